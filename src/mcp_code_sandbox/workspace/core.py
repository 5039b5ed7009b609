"""The :class:`Workspace`: one session's files on the host, and what the server does to them."""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import BinaryIO

from mcp_code_sandbox.agent.dirfd import pread_all, write_all
from mcp_code_sandbox.agent.packages import PACKAGES_DIR
from mcp_code_sandbox.agent.statefiles import STATE_DIR
from mcp_code_sandbox.errors import (
    FileExists_,
    InternalError,
    InvalidArgument,
    InvalidPath,
    NotFound,
    QuotaExceeded,
    SandboxError,
)
from mcp_code_sandbox.workspace import entries
from mcp_code_sandbox.workspace.entries import (
    FileInfo,
    ListResult,
    ReadResult,
    Snapshot,
    Stamp,
    make_entry,
)
from mcp_code_sandbox.workspace.fs import (
    DIR_FLAGS,
    FILE_FLAGS,
    Budget,
    closing_fd,
    counted_bytes,
    describe,
    iso_utc,
    walk,
)
from mcp_code_sandbox.workspace.mime import guess_mime, is_text_mime
from mcp_code_sandbox.workspace.paths import join_parts, parse_path
from mcp_code_sandbox.workspace.volume import Volume, release

__all__ = ["HEAD_BYTES", "HIDDEN_DIRS", "OUTPUTS_DIR", "Workspace", "measure", "upload_parts"]

#: Top-level directory where the server keeps full outputs of truncated runs.
OUTPUTS_DIR = ".outputs"
#: Top-level directories that are not the session's files: no artifacts, not listed
#: (unless asked for by path), but counted in the quota. ``PACKAGES_DIR``: what pip,
#: npm and bun installed at run time (``agent/packages.py``); ``STATE_DIR``: the
#: variables a paused session saved (``agent/statefiles.py``).
HIDDEN_DIRS = frozenset({OUTPUTS_DIR, PACKAGES_DIR, STATE_DIR})
#: Bytes of a file's start used to guess its type and whether it is text.
HEAD_BYTES = 512
_TMP_PREFIX = ".mcs-upload-"
_NO_FOLLOW_HINT = "the server never follows links inside the workspace"


class Workspace:
    """A session's files: the host directory ``root`` that the sandbox sees as /mnt/data."""

    def __init__(
        self,
        root: Path,
        *,
        quota_bytes: int,
        owner: tuple[int, int] | None = None,
        volume: Volume | None = None,
    ) -> None:
        if quota_bytes <= 0:
            raise InvalidArgument(f"quota_bytes must be positive, not {quota_bytes}")
        self.root = root
        self.quota_bytes = quota_bytes
        #: Host uid/gid given every directory and file the server creates; None: ours.
        self.owner = owner
        #: The filesystem of its own mounted at ``root`` (the quota binds the sandbox);
        #: ``None``: ``root`` is a plain directory and the quota is checked (:mod:`sessions.quota`).
        self.volume = volume

    # --- life cycle ------------------------------------------------------------------------

    def create(self) -> None:
        """Create ``root`` (mode 0o700, given to ``owner``), with its ``volume`` mounted
        on it; an existing directory (and mount) is kept. Blocks (a mount, and a format
        when no spare image is left): call it in a worker thread."""
        with _fs_errors("."):
            self._make_root()
            if self.volume is not None:
                self.volume.create(self.root)
            with closing_fd(os.open(self.root, DIR_FLAGS)) as fd:
                self._adopt(fd, 0o700)

    def make_root(self) -> None:
        """Create ``root`` alone (mode 0o700, the server's), neither mounted nor given to
        ``owner`` yet: what a sandbox's bind needs to be made; :meth:`create` does the
        rest. Blocks: call it in a worker thread."""
        with _fs_errors("."):
            self._make_root()

    def _make_root(self) -> None:
        self.root.parent.mkdir(parents=True, exist_ok=True)
        # An existing directory is a server restart re-attaching to a session: keep it.
        with suppress(FileExistsError):
            os.mkdir(self.root, 0o700)

    def unmount(self) -> bool:
        """Unmount the volume, keeping its image; :meth:`create` mounts it again. A no-op
        without a volume. Whether it is unmounted now (``False``: still busy). Blocks:
        call it in a worker thread."""
        if self.volume is None:
            return True
        with _fs_errors("."):
            return self.volume.unmount(self.root)

    def destroy(self) -> None:
        """Unmount and delete the volume, then remove ``root`` and everything in it,
        following no link; a no-op when gone."""
        with _fs_errors("."):
            release(self.root, self.volume.image if self.volume else None)

    # --- files -----------------------------------------------------------------------------

    def write_file(self, rel: str, data: bytes | BinaryIO, *, overwrite: bool) -> FileInfo:
        """Write ``data`` (bytes, or a file positioned at its start, read to its end) at
        ``rel`` atomically, creating parent directories.

        Raises ``InvalidFilename`` for a bad path, ``InvalidPath`` for a path in
        ``STATE_DIR``, when a component is a link or not a directory or when the target is
        not a regular file, ``FileExists_`` when it exists and not ``overwrite``,
        ``QuotaExceeded`` when it would not fit. A failed write leaves nothing behind
        (neither a partial file nor new directories).
        """
        parts = upload_parts(rel)
        shown = join_parts(parts)
        size, head = measure(data)
        with _fs_errors(shown), closing_fd(self._open_root()) as root:
            replaced = self._existing_size(root, parts, shown, overwrite=overwrite)
            self._check_quota(root, size, replaced, shown)
            with closing_fd(self._open_dir(root, parts[:-1], create=True)) as dir_fd:
                st = self._install(dir_fd, parts[-1], data, shown, overwrite=overwrite)
        return FileInfo(shown, st.st_size, guess_mime(shown, head), iso_utc(st.st_mtime_ns))

    def read_file(self, rel: str, *, offset: int = 0, max_bytes: int) -> ReadResult:
        """Read at most ``max_bytes`` of the regular file ``rel`` from ``offset``.

        Raises ``NotFound`` when missing, ``InvalidPath`` for a directory, a symlink (as
        any component), a FIFO, a device, a socket or a file with more than one hard link,
        ``InvalidArgument`` for a negative ``offset`` or ``max_bytes``.
        """
        if offset < 0 or max_bytes < 0:
            raise InvalidArgument(
                f"offset ({offset}) and max_bytes ({max_bytes}) must be 0 or more"
            )
        parts = parse_path(rel, for_upload=False)
        shown = join_parts(parts)
        with _fs_errors(shown):
            fd, st = self._open_regular(parts, shown)
            with closing_fd(fd):
                data = pread_all(fd, offset, max_bytes)
                head = os.pread(fd, HEAD_BYTES, 0)
        mime = guess_mime(shown, head)
        end = offset + len(data)
        return ReadResult(
            path=shown,
            data=data,
            offset=offset,
            next_offset=end,
            size_bytes=st.st_size,
            eof=len(data) < max_bytes or end >= st.st_size,
            mime_type=mime,
            is_text=is_text_mime(mime, head),
            modified=iso_utc(st.st_mtime_ns),
        )

    def open_file(self, rel: str) -> tuple[BinaryIO, FileInfo]:
        """Open ``rel`` for streaming (HTTP downloads) with ``read_file``'s checks.

        The caller closes the returned file. ``FileInfo.size_bytes`` is the size at open.
        """
        parts = parse_path(rel, for_upload=False)
        shown = join_parts(parts)
        with _fs_errors(shown):
            fd, st = self._open_regular(parts, shown)
            try:
                head = os.pread(fd, HEAD_BYTES, 0)
            except BaseException:
                os.close(fd)
                raise
        info = FileInfo(shown, st.st_size, guess_mime(shown, head), iso_utc(st.st_mtime_ns))
        return os.fdopen(fd, "rb"), info

    # --- listing, snapshots, usage ---------------------------------------------------------

    def list_files(
        self, rel: str = ".", *, recursive: bool = True, limit: int = 10000
    ) -> ListResult:
        """Entries under the directory ``rel``, sorted component-wise by path (a parent
        before its children), never following symlinks (reported as ``symlink``).

        At most ``limit`` directory entries are read; ``truncated`` says whether more
        exist. Raises ``NotFound`` / ``InvalidPath`` as ``read_file`` does.
        """
        if limit < 1:
            raise InvalidArgument(f"limit must be 1 or more, not {limit}")
        parts = parse_path(rel, for_upload=False)
        shown = join_parts(parts)
        budget = Budget(limit)
        with (
            _fs_errors(shown),
            closing_fd(self._open_root()) as root,
            closing_fd(self._open_dir(root, parts, create=False)) as fd,
        ):
            # Saved outputs, packages and variables are not the session's files (see
            # ``HIDDEN_DIRS``): listed only when asked for by path.
            hidden = HIDDEN_DIRS if not parts else frozenset()
            walked = walk(fd, "/".join(parts), recursive=recursive, budget=budget, skip=hidden)
            entries = tuple(make_entry(path, st) for path, st in walked)
        return ListResult(shown, entries, budget.truncated)

    def snapshot(self, limit: int = 20000, *, count_hidden: bool = False) -> Snapshot:
        """Stamps of the regular files (:data:`HIDDEN_DIRS` excluded), reading at most
        ``limit`` entries. Taken before and after every run, for :func:`diff`.
        ``count_hidden`` also sums the hidden directories' bytes (a walk of every installed
        package): only the snapshot after a run needs it, for the quota."""
        budget = Budget(limit)
        files: dict[str, Stamp] = {}
        # Blocks a file holds beyond its size (fallocate with KEEP_SIZE) count too.
        preallocated = 0
        with _fs_errors("."), closing_fd(self._open_root()) as root:
            for path, st in walk(root, "", recursive=True, budget=budget, skip=HIDDEN_DIRS):
                if stat.S_ISREG(st.st_mode):
                    files[path] = Stamp(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
                    preallocated += counted_bytes(st) - st.st_size
            hidden = (
                sum(self._hidden_usage(root, name) for name in HIDDEN_DIRS) if count_hidden else 0
            )
        return Snapshot(files, budget.truncated, hidden + preallocated if count_hidden else 0)

    def usage_bytes(self, limit: int = 200_000) -> int:
        """Bytes the regular files hold (:func:`.fs.counted_bytes`: their sizes, or
        their allocated blocks when more); a lower bound when there are more than
        ``limit`` entries."""
        with _fs_errors("."), closing_fd(self._open_root()) as root:
            return self._usage(root, limit)

    def disk_bytes(self, limit: int = 200_000) -> int:
        """Bytes the workspace takes on the host's disk now: allocated blocks, never
        apparent sizes (a sparse file's holes take none). With a volume, the image's
        blocks (files, saved variables and the filesystem's own metadata; mounted or
        not); else the blocks of its regular files, each inode once, a lower bound past
        ``limit`` entries. Blocks: call it in a worker thread."""
        if self.volume is not None:
            with _fs_errors("."):
                return self.volume.disk_bytes()
        seen: set[int] = set()
        total = 0
        with _fs_errors("."), closing_fd(self._open_root()) as root:
            for _, st in walk(root, "", recursive=True, budget=Budget(limit)):
                if stat.S_ISREG(st.st_mode) and st.st_ino not in seen:
                    seen.add(st.st_ino)
                    total += st.st_blocks * 512
        return total

    @staticmethod
    def diff(before: Snapshot, after: Snapshot) -> list[entries.Change]:
        """:func:`~mcp_code_sandbox.workspace.entries.diff`, for callers holding a workspace."""
        return entries.diff(before, after)

    # --- internals -------------------------------------------------------------------------

    def _open_root(self) -> int:
        try:
            return os.open(self.root, DIR_FLAGS)
        except FileNotFoundError:
            raise InternalError(
                "the workspace directory is gone (was the session closed?)"
            ) from None

    def _open_dir(self, root: int, parts: tuple[str, ...], *, create: bool) -> int:
        """An fd of the directory ``parts`` below ``root``, one O_NOFOLLOW step at a time."""
        fd = os.dup(root)
        for i, name in enumerate(parts):
            shown = join_parts(parts[: i + 1])
            try:
                child = self._step(fd, name, shown, create=create)
            finally:
                os.close(fd)
            fd = child
        return fd

    def _step(self, dir_fd: int, name: str, shown: str, *, create: bool) -> int:
        try:
            return os.open(name, DIR_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            if not create:
                raise NotFound(
                    f"'{shown}' does not exist in /mnt/data; list_files shows what does"
                ) from None
        except OSError as exc:
            raise _open_error(exc, dir_fd, name, shown, wanted="a directory") from exc
        try:
            os.mkdir(name, 0o755, dir_fd=dir_fd)
        except FileExistsError:  # the sandbox made it meanwhile: open it with the same checks
            return self._step(dir_fd, name, shown, create=False)
        fd = self._step(dir_fd, name, shown, create=False)
        self._adopt(fd, 0o755)
        return fd

    def _adopt(self, fd: int, mode: int) -> None:
        """Give something we created its mode and owner (the sandbox must be able to use it)."""
        os.fchmod(fd, mode)
        if self.owner is None:
            return
        try:
            os.fchown(fd, *self.owner)
        except PermissionError:
            raise InternalError(
                f"cannot give workspace files to uid/gid {self.owner}: the server must run "
                "as root or as that user"
            ) from None

    def _open_regular(self, parts: tuple[str, ...], shown: str) -> tuple[int, os.stat_result]:
        if not parts:
            raise InvalidPath("'.' is the workspace directory; use list_files to see its files")
        with (
            closing_fd(self._open_root()) as root,
            closing_fd(self._open_dir(root, parts[:-1], create=False)) as dir_fd,
        ):
            try:
                fd = os.open(parts[-1], FILE_FLAGS, dir_fd=dir_fd)
            except FileNotFoundError:
                raise NotFound(
                    f"'{shown}' does not exist in /mnt/data; list_files shows what does"
                ) from None
            except OSError as exc:
                raise _open_error(exc, dir_fd, parts[-1], shown, wanted="a file") from exc
        try:
            st = os.fstat(fd)
            _check_servable(st, shown)
        except BaseException:
            os.close(fd)
            raise
        return fd, st

    def _existing_size(
        self, root: int, parts: tuple[str, ...], shown: str, *, overwrite: bool
    ) -> int:
        """Size of the regular file an upload would replace (0 for none); refuses the rest."""
        try:
            dir_fd = self._open_dir(root, parts[:-1], create=False)
        except NotFound:
            return 0
        with closing_fd(dir_fd):
            try:
                st = os.stat(parts[-1], dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                return 0
            what = describe(dir_fd, parts[-1])
        if not overwrite:
            raise FileExists_(
                f"'{shown}' already exists; pass overwrite=true to replace it, or pick another name"
            )
        if not stat.S_ISREG(st.st_mode):
            raise InvalidPath(
                f"'{shown}' exists and is {what}; only regular files can be overwritten"
            )
        return st.st_size

    def _check_quota(self, root: int, size: int, replaced: int, shown: str) -> None:
        used = self._usage(root, 200_000)
        if used - replaced + size <= self.quota_bytes:
            return
        raise QuotaExceeded(
            f"writing '{shown}' ({size} bytes) would exceed the workspace quota: "
            f"{used} of {self.quota_bytes} bytes are in use; delete files you no longer "
            "need (e.g. with run_code) or write less",
            used_bytes=used,
            quota_bytes=self.quota_bytes,
        )

    def _hidden_usage(self, root: int, name: str) -> int:
        try:
            fd = self._open_dir(root, (name,), create=False)
        except (NotFound, InvalidPath):
            return 0
        with closing_fd(fd):
            return self._usage(fd, 200_000)

    def _usage(self, root: int, limit: int) -> int:
        walked = walk(root, "", recursive=True, budget=Budget(limit))
        return sum(counted_bytes(st) for _, st in walked if stat.S_ISREG(st.st_mode))

    def _install(
        self, dir_fd: int, name: str, data: bytes | BinaryIO, shown: str, *, overwrite: bool
    ) -> os.stat_result:
        """Write ``data`` to a temporary name in ``dir_fd``, then move it to ``name``."""
        tmp = f"{_TMP_PREFIX}{secrets.token_hex(8)}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            with closing_fd(os.open(tmp, flags, 0o644, dir_fd=dir_fd)) as fd:
                self._adopt(fd, 0o644)
                if isinstance(data, bytes):
                    write_all(fd, data)
                else:
                    while chunk := data.read(1 << 20):
                        write_all(fd, chunk)
                st = os.fstat(fd)
            _publish(dir_fd, tmp, name, shown, overwrite=overwrite)
        finally:
            _unlink_quietly(dir_fd, tmp)  # gone already after a rename; left after a link
        return st


def upload_parts(rel: str) -> tuple[str, ...]:
    """The components of ``rel`` as a file to write (:func:`.paths.parse_path`), which
    must not be in ``STATE_DIR``: ``InvalidFilename`` / ``InvalidPath`` otherwise."""
    parts = parse_path(rel, for_upload=True)
    if parts[0] == STATE_DIR:
        # The sandbox's own saved state (a pause writes it, a resume loads it): never
        # the client's, paused or not, whatever the backend keeps there.
        raise InvalidPath(
            f"'{join_parts(parts)}' is in {STATE_DIR}/, where the session keeps the "
            "variables a pause saves; nothing is uploaded there. Pick another path"
        )
    return parts


def measure(data: bytes | BinaryIO) -> tuple[int, bytes]:
    """Size and first bytes of ``data``; a file is left where it was."""
    if isinstance(data, bytes):
        return len(data), data[:HEAD_BYTES]
    start = data.tell()
    size = data.seek(0, os.SEEK_END) - start
    data.seek(start)
    head = data.read(HEAD_BYTES)
    data.seek(start)
    return size, head


def _publish(dir_fd: int, tmp: str, name: str, shown: str, *, overwrite: bool) -> None:
    try:
        if overwrite:
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        else:
            # link() fails when ``name`` exists, even if the sandbox made it a moment ago;
            # os.replace would silently clobber it.
            os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    except FileExistsError:
        raise FileExists_(
            f"'{shown}' already exists; pass overwrite=true to replace it, or pick another name"
        ) from None
    except (IsADirectoryError, NotADirectoryError) as exc:
        raise InvalidPath(
            f"'{shown}' became {describe(dir_fd, name)} during the upload; only regular "
            "files can be overwritten"
        ) from exc
    except OSError as exc:
        if exc.errno != errno.ENOTEMPTY:
            raise
        raise InvalidPath(
            f"'{shown}' is a directory; only regular files can be overwritten"
        ) from exc


def _check_servable(st: os.stat_result, shown: str) -> None:
    if stat.S_ISDIR(st.st_mode):
        raise InvalidPath(f"'{shown}' is a directory; use list_files to see what is in it")
    if not stat.S_ISREG(st.st_mode):
        raise InvalidPath(
            f"'{shown}' is not a regular file (a FIFO, socket or device); "
            "only regular files can be read"
        )
    if st.st_nlink != 1:
        raise InvalidPath(
            f"'{shown}' has {st.st_nlink} hard links; the server does not serve hard-linked "
            "files, because a link can point at a file outside the workspace. Make a copy "
            "in the sandbox (e.g. shutil.copy) and read that"
        )


def _open_error(exc: OSError, dir_fd: int, name: str, shown: str, *, wanted: str) -> SandboxError:
    """The client-facing error for a failed O_NOFOLLOW open of ``name``."""
    if exc.errno in (errno.ENOTDIR, errno.ELOOP, errno.ENXIO, errno.EOPNOTSUPP):
        what = describe(dir_fd, name)
        if what == "a symbolic link":
            return InvalidPath(
                f"'{shown}' is a symbolic link; {_NO_FOLLOW_HINT}. Read the "
                "file it points to by its own path, or copy it"
            )
        return InvalidPath(f"'{shown}' is {what}, not {wanted}")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return InvalidPath(
            f"'{shown}' is not readable by the server; make it readable "
            "in the sandbox (chmod u+r, or u+rx for a directory)"
        )
    return InternalError(f"cannot open '{shown}': {errno.errorcode.get(exc.errno or 0, exc)}")


def _unlink_quietly(dir_fd: int, name: str) -> None:
    with suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dir_fd)


@contextmanager
def _fs_errors(shown: str) -> Iterator[None]:
    """Translate the OSErrors nobody expected, naming the client's path, never the host's."""
    try:
        yield
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise QuotaExceeded(
                "the disk that holds the workspace is full; delete files you no longer need"
            ) from exc
        code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        raise InternalError(f"file system error on '{shown}': {code}") from exc
