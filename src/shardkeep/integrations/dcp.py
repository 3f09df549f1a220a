"""The adapter for PyTorch's distributed checkpoint (DCP) API: a ``StorageWriter`` and a
``StorageReader`` that make ``dcp.save``, ``dcp.async_save`` and ``dcp.load`` write and read real
shardkeep checkpoints.

``ShardkeepWriter(path)`` writes each rank's items as safetensors files under ``shards/`` of a
staging directory that the coordinator opens in ``prepare_global_plan`` (its name reaches every
rank in its plan's ``storage_data``), with a digest computed while writing and every file
fsynced (:func:`shardkeep.writes.write_shards`); in ``finish`` the coordinator writes the manifest
last, optionally signs it, and commits (:class:`~shardkeep.distributed.commit.CheckpointCommit`).
The result is an ordinary 1.x checkpoint (``metadata_version`` 1.4, or 1.3 with
``WriteOptions(block_size=0)``) that ``shardkeep verify`` and
``sk.load`` read:

- a whole tensor (DCP ``TENSOR`` item) is one tensor entry;
- a chunk of a sharded tensor (DCP ``SHARD`` item: a DTensor's local shard) is a chunk entry
  with ``global_shape``, ``global_offset`` and block digests of its own (a digest of its own
  with ``block_size=0``), in
  ``shards/rank_NNNNN_chunks.safetensors``;
- a non-tensor value (DCP ``BYTE_IO`` item: bytes that DCP's planner made with ``torch.save``
  from a local object) is decoded with the restricted unpickler (``weights_only=True``) and,
  when it is plain JSON-able data (``None``, bools, ints, floats including inf and nan,
  strings, lists, tuples and dicts of those: optimizer ``param_groups`` entries, step counters),
  stored as the manifest's JSON values and containers, like an ``sk.save`` value; anything else
  is stored as opaque ``U8`` data under its key and listed in ``custom_fields["dcp"]["bytes"]``
  (``sk.load`` returns it as a uint8 tensor, never unpickled);
- DCP's ``planner_data`` (each key's nested path) is kept as JSON in
  ``custom_fields["dcp"]["planner_data"]`` and as each entry's ``path``.

``ShardkeepReader(path)`` rebuilds DCP's ``Metadata`` from the manifest (of a checkpoint written
by this writer or by ``sk.save``) and reads only the files a rank's plan needs, each checked
before any value is handed to the planner: a file's digest when it is read whole, each chunk's
own digest when only some chunks of it are read (:func:`shardkeep.io.check_shard`). Non-tensor
values reach the planner as bytes the reader builds itself from the manifest's JSON; opaque
byte items, which DCP's planner would unpickle (``torch.load(..., weights_only=False)``), are
refused unless ``trust_pickle=True``.

A failed save removes what it wrote as far as DCP's hooks allow: see :class:`ShardkeepWriter`.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from shardkeep.config import ManifestLimits, WriteOptions
from shardkeep.distributed.commit import CheckpointCommit
from shardkeep.errors import ConfigError, IntegrityError, ManifestError, StateMismatchError, UnsupportedValueError
from shardkeep.integrity import SignaturePolicy, load_private_key
from shardkeep.io import check_shard
from shardkeep.layout import (
    WHOLE_TENSOR_BLOCK_SIZE,
    PlannedItem,
    assign_blocks,
    chunk_block_size,
    file_header,
    plan_files,
)
from shardkeep.manifest import ContainerEntry, FileRecord, Manifest, Tier, ValueEntry, key_for_path
from shardkeep.options import ManifestFields, regroup
from shardkeep.saving.job import ensure_directory
from shardkeep.saving.manifest_build import (
    DEFAULT_TIER,
    RecordedFields,
    commit_manifest,
    metadata_version,
    new_manifest,
    plain_json_mapping,
    precision_of,
    require_cryptographic_digest,
    state_sections,
)
from shardkeep.storage import LocalStore
from shardkeep.tensors.convert import NAME_TO_TORCH, array_from_buffer
from shardkeep.tensors.flatten import TensorLeaf, flatten_state, is_manifest_value, rebuild_state
from shardkeep.verification import CheckpointLocation, FileResolver, locate, read_checked_manifest
from shardkeep.writes import ByteBudget, ShardPlan, write_shards

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from shardkeep.options import Signer

__all__ = ["DCP_FIELD", "ShardkeepReader", "ShardkeepWriter", "dcp_to_torch_save"]

#: The ``custom_fields`` member that records what the DCP writer adds to a manifest.
DCP_FIELD = "dcp"
_TIER = Tier(tier_id=1, name=DEFAULT_TIER)
_RECORDS = msgspec.msgpack.Encoder()
_RECORDS_DECODER = msgspec.msgpack.Decoder(list[FileRecord])
#: One DCP byte item stored as JSON: its containers and values, with paths under ``["v"]``.
_JsonItem = tuple[list[ContainerEntry], list[ValueEntry]]
_JSON_ITEM_DECODER = msgspec.msgpack.Decoder(_JsonItem)


@dataclasses.dataclass(frozen=True)
class _PlanData:
    """A save plan's ``storage_data``: the staging name the coordinator opened."""

    staging: str


@dataclasses.dataclass(frozen=True)
class _Written:
    """A write result's ``storage_data``: where the item went (``value``: a byte item stored as
    JSON, its containers and values in msgpack); the first result of a rank also carries that
    rank's file records (msgpack), for the coordinator's manifest."""

    path: str | None
    records: bytes | None = None
    value: bytes | None = None


@dataclasses.dataclass(frozen=True)
class _Stored:
    """Where the reader finds one item: an entry of a file, or a JSON value of the manifest."""

    kind: Literal["tensor", "bytes", "value", "container"]
    file: int
    entry: int


def _checkpoint_path(path: str | os.PathLike[str]) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise UnsupportedValueError(f"the checkpoint path must be a string or path, not {type(path).__name__}")
    return os.fspath(path)


#: The keyword spellings of the previous release that ``ShardkeepWriter`` still accepts.
_WRITER_LEGACY = (
    "digest",
    "io_threads",
    "byte_budget",
    "file_size_target",
    "storage_options",
    "model_id",
    "epoch",
    "custom_fields",
)


class ShardkeepWriter(StorageWriter):
    """A DCP ``StorageWriter`` that commits a shardkeep checkpoint at ``path``.

    ``options`` (a :class:`~shardkeep.config.WriteOptions`: digest, I/O threads, byte budget,
    file size, fsspec ``storage_options``; no compression), ``fields`` (a
    :class:`~shardkeep.options.ManifestFields`: model id, epoch, custom fields), ``step`` and
    ``signer`` (an Ed25519 private key or the path of a PEM file; it needs a cryptographic
    digest) are those of ``sk.save``, and what they record is recorded in the manifest. A committed checkpoint is never overwritten: constructing a writer
    (or ``reset`` with a checkpoint id) for an existing checkpoint raises
    :class:`~shardkeep.errors.CheckpointExistsError`; a checkpoint that appears while the save
    runs makes the commit fail (DCP reports it wrapped in its ``CheckpointException``).

    DCP's non-tensor items (``BYTE_IO``: ``torch.save`` bytes from DCP's planner) are decoded
    here with ``torch.load(..., weights_only=True)``; a plain JSON-able value (``None``, bools,
    ints, floats including inf and nan, strings, and lists, tuples and dicts of those) is stored
    as JSON in the manifest, which :class:`ShardkeepReader` turns back into bytes itself. Only
    other values stay opaque bytes, which the reader refuses unless ``trust_pickle=True``.

    DCP's plan caching (``DefaultSavePlanner(enable_plan_caching=True)``) is refused with an
    :class:`~shardkeep.errors.UnsupportedValueError`: a cached plan carries an earlier save's
    staging directory.

    A failed save cleans up after itself as far as DCP's hooks allow (DCP calls no abort hook,
    and never calls ``finish`` when ``write_data`` failed on any rank): a rank whose
    ``write_data`` fails removes the files it wrote before re-raising; on one rank the
    coordinator also removes the staging directory then. With several ranks, the coordinator
    removes the staging directory (what other ranks wrote included) when the writer is
    ``reset``, plans its next save, or is garbage-collected (or at a normal interpreter exit),
    since only then is every rank known to be done writing.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        step: int | None = None,
        options: WriteOptions | None = None,
        fields: ManifestFields | None = None,
        signer: Signer | None = None,
        **legacy: Any,
    ) -> None:
        super().__init__()
        groups = regroup("ShardkeepWriter", legacy, options=options, fields=fields, accepted=_WRITER_LEGACY)
        self.options = groups.options
        digest, recorded = groups.options.digest, groups.fields
        for name, value in (
            ("options=WriteOptions(compression", self.options.compression),
            ("fields=ManifestFields(training", recorded.training),
            ("fields=ManifestFields(sharding_strategy", recorded.sharding_strategy),
            ("fields=ManifestFields(metrics", recorded.metrics),
        ):
            if value is not None:
                raise ConfigError(f"ShardkeepWriter does not take {name}=...)")
        require_cryptographic_digest(signer, digest)
        custom_fields = plain_json_mapping("custom_fields", recorded.custom_fields)
        if DCP_FIELD in custom_fields:
            raise UnsupportedValueError(f"custom_fields[{DCP_FIELD!r}] is reserved for the DCP adapter's own record")
        self.custom_fields = custom_fields
        self.signer = signer
        self.model_id, self.step, self.epoch = recorded.model_id, step, recorded.epoch
        self.storage_options = self.options.storage_options
        self.path = _checkpoint_path(path)
        self.is_coordinator = False
        self.rank = 0
        self._commit: CheckpointCommit | None = None
        self._pending: weakref.finalize[Any, Any] | None = None  # aborts _commit if the writer is dropped
        self._ranks = 0  # how many ranks write the pending save (len of DCP's global plan)
        self._private_key: Ed25519PrivateKey | None = None
        self._refuse_existing()

    # -- DCP's calls, in order ------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Forget the previous save; on the coordinator, remove the staging directory of a save
        that failed before its ``finish`` (DCP calls no abort hook)."""
        self._abort_pending()
        if checkpoint_id is not None:
            self.path = _checkpoint_path(checkpoint_id)
            self._refuse_existing()
        self._private_key = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        if rank is None:
            rank = torch.distributed.get_rank() if _distributed() else 0
        self.rank = int(rank)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """On the coordinator: refuse an existing checkpoint, load the signing key, and open the
        staging directory, whose name every rank's plan carries (a previous save of this writer
        that failed before its ``finish`` is aborted first)."""
        self._abort_pending()
        if any(not plan.usable for plan in plans):
            raise UnsupportedValueError(_PLAN_CACHING)
        location = self._location()
        if self.signer is not None:
            self._private_key = load_private_key(self.signer)
        if isinstance(location.store, LocalStore):
            ensure_directory(location.store.root)
        commit = CheckpointCommit(location.store, location.name)
        commit.begin()
        self._commit = commit
        self._ranks = len(plans)
        # DCP never calls finish after a failed write: abort when this writer is dropped.
        self._pending = weakref.finalize(self, _abort_quietly, commit)
        return [dataclasses.replace(plan, storage_data=_PlanData(commit.staging)) for plan in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items into its files in the staging directory (digests while
        writing, each file fsynced); the first result carries this rank's file records."""
        if not isinstance(plan.storage_data, _PlanData):
            raise UnsupportedValueError(
                "ShardkeepWriter.write_data got a plan without the staging directory: the save plan must come "
                "from this writer's prepare_global_plan"
            )
        location = self._location()
        commit = CheckpointCommit(location.store, location.name, plan.storage_data.staging)
        shard_plans: list[ShardPlan] = []
        try:
            if getattr(planner, "_enable_plan_caching", False):
                raise UnsupportedValueError(_PLAN_CACHING)
            results = self._write(plan, planner, location, commit, shard_plans)
        except BaseException:
            self._discard(location, commit, shard_plans)
            raise
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _write(
        self,
        plan: SavePlan,
        planner: SavePlanner,
        location: CheckpointLocation,
        commit: CheckpointCommit,
        shard_plans: list[ShardPlan],
    ) -> list[WriteResult]:
        items: list[PlannedItem] = []
        sizes: list[tuple[WriteItem, PlannedItem | bytes | None]] = []
        for write_item in plan.items:
            data = planner.resolve_data(write_item)
            stored: PlannedItem | bytes | None = None
            if write_item.type == WriteItemType.BYTE_IO and isinstance(data, io.BytesIO):
                stored = _json_item(data.getvalue())
            if stored is None:
                stored = _planned(write_item, data)
            sizes.append((write_item, stored))
            if isinstance(stored, PlannedItem):
                items.append(stored)
        records: list[FileRecord] = []
        where: dict[int, str] = {}
        chunk_block, whole_block = _block_sizes(self.options, items)
        for record, group in plan_files(
            items, rank=self.rank, target=self.options.file_size_target, tier=_TIER.name, tier_id=_TIER.tier_id
        ):
            assign_blocks(record, group, chunk_block if any(item.wants_digest for item in group) else whole_block)
            header = file_header(record, group, _TIER.tier_id)
            record.path, store, store_path = commit.place(record.path)
            shard_plans.append(ShardPlan(path=store_path, header=header, sources=group, record=record, store=store))
            records.append(record)
            where.update((id(item), record.path) for item in group)
        write_shards(
            location.store,
            shard_plans,
            algorithm=self.options.digest,
            budget=ByteBudget(self.options.byte_budget),
            io_threads=self.options.io_threads,
            fast=self.options.block_size != 0,
        )
        results = [
            WriteResult(
                index=write_item.index,
                size_in_bytes=stored.nbytes if isinstance(stored, PlannedItem) else 0,
                storage_data=_Written(where[id(stored)])
                if isinstance(stored, PlannedItem)
                else _Written(None, value=stored),
            )
            for write_item, stored in sizes
        ]
        if results:
            first = results[0]
            results[0] = dataclasses.replace(
                first, storage_data=dataclasses.replace(first.storage_data, records=_RECORDS.encode(records))
            )
        return results

    def _discard(self, location: CheckpointLocation, commit: CheckpointCommit, shard_plans: list[ShardPlan]) -> None:
        """After this rank's write failed: remove the files it planned (written or not), so that
        nothing of this rank is left; DCP will not call ``finish``. On the coordinator of a
        one-rank save nobody else writes, so the whole staging directory goes as well."""
        for shard_plan in shard_plans:
            try:
                (shard_plan.store or location.store).remove_file(shard_plan.path)
            except Exception:  # the save is already failing; the lease collects what stays
                pass
        pending = self._commit
        if self.is_coordinator and self._ranks == 1 and pending is not None and pending.staging == commit.staging:
            self._abort_pending()

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """On the coordinator: build the manifest from every rank's records, check it (every
        chunked tensor tiled exactly once), write it last, sign it, and commit."""
        commit = self._commit
        if commit is None:
            raise UnsupportedValueError("ShardkeepWriter.finish was called without prepare_global_plan")
        try:
            manifest = self._manifest(metadata, results)
            commit_manifest(
                commit,
                manifest,
                location=self._location(),
                private_key=self._private_key,
                data_files=[record.path for record in manifest.files],
            )
        except BaseException:
            commit.abort()
            raise
        finally:
            self._commit = None
            self._forget_pending()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def __getstate__(self) -> dict[str, Any]:
        """A copy (pickled for another process, or deep-copied) never owns this writer's pending
        save: only the original aborts it."""
        state = dict(self.__dict__)
        state.update(_commit=None, _pending=None, _ranks=0, _private_key=None)
        return state

    # -- helpers -------------------------------------------------------------------------------
    def _location(self) -> CheckpointLocation:
        return locate(self.path, None, self.storage_options)

    def _forget_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.detach()

    def _abort_pending(self) -> None:
        """On the coordinator: abort the save whose ``finish`` was never reached (removing its
        staging directory, with every rank's files); a failure to remove is left to the lease."""
        commit, self._commit = self._commit, None
        self._forget_pending()
        if commit is not None:
            _abort_quietly(commit)

    def _refuse_existing(self) -> None:
        location = self._location()
        CheckpointCommit(location.store, location.name).begin()  # raises CheckpointExistsError

    def _manifest(self, metadata: Metadata, results: list[list[WriteResult]]) -> Manifest:
        records: list[FileRecord] = []
        for rank_results in results:
            for result in rank_results[:1]:
                data = result.storage_data
                if isinstance(data, _Written) and data.records:
                    records.extend(_RECORDS_DECODER.decode(data.records))
        records.sort(key=lambda record: record.path)
        json_items: dict[str, _JsonItem] = {}
        for rank_results in results:
            for result in rank_results:
                data = result.storage_data
                if isinstance(data, _Written) and data.value is not None:
                    json_items[result.index.fqn] = _JSON_ITEM_DECODER.decode(data.value)
        # Only the byte items that are not JSON stay opaque (the reader refuses them by default).
        byte_keys = sorted(
            key
            for key, described in metadata.state_dict_metadata.items()
            if isinstance(described, BytesStorageMetadata) and key not in json_items
        )
        paths = _json_paths(metadata.planner_data)
        containers, values = _place_entries(records, paths, json_items)
        # "values": the byte items stored as JSON, the only values and containers the reader
        # offers DCP (exactly DCP's own keys, not the parts of a tuple, say).
        dcp_record: dict[str, Any] = {"bytes": byte_keys, "values": sorted(json_items)}
        if paths:
            dcp_record["planner_data"] = {key: list(path) for key, path in paths.items()}
        if metadata.version is not None:
            dcp_record["version"] = str(metadata.version)
        world_size = max(1, len(results))
        chunked = any(entry.global_shape is not None for record in records for entry in record.tensors)
        totals = {
            entry.key: (entry.nbytes, entry.dtype)
            for record in records
            for entry in record.tensors
            if entry.key not in dcp_record["bytes"]
        }
        # The top-level names of the state DCP saved: its optimizer section, as sk.save finds it.
        tops = dict.fromkeys(str(entry.path[0]) for record in records for entry in record.tensors)
        fields = RecordedFields(
            model_id=self.model_id,
            step=self.step,
            epoch=self.epoch,
            custom_fields={**self.custom_fields, DCP_FIELD: dcp_record},
        )
        return new_manifest(
            records,
            fields,
            state_sections(tops, []),
            digest=self.options.digest,
            world_size=world_size,
            chunked=chunked,
            precision=precision_of(totals),
            tiers=[_TIER],
            structure=containers,
            values=values,
            version=metadata_version(self.options.block_size),
        )


_PLAN_CACHING = (
    "ShardkeepWriter cannot save with DCP's plan caching (DefaultSavePlanner(enable_plan_caching=True)): DCP "
    "then hands the writer an earlier save's plan, whose storage data names that save's staging directory, "
    "so each save needs its own plan; use a planner without enable_plan_caching"
)


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _abort_quietly(commit: CheckpointCommit) -> None:
    """Abort a save that will never be finished; what cannot be removed now is collected after
    the lease (``CheckpointManager``, ``shardkeep prune --apply``)."""
    try:
        commit.abort()
    except Exception:  # cleaning up a failed save must not raise over the real error
        pass


def _json_item(data: bytes) -> bytes | None:
    """A DCP byte item (``torch.save`` bytes from DCP's planner, of a local object) as the
    manifest's containers and values (msgpack, paths under ``["v"]``), or ``None`` when it is
    not plain JSON-able data and must stay opaque. The bytes are decoded with the restricted
    unpickler (``weights_only=True``), which builds no arbitrary objects."""
    try:
        value = torch.load(io.BytesIO(data), weights_only=True)
    except Exception:
        return None
    # Exactly the plain values a manifest stores and gives back as the same types.
    if not is_manifest_value(value, allow_nonfinite=True, allow_int_keys=True, exact_types=True):
        return None
    try:
        flat = flatten_state({"v": value})
    except UnsupportedValueError:  # an int beyond 64 bits, keys that flatten to the same key
        return None
    if flat.tensors:
        return None
    containers = [container for container in flat.containers if container.path]
    return _RECORDS.encode((containers, flat.values))


def _planned(item: WriteItem, data: Any) -> PlannedItem | None:
    """The shardkeep item for one DCP write item, or ``None`` for an empty chunk of a tensor
    that is not empty (it covers nothing, and several ranks may hold one)."""
    key = item.index.fqn
    if item.type == WriteItemType.BYTE_IO:
        if not isinstance(data, io.BytesIO):
            raise UnsupportedValueError(f"DCP item {key!r}: expected the planner's bytes, got {type(data).__name__}")
        raw = bytearray(data.getbuffer())
        value = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return PlannedItem(TensorLeaf(key, (key,), value, 0))
    if not isinstance(data, torch.Tensor):
        raise UnsupportedValueError(f"DCP item {key!r}: expected a tensor, got {type(data).__name__}")
    tensor = data.detach()
    if type(tensor) is not torch.Tensor:
        tensor = tensor.to_local() if hasattr(tensor, "to_local") else torch.Tensor(tensor)
    chunk = item.tensor_data.chunk if item.tensor_data is not None else None
    if item.type == WriteItemType.SHARD:
        assert item.tensor_data is not None and chunk is not None
        global_shape = list(item.tensor_data.size)
        offsets = list(chunk.offsets)
        if list(tensor.shape) != list(chunk.sizes):
            raise UnsupportedValueError(
                f"DCP item {key!r}: the planner resolved a tensor of shape {list(tensor.shape)} for a chunk of "
                f"shape {list(chunk.sizes)}"
            )
        if tensor.numel() == 0 and (all(global_shape) or any(offsets)):
            return None
        planned = PlannedItem(TensorLeaf(key, (key,), tensor, 0))
        planned.global_shape = global_shape
        planned.global_offset = offsets
        planned.wants_digest = True
        return planned
    return PlannedItem(TensorLeaf(key, (key,), tensor, 0))


def _block_sizes(options: WriteOptions, items: list[PlannedItem]) -> tuple[int, int]:
    """The block sizes of this rank's chunk files and of its files of whole tensors (as a
    :func:`~shardkeep.save` decides them)."""
    if options.block_size == 0 or options.compression:
        return 0, 0
    if options.block_size is not None:
        return options.block_size, options.block_size
    return chunk_block_size([item.nbytes for item in items if item.wants_digest]), WHOLE_TENSOR_BLOCK_SIZE


def _json_paths(planner_data: Any) -> dict[str, tuple[str | int, ...]]:
    """DCP's ``planner_data`` (each key's path in the nested state) when it is what the default
    planner records, with every path joining to its key; ``{}`` otherwise."""
    if not isinstance(planner_data, Mapping):
        return {}
    paths: dict[str, tuple[str | int, ...]] = {}
    for key, path in planner_data.items():
        if not isinstance(key, str) or not isinstance(path, (tuple, list)) or not path:
            return {}
        if not all(isinstance(part, str) or (type(part) is int) for part in path):
            return {}
        if key_for_path(tuple(path)) != key:
            return {}
        paths[key] = tuple(path)
    return paths


def _place_entries(
    records: list[FileRecord], paths: dict[str, tuple[str | int, ...]], json_items: Mapping[str, _JsonItem]
) -> tuple[list[ContainerEntry], list[ValueEntry]]:
    """Give every entry its nested path (from DCP's ``planner_data``, else the key alone) and
    its depth-first order, in the order of the state DCP saved; place the byte items stored as
    JSON there too. Return the containers and the JSON values."""
    keys = {entry.key for record in records for entry in record.tensors} | set(json_items)
    ordered = [key for key in paths if key in keys] + sorted(keys - set(paths))
    containers: dict[tuple[str | int, ...], ContainerEntry] = {(): ContainerEntry(path=[], order=1)}
    counter = 1
    orders: dict[str, tuple[list[str | int], int]] = {}
    values: list[ValueEntry] = []
    leaves: set[tuple[str | int, ...]] = set()
    twice: list[str] = []
    for key in ordered:
        path = paths.get(key, (key,))
        for depth in range(1, len(path)):
            prefix = path[:depth]
            if prefix not in containers:
                counter += 1
                containers[prefix] = ContainerEntry(path=list(prefix), order=counter)
        item = json_items.get(key)
        if item is None:
            counter += 1
            orders[key] = (list(path), counter)
            leaves.add(path)
            continue
        # A byte item stored as JSON: its own containers and values, in their depth-first order,
        # re-rooted from ["v", ...] at the item's path.
        inner: list[ContainerEntry | ValueEntry] = [*item[0], *item[1]]
        for part in sorted(inner, key=lambda entry: entry.order):
            full = (*path, *part.path[1:])
            counter += 1
            if isinstance(part, ContainerEntry):
                if full in containers:
                    twice.append(key_for_path(full))
                containers[full] = ContainerEntry(path=list(full), kind=part.kind, order=counter)
            else:
                values.append(
                    msgspec.structs.replace(
                        part, key=key if full == path else key_for_path(full), path=list(full), order=counter
                    )
                )
                leaves.add(full)
    clash = sorted(key_for_path(prefix) for prefix in containers if prefix in leaves) + twice
    if clash:
        raise UnsupportedValueError(f"DCP keys {clash[:5]} are both values and containers of other values")
    for record in records:
        for entry in record.tensors:
            entry.path, entry.order = orders[entry.key]
    return list(containers.values()), values


class ShardkeepReader(StorageReader):
    """A DCP ``StorageReader`` of the shardkeep checkpoint at ``path`` (written by
    :class:`ShardkeepWriter` or by ``sk.save``).

    The manifest is read, sealed and validated when the reader is built (so a missing or
    damaged checkpoint raises the shardkeep error there); with ``public_key`` its signature is
    checked first (``require_signature`` as for ``sk.verify``). Every file a rank's plan needs
    is checked before any value reaches DCP's planner: with ``verify`` (the default) its digest
    (or, when only some of its chunks are read, those chunks' digests), else its size and
    header. A failure is an :class:`~shardkeep.errors.IntegrityError` naming the file, which
    DCP reports wrapped in its ``CheckpointException``. ``public_key`` with ``verify=False`` is
    refused (:class:`~shardkeep.errors.ConfigError`, as ``sk.load`` refuses it): the signature
    covers the data only through the digests.

    Non-tensor values are handed to DCP's planner as bytes that this reader builds itself with
    ``torch.save`` from the manifest's plain JSON. A checkpoint that holds *opaque* byte items
    (``custom_fields["dcp"]["bytes"]``: values that were not JSON-able, or any checkpoint
    written by an older writer) is refused when the reader is built, with an
    :class:`~shardkeep.errors.UnsupportedValueError` naming the keys: DCP's default planner
    unpickles such bytes (``torch.load(..., weights_only=False)``), which runs whatever code
    they name, and a valid digest or signature does not make them safe. Pass
    ``trust_pickle=True`` only for a checkpoint whose origin you trust.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        public_key: Any = None,
        require_signature: bool | None = None,
        verify: bool = True,
        limits: ManifestLimits | None = None,
        use_mmap: bool = True,
        storage_options: Mapping[str, Any] | None = None,
        trust_pickle: bool = False,
    ) -> None:
        super().__init__()
        self.path = _checkpoint_path(path)
        self.policy = SignaturePolicy.of(public_key, require_signature)
        if self.policy.public_key is not None and not verify:
            raise ConfigError(
                "public_key= with verify=False: the signature covers the data only through the digests, "
                "which verify=False does not check"
            )
        self.verify = verify
        self.trust_pickle = trust_pickle
        self.limits = limits
        self.use_mmap = use_mmap
        self.storage_options = storage_options
        self._storage: dict[MetadataIndex, _Stored] = {}
        self._open()

    def _open(self) -> None:
        self.location = locate(self.path, None, self.storage_options)
        self.manifest = read_checked_manifest(self.location, self.policy, self.limits)
        self._resolver = FileResolver(self.location, self.manifest, storage_options=self.storage_options)
        _, self._storage = _metadata_of(self.manifest, str(self.location))
        opaque = sorted(index.fqn for index, stored in self._storage.items() if stored.kind == "bytes")
        if opaque and not self.trust_pickle:
            raise UnsupportedValueError(_pickle_refusal(str(self.location), opaque))

    # -- DCP's calls, in order ------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None and _checkpoint_path(checkpoint_id) != self.path:
            self.path = _checkpoint_path(checkpoint_id)
            self._open()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's ``Metadata``, rebuilt from the manifest (nothing is unpickled)."""
        metadata, self._storage = _metadata_of(self.manifest, str(self.location))
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not self._storage:
            _, self._storage = _metadata_of(self.manifest, str(self.location))

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Check every file this plan needs, then hand each item to the planner."""
        manifest = self.manifest
        wanted: list[tuple[ReadItem, _Stored]] = []
        needed: dict[int, set[int]] = {}
        for item in plan.items:
            stored = self._storage.get(item.storage_index)
            if stored is None:
                raise ManifestError(
                    f"{self.location}: DCP asks for {item.storage_index.fqn!r} at offset "
                    f"{None if item.storage_index.offset is None else list(item.storage_index.offset)}, "
                    "which the checkpoint does not hold"
                )
            is_bytes = item.type == LoadItemType.BYTE_IO
            if is_bytes != (stored.kind != "tensor"):
                raise UnsupportedValueError(
                    f"{self.location}: {item.storage_index.fqn!r} is stored as "
                    f"{'a tensor' if stored.kind == 'tensor' else 'bytes'}, but DCP asks for "
                    f"{'bytes' if is_bytes else 'a tensor'}"
                )
            if stored.kind == "bytes" and not self.trust_pickle:
                raise UnsupportedValueError(_pickle_refusal(str(self.location), [item.storage_index.fqn]))
            wanted.append((item, stored))
            if stored.kind in ("tensor", "bytes"):
                needed.setdefault(stored.file, set()).add(stored.entry)
        buffers: dict[int, memoryview] = {}
        for file_index, entries in sorted(needed.items()):
            record = manifest.files[file_index]
            store, path = self._resolver(record)
            data, problems = check_shard(
                store, path, record, verify=self.verify, keep=True, use_mmap=self.use_mmap, needed=sorted(entries)
            )
            if problems or data is None:
                raise IntegrityError(f"{self.location}: " + "; ".join(problems[:5] or [f"{record.path}: unreadable"]))
            buffers[file_index] = data
        # Every file is checked: only now does any value reach the planner.
        for item, stored in wanted:
            if stored.kind in ("value", "container"):
                planner.load_bytes(item, io.BytesIO(_value_bytes(manifest, stored)))
                continue
            entry = manifest.files[stored.file].tensors[stored.entry]
            data = buffers[stored.file]
            if stored.kind == "bytes":
                planner.load_bytes(item, io.BytesIO(bytes(data[entry.offset : entry.offset + entry.nbytes])))
                continue
            source = array_from_buffer(data, entry.dtype, entry.shape, entry.offset, entry.nbytes, "torch", entry.key)
            for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
                source = source.narrow(dim, start, length)
            target = planner.resolve_tensor(item).detach()
            if target.size() != source.size():
                raise StateMismatchError(
                    f"{self.location}: {entry.key!r}: DCP's target region has shape {list(target.size())}, the "
                    f"stored region {list(source.size())}"
                )
            target.copy_(source)
            planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


def dcp_to_torch_save(
    checkpoint: str | os.PathLike[str], torch_save_path: str | os.PathLike[str], **reader_options: Any
) -> None:
    """``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` for a shardkeep
    checkpoint: load the whole state through DCP's own loader (one process, no process group)
    with a :class:`ShardkeepReader` (``reader_options``: ``public_key``, ``trust_pickle`` ...),
    then ``torch.save`` it at ``torch_save_path``, written whole or not at all (a fresh temporary
    file beside it, created exclusively and never through a symlink, fsynced, renamed); a name
    longer than 255 bytes is an :class:`~shardkeep.errors.UnsafePathError`. DCP's own function builds a ``FileSystemReader``, which looks
    for DCP's ``.metadata`` and so cannot read a shardkeep checkpoint. The file holds the
    nested state ``dcp_to_torch_save`` writes, and loads with ``torch.load(weights_only=True)``
    unless the checkpoint holds opaque byte items read with ``trust_pickle=True``."""
    from shardkeep.integrations.convert import load_whole_state, write_replacing

    state = load_whole_state(ShardkeepReader(checkpoint, **reader_options))

    write_replacing(os.fspath(torch_save_path), lambda temporary: torch.save(state, temporary))


def _metadata_of(manifest: Manifest, where: str) -> tuple[Metadata, dict[MetadataIndex, _Stored]]:
    """DCP's ``Metadata`` of a manifest, and where each item is stored."""
    record_field = manifest.custom_fields.get(DCP_FIELD)
    dcp_record: Mapping[str, Any] = record_field if isinstance(record_field, Mapping) else {}
    byte_keys = dcp_record.get("bytes", [])
    if not isinstance(byte_keys, list) or not all(isinstance(key, str) for key in byte_keys):
        raise ManifestError(f"{where}: custom_fields.{DCP_FIELD}.bytes must be a list of keys")
    bytes_of = set(byte_keys)
    json_keys = dcp_record.get("values")
    if json_keys is not None and (
        not isinstance(json_keys, list) or not all(isinstance(key, str) for key in json_keys)
    ):
        raise ManifestError(f"{where}: custom_fields.{DCP_FIELD}.values must be a list of keys")
    # Written by ShardkeepWriter: offer DCP exactly the byte items it saved as JSON. Otherwise
    # (sk.save), every value, and every container without tensors below it.
    offered = None if json_keys is None else set(json_keys)
    described: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    storage: dict[MetadataIndex, _Stored] = {}
    planner_data: dict[str, tuple[str | int, ...]] = {}
    for file_index, record in enumerate(manifest.files):
        for entry_index, entry in enumerate(record.tensors):
            key = entry.key
            planner_data[key] = tuple(entry.path)
            if key in bytes_of:
                if entry.dtype != "U8" or len(entry.shape) != 1 or entry.global_shape is not None or key in described:
                    raise ManifestError(f"{where}: {key!r} is listed as DCP bytes but is not one U8 vector")
                described[key] = BytesStorageMetadata()
                storage[MetadataIndex(key)] = _Stored("bytes", file_index, entry_index)
                continue
            dtype = NAME_TO_TORCH.get(entry.dtype)
            if dtype is None:
                raise UnsupportedValueError(f"{where}: {key!r}: dtype {entry.dtype} is not supported by this torch")
            global_shape = entry.global_shape if entry.global_shape is not None else entry.shape
            offset = entry.global_offset if entry.global_offset is not None else [0] * len(entry.shape)
            known = described.get(key)
            if known is None:
                known = described[key] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=dtype), size=torch.Size(global_shape), chunks=[]
                )
            if (
                not isinstance(known, TensorStorageMetadata)
                or known.properties.dtype != dtype
                or list(known.size) != list(global_shape)
            ):
                raise ManifestError(f"{where}: the chunks of {key!r} disagree about its dtype or shape")
            known.chunks.append(ChunkStorageMetadata(offsets=torch.Size(offset), sizes=torch.Size(entry.shape)))
            storage[MetadataIndex(key, offset)] = _Stored("tensor", file_index, entry_index)
    for value_index, value in enumerate(manifest.values):
        # A JSON leaf of the manifest: offered as bytes that this reader builds itself
        # (torch.save of the plain JSON value), so nothing from storage is unpickled.
        if offered is not None and value.key not in offered:
            continue
        described[value.key] = BytesStorageMetadata()
        storage[MetadataIndex(value.key)] = _Stored("value", -1, value_index)
        planner_data[value.key] = tuple(value.path)
    for container_index, container in enumerate(manifest.structure):
        # A container without tensors below it (a tuple of floats, a list of dicts of JSON) is
        # one leaf to DCP, which flattens only what holds tensors: offer it whole as well.
        key = key_for_path(container.path)
        if offered is not None and key not in offered:
            continue
        if container.path and key not in described and not _holds_tensors(manifest, container.path):
            described[key] = BytesStorageMetadata()
            storage[MetadataIndex(key)] = _Stored("container", -1, container_index)
            planner_data[key] = tuple(container.path)
    saved_paths = dcp_record.get("planner_data")
    if isinstance(saved_paths, Mapping):
        for key, path in saved_paths.items():
            if isinstance(key, str) and isinstance(path, list) and key in described:
                planner_data[key] = tuple(path)
    version = dcp_record.get("version")
    metadata = Metadata(
        state_dict_metadata=dict(described),
        planner_data=planner_data,
        storage_data=dict(storage),
        version=version if isinstance(version, str) else None,
    )
    return metadata, storage


_SPECIAL = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _pickle_refusal(where: str, keys: list[str]) -> str:
    shown = ", ".join(repr(key) for key in keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
    return (
        f"{where}: {len(keys)} non-tensor item(s) ({shown}) are stored as opaque bytes "
        f"(custom_fields.{DCP_FIELD}.bytes) that DCP's planner would unpickle on load "
        "(torch.load(..., weights_only=False)), and unpickling runs whatever code the bytes name; a digest or "
        "signature that checks out does not make them safe. shardkeep refuses them by default. If you trust "
        "where this checkpoint came from, pass ShardkeepReader(..., trust_pickle=True); sk.load reads it "
        "without unpickling (those items as uint8 tensors)."
    )


def _holds_tensors(manifest: Manifest, path: list[str | int]) -> bool:
    depth = len(path)
    return any(entry.path[:depth] == path for record in manifest.files for entry in record.tensors)


def _value_bytes(manifest: Manifest, stored: _Stored) -> bytes:
    """``torch.save`` of a JSON value of the manifest, or of a container holding only JSON
    values (what DCP's planner expects for a non-tensor item); built here from plain JSON,
    never read from storage."""
    if stored.kind == "value":
        entry = manifest.values[stored.entry]
        value: Any = _SPECIAL[entry.special] if entry.special else entry.value
    else:
        path = manifest.structure[stored.entry].path
        depth = len(path)
        inside = [c for c in manifest.structure if c.path[:depth] == path]
        values = [v for v in manifest.values if v.path[:depth] == path and len(v.path) > depth]
        rebased = [msgspec.structs.replace(c, path=["v", *c.path[depth:]]) for c in inside]
        leaves = [msgspec.structs.replace(v, path=["v", *v.path[depth:]]) for v in values]
        value = rebuild_state(rebased, leaves, [])["v"]
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()
