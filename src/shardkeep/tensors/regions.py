"""The overlap and assembly arithmetic of resharding: which saved chunks overlap the region a
rank holds, and how a full tensor or a rank's region is put together from them.

A chunk of a sharded tensor is a box (global offset, shape) in the global tensor; a rank that
loads into a DTensor wants the box its local shard covers (:func:`wanted_regions`), reads only
the entries that overlap it (:func:`needed_entries`), and copies each overlap straight into its
local shard (:class:`Region`).
"""

from __future__ import annotations

from typing import Any

import torch

from shardkeep.manifest import FileRecord, IndexedManifest, Manifest, ShardedTensor, TensorEntry
from shardkeep.tensors.convert import NAME_TO_TORCH, is_dtensor, local_region
from shardkeep.tensors.targets import TargetResolver

__all__ = ["Region", "assemble", "needed_entries", "overlap", "region_slices", "wanted_regions"]


class Region:
    """This rank's region of a sharded tensor, to be filled from only the chunks overlapping it.

    Nothing is copied until :meth:`copy_into` (straight into the target's local shard, so a
    load makes one copy) or :meth:`materialize`.
    """

    __slots__ = ("dtype", "global_shape", "offset", "parts", "shape")

    def __init__(
        self,
        parts: list[tuple[TensorEntry, Any]],
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
        for entry, array in self.parts:
            assert entry.global_offset is not None
            common = overlap(entry.global_offset, entry.shape, self.offset, self.shape)
            if common is None:
                continue
            start, size = common
            source = tuple(slice(s - o, s - o + n) for s, o, n in zip(start, entry.global_offset, size, strict=True))
            target = tuple(slice(s - o, s - o + n) for s, o, n in zip(start, self.offset, size, strict=True))
            local[target].copy_(array[source])

    def materialize(self) -> torch.Tensor:
        local = torch.empty(self.shape, dtype=self.dtype)
        self.copy_into(local)
        return local


def assemble(
    parts: list[tuple[TensorEntry, Any]], region: tuple[list[int], list[int]] | None
) -> tuple[list[str | int], int, Any]:
    """The full tensor (``region`` None), or a lazy :class:`Region` = (offset, shape) of it,
    from the chunks that tile it (coverage was checked with the manifest)."""
    first, sample = parts[0]
    assert first.global_shape is not None
    if region is None:
        full = torch.empty(first.global_shape, dtype=sample.dtype)
        for entry, array in parts:
            assert entry.global_offset is not None
            full[region_slices(entry.global_offset, entry.shape)].copy_(array)
        return first.path, first.order, full
    offset, shape = region
    return first.path, first.order, Region(parts, offset, shape, first.global_shape, first.dtype)


def overlap(
    offset_a: list[int], shape_a: list[int], offset_b: list[int], shape_b: list[int]
) -> tuple[list[int], list[int]] | None:
    """The intersection (start, size) of two boxes, or None if they do not overlap."""
    start = [max(a, b) for a, b in zip(offset_a, offset_b, strict=True)]
    end = [min(a + sa, b + sb) for a, sa, b, sb in zip(offset_a, shape_a, offset_b, shape_b, strict=True)]
    if any(e <= s for s, e in zip(start, end, strict=True)):
        return None
    return start, [e - s for s, e in zip(start, end, strict=True)]


def needed_entries(record: FileRecord, wanted: dict[str, tuple[list[int], list[int]]]) -> list[int] | None:
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
