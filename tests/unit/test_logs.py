"""Log lines below the level are dropped, lines at it are written, with their fields.

In a child process: ``configure_logging`` sets up the process's logging once, globally.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_SCRIPT = """
import sys
import structlog
from mcp_code_sandbox.logs import configure_logging
from mcp_code_sandbox.settings import load_settings
level, path = sys.argv[1], sys.argv[2]
configure_logging(load_settings({"log_level": level, "log_file": path}, environ={}))
log = structlog.get_logger("mcp_code_sandbox.audit")
log.debug("a debug line", n=0)
log.info("an info line", n=1)
log.warning("a warning line", n=2)
"""


def _lines(tmp_path: Path, level: str) -> str:
    path = tmp_path / f"{level}.log"
    subprocess.run([sys.executable, "-c", _SCRIPT, level, str(path)], check=True, timeout=60)
    return path.read_text()


@pytest.mark.parametrize(
    ("level", "shown", "hidden"),
    [
        ("DEBUG", ["a debug line", "an info line", "a warning line"], []),
        ("INFO", ["an info line", "a warning line"], ["a debug line"]),
        ("WARNING", ["a warning line"], ["a debug line", "an info line"]),
    ],
)
def test_level_filters_before_rendering(
    tmp_path: Path, level: str, shown: list[str], hidden: list[str]
) -> None:
    text = _lines(tmp_path, level)
    for line in shown:
        assert line in text
    for line in hidden:
        assert line not in text
    assert "n=2" in text and "mcp_code_sandbox.audit" in text
