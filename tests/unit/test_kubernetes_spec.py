"""backends/kubernetes/spec.py: every object it makes is valid for the Kubernetes API
(its published schemas, strict: an unknown field fails) and carries the hardening a
sandbox pod must have, checked without a cluster."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from mcp_code_sandbox.backends.base import Egress, Limits, SandboxSpec
from mcp_code_sandbox.backends.kubernetes import spec as k8s
from mcp_code_sandbox.layout import SANDBOX_UID
from mcp_code_sandbox.settings import Settings, load_settings

#: The oldest and the newest Kubernetes versions the manifests are checked against.
VERSIONS = ("1.33.0", "1.37.0")
KEY = "s" + "0123456789abcdef0123456789abcde"  # the shape of sessions.ids.session_key
LIMITS = Limits(memory_bytes=768 << 20, cpu=1.5, pids=128, tmp_bytes=64 << 20, file_bytes=1 << 30)

SETTINGS = {
    "defaults": {},
    "gvisor, seccomp, storage": {
        "SANDBOX_KUBERNETES_NAMESPACE": "sandboxes",
        "SANDBOX_KUBERNETES_RUNTIME_CLASS": "gvisor",
        "SANDBOX_KUBERNETES_SECCOMP_PROFILE": "profiles/mcp-code-sandbox.json",
        "SANDBOX_KUBERNETES_STORAGE_CLASS": "standard",
        "SANDBOX_IMAGE": "registry.example.com/mcp-code-sandbox:1.0",
        "SANDBOX_PRELOAD": "",
    },
}


def settings(name: str) -> Settings:
    return load_settings(environ=SETTINGS[name])


def session(**kw: Any) -> SandboxSpec:
    values: dict[str, Any] = {
        "key": KEY,
        "owner": "alice",
        "session_id": "my-session",
        "workspace": Path("/var/lib/mcs/workspaces/k1"),
        "limits": LIMITS,
        "env": {"API_KEY": "not-in-the-pod"},
        "uid": 0x7000_0001,
    }
    values.update(kw)
    return SandboxSpec(**values)


def every_object(s: Settings) -> list[dict[str, Any]]:
    """What spec.py makes for ``s``: a warm pod, session pods with and without a uid and
    a workspace claim, the claim, and the policy (in its namespace and across two)."""
    objects = [
        k8s.warm_pod("warm-1", s),
        k8s.session_pod(session(), "pod-1", s),
        k8s.session_pod(session(uid=None, egress=Egress(Path("/x"))), "pod-2", s),
        k8s.session_pod(session(), "pod-3", s, workspace_claim="ws-1"),
        k8s.sandbox_network_policy(s),
        k8s.sandbox_network_policy(s, server_namespace="mcp-server"),
        k8s.sandbox_egress_policy(s),
        k8s.sandbox_egress_policy(s, server_namespace="mcp-server"),
    ]
    if s.kubernetes_storage_class is not None:
        objects.append(k8s.workspace_claim("ws-1", session(), s))
        objects.append(k8s.workspace_claim("warm-2", None, s))
        objects.append(k8s.warm_pod("warm-2", s, own_claim=True))
    return objects


def pods(s: Settings) -> list[dict[str, Any]]:
    return [o for o in every_object(s) if o["kind"] == "Pod"]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", SETTINGS)
def test_every_object_is_valid_for_the_kubernetes_api(name: str, version: str) -> None:
    for obj in every_object(settings(name)):
        kubernetes_validate.validate(obj, version, strict=True)


def test_the_validation_catches_a_field_the_api_does_not_have() -> None:
    pod = k8s.warm_pod("warm-1", settings("defaults"))
    pod["spec"]["containers"][0]["securityContext"]["readOnlyRoot"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, VERSIONS[0], strict=True)


@pytest.mark.parametrize("name", SETTINGS)
def test_every_pod_is_hardened(name: str) -> None:
    s = settings(name)
    for pod in pods(s):
        spec = pod["spec"]
        assert spec["automountServiceAccountToken"] is False
        assert spec["enableServiceLinks"] is False
        assert spec["shareProcessNamespace"] is False
        assert "hostNetwork" not in spec and "hostPID" not in spec and "hostIPC" not in spec
        assert spec["terminationGracePeriodSeconds"] <= 2
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] > 0
        [container] = spec["containers"]
        assert container["securityContext"] == {
            "runAsNonRoot": True,
            "privileged": False,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        }
        assert container["resources"]["requests"] == container["resources"]["limits"]
        assert set(container["resources"]["limits"]) == {"cpu", "memory", "ephemeral-storage"}
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["tmp"]["emptyDir"]["medium"] == "Memory"
        assert int(volumes["tmp"]["emptyDir"]["sizeLimit"]) > 0
        ca = volumes["agent-ca"]["configMap"]
        assert ca["name"] == "mcp-code-sandbox-agent-ca" and ca["defaultMode"] == 0o444
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert set(mounts) == {"/tmp", "/mnt/data", "/etc/mcp-code-sandbox"}
        assert mounts["/etc/mcp-code-sandbox"]["readOnly"] is True


def test_seccomp_is_the_runtime_default_or_the_configured_profile() -> None:
    [default] = {
        json.dumps(p["spec"]["securityContext"]["seccompProfile"])
        for p in pods(settings("defaults"))
    }
    assert json.loads(default) == {"type": "RuntimeDefault"}
    configured = settings("gvisor, seccomp, storage")
    for pod in pods(configured):
        assert pod["spec"]["securityContext"]["seccompProfile"] == {
            "type": "Localhost",
            "localhostProfile": "profiles/mcp-code-sandbox.json",
        }
        assert pod["spec"]["runtimeClassName"] == "gvisor"
        assert pod["metadata"]["namespace"] == "sandboxes"
        assert pod["spec"]["containers"][0]["image"] == "registry.example.com/mcp-code-sandbox:1.0"
    assert all("runtimeClassName" not in p["spec"] for p in pods(settings("defaults")))


def test_a_session_pod_runs_as_its_own_uid_and_a_warm_one_as_the_images() -> None:
    s = settings("defaults")
    own = k8s.session_pod(session(), "pod-1", s)["spec"]["securityContext"]
    assert (own["runAsUser"], own["runAsGroup"]) == (0x7000_0001, 0x7000_0001)
    shared = k8s.session_pod(session(uid=None), "pod-2", s)["spec"]["securityContext"]
    warm = k8s.warm_pod("warm-1", s)["spec"]["securityContext"]
    assert shared["runAsUser"] == warm["runAsUser"] == SANDBOX_UID
    # An emptyDir is writable by any uid; a claim's files are given to the session's.
    assert "fsGroup" not in own
    claimed = k8s.session_pod(session(), "pod-3", s, workspace_claim="ws-1")["spec"]
    assert claimed["securityContext"]["fsGroup"] == 0x7000_0001


def test_the_agent_listens_on_its_pod_address_and_trusts_the_mounted_ca() -> None:
    pod = k8s.warm_pod("warm-1", settings("defaults"))
    [container] = pod["spec"]["containers"]
    command = container["command"]
    assert command[command.index("--listen") + 1] == "$(POD_IP):7070"
    assert command[command.index("--ca") + 1] == "/etc/mcp-code-sandbox/ca.crt"
    assert "-m" in command and "--config" in command
    config = json.loads(command[command.index("--config") + 1])
    assert config["preload"] == ["numpy", "pandas", "matplotlib.pyplot"]
    assert config["memory_bytes"] is None and config["pids"] is None  # cgroup-bound
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert container["ports"] == [{"name": "agent", "containerPort": 7070, "protocol": "TCP"}]
    assert container["readinessProbe"]["tcpSocket"] == {"port": "agent"}


def test_a_session_pod_carries_who_it_is_for_and_no_secret() -> None:
    s = settings("defaults")
    pod = k8s.session_pod(session(), "pod-1", s)
    assert pod["metadata"]["labels"] == {
        "app.kubernetes.io/name": "mcp-code-sandbox",
        "app.kubernetes.io/component": "sandbox",
        "mcp-code-sandbox/pool": "claimed",
        "mcp-code-sandbox/session-key": KEY,
    }
    assert pod["metadata"]["annotations"] == {
        "mcp-code-sandbox/owner": "alice",
        "mcp-code-sandbox/session-id": "my-session",
    }
    assert "not-in-the-pod" not in json.dumps(pod)  # the session's env goes over the channel
    assert pod["metadata"] | k8s.claim_metadata(session()) == pod["metadata"]


def test_a_warm_pod_is_anonymous() -> None:
    pod = k8s.warm_pod("warm-1", settings("defaults"))
    assert pod["metadata"]["labels"]["mcp-code-sandbox/pool"] == "warm"
    assert "mcp-code-sandbox/session-key" not in pod["metadata"]["labels"]
    assert "annotations" not in pod["metadata"]


def test_a_key_that_is_no_label_value_is_refused() -> None:
    with pytest.raises(ValueError, match="label value"):
        k8s.session_pod(session(key="a/b"), "pod-1", settings("defaults"))


def test_limits_become_requests_and_limits_and_volume_sizes() -> None:
    s = settings("defaults")
    pod = k8s.session_pod(session(), "pod-1", s)
    resources = pod["spec"]["containers"][0]["resources"]["limits"]
    assert resources["cpu"] == "1500m" and resources["memory"] == str(768 << 20)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["tmp"]["emptyDir"]["sizeLimit"] == str(64 << 20)
    assert volumes["workspace"]["emptyDir"]["sizeLimit"] == str(s.workspace_quota_bytes)
    # The workspace's disk counts in an emptyDir, not on a claim.
    claimed = k8s.session_pod(session(), "pod-3", s, workspace_claim="ws-1")
    volumes = {v["name"]: v for v in claimed["spec"]["volumes"]}
    assert volumes["workspace"] == {
        "name": "workspace",
        "persistentVolumeClaim": {"claimName": "ws-1"},
    }
    on_claim = claimed["spec"]["containers"][0]["resources"]["limits"]["ephemeral-storage"]
    assert int(on_claim) + s.workspace_quota_bytes == int(resources["ephemeral-storage"])
    warm = k8s.warm_pod("warm-1", s)["spec"]["containers"][0]["resources"]["limits"]
    assert warm["memory"] == str(s.memory_limit) and warm["cpu"] == "1000m"


def test_a_workspace_claim_has_the_quota_the_class_and_the_session_labels() -> None:
    s = settings("gvisor, seccomp, storage")
    claim = k8s.workspace_claim("ws-1", session(), s)
    assert claim["spec"]["storageClassName"] == "standard"
    assert claim["spec"]["resources"]["requests"]["storage"] == str(s.workspace_quota_bytes)
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claim["metadata"]["labels"]["mcp-code-sandbox/session-key"] == KEY
    assert claim["metadata"]["labels"]["app.kubernetes.io/component"] == "workspace"
    with pytest.raises(ValueError, match="StorageClass"):
        k8s.workspace_claim("ws-1", session(), settings("defaults"))


def test_with_a_storage_class_a_warm_pod_has_an_anonymous_claim_of_its_name() -> None:
    s = settings("gvisor, seccomp, storage")
    claim = k8s.workspace_claim("warm-2", None, s)
    assert "mcp-code-sandbox/session-key" not in claim["metadata"]["labels"]
    assert claim["metadata"]["annotations"] == {}
    pod = k8s.warm_pod("warm-2", s, own_claim=True)
    [workspace] = [v for v in pod["spec"]["volumes"] if v["name"] == "workspace"]
    assert workspace == {"name": "workspace", "persistentVolumeClaim": {"claimName": "warm-2"}}
    assert pod["metadata"]["labels"]["mcp-code-sandbox/pool"] == "warm"


def test_the_policy_lets_only_the_server_in_on_the_agent_port_and_nothing_out() -> None:
    policy = k8s.sandbox_network_policy(settings("defaults"))["spec"]
    assert policy["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "sandbox"
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    assert policy["egress"] == []
    [rule] = policy["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 7070}]
    [peer] = rule["from"]
    assert peer == {
        "podSelector": {
            "matchLabels": {
                "app.kubernetes.io/name": "mcp-code-sandbox",
                "app.kubernetes.io/component": "server",
            }
        }
    }
    across = k8s.sandbox_network_policy(settings("defaults"), server_namespace="mcp-server")
    [peer] = across["spec"]["ingress"][0]["from"]
    assert peer["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "mcp-server"}
    }


def test_a_session_with_network_is_labelled_and_its_proxy_is_not_in_the_pod() -> None:
    s = settings("defaults")
    spec = session(egress=Egress(Path("/x")), env={"HTTPS_PROXY": "http://u:tok@10.0.0.5:3128"})
    pod = k8s.session_pod(spec, "pod-1", s)
    assert pod["metadata"]["labels"]["mcp-code-sandbox/network"] == "on"
    assert k8s.claim_metadata(spec)["labels"]["mcp-code-sandbox/network"] == "on"
    assert "tok@" not in json.dumps(pod)
    assert "mcp-code-sandbox/network" not in k8s.claim_metadata(session())["labels"]
    assert "mcp-code-sandbox/network" not in k8s.warm_pod("warm-1", s)["metadata"]["labels"]


def test_a_pod_with_network_may_reach_the_server_pods_egress_port_and_nothing_else() -> None:
    policy = k8s.sandbox_egress_policy(settings("defaults"))["spec"]
    assert policy["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": "mcp-code-sandbox",
        "app.kubernetes.io/component": "sandbox",
        "mcp-code-sandbox/network": "on",
    }
    assert policy["policyTypes"] == ["Egress"]  # ingress stays the base policy's
    [rule] = policy["egress"]
    assert rule == {
        "to": [
            {
                "podSelector": {
                    "matchLabels": {
                        "app.kubernetes.io/name": "mcp-code-sandbox",
                        "app.kubernetes.io/component": "server",
                    }
                }
            }
        ],
        "ports": [{"protocol": "TCP", "port": 3128}],
    }
    across = k8s.sandbox_egress_policy(settings("defaults"), server_namespace="mcp-server")
    [peer] = across["spec"]["egress"][0]["to"]
    assert peer["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "mcp-server"}
    }
