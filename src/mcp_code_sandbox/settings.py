"""The server's configuration: read once from ``SANDBOX_*`` variables and CLI flags.

One frozen :class:`Settings` object is built at start (``load_settings``) and passed down;
nothing else reads ``os.environ``, but :func:`docker_environ` (the engine's address, which
is Docker's own setting). Invalid values stop the server with one line per problem
(:class:`ConfigError`), naming the variable and what it accepts.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

__all__ = [
    "FORBIDDEN_ENV",
    "ConfigError",
    "Settings",
    "ca_bundle_from_env",
    "docker_environ",
    "load_settings",
    "otlp_configured",
    "parse_size",
    "unknown_variables",
]

#: A Host header value: a name or IPv4 address, or a bracketed IPv6 one; a port or ``*``.
_HOST = re.compile(r"(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+)(:(\d{1,5}|\*))?")
#: A network allow/deny entry by shape (``egress.policy`` parses it): ``*``, ``*.name``,
#: a name or preset, an IPv4 or IPv6 address or network (brackets allowed).
_NETWORK_ENTRY = re.compile(
    r"\*|(\*\.)?[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*\.?|\[?[0-9A-Fa-f:.]+\]?(/\d{1,3})?"
)
#: Bytes of result text one token is taken to carry, to turn ``max_result_tokens`` into
#: bytes: English prose runs about 4, code, numbers and JSON about 3; the lower figure
#: keeps a result under the client's limit whatever it holds.
BYTES_PER_TOKEN = 3
#: Kubernetes object names: a namespace is a DNS label, a class a DNS subdomain.
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(
    r"(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def parse_size(value: object) -> object:
    """``512m``, ``1GiB``, ``100k``, ``1048576`` → bytes (binary units, as Docker reads them)."""
    if isinstance(value, str):
        match = _SIZE.match(value)
        if not match:
            raise ValueError("expected a size such as 512m, 1g, 100k or a number of bytes")
        number, unit, _ = match.groups()
        return int(float(number) * _UNITS[unit.lower()])
    return value


def _split_names(value: object) -> object:
    if isinstance(value, str):
        return [name.strip() for name in value.split(",") if name.strip()]
    return value


Size = Annotated[int, BeforeValidator(parse_size), Field(gt=0)]
NameList = Annotated[list[str], NoDecode, BeforeValidator(_split_names)]


def _default_state_dir() -> Path:
    # Read here, once, as the default of STATE_DIR. As root, a system path: the sandboxes
    # then run as an unprivileged uid that must reach its workspace, and /root is 0700.
    # Otherwise the XDG convention for a user's state files.
    if os.geteuid() == 0:
        return Path("/var/lib/mcp-code-sandbox")
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "mcp-code-sandbox"


#: Names that would change how the sandbox itself behaves, never settable per call.
FORBIDDEN_ENV = frozenset(
    {
        "LD_PRELOAD",
        "LD_LIBRARY_PATH",
        "LD_AUDIT",
        "PATH",
        "PYTHONPATH",
        "PYTHONHOME",
        "PYTHONSTARTUP",
        "PYTHONINSPECT",
        "NODE_OPTIONS",
        "NODE_PATH",
        "BASH_ENV",
        "ENV",
        "HOME",
        "VIRTUAL_ENV",
        "MPLBACKEND",
        "MPLCONFIGDIR",
    }
)


class Settings(BaseSettings):
    """Every setting of DESIGN.md §8; env ``SANDBOX_<NAME>``, CLI ``--<name-with-dashes>``."""

    model_config = SettingsConfigDict(
        env_prefix="SANDBOX_", frozen=True, extra="forbid", case_sensitive=False
    )

    backend: Literal["auto", "bwrap", "docker", "kubernetes"] = "auto"
    #: The sandbox image: docker, a tag the engine has; kubernetes, a reference the
    #: cluster's nodes can pull (the same image, pushed to a registry).
    image: str = "mcp-code-sandbox:latest"
    docker_runtime: Literal["runc", "runsc"] = "runc"

    # Kubernetes: what a cluster operator sets (deploy/kubernetes/ sets the first and
    # the last to match its own manifests). Read by backends/kubernetes/.
    #: The namespace the sandbox pods (and their claims, leases, policy) live in.
    kubernetes_namespace: str = "mcp-code-sandbox"
    #: runtimeClassName of every sandbox pod (``gvisor`` for runsc). None: the cluster's
    #: default runtime.
    kubernetes_runtime_class: str | None = None
    #: A Localhost seccomp profile for sandbox pods, relative to the kubelet's seccomp
    #: directory on every node. None: the runtime's default profile (RuntimeDefault).
    kubernetes_seccomp_profile: str | None = None
    #: StorageClass of every sandbox pod's workspace volume (a claim per pod, which a
    #: paused session keeps). None: no volume is made, and sessions on Kubernetes are
    #: not paused (they keep their pod until they expire).
    kubernetes_storage_class: str | None = None
    #: Directory with the agent channel's ``ca.crt``, ``server.crt`` and ``server.key``
    #: (what ``mcp-code-sandbox kubernetes certs --out DIR`` writes; a mounted Secret).
    kubernetes_agent_tls_dir: Path = Path("/etc/mcp-code-sandbox/agent-tls")
    #: The server pod's IP (the downward API's ``status.podIP``): where its egress gate
    #: listens and its sandboxes with network dial it. None: network is not offered.
    kubernetes_pod_ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None = None

    memory_limit: Size = 512 * 1024**2
    cpu_limit: float = Field(1.0, gt=0, le=256)
    pids_limit: int = Field(256, ge=16, le=65536)
    tmp_size: Size = 256 * 1024**2

    exec_timeout_s: float = Field(60.0, gt=0)
    max_exec_timeout_s: float = Field(600.0, gt=0)
    #: Idle minutes before a session expires (paused or not): 7 days, so an agent that
    #: comes back after a weekend finds its session; a paused one holds only disk.
    session_ttl_m: float = Field(7 * 24 * 60.0, gt=0)
    #: Hours after which a session expires however active: 30 days bounds what an
    #: abandoned-but-poked session holds on disk.
    session_max_lifetime_h: float = Field(30 * 24.0, gt=0)
    #: Idle minutes before a session is paused (``sessions.pause``): its sandbox stops and
    #: leaves RAM; its memory (gVisor) or variables and files stay on disk, and the next
    #: call resumes it. 0 turns pausing off (sessions keep their sandbox until they expire).
    pause_after_m: float = Field(10.0, ge=0)
    #: Paused state on disk (allocated blocks), all sessions together (checkpoint images,
    #: workspaces of paused sessions with their saved variables); past it the owner whose
    #: paused state is largest loses its longest-idle paused session first.
    paused_disk_bytes: Size = 10 * 1024**3
    #: Most bytes one session's saved variables may take; the largest values that do
    #: not fit are dropped and named.
    pause_max_bytes: Size = 512 * 1024**2
    #: Sessions running at once (not paused; with or without a sandbox: an upload makes
    #: one too). A call that needs one more pauses the longest-idle (``sessions.room``).
    max_sessions: int = Field(10, ge=1)
    #: Running sessions one owner may have at once. None: the default,
    #: :attr:`sessions_per_owner`.
    max_sessions_per_owner: int | None = Field(None, ge=1)
    #: Paused sessions kept, all owners; past it the owner holding the most loses its
    #: longest idle first. 0: none is kept, and no session is paused to make room.
    max_paused_sessions: int = Field(1000, ge=0)
    #: Sandboxes kept started, connected and preloaded for new sessions (``sessions.pool``);
    #: 0 turns the pool off. They count toward no session limit; each holds an idle
    #: interpreter (about 120 MiB with the default preload). A burst grows the pool past
    #: it for a while (``sessions.demand``).
    pool_size: int = Field(2, ge=0, le=64)
    #: Modules a pooled interpreter imports before a session claims it (not bound in the
    #: session's namespace); empty turns preloading off.
    preload: NameList = ["numpy", "pandas", "matplotlib.pyplot"]

    max_upload_bytes: Size = 50 * 1024**2
    max_output_bytes: Size = 100 * 1024
    max_code_bytes: Size = 100 * 1024
    workspace_quota_bytes: Size = 1024**3
    #: How the quota binds the sandbox. ``filesystem``: each workspace is a loop-mounted
    #: filesystem of the quota's size (root only; the server refuses to start without
    #: it). ``checked``: the server watches the workspace during runs and checks it after
    #: them (a run can overshoot briefly). ``auto``: ``filesystem`` where it works here.
    workspace_quota_mode: Literal["auto", "filesystem", "checked"] = "auto"
    max_image_bytes: Size = 1024**2
    max_images: int = Field(4, ge=0, le=64)
    max_read_bytes: Size = 1024**2
    #: Disk each session's run record may take (``export_notebook``'s source, kept on
    #: the host under ``state_dir/runlogs``), and the most an exported notebook takes.
    #: Past it, runs are recorded without their outputs, then only counted.
    notebook_max_bytes: Size = 32 * 1024**2
    #: The most bytes one tool result may take as a serialized JSON-RPC message (the
    #: structured content, its text copy, image blocks and links together). Half of the
    #: 1 MiB that the official MCP client accepts in one server-sent event; what does not
    #: fit is cut and the result says so (``server/fit.py``).
    max_result_bytes: Size = Field(512 * 1024, ge=64 * 1024)
    #: The most tokens the text of one tool result may take (estimated: ``BYTES_PER_TOKEN``
    #: bytes each). Claude Code warns at 10,000 and cuts a result at 25,000
    #: (``MAX_MCP_OUTPUT_TOKENS``); raise both together for clients that take more.
    max_result_tokens: int = Field(20_000, ge=2_000)

    allow_network: bool = False
    #: Hosts a networked sandbox may reach through its egress proxy (``egress.policy``):
    #: names, ``*.name``, ``*``, presets ``pypi``/``npm``, addresses and networks. Empty
    #: (the default): none; networked sandboxes then reach nothing until hosts are named.
    network_allow: NameList = Field(default_factory=list)
    #: Hosts refused even when the allow list matches them (same forms).
    network_deny: NameList = Field(default_factory=list)
    #: Names the proxy resolves from this list instead of DNS, ``name=address`` (several
    #: addresses: ``name=a|b``), like curl's ``--resolve``: pinned names, split horizons,
    #: test hosts. The address checks still apply (a private address needs an allow entry).
    network_resolve: NameList = Field(default_factory=list)
    #: A TOML file of secrets the proxy adds to requests for their hosts (``egress.secrets``);
    #: the sandbox sees placeholders only. None: no secrets.
    secrets_file: Path | None = None
    #: Extra CA certificates (PEM) the proxy trusts, besides the system roots, when it
    #: checks an upstream it terminates TLS for; also trusted inside networked sandboxes.
    network_upstream_ca: Path | None = None
    pass_through_env: NameList = Field(default_factory=list)
    allow_call_env: bool = False
    #: On a clean shutdown, pause every session for the next server on this state dir
    #: instead of ending them. None (the default): true for HTTP (a deploy is invisible
    #: to clients), false for stdio (a client that leaves leaves nothing behind); the
    #: CLI decides it from ``--transport``.
    keep_sessions_on_shutdown: bool | None = None
    #: One of several HTTP servers sharing this state directory's sessions (docker backend
    #: only): any of them serves any session (``sessions.replicas``).
    replica: bool = False

    http_host: str = "127.0.0.1"
    http_port: int = Field(8080, ge=0, le=65535)
    public_base_url: str | None = None
    #: ``name:token[:admin],...``; parsed (and refused line by line) by ``server.auth``;
    #: ``:admin`` lets that token see every owner's sessions in ``/ui``.
    api_tokens: str | None = Field(None, repr=False)
    #: One ``name:token`` a line, reread on SIGHUP.
    api_tokens_file: Path | None = None
    #: Key of the download links' signatures; unset: one made and kept in the state dir.
    url_secret: str | None = Field(None, repr=False, min_length=16)
    download_url_ttl_s: int = Field(3600, ge=60, le=7 * 86400)
    #: Host headers the HTTP endpoints accept besides this server's own loopback names
    #: and PUBLIC_BASE_URL's host (``server.hosts``): ``name``, ``name:port``, ``name:*``.
    #: Empty: only those. Origins likewise (``https://name[:port|:*]``).
    allowed_hosts: NameList = Field(default_factory=list)
    allowed_origins: NameList = Field(default_factory=list)
    #: Bearer token ``/metrics`` asks for. None: ``/metrics`` is served only on a
    #: loopback-bound server, to anyone who can reach it there.
    metrics_token: str | None = Field(None, repr=False, min_length=16)
    #: Serve beyond loopback with no authentication at all (a proxy in front does it).
    allow_unauthenticated: bool = False
    #: OAuth resource-server mode: JWT access tokens from this issuer (its metadata names
    #: the JWKS); exclusive with API tokens. Audience: by default this server's ``/mcp``
    #: URL. Required scopes: every token must carry all of them (empty: none required).
    oauth_issuer: str | None = None
    oauth_audience: str | None = None
    oauth_required_scopes: NameList = Field(default_factory=list)

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["console", "json"] = "console"
    log_file: Path | None = None
    state_dir: Path = Field(default_factory=_default_state_dir)
    #: Where ``setup`` builds the sandbox runtime env (a venv, later node); by default
    #: ``<state_dir>/runtime`` (filled in by ``_derive_paths``).
    runtime_dir: Path = Path()
    #: The Python packages (names, as pip knows them) of the bwrap runtime env that
    #: ``setup`` and a first ``serve`` build. Semantics: empty (the default) means the
    #: standard list of DESIGN.md §3 (``backends.bwrap.runtime.PACKAGES``); anything else
    #: replaces it (a smaller runtime builds faster: tests, CI). The docker image keeps
    #: its own list.
    runtime_packages: NameList = Field(default_factory=list)
    #: Host uids kept for sandboxes, one per session (``uids``): ``uid_range_start`` ..
    #: ``uid_range_start + uid_range_size - 1``, used as gids too; by default a band no
    #: user, useradd subuid range or systemd container range gets. Below 2^31.
    uid_range_start: int = Field(0x7000_0000, ge=65_536, lt=2**31 - 1)
    uid_range_size: int = Field(65_536, ge=1, le=2**24)
    #: Host-wide directory of the uid leases, shared by every server on this host (a
    #: server in a container: bind-mount the host's). Only the server's user may write it.
    uid_lease_dir: Path = Path("/run/mcp-code-sandbox/uids")
    #: The state dir as the Docker engine sees it. Semantics: ``None`` (the default)
    #: means the engine sees ``state_dir`` at the same path (the server runs on the
    #: engine's host, or the state dir is bind-mounted at the same path on both sides).
    #: Set it when the server runs in a container and drives the host's engine through
    #: its socket: the bind mounts of workspaces and run dirs are then given to the
    #: engine under this path (``backends.docker.spec.engine_path``).
    docker_host_state_dir: Path | None = None

    @model_validator(mode="before")
    @classmethod
    def _derive_paths(cls, data: Any) -> Any:
        if isinstance(data, dict) and not data.get("runtime_dir"):
            state = data.get("state_dir") or _default_state_dir()
            data = {**data, "runtime_dir": Path(state) / "runtime"}
        return data

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper_level(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value

    @field_validator(
        "docker_host_state_dir",
        "secrets_file",
        "network_upstream_ca",
        "kubernetes_runtime_class",
        "kubernetes_seccomp_profile",
        "kubernetes_storage_class",
        mode="before",
    )
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        # A compose file passes an unset variable on as "".
        return None if value == "" else value

    @field_validator("docker_host_state_dir")
    @classmethod
    def _absolute(cls, path: Path | None) -> Path | None:
        if path is not None and not path.is_absolute():
            raise ValueError("must be an absolute path (the state dir as the engine sees it)")
        return path

    @field_validator("kubernetes_namespace")
    @classmethod
    def _namespace_name(cls, name: str) -> str:
        if not _DNS_LABEL.fullmatch(name):
            raise ValueError("a namespace is 1-63 lower-case letters, digits or '-'")
        return name

    @field_validator("kubernetes_runtime_class", "kubernetes_storage_class")
    @classmethod
    def _object_name(cls, name: str | None) -> str | None:
        if name is not None and not _DNS_SUBDOMAIN.fullmatch(name):
            raise ValueError("expected an object name: lower-case letters, digits, '-' and '.'")
        return name

    @field_validator("kubernetes_seccomp_profile")
    @classmethod
    def _profile_path(cls, path: str | None) -> str | None:
        if path is not None and (path.startswith("/") or ".." in path.split("/")):
            raise ValueError("give the profile's path relative to the kubelet's seccomp dir")
        return path

    @field_validator("pass_through_env")
    @classmethod
    def _valid_names(cls, names: list[str]) -> list[str]:
        for name in names:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise ValueError(f"{name!r} is not an environment variable name")
            if name.upper() in FORBIDDEN_ENV:
                raise ValueError(f"{name} controls the sandbox itself and cannot be passed")
        return names

    def pass_through_values(self, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """The server's own values of ``pass_through_env`` (default: the process env, read
        now), for every sandbox's environment; names it does not have are left out."""
        env = os.environ if environ is None else environ
        return {name: env[name] for name in self.pass_through_env if name in env}

    @field_validator("preload")
    @classmethod
    def _module_names(cls, names: list[str]) -> list[str]:
        for name in names:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", name):
                raise ValueError(f"{name!r} is not a Python module name")
        return names

    @field_validator("runtime_packages")
    @classmethod
    def _package_names(cls, names: list[str]) -> list[str]:
        for name in names:
            # Bare names: the build reads each one's installed version back by its name.
            if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?", name):
                raise ValueError(f"{name!r} is not a package name (give names only, no versions)")
        return names

    @field_validator("network_allow", "network_deny")
    @classmethod
    def _valid_network_entries(cls, entries: list[str]) -> list[str]:
        # The parser is egress.policy's (a higher layer): checked there, at first use,
        # and here by shape, so a typo stops the server at start with its name.
        for entry in entries:
            if not _NETWORK_ENTRY.fullmatch(entry):
                raise ValueError(f"{entry!r} is not a host, *.host, *, preset, address or network")
        return entries

    @field_validator("network_resolve")
    @classmethod
    def _valid_resolve(cls, entries: list[str]) -> list[str]:
        for entry in entries:
            name, _, addresses = entry.partition("=")
            if not _NETWORK_ENTRY.fullmatch(name.strip()) or not addresses:
                raise ValueError(f"{entry!r} is not name=address (or name=address|address)")
            for address in addresses.split("|"):
                try:
                    ipaddress.ip_address(address.strip().strip("[]"))
                except ValueError:
                    raise ValueError(f"{entry!r}: {address!r} is not an IP address") from None
        return entries

    @field_validator("allowed_hosts")
    @classmethod
    def _valid_hosts(cls, hosts: list[str]) -> list[str]:
        for host in hosts:
            if not _HOST.fullmatch(host):
                raise ValueError(
                    f"{host!r} is not a Host header value: give name, name:port or name:* "
                    "(no scheme, no path)"
                )
        return hosts

    @field_validator("allowed_origins")
    @classmethod
    def _valid_origins(cls, origins: list[str]) -> list[str]:
        for origin in origins:
            scheme, _, host = origin.partition("://")
            if scheme not in ("http", "https") or not _HOST.fullmatch(host):
                raise ValueError(
                    f"{origin!r} is not an origin: give scheme://name[:port], e.g. "
                    "https://chat.example.com (no path)"
                )
        return origins

    @field_validator("oauth_issuer", "public_base_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"https?://[^/?#\s]+(/[^?#\s]*)?", value):
            raise ValueError("expected an http(s) URL without query or fragment")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.exec_timeout_s > self.max_exec_timeout_s:
            raise ValueError(
                "exec_timeout_s must not be larger than max_exec_timeout_s "
                f"({self.exec_timeout_s} > {self.max_exec_timeout_s})"
            )
        if self.uid_range_start + self.uid_range_size > 2**31 - 1:
            raise ValueError(
                "SANDBOX_UID_RANGE_START + SANDBOX_UID_RANGE_SIZE must stay below 2^31 - 1 "
                "(larger ids read as negative to some tools)"
            )
        if self.uid_range_size < self.max_sessions + self.max_paused_sessions + self.pool_size:
            raise ValueError(
                f"SANDBOX_UID_RANGE_SIZE ({self.uid_range_size}) must be at least "
                "SANDBOX_MAX_SESSIONS + SANDBOX_MAX_PAUSED_SESSIONS + SANDBOX_POOL_SIZE "
                f"({self.max_sessions} + {self.max_paused_sessions} + {self.pool_size}): "
                "every session (paused ones too) and pooled sandbox needs a uid"
            )
        if self.oauth_issuer is None:
            if self.oauth_audience is not None or self.oauth_required_scopes:
                raise ValueError(
                    "SANDBOX_OAUTH_AUDIENCE and SANDBOX_OAUTH_REQUIRED_SCOPES need "
                    "SANDBOX_OAUTH_ISSUER"
                )
        elif self.api_tokens or self.api_tokens_file:
            # One owner namespace: a token's name and a JWT's subject must never meet.
            raise ValueError(
                "SANDBOX_OAUTH_ISSUER and SANDBOX_API_TOKENS / SANDBOX_API_TOKENS_FILE "
                "exclude each other; choose one way to authenticate"
            )
        return self

    @property
    def sessions_per_owner(self) -> int | None:
        """The limit each owner gets: ``max_sessions_per_owner`` when set; else half of
        ``max_sessions`` (at least 1) where owners may be several, so that no one owner
        can take every slot and lock the others out (with two tenants, each can have
        its fair half; with more, one alone never holds more than half); ``None`` (only
        ``max_sessions``) where there is one owner at most. Several: two or more API
        token names, a tokens file (it is reread on SIGHUP, so owners may come without a
        restart), or OAuth (any subject the issuer vouches for)."""
        if self.max_sessions_per_owner is not None:
            return self.max_sessions_per_owner
        named = [entry for entry in (self.api_tokens or "").split(",") if entry.strip()]
        several = len(named) > 1 or self.api_tokens_file is not None or bool(self.oauth_issuer)
        return max(1, self.max_sessions // 2) if several else None

    @property
    def stream_bytes(self) -> int:
        """What a result keeps of each of stdout and stderr: ``max_output_bytes``, within
        a fifth of the result budget (each stream is in the result twice: structured
        and in its text copy) and two fifths of the text budget (two streams, and room
        for the value, the error and displays). Past it the full output is saved in the
        workspace."""
        return min(
            self.max_output_bytes, self.max_result_bytes // 5, self.result_text_bytes * 2 // 5
        )

    @property
    def result_text_bytes(self) -> int:
        """The most bytes of text one result carries: ``max_result_tokens``, estimated."""
        return self.max_result_tokens * BYTES_PER_TOKEN

    @property
    def kubernetes_agent_ca(self) -> Path:
        """The CA certificate the agents trust (public: sandbox pods mount it too)."""
        return self.kubernetes_agent_tls_dir / "ca.crt"

    @property
    def kubernetes_server_cert(self) -> Path:
        """The certificate this server presents to agents, signed by that CA."""
        return self.kubernetes_agent_tls_dir / "server.crt"

    @property
    def kubernetes_server_key(self) -> Path:
        """Its private key: the one secret that drives agents (never in a sandbox pod)."""
        return self.kubernetes_agent_tls_dir / "server.key"

    @property
    def workspaces_dir(self) -> Path:
        return self.state_dir / "workspaces"

    @property
    def volumes_dir(self) -> Path:
        """The workspaces' filesystem images (``workspace_quota_mode`` filesystem)."""
        return self.state_dir / "volumes"

    @property
    def sessions_dir(self) -> Path:
        """One small JSON record per session (no secrets, no code): see ``sessions.records``."""
        return self.state_dir / "sessions"

    @property
    def runlogs_dir(self) -> Path:
        """Each session's runs, in order (``sessions.runlog``): one file per slot."""
        return self.state_dir / "runlogs"

    @property
    def run_dir(self) -> Path:
        """Per-process records (pid files) used to find what a dead server left behind."""
        return self.state_dir / "run"


class ConfigError(Exception):
    """Invalid configuration: ``lines`` has one human line per problem."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines


def load_settings(
    overrides: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> Settings:
    """Build the settings from ``environ`` (default: the process env) plus CLI overrides.

    ``overrides`` are values from CLI flags, keyed by field name; they win over the env.
    """
    env = dict(os.environ if environ is None else environ)
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    try:
        if environ is None:
            return Settings(**given)
        # An explicit environ: read only that, never the process env.
        from_env = {
            name: env[key]
            for name in Settings.model_fields
            if (key := f"SANDBOX_{name.upper()}") in env
        }
        return Settings(**{**from_env, **given})
    except ValidationError as exc:
        raise ConfigError([_describe(err) for err in exc.errors()]) from None


#: ``SANDBOX_*`` names that are no setting but not a mistake either: the test suite's
#: own switches, which CI exports for the whole run (servers under test inherit them).
_NOT_SETTINGS = frozenset(
    {"SANDBOX_REQUIRE_DOCKER", "SANDBOX_TEST_RUNTIME_PYTHON", "SANDBOX_K8S_E2E"}
)


#: Settings that were removed, with what became of each: a user who still sets one is
#: told so at start, not left to believe it works.
_REMOVED = {
    "SANDBOX_POOL_MAX_AGE_S": "pooled sandboxes are replaced after an hour",
    "SANDBOX_WORKSPACE_SPARE_IMAGES": "two spare workspace images are kept",
    "SANDBOX_WORKER_THREADS": "eight worker threads serve blocking work",
}


def otlp_configured(environ: Mapping[str, str] | None = None) -> bool:
    """Does the environment ask for traces over OTLP (the OpenTelemetry SDK's own
    variables, which it reads itself: see ``mcp_code_sandbox.tracing``)?"""
    env = os.environ if environ is None else environ
    return bool(
        env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """One warning per ``SANDBOX_*`` variable of ``environ`` (default: the process env)
    that names no setting (a typo is otherwise silently ignored), with the closest
    setting's name when there is one, or what became of it when it was removed. Logged
    by the CLI at start."""
    env = os.environ if environ is None else environ
    known = {f"SANDBOX_{name.upper()}" for name in Settings.model_fields}
    lines = []
    for name in sorted(env):
        upper = name.upper()
        if not upper.startswith("SANDBOX_") or upper in known or upper in _NOT_SETTINGS:
            continue
        shown = name[:80]
        if upper in _REMOVED:
            lines.append(f"setting {shown} was removed and is ignored: {_REMOVED[upper]}")
            continue
        # Compared without the prefix, which every name shares.
        close = difflib.get_close_matches(upper[8:], [k[8:] for k in known], n=1, cutoff=0.7)
        hint = f"; did you mean SANDBOX_{close[0]}?" if close else ""
        lines.append(f"unknown setting {shown} is ignored{hint}")
    return lines


#: Never repeated in an error message.
_SECRET_SETTINGS = frozenset({"api_tokens", "url_secret", "metrics_token"})


def _describe(err: Mapping[str, Any]) -> str:
    loc = [str(part) for part in err.get("loc", ()) if part != "__root__"]
    name = loc[0] if loc else ""
    where = f"SANDBOX_{name.upper()} (--{name.replace('_', '-')})" if name else "settings"
    msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
    value = err.get("input")
    secret = name in _SECRET_SETTINGS
    shown = f" (got {value!r})" if name and not isinstance(value, dict) and not secret else ""
    return f"invalid configuration: {where}: {msg}{shown}"


#: What docker-py's ``from_env`` reads: where the engine is and how to talk TLS to it.
_DOCKER_VARS = ("DOCKER_HOST", "DOCKER_TLS_VERIFY", "DOCKER_CERT_PATH")


def docker_environ(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``DOCKER_*`` variables of ``environ`` (default: the process env).

    Not ``SANDBOX_`` settings: they are the engine's own, shared with the ``docker`` CLI,
    and passed as they are to ``docker.from_env(environment=...)``. Empty: the default
    socket, ``/var/run/docker.sock``.
    """
    env = os.environ if environ is None else environ
    return {name: env[name] for name in _DOCKER_VARS if env.get(name)}


_CA_VARIABLES = ("PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE")


def ca_bundle_from_env(environ: Mapping[str, str] | None = None) -> Path | None:
    """The CA bundle named by ``PIP_CERT``, ``SSL_CERT_FILE`` or ``REQUESTS_CA_BUNDLE``.

    What ``image build`` copies into its build stages when ``--ca-bundle`` is not given:
    like ``DOCKER_*``, these are the tools' own variables, not ``SANDBOX_`` settings.
    """
    env = os.environ if environ is None else environ
    for name in _CA_VARIABLES:
        if value := env.get(name):
            return Path(value)
    return None
