"""The checks of manifest validation that format 2 adds: the meshes, the regularly sharded
tensors described once (keys, dtypes, shapes, placements, the work their grids cost) and the
table of rank indexes. :func:`shardkeep.manifest.validate.validate_manifest` runs them for an
:class:`~shardkeep.manifest.schema.IndexedManifest`; the index files themselves are read and
checked by :mod:`shardkeep.indexes`. This module does not import torch.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

from shardkeep.config import ManifestLimits
from shardkeep.manifest.families import last_instance
from shardkeep.manifest.schema import (
    DIGEST_HEX_LENGTH,
    DTYPE_ITEMSIZE,
    MAX_MESH_RANKS,
    MAX_STRIDED_WORK,
    IndexedManifest,
    IndexTable,
    Manifest,
    ShardedTensor,
    TensorFamily,
    parse_placements,
    path_problem,
    shape_problem,
    short_shape,
)
from shardkeep.names import INDEX_DIRECTORY, unsafe_path_reason

__all__ = ["check_index_table", "check_indexed"]

_LOWER_HEX = re.compile(r"[0-9a-f]+")


Report = Callable[[str], None]


def check_indexed(
    manifest: IndexedManifest,
    tensor_keys: set[str],
    chunk_keys: set[str],
    limits: ManifestLimits,
    err: Report,
    warn: Report,
    families: Sequence[TensorFamily] = (),
) -> set[str]:
    """Format 2.x: the meshes, the described tensors (keys unique and not listed as entries,
    valid dtypes, shapes and placements) and the rank indexes (one per rank, in range, with
    well-formed digests). ``tensor_keys`` are the keys of the tensor entries, ``chunk_keys``
    those of chunk entries. ``families`` are the manifest's tensor families once their set is
    valid (:func:`~shardkeep.manifest.families.family_set_problems`): each is checked as a
    described tensor on the instance with the longest key
    (:func:`~shardkeep.manifest.families.last_instance`), since its instances share every other
    field. Reports errors to ``err`` and warnings to ``warn``; returns the described keys of
    ``sharded`` (family instances are not listed)."""
    _check_meshes(manifest, limits, err)
    described: set[str] = set()
    strided_grids: set[tuple[object, ...]] = set()
    strided_work = 0
    # A view expanded from the indexes (indexes.expand) lists the described tensors' chunks too.
    view = manifest.complete is not None
    for tensor in manifest.sharded:
        key = tensor.key
        if key in described or (key in tensor_keys and not (view and key in chunk_keys)):
            err(f"duplicate key {key[:80]!r} (described as a sharded tensor and listed again)")
        described.add(key)
        grid = _check_sharded(manifest, tensor, limits, err, warn)
        if grid is not None and grid[0] not in strided_grids:
            strided_grids.add(grid[0])
            strided_work += grid[1]
    for family in families:
        prefix = f"tensor family {family.key[:80]!r}, instance "
        grid = _check_sharded(
            manifest,
            last_instance(family),
            limits,
            lambda m, p=prefix: err(p + m),  # type: ignore[misc]
            lambda m, p=prefix: warn(p + m),  # type: ignore[misc]
        )
        if grid is not None and grid[0] not in strided_grids:
            strided_grids.add(grid[0])
            strided_work += grid[1]
    if manifest.indexes is not None:
        check_index_table(manifest, manifest.indexes, err)
    if strided_work > 4 * MAX_STRIDED_WORK:
        err(f"the strided grids take more than {4 * MAX_STRIDED_WORK} steps to work out in all")
    has_indexes = manifest.indexes is not None and bool(manifest.indexes.ranks)
    if (described or manifest.families) and not has_indexes:
        err("the manifest describes sharded tensors but lists no rank index")
    if has_indexes and not (described or manifest.families):
        err("the manifest lists rank indexes but describes no sharded tensor")
    return described


def _check_meshes(manifest: IndexedManifest, limits: ManifestLimits, err: Report) -> None:
    """Each mesh's shape and ranks, and the ranks of all meshes together."""
    world = max(manifest.world_size, 1)
    for position, mesh in enumerate(manifest.meshes):
        where = f"mesh {position}"
        if not mesh.shape or len(mesh.shape) > limits.max_ndim or min(mesh.shape) < 1:
            err(
                f"{where} has shape {short_shape(mesh.shape)}: it needs 1 to {limits.max_ndim} dimensions of at least 1"
            )
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


def _check_sharded(
    manifest: IndexedManifest, tensor: ShardedTensor, limits: ManifestLimits, err: Report, warn: Report
) -> tuple[tuple[object, ...], int] | None:
    """One described tensor: its key, path, dtype, global shape, mesh and placements. Returns
    its strided grid and the work of working it out, when it has one."""
    key = tensor.key
    where = f"sharded tensor {key[:80]!r}"
    if len(key.encode("utf-8", "surrogatepass")) > limits.max_key_bytes:
        err(f"{where}: key is longer than {limits.max_key_bytes} bytes")
    problem = path_problem(key, tensor.path, limits)
    if problem:
        err(problem)
    itemsize = DTYPE_ITEMSIZE.get(tensor.dtype)
    if itemsize is None:
        err(f"{where}: unknown dtype {tensor.dtype!r}")
    shape = tensor.global_shape
    if len(shape) > limits.max_ndim or (shape and min(shape) < 0) or shape_problem(shape, itemsize or 1):
        err(f"{where}: global_shape {short_shape(shape)} is not a valid shape")
        return None
    if not 0 <= tensor.mesh < len(manifest.meshes):
        err(f"{where}: mesh {tensor.mesh} is not one of the {len(manifest.meshes)} meshes")
        return None
    mesh = manifest.meshes[tensor.mesh]
    dims = parse_placements(tensor.placements, len(shape))
    grid: tuple[tuple[object, ...], int] | None = None
    if dims is None or len(dims) != len(mesh.shape):
        err(
            f"{where}: placements {tensor.placements[:8]!r} are not one of 'R' or 'S<dim>' per dimension of "
            f"mesh {tensor.mesh} (shape {short_shape(mesh.shape)})"
        )
    else:
        strided = [d for d in dims if isinstance(d, tuple)]
        if len({d[0] for d in strided}) < len(strided):
            err(f"{where}: two strided splits of one tensor dimension (FSDP2 over TP makes at most one)")
        elif any(d[1] * math.prod(mesh.shape) > MAX_STRIDED_WORK for d in strided):
            # A strided grid is worked out coordinate by coordinate, piece by piece: bounded.
            err(f"{where}: a strided split factor times the mesh's size is over {MAX_STRIDED_WORK}")
        elif strided:
            work = max(d[1] for d in strided) * math.prod(mesh.shape)
            grid = ((tuple(shape), tensor.mesh, tuple(tensor.placements)), work)
    if tensor.kind == "expert" and tensor.expert_key is None:
        warn(f"{where}: expert tensor without an expert_key")
    return grid


def check_index_table(manifest: Manifest, table: IndexTable, err: Report) -> None:
    """The rank index table: columns of one length, ranks unique and in range, sizes not
    negative, digests well-formed, a safe directory; a column at a time."""
    count = len(table.ranks)
    if len(table.sizes) != count or len(table.digests) != count:
        err(
            f"indexes: ranks, sizes and digests have different lengths ({count}, {len(table.sizes)}, {len(table.digests)})"
        )
        return
    length = DIGEST_HEX_LENGTH.get(table.algorithm)
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
    if any(record.path.startswith(f"{table.prefix}{INDEX_DIRECTORY}") for record in manifest.files):
        err("indexes: a data file is listed inside the index directory")
    if any(not isinstance(ref, str) or "/" in ref or unsafe_path_reason(ref) is not None for ref in table.refs):
        err("indexes: refs must be single safe checkpoint names")
