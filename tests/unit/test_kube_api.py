"""The fake Kubernetes API (tests/kube_api.py), driven by lightkube's AsyncClient as the
kubernetes backend drives a real one: what it answers is what the backend's tests rely on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from lightkube import ApiError, AsyncClient, operators
from lightkube.models.coordination_v1 import LeaseSpec
from lightkube.models.core_v1 import Container, PodSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import ConfigMap, Namespace, Pod
from lightkube.types import PatchType

from tests.kube_api import KubeApi, in_thread

NS = "sandboxes"


@pytest.fixture
async def api() -> AsyncIterator[KubeApi]:
    async with KubeApi() as api:
        yield api


@pytest.fixture
async def kube(api: KubeApi) -> AsyncIterator[AsyncClient]:
    async with api.client(NS) as client:
        await client.create(Namespace(metadata=ObjectMeta(name=NS)))
        yield client


def a_pod(name: str, **labels: str) -> Pod:
    return Pod(
        metadata=ObjectMeta(name=name, labels=labels),
        spec=PodSpec(containers=[Container(name="agent", image="mcp-code-sandbox")]),
    )


async def test_create_is_201_and_errors_are_status_objects(api: KubeApi) -> None:
    async with httpx.AsyncClient(base_url=api.url) as http:
        made = await http.post("/api/v1/namespaces/default/configmaps",
                               json={"metadata": {"name": "a"}, "data": {"k": "v"}})  # fmt: skip
        again = await http.post("/api/v1/namespaces/default/configmaps",
                                json={"metadata": {"name": "a"}})  # fmt: skip
        missing = await http.get("/api/v1/namespaces/default/configmaps/b")
    assert made.status_code == 201
    assert made.json()["metadata"]["resourceVersion"]
    assert (again.status_code, again.json()["reason"]) == (409, "AlreadyExists")
    assert missing.status_code == 404
    assert missing.headers["content-type"] == "application/json"
    assert missing.json() | {"message": ""} == {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": "", "reason": "NotFound", "details": {"name": "b", "kind": "configmaps"},
        "code": 404,
    }  # fmt: skip


async def test_a_namespace_must_exist_and_takes_its_objects_along(kube: AsyncClient) -> None:
    with pytest.raises(ApiError) as missing:
        await kube.create(Pod(metadata=ObjectMeta(name="p", namespace="nowhere")))
    await kube.create(a_pod("p"))
    await kube.delete(Namespace, NS)
    assert missing.value.status.code == 404
    assert [p async for p in kube.list(Pod, namespace="*")] == []


async def test_resource_versions_increase_across_kinds(kube: AsyncClient) -> None:
    pod = await kube.create(a_pod("p"))
    cm = await kube.create(ConfigMap(metadata=ObjectMeta(name="c")))
    patched = await kube.patch(Pod, "p", {"metadata": {"labels": {"x": "1"}}})
    versions = [int(o.metadata.resourceVersion or 0) for o in (pod, cm, patched) if o.metadata]
    assert versions == sorted(versions) and len(set(versions)) == 3


async def test_a_stale_update_is_a_conflict(kube: AsyncClient) -> None:
    pod = await kube.create(a_pod("p"))
    assert pod.metadata is not None and pod.metadata.labels is not None
    pod.metadata.labels["pool"] = "claimed"
    await kube.replace(pod)  # pod's resourceVersion is now stale
    with pytest.raises(ApiError) as stale_put:
        await kube.replace(pod)
    with pytest.raises(ApiError) as stale_patch:
        await kube.patch(Pod, "p", {"metadata": {"resourceVersion": pod.metadata.resourceVersion}},
                         patch_type=PatchType.MERGE)  # fmt: skip
    assert (stale_put.value.status.code, stale_put.value.status.reason) == (409, "Conflict")
    assert stale_patch.value.status.code == 409
    pod.metadata.resourceVersion = None  # no resourceVersion: an unconditional update
    updated = (await kube.replace(pod)).metadata
    assert updated is not None and updated.labels == {"pool": "claimed"}


async def test_lease_is_acquired_by_one_of_two_conditional_updates(api: KubeApi) -> None:
    async with api.client() as one, api.client() as two:
        await one.create(Lease(metadata=ObjectMeta(name="session-1"), spec=LeaseSpec()))
        seen = [await c.get(Lease, "session-1") for c in (one, two)]
        outcomes: list[str | int | None] = []
        for client, lease, holder in zip((one, two), seen, ("replica-a", "replica-b"), strict=True):
            assert lease.spec is not None
            lease.spec.holderIdentity = holder
            try:
                await client.replace(lease)
                outcomes.append(holder)
            except ApiError as exc:
                outcomes.append(exc.status.code)
        held = await one.get(Lease, "session-1")
    assert outcomes == ["replica-a", 409]
    assert held.spec is not None and held.spec.holderIdentity == "replica-a"


async def test_label_and_field_selectors(kube: AsyncClient) -> None:
    await kube.create(a_pod("w1", pool="warm"))
    await kube.create(a_pod("w2", pool="warm", zone="a"))
    await kube.create(a_pod("c1", pool="claimed", zone="b"))
    await kube.create(a_pod("bare"))

    async def names(**selectors: Any) -> list[str]:
        return [p.metadata.name async for p in kube.list(Pod, **selectors) if p.metadata]  # type: ignore[misc]

    assert await names(labels={"pool": "warm"}) == ["w1", "w2"]
    assert await names(labels={"pool": operators.not_equal("warm")}) == ["bare", "c1"]
    assert await names(labels={"zone": ["a", "b"]}) == ["c1", "w2"]
    assert await names(labels={"zone": operators.not_in(["a"])}) == ["bare", "c1", "w1"]
    assert await names(labels={"zone": None}) == ["c1", "w2"]
    assert await names(labels={"zone": operators.not_exists()}) == ["bare", "w1"]
    assert await names(labels={"pool": "warm", "zone": "a"}) == ["w2"]
    assert await names(fields={"metadata.name": "c1"}) == ["c1"]
    assert await names(fields={"metadata.name": operators.not_equal("c1")}) == ["bare", "w1", "w2"]


async def test_list_pages_with_limit_and_continue(kube: AsyncClient) -> None:
    for n in range(5):
        await kube.create(a_pod(f"p{n}"))
    listed = [p.metadata.name async for p in kube.list(Pod, chunk_size=2)]  # type: ignore[union-attr]
    assert listed == [f"p{n}" for n in range(5)]


async def test_status_is_written_only_through_its_subresource(kube: AsyncClient) -> None:
    await kube.create(a_pod("p"))
    relabelled = await kube.patch(Pod, "p", {"metadata": {"labels": {"a": "1"}},
                                             "status": {"phase": "Running"}})  # fmt: skip
    running = await kube.patch(Pod.Status, "p", {"metadata": {"labels": {"a": "2"}},
                                                 "status": {"phase": "Running"}})  # fmt: skip
    assert relabelled.status is not None and relabelled.status.phase == "Pending"
    assert running.status is not None and running.status.phase == "Running"
    assert running.metadata is not None and running.metadata.labels == {"a": "1"}


async def test_strategic_merge_merges_conditions_by_type(kube: AsyncClient) -> None:
    await kube.create(a_pod("p"))
    ready = {"type": "Ready", "status": "False"}
    scheduled = {"type": "PodScheduled", "status": "True"}
    await kube.patch(Pod.Status, "p", {"status": {"conditions": [ready, scheduled]}})
    pod = await kube.patch(
        Pod.Status, "p", {"status": {"conditions": [ready | {"status": "True"}]}}
    )
    assert pod.status is not None
    assert [(c.type, c.status) for c in pod.status.conditions or []] == [
        ("Ready", "True"), ("PodScheduled", "True"),
    ]  # fmt: skip


async def test_json_patch_with_a_failed_test_changes_nothing(kube: AsyncClient) -> None:
    await kube.create(a_pod("p", pool="warm"))
    claim = [
        {"op": "test", "path": "/metadata/labels/pool", "value": "warm"},
        {"op": "replace", "path": "/metadata/labels/pool", "value": "claimed"},
    ]
    claimed = await kube.patch(Pod, "p", claim, patch_type=PatchType.JSON)
    with pytest.raises(ApiError) as again:
        await kube.patch(Pod, "p", claim, patch_type=PatchType.JSON)
    assert claimed.metadata is not None and claimed.metadata.labels == {"pool": "claimed"}
    assert again.value.status.code == 422


async def test_apply_creates_then_merges(kube: AsyncClient) -> None:
    policy = ConfigMap(metadata=ObjectMeta(name="c", labels={"a": "1"}), data={"k": "v"})
    made = await kube.apply(policy, field_manager="mcp-code-sandbox")
    policy.data = {"k": "w"}
    again = await kube.apply(policy, field_manager="mcp-code-sandbox")
    assert made.metadata is not None and again.metadata is not None
    assert (again.data, again.metadata.uid) == ({"k": "w"}, made.metadata.uid)


async def test_watch_resumes_after_a_resource_version(kube: AsyncClient) -> None:
    await kube.create(a_pod("before"))
    mark = (await kube.patch(Pod, "before", {"metadata": {"labels": {"a": "1"}}})).metadata
    await kube.create(a_pod("after"))
    await kube.delete(Pod, "before")
    assert mark is not None
    events = await take(kube, 2, resource_version=mark.resourceVersion)
    assert events == [("ADDED", "after"), ("DELETED", "before")]


async def test_watch_without_a_resource_version_starts_with_what_exists(kube: AsyncClient) -> None:
    await kube.create(a_pod("there"))
    assert await take(kube, 1) == [("ADDED", "there")]


async def test_watch_with_a_selector_sees_objects_leave_and_join(kube: AsyncClient) -> None:
    made = (await kube.create(a_pod("p", pool="warm"))).metadata
    await kube.patch(Pod, "p", {"metadata": {"labels": {"pool": "claimed"}}})
    await kube.patch(Pod, "p", {"metadata": {"labels": {"zone": "a"}}})  # unseen: not warm
    await kube.patch(Pod, "p", {"metadata": {"labels": {"pool": "warm"}}})
    assert made is not None
    events = await take(kube, 2, labels={"pool": "warm"}, resource_version=made.resourceVersion)
    assert events == [("DELETED", "p"), ("ADDED", "p")]


async def test_watch_from_a_forgotten_resource_version_is_gone() -> None:
    async with KubeApi(history=2) as api, api.client() as kube:
        first = await kube.create(a_pod("p0"))
        for n in range(1, 4):
            await kube.create(a_pod(f"p{n}"))
        assert first.metadata is not None
        with pytest.raises(ApiError) as gone:
            await take(kube, 1, resource_version=first.metadata.resourceVersion)
        api.store.compact()
        with pytest.raises(ApiError) as compacted:
            await take(kube, 1, resource_version=str(api.store.rv - 1))
    assert (gone.value.status.code, compacted.value.status.code) == (410, 410)


async def test_writes_are_counted_by_verb_and_resource(api: KubeApi, kube: AsyncClient) -> None:
    await kube.create(a_pod("p"))
    await kube.patch(Pod, "p", {"metadata": {"labels": {"a": "1"}}})
    await kube.patch(Pod.Status, "p", {"status": {"phase": "Running"}})
    with pytest.raises(ApiError):
        await kube.create(a_pod("p"))  # refused writes count too: they load the API
    await kube.get(Pod, "p")
    await kube.delete(Pod, "p")
    assert api.counts[("create", "pods")] == 2
    assert api.counts[("get", "pods")] == 1
    assert api.writes("pods") == 4
    assert api.writes("pods/status") == 1
    assert api.writes() == 6  # and the namespace's create


async def test_discovery_lists_the_kinds_served(api: KubeApi) -> None:
    async with httpx.AsyncClient(base_url=api.url) as http:
        core = (await http.get("/api/v1")).json()
        groups = (await http.get("/apis")).json()
    assert {"pods", "pods/status", "secrets"} <= {r["name"] for r in core["resources"]}
    assert {g["name"] for g in groups["groups"]} == {"coordination.k8s.io", "networking.k8s.io"}


def test_serves_from_its_own_thread_for_a_synchronous_caller(tmp_path) -> None:
    with in_thread(KubeApi()) as api:
        namespaces = httpx.get(f"{api.url}/api/v1/namespaces").json()
        config = api.kubeconfig(tmp_path / "kubeconfig")
    assert [n["metadata"]["name"] for n in namespaces["items"]] == ["default"]
    assert api.url in config.read_text()


async def take(kube: AsyncClient, count: int, **watch: object) -> list[tuple[str, str]]:
    """The first ``count`` events of a pod watch, as (type, name)."""
    events: list[tuple[str, str]] = []
    async with asyncio.timeout(30):
        async for kind, pod in kube.watch(Pod, **watch):  # type: ignore[call-overload]
            events.append((kind, pod.metadata.name))
            if len(events) == count:
                return events
    return events
