"""The save job: prepare (plan, agree, open staging) -> write (each rank's files, digests while
writing) -> finish (gather reports, build the manifest, commit) -> abort. The manifest itself is
built and committed by :mod:`shardkeep.saving.manifest_build`, the comparison with an
incremental base by :mod:`shardkeep.saving.incremental`, and what ranks send the coordinator is
:mod:`shardkeep.saving.wire`.

Internal API for simulations (``bench/scale.py``): :func:`run_job` runs a given job's phases
as :func:`run_save` does, and a subclass of :class:`SaveJob` may replace the three steps that
touch tensors or bytes, :meth:`SaveJob.describe`, :meth:`SaveJob.place` and
:meth:`SaveJob.write_files`.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from shardkeep.distributed.commit import CheckpointCommit
from shardkeep.distributed.coordinator import Coordinator
from shardkeep.distributed.plan import (
    SMALL_WHOLE,
    ItemDescriptor,
    agreement_digest,
    assign_by_class,
    assign_identical,
    check_sharded_agreement,
    chunk_writer,
    global_totals,
    sharded_facts,
    sharded_totals,
)
from shardkeep.errors import StorageError, UnsupportedValueError
from shardkeep.indexes import encode_index
from shardkeep.integrity import digest_bytes, load_private_key
from shardkeep.layout import WHOLE_TENSOR_BLOCK_SIZE, PlannedItem, assign_blocks, chunk_block_size, plan_files
from shardkeep.manifest import (
    FileRecord,
    IndexedManifest,
    IndexRecord,
    Manifest,
    SaveTiming,
    Tier,
    index_path,
    validate_manifest,
)
from shardkeep.progress import collector_paused, progress_bar
from shardkeep.saving.incremental import IncrementalLayout, base_location, read_base
from shardkeep.saving.manifest_build import (
    DEFAULT_TIER,
    RecordedFields,
    Sections,
    commit_manifest,
    describe_sharded,
    detect_entry_families_ahead,
    indexed_manifest,
    indexed_version,
    merged_structure,
    metadata_version,
    metric_values,
    new_manifest,
    plain_json_mapping,
    precision_of,
    require_cryptographic_digest,
    state_sections,
    step_of,
    with_entry_families,
)
from shardkeep.saving.settings import SaveSettings
from shardkeep.saving.wire import (
    Descriptions,
    RankReport,
    decode_committed,
    decode_report,
    encode_committed,
    encode_report,
)
from shardkeep.storage import LocalStore, open_store, write_new
from shardkeep.storage.localfs import makedirs_durable
from shardkeep.tensors.flatten import FlatState, flatten_state
from shardkeep.tensors.keys import section_of
from shardkeep.tiers import check_tiers
from shardkeep.tiers import place as place_on_tiers
from shardkeep.verification import CheckpointLocation, locate
from shardkeep.writes import ByteBudget, ShardPlan, WriteControl, write_shards

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

__all__ = ["SaveJob", "ensure_directory", "run_job", "run_save"]


def ensure_directory(path: str) -> None:
    """Create the local directory ``path`` and missing parents durably
    (:func:`~shardkeep.storage.localfs.makedirs_durable`); a failure is a
    :class:`~shardkeep.errors.StorageError` whose cause is the ``OSError``. Something other
    than a directory at ``path`` is left for the commit to refuse."""
    try:
        makedirs_durable(path)
    except FileExistsError:
        return
    except OSError as exc:
        raise StorageError(f"cannot create directory {exc.filename or path!r}: {exc.strerror}") from exc


#: Why a filesystem refuses to write, by errno, in the words a save error uses.
_REFUSED_WRITES = {
    errno.EROFS: "the filesystem is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "the operation is not permitted",
}


class LaidOut(NamedTuple):
    """One file this rank lays out: its record, its tensors, its tier, and its header, or
    ``None`` when it equals the base checkpoint's file (which the record references)."""

    record: FileRecord
    group: list[PlannedItem]
    tier: Tier
    header: bytes | None


def _checked_tiers(settings: SaveSettings) -> list[Tier]:
    tiers = settings.tiers
    if tiers is not None and (isinstance(tiers, (str, bytes)) or not isinstance(tiers, Sequence)):
        raise UnsupportedValueError("tiers= must be a list of shardkeep.Tier")
    if settings.placement is not None and not tiers:
        raise UnsupportedValueError("placement= needs tiers=: define the tiers the rules name")
    return check_tiers(tiers) if tiers else [Tier(tier_id=1, name=DEFAULT_TIER)]


def _checked_base(settings: SaveSettings, location: CheckpointLocation) -> CheckpointLocation | None:
    """The incremental base named by ``incremental=`` (``None`` for ``True`` and ``False``)."""
    incremental = settings.incremental
    if not isinstance(incremental, (bool, str, os.PathLike)):
        raise UnsupportedValueError(
            f"incremental={incremental!r} must be True, False, or the path of an earlier checkpoint"
        )
    base = None
    if incremental is not False and incremental is not True:
        if settings.io.compression:
            raise UnsupportedValueError("incremental saves cannot be compressed yet; pass compression=None")
        base = base_location(incremental, location, settings.storage_options)
    if not isinstance(settings.trust_versions, bool):
        raise UnsupportedValueError(f"trust_versions={settings.trust_versions!r} must be True or False")
    if settings.trust_versions and incremental is False:
        raise UnsupportedValueError("trust_versions=True needs incremental= (it proves files unchanged)")
    return base


class SaveJob:
    """One save, split into its phases so that ``save`` and ``async_save`` share them.

    ``prepare`` (every rank, collectives) describes the state, assigns writers and opens the
    staging directory; ``write`` (every rank, no collectives) writes this rank's files; ``finish``
    (coordinator only) merges every rank's records, checks coverage, writes the manifest and
    commits; ``abort`` (coordinator only) removes the staging directory.
    """

    def __init__(
        self,
        state: Mapping[str, Any],
        location: CheckpointLocation,
        settings: SaveSettings,
        coordinator: Coordinator,
        *,
        sections: Sections | None = None,
    ) -> None:
        options = settings.io
        require_cryptographic_digest(settings.signer, options.digest)
        self.settings = settings
        self.private_key: Ed25519PrivateKey | None = None
        self.started = time.perf_counter() if settings.started is None else settings.started
        #: Set by ``async_save`` once the caller resumes; a synchronous save blocks throughout.
        self.blocked_seconds: float | None = None
        #: Follows this rank's writes; cancelled to abandon the save (the next buffer this rank
        #: would write fails the save instead).
        self.control = WriteControl()
        self.state = state
        self.location = location
        self.options = options
        self.coordinator = coordinator
        self.budget = settings.budget or ByteBudget(options.byte_budget)
        if self.budget.limit != options.byte_budget:
            raise UnsupportedValueError("budget= must have the same limit as byte_budget=")
        self.metrics = metric_values(settings.metrics)
        #: An async save's sections, from the caller's original state (its snapshot holds plain
        #: dicts where modules and optimizers were).
        self.sections = sections
        self.tiers = _checked_tiers(settings)
        self.tier_stores = {
            tier.name: open_store(tier.location, settings.storage_options)
            for tier in self.tiers
            if tier.location is not None
        }
        self.incremental = IncrementalLayout(
            location.store,
            self.tier_stores,
            digest=options.digest,
            fast=options.block_size != 0,
            base=_checked_base(settings, location),
            trust_versions=settings.trust_versions,
        )
        self.tier_of: dict[str, str] = {}
        #: Per key, its size in the whole checkpoint and dtype; whether any tensor is sharded.
        self.totals: dict[str, tuple[int, str]] = {}
        self.chunked = False
        #: Every rank holds the same tree (the usual case): the coordinator's tree is the
        #: checkpoint's. Otherwise each rank sends its containers with its records.
        self.alike = True
        #: When the ranks' trees differ: the lowest rank holding the same tree as this one.
        self.class_source = 0
        #: The keys of this rank's chunks on a regular grid (described once in format 2.x).
        self.on_grid: set[str] = set()
        #: The regularly sharded tensors this rank holds (on the coordinator, and on every rank
        #: when the ranks' trees differ).
        self.descriptions = Descriptions([], [])
        self.flat = FlatState()
        self.planned: list[PlannedItem] = []
        self.plans: list[ShardPlan] = []
        self.commit: CheckpointCommit | None = None
        self.manifest: Manifest | None = None

    # -- the steps a simulation replaces ---------------------------------------------------------
    def describe(self, descriptors: bool = True) -> list[ItemDescriptor]:
        """Flatten the state and plan its leaves; their descriptors (what ranks compare) unless
        ``descriptors=False`` (one process compares with nobody)."""
        with collector_paused():
            self.flat = flatten_state(self.state, keep_vars=self.settings.trust_versions)
            self.planned = [PlannedItem(leaf) for leaf in self.flat.tensors]
            self.on_grid = {item.leaf.key for item in self.planned if item.layout is not None}
            return [item.descriptor for item in self.planned] if descriptors else []

    def place(self, totals: dict[str, tuple[int, str]]) -> None:
        """Every tensor's tier (:attr:`tier_of`), decided from the global sizes (the same on
        every rank)."""
        if self.settings.placement is None and len(self.tiers) == 1 and self.tiers[0].size_budget is None:
            self.tier_of = dict.fromkeys(totals, self.tiers[0].name)  # nothing to decide
            return
        optim, router, _ = self._sections_of()
        self.tier_of = place_on_tiers(
            [(key, nbytes, dtype) for key, (nbytes, dtype) in sorted(totals.items())],
            self.tiers,
            self.settings.placement,
            optim.prefixes if optim is not None else (),
            router.prefixes if router is not None else (),
        )

    def write_files(self, on_bytes: Callable[[int], None] | None) -> None:
        """Write the files of :attr:`plans`, recording each file's digest in its record."""
        write_shards(
            self.location.store,
            self.plans,
            algorithm=self.options.digest,
            budget=self.budget,
            io_threads=self.options.io_threads,
            on_bytes=on_bytes,
            compression_level=self.options.compression_level if self.options.compression else None,
            control=self.control,
            fast=self.options.block_size != 0,
        )

    # -- prepare -------------------------------------------------------------------------------
    def describe_for_agreement(self, described: list[ItemDescriptor]) -> str:
        """Describe this rank's part (into ``described``) and return its agreement digest: the
        work of the save's first collective step."""
        described.extend(self.describe(descriptors=self.coordinator.distributed))
        # One process agrees with itself: no digest to compare.
        return agreement_digest(described, self.flat.containers) if self.coordinator.distributed else ""

    def prepare(self, digests: list[str] | None = None, described: list[ItemDescriptor] | None = None) -> None:
        """Plan the save in two collective steps: every rank's agreement digest (unless the
        caller ran :meth:`describe_for_agreement` in a step of its own and passes ``digests``
        and ``described``: ``async_save`` runs it with the staging copy), then one step in
        which every rank places its tensors on tiers and lays out its files while the
        coordinator opens the staging directory. Each collective costs milliseconds on a real
        group, and an async save's caller waits for all of them."""
        coordinator = self.coordinator
        if digests is None or described is None:
            described = []
            digests = coordinator.step("prepare the save", lambda: self.describe_for_agreement(described))
        self.alike = len(set(digests)) == 1
        local = described
        self.chunked = any(item.global_offset is not None for item in self.planned)
        if not coordinator.distributed:
            if self.chunked and not local:
                local = [item.descriptor for item in self.planned]
            planned_here, totals = self.planned, global_totals(local) if self.chunked else self._whole_totals()
        else:
            planned_here, totals = self._writers(local, digests)
        self.totals = totals
        base = self.incremental.base
        if base is not None:
            rank = coordinator.rank
            manifest = coordinator.step("read the incremental base", lambda: read_base(base, rank))[rank]
            self.incremental.use_base(manifest, self.tiers)
        laid_out: list[LaidOut] = []

        def plan() -> str | None:
            self.place(totals)
            laid_out.extend(self._lay_out(planned_here))
            # This rank's part of the manifest, inside the step: whatever fails here (a value
            # of custom_fields that is not JSON, say) fails every rank together. The records
            # get their paths once the staging directory is open (_place_files).
            self._build_manifest([file.record for file in laid_out])
            # Last, so that a failure above opens nothing. The coordinator keeps what it opened
            # at once: if another rank fails in this step, abort() removes it.
            staging = self._begin()
            if staging is not None:
                self.commit = self._commit_for(staging)
            return staging

        staging = coordinator.step("plan the save", plan)[0]
        if self.commit is None:
            self.commit = self._commit_for(staging)
        self._place_files(laid_out)

    def _whole_totals(self) -> dict[str, tuple[int, str]]:
        """:func:`global_totals` of a state without chunks, straight from the planned items."""
        return {item.leaf.key: (item.nbytes, item.dtype) for item in self.planned}

    def _begin(self) -> str | None:
        if not self.coordinator.is_coordinator:
            return None
        if self.settings.signer is not None:
            self.private_key = load_private_key(self.settings.signer)  # only the coordinator signs
        store = self.location.store
        with self._writes_refused_named():
            for local in (store, *self.tier_stores.values()):
                if isinstance(local, LocalStore):
                    ensure_directory(local.root)
        opening = CheckpointCommit(store, self.location.name, tier_stores=self.tier_stores)
        opening.begin()
        return opening.staging

    def _commit_for(self, staging: str | None) -> CheckpointCommit:
        return CheckpointCommit(self.location.store, self.location.name, staging, tier_stores=self.tier_stores)

    def _sections_of(self) -> Sections:
        """Optimizer and router sections and training fields, as the manifest records them."""
        optim, router, training = state_sections(self.state, [leaf.key for leaf in self.flat.tensors])
        if self.sections is not None:
            optim, _, training = self.sections
        return Sections(optim, router, training)

    def _writers(
        self, local: list[ItemDescriptor], digests: list[str]
    ) -> tuple[list[PlannedItem], dict[str, tuple[int, str]]]:
        """What this rank writes, and every tensor's global size. Chunks: the replica
        :func:`chunk_writer` names. Whole tensors: placed by each rank alone when every rank
        holds the same (equal ``digests``); otherwise each distinct tree's lists are sent once,
        by the lowest rank holding it (a broadcast per class of equal digests: what crosses
        grows with the number of distinct trees, not of ranks), and every rank places them
        the same way (:func:`assign_by_class`)."""
        coordinator = self.coordinator
        if self.alike:  # every rank holds the same whole tensors and sharded tensors
            small = SMALL_WHOLE if self.chunked else 0
            mine = assign_identical(local, coordinator.world_size, small=small)[coordinator.rank]
            totals = global_totals(local)
        else:
            members: dict[str, list[int]] = {}
            for rank, digest in enumerate(digests):
                members.setdefault(digest, []).append(rank)
            self.class_source = members[digests[coordinator.rank]][0]
            own = ([item for item in local if item.global_offset is None], sharded_facts(local))
            lists = [
                coordinator.broadcast(
                    own if coordinator.rank == ranks[0] else None, label="compare what the ranks hold", source=ranks[0]
                )
                for ranks in members.values()
            ]
            sources = [ranks[0] for ranks in members.values()]
            check_sharded_agreement([facts for _, facts in lists], ranks=sources)
            self.chunked = any(facts for _, facts in lists)
            small = SMALL_WHOLE if self.chunked else 0
            mine = assign_by_class(
                [items for items, _ in lists], list(members.values()), coordinator.world_size, small=small
            )[coordinator.rank]
            totals = {}
            for items, facts in lists:
                totals.update(global_totals(items))
                totals.update(sharded_totals(facts))
        planned_here = []
        for item in self.planned:
            if item.global_offset is None:
                if (item.leaf.key, None) in mine:
                    planned_here.append(item)
            elif item.nbytes == 0:
                # An empty chunk covers nothing, and several ranks may hold one at the same offset
                # (uneven sharding): skip it, unless the whole tensor is empty, whose key must
                # still be recorded once: by the rank at the mesh's origin.
                if item.mesh_origin and not math.prod(item.global_shape or ()):
                    planned_here.append(item)
            elif chunk_writer(item.leaf.key, tuple(item.global_offset), item.replica[1]) == item.replica[0]:
                planned_here.append(item)
        return planned_here, totals

    def _lay_out(self, planned_here: list[PlannedItem]) -> list[LaidOut]:
        """Group this rank's tensors into files and build each file's header (see
        :class:`LaidOut`). Where the files go is decided once the staging directory is open
        (:meth:`_place_files`)."""
        optim, router, _ = self._sections_of()
        optim_prefixes = optim.prefixes if optim is not None else []
        router_prefixes = router.prefixes if router is not None else []
        sections: dict[str, str] = {}
        for item in planned_here if optim_prefixes or router_prefixes else ():  # else all "model"
            section = section_of(item.leaf.key, optim_prefixes, router_prefixes)
            if section != "model":
                sections[item.leaf.key] = section
        laid_out: list[LaidOut] = []
        chunk_block, whole_block = self._block_sizes(planned_here)
        with collector_paused():
            by_tier: dict[str, list[PlannedItem]] = {}
            for item in planned_here:
                by_tier.setdefault(self.tier_of[item.leaf.key], []).append(item)
            for tier in self.tiers:
                groups = plan_files(
                    by_tier.get(tier.name, []),
                    rank=self.coordinator.rank,
                    target=self.options.file_size_target,
                    tier=tier.name,
                    tier_id=tier.tier_id,
                    suffix=".safetensors.zst" if self.options.compression else ".safetensors",
                    directory="shards" if not self.settings.tiers else f"shards/{tier.name}",
                    sections=sections,
                    per_expert=self.settings.incremental is not False,
                )
                for record, group in groups:
                    chunks = any(item.wants_digest for item in group)
                    assign_blocks(record, group, chunk_block if chunks else whole_block)
                    laid_out.append(LaidOut(record, group, tier, self.incremental.lay_out(record, group, tier)))
        return laid_out

    def _block_sizes(self, planned_here: list[PlannedItem]) -> tuple[int, int]:
        """The block sizes of this rank's chunk files and of its files of whole tensors: those of
        ``WriteOptions.block_size`` when it is given (0: no blocks, and none for compressed
        files), else :func:`~shardkeep.layout.chunk_block_size` of this rank's chunks and
        :data:`~shardkeep.layout.WHOLE_TENSOR_BLOCK_SIZE`."""
        forced = self.options.block_size
        if forced == 0 or self.options.compression:
            return 0, 0
        if forced is not None:
            return forced, forced
        return chunk_block_size([item.nbytes for item in planned_here if item.wants_digest]), WHOLE_TENSOR_BLOCK_SIZE

    def _place_files(self, laid_out: list[LaidOut]) -> None:
        """Put each laid-out file in the open staging directory (or its tier's location): only
        paths change, in the records the manifest already holds. No error can arise here
        that the plan step did not already meet on every rank."""
        assert self.commit is not None
        for record, group, tier, header in laid_out:
            if header is None:
                continue  # unchanged: the record references the earlier file
            record.path, store, store_path = self.commit.place(record.path, tier.name)
            self.plans.append(ShardPlan(path=store_path, header=header, sources=group, record=record, store=store))

    def _build_manifest(self, records: list[FileRecord]) -> None:
        """This rank's part of the manifest (sharing ``records``, whose paths are set later)."""
        coordinator = self.coordinator
        settings = self.settings
        with collector_paused():
            if self.on_grid and (coordinator.is_coordinator or not self.alike):
                self.descriptions = describe_sharded(self.planned, self.tier_of, self.tiers)
            fields = RecordedFields(
                model_id=settings.model_id,
                step=settings.step if settings.step is not None else step_of(self.state, self.location.name),
                epoch=settings.epoch,
                training=settings.training,
                sharding_strategy=settings.sharding_strategy,
                custom_fields=plain_json_mapping("custom_fields", settings.custom_fields),
                metrics=self.metrics,
                run=settings.run,
            )
            self.manifest = new_manifest(
                records,
                fields,
                self._sections_of(),
                digest=self.options.digest,
                world_size=coordinator.world_size,
                chunked=self.chunked,
                precision=precision_of(self.totals),
                tiers=self.tiers,
                structure=self.flat.containers,
                values=self.flat.values,
                version=metadata_version(self.options.block_size),
            )

    # -- write ---------------------------------------------------------------------------------
    def write(self) -> list[FileRecord]:
        """Write this rank's files; return every record of this rank (written or referenced)."""
        assert self.manifest is not None
        # Never write what load would refuse: this rank's part of the manifest is checked first.
        if self.coordinator.is_coordinator or self.plans:
            errors = validate_manifest(self.manifest).errors
            if errors:
                raise UnsupportedValueError(f"cannot save {self.location}: " + "; ".join(errors[:5]))
        update, close = progress_bar(
            sum(plan.record.size for plan in self.plans), f"save {self.location.name}", self.settings.progress
        )
        try:
            self.write_files(update)
        finally:
            close()
        self.incremental.record_written(self.plans)
        return list(self.manifest.files)

    def report(self) -> RankReport:
        """Write this rank's files (and, in format 2.x, its index); return what the coordinator
        needs: the records of the files the manifest lists, this rank's index record and the
        counts the coordinator checks, and the containers (and sharded tensors) of a rank whose
        tree differs from the coordinator's."""
        with self._writes_refused_named():
            return self._report()

    def _report(self) -> RankReport:
        records = self.write()
        listed: list[FileRecord] = []
        indexed: list[FileRecord] = []
        for record in records:
            on_grid = bool(record.tensors) and all(
                entry.global_offset is not None and entry.key in self.on_grid for entry in record.tensors
            )
            (indexed if on_grid else listed).append(record)
        if self.coordinator.is_coordinator and self.coordinator.distributed and self.chunked:
            # Its own whole tensors are the root's (SMALL_WHOLE): their entry families are
            # detected here, while the other ranks still write, not in the commit.
            detect_entry_families_ahead(listed, indexed_version(self.options.block_size))
        report = RankReport(files=listed)
        if indexed:
            report.index = self._write_index(indexed)
            report.index.data_bytes = sum(record.stored_size for record in indexed)
            report.refs = sorted({record.ref for record in indexed if record.ref is not None})
            report.indexed_files = len(indexed)
            report.indexed_bytes = sum(entry.nbytes for record in indexed for entry in record.tensors)
            report.directories = sorted(
                {
                    record.path.rpartition("/")[0]
                    for record in indexed
                    if record.ref is None and record.tier not in self.tier_stores
                }
            )
        if not self.alike and self.coordinator.rank == self.class_source:
            # One rank per distinct tree sends it (and its sharded tensors' descriptions).
            report.containers = self.flat.containers
            report.meshes, report.sharded = self.descriptions
        return report

    def _write_index(self, files: list[FileRecord]) -> IndexRecord:
        """Write this rank's index (durably, like a data file) and return its record."""
        assert self.commit is not None
        rank = self.coordinator.rank
        data = encode_index(rank, files, indexed_version(self.options.block_size))
        recorded, store, where = self.commit.place(index_path(rank))
        write_new(store, where, data)
        return IndexRecord(rank=rank, path=recorded, size=len(data), digest=digest_bytes(self.options.digest, data))

    def write_payload(self) -> bytes:
        """:meth:`report`, as msgpack bytes (:func:`~shardkeep.saving.wire.encode_report`)."""
        return encode_report(self.report())

    def read_payloads(self, payloads: list[bytes]) -> list[RankReport]:
        """On the coordinator: every rank's report from :meth:`write_payload`; the containers of
        ranks whose trees differ join the manifest's structure."""
        reports = [decode_report(payload) for payload in payloads]
        trees = [report.containers for report in reports if report.containers is not None]
        if trees and self.manifest is not None:
            self.manifest.structure = merged_structure(self.manifest.structure, trees)
        return reports

    # -- finish and abort ------------------------------------------------------------------------
    def finish(self, reports: list[RankReport] | None) -> Manifest | None:
        """On the coordinator: merge every rank's report, check coverage, seal, sign and
        commit; ``None`` on the other ranks."""
        if not self.coordinator.is_coordinator:
            return None
        with collector_paused():  # a few objects per rank and file, no cycles (see LoadJob.run)
            return self._finish(reports)

    def _finish(self, reports: list[RankReport] | None) -> Manifest:
        assert self.manifest is not None and self.commit is not None and reports is not None
        listed = [record for report in reports for record in report.files]
        if self.coordinator.distributed:
            listed.sort(key=lambda record: record.path)
        manifest: Manifest = self.manifest
        if any(report.index is not None for report in reports):
            manifest = indexed_manifest(
                self.manifest, self.descriptions if self.alike else None, reports, self.location
            )
        manifest.files = listed
        manifest.sharding.shard_count = len(listed) + sum(report.indexed_files for report in reports)
        # Every rank's data directories are fsynced, not only ours.
        data_files = [
            record.path for record in manifest.files if record.ref is None and record.tier not in self.tier_stores
        ]
        data_files += [f"{directory}/-" for directory in sorted({d for report in reports for d in report.directories})]
        if isinstance(manifest, IndexedManifest):
            data_files.append(index_path(0))  # the index directory (prefix: see IndexTable)
        total = time.perf_counter() - self.started
        blocked = total if self.blocked_seconds is None else min(self.blocked_seconds, total)
        manifest.timing = SaveTiming(blocked_seconds=round(blocked, 6), total_seconds=round(total, 6))
        with self._writes_refused_named():
            commit_manifest(
                self.commit,
                manifest,
                location=self.location,
                private_key=self.private_key,
                data_files=data_files,
                # A single process's own part was checked before writing (write).
                validate=self.coordinator.distributed or manifest is not self.manifest,
            )
        return manifest

    def abort(self) -> None:
        if self.coordinator.is_coordinator and self.commit is not None:
            self.commit.abort()

    @contextlib.contextmanager
    def _writes_refused_named(self) -> Iterator[None]:
        """A write the filesystem refuses (read-only, permissions) as a :class:`StorageError`
        naming the checkpoint the caller asked for; the store's error, which names the internal
        staging file, stays its cause."""
        try:
            yield
        except StorageError as exc:
            cause = exc.__cause__
            if not isinstance(cause, OSError) or cause.errno not in _REFUSED_WRITES:
                raise
            reason = _REFUSED_WRITES[cause.errno]
            where = str(self.location)
            if self.tier_stores:
                where += f" (or its tier locations {', '.join(sorted(s.root for s in self.tier_stores.values()))})"
            raise StorageError(f"cannot save {where}: {reason} ({cause.strerror}, errno {cause.errno})") from exc


def run_job(job: SaveJob) -> Manifest:
    """Run ``job``: prepare, write (every rank), commit (the coordinator), and abort on any
    failure; every rank returns the committed manifest."""
    coordinator = job.coordinator
    try:
        # Planning builds a few objects per tensor and no cycles: the collector's scans of them
        # would cost more than the planning (as when reading a manifest).
        with collector_paused():
            job.prepare()
        if coordinator.distributed:
            # Only the coordinator needs the file records: each rank sends its own, once.
            payloads = coordinator.step_to_coordinator("write the shards", job.write_payload)
            records = None if payloads is None else job.read_payloads(payloads)
        else:
            records = [job.report()]
        committed = _commit(job, records)
    except BaseException:
        job.abort()
        raise
    return committed


def _commit(job: SaveJob, records: list[RankReport] | None) -> Manifest:
    """The coordinator commits; the others receive the committed manifest once, in its compact
    form (:func:`~shardkeep.saving.wire.encode_committed`), by a broadcast: an all-gather would
    pad every rank's empty result to the manifest's size."""
    coordinator = job.coordinator
    if not coordinator.distributed:
        manifest = job.finish(records)
        assert manifest is not None
        return manifest
    kept: list[Manifest] = []

    def commit() -> bytes:
        manifest = job.finish(records)
        assert manifest is not None
        kept.append(manifest)
        # The files' whole tensors as the root records them (entry families, detected already
        # for the root: the memo of manifest_build), expanded again by decode_committed.
        return encode_committed(with_entry_families(manifest))

    sent = coordinator.on_coordinator("commit the checkpoint", commit)
    return kept[0] if kept else decode_committed(sent)


def run_save(state: Mapping[str, Any], path: str | os.PathLike[str], settings: SaveSettings) -> Manifest:
    """The body of :func:`~shardkeep.save` (and of the checkpoint manager's save): a
    :class:`SaveJob` run by :func:`run_job`."""
    job = SaveJob(
        state,
        locate(path, settings.storage, settings.storage_options),
        settings,
        Coordinator(settings.process_group, timeout=settings.timeout),
    )
    return run_job(job)
