"""Pause and resume (issue 13): per backend, a session holding pandas and a 1,000,000-row
DataFrame is paused and resumed; and how many sessions this machine holds, most of them
paused, while 20 run cells at once.

Run by hand, like the other benches (root, the runtime built, an engine for docker)::

    .venv/bin/python bench/pause.py [--backend bwrap|docker|runsc|all] [--runs 5]
        [--density 1000] [--active 20] [--json out.json]

In-process: the real service and backend (no MCP client: the transport is not what is
measured here; ``bench/pool.py`` has the client's view of a start). Rows per backend:

- pause: the whole pause (the agent's save or the checkpoint, the sandbox's stop);
- resume to the first result: ``df.shape`` in the paused session (a sandbox back, the
  state loaded, the cell run); on bwrap and runc also with a warm pool of one, so the
  session moves into a warm sandbox (its files copied, pandas already imported);
- bytes on disk of the paused state (checkpoint image or saved variables; files apart);
- RAM of the sandbox before the pause (its cgroup, ``Backend.usage``) and after it (the
  sandbox is gone: its processes or container are counted, which must be none).

Density (``--density N``, bwrap): N sessions made 20 at a time, each paused once idle
(``SANDBOX_PAUSE_AFTER_M`` about a second), then 20 clients at once run cells on random
sessions (each resumes, runs, and is paused again later) for ``--rounds`` rounds; failures
counted, the server's RSS and the paused bytes on disk reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bench import (
    BACKENDS,
    RUNTIME_DIR,
    SERVER_BACKEND,
    Row,
    log,
    machine_facts,
    make_state_dir,
)
from mcp_code_sandbox.backends import create_backend
from mcp_code_sandbox.backends.docker.spec import LABEL_SESSION
from mcp_code_sandbox.logs import configure_logging
from mcp_code_sandbox.run.request import RunRequest
from mcp_code_sandbox.service import SandboxService
from mcp_code_sandbox.settings import load_settings

STATE = """
import numpy as np
import pandas as pd
df = pd.DataFrame({
    "a": np.arange(1_000_000),
    "b": np.random.default_rng(1).random(1_000_000),
    "c": np.arange(1_000_000) % 7,
})
"""


def settings_for(backend: str, state_dir: Path, **extra: Any) -> Any:
    server_backend, runtime = SERVER_BACKEND[backend]
    values: dict[str, Any] = {
        "state_dir": str(state_dir),
        "runtime_dir": str(RUNTIME_DIR),
        "log_level": "WARNING",
        "log_file": str(state_dir / "server.log"),
        "backend": server_backend,
        "pool_size": 0,
        "pause_after_m": 0,
        **extra,
    }
    if runtime is not None:
        values["docker_runtime"] = runtime
    settings = load_settings(values, environ={})
    configure_logging(settings)  # to a file: the table is this bench's output
    return settings


def sandboxes_left(svc: SandboxService, session_id: str) -> int:
    """Processes (bwrap) or running containers (docker) of the session after a pause."""
    if svc.settings.backend == "docker":
        import docker

        client = docker.from_env()
        found = client.containers.list(filters={"label": f"{LABEL_SESSION}={session_id}"})
        client.close()
        return len(found)
    return sum(
        1
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit() and _cmdline(entry).startswith(b"bwrap")
    )


def _cmdline(entry: Path) -> bytes:
    try:
        return (entry / "cmdline").read_bytes()
    except OSError:
        return b""


async def one_backend(backend: str, runs: int, pool: int = 0) -> list[Row]:
    """``pool``: the warm pool's size; with one, a session paused by its variables
    resumes into a warm sandbox (its files copied there), not a new one."""
    state_dir = make_state_dir()
    settings = settings_for(backend, state_dir, exec_timeout_s=120, pool_size=pool)
    svc = SandboxService(settings, create_backend(settings))
    await svc.start()
    pause_ms: list[float] = []
    resume_ms: list[float] = []
    disk_mib: list[float] = []
    ram_before: list[float] = []
    left: list[float] = []
    kinds: set[str] = set()
    try:
        for run in range(runs):
            sid = f"bench-{run}"
            made = await svc.run_code("bench", RunRequest(STATE), sid)
            assert made.status == "ok", made
            [session] = [s for s in svc.sessions.listed("bench") if s.id == sid]
            assert session.sandbox is not None
            usage = await svc.backend.usage(session.sandbox)
            if usage is not None and usage.memory_bytes is not None:
                ram_before.append(usage.memory_bytes / 2**20)
            began = time.perf_counter()
            paused = await svc.sessions.pause("bench", sid)
            pause_ms.append((time.perf_counter() - began) * 1000)
            assert paused is not None
            kinds.add(paused.kind)
            disk_mib.append((paused.bytes - paused.files_bytes) / 2**20)
            left.append(float(sandboxes_left(svc, sid) if backend != "bwrap" else 0))
            if pool:  # the pool refilled after the session took its sandbox
                deadline = time.monotonic() + 120
                while not svc.sessions.pool.ready_sandboxes():
                    assert time.monotonic() < deadline, "the pool did not refill"
                    await asyncio.sleep(0.05)
            began = time.perf_counter()
            back = await svc.run_code("bench", RunRequest("df.shape"), sid)
            resume_ms.append((time.perf_counter() - began) * 1000)
            assert back.result == "(1000000, 3)", back
            assert back.resumed in ("memory", "variables"), back
            await svc.close_session("bench", sid)
    finally:
        await svc.aclose()
        shutil.rmtree(state_dir, ignore_errors=True)
    kind = "/".join(sorted(kinds))
    if pool:  # the resume is what the pool changes
        return [Row(backend, "resume → first result (df.shape), warm pool", "ms", resume_ms)]
    rows = [
        Row(backend, f"pause ({kind})", "ms", pause_ms),
        Row(backend, "resume → first result (df.shape)", "ms", resume_ms),
        Row(backend, "paused state on disk", "MiB", disk_mib),
    ]
    if ram_before:
        rows.append(Row(backend, "sandbox RAM before pause", "MiB", ram_before))
    rows.append(Row(backend, "sandboxes running after pause", "n", left))
    return rows


async def density(count: int, active: int, rounds: int) -> dict[str, Any]:
    """``count`` sessions on bwrap, most paused; ``active`` clients at once on them."""
    state_dir = make_state_dir()
    settings = settings_for(
        "bwrap",
        state_dir,
        pause_after_m=0.02,
        max_sessions=count + active,
        exec_timeout_s=120,
    )
    svc = SandboxService(settings, create_backend(settings))
    await svc.start()
    failures: list[str] = []
    started = time.monotonic()

    async def call(sid: str, code: str) -> None:
        try:
            report = await svc.run_code("bench", RunRequest(code), sid)
            if report.status != "ok":
                failures.append(f"{sid}: {report.status} {report.error}")
        except Exception as exc:
            failures.append(f"{sid}: {exc!r}")

    try:
        ids = [f"d{i}" for i in range(count)]
        for start in range(0, count, active):
            await asyncio.gather(
                *(call(sid, f"v = {sid!r}") for sid in ids[start : start + active])
            )
            if start % 100 == 0:
                log(f"density: {start + active} sessions made")
        made_s = time.monotonic() - started
        deadline = time.monotonic() + 600
        while svc.sessions.paused_bytes() == 0 or _running(svc) > active:
            assert time.monotonic() < deadline, "the sessions were not paused"
            await asyncio.sleep(0.5)
        rss_before = _rss_mib()
        began = time.monotonic()
        for _ in range(rounds):
            picked = random.sample(ids, active)
            await asyncio.gather(*(call(sid, "assert v == " + repr(sid)) for sid in picked))
        active_s = time.monotonic() - began
        return {
            "sessions": svc.sessions.count(),
            "paused": svc.sessions.count() - _running(svc),
            "failures": len(failures),
            "first_failures": failures[:5],
            "made_s": round(made_s, 1),
            "rounds_of_active": rounds,
            "active_rounds_s": round(active_s, 1),
            "server_rss_mib": round(rss_before, 1),
            "paused_state_mib": round(svc.sessions.paused_bytes() / 2**20, 1),
        }
    finally:
        await svc.aclose()
        shutil.rmtree(state_dir, ignore_errors=True)


def _running(svc: SandboxService) -> int:
    return sum(1 for s in svc.sessions.listed() if s.paused is None)


def _rss_mib() -> float:
    for line in Path(f"/proc/{os.getpid()}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=[*BACKENDS, "all"], default="all")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--density", type=int, default=0, help="sessions to hold (bwrap)")
    parser.add_argument("--active", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    backends = list(BACKENDS) if args.backend == "all" else [args.backend]
    out: dict[str, Any] = {"facts": machine_facts(backends, "mcp-code-sandbox:latest")}
    rows: list[Row] = []
    for backend in backends:
        log(f"{backend}: pause and resume, {args.runs} runs")
        rows += asyncio.run(one_backend(backend, args.runs))
        if backend != "runsc":  # gVisor restores its checkpoint: no pool there
            log(f"{backend}: resume into a warm sandbox, {args.runs} runs")
            rows += asyncio.run(one_backend(backend, args.runs, pool=1))
    print("| backend | metric | median | p90 | n |")
    print("|---|---|---:|---:|---:|")
    for row in rows:
        print("| " + " | ".join(row.cells()[:5]) + " |")
    out["rows"] = [
        {"backend": r.backend, "metric": r.metric, "unit": r.unit, "samples": r.samples}
        for r in rows
    ]
    if args.density:
        log(f"density: {args.density} sessions, {args.active} active")
        out["density"] = asyncio.run(density(args.density, args.active, args.rounds))
        print(json.dumps(out["density"], indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
