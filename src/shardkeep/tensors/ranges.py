"""Byte ranges of a box: which bytes of a C-contiguous tensor entry a box of it needs, and
which of the entry's fixed-size digest blocks cover them (no torch).

A box is ``(offset, size)`` per dimension, in elements, inside the entry's ``shape``. Its
bytes are runs of the row-major layout: with ``k`` the first dimension from which on the box
covers every later dimension whole, the box is ``prod(size[:k])`` runs of
``size[k] * prod(shape[k+1:]) * itemsize`` bytes each (one run for a box of whole rows, one
per row for a column slice). Block ``j`` of an entry holds its bytes ``[j*B, (j+1)*B)``; a run
``[a, b)`` needs blocks ``a // B`` to ``(b - 1) // B``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

__all__ = ["block_intervals", "box_runs", "byte_runs", "interval_bytes", "run_dim"]


def run_dim(shape: Sequence[int], offset: Sequence[int], size: Sequence[int]) -> int:
    """The dimension ``k`` along which the box's runs lie: every dimension after it is covered
    whole (``0`` for a scalar or a box whose dimensions after the first are whole)."""
    k = len(shape) - 1
    while k > 0 and offset[k] == 0 and size[k] == shape[k]:
        k -= 1
    return max(k, 0)


def box_runs(shape: Sequence[int], itemsize: int, offset: Sequence[int], size: Sequence[int]) -> tuple[int, int, int]:
    """``(k, count, run_bytes)``: the box is ``count`` runs of ``run_bytes`` bytes along
    dimension ``k`` (:func:`run_dim`); ``count`` is 0 for an empty box."""
    _check_box(shape, offset, size)
    if not shape:
        return 0, 1, itemsize
    k = run_dim(shape, offset, size)
    if any(n == 0 for n in size):
        return k, 0, 0
    return k, math.prod(size[:k]), size[k] * math.prod(shape[k + 1 :]) * itemsize


def byte_runs(shape: Sequence[int], itemsize: int, offset: Sequence[int], size: Sequence[int]) -> Iterator[int]:
    """The first byte of each run of the box, in row-major order of the box's leading
    dimensions (each run is ``box_runs(...)[2]`` bytes long)."""
    k, count, _ = box_runs(shape, itemsize, offset, size)
    if count == 0:
        return
    if not shape:
        yield 0
        return
    strides = [math.prod(shape[d + 1 :]) * itemsize for d in range(len(shape))]
    base = offset[k] * strides[k]
    for index in itertools.product(*(range(offset[d], offset[d] + size[d]) for d in range(k))):
        yield base + sum(i * s for i, s in zip(index, strides, strict=False))


def block_intervals(
    shape: Sequence[int], itemsize: int, offset: Sequence[int], size: Sequence[int], block_size: int
) -> list[tuple[int, int]]:
    """The blocks of ``block_size`` bytes the box needs, as sorted, disjoint, non-adjacent
    inclusive intervals ``[j0, j1]``. When the box has more runs than the entry has blocks,
    the single interval from its first to its last block (a superset, found without
    enumerating the runs)."""
    if block_size <= 0:
        raise ValueError(f"block_size={block_size} must be positive")
    k, count, run = box_runs(shape, itemsize, offset, size)
    if count == 0:
        return []
    nbytes = math.prod(shape) * itemsize
    if count > -(-nbytes // block_size):
        strides = [math.prod(shape[d + 1 :]) * itemsize for d in range(len(shape))]
        first = sum(o * s for o, s in zip(offset, strides, strict=True))
        last = sum((o + n - 1) * s for o, n, s in zip(offset[:k], size[:k], strides, strict=False))
        last += offset[k] * strides[k] + run
        return [(first // block_size, (last - 1) // block_size)]
    intervals: list[tuple[int, int]] = []
    for start in byte_runs(shape, itemsize, offset, size):
        j0, j1 = start // block_size, (start + run - 1) // block_size
        if intervals and j0 <= intervals[-1][1] + 1:
            intervals[-1] = (intervals[-1][0], max(intervals[-1][1], j1))
        else:
            intervals.append((j0, j1))
    return intervals


def interval_bytes(intervals: Sequence[tuple[int, int]], nbytes: int, block_size: int) -> list[tuple[int, int]]:
    """The entry-relative byte runs ``[start, end)`` of block intervals, the last block cut at
    the entry's end (``nbytes``)."""
    return [(j0 * block_size, min(nbytes, (j1 + 1) * block_size)) for j0, j1 in intervals]


def _check_box(shape: Sequence[int], offset: Sequence[int], size: Sequence[int]) -> None:
    if not len(shape) == len(offset) == len(size):
        raise ValueError(f"box ({list(offset)}, {list(size)}) does not match shape {list(shape)}")
    for dim, o, n in zip(shape, offset, size, strict=True):
        if o < 0 or n < 0 or o + n > dim:
            raise ValueError(f"box ({list(offset)}, {list(size)}) is not inside shape {list(shape)}")
