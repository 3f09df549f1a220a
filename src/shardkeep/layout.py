"""Planning a save's items into data files: which tensors share a file (grouped by tier, section,
expert and layer, split at the target file size) and the byte layout of each file's
safetensors header. Comparing those files with an incremental base's is
:mod:`shardkeep.saving.incremental`'s.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import numpy as np
import torch

from shardkeep.config import BLOCK_SIZES
from shardkeep.distributed.plan import ItemDescriptor
from shardkeep.errors import UnsupportedValueError
from shardkeep.manifest import (
    FileRecord,
    TensorEntry,
    parse_placements,
)
from shardkeep.tensors.convert import (
    Layout,
    at_mesh_origin,
    byte_view,
    contiguous_pieces,
    describe_array,
    dtensor_chunk,
    regular_layout,
    replica_of,
)
from shardkeep.tensors.flatten import TensorLeaf
from shardkeep.tensors.grid import Grid
from shardkeep.tensors.keys import EXPERT_KEY, LAYER_KEY
from shardkeep.tensors.shardfile import build_header

__all__ = ["WHOLE_TENSOR_BLOCK_SIZE", "PlannedItem", "assign_blocks", "chunk_block_size", "file_header", "plan_files"]

#: The block size of files of whole tensors: a whole tensor larger than this gets fast-only
#: block digests, a smaller one only its file's digests.
WHOLE_TENSOR_BLOCK_SIZE = BLOCK_SIZES[-1]
#: The most blocks :func:`chunk_block_size` gives one rank's chunks (about 2 MiB of base64 in its
#: index).
_MAX_RANK_BLOCKS = 32768
#: A chunk of the byte-weighted median size gets about this many blocks.
_BLOCKS_PER_CHUNK = 32


class PlannedItem:
    """One tensor (or DTensor chunk) to write: its description, and a
    :class:`~shardkeep.writes.TensorSource` over its bytes."""

    __slots__ = (
        "address",
        "array",
        "array_type",
        "dtype",
        "global_offset",
        "global_shape",
        "itemsize",
        "layout",
        "leaf",
        "mesh_origin",
        "nbytes",
        "replica",
        "shape",
        "wants_blocks",
        "wants_digest",
    )

    def __init__(self, leaf: TensorLeaf) -> None:
        self.leaf = leaf
        value = leaf.value
        chunk = dtensor_chunk(leaf.key, value) if type(value) not in _PLAIN_ARRAYS else None
        self.global_shape: list[int] | None = None
        self.global_offset: list[int] | None = None
        #: (this rank's index among the holders of this chunk, how many hold it).
        self.replica = (0, 1)
        #: Whether this rank is at coordinate (0, ..., 0) of the chunk's device mesh.
        self.mesh_origin = True
        #: The grid this chunk belongs to (a regularly sharded tensor), or None.
        self.layout: Layout | None = None
        if chunk is not None:
            self.replica = replica_of(value)
            self.mesh_origin = at_mesh_origin(value)
            self.layout = regular_layout(leaf.key, value)
            coordinate = value.device_mesh.get_coordinate()
            value, self.global_shape, self.global_offset = chunk
            if self.layout is not None and coordinate is not None:
                _check_on_grid(
                    leaf.key, self.layout, self.global_shape, self.global_offset, list(value.shape), coordinate
                )
        self.array = value
        self.wants_digest = chunk is not None
        #: Whether the tensor gets block digests (:func:`assign_blocks` decides).
        self.wants_blocks = False
        self.dtype, self.shape, self.nbytes, self.itemsize, self.array_type, self.address = describe_array(
            leaf.key, value
        )

    @property
    def descriptor(self) -> ItemDescriptor:
        return ItemDescriptor(
            self.leaf.key,
            self.dtype,
            tuple(self.shape),
            self.nbytes,
            None if self.global_shape is None else tuple(self.global_shape),
            None if self.global_offset is None else tuple(self.global_offset),
            None if self.layout is None else (self.layout[0], self.layout[2], self.layout[3]),
        )

    def pieces(self, max_bytes: int) -> Iterator[memoryview]:
        for piece in contiguous_pieces(self.array, max_bytes):
            yield byte_view(piece)
            del piece


_PLAIN_ARRAYS = (torch.Tensor, np.ndarray)


def _pow2_floor(value: int) -> int:
    return 1 << (value.bit_length() - 1) if value > 0 else 0


def _pow2_ceil(value: int) -> int:
    return 1 << (value - 1).bit_length() if value > 1 else 1


def chunk_block_size(sizes: list[int]) -> int:
    """The block size of one rank's chunk files, from the sizes of its chunks ``sizes``:
    ``clamp(pow2floor(c_w / 32), max(16 KiB, pow2ceil(total / 32768)), 16 MiB)``, ``c_w`` the
    byte-weighted median chunk size and ``total`` their sum. So a chunk of the median size has
    about 32 blocks (a partial read wastes under 1/32 of it at each open end) and the rank at
    most about 32K blocks; 0 when there are no chunk bytes."""
    total = sum(sizes)
    if total <= 0:
        return 0
    half, seen, median = total / 2, 0, 0
    for size in sorted(sizes):
        seen += size
        if seen >= half:
            median = size
            break
    floor = max(BLOCK_SIZES[0], _pow2_ceil(-(-total // _MAX_RANK_BLOCKS)))
    return min(max(_pow2_floor(median // _BLOCKS_PER_CHUNK), floor), BLOCK_SIZES[-1])


def assign_blocks(record: FileRecord, group: list[PlannedItem], block_size: int) -> None:
    """The block policy of one file: every non-empty chunk (an item that ``wants_digest``) gets
    block digests, which replace its own digest; a whole tensor gets (fast-only) ones when it is
    larger than ``block_size``. ``record.block_size`` is ``block_size`` when some item has
    blocks, else 0 (and 0 always with ``block_size`` 0: no blocks at all)."""
    any_blocks = False
    for item in group:
        item.wants_blocks = block_size > 0 and item.nbytes > 0 and (item.wants_digest or item.nbytes > block_size)
        any_blocks |= item.wants_blocks
    record.block_size = block_size if any_blocks else 0


def _check_on_grid(
    key: str, layout: Layout, global_shape: list[int], offset: list[int], shape: list[int], coordinate: list[int]
) -> None:
    """Refuse a chunk that is not where its placements put it: a format 2.x manifest records
    the grid, not the chunk, so a chunk off the grid would otherwise be lost silently."""
    dims = parse_placements(layout[3], len(global_shape))
    assert dims is not None
    expected = Grid.of(tuple(global_shape), layout[0], dims).chunk(coordinate)
    if expected != (tuple(offset), tuple(shape)):
        raise UnsupportedValueError(
            f"DTensor {key!r}: its local chunk at {offset} of shape {shape} is not the chunk its placements "
            f"{list(layout[3])} give on mesh {list(layout[0])} ({[list(b) for b in expected]})"
        )


def expert_key_of(key: str, tier_id: int) -> list[int] | None:
    if "experts." not in key:
        return None
    match = EXPERT_KEY.search(key)
    if match is None:
        return None
    layer = LAYER_KEY.search(key)
    return [tier_id, int(layer.group(1)) if layer else 0, int(match.group(1))]


def plan_files(
    planned: list[PlannedItem],
    *,
    rank: int,
    target: int,
    tier: str,
    tier_id: int,
    suffix: str = ".safetensors",
    directory: str = "shards",
    sections: Mapping[str, str] | None = None,
    per_expert: bool = False,
) -> list[tuple[FileRecord, list[PlannedItem]]]:
    """Lay tensors out in files: by decreasing element size (so every tensor is aligned), split
    into files of about ``target`` bytes so that large states are written in parallel.

    No file holds two items of one key (a safetensors header names each tensor once): a
    rank's second, third ... chunk of one tensor go to ``_c001``, ``_c002`` ... files.

    Chunks of sharded tensors go to their own files (``rank_NNNNN_sharded``), apart from whole
    tensors: every loading rank needs every whole tensor, but only the chunks that overlap its
    own shard, and it can then skip the other chunk files' bytes entirely.

    ``sections`` (key to ``"optim"``/``"router"``) puts optimizer and router state in files of
    their own (``rank_NNNNN_optim``), so that each section loads on its own. With
    ``per_expert`` (incremental saves), each expert's tensors get a file of their own
    (``rank_NNNNN_L003_E007``): a frozen expert's file is then unchanged from one save to the
    next, and referenced instead of written again.
    """
    groups: dict[str, list[PlannedItem]] = {}
    for item in planned:
        key = item.leaf.key
        # Chunks on a regular grid go to "_sharded" files (listed in the rank's index in format
        # 2.x); other chunks to "_chunks" files (listed in the manifest).
        sharded = "" if item.global_offset is None else "_sharded" if item.layout is not None else "_chunks"
        section = (sections or {}).get(key)
        if section is not None:
            stem = f"_{section}{sharded}"
        elif per_expert and (match := EXPERT_KEY.search(key)):
            layer = LAYER_KEY.search(key)
            stem = f"_L{int(layer.group(1)) if layer else 0:03d}_E{int(match.group(1)):03d}{sharded}"
        else:
            stem = sharded
        groups.setdefault(stem, []).append(item)
    result: list[tuple[FileRecord, list[PlannedItem]]] = []
    for stem in sorted(_apart_by_key(groups)):
        base = f"{directory}/rank_{rank:05d}{stem}"
        for index, group in enumerate(_split(groups[stem], target)):
            name = f"{base}{suffix}" if index == 0 else f"{base}_p{index:03d}{suffix}"
            result.append((FileRecord(path=name, rank=rank, size=0, digest=None, tier=tier), group))
    return result


def _apart_by_key(groups: dict[str, list[PlannedItem]]) -> dict[str, list[PlannedItem]]:
    """Split every group whose items share a key (several chunks of one tensor on this rank: a
    ``ShardedTensor`` with more shards than ranks) so that no file holds a key twice: a
    safetensors header names each tensor once. The n-th chunk of a key goes to the stem's
    ``_cNNN`` file (n from 1; the first chunk stays in the stem's own file). ``groups`` is
    changed in place and returned."""
    for stem in [stem for stem, items in groups.items() if len({item.leaf.key for item in items}) < len(items)]:
        seen: dict[str, int] = {}
        for item in groups.pop(stem):
            occurrence = seen[item.leaf.key] = seen.get(item.leaf.key, -1) + 1
            groups.setdefault(f"{stem}_c{occurrence:03d}" if occurrence else stem, []).append(item)
    return groups


def _split(items: list[PlannedItem], target: int) -> list[list[PlannedItem]]:
    if not items:
        return []
    ordered = sorted(items, key=lambda p: -p.itemsize)
    total = sum(p.nbytes for p in ordered)
    file_count = max(1, math.ceil(total / target))
    quota = total / file_count
    groups: list[list[PlannedItem]] = [[]]
    group_bytes = 0
    for item in ordered:
        if groups[-1] and group_bytes + item.nbytes > quota * 1.05 and len(groups) < file_count:
            groups.append([])
            group_bytes = 0
        groups[-1].append(item)
        group_bytes += item.nbytes
    return groups


def file_header(record: FileRecord, group: list[PlannedItem], tier_id: int) -> bytes:
    """Fill ``record`` with tensor entries and its size; return the safetensors header (which
    records ``record.version``)."""
    spans: list[tuple[str, str, list[int], int, int]] = []
    position = 0
    for item in group:
        spans.append((item.leaf.key, item.dtype, item.shape, position, position + item.nbytes))
        position += item.nbytes
    header = build_header(spans, record.version)
    base = len(header)
    tensors = record.tensors
    tensors.clear()
    for item, (key, _, _, begin, _) in zip(group, spans, strict=True):
        expert = expert_key_of(key, tier_id)
        tensors.append(
            TensorEntry(
                key=key,
                path=list(item.leaf.path),
                dtype=item.dtype,
                shape=item.shape,
                offset=base + begin,
                nbytes=item.nbytes,
                kind="expert" if expert else "dense",
                expert_key=expert,
                global_shape=item.global_shape,
                global_offset=item.global_offset,
                array_type=item.array_type,  # type: ignore[arg-type]  # "torch" or "numpy"
                order=item.leaf.order,
            )
        )
    record.size = base + position
    return header
