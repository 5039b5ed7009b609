"""The bwrap backend for real: bubblewrap, the runtime env from `setup`, the real agent.

These tests FAIL (never skip) when bwrap or the runtime environment is missing: run
`mcp-code-sandbox setup` first (the README's test command and CI do). They talk to the
agent with raw exec frames over the backend's Channel.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from mcp_code_sandbox.backends.base import Limits, SandboxSpec
from mcp_code_sandbox.backends.bwrap.backend import BwrapBackend, BwrapSandbox
from mcp_code_sandbox.sessions.agent_client import AgentClient
from mcp_code_sandbox.sessions.executor import Cell
from mcp_code_sandbox.settings import Settings

from ..conftest import sandbox_owner

pytestmark = pytest.mark.bwrap

REPO = Path(__file__).resolve().parents[2]
LIMITS = Limits(memory_bytes=256 << 20, cpu=1.0, pids=64, tmp_bytes=8 << 20, file_bytes=64 << 20)


@pytest.fixture
def bwrap_backend(make_settings: Callable[..., Settings]) -> BwrapBackend:
    return BwrapBackend(make_settings())


@pytest.fixture
async def sandbox(bwrap_backend: BwrapBackend, host_uid: int | None) -> AsyncIterator[BwrapSandbox]:
    box = await start(bwrap_backend, "t1", host_uid)
    try:
        yield box
    finally:
        await bwrap_backend.stop(box)


async def start(
    backend: BwrapBackend, key: str, uid: int | None, limits: Limits = LIMITS
) -> BwrapSandbox:
    workspace = backend.settings.state_dir / "workspaces" / key
    workspace.mkdir(parents=True)
    if (owner := sandbox_owner(backend, uid)) is not None:
        os.chown(workspace, *owner)
    uid = uid if backend.per_sandbox_uids else None
    spec = SandboxSpec(
        key=key, owner="local", session_id=key, workspace=workspace, limits=limits, uid=uid
    )
    box = await backend.create(spec)
    assert isinstance(box, BwrapSandbox)
    return box


_ids = iter(range(1, 1 << 30))


async def run(
    box: BwrapSandbox, code: str, language: str = "python", timeout_s: float = 20
) -> tuple[str, str, dict[str, Any]]:
    run_id = next(_ids)
    await box.channel.send(
        {
            "op": "exec",
            "id": run_id,
            "language": language,
            "code": code,
            "timeout_s": timeout_s,
            "env": {},
        }
    )
    out: dict[str, list[str]] = {"stdout": [], "stderr": []}
    async with asyncio.timeout(timeout_s + 30):
        while (msg := await box.channel.receive()) is not None:
            if msg.get("ev") == "stream" and msg.get("id") == run_id:
                out[msg["name"]].append(msg["text"])
            elif msg.get("ev") == "done" and msg.get("id") == run_id:
                return "".join(out["stdout"]), "".join(out["stderr"]), msg
    raise AssertionError(f"channel closed during run; stderr so far: {out['stderr']}")


async def test_ready_identity_and_capabilities(sandbox: BwrapSandbox) -> None:
    assert sandbox.ready["ev"] == "ready" and sandbox.is_alive()
    out, _, done = await run(sandbox, "id -u; id -g; grep CapEff /proc/self/status", "bash")
    assert done["exit_code"] == 0
    assert out.split()[:2] == ["1000", "1000"] and "0000000000000000" in out


async def test_no_network(sandbox: BwrapSandbox) -> None:
    code = (
        "import socket, os\n"
        "try:\n    socket.create_connection(('1.1.1.1', 53), timeout=3); print('CONNECTED')\n"
        "except OSError as e:\n    print('refused', e)\n"
        "print(sorted(os.listdir('/sys/class/net')) if os.path.exists('/sys/class/net') "
        "else open('/proc/net/dev').read())\n"
    )
    out, _, _ = await run(sandbox, code)
    assert "CONNECTED" not in out and "refused" in out
    assert "lo" in out and "eth0" not in out


async def test_host_paths_are_invisible(sandbox: BwrapSandbox, bwrap_backend: BwrapBackend) -> None:
    paths = ["/root", "/home", str(REPO), str(bwrap_backend.settings.state_dir), "/run", "/var"]
    code = f"import os, json\nprint(json.dumps([os.path.exists(p) for p in {paths!r}]))"
    out, _, _ = await run(sandbox, code)
    assert out.strip() == "[" + ", ".join(["false"] * len(paths)) + "]"
    out, _, _ = await run(sandbox, "print(sorted(os.listdir('/')))")
    assert set(eval(out)) <= {
        "bin",
        "dev",
        "etc",
        "lib",
        "lib32",
        "lib64",
        "libx32",
        "mnt",
        "node_modules",  # a symlink to /opt/sandbox/node/node_modules (read-only)
        "opt",
        "proc",
        "sbin",
        "tmp",
        "usr",
    }


async def test_read_only_outside_workspace(sandbox: BwrapSandbox) -> None:
    script = (
        "for p in / /usr /etc /opt/sandbox /opt/sandbox/venv /mnt; do "
        "touch $p/probe 2>/dev/null && echo WROTE $p; done; "
        "touch /mnt/data/ok /tmp/ok && echo WORKSPACE_OK"
    )
    out, _, _ = await run(sandbox, script, "bash")
    assert "WROTE" not in out and "WORKSPACE_OK" in out


async def test_tmp_is_size_limited(sandbox: BwrapSandbox) -> None:
    script = "dd if=/dev/zero of=/tmp/big bs=1M count=32 2>&1; ls -l /tmp/big; df -k /tmp"
    out, _, _ = await run(sandbox, script, "bash")
    assert "No space left" in out
    assert os.stat(sandbox.spec.workspace).st_size >= 0  # the workspace is untouched


async def test_seccomp_denials(sandbox: BwrapSandbox) -> None:
    code = (
        "import ctypes, errno, socket\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "def err(r):\n    return errno.errorcode.get(ctypes.get_errno()) if r < 0 else 'ok'\n"
        "print('unshare', err(libc.unshare(0x10000000)))\n"
        "print('ptrace', err(libc.ptrace(16, 1, 0, 0)))\n"
        "print('mount', err(libc.mount(b'none', b'/tmp', b'tmpfs', 0, None)))\n"
        "try:\n    socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0); print('netlink ok')\n"
        "except OSError as e:\n    print('netlink', errno.errorcode[e.errno])\n"
        "import numpy; print('numpy', numpy.ones(3).sum())\n"
    )
    out, _, _ = await run(sandbox, code)
    for line in ("unshare EPERM", "ptrace EPERM", "mount EPERM", "netlink EPERM", "numpy 3.0"):
        assert line in out


async def test_host_processes_invisible(sandbox: BwrapSandbox) -> None:
    out, _, _ = await run(
        sandbox, "import os\nprint(len([p for p in os.listdir('/proc') if p.isdigit()]))"
    )
    assert int(out) < 15


async def test_no_stray_fds(sandbox: BwrapSandbox) -> None:
    # Not one host fd (seccomp data, passwd data, staged sources) reaches user code.
    # The trailing "true" keeps bash from exec'ing ls in place: $$ stays the shell.
    out, _, _ = await run(sandbox, "ls /proc/$$/fd; true", "bash")
    assert set(out.split()) <= {"0", "1", "2"}


async def test_the_agent_is_pid_1_and_reaps_orphans(sandbox: BwrapSandbox) -> None:
    # bwrap --as-pid-1: no bwrap init beside the agent. Orphans (a double fork) come to
    # the agent, which collects them when their SIGCHLD arrives: no zombie stays.
    orphans = "for i in 1 2 3 4 5; do (sleep 0.1 &); done; sleep 1; true"
    await run(sandbox, orphans, "bash")
    code = (
        "import os, time\n"
        "def zombies():\n"
        "    found = []\n"
        "    for p in filter(str.isdigit, os.listdir('/proc')):\n"
        "        try:\n"
        "            stat = open(f'/proc/{p}/stat').read()\n"
        "        except OSError:\n"
        "            continue\n"
        "        if stat[stat.rfind(')') + 2] == 'Z':\n"
        "            found.append(p)\n"
        "    return found\n"
        "print(os.getppid(), open('/proc/1/cmdline').read().split('\\0')[:5], zombies())\n"
    )
    out, _, _ = await run(sandbox, code)
    assert out.startswith("1 ") and "mcs_agent" in out, out
    assert out.rstrip().endswith("[]"), out


async def test_cgroup_files_show_limits(sandbox: BwrapSandbox, bwrap_backend: BwrapBackend) -> None:
    assert sandbox.cgroup is not None, bwrap_backend.cgroups.reasons
    files = {
        p.name: p.read_text().strip()
        for d in sandbox.cgroup.dirs
        for p in d.iterdir()
        if p.name
        in ("memory.limit_in_bytes", "memory.max", "pids.max", "cpu.max", "cpu.cfs_quota_us")
    }
    assert files.get("pids.max") == "64"
    assert str(256 << 20) in (files.get("memory.limit_in_bytes"), files.get("memory.max"))
    assert sandbox.proc.pid in sandbox.cgroup.pids()


async def test_memory_limit(bwrap_backend: BwrapBackend, host_uid: int | None) -> None:
    box = await start(bwrap_backend, "mem", host_uid)
    try:
        code = "b = bytearray(600 << 20)\nb[::4096] = b'x' * len(b[::4096])\nprint('ALLOCATED')"
        out, _, done = await run(box, code, timeout_s=30)
        assert "ALLOCATED" not in out and done["status"] != "ok"
        out, _, _ = await run(box, "print(1 + 1)")  # the agent survives or restarts
        assert out.strip() == "2"
    finally:
        await bwrap_backend.stop(box)


async def test_fork_bomb_is_bounded(bwrap_backend: BwrapBackend, host_uid: int | None) -> None:
    box = await start(bwrap_backend, "bomb", host_uid)
    try:
        _, _, done = await run(box, "bomb() { bomb | bomb & }; bomb; sleep 3", "bash", timeout_s=8)
        assert done["status"] in ("ok", "error", "timeout")
        assert box.cgroup is not None and len(box.cgroup.pids()) <= 64
    finally:
        await asyncio.wait_for(bwrap_backend.stop(box), 30)
    assert not box.is_alive()


async def test_stop_kills_everything(bwrap_backend: BwrapBackend, host_uid: int | None) -> None:
    box = await start(bwrap_backend, "stop", host_uid)
    await run(box, "sleep 300 & setsid sleep 300 & echo started", "bash")
    assert box.cgroup is not None
    dirs = list(box.cgroup.dirs)
    pids = box.cgroup.pids()
    assert len(pids) >= 3
    await bwrap_backend.stop(box)
    assert not box.is_alive()
    assert all(not d.exists() for d in dirs)
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
    await bwrap_backend.stop(box)  # a second stop of a gone sandbox does not raise


async def test_enforcement_and_leftovers(bwrap_backend: BwrapBackend) -> None:
    enforcement = bwrap_backend.describe().enforcement
    assert enforcement["network"] == "kernel" and enforcement["tmp"] == "kernel"
    assert set(enforcement) == {"memory", "cpu", "pids", "tmp", "file_size", "network"}
    assert all(
        lo.backend_id.split("-")[0] != str(os.getpid())
        for lo in await bwrap_backend.list_leftovers()
    )


async def test_an_exec_the_agent_refuses_ends_the_call(sandbox: BwrapSandbox) -> None:
    # The agent answers a malformed exec with an error event and no done: the client
    # must end the call with that, not wait for a done until its timeout.
    client = AgentClient(sandbox.channel)
    async with asyncio.timeout(10):
        outcome = await client.execute(Cell("cobol", "x", 60), lambda *_: None)
    assert outcome.status == "error" and outcome.error is not None
    assert outcome.error["name"] == "AgentError" and "cobol" in outcome.error["value"]
    _, _, done = await run(sandbox, "print('still serving')")
    assert done["status"] == "ok"
