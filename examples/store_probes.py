"""Probes the demo watches a training run through: byte stores that wrap a real one.

- :class:`CountingStore` counts the bytes a load reads from each file (what the store served
  through ``read_into`` and ``map``), to show that each rank reads only its part of a
  checkpoint. :func:`kernel_read_bytes` is the kernel's own count for the whole process
  (``rchar`` in ``/proc/self/io``: every byte returned by ``read()``-family calls), the
  independent cross-check.
- :class:`PausingStore` holds one rank inside one save, after its first data file is written
  into the staging directory and before the rank reports its files, and says so in a small
  JSON file. The demo kills that rank there: a kill in the middle of an async save, landed the
  same way on a fast machine or a loaded one.

Both pass every other call straight to the wrapped store, so the library behaves as usual.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardkeep.storage import ByteStore, ForwardingStore, ReadHandle, WriteHandle

__all__ = ["CountingStore", "PausingStore", "kernel_read_bytes"]


def kernel_read_bytes() -> int | None:
    """This process's ``rchar`` from ``/proc/self/io`` (``None`` where there is none)."""
    try:
        with open("/proc/self/io") as file:
            for line in file:
                name, _, value = line.partition(":")
                if name == "rchar":
                    return int(value)
    except OSError:
        return None
    return None


class _Wrapped(ForwardingStore):
    """A byte store that passes every call to ``inner`` (subclasses override a few)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"

    def __getattr__(self, name: str) -> Any:  # a backend's own extras (FsspecStore.fs ...)
        if name.startswith("_") or name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


# -- counting reads ------------------------------------------------------------------------------
class _CountingReader:
    def __init__(self, handle: ReadHandle, count: Callable[[int], None]) -> None:
        self._handle = handle
        self._count = count
        self.size = handle.size

    def map(self) -> memoryview:
        self._count(self.size)  # a whole mapping may be touched anywhere: counted whole
        return self._handle.map()

    def read_into(self, offset: int, buffer: memoryview, /) -> None:
        self._handle.read_into(offset, buffer)
        self._count(buffer.nbytes)

    def close(self) -> None:
        self._handle.close()


class CountingStore(_Wrapped):
    """Counts, per path, the bytes read through the handles it opens. Thread-safe (loads read
    files from a thread pool)."""

    def __init__(self, inner: ByteStore) -> None:
        super().__init__(inner)
        self._lock = threading.Lock()
        self.bytes_read: dict[str, int] = {}

    def open_read(self, path: str) -> ReadHandle:
        handle = self.inner.open_read(path)
        with self._lock:
            self.bytes_read.setdefault(path, 0)

        def count(size: int) -> None:
            with self._lock:
                self.bytes_read[path] += size

        return _CountingReader(handle, count)


# -- pausing a save ------------------------------------------------------------------------------
class _PausingWriter:
    def __init__(self, handle: WriteHandle, store: PausingStore, path: str) -> None:
        self._handle = handle
        self._store = store
        self._path = path
        self._written = 0

    def write(self, data: bytes | memoryview, /) -> None:
        self._handle.write(data)
        self._written += memoryview(data).nbytes

    def commit(self) -> None:
        self._store.pause(self._path, self._written)
        self._handle.commit()

    def abort(self) -> None:
        self._handle.abort()


class PausingStore(_Wrapped):
    """Pauses every data file of the save of checkpoint ``name`` just before it is made
    durable, for at most ``limit`` seconds, after writing ``announce`` (JSON: this process's
    pid, the staging directory, the file and its size). Files of other saves pass through."""

    def __init__(self, inner: ByteStore, name: str, announce: Path, *, limit: float = 300.0) -> None:
        super().__init__(inner)
        self.prefix = f"{name}.tmp-"  # the staging directory of that save (docs/concepts.md)
        self.announce = announce
        self.limit = limit
        self._announced = threading.Lock()

    def open_write(self, path: str) -> WriteHandle:
        handle = self.inner.open_write(path)
        return _PausingWriter(handle, self, path) if path.startswith(self.prefix) else handle

    def pause(self, path: str, written: int) -> None:
        if self._announced.acquire(blocking=False):  # the first file says where the save is
            staging = path.partition("/")[0]
            record = {"pid": os.getpid(), "staging": staging, "file": path, "bytes_written": written}
            temporary = self.announce.with_name(self.announce.name + ".tmp")
            temporary.write_text(json.dumps(record) + "\n")
            temporary.rename(self.announce)
        time.sleep(self.limit)  # the demo kills this process long before
