"""The host's side of the agent protocol: run one request and collect what comes back.

The session manager calls :meth:`AgentClient.execute` with the session's lock held, so at
most one request is in flight per agent. Broken frames, EOF and an agent that stops
answering are translated here, once, into :class:`~mcp_code_sandbox.errors.SandboxFailed`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from mcp_code_sandbox.agent.protocol import ProtocolError
from mcp_code_sandbox.backends.base import Channel
from mcp_code_sandbox.errors import SandboxFailed

__all__ = ["INTERRUPT_GRACE_S", "AgentClient", "Display", "Outcome"]

#: How long after its deadline an agent gets to answer (its own SIGINT grace is 2 s, then a
#: kill and an interpreter restart) before the host gives up on the whole sandbox.
INTERRUPT_GRACE_S = 15.0

StreamSink = Callable[[str, str], None]


@dataclass(frozen=True)
class Display:
    """One rich output of a run: a figure or a ``display()`` call."""

    source: str
    mime_type: str
    #: Decoded bytes for images (PNG); UTF-8 text for text types and SVG.
    data: bytes


@dataclass
class Outcome:
    """The agent's ``done`` message, plus the rich outputs that came before it."""

    status: str
    exit_code: int | None
    result: str | None
    error: dict[str, str] | None
    execution_count: int | None
    state_lost: bool
    displays: list[Display] = field(default_factory=list)


class AgentClient:
    def __init__(self, channel: Channel) -> None:
        self._channel = channel
        self._next_id = 0
        #: True once the agent broke the protocol, went silent or was abandoned mid-run:
        #: the session manager then replaces the sandbox (and reports ``state_lost``).
        self.broken = False

    async def execute(
        self,
        *,
        language: str,
        code: str,
        timeout_s: float,
        env: dict[str, str],
        on_stream: StreamSink,
    ) -> Outcome:
        """Run one cell and return its outcome.

        If the calling task is cancelled, the run is interrupted (reason ``cancelled``)
        and its ``done`` awaited, bounded, before the cancellation propagates, so the
        agent is ready for the next call. Raises ``SandboxFailed`` when the agent breaks
        the protocol or does not answer within ``timeout_s + INTERRUPT_GRACE_S``.
        """
        self._next_id += 1
        run_id = self._next_id
        await self._send(
            {
                "op": "exec",
                "id": run_id,
                "language": language,
                "code": code,
                "timeout_s": timeout_s,
                "env": env,
            }
        )
        displays: list[Display] = []
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
        self, run_id: int, on_stream: StreamSink, displays: list[Display]
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

    async def _send(self, message: dict[str, Any]) -> None:
        try:
            await self._channel.send(message)
        except (OSError, ConnectionError) as exc:
            self.broken = True
            raise SandboxFailed(f"the sandbox's agent channel is closed ({exc})") from None

    async def _collect(
        self, run_id: int, on_stream: StreamSink, displays: list[Display]
    ) -> Outcome:
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
            event = message.get("ev")
            if event == "stream":
                on_stream(str(message.get("name")), str(message.get("text", "")))
            elif event == "display":
                displays.extend(_displays(message))
            elif event == "done":
                return _outcome(message, displays)
            elif event == "error":  # the agent refused this exec: no done follows
                error = {"name": "AgentError", "value": str(message.get("message")),
                         "traceback": ""}  # fmt: skip
                return Outcome("error", None, None, error, None, False, displays)


def _displays(message: dict[str, Any]) -> list[Display]:
    source = str(message.get("source", "display"))
    data = message.get("data")
    if not isinstance(data, dict):
        return []
    out: list[Display] = []
    for mime, value in data.items():
        if not isinstance(value, str):
            continue
        if mime in ("image/png", "image/jpeg"):
            try:
                out.append(Display(source, mime, base64.b64decode(value, validate=True)))
            except (binascii.Error, ValueError):
                continue
        elif mime in ("image/svg+xml", "text/markdown", "text/plain", "text/html"):
            out.append(Display(source, mime, value.encode("utf-8")))
    return out


def _outcome(message: dict[str, Any], displays: list[Display]) -> Outcome:
    error = message.get("error")
    status = message.get("status")
    return Outcome(
        status=status if status in ("ok", "error", "timeout", "cancelled") else "error",
        exit_code=_int_or_none(message.get("exit_code")),
        result=_str_or_none(message.get("result")),
        error=(
            {k: str(error.get(k, "")) for k in ("name", "value", "traceback")}
            if isinstance(error, dict)
            else None
        ),
        execution_count=_int_or_none(message.get("execution_count")),
        state_lost=bool(message.get("state_lost", False)),
        displays=displays,
    )


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) else None
