"""container_kwargs and map_docker_error: the container's shape and the error mapping,
checked without an engine (docker-py's exception classes are built by hand)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import docker.errors
import pytest
import requests

from mcp_code_sandbox.backends.base import Egress, Limits, SandboxSpec
from mcp_code_sandbox.backends.docker import engine as docker_engine
from mcp_code_sandbox.backends.docker import spec as docker_spec
from mcp_code_sandbox.backends.docker.backend import DockerBackend
from mcp_code_sandbox.backends.docker.engine import map_docker_error
from mcp_code_sandbox.backends.docker.spec import container_kwargs
from mcp_code_sandbox.backends.seccomp import docker_seccomp_opt
from mcp_code_sandbox.errors import BackendUnavailable, SandboxFailed
from mcp_code_sandbox.settings import docker_environ, load_settings

LIMITS = Limits(memory_bytes=512 << 20, cpu=1.5, pids=128, tmp_bytes=64 << 20, file_bytes=1 << 30)
RUN_DIR = Path("/var/lib/mcs/run/k1-abcd")


def spec(**kw: Any) -> SandboxSpec:
    values: dict[str, Any] = {
        "key": "k1",
        "owner": "alice",
        "session_id": "my-session",
        "workspace": Path("/var/lib/mcs/workspaces/i/k1"),
        "limits": LIMITS,
        "env": {"FOO": "bar"},
        "uid": 0x7000_0001,
    }
    values.update(kw)
    return SandboxSpec(**values)


def kwargs(runtime: str = "runc", **kw: Any) -> dict[str, Any]:
    settings = load_settings({"docker_runtime": runtime}, environ={})
    return container_kwargs(spec(**kw), settings, "img:1", instance="h-1-ab", run_dir=RUN_DIR)


def test_isolation() -> None:
    k = kwargs()
    assert k["network_mode"] == "none"
    assert k["cap_drop"] == ["ALL"]
    assert k["security_opt"] == ["no-new-privileges", docker_seccomp_opt()]
    assert k["read_only"] is True
    assert k["user"] == f"{0x7000_0001}:{0x7000_0001}"  # the session's own uid
    assert k["init"] is False  # the agent is pid 1: no dumpable init beside it
    assert k["auto_remove"] is False
    assert k["detach"] is True
    assert k["stdin_open"] is False and k["tty"] is False
    assert k["image"] == "img:1"
    assert "privileged" not in k and "cap_add" not in k


def test_runsc_gets_no_seccomp_profile() -> None:
    # gVisor ignores it (without --oci-seccomp), and its own kernel is the wall.
    assert kwargs("runsc")["security_opt"] == ["no-new-privileges"]


def test_without_a_uid_of_its_own_the_servers_but_never_root() -> None:
    if os.geteuid() == 0:
        with pytest.raises(SandboxFailed, match="never runs as root"):
            kwargs(uid=None)
    else:
        k = kwargs(uid=None)
        assert k["user"] == f"{os.geteuid()}:{os.getegid()}"
        assert "mcp-code-sandbox.uid" not in k["labels"]


def test_a_session_uid_is_the_containers_user_and_label() -> None:
    k = kwargs(uid=0x7000_0003)
    assert k["user"] == f"{0x7000_0003}:{0x7000_0003}"
    assert k["labels"]["mcp-code-sandbox.uid"] == str(0x7000_0003)
    assert docker_spec.uid_from_label(k["labels"]["mcp-code-sandbox.uid"]) == 0x7000_0003
    for bad in (None, "", "-1", "1e9", "12345678901", "0x10"):
        assert docker_spec.uid_from_label(bad) is None


def test_network_is_the_egress_socket_never_an_interface() -> None:
    k = kwargs(egress=Egress(Path("/var/lib/mcs/egress/k1-ab")))
    assert k["network_mode"] == "none"  # with network too: the proxy's socket is the way
    assert k["labels"]["mcp-code-sandbox.network"] == "true"
    assert "sysctls" not in k
    mounts = {m["Target"]: m for m in k["mounts"]}
    assert mounts["/run/mcs-egress"]["Source"] == "/var/lib/mcs/egress/k1-ab"
    assert mounts["/run/mcs-egress"]["ReadOnly"] is True
    plain = kwargs()
    assert "/run/mcs-egress" not in {m["Target"] for m in plain["mounts"]}
    assert "mcp-code-sandbox.network" not in plain["labels"]


def test_egress_dir_is_bound_from_the_engines_view_of_the_state_dir() -> None:
    settings = load_settings(
        {"state_dir": "/state", "docker_host_state_dir": "/srv/mcs-state"}, environ={}
    )
    k = container_kwargs(
        spec(egress=Egress(Path("/state/egress/k1-ab")), workspace=Path("/state/workspaces/k1")),
        settings,
        "img:1",
        instance="h",
        run_dir=Path("/state/run/k1-abcd"),
    )
    mounts = {m["Target"]: m for m in k["mounts"]}
    assert mounts["/run/mcs-egress"]["Source"] == "/srv/mcs-state/egress/k1-ab"


def test_limits() -> None:
    k = kwargs()
    assert k["mem_limit"] == 512 << 20
    assert k["memswap_limit"] == k["mem_limit"]
    assert k["nano_cpus"] == 1_500_000_000
    assert k["pids_limit"] == 128
    assert k["tmpfs"] == {"/tmp": f"size={64 << 20},mode=1777"}
    ulimits = {u["Name"]: (u["Soft"], u["Hard"]) for u in k["ulimits"]}
    assert ulimits["core"] == (0, 0)
    assert ulimits["fsize"] == (1 << 30, 1 << 30)
    assert ulimits["nofile"][0] == ulimits["nofile"][1] > 0


def test_cpu_limit_is_averaged_over_one_second_under_gvisor_only() -> None:
    # runc: Docker's own 100 ms period. runsc: the same 1.5 cores over a 1 s period, so a
    # checkpoint of an idle sandbox (its sentry compressing memory) is not throttled.
    runsc = kwargs("runsc")
    assert "nano_cpus" not in runsc
    assert (runsc["cpu_period"], runsc["cpu_quota"]) == (1_000_000, 1_500_000)
    assert "cpu_period" not in kwargs("runc")


def test_mounts_workspace_rw_and_channel_dir_ro() -> None:
    mounts = {m["Target"]: m for m in kwargs()["mounts"]}
    assert set(mounts) == {"/mnt/data", "/run/mcs"}
    assert mounts["/mnt/data"]["Source"] == "/var/lib/mcs/workspaces/i/k1"
    assert mounts["/mnt/data"]["ReadOnly"] is False
    assert mounts["/run/mcs"]["Source"] == str(RUN_DIR)
    assert mounts["/run/mcs"]["ReadOnly"] is True
    assert all(m["Type"] == "bind" for m in mounts.values())


def test_labels() -> None:
    assert kwargs()["labels"] == {
        "mcp-code-sandbox.owner": "alice",
        "mcp-code-sandbox.session": "my-session",
        "mcp-code-sandbox.key": "k1",
        "mcp-code-sandbox.instance": "h-1-ab",
        "mcp-code-sandbox.rundir": "k1-abcd",
        "mcp-code-sandbox.uid": str(0x7000_0001),
    }


def test_runtime() -> None:
    assert kwargs()["runtime"] == "runc"
    assert kwargs("runsc")["runtime"] == "runsc"


def test_command_connects_to_the_channel_socket_and_leaves_nproc_to_the_cgroup() -> None:
    k = kwargs()
    command = [*k["entrypoint"], *k["command"]]
    assert command[:5] == ["/opt/sandbox/venv/bin/python", "-s", "-B", "-m", "mcs_agent"]
    assert command[command.index("--connect") + 1] == "/run/mcs/agent.sock"
    assert "--channel-fd" not in command
    config = json.loads(command[command.index("--config") + 1])
    # RLIMIT_NPROC would count uid 1000's processes in every container together.
    assert config["pids"] is None
    assert config["memory_bytes"] is None  # the cgroup limits memory
    assert config["file_bytes"] == 1 << 30
    assert config["kill_strays"] is True
    # Not the workspace: the cwd is on sys.path, and user files must not shadow the agent.
    assert k["working_dir"] == "/opt/sandbox/lib"


def test_environment() -> None:
    env = kwargs()["environment"]
    assert env["FOO"] == "bar"
    assert env["HOME"] == "/tmp"
    assert env["PATH"].startswith("/opt/sandbox/venv/bin:")


def test_docker_environ_takes_only_the_engine_variables() -> None:
    environ = {"DOCKER_HOST": "unix:///run/podman.sock", "DOCKER_CERT_PATH": "", "HOME": "/r"}
    assert docker_environ(environ) == {"DOCKER_HOST": "unix:///run/podman.sock"}


# -- error mapping ------------------------------------------------------------------------


def mapped(exc: BaseException, runtime: str = "runc") -> Any:
    return map_docker_error(exc, image="img:1", runtime=runtime)


class _Response:
    def __init__(self, status: int) -> None:
        self.status_code = status
        self.reason = "x"
        self.url = "http://docker/x"


def api_error(status: int, explanation: str) -> docker.errors.APIError:
    """What docker-py raises for an engine's HTTP error (see its
    ``create_api_error_from_http_exception``), on a hand-made response."""
    cls = docker.errors.APIError
    if status == 404:
        is_image = "no such image" in explanation.lower()
        cls = docker.errors.ImageNotFound if is_image else docker.errors.NotFound
    return cls(
        f"{status} error",
        response=_Response(status),
        explanation=explanation,
    )


def version_error(cause: BaseException) -> docker.errors.DockerException:
    """What ``docker.from_env`` raises when it cannot ask the engine its API version."""
    try:
        try:
            raise cause
        except Exception as e:
            raise docker.errors.DockerException(
                f"Error while fetching server API version: {e}"
            ) from e
    except docker.errors.DockerException as wrapped:
        return wrapped


def test_engine_down_is_backend_unavailable() -> None:
    for exc in (
        version_error(
            requests.exceptions.ConnectionError(
                "('Connection aborted.', FileNotFoundError(2, 'No such file or directory'))"
            )
        ),
        version_error(FileNotFoundError(2, "No such file or directory")),
        requests.exceptions.ConnectionError("Connection refused"),
        requests.exceptions.ReadTimeout("read timed out"),
        ConnectionRefusedError(111, "Connection refused"),
    ):
        error = mapped(exc)
        assert isinstance(error, BackendUnavailable), exc
        assert "start Docker, or set SANDBOX_BACKEND=bwrap" in error.message


def test_image_missing_says_how_to_build_it() -> None:
    error = mapped(api_error(404, "No such image: img:1"))
    assert isinstance(error, BackendUnavailable)
    assert "img:1" in error.message and "mcp-code-sandbox image build" in error.message


def test_runtime_words_in_an_engine_error_are_not_a_missing_runtime() -> None:
    # Issue 10: a container that fails inside runc says "runtime" and "runc"; that is a
    # failed sandbox, not an engine without the runtime.
    failed_start = api_error(
        500,
        "failed to create task for container: failed to create shim task: OCI runtime "
        "create failed: runc create failed: unable to start container process: error "
        "during container init: open /proc/sys/x: permission denied: unknown",
    )
    error = mapped(failed_start, runtime="runc")
    assert isinstance(error, SandboxFailed)
    assert "has no runtime" not in error.message
    assert "HTTP 500" in error.message and "runc create failed" in error.message
    # Nor does an engine's refusal that merely names one become one.
    error = mapped(api_error(400, "unknown or invalid runtime name: runsc"), runtime="runsc")
    assert isinstance(error, SandboxFailed) and "HTTP 400" in error.message


def test_engine_errors_are_mapped_by_type_and_status() -> None:
    gone = mapped(api_error(404, "No such container: 0123abc"))
    assert isinstance(gone, SandboxFailed) and "no such object" in gone.message
    refused = mapped(api_error(409, "Conflict. The container name is already in use"))
    assert isinstance(refused, SandboxFailed) and "refused (HTTP 409)" in refused.message
    failed = mapped(api_error(503, "Service Unavailable"))
    assert isinstance(failed, SandboxFailed) and "failed (HTTP 503)" in failed.message
    # An APIError is an OSError (requests' HTTPError is an IOError): still the engine's
    # answer, not an engine that does not answer, even wrapped.
    assert isinstance(mapped(api_error(500, "Connection reset")), SandboxFailed)
    assert isinstance(mapped(version_error(api_error(500, "boom"))), SandboxFailed)
    # Words in a message without a cause are not a cause.
    plain = docker.errors.DockerException("Error while fetching server API version: Connection")
    assert isinstance(mapped(plain), SandboxFailed)


def test_a_missing_runtime_is_asked_of_the_engine() -> None:
    registered = {"runc": {"path": "runc"}, "io.containerd.runc.v2": {"path": "runc"}}
    assert docker_engine.runtime_missing("runc", registered) is None
    missing = docker_engine.runtime_missing("runsc", registered)
    assert isinstance(missing, BackendUnavailable)
    assert (
        "no runtime 'runsc'" in missing.message and "SANDBOX_DOCKER_RUNTIME=runc" in missing.message
    )
    assert "io.containerd.runc.v2, runc" in missing.message


def test_refused_create_is_sandbox_failed_with_the_engine_reason() -> None:
    exc = api_error(400, "invalid mount config for type bind: bind source path does not exist")
    error = mapped(exc)
    assert isinstance(error, SandboxFailed)
    assert "bind source path does not exist" in error.message


def test_errors_that_are_not_docker_are_sandbox_failed() -> None:
    assert isinstance(mapped(docker.errors.DockerException("odd")), SandboxFailed)


async def test_engine_down_at_create_is_backend_unavailable(tmp_path: Path) -> None:
    # A socket path where nothing listens: docker-py fails to fetch the API version.
    missing = tmp_path / "no-engine.sock"
    settings = load_settings({"state_dir": str(tmp_path)}, environ={})
    backend = DockerBackend(settings, {"DOCKER_HOST": f"unix://{missing}"})
    with pytest.raises(BackendUnavailable, match="start Docker"):
        await backend.create(spec(workspace=tmp_path))
    assert backend.describe().runtimes == {}
    assert not docker_engine.engine_ready({"DOCKER_HOST": f"unix://{missing}"}, "img:1")


def test_enforcement() -> None:
    settings = load_settings({}, environ={})
    backend = DockerBackend(settings, {})
    enforced = backend.describe().enforcement
    backend.engine.close()
    assert {enforced[k] for k in ("memory", "cpu", "pids")} == {"cgroup"}
    assert enforced["network"] == "kernel"


def test_instances_of_live_servers_on_this_host_are_not_leftovers() -> None:
    alive = docker_engine.instance_alive
    host = socket.gethostname()
    assert alive("mine", "mine")
    assert alive(f"{host}-{os.getpid()}-abcd", "mine")
    assert not alive(f"{host}-999999999-abcd", "mine")
    assert not alive(f"elsewhere-{os.getpid()}-abcd", "mine")
    assert not alive("garbage", "mine")
