"""The chunk grid of format 2.0 against torch's own arithmetic, and its overlap and writer
queries against brute force over every mesh coordinate."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from shardkeep.manifest import parse_placements
from shardkeep.tensors.grid import Grid, _strided_chunk, chunk_writer


@st.composite
def layouts(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int | None, ...]]:
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    dims = tuple(draw(st.lists(st.one_of(st.none(), st.integers(0, ndim - 1)), min_size=len(mesh), max_size=len(mesh))))
    return shape, mesh, dims


def _coordinates(mesh: tuple[int, ...]) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(n) for n in mesh)))


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_chunks_match_torch(layout: tuple[tuple[int, ...], tuple[int, ...], tuple[int | None, ...]]) -> None:
    shape, mesh, dims = layout
    placements = [Replicate() if d is None else Shard(d) for d in dims]
    grid = Grid(shape, mesh, dims)
    for coordinate in _coordinates(mesh):
        local, offset = _compute_local_shape_and_global_offset(shape, mesh, list(coordinate), placements)
        assert grid.chunk(coordinate) == (tuple(offset), tuple(local)), coordinate


@settings(max_examples=300, deadline=None)
@given(layouts(), st.data())
def test_overlap_and_writers_match_brute_force(
    layout: tuple[tuple[int, ...], tuple[int, ...], tuple[int | None, ...]], data: st.DataObject
) -> None:
    shape, mesh, dims = layout
    grid = Grid(shape, mesh, dims)
    key = data.draw(st.sampled_from(["w", "layers.0.attn.wq.weight", "optim.state.3.exp_avg"]))
    # Every non-empty chunk is written exactly once, by the coordinate writer() names.
    written = {}
    for coordinate in _coordinates(mesh):
        box = grid.writes(key, coordinate)
        if box is not None:
            assert box not in written, f"{box} written twice"
            written[box] = coordinate
    chunks = {grid.chunk(c) for c in _coordinates(mesh)}
    if math.prod(shape):
        assert set(written) == {box for box in chunks if math.prod(box[1])}
    else:
        assert list(written.values()) == [tuple(0 for _ in mesh)]
    for coordinate in written.values():
        shard = tuple(None if d is None else c for d, c in zip(dims, coordinate, strict=True))
        assert grid.writer(key, shard) == coordinate
    # overlapping() finds exactly the non-empty chunks that meet a region.
    start = tuple(data.draw(st.integers(0, max(n, 1))) for n in shape)
    extent = tuple(data.draw(st.integers(0, max(n - s, 0) + 1)) for n, s in zip(shape, start, strict=True))
    found = {grid.chunk([c or 0 for c in shard]) for shard in grid.overlapping(start, extent)}
    expected = {
        (offset, size)
        for offset, size in chunks
        if math.prod(size)
        and math.prod(extent)
        and all(o < s + e and s < o + n for o, n, s, e in zip(offset, size, start, extent, strict=True))
    }
    if math.prod(shape):
        assert found == expected


def test_writer_matches_the_save_rule() -> None:
    """A replicated chunk is written by the replica chunk_writer names (as the save decides)."""
    grid = Grid((8, 4), (2, 3), (0, None))
    for coordinate in _coordinates((2, 3)):
        offset, _ = grid.chunk(coordinate)
        chosen = chunk_writer("k", offset, 3) == coordinate[1]
        assert (grid.writes("k", coordinate) is not None) == chosen


@pytest.mark.parametrize(
    ("names", "ndim", "expected"),
    [
        (["R"], 1, (None,)),
        (["S0", "S1"], 2, (0, 1)),
        (["S1"], 1, None),
        (["S"], 1, None),
        (["P"], 1, None),
        (["s0"], 1, None),
    ],
)
def test_parse_placements(names: list[str], ndim: int, expected: tuple[int | None, ...] | None) -> None:
    assert parse_placements(names, ndim) == expected


@st.composite
def strided_layouts(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], tuple[Any, ...]]:
    """Layouts with ``_StridedShard`` placements, FSDP2-over-TP style and arbitrary."""
    ndim = draw(st.integers(1, 2))
    shape = tuple(draw(st.lists(st.integers(0, 13), min_size=ndim, max_size=ndim)))
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    dims = []
    for _ in mesh:
        kind = draw(st.sampled_from(["R", "S", "SS"]))
        dim = draw(st.integers(0, ndim - 1))
        dims.append(None if kind == "R" else dim if kind == "S" else (dim, draw(st.integers(1, 4))))
    return shape, mesh, tuple(dims)


def _torch_indices(
    shape: tuple[int, ...], mesh: tuple[int, ...], dims: tuple[Any, ...], coordinate: tuple[int, ...]
) -> dict[int, list[int]]:
    """Every global index a rank holds per sharded dimension, by torch's own placement code."""
    from torch.distributed.tensor.placement_types import _StridedShard, _StridedShardOffsetMode

    sizes = list(shape)
    indices: dict[int, torch.Tensor] = {}
    for mesh_dim, how in enumerate(dims):
        if how is None:
            continue
        dim = how if isinstance(how, int) else how[0]
        if isinstance(how, int):
            size, offset = Shard.local_shard_size_and_offset(sizes[dim], mesh[mesh_dim], coordinate[mesh_dim])
            index = torch.arange(offset, offset + size)
        else:
            placement = _StridedShard(dim, split_factor=how[1])
            size, offsets = placement.local_shard_size_and_offset(
                sizes[dim], mesh[mesh_dim], coordinate[mesh_dim], _StridedShardOffsetMode.ALL
            )
            index = torch.tensor(offsets, dtype=torch.long)
        previous = indices.get(dim, torch.arange(shape[dim]))
        indices[dim] = previous[index] if size else torch.empty(0, dtype=torch.long)
        sizes[dim] = size
    return {dim: index.tolist() for dim, index in indices.items()}


@settings(max_examples=400, deadline=None)
@given(strided_layouts())
def test_strided_chunks_match_torch_index_for_index(
    layout: tuple[tuple[int, ...], tuple[int, ...], tuple[Any, ...]],
) -> None:
    """With ``_StridedShard``, a chunk is claimed to be a box only when torch puts exactly that
    box's elements, in order, on the rank; and the box's offset and shape are torch's."""
    from torch.distributed.tensor.placement_types import _StridedShard

    shape, mesh, dims = layout
    placements = [
        Replicate() if d is None else Shard(d) if isinstance(d, int) else _StridedShard(d[0], split_factor=d[1])
        for d in dims
    ]
    grid = Grid(shape, mesh, dims)
    every_box = True
    for coordinate in _coordinates(mesh):
        held = _torch_indices(shape, mesh, dims, coordinate)
        (offset, size), box = _strided_chunk(shape, mesh, dims, coordinate)
        expected = all(index == list(range(index[0], index[0] + len(index))) for index in held.values() if index)
        assert box == expected, (coordinate, held)
        every_box = every_box and box
        if box:
            local, first = _compute_local_shape_and_global_offset(shape, mesh, list(coordinate), placements)
            assert size == tuple(local), coordinate
            for dim, index in held.items():
                if index:
                    assert offset[dim] == index[0] == first[dim], coordinate
    assert grid.regular == every_box
    if every_box and math.prod(shape):
        chunks = {grid.chunk(c) for c in _coordinates(mesh)}
        covered = sum(math.prod(s) for o, s in chunks if math.prod(s))
        assert covered == math.prod(shape)  # the distinct chunks tile the tensor


def test_fsdp_over_tensor_parallel_is_a_regular_grid() -> None:
    """torchtitan's layout: FSDP2 puts _StridedShard(0, split_factor=tp) on dp where TP shards
    dim 0 too; every rank's part is a box, in TP-major order."""
    grid = Grid((64, 8), (2, 4), ((0, 4), 0))
    assert grid.regular
    assert grid.chunk((1, 2)) == ((40, 0), (8, 8))  # TP chunk 2 (rows 32-47), its second half
    assert sorted(c for shard in grid.overlapping((0, 0), (16, 8)) for c in [shard]) == [(0, 0), (1, 0)]
