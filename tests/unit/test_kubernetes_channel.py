"""The server's end of the Kubernetes agent channel, against the real agent listening on
127.0.0.1: TLS with the server's certificate, the agent's ``ready`` naming the address
dialled, and every failure a ``SandboxFailed``."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from mcp_code_sandbox.backends.kubernetes.certs import write_certs
from mcp_code_sandbox.backends.kubernetes.channel import open_channel, server_context
from mcp_code_sandbox.errors import SandboxFailed
from mcp_code_sandbox.sessions.agent_client import AgentClient
from mcp_code_sandbox.sessions.executor import Cell
from tests.listening_agent import dial, free_port, spawn_agent

#: For connect, TLS and ``ready``: a test agent is up in well under a second.
OPEN_S = 30.0


@pytest.fixture
def files(tmp_path: Path) -> Path:
    out = tmp_path / "certs"
    write_certs(out)
    return out


@pytest.fixture
def tls(files: Path) -> ssl.SSLContext:
    return server_context(files / "server.crt", files / "server.key")


@pytest.fixture
def port(tmp_path: Path, files: Path) -> Iterator[int]:
    """A listening agent, trusting the CA of ``files``, and up."""
    port = free_port()
    proc = spawn_agent(tmp_path, files / "ca.crt", port)
    try:
        dial(port).close()  # listening (that connection is refused: it says nothing)
        yield port
    finally:
        proc.kill()
        proc.wait()


async def test_a_server_opens_the_channel_and_runs_code_through_the_agent_client(
    port: int, tls: ssl.SSLContext
) -> None:
    channel = await open_channel("127.0.0.1", port, tls, OPEN_S)
    try:
        ready = await channel.receive()  # what backends.base.wait_ready reads
        assert ready is not None and ready["ev"] == "ready"
        out: list[str] = []
        outcome = await AgentClient(channel).execute(
            Cell("python", "print(1)", timeout_s=10), lambda name, text: out.append(text)
        )
        assert (outcome.status, "".join(out)) == ("ok", "1\n")
    finally:
        channel.close()


async def test_a_second_server_takes_over_and_finds_the_variables(
    port: int, tls: ssl.SSLContext
) -> None:
    first = await open_channel("127.0.0.1", port, tls, OPEN_S)
    try:
        await first.receive()
        await AgentClient(first).execute(Cell("python", "kept = 41", 10), lambda *_: None)
        second = await open_channel("127.0.0.1", port, tls, OPEN_S)
        try:
            ready = await second.receive()
            assert ready is not None and ready["reattached"] is True
            outcome = await AgentClient(second).execute(
                Cell("python", "kept + 1", 10), lambda *_: None
            )
            assert outcome.result == "42"
        finally:
            second.close()
    finally:
        first.close()


async def test_a_certificate_from_another_ca_fails_as_sandbox_failed(
    port: int, tmp_path: Path
) -> None:
    other = write_certs(tmp_path / "other")
    with pytest.raises(SandboxFailed):
        await open_channel(
            "127.0.0.1", port, server_context(other.server_cert, other.server_key), OPEN_S
        )


@contextlib.asynccontextmanager
async def relay(to_port: int) -> AsyncIterator[tuple[str, int]]:
    """A pod in the middle: it passes a connection meant for it on to another agent."""
    writers: list[asyncio.StreamWriter] = []

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        agent_reader, agent_writer = await asyncio.open_connection("127.0.0.1", to_port)
        writers.extend((writer, agent_writer))
        await asyncio.gather(pipe(reader, agent_writer), pipe(agent_reader, writer))

    server = await asyncio.start_server(on_connection, "127.0.0.3", 0)
    try:
        yield "127.0.0.3", server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for writer in writers:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


async def test_a_connection_relayed_to_another_agent_is_caught_by_its_ready(
    port: int, tls: ssl.SSLContext
) -> None:
    async with relay(port) as (host, relay_port):
        with pytest.raises(SandboxFailed, match="another address"):
            await open_channel(host, relay_port, tls, OPEN_S)


async def test_nothing_listening_fails_as_sandbox_failed(tls: ssl.SSLContext) -> None:
    with pytest.raises(SandboxFailed):
        await open_channel("127.0.0.1", free_port(), tls, OPEN_S)


async def test_a_peer_that_never_answers_times_out_as_sandbox_failed(
    tls: ssl.SSLContext,
) -> None:
    held: list[asyncio.StreamWriter] = []
    silent = await asyncio.start_server(lambda _, writer: held.append(writer), "127.0.0.1", 0)
    try:
        with pytest.raises(SandboxFailed, match="no ready"):
            await open_channel("127.0.0.1", silent.sockets[0].getsockname()[1], tls, 0.5)
    finally:
        for writer in held:
            writer.close()
        silent.close()


def test_the_server_context_refuses_a_key_that_is_not_its_certificates(
    files: Path, tmp_path: Path
) -> None:
    other = write_certs(tmp_path / "other")
    with pytest.raises(ssl.SSLError):
        server_context(files / "server.crt", other.server_key)
