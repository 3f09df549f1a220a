"""The byte-store interface that every storage backend implements.

A store is rooted at one directory (or bucket prefix). Paths given to it are relative,
``/``-separated and already checked by :func:`shardkeep.manifest.unsafe_path_reason`.

Who calls what: on a save, each writing rank calls ``open_write`` for its own files (from worker
threads: ``open_write`` and the handles it returns must be thread-safe across different paths),
then the coordinator alone calls ``sync_dir`` and ``rename``. On failure, the coordinator calls
``remove_tree`` on the staging directory. Readers call ``open_read``, ``stat`` and
``list_files`` from any thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

__all__ = ["ByteStore", "EntryInfo", "ReadHandle", "WriteHandle", "renames"]


@dataclass(frozen=True)
class EntryInfo:
    """What is at a path: ``kind`` is ``"file"``, ``"dir"`` or ``"other"`` (symlink, FIFO ...)."""

    kind: Literal["file", "dir", "other"]
    size: int
    mtime: float = 0.0


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


class ByteStore(Protocol):
    """Operations on one root. Every method raises :class:`~shardkeep.errors.StorageError`
    (or a more specific shardkeep error) on failure, never a bare ``OSError``.

    A store may set ``atomic_rename = False`` (object stores): it then has no ``rename``, and
    the commit protocol writes every object under its final key, the manifest last and
    create-only (see :func:`renames`).
    """

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
        (:class:`~shardkeep.errors.CheckpointExistsError`), then make the change durable (fsync
        of the directories involved). A missing ``src`` is a
        :class:`~shardkeep.errors.CheckpointNotFoundError`."""
        ...

    def sync_dir(self, path: str) -> None:
        """Make the entries of directory ``path`` (``""`` is the root) durable."""
        ...

    def remove_tree(self, path: str) -> None:
        """Remove ``path`` and everything below it, never following symlinks. Missing is fine."""
        ...


def renames(store: object) -> bool:
    """Whether ``store`` has an atomic no-replace rename (filesystems) or not (object stores)."""
    return bool(getattr(store, "atomic_rename", True))
