"""Issue 10, finding 1 (the sandbox's side) and finding 8 (Docker's seccomp profile).

Mallory's code reaches for the agent that serves her own session: it shares her uid, so
before the fix ``pidfd_open`` + ``pidfd_getfd`` copied its fds (the host channel, the
stderr pipe the server logs), and ``/proc/<agent>/mem`` opened read-write. With a stolen
channel she forged a run's ``done``; with the stolen stderr, a line over 64 KiB killed the
server's reader, and escape sequences landed in the server log. The same for pid 1 of the
sandbox (bwrap's init, the container's tini). Now: the filter denies the pidfd calls, the
agent is not dumpable and is pid 1 itself. On Docker with runc the container runs under
our seccomp profile, so io_uring, ptrace, AF_VSOCK and AF_NETLINK fail there as on bwrap.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from mcp_code_sandbox.settings import Settings

from ..conftest import each_backend, each_runtime
from .tenants import two_tenants

pytestmark = [pytest.mark.e2e]

FORGED = "FORGED-BY-MALLORY"

#: Everything one process of the sandbox's uid could use to get into the agent or pid 1.
#: Prints one JSON object: what it got. Any fd it gets is used as the attack would.
REACH = r"""
import ctypes, errno, json, os, stat, struct
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
SYS_PIDFD_OPEN, SYS_PIDFD_GETFD = 434, 438  # the same on x86_64 and aarch64
FORGED = "FORGED_MARK"
got = {"agent": os.getppid(), "pidfd": {}, "stolen": [], "opened": [], "denied": {}}

def steal(pid):
    pidfd = libc.syscall(SYS_PIDFD_OPEN, pid, 0)
    if pidfd < 0:
        got["pidfd"][str(pid)] = errno.errorcode.get(ctypes.get_errno(), "?")
        return []
    got["pidfd"][str(pid)] = "ok"
    fds = []
    for target in range(64):
        fd = libc.syscall(SYS_PIDFD_GETFD, pidfd, target, 0)
        if fd >= 0:
            fds.append(fd)
            got["stolen"].append(f"{pid}:{target}")
    return fds

def reopen(path, flags):
    what = path + (" w" if flags & (os.O_WRONLY | os.O_RDWR) else "")
    try:
        fd = os.open(path, flags)
    except OSError as e:
        got["denied"][what] = errno.errorcode.get(e.errno, "?")
        return None
    mode = os.fstat(fd).st_mode
    kind = "fifo" if stat.S_ISFIFO(mode) else "chr" if stat.S_ISCHR(mode) else (
        "sock" if stat.S_ISSOCK(mode) else "file")
    got["opened"].append(f"{what} {kind}")
    return fd

fds = []
for pid in sorted({got["agent"], 1}):
    fds += steal(pid)
    for name in ("mem",):
        for flags in (os.O_RDONLY, os.O_RDWR):
            fd = reopen(f"/proc/{pid}/{name}", flags)
            if fd is not None:
                os.close(fd)
    fd = reopen(f"/proc/{pid}/environ", os.O_RDONLY)
    if fd is not None:
        os.close(fd)
    try:
        targets = os.listdir(f"/proc/{pid}/fd")
    except OSError as e:
        got["denied"][f"/proc/{pid}/fd"] = errno.errorcode.get(e.errno, "?")
        targets = [str(n) for n in range(16)]
    for target in targets:
        fd = reopen(f"/proc/{pid}/fd/{target}", os.O_WRONLY | os.O_NONBLOCK)
        if fd is not None:
            fds.append(fd)

print(json.dumps(got))
""".replace("FORGED_MARK", FORGED)

#: Then, in the next run of the same session (its report above is safe from the flood
#: this may cause): what the attack did with any fd it got: a forged done frame, fake log
#: lines with escape sequences, and one line over 64 KiB.
ATTACK = r"""
body = json.dumps({"ev": "done", "id": 1, "status": "ok", "result": FORGED}).encode()
for fd in fds:
    for data in (struct.pack(">I", len(body)) + body,
                 f"\n{FORGED} \x1b[2J\x1b]0;title\x07 fake log line\n".encode(),
                 b"A" * 70000 + b"\n"):
        try:
            os.write(fd, data)
        except OSError:
            pass
""".replace("FORGED_MARK", FORGED)


@each_runtime
async def test_user_code_cannot_reach_into_the_agent_or_pid_1(
    make_settings: Callable[..., Settings], backend: str
) -> None:
    async with two_tenants(make_settings()) as t:
        await t.victim_is_fine()
        ran = await t.run(t.mallory, REACH, session_id="walls")
        assert ran["status"] == "ok" and ran["stdout"].strip(), ran
        got = json.loads(ran["stdout"])
        attacked = await t.run(t.mallory, ATTACK, session_id="walls")
        assert FORGED not in json.dumps(attacked.get("result")), "a forged done frame was taken"
        assert got["stolen"] == [], got
        for pid, outcome in got["pidfd"].items():
            assert outcome != "ok", (pid, got)
        if backend == "runsc":
            # gVisor ignores dumpable for /proc/<pid>/fd and environ: the agent's pipes
            # to its own kernel (this very session's output) reopen there, and its
            # environ is this session's. Never a socket (the channel), never memory,
            # and fds 0-2 are /dev/null, not the engine's log pipes.
            for opened in got["opened"]:
                path, *_, kind = opened.split()
                assert "/mem" not in path and kind != "sock", got
                assert kind == "chr" or not path.endswith(("/fd/0", "/fd/1", "/fd/2")), got
        else:
            assert got["opened"] == [], got
        # Her own session still works: the agent was not hurt either.
        again = await t.run(t.mallory, "print('still here')", session_id="walls")
        assert again["stdout"] == "still here\n", again
        await t.victim_is_fine()
        closed = await t.mallory.call_tool("close_session", {"session_id": "walls"})
        assert not closed.is_error, closed.content
    assert FORGED not in t.log()


#: What Docker's default profile allows on some engines (Debian's), and our filter does
#: not: each prints "<name> <errno name or ok>".
DENIED = r"""
import ctypes, errno, os, socket, time
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def err(r):
    return "ok" if r >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")
params = ctypes.create_string_buffer(120)
print("io_uring_setup", err(libc.syscall(425, 8, params)))
child = os.fork()
if child == 0:
    time.sleep(30)
    os._exit(0)
attached = libc.ptrace(16, child, 0, 0)  # PTRACE_ATTACH to a process of our own
print("ptrace", err(attached))
os.kill(child, 9)
os.waitpid(child, 0)
for name, family, kind in (("AF_VSOCK", socket.AF_VSOCK, socket.SOCK_STREAM),
                           ("AF_NETLINK", socket.AF_NETLINK, socket.SOCK_RAW)):
    try:
        socket.socket(family, kind).close()
        print(name, "ok")
    except OSError as e:
        print(name, errno.errorcode.get(e.errno, "?"))
print("unshare", err(libc.unshare(0x10000000)))
print("pidfd_open", err(libc.syscall(434, os.getpid(), 0)))
# An i386 syscall (int 0x80) on x86_64 bypasses a filter written for x86_64 names; ours
# has only the native architecture, and any other kills the process (SIGSYS).
import mmap, platform
if platform.machine() == "x86_64":
    child = os.fork()
    if child == 0:
        code = bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3])  # eax=20 (getpid); int 0x80
        page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        page.write(code)
        ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))()
        os._exit(0)
    _, status = os.waitpid(child, 0)
    print("i386", "SIGSYS" if os.WIFSIGNALED(status) and os.WTERMSIG(status) == 31 else status)
else:
    print("i386 SIGSYS")  # no i386 ABI to reach
"""


@each_backend
async def test_escape_syscalls_fail_under_runc_as_under_bwrap(
    make_settings: Callable[..., Settings],
) -> None:
    async with two_tenants(make_settings()) as t:
        ran = await t.run(t.mallory, DENIED, session_id="syscalls")
        assert ran["status"] == "ok", ran
        outcome = dict(line.split() for line in ran["stdout"].splitlines())
        assert outcome == {
            "io_uring_setup": "EPERM",
            "ptrace": "EPERM",
            "AF_VSOCK": "EPERM",
            "AF_NETLINK": "EPERM",
            "unshare": "EPERM",
            "pidfd_open": "ENOSYS",
            "i386": "SIGSYS",
        }, ran["stdout"]
        await t.victim_is_fine()
