"""Runner images on the docker backend: images labelled ``sandbox.runner=true`` become
languages, share the session's workspace, and clients hear when the tool list changes.

The runner images here are built FROM the sandbox image (so no registry is needed) and
offer Perl, which every Debian-based image has (perl-base is essential).
"""

from __future__ import annotations

import contextlib
import io
import json
import secrets
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import docker
import pytest
from mcp import Client
from mcp_types import ToolListChangedNotification

from mcp_code_sandbox.run.languages import RUNTIMES
from mcp_code_sandbox.settings import Settings, docker_environ

from ..conftest import docker_image
from .conftest import held, http_server

pytestmark = [pytest.mark.e2e, pytest.mark.docker]

docker_only = pytest.mark.parametrize("backend", ["docker"], indirect=True)

PERL_LABELS = {
    "sandbox.runner": "true",
    "sandbox.language": "perl",
    "sandbox.command": json.dumps(["perl", "{file}"]),
    "sandbox.extension": ".pl",
    "sandbox.version": "5",
}


@pytest.fixture
def engine() -> Iterator[Any]:
    client = docker.from_env(environment=docker_environ())
    yield client
    client.close()


@pytest.fixture
def build_runner(engine: Any) -> Iterator[Callable[[dict[str, str]], str]]:
    """Build a runner image with these labels on the sandbox image; removed afterwards."""
    tags: list[str] = []

    def build(labels: dict[str, str]) -> str:
        tag = f"mcs-test-runner-{secrets.token_hex(4)}:1"
        label_args = " ".join(f"{k}={json.dumps(v)}" for k, v in labels.items())
        dockerfile = f"FROM {docker_image()}\nLABEL {label_args}\n"
        engine.images.build(fileobj=io.BytesIO(dockerfile.encode()), tag=tag, rm=True)
        tags.append(tag)
        return tag

    yield build
    for tag in tags:
        remove_image(engine, tag)


def remove_image(engine: Any, tag: str) -> None:
    with contextlib.suppress(docker.errors.ImageNotFound):
        engine.images.remove(tag, force=True)


def language_enum(tools: Any) -> list[str]:
    run = next(t for t in tools.tools if t.name == "run_code")
    return list(run.input_schema["properties"]["language"]["enum"])


async def call(client: Client, **arguments: Any) -> dict[str, Any]:
    result = await client.call_tool("run_code", arguments)
    assert not result.is_error, result.content
    assert result.structured_content is not None
    return result.structured_content


def session_containers(engine: Any, session_id: str) -> list[Any]:
    return list(
        engine.containers.list(
            all=True, filters={"label": f"mcp-code-sandbox.session={session_id}"}
        )
    )


@docker_only
async def test_a_runner_image_is_a_language_that_shares_the_workspace(
    service: Any, engine: Any, build_runner: Callable[[dict[str, str]], str]
) -> None:
    from mcp_code_sandbox.server.app import build_server

    changed = anyio.Event()

    async def on_message(message: Any) -> None:
        if isinstance(message, ToolListChangedNotification):
            changed.set()

    def connect() -> Client:
        return Client(build_server(service), mode="legacy", message_handler=on_message)

    async with held(connect) as client:
        tools_capability = client.server_capabilities.tools
        assert tools_capability is not None and tools_capability.list_changed
        assert language_enum(await client.list_tools()) == list(RUNTIMES)

        tag = build_runner(PERL_LABELS)
        runtimes = (await client.call_tool("list_runtimes", {})).structured_content
        perl = [r for r in runtimes["runtimes"] if r["language"] == "perl"]
        assert perl and perl[0]["image"] == tag and perl[0]["version"] == "5"
        assert perl[0]["stateful"] is False and perl[0]["backend"] == "docker"
        with anyio.fail_after(10):
            await changed.wait()
        assert language_enum(await client.list_tools()) == [*RUNTIMES, "perl"]

        # Python writes, Perl reads and writes, Python reads: one workspace.
        first = await call(client, code="open('a.txt', 'w').write('from python')")
        sid = first["session_id"]
        perl_code = (
            'open(my $in, "<", "a.txt") or die; my $t = <$in>; print "perl saw: $t\\n";\n'
            'open(my $out, ">", "b.txt") or die; print $out "from perl"; close $out;\n'
            'print "uid=$<\\n"; print STDERR "to stderr\\n";'
        )
        ran = await call(client, session_id=sid, language="perl", code=perl_code)
        assert ran["status"] == "ok" and ran["exit_code"] == 0
        assert "perl saw: from python" in ran["stdout"]
        # As the session's own host uid, as its main container: they share the workspace.
        [session] = service.sessions.table
        assert f"uid={session.uid}\n" in ran["stdout"] and "to stderr" in ran["stderr"]
        assert ran["language"] == "perl" and ran["state_lost"] is False
        assert [(f["path"], f["change"]) for f in ran["files"]] == [("b.txt", "created")]
        back = await call(client, session_id=sid, code="open('b.txt').read()")
        assert back["result"] == "'from perl'"
        # The code file never lands in the workspace.
        listed = (await client.call_tool("list_files", {"session_id": sid})).structured_content
        assert {e["path"] for e in listed["entries"]} == {"a.txt", "b.txt"}

        # A failing program is a normal result with its exit code.
        failed = await call(client, session_id=sid, language="perl", code='die "boom\\n";')
        assert failed["status"] == "error" and failed["exit_code"] == 255
        assert "boom" in failed["stderr"]

        # A timeout kills it; the next call gets a fresh container, files intact.
        slow = await call(client, session_id=sid, language="perl", code="sleep 60;", timeout_s=2)
        assert slow["status"] == "timeout" and slow["error"]["name"] == "Timeout"
        again = await call(client, session_id=sid, language="perl", code='print -s "b.txt";')
        assert again["status"] == "ok" and again["stdout"] == "9"

        assert len(session_containers(engine, sid)) == 2  # the agent's and perl's
        closed = await client.call_tool("close_session", {"session_id": sid})
        assert not closed.is_error
        assert session_containers(engine, sid) == []

        # The image goes away: the language too, and clients hear of it again.
        changed = anyio.Event()
        remove_image(engine, tag)
        await client.call_tool("list_runtimes", {})
        with anyio.fail_after(10):
            await changed.wait()
        assert language_enum(await client.list_tools()) == list(RUNTIMES)
        gone = await client.call_tool("run_code", {"code": "print(1);", "language": "perl"})
        assert gone.is_error
        assert gone.meta and gone.meta["error_code"] == "unsupported_language"


@docker_only
async def test_a_new_image_is_found_by_the_first_call_that_names_its_language(
    service: Any, build_runner: Callable[[dict[str, str]], str]
) -> None:
    build_runner(PERL_LABELS)
    from mcp_code_sandbox.run.request import RunRequest

    report = await service.run_code("local", RunRequest('print "hi";', language="perl"))
    assert report.status == "ok" and report.stdout == "hi"


@docker_only
async def test_images_that_cannot_be_runners_are_left_out(
    service: Any, build_runner: Callable[[dict[str, str]], str]
) -> None:
    build_runner({**PERL_LABELS, "sandbox.language": "python"})  # the agent's language
    build_runner({**PERL_LABELS, "sandbox.language": "Bad Name"})
    build_runner({**PERL_LABELS, "sandbox.command": '["perl"]'})  # no {file}
    runtimes = await service.runtimes()
    assert [r["language"] for r in runtimes] == list(RUNTIMES)
    python = runtimes[0]
    assert python["image"] == service.settings.image  # still the default image's agent


@docker_only
async def test_sandbox_image_replaces_the_default_image(
    make_settings: Callable[..., Settings], engine: Any
) -> None:
    from mcp_code_sandbox.backends import create_backend
    from mcp_code_sandbox.run.request import RunRequest
    from mcp_code_sandbox.service import SandboxService

    tag = f"mcs-test-default-{secrets.token_hex(4)}:1"
    engine.images.get(docker_image()).tag(tag)
    try:
        settings = make_settings(image=tag)
        service = SandboxService(settings, create_backend(settings))
        await service.start()
        try:
            report = await service.run_code("local", RunRequest("1 + 1"))
            assert report.result == "2"
            runtimes = await service.runtimes()
            assert [r["language"] for r in runtimes] == list(RUNTIMES)
            assert all(r["image"] == tag for r in runtimes)  # one image, all its languages
            (container,) = session_containers(engine, report.session_id)
            assert tag in container.image.tags
        finally:
            await service.aclose()
    finally:
        remove_image(engine, tag)


@docker_only
async def test_listening_clients_of_the_2026_era_hear_the_change(
    make_settings: Callable[..., Settings], build_runner: Callable[[dict[str, str]], str]
) -> None:
    with http_server(make_settings()) as base:
        async with Client(f"{base}/mcp", mode="2026-07-28") as client:
            async with client.listen(tools_list_changed=True) as events:
                build_runner(PERL_LABELS)
                await client.call_tool("list_runtimes", {})
                with anyio.fail_after(10):
                    event = await events.__anext__()
            assert type(event).__name__ == "ToolsListChanged"
            assert "perl" in language_enum(await client.list_tools())


@docker_only
async def test_a_runner_image_removed_since_it_was_found_fails_the_call_clearly(
    service: Any, engine: Any, build_runner: Callable[[dict[str, str]], str]
) -> None:
    from mcp_code_sandbox.errors import SandboxFailed
    from mcp_code_sandbox.run.request import RunRequest

    tag = build_runner(PERL_LABELS)
    assert "perl" in [r["language"] for r in await service.runtimes()]
    remove_image(engine, tag)
    with pytest.raises(SandboxFailed, match="is gone"):
        await service.run_code("local", RunRequest('print "hi";', language="perl"))
    assert "perl" not in [r["language"] for r in await service.runtimes()]


@docker_only
async def test_a_language_the_image_lacks_is_refused_and_then_not_offered(
    make_settings: Callable[..., Settings], engine: Any
) -> None:
    from mcp_code_sandbox.backends import create_backend
    from mcp_code_sandbox.errors import UnsupportedLanguage
    from mcp_code_sandbox.run.request import RunRequest
    from mcp_code_sandbox.service import SandboxService

    # An image whose labels say nothing about JavaScript and whose agent finds no node.
    tag = f"mcs-test-nonode-{secrets.token_hex(4)}:1"
    dockerfile = f"FROM {docker_image()}\nUSER root\nRUN rm -rf /opt/sandbox/node\nUSER 1000:1000\n"
    engine.images.build(fileobj=io.BytesIO(dockerfile.encode()), tag=tag, rm=True)
    try:
        settings = make_settings(image=tag)
        service = SandboxService(settings, create_backend(settings))
        await service.start()
        try:
            assert "javascript" in service.languages()  # nothing says otherwise yet
            with pytest.raises(UnsupportedLanguage, match="no interpreter for 'javascript'"):
                await service.run_code("local", RunRequest("console.log(1)", language="javascript"))
            assert "javascript" not in service.languages()
            assert "python" in service.languages()
        finally:
            await service.aclose()
    finally:
        remove_image(engine, tag)


@docker_only
async def test_a_runner_language_is_refused_network_clearly(
    make_service: Any, build_runner: Callable[[dict[str, str]], str]
) -> None:
    """A runner image has no agent to bridge the egress proxy into its container: network
    for it is refused before any session, saying so (network_not_allowed)."""
    from mcp_code_sandbox.errors import NetworkNotAllowed
    from mcp_code_sandbox.run.request import RunRequest

    build_runner(PERL_LABELS)
    async with make_service(allow_network=True, network_allow="pypi") as svc:
        with pytest.raises(NetworkNotAllowed, match="runner image"):
            await svc.run_code("local", RunRequest("print 1", "perl", network=True), "rn-net")
        assert svc.sessions.count() == 0
        ran = await svc.run_code("local", RunRequest('print "ok"', "perl"), "rn-net")
        assert ran.stdout == "ok"
