"""Bench of ``fork_session`` (issue 29): a pandas session holding a 1,000,000-row
DataFrame forked into a warm sandbox, through the official MCP client over stdio.

Run by hand, like ``bench.py`` (whose helpers it uses), from the checkout to measure
(its ``PYTHONPATH`` is passed on to the server)::

    PYTHONPATH=$PWD/src .venv/bin/python bench/fork.py [--backend bwrap|docker|runsc|all]
        [--runs 20] [--image mcp-code-sandbox:latest] [--json out.json]

Per backend, one server with a warm pool of 2 (the default preload) and 2 GiB of memory
per sandbox. The source session builds the DataFrame of ``pause_vars.py`` (four columns:
int, float, a category and a string). Each sample, with the pool full again (untimed):

- the source's call before the fork (``df.shape``): the warm round trip to compare with;
- ``fork_session`` alone: the source's variables saved (its sandbox runs on), its files
  copied into a warm sandbox's workspace, the variables loaded there;
- fork → first result in the fork: ``fork_session`` then ``df.shape`` in the fork;
- the source's next call after the fork (``df.shape``): the source is untouched.

The fork is closed after each sample. Prints machine facts and a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from mcp import Client, StdioServerParameters
from pause_vars import BUILD
from pool import call, rest

from bench import (
    BACKENDS,
    PROTOCOL,
    Row,
    log,
    machine_facts,
    make_state_dir,
    report,
    server_env,
)

SHAPE = "df.shape"
#: Each sandbox's memory: the frame, its pickles while saved, and its copy while loaded.
MEMORY = "2g"


@asynccontextmanager
async def serving(backend: str, image: str) -> AsyncIterator[Client]:
    state_dir = make_state_dir()
    env = server_env(state_dir, None, backend, image)
    env |= {"SANDBOX_POOL_SIZE": "2", "SANDBOX_MEMORY_LIMIT": MEMORY}
    if "PYTHONPATH" in os.environ:  # the server runs the code under test
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "mcp_code_sandbox", "serve"], env=env
    )
    try:
        async with Client(params, mode=PROTOCOL) as client:
            yield client
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)


async def timed_ms(client: Client, tool: str, **arguments: Any) -> tuple[float, dict[str, Any]]:
    start = time.perf_counter()
    content = await call(client, tool, **arguments)
    return (time.perf_counter() - start) * 1000, content


async def shape(client: Client, session_id: str) -> float:
    took, content = await timed_ms(client, "run_code", session_id=session_id, code=SHAPE)
    if content.get("result") != "(1000000, 4)":
        raise RuntimeError(f"df.shape in {session_id}: {content}")
    return took


async def measure(backend: str, args: argparse.Namespace) -> list[Row]:
    before: list[float] = []
    fork: list[float] = []
    first: list[float] = []
    after: list[float] = []
    copied: list[int] = []
    async with serving(backend, args.image) as client:
        await rest(client)
        built = await call(client, "run_code", session_id="source", code=BUILD, timeout_s=300)
        if built["status"] != "ok":
            raise RuntimeError(f"the source was not built: {built}")
        for index in range(args.runs + 1):  # the first is a warm-up
            await rest(client)
            source_before = await shape(client, "source")
            forked_ms, forked = await timed_ms(client, "fork_session", session_id="source")
            if forked["state"] != "variables":
                raise RuntimeError(f"fork_session: {forked}")
            in_fork = await shape(client, forked["session_id"])
            source_after = await shape(client, "source")
            await call(client, "close_session", session_id=forked["session_id"])
            copied.append(forked["bytes_copied"])
            log(f"{backend} run {index}: fork {forked_ms:.0f} ms, first result +{in_fork:.0f} ms")
            if index:
                before.append(source_before)
                fork.append(forked_ms)
                first.append(forked_ms + in_fork)
                after.append(source_after)
    mib = max(copied) / 2**20
    note = f"pool of 2 at rest; 1,000,000 rows × 4 columns; {mib:.0f} MiB copied"
    return [
        Row(backend, "source: `df.shape` before the fork", "ms", before, "warm round trip"),
        Row(backend, "`fork_session` alone", "ms", fork, note),
        Row(backend, "fork → first result in the fork (`df.shape`)", "ms", first, note),
        Row(backend, "source: next `df.shape` after the fork", "ms", after, "source untouched"),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=[*BACKENDS, "all"], default="all")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--image", default="mcp-code-sandbox:latest")
    parser.add_argument("--json", type=Path)
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
