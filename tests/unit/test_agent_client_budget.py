"""The host enforces the result budget again on whatever an agent sends: a hostile peer
on a real socket, speaking the protocol, flooding displays and sending huge texts."""

from __future__ import annotations

import asyncio
import base64
import socket
from typing import Any

from mcp_code_sandbox.agent.budget import MAX_DISPLAYS, Budget
from mcp_code_sandbox.agent.protocol import encode_frame
from mcp_code_sandbox.backends.base import Channel
from mcp_code_sandbox.sessions.agent_client import AgentClient
from mcp_code_sandbox.sessions.executor import Cell

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 100).decode()


async def hostile_agent(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> dict[str, Any]:
    channel = Channel(reader, writer)
    exec_message = await channel.receive()
    assert exec_message is not None
    run = exec_message["id"]
    for _ in range(300):  # 300 displays of 100 KB text, and images beside them
        writer.write(encode_frame({"ev": "display", "id": run, "source": "display",
                                   "data": {"text/markdown": "m" * 100_000}}))  # fmt: skip
        writer.write(encode_frame({"ev": "display", "id": run, "source": "figure",
                                   "data": {"image/png": PNG}}))  # fmt: skip
        await writer.drain()
    huge = "r" * 10_000_000
    error = {"name": "E" * 10_000, "value": huge, "traceback": huge}
    done = {"ev": "done", "id": run, "status": "error", "result": huge, "error": error,
            "cut": {"displays_dropped": -5, "result": "yes"}}  # fmt: skip
    writer.write(encode_frame(done))
    await writer.drain()
    writer.close()
    await writer.wait_closed()
    return exec_message


async def test_the_host_drops_and_cuts_what_a_hostile_agent_sends() -> None:
    ours, theirs = socket.socketpair()
    host_reader, host_writer = await asyncio.open_unix_connection(sock=ours)
    peer = asyncio.create_task(hostile_agent(*await asyncio.open_unix_connection(sock=theirs)))
    client = AgentClient(Channel(host_reader, host_writer))
    budget = Budget(result_bytes=64 * 1024, images=3)
    streams: list[Any] = []
    outcome = await client.execute(
        Cell("python", "x", 30, budget=budget), lambda name, text: streams.append(text)
    )
    sent = await peer
    host_writer.close()
    await host_writer.wait_closed()
    assert sent["budget"] == {"result_bytes": 64 * 1024, "images": 3}
    images = [d for d in outcome.displays if d.mime_type == "image/png"]
    text = sum(len(d.data) for d in outcome.displays if d.mime_type != "image/png")
    assert len(images) == 3
    assert text <= budget.result_bytes and len(outcome.displays) <= MAX_DISPLAYS
    assert outcome.result is not None and len(outcome.result) <= budget.text_chars
    assert outcome.error is not None
    assert len(outcome.error["value"]) <= budget.text_chars
    assert len(outcome.error["name"]) <= 200
    # The agent's own account is checked: a negative count and a non-bool are ignored.
    assert outcome.cut["result"] == 1 and outcome.cut["error"] == 1
    assert outcome.cut["images_dropped"] == 297
    assert outcome.cut["displays_dropped"] + len(outcome.displays) == 303
