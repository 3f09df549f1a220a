"""The local filesystem backend: create-only files, fsync, no-replace rename (an empty
directory excepted, as rename(2) replaces it), directory fsync.

Every path is opened relative to the store's root one component at a time with ``O_NOFOLLOW``,
so a symlink anywhere inside the root is refused rather than followed (a manifest's paths are relative with safe components only).
Writes loop on short writes and check every result; any ``OSError`` (from write, fsync, close
or rename, never retried) becomes a :class:`~shardkeep.errors.StorageError` that names the path.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import logging
import mmap
import os
import stat as stat_module
import threading
import uuid

from shardkeep.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    StorageError,
    UnsafePathError,
)
from shardkeep.names import STAGING_MARKER, sibling_name, unsafe_path_reason
from shardkeep.storage.base import EntryInfo, StoreBase
from shardkeep.storage.direct_io import DEFAULT_FILE_CALLS, DIRECT_IO_BLOCK, O_DIRECT, FileCalls, LocalWriter
from shardkeep.storage.localfs import (
    RENAME_EXCHANGE,
    ExchangeUnsupported,
    exchange_paths,
    fsync_directory_path,
    rename_noreplace_at,
    rename_noreplace_path,
    renameat2,
    storage_error,
)

__all__ = [
    "DIRECT_IO_BLOCK",
    "RENAME_EXCHANGE",
    "ExchangeUnsupported",
    "LocalStore",
    "exchange_paths",
    "fsync_directory_path",
    "rename_noreplace_path",
    "renameat2",
]

logger = logging.getLogger("shardkeep")

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
#: Directories nested deeper than this inside a checkpoint are not descended (none are legitimate).
_MAX_WALK_DEPTH = 16


#: Guards every store's ``write_paths``.
_COUNTING = threading.Lock()


class _LocalReader:
    def __init__(self, fd: int, path: str, size: int) -> None:
        self._fd = fd
        self._path = path
        self.size = size

    def map(self) -> memoryview:
        if self.size == 0:
            return memoryview(bytearray())
        try:
            mapped = mmap.mmap(self._fd, self.size, access=mmap.ACCESS_COPY)
        except OSError as exc:
            raise storage_error("memory-mapping", self._path, exc) from exc
        return memoryview(mapped)

    def read_into(self, offset: int, buffer: memoryview, /) -> None:
        view = buffer.cast("B") if buffer.format != "B" else buffer
        done = 0
        while done < len(view):
            try:
                count = os.preadv(self._fd, [view[done:]], offset + done)
            except OSError as exc:
                raise storage_error("reading", self._path, exc) from exc
            if count == 0:
                raise StorageError(f"reading {self._path!r}: unexpected end of file at byte {offset + done}")
            done += count

    def close(self) -> None:
        try:
            os.close(self._fd)
        except OSError as exc:
            raise storage_error("closing", self._path, exc) from exc


class LocalStore(StoreBase):
    """A :class:`~shardkeep.storage.base.ByteStore` on a local or shared POSIX filesystem.
    Its ``root`` is the absolute directory; it renames atomically; ``remove_file`` and
    ``abort_uploads`` are the defaults (``remove_tree``, nothing to abort).

    With ``direct_io`` (the default, on Linux), a file of at least :data:`DIRECT_IO_BLOCK`
    bytes is written with ``O_DIRECT`` through reused aligned buffers, and its last partial
    block through the page cache; where the filesystem refuses ``O_DIRECT`` (tmpfs before Linux
    6.6, some network and FUSE filesystems) the file is written through the page cache instead.
    ``write_paths`` counts the files written each way since the store was made (``"direct"``,
    ``"buffered"``, ``"buffered: O_DIRECT refused (...)"``). ``file_calls`` are the system
    calls, block size and waits of its writers (:class:`~shardkeep.storage.direct_io.FileCalls`;
    a test gives a simulated disk).
    """

    def __init__(
        self, root: str | os.PathLike[str], *, direct_io: bool = True, file_calls: FileCalls | None = None
    ) -> None:
        self._directory = os.path.abspath(os.fspath(root))
        self.direct_io = bool(direct_io) and O_DIRECT != 0
        self.file_calls = file_calls or DEFAULT_FILE_CALLS
        self.write_paths: collections.Counter[str] = collections.Counter()

    @property
    def root(self) -> str:
        return self._directory

    def __repr__(self) -> str:
        return f"LocalStore({self.root!r})"

    # -- path handling --------------------------------------------------------------------
    def _split(self, path: str) -> list[str]:
        reason = unsafe_path_reason(path)
        if reason is not None:
            raise UnsafePathError(f"unsafe path {path!r}: {reason}")
        return path.split("/")

    def _open_root(self) -> int:
        try:
            return os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(f"directory {self.root!r} does not exist") from exc
        except OSError as exc:
            raise storage_error("opening directory", self.root, exc) from exc

    def _open_parent(self, parts: list[str], *, create: bool) -> int:
        """A directory fd for all but the last component, walked without following symlinks."""
        fd = self._open_root()
        try:
            for index, part in enumerate(parts[:-1]):
                if create:
                    try:
                        os.mkdir(part, 0o755, dir_fd=fd)
                    except FileExistsError:
                        pass
                try:
                    child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError as exc:
                    raise CheckpointNotFoundError(
                        f"{'/'.join(parts[: index + 1])!r} does not exist in {self.root!r}"
                    ) from exc
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise UnsafePathError(
                            f"{'/'.join(parts[: index + 1])!r} in {self.root!r} is a symlink or not a directory"
                        ) from exc
                    where = os.path.join(self.root, *parts[: index + 1])
                    raise storage_error("opening directory", where, exc) from exc
                os.close(fd)
                fd = child
            return fd
        except BaseException:
            os.close(fd)
            raise

    # -- ByteStore ------------------------------------------------------------------------
    def open_write(self, path: str) -> LocalWriter:
        parts = self._split(path)
        try:
            dir_fd = self._open_parent(parts, create=True)
            try:
                fd = os.open(parts[-1], _WRITE_FLAGS, 0o644, dir_fd=dir_fd)
            finally:
                os.close(dir_fd)
        except FileExistsError as exc:
            raise CheckpointExistsError(f"{path!r} already exists in {self.root!r}") from exc
        except OSError as exc:
            raise storage_error("creating", path, exc) from exc
        try:
            return LocalWriter(fd, path, direct=self.direct_io, on_commit=self._count_path, calls=self.file_calls)
        except BaseException as exc:
            os.close(fd)
            if isinstance(exc, OSError):  # no memory for the aligned buffer
                raise storage_error("preparing to write", path, exc) from exc
            raise

    def _count_path(self, taken: str) -> None:
        with _COUNTING:
            self.write_paths[taken] += 1
            first = self.write_paths[taken] == 1
        if first and taken.startswith("buffered: O_DIRECT refused"):
            logger.info("%s: files are written through the page cache: %s", self.root, taken.partition(": ")[2])

    def open_read(self, path: str) -> _LocalReader:
        parts = self._split(path)
        try:
            dir_fd = self._open_parent(parts, create=False)
            try:
                fd = os.open(parts[-1], _READ_FLAGS, dir_fd=dir_fd)
            finally:
                os.close(dir_fd)
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(f"{path!r} does not exist in {self.root!r}") from exc
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafePathError(f"{path!r} in {self.root!r} is a symlink") from exc
            raise storage_error("opening", path, exc) from exc
        try:
            info = os.fstat(fd)
            if not stat_module.S_ISREG(info.st_mode):
                raise UnsafePathError(f"{path!r} in {self.root!r} is not a regular file")
        except BaseException:
            os.close(fd)
            raise
        return _LocalReader(fd, path, info.st_size)

    def stat(self, path: str) -> EntryInfo | None:
        parts = self._split(path)
        try:
            dir_fd = self._open_parent(parts, create=False)
        except (CheckpointNotFoundError, UnsafePathError):
            return None
        try:
            info = os.stat(parts[-1], dir_fd=dir_fd, follow_symlinks=False)
            parent = os.fstat(dir_fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise storage_error("stat of", path, exc) from exc
        finally:
            os.close(dir_fd)
        entry = _entry_info(info)
        if entry.kind == "dir" and info.st_dev != parent.st_dev:  # another filesystem mounted there
            entry = dataclasses.replace(entry, mount_point=True)
        return entry

    def list_files(self, path: str) -> list[tuple[str, EntryInfo]]:
        try:
            fd = self._open_parent([*self._split(path), "."], create=False) if path else self._open_root()
        except OSError as exc:
            raise storage_error("listing", path, exc) from exc
        found: list[tuple[str, EntryInfo]] = []
        try:
            self._walk(fd, "", found)
        finally:
            os.close(fd)
        found.sort(key=lambda item: item[0])
        return found

    def _walk(self, dir_fd: int, prefix: str, found: list[tuple[str, EntryInfo]]) -> None:
        """List below ``dir_fd`` without recursion, never following symlinks; a tree deeper than
        ``_MAX_WALK_DEPTH`` is reported as one ``other`` entry instead of being descended."""
        pending: list[tuple[int, str, int]] = [(os.dup(dir_fd), prefix, 0)]
        try:
            while pending:
                fd, at, depth = pending.pop()
                try:
                    for name, info in _entries(fd, at, at or self.root):
                        relative = f"{at}{name}"
                        if info.kind != "dir":
                            found.append((relative, info))
                        elif depth >= _MAX_WALK_DEPTH:
                            found.append((relative, EntryInfo(kind="other", size=0)))
                        else:
                            try:
                                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
                            except OSError as exc:
                                raise storage_error("opening directory", relative, exc) from exc
                            pending.append((child, relative + "/", depth + 1))
                finally:
                    os.close(fd)
        finally:
            for fd, _, _ in pending:
                os.close(fd)

    def list_dir(self, path: str = "") -> list[tuple[str, EntryInfo]]:
        fd = self._open_parent([*self._split(path), "."], create=False) if path else self._open_root()
        try:
            found = _entries(fd, "", path or self.root)
        finally:
            os.close(fd)
        found.sort(key=lambda item: item[0])
        return found

    def put_atomic(self, path: str, data: bytes) -> None:
        parts = self._split(path)
        temporary = sibling_name(parts[-1], STAGING_MARKER, uuid.uuid4().hex)
        writer = self.open_write("/".join([*parts[:-1], temporary]))
        try:
            writer.write(data)
            writer.commit()
        except BaseException:
            writer.abort()
            self.remove_tree("/".join([*parts[:-1], temporary]))
            raise
        dir_fd = self._open_parent(parts, create=False)
        try:
            try:
                os.rename(temporary, parts[-1], src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except OSError as exc:
                try:
                    os.unlink(temporary, dir_fd=dir_fd)
                except OSError:
                    pass  # the leftover is a staging name, collected later
                raise storage_error(f"replacing {path!r} with", temporary, exc) from exc
            _fsync_fd(dir_fd, path)
        finally:
            os.close(dir_fd)

    def rename(self, src: str, dst: str) -> None:
        src_parts = self._split(src)
        dst_parts = self._split(dst)
        src_fd = self._open_parent(src_parts, create=False)
        try:
            dst_fd = self._open_parent(dst_parts, create=True)
            try:
                try:
                    try:
                        rename_noreplace_at(src_fd, src_parts[-1], dst_fd, dst_parts[-1])
                    except OSError as exc:
                        if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                            raise
                        if not _is_directory(src_fd, src_parts[-1]) or not _is_empty_directory(dst_fd, dst_parts[-1]):
                            raise
                        # rename(2) replaces an empty directory atomically, and fails (ENOTEMPTY,
                        # ENOTDIR) if anything else is there by then: nothing is ever lost. The
                        # user's directory inode goes away with it: its mode and owner must not.
                        _adopt_attributes(src_fd, src_parts[-1], dst_fd, dst_parts[-1])
                        os.rename(src_parts[-1], dst_parts[-1], src_dir_fd=src_fd, dst_dir_fd=dst_fd)
                except OSError as exc:
                    if exc.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                        raise CheckpointExistsError(
                            f"{dst!r} already exists in {self.root!r}; it is never overwritten"
                        ) from exc
                    if exc.errno == errno.ENOENT:
                        raise CheckpointNotFoundError(f"{src!r} does not exist in {self.root!r}") from exc
                    raise storage_error(f"renaming {src!r} to", dst, exc) from exc
                _fsync_fd(dst_fd, dst)
                if src_parts[:-1] != dst_parts[:-1]:
                    _fsync_fd(src_fd, src)
            finally:
                os.close(dst_fd)
        finally:
            os.close(src_fd)

    def sync_dir(self, path: str) -> None:
        fd = self._open_parent([*self._split(path), "."], create=False) if path else self._open_root()
        try:
            _fsync_fd(fd, path)
        finally:
            os.close(fd)

    def remove_tree(self, path: str) -> None:
        parts = self._split(path)
        try:
            dir_fd = self._open_parent(parts, create=False)
        except CheckpointNotFoundError:
            return
        try:
            _remove_entry(dir_fd, parts[-1], path)
        finally:
            os.close(dir_fd)


def _adopt_attributes(src_fd: int, src: str, dst_fd: int, dst: str) -> None:
    """Give directory ``src`` the mode bits (setgid and sticky included), owner and group of
    directory ``dst``, which it is about to replace, durably. ACLs and other extended attributes
    are not copied; an owner or group the process may not give (not root) is left as it is."""
    try:
        wanted = os.stat(dst, dir_fd=dst_fd, follow_symlinks=False)
    except OSError:
        return  # gone already: the rename that follows says what is there
    fd = os.open(src, _DIR_FLAGS, dir_fd=src_fd)
    try:
        current = os.fstat(fd)
        if (current.st_uid, current.st_gid) != (wanted.st_uid, wanted.st_gid):
            try:
                os.fchown(fd, wanted.st_uid, wanted.st_gid)
            except PermissionError:  # not root: the group alone, if the process is a member
                with contextlib.suppress(PermissionError):
                    os.fchown(fd, -1, wanted.st_gid)
        os.fchmod(fd, stat_module.S_IMODE(wanted.st_mode))  # after chown, which may clear setgid
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_directory(dir_fd: int, name: str) -> bool:
    try:
        return stat_module.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _is_empty_directory(dir_fd: int, name: str) -> bool:
    """Whether ``name`` is a directory (not a symlink to one) with no entries."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        return not os.listdir(fd)
    finally:
        os.close(fd)


def _entry_info(info: os.stat_result) -> EntryInfo:
    if stat_module.S_ISREG(info.st_mode):
        kind = "file"
    elif stat_module.S_ISDIR(info.st_mode):
        kind = "dir"
    else:
        kind = "other"
    return EntryInfo(kind=kind, size=info.st_size, mtime=info.st_mtime)  # type: ignore[arg-type]  # kind is one of the Literal values


def _entries(dir_fd: int, prefix: str, where: str) -> list[tuple[str, EntryInfo]]:
    """The entries of the directory ``dir_fd`` (named ``where`` in errors; ``prefix`` is its
    path in the store, for the errors of its entries), each stat-ed without following a
    symlink; one that vanished meanwhile is left out."""
    try:
        names = os.listdir(dir_fd)
    except OSError as exc:
        raise storage_error("listing", where, exc) from exc
    found: list[tuple[str, EntryInfo]] = []
    for name in names:
        try:
            found.append((name, _entry_info(os.stat(name, dir_fd=dir_fd, follow_symlinks=False))))
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise storage_error("stat of", f"{prefix}{name}", exc) from exc
    return found


def _fsync_fd(fd: int, path: str) -> None:
    try:
        os.fsync(fd)
    except OSError as exc:
        raise storage_error("fsync of directory", path, exc) from exc


def _remove_entry(dir_fd: int, name: str, path: str) -> None:
    """Remove ``name`` under ``dir_fd``; directories recursively, symlinks as links only."""
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise storage_error("stat of", path, exc) from exc
    try:
        if stat_module.S_ISDIR(info.st_mode):
            child = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
            try:
                for entry in os.listdir(child):
                    _remove_entry(child, entry, f"{path}/{entry}")
            finally:
                os.close(child)
            os.rmdir(name, dir_fd=dir_fd)
        else:
            os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise storage_error("removing", path, exc) from exc
