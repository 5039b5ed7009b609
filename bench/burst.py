"""Bursts of new sessions (issue 29): waves of sessions opened at once through the official
MCP client over stdio, on a pool that follows demand.

Run by hand, like ``bench.py`` (whose helpers it uses)::

    .venv/bin/python bench/burst.py [--waves 5] [--only docker|bwrap]
        [--seed-python ../seed000/.venv/bin/python]
        [--seed-image mcp-code-sandbox:seed000] [--json out.json]

- **docker (runc), 10 at once, ours beside seed 000**: both servers run at once, each
  behind its own client in this one process, on the same engine; their waves alternate
  (ours first in odd rounds, seed 000's first in even ones), so both see the same host.
  Seed 000 is the repository's first server that runs a docker session (commit 70e5da7),
  run from its own checkout and venv (``--seed-python``); its image (``--seed-image``) is
  ours with seed 000's agent in place of ours (the same packages: see bench/README.md).
  It has no pool: every session starts cold. Ours runs with its defaults
  (``SANDBOX_POOL_SIZE=2``).
- **bwrap, 20 at once**: ours alone, the same way.

Before each wave the bench waits, untimed, until each server is at rest (ours: its pool
holds its target, ``list_runtimes`` says so); how long our pool took to refill after a
wave is reported too. The first wave meets the pool at its resting size (2); the pool then
grows to the burst, so later waves are served warm. A wave's time is the wall time from
sending its calls to the last result; its sessions are closed afterwards, untimed.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from mcp import Client, StdioServerParameters

from bench import PROTOCOL, Row, call, log, machine_facts, make_state_dir, report, server_env

DOCKER_WAVE = 10
BWRAP_WAVE = 20
REST_S = 600.0
SEED_IMAGE = "mcp-code-sandbox:seed000"


@asynccontextmanager
async def serving(
    python: str, backend: str, image: str, env: dict[str, str]
) -> AsyncIterator[Client]:
    state_dir = make_state_dir()
    full_env = server_env(state_dir, None, backend, image) | env
    params = StdioServerParameters(
        command=python, args=["-m", "mcp_code_sandbox", "serve"], env=full_env
    )
    try:
        async with Client(params, mode=PROTOCOL) as client:
            yield client
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)  # the server has ended


async def rest(client: Client, pooled: bool) -> tuple[float, dict[str, Any] | None]:
    """Wait (at most ``REST_S``) until the pool holds its target; the time it took, in
    ms, and the pool's status. A server without a pool is at rest at once."""
    if not pooled:
        return 0.0, None
    start = time.perf_counter()
    while True:
        pool: dict[str, Any] = (await call(client, "list_runtimes"))["pool"]
        if pool["ready"] >= pool["size"] and pool["starting"] == 0:
            return (time.perf_counter() - start) * 1000, pool
        if time.perf_counter() - start > REST_S:
            raise RuntimeError(f"the pool did not fill: {pool}")
        await asyncio.sleep(0.1)


async def wave(client: Client, size: int) -> tuple[float, int]:
    """``size`` new sessions at once: the wall time in ms, and how many failed."""
    start = time.perf_counter()
    results = await asyncio.gather(
        *(client.call_tool("run_code", {"code": "print(1)"}) for _ in range(size)),
        return_exceptions=True,
    )
    wall = (time.perf_counter() - start) * 1000
    failed = 0
    for result in results:
        content = None if isinstance(result, BaseException) else result.structured_content
        if not isinstance(content, dict) or content.get("stdout") != "1\n":
            failed += 1
        else:
            await call(client, "close_session", session_id=content["session_id"])
    return wall, failed


class Waves:
    """One server's waves: the first apart from the later ones."""

    def __init__(self, name: str, client: Client, size: int, pooled: bool) -> None:
        self.name, self.client, self.size, self.pooled = name, client, size, pooled
        self.walls: list[float] = []
        self.refills: list[float] = []
        self.failed = 0
        self.pools: list[dict[str, Any]] = []

    async def one(self) -> None:
        refill, pool = await rest(self.client, self.pooled)
        if self.walls:  # the refill after the previous wave
            self.refills.append(refill)
        if pool is not None:
            self.pools.append(pool)
        wall, failed = await wave(self.client, self.size)
        self.walls.append(wall)
        self.failed += failed
        log(f"{self.name}: wave {len(self.walls)}: {wall:.0f} ms, {failed} failed")

    def rows(self, backend: str) -> list[Row]:
        failed = f"{self.failed} failed of {self.size * len(self.walls)}"
        first = "pool at rest" if self.pooled else "no pool"
        rows = [
            Row(backend, f"{self.name}: first wave of {self.size} new sessions", "ms",
                self.walls[:1], f"{first}; {failed}"),
        ]  # fmt: skip
        if len(self.walls) > 1:
            sizes = sorted({p["size"] for p in self.pools[1:]})
            how = f"pool grown to {sizes}" if self.pooled else "no pool"
            rows.append(
                Row(backend, f"{self.name}: later waves of {self.size}", "ms", self.walls[1:],
                    f"{how}; {failed}"),
            )  # fmt: skip
        if self.refills and self.pooled:
            rows.append(
                Row(backend, f"{self.name}: pool refill after a wave (untimed wait)", "ms",
                    self.refills, "from the wave's end until the pool held its target"),
            )  # fmt: skip
        return rows


async def docker_side_by_side(args: argparse.Namespace) -> list[Row]:
    log("docker (runc): ours and seed 000, side by side")
    async with (
        serving(sys.executable, "docker", args.image, {"SANDBOX_POOL_SIZE": "2"}) as ours_client,
        serving(args.seed_python, "docker", args.seed_image, {}) as seed_client,
    ):
        ours = Waves("ours", ours_client, DOCKER_WAVE, pooled=True)
        seed = Waves("seed 000", seed_client, DOCKER_WAVE, pooled=False)
        await rest(ours_client, True)
        for n in range(args.waves):
            for side in (ours, seed) if n % 2 == 0 else (seed, ours):
                await side.one()
    rows = ours.rows("docker") + seed.rows("docker")
    later = statistics.median(ours.walls[1:] or ours.walls)
    first = ours.walls[0]
    base = statistics.median(seed.walls)
    rows.append(
        Row("docker", "ratio: ours ÷ seed 000 (medians)", "x", [later / base],
            f"later waves; first wave {first / base:.2f}×"),
    )  # fmt: skip
    return rows


async def bwrap_burst(args: argparse.Namespace) -> list[Row]:
    log("bwrap: ours, bursts of 20")
    async with serving(sys.executable, "bwrap", args.image, {"SANDBOX_POOL_SIZE": "2"}) as client:
        ours = Waves("ours", client, BWRAP_WAVE, pooled=True)
        for _ in range(args.waves):
            await ours.one()
    return ours.rows("bwrap")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--waves", type=int, default=5)
    parser.add_argument("--only", choices=["docker", "bwrap"])
    parser.add_argument("--image", default="mcp-code-sandbox:latest")
    # Seed 000's own venv (bench/README.md says how to make it): outside this checkout,
    # so always named, never guessed.
    parser.add_argument("--seed-python")
    parser.add_argument("--seed-image", default=SEED_IMAGE)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.only != "bwrap" and not (args.seed_python and Path(args.seed_python).exists()):
        parser.error("--seed-python: seed 000's interpreter (its own venv; see bench/README.md)")
    backends = ["docker", "bwrap"] if args.only is None else [args.only]
    facts = machine_facts(backends, args.image)
    rows: list[Row] = []
    if "docker" in backends:
        rows += asyncio.run(docker_side_by_side(args))
    if "bwrap" in backends:
        rows += asyncio.run(bwrap_burst(args))
    report(rows, facts, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
