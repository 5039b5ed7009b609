"""The docker backend's pure half: what it asks the engine for, as plain values.

:func:`container_kwargs` builds the whole ``containers.create`` call of a sandbox (and
:func:`.runners.runner_kwargs` a runner's from it), with the labels that say whose it
is, and nothing here talks to an engine (that is :mod:`.engine`), so all of it is
unit-tested without one (STYLE.md rule 4). See :mod:`.backend` for why the channel is a
Unix socket in a bind-mounted run dir.

Paths. Every mount the server gives the engine names a directory of the state dir as
the *engine* sees it, and every mount source the engine reports is one as the engine
sees it: :class:`.statedir.StateDir` translates between the two views when the server
runs in a container (a bind mount of a host dir, or a named volume: the appliance).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from docker.types import LogConfig, Ulimit

from mcp_code_sandbox.backends.base import SandboxSpec
from mcp_code_sandbox.backends.docker.statedir import StateDir
from mcp_code_sandbox.backends.seccomp import docker_seccomp_opt
from mcp_code_sandbox.errors import SandboxFailed
from mcp_code_sandbox.layout import (
    AGENT_LIB_DIR,
    EGRESS_DIR,
    WORKSPACE_DIR,
    agent_argv,
    sandbox_env,
)
from mcp_code_sandbox.settings import Settings

__all__ = [
    "CHANNEL_DIR",
    "LABEL_INSTANCE",
    "LABEL_KEY",
    "LABEL_NETWORK",
    "LABEL_OWNER",
    "LABEL_RUNNER",
    "LABEL_RUN_DIR",
    "LABEL_SESSION",
    "LABEL_UID",
    "LABEL_WORKSPACE",
    "SOCKET_NAME",
    "container_kwargs",
    "engine_path",
    "sandbox_ids",
    "security_opt",
    "server_path",
    "uid_from_label",
]

_PREFIX = "mcp-code-sandbox"
LABEL_OWNER = f"{_PREFIX}.owner"
LABEL_SESSION = f"{_PREFIX}.session"
LABEL_KEY = f"{_PREFIX}.key"
LABEL_INSTANCE = f"{_PREFIX}.instance"
#: On a runner's container (:mod:`.runners`): its language.
LABEL_RUNNER = f"{_PREFIX}.runner"
#: On a container: "true" when it has network (the egress proxy's socket bound in).
LABEL_NETWORK = f"{_PREFIX}.network"
#: Name of the sandbox's run dir under ``settings.run_dir``, removed with the container.
LABEL_RUN_DIR = f"{_PREFIX}.rundir"
#: The session's own host uid that the container runs as (``SandboxSpec.uid``); absent
#: when the containers run as the server's uid.
LABEL_UID = f"{_PREFIX}.uid"
#: The workspace's path in the state dir: a volume's sub-directory mounted into a
#: container is not in the engine's list of its mounts (see :mod:`.statedir`).
LABEL_WORKSPACE = f"{_PREFIX}.workspace"
CHANNEL_DIR = "/run/mcs"
SOCKET_NAME = "agent.sock"
_NOFILE = 4096


def engine_path(path: Path, settings: Settings) -> Path:
    """``path``, in this server's state dir, as the engine sees it by the settings
    (:meth:`.statedir.StateDir.engine_path`)."""
    return StateDir.of_settings(settings).engine_path(path)


def server_path(path: Path, settings: Settings) -> Path | None:
    """A bind source the engine reports, as this server sees it by the settings
    (:meth:`.statedir.StateDir.server_path`)."""
    return StateDir.of_settings(settings).server_path(path)


def sandbox_ids(spec: SandboxSpec) -> tuple[int, int]:
    """The uid and gid ``spec``'s containers run as: the session's own host uid, or,
    without one (a server that cannot chown), the server's own, which owns the workspace,
    unless that is root (``SandboxFailed``).
    Under runc they are the host's ids; under gVisor the sandbox kernel's, and the files
    it writes in the workspace get them on the host too."""
    if spec.uid is not None:
        return spec.uid, spec.uid
    if os.geteuid() == 0:  # a root server without CAP_CHOWN, or a caller's slip
        raise SandboxFailed(
            "a sandbox never runs as root, and this one has no host uid of its own: a "
            "server run as root needs CAP_CHOWN to give it one"
        )
    return os.geteuid(), os.getegid()


def uid_from_label(value: str | None) -> int | None:
    """The uid a container's ``LABEL_UID`` names; ``None`` when absent or not a uid."""
    if not value or not value.isdigit() or len(value) > 10:
        return None
    return int(value)


def container_kwargs(
    spec: SandboxSpec,
    settings: Settings,
    image: str,
    *,
    instance: str,
    run_dir: Path,
    state: StateDir | None = None,
) -> dict[str, Any]:
    """Everything ``containers.create`` gets for one sandbox. Pure: no engine needed.
    ``state``: how the engine sees the state dir (default: as the settings say).

    Every container has ``network_mode`` none (loopback only), with network or without:
    one with network gets the egress proxy's directory (``spec.egress``) read-only at
    ``EGRESS_DIR``, whose socket is its only way out (under gVisor, connecting to it
    needs runsc's ``--host-uds=open``, which ``scripts/docker-engine.sh`` registers)."""
    limits = spec.limits
    state = state or StateDir.of_settings(settings)
    socket_path = f"{CHANNEL_DIR}/{SOCKET_NAME}"
    command = agent_argv(
        limits,
        rlimit_memory=False,
        # A private server's sandbox has no successor to wait for: its agent exits as
        # soon as the channel closes (a park before a checkpoint excepted).
        channel=("--connect", socket_path)
        + (() if spec.outlives_server else ("--reconnect-s", "0")),
        rlimit_pids=False,
        preload=spec.preload,
    )
    return {
        "image": image,
        # The entrypoint too: an image's own (a shell wrapper, a runner's) must not stand
        # between the engine and the agent, and the agent's argv must not depend on it.
        "entrypoint": command[:1],
        "command": command[1:],
        # Not WORKSPACE_DIR: Python puts the cwd first on sys.path, and a workspace file
        # named mcs_agent.py would replace the agent. The agent's --workdir (default
        # /mnt/data) is where code runs.
        "working_dir": AGENT_LIB_DIR,
        # Not the image's uid 1000: the session's own host uid, so per-user kernel
        # counters (inotify instances...) are per sandbox; HOME is /tmp all the same.
        "user": "{}:{}".format(*sandbox_ids(spec)),
        "environment": sandbox_env(spec.env),
        "labels": {
            LABEL_OWNER: spec.owner,
            LABEL_SESSION: spec.session_id,
            LABEL_KEY: spec.key,
            LABEL_INSTANCE: instance,
            LABEL_RUN_DIR: run_dir.name,
            **_workspace_label(spec.workspace, settings),
            **({LABEL_UID: str(spec.uid)} if spec.uid is not None else {}),
            **({LABEL_NETWORK: "true"} if spec.network else {}),
        },
        "hostname": "sandbox",
        "runtime": settings.docker_runtime,
        # No init: the agent is pid 1 and reaps orphans itself. An engine-injected init
        # (tini) would be a dumpable process of the sandbox uid holding the container's
        # log pipes, whose /proc/1/mem user code could open read-write.
        "init": False,
        "detach": True,
        # The channel is the socket: stdin stays /dev/null, as the agent expects.
        "stdin_open": False,
        "tty": False,
        "auto_remove": False,  # a dead container's log tail explains a failed start
        "network_mode": "none",
        "cap_drop": ["ALL"],
        "security_opt": security_opt(settings.docker_runtime),
        "read_only": True,
        "tmpfs": {"/tmp": f"size={limits.tmp_bytes},mode=1777"},  # noqa: S108 - in the sandbox
        "mem_limit": limits.memory_bytes,
        "memswap_limit": limits.memory_bytes,  # the same: no swap on top
        **cpu_quota(limits.cpu, settings.docker_runtime),
        "pids_limit": limits.pids,
        "ulimits": [
            Ulimit(name="nofile", soft=_NOFILE, hard=_NOFILE),
            Ulimit(name="core", soft=0, hard=0),
            Ulimit(name="fsize", soft=limits.file_bytes, hard=limits.file_bytes),
        ],
        "mounts": [
            state.mount(WORKSPACE_DIR, spec.workspace, read_only=False),
            state.mount(CHANNEL_DIR, run_dir, read_only=True),
            *(
                [state.mount(EGRESS_DIR, spec.egress.host_dir, read_only=True)]
                if spec.egress is not None
                else []
            ),
        ],
        # User code can reopen the agent's stderr through /proc: cap what the engine keeps.
        "log_config": LogConfig(type="json-file", config={"max-size": "1m", "max-file": "1"}),
    }


def _workspace_label(workspace: Path, settings: Settings) -> dict[str, str]:
    """``LABEL_WORKSPACE``: the workspace's path relative to the state dir (none outside)."""
    try:
        return {LABEL_WORKSPACE: str(workspace.relative_to(settings.state_dir))}
    except ValueError:
        return {}


#: CFS period under gVisor: the longest the kernel allows (1 s), not Docker's 100 ms.
GVISOR_CPU_PERIOD_US = 1_000_000


def cpu_quota(cpus: float, runtime: str) -> dict[str, int]:
    """The engine's CPU limit: ``cpus`` cores on average, as ``nano_cpus`` (Docker's
    100 ms CFS period), except under gVisor, where the same average is taken over 1 s.

    Why: pausing a gVisor sandbox (its checkpoint) is the sandbox's own sentry compressing
    its memory, CPU-bound and parallel, so it runs under the sandbox's quota. A sandbox is
    paused after it has been idle, with its quota unused: over a 1 s period the checkpoint
    (and the restore) uses every core for its fraction of a second instead of being
    throttled to one, so it ends sooner (``bench/README.md``).
    The average stays ``cpus``; a single thread cannot exceed one core either way; only a
    multi-threaded burst may run on more cores for up to ``cpus`` x 1 s before it waits.
    """
    if runtime == "runsc":
        period = GVISOR_CPU_PERIOD_US
        return {"cpu_period": period, "cpu_quota": max(1000, int(cpus * period))}
    return {"nano_cpus": int(cpus * 1e9)}


def security_opt(runtime: str) -> list[str]:
    """``no-new-privileges``, and under runc our seccomp profile (the same deny-list as
    bwrap's; it replaces the engine's default, which allows io_uring, ptrace, AF_VSOCK and
    AF_NETLINK on some engines). gVisor ignores a container's seccomp profile unless runsc
    runs with ``--oci-seccomp``, and its own kernel is the wall: runsc gets none."""
    if runtime == "runsc":
        return ["no-new-privileges"]
    return ["no-new-privileges", docker_seccomp_opt()]
