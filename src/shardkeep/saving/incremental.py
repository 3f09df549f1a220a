"""Incremental saves: which of this save's files equal a file of the base checkpoint (and are
referenced instead of written), and the version-proof bookkeeping of ``trust_versions=True``
(:mod:`shardkeep.versions`): a file whose tensors' version counters did not move since its
digest was recorded is proved unchanged without reading it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, NamedTuple

from shardkeep.distributed.commit import ATTEMPT_PREFIX
from shardkeep.errors import UnsupportedValueError
from shardkeep.indexes import expand
from shardkeep.layout import PlannedItem, file_header
from shardkeep.manifest import FileRecord, IndexedManifest, Manifest, Tier
from shardkeep.storage import ByteStore
from shardkeep.verification import CheckpointLocation, locate, parse_manifest, read_manifest_bytes
from shardkeep.versions import KNOWN, TensorVersions, capture
from shardkeep.writes import FileDigests, ShardPlan, digest_of

__all__ = ["IncrementalLayout", "VersionProof", "base_location", "read_base"]


def base_location(
    path: str | os.PathLike[str], location: CheckpointLocation, storage_options: Mapping[str, Any] | None
) -> CheckpointLocation:
    """The incremental base: a checkpoint in the same root as the one being saved (files are
    referenced by checkpoint name, so both must live side by side)."""
    text = os.fspath(path)
    if "/" not in text and os.sep not in text and "://" not in text:
        return CheckpointLocation(location.store, text)  # a name in the same root
    base = locate(text, None, storage_options)
    if location.store.root != base.store.root:
        raise UnsupportedValueError(
            f"incremental={text!r} must be a checkpoint in the same root as {location} (its files are referenced by name)"
        )
    return CheckpointLocation(location.store, base.name)


def read_base(base: CheckpointLocation, rank: int) -> Manifest:
    """The base checkpoint's manifest, as the files of ``rank`` need it (a format 2.x base's
    files of this rank are in its own index)."""
    manifest = parse_manifest(read_manifest_bytes(base), where=str(base))
    if isinstance(manifest, IndexedManifest):
        own = [record.rank for record in manifest.index_records() if record.rank == rank]
        manifest = expand(base.store, base.name, manifest, own)
    return manifest


def _logical(path: str) -> str:
    """A data file's path without the attempt prefix object stores and tier locations add."""
    first, _, rest = path.partition("/")
    return rest if first.startswith(ATTEMPT_PREFIX) and rest else path


def previous_files(manifest: Manifest, tiers: list[Tier]) -> dict[tuple[str, str], FileRecord]:
    """The base checkpoint's files by (tier, path without attempt prefix), on tiers whose
    location is unchanged (a file can only be referenced where it already is)."""
    locations = {tier.name: tier.location for tier in tiers}
    theirs = {tier.name: tier.location for tier in manifest.tiers}
    found: dict[tuple[str, str], FileRecord] = {}
    for record in manifest.files:
        if record.tier in locations and theirs.get(record.tier) == locations[record.tier]:
            found[(record.tier, _logical(record.path))] = record
    return found


class VersionProof(NamedTuple):
    """What proves a file unchanged later: its key in the process's known digests (store root,
    tier, path), its header, and its tensors' versions, taken before any of its bytes were read."""

    key: tuple[str, str, str]
    header: bytes
    versions: TensorVersions


class IncrementalLayout:
    """One rank's comparison of its files with the base checkpoint's (``base`` and its
    manifest; none for a plain save) and, with ``trust_versions``, the proofs of the files
    it writes, recorded once their digests are known (:meth:`record_written`)."""

    def __init__(
        self,
        store: ByteStore,
        tier_stores: Mapping[str, ByteStore],
        *,
        digest: str,
        fast: bool = True,
        base: CheckpointLocation | None,
        trust_versions: bool,
    ) -> None:
        self.store = store
        self.tier_stores = tier_stores
        self.digest = digest
        #: Whether files get a ``fast_digest`` (and blocks where their record has a ``block_size``).
        self.fast = fast
        self.base = base
        #: Prove files unchanged by version counters (:mod:`shardkeep.versions`) where possible.
        self.trust_versions = trust_versions
        #: The base checkpoint's files by (tier, logical path) (see :func:`previous_files`).
        self.previous: dict[tuple[str, str], FileRecord] = {}
        #: Per file laid out (by ``id`` of its record): its version proof.
        self.proofs: dict[int, VersionProof] = {}

    def use_base(self, manifest: Manifest | None, tiers: list[Tier]) -> None:
        """Compare with ``manifest``'s files (the base's, as :func:`read_base` read it)."""
        self.previous = previous_files(manifest, tiers) if manifest is not None else {}

    def _base_file_present(self, earlier: FileRecord, tier: Tier) -> bool:
        """Whether the base's file is where its manifest says, with its size: a reference to a
        missing or truncated file would commit a checkpoint that cannot load (its digest is
        checked on every load and verify)."""
        assert self.base is not None
        store = self.tier_stores.get(tier.name, self.store)
        info = store.stat(f"{earlier.ref or self.base.name}/{earlier.path}")
        return info is not None and info.kind == "file" and info.size == earlier.stored_size

    def lay_out(self, record: FileRecord, group: list[PlannedItem], tier: Tier) -> bytes | None:
        """Lay out one file; return its header, or ``None`` when the file equals the base
        checkpoint's file of the same name (which ``record`` then references, with the fast and
        block digests this save would have written: copied from the base's record when it has
        them for the same block size, else computed from the tensors)."""
        earlier = self.previous.get((tier.name, record.path))
        key = (self.tier_stores.get(tier.name, self.store).root, tier.name, record.path)
        arrays = [item.array for item in group] if self.trust_versions else []
        versions = capture(arrays) if self.trust_versions else None  # before any byte is read
        if earlier is not None and earlier.digest and earlier.compression is None:
            algorithm = earlier.digest.partition(":")[0]
            record.version = earlier.version
            header = file_header(record, group, tier.tier_id)
            if algorithm == self.digest:
                known = KNOWN.digest(key, header, arrays) if versions is not None else None
                if known is not None and known.partition(":")[0] != algorithm:
                    known = None  # recorded under another digest algorithm
                computed: FileDigests | None = None
                if known:
                    digest = known
                else:
                    computed = digest_of(header, group, algorithm, block_size=record.block_size, fast=self.fast)
                    digest = computed.digest
                if versions is not None:
                    KNOWN.record(key, header, versions, digest)
                if digest == earlier.digest and self._base_file_present(earlier, tier):
                    assert self.base is not None
                    record.ref = earlier.ref or self.base.name
                    record.path = earlier.path
                    record.digest = earlier.digest
                    self._fill_digests(record, earlier, header, group, computed)
                    return None
            record.version = earlier.version + 1
        header = file_header(record, group, tier.tier_id)
        if self.trust_versions:
            self.proofs[id(record)] = VersionProof(key, header, versions)
        return header

    def _fill_digests(
        self,
        record: FileRecord,
        earlier: FileRecord,
        header: bytes,
        group: list[PlannedItem],
        computed: FileDigests | None,
    ) -> None:
        """Give ``record`` (referencing ``earlier``, the same bytes) the fast and block digests this
        save writes: ``computed`` (or the base's, when it recorded them for the same block size,
        or computed now)."""
        same_blocks = earlier.block_size == record.block_size and all(
            bool(old.blocks) == item.wants_blocks for old, item in zip(earlier.tensors, group, strict=True)
        )
        if computed is None and same_blocks and (earlier.fast_digest is not None or not self.fast):
            record.fast_digest = earlier.fast_digest
            for entry, old in zip(record.tensors, earlier.tensors, strict=True):
                entry.blocks = old.blocks
            return
        if computed is None:
            computed = digest_of(header, group, self.digest, block_size=record.block_size, fast=self.fast)
        record.fast_digest = computed.fast_digest
        for entry, blocks in zip(record.tensors, computed.blocks, strict=True):
            entry.blocks = blocks

    def record_written(self, plans: list[ShardPlan]) -> None:
        """After the files of ``plans`` were written: record each proved file's digest."""
        for plan in plans if self.trust_versions else ():
            proof = self.proofs.get(id(plan.record))
            if proof is not None and plan.record.digest:
                KNOWN.record(proof.key, proof.header, proof.versions, plan.record.digest)
