"""What crosses between ranks in a save: :class:`RankReport` (what a rank sends the coordinator
after writing its files) and its msgpack codec, the merge of the sharded-tensor descriptions
that several reports carry, and the committed manifest the coordinator sends every rank
(:func:`encode_committed`: msgpack, with the rank indexes' digests as raw bytes)."""

from __future__ import annotations

from typing import NamedTuple

import msgspec

from shardkeep.manifest import (
    ContainerEntry,
    FileRecord,
    IndexedManifest,
    IndexRecord,
    IndexTable,
    Manifest,
    Mesh,
    ShardedTensor,
)
from shardkeep.manifest.families import expand_entry_families

__all__ = [
    "Descriptions",
    "RankReport",
    "decode_committed",
    "decode_report",
    "encode_committed",
    "encode_report",
    "merged_descriptions",
]


class Descriptions(NamedTuple):
    """The regularly sharded tensors a format 2.x manifest describes once, and their meshes
    (each tensor's ``mesh`` indexes ``meshes``)."""

    meshes: list[Mesh]
    sharded: list[ShardedTensor]


class RankReport(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """What each rank sends the coordinator after writing: O(files it lists + 1), whatever the
    number of chunks it wrote."""

    #: The records of the files the manifest lists (whole tensors, chunks off a grid).
    files: list[FileRecord]
    #: Format 2.x: this rank's index, how many files it lists, their chunk bytes and directories.
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


_PAYLOAD_ENCODER = msgspec.msgpack.Encoder()
_PAYLOAD_DECODER = msgspec.msgpack.Decoder(RankReport)


def encode_report(report: RankReport) -> bytes:
    """``report`` as msgpack bytes (compact, and decoded with their defaults intact, so the
    manifest omits them)."""
    return _PAYLOAD_ENCODER.encode(report)


def decode_report(payload: bytes) -> RankReport:
    """The report :func:`encode_report` encoded."""
    return _PAYLOAD_DECODER.decode(payload)


def merged_descriptions(reports: list[RankReport]) -> Descriptions:
    """Every rank's sharded tensors, each once, with their meshes renumbered into one list."""
    meshes: dict[tuple[tuple[int, ...], tuple[int, ...] | None], int] = {}
    described: dict[str, ShardedTensor] = {}
    for report in reports:
        if not report.sharded:
            continue
        # Each of this report's meshes numbered once, when a new tensor first uses it.
        numbers: list[int | None] = [None] * len(report.meshes)
        for tensor in report.sharded:
            if tensor.key in described:
                continue
            number = numbers[tensor.mesh]
            if number is None:
                mesh = report.meshes[tensor.mesh]
                ident = (tuple(mesh.shape), None if mesh.ranks is None else tuple(mesh.ranks))
                number = numbers[tensor.mesh] = meshes.setdefault(ident, len(meshes))
            # A renumbered copy: the reports stay as received (a commit may be attempted again).
            described[tensor.key] = tensor if number == tensor.mesh else msgspec.structs.replace(tensor, mesh=number)
    mesh_list = [Mesh(shape=list(shape), ranks=None if ranks is None else list(ranks)) for shape, ranks in meshes]
    return Descriptions(mesh_list, sorted(described.values(), key=lambda tensor: tensor.key))


class _Committed(msgspec.Struct, array_like=True, gc=False):
    """The committed manifest as the coordinator sends it to the other ranks: the manifest
    (``indexed``: an :class:`IndexedManifest`), with its index table's hexadecimal digests moved
    into ``digests`` as raw bytes of ``width`` bytes each (``width`` 0: left in the table) and,
    when the table's ranks are ``0, 1, ...``, its ranks left out (``ranks_counted``)."""

    indexed: bool
    manifest: msgspec.Raw
    digests: bytes = b""
    width: int = 0
    ranks_counted: bool = False


_COMMITTED_DECODER = msgspec.msgpack.Decoder(_Committed)
_MANIFEST_DECODER = msgspec.msgpack.Decoder(Manifest)
_INDEXED_DECODER = msgspec.msgpack.Decoder(IndexedManifest)


def _packed_digests(table: IndexTable) -> tuple[bytes, int]:
    """The table's digests as raw bytes and their width, or ``(b"", 0)`` when some digest is
    not lowercase hexadecimal of the common length (then they travel as they are)."""
    hexes = table.digests
    width = len(hexes[0]) // 2 if hexes else 0
    try:
        packed = bytes.fromhex("".join(hexes))
    except ValueError:
        return b"", 0
    if width == 0 or len(packed) != width * len(hexes) or packed.hex() != "".join(hexes):
        return b"", 0
    return packed, width


def encode_committed(manifest: Manifest) -> bytes:
    """``manifest`` as the commit broadcast carries it: msgpack of the manifest, with what grows
    with the number of ranks in its compact form (an :class:`IndexedManifest`'s index digests
    as raw bytes: 32 bytes a rank instead of 64 hexadecimal characters, and ranks ``0, 1, ...``
    left out). :func:`decode_committed` gives back an equal manifest."""
    table = manifest.indexes if isinstance(manifest, IndexedManifest) else None
    if table is None:
        sent = _PAYLOAD_ENCODER.encode(manifest)
        return _PAYLOAD_ENCODER.encode(_Committed(isinstance(manifest, IndexedManifest), msgspec.Raw(sent)))
    packed, width = _packed_digests(table)
    counted = table.ranks == list(range(len(table.ranks)))
    slim = msgspec.structs.replace(table, digests=[] if width else table.digests, ranks=[] if counted else table.ranks)
    sent = _PAYLOAD_ENCODER.encode(msgspec.structs.replace(manifest, indexes=slim))
    return _PAYLOAD_ENCODER.encode(_Committed(True, msgspec.Raw(sent), packed, width, counted))


def decode_committed(payload: bytes) -> Manifest:
    """The manifest :func:`encode_committed` encoded, with the entry families its files carry
    (a manifest as the root records it: ``manifest_build.with_entry_families``) expanded, as a
    decoded root has them."""
    committed = _COMMITTED_DECODER.decode(payload)
    if not committed.indexed:
        return _MANIFEST_DECODER.decode(committed.manifest)
    manifest = _INDEXED_DECODER.decode(committed.manifest)
    for record in manifest.files:
        if record.families:
            expand_entry_families(record)
    table = manifest.indexes
    if table is not None:
        count = len(table.sizes)
        if committed.ranks_counted:
            table.ranks = list(range(count))
        if committed.width:
            hexed = committed.digests.hex()
            step = 2 * committed.width
            table.digests = [hexed[start : start + step] for start in range(0, len(hexed), step)]
    return manifest
