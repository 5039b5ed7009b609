"""Build the MCP server: tools with generated descriptions, the file resource, middleware.

``build_server`` is the one place that wires the SDK to the service. Tool descriptions
are generated from the settings, so what they promise (limits, lifetimes, network) is
always what this server does.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

from mcp.server import MCPServer
from mcp.server.context import ServerMiddleware
from mcp.server.subscriptions import InMemorySubscriptionBus
from mcp_types import ToolAnnotations

from mcp_code_sandbox import __version__
from mcp_code_sandbox.backends.bwrap.runtime import PACKAGES
from mcp_code_sandbox.metrics import Metrics
from mcp_code_sandbox.server.auth import ServerAuth
from mcp_code_sandbox.server.downloads import UrlSigner
from mcp_code_sandbox.server.notify import ToolListNotifier, advertise_tools_changed
from mcp_code_sandbox.server.resources import WorkspaceResources
from mcp_code_sandbox.server.tools import ToolSet
from mcp_code_sandbox.service import SandboxService
from mcp_code_sandbox.settings import Settings
from mcp_code_sandbox.workspace.pages import blob_page_bytes

__all__ = ["build_server", "descriptions"]

INSTRUCTIONS = (
    "Runs code in an isolated sandbox with a persistent session: files in /mnt/data and "
    "Python variables survive between run_code calls of one session_id. Upload data with "
    "upload_file, run code with run_code, fetch results with list_files and read_file."
)


def _size(n: int) -> str:
    for unit, factor in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= factor:
            return f"{n / factor:g} {unit}"
    return f"{n} bytes"


def descriptions(
    settings: Settings, languages: list[str] | None = None, http_base: str | None = None
) -> dict[str, str]:
    """Every tool's description, from the settings; ``http_base``: where the HTTP server
    serves files (``None`` over stdio, which has no file routes)."""
    net = (
        "Outbound network can be requested with network=true, or a list of hosts: HTTP and "
        "HTTPS only, through the server's egress proxy (HTTP_PROXY is set; DNS and raw "
        "sockets do not work), to the hosts its allowlist names ("
        + (", ".join(settings.network_allow) or "none yet")
        + "); a refused request gets a 403 and its host is listed in blocked_hosts. "
        "A session's sandbox is restarted when a call switches network on or off "
        "(files kept, variables lost; other hosts alone do not restart it), so keep "
        "network on for every call of a session that needs it. With network, `pip install` (or "
        "%pip), `npm install` and `bun add` work: packages go to /mnt/data/.packages, "
        "are importable by bare name for the rest of the session, count towards its "
        f"{_size(settings.workspace_quota_bytes)} quota, and are not listed as files."
        if settings.allow_network
        else "There is no network access (pip install will not work)."
    )
    pause = (
        f"A session idle for {_minutes(settings.pause_after_m)} is paused (its sandbox "
        "put away to disk) and the next call resumes it: `resumed` says how, `notice` "
        "what was not kept. "
        if settings.pause_after_m > 0
        else ""
    )
    life = (
        f"{pause}A session ends after {_minutes(settings.session_ttl_m)} without calls, or "
        f"{_minutes(settings.session_max_lifetime_h * 60)} after it started; then its files "
        "and variables are gone (list_sessions finds your sessions)."
    )
    offered = languages or ["python"]
    return {
        "run_code": (
            "Run code in a sandboxed session and return its output. The working directory "
            "is /mnt/data: the session's files, shared by all its languages (files created "
            "or changed there are listed in `files`, image files are returned as images). "
            "Python runs in a persistent IPython interpreter: variables and imports survive "
            "between calls with the same session_id; the value of the last expression is "
            "returned as `result`; every matplotlib figure comes back as an image. "
            f"Preinstalled: {_preinstalled(settings)}.{_other_languages(offered)} {net} Limits per "
            f"session: {_size(settings.memory_limit)} memory, {settings.cpu_limit:g} CPU, "
            f"{settings.exec_timeout_s:g} s per call by default (timeout_s up to "
            f"{settings.max_exec_timeout_s:g}), output beyond "
            f"{_size(settings.stream_bytes)} per stream is cut (the full text is saved "
            f"under /mnt/data/.outputs); a whole result is at most "
            f"{_size(settings.max_result_bytes)} and about {settings.max_result_tokens:,} "
            "tokens of text, and what does not fit (a huge value, "
            "error, display flood, thousands of files) is cut and said in `notice`. "
            f"{life} Failing code is a normal result with "
            "status 'error' and a traceback (for other languages: exit_code and stderr)."
        ),
        "upload_file": (
            "Write a file into a session's /mnt/data (creating the session if needed). "
            "Give content_text for text or content_base64 for binary, at most "
            f"{_size(settings.max_upload_bytes)}. Paths are relative to /mnt/data; "
            "existing files are kept unless overwrite=true."
            + (
                f" Larger files: HTTP PUT {http_base}/files/<session_id>/<path> with this "
                "server's bearer token (same limit and quota; ?overwrite=true)."
                if http_base
                else ""
            )
        ),
        "read_file": (
            "Read a file from a session's /mnt/data, a page at a time: text comes back as "
            f"text (pages of up to "
            f"{_size(min(settings.max_read_bytes, settings.result_text_bytes))}), images "
            "as images, "
            "other files as base64 in an embedded resource (pages of up to "
            f"{_size(blob_page_bytes(settings.max_read_bytes))}). A page that does not "
            "reach the end has next_offset: pass it as offset to get the rest."
        ),
        "list_files": "List files under a directory of a session's /mnt/data. A long "
        "listing comes in pages: call again with offset=next_offset until it is null. "
        "Saved full outputs (.outputs), installed packages (.packages) and saved "
        "variables (.session) are listed only when path names them.",
        "close_session": (
            "Close a session: stop its sandbox and delete its files. Do this when done."
        ),
        "restart_interpreter": (
            "Restart a session's Python interpreter, like Jupyter's Restart kernel: after "
            "a cell broke its state or to reload a changed module. Variables, imports and "
            "processes the session started are gone; files in /mnt/data are kept and the "
            "session id stays the same."
        ),
        "fork_session": (
            "Copy a session of yours into a new one: its files in /mnt/data (installed "
            "packages too) and its variables and imports; the session copied runs on "
            "untouched, and the two diverge from here. Open files, threads and running "
            "processes are not copied: notice names what was not. The new session counts "
            "toward your session limits."
        ),
        "list_sessions": (
            "List your sessions: id, when created and last active, state (running, or "
            "paused: idle, put away to disk, resumed by the next run_code), the size of "
            "its files, and the variables a paused session saved. Use it to find a "
            "session to come back to."
        ),
        "list_runtimes": (
            "List the languages run_code offers, with versions, preinstalled packages and "
            "the limits of every session."
        ),
        "export_notebook": (
            "Save a session's runs, in order, as a Jupyter notebook (.ipynb) in its "
            "/mnt/data: Python runs as code cells with their outputs, figures and errors; "
            "bash, JavaScript and TypeScript runs as %%bash / %%script cells. Replaces a "
            "file at that path. Returns its path"
            + (" and a download_url for the person you work for." if http_base else ".")
        ),
    }


def _minutes(minutes: float) -> str:
    """A span for a description: ``10 min``, ``7 days``, ``36 h``."""
    if minutes >= 24 * 60 and minutes % (24 * 60) == 0:
        days = minutes / (24 * 60)
        return f"{days:g} day" + ("s" if days != 1 else "")
    if minutes >= 120:
        return f"{minutes / 60:g} h"
    return f"{minutes:g} min"


def _preinstalled(settings: Settings) -> str:
    """The Python packages sandboxes have: ``SANDBOX_RUNTIME_PACKAGES`` where it is the
    whole list (the bwrap runtime env), DESIGN.md §3's list and it on Docker (the derived
    image adds it to the image's), else DESIGN.md §3's list alone."""
    if settings.runtime_packages and settings.backend != "docker":
        return ", ".join(settings.runtime_packages)
    extra = [p for p in settings.runtime_packages if p not in PACKAGES]
    return ", ".join((*PACKAGES, *extra))


#: What run_code's description says of each agent language but Python (runtimes.RUNTIMES).
_LANGUAGE_NOTES = {
    "javascript": "language='javascript': Node.js; the code runs as an ES module (import, "
    "top-level await) and require works too",
    "typescript": "language='typescript': TypeScript run from source by bun (import, "
    "require, top-level await)",
    "bash": "language='bash': a bash script",
}
_NPM = "pg, postgres, csv-parser and papaparse"


def _other_languages(languages: list[str]) -> str:
    notes = [_LANGUAGE_NOTES[lang] for lang in languages if lang in _LANGUAGE_NOTES]
    if any(lang in languages for lang in ("javascript", "typescript")):
        notes.append(
            f"for JavaScript and TypeScript {_NPM} are preinstalled, imported by bare name"
        )
    text = f" {'; '.join(notes)}." if notes else ""
    if notes:
        text += " These run as a new process per call: their variables do not survive, files do."
    if any(lang in languages for lang in ("javascript", "typescript")):
        text += " A JavaScript or TypeScript program's last expression is its `result`."
    runners = [lang for lang in languages if lang != "python" and lang not in _LANGUAGE_NOTES]
    if runners:
        text += f" Other languages (language=...): {', '.join(runners)}; see list_runtimes."
    return text


def build_server(
    service: SandboxService, auth: ServerAuth | None = None, signer: UrlSigner | None = None
) -> MCPServer[Any]:
    """The MCP server for ``service``; the caller starts and closes the service.

    ``auth``: how HTTP callers authenticate (``auth.build_auth``); None for stdio and for
    an unauthenticated HTTP server. ``signer``: signs the download links results carry,
    given by the HTTP app, which serves them (``None`` over stdio: no links)."""
    settings = service.settings
    bus = InMemorySubscriptionBus()
    mcp: MCPServer[Any] = MCPServer(
        "mcp-code-sandbox",
        version=__version__,
        instructions=INSTRUCTIONS,
        log_level=settings.log_level,
        subscriptions=bus,
        auth=None if auth is None else auth.settings,
        token_verifier=None if auth is None else auth.verifier,
    )
    tools = ToolSet(service, signer)
    http_base = signer.base_url if signer else None
    _register_tools(mcp, tools, service.languages(), http_base)
    WorkspaceResources(service, signer).install(mcp)
    notifier = ToolListNotifier(bus)
    advertise_tools_changed(mcp)
    mcp.middleware.append(notifier.middleware)
    mcp.middleware.append(_error_counter(service.metrics))  # outside: sees the final code
    mcp.middleware.append(_argument_errors)

    async def languages_changed(languages: list[str]) -> None:
        _register_tools(mcp, tools, languages, http_base, again=True)
        await notifier.tools_changed()

    service.on_languages_changed.append(languages_changed)
    return mcp


def _hints(*, read_only: bool, destructive: bool, idempotent: bool) -> ToolAnnotations:
    return ToolAnnotations(
        read_only_hint=read_only, destructive_hint=destructive,
        idempotent_hint=idempotent, open_world_hint=False,
    )  # fmt: skip


def _register_tools(
    mcp: MCPServer[Any],
    tools: ToolSet,
    languages: list[str],
    http_base: str | None,
    *,
    again: bool = False,
) -> None:
    """Register the tools with ``languages`` in run_code's schema (the ``language``
    enum) and description; ``again``: replace the ones registered before.

    The SDK builds a tool's schema once, from its signature, at ``add_tool``: so run_code
    is registered with the enum already in its signature (``ToolSet.run_code_tool``),
    and all of them again when the languages change, in the same order, through the SDK's
    public ``remove_tool``/``add_tool`` (no await between them: no call sees a gap).
    The enum only advertises: a language not offered is refused by the service with
    ``unsupported_language``, whatever a client sends."""
    settings = tools.settings
    text = descriptions(settings, languages, http_base)
    readonly = _hints(read_only=True, destructive=False, idempotent=True)
    run_hints = _hints(read_only=False, destructive=False, idempotent=False)
    # The network is the only "open world" a run can reach, and only where it is allowed.
    run_hints.open_world_hint = settings.allow_network
    table: list[tuple[Callable[..., Any], str, str, ToolAnnotations]] = [
        (tools.run_code_tool(languages), "run_code", "Run code", run_hints),
        (tools.upload_file, "upload_file", "Upload a file",
         _hints(read_only=False, destructive=True, idempotent=True)),
        (tools.read_file, "read_file", "Read a file", readonly),
        (tools.list_files, "list_files", "List files", readonly),
        (tools.close_session, "close_session", "Close a session",
         _hints(read_only=False, destructive=True, idempotent=False)),
        (tools.restart_interpreter, "restart_interpreter", "Restart the interpreter",
         _hints(read_only=False, destructive=True, idempotent=True)),
        (tools.fork_session, "fork_session", "Fork a session",
         _hints(read_only=False, destructive=False, idempotent=False)),
        (tools.list_sessions, "list_sessions", "List your sessions", readonly),
        (tools.list_runtimes, "list_runtimes", "List runtimes", readonly),
        (tools.export_notebook, "export_notebook", "Export the session as a notebook",
         _hints(read_only=False, destructive=True, idempotent=True)),
    ]  # fmt: skip
    for fn, name, title, tool_hints in table:
        if again:
            mcp.remove_tool(name)
        mcp.add_tool(fn, name=name, title=title, description=text[name], annotations=tool_hints)


def _error_counter(metrics: Metrics) -> ServerMiddleware[Any]:
    """Count every failed tool call by its ``_meta.error_code`` (``tool_errors`` and
    ``_argument_errors`` put one on each)."""

    async def count(ctx: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
        result = await call_next(ctx)
        failed = isinstance(result, dict) and result.get("isError")
        if failed and getattr(ctx, "method", None) == "tools/call":
            metrics.tool_error(str((result.get("_meta") or {}).get("error_code")))
        return result

    return count


_PYDANTIC_LINK = re.compile(r"\s*For further information visit \S+")


async def _argument_errors(ctx: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
    """Give the SDK's own tool failures (bad arguments, unknown tool) our error shape."""
    result = await call_next(ctx)
    if getattr(ctx, "method", None) != "tools/call" or not isinstance(result, dict):
        return result
    if not result.get("isError") or (result.get("_meta") or {}).get("error_code"):
        return result
    content = result.get("content") or [{}]
    text = str(content[0].get("text", "")) if isinstance(content[0], dict) else ""
    text = _PYDANTIC_LINK.sub("", text).replace("Error executing tool ", "tool ")
    code = "invalid_argument"
    result = dict(result)
    result["content"] = [{"type": "text", "text": f"{code}: {text}"}]
    result["_meta"] = {**(result.get("_meta") or {}), "error_code": code}
    return result
