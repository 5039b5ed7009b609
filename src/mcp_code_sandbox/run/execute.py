"""One ``run_code`` call inside a held session: checks, execution, output, artifacts, audit.

The session manager owns the session's lifecycle; this module owns what happens during one
run. Nothing here knows about MCP: the tool layer turns a :class:`RunReport` into a result.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import BinaryIO

import structlog

from mcp_code_sandbox.agent.budget import Budget
from mcp_code_sandbox.backends.runner_images import RunnerImage
from mcp_code_sandbox.errors import (
    CodeTooLarge,
    EnvNotAllowed,
    InvalidArgument,
    NetworkNotAllowed,
    QuotaExceeded,
    SandboxError,
    SandboxFailed,
    UnsupportedLanguage,
)
from mcp_code_sandbox.run.agent_client import AgentClient, Display, Outcome
from mcp_code_sandbox.run.languages import RUNTIMES
from mcp_code_sandbox.run.output import OutputCapture
from mcp_code_sandbox.run.probe import clean_languages
from mcp_code_sandbox.run.runner_client import RunnerClient
from mcp_code_sandbox.sessions import quota
from mcp_code_sandbox.sessions.manager import Session, SessionManager
from mcp_code_sandbox.settings import FORBIDDEN_ENV, Settings
from mcp_code_sandbox.workspace import Change, Snapshot
from mcp_code_sandbox.workspace.mime import IMAGE_MIME_TYPES

__all__ = [
    "ImageFile",
    "RunReport",
    "RunRequest",
    "check_request",
    "ready_languages",
    "run",
]

audit = structlog.get_logger("mcp_code_sandbox.audit")

#: Image files larger than this are linked, not embedded (decoding them costs too much).
MAX_IMAGE_FILE_BYTES = 20 * 1024 * 1024
PROGRESS_EVERY_S = 2.0

ProgressSink = Callable[[float, str], Awaitable[None]]


@dataclass(frozen=True)
class RunRequest:
    code: str
    language: str = "python"
    timeout_s: float | None = None
    network: bool = False
    env: Mapping[str, str] | None = None


@dataclass(frozen=True)
class ImageFile:
    path: str
    mime_type: str
    data: bytes


@dataclass
class RunReport:
    session_id: str
    session_created: bool
    notice: str | None
    language: str
    status: str
    exit_code: int | None
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    full_output_path: str | None
    result: str | None
    error: dict[str, str] | None
    files: list[Change]
    execution_count: int | None
    duration_ms: int
    state_lost: bool
    displays: list[Display] = field(default_factory=list)
    image_files: list[ImageFile] = field(default_factory=list)
    #: What the result budget cut before shaping (``Outcome.cut``).
    cut: dict[str, int] = field(default_factory=dict)
    #: The workspace scan stopped at its limit: more files may have changed than listed.
    files_partial: bool = False


def check_request(
    settings: Settings, request: RunRequest, languages: Collection[str] = RUNTIMES.keys()
) -> float:
    """Refuse what this server does not allow; return the effective timeout."""
    if request.language not in languages:
        raise UnsupportedLanguage(
            f"language {request.language!r} is not offered here; available: "
            + ", ".join(sorted(languages))
        )
    if len(request.code.encode("utf-8")) > settings.max_code_bytes:
        raise CodeTooLarge(
            f"code is larger than {settings.max_code_bytes} bytes; upload data with "
            "upload_file and read it from /mnt/data instead of inlining it"
        )
    if request.network and not settings.allow_network:
        raise NetworkNotAllowed(
            "this server does not allow network access from sandboxes "
            "(the operator can set SANDBOX_ALLOW_NETWORK=true)"
        )
    if request.env:
        if not settings.allow_call_env:
            raise EnvNotAllowed(
                "this server does not accept env per call (the operator can set "
                "SANDBOX_ALLOW_CALL_ENV=true); run without env"
            )
        bad = sorted(k for k in request.env if k.upper() in FORBIDDEN_ENV or "=" in k or not k)
        if bad:
            raise InvalidArgument(f"env may not set {', '.join(bad)}: they control the sandbox")
    timeout = settings.exec_timeout_s if request.timeout_s is None else request.timeout_s
    if not 0 < timeout <= settings.max_exec_timeout_s:
        raise InvalidArgument(
            f"timeout_s must be more than 0 and at most {settings.max_exec_timeout_s:g}"
        )
    return timeout


async def run(
    manager: SessionManager,
    session: Session,
    request: RunRequest,
    timeout_s: float,
    on_progress: ProgressSink | None,
    runner: RunnerImage | None = None,
) -> RunReport:
    """Run ``request`` in ``session`` (whose lock the caller holds): in its agent, or in
    its container of ``runner`` when the language is a runner image's."""
    settings = manager.settings
    started = time.monotonic()
    session.runs += 1
    run_name = f"run-{session.runs}"
    executor: AgentClient | RunnerClient
    if runner is None:
        executor, notice = await manager.ensure_sandbox(session, network=request.network)
        _check_ready(session, request.language)
    else:
        executor, notice = RunnerClient(manager, session, runner, request.network), None
    # A notice here means the previous sandbox had died: its variables are gone.
    replaced = notice is not None
    threads = manager.threads  # blocking work, bounded per owner (never the event loop)
    before = await threads.run(session.owner, session.workspace.snapshot)
    # The spool (an unnamed temp file) is only made once the output passes the budget.
    capture = OutputCapture(settings.stream_bytes, _open_spool)
    progress = asyncio.create_task(_report_progress(capture, started, on_progress))

    def execute() -> Awaitable[Outcome]:
        return executor.execute(
            language=request.language,
            code=request.code,
            timeout_s=timeout_s,
            env=dict(request.env or {}),
            on_stream=capture.add,
            budget=Budget(settings.max_result_bytes, settings.max_images),
        )

    try:
        if manager.quota.filesystem:
            outcome = await execute()  # the workspace's own filesystem is the limit
        else:
            done, stopped = await quota.guarded(session.workspace, execute)
            outcome = done or _stopped(stopped or "")
    except SandboxFailed as exc:
        if runner is not None:
            raise  # the runner was replaced once already; nothing was lost but this call
        manager.metrics.backend_error(exc.code)  # the sandbox died under the run
        await manager.restart_sandbox(session)
        outcome = _lost(str(exc))
    finally:
        progress.cancel()
        full_output = await threads.run(session.owner, capture.finish)
    full_path = await _save_full_output(manager, session, full_output, run_name)
    after, changes = await threads.run(session.owner, _changes_since, session, before)
    notice = _join(notice, _over_quota(after, settings.workspace_quota_bytes))
    lost_said = replaced and not outcome.state_lost  # the notice says what was lost
    outcome.state_lost = outcome.state_lost or replaced
    report = _report(
        session, request, outcome, capture, full_path, changes, started, notice, lost_said
    )
    report.files_partial = before.truncated or after.truncated
    report.image_files = await threads.run(session.owner, _read_images, session, changes, settings)
    _audit(session, request, report, capture)
    manager.metrics.run_finished(report.language, report.status, report.duration_ms / 1000)
    return report


def ready_languages(session: Session) -> dict[str, str] | None:
    """The languages (with versions) the session's agent said ``ready`` with, only the
    known ones; ``None`` when unknown (no sandbox, or a ready message without languages).
    For this session's own messages only: never another owner's."""
    sandbox = session.sandbox
    return clean_languages(sandbox.ready if sandbox is not None else None, RUNTIMES)


def _check_ready(session: Session, language: str) -> None:
    listed = ready_languages(session)
    if listed is not None and language not in listed:
        raise UnsupportedLanguage(
            f"this sandbox has no interpreter for {language!r} (its runtime environment "
            "lacks it: the operator runs `mcp-code-sandbox setup` for bwrap, or "
            "`mcp-code-sandbox image build` for docker); available: " + ", ".join(sorted(listed))
        )


def _over_quota(after: Snapshot, limit: int) -> str | None:
    # The workspace's filesystem (or the watch over the run) stopped the code near the
    # quota; the server's own writes (uploads, saved output) fail with quota_exceeded.
    used = after.used_bytes
    return None if used <= limit else quota.over_quota_message(used, limit)


def _stopped(why: str) -> Outcome:
    error = {"name": "QuotaExceeded", "value": why, "traceback": ""}
    return Outcome("error", None, None, error, None, False)


def _join(first: str | None, second: str | None) -> str | None:
    return "; ".join(part for part in (first, second) if part) or None


def _open_spool() -> BinaryIO:
    return tempfile.TemporaryFile(prefix="mcs-out-")  # closed by OutputCapture.finish()


async def _report_progress(
    capture: OutputCapture, started: float, on_progress: ProgressSink | None
) -> None:
    if on_progress is None:
        return
    while True:
        await asyncio.sleep(PROGRESS_EVERY_S)
        elapsed = time.monotonic() - started
        with contextlib.suppress(Exception):  # a client gone away must not fail the run
            await on_progress(elapsed, capture.tail() or f"running for {elapsed:.0f} s")


def _changes_since(session: Session, before: Snapshot) -> tuple[Snapshot, list[Change]]:
    after = session.workspace.snapshot(count_hidden=True)
    return after, session.workspace.diff(before, after)


async def _save_full_output(
    manager: SessionManager, session: Session, data: bytes | None, run_name: str
) -> str | None:
    if data is None:
        return None
    rel = f".outputs/{run_name}.txt"
    write = session.workspace.write_file
    try:
        await manager.threads.run(session.owner, write, rel, data, overwrite=True)
    except QuotaExceeded:
        return None
    return rel


def _lost(reason: str) -> Outcome:
    return Outcome(
        status="error",
        exit_code=None,
        result=None,
        error={"name": "SandboxDied", "value": reason, "traceback": ""},
        execution_count=None,
        state_lost=True,
    )


def _report(
    session: Session,
    request: RunRequest,
    outcome: Outcome,
    capture: OutputCapture,
    full_path: str | None,
    changes: list[Change],
    started: float,
    notice: str | None,
    lost_said: bool = False,
) -> RunReport:
    where = f"/mnt/data/{full_path}" if full_path else None
    stdout = capture.render("stdout", where)
    stderr = capture.render("stderr", where)
    if outcome.state_lost and not lost_said:
        lost = "the interpreter was restarted: files in /mnt/data are kept, variables are gone"
        notice = _join(notice, lost)
    return RunReport(
        session_id=session.id,
        session_created=False,
        notice=notice,
        language=request.language,
        status=outcome.status,
        exit_code=outcome.exit_code,
        stdout=stdout.text,
        stderr=stderr.text,
        stdout_truncated=stdout.truncated,
        stderr_truncated=stderr.truncated,
        full_output_path=full_path,
        result=outcome.result,
        error=outcome.error,
        files=changes,
        execution_count=outcome.execution_count,
        duration_ms=int((time.monotonic() - started) * 1000),
        state_lost=outcome.state_lost,
        displays=outcome.displays,
        cut=outcome.cut,
    )


def _read_images(session: Session, changes: list[Change], settings: Settings) -> list[ImageFile]:
    images: list[ImageFile] = []
    for change in changes:
        if len(images) >= settings.max_images:
            break
        if change.mime_type not in IMAGE_MIME_TYPES or change.size_bytes > MAX_IMAGE_FILE_BYTES:
            continue
        try:
            read = session.workspace.read_file(change.path, max_bytes=MAX_IMAGE_FILE_BYTES)
        except SandboxError:
            continue  # replaced by a link or removed since the diff: skip, never follow
        images.append(ImageFile(change.path, change.mime_type, read.data))
    return images


def _audit(
    session: Session, request: RunRequest, report: RunReport, capture: OutputCapture
) -> None:
    # Never the code, the output, file contents or env values: sizes and outcomes only.
    audit.info(
        "run",
        owner=session.owner,
        session=session.id,
        language=request.language,
        status=report.status,
        duration_ms=report.duration_ms,
        code_bytes=len(request.code.encode("utf-8")),
        output_bytes=capture.total_bytes,
        files_changed=len(report.files),
        state_lost=report.state_lost,
        env_names=sorted(request.env or {}),
    )
