"""A client nobody here wrote: the official MCP conformance suite
(``@modelcontextprotocol/conformance``, pinned in ``tests/conformance/package.json``)
runs its server scenarios against the real HTTP server.

``scripts/install.sh --dev`` installs the suite into ``tests/conformance/node_modules``
(``npm ci``: the lockfile's exact versions); it needs Node.js 22 or later, so it runs on
the sandbox runtime's node (``mcp-code-sandbox setup`` builds it), not the host's. The
scenarios that need the suite's own test tools, resources and prompts, or capabilities
the server does not declare, are listed with their reasons in
``tests/conformance/expected-failures.yml``; the suite fails on any other failure and on
a listed scenario that passes. Without the suite installed the test is skipped with the
fix, and fails in CI.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from mcp_code_sandbox.settings import Settings

from ..conftest import REPO, REQUIRE_DOCKER
from .conftest import http_server_process

pytestmark = [pytest.mark.e2e, pytest.mark.bwrap]

SUITE_DIR = REPO / "tests" / "conformance"
SUITE = SUITE_DIR / "node_modules" / "@modelcontextprotocol" / "conformance" / "dist" / "index.js"
EXPECTED_FAILURES = SUITE_DIR / "expected-failures.yml"
#: The suite's own timeout is 30 s per scenario; the whole run takes a few seconds.
SUITE_TIMEOUT_S = 300
MIN_NODE_MAJOR = 22


def _missing(why: str) -> None:
    if os.environ.get("CI") or REQUIRE_DOCKER:  # .ci/run installs it (install.sh --dev)
        pytest.fail(why, pytrace=False)
    pytest.skip(why)


def _node(runtime_dir: Path) -> str:
    node = runtime_dir / "node" / "bin" / "node"
    if not node.is_file():
        _missing(f"no Node.js in the sandbox runtime ({node}): run mcp-code-sandbox setup")
    version = subprocess.run(
        [str(node), "--version"], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    major = re.match(r"v(\d+)\.", version)
    assert major and int(major.group(1)) >= MIN_NODE_MAJOR, version
    return str(node)


def test_the_official_conformance_suite_passes(
    make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    if not SUITE.is_file():
        _missing("the MCP conformance suite is not installed: run scripts/install.sh --dev")
    settings = make_settings()
    node = _node(settings.runtime_dir)
    with http_server_process(settings) as (base, _proc):
        argv = [node, str(SUITE), "server", "--url", f"{base}/mcp"]
        argv += ["--expected-failures", str(EXPECTED_FAILURES), "--output-dir", str(tmp_path)]
        done = subprocess.run(
            argv, cwd=tmp_path, capture_output=True, text=True, timeout=SUITE_TIMEOUT_S
        )
    report = done.stdout[-6000:] + done.stderr[-3000:]
    assert done.returncode == 0, report
    # It ran the scenarios (an empty run would exit 0 too).
    assert "=== SUMMARY ===" in done.stdout, report
    for scenario in ("server-initialize", "tools-list", "dns-rebinding-protection"):
        assert re.search(rf"✓ {scenario}: \d+ passed, 0 failed", done.stdout), report
