"""The bwrap command lines of a sandbox, built as plain lists: no bwrap, no process.

STYLE.md rule 4 (sandbox-runtime's ``linux-sandbox-utils.ts``): these functions only build
argv; :mod:`.backend` opens the fds they name and spawns the result. So the sandbox's
whole shape (namespaces, binds, the launcher that places it in its cgroups and drops the
uid) is unit-tested without bwrap, and ``doctor`` and ``bench`` build their probes'
command lines here (:func:`minimal_argv`, :func:`drop_uid_argv`) instead of retyping them.
Only :meth:`HostLayout.probe` reads anything: the host's top-level directories.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mcp_code_sandbox.backends.base import SandboxSpec
from mcp_code_sandbox.layout import (
    AGENT_LIB_DIR,
    AGENT_MODULE,
    EGRESS_DIR,
    SANDBOX_GID,
    SANDBOX_NODE,
    SANDBOX_NODE_MODULES_LINK,
    SANDBOX_UID,
    SANDBOX_VENV,
    SESSION_NODE_MODULES_LINK,
    WORKSPACE_DIR,
    agent_argv,
    sandbox_env,
)

__all__ = [
    "GROUP",
    "MINIMAL_LAYOUT",
    "PASSWD",
    "STAGE",
    "HostLayout",
    "Mounts",
    "build_bwrap_argv",
    "build_launcher_argv",
    "drop_uid_argv",
    "env_args",
    "minimal_argv",
    "system_binds",
]

#: Where the root launcher stages the bind sources, on a tmpfs private to its mount
#: namespace: any directory the unprivileged uid can traverse would do.
STAGE = "/tmp"  # noqa: S108
_TOP_LEVEL = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
#: What programs need of /etc; passwd and group are synthesized.
_ETC = (
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "ssl",
    "ca-certificates",
    "ca-certificates.conf",
    "fonts",
    "localtime",
    "timezone",
    "mime.types",
    "nsswitch.conf",
    "hosts",
    "host.conf",
    "alternatives",
    "os-release",
    "debian_version",
    "matplotlibrc",
    "locale.alias",
    "gai.conf",
    "protocols",
    "services",
    "magic",
    "magic.mime",
    "terminfo",
    "inputrc",
    "bash.bashrc",
    "profile",
    "shells",
)
#: The sandbox's /etc/passwd and /etc/group (bound from memfds by the backend).
PASSWD = (
    "root:x:0:0:root:/root:/usr/sbin/nologin\n"
    f"sandbox:x:{SANDBOX_UID}:{SANDBOX_GID}:sandbox:/tmp:/bin/bash\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
)
GROUP = f"root:x:0:\nsandbox:x:{SANDBOX_GID}:\nnogroup:x:65534:\n"
# bash, not sh: dash cannot open or close an fd above 9. Arguments:
# $1 channel fd; n, n cgroup.procs files; n, n (source path, name) to stage; then argv.
# Sources are opened before the tmpfs covers $STAGE (a workspace may live below /tmp)
# and bound from those fds; --no-canonicalize keeps mount from turning them into paths.
# They are opened in this mount namespace: a bind from another one fails with EINVAL.
# All the binds are one `mount -a` of a table written into the stage itself (each mount
# point made by X-mount.mkdir, 0755 as mkdir made them): two programs run, not one mkdir
# and one mount per source (those were much of every sandbox's start).
_LAUNCH = r"""
set -e
fd=$1; shift; exec 3<&"$fd"; eval "exec $fd<&-"
n=$1; shift
while [ "$n" -gt 0 ]; do echo $$ > "$1"; shift; n=$((n - 1)); done
n=$1; shift
fds=()
for ((i = 0; i < n; i++)); do exec {src}<"${@:2*i+1:1}"; fds+=("$src"); done
if [ "$n" -gt 0 ]; then
  /usr/bin/mount -t tmpfs -o mode=0755,size=1m mcs-stage "$STAGE"
  for ((i = 0; i < n; i++)); do
    printf '/proc/self/fd/%s %s/%s none bind,X-mount.mkdir 0 0\n' "${fds[i]}" "$STAGE" "$2"
    shift 2
  done > "$STAGE/.binds"
  /usr/bin/mount --no-canonicalize -a -T "$STAGE/.binds"
  for src in "${fds[@]}"; do eval "exec $src<&-"; done
fi
exec "$@"
"""
#: Names a stage may bind (a line of the table ``mount -a`` reads: no blanks, no ``/``).
_STAGE_NAME = re.compile(r"[a-z]+")


@dataclass(frozen=True)
class HostLayout:
    """The host's top-level system directories and /etc entries, probed once."""

    links: tuple[tuple[str, str], ...]
    dirs: tuple[str, ...]
    etc: tuple[str, ...]

    @classmethod
    def probe(cls, root: Path = Path("/")) -> HostLayout:
        links: list[tuple[str, str]] = []
        dirs: list[str] = []
        for name in _TOP_LEVEL:
            path = root / name
            if path.is_symlink():
                links.append((f"/{name}", os.readlink(path)))
            elif path.is_dir():
                dirs.append(f"/{name}")
        etc = tuple(f"/etc/{n}" for n in _ETC if (root / "etc" / n).exists())
        return cls(tuple(links), tuple(dirs), etc)


@dataclass(frozen=True)
class Mounts:
    """Sources as bwrap sees them (staged when root) and the fds bwrap reads."""

    workspace: str
    venv: str
    agent: str
    #: (source, destination) of a base interpreter prefix outside /usr, else ``None``.
    base_prefix: tuple[str, str] | None
    seccomp_fd: int
    passwd_fd: int
    group_fd: int
    #: Node.js, bun and npm packages for ``SANDBOX_NODE``; ``None`` when not provisioned.
    node: str | None = None
    #: The egress proxy's directory (``SandboxSpec.egress``) for ``EGRESS_DIR``; ``None``
    #: for a sandbox without network.
    egress: str | None = None


def env_args(spec: SandboxSpec) -> bytes:
    """The sandbox's environment as bwrap arguments for ``--args FD`` (NUL-separated)."""
    parts = []
    for name, value in sandbox_env(spec.env).items():
        parts += ["--setenv", name, value]
    return b"".join(part.encode() + b"\0" for part in parts)


def build_bwrap_argv(
    bwrap: str,
    spec: SandboxSpec,
    mounts: Mounts,
    layout: HostLayout,
    *,
    rlimit_memory: bool,
    env_fd: int,
) -> list[str]:
    """The bwrap command line of one sandbox (its environment comes from ``env_fd``, a
    file of :func:`env_args`). Pure: unit-tested without bwrap.

    Every sandbox has its own, empty net namespace (loopback only). One with network
    gets the egress proxy's directory read-only at ``EGRESS_DIR``: its socket is the only
    way out (``spec.network`` without ``mounts.egress`` is a caller's bug)."""
    if spec.network != (mounts.egress is not None):
        raise ValueError("a sandbox has the egress directory exactly when it has network")
    argv = [
        bwrap,
        "--unshare-user",
        "--uid",
        str(SANDBOX_UID),
        "--gid",
        str(SANDBOX_GID),
        "--unshare-pid",
        # The agent is pid 1, not bwrap's own init: that init is dumpable, holds bwrap's
        # stderr (the host's log pipe) and its /proc/1/mem opens read-write for user code
        # of the same uid. The agent is not dumpable, and reaps orphans itself.
        "--as-pid-1",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--unshare-net",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--hostname",
        "sandbox",
        "--seccomp",
        str(mounts.seccomp_fd),
        *system_binds(layout),
    ]
    argv += [
        "--perms",
        "0644",
        "--ro-bind-data",
        str(mounts.passwd_fd),
        "/etc/passwd",
        "--perms",
        "0644",
        "--ro-bind-data",
        str(mounts.group_fd),
        "/etc/group",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        str(spec.limits.tmp_bytes),
        "--tmpfs",
        "/tmp",  # noqa: S108
        "--ro-bind",
        mounts.venv,
        SANDBOX_VENV,
        "--ro-bind",
        mounts.agent,
        f"{AGENT_LIB_DIR}/{AGENT_MODULE}",
    ]
    if mounts.base_prefix is not None:
        argv += ["--ro-bind", *mounts.base_prefix]
    if mounts.node is not None:
        argv += ["--ro-bind", mounts.node, SANDBOX_NODE]
        argv += ["--symlink", f"{SANDBOX_NODE}/node_modules", SANDBOX_NODE_MODULES_LINK]
        link, target = SESSION_NODE_MODULES_LINK
        argv += ["--symlink", target, link]
    if mounts.egress is not None:
        argv += ["--ro-bind", mounts.egress, EGRESS_DIR]
    # The workspace last: nothing may be mounted over or under it afterwards.
    argv += ["--bind", mounts.workspace, WORKSPACE_DIR, "--chdir", AGENT_LIB_DIR]
    # The root itself is bwrap's tmpfs: make it (/etc, /opt, /mnt...) read-only too.
    argv += ["--remount-ro", "/", "--clearenv", "--args", str(env_fd)]
    return [*argv, "--", *agent_argv(spec.limits, rlimit_memory, preload=spec.preload)]


def build_launcher_argv(
    channel_fd: int,
    procs_files: list[str],
    stage: list[tuple[str, str]] | None,
    drop_uid: int | None,
) -> list[str]:
    """The prefix that places the sandbox in its cgroups and (as root) drops the uid."""
    for _, name in stage or []:
        if not _STAGE_NAME.fullmatch(name):
            raise ValueError(f"not a stage name: {name!r}")
    prefix = ["/usr/bin/unshare", "--mount", "--propagation", "private"] if stage else []
    binds = [part for source, name in stage or [] for part in (source, name)]
    argv = [
        *prefix,
        "/bin/bash",
        "-c",
        _LAUNCH,
        "mcs-launch",
        str(channel_fd),
        str(len(procs_files)),
        *procs_files,
        str(len(stage or [])),
        *binds,
    ]
    if drop_uid is not None:
        argv += drop_uid_argv(drop_uid)
    return argv


def system_binds(layout: HostLayout) -> list[str]:
    """``/usr`` and the host's top-level system directories and /etc entries, read-only
    (top-level links to ``usr/`` as symlinks)."""
    argv = ["--ro-bind", "/usr", "/usr"]
    for link, target in layout.links:
        argv += ["--symlink", target, link]
    for path in layout.dirs:
        argv += ["--ro-bind", path, path]
    for path in layout.etc:
        argv += ["--ro-bind", path, path]
    return argv


#: The smallest system a probe needs on a merged-/usr host: ``/usr`` and its links.
MINIMAL_LAYOUT = HostLayout(
    links=(("/bin", "usr/bin"), ("/lib", "usr/lib"), ("/lib64", "usr/lib64")), dirs=(), etc=()
)


def minimal_argv(
    bwrap: str, flags: Sequence[str], command: Sequence[str], binds: Sequence[str] = ()
) -> list[str]:
    """bwrap with ``flags`` (namespaces and the like) around ``command``, on
    :data:`MINIMAL_LAYOUT` with ``/proc`` and ``/dev`` and any extra ``binds``: not a
    sandbox, a probe. Used by ``doctor`` (does each namespace work here?) and by
    ``bench`` (bwrap's own cost, without the backend's)."""
    return [
        bwrap,
        *flags,
        *system_binds(MINIMAL_LAYOUT),
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        *binds,
        *command,
    ]


def drop_uid_argv(uid: int) -> list[str]:
    """The ``setpriv`` prefix that runs what follows as host uid (and gid) ``uid``, with
    no supplementary groups: how a root server's sandboxes (and doctor's probes) run."""
    return ["/usr/bin/setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
