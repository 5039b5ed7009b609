"""The workspace's files for a host that cannot see them: the agent's ``fs`` requests.

On Kubernetes the server cannot open a pod's ``/mnt/data`` (an emptyDir): uploads,
reads, listings, the snapshots behind a run's files and the quota walk come here, one
request at a time like ``exec``, and never while a run is in flight (the supervisor
refuses them then). The host's agent-backed workspace
(:mod:`mcp_code_sandbox.sessions.agent_files`) sends them; it has already checked the
client's path as a string, and sends its components.

The same rules hold here as on the host's own directory (:mod:`mcp_code_sandbox.workspace`),
because the requests still come from a client and the tree is still the sandbox's:

- Components are checked again (no empty name, ``.``, ``..``, ``/`` or NUL, at most 255
  bytes each) and opened one at a time from the root's fd with ``O_NOFOLLOW``: no link
  is followed and nothing outside ``/mnt/data`` is reached, whatever user code planted.
- Only regular files with one hard link are read, opened ``O_NONBLOCK`` (a FIFO cannot
  hang the agent).
- Replies are bounded: a read sends at most ``READ_PAGE_BYTES`` (the host asks again for
  the rest), a walk reads at most the entries asked for (capped by ``MAX_WALK_ENTRIES``)
  and sends them in pages of about ``PAGE_BYTES`` (``next`` says where the next page
  starts), so no reply comes near ``MAX_FRAME_BYTES``. Names that are not UTF-8 are sent
  with U+FFFD in them, as the host lists them.
- A write goes to a temporary name in its directory, in chunks of at most
  ``WRITE_CHUNK_BYTES``, and is renamed (or, without ``overwrite``, hard-linked) into
  place at its last chunk; the quota is checked before its first byte. Any failure,
  a new write or an ``abort`` removes the temporary file.

Requests (``{"op": "fs", "id": int, "action": ...}``, binary data in base64) and their
answers (``{"ev": "fs", "id": int, "ok": true, ...}`` or ``"ok": false`` with ``code``
and ``message``) are in :mod:`.protocol`.
"""

from __future__ import annotations

import base64
import binascii
import errno
import os
import secrets
import stat
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, cast

from .dirfd import (
    DIR_FLAGS,
    FILE_FLAGS,
    Budget,
    closing_fd,
    counted_bytes,
    describe,
    pread_all,
    walk,
    write_all,
)
from .protocol import FsEvent

__all__ = [
    "HEAD_BYTES",
    "MAX_WALK_ENTRIES",
    "PAGE_BYTES",
    "READ_PAGE_BYTES",
    "WRITE_CHUNK_BYTES",
    "Files",
]

#: Bytes of a file read per reply; base64 makes 4/3 of it, far below ``MAX_FRAME_BYTES``.
READ_PAGE_BYTES = 8 << 20
#: The most a write chunk may carry (decoded); the host sends at most this much per frame.
WRITE_CHUNK_BYTES = 8 << 20
#: Bytes of walk entries (their paths, plus ``_ENTRY_OVERHEAD`` each) per reply.
PAGE_BYTES = 8 << 20
#: The most entries one walk reads, whatever the host asks: the host's own largest.
MAX_WALK_ENTRIES = 200_000
#: A file's first bytes, sent with every read: the host guesses its type from them.
HEAD_BYTES = 512
#: What an entry's numbers and JSON punctuation take beside its path, at most.
_ENTRY_OVERHEAD = 100
_MAX_NAME_BYTES = 255
_TMP_PREFIX = ".mcs-upload-"
_NO_FOLLOW_HINT = "the server never follows links inside the workspace"


class _Refused(Exception):
    """A request the workspace's rules refuse: answered ``ok: false`` with ``code``."""

    def __init__(self, code: str, message: str, **details: int) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = details


@dataclass
class _Upload:
    """A write between its first chunk and its last: its temporary file in its directory."""

    parts: tuple[str, ...]
    dir_fd: int
    fd: int
    tmp: str
    size: int
    written: int
    overwrite: bool


@dataclass(frozen=True)
class _Walked:
    """A walk's items (lists, as sent), whether it was cut short, and the bytes a
    snapshot counts beside its files (hidden directories, preallocated blocks)."""

    items: list[list[Any]]
    truncated: bool
    extra_bytes: int = 0


class Files:
    """The ``fs`` requests on the workspace directory ``root`` (the agent's workdir)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._upload: _Upload | None = None
        #: The last walk, for its next pages: ``(request key, walk)``.
        self._walked: tuple[tuple[Any, ...], _Walked] | None = None

    def handle(self, message: dict[str, Any]) -> FsEvent:
        """The answer to one ``fs`` request (never raises for a bad one)."""
        action = message.get("action")
        answer: dict[str, Any] = {"ev": "fs", "id": message.get("id"), "ok": True}
        try:
            if action != "write":
                self.abort()  # a write's chunks come one after the other, or not at all
            if action not in ("list", "snapshot"):
                self._walked = None
            answer.update(self._dispatch(action, message))
        except _Refused as exc:
            self.abort()
            answer.update(ok=False, code=exc.code, message=exc.message)
            if exc.details:
                answer["details"] = exc.details
        except OSError as exc:
            self.abort()
            answer.update(ok=False, **_os_error(exc))
        return cast(FsEvent, answer)

    def abort(self) -> None:
        """Drop a write in progress: its temporary file goes."""
        upload, self._upload = self._upload, None
        if upload is None:
            return
        os.close(upload.fd)
        with suppress(OSError):
            os.unlink(upload.tmp, dir_fd=upload.dir_fd)
        os.close(upload.dir_fd)

    def close(self) -> None:
        self.abort()

    # -- dispatch ------------------------------------------------------------------------

    def _dispatch(self, action: Any, message: dict[str, Any]) -> dict[str, Any]:
        if action == "read":
            return self._read(message)
        if action == "list":
            return self._list(message)
        if action == "snapshot":
            return self._snapshot(message)
        if action == "usage":
            with closing_fd(self._open_root()) as root:
                return {"bytes": _usage(root, _limit(message, MAX_WALK_ENTRIES))}
        if action == "write":
            return self._write(message)
        if action == "abort":
            return {}
        raise _Refused("invalid_argument", f"unknown fs action {action!r}")

    # -- reading -------------------------------------------------------------------------

    def _read(self, message: dict[str, Any]) -> dict[str, Any]:
        parts = _parts(message)
        offset = _count(message, "offset")
        want = min(_count(message, "max_bytes"), READ_PAGE_BYTES)
        shown = _shown(parts)
        if not parts:
            raise _Refused(
                "invalid_path", "'.' is the workspace directory; use list_files to see its files"
            )
        with (
            closing_fd(self._open_root()) as root,
            closing_fd(self._open_dir(root, parts[:-1], create=False)) as dir_fd,
        ):
            try:
                fd = os.open(parts[-1], FILE_FLAGS, dir_fd=dir_fd)
            except FileNotFoundError:
                raise _not_found(shown) from None
            except OSError as exc:
                raise _open_error(exc, dir_fd, parts[-1], shown, wanted="a file") from exc
        with closing_fd(fd):
            st = os.fstat(fd)
            _check_servable(st, shown)
            data = pread_all(fd, offset, want)
            head = os.pread(fd, HEAD_BYTES, 0)
        return {
            "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
            "data": base64.b64encode(data).decode("ascii"),
            "head": base64.b64encode(head).decode("ascii"),
        }

    # -- walks ---------------------------------------------------------------------------

    def _list(self, message: dict[str, Any]) -> dict[str, Any]:
        parts = _parts(message)
        recursive = message.get("recursive") is not False
        limit = _limit(message, MAX_WALK_ENTRIES)
        skip = _names(message.get("skip"))
        key = ("list", parts, recursive, limit, skip)

        def items() -> _Walked:
            budget = Budget(limit)
            with (
                closing_fd(self._open_root()) as root,
                closing_fd(self._open_dir(root, parts, create=False)) as fd,
            ):
                walked = walk(fd, "/".join(parts), recursive=recursive, budget=budget, skip=skip)
                found = [[path, st.st_mode, st.st_size, st.st_mtime_ns] for path, st in walked]
            return _Walked(found, budget.truncated)

        return self._page(key, message, items, "entries")

    def _snapshot(self, message: dict[str, Any]) -> dict[str, Any]:
        limit = _limit(message, MAX_WALK_ENTRIES)
        skip = _names(message.get("skip"))
        count_hidden = message.get("count_hidden") is True
        key = ("snapshot", limit, skip, count_hidden)

        def items() -> _Walked:
            budget = Budget(limit)
            files: list[Any] = []
            preallocated = 0
            with closing_fd(self._open_root()) as root:
                for path, st in walk(root, "", recursive=True, budget=budget, skip=skip):
                    if stat.S_ISREG(st.st_mode):
                        files.append([path, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino])
                        preallocated += counted_bytes(st) - st.st_size
                hidden = sum(self._hidden_usage(root, name) for name in skip) if count_hidden else 0
            return _Walked(files, budget.truncated, hidden + preallocated if count_hidden else 0)

        return self._page(key, message, items, "files")

    def _page(
        self,
        key: tuple[Any, ...],
        message: dict[str, Any],
        walker: Callable[[], _Walked],
        field: str,
    ) -> dict[str, Any]:
        """One page of a walk's items from ``start``: walked afresh at ``start`` 0, else
        the same walk's next page (nothing runs in between: the host holds the lock)."""
        start = _count(message, "start")
        if start == 0 or self._walked is None or self._walked[0] != key:
            self._walked = (key, walker())
        walked = self._walked[1]
        found = walked.items
        page: list[Any] = []
        size = 0
        end = start
        while end < len(found) and (not page or size + _weight(found[end]) <= PAGE_BYTES):
            size += _weight(found[end])
            page.append(found[end])
            end += 1
        more = end < len(found)
        if not more:
            self._walked = None
        return {field: page, "truncated": walked.truncated, "next": end if more else None,
                "extra_bytes": walked.extra_bytes}  # fmt: skip

    def _hidden_usage(self, root: int, name: str) -> int:
        try:
            fd = self._open_dir(root, (name,), create=False)
        except _Refused:
            return 0
        with closing_fd(fd):
            return _usage(fd, MAX_WALK_ENTRIES)

    # -- writing -------------------------------------------------------------------------

    def _write(self, message: dict[str, Any]) -> dict[str, Any]:
        parts = _parts(message)
        if not parts:
            raise _Refused("invalid_path", "the workspace itself is not a file")
        offset = _count(message, "offset")
        data = _data(message)
        end = message.get("end") is True
        if offset == 0:
            self.abort()
            self._upload = self._begin(parts, message)
        upload = self._upload
        if upload is None or upload.parts != parts or upload.written != offset:
            self.abort()
            raise _Refused("invalid_argument", "a write chunk out of order; start again at 0")
        if upload.written + len(data) > upload.size:
            raise _Refused("invalid_argument", "more data than the write's size")
        write_all(upload.fd, data)
        upload.written += len(data)
        if not end:
            return {}
        if upload.written != upload.size:
            raise _Refused("invalid_argument", "the write ended before its size")
        st = os.fstat(upload.fd)
        try:
            _publish(upload.dir_fd, upload.tmp, parts[-1], _shown(parts), upload.overwrite)
        finally:
            self.abort()  # the temporary name: gone after a rename, left after a link
        return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}

    def _begin(self, parts: tuple[str, ...], message: dict[str, Any]) -> _Upload:
        size = _count(message, "size")
        quota = _count(message, "quota")
        overwrite = message.get("overwrite") is True
        shown = _shown(parts)
        with closing_fd(self._open_root()) as root:
            replaced = self._existing_size(root, parts, shown, overwrite=overwrite)
            used = _usage(root, MAX_WALK_ENTRIES)
            if used - replaced + size > quota:
                raise _Refused(
                    "quota_exceeded",
                    f"writing '{shown}' ({size} bytes) would exceed the workspace quota: "
                    f"{used} of {quota} bytes are in use; delete files you no longer "
                    "need (e.g. with run_code) or write less",
                    used_bytes=used,
                    quota_bytes=quota,
                )
            dir_fd = self._open_dir(root, parts[:-1], create=True)
        tmp = f"{_TMP_PREFIX}{secrets.token_hex(8)}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags, 0o644, dir_fd=dir_fd)
            os.fchmod(fd, 0o644)
        except BaseException:
            os.close(dir_fd)
            raise
        return _Upload(parts, dir_fd, fd, tmp, size, 0, overwrite)

    def _existing_size(
        self, root: int, parts: tuple[str, ...], shown: str, *, overwrite: bool
    ) -> int:
        """Size of the regular file a write would replace (0 for none); refuses the rest."""
        try:
            dir_fd = self._open_dir(root, parts[:-1], create=False)
        except _Refused as exc:
            if exc.code == "not_found":
                return 0
            raise
        with closing_fd(dir_fd):
            try:
                st = os.stat(parts[-1], dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                return 0
            what = describe(dir_fd, parts[-1])
        if not overwrite:
            raise _exists(shown)
        if not stat.S_ISREG(st.st_mode):
            raise _Refused(
                "invalid_path",
                f"'{shown}' exists and is {what}; only regular files can be overwritten",
            )
        return st.st_size

    # -- opening -------------------------------------------------------------------------

    def _open_root(self) -> int:
        try:
            return os.open(self.root, DIR_FLAGS)
        except FileNotFoundError:
            raise _Refused("internal_error", "the workspace directory is gone") from None

    def _open_dir(self, root: int, parts: tuple[str, ...], *, create: bool) -> int:
        """An fd of the directory ``parts`` below ``root``, one O_NOFOLLOW step at a time."""
        fd = os.dup(root)
        for i, name in enumerate(parts):
            try:
                child = self._step(fd, name, _shown(parts[: i + 1]), create=create)
            finally:
                os.close(fd)
            fd = child
        return fd

    def _step(self, dir_fd: int, name: str, shown: str, *, create: bool) -> int:
        try:
            return os.open(name, DIR_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            if not create:
                raise _not_found(shown) from None
        except OSError as exc:
            raise _open_error(exc, dir_fd, name, shown, wanted="a directory") from exc
        try:
            os.mkdir(name, 0o755, dir_fd=dir_fd)
        except FileExistsError:  # made meanwhile: open it with the same checks
            return self._step(dir_fd, name, shown, create=False)
        fd = self._step(dir_fd, name, shown, create=False)
        os.fchmod(fd, 0o755)
        return fd


# -- request fields: checked, the frame is only a claim ---------------------------------


def _parts(message: dict[str, Any]) -> tuple[str, ...]:
    raw = message.get("path", [])
    if not isinstance(raw, list) or len(raw) > 4096:
        raise _Refused("invalid_path", "path must be a list of names")
    for name in raw:
        if (
            not isinstance(name, str)
            or name in ("", ".", "..")
            or "/" in name
            or "\x00" in name
            or len(name.encode("utf-8", "surrogateescape")) > _MAX_NAME_BYTES
        ):
            raise _Refused("invalid_path", f"invalid name in path: {name!r:.300}")
    return tuple(raw)


def _names(raw: Any) -> frozenset[str]:
    if not isinstance(raw, list) or not all(isinstance(n, str) for n in raw):
        return frozenset()
    return frozenset(raw)


def _count(message: dict[str, Any], key: str) -> int:
    value = message.get(key, 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise _Refused("invalid_argument", f"{key} must be an integer, 0 or more")
    return value


def _limit(message: dict[str, Any], cap: int) -> int:
    value = _count(message, "limit")
    return min(value, cap) if value > 0 else cap


def _data(message: dict[str, Any]) -> bytes:
    raw = message.get("data", "")
    if not isinstance(raw, str) or len(raw) > (WRITE_CHUNK_BYTES // 3 + 1) * 4:
        raise _Refused("invalid_argument", f"data must be base64 of at most {WRITE_CHUNK_BYTES}")
    try:
        return base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise _Refused("invalid_argument", "data is not base64") from None


def _shown(parts: tuple[str, ...]) -> str:
    return "/".join(parts) if parts else "."


def _weight(item: list[Any]) -> int:
    # A character is at most 6 bytes in the frame: 4 of UTF-8, or a control's \u001b.
    return len(item[0]) * 6 + _ENTRY_OVERHEAD


# -- the rules and their messages (the host's own words, see workspace.core) ---------------


def _not_found(shown: str) -> _Refused:
    return _Refused(
        "not_found", f"'{shown}' does not exist in /mnt/data; list_files shows what does"
    )


def _exists(shown: str) -> _Refused:
    return _Refused(
        "file_exists",
        f"'{shown}' already exists; pass overwrite=true to replace it, or pick another name",
    )


def _check_servable(st: os.stat_result, shown: str) -> None:
    if stat.S_ISDIR(st.st_mode):
        raise _Refused(
            "invalid_path", f"'{shown}' is a directory; use list_files to see what is in it"
        )
    if not stat.S_ISREG(st.st_mode):
        raise _Refused(
            "invalid_path",
            f"'{shown}' is not a regular file (a FIFO, socket or device); "
            "only regular files can be read",
        )
    if st.st_nlink != 1:
        raise _Refused(
            "invalid_path",
            f"'{shown}' has {st.st_nlink} hard links; the server does not serve hard-linked "
            "files, because a link can point at a file outside the workspace. Make a copy "
            "in the sandbox (e.g. shutil.copy) and read that",
        )


def _open_error(exc: OSError, dir_fd: int, name: str, shown: str, *, wanted: str) -> _Refused:
    """The refusal for a failed O_NOFOLLOW open of ``name``."""
    if exc.errno in (errno.ENOTDIR, errno.ELOOP, errno.ENXIO, errno.EOPNOTSUPP):
        what = describe(dir_fd, name)
        if what == "a symbolic link":
            return _Refused(
                "invalid_path",
                f"'{shown}' is a symbolic link; {_NO_FOLLOW_HINT}. Read the "
                "file it points to by its own path, or copy it",
            )
        return _Refused("invalid_path", f"'{shown}' is {what}, not {wanted}")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return _Refused(
            "invalid_path",
            f"'{shown}' is not readable by the server; make it readable "
            "in the sandbox (chmod u+r, or u+rx for a directory)",
        )
    name_ = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return _Refused("internal_error", f"cannot open '{shown}': {name_}")


def _os_error(exc: OSError) -> dict[str, str]:
    """What nobody expected, by its errno name only (never a path of the agent's)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        message = "the disk that holds the workspace is full; delete files you no longer need"
        return {"code": "quota_exceeded", "message": message}
    code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return {"code": "internal_error", "message": f"file system error: {code}"}


def _publish(dir_fd: int, tmp: str, name: str, shown: str, overwrite: bool) -> None:
    try:
        if overwrite:
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        else:
            # link() fails when ``name`` exists, even if user code made it a moment ago.
            os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    except FileExistsError:
        raise _exists(shown) from None
    except (IsADirectoryError, NotADirectoryError):
        raise _Refused(
            "invalid_path",
            f"'{shown}' became {describe(dir_fd, name)} during the upload; only regular "
            "files can be overwritten",
        ) from None
    except OSError as exc:
        if exc.errno != errno.ENOTEMPTY:
            raise
        raise _Refused(
            "invalid_path", f"'{shown}' is a directory; only regular files can be overwritten"
        ) from None


def _usage(root: int, limit: int) -> int:
    walked = walk(root, "", recursive=True, budget=Budget(limit))
    return sum(counted_bytes(st) for _, st in walked if stat.S_ISREG(st.st_mode))
