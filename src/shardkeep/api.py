"""The verbs: ``save`` and ``load`` (and, re-exported, ``read_manifest`` and ``verify``).

``save`` flattens the state, lays tensors out in safetensors data files, writes them in parallel
under a byte budget with digests computed while writing, and commits through
:class:`~shardkeep.distributed.commit.CheckpointCommit`: staging directory, manifest last, one rename.
``load`` reads the manifest, checks the file set, memory-maps and verifies every file it needs
before it builds a single tensor, so a damaged checkpoint raises before anything is modified.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import gc
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import numpy as np
import torch

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shardkeep.config import LoadOptions, ManifestLimits, SaveOptions
from shardkeep.distributed.commit import ATTEMPT_PREFIX, CheckpointCommit
from shardkeep.distributed.coordinator import DEFAULT_TIMEOUT, Coordinator
from shardkeep.distributed.plan import ItemDescriptor, assign_writers, coverage_problems
from shardkeep.errors import (
    ConfigError,
    CoordinationError,
    IntegrityError,
    SaveInProgressError,
    ShardkeepError,
    StorageError,
    UnsupportedValueError,
)
from shardkeep.fill import fill_into
from shardkeep.integrity import CRYPTOGRAPHIC_DIGESTS, SignaturePolicy, load_private_key, seal_manifest, sign_manifest
from shardkeep.io import ByteBudget, ShardPlan, check_shard, digest_of, write_shards
from shardkeep.manifest import (
    FileRecord,
    Manifest,
    RunInfo,
    SaveTiming,
    Sharding,
    StateSection,
    TensorEntry,
    Tier,
    Training,
    encode_manifest,
    validate_manifest,
)
from shardkeep.snapshot import StagingArena, snapshot_state
from shardkeep.storage import ByteStore, LocalStore, open_store
from shardkeep.tensors.convert import (
    array_from_buffer,
    byte_view,
    contiguous_pieces,
    describe_array,
    dtensor_chunk,
)
from shardkeep.tensors.flatten import FlatState, TensorLeaf, flatten_state, is_plain_json, rebuild_state
from shardkeep.tensors.keys import EXPERT_KEY, LAYER_KEY, ROUTER_KEY, section_of
from shardkeep.tensors.regions import Region, assemble, needed_entries, wanted_regions
from shardkeep.tensors.shardfile import build_header
from shardkeep.tiers import Placement, check_tiers, place
from shardkeep.verification import (
    CheckpointLocation,
    FileResolver,
    TierLocations,
    file_set_problems,
    locate,
    parse_manifest,
    read_checked_manifest,
    read_manifest,
    read_manifest_bytes,
    select_files,
    verify,
)

__all__ = ["SaveHandle", "async_save", "load", "read_manifest", "save", "verify"]

logger = logging.getLogger("shardkeep")

DEFAULT_TIER = "hot"
_PRECISION = {"F32": "fp32", "BF16": "bf16", "F16": "fp16", "F64": "fp64", "F8_E4M3": "fp8", "F8_E5M2": "fp8"}


class _Planned:
    """One tensor (or DTensor chunk) to write: its description, and a
    :class:`~shardkeep.io.TensorSource` over its bytes."""

    __slots__ = (
        "address",
        "array",
        "array_type",
        "dtype",
        "global_offset",
        "global_shape",
        "itemsize",
        "leaf",
        "nbytes",
        "shape",
        "wants_digest",
    )

    def __init__(self, leaf: TensorLeaf) -> None:
        self.leaf = leaf
        value = leaf.value
        chunk = dtensor_chunk(leaf.key, value) if type(value) not in _PLAIN_ARRAYS else None
        self.global_shape: list[int] | None = None
        self.global_offset: list[int] | None = None
        if chunk is not None:
            value, self.global_shape, self.global_offset = chunk
        self.array = value
        self.wants_digest = chunk is not None
        self.dtype, self.shape, self.nbytes, self.itemsize, self.array_type, self.address = describe_array(
            leaf.key, value
        )

    @property
    def descriptor(self) -> ItemDescriptor:
        return ItemDescriptor(
            self.leaf.key,
            self.dtype,
            tuple(self.shape),
            self.nbytes,
            None if self.global_shape is None else tuple(self.global_shape),
            None if self.global_offset is None else tuple(self.global_offset),
        )

    def pieces(self, max_bytes: int) -> Iterator[memoryview]:
        for piece in contiguous_pieces(self.array, max_bytes):
            yield byte_view(piece)
            del piece


_PLAIN_ARRAYS = (torch.Tensor, np.ndarray)


def _expert_key(key: str, tier_id: int) -> list[int] | None:
    if "experts." not in key:
        return None
    match = EXPERT_KEY.search(key)
    if match is None:
        return None
    layer = LAYER_KEY.search(key)
    return [tier_id, int(layer.group(1)) if layer else 0, int(match.group(1))]


def _plan_files(
    planned: list[_Planned],
    *,
    rank: int,
    target: int,
    tier: str,
    tier_id: int,
    suffix: str = ".safetensors",
    directory: str = "shards",
    sections: Mapping[str, str] | None = None,
    per_expert: bool = False,
) -> list[tuple[FileRecord, list[_Planned]]]:
    """Lay tensors out in files: by decreasing element size (so every tensor is aligned), split
    into files of about ``target`` bytes so that large states are written in parallel.

    Chunks of sharded tensors go to their own files (``rank_NNNNN_sharded``), apart from whole
    tensors: every loading rank needs every whole tensor, but only the chunks that overlap its
    own shard, and it can then skip the other chunk files' bytes entirely.

    ``sections`` (key to ``"optim"``/``"router"``) puts optimizer and router state in files of
    their own (``rank_NNNNN_optim``), so that each section loads on its own. With
    ``per_expert`` (incremental saves), each expert's tensors get a file of their own
    (``rank_NNNNN_L003_E007``): a frozen expert's file is then unchanged from one save to the
    next, and referenced instead of written again.
    """
    groups: dict[str, list[_Planned]] = {}
    for item in planned:
        key = item.leaf.key
        sharded = "_sharded" if item.global_offset is not None else ""
        section = (sections or {}).get(key)
        if section is not None:
            stem = f"_{section}{sharded}"
        elif per_expert and (match := EXPERT_KEY.search(key)):
            layer = LAYER_KEY.search(key)
            stem = f"_L{int(layer.group(1)) if layer else 0:03d}_E{int(match.group(1)):03d}{sharded}"
        else:
            stem = sharded
        groups.setdefault(stem, []).append(item)
    result: list[tuple[FileRecord, list[_Planned]]] = []
    for stem in sorted(groups):
        base = f"{directory}/rank_{rank:05d}{stem}"
        for index, group in enumerate(_split(groups[stem], target)):
            name = f"{base}{suffix}" if index == 0 else f"{base}_p{index:03d}{suffix}"
            result.append((FileRecord(path=name, rank=rank, size=0, digest=None, tier=tier), group))
    return result


def _split(items: list[_Planned], target: int) -> list[list[_Planned]]:
    if not items:
        return []
    ordered = sorted(items, key=lambda p: -p.itemsize)
    total = sum(p.nbytes for p in ordered)
    file_count = max(1, math.ceil(total / target))
    quota = total / file_count
    groups: list[list[_Planned]] = [[]]
    group_bytes = 0
    for item in ordered:
        if groups[-1] and group_bytes + item.nbytes > quota * 1.05 and len(groups) < file_count:
            groups.append([])
            group_bytes = 0
        groups[-1].append(item)
        group_bytes += item.nbytes
    return groups


def _layout(record: FileRecord, group: list[_Planned], tier_id: int) -> bytes:
    """Fill ``record`` with tensor entries and its size; return the safetensors header (which
    records ``record.version``)."""
    spans: list[tuple[str, str, list[int], int, int]] = []
    position = 0
    for item in group:
        spans.append((item.leaf.key, item.dtype, item.shape, position, position + item.nbytes))
        position += item.nbytes
    header = build_header(spans, record.version)
    base = len(header)
    tensors = record.tensors
    tensors.clear()
    for item, (key, _, _, begin, _) in zip(group, spans, strict=True):
        expert = _expert_key(key, tier_id)
        tensors.append(
            TensorEntry(
                key=key,
                path=list(item.leaf.path),
                dtype=item.dtype,
                shape=item.shape,
                offset=base + begin,
                nbytes=item.nbytes,
                kind="expert" if expert else "dense",
                expert_key=expert,
                global_shape=item.global_shape,
                global_offset=item.global_offset,
                array_type=item.array_type,  # type: ignore[arg-type]  # "torch" or "numpy"
                order=item.leaf.order,
            )
        )
    record.size = base + position
    return header


def _sections(state: Mapping[str, Any], keys: list[str]) -> tuple[StateSection | None, StateSection | None, Training]:
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


def _progress_bar(
    total: int, description: str, enabled: bool
) -> tuple[Callable[[int], None] | None, Callable[[], None]]:
    if not enabled:
        return None, lambda: None
    from tqdm import tqdm

    bar = tqdm(total=total, unit="B", unit_scale=True, desc=description, leave=False)
    return bar.update, bar.close


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while building or decoding many small objects.

    A state of 20,000 tensors creates about 100,000 short-lived containers; without the pause,
    repeated full collections scanning them cost more than the work itself. Nothing created
    here forms a reference cycle, and the collector is resumed even on error.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


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


def save(
    state: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    digest: str = "blake3",
    byte_budget: int = SaveOptions.byte_budget,
    io_threads: int = SaveOptions.io_threads,
    file_size_target: int = SaveOptions.file_size_target,
    compression: str | None = None,
    compression_level: int = SaveOptions.compression_level,
    model_id: str | None = None,
    step: int | None = None,
    epoch: int | None = None,
    training: Mapping[str, Any] | None = None,
    sharding_strategy: str | None = None,
    custom_fields: Mapping[str, Any] | None = None,
    metrics: Mapping[str, float | None] | None = None,
    run: RunInfo | None = None,
    progress: bool = False,
    budget: ByteBudget | None = None,
    storage: ByteStore | None = None,
    storage_options: Mapping[str, Any] | None = None,
    tiers: Sequence[Tier] | None = None,
    placement: Placement | None = None,
    incremental: bool | str | os.PathLike[str] = False,
    signer: Any = None,
    process_group: Any = None,
    timeout: float = DEFAULT_TIMEOUT,
    started: float | None = None,
) -> Manifest:
    r"""Save ``state`` as a new committed checkpoint at ``path`` and return its manifest.

    ``state`` is a mapping whose leaves are tensors, ``DTensor``\ s, numpy arrays or JSON
    values; objects with ``state_dict()`` are expanded. The checkpoint appears at ``path``
    atomically, or not at all; saving onto an existing checkpoint raises
    :class:`~shardkeep.errors.CheckpointExistsError`.

    When ``torch.distributed`` is initialized, every rank calls ``save`` with the same ``path``
    on a shared filesystem. Plain tensors are taken to be replicated (as in DDP) and are written
    once in total, spread across ranks; ``DTensor`` leaves are written as the chunks each rank
    holds, with their global shape and offset. JSON values and the tree structure come from the
    coordinator (the lowest rank). If any rank fails, every rank raises the same
    :class:`~shardkeep.errors.CoordinationError` and nothing is committed. ``process_group``
    picks the group (default: a dedicated gloo group); ``timeout`` bounds every wait.

    ``metrics`` (name to number; NaN and infinities are recorded as null) and ``run`` (a
    :class:`~shardkeep.manifest.RunInfo`) go into the manifest; the checkpoint manager sets them.

    ``byte_budget`` bounds the memory held beyond the caller's tensors; pass ``budget`` to
    observe its high-water mark. With ``storage`` (a byte store), ``path`` is the checkpoint's
    name inside that store. ``path`` may be a URL (``s3://bucket/prefix/step_00001000``);
    ``storage_options`` then go to fsspec (credentials, endpoint; the AWS environment variables
    are used otherwise). An object store has no rename: data objects go under a fresh
    ``attempt-<id>/`` prefix and the manifest is written last, create-only.

    ``tiers`` (a list of :class:`~shardkeep.manifest.Tier`) and ``placement`` (ordered
    ``(glob on the key, tier name)`` rules, or a callable taking a
    :class:`~shardkeep.tiers.PlacementInfo`) put each tensor on a tier; a tier's files go to
    its ``location`` (``None``: beside the manifest). Size budgets are enforced as each tier's
    ``placement_policy`` says (``"prioritized"`` spills to the next tier, ``"strict"`` refuses).

    ``incremental``: ``True`` lays files out so that unchanged parts can be referenced later
    (one file per expert); a path (an earlier checkpoint in the same root) also compares each
    file's digest with that checkpoint's and, where they are equal, records a reference to the
    existing file instead of writing it again.

    ``signer`` (an ``Ed25519PrivateKey`` or the path of a PEM private key file) signs the
    manifest: ``manifest.sig`` is written beside it, over its exact bytes, before the commit.
    Only the coordinator uses the key (other ranks may pass ``None``). The digest must be
    cryptographic (``blake3`` or ``sha256``).

    ``started`` (a ``time.perf_counter()`` value; default: now) is when the caller's pause
    began, recorded in the manifest's ``timing`` (the checkpoint manager passes its own start).
    """
    options = SaveOptions(
        digest=digest,
        byte_budget=byte_budget,
        io_threads=io_threads,
        file_size_target=file_size_target,
        compression=compression,
        compression_level=compression_level,
    )
    job = _SaveJob(
        state,
        locate(path, storage, storage_options),
        options,
        Coordinator(process_group, timeout=timeout),
        budget=budget,
        progress=progress,
        metadata=_SaveMetadata(
            model_id, step, epoch, training, sharding_strategy, custom_fields, _metric_values(metrics), run
        ),
        layout=_Layout(tiers, placement, incremental, storage_options),
        signer=signer,
    )
    if started is not None:
        job.started = started
    coordinator = job.coordinator
    try:
        job.prepare()
        records = coordinator.step("write the shards", job.write)
        committed = coordinator.step("commit the checkpoint", lambda: job.finish(records))[0]
    except BaseException:
        job.abort()
        raise
    assert committed is not None
    return committed


class _SaveMetadata(NamedTuple):
    model_id: str | None
    step: int | None
    epoch: int | None
    training: Mapping[str, Any] | None
    sharding_strategy: str | None
    custom_fields: Mapping[str, Any] | None
    metrics: dict[str, float | None]
    run: RunInfo | None


class _Layout(NamedTuple):
    """Where a save puts its tensors: tiers, placement rules, incremental base."""

    tiers: Sequence[Tier] | None = None
    placement: Placement | None = None
    incremental: bool | str | os.PathLike[str] = False
    storage_options: Mapping[str, Any] | None = None


class _SaveJob:
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
        options: SaveOptions,
        coordinator: Coordinator,
        *,
        budget: ByteBudget | None,
        progress: bool,
        metadata: _SaveMetadata,
        sections: tuple[StateSection | None, StateSection | None, Training] | None = None,
        layout: _Layout | None = None,
        signer: Any = None,
    ) -> None:
        layout = layout or _Layout()
        if signer is not None and options.digest not in CRYPTOGRAPHIC_DIGESTS:
            raise UnsupportedValueError(
                f"signer= needs a cryptographic digest, not digest={options.digest!r}: a signature covers the "
                "data only through the digests (use 'blake3' or 'sha256')"
            )
        self.signer = signer
        self.private_key: Ed25519PrivateKey | None = None
        self.started = time.perf_counter()
        #: Set by ``async_save`` once the caller resumes; a synchronous save blocks throughout.
        self.blocked_seconds: float | None = None
        self.state = state
        self.location = location
        self.options = options
        self.coordinator = coordinator
        self.budget = budget or ByteBudget(options.byte_budget)
        if self.budget.limit != options.byte_budget:
            raise UnsupportedValueError("budget= must have the same limit as byte_budget=")
        self.progress = progress
        self.metadata = metadata
        self.sections = sections
        self.default_tiers = not layout.tiers
        self.tiers = check_tiers(layout.tiers) if layout.tiers else [Tier(tier_id=1, name=DEFAULT_TIER)]
        self.placement = layout.placement
        if layout.placement is not None and not layout.tiers:
            raise UnsupportedValueError("placement= needs tiers=: define the tiers the rules name")
        self.tier_stores = {
            tier.name: open_store(tier.location, layout.storage_options)
            for tier in self.tiers
            if tier.location is not None
        }
        if not isinstance(layout.incremental, (bool, str, os.PathLike)):
            raise UnsupportedValueError(
                f"incremental={layout.incremental!r} must be True, False, or the path of an earlier checkpoint"
            )
        if layout.tiers is not None and (
            isinstance(layout.tiers, (str, bytes)) or not isinstance(layout.tiers, Sequence)
        ):
            raise UnsupportedValueError("tiers= must be a list of shardkeep.Tier")
        self.incremental = layout.incremental is not False
        self.base: CheckpointLocation | None = None
        if layout.incremental is not False and layout.incremental is not True:
            if options.compression:
                raise UnsupportedValueError("incremental saves cannot be compressed yet; pass compression=None")
            self.base = _sibling(layout.incremental, location, layout.storage_options)
        self.base_manifest: Manifest | None = None
        self.tier_of: dict[str, str] = {}
        self.flat = FlatState()
        self.planned: list[_Planned] = []
        self.plans: list[ShardPlan] = []
        self.commit: CheckpointCommit | None = None
        self.manifest: Manifest | None = None

    def _describe(self) -> list[ItemDescriptor]:
        with _collector_paused():
            self.flat = flatten_state(self.state)
            self.planned = [_Planned(leaf) for leaf in self.flat.tensors]
            return [item.descriptor for item in self.planned]

    def _begin(self) -> str | None:
        if not self.coordinator.is_coordinator:
            return None
        if self.signer is not None:
            self.private_key = load_private_key(self.signer)  # only the coordinator signs
        store = self.location.store
        for local in (store, *self.tier_stores.values()):
            if isinstance(local, LocalStore):
                _ensure_directory(local.root)
        opening = CheckpointCommit(store, self.location.name, tier_stores=self.tier_stores)
        opening.begin()
        return opening.staging

    def _sections_of(self) -> tuple[StateSection | None, StateSection | None, Training]:
        """Optimizer and router sections (as :func:`_manifest_for` records them)."""
        optim, router, training = _sections(self.state, [leaf.key for leaf in self.flat.tensors])
        if self.sections is not None:
            # An async save describes a snapshot: the optimizer section comes from the original state.
            optim, _, training = self.sections
        return optim, router, training

    def _place(self, held: list[list[ItemDescriptor]]) -> None:
        """Every tensor's tier, decided from the global list (the same on every rank)."""
        totals: dict[str, list[Any]] = {}
        seen: set[tuple[str, tuple[int, ...] | None]] = set()
        for items in held:
            for item in items:
                identity = (item.key, item.global_offset)
                if identity in seen:
                    continue  # a replicated tensor held by several ranks is written once
                seen.add(identity)
                entry = totals.setdefault(item.key, [0, item.dtype])
                entry[0] += item.nbytes
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
        return parse_manifest(read_manifest_bytes(self.base), where=str(self.base))

    def prepare(self) -> None:
        coordinator = self.coordinator
        held = coordinator.step("prepare the save", self._describe)
        if coordinator.distributed:
            mine = assign_writers(held)[coordinator.rank]
            planned_here = [p for p in self.planned if (p.leaf.key, _offset_key(p.global_offset)) in mine]
        else:
            planned_here = self.planned
        coordinator.step("place the tensors on tiers", lambda: self._place(held))
        staging = coordinator.step("begin the save", self._begin)[0]
        self.commit = CheckpointCommit(self.location.store, self.location.name, staging, tier_stores=self.tier_stores)
        if self.base is not None:
            self.base_manifest = coordinator.step("read the incremental base", self._read_base)[coordinator.rank]
        coordinator.step("lay out the files", lambda: self._lay_out(planned_here, held))

    def _lay_out(self, planned_here: list[_Planned], held: list[list[ItemDescriptor]]) -> None:
        coordinator = self.coordinator
        assert self.commit is not None
        optim, router, _ = self._sections_of()
        optim_prefixes = optim.prefixes if optim is not None else []
        router_prefixes = router.prefixes if router is not None else []
        sections: dict[str, str] = {}
        for item in planned_here:
            section = section_of(item.leaf.key, optim_prefixes, router_prefixes)
            if section != "model":
                sections[item.leaf.key] = section
        previous = _previous_files(self.base_manifest, self.tiers) if self.base_manifest is not None else {}
        records: list[FileRecord] = []
        with _collector_paused():
            by_tier: dict[str, list[_Planned]] = {}
            for item in planned_here:
                by_tier.setdefault(self.tier_of[item.leaf.key], []).append(item)
            for tier in self.tiers:
                groups = _plan_files(
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
                    header = self._lay_out_one(record, group, tier, previous)
                    records.append(record)
                    if header is None:
                        continue  # unchanged: the record references the earlier file
                    record.path, store, store_path = self.commit.place(record.path, tier.name)
                    self.plans.append(
                        ShardPlan(path=store_path, header=header, sources=group, record=record, store=store)
                    )
            self.manifest = _manifest_for(
                self.state,
                self.flat,
                records,
                held,
                world_size=coordinator.world_size,
                digest=self.options.digest,
                tiers=self.tiers,
                metadata=self.metadata,
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
        self, record: FileRecord, group: list[_Planned], tier: Tier, previous: dict[tuple[str, str], FileRecord]
    ) -> bytes | None:
        """Lay out one file; return its header, or ``None`` when the file equals the base
        checkpoint's file of the same name (which ``record`` then references)."""
        earlier = previous.get((tier.name, record.path))
        if earlier is not None and earlier.digest and earlier.compression is None:
            algorithm = earlier.digest.partition(":")[0]
            record.version = earlier.version
            header = _layout(record, group, tier.tier_id)
            if (
                algorithm == self.options.digest
                and digest_of(header, group, algorithm) == earlier.digest
                and self._base_file_present(earlier, tier)
            ):
                assert self.base is not None
                record.ref = earlier.ref or self.base.name
                record.path = earlier.path
                record.digest = earlier.digest
                return None
            record.version = earlier.version + 1
        return _layout(record, group, tier.tier_id)

    def write(self) -> list[FileRecord]:
        """Write this rank's files; return every record of this rank (written or referenced)."""
        assert self.manifest is not None
        # Never write what load would refuse: this rank's part of the manifest is checked first.
        if self.coordinator.is_coordinator or self.plans:
            errors = validate_manifest(self.manifest).errors
            if errors:
                raise UnsupportedValueError(f"cannot save {self.location}: " + "; ".join(errors[:5]))
        update, close = _progress_bar(
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
            )
        finally:
            close()
        return list(self.manifest.files)

    def finish(self, records: list[list[FileRecord]]) -> Manifest | None:
        if not self.coordinator.is_coordinator:
            return None
        manifest = self.manifest
        assert manifest is not None and self.commit is not None
        if self.coordinator.distributed:
            manifest.files = sorted((record for part in records for record in part), key=lambda r: r.path)
            manifest.sharding.shard_count = len(manifest.files)
            problems = validate_manifest(manifest).errors
        else:
            problems = []
        # Never commit what load would refuse: every tensor tiled exactly once, every leaf placed.
        problems += coverage_problems(manifest)
        if problems:
            raise UnsupportedValueError(f"cannot commit {self.location}: " + "; ".join(problems[:5]))
        for record in manifest.files:
            if record.ref is None and record.tier not in self.tier_stores and not self.commit.object_store:
                self.commit.staged(record.path)  # every rank's data directories are fsynced, not only ours
        total = time.perf_counter() - self.started
        blocked = total if self.blocked_seconds is None else min(self.blocked_seconds, total)
        manifest.timing = SaveTiming(blocked_seconds=round(blocked, 6), total_seconds=round(total, 6))
        with _collector_paused():
            sealed = seal_manifest(encode_manifest(manifest), self.options.digest)
        warn_if_over_read_limits(self.location, sealed, manifest)
        signature = sign_manifest(sealed, self.private_key, manifest) if self.private_key is not None else None
        self.commit.commit(sealed, signature)
        return manifest

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


class SaveHandle:
    """The result of :func:`async_save`: the state is already staged when you get one.

    ``done()`` tells whether the background write and commit have finished; ``result(timeout)``
    waits and returns the committed :class:`~shardkeep.manifest.Manifest`, or raises the
    failure with its own type (a :class:`~shardkeep.errors.CoordinationError` when ranks
    failed). ``wait_staged()`` returns at once: staging finished before ``async_save`` returned.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._finished = threading.Event()
        self._manifest: Manifest | None = None
        self._error: BaseException | None = None
        self.blocked_seconds = 0.0

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self._error else "committed")
        return f"SaveHandle({self.path!r}, {state})"

    def wait_staged(self, timeout: float | None = None) -> bool:
        return True

    def done(self) -> bool:
        return self._finished.is_set()

    def result(self, timeout: float | None = None) -> Manifest:
        if not self._finished.wait(timeout):
            raise SaveInProgressError(f"the save of {self.path} is still running after {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._manifest is not None
        return self._manifest

    def _complete(self, manifest: Manifest | None, error: BaseException | None) -> None:
        self._manifest = manifest
        self._error = error
        self._finished.set()


_submit_lock = threading.Lock()
_inflight: SaveHandle | None = None
_arena = StagingArena()


def async_save(
    state: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    wait: bool = True,
    staging_budget: int | None = None,
    digest: str = "blake3",
    byte_budget: int = SaveOptions.byte_budget,
    io_threads: int = SaveOptions.io_threads,
    file_size_target: int = SaveOptions.file_size_target,
    compression: str | None = None,
    compression_level: int = SaveOptions.compression_level,
    model_id: str | None = None,
    step: int | None = None,
    epoch: int | None = None,
    training: Mapping[str, Any] | None = None,
    sharding_strategy: str | None = None,
    custom_fields: Mapping[str, Any] | None = None,
    metrics: Mapping[str, float | None] | None = None,
    run: RunInfo | None = None,
    storage: ByteStore | None = None,
    storage_options: Mapping[str, Any] | None = None,
    tiers: Sequence[Tier] | None = None,
    placement: Placement | None = None,
    incremental: bool | str | os.PathLike[str] = False,
    signer: Any = None,
    process_group: Any = None,
    timeout: float = DEFAULT_TIMEOUT,
    after_commit: Callable[[Manifest], None] | None = None,
    started: float | None = None,
) -> SaveHandle:
    """Snapshot ``state`` into reusable host buffers, then write and commit in the background.

    Returns once the snapshot is taken: training may change its tensors at once without
    changing what is saved. Options are those of :func:`save`. At most one save is in flight
    per process: a second call waits for the first (``wait=True``) or raises
    :class:`~shardkeep.errors.SaveInProgressError`. ``staging_budget`` (bytes) refuses states
    larger than that instead of growing the staging buffer.

    With several ranks, every rank calls ``async_save``; the collectives (planning, opening the
    staging directory) run here, on the caller's thread. The background thread runs none: each
    rank posts its outcome to the process group's key-value store, and the coordinator commits
    once every rank has reported (or fails at the ``timeout`` deadline).

    ``after_commit``, if given, is called on every rank in the background thread with the
    committed manifest before the handle completes; an exception from it becomes the handle's
    error (the checkpoint manager runs retention there).

    ``started`` (a ``time.perf_counter()`` value; default: now) is when the caller's pause
    began, for the manifest's ``timing``: the checkpoint manager passes the start of its own
    ``async_save``.
    """
    started = time.perf_counter() if started is None else started
    # One save at a time, from the snapshot until the handle is registered: two threads must
    # never stage into the shared arena together.
    if not _submit_lock.acquire(blocking=wait, timeout=timeout if wait else -1):
        raise SaveInProgressError("another async_save is staging in this process; pass wait=True to queue")
    try:
        return _submit(
            state,
            path,
            started=started,
            wait=wait,
            staging_budget=staging_budget,
            options=SaveOptions(
                digest=digest,
                byte_budget=byte_budget,
                io_threads=io_threads,
                file_size_target=file_size_target,
                compression=compression,
                compression_level=compression_level,
            ),
            metadata=_SaveMetadata(
                model_id, step, epoch, training, sharding_strategy, custom_fields, _metric_values(metrics), run
            ),
            storage=storage,
            layout=_Layout(tiers, placement, incremental, storage_options),
            signer=signer,
            process_group=process_group,
            timeout=timeout,
            after_commit=after_commit,
        )
    finally:
        _submit_lock.release()


def _submit(
    state: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    started: float,
    wait: bool,
    staging_budget: int | None,
    options: SaveOptions,
    metadata: _SaveMetadata,
    storage: ByteStore | None,
    layout: _Layout,
    signer: Any,
    process_group: Any,
    timeout: float,
    after_commit: Callable[[Manifest], None] | None,
) -> SaveHandle:
    """The body of :func:`async_save`, run while holding ``_submit_lock``."""
    global _inflight
    previous = _inflight
    if previous is not None and not previous.done():
        if not wait:
            raise SaveInProgressError(f"a save of {previous.path} is still in flight; pass wait=True to queue")
        if not previous._finished.wait(timeout):
            raise SaveInProgressError(f"the previous save of {previous.path} is still running after {timeout:.0f} s")
    coordinator = Coordinator(process_group, timeout=timeout)
    location = locate(path, storage, layout.storage_options)
    staged: dict[str, Any] = {}

    def stage() -> None:
        nonlocal staged
        with _collector_paused():
            staged = snapshot_state(state, _arena, budget=staging_budget)

    coordinator.step("stage the state", stage)
    job = _SaveJob(
        staged,
        location,
        options,
        coordinator,
        budget=None,
        progress=False,
        metadata=metadata,
        sections=_sections(state, []),
        layout=layout,
        signer=signer,
    )
    job.started = started
    try:
        job.prepare()
    except BaseException:
        job.abort()
        raise
    handle = SaveHandle(str(location))
    _inflight = handle
    worker = threading.Thread(
        target=_finish_in_background, args=(job, handle, after_commit), name="shardkeep-async-save"
    )
    job.blocked_seconds = handle.blocked_seconds = time.perf_counter() - started
    worker.start()
    return handle


def _finish_in_background(
    job: _SaveJob, handle: SaveHandle, after_commit: Callable[[Manifest], None] | None = None
) -> None:
    """Write this rank's files and complete the commit without any collective, then run
    ``after_commit``. The handle is always completed, even when cleaning up after a failure
    fails too."""
    manifest: Manifest | None = None
    error: BaseException | None = None
    try:
        if job.coordinator.distributed:
            manifest = _finish_through_store(job)
        else:
            try:
                manifest = job.finish([job.write()])
            except BaseException:
                job.abort()
                raise
        if after_commit is not None:
            assert manifest is not None
            after_commit(manifest)
    except BaseException as exc:
        error = exc
    finally:
        handle._complete(manifest, error)


def _finish_through_store(job: _SaveJob) -> Manifest:
    """Exchange outcomes through the process group's key-value store: every rank posts its
    records or its error; the coordinator waits for all (with the deadline), commits or aborts,
    and posts the result, which the other ranks wait for."""
    import pickle

    from torch.distributed import distributed_c10d

    coordinator = job.coordinator
    store = distributed_c10d._get_default_store()
    assert job.commit is not None
    prefix = f"shardkeep/{job.commit.staging}"
    deadline = _dt.timedelta(seconds=coordinator.timeout)
    try:
        outcome: tuple[str, Any] = ("ok", job.write())
    except Exception as exc:
        outcome = ("error", f"{type(exc).__name__}: {exc}")
    store.set(f"{prefix}/rank{coordinator.rank}", pickle.dumps(outcome))  # type: ignore[arg-type]  # Store.set takes bytes too
    result: tuple[str, Any]
    if coordinator.is_coordinator:
        try:
            keys = [f"{prefix}/rank{rank}" for rank in range(coordinator.world_size)]
            store.wait(keys, deadline)
            outcomes = [pickle.loads(store.get(key)) for key in keys]
            for key in keys:
                store.delete_key(key)
            failures = {rank: text for rank, (kind, text) in enumerate(outcomes) if kind == "error"}
            if failures:
                raise CoordinationError(
                    f"writing the shards failed on rank(s) {sorted(failures)} of {coordinator.world_size}: "
                    + "; ".join(f"rank {rank}: {text}" for rank, text in failures.items()),
                    failures,
                )
            manifest = job.finish([records for _, records in outcomes])
            assert manifest is not None
            result = ("ok", None)  # a small key: the other ranks read the committed manifest
        except BaseException as exc:
            failures = exc.failures if isinstance(exc, CoordinationError) else {0: f"{type(exc).__name__}: {exc}"}
            message = str(exc) if isinstance(exc, CoordinationError) else f"committing failed on rank 0: {exc}"
            if "deadline" not in message and not isinstance(exc, ShardkeepError):
                message = f"{message} (a rank may have missed the {coordinator.timeout:.0f} s deadline)"
            try:
                job.abort()
            except ShardkeepError as cleanup:
                message = f"{message}; removing the staging directory failed too: {cleanup}"
            result = ("error", (message, failures))
        store.set(f"{prefix}/result", pickle.dumps(result))  # type: ignore[arg-type]  # Store.set takes bytes too
        _await_acknowledgements(store, prefix, coordinator.world_size, deadline)
        if result[0] == "ok":
            return cast(Manifest, job.manifest)
    else:
        try:
            # The coordinator may spend up to one deadline waiting for the slowest rank and then
            # commit: wait for two, so a slow but successful commit is not reported as failed.
            store.wait([f"{prefix}/result"], 2 * deadline)
            result = pickle.loads(store.get(f"{prefix}/result"))
            store.set(f"{prefix}/ack{coordinator.rank}", b"1")  # type: ignore[arg-type]  # Store.set takes bytes too
        except Exception as exc:
            raise CoordinationError(
                f"the coordinator did not report the outcome within twice the {coordinator.timeout:.0f} s "
                f"deadline; the checkpoint may or may not have been committed ({exc})"
            ) from exc

    if result[0] == "ok":
        return read_manifest(job.location.name, storage=job.location.store)
    error_message, error_failures = cast(tuple[str, dict[int, str]], result[1])
    raise CoordinationError(error_message, error_failures)


def _await_acknowledgements(store: Any, prefix: str, world_size: int, deadline: _dt.timedelta) -> None:
    """The coordinator hosts the key-value store in the usual TCP setup: before its handle
    completes (after which the process may exit), wait until every other rank has read the
    outcome. A rank that never acknowledges is not waited for beyond the deadline."""
    keys = [f"{prefix}/ack{rank}" for rank in range(1, world_size)]
    with contextlib.suppress(Exception):
        store.wait(keys, deadline)
    with contextlib.suppress(Exception):
        for key in [*keys, f"{prefix}/result"]:
            store.delete_key(key)


def _sibling(
    path: str | os.PathLike[str], location: CheckpointLocation, storage_options: Mapping[str, Any] | None
) -> CheckpointLocation:
    """The incremental base: a checkpoint in the same root as the one being saved (files are
    referenced by checkpoint name, so both must live side by side)."""
    text = os.fspath(path)
    if "/" not in text and os.sep not in text and "://" not in text:
        return CheckpointLocation(location.store, text)  # a name in the same root
    base = locate(text, None, storage_options)
    ours, theirs = getattr(location.store, "root", None), getattr(base.store, "root", None)
    if ours is None or ours != theirs:
        raise UnsupportedValueError(
            f"incremental={text!r} must be a checkpoint in the same root as {location} (its files are referenced by name)"
        )
    return CheckpointLocation(location.store, base.name)


def _logical(path: str) -> str:
    """A data file's path without the attempt prefix object stores and tier locations add."""
    first, _, rest = path.partition("/")
    return rest if first.startswith(ATTEMPT_PREFIX) and rest else path


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
    state: Mapping[str, Any],
    flat: FlatState,
    records: list[FileRecord],
    held: list[list[ItemDescriptor]],
    *,
    world_size: int,
    digest: str,
    tiers: list[Tier],
    metadata: _SaveMetadata,
    sections: tuple[StateSection | None, StateSection | None, Training] | None,
) -> Manifest:
    """The manifest of this save, with this rank's file records (the coordinator merges all)."""
    optim, router, detected = _sections(state, [leaf.key for leaf in flat.tensors])
    if sections is not None:
        # An async save describes a snapshot, where modules and optimizers are plain dicts: the
        # optimizer section and training fields come from the caller's original state.
        optim, _, detected = sections
    chunked = any(item.global_offset is not None for items in held for item in items)
    strategy = metadata.sharding_strategy or ("dtensor" if chunked else "replicated" if world_size > 1 else "none")
    return Manifest(
        model_id=metadata.model_id,
        step=metadata.step,
        epoch=metadata.epoch,
        world_size=world_size,
        digest_algorithm=digest,
        sharding=Sharding(strategy=strategy, shard_count=len(records), precision=_precision(held)),
        training=_training_fields(metadata.training, detected),
        tiers=tiers,
        files=records,
        optim_state=optim,
        router_state=router,
        structure=flat.containers,
        values=flat.values,
        custom_fields=_plain_json_mapping("custom_fields", metadata.custom_fields),
        metrics=metadata.metrics,
        run=metadata.run,
    )


def _metric_values(metrics: Mapping[str, Any] | None) -> dict[str, float | None]:
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


def _precision(held: list[list[ItemDescriptor]]) -> str | None:
    """The floating-point dtype holding the most bytes, as fp32/bf16/fp16/fp64/fp8."""
    float_bytes: dict[str, int] = {}
    for items in held:
        for item in items:
            if item.dtype in _PRECISION:
                float_bytes[item.dtype] = float_bytes.get(item.dtype, 0) + item.nbytes
    return _PRECISION[max(float_bytes, key=float_bytes.__getitem__)] if float_bytes else None


# --------------------------------------------------------------------------------------------
# load
# --------------------------------------------------------------------------------------------


SECTIONS = ("model", "optim", "router")


def load(
    path: str | os.PathLike[str],
    into: Any = None,
    *,
    verify: bool = True,
    mmap: bool = True,
    io_threads: int = LoadOptions.io_threads,
    progress: bool = False,
    storage: ByteStore | None = None,
    limits: ManifestLimits | None = None,
    storage_options: Mapping[str, Any] | None = None,
    tiers: Iterable[str] | None = None,
    sections: Iterable[str] | None = None,
    lazy: bool = False,
    tier_locations: TierLocations | None = None,
    public_key: Any = None,
    require_signature: bool | None = None,
) -> Any:
    """Load the checkpoint at ``path`` (a local path or a URL such as ``s3://bucket/p/step_1``).

    Without ``into``, returns the saved state as a new nested dict (tensors view the files'
    memory maps when ``mmap``; writes to them never reach the files). With ``into``, fills that
    state in place (tensors are copied into, objects get ``load_state_dict``) and returns it.
    With ``verify`` (the default) the file set, every size, digest, version and shard header are
    checked before any tensor is built or any target modified.

    ``tiers`` (tier names) and ``sections`` (``"model"``, ``"optim"``, ``"router"``) select a
    part of the checkpoint: only the files holding it are read. Tensors left out are absent from
    the result (``None`` inside lists), or, with ``lazy=True``, :class:`~shardkeep.lazy.LazyTensor`
    placeholders that read and verify their file on first use. With ``into``, a partial load
    fills only what it read and leaves the rest of ``into`` as it is. ``tier_locations`` maps a
    tier name to where its files are now (a path, URL or byte store), for a tier that moved.

    ``public_key`` (an ``Ed25519PublicKey`` or the path of a PEM file): ``manifest.sig`` must
    be a valid signature by that key, checked before the manifest is parsed; since every file
    is then checked against the signed digests, the signature covers the data. An unsigned
    checkpoint is refused unless ``require_signature=False``. Raises
    :class:`~shardkeep.errors.SignatureError` otherwise.
    """
    options = LoadOptions(verify=verify, mmap=mmap, io_threads=io_threads)
    if lazy and into is not None:
        raise UnsupportedValueError("lazy=True returns placeholders; it cannot fill into= (load the tiers you need)")
    policy = SignaturePolicy.of(public_key, require_signature)
    if policy.public_key is not None and not options.verify:
        raise ConfigError(
            "public_key= with verify=False: the signature covers the data only through the digests, "
            "which verify=False does not check"
        )
    location = locate(path, storage, storage_options)
    with _collector_paused():
        manifest = read_checked_manifest(location, policy, limits)
    selected = set(select_files(manifest, tiers))
    wanted_sections = _check_sections(sections)
    resolver = FileResolver(location, manifest, tier_locations=tier_locations, storage_options=storage_options)
    partial = len(selected) < len(manifest.files) or wanted_sections is not None
    problems: list[str] = []
    if options.verify:
        problems.extend(file_set_problems(location, manifest, resolver=resolver))

    wanted = wanted_regions(into, manifest) if into is not None else {}
    needed: list[list[int] | None] = []
    section_of = _section_function(manifest)
    for index, record in enumerate(manifest.files):
        entries = needed_entries(record, wanted)
        if index not in selected:
            entries = []
        elif wanted_sections is not None:
            keep = [
                i
                for i in (range(len(record.tensors)) if entries is None else entries)
                if section_of(record.tensors[i].key) in wanted_sections
            ]
            entries = None if entries is None and len(keep) == len(record.tensors) else keep
        needed.append(entries)
    update, close = _progress_bar(
        sum(r.size for i, r in enumerate(manifest.files) if needed[i] != []), f"load {location.name}", progress
    )

    def read(index: int) -> tuple[memoryview | None, list[str]]:
        record = manifest.files[index]
        if needed[index] == []:
            return None, []  # not selected, or nothing in it overlaps what this rank loads
        store, where = resolver(record)
        buffer, found = check_shard(
            store,
            where,
            record,
            verify=options.verify,
            keep=True,
            use_mmap=options.mmap,
            needed=needed[index],
            on_bytes=update,
        )
        return buffer, resolver.annotate(record, found)

    try:
        with ThreadPoolExecutor(
            max(1, min(options.io_threads, len(manifest.files) or 1)), thread_name_prefix="shardkeep-read"
        ) as pool:
            results = list(pool.map(read, range(len(manifest.files))))
    finally:
        close()
    for _, file_problems in results:
        problems.extend(file_problems)
    if problems:
        raise IntegrityError(f"checkpoint {location} failed verification: " + "; ".join(problems), problems)

    with _collector_paused():
        tensors: list[tuple[list[str | int], int, Any]] = []
        chunks: dict[str, list[tuple[TensorEntry, Any]]] = {}
        loaded_keys: set[str] = set()
        skipped: dict[str, tuple[TensorEntry, int]] = {}
        for index, (record, (buffer, _), wanted_here) in enumerate(zip(manifest.files, results, needed, strict=True)):
            chosen = (range(len(record.tensors)) if wanted_here is None else wanted_here) if buffer is not None else ()
            if partial:
                picked = set(chosen)
                for position, entry in enumerate(record.tensors):
                    if position not in picked:
                        skipped.setdefault(entry.key, (entry, index))
            for position in chosen:
                assert buffer is not None
                entry = record.tensors[position]
                loaded_keys.add(entry.key)
                array = array_from_buffer(
                    buffer, entry.dtype, entry.shape, entry.offset, entry.nbytes, entry.array_type, entry.key
                )
                if entry.global_offset is None:
                    tensors.append((entry.path, entry.order, array))
                else:
                    chunks.setdefault(entry.key, []).append((entry, array))
        for key, parts in chunks.items():
            tensors.append(assemble(parts, wanted.get(key)))
        absent = {key: found for key, found in skipped.items() if key not in loaded_keys}
        for key in wanted.keys() - chunks.keys():
            if key in absent:
                continue  # on a tier or in a section this partial load leaves out
            # This rank's region is empty (fewer rows than ranks): no chunk overlaps it.
            first = next(entry for _, entry in manifest.iter_tensors() if entry.key == key)
            assert first.global_shape is not None
            offset, shape = wanted[key]
            tensors.append((first.path, first.order, Region([], offset, shape, first.global_shape, first.dtype)))
        tensors.extend(_placeholders(manifest, absent, resolver, lazy=lazy, verify=options.verify))
        loaded = rebuild_state(manifest.structure, manifest.values, tensors)
        if absent and not lazy:
            _drop_absent(loaded, [entry for entry, _ in absent.values()])
    if into is None:
        return loaded
    fill_into(into, loaded, partial=partial, absent=frozenset(absent))
    return into


def _check_sections(sections: Iterable[str] | None) -> set[str] | None:
    if sections is None:
        return None
    if not isinstance(sections, (str, Iterable)):
        raise UnsupportedValueError(f"sections={sections!r} must be a set of names from {list(SECTIONS)}")
    chosen = {sections} if isinstance(sections, str) else set(sections)
    unknown = sorted(chosen - set(SECTIONS))
    if unknown:
        raise UnsupportedValueError(
            f"sections={sorted(chosen)}: unknown section(s) {unknown}; choose from {list(SECTIONS)}"
        )
    return chosen


def _section_function(manifest: Manifest) -> Callable[[str], str]:
    optim = manifest.optim_state.prefixes if manifest.optim_state is not None else []
    router = manifest.router_state.prefixes if manifest.router_state is not None else []
    return lambda key: section_of(key, optim, router)


def _placeholders(
    manifest: Manifest,
    absent: dict[str, tuple[TensorEntry, int]],
    resolver: FileResolver,
    *,
    lazy: bool,
    verify: bool,
) -> list[tuple[list[str | int], int, Any]]:
    """Leaves for tensors a partial load left out: lazy placeholders, or ``None`` (removed
    again from mappings by :func:`_drop_absent`; kept inside lists so indices stay right)."""
    result: list[tuple[list[str | int], int, Any]] = []
    files: dict[int, Any] = {}
    for key, (entry, index) in absent.items():
        if entry.global_offset is not None and lazy:
            raise UnsupportedValueError(
                f"tensor {key!r} is stored in chunks; lazy loading of sharded tensors is not supported"
            )
        if lazy:
            from shardkeep.lazy import LazyFile, LazyTensor

            if index not in files:
                store, where = resolver(manifest.files[index])
                files[index] = LazyFile(
                    store,
                    where,
                    manifest.files[index],
                    verify=verify,
                    describe=resolver.describe(manifest.files[index]),
                )
            position = next(i for i, e in enumerate(manifest.files[index].tensors) if e is entry)
            result.append((entry.path, entry.order, LazyTensor(files[index], position)))
        else:
            result.append((entry.path, entry.order, None))
    return result


def _drop_absent(loaded: dict[str, Any], absent: list[TensorEntry]) -> None:
    """Remove the ``None`` placeholders of absent tensors from mappings (lists keep them)."""
    for entry in absent:
        node: Any = loaded
        for part in entry.path[:-1]:
            node = node[part]
        if isinstance(node, dict) and node.get(entry.path[-1], 0) is None:
            del node[entry.path[-1]]
