"""The manifest's schema: the msgspec structs of a checkpoint's record, the format's constants
(versions, dtype sizes, block sizes, limits of format 2.x) and the rules a value of the schema must meet
(a shape's extent, a digest's form, a key and its path).

The manifest is versioned data (``metadata_version`` is ``"MAJOR.MINOR"``): a struct's fields
are its encoded members, in order. State a struct keeps that is never encoded (what a reader
learned while decoding, a view's completeness) is declared with :class:`Transient`. The
field-by-field description is in ``docs/manifest.md``. This module does not import torch.
"""

from __future__ import annotations

import datetime as _dt
import math
import operator
import re
from collections.abc import Callable, Sequence
from itertools import chain, repeat
from typing import Any, Generic, Literal, TypeVar, overload

import msgspec

from shardkeep.config import BLOCK_SIZES, ManifestLimits
from shardkeep.errors import ManifestError
from shardkeep.names import index_path

__all__ = [
    "BLOCK_SIZES",
    "DIGEST_HEX_LENGTH",
    "DTYPE_ITEMSIZE",
    "FAST_BLOCK_DIGEST_BYTES",
    "FAST_DIGEST",
    "FORMAT_NAME",
    "INDEXED_VERSION",
    "INDEX_FORMAT",
    "MAX_HISTORY",
    "MAX_MESH_RANKS",
    "MAX_STRIDED_WORK",
    "MAX_TENSOR_BYTES",
    "METADATA_VERSION",
    "RUN_ID_PATTERN",
    "SEAL_FIELD",
    "STRONG_BLOCK_DIGEST_BYTES",
    "WRITTEN_INDEXED_VERSION",
    "COMPATIBLE_INDEXED_VERSION",
    "COMPATIBLE_METADATA_VERSION",
    "WRITTEN_METADATA_VERSION",
    "Compression",
    "ContainerEntry",
    "EntryFamily",
    "FileRecord",
    "HistoryPoint",
    "IndexRecord",
    "IndexTable",
    "IndexedManifest",
    "KeyPath",
    "Manifest",
    "Mesh",
    "RankIndex",
    "RetentionRecord",
    "RunInfo",
    "SaveTiming",
    "ShardedTensor",
    "Sharding",
    "StateSection",
    "TensorEntry",
    "TensorFamily",
    "Tier",
    "Training",
    "Transient",
    "ValueEntry",
    "digest_problem",
    "has_chunks",
    "key_for_path",
    "lineage",
    "parse_placements",
    "path_problem",
    "shape_problem",
    "short_shape",
    "stored_bytes",
]

FORMAT_NAME = "shardkeep"
#: The newest 1.x version this schema describes (1.3 plus ``fast_digest``, ``block_size`` and
#: ``blocks``): a reader decodes a manifest of this minor or an older one with every field known.
METADATA_VERSION = "1.4"
#: The newest version of a manifest that describes regularly sharded tensors once, with rank
#: indexes (:class:`IndexedManifest`), that this schema describes (2.0 plus the fields of 1.4
#: and the families). A rank index records the version of its root.
INDEXED_VERSION = "2.1"
#: The versions saves write: a save without sharded tensors writes
#: :data:`WRITTEN_METADATA_VERSION`, a sharded one :data:`WRITTEN_INDEXED_VERSION` (root and
#: indexes).
WRITTEN_METADATA_VERSION = "1.4"
WRITTEN_INDEXED_VERSION = "2.1"
#: The versions a save with ``WriteOptions(block_size=0)`` writes (no ``fast_digest``, no
#: blocks, no families): what readers of 1.3 and 2.0 read.
COMPATIBLE_METADATA_VERSION = "1.3"
COMPATIBLE_INDEXED_VERSION = "2.0"
#: The algorithm of ``FileRecord.fast_digest`` and of the first digest of each block.
FAST_DIGEST = "xxh3-128"
#: Bytes of each digest in ``TensorEntry.blocks``: the fast one (xxh3-128), and the strong one
#: (blake3 or sha256) when the block records it.
FAST_BLOCK_DIGEST_BYTES = 16
STRONG_BLOCK_DIGEST_BYTES = 32
INDEX_FORMAT = "shardkeep-index"
#: The most ranks a format 2.x mesh may have (its rank list is built when an index is read).
MAX_MESH_RANKS = 1 << 20
#: The most (mesh coordinates x split factor) of a ``_StridedShard`` grid, whose chunks a
#: reader works out one coordinate and one piece at a time.
MAX_STRIDED_WORK = 1 << 24
#: The sealing trailer's key. It is the last member of the top-level object; see ``integrity``.
SEAL_FIELD = "manifest_digest"
#: The most earlier saves a manifest's run history keeps (the oldest are dropped first).
MAX_HISTORY = 10_000

#: Bytes per element for every dtype name a manifest may record: the safetensors names, and
#: those safetensors has no name for (``tensors.shardfile.CARRIED_DTYPES`` says how a shard's
#: header carries them).
DTYPE_ITEMSIZE: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2": 1,
    "F8_E5M2FNUZ": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "C64": 8,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "F8_E8M0": 1,
    "F4_E2M1FN_X2": 1,
    "B8": 1,
    "B1X8": 1,
    "B2X4": 1,
    "B4X2": 1,
    "B16": 2,
    "C32": 4,
    "C128": 16,
}

#: Hex digits of a digest of each algorithm a manifest may name.
DIGEST_HEX_LENGTH = {"blake3": 64, "xxh3-128": 32, "sha256": 64}
#: A run id: 1-128 characters of letters, digits, ``.``, ``_`` or ``-``, starting alphanumeric.
RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

KeyPath = list[str | int]

_T = TypeVar("_T")


class Transient(Generic[_T]):
    """A declared attribute of a manifest struct that is not one of its fields: msgspec never
    encodes, decodes, compares or pickles it, and ``msgspec.structs.replace`` does not carry it
    over.

    The struct is declared ``dict=True`` (msgspec's place for runtime state a struct holds
    besides its fields); the value lives there under the attribute's own name and reads as
    ``default()`` until it is set. Type checkers see the attribute's type through
    :meth:`__get__`."""

    def __init__(self, default: Callable[[], _T]) -> None:
        self._default = default
        self._name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, instance: None, owner: type) -> Transient[_T]: ...
    @overload
    def __get__(self, instance: object, owner: type) -> _T: ...
    def __get__(self, instance: object | None, owner: type) -> Transient[_T] | _T:
        if instance is None:
            return self
        try:
            value: _T = instance.__dict__[self._name]
        except KeyError:
            return self._default()
        return value

    def __set__(self, instance: object, value: _T) -> None:
        instance.__dict__[self._name] = value


class Tier(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """A storage tier. ``location`` ``None`` means the directory that holds the manifest."""

    tier_id: int
    name: str
    size_budget: str | None = None
    placement_policy: str = "prioritized"
    location: str | None = None


class TensorEntry(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """One tensor, or one chunk of a larger tensor, stored in a data file.

    ``offset`` is the absolute byte offset in the file (past the safetensors header) and
    ``nbytes`` the stored size. ``global_shape``/``global_offset`` are set when the entry is a
    chunk of a tensor sharded across ranks; a chunk also has its own ``digest``, so a rank that
    needs only some chunks of a file can read and verify just those byte ranges.

    ``blocks`` (1.4/2.1) holds the digests of the entry's blocks: block ``j`` is the bytes
    ``[offset + j*B, min(offset + nbytes, offset + (j+1)*B))``, ``B`` the file record's
    ``block_size``, and its digests are 16 bytes of xxh3-128 and then, unless the block is
    "fast-only", 32 bytes of the manifest's ``digest_algorithm``
    (:func:`shardkeep.integrity.block_digests` is the definition). Empty: no blocks.
    """

    key: str
    path: KeyPath
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int
    kind: Literal["dense", "expert"] = msgspec.field(default="dense", name="type")
    expert_key: list[int] | None = None
    global_shape: list[int] | None = None
    global_offset: list[int] | None = None
    array_type: Literal["torch", "numpy"] = "torch"
    order: int = 0
    digest: str | None = None
    blocks: bytes = b""


class TensorFamily(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """Regularly sharded tensors (format 2.1) that differ only in the integers of their keys,
    described once: ``IndexedManifest.families``.

    ``key`` is a template (``"model.layers.{0}.experts.{1}.w1"``; ``{{`` and ``}}`` are literal
    braces) and ``path`` one template per component; a component exactly ``"{k}"`` whose
    position is in ``int_parts`` is the integer itself. ``indices`` gives each placeholder's
    ``[start, stop, step]``; the instances are the cartesian product, row-major. An instance's
    ``order`` is ``order + sum(order_steps[k] * (i_k - start_k) / step_k)``; ``expert_key``'s
    templates resolve as ``path``'s. The other fields are those of :class:`ShardedTensor`."""

    key: str
    path: list[str | int]
    int_parts: list[int] = msgspec.field(default_factory=list)
    indices: list[list[int]]
    dtype: str
    global_shape: list[int]
    mesh: int
    placements: list[str]
    kind: Literal["dense", "expert"] = "dense"
    expert_key: list[int | str] | None = None
    order: int = 0
    order_steps: list[int] = msgspec.field(default_factory=list)


class EntryFamily(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """Whole tensors of one data file (format 2.1) that differ only in the integers of their
    keys, described once: ``FileRecord.families`` (an optimizer's ``step`` scalars, say).

    ``key``, ``path``, ``int_parts``, ``indices``, ``order`` and ``order_steps`` are as in
    :class:`TensorFamily`; every instance has ``dtype``, ``shape``, ``nbytes``, ``kind`` and
    ``expert_key`` (templates resolved as in :class:`TensorFamily`), and its byte offset is
    ``offset + sum(offset_steps[k] * (i_k - start_k) / step_k)``. An instance is a whole-tensor
    :class:`TensorEntry` with no digest and no blocks. A reader expands the families of a record
    into its ``tensors`` when it decodes the manifest, in byte-offset order."""

    key: str
    path: list[str | int]
    int_parts: list[int] = msgspec.field(default_factory=list)
    indices: list[list[int]]
    dtype: str
    shape: list[int]
    nbytes: int
    offset: int
    offset_steps: list[int] = msgspec.field(default_factory=list)
    order: int = 0
    order_steps: list[int] = msgspec.field(default_factory=list)
    kind: Literal["dense", "expert"] = "dense"
    expert_key: list[int | str] | None = None


class Compression(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """How a data file is compressed on storage. ``stored_size`` is the compressed size; the
    file record's ``size`` and ``digest`` describe the uncompressed safetensors bytes."""

    codec: Literal["zstd"]
    level: int
    stored_size: int


class FileRecord(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """One data file (a valid safetensors file, or one compressed as ``compression`` says).

    The file lives at ``<tier location>/<owner>/<path>``: the tier location is the directory
    (or bucket prefix) holding the checkpoint when the tier has no location of its own, and the
    owner is ``ref`` when set (an incremental save referencing an unchanged file of an earlier
    checkpoint in the same root) or this checkpoint. ``version`` counts the file's content
    changes across incremental saves; the file's safetensors header records it too.

    Added in 1.4/2.1: ``fast_digest``, the xxh3-128 digest of the same bytes as ``digest``
    (absent when ``digest`` is itself xxh3-128); ``block_size``, the bytes per block of the
    entries' ``blocks`` (0: none; always 0 for a compressed file, which is read whole); and
    ``families`` (2.1 roots only), whole-tensor entries described once.
    """

    path: str
    rank: int
    size: int
    digest: str | None
    version: int = 1
    tier: str = "hot"
    ref: str | None = None
    tensors: list[TensorEntry] = msgspec.field(default_factory=list)
    compression: Compression | None = None
    fast_digest: str | None = None
    block_size: int = 0
    families: list[EntryFamily] = msgspec.field(default_factory=list)

    @property
    def stored_size(self) -> int:
        """Bytes on storage: the compressed size, or ``size``."""
        return self.compression.stored_size if self.compression is not None else self.size


class Sharding(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """How the state was split across ranks. ``shard_count`` equals the number of files."""

    strategy: str = "none"
    shard_count: int = 0
    precision: str | None = None
    strategy_info: dict[str, Any] = msgspec.field(default_factory=dict)


class Training(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """Training fields recorded for humans and tools; the state itself holds the truth."""

    learning_rate: float | None = None
    optimizer_type: str | None = None


class StateSection(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """Where a kind of state (optimizer, router) lives: the key prefixes that hold it."""

    prefixes: list[str]
    description: str | None = None


class ContainerEntry(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """A container in the saved state tree, so that load rebuilds it exactly (even when empty)."""

    path: KeyPath
    kind: Literal["dict", "list", "tuple", "state_dict"] = "dict"
    order: int = 0


class ValueEntry(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """A JSON leaf of the state. ``special`` encodes non-finite floats (``nan``, ``inf``, ``-inf``)."""

    key: str
    path: KeyPath
    value: Any = None
    special: Literal["nan", "inf", "-inf"] | None = None
    order: int = 0


def _utc_now() -> _dt.datetime:
    return _dt.datetime.now(_dt.UTC)


class RetentionRecord(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """The retention policy of the manager that wrote a checkpoint (added in 1.1)."""

    keep_last: int
    keep_best: int
    metric: str
    mode: Literal["min", "max"] = "min"


class SaveTiming(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """How long the save took on the coordinator (added in 1.3): ``blocked_seconds`` is the
    time the caller was paused (all of it for ``save``; until the snapshot was taken for
    ``async_save``), ``total_seconds`` the time from the call until the manifest was built."""

    blocked_seconds: float
    total_seconds: float


class HistoryPoint(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """One earlier save of the run (added in 1.3): its step, metrics and timing, kept even after
    retention deleted that checkpoint, so that the metric curve survives."""

    step: int
    metrics: dict[str, float | None] = msgspec.field(default_factory=dict)
    timing: SaveTiming | None = None


class RunInfo(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """Which training run wrote a checkpoint (added in 1.1; written by ``CheckpointManager``).

    ``fingerprint`` is a digest of the run's model args and config; ``fingerprint_fields``
    holds their leaves by dotted path (``config.optimizer.lr``) so that a change can be shown
    field by field. ``history`` (1.3) lists the run's earlier saves, oldest first, on the
    lineage that led to this checkpoint.
    """

    run_id: str
    fingerprint: str | None = None
    fingerprint_fields: dict[str, Any] = msgspec.field(default_factory=dict)
    retention: RetentionRecord | None = None
    history: list[HistoryPoint] = msgspec.field(default_factory=list)


class Manifest(msgspec.Struct, kw_only=True, dict=True):
    """The record of one committed checkpoint. Written last; its presence means committed.

    ``unknown_fields`` holds fields a newer minor version wrote that this version does not know,
    keyed by their location (``files[0].new_field``); they are kept for inspection and ignored.
    """

    #: Fields of a newer minor version that the decoder kept (never encoded again).
    unknown_fields = Transient[dict[str, Any]](dict)

    metadata_version: str = WRITTEN_METADATA_VERSION
    format: str = FORMAT_NAME
    model_id: str | None = None
    created_at: _dt.datetime = msgspec.field(default_factory=_utc_now)
    epoch: int | None = None
    step: int | None = None
    world_size: int = 1
    coordinator_rank: int = 0
    digest_algorithm: str = "blake3"
    sharding: Sharding = msgspec.field(default_factory=Sharding)
    training: Training = msgspec.field(default_factory=Training)
    tiers: list[Tier] = msgspec.field(default_factory=list)
    files: list[FileRecord] = msgspec.field(default_factory=list)
    optim_state: StateSection | None = None
    router_state: StateSection | None = None
    structure: list[ContainerEntry] = msgspec.field(default_factory=list)
    values: list[ValueEntry] = msgspec.field(default_factory=list)
    custom_fields: dict[str, Any] = msgspec.field(default_factory=dict)
    metrics: dict[str, float | None] = msgspec.field(default_factory=dict)
    run: RunInfo | None = None
    timing: SaveTiming | None = None

    def iter_tensors(self) -> list[tuple[FileRecord, TensorEntry]]:
        """Every (file, tensor entry) pair, in file order."""
        return list(chain.from_iterable(zip(repeat(record), record.tensors) for record in self.files))

    @property
    def total_tensor_bytes(self) -> int:
        return sum(map(_NBYTES, chain.from_iterable(map(_TENSORS, self.files))))


# Field getters: ``map(_NBYTES, entries)`` runs in C, with no Python frame per entry.
_TENSORS = operator.attrgetter("tensors")
_NBYTES = operator.attrgetter("nbytes")
_GLOBAL_OFFSET = operator.attrgetter("global_offset")


class Mesh(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """A device mesh (format 2.x): its shape, and its global ranks in row-major order of the
    mesh coordinates (absent: ``0, 1, ...``, the usual case)."""

    shape: list[int]
    ranks: list[int] | None = None

    def rank_list(self) -> list[int]:
        return self.ranks if self.ranks is not None else list(range(math.prod(self.shape)))


class ShardedTensor(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """A regularly sharded tensor (format 2.x), described once: its chunks are computed from
    ``global_shape``, the mesh and the placements (``"R"``: replicated over that mesh
    dimension; ``"S<d>"``: tensor dimension ``d`` split over it, as ``torch.chunk`` splits).
    Which file holds each chunk is in the index of the rank that wrote it."""

    key: str
    path: KeyPath
    dtype: str
    global_shape: list[int]
    mesh: int
    placements: list[str]
    kind: Literal["dense", "expert"] = msgspec.field(default="dense", name="type")
    expert_key: list[int] | None = None
    order: int = 0


class IndexRecord(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """One rank's index file (format 2.x), ``index/rank_NNNNN.json``: its path (on an object
    store, below the save attempt's prefix, as data files are), size and digest."""

    rank: int
    path: str
    size: int
    digest: str
    #: Bytes on storage of the data files the index lists (informational: sizes in listings).
    data_bytes: int = 0


class IndexTable(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """The rank indexes of a format 2.x manifest, one column per field, so that each rank
    costs about 80 bytes of the manifest: rank ``ranks[i]``'s index is
    ``{prefix}index/rank_NNNNN.json``, of ``sizes[i]`` bytes and digest
    ``{algorithm}:{digests[i]}``. ``prefix`` is the save attempt's directory on an object
    store (as data files have). ``data_bytes`` is the stored size of the files the indexes list."""

    algorithm: str
    ranks: list[int]
    sizes: list[int]
    digests: list[str]
    prefix: str = ""
    data_bytes: int = 0
    #: The earlier checkpoints whose files the indexes reference (an incremental save's
    #: unchanged chunk files): what retention must know without reading every index.
    refs: list[str] = msgspec.field(default_factory=list)

    def records(self) -> list[IndexRecord]:
        return [
            IndexRecord(
                rank=rank, path=f"{self.prefix}{index_path(rank)}", size=size, digest=f"{self.algorithm}:{hex_}"
            )
            for rank, size, hex_ in zip(self.ranks, self.sizes, self.digests, strict=True)
        ]

    @classmethod
    def of(cls, records: list[IndexRecord]) -> IndexTable:
        """The table of some index records (sorted by rank), which share one algorithm and prefix."""
        records = sorted(records, key=lambda record: record.rank)
        prefix = records[0].path.removesuffix(index_path(records[0].rank)) if records else ""
        prefixes = {prefix} if all(r.path == f"{prefix}{index_path(r.rank)}" for r in records) else {"", "?"}
        algorithms = {record.digest.partition(":")[0] for record in records}
        if len(prefixes) > 1 or len(algorithms) > 1:
            raise ManifestError(f"rank indexes differ in their directory or digest algorithm: {prefixes} {algorithms}")
        return cls(
            algorithm=algorithms.pop() if algorithms else "blake3",
            ranks=[record.rank for record in records],
            sizes=[record.size for record in records],
            digests=[record.digest.partition(":")[2] for record in records],
            prefix=prefixes.pop() if prefixes else "",
            data_bytes=sum(record.data_bytes for record in records),
        )


class RankIndex(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, gc=False):
    """The contents of a rank index: the file records (with every chunk entry) of the files
    that rank wrote for regularly sharded tensors."""

    format: str
    metadata_version: str
    rank: int
    files: list[FileRecord]


class IndexedManifest(Manifest, kw_only=True, dict=True):
    """A format 2.x manifest: everything a 1.x manifest holds, except that the chunks of
    regularly sharded tensors are not listed. ``sharded`` describes each such tensor once,
    ``meshes`` the meshes they refer to, and ``indexes`` each rank's index file, which lists
    the files that rank wrote for them and their chunk entries. A reader expands the indexes it
    needs (:mod:`shardkeep.indexes`) into a view with the 1.x shape.

    ``complete`` is ``None`` for the manifest as read (its files only); on a view that
    :func:`shardkeep.indexes.expand` built, it says whether the files of every rank index are in
    it (``True``) or of some (``False``)."""

    #: Whether this view lists the files of every rank index; ``None``: not a view.
    complete = Transient[bool | None](lambda: None)
    _index_record_cache = Transient[list[IndexRecord] | None](lambda: None)
    _described_cache = Transient[list[ShardedTensor] | None](lambda: None)
    _find_cache = Transient[tuple[dict[str, ShardedTensor], Any] | None](lambda: None)

    meshes: list[Mesh] = msgspec.field(default_factory=list)
    sharded: list[ShardedTensor] = msgspec.field(default_factory=list)
    indexes: IndexTable | None = None
    #: Described tensors that differ only in the integers of their keys (2.1). Unset, and so
    #: not encoded, when there are none: this struct encodes every field that is set, and a 2.0
    #: manifest has no such member. ``manifest.families or []`` reads it as a list.
    families: list[TensorFamily] | msgspec.UnsetType = msgspec.UNSET

    def index_records(self) -> list[IndexRecord]:
        """The rank indexes, one record each (built once)."""
        found = self._index_record_cache
        if found is None:
            found = self._index_record_cache = self.indexes.records() if self.indexes is not None else []
        return found

    def described(self) -> list[ShardedTensor]:
        """Every described sharded tensor: ``sharded``, then each family's instances, row-major
        (built once per manifest object; ``sharded`` itself when there is no family). What
        readers resolve keys against; the manifest must be valid."""
        if not self.families:
            return self.sharded
        found = self._described_cache
        if found is None:
            from shardkeep.manifest.families import expand_tensor_family

            found = [*self.sharded, *chain.from_iterable(map(expand_tensor_family, self.families))]
            self._described_cache = found
        return found

    def find(self, key: str) -> ShardedTensor | None:
        """The described sharded tensor ``key``, a singleton or a family instance, or ``None``;
        no family is expanded (the key's integers are parsed and the ranges checked)."""
        lookup = self._find_cache
        if lookup is None:
            from shardkeep.manifest.families import FamilyIndex

            lookup = self._find_cache = (
                {tensor.key: tensor for tensor in self.sharded},
                FamilyIndex(self.families or []),
            )
        singles, families = lookup
        found = singles.get(key)
        return found if found is not None else families.find(key)

    def share_described(self, view: IndexedManifest) -> None:
        """Give ``view`` (a copy of this manifest with other files) the instances already built."""
        view._described_cache = self._described_cache
        view._find_cache = self._find_cache


_PLACEMENT = re.compile(r"R|S(\d{1,3})(?:/([1-9]\d{0,5}))?")


def parse_placements(placements: Sequence[str], ndim: int) -> tuple[int | tuple[int, int] | None, ...] | None:
    """Placement names as what each mesh dimension does to the tensor: ``"R"`` replicates
    (``None``), ``"S<d>"`` splits dimension ``d`` (``d``), ``"S<d>/<f>"`` splits it as
    ``_StridedShard(d, split_factor=f)`` does (``(d, f)``); ``None`` when a name is not valid
    for a tensor of ``ndim`` dimensions."""
    dims: list[int | tuple[int, int] | None] = []
    for name in placements:
        match = _PLACEMENT.fullmatch(name) if isinstance(name, str) else None
        if match is None:
            return None
        if match.group(1) is None:
            dims.append(None)
            continue
        dim = int(match.group(1))
        if dim >= ndim:
            return None
        dims.append(dim if match.group(2) is None else (dim, int(match.group(2))))
    return tuple(dims)


def stored_bytes(manifest: Manifest) -> int:
    """Bytes on storage of a checkpoint's data files, including (format 2.x) the files that
    the rank indexes list when ``manifest`` is the root alone."""
    total = sum(record.stored_size for record in manifest.files)
    if isinstance(manifest, IndexedManifest):
        table = manifest.indexes
        if table is not None:
            total += sum(table.sizes)  # the index files themselves
            if not manifest.complete:
                total += table.data_bytes
    return total


def has_chunks(manifest: Manifest) -> bool:
    """Whether any tensor entry is a chunk of a sharded tensor (has a ``global_offset``)."""
    offsets = map(_GLOBAL_OFFSET, chain.from_iterable(map(_TENSORS, manifest.files)))
    return any(map(operator.is_not, offsets, repeat(None)))


def lineage(manifest: Manifest) -> list[HistoryPoint]:
    """The saves of the run that led to ``manifest``, oldest first, ending with its own (at most
    ``MAX_HISTORY``): what the run's next checkpoint records as ``run.history``."""
    earlier = manifest.run.history if manifest.run is not None else []
    point = HistoryPoint(step=manifest.step or 0, metrics=dict(manifest.metrics), timing=manifest.timing)
    return [*earlier, point][-MAX_HISTORY:]


def key_for_path(path: KeyPath | tuple[str | int, ...]) -> str:
    """The dotted key of a state path: ``["model", "layers.0.weight"]`` -> ``"model.layers.0.weight"``."""
    return ".".join(str(part) for part in path)


def path_problem(key: str, path: KeyPath, limits: ManifestLimits) -> str | None:
    """Why ``path`` cannot be the state path of ``key`` (too deep, or not joining to ``key``), or None."""
    if len(path) > limits.max_path_components:
        return f"key {key[:80]!r}: path is nested deeper than {limits.max_path_components} components"
    if key_for_path(path) != key:
        return f"key {key[:80]!r} does not match its path {path[:8]!r}"
    return None


#: The largest tensor any dimension or byte stride may describe: strides and sizes are 64-bit
#: signed integers in torch and numpy, so a shape whose extent overflows them (an empty tensor
#: with another dimension of 2**63, say) is refused while parsing, not by a crash on load.
MAX_TENSOR_BYTES = 2**63 - 1


def shape_problem(shape: Sequence[int], itemsize: int) -> str | None:
    """Why ``shape`` (non-negative dimensions) cannot be a tensor: its extent, the product of
    its non-zero dimensions times ``itemsize`` (the largest byte stride an empty tensor of that
    shape would have), must fit in a signed 64-bit integer. None if it can."""
    extent = itemsize
    for dimension in shape:
        if dimension < 0:
            return f"negative dimension {dimension}"
        if dimension:
            extent *= dimension
            if extent > MAX_TENSOR_BYTES:
                return "its extent exceeds 2**63 - 1 bytes (a dimension or stride overflows 64 bits)"
    return None


def short_shape(shape: Sequence[int]) -> str:
    """A shape for a message, with absurd dimensions (10**400) abbreviated."""
    return "[" + ", ".join(str(d) if d < 10**20 else f"<{len(str(d))}-digit number>" for d in shape) + "]"


_LOWER_HEX = re.compile(r"[0-9a-f]+")


def digest_problem(digest: str) -> str | None:
    """What is wrong with ``digest`` (``<algorithm>:<lower-case hex>``), or None."""
    algorithm, _, hex_digest = digest.partition(":")
    expected_len = DIGEST_HEX_LENGTH.get(algorithm)
    if expected_len is None:
        return f"a digest with unknown algorithm {algorithm!r}"
    if len(hex_digest) != expected_len or _LOWER_HEX.fullmatch(hex_digest) is None:
        return f"a malformed {algorithm} digest"
    return None
