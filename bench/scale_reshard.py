"""``bench/scale.py --reshard R:R2``: the bytes each rank of a world of R2 reads to load a
checkpoint saved by R ranks, with block reads against whole chunks, for the ``Workload``\\ s of
``bench/scale.py``.

Computed, not run: for each sharded tensor the chunks the R saving ranks write (torch's DTensor
arithmetic, ``scale.chunk_of``) and each saving rank's block size (the writer's own
``layout.chunk_block_size`` of the chunks it writes, as ``SaveJob`` picks it by default); for each
loading rank the region its placements give it in the world of R2, and for every saved chunk that
region overlaps, the blocks a block read fetches (``tensors.ranges.block_intervals`` and
``interval_bytes`` on the chunk's shape and its writer's block size, the intervals ``reads.read_blocks`` reads) and
the whole chunk a whole-chunk read fetches. A rank's share is the bytes of its regions. Tensors
of equal shape, dtype, mesh and placements are computed once. Whole tensors (not sharded) are
left out: every rank reads them whole either way (the AdamW ``step`` scalars: kilobytes).
Workloads whose DTensors are replicated over some mesh dimension are refused (which replica
writes a chunk depends on its key); ``dense-70b``, ``moe`` and ``moe-stacked`` have none.

    .venv/bin/python bench/scale.py --reshard 1024:768 --workloads dense-70b,moe
"""

from __future__ import annotations

import bisect
import math
import statistics
import time
from types import ModuleType
from typing import Any

from shardkeep.layout import chunk_block_size
from shardkeep.manifest import DTYPE_ITEMSIZE
from shardkeep.tensors.ranges import block_intervals, interval_bytes


class Incompatible(Exception):
    """The two worlds give the workload different meshes (``moe``'s EP is min(8, R))."""


#: (global shape, dtype, mesh, placements): tensors of one class have the same chunks.
ClassKey = tuple[tuple[int, ...], str, int, tuple[Any, ...]]


def _classes(workload: Any) -> dict[ClassKey, int]:
    """How many sharded tensors of each class the workload holds."""
    counts: dict[ClassKey, int] = {}
    for spec in workload.tensors:
        if spec.placements is None:
            continue
        if any(placement.is_replicate() for placement in spec.placements):
            raise SystemExit(f"--reshard: {workload.name} replicates {spec.key!r}; only unreplicated layouts")
        key = (spec.global_shape, spec.dtype, spec.mesh, spec.placements)
        counts[key] = counts.get(key, 0) + 1
    return counts


def _chunks(scale: ModuleType, workload: Any, key: ClassKey) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """(rank, offset, shape) of each non-empty chunk of a tensor of class ``key``."""
    shape, _, mesh_index, placements = key
    mesh = workload.meshes[mesh_index]
    found = []
    for rank, coordinate in mesh.coordinates().items():
        local, offset = scale.chunk_of(shape, mesh.shape, coordinate, placements)
        if math.prod(local):
            found.append((rank, offset, local))
    return found


def _block_sizes(scale: ModuleType, workload: Any, classes: dict[ClassKey, int]) -> dict[int, int]:
    """Each saving rank's chunk block size: ``chunk_block_size`` of the chunks it writes."""
    sizes: dict[int, list[int]] = {}
    for key, count in classes.items():
        itemsize = DTYPE_ITEMSIZE[key[1]]
        for rank, _, local in _chunks(scale, workload, key):
            sizes.setdefault(rank, []).extend([math.prod(local) * itemsize] * count)
    return {rank: chunk_block_size(chunk_sizes) for rank, chunk_sizes in sizes.items()}


def _overlap(
    a_offset: tuple[int, ...], a_shape: tuple[int, ...], b_offset: tuple[int, ...], b_shape: tuple[int, ...]
) -> tuple[list[int], list[int]] | None:
    """The intersection of box b with chunk a, in a's coordinates (offset, size), or None."""
    offset, size = [], []
    for ao, an, bo, bn in zip(a_offset, a_shape, b_offset, b_shape, strict=True):
        low, high = max(ao, bo), min(ao + an, bo + bn)
        if high <= low:
            return None
        offset.append(low - ao)
        size.append(high - low)
    return offset, size


def reshard_reads(
    scale: ModuleType, name: str, saved_world: int, loaded_world: int, block_size: int | None = None
) -> dict[str, Any]:
    """Per loading rank: its share, what block reads fetch and what whole-chunk reads fetch;
    ``block_size`` (bytes) as ``WriteOptions(block_size=...)`` sets it for every saving rank,
    else each rank's default (``layout.chunk_block_size``)."""
    started = time.perf_counter()
    saved, loaded = scale.make_workload(name, saved_world), scale.make_workload(name, loaded_world)
    classes = _classes(saved)
    if classes != _classes(loaded):
        raise Incompatible(f"{name} has other tensors (meshes) at {saved.world} and {loaded.world} ranks")
    block_of = _block_sizes(scale, saved, classes)
    if block_size is not None:
        block_of = dict.fromkeys(block_of, block_size)
    share: dict[int, int] = {}
    blocks: dict[int, int] = {}
    whole: dict[int, int] = {}
    for key, count in classes.items():
        itemsize = DTYPE_ITEMSIZE[key[1]]
        chunks = sorted(_chunks(scale, saved, key), key=lambda chunk: chunk[1])
        starts = [offset[0] for _, offset, _ in chunks]
        ends = [offset[0] + local[0] for _, offset, local in chunks]
        ordered = ends == sorted(ends)  # a product grid: chunks of one row share their extent
        for rank, region_offset, region_shape in _chunks(scale, loaded, key):
            share[rank] = share.get(rank, 0) + math.prod(region_shape) * itemsize * count
            read_blocks = read_whole = 0
            # Chunks that may overlap: those starting before the region's end and (on a product
            # grid) ending after its start, along dim 0.
            last = bisect.bisect_left(starts, region_offset[0] + region_shape[0])
            first = bisect.bisect_right(ends, region_offset[0]) if ordered else 0
            for writer, offset, local in chunks[first:last]:
                box = _overlap(offset, local, region_offset, region_shape)
                if box is None:
                    continue
                nbytes = math.prod(local) * itemsize
                read_whole += nbytes
                size = block_of[writer]
                if size:
                    intervals = block_intervals(local, itemsize, box[0], box[1], size)
                    read_blocks += sum(end - begin for begin, end in interval_bytes(intervals, nbytes, size))
                else:
                    read_blocks += nbytes
            blocks[rank] = blocks.get(rank, 0) + read_blocks * count
            whole[rank] = whole.get(rank, 0) + read_whole * count
    ranks = sorted(rank for rank in share if share[rank])
    block_ratio = [blocks[rank] / share[rank] for rank in ranks]
    whole_ratio = [whole[rank] / share[rank] for rank in ranks]
    return {
        "workload": name,
        "saved": saved.world,
        "loaded": loaded.world,
        "ranks": len(ranks),
        "share_median": statistics.median(share[rank] for rank in ranks),
        "block_sizes": sorted(set(block_of.values())),
        "block_max": max(block_ratio),
        "block_median": statistics.median(block_ratio),
        "block_worst_rank": ranks[block_ratio.index(max(block_ratio))],
        "block_worst_share": share[ranks[block_ratio.index(max(block_ratio))]],
        "block_max_full_share": max(
            (ratio for rank, ratio in zip(ranks, block_ratio, strict=True) if share[rank] >= max(share.values()) / 2),
            default=0.0,
        ),
        "whole_max": max(whole_ratio),
        "whole_median": statistics.median(whole_ratio),
        "total_share": sum(share.values()),
        "total_blocks": sum(blocks.values()),
        "total_whole": sum(whole.values()),
        "seconds": time.perf_counter() - started,
    }


def check_against_save(scale: ModuleType, name: str, world: int) -> int:
    """Compare the chunks and block sizes computed here with the rank indexes of the simulated
    save of ``name`` at ``world`` (``scale.CurrentFormat().save``: the real writer's indexes);
    the number of chunk entries compared; ``SystemExit`` on a difference."""
    import msgspec

    from shardkeep.indexes import read_small
    from shardkeep.manifest import RankIndex, index_path

    workload = scale.make_workload(name, world)
    classes = _classes(workload)
    block_of = _block_sizes(scale, workload, classes)
    expected: dict[tuple[str, tuple[int, ...]], tuple[tuple[int, ...], int]] = {}
    for spec in workload.tensors:
        if spec.placements is None:
            continue
        for rank, offset, local in _chunks(
            scale, workload, (spec.global_shape, spec.dtype, spec.mesh, spec.placements)
        ):
            expected[(spec.key, offset)] = (local, block_of[rank])
    save = scale.CurrentFormat().save(workload)
    store, staging = save.location.store, save.location.name
    found: dict[tuple[str, tuple[int, ...]], tuple[tuple[int, ...], int]] = {}
    for rank in range(workload.world):
        path = f"{staging}/{index_path(rank)}"
        if store.stat(path) is None:
            continue
        index = msgspec.json.decode(read_small(store, path, 1 << 30, SystemExit), type=RankIndex)  # type: ignore[arg-type]
        for record in index.files:
            for entry in record.tensors:
                if entry.global_offset is not None and entry.nbytes:
                    found[(entry.key, tuple(entry.global_offset))] = (tuple(entry.shape), record.block_size)
    if found != expected:
        differ = sorted(set(found.items()) ^ set(expected.items()))[:5]
        raise SystemExit(f"--reshard: {name} at {world}: the simulated save's indexes differ: {differ}")
    return len(found)


def run(args: Any, scale: ModuleType) -> int:
    """``--reshard R:R2[,R:R2]`` for ``--workloads`` (default dense-70b,moe); prints a table."""
    pairs = [tuple(int(n) for n in pair.split(":")) for pair in args.reshard.split(",")]
    names = args.workloads.split(",") if args.workloads else ["dense-70b", "moe"]
    rows, results = [], []
    for name in names:
        for saved_world, loaded_world in pairs:
            try:
                block_size = int(args.block_kib * 1024) if args.block_kib else None
                point = reshard_reads(scale, name, saved_world, loaded_world, block_size)
            except Incompatible as exc:
                print(f"skipped: {exc}")
                continue
            results.append(point)
            rows.append(
                [
                    name,
                    f"{point['saved']:,} -> {point['loaded']:,}",
                    scale.fmt_bytes(point["share_median"]),
                    ", ".join(scale.fmt_bytes(size) for size in point["block_sizes"]),
                    f"{point['block_max']:.3f}x / {point['block_median']:.3f}x",
                    f"{scale.fmt_bytes(point['block_worst_share'])}",
                    f"{point['block_max_full_share']:.3f}x",
                    f"{point['whole_max']:.3f}x / {point['whole_median']:.3f}x",
                    f"{point['total_blocks'] / point['total_share']:.3f}x",
                    f"{point['seconds']:.1f} s",
                ]
            )
    headers = ["workload", "R -> R'", "share (median)", "block sizes", "block reads max / median"]
    headers += ["share of that max's rank", "block reads max, shares >= half the largest"]
    headers += ["whole chunks max / median", "all ranks, block reads", "computed in"]
    print("reshard reads: bytes a loading rank reads / its own share (sharded tensors)")
    print(scale.table(headers, rows))
    for name in names:
        worlds = sorted(saved for saved, _ in pairs)
        world = next((saved for saved in worlds if saved >= 8), worlds[0])  # several EP groups where it can
        if world <= 64:  # a simulated save of that size takes seconds
            count = check_against_save(scale, name, world)
            print(
                f"{name} at R={world}: chunks and block sizes equal the simulated save's rank indexes ({count:,} chunks)"
            )
    if args.json:
        import json

        with open(args.json, "w") as handle:
            json.dump({"reshard": results}, handle, indent=1)
    return 0
