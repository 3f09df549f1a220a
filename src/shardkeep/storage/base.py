"""The byte-store interface that every storage backend implements: its operations, its optional
capabilities, and how a store that lacks the capabilities gets their defaults.

A store is rooted at one directory (or bucket prefix). Paths given to it are relative,
``/``-separated and already checked by :func:`shardkeep.names.unsafe_path_reason`.

Who calls what: on a save, each writing rank calls ``open_write`` for its own files (from worker
threads: ``open_write`` and the handles it returns must be thread-safe across different paths),
then the coordinator alone calls ``sync_dir`` and ``rename``. On failure, the coordinator calls
``remove_tree`` on the staging directory. Readers call ``open_read``, ``stat`` and
``list_files`` from any thread. Retention and leftover collection (the coordinator alone) call
``rename``, ``remove_file``, ``remove_tree`` and ``abort_uploads``.

The built-in stores inherit :class:`StoreBase`. A store from elsewhere may implement only the
operations (:class:`StoreOperations`): where such a store enters (``storage=``, a byte store in
``tier_locations``, a :class:`~shardkeep.catalog.CheckpointRoot`), :func:`adapt_store` gives it
the default capabilities, so the code above this layer uses every member of :class:`ByteStore`
directly, never ``getattr``.
"""

from __future__ import annotations

import abc
import threading
import weakref
from dataclasses import dataclass
from typing import Literal, Protocol

from shardkeep.names import ATTEMPT_PREFIX

__all__ = [
    "ATTEMPT_PREFIX",
    "ByteStore",
    "EntryInfo",
    "ForwardingStore",
    "ReadHandle",
    "StoreBase",
    "StoreOperations",
    "WriteHandle",
    "adapt_store",
    "renames",
    "write_new",
]


@dataclass(frozen=True)
class EntryInfo:
    """What is at a path: ``kind`` is ``"file"``, ``"dir"`` or ``"other"`` (symlink, FIFO ...).
    ``mount_point`` marks a directory on which another filesystem is mounted (a rename can never
    replace it)."""

    kind: Literal["file", "dir", "other"]
    size: int
    mtime: float = 0.0
    mount_point: bool = False


class WriteHandle(Protocol):
    """A new file being written. ``write`` appends all of ``data``; ``commit`` makes the file
    durable (fsync) and closes it; ``abort`` closes it without promising anything. Exactly one of
    ``commit`` or ``abort`` is called, once. Not shared between threads."""

    def write(self, data: bytes | memoryview, /) -> None: ...

    def commit(self) -> None: ...

    def abort(self) -> None: ...


class ReadHandle(Protocol):
    """An open regular file. ``size`` is its size when opened. ``map`` returns the whole file as
    a writable private view (copy-on-write memory map where the backend can), whose writes never
    reach storage. ``read_into`` fills ``buffer`` from ``offset`` exactly or raises."""

    size: int

    def map(self) -> memoryview: ...

    def read_into(self, offset: int, buffer: memoryview, /) -> None: ...

    def close(self) -> None: ...


class StoreOperations(Protocol):
    """The operations every store has, on one root. Every method raises
    :class:`~shardkeep.errors.StorageError` (or a more specific shardkeep error) on failure,
    never a bare ``OSError``. This is all a store from elsewhere must implement."""

    def open_write(self, path: str) -> WriteHandle:
        """Create a new file (create-only: an existing path is an error), making parents."""
        ...

    def open_read(self, path: str) -> ReadHandle:
        """Open a regular file without following symlinks."""
        ...

    def stat(self, path: str) -> EntryInfo | None:
        """What is at ``path`` (not following symlinks), or ``None`` if nothing is."""
        ...

    def list_files(self, path: str) -> list[tuple[str, EntryInfo]]:
        """Every entry below directory ``path`` (``""`` is the root), recursively, as (relative
        path, info), sorted; directories themselves are not listed. Symlinks and special files
        are listed with kind ``"other"`` and not descended into. A missing directory is a
        :class:`~shardkeep.errors.CheckpointNotFoundError`."""
        ...

    def list_dir(self, path: str = "") -> list[tuple[str, EntryInfo]]:
        """The entries directly inside directory ``path`` (``""`` is the root), as (name, info),
        sorted by name; nothing is descended into."""
        ...

    def put_atomic(self, path: str, data: bytes) -> None:
        """Replace the small file ``path`` with ``data`` atomically and durably: a reader sees the
        old bytes or the new ones, never a mix (temp file, fsync, replacing rename, directory
        fsync on a filesystem; a single PUT on an object store)."""
        ...

    def rename(self, src: str, dst: str) -> None:
        """Atomically move ``src`` to ``dst``, refusing to replace an existing ``dst``
        (:class:`~shardkeep.errors.CheckpointExistsError`) unless ``src`` is a directory and
        ``dst`` an empty directory, which is replaced in the same atomic step (as ``rename(2)``
        does; a filesystem store first gives ``src`` the mode bits, owner and group of the
        directory it replaces, not its ACLs or other extended attributes), then make the change
        durable (fsync of the directories involved). A missing ``src`` is a
        :class:`~shardkeep.errors.CheckpointNotFoundError`. Only called when ``atomic_rename``."""
        ...

    def sync_dir(self, path: str) -> None:
        """Make the entries of directory ``path`` (``""`` is the root) durable."""
        ...

    def remove_tree(self, path: str) -> None:
        """Remove ``path`` and everything below it, never following symlinks. Missing is fine."""
        ...


class ByteStore(StoreOperations, Protocol):
    """A store as shardkeep uses it: the operations, and five capabilities a store may lack.
    What each capability means for a store that lacks it (the default, in :class:`StoreBase`):

    - ``root``: the store's repr;
    - ``atomic_rename``: ``True``;
    - ``remove_file``: ``remove_tree`` of the path;
    - ``abort_uploads``: nothing to abort;
    - ``read_gap``: 0 (ranged reads merge only runs that touch).
    """

    @property
    def root(self) -> str:
        """Where the store is rooted, as a user names it (an absolute directory, or a URL such
        as ``s3://bucket/prefix``): used in messages, and to tell whether two stores are the same
        root (an incremental base named by path must be). A store that cannot say gives its
        repr, which equals no other store's root."""
        ...

    @property
    def atomic_rename(self) -> bool:
        """Whether ``rename`` works (filesystems). ``False`` (object stores): there is no
        rename, and the commit protocol writes every object under its final key, under an
        ``attempt-<id>/`` prefix, the manifest last and create-only
        (:class:`~shardkeep.distributed.commit.ObjectStoreCommit`)."""
        ...

    @property
    def read_gap(self) -> int:
        """The largest gap (bytes) between two byte runs of one file that a ranged read reads
        through rather than issuing two reads (:mod:`shardkeep.reads`): 0 where a read costs
        little (local files, memory), about 1 MiB where each request costs tens of ms (object
        stores). Every gap byte is read and discarded."""
        ...

    def remove_file(self, path: str) -> None:
        """Remove the one file ``path`` (missing is fine) and confirm that it is gone; used to
        un-commit a checkpoint by removing its manifest. A store without a single-file delete
        of its own does ``remove_tree(path)``."""
        ...

    def abort_uploads(self, path: str = "", *, older_than: float = 0.0) -> list[str]:
        """Abort the unfinished uploads (S3 multipart uploads) below ``path`` started more than
        ``older_than`` seconds ago, which no listing shows; return their keys. A store without
        such uploads has nothing to abort and returns ``[]``."""
        ...


class StoreBase(abc.ABC):
    """A byte store with the default capabilities (see :class:`ByteStore` for every contract):
    subclasses implement the operations and override the capabilities they have."""

    @abc.abstractmethod
    def open_write(self, path: str) -> WriteHandle: ...

    @abc.abstractmethod
    def open_read(self, path: str) -> ReadHandle: ...

    @abc.abstractmethod
    def stat(self, path: str) -> EntryInfo | None: ...

    @abc.abstractmethod
    def list_files(self, path: str) -> list[tuple[str, EntryInfo]]: ...

    @abc.abstractmethod
    def list_dir(self, path: str = "") -> list[tuple[str, EntryInfo]]: ...

    @abc.abstractmethod
    def put_atomic(self, path: str, data: bytes) -> None: ...

    @abc.abstractmethod
    def rename(self, src: str, dst: str) -> None: ...

    @abc.abstractmethod
    def sync_dir(self, path: str) -> None: ...

    @abc.abstractmethod
    def remove_tree(self, path: str) -> None: ...

    @property
    def root(self) -> str:
        return repr(self)

    @property
    def atomic_rename(self) -> bool:
        return True

    @property
    def read_gap(self) -> int:
        return 0

    def remove_file(self, path: str) -> None:
        self.remove_tree(path)

    def abort_uploads(self, path: str = "", *, older_than: float = 0.0) -> list[str]:
        return []


class ForwardingStore(StoreBase):
    """A store that passes every operation to ``inner``, with ``inner``'s own capabilities or,
    where it lacks one, the default (which ones it has is looked up once, here).

    :func:`adapt_store` wraps a store from elsewhere in one. Subclass it to wrap a store and
    change a few operations (count the bytes read, pause a write, inject a fault): override
    those, and everything else passes through.
    """

    def __init__(self, inner: StoreOperations) -> None:
        self.inner = inner
        root = getattr(inner, "root", None)
        self._root = repr(inner) if root is None else str(root)
        self._atomic_rename = bool(getattr(inner, "atomic_rename", True))
        self._read_gap = int(getattr(inner, "read_gap", 0))
        self._remove_file = getattr(inner, "remove_file", None)
        self._abort_uploads = getattr(inner, "abort_uploads", None)

    def __repr__(self) -> str:
        return repr(self.inner)

    @property
    def root(self) -> str:
        return self._root

    @property
    def atomic_rename(self) -> bool:
        return self._atomic_rename

    @property
    def read_gap(self) -> int:
        return self._read_gap

    def remove_file(self, path: str) -> None:
        if callable(self._remove_file):
            self._remove_file(path)
        else:
            self.inner.remove_tree(path)

    def abort_uploads(self, path: str = "", *, older_than: float = 0.0) -> list[str]:
        if not callable(self._abort_uploads):
            return []
        return list(self._abort_uploads(path, older_than=older_than))

    def open_write(self, path: str) -> WriteHandle:
        return self.inner.open_write(path)

    def open_read(self, path: str) -> ReadHandle:
        return self.inner.open_read(path)

    def stat(self, path: str) -> EntryInfo | None:
        return self.inner.stat(path)

    def list_files(self, path: str) -> list[tuple[str, EntryInfo]]:
        return self.inner.list_files(path)

    def list_dir(self, path: str = "") -> list[tuple[str, EntryInfo]]:
        return self.inner.list_dir(path)

    def put_atomic(self, path: str, data: bytes) -> None:
        self.inner.put_atomic(path, data)

    def rename(self, src: str, dst: str) -> None:
        self.inner.rename(src, dst)

    def sync_dir(self, path: str) -> None:
        self.inner.sync_dir(path)

    def remove_tree(self, path: str) -> None:
        self.inner.remove_tree(path)


_adapted: weakref.WeakValueDictionary[int, ForwardingStore] = weakref.WeakValueDictionary()
_adapting = threading.Lock()


def adapt_store(store: StoreOperations) -> ByteStore:
    """``store`` itself if it is a :class:`StoreBase`, else ``store`` with the default
    capabilities for those it lacks (an adapter that passes everything else to it).

    The same store object gets the same adapter while that adapter is in use, so two places
    that adapt one store still see one store (``is``). Thread-safe.
    """
    if isinstance(store, StoreBase):
        return store
    with _adapting:
        adapter = _adapted.get(id(store))
        if adapter is None or adapter.inner is not store:
            adapter = _adapted[id(store)] = ForwardingStore(store)
        return adapter


def renames(store: StoreOperations) -> bool:
    """Whether ``store`` has an atomic no-replace rename (filesystems) or not (object stores):
    its ``atomic_rename``, for any store (through :func:`adapt_store`)."""
    return adapt_store(store).atomic_rename


def write_new(store: StoreOperations, path: str, data: bytes) -> None:
    """Write the small file ``path`` (new) with ``data`` and make it durable (the handle's
    commit: fsync on a filesystem, a completed upload on an object store); nothing is left
    behind on failure."""
    handle = store.open_write(path)
    try:
        handle.write(data)
        handle.commit()
    except BaseException:
        handle.abort()
        raise
