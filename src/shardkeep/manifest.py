"""The checkpoint manifest: its schema, strict bounded JSON encoding and decoding, and validation.

The manifest is versioned data (``metadata_version`` is ``"MAJOR.MINOR"``). A reader accepts any
minor version of its own major version: fields it does not know are kept in
:attr:`Manifest.unknown_fields` and otherwise ignored. A newer major version is refused with
:class:`~shardkeep.errors.ManifestVersionError`. Decoding never mutates its input, enforces the
limits in :class:`~shardkeep.config.ManifestLimits` before building objects, and raises only
:class:`~shardkeep.errors.ManifestError` (or a subclass) on bad input.

This module does not import torch. The field-by-field description is in ``docs/manifest.md``.
"""

from __future__ import annotations

import datetime as _dt
import functools
import itertools
import json
import math
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import chain, compress, repeat
from typing import Any, Literal

import msgspec

from shardkeep.config import DIGEST_ALGORITHMS, ManifestLimits
from shardkeep.errors import ManifestError, ManifestVersionError, ShardkeepError
from shardkeep.names import is_derived_name
from shardkeep.progress import collector_paused

__all__ = [
    "DTYPE_ITEMSIZE",
    "FORMAT_NAME",
    "MANIFEST_FILENAME",
    "METADATA_VERSION",
    "RUN_ID_PATTERN",
    "SIGNATURE_FILENAME",
    "DELETING_MARKER",
    "STAGING_MARKER",
    "Compression",
    "ContainerEntry",
    "FileRecord",
    "INDEXED_VERSION",
    "IndexRecord",
    "IndexTable",
    "IndexedManifest",
    "Manifest",
    "Mesh",
    "RankIndex",
    "ShardedTensor",
    "HistoryPoint",
    "RetentionRecord",
    "RunInfo",
    "SaveTiming",
    "Sharding",
    "StateSection",
    "TensorEntry",
    "Tier",
    "Training",
    "ValidationResult",
    "ValueEntry",
    "decode_manifest",
    "encode_manifest",
    "has_chunks",
    "index_path",
    "parse_placements",
    "stored_bytes",
    "is_staging_name",
    "lineage",
    "key_for_path",
    "unsafe_path_reason",
    "validate_manifest",
]

FORMAT_NAME = "shardkeep"
METADATA_VERSION = "1.3"
#: The version of a manifest that describes regularly sharded tensors once, with rank indexes
#: (:class:`IndexedManifest`); saves without such tensors still write :data:`METADATA_VERSION`.
INDEXED_VERSION = "2.0"
INDEX_FORMAT = "shardkeep-index"
#: The most ranks a format 2.0 mesh may have (its rank list is built when an index is read).
MAX_MESH_RANKS = 1 << 20
#: The most (mesh coordinates x split factor) of a ``_StridedShard`` grid, whose chunks a
#: reader works out one coordinate and one piece at a time.
MAX_STRIDED_WORK = 1 << 24
MANIFEST_FILENAME = "manifest.json"
SIGNATURE_FILENAME = "manifest.sig"
#: Staging directories are named ``<final>.tmp-<uuid>``; they are never read as checkpoints.
STAGING_MARKER = ".tmp-"
#: A checkpoint being deleted is first renamed to ``<name>.deleting-<uuid>`` (un-committed).
DELETING_MARKER = ".deleting-"
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

_DIGEST_HEX_LENGTH = {"blake3": 64, "xxh3-128": 32, "sha256": 64}

KeyPath = list[str | int]


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

    metadata_version: str = METADATA_VERSION
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

    @property
    def unknown_fields(self) -> dict[str, Any]:
        found: dict[str, Any] = self.__dict__.get("_unknown_fields", {})
        return found

    def iter_tensors(self) -> list[tuple[FileRecord, TensorEntry]]:
        """Every (file, tensor entry) pair, in file order."""
        return list(chain.from_iterable(zip(repeat(record), record.tensors) for record in self.files))

    @property
    def total_tensor_bytes(self) -> int:
        return sum(map(_NBYTES, chain.from_iterable(map(_TENSORS, self.files))))


class Mesh(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """A device mesh (format 2.0): its shape, and its global ranks in row-major order of the
    mesh coordinates (absent: ``0, 1, ...``, the usual case)."""

    shape: list[int]
    ranks: list[int] | None = None

    def rank_list(self) -> list[int]:
        return self.ranks if self.ranks is not None else list(range(math.prod(self.shape)))


class ShardedTensor(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """A regularly sharded tensor (format 2.0), described once: its chunks are computed from
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
    """One rank's index file (format 2.0), ``index/rank_NNNNN.json``: its path (on an object
    store, below the save attempt's prefix, as data files are), size and digest."""

    rank: int
    path: str
    size: int
    digest: str
    #: Bytes on storage of the data files the index lists (informational: sizes in listings).
    data_bytes: int = 0


class IndexTable(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """The rank indexes of a format 2.0 manifest, one column per field, so that each rank
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
    """A format 2.0 manifest: everything a 1.x manifest holds, except that the chunks of
    regularly sharded tensors are not listed. ``sharded`` describes each such tensor once,
    ``meshes`` the meshes they refer to, and ``indexes`` each rank's index file, which lists
    the files that rank wrote for them and their chunk entries. A reader expands the indexes it
    needs (:mod:`shardkeep.indexes`) into a view with the 1.x shape."""

    meshes: list[Mesh] = msgspec.field(default_factory=list)
    sharded: list[ShardedTensor] = msgspec.field(default_factory=list)
    indexes: IndexTable | None = None

    def index_records(self) -> list[IndexRecord]:
        """The rank indexes, one record each (built once)."""
        found: list[IndexRecord] | None = self.__dict__.get("_index_records")
        if found is None:
            found = self.indexes.records() if self.indexes is not None else []
            self.__dict__["_index_records"] = found
        return found


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
    """Bytes on storage of a checkpoint's data files, including (format 2.0) the files that
    the rank indexes list when ``manifest`` is the root alone."""
    total = sum(record.stored_size for record in manifest.files)
    if isinstance(manifest, IndexedManifest):
        table = manifest.indexes
        if table is not None:
            total += sum(table.sizes)  # the index files themselves
            if not manifest.__dict__.get("complete"):
                total += table.data_bytes
    return total


def index_path(rank: int) -> str:
    """Where the index of ``rank`` lies in a format 2.0 checkpoint."""
    return f"index/rank_{rank:05d}.json"


# Field getters for column-at-a-time work: ``map(_KEY, entries)`` runs in C, with no Python
# frame per entry.
_TENSORS = operator.attrgetter("tensors")
_KEY = operator.attrgetter("key")
_PATH = operator.attrgetter("path")
_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")
_OFFSET = operator.attrgetter("offset")
_NBYTES = operator.attrgetter("nbytes")
_KIND = operator.attrgetter("kind")
_EXPERT_KEY = operator.attrgetter("expert_key")
_GLOBAL_SHAPE = operator.attrgetter("global_shape")
_GLOBAL_OFFSET = operator.attrgetter("global_offset")
_ARRAY_TYPE = operator.attrgetter("array_type")
_DIGEST = operator.attrgetter("digest")
_SIZE = operator.attrgetter("size")
_PARENT = operator.itemgetter(slice(None, -1))
_IS_NOT_NONE = functools.partial(operator.is_not, None)


def has_chunks(manifest: Manifest) -> bool:
    """Whether any tensor entry is a chunk of a sharded tensor (has a ``global_offset``)."""
    return any(map(_IS_NOT_NONE, map(_GLOBAL_OFFSET, chain.from_iterable(map(_TENSORS, manifest.files)))))


def lineage(manifest: Manifest) -> list[HistoryPoint]:
    """The saves of the run that led to ``manifest``, oldest first, ending with its own (at most
    ``MAX_HISTORY``): what the run's next checkpoint records as ``run.history``."""
    earlier = manifest.run.history if manifest.run is not None else []
    point = HistoryPoint(step=manifest.step or 0, metrics=dict(manifest.metrics), timing=manifest.timing)
    return [*earlier, point][-MAX_HISTORY:]


# --------------------------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------------------------

_encoder = msgspec.json.Encoder()


def encode_manifest(manifest: Manifest) -> bytes:
    """The manifest as compact UTF-8 JSON (not yet sealed; see ``integrity.seal_manifest``)."""
    try:
        return _encoder.encode(manifest)
    except (msgspec.EncodeError, OverflowError, TypeError, UnicodeEncodeError) as exc:
        raise ManifestError(f"cannot encode manifest: {exc}") from exc


# --------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_INNERMOST_PAIR = re.compile(rb"\{\}|\[\]")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"{}[]")


def _check_depth(data: bytes, max_depth: int) -> None:
    """Refuse input nested deeper than ``max_depth`` without recursing.

    Strings are removed, then innermost ``{}``/``[]`` pairs are peeled away one level per pass;
    each pass is a single C-speed regex substitution, so the cost is bounded by the limit.
    """
    brackets = _JSON_STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    for _ in range(max_depth):
        if not brackets:
            return
        peeled = _INNERMOST_PAIR.sub(b"", brackets)
        if peeled == brackets:
            raise ManifestError("manifest JSON is malformed: unbalanced brackets")
        brackets = peeled
    if brackets:
        raise ManifestError(f"manifest JSON is nested deeper than the limit of {max_depth}")


def strict_json_hooks(error: type[ShardkeepError], what: str) -> dict[str, Any]:
    """``json.loads`` hooks that refuse duplicate keys and NaN/Infinity with ``error``, naming
    ``what`` (the manifest, a shard header)."""

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in pairs:
            if key in result:
                raise error(f"{what} has a duplicate key {key[:80]!r}")
            result[key] = value
        return result

    def constant(name: str) -> Any:
        raise error(f"{what} contains {name}, which is not valid JSON")

    return {"object_pairs_hook": unique, "parse_constant": constant}


_STRICT_MANIFEST_HOOKS = strict_json_hooks(ManifestError, "manifest JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ManifestError(f"manifest JSON contains the number {text[:40]}, which overflows to infinity")
    return value


#: A JSON escape of a UTF-16 surrogate: such a string may not be valid Unicode text, and this
#: library never writes one (text is UTF-8).
_SURROGATE_ESCAPE = re.compile(rb"(?<!\\)(?:\\\\)*\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
#: What any such escape contains. It starts with a literal, which the regex engine finds with a
#: fast scan; the exact pattern above (its look-behind is tried at every byte, about 45 ms per
#: MiB) runs only when this finds something.
_SURROGATE_CANDIDATE = re.compile(rb"\\u[dD][89a-fA-F]")


def _parse_version(text: object) -> tuple[int, int]:
    if not isinstance(text, str):
        raise ManifestError(f"metadata_version must be a string like '1.0', got {text!r}")
    match = re.fullmatch(r"(\d{1,6})\.(\d{1,6})", text)
    if match is None:
        raise ManifestError(f"metadata_version {text!r} is not of the form MAJOR.MINOR")
    return int(match.group(1)), int(match.group(2))


def parse_json_strict(data: bytes, limits: ManifestLimits) -> Any:
    """Parse JSON bytes, refusing oversized or deep input, duplicate keys, NaN and bad UTF-8."""
    if len(data) > limits.max_bytes:
        raise ManifestError(f"manifest is {len(data)} bytes, over the limit of {limits.max_bytes} bytes{_RAISE_LIMIT}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(f"manifest is not valid UTF-8: {exc}") from exc
    _check_depth(data, limits.max_depth)
    try:
        return json.loads(text, parse_float=_finite_float, **_STRICT_MANIFEST_HOOKS)
    except ManifestError:
        raise
    except (ValueError, RecursionError) as exc:
        raise ManifestError(f"manifest JSON is malformed: {exc}") from exc


_CHILD_STRUCTS: dict[type, dict[str, tuple[type, bool]]] = {}


def _children(cls: type) -> dict[str, tuple[type, bool]]:
    """Encoded field name -> (struct type, is_list) for the nested structs of ``cls``."""
    return _CHILD_STRUCTS.get(cls, {})


_KNOWN_FIELDS: dict[type, frozenset[str]] = {}


def _known_fields(cls: type) -> frozenset[str]:
    known = _KNOWN_FIELDS.get(cls)
    if known is None:
        known = frozenset(f.encode_name for f in msgspec.structs.fields(cls))
        _KNOWN_FIELDS[cls] = known
    return known


def _collect_unknown(raw: Any, cls: type, where: str, out: dict[str, Any]) -> None:
    if not isinstance(raw, dict):
        return
    known = _known_fields(cls)
    if not known.issuperset(raw):
        for key, value in raw.items():
            if key not in known:
                out[f"{where}.{key}" if where else key] = value
    for name, (child, is_list) in _children(cls).items():
        value = raw.get(name)
        if is_list and isinstance(value, list):
            for index, item in enumerate(value):
                _collect_unknown(item, child, f"{where + '.' if where else ''}{name}[{index}]", out)
        elif not is_list:
            _collect_unknown(value, child, f"{where + '.' if where else ''}{name}", out)


_CANONICAL_START = re.compile(rb'\{"metadata_version":"(\d{1,6})\.\d{1,6}","format":"shardkeep",')
_CANONICAL_SEAL = re.compile(rb'"' + SEAL_FIELD.encode() + rb'":"[a-z0-9-]{1,16}:[0-9a-f]{1,128}"\}\n\Z')
#: The struct of each readable major version.
_BY_MAJOR: dict[int, type[Manifest]] = {1: Manifest, 2: IndexedManifest}
_typed_decoders = {major: msgspec.json.Decoder(cls) for major, cls in _BY_MAJOR.items()}


def _json_depth_exceeds(value: Any, limit: int) -> bool:
    """True if a decoded JSON value nests deeper than ``limit`` (recursion is bounded by it)."""
    if limit < 0:
        return True
    if isinstance(value, dict):
        return any(_json_depth_exceeds(item, limit - 1) for item in value.values())
    if isinstance(value, list):
        return any(_json_depth_exceeds(item, limit - 1) for item in value)
    return False


_RAISE_LIMIT = (
    " (the default limits bound what reading an untrusted manifest costs; for a large checkpoint you "
    "trust, pass limits=ManifestLimits(...) with larger values)"
)


def _check_counts(file_count: int, tensor_count: int, limits: ManifestLimits) -> None:
    if file_count > limits.max_files:
        raise ManifestError(f"manifest lists {file_count} files, over the limit of {limits.max_files}{_RAISE_LIMIT}")
    if tensor_count > limits.max_tensors:
        raise ManifestError(
            f"manifest lists {tensor_count} tensors, over the limit of {limits.max_tensors}{_RAISE_LIMIT}"
        )


def _decode_canonical(data: bytes, limits: ManifestLimits) -> Manifest | None:
    """The fast path for bytes exactly as this library encodes them, or ``None``.

    A typed decode followed by a re-encode that must reproduce the input byte for byte (plus the
    seal): that proves there are no duplicate keys, no unknown fields and nothing malformed, so
    the strict slow path is only needed for manifests written some other way.
    """
    match = _CANONICAL_START.match(data)
    decoder = _typed_decoders.get(int(match.group(1))) if match is not None else None
    if decoder is None:
        return None
    try:
        manifest = decoder.decode(data)
        encoded = _encoder.encode(manifest)
    except (msgspec.DecodeError, msgspec.EncodeError, RecursionError, ValueError):
        return None  # the strict path gives the precise error (UnicodeDecodeError is a ValueError)
    if data != encoded:
        body = len(encoded) - 1
        if not (
            data.startswith(memoryview(encoded)[:body])  # compared in place: no copy of either
            and data[body : body + 1] == b","
            and _CANONICAL_SEAL.match(data, body + 1) is not None
        ):
            return None
    depth_budget = limits.max_depth - 4
    if (
        _json_depth_exceeds(manifest.custom_fields, depth_budget)
        or _json_depth_exceeds(manifest.sharding.strategy_info, depth_budget)
        or (manifest.run is not None and _json_depth_exceeds(manifest.run.fingerprint_fields, depth_budget))
        or any(
            isinstance(v.value, (dict, list)) and _json_depth_exceeds(v.value, depth_budget) for v in manifest.values
        )
    ):
        raise ManifestError(f"manifest JSON is nested deeper than the limit of {limits.max_depth}")
    _check_counts(*_counts(manifest), limits)
    return manifest


def _counts(manifest: Manifest) -> tuple[int, int]:
    """(files, tensor entries) that the limits bound: a format 2.0 manifest's rank indexes
    count as files, and its described tensors as entries."""
    files, tensors = len(manifest.files), sum(map(len, map(_TENSORS, manifest.files)))
    if isinstance(manifest, IndexedManifest):
        files += len(manifest.indexes.ranks) if manifest.indexes is not None else 0
        tensors += len(manifest.sharded)
    return files, tensors


def decode_manifest(data: bytes, *, limits: ManifestLimits | None = None) -> Manifest:
    """Decode manifest JSON bytes into a :class:`Manifest`.

    Raises :class:`ManifestVersionError` for a newer major version and :class:`ManifestError`
    for anything malformed, oversized or not matching the schema.
    """
    limits = limits or ManifestLimits()
    # Decoding builds two lists per tensor entry; collections scanning them while they are built
    # would cost more than the decoding itself.
    with collector_paused():
        return _decode(data, limits)


def _decode(data: bytes, limits: ManifestLimits) -> Manifest:
    """:func:`decode_manifest`: the typed fast path, else the strict path."""
    if len(data) > limits.max_bytes:
        raise ManifestError(f"manifest is {len(data)} bytes, over the limit of {limits.max_bytes} bytes{_RAISE_LIMIT}")
    if _SURROGATE_CANDIDATE.search(data) is not None and _SURROGATE_ESCAPE.search(data) is not None:
        raise ManifestError("manifest JSON contains a \\uD800-\\uDFFF surrogate escape; text must be plain UTF-8")
    fast = _decode_canonical(data, limits)
    if fast is not None:
        return fast
    raw = parse_json_strict(data, limits)
    if not isinstance(raw, dict):
        raise ManifestError("manifest JSON must be an object")
    if raw.get("format", FORMAT_NAME) != FORMAT_NAME:
        raise ManifestError(f"not a shardkeep manifest: format is {raw.get('format')!r}")
    major, _minor = _parse_version(raw.get("metadata_version"))
    if major > max(_BY_MAJOR):
        raise ManifestVersionError(str(raw["metadata_version"]), INDEXED_VERSION)
    if major < 1:
        raise ManifestError(f"metadata_version {raw['metadata_version']!r} is not supported")
    cls = _BY_MAJOR[major]
    files = raw.get("files", [])
    if isinstance(files, list):
        table = raw.get("indexes") if major >= 2 else None
        ranks = table.get("ranks") if isinstance(table, dict) else None
        extra = [ranks, raw.get("sharded") if major >= 2 else None]
        _check_counts(
            len(files) + (len(extra[0]) if isinstance(extra[0], list) else 0),
            sum(len(f["tensors"]) for f in files if isinstance(f, dict) and isinstance(f.get("tensors"), list))
            + (len(extra[1]) if isinstance(extra[1], list) else 0),
            limits,
        )
    unknown: dict[str, Any] = {}
    _collect_unknown(raw, cls, "", unknown)
    unknown.pop(SEAL_FIELD, None)
    raw_known = {k: v for k, v in raw.items() if k not in unknown and k != SEAL_FIELD}
    try:
        manifest = msgspec.convert(raw_known, cls, strict=True)
    except msgspec.ValidationError as exc:
        raise ManifestError(f"manifest does not match the schema: {exc}") from exc
    if "created_at" not in raw:
        raise ManifestError("manifest does not match the schema: created_at is missing")
    if unknown:
        manifest.__dict__["_unknown_fields"] = unknown
    return manifest


_CHILD_STRUCTS.update(
    {
        Manifest: {
            "sharding": (Sharding, False),
            "training": (Training, False),
            "tiers": (Tier, True),
            "files": (FileRecord, True),
            "optim_state": (StateSection, False),
            "router_state": (StateSection, False),
            "structure": (ContainerEntry, True),
            "values": (ValueEntry, True),
            "run": (RunInfo, False),
            "timing": (SaveTiming, False),
        },
        FileRecord: {"tensors": (TensorEntry, True), "compression": (Compression, False)},
        ShardedTensor: {},
        RunInfo: {"retention": (RetentionRecord, False), "history": (HistoryPoint, True)},
        HistoryPoint: {"timing": (SaveTiming, False)},
    }
)
_CHILD_STRUCTS[IndexedManifest] = {
    **_CHILD_STRUCTS[Manifest],
    "meshes": (Mesh, True),
    "sharded": (ShardedTensor, True),
    "indexes": (IndexTable, False),
}


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


@dataclass
class ValidationResult:
    """Errors make a manifest unusable; warnings are worth a look but do not block loading."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def is_valid(self) -> bool:
        return not self.errors

    def add_error(self, message: str) -> None:
        self.errors.append(message)

    def add_warning(self, message: str) -> None:
        self.warnings.append(message)


_WINDOWS_DRIVE = re.compile(r"^[A-Za-z]:")
_CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f]")


def unsafe_path_reason(path: str) -> str | None:
    """Why ``path`` is not a safe relative path inside a checkpoint, or ``None`` if it is.

    Safe means: relative, ``/``-separated, no empty, ``.`` or ``..`` component, no backslash,
    no NUL or control character, and not longer than 1024 bytes.
    """
    if not isinstance(path, str) or not path:
        return "path is empty"
    if len(path.encode("utf-8", "surrogatepass")) > 1024:
        return "path is longer than 1024 bytes"
    if path.startswith("/"):
        return "path is absolute"
    if "\\" in path:
        return "path contains a backslash"
    if _CONTROL_CHARACTER.search(path) is not None:
        return "path contains a NUL or control character"
    if _WINDOWS_DRIVE.match(path):
        return "path starts with a drive letter"
    for part in path.split("/"):
        if part in ("", ".", ".."):
            return f"path has a {part or 'empty'!r} component" if part else "path has an empty component"
    return None


_URL = re.compile(r"^[a-z][a-z0-9+.-]*://[^\x00-\x1f]+$")


#: URL schemes a tier location may use: object stores, never a web server or a shell.
TIER_URL_SCHEMES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "file"})


def _is_safe_location(location: str) -> bool:
    """A tier location is an absolute local path or an object-store URL (``s3://bucket/prefix``)."""
    if any(ord(ch) < 0x20 for ch in location):
        return False
    if _URL.match(location):
        scheme, _, rest = location.partition("://")
        return scheme in TIER_URL_SCHEMES and ".." not in rest.split("/")
    return location.startswith("/") and ".." not in location.split("/")


def is_staging_name(name: str) -> bool:
    """True for a staging or being-deleted directory name (of the shape shardkeep creates, see
    :func:`shardkeep.names.is_derived_name`), which is never read as a checkpoint."""
    return is_derived_name(name, STAGING_MARKER) or is_derived_name(name, DELETING_MARKER)


def key_for_path(path: KeyPath | tuple[str | int, ...]) -> str:
    """The dotted key of a state path: ``["model", "layers.0.weight"]`` -> ``"model.layers.0.weight"``."""
    return ".".join(str(part) for part in path)


def _path_problem(key: str, path: KeyPath, limits: ManifestLimits) -> str | None:
    if len(path) > limits.max_path_components:
        return f"key {key[:80]!r}: path is nested deeper than {limits.max_path_components} components"
    if key_for_path(path) != key:
        return f"key {key[:80]!r} does not match its path {path[:8]!r}"
    return None


def validate_manifest(manifest: Manifest, *, limits: ManifestLimits | None = None) -> ValidationResult:
    """Check a decoded manifest for internal consistency. Never raises for bad content.

    The checks run in a fixed order, so the errors are reported in it: the top-level fields,
    the tiers, the files and their tensors, the state tree (parents, values), the run record,
    and the containers."""
    limits = limits or ManifestLimits()
    result = ValidationResult()
    with collector_paused():
        table = _TensorTable(manifest.files)
        _check_top_level(manifest, result.add_error)
        tier_names = _check_tiers(manifest, result.add_error)
        tensor_keys = _check_files(manifest, table, tier_names, limits, result)
        if isinstance(manifest, IndexedManifest):
            chunk_keys = set(compress(table.keys, map(_IS_NOT_NONE, map(_GLOBAL_OFFSET, table.entries))))
            tensor_keys = tensor_keys | _check_indexed(manifest, tensor_keys, chunk_keys, limits, result)
        _check_parents(manifest, table, result.add_error)
        _check_values(manifest, tensor_keys, limits, result.add_error)
        _validate_run(manifest, limits, result)
        _check_containers(manifest, limits, result.add_error)
    return result


def _check_top_level(manifest: Manifest, err: Callable[[str], None]) -> None:
    """The version, ranks, digest algorithm and shard count."""
    try:
        _parse_version(manifest.metadata_version)
    except ManifestError as exc:
        err(str(exc))
    if manifest.world_size < 1:
        err(f"world_size must be >= 1, got {manifest.world_size}")
    if not 0 <= manifest.coordinator_rank < max(manifest.world_size, 1):
        err(f"coordinator_rank {manifest.coordinator_rank} is outside world_size {manifest.world_size}")
    if manifest.digest_algorithm not in DIGEST_ALGORITHMS:
        err(f"digest_algorithm {manifest.digest_algorithm!r} is not one of {', '.join(DIGEST_ALGORITHMS)}")
    if isinstance(manifest, IndexedManifest):
        if manifest.sharding.shard_count < len(manifest.files):
            err(
                f"shard count mismatch: sharding.shard_count is {manifest.sharding.shard_count} "
                f"but the manifest lists {len(manifest.files)} files besides its rank indexes"
            )
    elif manifest.sharding.shard_count != len(manifest.files):
        err(
            f"shard count mismatch: sharding.shard_count is {manifest.sharding.shard_count} "
            f"but the manifest lists {len(manifest.files)} files"
        )


def _check_tiers(manifest: Manifest, err: Callable[[str], None]) -> set[str]:
    """Tier names and ids are unique and locations safe; returns the tier names."""
    tier_names: set[str] = set()
    tier_ids: set[int] = set()
    for tier in manifest.tiers:
        if tier.name in tier_names:
            err(f"tier name {tier.name!r} is defined twice")
        if tier.tier_id in tier_ids:
            err(f"tier_id {tier.tier_id} is defined twice")
        tier_names.add(tier.name)
        tier_ids.add(tier.tier_id)
        if tier.location is not None and not _is_safe_location(tier.location):
            err(
                f"tier {tier.name!r} has location {tier.location!r}: it must be an absolute path or an object-store URL ("
                + ", ".join(sorted(TIER_URL_SCHEMES))
                + ")"
            )
    return tier_names


def _check_files(
    manifest: Manifest, table: _TensorTable, tier_names: set[str], limits: ManifestLimits, result: ValidationResult
) -> set[str]:
    """Every file record and its tensors, with keys unique across files; returns the tensor keys.

    The tensor entries are first checked a column at a time (:func:`_tensors_pass`). When that
    finds nothing, only the file records are checked one by one; otherwise every entry is checked
    one by one, which words each problem, in the same order as always."""
    seen_paths: set[str] = set()
    if _tensors_pass(manifest.files, table, limits):
        for record in manifest.files:
            _check_file_record(record, f"file {record.path!r}", manifest, tier_names, seen_paths, result)
        return table.key_set if table.key_set is not None else set(table.keys)
    seen_keys: dict[tuple[str, tuple[int, ...]], str] = {}
    for record in manifest.files:
        where = f"file {record.path!r}"
        _check_file_record(record, where, manifest, tier_names, seen_paths, result)
        _check_file_tensors(record, where, limits, seen_keys, result)
    return {key for key, _ in seen_keys}


def _check_file_record(
    record: FileRecord,
    where: str,
    manifest: Manifest,
    tier_names: set[str],
    seen_paths: set[str],
    result: ValidationResult,
) -> None:
    """One file's path (safe, unreserved, listed once), rank, size, compression, version, ref, tier, digest."""
    err = result.add_error
    reason = unsafe_path_reason(record.path)
    if reason is not None:
        err(f"unsafe path {record.path!r}: {reason}")
    elif record.path in (MANIFEST_FILENAME, SIGNATURE_FILENAME):
        err(f"unsafe path {record.path!r}: data files may not use a reserved name")
    if record.path in seen_paths:
        err(f"{where} is listed twice")
    seen_paths.add(record.path)
    if not 0 <= record.rank < max(manifest.world_size, 1):
        err(f"{where} has rank {record.rank}, outside world_size {manifest.world_size}")
    if record.size < 0:
        err(f"{where} has a negative size {record.size}")
    if record.compression is not None and (
        record.compression.stored_size < 0 or not -7 <= record.compression.level <= 22
    ):
        err(f"{where} has invalid compression settings {msgspec.to_builtins(record.compression)}")
    if record.version < 0:
        err(f"{where} has a negative version {record.version}")
    if record.ref is not None and (unsafe_path_reason(record.ref) is not None or "/" in record.ref):
        err(f"{where} references checkpoint {record.ref!r}: it must be a single safe name")
    if tier_names and record.tier not in tier_names:
        err(f"{where} is on tier {record.tier!r}, which the manifest does not define")
    if record.digest is None or record.digest == "":
        result.add_warning(f"{where} has no digest; its contents cannot be verified")
    else:
        algorithm = record.digest.partition(":")[0]
        problem = _digest_problem(record.digest)
        if problem:
            err(f"{where} has {problem}")
        elif algorithm != manifest.digest_algorithm:
            result.add_warning(f"{where} uses digest {algorithm}, not the manifest's {manifest.digest_algorithm}")


def _check_file_tensors(
    record: FileRecord,
    where: str,
    limits: ManifestLimits,
    seen_keys: dict[tuple[str, tuple[int, ...]], str],
    result: ValidationResult,
) -> None:
    """One file's tensor entries: each valid, no (key, chunk) seen before, no byte ranges overlapping."""
    ranges: list[tuple[int, int, str]] = []
    for entry in record.tensors:
        _validate_tensor(entry, record, where, limits, result)
        ranges.append((entry.offset, entry.offset + entry.nbytes, entry.key))
        chunk = tuple(entry.global_offset or ())
        previous = seen_keys.get((entry.key, chunk))
        if previous is not None:
            result.add_error(f"duplicate key {entry.key!r} (in {previous} and {record.path!r})")
        else:
            seen_keys[(entry.key, chunk)] = repr(record.path)
    ranges.sort()
    for (start_a, end_a, key_a), (start_b, _end_b, key_b) in itertools.pairwise(ranges):
        if start_b < end_a and end_a > start_a:
            result.add_error(f"{where}: byte ranges of {key_a!r} and {key_b!r} overlap")


class _TensorTable:
    """Every tensor entry of a manifest's files, in file order, with the columns that more than
    one check reads: ``counts`` (entries per file), ``keys``, ``paths`` and their lengths."""

    def __init__(self, files: list[FileRecord]) -> None:
        per_file = list(map(_TENSORS, files))
        self.counts: list[int] = list(map(len, per_file))
        self.entries: list[TensorEntry] = list(chain.from_iterable(per_file))
        self.keys: list[str] = list(map(_KEY, self.entries))
        self.paths: list[KeyPath] = list(map(_PATH, self.entries))
        self.path_lengths: list[int] = list(map(len, self.paths))
        #: The set of keys, once a check has built it.
        self.key_set: set[str] | None = None


#: Entry digests, one per line: exactly what :func:`_digest_problem` accepts.
_DIGEST_LINES = re.compile(r"(?:(?:blake3|sha256):[0-9a-f]{64}\n|xxh3-128:[0-9a-f]{32}\n)*")
#: Column checks keep integers below this, so that sums and products of two stay exact in int64.
_EXACT_LIMIT = 2**62


def _tensors_pass(files: list[FileRecord], table: _TensorTable, limits: ManifestLimits) -> bool:
    """Whether every tensor entry passes every check of :func:`_validate_tensor` and
    :func:`_check_file_tensors` without an error or a warning, decided a column at a time: each
    step maps a C function over a list or runs numpy over an array, so no Python code runs per
    entry. ``False`` means "check entry by entry", which finds and words each problem; it is
    also the answer for anything unusual (a wrong type, an integer beyond 62 bits), so this
    never passes an entry that the entry-by-entry checks would not."""
    if not table.entries:
        return True
    try:
        return _columns_pass(files, table, limits)
    except (TypeError, ValueError, OverflowError, IndexError):
        return False  # wrong types in a manifest built in Python; the per-entry checks report them


def _columns_pass(files: list[FileRecord], table: _TensorTable, limits: ManifestLimits) -> bool:
    """The steps of :func:`_tensors_pass`; each keeps only what a later one needs, so that the
    columns of a large manifest are not all held at once."""
    if not _keys_pass(table, limits):
        return False
    itemsizes = _itemsizes(list(map(_DTYPE, table.entries)))
    if itemsizes is None:
        return False
    nbytes = _nbytes_pass(table.entries, itemsizes, limits)
    if nbytes is None:
        return False
    ranges = _ranges_within_files(files, table, nbytes)
    del nbytes
    return (
        ranges is not None
        and _digests_pass(table.entries)
        and _experts_pass(table.entries)
        and _chunks_pass(table, itemsizes)
        and not _ranges_overlap(*ranges, table.counts)
    )


def _keys_pass(table: _TensorTable, limits: ManifestLimits) -> bool:
    """Keys within ``max_key_bytes``, paths within ``max_path_components``, each key its joined path."""
    limit = limits.max_key_bytes
    keys = table.keys
    if max(map(len, keys)) * 4 > limit and any(
        len(key.encode("utf-8", "surrogatepass")) > limit for key in keys if len(key) * 4 > limit
    ):
        return False
    return max(table.path_lengths) <= limits.max_path_components and _keys_are_joined_paths(table)


#: The work on joined strings is done this many entries at a time, to bound its memory.
_BLOCK = 1 << 16


def _keys_are_joined_paths(table: _TensorTable) -> bool:
    """Whether every key equals :func:`key_for_path` of its path. The keys are joined with NUL
    after each, and the paths' components (as strings) with ``.`` between the components of a
    path and NUL after its last: when neither side holds a NUL of its own (each has exactly one
    per entry), the two strings are equal exactly when every key equals its joined path."""
    keys, paths, lengths = table.keys, table.paths, table.path_lengths
    if min(lengths) == 0:
        return False  # a key for the root; rare enough to be checked entry by entry
    if max(lengths) == 1:
        parts = list(chain.from_iterable(paths))
        return parts == keys or list(map(str, parts)) == keys
    separators = [(".",) * (length - 1) + ("\0",) for length in range(max(lengths) + 1)]
    for start in range(0, len(keys), _BLOCK):
        block = slice(start, start + _BLOCK)
        joined_keys = "\0".join(keys[block]) + "\0"
        pieces = zip(
            map(str, chain.from_iterable(paths[block])),
            chain.from_iterable(map(separators.__getitem__, lengths[block])),
            strict=True,
        )
        joined_paths = "".join(chain.from_iterable(pieces))
        entries = len(keys[block])
        if joined_keys != joined_paths or joined_keys.count("\0") != entries or joined_paths.count("\0") != entries:
            return False
    return True


def _nbytes_pass(entries: list[TensorEntry], itemsizes: Any, limits: ManifestLimits) -> Any:
    """Each entry's ``nbytes`` (an int64 array) when every shape has at most ``max_ndim``
    dimensions, none negative, and ``nbytes`` is its elements times the itemsize (an empty
    tensor's other dimensions fitting in 64 bits); else ``None``."""
    import numpy  # here, not at the top: ``import shardkeep`` stays light

    shapes = list(map(_SHAPE, entries))
    ndims = numpy.fromiter(map(len, shapes), numpy.int64, len(shapes))
    dims = _int64_array(list(chain.from_iterable(shapes)))
    nbytes = _int64_array(list(map(_NBYTES, entries)))
    if ndims.max() > limits.max_ndim or dims is None or nbytes is None or (dims.size and dims.min() < 0):
        return None
    element_counts, estimate = _products(dims, ndims)
    del dims, ndims
    if not (estimate * itemsizes < _EXACT_LIMIT).all() or not numpy.array_equal(element_counts * itemsizes, nbytes):
        return None  # (an estimate of NaN, from infinity times a zero dimension, fails too)
    for index in numpy.flatnonzero(element_counts == 0).tolist():
        # An empty tensor: its other dimensions must still fit in 64 bits.
        if shape_problem(shapes[index], int(itemsizes if itemsizes.ndim == 0 else itemsizes[index])):
            return None
    return nbytes


def _ranges_within_files(files: list[FileRecord], table: _TensorTable, nbytes: Any) -> tuple[Any, Any] | None:
    """Each entry's byte range as (start, end) int64 arrays when every offset is non-negative
    and every range ends within its file; else ``None``."""
    import numpy

    offsets = _int64_array(list(map(_OFFSET, table.entries)))
    sizes = _int64_array(list(map(_SIZE, files)))
    if offsets is None or sizes is None or offsets.min() < 0 or nbytes.min() < 0 or offsets.max() >= _EXACT_LIMIT:
        return None
    ends = offsets + nbytes
    if not (ends <= numpy.repeat(sizes, table.counts)).all():
        return None
    return offsets, ends


def _digests_pass(entries: list[TensorEntry]) -> bool:
    """Every digest an entry has is well formed."""
    digests = list(filter(_IS_NOT_NONE, map(_DIGEST, entries)))
    if not digests:
        return True
    lines = "\n".join(digests) + "\n"
    return lines.count("\n") == len(digests) and _DIGEST_LINES.fullmatch(lines) is not None


def _experts_pass(entries: list[TensorEntry]) -> bool:
    """Every expert tensor has an ``expert_key`` (a missing one is a warning)."""
    kinds = list(map(_KIND, entries))
    if kinds.count("dense") == len(kinds):
        return True
    is_expert = map(operator.eq, kinds, repeat("expert"))
    has_no_key = map(operator.is_, map(_EXPERT_KEY, entries), repeat(None))
    return not any(map(operator.and_, is_expert, has_no_key))


def _int64_array(values: list[Any]) -> Any:
    """``values`` as a numpy int64 array, or ``None`` when they are not all integers that fit."""
    import numpy

    array = numpy.array(values) if values else numpy.zeros(0, numpy.int64)
    return array if array.dtype == numpy.int64 else None


def _itemsizes(dtypes: list[str]) -> Any:
    """Bytes per element of each entry's dtype (a scalar when all are equal), or ``None`` when
    a dtype is unknown."""
    import numpy

    if dtypes.count(dtypes[0]) == len(dtypes):
        itemsize = DTYPE_ITEMSIZE.get(dtypes[0])
        return None if itemsize is None else numpy.int64(itemsize)
    if not set(dtypes).issubset(DTYPE_ITEMSIZE):
        return None
    return numpy.fromiter(map(DTYPE_ITEMSIZE.__getitem__, dtypes), numpy.int64, len(dtypes))


def _products(dims: Any, ndims: Any) -> tuple[Any, Any]:
    """The number of elements of each shape, given all dimensions in one array and each shape's
    length: exact modulo 2**64 (int64 arithmetic wraps), and as a float64 estimate that says
    whether the exact value fits."""
    import numpy

    exact = numpy.ones(len(ndims), numpy.int64)
    estimate = numpy.ones(len(ndims), numpy.float64)
    shaped = ndims > 0
    if dims.size:
        starts = (numpy.cumsum(ndims) - ndims)[shaped]
        exact[shaped] = numpy.multiply.reduceat(dims, starts)
        with numpy.errstate(over="ignore", invalid="ignore"):
            estimate[shaped] = numpy.multiply.reduceat(dims.astype(numpy.float64), starts)
    return exact, estimate


def _chunks_pass(table: _TensorTable, itemsizes: Any) -> bool:
    """The chunk checks of :func:`_validate_tensor` (both of ``global_shape``/``global_offset``
    or neither; a torch tensor; ranks agreeing; inside a global shape that fits in 64 bits) and
    the key checks of :func:`_check_file_tensors` (no key, with its chunk offset, twice)."""
    entries, keys = table.entries, table.keys
    global_shapes = list(map(_GLOBAL_SHAPE, entries))
    global_offsets = list(map(_GLOBAL_OFFSET, entries))
    count = len(entries)
    if global_shapes.count(None) == count and global_offsets.count(None) == count:
        table.key_set = set(keys)
        return len(table.key_set) == count
    whole = list(map(operator.is_, global_shapes, repeat(None)))
    if whole != list(map(operator.is_, global_offsets, repeat(None))):
        return False
    chunked = list(map(operator.not_, whole))
    if any(map(operator.ne, compress(map(_ARRAY_TYPE, entries), chunked), repeat("torch"))):
        return False
    chunk_shapes = list(compress(map(_SHAPE, entries), chunked))
    chunk_global_shapes = list(compress(global_shapes, chunked))
    chunk_offsets = list(compress(global_offsets, chunked))
    ranks = list(map(len, chunk_shapes))
    if list(map(len, chunk_global_shapes)) != ranks or list(map(len, chunk_offsets)) != ranks:
        return False
    flat_global = list(chain.from_iterable(chunk_global_shapes))
    flat_offsets = list(chain.from_iterable(chunk_offsets))
    if min(flat_global, default=0) < 0 or min(flat_offsets, default=0) < 0:
        return False
    chunk_itemsizes = list(compress(itemsizes.tolist(), chunked)) if itemsizes.ndim else [int(itemsizes)] * len(ranks)
    if 0 in flat_global:
        if any(map(shape_problem, chunk_global_shapes, chunk_itemsizes)):
            return False
    elif max(map(operator.mul, map(math.prod, chunk_global_shapes), chunk_itemsizes)) > MAX_TENSOR_BYTES:
        return False
    ends = map(operator.add, flat_offsets, chain.from_iterable(chunk_shapes))
    if not all(map(operator.le, ends, flat_global)):
        return False
    identities = set(zip(compress(keys, whole), repeat(())))
    identities.update(zip(compress(keys, chunked), map(tuple, chunk_offsets), strict=True))
    return len(identities) == count


def _ranges_overlap(starts: Any, stops: Any, counts: list[int]) -> bool:
    """Whether, as :func:`_check_file_tensors` sees it, two byte ranges of one file overlap:
    in the order of (file, start, end), a range starts before its predecessor ends (a range of
    zero bytes overlaps nothing). Ranges are usually listed in that order already."""
    import numpy

    files = numpy.repeat(numpy.arange(len(counts)), counts)
    same_file = files[1:] == files[:-1]
    in_order = ~same_file | (starts[1:] > starts[:-1]) | ((starts[1:] == starts[:-1]) & (stops[1:] >= stops[:-1]))
    if not in_order.all():
        order = numpy.lexsort((stops, starts, files))
        starts, stops = starts[order], stops[order]
    return bool((same_file & (starts[1:] < stops[:-1]) & (stops[:-1] > starts[:-1])).any())


def _check_parents(manifest: Manifest, table: _TensorTable, err: Callable[[str], None]) -> None:
    """When ``structure`` lists containers, every tensor, value and container has its parent there."""
    containers = {tuple(container.path) for container in manifest.structure}
    if not containers or _parents_pass(manifest, table, containers):
        return
    orphans = [
        entry.key for record in manifest.files for entry in record.tensors if tuple(entry.path[:-1]) not in containers
    ]
    if isinstance(manifest, IndexedManifest):
        orphans += [tensor.key for tensor in manifest.sharded if tuple(tensor.path[:-1]) not in containers]
    orphans += [value.key for value in manifest.values if tuple(value.path[:-1]) not in containers]
    orphans += [key_for_path(c.path) for c in manifest.structure if c.path and tuple(c.path[:-1]) not in containers]
    if orphans:
        err(f"{len(orphans)} state path(s) have no parent container in structure, e.g. {orphans[0]!r}")


def _parents_pass(manifest: Manifest, table: _TensorTable, containers: set[tuple[str | int, ...]]) -> bool:
    """Whether every parent is in ``containers``, decided a column at a time (``False`` also for
    an unhashable path component, which the entry-by-entry check then raises on)."""
    try:
        return (
            (
                () in containers
                if max(table.path_lengths, default=0) <= 1
                else containers.issuperset(map(tuple, map(_PARENT, table.paths)))
            )
            and containers.issuperset(map(tuple, map(_PARENT, map(_PATH, manifest.values))))
            and (
                not isinstance(manifest, IndexedManifest)
                or containers.issuperset(map(tuple, map(_PARENT, map(_PATH, manifest.sharded))))
            )
            and containers.issuperset(map(tuple, map(_PARENT, filter(None, map(_PATH, manifest.structure)))))
        )
    except TypeError:
        return False


def _check_values(
    manifest: Manifest, tensor_keys: set[str], limits: ManifestLimits, err: Callable[[str], None]
) -> None:
    """Plain values: keys unique (and not a tensor's), ``value`` or ``special`` set, paths matching keys."""
    value_keys: set[str] = set()
    for value in manifest.values:
        if value.key in value_keys or value.key in tensor_keys:
            err(f"duplicate key {value.key!r} in values")
        value_keys.add(value.key)
        if value.special is not None and value.value is not None:
            err(f"value {value.key!r} sets both value and special")
        problem = _path_problem(value.key, value.path, limits)
        if problem:
            err(problem)


def _check_containers(manifest: Manifest, limits: ManifestLimits, err: Callable[[str], None]) -> None:
    """Containers are listed once each and are not nested too deeply."""
    container_paths: set[str] = set()
    for container in manifest.structure:
        rendered = repr(container.path)
        if rendered in container_paths:
            err(f"container {key_for_path(container.path)!r} is listed twice")
        container_paths.add(rendered)
        if len(container.path) > limits.max_path_components:
            err(f"container {key_for_path(container.path[:8])!r}...: path is nested too deeply")


def _check_indexed(
    manifest: IndexedManifest,
    tensor_keys: set[str],
    chunk_keys: set[str],
    limits: ManifestLimits,
    result: ValidationResult,
) -> set[str]:
    """Format 2.0: the meshes, the described tensors (keys unique and not listed as entries,
    valid dtypes, shapes and placements) and the rank indexes (one per rank, in range, with
    well-formed digests). Returns the described keys."""
    err = result.add_error
    world = max(manifest.world_size, 1)
    for position, mesh in enumerate(manifest.meshes):
        where = f"mesh {position}"
        if not mesh.shape or len(mesh.shape) > limits.max_ndim or min(mesh.shape) < 1:
            err(f"{where} has shape {_short(mesh.shape)}: it needs 1 to {limits.max_ndim} dimensions of at least 1")
            continue
        size = math.prod(mesh.shape)
        if size > world or size > MAX_MESH_RANKS:
            err(f"{where} has {size} ranks, more than world_size {manifest.world_size} (or {MAX_MESH_RANKS})")
        elif mesh.ranks is not None and (
            len(mesh.ranks) != size or len(set(mesh.ranks)) != size or not all(0 <= r < world for r in mesh.ranks)
        ):
            err(f"{where} lists ranks that are not {size} distinct ranks below world_size {manifest.world_size}")
    if (
        sum(math.prod(mesh.shape) for mesh in manifest.meshes if 0 < len(mesh.shape) <= limits.max_ndim)
        > 4 * MAX_MESH_RANKS
    ):
        err(f"the meshes have more than {4 * MAX_MESH_RANKS} ranks in all")
    described: set[str] = set()
    strided_grids: set[tuple[object, ...]] = set()
    strided_work = 0
    # A view expanded from the indexes (read_manifest) lists the described tensors' chunks too.
    view = "complete" in manifest.__dict__
    for tensor in manifest.sharded:
        key = tensor.key
        where = f"sharded tensor {key[:80]!r}"
        if key in described or (key in tensor_keys and not (view and key in chunk_keys)):
            err(f"duplicate key {key[:80]!r} (described as a sharded tensor and listed again)")
        described.add(key)
        if len(key.encode("utf-8", "surrogatepass")) > limits.max_key_bytes:
            err(f"{where}: key is longer than {limits.max_key_bytes} bytes")
        problem = _path_problem(key, tensor.path, limits)
        if problem:
            err(problem)
        itemsize = DTYPE_ITEMSIZE.get(tensor.dtype)
        if itemsize is None:
            err(f"{where}: unknown dtype {tensor.dtype!r}")
        shape = tensor.global_shape
        if len(shape) > limits.max_ndim or (shape and min(shape) < 0) or shape_problem(shape, itemsize or 1):
            err(f"{where}: global_shape {_short(shape)} is not a valid shape")
            continue
        if not 0 <= tensor.mesh < len(manifest.meshes):
            err(f"{where}: mesh {tensor.mesh} is not one of the {len(manifest.meshes)} meshes")
            continue
        mesh = manifest.meshes[tensor.mesh]
        dims = parse_placements(tensor.placements, len(shape))
        if dims is None or len(dims) != len(mesh.shape):
            err(
                f"{where}: placements {tensor.placements[:8]!r} are not one of 'R' or 'S<dim>' per dimension of "
                f"mesh {tensor.mesh} (shape {_short(mesh.shape)})"
            )
        else:
            strided = [d for d in dims if isinstance(d, tuple)]
            if len({d[0] for d in strided}) < len(strided):
                err(f"{where}: two strided splits of one tensor dimension (FSDP2 over TP makes at most one)")
            elif any(d[1] * math.prod(mesh.shape) > MAX_STRIDED_WORK for d in strided):
                # A strided grid is worked out coordinate by coordinate, piece by piece: bounded.
                err(f"{where}: a strided split factor times the mesh's size is over {MAX_STRIDED_WORK}")
            elif strided:
                grid = (tuple(shape), tensor.mesh, tuple(tensor.placements))
                if grid not in strided_grids:
                    strided_grids.add(grid)
                    strided_work += max(d[1] for d in strided) * math.prod(mesh.shape)
        if tensor.kind == "expert" and tensor.expert_key is None:
            result.add_warning(f"{where}: expert tensor without an expert_key")
    if manifest.indexes is not None:
        _check_index_table(manifest, manifest.indexes, err)
    if strided_work > 4 * MAX_STRIDED_WORK:
        err(f"the strided grids take more than {4 * MAX_STRIDED_WORK} steps to work out in all")
    has_indexes = manifest.indexes is not None and bool(manifest.indexes.ranks)
    if described and not has_indexes:
        err("the manifest describes sharded tensors but lists no rank index")
    if has_indexes and not described:
        err("the manifest lists rank indexes but describes no sharded tensor")
    return described


def _check_index_table(manifest: Manifest, table: IndexTable, err: Callable[[str], None]) -> None:
    """The rank index table: columns of one length, ranks unique and in range, sizes not
    negative, digests well-formed, a safe directory; a column at a time."""
    count = len(table.ranks)
    if len(table.sizes) != count or len(table.digests) != count:
        err(
            f"indexes: ranks, sizes and digests have different lengths ({count}, {len(table.sizes)}, {len(table.digests)})"
        )
        return
    length = _DIGEST_HEX_LENGTH.get(table.algorithm)
    if length is None:
        err(f"indexes: unknown digest algorithm {table.algorithm!r}")
    elif count and (
        not all(isinstance(d, str) and len(d) == length for d in table.digests)
        or _LOWER_HEX.fullmatch("".join(table.digests)) is None
    ):
        err(f"indexes: a digest is not {length} lower-case hex digits of {table.algorithm}")
    if count and (min(table.ranks) < 0 or max(table.ranks) >= max(manifest.world_size, 1)):
        err(f"indexes: a rank is outside world_size {manifest.world_size}")
    if len(set(table.ranks)) != count:
        err("indexes: a rank is listed twice")
    if (count and min(table.sizes) < 0) or table.data_bytes < 0:
        err("indexes: a negative size")
    if table.prefix and (not table.prefix.endswith("/") or unsafe_path_reason(table.prefix.rstrip("/")) is not None):
        err(f"indexes: prefix {table.prefix[:80]!r} is not a safe directory")
    if any(record.path.startswith(f"{table.prefix}index/") for record in manifest.files):
        err("indexes: a data file is listed inside the index directory")
    if any(not isinstance(ref, str) or "/" in ref or unsafe_path_reason(ref) is not None for ref in table.refs):
        err("indexes: refs must be single safe checkpoint names")


#: A run id: 1-128 characters of letters, digits, ``.``, ``_`` or ``-``, starting alphanumeric.
RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def _validate_run(manifest: Manifest, limits: ManifestLimits, result: ValidationResult) -> None:
    """Metrics and the run record (1.1): names are bounded, numbers finite or null."""
    err = result.add_error
    for name, value in manifest.metrics.items():
        if not name or len(name.encode("utf-8", "surrogatepass")) > limits.max_key_bytes:
            err(f"metric name {name[:64]!r} must be non-empty and at most {limits.max_key_bytes} bytes")
        if value is not None and not math.isfinite(value):
            err(f"metric {name!r} is {value}; non-finite metrics are recorded as null")
    _validate_timing(manifest.timing, "timing", err)
    run = manifest.run
    if run is None:
        return
    if len(run.history) > MAX_HISTORY:
        err(f"run history has {len(run.history)} points; at most {MAX_HISTORY}")
    previous = -1
    for index, point in enumerate(run.history[:MAX_HISTORY]):
        if not previous < point.step < (manifest.step if manifest.step is not None else math.inf):
            err(f"run history[{index}]: step {point.step} must be >= 0, after the previous point and before this save")
        previous = max(previous, point.step)
        if any(
            not name
            or len(name.encode("utf-8", "surrogatepass")) > limits.max_key_bytes
            or (value is not None and not math.isfinite(value))
            for name, value in point.metrics.items()
        ):
            err(f"run history[{index}]: metric names must be non-empty and short, values finite numbers or null")
        _validate_timing(point.timing, f"run history[{index}].timing", err)
    if not RUN_ID_PATTERN.fullmatch(run.run_id):
        err(f"run_id {run.run_id[:64]!r} must be 1-128 characters of letters, digits, '.', '_' or '-'")
    if run.fingerprint is not None:
        problem = _digest_problem(run.fingerprint)
        if problem:
            err(f"run fingerprint has {problem}")
    for name, value in run.fingerprint_fields.items():
        if isinstance(value, (dict, list)):
            err(f"fingerprint field {name!r} must be a scalar (nested values are flattened to dotted paths)")
    if run.retention is not None:
        policy = run.retention
        if policy.keep_last < 0 or policy.keep_best < 0:
            err(f"retention keep_last={policy.keep_last} and keep_best={policy.keep_best} must be >= 0")
        if not policy.metric:
            err("retention metric must be a non-empty string")


def _validate_timing(timing: SaveTiming | None, where: str, err: Callable[[str], None]) -> None:
    if timing is None:
        return
    for name, value in (("blocked_seconds", timing.blocked_seconds), ("total_seconds", timing.total_seconds)):
        if not math.isfinite(value) or value < 0:
            err(f"{where}.{name}={value} must be a finite number >= 0")
    if timing.blocked_seconds > timing.total_seconds:
        err(f"{where}: blocked_seconds={timing.blocked_seconds} exceeds total_seconds={timing.total_seconds}")


# The largest tensor any dimension or byte stride may describe: strides and sizes are 64-bit
# signed integers in torch and numpy, so a shape whose extent overflows them (an empty tensor
# with another dimension of 2**63, say) is refused while parsing, not by a crash on load.
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


def _short(shape: Sequence[int]) -> str:
    """A shape for a message, with absurd dimensions (10**400) abbreviated."""
    return "[" + ", ".join(str(d) if d < 10**20 else f"<{len(str(d))}-digit number>" for d in shape) + "]"


_LOWER_HEX = re.compile(r"[0-9a-f]+")


def _digest_problem(digest: str) -> str | None:
    algorithm, _, hex_digest = digest.partition(":")
    expected_len = _DIGEST_HEX_LENGTH.get(algorithm)
    if expected_len is None:
        return f"a digest with unknown algorithm {algorithm!r}"
    if len(hex_digest) != expected_len or _LOWER_HEX.fullmatch(hex_digest) is None:
        return f"a malformed {algorithm} digest"
    return None


def _validate_tensor(
    entry: TensorEntry, record: FileRecord, where: str, limits: ManifestLimits, result: ValidationResult
) -> None:
    """Checks for one tensor entry. This runs for every tensor on every load, so the common
    (valid) case does no string formatting and no generator expressions."""

    def err(message: str) -> None:
        result.add_error(f"tensor {entry.key!r} in {where}: {message}")

    key = entry.key
    if len(key) * 4 > limits.max_key_bytes and len(key.encode("utf-8", "surrogatepass")) > limits.max_key_bytes:
        err(f"key is longer than {limits.max_key_bytes} bytes")
    path = entry.path
    if len(path) > limits.max_path_components or (key != path[0] if len(path) == 1 else key != key_for_path(path)):
        problem = _path_problem(key, path, limits)
        if problem:
            result.add_error(problem)
    itemsize = DTYPE_ITEMSIZE.get(entry.dtype)
    if itemsize is None:
        err(f"unknown dtype {entry.dtype!r}")
    shape = entry.shape
    if len(shape) > limits.max_ndim:
        err(f"{len(shape)} dimensions, over the limit of {limits.max_ndim}")
        return
    if shape and min(shape) < 0:
        err(f"negative dimension in shape {shape}")
        return
    if itemsize is not None:
        count = math.prod(shape)
        if count * itemsize != entry.nbytes:
            err(f"shape {shape} of {entry.dtype} needs {count * itemsize} bytes, not {entry.nbytes}")
        elif count == 0 and shape_problem(shape, itemsize):
            err(f"shape {_short(shape)}: {shape_problem(shape, itemsize)}")
    if entry.offset < 0 or entry.nbytes < 0:
        err("negative byte offset or size")
    elif entry.offset + entry.nbytes > record.size:
        err(f"byte range [{entry.offset}, {entry.offset + entry.nbytes}) is beyond the file size {record.size}")
    if entry.digest is not None:
        problem = _digest_problem(entry.digest)
        if problem:
            err(f"has {problem}")
    if entry.kind == "expert" and entry.expert_key is None:
        result.add_warning(f"tensor {key!r} in {where}: expert tensor without an expert_key")
    if entry.global_shape is None and entry.global_offset is None:
        return
    if entry.array_type != "torch":
        err("a chunk of a sharded tensor must be a torch tensor")
    if entry.global_shape is None or entry.global_offset is None:
        err("global_shape and global_offset must be given together")
    elif not len(entry.global_shape) == len(entry.global_offset) == len(shape):
        err("shape, global_shape and global_offset have different ranks")
    elif min(entry.global_shape, default=0) < 0 or shape_problem(entry.global_shape, itemsize or 1):
        err(f"global_shape {_short(entry.global_shape)}: {shape_problem(entry.global_shape, itemsize or 1)}")
    elif any(o < 0 or o + s > g for o, s, g in zip(entry.global_offset, shape, entry.global_shape, strict=True)):
        err(f"chunk at {entry.global_offset} of shape {shape} lies outside {entry.global_shape}")
