"""Telling clients that the tool list changed (``run_code``'s language enum is in it).

Two protocol eras, two ways, and a client of either must hear it:

- 2026-07-28 clients open a ``subscriptions/listen`` stream; an event published on the
  server's subscription bus reaches every open one.
- Handshake-era clients get ``notifications/tools/list_changed`` on their session, and
  only if ``initialize`` advertised ``tools.listChanged``. The SDK derives that flag from
  ``NotificationOptions`` given to ``create_initialization_options``, which ``MCPServer``
  calls without any; :func:`advertise_tools_changed` supplies them. Sessions are
  remembered (weakly) as they make requests, by a middleware, so a change found during one
  client's call reaches all of them.
"""

from __future__ import annotations

import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import structlog
from mcp.server import MCPServer
from mcp.server.lowlevel.server import NotificationOptions
from mcp.server.subscriptions import SubscriptionBus, ToolsListChanged
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

__all__ = ["ToolListNotifier", "advertise_tools_changed"]

log = structlog.get_logger("mcp_code_sandbox.server")

#: Longest one session's notification may take (a client that stopped reading).
SEND_TIMEOUT_S = 2.0


def advertise_tools_changed(mcp: MCPServer[Any]) -> None:
    """Make ``initialize`` say ``tools.listChanged: true`` (handshake era)."""
    lowlevel = mcp._lowlevel_server  # the SDK offers no public way yet
    create = lowlevel.create_initialization_options

    def create_with_tools_changed(
        notification_options: NotificationOptions | None = None, *args: Any, **kwargs: Any
    ) -> Any:
        options = notification_options or NotificationOptions(tools_changed=True)
        return create(options, *args, **kwargs)

    lowlevel.create_initialization_options = create_with_tools_changed  # type: ignore[method-assign]


class ToolListNotifier:
    def __init__(self, bus: SubscriptionBus) -> None:
        self._bus = bus
        self._sessions: weakref.WeakSet[Any] = weakref.WeakSet()

    async def middleware(self, ctx: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
        """Remember every handshake-era session that makes a request."""
        session = getattr(ctx, "session", None)
        try:
            legacy = (
                session is not None and session.protocol_version not in MODERN_PROTOCOL_VERSIONS
            )
        except Exception:  # not initialized yet
            legacy = False
        if legacy:
            self._sessions.add(session)
        return await call_next(ctx)

    async def tools_changed(self) -> None:
        await self._bus.publish(ToolsListChanged())
        for session in list(self._sessions):
            try:
                with anyio.fail_after(SEND_TIMEOUT_S):
                    await session.send_tool_list_changed()
            except Exception as exc:  # gone away: forget it
                log.debug("tools/list_changed not delivered", error=repr(exc))
                self._sessions.discard(session)
