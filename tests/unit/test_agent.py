"""The agent as a real process over a real socketpair, the way a backend starts it.

Two interpreters: the host's (``--plain``, no IPython) and the sandbox runtime's, which has
IPython, matplotlib, numpy and pandas (``SANDBOX_TEST_RUNTIME_PYTHON``, else the venv that
``mcp-code-sandbox setup`` builds). Tests needing the latter are marked ``bwrap`` and fail
when it is missing. ``kill_strays`` is always false here: these agents share the host's
pid namespace.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from mcp_code_sandbox.agent.protocol import HEADER, read_frame, write_frame

SRC = Path(__file__).resolve().parents[2] / "src"
CONFIG = {"kill_strays": False, "pids": 100_000, "file_bytes": 2**31, "memory_bytes": None}


def runtime_python() -> str:
    explicit = os.environ.get("SANDBOX_TEST_RUNTIME_PYTHON")
    if explicit:
        return explicit
    from mcp_code_sandbox.settings import load_settings

    path = load_settings().runtime_dir / "venv" / "bin" / "python"
    if not path.exists():
        pytest.fail(
            f"no runtime Python with IPython at {path}: run `mcp-code-sandbox setup` or set "
            "SANDBOX_TEST_RUNTIME_PYTHON to a python with ipython, matplotlib and pandas"
        )
    return str(path)


@dataclass
class Result:
    done: dict[str, Any]
    stdout: str = ""
    stderr: str = ""
    displays: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def status(self) -> str:
        return str(self.done["status"])


class Agent:
    def __init__(
        self,
        python: str,
        workdir: Path,
        plain: bool,
        config: dict[str, Any] | None = None,
        prefix: tuple[str, ...] = (),
    ) -> None:
        self.workdir = workdir
        self.sock, theirs = socket.socketpair()
        argv = [*prefix, python, "-m", "mcp_code_sandbox.agent",
                "--channel-fd", str(theirs.fileno()), "--workdir", str(workdir),
                "--config", json.dumps(config or CONFIG)]  # fmt: skip
        if plain:
            argv.append("--plain")
        env = {**os.environ, "PYTHONPATH": str(SRC), "MPLBACKEND": "Agg", "HOME": str(workdir)}
        env["MPLCONFIGDIR"] = str(workdir / ".mpl")
        self.proc = subprocess.Popen(
            argv, pass_fds=[theirs.fileno()], env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        theirs.close()
        self.ready = self.receive(timeout=60)
        self._next_id = 0

    def send(self, message: dict[str, Any]) -> None:
        write_frame(self.sock, message)

    def receive(self, timeout: float = 30) -> dict[str, Any]:
        readable, _, _ = select.select([self.sock], [], [], timeout)
        assert readable, f"no message from the agent within {timeout} s"
        message = read_frame(self.sock.fileno())
        assert message is not None, "agent closed the channel"
        return message

    def submit(self, code: str, **fields: Any) -> int:
        self._next_id += 1
        message = {"op": "exec", "id": self._next_id, "language": "python", "code": code,
                   "timeout_s": 20, "env": {}}  # fmt: skip
        message.update(fields)
        self.send(message)
        return self._next_id

    def collect(self, run_id: int, timeout: float = 30) -> Result:
        result = Result(done={})
        while True:
            message = self.receive(timeout)
            assert message.get("id") == run_id, message
            result.events.append(message)
            if message["ev"] == "stream":
                name = message["name"]
                setattr(result, name, getattr(result, name) + message["text"])
            elif message["ev"] == "display":
                result.displays.append(message)
            elif message["ev"] == "done":
                result.done = message
                return result
            else:
                raise AssertionError(message)

    def run(self, code: str, **fields: Any) -> Result:
        return self.collect(self.submit(code, **fields))

    def close(self) -> int:
        self.sock.close()
        try:
            return self.proc.wait(timeout=10)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            assert self.proc.stdout is not None
            self.proc.stdout.close()


def start_agent(kind: str, workdir: Path) -> Agent:
    if kind == "plain":
        return Agent(sys.executable, workdir, plain=True)
    return Agent(runtime_python(), workdir, plain=False)


KINDS = [pytest.param("plain"), pytest.param("ipython", marks=pytest.mark.bwrap)]


@pytest.fixture(params=KINDS)
def agent(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Agent]:
    a = start_agent(request.param, tmp_path)
    yield a
    assert a.close() == 0


@pytest.fixture(params=[pytest.param("ipython", marks=pytest.mark.bwrap)])
def ipy(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Agent]:
    a = start_agent(request.param, tmp_path)
    yield a
    assert a.close() == 0


def test_ready_message(agent: Agent) -> None:
    ready = agent.ready
    assert ready["ev"] == "ready"
    assert ready["languages"]["python"].count(".") == 2
    assert "bash" in ready["languages"]
    assert ready["ipython"] is (agent.proc.args[-1] != "--plain")  # type: ignore[index]
    assert ready["pid"] == agent.proc.pid


def test_state_persists_and_last_expression_is_the_result(agent: Agent) -> None:
    first = agent.run("x = 41")
    second = agent.run("x + 1")
    assert first.done["result"] is None
    assert second.status == "ok" and second.done["result"] == "42"
    assert second.stdout == ""  # no Out[2]: on stdout
    assert second.done["exit_code"] is None and second.done["state_lost"] is False
    assert second.done["execution_count"] == first.done["execution_count"] + 1
    assert agent.run("print(__name__); _").stdout == "__main__\n"


def test_every_writer_to_fd1_is_a_stream_and_the_channel_survives(agent: Agent) -> None:
    code = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None)\n"
        "print('py')\n"
        "os.system('echo sh')\n"
        "libc.write(1, b'raw\\n', 4)\n"
        "libc.printf(b'printf\\n')\n"  # left in C's stdio buffer: the agent flushes it
        "None"
    )
    result = agent.run(code)
    assert result.status == "ok", result.done
    assert result.stdout == "py\nsh\nraw\nprintf\n"
    assert agent.run("1 + 1").done["result"] == "2"


def test_stderr(agent: Agent) -> None:
    result = agent.run("import sys, os; print('e', file=sys.stderr); os.system('echo s >&2')")
    assert result.stderr == "e\ns\n" and result.stdout == ""


def test_output_keeps_its_order_across_streams_and_children(agent: Agent) -> None:
    code = (
        "import os, subprocess, sys\n"
        "print('a')\n"
        "print('b', file=sys.stderr)\n"
        "print('c')\n"
        "os.system('echo d; echo e >&2')\n"
        "print('f')\n"
        "subprocess.run(['echo', 'g'])\n"
        "sys.stderr.write('h\\n')\n"
        "print('i', flush=True)"
    )
    result = agent.run(code)
    assert result.status == "ok", result.done
    said = "".join(f"{e['name'][3]}{e['text']}" for e in result.events if e["ev"] == "stream")
    assert said.replace("\n", "") == "oaebocodeeofogehoi"


def test_output_is_sent_while_the_cell_still_runs(agent: Agent) -> None:
    go = agent.workdir / "go"
    run_id = agent.submit(
        f"import os, time\nprint('first')\n"
        f"while not os.path.exists({str(go)!r}):\n    time.sleep(0.01)\nprint('last')"
    )
    # Nothing else will end the cell: if 'first' waited for the end, this would time out.
    assert agent.receive() == {"ev": "stream", "id": run_id, "name": "stdout", "text": "first\n"}
    go.touch()
    result = agent.collect(run_id)
    assert result.status == "ok" and result.stdout == "last\n"


def test_many_prints_arrive_whole_in_few_messages(agent: Agent) -> None:
    result = agent.run(
        "import sys\nfor i in range(100000):\n    print(i)\n"
        "sys.stdout.buffer.write('é'.encode() * 70000)\nNone"
    )
    assert result.status == "ok"
    assert result.stdout == "".join(f"{i}\n" for i in range(100000)) + "é" * 70000
    streams = [e for e in result.events if e["ev"] == "stream"]
    assert len(streams) < 100  # one per 64 KiB or per 50 ms, not one per print
    assert max(len(e["text"]) for e in streams) <= 64 * 1024


def test_forked_children_print_through_the_pipes(agent: Agent) -> None:
    # A forked child inherits the kernel's buffered streams and its control socket: its
    # output must go to fd 1 / fd 2, never as frames of its own on the parent's socket.
    code = (
        "import multiprocessing, os, sys\n"
        "print('parent')\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    print('child'); print('child-err', file=sys.stderr); sys.stdout.flush()\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "def double(x):\n"
        "    print('worker', x)\n"
        "    return 2 * x\n"
        "with multiprocessing.get_context('fork').Pool(2) as pool:\n"
        "    print(pool.map(double, range(4)))"
    )
    result = agent.run(code)
    assert result.status == "ok", result.done
    assert result.stdout.startswith("parent\nchild\n") and result.stderr == "child-err\n"
    assert result.stdout.endswith("[0, 2, 4, 6]\n") and result.stdout.count("worker") == 4
    assert agent.run("1 + 1").done["result"] == "2"


def test_error_has_a_trimmed_traceback(agent: Agent) -> None:
    result = agent.run("def f():\n    return 1 / 0\nf()")
    assert result.status == "error"
    error = result.done["error"]
    assert error["name"] == "ZeroDivisionError" and error["value"] == "division by zero"
    assert "return 1 / 0" in error["traceback"]
    assert "mcp_code_sandbox" not in error["traceback"]
    assert "\x1b[" not in error["traceback"]
    syntax = agent.run("1 +").done
    assert syntax["status"] == "error" and syntax["error"]["name"] == "SyntaxError"
    assert agent.run("2").done["result"] == "2"


def test_cwd_is_the_workdir_and_importable(agent: Agent) -> None:
    (agent.workdir / "mymod.py").write_text("VALUE = 7\n")
    result = agent.run("import os, mymod; (os.getcwd(), mymod.VALUE)")
    assert result.done["result"] == repr((str(agent.workdir), 7))


def test_a_50_mb_flood_flows_with_bounded_memory(agent: Agent) -> None:
    run_id = agent.submit("import os; os.system('yes | head -c 50000000')", timeout_s=60)
    received = 0
    while (message := agent.receive())["ev"] == "stream":
        if message["name"] == "stdout":  # stderr has yes's "Broken pipe"
            received += len(message["text"])
    assert message["ev"] == "done" and message["status"] == "ok" and message["id"] == run_id
    assert received == 50_000_000
    status = Path(f"/proc/{agent.proc.pid}/status").read_text()
    peak_kib = int(status.split("VmHWM:")[1].split()[0])
    assert peak_kib < 100 * 1024, f"supervisor peaked at {peak_kib} KiB"
    assert agent.run("'still here'").done["result"] == "'still here'"


def test_ipython_traceback_leaves_out_the_agents_frames(ipy: Agent) -> None:
    # savefig is the agent's wrapper around matplotlib's: a failure inside it must read
    # as the user's call and matplotlib's frames, as on the plain path.
    code = "import matplotlib.pyplot as plt\nfig = plt.figure()\nfig.savefig(3.5)"
    error = ipy.run(code).done["error"]
    assert error["name"] == "AttributeError"
    assert "fig.savefig(3.5)" in error["traceback"]
    assert "matplotlib" in error["traceback"]
    assert "mcp_code_sandbox" not in error["traceback"]
    assert str(SRC) not in error["traceback"]


def test_deadline_ends_a_sleeping_cell(agent: Agent) -> None:
    # The agent's own deadline, with nothing asserted that depends on when the cell got
    # the CPU: on a loaded machine it may not have printed yet, or the grace may run out.
    agent.run("x = 1")
    started = time.monotonic()
    result = agent.run("import time\nprint('before', flush=True)\ntime.sleep(30)", timeout_s=0.5)
    assert time.monotonic() - started < 20  # interrupted, not slept out
    assert result.status == "timeout"
    assert "before\n".startswith(result.stdout)
    after = agent.run("x").done
    assert after["result"] == ("1" if not result.done["state_lost"] else None)


def _wait_for_output(agent: Agent, text: str) -> str:
    seen = ""
    while seen != text:  # print may arrive in pieces
        seen += agent.receive()["text"]
    return seen


def test_timeout_interrupts_and_keeps_state(agent: Agent) -> None:
    # A timeout once the cell has printed and is sleeping: the interrupt the deadline
    # sends, sent when the output is known to be out (independent of machine load).
    agent.run("x = 1")
    run_id = agent.submit("import time\nprint('before', flush=True)\ntime.sleep(30)")
    seen = _wait_for_output(agent, "before\n")
    agent.send({"op": "interrupt", "id": run_id, "reason": "timeout"})
    result = agent.collect(run_id)
    assert result.status == "timeout" and result.done["state_lost"] is False
    assert seen + result.stdout == "before\n"
    assert result.done["error"]["name"] == "KeyboardInterrupt"
    assert "mcp_code_sandbox" not in result.done["error"]["traceback"]
    assert agent.run("x").done["result"] == "1"


def test_timeout_of_code_ignoring_sigint_kills_and_restarts(agent: Agent) -> None:
    agent.run("x = 1")
    code = "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True: pass"
    result = agent.run(code, timeout_s=0.3)
    assert result.status == "timeout" and result.done["state_lost"] is True
    after = agent.run("x")
    assert after.done["error"]["name"] == "NameError"
    assert after.done["state_lost"] is False
    assert agent.run("1").done["result"] == "1"


def test_interrupt_op_cancels(agent: Agent) -> None:
    run_id = agent.submit("import time\nprint('go', flush=True)\ntime.sleep(30)")
    _wait_for_output(agent, "go\n")
    agent.send({"op": "interrupt", "id": run_id, "reason": "cancelled"})
    result = agent.collect(run_id)
    assert result.status == "cancelled" and result.done["state_lost"] is False


def test_interrupt_of_an_unknown_run_is_ignored(agent: Agent) -> None:
    agent.send({"op": "interrupt", "id": 999, "reason": "cancelled"})
    assert agent.run("3").done["result"] == "3"


@pytest.mark.parametrize(
    ("code", "expected"),
    [("import os; os._exit(3)", "code 3"), ("import os; os.kill(os.getpid(), 9)", "SIGKILL")],
)
def test_kernel_death_is_reported_and_recovered(agent: Agent, code: str, expected: str) -> None:
    agent.run("x = 1")
    result = agent.run(code)
    assert result.status == "error" and result.done["state_lost"] is True
    assert result.done["error"]["name"] == "KernelDied"
    assert expected in result.done["error"]["value"]
    if expected == "SIGKILL":
        assert "memory" in result.done["error"]["value"]
    assert agent.run("'x' in dir()").done["result"] == "False"


#: What a kernel shows of itself: started as ``-m ….kernel`` or forked from the agent
#: (whose command line it keeps), its fds past stdio, whether it is dumpable, and what
#: user code sees (names, ``sys.path``, ``sys.argv``, the environment, the collector on
#: and the start's objects frozen).
KERNEL_SELF = """
import ctypes, gc, json, os, sys
def _fds():
    fds = sorted(map(int, os.listdir('/proc/self/fd')))
    alive = [fd for fd in fds if fd > 2 and os.path.exists(f'/proc/self/fd/{fd}')]
    return [os.readlink(f'/proc/self/fd/{fd}').split(':')[0] for fd in alive]
print(json.dumps({
    'forked': b'.kernel' not in open('/proc/self/cmdline', 'rb').read(),
    'fds': _fds(),
    'dumpable': ctypes.CDLL(None).prctl(3, 0, 0, 0, 0),
    'names': sorted(n for n in dir() if not n.startswith('_')),
    'path': sys.path,
    'argv': sys.argv[1:],
    'env': dict(os.environ),
    'gc': [gc.isenabled(), gc.get_freeze_count() > 0],
}))
"""


def test_the_first_kernel_is_forked_and_looks_like_a_new_one(agent: Agent) -> None:
    """The first kernel is forked from the agent (``agent.forked``); after its death the
    next one is a new interpreter. User code cannot tell them apart, and the forked one
    holds nothing of the agent's: no fd but its control socket, dumpable again."""
    first = agent.run(KERNEL_SELF)
    assert first.done["execution_count"] == 1
    forked = json.loads(first.stdout)
    assert agent.run("import os; os._exit(3)").done["error"]["name"] == "KernelDied"
    second = agent.run(KERNEL_SELF)
    assert second.done["execution_count"] == 1
    fresh = json.loads(second.stdout)
    assert forked.pop("forked") is True and fresh.pop("forked") is False
    assert forked["fds"] == ["socket"] and forked["dumpable"] == 1
    assert forked["gc"] == [True, True]  # off only for the start's imports
    assert forked["argv"][2:] == fresh["argv"][2:]  # but the control socket's fd number
    del forked["argv"], fresh["argv"]
    assert forked == fresh


#: Which of the kernel's deferred modules (``kernel.deferred``) are imported, and which
#: standard modules they import at their top are not imported yet.
DEFERRED_SEEN = """
import ast, json, os, sys
kernel = next(
    m for n, m in list(sys.modules.items()) if n.endswith('kernel') and hasattr(m, 'deferred')
)
pkg = kernel.__name__.rpartition('.')[0]
names = ['state', 'stateload', 'statewrite', 'statefiles', 'plain', 'tables']
missing = set()
for name in names:
    with open(os.path.join(os.path.dirname(kernel.__file__), name + '.py')) as source:
        tree = ast.parse(source.read())
    for node in tree.body:
        if isinstance(node, ast.Import):
            missing |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            missing.add(node.module)
print(json.dumps({
    'loaded': [n for n in names if f'{pkg}.{n}' in sys.modules],
    'missing': sorted(m for m in missing if m not in sys.modules and m != '__future__'),
}))
"""


def test_modules_the_kernel_imports_late_cannot_be_shadowed_by_workspace_files(
    agent: Agent,
) -> None:
    """The kernel imports its pause and plain-shell modules at their first use, when the
    workspace is first on ``sys.path``: every standard module they import must be
    imported already (by IPython's start; a plain kernel imports them at its start), so
    that a workspace file named like one (``pickle.py``) never stands in for it."""
    seen = json.loads(agent.run(DEFERRED_SEEN).stdout)
    assert seen["missing"] == []
    ipython = agent.ready["ipython"]
    assert seen["loaded"] == (
        [] if ipython else ["state", "stateload", "statewrite", "statefiles", "plain"]
    )
    for name in ("pickle", "shutil", "dataclasses"):
        (agent.workdir / f"{name}.py").write_text("raise SystemExit('a workspace module')\n")
    agent.run("x = 41")
    saved = agent.run("", state="save", max_bytes=1 << 20)
    assert saved.status == "ok", saved.done
    assert "x" in [k["name"] for k in json.loads(saved.done["result"])["kept"]]


def test_a_kernel_that_cannot_start_is_reported_with_its_stderr(tmp_path: Path) -> None:
    # The forked kernel's chdir into a workdir that is not there fails before its ready.
    agent = Agent(sys.executable, tmp_path / "missing", plain=True)
    message = agent.ready
    assert message["ev"] == "error", message
    assert "before ready" in message["message"]
    assert "FileNotFoundError" in message["message"]
    assert agent.close() == 1


def test_env_applies_to_one_cell(agent: Agent) -> None:
    code = "import os; print(os.environ['MCS_T']); os.system('echo $MCS_T')"
    assert agent.run(code, env={"MCS_T": "v1"}).stdout == "v1\nv1\n"
    assert agent.run("import os; 'MCS_T' in os.environ").done["result"] == "False"


def test_queued_execs_run_in_order(agent: Agent) -> None:
    first = agent.submit("import time; time.sleep(0.2); 1")
    second = agent.submit("2")
    assert agent.collect(first).done["result"] == "1"
    assert agent.collect(second).done["result"] == "2"


def test_restart_gives_a_fresh_interpreter_and_keeps_the_files(agent: Agent) -> None:
    agent.run("x = 1\nopen('kept.txt', 'w').write('k')")
    spawn = "import subprocess; p = subprocess.Popen(['sleep', '300']); p.pid"
    child = int(agent.run(spawn).done["result"])
    agent.send({"op": "restart", "id": 50})
    assert agent.receive() == {"ev": "restarted", "id": 50}
    after = agent.run("x")
    assert after.done["error"]["name"] == "NameError"
    assert after.done["state_lost"] is False and after.done["execution_count"] == 1
    assert _is_zombie(child)  # killed with the interpreter that started it
    assert agent.run("open('kept.txt').read()").done["result"] == "'k'"


def test_restart_waits_for_the_run_before_it(agent: Agent) -> None:
    first = agent.submit("import time; time.sleep(0.2); y = 2; y")
    agent.send({"op": "restart", "id": 60})
    assert agent.collect(first).done["result"] == "2"
    assert agent.receive() == {"ev": "restarted", "id": 60}
    assert agent.run("'y' in dir()").done["result"] == "False"


def test_restart_without_an_integer_id_is_an_error(agent: Agent) -> None:
    agent.send({"op": "restart", "id": "a"})
    message = agent.receive()
    assert message["ev"] == "error" and message["id"] == "a"
    assert agent.run("3").done["result"] == "3"


def test_display_of_markdown_and_png(agent: Agent) -> None:
    code = (
        "class Md:\n"
        "    def _repr_markdown_(self): return '# hi'\n"
        "class Png:\n"
        "    def _repr_png_(self): return b'\\x89PNG fake'\n"
        "display(Md()); display(Png())"
    )
    result = agent.run(code)
    assert result.status == "ok", result.done
    md, png = (d["data"] for d in result.displays)
    assert md["text/markdown"] == "# hi" and "text/plain" in md
    assert png["image/png"] == "iVBORyBmYWtl" and "text/plain" in png
    assert all(d["source"] == "display" for d in result.displays)


def test_bash_program(agent: Agent) -> None:
    result = agent.run(
        "echo out; echo err >&2; pwd; echo $MCS_T; exit 3", language="bash", env={"MCS_T": "e"}
    )
    assert result.status == "error" and result.done["exit_code"] == 3
    assert result.stdout == f"out\n{agent.workdir}\ne\n" and result.stderr == "err\n"
    assert result.done["execution_count"] is None
    ok = agent.run("true", language="bash")
    assert ok.status == "ok" and ok.done["exit_code"] == 0


def test_bash_timeout(agent: Agent) -> None:
    started = time.monotonic()
    result = agent.run("echo start; sleep 30", language="bash", timeout_s=0.3)
    # Interrupted, not waited for: far below the sleep (not a speed check: a loaded
    # machine takes seconds to schedule the kill).
    assert time.monotonic() - started < 20
    # On a loaded machine bash may not have echoed before the deadline: whatever it
    # printed is kept, nothing else.
    assert result.status == "timeout" and "start\n".startswith(result.stdout)
    # SIGINT ends it (130); on a loaded machine the grace may run out first, or the
    # deadline may come before bash set up its handlers, and the group is killed (137).
    # Either way it is gone and the result says timeout.
    assert result.done["exit_code"] in (128 + signal.SIGINT, 128 + signal.SIGKILL)


def test_bash_timeout_keeps_the_output_so_far(agent: Agent) -> None:
    run_id = agent.submit("echo start; sleep 30", language="bash")
    seen = _wait_for_output(agent, "start\n")
    agent.send({"op": "interrupt", "id": run_id, "reason": "timeout"})
    result = agent.collect(run_id)
    assert result.status == "timeout" and seen + result.stdout == "start\n"
    assert result.done["exit_code"] in (128 + signal.SIGINT, 128 + signal.SIGKILL)


def test_malformed_frames_get_error_events(agent: Agent) -> None:
    body = b"not json"
    agent.sock.sendall(HEADER.pack(len(body)) + body)
    assert agent.receive()["ev"] == "error"
    agent.send({"op": "dance"})
    assert "dance" in agent.receive()["message"]
    agent.send({"op": "exec", "id": 5, "code": 1, "timeout_s": 1})
    bad = agent.receive()
    assert bad["ev"] == "error" and bad["id"] == 5
    agent.send({"op": "exec", "id": 6, "code": "1", "language": "cobol", "timeout_s": 1})
    assert "cobol" in agent.receive()["message"]
    assert agent.run("4").done["result"] == "4"


def test_eof_on_the_channel_ends_the_agent_and_kernel(agent: Agent) -> None:
    kernel_pid = int(agent.run("import os; os.getpid()").done["result"])
    assert agent.close() == 0
    assert not Path(f"/proc/{kernel_pid}").exists() or _is_zombie(kernel_pid)
    assert agent.proc.stdout is not None


def test_user_processes_inherit_no_agent_fd(agent: Agent) -> None:
    result = agent.run("import os; os.system('ls /proc/self/fd')")
    assert result.stdout.split() == ["0", "1", "2", "3"]  # 3: ls's own directory handle


def test_rlimits_from_the_config(tmp_path: Path) -> None:
    config = {**CONFIG, "memory_bytes": 300 * 2**20, "file_bytes": 2**20}
    agent = Agent(sys.executable, tmp_path, plain=True, config=config)
    try:
        big = agent.run("b = bytearray(600 * 2**20)").done
        assert big["error"]["name"] == "MemoryError" and big["state_lost"] is False
        write = agent.run("open('f', 'wb').write(bytes(2**21))").done
        assert write["error"]["name"] == "OSError" and "too large" in write["error"]["value"]
        assert (
            agent.run("import resource; resource.getrlimit(resource.RLIMIT_CORE)").done["result"]
            == "(0, 0)"
        )
        bash = agent.run("ulimit -f; ulimit -c", language="bash")
        assert bash.stdout.split() == ["1024", "0"]  # bash counts KiB
    finally:
        assert agent.close() == 0


@pytest.mark.bwrap
def test_kill_strays_in_its_own_pid_namespace(tmp_path: Path) -> None:
    # The agent is pid 1 of a new pid namespace, as in a container without an init.
    prefix = ("unshare", "--pid", "--fork", "--mount-proc", "--kill-child")
    config = {**CONFIG, "kill_strays": True}
    agent = Agent(sys.executable, tmp_path, plain=True, config=config, prefix=prefix)
    try:
        assert agent.run("import os; os.getpid()").done["result"] != "1"
        spawn = "import subprocess; p = subprocess.Popen(['setsid', 'sleep', '300']); p.pid"
        escaped = agent.run(spawn).done["result"]
        stuck = "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True: pass"
        assert agent.run(stuck, timeout_s=0.2).done["state_lost"] is True
        time.sleep(1.5)  # the reaper's tick
        gone = agent.run(f"import os; os.path.exists('/proc/{escaped}')").done
        assert gone["result"] == "False"
        agent.run("x = 1")
        bash = agent.run("setsid sleep 300 & echo $!; sleep 30", language="bash", timeout_s=0.3)
        assert bash.status == "timeout"
        assert agent.run("x").done["result"] == "1"  # the kernel was spared
    finally:
        assert agent.close() == 0


def test_shutdown_and_sigterm_exit_cleanly(tmp_path: Path) -> None:
    one = start_agent("plain", tmp_path)
    one.send({"op": "shutdown"})
    assert one.proc.wait(timeout=10) == 0
    one.close()
    two = start_agent("plain", tmp_path)
    two.proc.send_signal(signal.SIGTERM)
    assert two.proc.wait(timeout=10) == 0
    two.close()


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


# -- IPython and matplotlib (the runtime interpreter only) ------------------------------


def test_ipython_magics_shell_and_rich_display(ipy: Agent) -> None:
    result = ipy.run("%cd .\n!echo bang\nfrom IPython.display import Markdown\nMarkdown('*m*')")
    assert result.status == "ok", result.done
    assert "bang\n" in result.stdout and "Out[" not in result.stdout
    assert result.done["result"] == "*m*"  # its markdown, once: not "<...Markdown object>"
    assert result.displays == []
    assert ipy.run("_").done["result"] == "*m*"
    assert ipy.run("1;").done["result"] is None  # a trailing semicolon hides it, like Jupyter


def test_the_first_cell_of_a_kernel_that_warmed_up_is_its_first(ipy: Agent) -> None:
    # The kernel ran its warm-up after ready (``warm_up``): no count, history or result.
    first = ipy.run("len(In), len(Out), _")
    assert first.done["execution_count"] == 1
    assert first.done["result"] == "(2, 0, '')"


def test_ipython_usage_error_is_an_error(ipy: Agent) -> None:
    result = ipy.run("%no_such_magic")
    assert result.status == "error" and result.done["error"]["name"] == "UsageError"


def test_two_figures_are_captured_and_closed(ipy: Agent) -> None:
    code = "import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.figure(); plt.plot([3, 4]); None"
    result = ipy.run(code)
    assert result.status == "ok", result.done
    figures = [d for d in result.displays if d["source"] == "figure"]
    assert len(figures) == 2
    assert all(d["data"]["image/png"].startswith("iVBOR") for d in figures)
    assert ipy.run("plt.get_fignums()").done["result"] == "[]"


def test_show_captures_in_order_without_warning(ipy: Agent) -> None:
    code = (
        "import matplotlib.pyplot as plt\n"
        "plt.plot([1]); plt.show()\n"
        "print('between', flush=True)\n"
        "plt.plot([2]); plt.show()"
    )
    result = ipy.run(code)
    assert result.status == "ok", result.done
    kinds = [e["ev"] for e in result.events]
    kinds = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]  # "between", "\n"
    assert kinds == ["display", "stream", "display", "done"]
    assert result.stderr == ""


def test_savefig_into_workdir_is_not_captured_twice(ipy: Agent) -> None:
    code = (
        "import matplotlib.pyplot as plt\n"
        "plt.plot([1]); plt.savefig('a.png')\n"
        "plt.figure(); plt.plot([2]); plt.savefig('/tmp/mcs-test-elsewhere.png'); None"
    )
    result = ipy.run(code)
    assert result.status == "ok", result.done
    assert (ipy.workdir / "a.png").exists()
    assert len(result.displays) == 1  # only the figure saved outside the workspace
    assert ipy.run("plt.get_fignums()").done["result"] == "[]"


def test_a_pandas_result_is_one_markdown_table(ipy: Agent) -> None:
    agent = ipy
    result = agent.run("import pandas as pd\npd.DataFrame({'a': [177.48850000000002, 1.5]})")
    table = "|  | a |\n| --- | --- |\n| 0 | 177.4885 |\n| 1 | 1.5000 |"
    assert result.done["result"] == table
    assert result.displays == []  # not also as a display
    shown = agent.run("display(pd.DataFrame({'b': [0.1 + 0.2]}))")
    assert [d["data"]["text/markdown"] for d in shown.displays] == [
        "|  | b |\n| --- | --- |\n| 0 | 0.3 |"
    ]
    series = agent.run("pd.Series([1, 2])")  # only frames: a Series is its text
    assert series.displays == [] and series.done["result"]


def test_latex_json_and_html_come_back_marked_by_their_type(agent: Agent) -> None:
    code = (
        "class Rich:\n"
        "    def __init__(self, **forms): self.forms = forms\n"
        "    def _repr_latex_(self): return self.forms.get('latex')\n"
        "    def _repr_json_(self): return self.forms.get('json')\n"
        "    def _repr_html_(self): return self.forms.get('html')\n"
        "display(Rich(latex='$x^2$')); display(Rich(json={'a': [1]}))\n"
        "display(Rich(html='<b>hi</b>'))\n"
        "Rich(html='<i>value</i>')"
    )
    result = agent.run(code)
    assert result.status == "ok", result.done
    picked = [{k: v for k, v in d["data"].items() if k != "text/plain"} for d in result.displays]
    assert picked == [
        {"text/latex": "$x^2$"},
        {"application/json": '{"a": [1]}'},
        {"text/html": "<b>hi</b>"},
        {"text/html": "<i>value</i>"},
    ]
    assert result.done["result"] is None  # not "<__main__.Rich object at 0x...>"
    assert result.done["cut"].get("displays_unsupported", 0) == 0


def test_a_display_with_no_form_a_result_carries_is_counted(ipy: Agent) -> None:
    code = (
        "class Js:\n"
        "    def _repr_mimebundle_(self, include=None, exclude=None):\n"
        "        return {'application/javascript': 'alert(1)'}\n"
        "display(Js())"
    )
    result = ipy.run(code)
    assert result.status == "ok", result.done
    assert [sorted(d["data"]) for d in result.displays] == [["text/plain"]]
    assert result.done["cut"]["displays_unsupported"] == 1


def test_an_artist_beside_its_figure_is_no_result(ipy: Agent) -> None:
    result = ipy.run("import matplotlib.pyplot as plt\nplt.plot([1, 2])")
    assert result.done["result"] is None, result.done
    assert [d["source"] for d in result.displays] == ["figure"]
    axes = ipy.run("fig, ax = plt.subplots()\nax")
    assert axes.done["result"] is None
    # Without a figure drawn by the cell, an artist is a value like any other.
    plt_closed = ipy.run("import matplotlib.lines as ml\n[ml.Line2D([0], [1])]")
    assert plt_closed.done["result"].startswith("[<matplotlib.lines.Line2D")


def test_pil_show_returns_the_image(ipy: Agent) -> None:
    code = "from PIL import Image\nImage.new('RGB', (8, 8), 'red').show()"
    result = ipy.run(code)
    assert result.status == "ok", result.done
    assert [sorted(d["data"]) for d in result.displays] == [["image/png", "text/plain"]]
    assert result.done["result"] is None and result.stderr == ""


def test_a_figure_value_is_its_image_not_its_repr(ipy: Agent) -> None:
    result = ipy.run("import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.gcf()")
    assert result.done["result"] is None, result.done
    assert [sorted(d["data"]) for d in result.displays] == [["image/png", "text/plain"]]


def test_a_figure_value_has_no_result_in_the_plain_shell(tmp_path: Path) -> None:
    agent = start_agent("plain", tmp_path)
    try:
        code = "class Figure:\n    pass\nFigure.__module__ = 'matplotlib.figure'\nFigure()"
        assert agent.run(code).done["result"] is None
        assert agent.run("object()").done["result"]  # other values are still their repr
    finally:
        assert agent.close() == 0
