"""Several HTTP servers on one state directory, as replicas: any of them serves any session.

Started with ``SANDBOX_REPLICA=true`` (``--replica``), HTTP servers on one state
directory share its sessions (a server without it stays alone there: :mod:`.holder`).
The rules:

- **The record is the truth.** A session's record (:mod:`.records`) names the replica that
  holds it now (``instance``). Every replica reads records; only the holder writes one.
- **One holder at a time.** The holder alone talks to the session's sandbox (its agent
  accepts one host connection), runs its calls one at a time in arrival order, pauses,
  resumes, moves or ends it. A replica that gets a call for a session another replica
  holds takes it over before it runs the call: a *handover*.
- **A handover** is done under the session's :class:`Lease` (an ``flock`` on
  ``run_dir/leases/<key>``: one handover of a session at a time, and the kernel drops it
  with a holder that dies). The taker starts listening on the sandbox's channel, then asks
  the holder, over the holder's control socket (:class:`Control`,
  ``run_dir/replicas/<instance>.sock``), to let go. The holder waits for the calls it has
  already queued for the session (they arrived first), writes the record as it stands,
  closes its end of the channel and forgets the session; the agent reconnects to the taker
  at once (:mod:`mcp_code_sandbox.agent.hostlink`), which writes the record as its own.
  Calls queued on the holder after that ask for the session back in turn, so calls run
  in the order they reached the replicas' queues.
- **A dead holder** (SIGKILL, a clean stop) holds nothing: its sessions' containers run on
  (their agents wait for a host) and their records stay. The next replica that gets a
  call for one of them, and every replica's reaper once a pass, takes over what dead
  servers left exactly as a restarted server does (:func:`.recovery.recover`, under its
  lock, so two replicas never both take a session).
- **A clean stop of a replica** lets go of its sessions without pausing them: a rolling
  restart (start a new replica, stop the old) pauses nothing.
- **Network crosses a handover**: the record names the sandbox's proxy directory and
  hosts; the holder leaves the directory, and the taker opens a proxy there again.
- **Limits count every replica** (:class:`.room.Others`): the others' running sessions
  are read from their records before a new session and at each reaper pass, and room is
  made by taking the longest idle over and pausing it, as one server would.
- **One warm pool**: a replica whose pool is empty borrows a warm sandbox from another,
  whose pool record is rewritten as the borrower's before it lets go of it.

Why a handover and not an agent that takes several host connections: the agent's channel
is a Unix socket the server listens on and the agent connects to (under gVisor a socket
the sandbox made is not visible on the host), so only one replica can be on the other
end at a time; a handover costs one reconnect only when a call lands on a replica that is
not the session's last, keeps every call on one ordered channel, and needs nothing new
from the agent or the image.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import fcntl
import json
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import structlog

from mcp_code_sandbox import tracing
from mcp_code_sandbox.backends.base import Backend
from mcp_code_sandbox.backends.unix_sockets import SocketDir
from mcp_code_sandbox.errors import SessionBusy
from mcp_code_sandbox.metrics import Metrics
from mcp_code_sandbox.sessions import records
from mcp_code_sandbox.sessions.agent_client import AgentClient
from mcp_code_sandbox.sessions.ids import session_key
from mcp_code_sandbox.sessions.lifecycle import Phase, transition
from mcp_code_sandbox.sessions.mounts import MountedWorkspaces
from mcp_code_sandbox.sessions.pausing import Pausing
from mcp_code_sandbox.sessions.pool import Pooled, WarmPool
from mcp_code_sandbox.sessions.recovery import (
    Adopted,
    SpecFor,
    Unsandboxed,
    adopted_session,
    alive,
    dead_instances,
    kept_session,
    take_lent,
    take_over,
    unsandboxed_session,
)
from mcp_code_sandbox.sessions.sandboxes import Sandboxes
from mcp_code_sandbox.sessions.session import Session
from mcp_code_sandbox.sessions.table import SessionTable
from mcp_code_sandbox.sessions.uids import UidPool
from mcp_code_sandbox.settings import Settings

__all__ = [
    "LEASES_DIR",
    "REPLICAS_DIR",
    "Control",
    "Lease",
    "Replicas",
    "ask_to_lend",
    "ask_to_let_go",
]

log = structlog.get_logger("mcp_code_sandbox.sessions.replicas")

#: Under ``run_dir``: one lock file per session key, held during a handover.
LEASES_DIR = "leases"
#: Under ``run_dir``: each live replica's control socket, ``<instance>.sock``.
REPLICAS_DIR = "replicas"
#: Between two tries of a lease another replica holds: a handover takes milliseconds,
#: and a call waiting on one should not pay much more than that.
_LEASE_POLL_S = 0.002
_LEASE_POLL_MAX_S = 0.02
#: How long taking over another replica's idle session to pause it may wait for that
#: replica: a session in a call there is not idle, and the next one is tried instead.
_FETCH_WAIT_S = 2.0
#: How old the other replicas' running sessions, as last read, may be when a new session
#: counts them toward the limits: their records are all read again past it. Longer saves
#: reads in a burst; shorter lets a burst on two replicas overshoot a limit less.
_RECENT_S = 1.0
#: How long a replica with an empty pool waits for another to lend it a warm sandbox; a
#: lend is a few milliseconds, and past this a cold start is as quick.
_LEND_S = 0.5
#: A request or an answer on a control socket is one short JSON line.
_LINE_LIMIT = 4096

#: ``let_go(owner, session_id)``: True when this replica held the session and has let
#: it go (its record is written, its channel closed); False when it did not hold it.
LetGo = Callable[[str, str], Awaitable[bool]]
#: ``lend(borrower)``: the slot of a warm sandbox of this replica's pool now the
#: borrower's (its record says so, its channel is closed); ``None``: none is ready.
Lend = Callable[[str], Awaitable[str | None]]


class Lease:
    """The exclusive ``flock`` on ``run_dir/leases/<key>``: one handover (or making) of a
    session at a time across replicas. The kernel drops it when its holder dies, however
    it dies. Its holder removes the file as it lets go, so none piles up: a waiter that
    then gets the lock of a file no longer at that path opens the path again."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd: int | None = fd
        self.path = path

    @classmethod
    async def take(cls, run_dir: Path, key: str, wait_s: float) -> Lease:
        """Wait (polling, never blocking the loop) for the lease; ``TimeoutError`` after
        ``wait_s``."""
        directory = run_dir / LEASES_DIR
        directory.mkdir(mode=0o700, exist_ok=True)
        path = directory / key
        pause = _LEASE_POLL_S
        async with asyncio.timeout(wait_s):
            while True:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    while True:
                        try:
                            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                            break
                        except BlockingIOError:
                            await asyncio.sleep(pause)
                            pause = min(pause * 2, _LEASE_POLL_MAX_S)
                    if _same_file(fd, path):
                        return cls(fd, path)
                except BaseException:
                    os.close(fd)
                    raise
                os.close(fd)  # its holder removed it as it let go: the path's new file

    def release(self) -> None:
        if self._fd is not None:
            self.path.unlink(missing_ok=True)  # while locked: see the class docstring
            os.close(self._fd)
            self._fd = None

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


class Control:
    """This replica's control socket, where other replicas ask it to let go of a session.

    Only the server's uid can connect (the run dir and the socket are its own, mode 0700
    and 0600); a request is one JSON line, ``{"let_go": [owner, session_id]}`` (answered
    ``{"held": bool}``) or ``{"lend": borrower}`` (a warm sandbox: ``{"slot": slot}``,
    ``null`` when none is ready)."""

    def __init__(
        self, run_dir: Path, instance: str, let_go: LetGo, lend: Lend | None = None
    ) -> None:
        self.directory = run_dir / REPLICAS_DIR
        self.name = f"{instance}.sock"
        self._let_go = let_go
        self._lend = lend
        self._server: asyncio.Server | None = None
        self._sockets: SocketDir | None = None

    async def start(self) -> None:
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._sockets = SocketDir(self.directory)
        self._sockets.unlink_socket(self.name)
        listener = self._sockets.listen(self.name, mode=0o600)
        listener.listen(64)  # every other replica may ask at once
        self._server = await asyncio.start_unix_server(
            self._serve, sock=listener, limit=_LINE_LIMIT
        )

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None
        if self._sockets is not None:
            with contextlib.suppress(OSError):
                self._sockets.unlink_socket(self.name)
            self._sockets.close()
            self._sockets = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await reader.readuntil(b"\n")
            request = json.loads(line)
            answer: dict[str, object]
            if isinstance(request, dict) and "lend" in request:
                borrower = request["lend"]
                if not isinstance(borrower, str) or self._lend is None:
                    raise ValueError("a borrower is a replica's name")
                answer = {"slot": await self._lend(borrower)}
            else:
                owner, session_id = request["let_go"]
                if not isinstance(owner, str) or not isinstance(session_id, str):
                    raise ValueError("owner and session id are strings")
                answer = {"held": await self._let_go(owner, session_id)}
            writer.write(json.dumps(answer).encode() + b"\n")
            await writer.drain()
        except Exception as exc:  # a peer of ours sent nonsense, or went away
            log.warning("a replica's request failed", error=repr(exc))
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


async def ask_to_let_go(
    run_dir: Path, instance: str, owner: str, session_id: str, wait_s: float
) -> bool | None:
    """Ask replica ``instance`` to let go of a session; its answer (``held``), or
    ``None`` when it does not answer (not a replica, or dead): then it holds nothing
    that runs, and what it left is taken over as a dead server's. ``TimeoutError`` after
    ``wait_s``: it still runs a call of the session."""
    answer = await _ask(run_dir, instance, {"let_go": [owner, session_id]}, wait_s)
    return None if answer is None else answer.get("held") is True


async def ask_to_lend(run_dir: Path, instance: str, borrower: str, wait_s: float) -> str | None:
    """Ask replica ``instance`` for a warm sandbox of its pool, for ``borrower``: its slot,
    or ``None`` (none ready, or no answer within ``wait_s``)."""
    try:
        answer = await _ask(run_dir, instance, {"lend": borrower}, wait_s)
    except TimeoutError:
        return None
    slot = None if answer is None else answer.get("slot")
    return slot if isinstance(slot, str) and records.SLOT_PATTERN.fullmatch(slot) else None


async def _ask(
    run_dir: Path, instance: str, request: dict[str, object], wait_s: float
) -> dict[str, object] | None:
    """One request to replica ``instance``, its answer; ``None`` when it does not answer
    (not a replica, or dead); ``TimeoutError`` after ``wait_s``."""
    try:
        with SocketDir(run_dir / REPLICAS_DIR) as sockets:
            async with asyncio.timeout(wait_s):
                reader, writer = await asyncio.open_unix_connection(
                    sockets.address(f"{instance}.sock"), limit=_LINE_LIMIT
                )
                try:
                    writer.write(json.dumps(request).encode() + b"\n")
                    await writer.drain()
                    answer = json.loads(await reader.readuntil(b"\n"))
                finally:
                    writer.close()
    except TimeoutError:
        raise  # to the caller: the holder is busy, not gone (TimeoutError is an OSError)
    except (OSError, asyncio.IncompleteReadError, ValueError):
        return None
    return answer if isinstance(answer, dict) else None


class Replicas:
    """This server's part in the registry its replicas share (see the module docstring):
    taking sessions over, letting them go, and seeing those the others hold. Owned by the
    session manager of a replica; ``recover`` is the manager's (it takes over, and adds,
    everything dead servers left)."""

    def __init__(
        self,
        settings: Settings,
        backend: Backend,
        table: SessionTable,
        sandboxes: Sandboxes,
        *,
        uids: UidPool | None,
        spec_for: SpecFor,
        pausing: Pausing,
        mounts: MountedWorkspaces,
        pool: WarmPool,
        recover: Callable[[], Awaitable[None]],
        metrics: Metrics,
    ) -> None:
        self.settings = settings
        self.backend = backend
        self.table = table
        self.sandboxes = sandboxes
        self.uids = uids
        self.spec_for = spec_for
        self.pausing = pausing
        self.mounts = mounts
        self.pool = pool
        self._recover = recover
        self.metrics = metrics
        self.instance = table.instance
        self._control = Control(settings.run_dir, self.instance, self.give_up, self.lend)
        #: Running sessions the other replicas hold, by owner, as their records said at
        #: the last look (:meth:`refresh`): they count toward the limits here too.
        self._running_elsewhere: collections.Counter[str] = collections.Counter()
        self._refreshed_at = -_RECENT_S

    async def start(self) -> None:
        self.metrics.replica(self.instance)
        await self._control.start()

    async def aclose(self) -> None:
        await self._control.aclose()

    # -- taking a session over -------------------------------------------------------

    async def take(self, owner: str, session_id: str, wait_s: float) -> None:
        """Make ``owner``'s session this replica's when another holds it, or a dead
        server left it; nothing when this one holds it, or no record names it (a new
        session, or one that ended). ``SessionBusy`` when its holder is still running a
        call after ``wait_s``."""
        async with self.held(owner, session_id, wait_s):
            pass

    @contextlib.asynccontextmanager
    async def held(self, owner: str, session_id: str, wait_s: float) -> AsyncIterator[None]:
        """:meth:`take`, then the session's lease held for the ``with`` block: a session
        no record names yet is made there, and a replica asked for the same new id at
        the same moment takes the one made here over instead of making a second."""
        if self.table.get(owner, session_id) is not None:
            yield
            return
        key = session_key(owner, session_id)
        try:
            lease = await Lease.take(self.settings.run_dir, key, wait_s)
        except TimeoutError:
            raise SessionBusy(
                f"session {session_id} is still running a call on another replica after "
                f"{wait_s:.0f} s of waiting; wait for it to finish, or use another session"
            ) from None
        try:
            if self.table.get(owner, session_id) is None:
                try:
                    await self._take_over(owner, session_id, key, wait_s)
                except TimeoutError:
                    raise SessionBusy(
                        f"session {session_id} is still running a call on another replica "
                        f"after {wait_s:.0f} s of waiting; wait for it to finish, or use "
                        "another session"
                    ) from None
            yield
        finally:
            lease.release()

    async def _take_over(self, owner: str, session_id: str, key: str, wait_s: float) -> None:
        record = await asyncio.to_thread(self._record_of, key, owner, session_id)
        if record is None:
            return  # a new session, or one that ended
        # Ours on record but not held: this replica let it go to one that gave up waiting
        # before taking it. Its sandbox waits for a host: taken back like another's.
        mine = record.instance == self.instance
        holder = self.settings.run_dir / f"{record.instance}.pid"
        if not mine and not await asyncio.to_thread(alive, holder):
            with tracing.span("take over from a dead server"):
                await self._recover()  # what dead servers left: all of it
            return

        async def let_go() -> records.SessionRecord | None:
            run_dir, instance = self.settings.run_dir, record.instance
            if not mine:
                held = await ask_to_let_go(run_dir, instance, owner, session_id, wait_s)
                if held is None and await asyncio.to_thread(alive, holder):
                    raise SessionBusy(
                        f"session {session_id} is held by a replica that does not answer "
                        "(it may be shutting down); try again in a few seconds"
                    )
            return await asyncio.to_thread(self._record_of, key, owner, session_id)

        with tracing.span("handover"):
            taken = await take_over(
                self.settings,
                self.backend,
                record,
                instance=self.instance,
                spec_for=self.spec_for,
                uids=self.uids,
                let_go=let_go,
            )
        if isinstance(taken, str):
            self.table.tombstone(owner, session_id, taken)
            return
        if taken is None:
            return
        if isinstance(taken, Adopted):
            await self._network_again(taken)
            session = adopted_session(self.table, taken)
        elif isinstance(taken, Unsandboxed):
            session = unsandboxed_session(self.table, taken)
        else:
            session = kept_session(self.table, taken)
        self.table.add(session)
        self.table.save(session, force=True)
        self.metrics.handed_over("in")

    async def _network_again(self, taken: Adopted) -> None:
        """A taken-over sandbox that had network gets its proxy again, where it left it."""
        egress, record = taken.record.egress, taken.record
        if egress is None:
            return
        hosts = None if egress["hosts"] is None else tuple(egress["hosts"])
        proxies = self.sandboxes.egress
        reopened = await proxies.reopen(egress["dir"], hosts, record.owner, record.session_id)
        if reopened is not None:
            sandbox = taken.sandbox
            sandbox.spec = dataclasses.replace(sandbox.spec, egress=reopened)

    def _record_of(self, key: str, owner: str, session_id: str) -> records.SessionRecord | None:
        """The record of ``owner``'s session that a service holds (blocking)."""
        for record in records.records_of(self.settings.sessions_dir, key):
            if (record.owner, record.session_id) == (owner, session_id) and record.handover:
                return record
        return None

    # -- letting a session go ----------------------------------------------------------

    async def give_up(self, owner: str, session_id: str) -> bool:
        """Another replica asks for ``owner``'s session: after the calls queued for it
        here (they arrived first), write its record and let it go."""
        session = self.table.get(owner, session_id)
        if session is None:
            return False
        async with session.lock:
            if self.table.get(owner, session_id) is not session or session.closed:
                return False
            await self.hand_on(session)
        self.metrics.handed_over("out")
        return True

    async def hand_on(self, session: Session) -> None:
        """Let go of ``session`` without ending or pausing it (its lock held, or at
        shutdown): its record written as it stands, its sandbox left running for the
        next holder. Its runners are stopped (they hold nothing but the workspace's
        files) and its network proxy closed (the next holder takes it without network,
        as a restart does)."""
        if session.sandbox is None and not session.runners:
            await self.pausing.unmount(session)  # a paused one mounted for a file call
        self.table.save(session, force=True)
        self.table.forget(session)
        session.phase = transition(session.phase, Phase.HANDED_ON)
        for runner in list(session.runners.values()):
            await self.sandboxes.free(session, runner)
        session.runners.clear()
        sandbox, session.sandbox, session.agent = session.sandbox, None, None
        if sandbox is not None:
            sandbox.channel.close()
            # Its directory stays (the sandbox has it bound): the next holder's proxy
            # listens there again (see ``take``).
            await self.sandboxes.egress.close(sandbox.spec.egress, keep_dir=True)
        await self.mounts.give_back(session)
        if session.uid_lease is not None:
            session.uid_lease.release()  # reserved by its record for the next holder
        log.info("session handed on", owner=session.owner, session=session.id)

    # -- one warm pool -------------------------------------------------------------------

    async def lend(self, borrower: str) -> str | None:
        """A warm sandbox of this replica's pool for replica ``borrower``, whose pool is
        empty: its slot (its record names the borrower now, its channel is let go),
        ``None`` when none is ready."""
        pooled = self.pool.lend(borrower)
        if pooled is None:
            return None
        pooled.sandbox.channel.close()  # its agent reconnects to the borrower at once
        if pooled.uid_lease is not None:
            pooled.uid_lease.release()  # reserved by its record for the borrower
        log.info("warm sandbox lent", slot=pooled.slot, to=borrower)
        return pooled.slot

    async def borrow(self) -> None:
        """With no warm sandbox left here, take one of another replica's: a new session
        then starts warm (a handover costs a reconnect, a cold start an interpreter)."""
        if self.pool.size == 0 or self.pool.ready_sandboxes():
            return
        with tracing.span("borrow a warm sandbox"):
            for other in await asyncio.to_thread(self._others):
                slot = await ask_to_lend(self.settings.run_dir, other, self.instance, _LEND_S)
                if slot is not None and await self._take_lent(slot):
                    return

    async def _take_lent(self, slot: str) -> bool:
        path = records.record_path(self.settings.sessions_dir, slot)
        record = await asyncio.to_thread(records.read_record, path)
        if record is None or not record.pool or record.instance != self.instance:
            return False
        workspace = self.pool.workspace_for(record.slot, record.uid)
        spec = self.pool.spec(record.key, workspace, record.uid)
        taken = await take_lent(self.settings, self.backend, record, spec, self.uids)
        if taken is None:
            return False
        sandbox, lease = taken
        age = max(0.0, time.time() - record.created_at)
        made_at = time.monotonic() - age
        agent = AgentClient(sandbox.channel)
        self.pool.put(Pooled(record.key, slot, workspace, lease, sandbox, agent, made_at))
        return True

    def _others(self) -> list[str]:
        """The other replicas with a control socket, in a random order (blocking)."""
        names = [
            p.name.removesuffix(".sock")
            for p in (self.settings.run_dir / REPLICAS_DIR).glob("*.sock")
            if p.name != f"{self.instance}.sock"
        ]
        random.shuffle(names)
        return names

    # -- what the others hold --------------------------------------------------------

    def elsewhere(self, owner: str | None = None) -> list[records.SessionRecord]:
        """The sessions other replicas hold (every owner's, or ``owner``'s), as their
        records say. Blocking: call it in a worker thread."""
        return [
            r
            for r in records.load_records(self.settings.sessions_dir, remove_bad=False)
            if r.handover
            and not r.pool
            and r.instance != self.instance
            and (owner is None or r.owner == owner)
            and self.table.get(r.owner, r.session_id) is None
        ]

    def running_elsewhere(self, owner: str | None) -> int:
        """Running sessions other replicas hold (all, or ``owner``'s), as last seen."""
        counts = self._running_elsewhere
        return sum(counts.values()) if owner is None else counts[owner]

    async def refresh(self, *, unless_recent: bool = False) -> None:
        """Look again at what the other replicas run (before a new session: the limits
        count them; and at every reaper pass). ``unless_recent`` (a new session): not if
        another new session looked in the last ``_RECENT_S``, so that a burst of new
        sessions reads every record once, not once a session."""
        if unless_recent:
            if time.monotonic() - self._refreshed_at < _RECENT_S:
                return
            self._refreshed_at = time.monotonic()
        held = await asyncio.to_thread(self.elsewhere)
        running = (r.owner for r in held if r.paused is None and not r.pausing)
        self._running_elsewhere = collections.Counter(running)

    async def fetch(self, owner: str | None) -> bool:
        """Take over the longest-idle running session another replica holds (``owner``'s,
        or anyone's), for this replica to pause to make room; False when there is none,
        or it is in a call."""
        held = await asyncio.to_thread(self.elsewhere, owner)
        running = [r for r in held if r.paused is None and not r.pausing]
        if not running:
            return False
        idlest = min(running, key=lambda r: r.last_active)
        try:
            await self.take(idlest.owner, idlest.session_id, _FETCH_WAIT_S)
        except SessionBusy:
            return False
        finally:
            await self.refresh()
        return self.table.get(idlest.owner, idlest.session_id) is not None

    async def reap(self) -> None:
        """Take over what replicas that died left, and look again at what the others run
        (the reaper's every pass)."""
        if await asyncio.to_thread(dead_instances, self.settings.run_dir, self.instance):
            await self._recover()
        await self.refresh()
