"""Sessions that outlive their server (issue 13), through the real HTTP server and the
official MCP client: a clean stop pauses every session (the HTTP default), the next
server gives each back on its first call, and ``list_sessions`` shows a caller its own
sessions only, running or paused, with the variables a pause saved."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from mcp_code_sandbox.settings import Settings

from .conftest import http_server_process
from .tenants import client_as, structured

pytestmark = [pytest.mark.e2e, pytest.mark.bwrap]

ALICE = "alice-0123456789abcdef"
BOB = "bob-0123456789abcdef00"
TOKENS = f"alice:{ALICE},bob:{BOB}"
#: The server's own default for keeping sessions at a stop (HTTP: keep), and two owners.
SERVER = {"SANDBOX_KEEP_SESSIONS_ON_SHUTDOWN": "", "SANDBOX_API_TOKENS": TOKENS}

STATE = """
import math
v = {value}
def tenfold():
    return v * 10
open("f{value}.txt", "w").write("x")
"""


def sessions(result: Any) -> dict[str, dict[str, Any]]:
    return {s["session_id"]: s for s in structured(result)["sessions"]}


async def test_a_cleanly_restarted_http_server_gives_every_session_back(
    make_settings: Callable[..., Settings],
) -> None:
    settings = make_settings()
    with http_server_process(settings, **SERVER) as (base, proc):
        async with client_as(base, ALICE) as alice, client_as(base, BOB) as bob:
            for value, sid in ((1, "one"), (2, "two")):
                made = structured(
                    await alice.call_tool(
                        "run_code", {"session_id": sid, "code": STATE.format(value=value)}
                    )
                )
                assert made["status"] == "ok", made
            structured(await bob.call_tool("run_code", {"session_id": "bobs", "code": "w = 3"}))
            listed = sessions(await alice.call_tool("list_sessions", {}))
            assert sorted(listed) == ["one", "two"]
            assert {s["state"] for s in listed.values()} == {"running"}
            assert listed["one"]["file_count"] == 1 and listed["one"]["workspace_bytes"] > 0
    assert proc.returncode is not None  # SIGTERM: a clean stop, which paused every session
    saved = [json.loads(p.read_text()) for p in settings.sessions_dir.glob("*.json")]
    assert sorted(r["session_id"] for r in saved) == ["bobs", "one", "two"]
    assert all(r["paused"]["kind"] == "variables" for r in saved), saved

    with http_server_process(settings, **SERVER) as (base, _proc):
        async with client_as(base, ALICE) as alice, client_as(base, BOB) as bob:
            listed = sessions(await alice.call_tool("list_sessions", {}))
            assert sorted(listed) == ["one", "two"]  # never bob's
            one = listed["one"]
            assert one["state"] == "paused"
            names = {(v["name"], v["type"]) for v in one["saved_variables"]}
            assert {("v", "int"), ("tenfold", "function"), ("math", "module math")} <= names
            assert sessions(await bob.call_tool("list_sessions", {})).keys() == {"bobs"}
            back = structured(
                await alice.call_tool(
                    "run_code",
                    {
                        "session_id": "one",
                        "code": "import os\n(tenfold(), [n for n in os.listdir() if n[0] != '.'])",
                    },
                )
            )
            assert back["session_created"] is False and back["resumed"] == "variables", back
            assert back["result"] == "(10, ['f1.txt'])"
            assert back.get("notice") is None, back
            theirs = structured(
                await bob.call_tool("run_code", {"session_id": "bobs", "code": "w"})
            )
            assert (theirs["result"], theirs["resumed"]) == ("3", "variables")
            listed = sessions(await alice.call_tool("list_sessions", {}))
            assert (listed["one"]["state"], listed["two"]["state"]) == ("running", "paused")
