"""Fixtures of more than one unit test file."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Tracer

from mcp_code_sandbox import tracing


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Tracer, InMemorySpanExporter]]:
    """The server's spans (``tracing``) recorded in memory, through a provider of the
    test's own (the process's global one is never set here), and a tracer of that
    provider for the test's own parent spans."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("mcp_code_sandbox"))
    yield provider.get_tracer("test"), exporter
    provider.shutdown()
