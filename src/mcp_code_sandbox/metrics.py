"""Prometheus metrics of one server: sessions, runs, durations, failures by code.

One :class:`Metrics` per :class:`~mcp_code_sandbox.service.SandboxService`, with its own
``CollectorRegistry`` (never the process-global one: tests build many services in one
process, and two servers in one process must not add up). The session manager, the run
and the MCP layer call its small methods; ``/metrics`` (``server.ops``) renders it.

Labels are bounded on purpose: ``language`` is one the server offers (built-in or a runner
image's), ``status`` one of ``STATUSES``, ``code`` one of ``errors.ERROR_CODES``, ``reason``
one of ``END_REASONS``. Never a session id, an owner or anything a client chose freely.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Literal

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.exposition import choose_encoder

from mcp_code_sandbox import __version__
from mcp_code_sandbox.errors import ERROR_CODES, BackendUnavailable, SandboxFailed

__all__ = ["END_REASONS", "STATUSES", "EndReason", "Metrics"]

#: Why a session ended: ``close_session``, the idle TTL, the max lifetime, or (paused)
#: the paused-state disk budget or the paused-session limit. A shutdown is not counted:
#: the process (and its counters) ends with it.
EndReason = Literal["closed", "idle", "lifetime", "disk", "limit"]
END_REASONS: tuple[EndReason, ...] = ("closed", "idle", "lifetime", "disk", "limit")
#: How a session was paused (and resumed): its whole memory, its variables, its files.
PAUSE_KINDS = ("memory", "variables", "files")
SESSION_STATES = ("running", "paused")
#: Why a pause kept less than the backend offers (``pause_fallbacks``).
FALLBACK_REASONS = ("checkpoint_failed", "save_failed", "no_interpreter", "network", "restored")
STATUSES = ("ok", "error", "timeout", "cancelled")
BACKEND_CODES = (BackendUnavailable.code, SandboxFailed.code)
#: Whether a new session found a warm sandbox in the pool.
POOL_RESULTS = ("hit", "miss")
POOL_STATES = ("ready", "starting")
#: How the warm pool's target moved (``sessions.demand``), and where it stands.
POOL_DECISIONS = ("grow", "shrink")
POOL_TRENDS = ("resting", "grown", "shrinking")
#: From a pool claim (well under a millisecond) to a slow gVisor start.
START_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
#: Distinct ``host`` label values of the egress counters, per outcome; later hosts count
#: as ``other`` (a sandbox choosing blocked names freely must not grow the registry).
MAX_EGRESS_HOSTS = 200
#: From the quickest cell to the largest default ``MAX_EXEC_TIMEOUT_S``.
DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    def __init__(self, backend: str) -> None:
        # The ``*_created`` gauges double every counter's series in the text format and
        # no dashboard reads them (a process-wide switch, and this is the process's app).
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry()
        self._handovers: Counter | None = None  # a replica's (see ``replica``)
        r = self.registry
        ProcessCollector(registry=r)  # process_resident_memory_bytes, open fds, CPU seconds
        Gauge(
            "mcp_sandbox_build_info", "This server: version and backend", ["version", "backend"],
            registry=r,
        ).labels(__version__, backend).set(1)  # fmt: skip
        self._active = Gauge(
            "mcp_sandbox_sessions_active", "Sessions open now (each holds a workspace)", registry=r
        )
        self._created = Counter(
            "mcp_sandbox_sessions_created", "Sessions created (re-attached ones not)", registry=r
        )
        self._ended = Counter(
            "mcp_sandbox_sessions_ended",
            "Sessions ended, by reason: closed (close_session), idle (TTL), lifetime (max "
            "age), disk (paused state past SANDBOX_PAUSED_DISK_BYTES)",
            ["reason"],
            registry=r,
        )
        self._runs = Counter(
            "mcp_sandbox_runs",
            "run_code calls that ran and returned a result, by language and status",
            ["language", "status"],
            registry=r,
        )
        self._duration = Histogram(
            "mcp_sandbox_run_duration_seconds",
            "Wall time of a run, from taking the session to the result (sandbox start included)",
            ["language"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self._tool_errors = Counter(
            "mcp_sandbox_tool_errors",
            "Tool calls that failed (isError results), by error code",
            ["code"],
            registry=r,
        )
        self._backend_errors = Counter(
            "mcp_sandbox_backend_errors",
            "Failures of the sandbox backend (engine unreachable, a sandbox that would not "
            "start or died mid-run), by error code",
            ["code"],
            registry=r,
        )
        self._pool_claims = Counter(
            "mcp_sandbox_pool_claims",
            "New sessions that could use the warm pool, by result: hit (took a warm "
            "sandbox) or miss (the pool was empty; a sandbox was started for it)",
            ["result"],
            registry=r,
        )
        self._pool_claim_s = Histogram(
            "mcp_sandbox_pool_claim_seconds",
            "Time to take a warm sandbox from the pool (checks included)",
            buckets=START_BUCKETS,
            registry=r,
        )
        self._cold_start_s = Histogram(
            "mcp_sandbox_cold_start_seconds",
            "Time to start a session's sandbox when none was warm (agent ready)",
            buckets=START_BUCKETS,
            registry=r,
        )
        self._pool_refill_s = Histogram(
            "mcp_sandbox_pool_refill_seconds",
            "Time to start one pooled sandbox (workspace, sandbox, preload)",
            buckets=START_BUCKETS,
            registry=r,
        )
        self._pool_sandboxes = Gauge(
            "mcp_sandbox_pool_sandboxes",
            "Pooled sandboxes, by state: ready (warm, unclaimed) or starting",
            ["state"],
            registry=r,
        )
        self._pool_target = Gauge(
            "mcp_sandbox_pool_target",
            "Warm sandboxes the pool aims to hold now: SANDBOX_POOL_SIZE at rest, more "
            "after a burst of new sessions outran it, up to the ceiling",
            registry=r,
        )
        self._pool_bounds = Gauge(
            "mcp_sandbox_pool_bounds",
            "The warm pool target's bounds: floor (SANDBOX_POOL_SIZE) and ceiling (the "
            "least of the session limit, available memory / sandbox memory limit, spare uids)",
            ["bound"],
            registry=r,
        )
        self._pool_trend = Gauge(
            "mcp_sandbox_pool_trend",
            "The warm pool's trend: 1 for the current one of resting, grown, shrinking",
            ["trend"],
            registry=r,
        )
        self._pool_decisions = Counter(
            "mcp_sandbox_pool_decisions",
            "Changes of the warm pool's target: grow (a burst ran it out) or shrink (idle)",
            ["decision"],
            registry=r,
        )
        self._egress = Counter(
            "mcp_sandbox_egress_connections",
            "Connections through the sandboxes' egress proxies, by outcome (allowed or "
            "blocked) and host (an allowlist wildcard such as *.example.com for the hosts it "
            f"matched; 'other' past {MAX_EGRESS_HOSTS} distinct hosts)",
            ["outcome", "host"],
            registry=r,
        )
        self._egress_hosts: dict[str, set[str]] = {"allowed": set(), "blocked": set()}
        self._egress_refused = Counter(
            "mcp_sandbox_egress_refusals",
            "Egress proxy refusals beyond the per-host counts, by reason: connections past "
            "a sandbox's limit, its owner's share or the server's reserve ('sandbox_limit', "
            "'owner_share', 'server_reserve'), and refusals delayed past the per-sandbox rate "
            "whose log lines were summarised ('throttled')",
            ["reason"],
            registry=r,
        )
        self._states = Gauge(
            "mcp_sandbox_sessions", "Sessions by state: running or paused", ["state"], registry=r
        )
        self._pause_s = Histogram(
            "mcp_sandbox_pause_seconds",
            "Time to pause a session, by kind: memory, variables or files",
            ["kind"],
            buckets=START_BUCKETS,
            registry=r,
        )
        self._resume_s = Histogram(
            "mcp_sandbox_resume_seconds",
            "Time to resume a paused session (sandbox back, state loaded), by kind",
            ["kind"],
            buckets=START_BUCKETS,
            registry=r,
        )
        self._paused_bytes = Gauge(
            "mcp_sandbox_paused_bytes",
            "Bytes of paused sessions' state on disk (checkpoints, saved variables, files)",
            registry=r,
        )
        self._fallbacks = Counter(
            "mcp_sandbox_pause_fallbacks",
            "Pauses that kept less than the backend offers, by what they kept and why",
            ["kind", "reason"],
            registry=r,
        )
        # Every series of a known label set exists from the start, at 0: a rate() over a
        # series that appears only with its first failure misses that failure.
        for reason in END_REASONS:
            self._ended.labels(reason)
        for result in POOL_RESULTS:
            self._pool_claims.labels(result)
        for decision in POOL_DECISIONS:
            self._pool_decisions.labels(decision)
        for kind in PAUSE_KINDS:
            self._pause_s.labels(kind)
            self._resume_s.labels(kind)
        for code in ERROR_CODES:
            self._tool_errors.labels(code)
        for code in BACKEND_CODES:
            self._backend_errors.labels(code)

    def replica(self, name: str) -> None:
        """This server is one of its state directory's replicas, named ``name`` (the
        ``replica`` of ``/readyz``, ``/ui`` and traces)."""
        Gauge(
            "mcp_sandbox_replica_info",
            "This server is a replica (SANDBOX_REPLICA) of this name",
            ["replica"],
            registry=self.registry,
        ).labels(name).set(1)
        self._handovers = Counter(
            "mcp_sandbox_handovers",
            "Sessions handed between replicas: in (taken from another replica, or from "
            "one that died), out (let go to another replica)",
            ["direction"],
            registry=self.registry,
        )

    def handed_over(self, direction: Literal["in", "out"]) -> None:
        if self._handovers is not None:
            self._handovers.labels(direction).inc()

    def track_sessions(self, count: Callable[[], int]) -> None:
        """Read the open sessions from ``count`` at every scrape (never drifts)."""
        self._active.set_function(count)

    def track_states(self, count: Callable[[str], int], paused_bytes: Callable[[], int]) -> None:
        """Read sessions by state, and the paused bytes, at every scrape."""
        for state in SESSION_STATES:
            self._states.labels(state).set_function(functools.partial(count, state))
        self._paused_bytes.set_function(paused_bytes)

    def paused(self, kind: str, seconds: float, fallback: str | None) -> None:
        """One pause: what it kept (``kind``), how long it took, and why it kept less
        than the backend offers (``fallback``, one of :data:`FALLBACK_REASONS`)."""
        self._pause_s.labels(kind).observe(seconds)
        if fallback is not None:
            self._fallbacks.labels(kind, fallback).inc()

    def resumed(self, kind: str, seconds: float) -> None:
        self._resume_s.labels(kind).observe(seconds)

    def session_created(self) -> None:
        self._created.inc()

    def session_ended(self, reason: EndReason) -> None:
        self._ended.labels(reason).inc()

    def run_finished(self, language: str, status: str, duration_s: float) -> None:
        """One run that produced a result. ``language`` is one the server offered."""
        status = status if status in STATUSES else "error"
        self._runs.labels(language, status).inc()
        self._duration.labels(language).observe(duration_s)

    def tool_error(self, code: str) -> None:
        self._tool_errors.labels(code if code in ERROR_CODES else "internal_error").inc()

    def backend_error(self, code: str) -> None:
        self._backend_errors.labels(code if code in BACKEND_CODES else SandboxFailed.code).inc()

    def egress_connection(self, host: str, allowed: bool) -> None:
        """One connection through an egress proxy (``egress.proxy``). ``host``: the host,
        or the wildcard entry that allowed it; bounded to :data:`MAX_EGRESS_HOSTS`."""
        outcome = "allowed" if allowed else "blocked"
        seen = self._egress_hosts[outcome]
        if host not in seen:
            if len(seen) >= MAX_EGRESS_HOSTS:
                host = "other"
            else:
                seen.add(host)
        self._egress.labels(outcome, host[:253]).inc()

    def egress_refused(self, reason: str) -> None:
        """One refusal of an egress proxy by a limit or its rate (``egress.limits``)."""
        self._egress_refused.labels(reason).inc()

    @contextlib.contextmanager
    def counting_backend_errors(self) -> Iterator[None]:
        """Count a ``BackendUnavailable`` / ``SandboxFailed`` raised inside, and re-raise."""
        try:
            yield
        except (BackendUnavailable, SandboxFailed) as exc:
            self.backend_error(exc.code)
            raise

    def track_pool(self, count: Callable[[str], int]) -> None:
        """Read the pooled sandboxes in each state from ``count`` at every scrape."""
        for state in POOL_STATES:
            self._pool_sandboxes.labels(state).set_function(functools.partial(count, state))

    def track_pool_demand(
        self, target: Callable[[], int], floor: int, ceiling: int, trend: Callable[[], str]
    ) -> None:
        """Read the pool's target and trend at every scrape; its bounds are fixed."""
        self._pool_target.set_function(target)
        self._pool_bounds.labels("floor").set(floor)
        self._pool_bounds.labels("ceiling").set(ceiling)

        def current(name: str) -> float:
            return float(trend() == name)

        for name in POOL_TRENDS:
            self._pool_trend.labels(name).set_function(functools.partial(current, name))

    def pool_decided(self, decision: Literal["grow", "shrink"]) -> None:
        self._pool_decisions.labels(decision).inc()

    def pool_claimed(self, hit: bool, seconds: float) -> None:
        self._pool_claims.labels("hit" if hit else "miss").inc()
        if hit:
            self._pool_claim_s.observe(seconds)

    def cold_started(self, seconds: float) -> None:
        self._cold_start_s.observe(seconds)

    def pool_refilled(self, seconds: float) -> None:
        self._pool_refill_s.observe(seconds)

    def render(self, accept: str | None) -> tuple[bytes, str]:
        """The exposition for a scrape with this ``Accept`` header: (body, content type).
        Prometheus's text format, or OpenMetrics when the scraper asks for it."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type
