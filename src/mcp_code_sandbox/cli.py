"""``mcp-code-sandbox``: argv → settings → one of serve, setup, doctor, exec, image build.

Every setting of :class:`~mcp_code_sandbox.settings.Settings` is also a flag
(``--memory-limit 1g`` is ``SANDBOX_MEMORY_LIMIT=1g``); flags win over the environment.
Human output goes to stderr except where a command's result is its output (``doctor``,
``exec``); ``serve`` never writes to stdout, which stdio mode reserves for the protocol.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog

from mcp_code_sandbox import __version__
from mcp_code_sandbox.errors import SandboxError
from mcp_code_sandbox.settings import (
    ConfigError,
    Settings,
    load_settings,
    otlp_configured,
    unknown_variables,
)

__all__ = ["default_command", "main"]


def _add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, in the README's groups, each with its meaning and default."""
    from mcp_code_sandbox.cli_help import GROUPS, default_text

    for title, entries in GROUPS:
        group = parser.add_argument_group(f"{title} (also SANDBOX_<NAME> variables)")
        for name, meaning, default in entries:
            field = Settings.model_fields[name]
            flag = "--" + name.replace("_", "-")
            shown = f"{meaning} (default: {default or default_text(name)})".replace("%", "%%")
            if typing.get_origin(field.annotation) is None and field.annotation is bool:
                group.add_argument(
                    flag, dest=name, default=None, action=argparse.BooleanOptionalAction,
                    help=shown,
                )  # fmt: skip
            else:
                group.add_argument(flag, dest=name, default=None, metavar=name.upper(), help=shown)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mcp-code-sandbox",
        description="MCP server that runs LLM-written code in isolated, stateful sandboxes.",
    )
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="serve MCP over stdio (default) or HTTP; the command when none is given",
        usage="mcp-code-sandbox serve [--transport {stdio,http}] [--SETTING VALUE ...]",
    )
    serve.add_argument(
        "--transport",
        choices=("stdio", "http"),
        default="stdio",
        help="stdio (what a client starts) or http (default: stdio)",
    )
    # The spellings of --http-host/--http-port before 0.x, kept working (scripts and
    # service files pass them), not shown: one flag per setting.
    serve.add_argument("--host", dest="http_host", default=None, help=argparse.SUPPRESS)
    serve.add_argument("--port", dest="http_port", default=None, help=argparse.SUPPRESS)
    setup = sub.add_parser("setup", help="build the sandbox runtime environment (bwrap)")
    setup.add_argument("--force", action="store_true", help="rebuild even if up to date")
    setup.add_argument(
        "--node",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also build Node.js and bun for JavaScript and TypeScript (default: yes)",
    )
    setup.add_argument(
        "--apparmor",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="as root, where AppArmor forbids unprivileged user namespaces (Ubuntu >= "
        "23.10), write a profile that lets bwrap create them (default: yes)",
    )
    sub.add_parser("doctor", help="check each backend and say what is enforced")
    run = sub.add_parser("exec", help="run code once in a fresh sandbox and print the result")
    run.add_argument("code", nargs="?", help="the code (or use --file)")
    run.add_argument("--file", type=Path, help="read the code from this file")
    run.add_argument("--language", default="python")
    image = sub.add_parser("image", help="manage the sandbox image (docker backend)")
    image_sub = image.add_subparsers(dest="image_command", required=True)
    build = image_sub.add_parser("build", help="build the default sandbox image")
    build.add_argument(
        "--base",
        default=None,
        help="base image (default: python:3.11-slim, "
        "or a Debian base bootstrapped locally when it cannot be pulled)",
    )
    build.add_argument(
        "--ca-bundle",
        type=Path,
        default=None,
        help="CA bundle used during "
        "the build only (default: $PIP_CERT, $SSL_CERT_FILE, $REQUESTS_CA_BUNDLE)",
    )
    build.add_argument(
        "--server",
        action="store_true",
        help="build the server's own image (images/server.Dockerfile, for deploy/compose.yaml) "
        "instead of the sandbox image",
    )
    build.add_argument(
        "--tag",
        default=None,
        help="image tag (default: SANDBOX_IMAGE; with --server mcp-code-sandbox-server:latest)",
    )
    kubernetes = sub.add_parser("kubernetes", help="what the Kubernetes backend needs")
    kubernetes_sub = kubernetes.add_subparsers(dest="kubernetes_command", required=True)
    certs = kubernetes_sub.add_parser(
        "certs",
        help="write the agent channel's CA and server certificate (ca.crt, ca.key, "
        "server.crt, server.key); an existing CA in DIR is kept and a new server "
        "certificate issued",
    )
    certs.add_argument("--out", type=Path, required=True, metavar="DIR")
    for p in (serve, setup, sub.choices["doctor"], run, build):
        _add_setting_flags(p)
    return parser


def default_command(argv: Sequence[str]) -> list[str]:
    """``argv`` with ``serve`` put first when it names no command (nothing, or only
    flags): ``uvx mcp-code-sandbox`` is the line MCP clients are given."""
    args = list(argv)
    if not args or (args[0].startswith("-") and args[0] not in ("-h", "--help", "--version")):
        return ["serve", *args]
    return args


def _settings(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {
        name: getattr(args, name) for name in Settings.model_fields if hasattr(args, name)
    }
    return load_settings(overrides)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(default_command(sys.argv[1:] if argv is None else argv))
    if args.command == "kubernetes":  # no settings: files only
        return _kubernetes_certs(args.out)
    try:
        settings = _settings(args)
    except ConfigError as exc:
        for line in exc.lines:
            print(line, file=sys.stderr)
        return 2
    from mcp_code_sandbox.logs import configure_logging

    if args.command == "exec" and "log_level" not in settings.model_fields_set:
        # A person trying code by hand wants its output, not the server's INFO lines.
        settings = settings.model_copy(update={"log_level": "WARNING"})
    configure_logging(settings)
    for line in unknown_variables():
        structlog.get_logger("mcp_code_sandbox.cli").warning(line)
    try:
        if args.command == "serve":
            return _serve(settings, args.transport)
        if args.command == "setup":
            return _setup(settings, force=args.force, node=args.node, apparmor=args.apparmor)
        if args.command == "image":
            return _image_build(settings, args)
        if args.command == "doctor":
            from mcp_code_sandbox.doctor.report import run_doctor

            return run_doctor(settings)
        return _exec(settings, args)
    except ConfigError as exc:
        for line in exc.lines:
            print(line, file=sys.stderr)
        return 2
    except SandboxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _kubernetes_certs(out: Path) -> int:
    from mcp_code_sandbox.backends.kubernetes.certs import write_certs

    try:
        files = write_certs(out)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    ca = "kept the CA in" if files.kept_ca else "wrote a new CA to"
    print(f"{ca} {files.ca_cert} and {files.ca_key}; keep ca.key out of the cluster")
    print(f"wrote {files.server_cert} and {files.server_key} for the servers (a Secret)")
    return 0


def _serve(settings: Settings, transport: str) -> int:
    from mcp_code_sandbox.backends import choose_backend
    from mcp_code_sandbox.server.auth import build_auth
    from mcp_code_sandbox.server.first_run import runtime_preparation
    from mcp_code_sandbox.server.transports import (
        bind_http,
        check_http_exposure,
        serve_http,
        serve_stdio,
    )
    from mcp_code_sandbox.service import SandboxService
    from mcp_code_sandbox.sessions.holder import Role, refused

    if settings.keep_sessions_on_shutdown is None:  # HTTP keeps sessions; stdio does not
        settings = settings.model_copy(update={"keep_sessions_on_shutdown": transport == "http"})
    # The state directory's one service (HTTP, or a server told to keep its sessions)
    # takes over what its predecessor left; any other server holds only its own.
    service_role = transport == "http" or settings.keep_sessions_on_shutdown
    role = Role.SERVICE if service_role else Role.PRIVATE
    if settings.replica and role is not Role.SERVICE:
        raise ConfigError(["SANDBOX_REPLICA needs --transport http: replicas serve HTTP"])
    if role is Role.SERVICE and (line := refused(settings.run_dir, replica=settings.replica)):
        raise ConfigError([line])  # before any port or sandbox
    sock = None
    if transport == "http":  # refuse an open bind, bad tokens or a busy port first
        check_http_exposure(settings)
        build_auth(settings)
        sock = bind_http(settings)
    backend, why = choose_backend(settings)
    if settings.replica and backend.name != "docker":
        raise ConfigError(
            [
                f"SANDBOX_REPLICA needs the docker backend, not {backend.name}: its sandboxes "
                "are children of one server process, so a server on it stays alone on its "
                "state directory"
            ]
        )
    where = "stdio" if sock is None else f"http://{settings.http_host}:{settings.http_port}/mcp"
    structlog.get_logger("mcp_code_sandbox.cli").info(f"serving MCP on {where}; backend {why}")
    # No runtime env yet (a first `uvx mcp-code-sandbox`): serve at once, build it beside.
    service = SandboxService(
        settings,
        backend,
        runtime_preparation(settings, backend),
        role=role,
        janitor=role is Role.PRIVATE,
        replica=settings.replica,
    )
    if otlp_configured():
        from mcp_code_sandbox import tracing

        if (warning := tracing.configure(service.sessions.instance)) is not None:
            structlog.get_logger("mcp_code_sandbox.cli").warning(warning)
    try:
        if sock is None:
            asyncio.run(serve_stdio(service))
        else:
            asyncio.run(serve_http(service, sock))
    finally:
        if otlp_configured():
            from mcp_code_sandbox import tracing

            tracing.shutdown()
    return 0


def _setup(settings: Settings, *, force: bool, node: bool = True, apparmor: bool = True) -> int:
    from mcp_code_sandbox.provision.apparmor import allow_bwrap_userns
    from mcp_code_sandbox.provision.venv import build_runtime

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if apparmor:  # not in the server's background build (--no-apparmor): it changes the host
        allow_bwrap_userns(progress)
    status = build_runtime(settings, force=force, progress=progress, node=node)
    js = status.node
    languages = f", Node.js {js.node}, bun {js.bun}" if js else ", no JavaScript/TypeScript"
    if not node and js is None:
        languages = ", Node.js not built (--no-node)"
    print(
        f"runtime environment ready: {status.venv} (Python {status.python_version}{languages})",
        file=sys.stderr,
    )
    return 0


def _image_build(settings: Settings, args: argparse.Namespace) -> int:
    from mcp_code_sandbox.provision.image import build_image, build_packages_image
    from mcp_code_sandbox.settings import ca_bundle_from_env

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    ca_bundle = args.ca_bundle or ca_bundle_from_env()
    built = build_image(
        settings,
        base=args.base,
        ca_bundle=ca_bundle,
        tag=args.tag,
        progress=progress,
        server=args.server,
    )
    if not args.server:  # and on it, the image with SANDBOX_RUNTIME_PACKAGES, if any
        build_packages_image(settings, base=built.tag, ca_bundle=ca_bundle, progress=progress)
    return 0


def _exec(settings: Settings, args: argparse.Namespace) -> int:
    if args.file is not None:
        code = args.file.read_text(encoding="utf-8")
    elif args.code is not None:
        code = args.code
    else:
        code = sys.stdin.read()
    return asyncio.run(_exec_once(settings, code, args.language))


async def _exec_once(settings: Settings, code: str, language: str) -> int:
    from mcp_code_sandbox.backends import create_backend
    from mcp_code_sandbox.run.request import RunRequest
    from mcp_code_sandbox.service import SandboxService
    from mcp_code_sandbox.sessions.holder import Role

    # Private: it never takes over a service's sessions, and a janitor cleans up after
    # it if it is killed.
    service = SandboxService(settings, create_backend(settings), role=Role.PRIVATE, janitor=True)
    await service.start()
    try:
        report = await service.run_code("local", RunRequest(code, language))
    finally:
        await service.aclose()
    sys.stdout.write(report.stdout)
    sys.stderr.write(report.stderr)
    if report.result is not None:
        print(f"Out[{report.execution_count}]: {report.result}")
    if report.error:
        print(
            report.error.get("traceback") or f"{report.error['name']}: {report.error['value']}",
            file=sys.stderr,
        )
    for display in report.displays:
        if display.source == "figure" and not display.mime_type.startswith("image/"):
            continue
        print(
            f"[{display.source}: {display.mime_type}, {len(display.data)} bytes]", file=sys.stderr
        )
    if report.status != "ok":
        print(f"status: {report.status}", file=sys.stderr)
    return 0 if report.status == "ok" else 1
