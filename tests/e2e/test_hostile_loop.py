"""Issue 10, finding 3: one tenant's call must not freeze the server for everyone; and
finding 9: a bound never cuts a file silently (at the end of this file).

``mallory`` fills a session with ~150,000 files and four 7900x7900 PNGs (numpy + PIL, and a
matplotlib figure), then makes the server work on them: the run that returns the images,
``read_file`` of one, an upload (its quota walk), a listing. Meanwhile ``victim`` keeps
asking ``/healthz`` (answered by the event loop and nothing else) and makes tool calls.
On main every image was decoded and re-encoded by Pillow on the event loop, so a victim's
``/healthz`` waited 12-17 s; the walks cost every client about a second more.

The assertion is on the event loop's lag as the victim sees it (the longest ``/healthz``
round trip while mallory's calls are in flight), with a bound far above anything a loaded
machine adds to an idle loop and far below what a blocked loop costs.
"""

from __future__ import annotations

import ast
import asyncio
import base64
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import pytest
from mcp import Client, MCPError, StdioServerParameters
from mcp_types import BlobResourceContents, EmbeddedResource

from mcp_code_sandbox.settings import Settings

from ..conftest import each_backend
from .conftest import ERAS
from .tenants import Tenants, structured, two_tenants

pytestmark = [pytest.mark.e2e, pytest.mark.bwrap]

#: The longest a victim's ``/healthz`` may wait while mallory's calls run: an idle loop
#: answers in milliseconds even on a loaded 2-core machine; main took 12 s and more.
LAG_LIMIT_S = 3.0
JUNK_FILES = 150_000

MANY_FILES = f"""
import os
root = '.packages/junk'   # hidden from files[] (keeps the result small), walked by the quota
for d in range({JUNK_FILES} // 1000):
    os.makedirs(f'{{root}}/{{d}}', exist_ok=True)
    for i in range(1000):
        open(f'{{root}}/{{d}}/{{i}}', 'w').close()
print(sum(len(files) for _, _, files in os.walk(root)))
"""

# 62.4 megapixels each: under Pillow's bomb limit (89 MP), so main decoded them whole. A
# band of noise makes each file bigger than the image budget (so it must be re-encoded)
# and smaller than the 20 MiB past which images are only linked; huge0 is under 1 MiB, so
# read_file takes it whole.
HUGE_IMAGES = """
import numpy as np
from PIL import Image
import matplotlib
matplotlib.use('Agg')
import matplotlib.pyplot as plt
side = 7900
for n, rows in enumerate((90, 600, 1200)):
    pixels = np.zeros((side, side), dtype=np.uint8)
    pixels[:rows] = np.random.randint(0, 256, (rows, side), dtype=np.uint8)
    Image.fromarray(pixels).save(f'huge{n}.png', compress_level=1)
    del pixels
fig = plt.figure(figsize=(79, 79), dpi=100)
plt.plot(np.random.rand(20000))
fig.savefig('huge3.png')
plt.close(fig)
import os
print(sorted((name, os.path.getsize(name)) for name in os.listdir('.') if name.endswith('.png')))
"""


@dataclass
class Watch:
    """What the victim saw while mallory's calls were in flight: each ``/healthz`` as
    (sent, answered), monotonic; the slowest of each kind of tool call."""

    healthz: list[tuple[float, float]] = field(default_factory=list)
    calls_s: dict[str, float] = field(default_factory=dict)

    def call(self, kind: str, started: float) -> None:
        self.calls_s[kind] = max(self.calls_s.get(kind, 0.0), time.monotonic() - started)

    def worst(self, start: float = 0.0, end: float = float("inf")) -> float:
        """The longest ``/healthz`` wait of those in flight at some time in [start, end]."""
        waits = [done - sent for sent, done in self.healthz if sent <= end and done >= start]
        return max(waits, default=0.0)


async def probe_healthz(base: str, stop: asyncio.Event, watch: Watch) -> None:
    """One ``/healthz`` at a time until ``stop``; each round trip recorded (the one in
    flight when ``stop`` comes is finished and counted: it may be the slowest)."""
    async with httpx.AsyncClient(timeout=300) as http:
        while not stop.is_set():
            sent = time.monotonic()
            response = await http.get(f"{base}/healthz")
            assert response.status_code == 200, response.text
            watch.healthz.append((sent, time.monotonic()))
            await asyncio.sleep(0.05)


async def victim_calls(t: Tenants, stop: asyncio.Event, watch: Watch) -> None:
    """The victim's own tool calls, again and again while mallory works."""
    while not stop.is_set():
        started = time.monotonic()
        runtimes = structured(await t.victim.call_tool("list_runtimes", {}))
        assert runtimes["runtimes"], runtimes
        watch.call("list_runtimes", started)
        started = time.monotonic()
        ran = await t.run(t.victim, "print(6 * 7)", session_id="victim-canary")
        assert ran["stdout"] == "42\n", ran
        watch.call("run_code", started)
        await asyncio.sleep(0.2)


async def mallory_calls(t: Tenants, session: str) -> dict[str, tuple[float, float]]:
    """The calls that made the server work for everyone: when each ran (monotonic)."""
    phases: dict[str, tuple[float, float]] = {}
    started = time.monotonic()
    ran = await t.run(t.mallory, HUGE_IMAGES, session_id=session, timeout_s=120)
    phases["run_code (4 huge PNGs)"] = (started, time.monotonic())
    assert ran["status"] == "ok", (ran["error"], ran["stderr"][-2000:])
    # Not decoded, yet nothing is hidden: every file is listed, and the result says why
    # there is no preview.
    assert {f"huge{n}.png" for n in range(4)} <= {f["path"] for f in ran["files"]}, ran
    assert "not decoded" in (ran["notice"] or ""), ran["notice"]
    started = time.monotonic()
    read = structured(
        await t.mallory.call_tool("read_file", {"session_id": session, "path": "huge0.png"})
    )
    phases["read_file huge0.png"] = (started, time.monotonic())
    assert read["encoding"] == "resource" and "no preview" in read["notice"], read
    started = time.monotonic()
    up = {"session_id": session, "filename": "up.txt", "content_text": "x", "overwrite": True}
    structured(await t.mallory.call_tool("upload_file", up))
    phases["upload_file (quota walk)"] = (started, time.monotonic())
    started = time.monotonic()
    # One directory of 1,000: a listing of 10,000 entries is over 1 MiB, which the
    # official client refuses over SSE (a result-budget matter, not this test's).
    listed = {"session_id": session, "path": ".packages/junk/7", "recursive": True}
    structured(await t.mallory.call_tool("list_files", listed))
    phases["list_files"] = (started, time.monotonic())
    return phases


@each_backend
async def test_one_tenants_heavy_call_does_not_freeze_the_others(
    make_settings: Callable[..., Settings],
) -> None:
    settings = make_settings()
    env = {
        "SANDBOX_MEMORY_LIMIT": "2g",  # the 7900x7900 figure is 250 MB in matplotlib
        "SANDBOX_MAX_IMAGE_BYTES": "100000",  # every huge PNG is over it: re-encoded on main
        "SANDBOX_EXEC_TIMEOUT_S": "120",
        # A workspace filesystem has one inode per 8 KiB of quota (workspace/volume.py):
        # 150,000 files need more than the default 1 GiB's 131,072.
        "SANDBOX_WORKSPACE_QUOTA_BYTES": "2g",
    }
    async with two_tenants(settings, **env) as t:
        made = await t.run(t.mallory, MANY_FILES, session_id="heavy", timeout_s=120)
        assert made["stdout"].strip() == str(JUNK_FILES), made
        await t.victim_is_fine()
        watch = Watch()
        stop = asyncio.Event()
        probes = [
            asyncio.create_task(probe_healthz(t.base, stop, watch)),
            asyncio.create_task(victim_calls(t, stop, watch)),
        ]
        try:
            phases = await mallory_calls(t, "heavy")
        finally:
            stop.set()
            await asyncio.gather(*probes)
        await t.victim_is_fine()
    report = "; ".join(
        f"{name}: {end - start:.2f} s, victim's worst /healthz {watch.worst(start, end):.3f} s"
        for name, (start, end) in phases.items()
    )
    calls = ", ".join(f"{kind} {took:.3f} s" for kind, took in watch.calls_s.items())
    report += f"; victim's slowest calls: {calls}; {len(watch.healthz)} /healthz probes"
    print(report)
    assert watch.worst() < LAG_LIMIT_S, report


# --- finding 9: bounded, but never silently cut ----------------------------------------

MAKE_FILES = """
import hashlib, os
def make(name, data):
    open(name, 'wb').write(data)
    return hashlib.sha256(data).hexdigest()
sums = {
    'big.bin': make('big.bin', os.urandom(5 * 1024 * 1024)),
    'report.pdf': make('report.pdf', b'%PDF-1.7\\n' + os.urandom(1_300_000)),
    'table.csv': make('table.csv', b''.join(b'%d,%d\\n' % (i, i * i) for i in range(150_000))),
    'small.pdf': make('small.pdf', b'%PDF-1.7\\n' + os.urandom(200_000)),
}
print(sums)
"""


async def make_files(client: Client, session: str) -> dict[str, str]:
    ran = structured(
        await client.call_tool("run_code", {"code": MAKE_FILES, "session_id": session})
    )
    assert ran["status"] == "ok", ran
    sums: dict[str, str] = ast.literal_eval(ran["stdout"])
    return sums


async def fetch_by_pages(client: Client, session: str, path: str) -> tuple[bytes, int]:
    """The whole file through read_file, page after page; and how many pages it took."""
    got, offset, pages = b"", 0, 0
    while True:
        page = await client.call_tool(
            "read_file", {"session_id": session, "path": path, "offset": offset}
        )
        info = structured(page)
        block = page.content[1]
        assert isinstance(block, EmbeddedResource), block
        assert isinstance(block.resource, BlobResourceContents)
        data = base64.b64decode(block.resource.blob)
        assert info["encoding"] == "resource" and info["returned_bytes"] == len(data) > 0
        got += data
        pages += 1
        if info["eof"]:
            assert info["next_offset"] is None and len(got) == info["size_bytes"]
            return got, pages
        assert info["next_offset"] == offset + len(data)
        offset = info["next_offset"]


async def assert_whole_or_refused(client: Client, uri: str, digest: str) -> str:
    """A resource read returns the whole file (same hash) or fails with
    artifact_too_large; never a part of it as if it were all. Which one, it returns."""
    try:
        read = await client.read_resource(uri)
    except MCPError as exc:
        assert exc.data and exc.data["error_code"] == "artifact_too_large", exc.error
        assert exc.message.startswith("artifact_too_large: ") and "read_file" in exc.message
        return "refused"
    content = read.contents[0]
    if isinstance(content, BlobResourceContents):
        data = base64.b64decode(content.blob)
    else:
        data = content.text.encode()
    assert hashlib.sha256(data).hexdigest() == digest, f"{uri}: {len(data)} bytes, cut"
    return "whole"


@pytest.mark.parametrize("mode", ERAS)
async def test_over_stdio_a_5_mb_binary_comes_whole_by_pages(
    stdio_params: StdioServerParameters, mode: str
) -> None:
    async with Client(stdio_params, mode=mode) as client:
        sums = await make_files(client, "eda")
        seen = {
            path: await assert_whole_or_refused(client, f"sandbox://eda/{path}", sums[path])
            for path in ("report.pdf", "table.csv", "small.pdf")
        }
        assert seen == {"report.pdf": "refused", "table.csv": "refused", "small.pdf": "whole"}
        data, pages = await fetch_by_pages(client, "eda", "big.bin")
        assert hashlib.sha256(data).hexdigest() == sums["big.bin"] and pages > 5
        pdf, _ = await fetch_by_pages(client, "eda", "report.pdf")
        assert hashlib.sha256(pdf).hexdigest() == sums["report.pdf"]


async def test_over_http_resources_are_whole_or_refused_with_a_link(
    make_settings: Callable[..., Settings],
) -> None:
    async with two_tenants(make_settings()) as t:
        sums = await make_files(t.mallory, "eda")
        with pytest.raises(MCPError) as refused:
            await t.mallory.read_resource("sandbox://eda/report.pdf")
        url = refused.value.data["download_url"]
        assert url in refused.value.message and url.startswith(f"{t.base}/files/eda/report.pdf?")
        got = httpx.get(url, timeout=60)
        assert hashlib.sha256(got.content).hexdigest() == sums["report.pdf"]
        # Pages of the default size, each under the official client's 1 MiB SSE limit.
        data, _ = await fetch_by_pages(t.mallory, "eda", "big.bin")
        assert hashlib.sha256(data).hexdigest() == sums["big.bin"]
        small = await assert_whole_or_refused(
            t.mallory, "sandbox://eda/small.pdf", sums["small.pdf"]
        )
        assert small == "whole"
        # And the other tenant gets nothing of it, whole or in part.
        with pytest.raises(MCPError, match="session_not_found"):
            await t.victim.read_resource("sandbox://eda/small.pdf")
        # Each lists its own files as resources, never the other's.
        mine = (await t.mallory.list_resources()).resources
        assert "sandbox://eda/small.pdf" in {str(r.uri) for r in mine}
        theirs = (await t.victim.list_resources()).resources
        assert not any(str(r.uri).startswith("sandbox://eda/") for r in theirs)
        await t.victim_is_fine()
