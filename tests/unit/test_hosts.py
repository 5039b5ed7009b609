"""Host/Origin allow-lists (DNS-rebinding protection) and their settings."""

from __future__ import annotations

import pytest

from mcp_code_sandbox.server import hosts
from mcp_code_sandbox.server.hosts import allowed_hosts, allowed_origins, transport_security
from mcp_code_sandbox.settings import ConfigError, load_settings


def test_all_is_honest() -> None:
    for name in hosts.__all__:
        assert hasattr(hosts, name)


def test_default_is_loopback_on_any_port() -> None:
    # Any port: behind a published container port the Host is not the server's own port,
    # and a rebinding page sends its own name, never a loopback one.
    s = load_settings(environ={})
    assert allowed_hosts(s) == ["127.0.0.1:*", "localhost:*", "[::1]:*"]
    assert "http://localhost:*" in allowed_origins(s)
    security = transport_security(s)
    assert security.enable_dns_rebinding_protection


def test_port_zero_and_bind_addresses() -> None:
    assert "localhost:*" in allowed_hosts(load_settings({"http_port": 0}, environ={}))
    specific = load_settings({"http_host": "10.1.2.3", "http_port": 9000}, environ={})
    assert "10.1.2.3:9000" in allowed_hosts(specific)
    v6 = load_settings({"http_host": "fd00::5", "http_port": 9000}, environ={})
    assert "[fd00::5]:9000" in allowed_hosts(v6)
    wildcard = load_settings({"http_host": "0.0.0.0"}, environ={})
    assert allowed_hosts(wildcard) == ["127.0.0.1:*", "localhost:*", "[::1]:*"]


def test_public_base_url_and_extras_are_added() -> None:
    env = {
        "SANDBOX_PUBLIC_BASE_URL": "https://sandbox.example.com/base",
        "SANDBOX_ALLOWED_HOSTS": "proxy.internal:*, 10.0.0.7:8080",
        "SANDBOX_ALLOWED_ORIGINS": "https://chat.example.com",
    }
    s = load_settings(environ=env)
    got = allowed_hosts(s)
    assert got[:3] == ["127.0.0.1:*", "localhost:*", "[::1]:*"]
    assert {"sandbox.example.com", "proxy.internal:*", "10.0.0.7:8080"} <= set(got)
    origins = allowed_origins(s)
    assert {"https://sandbox.example.com", "https://chat.example.com"} <= set(origins)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("SANDBOX_ALLOWED_HOSTS", "https://example.com"),
        ("SANDBOX_ALLOWED_HOSTS", "example.com/path"),
        ("SANDBOX_ALLOWED_ORIGINS", "example.com"),
        ("SANDBOX_ALLOWED_ORIGINS", "https://example.com/path"),
        ("SANDBOX_PUBLIC_BASE_URL", "sandbox.example.com"),
    ],
)
def test_malformed_values_stop_the_server(name: str, value: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(environ={name: value})
    assert name in str(err.value)


def test_a_short_metrics_token_is_refused_and_never_echoed() -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(environ={"SANDBOX_METRICS_TOKEN": "hunter2"})
    assert "SANDBOX_METRICS_TOKEN" in str(err.value)
    assert "hunter2" not in str(err.value)
    s = load_settings(environ={"SANDBOX_METRICS_TOKEN": "x" * 32})
    assert "x" * 32 not in repr(s)
