"""The kubernetes backend: a pod per session, claimed from a warm pool that every replica
shares, its agent reached over the pod network.

A session's sandbox is a pod made from the sandbox image (the manifest is
:mod:`.spec`'s). ``create`` claims a ready warm pod (:class:`.pool.PodPool`: one
conditional update) or, when the pool is empty, creates one for the session and waits
for it to run (a watch event, never a poll); then it opens the agent's authenticated
channel on the pod's IP (:mod:`.channel`) and waits for ``ready``. ``stop`` deletes the
pod. The agent listens in its pod and keeps its state across connections, so another
replica (or this one after a restart) reaches the same session by connecting again:
``reattach`` is a connect. A pod deleted behind the server's back ends its agent's
connection; the session's next call then finds the sandbox dead and replaces it
(``state_lost``), never hangs (the socket has keepalives, and the view sees the pod go).

What this backend does not see: a pod's files. Its workspace is an ``emptyDir`` (or a
PVC) inside the pod, reached through the agent (``workspace_in_sandbox``). With a
StorageClass it is a claim of the pod's own, which outlives the pod and records the
session while it is paused (``keeps_workspaces``: :mod:`.workspaces`): ``stop`` keeps
it, ``create`` for a paused session's key starts a pod on it (cold), ``forget`` deletes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from lightkube import ApiError, AsyncClient, ConfigError, KubeConfig
from lightkube.resources.core_v1 import Pod
from lightkube.types import PatchType

from mcp_code_sandbox.backends.base import (
    Backend,
    Channel,
    Description,
    Leftover,
    Sandbox,
    SandboxSpec,
    stop_step,
    wait_ready,
)
from mcp_code_sandbox.backends.egress_gate import GatedEgress
from mcp_code_sandbox.backends.kubernetes.channel import open_channel, server_context
from mcp_code_sandbox.backends.kubernetes.pods import ClaimView, PodView, PodWatch, pod_of
from mcp_code_sandbox.backends.kubernetes.pool import PodPool, warm_pod_name
from mcp_code_sandbox.backends.kubernetes.spec import (
    AGENT_PORT,
    ANNOTATION_ACTIVE,
    ANNOTATION_CREATED,
    CLAIMED,
    EGRESS_PORT,
    LABEL_NETWORK,
    NETWORK_ON,
    claim_metadata,
    session_pod,
    warm_pod,
    workspace_claim,
)
from mcp_code_sandbox.backends.kubernetes.workspaces import KeptWorkspaces
from mcp_code_sandbox.backends.own_pool import OwnPool, PoolCounts
from mcp_code_sandbox.backends.shared import SharedSandboxes
from mcp_code_sandbox.errors import BackendUnavailable, SandboxFailed
from mcp_code_sandbox.settings import ConfigError as SettingsError
from mcp_code_sandbox.settings import Settings

__all__ = ["KubernetesBackend", "Manifests", "PodSandbox", "from_settings"]

log = logging.getLogger(__name__)

#: How long a cold pod may take to run and pass its readiness probe: an image pull on a
#: node that has none of it yet is most of it.
_START_WAIT_S = 120.0
#: How long the agent has to say ``ready`` once connected (it is already listening).
_READY_WAIT_S = 15.0
#: Between two writes of a session pod's activity annotation: the reaper of idle pods
#: that no server holds judges by it, in minutes at least (``SANDBOX_SESSION_TTL_M``), so
#: a write a minute keeps it right within one and costs the API server little.
_ACTIVE_EVERY_S = 60.0
#: How long a connect and its TLS handshake may take on the pod network.
_CONNECT_WAIT_S = 10.0


OpenChannel = Callable[[str, int, ssl.SSLContext, float], Awaitable[Channel]]


class Manifests:
    """The pod manifests this backend sends (see :mod:`.spec`), and the agent's port."""

    def __init__(
        self,
        warm: Callable[[str], dict[str, Any]],
        session: Callable[..., dict[str, Any]],
        agent_port: int,
        claim: Callable[[str], dict[str, Any]] | None = None,
    ) -> None:
        #: A warm pod's (on the claim of its name when ``claim`` is set).
        self.warm = warm
        #: ``session(spec, name, workspace_claim=None)``: a pod made for a session.
        self.session = session
        self.agent_port = agent_port
        #: An anonymous workspace claim; ``None``: no StorageClass, no claims.
        self.claim = claim


class PodChannel(Channel):
    """The channel to a pod's agent, which dials the agent again when the agent let it go
    (another server connected since: the agent serves the newest, once idle) before it
    sends a request. A request never goes down a connection the agent closed."""

    def __init__(self, link: Channel, dial: Callable[[], Awaitable[Channel]]) -> None:
        # Not Channel.__init__: every method goes to ``link``, the connection now.
        self._link = link
        self._dial = dial

    def at_eof(self) -> bool:
        return self._link.at_eof()

    async def send(self, message: Mapping[str, Any]) -> None:
        if self._link.at_eof():
            link = await self._dial()
            await link.receive()  # its ready (reattached): the session goes on as it was
            self._link = link
        await self._link.send(message)

    async def receive(self) -> dict[str, Any] | None:
        return await self._link.receive()

    def close(self) -> None:
        self._link.close()


class PodSandbox(Sandbox):
    """A session's pod, as the backend hands it out."""

    def __init__(
        self,
        spec: SandboxSpec,
        channel: Channel,
        pod: str,
        watch: PodWatch,
        claim: str | None = None,
    ) -> None:
        super().__init__(spec, channel, pod)
        self._watch = watch
        #: The claim its workspace is on (``None``: an ``emptyDir``).
        self.claim = claim
        #: When this server last wrote the pod's activity annotation (``time.time()``).
        self.noted_active = 0.0

    def is_alive(self) -> bool:
        view = self._watch.get(self.backend_id)
        return view is not None and not view.gone


class KubernetesBackend(Backend, SharedSandboxes, GatedEgress, OwnPool):
    """Sandboxes as pods in one namespace (see the module doc)."""

    name = "kubernetes"
    workspace_in_sandbox = True
    #: The session manager then mounts no filesystem per session on this server: a
    #: session's files are the pod's, bound by its volume's size limit.
    workspace_mounts_unseen = "a session's files live in its pod, not on this server"

    def __init__(
        self,
        *,
        client: AsyncClient,
        namespace: str,
        manifests: Manifests,
        tls: ssl.SSLContext,
        open_channel: OpenChannel,
        pool_size: int,
        instance: str,
        idle_s: float,
        lifetime_s: float,
        egress_gate: tuple[str, int] | None = None,
    ) -> None:
        """``egress_gate``: this server pod's address and the egress port, where its
        sandboxes with network reach their proxies (None: network is not offered)."""
        self.egress_gate = egress_gate
        self._client = client
        self._namespace = namespace
        self._manifests = manifests
        self._tls = tls
        self._open_channel = open_channel
        self.watch = PodWatch(client, namespace)
        self.workspaces = (
            None if manifests.claim is None else KeptWorkspaces(client, namespace, manifests.claim)
        )
        self.keeps_workspaces = self.workspaces is not None
        self.pool = PodPool(
            client,
            namespace,
            self.watch,
            manifests.warm,
            make_claim=manifests.claim,
            claims=None if self.workspaces is None else self.workspaces.watch,
            size=pool_size,
            instance=instance,
            idle_s=idle_s,
            lifetime_s=lifetime_s,
        )
        self._started: asyncio.Task[None] | None = None

    async def _start(self) -> None:
        """Start the view and the pool once; raise ``BackendUnavailable`` when the API
        server does not answer (and try again at the next call)."""
        if self._started is None or (self._started.done() and self._started.exception()):
            self._started = asyncio.ensure_future(self._begin())
        try:
            await asyncio.shield(self._started)
        except ApiError as exc:
            raise BackendUnavailable(f"the Kubernetes API refused: {exc.status.message}") from None
        except OSError as exc:
            raise BackendUnavailable(f"the Kubernetes API does not answer: {exc}") from None

    async def _begin(self) -> None:
        await self.watch.start()
        if self.workspaces is not None:
            await self.workspaces.start()
        self.pool.start()

    async def create(self, spec: SandboxSpec, *, mounted: Awaitable[None] | None = None) -> Sandbox:
        if mounted is not None:
            await mounted  # nothing is mounted for a pod: its workspace lives in it
        await self._start()
        try:
            kept = self.workspaces.of(spec.key) if self.workspaces is not None else None
            if kept is not None:  # its workspace is kept: a pod on it
                return await self._resume(kept, spec)
            view = await self.pool.claim(_claimed(spec))
            if view is None:
                view = await self._start_cold(spec)
        except ApiError as exc:
            raise SandboxFailed(f"the Kubernetes API refused a pod: {exc.status.message}") from None
        try:
            return await self._connect(view, spec)
        except BaseException:
            await self._delete(view.name)
            raise

    async def _resume(self, kept: ClaimView, spec: SandboxSpec) -> Sandbox:
        """A pod for ``spec``'s paused session on its kept claim (:mod:`.workspaces`)."""
        assert self.workspaces is not None
        if kept.paused is None:  # a pod runs on it
            raise SandboxFailed(f"session {spec.session_id} was resumed by another server")
        await self.workspaces.take(kept, spec.session_id)
        view: PodView | None = None
        try:
            view = await self._start_cold(spec, kept.name, created=kept.session_created)
            return await self._connect(view, spec)
        except BaseException:
            if view is not None:
                await self._delete(view.name)
            await stop_step(spec.key, "keep its workspace", self.workspaces.give_back(kept))
            raise

    async def _start_cold(
        self, spec: SandboxSpec, claim: str | None = None, *, created: float | None = None
    ) -> PodView:
        """A pod made for ``spec``'s session, on ``claim`` (else one of its own when there
        are claims); ``created``: a resumed session's time of making."""
        name = warm_pod_name()
        if claim is None and self.workspaces is not None:
            await self.workspaces.make(name)
            claim = name
        manifest = self._manifests.session(spec, name, workspace_claim=claim)
        annotations = _claimed(spec)["annotations"]
        if created is not None:
            annotations[ANNOTATION_CREATED] = _stamp(created)
        manifest["metadata"].setdefault("annotations", {}).update(annotations)
        pod = await self._client.create(pod_of(manifest, self._namespace))
        self.watch.note(pod)
        try:
            view = await self.watch.wait_for(
                name, lambda v: v is None or v.gone or (v.ready and v.ip is not None), _START_WAIT_S
            )
        except TimeoutError:
            await self._delete(name)
            raise SandboxFailed(
                f"pod {name} did not become ready within {_START_WAIT_S:.0f} s "
                "(kubectl describe pod says why)"
            ) from None
        if view is None or view.gone or view.ip is None:
            await self._delete(name)
            raise SandboxFailed(f"pod {name} ended before it was ready")
        return view

    async def _connect(self, view: PodView, spec: SandboxSpec) -> PodSandbox:
        ip, name = view.ip, view.name
        assert ip is not None

        async def dial() -> Channel:
            now = self.watch.get(name)
            if now is None or now.gone:
                raise SandboxFailed(f"pod {name} is gone")
            port = self._manifests.agent_port
            return await self._open_channel(ip, port, self._tls, _CONNECT_WAIT_S)

        channel = PodChannel(await dial(), dial)
        sandbox = PodSandbox(spec, channel, name, self.watch, view.claim)
        # As the pod records it: a claim wrote it just now, so the first call writes no
        # annotation of its own (a claim stays within its writes).
        sandbox.noted_active = view.active or 0.0

        async def not_ready(message: dict[str, Any] | None, timed_out: bool) -> str:
            what = "said nothing" if timed_out else f"sent {message!r}"[:200]
            return f"the agent of pod {view.name} {what} instead of ready"

        try:
            sandbox.ready = await wait_ready(sandbox, _READY_WAIT_S, not_ready)
        except BaseException:
            channel.close()
            raise
        return sandbox

    async def stop(self, sandbox: Sandbox) -> None:
        sandbox.channel.close()
        key = sandbox.spec.key
        claim = sandbox.claim if isinstance(sandbox, PodSandbox) else None
        if self.workspaces is not None and claim is not None:
            if key in self.workspaces.ending:  # nothing to keep: deleted after its pod
                await stop_step(key, "delete its pod", self._delete(sandbox.backend_id))
                await stop_step(key, "delete its workspace", self.workspaces.delete(claim))
                return
            view = self.watch.get(sandbox.backend_id)
            made, active = (None, None) if view is None else (view.session_created, view.active)
            keep = self.workspaces.keep(claim, sandbox.spec, made, active)
            await stop_step(key, "keep its workspace", keep)
        await stop_step(key, "delete its pod", self._delete(sandbox.backend_id))

    async def kept(self, key: str, paused: dict[str, Any]) -> None:
        if self.workspaces is not None:
            await self.workspaces.kept(key, paused)

    def ending(self, key: str) -> None:
        if self.workspaces is not None:
            self.workspaces.ending.add(key)

    async def forget(self, key: str) -> None:
        if self.workspaces is not None:
            await self._start()
            await self.workspaces.forget(key)

    async def _delete(self, name: str) -> None:
        try:
            await self._client.delete(Pod, name, namespace=self._namespace, grace_period=0)
        except ApiError as exc:
            if exc.status.code != 404:
                raise
        self.watch.forget(name)

    async def reattach(
        self,
        leftover: Leftover,
        spec: SandboxSpec,
        *,
        bound: Callable[[], Awaitable[None]] | None = None,
    ) -> Sandbox | None:
        await self._start()
        view = self.watch.get(leftover.backend_id)
        if view is None or view.gone or view.ip is None or view.key != spec.key:
            return None
        if bound is not None:
            await bound()
        try:
            return await self._connect(view, spec)
        except (SandboxFailed, OSError) as exc:
            log.warning("kubernetes: cannot reach pod %s again: %s", view.name, exc)
            return None

    async def follow(self) -> None:
        await self._start()

    async def find(self, key: str) -> Leftover | None:
        await self._start()
        paused = await self.workspaces.find(key) if self.workspaces is not None else None
        if paused is not None:
            return paused
        for view in self.watch.all():
            if view.pool == CLAIMED and view.key == key and not view.gone and view.ip:
                return _found(view)
        return None

    def sessions(self, owner: str | None) -> list[Leftover]:
        paused = self.workspaces.paused(owner) if self.workspaces is not None else []
        return [
            _found(view)
            for view in self.watch.all()
            if view.pool == CLAIMED and not view.gone and owner in (None, view.owner)
        ] + paused

    def handed_on(self, sandbox: Sandbox) -> bool:
        return sandbox.channel.at_eof() and sandbox.is_alive()

    async def touch(self, sandbox: Sandbox) -> None:
        if not isinstance(sandbox, PodSandbox):
            return
        now = time.time()
        if now - sandbox.noted_active < _ACTIVE_EVERY_S:
            return
        sandbox.noted_active = now
        patch = {"metadata": {"annotations": {ANNOTATION_ACTIVE: _stamp(now)}}}
        try:
            await self._client.patch(
                Pod,
                sandbox.backend_id,
                patch,
                namespace=self._namespace,
                patch_type=PatchType.MERGE,
            )
        except (ApiError, OSError) as exc:
            log.warning("kubernetes: cannot note pod %s active: %s", sandbox.backend_id, exc)

    async def allow_egress(self, sandbox: Sandbox) -> None:
        """Label the pod with network: the policy then lets it reach the server pods'
        egress gate (``spec.sandbox_egress_policy``); a pod labelled already stays so."""
        patch = {"metadata": {"labels": {LABEL_NETWORK: NETWORK_ON}}}
        try:
            await self._client.patch(
                Pod, sandbox.backend_id, patch, namespace=self._namespace,
                patch_type=PatchType.MERGE,
            )  # fmt: skip
        except ApiError as exc:
            raise SandboxFailed(
                f"cannot give pod {sandbox.backend_id} network: {exc.status.message}"
            ) from None

    async def list_leftovers(self, *, live_too: bool = False) -> list[Leftover]:
        """None: a session's pod is the cluster's record of it, which any replica finds
        again by its key when a call comes for it, so a starting server has nothing of
        another's to take over or remove (and must not delete pods other replicas serve)."""
        return []

    async def remove_leftover(self, leftover: Leftover) -> None:
        with contextlib.suppress(ApiError):
            await self._delete(leftover.backend_id)

    async def check_ready(self) -> None:
        await self._start()
        try:
            await self._client.get(Pod, "mcp-code-sandbox-readyz", namespace=self._namespace)
        except ApiError as exc:
            if exc.status.code != 404:
                raise BackendUnavailable(
                    f"the Kubernetes API refused to read pods: {exc.status.message}"
                ) from None
        except OSError as exc:
            raise BackendUnavailable(f"the Kubernetes API does not answer: {exc}") from None

    def pool_counts(self) -> PoolCounts:
        return self.pool.counts()

    def describe(self) -> Description:
        return Description(
            enforcement={
                "memory": "cgroup",
                "cpu": "cgroup",
                "pids": "none",
                "tmp": "checked",
                "file_size": "rlimit",
                "network": "checked",
            },
            runtimes={},
            network_unavailable=None
            if self.egress_gate is not None
            else (
                "SANDBOX_KUBERNETES_POD_IP is not set (deploy/kubernetes/server.yaml sets "
                "it from the downward API): the server pod's IP, where sandbox pods reach "
                "their egress proxies"
            ),
        )

    async def aclose(self) -> None:
        await self.pool.aclose()
        await self.watch.aclose()
        if self.workspaces is not None:
            await self.workspaces.aclose()
        await self._client.close()


def _found(view: PodView) -> Leftover:
    """A claimed pod as the session it records."""
    return Leftover(
        backend_id=view.name,
        key=view.key,
        owner=view.owner,
        session_id=view.session_id,
        running=not view.gone,
        created_at=view.session_created,
        active_at=view.active,
    )


def _claimed(spec: SandboxSpec) -> dict[str, dict[str, str]]:
    """What makes a pod ``spec``'s session's: its labels and annotations, with the
    session's times (made and active now)."""
    metadata = claim_metadata(spec)
    now = _stamp(time.time())
    metadata["annotations"].update({ANNOTATION_CREATED: now, ANNOTATION_ACTIVE: now})
    return metadata


def _stamp(when: float) -> str:
    return f"{when:.0f}"


def from_settings(settings: Settings) -> KubernetesBackend:
    """The backend for ``settings``: the API server of the pod's service account (in a
    cluster) or of ``KUBECONFIG`` (outside one), as lightkube finds them; the sandboxes'
    namespace; the server's certificate for the agents (``SANDBOX_KUBERNETES_AGENT_TLS_DIR``).
    Raises ``ConfigError`` (ours) saying what to fix when either is missing."""
    try:
        config = KubeConfig.from_env()
    except ConfigError as exc:
        why = (
            f"SANDBOX_BACKEND=kubernetes: no Kubernetes API found ({exc}); run the server "
            "in a cluster with a service account, or set KUBECONFIG"
        )
        raise SettingsError([why]) from None
    try:
        tls = server_context(settings.kubernetes_server_cert, settings.kubernetes_server_key)
    except (OSError, ssl.SSLError) as exc:
        why = (
            "SANDBOX_BACKEND=kubernetes: cannot load the agents' server certificate from "
            f"{settings.kubernetes_agent_tls_dir} ({exc}); make one with "
            "`mcp-code-sandbox kubernetes certs --out DIR`"
        )
        raise SettingsError([why]) from None
    keeps = settings.kubernetes_storage_class is not None
    manifests = Manifests(
        warm=functools.partial(warm_pod, settings=settings, own_claim=keeps),
        session=functools.partial(session_pod, settings=settings),
        agent_port=AGENT_PORT,
        claim=functools.partial(workspace_claim, spec=None, settings=settings) if keeps else None,
    )
    return KubernetesBackend(
        client=AsyncClient(config, namespace=settings.kubernetes_namespace),
        namespace=settings.kubernetes_namespace,
        manifests=manifests,
        tls=tls,
        open_channel=open_channel,
        pool_size=settings.pool_size,
        # The pool's Lease names its holder: the pod (its hostname) and the process.
        instance=f"{socket.gethostname()}-{os.getpid()}",
        idle_s=settings.session_ttl_m * 60,
        lifetime_s=settings.session_max_lifetime_h * 3600,
        egress_gate=None if (ip := settings.kubernetes_pod_ip) is None else (str(ip), EGRESS_PORT),
    )
