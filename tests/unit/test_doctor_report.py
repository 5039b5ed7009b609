"""doctor/report.py as a person reads it: FAIL only for what stops this server, notes for
what a normal install of its kind has, sizes as sizes, and what the image serves."""

from __future__ import annotations

import io
import os
from collections.abc import Callable

import pytest

from mcp_code_sandbox.doctor.checks import size_text
from mcp_code_sandbox.doctor.report import run_doctor
from mcp_code_sandbox.settings import Settings

from ..conftest import require_docker


def doctor(settings: Settings) -> tuple[int, str]:
    out = io.StringIO()
    return run_doctor(settings, out), out.getvalue()


@pytest.mark.bwrap
def test_a_single_user_install_not_run_as_root_has_no_fail(
    make_settings: Callable[..., Settings], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A user's own server (not root) with no Docker engine: sandboxes share its uid and
    # no engine answers. Both are normal there: notes, not failures.
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    code, text = doctor(make_settings(backend="auto"))
    assert code == 0, text
    assert "FAIL" not in text, text
    assert "  note per-sandbox uids: no (server not root)" in text
    assert "docker backend (not in use):\n  note docker engine: no engine answers" in text
    assert "backend in use (auto): bwrap, ready" in text


def test_sizes_are_said_as_sizes(make_settings: Callable[..., Settings]) -> None:
    assert size_text(10 * 1024**3) == "10 GiB"
    assert size_text(512 * 1024**2) == "512 MiB"
    assert size_text(1536) == "1.5 KiB"
    assert size_text(100) == "100 bytes"


@pytest.mark.parametrize("backend", ["docker"], indirect=True)
def test_doctor_lists_every_language_the_image_serves(
    make_settings: Callable[..., Settings],
) -> None:
    require_docker()
    settings = make_settings()
    code, text = doctor(settings)
    assert code == 0, text
    line = next(x for x in text.splitlines() if x.startswith("  ok   docker image:"))
    for language in ("python 3.", "javascript ", "typescript ", "bash "):
        assert language in line, line
    assert "paused state is kept within 10 GiB" in text
