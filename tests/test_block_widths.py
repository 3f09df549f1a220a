"""The block-digest helpers of ``integrity`` (``block_width``, ``blocks_strong``,
``blocks_check``, ``fast_block_digests``), against the readers that use them: every
combination of block layout, save algorithm and compression."""

from __future__ import annotations

import itertools

import pytest

from shardkeep.integrity import (
    FULL_BLOCK_DIGEST_BYTES,
    block_digests,
    block_width,
    blocks_check,
    blocks_strong,
    fast_block_digests,
)
from shardkeep.manifest import FAST_BLOCK_DIGEST_BYTES, Compression, FileRecord, TensorEntry
from shardkeep.reads import reads_blocks

ALGORITHMS = ["blake3", "sha256", "xxh3-128", None]
WIDTHS = [0, FAST_BLOCK_DIGEST_BYTES, FULL_BLOCK_DIGEST_BYTES, 20]


def _record(algorithm: str | None, width: int, nbytes: int, block_size: int, compressed: bool) -> FileRecord:
    count = -(-nbytes // block_size) if block_size > 0 else 1
    entry = TensorEntry(
        key="t", path=["t"], dtype="U8", shape=[nbytes], offset=8, nbytes=nbytes, blocks=b"\1" * (count * width)
    )
    return FileRecord(
        path="f.safetensors",
        rank=0,
        size=8 + nbytes,
        digest=None if algorithm is None else f"{algorithm}:00",
        block_size=block_size,
        compression=Compression(codec="zstd", level=1, stored_size=4) if compressed else None,
        tensors=[entry],
    )


@pytest.mark.parametrize(
    ("algorithm", "width", "nbytes", "block_size", "compressed"),
    list(itertools.product(ALGORITHMS, WIDTHS, [0, 1, 40], [0, 16], [False, True])),
)
def test_the_helpers_agree_with_the_ranged_reader(
    algorithm: str | None, width: int, nbytes: int, block_size: int, compressed: bool
) -> None:
    record = _record(algorithm, width, nbytes, block_size, compressed)
    entry = record.tensors[0]
    found = block_width(record, entry)
    usable = bool(entry.blocks) and block_size > 0 and not compressed and nbytes > 0 and width in (16, 48)
    assert found == (width if usable else 0)
    assert blocks_check(record, entry, strong=False) == reads_blocks(record, entry, "fast")
    assert blocks_check(record, entry, strong=True) == reads_blocks(record, entry, "strong")
    expected_strong = algorithm if found == FULL_BLOCK_DIGEST_BYTES and algorithm is not None else None
    assert blocks_strong(record, entry) == expected_strong


def test_fast_block_digests_takes_the_fast_half_of_each_block() -> None:
    data = bytes(range(256)) * 3
    full = block_digests(data, 100, "blake3")
    fast = block_digests(data, 100, None)
    assert fast_block_digests(full, FULL_BLOCK_DIGEST_BYTES) == fast
    assert fast_block_digests(fast, FAST_BLOCK_DIGEST_BYTES) == fast
