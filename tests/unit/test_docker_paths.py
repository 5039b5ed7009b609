"""The state dir as the server sees it and as the engine sees it (a server in a container):
the translation both ways, and that every bind the engine gets, and every mount source it
reports back, goes through it. No engine needed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mcp_code_sandbox.backends.base import Limits, SandboxSpec
from mcp_code_sandbox.backends.docker.backend import DockerBackend
from mcp_code_sandbox.backends.docker.runners import runner_kwargs
from mcp_code_sandbox.backends.docker.spec import container_kwargs, engine_path, server_path
from mcp_code_sandbox.backends.runner_images import RunnerImage
from mcp_code_sandbox.settings import ConfigError, Settings, load_settings

INSIDE = Path("/var/lib/mcp-code-sandbox")
HOST = Path("/srv/mcs/state")
LIMITS = Limits(memory_bytes=512 << 20, cpu=1.0, pids=128, tmp_bytes=64 << 20, file_bytes=1 << 30)


def settings(host: Path | None = HOST) -> Settings:
    values: dict[str, Any] = {"state_dir": str(INSIDE)}
    if host is not None:
        values["docker_host_state_dir"] = str(host)
    return load_settings(values, environ={})


def spec(s: Settings) -> SandboxSpec:
    return SandboxSpec(
        key="k1",
        owner="alice",
        session_id="s",
        workspace=s.workspaces_dir / "slot1",
        limits=LIMITS,
        env={},
        uid=0x7000_0001,
    )


def test_engine_path_maps_the_state_dir_prefix() -> None:
    s = settings()
    assert engine_path(INSIDE / "workspaces" / "slot1", s) == HOST / "workspaces" / "slot1"
    assert engine_path(INSIDE / "run" / "k1-ab", s) == HOST / "run" / "k1-ab"


def test_engine_path_refuses_a_path_outside_the_state_dir() -> None:
    with pytest.raises(ValueError):
        engine_path(Path("/etc/passwd"), settings())


def test_server_path_is_the_inverse_and_rejects_foreign_sources() -> None:
    s = settings()
    inside = INSIDE / "workspaces" / "slot1"
    assert server_path(engine_path(inside, s), s) == inside
    assert server_path(Path("/var/tmp/other-server/workspaces/x"), s) is None
    # A prefix of a name is not a parent directory.
    assert server_path(Path("/srv/mcs/state2/workspaces/x"), s) is None


def test_without_a_mapping_both_are_the_identity() -> None:
    s = settings(host=None)
    for path in (INSIDE / "workspaces" / "x", Path("/elsewhere/x")):
        assert engine_path(path, s) == path
        assert server_path(path, s) == path


def test_container_binds_are_engine_paths() -> None:
    s = settings()
    run_dir = s.run_dir / "k1-abcd"
    kw = container_kwargs(spec(s), s, "img:1", instance="h-1-ab", run_dir=run_dir)
    sources = {m["Target"]: m["Source"] for m in kw["mounts"]}
    assert sources == {
        "/mnt/data": str(HOST / "workspaces" / "slot1"),
        "/run/mcs": str(HOST / "run" / "k1-abcd"),
    }
    # The label names the run dir by its name only: the same on both sides.
    assert kw["labels"]["mcp-code-sandbox.rundir"] == "k1-abcd"


def test_runner_binds_are_engine_paths() -> None:
    s = settings()
    runner = RunnerImage("ruby", "ruby:3", "sha256:1", ("ruby", "{file}"), ".rb", None, {})
    kw = runner_kwargs(spec(s), s, runner, instance="h", run_dir=s.run_dir / "k1-ruby-ab")
    sources = {m["Target"]: m["Source"] for m in kw["mounts"]}
    assert sources["/mnt/data"] == str(HOST / "workspaces" / "slot1")
    assert sources["/run/mcs"] == str(HOST / "run" / "k1-ruby-ab")


def attrs(channel: str | None, workspace: str | None) -> dict[str, Any]:
    mounts = []
    if channel is not None:
        mounts.append({"Destination": "/run/mcs", "Source": channel})
    if workspace is not None:
        mounts.append({"Destination": "/mnt/data", "Source": workspace})
    return {"Mounts": mounts}


def test_leftovers_are_recognised_by_their_engine_paths() -> None:
    backend = DockerBackend(settings(), {}, instance="me")
    ours = attrs(str(HOST / "run" / "k1-ab"), str(HOST / "workspaces" / "slot1"))
    assert backend._same_state_dir(ours)
    assert backend._bound_dir(ours, "/mnt/data") == INSIDE / "workspaces" / "slot1"
    # The server-side path as a source is another state dir (e.g. a server on the host
    # whose state dir happens to be that path), not ours.
    theirs = attrs(str(INSIDE / "run" / "k1-ab"), str(INSIDE / "workspaces" / "slot1"))
    assert not backend._same_state_dir(theirs)
    assert backend._bound_dir(theirs, "/mnt/data") is None
    assert backend._same_state_dir(attrs(None, None))  # unknown: yes, as before


def test_setting_must_be_absolute_and_empty_means_unset() -> None:
    with pytest.raises(ConfigError, match="SANDBOX_DOCKER_HOST_STATE_DIR"):
        load_settings({"docker_host_state_dir": "relative/dir"}, environ={})
    s = load_settings(environ={"SANDBOX_DOCKER_HOST_STATE_DIR": ""})
    assert s.docker_host_state_dir is None
    s = load_settings(environ={"SANDBOX_DOCKER_HOST_STATE_DIR": "/srv/x"})
    assert s.docker_host_state_dir == Path("/srv/x")
