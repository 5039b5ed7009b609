"""A fake cluster for the kubernetes backend's tests: the fake API
(``tests/kube_api.py``), the fake kubelet running the real agent in each pod
(``tests/kubelet.py``), the sandboxes' namespace, the agents' CA and the servers'
certificate; and backends and sessions' specs made against it."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from lightkube import AsyncClient
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import ConfigMap, Namespace, PersistentVolumeClaim, Pod

from mcp_code_sandbox.backends.base import SandboxSpec
from mcp_code_sandbox.backends.kubernetes.backend import KubernetesBackend, Manifests
from mcp_code_sandbox.backends.kubernetes.certs import write_certs
from mcp_code_sandbox.backends.kubernetes.channel import open_channel, server_context
from mcp_code_sandbox.backends.kubernetes.spec import (
    AGENT_PORT,
    CA_CONFIGMAP,
    CA_KEY,
    limits_of,
    session_pod,
    warm_pod,
    workspace_claim,
)
from mcp_code_sandbox.settings import Settings, load_settings
from tests.kube_api import KubeApi
from tests.kubelet import Kubelet

__all__ = ["Cluster", "cluster"]


@dataclass
class Cluster:
    api: KubeApi
    kubelet: Kubelet
    kube: AsyncClient
    settings: Settings
    certs: Path

    def backend(
        self,
        *,
        pool_size: int,
        instance: str,
        idle_s: float = 3600,
        storage_class: str | None = None,
    ) -> KubernetesBackend:
        """A server's backend; ``storage_class``: every workspace a claim of that class
        (``SANDBOX_KUBERNETES_STORAGE_CLASS``; the fake kubelet keeps a directory per claim)."""
        files = self.certs
        settings = self.settings.model_copy(update={"kubernetes_storage_class": storage_class})
        keeps = storage_class is not None
        claim = functools.partial(workspace_claim, spec=None, settings=settings)
        manifests = Manifests(
            warm=functools.partial(warm_pod, settings=settings, own_claim=keeps),
            session=functools.partial(session_pod, settings=settings),
            agent_port=AGENT_PORT,
            claim=claim if keeps else None,
        )
        return KubernetesBackend(
            client=self.api.client(self.settings.kubernetes_namespace),
            namespace=self.settings.kubernetes_namespace,
            manifests=manifests,
            tls=server_context(files / "server.crt", files / "server.key"),
            open_channel=open_channel,
            pool_size=pool_size,
            instance=instance,
            idle_s=idle_s,
            lifetime_s=86400,
        )

    def spec(self, session_id: str, owner: str = "alice") -> SandboxSpec:
        return SandboxSpec(
            key=f"{owner}-{session_id}",
            owner=owner,
            session_id=session_id,
            workspace=Path("/nonexistent"),
            limits=limits_of(self.settings),
        )

    async def pods(self) -> list[Pod]:
        return [pod async for pod in self.kube.list(Pod)]

    async def claims(self) -> list[PersistentVolumeClaim]:
        return [claim async for claim in self.kube.list(PersistentVolumeClaim)]


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    files = write_certs(tmp_path / "certs")
    settings = load_settings({"preload": []}, environ={})
    namespace = settings.kubernetes_namespace
    async with (
        KubeApi() as api,
        Kubelet(api.url, namespace) as kubelet,
        api.client(namespace) as kube,
    ):
        await kube.create(Namespace(metadata=ObjectMeta(name=namespace)))
        ca = {CA_KEY: files.ca_cert.read_text()}
        await kube.create(ConfigMap(metadata=ObjectMeta(name=CA_CONFIGMAP), data=ca))
        yield Cluster(api, kubelet, kube, settings, tmp_path / "certs")
