"""The worker threads: bounded server-wide, and no owner gets more than half of them."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import anyio
import pytest

from mcp_code_sandbox.sessions.workers import WorkerThreads


class Gate:
    """Blocking work that waits for the test to let it finish, counting who runs."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.lock = threading.Lock()
        self.running = 0
        self.most = 0

    def work(self, value: str) -> str:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            assert self.open.wait(30), "never released"
            return value
        finally:
            with self.lock:
                self.running -= 1


async def until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(4000):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never happened: {what}")


async def test_one_owner_gets_half_and_the_others_the_rest() -> None:
    threads = WorkerThreads(4)
    gate = Gate()
    hogs = [asyncio.create_task(threads.run("mallory", gate.work, f"m{i}")) for i in range(6)]
    await until(lambda: gate.running == 2, "mallory's share busy")
    assert threads.busy("mallory") == 2
    # The victim's work runs at once, though mallory has four calls queued.
    with anyio.fail_after(20):
        assert await threads.run("victim", str.upper, "ok") == "OK"
    gate.open.set()
    assert await asyncio.gather(*hogs) == [f"m{i}" for i in range(6)]
    assert gate.most == 2
    assert threads.busy("mallory") == 0 and threads._shares == {}  # nothing left behind


async def test_the_server_wide_bound_holds_across_owners() -> None:
    threads = WorkerThreads(4)
    gate = Gate()
    calls = [
        asyncio.create_task(threads.run(f"owner{i % 4}", gate.work, str(i))) for i in range(12)
    ]
    await until(lambda: gate.running == 4, "every thread busy")
    await asyncio.sleep(0.05)  # give a fifth a chance to (wrongly) start
    assert gate.running == 4
    gate.open.set()
    await asyncio.gather(*calls)
    assert gate.most == 4


async def test_errors_come_back_and_free_the_slot() -> None:
    threads = WorkerThreads(2)

    def fail() -> None:
        raise OSError("disk on fire")

    for _ in range(3):  # one thread for this owner: a leaked slot would hang the next
        with pytest.raises(OSError, match="disk on fire"), anyio.fail_after(20):
            await threads.run("local", fail)
    assert await threads.run("local", int, "7") == 7


def test_fewer_than_two_threads_is_refused() -> None:
    with pytest.raises(ValueError):
        WorkerThreads(1)
