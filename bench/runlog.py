"""What recording a run costs (issue 15, the session as a notebook): ``RunLog.append`` per
run, beside its baseline (one ``os.write`` of the same bytes to an open file, measured in
the same process and moment), and building a notebook from a long log; and what exporting
a full log of newline-heavy runs costs (issue 27): its time, the notebook's size and the
export's peak of Python memory (``tracemalloc``).

    .venv/bin/python bench/runlog.py [--runs 500] [--export-mb 32]

Prints a Markdown table of medians; no sandbox is needed (the append runs in a worker
thread after each run, so this is added to a run's round trip at most).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path

from mcp_code_sandbox.run.notebook import build_notebook, write_notebook
from mcp_code_sandbox.sessions.runlog import RecordedDisplay, RunEntry, RunLog

SLOT = "s" + "0" * 31 + "-00000000"


def entries() -> dict[str, RunEntry]:
    small = RunEntry("python", "1+1", "ok", 0, "", "", "2", None, 1, 3, time.time())
    figure = RunEntry(
        "python", "plt.plot(x)", "ok", 0, "step\n" * 100, "", None, None, 2, 40, time.time(),
        displays=[RecordedDisplay("image/png", data=b"\x89PNG" + bytes(30_000))],
    )  # fmt: skip
    return {"1+1": small, "a 30 KB figure": figure}


def median_us(fn: object, runs: int) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--export-mb", type=int, default=32)
    args = parser.parse_args()
    runs = args.runs
    work = Path(tempfile.mkdtemp(prefix="mcs-runlog-"))
    log = RunLog(work / "runlogs", SLOT, 1 << 30)
    print("| what | RunLog.append (µs) | baseline: os.write of the same bytes (µs) |")
    print("|---|---|---|")
    with (work / "baseline").open("ab", buffering=0) as base:
        for name, entry in entries().items():
            probe = RunLog(work / "probe", name.replace(" ", "-"), 1 << 30)
            probe.append(entry)
            line = probe.path.read_bytes()  # the very bytes an append writes
            ours = median_us(lambda e=entry: log.append(e), runs)
            theirs = median_us(lambda b=line: os.write(base.fileno(), b), runs)
            print(f"| {name} | {ours:.0f} | {theirs:.0f} |")
    found = list(log.records())[:200]
    started = time.perf_counter()
    notebook = build_notebook(found, lambda _: None, 1 << 30)
    took = (time.perf_counter() - started) * 1000
    print(f"\nnotebook of 200 runs: {took:.0f} ms to build and validate, {len(notebook)} bytes")
    export(work, args.export_mb * 1024 * 1024)


def export(work: Path, budget: int) -> None:
    """A log filled to ``budget`` with runs of 50,000 newlines each, exported."""
    log = RunLog(work / "full", SLOT, budget)
    lines = "\n" * 50_000
    for _ in range(budget // 100_000 + 10):  # a line is about 100 KB: the log is full
        log.append(RunEntry("python", "print(x)", "ok", 0, lines, "", None, None, 1, 3, 0.0))
    with (work / "out.ipynb").open("wb") as out:
        started = time.perf_counter()
        tracemalloc.start()
        written = write_notebook(log.records(), lambda _: None, out, budget)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        took = time.perf_counter() - started
    print(
        f"export of a {log.path.stat().st_size / 1e6:.1f} MB log: {took * 1000:.0f} ms, "
        f"notebook {written.size_bytes / 1e6:.1f} MB ({written.runs} runs), "
        f"peak {peak / 1e6:.1f} MB"
    )


if __name__ == "__main__":
    main()
