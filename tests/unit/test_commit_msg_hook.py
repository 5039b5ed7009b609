"""scripts/hooks/commit-msg: the commit messages it lets through and those it refuses.

The hook is run as git runs it, on a message file; `scripts/install.sh --dev` installs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HOOK = Path(__file__).resolve().parents[2] / "scripts" / "hooks" / "commit-msg"
WHY = "The body says why: what was wrong, and what a reader must know.\n"


def run_hook(tmp_path: Path, message: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "COMMIT_EDITMSG"
    path.write_text(message, encoding="utf-8")
    return subprocess.run(
        [sys.executable, str(HOOK), str(path)], capture_output=True, text=True, timeout=30
    )


@pytest.mark.parametrize(
    "message",
    [
        f"Pause idle sessions after ten minutes\n\n{WHY}",
        f"{'x' * 72}\n\n{WHY}",
        f"Subject\n\n{WHY}\n# Please enter the commit message for your changes.\n",
        f"Subject\n\n{WHY}# ------------------------ >8 ------------------------\ndiff\n",
        "Merge branch 'habits'\n",
        'Revert "Pause idle sessions after ten minutes"\n',
        f"fixup! {'x' * 72}\n",
        "squash! Subject\n",
    ],
)
def test_a_well_formed_message_passes(tmp_path: Path, message: str) -> None:
    result = run_hook(tmp_path, message)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("message", "says"),
    [
        (f"{'x' * 73}\n\n{WHY}", "the subject has 73 characters; at most 72"),
        (f"Subject\n{WHY}", "must be followed by a blank line"),
        ("Subject\n", "no body"),
        ("Subject\n\n# only a comment\n", "no body"),
        (f"Subject\n\n# ------------------------ >8 ------------------------\n{WHY}", "no body"),
    ],
)
def test_a_malformed_message_is_refused_with_the_reason(
    tmp_path: Path, message: str, says: str
) -> None:
    result = run_hook(tmp_path, message)
    assert result.returncode == 1
    assert says in result.stderr


def test_install_dev_points_git_at_the_hooks() -> None:
    install = (HOOK.parents[1] / "install.sh").read_text(encoding="utf-8")
    assert "config core.hooksPath scripts/hooks" in install
