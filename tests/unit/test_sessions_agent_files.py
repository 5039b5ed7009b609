"""The host's side of the workspace through the agent (sessions/agent_files.py): what a
hostile agent's answers can and cannot make of a file call, and the real agent over its
channel (chunks, pages, refusal during a run). The workspace's rules on both sides are
in test_workspace.py."""

from __future__ import annotations

import asyncio
import base64
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mcp_code_sandbox.backends.base import SandboxSpec
from mcp_code_sandbox.errors import InternalError, InvalidPath, NotFound, SandboxFailed
from mcp_code_sandbox.sessions.agent_client import AgentClient
from mcp_code_sandbox.sessions.agent_files import CHUNK_BYTES, AgentFiles
from tests.fakes import FAKE_LIMITS, FakeBackend, agent_files


async def _blocking(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    return await asyncio.to_thread(fn, *args, **kwargs)


class Scripted:
    """An agent client whose answers the test writes: ``answer(request) -> dict``."""

    def __init__(self, answer: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        self.answer = answer
        self.requests: list[dict[str, Any]] = []

    async def fs(self, message: dict[str, Any]) -> dict[str, Any]:
        self.requests.append(message)
        return {"ev": "fs", "id": 1, **self.answer(message)}


def scripted(answer: Callable[[dict[str, Any]], dict[str, Any]]) -> tuple[AgentFiles, Scripted]:
    client = Scripted(answer)

    async def agent() -> Any:
        return client

    return AgentFiles(agent, quota_bytes=100, blocking=_blocking), client


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


READ = {"ok": True, "size": 3, "mtime_ns": 0, "head": _b64(b"abc")}


@pytest.mark.parametrize(
    "answer",
    [
        {**READ, "data": _b64(b"x" * 11)},  # more than asked for
        {**READ, "data": "not base64!"},
        {**READ, "data": _b64(b"abc"), "size": "3"},
        {**READ, "data": _b64(b"abc"), "size": -1},
        {**READ, "data": _b64(b"abc"), "mtime_ns": True},
        {"ok": True},
    ],
)
async def test_a_malformed_read_answer_fails_the_call(answer: dict[str, Any]) -> None:
    files, _ = scripted(lambda request: answer)
    with pytest.raises(SandboxFailed, match="file answer"):
        await files.read_file("a.txt", max_bytes=10)


async def test_refusals_become_the_servers_errors_with_their_text_cleaned() -> None:
    files, _ = scripted(
        lambda r: {"ok": False, "code": "invalid_path", "message": "'a' is \x1b[31mred"}
    )
    with pytest.raises(InvalidPath) as info:
        await files.read_file("a", max_bytes=1)
    assert "\x1b" not in str(info.value)
    files, _ = scripted(lambda r: {"ok": False, "code": "not_found", "message": "gone"})
    with pytest.raises(NotFound):
        await files.list_files("d")
    files, _ = scripted(lambda r: {"ok": False, "code": "sandbox_escape", "message": "x"})
    with pytest.raises(InternalError):
        await files.usage_bytes()


@pytest.mark.parametrize(
    "answer",
    [
        {"ok": True, "entries": [["a", 0o100644, 1, 0]], "truncated": False, "next": 0},
        {"ok": True, "entries": [["a", "mode", 1, 0]], "truncated": False, "next": None},
        {"ok": True, "entries": [["a", 0o100644, 1]], "truncated": False, "next": None},
        {"ok": True, "entries": {"a": 1}, "truncated": False, "next": None},
        {"ok": True, "entries": [["", 0o100644, 1, 0]], "truncated": False, "next": None},
    ],
)
async def test_a_malformed_page_fails_the_listing(answer: dict[str, Any]) -> None:
    files, _ = scripted(lambda request: answer)
    with pytest.raises(SandboxFailed):
        await files.list_files()


async def test_an_agent_that_sends_more_than_the_limit_is_cut_to_it() -> None:
    many = [[f"f{i}", 0o100644, 1, 0] for i in range(50)]
    files, _ = scripted(lambda r: {"ok": True, "entries": many, "truncated": False, "next": None})
    listing = await files.list_files(limit=10)
    assert len(listing.entries) == 10 and listing.truncated


async def test_pages_are_asked_for_until_the_last(tmp_path: Path) -> None:
    def answer(request: dict[str, Any]) -> dict[str, Any]:
        start = request["start"]
        entry = [f"f{start}", 0o100644, 1, 0]
        return {
            "ok": True,
            "entries": [entry],
            "truncated": False,
            "next": start + 1 if start < 2 else None,
        }

    files, client = scripted(answer)
    listing = await files.list_files()
    assert [e.path for e in listing.entries] == ["f0", "f1", "f2"]
    assert [r["start"] for r in client.requests] == [0, 1, 2]


async def test_an_upload_larger_than_a_chunk_arrives_whole(tmp_path: Path) -> None:
    root = tmp_path / "ws"
    root.mkdir()
    data = os.urandom(CHUNK_BYTES * 2 + 123)
    async with agent_files(root, 1 << 30, _blocking) as files:
        info = await files.write_file("up/big.bin", data, overwrite=False)
        assert info.size_bytes == len(data)
        assert (root / "up" / "big.bin").read_bytes() == data
        read = await files.read_file("up/big.bin", offset=10, max_bytes=len(data))
        assert read.data == data[10:] and read.eof
        stream, opened = await files.open_file("up/big.bin")
        with stream:
            assert stream.read() == data
        assert opened.size_bytes == len(data)
    assert sorted(os.listdir(root / "up")) == ["big.bin"]


async def test_the_agent_refuses_a_file_request_during_a_run(tmp_path: Path) -> None:
    backend = FakeBackend()
    sandbox = await backend.create(SandboxSpec("k", "local", "s", tmp_path, FAKE_LIMITS))
    try:
        channel = sandbox.channel
        run = {"op": "exec", "id": 1, "code": "import time; time.sleep(1)", "timeout_s": 10}
        await channel.send(run)
        await channel.send({"op": "fs", "id": 2, "action": "usage"})
        while True:
            message = await asyncio.wait_for(channel.receive(), 10)
            assert message is not None
            if message.get("id") == 2:
                break
        assert message["ev"] == "error" and "run is in flight" in message["message"]
        while (await asyncio.wait_for(channel.receive(), 10) or {}).get("ev") != "done":
            pass
        answer = await AgentClient(channel).fs({"action": "usage"})
        assert answer["ok"] and answer["bytes"] == 0
    finally:
        await backend.end_all()
