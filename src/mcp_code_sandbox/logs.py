"""Logging: structlog for our lines, the stdlib's loggers (SDK, uvicorn) routed through it.

Everything goes to stderr or ``LOG_FILE``, never stdout: in stdio mode stdout carries the
MCP protocol, and one stray line would corrupt it.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

from mcp_code_sandbox.settings import Settings

__all__ = ["configure_logging"]


def configure_logging(settings: Settings) -> None:
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if settings.log_format == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )
    handler: logging.Handler
    if settings.log_file is not None:
        settings.log_file.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(settings.log_file, encoding="utf-8")
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level)
    # Never below INFO for these, even at DEBUG: their debug lines carry whole protocol
    # messages, i.e. the code, outputs and file contents that logs must not hold.
    for chatty in ("sse_starlette", "mcp", "httpx", "httpcore"):
        logging.getLogger(chatty).setLevel(max(logging.INFO, root.level))
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    structlog.configure(
        # A line below the level is dropped first, not after the processors have stamped
        # and dressed it (the stdlib logger would drop it at the end anyway): a run's
        # audit line at WARNING cost a tenth of a warm `1+1` for nothing.
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
