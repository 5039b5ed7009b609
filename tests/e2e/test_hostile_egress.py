"""Issue 27, findings 1-3 (the egress proxy), performed over HTTP by ``mallory``'s
code against a server shared with ``victim``: request smuggling, a NAT64 name for the
metadata address, and a flood of connections to the proxy while the victim works. The
server runs in its own process: its descriptors are counted in ``/proc``.
"""

from __future__ import annotations

import asyncio
import json
import os
import textwrap
from collections.abc import Callable

import pytest

from mcp_code_sandbox.egress import limits
from mcp_code_sandbox.egress import proxy as proxy_module
from mcp_code_sandbox.settings import Settings

from ..egress_lab import ASK_PROXY, flood_proxy, naive_upstream
from .tenants import two_tenants

pytestmark = [pytest.mark.e2e]

ASK = ASK_PROXY + "out = {}\n"
FLOOD = flood_proxy(2)


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def test_a_hostile_session_against_its_egress_proxy(
    make_settings: Callable[..., Settings],
) -> None:
    async with naive_upstream() as naive:
        where = f"smuggle.test:{naive.port}"
        network = {
            "SANDBOX_ALLOW_NETWORK": "true",
            "SANDBOX_NETWORK_ALLOW": "smuggle.test,nat64.test,127.0.0.1/32",
            "SANDBOX_NETWORK_RESOLVE": "smuggle.test=127.0.0.1,nat64.test=64:ff9b::a9fe:a9fe",
        }
        async with two_tenants(make_settings(), **network) as t:
            attack = ASK + textwrap.dedent(
                f"""
                smuggled = b"GET /smuggled HTTP/1.1\\r\\nHost: internal.corp\\r\\n\\r\\n"
                body = b"%x\\r\\n%s\\r\\n0\\r\\n\\r\\n" % (len(smuggled), smuggled)
                out["smuggled"] = ask(
                    b"POST http://{where}/ HTTP/1.1\\r\\nHost: {where}\\r\\n"
                    b"Content-Length: 4\\r\\nTransfer-Encoding: chunked\\r\\n\\r\\n" + body
                )
                t = b"nat64.test:443"
                out["nat64"] = ask(b"CONNECT " + t + b" HTTP/1.1\\r\\nHost: " + t + b"\\r\\n\\r\\n")
                print(json.dumps(out))
                """
            )
            ran = await t.run(t.mallory, attack, session_id="m", network=True)
            found = json.loads(ran["stdout"])
            assert found == {
                "smuggled": "HTTP/1.1 400 Bad Request",
                "nat64": "HTTP/1.1 403 Forbidden",
            }
            assert naive.requests == []

            await t.run(t.victim, "print(1)", session_id="v", network=True)
            before = _fds(t.proc.pid)
            flood = asyncio.create_task(
                t.run(
                    t.mallory, ASK + FLOOD + "print(json.dumps(out))", session_id="m", network=True
                )
            )
            peak = before
            while not flood.done() and peak - before < proxy_module.MAX_CONNECTIONS:
                peak = max(peak, _fds(t.proc.pid))
                await asyncio.sleep(0.02)
            victim = await t.run(
                t.victim,
                ASK + f"print(ask(b'GET http://{where}/ HTTP/1.1\\r\\nHost: {where}\\r\\n"
                "Connection: close\\r\\n\\r\\n'))",
                session_id="v",
                network=True,
            )
            while not flood.done():
                peak = max(peak, _fds(t.proc.pid))
                await asyncio.sleep(0.02)
            held = json.loads((await flood)["stdout"])["held"]
            await t.victim_is_fine()
    assert victim["stdout"] == "HTTP/1.1 200 OK\n", victim
    assert held > proxy_module.MAX_CONNECTIONS + proxy_module.REFUSING
    # Slack: the victim's run and connection, the server's own pipes and logs.
    assert peak - before <= proxy_module.MAX_CONNECTIONS + proxy_module.REFUSING + 16, peak


async def test_a_flood_of_refused_requests_is_paced_and_its_log_bounded(
    make_settings: Callable[..., Settings],
) -> None:
    """Finding 7: a sandbox asking for a refused host as fast as it can gets its refusals
    at the proxy's pace, the server logs a bounded number of lines for them, and the other
    tenant is served meanwhile."""
    network = {"SANDBOX_ALLOW_NETWORK": "true", "SANDBOX_NETWORK_ALLOW": "allowed.test"}
    async with two_tenants(make_settings(), **network) as t:
        flood = ASK + textwrap.dedent(
            """
            start = time.monotonic()
            answers = {}
            while time.monotonic() - start < 3:
                got = ask(b"GET http://blocked.test/ HTTP/1.1\\r\\nHost: blocked.test\\r\\n\\r\\n")
                answers[got] = answers.get(got, 0) + 1
            out["answers"] = answers
            out["seconds"] = time.monotonic() - start
            print(json.dumps(out))
            """
        )
        attack = asyncio.create_task(t.run(t.mallory, flood, session_id="m", network=True))
        await t.victim_is_fine()
        found = json.loads((await attack)["stdout"])
        await t.victim_is_fine()
        logged = sum("blocked.test" in line for line in t.log().splitlines())
    answered = sum(found["answers"].values())
    assert set(found["answers"]) == {"HTTP/1.1 403 Forbidden"}, found
    # At most a burst and then the pace, over the seconds the flood lasted.
    bound = limits.REFUSAL_BURST + limits.REFUSALS_PER_S * found["seconds"] + 5
    assert answered <= bound, found
    assert logged <= bound, logged
