"""The supervisor: the agent's main process, between the host channel and the runs.

One thread, one ``selectors`` loop over the host channel, the kernel's control socket,
the stdout/stderr pipes of the kernel and of a running program, and a wake-up socket that
SIGCHLD writes to (``signal.set_wakeup_fd``): a child that exits wakes the loop at once,
with no polling tick (and no pidfd, which the sandbox's seccomp filter denies). As pid 1
(``bwrap --as-pid-1``, a container without an init) the same wake-up collects the
orphans user code leaves behind. It enforces deadlines (SIGINT, then after ``GRACE_S``
SIGKILL and a fresh kernel), notices a kernel that died by itself, and restarts it.

Output attribution: bytes on the kernel's pipes belong to the current run when that run
is Python; a program's pipes belong to its run. Output written when no run is in the
kernel (a background thread or process started by an earlier cell) is dropped. Before a
run's ``done`` its pipes are drained, so everything written before it ended comes first.

Runs are one at a time; an ``exec`` or ``restart`` arriving during a run is queued in order.

When the host goes away on a channel that can reconnect (:mod:`.hostlink`), the runs
queued by that host are dropped (nobody waits for them), the current run goes on to its
end or its deadline unreported (``orphaned``), and on reconnecting the agent says
``ready`` again with ``reattached: true``.

Listening (``--listen``, :mod:`.listener`): an authenticated connection becomes the link
at once when there is none (or its run is orphaned) and otherwise waits, unread, until no
run is in flight: the run finishes on the connection that asked for it, its ``done``
delivered there. Then the old link's queued runs end ``cancelled`` on it, it is closed,
and the newest waiting connection (an older waiting one is closed) gets ``ready``, with
``reattached`` when a host was connected before.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import selectors
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any, cast

from . import packages
from .budget import STATE_RESULT_BYTES, Budget, DisplayGate, cut_error, cut_text
from .children import Child, OutputPipe, kill_strays, reap_orphans, spawn
from .coalesce import Pending
from .config import AgentConfig, apply_limits
from .files import Files
from .hostlink import HostLink, bare_fd
from .kernelproc import KernelProcess, await_ready, start_kernel
from .languages import VALUED, available, command, value
from .protocol import (
    HEADER,
    MAX_FRAME_BYTES,
    AgentEvent,
    CutReport,
    DoneEvent,
    ErrorDetail,
    ExecMessage,
    ProtocolError,
    ReadyEvent,
    RestartMessage,
    decode_body,
)
from .run_state import (
    GRACE_S,
    Run,
    done,
    exec_error,
    kernel_died_error,
    killed_error,
    program_exit_code,
)

if TYPE_CHECKING:
    from .listener import TlsConnection

__all__ = ["AgentExit", "Supervisor"]


def _python_version() -> str:
    # Not platform.python_version(): importing platform is slow, on every sandbox start.
    return ".".join(str(part) for part in sys.version_info[:3])


class AgentExit(Exception):
    """Leave the loop: kill everything, exit with ``code``."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class Supervisor:
    def __init__(
        self,
        link: HostLink,
        workdir: str,
        config: AgentConfig,
        plain: bool,
        kernel: KernelProcess | None = None,
    ) -> None:
        """``kernel``: one the agent's ``main`` already spawned (:func:`.kernelproc.spawn_kernel`,
        with this ``workdir`` and ``config`` and the session's packages in its environment),
        whose ready is awaited here; ``None``: start one."""
        self._link = link
        #: An authenticated connection waiting for the current run to end (``--listen``).
        self._waiting: TlsConnection | None = None
        #: A host was greeted before: the next ``ready`` says ``reattached``.
        self._greeted = False
        self._workdir = workdir
        self._config = config
        self._plain = plain
        self._sel = selectors.DefaultSelector()
        self._inbox = bytearray()
        #: Runs and restarts, in the order the host sent them.
        self._queue: collections.deque[ExecMessage | RestartMessage] = collections.deque()
        self._run: Run | None = None
        #: The workspace's files, for a host that cannot see them (``fs``, :mod:`.files`).
        self._files = Files(workdir)
        #: The current run's output read from pipes and not yet sent (see .coalesce).
        self._pending = Pending()
        self._programs: dict[str, tuple[str, str]] = {}
        #: Private directory under /tmp for programs' code files; made at the first use.
        self._scratch: str | None = None
        #: The kernel died between runs: the next Python run reports ``state_lost``.
        self._state_lost_pending = False
        #: SIGCHLD arrived since the children were last looked at.
        self._child_signalled = False
        #: The latest ``execution_count`` the kernel reported; 0 for a fresh kernel.
        self._execution_count = 0
        #: The environment the backend gave us, before the session's packages join it:
        #: interpreters are looked for here only (see ``languages``).
        self._base_env = dict(os.environ)
        # Before any child starts: they all inherit where the session's packages are.
        os.environ.update(packages.environ(workdir, os.environ))
        # Before any child starts but an early kernel (``kernel``), so that no exit goes
        # unnoticed; one that exits before its ready closes its control socket, which
        # ``await_ready`` notices.
        self._wakeup = _sigchld_wakeup()
        self._sel.register(self._wakeup, selectors.EVENT_READ, self._on_sigchld)
        self._kernel = self._start_kernel(meanwhile=self._find_programs, spawned=kernel)
        # Preloading warms a pooled sandbox once; a restarted kernel starts lean.
        self._config = config._replace(preload=())

    # -- lifecycle -------------------------------------------------------------------

    def serve(self) -> int:
        signal.signal(signal.SIGTERM, _on_sigterm)
        if self._link.listener is not None:
            self._link.listener.attach(self._sel, self._on_authenticated)
        if self._link.fd is not None:
            self._greet(reattached=False)
        try:
            while True:
                self._step()
        except AgentExit as exit_:
            return exit_.code
        finally:
            self._shutdown()

    def _greet(self, *, reattached: bool) -> None:
        assert self._link.fd is not None
        self._sel.register(self._link.fd, selectors.EVENT_READ, self._on_channel)
        # Our own version, not the kernel's: the kernel ran the session's .pth files
        # (its packages) before it answered, so what it says is the tenant's to choose.
        languages = {"python": _python_version()}
        languages.update({name: version for name, (_, version) in self._programs.items()})
        ready: ReadyEvent = {"ev": "ready", "languages": languages,
                             "ipython": self._kernel.ipython, "pid": os.getpid()}  # fmt: skip
        if reattached:
            ready["reattached"] = True
            ready["execution_count"] = self._execution_count
        if self._link.listener is not None:
            ready["listen"] = self._link.listener.name
        self._greeted = True
        self._send(ready)

    def _step(self) -> None:
        for key, _ in self._sel.select(self._tick()):
            callback: Callable[[], None] = key.data
            # An earlier callback may have closed this fd, and a new kernel reused it.
            if self._sel.get_map().get(key.fd) is key:
                callback()
        if self._child_signalled:
            self._child_signalled = False
            self._poll_children()
            self._reap()
        self._send_pending(due_only=True)
        self._check_deadline()
        if self._link.listener is not None:
            self._link.listener.expire()
        self._reconnect()
        self._adopt_waiting()
        if self._run is None and self._queue:
            message = self._queue.popleft()
            if message["op"] == "restart":
                self._restart(message)
            else:
                self._start(message)

    def _tick(self) -> float | None:
        ticks: list[float] = []
        run = self._run
        if run is not None:
            due = run.kill_at if run.reason is not None else run.deadline
            ticks.append(max(0.0, (due or 0.0) - time.monotonic()))
        listener = self._link.listener
        if listener is not None:
            handshake_due = listener.due_in()
            if handshake_due is not None:
                ticks.append(handshake_due)
        elif self._link.fd is None:
            ticks.append(self._link.due_in())
        if self._pending.due is not None:
            ticks.append(max(0.0, self._pending.due - time.monotonic()))
        return min(ticks) if ticks else None

    def _shutdown(self) -> None:
        self._files.close()
        if self._link.listener is not None:
            self._link.listener.close()
        if self._waiting is not None:
            self._waiting.close()
        if self._run is not None and self._run.child is not None:
            self._run.child.kill_and_reap()
            self._run.child.close()
        self._kernel.child.kill_and_reap()
        self._kernel.close()
        if self._config.kill_strays:
            kill_strays()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)

    def _scratch_dir(self) -> str:
        """Where programs' code files go: outside the workspace, so never an artifact."""
        if self._scratch is None:
            import tempfile  # not at start: it costs milliseconds of every sandbox's start

            self._scratch = tempfile.mkdtemp(prefix="mcs-code-")
        return self._scratch

    # -- the host channel ------------------------------------------------------------

    def _send(self, message: AgentEvent) -> None:
        if self._link.fd is None:
            return  # the host is away: there is nobody to tell
        try:
            self._link.send(message)
        except OSError:
            self._host_lost(1)

    def _host_lost(self, code: int, *, parked: bool = False) -> None:
        """The channel broke or reached EOF (``parked``: the host asked us to close it):
        exit with ``code``, or wait for the host."""
        if not self._link.waits_for(parked=parked) or self._link.fd is None:
            raise AgentExit(code)
        self._sel.unregister(self._link.fd)
        self._link.close()
        self._link.lost(parked=parked)
        self._inbox.clear()
        self._files.abort()  # its write will never end
        # The host that asked for these is gone; its successor has never heard of them.
        self._queue.clear()
        if self._run is not None:
            self._run.orphaned = True

    def _reconnect(self) -> None:
        if self._link.listener is not None:
            return  # servers dial in: see _on_authenticated
        if self._link.fd is not None or self._link.due_in() > 0:
            return
        try:
            connected = self._link.try_reconnect()
        except TimeoutError:
            raise AgentExit(1) from None
        if connected:
            self._greet(reattached=True)

    def _on_authenticated(self, conn: TlsConnection) -> None:
        """A server proved itself on ``conn``: the newest wins (see the module's doc)."""
        if self._waiting is not None:
            self._waiting.close()
        self._waiting = conn
        self._adopt_waiting()

    def _adopt_waiting(self) -> None:
        conn = self._waiting
        if conn is None:
            return
        if self._link.fd is not None:
            if self._run is not None and not self._run.orphaned:
                return  # its done goes to the host that asked for it
            for queued in self._queue:  # asked for by the host being replaced
                self._send(done(queued["id"], "cancelled"))
            self._queue.clear()
            if self._link.fd is not None:  # (a send above may have lost it)
                self._sel.unregister(self._link.fd)
                self._link.close()
                self._link.lost()
        self._waiting = None
        self._inbox.clear()
        self._files.abort()  # a write the replaced host began: the new one never ends it
        self._link.adopt(conn)
        self._greet(reattached=self._greeted)

    def _error(self, message: str, run_id: Any = None) -> None:
        self._send({"ev": "error", "message": message, "id": run_id})

    def _on_channel(self) -> None:
        data = self._link.read() if self._link.fd is not None else b""
        if data is None:
            return  # a TLS record not yet whole
        if not data:
            self._host_lost(0)
            return
        self._inbox += data
        while len(self._inbox) >= HEADER.size:
            (length,) = HEADER.unpack_from(self._inbox)
            if length > MAX_FRAME_BYTES:  # cannot find the next frame: give up cleanly
                self._error(f"frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
                raise AgentExit(1)
            if self._link.fd is None:  # a callback above lost the host: drop the rest
                return
            if len(self._inbox) < HEADER.size + length:
                return
            body = bytes(self._inbox[HEADER.size : HEADER.size + length])
            del self._inbox[: HEADER.size + length]
            try:
                message = decode_body(body)
            except ProtocolError as exc:
                self._error(str(exc))
                continue
            self._on_message(message)

    def _on_message(self, message: dict[str, Any]) -> None:
        self._link.heard()
        op = message.get("op")
        if op == "exec":
            problem = exec_error(message, {"python", *self._programs})
            if problem is None:
                # exec_error checked every field _start reads (budget: Budget.from_message).
                self._queue.append(cast(ExecMessage, message))
            else:
                self._error(problem, message.get("id"))
        elif op == "restart":
            run_id = message.get("id")
            if isinstance(run_id, int) and not isinstance(run_id, bool):
                self._queue.append(RestartMessage(op="restart", id=run_id))
            else:
                self._error("restart: 'id' must be an integer", run_id)
        elif op == "interrupt":
            reason = "timeout" if message.get("reason") == "timeout" else "cancelled"
            self._interrupt_id(message.get("id"), reason)
        elif op == "park":
            if self._link.can_reconnect:
                self._host_lost(0, parked=True)
            else:
                self._error("park: this channel cannot reconnect (it needs --connect)")
        elif op == "shutdown":
            raise AgentExit(0)
        elif op == "fs":
            self._on_fs(message)
        else:
            self._error(f"unknown op {op!r}")

    def _on_fs(self, message: dict[str, Any]) -> None:
        """Answer a file request at once, between runs only: the host holds the session's
        lock for both, so one during a run (or with one queued) is a host's mistake."""
        if self._run is not None or self._queue:
            self._files.abort()
            self._error(
                "fs: a run is in flight; file requests come between runs", message.get("id")
            )
            return
        self._send(self._files.handle(message))

    def _interrupt_id(self, run_id: Any, reason: str) -> None:
        # An orphaned run's id may be reused by the next host: it is not that host's run.
        if self._run is not None and self._run.id == run_id and not self._run.orphaned:
            if self._run.reason is None:
                self._interrupt(self._run, reason)
            return
        for queued in list(self._queue):  # never started: it ends right here
            if queued["op"] == "exec" and queued["id"] == run_id:
                self._queue.remove(queued)
                self._send(done(run_id, reason))
        # Any other id: that run is over already, the host just has not seen its done.

    # -- starting and ending runs ----------------------------------------------------

    def _start(self, message: ExecMessage) -> None:
        timeout = float(message.get("timeout_s", 60))
        language = str(message.get("language", "python"))
        run = Run(message["id"], language, time.monotonic() + timeout)
        env: dict[str, str] = message.get("env") or {}
        if language == "python":
            budget = Budget.from_message(message.get("budget"))
            request: dict[str, Any] = {"op": "exec", "id": run.id, "code": message["code"]}
            if "state" in message:  # its report is never cut: the agent bounds it
                budget = Budget(max(budget.result_bytes, STATE_RESULT_BYTES), budget.images)
                request.update(state=message["state"], max_bytes=message.get("max_bytes"))
            run.displays = DisplayGate(budget)
            self._run = run
            try:
                self._kernel.send({**request, "env": env, "budget": budget.to_message()})
            except OSError:
                self._kernel_died()
            return
        exe, _ = self._programs[language]
        # Its value (JavaScript, TypeScript) is bounded as a Python cell's is.
        run.displays = DisplayGate(Budget.from_message(message.get("budget")))
        try:
            argv = command(language, exe, message["code"], self._scratch_dir())
            child = spawn(argv, cwd=self._workdir, env={**os.environ, **env},
                          preexec_fn=lambda: apply_limits(self._config))  # fmt: skip
        except OSError as exc:
            error = ErrorDetail(name=type(exc).__name__, value=str(exc), traceback="")
            self._send(done(run.id, "error", error=error))
            return
        run.child = child
        self._run = run
        self._watch(child)

    def _finish(self, message: DoneEvent) -> None:
        """End the current run: drain its output, send ``done``, forget the run."""
        run = self._run
        assert run is not None
        pipes = run.child.pipes if run.child is not None else self._kernel.child.pipes
        self._drain(pipes)
        self._send_pending()
        if run.reason is not None:
            message["status"] = run.reason
        self._run = None
        message["run_s"] = round(time.monotonic() - run.started, 6)
        if not run.orphaned:
            self._send(message)

    def _drain(self, pipes: tuple[OutputPipe, ...], final: bool = True) -> None:
        for pipe in pipes:
            pipe.drain(functools.partial(self._stream, pipe.name), final)

    def _stream(self, name: str, text: str) -> None:
        """Output of the current run, batched (:mod:`.coalesce`); dropped when orphaned."""
        if self._run is not None and not self._run.orphaned and self._pending.add(name, text):
            self._send_pending()

    def _send_pending(self, due_only: bool = False) -> None:
        """Send the batched output now (``due_only``: only if its time has come)."""
        due = self._pending.due
        if due is None or (due_only and time.monotonic() < due):
            return
        chunks = self._pending.take()
        run = self._run
        if run is None or run.orphaned:
            return
        for name, text in chunks:
            self._send({"ev": "stream", "id": run.id, "name": name, "text": text})

    def _on_program_exit(self) -> None:
        run = self._run
        if run is None or run.child is None:
            return
        child = run.child
        returncode = child.returncode()
        if returncode is None:
            return
        if run.reason is not None:  # what it left running in its group goes with it
            child.signal_group(signal.SIGKILL)
        self._unwatch(child)
        status = "ok" if returncode == 0 else "error"
        result = None
        if run.reason is None and run.language in VALUED and self._scratch is not None:
            result = value(self._scratch, run.displays.budget.text_chars)
        exit_code = program_exit_code(returncode)
        self._finish(done(run.id, status, exit_code=exit_code, result=result))
        child.close()

    # -- interrupts and deadlines ----------------------------------------------------

    def _check_deadline(self) -> None:
        run = self._run
        if run is None:
            return
        now = time.monotonic()
        if run.reason is None and now >= run.deadline:
            self._interrupt(run, "timeout")
        elif run.kill_at is not None and now >= run.kill_at:
            self._kill(run)

    def _interrupt(self, run: Run, reason: str) -> None:
        run.reason = reason
        run.kill_at = time.monotonic() + GRACE_S
        child = run.child if run.child is not None else self._kernel.child
        child.signal_group(signal.SIGINT)

    def _kill(self, run: Run) -> None:
        if run.child is not None:
            run.child.kill_and_reap()
            if self._config.kill_strays:  # the kernel's session is another run's state
                kill_strays(spare_sessions=[self._kernel.child.pid])
            self._on_program_exit()
            return
        self._replace_kernel()
        self._state_lost_pending = False
        self._finish(
            done(
                run.id,
                run.reason or "timeout",
                error=killed_error(run.reason or "timeout"),
                state_lost=True,
            )
        )

    # -- the kernel ------------------------------------------------------------------

    def _find_programs(self) -> None:
        self._programs = available(self._base_env)

    def _start_kernel(
        self, meanwhile: Callable[[], None] | None = None, spawned: KernelProcess | None = None
    ) -> KernelProcess:
        if spawned is None:
            kernel = start_kernel(self._workdir, self._config, self._plain, meanwhile)
        else:
            kernel = await_ready(spawned, meanwhile)
        self._watch(kernel.child)
        self._sel.register(kernel.control, selectors.EVENT_READ, self._on_control)
        return kernel

    def _replace_kernel(self) -> int:
        """Kill the kernel and everything it started; start a fresh one. Returns the
        old kernel's exit status, with its output left to drain in ``_finish``."""
        old = self._kernel
        returncode = old.child.kill_and_reap()
        if self._config.kill_strays:
            kill_strays()
        self._unwatch(old.child)
        self._sel.unregister(old.control)
        self._kernel = self._start_kernel()
        self._execution_count = 0
        if self._run is not None and self._run.child is None:
            self._drain(old.child.pipes)  # the current run's output, before it is closed
        old.close()
        return returncode

    def _restart(self, message: RestartMessage) -> None:
        """The host asked for a fresh interpreter (between runs): no ``state_lost`` to
        report, the host knows."""
        self._replace_kernel()
        self._state_lost_pending = False
        self._send({"ev": "restarted", "id": message["id"]})

    def _on_control(self) -> None:
        try:
            messages = self._kernel.receive()
        except ProtocolError:
            messages = None  # a kernel that garbles its frames is as good as dead
        if messages is None:
            self._kernel_died()
            return
        for message in messages:
            self._on_kernel_message(message)

    def _on_kernel_message(self, message: dict[str, Any]) -> None:
        run = self._run
        current = run is not None and run.child is None and message.get("id") == run.id
        event = message.get("ev")
        if event == "stream":
            if current:
                self._kernel_output(message)
        elif event == "sync":
            # The kernel is about to start a process: what its pipes hold came before.
            if current:
                self._drain(self._kernel.child.pipes, final=False)
            with contextlib.suppress(OSError):  # a dead kernel is noticed by its SIGCHLD
                self._kernel.send({"op": "ack"})
        elif event == "display":
            self._forward_display(message, current)
        elif run is not None and current and message.get("ev") == "done":
            count = message.get("execution_count")
            if isinstance(count, int):
                self._execution_count = count
            state_lost, self._state_lost_pending = self._state_lost_pending, False
            result, error, cut = _within_budget(message, run.displays)
            self._finish(done(run.id, str(message.get("status")),
                              result=result, error=error,
                              execution_count=message.get("execution_count"),
                              state_lost=state_lost, cut=cut))  # fmt: skip

    def _kernel_output(self, message: dict[str, Any]) -> None:
        """A batch of what the cell printed (:mod:`.outstream`), checked: the kernel runs
        user code. What its pipes hold was written before (a child started earlier, whose
        output the kernel's batch follows), so it goes first."""
        name, text = message.get("name"), message.get("text")
        if name not in ("stdout", "stderr") or not isinstance(text, str):
            return
        self._drain(self._kernel.child.pipes, final=False)
        self._stream(name, text)
        self._send_pending()

    def _forward_display(self, message: dict[str, Any], current: bool) -> None:
        if current and self._run is not None and not self._run.orphaned:
            # The kernel flushed what it printed before the display and now waits for the
            # ack, so the pipes hold exactly the output that comes first.
            self._drain(self._kernel.child.pipes, final=False)
            self._send_pending()
            data = self._run.displays.admit(message.get("data"))
            if data is not None:  # else over the run's budget: dropped as it arrives
                self._send({"ev": "display", "id": self._run.id,
                            "source": str(message.get("source")), "data": data})  # fmt: skip
        with contextlib.suppress(OSError):  # a dead kernel is noticed by its SIGCHLD
            self._kernel.send({"op": "ack"})

    def _on_kernel_exit(self) -> None:
        if self._kernel.child.returncode() is not None:
            self._kernel_died()

    def _kernel_died(self) -> None:
        with contextlib.suppress(Exception):  # give a dying kernel a moment to be reaped
            self._kernel.child.proc.wait(timeout=0.5)
        returncode = self._replace_kernel()
        run = self._run
        if run is None or run.child is not None:
            self._state_lost_pending = True
            return
        self._state_lost_pending = False
        error = kernel_died_error(returncode, self._config.memory_bytes)
        self._finish(done(run.id, "error", error=error, state_lost=True))

    # -- child bookkeeping -----------------------------------------------------------

    def _watch(self, child: Child) -> None:
        for pipe in child.pipes:
            self._sel.register(pipe.fd, selectors.EVENT_READ, self._reader(child, pipe))

    def _unwatch(self, child: Child) -> None:
        for fd in (p.fd for p in child.pipes if not p.closed):
            if fd in self._sel.get_map():
                self._sel.unregister(fd)

    def _reader(self, child: Child, pipe: OutputPipe) -> Callable[[], None]:
        def on_readable() -> None:
            text = pipe.read()
            if text is None:  # EOF: the child (and all it started) closed this pipe
                self._sel.unregister(pipe.fd)
                pipe.close()
                return
            run = self._run
            if text and run is not None and (run.child or self._kernel.child) is child:
                self._stream(pipe.name, text)

        return on_readable

    def _on_sigchld(self) -> None:
        """The wake-up socket is readable: empty it; the step then looks at the children."""
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wakeup, 4096):
                pass
        self._child_signalled = True

    def _reap(self) -> None:
        if os.getpid() != 1:
            return
        keep = [self._kernel.child.pid]
        if self._run is not None and self._run.child is not None:
            keep.append(self._run.child.pid)
        reap_orphans(keep)

    def _poll_children(self) -> None:
        """After a SIGCHLD: has the kernel or the running program exited?"""
        self._on_kernel_exit()
        run = self._run
        if run is not None and run.child is not None:
            self._on_program_exit()


def _within_budget(
    message: dict[str, Any], displays: DisplayGate
) -> tuple[str | None, ErrorDetail | None, CutReport]:
    """The kernel's result and error cut to the run's budget, and what was cut (the
    kernel's own account, checked, plus the supervisor's)."""
    limit = displays.budget.text_chars
    raw = message.get("result")
    result, result_cut = cut_text(raw, limit) if isinstance(raw, str) else (None, False)
    cut_detail, error_cut = cut_error(message.get("error"), limit)
    error = (
        None
        if cut_detail is None
        else ErrorDetail(
            name=cut_detail["name"], value=cut_detail["value"], traceback=cut_detail["traceback"]
        )
    )
    raw_cut = message.get("cut")
    claimed: dict[str, Any] = raw_cut if isinstance(raw_cut, dict) else {}
    ours = displays.summary()

    def counted(key: str) -> int:
        theirs = claimed.get(key)
        if isinstance(theirs, int) and not isinstance(theirs, bool) and theirs >= 0:
            return ours[key] + theirs
        return ours[key]

    cut: CutReport = {
        "result": result_cut or claimed.get("result") is True,
        "error": error_cut or claimed.get("error") is True,
        "displays_dropped": counted("displays_dropped"),
        "displays_cut": counted("displays_cut"),
        "images_dropped": counted("images_dropped"),
        "displays_unsupported": counted("displays_unsupported"),
    }
    return result, error, cut


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise AgentExit(0)


def _on_sigchld(signum: int, frame: FrameType | None) -> None:
    """Nothing: the C-level handler has written to the wake-up fd already."""


def _sigchld_wakeup() -> int:
    """The read end of a channel that gets a byte whenever SIGCHLD arrives.

    Python's C signal handler writes the signal number to the wake-up fd the moment the
    signal arrives, so a select() already sleeping wakes, and one about to sleep finds the
    byte: no exit is missed, and nothing polls. Only the handler needs installing (SIGCHLD
    is ignored by default); exec resets it, so the children are unaffected. A socketpair,
    not a pipe: gVisor lets user code reopen the agent's pipes through /proc (a socket
    cannot be reopened), and stealing these bytes would hide a program's exit."""
    read_end, write_end = socket.socketpair()
    read_end.setblocking(False)
    write_end.setblocking(False)
    signal.signal(signal.SIGCHLD, _on_sigchld)
    signal.set_wakeup_fd(bare_fd(write_end), warn_on_full_buffer=False)
    return bare_fd(read_end)
