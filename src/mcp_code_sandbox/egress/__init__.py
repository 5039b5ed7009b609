"""The egress proxy: a networked sandbox's only way out (issue 14).

Layer: above ``workspace/``, below ``backends/``; imports only errors, settings, sanitize,
logs and metrics of the package. The sandbox side (binding the socket in, the bridge,
the proxy variables) belongs to the backends; this package is the host side::

    policy.py    Policy: allow/deny host patterns, presets, address ranges; narrowed per call
    dns.py       resolution by the proxy, and the address check before every connect
    secrets.py   SANDBOX_SECRETS_FILE: secrets, their hosts and header, placeholders
    tls.py       SNI check of CONNECT tunnels; TLS termination with an ephemeral CA
    streams.py   counted, bounded byte streams; the two-way pipe of a tunnel
    http.py      HTTP/1.1 relaying with h11; ambiguous framing refused, bodies re-framed
    intercept.py requests inside a terminated TLS session: the secrets added
    audit.py     one audit line and one metrics count per connection
    limits.py    the proxies' share of the server's descriptors; the pace of refusals
    proxy.py     open_proxy() -> EgressProxy on a Unix socket: CONNECT and plain HTTP
    gate.py      ProxyGate: one TCP port for many proxies, a credential per proxy
"""

from .dns import (
    ResolveFailed,
    Resolver,
    resolver_from_settings,
    static_resolver,
    system_resolver,
)
from .gate import Credential, ProxyGate
from .policy import Decision, Policy
from .presets import PRESETS, learn_presets, preset_hosts
from .proxy import EgressProxy, blocked_message, open_proxy
from .secrets import Secret, SecretsFileError, load_secrets, placeholder, placeholder_env

__all__ = [
    "PRESETS",
    "Credential",
    "Decision",
    "EgressProxy",
    "Policy",
    "ProxyGate",
    "ResolveFailed",
    "Resolver",
    "Secret",
    "SecretsFileError",
    "blocked_message",
    "learn_presets",
    "load_secrets",
    "open_proxy",
    "placeholder",
    "placeholder_env",
    "preset_hosts",
    "resolver_from_settings",
    "static_resolver",
    "system_resolver",
]
