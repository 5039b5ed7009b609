"""The server's own look at what its sandboxes offer: languages and their versions.

``list_runtimes`` (and run_code's ``language`` enum) is one answer for every owner, so it
must not come from a tenant's sandbox: a session's workspace is the tenant's to write
(a ``bash`` planted in ``.packages/python/bin``, a ``.pth`` file the kernel runs), and
once its code ran, so is its agent. Instead the server starts one sandbox of its own, on
an empty workspace that no session owns, reads what its agent says in ``ready``, stops
it, and keeps that: names only of languages the server knows, versions only when they
look like versions. One probe at a time; concurrent callers share it; a failed one is
tried again after ``RETRY_S``.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from collections.abc import Callable, Collection
from typing import Any

import structlog

from mcp_code_sandbox.backends.base import Backend, Limits, SandboxSpec
from mcp_code_sandbox.errors import SandboxError
from mcp_code_sandbox.sessions.uids import UidPool
from mcp_code_sandbox.settings import Settings
from mcp_code_sandbox.workspace import Workspace, remove_tree

__all__ = ["RETRY_S", "RuntimeProbe", "clean_languages"]

log = structlog.get_logger("mcp_code_sandbox.run.probe")

#: After a failed probe (engine down, no image), how long before the next one may start.
RETRY_S = 30.0
_VERSION = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+_-]{0,39}")


def clean_languages(ready: Any, known: Collection[str]) -> dict[str, str] | None:
    """``{language: version}`` from an agent's ``ready``, keeping only ``known``
    languages and version strings that look like one (else ``"unknown"``); ``None`` when
    ``ready`` lists no languages at all."""
    languages = ready.get("languages") if isinstance(ready, dict) else None
    if not isinstance(languages, dict):
        return None
    return {
        name: version if isinstance(version, str) and _VERSION.fullmatch(version) else "unknown"
        for name, version in languages.items()
        if name in known
    }


class RuntimeProbe:
    def __init__(
        self,
        settings: Settings,
        backend: Backend,
        limits: Callable[[], Limits],
        known: Collection[str],
        uids: UidPool | None = None,
    ) -> None:
        """``uids``: the session manager's pool, when the backend runs each sandbox as a
        host uid of its own (the probe's sandbox too: never as root, never a tenant's)."""
        self._settings = settings
        self._uids = uids
        self._backend = backend
        self._limits = limits
        self._known = tuple(known)
        self._lock = asyncio.Lock()
        #: The latest successful answer; ``None`` before any.
        self.languages: dict[str, str] | None = None
        self._attempts = 0
        self._attempted_at = -RETRY_S

    async def get(self, *, again: bool = False) -> dict[str, str] | None:
        """The probed languages, probing first when there is no answer yet, or when
        ``again`` (a run found its sandbox lacking a language). At most one probe per
        ``RETRY_S``, so neither a broken engine nor a tenant asking for a missing
        language makes the server start sandboxes in a loop. ``None``: no answer yet."""
        attempts = self._attempts
        async with self._lock:
            if self._attempts != attempts:  # probed while we waited: share its answer
                return self.languages
            if self.languages is not None and not again:
                return self.languages
            if time.monotonic() - self._attempted_at < RETRY_S:
                return self.languages
            self._attempts += 1
            self._attempted_at = time.monotonic()
            try:
                self.languages = await self._probe() or self.languages
            except SandboxError as exc:
                log.warning("runtime probe failed", error=exc.message)
            return self.languages

    async def _probe(self) -> dict[str, str] | None:
        key = "probe-" + secrets.token_hex(8)
        # Not a path: no record reserves it if this server dies with the probe running.
        lease = None if self._uids is None else self._uids.lease(f"probe {key}")
        uid = None if lease is None else lease.uid
        try:
            return await self._probe_as(key, uid)
        finally:
            if lease is not None:
                lease.release()

    async def _probe_as(self, key: str, uid: int | None) -> dict[str, str] | None:
        workspace = Workspace(
            self._settings.state_dir / "probe" / key,
            quota_bytes=self._settings.workspace_quota_bytes,
            owner=self._backend.workspace_owner if uid is None else (uid, uid),
        )
        await asyncio.to_thread(workspace.create)
        try:
            spec = SandboxSpec(
                key=key,
                owner="",
                session_id=key,
                workspace=workspace.root,
                limits=self._limits(),
                uid=uid,
            )
            sandbox = await self._backend.create(spec)
            try:
                return clean_languages(sandbox.ready, self._known)
            finally:
                await self._backend.stop(sandbox)
        finally:
            await asyncio.to_thread(remove_tree, workspace.root)
