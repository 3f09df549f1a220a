"""The overlap and assembly arithmetic of resharding: which saved chunks overlap the region a
rank holds, and how a full tensor or a rank's region is put together from them.

A chunk of a sharded tensor is a box (global offset, shape) in the global tensor; a rank that
loads into a DTensor wants the box its local shard covers (:func:`wanted_regions`), reads only
the entries that overlap it (:func:`needed_entries`, and of each the box :func:`needed_box`),
and copies each overlap straight into its local shard (:class:`Region`). A part is a box of
the global tensor and an array holding it: a whole chunk, or the rows of a chunk that a ranged
read covered (:func:`rows_part`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shardkeep.manifest import FileRecord, IndexedManifest, Manifest, ShardedTensor, TensorEntry
from shardkeep.tensors.convert import NAME_TO_TORCH, array_from_buffer, is_dtensor, local_region
from shardkeep.tensors.targets import TargetResolver

__all__ = [
    "Box",
    "Region",
    "assemble",
    "chunk_part",
    "needed_box",
    "needed_entries",
    "overlap",
    "region_slices",
    "rows_part",
    "wanted_regions",
]

#: ``(offset, shape)`` of a box, in elements.
Box = tuple[list[int], list[int]]


class Region:
    """This rank's region of a sharded tensor, to be filled from only the chunks overlapping it.

    Nothing is copied until :meth:`copy_into` (straight into the target's local shard, so a
    load makes one copy) or :meth:`materialize`.
    """

    __slots__ = ("dtype", "global_shape", "offset", "parts", "shape")

    def __init__(
        self,
        parts: list[tuple[Box, Any]],
        offset: list[int],
        shape: list[int],
        global_shape: list[int],
        dtype_name: str,
    ) -> None:
        self.parts = parts
        self.offset = offset
        self.shape = shape
        self.global_shape = global_shape
        self.dtype = NAME_TO_TORCH[dtype_name]

    def copy_into(self, local: torch.Tensor) -> None:
        for (origin, extent), array in self.parts:
            common = overlap(origin, extent, self.offset, self.shape)
            if common is None:
                continue
            start, size = common
            source = tuple(slice(s - o, s - o + n) for s, o, n in zip(start, origin, size, strict=True))
            target = tuple(slice(s - o, s - o + n) for s, o, n in zip(start, self.offset, size, strict=True))
            local[target].copy_(array[source])

    def materialize(self) -> torch.Tensor:
        local = torch.empty(self.shape, dtype=self.dtype)
        self.copy_into(local)
        return local


def assemble(
    tensor: TensorEntry | ShardedTensor, parts: list[tuple[Box, Any]], region: Box | None
) -> tuple[list[str | int], int, Any]:
    """The full ``tensor`` (``region`` None), or a lazy :class:`Region` = (offset, shape) of
    it, from ``parts`` that cover it (coverage was checked with the manifest)."""
    assert tensor.global_shape is not None
    if region is None:
        full = torch.empty(tensor.global_shape, dtype=parts[0][1].dtype)
        for box, array in parts:
            full[region_slices(*box)].copy_(array)
        return tensor.path, tensor.order, full
    offset, shape = region
    return tensor.path, tensor.order, Region(parts, offset, shape, tensor.global_shape, tensor.dtype)


def chunk_part(entry: TensorEntry, array: Any) -> tuple[Box, Any]:
    """The part a whole chunk ``array`` of ``entry`` gives."""
    assert entry.global_offset is not None
    return (list(entry.global_offset), list(entry.shape)), array


def needed_box(entry: TensorEntry, region: Box | None) -> Box | None:
    """The box of chunk ``entry`` (in its own coordinates) that overlaps ``region``, or
    ``None`` when all of it is needed (no region, a whole tensor, or a region covering it)."""
    if region is None or entry.global_offset is None:
        return None
    common = overlap(entry.global_offset, entry.shape, *region)
    if common is None or common[1] == list(entry.shape):
        return None
    start, size = common
    return [s - o for s, o in zip(start, entry.global_offset, strict=True)], size


def rows_part(entry: TensorEntry, box: Box | None, pieces: Sequence[tuple[int, memoryview]]) -> tuple[Box, Any]:
    """The part holding ``box`` of chunk ``entry`` (all of it for None) built from ``pieces``,
    the ``(entry-relative start, bytes)`` a ranged read covered: the rows of the chunk the box
    spans, viewed without a copy when one piece holds them, else copied piece by piece into a
    buffer of those rows (bytes between pieces stay unset; the box never reaches them)."""
    assert entry.global_offset is not None
    shape = list(entry.shape)
    first, count = (box[0][0], box[1][0]) if box is not None and shape else (0, shape[0] if shape else 1)
    row = entry.nbytes // shape[0] if shape and shape[0] else entry.nbytes
    begin, end = first * row, (first + count) * row
    rows = [count, *shape[1:]] if shape else []
    origin = list(entry.global_offset)
    if shape:
        origin[0] += first
    for start, data in pieces:
        if start <= begin and end <= start + len(data):
            array = array_from_buffer(data, entry.dtype, rows, begin - start, end - begin, entry.array_type, entry.key)
            return (origin, rows), array
    buffer = memoryview(bytearray(end - begin))
    for start, data in pieces:
        low, high = max(start, begin), min(start + len(data), end)
        if high > low:
            buffer[low - begin : high - begin] = data[low - start : high - start]
    array = array_from_buffer(buffer, entry.dtype, rows, 0, end - begin, entry.array_type, entry.key)
    return (origin, rows), array


def overlap(
    offset_a: list[int], shape_a: list[int], offset_b: list[int], shape_b: list[int]
) -> tuple[list[int], list[int]] | None:
    """The intersection (start, size) of two boxes, or None if they do not overlap."""
    start = [max(a, b) for a, b in zip(offset_a, offset_b, strict=True)]
    end = [min(a + sa, b + sb) for a, sa, b, sb in zip(offset_a, shape_a, offset_b, shape_b, strict=True)]
    if any(e <= s for s, e in zip(start, end, strict=True)):
        return None
    return start, [e - s for s, e in zip(start, end, strict=True)]


def needed_entries(record: FileRecord, wanted: dict[str, Box]) -> list[int] | None:
    """Indices of the entries of ``record`` this load uses, or None for all of them."""
    if not wanted:
        return None
    indices: list[int] = []
    for index, entry in enumerate(record.tensors):
        region = wanted.get(entry.key)
        if (
            region is None
            or entry.global_offset is None
            or (entry.nbytes and overlap(entry.global_offset, entry.shape, *region) is not None)
        ):
            indices.append(index)
    return None if len(indices) == len(record.tensors) else indices


def wanted_regions(into: Any, manifest: Manifest) -> dict[str, tuple[list[int], list[int]]]:
    """For each sharded key whose target in ``into`` (:mod:`shardkeep.tensors.targets`) is a
    DTensor of its global shape, or an optimizer state shaped like such a parameter: that
    rank's (offset, shape)."""
    regions: dict[str, tuple[list[int], list[int]]] = {}
    targets = TargetResolver(into)
    sharded: list[TensorEntry | ShardedTensor] = [entry for _, entry in manifest.iter_tensors()]
    if isinstance(manifest, IndexedManifest):
        sharded += manifest.described()  # format 2.x: described once, whether or not a chunk is listed
    for entry in sharded:
        if entry.global_shape is None or entry.key in regions:
            continue
        target = targets.resolve(entry.path).tensor
        if target is not None and is_dtensor(target) and list(target.shape) == entry.global_shape:
            regions[entry.key] = local_region(target)
    return regions


def region_slices(offset: list[int], shape: list[int]) -> tuple[slice, ...]:
    return tuple(slice(start, start + size) for start, size in zip(offset, shape, strict=True))
