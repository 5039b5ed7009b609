"""A fake kubelet for the fake Kubernetes API (``tests/kube_api.py``): it runs each pod of a
namespace as a local process, so the kubernetes backend's tests reach a real agent.

    async with KubeApi() as api, Kubelet(api.url, "sandboxes") as kubelet:
        ...                                  # create pods through the API
        kubelet.pods["sb-1"].workspace       # the host directory of the pod's /mnt/data

It lists and watches pods through the API's HTTP, as a kubelet does, so it works as well
against an API served from another thread (``in_thread``). It speaks that HTTP itself
(httpx, JSON) rather than through lightkube: the backend's client is what the tests
check, and lightkube's decoder (msgspec) crashes the process when two threads first
decode one type at once, as a kubelet thread beside a test's client would. For each new
pod it starts the first container as a process of its own session:

- the argv: ``command`` + ``args`` with ``$(VAR)`` expanded from the container's env as
  Kubernetes does (``$$`` is a literal ``$``; an unknown variable stays as written). No
  ``command``: the image's entrypoint, which for every image is the agent's,
  ``python -s -B -m mcs_agent``. The image's /opt/sandbox/lib holds this repository's
  ``src/.../agent`` as ``mcs_agent``; an agent's argv without ``--workdir`` gets the
  agent's default one spelled out (``--workdir /mnt/data``), so that it is mapped as
  below. The image's ``python`` (``python``, ``python3``,
  ``/opt/sandbox/venv/bin/python``...) is this test's interpreter, with ``PYTHONPATH`` at
  this repository's ``src``;
- the filesystem: as ``tests/fakes.py`` does, nothing is walled off and the paths the pod
  sees are host directories. Each volume is a fresh directory (``emptyDir``), the keys of
  its ConfigMap or Secret as files, one per claim kept across pods
  (``persistentVolumeClaim``), or the host's own (``hostPath``: how a test meets the
  pod's files); the image's /mnt/data and /tmp are fresh directories too.
  An argument, an env value or ``workingDir`` that starts with a mount path (``--x=`` too)
  is rewritten to its host directory; the process runs in ``workingDir`` (default the
  image's, /mnt/data);
- the env: a small base (PATH, HOME, LANG, PYTHONPATH), then the container's ``env`` and
  ``envFrom``: ``value``, ``fieldRef`` (``status.podIP`` is the pod's address, also
  ``metadata.name``/``namespace``/``uid``/``labels['k']``/``annotations['k']``,
  ``status.hostIP``, ``spec.nodeName``), ``configMapKeyRef`` and ``secretKeyRef``;
- the network: the pod's IP is a fresh loopback address (all of 127/8 is loopback on
  Linux), picked at random outside 127.0.0.0/24 so that kubelets of concurrent test runs
  do not meet, and free on the container's ports.

Then it reports the pod ``Running`` with that ``podIP``, and ``Ready`` once the port of
its ``readinessProbe`` (``tcpSocket``/``httpGet``) or, with no probe, its first
``containerPort`` accepts a TCP connection. A real kubelet marks a pod without a probe
Ready as soon as its container starts: give the sandbox pod a tcpSocket probe on its
agent port and both agree. When the process exits, the pod is ``Failed`` (``Succeeded``
for exit 0 under ``restartPolicy`` Never/OnFailure; there are no restarts); when the pod
is deleted, its container's process gets SIGTERM (ignored unless handled, as by a pid 1
in a container), then its whole process group SIGKILL after a short grace.

Isolation: none but a pid namespace of its own where ``unshare`` can make one (the
container's process is pid 1 there and sees only its own, so the agent's ``kill_strays``
ends only the pod's processes; where none can be made, a pod that asks for
``kill_strays`` fails instead). No user or network isolation and no walls: the process
runs as the test's user, sees the host's files (and a /proc of its own) and shares the
host's network. Not emulated: resource
limits, init and sidecar containers, probes beyond readiness once, restarts, image
pulls, scheduling (every pod of the namespace runs here, whatever its ``nodeName``)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import sys
import tempfile
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.kube_ops import PATCH_MERGE, Obj
from tests.kubelet_pod import (
    PROBE_EVERY_S,
    expand,
    failed_status,
    field_value,
    fresh_ip,
    group_members,
    in_pid_namespace,
    probe_port,
    rewrite,
    running_status,
    until_gone,
)

__all__ = ["FakePod", "Kubelet"]

SRC = Path(__file__).resolve().parents[1] / "src"
AGENT = SRC / "mcp_code_sandbox" / "agent"
#: The image's entrypoint (images/Dockerfile), run in AGENT_LIB.
ENTRYPOINT = ["python", "-s", "-B", "-m", "mcs_agent"]
#: The agent's default ``--workdir`` (the image has it), spelled out on an agent's argv
#: that has none, so that it is mapped like any path in the pod.
AGENT_WORKDIR = ("--workdir", "/mnt/data")
IMAGE_WORKDIR = "/mnt/data"
#: Where the image keeps the agent package (its entrypoint's cwd, the pod's workingDir).
AGENT_LIB = "/opt/sandbox/lib"
#: Directories every container of the image has, without a volume.
IMAGE_DIRS = ("/mnt/data", "/tmp")
PYTHON_RE = re.compile(r"^python(3(\.\d+)?)?$")
#: SIGTERM to SIGKILL on delete (a pod's own grace period, capped: tests wait for it).
MAX_GRACE_S = 2.0
#: Before a watch that failed is tried again (the API restarting in a test).
REWATCH_AFTER_S = 0.2


@dataclass
class FakePod:
    """One pod this kubelet runs: its process and where its paths are on the host."""

    name: str
    uid: str
    ip: str
    root: Path  # everything of this pod on the host; removed when it ends
    mounts: dict[str, Path]  # path in the pod -> host path
    proc: asyncio.subprocess.Process | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    deleted: bool = False
    #: Seconds from SIGTERM to SIGKILL: the pod's terminationGracePeriodSeconds, capped.
    grace_s: float = MAX_GRACE_S

    @property
    def workspace(self) -> Path:
        """The host directory the pod sees as /mnt/data."""
        return self.host_path("/mnt/data")

    @property
    def log(self) -> str:
        """What the container wrote (stdout and stderr)."""
        path = self.root / "container.log"
        return path.read_text(errors="replace") if path.exists() else ""

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else 0

    def host_path(self, path: str) -> Path:
        return Path(rewrite(path, self.mounts))


class Kubelet:
    """Runs every pod of ``namespace`` (with all of ``labels``, if given) that the API at
    ``url`` has."""

    def __init__(
        self, url: str, namespace: str = "default", *, labels: dict[str, str] | None = None
    ) -> None:
        self._url = url
        self._namespace = namespace
        self._labels = labels
        #: Pods running here, by name.
        self.pods: dict[str, FakePod] = {}
        self._seen: set[str] = set()  # uids started (a re-list after 410 sees them again)
        self._state = Path(tempfile.mkdtemp(prefix="mcs-kubelet-"))
        self._http: httpx.AsyncClient | None = None
        self._watch: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Kubelet:
        lib = self._state / "lib"  # the image's /opt/sandbox/lib: the agent as mcs_agent
        lib.mkdir()
        (lib / "mcs_agent").symlink_to(AGENT, target_is_directory=True)
        # No read timeout: a watch waits as long as nothing changes.
        timeout = httpx.Timeout(10.0, read=None)
        self._http = httpx.AsyncClient(base_url=self._url, timeout=timeout, trust_env=False)
        self._watch = asyncio.create_task(self._watch_pods())
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in [self._watch, *self._tasks]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await asyncio.gather(*(self._end(pod) for pod in list(self.pods.values())))
        if self._http is not None:
            await self._http.aclose()
        shutil.rmtree(self._state, ignore_errors=True)

    # -- the watch -------------------------------------------------------------------------

    async def _watch_pods(self) -> None:
        """List, then watch from the list's resourceVersion; list again after a 410 (and
        end what the list no longer has), watch again after a dropped stream."""
        assert self._http is not None
        path = f"/api/v1/namespaces/{self._namespace}/pods"
        selector = ",".join(f"{k}={v}" for k, v in (self._labels or {}).items())
        version: str | None = None
        while True:
            try:
                if version is None:
                    listed = await self._read(path, labelSelector=selector)
                    present = {p["metadata"]["uid"] for p in listed["items"]}
                    for pod in list(self.pods.values()):
                        if pod.uid not in present:
                            self._gone(pod.name, pod.uid)
                    for obj in listed["items"]:
                        self._seen_pod("ADDED", obj)
                    version = listed["metadata"]["resourceVersion"]
                params = {"watch": "true", "resourceVersion": version, "labelSelector": selector}
                async with self._http.stream("GET", path, params=params) as stream:
                    stream.raise_for_status()
                    async for line in stream.aiter_lines():
                        event = json.loads(line)
                        if event["type"] == "ERROR":  # 410 Gone: too far behind
                            version = None
                            break
                        version = event["object"]["metadata"]["resourceVersion"]
                        self._seen_pod(event["type"], event["object"])
            except (httpx.HTTPError, ValueError, KeyError):
                await asyncio.sleep(REWATCH_AFTER_S)  # the API restarting, in a test

    def _seen_pod(self, event: str, obj: Obj) -> None:
        meta = obj["metadata"]
        if event == "DELETED":
            self._gone(meta["name"], meta["uid"])
        elif meta["uid"] not in self._seen and obj.get("status", {}).get("phase") == "Pending":
            self._seen.add(meta["uid"])
            self._spawn(self._start(obj))

    def _gone(self, name: str, uid: str) -> None:
        running = self.pods.get(name)
        if running is not None and running.uid == uid and not running.deleted:
            running.deleted = True
            self._spawn(self._end(running))

    async def _read(self, path: str, **params: str) -> Obj:
        assert self._http is not None
        response = await self._http.get(path, params=params)
        response.raise_for_status()
        found: Obj = response.json()
        return found

    async def _object(self, plural: str, name: str) -> Obj:
        return await self._read(f"/api/v1/namespaces/{self._namespace}/{plural}/{name}")

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- one pod -----------------------------------------------------------------------

    async def _start(self, obj: Obj) -> None:
        meta, spec = obj["metadata"], obj["spec"]
        container = spec["containers"][0]
        ports = [p["containerPort"] for p in container.get("ports") or []]
        root = self._state / "pods" / meta["uid"]
        root.mkdir(parents=True)
        ip = fresh_ip(ports, {p.ip for p in self.pods.values()})
        pod = FakePod(meta["name"], meta["uid"], ip, root, {})
        pod.grace_s = min(float(spec.get("terminationGracePeriodSeconds", 30)), MAX_GRACE_S)
        self.pods[pod.name] = pod
        try:
            pod.mounts = await self._volumes(obj, container, root)
            own = await self._env(obj, container, pod)
            env = {**self._base_env(pod), **own}
            argv = in_pid_namespace(self._argv(container, own, pod.mounts))
            cwd = pod.host_path(container.get("workingDir") or IMAGE_WORKDIR)
            with open(root / "container.log", "wb") as log:
                pod.proc = await asyncio.create_subprocess_exec(
                    *argv,
                    env=env,
                    cwd=cwd,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,
                )
        except (OSError, LookupError, ValueError, httpx.HTTPError) as exc:
            await self._status(pod, failed_status(f"the fake kubelet cannot start it: {exc!r}"))
            return
        if pod.deleted:  # deleted while it started
            await self._end(pod)
            return
        await self._status(pod, running_status(pod.ip, pod.pid, container, ready=False))
        pod.tasks.append(asyncio.create_task(self._until_ready(pod, container)))
        pod.tasks.append(asyncio.create_task(self._until_exit(pod, container, spec)))

    async def _until_ready(self, pod: FakePod, container: Obj) -> None:
        port = probe_port(container)
        while port is not None:
            with contextlib.suppress(OSError):
                _, writer = await asyncio.open_connection(pod.ip, port)
                writer.close()
                break
            await asyncio.sleep(PROBE_EVERY_S)
        await self._status(pod, running_status(pod.ip, pod.pid, container, ready=True))

    async def _until_exit(self, pod: FakePod, container: Obj, spec: Obj) -> None:
        assert pod.proc is not None
        code = await pod.proc.wait()
        if pod.deleted:
            return
        for task in pod.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        done = code == 0 and spec.get("restartPolicy", "Always") != "Always"
        status = failed_status(f"the container exited with {code}", code, container["name"])
        status["phase"] = "Succeeded" if done else "Failed"
        await self._status(pod, status)

    async def _end(self, pod: FakePod) -> None:
        """SIGTERM to the container's process, a short grace, SIGKILL to the pod's process
        group, each until none of the group is left; then the pod's files."""
        for task in pod.tasks:
            task.cancel()
        proc = pod.proc
        if proc is not None:
            for sig, wait in ((signal.SIGTERM, pod.grace_s), (signal.SIGKILL, 5.0)):
                members = group_members(proc.pid)
                if not members:
                    break
                # Under unshare the container's process is unshare's child (pid 1 of its
                # namespace); SIGTERM to unshare would only make it SIGKILL that child.
                main = [pid for pid, ppid in members if ppid == proc.pid] or [proc.pid]
                with contextlib.suppress(ProcessLookupError):
                    if sig == signal.SIGTERM:
                        os.kill(main[0], sig)
                    else:
                        os.killpg(proc.pid, sig)
                await until_gone(proc.pid, wait)
            with contextlib.suppress(TimeoutError):  # reap it (its group is gone)
                await asyncio.wait_for(proc.wait(), 5.0)
        if self.pods.get(pod.name) is pod:
            del self.pods[pod.name]
        shutil.rmtree(pod.root, ignore_errors=True)

    async def _status(self, pod: FakePod, status: Obj) -> None:
        assert self._http is not None
        if pod.deleted:
            return
        path = f"/api/v1/namespaces/{self._namespace}/pods/{pod.name}/status"
        body = json.dumps({"status": status})
        with contextlib.suppress(httpx.HTTPError):  # deleted meanwhile: nobody to tell
            response = await self._http.patch(
                path, content=body, headers={"Content-Type": PATCH_MERGE}
            )
            response.raise_for_status()

    # -- what the process gets -----------------------------------------------------------

    async def _volumes(self, obj: Obj, container: Obj, root: Path) -> dict[str, Path]:
        volumes: dict[str, Path] = {}
        for volume in obj["spec"].get("volumes") or []:
            path = root / "volumes" / volume["name"]
            if "persistentVolumeClaim" in volume:  # one directory per claim, kept across pods
                claim = volume["persistentVolumeClaim"]["claimName"]
                path = self._state / "claims" / claim
            elif "hostPath" in volume:  # the host's own directory (a test's, to meet the pod)
                path = Path(volume["hostPath"]["path"])
            path.mkdir(parents=True, exist_ok=True)
            for key, data in (await self._volume_files(volume)).items():
                (path / key).parent.mkdir(parents=True, exist_ok=True)
                (path / key).write_bytes(data)
            volumes[volume["name"]] = path
        mounts = {d: root / "image" / d.strip("/") for d in IMAGE_DIRS}
        mounts[AGENT_LIB] = self._state / "lib"  # the image's agent package, as mcs_agent
        for mount in container.get("volumeMounts") or []:
            mounts[mount["mountPath"]] = volumes[mount["name"]] / mount.get("subPath", "")
        for path in mounts.values():
            if not path.suffix:  # a file mounted by subPath exists already
                path.mkdir(parents=True, exist_ok=True)
        return mounts

    async def _volume_files(self, volume: Obj) -> dict[str, bytes]:
        """The files of a ConfigMap or Secret volume (all keys, or its ``items``)."""
        if "configMap" in volume:
            source = volume["configMap"]
            cm = await self._object("configmaps", source["name"])
            data = {k: v.encode() for k, v in (cm.get("data") or {}).items()}
            data.update({k: base64.b64decode(v) for k, v in (cm.get("binaryData") or {}).items()})
        elif "secret" in volume:
            source = volume["secret"]
            secret = await self._object("secrets", source["secretName"])
            data = {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}
        else:
            return {}
        items = source.get("items")
        return {i["path"]: data[i["key"]] for i in items} if items else data

    async def _env(self, obj: Obj, container: Obj, pod: FakePod) -> dict[str, str]:
        own: dict[str, str] = {}
        for source in container.get("envFrom") or []:
            prefix = source.get("prefix", "")
            if "configMapRef" in source:
                cm = await self._object("configmaps", source["configMapRef"]["name"])
                own.update({prefix + k: v for k, v in (cm.get("data") or {}).items()})
            elif "secretRef" in source:
                secret = await self._object("secrets", source["secretRef"]["name"])
                own.update(
                    {
                        prefix + k: base64.b64decode(v).decode()
                        for k, v in (secret.get("data") or {}).items()
                    }
                )
        for var in container.get("env") or []:
            if "value" in var:
                own[var["name"]] = expand(var["value"], own)
            elif "valueFrom" in var:
                own[var["name"]] = await self._value_from(var["valueFrom"], obj, pod)
            else:
                own[var["name"]] = ""
        return {k: rewrite(v, pod.mounts) for k, v in own.items()}

    def _base_env(self, pod: FakePod) -> dict[str, str]:
        """What the image's environment would give (images/Dockerfile), on this host."""
        return {
            "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
            "HOME": str(pod.host_path("/tmp")),
            "TMPDIR": str(pod.host_path("/tmp")),
            "LANG": "C.UTF-8",
            "MPLBACKEND": "Agg",
            "PYTHONUNBUFFERED": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONPATH": f"{self._state / 'lib'}:{SRC}",
        }

    async def _value_from(self, source: Obj, obj: Obj, pod: FakePod) -> str:
        if "fieldRef" in source:
            return field_value(source["fieldRef"]["fieldPath"], obj, pod.ip)
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            cm = await self._object("configmaps", ref["name"])
            return str((cm.get("data") or {})[ref["key"]])
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            secret = await self._object("secrets", ref["name"])
            return base64.b64decode((secret.get("data") or {})[ref["key"]]).decode()
        return ""  # resourceFieldRef: no limits here

    def _argv(self, container: Obj, own: dict[str, str], mounts: dict[str, Path]) -> list[str]:
        """``own``: the container's variables (env, envFrom), what ``$(VAR)`` may name."""
        command = container.get("command")
        args = container.get("args") or []
        if not command:  # the image's entrypoint, given args or the image's (empty) CMD
            command = ENTRYPOINT
        argv = [expand(a, own) for a in [*command, *args]]
        if _runs_agent(argv) and "--workdir" not in argv:
            argv += AGENT_WORKDIR
        argv = [rewrite(a, mounts) for a in argv]
        if PYTHON_RE.match(Path(argv[0]).name):
            argv[0] = sys.executable
        return argv


def _runs_agent(argv: list[str]) -> bool:
    """``argv`` runs the agent's module (``-m mcs_agent``)."""
    return any(a == "-m" and b == "mcs_agent" for a, b in itertools.pairwise(argv))
