"""Work a backend needs done before it can start sandboxes, done in the background.

A first ``serve`` on a machine without the bwrap runtime environment (``uvx
mcp-code-sandbox``) must answer its client's ``initialize`` at once, so the build runs
beside the server: :class:`Preparation` is its status, which the service waits on before
a call that needs a sandbox. What the work *is* (``mcp-code-sandbox setup`` in a child
process) is decided by the server layer, which creates the object and gives it the job:
build-time code never enters the request path, and nothing here knows about it.

States (``usable``: sandboxes can start; more, such as Node.js, may still be built)::

    building ──► usable ──► done
        │           │
        └───────────┴──► failed ──(reported to the calls waiting, else to the next one)
                                   └──► the call after that starts the job again

Semantics: a call waits up to its own timeout, told of every step (``on_progress``, at
least every :data:`PROGRESS_EVERY_S`), then gets :class:`NotReady`, a
``backend_unavailable`` saying that nothing ran and when to call again. A failure is
said once, plainly, in the words of the job's error; the call after it retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import structlog

from mcp_code_sandbox.errors import BackendUnavailable, SandboxError

__all__ = ["PROGRESS_EVERY_S", "RETRY_AFTER_S", "Job", "NotReady", "Preparation"]

log = structlog.get_logger("mcp_code_sandbox.backends.preparation")

#: The longest a waiting call goes without a progress notification (DESIGN §6: 5 s).
PROGRESS_EVERY_S = 5.0
#: What a call that timed out is told to wait before it calls again.
RETRY_AFTER_S = 30
#: The longest :meth:`Preparation.aclose` waits for the job to end once cancelled.
CLOSE_TIMEOUT_S = 10.0

#: Receives the job's current step, in words ("installing pandas (3/10)").
Step = Callable[[str], None]
#: The work. Runs until done, calls ``step(text)`` whenever it moves on and
#: ``usable()`` once sandboxes can start; raises :class:`SandboxError` with a message for
#: the user when it fails. Cancelled when the server stops: it must stop its processes.
Job = Callable[[Step, Callable[[], None]], Awaitable[None]]
#: A waiting call's progress sink: seconds waited so far, and what is happening.
ProgressSink = Callable[[float, str], Awaitable[None]]


class NotReady(BackendUnavailable):
    """The preparation is still under way after the call's timeout: nothing ran; call
    again (``details["retry_after_s"]``). The same public code as
    :class:`BackendUnavailable` (DESIGN §7), told apart by its ``retry_after_s``."""


class Preparation:
    """The status of one background job, shared by every call that waits for it.

    Created (with the job) by the server layer, which starts it with the server; waited
    on by the service before each call that needs a sandbox; closed by the service."""

    def __init__(self, what: str, job: Job, blocked: Callable[[], str | None] | None = None):
        #: What is being done, as the first words of every message ("building the
        #: sandbox runtime").
        self.what = what
        self._job = job
        #: Why no wait can succeed now (a missing system program), asked at each wait:
        #: such a call fails at once with that reason instead of waiting for the job.
        self._blocked = blocked
        #: Called (awaited, errors logged) each time the job reaches ``usable`` and
        #: ``done``: the service refreshes what its sandboxes offer.
        self.listeners: list[Callable[[], Awaitable[object]]] = []
        self.step = "starting"
        self.usable = False
        self.done = False
        self._failure: SandboxError | None = None
        self._reported = False
        self._task: asyncio.Task[None] | None = None
        #: The listeners' run after ``usable`` (kept: a task nobody holds may be collected).
        self._telling: asyncio.Task[None] | None = None
        self._started_at = time.monotonic()
        self._changed = asyncio.Event()

    def start(self) -> None:
        """Start the job unless it runs or has finished. Called by the server layer when
        the server starts, and by :meth:`wait` to retry after a reported failure."""
        if self.done or (self._task is not None and not self._task.done()):
            return
        self._failure, self._reported = None, False
        self.step = "starting"
        self._started_at = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            await self._job(self._set_step, self._set_usable)
        except SandboxError as exc:
            self._failure = exc
            log.warning(f"{self.what} failed", error=exc.message)
        except Exception as exc:  # a bug in the job: still one plain message, logged whole
            log.exception(f"{self.what} failed unexpectedly")
            self._failure = BackendUnavailable(f"{type(exc).__name__}: {exc}")
        else:
            self.done = True
            self.step = "done"
            log.info(f"{self.what}: done", seconds=round(time.monotonic() - self._started_at, 1))
            await self._tell_listeners()
        self._notify()

    def _set_step(self, text: str) -> None:
        if text != self.step:
            self.step = text
            log.info(f"{self.what}: {text}")
            self._notify()

    def _set_usable(self) -> None:
        if not self.usable:
            self.usable = True
            self._notify()
            self._telling = asyncio.get_running_loop().create_task(self._tell_listeners())

    async def _tell_listeners(self) -> None:
        for listener in list(self.listeners):
            try:
                await listener()
            except Exception:  # one listener's failure must not stop the others
                log.exception("preparation listener failed")

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def message(self) -> str:
        """What is happening (or why it stopped), for a progress notification, a log line
        or ``/readyz``."""
        if self._failure is not None:
            return f"{self.what} failed: {self._failure.message}"
        return f"{self.what}: {self.step}"

    async def wait(
        self, timeout_s: float, on_progress: ProgressSink | None = None, *, whole: bool = False
    ) -> None:
        """Return once sandboxes can start (``whole``: once everything is built), telling
        ``on_progress`` what happens meanwhile. Called by the service before a call that
        needs a sandbox. Raises :class:`NotReady` after ``timeout_s``, the job's failure
        (once: the call after it starts the job again), or ``BackendUnavailable`` at
        once when the preparation is blocked."""
        if self.done or (self.usable and not whole):
            return
        if self._blocked is not None and (why := self._blocked()) is not None:
            raise BackendUnavailable(why)
        if self._failure is not None and not self._reported:
            raise self._report()
        self.start()  # not started yet (a service used without a server), or a retry
        began = time.monotonic()
        told: tuple[float, str] | None = None
        while not (self.done or (self.usable and not whole)):
            if self._failure is not None:
                raise self._report()
            now = time.monotonic()
            if on_progress is not None and (
                told is None or told[1] != self.message() or now - told[0] >= PROGRESS_EVERY_S
            ):
                told = (now, self.message())
                with contextlib.suppress(Exception):  # a client gone away: keep waiting
                    await on_progress(now - began, told[1])
            remaining = began + timeout_s - now
            if remaining <= 0:
                raise self._not_ready(now - began)
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), min(remaining, PROGRESS_EVERY_S))

    def _report(self) -> SandboxError:
        assert self._failure is not None
        self._reported = True
        return BackendUnavailable(
            f"{self.what} failed, so nothing ran: {self._failure.message}\n"
            "The next call tries the build again. To see its whole output, run "
            "`mcp-code-sandbox setup` in a terminal."
        )

    def _not_ready(self, waited: float) -> NotReady:
        so_far = time.monotonic() - self._started_at
        return NotReady(
            f"still {self.what} (started {so_far:.0f} s ago; now: {self.step}). Nothing "
            f"ran: this call waited {waited:.0f} s, its timeout. Call again with the same "
            f"arguments in about {RETRY_AFTER_S} s.",
            retry_after_s=RETRY_AFTER_S,
            preparing=self.step,
        )

    async def aclose(self) -> None:
        """Stop the job (its processes with it), waiting at most ``CLOSE_TIMEOUT_S``.
        Called by the service when the server stops."""
        task, self._task = self._task, None
        if task is None or task.done():
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(task, CLOSE_TIMEOUT_S)
