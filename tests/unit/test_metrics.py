"""Metrics: what each hook counts, bounded labels, one registry per service."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mcp_code_sandbox import __version__
from mcp_code_sandbox import metrics as metrics_module
from mcp_code_sandbox.errors import ERROR_CODES, BackendUnavailable, InvalidPath, SandboxFailed
from mcp_code_sandbox.metrics import Metrics


def value(m: Metrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def test_all_is_honest() -> None:
    for name in metrics_module.__all__:
        assert hasattr(metrics_module, name)


def test_a_run_counts_by_language_and_status_with_its_duration() -> None:
    m = Metrics("bwrap")
    m.run_finished("python", "ok", 0.2)
    m.run_finished("python", "ok", 3.0)
    m.run_finished("bash", "timeout", 60.0)
    assert value(m, "mcp_sandbox_runs_total", language="python", status="ok") == 2
    assert value(m, "mcp_sandbox_runs_total", language="bash", status="timeout") == 1
    assert value(m, "mcp_sandbox_run_duration_seconds_count", language="python") == 2
    assert value(m, "mcp_sandbox_run_duration_seconds_sum", language="python") == pytest.approx(3.2)
    assert value(m, "mcp_sandbox_run_duration_seconds_bucket", language="python", le="0.25") == 1


def test_labels_stay_within_their_sets() -> None:
    m = Metrics("bwrap")
    m.run_finished("python", "something-else", 0.1)
    m.tool_error("not-a-code")
    m.backend_error("not-a-code")
    assert value(m, "mcp_sandbox_runs_total", language="python", status="error") == 1
    assert value(m, "mcp_sandbox_tool_errors_total", code="internal_error") == 1
    assert value(m, "mcp_sandbox_backend_errors_total", code="sandbox_failed") == 1
    families = {f.name: f for f in text_string_to_metric_families(m.render(None)[0].decode())}
    codes = {s.labels["code"] for s in families["mcp_sandbox_tool_errors"].samples}
    assert codes == set(ERROR_CODES)  # every code exported from the start, none added


def test_sessions_and_backend_errors() -> None:
    m = Metrics("docker")
    open_now = [3]
    m.track_sessions(lambda: open_now[0])
    m.session_created()
    m.session_ended("idle")
    assert value(m, "mcp_sandbox_sessions_active") == 3
    open_now[0] = 1
    assert value(m, "mcp_sandbox_sessions_active") == 1  # read at every scrape
    assert value(m, "mcp_sandbox_sessions_created_total") == 1
    assert value(m, "mcp_sandbox_sessions_ended_total", reason="idle") == 1
    assert value(m, "mcp_sandbox_sessions_ended_total", reason="closed") == 0
    assert value(m, "mcp_sandbox_build_info", version=__version__, backend="docker")
    for error in (BackendUnavailable("down"), SandboxFailed("died"), InvalidPath("no")):
        with pytest.raises(type(error)), m.counting_backend_errors():
            raise error
    assert value(m, "mcp_sandbox_backend_errors_total", code="backend_unavailable") == 1
    assert value(m, "mcp_sandbox_backend_errors_total", code="sandbox_failed") == 1


def test_each_instance_has_its_own_registry() -> None:
    first, second = Metrics("bwrap"), Metrics("bwrap")  # no "duplicated timeseries" error
    first.session_created()
    assert value(second, "mcp_sandbox_sessions_created_total") == 0


def test_openmetrics_when_the_scraper_asks() -> None:
    m = Metrics("bwrap")
    body, content_type = m.render("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert body.rstrip().endswith(b"# EOF")
    body, content_type = m.render(None)
    assert content_type.startswith("text/plain")
    assert b"mcp_sandbox_runs_created" not in body and b"tool_errors_created" not in body
