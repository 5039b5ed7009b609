"""``doctor`` checks of the docker backend: the engine, its runtimes, the image.

Output-free like :func:`.bwrap.check_bwrap`: one :class:`.checks.Check` a fact.
Limits need no checks of their own here: the engine enforces memory, CPU and pids with its
cgroups for every container, whatever the host's cgroup version.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import docker

from mcp_code_sandbox import host
from mcp_code_sandbox.backends.base import Limits
from mcp_code_sandbox.backends.docker.backend import DockerBackend, no_checkpoints
from mcp_code_sandbox.backends.docker.derived import sandbox_image
from mcp_code_sandbox.backends.docker.engine import foreign, probe_engine
from mcp_code_sandbox.backends.docker.labels import RUNNER_FILTER, is_runner
from mcp_code_sandbox.backends.docker.runners import choose_runners, listed_images
from mcp_code_sandbox.backends.docker.statedir import StateDir
from mcp_code_sandbox.backends.seccomp import deny_rules
from mcp_code_sandbox.doctor.checks import (
    Check,
    network_check,
    pause_check,
    uid_range_detail,
    workspace_quota_check,
)
from mcp_code_sandbox.errors import SandboxError
from mcp_code_sandbox.run.languages import RUNTIMES
from mcp_code_sandbox.run.probe import RuntimeProbe
from mcp_code_sandbox.sessions.uids import uid_pool
from mcp_code_sandbox.settings import Settings, docker_environ

__all__ = ["ESSENTIAL", "check_docker", "seccomp_check", "state_dir_check", "uid_check"]

#: Docker checks without which its sandboxes cannot start.
ESSENTIAL = ("docker engine", "docker runtime", "docker seccomp", "docker image")

_ENGINE_FIX = (
    "install and start an engine (scripts/docker-engine.sh on Debian/Ubuntu), set "
    "DOCKER_HOST (Podman: unix:///run/podman/podman.sock), or use SANDBOX_BACKEND=bwrap"
)


def check_docker(settings: Settings) -> list[Check]:
    environment = docker_environ()
    where = environment.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    try:
        probe_engine(environment)
        client = docker.from_env(environment=environment, timeout=5)
    except Exception as exc:
        if not foreign(exc):
            raise
        return [Check("docker engine", False, f"no engine answers at {where}", _ENGINE_FIX)]
    try:
        return _engine_checks(client, settings, where)
    except Exception as exc:
        if not foreign(exc):
            raise
        return [Check("docker engine", False, f"{where}: {exc}", _ENGINE_FIX)]
    finally:
        client.close()


def _engine_checks(client: Any, settings: Settings, where: str) -> list[Check]:
    info = client.info()
    version = client.version().get("Version", "?")
    runtimes = sorted(info.get("Runtimes") or {})
    checks = [
        Check("docker engine", True, f"{where}: version {version}"),
        Check("docker runtimes", True, ", ".join(runtimes) or "none reported"),
    ]
    wanted = settings.docker_runtime
    if wanted in runtimes:
        checks.append(Check("docker runtime", True, f"{wanted} (SANDBOX_DOCKER_RUNTIME)"))
    else:
        checks.append(Check(
            "docker runtime", False, f"{wanted} is not registered with the engine",
            "register gVisor's runsc in /etc/docker/daemon.json (scripts/docker-engine.sh "
            "does) with runtimeArgs --network=none --host-uds=open",
        ))  # fmt: skip
    checks.append(seccomp_check(wanted, info.get("SecurityOptions") or []))
    wanted_image = sandbox_image(settings)  # with SANDBOX_RUNTIME_PACKAGES, if any
    image = _image_check(client, wanted_image)
    if image.ok:  # what the image serves, asked of a sandbox of it (not only its label)
        image = Check(image.name, True, f"{wanted_image} ({_served(settings, image.detail)})")
    elif settings.runtime_packages:
        packages = ", ".join(settings.runtime_packages)
        image = Check(image.name, False, f"{image.detail}: {settings.image} with "
                      f"SANDBOX_RUNTIME_PACKAGES ({packages})", image.fix)  # fmt: skip
    checks.append(image)
    checks.append(_runners_check(client, wanted_image))
    checks.append(Check(
        "docker limits", True,
        "memory, cpu and pids by the engine's cgroups; network only where allowed and asked for",
    ))  # fmt: skip
    checks.append(state_dir_check(DockerBackend(settings, docker_environ())))
    backend = DockerBackend(settings, docker_environ())
    runsc = (info.get("Runtimes") or {}).get("runsc") or {}
    checks.append(_network_check(backend, settings, list(runsc.get("runtimeArgs") or [])))
    checks.append(_quota_check(backend, settings))
    checks.append(uid_check(settings, info.get("SecurityOptions") or []))
    checks.append(pause_check(no_checkpoints(settings, info)))
    return checks


def state_dir_check(backend: DockerBackend) -> Check:
    """Where the sandboxes' workspaces and sockets are for the engine: the state dir on
    its host, a host dir bound into the server's container, or (the appliance) a named
    volume of the engine, which nothing on the client's machine is part of."""
    name = "docker state dir"

    async def ask() -> StateDir:
        try:
            return await backend.state_dir()
        finally:
            await backend.aclose()

    try:
        state = asyncio.run(ask())
    except SandboxError as exc:
        return Check(name, False, exc.message, "mount a volume at the state dir")
    where = "the server runs in a container: " if backend.own_container else ""
    return Check(name, True, where + state.describe())


def uid_check(settings: Settings, security_options: list[str]) -> Check:
    """How the containers' host uids keep per-user kernel limits per sandbox."""
    name = "per-sandbox uids"
    runtime = settings.docker_runtime
    gvisor = "; under gVisor per-user limits are each sandbox kernel's own anyway"
    remapped = [o for o in security_options if "name=userns" in o or "name=rootless" in o]
    if remapped:
        return Check(
            name, False,
            f"the engine remaps uids ({', '.join(remapped)}): not supported, the server's "
            "workspace files would not be the sandboxes'",
            "use an engine without userns-remap, or SANDBOX_BACKEND=bwrap",
        )  # fmt: skip
    if not host.can_chown():
        uid = os.geteuid()
        detail = (
            f"no (server cannot chown: not root, no CAP_CHOWN): every container runs as "
            f"the server's uid {uid}, so per-user limits like inotify instances are "
            "shared by all sandboxes"
        )
        if runtime == "runsc":
            return Check(name, True, detail + gvisor)
        return Check(name, False, detail, "run the server as root, or with CAP_CHOWN")
    detail, why_not = uid_range_detail(settings)
    if why_not is not None:
        return Check(name, False, f"{detail}: {why_not}", "set SANDBOX_UID_LEASE_DIR")
    how = f"yes: each session's containers run as a host uid of its own ({runtime}); {detail}"
    return Check(name, True, how + (gvisor if runtime == "runsc" else ""))


def seccomp_check(runtime: str, security_options: list[str]) -> Check:
    """Under runc the containers run under our profile (``security_opt``), which needs an
    engine built with seccomp; under runsc gVisor's own kernel stands in for it."""
    if runtime == "runsc":
        return Check(
            "docker seccomp", True, "runsc: none (gVisor's own kernel serves every syscall)"
        )
    if not any("seccomp" in option for option in security_options):
        return Check(
            "docker seccomp", False, "the engine reports no seccomp support: containers fail "
            "to start with our profile", "use an engine built with seccomp (libseccomp)",
        )  # fmt: skip
    return Check(
        "docker seccomp", True,
        f"runc containers run under our profile ({len(deny_rules())} rules, bwrap's deny-list)",
    )  # fmt: skip


def _quota_check(backend: DockerBackend, settings: Settings) -> Check:
    return workspace_quota_check(settings, backend)


def _network_check(backend: DockerBackend, settings: Settings, runsc_args: list[str]) -> Check:
    try:
        why_not = backend.describe().network_unavailable
    finally:
        backend.engine.close()  # describe() may have opened a client
    if settings.docker_runtime == "runsc" and "--host-uds=open" not in runsc_args:
        why_not = why_not or (
            "runsc is registered without --host-uds=open, so a gVisor sandbox cannot connect "
            "to the egress proxy's socket (scripts/docker-engine.sh registers it)"
        )
    how = "the container keeps network_mode none (loopback only)" + (
        ", under gVisor with runsc --host-uds=open (connect to a bound socket, never create)"
        if settings.docker_runtime == "runsc"
        else ""
    )
    return network_check(settings, why_not, how)


def _image_check(client: Any, image: str) -> Check:
    try:
        labels = client.images.get(image).attrs["Config"].get("Labels") or {}
    except Exception as exc:
        if not foreign(exc):
            raise
        return Check("docker image", False, f"{image} is not built", "mcp-code-sandbox image build")
    languages = labels.get("sandbox.language", "?")
    if not is_runner(labels):
        return Check("docker image", False, f"{image} lacks the label sandbox.runner=true",
                     "rebuild it: mcp-code-sandbox image build")  # fmt: skip
    return Check("docker image", True, f"{image} (languages: {languages})")


def _served(settings: Settings, label_detail: str) -> str:
    """ "languages: python 3.11.2, javascript 24.1.0, ...", as the server's own probe
    sandbox finds them (the image's label names only its first language); the label's
    words when no sandbox could be started."""
    backend = DockerBackend(settings, docker_environ())
    uids = uid_pool(settings) if backend.per_sandbox_uids else None
    probe = RuntimeProbe(settings, backend, lambda: _limits(settings), RUNTIMES, uids)

    async def ask() -> dict[str, str] | None:
        try:
            return await probe.get()
        finally:
            await backend.aclose()

    try:
        found = asyncio.run(ask())
    except SandboxError:
        found = None
    if not found:
        return label_detail.split("(", 1)[-1].rstrip(")")
    return "languages: " + ", ".join(f"{name} {version}" for name, version in found.items())


def _limits(settings: Settings) -> Limits:
    return Limits(
        memory_bytes=settings.memory_limit,
        cpu=settings.cpu_limit,
        pids=settings.pids_limit,
        tmp_bytes=settings.tmp_size,
        file_bytes=settings.workspace_quota_bytes,
    )


def _runners_check(client: Any, image: str) -> Check:
    try:
        default_id = client.images.get(image).id
    except Exception as exc:
        if not foreign(exc):
            raise
        default_id = None
    runners, skipped = choose_runners(
        listed_images(client.api.images(filters=RUNNER_FILTER)),
        default_image_id=default_id,
        taken=RUNTIMES,
    )
    found = ", ".join(f"{lang} ({runner.image})" for lang, runner in runners.items())
    detail = found or "none (an image labelled sandbox.runner=true, sandbox.language=NAME adds one)"
    if skipped:
        detail += "; left out: " + "; ".join(skipped)
    return Check("runner images", True, detail)
