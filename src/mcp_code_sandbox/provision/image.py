"""``mcp-code-sandbox image build``: the default sandbox image, with or without a registry.

The image is ``images/Dockerfile`` built on a base given by the ``BASE`` build argument:

``--base IMAGE`` (pulled if not local; failing is an error), else the first of: a local
:data:`OFFICIAL_BASE`, a local :data:`LOCAL_BASE`, :data:`OFFICIAL_BASE` pulled, and (no
registry: air-gapped hosts, CI) a Debian base bootstrapped here with ``debootstrap`` from
the mirror of the host's apt sources, imported as :data:`LOCAL_BASE`. A local base is never
pulled again: rebuilds reuse the engine's cached layers and never wait for a registry.

The build context is assembled under ``<state_dir>/images/context``: the Dockerfile, a
``requirements.txt`` generated from
:data:`~mcp_code_sandbox.backends.bwrap.runtime.PACKAGES` (the one list of packages, shared
with the bwrap runtime), ``node_env.py`` (a copy of :mod:`.node`,
which builds ``/opt/sandbox/node``, run in a build stage with Debian's npm: the image needs
no npm on the host), a copy of the agent package as ``mcs_agent/`` and ``build-ca/`` holding the CA
bundle, if any. The bundle only enters the build stages; the final stage copies the
finished trees, never the bundle. The npm registry is the host's (``npm config get
registry``, passed as the ``NPM_REGISTRY`` build argument) when the host has npm, else
npm's own default; so is the CA bundle (npm's ``cafile``) when no other is given.

docker-py does all engine work (pull, import, build): it speaks to whatever ``DOCKER_HOST``
names (Podman's socket too) and its classic build API needs no BuildKit or buildx, which
Debian's docker.io lacks. Its errors become :class:`BackendUnavailable` in
:func:`_engine_errors`, and nowhere else. ``debootstrap`` and ``tar`` run as programs.

``build_image(..., server=True)`` builds the server's own image the same way (same base,
same CA handling) from the context :func:`.server_image.prepare_server_context` assembles.

Semantics: progress lines go to ``progress`` (the CLI writes them to stderr), never stdout.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mcp_code_sandbox import agent
from mcp_code_sandbox.backends.bwrap.runtime import PACKAGES
from mcp_code_sandbox.backends.docker.derived import dockerfile as derived_dockerfile
from mcp_code_sandbox.backends.docker.derived import packages_tag
from mcp_code_sandbox.errors import BackendUnavailable
from mcp_code_sandbox.provision import node
from mcp_code_sandbox.provision.common import (
    Progress,
    copy_ca_bundle,
    copy_tree,
    run_streaming,
    stderr_progress,
)
from mcp_code_sandbox.provision.server_image import SERVER_TAG, prepare_server_context
from mcp_code_sandbox.provision.venv import SESSION_SITE_PTH, TOOLS
from mcp_code_sandbox.settings import Settings

__all__ = [
    "BOOTSTRAP_SUITE",
    "LOCAL_BASE",
    "OFFICIAL_BASE",
    "AptSource",
    "BuildResult",
    "apt_sources",
    "build_image",
    "build_kwargs",
    "build_packages_image",
    "choose_mirror",
    "debootstrap_argv",
    "find_mirror",
    "host_npm_config",
    "parse_deb822",
    "parse_one_line",
    "prepare_context",
    "requirements_text",
]

OFFICIAL_BASE = "python:3.11-slim"
#: Debian 12: Python 3.11, as the official base and the bwrap runtime's minimum.
BOOTSTRAP_SUITE = "bookworm"
LOCAL_BASE = f"mcp-code-sandbox-base:{BOOTSTRAP_SUITE}"
_DEBIAN_SUITES = frozenset({"bullseye", "bookworm", "trixie", "forky", "sid", "stable", "testing"})
#: Environment variables naming a CA bundle, in the order they are consulted.


@dataclass(frozen=True)
class AptSource:
    """One ``deb`` entry of the host's apt configuration."""

    uri: str
    suites: tuple[str, ...]
    components: tuple[str, ...]


@dataclass(frozen=True)
class BuildResult:
    tag: str
    image_id: str
    base: str
    #: Seconds per phase that ran (``debootstrap``, ``import``, ``build``); a skipped phase
    #: is absent, not zero.
    timings: dict[str, float] = field(default_factory=dict)


def requirements_text(packages: Sequence[str] = (*PACKAGES, *TOOLS)) -> str:
    """``requirements.txt`` for the image: one package a line, as the bwrap runtime has."""
    return "".join(f"{name}\n" for name in packages)


#: The engine colours a build step's stderr (``ESC[91m``); progress lines are plain text.
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_ONE_LINE = re.compile(r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+(\S+)((?:\s+\S+)*)\s*$")


def parse_one_line(text: str) -> list[AptSource]:
    """The ``deb`` lines of a ``sources.list`` file (``deb-src`` and comments skipped)."""
    found: list[AptSource] = []
    for raw in text.splitlines():
        match = _ONE_LINE.match(raw.split("#", 1)[0].strip())
        if match:
            uri, suite, components = match.groups()
            found.append(AptSource(uri, (suite,), tuple(components.split())))
    return found


def _stanzas(text: str) -> Iterator[dict[str, str]]:
    fields: dict[str, str] = {}
    last = ""
    for line in [*text.splitlines(), ""]:
        if line.startswith("#"):
            continue
        if not line.strip():
            if fields:
                yield fields
            fields, last = {}, ""
        elif line[0].isspace() and last:  # a continuation line (Signed-By key blocks)
            fields[last] += "\n" + line.strip()
        elif ":" in line:
            name, value = line.split(":", 1)
            last = name.strip().lower()
            fields[last] = value.strip()


def parse_deb822(text: str) -> list[AptSource]:
    """The enabled ``deb`` stanzas of a deb822 ``.sources`` file, one entry per URI."""
    found: list[AptSource] = []
    for stanza in _stanzas(text):
        if "deb" not in stanza.get("types", "").split():
            continue
        if stanza.get("enabled", "yes").lower() == "no":
            continue
        suites = tuple(stanza.get("suites", "").split())
        components = tuple(stanza.get("components", "").split())
        found.extend(AptSource(uri, suites, components) for uri in stanza.get("uris", "").split())
    return found


def apt_sources(apt_dir: Path = Path("/etc/apt")) -> list[AptSource]:
    """Every ``deb`` source of the host: ``sources.list`` first, then ``sources.list.d``."""
    found: list[AptSource] = []
    main = apt_dir / "sources.list"
    with contextlib.suppress(OSError):
        found += parse_one_line(main.read_text(encoding="utf-8", errors="replace"))
    parts = apt_dir / "sources.list.d"
    files = sorted(parts.iterdir()) if parts.is_dir() else []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        if path.suffix == ".list":
            found += parse_one_line(text)
        elif path.suffix == ".sources":
            found += parse_deb822(text)
    return found


def choose_mirror(sources: Sequence[AptSource], suite: str = BOOTSTRAP_SUITE) -> str | None:
    """The Debian mirror to bootstrap ``suite`` from; ``None`` when the host names none.

    Preferred: a source of ``suite`` itself with ``main``; else one of any Debian release
    with ``main`` (a mirror carries every release). Security, update and backport suites,
    and third-party repositories (their suites are not Debian releases), are never chosen.
    """
    usable = [
        s
        for s in sources
        if "main" in s.components and s.uri.split(":", 1)[0] in {"http", "https", "ftp", "file"}
    ]
    for wanted in ({suite}, _DEBIAN_SUITES):
        for source in usable:
            if wanted.intersection(source.suites):
                return source.uri.rstrip("/")
    return None


def find_mirror(apt_dir: Path = Path("/etc/apt"), suite: str = BOOTSTRAP_SUITE) -> str:
    mirror = choose_mirror(apt_sources(apt_dir), suite)
    if mirror is None:
        raise BackendUnavailable(
            f"no Debian mirror in {apt_dir}/sources.list(.d) to bootstrap a {suite} base "
            f"from; pass --base with an image that has Python >= 3.11 and its venv module"
        )
    return mirror


def debootstrap_argv(target: Path, mirror: str, suite: str = BOOTSTRAP_SUITE) -> list[str]:
    return [
        _debootstrap_program(),
        "--variant=minbase",
        "--include=python3,python3-venv,ca-certificates",
        suite,
        str(target),
        mirror,
    ]


def host_npm_config(
    npm: str | None, run: Callable[[list[str]], str | None] | None = None
) -> dict[str, str]:
    """The host npm's ``registry`` and ``cafile`` (those it sets), for the image build.

    ``run`` returns a command's stdout, ``None`` when it failed (a test seam)."""
    if npm is None:
        return {}
    run = run or _stdout_of
    found: dict[str, str] = {}
    for key in ("registry", "cafile"):
        value = (run([npm, "config", "get", key]) or "").strip()
        if value and value not in ("null", "undefined"):
            found[key] = value
    return found


def _stdout_of(argv: list[str]) -> str | None:
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=60, check=False, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def build_kwargs(
    context: Path, tag: str, base: str, npm_registry: str | None = None
) -> dict[str, Any]:
    """Keyword arguments of docker-py's ``APIClient.build`` for the image."""
    return {
        "path": str(context),
        "tag": tag,
        # NPM_REGISTRY unset: npm's own default (the Dockerfile's ARG is empty).
        "buildargs": {"BASE": base, **({"NPM_REGISTRY": npm_registry} if npm_registry else {})},
        "pull": False,  # the base is local by now; never ask a registry again
        "rm": True,
        "forcerm": True,
        "decode": True,
    }


def _dockerfile() -> Path:
    pkg = Path(__file__).resolve().parents[1]  # mcp_code_sandbox/
    # A wheel carries it as package data; a checkout (editable install) has images/.
    for candidate in (pkg / "_images" / "Dockerfile", pkg.parents[1] / "images" / "Dockerfile"):
        if candidate.is_file():
            return candidate
    raise BackendUnavailable("images/Dockerfile is missing from this installation")


def prepare_context(context: Path, ca_bundle: Path | None) -> None:
    """Fill ``context`` (emptied first) with what ``images/Dockerfile`` copies."""
    shutil.rmtree(context, ignore_errors=True)
    context.mkdir(parents=True)
    shutil.copyfile(_dockerfile(), context / "Dockerfile")
    (context / "requirements.txt").write_text(requirements_text(), encoding="utf-8")
    pth_name, pth_text = SESSION_SITE_PTH
    (context / pth_name).write_text(pth_text, encoding="utf-8")
    (context / "node_env.py").write_bytes(Path(node.__file__).read_bytes())
    copy_tree(Path(agent.__file__).resolve().parent, context / "mcs_agent")
    copy_ca_bundle(context, ca_bundle)


@contextlib.contextmanager
def _engine_errors(what: str) -> Iterator[None]:
    """The one place docker-py's (and requests') exceptions become ours."""
    import docker.errors
    import requests.exceptions

    try:
        yield
    except (docker.errors.DockerException, requests.exceptions.RequestException) as exc:
        raise BackendUnavailable(f"{what}: {exc}") from None


def _client() -> Any:
    import docker

    with _engine_errors("cannot reach the Docker engine (is it running? DOCKER_HOST?)"):
        client = docker.from_env(timeout=600)
        client.ping()
    return client


def _has_image(client: Any, name: str) -> bool:
    import docker.errors

    with _engine_errors(f"cannot look up {name}"):
        try:
            client.images.get(name)
        except docker.errors.ImageNotFound:
            return False
    return True


def _pull(client: Any, name: str, progress: Progress) -> None:
    repository, _, tag = name.partition(":")
    progress(f"pulling {name}")
    with _engine_errors(f"cannot pull {name}"):
        for event in client.api.pull(repository, tag or "latest", stream=True, decode=True):
            if "error" in event:
                raise BackendUnavailable(f"cannot pull {name}: {event['error']}")
            if event.get("status") and "progress" not in event:
                progress(f"  {event.get('id', '')} {event['status']}".rstrip())


def _debootstrap_program() -> str:
    return shutil.which("debootstrap") or "/usr/sbin/debootstrap"


def _bootstrap_base(client: Any, work: Path, progress: Progress, timings: dict[str, float]) -> None:
    """Bootstrap :data:`BOOTSTRAP_SUITE` into ``work`` and import it as :data:`LOCAL_BASE`."""
    if os.geteuid() != 0:
        raise BackendUnavailable(
            "no base image can be pulled and bootstrapping a Debian base needs root: "
            "run `sudo mcp-code-sandbox image build`, or pass --base with a local image"
        )
    if not Path(_debootstrap_program()).exists():
        raise BackendUnavailable("debootstrap is missing: apt-get install debootstrap")
    mirror = find_mirror()
    rootfs, tarball = work / f"{BOOTSTRAP_SUITE}-rootfs", work / f"{BOOTSTRAP_SUITE}.tar"
    shutil.rmtree(rootfs, ignore_errors=True)  # a failed earlier attempt
    progress(f"bootstrapping Debian {BOOTSTRAP_SUITE} from {mirror} into {rootfs}")
    started = time.monotonic()
    try:
        run_streaming(debootstrap_argv(rootfs, mirror), progress, "debootstrap")
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for entry in (rootfs / cache).glob("*"):
                if entry.is_file():
                    entry.unlink()
        timings["debootstrap"] = time.monotonic() - started
        progress(f"importing it as {LOCAL_BASE}")
        started = time.monotonic()
        run_streaming(
            ["tar", "-C", str(rootfs), "--numeric-owner", "-cf", str(tarball), "."], progress, "tar"
        )
        repository, _, tag = LOCAL_BASE.partition(":")
        with _engine_errors(f"cannot import {LOCAL_BASE}"):
            client.api.import_image_from_file(
                str(tarball),
                repository=repository,
                tag=tag,
                changes=['CMD ["/bin/sh"]', "ENV LANG=C.UTF-8"],
            )
        timings["import"] = time.monotonic() - started
    finally:
        tarball.unlink(missing_ok=True)
        shutil.rmtree(rootfs, ignore_errors=True)


def _choose_base(
    client: Any, base: str | None, work: Path, progress: Progress, timings: dict[str, float]
) -> str:
    if base is not None:
        if not _has_image(client, base):
            _pull(client, base, progress)
        return base
    for local in (OFFICIAL_BASE, LOCAL_BASE):
        if _has_image(client, local):
            progress(f"using the local base image {local}")
            return local
    try:
        _pull(client, OFFICIAL_BASE, progress)
        return OFFICIAL_BASE
    except BackendUnavailable as exc:  # no registry: make a base here
        progress(f"{exc.message.splitlines()[0]}; bootstrapping a Debian base locally")
    _bootstrap_base(client, work, progress, timings)
    return LOCAL_BASE


def _build(client: Any, kwargs: dict[str, Any], progress: Progress) -> str:
    image_id = ""
    with _engine_errors("the image build failed"):
        for event in client.api.build(**kwargs):
            if "error" in event:
                raise BackendUnavailable(f"the image build failed: {event['error'].strip()}")
            if text := _ANSI.sub("", event.get("stream", "")).rstrip():
                progress("  " + text)
            if aux := event.get("aux"):
                image_id = str(aux.get("ID", image_id))
    return image_id


def _versions_code(packages: Sequence[str]) -> str:
    """Prints ``{package: version}`` of ``packages``, run in the built image."""
    return (
        "import json, importlib.metadata as m; "
        f"print(json.dumps({{p: m.version(p) for p in {list(packages)!r}}}))"
    )


def _label_packages(
    client: Any, kwargs: dict[str, Any], progress: Progress, packages: Sequence[str] = PACKAGES
) -> str | None:
    """Label the image just built with its packages' versions (``sandbox.packages``, what
    ``list_runtimes`` shows, as the bwrap runtime's manifest does): asked of the image
    itself, then the same build again with the label (every layer cached). ``None`` (and
    said) when the image does not answer: the image works without the label."""
    try:
        out = client.containers.run(
            kwargs["tag"],
            entrypoint=["/opt/sandbox/venv/bin/python", "-I", "-c", _versions_code(packages)],
            command=[],
            network_disabled=True,
            remove=True,
            user="1000:1000",
        )
        versions = json.loads(out)
        if not isinstance(versions, dict):
            raise ValueError("not an object")
    except Exception as exc:  # docker-py's, or the output's: the label is optional
        progress(f"package versions not read from the image ({exc}); not labelled")
        return None
    label = json.dumps({str(k): str(v) for k, v in versions.items()}, sort_keys=True)
    return _build(client, {**kwargs, "labels": {"sandbox.packages": label}}, progress)


def build_image(
    settings: Settings,
    *,
    base: str | None = None,
    ca_bundle: Path | None = None,
    tag: str | None = None,
    progress: Progress = stderr_progress,
    server: bool = False,
) -> BuildResult:
    """Build the sandbox image as ``tag`` (default ``settings.image``), or with ``server``
    the server's image (default :data:`.server_image.SERVER_TAG`); see the module doc."""
    tag = tag or (SERVER_TAG if server else settings.image)
    work = settings.state_dir / "images"
    context = work / ("server-context" if server else "context")
    timings: dict[str, float] = {}
    npm = host_npm_config(shutil.which("npm"))
    if ca_bundle is None and "cafile" in npm:
        ca_bundle = Path(npm["cafile"])
    client = _client()
    try:
        work.mkdir(parents=True, exist_ok=True)
        chosen = _choose_base(client, base, work, progress, timings)
        (prepare_server_context if server else prepare_context)(context, ca_bundle)
        if ca_bundle is not None:
            progress(f"using the CA bundle {ca_bundle} during the build only")
        progress(f"building {tag} on {chosen}")
        started = time.monotonic()
        # The server's Dockerfile runs no npm: no NPM_REGISTRY (an unused build argument
        # is a warning of the engine's).
        registry = None if server else npm.get("registry")
        kwargs = build_kwargs(context, tag, chosen, registry)
        image_id = _build(client, kwargs, progress)
        if not server:
            image_id = _label_packages(client, kwargs, progress) or image_id
        timings["build"] = time.monotonic() - started
    except OSError as exc:
        raise BackendUnavailable(f"cannot build the image: {exc}") from None
    finally:
        shutil.rmtree(context, ignore_errors=True)
        client.close()
    summary = ", ".join(f"{k} {v:.1f}s" for k, v in timings.items())
    progress(f"built {tag} ({image_id[:19] or 'id unknown'}) on {chosen}: {summary}")
    return BuildResult(tag, image_id, chosen, timings)


def build_packages_image(
    settings: Settings,
    *,
    base: str | None = None,
    ca_bundle: Path | None = None,
    progress: Progress = stderr_progress,
) -> BuildResult | None:
    """Build the image with ``SANDBOX_RUNTIME_PACKAGES`` on top of ``base`` (default
    ``settings.image``), tagged as :func:`.derived.packages_tag` names it; ``None`` when
    the setting names no packages (see :mod:`..backends.docker.derived`)."""
    packages = settings.runtime_packages
    if not packages:
        return None
    base = base or settings.image
    tag = packages_tag(base, packages)
    context = settings.state_dir / "images" / "packages-context"
    client = _client()
    started = time.monotonic()
    try:
        shutil.rmtree(context, ignore_errors=True)
        context.mkdir(parents=True)
        copy_ca_bundle(context, ca_bundle)
        (context / "Dockerfile").write_text(derived_dockerfile(base, packages), encoding="utf-8")
        progress(f"building {tag}: {base} with {', '.join(packages)} (SANDBOX_RUNTIME_PACKAGES)")
        kwargs = {**build_kwargs(context, tag, base), "buildargs": {}}
        image_id = _build(client, kwargs, progress)
        listed = (*PACKAGES, *(p for p in packages if p not in PACKAGES))
        image_id = _label_packages(client, kwargs, progress, listed) or image_id
    except OSError as exc:
        raise BackendUnavailable(f"cannot build the image: {exc}") from None
    finally:
        shutil.rmtree(context, ignore_errors=True)
        client.close()
    timings = {"build": time.monotonic() - started}
    progress(f"built {tag} ({image_id[:19] or 'id unknown'}): build {timings['build']:.1f}s")
    return BuildResult(tag, image_id, base, timings)
