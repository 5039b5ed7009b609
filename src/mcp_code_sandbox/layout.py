"""The sandbox's inside, the same for every backend: paths, ids, base env, the agent's argv.

Every backend lays the sandbox out this way, so the agent and the tool descriptions can
rely on it: the workspace at ``WORKSPACE_DIR`` (the working directory), the runtime
environment's interpreter at ``SANDBOX_PYTHON``, the agent package at ``AGENT_LIB_DIR``,
``/tmp`` a size-limited tmpfs, everything else read-only, no capabilities, uid/gid 1000
inside where the backend can map ids (bwrap), else the sandbox's host uid itself (docker).

Imported by the backends (which build sandboxes to it), by :mod:`.provision` (which builds
what is bound at these paths) and by the tool layer's descriptions; it imports nothing of
the host but the agent's own package layout.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Protocol

from mcp_code_sandbox.agent.egress import EGRESS_DIR, EGRESS_PORT
from mcp_code_sandbox.agent.packages import PACKAGES_DIR

__all__ = [
    "AGENT_LIB_DIR",
    "AGENT_MODULE",
    "EGRESS_CA_NAME",
    "EGRESS_DIR",
    "SANDBOX_GID",
    "SANDBOX_NODE",
    "SANDBOX_NODE_MODULES_LINK",
    "SANDBOX_PYTHON",
    "SANDBOX_UID",
    "SANDBOX_VENV",
    "SESSION_NODE_MODULES_LINK",
    "WORKSPACE_DIR",
    "AgentLimits",
    "agent_argv",
    "egress_env",
    "sandbox_env",
]

WORKSPACE_DIR = "/mnt/data"
SANDBOX_VENV = "/opt/sandbox/venv"
SANDBOX_PYTHON = f"{SANDBOX_VENV}/bin/python"
#: Node.js and bun in ``bin/``, the npm packages of DESIGN.md §3 in ``node_modules/``,
#: ``versions.json`` (:mod:`mcp_code_sandbox.provision.node`). Absent when not provisioned.
SANDBOX_NODE = "/opt/sandbox/node"
#: A symlink to ``SANDBOX_NODE/node_modules``: Node's ESM resolver (``import``) ignores
#: ``NODE_PATH`` and only walks up from the importing file, so from ``/mnt/data`` or
#: ``/tmp`` it ends at ``/node_modules``.
SANDBOX_NODE_MODULES_LINK = "/node_modules"
#: ``/mnt/node_modules``, a symlink to the session's own npm/bun packages (in the
#: workspace: ``agent.packages``), so that ``import`` in a file anywhere in the workspace
#: finds them before the walk up ends at the preinstalled ones.
SESSION_NODE_MODULES_LINK = (
    "/mnt/node_modules",
    f"{WORKSPACE_DIR}/{PACKAGES_DIR}/node/node_modules",
)
#: Parent directory of the agent package inside the sandbox; the package is ``mcs_agent``.
AGENT_LIB_DIR = "/opt/sandbox/lib"
AGENT_MODULE = "mcs_agent"
SANDBOX_UID = 1000
SANDBOX_GID = 1000


#: The CA bundle's file name in the egress directory (present only when the proxy
#: intercepts TLS for secrets): the sandbox's own ephemeral CA plus the system roots.
EGRESS_CA_NAME = "ca.pem"


def egress_env(ca_bundle: bool, url: str | None = None) -> dict[str, str]:
    """The variables that send every language's HTTP clients to the agent's bridge to the
    egress proxy (``agent.egress``), for a sandbox with network. ``ca_bundle``: point
    the TLS clients at ``EGRESS_CA_NAME`` too (Python's ssl, requests, pip, Node).
    ``url``: the proxy elsewhere instead of the bridge (the server's egress gate, with
    the sandbox's credential in it: ``egress.gate``).

    Every spelling is set because each client reads its own: curl, requests and pip read
    ``*_PROXY`` (curl only lower-case ``http_proxy``), npm its ``npm_config_*``, Node's own
    fetch only with ``NODE_USE_ENV_PROXY``. ``NO_PROXY`` keeps loopback direct."""
    url = url or f"http://127.0.0.1:{EGRESS_PORT}"
    env: dict[str, str] = {}
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        env[name] = env[name.lower()] = url
    env["NO_PROXY"] = env["no_proxy"] = "localhost,127.0.0.1,::1"
    env["PIP_PROXY"] = url
    env["npm_config_proxy"] = env["npm_config_https_proxy"] = url
    env["NODE_USE_ENV_PROXY"] = "1"
    if ca_bundle:
        bundle = f"{EGRESS_DIR}/{EGRESS_CA_NAME}"
        for name in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "NODE_EXTRA_CA_CERTS", "PIP_CERT"):
            env[name] = bundle
        env["npm_config_cafile"] = bundle
    return env


class AgentLimits(Protocol):
    """What :func:`agent_argv` reads of a sandbox's limits (``backends.base.Limits``)."""

    @property
    def pids(self) -> int: ...
    @property
    def file_bytes(self) -> int: ...
    @property
    def memory_bytes(self) -> int: ...


def sandbox_env(extra: Mapping[str, str]) -> dict[str, str]:
    """The environment of the agent and every process it starts, for every backend."""
    env = {
        # shims/: npm, npx and bun as provision.node.SHIMS wraps them (installs go to the
        # session's packages); the agent adds those packages' bin dirs in front.
        "PATH": f"{SANDBOX_VENV}/bin:{SANDBOX_NODE}/shims:{SANDBOX_NODE}/bin:"
        "/usr/local/bin:/usr/bin:/bin",
        "HOME": "/tmp",  # noqa: S108 - the sandbox's own private tmpfs
        "USER": "sandbox",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "TERM": "dumb",
        "MPLBACKEND": "Agg",
        "MPLCONFIGDIR": "/tmp/.matplotlib",  # noqa: S108 - inside the sandbox
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
        "VIRTUAL_ENV": SANDBOX_VENV,
        # require() (node and bun) and bun's import; node's import uses the /node_modules link.
        "NODE_PATH": f"{SANDBOX_NODE}/node_modules",
    }
    env.update(extra)
    return env


def agent_argv(
    limits: AgentLimits,
    rlimit_memory: bool,
    *,
    channel: tuple[str, ...] = ("--channel-fd", "3"),
    rlimit_pids: bool = True,
    preload: Sequence[str] = (),
) -> list[str]:
    """Command line of the agent inside the sandbox (run with cwd ``AGENT_LIB_DIR``).

    ``rlimit_memory`` asks the agent to cap the interpreter's data segment with
    RLIMIT_DATA, for backends that could not set a cgroup memory limit. ``channel`` says
    how the agent reaches the host (an inherited fd, or ``--connect PATH``).
    ``rlimit_pids`` false leaves RLIMIT_NPROC unset, for backends whose sandboxes share
    one user namespace: that rlimit counts every process of uid 1000 in it, across
    sandboxes, so there the cgroup's pids limit is the only per-sandbox one.
    ``preload``: modules the interpreter imports before the agent says it is ready.
    """
    config = {
        # The agent is alone in its pid namespace: on a kill it may end every process but
        # itself and pid 1, so a child that escaped into its own session dies too.
        "kill_strays": True,
        "pids": limits.pids if rlimit_pids else None,
        "file_bytes": limits.file_bytes,
        "memory_bytes": limits.memory_bytes if rlimit_memory else None,
        "preload": list(preload),
    }
    return [
        SANDBOX_PYTHON,
        "-s",
        "-B",
        "-m",
        AGENT_MODULE,
        *channel,
        "--config",
        json.dumps(config, separators=(",", ":")),
    ]
