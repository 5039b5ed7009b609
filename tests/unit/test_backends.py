"""backends/__init__.py: which backend ``auto`` picks, and the reason the start line gives."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcp_code_sandbox.backends import choose_backend
from mcp_code_sandbox.settings import load_settings


def test_auto_without_an_engine_is_bwrap_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no.sock")
    settings = load_settings({"state_dir": str(tmp_path)}, environ={})
    backend, why = choose_backend(settings)
    assert backend.name == "bwrap"
    assert (
        why
        == f"bwrap, because SANDBOX_BACKEND=auto and no Docker engine answers at unix://{tmp_path}/no.sock"
    )


def test_a_chosen_backend_says_it_was_chosen(tmp_path: Path) -> None:
    settings = load_settings({"state_dir": str(tmp_path), "backend": "bwrap"}, environ={})
    assert choose_backend(settings)[1] == "bwrap, because SANDBOX_BACKEND=bwrap"
