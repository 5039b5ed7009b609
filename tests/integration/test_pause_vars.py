"""The variables pause for real, on bwrap: the agent saves a session's namespace into its
workspace's ``.session/`` inside the sandbox, the sandbox stops, a new sandbox on the same
workspace loads it, through :class:`AgentClient` (``save_state`` / ``load_state``).

Needs the sandbox runtime with cloudpickle (``mcp-code-sandbox setup``; set
``SANDBOX_RUNTIME_DIR`` to a runtime built from this tree). The host never unpickles: the
hostile test makes every unpickling on the host fail, and a pickle that runs a command
leaves its marker in the sandbox only.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import secrets
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from mcp_code_sandbox.backends.base import Limits, SandboxSpec
from mcp_code_sandbox.backends.bwrap.backend import BwrapBackend, BwrapSandbox
from mcp_code_sandbox.errors import SandboxFailed
from mcp_code_sandbox.sessions.agent_client import AgentClient
from mcp_code_sandbox.sessions.executor import Cell, Outcome
from mcp_code_sandbox.settings import Settings

from ..conftest import sandbox_owner

pytestmark = pytest.mark.bwrap

LIMITS = Limits(memory_bytes=768 << 20, cpu=1.0, pids=64, tmp_bytes=8 << 20, file_bytes=256 << 20)


class Box:
    """One sandbox on a workspace, and its agent client."""

    def __init__(self, sandbox: BwrapSandbox) -> None:
        self.sandbox = sandbox
        self.client = AgentClient(sandbox.channel)

    async def run(self, code: str, timeout_s: float = 60) -> Outcome:
        return await self.client.execute(Cell("python", code, timeout_s), lambda n, t: None)

    async def ok(self, code: str) -> str | None:
        outcome = await self.run(code)
        assert outcome.status == "ok", outcome.error
        return outcome.result


@pytest.fixture
def backend(make_settings: Callable[..., Settings]) -> BwrapBackend:
    return BwrapBackend(make_settings())


@pytest.fixture
def open_box(
    backend: BwrapBackend, host_uid: int | None
) -> Callable[[str], Any]:  # an async context manager factory
    import contextlib

    @contextlib.asynccontextmanager
    async def open_(key: str, limits: Limits = LIMITS) -> AsyncIterator[Box]:
        workspace = backend.settings.state_dir / "workspaces" / "shared"
        if not workspace.exists():
            workspace.mkdir(parents=True)
            if (owner := sandbox_owner(backend, host_uid)) is not None:
                os.chown(workspace, *owner)
        uid = host_uid if backend.per_sandbox_uids else None
        spec = SandboxSpec(key=key, owner="local", session_id="s", workspace=workspace,
                           limits=limits, uid=uid)  # fmt: skip
        sandbox = await backend.create(spec)
        assert isinstance(sandbox, BwrapSandbox)
        try:
            yield Box(sandbox)
        finally:
            await backend.stop(sandbox)

    return open_


SESSION = """
import numpy as np
import os.path as osp
import pandas as pd
import threading, socket
df = pd.DataFrame({"a": range(1000), "b": [f"s{i}" for i in range(1000)]})
def f():
    return df.shape
class Point:
    def __init__(self, x):
        self.x = x
    def double(self):
        return Point(self.x * 2)
p = Point(21)
a = b = [1]
holder = {"df": df}
g = (i for i in range(3))
lock = threading.Lock()
sock = socket.socket()
fh = open("notes.txt", "w")
"""


async def test_a_session_comes_back_in_a_new_sandbox(open_box: Callable[[str], Any]) -> None:
    async with open_box("first") as box:
        await box.ok(SESSION)
        await box.ok("import matplotlib.pyplot as plt\nfig, ax = plt.subplots()\nax.plot([1, 2])")
        last = await box.run("p.double().x")
        assert last.result == "42" and last.execution_count == 3
        report = await box.client.save_state(max_bytes=64 << 20, timeout_s=60)
    kept = {v.name: v for v in report.kept}
    assert set(kept) == {"df", "f", "Point", "p", "a", "b", "holder", "fig", "ax"}
    assert kept["df"].type == "pandas.DataFrame" and (kept["df"].bytes or 0) > 0
    assert {(m.name, m.type) for m in report.modules} >= {("np", "numpy"), ("pd", "pandas")}
    assert ("osp", "posixpath") in {(m.name, m.type) for m in report.modules}
    dropped = {v.name: v for v in report.dropped}
    assert set(dropped) == {"g", "lock", "sock", "fh"}
    assert dropped["g"].type == "generator" and "not picklable" in (dropped["g"].why or "")
    assert dropped["sock"].type == "socket.socket"
    assert report.bytes >= sum(v.bytes or 0 for v in report.kept)

    async with open_box("second") as box:
        assert await box.ok("'df' in globals()") == "False"  # a fresh interpreter...
        loaded = await box.client.load_state(timeout_s=60)
        assert loaded.found and set(loaded.restored) == set(kept) and loaded.failed == ()
        assert {"np", "osp", "pd", "plt"} <= set(loaded.modules)
        # ...numbering goes on from before the pause; the save and load did not count.
        first = await box.run("f()")
        assert first.result == "(1000, 2)" and first.execution_count == 4
        # fig and ax refer to each other: saved together, they still do.
        assert await box.ok("fig.axes[0] is ax, ax.figure is fig") == "(True, True)"
        assert await box.ok("a is b, holder['df'] is df, type(p) is Point") == "(True, True, True)"
        assert await box.ok("p.double().x, np.arange(4).sum(), osp.join('x', 'y')") == (
            "(42, np.int64(6), 'x/y')"
        )
        # The function sees the live namespace: rebinding df changes what it returns.
        assert await box.ok("df = pd.DataFrame({'z': [1, 2]}); f()") == "(2, 1)"
        assert await box.ok("f.__globals__ is globals()") == "True"
        assert await box.ok("In[1].strip().splitlines()[0]") == "'import numpy as np'"
        assert (
            await box.ok("[name for name in ('g', 'lock', 'sock', 'fh') if name in globals()]")
            == "[]"
        )


async def test_the_budget_drops_the_largest_and_what_refers_to_them(
    open_box: Callable[[str], Any],
) -> None:
    async with open_box("budget") as box:
        await box.ok("import numpy as np\nbig = np.zeros(2_000_000)\nmid = np.ones(50_000)\n"
                     "ref = [big]\nsmall = 'x'")  # fmt: skip
        report = await box.client.save_state(max_bytes=4 << 20, timeout_s=60)
        why = {v.name: v.why or "" for v in report.dropped}
        assert (
            why["big"].startswith("too large") and why["ref"] == "refers to big, which is not saved"
        )
        assert {v.name for v in report.kept} == {"mid", "small"}
    async with open_box("budget2") as box:
        loaded = await box.client.load_state(timeout_s=60)
        assert set(loaded.restored) == {"mid", "small"}
        assert await box.ok("float(mid.sum()), 'big' in globals()") == "(50000.0, False)"


async def test_a_value_over_the_file_size_limit_is_dropped_not_the_save(
    open_box: Callable[..., Any],
) -> None:
    limits = Limits(memory_bytes=512 << 20, cpu=1.0, pids=64, tmp_bytes=8 << 20,
                    file_bytes=1 << 20)  # fmt: skip
    async with open_box("fsize", limits) as box:
        await box.ok("blob = bytes(3 << 20)\nsmall = [1, 2]")
        report = await box.client.save_state(max_bytes=64 << 20, timeout_s=60)
        assert [v.name for v in report.kept] == ["small"]
        assert [v.name for v in report.dropped] == ["blob"]
        assert (report.dropped[0].why or "").startswith("too large")


HOSTILE = """
import json, os, pickle
class Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/{token} /mnt/data/ran-{token}",))
os.makedirs(".session/data-00000000000000aa", exist_ok=True)
body = pickle.dumps(Evil())
with open(".session/data-00000000000000aa/v0.pkl", "wb") as out:
    out.write(body)
manifest = {{"format": 1, "data": "data-00000000000000aa", "modules": [],
            "values": [{{"name": "evil", "type": "x", "file": "v0.pkl", "bytes": len(body)}}],
            "execution_count": 3}}
with open(".session/manifest.json", "w") as out:
    json.dump(manifest, out)
"""


async def test_a_hostile_pickle_runs_only_inside_the_sandbox(
    open_box: Callable[[str], Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the host unpickled something a sandbox wrote")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, never)
    token = secrets.token_hex(8)
    async with open_box("plant") as box:
        await box.ok(HOSTILE.format(token=token))
    async with open_box("victim") as box:
        loaded = await box.client.load_state(timeout_s=60)
        # It ran, as the user, in the sandbox: its marker is in the workspace, and the
        # sandbox's /tmp is its own.
        assert loaded.found and loaded.restored == ("evil",)
        assert await box.ok(f"import os; os.path.exists('/tmp/{token}')") == "True"
        workspace = box.sandbox.spec.workspace
    assert (workspace / f"ran-{token}").exists()
    assert not Path(f"/tmp/{token}").exists()

    # Garbage: a manifest that is not JSON, then .session a symlink out of the workspace.
    async with open_box("garbage") as box:
        await box.ok("open('.session/manifest.json', 'w').write('{not json')")
        loaded = await box.client.load_state(timeout_s=60)
        assert not loaded.found and "manifest" in loaded.failed[0].type
        await box.ok("import shutil, os\nshutil.rmtree('.session')\nos.makedirs('/tmp/elsewhere')\n"
                     "os.symlink('/tmp/elsewhere', '.session')\nkept = 1")  # fmt: skip
        assert not (await box.client.load_state(timeout_s=60)).found
        report = await box.client.save_state(max_bytes=1 << 20, timeout_s=60)
        assert [v.name for v in report.kept] == ["kept"]
        assert await box.ok("os.listdir('/tmp/elsewhere'), os.path.islink('.session')") == (
            "([], False)"
        )
        assert await box.ok("1 + 1") == "2"  # the agent carries on


async def test_a_sandbox_killed_mid_save_leaves_the_previous_state(
    open_box: Callable[[str], Any],
) -> None:
    async with open_box("gen1") as box:
        await box.ok("generation = 1")
        await box.client.save_state(max_bytes=512 << 20, timeout_s=60)
        workspace: Path = box.sandbox.spec.workspace
        committed = {p.name for p in (workspace / ".session").iterdir()}
        await box.ok("generation = 2\nblobs = [bytes([i]) * (4 << 20) for i in range(40)]\n"
                     + "\n".join(f"v{i} = blobs[{i}]" for i in range(40)))  # fmt: skip
        saving = asyncio.create_task(box.client.save_state(max_bytes=512 << 20, timeout_s=120))
        async with asyncio.timeout(60):
            while not any(
                p.name.startswith("data-") and p.name not in committed and (p / "v3.pkl").exists()
                for p in (workspace / ".session").iterdir()
            ):
                await asyncio.sleep(0.01)
        assert not saving.done(), "the save finished before the sandbox could be killed"
        box.sandbox.proc.kill()  # a crash: SIGKILL of bwrap, whose sandbox dies with it
        with pytest.raises(SandboxFailed):
            await saving
    async with open_box("after") as box:
        loaded = await box.client.load_state(timeout_s=60)
        assert loaded.found and loaded.restored == ("generation",), loaded
        assert await box.ok("generation, 'v0' in globals()") == "(1, False)"


SLOW = """
import time
class Slow:
    def __reduce__(self):
        time.sleep(60)
        return (int, ())
slow = Slow()
"""


async def test_a_save_past_its_deadline_is_interrupted_like_a_cell(
    open_box: Callable[[str], Any],
) -> None:
    async with open_box("slow") as box:
        await box.ok("kept = 'first'")
        await box.client.save_state(max_bytes=1 << 20, timeout_s=30)
        await box.ok(SLOW + "kept = 'second'")
        with pytest.raises(SandboxFailed, match="did not finish within 1 s"):
            await box.client.save_state(max_bytes=1 << 20, timeout_s=1)
        after = await box.run("kept")
        assert after.result == "'second'" and not after.state_lost  # the kernel is intact
    async with open_box("slow2") as box:
        loaded = await box.client.load_state(timeout_s=30)
        assert loaded.restored == ("kept",)
        assert await box.ok("kept") == "'first'"  # the last complete state
