"""What the egress proxies may take of the server: descriptors, and the rate of refusals.

Every proxied connection costs the server two file descriptors (the sandbox's side and
the upstream's). A :class:`ConnectionBudget` is shared by every proxy of one server: it
keeps a reserve of the process's descriptors (``RLIMIT_NOFILE``) that no proxy can
take, and bounds what one owner's sandboxes take together, so that one tenant's flood
of connections leaves the server able to start another tenant's session and serve its
calls. The cap of one proxy (``proxy.MAX_CONNECTIONS``) is below that share.

A :class:`RefusalPace` belongs to one proxy: refusals (a 403 of the policy, a 503 past a
limit) past :data:`REFUSALS_PER_S` are delayed, and their log lines summarised, so a
sandbox that asks for blocked hosts in a loop neither floods the log nor takes the event
loop from other tenants.
"""

from __future__ import annotations

import asyncio
import resource
import time
from dataclasses import dataclass, field

import structlog

from mcp_code_sandbox.metrics import Metrics

__all__ = [
    "FDS_PER_CONNECTION",
    "REFUSALS_PER_S",
    "ConnectionBudget",
    "RefusalPace",
]

log = structlog.get_logger("mcp_code_sandbox.egress")

#: The sandbox's side and the upstream's.
FDS_PER_CONNECTION = 2
#: The part of the process's descriptors the proxies never take: the server's own files,
#: sandboxes' channels, its HTTP clients. Half: the server's other users of descriptors
#: are bounded by its session limits, while connections are the sandbox's to open.
RESERVE_FRACTION = 0.5
#: An owner's sandboxes together hold at most this part of the proxies' budget (but at
#: least what one proxy may hold), so four owners in a flood still leave room.
OWNER_FRACTION = 0.25
#: Refusals a proxy answers at once per second (and logs line by line); more wait.
REFUSALS_PER_S = 20.0
#: Refusals answered at once in a burst (a page naming a few blocked hosts).
REFUSAL_BURST = 40
#: Seconds between two summaries of the refusals whose log lines were left out.
SUMMARY_S = 10.0


@dataclass
class ConnectionBudget:
    """Connections the proxies of one server may hold at once: ``total`` across all,
    ``share`` for one owner's sandboxes together. Made once by the server
    (:meth:`for_process`) and given to every proxy it opens."""

    total: int
    share: int
    held: int = 0
    by_owner: dict[str, int] = field(default_factory=dict)

    @classmethod
    def for_process(cls, per_proxy: int) -> ConnectionBudget:
        """From this process's soft ``RLIMIT_NOFILE``, less the reserve; an owner's share
        never below ``per_proxy`` (one proxy's cap) unless the whole budget is."""
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            soft = 1 << 20
        total = max(1, int(soft * (1 - RESERVE_FRACTION)) // FDS_PER_CONNECTION)
        return cls(total, min(total, max(per_proxy, int(total * OWNER_FRACTION))))

    def take(self, owner: str) -> tuple[str, str] | None:
        """Count one connection of ``owner``'s; None when granted, else why not: the
        metrics' reason and the sandbox's message (its 503). Every grant is given back
        with :meth:`give`."""
        if self.held >= self.total:
            return "server_reserve", (
                "the server's connections for sandboxes are all in use; try again later"
            )
        mine = self.by_owner.get(owner, 0)
        if mine >= self.share:
            return "owner_share", (
                f"this owner's sandboxes hold {mine} connections, their share of the "
                "server's; close some"
            )
        self.held += 1
        self.by_owner[owner] = mine + 1
        return None

    def give(self, owner: str) -> None:
        self.held -= 1
        left = self.by_owner.get(owner, 1) - 1
        if left > 0:
            self.by_owner[owner] = left
        else:
            self.by_owner.pop(owner, None)


class RefusalPace:
    """One proxy's refusals: at most :data:`REFUSALS_PER_S` answered (and logged) at
    once per second after a burst of :data:`REFUSAL_BURST`; past that each waits its
    turn (:meth:`wait`), its audit line is left out (:meth:`log_line` says False) and
    counted, and a summary line says how many every :data:`SUMMARY_S`."""

    def __init__(self, session: str, owner: str, metrics: Metrics | None) -> None:
        self.session = session
        self.owner = owner
        self._metrics = metrics
        #: When the refusals so far would have been answered at exactly the rate (GCRA):
        #: a refusal is answered at once while that is at most a burst ahead of now.
        self._due = 0.0
        self._left_out = 0
        self._summarised = time.monotonic()

    async def wait(self) -> bool:
        """Before answering one refusal: at once while the rate allows, else after its
        turn. Returns whether its log line may be written."""
        now = time.monotonic()
        interval = 1 / REFUSALS_PER_S
        self._due = max(self._due, now) + interval
        delay = self._due - now - REFUSAL_BURST * interval
        if delay <= 0:
            return True
        self._left_out += 1
        if self._metrics is not None:
            self._metrics.egress_refused("throttled")
        self._maybe_summarise(now)
        await asyncio.sleep(delay)
        return False

    def _maybe_summarise(self, now: float) -> None:
        if self._left_out and now - self._summarised >= SUMMARY_S:
            self.summarise()

    def summarise(self) -> None:
        """Log how many refusals had no line of their own since the last summary (also
        called when the proxy closes)."""
        if self._left_out:
            log.warning(
                "egress refusals throttled",
                session=self.session,
                owner=self.owner,
                refusals_without_line=self._left_out,
                per_s=REFUSALS_PER_S,
            )
        self._left_out = 0
        self._summarised = time.monotonic()
