"""How a first start (no runtime env: ``uvx mcp-code-sandbox`` on a new machine) compares
with a start on a machine that has one, through the official MCP client over stdio.

For each of ``--runs`` rounds, in the same run so that the load is shared: the time to
``initialize`` answered for a server with the runtime env (``SANDBOX_RUNTIME_DIR`` or the
default) and for one with an empty runtime dir; for the latter also the time to the first
``run_code`` result, waiting through the background build of a runtime of ``--packages``
(default ``ipython``: small; the full default list takes minutes and ~400 MB).

    .venv/bin/python bench/first_run.py --runs 5
    .venv/bin/python bench/first_run.py --runs 1 --packages ""     # the default list

Needs bwrap, the package index (this machine's pip configuration is passed through) and,
for the baseline, a runtime env. Progress to stderr, a Markdown table to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from mcp import Client, StdioServerParameters

from mcp_code_sandbox.settings import load_settings


def params(state: Path, runtime: Path, packages: str) -> StdioServerParameters:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_")}
    env |= {
        "SANDBOX_STATE_DIR": str(state),
        "SANDBOX_RUNTIME_DIR": str(runtime),
        "SANDBOX_BACKEND": "bwrap",
        "SANDBOX_LOG_FILE": str(state / "server.log"),
    }
    if packages:
        env["SANDBOX_RUNTIME_PACKAGES"] = packages
    return StdioServerParameters(command=sys.executable, args=["-m", "mcp_code_sandbox"], env=env)


async def one(state: Path, runtime: Path, packages: str) -> tuple[float, float]:
    """Seconds to ``initialize`` answered and to the first result of ``6 * 7``."""
    started = time.perf_counter()
    async with Client(params(state, runtime, packages), mode="legacy") as client:
        initialized = time.perf_counter() - started
        result = await client.call_tool("run_code", {"code": "6 * 7", "timeout_s": 600})
        if result.is_error:
            raise SystemExit(f"run_code failed: {result.content}")
        return initialized, time.perf_counter() - started


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--packages", default="ipython")
    args = parser.parse_args()
    shared = load_settings().runtime_dir
    rows: dict[str, list[float]] = {}
    for n in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="mcs-first-run-", dir="/var/tmp") as tmp:
            root = Path(tmp)
            (root / "warm").mkdir()
            (root / "cold").mkdir()
            warm = await one(root / "warm", shared, "")
            cold = await one(root / "cold", root / "cold" / "runtime", args.packages)
        for name, value in (
            ("initialize answered, runtime env there (baseline)", warm[0]),
            ("initialize answered, first start (no runtime env)", cold[0]),
            ("first result, runtime env there (baseline)", warm[1]),
            (f"first result, first start (builds {args.packages or 'the default list'})", cold[1]),
        ):
            rows.setdefault(name, []).append(value)
        print(f"round {n + 1}/{args.runs}: warm {warm}, cold {cold}", file=sys.stderr)
    print(f"load average at end: {os.getloadavg()}")
    print("| seconds (median, min, max) | |\n|---|---|")
    for name, values in rows.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.2f} ({min(values):.2f}, {max(values):.2f}) |")


if __name__ == "__main__":
    asyncio.run(main())
