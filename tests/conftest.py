"""Shared fixtures.

Tests that need the real sandbox are marked ``bwrap``; they FAIL (never skip) when
bubblewrap or the runtime environment is missing: run ``mcp-code-sandbox setup`` (the
README's test command does). Each test gets its own state directory, so workspaces never
leak between tests; all of them share the one runtime environment ``setup`` built.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mcp_code_sandbox.settings import Settings, load_settings

REPO = Path(__file__).resolve().parents[1]


def shared_runtime_dir() -> Path:
    configured = os.environ.get("SANDBOX_RUNTIME_DIR")
    if configured:
        return Path(configured)
    return load_settings(environ={}).runtime_dir


def require_runtime() -> Path:
    runtime = shared_runtime_dir()
    if not (runtime / "venv" / "bin" / "python").exists():
        pytest.fail(
            f"the sandbox runtime environment is missing at {runtime}: run "
            "`.venv/bin/mcp-code-sandbox setup` (scripts/test.sh does)",
            pytrace=False,
        )
    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap is not installed: apt-get install bubblewrap", pytrace=False)
    return runtime


@pytest.fixture
def state_dir() -> Iterator[Path]:
    # Not pytest's tmp_path: as root the sandbox runs as an unprivileged uid that must be
    # able to traverse to its workspace, and pytest's base temp dir is 0700.
    path = Path(tempfile.mkdtemp(prefix="mcs-test-", dir="/var/tmp"))
    path.chmod(0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def make_settings(state_dir: Path) -> Callable[..., Settings]:
    runtime = require_runtime()

    def make(**overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "state_dir": str(state_dir),
            "runtime_dir": str(runtime),
            "backend": "bwrap",
        }
        values.update(overrides)
        return load_settings(values, environ={})

    return make


@pytest.fixture
async def service(make_settings: Callable[..., Settings]) -> AsyncIterator[Any]:
    from mcp_code_sandbox.backends import create_backend
    from mcp_code_sandbox.service import SandboxService

    settings = make_settings(exec_timeout_s=30)
    svc = SandboxService(settings, create_backend(settings))
    await svc.start()
    try:
        yield svc
    finally:
        await svc.aclose()
