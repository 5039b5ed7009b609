"""Output schemas of the tools (DESIGN.md §6): what ``structuredContent`` holds.

No base64 in here: images travel as content blocks beside the structured result.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

__all__ = [
    "CloseResult",
    "DisplayOut",
    "ExportNotebookResult",
    "FileEntryOut",
    "FileOut",
    "ForkResult",
    "ListFilesResult",
    "ReadFileResult",
    "RestartResult",
    "RunError",
    "RunResult",
    "RuntimeOut",
    "RuntimesResult",
    "UploadResult",
]


class FileOut(BaseModel):
    path: str = Field(description="Relative to /mnt/data")
    size_bytes: int
    mime_type: str
    change: Literal["created", "modified"]
    download_url: str | None = None


class RunError(BaseModel):
    name: str
    value: str
    traceback: str


class DisplayOut(BaseModel):
    """A text-like rich output of display() or of a cell's value, marked by its type:
    markdown, HTML, LaTeX, JSON, SVG or plain text; images are blocks."""

    mime_type: str
    text: str


class RunResult(BaseModel):
    session_id: str
    session_created: bool
    notice: str | None = None
    resumed: Literal["memory", "variables"] | None = Field(
        None,
        description="The session had been paused while idle and came back for this call: "
        "with its whole memory, or with its saved variables (notice names what was not "
        "kept); absent when it was not paused",
    )
    language: str
    status: Literal["ok", "error", "timeout", "cancelled"]
    exit_code: int | None = None
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    full_output_path: str | None = None
    result: str | None = Field(None, description="Text repr of the last expression (Out[n])")
    error: RunError | None = None
    files: list[FileOut]
    displays: list[DisplayOut] = Field(default_factory=list)
    execution_count: int | None = None
    duration_ms: int
    state_lost: bool = Field(description="True when a restart dropped variables")
    # The result budget (SANDBOX_MAX_RESULT_BYTES): what was cut to fit; `notice` says how.
    result_truncated: bool = False
    error_truncated: bool = False
    displays_truncated: bool = Field(False, description="Some display() outputs were left out")
    files_truncated: bool = Field(
        False, description="`files` lists only some of the changed files: list_files has all"
    )
    blocked_hosts: list[str] = Field(
        default_factory=list,
        description="Hosts the network policy refused during this run (network=true only)",
    )


class UploadResult(BaseModel):
    session_id: str
    path: str
    size_bytes: int
    session_created: bool
    notice: str | None = None


class ReadFileResult(BaseModel):
    session_id: str
    path: str
    mime_type: str
    size_bytes: int
    offset: int
    returned_bytes: int
    eof: bool
    next_offset: int | None = None
    encoding: Literal["text", "image", "resource"]
    download_url: str | None = None
    #: Why an image came back as bytes rather than as an image (no preview).
    notice: str | None = None


class FileEntryOut(BaseModel):
    path: str
    size_bytes: int
    modified: str
    mime_type: str
    type: Literal["file", "directory", "symlink", "other"]


class ListFilesResult(BaseModel):
    session_id: str
    path: str
    entries: list[FileEntryOut]
    truncated: bool
    #: More entries exist: call again with ``offset`` set to this (the result budget, or
    #: the listing's own limit, cut the list here). None: this is the end.
    next_offset: int | None = None


class CloseResult(BaseModel):
    session_id: str
    status: Literal["closed"]


class RestartResult(BaseModel):
    session_id: str
    restarted: Literal[True]
    state: Literal["running", "paused"] = Field(
        description="paused: the session stays paused; its next run starts the fresh "
        "interpreter (its saved variables are not loaded)"
    )
    message: str


class VariableOut(BaseModel):
    name: str
    type: str


class SessionOut(BaseModel):
    session_id: str
    created: str = Field(description="ISO 8601, UTC")
    last_active: str = Field(description="ISO 8601, UTC; now while a call holds the session")
    state: Literal["running", "paused"] = Field(
        description="paused: idle, its sandbox put away to disk; the next run_code resumes it"
    )
    workspace_bytes: int | None = Field(
        None, description="Bytes its /mnt/data holds (installed packages and saved state too)"
    )
    file_count: int | None = None
    saved_variables: list[VariableOut] | None = Field(
        None, description="Variables a pause saved (paused sessions kept by their variables)"
    )
    saved_variables_more: int = Field(0, description="Saved variables not listed here")


class SessionsResult(BaseModel):
    sessions: list[SessionOut]


class RuntimeOut(BaseModel):
    language: str
    version: str | None
    backend: str
    image: str | None
    stateful: bool
    summary: str
    packages: dict[str, str]
    limits: dict[str, Any]


class PoolOut(BaseModel):
    """The warm pool: sandboxes started ahead for new sessions (``size`` 0: off), and the
    modules their Python imported ahead (a first ``import pandas`` then costs nothing)."""

    size: int = Field(description="Warm sandboxes the pool aims to hold now; 0: no pool")
    ready: int
    starting: int
    preload: list[str]
    floor: int = Field(description="SANDBOX_POOL_SIZE: the size at rest")
    ceiling: int = Field(description="The most the size grows to during a burst")
    trend: str = Field(description="resting, grown (after a burst) or shrinking (idle)")


class RuntimesResult(BaseModel):
    runtimes: list[RuntimeOut]
    pool: PoolOut
    notice: str | None = Field(
        None,
        description="Why no sandbox can start now, and what the operator runs to fix it "
        "(as /readyz says); absent when sandboxes can start",
    )


class ExportNotebookResult(BaseModel):
    session_id: str
    path: str = Field(description="The notebook, relative to /mnt/data")
    size_bytes: int
    runs: int = Field(description="Runs in the notebook, in the order they ran")
    download_url: str | None = Field(
        None, description="Where a person can download it (over HTTP; none over stdio)"
    )
    notice: str | None = Field(
        None, description="What the notebook leaves out (its last cell says it too)"
    )


class ForkResult(BaseModel):
    session_id: str = Field(description="The new session: use it like any other")
    forked_from: str = Field(description="The session copied; it runs on untouched")
    state: Literal["variables", "files"] = Field(
        description="What of the interpreter was copied: its variables and imports, or "
        "none (files only; notice says why)"
    )
    file_count: int = Field(description="Files copied into the new /mnt/data")
    bytes_copied: int
    variables: list[str] = Field(description="Variables and modules restored in the fork")
    variables_more: int = Field(0, description="Restored ones not listed here")
    notice: str | None = Field(
        None,
        description="What was not copied: variables that could not be saved, open files, "
        "threads, processes, files that are not plain files",
    )
