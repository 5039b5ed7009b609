"""``test_kubernetes.py``'s checks against a REAL cluster: the server runs here (a
subprocess, ``SANDBOX_BACKEND=kubernetes``) and makes its sandbox pods in the cluster that
KUBECONFIG names. Skipped unless ``SANDBOX_K8S_E2E=1``::

    mcp-code-sandbox kubernetes certs --out ./agent-tls
    kubectl create namespace sandboxes-e2e
    kubectl -n sandboxes-e2e create configmap mcp-code-sandbox-agent-ca \\
        --from-file=ca.crt=./agent-tls/ca.crt
    SANDBOX_K8S_E2E=1 KUBECONFIG=~/.kube/config \\
    SANDBOX_KUBERNETES_NAMESPACE=sandboxes-e2e \\
    SANDBOX_KUBERNETES_AGENT_TLS_DIR=./agent-tls \\
    SANDBOX_IMAGE=registry.example/mcp-code-sandbox:latest \\
        .venv/bin/python -m pytest tests/e2e/test_kubernetes_cluster.py

The namespace and its CA ConfigMap are the operator's (``deploy/kubernetes/`` makes
both); use a namespace no other server uses, since the warm pool is the namespace's.
Every other ``SANDBOX_KUBERNETES_*`` variable is passed to the server too. This machine
must reach pod IPs on port 7070, as the server must (a node, a kind cluster on this host,
or a routed pod network); the plain TCP check connects there itself. Sessions are
closed when the server stops; warm pods stay, for the next run."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from mcp import Client

from mcp_code_sandbox.backends.kubernetes.spec import CA_CONFIGMAP, CA_KEY

from .conftest import held
from .kube_harness import (
    KubectlPods,
    Server,
    check_a_lost_pod_loses_state_not_the_session,
    check_close_deletes_the_pod,
    check_plain_tcp_gets_no_frame,
    check_runs_files_and_variables,
    check_sessions_are_their_owners,
    check_the_pool_refills,
    scratch_dir,
)
from .tenants import client_as

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

ENABLED = os.environ.get("SANDBOX_K8S_E2E") == "1"
#: What the suite needs beside SANDBOX_K8S_E2E=1 (the server's own settings' names).
NEEDED = ("KUBECONFIG", "SANDBOX_KUBERNETES_NAMESPACE", "SANDBOX_KUBERNETES_AGENT_TLS_DIR")
#: Warm pods the server keeps (SANDBOX_POOL_SIZE overrides): few, on a shared cluster.
POOL_SIZE = os.environ.get("SANDBOX_POOL_SIZE", "2")
#: This run's owners: tokens' names of their own, so pods of an earlier run that was
#: cut short are never taken for this one's.
RUN = secrets.token_hex(4)
ALICE_NAME, BOB_NAME = f"e2e-alice-{RUN}", f"e2e-bob-{RUN}"
ALICE, BOB = secrets.token_hex(16), secrets.token_hex(16)

if not ENABLED:
    pytestmark.append(
        pytest.mark.skip(
            reason="a real cluster: set SANDBOX_K8S_E2E=1, KUBECONFIG, "
            "SANDBOX_KUBERNETES_NAMESPACE, SANDBOX_KUBERNETES_AGENT_TLS_DIR (and "
            "SANDBOX_IMAGE unless the nodes have mcp-code-sandbox:latest); see this "
            "file's docstring"
        )
    )


@pytest.fixture(scope="module")
def pods() -> KubectlPods:
    missing = [name for name in NEEDED if not os.environ.get(name)]
    if missing:
        pytest.fail(f"SANDBOX_K8S_E2E=1 but {', '.join(missing)} not set", pytrace=False)
    made = KubectlPods(os.environ["SANDBOX_KUBERNETES_NAMESPACE"])
    ca = json.loads(made.kubectl("get", "configmap", CA_CONFIGMAP, "-o", "json"))["data"][CA_KEY]
    mine = (Path(os.environ["SANDBOX_KUBERNETES_AGENT_TLS_DIR"]) / "ca.crt").read_text()
    if ca.strip() != mine.strip():
        pytest.fail(
            f"ConfigMap {CA_CONFIGMAP} in {made.namespace} is not the CA of "
            "SANDBOX_KUBERNETES_AGENT_TLS_DIR: the agents would refuse this server",
            pytrace=False,
        )
    return made


@pytest.fixture(scope="module")
def server(pods: KubectlPods) -> Iterator[Server]:
    passed = {
        name: value
        for name, value in os.environ.items()
        if name.startswith("SANDBOX_KUBERNETES_") or name in ("KUBECONFIG", "SANDBOX_IMAGE")
    }
    env = {
        **passed,
        "SANDBOX_API_TOKENS": f"{ALICE_NAME}:{ALICE},{BOB_NAME}:{BOB}",
        "SANDBOX_POOL_SIZE": POOL_SIZE,
        # Room for every session the module's tests open on this one server.
        "SANDBOX_MAX_SESSIONS": "20",
    }
    with scratch_dir() as state, Server(state, "server", env) as started:
        yield started


@pytest.fixture
async def alice(server: Server) -> AsyncIterator[Client]:
    async with held(lambda: client_as(server.base, ALICE)) as client:
        yield client


async def test_code_variables_and_the_workspace_in_the_pod(alice: Client) -> None:
    await check_runs_files_and_variables(alice)


async def test_closing_a_session_deletes_its_pod(alice: Client, pods: KubectlPods) -> None:
    await check_close_deletes_the_pod(alice, pods, ALICE_NAME)


async def test_a_pod_deleted_behind_the_servers_back_is_state_lost(
    alice: Client, pods: KubectlPods
) -> None:
    await check_a_lost_pod_loses_state_not_the_session(alice, pods, ALICE_NAME)


async def test_a_plain_tcp_peer_gets_nothing_from_an_agent(
    alice: Client, pods: KubectlPods
) -> None:
    await check_plain_tcp_gets_no_frame(alice, pods, ALICE_NAME)


async def test_an_owner_sees_only_their_sessions(alice: Client, server: Server) -> None:
    async with client_as(server.base, BOB) as bob:
        await check_sessions_are_their_owners(alice, bob)


async def test_the_warm_pool_refills_after_claims(alice: Client, pods: KubectlPods) -> None:
    await check_the_pool_refills(alice, pods, int(POOL_SIZE), ALICE_NAME)
