"""Spans the server adds inside a request's (``tracing``): each under the current span,
past ones with the times given. Recorded by the OpenTelemetry SDK's in-memory exporter
through a tracer of a provider of this test's own: the process's global provider (which
``tracing.configure`` sets, once per process) is never touched."""

from __future__ import annotations

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Tracer

from mcp_code_sandbox import tracing


def by_name(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    return {s.name: s for s in exporter.get_finished_spans()}


def test_a_span_nests_under_the_current_one(
    spans: tuple[Tracer, InMemorySpanExporter],
) -> None:
    tracer, exporter = spans
    with tracer.start_as_current_span("tools/call run_code"):
        with tracing.span("claim session", handover=True), tracing.span("handover"):
            pass
        with tracing.span("agent round trip"):
            pass
    found = by_name(exporter)
    request = found["tools/call run_code"].context
    claim = found["claim session"]
    assert request is not None and claim.parent is not None
    assert claim.parent.span_id == request.span_id
    assert claim.context is not None and found["handover"].parent is not None
    assert found["handover"].parent.span_id == claim.context.span_id
    assert found["agent round trip"].parent is not None
    assert found["agent round trip"].parent.span_id == request.span_id
    assert dict(claim.attributes or {}) == {"handover": True}
    assert {s.context.trace_id for s in found.values() if s.context} == {request.trace_id}


def test_a_past_span_has_the_times_given_under_the_current_one(
    spans: tuple[Tracer, InMemorySpanExporter],
) -> None:
    tracer, exporter = spans
    with tracer.start_as_current_span("agent round trip") as parent:
        tracing.past_span("kernel run", 1_000_000_000, 3_500_000_000, language="python")
    kernel = by_name(exporter)["kernel run"]
    assert (kernel.start_time, kernel.end_time) == (1_000_000_000, 3_500_000_000)
    assert kernel.parent is not None
    assert kernel.parent.span_id == parent.get_span_context().span_id
    assert dict(kernel.attributes or {}) == {"language": "python"}


def test_the_serving_replica_is_marked_on_the_current_span(
    spans: tuple[Tracer, InMemorySpanExporter],
) -> None:
    tracer, exporter = spans
    with tracer.start_as_current_span("tools/call run_code"):
        tracing.mark_replica("1234-abcd")
    [request] = exporter.get_finished_spans()
    assert dict(request.attributes or {}) == {tracing.REPLICA_ATTRIBUTE: "1234-abcd"}


def test_without_an_sdk_spans_cost_nothing_and_fail_nothing() -> None:
    """The module's own tracer, whatever provider the process has (none in these tests:
    the API's no-op spans)."""
    with tracing.span("claim session"):
        tracing.past_span("kernel run", 1, 2)
        tracing.mark_replica("1234-abcd")
