"""The repository stands alone: nothing in it reads a file outside the checkout, so the
README's test command passes in a bare clone (DESIGN's rule, kept here in code)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: ``Path(__file__)...parents[N]``: how code here finds the checkout's files.
_PARENTS = re.compile(r"Path\(__file__\)(?:\.resolve\(\))?\.parents\[(\d+)\]")
#: The team's shared notes beside the checkout, by name (tests here also hold hostile
#: paths such as ``../etc/passwd``: inputs, not reads).
_OUTSIDE = re.compile(r"\.\./shared\b|[\"']shared[\"']\s*/")


def _sources() -> list[Path]:
    """The project's own files: installed packages (``node_modules``, a venv) are not."""
    found = []
    for top in ("src", "tests", "bench", "scripts", ".ci"):
        found += [
            p
            for p in (ROOT / top).rglob("*")
            if p.is_file() and p.suffix != ".pyc" and "node_modules" not in p.parts
        ]
    return found


def test_no_file_reaches_above_the_checkout() -> None:
    outside = []
    for path in _sources():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        depth = len(path.relative_to(ROOT).parts) - 1  # parents[depth] is the checkout
        for match in _PARENTS.finditer(text):
            if int(match.group(1)) > depth:
                outside.append(f"{path.relative_to(ROOT)}: {match.group(0)}")
        for match in _OUTSIDE.finditer(text):
            outside.append(f"{path.relative_to(ROOT)}: {match.group(0)}")
    assert outside == []
