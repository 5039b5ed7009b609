"""How long a stdio server takes to go once its client closes stdin (issue 23).

MCP clients stop a stdio server by closing its stdin, waiting about 2 s, then SIGTERM, 2 s
more, then SIGKILL: a server that ends its sessions within the first 2 s is never signalled.
For each backend this starts the real server (``python -m mcp_code_sandbox serve``) on a
fresh state directory, opens ``--sessions`` sessions with a file each, closes stdin and
times the exit; it also times a server that was given SIGKILL instead, until its janitor
has removed every container, mount, loop device and record. Baseline in the same run: the
same server with no session (what the exit itself costs).

    .venv/bin/python bench/stdio_exit.py --backend all --runs 10
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mcp_code_sandbox.settings import load_settings  # noqa: E402
from tests.e2e.conftest import settings_env  # noqa: E402
from tests.e2e.test_stdio import call, handshake  # noqa: E402
from tests.procs import of_state_dir  # noqa: E402

BACKENDS = {"bwrap": {"backend": "bwrap"}, "docker": {"backend": "docker"}}
BACKENDS["runsc"] = {"backend": "docker", "docker_runtime": "runsc"}


def one(backend: str, sessions: int, *, kill: bool) -> float:
    state = Path(tempfile.mkdtemp(prefix="mcs-exit-", dir="/var/tmp"))
    os.chmod(state, 0o711)
    values = {"state_dir": str(state), "pool_size": 0, **BACKENDS[backend]}
    values["runtime_dir"] = os.environ.get(
        "SANDBOX_RUNTIME_DIR", "/var/lib/mcp-code-sandbox/runtime"
    )
    settings = load_settings(values, environ={})
    env = settings_env(settings, SANDBOX_KEEP_SESSIONS_ON_SHUTDOWN="", SANDBOX_LOG_LEVEL="WARNING")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mcp_code_sandbox", "serve"],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        handshake(proc)
        for n in range(sessions):
            call(proc, 10 + n, "run_code", session_id=f"s{n}", code="open('f','w').write('x')")
        assert proc.stdin is not None
        start = time.perf_counter()
        if kill:
            proc.kill()
            proc.wait()
            while of_state_dir(state) or any(settings.sessions_dir.glob("*.json")):
                time.sleep(0.02)
        else:
            proc.stdin.close()
            proc.wait()
        return time.perf_counter() - start
    finally:
        proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()
        shutil.rmtree(state, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="all", choices=[*BACKENDS, "all"])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--sessions", type=int, default=3)
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}")
    print("| backend | what | median s | max s |\n|---|---|---:|---:|")
    for backend in BACKENDS if args.backend == "all" else [args.backend]:
        rows = {
            "no session, stdin closed (baseline)": (0, False),
            f"{args.sessions} sessions, stdin closed": (args.sessions, False),
            f"{args.sessions} sessions, SIGKILL until the janitor is done": (args.sessions, True),
        }
        for what, (sessions, kill) in rows.items():
            times = [one(backend, sessions, kill=kill) for _ in range(args.runs)]
            print(f"| {backend} | {what} | {statistics.median(times):.2f} | {max(times):.2f} |")
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
