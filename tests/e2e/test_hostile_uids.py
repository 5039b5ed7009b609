"""Issue 10, finding 5: tenants must not share per-uid kernel counters.

``fs.inotify.max_user_instances`` (128 by default) counts the inotify instances of one
host uid. When every sandbox runs as the same host uid, a session that holds them all
makes every other tenant's ``inotify_init`` fail with EMFILE (file watchers, ``tail -f``,
dev servers, IPython's autoreload extensions...). With one host uid per sandbox the
attacker only exhausts its own.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from mcp_code_sandbox.settings import Settings

from ..conftest import each_runtime
from .tenants import two_tenants

pytestmark = [pytest.mark.e2e, each_runtime]

#: Mallory's cell: open inotify instances until the kernel refuses (EMFILE: the per-user
#: limit; ENFILE/ENOMEM: a host limit), at most 2000, and keep them open in the
#: interpreter (the list lives on in the session's globals).
HOARD = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
held = []
errno_at_end = 0
while len(held) < 2000:
    fd = libc.inotify_init1(os.O_CLOEXEC)
    if fd < 0:
        errno_at_end = ctypes.get_errno()
        break
    held.append(fd)
print(len(held), errno_at_end)
"""

#: The victim's cell: one inotify instance, as any file watcher opens.
ONE = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init1(os.O_CLOEXEC)
print("inotify", "ok" if fd >= 0 else os.strerror(ctypes.get_errno()))
"""


async def test_inotify_instances_are_per_sandbox(make_settings: Callable[..., Settings]) -> None:
    async with two_tenants(make_settings(exec_timeout_s=60)) as t:
        hoard = await t.run(t.mallory, HOARD, session_id="hoard")
        assert hoard["status"] == "ok", hoard
        held, _ = map(int, hoard["stdout"].split())
        assert held > 0, hoard
        # Still held: the interpreter keeps the fds between calls.
        still = await t.run(t.mallory, "print(len(held))", session_id="hoard")
        assert still["stdout"] == f"{held}\n", still

        ran = await t.run(t.victim, ONE, session_id="watcher")
        assert ran["stdout"] == "inotify ok\n", (hoard["stdout"], ran)
        # A second session of mallory's own is a sandbox of its own too.
        own = await t.run(t.mallory, ONE, session_id="second")
        assert own["stdout"] == "inotify ok\n", (hoard["stdout"], own)
        await t.victim_is_fine()
