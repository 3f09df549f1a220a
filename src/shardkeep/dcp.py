"""The adapter for PyTorch's distributed checkpoint (DCP) API: a ``StorageWriter`` and a
``StorageReader`` that make ``dcp.save``, ``dcp.async_save`` and ``dcp.load`` write and read real
shardkeep checkpoints.

``ShardkeepWriter(path)`` writes each rank's items as safetensors files under ``shards/`` of a
staging directory that the coordinator opens in ``prepare_global_plan`` (its name reaches every
rank in its plan's ``storage_data``), with a digest computed while writing and every file
fsynced (:func:`shardkeep.io.write_shards`); in ``finish`` the coordinator writes the manifest
last, optionally signs it, and commits (:class:`~shardkeep.distributed.commit.CheckpointCommit`).
The result is an ordinary 1.x checkpoint (``metadata_version`` 1.3) that ``shardkeep verify`` and
``sk.load`` read:

- a whole tensor (DCP ``TENSOR`` item) is one tensor entry;
- a chunk of a sharded tensor (DCP ``SHARD`` item: a DTensor's local shard) is a chunk entry
  with ``global_shape``, ``global_offset`` and a digest of its own, in
  ``shards/rank_NNNNN_chunks.safetensors``;
- a non-tensor value (DCP ``BYTE_IO`` item, which DCP's planner serialises with
  ``torch.save``) is stored as opaque ``U8`` data under its key and listed in
  ``custom_fields["dcp"]["bytes"]``: shardkeep never unpickles it (``sk.load`` returns a uint8
  tensor), and ``ShardkeepReader`` hands the exact bytes back to DCP's planner, which loads them
  as DCP always does (``torch.load(..., weights_only=False)`` in the default planner);
- DCP's ``planner_data`` (each key's nested path) is kept as JSON in
  ``custom_fields["dcp"]["planner_data"]`` and as each entry's ``path``.

``ShardkeepReader(path)`` rebuilds DCP's ``Metadata`` from the manifest (of a checkpoint written
by this writer or by ``sk.save``) and reads only the files a rank's plan needs, each checked
before any value is handed to the planner: a file's digest when it is read whole, each chunk's
own digest when only some chunks of it are read (:func:`shardkeep.io.check_shard`).
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
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

from shardkeep.config import ManifestLimits, SaveOptions
from shardkeep.distributed.commit import CheckpointCommit
from shardkeep.errors import IntegrityError, ManifestError, UnsupportedValueError
from shardkeep.integrity import (
    CRYPTOGRAPHIC_DIGESTS,
    SignaturePolicy,
    load_private_key,
    seal_manifest,
    sign_manifest,
)
from shardkeep.io import ByteBudget, ShardPlan, check_shard, write_shards
from shardkeep.layout import PlannedItem, file_header, plan_files
from shardkeep.manifest import (
    ContainerEntry,
    FileRecord,
    Manifest,
    Sharding,
    StateSection,
    Tier,
    encode_manifest,
    has_chunks,
    key_for_path,
    validate_manifest,
)
from shardkeep.saving import DEFAULT_TIER, _ensure_directory, _plain_json_mapping, _precision, warn_if_over_read_limits
from shardkeep.storage import LocalStore
from shardkeep.tensors.convert import NAME_TO_TORCH, array_from_buffer
from shardkeep.tensors.coverage import coverage_problems
from shardkeep.tensors.flatten import TensorLeaf, rebuild_state
from shardkeep.verification import CheckpointLocation, FileResolver, locate, read_checked_manifest

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

__all__ = ["DCP_FIELD", "ShardkeepReader", "ShardkeepWriter"]

#: The ``custom_fields`` member that records what the DCP writer adds to a manifest.
DCP_FIELD = "dcp"
_TIER = Tier(tier_id=1, name=DEFAULT_TIER)
_RECORDS = msgspec.msgpack.Encoder()
_RECORDS_DECODER = msgspec.msgpack.Decoder(list[FileRecord])


@dataclasses.dataclass(frozen=True)
class _PlanData:
    """A save plan's ``storage_data``: the staging name the coordinator opened."""

    staging: str


@dataclasses.dataclass(frozen=True)
class _Written:
    """A write result's ``storage_data``: where the item went; the first result of a rank also
    carries that rank's file records (msgpack), for the coordinator's manifest."""

    path: str | None
    records: bytes | None = None


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


class ShardkeepWriter(StorageWriter):
    """A DCP ``StorageWriter`` that commits a shardkeep checkpoint at ``path``.

    ``digest``, ``io_threads``, ``byte_budget`` and ``file_size_target`` are those of
    ``sk.save``; ``signer`` (an Ed25519 private key or the path of a PEM file) signs the manifest
    (it needs a cryptographic digest); ``model_id``, ``step``, ``epoch`` and ``custom_fields`` are
    recorded in the manifest. A committed checkpoint is never overwritten: constructing a writer
    (or ``reset`` with a checkpoint id) for an existing checkpoint raises
    :class:`~shardkeep.errors.CheckpointExistsError`; a checkpoint that appears while the save
    runs makes the commit fail (DCP reports it wrapped in its ``CheckpointException``).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        digest: str = SaveOptions.digest,
        signer: Any = None,
        io_threads: int = SaveOptions.io_threads,
        byte_budget: int = SaveOptions.byte_budget,
        file_size_target: int = SaveOptions.file_size_target,
        model_id: str | None = None,
        step: int | None = None,
        epoch: int | None = None,
        custom_fields: Mapping[str, Any] | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.options = SaveOptions(
            digest=digest, io_threads=io_threads, byte_budget=byte_budget, file_size_target=file_size_target
        )
        if signer is not None and digest not in CRYPTOGRAPHIC_DIGESTS:
            raise UnsupportedValueError(
                f"signer= needs a cryptographic digest, not digest={digest!r}: a signature covers the "
                "data only through the digests (use 'blake3' or 'sha256')"
            )
        fields = _plain_json_mapping("custom_fields", custom_fields)
        if DCP_FIELD in fields:
            raise UnsupportedValueError(f"custom_fields[{DCP_FIELD!r}] is reserved for the DCP adapter's own record")
        self.custom_fields = fields
        self.signer = signer
        self.model_id, self.step, self.epoch = model_id, step, epoch
        self.storage_options = storage_options
        self.path = _checkpoint_path(path)
        self.is_coordinator = False
        self.rank = 0
        self._commit: CheckpointCommit | None = None
        self._private_key: Ed25519PrivateKey | None = None
        self._refuse_existing()

    # -- DCP's calls, in order ------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = _checkpoint_path(checkpoint_id)
            self._refuse_existing()
        self._commit = None
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
        staging directory, whose name every rank's plan carries."""
        location = self._location()
        if self.signer is not None:
            self._private_key = load_private_key(self.signer)
        if isinstance(location.store, LocalStore):
            _ensure_directory(location.store.root)
        commit = CheckpointCommit(location.store, location.name)
        commit.begin()
        self._commit = commit
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
        items: list[PlannedItem] = []
        sizes: list[tuple[WriteItem, PlannedItem | None]] = []
        for write_item in plan.items:
            planned = _planned(write_item, planner.resolve_data(write_item))
            sizes.append((write_item, planned))
            if planned is not None:
                items.append(planned)
        shard_plans: list[ShardPlan] = []
        records: list[FileRecord] = []
        where: dict[int, str] = {}
        for record, group in plan_files(
            items, rank=self.rank, target=self.options.file_size_target, tier=_TIER.name, tier_id=_TIER.tier_id
        ):
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
        )
        results = [
            WriteResult(
                index=write_item.index,
                size_in_bytes=0 if planned is None else planned.nbytes,
                storage_data=_Written(None if planned is None else where[id(planned)]),
            )
            for write_item, planned in sizes
        ]
        if results:
            first = results[0]
            results[0] = dataclasses.replace(
                first, storage_data=_Written(first.storage_data.path, _RECORDS.encode(records))
            )
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """On the coordinator: build the manifest from every rank's records, check it (every
        chunked tensor tiled exactly once), write it last, sign it, and commit."""
        commit = self._commit
        if commit is None:
            raise UnsupportedValueError("ShardkeepWriter.finish was called without prepare_global_plan")
        try:
            manifest = self._manifest(metadata, results)
            for record in manifest.files:
                commit.add_data_file(record.path)
            sealed = seal_manifest(encode_manifest(manifest), self.options.digest)
            warn_if_over_read_limits(self._location(), sealed, manifest)
            key = self._private_key
            signature = sign_manifest(sealed, key, manifest) if key is not None else None
            commit.commit(sealed, signature)
        except BaseException:
            commit.abort()
            raise
        finally:
            self._commit = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    # -- helpers -------------------------------------------------------------------------------
    def _location(self) -> CheckpointLocation:
        return locate(self.path, None, self.storage_options)

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
        byte_keys = sorted(
            key
            for key, described in metadata.state_dict_metadata.items()
            if isinstance(described, BytesStorageMetadata)
        )
        paths = _json_paths(metadata.planner_data)
        containers = _place_entries(records, paths)
        dcp_record: dict[str, Any] = {"bytes": byte_keys}
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
        tops = {str(entry.path[0]) for record in records for entry in record.tensors}
        optim = sorted(name for name in tops if name in ("optim", "optimizer"))
        manifest = Manifest(
            model_id=self.model_id,
            step=self.step,
            epoch=self.epoch,
            world_size=world_size,
            digest_algorithm=self.options.digest,
            sharding=Sharding(
                strategy="dtensor" if chunked else "replicated" if world_size > 1 else "none",
                shard_count=len(records),
                precision=_precision(totals),
            ),
            tiers=[_TIER],
            files=records,
            optim_state=StateSection(prefixes=optim, description="optimizer state") if optim else None,
            structure=containers,
            custom_fields={**self.custom_fields, DCP_FIELD: dcp_record},
        )
        problems = validate_manifest(manifest).errors
        if has_chunks(manifest):
            problems += coverage_problems(manifest)
        if problems:
            raise UnsupportedValueError(f"cannot commit {self._location()}: " + "; ".join(problems[:5]))
        return manifest


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


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


def _place_entries(records: list[FileRecord], paths: dict[str, tuple[str | int, ...]]) -> list[ContainerEntry]:
    """Give every entry its nested path (from DCP's ``planner_data``, else the key alone) and
    its depth-first order, in the order of the state DCP saved; return the containers."""
    keys = {entry.key for record in records for entry in record.tensors}
    ordered = [key for key in paths if key in keys] + sorted(keys - set(paths))
    containers: dict[tuple[str | int, ...], int] = {(): 1}
    counter = 1
    orders: dict[str, tuple[list[str | int], int]] = {}
    for key in ordered:
        path = paths.get(key, (key,))
        for depth in range(1, len(path)):
            prefix = path[:depth]
            if prefix not in containers:
                counter += 1
                containers[prefix] = counter
        counter += 1
        orders[key] = (list(path), counter)
    leaves = {tuple(path) for path, _ in orders.values()}
    clash = sorted(key_for_path(prefix) for prefix in containers if prefix in leaves)
    if clash:
        raise UnsupportedValueError(f"DCP keys {clash[:5]} are both values and containers of other values")
    for record in records:
        for entry in record.tensors:
            entry.path, entry.order = orders[entry.key]
    return [ContainerEntry(path=list(path), order=order) for path, order in containers.items()]


class ShardkeepReader(StorageReader):
    """A DCP ``StorageReader`` of the shardkeep checkpoint at ``path`` (written by
    :class:`ShardkeepWriter` or by ``sk.save``).

    The manifest is read, sealed and validated when the reader is built (so a missing or
    damaged checkpoint raises the shardkeep error there); with ``public_key`` its signature is
    checked first (``require_signature`` as for ``sk.verify``). Every file a rank's plan needs
    is checked before any value reaches DCP's planner: with ``verify`` (the default) its digest
    (or, when only some of its chunks are read, those chunks' digests), else its size and
    header. A failure is an :class:`~shardkeep.errors.IntegrityError` naming the file, which
    DCP reports wrapped in its ``CheckpointException``.
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
    ) -> None:
        super().__init__()
        self.path = _checkpoint_path(path)
        self.policy = SignaturePolicy.of(public_key, require_signature)
        self.verify = verify
        self.limits = limits
        self.use_mmap = use_mmap
        self.storage_options = storage_options
        self._storage: dict[MetadataIndex, _Stored] = {}
        self._open()

    def _open(self) -> None:
        self.location = locate(self.path, None, self.storage_options)
        self.manifest = read_checked_manifest(self.location, self.policy, self.limits)
        self._resolver = FileResolver(self.location, self.manifest, storage_options=self.storage_options)

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
                raise UnsupportedValueError(
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


def _metadata_of(manifest: Manifest, where: str) -> tuple[Metadata, dict[MetadataIndex, _Stored]]:
    """DCP's ``Metadata`` of a manifest, and where each item is stored."""
    record_field = manifest.custom_fields.get(DCP_FIELD)
    dcp_record: Mapping[str, Any] = record_field if isinstance(record_field, Mapping) else {}
    byte_keys = dcp_record.get("bytes", [])
    if not isinstance(byte_keys, list) or not all(isinstance(key, str) for key in byte_keys):
        raise ManifestError(f"{where}: custom_fields.{DCP_FIELD}.bytes must be a list of keys")
    bytes_of = set(byte_keys)
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
        # A JSON leaf of an ``sk.save`` checkpoint: offered as bytes that this reader builds
        # itself (torch.save of the plain JSON value), so nothing from storage is unpickled.
        described[value.key] = BytesStorageMetadata()
        storage[MetadataIndex(value.key)] = _Stored("value", -1, value_index)
        planner_data[value.key] = tuple(value.path)
    for container_index, container in enumerate(manifest.structure):
        # A container without tensors below it (a tuple of floats, a list of dicts of JSON) is
        # one leaf to DCP, which flattens only what holds tensors: offer it whole as well.
        key = key_for_path(container.path)
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
