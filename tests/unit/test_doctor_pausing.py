"""``doctor``'s pausing line: when idle sessions pause, and what the session limits count."""

from __future__ import annotations

from pathlib import Path

from mcp_code_sandbox.doctor.checks import pausing_check
from mcp_code_sandbox.settings import load_settings


def test_says_running_sessions_are_limited_and_paused_ones_kept(tmp_path: Path) -> None:
    check = pausing_check(load_settings({"state_dir": str(tmp_path)}, environ={}))
    assert check.ok
    assert "paused after 10 min" in check.detail
    assert "10 run at once (the longest idle is paused to make room)" in check.detail
    assert "1000 paused at most" in check.detail


def test_with_pausing_off_every_session_counts(tmp_path: Path) -> None:
    settings = load_settings({"state_dir": str(tmp_path), "pause_after_m": 0}, environ={})
    check = pausing_check(settings)
    assert "not paused" in check.detail
    assert "every session counts toward SANDBOX_MAX_SESSIONS (10)" in check.detail
