"""Node-local parts for tests: split a checkpoint that ``sk.save`` wrote on N ranks into the
directories a node-local level holds on each node (the manifest and signature, every rank
index, the data files of that node's ranks, and ``node-part.json``)."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import shardkeep as sk
from shardkeep.levels.parts import NodePart, encode_node_part, manifest_identity
from shardkeep.names import INDEX_DIRECTORY, MANIFEST_FILENAME, NODE_PART_FILENAME, SIGNATURE_FILENAME


def split_into_nodes(
    checkpoint: Path,
    node_roots: Sequence[Path],
    node_of: Callable[[int], int],
    world_size: int,
    *,
    attempt: str = "0" * 32,
    also: Callable[[int], Sequence[str]] | None = None,
) -> list[NodePart]:
    """Write node ``n``'s part of ``checkpoint`` into ``node_roots[n] / checkpoint.name``: the
    files of the ranks ``node_of`` puts on ``n`` (plus ``also(n)``, files it holds beyond its
    design, recorded as healed). Returns each node's part."""
    manifest = sk.read_manifest(checkpoint)
    sealed = (checkpoint / MANIFEST_FILENAME).read_bytes()
    parts: list[NodePart] = []
    for node, root in enumerate(node_roots):
        ranks = [rank for rank in range(world_size) if node_of(rank) == node]
        files = sorted(record.path for record in manifest.files if record.rank in ranks)
        extra = sorted(set(also(node) if also is not None else ()) - set(files))
        target = root / checkpoint.name
        target.mkdir(parents=True)
        for name in (MANIFEST_FILENAME, SIGNATURE_FILENAME):
            if (checkpoint / name).exists():
                shutil.copy2(checkpoint / name, target / name)
        if (checkpoint / INDEX_DIRECTORY).is_dir():
            shutil.copytree(checkpoint / INDEX_DIRECTORY, target / INDEX_DIRECTORY)
        for path in [*files, *extra]:
            (target / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(checkpoint / path, target / path)
        part = NodePart(
            node=node,
            nodes=len(node_roots),
            ranks=ranks,
            world_size=world_size,
            files=files,
            attempt=attempt,
            manifest_digest=manifest_identity(sealed),
            healed=extra,
        )
        (target / NODE_PART_FILENAME).write_bytes(encode_node_part(part))
        parts.append(part)
    return parts
