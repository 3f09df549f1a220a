"""The save job: prepare (plan, agree, open staging) -> write (each rank's files, digests while
writing) -> finish (gather records, build and seal the manifest, commit) -> abort, and the
manifest building that goes with it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import msgspec
import torch

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from shardkeep.options import Group, Regrouped, Signer

from shardkeep.config import ManifestLimits, WriteOptions
from shardkeep.distributed.commit import ATTEMPT_PREFIX, CheckpointCommit
from shardkeep.distributed.coordinator import DEFAULT_TIMEOUT, Coordinator
from shardkeep.distributed.plan import (
    SMALL_WHOLE,
    ItemDescriptor,
    agreement_digest,
    assign_by_class,
    assign_identical,
    check_sharded_agreement,
    chunk_writer,
    coverage_problems,
    global_totals,
    sharded_facts,
    sharded_totals,
)
from shardkeep.errors import (
    StorageError,
    UnsupportedValueError,
)
from shardkeep.indexes import encode_index, expand
from shardkeep.integrity import CRYPTOGRAPHIC_DIGESTS, digest_bytes, load_private_key, seal_manifest, sign_manifest
from shardkeep.io import ByteBudget, ShardPlan, WriteControl, digest_of, write_shards
from shardkeep.layout import PlannedItem, expert_key_of, file_header, plan_files
from shardkeep.manifest import (
    DTYPE_ITEMSIZE,
    INDEXED_VERSION,
    ContainerEntry,
    FileRecord,
    IndexedManifest,
    IndexRecord,
    IndexTable,
    Manifest,
    Mesh,
    RunInfo,
    SaveTiming,
    ShardedTensor,
    Sharding,
    StateSection,
    Tier,
    Training,
    encode_manifest,
    has_chunks,
    index_path,
    validate_manifest,
)
from shardkeep.names import MAX_STEP, step_of_name
from shardkeep.progress import collector_paused, progress_bar
from shardkeep.storage import LocalStore, StoreOperations, open_store, write_new
from shardkeep.tensors.flatten import FlatState, flatten_state, is_plain_json
from shardkeep.tensors.keys import ROUTER_KEY, section_of
from shardkeep.tiers import Placement, check_tiers, place
from shardkeep.verification import (
    CheckpointLocation,
    locate,
    parse_manifest,
    read_manifest_bytes,
)
from shardkeep.versions import KNOWN, TensorVersions, capture

__all__ = [
    "DEFAULT_TIER",
    "SaveJob",
    "SaveSettings",
    "metric_values",
    "run_save",
    "state_sections",
    "warn_if_over_read_limits",
]

logger = logging.getLogger("shardkeep")

DEFAULT_TIER = "hot"


_PRECISION = {"F32": "fp32", "BF16": "bf16", "F16": "fp16", "F64": "fp64", "F8_E4M3": "fp8", "F8_E5M2": "fp8"}


def state_sections(
    state: Mapping[str, Any], keys: list[str]
) -> tuple[StateSection | None, StateSection | None, Training]:
    optim_prefixes = sorted(
        str(name)
        for name, value in state.items()
        if isinstance(value, torch.optim.Optimizer) or name in ("optim", "optimizer")
    )
    router_prefixes = sorted(
        {key[: match.end()] for key in keys if "router" in key and (match := ROUTER_KEY.search(key))}
    )
    training = Training()
    for name in optim_prefixes:
        optimizer = state.get(name)
        if isinstance(optimizer, torch.optim.Optimizer):
            training.optimizer_type = type(optimizer).__name__
            lr = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
            training.learning_rate = float(lr) if isinstance(lr, (int, float)) else None
            break
    optim = StateSection(prefixes=optim_prefixes, description="optimizer state") if optim_prefixes else None
    router = StateSection(prefixes=router_prefixes, description="router weights and state") if router_prefixes else None
    return optim, router, training


def _ensure_directory(path: str) -> None:
    """Create ``path`` and missing parents, fsyncing each parent whose entries changed."""
    if os.path.isdir(path):
        return
    parent = os.path.dirname(path)
    if parent and parent != path:
        _ensure_directory(parent)
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        return
    except OSError as exc:
        raise StorageError(f"cannot create directory {path!r}: {exc.strerror}") from exc
    try:
        fd = os.open(parent or ".", os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise StorageError(f"fsync of directory {parent!r} failed: {exc.strerror}") from exc


#: Why a filesystem refuses to write, by errno, in the words a save error uses.
_REFUSED_WRITES = {
    errno.EROFS: "the filesystem is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "the operation is not permitted",
}


@dataclass(frozen=True, kw_only=True)
class SaveSettings:
    """Every setting of one save, flat, as the save job reads them.

    :func:`~shardkeep.save`, :func:`~shardkeep.async_save` and
    :class:`~shardkeep.CheckpointManager` build it with :meth:`of` from the public option groups
    (:class:`~shardkeep.config.WriteOptions`, :class:`~shardkeep.options.TierPlan`,
    :class:`~shardkeep.options.Incremental`, :class:`~shardkeep.options.ManifestFields`) and the
    other arguments of ``save``. ``run``, ``budget`` and ``started`` are set by the checkpoint
    manager (and tests) only. ``tests/test_save_settings.py`` checks that every field is
    reachable from a group or an argument.
    """

    # How files are written (WriteOptions).
    digest: str = WriteOptions.digest
    byte_budget: int = WriteOptions.byte_budget
    io_threads: int = WriteOptions.io_threads
    file_size_target: int = WriteOptions.file_size_target
    compression: str | None = WriteOptions.compression
    compression_level: int = WriteOptions.compression_level
    progress: bool = False
    storage_options: Mapping[str, Any] | None = None
    # What the manifest records (ManifestFields, and the step).
    model_id: str | None = None
    step: int | None = None
    epoch: int | None = None
    training: Mapping[str, Any] | None = None
    sharding_strategy: str | None = None
    custom_fields: Mapping[str, Any] | None = None
    metrics: Mapping[str, float | None] | None = None
    # Where tensors go (TierPlan), what an incremental save compares against (Incremental), who signs.
    tiers: Sequence[Tier] | None = None
    placement: Placement | None = None
    incremental: bool | str | os.PathLike[str] = False
    trust_versions: bool = False
    signer: Signer | None = None
    # The call's context.
    storage: StoreOperations | None = None
    process_group: Group | None = None
    timeout: float = DEFAULT_TIMEOUT
    # Set by the checkpoint manager only.
    run: RunInfo | None = None
    budget: ByteBudget | None = None
    started: float | None = None
    #: The write options, validated (built from the first group of fields).
    io: WriteOptions = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        io = WriteOptions(
            digest=self.digest,
            byte_budget=self.byte_budget,
            io_threads=self.io_threads,
            file_size_target=self.file_size_target,
            compression=self.compression,
            compression_level=self.compression_level,
            progress=self.progress,
            storage_options=self.storage_options,
        )
        object.__setattr__(self, "io", io)

    @classmethod
    def of(
        cls,
        groups: Regrouped,
        *,
        step: int | None = None,
        signer: Signer | None = None,
        storage: StoreOperations | None = None,
        process_group: Group | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> SaveSettings:
        """The settings of one save, from its option groups and the other arguments of ``save``
        (and the manager-only ``run``, ``budget`` and ``started`` in ``groups.internal``)."""
        written, recorded = groups.options, groups.fields
        return cls(
            **{f.name: getattr(written, f.name) for f in fields(written)},
            **{f.name: getattr(recorded, f.name) for f in fields(recorded)},
            step=step,
            tiers=groups.tiers.tiers or None,
            placement=groups.tiers.placement,
            incremental=groups.incremental.base,
            trust_versions=groups.incremental.trust_versions,
            signer=signer,
            storage=storage,
            process_group=process_group,
            timeout=timeout,
            **{name: value for name, value in groups.internal.items() if name in ("run", "budget", "started")},
        )


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
        sections: tuple[StateSection | None, StateSection | None, Training] | None = None,
    ) -> None:
        options = settings.io
        if settings.signer is not None and options.digest not in CRYPTOGRAPHIC_DIGESTS:
            raise UnsupportedValueError(
                f"signer= needs a cryptographic digest, not digest={options.digest!r}: a signature covers the "
                "data only through the digests (use 'blake3' or 'sha256')"
            )
        self.settings = settings
        self.signer = settings.signer
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
        self.progress = settings.progress
        self.metrics = metric_values(settings.metrics)
        self.sections = sections
        tiers, incremental = settings.tiers, settings.incremental
        if tiers is not None and (isinstance(tiers, (str, bytes)) or not isinstance(tiers, Sequence)):
            raise UnsupportedValueError("tiers= must be a list of shardkeep.Tier")
        self.default_tiers = not tiers
        self.tiers = check_tiers(tiers) if tiers else [Tier(tier_id=1, name=DEFAULT_TIER)]
        self.placement = settings.placement
        if settings.placement is not None and not tiers:
            raise UnsupportedValueError("placement= needs tiers=: define the tiers the rules name")
        self.tier_stores = {
            tier.name: open_store(tier.location, settings.storage_options)
            for tier in self.tiers
            if tier.location is not None
        }
        if not isinstance(incremental, (bool, str, os.PathLike)):
            raise UnsupportedValueError(
                f"incremental={incremental!r} must be True, False, or the path of an earlier checkpoint"
            )
        self.incremental = incremental is not False
        self.base: CheckpointLocation | None = None
        if incremental is not False and incremental is not True:
            if options.compression:
                raise UnsupportedValueError("incremental saves cannot be compressed yet; pass compression=None")
            self.base = _sibling(incremental, location, settings.storage_options)
        self.base_manifest: Manifest | None = None
        if not isinstance(settings.trust_versions, bool):
            raise UnsupportedValueError(f"trust_versions={settings.trust_versions!r} must be True or False")
        if settings.trust_versions and incremental is False:
            raise UnsupportedValueError("trust_versions=True needs incremental= (it proves files unchanged)")
        #: Prove files unchanged by version counters (:mod:`shardkeep.versions`) where possible.
        self.trust_versions = settings.trust_versions
        #: Per file laid out (by ``id`` of its record): its key in the process's known digests,
        #: its header and its tensors' version proof, taken before any of its bytes were read.
        self.proofs: dict[int, tuple[tuple[str, str, str], bytes, TensorVersions]] = {}
        self.tier_of: dict[str, str] = {}
        #: Per key, its size in the whole checkpoint and dtype; whether any tensor is sharded.
        self.totals: dict[str, tuple[int, str]] = {}
        self.chunked = False
        self.alike = True
        #: When the ranks' trees differ: the lowest rank holding the same tree as this one.
        self.class_source = 0
        #: The keys of this rank's chunks on a regular grid (described once in format 2.0).
        self.on_grid: set[str] = set()
        #: The meshes and descriptions of the regularly sharded tensors this rank holds (on the
        #: coordinator, and on every rank when the ranks' trees differ).
        self.descriptions: tuple[list[Mesh], list[ShardedTensor]] = ([], [])
        self.flat = FlatState()
        self.planned: list[PlannedItem] = []
        self.plans: list[ShardPlan] = []
        self.commit: CheckpointCommit | None = None
        self.manifest: Manifest | None = None

    def _describe(self, descriptors: bool = True) -> list[ItemDescriptor]:
        """Flatten the state and plan its leaves; their descriptors (what ranks compare) unless
        ``descriptors=False`` (one process compares with nobody)."""
        with collector_paused():
            self.flat = flatten_state(self.state, keep_vars=self.trust_versions)
            self.planned = [PlannedItem(leaf) for leaf in self.flat.tensors]
            self.on_grid = {item.leaf.key for item in self.planned if item.layout is not None}
            return [item.descriptor for item in self.planned] if descriptors else []

    def _whole_totals(self) -> dict[str, tuple[int, str]]:
        """:func:`global_totals` of a state without chunks, straight from the planned items."""
        return {item.leaf.key: (item.nbytes, item.dtype) for item in self.planned}

    def _begin(self) -> str | None:
        if not self.coordinator.is_coordinator:
            return None
        if self.signer is not None:
            self.private_key = load_private_key(self.signer)  # only the coordinator signs
        store = self.location.store
        with self._writes_refused_named():
            for local in (store, *self.tier_stores.values()):
                if isinstance(local, LocalStore):
                    _ensure_directory(local.root)
        opening = CheckpointCommit(store, self.location.name, tier_stores=self.tier_stores)
        opening.begin()
        return opening.staging

    def _sections_of(self) -> tuple[StateSection | None, StateSection | None, Training]:
        """Optimizer and router sections (as :func:`_manifest_for` records them)."""
        optim, router, training = state_sections(self.state, [leaf.key for leaf in self.flat.tensors])
        if self.sections is not None:
            # An async save describes a snapshot: the optimizer section comes from the original state.
            optim, _, training = self.sections
        return optim, router, training

    def _place(self, totals: dict[str, tuple[int, str]]) -> None:
        """Every tensor's tier, decided from the global sizes (the same on every rank)."""
        if self.placement is None and len(self.tiers) == 1 and self.tiers[0].size_budget is None:
            self.tier_of = dict.fromkeys(totals, self.tiers[0].name)  # nothing to decide
            return
        optim, router, _ = self._sections_of()
        self.tier_of = place(
            [(key, nbytes, dtype) for key, (nbytes, dtype) in sorted(totals.items())],
            self.tiers,
            self.placement,
            optim.prefixes if optim is not None else (),
            router.prefixes if router is not None else (),
        )

    def _read_base(self) -> Manifest | None:
        if self.base is None:
            return None
        base = parse_manifest(read_manifest_bytes(self.base), where=str(self.base))
        if isinstance(base, IndexedManifest):  # this rank's files are in its own index
            own = [record.rank for record in base.index_records() if record.rank == self.coordinator.rank]
            base = expand(self.base.store, self.base.name, base, own)
        return base

    def describe_for_agreement(self, described: list[ItemDescriptor]) -> str:
        """Describe this rank's part (into ``described``) and return its agreement digest: the
        work of the save's first collective step."""
        described.extend(self._describe(descriptors=self.coordinator.distributed))
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
        #: Every rank holds the same tree and whole tensors (the usual case): the coordinator's
        #: tree is the checkpoint's. Otherwise each rank sends its containers with its records.
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
        if self.base is not None:
            self.base_manifest = coordinator.step("read the incremental base", self._read_base)[coordinator.rank]
        laid_out: list[tuple[FileRecord, list[PlannedItem], Tier, bytes | None]] = []

        def plan() -> str | None:
            self._place(totals)
            laid_out.extend(self._lay_out(planned_here))
            # This rank's part of the manifest, inside the step: whatever fails here (a value
            # of custom_fields that is not JSON, say) fails every rank together. The records
            # get their paths once the staging directory is open (_place_files).
            self._build_manifest([record for record, _, _, _ in laid_out])
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

    def _commit_for(self, staging: str | None) -> CheckpointCommit:
        return CheckpointCommit(self.location.store, self.location.name, staging, tier_stores=self.tier_stores)

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

    def _lay_out(
        self, planned_here: list[PlannedItem]
    ) -> list[tuple[FileRecord, list[PlannedItem], Tier, bytes | None]]:
        """Group this rank's tensors into files and build each file's header: (record, its
        tensors, its tier, its header, or ``None`` when the file equals the base checkpoint's
        file of the same name). Where the files go is decided once the staging directory is
        open (:meth:`_place_files`)."""
        coordinator = self.coordinator
        optim, router, _ = self._sections_of()
        optim_prefixes = optim.prefixes if optim is not None else []
        router_prefixes = router.prefixes if router is not None else []
        sections: dict[str, str] = {}
        for item in planned_here if optim_prefixes or router_prefixes else ():  # else all "model"
            section = section_of(item.leaf.key, optim_prefixes, router_prefixes)
            if section != "model":
                sections[item.leaf.key] = section
        previous = _previous_files(self.base_manifest, self.tiers) if self.base_manifest is not None else {}
        laid_out: list[tuple[FileRecord, list[PlannedItem], Tier, bytes | None]] = []
        with collector_paused():
            by_tier: dict[str, list[PlannedItem]] = {}
            for item in planned_here:
                by_tier.setdefault(self.tier_of[item.leaf.key], []).append(item)
            for tier in self.tiers:
                groups = plan_files(
                    by_tier.get(tier.name, []),
                    rank=coordinator.rank,
                    target=self.options.file_size_target,
                    tier=tier.name,
                    tier_id=tier.tier_id,
                    suffix=".safetensors.zst" if self.options.compression else ".safetensors",
                    directory="shards" if self.default_tiers else f"shards/{tier.name}",
                    sections=sections,
                    per_expert=self.incremental,
                )
                for record, group in groups:
                    laid_out.append((record, group, tier, self._lay_out_one(record, group, tier, previous)))
        return laid_out

    def _place_files(self, laid_out: list[tuple[FileRecord, list[PlannedItem], Tier, bytes | None]]) -> None:
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
        with collector_paused():
            if self.on_grid and (coordinator.is_coordinator or not self.alike):
                self.descriptions = self._descriptions()
            self.manifest = _manifest_for(
                self.location.name,
                self.state,
                self.flat,
                records,
                chunked=self.chunked,
                precision=_precision(self.totals),
                world_size=coordinator.world_size,
                digest=self.options.digest,
                tiers=self.tiers,
                settings=self.settings,
                metrics=self.metrics,
                sections=self.sections,
            )

    def _base_file_present(self, earlier: FileRecord, tier: Tier) -> bool:
        """Whether the base's file is where its manifest says, with its size: a reference to a
        missing or truncated file would commit a checkpoint that cannot load (its digest is
        checked on every load and verify)."""
        assert self.base is not None
        store = self.tier_stores.get(tier.name, self.location.store)
        info = store.stat(f"{earlier.ref or self.base.name}/{earlier.path}")
        return info is not None and info.kind == "file" and info.size == earlier.stored_size

    def _lay_out_one(
        self, record: FileRecord, group: list[PlannedItem], tier: Tier, previous: dict[tuple[str, str], FileRecord]
    ) -> bytes | None:
        """Lay out one file; return its header, or ``None`` when the file equals the base
        checkpoint's file of the same name (which ``record`` then references)."""
        earlier = previous.get((tier.name, record.path))
        key = (self.tier_stores.get(tier.name, self.location.store).root, tier.name, record.path)
        arrays = [item.array for item in group] if self.trust_versions else []
        versions = capture(arrays) if self.trust_versions else None  # before any byte is read
        if earlier is not None and earlier.digest and earlier.compression is None:
            algorithm = earlier.digest.partition(":")[0]
            record.version = earlier.version
            header = file_header(record, group, tier.tier_id)
            if algorithm == self.options.digest:
                known = KNOWN.digest(key, header, arrays) if versions is not None else None
                if known is not None and known.partition(":")[0] != algorithm:
                    known = None  # recorded under another digest algorithm
                digest = known or digest_of(header, group, algorithm)
                if versions is not None:
                    KNOWN.record(key, header, versions, digest)
                if digest == earlier.digest and self._base_file_present(earlier, tier):
                    assert self.base is not None
                    record.ref = earlier.ref or self.base.name
                    record.path = earlier.path
                    record.digest = earlier.digest
                    return None
            record.version = earlier.version + 1
        header = file_header(record, group, tier.tier_id)
        if self.trust_versions:
            self.proofs[id(record)] = (key, header, versions)
        return header

    def write(self) -> list[FileRecord]:
        """Write this rank's files; return every record of this rank (written or referenced)."""
        assert self.manifest is not None
        # Never write what load would refuse: this rank's part of the manifest is checked first.
        if self.coordinator.is_coordinator or self.plans:
            errors = validate_manifest(self.manifest).errors
            if errors:
                raise UnsupportedValueError(f"cannot save {self.location}: " + "; ".join(errors[:5]))
        update, close = progress_bar(
            sum(plan.record.size for plan in self.plans), f"save {self.location.name}", self.progress
        )
        try:
            write_shards(
                self.location.store,
                self.plans,
                algorithm=self.options.digest,
                budget=self.budget,
                io_threads=self.options.io_threads,
                on_bytes=update,
                compression_level=self.options.compression_level if self.options.compression else None,
                control=self.control,
            )
        finally:
            close()
        for plan in self.plans if self.trust_versions else ():
            proof = self.proofs.get(id(plan.record))
            if proof is not None and plan.record.digest:
                KNOWN.record(proof[0], proof[1], proof[2], plan.record.digest)
        return list(self.manifest.files)

    def report(self) -> RankReport:
        """Write this rank's files (and, in format 2.0, its index); return what the coordinator
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
        data = encode_index(rank, files)
        recorded, store, where = self.commit.place(index_path(rank))
        write_new(store, where, data)
        return IndexRecord(rank=rank, path=recorded, size=len(data), digest=digest_bytes(self.options.digest, data))

    def _descriptions(self) -> tuple[list[Mesh], list[ShardedTensor]]:
        """The meshes and the descriptions of the regularly sharded tensors this rank holds."""
        tier_ids = {tier.name: tier.tier_id for tier in self.tiers}
        meshes: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
        described: dict[str, ShardedTensor] = {}
        for item in self.planned:
            if item.layout is None or item.leaf.key in described:
                continue
            mesh_shape, ranks, _, placements = item.layout
            mesh = meshes.setdefault((mesh_shape, ranks), len(meshes))
            key = item.leaf.key
            expert = expert_key_of(key, tier_ids.get(self.tier_of.get(key, ""), 1))
            assert item.global_shape is not None
            described[key] = ShardedTensor(
                key=key,
                path=list(item.leaf.path),
                dtype=item.dtype,
                global_shape=list(item.global_shape),
                mesh=mesh,
                placements=list(placements),
                kind="expert" if expert else "dense",
                expert_key=expert,
                order=item.leaf.order,
            )
        mesh_list = [
            Mesh(shape=list(shape), ranks=None if list(ranks) == list(range(len(ranks))) else list(ranks))
            for (shape, ranks) in meshes
        ]
        return mesh_list, sorted(described.values(), key=lambda tensor: tensor.key)

    def write_payload(self) -> bytes:
        """:meth:`report`, as msgpack bytes (compact, and decoded with their defaults intact,
        so the manifest omits them)."""
        return _PAYLOAD_ENCODER.encode(self.report())

    def read_payloads(self, payloads: list[bytes]) -> list[RankReport]:
        """On the coordinator: every rank's report from :meth:`write_payload`; the containers of
        ranks whose trees differ join the manifest's structure."""
        reports = [_PAYLOAD_DECODER.decode(payload) for payload in payloads]
        trees = [report.containers for report in reports if report.containers is not None]
        if trees and self.manifest is not None:
            self.manifest.structure = _merged_structure(self.manifest.structure, trees)
        return reports

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
        manifest = self._indexed(reports) if any(report.index is not None for report in reports) else self.manifest
        manifest.files = listed
        manifest.sharding.shard_count = len(listed) + sum(report.indexed_files for report in reports)
        problems = (
            validate_manifest(manifest).errors if self.coordinator.distributed or manifest is not self.manifest else []
        )
        # Never commit what load would refuse: every tensor tiled exactly once, every leaf placed.
        # (The chunks of a format 2.0 manifest's described tensors tile by construction; their
        # bytes are counted in _indexed.)
        if has_chunks(manifest):  # coverage_problems finds nothing without chunks
            problems += coverage_problems(manifest)
        if problems:
            raise UnsupportedValueError(f"cannot commit {self.location}: " + "; ".join(problems[:5]))
        for record in manifest.files:
            if record.ref is None and record.tier not in self.tier_stores:
                self.commit.add_data_file(record.path)  # every rank's data directories are fsynced, not only ours
        for directory in sorted({directory for report in reports for directory in report.directories}):
            self.commit.add_data_file(f"{directory}/-")
        if isinstance(manifest, IndexedManifest):
            self.commit.add_data_file(index_path(0))  # the index directory (prefix: see IndexTable)
        total = time.perf_counter() - self.started
        blocked = total if self.blocked_seconds is None else min(self.blocked_seconds, total)
        manifest.timing = SaveTiming(blocked_seconds=round(blocked, 6), total_seconds=round(total, 6))
        sealed = seal_manifest(encode_manifest(manifest), self.options.digest)
        warn_if_over_read_limits(self.location, sealed, manifest)
        signature = sign_manifest(sealed, self.private_key, manifest) if self.private_key is not None else None
        with self._writes_refused_named():
            self.commit.commit(sealed, signature)
        return manifest

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

    def _indexed(self, reports: list[RankReport]) -> IndexedManifest:
        """The format 2.0 manifest: the sharded tensors described once (from this rank, or
        merged from every rank's report when the ranks hold different trees), and the rank
        indexes; refused unless the ranks' indexed chunks hold exactly the described bytes."""
        assert self.manifest is not None
        if self.alike:
            meshes, sharded = self.descriptions
        else:
            meshes, sharded = _merged_descriptions(reports)
        expected = sum(math.prod(t.global_shape) * DTYPE_ITEMSIZE.get(t.dtype, 1) for t in sharded)
        written = sum(report.indexed_bytes for report in reports)
        if written != expected:
            raise UnsupportedValueError(
                f"cannot commit {self.location}: the ranks wrote {written} bytes of chunks of sharded tensors, "
                f"but those tensors hold {expected} bytes"
            )
        base = {name: getattr(self.manifest, name) for name in Manifest.__struct_fields__}
        base["metadata_version"] = INDEXED_VERSION
        return IndexedManifest(
            **base,
            meshes=meshes,
            sharded=sharded,
            indexes=msgspec.structs.replace(
                IndexTable.of([report.index for report in reports if report.index is not None]),
                refs=sorted({ref for report in reports for ref in report.refs}),
            ),
        )

    def abort(self) -> None:
        if self.coordinator.is_coordinator and self.commit is not None:
            self.commit.abort()


def warn_if_over_read_limits(
    location: object, sealed: bytes, manifest: Manifest, limits: ManifestLimits | None = None
) -> None:
    """Log a warning when readers will need ``limits=``: the default limits (or ``limits``)
    bound what reading any manifest may cost, and this one is over them."""
    limits = limits or ManifestLimits()
    entries = sum(len(record.tensors) for record in manifest.files)
    if len(sealed) > limits.max_bytes or entries > limits.max_tensors or len(manifest.files) > limits.max_files:
        logger.warning(
            "the manifest of %s (%.1f MiB, %d tensor entries, %d files) is over the default read limits "
            "(%g MiB, %d entries, %d files): load, verify and CheckpointManager need "
            "limits=ManifestLimits(max_bytes=..., max_tensors=..., max_files=...) to read it",
            location,
            len(sealed) / 2**20,
            entries,
            len(manifest.files),
            limits.max_bytes / 2**20,
            limits.max_tensors,
            limits.max_files,
        )


def _sibling(
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


def _logical(path: str) -> str:
    """A data file's path without the attempt prefix object stores and tier locations add."""
    first, _, rest = path.partition("/")
    return rest if first.startswith(ATTEMPT_PREFIX) and rest else path


def _merged_structure(own: list[ContainerEntry], others: list[list[ContainerEntry]]) -> list[ContainerEntry]:
    """The coordinator's containers plus those only other ranks hold (expert-parallel ranks
    hold different experts); ranks that disagree about a container's kind are refused."""
    merged = {tuple(entry.path): entry for entry in own}
    for containers in others:
        for entry in containers:
            known = merged.setdefault(tuple(entry.path), entry)
            if known.kind != entry.kind:
                raise UnsupportedValueError(
                    f"ranks disagree about the container at {'.'.join(map(str, entry.path)) or '<root>'}: "
                    f"{known.kind} and {entry.kind}"
                )
    return list(merged.values())


def _previous_files(manifest: Manifest, tiers: list[Tier]) -> dict[tuple[str, str], FileRecord]:
    """The base checkpoint's files by (tier, path without attempt prefix), on tiers whose
    location is unchanged (a file can only be referenced where it already is)."""
    locations = {tier.name: tier.location for tier in tiers}
    theirs = {tier.name: tier.location for tier in manifest.tiers}
    found: dict[tuple[str, str], FileRecord] = {}
    for record in manifest.files:
        if record.tier in locations and theirs.get(record.tier) == locations[record.tier]:
            found[(record.tier, _logical(record.path))] = record
    return found


def _offset_key(offset: list[int] | None) -> tuple[int, ...] | None:
    return None if offset is None else tuple(offset)


def _manifest_for(
    name: str,
    state: Mapping[str, Any],
    flat: FlatState,
    records: list[FileRecord],
    *,
    chunked: bool,
    precision: str | None,
    world_size: int,
    digest: str,
    tiers: list[Tier],
    settings: SaveSettings,
    metrics: dict[str, float | None],
    sections: tuple[StateSection | None, StateSection | None, Training] | None,
) -> Manifest:
    """The manifest of this save, with this rank's file records (the coordinator merges all)."""
    optim, router, detected = state_sections(state, [leaf.key for leaf in flat.tensors])
    if sections is not None:
        # An async save describes a snapshot, where modules and optimizers are plain dicts: the
        # optimizer section and training fields come from the caller's original state.
        optim, _, detected = sections
    strategy = settings.sharding_strategy or ("dtensor" if chunked else "replicated" if world_size > 1 else "none")
    return Manifest(
        model_id=settings.model_id,
        step=settings.step if settings.step is not None else _step_of(state, name),
        epoch=settings.epoch,
        world_size=world_size,
        digest_algorithm=digest,
        sharding=Sharding(strategy=strategy, shard_count=len(records), precision=precision),
        training=_training_fields(settings.training, detected),
        tiers=tiers,
        files=records,
        optim_state=optim,
        router_state=router,
        structure=flat.containers,
        values=flat.values,
        custom_fields=_plain_json_mapping("custom_fields", settings.custom_fields),
        metrics=metrics,
        run=settings.run,
    )


def _step_of(state: Mapping[str, Any], name: str) -> int | None:
    """The step a state records in its top-level ``"step"`` key (an int >= 0, not a bool), which
    a save without ``step=`` to checkpoint ``name`` records as the checkpoint's step, unless it
    contradicts the name: ``step_<N>`` with another ``N`` (a directory counting saves while the
    state holds the next step to run) would make the checkpoint misnamed."""
    value = state.get("step")
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_STEP:
        return None
    named = step_of_name(name)
    return value if named is None or named == value else None


def metric_values(metrics: Mapping[str, Any] | None) -> dict[str, float | None]:
    """Metrics as recorded: finite floats, or ``None`` for NaN and infinities."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise UnsupportedValueError(f"metrics= must be a mapping of names to numbers, got {type(metrics).__name__}")
    recorded: dict[str, float | None] = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name:
            raise UnsupportedValueError(f"metric name {name!r} must be a non-empty string")
        try:
            if value is not None and hasattr(value, "item") and callable(value.item):
                value = value.item()  # a 0-d tensor or numpy scalar
            if value is None:
                recorded[name] = None
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                raise UnsupportedValueError(f"metric {name!r}={value!r} must be a number")
            else:
                number = float(value)
                recorded[name] = number if math.isfinite(number) else None
        except (RuntimeError, ValueError, OverflowError) as exc:
            raise UnsupportedValueError(f"metric {name!r} must be a single finite-size number: {exc}") from exc
    return recorded


def _plain_json_mapping(name: str, value: Mapping[str, Any] | None) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not is_plain_json(dict(value)):
        raise UnsupportedValueError(
            f"{name}= must be a mapping of plain JSON values (string keys, finite numbers, lists, dicts)"
        )
    return dict(value)


def _training_fields(given: Mapping[str, Any] | None, detected: Training) -> Training:
    if not given:
        return detected
    unknown = set(given) - {"learning_rate", "optimizer_type"}
    if unknown:
        raise UnsupportedValueError(
            f"training= has unknown fields {sorted(unknown)}; known: learning_rate, optimizer_type"
        )
    learning_rate = given.get("learning_rate", detected.learning_rate)
    if learning_rate is not None and (
        isinstance(learning_rate, bool)
        or not isinstance(learning_rate, (int, float))
        or not math.isfinite(learning_rate)
    ):
        raise UnsupportedValueError(f"training learning_rate={learning_rate!r} must be a finite number")
    optimizer_type = given.get("optimizer_type", detected.optimizer_type)
    if optimizer_type is not None and not isinstance(optimizer_type, str):
        raise UnsupportedValueError(f"training optimizer_type={optimizer_type!r} must be a string")
    return Training(
        learning_rate=None if learning_rate is None else float(learning_rate), optimizer_type=optimizer_type
    )


def _precision(totals: dict[str, tuple[int, str]]) -> str | None:
    """The floating-point dtype holding the most bytes, as fp32/bf16/fp16/fp64/fp8."""
    float_bytes: dict[str, int] = {}
    for nbytes, dtype in totals.values():
        if dtype in _PRECISION:
            float_bytes[dtype] = float_bytes.get(dtype, 0) + nbytes
    return _PRECISION[max(float_bytes, key=float_bytes.__getitem__)] if float_bytes else None


class RankReport(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """What each rank sends the coordinator after writing: O(files it lists + 1), whatever the
    number of chunks it wrote."""

    #: The records of the files the manifest lists (whole tensors, chunks off a grid).
    files: list[FileRecord]
    #: Format 2.0: this rank's index, how many files it lists, their chunk bytes and directories.
    index: IndexRecord | None = None
    indexed_files: int = 0
    indexed_bytes: int = 0
    #: The earlier checkpoints the indexed files reference (incremental saves).
    refs: list[str] = msgspec.field(default_factory=list)
    directories: list[str] = msgspec.field(default_factory=list)
    #: Only when the ranks' trees differ: this rank's containers and sharded tensors.
    containers: list[ContainerEntry] | None = None
    meshes: list[Mesh] = msgspec.field(default_factory=list)
    sharded: list[ShardedTensor] = msgspec.field(default_factory=list)


def _merged_descriptions(reports: list[RankReport]) -> tuple[list[Mesh], list[ShardedTensor]]:
    """Every rank's sharded tensors, each once, with their meshes renumbered into one list."""
    meshes: dict[tuple[tuple[int, ...], tuple[int, ...] | None], int] = {}
    described: dict[str, ShardedTensor] = {}
    for report in reports:
        for tensor in report.sharded:
            if tensor.key in described:
                continue
            mesh = report.meshes[tensor.mesh]
            ident = (tuple(mesh.shape), None if mesh.ranks is None else tuple(mesh.ranks))
            # A renumbered copy: the reports stay as received (a commit may be attempted again).
            described[tensor.key] = msgspec.structs.replace(tensor, mesh=meshes.setdefault(ident, len(meshes)))
    mesh_list = [Mesh(shape=list(shape), ranks=None if ranks is None else list(ranks)) for shape, ranks in meshes]
    return mesh_list, sorted(described.values(), key=lambda tensor: tensor.key)


_PAYLOAD_ENCODER = msgspec.msgpack.Encoder()
_PAYLOAD_DECODER = msgspec.msgpack.Decoder(RankReport)


def run_save(state: Mapping[str, Any], path: str | os.PathLike[str], settings: SaveSettings) -> Manifest:
    """The body of :func:`~shardkeep.save` (and of the checkpoint manager's save): prepare,
    write (every rank), commit (the coordinator), and abort on any failure."""
    job = SaveJob(
        state,
        locate(path, settings.storage, settings.storage_options),
        settings,
        Coordinator(settings.process_group, timeout=settings.timeout),
    )
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
        # The coordinator commits; the others receive the committed manifest once (a broadcast:
        # an all-gather would pad every rank's empty result to the manifest's size).
        committed = coordinator.on_coordinator("commit the checkpoint", lambda: job.finish(records))
    except BaseException:
        job.abort()
        raise
    assert committed is not None
    return committed
