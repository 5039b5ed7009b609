"""The ``kernel run`` span the host adds from the agent's ``done`` (``agent_client``): its
``run_s`` comes from the sandbox, so it is hostile. A number gives a span ending now and
never starting before the round trip that holds it; anything else gives none."""

from __future__ import annotations

import time

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Tracer

from mcp_code_sandbox.sessions.agent_client import _trace_kernel_run


def kernel_run(
    spans: tuple[Tracer, InMemorySpanExporter], run_s: object, *, round_trip_s: float = 10.0
) -> tuple[int, int, int]:
    """``(round trip's start, kernel run's start, its end)`` for a round trip that began
    ``round_trip_s`` ago; fails when no span was made."""
    tracer, exporter = spans
    began = time.time_ns() - int(round_trip_s * 1e9)
    with tracer.start_as_current_span("agent round trip", start_time=began) as parent:
        _trace_kernel_run(run_s)
    [kernel] = [s for s in exporter.get_finished_spans() if s.name == "kernel run"]
    assert kernel.parent is not None
    assert kernel.parent.span_id == parent.get_span_context().span_id
    assert kernel.start_time is not None and kernel.end_time is not None
    return began, kernel.start_time, kernel.end_time


@pytest.mark.parametrize("run_s", [0, 0.0, 2.5, 7])
def test_a_kernel_run_ends_now_and_lasts_what_the_agent_said(
    spans: tuple[Tracer, InMemorySpanExporter], run_s: float
) -> None:
    before = time.time_ns()
    _, start, end = kernel_run(spans, run_s)
    assert before <= end <= time.time_ns()
    assert end - start == int(run_s * 1e9)


@pytest.mark.parametrize("run_s", [11.0, 3600, 1e30, 1.7e308])
def test_a_run_longer_than_its_round_trip_starts_with_the_round_trip(
    spans: tuple[Tracer, InMemorySpanExporter], run_s: float
) -> None:
    round_trip, start, end = kernel_run(spans, run_s)
    assert start == round_trip and end > start


@pytest.mark.parametrize(
    "run_s", [float("nan"), float("inf"), float("-inf"), -1.0, "2.5", None, [1], {"s": 1}]
)
def test_a_hostile_run_time_makes_no_span(
    spans: tuple[Tracer, InMemorySpanExporter], run_s: object
) -> None:
    tracer, exporter = spans
    with tracer.start_as_current_span("agent round trip"):
        _trace_kernel_run(run_s)
    assert [s.name for s in exporter.get_finished_spans()] == ["agent round trip"]
