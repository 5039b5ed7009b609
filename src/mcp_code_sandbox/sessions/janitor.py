"""A private server's janitor: a small process that outlives the server and removes what
it leaves behind if it dies without ending its sessions.

A stdio server (or ``exec``) holds sessions that no other server will ever take over
(:mod:`.holder`). Its client may kill it at any moment (the MCP clients' shutdown is
stdin closed, a short wait, SIGTERM, a short wait, SIGKILL), and a SIGKILL runs no
cleanup: its Docker containers, loop-mounted workspaces and records would stay until some
later server on the state directory removed them (on a laptop, maybe never). So at start
such a server spawns this janitor (``python -m mcp_code_sandbox.sessions.janitor``) in a
session of its own, so that a signal to the server's process group does not reach it, and
keeps the only write end of a pipe to its stdin: the kernel closes that when the server
dies, however it dies.

Protocol on the janitor's stdin: one line of JSON (the server's settings, its backend's
name), then either ``done`` (the server ended everything it held: the janitor exits at
once) or EOF without it (the server is gone and may have left things: the janitor runs
the cleanup any later start would run, :func:`.recovery.recover` as a private server, which
removes what dead private servers left and never touches a live server's sessions or a
service's, then exits). Idle, it has imported nearly nothing: the cleanup's imports come
after EOF.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:  # the janitor's process imports these only when it has work to do
    from mcp_code_sandbox.backends.base import SandboxSpec
    from mcp_code_sandbox.sessions.records import SessionRecord
    from mcp_code_sandbox.settings import Settings

__all__ = ["Janitor", "main"]

_DONE = b"done"
#: How long the server waits for a dismissed janitor to exit (it exits at once).
_DISMISS_WAIT_S = 2.0


class Janitor:
    """The server's side: the process, and the pipe whose closing wakes it."""

    def __init__(self, proc: subprocess.Popen[bytes], pipe: IO[bytes]) -> None:
        self.proc = proc
        self._pipe: IO[bytes] | None = pipe

    @classmethod
    async def start(cls, settings: Settings, backend: str, instance: str) -> Janitor | None:
        """:meth:`spawn` in a worker thread; ``None`` (logged) when it cannot start: then
        the next start on the state directory removes what this server leaves."""
        import asyncio

        import structlog

        try:
            return await asyncio.to_thread(cls.spawn, settings, backend, instance)
        except OSError as exc:  # an interpreter this uid may run but not start again
            structlog.get_logger("mcp_code_sandbox.sessions.manager").warning(
                "no janitor: if this server is killed, the next start on its state "
                "directory removes what it leaves",
                error=str(exc),
            )
            return None

    @classmethod
    def spawn(cls, settings: Settings, backend: str, instance: str) -> Janitor:
        """Start the janitor of server ``instance`` (blocking: a fork and exec)."""
        proc = subprocess.Popen(
            [sys.executable, "-m", __name__],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,  # stdio mode: stdout is the protocol's
            start_new_session=True,
            close_fds=True,
        )
        assert proc.stdin is not None
        header = {
            "settings": settings.model_dump(mode="json"),
            "backend": backend,
            "instance": instance,
        }
        proc.stdin.write(json.dumps(header).encode() + b"\n")
        proc.stdin.flush()
        return cls(proc, proc.stdin)

    def dismiss(self) -> None:
        """The server ended everything it held: the janitor exits without work."""
        if self._pipe is None:
            return
        try:
            self._pipe.write(_DONE)
            self._pipe.close()
        except OSError:  # it died: there is nobody to tell
            pass
        self._pipe = None
        try:
            self.proc.wait(_DISMISS_WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main() -> int:
    stdin = sys.stdin.buffer
    header = stdin.readline()
    rest = stdin.read()  # until the server's end of the pipe closes
    if rest == _DONE or not header:
        return 0
    config = json.loads(header)
    import asyncio

    return asyncio.run(_clean(config))


async def _clean(config: dict[str, object]) -> int:
    from mcp_code_sandbox.logs import configure_logging
    from mcp_code_sandbox.settings import load_settings

    values = config["settings"]
    assert isinstance(values, dict)
    settings = load_settings({**values, "backend": config["backend"]}, environ={})
    configure_logging(settings)
    import structlog

    from mcp_code_sandbox.backends import create_backend
    from mcp_code_sandbox.sessions.recovery import recover

    log = structlog.get_logger("mcp_code_sandbox.sessions.janitor")
    log.info(
        "the server ended without cleaning up: removing what it left", server=config["instance"]
    )
    backend = create_backend(settings)
    try:
        await recover(
            settings,
            backend,
            instance=f"janitor-{os.getpid()}-{os.urandom(4).hex()}",
            spec_for=_never,
            uids=None,
            takes_over=False,
        )
    finally:
        await backend.aclose()
    log.info("cleaned up after the server", server=config["instance"])
    return 0


def _never(record: SessionRecord) -> SandboxSpec:
    raise AssertionError("a private server's janitor re-attaches nothing")


if __name__ == "__main__":
    sys.exit(main())
