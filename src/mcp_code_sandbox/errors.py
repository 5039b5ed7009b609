"""The one error tree of mcp-code-sandbox.

Every failure that reaches a client is a :class:`SandboxError` whose ``code`` is one of the
codes of DESIGN.md §7. The MCP layer turns it into ``isError: true`` with the text
``"<code>: <message>"`` and ``_meta.error_code``; the message says what to do next.

    SandboxError
    ├── InvalidArgument          invalid_argument
    ├── InvalidSessionId         invalid_session_id
    ├── SessionNotFound          session_not_found
    ├── SessionBusy              session_busy
    ├── MaxSessions              max_sessions
    ├── InvalidFilename          invalid_filename
    ├── InvalidPath              invalid_path
    ├── NotFound                 not_found
    ├── FileExists_              file_exists
    ├── InvalidContent           invalid_content
    ├── CodeTooLarge             code_too_large
    ├── UploadTooLarge           upload_too_large
    ├── ArtifactTooLarge         artifact_too_large
    ├── QuotaExceeded            quota_exceeded
    ├── UnsupportedLanguage      unsupported_language
    ├── NetworkNotAllowed        network_not_allowed
    ├── EnvNotAllowed            env_not_allowed
    ├── BackendUnavailable       backend_unavailable
    ├── SandboxFailed            sandbox_failed
    ├── Unauthorized             unauthorized
    └── InternalError            internal_error

Foreign errors (OSError from a backend, docker-py's exceptions, a broken agent frame) are
translated into this tree at the boundary that sees them (the backend, the agent client),
never further up. User code that fails is *not* an error: it is data in the run result.
"""

from __future__ import annotations

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

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        #: Extra machine-readable facts (e.g. ``download_url``); never secrets or file contents.
        self.details = details

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class InvalidArgument(SandboxError):
    code = "invalid_argument"


class InvalidSessionId(SandboxError):
    code = "invalid_session_id"


class SessionNotFound(SandboxError):
    code = "session_not_found"


class SessionBusy(SandboxError):
    code = "session_busy"


class MaxSessions(SandboxError):
    code = "max_sessions"


class InvalidFilename(SandboxError):
    code = "invalid_filename"


class InvalidPath(SandboxError):
    code = "invalid_path"


class NotFound(SandboxError):
    code = "not_found"


class FileExists_(SandboxError):
    code = "file_exists"


class InvalidContent(SandboxError):
    code = "invalid_content"


class CodeTooLarge(SandboxError):
    code = "code_too_large"


class UploadTooLarge(SandboxError):
    code = "upload_too_large"


class ArtifactTooLarge(SandboxError):
    code = "artifact_too_large"


class QuotaExceeded(SandboxError):
    code = "quota_exceeded"


class UnsupportedLanguage(SandboxError):
    code = "unsupported_language"


class NetworkNotAllowed(SandboxError):
    code = "network_not_allowed"


class EnvNotAllowed(SandboxError):
    code = "env_not_allowed"


class BackendUnavailable(SandboxError):
    code = "backend_unavailable"


class SandboxFailed(SandboxError):
    code = "sandbox_failed"


class Unauthorized(SandboxError):
    code = "unauthorized"


class InternalError(SandboxError):
    code = "internal_error"


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
