"""The agent's ``--config`` value and the resource limits it asks for.

Semantics: ``memory_bytes`` ``None`` means "the backend enforces memory with a cgroup",
so no RLIMIT_DATA is set; a number caps each user process's data segment (a
``MemoryError`` in Python rather than a kill). ``kill_strays`` may only be true where the
agent is alone in its pid namespace: it then ends every process but itself and pid 1.
"""

from __future__ import annotations

import json
import resource
from typing import Any, NamedTuple

__all__ = ["AgentConfig", "apply_limits"]


class AgentConfig(NamedTuple):
    """Immutable; a NamedTuple, not a dataclass: the agent parses it before it spawns its
    kernel, and importing ``dataclasses`` (with ``inspect``) there would delay every
    sandbox's start."""

    kill_strays: bool = False
    pids: int | None = None
    file_bytes: int | None = None
    memory_bytes: int | None = None
    #: Modules the first kernel imports before it says it is ready (a pooled sandbox's
    #: warm-up); never bound in the user's namespace.
    preload: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, text: str) -> AgentConfig:
        raw: Any = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("--config must be a JSON object")
        return cls(
            kill_strays=bool(raw.get("kill_strays", False)),
            pids=_opt_int(raw, "pids"),
            file_bytes=_opt_int(raw, "file_bytes"),
            memory_bytes=_opt_int(raw, "memory_bytes"),
            preload=_names(raw, "preload"),
        )

    def to_json(self) -> str:
        return json.dumps(
            {
                "kill_strays": self.kill_strays,
                "pids": self.pids,
                "file_bytes": self.file_bytes,
                "memory_bytes": self.memory_bytes,
                "preload": list(self.preload),
            },
            separators=(",", ":"),
        )


def _opt_int(raw: dict[str, Any], key: str) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config {key!r} must be a positive integer or null")
    return value


def _names(raw: dict[str, Any], key: str) -> tuple[str, ...]:
    value = raw.get(key) or []
    if not isinstance(value, list) or not all(
        isinstance(name, str) and all(part.isidentifier() for part in name.split("."))
        for name in value
    ):
        raise ValueError(f"config {key!r} must be a list of module names")
    return tuple(value)


def apply_limits(config: AgentConfig) -> None:
    """Set the rlimits of the calling process (the kernel, or a program before its exec).

    The supervisor itself stays unlimited, so it can always fork a fresh kernel even when
    user code has used up the process limit.
    """
    _set(resource.RLIMIT_CORE, 0)
    if config.pids is not None:
        _set(resource.RLIMIT_NPROC, config.pids)
    if config.file_bytes is not None:
        _set(resource.RLIMIT_FSIZE, config.file_bytes)
    if config.memory_bytes is not None:
        _set(resource.RLIMIT_DATA, config.memory_bytes)


def _set(which: int, value: int) -> None:
    _soft, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)  # an unprivileged process cannot raise its hard limit
    resource.setrlimit(which, (value, value))
