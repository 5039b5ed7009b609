"""Spare workspace images' directories (``workspace/spares.py``): each server keeps its
own under ``.spares/<instance>/``, and neither its close nor another's recovery touches a
live server's. Plain files stand in for the images: formatting real ones (``mkfs``) is
tests/integration/test_spare_images.py's."""

from __future__ import annotations

from pathlib import Path

from mcp_code_sandbox.workspace.spares import SPARES_DIR, SpareImages, sweep


def spares_of(volumes: Path, instance: str, count: int = 2) -> Path:
    directory = volumes / SPARES_DIR / instance
    directory.mkdir(parents=True)
    for n in range(count):
        (directory / f"{n:016x}.img").write_bytes(b"\0" * 16)
    return directory


def test_recovery_deletes_dead_servers_spares_and_keeps_live_ones(tmp_path: Path) -> None:
    live, dead = spares_of(tmp_path, "host-1-live"), spares_of(tmp_path, "host-2-dead")
    stray = tmp_path / SPARES_DIR / "0123456789abcdef.img"  # from before per-server directories
    stray.write_bytes(b"\0")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.img").write_bytes(b"\0")
    (tmp_path / SPARES_DIR / "host-3-live").symlink_to(outside)  # a link is never a server's
    sweep(tmp_path, lambda instance: instance.endswith("-live"))
    assert sorted(p.name for p in (tmp_path / SPARES_DIR).iterdir()) == ["host-1-live"]
    assert len(list(live.iterdir())) == 2 and not dead.exists()
    assert (outside / "keep.img").exists()  # the link went, not what it points to


def test_recovery_removes_the_spares_directory_once_empty(tmp_path: Path) -> None:
    spares_of(tmp_path, "host-2-dead")
    sweep(tmp_path, lambda _: False)
    assert list(tmp_path.iterdir()) == []
    sweep(tmp_path, lambda _: False)  # nothing there: nothing to do
    sweep(tmp_path / "missing", lambda _: False)


def test_a_server_closing_deletes_only_its_own_spares(tmp_path: Path) -> None:
    mine, theirs = spares_of(tmp_path, "host-1-me"), spares_of(tmp_path, "host-2-other")
    SpareImages(mine, 4096, keep=0).close()
    assert not mine.exists() and len(list(theirs.iterdir())) == 2
    last = SpareImages(theirs, 4096, keep=0)
    assert not last.take(tmp_path / "ws.img", 4096)  # keep 0: the caller formats its own
    last.close()
    last.close()
    assert list(tmp_path.iterdir()) == []  # the last server's close leaves no directory
