"""What each setting means, in the groups of the README's Configuration table: the
flags of ``serve`` (and of the other commands) are listed from here, one per setting.

Each entry is ``(field name, meaning, default in words or None)``; ``None``: the field's
own default, formatted as a user writes it (``512m``, ``false``, ``60``). A unit test
keeps this list, :class:`~mcp_code_sandbox.settings.Settings` and the README in step.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BeforeValidator

from mcp_code_sandbox.settings import Settings, parse_size

__all__ = ["GROUPS", "default_text"]

Entry = tuple[str, str, str | None]

GROUPS: tuple[tuple[str, tuple[Entry, ...]], ...] = (
    (
        "Backend",
        (
            ("backend", "auto (docker when an engine answers and has the image, else bwrap), "
             "bwrap or docker (kubernetes: not in this version yet)", None),
            ("image", "the sandbox image (kubernetes: a reference the nodes can pull)", None),
            ("docker_runtime", "runc, or runsc for gVisor", None),
            ("docker_host_state_dir", "docker: the state dir's path as the engine sees it, "
             "when the server runs in a container", "the state dir"),
            ("runtime_packages", "comma-separated Python packages: the bwrap runtime env's "
             "list; on docker, installed on the image by `image build`", "the standard list"),
        ),
    ),
    (
        "Kubernetes",
        (
            ("kubernetes_namespace", "namespace of the sandbox pods", None),
            ("kubernetes_runtime_class", "runtimeClassName of sandbox pods (gvisor)",
             "the cluster's default"),
            ("kubernetes_seccomp_profile", "Localhost seccomp profile of sandbox pods, "
             "relative to the kubelet's seccomp dir", "RuntimeDefault"),
            ("kubernetes_storage_class", "StorageClass of paused sessions' workspaces",
             "none: no pausing"),
            ("kubernetes_agent_tls_dir", "directory of the agent channel's ca.crt, "
             "server.crt, server.key", None),
            ("kubernetes_pod_ip", "the server pod's IP (status.podIP), where sandboxes "
             "reach their egress proxies", "none: no network"),
        ),
    ),
    (
        "Limits per sandbox",
        (
            ("memory_limit", "memory per sandbox", None),
            ("cpu_limit", "CPU cores per sandbox", None),
            ("exec_timeout_s", "default wall time per call, seconds", None),
            ("max_exec_timeout_s", "largest timeout_s a call may ask for", None),
            ("workspace_quota_bytes", "workspace size per session, packages included", None),
            ("workspace_quota_mode", "filesystem (a loop-mounted image per workspace), "
             "checked, or auto", None),
        ),
    ),
    (
        "Sessions",
        (
            ("pause_after_m", "idle minutes before a session is paused to disk; 0: never",
             None),
            ("session_ttl_m", "idle minutes before a session expires", None),
            ("paused_disk_bytes", "paused state on disk, all sessions", None),
            ("max_sessions", "sessions running at once (paused ones do not count)", None),
            ("max_sessions_per_owner", "running sessions one owner may have at once",
             "half of max-sessions with several owners, else none"),
            ("keep_sessions_on_shutdown", "a clean stop pauses every session for the next "
             "server instead of ending them", "true over HTTP, false over stdio"),
            ("replica", "one of several HTTP servers sharing this state directory's sessions "
             "(docker backend)", None),
        ),
    ),
    (
        "Warm pool",
        (
            ("pool_size", "warm sandboxes kept started for new sessions; 0: off", None),
            ("preload", "modules a pooled interpreter imports ahead; empty: none", None),
        ),
    ),
    (
        "Inputs and results",
        (
            ("max_upload_bytes", "largest upload", None),
            ("max_result_tokens", "most tokens the text of one tool result takes "
             "(3 bytes a token)", None),
        ),
    ),
    (
        "Network and environment",
        (
            ("allow_network", "allow run_code(network=true), through the egress proxy only",
             None),
            ("network_allow", "hosts networked sandboxes may reach (names, *.name, *, "
             "pypi, npm, addresses)", "empty (nothing)"),
            ("network_deny", "hosts refused even when allowed", "empty"),
            ("network_resolve", "name=addr pins, resolved without DNS", "empty"),
            ("network_upstream_ca", "extra PEM roots the proxy trusts for upstreams", None),
            ("secrets_file", "secrets the proxy adds for their hosts only (TOML)", None),
            ("pass_through_env", "names copied from the server's env into every sandbox",
             "empty"),
            ("allow_call_env", "allow run_code(env={...})", None),
        ),
    ),
    (
        "HTTP and authentication",
        (
            ("http_host", "HTTP bind address", None),
            ("http_port", "HTTP port", None),
            ("public_base_url", "the URL clients reach this server at", "http://<host>:<port>"),
            ("api_tokens", "name:token,...: named bearer tokens", None),
            ("api_tokens_file", "a file of name:token lines, reread on SIGHUP", None),
            ("allow_unauthenticated", "listen beyond loopback without authentication", None),
            ("oauth_issuer", "accept JWT access tokens from this OAuth issuer", None),
            ("oauth_audience", "the aud those tokens must carry", "<public base URL>/mcp"),
            ("oauth_required_scopes", "scopes every token must have", None),
            ("url_secret", "key of the download links' signatures", "made once, kept"),
            ("allowed_hosts", "Host headers accepted besides the loopback names", None),
            ("allowed_origins", "Origins accepted besides loopback pages", None),
            ("metrics_token", "bearer token /metrics requires", None),
        ),
    ),
    (
        "Logs and state",
        (
            ("log_level", "DEBUG, INFO, WARNING or ERROR", None),
            ("log_format", "console or json", None),
            ("log_file", "log here instead of stderr", None),
            ("state_dir", "runtime env, workspaces and records", None),
        ),
    ),
    (
        "Tuning (an operator's, rarely needed)",
        (
            ("runtime_dir", "where setup builds the bwrap runtime env", "<state dir>/runtime"),
            ("pids_limit", "processes per sandbox", None),
            ("tmp_size", "size of the sandbox's /tmp (tmpfs)", None),
            ("session_max_lifetime_h", "hours after which a session expires anyway", None),
            ("pause_max_bytes", "most one session's saved variables may take", None),
            ("max_paused_sessions", "paused sessions kept; 0: none", None),
            ("notebook_max_bytes", "disk each session's record of runs may take", None),
            ("max_output_bytes", "stdout/stderr kept per stream per run (head and tail)",
             None),
            ("max_code_bytes", "largest code", None),
            ("max_image_bytes", "images are downscaled to fit this", None),
            ("max_images", "images per result", None),
            ("max_read_bytes", "most bytes one read_file page returns", None),
            ("max_result_bytes", "most bytes one tool result takes as a message", None),
            ("download_url_ttl_s", "how long a download link works, seconds", None),
            ("uid_range_start", "first host uid (and gid) kept for sandboxes", None),
            ("uid_range_size", "how many host uids are kept", None),
            ("uid_lease_dir", "host-wide leases of those uids", None),
        ),
    ),
)  # fmt: skip

_UNITS = (("t", 1024**4), ("g", 1024**3), ("m", 1024**2), ("k", 1024))
#: Fields read as sizes (``512m``): their defaults are shown the same way.
_SIZES = frozenset(
    name
    for name, field in Settings.model_fields.items()
    if any(isinstance(m, BeforeValidator) and m.func is parse_size for m in field.metadata)
)


def _size(value: int) -> str:
    for suffix, unit in _UNITS:
        if value % unit == 0:
            return f"{value // unit}{suffix}"
    return str(value)


def default_text(name: str) -> str:
    """``name``'s default as a user would write it."""
    field = Settings.model_fields[name]
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if name in _SIZES and isinstance(value, int):
        return _size(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, list):
        return ",".join(value) if value else "empty"
    if isinstance(value, Path):
        return str(value)
    return str(value)
