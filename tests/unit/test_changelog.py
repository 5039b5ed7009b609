"""CHANGELOG.md keeps Keep a Changelog's shape: under each version, one section per kind of
change, each kind at most once, and in them one bullet per change a user sees, with no
measured figures (those go to bench/README.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

CHANGELOG = Path(__file__).resolve().parents[2] / "CHANGELOG.md"
KINDS = ("Added", "Changed", "Deprecated", "Removed", "Fixed", "Security")
VERSION = re.compile(r"## \[(Unreleased|\d+\.\d+\.\d+)\]( - \d{4}-\d{2}-\d{2})?")
#: A timing or a speed-up: "20 ms", "3× faster", "(1.2 s)", "1.2 s → 0.3 s", "40% faster".
#: A size such as 4096×4096 pixels is not one.
NUMBER = r"(?<![\w.])~?\d[\d.,]*"
FIGURE = re.compile(
    rf"{NUMBER}\s*(?:ms|µs)\b|{NUMBER}\s*×(?!\s*\d)|{NUMBER}\s*s\)|{NUMBER}\s*s\s*(?:→|->)"
    rf"|{NUMBER}\s*%\s*(?:faster|slower)|{NUMBER}x\s+(?:faster|slower)"
)


def problems(text: str) -> list[str]:
    found = []
    version = None
    kinds: list[str] = []
    bullets = 0
    for number, line in enumerate(text.splitlines(), 1):
        where = f"line {number}"
        if line.startswith("## "):
            if not VERSION.fullmatch(line):
                found.append(f"{where}: a version is `## [Unreleased]` or `## [1.2.3] - date`")
            version, kinds = line, []
        elif line.startswith("### "):
            kind = line[4:]
            if version is None:
                found.append(f"{where}: {kind} before any version")
            if kind not in KINDS:
                found.append(f"{where}: {kind!r} is not one of {', '.join(KINDS)}")
            elif kind in kinds:
                found.append(f"{where}: a second {kind} section in {version}")
            if kinds and bullets == 0:
                found.append(f"{where}: the {kinds[-1]} section above is empty")
            kinds.append(kind)
            bullets = 0
        elif kinds and line and not line.startswith(("- ", "  ")):
            found.append(f"{where}: a change is a bullet (`- `), continued indented by two")
        elif line.startswith("- "):
            bullets += 1
        if kinds and (figure := FIGURE.search(line)):
            found.append(f"{where}: {figure.group(0)!r} is a measured figure: bench/README.md")
    return found


def test_the_changelog_keeps_its_shape() -> None:
    assert problems(CHANGELOG.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("## [Unreleased]\n### Improved\n- x\n", "'Improved' is not one of"),
        ("## [Unreleased]\n### Fixed\n- x\n### Fixed\n- y\n", "a second Fixed section"),
        ("## [Unreleased]\n### Fixed\n### Added\n- y\n", "Fixed section above is empty"),
        ("## [Unreleased]\n### Fixed\nx\n", "a change is a bullet"),
        ("## Unreleased\n", "a version is"),
        ("## [Unreleased]\n### Changed\n- Starts in 20 ms\n", "'20 ms' is a measured"),
        ("## [Unreleased]\n### Changed\n- 3× faster\n", "'3×' is a measured"),
        ("## [Unreleased]\n### Changed\n- faster (1.2 s)\n", "'1.2 s)' is a measured"),
    ],
)
def test_a_changelog_out_of_shape_is_named(text: str, says: str) -> None:
    assert any(says in problem for problem in problems(text)), problems(text)


def test_a_size_is_not_a_timing() -> None:
    assert problems("## [Unreleased]\n### Security\n- images up to 4096×4096 pixels\n") == []
