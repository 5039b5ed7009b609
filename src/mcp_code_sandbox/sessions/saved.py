"""STUB until the state branch lands (interface only)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Variable:
    name: str
    type: str
    bytes: int | None = None
    why: str | None = None


@dataclass(frozen=True)
class SaveReport:
    kept: tuple[Variable, ...]
    modules: tuple[Variable, ...]
    dropped: tuple[Variable, ...]
    bytes: int


@dataclass(frozen=True)
class LoadReport:
    found: bool
    restored: tuple[str, ...]
    modules: tuple[str, ...]
    failed: tuple[Variable, ...]
