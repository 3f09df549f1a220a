"""A simulated disk that loses everything not yet made durable when the power is cut.

:class:`PowerLossStore` implements the byte-store contract over an in-memory tree of inodes
with two views:

- the *volatile* view, what a running process sees;
- the *durable* view, what survives a power cut. A file's data becomes durable when the file is
  fsynced (``WriteHandle.commit``); a directory's entries (files and directories created,
  renamed or removed in it) become durable when that directory is fsynced (``sync_dir``, and
  the directory fsyncs that ``rename`` and ``put_atomic`` promise). This is the strict POSIX
  model: nothing is durable by accident.

``cut_at=N`` cuts the power at the N-th operation (1-based; every store and handle call
counts): that operation and every later one raise :class:`PowerCut` and change nothing.
:meth:`PowerLossStore.after_power_loss` returns what a reboot finds, as a fresh
:class:`~shardkeep.storage.memory.MemoryStore`.

``skip_sync=K`` turns the K-th fsync (1-based, in the order they happen) into a no-op: the
mutation check that proves each required fsync is needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from shardkeep.errors import CheckpointExistsError, CheckpointNotFoundError, StorageError, UnsafePathError
from shardkeep.manifest import unsafe_path_reason
from shardkeep.storage.base import EntryInfo
from shardkeep.storage.memory import MemoryStore


class PowerCut(StorageError):
    """The simulated power failed: nothing after it happens."""


@dataclass(eq=False)
class _Inode:
    kind: Literal["file", "dir"]
    data: bytearray = field(default_factory=bytearray)
    durable_data: bytes = b""
    children: dict[str, _Inode] = field(default_factory=dict)
    durable_children: dict[str, _Inode] = field(default_factory=dict)


class _Writer:
    def __init__(self, store: PowerLossStore, inode: _Inode, path: str) -> None:
        self._store = store
        self._inode = inode
        self._path = path

    def write(self, data: bytes | memoryview, /) -> None:
        self._store._tick(f"write {self._path}")
        self._inode.data += memoryview(data).cast("B")

    def commit(self) -> None:
        self._store._tick(f"fsync+close {self._path}")
        if self._store._sync(f"fsync {self._path}"):
            self._inode.durable_data = bytes(self._inode.data)

    def abort(self) -> None:
        pass


class _Reader:
    def __init__(self, store: PowerLossStore, data: bytes, path: str) -> None:
        self._store = store
        self._data = data
        self._path = path
        self.size = len(data)

    def map(self) -> memoryview:
        self._store._tick(f"map {self._path}")
        return memoryview(bytearray(self._data))

    def read_into(self, offset: int, buffer: memoryview, /) -> None:
        self._store._tick(f"read {self._path}")
        view = buffer.cast("B") if buffer.format != "B" else buffer
        if offset < 0 or offset + len(view) > self.size:
            raise StorageError(f"reading {self._path!r}: unexpected end of file")
        view[:] = self._data[offset : offset + len(view)]

    def close(self) -> None:
        pass


class PowerLossStore:
    """A byte store on a simulated disk that drops unsynced writes at a power cut."""

    def __init__(self, *, cut_at: int | None = None, skip_sync: int | None = None) -> None:
        self.root = _Inode(kind="dir")
        self.cut_at = cut_at
        self.skip_sync = skip_sync
        self.operations: list[str] = []
        self.syncs: list[str] = []
        self.cut = False

    # -- the simulation ---------------------------------------------------------------------
    def _tick(self, operation: str) -> None:
        if self.cut:
            raise PowerCut(f"no power ({operation})")
        self.operations.append(operation)
        if self.cut_at is not None and len(self.operations) >= self.cut_at:
            self.cut = True
            raise PowerCut(f"power cut at operation {len(self.operations)} ({operation})")

    def _sync(self, what: str) -> bool:
        """Count one fsync; False when the mutation removes it."""
        self.syncs.append(what)
        return len(self.syncs) != self.skip_sync

    def _sync_directory(self, directory: _Inode, what: str) -> None:
        if self._sync(what):
            directory.durable_children = dict(directory.children)

    def arm(self, cut_at: int | None, skip_sync: int | None = None) -> None:
        """Start counting afresh (after setting the disk up) with a new cut point and mutation."""
        self.operations = []
        self.syncs = []
        self.cut_at = cut_at
        self.skip_sync = skip_sync

    def after_power_loss(self) -> MemoryStore:
        """What a reboot finds: every durable entry, with its durable data."""
        found = MemoryStore()

        def walk(directory: _Inode, prefix: str) -> None:
            for name, inode in sorted(directory.durable_children.items()):
                path = f"{prefix}{name}"
                if inode.kind == "dir":
                    walk(inode, f"{path}/")  # (an empty directory does not survive the copy; none matters)
                else:
                    found.put_atomic(path, inode.durable_data)

        walk(self.root, "")
        return found

    # -- path helpers -----------------------------------------------------------------------
    @staticmethod
    def _parts(path: str) -> list[str]:
        reason = unsafe_path_reason(path)
        if reason is not None:
            raise UnsafePathError(f"unsafe path {path!r}: {reason}")
        return path.split("/")

    def _dir(self, parts: list[str], *, create: bool) -> _Inode:
        node = self.root
        for name in parts:
            child = node.children.get(name)
            if child is None:
                if not create:
                    raise CheckpointNotFoundError(f"{'/'.join(parts)!r} does not exist")
                child = node.children[name] = _Inode(kind="dir")
            if child.kind != "dir":
                raise UnsafePathError(f"{name!r} is not a directory")
            node = child
        return node

    def _lookup(self, path: str) -> _Inode | None:
        if path == "":
            return self.root
        parts = self._parts(path)
        try:
            parent = self._dir(parts[:-1], create=False)
        except (CheckpointNotFoundError, UnsafePathError):
            return None
        return parent.children.get(parts[-1])

    # -- ByteStore --------------------------------------------------------------------------
    def open_write(self, path: str) -> _Writer:
        self._tick(f"open_write {path}")
        parts = self._parts(path)
        parent = self._dir(parts[:-1], create=True)
        if parts[-1] in parent.children:
            raise CheckpointExistsError(f"{path!r} already exists")
        inode = parent.children[parts[-1]] = _Inode(kind="file")
        return _Writer(self, inode, path)

    def open_read(self, path: str) -> _Reader:
        self._tick(f"open_read {path}")
        inode = self._lookup(path)
        if inode is None:
            raise CheckpointNotFoundError(f"{path!r} does not exist")
        if inode.kind != "file":
            raise UnsafePathError(f"{path!r} is not a regular file")
        return _Reader(self, bytes(inode.data), path)

    def stat(self, path: str) -> EntryInfo | None:
        self._tick(f"stat {path}")
        inode = self._lookup(path)
        if inode is None:
            return None
        return EntryInfo(kind=inode.kind, size=len(inode.data) if inode.kind == "file" else 0, mtime=0.0)

    def list_files(self, path: str) -> list[tuple[str, EntryInfo]]:
        self._tick(f"list_files {path}")
        directory = self._lookup(path)
        if directory is None or directory.kind != "dir":
            raise CheckpointNotFoundError(f"directory {path!r} does not exist")
        found: list[tuple[str, EntryInfo]] = []
        stack = [(directory, "")]
        while stack:
            node, prefix = stack.pop()
            for name, child in node.children.items():
                if child.kind == "dir":
                    stack.append((child, f"{prefix}{name}/"))
                else:
                    found.append((f"{prefix}{name}", EntryInfo(kind="file", size=len(child.data), mtime=0.0)))
        return sorted(found)

    def list_dir(self, path: str = "") -> list[tuple[str, EntryInfo]]:
        self._tick(f"list_dir {path}")
        directory = self._lookup(path)
        if directory is None or directory.kind != "dir":
            raise CheckpointNotFoundError(f"directory {path!r} does not exist")
        return sorted(
            (name, EntryInfo(kind=child.kind, size=len(child.data), mtime=0.0))
            for name, child in directory.children.items()
        )

    def put_atomic(self, path: str, data: bytes) -> None:
        self._tick(f"put_atomic {path}")
        parts = self._parts(path)
        parent = self._dir(parts[:-1], create=True)
        inode = _Inode(kind="file", data=bytearray(data))
        if self._sync(f"fsync {path} (put_atomic)"):
            inode.durable_data = bytes(data)
        parent.children[parts[-1]] = inode
        self._sync_directory(parent, f"fsync directory of {path} (put_atomic)")

    def rename(self, src: str, dst: str) -> None:
        self._tick(f"rename {src} -> {dst}")
        src_parts, dst_parts = self._parts(src), self._parts(dst)
        src_parent = self._dir(src_parts[:-1], create=False)
        inode = src_parent.children.get(src_parts[-1])
        if inode is None:
            raise CheckpointNotFoundError(f"{src!r} does not exist")
        dst_parent = self._dir(dst_parts[:-1], create=True)
        existing = dst_parent.children.get(dst_parts[-1])
        if existing is not None and not (existing.kind == "dir" == inode.kind and not existing.children):
            raise CheckpointExistsError(f"{dst!r} already exists")  # rename(2) replaces only an empty directory
        del src_parent.children[src_parts[-1]]
        dst_parent.children[dst_parts[-1]] = inode
        # The contract: the directories the rename changed are fsynced.
        self._sync_directory(dst_parent, f"fsync directory of {dst} (rename)")
        if src_parent is not dst_parent:
            self._sync_directory(src_parent, f"fsync directory of {src} (rename)")

    def sync_dir(self, path: str) -> None:
        self._tick(f"sync_dir {path}")
        directory = self._lookup(path)
        if directory is None or directory.kind != "dir":
            raise CheckpointNotFoundError(f"directory {path!r} does not exist")
        self._sync_directory(directory, f"fsync directory {path or '<root>'}")

    def remove_tree(self, path: str) -> None:
        if self.cut:
            raise PowerCut(f"no power (remove_tree {path})")
        parts = self._parts(path)
        try:
            parent = self._dir(parts[:-1], create=False)
        except CheckpointNotFoundError:
            return
        parent.children.pop(parts[-1], None)
