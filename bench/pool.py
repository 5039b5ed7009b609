"""The warm pool's bench (issue 12): new sessions with and without the pool, per backend,
through the official MCP client over stdio, each row beside its baseline of the same run.

Run by hand, like ``bench.py`` (whose helpers it uses)::

    .venv/bin/python bench/pool.py [--backend bwrap|docker|runsc|all] [--runs 20]
        [--bursts 5] [--image mcp-code-sandbox:latest] [--json out.json]
        [--llm-sandbox-python /tmp/llmsb-venv/bin/python]

Per backend, two servers one after the other on fresh state dirs: one with the pool
(``SANDBOX_POOL_SIZE=2``, the default preload) and one without (``SANDBOX_POOL_SIZE=0``:
every new session is a miss). Rows:

- new session → first result of ``print(1)``: pool hit, and miss (pool off);
- the first ``df.describe()`` of a 1,000-row frame in a new session (the ``import pandas``
  included): pool hit (preloaded), and miss;
- a burst of 20 new sessions at once (wall time, failures): pool of 2, and pool off;
- idle memory of one pooled sandbox (PSS of its processes, no session in it);
- Docker backends: llm-sandbox with its own container pool (``PoolConfig``) as the peer,
  on the same image and engine (``llm_sandbox_peer.py --pool``).

Between samples the bench waits, untimed, until the pool is full again (``list_runtimes``
says so): a hit is measured as a client arriving at a server at rest would see it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from mcp import Client, StdioServerParameters

from bench import (
    BACKENDS,
    HERE,
    PROTOCOL,
    SERVER_BACKEND,
    Row,
    call,
    cgroup_pids,
    descendants,
    find_server,
    log,
    machine_facts,
    make_state_dir,
    our_containers,
    pss_kib,
    report,
    server_env,
)

PRINT = "print(1)"
DESCRIBE = (
    "import numpy as np\nimport pandas as pd\n"
    "df = pd.DataFrame({'a': np.arange(1000), 'b': np.arange(1000) * 0.5})\n"
    "df.describe()"
)
BURST = 20
REST_S = 300.0


@asynccontextmanager
async def serving(backend: str, image: str, pool: int) -> AsyncIterator[tuple[Client, Path]]:
    state_dir = make_state_dir()
    env = server_env(state_dir, None, backend, image)
    env |= {"SANDBOX_POOL_SIZE": str(pool), "SANDBOX_MAX_SESSIONS": str(BURST * 2)}
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "mcp_code_sandbox", "serve"], env=env
    )
    try:
        async with Client(params, mode=PROTOCOL) as client:
            yield client, state_dir
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)  # the server has ended: nothing waits


async def rest(client: Client) -> dict[str, Any]:
    """Wait until the pool is full (untimed, at most ``REST_S``); its status."""
    deadline = time.monotonic() + REST_S
    while True:
        pool: dict[str, Any] = (await call(client, "list_runtimes"))["pool"]
        if pool["ready"] == pool["size"] and pool["starting"] == 0:
            return pool
        if time.monotonic() > deadline:
            raise RuntimeError(f"the pool did not fill: {pool}")
        await asyncio.sleep(0.2)


async def new_sessions(client: Client, code: str, runs: int) -> list[float]:
    samples = []
    for _ in range(runs + 1):  # the first is a warm-up
        await rest(client)
        start = time.perf_counter()
        content = await call(client, "run_code", code=code)
        samples.append((time.perf_counter() - start) * 1000)
        if content["status"] != "ok" or not content["session_created"]:
            raise RuntimeError(f"run_code: {content}")
        await call(client, "close_session", session_id=content["session_id"])
    return samples[1:]


async def bursts(client: Client, runs: int) -> tuple[list[float], int]:
    walls, failures = [], 0
    for _ in range(runs):
        await rest(client)
        start = time.perf_counter()
        results = await asyncio.gather(
            *(client.call_tool("run_code", {"code": PRINT}) for _ in range(BURST)),
            return_exceptions=True,
        )
        walls.append((time.perf_counter() - start) * 1000)
        for result in results:
            content = None if isinstance(result, BaseException) else result.structured_content
            if not isinstance(content, dict) or content.get("status") != "ok":
                failures += 1
            else:
                await call(client, "close_session", session_id=content["session_id"])
    return walls, failures


def pooled_pss_mib(backend: str, state_dir: Path, size: int) -> list[float]:
    """PSS of each pooled sandbox's processes (the server at rest, no session open)."""
    server = find_server(state_dir)
    if backend == "bwrap":
        # Everything under the server is the pool's: one bwrap tree per sandbox.
        total = sum(pss_kib(pid) for pid in descendants(server)) / 1024
        return [total / size]
    # The pool's containers are labelled with an empty session id (docker's template
    # prints an empty label as "<no value>" on some versions).
    pool = our_containers(server, {"", "<no value>"})
    if not pool:
        raise RuntimeError("no pooled container found to measure")
    return [sum(pss_kib(pid) for pid in cgroup_pids(cid)) / 1024 for cid in pool]


async def measure(backend: str, args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    log(f"{backend}: with the pool")
    async with serving(backend, args.image, 2) as (client, state_dir):
        pool = await rest(client)
        hit = await new_sessions(client, PRINT, args.runs)
        hit_df = await new_sessions(client, DESCRIBE, args.runs)
        await rest(client)
        memory = pooled_pss_mib(backend, state_dir, pool["size"])
        burst, burst_failed = await bursts(client, args.bursts)
    log(f"{backend}: without the pool")
    async with serving(backend, args.image, 0) as (client, _):
        miss = await new_sessions(client, PRINT, args.runs)
        miss_df = await new_sessions(client, DESCRIBE, args.runs)
        cold_burst, cold_failed = await bursts(client, args.bursts)
    preload = ", ".join(pool["preload"])
    rows += [
        Row(backend, "pool hit: new session → first result of `print(1)`", "ms", hit,
            f"pool of 2, at rest before each sample; preload {preload}"),
        Row(backend, "miss (pool off): new session → first result of `print(1)`", "ms", miss,
            "SANDBOX_POOL_SIZE=0: a sandbox started for the call"),
        Row(backend, "pool hit: first `df.describe()` of 1,000 rows in a new session", "ms",
            hit_df, "`import pandas` included: preloaded"),
        Row(backend, "miss (pool off): first `df.describe()` of 1,000 rows", "ms", miss_df,
            "the sandbox start and `import pandas` included"),
        Row(backend, f"burst of {BURST} new sessions, pool of 2: wall", "ms", burst,
            f"{burst_failed} failed of {BURST * len(burst)}"),
        Row(backend, f"burst of {BURST} new sessions, pool off: wall", "ms", cold_burst,
            f"{cold_failed} failed of {BURST * len(cold_burst)}"),
        Row(backend, "idle memory of one pooled sandbox (PSS)", "MiB", memory,
            "its processes: bwrap or the container's init, agent, kernel with the preload"),
    ]  # fmt: skip
    if backend != "bwrap":
        rows += peer(backend, args)
    return rows


def peer(backend: str, args: argparse.Namespace) -> list[Row]:
    runtime = SERVER_BACKEND[backend][1] or "runc"
    python = Path(args.llm_sandbox_python)
    if not python.exists():
        return [Row(backend, "peer: llm-sandbox pool", "ms", [float("nan")], f"no {python}")]
    argv = [str(python), str(HERE / "llm_sandbox_peer.py"), "--image", args.image,
            "--runtime", runtime, "--runs", str(args.runs), "--pool"]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=3600)
    if out.returncode != 0:
        log(f"llm-sandbox failed: {out.stderr[-2000:]}")
        why = (out.stderr.strip().splitlines() or ["?"])[-1][:200]
        return [Row(backend, "peer: llm-sandbox pool", "ms", [float("nan")], f"failed: {why}")]
    data = json.loads(out.stdout.strip().splitlines()[-1])
    return [
        Row(backend, "peer: llm-sandbox with its pool: new session → `print(1)`", "ms",
            data["new_session"], f"llm-sandbox {data['version']}, {data['how']}"),
    ]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=[*BACKENDS, "all"], default="all")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--bursts", type=int, default=5)
    parser.add_argument("--image", default="mcp-code-sandbox:latest")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--llm-sandbox-python", default="/tmp/llmsb-venv/bin/python")
    args = parser.parse_args()
    backends = list(BACKENDS) if args.backend == "all" else [args.backend]
    facts = machine_facts(backends, args.image)
    rows: list[Row] = []
    for backend in backends:
        rows += asyncio.run(measure(backend, args))
    report(rows, facts, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
