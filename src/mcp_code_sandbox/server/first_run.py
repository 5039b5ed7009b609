"""The first ``serve`` without the bwrap runtime environment: build it in the background.

``uvx mcp-code-sandbox`` on a new machine has no runtime env yet, and building it takes
minutes, longer than any client waits for ``initialize``. So :func:`runtime_preparation`
returns a :class:`~mcp_code_sandbox.backends.preparation.Preparation` whose job runs
``mcp-code-sandbox setup`` (the same provisioning, the same lock) as a child process, in
two steps so that Python runs as soon as it can:

1. ``setup --no-node``: the Python venv. Then sandboxes can start (``usable``).
2. ``setup``: Node.js and bun (it finds the venv current); then JavaScript and TypeScript
   are offered and clients are told that the tool list changed.

A child process, not a thread: the server stops it (its whole process group, pip
included) when it stops, and build-time code stays out of the server's process. Its
stdin and stdout are ``/dev/null`` (stdio mode's stdout is the protocol); its stderr lines
become the steps the waiting calls are told of (:class:`SetupSteps`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from collections import deque
from collections.abc import Callable

import structlog

from mcp_code_sandbox.backends.base import Backend
from mcp_code_sandbox.backends.bwrap.backend import BwrapBackend, bwrap_missing
from mcp_code_sandbox.backends.bwrap.runtime import runtime_packages, runtime_status
from mcp_code_sandbox.backends.preparation import Preparation, Step
from mcp_code_sandbox.errors import BackendUnavailable
from mcp_code_sandbox.sanitize import clean_text
from mcp_code_sandbox.settings import Settings

__all__ = ["WHAT", "SetupSteps", "runtime_preparation", "setup_argv"]

log = structlog.get_logger("mcp_code_sandbox.first_run")

WHAT = "building the sandbox runtime"
#: The longest line kept of ``setup``'s output (log, failure), and the longest failure.
_LINE_CHARS = 300
_FAILURE_CHARS = 2000
#: How long a stopped build may take to end before it is killed.
_TERM_GRACE_S = 5.0
#: pip found a package: by name from an index, or as a file (a local index, find-links).
_COLLECTING = re.compile(
    r"^\s*(?:Collecting ([A-Za-z0-9][A-Za-z0-9._-]*)"
    r"|Processing \S*?([A-Za-z0-9][A-Za-z0-9._]*?)-[0-9][^/\s]*\.(?:whl|tar\.gz|zip)\b)"
)
_UNPACKING = re.compile(r"^\s*Installing collected packages: (.*)$")
#: ``setup``'s own lines (provision/venv.py, node.py) by their first words, and the step
#: each one is told as: a client is not shown this server's paths. Other lines leave the
#: step as it was (the log has them all, at DEBUG).
_STEPS = (
    ("waiting for another build", "waiting for another build of it (another server's?)"),
    ("creating venv", "creating the Python environment"),
    ("installing npm packages", "installing the npm packages"),
    ("installing ", "installing the Python packages"),  # "installing pandas, ... with pip"
    ("installed into", "checking the Python environment"),
    ("runtime environment is up to date", "the Python environment is ready"),
    ("Node.js and bun at", "installing Node.js and bun"),
    ("fetching Node.js", "fetching Node.js"),
    ("fetching bun", "fetching bun"),
    ("fetching npm", "fetching npm"),
    ("installed Node.js", "checking Node.js and bun"),
    ("JavaScript and TypeScript are not available", "JavaScript and TypeScript are not available"),
    ("warning: JavaScript and TypeScript", "JavaScript and TypeScript are not available"),
    ("runtime environment ready", "finishing"),
)


def runtime_preparation(settings: Settings, backend: Backend) -> Preparation | None:
    """The background build for ``backend``, or ``None`` when there is nothing to build
    (another backend than bwrap, or a runtime env that is there and current). Called by
    the CLI's ``serve`` before the server starts; says a missing ``bwrap``, or a host
    where it cannot make user namespaces, once, here."""
    if not isinstance(backend, BwrapBackend):
        return None
    if (why := bwrap_missing()) is not None:
        log.warning(why)
    elif (problem := backend.find_host_problem()) is not None:
        log.error(problem)
    if runtime_status(settings).ok:
        return None

    async def job(step: Step, usable: Callable[[], None]) -> None:
        steps = SetupSteps(step, runtime_packages(settings))
        await _run_setup(setup_argv(settings, node=False), steps)
        status = await asyncio.to_thread(runtime_status, settings)
        if not status.ok:  # setup said it worked: believe the disk, not the exit code
            log.warning("sandbox runtime unusable after setup", detail=status.detail)
            raise status.unavailable()
        usable()
        await _run_setup(setup_argv(settings, node=True), steps)

    def blocked() -> str | None:
        return bwrap_missing() or backend.host_problem

    return Preparation(WHAT, job, blocked=blocked)


def setup_argv(settings: Settings, *, node: bool) -> list[str]:
    """``mcp-code-sandbox setup`` for this server's runtime dir and package list, run
    with the server's own interpreter (``uvx``'s environment has no command on PATH)."""
    argv = [sys.executable, "-m", "mcp_code_sandbox", "setup", "--log-level", "WARNING"]
    argv += ["--state-dir", str(settings.state_dir), "--runtime-dir", str(settings.runtime_dir)]
    if settings.runtime_packages:
        argv += ["--runtime-packages", ",".join(settings.runtime_packages)]
    # The host's AppArmor policy is a person's to change (`sudo mcp-code-sandbox setup`).
    return [*argv, "--no-apparmor", "--node" if node else "--no-node"]


class SetupSteps:
    """``setup``'s stderr, line by line, as steps a person understands.

    ``setup``'s own lines (not indented) become steps by their first words (:data:`_STEPS`).
    Of pip's output (indented by two spaces) only a requested package being found counts,
    ``Collecting <name>`` or ``Processing <file>`` (a local index): "installing pandas
    (3/10)"; and the install that follows the downloads: "unpacking 37 packages". The last
    lines are kept for a failure, from ``setup``'s own ``error:`` line on when it said one."""

    def __init__(self, step: Step, packages: tuple[str, ...]) -> None:
        self._step = step
        self._wanted = {_normal(name): name for name in packages}
        self._seen: list[str] = []
        self.tail: deque[str] = deque(maxlen=15)

    def line(self, text: str) -> None:
        text = clean_text(text.rstrip())  # whole: pip's install line names every package
        if not text.strip():
            return
        log.debug("setup", line=text[:_LINE_CHARS])
        if text.startswith("error: "):  # setup's last word: it repeats what failed
            self.tail.clear()
            text = re.sub(r"^error: ([a-z_]+: )?", "", text)
        self.tail.append(text.strip()[:_LINE_CHARS])
        if (match := _COLLECTING.match(text)) is not None:
            name = _normal(match.group(1) or match.group(2))
            if name in self._wanted and name not in self._seen:
                self._seen.append(name)
                total = len(self._wanted)
                self._step(f"installing {self._wanted[name]} ({len(self._seen)}/{total})")
        elif (match := _UNPACKING.match(text)) is not None:
            self._step(f"unpacking {match.group(1).count(',') + 1} packages")
        elif not text.startswith(" "):
            for prefix, step in _STEPS:
                if text.startswith(prefix):
                    self._step(step)
                    break


def _normal(name: str) -> str:
    """A package name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


async def _run_setup(argv: list[str], steps: SetupSteps) -> None:
    """Run ``argv``, feeding its stderr to ``steps``; raise its last words when it fails.
    Cancelled (the server stops): its process group is stopped, then killed."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # its own process group: pip and npm stop with it
            limit=1024 * 1024,
        )
    except OSError as exc:
        raise BackendUnavailable(f"cannot start `mcp-code-sandbox setup`: {exc}") from None
    assert proc.stderr is not None
    try:
        while True:
            try:
                raw = await proc.stderr.readline()
            except ValueError:  # a line over the limit: skip it
                continue
            if not raw:
                break
            steps.line(raw.decode("utf-8", "replace"))
        code = await proc.wait()
    except asyncio.CancelledError:
        await _stop(proc)
        raise
    if code != 0:
        said = "\n".join(steps.tail)[-_FAILURE_CHARS:]
        raise BackendUnavailable(f"`mcp-code-sandbox setup` exited with {code}:\n{said}")


async def _stop(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM to the build's process group, then SIGKILL after a grace period."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), _TERM_GRACE_S)
            return
