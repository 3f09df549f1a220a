"""Fabricate a node-local checkpoint without the node-local save: split an ordinary committed
checkpoint (``sk.save`` on N ranks) into the per-node step directories a node-local level holds.

Each node's ``<root>/<name>/`` gets the manifest (and signature), every rank index, the data
files written by that node's ranks (a file goes to the node of the rank that wrote it), any
extra files given (recorded as healed) and a ``node-part.json``. Used by the drain and restore
tests.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
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
    node_of: Sequence[int] | Callable[[int], int],
    world_size: int | None = None,
    *,
    attempt: str = "0" * 32,
    run_id: str | None = None,
    also: Callable[[int], Sequence[str]] | None = None,
) -> list[NodePart]:
    """Lay the committed ``checkpoint`` out as node ``n``'s part under ``node_roots[n]/<name>/``
    for every node. ``node_of`` gives each rank's node (a sequence indexed by rank, or a
    function of the rank with ``world_size``); ``also(n)`` names files node ``n`` holds beyond
    its design (recorded as healed). Returns each node's part."""
    if callable(node_of):
        assert world_size is not None, "world_size= is needed with a function node_of"
        owners = [node_of(rank) for rank in range(world_size)]
    else:
        owners = list(node_of)
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
    parts: list[NodePart] = []
    for node, root in enumerate(node_roots):
        files = sorted(record.path for record in expanded.files if owners[record.rank] == node)
        extra = sorted(set(also(node) if also is not None else ()) - set(files))
        target = Path(root) / name
        target.mkdir(parents=True, exist_ok=True)
        for relative in [*shared, *files, *extra]:
            (target / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(checkpoint / relative, target / relative)
        part = NodePart(
            node=node,
            nodes=len(node_roots),
            ranks=[rank for rank, owner in enumerate(owners) if owner == node],
            world_size=len(owners),
            files=files,
            attempt=attempt,
            manifest_digest=manifest_identity(sealed),
            run_id=run_id,
            healed=extra,
        )
        (target / NODE_PART_FILENAME).write_bytes(encode_node_part(part))
        parts.append(part)
    return parts
