"""tensors/ranges.py against brute force: the bytes and blocks every box of small shapes needs."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkeep.tensors.ranges import block_intervals, box_runs, byte_runs, interval_bytes


def _element_bytes(shape: list[int], itemsize: int, offset: list[int], size: list[int]) -> set[int]:
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    found: set[int] = set()
    for index in itertools.product(*(range(o, o + n) for o, n in zip(offset, size, strict=True))):
        flat = sum(i * s for i, s in zip(index, strides, strict=True))
        found.update(range(flat * itemsize, (flat + 1) * itemsize))
    return found


def _boxes(shape: list[int]) -> list[tuple[list[int], list[int]]]:
    per_dim = [[(o, n) for o in range(dim + 1) for n in range(dim - o + 1)] for dim in shape]
    return [([o for o, _ in box], [n for _, n in box]) for box in itertools.product(*per_dim)]


def _check(shape: list[int], itemsize: int, offset: list[int], size: list[int], block_size: int) -> None:
    wanted = _element_bytes(shape, itemsize, offset, size)
    _, count, run = box_runs(shape, itemsize, offset, size)
    starts = list(byte_runs(shape, itemsize, offset, size))
    assert len(starts) == count
    covered = [b for start in starts for b in range(start, start + run)]
    assert covered == sorted(covered) and set(covered) == wanted and len(covered) == len(wanted)
    intervals = block_intervals(shape, itemsize, offset, size, block_size)
    blocks = {b // block_size for b in wanted}
    got = {j for j0, j1 in intervals for j in range(j0, j1 + 1)}
    assert all(a[1] + 1 < b[0] for a, b in itertools.pairwise(intervals)), intervals  # merged
    nbytes = math.prod(shape) * itemsize
    if count <= -(-nbytes // block_size):
        assert got == blocks
    else:  # more runs than blocks: first to last block
        assert got == set(range(min(blocks), max(blocks) + 1))
    for start, end in interval_bytes(intervals, nbytes, block_size):
        assert 0 <= start < end <= nbytes and start % block_size == 0


@pytest.mark.parametrize("shape", [[], [5], [3, 4], [2, 3, 2], [1, 4, 1], [2, 0, 3]])
@pytest.mark.parametrize("itemsize", [1, 2, 4])
@pytest.mark.parametrize("block_size", [1, 2, 4, 8, 16, 64])
def test_every_box_of_small_shapes_needs_exactly_the_blocks_of_its_bytes(
    shape: list[int], itemsize: int, block_size: int
) -> None:
    for offset, size in _boxes(shape):
        _check(shape, itemsize, offset, size, block_size)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_random_boxes_agree_with_brute_force(data: st.DataObject) -> None:
    shape = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=4))
    offset = [data.draw(st.integers(0, dim - 1)) for dim in shape]
    size = [data.draw(st.integers(0, dim - o)) for dim, o in zip(shape, offset, strict=True)]
    itemsize = data.draw(st.sampled_from([1, 2, 4, 8]))
    block_size = data.draw(st.sampled_from([1, 2, 4, 8, 16, 32, 128]))
    _check(shape, itemsize, offset, size, block_size)


def test_rows_are_one_run_and_columns_one_run_per_row() -> None:
    assert box_runs([8, 4], 4, [2, 0], [3, 4]) == (0, 1, 48)
    assert box_runs([8, 4], 4, [0, 1], [8, 2]) == (1, 8, 8)
    assert block_intervals([1024, 256], 4, [128, 0], [128, 256], 16384) == [(8, 15)]


def test_boxes_outside_the_shape_are_refused() -> None:
    with pytest.raises(ValueError, match="not inside"):
        box_runs([4], 1, [3], [2])
    with pytest.raises(ValueError, match="does not match"):
        box_runs([4, 4], 1, [0], [1])
