"""The commit protocol for a checkpoint on a filesystem store: staging, manifest last, one rename.

:class:`CheckpointCommit` owns one save attempt. Its steps, in order:

1. ``begin``: refuse if the final name is already committed; choose a fresh staging name
   ``<final>.tmp-<uuid>`` in the same parent, so a retry never overwrites anything and the final
   rename never crosses filesystems.
2. Writers create every data file under the staging directory; each file is fsynced before its
   record is reported (rule 3).
3. ``commit(manifest_bytes, signature)``: fsync the data directories; write ``manifest.sig`` if
   the save is signed; write ``manifest.json.tmp``, fsync it,
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

On an object store (no rename; the commit is the manifest object, written last and create-only) the same class follows another
protocol: ``begin`` refuses if ``<final>/manifest.json`` exists; data objects are written under
``<final>/attempt-<id>/``, a prefix no other attempt uses, so no object is ever overwritten;
``commit`` writes the manifest last, create-only (``If-None-Match: *``), so that of two
coordinators committing the same name one fails; ``abort`` deletes the attempt's prefix and
aborts its unfinished multipart uploads. A killed attempt leaves objects without a manifest,
which no reader takes for a checkpoint; cleanup removes them after a lease. The signature of a
signed save is written to ``<final>/manifest.sig`` right after the manifest, by the attempt that
won the create-only write (replacing any an earlier, uncommitted attempt left); an unsigned save
removes such a leftover. A reader that requires a signature refuses the checkpoint in between
(and after a crash in between, until ``shardkeep sign`` adds it): it fails closed.

Tiers with a location of their own (another directory, or a bucket) get the object-store
layout there too, on any kind of store: their files go under ``<final>/attempt-<id>/`` of the
tier's store, are made durable before the manifest is written, and are removed on abort. The
manifest, in the main store, is the only commit point.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping

from shardkeep.errors import CheckpointExistsError, StorageError, UnsafePathError
from shardkeep.manifest import MANIFEST_FILENAME, SIGNATURE_FILENAME, STAGING_MARKER
from shardkeep.storage.base import ByteStore, renames

__all__ = ["ATTEMPT_PREFIX", "CheckpointCommit"]

#: Data written by one save attempt on an object store (or a tier location) lives under
#: ``<checkpoint>/attempt-<id>/``.
ATTEMPT_PREFIX = "attempt-"


class CheckpointCommit:
    """One save attempt of checkpoint ``final`` (a name directly under the store's root).

    ``tier_stores`` maps the names of tiers with a location of their own to their stores;
    files of other tiers go to the main store.
    """

    def __init__(
        self,
        store: ByteStore,
        final: str,
        staging: str | None = None,
        tier_stores: Mapping[str, ByteStore] | None = None,
    ) -> None:
        """``staging`` is given on non-coordinator ranks: the name the coordinator chose."""
        self.store = store
        self.final = final
        self.object_store = not renames(store)
        self.tier_stores = dict(tier_stores or {})
        if staging is None:
            attempt = uuid.uuid4().hex
            staging = (
                f"{final}/{ATTEMPT_PREFIX}{attempt[:16]}" if self.object_store else f"{final}{STAGING_MARKER}{attempt}"
            )
        expected = f"{final}/{ATTEMPT_PREFIX}" if self.object_store else f"{final}{STAGING_MARKER}"
        rest = staging[len(expected) :]
        if not staging.startswith(expected) or not rest or not rest.isalnum():
            raise UnsafePathError(f"staging name {staging!r} does not belong to {final!r}")
        self.staging = staging
        self.attempt = f"{ATTEMPT_PREFIX}{rest[:16]}"
        self.data_dirs: set[str] = set()
        self.tier_dirs: dict[str, set[str]] = {}
        self.sealed: bytes | None = None  # the manifest bytes, once their write was attempted

    def begin(self) -> None:
        committed = f"{self.final}/{MANIFEST_FILENAME}" if self.object_store else self.final
        if self.store.stat(committed) is not None:
            raise CheckpointExistsError(
                f"checkpoint {self.final!r} already exists in {self.store!r}; committed checkpoints are never overwritten"
            )

    def place(self, relative: str, tier: str | None = None) -> tuple[str, ByteStore, str]:
        """Where a new data file goes: (its path in the manifest, its store, its path in that
        store during the save)."""
        tier_store = self.tier_stores.get(tier) if tier is not None else None
        if tier_store is not None:
            recorded = f"{self.attempt}/{relative}"
            directory = f"{self.final}/{recorded}".rpartition("/")[0]
            self.tier_dirs.setdefault(tier or "", set()).add(directory)
            return recorded, tier_store, f"{self.final}/{recorded}"
        if self.object_store:
            recorded = f"{self.attempt}/{relative}"
            return recorded, self.store, f"{self.final}/{recorded}"
        return relative, self.store, self.staged(relative)

    def staged(self, relative: str) -> str:
        """The store path of a file inside the staging directory."""
        directory, _, _ = relative.rpartition("/")
        if directory:
            self.data_dirs.add(directory)
        return f"{self.staging}/{relative}"

    def _sync_tier_directories(self) -> None:
        """Make every new directory of a tier location durable, deepest first, up to its root."""
        for name, directories in self.tier_dirs.items():
            tier_store = self.tier_stores[name]
            if not renames(tier_store):
                continue  # an object store: a completed upload is durable
            chain: set[str] = set()
            for directory in directories:
                parts = directory.split("/")
                chain.update("/".join(parts[:depth]) for depth in range(1, len(parts) + 1))
            for directory in sorted(chain, key=lambda d: -d.count("/")):
                tier_store.sync_dir(directory)
            tier_store.sync_dir("")

    def commit(self, manifest_bytes: bytes, signature: bytes | None = None) -> None:
        """On a filesystem: write the signature (if any) and the manifest into the staging
        directory, then publish it. On an object store: write the manifest (create-only), then
        the signature."""
        self._sync_tier_directories()
        if self.object_store:
            self.sealed = manifest_bytes
            self._write_new(f"{self.final}/{MANIFEST_FILENAME}", manifest_bytes)  # create-only
            # Committed, and ours: only now may <final>/manifest.sig be written or replaced.
            signature_path = f"{self.final}/{SIGNATURE_FILENAME}"
            if signature is not None:
                try:
                    self.store.put_atomic(signature_path, signature)
                except StorageError as exc:
                    raise StorageError(
                        f"{self.final!r} is committed, but writing its signature failed ({exc}); readers that require "
                        "a signature refuse it until `shardkeep sign` adds one"
                    ) from exc
            elif self.store.stat(signature_path) is not None:
                self.store.remove_tree(signature_path)  # a leftover of an uncommitted signed attempt
            return
        self.sealed = manifest_bytes
        for directory in sorted(self.data_dirs, key=lambda d: -d.count("/")):
            self.store.sync_dir(f"{self.staging}/{directory}")
        if signature is not None:
            # Inside the unpublished staging directory: no temp name needed; the manifest's
            # rename below fsyncs the directory, which makes this entry durable too.
            self._write_new(f"{self.staging}/{SIGNATURE_FILENAME}", signature)
        temporary = f"{self.staging}/{MANIFEST_FILENAME}.tmp"
        self._write_new(temporary, manifest_bytes)
        # ByteStore.rename fsyncs the directory it changed: here the staging directory, which
        # also makes its data subdirectories' entries durable.
        self.store.rename(temporary, f"{self.staging}/{MANIFEST_FILENAME}")
        self.store.rename(self.staging, self.final)

    def _write_new(self, path: str, data: bytes) -> None:
        handle = self.store.open_write(path)
        try:
            handle.write(data)
            handle.commit()
        except BaseException:
            handle.abort()
            raise

    def committed(self) -> bool | None:
        """After the manifest write was attempted: whether the manifest under the final name
        is this attempt's (``None``: it cannot be read, so the outcome is unknown)."""
        if self.sealed is None:
            return False
        path = f"{self.final}/{MANIFEST_FILENAME}"
        try:
            if self.store.stat(path) is None:
                return False
            handle = self.store.open_read(path)
            try:
                if handle.size != len(self.sealed):
                    return False
                found = bytearray(handle.size)
                handle.read_into(0, memoryview(found))
            finally:
                handle.close()
        except Exception:
            return None
        return bytes(found) == self.sealed

    def abort(self) -> None:
        """Remove what this attempt wrote, and only that; the first failure is raised after
        every location was tried. Once the manifest write was attempted, nothing is removed
        unless the final manifest is readable and is not this attempt's: a failure after the
        commit point (a lost response, a peer that died during the last collective) must never
        delete a committed checkpoint's data. Anything left is collected after the lease."""
        if self.sealed is not None and self.committed() is not False:
            return
        first: BaseException | None = None
        for tier_store in self.tier_stores.values():
            try:
                tier_store.remove_tree(f"{self.final}/{self.attempt}")
            except Exception as exc:
                first = first or exc
        try:
            self.store.remove_tree(self.staging)
        except Exception as exc:
            first = first or exc
        if first is not None:
            raise first
