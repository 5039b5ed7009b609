"""What one proxied connection leaves behind: one audit line and one metrics count.

The line (logger ``mcp_code_sandbox.egress``, event ``egress``) carries the session, the
owner, the host and port, allowed or not and the rule that decided, bytes each way (as
they crossed the sandbox's socket: TLS bytes for HTTPS), whether TLS was intercepted and
the NAMES of the secrets added. Never a value, a header, a path or a body.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import structlog

from mcp_code_sandbox.metrics import Metrics

from .streams import Counter

__all__ = ["Audit"]

log = structlog.get_logger("mcp_code_sandbox.egress")


@dataclass
class Audit:
    """Filled in while a connection (or, for plain HTTP, one request) is served."""

    kind: str  # "connect" | "http"
    host: str = ""
    port: int = 0
    allowed: bool = False
    rule: str = ""
    up: Counter = field(default_factory=Counter)  # sandbox -> upstream
    down: Counter = field(default_factory=Counter)  # upstream -> sandbox
    secrets: set[str] = field(default_factory=set)
    intercepted: bool = False
    started: float = field(default_factory=time.monotonic)
    #: A refusal past the proxy's rate: counted, its line left to the proxy's summary.
    quiet: bool = False

    def emit(self, session: str, owner: str, metrics: Metrics | None) -> None:
        """Log the line and count the connection (by host; by the wildcard entry that
        allowed it, so a ``*`` allowlist does not make one series per host). A
        ``quiet`` one is only counted."""
        if not self.quiet:
            self._log(session, owner)
        if metrics is not None:
            entry = self.rule.partition(":")[2] if self.allowed else ""
            metrics.egress_connection(entry if entry.startswith("*") else self.host, self.allowed)

    def _log(self, session: str, owner: str) -> None:
        log.info(
            "egress",
            session=session,
            owner=owner,
            kind=self.kind,
            host=self.host,
            port=self.port,
            allowed=self.allowed,
            rule=self.rule,
            bytes_up=self.up.bytes,
            bytes_down=self.down.bytes,
            intercepted=self.intercepted,
            secrets=sorted(self.secrets),
            duration_ms=round((time.monotonic() - self.started) * 1000),
        )
