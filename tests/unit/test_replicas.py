"""What replicas on one state directory coordinate with (``sessions.replicas``): the
per-session lease of a handover, and the control socket a replica is asked to let go of
a session on. Real files, locks, processes and Unix sockets; the handover itself is in
test_replicas_fake.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from mcp_code_sandbox.backends.unix_sockets import SocketDir
from mcp_code_sandbox.sessions.replicas import (
    LEASES_DIR,
    REPLICAS_DIR,
    Control,
    Lease,
    ask_to_let_go,
)

from ..conftest import long_dir

KEY = "s" + "0" * 31


async def test_a_lease_is_one_holders_at_a_time(tmp_path: Path) -> None:
    first = await Lease.take(tmp_path, KEY, wait_s=1.0)
    with pytest.raises(TimeoutError):
        await Lease.take(tmp_path, KEY, wait_s=0.05)
    other = await Lease.take(tmp_path, "s" + "1" * 31, wait_s=1.0)  # another session's
    other.release()
    waiting = asyncio.create_task(Lease.take(tmp_path, KEY, wait_s=30.0))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    first.release()
    first.release()
    async with await waiting:  # it had the file its holder removed: it opened the new one
        assert [p.name for p in (tmp_path / LEASES_DIR).iterdir()] == [KEY]
    assert list((tmp_path / LEASES_DIR).iterdir()) == []  # no file piles up per session


#: Takes the lease ``argv[2]`` under the run dir ``argv[1]`` and holds it until killed.
_HOLD = """
import asyncio, sys
from pathlib import Path
from mcp_code_sandbox.sessions.replicas import Lease
lease = asyncio.run(Lease.take(Path(sys.argv[1]), sys.argv[2], 10.0))
print("held", flush=True)
sys.stdin.read()
"""


async def test_a_lease_goes_with_the_process_that_held_it(tmp_path: Path) -> None:
    """A replica killed mid-handover leaves no session locked for ever."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(tmp_path), KEY],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"held\n"
        with pytest.raises(TimeoutError):
            await Lease.take(tmp_path, KEY, wait_s=0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    async with await Lease.take(tmp_path, KEY, wait_s=10.0):
        pass


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """Longer than a Unix socket's address may be (108): the socket is reached by its
    directory's fd, not by its path."""
    path = long_dir(tmp_path, 150)
    assert len(str(path / REPLICAS_DIR / "replica-1.sock")) > 108
    return path


@contextlib.asynccontextmanager
async def control(run_dir: Path, answer: dict[tuple[str, str], bool]) -> AsyncIterator[list[str]]:
    """Replica ``replica-1``'s control socket, answering from ``answer``; yields the
    requests it got, as ``owner/session``."""
    asked: list[str] = []

    async def let_go(owner: str, session_id: str) -> bool:
        asked.append(f"{owner}/{session_id}")
        if session_id == "slow":
            await asyncio.sleep(30)
        return answer.get((owner, session_id), False)

    server = Control(run_dir, "replica-1", let_go)
    await server.start()
    try:
        yield asked
    finally:
        await server.aclose()


async def test_a_replica_answers_whether_it_let_go(run_dir: Path) -> None:
    async with control(run_dir, {("alice", "conv"): True}) as asked:
        assert await ask_to_let_go(run_dir, "replica-1", "alice", "conv", 5.0) is True
        assert await ask_to_let_go(run_dir, "replica-1", "alice", "other", 5.0) is False
        assert await ask_to_let_go(run_dir, "replica-1", "bob", "conv", 5.0) is False
        assert asked == ["alice/conv", "alice/other", "bob/conv"]
        sock = run_dir / REPLICAS_DIR / "replica-1.sock"
        assert (sock.stat().st_mode & 0o777, (run_dir / REPLICAS_DIR).stat().st_mode & 0o777) == (
            0o600,
            0o700,
        )
    assert not (run_dir / REPLICAS_DIR / "replica-1.sock").exists()  # gone with its server
    assert await ask_to_let_go(run_dir, "replica-1", "alice", "conv", 5.0) is None


async def test_no_answer_from_a_server_that_is_no_replica_or_is_dead(run_dir: Path) -> None:
    assert await ask_to_let_go(run_dir, "replica-1", "alice", "conv", 5.0) is None
    (run_dir / REPLICAS_DIR).mkdir()
    assert await ask_to_let_go(run_dir, "replica-1", "alice", "conv", 5.0) is None
    with SocketDir(run_dir / REPLICAS_DIR) as sockets:  # a killed replica's socket file
        sockets.listen("replica-2.sock", mode=0o600).close()
    assert (run_dir / REPLICAS_DIR / "replica-2.sock").exists()
    assert await ask_to_let_go(run_dir, "replica-2", "alice", "conv", 5.0) is None


async def test_a_replica_still_running_a_call_makes_the_asker_wait_out(run_dir: Path) -> None:
    async with control(run_dir, {("alice", "conv"): True}):
        with pytest.raises(TimeoutError):
            await ask_to_let_go(run_dir, "replica-1", "alice", "slow", 0.1)
        assert await ask_to_let_go(run_dir, "replica-1", "alice", "conv", 5.0) is True


@pytest.mark.parametrize(
    "line",
    [
        b"not json\n",
        b'{"let_go": [1, 2]}\n',
        b'{"let_go": "alice"}\n',
        b'{"let_go": ["alice", "conv", "x"]}\n',
        b"[]\n",
        b"x" * 5000 + b"\n",  # past the line limit
        b"",  # a peer that goes away
    ],
)
async def test_nonsense_on_the_control_socket_is_not_answered_and_harms_nothing(
    run_dir: Path, line: bytes
) -> None:
    async with control(run_dir, {("alice", "conv"): True}) as asked:
        with SocketDir(run_dir / REPLICAS_DIR) as sockets:
            peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            peer.connect(sockets.address("replica-1.sock"))
        reader, writer = await asyncio.open_unix_connection(sock=peer)
        writer.write(line)
        await writer.drain()
        if not line:
            writer.write_eof()
        assert await asyncio.wait_for(reader.read(), 5.0) == b""  # closed, no answer
        writer.close()
        assert asked == []
        assert await ask_to_let_go(run_dir, "replica-1", "alice", "conv", 5.0) is True
