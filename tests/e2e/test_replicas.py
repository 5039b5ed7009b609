"""Replicas: several HTTP servers on one state directory serve the same sessions.

Real servers (``serve --transport http --replica``) on the docker backend (runc), the
official MCP client, two API tokens. A client sends its calls to either replica, as a
load balancer without affinity would, and gets one session: its variables, files,
execution count and call order; another owner sees nothing of it through either; a
replica killed with SIGKILL loses no session; a rolling restart pauses nothing; the
warm pools of both serve a burst without handing one sandbox to two sessions. Traces
over OTLP show which replica served each call.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import os
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import anyio
import httpx
import pytest
from mcp import Client
from mcp_types import TextContent

from mcp_code_sandbox.settings import Settings

from ..conftest import require_docker
from ..procs import remove_containers_of
from .conftest import free_port, http_server_argv, settings_env
from .tenants import client_as, structured

ALICE = "alice-0123456789abcdef0"
BOB = "bob-0123456789abcdef0123"
TOKENS = f"alice:{ALICE},bob:{BOB}"


@pytest.fixture
def backend() -> str:
    require_docker("runc")
    return "docker"


class Replica:
    """One replica's process, its base URL and its log."""

    def __init__(self, settings: Settings, name: str, **env: str) -> None:
        self.name = name
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = settings.state_dir / f"{name}.log"
        environ = settings_env(
            settings,
            SANDBOX_API_TOKENS=TOKENS,
            SANDBOX_REPLICA="true",
            SANDBOX_KEEP_SESSIONS_ON_SHUTDOWN="",
            # The code under test, when it is not the installed package's (a worktree).
            PYTHONPATH=os.environ.get("PYTHONPATH", ""),
            **env,
        )
        with open(self.log_path, "wb") as log:
            argv = http_server_argv(self.port)
            self.proc = subprocess.Popen(argv, env=environ, stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.base}/healthz", timeout=1).status_code == 200:
                    break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                self.proc.wait()
                raise RuntimeError(f"replica {name} did not start: {self.log()[-3000:]}")
            time.sleep(0.1)
        ready = httpx.get(f"{self.base}/readyz", timeout=30).json()
        self.instance = str(ready["replica"])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        """A clean stop (SIGTERM), as a rolling restart does."""
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


@contextlib.contextmanager
def replicas(settings: Settings, *names: str, **env: str) -> Iterator[list[Replica]]:
    started: list[Replica] = []
    try:
        for name in names:
            started.append(Replica(settings, name, **env))
        yield started
    finally:
        for replica in started:
            with contextlib.suppress(Exception):
                replica.stop()
        remove_containers_of(settings.state_dir)


@contextlib.asynccontextmanager
async def clients(*pairs: tuple[Replica, str]) -> AsyncIterator[list[Client]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(client_as(r.base, token)) for r, token in pairs]


async def run(client: Client, code: str, **args: Any) -> dict[str, Any]:
    return structured(await client.call_tool("run_code", {"code": code, **args}))


class Collector(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP trace receiver: keeps each export request's body."""

    bodies: list[bytes]

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", 0))
        self.bodies.append(self.rfile.read(length))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def otlp_receiver() -> Iterator[tuple[str, Callable[[], list[tuple[str, str, dict[str, Any]]]]]]:
    """An endpoint, and what it has received so far: ``(replica, span name, attributes)``."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    bodies: list[bytes] = []
    handler = type("Handler", (Collector,), {"bodies": bodies})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    def spans() -> list[tuple[str, str, dict[str, Any]]]:
        found = []
        for body in list(bodies):
            request = ExportTraceServiceRequest.FromString(body)
            for resource_spans in request.resource_spans:
                resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope in resource_spans.scope_spans:
                    for span in scope.spans:
                        attributes = {a.key: a.value for a in span.attributes}
                        found.append(
                            (resource.get("service.instance.id", ""), span.name, attributes)
                        )
        return found

    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", spans
    finally:
        server.shutdown()
        server.server_close()


async def test_a_client_alternating_between_replicas_has_one_session(
    make_settings: Callable[..., Settings],
) -> None:
    settings = make_settings()
    with otlp_receiver() as (endpoint, spans):
        otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
        with replicas(settings, "a", "b", **otel) as (a, b):
            async with clients((a, ALICE), (b, ALICE), (a, BOB), (b, BOB)) as both:
                alice_a, alice_b, bob_a, bob_b = both
                await _fifty_calls(alice_a, alice_b)
                await _files_cross(alice_a, alice_b)
                for via, other in ((alice_a, alice_b), (alice_b, alice_a)):
                    await _progress_and_cancel(via, other)
                for bob in (bob_a, bob_b):
                    listed = structured(await bob.call_tool("list_sessions", {}))
                    assert listed["sessions"] == [], listed
                    seen = await bob.call_tool("list_files", {"session_id": "shared"})
                    assert seen.is_error, "bob reached alice's session"
                for alice in (alice_a, alice_b):
                    listed = structured(await alice.call_tool("list_sessions", {}))
                    assert [s["session_id"] for s in listed["sessions"]] == ["shared"]
            assert a.proc.poll() is None and b.proc.poll() is None
            await anyio.sleep(1)  # the exporters' next batch
            served = {(replica, name) for replica, name, _ in spans()}
            for replica in (a, b):
                for name in ("claim session", "agent round trip", "kernel run"):
                    assert (replica.instance, name) in served, (replica.name, name)
                assert (replica.instance, "tools/call run_code") in served
            tagged = [
                attrs["mcs.replica"].string_value
                for _, name, attrs in spans()
                if name == "tools/call run_code" and "mcs.replica" in attrs
            ]
            assert {a.instance, b.instance} <= set(tagged)


async def _fifty_calls(first: Client, second: Client) -> None:
    """50 calls, alternating: variables, execution count and order all hold."""
    await run(first, "order = []", session_id="shared")
    counts = []
    for i in range(50):
        via = second if i % 2 == 0 else first
        out = await run(via, f"order.append({i})\nprint(len(order))", session_id="shared")
        assert out["status"] == "ok" and out["stdout"] == f"{i + 1}\n", out
        assert not out.get("notice"), out  # nothing lost on the way
        counts.append(out["execution_count"])
    assert counts == list(range(counts[0], counts[0] + 50)), counts
    final = await run(first, "order == list(range(50))", session_id="shared")
    assert final["result"] == "True"


async def _files_cross(first: Client, second: Client) -> None:
    up = await first.call_tool(
        "upload_file", {"session_id": "shared", "filename": "in.txt", "content_text": "from a"}
    )
    structured(up)
    out = await run(second, "open('in.txt').read()", session_id="shared")
    assert out["result"] == "'from a'"
    await run(second, "open('out.txt', 'w').write('from b')", session_id="shared")
    read = await first.call_tool("read_file", {"session_id": "shared", "path": "out.txt"})
    assert structured(read)["encoding"] == "text"
    assert any(isinstance(b, TextContent) and b.text == "from b" for b in read.content)


async def _progress_and_cancel(via: Client, other: Client) -> None:
    seen: list[str | None] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append(message)

    code = "import time\nfor i in range(3):\n    print('step', i, flush=True)\n    time.sleep(1)"
    result = await via.call_tool(
        "run_code", {"session_id": "shared", "code": code}, progress_callback=on_progress
    )
    structured(result)
    assert any(m and "step" in m for m in seen), seen
    await run(via, "kept = 'yes'", session_id="shared")
    with anyio.move_on_after(2):
        await via.call_tool(
            "run_code",
            {"session_id": "shared", "code": "import time\ntime.sleep(120)\nkept = 'no'"},
        )
    with anyio.fail_after(30):  # interrupted, not left running: the other replica is served
        after = await run(other, "kept", session_id="shared")
    assert after["result"] == "'yes'" and after["state_lost"] is False


FENCED = """
import urllib.request, urllib.error
try:
    urllib.request.urlopen("http://10.255.255.1/", timeout=20)
except urllib.error.HTTPError as e:
    print(e.code)
"""


async def test_a_session_with_network_keeps_it_and_its_variables_on_either_replica(
    make_settings: Callable[..., Settings],
) -> None:
    settings = make_settings()
    with replicas(settings, "a", "b", SANDBOX_ALLOW_NETWORK="true") as (a, b):
        async with clients((a, ALICE), (b, ALICE)) as (via_a, via_b):
            await run(via_a, "x = 1", session_id="net", network=True)
            for i, via in enumerate((via_b, via_a, via_b)):
                # The proxy answers (a private address is refused with its 403, and
                # named), on whichever replica holds the sandbox: no restart between.
                out = await run(via, FENCED + "x += 1\nprint(x)", session_id="net", network=True)
                assert out["stdout"] == f"403\n{i + 2}\n", out
                assert out["blocked_hosts"] == ["10.255.255.1"] and not out.get("notice"), out


async def test_a_new_session_named_on_both_replicas_at_once_is_one_session(
    make_settings: Callable[..., Settings],
) -> None:
    settings = make_settings()
    with replicas(settings, "a", "b") as (a, b):
        async with clients((a, ALICE), (b, ALICE)) as (via_a, via_b):
            both = await asyncio.gather(
                run(
                    via_a,
                    "seen = globals().setdefault('seen', [])\nseen.append('a')",
                    session_id="new",
                ),
                run(
                    via_b,
                    "seen = globals().setdefault('seen', [])\nseen.append('b')",
                    session_id="new",
                ),
            )
            assert sorted(o["session_created"] for o in both) == [False, True], both
            out = await run(via_a, "sorted(seen)", session_id="new")
            assert out["result"] == "['a', 'b']", out
            listed = structured(await via_b.call_tool("list_sessions", {}))
            assert [s["session_id"] for s in listed["sessions"]] == ["new"]


async def test_a_replica_killed_mid_run_loses_no_session(
    make_settings: Callable[..., Settings],
) -> None:
    settings = make_settings()
    with replicas(settings, "a", "b") as (a, b):
        async with clients((a, ALICE), (b, ALICE)) as (via_a, via_b):
            await run(via_a, "x = 41", session_id="victim")
            await run(via_b, "y = 1", session_id="bystander")
            # b runs a call of its own while a dies in the middle of one.
            long_b = asyncio.ensure_future(
                run(via_b, "import time\ntime.sleep(4)\ny += 1\ny", session_id="bystander")
            )
            long_a = asyncio.ensure_future(
                via_a.call_tool(
                    "run_code", {"session_id": "victim", "code": "import time\ntime.sleep(30)"}
                )
            )
            await asyncio.sleep(1.5)
            a.kill()
            done_b = await asyncio.wait_for(long_b, 60)
            assert done_b["result"] == "2", done_b  # undisturbed
            ready = httpx.get(f"{b.base}/readyz", timeout=30)  # its own readiness only
            assert ready.status_code == 200 and ready.json()["replica"] == b.instance
            long_a.cancel()
            with contextlib.suppress(BaseException):
                await long_a
            with anyio.fail_after(60):
                after = await run(via_b, "x + 1", session_id="victim")
            assert after["result"] == "42", after
            listed = structured(await via_b.call_tool("list_sessions", {}))
            assert sorted(s["session_id"] for s in listed["sessions"]) == ["bystander", "victim"]


async def test_a_rolling_restart_pauses_nothing(make_settings: Callable[..., Settings]) -> None:
    settings = make_settings()
    with replicas(settings, "a", "b") as started:
        a, b = started
        async with clients((a, ALICE), (b, ALICE)) as (via_a, via_b):
            for i, via in enumerate((via_a, via_b, via_a)):
                await run(via, f"v = {i}", session_id=f"s{i}")
        # A new replica first, then the old ones stop cleanly, one after the other.
        started.append(c := Replica(settings, "c"))
        a.stop()
        started.append(d := Replica(settings, "d"))
        b.stop()
        async with clients((c, ALICE), (d, ALICE)) as (via_c, via_d):
            listed = structured(await via_c.call_tool("list_sessions", {}))
            states = {s["session_id"]: s["state"] for s in listed["sessions"]}
            assert states == {"s0": "running", "s1": "running", "s2": "running"}, states
            for i, via in enumerate((via_c, via_d, via_c)):
                out = await run(via, "v", session_id=f"s{i}")
                assert out["result"] == str(i) and out.get("resumed") is None, out
                assert not out.get("notice"), out
        assert "session paused" not in a.log() + b.log()


async def test_an_owners_limit_counts_the_sessions_of_both_replicas(
    make_settings: Callable[..., Settings],
) -> None:
    settings = make_settings()
    with replicas(settings, "a", "b", SANDBOX_MAX_SESSIONS_PER_OWNER="2") as (a, b):
        async with clients((a, ALICE), (b, ALICE)) as (via_a, via_b):
            await run(via_a, "v = 'first'", session_id="s1")
            await run(via_a, "v = 'second'", session_id="s2")
            # A third on the other replica: the longest idle of the two is paused to make
            # room, as on one server, not a third running session.
            await run(via_b, "v = 'third'", session_id="s3")
            listed = structured(await via_a.call_tool("list_sessions", {}))
            states = {s["session_id"]: s["state"] for s in listed["sessions"]}
            assert states == {"s1": "paused", "s2": "running", "s3": "running"}, states
            back = await run(via_b, "v", session_id="s1")
            assert back["result"] == "'first'", back


async def test_both_warm_pools_serve_a_burst_without_double_claims(
    make_settings: Callable[..., Settings],
) -> None:
    settings = make_settings()
    room = {"SANDBOX_MAX_SESSIONS": "20", "SANDBOX_MAX_SESSIONS_PER_OWNER": "20"}
    pools = {"SANDBOX_POOL_SIZE": "3", "SANDBOX_PRELOAD": ""}
    with replicas(settings, "a", "b", **room, **pools) as (a, b):
        await _pool_ready(a, 3)
        await _pool_ready(b, 3)
        async with clients((a, ALICE), (b, BOB)) as (via_a, via_b):
            # Each sandbox marks itself the first time a session runs in it.
            code = (
                "import os\nfirst = not os.path.exists('/tmp/claimed')\n"
                "open('/tmp/claimed', 'w').close()\nfirst"
            )
            outs = await asyncio.gather(*(run(via_a if i % 2 else via_b, code) for i in range(20)))
        assert [o["result"] for o in outs] == ["True"] * 20, outs
        assert len({o["session_id"] for o in outs}) == 20
        hits = _metric(a, "mcp_sandbox_pool_claims_total", 'result="hit"')
        hits += _metric(b, "mcp_sandbox_pool_claims_total", 'result="hit"')
        assert hits >= 2, hits  # both pools served warm sandboxes


async def test_a_replica_with_an_empty_pool_borrows_a_warm_sandbox(
    make_settings: Callable[..., Settings],
) -> None:
    settings = make_settings()
    with replicas(settings, "a", SANDBOX_POOL_SIZE="2", SANDBOX_PRELOAD="") as [a]:
        await _pool_ready(a, 2)
        with replicas(settings, "b", SANDBOX_POOL_SIZE="1", SANDBOX_PRELOAD="") as [b]:
            await _pool_ready(b, 1)
            code = (
                "import os\nfirst = not os.path.exists('/tmp/claimed')\n"
                "open('/tmp/claimed', 'w').close()\nfirst"
            )
            async with clients((b, ALICE)) as [via_b]:
                outs = [await run(via_b, code) for _ in range(2)]  # b's own, then a's
            assert [o["result"] for o in outs] == ["True", "True"], outs
            assert "warm sandbox lent" in a.log()
            hits = _metric(b, "mcp_sandbox_pool_claims_total", 'result="hit"')
            assert hits == 2, hits  # both warm: no cold start


async def _pool_ready(replica: Replica, size: int) -> None:
    with anyio.fail_after(120):
        while httpx.get(f"{replica.base}/readyz", timeout=10).json()["pool"]["ready"] < size:
            await anyio.sleep(0.2)


def _metric(replica: Replica, name: str, label: str) -> float:
    text = httpx.get(f"{replica.base}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name) and label in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_replica_and_a_lone_service_refuse_each_other(
    make_settings: Callable[..., Settings],
) -> None:
    settings = make_settings()
    env = settings_env(
        settings, SANDBOX_API_TOKENS=TOKENS, PYTHONPATH=os.environ.get("PYTHONPATH", "")
    )
    with replicas(settings, "a"):
        lone = subprocess.run(
            http_server_argv(free_port()), env=env, capture_output=True, text=True, timeout=60
        )
        assert lone.returncode == 2
        assert "replicas (SANDBOX_REPLICA=true) serve the state directory" in lone.stderr
    bwrap = {**env, "SANDBOX_BACKEND": "bwrap", "SANDBOX_REPLICA": "true"}
    refused = subprocess.run(
        http_server_argv(free_port()), env=bwrap, capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 2 and "needs the docker backend" in refused.stderr
