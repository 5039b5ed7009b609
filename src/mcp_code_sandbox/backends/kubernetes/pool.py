"""The warm pool of pods that every server replica shares.

Warm pods are anonymous: made from the same manifest whoever asks, with no session's
identity, env or secrets (a session's reach the pod after its claim, over the agent's
authenticated channel, with each run). Semantics:

- **Claim**: one merge patch of a ready warm pod's labels and annotations, carrying the
  resourceVersion this replica saw (:meth:`PodPool.claim`). The API server applies it
  only if the pod is unchanged since, so two replicas racing for one pod get one success
  and one 409, and the loser tries the next pod: never a double claim. One API write.
- **Refill and reap**: one replica at a time, the holder of the pool's Lease
  (``coordination.k8s.io/v1``), keeps ``size`` warm pods made or starting, replaces those
  that failed or are older than an hour, and deletes the surplus. A claim wakes it
  at once; it creates at most :data:`_CREATES_AT_ONCE` pods per round. The holder renews
  the Lease; when it stops (a crash, a SIGKILL) another replica takes the Lease once it
  expired, so the pool outlives any replica. It also ends sessions' pods past their
  lifetime or idle TTL by their annotations, whichever server served them last. So a
  claim costs at most two writes: the claim and the refill's create.
- **Workspace claims** (with a StorageClass): each warm pod is made with a claim of its
  own, of the same name (the claim first, then the pod), so a claim of a pod still
  writes the pod alone, and a claim costs at most three writes. A pod deleted here
  takes its claim along; a session's claim without a pod (a paused session) is deleted
  past the session's lifetime or idle TTL, by its annotations; an anonymous claim whose
  pod is gone (its maker died between the two creates) after :data:`_ORPHAN_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import secrets
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from lightkube import ApiError, AsyncClient
from lightkube.models.coordination_v1 import LeaseSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import PersistentVolumeClaim, Pod
from lightkube.types import PatchType

from mcp_code_sandbox.backends.kubernetes.pods import (
    ClaimView,
    ClaimWatch,
    PodView,
    PodWatch,
    claim_of,
    pod_of,
    view_of,
)
from mcp_code_sandbox.backends.kubernetes.spec import CLAIMED, WARM
from mcp_code_sandbox.backends.own_pool import PoolCounts

__all__ = ["POOL_LEASE", "PodPool", "warm_pod_name"]

log = logging.getLogger(__name__)

#: The Lease whose holder refills the pool (one per namespace).
POOL_LEASE = "mcp-code-sandbox-pool"
#: How long a pool Lease lasts unrenewed: a replica that died stops refilling for at most
#: this long before another takes over; renewed three times within it.
_LEASE_S = 15
_RENEW_S = _LEASE_S / 3
#: Pods the refiller creates per round: a burst of creates is what drains an API server's
#: write budget (and a node's image cache), and the claims of a burst come first.
_CREATES_AT_ONCE = 4
#: A warm pod older than this is replaced, as the other backends' pooled sandboxes are:
#: its image may have been updated since, and a long-lived idle process is a target.
_MAX_AGE = timedelta(hours=1)
#: Past a session's idle TTL, how long its pod's activity annotation may lag the last call
#: (a server writes it once a minute at most: ``backend._ACTIVE_EVERY_S``) before the
#: reaper of sessions nobody holds ends it.
_IDLE_GRACE_S = 180.0
#: How often the refiller looks again when no claim woke it.
_TICK_S = 1.0
#: How old an anonymous workspace claim with no pod may be before it is deleted: its
#: pod is created right after it, so only a refiller that died between the two leaves
#: one; a minute is far beyond that gap and any watch's lag.
_ORPHAN_S = 60.0


def warm_pod_name() -> str:
    """A fresh pod name: no session's name, so the pod tells nothing of who will use it."""
    return f"mcp-sandbox-{secrets.token_hex(6)}"


class PodPool:
    """Claims warm pods for sessions and, while it holds the pool's Lease, refills them."""

    def __init__(
        self,
        client: AsyncClient,
        namespace: str,
        watch: PodWatch,
        make_warm: Callable[[str], dict[str, Any]],
        *,
        make_claim: Callable[[str], dict[str, Any]] | None = None,
        claims: ClaimWatch | None = None,
        size: int,
        instance: str,
        idle_s: float,
        lifetime_s: float,
    ) -> None:
        self._client = client
        self._namespace = namespace
        self._watch = watch
        self._make_warm = make_warm
        self._make_claim = make_claim
        self._claims = claims
        self.size = size
        self._instance = instance
        self._idle = timedelta(seconds=idle_s + _IDLE_GRACE_S)
        self._lifetime = timedelta(seconds=lifetime_s)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.leading = False
        #: Claims that lost their race (409): for the metrics and the bench.
        self.conflicts = 0
        #: Pods a claim of this replica is patching now.
        self._trying: set[str] = set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._refill_loop(), name="kubernetes-pool")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.leading:
            # Let another replica refill at once rather than after the Lease expires.
            with contextlib.suppress(Exception):
                await self._client.patch(
                    Lease,
                    POOL_LEASE,
                    {"spec": {"holderIdentity": None}},
                    namespace=self._namespace,
                    patch_type=PatchType.MERGE,
                )

    def counts(self) -> PoolCounts:
        """The warm pods now, as this replica's view has them (every replica's pool)."""
        warm = [view for view in self._watch.all() if view.pool == WARM and not view.gone]
        ready = sum(1 for view in warm if view.claimable)
        return PoolCounts(self.size, ready, len(warm) - ready)

    async def claim(self, metadata: dict[str, dict[str, str]]) -> PodView | None:
        """Make a ready warm pod a session's, by one conditional update writing
        ``metadata`` (its labels and annotations: ``spec.claim_metadata``); ``None`` when
        none is left (the caller starts one cold). Raises the API server's other errors."""
        # In random order, and never a pod another claim of this replica is trying: a
        # burst of claims that all tried the oldest pod first would lose to each other
        # once per pod claimed before them (a conflict each, quadratic in the burst).
        names = [v.name for v in self._watch.claimable()]
        random.shuffle(names)
        for name in names:
            view = self._watch.get(name)  # as of now: another claim may have taken it
            if view is None or not view.claimable or name in self._trying:
                continue
            patch = {"metadata": {"resourceVersion": view.resource_version, **metadata}}
            self._trying.add(view.name)
            try:
                pod = await self._client.patch(
                    Pod, view.name, patch, namespace=self._namespace, patch_type=PatchType.MERGE
                )
            except ApiError as exc:
                if exc.status.code in (404, 409):  # another replica's, or gone: next one
                    self.conflicts += 1
                    continue
                raise
            finally:
                self._trying.discard(view.name)
            self._watch.note(pod)
            self._wake.set()
            return view_of(pod)
        self._wake.set()
        return None

    async def _refill_loop(self) -> None:
        renewed_at = 0.0
        loop = asyncio.get_running_loop()
        while True:
            try:
                if loop.time() - renewed_at >= _RENEW_S:
                    self.leading = await self._hold_lease()
                    renewed_at = loop.time()
                if self.leading:
                    await self._refill()
                    await self._reap()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("kubernetes: pool refill failed (%s)", exc)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), _TICK_S)

    async def _refill(self) -> None:
        now = datetime.now(UTC)
        alive = []
        for view in self._watch.all():
            if view.pool != WARM:
                continue
            if view.gone or (view.created is not None and now - view.created > _MAX_AGE):
                await self._delete(view)
            else:
                alive.append(view)
        surplus = len(alive) - self.size
        if surplus > 0:
            # The newest first: the oldest are the readiest.
            for view in sorted(alive, key=lambda v: v.created or now, reverse=True)[:surplus]:
                await self._delete(view)
            return
        missing = min(-surplus, _CREATES_AT_ONCE)
        if missing > 0:
            await asyncio.gather(*(self._create() for _ in range(missing)))

    async def _reap(self) -> None:
        """Delete the pods of sessions past their lifetime, or idle past their TTL by
        their activity annotation (the servers note each call's): a session whose
        servers all let go of it, or died, is ended here as its server would have."""
        now = datetime.now(UTC)
        for view in self._watch.all():
            if view.pool != CLAIMED or view.gone:
                continue
            if self._expired(view, now):
                log.info("kubernetes: ending the idle or expired session of pod %s", view.name)
                await self._delete(view)
        if self._claims is not None:
            await self._reap_claims(now)

    async def _reap_claims(self, now: datetime) -> None:
        """Delete the claims no pod runs on that nobody will: a paused session's past
        its lifetime or idle TTL, an anonymous one left by a refiller that died."""
        assert self._claims is not None
        used = {view.claim for view in self._watch.all() if view.claim is not None}
        for claim in self._claims.all():
            if claim.deleting or claim.name in used:
                continue
            if claim.key is None:
                if claim.created is not None and (now - claim.created).total_seconds() > _ORPHAN_S:
                    await self._delete_claim(claim.name)
            elif self._expired(claim, now):
                log.info("kubernetes: ending the idle or expired paused session %s", claim.name)
                await self._delete_claim(claim.name)

    def _expired(self, view: PodView | ClaimView, now: datetime) -> bool:
        made = _when(view.session_created) or view.created
        active = _when(view.active) or made
        return (made is not None and now - made > self._lifetime) or (
            active is not None and now - active > self._idle
        )

    async def _create(self) -> None:
        name = warm_pod_name()
        if self._make_claim is not None:  # its workspace's claim first: the pod mounts it
            claim = await self._client.create(claim_of(self._make_claim(name), self._namespace))
            if self._claims is not None:
                self._claims.note(claim)
        pod = await self._client.create(pod_of(self._make_warm(name), self._namespace))
        self._watch.note(pod)

    async def _delete(self, view: PodView) -> None:
        """Delete a pod and the claim its workspace is on, if any."""
        with contextlib.suppress(ApiError):
            await self._client.delete(Pod, view.name, namespace=self._namespace, grace_period=0)
        self._watch.forget(view.name)
        if view.claim is not None:
            await self._delete_claim(view.claim)

    async def _delete_claim(self, name: str) -> None:
        with contextlib.suppress(ApiError):
            await self._client.delete(PersistentVolumeClaim, name, namespace=self._namespace)
        if self._claims is not None:
            self._claims.forget(name)

    async def _hold_lease(self) -> bool:
        """Take or renew the pool's Lease; whether this replica holds it now."""
        now = datetime.now(UTC)
        try:
            lease = await self._client.get(Lease, POOL_LEASE, namespace=self._namespace)
        except ApiError as exc:
            if exc.status.code != 404:
                raise
            fresh = Lease(
                metadata=ObjectMeta(name=POOL_LEASE, namespace=self._namespace),
                spec=LeaseSpec(
                    holderIdentity=self._instance,
                    leaseDurationSeconds=_LEASE_S,
                    acquireTime=now,
                    renewTime=now,
                ),
            )
            try:
                await self._client.create(fresh)
            except ApiError as lost:
                if lost.status.code == 409:
                    return False
                raise
            return True
        spec = lease.spec or LeaseSpec()
        mine = spec.holderIdentity == self._instance
        expired = (
            spec.holderIdentity is None
            or spec.renewTime is None
            or now - spec.renewTime > timedelta(seconds=spec.leaseDurationSeconds or _LEASE_S)
        )
        if not (mine or expired):
            return False
        assert lease.metadata is not None
        patch: dict[str, Any] = {
            "metadata": {"resourceVersion": lease.metadata.resourceVersion},
            "spec": {
                "holderIdentity": self._instance,
                "leaseDurationSeconds": _LEASE_S,
                "renewTime": _micro(now),
            },
        }
        if not mine:
            patch["spec"]["acquireTime"] = _micro(now)
            patch["spec"]["leaseTransitions"] = (spec.leaseTransitions or 0) + 1
        try:
            await self._client.patch(
                Lease, POOL_LEASE, patch, namespace=self._namespace, patch_type=PatchType.MERGE
            )
        except ApiError as exc:
            if exc.status.code == 409:  # another replica renewed or took it first
                return False
            raise
        if not mine:
            log.info("kubernetes: this replica refills the warm pool now")
        return True


def _when(seconds: float | None) -> datetime | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, UTC)


def _micro(when: datetime) -> str:
    """A ``MicroTime``, as Leases carry them."""
    return when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
