"""Settings: env and flags, sizes, and one clear line per invalid value."""

import subprocess
import sys

import pytest

from mcp_code_sandbox.settings import (
    ConfigError,
    Settings,
    load_settings,
    otlp_configured,
    parse_size,
    unknown_variables,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512m", 512 * 1024**2),
        ("1g", 1024**3),
        ("1GiB", 1024**3),
        ("100k", 102400),
        ("4096", 4096),
        ("1.5m", int(1.5 * 1024**2)),
    ],
)
def test_sizes(text: str, expected: int) -> None:
    assert parse_size(text) == expected


def test_defaults_match_the_design() -> None:
    s = load_settings(environ={})
    assert s.backend == "auto"
    assert s.memory_limit == 512 * 1024**2
    assert s.cpu_limit == 1.0
    assert s.pids_limit == 256
    assert s.exec_timeout_s == 60
    assert s.max_exec_timeout_s == 600
    assert s.session_ttl_m == 7 * 24 * 60
    assert s.session_max_lifetime_h == 30 * 24
    assert s.max_sessions == 10
    assert s.max_upload_bytes == 50 * 1024**2
    assert s.max_output_bytes == 100 * 1024
    assert s.max_code_bytes == 100 * 1024
    assert s.workspace_quota_bytes == 1024**3
    assert s.allow_network is False
    assert s.allow_call_env is False
    assert (s.http_host, s.http_port) == ("127.0.0.1", 8080)
    assert s.log_format == "console"


def test_env_and_overrides() -> None:
    env = {
        "SANDBOX_MEMORY_LIMIT": "1g",
        "SANDBOX_PASS_THROUGH_ENV": "A, B",
        "SANDBOX_MAX_SESSIONS": "3",
        "SANDBOX_LOG_LEVEL": "debug",
    }
    s = load_settings({"max_sessions": 5}, environ=env)
    assert s.memory_limit == 1024**3
    assert s.pass_through_env == ["A", "B"]
    assert s.max_sessions == 5  # the flag wins
    assert s.log_level == "DEBUG"


def test_each_invalid_value_gets_its_own_line() -> None:
    env = {"SANDBOX_MEMORY_LIMIT": "lots", "SANDBOX_BACKEND": "k8s", "SANDBOX_CPU_LIMIT": "-1"}
    with pytest.raises(ConfigError) as info:
        load_settings(environ=env)
    lines = info.value.lines
    assert len(lines) == 3
    assert any("SANDBOX_MEMORY_LIMIT" in line and "512m" in line for line in lines)
    assert any("SANDBOX_BACKEND" in line and "'k8s'" in line for line in lines)
    assert any("SANDBOX_CPU_LIMIT" in line for line in lines)


def test_timeout_larger_than_max_is_refused() -> None:
    with pytest.raises(ConfigError, match="max_exec_timeout_s"):
        load_settings(environ={"SANDBOX_EXEC_TIMEOUT_S": "900"})


def test_bad_pass_through_name() -> None:
    with pytest.raises(ConfigError, match="PASS_THROUGH_ENV"):
        load_settings(environ={"SANDBOX_PASS_THROUGH_ENV": "OK,NOT-OK"})


def test_tokens_never_echoed() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(environ={"SANDBOX_API_TOKENS": "x", "SANDBOX_HTTP_PORT": "99999"})
    assert "x'" not in str(info.value)


def test_cli_stops_with_one_line_per_problem(tmp_path: object) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mcp_code_sandbox",
            "serve",
            "--memory-limit",
            "huge",
            "--pids-limit",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2, proc.stderr
    assert all(line.startswith("invalid configuration: SANDBOX_") for line in lines)


def test_several_owners_get_a_share_of_the_sessions_each() -> None:
    def per_owner(**env: str) -> int | None:
        return load_settings(
            environ={f"SANDBOX_{k.upper()}": v for k, v in env.items()}
        ).sessions_per_owner

    one, two = "a:" + "a" * 24, "a:" + "a" * 24 + ",b:" + "b" * 24
    assert per_owner() is None  # stdio or a single owner: max_sessions alone
    assert per_owner(api_tokens=one) is None
    assert per_owner(api_tokens=two) == 5
    assert per_owner(api_tokens=two, max_sessions="3") == 1
    assert per_owner(api_tokens=two, max_sessions="1") == 1
    assert per_owner(api_tokens_file="/etc/tokens") == 5  # reloadable: names may come
    assert per_owner(oauth_issuer="https://idp.example.com") == 5
    assert per_owner(api_tokens=two, max_sessions_per_owner="9") == 9  # explicit wins


def test_a_removed_setting_still_set_is_named_as_removed() -> None:
    lines = unknown_variables({"SANDBOX_WORKER_THREADS": "16", "SANDBOX_POOL_MAX_AGE_S": "60"})
    assert lines == [
        "setting SANDBOX_POOL_MAX_AGE_S was removed and is ignored: "
        "pooled sandboxes are replaced after an hour",
        "setting SANDBOX_WORKER_THREADS was removed and is ignored: "
        "eight worker threads serve blocking work",
    ]
    assert "worker_threads" not in Settings.model_fields


@pytest.mark.parametrize(("value", "expected"), [("true", True), ("1", True), ("false", False)])
def test_replica_is_read_from_the_environment(value: str, expected: bool) -> None:
    assert load_settings(environ={"SANDBOX_REPLICA": value}).replica is expected
    assert "SANDBOX_REPLICA" not in " ".join(unknown_variables({"SANDBOX_REPLICA": value}))


def test_replica_is_off_by_default_and_refuses_nonsense() -> None:
    assert load_settings(environ={}).replica is False
    with pytest.raises(ConfigError) as info:
        load_settings(environ={"SANDBOX_REPLICA": "sometimes"})
    [line] = info.value.lines
    assert "SANDBOX_REPLICA" in line


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": ""}, False),  # set but empty: not asked for
        ({"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://collector:4318"}, False),
        ({}, False),
    ],
)
def test_traces_are_sent_when_either_otlp_endpoint_is_set(
    environ: dict[str, str], expected: bool
) -> None:
    assert otlp_configured(environ) is expected


def test_kubernetes_settings_read_names_and_the_tls_files_in_one_directory() -> None:
    s = load_settings(
        environ={
            "SANDBOX_KUBERNETES_NAMESPACE": "sandboxes",
            "SANDBOX_KUBERNETES_RUNTIME_CLASS": "gvisor",
            "SANDBOX_KUBERNETES_STORAGE_CLASS": "",  # compose's unset: no pausing
            "SANDBOX_KUBERNETES_AGENT_TLS_DIR": "/run/tls",
        }
    )
    assert (s.kubernetes_namespace, s.kubernetes_runtime_class) == ("sandboxes", "gvisor")
    assert s.kubernetes_storage_class is None and s.kubernetes_seccomp_profile is None
    assert str(s.kubernetes_agent_ca) == "/run/tls/ca.crt"
    assert str(s.kubernetes_server_cert) == "/run/tls/server.crt"
    assert str(s.kubernetes_server_key) == "/run/tls/server.key"


def test_kubernetes_names_are_checked_at_start() -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(
            environ={
                "SANDBOX_KUBERNETES_NAMESPACE": "Sandboxes",
                "SANDBOX_KUBERNETES_RUNTIME_CLASS": "g visor",
                "SANDBOX_KUBERNETES_SECCOMP_PROFILE": "../etc/profile.json",
            }
        )
    assert [line.split(":")[1].strip() for line in caught.value.lines] == [
        "SANDBOX_KUBERNETES_NAMESPACE (--kubernetes-namespace)",
        "SANDBOX_KUBERNETES_RUNTIME_CLASS (--kubernetes-runtime-class)",
        "SANDBOX_KUBERNETES_SECCOMP_PROFILE (--kubernetes-seccomp-profile)",
    ]
