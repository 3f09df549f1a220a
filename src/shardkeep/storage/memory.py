"""The in-memory backend: the reference implementation of the byte-store contract.

Everything lives in one dictionary of nodes guarded by a lock. It behaves like the local
backend in every way the conformance suite checks (create-only files, no-replace renames,
symlinks and special files refused, typed errors), without touching a disk, so it serves as the
reference the other backends are compared with and as a fast store for tests.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Literal

from shardkeep.errors import CheckpointExistsError, CheckpointNotFoundError, StorageError, UnsafePathError
from shardkeep.names import unsafe_path_reason
from shardkeep.storage.base import EntryInfo, StoreBase

__all__ = ["MemoryStore"]


@dataclass
class _Node:
    kind: Literal["file", "dir", "other"]
    data: bytearray = field(default_factory=bytearray)
    mtime: float = field(default_factory=time.time)


class _MemoryWriter:
    def __init__(self, store: MemoryStore, node: _Node) -> None:
        self._store = store
        self._node = node
        self._closed = False

    def write(self, data: bytes | memoryview, /) -> None:
        if self._closed:
            raise StorageError("writing to a closed file")
        with self._store._lock:
            self._node.data += memoryview(data).cast("B")
            self._node.mtime = time.time()

    def commit(self) -> None:
        self._closed = True

    def abort(self) -> None:
        self._closed = True


class _MemoryReader:
    def __init__(self, path: str, data: bytes) -> None:
        self._path = path
        self._data = data
        self.size = len(data)

    def map(self) -> memoryview:
        return memoryview(bytearray(self._data))

    def read_into(self, offset: int, buffer: memoryview, /) -> None:
        view = buffer.cast("B") if buffer.format != "B" else buffer
        end = offset + len(view)
        if offset < 0 or end > self.size:
            raise StorageError(
                f"reading {self._path!r}: unexpected end of file at byte {min(max(offset, 0), self.size)}"
            )
        view[:] = self._data[offset:end]

    def close(self) -> None:
        self._data = b""


class MemoryStore(StoreBase):
    """A :class:`~shardkeep.storage.base.ByteStore` held in memory. Thread-safe. It renames
    atomically; its ``root`` and other capabilities are the defaults."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._nodes: dict[str, _Node] = {"": _Node(kind="dir")}

    def __repr__(self) -> str:
        return f"MemoryStore({len(self._nodes) - 1} entries)"

    # -- helpers ----------------------------------------------------------------------------
    @staticmethod
    def _check(path: str) -> list[str]:
        reason = unsafe_path_reason(path)
        if reason is not None:
            raise UnsafePathError(f"unsafe path {path!r}: {reason}")
        return path.split("/")

    def _parent(self, parts: list[str], *, create: bool) -> None:
        """Check (or create) every directory above the last component."""
        for index in range(1, len(parts)):
            prefix = "/".join(parts[:index])
            node = self._nodes.get(prefix)
            if node is None:
                if not create:
                    raise CheckpointNotFoundError(f"{prefix!r} does not exist in the memory store")
                self._nodes[prefix] = _Node(kind="dir")
            elif node.kind != "dir":
                raise UnsafePathError(f"{prefix!r} in the memory store is a symlink or not a directory")

    def _below(self, path: str) -> list[str]:
        prefix = f"{path}/" if path else ""
        return [key for key in self._nodes if key and key.startswith(prefix)]

    def add_special(self, path: str) -> None:
        """Test hook: put a non-regular entry (standing for a symlink or FIFO) at ``path``."""
        with self._lock:
            parts = self._check(path)
            self._parent(parts, create=True)
            self._nodes[path] = _Node(kind="other")

    # -- ByteStore --------------------------------------------------------------------------
    def open_write(self, path: str) -> _MemoryWriter:
        parts = self._check(path)
        with self._lock:
            self._parent(parts, create=True)
            if path in self._nodes:
                raise CheckpointExistsError(f"{path!r} already exists in the memory store")
            node = _Node(kind="file")
            self._nodes[path] = node
            return _MemoryWriter(self, node)

    def open_read(self, path: str) -> _MemoryReader:
        parts = self._check(path)
        with self._lock:
            self._parent(parts, create=False)
            node = self._nodes.get(path)
            if node is None:
                raise CheckpointNotFoundError(f"{path!r} does not exist in the memory store")
            if node.kind != "file":
                raise UnsafePathError(f"{path!r} in the memory store is not a regular file")
            return _MemoryReader(path, bytes(node.data))

    def stat(self, path: str) -> EntryInfo | None:
        parts = self._check(path)
        with self._lock:
            try:
                self._parent(parts, create=False)
            except (CheckpointNotFoundError, UnsafePathError):
                return None
            node = self._nodes.get(path)
            if node is None:
                return None
            return EntryInfo(kind=node.kind, size=len(node.data) if node.kind == "file" else 0, mtime=node.mtime)

    def _directory(self, path: str) -> None:
        if path:
            self._parent([*self._check(path), "."], create=False)
        node = self._nodes.get(path)
        if node is None:
            raise CheckpointNotFoundError(f"directory {path!r} does not exist in the memory store")
        if node.kind != "dir":
            raise UnsafePathError(f"{path!r} in the memory store is a symlink or not a directory")

    def list_files(self, path: str) -> list[tuple[str, EntryInfo]]:
        with self._lock:
            self._directory(path)
            prefix = f"{path}/" if path else ""
            found = []
            for key in self._below(path):
                relative = key[len(prefix) :]
                # Nothing below an "other" entry is reachable: it is not descended into.
                if any(
                    self._nodes["/".join([*key.split("/")[:i]])].kind == "other" for i in range(1, key.count("/") + 1)
                ):
                    continue
                node = self._nodes[key]
                if node.kind != "dir":
                    found.append((relative, EntryInfo(kind=node.kind, size=len(node.data), mtime=node.mtime)))
            found.sort(key=lambda item: item[0])
            return found

    def list_dir(self, path: str = "") -> list[tuple[str, EntryInfo]]:
        with self._lock:
            self._directory(path)
            prefix = f"{path}/" if path else ""
            found = []
            for key in self._below(path):
                name = key[len(prefix) :]
                if "/" in name:
                    continue
                node = self._nodes[key]
                size = len(node.data) if node.kind == "file" else 0
                found.append((name, EntryInfo(kind=node.kind, size=size, mtime=node.mtime)))
            found.sort(key=lambda item: item[0])
            return found

    def put_atomic(self, path: str, data: bytes) -> None:
        parts = self._check(path)
        with self._lock:
            self._parent(parts, create=True)
            existing = self._nodes.get(path)
            if existing is not None and existing.kind != "file":
                raise UnsafePathError(f"{path!r} in the memory store is not a regular file")
            self._nodes[path] = _Node(kind="file", data=bytearray(data))

    def rename(self, src: str, dst: str) -> None:
        src_parts = self._check(src)
        dst_parts = self._check(dst)
        with self._lock:
            self._parent(src_parts, create=False)
            if src not in self._nodes:
                raise CheckpointNotFoundError(f"{src!r} does not exist in the memory store")
            if dst == src or dst.startswith(f"{src}/"):
                raise StorageError(f"cannot rename {src!r} into itself ({dst!r})")
            self._parent(dst_parts, create=True)
            existing = self._nodes.get(dst)
            if existing is not None:
                replaceable = existing.kind == "dir" and self._nodes[src].kind == "dir" and not self._below(dst)
                if not replaceable:
                    raise CheckpointExistsError(f"{dst!r} already exists in the memory store; it is never overwritten")
                del self._nodes[dst]  # an empty directory, replaced as rename(2) replaces it
            for key in [src, *self._below(src)]:
                self._nodes[dst + key[len(src) :]] = self._nodes.pop(key)

    def sync_dir(self, path: str) -> None:
        with self._lock:
            self._directory(path)

    def remove_tree(self, path: str) -> None:
        parts = self._check(path)
        with self._lock:
            try:
                self._parent(parts, create=False)
            except CheckpointNotFoundError:
                return
            if path not in self._nodes:
                return
            below = [] if self._nodes[path].kind == "other" else self._below(path)
            for key in [path, *below]:
                self._nodes.pop(key, None)
