"""The seed workflow, end to end: upload a CSV, analyse it with pandas, draw two charts,
get them back as images, list and read files, close the session — over stdio and over
streamable HTTP, with a 2026-07-28 client and with a handshake-era (2025) client, on every
backend (bwrap, docker with runc, docker with runsc)."""

from __future__ import annotations

import base64
import json
from typing import Any

import httpx
import pytest
from mcp import Client, StdioServerParameters
from mcp_types import ImageContent, ResourceLink, TextContent

from ..conftest import each_runtime, valued
from .conftest import ERAS

pytestmark = [pytest.mark.e2e, each_runtime]

SALES = (
    "region,month,revenue\nnorth,jan,120\nsouth,jan,90\nnorth,feb,150\nsouth,feb,80\n"
    "east,jan,60\neast,feb,75\n"
)

CHARTS = """
import matplotlib.pyplot as plt
by_region = df.groupby("region")["revenue"].sum()
fig, ax = plt.subplots()
by_region.plot.bar(ax=ax)
fig.savefig("/mnt/data/chart.png")
plt.figure()
plt.plot(df["revenue"].cumsum())
plt.title("cumulative")
by_region.to_dict()
"""


def structured(result: Any) -> dict[str, Any]:
    assert not result.is_error, result.content
    data = result.structured_content
    assert isinstance(data, dict)
    text = [b for b in result.content if isinstance(b, TextContent)]
    # The same JSON as text, with only the fields that have a value (DESIGN §6).
    assert json.loads(text[0].text) == valued(data)
    return data


async def workflow(client: Client, http_base: str | None = None) -> None:
    """Upload, analyse, chart, read, list, close. ``http_base``: the HTTP server's URL,
    whose download links are fetched too (``None``: stdio, where results carry none)."""
    up = structured(
        await client.call_tool("upload_file", {"filename": "sales.csv", "content_text": SALES})
    )
    assert up["session_created"] is True
    sid = up["session_id"]
    assert up["path"] == "sales.csv" and up["size_bytes"] == len(SALES)

    described = structured(
        await client.call_tool(
            "run_code",
            {
                "session_id": sid,
                "code": "import pandas as pd\ndf = pd.read_csv('sales.csv')\ndf.describe()",
            },
        )
    )
    assert described["status"] == "ok", described
    assert described["session_created"] is False
    assert "count" in described["result"] and "revenue" in described["result"]

    charts = await client.call_tool("run_code", {"session_id": sid, "code": CHARTS})
    data = structured(charts)
    assert data["status"] == "ok", data
    assert data["result"] == str({"east": 135, "north": 270, "south": 170})
    images = [b for b in charts.content if isinstance(b, ImageContent)]
    links = [b for b in charts.content if isinstance(b, ResourceLink)]
    assert len(images) == 2, [type(b).__name__ for b in charts.content]
    for image in images:
        assert image.mime_type == "image/png"
        assert base64.b64decode(image.data).startswith(b"\x89PNG")
    assert [link.name for link in links] == ["chart.png"]
    assert links[0].uri == f"sandbox://{sid}/chart.png"
    link = data["files"][0].pop("download_url")
    assert data["files"] == [
        {
            "path": "chart.png",
            "size_bytes": data["files"][0]["size_bytes"],
            "mime_type": "image/png",
            "change": "created",
        }
    ]
    if http_base is None:
        assert link is None  # over stdio nothing serves files
    else:
        assert link.startswith(f"{http_base}/files/{sid}/chart.png?")
        assert httpx.get(link).content.startswith(b"\x89PNG")

    listing = structured(await client.call_tool("list_files", {"session_id": sid}))
    assert {e["path"] for e in listing["entries"]} >= {"sales.csv", "chart.png"}

    chart = await client.call_tool("read_file", {"session_id": sid, "path": "chart.png"})
    assert structured(chart)["encoding"] == "image"
    assert any(isinstance(b, ImageContent) for b in chart.content)

    csv = await client.call_tool("read_file", {"session_id": sid, "path": "sales.csv"})
    assert structured(csv)["encoding"] == "text"
    assert any(isinstance(b, TextContent) and b.text == SALES for b in csv.content)

    closed = structured(await client.call_tool("close_session", {"session_id": sid}))
    assert closed == {"session_id": sid, "status": "closed"}
    gone = await client.call_tool("list_files", {"session_id": sid})
    assert gone.is_error
    assert (gone.meta or {}).get("error_code") == "session_not_found"


@pytest.mark.parametrize("mode", ERAS)
async def test_workflow_over_stdio(stdio_params: StdioServerParameters, mode: str) -> None:
    async with Client(stdio_params, mode=mode) as client:
        await workflow(client)


@pytest.mark.parametrize("mode", ERAS)
async def test_workflow_over_http(http_base: str, mode: str) -> None:
    async with Client(f"{http_base}/mcp", mode=mode) as client:
        await workflow(client, http_base)


async def test_older_handshake_revision_over_http(
    http_base: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that only speaks 2025-03-26 (n8n-era) still gets the whole workflow."""
    import mcp.client.session as client_session

    monkeypatch.setattr(client_session, "LATEST_HANDSHAKE_VERSION", "2025-03-26")
    async with Client(f"{http_base}/mcp", mode="legacy") as client:
        assert client.protocol_version == "2025-03-26"
        await workflow(client, http_base)
