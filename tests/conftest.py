"""Shared fixtures, and which sandbox backends a test runs on.

Tests that need the real sandbox are marked ``bwrap``; they FAIL (never skip) when
bubblewrap or the runtime environment is missing: run ``mcp-code-sandbox setup`` (the
README's test command does). Each test gets its own state directory, so workspaces never
leak between tests; all of them share the one runtime environment ``setup`` built.

Sandbox-behaviour tests run on every backend (issue 3): they parametrize the ``backend``
fixture indirectly with :data:`each_backend` (``bwrap``, ``docker``) or, for isolation and
the workflow, :data:`each_runtime` (plus ``runsc``: docker under gVisor); ``make_settings``
and ``service`` then build that backend. Unparametrized, ``backend`` is ``bwrap``. The
Docker params are skipped with the reason shown when no engine answers, the image is
missing or the engine lacks the runtime, and FAIL instead when ``SANDBOX_REQUIRE_DOCKER=1``
(CI sets it). ``SANDBOX_IMAGE`` picks the image, as for the server.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mcp_code_sandbox.settings import Settings, docker_environ, load_settings

REPO = Path(__file__).resolve().parents[1]
REQUIRE_DOCKER = os.environ.get("SANDBOX_REQUIRE_DOCKER") == "1"
#: ``backend`` fixture value → the Docker runtime it runs under (``bwrap`` has none).
DOCKER_RUNTIMES = {"docker": "runc", "runsc": "runsc"}

_BWRAP = pytest.param("bwrap", id="bwrap", marks=pytest.mark.bwrap)
_DOCKER = pytest.param("docker", id="docker", marks=pytest.mark.docker)
_RUNSC = pytest.param("runsc", id="runsc", marks=pytest.mark.docker)
#: Sandbox behaviour (limits, timeouts, state, cleanup): bwrap and docker with runc.
each_backend = pytest.mark.parametrize("backend", [_BWRAP, _DOCKER], indirect=True)
#: Isolation and the workflow: also docker under gVisor.
each_runtime = pytest.mark.parametrize("backend", [_BWRAP, _DOCKER, _RUNSC], indirect=True)


def valued(value: Any) -> Any:
    """``value`` without the fields that say nothing (null, false, "", [], {}): what the
    text copy of a tool result carries (DESIGN §6)."""
    if isinstance(value, dict):
        kept = {k: valued(v) for k, v in value.items()}
        # By identity for null and false: 0 is a value (an exit code), and 0 == False.
        return {
            k: v
            for k, v in kept.items()
            if v is not None and v is not False and v not in ("", [], {})
        }
    if isinstance(value, list):
        return [valued(v) for v in value]
    return value


def shared_runtime_dir() -> Path:
    configured = os.environ.get("SANDBOX_RUNTIME_DIR")
    if configured:
        return Path(configured)
    return load_settings(environ={}).runtime_dir


def require_runtime() -> Path:
    runtime = shared_runtime_dir()
    if not (runtime / "venv" / "bin" / "python").exists():
        pytest.fail(
            f"the sandbox runtime environment is missing at {runtime}: run "
            "`.venv/bin/mcp-code-sandbox setup` (scripts/test.sh does)",
            pytrace=False,
        )
    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap is not installed: apt-get install bubblewrap", pytrace=False)
    return runtime


def docker_image() -> str:
    return os.environ.get("SANDBOX_IMAGE") or load_settings(environ={}).image


@functools.cache
def docker_missing(runtime: str, image: str) -> str | None:
    """Why the engine at DOCKER_HOST cannot run ``image`` under ``runtime``; None if it can.

    Asked once per run: every Docker-parametrized test would otherwise probe the engine."""
    import docker

    from mcp_code_sandbox.backends.docker.backend import engine_ready

    environment = docker_environ()
    where = environment.get("DOCKER_HOST", "the default socket")
    if not engine_ready(environment, image):
        return (
            f"no Docker engine answers at {where}, or it has no image {image} "
            "(mcp-code-sandbox image build)"
        )
    client = docker.from_env(environment=environment, timeout=10)
    try:
        runtimes = client.info().get("Runtimes") or {}
    finally:
        client.close()
    if runtime not in runtimes:
        return (
            f"the Docker engine at {where} has no runtime {runtime!r} "
            "(scripts/docker-engine.sh registers runsc)"
        )
    return None


def require_docker(runtime: str = "runc", image: str | None = None) -> None:
    """Skip (with the reason) when Docker cannot serve; fail when SANDBOX_REQUIRE_DOCKER=1."""
    why = docker_missing(runtime, image or docker_image())
    if why is None:
        return
    if REQUIRE_DOCKER:
        pytest.fail(f"SANDBOX_REQUIRE_DOCKER=1 but {why}", pytrace=False)
    pytest.skip(why)


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> str:
    """``bwrap``, ``docker`` (runc) or ``runsc``: what ``make_settings`` builds."""
    name: str = getattr(request, "param", "bwrap")
    if name in DOCKER_RUNTIMES:
        require_docker(DOCKER_RUNTIMES[name])
    return name


def backend_settings(backend: str) -> dict[str, Any]:
    if backend == "bwrap":
        return {"backend": "bwrap", "runtime_dir": str(require_runtime())}
    return {
        "backend": "docker",
        "docker_runtime": DOCKER_RUNTIMES[backend],
        "image": docker_image(),
    }


@pytest.fixture
def state_dir() -> Iterator[Path]:
    # Not pytest's tmp_path: as root the sandbox runs as an unprivileged uid that must be
    # able to traverse to its workspace, and pytest's base temp dir is 0700.
    path = Path(tempfile.mkdtemp(prefix="mcs-test-", dir="/var/tmp"))
    path.chmod(0o711)
    yield path
    _unmount_below(path)  # a test that failed half-way may leave workspace filesystems
    shutil.rmtree(path, ignore_errors=True)


def long_dir(base: Path, length: int) -> Path:
    """A directory under ``base`` whose path is ``length`` characters (a deep state dir),
    each level traversable by a sandbox's uid, as the ``state_dir`` fixture's own."""
    path, left = base, length - len(str(base))
    while left > 0:
        # "/" and a name; never leave 1 character, which could not hold another level.
        name = min(50, left - 1)
        name -= left - 1 - name == 1
        path = path / ("d" * name)
        path.mkdir()
        path.chmod(0o711)
        left -= name + 1
    assert len(str(path)) == length
    return path


def _unmount_below(path: Path) -> None:
    with open("/proc/self/mountinfo") as info:
        points = [line.split()[4] for line in info]
    for point in reversed(points):
        if point.startswith(f"{path}/"):
            subprocess.run(["umount", "--lazy", point], capture_output=True, check=False)


@pytest.fixture
def host_uid() -> Iterator[int | None]:
    """For tests that start sandboxes without a session manager: a host uid leased as the
    manager would lease one (``uids``), for backends with ``per_sandbox_uids``; ``None``
    when the tests do not run as root (no backend can use one then)."""
    from mcp_code_sandbox.sessions.uids import uid_pool

    if os.geteuid() != 0:
        yield None
        return
    lease = uid_pool(load_settings(environ={})).lease(f"test {os.getpid()}")
    try:
        yield lease.uid
    finally:
        lease.release()


def sandbox_owner(backend: Any, uid: int | None) -> tuple[int, int] | None:
    """Who must own a workspace that ``backend`` runs a sandbox of ``uid`` on."""
    if backend.per_sandbox_uids:
        assert uid is not None, "request the host_uid fixture"
        return uid, uid
    owner: tuple[int, int] | None = backend.workspace_owner
    return owner


@pytest.fixture
def make_settings(state_dir: Path, backend: str) -> Callable[..., Settings]:
    chosen = backend_settings(backend)

    def make(**overrides: Any) -> Settings:
        # The warm pool off unless a test asks for it: most tests count sandboxes, and
        # every server would otherwise start two preloaded ones (tests/e2e/test_pool.py).
        values: dict[str, Any] = {"state_dir": str(state_dir), "pool_size": 0, **chosen}
        values.update(overrides)
        return load_settings(values, environ={})

    return make


#: ``make_service``'s type, for tests' annotations.
MakeService = Callable[..., contextlib.AbstractAsyncContextManager[Any]]


@pytest.fixture
def make_service(make_settings: Callable[..., Settings]) -> MakeService:
    """``async with make_service(**settings) as svc``: a started service of this test's
    backend, closed (every sandbox and workspace removed) on the way out."""
    from mcp_code_sandbox.backends import create_backend
    from mcp_code_sandbox.service import SandboxService

    @contextlib.asynccontextmanager
    async def make(**overrides: Any) -> AsyncIterator[Any]:
        settings = make_settings(**overrides)
        svc = SandboxService(settings, create_backend(settings))
        await svc.start()
        try:
            yield svc
        finally:
            await svc.aclose()

    return make


@pytest.fixture
async def service(make_service: MakeService) -> AsyncIterator[Any]:
    async with make_service(exec_timeout_s=30) as svc:
        yield svc
