"""Session ids: minted ones, client-chosen ones, and the private key a session is filed under."""

from __future__ import annotations

import hashlib
import re
import secrets

from mcp_code_sandbox.errors import InvalidSessionId

__all__ = ["mint_session_id", "session_key", "validate_session_id"]

_CLIENT_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


def mint_session_id() -> str:
    # 16 random bytes = 128 bits; token_urlsafe uses only letters, digits, '-' and '_'.
    return "sess_" + secrets.token_urlsafe(16)


def validate_session_id(session_id: str) -> str:
    if not _CLIENT_ID.fullmatch(session_id):
        raise InvalidSessionId(
            "a session id is 1 to 64 letters, digits, '.', '_' or '-'; "
            "omit session_id to get a new session"
        )
    return session_id


def session_key(owner: str, session_id: str) -> str:
    """Where a session is filed (directories, cgroups, labels): owner and id never collide
    across owners, and no client-chosen text reaches a path or a label."""
    digest = hashlib.sha256(f"{owner}\0{session_id}".encode()).hexdigest()
    return "s" + digest[:31]
