"""The egress package's exports, its metrics' bounded labels, and its refusal text."""

from __future__ import annotations

import importlib

import pytest

from mcp_code_sandbox import metrics as metrics_module
from mcp_code_sandbox.egress import blocked_message
from mcp_code_sandbox.metrics import Metrics

MODULES = [
    "",
    ".policy",
    ".dns",
    ".secrets",
    ".tls",
    ".http",
    ".streams",
    ".intercept",
    ".audit",
    ".proxy",
    ".gate",
]


@pytest.mark.parametrize("suffix", MODULES)
def test_every_exported_name_exists(suffix: str) -> None:
    module = importlib.import_module("mcp_code_sandbox.egress" + suffix)
    for name in module.__all__:
        assert hasattr(module, name), f"{module.__name__}.{name}"


def test_the_refusal_says_what_the_model_can_act_on() -> None:
    assert blocked_message("evil.test") == (
        "blocked by sandbox network policy: evil.test is not in the allowlist"
    )


def test_egress_counters_by_outcome_and_host_with_bounded_hosts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(metrics_module, "MAX_EGRESS_HOSTS", 3)
    m = Metrics("bwrap")
    m.egress_connection("pypi.test", allowed=True)
    m.egress_connection("pypi.test", allowed=True)
    m.egress_connection("*.example.test", allowed=True)
    for n in range(10):  # a sandbox inventing names must not grow the registry
        m.egress_connection(f"junk{n}.test", allowed=False)
    text = m.render(None)[0].decode()
    assert 'mcp_sandbox_egress_connections_total{host="pypi.test",outcome="allowed"} 2.0' in text
    assert 'host="*.example.test",outcome="allowed"} 1.0' in text
    assert 'host="junk2.test",outcome="blocked"} 1.0' in text
    assert 'host="junk3.test"' not in text
    assert 'mcp_sandbox_egress_connections_total{host="other",outcome="blocked"} 7.0' in text
