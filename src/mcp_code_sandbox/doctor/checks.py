"""What a ``doctor`` check is, and the checks both backends share.

The package, lowest first: :mod:`.checks` (this), :mod:`.bwrap` and :mod:`.docker` (each
backend's checks, output-free: one :class:`Check` a fact), :mod:`.report` (runs them all
and prints; the CLI's ``doctor``). Nothing here imports upwards, so no import hides in a
function.
"""

from __future__ import annotations

from typing import NamedTuple

from mcp_code_sandbox.backends.base import Backend
from mcp_code_sandbox.errors import BackendUnavailable, SandboxError
from mcp_code_sandbox.sessions import quota, records
from mcp_code_sandbox.sessions.pool import MAX_AGE_S as POOL_MAX_AGE_S
from mcp_code_sandbox.sessions.recovery import alive
from mcp_code_sandbox.sessions.uids import uid_pool
from mcp_code_sandbox.settings import Settings

__all__ = [
    "Check",
    "network_check",
    "pause_check",
    "pausing_check",
    "pool_check",
    "size_text",
    "uid_range_detail",
    "workspace_quota_check",
]


class Check(NamedTuple):
    name: str
    ok: bool
    detail: str
    #: What to run or change when not ``ok``; ``None`` when there is nothing to do.
    fix: str | None = None
    #: Not ``ok``, but what a normal install of this kind has (a single user's server not
    #: run as root: rlimits instead of cgroups, one uid for all sandboxes; no npm): said
    #: as a ``note``, never a ``FAIL``.
    note: bool = False


def size_text(size: int) -> str:
    """``size`` bytes as a person reads it: ``10 GiB``, ``512 MiB``, ``1.5 KiB``."""
    value = float(size)
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:g} {unit}" if unit != "bytes" else f"{size} bytes"
        value /= 1024
    return f"{value:.3g} TiB"


def network_check(settings: Settings, why_not: str | None, how: str) -> Check:
    """Whether network-by-permission works here, and what enforces it (every backend):
    ``how`` says how this backend keeps the sandbox's namespace empty and binds the
    egress proxy's socket in."""
    base = "each sandbox has no network unless a call asks for it"
    if not settings.allow_network:
        return Check("network", True, f"{base}; network=true is refused (SANDBOX_ALLOW_NETWORK)")
    if why_not is not None:
        return Check(
            "network", False, f"{base}; SANDBOX_ALLOW_NETWORK=true but {why_not}",
            "see above, or unset SANDBOX_ALLOW_NETWORK",
        )  # fmt: skip
    allow = ", ".join(settings.network_allow) or "nothing (SANDBOX_NETWORK_ALLOW is empty)"
    deny = ", ".join(settings.network_deny)
    return Check(
        "network", True,
        f"{base}; with network=true {how}, and its only way out is this server's egress "
        f"proxy (HTTP CONNECT and plain HTTP, by host; SNI checked) over a Unix socket bound "
        f"into it, allowing {allow}" + (f" but not {deny}" if deny else ""),
    )  # fmt: skip


def uid_range_detail(settings: Settings) -> tuple[str, str | None]:
    """The range of sandbox uids and where they are leased, for the uid checks; and why
    no uid can be leased here (``None`` when one can)."""
    pool = uid_pool(settings)
    skipped = f", {pool.skipped} of them skipped (ids of this host's users)" if pool.skipped else ""
    detail = f"host uids {pool.describe()}{skipped}, leased in {pool.directory}"
    try:
        pool.open()
    except SandboxError as exc:
        return detail, exc.message
    return detail, None


def workspace_quota_check(settings: Settings, backend: Backend) -> Check:
    """How the workspace quota binds ``backend``'s sandboxes here (both backends)."""
    try:
        mode = quota.choose(settings, backend)
    except BackendUnavailable as exc:
        return Check("workspace quota", False, exc.message, "see above")
    return Check("workspace quota", True, mode.describe())


def pool_check(settings: Settings) -> Check:
    """The warm pool as configured, and the pooled sandboxes that servers running on this
    state dir hold now (their records say ``pool``; a live server's ready and starting
    ones both have one)."""
    if settings.pool_size == 0:
        return Check(
            "warm pool", True, "off (SANDBOX_POOL_SIZE=0): every new session starts a sandbox"
        )
    preload = ", ".join(settings.preload) or "nothing"
    held = [
        r
        for r in records.load_records(settings.sessions_dir)
        if r.pool and alive(settings.run_dir / f"{r.instance}.pid")
    ]
    return Check(
        "warm pool",
        True,
        f"{settings.pool_size} sandboxes kept ready per server, replaced after "
        f"{POOL_MAX_AGE_S:g} s, preloading {preload}; {len(held)} pooled "
        "(ready or starting) held by servers running on this state dir now",
    )


#: What a variables pause keeps, and what it cannot.
_VARIABLES = (
    "variables (each value pickled with cloudpickle inside the sandbox into /mnt/data/"
    ".session, modules re-imported, what cannot be pickled named); open files, threads "
    "and processes do not survive"
)


def pause_check(no_memory: str | None) -> Check:
    """Which pause kind this backend offers here: ``no_memory`` is why it cannot keep a
    sandbox's whole memory (``Checkpoints.cannot_checkpoint``), ``None`` when it can."""
    if no_memory is None:
        return Check(
            "pause",
            True,
            "an idle session is paused with its whole memory (a gVisor checkpoint: "
            "variables, imports, open figures and history come back); one with network, "
            f"one restored once already, or one whose checkpoint fails, with its {_VARIABLES}",
        )
    return Check("pause", True, f"an idle session is paused with its {_VARIABLES} ({no_memory})")


def pausing_check(settings: Settings) -> Check:
    """The pause settings, and the paused sessions servers on this state dir hold now."""
    if settings.pause_after_m == 0:
        head = "idle sessions are not paused (SANDBOX_PAUSE_AFTER_M=0)"
    else:
        head = f"idle sessions are paused after {settings.pause_after_m:g} min"
    paused = [r for r in records.load_records(settings.sessions_dir) if r.paused is not None]
    if settings.pause_after_m == 0 or settings.max_paused_sessions == 0:
        room = f"every session counts toward SANDBOX_MAX_SESSIONS ({settings.max_sessions})"
    else:
        room = (
            f"{settings.max_sessions} run at once (the longest idle is paused to make room), "
            f"{settings.max_paused_sessions} paused at most"
        )
    return Check(
        "pausing",
        True,
        f"{head}; they expire after {settings.session_ttl_m:g} min idle or "
        f"{settings.session_max_lifetime_h:g} h in all; paused state is kept within "
        f"{size_text(settings.paused_disk_bytes)} (the longest idle expire first); {room}; "
        f"{len(paused)} paused sessions on this state dir now",
    )
