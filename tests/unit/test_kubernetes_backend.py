"""The kubernetes backend's start: what an operator who forgot a piece is told."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mcp_code_sandbox.backends import choose_backend
from mcp_code_sandbox.settings import ConfigError, load_settings


def test_without_an_api_the_server_stops_naming_kubeconfig(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-such-kubeconfig"))
    monkeypatch.setenv("HOME", str(tmp_path))
    settings = load_settings({"backend": "kubernetes"}, environ={})
    with pytest.raises(ConfigError) as caught:
        choose_backend(settings)
    [line] = caught.value.lines
    assert "SANDBOX_BACKEND=kubernetes: no Kubernetes API found" in line
    assert "KUBECONFIG" in line


def test_without_the_agents_certificate_the_server_stops_naming_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kubeconfig = tmp_path / "kubeconfig"  # read at start, never asked: nothing listens
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": "https://127.0.0.1:9"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
    }))  # fmt: skip
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    settings = load_settings(
        {"backend": "kubernetes", "kubernetes_agent_tls_dir": str(tmp_path / "no-certs")},
        environ={},
    )
    with pytest.raises(ConfigError) as caught:
        choose_backend(settings)
    [line] = caught.value.lines
    assert "cannot load the agents' server certificate" in line
    assert "mcp-code-sandbox kubernetes certs --out DIR" in line
