"""The kubernetes backend's pure half: the objects it asks the API server for, as dicts.

:func:`warm_pod` and :func:`session_pod` build a sandbox pod's manifest (from the same
sandbox image as the docker backend), :func:`workspace_claim` the volume a session's
workspace is kept on through pauses (with a StorageClass), :func:`sandbox_network_policy`
the policy that walls every sandbox pod in, and :func:`sandbox_egress_policy` the one
door a pod with network gets: the server pods' egress gate. Nothing here talks to a
cluster or imports its client, so all of it is unit-tested against the Kubernetes
schemas without one (STYLE.md rule 4), and ``deploy/kubernetes/`` holds the same policy
as YAML.

Hardening of every sandbox pod, each the pod's own (none needs a cluster policy):
non-root uid (the session's own when it has one), read-only root, every capability
dropped, no privilege escalation, a seccomp profile, no service account token, no
service links in its environment, CPU/memory/ephemeral-storage requests equal to limits,
``/tmp`` and the workspace size-limited ``emptyDir`` volumes, the agent listening only
on its pod's address, and (the policy) ingress only from the server's pods on the agent
port and no egress at all, but to the server pods' egress gate for a pod labelled with
network (:data:`LABEL_NETWORK`), whose proxy decides every host.

The agent holds no secret: it proves nothing to the server, the server proves itself to
it with a certificate the agent checks against the CA certificate mounted from a
ConfigMap (public). Semantics of the env: a pod carries only the sandbox's base env
(``layout.sandbox_env``); a session's own (``SandboxSpec.env``, which may hold values
passed through from the server) is never written into a pod, where anyone allowed to
read pods would see it: the backend hands it to the agent over the channel.
"""

from __future__ import annotations

import re
from typing import Any

from mcp_code_sandbox.backends.base import Limits, SandboxSpec
from mcp_code_sandbox.layout import (
    AGENT_LIB_DIR,
    SANDBOX_UID,
    WORKSPACE_DIR,
    agent_argv,
    sandbox_env,
)
from mcp_code_sandbox.settings import Settings

__all__ = [
    "AGENT_PORT",
    "AGENT_PORT_NAME",
    "ANNOTATION_ACTIVE",
    "ANNOTATION_CREATED",
    "ANNOTATION_OWNER",
    "ANNOTATION_PAUSED",
    "ANNOTATION_SESSION",
    "CA_CONFIGMAP",
    "CA_DIR",
    "CA_KEY",
    "CA_PATH",
    "CLAIMED",
    "COMPONENT_SANDBOX",
    "COMPONENT_SERVER",
    "COMPONENT_WORKSPACE",
    "CONTAINER",
    "EGRESS_PORT",
    "EGRESS_PORT_NAME",
    "LABEL_COMPONENT",
    "LABEL_KEY",
    "LABEL_NAME",
    "LABEL_NETWORK",
    "LABEL_POOL",
    "NAME",
    "NETWORK_ON",
    "WARM",
    "claim_metadata",
    "limits_of",
    "pod_labels",
    "sandbox_egress_policy",
    "sandbox_network_policy",
    "session_pod",
    "warm_pod",
    "workspace_claim",
]

NAME = "mcp-code-sandbox"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_COMPONENT = "app.kubernetes.io/component"
#: ``warm`` (anonymous, in the pool) or ``claimed`` (a session's).
LABEL_POOL = "mcp-code-sandbox/pool"
#: The session's key (``SandboxSpec.key``), on claimed pods and workspace claims only.
LABEL_KEY = "mcp-code-sandbox/session-key"
#: ``on`` on a claimed pod whose session has network: the pods
#: :func:`sandbox_egress_policy` lets reach the server pods' egress gate (and nothing
#: else). Only a server writes it; what a pod may reach through the gate is its proxy's.
LABEL_NETWORK = "mcp-code-sandbox/network"
NETWORK_ON = "on"
ANNOTATION_OWNER = "mcp-code-sandbox/owner"
ANNOTATION_SESSION = "mcp-code-sandbox/session-id"
#: Wall-clock seconds: when the session was made, and when a server last noted it active
#: (the session's registry entry for its lifetime and idle TTL, read by every replica).
ANNOTATION_CREATED = "mcp-code-sandbox/created"
ANNOTATION_ACTIVE = "mcp-code-sandbox/active"
#: On a session's workspace claim while no pod runs on it: how the session was paused
#: (JSON, written by the server that paused it).
ANNOTATION_PAUSED = "mcp-code-sandbox/paused"
COMPONENT_SANDBOX = "sandbox"
#: The server's pods (deploy/kubernetes/): the only ones the agents accept traffic from.
COMPONENT_SERVER = "server"
COMPONENT_WORKSPACE = "workspace"
WARM = "warm"
CLAIMED = "claimed"

AGENT_PORT = 7070
AGENT_PORT_NAME = "agent"
#: The server pods' egress gate (``egress.gate``): one port for all of a server's
#: proxies, each sandbox with a credential of its own. The usual HTTP proxy port.
EGRESS_PORT = 3128
EGRESS_PORT_NAME = "egress"
#: The CA certificate's ConfigMap (``mcp-code-sandbox kubernetes certs`` writes it) and
#: where sandbox pods see it.
CA_CONFIGMAP = "mcp-code-sandbox-agent-ca"
CA_KEY = "ca.crt"
CA_DIR = "/etc/mcp-code-sandbox"
CA_PATH = f"{CA_DIR}/{CA_KEY}"
CONTAINER = "sandbox"

#: Seconds between SIGTERM and SIGKILL when a pod is deleted: a sandbox keeps nothing a
#: clean exit would save (a paused session's files are on its claim already), so a
#: deleted session's pod should free its node at once; not 0, which the API server
#: treats as a force delete.
_GRACE_S = 1
#: Disk the container may use besides its volumes: the agent's log (its stderr, which
#: user code can write to through /proc) as the kubelet keeps it, and the writable
#: layer, empty under a read-only root. Past it the kubelet evicts the pod.
_LOG_ALLOWANCE_BYTES = 64 * 1024**2
#: Label values: 63 characters at most, alphanumeric at both ends.
_LABEL_VALUE = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]")


def limits_of(settings: Settings) -> Limits:
    """A sandbox's limits by the settings: every pod, warm or a session's, has these."""
    return Limits(
        memory_bytes=settings.memory_limit,
        cpu=settings.cpu_limit,
        pids=settings.pids_limit,
        tmp_bytes=settings.tmp_size,
        file_bytes=settings.workspace_quota_bytes,
    )


def pod_labels(key: str | None) -> dict[str, str]:
    """A sandbox pod's labels: warm when ``key`` is None, else claimed by that session."""
    labels = {LABEL_NAME: NAME, LABEL_COMPONENT: COMPONENT_SANDBOX}
    if key is None:
        return {**labels, LABEL_POOL: WARM}
    if not _LABEL_VALUE.fullmatch(key):
        raise ValueError(f"session key {key!r} is not a label value")
    return {**labels, LABEL_POOL: CLAIMED, LABEL_KEY: key}


def claim_metadata(spec: SandboxSpec) -> dict[str, dict[str, str]]:
    """The labels and annotations that make a pod ``spec``'s session's: what a claim
    writes over a warm pod's (its ``metadata``, in a merge patch), and what a pod made
    for the session has from the start. Annotations carry who and which session, never
    a secret (anyone who may list pods reads them). A session with network
    (``spec.egress``) has :data:`LABEL_NETWORK` too."""
    labels = pod_labels(spec.key)
    if spec.egress is not None:
        labels[LABEL_NETWORK] = NETWORK_ON
    return {
        "labels": labels,
        "annotations": {ANNOTATION_OWNER: spec.owner, ANNOTATION_SESSION: spec.session_id},
    }


def warm_pod(name: str, settings: Settings, *, own_claim: bool = False) -> dict[str, Any]:
    """An anonymous pod for the warm pool: the image's sandbox uid, an ``emptyDir``
    workspace (``own_claim``: the claim of the same name, :func:`workspace_claim`), the
    settings' preload; no session's name, owner or env in it."""
    metadata = {"labels": pod_labels(None)}
    claim = name if own_claim else None
    return _pod(
        name, settings, metadata, uid=SANDBOX_UID, preload=tuple(settings.preload), claim=claim
    )


def session_pod(
    spec: SandboxSpec,
    name: str,
    settings: Settings,
    *,
    workspace_claim: str | None = None,
) -> dict[str, Any]:
    """A pod made for ``spec``'s session: its uid (``spec.uid``, else the image's), its
    labels and annotations. ``workspace_claim``: the PersistentVolumeClaim (see
    :func:`workspace_claim`) holding the workspace, for a paused session that comes back;
    None: an ``emptyDir`` of the quota's size.

    ``spec.egress`` adds :data:`LABEL_NETWORK` only: the pod's one way out is then the
    server pods' egress gate (:func:`sandbox_egress_policy`), its proxy's address and
    credential come with each run's env, never in the pod; ``spec.workspace`` is a host
    path that no pod sees."""
    return _pod(
        name,
        settings,
        claim_metadata(spec),
        uid=SANDBOX_UID if spec.uid is None else spec.uid,
        preload=spec.preload,
        claim=workspace_claim,
        limits=spec.limits,
    )


def _pod(
    name: str,
    settings: Settings,
    metadata: dict[str, Any],
    *,
    uid: int,
    preload: tuple[str, ...],
    claim: str | None,
    limits: Limits | None = None,
) -> dict[str, Any]:
    limits = limits or limits_of(settings)
    spec: dict[str, Any] = {
        # The agent talks to the server over the pod network only; the API server is
        # nothing a sandbox may reach, with or without a token.
        "automountServiceAccountToken": False,
        # No *_SERVICE_HOST variables: they would tell user code what runs beside it.
        "enableServiceLinks": False,
        # A dead agent is a dead sandbox: the backend makes a new one (state is gone).
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": _GRACE_S,
        "hostname": "sandbox",
        # The agent is pid 1 of its own pid namespace, which its kill_strays relies on.
        "shareProcessNamespace": False,
        "securityContext": _pod_security(settings, uid, with_claim=claim is not None),
        "containers": [_container(settings, limits, preload, with_claim=claim is not None)],
        "volumes": _volumes(limits, settings, claim),
    }
    if settings.kubernetes_runtime_class is not None:
        spec["runtimeClassName"] = settings.kubernetes_runtime_class
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": settings.kubernetes_namespace, **metadata},
        "spec": spec,
    }


def _pod_security(settings: Settings, uid: int, *, with_claim: bool) -> dict[str, Any]:
    """The pod's securityContext. ``fsGroup`` only with a claim: an ``emptyDir`` is
    world-writable already, and a volume's files must belong to the session's uid."""
    if settings.kubernetes_seccomp_profile is None:
        seccomp: dict[str, str] = {"type": "RuntimeDefault"}
    else:
        seccomp = {"type": "Localhost", "localhostProfile": settings.kubernetes_seccomp_profile}
    context: dict[str, Any] = {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "seccompProfile": seccomp,
    }
    if with_claim:
        context["fsGroup"] = uid
        context["fsGroupChangePolicy"] = "OnRootMismatch"
    return context


def _container(
    settings: Settings, limits: Limits, preload: tuple[str, ...], *, with_claim: bool
) -> dict[str, Any]:
    command = agent_argv(
        limits,
        rlimit_memory=False,  # the container's memory limit is the cgroup's
        # RLIMIT_NPROC counts a uid's processes on the whole node, across pods of the
        # same uid: the pod's pids limit (the kubelet's) is the per-sandbox one.
        rlimit_pids=False,
        # $(POD_IP): the kubelet substitutes the env variable below into the argv.
        channel=("--listen", f"$(POD_IP):{AGENT_PORT}", "--ca", CA_PATH),
        preload=preload,
    )
    env: list[dict[str, Any]] = [
        {"name": key, "value": value} for key, value in sandbox_env({}).items()
    ]
    env.append({"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    resources = _resources(limits, settings, with_claim=with_claim)
    return {
        "name": CONTAINER,
        "image": settings.image,
        "imagePullPolicy": "IfNotPresent",
        # The whole argv, entrypoint included: an image's own wrapper must not stand
        # between the kubelet and the agent.
        "command": command,
        # Not WORKSPACE_DIR: a workspace file named like the agent's module would
        # replace it on sys.path (see backends/docker/spec.py).
        "workingDir": AGENT_LIB_DIR,
        "env": env,
        "ports": [{"name": AGENT_PORT_NAME, "containerPort": AGENT_PORT, "protocol": "TCP"}],
        # Ready once the agent listens; the server's own handshake is what it trusts.
        "readinessProbe": {
            "tcpSocket": {"port": AGENT_PORT_NAME},
            "periodSeconds": 2,
            "failureThreshold": 3,
        },
        "resources": {"requests": resources, "limits": dict(resources)},
        "securityContext": {
            "runAsNonRoot": True,
            "privileged": False,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "tmp", "mountPath": "/tmp"},  # noqa: S108 - the sandbox's own tmpfs
            {"name": "workspace", "mountPath": WORKSPACE_DIR},
            {"name": "agent-ca", "mountPath": CA_DIR, "readOnly": True},
        ],
        "stdin": False,
        "tty": False,
    }


def _resources(limits: Limits, settings: Settings, *, with_claim: bool) -> dict[str, str]:
    """Requests equal to limits (the Guaranteed class): a sandbox gets what it was
    promised and is the last a node evicts. Memory holds ``/tmp`` too (a memory-backed
    volume is charged to the pod), as a tmpfs is in a docker sandbox's cgroup."""
    disk = _LOG_ALLOWANCE_BYTES + (0 if with_claim else settings.workspace_quota_bytes)
    return {
        "cpu": f"{round(limits.cpu * 1000)}m",
        "memory": str(limits.memory_bytes),
        "ephemeral-storage": str(disk),
    }


def _volumes(limits: Limits, settings: Settings, claim: str | None) -> list[dict[str, Any]]:
    if claim is None:
        workspace: dict[str, Any] = {"emptyDir": {"sizeLimit": str(settings.workspace_quota_bytes)}}
    else:
        workspace = {"persistentVolumeClaim": {"claimName": claim}}
    return [
        {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": str(limits.tmp_bytes)}},
        {"name": "workspace", **workspace},
        {
            "name": "agent-ca",
            "configMap": {
                "name": CA_CONFIGMAP,
                "items": [{"key": CA_KEY, "path": CA_KEY}],
                "defaultMode": 0o444,
            },
        },
    ]


def workspace_claim(name: str, spec: SandboxSpec | None, settings: Settings) -> dict[str, Any]:
    """The PersistentVolumeClaim a session's workspace is kept on, through pauses: the
    quota's size, of ``SANDBOX_KUBERNETES_STORAGE_CLASS`` (``ValueError`` when unset:
    without a class nothing is paused), one node at a time. ``spec`` None: an anonymous
    one, for a warm pod (the session's labels reach it when its pod first stops)."""
    storage_class = settings.kubernetes_storage_class
    if storage_class is None:
        raise ValueError("no StorageClass is set: sessions on Kubernetes are not paused")
    if spec is None:
        metadata: dict[str, dict[str, str]] = {"labels": {LABEL_NAME: NAME}, "annotations": {}}
    else:
        metadata = claim_metadata(spec)
    labels = {**metadata["labels"], LABEL_COMPONENT: COMPONENT_WORKSPACE}
    labels.pop(LABEL_POOL, None)
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": name,
            "namespace": settings.kubernetes_namespace,
            "labels": labels,
            "annotations": metadata["annotations"],
        },
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": storage_class,
            "resources": {"requests": {"storage": str(settings.workspace_quota_bytes)}},
        },
    }


def _server_peer(settings: Settings, server_namespace: str | None) -> dict[str, Any]:
    """The server's pods, as a NetworkPolicy peer."""
    server: dict[str, Any] = {
        "podSelector": {"matchLabels": {LABEL_NAME: NAME, LABEL_COMPONENT: COMPONENT_SERVER}}
    }
    if server_namespace is not None and server_namespace != settings.kubernetes_namespace:
        server["namespaceSelector"] = {
            "matchLabels": {"kubernetes.io/metadata.name": server_namespace}
        }
    return server


def sandbox_network_policy(
    settings: Settings, server_namespace: str | None = None
) -> dict[str, Any]:
    """The NetworkPolicy of every sandbox pod: ingress only from the server's pods, on
    the agent port; no egress at all (not even DNS). ``server_namespace``: where the
    server's pods are, when not in the sandboxes' namespace (None: the same one).
    ``deploy/kubernetes/`` holds this policy as YAML, for the default settings."""
    server = _server_peer(settings, server_namespace)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": f"{NAME}-sandbox",
            "namespace": settings.kubernetes_namespace,
            "labels": {LABEL_NAME: NAME, LABEL_COMPONENT: COMPONENT_SANDBOX},
        },
        "spec": {
            "podSelector": {"matchLabels": {LABEL_NAME: NAME, LABEL_COMPONENT: COMPONENT_SANDBOX}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [server], "ports": [{"protocol": "TCP", "port": AGENT_PORT}]}],
            "egress": [],
        },
    }


def sandbox_egress_policy(
    settings: Settings, server_namespace: str | None = None
) -> dict[str, Any]:
    """The NetworkPolicy that adds (policies add up) one way out for the sandbox pods
    labelled with network: TCP to the server pods' egress gate, nothing else (no DNS: the
    proxy resolves). ``deploy/kubernetes/components/network`` holds it as YAML."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": f"{NAME}-sandbox-network",
            "namespace": settings.kubernetes_namespace,
            "labels": {LABEL_NAME: NAME, LABEL_COMPONENT: COMPONENT_SANDBOX},
        },
        "spec": {
            "podSelector": {
                "matchLabels": {
                    LABEL_NAME: NAME,
                    LABEL_COMPONENT: COMPONENT_SANDBOX,
                    LABEL_NETWORK: NETWORK_ON,
                }
            },
            "policyTypes": ["Egress"],
            "egress": [
                {
                    "to": [_server_peer(settings, server_namespace)],
                    "ports": [{"protocol": "TCP", "port": EGRESS_PORT}],
                }
            ],
        },
    }
