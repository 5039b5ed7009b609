"""One ``run_code`` call inside a held session, from start to report: output, artifacts,
audit.

The session manager owns the session's lifecycle and hands out what executes the code
(:class:`..sessions.executor.Executor`, with what the session lost getting it ready);
this module owns what happens during one run. It is given everything it uses (the held
session, the executor, the request, and :class:`RunBudget`: settings, metrics, worker
threads, how the quota binds) and never reaches back into the manager. It builds one
complete :class:`RunReport`. Nothing here knows about MCP: the tool layer shapes the
report into a result.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field, fields
from typing import BinaryIO

import structlog

from mcp_code_sandbox.agent.budget import Budget
from mcp_code_sandbox.errors import QuotaExceeded, SandboxError
from mcp_code_sandbox.metrics import Metrics
from mcp_code_sandbox.run.languages import RUNTIMES
from mcp_code_sandbox.run.output import OutputCapture
from mcp_code_sandbox.run.request import RunRequest
from mcp_code_sandbox.sessions import quota
from mcp_code_sandbox.sessions.executor import Cell, Outcome
from mcp_code_sandbox.sessions.session import Acquired, Handout, Session
from mcp_code_sandbox.sessions.workers import WorkerThreads
from mcp_code_sandbox.settings import Settings
from mcp_code_sandbox.workspace import Change, Snapshot, diff
from mcp_code_sandbox.workspace.mime import IMAGE_MIME_TYPES
from mcp_code_sandbox.workspace.seam import Files

__all__ = [
    "ImageFile",
    "ProgressSink",
    "RunBudget",
    "RunReport",
    "exit_code",
    "join_notices",
    "run",
    "timed_out",
]

audit = structlog.get_logger("mcp_code_sandbox.audit")

#: Image files larger than this are linked, not embedded (decoding them costs too much).
MAX_IMAGE_FILE_BYTES = 20 * 1024 * 1024
PROGRESS_EVERY_S = 2.0

ProgressSink = Callable[[float, str], Awaitable[None]]

#: Said when the interpreter was restarted under the run (a timeout's kill, a sandbox
#: that died) and nothing else said so.
STATE_LOST = "the interpreter was restarted: files in /mnt/data are kept, variables are gone"


@dataclass(frozen=True)
class ImageFile:
    path: str
    mime_type: str
    data: bytes


@dataclass(frozen=True)
class RunBudget:
    """What a run is given besides its session and executor: the server's settings (its
    budgets: output, result, images, quota), where to count, where blocking work runs,
    and whether the workspace's own filesystem bounds it (else a watch does)."""

    settings: Settings
    metrics: Metrics
    threads: WorkerThreads
    quota_on_disk: bool


@dataclass(kw_only=True)
class RunReport(Outcome):
    """One run, complete: the executor's :class:`..sessions.executor.Outcome` (how the
    code ended: status, result, error, displays, what the budget cut; ``state_lost`` also
    true when the sandbox was replaced) with the output, files, timing and notices
    around it, built once by :func:`run`. The tool layer shapes it."""

    session_id: str
    session_created: bool
    notice: str | None
    language: str
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    full_output_path: str | None
    files: list[Change]
    duration_ms: int
    image_files: list[ImageFile] = field(default_factory=list)
    #: The workspace scan stopped at its limit: more files may have changed than listed.
    files_partial: bool = False
    #: Hosts the sandbox's egress proxy refused during the run.
    blocked_hosts: list[str] = field(default_factory=list)
    #: How a paused session came back for this run (``memory``, ``variables``), if it was.
    resumed: str | None = None


#: The outcome's fields the report carries over as they are (not ``state_lost``: a
#: replaced sandbox lost the state too).
_OUTCOME_FIELDS = tuple(f.name for f in fields(Outcome) if f.name != "state_lost")


def join_notices(parts: Iterable[str | None]) -> str | None:
    """The one way a run's notices become its ``notice``: in order, ``"; "`` between
    them; ``None`` when none was said."""
    return "; ".join(part for part in parts if part) or None


async def run(
    held: Acquired,
    handout: Handout,
    files: Files,
    request: RunRequest,
    timeout_s: float,
    given: RunBudget,
    on_progress: ProgressSink | None = None,
    started: float | None = None,
    blocked_hosts: Callable[[], list[str]] = list,
) -> RunReport:
    """Run ``request`` in ``held``'s session (whose lock the caller holds) on
    ``handout.executor``, and report it, with what it did to ``files`` (the session's).
    ``started``: when the call began (monotonic; the sandbox's start counts in the run's
    duration); default now. ``blocked_hosts``: the hosts the session's egress proxy
    refused since it was last asked, asked once the run ended (the session manager's;
    default: none). Called by the service. A sandbox that died under the run is the
    executor's to report (an outcome with ``state_lost``); a runner that failed twice
    raises ``SandboxFailed``."""
    started = time.monotonic() if started is None else started
    session, settings, threads = held.session, given.settings, given.threads
    # A notice here means the previous sandbox had died: its variables are gone.
    replaced = handout.notice is not None
    before = await files.snapshot()
    # The spool (an unnamed temp file) is only made once the output passes the budget.
    capture = OutputCapture(settings.stream_bytes, _open_spool)
    progress = asyncio.create_task(_report_progress(capture, started, on_progress))

    def execute() -> Awaitable[Outcome]:
        budget = Budget(settings.max_result_bytes, settings.max_images)
        cell = Cell(request.language, request.code, timeout_s, dict(request.env or {}), budget)
        return handout.executor.execute(cell, capture.add)

    try:
        if given.quota_on_disk:
            outcome = await execute()  # the workspace's own filesystem is the limit
        else:  # only a directory's workspace is watched (``RunBudget``)
            done, stopped = await quota.guarded(session.workspace, execute)
            outcome = done or _stopped(stopped or "")
    except BaseException:
        progress.cancel()
        await threads.run(session.owner, capture.finish)  # closes the spool, if one was made
        raise
    progress.cancel()
    full_path, after, changes, images = await _after_run(
        session, files, capture, before, f"run-{handout.run}", settings, threads
    )
    notice = join_notices(
        (
            held.notice,
            handout.notice,
            _over_quota(after, settings.workspace_quota_bytes),
            # A timeout in words (what became of the interpreter included); else the
            # interpreter's own restart (a replaced sandbox's notice said its own).
            timed_out(outcome, request.language, timeout_s)
            or (STATE_LOST if outcome.state_lost else None),
        )
    )
    where = f"/mnt/data/{full_path}" if full_path else None
    stdout, stderr = capture.render("stdout", where), capture.render("stderr", where)
    report = RunReport(
        **{name: getattr(outcome, name) for name in _OUTCOME_FIELDS if name != "exit_code"},
        exit_code=exit_code(outcome, request.language),
        session_id=session.id,
        session_created=held.created,
        notice=notice,
        language=request.language,
        stdout=stdout.text,
        stderr=stderr.text,
        stdout_truncated=stdout.truncated,
        stderr_truncated=stderr.truncated,
        full_output_path=full_path,
        files=changes,
        duration_ms=int((time.monotonic() - started) * 1000),
        image_files=images,
        files_partial=before.truncated or after.truncated,
        state_lost=outcome.state_lost or replaced,
        resumed=handout.resumed,
        blocked_hosts=blocked_hosts(),
    )
    _audit(session, request, report, capture)
    given.metrics.run_finished(report.language, report.status, report.duration_ms / 1000)
    return report


def _stateful(language: str) -> bool:
    runtime = RUNTIMES.get(language)
    return runtime is not None and runtime.stateful


def exit_code(outcome: Outcome, language: str) -> int | None:
    """The run's exit code: a program's own; for the interpreter (which does not exit),
    0 when the cell ran through and 1 when it did not, as ``python script.py`` would."""
    if outcome.exit_code is not None or not _stateful(language):
        return outcome.exit_code
    return 0 if outcome.status == "ok" else 1


def timed_out(outcome: Outcome, language: str, timeout_s: float) -> str | None:
    """What a timeout did, in words; ``None`` when the run did not time out. The agent
    interrupts the interpreter (``KeyboardInterrupt``) and restarts it only when the
    code did not stop within its grace period (``state_lost``); a program is stopped."""
    if outcome.status != "timeout":
        return None
    said = f"timed out after {timeout_s:g} s"
    if not _stateful(language):
        return f"{said}; the program was stopped (files in /mnt/data are kept)"
    if outcome.state_lost:
        return (
            f"{said}; the code did not stop when interrupted, so the interpreter was "
            "restarted: variables are gone, files in /mnt/data are kept"
        )
    return f"{said}; the interpreter was interrupted, variables kept"


def _over_quota(after: Snapshot, limit: int) -> str | None:
    # The workspace's filesystem (or the watch over the run) stopped the code near the
    # quota; the server's own writes (uploads, saved output) fail with quota_exceeded.
    used = after.used_bytes
    return None if used <= limit else quota.over_quota_message(used, limit)


def _stopped(why: str) -> Outcome:
    error = {"name": "QuotaExceeded", "value": why, "traceback": ""}
    return Outcome("error", None, None, error, None, False)


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


async def _after_run(
    session: Session,
    files: Files,
    capture: OutputCapture,
    before: Snapshot,
    run_name: str,
    settings: Settings,
    threads: WorkerThreads,
) -> tuple[str | None, Snapshot, list[Change], list[ImageFile]]:
    """Everything after a run, in order: the output's end (its spool read back, in a
    worker thread, when there is one), the full output saved when it was cut, the
    workspace's changes since ``before``, and the images among them. Without a spool or
    images, one trip to a worker thread (the snapshot's; a trip costs a thread's wake-up
    and the event loop's, which is most of a warm ``1+1``)."""
    spooled = None if capture.spool is None else await threads.run(session.owner, capture.finish)
    full_path = await _save_full_output(files, spooled, run_name)
    after = await files.snapshot(count_hidden=True)
    changes = diff(before, after)
    return full_path, after, changes, await _read_images(files, changes, settings)


async def _save_full_output(files: Files, data: bytes | None, run_name: str) -> str | None:
    if data is None:
        return None
    rel = f".outputs/{run_name}.txt"
    try:
        await files.write_file(rel, data, overwrite=True)
    except QuotaExceeded:
        return None
    return rel


async def _read_images(files: Files, changes: list[Change], settings: Settings) -> list[ImageFile]:
    images: list[ImageFile] = []
    for change in changes:
        if len(images) >= settings.max_images:
            break
        if change.mime_type not in IMAGE_MIME_TYPES or change.size_bytes > MAX_IMAGE_FILE_BYTES:
            continue
        try:
            read = await files.read_file(change.path, max_bytes=MAX_IMAGE_FILE_BYTES)
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
