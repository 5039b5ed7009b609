"""What the tools do, independent of MCP: one method per tool, each owner-aware.

The MCP layer (and the ``exec`` CLI command) call this; it validates what only it can
(sizes, permissions), holds the session for the call, and returns plain data.
"""

from __future__ import annotations

import asyncio
import functools
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

import structlog

from mcp_code_sandbox.backends.base import Backend, Enforcement, Sandbox
from mcp_code_sandbox.backends.preparation import Preparation
from mcp_code_sandbox.backends.runner_images import RunnerImage, RunnerImages
from mcp_code_sandbox.errors import (
    BackendUnavailable,
    InvalidArgument,
    InvalidFilename,
    NetworkNotAllowed,
    SandboxError,
    SessionNotFound,
    UnsupportedLanguage,
    UploadTooLarge,
)
from mcp_code_sandbox.metrics import Metrics
from mcp_code_sandbox.run import execute, notebook
from mcp_code_sandbox.run.languages import RUNTIMES, Languages, runner_summary
from mcp_code_sandbox.run.probe import RuntimeProbe
from mcp_code_sandbox.run.recent import RecentRuns, error_label
from mcp_code_sandbox.run.request import RunRequest, check_request
from mcp_code_sandbox.sessions.egress import Wish
from mcp_code_sandbox.sessions.forking import Forked
from mcp_code_sandbox.sessions.holder import Role
from mcp_code_sandbox.sessions.manager import SessionManager
from mcp_code_sandbox.sessions.overview import SessionSummary, SessionView, overview, summaries
from mcp_code_sandbox.sessions.records import SessionRecord
from mcp_code_sandbox.sessions.runlog import RunLog
from mcp_code_sandbox.sessions.session import Session
from mcp_code_sandbox.settings import Settings
from mcp_code_sandbox.workspace import FileInfo, ListResult, ReadResult, measure
from mcp_code_sandbox.workspace.pages import Page, page_of, whole_file
from mcp_code_sandbox.workspace.seam import Files

__all__ = ["Download", "Exported", "Restarted", "SandboxService", "Upload"]

log = structlog.get_logger("mcp_code_sandbox.service")


#: Room in a ``read_file`` result's text for what goes beside a text page (its
#: structured metadata as text: path, sizes, offsets, the download link).
READ_META_TEXT_BYTES = 2 * 1024


@dataclass(frozen=True)
class Upload:
    session_id: str
    path: str
    size_bytes: int
    session_created: bool
    notice: str | None
    mime_type: str


@dataclass(frozen=True)
class Download:
    """A workspace file opened for an HTTP download: its owner (whose worker threads read
    it), the open file (the caller closes it) and what it was at open."""

    owner: str
    source: BinaryIO
    info: FileInfo


@dataclass(frozen=True)
class Exported:
    """A notebook ``export_notebook`` wrote: where, how big, how many runs."""

    session_id: str
    path: str
    size_bytes: int
    #: Runs in it (recorded ones; the notebook says how many were not).
    runs: int
    #: What it leaves out, as its last cell says; ``None``: nothing.
    notice: str | None


@dataclass(frozen=True)
class Restarted:
    """A session whose interpreter ``restart_interpreter`` restarted, and what it is now."""

    session_id: str
    state: str  # "running" | "paused"
    message: str


#: Largest workspace image a notebook embeds (beyond: its path, as text).
NOTEBOOK_IMAGE_BYTES = 5 * 1024 * 1024

LanguagesChanged = Callable[[list[str]], Awaitable[None]]
#: How long ``/readyz`` waits for the backend's answer (probes come every few seconds).
READY_TIMEOUT_S = 5.0
#: How long one answer of the backend serves ``/readyz``. The endpoint is open, and asking
#: the engine on every request let a flood of them slow every tenant's runs
#: (``bench/README.md``); orchestrators probe every few seconds, so an answer up to 2 s
#: old tells them the same.
READY_CACHE_S = 2.0


#: What the tool layer is told of a call's progress: seconds so far, the most seconds the
#: call may take (both grow: a wait for the first-start build, then the run with its own
#: timeout), and what is happening.
ProgressReport = Callable[[float, float, str], Awaitable[None]]


def _counted(
    sink: ProgressReport | None, waited: float, timeout: float
) -> execute.ProgressSink | None:
    """``sink`` for one phase of a call (the wait for the build, then the run): its
    seconds counted from ``waited`` on, out of ``waited + timeout``, so that progress and
    total only grow within a request (MCP progress values must increase)."""
    if sink is None:
        return None
    sink_ = sink

    async def report(elapsed: float, message: str) -> None:
        done = waited + elapsed
        await sink_(done, max(waited + timeout, done), message)

    return report


def _host_dirs(settings: Settings) -> dict[str, str]:
    """Each directory of the server's (as set, and with its links resolved) -> the setting
    that names it, which a message shows instead: the operator knows where it is."""
    named = {
        "$SANDBOX_STATE_DIR": settings.state_dir,
        "$SANDBOX_DOCKER_HOST_STATE_DIR": settings.docker_host_state_dir,
        "$SANDBOX_RUNTIME_DIR": settings.runtime_dir,
        "$SANDBOX_UID_LEASE_DIR": settings.uid_lease_dir,
    }
    dirs: dict[str, str] = {}
    for name, path in named.items():
        # "/" or a relative path would match text that is no path of ours.
        if path is not None and path.is_absolute() and len(path.parts) > 1:
            dirs[str(path)] = dirs[str(path.resolve())] = name
    return dirs


#: Whose worker-thread share the operator's views of every owner read records in.
_OPERATOR_THREADS = "(operator)"


class SandboxService:
    def __init__(
        self,
        settings: Settings,
        backend: Backend,
        preparing: Preparation | None = None,
        *,
        role: Role | None = None,
        janitor: bool = False,
        replica: bool = False,
    ) -> None:
        """``preparing``: what the backend still needs built before its first sandbox (a
        first ``serve`` without the runtime env), from the server layer, which decides
        what that is; ``None``: nothing. Started and closed with the service. ``role``
        ``janitor`` and ``replica``: see :class:`.sessions.manager.SessionManager`."""
        self.settings = settings
        self.backend = backend
        self.preparing = preparing
        self.metrics = Metrics(backend.name)
        self.sessions = SessionManager(
            settings, backend, self.metrics, role=role, janitor=janitor, replica=replica
        )
        #: Blocking work (file I/O, walks, images) goes here, never on the event loop.
        self.threads = self.sessions.threads
        #: How the backend enforces each limit, as ``describe()`` said at the latest refresh.
        self._enforcement: dict[str, Enforcement] = {}
        #: The server's own probe sandbox (never a tenant's: see :mod:`.run.probe`).
        self.probe = RuntimeProbe(
            settings, backend, self.sessions.limits, RUNTIMES, self.sessions.uids
        )
        #: Which languages are offered: decided there alone, from the backend's
        #: ``describe()``, the probe and runner images, which this service refreshes.
        self.offer = Languages(self.probe)
        #: Called with the new language list whenever it changes (the MCP layer tells
        #: its clients that the tool list changed: run_code's language enum is in it).
        self.on_languages_changed: list[LanguagesChanged] = []
        #: ``not_ready``'s latest answer and when it was had (monotonic); one probe at a
        #: time (the lock), its answer shared by everyone who waited for it.
        self._ready: tuple[float, str | None] | None = None
        self._ready_lock = asyncio.Lock()
        #: The latest runs of every owner, for the operator's ``/ui`` page.
        self.recent_runs = RecentRuns()
        #: The server's own directories, hidden from error messages (``public_error``).
        self._host_dirs = _host_dirs(settings)
        if preparing is not None:  # built further: what the sandboxes offer changed
            preparing.listeners.append(self.refresh_runners)
            # No warm sandbox before they can start (each start would fail, and say so).
            self.sessions.hold_pool_while(lambda: None if preparing.usable else preparing.step)
            preparing.listeners.append(self._refill_pool)

    async def start(self) -> None:
        if self.settings.allow_network:
            # A bad allowlist or secrets file stops the server now, not a user's call.
            await asyncio.to_thread(self.sessions.check_egress)
        if self.preparing is not None:
            self.preparing.start()
        await self.sessions.start()
        await self.refresh_runners()

    async def _refill_pool(self) -> None:
        self.sessions.refill_pool()

    def languages(self) -> list[str]:
        """What ``run_code`` offers (see :class:`.run.languages.Languages`)."""
        return self.offer.offered()

    async def refresh_runners(self) -> bool:
        """Ask the backend for runner images and its built-in languages again; True (and
        listeners told) when the offered languages changed.

        An engine that does not answer keeps what was found before: its runs fail with
        ``backend_unavailable`` anyway, and the list should not flap with it."""
        before = self.languages()
        try:
            description = await asyncio.to_thread(self.backend.describe)
        except SandboxError as exc:
            log.warning("runtime info not read", error=exc.message)
        else:
            self.offer.info = description.runtimes
            self._enforcement = description.enforcement
        images = self.backend if isinstance(self.backend, RunnerImages) else None
        try:
            found = await images.discover_runners(RUNTIMES.keys()) if images else {}
        except SandboxError as exc:
            log.warning("runner images not listed", error=exc.message)
        else:
            self.offer.set_runners(found)
        return await self._languages_changed(before)

    async def _languages_changed(self, before: list[str]) -> bool:
        after = self.languages()
        if after == before:
            return False
        log.info("languages changed", languages=after)
        for listener in list(self.on_languages_changed):
            try:
                await listener(after)
            except Exception:  # a client gone away must not fail the caller
                log.exception("languages-changed listener failed")
        return True

    async def aclose(self) -> None:
        if self.preparing is not None:
            await self.preparing.aclose()
        await self.sessions.aclose()

    def public_error(self, error: SandboxError) -> SandboxError:
        """``error`` as a client may see it: the server's own directories that its message
        names (where it ``quotes_host``: a tool's, pip's or the engine's text) shown as
        the setting that names them; the message as it was goes to the log. Called by
        every boundary that answers a client with an error (tools, resources, ``/files``
        uploads)."""
        original = error.message
        if error.quotes_host and error.hide_paths(self._host_dirs):
            log.warning("an error message named a host path", code=error.code, message=original)
        return error

    def session_count(self) -> int:
        """Sessions open now, of every owner (``/healthz``)."""
        return self.sessions.count()

    async def not_ready(self, timeout_s: float = READY_TIMEOUT_S) -> str | None:
        """Why the backend could not start a sandbox now (for ``/readyz``); ``None``: it
        could. Bounded by ``timeout_s``: a hung engine is as good as a dead one. The
        answer is kept for ``READY_CACHE_S``."""
        async with self._ready_lock:
            if self._ready is not None and time.monotonic() - self._ready[0] < READY_CACHE_S:
                return self._ready[1]
            reason = await self._ask_ready(timeout_s)
            self._ready = (time.monotonic(), reason)
            return reason

    async def _ask_ready(self, timeout_s: float) -> str | None:
        if self.preparing is not None and not self.preparing.usable:
            return self.preparing.message()  # "building the sandbox runtime: installing ..."
        try:
            async with asyncio.timeout(timeout_s):
                await self.backend.check_ready()
        except TimeoutError:
            return f"the {self.backend.name} backend did not answer within {timeout_s:g} s"
        except SandboxError as exc:
            return exc.message
        return None

    async def session_overview(self, owner: str | None) -> list[SessionView]:
        """The live sessions of ``owner`` (``None``: every owner's, for admins) with
        their figures now (``sessions.overview``), for the operator's ``/ui`` page."""
        elsewhere = await self._elsewhere(owner)
        return await overview(
            self.sessions.listed(owner),
            self.backend,
            self.threads,
            replica=self.replica,
            elsewhere=elsewhere,
        )

    async def run_code(
        self,
        owner: str,
        request: RunRequest,
        session_id: str | None = None,
        on_progress: ProgressReport | None = None,
    ) -> execute.RunReport:
        """:meth:`_run_code`, and an entry in :attr:`recent_runs` for how it ended."""
        started = time.monotonic()
        try:
            report = await self._run_code(owner, request, session_id, on_progress)
        except SandboxError as exc:
            took = int((time.monotonic() - started) * 1000)
            self.recent_runs.add(owner, session_id, request.language, "failed", took, exc.code)
            raise
        error = error_label(report.status, report.error, report.exit_code, report.stderr)
        self.recent_runs.add(
            owner, report.session_id, report.language, report.status, report.duration_ms, error
        )
        return report

    async def _run_code(
        self,
        owner: str,
        request: RunRequest,
        session_id: str | None,
        report_progress: ProgressReport | None,
    ) -> execute.RunReport:
        """Check ``request``, hold the session (made when new), get its executor from the
        session manager and run; the report is complete as :func:`.run.execute.run`
        builds it. While the backend is still being prepared, the call waits for it up
        to its timeout (a language not offered yet: for the whole preparation)."""
        timeout = check_request(self.settings, request)
        if self.backend.host_problem is not None:  # no sandbox can start here: say why
            raise BackendUnavailable(self.backend.host_problem)
        on_progress = _counted(report_progress, 0.0, timeout)
        if self.preparing is not None:
            whole = request.language not in self.languages()
            waiting = time.monotonic()
            with self.metrics.counting_backend_errors():
                await self.preparing.wait(timeout, on_progress, whole=whole)
            waited = time.monotonic() - waiting
            on_progress = _counted(report_progress, waited, timeout)
        runner = await self._checked_language(request.language)
        network = request.network_wish
        await self._check_network(network, request.language, runner)
        before = self.languages()
        # Pooled sandboxes are made for calls with no network, no runner and no env of
        # their own: a call asking for any of these starts its sandbox as before.
        pooled = network is None and not request.env and runner is None
        async with self.sessions.acquire(
            owner, session_id, create=True, wait_s=timeout, pool=pooled, runs=True
        ) as held:
            started = time.monotonic()  # the sandbox's start counts, the queue does not
            handout = await self.sessions.executor(
                held.session, network=network, runner=runner, pool=pooled
            )
            if runner is None:
                await self._check_sandbox(held.session.sandbox, request.language, before)
            started_wall = time.time()
            report = await execute.run(
                held,
                handout,
                self.sessions.files(held.session),
                request,
                timeout,
                self._run_budget(),
                on_progress,
                started,
                functools.partial(self.sessions.blocked_hosts, held.session),
            )
            if not held.session.closed:
                await self._record(held.session, request, report, started_wall)
            if held.session.closed:  # close_session landed during the run: it is gone
                raise SessionNotFound(
                    f"session {held.session.id} was closed while this call ran; its "
                    "files and variables are gone"
                )
        await self._languages_changed(before)
        return report

    async def _checked_language(self, language: str) -> RunnerImage | None:
        """Refuse a language this server does not offer (``UnsupportedLanguage``), after
        a look for runner images built since the last one; the runner image that offers
        it, or ``None`` when the sandbox's agent runs it."""
        if language not in self.languages():
            await self.refresh_runners()  # an image built since the last look
        self.offer.check(language)
        return self.offer.runner(language)

    async def _check_network(
        self, network: Wish, language: str, runner: RunnerImage | None
    ) -> None:
        """Refuse a call's network wish (``NetworkNotAllowed``) before any session is
        held: a host outside the server's policy, a backend that cannot give a sandbox
        network here, or a language that runs in a runner image (no agent there bridges
        the egress proxy). ``None``: no network, nothing to check."""
        if network is None:
            return
        self.sessions.check_network(network)
        why = (await asyncio.to_thread(self.backend.describe)).network_unavailable
        if why is not None:
            raise NetworkNotAllowed(
                f"network access is allowed by this server but not available: {why}"
            )
        if runner is not None:
            raise NetworkNotAllowed(
                f"{language} runs in a runner image, which has no agent to bridge the "
                "egress proxy into its sandbox: run it without network"
            )

    async def _check_sandbox(
        self, sandbox: Sandbox | None, language: str, before: list[str]
    ) -> None:
        """Refuse a language the session's sandbox has no interpreter for; the server's
        own probe is asked again then (the list it offers may be stale)."""
        try:
            self.offer.check_sandbox(sandbox.ready if sandbox is not None else None, language)
        except UnsupportedLanguage:
            await self.probe.get(again=True)
            await self._languages_changed(before)
            raise

    def runlog(self, session: Session) -> RunLog:
        """``session``'s runs on the host (see :mod:`.sessions.runlog`)."""
        return RunLog(self.settings.runlogs_dir, session.slot, self.settings.notebook_max_bytes)

    async def _record(
        self, session: Session, request: RunRequest, report: execute.RunReport, started: float
    ) -> None:
        """Append the run to the session's run log; a disk that fails only costs the
        record (logged), never the run's result. Called with the session's lock held."""
        entry = notebook.entry_of(
            report,
            request.code,
            started,
            max_images=self.settings.max_images,
            max_image_bytes=self.settings.max_image_bytes,
            max_text_bytes=self.settings.max_output_bytes,
        )
        try:
            await self.threads.run(session.owner, self.runlog(session).append, entry)
        except OSError as exc:
            log.warning("run not recorded", session=session.id, error=str(exc))

    async def export_notebook(self, owner: str, session_id: str, path: str) -> Exported:
        """Write the session's runs as a Jupyter notebook at ``path`` in its workspace
        (replacing a file there; the path is checked like an upload's, and must end in
        ``.ipynb``), under the session's lock: ``export_notebook``."""
        if not path.lower().endswith(".ipynb"):
            raise InvalidFilename(f"{path!r}: a notebook's path must end in .ipynb")
        async with self.sessions.acquire(
            owner, session_id, create=False, wait_s=self.settings.exec_timeout_s
        ) as held:
            session = held.session
            files = self.sessions.files(session)
            build = functools.partial(_build_notebook, self.runlog(session), files)
            spool, written = await self.threads.run(owner, build)
            try:
                info = await files.write_file(path, spool, overwrite=True)
            finally:
                spool.close()
        return Exported(session.id, info.path, info.size_bytes, written.runs, written.cut)

    def _run_budget(self) -> execute.RunBudget:
        # A workspace in the sandbox is not watched during a run (its agent answers
        # between runs only): the sandbox's own volume limit binds it.
        bound = self.sessions.quota_on_disk() or self.backend.workspace_in_sandbox
        return execute.RunBudget(self.settings, self.metrics, self.threads, bound)

    async def upload_file(
        self,
        owner: str,
        filename: str,
        data: bytes | BinaryIO,
        *,
        session_id: str | None,
        overwrite: bool,
    ) -> Upload:
        """Write an upload: ``data`` as bytes, or as a file at its start (a spooled HTTP
        body), checked against the upload limit and the quota before anything is written."""
        size, _ = measure(data)
        if size > self.settings.max_upload_bytes:
            raise UploadTooLarge(
                f"the file is {size} bytes; the limit is {self.settings.max_upload_bytes} "
                "bytes per upload"
            )
        async with self.sessions.acquire(
            owner, session_id, create=True, wait_s=self.settings.exec_timeout_s
        ) as held:
            files = self.sessions.files(held.session)  # a quota walk, then the write
            info: FileInfo = await files.write_file(filename, data, overwrite=overwrite)
        session = held.session
        return Upload(
            session.id, info.path, info.size_bytes, held.created, held.notice, info.mime_type
        )

    async def read_file(
        self, owner: str, session_id: str, path: str, *, offset: int, max_bytes: int | None
    ) -> ReadResult:
        """Up to ``max_bytes`` (at most ``max_read_bytes``) of ``path`` from ``offset``,
        read under the session lock: the bytes :meth:`read_page` and
        :meth:`read_resource` decide on (and what tests read directly)."""
        limit = self.settings.max_read_bytes if max_bytes is None else max_bytes
        if not 0 < limit <= self.settings.max_read_bytes:
            raise InvalidArgument(f"max_bytes must be between 1 and {self.settings.max_read_bytes}")
        async with self.sessions.acquire(
            owner, session_id, create=False, wait_s=self.settings.exec_timeout_s
        ) as held:
            files = self.sessions.files(held.session)
            return await files.read_file(path, offset=offset, max_bytes=limit)

    async def read_page(
        self, owner: str, session_id: str, path: str, *, offset: int, max_bytes: int | None
    ) -> Page:
        """``read_file``'s page, decided (text, image candidate or bytes; how many; the
        next offset) so that the whole result fits in ``max_read_bytes`` and in
        ``max_result_bytes``; the tool layer only shapes it (``server.reads``)."""
        read = await self.read_file(owner, session_id, path, offset=offset, max_bytes=max_bytes)
        budget = min(self.settings.max_read_bytes, self.settings.max_result_bytes)
        # A text page is what a client reads as tokens: within the result's text budget.
        text = self.settings.result_text_bytes - READ_META_TEXT_BYTES
        # Decoding up to a page of text and sizing its JSON: a worker thread's job.
        return await self.threads.run(owner, page_of, read, budget, text)

    async def read_resource(
        self, owner: str, session_id: str, path: str, link: Callable[[str], str] | None
    ) -> tuple[str | bytes, str]:
        """A ``sandbox://`` resource: the whole file and its detected MIME type, or
        ``ArtifactTooLarge`` naming ``read_file`` (and ``link(path)``, its download link,
        when given)."""
        read = await self.read_file(owner, session_id, path, offset=0, max_bytes=None)
        url = link(read.path) if link else None
        # Decoding up to ``max_read_bytes`` of text: a worker thread's job, as for pages.
        whole = await self.threads.run(owner, whole_file, read, self.settings.max_read_bytes, url)
        return whole, read.mime_type

    async def open_download(
        self, session_id: str, path: str, signed_for: Callable[[str], bool]
    ) -> Download | None:
        """Open ``path`` of the session named ``session_id`` whose owner ``signed_for``
        accepts, for ``/files`` downloads (a link names no owner: its signature tells
        which of the sessions of that id it is for); ``None``: no such session.

        The open (path checks, no symlink followed) happens under the session lock like
        every other file call; the caller streams the open file after it is released,
        so a slow download never holds the session. Raises what ``open_file`` raises."""
        owners = [s.owner for s in self.sessions.with_id(session_id) if signed_for(s.owner)]
        if not owners:
            return None
        owner = owners[0]
        async with self.sessions.acquire(
            owner, session_id, create=False, wait_s=self.settings.exec_timeout_s
        ) as held:
            source, info = await self.sessions.files(held.session).open_file(path)
        return Download(owner, source, info)

    async def list_files(
        self,
        owner: str,
        session_id: str,
        path: str,
        *,
        recursive: bool,
        limit: int = 10000,
        wait_s: float | None = None,
    ) -> ListResult:
        """``wait_s``: how long to wait for a session busy with another call before
        ``SessionBusy`` (default: ``exec_timeout_s``, as every call)."""
        wait = self.settings.exec_timeout_s if wait_s is None else wait_s
        async with self.sessions.acquire(owner, session_id, create=False, wait_s=wait) as held:
            listing = self.sessions.files(held.session).list_files
            return await listing(path, recursive=recursive, limit=limit)

    async def restart_interpreter(self, owner: str, session_id: str) -> Restarted:
        """A fresh interpreter for ``owner``'s session, its files kept, under the session's
        lock (see :meth:`.sessions.manager.SessionManager.restart`): a paused session
        stays paused and its next call starts fresh, without its saved variables."""
        async with self.sessions.acquire(
            owner, session_id, create=False, wait_s=self.settings.exec_timeout_s
        ) as held:
            session = held.session
            await self.sessions.restart(session)
            paused = session.paused is not None
        if paused:
            message = (
                f"session {session.id} is paused; what it kept of its interpreter was "
                "discarded, so its next run starts a fresh one. Files in /mnt/data are kept"
            )
        else:
            message = (
                f"the interpreter of session {session.id} was restarted: variables, imports "
                "and processes started before are gone; files in /mnt/data are kept"
            )
        return Restarted(session.id, "paused" if paused else "running", message)

    async def close_session(self, owner: str, session_id: str) -> None:
        await self.sessions.close(owner, session_id)

    async def fork_session(
        self, owner: str, session_id: str, new_session_id: str | None = None
    ) -> Forked:
        """``fork_session``: a new session of ``owner``'s with a copy of ``session_id``'s
        files and variables (:mod:`.sessions.forking`), waiting for the source's call in
        flight as any call does."""
        if self.backend.host_problem is not None:  # no sandbox can start here: say why
            raise BackendUnavailable(self.backend.host_problem)
        wait = self.settings.exec_timeout_s
        return await self.sessions.fork(owner, session_id, new_session_id, wait_s=wait)

    @property
    def replica(self) -> str:
        """This server's name among the replicas of its state directory; empty for a
        server alone (``SANDBOX_REPLICA`` unset)."""
        return self.sessions.instance if self.sessions.replica else ""

    async def list_sessions(self, owner: str) -> list[SessionSummary]:
        """``list_sessions``: ``owner``'s sessions only, running and paused."""
        elsewhere = await self._elsewhere(owner)
        return await summaries(self.sessions.listed(owner), self.threads, elsewhere)

    async def _elsewhere(self, owner: str | None) -> list[SessionRecord]:
        """The sessions other replicas hold (``owner``'s, or every owner's for the operator),
        read in the owner's share of the worker threads: one owner listing in a loop
        reads records in its own share only. None, without a thread, for a server alone."""
        if not self.sessions.replica:
            return []
        if self.sessions.shared is not None:  # the cluster's, as this server sees it now
            return self.sessions.elsewhere(owner)
        return await self.threads.run(owner or _OPERATOR_THREADS, self.sessions.elsewhere, owner)

    def pool_status(self) -> dict[str, Any]:
        """The warm pool as ``list_runtimes``, ``/readyz`` and ``/ui`` show it: ``size``
        (the target; 0: no pool), ``ready`` (started, waiting for a session),
        ``starting``, ``preload`` (modules imported ahead)."""
        return self.sessions.pool_status().as_json()

    def ended_sessions(self) -> Mapping[tuple[str, str], str]:
        """Why each remembered ``(owner, session_id)`` ended, in words (the manager's
        tombstones), for the operator's ``/ui`` page."""
        return self.sessions.tombstones()

    def paused_status(self, owner: str | None) -> dict[str, Any]:
        """Paused sessions as ``/ui`` shows them: ``sessions`` and ``bytes`` on disk
        (``owner``'s; ``None``: every owner's), and the server's rules, which hold for all
        owners together: ``pause_after_m`` (0: idle sessions are not paused),
        ``disk_budget_bytes`` and ``max_sessions``."""
        paused = [s.paused for s in self.sessions.listed(owner) if s.paused is not None]
        return {
            "sessions": len(paused),
            "bytes": sum(p.bytes for p in paused),
            "pause_after_m": self.settings.pause_after_m,
            "disk_budget_bytes": self.settings.paused_disk_bytes,
            "max_sessions": self.settings.max_paused_sessions,
        }

    async def runtimes(self) -> list[dict[str, Any]]:
        """``list_runtimes``: every language with its version, image and limits (runner
        images are looked for again first, and the server's own probe sandbox is asked
        once for versions the backend does not record)."""
        await self.refresh_runners()
        info = self.offer.info  # as the refresh just read it
        before = self.languages()
        unknown = [n for n in before if n in RUNTIMES and not info.get(n, {}).get("version")]
        # A probe sandbox only for what the backend's own records leave out (docker).
        seen = (await self.probe.get() if unknown else self.probe.languages) or {}
        await self._languages_changed(before)
        limits = self.sessions.limits()
        common = {
            "backend": self.backend.name,
            "limits": {
                "memory_bytes": limits.memory_bytes,
                "cpu": limits.cpu,
                "pids": limits.pids,
                "tmp_bytes": limits.tmp_bytes,
                "workspace_quota_bytes": self.settings.workspace_quota_bytes,
                "default_timeout_s": self.settings.exec_timeout_s,
                "max_timeout_s": self.settings.max_exec_timeout_s,
                "max_output_bytes": self.settings.max_output_bytes,
                "max_result_bytes": self.settings.max_result_bytes,
                "enforcement": {
                    **self._enforcement,
                    "workspace": "kernel" if self.sessions.quota_on_disk() else "checked",
                },
            },
        }
        out = []
        for name in self.languages():
            runtime = RUNTIMES.get(name)
            if runtime is None:
                continue  # a runner's: below
            lang = info.get(name, {})
            out.append(
                {
                    "language": name,
                    "version": lang.get("version") or seen.get(name),
                    # The agent's languages all run in the sandbox's image.
                    "image": lang.get("image") or info.get("python", {}).get("image"),
                    "stateful": runtime.stateful,
                    "summary": runtime.summary,
                    "packages": lang.get("packages", {}),
                    **common,
                }
            )
        for name, runner in self.offer.runners.items():
            out.append(
                {
                    "language": name,
                    "version": runner.version,
                    "image": runner.image,
                    "stateful": False,
                    "summary": runner_summary(runner),
                    "packages": dict(runner.packages),
                    **common,
                }
            )
        return out


def _build_notebook(runs: RunLog, files: Files) -> tuple[BinaryIO, notebook.Written]:
    """``runs`` as a notebook, built a cell at a time into a temporary file beside the
    run logs (on the host's disk, not in memory), at its start, to be installed like an
    upload; the caller closes it. Blocking: run in a worker thread."""
    runs.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    spool = tempfile.TemporaryFile(dir=runs.directory)  # noqa: SIM115 - the caller's to close
    try:
        written = notebook.write_notebook(
            runs.records(), _image_reader(files), spool, runs.max_bytes
        )
        spool.seek(0)
    except BaseException:
        spool.close()
        raise
    return spool, written


def _image_reader(files: Files) -> notebook.ReadImage:
    """Reads a workspace image for a notebook: its bytes, or ``None`` when it is gone,
    no longer a regular file, or bigger than ``NOTEBOOK_IMAGE_BYTES``."""
    read_file = files.reader()

    def read(path: str) -> bytes | None:
        try:
            got = read_file(path, NOTEBOOK_IMAGE_BYTES)
        except SandboxError:
            return None
        return got.data if got.eof else None

    return read
