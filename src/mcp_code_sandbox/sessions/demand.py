"""How many warm sandboxes the pool (:mod:`.pool`) should hold: its *target*, which
follows demand between ``SANDBOX_POOL_SIZE`` (the *floor*) and a *ceiling*. Decisions
only: the pool asks, then starts or stops sandboxes itself.

Semantics:

- **Ceiling**, fixed when the server starts (:func:`ceiling`): the smallest of
  ``max_sessions`` (a warm sandbox that no session could take is waste: never more than
  could be claimed at once), the host's available memory divided by the sandbox memory
  limit (each warm sandbox, once claimed, may grow to that limit; ``None`` when
  ``/proc/meminfo`` says nothing: the floor only), the host uids left over from sessions
  and paused sessions where the backend gives each sandbox one, and :data:`MAX_CEILING`.
  Never below the floor: the operator's own choice stands.
- **Growth**: every claim (hit or miss) is noted. A miss means the pool held too few:
  the target becomes the most claims seen within one *refill time* (the recent claim
  rate × the time the pool takes to start one sandbox, measured, and at least
  :data:`MIN_WINDOW_S`), capped by the ceiling. A burst that drained the pool is thus
  served warm from its second wave on, once the pool has refilled to the new target.
  Claims that all hit never change the target.
- **Shrinking**: after :data:`IDLE_S` with no claim the target returns to the floor; the
  pool then stops the extra warm sandboxes, oldest first, one per watch pass.
- A pool of size 0 is off: it never grows.

The pool's :class:`Trend`, and what makes each true::

    RESTING    the target is the floor
    GROWN      a burst raised the target above the floor; it holds until idle
    SHRINKING  idle: the target is the floor again, and the pool still holds more

The moves (each by :meth:`Demand.claimed` or :meth:`Demand.settle`)::

    RESTING   -> GROWN      a claim missed, and more claims came within one refill time
                            than the floor
    GROWN     -> SHRINKING  idle for IDLE_S, and the pool holds more than the floor
    GROWN     -> RESTING    idle for IDLE_S, and the pool holds no more than the floor
    SHRINKING -> RESTING    the extra sandboxes are stopped (or were claimed)
    SHRINKING -> GROWN      a burst again before that
"""

from __future__ import annotations

import collections
import enum
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mcp_code_sandbox.errors import InternalError

__all__ = [
    "IDLE_S",
    "MAX_CEILING",
    "MIN_WINDOW_S",
    "Decision",
    "Demand",
    "Trend",
    "available_memory",
    "ceiling",
    "transition",
]

#: With no claim for this long the pool shrinks back to its floor. Bursts of an agent's
#: parallel calls or a workflow's runs come back within minutes; a warm sandbox costs
#: about a hundred MiB of idle memory, so an hour would be long to hold them.
IDLE_S = 300.0
#: The shortest span of claims counted as one burst: a refill time measured on a quiet
#: host (tens of ms on bwrap) would split the calls of one burst, which an MCP client
#: sends over some hundreds of milliseconds, into several.
MIN_WINDOW_S = 1.0
#: The refill time assumed before the first pooled sandbox has started.
FIRST_REFILL_S = 1.0
#: The weight of the newest refill time in its moving average.
_REFILL_WEIGHT = 0.3
#: The most warm sandboxes a pool holds whatever the host (``SANDBOX_POOL_SIZE``'s own
#: bound): past it a burst is better served by a second replica than a bigger pool.
MAX_CEILING = 64


class Trend(enum.Enum):
    RESTING = "resting"
    GROWN = "grown"
    SHRINKING = "shrinking"


_MOVES: dict[Trend, frozenset[Trend]] = {
    Trend.RESTING: frozenset({Trend.GROWN}),
    Trend.GROWN: frozenset({Trend.SHRINKING, Trend.RESTING}),
    Trend.SHRINKING: frozenset({Trend.RESTING, Trend.GROWN}),
}


def transition(trend: Trend, to: Trend) -> Trend:
    """``to``, when the module docstring's table has the move from ``trend``; else
    ``InternalError`` (a bug of ours)."""
    if to not in _MOVES[trend]:
        raise InternalError(f"the warm pool cannot go from {trend.value} to {to.value}")
    return to


@dataclass(frozen=True)
class Decision:
    """One change of the target, as metrics and ``/ui`` show it."""

    kind: Literal["grow", "shrink"]
    target: int
    #: In words, for the operator.
    why: str
    #: Wall-clock time (``time.time()``).
    at: float


def available_memory(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The host's ``MemAvailable`` in bytes; ``None`` when it cannot be read."""
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            fields = value.split()
            if fields and fields[0].isdigit():
                return int(fields[0]) * 1024
    return None


def ceiling(
    floor: int,
    *,
    max_sessions: int,
    memory_limit: int,
    available: int | None,
    spare_uids: int | None,
) -> int:
    """The most warm sandboxes the pool may hold (see the module docstring).
    ``spare_uids``: host uids no session or paused session can need; ``None`` where
    sandboxes get no uid of their own."""
    bounds = [max_sessions, MAX_CEILING, 0 if available is None else available // memory_limit]
    if spare_uids is not None:
        bounds.append(spare_uids)
    return max(floor, min(bounds))


class Demand:
    """The pool's target, from the claims it saw (see the module docstring). Every
    method takes the time (``time.monotonic()``) from its caller: no clock of its own."""

    def __init__(self, floor: int, ceiling: int) -> None:
        self.floor = floor
        self.ceiling = max(floor, ceiling)
        self.target = floor
        self.trend = Trend.RESTING
        self.refill_s = FIRST_REFILL_S
        #: The newest decision, or ``None`` before the first.
        self.last: Decision | None = None
        #: When each recent claim came (at most one window's worth beyond the ceiling
        #: is ever needed: older ones are dropped as new ones come).
        self._claims: collections.deque[float] = collections.deque()
        self._last_claim: float | None = None

    def window_s(self) -> float:
        """The span of claims counted as one burst: one refill time, at least
        :data:`MIN_WINDOW_S`."""
        return max(MIN_WINDOW_S, self.refill_s)

    def refilled(self, seconds: float) -> None:
        """One pooled sandbox took ``seconds`` to start."""
        self.refill_s += _REFILL_WEIGHT * (seconds - self.refill_s)

    def claimed(self, now: float, wall: float, *, hit: bool) -> Decision | None:
        """A session asked the pool for a sandbox (``hit``: it got one). Returns the
        decision to grow, if this claim made one."""
        self._last_claim = now
        if self.floor == 0:
            return None
        self._claims.append(now)
        horizon = now - self.window_s()
        while self._claims and self._claims[0] < horizon:
            self._claims.popleft()
        burst = len(self._claims)
        wanted = min(self.ceiling, burst)
        if hit or wanted <= self.target:
            return None
        self.target = wanted
        if self.trend is not Trend.GROWN:
            self.trend = transition(self.trend, Trend.GROWN)
        capped = " (the ceiling)" if wanted == self.ceiling else ""
        window = f"{self.window_s():.1f}"
        why = f"{burst} new sessions within {window} s and the pool ran out: {wanted}{capped}"
        self.last = Decision("grow", wanted, why, wall)
        return self.last

    def settle(self, now: float, wall: float, held: int) -> Decision | None:
        """A watch pass, with ``held`` sandboxes ready or starting: shrink after
        :data:`IDLE_S` without a claim. Returns the decision to shrink, if made now."""
        if self.trend is Trend.SHRINKING and held <= self.target:
            self.trend = transition(self.trend, Trend.RESTING)
        if self.trend is not Trend.GROWN:
            return None
        idle = math.inf if self._last_claim is None else now - self._last_claim
        if idle < IDLE_S:
            return None
        self.target = self.floor
        self._claims.clear()
        back = Trend.SHRINKING if held > self.floor else Trend.RESTING
        self.trend = transition(self.trend, back)
        why = f"no new session for {idle:.0f} s: back to SANDBOX_POOL_SIZE ({self.floor})"
        self.last = Decision("shrink", self.floor, why, wall)
        return self.last

    def excess(self, held: int) -> int:
        """How many of ``held`` sandboxes are beyond the target."""
        return max(0, held - self.target)
