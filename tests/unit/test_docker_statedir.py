"""How the engine sees the server's state dir when the server runs in a container
(``backends.docker.statedir``): found from the server's own container, a named volume's
sub-directories mounted by subpath or bound from the engine's own directory, a bind
mount's host path; and that leftovers are known again through either. No engine needed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mcp_code_sandbox.backends.docker.backend import DockerBackend
from mcp_code_sandbox.backends.docker.spec import container_kwargs
from mcp_code_sandbox.backends.docker.statedir import (
    StateDir,
    api_at_least,
    locate,
    own_container_id,
)
from mcp_code_sandbox.errors import BackendUnavailable
from mcp_code_sandbox.settings import Settings, load_settings

from .test_docker_paths import spec

STATE = Path("/var/lib/mcp-code-sandbox")
DATA = Path("/var/lib/docker/volumes/mcp-code-sandbox/_data")
CID = "4f" * 32
MOUNTINFO = f"""\
612 590 0:52 / / rw,relatime master:300 - overlay overlay rw
640 612 254:1 /var/lib/docker/volumes/mcp-code-sandbox/_data {STATE} rw - ext4 /dev/vda1 rw
641 612 254:1 /var/lib/docker/containers/{CID}/resolv.conf /etc/resolv.conf rw - ext4 /dev/vda1
642 612 254:1 /var/lib/docker/containers/{CID}/hostname /etc/hostname rw - ext4 /dev/vda1 rw
"""


def settings(**values: Any) -> Settings:
    return load_settings({"state_dir": str(STATE), **values}, environ={})


def volume_at(destination: Path = STATE, driver: str = "local") -> dict[str, Any]:
    return {
        "Mounts": [
            {
                "Type": "bind",
                "Source": "/var/run/docker.sock",
                "Destination": "/var/run/docker.sock",
            },
            {
                "Type": "volume",
                "Name": "mcp-code-sandbox",
                "Source": str(DATA),
                "Destination": str(destination),
                "Driver": driver,
            },
        ]
    }


def test_the_own_container_is_found_in_mountinfo() -> None:
    assert own_container_id(MOUNTINFO) == CID
    assert own_container_id("25 1 0:22 / / rw - ext4 /dev/sda1 rw\n") is None


def test_api_versions() -> None:
    assert api_at_least("1.45") and api_at_least("1.47") and api_at_least("2.0")
    assert not api_at_least("1.41") and not api_at_least("") and not api_at_least("x.y")


def test_a_volume_on_an_engine_with_subpaths_is_mounted_by_sub_directory() -> None:
    s = settings()
    state = locate(s, volume_at(), "1.45")
    assert state == StateDir(STATE, DATA, volume="mcp-code-sandbox", subpath=True)
    kw = container_kwargs(
        spec(s), s, "img:1", instance="h", run_dir=s.run_dir / "k1-ab", state=state
    )
    mounts = {m["Target"]: m for m in kw["mounts"]}
    assert {m["Type"] for m in mounts.values()} == {"volume"}
    assert {m["Source"] for m in mounts.values()} == {"mcp-code-sandbox"}
    assert mounts["/mnt/data"]["VolumeOptions"] == {"NoCopy": True, "Subpath": "workspaces/slot1"}
    assert mounts["/run/mcs"]["VolumeOptions"]["Subpath"] == "run/k1-ab"
    assert mounts["/run/mcs"]["ReadOnly"] and not mounts["/mnt/data"]["ReadOnly"]
    assert kw["labels"]["mcp-code-sandbox.workspace"] == "workspaces/slot1"


def test_a_volume_on_an_older_engine_is_bound_from_the_engines_own_directory() -> None:
    s = settings()
    state = locate(s, volume_at(), "1.41")
    assert state.volume == "mcp-code-sandbox" and not state.subpath
    kw = container_kwargs(
        spec(s), s, "img:1", instance="h", run_dir=s.run_dir / "k1-ab", state=state
    )
    sources = {m["Target"]: (m["Type"], m["Source"]) for m in kw["mounts"]}
    assert sources == {
        "/mnt/data": ("bind", str(DATA / "workspaces" / "slot1")),
        "/run/mcs": ("bind", str(DATA / "run" / "k1-ab")),
    }


def test_a_state_dir_below_the_volume_mount_keeps_its_place_in_the_volume() -> None:
    s = settings()
    state = locate(s, volume_at(destination=STATE.parent), "1.45")
    assert (
        state.mount("/mnt/data", s.workspaces_dir / "x", read_only=False)["VolumeOptions"][
            "Subpath"
        ]
        == "mcp-code-sandbox/workspaces/x"
    )
    assert not locate(s, volume_at(driver="nfs-plugin"), "1.45").subpath


def test_a_bind_mount_maps_to_its_host_path_and_the_setting_wins() -> None:
    attrs = {"Mounts": [{"Type": "bind", "Source": "/srv/state", "Destination": str(STATE)}]}
    assert locate(settings(), attrs, "1.41") == StateDir(STATE, Path("/srv/state"))
    mapped = settings(docker_host_state_dir="/elsewhere")
    assert locate(mapped, volume_at(), "1.45") == StateDir(STATE, Path("/elsewhere"))
    assert locate(settings(), None, "") == StateDir(STATE, STATE)  # not the engine's container
    assert not StateDir(STATE, STATE).mapped


def test_a_state_dir_in_the_containers_own_layer_is_refused_with_the_fix() -> None:
    with pytest.raises(BackendUnavailable, match="-v mcp-code-sandbox:/var/lib/mcp-code-sandbox"):
        locate(settings(), {"Mounts": []}, "1.45")


def listed(mount_type: str, source: str, name: str = "", **labels: str) -> dict[str, Any]:
    return {
        "Labels": labels,
        "Mounts": [
            {"Type": mount_type, "Name": name, "Source": source, "Destination": d}
            for d in ("/mnt/data", "/run/mcs")
        ],
    }


def test_leftovers_in_the_volume_are_known_by_their_labels() -> None:
    s = settings()
    backend = DockerBackend(s, {}, instance="me")
    backend._state = locate(s, volume_at(), "1.45")
    labels = {"mcp-code-sandbox.rundir": "k1-ab", "mcp-code-sandbox.workspace": "workspaces/s1"}
    ours = listed("volume", str(DATA), "mcp-code-sandbox", **labels)
    assert backend._same_state_dir(ours)
    assert backend._bound_dir(ours, "/mnt/data") == STATE / "workspaces" / "s1"
    other_volume = listed("volume", "/var/lib/docker/volumes/x/_data", "x", **labels)
    assert not backend._same_state_dir(other_volume)
    assert backend._bound_dir(other_volume, "/mnt/data") is None
    escaping = listed("volume", str(DATA), "mcp-code-sandbox", **{
        "mcp-code-sandbox.workspace": "../../etc"
    })  # fmt: skip
    assert backend._bound_dir(escaping, "/mnt/data") is None
    # An older engine's binds of the volume's directory: mapped back by their paths.
    backend._state = locate(s, volume_at(), "1.41")
    bound = listed("bind", str(DATA / "workspaces" / "s1"))
    assert backend._bound_dir(bound, "/mnt/data") == STATE / "workspaces" / "s1"
