"""What the tools do, independent of MCP: one method per tool, each owner-aware.

The MCP layer (and the ``exec`` CLI command) call this; it validates what only it can
(sizes, permissions), holds the session for the call, and returns plain data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mcp_code_sandbox import runs
from mcp_code_sandbox.backends.base import Backend
from mcp_code_sandbox.errors import InvalidArgument, UploadTooLarge
from mcp_code_sandbox.runtimes import RUNTIMES
from mcp_code_sandbox.sessions import SessionManager
from mcp_code_sandbox.settings import Settings
from mcp_code_sandbox.workspace import FileInfo, ListResult, ReadResult

__all__ = ["SandboxService", "Upload"]


@dataclass(frozen=True)
class Upload:
    session_id: str
    path: str
    size_bytes: int
    session_created: bool
    notice: str | None


class SandboxService:
    def __init__(self, settings: Settings, backend: Backend) -> None:
        self.settings = settings
        self.backend = backend
        self.sessions = SessionManager(settings, backend)

    async def start(self) -> None:
        await self.sessions.start()

    async def aclose(self) -> None:
        await self.sessions.aclose()

    async def run_code(
        self,
        owner: str,
        request: runs.RunRequest,
        session_id: str | None = None,
        on_progress: runs.ProgressSink | None = None,
    ) -> runs.RunReport:
        timeout = runs.check_request(self.settings, request)
        async with self.sessions.acquire(owner, session_id, create=True, wait_s=timeout) as held:
            report = await runs.run(self.sessions, held.session, request, timeout, on_progress)
        report.session_created = held.created
        if held.notice:
            report.notice = f"{held.notice}. {report.notice}" if report.notice else held.notice
        return report

    async def upload_file(
        self,
        owner: str,
        filename: str,
        data: bytes,
        *,
        session_id: str | None,
        overwrite: bool,
    ) -> Upload:
        if len(data) > self.settings.max_upload_bytes:
            raise UploadTooLarge(
                f"the file is {len(data)} bytes; the limit is {self.settings.max_upload_bytes} "
                "bytes per upload"
            )
        async with self.sessions.acquire(
            owner, session_id, create=True, wait_s=self.settings.exec_timeout_s
        ) as held:
            info: FileInfo = held.session.workspace.write_file(filename, data, overwrite=overwrite)
        return Upload(held.session.id, info.path, info.size_bytes, held.created, held.notice)

    async def read_file(
        self, owner: str, session_id: str, path: str, *, offset: int, max_bytes: int | None
    ) -> ReadResult:
        limit = self.settings.max_read_bytes if max_bytes is None else max_bytes
        if not 0 < limit <= self.settings.max_read_bytes:
            raise InvalidArgument(f"max_bytes must be between 1 and {self.settings.max_read_bytes}")
        async with self.sessions.acquire(
            owner, session_id, create=False, wait_s=self.settings.exec_timeout_s
        ) as held:
            return held.session.workspace.read_file(path, offset=offset, max_bytes=limit)

    async def list_files(
        self, owner: str, session_id: str, path: str, *, recursive: bool
    ) -> ListResult:
        async with self.sessions.acquire(
            owner, session_id, create=False, wait_s=self.settings.exec_timeout_s
        ) as held:
            return held.session.workspace.list_files(path, recursive=recursive)

    async def close_session(self, owner: str, session_id: str) -> None:
        await self.sessions.close(owner, session_id)

    def runtimes(self) -> list[dict[str, Any]]:
        info = self.backend.runtime_info()
        limits = self.sessions.limits()
        enforcement = self.backend.enforcement()
        out = []
        for name, runtime in RUNTIMES.items():
            lang = info.get(name, {})
            out.append(
                {
                    "language": name,
                    "version": lang.get("version"),
                    "backend": self.backend.name,
                    "image": lang.get("image"),
                    "stateful": runtime.stateful,
                    "summary": runtime.summary,
                    "packages": lang.get("packages", {}),
                    "limits": {
                        "memory_bytes": limits.memory_bytes,
                        "cpu": limits.cpu,
                        "pids": limits.pids,
                        "tmp_bytes": limits.tmp_bytes,
                        "workspace_quota_bytes": self.settings.workspace_quota_bytes,
                        "default_timeout_s": self.settings.exec_timeout_s,
                        "max_timeout_s": self.settings.max_exec_timeout_s,
                        "max_output_bytes": self.settings.max_output_bytes,
                        "enforcement": enforcement,
                    },
                }
            )
        return out
