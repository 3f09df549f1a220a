"""The rank indexes of a format 2.x checkpoint: encoding one, reading and checking one, which
ranks' indexes a load needs, and the expanded view (the 1.x shape) built from them.

A format 2.x manifest (:class:`~shardkeep.manifest.IndexedManifest`) describes each regularly
sharded tensor once; the files and chunk entries each rank wrote for them are in that rank's
index, ``index/rank_NNNNN.json``, whose size and digest the manifest records. The chain of trust
stays whole: signature -> manifest seal -> index digest -> file digests -> data.

Reading an index checks more than its digest. Every chunk entry must be the chunk the grid
gives that rank (:class:`~shardkeep.tensors.grid.Grid`: offset, shape, and that this rank is
the replica that writes it), with the described dtype, global shape and path, and the index
must hold every chunk that rank writes. So the chunks of the indexes a load expands tile the
regions it needs exactly, without reading the other ranks' indexes.

This module does not import torch.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import chain
from typing import Any

import msgspec

from shardkeep.config import ManifestLimits
from shardkeep.errors import IntegrityError, ManifestError, ManifestVersionError, ShardkeepError
from shardkeep.integrity import digest_bytes, digests_equal
from shardkeep.manifest import (
    INDEX_FORMAT,
    INDEXED_VERSION,
    WRITTEN_INDEXED_VERSION,
    FileRecord,
    IndexedManifest,
    IndexRecord,
    Manifest,
    RankIndex,
    ShardedTensor,
    Sharding,
    parse_json_strict,
    parse_placements,
    parse_version,
    validate_manifest,
)
from shardkeep.progress import collector_paused
from shardkeep.storage import ByteStore
from shardkeep.tensors.coverage import coverage_problems
from shardkeep.tensors.grid import Grid

__all__ = [
    "encode_index",
    "expand",
    "expand_all",
    "layouts_of",
    "index_paths",
    "is_partial_view",
    "merged",
    "needed_ranks",
    "read_index",
    "read_small",
]

Region = tuple[Sequence[int], Sequence[int]]

_INDEX_DECODER = msgspec.json.Decoder(RankIndex)
_INDEX_ENCODER = msgspec.json.Encoder()


def read_small(store: ByteStore, path: str, limit: int, error: type[ShardkeepError]) -> bytes:
    """The whole file at ``path``, refused before allocation when over ``limit`` bytes."""
    handle = store.open_read(path)
    try:
        if handle.size > limit:
            raise error(
                f"{path} is {handle.size} bytes, over the limit of {limit} (for a large manifest you trust, "
                "pass limits=ManifestLimits(max_bytes=...))"
            )
        buffer = bytearray(handle.size)
        handle.read_into(0, memoryview(buffer))
    finally:
        handle.close()
    return bytes(buffer)


def encode_index(rank: int, files: list[FileRecord], version: str = WRITTEN_INDEXED_VERSION) -> bytes:
    """The bytes of the index of ``rank`` (of the root's ``version``), listing ``files`` with their
    chunk entries."""
    index = RankIndex(format=INDEX_FORMAT, metadata_version=version, rank=rank, files=files)
    return _INDEX_ENCODER.encode(index) + b"\n"


def index_paths(manifest: Manifest) -> list[str]:
    """The index files of a format 2.x manifest (none for 1.x)."""
    if not isinstance(manifest, IndexedManifest):
        return []
    return [record.path for record in manifest.index_records()]


class _Layouts:
    """Per described key: its descriptor and grid; per mesh: each rank's coordinate."""

    def __init__(self, manifest: IndexedManifest) -> None:
        self.manifest = manifest
        described = manifest.described()
        self.tensors: dict[str, ShardedTensor] = {tensor.key: tensor for tensor in described}
        self.grids: dict[str, Grid] = {}
        self._coordinates: dict[int, dict[int, tuple[int, ...]]] = {}
        self._ranks: dict[int, list[int]] = {}
        #: The described keys on each mesh (a rank writes chunks only of its meshes' tensors).
        self.by_mesh: dict[int, list[str]] = {}
        # One grid per (shape, mesh, placements): the instances of a family share theirs.
        shared: dict[tuple[object, ...], Grid] = {}
        for tensor in described:
            self.by_mesh.setdefault(tensor.mesh, []).append(tensor.key)
            signature = (*tensor.global_shape, None, tensor.mesh, *tensor.placements)
            grid = shared.get(signature)
            if grid is None:
                mesh = manifest.meshes[tensor.mesh]
                dims = parse_placements(tensor.placements, len(tensor.global_shape))
                assert dims is not None  # validate_manifest checked it
                grid = shared[signature] = Grid.of(tuple(tensor.global_shape), tuple(mesh.shape), dims)
            self.grids[tensor.key] = grid

    def coordinates(self, mesh: int) -> dict[int, tuple[int, ...]]:
        """Rank -> its coordinate in mesh ``mesh``."""
        found = self._coordinates.get(mesh)
        if found is None:
            shape = self.manifest.meshes[mesh].shape
            found = {rank: _unravel(position, shape) for position, rank in enumerate(self.ranks(mesh))}
            self._coordinates[mesh] = found
        return found

    def rank_at(self, mesh: int, coordinate: Sequence[int]) -> int:
        shape = self.manifest.meshes[mesh].shape
        position = 0
        for size, index in zip(shape, coordinate, strict=True):
            position = position * size + index
        return self.ranks(mesh)[position]

    def ranks(self, mesh: int) -> list[int]:
        """The ranks of mesh ``mesh`` in row-major order (built once, when first needed)."""
        found = self._ranks.get(mesh)
        if found is None:
            found = self._ranks[mesh] = self.manifest.meshes[mesh].rank_list()
        return found

    def expected(self, rank: int) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
        """Every chunk ``rank`` writes: key -> (global offset, shape)."""
        chunks: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        for mesh, keys in self.by_mesh.items():
            coordinate = self.coordinates(mesh).get(rank)
            if coordinate is None:
                continue  # not on this mesh: none of its tensors
            for key in keys:
                box = self.grids[key].writes(key, coordinate)
                if box is not None:
                    chunks[key] = box
        return chunks


def layouts_of(manifest: IndexedManifest) -> _Layouts:
    """The grids and mesh coordinates of a format 2.x manifest, to share between the
    :func:`read_index` calls of one reading."""
    return _Layouts(manifest)


def _unravel(position: int, shape: Sequence[int]) -> tuple[int, ...]:
    coordinate = []
    for size in reversed(shape):
        coordinate.append(position % size)
        position //= size
    return tuple(reversed(coordinate))


def read_index(
    store: ByteStore,
    name: str,
    manifest: IndexedManifest,
    record: IndexRecord,
    limits: ManifestLimits | None = None,
    layouts: _Layouts | None = None,
) -> list[FileRecord]:
    """The file records of one rank index, checked: size and digest against ``record``, its
    version (that of the root; a newer major is a :class:`ManifestVersionError`), decoding
    (strict and canonical up to this reader's minor, strict JSON with unknown fields ignored for
    a newer minor), the records and entries as :func:`~shardkeep.manifest.validate_manifest`
    checks them, and every chunk against the grid (this rank's chunks, all of them, nothing
    else). Raises :class:`IntegrityError` for bytes that do not match and
    :class:`ManifestError` for content that is wrong."""
    limits = limits or ManifestLimits()
    where = f"{name}/{record.path}"
    data = read_small(store, where, limits.max_bytes, ManifestError)
    if len(data) != record.size:
        raise IntegrityError(f"{where}: size is {len(data)} bytes, the manifest records {record.size}", [where])
    algorithm = record.digest.partition(":")[0]
    if not digests_equal(record.digest, digest_bytes(algorithm, data)):
        raise IntegrityError(f"{where}: digest mismatch (the index was changed or damaged)", [where])
    index = _decode_index(data, where, manifest, limits)
    problems = _index_problems(index, record, manifest, limits, layouts or _Layouts(manifest))
    if problems:
        more = f"; ... and {len(problems) - 20} more problems" if len(problems) > 20 else ""
        raise ManifestError(f"{where}: invalid rank index: " + "; ".join(problems[:20]) + more)
    return index.files


_INDEX_START = re.compile(rb'\{"format":"' + INDEX_FORMAT.encode() + rb'","metadata_version":"(\d{1,6}\.\d{1,6})"')


def _decode_index(data: bytes, where: str, manifest: IndexedManifest, limits: ManifestLimits) -> RankIndex:
    """The index in ``data``, decoded by its version: a newer major is refused
    (:class:`ManifestVersionError`); an index of this reader's minor or an older one must be
    exactly as a save writes it (no unknown field at any depth, nothing spelled otherwise);
    one of a newer minor is parsed strictly and its unknown fields ignored. Its version must be
    its root's."""
    match = _INDEX_START.match(data)
    raw: Any = None
    try:
        if match is not None:
            version: object = match.group(1).decode()
        else:  # not as a save writes it; the version decides which error to give
            raw = parse_json_strict(data, limits)
            version = raw.get("metadata_version") if isinstance(raw, dict) else None
        major, minor = parse_version(version)
    except ManifestError as exc:
        raise ManifestError(f"{where}: invalid rank index: {exc}") from exc
    assert isinstance(version, str)  # parse_version accepted it
    own_major, own_minor = parse_version(INDEXED_VERSION)
    if major != own_major:
        raise ManifestVersionError(version, INDEXED_VERSION)
    if parse_version(manifest.metadata_version) != (major, minor):
        raise ManifestError(
            f"{where}: invalid rank index: its version {version} is not its root manifest's "
            f"{manifest.metadata_version} (the index and the root come from different saves or writers)"
        )
    if minor > own_minor:
        return _decode_newer_index(data if raw is None else raw, where, limits)
    try:
        index = _INDEX_DECODER.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{where}: invalid rank index: {exc}") from exc
    if _INDEX_ENCODER.encode(index) + b"\n" != data:
        raise ManifestError(f"{where}: invalid rank index: not in the canonical encoding (an unknown field?)")
    return index


def _decode_newer_index(source: Any, where: str, limits: ManifestLimits) -> RankIndex:
    """An index of a newer minor version: strict JSON (no duplicate key, NaN or bad UTF-8)
    converted to the schema, with the members this reader does not know left out."""
    try:
        raw = parse_json_strict(source, limits) if isinstance(source, bytes) else source
    except ManifestError as exc:
        raise ManifestError(f"{where}: invalid rank index: {exc}") from exc
    if not isinstance(raw, dict):
        raise ManifestError(f"{where}: invalid rank index: not a JSON object")
    known = {name: value for name, value in raw.items() if name in _INDEX_FIELDS}
    try:
        index = msgspec.convert(known, RankIndex, strict=True)
        _INDEX_ENCODER.encode(index)  # refuses text that is not plain UTF-8 (a surrogate escape)
    except (msgspec.ValidationError, msgspec.EncodeError, UnicodeEncodeError) as exc:
        raise ManifestError(f"{where}: invalid rank index: {exc}") from exc
    return index


_INDEX_FIELDS = frozenset(field.encode_name for field in msgspec.structs.fields(RankIndex))


def _index_problems(
    index: RankIndex, record: IndexRecord, manifest: IndexedManifest, limits: ManifestLimits, layouts: _Layouts
) -> list[str]:
    if index.format != INDEX_FORMAT or index.metadata_version.partition(".")[0] != INDEXED_VERSION.partition(".")[0]:
        return [f"format {index.format!r} version {index.metadata_version!r} is not a {INDEX_FORMAT} 2.x index"]
    if index.rank != record.rank:
        return [f"it is the index of rank {index.rank}, not of rank {record.rank}"]
    # The records and entries, checked as a manifest of these files alone would be.
    alone = Manifest(
        files=index.files,
        world_size=manifest.world_size,
        digest_algorithm=manifest.digest_algorithm,
        tiers=manifest.tiers,
        sharding=Sharding(shard_count=len(index.files)),
    )
    problems = list(validate_manifest(alone, limits=limits).errors)
    if problems:
        return problems
    expected = layouts.expected(record.rank)
    if _entries_pass(index, record.rank, expected, layouts):
        return []
    seen: set[str] = set()
    for file in index.files:
        if file.rank != record.rank:
            problems.append(f"file {file.path!r} has rank {file.rank}")
        if file.digest is None:
            problems.append(f"file {file.path!r} has no digest")
        for entry in file.tensors:
            key = entry.key
            tensor = layouts.tensors.get(key)
            if tensor is None:
                problems.append(f"{key!r} is not a sharded tensor the manifest describes")
                continue
            if key in seen:
                problems.append(f"{key!r} is listed twice")
            seen.add(key)
            box = expected.get(key)
            if (
                entry.global_offset is None
                or box is None
                or (tuple(entry.global_offset), tuple(entry.shape)) != box
                or entry.global_shape != tensor.global_shape
                or (entry.dtype, entry.path, entry.kind, entry.expert_key, entry.order)
                != (tensor.dtype, tensor.path, tensor.kind, tensor.expert_key, tensor.order)
            ):
                problems.append(
                    f"the chunk of {key!r} at {entry.global_offset} of shape {entry.shape} is not the chunk "
                    f"rank {record.rank} writes ({'none' if box is None else list(map(list, box))}) "
                    "or does not match its description"
                )
    missing = expected.keys() - seen
    if missing:
        problems.append(f"it lacks the chunks of {len(missing)} tensor(s) this rank writes, e.g. {min(missing)!r}")
    return problems


#: Column getters: ``map(_KEY, entries)`` runs in C, with no Python frame per entry.
_FACTS = operator.attrgetter("key", "dtype", "path", "kind", "expert_key", "order")
_KEY = operator.attrgetter("key")
_GLOBAL_OFFSET = operator.attrgetter("global_offset")
_SHAPE = operator.attrgetter("shape")
_GLOBAL_SHAPE = operator.attrgetter("global_shape")


def _entries_pass(
    index: RankIndex, rank: int, expected: dict[str, tuple[tuple[int, ...], tuple[int, ...]]], layouts: _Layouts
) -> bool:
    """Whether every entry of ``index`` is exactly a chunk ``rank`` writes, with its tensor's
    description, and every such chunk is there: decided with whole-column comparisons (maps
    and dict equality run in C), so that no Python code runs per chunk. ``False`` means "check
    entry by entry", which words each problem."""
    if any(file.rank != rank or file.digest is None for file in index.files):
        return False
    entries = list(chain.from_iterable(file.tensors for file in index.files))
    keys = list(map(_KEY, entries))
    if len(keys) != len(expected) or set(keys) != expected.keys():
        return False
    wanted = [expected[key] for key in keys]
    if list(map(_GLOBAL_OFFSET, entries)) != [list(box[0]) for box in wanted]:
        return False
    if list(map(_SHAPE, entries)) != [list(box[1]) for box in wanted]:
        return False
    tensors = layouts.tensors
    if list(map(_GLOBAL_SHAPE, entries)) != [tensors[key].global_shape for key in keys]:
        return False
    return list(map(_FACTS, entries)) == list(map(_FACTS, map(tensors.__getitem__, keys)))


def needed_ranks(
    manifest: IndexedManifest, wanted: Mapping[str, Region], held: Collection[str] | None = None
) -> set[int]:
    """The ranks whose indexes hold every chunk that overlaps ``wanted`` (key -> this rank's
    (offset, shape)); a described key that ``wanted`` lacks is needed whole, unless ``held``
    (the keys a load reads; ``None``: all) leaves it out."""
    layouts = _Layouts(manifest)
    keys = [key for key in layouts.tensors if held is None or key in held]
    if any(key not in wanted for key in keys):
        return {record.rank for record in manifest.index_records()}
    ranks: set[int] = set()
    cache: dict[tuple[object, ...], list[tuple[int | None, ...]]] = {}
    for key in keys:
        tensor = layouts.tensors[key]
        grid = layouts.grids[key]
        offset, shape = wanted[key]
        signature = (tensor.mesh, grid.global_shape, grid.dims, tuple(offset), tuple(shape))
        shards = cache.get(signature)
        if shards is None:
            shards = cache[signature] = grid.overlapping(offset, shape)
        for shard in shards:
            ranks.add(layouts.rank_at(tensor.mesh, grid.writer(key, shard)))
    return ranks


def expand(
    store: ByteStore,
    name: str,
    manifest: Manifest,
    ranks: Iterable[int] | None = None,
    *,
    limits: ManifestLimits | None = None,
    threads: int = 8,
) -> Manifest:
    """A view of ``manifest`` with the files (and chunk entries) of the indexes of ``ranks``
    (``None``: every rank) listed as in a 1.x manifest, sorted by path. A 1.x manifest is
    returned as it is. The view's ``complete`` attribute says whether every index is in it."""
    if not isinstance(manifest, IndexedManifest):
        return manifest
    by_rank = {record.rank: record for record in manifest.index_records()}
    wanted = sorted(by_rank) if ranks is None else sorted(set(ranks))
    absent = [rank for rank in wanted if rank not in by_rank]
    if absent:
        raise IntegrityError(
            f"{name}: the manifest lists no index for rank(s) {absent[:8]}, which hold chunks this load needs",
            [f"index of rank {rank}" for rank in absent],
        )
    layouts = _Layouts(manifest)
    workers = max(1, min(threads, len(wanted)))
    with collector_paused():
        if workers == 1:  # no pool: starting its one thread costs more than reading the indexes
            parts = [read_index(store, name, manifest, by_rank[rank], limits, layouts) for rank in wanted]
        else:
            with ThreadPoolExecutor(workers) as pool:
                parts = list(
                    pool.map(lambda rank: read_index(store, name, manifest, by_rank[rank], limits, layouts), wanted)
                )
    return merged(name, manifest, parts, complete=len(wanted) == len(by_rank))


def merged(name: str, manifest: IndexedManifest, parts: list[list[FileRecord]], *, complete: bool) -> Manifest:
    """The view of ``manifest`` with the file records of some indexes (``parts``, checked by
    :func:`read_index`); with every index (``complete``), also checked for coverage."""
    files = list(manifest.files)
    paths = {record.path for record in files}
    refs = set(manifest.indexes.refs) if manifest.indexes is not None else set()
    for part in parts:
        for record in part:
            if record.ref is not None and record.ref not in refs:
                raise ManifestError(
                    f"{name}: file {record.path!r} of an index references {record.ref!r}, which the manifest's "
                    "index table does not list"
                )
            if record.path in paths:
                raise ManifestError(f"{name}: file {record.path!r} is listed twice (in the manifest or an index)")
            paths.add(record.path)
            files.append(record)
    files.sort(key=lambda record: record.path)
    view = msgspec.structs.replace(manifest, files=files)
    manifest.share_described(view)
    view.complete = complete
    if complete:
        # Every index is in: the chunks must tile every tensor (an index record missing from
        # the manifest would otherwise leave chunks out unnoticed).
        with collector_paused():
            problems = coverage_problems(view) + [
                f"sharded tensor {key!r} has no chunk in any index" for key in _described_without_chunks(view)
            ]
        if problems:
            more = f"; ... and {len(problems) - 20} more problems" if len(problems) > 20 else ""
            raise ManifestError(f"{name}: invalid manifest: " + "; ".join(problems[:20]) + more)
    return view


def _described_without_chunks(view: IndexedManifest) -> list[str]:
    found = {entry.key for _, entry in view.iter_tensors() if entry.global_offset is not None}
    return sorted(tensor.key for tensor in view.described() if tensor.key not in found)


def expand_all(store: ByteStore, name: str, manifest: Manifest, *, limits: ManifestLimits | None = None) -> Manifest:
    """:func:`expand` with every index: what ``verify``, ``inspect`` and export read."""
    return expand(store, name, manifest, None, limits=limits)


def is_partial_view(manifest: Manifest) -> bool:
    """Whether ``manifest`` is a format 2.x manifest without some of its indexes expanded."""
    return isinstance(manifest, IndexedManifest) and bool(manifest.index_records()) and not manifest.complete
