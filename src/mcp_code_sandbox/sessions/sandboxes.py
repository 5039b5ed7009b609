"""A session's sandbox and runner containers: started when a call needs them, replaced
when they died, stopped when the session ends. The session manager owns one
:class:`Sandboxes` and hands its executors out (:meth:`.manager.SessionManager.executor`).

Semantics (see the manager's module docstring for the whole lifecycle): a start is never
cancelled half-way (it runs in a task of its own that ending the session waits for); a
sandbox made for a closed session, or for a call cancelled meanwhile, is stopped at once;
a stop that failed or was cut short is kept in the session's ``unstopped`` and retried.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import structlog

from mcp_code_sandbox import tracing
from mcp_code_sandbox.backends.base import Backend, Limits, Sandbox, SandboxSpec
from mcp_code_sandbox.backends.checkpoints import (
    NO_CHECKPOINTS,
    Checkpoint,
    Checkpoints,
    checkpoints_of,
)
from mcp_code_sandbox.backends.egress_gate import gated_egress_of
from mcp_code_sandbox.backends.runner_images import RunnerImage, RunnerSandbox, runner_images_of
from mcp_code_sandbox.errors import SandboxFailed, SessionNotFound
from mcp_code_sandbox.metrics import Metrics
from mcp_code_sandbox.sessions.agent_client import AgentClient
from mcp_code_sandbox.sessions.egress import EgressProxies, Wish
from mcp_code_sandbox.sessions.executor import Executor, Guarded, Outcome, WithEnv, lost
from mcp_code_sandbox.sessions.runner_client import RunnerClient
from mcp_code_sandbox.sessions.saved import Variable
from mcp_code_sandbox.sessions.session import (
    END_WAIT_S,
    Handout,
    Paused,
    Session,
    check_open,
    closed_while,
    stop_logged,
)
from mcp_code_sandbox.settings import Settings
from mcp_code_sandbox.workspace import Workspace

__all__ = ["Sandboxes"]

log = structlog.get_logger("mcp_code_sandbox.sessions.sandboxes")

_T = TypeVar("_T")
#: Longest a save or load of a session's variables may take (a 1 GiB namespace, slowly).
STATE_TIMEOUT_S = 120.0
#: Variables a notice names at most (the rest are counted).
_NAMED = 20


class Sandboxes:
    """Starts, replaces and stops sessions' sandboxes and runners on ``backend``. Called
    by the session manager only, with the session's lock held where a method says so."""

    def __init__(
        self, settings: Settings, backend: Backend, metrics: Metrics, *, outlive_server: bool
    ) -> None:
        """``outlive_server``: may sandboxes outlive this server, for a successor to
        re-attach (``SandboxSpec.outlives_server``)? The manager says, by its role."""
        self.settings = settings
        self.backend = backend
        self.metrics = metrics
        self.outlive_server = outlive_server
        #: The backend's route to the egress gate, when its sandboxes reach their proxies
        #: over a network (see :mod:`.egress`); ``None``: a socket bound into each.
        self.gated = gated_egress_of(backend)
        self.egress = EgressProxies(
            settings, metrics, None if self.gated is None else self.gated.egress_gate
        )
        #: The backend's capability to pause with a sandbox's memory; ``None``: it has none.
        self.checkpoints: Checkpoints | None = checkpoints_of(backend)
        #: Why a pause cannot keep a sandbox's whole memory here (``None``: it can);
        #: asked of the backend by :meth:`start`, and again before a pause until the
        #: backend knows (an engine that did not answer at start).
        self.no_memory_pause: str | None = "not asked yet"

    async def start(self) -> None:
        """Ask the backend once whether it can checkpoint. Called by the manager's start."""
        self.no_memory_pause = await self._cannot_checkpoint()

    async def _cannot_checkpoint(self) -> str | None:
        if self.checkpoints is None:
            return NO_CHECKPOINTS
        return await self.checkpoints.cannot_checkpoint()

    # -- pause and resume ------------------------------------------------------------------

    async def pause(self, session: Session) -> Paused:
        """Stop the session's sandbox and runners, keeping what the backend can of its
        interpreter: the whole memory (a checkpoint), else its variables (saved by the
        agent into the workspace's ``.session/``), else nothing (the files stay either
        way). Called by the manager with the session's lock held; never raises for the
        sandbox's failure (what was kept says so)."""
        began = time.monotonic()
        if self.no_memory_pause is not None:  # the backend keeps a final answer: cheap
            self.no_memory_pause = await self._cannot_checkpoint()
        checkpoints = None if self.no_memory_pause is not None else self.checkpoints
        for language in list(session.runners):
            await self.drop_runner(session, language)
        sandbox, agent = session.sandbox, session.agent
        kept: Paused | None = None
        fallback: str | None = None
        why: str | None = None
        alive = (
            sandbox is not None and agent is not None and sandbox.is_alive() and not agent.broken
        )
        if not alive:
            why = None if sandbox is None else "its sandbox had stopped"
            fallback = None if sandbox is None else "no_interpreter"
        elif (
            checkpoints is not None
            and sandbox is not None
            and sandbox.spec.egress is None
            and checkpoints.refuses_checkpoint(sandbox) is None
        ):
            assert agent is not None
            try:
                await agent.park()
                checkpoint = await checkpoints.checkpoint(sandbox)
            except SandboxFailed as exc:
                log.warning("a checkpoint failed", session=session.id, error=exc.message)
                fallback = "checkpoint_failed"
                agent = await self._unparked(checkpoints, session, sandbox)
                alive = agent is not None
                if agent is None:
                    why = f"its memory could not be saved ({exc.message})"
                sandbox = session.sandbox
            else:
                session.sandbox, session.agent = None, None  # stopped: held by the checkpoint
                kept = Paused("memory", time.time(), checkpoint.bytes or 0, checkpoint)
        if kept is None and why is None and alive and agent is not None:
            if checkpoints is not None and sandbox is not None and fallback is None:
                # Not checkpointed: one with an egress proxy, or one restored already.
                fallback = "network" if sandbox.spec.egress is not None else "restored"
            try:
                report = await agent.save_state(self.settings.pause_max_bytes, STATE_TIMEOUT_S)
            except SandboxFailed as exc:
                why, fallback = f"its variables could not be saved ({exc.message})", "save_failed"
            else:
                kept = Paused(
                    "variables",
                    time.time(),
                    report.bytes,
                    saved=tuple((v.name, v.type) for v in report.kept)
                    + tuple((v.name, f"module {v.type}") for v in report.modules),
                    dropped=tuple((v.name, v.type, v.why or "") for v in report.dropped),
                    load=True,
                )
        await self.stop_sandbox(session)
        if kept is None:
            kept = Paused("files", time.time(), why=why)
        self.metrics.paused(kept.kind, time.monotonic() - began, fallback)
        return kept

    async def _unparked(
        self, checkpoints: Checkpoints, session: Session, sandbox: Sandbox
    ) -> AgentClient | None:
        """The agent of a sandbox whose checkpoint failed after it parked, on a new
        channel (installed in the session); ``None`` when it cannot be had back."""
        try:
            back = await checkpoints.unpark(sandbox)
        except SandboxFailed as exc:
            log.warning("a parked sandbox did not come back", session=session.id, error=exc.message)
            return None
        session.sandbox, session.agent = back, AgentClient(back.channel)
        return session.agent

    async def discard(self, paused: Paused) -> None:
        """Free what a pause holds outside the workspace (a checkpoint). Never raises."""
        if paused.checkpoint is not None and self.checkpoints is not None:
            try:
                await self.checkpoints.discard(paused.checkpoint)
            except Exception:
                log.exception(
                    "cannot discard a checkpoint", backend_id=paused.checkpoint.backend_id
                )

    async def _restore(self, checkpoint: Checkpoint, spec: SandboxSpec) -> Sandbox:
        """The sandbox ``checkpoint`` saved; ``SandboxFailed`` from a backend without the
        capability (a paused session recorded by a server on another backend)."""
        if self.checkpoints is None:
            raise SandboxFailed(NO_CHECKPOINTS)
        return await self.checkpoints.restore(checkpoint, spec)

    async def _resume(self, session: Session, network: Wish) -> tuple[str | None, str | None]:
        """Bring a paused session back for this call: ``(resumed, notice)``. Its memory
        when it was checkpointed and this call wants no network; else a new sandbox, which
        loads the saved variables when there are some. Lock held."""
        paused = session.paused
        assert paused is not None
        began = time.monotonic()
        why = paused.why
        if paused.checkpoint is not None:
            if network is None:
                spec = self.spec(
                    session.key, session.owner, session.id, session.workspace, session.uid
                )
                checkpoint = paused.checkpoint
                try:
                    with self.metrics.counting_backend_errors():
                        sandbox = await self._create(
                            session, lambda: self._restore(checkpoint, spec), self._stop
                        )
                except SandboxFailed as exc:
                    log.warning("a restore failed", session=session.id, error=exc.message)
                    why = f"its memory could not be restored ({exc.message})"
                else:
                    session.sandbox, session.agent = sandbox, AgentClient(sandbox.channel)
                    session.paused = None
                    self.metrics.resumed("memory", time.monotonic() - began)
                    return "memory", None
            else:
                why = "this call asked for network, and a sandbox with its memory has none"
            await self.discard(paused)
            paused = dataclasses.replace(paused, checkpoint=None, why=why)
        session.paused = None
        try:
            agent, _ = await self._ensure_sandbox(session, network=network)
        except BaseException:
            session.paused = paused  # still paused: the next call tries again
            raise
        if not paused.load:
            self.metrics.resumed("files", time.monotonic() - began)
            return None, _files_only(session, why)
        try:
            report = await agent.load_state(STATE_TIMEOUT_S)
        except SandboxFailed as exc:
            self.metrics.resumed("files", time.monotonic() - began)
            return None, _files_only(session, f"its saved variables could not be loaded ({exc})")
        if not report.found:
            self.metrics.resumed("files", time.monotonic() - began)
            return None, _files_only(session, why or "no complete saved state was found")
        self.metrics.resumed("variables", time.monotonic() - began)
        return "variables", _variables_notice(session, paused, report.failed, why)

    async def restart(self, session: Session) -> None:
        """Give a running ``session`` a fresh interpreter, its sandbox and files kept: the
        agent restarts it (:meth:`.agent_client.AgentClient.restart`). A sandbox whose
        agent cannot (one started from an image older than the ``restart`` op, one that
        stopped or broke) is stopped instead, so its next call starts a new one, as fresh.
        Runner containers keep no state but their processes: they are stopped too.
        Called by the manager with the session's lock held."""
        for language in list(session.runners):
            await self.drop_runner(session, language)
        sandbox, agent = session.sandbox, session.agent
        if sandbox is None or agent is None:
            return  # nothing runs: the next call starts a fresh interpreter anyway
        if sandbox.is_alive() and not agent.broken:
            try:
                await agent.restart()
            except SandboxFailed as exc:
                log.warning("the agent did not restart; the sandbox is replaced",
                            session=session.id, error=exc.message)  # fmt: skip
            else:
                return
        await self.stop_sandbox(session)

    def limits(self) -> Limits:
        s = self.settings
        return Limits(
            memory_bytes=s.memory_limit,
            cpu=s.cpu_limit,
            pids=s.pids_limit,
            tmp_bytes=s.tmp_size,
            file_bytes=s.workspace_quota_bytes,
        )

    async def handout(
        self,
        session: Session,
        *,
        network: Wish = None,
        runner: RunnerImage | None = None,
        mounted: Awaitable[None] | None = None,
        counted: bool = True,
    ) -> Handout:
        """What runs this call's code in ``session``: its agent, or (``runner``) its
        container of that runner image; started if need be, replaced if it died.

        Replacing a sandbox that died is decided here alone: one found dead is replaced
        (said in the notice); one that dies under the run is stopped at once and the run
        reports it as lost (:meth:`_sandbox_failed`), so the next call starts a new one
        and says nothing more; a runner's container is replaced once within the run
        (runners keep no state). Called by :meth:`.manager.SessionManager.executor` (for
        the service) with the session's lock held; ``SessionNotFound`` as for
        :meth:`_ensure_sandbox`. ``mounted``: the workspace's mount, still under way (a
        new session's, see :meth:`.manager.SessionManager.executor`): a sandbox started
        here waits for it (``Backend.create``); the caller awaits it in any case.
        ``counted``: a run's (numbered); False for a file call that needs the agent."""
        if counted:
            session.runs += 1
        resumed, notice = None, None
        # Paused: resumed now (its sandbox, if any, is a warm one it moved into).
        if session.paused is not None:
            resumed, notice = await self._resume(session, network if runner is None else None)
        if runner is not None:
            if mounted is not None:
                await mounted
            container = await self._ensure_runner(session, runner, network=network)

            async def replace() -> RunnerSandbox:
                await self.drop_runner(session, runner.language)
                return await self._ensure_runner(session, runner, network=network)

            return Handout(RunnerClient(container, replace), session.runs, notice, resumed)
        agent, replaced = await self._ensure_sandbox(session, network=network, mounted=mounted)
        guarded: Executor = Guarded(agent, lambda exc: self._sandbox_failed(session, exc))
        sandbox = session.sandbox
        if env := self.egress.run_env(None if sandbox is None else sandbox.spec.egress):
            guarded = WithEnv(guarded, env)  # the proxy's credential: never in the spec
        return Handout(guarded, session.runs, _joined(notice, replaced), resumed)

    async def agent(self, session: Session) -> AgentClient:
        """The agent of ``session``'s sandbox (no network), started if it has none: for a
        fork, which loads its copied variables before its first call. Lock held;
        raises as :meth:`_ensure_sandbox`."""
        agent, _ = await self._ensure_sandbox(session)
        return agent

    async def _sandbox_failed(self, session: Session, exc: SandboxFailed) -> Outcome:
        """A sandbox died under a run: count it, stop it (the next call starts a new one),
        and give the run its outcome. The stop runs in a task ending the session waits
        for, so a run stopped meanwhile (its quota watch) leaves no sandbox behind."""
        self.metrics.backend_error(exc.code)
        sandbox, session.sandbox, session.agent = session.sandbox, None, None
        if sandbox is not None:
            await asyncio.shield(self.track(session, self.free(session, sandbox)))
        return lost(str(exc))

    async def _ensure_sandbox(
        self, session: Session, *, network: Wish = None, mounted: Awaitable[None] | None = None
    ) -> tuple[AgentClient, str | None]:
        """The session's agent, starting a sandbox if it has none or its one died.

        ``network``: what this call asked for (a :data:`.egress.Wish`). Whether a sandbox
        has network (an egress proxy's socket) is fixed when it starts, and a call gets
        exactly what it asked for: one that switches network on or off restarts it
        (files kept, variables lost, said in the notice), so ``network=false`` always
        means no network at all. Between calls with network, only the hosts may change:
        the running proxy takes the call's policy (connections already open keep theirs).
        Behind the egress gate (kubernetes, see :mod:`.egress`) a running sandbox without
        network gets a proxy instead of a restart: its route out is opened by the backend
        and the proxy's address comes with each run (a session adopted from another
        server gets its proxy here so).

        Returns a notice when a previous sandbox was lost (variables are gone then).
        Called with the session's lock held. Raises ``SessionNotFound`` when the session
        was closed before or while its sandbox started (that sandbox is stopped then).
        """
        check_open(session)
        notice = None
        running = session.sandbox
        if running is not None and running.spec.egress is not None and network is not None:
            # Network both times: the call's hosts go to the running proxy; no restart.
            running.spec = dataclasses.replace(
                running.spec, egress=self.egress.narrow(running.spec.egress, network)
            )
        elif (
            running is not None and network is not None and self.egress.gated and running.is_alive()
        ):
            await self._network_added(running, network)
        elif running is not None and _wish(running.spec) != network:
            await self.stop_sandbox(session)
            notice = (
                f"the sandbox of session {session.id} was restarted "
                + (
                    "with network, as this call asked for it (network=true)"
                    if network is not None
                    else "without network, as this call did not ask for it (network=false)"
                )
                + ". Files in /mnt/data are kept; variables and imports from before are gone "
                "(pass the same network value on every call to keep them)"
            )
        if session.sandbox is not None and (
            not session.sandbox.is_alive() or (session.agent is not None and session.agent.broken)
        ):
            await self.stop_sandbox(session)
            notice = (
                f"the sandbox of session {session.id} had stopped; a new one was started. "
                "Files in /mnt/data are kept; variables and imports from before are gone"
            )
        if session.sandbox is None or session.agent is None:
            spec = await self._networked(
                self.spec(session.key, session.owner, session.id, session.workspace, session.uid),
                network,
            )
            began = time.monotonic()
            with self.metrics.counting_backend_errors():
                sandbox = await self._create(
                    session, lambda: self._started(spec, mounted), self._stop
                )
            self.metrics.cold_started(time.monotonic() - began)
            session.sandbox, session.agent = sandbox, AgentClient(sandbox.channel)
        return session.agent, notice

    async def _ensure_runner(
        self, session: Session, runner: RunnerImage, *, network: Wish = None
    ) -> RunnerSandbox:
        """The session's container of ``runner``, started on first use and again after a
        run had to kill it, when the language's image changed, or when this call's
        ``network`` differs from the container's (runners keep no state). Lock held;
        ``SessionNotFound`` as for :meth:`_ensure_sandbox`."""
        check_open(session)
        current = session.runners.get(runner.language)
        if current is not None and (
            not current.usable or current.runner != runner or _wish(current.spec) != network
        ):
            await self.drop_runner(session, runner.language)
            current = None
        if current is None:
            spec = self.spec(session.key, session.owner, session.id, session.workspace, session.uid)
            with self.metrics.counting_backend_errors():
                current = await self._create(
                    session,
                    lambda: runner_images_of(self.backend).create_runner(spec, runner),
                    runner_images_of(self.backend).stop_runner,
                )
            session.runners[runner.language] = current
        return current

    async def _create(
        self,
        session: Session,
        create: Callable[[], Awaitable[_T]],
        stop: Callable[[_T], Awaitable[None]],
    ) -> _T:
        """Run a backend's ``create`` to its end for ``session`` and hand its sandbox to
        the caller, who installs it in the session before awaiting anything else.

        The start runs in a task of its own, shielded: this call's cancellation does not
        cut it short (what it made would be lost), and ending the session waits for it
        (``session.starting``). Whoever learns first that the sandbox is not wanted (the
        session closed, or this call cancelled) stops it: the start itself when that was
        known before it ended, this call when it finds the session closed on waking up.
        A start that a cancelled call left running is waited for first: two sandboxes of
        one session never start at once (they share names, e.g. bwrap's cgroups).
        """
        if session.starting:
            await asyncio.wait(set(session.starting), timeout=END_WAIT_S)
            check_open(session)
        abandoned = False

        async def start() -> _T:
            made = await create()
            if session.closed or abandoned:
                await stop_logged(stop, made, session)
                if abandoned:
                    raise asyncio.CancelledError
                raise SessionNotFound(closed_while(session, "its sandbox started"))
            return made

        task = self.track(session, start())
        try:
            made = await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                abandoned = True  # the start stops what it makes
            elif not task.cancelled() and task.exception() is None:
                self.track(session, stop_logged(stop, task.result(), session))
            raise
        if session.closed:  # closed between the start's end and this call's turn
            await stop_logged(stop, made, session)
            raise SessionNotFound(closed_while(session, "its sandbox started"))
        return made

    def track(self, session: Session, work: Awaitable[_T]) -> asyncio.Task[_T]:
        """A task for ``work`` that ending ``session`` waits for; its outcome, if nobody
        awaits it, is retrieved (and logged when it is a failure)."""
        task: asyncio.Task[_T] = asyncio.ensure_future(work)
        session.starting.add(task)

        def done(task: asyncio.Task[_T]) -> None:
            session.starting.discard(task)
            exc = None if task.cancelled() else task.exception()
            if exc is not None and not isinstance(exc, SessionNotFound):
                # The caller, if still there, has it too: this is for the unawaited.
                log.debug("a sandbox start ended in an error", session=session.id, error=repr(exc))

        task.add_done_callback(done)
        return task

    async def drop_runner(self, session: Session, language: str) -> None:
        runner = session.runners.pop(language, None)
        if runner is not None:
            await self.free(session, runner)

    async def free(self, session: Session, thing: Sandbox | RunnerSandbox) -> None:
        """Stop a sandbox or runner of ``session``; one whose stop failed (logged) or was
        cancelled half-way is kept in ``unstopped``, and ending the session tries again."""
        stop: Any = (
            self._stop if isinstance(thing, Sandbox) else runner_images_of(self.backend).stop_runner
        )
        session.unstopped.append(thing)  # until stopped: a stop cut short is tried again
        if await stop_logged(stop, thing, session):
            session.unstopped.remove(thing)

    def spec(
        self,
        key: str,
        owner: str,
        session_id: str,
        workspace: Workspace,
        uid: int | None = None,
    ) -> SandboxSpec:
        """A spec without network (:meth:`_networked` adds it)."""
        return SandboxSpec(
            key=key,
            owner=owner,
            session_id=session_id,
            workspace=workspace.root,
            limits=self.limits(),
            env=self.settings.pass_through_values(),
            uid=uid,
            outlives_server=self.outlive_server,
        )

    # -- network: an egress proxy per sandbox that has it (see .egress) ---------------------

    async def _networked(self, spec: SandboxSpec, network: Wish) -> SandboxSpec:
        """``spec`` with network as ``network`` wishes: a new egress proxy and its
        variables. Its proxy is closed by :meth:`_started` when the start fails and by
        :meth:`_stop` when the sandbox stops."""
        if network is None:
            return spec
        egress, env = await self.egress.open(spec.key, spec.owner, spec.session_id, network)
        return dataclasses.replace(spec, egress=egress, env={**spec.env, **env})

    async def _network_added(self, sandbox: Sandbox, network: tuple[str, ...]) -> None:
        """Give a running sandbox without network a proxy behind the gate and its route
        to it; the proxy is closed again when the backend cannot open the route."""
        assert self.gated is not None
        spec = await self._networked(sandbox.spec, network)
        try:
            await self.gated.allow_egress(sandbox)
        except BaseException:
            await self.egress.close(spec.egress)
            raise
        sandbox.spec = dataclasses.replace(sandbox.spec, egress=spec.egress)

    async def _started(self, spec: SandboxSpec, mounted: Awaitable[None] | None) -> Sandbox:
        try:
            with tracing.span("sandbox start", backend=self.backend.name, network=spec.network):
                return await self.backend.create(spec, mounted=mounted)
        except BaseException:
            await self.egress.close(spec.egress)
            raise

    async def _stop(self, sandbox: Sandbox) -> None:
        """The backend's stop, then (whatever it did) the sandbox's egress proxy."""
        try:
            await self.backend.stop(sandbox)
        finally:
            await self.egress.close(sandbox.spec.egress)

    def blocked_hosts(self, session: Session) -> list[str]:
        """Hosts the session's sandbox's proxy refused since the last call (its runners
        have none). Called by the service after a run, for the result."""
        sandbox = session.sandbox
        return self.egress.take_blocked([sandbox.spec.egress] if sandbox is not None else [])

    async def stop_sandbox(self, session: Session) -> None:
        sandbox, session.sandbox, session.agent = session.sandbox, None, None
        if sandbox is not None:
            await self.free(session, sandbox)


def _joined(*notices: str | None) -> str | None:
    said = [n for n in notices if n]
    return " ".join(said) if said else None


def _files_only(session: Session, why: str | None) -> str | None:
    if why is None:
        return None  # nothing had run: nothing was lost
    return (
        f"session {session.id} was paused while idle and resumed with its files only: {why}. "
        "Files in /mnt/data are kept; variables and imports from before are gone"
    )


def _variables_notice(
    session: Session, paused: Paused, failed: Sequence[Variable], why: str | None
) -> str | None:
    """What a resume from saved variables could not bring back, by name (``None``: all
    of it came back)."""
    lost = [f"{name} ({kind}: {reason})" for name, kind, reason in paused.dropped]
    lost += [f"{v.name} ({v.type}: {v.why or 'could not be loaded'})" for v in failed]
    if not lost and why is None:
        return None
    shown = ", ".join(lost[:_NAMED])
    if len(lost) > _NAMED:
        shown += f" and {len(lost) - _NAMED} more"
    head = f"session {session.id} was paused while idle and resumed with its saved variables"
    if why is not None:
        head += f" ({why})"
    tail = f"; not restored: {shown}" if lost else ""
    return head + tail + ". Open files, threads and running processes do not survive a pause"


def _wish(spec: SandboxSpec) -> Wish:
    """What network a running sandbox was started with, as a call's wish."""
    if spec.egress is None:
        return None
    return spec.egress.hosts or ()
