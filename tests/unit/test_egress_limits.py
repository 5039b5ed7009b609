"""The proxies' budget of connections and the pace of refusals (``egress.limits``)."""

from __future__ import annotations

import resource
import time

import pytest
import structlog

from mcp_code_sandbox.egress import limits
from mcp_code_sandbox.egress.limits import ConnectionBudget, RefusalPace
from mcp_code_sandbox.metrics import Metrics


def test_the_budget_keeps_half_the_descriptors_and_bounds_each_owner(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda _: (20_000, 20_000))
    budget = ConnectionBudget.for_process(per_proxy=64)
    # Half the descriptors stay the server's; two per connection; a quarter each owner.
    assert (budget.total, budget.share) == (5_000, 1_250)
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1_024, 4_096))
    assert ConnectionBudget.for_process(per_proxy=64).share == 64  # never below one proxy


def test_an_owner_past_its_share_is_refused_while_others_are_served() -> None:
    budget = ConnectionBudget(total=10, share=4)
    assert [budget.take("alice") for _ in range(4)] == [None] * 4
    refusal = budget.take("alice")
    assert refusal is not None and refusal[0] == "owner_share" and "share" in refusal[1]
    assert [budget.take("bob") for _ in range(4)] == [None] * 4
    budget.give("alice")
    assert budget.take("alice") is None
    assert budget.take("carol") is None and budget.take("carol") is None
    full = budget.take("carol")  # 10 held: the server's budget, whoever asks
    assert full is not None and full[0] == "server_reserve"


async def test_refusals_past_the_rate_wait_and_leave_one_summary(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(limits, "REFUSAL_BURST", 3)
    monkeypatch.setattr(limits, "REFUSALS_PER_S", 100.0)
    metrics = Metrics("test")
    pace = RefusalPace("sess_a", "alice", metrics)
    with structlog.testing.capture_logs() as logs:
        started = time.monotonic()
        lines = [await pace.wait() for _ in range(40)]
        elapsed = time.monotonic() - started
        pace.summarise()
    # However slow this machine: no more lines than the burst and the rate allow.
    assert lines[:3] == [True] * 3
    assert sum(lines) <= 3 + elapsed * 100 + 1
    assert elapsed >= (40 - 3 - 1) / 100  # the flood was slowed to the rate
    summary = [entry for entry in logs if entry["event"] == "egress refusals throttled"]
    assert len(summary) == 1 and summary[0]["refusals_without_line"] == lines.count(False)
    text = metrics.render(None)[0].decode()
    assert 'mcp_sandbox_egress_refusals_total{reason="throttled"}' in text
