"""Environment by permission: pass-through variables reach every sandbox, per-call env only
its call, and no value ever shows up where it should not (other processes' command lines,
the state dir, the server's log)."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mcp_code_sandbox.errors import EnvNotAllowed, InvalidArgument
from mcp_code_sandbox.run.request import RunRequest
from mcp_code_sandbox.settings import Settings

from ..conftest import MakeService, each_backend


@pytest.fixture
def secret(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    value = "s3cret-" + secrets.token_hex(12)
    monkeypatch.setenv("MCS_TEST_TOKEN", value)
    yield value


def cmdlines_with(value: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            raw = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if value.encode() in raw:
            found.append(f"{proc.name}: {raw[:200]!r}")
    return found


def files_with(root: Path, value: str, skip: Path | None = None) -> list[str]:
    hits = []
    for path in root.rglob("*"):
        if skip is not None and path.is_relative_to(skip):
            continue
        if path.is_file() and not path.is_symlink():
            try:
                if value.encode() in path.read_bytes():
                    hits.append(str(path))
            except OSError:
                continue
    return hits


@each_backend
async def test_pass_through_env_reaches_the_sandbox_and_nowhere_else(
    make_service: MakeService, secret: str, capfd: pytest.CaptureFixture[str]
) -> None:
    async with make_service(pass_through_env=["MCS_TEST_TOKEN", "MCS_TEST_ABSENT"]) as service:
        settings = service.settings
        report = await service.run_code(
            "local",
            RunRequest(
                "import os\n"
                "print(len(os.environ['MCS_TEST_TOKEN']), 'MCS_TEST_ABSENT' in os.environ)"
            ),
            "env-1",
        )
        assert report.status == "ok", report
        assert report.stdout.split() == [str(len(secret)), "False"]
        # While the sandbox runs: no process's command line carries the value.
        assert cmdlines_with(secret) == []
        workspaces = settings.workspaces_dir
        assert files_with(settings.state_dir, secret, skip=workspaces) == []
    out, err = capfd.readouterr()
    assert secret not in out + err


@each_backend
async def test_call_env_is_refused_unless_allowed(service: Any) -> None:
    with pytest.raises(EnvNotAllowed):
        await service.run_code("local", RunRequest("1", env={"A": "b"}), "env-2")


@each_backend
async def test_call_env_applies_to_that_call_only(
    make_service: MakeService, capfd: pytest.CaptureFixture[str]
) -> None:
    value = "call-" + secrets.token_hex(8)
    async with make_service(allow_call_env=True) as service:

        async def run(code: str, **kw: Any) -> Any:
            return await service.run_code("local", RunRequest(code, **kw), "env-3")

        first = await run("import os\nos.environ.get('CALL_TOKEN')", env={"CALL_TOKEN": value})
        assert first.result == repr(value)
        after = await run("print(os.environ.get('CALL_TOKEN'))")
        assert after.stdout == "None\n"  # the interpreter's environment was restored
        for bad in ("LD_PRELOAD", "PATH", "PYTHONPATH", "NODE_OPTIONS", "ld_preload", "A=B"):
            with pytest.raises(InvalidArgument):
                await run("1", env={bad: "x"})
    out, err = capfd.readouterr()
    assert value not in out + err
    assert "CALL_TOKEN" in out + err  # names are audited, values are not


@pytest.mark.bwrap
def test_pass_through_names_are_validated(make_settings: Callable[..., Settings]) -> None:
    with pytest.raises(Exception, match="PASS_THROUGH_ENV"):
        make_settings(pass_through_env=["BAD=NAME"])
    with pytest.raises(Exception, match="PASS_THROUGH_ENV"):
        make_settings(pass_through_env=["LD_PRELOAD"])
    assert os.environ.get("MCS_TEST_TOKEN") is None
