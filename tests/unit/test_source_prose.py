"""src/'s comments and docstrings carry no measured timings ("~20 ms of every start"):
nothing re-measures them, so they go stale unseen. The figures live in bench/README.md;
a comment says why without the number. A constant's own value may be named beside it."""

from __future__ import annotations

import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "mcp_code_sandbox"
NUMBER = r"(?<![\w.])~?\d[\d.,]*(?:\s*[-–]\s*\d[\d.,]*)?"
#: Milliseconds and below are measurements here (no setting is in them), as are
#: approximate seconds ("~0.1 s") and before → after pairs.
TIMING = re.compile(
    rf"{NUMBER}\s*(?:ms|µs|ns)\b|~\s*\d[\d.,]*\s*s\b|{NUMBER}\s*s\s*(?:→|->)"
    rf"|{NUMBER}\s*×\s*(?:faster|slower)|{NUMBER}x\s+(?:faster|slower)"
)
#: Values of constants, named where the constant is described: (module, figure).
VALUES = {
    ("agent/outstream.py", "50 ms"),  # FLUSH_S
    ("agent/protocol.py", "50 ms"),  # the agent's output batching, FLUSH_S
    ("backends/docker/spec.py", "100 ms"),  # Docker's CFS period, beside GVISOR_CPU_PERIOD_US
}


def prose(path: Path) -> Iterator[tuple[int, str]]:
    """Each line of the comments and docstrings of ``path``, with its number."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
    for token in tokens:
        docstring = token.type == tokenize.STRING and token.string.lstrip("rbuRBU")[:3] in (
            '"""',
            "'''",
        )
        if token.type == tokenize.COMMENT or docstring:
            for offset, line in enumerate(token.string.splitlines()):
                yield token.start[0] + offset, line


def timings(path: Path) -> list[str]:
    module = path.relative_to(PACKAGE).as_posix()
    return [
        f"{module}:{number}: {match.group(0)}"
        for number, line in prose(path)
        for match in TIMING.finditer(line)
        if (module, match.group(0)) not in VALUES
    ]


def test_no_measured_timing_in_src_prose() -> None:
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) for hit in timings(path)]
    assert found == [], f"move these figures to bench/README.md: {found}"


def test_a_timing_is_found_and_a_value_or_a_size_is_not(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        '"""Starts in ~20 ms; a mount takes 20-30 ms; 0.50 s -> 0.33 s."""\n'
        "# importing it costs 1.5 ms\n"
        "LIMIT_S = 2.0  # at most 2 s, 64 KiB, 4096×4096 pixels\n"
        'TEXT = "5 ms"  # a string, not prose\n'
    )
    found = [m.group(0) for _, line in prose(sample) for m in TIMING.finditer(line)]
    assert found == ["~20 ms", "20-30 ms", "0.50 s ->", "1.5 ms"]


def test_the_allowed_values_are_still_there() -> None:
    for module, figure in VALUES:
        assert any(figure in line for _, line in prose(PACKAGE / module)), (module, figure)
