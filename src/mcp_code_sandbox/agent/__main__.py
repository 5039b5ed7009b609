"""Entry point: ``python -m mcs_agent --channel-fd 3 --config JSON [--workdir DIR]``.

The backend starts the agent this way (see ``backends.base.agent_argv``); on the host the
same package runs as ``python -m mcp_code_sandbox.agent``. fds 0-2 are whatever the
backend gave (/dev/null): nothing is ever written there, everything goes over the channel.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from .config import AgentConfig
from .kernelproc import KernelStartError
from .protocol import write_frame
from .supervisor import AgentExit, Supervisor


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="mcs_agent")
    parser.add_argument("--channel-fd", type=int, required=True)
    parser.add_argument("--config", default="{}", help="JSON: kill_strays, pids, ...")
    parser.add_argument("--workdir", default="/mnt/data", help="where code runs")
    parser.add_argument("--plain", action="store_true", help="never use IPython")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        config = AgentConfig.from_json(args.config)
        supervisor = Supervisor(args.channel_fd, args.workdir, config, args.plain)
        return supervisor.serve()
    except AgentExit as exit_:  # e.g. SIGTERM before the loop started
        return exit_.code
    except (KernelStartError, ValueError, OSError) as exc:
        _report(args.channel_fd, f"agent failed: {type(exc).__name__}: {exc}")
        return 1


def _report(channel: int, message: str) -> None:
    with contextlib.suppress(OSError):  # no channel: nobody to tell
        write_frame(channel, {"ev": "error", "message": message, "id": None})


if __name__ == "__main__":
    sys.exit(main())
