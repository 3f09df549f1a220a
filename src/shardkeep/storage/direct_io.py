"""The ``O_DIRECT`` write pipeline of the local store: a new file written past the page cache
in aligned blocks (some in the background), or through it, byte for byte the same file.

:class:`LocalWriter` is the handle :meth:`~shardkeep.storage.local.LocalStore.open_write`
returns; :class:`FileCalls` is every system call, block size and wait it makes, given by the
store, so that a test can stand a simulated disk under the real writer. The buffers and the
background threads are shared by every writer of the process and made anew in a forked child.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import fcntl
import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from typing import Any

from shardkeep.errors import StorageError
from shardkeep.storage.localfs import storage_error, sync_file_range_function

__all__ = ["DEFAULT_FILE_CALLS", "DIRECT_IN_FLIGHT", "DIRECT_IO_BLOCK", "O_DIRECT", "FileCalls", "LocalWriter"]

_MAX_WRITE = 1 << 30
_SYNC_FILE_RANGE_WRITE = 2
#: Start writeback after this many new bytes (see ``LocalWriter._start_writeback``).
_WRITEBACK_CHUNK = 32 << 20
#: Files of at least this many bytes are written with ``O_DIRECT``, this many bytes per write
#: (a multiple of every filesystem's direct I/O alignment).
DIRECT_IO_BLOCK = 8 << 20
#: Blocks of one file being written in the background at once (each holds a buffer; a deeper
#: queue was measured and did not pay).
DIRECT_IN_FLIGHT = 1
#: The ``O_DIRECT`` open flag (0 where the OS has none: direct I/O is then off).
O_DIRECT: int = getattr(os, "O_DIRECT", 0)


class FileCalls:
    """The system calls a :class:`LocalWriter` makes, the block geometry it uses and its waits
    for background writes, in one place: a :class:`~shardkeep.storage.local.LocalStore` is given
    one (``file_calls=``), so that a test stands a simulated disk (a power cut, a filesystem that
    refuses ``O_DIRECT``, a slow or interrupted background write) under the real writer.

    ``block`` is the size of one ``O_DIRECT`` write (a file of at least that many bytes is
    written past the page cache); ``in_flight`` is how many blocks of one file are written in
    the background at once (each holds a buffer)."""

    block: int = DIRECT_IO_BLOCK
    in_flight: int = DIRECT_IN_FLIGHT

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        return os.pwrite(fd, data, offset)

    def set_direct(self, fd: int, on: bool) -> None:
        """Turn ``O_DIRECT`` on or off for ``fd`` (``OSError`` ``EINVAL`` where the filesystem
        refuses it)."""
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | O_DIRECT if on else flags & ~O_DIRECT)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def submit(self, job: Callable[[], None]) -> None:
        """Queue ``job`` (one block's write) on the background writers."""
        _BlockWriters.submit(job)

    def wait(self, future: Future[None]) -> None:
        """Wait until a background write is over (an interruption may end the wait early)."""
        wait_for([future])


#: The calls of a store given none.
DEFAULT_FILE_CALLS = FileCalls()
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


def _after_fork_in_child() -> None:
    """A parent thread may have held these locks at the fork, and the pool's threads are not in
    the child."""
    _BlockWriters.forget()
    _BUFFERS._lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


class LocalWriter:
    """A new file written in one of two ways, chosen by its size (see
    :class:`~shardkeep.storage.local.LocalStore`):

    - a file of at least one block (``calls.block``, :data:`DIRECT_IO_BLOCK`) is copied into
      reused page-aligned buffers and written with ``O_DIRECT`` one whole block at a time, past
      the page cache: up to ``calls.in_flight`` blocks are written in the background while the
      next is filled (``calls.in_flight + 1`` buffers per file). The last partial block is
      written through the page cache, so the file is byte for byte what a buffered write gives
      (no padding);
    - a smaller file, or any file on a filesystem that refuses ``O_DIRECT``, is written through
      the page cache, with writeback started every ``_WRITEBACK_CHUNK`` bytes.

    The first block is collected before anything is written, which is how the size is told.
    Either way ``commit`` fsyncs the file: ``O_DIRECT`` skips the page cache, not the disk's
    own cache or the file's size in its inode. ``path_taken`` says which way ran (``"direct"``,
    ``"buffered"``, or ``"buffered: <why>"`` when ``O_DIRECT`` was refused or turned off).
    """

    def __init__(
        self,
        fd: int,
        path: str,
        *,
        direct: bool,
        on_commit: Callable[[str], None] | None = None,
        calls: FileCalls = DEFAULT_FILE_CALLS,
    ) -> None:
        self._fd = fd
        self._path = path
        self._on_commit = on_commit
        self._calls = calls
        self._closed = False
        self._failed = False  # a write failed: the file may miss bytes, and must not be committed
        self._offset = 0  # bytes of the file written, or handed to a background write
        self._writeback_from = 0
        self._sync_file_range = sync_file_range_function()
        self._block = calls.block
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
        while len(self._in_flight) >= self._calls.in_flight:
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
            self._calls.submit(job)
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

    def _settle(self, future: Future[None]) -> None:
        """Wait until a background write is over, whatever happens meanwhile: its buffer and the
        file descriptor must outlive it (a descriptor closed early could be reused by another
        file, which the write would then land in). An interruption (Ctrl-C) is raised after."""
        interrupted: BaseException | None = None
        while not future.done():
            try:
                self._calls.wait(future)
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
