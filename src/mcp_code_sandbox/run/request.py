"""What a ``run_code`` call asks for, and the server's refusals of it.

The tool layer (and the ``exec`` CLI command) build a :class:`RunRequest`; the service
checks it with :func:`check_request` before it holds a session, so a refused call costs no
sandbox. Whether the language is offered is :class:`.languages.Languages`'s to say.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mcp_code_sandbox.errors import CodeTooLarge, EnvNotAllowed, InvalidArgument, NetworkNotAllowed
from mcp_code_sandbox.settings import FORBIDDEN_ENV, Settings

__all__ = ["RunRequest", "check_request"]


@dataclass(frozen=True)
class RunRequest:
    code: str
    language: str = "python"
    #: ``None``: the server's default (``exec_timeout_s``).
    timeout_s: float | None = None
    #: ``True``: the server's whole network policy; a list: only those hosts (a subset
    #: of it); ``False`` or an empty list: no network.
    network: bool | Sequence[str] = False
    #: Variables for this call only; ``None`` or empty: none.
    env: Mapping[str, str] | None = None

    @property
    def network_wish(self) -> tuple[str, ...] | None:
        """The network as the session side takes it: ``None`` none, ``()`` the server's
        policy, else the hosts asked for (see ``sessions.egress``)."""
        if self.network is True:
            return ()
        if self.network is False or not self.network:
            return None
        return tuple(str(host) for host in self.network)


def check_request(settings: Settings, request: RunRequest) -> float:
    """Refuse what this server does not allow (code size, network, env, timeout); return
    the effective timeout. Called by the service first (before any wait)."""
    if len(request.code.encode("utf-8")) > settings.max_code_bytes:
        raise CodeTooLarge(
            f"code is larger than {settings.max_code_bytes} bytes; upload data with "
            "upload_file and read it from /mnt/data instead of inlining it"
        )
    if request.network_wish is not None and not settings.allow_network:
        raise NetworkNotAllowed(
            "this server does not allow network access from sandboxes "
            "(the operator can set SANDBOX_ALLOW_NETWORK=true)"
        )
    if request.env:
        if not settings.allow_call_env:
            raise EnvNotAllowed(
                "this server does not accept env per call (the operator can set "
                "SANDBOX_ALLOW_CALL_ENV=true); run without env"
            )
        bad = sorted(k for k in request.env if k.upper() in FORBIDDEN_ENV or "=" in k or not k)
        if bad:
            raise InvalidArgument(f"env may not set {', '.join(bad)}: they control the sandbox")
    timeout = settings.exec_timeout_s if request.timeout_s is None else request.timeout_s
    if not 0 < timeout <= settings.max_exec_timeout_s:
        raise InvalidArgument(
            f"timeout_s must be more than 0 and at most {settings.max_exec_timeout_s:g}"
        )
    return timeout
