"""Benchmark of mcp-code-sandbox through the official MCP client (DESIGN §12).

Run by hand, as root or as the user that serves (bwrap and the runtime env for ``bwrap``;
a Docker engine with runc and runsc and the image for ``docker``/``runsc``)::

    .venv/bin/python bench/bench.py [--backend bwrap|docker|runsc|all] [--runs 20]
        [--json out.json] [--server-log server.log]

Per backend it starts the real server (``python -m mcp_code_sandbox serve`` over stdio) on
a fresh state directory, measures each metric ``--runs`` times, then the baselines of that
backend (raw bwrap; ``docker run`` and ``docker exec`` on the same engine and image) and,
for the Docker backends, the peer llm-sandbox (run by ``llm_sandbox_peer.py`` in its own
venv). It prints one Markdown table (median and p90) and the ratios to stdout; progress
goes to stderr. See bench/README.md for the rows.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mcp import Client, StdioServerParameters

from mcp_code_sandbox.backends.bwrap.argv import minimal_argv
from mcp_code_sandbox.layout import SANDBOX_PYTHON, SANDBOX_VENV

RUNTIME_DIR = Path(os.environ.get("SANDBOX_RUNTIME_DIR", "/var/lib/mcp-code-sandbox/runtime"))
HERE = Path(__file__).resolve().parent
BACKENDS = ("bwrap", "docker", "runsc")
#: backend name of this bench → (SANDBOX_BACKEND, SANDBOX_DOCKER_RUNTIME)
SERVER_BACKEND = {
    "bwrap": ("bwrap", None),
    "docker": ("docker", "runc"),
    "runsc": ("docker", "runsc"),
}
IMAGE_PYTHON = "/opt/sandbox/venv/bin/python"
LABEL_INSTANCE = "mcp-code-sandbox.instance"
LABEL_SESSION = "mcp-code-sandbox.session"
#: Docker's own variables (engine address, TLS), passed through to the server as they are.
DOCKER_ENV = ("DOCKER_HOST", "DOCKER_TLS_VERIFY", "DOCKER_CERT_PATH", "DOCKER_CONFIG")
PROTOCOL = "2026-07-28"
PARALLEL = 10
MEMORY_SESSIONS = 5
PANDAS_ROWS = 1_000_000
SETUP_FRAME = (
    "import time\n"
    "import numpy as np\n"
    "import pandas as pd\n"
    f"df = pd.DataFrame({{'k': np.random.randint(0, 1000, {PANDAS_ROWS}),"
    f" 'v': np.random.rand({PANDAS_ROWS})}})\n"
    "len(df)"
)
PRINTED_LINES = 200_000
#: 200,000 print() calls (2.3 MB), and the same text in one write: the cost per write.
PRINTS = f"for i in range({PRINTED_LINES}):\n    print(f'line {{i}}')"
ONE_WRITE = (
    f"import sys\nsys.stdout.write(''.join(f'line {{i}}\\n' for i in range({PRINTED_LINES})))\nNone"
)
GROUPBY = (
    "_t0 = time.perf_counter()\n"
    "_r = df.groupby('k')['v'].mean().sum()\n"
    "print(f'{time.perf_counter() - _t0:.9f}')\n"
    "_r"
)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- statistics and the report ---------------------------------------------------------


def p90(samples: list[float]) -> float:
    """90th percentile, linear interpolation between closest ranks (inclusive)."""
    if len(samples) == 1:
        return samples[0]
    return statistics.quantiles(samples, n=10, method="inclusive")[-1]


@dataclass
class Row:
    backend: str
    metric: str
    unit: str  # "ms" or "MiB"
    samples: list[float]
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def p90(self) -> float:
        return p90(self.samples)

    def cells(self) -> list[str]:
        def fmt(value: float) -> str:
            return f"{value:.1f} {self.unit}" if value >= 10 else f"{value:.2f} {self.unit}"

        return [
            self.backend,
            self.metric,
            fmt(self.median),
            fmt(self.p90),
            str(len(self.samples)),
            self.notes,
        ]


def markdown_table(rows: list[Row]) -> str:
    lines = [
        "| backend | metric | median | p90 | n | notes |",
        "|---|---|---:|---:|---:|---|",
    ]
    lines += ["| " + " | ".join(row.cells()) + " |" for row in rows]
    return "\n".join(lines)


# -- machine facts ---------------------------------------------------------------------


def _first_line(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unavailable ({exc})"
    return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr) else "?"


def cgroup_version(root: Path = Path("/sys/fs/cgroup")) -> str:
    fstype = _first_line(["stat", "-fc", "%T", str(root)])
    if fstype == "cgroup2fs":
        return "v2 (unified)"
    if (root / "unified").is_dir():
        return "hybrid (v1 controllers, v2 at /sys/fs/cgroup/unified)"
    return "v1"


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def mem_total() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    return "?"


def loadavg() -> str:
    with contextlib.suppress(OSError):
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return "?"


def report(rows: list[Row], facts: dict[str, str], json_path: Path | None) -> None:
    """A bench's end: its samples to ``json_path`` first (they survive a failure to
    print), then the machine's facts with the load now, and the table."""
    if json_path is not None:
        json_path.write_text(json.dumps([r.__dict__ for r in rows], indent=1))
    print("\n".join(f"- {k}: {v}" for k, v in facts.items()))
    print(f"- loadavg (1/5/15 min) at the end: {loadavg()}\n")
    print(markdown_table(rows))


def machine_facts(backends: list[str], image: str) -> dict[str, str]:
    runtime_python = RUNTIME_DIR / "venv" / "bin" / "python"
    facts = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "nproc": str(len(os.sched_getaffinity(0))),
        "cpu": cpu_model(),
        "memory": mem_total(),
        "kernel": platform.release(),
        "cgroup": cgroup_version(),
        "server python": platform.python_version(),
        "user": f"uid {os.geteuid()}",
        "backends": ", ".join(backends),
        "loadavg (1/5/15 min) at start": loadavg(),
    }
    if "bwrap" in backends:
        facts["bwrap"] = _first_line(["bwrap", "--version"])
        facts["runtime python"] = _first_line([str(runtime_python), "--version"])
    if set(backends) & {"docker", "runsc"}:
        facts["docker engine"] = _first_line(
            ["docker", "version", "--format", "{{.Server.Version}}"]
        )
        facts["docker runtimes"] = _first_line(
            ["docker", "info", "--format", "{{range $k, $v := .Runtimes}}{{$k}} {{end}}"]
        )
        facts["runsc"] = _first_line(["runsc", "--version"])
        facts["image"] = (
            image + " " + _first_line(["docker", "image", "inspect", "--format", "{{.Id}}", image])
        )
    return facts


# -- the server and its processes ------------------------------------------------------


def make_state_dir() -> Path:
    path = Path(tempfile.mkdtemp(prefix="mcs-bench-", dir="/var/tmp"))
    path.chmod(0o711)  # the sandbox uid must traverse it to its workspace
    return path


def server_env(
    state_dir: Path, server_log: Path | None, backend: str, image: str
) -> dict[str, str]:
    server_backend, docker_runtime = SERVER_BACKEND[backend]
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "SANDBOX_STATE_DIR": str(state_dir),
        "SANDBOX_RUNTIME_DIR": str(RUNTIME_DIR),
        "SANDBOX_BACKEND": server_backend,
        "SANDBOX_MAX_SESSIONS": "64",
        "SANDBOX_LOG_LEVEL": "WARNING",
        # The rows here measure the cold path: no warm pool (a setting unknown to a
        # server without one is ignored).
        "SANDBOX_POOL_SIZE": "0",
    }
    if docker_runtime is not None:
        env |= {"SANDBOX_DOCKER_RUNTIME": docker_runtime, "SANDBOX_IMAGE": image}
        env |= {k: os.environ[k] for k in DOCKER_ENV if k in os.environ}
    if server_log is not None:
        env |= {"SANDBOX_LOG_LEVEL": "DEBUG", "SANDBOX_LOG_FILE": str(server_log)}
    return env


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def _environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


def find_server(state_dir: Path) -> int:
    """The server process: our descendant running ``mcp_code_sandbox serve`` on state_dir."""
    tree = _children()
    marker = f"SANDBOX_STATE_DIR={state_dir}".encode()
    todo = list(tree.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        if "mcp_code_sandbox serve" in _cmdline(pid) and marker in _environ(pid).split(b"\0"):
            return pid
        todo += tree.get(pid, [])
    raise RuntimeError("server process not found")


def descendants(pid: int) -> list[int]:
    tree = _children()
    out: list[int] = []
    todo = list(tree.get(pid, []))
    while todo:
        child = todo.pop()
        out.append(child)
        todo += tree.get(child, [])
    return sorted(out)


def pss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    raise RuntimeError(f"no Pss in /proc/{pid}/smaps_rollup")


def process_role(cmdline: str) -> str:
    if cmdline.startswith(("/sbin/docker-init", "docker-init")):
        return "docker-init"
    if "mcs_agent.kernel" in cmdline or "ipykernel" in cmdline:
        return "kernel"
    if "mcs_agent" in cmdline and not cmdline.startswith(("/usr/bin/bwrap", "bwrap")):
        return "agent"
    if cmdline.startswith(("/usr/bin/bwrap", "bwrap")):
        return "bwrap"
    return os.path.basename(cmdline.split(" ", 1)[0]) or "?"


# -- the measurements ------------------------------------------------------------------


class Bench:
    def __init__(
        self, client: Client, runs: int, backend: str, bare: tuple[str, list[str]] | None = None
    ) -> None:
        self.client = client
        self.runs = runs
        self.backend = backend
        #: The bare baseline of a new session, as (its name, its argv), timed between our
        #: samples (:meth:`new_session`) so that both see the same load.
        self.bare = bare

    def row(
        self,
        metric: str,
        unit: str,
        samples: list[float],
        notes: str = "",
        extra: dict[str, Any] | None = None,
    ) -> Row:
        return Row(self.backend, metric, unit, samples, notes, extra or {})

    async def call(self, tool: str, **arguments: Any) -> dict[str, Any]:
        result = await self.client.call_tool(tool, arguments)
        content = result.structured_content
        if result.is_error or not isinstance(content, dict):
            text = " ".join(getattr(c, "text", "") for c in result.content)
            raise RuntimeError(f"{tool} failed: {text[:500]}")
        if tool == "run_code" and content.get("status") != "ok":
            raise RuntimeError(f"run_code: {content.get('status')}: {content.get('error')}")
        return content

    async def run(self, code: str, session_id: str | None = None) -> dict[str, Any]:
        args: dict[str, Any] = {"code": code}
        if session_id is not None:
            args["session_id"] = session_id
        return await self.call("run_code", **args)

    async def timed(self, make: Callable[[], Awaitable[Any]]) -> tuple[float, Any]:
        start = time.perf_counter()
        value = await make()
        return (time.perf_counter() - start) * 1000, value

    async def new_session(self) -> tuple[Row, Row, list[Row]]:
        # The very first sandbox of a server pays one-off costs (imports, host probe,
        # page cache): measured once and reported apart from the steady state.
        first_ms, content = await self.timed(lambda: self.run("print(1)"))
        await self.call("close_session", session_id=content["session_id"])
        if self.bare is not None:
            time_command(self.bare[1], 0)  # its two warm-ups
        samples: list[float] = []
        server_ms: list[float] = []
        bare_ms: list[float] = []
        for _ in range(self.runs):
            ms, content = await self.timed(lambda: self.run("print(1)"))
            assert content["stdout"] == "1\n" and content["session_created"], content
            samples.append(ms)
            server_ms.append(float(content["duration_ms"]))
            await self.call("close_session", session_id=content["session_id"])
            if self.bare is not None:  # the server is idle now: one bare sample
                bare_ms += await asyncio.to_thread(time_command, self.bare[1], 1, 0)
        row = self.row(
            "new session → first result of `print(1)`, cold (pool off)",
            "ms",
            samples,
            f"no pool; server's duration_ms median {statistics.median(server_ms):.0f} ms",
            {"server_duration_ms": server_ms},
        )
        first = self.row(
            "first new session of a fresh server",
            "ms",
            [first_ms],
            "one-off, excluded from the row above",
        )
        bare = []
        if self.bare is not None:
            bare.append(
                self.row(
                    f"baseline, interleaved: {self.bare[0]}",
                    "ms",
                    bare_ms,
                    "one sample after each of the row above's, same load; "
                    f"ours ÷ this: {statistics.median(samples) / statistics.median(bare_ms):.2f}× "
                    f"(median), {p90(samples) / p90(bare_ms):.2f}× (p90)",
                )
            )
        return row, first, bare

    async def _sdk_round_trip(self) -> Any:
        return await self.client.list_prompts(cache_mode="bypass")

    async def warm(self) -> list[Row]:
        """The warm ``1+1`` round trip beside its two floors, one of each in turn per
        sample (same load): ``list_runtimes`` (a tool call that starts no sandbox) and
        the SDK's own round trip (``prompts/list``, answered by the SDK alone: this
        server has no prompts; the client's cache bypassed)."""
        sid = (await self.run("print(1)"))["session_id"]
        for _ in range(3):
            await self.run("1+1", sid)
            await self.call("list_runtimes")
        samples: list[float] = []
        server_ms: list[float] = []
        runtimes: list[float] = []
        sdk: list[float] = []
        for _ in range(self.runs):
            ms, content = await self.timed(lambda: self.run("1+1", sid))
            assert content["result"] == "2", content
            samples.append(ms)
            server_ms.append(float(content["duration_ms"]))
            runtimes.append((await self.timed(lambda: self.call("list_runtimes")))[0])
            sdk.append((await self.timed(self._sdk_round_trip))[0])
        await self.call("close_session", session_id=sid)
        return [
            self.row(
                "warm round trip of `1+1` over stdio",
                "ms",
                samples,
                f"cell's own time ≈ 0; server's duration_ms median "
                f"{statistics.median(server_ms):.0f} ms; over the SDK's round trip: "
                f"{statistics.median(samples) - statistics.median(sdk):.2f} ms (medians)",
                {"server_duration_ms": server_ms},
            ),
            self.row(
                "reference: `list_runtimes` round trip over stdio",
                "ms",
                runtimes,
                "a tool call that touches no sandbox, interleaved with the row above",
            ),
            self.row(
                "reference: the SDK's own round trip (`prompts/list`) over stdio",
                "ms",
                sdk,
                "answered by the SDK alone (no prompts), client cache bypassed; interleaved",
            ),
        ]

    async def pandas(self) -> Row:
        sid = (await self.run(SETUP_FRAME))["session_id"]
        await self.run(GROUPBY, sid)  # warm-up
        samples: list[float] = []
        cell_ms: list[float] = []
        for _ in range(self.runs):
            ms, content = await self.timed(lambda: self.run(GROUPBY, sid))
            samples.append(ms)
            cell_ms.append(float(content["stdout"].strip()) * 1000)
        await self.call("close_session", session_id=sid)
        overhead = [total - cell for total, cell in zip(samples, cell_ms, strict=True)]
        return self.row(
            f"pandas groupby-mean over {PANDAS_ROWS:,} rows",
            "ms",
            samples,
            f"cell's own time median {statistics.median(cell_ms):.1f} ms / p90 "
            f"{p90(cell_ms):.1f} ms; overhead median {statistics.median(overhead):.1f} ms / "
            f"p90 {p90(overhead):.1f} ms",
            {"cell_ms": cell_ms, "overhead_ms": overhead},
        )

    async def prints(self) -> list[Row]:
        """200,000 ``print()`` lines, and beside each sample the same text in one write."""
        sid = (await self.run("1"))["session_id"]
        last = f"line {PRINTED_LINES - 1}\n"
        for code in (PRINTS, ONE_WRITE):  # warm-up
            await self.run(code, sid)
        samples: list[float] = []
        baseline: list[float] = []
        for _ in range(self.runs):
            ms, content = await self.timed(lambda: self.run(PRINTS, sid))
            assert content["stdout_truncated"] and content["stdout"].endswith(last), content
            samples.append(ms)
            ms, content = await self.timed(lambda: self.run(ONE_WRITE, sid))
            assert content["stdout"].endswith(last), content
            baseline.append(ms)
        await self.call("close_session", session_id=sid)
        return [
            self.row(
                f"{PRINTED_LINES:,} printed lines",
                "ms",
                samples,
                f"`print(f'line {{i}}')` ×{PRINTED_LINES:,} (2.3 MB; output cut to the budget, "
                "saved whole under .outputs/); baseline in the next row, sampled alternately",
            ),
            self.row(
                "baseline: the same 2.3 MB in one write",
                "ms",
                baseline,
                "`sys.stdout.write(<the same text>)`: the cost per byte, not per write",
            ),
        ]

    async def parallel(self) -> Row:
        samples: list[float] = []
        for _ in range(self.runs):
            ms, contents = await self.timed(
                lambda: asyncio.gather(*(self.run("print(1)") for _ in range(PARALLEL)))
            )
            assert all(c["stdout"] == "1\n" for c in contents)
            samples.append(ms)
            await asyncio.gather(
                *(self.call("close_session", session_id=c["session_id"]) for c in contents)
            )
        return self.row(
            f"{PARALLEL} new sessions in parallel (wall time of the batch)",
            "ms",
            samples,
            f"{PARALLEL} concurrent `print(1)` without session_id; one sample = one batch",
        )

    async def memory(self, state_dir: Path) -> tuple[list[Row], list[dict[str, Any]]]:
        sids = [
            (await self.run("import pandas as pd\nimport numpy as np"))["session_id"]
            for _ in range(MEMORY_SESSIONS)
        ]
        await asyncio.sleep(1.0)  # let the agents settle
        server = find_server(state_dir)
        server_kib = pss_kib(server)
        try:
            if self.backend == "bwrap":
                return self._memory_bwrap(server, server_kib), process_list(descendants(server))
            return self._memory_docker(server, server_kib, set(sids))
        finally:
            for sid in sids:
                await self.call("close_session", session_id=sid)

    def _memory_bwrap(self, server: int, server_kib: int) -> list[Row]:
        procs = process_list(descendants(server))
        per_session = sum(p["pss_kib"] for p in procs) / 1024 / MEMORY_SESSIONS
        return [
            self.row(
                "idle memory per session, pandas imported (PSS)",
                "MiB",
                [per_session],
                f"{MEMORY_SESSIONS} sessions, {len(procs)} processes; per process MiB: "
                f"{role_breakdown(procs)}; server itself {server_kib / 1024:.1f} MiB, not counted",
                {"processes": procs, "server_pss_kib": server_kib},
            )
        ]

    def _memory_docker(
        self, server: int, server_kib: int, sids: set[str]
    ) -> tuple[list[Row], list[dict[str, Any]]]:
        containers = our_containers(server, sids)
        if len(containers) != MEMORY_SESSIONS:
            raise RuntimeError(f"expected {MEMORY_SESSIONS} containers, found {containers}")
        stats = docker_stats_mib(list(containers))
        procs: list[dict[str, Any]] = []
        cgroup: dict[str, dict[str, int]] = {}
        shim_kib: list[int] = []
        for cid in containers:
            cgroup[cid] = memory_cgroup(cid)
            procs += [p | {"container": cid[:12]} for p in process_list(cgroup_pids(cid))]
            with contextlib.suppress(OSError, ValueError, RuntimeError):
                shim_kib.append(pss_kib(shim_pid(cid)))
        n = len(containers)
        pss_per = sum(p["pss_kib"] for p in procs) / 1024 / n
        usage_per = sum(c["usage"] for c in cgroup.values()) / 1024**2 / n
        rss_per = sum(c["total_rss"] for c in cgroup.values()) / 1024**2 / n
        cache_per = sum(c["total_cache"] for c in cgroup.values()) / 1024**2 / n
        shim = f"{sum(shim_kib) / len(shim_kib) / 1024:.1f}" if shim_kib else "?"
        extra = {
            "processes": procs,
            "server_pss_kib": server_kib,
            "docker_stats_mib": stats,
            "cgroup": cgroup,
            "shim_pss_kib": shim_kib,
        }
        return [
            self.row(
                "idle memory per session, pandas imported (`docker stats`)",
                "MiB",
                list(stats.values()),
                f"MEM USAGE of `docker stats --no-stream` (cgroup v1: usage − inactive_file) "
                f"of the {n} containers labelled {LABEL_INSTANCE} = this server; one sample "
                f"per container; cgroup memory.usage_in_bytes mean {usage_per:.1f} MiB "
                f"(total_rss {rss_per:.1f} + total_cache {cache_per:.1f})",
                extra,
            ),
            self.row(
                "idle memory per session, pandas imported (PSS)",
                "MiB",
                [pss_per],
                f"PSS of the {len(procs)} processes in the containers' memory cgroups "
                f"(cgroup.procs), summed / {n}; per process MiB: {role_breakdown(procs)}; "
                f"not counted: containerd-shim per container ≈ {shim} MiB, "
                f"server itself {server_kib / 1024:.1f} MiB",
            ),
        ], procs


def process_list(pids: list[int]) -> list[dict[str, Any]]:
    procs: list[dict[str, Any]] = []
    for pid in pids:
        cmdline = _cmdline(pid)
        role = process_role(cmdline) if cmdline else f"[{_comm(pid)}]"  # e.g. gVisor stubs
        with contextlib.suppress(OSError, RuntimeError):
            procs.append({"pid": pid, "role": role, "pss_kib": pss_kib(pid)})
    return procs


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def role_breakdown(procs: list[dict[str, Any]]) -> str:
    by_role: dict[str, list[int]] = {}
    for p in procs:
        by_role.setdefault(p["role"], []).append(p["pss_kib"])
    return ", ".join(
        f"{role} ×{len(v)} ≈ {sum(v) / len(v) / 1024:.1f}" for role, v in by_role.items()
    )


# -- Docker ----------------------------------------------------------------------------


def docker(*args: str, timeout: float = 120) -> str:
    out = subprocess.run(
        ["docker", *args], capture_output=True, text=True, check=False, timeout=timeout
    )
    if out.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:3])} failed: {out.stderr.strip()[-500:]}")
    return out.stdout


def our_containers(server: int, sids: set[str]) -> dict[str, str]:
    """Full id → session id of the running containers of this server's sessions ``sids``.

    The backend labels each container with its server instance (``host-pid-random``) and
    session id; other servers on this engine (test suites) have other instances.
    """
    # ``<host>-<pid>.<start time>-<random>`` (or, before the start time was added to it,
    # ``<host>-<pid>-<random>``).
    prefixes = (f"{socket.gethostname()}-{server}.", f"{socket.gethostname()}-{server}-")
    listing = docker(
        "ps",
        "--no-trunc",
        "--filter",
        f"label={LABEL_INSTANCE}",
        "--format",
        f'{{{{.ID}}}}\t{{{{.Label "{LABEL_INSTANCE}"}}}}\t{{{{.Label "{LABEL_SESSION}"}}}}',
    )
    found: dict[str, str] = {}
    for line in listing.splitlines():
        cid, instance, sid = [*line.split("\t"), "", ""][:3]
        if instance.startswith(prefixes) and sid in sids:
            found[cid] = sid
    return found


_UNITS = {"B": 1 / 1024**2, "KiB": 1 / 1024, "kB": 1 / 1024, "MiB": 1.0, "MB": 1.0}
_UNITS |= {"GiB": 1024.0, "GB": 1024.0}


def docker_stats_mib(cids: list[str]) -> dict[str, float]:
    """MEM USAGE of ``docker stats --no-stream`` per container, in MiB."""
    out = docker("stats", "--no-stream", "--format", "{{.ID}}\t{{.MemUsage}}", *cids)
    stats: dict[str, float] = {}
    for line in out.splitlines():
        short, usage = line.split("\t")
        match = re.match(r"([\d.]+)\s*([A-Za-z]+)", usage.split("/")[0].strip())
        if match is None:
            raise RuntimeError(f"cannot parse docker stats: {line!r}")
        cid = next(c for c in cids if c.startswith(short))
        stats[cid] = float(match.group(1)) * _UNITS[match.group(2)]
    return stats


def memory_cgroup_dir(cid: str) -> Path:
    """The container's memory cgroup (cgroup v1, cgroupfs driver: ``memory/docker/<id>``)."""
    for candidate in (
        Path(f"/sys/fs/cgroup/memory/docker/{cid}"),
        Path(f"/sys/fs/cgroup/system.slice/docker-{cid}.scope"),
        Path(f"/sys/fs/cgroup/docker/{cid}"),
    ):
        if candidate.is_dir():
            return candidate
    raise RuntimeError(f"no memory cgroup found for container {cid[:12]}")


def memory_cgroup(cid: str) -> dict[str, int]:
    path = memory_cgroup_dir(cid)
    values: dict[str, int] = {"usage": 0, "total_rss": 0, "total_cache": 0}
    if (path / "memory.usage_in_bytes").exists():  # v1
        values["usage"] = int((path / "memory.usage_in_bytes").read_text())
        for line in (path / "memory.stat").read_text().splitlines():
            key, value = line.split()
            if key in values:
                values[key] = int(value)
    else:  # v2
        values["usage"] = int((path / "memory.current").read_text())
        for line in (path / "memory.stat").read_text().splitlines():
            key, value = line.split()
            if key == "anon":
                values["total_rss"] = int(value)
            elif key == "file":
                values["total_cache"] = int(value)
    return values


def cgroup_pids(cid: str) -> list[int]:
    return [int(x) for x in (memory_cgroup_dir(cid) / "cgroup.procs").read_text().split()]


def shim_pid(cid: str) -> int:
    """The containerd-shim of a container: the parent of its init process."""
    pid = int(docker("inspect", "--format", "{{.State.Pid}}", cid).strip())
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def time_command(argv: list[str], runs: int, warmups: int = 2) -> list[float]:
    samples: list[float] = []
    for i in range(runs + warmups):
        start = time.perf_counter()
        out = subprocess.run(argv, capture_output=True, check=False)
        ms = (time.perf_counter() - start) * 1000
        if out.returncode != 0 or out.stdout != b"1\n":
            raise RuntimeError(f"{argv[0]} failed ({out.returncode}): {out.stderr.decode()[-500:]}")
        if i >= warmups:
            samples.append(ms)
    return samples


def bare_bwrap_argv() -> list[str]:
    """The floor of any bwrap sandbox: the backend's own probe command line (what doctor
    runs too), with the runtime venv bound, starting the same interpreter."""
    return minimal_argv(
        shutil.which("bwrap") or "bwrap",
        ["--unshare-all", "--die-with-parent"],
        [SANDBOX_PYTHON, "-c", "print(1)"],
        binds=["--ro-bind", str(RUNTIME_DIR / "venv"), SANDBOX_VENV],
    )


def docker_run_argv(backend: str, image: str) -> list[str]:
    """A bare ``docker run`` of the image's python on the same engine and runtime."""
    runtime = SERVER_BACKEND[backend][1] or "runc"
    argv = ["docker", "run", "--rm", "--network", "none", "--runtime", runtime]
    return [*argv, "--entrypoint", IMAGE_PYTHON, image, "-c", "print(1)"]


def bare_baseline(backend: str, image: str) -> tuple[str, list[str]]:
    """The new-session row's baseline, as (its name, its argv)."""
    if backend == "bwrap":
        return "bare bwrap of the runtime's python `print(1)`", bare_bwrap_argv()
    return f"bare `docker run` of the image ({backend}) `print(1)`", docker_run_argv(backend, image)


def bwrap_baselines(runs: int) -> list[Row]:
    venv = RUNTIME_DIR / "venv"
    argv = bare_bwrap_argv()
    return [
        Row(
            "bwrap",
            "baseline: raw `bwrap … python -c 'print(1)'`",
            "ms",
            time_command(argv, runs),
            "same runtime python, --unshare-all, no seccomp/cgroup/uid drop/agent",
        ),
        Row(
            "bwrap",
            "baseline: host `python -c 'print(1)'`",
            "ms",
            time_command([str(venv / "bin" / "python"), "-c", "print(1)"], runs),
            "runtime venv's python without a sandbox (warm page cache)",
        ),
    ]


def docker_baselines(backend: str, image: str, runs: int) -> list[Row]:
    """``docker run`` and ``docker exec`` of ``python -c 'print(1)'``, same engine and image."""
    runtime = SERVER_BACKEND[backend][1] or "runc"
    run_argv = docker_run_argv(backend, image)
    rows = [
        Row(
            backend,
            f"baseline: `docker run --rm --network none --runtime {runtime}` … `print(1)`",
            "ms",
            time_command(run_argv, runs),
            "the image's python as entrypoint (the image's own is our agent); no other flags",
        )
    ]
    cid = docker(
        "run", "-d", "--rm", "--network", "none", "--runtime", runtime, "--init",
        "--entrypoint", IMAGE_PYTHON, image, "-c", "import signal; signal.pause()",
    ).strip()  # fmt: skip
    try:
        exec_argv = ["docker", "exec", cid, IMAGE_PYTHON, "-c", "print(1)"]
        rows.append(
            Row(
                backend,
                f"baseline: `docker exec` … `print(1)` into a running container ({runtime})",
                "ms",
                time_command(exec_argv, runs),
                "a new python process per exec in one idle container of the image",
            )
        )
    finally:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            docker("rm", "-f", cid)
    return rows


def peer(backend: str, image: str, runs: int, python: Path) -> list[Row]:
    """llm-sandbox, Docker backend, our image: run in its own venv by llm_sandbox_peer.py."""
    runtime = SERVER_BACKEND[backend][1] or "runc"
    if not python.exists():
        log(f"llm-sandbox: no interpreter at {python}, peer not measured")
        return [Row(backend, "peer: llm-sandbox", "ms", [float("nan")], f"not run: no {python}")]
    argv = [str(python), str(HERE / "llm_sandbox_peer.py"), "--image", image]
    argv += ["--runtime", runtime, "--runs", str(runs)]
    out = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=3600)
    if out.returncode != 0:
        reason = (out.stderr.strip().splitlines() or ["?"])[-1][:300]
        log(f"llm-sandbox failed: {out.stderr[-2000:]}")
        return [Row(backend, "peer: llm-sandbox", "ms", [float("nan")], f"failed: {reason}")]
    data = json.loads(out.stdout.strip().splitlines()[-1])
    how = (
        f"llm-sandbox {data['version']}, SandboxSession(backend=DOCKER, image=ours, "
        f"skip_environment_setup=True, keep_template=True, runtime={runtime})"
    )
    return [
        Row(
            backend,
            "peer: llm-sandbox new session → first result of `print(1)`",
            "ms",
            data["new_session"],
            f"{how}: container create+start, put_archive of the code, exec `python file`; "
            "close untimed",
        ),
        Row(
            backend,
            "peer: llm-sandbox warm round trip of `print(1+1)`",
            "ms",
            data["warm"],
            "an open session: put_archive + exec of a new `python file` (no kept interpreter)",
        ),
    ]


# -- main ------------------------------------------------------------------------------


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    processes: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


def process_table(processes: list[dict[str, Any]]) -> str:
    if not any("container" in p for p in processes):
        lines = ["| pid | process | PSS |", "|---:|---|---:|"]
        lines += [
            f"| {p['pid']} | {p['role']} | {p['pss_kib'] / 1024:.1f} MiB |" for p in processes
        ]
        return "\n".join(lines)
    lines = ["| pid | process | container | PSS |", "|---:|---|---|---:|"]
    lines += [
        f"| {p['pid']} | {p['role']} | {p['container']} | {p['pss_kib'] / 1024:.1f} MiB |"
        for p in processes
    ]
    return "\n".join(lines)


@contextlib.asynccontextmanager
async def serving(
    state_dir: Path, server_log: Path | None, backend: str, image: str
) -> AsyncIterator[Client]:
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "mcp_code_sandbox", "serve"],
        env=server_env(state_dir, server_log, backend, image),
    )
    async with Client(params, mode=PROTOCOL) as client:
        yield client


async def measure(backend: str, args: argparse.Namespace, state_dir: Path, report: Report) -> None:
    runs = args.runs
    start = time.perf_counter()
    async with serving(state_dir, args.server_log, backend, args.image) as client:
        # The 2026-07-28 client has no handshake: the first call waits for the server.
        await client.call_tool("list_runtimes", {})
        server_ms = (time.perf_counter() - start) * 1000
        bench = Bench(client, runs, backend, bare_baseline(backend, args.image))
        log(f"[{backend}] new session → first result, beside its bare baseline …")
        new, first, bare = await bench.new_session()
        log(f"[{backend}] warm round trip, beside list_runtimes and the SDK's …")
        warm = await bench.warm()
        if args.quick:
            report.rows += [new, *bare, *warm]
            return
        log(f"[{backend}] pandas groupby …")
        pandas = await bench.pandas()
        log(f"[{backend}] {PRINTED_LINES:,} printed lines …")
        printed = await bench.prints()
        log(f"[{backend}] {PARALLEL} sessions in parallel …")
        parallel = await bench.parallel()
        log(f"[{backend}] idle memory …")
        memory, report.processes[backend] = await bench.memory(state_dir)
        report.rows += [new, *bare, *warm, pandas, *printed, parallel, *memory]
    log(f"[{backend}] baselines …")
    if backend == "bwrap":
        report.rows += bwrap_baselines(runs)
    else:
        report.rows += docker_baselines(backend, args.image, runs)
        log(f"[{backend}] peer llm-sandbox …")
        report.rows += peer(backend, args.image, runs, args.llm_sandbox_python)
    report.rows += [
        Row(
            backend,
            "one-off: server start → first `list_runtimes` answered",
            "ms",
            [server_ms],
            "python -m mcp_code_sandbox serve, imports included",
        ),
        first,
    ]


async def call(client: Client, tool: str, **arguments: Any) -> dict[str, Any]:
    """``tool``'s structured result; ``RuntimeError`` with its text when it failed."""
    result = await client.call_tool(tool, arguments)
    content = result.structured_content
    if result.is_error or not isinstance(content, dict):
        text = " ".join(getattr(c, "text", "") for c in result.content)
        raise RuntimeError(f"{tool} failed: {text[:300]}")
    return content


def find_row(rows: list[Row], backend: str, prefix: str) -> Row | None:
    for row in rows:
        if row.backend == backend and row.metric.startswith(prefix):
            return row
    return None


def ratios(rows: list[Row], backends: list[str]) -> list[str]:
    """Ours ÷ anchor, on medians (and p90s), per Docker backend."""
    pairs = [
        ("new session", "new session → first", "baseline, interleaved: bare `docker run"),
        ("new session", "new session → first", "baseline: `docker run"),
        ("new session", "new session → first", "baseline: `docker exec"),
        ("warm round trip", "warm round trip", "baseline: `docker exec"),
        ("new session", "new session → first", "peer: llm-sandbox new session"),
        ("warm round trip", "warm round trip", "peer: llm-sandbox warm"),
    ]
    lines = [
        "| backend | ours | vs | ours median | theirs median | ratio of medians | ratio of p90s |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for backend in backends:
        if backend == "bwrap":
            continue
        for label, ours_prefix, theirs_prefix in pairs:
            ours = find_row(rows, backend, ours_prefix)
            theirs = find_row(rows, backend, theirs_prefix)
            if ours is None or theirs is None or theirs.median != theirs.median:  # NaN
                continue
            short = (
                "llm-sandbox"
                if theirs.metric.startswith("peer:")
                else theirs.metric.split(" …")[0]
                .removeprefix("baseline: ")
                .removeprefix("baseline, interleaved: ")
            )
            lines.append(
                f"| {backend} | {label} | {short} | {ours.median:.1f} ms | "
                f"{theirs.median:.1f} ms | {ours.median / theirs.median:.2f}× | "
                f"{ours.p90 / theirs.p90:.2f}× |"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="samples per metric (default 20)")
    parser.add_argument(
        "--backend",
        choices=[*BACKENDS, "all"],
        default="all",
        help="bwrap, docker (runc), runsc (docker with gVisor) or all (default)",
    )
    parser.add_argument(
        "--image", default="mcp-code-sandbox:latest", help="image for docker/runsc and peers"
    )
    parser.add_argument(
        "--llm-sandbox-python",
        type=Path,
        default=Path("/tmp/llmsb-venv/bin/python"),
        help="interpreter of a venv with llm-sandbox installed (default /tmp/llmsb-venv)",
    )
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    parser.add_argument(
        "--server-log", type=Path, help="run the server at DEBUG level and log to this file"
    )
    parser.add_argument("--keep", action="store_true", help="keep the state directories")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="only the new-session and warm round-trip rows, beside their interleaved baselines",
    )
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    backends = list(BACKENDS) if args.backend == "all" else [args.backend]
    if "bwrap" in backends and not (RUNTIME_DIR / "venv" / "bin" / "python").exists():
        parser.error(f"no runtime env at {RUNTIME_DIR}: run `mcp-code-sandbox setup` first")

    facts = machine_facts(backends, args.image)
    report = Report()
    for backend in backends:
        state_dir = make_state_dir()
        try:
            asyncio.run(measure(backend, args, state_dir, report))
        finally:
            if not args.keep:
                shutil.rmtree(state_dir, ignore_errors=True)
    facts["loadavg (1/5/15 min) at end"] = loadavg()

    print("# mcp-code-sandbox bench\n")
    for key, value in facts.items():
        print(f"- {key}: {value}")
    print(
        f"- runs per metric: {args.runs}; client: official MCP SDK over stdio, "
        f"protocol {PROTOCOL}\n"
    )
    print(markdown_table(report.rows))
    ratio_lines = ratios(report.rows, backends)
    if len(ratio_lines) > 2:
        print("\n## Ratios (ours ÷ anchor; > 1 means ours is slower)\n")
        print("\n".join(ratio_lines))
    for backend, processes in report.processes.items():
        where = (
            "descendants of the server process"
            if backend == "bwrap"
            else "processes in the containers' memory cgroups"
        )
        print(
            f"\nProcesses of the {backend} memory sample ({MEMORY_SESSIONS} idle sessions, "
            f"pandas imported; {where}):\n"
        )
        print(process_table(processes))
    if args.json is not None:
        payload = {
            "facts": facts,
            "runs": args.runs,
            "rows": [asdict(r) | {"median": r.median, "p90": r.p90} for r in report.rows],
        }
        args.json.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
