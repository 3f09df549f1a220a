"""Fabricate a node-local checkpoint without the node-local save: split an ordinary committed
checkpoint into per-node step directories, as a node-local level lays them out.

Each node's ``<root>/<name>/`` gets the manifest (and signature), every rank index, the data
files written by that node's ranks (a file goes to the node of the rank that wrote it) and a
``node-part.json``. Used by the drain and restore tests.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

from shardkeep.indexes import expand_all, index_paths
from shardkeep.levels.parts import NodePart, encode_node_part, manifest_identity
from shardkeep.manifest.schema import IndexedManifest
from shardkeep.names import MANIFEST_FILENAME, NODE_PART_FILENAME, SIGNATURE_FILENAME
from shardkeep.storage import LocalStore
from shardkeep.verification import parse_manifest


def split_into_nodes(
    checkpoint: Path,
    node_roots: Sequence[Path],
    node_of: Sequence[int],
    *,
    attempt: str = "fabricated",
    run_id: str | None = None,
) -> list[NodePart]:
    """Lay the committed ``checkpoint`` out as node ``n``'s part under ``node_roots[n]/<name>/``
    for every node; ``node_of[rank]`` is each rank's node. Returns each node's part."""
    name = checkpoint.name
    sealed = (checkpoint / MANIFEST_FILENAME).read_bytes()
    manifest = parse_manifest(sealed, where=str(checkpoint))
    if isinstance(manifest, IndexedManifest):
        expanded = expand_all(LocalStore(str(checkpoint.parent)), name, manifest)
        indexes = index_paths(manifest)
    else:
        expanded, indexes = manifest, []
    shared = [MANIFEST_FILENAME, *indexes]
    if (checkpoint / SIGNATURE_FILENAME).exists():
        shared.append(SIGNATURE_FILENAME)
    nodes = len(node_roots)
    parts: list[NodePart] = []
    for node, root in enumerate(node_roots):
        files = [record.path for record in expanded.files if node_of[record.rank] == node]
        target = Path(root) / name
        for relative in [*shared, *files]:
            (target / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(checkpoint / relative, target / relative)
        part = NodePart(
            node=node,
            nodes=nodes,
            ranks=[rank for rank, owner in enumerate(node_of) if owner == node],
            world_size=len(node_of),
            files=files,
            attempt=attempt,
            manifest_digest=manifest_identity(sealed),
            run_id=run_id,
        )
        (target / NODE_PART_FILENAME).write_bytes(encode_node_part(part))
        parts.append(part)
    return parts
