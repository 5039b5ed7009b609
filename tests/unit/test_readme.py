"""README.md says only what is true of this checkout: its Quick start works as written
(the package is not on PyPI yet), and the scripts it names exist."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def quick_start() -> str:
    return README.split("## Quick start", 1)[1].split("\n## ", 1)[0]


def test_quick_start_says_the_package_is_not_published_and_what_works_until_then() -> None:
    section = quick_start()
    text = " ".join(section.split())
    assert "not published on PyPI yet" in text
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    # The first thing a reader runs works today: the clone's script, not `uvx`.
    first = blocks[0]
    assert "uvx mcp-code-sandbox" not in first
    assert "git clone" in first and "scripts/serve.sh" in first
    # The published line comes last, after the words that say it is not there yet.
    assert text.index("not published on PyPI yet") < text.index("uvx mcp-code-sandbox # needs")


def test_the_scripts_the_readme_names_exist_and_run() -> None:
    for name in set(re.findall(r"scripts/([a-z_-]+\.sh)", README)):
        script = ROOT / "scripts" / name
        assert script.is_file(), name
        assert os.access(script, os.X_OK), name


def test_the_wheel_command_builds_what_the_uvx_line_runs() -> None:
    # `pip wheel ... -w dist .` names the file `mcp_code_sandbox-<version>-py3-none-any.whl`:
    # the project's name with '_', which the Quick start's glob expects.
    text = quick_start()
    assert "python3 -m pip wheel --no-deps -w dist ." in text
    assert "dist/mcp_code_sandbox-*.whl" in text
    assert 'name = "mcp-code-sandbox"' in (ROOT / "pyproject.toml").read_text()
