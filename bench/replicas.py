"""Replicas (issue 25): warm throughput on one replica and on two, and what a handover
costs, through the official MCP client over streamable HTTP, on the docker backend (runc).

Run by hand, like ``bench.py`` (whose helpers it uses), as the user that serves (root on
the reference machine), with the image built::

    .venv/bin/python bench/replicas.py [--clients 40] [--calls 20] [--rounds 4]
        [--handovers 30] [--handover-rounds 3] [--kills 3]
        [--image mcp-code-sandbox:latest] [--json out.json] [--keep]

Two replicas (``serve --transport http --replica``) on one fresh state directory, one API
token for every client. Parts:

1. throughput: ``--clients`` clients, each with its own session (one call first, untimed,
   to warm it), then ``--calls`` warm ``1+1`` calls each, all at once: every client on
   replica A ("one replica"), then half on A and half on B ("two replicas"), each client
   always on the same replica. The two alternate for ``--rounds`` rounds (ABBA order),
   so both see the same load; a warm-up call starts each phase (it hands the session
   over when the previous phase had it on the other replica), so the timed calls hand
   nothing over. The CPU the timed calls cost is given per call: the clients (this
   process, on the same cores), the replicas' processes, and the whole machine's.
2. handover: one session, ``--handovers`` warm ``1+1`` calls alternating between A and B
   (each lands on the replica that did not serve the previous one: a handover) beside as
   many calls all to A, in ``--handover-rounds`` rounds.
3. take-over from a dead replica: the session's holder is SIGKILLed, the next call goes to
   the other replica (timed), a new replica replaces the dead one; ``--kills`` times.

Every session is closed at the end through the servers; then the replicas stop and
whatever is left of this state directory's (containers, mounts) is removed, also on
Ctrl-C or SIGTERM. Other containers on the engine are never touched.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from bench import PROTOCOL, loadavg, log, machine_facts, make_state_dir, server_env

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after bench.py: tests/ too
from tests.procs import remove_containers_of

TOKEN = "bench-0123456789abcdef0123"
WARM = "1+1"
#: Each client's own session, and room for the handover part's and a few more.
MAX_SESSIONS_SLACK = 10
START_S = 60.0
STOP_S = 60.0


# -- the replicas ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Replica:
    """One replica's process (its own process group: Ctrl-C reaches the bench only, which
    stops the replicas in order), its base URL and its log in the state directory."""

    def __init__(self, state_dir: Path, name: str, env: dict[str, str]) -> None:
        self.name = name
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = state_dir / f"{name}.log"
        argv = [sys.executable, "-m", "mcp_code_sandbox", "serve", "--transport", "http"]
        argv += ["--port", str(self.port), "--replica"]
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                argv, env=env, stdout=subprocess.DEVNULL, stderr=out, start_new_session=True
            )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_S
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.base}/readyz", timeout=5).status_code == 200:
                    return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"replica {self.name} did not start: {tail}")
            time.sleep(0.1)

    def handovers_in(self) -> float:
        """Sessions this replica took over so far (its ``/metrics``)."""
        text = httpx.get(f"{self.base}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith("mcp_sandbox_handovers_total") and 'direction="in"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=STOP_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


class Replicas:
    """The replicas started so far on one state directory, and their cleanup."""

    def __init__(self, state_dir: Path, image: str, max_sessions: int) -> None:
        self.state_dir = state_dir
        self.env = server_env(state_dir, None, "docker", image) | {
            "SANDBOX_API_TOKENS": f"bench:{TOKEN}",
            "SANDBOX_MAX_SESSIONS": str(max_sessions),
            "SANDBOX_MAX_SESSIONS_PER_OWNER": str(max_sessions),
            # No warm pool: its refills would run beside the timed calls.
            "SANDBOX_POOL_SIZE": "0",
        }
        self.started: list[Replica] = []
        self.count = 0

    def start(self) -> Replica:
        self.count += 1
        replica = Replica(self.state_dir, f"replica-{self.count}", self.env)
        self.started.append(replica)
        replica.wait_ready()
        return replica

    def close(self) -> None:
        for replica in self.started:
            with contextlib.suppress(Exception):
                replica.stop()
        remove_leftovers(self.state_dir)


def remove_leftovers(state_dir: Path) -> None:
    """What the replicas left of this state directory: its sessions' containers (a replica
    that stops leaves them running for the others) and its workspaces' mounts. Only
    containers with a mount under ``state_dir``: never another server's."""
    remove_containers_of(state_dir)
    with open("/proc/self/mountinfo") as info:
        points = [line.split()[4] for line in info]
    for point in reversed(points):
        if point.startswith(f"{state_dir}/"):
            subprocess.run(["umount", "--lazy", point], capture_output=True, check=False)


# -- clients and statistics -------------------------------------------------------------


@contextlib.asynccontextmanager
async def client_to(replica: Replica) -> AsyncIterator[Client]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with create_mcp_http_client(headers=headers) as http:
        transport = streamable_http_client(f"{replica.base}/mcp", http_client=http)
        async with Client(transport, mode=PROTOCOL) as client:
            yield client


async def run(client: Client, session_id: str, code: str = WARM) -> dict[str, Any]:
    result = await client.call_tool("run_code", {"code": code, "session_id": session_id})
    content = result.structured_content
    if result.is_error or not isinstance(content, dict) or content.get("status") != "ok":
        text = " ".join(getattr(c, "text", "") for c in result.content)
        raise RuntimeError(f"run_code in {session_id}: {content or text[:500]}")
    return content


async def timed(client: Client, session_id: str) -> float:
    start = time.perf_counter()
    content = await run(client, session_id)
    ms = (time.perf_counter() - start) * 1000
    if content.get("result") != "2":
        raise RuntimeError(f"1+1 in {session_id}: {content}")
    return ms


def p95(samples: list[float]) -> float:
    """95th percentile, linear interpolation between closest ranks (inclusive)."""
    if len(samples) == 1:
        return samples[0]
    return statistics.quantiles(samples, n=20, method="inclusive")[-1]


@dataclass
class Phase:
    name: str
    latencies_ms: list[float] = field(default_factory=list)
    walls_s: list[float] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)
    handovers: float = 0.0
    #: CPU seconds during the timed calls: this process (the clients), the replicas'
    #: processes, and the whole machine (the sandboxes and everyone else included).
    cpu_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CPU_PARTS, 0.0))

    @property
    def rates(self) -> list[float]:
        return [n / wall for n, wall in zip(self.calls, self.walls_s, strict=True)]

    def cpu_ms_per_call(self) -> str:
        calls = sum(self.calls)
        return ", ".join(f"{k} {v / calls * 1000:.1f}" for k, v in self.cpu_s.items())


CPU_PARTS = ("clients", "replicas", "machine")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _process_cpu_s(pid: int) -> float:
    with contextlib.suppress(OSError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime
    return 0.0


def cpu_now(replicas: list[Replica]) -> dict[str, float]:
    """CPU seconds so far, per part of :data:`CPU_PARTS` (the machine: every CPU's busy time)."""
    jiffies = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    busy = sum(jiffies) - jiffies[3] - jiffies[4]  # all but idle and iowait
    return {
        "clients": time.process_time(),
        "replicas": sum(_process_cpu_s(r.proc.pid) for r in replicas),
        "machine": busy / CLOCK_TICKS,
    }


# -- the measurements -------------------------------------------------------------------


async def throughput(
    a: Replica, b: Replica, args: argparse.Namespace
) -> tuple[Phase, Phase, float]:
    """Part 1; also the wall time of the first calls (the sessions' starts)."""
    one, two = Phase("one replica"), Phase("two replicas")
    sessions = [f"client-{i}" for i in range(args.clients)]
    async with contextlib.AsyncExitStack() as stack:
        on_a = [await stack.enter_async_context(client_to(a)) for _ in sessions]
        on_b = [await stack.enter_async_context(client_to(b)) for _ in sessions[1::2]]
        # Two replicas: the even clients on A, the odd ones on B.
        split = [on_a[i] if i % 2 == 0 else on_b[i // 2] for i in range(len(sessions))]
        log(f"starting {len(sessions)} sessions on {a.name}")
        start = time.perf_counter()
        await asyncio.gather(*(run(c, s) for c, s in zip(on_a, sessions, strict=True)))
        started_s = time.perf_counter() - start
        for r in range(args.rounds):
            # ABBA: neither goes first every round (the machine settles after the starts).
            order = [(one, on_a), (two, split)]
            for phase, clients in order if r % 4 in (0, 3) else order[::-1]:
                log(f"round {r + 1}/{args.rounds}: {phase.name}")
                pairs = list(zip(clients, sessions, strict=True))
                # The warm-up: hands over the sessions the last phase had on the other.
                await asyncio.gather(*(run(c, s) for c, s in pairs))
                before = a.handovers_in() + b.handovers_in()
                cpu = cpu_now([a, b])
                start = time.perf_counter()
                per_client = await asyncio.gather(*(_calls(c, s, args.calls) for c, s in pairs))
                phase.walls_s.append(time.perf_counter() - start)
                for part, value in cpu_now([a, b]).items():
                    phase.cpu_s[part] += value - cpu[part]
                phase.handovers += a.handovers_in() + b.handovers_in() - before
                phase.calls.append(sum(len(x) for x in per_client))
                phase.latencies_ms += [ms for x in per_client for ms in x]
        log("closing the sessions")
        await asyncio.gather(
            *(
                c.call_tool("close_session", {"session_id": s})
                for c, s in zip(split, sessions, strict=True)
            )
        )
    return one, two, started_s


async def _calls(client: Client, session_id: str, count: int) -> list[float]:
    return [await timed(client, session_id) for _ in range(count)]


async def handover(a: Replica, b: Replica, args: argparse.Namespace) -> tuple[Phase, Phase]:
    """Part 2: one session, alternating between A and B, beside all calls to A."""
    same, alternating = Phase("same replica"), Phase("alternating")
    async with client_to(a) as via_a, client_to(b) as via_b:
        for _ in range(3):
            await run(via_a, "h")
        for r in range(args.handover_rounds):
            log(f"handover round {r + 1}/{args.handover_rounds}")
            for phase, order in ((same, (via_a, via_a)), (alternating, (via_b, via_a))):
                await run(via_a, "h")  # A holds it: the first alternating call goes to B
                before = a.handovers_in() + b.handovers_in()
                for i in range(args.handovers):
                    phase.latencies_ms.append(await timed(order[i % 2], "h"))
                phase.handovers += a.handovers_in() + b.handovers_in() - before
                phase.calls.append(args.handovers)
        await via_a.call_tool("close_session", {"session_id": "h"})
    return same, alternating


async def dead_holder(replicas: Replicas, a: Replica, b: Replica, kills: int) -> list[float]:
    """Part 3: the first call after the session's holder was SIGKILLed, on the other."""
    samples: list[float] = []
    holder, other = a, b
    for k in range(kills):
        log(f"SIGKILL {k + 1}/{kills}")
        async with client_to(holder) as via_holder:
            await run(via_holder, "d")
            await run(via_holder, "d")
        async with client_to(other) as via_other:
            holder.kill()
            samples.append(await timed(via_other, "d"))
            await run(via_other, "d")
        # A new replica in the dead one's place; the survivor holds the session now.
        holder, other = other, await asyncio.to_thread(replicas.start)
    async with client_to(holder) as via_holder:
        await via_holder.call_tool("close_session", {"session_id": "d"})
    return samples


# -- the report -------------------------------------------------------------------------


def ms(value: float) -> str:
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def table(one: Phase, two: Phase, same: Phase, alt: Phase, dead: list[float], clients: int) -> str:
    lines = [
        "| what | calls | calls/s | p50 ms | p95 ms | notes |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for phase in (one, two):
        rates = ", ".join(f"{r:.0f}" for r in phase.rates)
        lines.append(
            f"| warm `1+1`, {clients} clients, {phase.name} | {sum(phase.calls)} "
            f"| {statistics.median(phase.rates):.0f} | {ms(statistics.median(phase.latencies_ms))} "
            f"| {ms(p95(phase.latencies_ms))} | calls/s per round: {rates}; "
            f"handovers in timed calls: {phase.handovers:.0f}; "
            f"CPU ms per call: {phase.cpu_ms_per_call()} |"
        )
    for phase, what in ((same, "all to one replica (no handover)"),
                        (alt, "alternating between two (each a handover)")):  # fmt: skip
        lines.append(
            f"| one session, {what} | {sum(phase.calls)} | | "
            f"{ms(statistics.median(phase.latencies_ms))} | {ms(p95(phase.latencies_ms))} "
            f"| handovers counted: {phase.handovers:.0f} |"
        )
    d50 = statistics.median(alt.latencies_ms) - statistics.median(same.latencies_ms)
    d95 = p95(alt.latencies_ms) - p95(same.latencies_ms)
    lines.append(
        f"| a handover's extra latency (alternating − same) | | | {ms(d50)} | {ms(d95)} | |"
    )
    if dead:
        each = ", ".join(ms(x) for x in dead)
        lines.append(
            f"| first call after the holder was SIGKILLed | {len(dead)} | | "
            f"{ms(statistics.median(dead))} | {ms(max(dead))} (max) | each: {each} ms |"
        )
    return "\n".join(lines)


async def measure(replicas: Replicas, args: argparse.Namespace) -> dict[str, Any]:
    a = await asyncio.to_thread(replicas.start)
    b = await asyncio.to_thread(replicas.start)
    one, two, started_s = await throughput(a, b, args)
    same, alt = await handover(a, b, args)
    dead = await dead_holder(replicas, a, b, args.kills) if args.kills else []
    return {"one": one, "two": two, "started_s": started_s, "same": same, "alt": alt,
            "dead": dead}  # fmt: skip


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # SIGTERM cleans up as Ctrl-C does


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=40)
    parser.add_argument("--calls", type=int, default=20, help="timed calls per client, per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--handovers", type=int, default=30, help="calls per handover round")
    parser.add_argument("--handover-rounds", type=int, default=3)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--image", default="mcp-code-sandbox:latest")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--keep", action="store_true", help="keep the state dir (the logs)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _interrupt)
    facts = machine_facts(["docker"], args.image)
    state_dir = make_state_dir()
    replicas = Replicas(state_dir, args.image, args.clients + MAX_SESSIONS_SLACK)
    log(f"state dir {state_dir}")
    try:
        found = asyncio.run(measure(replicas, args))
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C: still clean up
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        log("stopping the replicas, removing what is left")
        replicas.close()
        if not args.keep:
            shutil.rmtree(state_dir, ignore_errors=True)
    load_end = loadavg()
    if args.json:
        data = {k: asdict(v) if isinstance(v, Phase) else v for k, v in found.items()}
        args.json.write_text(json.dumps(data | {"facts": facts}, indent=1))
    print("\n".join(f"- {k}: {v}" for k, v in facts.items()))
    print(f"- loadavg (1/5/15 min) at the end: {load_end}")
    print(f"- {args.clients} sessions started at once (the untimed first calls): "
          f"{found['started_s']:.1f} s\n")  # fmt: skip
    print(table(found["one"], found["two"], found["same"], found["alt"], found["dead"],
                args.clients))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
