"""The save plan: which rank writes which tensor or chunk, and the coverage check at commit.

Every rank describes the tensors it holds as :class:`ItemDescriptor` values; after an
all-gather, every rank computes the same :func:`assign_writers` result, so no second round trip
is needed. A replicated tensor (the DDP case: every rank holds the same key) and a chunk held by
several replicas are written once in total; items are placed largest first on the rank with the
fewest bytes so far, so ranks write about the same number of bytes.

This module does not import torch.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from shardkeep.errors import CoordinationError
from shardkeep.manifest import Manifest

__all__ = ["ItemDescriptor", "assign_writers", "coverage_problems"]


class ItemDescriptor(NamedTuple):
    """What one rank holds for one key: a whole tensor (``global_offset`` is ``None``) or a chunk."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    global_shape: tuple[int, ...] | None
    global_offset: tuple[int, ...] | None

    @property
    def ident(self) -> tuple[str, tuple[int, ...] | None]:
        return (self.key, self.global_offset)


def assign_writers(held: list[list[ItemDescriptor]]) -> list[set[tuple[str, tuple[int, ...] | None]]]:
    """For each rank, the idents it writes. ``held[r]`` lists what rank ``r`` holds.

    Raises :class:`CoordinationError` when ranks disagree about an item (dtype or shape).
    """
    holders: dict[tuple[str, tuple[int, ...] | None], list[int]] = {}
    first: dict[tuple[str, tuple[int, ...] | None], ItemDescriptor] = {}
    for rank, items in enumerate(held):
        for item in items:
            ident = item.ident
            known = first.get(ident)
            if known is None:
                first[ident] = item
                holders[ident] = [rank]
                continue
            if (known.dtype, known.shape, known.global_shape) != (item.dtype, item.shape, item.global_shape):
                raise CoordinationError(
                    f"ranks disagree about tensor {item.key!r}: rank {holders[ident][0]} has "
                    f"{known.dtype}{list(known.shape)}, rank {rank} has {item.dtype}{list(item.shape)}"
                )
            holders[ident].append(rank)
    assigned: list[set[tuple[str, tuple[int, ...] | None]]] = [set() for _ in held]
    load = [0] * len(held)
    order = sorted(first, key=lambda ident: (-first[ident].nbytes, ident[0], ident[1] or ()))
    for ident in order:
        writer = min(holders[ident], key=lambda rank: (load[rank], rank))
        assigned[writer].add(ident)
        load[writer] += first[ident].nbytes
    return assigned


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
