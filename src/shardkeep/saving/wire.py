"""What a rank sends the coordinator after writing its files: :class:`RankReport`, its msgpack
codec, and the merge of the sharded-tensor descriptions that several reports carry."""

from __future__ import annotations

from typing import NamedTuple

import msgspec

from shardkeep.manifest import ContainerEntry, FileRecord, IndexRecord, Mesh, ShardedTensor

__all__ = ["Descriptions", "RankReport", "decode_report", "encode_report", "merged_descriptions"]


class Descriptions(NamedTuple):
    """The regularly sharded tensors a format 2.0 manifest describes once, and their meshes
    (each tensor's ``mesh`` indexes ``meshes``)."""

    meshes: list[Mesh]
    sharded: list[ShardedTensor]


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
        for tensor in report.sharded:
            if tensor.key in described:
                continue
            mesh = report.meshes[tensor.mesh]
            ident = (tuple(mesh.shape), None if mesh.ranks is None else tuple(mesh.ranks))
            # A renumbered copy: the reports stay as received (a commit may be attempted again).
            described[tensor.key] = msgspec.structs.replace(tensor, mesh=meshes.setdefault(ident, len(meshes)))
    mesh_list = [Mesh(shape=list(shape), ranks=None if ranks is None else list(ranks)) for shape, ranks in meshes]
    return Descriptions(mesh_list, sorted(described.values(), key=lambda tensor: tensor.key))
