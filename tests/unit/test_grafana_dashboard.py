"""``deploy/grafana-dashboard.json``: loads, is laid out, and every PromQL expression names
metrics this server exports (``Metrics``' registry) or that are documented here as coming
(the warm pool's, issue 12)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from mcp_code_sandbox.metrics import Metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana-dashboard.json"

#: The warm pool's metrics (issue 12) and their types: allowed before they are in
#: ``Metrics``.
POOL_METRICS = {
    "mcp_sandbox_pool_claims": "counter",
    "mcp_sandbox_pool_claim_seconds": "histogram",
    "mcp_sandbox_cold_start_seconds": "histogram",
    "mcp_sandbox_pool_refill_seconds": "histogram",
    "mcp_sandbox_pool_sandboxes": "gauge",
}
#: Pausing (issue 13): what its panels must show.
PAUSE_METRICS = {
    "mcp_sandbox_sessions",
    "mcp_sandbox_pause_seconds",
    "mcp_sandbox_resume_seconds",
    "mcp_sandbox_paused_bytes",
    "mcp_sandbox_pause_fallbacks",
}
#: What the dashboard must show (the issue: sessions, runs, durations, errors by code).
REQUIRED = {
    "mcp_sandbox_sessions_active",
    "mcp_sandbox_sessions_created",
    "mcp_sandbox_sessions_ended",
    "mcp_sandbox_runs",
    "mcp_sandbox_run_duration_seconds",
    "mcp_sandbox_tool_errors",
    "mcp_sandbox_backend_errors",
    *POOL_METRICS,
    *PAUSE_METRICS,
}
_FUNCTIONS_AND_WORDS = {
    "sum", "rate", "irate", "increase", "histogram_quantile", "avg", "max", "min", "count",
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
    "label_values", "clamp_min", "clamp_max", "abs", "topk", "bottomk",
}  # fmt: skip
_SUFFIXES = ("_bucket", "_sum", "_count", "_total")
#: The series names a family of each type has in the exposition.
_SERIES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "gauge": ("",),
}


def series_names(families: dict[str, str]) -> set[str]:
    return {name + suffix for name, kind in families.items() for suffix in _SERIES[kind]}


def exported_families() -> dict[str, str]:
    """The metric families one server exports: name (counters without ``_total``) → type."""
    return {f.name: f.type for f in Metrics("bwrap").registry.collect()}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (labels, ranges, groupings, strings,
    numbers and functions left out)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings (label values, $vars)
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)
    words = re.findall(r"(?<![\w.$])([A-Za-z_:][A-Za-z0-9_:]*)\s*(\()?", expr)
    return {word for word, call in words if not call and word not in _FUNCTIONS_AND_WORDS}


def family(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def load() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text())
    assert isinstance(data, dict)
    return data


def expressions(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            found.append((panel["title"], target["expr"]))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            found.append((variable["name"], variable["definition"]))
    return found


def test_the_parser_finds_what_an_expression_selects() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, language) (rate(a_b_bucket{job=~"$job", '
        'x!="sum(rate(zzz))"}[$__rate_interval]))) / on (job) other_metric'
    )
    assert metric_names(expr) == {"a_b_bucket", "other_metric"}
    assert metric_names("label_values(mcp_sandbox_build_info, job)") == {
        "mcp_sandbox_build_info",
        "job",
    }


def test_every_expression_names_a_known_metric() -> None:
    dashboard = load()
    known = series_names({**exported_families(), **POOL_METRICS})
    used: set[str] = set()
    for title, expr in expressions(dashboard):
        names = metric_names(expr)
        if expr.startswith("label_values("):
            names = {n for n in names if n.startswith(("mcp_", "process_"))}  # the label too
        assert names, (title, expr)
        for name in names:
            assert name in known, f"{title}: {name} is not a metric's series ({expr})"
            used.add(family(name))
    assert used >= REQUIRED, REQUIRED - used


def test_panels_are_laid_out_and_none_is_a_placeholder() -> None:
    dashboard = load()
    assert dashboard["uid"] == "mcp-code-sandbox"
    taken: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        cells = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"])
                 for y in range(pos["y"], pos["y"] + pos["h"])}  # fmt: skip
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert "planned" not in panel["title"], panel["title"]
