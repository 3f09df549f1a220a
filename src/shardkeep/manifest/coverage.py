"""The coverage check: whether the chunks a manifest records tile each sharded tensor's global
shape exactly once (no gaps, no overlaps), so that a save never commits, and a reader never
accepts, a tensor that cannot be assembled.

This module does not import torch: ``verify`` and the CLI use it.
"""

from __future__ import annotations

import math

from shardkeep.manifest.schema import Manifest

__all__ = ["coverage_problems"]


def coverage_problems(manifest: Manifest) -> list[str]:
    """Keys whose chunks do not tile their global shape exactly once (gaps or overlaps)."""
    chunks: dict[str, list[tuple[list[int], list[int], list[int]]]] = {}
    whole: set[str] = set()
    for _, entry in manifest.iter_tensors():
        if entry.global_shape is None or entry.global_offset is None:
            whole.add(entry.key)
        else:
            chunks.setdefault(entry.key, []).append((entry.global_offset, entry.shape, entry.global_shape))
    problems: list[str] = []
    for key, parts in chunks.items():
        if key in whole:
            problems.append(f"tensor {key!r} is stored both whole and as chunks")
            continue
        global_shape = parts[0][2]
        if any(part[2] != global_shape for part in parts):
            problems.append(f"chunks of {key!r} disagree about the global shape")
            continue
        covered = sum(math.prod(shape) for _, shape, _ in parts)
        if covered != math.prod(global_shape):
            problems.append(f"chunks of {key!r} cover {covered} of {math.prod(global_shape)} elements")
            continue
        overlap = _first_overlap(parts)
        if overlap is not None:
            problems.append(f"chunks of {key!r} at {overlap[0]} and {overlap[1]} overlap")
    return problems


def _first_overlap(parts: list[tuple[list[int], list[int], list[int]]]) -> tuple[list[int], list[int]] | None:
    """Two chunks that overlap, or None. A sweep along the dimension with the most distinct
    offsets: only chunks whose intervals overlap there are compared, so the usual shardings
    (row-, column- or grid-wise) cost about n log n rather than n squared."""
    boxes = [(offset, shape) for offset, shape, _ in parts if all(size > 0 for size in shape)]
    if len(boxes) < 2:
        return None
    ndim = len(boxes[0][0])
    if ndim == 0:
        return (boxes[0][0], boxes[1][0])
    axis = max(range(ndim), key=lambda d: len({offset[d] for offset, _ in boxes}))
    boxes.sort(key=lambda box: box[0][axis])
    active: list[tuple[list[int], list[int]]] = []
    for offset, shape in boxes:
        start = offset[axis]
        active = [box for box in active if box[0][axis] + box[1][axis] > start]
        for other_offset, other_shape in active:
            if all(
                a < b + sb and b < a + sa for a, sa, b, sb in zip(offset, shape, other_offset, other_shape, strict=True)
            ):
                return (other_offset, offset)
        active.append((offset, shape))
    return None
