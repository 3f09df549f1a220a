"""A fault-injecting wrapper for any byte store: fail the N-th operation, on purpose.

Used by shardkeep's own tests, by :mod:`shardkeep.testing.conformance` and by tests of a custom
store, to prove that a failure at any point of a save produces a typed error and leaves nothing
that looks committed. Every store call and every
handle call (``write``, ``commit``, ``read_into``, ``map``) counts as one operation; the
capabilities (``root``, ``atomic_rename``, ``remove_file``, ``abort_uploads``) are the wrapped
store's, uncounted.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable

from shardkeep.errors import StorageError
from shardkeep.storage.base import EntryInfo, ReadHandle, StoreBase, StoreOperations, WriteHandle, adapt_store

__all__ = ["FaultInjectingStore", "InjectedFault"]


class InjectedFault(StorageError):
    """The failure a :class:`FaultInjectingStore` raises at its chosen operation."""


class _Counter:
    def __init__(self, fail_at: int | None, code: int, fault: Callable[[str], None] | None) -> None:
        self.fail_at = fail_at
        self.code = code
        self.fault = fault
        self.count = 0
        self.operations: list[str] = []
        self._lock = threading.Lock()

    def tick(self, operation: str) -> None:
        with self._lock:
            self.count += 1
            self.operations.append(operation)
            if self.fail_at is None or self.count != self.fail_at:
                return
        if self.fault is not None:
            self.fault(operation)
        raise InjectedFault(
            f"injected {errno.errorcode.get(self.code, self.code)} at operation {self.count} ({operation})"
        ) from OSError(self.code, os.strerror(self.code), operation)


class _FaultyWriter:
    def __init__(self, inner: WriteHandle, counter: _Counter, path: str) -> None:
        self._inner = inner
        self._counter = counter
        self._path = path

    def write(self, data: bytes | memoryview, /) -> None:
        self._counter.tick(f"write {self._path}")
        self._inner.write(data)

    def commit(self) -> None:
        try:
            self._counter.tick(f"commit {self._path}")
        except InjectedFault:
            self._inner.abort()
            raise
        self._inner.commit()

    def abort(self) -> None:
        self._inner.abort()


class _FaultyReader:
    def __init__(self, inner: ReadHandle, counter: _Counter, path: str) -> None:
        self._inner = inner
        self._counter = counter
        self._path = path
        self.size = inner.size

    def map(self) -> memoryview:
        self._counter.tick(f"map {self._path}")
        return self._inner.map()

    def read_into(self, offset: int, buffer: memoryview, /) -> None:
        self._counter.tick(f"read {self._path}")
        self._inner.read_into(offset, buffer)

    def close(self) -> None:
        self._inner.close()


class FaultInjectingStore(StoreBase):
    """Wraps ``inner`` and raises :class:`InjectedFault` at operation number ``fail_at`` (1-based),
    chained to an ``OSError`` of ``code``, as a real store's failure is.

    With ``fail_at=None`` it only counts, so a first run can learn how many operations a save
    takes; ``operations`` lists them in order. ``remove_tree``, ``remove_file`` and
    ``abort_uploads`` are not counted, so cleanup after an injected failure still runs.

    Args:
        inner: the store to wrap.
        fail_at: the operation that fails, or ``None`` to count only.
        code: the ``errno`` the injected failure names (``EIO`` by default).
        fault: called with the operation's description at operation ``fail_at``, before the
            :class:`InjectedFault` is raised: a test that simulates a crash kills the process
            here (``lambda operation: os.kill(os.getpid(), signal.SIGKILL)``).
    """

    def __init__(
        self,
        inner: StoreOperations,
        *,
        fail_at: int | None = None,
        code: int = errno.EIO,
        fault: Callable[[str], None] | None = None,
    ) -> None:
        self.inner = inner
        self._capable = adapt_store(inner)  # inner's capabilities, or the defaults
        self._counter = _Counter(fail_at, code, fault)

    def __getattr__(self, name: str) -> object:
        # A backend's own attributes (FsspecStore.fs ...) pass through, uncounted.
        if name.startswith("_") or name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def root(self) -> str:
        return self._capable.root

    @property
    def atomic_rename(self) -> bool:
        return self._capable.atomic_rename

    def remove_file(self, path: str) -> None:
        self._capable.remove_file(path)

    def abort_uploads(self, path: str = "", *, older_than: float = 0.0) -> list[str]:
        return self._capable.abort_uploads(path, older_than=older_than)

    @property
    def operation_count(self) -> int:
        return self._counter.count

    @property
    def operations(self) -> list[str]:
        return list(self._counter.operations)

    def open_write(self, path: str) -> WriteHandle:
        self._counter.tick(f"open_write {path}")
        return _FaultyWriter(self.inner.open_write(path), self._counter, path)

    def open_read(self, path: str) -> ReadHandle:
        self._counter.tick(f"open_read {path}")
        return _FaultyReader(self.inner.open_read(path), self._counter, path)

    def stat(self, path: str) -> EntryInfo | None:
        self._counter.tick(f"stat {path}")
        return self.inner.stat(path)

    def list_files(self, path: str) -> list[tuple[str, EntryInfo]]:
        self._counter.tick(f"list_files {path}")
        return self.inner.list_files(path)

    def list_dir(self, path: str = "") -> list[tuple[str, EntryInfo]]:
        self._counter.tick(f"list_dir {path}")
        return self.inner.list_dir(path)

    def put_atomic(self, path: str, data: bytes) -> None:
        self._counter.tick(f"put_atomic {path}")
        self.inner.put_atomic(path, data)

    def rename(self, src: str, dst: str) -> None:
        self._counter.tick(f"rename {src} -> {dst}")
        self.inner.rename(src, dst)

    def sync_dir(self, path: str) -> None:
        self._counter.tick(f"sync_dir {path}")
        self.inner.sync_dir(path)

    def remove_tree(self, path: str) -> None:
        self.inner.remove_tree(path)
