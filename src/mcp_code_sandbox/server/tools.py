"""The tools of DESIGN §6. Each validates its arguments, calls the service, shapes.

Owners: the authenticated principal over HTTP (a token's name, a JWT's subject), ``local``
over stdio and over unauthenticated loopback HTTP (``auth.current_owner``).
"""

from __future__ import annotations

import base64
import binascii
import datetime
import functools
import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Annotated, Any, Concatenate, ParamSpec

import structlog
from mcp.server.mcpserver import Context
from mcp_types import CallToolResult, ResourceLink
from pydantic import Field

from mcp_code_sandbox.errors import (
    InternalError,
    InvalidArgument,
    InvalidContent,
    SandboxError,
    UploadTooLarge,
)
from mcp_code_sandbox.run.request import RunRequest
from mcp_code_sandbox.sanitize import clean_text, escape_name
from mcp_code_sandbox.server import models
from mcp_code_sandbox.server.auth import current_owner
from mcp_code_sandbox.server.downloads import UrlSigner
from mcp_code_sandbox.server.fit import fit_count
from mcp_code_sandbox.server.reads import read_result
from mcp_code_sandbox.server.tool_results import (
    error_result,
    file_uri,
    light,
    run_result,
    structured_result,
)
from mcp_code_sandbox.service import SandboxService
from mcp_code_sandbox.sessions.overview import SessionSummary
from mcp_code_sandbox.workspace import ListResult

__all__ = ["ToolSet"]

log = structlog.get_logger("mcp_code_sandbox.tools")
P = ParamSpec("P")
#: Directory entries one list_files walk reads (beyond: ``truncated``, narrow the path),
#: and the most one page can hold before the result budget cuts it further.
LIST_WALK = 50_000
LIST_PAGE = 10_000

SessionArg = Annotated[
    str | None,
    Field(
        description="Session to use. Omit to start a new one (its id is in the result); "
        "pass your own id (letters, digits, . _ -) to create or reuse a named session."
    ),
]
LANGUAGE_DESCRIPTION = "Language of the code (see list_runtimes)"
RequiredSession = Annotated[str, Field(description="The session_id a previous result returned")]


def tool_errors(
    fn: Callable[Concatenate[ToolSet, P], Awaitable[CallToolResult]],
) -> Callable[Concatenate[ToolSet, P], Awaitable[CallToolResult]]:
    """Turn our errors into ``isError`` results (as the service lets a client see them:
    ``public_error``); anything else is ``internal_error``."""

    @functools.wraps(fn)
    async def wrapper(tools: ToolSet, /, *args: P.args, **kwargs: P.kwargs) -> CallToolResult:
        try:
            return await fn(tools, *args, **kwargs)
        except SandboxError as exc:
            return error_result(tools.service.public_error(exc))
        except Exception:
            log.exception("tool failed unexpectedly", tool=fn.__name__)
            return error_result(
                InternalError(
                    "the server failed unexpectedly; the error is in its log. Try again, or "
                    "start a new session if it persists"
                )
            )

    return wrapper


class ToolSet:
    """The tools bound to one service; ``app.build_server`` registers them.

    ``signer`` signs the download links results carry: the HTTP app's, which serves them;
    ``None`` over stdio (no links)."""

    def __init__(self, service: SandboxService, signer: UrlSigner | None = None) -> None:
        self.service = service
        self.settings = service.settings
        self.signer = signer

    @tool_errors
    async def run_code(
        self,
        code: Annotated[str, Field(description="The program or cell to run")],
        ctx: Context[Any, Any],
        language: Annotated[
            str,
            # The enum is added by run_code_tool and follows the runner images found.
            Field(description=LANGUAGE_DESCRIPTION),
        ] = "python",
        session_id: SessionArg = None,
        timeout_s: Annotated[float | None, Field(description="Wall-time limit in seconds")] = None,
        network: Annotated[
            bool | list[str],
            Field(
                description=(
                    "Outbound network for this call, where the server allows it (else "
                    "network_not_allowed): true for every host the server's allowlist "
                    'names, or a list of those hosts (e.g. ["pypi", "api.example.com"]). '
                    "It goes through the server's egress proxy (HTTP/HTTPS only, via "
                    "HTTP_PROXY); refused hosts are listed in blocked_hosts. Switching it "
                    "on or off within a session restarts the sandbox (files kept, "
                    "variables lost); other hosts on a networked sandbox do not"
                )
            ),
        ] = False,
        env: Annotated[
            dict[str, str] | None, Field(description="Extra environment for this call")
        ] = None,
    ) -> Annotated[CallToolResult, models.RunResult]:
        request = RunRequest(code, language, timeout_s, network, env)
        owner = current_owner()
        report = await self.service.run_code(
            owner, request, session_id, on_progress=_progress_sink(ctx)
        )
        # Shaping decodes and re-encodes images: blocking work, in the owner's threads,
        # unless there is none and little text (most cells: then the trip costs more).
        links = self._links(owner, report.session_id)
        if light(report):
            return run_result(report, self.settings, links)
        return await self.service.threads.run(owner, run_result, report, self.settings, links)

    def run_code_tool(self, languages: Sequence[str]) -> Callable[..., Awaitable[CallToolResult]]:
        """:meth:`run_code` as ``app.build_server`` registers it: the same tool, with
        ``languages`` as the enum of its ``language`` argument.

        The SDK builds a tool's input schema from the function's signature, once, at
        ``add_tool``: the enum is put into that signature up front (and the tool
        registered again when the languages change) instead of patching the schema."""
        method = self.run_code

        async def run_code(*args: Any, **kwargs: Any) -> CallToolResult:
            return await method(*args, **kwargs)

        enum = Annotated[
            str, Field(description=LANGUAGE_DESCRIPTION, json_schema_extra={"enum": [*languages]})
        ]
        signature = inspect.signature(method, eval_str=True)
        params = [
            p.replace(annotation=enum) if p.name == "language" else p
            for p in signature.parameters.values()
        ]
        run_code.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
        # What typing.get_type_hints reads (the SDK finds the Context argument with it).
        run_code.__annotations__ = {p.name: p.annotation for p in params}
        run_code.__annotations__["return"] = signature.return_annotation
        run_code.__doc__ = method.__doc__
        return run_code

    @tool_errors
    async def upload_file(
        self,
        filename: Annotated[
            str, Field(description="Path relative to /mnt/data, e.g. data/sales.csv")
        ],
        content_base64: Annotated[str | None, Field(description="File content, base64")] = None,
        content_text: Annotated[str | None, Field(description="File content as UTF-8 text")] = None,
        session_id: SessionArg = None,
        overwrite: Annotated[bool, Field(description="Replace an existing file")] = False,
    ) -> Annotated[CallToolResult, models.UploadResult]:
        owner = current_owner()
        # Up to max_upload_bytes of base64 to decode: a worker thread's job.
        decode = self._decode_content
        data = await self.service.threads.run(owner, decode, content_base64, content_text)
        up = await self.service.upload_file(
            owner, filename, data, session_id=session_id, overwrite=overwrite
        )
        name = escape_name(up.path)  # as listings show it, and as clients give it back
        link = ResourceLink(
            type="resource_link",
            uri=file_uri(up.session_id, name),
            name=name,
            mime_type=up.mime_type,
            size=up.size_bytes,
        )
        result = models.UploadResult(
            session_id=up.session_id,
            path=up.path,
            size_bytes=up.size_bytes,
            session_created=up.session_created,
            notice=up.notice,
        )
        return structured_result(result, [link])

    def _decode_content(self, b64: str | None, text: str | None) -> bytes:
        if (b64 is None) == (text is None):
            raise InvalidArgument("give exactly one of content_base64 and content_text")
        if text is not None:
            return text.encode("utf-8")
        assert b64 is not None
        limit = self.settings.max_upload_bytes
        if len(b64) > (limit + 2) // 3 * 4 + 4:
            raise UploadTooLarge(f"the file is larger than the upload limit of {limit} bytes")
        try:
            return base64.b64decode("".join(b64.split()), validate=True)
        except (binascii.Error, ValueError):
            raise InvalidContent(
                "content_base64 is not valid base64; send standard base64 (RFC 4648) or "
                "use content_text for text"
            ) from None

    @tool_errors
    async def read_file(
        self,
        session_id: RequiredSession,
        path: Annotated[str, Field(description="Path relative to /mnt/data")],
        offset: Annotated[
            int, Field(description="Byte offset to start at: 0, then the next_offset of a page")
        ] = 0,
        max_bytes: Annotated[int | None, Field(description="Most bytes to return")] = None,
    ) -> Annotated[CallToolResult, models.ReadFileResult]:
        owner = current_owner()
        page = await self.service.read_page(
            owner, session_id, path, offset=offset, max_bytes=max_bytes
        )
        # Shaping may decode and re-encode an image: blocking work, in the owner's threads.
        links = self._links(owner, session_id)
        shape = read_result
        return await self.service.threads.run(owner, shape, page, session_id, self.settings, links)

    def _links(self, owner: str, session_id: str) -> Callable[[str], str] | None:
        """Download links to ``session_id``'s files, when the HTTP server serves them."""
        if self.signer is None:
            return None
        return functools.partial(self.signer.url, owner, session_id)

    @tool_errors
    async def list_files(
        self,
        session_id: RequiredSession,
        path: Annotated[str, Field(description="Directory relative to /mnt/data")] = ".",
        recursive: Annotated[bool, Field(description="Include subdirectories")] = True,
        offset: Annotated[
            int, Field(ge=0, description="Skip this many entries (a previous next_offset)")
        ] = 0,
    ) -> Annotated[CallToolResult, models.ListFilesResult]:
        # The same bounded walk every time (sorted, so the same entries in the same
        # order while the files stay put), paged by offset within the result budget;
        # shaping 10,000 entries takes a quarter of a second: not on the event loop.
        owner = current_owner()
        listing = await self.service.list_files(
            owner, session_id, path, recursive=recursive, limit=LIST_WALK
        )
        budget = self.settings.max_result_bytes
        return await self.service.threads.run(
            owner, _listing_page, session_id, path, listing, offset, budget
        )

    @tool_errors
    async def close_session(
        self, session_id: RequiredSession
    ) -> Annotated[CallToolResult, models.CloseResult]:
        await self.service.close_session(current_owner(), session_id)
        return structured_result(models.CloseResult(session_id=session_id, status="closed"))

    @tool_errors
    async def restart_interpreter(
        self, session_id: RequiredSession
    ) -> Annotated[CallToolResult, models.RestartResult]:
        done = await self.service.restart_interpreter(current_owner(), session_id)
        result = models.RestartResult(
            session_id=done.session_id,
            restarted=True,
            state="paused" if done.state == "paused" else "running",
            message=done.message,
        )
        return structured_result(result)

    @tool_errors
    async def fork_session(
        self,
        session_id: RequiredSession,
        new_session_id: Annotated[
            str | None,
            Field(
                description="Name for the new session (letters, digits, . _ -); omit for a new id"
            ),
        ] = None,
    ) -> Annotated[CallToolResult, models.ForkResult]:
        done = await self.service.fork_session(current_owner(), session_id, new_session_id)
        result = models.ForkResult(
            session_id=done.session_id,
            forked_from=done.source_id,
            state=done.state,
            file_count=done.files,
            bytes_copied=done.bytes,
            variables=list(done.variables[:LISTED_VARIABLES]),
            variables_more=max(0, len(done.variables) - LISTED_VARIABLES),
            notice=done.notice,
        )
        return structured_result(result)

    @tool_errors
    async def list_sessions(self) -> Annotated[CallToolResult, models.SessionsResult]:
        listed = await self.service.list_sessions(current_owner())
        # Names and types are at most 200 characters each: the variables listed shrink
        # with the number of sessions, so the whole result stays within its budget.
        share = self.settings.max_result_bytes // 2 // max(1, len(listed))
        per_session = min(LISTED_VARIABLES, share // _VARIABLE_BYTES)
        sessions = [_session_out(s, per_session) for s in listed]
        return structured_result(models.SessionsResult(sessions=sessions))

    @tool_errors
    async def list_runtimes(self) -> Annotated[CallToolResult, models.RuntimesResult]:
        runtimes = [models.RuntimeOut(**r) for r in await self.service.runtimes()]
        pool = models.PoolOut(**self.service.pool_status())
        notice = await self.service.not_ready()
        return structured_result(models.RuntimesResult(runtimes=runtimes, pool=pool, notice=notice))

    @tool_errors
    async def export_notebook(
        self,
        session_id: RequiredSession,
        path: Annotated[
            str, Field(description="Where to write it, relative to /mnt/data; ends in .ipynb")
        ] = "session.ipynb",
    ) -> Annotated[CallToolResult, models.ExportNotebookResult]:
        owner = current_owner()
        done = await self.service.export_notebook(owner, session_id, path)
        links = self._links(owner, done.session_id)
        name = escape_name(done.path)
        link = ResourceLink(
            type="resource_link",
            uri=file_uri(done.session_id, name),
            name=name,
            mime_type="application/x-ipynb+json",
            size=done.size_bytes,
        )
        result = models.ExportNotebookResult(
            session_id=done.session_id,
            path=name,
            size_bytes=done.size_bytes,
            runs=done.runs,
            download_url=links(name) if links else None,
            notice=done.notice,
        )
        return structured_result(result, [link])


#: Saved variables ``list_sessions`` names per session (the rest are counted).
LISTED_VARIABLES = 100
#: The most one listed variable takes in a result (a name and a type of 200 characters,
#: escaped, and the JSON around them).
_VARIABLE_BYTES = 1024


def _session_out(summary: SessionSummary, listed: int) -> models.SessionOut:
    saved = summary.saved_variables
    return models.SessionOut(
        session_id=summary.session_id,
        created=_iso(summary.created_at),
        last_active=_iso(summary.last_active),
        state=summary.state,
        workspace_bytes=summary.workspace_bytes,
        file_count=summary.file_count,
        saved_variables=None
        if saved is None
        else [models.VariableOut(name=n, type=t) for n, t in saved[:listed]],
        saved_variables_more=max(0, len(saved or ()) - listed),
    )


def _iso(wall: float) -> str:
    return datetime.datetime.fromtimestamp(wall, datetime.UTC).isoformat(timespec="seconds")


def _listing_page(
    session_id: str, path: str, listing: ListResult, offset: int, budget: int
) -> CallToolResult:
    """One page of ``listing`` from ``offset``: as many entries as fit in ``budget``."""
    rest = listing.entries[offset:]
    entries = [
        models.FileEntryOut(**{**vars(e), "path": escape_name(e.path)}) for e in rest[:LIST_PAGE]
    ]

    def page(count: int) -> CallToolResult:
        more = count < len(rest)
        return structured_result(
            models.ListFilesResult(
                session_id=session_id,
                path=path,
                entries=entries[:count],
                truncated=more or listing.truncated,
                next_offset=offset + count if more and count else None,
            )
        )

    return fit_count(page, len(entries), budget)


#: The least a progress value grows by, when two reports come within a clock tick.
_PROGRESS_STEP = 0.001


def _progress_sink(
    ctx: Context[Any, Any],
) -> Callable[[float, float, str], Awaitable[None]] | None:
    """Progress notifications for a request that asked for them: seconds so far out of
    the most the call may take, each value above the last (MCP requires it)."""
    meta = ctx.request_context.meta or {}
    if meta.get("progress_token") is None:
        return None
    last = -1.0

    async def report(done: float, total: float, message: str) -> None:
        nonlocal last
        last = max(done, last + _PROGRESS_STEP)
        await ctx.report_progress(last, max(total, last), clean_text(message))

    return report
