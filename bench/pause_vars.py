"""Bench of the variables pause on bwrap: a pandas session with a 1,000,000-row DataFrame.

Run by hand (as root, like the server; the runtime env must have cloudpickle)::

    SANDBOX_RUNTIME_DIR=/var/tmp/mcs-state-runtime .venv/bin/python bench/pause_vars.py [--runs 5]

Each run, in one bwrap sandbox: build the session (import pandas, a DataFrame of
1,000,000 rows and four columns: int, float, a category and a string), then time the
save (``AgentClient.save_state``), measure the bytes of ``.session/`` on disk, stop the
sandbox, start a new one on the same workspace, time the load, and the first result
(``df.shape``). The kernel's peak RSS before and after the save (a save that held its
pickles in memory would raise it by the DataFrame's size), and after the load. Beside
them, in the same run, the baselines: the sandbox's start alone, and rebuilding the
session from scratch in a new sandbox (what a resume without saved variables costs).
Prints a Markdown table of medians to stdout; progress to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from mcp_code_sandbox.backends.base import Limits, SandboxSpec
from mcp_code_sandbox.backends.bwrap.backend import BwrapBackend
from mcp_code_sandbox.sessions.agent_client import AgentClient
from mcp_code_sandbox.sessions.executor import Cell
from mcp_code_sandbox.settings import load_settings

LIMITS = Limits(memory_bytes=2 << 30, cpu=1.0, pids=128, tmp_bytes=64 << 20, file_bytes=1 << 30)
BUILD = """
import numpy as np
import pandas as pd
n = 1_000_000
df = pd.DataFrame({
    "id": np.arange(n),
    "x": np.random.default_rng(0).random(n),
    "kind": pd.Categorical(np.array(["a", "b", "c", "d"])[np.arange(n) % 4]),
    "name": [f"row{i}" for i in range(n)],
})
"""
MAX_BYTES = 1 << 30
#: The kernel's peak RSS so far, MiB: a save that held every pickle in memory raises it.
PEAK = "import resource; resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024"


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


async def timed(step: Callable[[], Awaitable[Any]]) -> tuple[float, Any]:
    started = time.perf_counter()
    value = await step()
    return time.perf_counter() - started, value


async def cell(client: AgentClient, code: str) -> str | None:
    outcome = await client.execute(Cell("python", code, 300), lambda n, t: None)
    if outcome.status != "ok":
        raise RuntimeError(f"{code[:40]!r}: {outcome.error}")
    return outcome.result


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


async def one_run(backend: BwrapBackend, workspace: Path, uid: int | None) -> dict[str, float]:
    shutil.rmtree(workspace / ".session", ignore_errors=True)

    def spec(key: str) -> SandboxSpec:
        return SandboxSpec(key=key, owner="bench", session_id="bench", workspace=workspace,
                           limits=LIMITS, uid=uid)  # fmt: skip

    row: dict[str, float] = {}
    row["start_s"], box = await timed(lambda: backend.create(spec("a")))
    try:
        client = AgentClient(box.channel)
        row["build_s"], _ = await timed(lambda: cell(client, BUILD))
        row["kernel_peak_mib_before_save"] = float(await cell(client, PEAK) or 0)
        row["save_s"], report = await timed(lambda: client.save_state(MAX_BYTES, 300))
        assert {v.name for v in report.kept} >= {"df", "n"}, report
        row["kernel_peak_mib_after_save"] = float(await cell(client, PEAK) or 0)
        row["disk_mib"] = disk_bytes(workspace / ".session") / 2**20
    finally:
        await backend.stop(box)
    started = time.perf_counter()
    box = await backend.create(spec("b"))
    try:
        client = AgentClient(box.channel)
        row["load_s"], loaded = await timed(lambda: client.load_state(300))
        assert "df" in loaded.restored, loaded
        shape = await cell(client, "df.shape")
        assert shape == "(1000000, 4)", shape
        row["kernel_peak_mib_after_load"] = float(await cell(client, PEAK) or 0)
        row["resume_first_result_s"] = time.perf_counter() - started
    finally:
        await backend.stop(box)
    started = time.perf_counter()  # the baseline: no saved variables, build again
    box = await backend.create(spec("c"))
    try:
        await cell(AgentClient(box.channel), BUILD + "df.shape")
        row["rebuild_first_result_s"] = time.perf_counter() - started
    finally:
        await backend.stop(box)
    return row


async def bench(backend: BwrapBackend, workspace: Path, uid: int | None, runs: int) -> None:
    rows = []
    for index in range(runs):
        row = await one_run(backend, workspace, uid)
        log(f"run {index + 1}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()))
        rows.append(row)
    print(f"| bwrap, 1,000,000-row DataFrame (4 columns) | median of {len(rows)} |")
    print("|---|---|")
    for key in rows[0]:
        print(f"| {key} | {statistics.median(r[key] for r in rows):.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    state_dir = Path(tempfile.mkdtemp(prefix="mcs-bench-pause-", dir="/var/tmp"))
    state_dir.chmod(0o711)
    settings = load_settings({"state_dir": str(state_dir), "backend": "bwrap"})
    backend = BwrapBackend(settings)
    lease = None
    uid = None
    if os.geteuid() == 0 and backend.per_sandbox_uids:
        from mcp_code_sandbox.sessions.uids import uid_pool

        lease = uid_pool(settings).lease("bench pause_vars")
        uid = lease.uid
    workspace = state_dir / "workspaces" / "bench"
    workspace.mkdir(parents=True)
    owner = (uid, uid) if uid is not None else backend.workspace_owner
    if owner is not None:
        os.chown(workspace, *owner)
    try:
        asyncio.run(bench(backend, workspace, uid, args.runs))
    finally:
        if lease is not None:
            lease.release()
        shutil.rmtree(state_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
