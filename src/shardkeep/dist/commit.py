"""The commit protocol for a checkpoint on a filesystem store: staging, manifest last, one rename.

:class:`CheckpointCommit` owns one save attempt. Its steps, in order:

1. ``begin``: refuse if the final name is already committed; choose a fresh staging name
   ``<final>.tmp-<uuid>`` in the same parent (RELIABILITY.md rules 1 and 2).
2. Writers create every data file under the staging directory; each file is fsynced before its
   record is reported (rule 3).
3. ``commit(manifest_bytes)``: fsync the data directories; write ``manifest.json.tmp``, fsync it,
   rename it to ``manifest.json`` (the rename fsyncs the staging directory); then the commit point: rename
   the staging directory to its final name (refusing to replace anything) and fsync the parent
   (rules 4 and 5).
4. ``abort``: remove the staging directory, and only it (rule 7).

Crash windows and what recovery sees:

- before step 3's final rename: only ``<final>.tmp-<uuid>`` exists. It is never read as a
  checkpoint; stale staging directories are collected later by the coordinator, after a lease.
- after the rename, before the parent fsync: on power loss the rename may be lost (the
  checkpoint is then absent, the staging directory remains) or kept (committed, complete,
  because every file and directory below it was fsynced before the rename).
- after the parent fsync: committed and durable.

A manifest is never visible under the final name without every file it lists being durable.
"""

from __future__ import annotations

import uuid

from shardkeep.errors import CheckpointExistsError, UnsafePathError
from shardkeep.manifest import MANIFEST_FILENAME, STAGING_MARKER
from shardkeep.storage.base import ByteStore

__all__ = ["CheckpointCommit"]


class CheckpointCommit:
    """One save attempt of checkpoint ``final`` (a name directly under the store's root)."""

    def __init__(self, store: ByteStore, final: str, staging: str | None = None) -> None:
        """``staging`` is given on non-coordinator ranks: the name the coordinator chose."""
        self.store = store
        self.final = final
        self.staging = staging or f"{final}{STAGING_MARKER}{uuid.uuid4().hex}"
        if not self.staging.startswith(f"{final}{STAGING_MARKER}"):
            raise UnsafePathError(f"staging name {self.staging!r} does not belong to {final!r}")
        self.data_dirs: set[str] = set()

    def begin(self) -> None:
        if self.store.stat(self.final) is not None:
            raise CheckpointExistsError(
                f"checkpoint {self.final!r} already exists in {self.store!r}; committed checkpoints are never overwritten"
            )

    def staged(self, relative: str) -> str:
        """The store path of a file inside the staging directory."""
        directory, _, _ = relative.rpartition("/")
        if directory:
            self.data_dirs.add(directory)
        return f"{self.staging}/{relative}"

    def commit(self, manifest_bytes: bytes) -> None:
        """Write the manifest last, then publish the staging directory under its final name."""
        for directory in sorted(self.data_dirs, key=lambda d: -d.count("/")):
            self.store.sync_dir(f"{self.staging}/{directory}")
        temporary = f"{self.staging}/{MANIFEST_FILENAME}.tmp"
        handle = self.store.open_write(temporary)
        try:
            handle.write(manifest_bytes)
            handle.commit()
        except BaseException:
            handle.abort()
            raise
        # ByteStore.rename fsyncs the directory it changed: here the staging directory, which
        # also makes its data subdirectories' entries durable.
        self.store.rename(temporary, f"{self.staging}/{MANIFEST_FILENAME}")
        self.store.rename(self.staging, self.final)

    def abort(self) -> None:
        self.store.remove_tree(self.staging)
