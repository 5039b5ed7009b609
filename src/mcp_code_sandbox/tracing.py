"""Traces: where a tool call's time went, and which replica served it (OpenTelemetry).

The MCP SDK opens a server span per request (``tools/call run_code``). Inside it the
server adds child spans: ``claim session`` (finding the session, taking it over from
another replica, waiting for its earlier calls), ``sandbox start``, ``agent round trip``
(the run as the host sees it) and, inside that, ``kernel run`` (the run as the agent
timed it, placed at the end of the round trip). Every span carries the serving replica
as the resource's ``service.instance.id``, and the server span ``mcs.replica`` too.

Spans cost nothing without an SDK: the API's default tracer makes no-op spans. With
``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) set, the
server installs the OpenTelemetry SDK with the OTLP/HTTP exporter (the ``otel`` extra:
``mcp-code-sandbox[otel]``), configured by the standard ``OTEL_*`` variables, which the
SDK reads itself. No session id, owner or code goes into a span: the same rule as
``/metrics``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from opentelemetry import trace

__all__ = ["REPLICA_ATTRIBUTE", "configure", "past_span", "shutdown", "span"]

REPLICA_ATTRIBUTE = "mcs.replica"

_tracer = trace.get_tracer("mcp_code_sandbox")
_provider: Any = None


def configure(instance: str) -> str | None:
    """Install the SDK and its OTLP exporter, with ``instance`` as this replica's name;
    a warning line when the SDK is not installed (``None``: done). Called once, when
    the environment asks for an exporter (``settings.otlp_configured``)."""
    global _provider
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        return (
            "OTEL_EXPORTER_OTLP_ENDPOINT is set but the OpenTelemetry SDK is not installed: "
            "install mcp-code-sandbox[otel] to export traces"
        )
    resource = Resource.create(
        {"service.name": "mcp-code-sandbox", "service.instance.id": instance}
    )
    _provider = TracerProvider(resource=resource)
    _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(_provider)
    return None


def shutdown() -> None:
    """Flush what is buffered (bounded by the exporter's own timeout)."""
    if _provider is not None:
        _provider.shutdown()


@contextlib.contextmanager
def span(name: str, **attributes: str | int | bool) -> Iterator[trace.Span]:
    """A child span of the current one for the ``with`` block."""
    with _tracer.start_as_current_span(name, attributes=attributes) as current:
        yield current


def past_span(name: str, start_ns: int, end_ns: int, **attributes: str | int | bool) -> None:
    """A child span of the current one, for something already over (its times given)."""
    _tracer.start_span(name, start_time=start_ns, attributes=attributes).end(end_time=end_ns)


def mark_replica(instance: str) -> None:
    """Say on the current span (the SDK's server span) which replica serves it."""
    trace.get_current_span().set_attribute(REPLICA_ATTRIBUTE, instance)
