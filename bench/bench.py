"""Benchmark of mcp-code-sandbox through the official MCP client (DESIGN §12).

Run by hand, as root or as the user that serves (needs bwrap and the runtime env)::

    .venv/bin/python bench/bench.py [--runs 20] [--json out.json] [--server-log server.log]

It starts the real server (``python -m mcp_code_sandbox serve`` over stdio) on a fresh
state directory, measures each metric ``--runs`` times and prints a Markdown table
(median and p90) to stdout; progress goes to stderr. See bench/README.md for the rows.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
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

RUNTIME_DIR = Path(os.environ.get("SANDBOX_RUNTIME_DIR", "/var/lib/mcp-code-sandbox/runtime"))
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

        return [self.metric, fmt(self.median), fmt(self.p90), str(len(self.samples)), self.notes]


def markdown_table(rows: list[Row]) -> str:
    lines = ["| metric | median | p90 | n | notes |", "|---|---:|---:|---:|---|"]
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


def machine_facts() -> dict[str, str]:
    runtime_python = RUNTIME_DIR / "venv" / "bin" / "python"
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "nproc": str(len(os.sched_getaffinity(0))),
        "cpu": cpu_model(),
        "memory": mem_total(),
        "kernel": platform.release(),
        "bwrap": _first_line(["bwrap", "--version"]),
        "cgroup": cgroup_version(),
        "server python": platform.python_version(),
        "runtime python": _first_line([str(runtime_python), "--version"]),
        "user": f"uid {os.geteuid()}",
    }


# -- the server and its processes ------------------------------------------------------


def make_state_dir() -> Path:
    path = Path(tempfile.mkdtemp(prefix="mcs-bench-", dir="/var/tmp"))
    path.chmod(0o711)  # the sandbox uid must traverse it to its workspace
    return path


def server_env(state_dir: Path, server_log: Path | None) -> dict[str, str]:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "SANDBOX_STATE_DIR": str(state_dir),
        "SANDBOX_RUNTIME_DIR": str(RUNTIME_DIR),
        "SANDBOX_BACKEND": "bwrap",
        "SANDBOX_MAX_SESSIONS": "64",
        "SANDBOX_LOG_LEVEL": "WARNING",
    }
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
    if "mcs_agent.kernel" in cmdline:
        return "kernel"
    if "mcs_agent" in cmdline and not cmdline.startswith(("/usr/bin/bwrap", "bwrap")):
        return "agent"
    if cmdline.startswith(("/usr/bin/bwrap", "bwrap")):
        return "bwrap"
    return cmdline.split(" ", 1)[0] or "?"


# -- the measurements ------------------------------------------------------------------


class Bench:
    def __init__(self, client: Client, runs: int) -> None:
        self.client = client
        self.runs = runs

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

    async def new_session(self) -> tuple[Row, Row]:
        # The very first sandbox of a server pays one-off costs (imports, host probe,
        # page cache): measured once and reported apart from the steady state.
        first_ms, content = await self.timed(lambda: self.run("print(1)"))
        await self.call("close_session", session_id=content["session_id"])
        samples: list[float] = []
        server_ms: list[float] = []
        for _ in range(self.runs):
            ms, content = await self.timed(lambda: self.run("print(1)"))
            assert content["stdout"] == "1\n" and content["session_created"], content
            samples.append(ms)
            server_ms.append(float(content["duration_ms"]))
            await self.call("close_session", session_id=content["session_id"])
        row = Row(
            "new session → first result of `print(1)`",
            "ms",
            samples,
            f"no pool; server's duration_ms median {statistics.median(server_ms):.0f} ms",
            {"server_duration_ms": server_ms},
        )
        first = Row(
            "first new session of a fresh server",
            "ms",
            [first_ms],
            "one-off, excluded from the row above",
        )
        return row, first

    async def warm(self) -> Row:
        sid = (await self.run("print(1)"))["session_id"]
        for _ in range(3):
            await self.run("1+1", sid)
        samples: list[float] = []
        server_ms: list[float] = []
        for _ in range(self.runs):
            ms, content = await self.timed(lambda: self.run("1+1", sid))
            assert content["result"] == "2", content
            samples.append(ms)
            server_ms.append(float(content["duration_ms"]))
        await self.call("close_session", session_id=sid)
        return Row(
            "warm round trip of `1+1`",
            "ms",
            samples,
            f"cell's own time ≈ 0; server's duration_ms median "
            f"{statistics.median(server_ms):.0f} ms",
            {"server_duration_ms": server_ms},
        )

    async def floor(self) -> Row:
        samples = [
            (await self.timed(lambda: self.call("list_runtimes")))[0] for _ in range(self.runs)
        ]
        return Row(
            "reference: `list_runtimes` round trip",
            "ms",
            samples,
            "a tool call that touches no sandbox: the MCP/stdio floor",
        )

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
        return Row(
            f"pandas groupby-mean over {PANDAS_ROWS:,} rows",
            "ms",
            samples,
            f"cell's own time median {statistics.median(cell_ms):.1f} ms / p90 "
            f"{p90(cell_ms):.1f} ms; overhead median {statistics.median(overhead):.1f} ms / "
            f"p90 {p90(overhead):.1f} ms",
            {"cell_ms": cell_ms, "overhead_ms": overhead},
        )

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
        return Row(
            f"{PARALLEL} new sessions in parallel (wall time of the batch)",
            "ms",
            samples,
            f"{PARALLEL} concurrent `print(1)` without session_id; one sample = one batch",
        )

    async def memory(self, state_dir: Path) -> tuple[Row, list[dict[str, Any]]]:
        sids = [
            (await self.run("import pandas as pd\nimport numpy as np"))["session_id"]
            for _ in range(MEMORY_SESSIONS)
        ]
        await asyncio.sleep(1.0)  # let the agents settle
        server = find_server(state_dir)
        procs: list[dict[str, Any]] = []
        for pid in descendants(server):
            cmdline = _cmdline(pid)
            with contextlib.suppress(OSError):
                procs.append({"pid": pid, "role": process_role(cmdline), "pss_kib": pss_kib(pid)})
        total_kib = sum(p["pss_kib"] for p in procs)
        server_kib = pss_kib(server)
        for sid in sids:
            await self.call("close_session", session_id=sid)
        per_session = total_kib / 1024 / MEMORY_SESSIONS
        by_role: dict[str, list[int]] = {}
        for p in procs:
            by_role.setdefault(p["role"], []).append(p["pss_kib"])
        breakdown = ", ".join(
            f"{role} ×{len(v)} ≈ {sum(v) / len(v) / 1024:.1f}" for role, v in by_role.items()
        )
        row = Row(
            "idle memory per session, pandas imported (PSS)",
            "MiB",
            [per_session],
            f"{MEMORY_SESSIONS} sessions, {len(procs)} processes; per process MiB: {breakdown}; "
            f"server itself {server_kib / 1024:.1f} MiB, not counted",
            {"processes": procs, "server_pss_kib": server_kib},
        )
        return row, procs


def time_command(argv: list[str], runs: int) -> list[float]:
    samples: list[float] = []
    for i in range(runs + 2):  # two warm-ups
        start = time.perf_counter()
        out = subprocess.run(argv, capture_output=True, check=False)
        ms = (time.perf_counter() - start) * 1000
        if out.returncode != 0 or out.stdout != b"1\n":
            raise RuntimeError(f"{argv[0]} failed ({out.returncode}): {out.stderr.decode()[-500:]}")
        if i >= 2:
            samples.append(ms)
    return samples


def baselines(runs: int) -> list[Row]:
    venv = RUNTIME_DIR / "venv"
    bwrap = shutil.which("bwrap") or "bwrap"
    argv = [
        bwrap,
        "--unshare-all",
        "--die-with-parent",
        "--ro-bind",
        "/usr",
        "/usr",
        "--symlink",
        "usr/bin",
        "/bin",
        "--symlink",
        "usr/lib",
        "/lib",
        "--symlink",
        "usr/lib64",
        "/lib64",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--ro-bind",
        str(venv),
        "/opt/sandbox/venv",
        "/opt/sandbox/venv/bin/python",
        "-c",
        "print(1)",
    ]
    return [
        Row(
            "baseline: raw `bwrap … python -c 'print(1)'`",
            "ms",
            time_command(argv, runs),
            "same runtime python, --unshare-all, no seccomp/cgroup/uid drop/agent",
        ),
        Row(
            "baseline: host `python -c 'print(1)'`",
            "ms",
            time_command([str(venv / "bin" / "python"), "-c", "print(1)"], runs),
            "runtime venv's python without a sandbox (warm page cache)",
        ),
    ]


# -- main ------------------------------------------------------------------------------


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    processes: list[dict[str, Any]] = field(default_factory=list)


def process_table(processes: list[dict[str, Any]]) -> str:
    lines = ["| pid | process | PSS |", "|---:|---|---:|"]
    lines += [f"| {p['pid']} | {p['role']} | {p['pss_kib'] / 1024:.1f} MiB |" for p in processes]
    return "\n".join(lines)


@contextlib.asynccontextmanager
async def serving(state_dir: Path, server_log: Path | None) -> AsyncIterator[Client]:
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "mcp_code_sandbox", "serve"],
        env=server_env(state_dir, server_log),
    )
    async with Client(params, mode=PROTOCOL) as client:
        yield client


async def measure(runs: int, state_dir: Path, server_log: Path | None) -> Report:
    report = Report()
    start = time.perf_counter()
    async with serving(state_dir, server_log) as client:
        # The 2026-07-28 client has no handshake: the first call waits for the server.
        await client.call_tool("list_runtimes", {})
        server_ms = (time.perf_counter() - start) * 1000
        bench = Bench(client, runs)
        log("new session → first result …")
        new, first = await bench.new_session()
        log("warm round trip …")
        warm = await bench.warm()
        floor = await bench.floor()
        log("pandas groupby …")
        pandas = await bench.pandas()
        log(f"{PARALLEL} sessions in parallel …")
        parallel = await bench.parallel()
        log("idle memory …")
        memory, report.processes = await bench.memory(state_dir)
        report.rows += [new, warm, floor, pandas, parallel, memory]
    log("baselines …")
    report.rows += baselines(runs)
    report.rows += [
        Row(
            "one-off: server start → first `list_runtimes` answered",
            "ms",
            [server_ms],
            "python -m mcp_code_sandbox serve, imports included",
        ),
        first,
    ]
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="samples per metric (default 20)")
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    parser.add_argument(
        "--server-log", type=Path, help="run the server at DEBUG level and log to this file"
    )
    parser.add_argument("--keep", action="store_true", help="keep the state directory")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if not (RUNTIME_DIR / "venv" / "bin" / "python").exists():
        parser.error(f"no runtime env at {RUNTIME_DIR}: run `mcp-code-sandbox setup` first")

    facts = machine_facts()
    state_dir = make_state_dir()
    try:
        report = asyncio.run(measure(args.runs, state_dir, args.server_log))
    finally:
        if not args.keep:
            shutil.rmtree(state_dir, ignore_errors=True)

    print("# mcp-code-sandbox bench (bwrap backend)\n")
    for key, value in facts.items():
        print(f"- {key}: {value}")
    print(
        f"- runs per metric: {args.runs}; client: official MCP SDK over stdio, "
        f"protocol {PROTOCOL}\n"
    )
    print(markdown_table(report.rows))
    print(
        f"\nProcesses of the memory sample ({MEMORY_SESSIONS} idle sessions, pandas imported;"
        " descendants of the server process):\n"
    )
    print(process_table(report.processes))
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
