"""A node's part of a node-local checkpoint: ``node-part.json`` (:data:`~shardkeep.names.NODE_PART_FILENAME`),
written by :mod:`shardkeep.levels.local_save`.

A node-local level keeps, on each node, the checkpoint's manifest and rank indexes (the same
bytes on every node) and the data files of that node's ranks only. Beside them, each node's
step directory holds a :class:`NodePart`: which node wrote it, which ranks and data files it
holds by design, and the digest of the sealed manifest it belongs to. A part whose
``manifest_digest`` differs from the manifest chosen for a step belongs to another attempt of
that step (a save repeated after a rollback) and is never used.
"""

from __future__ import annotations

import blake3
import msgspec

from shardkeep.errors import ManifestError

__all__ = ["NodePart", "decode_node_part", "encode_node_part", "manifest_identity"]


class NodePart(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """What one node's directory of a node-local checkpoint holds.

    ``files`` are the data-file paths (relative to the checkpoint, as the manifest records
    them) this node holds by design; the manifest, the signature, every rank index and this
    file are on every node. ``manifest_digest`` is :func:`manifest_identity` of the sealed
    manifest bytes.
    """

    node: int
    nodes: int
    ranks: list[int]
    world_size: int
    files: list[str]
    attempt: str
    manifest_digest: str
    run_id: str | None = None
    #: Files this node holds beyond its design (copied here by a restore that healed it).
    healed: list[str] = msgspec.field(default_factory=list)
    #: Peer replicas this node holds, recorded once every rank's replication of the step ended
    #: (the step is then *protected*): source node -> the data files of that node's part, at the
    #: same relative paths as on the source node.
    replicas: dict[int, list[str]] = msgspec.field(default_factory=dict)

    def holds(self) -> set[str]:
        """Every data file this part holds: by design, healed, and replicas of other nodes."""
        return set(self.files) | set(self.healed) | {path for paths in self.replicas.values() for path in paths}


def manifest_identity(sealed: bytes) -> str:
    """The identity of a step's manifest: the blake3 digest of its sealed bytes (the same bytes
    on every node and on the persistent copy a drain makes)."""
    return "blake3:" + blake3.blake3(sealed).hexdigest()


def encode_node_part(part: NodePart) -> bytes:
    return msgspec.json.encode(part)


def decode_node_part(data: bytes, *, where: str) -> NodePart:
    """Decode a ``node-part.json``; :class:`~shardkeep.errors.ManifestError` naming ``where``
    when it is not one."""
    try:
        return msgspec.json.decode(data, type=NodePart)
    except msgspec.ValidationError as exc:
        raise ManifestError(f"{where}: not a node part ({exc})") from exc
    except msgspec.DecodeError as exc:
        raise ManifestError(f"{where}: not JSON ({exc})") from exc
