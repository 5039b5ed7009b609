"""The warm pool's target (``sessions.demand``): how its ceiling is chosen, that a burst
that ran the pool out raises it (never past the ceiling), that idle brings it back, and
that its trend moves only as its table says. Times are given, never waited for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mcp_code_sandbox.errors import InternalError
from mcp_code_sandbox.sessions import demand
from mcp_code_sandbox.sessions.demand import Demand, Trend

MIB = 1024**2


def burst(d: Demand, at: float, size: int, hits: int) -> list[demand.Decision]:
    """``size`` claims at ``at``, the first ``hits`` of them served warm."""
    made = [d.claimed(at, 0.0, hit=i < hits) for i in range(size)]
    return [m for m in made if m is not None]


def test_the_ceiling_is_the_least_of_sessions_memory_and_uids() -> None:
    common: dict[str, Any] = {"max_sessions": 10, "memory_limit": 512 * MIB, "spare_uids": None}
    assert demand.ceiling(2, available=64 * 1024 * MIB, **common) == 10  # the sessions
    assert demand.ceiling(2, available=2048 * MIB, **common) == 4  # memory: 2 GiB / 512 MiB
    with_uids = common | {"spare_uids": 3}
    assert demand.ceiling(2, available=64 * 1024 * MIB, **with_uids) == 3
    many = common | {"max_sessions": 1000}
    assert demand.ceiling(2, available=1024**4, **many) == demand.MAX_CEILING


def test_the_ceiling_never_goes_below_the_operators_size() -> None:
    # Memory unknown, or too little for one more: the configured size stands.
    kwargs: dict[str, Any] = {"max_sessions": 10, "memory_limit": 512 * MIB, "spare_uids": None}
    assert demand.ceiling(2, available=None, **kwargs) == 2
    assert demand.ceiling(3, available=100 * MIB, **kwargs) == 3


def test_available_memory_reads_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  2048 kB\nMemFree: 100 kB\nMemAvailable:   1024 kB\n")
    assert demand.available_memory(meminfo) == 1024 * 1024
    meminfo.write_text("MemTotal:  2048 kB\n")
    assert demand.available_memory(meminfo) is None
    assert demand.available_memory(tmp_path / "missing") is None


def test_a_burst_that_runs_the_pool_out_grows_the_target_to_its_size() -> None:
    d = Demand(2, 16)
    [decision] = burst(d, 100.0, 10, hits=2)[-1:]
    assert d.target == 10 and d.trend is Trend.GROWN
    assert decision.kind == "grow" and decision.target == 10 and "10 new sessions" in decision.why


def test_growth_stops_at_the_ceiling() -> None:
    d = Demand(2, 6)
    decisions = burst(d, 100.0, 20, hits=2)
    assert d.target == 6 and max(x.target for x in decisions) == 6
    assert "ceiling" in decisions[-1].why


def test_claims_served_warm_never_grow_it() -> None:
    d = Demand(2, 16)
    assert burst(d, 100.0, 2, hits=2) == []
    assert d.target == 2 and d.trend is Trend.RESTING


def test_claims_spread_wider_than_a_refill_are_not_one_burst() -> None:
    d = Demand(2, 16)
    d.refilled(0.1)  # a quick start: the window stays MIN_WINDOW_S
    for i in range(10):  # one miss every 2 windows: the pool keeps up
        d.claimed(100.0 + i * 2 * demand.MIN_WINDOW_S, 0.0, hit=False)
    assert d.target == 2


def test_a_slow_refill_widens_the_window() -> None:
    d = Demand(2, 16)
    for _ in range(20):
        d.refilled(5.0)
    assert d.window_s() > 4.0
    for i in range(6):  # one every half second: six within one refill time
        d.claimed(100.0 + i / 2, 0.0, hit=False)
    assert d.target == 6


def test_idle_brings_it_back_to_the_floor_then_rest() -> None:
    d = Demand(2, 16)
    burst(d, 100.0, 10, hits=2)
    assert d.settle(100.0 + demand.IDLE_S / 2, 0.0, held=10) is None
    assert d.target == 10
    decision = d.settle(100.0 + demand.IDLE_S + 1, 0.0, held=10)
    assert decision is not None and decision.kind == "shrink" and decision.target == 2
    assert d.target == 2 and d.trend is Trend.SHRINKING and d.excess(10) == 8
    assert d.settle(100.0 + demand.IDLE_S + 2, 0.0, held=5) is None
    assert d.trend is Trend.SHRINKING
    d.settle(100.0 + demand.IDLE_S + 3, 0.0, held=2)
    trend: Trend = d.trend  # moved by settle, which mypy cannot see
    assert trend is Trend.RESTING and d.excess(2) == 0


def test_a_new_burst_while_shrinking_grows_it_again() -> None:
    d = Demand(2, 16)
    burst(d, 100.0, 10, hits=2)
    d.settle(100.0 + demand.IDLE_S + 1, 0.0, held=10)
    burst(d, 100.0 + demand.IDLE_S + 2, 5, hits=0)
    assert d.target == 5 and d.trend is Trend.GROWN


def test_a_pool_that_is_off_never_grows() -> None:
    d = Demand(0, 16)
    assert burst(d, 100.0, 10, hits=0) == []
    assert d.target == 0 and d.trend is Trend.RESTING


@pytest.mark.parametrize(
    ("start", "to"),
    [(Trend.RESTING, Trend.SHRINKING), (Trend.RESTING, Trend.RESTING), (Trend.GROWN, Trend.GROWN)],
)
def test_a_move_outside_the_table_is_refused(start: Trend, to: Trend) -> None:
    with pytest.raises(InternalError, match="cannot go from"):
        demand.transition(start, to)
