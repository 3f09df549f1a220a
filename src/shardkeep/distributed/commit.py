"""The commit protocol: how one save attempt becomes a checkpoint, whole or not at all.

:class:`CheckpointCommit` is the one interface the save job drives, and constructing it picks
one of two protocols from the store's capability (:attr:`~shardkeep.storage.base.ByteStore.atomic_rename`):

- :class:`FilesystemCommit` (a store that renames): a staging directory, the manifest last, one
  rename;
- :class:`ObjectStoreCommit` (a store that cannot rename): an ``attempt-<id>/`` prefix, the
  manifest last and create-only.

Each class's docstring lists its steps, every crash window and what recovery sees in each. In
both, a manifest is never visible under the final name without every file it lists being
durable.

Tiers with a location of their own (another directory, or a bucket) get the object-store
layout there, under either protocol and on any kind of store: their files go under
``<final>/attempt-<id>/`` of the tier's store, are made durable before the manifest is written,
and are removed on abort. The manifest, in the main store, is the only commit point.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping

from shardkeep.errors import CheckpointExistsError, StorageError, UnsafePathError
from shardkeep.names import (
    ATTEMPT_ID_CHARS,
    ATTEMPT_PREFIX,
    DELETING_MARKER,
    MANIFEST_FILENAME,
    SIGNATURE_FILENAME,
    STAGING_MARKER,
    is_staging_name,
    sibling_prefix,
)
from shardkeep.storage.base import ByteStore, write_new

__all__ = ["ATTEMPT_PREFIX", "CheckpointCommit", "FilesystemCommit", "ObjectStoreCommit"]


class CheckpointCommit:
    """One save attempt of checkpoint ``final`` (a name directly under the store's root).

    ``CheckpointCommit(store, final, ...)`` returns a :class:`FilesystemCommit` when
    ``store.atomic_rename``, else an :class:`ObjectStoreCommit` (as ``pathlib.Path`` returns a
    ``PosixPath``). ``staging`` is given on non-coordinator ranks: the name the coordinator
    chose (refused unless it belongs to ``final`` under this protocol). ``tier_stores`` maps
    the names of tiers with a location of their own to their stores; files of other tiers go
    to the main store.

    Who calls what, in order (nothing here needs to be thread-safe): the coordinator calls
    :meth:`begin`; every rank calls :meth:`place` for each data file it lays out, on its own
    object with the coordinator's ``staging``; the coordinator calls :meth:`add_data_file` for
    every rank's main-store files, then :meth:`commit` once, or :meth:`abort` on any failure
    (also after a failed ``commit``).
    """

    def __new__(
        cls,
        store: ByteStore,
        final: str,
        staging: str | None = None,
        tier_stores: Mapping[str, ByteStore] | None = None,
    ) -> CheckpointCommit:
        if cls is CheckpointCommit:
            cls = FilesystemCommit if store.atomic_rename else ObjectStoreCommit
        return super().__new__(cls)

    def __init__(
        self,
        store: ByteStore,
        final: str,
        staging: str | None = None,
        tier_stores: Mapping[str, ByteStore] | None = None,
    ) -> None:
        self.store = store
        self.final = final
        self.tier_stores = dict(tier_stores or {})
        if is_staging_name(final):
            raise UnsafePathError(
                f"{self._where()}: a name of the shape <name>{STAGING_MARKER}<id> or <name>{DELETING_MARKER}<id> "
                "(32 hex digits) is an unfinished save's or deletion's, which cleanup removes; save under another name"
            )
        expected = self._staging_prefix()
        if staging is None:
            staging = f"{expected}{uuid.uuid4().hex[: self._attempt_id_length]}"
        rest = staging[len(expected) :]
        if not staging.startswith(expected) or not rest or not rest.isalnum():
            raise UnsafePathError(f"staging name {staging!r} does not belong to {final!r}")
        #: Where this attempt's main-store files are during the save (removed by ``abort``).
        self.staging = staging
        #: The prefix of this attempt's files in tier locations (and, on an object store, in
        #: the main store): ``attempt-<first 16 characters of the attempt id>``.
        self.attempt = f"{ATTEMPT_PREFIX}{rest[:16]}"
        self.tier_dirs: dict[str, set[str]] = {}
        self.sealed: bytes | None = None  # the manifest bytes, once their write was attempted

    # -- what each protocol defines -----------------------------------------------------------
    #: How many hex characters of a fresh uuid name an attempt.
    _attempt_id_length = ATTEMPT_ID_CHARS

    def _staging_prefix(self) -> str:
        """What every staging name of this checkpoint starts with; the attempt id follows."""
        raise NotImplementedError

    def begin(self) -> None:
        """Refuse (:class:`~shardkeep.errors.CheckpointExistsError`) if ``final`` is already
        committed."""
        raise NotImplementedError

    def _place_in_main_store(self, relative: str) -> tuple[str, str]:
        """(path in the manifest, path in the main store during the save) of a new data file."""
        raise NotImplementedError

    def add_data_file(self, path: str) -> None:
        """Tell the coordinator's commit about a data file in the main store, written by any
        rank (``path`` as the manifest records it), so that :meth:`commit` makes it durable
        before the manifest."""
        raise NotImplementedError

    def commit(self, manifest_bytes: bytes, signature: bytes | None = None) -> None:
        """Write the manifest (and the signature of a signed save) and publish the checkpoint."""
        raise NotImplementedError

    # -- shared -------------------------------------------------------------------------------
    def _where(self) -> str:
        return f"{self.store.root.rstrip('/')}/{self.final}"

    def _refuse_if_committed(self, commit_point: str) -> None:
        if self.store.stat(commit_point) is not None:
            raise CheckpointExistsError(
                f"{self._where()} is a committed checkpoint; committed checkpoints are never overwritten: "
                "save under another name"
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
        recorded, store_path = self._place_in_main_store(relative)
        return recorded, self.store, store_path

    def _sync_tier_directories(self) -> None:
        """Make every new directory of a tier location durable, deepest first, up to its root."""
        for name, directories in self.tier_dirs.items():
            tier_store = self.tier_stores[name]
            if not tier_store.atomic_rename:
                continue  # an object store: a completed upload is durable
            chain: set[str] = set()
            for directory in directories:
                parts = directory.split("/")
                chain.update("/".join(parts[:depth]) for depth in range(1, len(parts) + 1))
            for directory in sorted(chain, key=lambda d: -d.count("/")):
                tier_store.sync_dir(directory)
            tier_store.sync_dir("")

    def _write_new(self, path: str, data: bytes) -> None:
        write_new(self.store, path, data)

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
        """Remove what this attempt wrote, and only that: its files in tier locations, then its
        staging directory or attempt prefix; the first failure is raised after every location
        was tried. Once the manifest write was attempted, nothing is removed unless the final
        manifest is readable and is not this attempt's: a failure after the commit point (a
        lost response, a peer that died during the last collective) must never delete a
        committed checkpoint's data. Anything left is collected after the lease."""
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


class FilesystemCommit(CheckpointCommit):
    """The commit on a store that renames: staging, manifest last, one rename. Its steps, in
    order:

    1. ``begin``: refuse if anything but an empty directory is at the final name (a committed
       checkpoint, files, a symlink), saying which; choose a fresh staging name
       ``<final>.tmp-<uuid>`` in the same parent (a long final name shortened with its digest,
       :mod:`shardkeep.names`), so a retry never overwrites anything and the final rename never
       crosses filesystems.
    2. Writers create every data file under the staging directory; each file is fsynced before
       its record is reported.
    3. ``commit(manifest_bytes, signature)``: fsync the data directories; write ``manifest.sig``
       if the save is signed; write ``manifest.json.tmp``, fsync it, rename it to
       ``manifest.json`` (the rename fsyncs the staging directory); then the commit point:
       rename the staging directory to its final name (refusing to replace anything but an
       empty directory, which the rename replaces in one atomic step) and fsync the parent
       (data before rename, rename before the directory's fsync; the manifest last).
    4. ``abort``: remove the staging directory, and only it (leftovers of other attempts are
       collected later, after their lease).

    Crash windows and what recovery sees:

    - before step 3's final rename: only ``<final>.tmp-<uuid>`` exists (and the attempt's files
      under ``<final>/attempt-<id>/`` in tier locations). It is never read as a checkpoint;
      stale staging directories are collected later by the coordinator, after a lease, the
      attempt's tier files first (the staging name is the only record of the attempt id).
    - after the rename, before the parent fsync: on power loss the rename may be lost (the
      checkpoint is then absent, or the empty directory it replaced is back; the staging
      directory remains) or kept (committed, complete, because every file and directory below
      it was fsynced before the rename).
    - after the parent fsync: committed and durable.
    """

    def __init__(
        self,
        store: ByteStore,
        final: str,
        staging: str | None = None,
        tier_stores: Mapping[str, ByteStore] | None = None,
    ) -> None:
        super().__init__(store, final, staging, tier_stores)
        #: Directories (relative to the staging directory) that hold data files.
        self.data_dirs: set[str] = set()

    def _staging_prefix(self) -> str:
        # A final name of up to 255 bytes is shortened (with its digest) so that the staging
        # name fits in one path component too; the marker is always there (see names).
        return sibling_prefix(self.final, STAGING_MARKER, reserve=ATTEMPT_ID_CHARS)

    def begin(self) -> None:
        """Refuse anything at the final name but an empty directory, saying what is there (an
        empty mount point too: no rename can replace it). An empty directory is replaced by the
        final rename (``rename(2)`` replaces an empty directory atomically, and fails if it is no
        longer empty), which gives the checkpoint that directory's mode, owner and group (not
        its ACLs)."""
        info = self.store.stat(self.final)
        if info is None:
            return
        where = self._where()
        if info.kind == "file":
            raise CheckpointExistsError(f"{where} is a file, not a checkpoint; a save never replaces it")
        if info.kind != "dir":
            raise CheckpointExistsError(
                f"{where} is a symbolic link or special file, not a checkpoint; a save never replaces it"
            )
        entries = [name for name, _ in self.store.list_dir(self.final)]
        if not entries and info.mount_point:
            raise CheckpointExistsError(
                f"{where} is an empty directory on which another filesystem is mounted (a mount point); a save "
                "cannot replace a mount point: save to a new name inside it, or unmount it"
            )
        if not entries:
            return
        if MANIFEST_FILENAME in entries:
            self._refuse_if_committed(self.final)
        shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
        raise CheckpointExistsError(
            f"{where} is a directory that is not a checkpoint (it holds {len(entries)} entr"
            f"{'y' if len(entries) == 1 else 'ies'}: {shown}); a save goes to a new name or an empty directory "
            "and never replaces other files"
        )

    def _place_in_main_store(self, relative: str) -> tuple[str, str]:
        self.add_data_file(relative)
        return relative, f"{self.staging}/{relative}"

    def add_data_file(self, path: str) -> None:
        directory, _, _ = path.rpartition("/")
        if directory:
            self.data_dirs.add(directory)

    def commit(self, manifest_bytes: bytes, signature: bytes | None = None) -> None:
        """Write the signature (if any) and the manifest into the staging directory, then
        publish it."""
        self._sync_tier_directories()
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


class ObjectStoreCommit(CheckpointCommit):
    """The commit on a store that cannot rename: the commit is the manifest object, written
    last and create-only. Its steps, in order:

    1. ``begin``: refuse if ``<final>/manifest.json`` exists; the attempt's objects go under
       ``<final>/attempt-<id>/``, a prefix no other attempt uses, so no object is ever
       overwritten.
    2. Writers upload every data object under that prefix; each upload is complete (durable)
       before its record is reported.
    3. ``commit(manifest_bytes, signature)``: the commit point: write ``<final>/manifest.json``,
       create-only (``If-None-Match: *``), so that of two coordinators committing the same name
       one fails; then, by the attempt that won, write ``<final>/manifest.sig`` for a signed
       save (replacing any an earlier, uncommitted attempt left), or remove such a leftover for
       an unsigned one.
    4. ``abort``: delete the attempt's prefix and abort its unfinished multipart uploads.

    Crash windows and what recovery sees:

    - before the manifest's write completes: only objects under ``<final>/attempt-<id>/`` (and
      unfinished multipart uploads) exist, with no manifest, so no reader takes them for a
      checkpoint; the coordinator's cleanup removes them after a lease. (The attempt's files in
      tier locations are not collected there: other roots may share a tier location.)
    - after the manifest, before the signature step: committed. A signed save's signature is
      not written yet, or a stale one from an earlier uncommitted attempt is still there: a
      reader that requires a signature refuses the checkpoint (it fails closed), after a crash
      until ``shardkeep sign`` adds one.
    - after the signature step: committed and complete; a completed PUT is durable.
    """

    _attempt_id_length = 16

    def _staging_prefix(self) -> str:
        return f"{self.final}/{ATTEMPT_PREFIX}"

    def begin(self) -> None:
        self._refuse_if_committed(f"{self.final}/{MANIFEST_FILENAME}")

    def _place_in_main_store(self, relative: str) -> tuple[str, str]:
        recorded = f"{self.attempt}/{relative}"
        return recorded, f"{self.final}/{recorded}"

    def add_data_file(self, path: str) -> None:
        """Nothing to do: a completed upload is durable, and there are no directories."""

    def commit(self, manifest_bytes: bytes, signature: bytes | None = None) -> None:
        """Write the manifest (create-only), then the signature."""
        self._sync_tier_directories()
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
