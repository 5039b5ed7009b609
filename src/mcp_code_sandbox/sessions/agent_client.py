"""The host's side of the agent protocol: run one request and collect what comes back.

An :class:`.executor.Executor`: the session manager hands it out, and the run path calls
:meth:`AgentClient.execute` with the session's lock held, so at most one request is in
flight per agent. Broken frames, EOF and an agent that stops
answering are translated here, once, into :class:`~mcp_code_sandbox.errors.SandboxFailed`.

The run's result budget (:mod:`.agent.budget`) is sent with the ``exec`` and enforced
again here, on whatever the agent sends: displays past it are dropped as they arrive
(never kept to be cut later), and the result and error texts are cut.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import math
import time
from typing import Any, cast

import anyio
from opentelemetry import trace

from mcp_code_sandbox import tracing
from mcp_code_sandbox.agent.budget import (
    STATE_RESULT_BYTES,
    Budget,
    DisplayGate,
    cut_error,
    cut_text,
)
from mcp_code_sandbox.agent.cells import RICH_MIMES
from mcp_code_sandbox.agent.protocol import (
    DisplayEvent,
    DoneEvent,
    ExecMessage,
    FsEvent,
    FsMessage,
    HostMessage,
    ProtocolError,
)
from mcp_code_sandbox.backends.base import Channel
from mcp_code_sandbox.errors import SandboxFailed
from mcp_code_sandbox.sanitize import clean_text
from mcp_code_sandbox.sessions.executor import Cell, Display, Outcome, StreamSink
from mcp_code_sandbox.sessions.saved import LoadReport, SaveReport, parse_load, parse_save

__all__ = ["FS_TIMEOUT_S", "INTERRUPT_GRACE_S", "RESTART_WAIT_S", "AgentClient"]

#: How long after its deadline an agent gets to answer (its own SIGINT grace is 2 s, then a
#: kill and an interpreter restart) before the host gives up on the whole sandbox.
INTERRUPT_GRACE_S = 15.0
#: How long one ``fs`` request may take: a page is at most a few MiB, a walk at most
#: 200 000 entries; an agent that takes longer is stuck, and its sandbox is replaced.
FS_TIMEOUT_S = 60.0
#: How long a restart of the interpreter may take: a kill and a fresh interpreter's start
#: (well under a second; IPython with the session's packages on a loaded machine, more).
RESTART_WAIT_S = 30.0


class AgentClient:
    """The executor of a sandbox's agent: one ``exec`` at a time over its channel."""

    def __init__(self, channel: Channel) -> None:
        self._channel = channel
        self._next_id = 0
        #: True once the agent broke the protocol, went silent or was abandoned mid-run:
        #: the session manager then replaces the sandbox (and reports ``state_lost``).
        self.broken = False

    async def execute(self, cell: Cell, on_stream: StreamSink) -> Outcome:
        """Run ``cell`` and return its outcome, within its budget (default: the agent's).

        If the calling task is cancelled, the run is interrupted (reason ``cancelled``)
        and its ``done`` awaited, bounded, before the cancellation propagates, so the
        agent is ready for the next call. Raises ``SandboxFailed`` when the agent breaks
        the protocol or does not answer within ``timeout_s + INTERRUPT_GRACE_S``.
        """
        self._next_id += 1
        budget = cell.budget or Budget()
        message: ExecMessage = {
            "op": "exec",
            "id": self._next_id,
            "language": cell.language,
            "code": cell.code,
            "timeout_s": cell.timeout_s,
            "env": cell.env,
            "budget": budget.to_message(),
        }
        return await self._run(message, budget, on_stream)

    async def save_state(self, max_bytes: int, timeout_s: float) -> SaveReport:
        """Save the interpreter's variables to the workspace's ``.session/``, inside the
        sandbox (the session manager's variables pause); what was kept and dropped.

        Raises ``SandboxFailed`` when the agent could not save at all (its message
        says why: the disk, the quota), ran out of time, or sent a report that is not
        one. The host reads the report only, never the saved files."""
        outcome = await self._state({"state": "save", "max_bytes": max_bytes}, timeout_s)
        return parse_save(outcome.result)

    async def load_state(self, timeout_s: float) -> LoadReport:
        """Load what :meth:`save_state` saved into a fresh interpreter (a resume), inside
        the sandbox; what was restored. Raises ``SandboxFailed`` as ``save_state`` does."""
        outcome = await self._state({"state": "load"}, timeout_s)
        return parse_load(outcome.result)

    async def restart(self, wait_s: float = RESTART_WAIT_S) -> None:
        """Have the agent replace its interpreter, and all the interpreter started, by a
        fresh one (the sandbox and its files stay). Called with the session's lock held,
        between runs. Raises ``SandboxFailed`` when the agent refuses (one older than the
        ``restart`` op), breaks the protocol or does not answer within ``wait_s`` (then
        it is ``broken``)."""
        self._next_id += 1
        run_id = self._next_id
        await self._send({"op": "restart", "id": run_id})
        await self._answer(run_id, "restarted", wait_s, "restart its interpreter")

    async def park(self, wait_s: float = 5.0) -> None:
        """Have the agent close its channel now (it reconnects at once on its own, to
        whoever listens on its socket next): before a checkpoint of the sandbox, which
        cannot hold a connection to the host. Returns once the channel reached EOF;
        the channel is then done with. Raises ``SandboxFailed`` when the agent refuses
        (a channel that cannot reconnect) or does not close within ``wait_s``."""
        await self._send({"op": "park"})
        try:
            async with asyncio.timeout(wait_s):
                while True:
                    message = await self._channel.receive()
                    if message is None:
                        return
                    if message.get("ev") == "error":
                        text, _ = cut_text(str(message.get("message")), 500)
                        raise SandboxFailed(f"the sandbox's agent cannot park: {text}")
        except TimeoutError:
            raise SandboxFailed(f"the sandbox's agent did not park within {wait_s:g} s") from None
        except (ProtocolError, OSError, ConnectionError) as exc:
            raise SandboxFailed(f"the sandbox's agent broke the protocol: {exc}") from None

    async def fs(self, message: dict[str, Any]) -> FsEvent:
        """Send one ``fs`` request (``message`` without ``op`` and ``id``) and return its
        answer, ``ok`` or not; the caller checks every field it reads (the agent is the
        sandbox's). Raises ``SandboxFailed`` when the agent refuses the request outright
        (an ``error``), breaks the protocol or does not answer within ``FS_TIMEOUT_S``."""
        self._next_id += 1
        request_id = self._next_id
        await self._send(cast(FsMessage, {"op": "fs", "id": request_id, **message}))
        answer = await self._answer(request_id, "fs", FS_TIMEOUT_S, "answer a file request")
        return cast(FsEvent, answer)

    async def _answer(
        self, request_id: int, event: str, wait_s: float, what: str
    ) -> dict[str, Any]:
        """The agent's ``event`` answering request ``request_id``, within ``wait_s``.
        Raises ``SandboxFailed`` (the agent then ``broken`` unless it refused) when it
        refuses (an ``error``: an agent that does not know the op says so without an
        id), stops, breaks the protocol or does not answer in time; ``what`` names the
        request in those messages ("restart its interpreter")."""
        try:
            async with asyncio.timeout(wait_s):
                while True:
                    answer = await self._channel.receive()
                    if answer is None:
                        self.broken = True
                        raise SandboxFailed(f"the sandbox stopped before it could {what}")
                    kind, about = answer.get("ev"), answer.get("id")
                    if kind == event and about == request_id:
                        return answer
                    if kind == "error" and about in (request_id, None):
                        text, _ = cut_text(str(answer.get("message")), 500)
                        raise SandboxFailed(f"the sandbox's agent cannot {what}: {text}")
        except TimeoutError:
            self.broken = True
            raise SandboxFailed(f"the sandbox's agent did not {what} within {wait_s:g} s") from None
        except (ProtocolError, OSError, ConnectionError) as exc:
            self.broken = True
            raise SandboxFailed(f"the sandbox's agent broke the protocol: {exc}") from None

    async def _state(self, fields: dict[str, Any], timeout_s: float) -> Outcome:
        """Run a save or load (an ``exec`` with ``state``) like a cell; its outcome, or
        ``SandboxFailed`` with the agent's own message when it did not end "ok"."""
        self._next_id += 1
        budget = Budget(result_bytes=STATE_RESULT_BYTES)
        message = cast(ExecMessage, {
            "op": "exec", "id": self._next_id, "language": "python", "code": "",
            "timeout_s": timeout_s, "env": {}, "budget": budget.to_message(), **fields,
        })  # fmt: skip
        outcome = await self._run(message, budget, _discard)
        if outcome.status == "ok":
            return outcome
        verb = "save" if fields["state"] == "save" else "load"
        if outcome.status in ("timeout", "cancelled"):
            why = f"it did not finish within {timeout_s:g} s ({outcome.status})"
        elif outcome.error is not None:
            why = f"{outcome.error['name']}: {outcome.error['value']}"
        else:
            why = "it failed without saying why"
        raise SandboxFailed(f"the sandbox could not {verb} its variables: {clean_text(why)[:500]}")

    async def _run(self, message: ExecMessage, budget: Budget, on_stream: StreamSink) -> Outcome:
        """Send ``message`` (an ``exec``) and collect its outcome (see :meth:`execute`)."""
        run_id, timeout_s = message["id"], float(message.get("timeout_s", 60))
        with tracing.span("agent round trip", language=message["language"]):
            return await self._round_trip(message, budget, on_stream, run_id, timeout_s)

    async def _round_trip(
        self,
        message: ExecMessage,
        budget: Budget,
        on_stream: StreamSink,
        run_id: int,
        timeout_s: float,
    ) -> Outcome:
        await self._send(message)
        displays = _Displays(budget)
        try:
            async with asyncio.timeout(timeout_s + INTERRUPT_GRACE_S):
                return await self._collect(run_id, on_stream, displays)
        except TimeoutError:
            self.broken = True
            raise SandboxFailed(
                f"the sandbox did not answer within {timeout_s + INTERRUPT_GRACE_S:.0f} s "
                "of the run's start; it was stopped and will be restarted on the next call"
            ) from None
        except asyncio.CancelledError:
            await self._interrupt_after_cancel(run_id, on_stream, displays)
            raise

    async def _interrupt_after_cancel(
        self, run_id: int, on_stream: StreamSink, displays: _Displays
    ) -> None:
        # Shielded: the caller is being cancelled, but the agent must finish this run
        # before the session can take another one. anyio's shield, because the MCP SDK
        # cancels tools with anyio cancel scopes, which re-deliver cancellation at every
        # await inside them (asyncio.shield alone would be interrupted again at once).
        try:
            with anyio.CancelScope(shield=True):
                await self._send({"op": "interrupt", "id": run_id, "reason": "cancelled"})
                with anyio.fail_after(INTERRUPT_GRACE_S):
                    await self._collect(run_id, on_stream, displays)
        except (TimeoutError, SandboxFailed):
            # The agent is stuck or gone: the session manager replaces the sandbox.
            self.broken = True

    async def _send(self, message: HostMessage) -> None:
        try:
            await self._channel.send(message)
        except (OSError, ConnectionError) as exc:
            self.broken = True
            raise SandboxFailed(f"the sandbox's agent channel is closed ({exc})") from None

    async def _collect(self, run_id: int, on_stream: StreamSink, displays: _Displays) -> Outcome:
        while True:
            try:
                message = await self._channel.receive()
            except (ProtocolError, OSError, ConnectionError) as exc:
                self.broken = True
                raise SandboxFailed(f"the sandbox's agent broke the protocol: {exc}") from None
            if message is None:
                self.broken = True
                raise SandboxFailed("the sandbox stopped while running the code")
            if message.get("id") != run_id:
                continue  # late output of an earlier, abandoned run
            # Typed below by what the agent claims to have sent: a hostile agent may send
            # anything, so every field read is still checked (_Displays, _outcome).
            event = message.get("ev")
            if event == "stream":
                on_stream(str(message.get("name")), str(message.get("text", "")))
            elif event == "display":
                displays.add(cast(DisplayEvent, message))
            elif event == "done":
                _trace_kernel_run(message.get("run_s"))
                return _outcome(cast(DoneEvent, message), displays)
            elif event == "error":  # the agent refused this exec: no done follows
                text, _ = cut_text(str(message.get("message")), displays.gate.budget.text_chars)
                error = {"name": "AgentError", "value": text, "traceback": ""}
                return Outcome("error", None, None, error, None, False, displays.kept)


def _trace_kernel_run(run_s: object) -> None:
    """The run as the agent timed it, ending now (its clock is the sandbox's: only the
    length is taken, and it is hostile: a number, never longer than the round trip)."""
    if not isinstance(run_s, (int, float)) or not math.isfinite(run_s) or run_s < 0:
        return
    end = time.time_ns()
    parent = trace.get_current_span()
    started = getattr(parent, "start_time", None)  # the SDK's spans have one
    start = end - int(min(run_s, end / 1e9) * 1e9)  # 1e300 s would overflow an int
    if isinstance(started, int):
        start = max(start, started)
    tracing.past_span("kernel run", start, end)


def _discard(name: str, text: str) -> None:
    """What a save or load prints (a value's ``__reduce__`` may): nobody reads it."""


class _Displays:
    """A run's displays as they arrive: admitted by the budget, or dropped at once."""

    def __init__(self, budget: Budget) -> None:
        self.gate = DisplayGate(budget)
        self.kept: list[Display] = []

    def add(self, message: DisplayEvent) -> None:
        data = self.gate.admit(message.get("data"))
        if data is not None:
            self.kept.extend(_displays(str(message.get("source", "display")), data))


#: A bundle's richer forms: beside one of these, its ``text/plain`` is only a fallback
#: (``<Figure size 640x480 with 1 Axes>``) and is left out.
_RICHER = frozenset(RICH_MIMES)
#: Text forms a display keeps (the agent's ``cells.RICH_MIMES`` and ``text/plain``).
_TEXTS = frozenset(_RICHER - {"image/png", "image/jpeg"} | {"text/plain"})


def _displays(source: str, data: dict[str, str]) -> list[Display]:
    out: list[Display] = []
    fallback = not _RICHER.intersection(data)
    for mime, value in data.items():
        if mime == "text/plain" and not fallback:
            continue
        if not isinstance(value, str):
            continue
        if mime in ("image/png", "image/jpeg"):
            try:
                out.append(Display(source, mime, base64.b64decode(value, validate=True)))
            except (binascii.Error, ValueError):
                continue
        elif mime in _TEXTS:
            out.append(Display(source, mime, value.encode("utf-8")))
    return out


def _outcome(message: DoneEvent, displays: _Displays) -> Outcome:
    status = message.get("status")
    limit = displays.gate.budget.text_chars
    raw = message.get("result")
    result, result_cut = cut_text(raw, limit) if isinstance(raw, str) else (None, False)
    error, error_cut = cut_error(message.get("error"), limit)
    return Outcome(
        status=status if status in ("ok", "error", "timeout", "cancelled") else "error",
        exit_code=_int_or_none(message.get("exit_code")),
        result=result,
        error=error,
        execution_count=_int_or_none(message.get("execution_count")),
        state_lost=bool(message.get("state_lost", False)),
        displays=displays.kept,
        cut=_cuts(message.get("cut"), result_cut, error_cut, displays.gate),
    )


def _cuts(claimed: Any, result_cut: bool, error_cut: bool, gate: DisplayGate) -> dict[str, int]:
    """What was cut: the agent's account (checked, it may lie) plus ours; zeros left out."""
    agent = claimed if isinstance(claimed, dict) else {}

    def said(key: str) -> int:
        value = _int_or_none(agent.get(key))
        return min(value, 1 << 30) if value is not None and value > 0 else 0

    cuts = {
        "result": int(result_cut or agent.get("result") is True),
        "error": int(error_cut or agent.get("error") is True),
        "displays_dropped": said("displays_dropped") + gate.dropped,
        "displays_cut": said("displays_cut") + gate.cut,
        "images_dropped": said("images_dropped") + gate.images_dropped,
        "displays_unsupported": said("displays_unsupported"),
    }
    return {key: value for key, value in cuts.items() if value}


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
