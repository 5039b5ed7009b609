"""The supervisor's handle on the kernel process: start it, wait for ``ready``, talk to it.

The kernel is ``python -s -B -m <package>.kernel`` started from the directory holding the
agent package (so ``-m`` finds it under either name, ``mcs_agent`` in the sandbox or
``mcp_code_sandbox.agent`` on the host); it changes to the workspace itself. The first
kernel of a sandbox is usually forked from the agent instead (:mod:`.forked`), with the
same arguments (:func:`kernel_argv`); from here on both are the same to the supervisor.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from .children import Child, spawn
from .config import AgentConfig
from .protocol import FrameDecoder, ProtocolError, write_frame

__all__ = [
    "KERNEL_START_S",
    "KernelProcess",
    "KernelStartError",
    "await_ready",
    "kernel_argv",
    "spawn_kernel",
    "start_kernel",
]

#: Importing IPython on a slow, CPU-limited sandbox can take seconds; ten times that.
KERNEL_START_S = 60.0
_STDERR_KEEP = 4000


class KernelStartError(Exception):
    """The kernel exited or stayed silent before saying ``ready``; carries its stderr."""


class KernelProcess:
    def __init__(self, child: Child, control: socket.socket) -> None:
        self.child = child
        self.control = control
        self.decoder = FrameDecoder()
        self.ipython = False
        self.version = ""

    def send(self, message: dict[str, Any]) -> None:
        write_frame(self.control, message)

    def receive(self) -> list[dict[str, Any]] | None:
        """Whole messages waiting on the control socket; ``None`` when it closed."""
        try:
            data = self.control.recv(1 << 20)
        except (ConnectionResetError, BlockingIOError):
            data = b""
        if not data:
            return None
        return self.decoder.feed(data)

    def close(self) -> None:
        self.child.close()
        with contextlib.suppress(OSError):
            self.control.close()


def _lib_dir() -> str:
    # os.path, not pathlib: the agent imports nothing it does not need before its
    # kernel starts (pathlib and what it imports would weigh on every sandbox's start).
    package = __package__ or "mcs_agent"
    path = os.path.abspath(__file__)
    for _ in range(package.count(".") + 2):
        path = os.path.dirname(path)
    return path


def start_kernel(
    workdir: str, config: AgentConfig, plain: bool, meanwhile: Callable[[], None] | None = None
) -> KernelProcess:
    """Start a kernel and wait for its ``ready``; ``meanwhile`` runs while it boots (its
    IPython import is the slowest part of a sandbox's start)."""
    return await_ready(spawn_kernel(workdir, config, plain, os.environ), meanwhile)


def spawn_kernel(
    workdir: str, config: AgentConfig, plain: bool, env: Mapping[str, str]
) -> KernelProcess:
    """Start a kernel with ``env`` and return at once; :func:`await_ready` waits for it.

    The agent's ``main`` calls this before it imports the rest of the agent, so that the
    kernel boots while the agent finishes its own start (see ``__main__``)."""
    ours, theirs = socket.socketpair()
    argv = [sys.executable, "-s", "-B", "-m", f"{__package__}.kernel"]
    argv += kernel_argv(theirs.fileno(), workdir, config, plain)
    try:
        child = spawn(argv, cwd=_lib_dir(), env=env, pass_fds=[theirs.fileno()])
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return KernelProcess(child, ours)


def kernel_argv(control: int, workdir: str, config: AgentConfig, plain: bool) -> list[str]:
    """The kernel's arguments (after ``-m <package>.kernel``); also what a forked kernel
    parses (:mod:`.forked`)."""
    argv = ["--control-fd", str(control), "--workdir", workdir, "--config", config.to_json()]
    if plain:
        argv.append("--plain")
    return argv


def await_ready(
    kernel: KernelProcess, meanwhile: Callable[[], None] | None = None
) -> KernelProcess:
    """Wait for the ``ready`` of a kernel from :func:`spawn_kernel`, running ``meanwhile``
    first; returns it. Raises ``KernelStartError`` (or what ``meanwhile`` raised) with
    the kernel killed and closed."""
    try:
        if meanwhile is not None:
            meanwhile()
        _await_ready(kernel)
    except BaseException:
        kernel.child.kill_and_reap()
        kernel.close()
        raise
    return kernel


def _await_ready(kernel: KernelProcess) -> None:
    stderr: list[str] = []
    deadline = time.monotonic() + KERNEL_START_S
    with selectors.DefaultSelector() as sel:
        sel.register(kernel.control, selectors.EVENT_READ)
        for pipe in kernel.child.pipes:
            sel.register(pipe.fd, selectors.EVENT_READ, pipe)
        while (left := deadline - time.monotonic()) > 0:
            for key, _ in sel.select(left):
                if key.data is not None:  # startup chatter: kept for an error message
                    text = key.data.read()
                    if text is None:
                        sel.unregister(key.fd)
                    elif key.data.name == "stderr":
                        stderr.append(text)
                    continue
                try:
                    messages = kernel.receive()
                except ProtocolError as exc:
                    raise KernelStartError(f"bad frame from the kernel: {exc}") from None
                if messages is None:  # died: what it wrote last may not be read yet
                    kernel.child.stderr.drain(stderr.append)
                    raise KernelStartError(_startup_failure(kernel, stderr))
                for message in messages:
                    if message.get("ev") == "ready":
                        kernel.ipython = bool(message.get("ipython"))
                        kernel.version = str(message.get("version", ""))
                        return
    raise KernelStartError(f"no ready within {KERNEL_START_S:.0f} s")


def _startup_failure(kernel: KernelProcess, stderr: list[str]) -> str:
    with contextlib.suppress(Exception):
        kernel.child.proc.wait(timeout=2)
    code = kernel.child.returncode()
    return f"kernel exited (code {code}) before ready: {''.join(stderr)[-_STDERR_KEEP:]}"
