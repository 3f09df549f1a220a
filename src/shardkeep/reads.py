"""The ranged reads of a load: only the digest blocks of an entry that a box needs, each read
with ``read_into`` (never a whole-file map) and checked against the entry's recorded blocks
before it is used.

A file of format 2.1/1.4 records, per tensor entry, a digest of each ``block_size`` bytes of
the entry counted from its first byte (``TensorEntry.blocks``: 16 bytes of xxh3-128, then 32
bytes of the save's strong digest unless the blocks are fast-only). :func:`read_blocks` reads
the header (parsed and compared with the record) and the byte runs of the needed blocks, hashes
each block with the fast digest (``"fast"``) or the strong one (``"strong"``), and raises
:class:`~shardkeep.errors.IntegrityError` naming the file and the key on a mismatch.
:func:`read_entries` is the fallback for entries without blocks (format 2.0/1.x, compressed
files): the whole entries, or the whole file, checked by :func:`shardkeep.io.check_shard`.

This module does not import torch.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from typing import NamedTuple

from shardkeep.errors import IntegrityError, ShardkeepError
from shardkeep.integrity import block_digests
from shardkeep.io import DigestChoice, check_shard
from shardkeep.manifest import FAST_BLOCK_DIGEST_BYTES, FAST_DIGEST, STRONG_BLOCK_DIGEST_BYTES, FileRecord, TensorEntry
from shardkeep.storage.base import ByteStore, ReadHandle
from shardkeep.tensors.ranges import interval_bytes
from shardkeep.tensors.shardfile import check_header, header_length, parse_header

__all__ = ["Piece", "block_width", "read_blocks", "read_entries", "reads_blocks"]

_STRONG = ("blake3", "sha256")


class Piece(NamedTuple):
    """Bytes ``[start, start + len(data))`` of an entry (``start`` counted from its first byte)."""

    start: int
    data: memoryview


def block_width(record: FileRecord, entry: TensorEntry) -> int:
    """The bytes per block of ``entry.blocks`` (16 fast-only, 48 with the strong half), or 0 when
    the entry has no usable blocks (none recorded, no block size, a compressed file, or a length
    that fits neither width)."""
    if not entry.blocks or record.block_size <= 0 or record.compression is not None or not entry.nbytes:
        return 0
    count = -(-entry.nbytes // record.block_size)
    for width in (FAST_BLOCK_DIGEST_BYTES + STRONG_BLOCK_DIGEST_BYTES, FAST_BLOCK_DIGEST_BYTES):
        if len(entry.blocks) == count * width:
            return width
    return 0


def reads_blocks(record: FileRecord, entry: TensorEntry, choice: DigestChoice) -> bool:
    """Whether :func:`read_blocks` can check ``entry`` with the digests ``choice`` names: any
    blocks for ``"fast"``; for ``"strong"``, blocks with a strong half (or a save whose own
    digest is xxh3-128, whose blocks are then as strong as its file digest)."""
    width = block_width(record, entry)
    if not width or not record.digest:
        return False
    algorithm = record.digest.partition(":")[0]
    if choice == "fast":
        return True
    if width == FAST_BLOCK_DIGEST_BYTES:
        return algorithm == FAST_DIGEST
    return algorithm in _STRONG


def read_blocks(
    handle: ReadHandle,
    record: FileRecord,
    entry: TensorEntry,
    intervals: Sequence[tuple[int, int]],
    choice: DigestChoice,
    where: str | None = None,
) -> list[Piece]:
    """Read and check the blocks ``intervals`` (inclusive ``[j0, j1]``, sorted) of ``entry``:
    one ``read_into`` per interval into its own buffer, each block hashed once (its fast half
    for ``"fast"``, its strong half for ``"strong"``/``"all"``, see :func:`reads_blocks`). The
    header is read and compared with the record first. ``where`` names the file in errors
    (default: the record's path)."""
    name = where or record.path
    if not reads_blocks(record, entry, choice):
        raise IntegrityError(f"{name}: tensor {entry.key!r} has no block digests a {choice} check can use")
    if handle.size != record.stored_size:
        raise IntegrityError(f"{name}: size is {handle.size} bytes, manifest says {record.stored_size}")
    _check_head(handle, record, name)
    width = block_width(record, entry)
    size = record.block_size
    strong = record.digest.partition(":")[0] if record.digest else None
    fast = choice == "fast" or width == FAST_BLOCK_DIGEST_BYTES
    pieces: list[Piece] = []
    for (j0, j1), (start, end) in zip(intervals, interval_bytes(intervals, entry.nbytes, size), strict=True):
        if not 0 <= j0 <= j1 or end <= start:
            raise IntegrityError(f"{name}: tensor {entry.key!r} has no blocks {j0}..{j1}")
        data = memoryview(bytearray(end - start))
        handle.read_into(entry.offset + start, data)
        recorded = entry.blocks[j0 * width : (j1 + 1) * width]
        if fast:
            if width != FAST_BLOCK_DIGEST_BYTES:
                recorded = b"".join(
                    recorded[at : at + FAST_BLOCK_DIGEST_BYTES] for at in range(0, len(recorded), width)
                )
            actual = block_digests(data, size, None)
        else:
            actual = block_digests(data, size, strong)
        if not hmac.compare_digest(recorded, actual):
            raise IntegrityError(
                f"{name}: tensor {entry.key!r} fails its digest in blocks {j0}..{j1} (file is corrupt)"
            )
        pieces.append(Piece(start, data))
    return pieces


def read_entries(
    store: ByteStore, path: str, record: FileRecord, indices: list[int], choice: DigestChoice, where: str | None = None
) -> memoryview:
    """The bytes of the file at ``path`` with at least the entries ``indices`` read and checked
    (:func:`~shardkeep.io.check_shard`: only those entries when each has a digest of its own,
    else the whole file against its digest), read with ``read_into``. Raises
    :class:`~shardkeep.errors.IntegrityError` with every problem found."""
    data, problems = check_shard(
        store, path, record, verify=True, keep=True, use_mmap=False, needed=indices, digest=choice
    )
    if problems or data is None:
        found = problems or [f"{where or record.path}: could not be read"]
        raise IntegrityError("; ".join(found), found)
    return data


def _check_head(handle: ReadHandle, record: FileRecord, name: str) -> None:
    """Read the safetensors header (length prefix, then the header) and compare it with the
    record."""
    prefix = memoryview(bytearray(min(8, handle.size)))
    handle.read_into(0, prefix)
    try:
        length = header_length(prefix, handle.size)
        head = memoryview(bytearray(8 + length))
        head[:8] = prefix
        if length:
            handle.read_into(8, head[8:])
        problems = check_header(parse_header(head), record)
    except ShardkeepError as exc:
        problems = [f"{name}: {exc}"]
    if problems:
        raise IntegrityError("; ".join(problems), problems)
