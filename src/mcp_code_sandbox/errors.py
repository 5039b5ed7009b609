"""The one error tree of mcp-code-sandbox.

Every failure that reaches a client is a :class:`SandboxError` whose ``code`` is one of the
codes of DESIGN.md §7. The MCP layer turns it into ``isError: true`` with the text
``"<code>: <message>"`` and ``_meta.error_code``; the message says what to do next.

    SandboxError                                     HTTP status (``http_status``)
    ├── InvalidArgument          invalid_argument      400
    ├── InvalidSessionId         invalid_session_id    400
    ├── SessionNotFound          session_not_found     500
    ├── SessionBusy              session_busy          409
    ├── MaxSessions              max_sessions          429
    ├── InvalidFilename          invalid_filename      400
    ├── InvalidPath              invalid_path          400
    ├── NotFound                 not_found             500
    ├── FileExists_              file_exists           409
    ├── InvalidContent           invalid_content       500
    ├── CodeTooLarge             code_too_large        500
    ├── UploadTooLarge           upload_too_large      413
    ├── ArtifactTooLarge         artifact_too_large    500
    ├── QuotaExceeded            quota_exceeded        413
    ├── UnsupportedLanguage      unsupported_language  500
    ├── NetworkNotAllowed        network_not_allowed   500
    ├── EnvNotAllowed            env_not_allowed       500
    ├── BackendUnavailable       backend_unavailable   503
    ├── SandboxFailed            sandbox_failed        500
    ├── Unauthorized             unauthorized          401
    └── InternalError            internal_error        500

Each class carries the HTTP status an HTTP route answers its code with (``http_status``:
the ``/files`` upload route), so no table in the server repeats the tree.

Foreign errors (OSError from a backend, docker-py's exceptions, a broken agent frame) are
translated into this tree at the boundary that sees them (the backend, the agent client),
never further up. User code that fails is *not* an error: it is data in the run result.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar

__all__ = [
    "ERROR_CODES",
    "ArtifactTooLarge",
    "BackendUnavailable",
    "CodeTooLarge",
    "EnvNotAllowed",
    "FileExists_",
    "InternalError",
    "InvalidArgument",
    "InvalidContent",
    "InvalidFilename",
    "InvalidPath",
    "InvalidSessionId",
    "MaxSessions",
    "NetworkNotAllowed",
    "NotFound",
    "QuotaExceeded",
    "SandboxError",
    "SandboxFailed",
    "SessionBusy",
    "SessionNotFound",
    "Unauthorized",
    "UnsupportedLanguage",
    "UploadTooLarge",
]


class SandboxError(Exception):
    """Base of every error a client can see. ``code`` is the machine-readable part."""

    code: ClassVar[str] = "internal_error"
    #: The HTTP status of this code where HTTP routes answer with it (``/files`` PUT):
    #: 500 unless the code names a fault of the request (4xx) or a backend that is down.
    http_status: ClassVar[int] = 500
    #: The message may quote another program (the Docker engine, pip, a tool the server
    #: ran) or the OS, and so a host path: ``hide_paths`` runs on it before a client
    #: sees it. The other codes' messages are the server's own words and what the client
    #: sent (a path it gave is its own, and hiding it would tell it whose path it was).
    quotes_host: ClassVar[bool] = False

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        #: Extra machine-readable facts (e.g. ``download_url``); never secrets or file contents.
        self.details = details

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    def hide_paths(self, names: Mapping[str, str]) -> bool:
        """Replace each host path of ``names`` (path -> what to call it instead) where the
        message names it, or a path below it; ``True`` if any was. Only a whole path
        counts (``/data`` is not in ``/mnt/data``). The server's boundaries call it
        (``SandboxService.public_error``): a message may quote text a tool, pip or the
        Docker engine wrote, and no client is told where the server keeps its files."""
        shown = {path.rstrip("/"): name for path, name in names.items() if path.strip("/")}
        if not shown:
            return False
        longest_first = "|".join(map(re.escape, sorted(shown, key=len, reverse=True)))
        whole = re.compile(rf"(?<![\w.~/-])({longest_first})(?![\w.~-])")
        hidden = whole.sub(lambda match: shown[match.group(1)], self.message)
        if hidden == self.message:
            return False
        self.message = hidden
        self.args = (hidden,)
        return True


class InvalidArgument(SandboxError):
    code = "invalid_argument"
    http_status = 400


class InvalidSessionId(SandboxError):
    code = "invalid_session_id"
    http_status = 400


class SessionNotFound(SandboxError):
    code = "session_not_found"


class SessionBusy(SandboxError):
    code = "session_busy"
    http_status = 409


class MaxSessions(SandboxError):
    code = "max_sessions"
    http_status = 429


class InvalidFilename(SandboxError):
    code = "invalid_filename"
    http_status = 400


class InvalidPath(SandboxError):
    code = "invalid_path"
    http_status = 400


class NotFound(SandboxError):
    code = "not_found"


class FileExists_(SandboxError):
    code = "file_exists"
    http_status = 409


class InvalidContent(SandboxError):
    code = "invalid_content"


class CodeTooLarge(SandboxError):
    code = "code_too_large"


class UploadTooLarge(SandboxError):
    code = "upload_too_large"
    http_status = 413


class ArtifactTooLarge(SandboxError):
    code = "artifact_too_large"


class QuotaExceeded(SandboxError):
    code = "quota_exceeded"
    http_status = 413


class UnsupportedLanguage(SandboxError):
    code = "unsupported_language"


class NetworkNotAllowed(SandboxError):
    code = "network_not_allowed"


class EnvNotAllowed(SandboxError):
    code = "env_not_allowed"


class BackendUnavailable(SandboxError):
    code = "backend_unavailable"
    http_status = 503
    quotes_host = True


class SandboxFailed(SandboxError):
    code = "sandbox_failed"
    quotes_host = True


class Unauthorized(SandboxError):
    code = "unauthorized"
    http_status = 401


class InternalError(SandboxError):
    code = "internal_error"
    quotes_host = True


#: Every public code, in the order of DESIGN.md §7.
ERROR_CODES: tuple[str, ...] = tuple(
    cls.code
    for cls in (
        InvalidArgument,
        InvalidSessionId,
        SessionNotFound,
        SessionBusy,
        MaxSessions,
        InvalidFilename,
        InvalidPath,
        NotFound,
        FileExists_,
        InvalidContent,
        CodeTooLarge,
        UploadTooLarge,
        ArtifactTooLarge,
        QuotaExceeded,
        UnsupportedLanguage,
        NetworkNotAllowed,
        EnvNotAllowed,
        BackendUnavailable,
        SandboxFailed,
        Unauthorized,
        InternalError,
    )
)
