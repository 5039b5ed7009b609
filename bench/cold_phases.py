"""Where a cold Docker sandbox's start goes (issue 12 point 3), beside a bare ``docker run``.

Run by hand, as root, like ``bench.py`` (whose helpers it uses)::

    .venv/bin/python bench/cold_phases.py [--backend docker|runsc] [--runs 20]
        [--image mcp-code-sandbox:latest]

It drives the docker backend in-process (no MCP server, no session manager: the
workspace is a plain directory, without the filesystem quota) and stamps each phase of
``DockerBackend.create`` by wrapping the functions the backend calls: the engine's create
(one request), its start, the agent's connection on the run dir's socket, the agent's
``ready`` (its kernel is up), then the first result of ``print(1)``. Each sample is
followed by one bare ``docker run … python -c 'print(1)'`` of the same image and runtime
(bench.py's baseline), so both see the same load. Times are from the start of
``create``; medians and p90s over ``--runs`` samples after two warm-ups.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import SERVER_BACKEND, Row, docker_run_argv, log, make_state_dir, markdown_table, p90
from bench import time_command as time_bare
from mcp_code_sandbox.backends.base import Limits, SandboxSpec
from mcp_code_sandbox.backends.docker import backend as docker_backend
from mcp_code_sandbox.backends.docker.backend import DockerBackend, DockerSandbox
from mcp_code_sandbox.backends.docker.engine import Engine
from mcp_code_sandbox.sessions.uids import uid_pool
from mcp_code_sandbox.settings import docker_environ, load_settings

PHASES = (
    ("created", "engine create returned"),
    ("started", "engine start returned"),
    ("connected", "agent connected to the run dir's socket"),
    ("ready", "agent ready (its kernel is up)"),
    ("done", "first result of `print(1)`"),
)
LIMITS = Limits(memory_bytes=512 << 20, cpu=1.0, pids=256, tmp_bytes=64 << 20, file_bytes=1 << 30)


class Stamps:
    """The phases of the sandbox being started, as ``perf_counter`` times."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        self.times.setdefault(phase, time.perf_counter())

    def since(self, start: float) -> dict[str, float]:
        return {phase: (at - start) * 1000 for phase, at in self.times.items()}


def instrument(stamps: Stamps) -> None:
    """Stamp the backend's steps: its engine calls by the function called, its accept."""
    call = Engine.call

    async def timed_call(self: Engine, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        result = await call(self, fn, *args, **kwargs)
        name = getattr(fn, "__name__", "")
        if name in ("create_container", "start"):
            stamps.mark("created" if name == "create_container" else "started")
        return result

    accept = docker_backend.accept_agent

    async def timed_accept(*args: Any, **kwargs: Any) -> Any:
        result = await accept(*args, **kwargs)
        stamps.mark("connected")
        return result

    Engine.call = timed_call  # type: ignore[method-assign]
    docker_backend.accept_agent = timed_accept  # type: ignore[assignment]


async def first_print(box: DockerSandbox, run_id: int) -> None:
    await box.channel.send(
        {"op": "exec", "id": run_id, "language": "python", "code": "print(1)", "timeout_s": 30}
    )
    while (message := await box.channel.receive()) is not None:
        if message.get("ev") == "done":
            return
    raise RuntimeError("the agent closed its channel before its done")


async def measure(backend_name: str, image: str, runs: int) -> list[Row]:
    state = make_state_dir()
    runtime = SERVER_BACKEND[backend_name][1] or "runc"
    values = {"state_dir": str(state), "backend": "docker", "pool_size": 0, "image": image}
    settings = load_settings({**values, "docker_runtime": runtime}, environ={})
    lease = uid_pool(load_settings(environ={})).lease(f"bench cold_phases {os.getpid()}")
    backend = DockerBackend(settings, docker_environ())
    stamps = Stamps()
    instrument(stamps)
    bare_argv = docker_run_argv(backend_name, image)
    phases: dict[str, list[float]] = {phase: [] for phase, _ in PHASES}
    bare: list[float] = []
    ids = itertools.count(1)
    try:
        for i in range(runs + 2):
            workspace = state / "workspaces" / f"w{i}"
            workspace.mkdir(parents=True)
            os.chown(workspace, lease.uid, lease.uid)
            spec = SandboxSpec(
                key=f"w{i}",
                owner="bench",
                session_id=f"cold-{i}",
                workspace=workspace,
                limits=LIMITS,
                uid=lease.uid,
            )
            stamps.times.clear()
            start = time.perf_counter()
            box = await backend.create(spec)
            stamps.mark("ready")
            assert isinstance(box, DockerSandbox)
            await first_print(box, next(ids))
            stamps.mark("done")
            sample = stamps.since(start)
            await backend.stop(box)
            bare_ms = await asyncio.to_thread(time_bare, bare_argv, 1, 0)
            if i < 2:
                continue  # warm-ups
            for phase in phases:
                phases[phase].append(sample[phase])
            bare += bare_ms
            log(f"[{backend_name}] {i - 1}/{runs}: {sample['done']:.0f} ms, bare {bare_ms[0]:.0f}")
    finally:
        await backend.aclose()
        lease.release()
        shutil.rmtree(state, ignore_errors=True)
    done = phases["done"]
    after_ready = [d - r for d, r in zip(done, phases["ready"], strict=True)]
    rows = [
        Row(backend_name, f"{what} (since create)", "ms", phases[phase]) for phase, what in PHASES
    ]
    rows.append(Row(backend_name, "agent ready → first result of `print(1)`", "ms", after_ready))
    rows.append(
        Row(
            backend_name,
            "baseline, interleaved: bare `docker run` `print(1)`",
            "ms",
            bare,
            f"first result ÷ this: {_ratio(done, bare, statistics.median)} (median), "
            f"{_ratio(done, bare, p90)} (p90)",
        )
    )
    return rows


def _ratio(ours: list[float], theirs: list[float], stat: Callable[[list[float]], float]) -> str:
    return f"{stat(ours) / stat(theirs):.2f}×"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["docker", "runsc"], default="docker")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--image", default="mcp-code-sandbox:latest")
    args = parser.parse_args(argv)
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    rows = asyncio.run(measure(args.backend, args.image, args.runs))
    end = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print(f"- image: {args.image}\n- loadavg at start: {load}; at end: {end}\n")
    print(markdown_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
