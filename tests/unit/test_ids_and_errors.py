import re

import pytest

import mcp_code_sandbox.errors as errors_module
from mcp_code_sandbox.errors import ERROR_CODES, InvalidSessionId, SandboxError
from mcp_code_sandbox.sessions.ids import mint_session_id, session_key, validate_session_id

#: The public error codes, in the contract's order: clients branch on them
#: (``_meta.error_code``), so one is added, renamed or dropped only on purpose, here too.
CONTRACT_CODES = (
    "invalid_argument", "invalid_session_id", "session_not_found", "session_busy",
    "max_sessions", "invalid_filename", "invalid_path", "not_found", "file_exists",
    "invalid_content", "code_too_large", "upload_too_large", "artifact_too_large",
    "quota_exceeded", "unsupported_language", "network_not_allowed", "env_not_allowed",
    "backend_unavailable", "sandbox_failed", "unauthorized", "internal_error",
)  # fmt: skip


def test_error_codes_are_exactly_the_contracts() -> None:
    assert tuple(ERROR_CODES) == CONTRACT_CODES


def test_every_exported_name_exists() -> None:
    for name in errors_module.__all__:
        assert hasattr(errors_module, name)


def test_error_text_is_code_colon_message() -> None:
    err = InvalidSessionId("bad")
    assert str(err) == "invalid_session_id: bad"
    assert isinstance(err, SandboxError)


def test_each_code_carries_its_http_status() -> None:
    # What /files answers a refused upload with, read from the tree (no table elsewhere).
    statuses = {cls.code: cls.http_status for cls in SandboxError.__subclasses__()}
    assert set(statuses) == set(ERROR_CODES)
    expected = {
        "unauthorized": 401, "invalid_session_id": 400, "invalid_filename": 400,
        "invalid_path": 400, "invalid_argument": 400, "file_exists": 409,
        "session_busy": 409, "upload_too_large": 413, "quota_exceeded": 413,
        "max_sessions": 429, "backend_unavailable": 503,
    }  # fmt: skip
    assert statuses == {code: expected.get(code, 500) for code in ERROR_CODES}
    # The tree drawn in the module's docstring says the same.
    for code, status in statuses.items():
        assert re.search(rf"{code}\s+{status}\n", errors_module.__doc__ or ""), code


def test_minted_ids_are_unique_and_valid() -> None:
    ids = {mint_session_id() for _ in range(1000)}
    assert len(ids) == 1000
    for sid in ids:
        assert sid.startswith("sess_")
        assert len(sid) >= 5 + 22  # 16 bytes of randomness, url-safe
        assert validate_session_id(sid) == sid


@pytest.mark.parametrize("bad", ["", "a" * 65, "../x", "a/b", "a b", "x\0", "é"])
def test_client_ids_are_checked(bad: str) -> None:
    with pytest.raises(InvalidSessionId):
        validate_session_id(bad)


def test_keys_separate_owners() -> None:
    assert session_key("alice", "conv-1") != session_key("bob", "conv-1")
    assert re.fullmatch(r"s[0-9a-f]{31}", session_key("alice", "conv-1"))


def test_an_error_hides_the_servers_directories_it_names() -> None:
    names = {"/data": "$SANDBOX_STATE_DIR", "/data/runtime": "$SANDBOX_RUNTIME_DIR"}
    err = errors_module.SandboxFailed(
        "docker: bind source path does not exist: /data/workspaces/s1 (pip: '/data/runtime/"
        "venv/bin/pip' failed; in /mnt/data, /data2 and /old/data nothing changed) /data"
    )
    assert err.hide_paths(names)
    assert err.message == (
        "docker: bind source path does not exist: $SANDBOX_STATE_DIR/workspaces/s1 (pip: "
        "'$SANDBOX_RUNTIME_DIR/venv/bin/pip' failed; in /mnt/data, /data2 and /old/data "
        "nothing changed) $SANDBOX_STATE_DIR"
    )
    assert str(err).startswith("sandbox_failed: docker: bind source")
    untouched = errors_module.NotFound("'data/x' does not exist in /mnt/data")
    assert not untouched.hide_paths(names) and not untouched.hide_paths({"/": "root"})
    assert untouched.message == "'data/x' does not exist in /mnt/data"
