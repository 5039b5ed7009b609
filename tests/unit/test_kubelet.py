"""The fake kubelet (tests/kubelet.py): a pod made through the fake API runs as a local
process on its own loopback address, is reported Running and Ready there, and ends with
its pod. The commands are stand-ins, so that these tests need no agent listening on TCP."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from lightkube import AsyncClient, codecs
from lightkube.models.core_v1 import (
    ConfigMapVolumeSource,
    Container,
    ContainerPort,
    EmptyDirVolumeSource,
    EnvVar,
    EnvVarSource,
    HostPathVolumeSource,
    ObjectFieldSelector,
    PodSpec,
    Volume,
    VolumeMount,
)
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import ConfigMap, Namespace, Pod

from mcp_code_sandbox.agent.protocol import FrameDecoder
from mcp_code_sandbox.backends.kubernetes.certs import write_certs
from mcp_code_sandbox.backends.kubernetes.channel import open_channel, server_context
from mcp_code_sandbox.backends.kubernetes.spec import AGENT_PORT, CA_CONFIGMAP, CA_KEY, warm_pod
from mcp_code_sandbox.settings import load_settings
from tests.kube_api import KubeApi, in_thread
from tests.kubelet import Kubelet
from tests.kubelet_pod import expand

#: Listens on the address in argv[1], port 7070, and copies the mounted config's file into
#: the workspace (both paths as the pod sees them), then waits to be killed.
LISTENER = """
import shutil, socket, sys, time
server = socket.create_server((sys.argv[1], 7070))
shutil.copy(sys.argv[2], sys.argv[3])
while True:
    time.sleep(60)
"""


@pytest.fixture
async def cluster() -> AsyncIterator[tuple[KubeApi, Kubelet, AsyncClient]]:
    async with KubeApi() as api, Kubelet(api.url) as kubelet, api.client() as kube:
        yield api, kubelet, kube


def a_pod(name: str, container: Container, volumes: list[Volume] | None = None) -> Pod:
    return Pod(
        metadata=ObjectMeta(name=name),
        spec=PodSpec(
            containers=[container],
            volumes=volumes,
            restartPolicy="Never",
            terminationGracePeriodSeconds=1,
        ),
    )


async def until(kube: AsyncClient, name: str, done: str) -> Pod:
    """The pod once ``done`` is true of it: "ready", or a phase."""
    async for _, pod in kube.watch(Pod, fields={"metadata.name": name}):
        status = pod.status
        assert status is not None
        ready = any(c.type == "Ready" and c.status == "True" for c in status.conditions or [])
        if (done == "ready" and ready) or status.phase == done:
            return pod
    raise AssertionError("the watch ended")


async def test_a_pod_runs_on_its_own_address_until_deleted(cluster) -> None:
    _, kubelet, kube = cluster
    await kube.create(ConfigMap(metadata=ObjectMeta(name="ca"), data={"ca.crt": "PEM"}))
    listener = Container(
        name="agent",
        image="mcp-code-sandbox",
        command=["/opt/sandbox/venv/bin/python", "-c", LISTENER],
        args=["$(POD_IP)", "/etc/mcp-code-sandbox/ca.crt", "/mnt/data/ca.copy"],
        env=[EnvVar(name="POD_IP", valueFrom=EnvVarSource(
            fieldRef=ObjectFieldSelector(fieldPath="status.podIP")))],
        ports=[ContainerPort(containerPort=7070, name="agent")],
        volumeMounts=[VolumeMount(name="workspace", mountPath="/mnt/data"),
                      VolumeMount(name="ca", mountPath="/etc/mcp-code-sandbox")],
    )  # fmt: skip
    volumes = [
        Volume(name="workspace", emptyDir=EmptyDirVolumeSource()),
        Volume(name="ca", configMap=ConfigMapVolumeSource(name="ca")),
    ]
    await kube.create(a_pod("sb-1", listener, volumes))

    ready = await until(kube, "sb-1", "ready")
    assert ready.status is not None and ready.status.phase == "Running"
    ip = ready.status.podIP
    assert ip is not None and ip != "127.0.0.1"
    assert ipaddress.ip_address(ip) in ipaddress.ip_network("127.0.0.0/8")
    socket.create_connection((ip, 7070), timeout=10).close()
    running = kubelet.pods["sb-1"]
    assert (running.workspace / "ca.copy").read_text() == "PEM"

    await kube.delete(Pod, "sb-1")
    assert running.proc is not None
    assert await running.proc.wait() != 0  # killed
    # The pod's pid 1 goes a moment after the unshare that waited for it: bounded wait
    # until nothing listens there any more.
    async with asyncio.timeout(30):
        while True:
            try:
                socket.create_connection((ip, 7070), timeout=10).close()
            except ConnectionRefusedError:
                break
            await asyncio.sleep(0.05)


async def test_a_process_that_exits_fails_its_pod(cluster) -> None:
    _, _, kube = cluster
    crash = Container(name="agent", image="x", command=["python", "-c", "raise SystemExit(3)"])
    await kube.create(a_pod("sb-2", crash))
    failed = await until(kube, "sb-2", "Failed")
    assert failed.status is not None and failed.status.containerStatuses is not None
    terminated = failed.status.containerStatuses[0].state
    assert terminated is not None and terminated.terminated is not None
    assert terminated.terminated.exitCode == 3


async def test_without_a_command_the_image_runs_the_agent(cluster) -> None:
    _, kubelet, kube = cluster
    await kube.create(a_pod("sb-3", Container(name="agent", image="x", args=["--help"])))
    await until(kube, "sb-3", "Succeeded")
    log = kubelet.pods["sb-3"].log
    assert "usage: mcs_agent" in log


async def test_the_image_entrypoint_runs_the_real_agent(cluster, tmp_path) -> None:
    """The agent of src/ starts under the image's entrypoint as pid 1 and says ready (over
    ``--connect``, to a socket of the test's mounted into the pod by hostPath)."""
    _, _, kube = cluster
    ready: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()

    async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        decoder = FrameDecoder()
        while not ready.done() and (data := await reader.read(65536)):
            for message in decoder.feed(data):
                if message.get("ev") == "ready" and not ready.done():
                    ready.set_result(message)
        writer.close()

    server = await asyncio.start_unix_server(accepted, tmp_path / "agent.sock")
    agent = Container(
        name="agent", image="mcp-code-sandbox",
        args=["--connect", "/run/host/agent.sock", "--config", "{}", "--plain"],
        volumeMounts=[VolumeMount(name="host", mountPath="/run/host")],
    )  # fmt: skip
    volume = Volume(name="host", hostPath=HostPathVolumeSource(path=str(tmp_path)))
    async with server:
        await kube.create(a_pod("sb-4", agent, [volume]))
        async with asyncio.timeout(60):
            message = await ready
    assert "python" in message["languages"]


async def test_the_sandbox_pod_of_spec_serves_the_servers_channel(tmp_path) -> None:
    """The pod the backend asks for (``spec.warm_pod``) runs the real agent listening on
    its pod's address, which the server's channel reaches over TLS."""
    files = write_certs(tmp_path / "certs")
    settings = load_settings({"preload": []}, environ={})
    namespace = settings.kubernetes_namespace
    async with (
        KubeApi() as api,
        Kubelet(api.url, namespace),
        api.client(namespace) as kube,
    ):
        await kube.create(Namespace(metadata=ObjectMeta(name=namespace)))
        ca = {CA_KEY: files.ca_cert.read_text()}
        await kube.create(ConfigMap(metadata=ObjectMeta(name=CA_CONFIGMAP), data=ca))
        await kube.create(codecs.from_dict(warm_pod("warm-1", settings)))
        ready = await until(kube, "warm-1", "ready")
        assert ready.status is not None and ready.status.podIP is not None
        tls = server_context(files.server_cert, files.server_key)
        channel = await open_channel(ready.status.podIP, AGENT_PORT, tls, 60)
        try:
            hello = await channel.receive()
        finally:
            channel.close()
    assert hello is not None and hello["ev"] == "ready"


def test_runs_beside_a_synchronous_test_from_its_own_thread() -> None:
    pod = {
        "metadata": {"name": "sb-5"},
        "spec": {"restartPolicy": "Never", "containers": [
            {"name": "agent", "image": "x", "command": ["python", "-c", "print('hi')"]},
        ]},
    }  # fmt: skip
    with in_thread(KubeApi()) as api, in_thread(Kubelet(api.url)) as kubelet:
        pods = f"{api.url}/api/v1/namespaces/default/pods"
        assert httpx.post(pods, json=pod).status_code == 201
        with httpx.Client() as http:
            phase = ""
            for _ in range(600):  # a bound, not a timing: the loop ends when it succeeds
                phase = http.get(f"{pods}/sb-5").json()["status"]["phase"]
                if phase == "Succeeded":
                    break
                time.sleep(0.05)
        assert phase == "Succeeded"
        assert kubelet.pods["sb-5"].log == "hi\n"


def test_expand_follows_kubernetes() -> None:
    env = {"POD_IP": "127.0.0.9"}
    assert expand("$(POD_IP):7070", env) == "127.0.0.9:7070"
    assert expand("$$(POD_IP) $(UNSET)", env) == "$(POD_IP) $(UNSET)"
