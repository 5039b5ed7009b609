"""The server image's build context and Dockerfile, and the deployment files beside them
(deploy/compose.yaml, deploy/.env.example), checked without an engine. The e2e test
tests/e2e/test_deployment.py builds nothing: it runs what these files describe."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from mcp_code_sandbox.errors import BackendUnavailable
from mcp_code_sandbox.provision import server_image
from mcp_code_sandbox.settings import Settings

REPO = Path(__file__).resolve().parents[2]


def test_dependencies_are_pyprojects() -> None:
    text = (REPO / "pyproject.toml").read_text()
    deps = server_image.dependencies(text)
    assert deps == tomllib.loads(text)["project"]["dependencies"]
    assert any(d.startswith("mcp") for d in deps)
    with pytest.raises(BackendUnavailable):
        server_image.dependencies('[project]\ndependencies = "mcp"\n')


def test_context(tmp_path: Path) -> None:
    context = tmp_path / "context"
    context.mkdir()
    (context / "stale").write_text("x")
    bundle = tmp_path / "ca.pem"
    bundle.write_text("-----BEGIN CERTIFICATE-----\n")
    server_image.prepare_server_context(context, bundle)
    assert sorted(p.name for p in context.iterdir()) == [
        "Dockerfile",
        "build-ca",
        "project",
        "requirements.txt",
    ]
    assert (context / "Dockerfile").read_text() == (REPO / "images/server.Dockerfile").read_text()
    assert (context / "build-ca" / "ca.pem").read_text() == bundle.read_text()
    project = context / "project"
    assert sorted(p.name for p in project.iterdir()) == [
        "README.md",
        "images",
        "pyproject.toml",
        "src",
    ]
    assert (project / "src" / "mcp_code_sandbox" / "cli.py").is_file()
    assert (project / "images" / "Dockerfile").is_file()  # the wheel's force-include
    assert not list(project.rglob("__pycache__"))
    assert not list(project.rglob("*.pyc"))


def test_a_wheel_install_has_no_checkout(tmp_path: Path) -> None:
    fake = tmp_path / "site-packages" / "mcp_code_sandbox" / "provision" / "server_image.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("")
    with pytest.raises(BackendUnavailable, match="source checkout"):
        server_image.source_root(fake)
    assert server_image.source_root() == REPO


def test_server_dockerfile_keeps_the_contract() -> None:
    text = (REPO / "images" / "server.Dockerfile").read_text()
    assert "ARG BASE=python:3.11-slim" in text
    assert "FROM ${BASE} AS python" in text
    # The CA bundle only enters the venv stage; the final stage copies the venv alone.
    final = text.split("\nFROM python\n", 1)[1]
    assert "build-ca" not in final
    assert "COPY --from=venv /opt/mcp-code-sandbox /opt/mcp-code-sandbox" in final
    assert "SANDBOX_BACKEND=docker" in final
    assert "SANDBOX_HTTP_HOST=0.0.0.0" in final
    # The appliance: no command serves stdio; compose asks for HTTP and checks /healthz.
    assert 'ENTRYPOINT ["mcp-code-sandbox"]\n' in final
    assert "\nCMD " not in final and "\nHEALTHCHECK " not in final
    # State and uid leases in the state dir's volume, shared by appliances on it.
    assert "SANDBOX_UID_LEASE_DIR=/var/lib/mcp-code-sandbox/uids" in final
    assert "VOLUME /var/lib/mcp-code-sandbox\n" in final


def test_compose_mounts_the_socket_and_maps_the_state_dir() -> None:
    text = (REPO / "deploy" / "compose.yaml").read_text()
    assert "- ${MCS_DOCKER_SOCKET:-/var/run/docker.sock}:/var/run/docker.sock\n" in text
    host_dir = "${MCS_HOST_STATE_DIR:-/var/lib/mcp-code-sandbox-compose}"
    # The same host path is the mount's source and what the server names to the engine.
    assert f"- {host_dir}:/var/lib/mcp-code-sandbox\n" in text
    assert f"SANDBOX_DOCKER_HOST_STATE_DIR: {host_dir}\n" in text
    assert "SANDBOX_STATE_DIR: /var/lib/mcp-code-sandbox\n" in text
    assert '"${MCS_BIND:-127.0.0.1}:${MCS_PORT:-8080}:8080"' in text  # loopback by default
    assert "/healthz" in text and "restart: unless-stopped" in text
    assert 'command: ["serve", "--transport", "http"]' in text
    assert "SANDBOX_UID_LEASE_DIR: /run/mcp-code-sandbox/uids\n" in text  # the host's


def test_env_example_names_every_setting() -> None:
    text = (REPO / "deploy" / ".env.example").read_text()
    named = set(re.findall(r"\bSANDBOX_([A-Z0-9_]+)", text))
    missing = {f"SANDBOX_{n.upper()}" for n in Settings.model_fields} - {
        f"SANDBOX_{n}" for n in named
    }
    assert not missing, f"deploy/.env.example does not mention {sorted(missing)}"
    # The one line that is not commented out is the token the server cannot start without.
    active = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert [line.split("=", 1)[0] for line in active] == ["SANDBOX_API_TOKENS"]
