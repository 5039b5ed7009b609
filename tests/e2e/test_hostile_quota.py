"""Issue 10, finding 2: the workspace quota binds the sandbox, on every runtime.

With a 64 MiB quota, mallory's code tries to fill the host's disk through /mnt/data: 360 MB
of ``fallocate`` (in files under the per-file limit, and with ``FALLOC_FL_KEEP_SIZE``,
which that limit does not cover), 360 MB of plain writes in many files, and the same into
``/mnt/data/.packages`` as ``pip`` would. What the host's disk holds for mallory's
workspace must stay within the quota (plus the filesystem's own metadata), the run says
so, uploads are refused until mallory deletes files (which a run can still do), and the
victim, on the same server, works and writes its own files up to its own quota.

On this host (root, loop devices) the quota is a filesystem per workspace; the checked
mode that servers which cannot mount use has its own test below (``checked``).
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mcp_code_sandbox.settings import Settings, load_settings

from ..conftest import each_backend, each_runtime
from .tenants import Tenants, structured, two_tenants

pytestmark = [pytest.mark.e2e]

MIB = 1 << 20
QUOTA = 64 * MIB
#: What a workspace of QUOTA may cost the host: its image is the quota plus ext4's
#: metadata (~6 %, :func:`~mcp_code_sandbox.workspace.volume.image_bytes`).
HOST_BOUND = QUOTA + QUOTA // 10

FALLOCATE = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
for i in range(6):  # 360 MB, each file under the per-file limit (RLIMIT_FSIZE = quota)
    fd = os.open(f"/mnt/data/alloc{i}.bin", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.posix_fallocate(fd, 0, 60 * 2**20)
    except OSError as e:
        print("posix_fallocate", i, e.strerror)
    finally:
        os.close(fd)
fd = os.open("/mnt/data/keep.bin", os.O_CREAT | os.O_WRONLY, 0o644)
FALLOC_FL_KEEP_SIZE = 1  # blocks without size: RLIMIT_FSIZE does not apply
if libc.fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, 360 * 2**20) != 0:
    print("keep_size", os.strerror(ctypes.get_errno()))
os.close(fd)
"""

WRITES = """
import os
chunk = b"x" * 2**20
written = 0
os.makedirs("{where}", exist_ok=True)
for i in range(90):  # 90 files of 4 MiB: 360 MiB
    try:
        with open(f"{where}/f{{i}}.bin", "wb") as out:
            for _ in range(4):
                out.write(chunk)
                written += len(chunk)
    except OSError as e:
        print("stopped:", e.strerror)
        break
print("written", written)
"""

CLEAN = """
import os, shutil
for name in os.listdir("/mnt/data"):
    path = os.path.join("/mnt/data", name)
    shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
print("clean")
"""


def slot_of(settings: Settings, owner: str) -> str:
    for record in settings.sessions_dir.glob("*.json"):
        data = json.loads(record.read_text())
        if data["owner"] == owner:
            return str(data["slot"])
    raise AssertionError(f"no session of {owner}")


def host_bytes(settings: Settings, slot: str) -> int:
    """What the host's disk holds for a workspace: its image's allocated blocks when it
    has one (mounted, the directory shows the image's filesystem), else the blocks of
    everything in its directory (``du``)."""
    image = settings.state_dir / "volumes" / f"{slot}.img"
    if image.exists():
        return image.stat().st_blocks * 512
    total = 0
    for top, dirs, files in os.walk(settings.workspaces_dir / slot):
        for name in dirs + files:
            total += os.lstat(os.path.join(top, name)).st_blocks * 512
    return total


async def upload(t: Tenants, who: Any, session_id: str, name: str, size: int) -> Any:
    content = base64.b64encode(b"u" * size).decode()
    return await who.call_tool(
        "upload_file",
        {"session_id": session_id, "filename": name, "content_base64": content, "overwrite": True},
    )


async def attack(t: Tenants, code: str) -> dict[str, Any]:
    """Run ``code`` as mallory; the host keeps her workspace within the quota, the result
    says it is over (or the code met a full disk), and uploads are refused."""
    ran = await t.run(t.mallory, code, session_id="hog", timeout_s=120)
    used = host_bytes(t.settings, slot_of(t.settings, "mallory"))
    assert used <= HOST_BOUND, f"mallory's workspace costs the host {used} bytes: {ran}"
    said = (ran.get("notice") or "") + ran["stdout"] + json.dumps(ran.get("error"))
    assert "quota" in said or "No space left" in said, ran
    refused = await upload(t, t.mallory, "hog", "more.bin", 2 * MIB)
    assert refused.is_error and "quota_exceeded" in str(refused.content), refused
    # Deleting is always possible, with run_code; then the workspace takes files again.
    cleaned = await t.run(t.mallory, CLEAN, session_id="hog")
    assert cleaned["stdout"] == "clean\n" and not cleaned.get("notice"), cleaned
    assert not (await upload(t, t.mallory, "hog", "small.bin", MIB)).is_error
    return ran


@each_runtime
@pytest.mark.skipif(os.geteuid() != 0, reason="a filesystem per workspace needs a root server")
async def test_a_session_cannot_fill_the_hosts_disk(make_settings: Callable[..., Settings]) -> None:
    settings = make_settings(workspace_quota_bytes=QUOTA)
    env = {"SANDBOX_WORKSPACE_QUOTA_BYTES": str(QUOTA), "SANDBOX_EXEC_TIMEOUT_S": "120"}
    async with two_tenants(settings, **env) as t:
        await attack(t, FALLOCATE)
        await attack(t, WRITES.format(where="/mnt/data/many"))
        pip = "/mnt/data/.packages/python/lib/python3.11/site-packages/evil"
        await attack(t, WRITES.format(where=pip))
        # The victim works, and fills its own workspace up to its own quota.
        await t.victim_is_fine("own")
        mine = await t.run(t.victim, WRITES.format(where="/mnt/data/mine").replace("90", "12"),
                           session_id="own")  # fmt: skip
        assert mine["status"] == "ok" and "written 50331648" in mine["stdout"], mine
        assert not mine.get("notice"), mine
        assert not (await upload(t, t.victim, "own", "up.bin", 8 * MIB)).is_error
        listed = structured(await t.victim.call_tool("list_files", {"session_id": "own"}))
        assert "up.bin" in {e["path"] for e in listed["entries"]}


CREEP = """
import time
chunk = b"x" * 2**20
for i in range({files}):  # 1 MiB files, a little at a time: the watch must catch it
    with open(f"/mnt/data/{prefix}{{i}}.bin", "wb") as out:
        out.write(chunk)
    time.sleep(0.02)
print("wrote them all")
"""


@each_backend
async def test_checked_mode_stops_the_run_and_refuses_writes(
    make_settings: Callable[..., Settings],
) -> None:
    """Where the server cannot mount (not root, or in a container without
    CAP_SYS_ADMIN), the quota is checked: the run that writes past it is stopped, and
    every write after that is refused until files are deleted."""
    quota = 16 * MIB
    settings = make_settings(workspace_quota_bytes=quota)
    env = {"SANDBOX_WORKSPACE_QUOTA_BYTES": str(quota), "SANDBOX_WORKSPACE_QUOTA_MODE": "checked"}
    async with two_tenants(settings, **env) as t:
        ran = await t.run(t.mallory, CREEP.format(files=300, prefix="a"), session_id="hog",
                          timeout_s=120)  # fmt: skip
        assert ran["status"] == "error" and ran["error"]["name"] == "QuotaExceeded", ran
        assert "wrote them all" not in ran["stdout"]
        assert "more than its quota" in (ran.get("notice") or ""), ran
        assert not list((settings.state_dir / "volumes").glob("*.img")), "no image when checked"
        refused = await upload(t, t.mallory, "hog", "more.bin", 1024)
        assert refused.is_error and "quota_exceeded" in str(refused.content), refused
        # Over its quota, a run may not grow the workspace at all...
        again = await t.run(t.mallory, CREEP.format(files=100, prefix="b"), session_id="hog")
        assert again["status"] == "error" and again["error"]["name"] == "QuotaExceeded", again
        # ...but it may delete, and then the workspace takes files again.
        cleaned = await t.run(t.mallory, CLEAN, session_id="hog")
        assert cleaned["status"] == "ok" and not cleaned.get("notice"), cleaned
        assert not (await upload(t, t.mallory, "hog", "small.bin", MIB)).is_error
        await t.victim_is_fine()
    assert "workspace quota" in t.log() and "checked" in t.log()


def test_host_bytes_counts_a_plain_directory(tmp_path: Path) -> None:
    """The measure the attack test relies on sees what a plain workspace holds."""
    settings = load_settings({"state_dir": tmp_path})
    ws = settings.workspaces_dir / "slot"
    ws.mkdir(parents=True)
    (ws / "f").write_bytes(b"x" * MIB)
    assert host_bytes(settings, "slot") >= MIB
