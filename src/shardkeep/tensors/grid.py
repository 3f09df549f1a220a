"""The chunk grid of a regularly sharded tensor: which chunk each rank of a device mesh holds
under ``Shard``, ``Replicate`` and ``_StridedShard`` placements (whether each rank's part is a
box at all, for the strided ones), which chunks overlap a region, and which rank writes each
chunk, computed from (global shape, mesh, placements) alone.

This is what lets a format 2.x manifest describe a sharded tensor once instead of once per
chunk: a reader recomputes the chunks. The arithmetic follows
``torch.distributed.tensor._utils.compute_local_shape_and_global_offset`` exactly (the
``torch.chunk`` split: chunks of ``ceil(n / k)`` rows, the last ones shorter or empty; an
empty chunk's offset is the dimension's size), and a test checks it against torch over many
shapes and meshes.

This module does not import torch: ``verify`` and the CLI use it.
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Sequence
from functools import lru_cache

from shardkeep.manifest import parse_placements

__all__ = [
    "Grid",
    "chunk_writer",
    "parse_placements",
]

Box = tuple[tuple[int, ...], tuple[int, ...]]
#: What a mesh dimension does to the tensor: ``None`` (replicate), ``d`` (``Shard(d)``) or
#: ``(d, split_factor)`` (``_StridedShard``); see :class:`Grid`.
Dim = int | tuple[int, int] | None


def chunk_writer(key: str, offset: Sequence[int], replicas: int) -> int:
    """Which of ``replicas`` holders of the chunk of ``key`` at ``offset`` writes it: the same
    answer on every holder, and on every reader, spread evenly over replicas (a stable hash,
    not Python's)."""
    if replicas <= 1:
        return 0
    return zlib.crc32(f"{key}@{list(offset)}".encode()) % replicas


class Grid:
    """The chunks of one global shape sharded over one mesh shape by one set of placements.

    ``dims[m]`` says what mesh dimension ``m`` does: ``None`` replicates; an integer ``d``
    splits tensor dimension ``d`` (``Shard(d)``); a pair ``(d, f)`` splits it as
    ``_StridedShard(d, split_factor=f)`` does (into ``f`` pieces first, each piece into the
    mesh dimension's size, this rank taking its part of every piece: FSDP2 over tensor
    parallelism). Coordinates are mesh coordinates.
    """

    __slots__ = ("dims", "global_shape", "mesh_shape", "replicas", "size", "strided")

    def __init__(self, global_shape: Sequence[int], mesh_shape: Sequence[int], dims: Sequence[Dim]) -> None:
        self.global_shape = tuple(global_shape)
        self.mesh_shape = tuple(mesh_shape)
        self.dims = tuple(dims)
        self.size = math.prod(self.mesh_shape)
        #: How many ranks hold each chunk (the product of the replicated mesh dimensions).
        self.replicas = math.prod(n for n, d in zip(self.mesh_shape, self.dims, strict=True) if d is None)
        self.strided = any(isinstance(d, tuple) for d in self.dims)

    @classmethod
    @lru_cache(maxsize=4096)
    def of(cls, global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], dims: tuple[Dim, ...]) -> Grid:
        return cls(global_shape, mesh_shape, dims)

    @property
    def empty(self) -> bool:
        return math.prod(self.global_shape) == 0

    def chunk(self, coordinate: Sequence[int]) -> Box:
        """(global offset, shape) of the chunk at a mesh coordinate. (With ``_StridedShard``
        placements a rank's elements may not form a box; :meth:`regular` says whether they do
        at every coordinate, and only then is this the rank's chunk.)"""
        if self.strided:
            return _strided_chunk(self.global_shape, self.mesh_shape, self.dims, tuple(coordinate))[0]
        return _chunk(self.global_shape, self.mesh_shape, self.dims, tuple(coordinate))

    def is_box(self, coordinate: Sequence[int]) -> bool:
        """Whether the elements at ``coordinate`` form one box (see :meth:`regular`)."""
        return not self.strided or _strided_chunk(self.global_shape, self.mesh_shape, self.dims, tuple(coordinate))[1]

    @property
    def regular(self) -> bool:
        """Whether every coordinate's elements form a box (always, without ``_StridedShard``;
        with it, checked at every coordinate, once per grid)."""
        return not self.strided or _all_boxes(self)

    def replica_index(self, coordinate: Sequence[int]) -> int:
        """The position of a coordinate among the holders of its chunk (row-major over the
        replicated mesh dimensions)."""
        index = 0
        for n, d, c in zip(self.mesh_shape, self.dims, coordinate, strict=True):
            if d is None:
                index = index * n + c
        return index

    def writes(self, key: str, coordinate: Sequence[int]) -> Box | None:
        """The chunk the rank at ``coordinate`` writes for ``key``, or ``None``: each non-empty
        chunk is written by the replica :func:`chunk_writer`
        names; a tensor with no elements at all is recorded once, by the mesh's origin."""
        offset, shape = self.chunk(coordinate)
        if self.empty:
            return (offset, shape) if not any(coordinate) else None
        if not math.prod(shape):
            return None
        if chunk_writer(key, offset, self.replicas) != self.replica_index(coordinate):
            return None
        return offset, shape

    def writer(self, key: str, shard_coordinate: Sequence[int | None]) -> tuple[int, ...]:
        """The full coordinate of the rank that writes the chunk at ``shard_coordinate``
        (``None`` in the replicated mesh dimensions)."""
        offset, _ = self.chunk([c or 0 for c in shard_coordinate])
        replica = 0 if self.empty else chunk_writer(key, offset, self.replicas)
        full = list(shard_coordinate)
        for m in reversed(range(len(self.dims))):
            if self.dims[m] is None:
                full[m] = replica % self.mesh_shape[m]
                replica //= self.mesh_shape[m]
        return tuple(int(c or 0) for c in full)

    def overlapping(self, offset: Sequence[int], shape: Sequence[int]) -> list[tuple[int | None, ...]]:
        """The shard coordinates (``None`` in replicated mesh dimensions) of the non-empty
        chunks that overlap the box (``offset``, ``shape``); for a tensor with no elements,
        the origin's. Only the overlapping chunks are visited, not every coordinate."""
        if self.empty:
            return [tuple(None if d is None else 0 for d in self.dims)]
        found: list[tuple[int | None, ...]] = []
        if self.strided:  # no interval arithmetic across a strided split: every coordinate is looked at
            ranges = [range(1) if d is None else range(n) for n, d in zip(self.mesh_shape, self.dims, strict=True)]
            for coordinate in itertools.product(*ranges):
                start, size = self.chunk(coordinate)
                if all(size) and all(
                    e > 0 and s < o + e and o < s + n for s, n, o, e in zip(start, size, offset, shape, strict=True)
                ):
                    found.append(tuple(None if d is None else c for d, c in zip(self.dims, coordinate, strict=True)))
            return found
        self._walk(0, list(self.global_shape), [0] * len(self.global_shape), (), tuple(offset), tuple(shape), found)
        return found

    def _walk(
        self,
        mesh_dim: int,
        shape: list[int],
        start: list[int],
        coordinate: tuple[int | None, ...],
        offset: tuple[int, ...],
        extent: tuple[int, ...],
        found: list[tuple[int | None, ...]],
    ) -> None:
        if mesh_dim == len(self.dims):
            if all(shape) and all(
                e > 0 and s < o + e and o < s + n for s, n, o, e in zip(start, shape, offset, extent, strict=True)
            ):
                found.append(coordinate)
            return
        dim = self.dims[mesh_dim]
        if dim is None:
            self._walk(mesh_dim + 1, shape, start, (*coordinate, None), offset, extent, found)
            return
        assert isinstance(dim, int)
        size, chunks = shape[dim], self.mesh_shape[mesh_dim]
        full = -(-size // chunks)
        if full == 0 or extent[dim] <= 0:
            return
        low = max(0, (offset[dim] - start[dim]) // full)
        high = min(chunks - 1, (offset[dim] + extent[dim] - 1 - start[dim]) // full)
        for index in range(low, high + 1):
            begin = full * index
            length = min(size, begin + full) - begin
            if length <= 0:
                break
            shape_here, start_here = list(shape), list(start)
            shape_here[dim], start_here[dim] = length, start[dim] + begin
            self._walk(mesh_dim + 1, shape_here, start_here, (*coordinate, index), offset, extent, found)


@lru_cache(maxsize=1024)
def _all_boxes(grid: Grid) -> bool:
    ranges = [range(1) if d is None else range(n) for n, d in zip(grid.mesh_shape, grid.dims, strict=True)]
    return all(
        _strided_chunk(grid.global_shape, grid.mesh_shape, grid.dims, coordinate)[1]
        for coordinate in itertools.product(*ranges)
    )


Runs = list[tuple[int, int]]  # an ascending-or-not list of global indices, as (start, stop) runs


def _take(runs: Runs, begin: int, end: int) -> Runs:
    """Positions ``begin`` to ``end`` of the index list that ``runs`` spells out."""
    taken: Runs = []
    position = 0
    for start, stop in runs:
        length = stop - start
        low, high = max(begin, position), min(end, position + length)
        if low < high:
            taken.append((start + low - position, start + high - position))
        position += length
        if position >= end:
            break
    return taken


def _piece(length: int, chunks: int, index: int) -> tuple[int, int]:
    """(begin, end) of piece ``index`` of ``torch.chunk`` of ``length`` items into ``chunks``."""
    full = -(-length // chunks)
    begin = min(full * index, length)
    return begin, min(full * (index + 1), length)


@lru_cache(maxsize=65536)
def _strided_chunk(
    global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], dims: tuple[Dim, ...], coordinate: tuple[int, ...]
) -> tuple[Box, bool]:
    """(the chunk's box, whether the rank's elements are exactly that box): torch's
    arithmetic with every index kept, so that a strided split whose parts are not contiguous
    is seen as such."""
    indices: dict[int, Runs] = {}
    for mesh_dim, how in enumerate(dims):
        if how is None:
            continue
        dim, factor = (how, 0) if isinstance(how, int) else how
        current = indices.get(dim, [(0, global_shape[dim])])
        length = sum(stop - start for start, stop in current)
        chunks, index = mesh_shape[mesh_dim], coordinate[mesh_dim]
        if factor == 0:
            indices[dim] = _take(current, *_piece(length, chunks, index))
        else:
            taken: Runs = []
            for part in range(factor):
                first, last = _piece(length, factor, part)
                begin, end = _piece(last - first, chunks, index)
                taken += _take(current, first + begin, first + end)
            indices[dim] = taken
    offset, shape = [0] * len(global_shape), list(global_shape)
    box = True
    for dim, runs in indices.items():
        merged: Runs = []
        for start, stop in runs:
            if merged and merged[-1][1] == start:
                merged[-1] = (merged[-1][0], stop)
            elif stop > start:
                merged.append((start, stop))
        shape[dim] = sum(stop - start for start, stop in merged)
        offset[dim] = merged[0][0] if merged else global_shape[dim]  # an empty part: as torch records it
        box = box and len(merged) <= 1
    return (tuple(offset), tuple(shape)), box


@lru_cache(maxsize=65536)
def _chunk(
    global_shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    dims: tuple[int | None, ...],
    coordinate: tuple[int, ...],
) -> Box:
    shape = list(global_shape)
    offset = [0] * len(global_shape)
    for mesh_dim, dim in enumerate(dims):
        if dim is None:
            continue
        size, chunks = shape[dim], mesh_shape[mesh_dim]
        full = -(-size // chunks)
        begin = full * coordinate[mesh_dim]
        length = max(0, min(size, begin + full) - begin)
        if length == 0:
            offset[dim] = global_shape[dim]  # as torch records an empty shard
        else:
            offset[dim] += begin
        shape[dim] = length
    return tuple(offset), tuple(shape)
