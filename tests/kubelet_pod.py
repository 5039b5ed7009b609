"""The pure pieces of the fake kubelet (``tests/kubelet.py``): how a pod's spec becomes a
process's argv and env, and a status; and the process-group helpers it ends pods with."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import ipaddress
import json
import os
import random
import re
import shutil
import socket
import subprocess
from pathlib import Path

from tests.kube_ops import Obj

VAR_RE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
#: How often readiness and a pod's end are checked: an agent listens in tens of ms.
PROBE_EVERY_S = 0.05


def group_members(pgid: int) -> list[tuple[int, int]]:
    """(pid, parent pid) of the live processes of a process group (zombies are gone)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()
        if fields[0] != b"Z" and int(fields[2]) == pgid:
            found.append((int(entry), int(fields[1])))
    return found


async def until_gone(pgid: int, timeout: float) -> None:
    """Wait (at most ``timeout``) until no live process is left in the group."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            while group_members(pgid):
                await asyncio.sleep(PROBE_EVERY_S)


def in_pid_namespace(argv: list[str]) -> list[str]:
    """``argv`` as pid 1 of a pid namespace of its own (with its own /proc), as in a
    container: the agent's ``kill_strays`` then ends only the pod's processes. Where
    no such namespace can be made, a pod whose argv asks for ``kill_strays`` does not
    start: on the host it would SIGKILL every process this user may signal."""
    if prefix := pid_namespace():
        return [*prefix, *argv]
    for arg in argv:
        with contextlib.suppress(ValueError):
            if isinstance(config := json.loads(arg), dict) and config.get("kill_strays"):
                raise ValueError("kill_strays without a pid namespace (unshare failed here)")
    return argv


@functools.cache
def pid_namespace() -> list[str]:
    """The ``unshare`` prefix that works here (as root; else in a user namespace), or []."""
    unshare = shutil.which("unshare")
    base = ["--pid", "--fork", "--mount-proc", "--kill-child"]
    for prefix in ([], ["--map-current-user"]):
        argv = [unshare or "unshare", *prefix, *base]
        try:
            subprocess.run([*argv, "true"], check=True, capture_output=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            continue
        return argv
    return []


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: a defined variable's value, ``$$`` → ``$``, and an
    undefined ``$(VAR)`` left as written."""

    def one(m: re.Match[str]) -> str:
        if m[0] == "$$":
            return "$"
        return env.get(m[1], m[0])

    return VAR_RE.sub(one, text)


def rewrite(text: str, mounts: dict[str, Path]) -> str:
    """``text`` with a leading path in the pod (also after ``--opt=``) made the host's."""
    head, sep, tail = text.partition("=")
    if sep and tail.startswith("/") and not head.startswith("/"):
        return head + sep + rewrite(tail, mounts)
    for mount in sorted(mounts, key=len, reverse=True):
        if text == mount or text.startswith(mount.rstrip("/") + "/"):
            return str(mounts[mount]) + text[len(mount.rstrip("/")) :]
    return text


def field_value(path: str, obj: Obj, ip: str) -> str:
    """A downward API ``fieldRef`` of the pod ``obj`` whose address is ``ip``."""
    meta = obj["metadata"]
    if m := re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path):
        return str((meta.get(m[1]) or {}).get(m[2], ""))
    known = {
        "metadata.name": meta["name"],
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta["uid"],
        "spec.nodeName": obj["spec"].get("nodeName") or "fake-node",
        "spec.serviceAccountName": obj["spec"].get("serviceAccountName") or "default",
        "status.podIP": ip,
        "status.podIPs": ip,
        "status.hostIP": "127.0.0.1",
    }
    if path not in known:
        raise LookupError(f"unsupported fieldRef: {path}")
    return str(known[path])


def fresh_ip(ports: list[int], used: set[str]) -> str:
    """A loopback address not in ``used``, free on ``ports``."""
    while True:
        ip = str(ipaddress.IPv4Address((127 << 24) + random.randrange(256, 1 << 24)))
        if ip in used or ip.endswith((".0", ".255")):
            continue
        try:
            for port in ports:
                with socket.socket() as probe:
                    probe.bind((ip, port))
        except OSError:
            continue
        return ip


def probe_port(container: Obj) -> int | None:
    """The port whose accepting makes the pod Ready; ``None``: ready at once."""
    probe = container.get("readinessProbe") or {}
    action = probe.get("tcpSocket") or probe.get("httpGet")
    ports = container.get("ports") or []
    if action is None:
        if probe:  # an exec probe: not run, ready at once
            return None
        return ports[0]["containerPort"] if ports else None
    port = action["port"]
    if isinstance(port, str):  # a named port
        return int(next(p["containerPort"] for p in ports if p.get("name") == port))
    return int(port)


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def conditions(ready: bool) -> list[Obj]:
    """A pod's conditions: scheduled and initialized, ready or not."""
    moment = now()
    return [
        {"type": t, "status": s, "lastTransitionTime": moment}
        for t, s in (
            ("PodScheduled", "True"),
            ("Initialized", "True"),
            ("ContainersReady", str(ready)),
            ("Ready", str(ready)),
        )
    ]


def running_status(ip: str, pid: int, container: Obj, *, ready: bool) -> Obj:
    """A Running pod's status at ``ip``, its container's process ``pid``."""
    started = now()
    return {
        "phase": "Running",
        "podIP": ip,
        "podIPs": [{"ip": ip}],
        "hostIP": "127.0.0.1",
        "startTime": started,
        "conditions": conditions(ready),
        "containerStatuses": [
            {
                "name": container["name"],
                "image": container.get("image", ""),
                "imageID": "",
                "containerID": f"fake://{pid}",
                "ready": ready,
                "started": True,
                "restartCount": 0,
                "state": {"running": {"startedAt": started}},
            }
        ],
    }


def failed_status(message: str, code: int | None = None, name: str = "") -> Obj:
    """A Failed pod's status; with ``code``, its container ``name`` terminated so."""
    status: Obj = {"phase": "Failed", "message": message, "conditions": conditions(False)}
    if code is not None:
        status["containerStatuses"] = [
            {
                "name": name,
                "ready": False,
                "started": False,
                "restartCount": 0,
                "image": "",
                "imageID": "",
                "state": {
                    "terminated": {
                        "exitCode": code,
                        "finishedAt": now(),
                        "reason": "Error" if code else "Completed",
                    }
                },
            }
        ]
    return status
