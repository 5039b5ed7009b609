"""The docker backend for real: an engine at DOCKER_HOST, the sandbox image, the agent.

Skipped, with the reason shown, when no engine answers or the image is missing; FAILING
instead when ``SANDBOX_REQUIRE_DOCKER=1`` (CI sets it, so no Docker test may skip there).
``SANDBOX_IMAGE`` and ``SANDBOX_DOCKER_RUNTIME`` choose the image and runtime, as for the
server. The tests talk to the agent with raw exec frames over the backend's Channel.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import docker
import docker.errors
import pytest

from mcp_code_sandbox.backends.base import Limits, SandboxSpec
from mcp_code_sandbox.backends.docker.backend import DockerBackend, DockerSandbox
from mcp_code_sandbox.backends.docker.engine import create_container
from mcp_code_sandbox.backends.docker.spec import container_kwargs
from mcp_code_sandbox.errors import BackendUnavailable
from mcp_code_sandbox.settings import Settings, docker_environ, load_settings

from ..conftest import require_docker, sandbox_owner

pytestmark = pytest.mark.docker

LIMITS = Limits(memory_bytes=256 << 20, cpu=0.5, pids=64, tmp_bytes=8 << 20, file_bytes=64 << 20)


def docker_settings(state_dir: Path) -> Settings:
    values: dict[str, Any] = {"state_dir": str(state_dir), "backend": "docker", "pool_size": 0}
    for name in ("image", "docker_runtime"):
        if os.environ.get(f"SANDBOX_{name.upper()}"):
            values[name] = os.environ[f"SANDBOX_{name.upper()}"]
    return load_settings(values, environ={})


@pytest.fixture
def settings(state_dir: Path) -> Settings:
    settings = docker_settings(state_dir)
    require_docker(settings.docker_runtime, settings.image)
    return settings


@pytest.fixture
async def backend(settings: Settings) -> AsyncIterator[DockerBackend]:
    backend = DockerBackend(settings, docker_environ())
    yield backend
    await backend.aclose()


@pytest.fixture
def engine() -> Any:
    client = docker.from_env(environment=docker_environ())
    yield client
    client.close()


async def start(backend: DockerBackend, key: str, uid: int | None, **spec: Any) -> DockerSandbox:
    workspace = backend.settings.state_dir / "workspaces" / key
    workspace.mkdir(parents=True)
    if (owner := sandbox_owner(backend, uid)) is not None:
        os.chown(workspace, *owner)
    box = await backend.create(
        SandboxSpec(
            key=key,
            owner="alice",
            session_id=f"id-{key}",
            workspace=workspace,
            limits=LIMITS,
            uid=uid if backend.per_sandbox_uids else None,
            **spec,
        )
    )
    assert isinstance(box, DockerSandbox)
    return box


@pytest.fixture
async def sandbox(backend: DockerBackend, host_uid: int | None) -> AsyncIterator[DockerSandbox]:
    box = await start(backend, "d1", host_uid)
    try:
        yield box
    finally:
        await backend.stop(box)


_ids = itertools.count(1)


async def run(
    box: DockerSandbox, code: str, language: str = "python"
) -> tuple[str, dict[str, Any]]:
    run_id = next(_ids)
    await box.channel.send(
        {"op": "exec", "id": run_id, "language": language, "code": code, "timeout_s": 30}
    )
    stdout = ""
    while True:
        message = await box.channel.receive()
        assert message is not None, "the agent closed the channel"
        if message["ev"] == "stream" and message["name"] == "stdout":
            stdout += message["text"]
        elif message["ev"] == "done":
            return stdout, message


def gone(engine: Any, container_id: str) -> bool:
    try:
        engine.containers.get(container_id)
    except docker.errors.NotFound:
        return True
    return False


async def test_create_exec_stop_leaves_nothing(
    backend: DockerBackend, engine: Any, host_uid: int | None
) -> None:
    box = await start(backend, "life", host_uid)
    assert box.ready["ev"] == "ready" and "python" in box.ready["languages"]
    _, done = await run(box, "1+1")
    assert done["status"] == "ok" and done["result"] == "2"
    assert box.is_alive()
    await backend.stop(box)
    assert not box.is_alive()
    assert gone(engine, box.backend_id)
    assert not box.run_dir.exists()
    await backend.stop(box)  # a gone container is not an error


async def test_labels(sandbox: DockerSandbox, backend: DockerBackend, engine: Any) -> None:
    labels = engine.containers.get(sandbox.backend_id).attrs["Config"]["Labels"]
    assert labels["mcp-code-sandbox.owner"] == "alice"
    assert labels["mcp-code-sandbox.session"] == "id-d1"
    assert labels["mcp-code-sandbox.key"] == "d1"
    assert labels["mcp-code-sandbox.instance"] == backend.instance
    assert labels["mcp-code-sandbox.uid"] == str(sandbox.spec.uid)


async def test_limits_and_isolation_in_the_container_config(
    sandbox: DockerSandbox, backend: DockerBackend, engine: Any
) -> None:
    attrs = engine.containers.get(sandbox.backend_id).attrs
    host = attrs["HostConfig"]
    assert host["Memory"] == LIMITS.memory_bytes == host["MemorySwap"]
    assert host["NanoCpus"] == 500_000_000
    assert host["PidsLimit"] == LIMITS.pids
    assert host["ReadonlyRootfs"] is True
    assert host["CapDrop"] == ["ALL"]
    assert "no-new-privileges" in host["SecurityOpt"]
    assert host["NetworkMode"] == "none"
    assert host["Tmpfs"]["/tmp"].startswith(f"size={LIMITS.tmp_bytes}")
    assert host["Runtime"] == backend.settings.docker_runtime
    assert not host["Init"]  # the agent is pid 1, not tini (dumpable, holding the log)
    if backend.settings.docker_runtime == "runc":  # the engine took our profile
        assert any(opt.startswith("seccomp=") for opt in host["SecurityOpt"])
    uid = sandbox.spec.uid
    assert attrs["Config"]["User"] == f"{uid}:{uid}" and uid is not None and uid > 65535
    assert attrs["State"]["Running"] is True


def test_create_without_inspect_asks_what_containers_create_asks(
    backend: DockerBackend, engine: Any, state_dir: Path, host_uid: int | None
) -> None:
    """``create_container`` (no inspect after it) sends the engine the very container
    docker-py's ``containers.create`` sends, for a sandbox's whole kwargs."""
    workspace = state_dir / "ws-same"
    run_dir = state_dir / "run-same"
    workspace.mkdir()
    run_dir.mkdir()
    spec = SandboxSpec(
        key="same",
        owner="alice",
        session_id="id-same",
        workspace=workspace,
        limits=LIMITS,
        uid=host_uid if backend.per_sandbox_uids else None,
    )
    kwargs = container_kwargs(
        spec, backend.settings, backend.image, instance=backend.instance, run_dir=run_dir
    )
    theirs = engine.containers.create(**kwargs)
    ours = create_container(engine, kwargs)
    try:
        assert ours.attrs == {"Id": ours.id}  # no inspect: the id only
        ours.reload()
        for part in ("Config", "HostConfig"):
            assert ours.attrs[part] == theirs.attrs[part], part
        with pytest.raises(TypeError, match="unexpected container arguments"):
            create_container(engine, {**kwargs, "no_such_option": 1})
    finally:
        theirs.remove(force=True)
        ours.remove(force=True)


async def test_inside_uid_readonly_root_tmp_and_no_network(sandbox: DockerSandbox) -> None:
    code = """
import os, socket
print(os.getuid(), os.getgid(), os.getcwd())
for path in ("/etc/evil", "/opt/sandbox/evil", "/evil"):
    try:
        open(path, "w")
        print("wrote", path)
    except OSError as exc:
        print("refused", exc.errno)
open("/tmp/ok", "w").write("x")
open("/mnt/data/made-inside.txt", "w").write("hello")
print(sorted(os.listdir("/sys/class/net")))
try:
    socket.create_connection(("1.1.1.1", 53), timeout=2)
    print("network: yes")
except OSError:
    print("network: no")
"""
    stdout, done = await run(sandbox, code)
    assert done["status"] == "ok", done
    lines = stdout.splitlines()
    uid = sandbox.spec.uid
    assert lines[0] == f"{uid} {uid} /mnt/data"  # the session's own host uid, not 1000
    assert lines[1:4] == ["refused 30"] * 3  # EROFS
    assert lines[4] == "['lo']"
    assert lines[5] == "network: no"
    made = sandbox.spec.workspace / "made-inside.txt"
    assert made.read_text() == "hello"
    assert made.stat().st_uid == uid


async def test_containers_of_a_dead_instance_are_leftovers(
    backend: DockerBackend, sandbox: DockerSandbox, engine: Any, host_uid: int | None
) -> None:
    # Another live server process on this host (here: this one) owns its containers.
    assert sandbox.backend_id not in {lo.backend_id for lo in await backend.list_leftovers()}
    dead = DockerBackend(backend.settings, docker_environ(), instance="gone-host-1-ab")
    try:
        box = await start(dead, "old", host_uid)
        leftovers = {lo.backend_id: lo for lo in await backend.list_leftovers()}
        found = leftovers[box.backend_id]
        assert (found.key, found.owner, found.session_id) == ("old", "alice", "id-old")
        assert found.uid == host_uid
        assert found.running
        await backend.remove_leftover(found)
        assert gone(engine, box.backend_id)
        assert not box.run_dir.exists()
        await dead.stop(box)  # already removed: not an error
    finally:
        await dead.aclose()


async def test_missing_image_is_backend_unavailable_and_leaves_nothing(
    settings: Settings, host_uid: int | None
) -> None:
    # create() no longer looks the image up first: the engine's refusal of the create
    # must say the same (how to build it), and leave no run dir behind.
    missing = settings.model_copy(update={"image": "mcs-no-such-image:never"})
    backend = DockerBackend(missing, docker_environ())
    try:
        with pytest.raises(BackendUnavailable) as caught:
            await start(backend, "noimg", host_uid)
        assert "mcs-no-such-image:never" in caught.value.message
        assert "mcp-code-sandbox image build" in caught.value.message
        assert not any(missing.run_dir.glob("noimg-*"))
    finally:
        await backend.aclose()
