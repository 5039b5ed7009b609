"""Entry point: ``python -m mcs_agent (--channel-fd N | --connect PATH | --listen ADDR:PORT
--ca PATH) --config JSON``.

The backend starts the agent this way (see ``mcp_code_sandbox.layout.agent_argv``); on the host the
same package runs as ``python -m mcp_code_sandbox.agent``. fds 0-2 are whatever the
backend gave (/dev/null): nothing is ever written there, everything goes over the channel.

The channel is either an inherited, connected socket (``--channel-fd``: bwrap's
socketpair) or a Unix socket the host listens on (``--connect``: the docker backend, whose
containers inherit no fds). A path that is not there yet, or refuses, is retried for
``CONNECT_WAIT_S``; after that the agent exits 1 with one line on stderr. With
``--connect`` the agent also survives the host going away: it reconnects to the same path
for ``--reconnect-s`` seconds (see :mod:`.hostlink`). With ``--listen`` (Kubernetes) the
agent listens on TCP and servers connect to it, each proving itself with a certificate
signed by the CA in ``--ca`` (see :mod:`.listener`); an address it cannot listen on, or a
CA file it cannot read, makes it exit 1 with one line on stderr.

The first thing the agent does is make itself non-dumpable. User code runs under the
agent's uid, and to the kernel "same uid, dumpable" means "may ptrace": it could open
``/proc/<agent>/mem`` read-write, reopen the agent's fds through ``/proc/<agent>/fd`` and
read its environ, and so forge frames on the host channel or write into the host's log.
Non-dumpable, those files belong to root and every ptrace-mode access check fails. The
flag lives in the process's memory map: the kernel and programs the agent starts get a
fresh, dumpable one at exec, as they should (they are the user's).

The kernel is started as early as that allows (after the flag, the config check and the
egress bridge, which must all come before any user code: the kernel runs the session's
``.pth`` files), and before the agent imports the rest of itself: importing IPython in the
kernel is the slowest part of a sandbox's start, and the agent's own imports
run beside it instead of before it. The first kernel is forked from the agent
(:mod:`.forked`) rather than started as a second interpreter, unless a thread runs (the
egress bridge of a sandbox with network): one interpreter start and the standard library
both import are paid once.
"""

from __future__ import annotations

import gc

if __name__ == "__main__":  # the agent's start, not an import of ``main`` (tests)
    gc.disable()  # for the imports below too: see ``main``

import argparse
import contextlib
import ctypes
import os
import sys
from typing import TYPE_CHECKING

from . import packages
from .config import AgentConfig
from .egress import start_bridge
from .forked import can_fork, fork_kernel
from .hostlink import RECONNECT_GIVE_UP_S, HostLink, connect
from .kernelproc import KernelProcess, KernelStartError, spawn_kernel
from .protocol import write_frame

if TYPE_CHECKING:
    from .listener import Listener

# Not imported here: .supervisor (and what it imports), after the kernel is spawned.

CONNECT_WAIT_S = 10.0
_PR_SET_DUMPABLE = 4


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="mcs_agent")
    channel = parser.add_mutually_exclusive_group(required=True)
    channel.add_argument("--channel-fd", type=int)
    channel.add_argument("--connect", metavar="PATH", help="a Unix socket the host listens on")
    channel.add_argument("--listen", metavar="ADDR:PORT", help="listen for servers (TLS)")
    parser.add_argument("--ca", metavar="PATH", help="with --listen: the servers' CA certificate")
    parser.add_argument("--config", default="{}", help="JSON: kill_strays, pids, ...")
    parser.add_argument("--workdir", default="/mnt/data", help="where code runs")
    parser.add_argument("--plain", action="store_true", help="never use IPython")
    parser.add_argument(
        "--reconnect-s",
        type=float,
        default=RECONNECT_GIVE_UP_S,
        help="with --connect: how long to wait for a host that went away before exiting",
    )
    args = parser.parse_args(argv)
    if (args.listen is None) != (args.ca is None):
        parser.error("--listen and --ca go together")
    return args


def make_undumpable() -> None:
    """``prctl(PR_SET_DUMPABLE, 0)``; raises ``OSError``: an agent that user code could
    reach into does not start (there is no ``prctl`` in the standard library but ctypes)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"prctl(PR_SET_DUMPABLE, 0) failed: errno {code}")


def main(argv: list[str] | None = None) -> int:
    # The start's imports (the supervisor's here; the kernel's own and IPython's in the
    # forked kernel, which inherits this) make many objects and few cycles: without the
    # cyclic collector's passes over them, a one-CPU sandbox starts measurably sooner. On
    # again once the supervisor is imported, and in the kernel before its ready.
    gc.disable()
    try:
        return _main(argv)
    finally:
        gc.enable()


def _main(argv: list[str] | None) -> int:
    try:
        make_undumpable()
    except OSError as exc:
        print(f"agent: {exc}", file=sys.stderr)
        return 1
    args = _parse(argv)
    listener: Listener | None = None
    if args.listen is not None:
        channel: int | None = None
        try:
            listener = _listen(args.listen, args.ca)
        except (ValueError, OSError) as exc:  # ssl.SSLError is an OSError
            print(f"agent: cannot listen on {args.listen}: {exc}", file=sys.stderr)
            return 1
    elif args.connect is None:
        channel = args.channel_fd
    else:
        try:
            channel = connect(args.connect, CONNECT_WAIT_S)
        except OSError as exc:
            print(f"agent: cannot connect to {args.connect}: {exc}", file=sys.stderr)
            return 1
    try:
        config = AgentConfig.from_json(args.config)
        # Before any user code: the bridge's port must be the agent's (see .egress).
        start_bridge()
        kernel = _spawn_kernel(args.workdir, config, args.plain)
    except (ValueError, OSError) as exc:
        _report(channel, f"agent failed: {type(exc).__name__}: {exc}")
        return 1
    from .supervisor import AgentExit, Supervisor  # while the kernel boots

    gc.freeze()
    gc.enable()
    try:
        link = HostLink(channel, args.connect, args.reconnect_s, listener)
        supervisor = Supervisor(link, args.workdir, config, args.plain, kernel)
        if channel is None or args.connect is not None:  # up to here, errors explain a failed start
            _stdio_to_null()
        return supervisor.serve()
    except AgentExit as exit_:  # e.g. SIGTERM before the loop started
        return exit_.code
    except (KernelStartError, ValueError, OSError) as exc:
        _report(channel, f"agent failed: {type(exc).__name__}: {exc}")
        return 1


def _listen(address: str, cafile: str) -> Listener:
    from .listener import Listener, parse_address  # ssl: only for a listening agent

    return Listener(parse_address(address), cafile)


def _spawn_kernel(workdir: str, config: AgentConfig, plain: bool) -> KernelProcess:
    """The first kernel, with the session's packages in its environment as the
    supervisor will have them in its own (``Supervisor`` adds them to ``os.environ``):
    forked where the agent runs no thread, else a new interpreter."""
    env = {**os.environ, **packages.environ(workdir, os.environ)}
    if can_fork():
        return fork_kernel(workdir, config, plain, env)
    return spawn_kernel(workdir, config, plain, env)


def _stdio_to_null() -> None:
    """Before any user code runs, fds 0-2 become /dev/null: from here on everything goes
    over the channel.

    With ``--connect`` (docker) or ``--listen`` (a pod) they are the container's log
    pipes. Linux keeps them from user code (the agent is not dumpable), but gVisor lets a
    process of the same uid reopen another's pipes through ``/proc/<pid>/fd`` regardless:
    nothing of the engine's should be there to reopen."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)


def _report(channel: int | None, message: str) -> None:
    if channel is None:  # listening, no server yet: stderr is the pod's log
        print(f"agent: {message}", file=sys.stderr)
        return
    with contextlib.suppress(OSError):  # no channel: nobody to tell
        write_frame(channel, {"ev": "error", "message": message, "id": None})


if __name__ == "__main__":
    sys.exit(main())
