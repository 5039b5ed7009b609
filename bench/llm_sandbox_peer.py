"""The peer: llm-sandbox (PyPI ``llm-sandbox``), Docker backend, on our image.

Run by ``bench.py --backend docker|runsc|all`` with the interpreter of a separate venv that
has ``llm-sandbox`` installed (never the project's venv)::

    /tmp/llmsb-venv/bin/python bench/llm_sandbox_peer.py --image mcp-code-sandbox:latest \
        --runtime runc --runs 20

Prints one JSON object to stdout: the llm-sandbox version and, in milliseconds, the samples
of ``new_session`` (``SandboxSession(...)`` opened, ``run("print(1)")`` returned; the close
that follows is untimed) and ``warm`` (``run("print(1+1)")`` in an open session).

With ``--pool``: llm-sandbox's own container pool (``create_pool_manager`` with
``PoolConfig(min_pool_size=2)``, its documented way to start fast), and ``new_session`` is a
``PooledSandboxSession`` opened on it, ``run("print(1)")`` returned (``how`` says so). Note
what its pool does on ``close``: the container goes back to the pool and serves the next
session as it is (its files and processes included), which is why it is fast.

How it is made to run with no registry and no pip: ``skip_environment_setup=True`` (no venv,
no ``pip install --upgrade pip``), the image already present locally (``images.get`` finds
it, so nothing is pulled, and ``is_create_template`` stays false so ``close`` does not
remove it), ``keep_template=True`` and ``commit_container=False`` for good measure. Through
``runtime_configs``: our image's entrypoint is our agent, which exits without its channel,
so an idle Python replaces it (under ``init``, as ours, so that ``close``'s stop does not
wait out the 10 s grace); ``network_mode: none`` and the runtime as ours; a host temp
directory bind-mounted at ``/mnt/data`` as the workdir (see ``session``). Everything else
is llm-sandbox's default (it runs as root in the container, with the rootfs writable).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

from llm_sandbox import SandboxBackend, SandboxSession

KEEP_ALIVE = ["/opt/sandbox/venv/bin/python", "-c", "import signal; signal.pause()"]


def session(image: str, runtime: str, workspace: str) -> SandboxSession:
    return SandboxSession(
        backend=SandboxBackend.DOCKER,
        lang="python",
        image=image,
        skip_environment_setup=True,
        keep_template=True,
        commit_container=False,
        # A host directory bind-mounted at the image's WORKDIR, as our backend mounts the
        # session workspace: put_archive needs an existing directory (no setup mkdirs it),
        # and under runsc a file that docker cp puts into the container's rootfs (or /tmp,
        # gVisor's own tmpfs) is not seen by the sandbox, while a bind mount is.
        workdir="/mnt/data",
        runtime_configs={
            "volumes": {workspace: {"bind": "/mnt/data", "mode": "rw"}},
            "entrypoint": KEEP_ALIVE,
            "init": True,  # as ours: PID 1 forwards SIGTERM, so close() need not wait 10 s
            "network_mode": "none",
            "runtime": runtime,
        },
    )


def run_checked(sandbox: SandboxSession, code: str, expected: str) -> None:
    out = sandbox.run(code)
    if out.exit_code != 0 or out.stdout != expected:
        raise RuntimeError(f"llm-sandbox run failed: {out.exit_code} {out.stdout!r} {out.stderr!r}")


def new_session(image: str, runtime: str) -> float:
    with tempfile.TemporaryDirectory(prefix="llmsb-bench-") as workspace:
        start = time.perf_counter()
        sandbox = session(image, runtime, workspace)
        sandbox.open()
        try:
            run_checked(sandbox, "print(1)", "1\n")
            return (time.perf_counter() - start) * 1000
        finally:
            sandbox.close()


def pooled(image: str, runtime: str, runs: int) -> int:
    from llm_sandbox.pool import PoolConfig, PooledSandboxSession, create_pool_manager

    with tempfile.TemporaryDirectory(prefix="llmsb-bench-") as workspace:
        # A pooled session runs `<workdir>/.sandbox-venv/bin/python`, which its pool's
        # environment setup would make with pip (no network here): point it at the image's.
        venv_bin = Path(workspace) / ".sandbox-venv" / "bin"
        venv_bin.mkdir(parents=True)
        (venv_bin / "python").symlink_to(KEEP_ALIVE[0])
        Path(workspace).chmod(0o755)
        pool = create_pool_manager(
            backend=SandboxBackend.DOCKER,
            config=PoolConfig(max_pool_size=4, min_pool_size=2),
            lang="python",
            image=image,
            skip_environment_setup=True,
            keep_template=True,
            commit_container=False,
            runtime_configs=session(image, runtime, workspace).config.runtime_configs,
        )
        samples = []
        try:
            time.sleep(5)  # let it pre-warm, as our bench lets our pool fill
            for _ in range(runs + 1):
                start = time.perf_counter()
                with PooledSandboxSession(pool_manager=pool, workdir="/mnt/data") as sandbox:
                    run_checked(sandbox, "print(1)", "1\n")  # type: ignore[arg-type]
                    samples.append((time.perf_counter() - start) * 1000)
        finally:
            pool.close()
    how = (
        "create_pool_manager(PoolConfig(min_pool_size=2, max_pool_size=4)), same image; "
        "its venv path linked to the image's python"
    )
    json.dump({"version": version("llm-sandbox"), "new_session": samples[1:], "how": how},
              sys.stdout)  # fmt: skip
    print()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--image", default="mcp-code-sandbox:latest")
    parser.add_argument("--runtime", default="runc")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--pool", action="store_true", help="llm-sandbox's container pool")
    args = parser.parse_args()
    if args.pool:
        return pooled(args.image, args.runtime, args.runs)

    new_session(args.image, args.runtime)  # warm-up
    new = [new_session(args.image, args.runtime) for _ in range(args.runs)]
    print(f"llm-sandbox new session: median {statistics.median(new):.0f} ms", file=sys.stderr)

    warm: list[float] = []
    with (
        tempfile.TemporaryDirectory(prefix="llmsb-bench-") as workspace,
        session(args.image, args.runtime, workspace) as sandbox,
    ):
        for _ in range(3):
            run_checked(sandbox, "print(1+1)", "2\n")
        for _ in range(args.runs):
            start = time.perf_counter()
            run_checked(sandbox, "print(1+1)", "2\n")
            warm.append((time.perf_counter() - start) * 1000)
    json.dump({"version": version("llm-sandbox"), "new_session": new, "warm": warm}, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
