"""The local filesystem backend: create-only files, fsync, no-replace rename, directory fsync.

Every path is opened relative to the store's root one component at a time with ``O_NOFOLLOW``,
so a symlink anywhere inside the root is refused rather than followed (a manifest's paths are relative with safe components only).
Writes loop on short writes and check every result (rule 3); any ``OSError`` becomes a
:class:`~shardkeep.errors.StorageError` that names the path (rule 6).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import stat as stat_module
import threading
import uuid
from typing import Any

from shardkeep.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    StorageError,
    UnsafePathError,
)
from shardkeep.manifest import STAGING_MARKER, unsafe_path_reason
from shardkeep.storage.base import EntryInfo, StoreBase

__all__ = [
    "RENAME_EXCHANGE",
    "ExchangeUnsupported",
    "LocalStore",
    "exchange_paths",
    "rename_noreplace_path",
    "renameat2",
]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_MAX_WRITE = 1 << 30
_RENAME_NOREPLACE = 1
_SYNC_FILE_RANGE_WRITE = 2
#: Start writeback after this many new bytes (see ``_LocalWriter._start_writeback``).
_WRITEBACK_CHUNK = 32 << 20
#: Directories nested deeper than this inside a checkpoint are not descended (none are legitimate).
_MAX_WALK_DEPTH = 16


def _storage_error(action: str, path: str, exc: OSError) -> StorageError:
    return StorageError(f"{action} {path!r} failed: {exc.strerror or exc} (errno {exc.errno})")


class _Libc:
    """Two Linux calls that ``os`` lacks, resolved once through ctypes (``None`` if missing):
    ``renameat2`` with ``RENAME_NOREPLACE``, so a rename never replaces a checkpoint, and
    ``sync_file_range``, so writeback starts while a large file is still being written."""

    _lock = threading.Lock()
    _resolved = False
    renameat2: Any = None
    sync_file_range: Any = None

    @classmethod
    def load(cls) -> type[_Libc]:
        with cls._lock:
            if not cls._resolved:
                cls._resolved = True
                try:
                    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
                except OSError:
                    return cls
                renameat2 = getattr(libc, "renameat2", None)
                if renameat2 is not None:
                    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
                    renameat2.restype = ctypes.c_int
                    cls.renameat2 = renameat2
                sync_file_range = getattr(libc, "sync_file_range", None)
                if sync_file_range is not None:
                    sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
                    sync_file_range.restype = ctypes.c_int
                    cls.sync_file_range = sync_file_range
            return cls


def _rename_noreplace(src_dir_fd: int, src: str, dst_dir_fd: int, dst: str) -> None:
    renameat2 = _Libc.load().renameat2
    if renameat2 is not None:
        result = renameat2(src_dir_fd, os.fsencode(src), dst_dir_fd, os.fsencode(dst), _RENAME_NOREPLACE)
        if result == 0:
            return
        err = ctypes.get_errno()
        if err not in _FLAG_UNSUPPORTED:
            raise OSError(err, os.strerror(err))
    # Filesystems without RENAME_NOREPLACE: check, then rename. A racing writer could slip in
    # between, but staging names are unique and the final name is checked first.
    try:
        os.stat(dst, dir_fd=dst_dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        os.rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
        return
    raise OSError(errno.EEXIST, os.strerror(errno.EEXIST))


#: ``renameat2`` flag: swap two existing paths in one step.
RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_FLAG_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}


class ExchangeUnsupported(OSError):
    """``renameat2`` with the requested flag is not available here (OS, C library or filesystem)."""


def renameat2(source: str, destination: str, flags: int) -> None:
    """``renameat2(2)`` on two paths (relative to the working directory). Raises
    :class:`ExchangeUnsupported` where the OS, the C library or the filesystem lacks it or the
    flag, and ``OSError`` for any other failure."""
    function = _Libc.load().renameat2
    if function is None:
        raise ExchangeUnsupported(errno.ENOSYS, "the C library has no renameat2 (Linux only)")
    if function(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(destination), flags) != 0:
        code = ctypes.get_errno()
        if code in _FLAG_UNSUPPORTED:
            raise ExchangeUnsupported(code, os.strerror(code), source, None, destination)
        raise OSError(code, os.strerror(code), source, None, destination)


def exchange_paths(source: str, destination: str) -> None:
    """Swap ``source`` and ``destination`` (both exist) in one atomic step: at no moment is
    either name missing. :class:`ExchangeUnsupported` where that cannot be done here. Used to
    replace a directory that must never be missing (Lightning's ``last.ckpt``, a Hugging Face
    export)."""
    renameat2(source, destination, RENAME_EXCHANGE)


def rename_noreplace_path(source: str, destination: str) -> None:
    """Rename ``source`` to ``destination`` (paths, not relative to a store), never replacing
    anything there (``FileExistsError``): the store's own no-replace rename."""
    _rename_noreplace(_AT_FDCWD, source, _AT_FDCWD, destination)


def fsync_directory_path(path: str) -> None:
    """fsync the directory ``path``, so that the renames and creations in it are durable."""
    handle = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


class _LocalWriter:
    def __init__(self, fd: int, path: str) -> None:
        self._fd = fd
        self._path = path
        self._closed = False
        self._written = 0
        self._writeback_from = 0
        self._sync_file_range = _Libc.load().sync_file_range

    def write(self, data: bytes | memoryview, /) -> None:
        view = memoryview(data).cast("B")
        total = len(view)
        done = 0
        while done < total:
            try:
                written = os.write(self._fd, view[done : done + _MAX_WRITE])
            except OSError as exc:
                raise _storage_error("writing", self._path, exc) from exc
            if written <= 0:
                raise StorageError(f"writing {self._path!r} made no progress (wrote {written} bytes)")
            done += written
        self._written += total
        if self._sync_file_range is not None and self._written - self._writeback_from >= _WRITEBACK_CHUNK:
            self._start_writeback()

    def _start_writeback(self) -> None:
        """Ask the kernel to start writing the bytes written so far, without waiting, so the
        final fsync has less left to flush. A hint only: fsync still decides durability."""
        result = self._sync_file_range(
            self._fd, self._writeback_from, self._written - self._writeback_from, _SYNC_FILE_RANGE_WRITE
        )
        if result != 0:
            code = ctypes.get_errno()
            if code in (errno.EINVAL, errno.ENOSYS, errno.ESPIPE, errno.EOPNOTSUPP):
                self._sync_file_range = None  # not supported here; fsync alone will do
                return
            raise _storage_error("starting writeback of", self._path, OSError(code, os.strerror(code)))
        self._writeback_from = self._written

    def commit(self) -> None:
        self._closed = True
        try:
            os.fsync(self._fd)
        except OSError as exc:
            os.close(self._fd)
            raise _storage_error("fsync of", self._path, exc) from exc
        try:
            os.close(self._fd)
        except OSError as exc:
            raise _storage_error("closing", self._path, exc) from exc

    def abort(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                os.close(self._fd)
            except OSError:
                pass  # the save is already failing; the file is removed with its staging dir


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
            raise _storage_error("memory-mapping", self._path, exc) from exc
        return memoryview(mapped)

    def read_into(self, offset: int, buffer: memoryview, /) -> None:
        view = buffer.cast("B") if buffer.format != "B" else buffer
        done = 0
        while done < len(view):
            try:
                count = os.preadv(self._fd, [view[done:]], offset + done)
            except OSError as exc:
                raise _storage_error("reading", self._path, exc) from exc
            if count == 0:
                raise StorageError(f"reading {self._path!r}: unexpected end of file at byte {offset + done}")
            done += count

    def close(self) -> None:
        try:
            os.close(self._fd)
        except OSError as exc:
            raise _storage_error("closing", self._path, exc) from exc


class LocalStore(StoreBase):
    """A :class:`~shardkeep.storage.base.ByteStore` on a local or shared POSIX filesystem.
    Its ``root`` is the absolute directory; it renames atomically; ``remove_file`` and
    ``abort_uploads`` are the defaults (``remove_tree``, nothing to abort)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self._directory = os.path.abspath(os.fspath(root))

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
            raise _storage_error("opening directory", self.root, exc) from exc

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
                    raise _storage_error("opening directory", where, exc) from exc
                os.close(fd)
                fd = child
            return fd
        except BaseException:
            os.close(fd)
            raise

    # -- ByteStore ------------------------------------------------------------------------
    def open_write(self, path: str) -> _LocalWriter:
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
            raise _storage_error("creating", path, exc) from exc
        return _LocalWriter(fd, path)

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
            raise _storage_error("opening", path, exc) from exc
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
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _storage_error("stat of", path, exc) from exc
        finally:
            os.close(dir_fd)
        return _entry_info(info)

    def list_files(self, path: str) -> list[tuple[str, EntryInfo]]:
        try:
            fd = self._open_parent([*self._split(path), "."], create=False) if path else self._open_root()
        except OSError as exc:
            raise _storage_error("listing", path, exc) from exc
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
                    try:
                        names = os.listdir(fd)
                    except OSError as exc:
                        raise _storage_error("listing", at or self.root, exc) from exc
                    for name in names:
                        relative = f"{at}{name}"
                        try:
                            info = _entry_info(os.stat(name, dir_fd=fd, follow_symlinks=False))
                        except FileNotFoundError:
                            continue
                        except OSError as exc:
                            raise _storage_error("stat of", relative, exc) from exc
                        if info.kind != "dir":
                            found.append((relative, info))
                        elif depth >= _MAX_WALK_DEPTH:
                            found.append((relative, EntryInfo(kind="other", size=0)))
                        else:
                            try:
                                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
                            except OSError as exc:
                                raise _storage_error("opening directory", relative, exc) from exc
                            pending.append((child, relative + "/", depth + 1))
                finally:
                    os.close(fd)
        finally:
            for fd, _, _ in pending:
                os.close(fd)

    def list_dir(self, path: str = "") -> list[tuple[str, EntryInfo]]:
        fd = self._open_parent([*self._split(path), "."], create=False) if path else self._open_root()
        found: list[tuple[str, EntryInfo]] = []
        try:
            try:
                names = os.listdir(fd)
            except OSError as exc:
                raise _storage_error("listing", path or self.root, exc) from exc
            for name in names:
                try:
                    found.append((name, _entry_info(os.stat(name, dir_fd=fd, follow_symlinks=False))))
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    raise _storage_error("stat of", name, exc) from exc
        finally:
            os.close(fd)
        found.sort(key=lambda item: item[0])
        return found

    def put_atomic(self, path: str, data: bytes) -> None:
        parts = self._split(path)
        temporary = f"{parts[-1]}{STAGING_MARKER}{uuid.uuid4().hex}"
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
                raise _storage_error(f"replacing {path!r} with", temporary, exc) from exc
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
                    _rename_noreplace(src_fd, src_parts[-1], dst_fd, dst_parts[-1])
                except OSError as exc:
                    if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                        raise CheckpointExistsError(
                            f"{dst!r} already exists in {self.root!r}; it is never overwritten"
                        ) from exc
                    if exc.errno == errno.ENOENT:
                        raise CheckpointNotFoundError(f"{src!r} does not exist in {self.root!r}") from exc
                    raise _storage_error(f"renaming {src!r} to", dst, exc) from exc
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


def _entry_info(info: os.stat_result) -> EntryInfo:
    if stat_module.S_ISREG(info.st_mode):
        kind = "file"
    elif stat_module.S_ISDIR(info.st_mode):
        kind = "dir"
    else:
        kind = "other"
    return EntryInfo(kind=kind, size=info.st_size, mtime=info.st_mtime)  # type: ignore[arg-type]  # kind is one of the Literal values


def _fsync_fd(fd: int, path: str) -> None:
    try:
        os.fsync(fd)
    except OSError as exc:
        raise _storage_error("fsync of directory", path, exc) from exc


def _remove_entry(dir_fd: int, name: str, path: str) -> None:
    """Remove ``name`` under ``dir_fd``; directories recursively, symlinks as links only."""
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
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
        raise _storage_error("removing", path, exc) from exc
