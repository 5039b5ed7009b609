"""The two-tenant harness itself: both tenants work, and each sees only its own sessions."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from mcp_code_sandbox.settings import Settings

from .tenants import structured, two_tenants

pytestmark = [pytest.mark.e2e, pytest.mark.bwrap]


async def test_two_tenants_are_apart(make_settings: Callable[..., Settings]) -> None:
    async with two_tenants(make_settings()) as t:
        ran = await t.run(t.mallory, "x = 1\nprint('m')", session_id="shared-name")
        assert ran["stdout"] == "m\n"
        mine = await t.run(t.victim, "print('x' in globals())", session_id="shared-name")
        assert mine["session_created"] is True and mine["stdout"] == "False\n"
        await t.victim_is_fine()
        listed = structured(await t.mallory.call_tool("list_files", {"session_id": "shared-name"}))
        assert listed["entries"] == []
    assert "owner=mallory" in t.log() and "owner=victim" in t.log()
