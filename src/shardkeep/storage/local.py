"""The local filesystem backend: create-only files, fsync, no-replace rename (an empty
directory excepted, as rename(2) replaces it), directory fsync.

Every path is opened relative to the store's root one component at a time with ``O_NOFOLLOW``,
so a symlink anywhere inside the root is refused rather than followed (a manifest's paths are relative with safe components only).
Writes loop on short writes and check every result (rule 3); any ``OSError`` becomes a
:class:`~shardkeep.errors.StorageError` that names the path (rule 6).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import ctypes.util
import dataclasses
import errno
import fcntl
import logging
import mmap
import os
import stat as stat_module
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from typing import Any

from shardkeep.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    StorageError,
    UnsafePathError,
)
from shardkeep.names import STAGING_MARKER, sibling_name, unsafe_path_reason
from shardkeep.storage.base import EntryInfo, StoreBase
from shardkeep.storage.localfs import (
    RENAME_EXCHANGE,
    ExchangeUnsupported,
    exchange_paths,
    fsync_directory_path,
    rename_noreplace_at,
    rename_noreplace_path,
    renameat2,
    storage_error,
    sync_file_range_function,
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
_MAX_WRITE = 1 << 30
_SYNC_FILE_RANGE_WRITE = 2
#: Start writeback after this many new bytes (see ``_LocalWriter._start_writeback``).
_WRITEBACK_CHUNK = 32 << 20
#: Files of at least this many bytes are written with ``O_DIRECT``, this many bytes per write
#: (a multiple of every filesystem's direct I/O alignment).
DIRECT_IO_BLOCK = 8 << 20
#: Blocks of one file being written in the background at once (each holds a buffer).
_DIRECT_IN_FLIGHT = 1
_O_DIRECT = getattr(os, "O_DIRECT", 0)
#: Directories nested deeper than this inside a checkpoint are not descended (none are legitimate).
_MAX_WALK_DEPTH = 16


class _FileCalls:
    """The system calls a :class:`_LocalWriter` makes, in one place, so that a test can stand a
    simulated disk (a power cut, a filesystem that refuses ``O_DIRECT``) under the real writer."""

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        return os.pwrite(fd, data, offset)

    def set_direct(self, fd: int, on: bool) -> None:
        """Turn ``O_DIRECT`` on or off for ``fd`` (``OSError`` ``EINVAL`` where the filesystem
        refuses it)."""
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | _O_DIRECT if on else flags & ~_O_DIRECT)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def close(self, fd: int) -> None:
        os.close(fd)


_FILE_CALLS = _FileCalls()
_memmove = ctypes.memmove


def _address_of(view: memoryview) -> int | None:
    """The address of a writable contiguous byte view's first byte (``None`` for a read-only
    one, which is copied by slice assignment instead)."""
    if view.readonly or not view.c_contiguous or not len(view):
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class _AlignedBuffers:
    """Reused page-aligned buffers for ``O_DIRECT`` writes: an anonymous memory map is
    page-aligned, and reusing it avoids first-touch page faults, which cost more than the copy
    on these machines. At most ``keep`` idle buffers are kept."""

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._idle: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self, size: int) -> mmap.mmap:
        with self._lock:
            for index, buffer in enumerate(self._idle):
                if len(buffer) == size:
                    return self._idle.pop(index)
        # Private: a shared anonymous map (mmap's default) would be one buffer for a forked child
        # and its parent, each writing into the other's file.
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)

    def give(self, buffer: mmap.mmap) -> None:
        with self._lock:
            if len(self._idle) < self._keep:
                self._idle.append(buffer)
                return
        try:
            buffer.close()
        except BufferError:
            pass  # a view of it is still alive somewhere: it is unmapped when that goes


_BUFFERS = _AlignedBuffers(keep=8)


class _BlockWriters:
    """The threads that write full blocks in the background, while the writer fills its other
    buffer: up to ``_DIRECT_IN_FLIGHT`` blocks in flight per file. Made on first use, and forgotten in a forked child
    (whose copy of the parent's threads does not run)."""

    _lock = threading.Lock()
    _pool: ThreadPoolExecutor | None = None

    @classmethod
    def submit(cls, function: Callable[..., None], *args: Any) -> Future[None]:
        with cls._lock:
            if cls._pool is None:
                cls._pool = ThreadPoolExecutor(8, thread_name_prefix="shardkeep-direct")
            return cls._pool.submit(function, *args)

    @classmethod
    def forget(cls) -> None:
        cls._lock = threading.Lock()
        cls._pool = None


#: Guards every store's ``write_paths``.
_COUNTING = threading.Lock()


def _after_fork_in_child() -> None:
    """A parent thread may have held any of these locks at the fork, and the pool's threads are
    not in the child."""
    global _COUNTING
    _BlockWriters.forget()
    _BUFFERS._lock = threading.Lock()
    _COUNTING = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


class _LocalWriter:
    """A new file written in one of two ways, chosen by its size (see :class:`LocalStore`):

    - a file of at least :data:`DIRECT_IO_BLOCK` bytes is copied into reused page-aligned
      buffers and written with ``O_DIRECT`` one whole block at a time, past the page cache: up
      to ``_DIRECT_IN_FLIGHT`` blocks are written in the background while the next is filled
      (``_DIRECT_IN_FLIGHT + 1`` buffers per file). The last partial block is
      written through the page cache, so the file is byte for byte what a buffered write gives
      (no padding);
    - a smaller file, or any file on a filesystem that refuses ``O_DIRECT``, is written through
      the page cache, with writeback started every ``_WRITEBACK_CHUNK`` bytes.

    The first block is collected before anything is written, which is how the size is told.
    Either way ``commit`` fsyncs the file: ``O_DIRECT`` skips the page cache, not the disk's
    own cache or the file's size in its inode. ``path_taken`` says which way ran (``"direct"``,
    ``"buffered"``, or ``"buffered: <why>"`` when ``O_DIRECT`` was refused or turned off).
    """

    def __init__(self, fd: int, path: str, *, direct: bool, on_commit: Callable[[str], None] | None = None) -> None:
        self._fd = fd
        self._path = path
        self._on_commit = on_commit
        self._calls = _FILE_CALLS
        self._closed = False
        self._failed = False  # a write failed: the file may miss bytes, and must not be committed
        self._offset = 0  # bytes of the file written, or handed to a background write
        self._writeback_from = 0
        self._sync_file_range = sync_file_range_function()
        self._block = DIRECT_IO_BLOCK
        self._buffers: list[mmap.mmap] = [_BUFFERS.take(self._block)] if direct else []  # every one held
        self._filling: mmap.mmap | None = self._buffers[0] if direct else None
        self._view: memoryview | None = memoryview(self._buffers[0]) if direct else None  # of the one filling
        self._address = (_address_of(self._view) if self._view is not None else None) or 0
        self._filled = 0  # bytes collected in the buffer being filled
        #: The background writes not yet waited for, oldest first, with their buffers.
        self._in_flight: collections.deque[tuple[Future[None], mmap.mmap]] = collections.deque()
        self._direct = False  # O_DIRECT is on for fd
        self.path_taken = "buffered" if direct else "buffered: direct I/O is off for this store"

    def write(self, data: bytes | memoryview, /) -> None:
        self._check_open("write to")
        try:
            self._write(data)
        except BaseException:
            self._failed = True
            raise

    def _check_open(self, action: str) -> None:
        """Refuse to go on after a failure (a block may be missing) or after commit or abort."""
        if self._failed or self._closed:
            state = "a write to it failed" if self._failed else "it is closed"
            raise StorageError(f"cannot {action} {self._path!r}: {state}")

    def _write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        if self._view is None:
            self._write_through(view)
            return
        done = 0
        total = len(view)
        source = _address_of(view)
        while done < total:
            take = min(self._block - self._filled, total - done)
            if source is None:
                self._view[self._filled : self._filled + take] = view[done : done + take]
            else:  # ctypes.memmove lets go of the GIL while it copies
                _memmove(self._address + self._filled, source + done, take)
            self._filled += take
            done += take
            if self._filled == self._block:
                self._write_block()
                if self._view is None:  # O_DIRECT was refused: the rest goes through the page cache
                    self._write_through(view[done:])
                    return

    def _write_block(self) -> None:
        """Write the full buffer with O_DIRECT. The first block turns O_DIRECT on and is written
        here, so that a filesystem that refuses it is found at once: then the buffer is written
        through the page cache and no buffer is used again. Later blocks are written in the
        background while the next one fills a second buffer."""
        assert self._view is not None
        if not self._direct:
            try:
                self._calls.set_direct(self._fd, True)
                self._direct = True
                self._write_at(self._view, 0)
            except OSError as exc:
                if exc.errno != errno.EINVAL and self._direct:
                    raise storage_error("writing", self._path, exc) from exc
                self._refused(exc)
                return
            self._offset = self._block
            self._filled = 0
            self.path_taken = "direct"
            return
        assert self._filling is not None
        free = []
        while len(self._in_flight) >= _DIRECT_IN_FLIGHT:
            free.append(self._wait_oldest())
        self._in_flight.append((self._submit(self._view, self._offset), self._filling))
        self._offset += self._block
        self._filled = 0
        if not free:
            free.append(_BUFFERS.take(self._block))
            self._buffers.append(free[0])
        self._filling = free[0]
        self._view = memoryview(self._filling)
        self._address = _address_of(self._view) or 0

    def _submit(self, view: memoryview, offset: int) -> Future[None]:
        """Start writing ``view`` at ``offset`` in the background. The future is the writer's
        own: if queueing is interrupted, a job that has not started is cancelled and never
        writes, and one that has started is waited for before the interruption goes on."""
        future: Future[None] = Future()

        def job() -> None:
            if not future.set_running_or_notify_cancel():
                return  # cancelled: the writer gave up before the job started
            try:
                self._write_at(view, offset)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(None)

        try:
            _BlockWriters.submit(job)
        except BaseException:
            if not future.cancel():  # the job already runs: let it finish before anything goes
                self._settle(future)
            raise
        return future

    def _wait_oldest(self) -> mmap.mmap:
        """Wait for the oldest background write (see :meth:`_settle`), raise its error, and
        return its buffer, free again."""
        future, buffer = self._in_flight[0]
        self._settle(future)
        self._in_flight.popleft()
        error = future.exception()
        if isinstance(error, OSError):
            raise storage_error("writing", self._path, error) from error
        if error is not None:
            raise error
        return buffer

    def _wait_in_flight(self) -> None:
        """Wait for every background write, and raise the first error."""
        while self._in_flight:
            self._wait_oldest()

    @staticmethod
    def _settle(future: Future[None]) -> None:
        """Wait until a background write is over, whatever happens meanwhile: its buffer and the
        file descriptor must outlive it (a descriptor closed early could be reused by another
        file, which the write would then land in). An interruption (Ctrl-C) is raised after."""
        interrupted: BaseException | None = None
        while not future.done():
            try:
                wait_for([future])
            except BaseException as exc:  # kept, and raised once the write is over
                interrupted = exc
        if interrupted is not None:
            raise interrupted

    def _refused(self, exc: OSError) -> None:
        """O_DIRECT is not possible for this file: write what the buffer holds through the page
        cache and go on without the buffer."""
        self.path_taken = f"buffered: O_DIRECT refused ({exc.strerror or exc})"
        if self._direct:
            self._set_buffered()
        assert self._view is not None
        pending = self._view[: self._filled]
        self._filled = 0
        self._write_through(pending)
        del pending
        self._release_buffers()

    def _set_buffered(self) -> None:
        try:
            self._calls.set_direct(self._fd, False)
        except OSError as exc:
            raise storage_error("turning off O_DIRECT for", self._path, exc) from exc
        self._direct = False

    def _write_at(self, view: memoryview, offset: int) -> None:
        """Write all of ``view`` at ``offset`` (``OSError`` on failure)."""
        done = 0
        while done < len(view):
            written = self._calls.pwrite(self._fd, view[done : done + _MAX_WRITE], offset + done)
            if written <= 0:
                raise OSError(errno.EIO, f"no progress (wrote {written} bytes)")
            done += written

    def _write_through(self, view: memoryview) -> None:
        """Write ``view`` through the page cache, starting writeback every few tens of MiB."""
        if not len(view):
            return
        try:
            self._write_at(view, self._offset)
        except OSError as exc:
            raise storage_error("writing", self._path, exc) from exc
        self._offset += len(view)
        if self._sync_file_range is not None and self._offset - self._writeback_from >= _WRITEBACK_CHUNK:
            self._start_writeback()

    def _start_writeback(self) -> None:
        """Ask the kernel to start writing the bytes written so far, without waiting, so the
        final fsync has less left to flush. A hint only: fsync still decides durability."""
        result = self._sync_file_range(
            self._fd, self._writeback_from, self._offset - self._writeback_from, _SYNC_FILE_RANGE_WRITE
        )
        if result != 0:
            code = ctypes.get_errno()
            if code in (errno.EINVAL, errno.ENOSYS, errno.ESPIPE, errno.EOPNOTSUPP):
                self._sync_file_range = None  # not supported here; fsync alone will do
                return
            raise storage_error("starting writeback of", self._path, OSError(code, os.strerror(code)))
        self._writeback_from = self._offset

    def _release_buffers(self) -> None:
        """Give the buffers back, once every write in flight (if any) has finished with them."""
        try:
            self._settle_all()
        finally:
            self._give_back()

    def _settle_all(self) -> None:
        """Wait for every background write, through interruptions (the first is raised after)."""
        interrupted: BaseException | None = None
        for future, _ in self._in_flight:
            try:
                self._settle(future)
            except BaseException as exc:  # the future is done: _settle waited it out
                interrupted = interrupted or exc
        if interrupted is not None:
            raise interrupted

    def _give_back(self) -> None:
        if any(not future.done() for future, _ in self._in_flight):
            return  # (interrupted twice while settling) never hand out a buffer still being written
        self._in_flight.clear()
        self._view = None
        self._filling = None
        buffers, self._buffers = self._buffers, []
        for buffer in buffers:
            _BUFFERS.give(buffer)

    def commit(self) -> None:
        self._check_open("commit")
        try:
            if self._view is not None:
                self._wait_in_flight()
                # The last partial block (or the whole of a small file) through the page cache.
                if self._direct:
                    self._set_buffered()
                pending = self._view[: self._filled]
                self._filled = 0
                self._write_through(pending)
                del pending
                self._release_buffers()
        except BaseException:
            self._failed = True
            self.abort()
            raise
        self._closed = True
        try:
            self._calls.fsync(self._fd)
        except OSError as exc:
            try:
                self._calls.close(self._fd)
            except OSError:
                pass  # the fsync's error is the one to report
            raise storage_error("fsync of", self._path, exc) from exc
        try:
            self._calls.close(self._fd)
        except OSError as exc:
            raise storage_error("closing", self._path, exc) from exc
        if self._on_commit is not None:
            self._on_commit(self.path_taken)

    def abort(self) -> None:
        try:
            self._release_buffers()  # waits for the write in flight: the fd is closed only after it
        finally:
            self._close_quietly()

    def _close_quietly(self) -> None:
        if any(not future.done() for future, _ in self._in_flight):
            return  # never: every write is settled first; a descriptor still written stays open
        if not self._closed:
            self._closed = True
            try:
                self._calls.close(self._fd)
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
    ``"buffered"``, ``"buffered: O_DIRECT refused (...)"``).
    """

    def __init__(self, root: str | os.PathLike[str], *, direct_io: bool = True) -> None:
        self._directory = os.path.abspath(os.fspath(root))
        self.direct_io = bool(direct_io) and _O_DIRECT != 0
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
            raise storage_error("creating", path, exc) from exc
        try:
            return _LocalWriter(fd, path, direct=self.direct_io, on_commit=self._count_path)
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
                    try:
                        names = os.listdir(fd)
                    except OSError as exc:
                        raise storage_error("listing", at or self.root, exc) from exc
                    for name in names:
                        relative = f"{at}{name}"
                        try:
                            info = _entry_info(os.stat(name, dir_fd=fd, follow_symlinks=False))
                        except FileNotFoundError:
                            continue
                        except OSError as exc:
                            raise storage_error("stat of", relative, exc) from exc
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
        found: list[tuple[str, EntryInfo]] = []
        try:
            try:
                names = os.listdir(fd)
            except OSError as exc:
                raise storage_error("listing", path or self.root, exc) from exc
            for name in names:
                try:
                    found.append((name, _entry_info(os.stat(name, dir_fd=fd, follow_symlinks=False))))
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    raise storage_error("stat of", name, exc) from exc
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
