"""The kubernetes backend against the fake cluster (``tests/kube_api.py`` and
``tests/kubelet.py``: the real agent in each pod, as a local process on a 127/8 address),
through the official MCP client over streamable HTTP to real servers
(``serve --transport http``, ``SANDBOX_BACKEND=kubernetes``).

Run by hand, from a checkout (the fakes are the test suite's)::

    .venv/bin/python bench/kubernetes.py [--samples 20] [--pool 2] [--burst 100]
        [--json out.json]

Parts:

1. claim: one server with a warm pool of ``--pool``; per sample, a new session's first
   ``print(1)`` (wall clock at the client around ``call_tool``), after the pool is full
   again (untimed, like closing the sample's session). API writes are counted in the
   fake around each claim: on pods during the call (the claim), and until the pool is
   full again (with the refill's create); the pool Lease's writes (renewals) apart.
   Two untimed samples first.
2. burst: two servers (each its own state directory; one fake cluster) and a pool of
   ``--burst`` warm pods made up front by the bench, which holds the pool's Lease (a
   server's pool size stops at 64, and the Lease's holder keeps the pool at its own); then
   ``--burst`` new sessions at once, each a ``print(1)``, half through each server
   (several clients per server). Reported:
   the wall time of the whole burst, failures, and the double-claim check: every
   session's pod found by its owner and session annotations, every claimed pod's
   session-key label unique, one pod per session; and how many were warm pods.

Progress goes to stderr; the report to stdout (and ``--json``). Nothing is isolated from
other load on the machine: read the load average beside the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from mcp import Client

from bench import PROTOCOL, log

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after bench.py: tests/ too
from mcp_code_sandbox.backends.kubernetes.pool import POOL_LEASE
from mcp_code_sandbox.backends.kubernetes.spec import (
    ANNOTATION_OWNER,
    ANNOTATION_SESSION,
    CLAIMED,
    LABEL_KEY,
    LABEL_POOL,
    warm_pod,
)
from mcp_code_sandbox.settings import load_settings
from tests.e2e.kube_harness import FakeCluster, Server, fake_cluster, ready_warm_pods
from tests.e2e.tenants import client_as, structured

TOKEN = "bench-0123456789abcdef0123"
OWNER = "bench"
#: Untimed claims before the samples (imports, connections, the Lease taken).
WARMUPS = 2
#: Clients per server in the burst: one client's calls share its HTTP connection pool.
CLIENTS_PER_SERVER = 5
FILL_WAIT_S = 600.0


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().split(" (")[0].rsplit(" ", 2)[0]


def pct(samples: list[float], q: int) -> float:
    """The ``q``-th percentile (inclusive interpolation)."""
    return statistics.quantiles(samples, n=100, method="inclusive")[q - 1]


async def until_pool(cluster: FakeCluster, size: int) -> set[str]:
    """Until ``size`` warm pods are ready; their names."""
    deadline = time.monotonic() + FILL_WAIT_S
    while len(ready := ready_warm_pods(cluster)) < size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the pool did not fill: {len(ready)} of {size} ready")
        await asyncio.sleep(0.05)
    return {p["metadata"]["name"] for p in ready}


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of one process so far; 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def agent_pids() -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if b"mcs_agent" in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found


def machine_cpu_s() -> float:
    """CPU seconds every core spent busy so far (all of /proc/stat's but idle, iowait)."""
    ticks = [int(t) for t in Path("/proc/stat").read_text().split("\n")[0].split()[1:8]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def session_pods(cluster: FakeCluster) -> dict[str, list[dict[str, Any]]]:
    """The bench owner's pods by session id."""
    found: dict[str, list[dict[str, Any]]] = {}
    for pod in cluster.list():
        notes = pod["metadata"].get("annotations") or {}
        if notes.get(ANNOTATION_OWNER) == OWNER and not pod["metadata"].get("deletionTimestamp"):
            found.setdefault(notes.get(ANNOTATION_SESSION, ""), []).append(pod)
    return found


def server_env(cluster: FakeCluster, pool: int, sessions: int) -> dict[str, str]:
    return {
        **cluster.server_env(),
        "SANDBOX_API_TOKENS": f"{OWNER}:{TOKEN}",
        "SANDBOX_POOL_SIZE": str(pool),
        "SANDBOX_MAX_SESSIONS": str(sessions),
        "SANDBOX_MAX_SESSIONS_PER_OWNER": str(sessions),
        "SANDBOX_LOG_LEVEL": "INFO",
    }


@contextlib.asynccontextmanager
async def clients(base: str, n: int) -> AsyncIterator[list[Client]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(client_as(base, TOKEN, PROTOCOL)) for _ in range(n)]


async def first_print(client: Client) -> dict[str, Any]:
    out = structured(await client.call_tool("run_code", {"code": "print(1)"}))
    if out["status"] != "ok" or out["stdout"] != "1\n":
        raise AssertionError(f"print(1) did not print 1: {out}")
    return out


# -- 1. claim --------------------------------------------------------------------------


async def claims(cluster: FakeCluster, state: Path, samples: int, pool: int) -> dict[str, Any]:
    api = cluster.api
    times: list[float] = []
    claim_writes: list[int] = []
    refill_writes: list[int] = []
    lease_writes: list[int] = []
    cold = 0
    began, leases_began = time.perf_counter(), api.writes("leases")
    with Server(state, "claim", server_env(cluster, pool, samples + WARMUPS + 2)) as server:
        async with clients(server.base, 1) as [client]:
            for i in range(WARMUPS + samples):
                warm = await until_pool(cluster, pool)
                await asyncio.sleep(0.2)  # the server's view of the pool: the same events
                pods0, leases0 = api.writes("pods"), api.writes("leases")
                started = time.perf_counter()
                out = await first_print(client)
                took = time.perf_counter() - started
                pods1 = api.writes("pods")
                await until_pool(cluster, pool)
                pods2, leases2 = api.writes("pods"), api.writes("leases")
                [pod] = session_pods(cluster)[out["session_id"]]
                structured(
                    await client.call_tool("close_session", {"session_id": out["session_id"]})
                )
                if i < WARMUPS:
                    continue
                times.append(took * 1000)
                claim_writes.append(pods1 - pods0)
                refill_writes.append(pods2 - pods0)
                lease_writes.append(leases2 - leases0)
                cold += pod["metadata"]["name"] not in warm
                log(f"claim {i - WARMUPS + 1}/{samples}: {took * 1000:.1f} ms")
    return {
        "samples": samples,
        "pool": pool,
        "lease_writes_total": api.writes("leases") - leases_began,
        "part_s": round(time.perf_counter() - began, 1),
        "p50_ms": round(statistics.median(times), 1),
        "p90_ms": round(pct(times, 90), 1),
        "min_ms": round(min(times), 1),
        "max_ms": round(max(times), 1),
        "cold_starts": cold,
        "pod_writes_during_call": _spread(claim_writes),
        "pod_writes_until_refilled": _spread(refill_writes),
        "lease_writes_per_sample": _spread(lease_writes),
        "times_ms": [round(t, 2) for t in times],
    }


def _spread(values: list[int]) -> dict[str, float]:
    return {"mean": round(statistics.mean(values), 2), "min": min(values), "max": max(values)}


# -- 2. burst --------------------------------------------------------------------------


def add_warm_pods(cluster: FakeCluster, n: int) -> None:
    """``n`` warm pods, as a server's refill makes them (``spec.warm_pod``), and the pool's
    Lease held by the bench for an hour, so that no server trims the pool to its size."""
    settings = load_settings({"preload": [], "kubernetes_namespace": cluster.namespace}, environ={})
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    lease = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": POOL_LEASE},
        "spec": {
            "holderIdentity": "bench",
            "leaseDurationSeconds": 3600,
            "acquireTime": now,
            "renewTime": now,
        },
    }
    ns = cluster.namespace
    with httpx.Client(base_url=cluster.api.url, trust_env=False, timeout=30) as http:
        path = f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"
        http.post(path, json=lease).raise_for_status()
        for _ in range(n):
            manifest = warm_pod(f"mcp-sandbox-{secrets.token_hex(6)}", settings)
            http.post(f"/api/v1/namespaces/{ns}/pods", json=manifest).raise_for_status()


async def burst(cluster: FakeCluster, state: Path, n: int) -> dict[str, Any]:
    api = cluster.api
    # The pool made up front by the bench, which holds its Lease (a server's
    # SANDBOX_POOL_SIZE stops at 64, and the Lease's holder keeps the pool at its size).
    log(f"burst: filling a pool of {n}")
    filled_at = time.perf_counter()
    add_warm_pods(cluster, n)
    env = server_env(cluster, 0, n + 10)
    with Server(state, "a", env) as a, Server(state, "b", env) as b:
        warm = await until_pool(cluster, n)
        fill_s = time.perf_counter() - filled_at
        async with httpx.AsyncClient(timeout=60) as http:
            for server in (a, b):  # each server's view of the pods: listed, then watched
                (await http.get(f"{server.base}/readyz")).raise_for_status()
        await asyncio.sleep(1.0)  # both views have every pod's last event
        async with (
            clients(a.base, CLIENTS_PER_SERVER) as via_a,
            clients(b.base, CLIENTS_PER_SERVER) as via_b,
        ):
            routes = [c for pair in zip(via_a, via_b, strict=True) for c in pair]
            patches0 = api.counts[("patch", "pods")]
            creates0 = api.counts[("create", "pods")]
            agents = agent_pids()
            cpu0 = {
                "bench process (clients, fake API, fake kubelet)": cpu_s(os.getpid()),
                "servers": cpu_s(a.proc.pid) + cpu_s(b.proc.pid),
                "agents": sum(cpu_s(p) for p in agents),
                "machine (every process)": machine_cpu_s(),
            }
            started = time.perf_counter()
            done = await asyncio.gather(
                *(_timed(routes[i % len(routes)], started) for i in range(n)),
                return_exceptions=True,
            )
            wall = time.perf_counter() - started
            cpu1 = {
                "bench process (clients, fake API, fake kubelet)": cpu_s(os.getpid()),
                "servers": cpu_s(a.proc.pid) + cpu_s(b.proc.pid),
                "agents": sum(cpu_s(p) for p in agents),
                "machine (every process)": machine_cpu_s(),
            }
            patches = api.counts[("patch", "pods")] - patches0
            creates = api.counts[("create", "pods")] - creates0
            failures = [repr(d)[:300] for d in done if isinstance(d, BaseException)]
            outs = [d for d in done if not isinstance(d, BaseException)]
            found = session_pods(cluster)
            sids = [o["session_id"] for o, _ in outs]
            claimed = [
                p
                for p in cluster.list()
                if (p["metadata"].get("labels") or {}).get(LABEL_POOL) == CLAIMED
            ]
            keys = [p["metadata"]["labels"].get(LABEL_KEY) for p in claimed]
            double = (
                len(set(sids)) != len(sids)
                or any(len(found.get(s, [])) != 1 for s in sids)
                or len(set(keys)) != len(keys)
            )
            served = {found[s][0]["metadata"]["name"] for s in sids if found.get(s)}
            log("burst: closing the sessions")
            for i, sid in enumerate(sids):
                with contextlib.suppress(Exception):
                    await routes[i % len(routes)].call_tool("close_session", {"session_id": sid})
    ends = sorted(t for _, t in outs)
    return {
        "sessions": n,
        "servers": 2,
        "pool": n,
        "pool_fill_s": round(fill_s, 1),
        "wall_s": round(wall, 3),
        "call_p50_ms": round(statistics.median(ends) * 1000, 1) if ends else None,
        "failures": len(failures),
        "failure_samples": failures[:5],
        "ran_print": len(outs),
        "double_claims": bool(double),
        "claimed_pods": len(claimed),
        "unique_keys": len(set(keys)),
        "warm_pods_served": len(served & warm),
        "pod_patches": patches,
        "cpu_s_during_burst": {k: round(cpu1[k] - cpu0[k], 2) for k in cpu0},
        "pod_creates_during_burst": creates,
    }


async def _timed(client: Client, started: float) -> tuple[dict[str, Any], float]:
    out = await first_print(client)
    return out, time.perf_counter() - started


# -- main --------------------------------------------------------------------------------


async def main(args: argparse.Namespace) -> dict[str, Any]:
    state = Path(tempfile.mkdtemp(prefix="mcs-bench-k8s-", dir="/var/tmp"))
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "nproc": len(os.sched_getaffinity(0)),
        "loadavg at start": loadavg(),
    }
    try:
        with fake_cluster() as cluster:
            log(f"claim: {args.samples} samples, pool {args.pool}")
            report["claim"] = await claims(cluster, state, args.samples, args.pool)
        with fake_cluster() as cluster:
            report["burst"] = await burst(cluster, state, args.burst)
    finally:
        report["loadavg at end"] = loadavg()
        shutil.rmtree(state, ignore_errors=True)
    return report


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--pool", type=int, default=2)
    parser.add_argument("--burst", type=int, default=100)
    parser.add_argument("--json", type=Path)
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    result = asyncio.run(main(arguments))
    text = json.dumps(result, indent=2)
    print(text)
    if arguments.json:
        arguments.json.write_text(text)
