"""The package as users get it: built like a release (sdist, then the wheel from the
sdist), installed into a new environment without pip of its own (as uvx and pipx make
them) and without this checkout anywhere on ``sys.path``, then started the way an MCP
client is told to start it (``mcp-code-sandbox`` with no arguments, the ``uvx`` line) on
a machine with no runtime env: it answers at once, builds the runtime in the background,
tells a waiting ``run_code`` what it is doing, and then runs the code.

The runtime is kept small (``SANDBOX_RUNTIME_PACKAGES=ipython``) so that the build takes
seconds; it needs the package index, reached with this machine's own pip configuration
(the environment is passed through). Timings are printed (``pytest -s``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
from mcp import Client, StdioServerParameters

import mcp_code_sandbox

from ..conftest import REPO, require_runtime

pytestmark = [pytest.mark.e2e, pytest.mark.bwrap, pytest.mark.timeout(900)]

#: What the wheel must carry beyond the Python modules: what `setup`, `image build` and
#: the sandboxes read at run time from the installed package.
PACKAGE_DATA = (
    "mcp_code_sandbox/agent/__main__.py",  # mounted into every sandbox
    "mcp_code_sandbox/_images/Dockerfile",  # image build
    "mcp_code_sandbox/provision/node.py",  # copied into the image's build context
    "mcp_code_sandbox/provision/venv.py",  # the runtime build
    "mcp_code_sandbox/backends/seccomp.py",  # the filter every bwrap sandbox gets
    "mcp_code_sandbox/py.typed",
)


def _clean_env(**extra: str) -> dict[str, str]:
    """This machine's environment (pip's and npm's configuration: index, CA bundle)
    without anything that points at this checkout or sets the server's settings."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SANDBOX_") and k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
    }
    env.update(extra)
    return env


def _run(argv: list[str], cwd: Path, what: str) -> str:
    done = subprocess.run(
        argv, cwd=cwd, env=_clean_env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{what} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The sdist and wheel, and a new environment with the wheel installed."""
    require_runtime()  # bwrap itself; the runtime env this test builds is its own
    work = tmp_path_factory.mktemp("wheel")
    timings: dict[str, float] = {}
    started = time.monotonic()
    _run([sys.executable, "-m", "build", "--outdir", str(work / "dist"), str(REPO)], work, "build")
    timings["build sdist + wheel"] = time.monotonic() - started
    (wheel,) = (work / "dist").glob("*.whl")
    (sdist,) = (work / "dist").glob("*.tar.gz")
    started = time.monotonic()
    venv = work / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], work, "venv")
    python = str(venv / "bin" / "python")
    install = [sys.executable, "-m", "pip", "--python", python, "install", "-q", str(wheel)]
    _run(install, work, "pip install of the wheel")
    timings["install into a new venv"] = time.monotonic() - started
    return {"work": work, "wheel": wheel, "sdist": sdist, "venv": venv, "timings": timings}


def test_the_wheel_carries_what_it_reads_at_run_time(built: dict[str, Any]) -> None:
    with zipfile.ZipFile(built["wheel"]) as wheel:
        names = set(wheel.namelist())
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = wheel.read(metadata).decode()
    missing = [name for name in PACKAGE_DATA if name not in names]
    assert not missing, f"the wheel lacks {missing}"
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert f"Version: {mcp_code_sandbox.__version__}\n" in meta
    assert "License-Expression: MIT\n" in meta
    assert "Requires-Dist: pip" in meta  # the runtime build runs the server's own pip
    assert "Description-Content-Type: text/markdown" in meta
    assert "Classifier: Operating System :: POSIX :: Linux" in meta
    assert not any("/tests/" in n or n.startswith("tests/") for n in names)


def test_the_installed_package_runs_from_its_environment_alone(built: dict[str, Any]) -> None:
    """No checkout on sys.path: the package, its agent and the image's build context all
    come from the new environment."""
    python = str(built["venv"] / "bin" / "python")
    probe = (
        "import json, sys, pathlib, mcp_code_sandbox as m\n"
        "from mcp_code_sandbox.provision.image import prepare_context\n"
        "ctx = pathlib.Path(sys.argv[1])\n"
        "prepare_context(ctx, None)\n"
        "print(json.dumps([m.__file__, m.__version__, sys.path, sorted(p.name for p in "
        "ctx.iterdir())]))"
    )
    context = built["work"] / "image-context"
    out = _run([python, "-c", probe, str(context)], built["work"], "the installed package")
    where, version, path, files = json.loads(out)
    assert Path(where).is_relative_to(built["venv"]), where
    assert version == mcp_code_sandbox.__version__
    assert not any(p and Path(p).resolve().is_relative_to(REPO) for p in path), path
    assert {"Dockerfile", "mcs_agent", "node_env.py", "requirements.txt"} <= set(files)


async def test_a_first_serve_builds_the_runtime_while_a_call_waits(
    built: dict[str, Any],
) -> None:
    work: Path = built["work"]
    state = work / "state"
    env = _clean_env(
        SANDBOX_STATE_DIR=str(state),
        SANDBOX_RUNTIME_DIR=str(state / "runtime"),
        SANDBOX_BACKEND="bwrap",
        SANDBOX_RUNTIME_PACKAGES="ipython",
        SANDBOX_LOG_FILE=str(work / "server.log"),
    )
    # The line clients are given: the command alone, no arguments (serve over stdio).
    params = StdioServerParameters(
        command=str(built["venv"] / "bin" / "mcp-code-sandbox"), args=[], env=env, cwd=work
    )
    timings: dict[str, float] = built["timings"]
    told: list[tuple[float, str | None]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        told.append((progress, message))

    started = time.monotonic()
    try:
        async with Client(params, mode="legacy") as client:
            timings["serve: initialize answered"] = time.monotonic() - started
            # Too short a wait: nothing ran, and the answer says to call again.
            early = await client.call_tool("run_code", {"code": "1", "timeout_s": 0.1})
            assert early.is_error
            text = early.content[0].text  # type: ignore[union-attr]
            assert text.startswith("backend_unavailable: still building the sandbox runtime")
            assert "Nothing ran" in text and "Call again with the same arguments" in text
            assert (early.meta or {}).get("retry_after_s") == 30
            # Long enough: it waits through the build, told what happens, then runs.
            result = await client.call_tool(
                "run_code",
                {"code": "import IPython, sys\nprint(IPython.__version__)\n6 * 7"},
                progress_callback=on_progress,
            )
            timings["serve: first result"] = time.monotonic() - started
            assert not result.is_error, result.content
            data = result.structured_content or {}
            assert (data["status"], data["result"]) == ("ok", "42"), data
            assert data["stdout"].strip()
            runtimes = await client.call_tool("list_runtimes", {})
            python = next(
                r for r in (runtimes.structured_content or {})["runtimes"]
                if r["language"] == "python"
            )  # fmt: skip
            assert python["version"] and "ipython" in python["packages"]
    finally:
        log_file = work / "server.log"
        log = log_file.read_text(errors="replace") if log_file.exists() else ""
        print(f"\nwheel test timings (s): { {k: round(v, 1) for k, v in timings.items()} }")
        print(f"progress: {told}")
    messages = [m or "" for _, m in told]
    assert any(m == "building the sandbox runtime: installing ipython (1/1)" for m in messages), (
        messages,
        log[-3000:],
    )
    values = [v for v, _ in told]
    assert values == sorted(values)
    assert (state / "runtime" / "venv" / "bin" / "python").exists()
    # The server stopped the rest of the build (Node.js) when its client went away.
    assert _wait_no_process_mentions(str(state)), "a build process outlived its server"


def _wait_no_process_mentions(needle: str, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if needle.encode() in cmdline:
                alive.append(pid)
        if not alive:
            return True
        time.sleep(0.5)
    return False
