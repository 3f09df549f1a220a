"""The ranged reads of a load: only the digest blocks of the entries that the needed boxes
overlap, each read with ``read_into`` (never a whole-file map) and checked against the entry's
recorded blocks before it is used.

A file of format 2.1/1.4 records, per tensor entry, a digest of each ``block_size`` bytes of
the entry counted from its first byte (``TensorEntry.blocks``: 16 bytes of xxh3-128, then 32
bytes of the save's strong digest unless the blocks are fast-only). :func:`read_needs` takes
what a load, a lazy tensor or ``load_slice`` needs of one file (:class:`Need`: an entry, and a
box of it or all of it), plans the byte spans of the blocks those boxes overlap (whole entries
where an entry has no blocks but a digest of its own, format 2.0 chunks), merges the spans into
runs (:func:`merge_runs`, across gaps up to the store's ``read_gap``), reads the header (parsed
and compared with the record) and each run once, hashes each block once with the fast digest
(``"fast"``) or the strong one (``"strong"``), and raises
:class:`~shardkeep.errors.IntegrityError` naming the file and the key on a mismatch. A file
the runs would cover almost whole, or whose needed entries only the file digest covers, is left
to the whole-file read (:func:`read_entries`, :func:`shardkeep.io.check_shard`).

This module does not import torch.
"""

from __future__ import annotations

import bisect
import hmac
import math
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import numpy

from shardkeep.errors import IntegrityError, ShardkeepError
from shardkeep.integrity import (
    block_digests,
    block_width,
    blocks_check,
    digest_bytes,
    digests_equal,
    fast_block_digests,
)
from shardkeep.io import DigestChoice, check_shard
from shardkeep.manifest import FAST_BLOCK_DIGEST_BYTES, FileRecord, TensorEntry
from shardkeep.storage.base import ByteStore, ReadHandle
from shardkeep.tensors.ranges import block_intervals, interval_bytes
from shardkeep.tensors.shardfile import check_header, header_length, parse_header

__all__ = [
    "MAX_READ",
    "WHOLE_FILE_SHARE",
    "Need",
    "Piece",
    "merge_runs",
    "plan_spans",
    "read_entries",
    "read_needs",
    "reads_blocks",
]


class Piece(NamedTuple):
    """Bytes ``[start, start + len(data))`` of an entry (``start`` counted from its first byte)."""

    start: int
    data: memoryview


def reads_blocks(record: FileRecord, entry: TensorEntry, choice: DigestChoice) -> bool:
    """Whether a ranged read (:func:`read_needs`) can check ``entry`` with the digests
    ``choice`` names (:func:`~shardkeep.integrity.blocks_check`: any blocks for ``"fast"``;
    otherwise blocks with a strong half, or fast-only blocks of a save whose own digest is
    xxh3-128)."""
    return blocks_check(record, entry, strong=choice != "fast")


def _check_blocks(
    record: FileRecord, entry: TensorEntry, interval: tuple[int, int], data: memoryview, choice: DigestChoice, name: str
) -> None:
    """Hash the blocks ``interval`` of ``entry`` (their bytes ``data``) once and compare them
    with the recorded ones: the fast halves for ``"fast"`` (and for fast-only blocks, see
    :func:`reads_blocks`), else the strong halves. A mismatch raises
    :class:`~shardkeep.errors.IntegrityError` naming the file (``name``) and the key."""
    j0, j1 = interval
    width = block_width(record, entry)
    size = record.block_size
    recorded = entry.blocks[j0 * width : (j1 + 1) * width]
    if choice == "fast" or width == FAST_BLOCK_DIGEST_BYTES:
        recorded = fast_block_digests(recorded, width)
        actual = block_digests(data, size, None)
    else:
        actual = block_digests(data, size, record.digest.partition(":")[0] if record.digest else None)
    if not hmac.compare_digest(recorded, actual):
        raise IntegrityError(f"{name}: tensor {entry.key!r} fails its digest in blocks {j0}..{j1} (file is corrupt)")


class Need(NamedTuple):
    """An entry a load uses: its position in ``FileRecord.tensors`` and the box of it that is
    used (``(offset, size)`` in elements, in the entry's own coordinates), or ``None`` for all
    of it."""

    position: int
    box: tuple[list[int], list[int]] | None


class _Span(NamedTuple):
    """Bytes ``[start, end)`` of the entry at ``position`` that a ranged read reads, checked by
    its blocks ``blocks`` (inclusive), or whole by the entry's own digest (``blocks`` None)."""

    position: int
    start: int
    end: int
    blocks: tuple[int, int] | None


#: The coverage of a file from which on a ranged read reads the whole file instead.
WHOLE_FILE_SHARE = 0.95
#: The most one ``read_into`` of a ranged read asks for.
MAX_READ = 64 << 20


def plan_spans(record: FileRecord, needs: Sequence[Need], choice: DigestChoice | None) -> list[_Span] | None:
    """The entry byte spans a ranged read of ``needs`` reads (``choice`` None: unchecked), or
    ``None`` when ``needs`` cannot be read by range: a compressed file, or an entry whose only
    digest is the whole file's."""
    if record.compression is not None:
        return None
    spans: list[_Span] = []
    for position, box in needs:
        entry = record.tensors[position]
        if not entry.nbytes:
            continue
        if block_width(record, entry) and (choice is None or reads_blocks(record, entry, choice)):
            itemsize = _itemsize(entry)
            if itemsize is None:
                return None
            offset, size = box if box is not None else ([0] * len(entry.shape), list(entry.shape))
            intervals = block_intervals(entry.shape, itemsize, offset, size, record.block_size)
            for interval, (start, end) in zip(
                intervals, interval_bytes(intervals, entry.nbytes, record.block_size), strict=True
            ):
                spans.append(_Span(position, start, end, interval))
        elif entry.digest or choice is None:
            spans.append(_Span(position, 0, entry.nbytes, None))
        else:
            return None
    return spans


def merge_runs(runs: Iterable[tuple[int, int]], gap: int) -> list[tuple[int, int]]:
    """Byte runs ``[start, end)`` sorted, with runs that overlap, touch or lie at most ``gap``
    bytes apart merged into one."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(runs):
        if merged and start <= merged[-1][1] + gap:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def read_needs(
    store: ByteStore,
    path: str,
    record: FileRecord,
    needs: Sequence[Need],
    choice: DigestChoice | None,
    *,
    where: str | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> dict[int, list[Piece]] | None:
    """Read and check only the bytes of ``needs`` from the file at ``path``: its header
    (compared with the record), then the byte runs of the needed blocks (and of needed entries
    without blocks, whole, checked by their own digest), merged per
    :func:`merge_runs` with the store's ``read_gap``, each run read into its own buffer with
    ``read_into`` calls of at most :data:`MAX_READ` bytes. Each block is hashed once with the
    digest ``choice`` names (``None``: nothing is hashed, as ``load(verify=False)``).

    Returns each needed entry's pieces (sorted, entry-relative starts), or ``None`` when the
    caller should read the whole file instead (:func:`~shardkeep.io.check_shard`): the file is
    compressed, a needed entry has no digest of its own, or the runs cover at least
    :data:`WHOLE_FILE_SHARE` of the file. A mismatch raises
    :class:`~shardkeep.errors.IntegrityError` naming the file and the key."""
    name = where or record.path
    spans = plan_spans(record, needs, choice)
    if spans is None:
        return None
    offsets = [record.tensors[span.position].offset for span in spans]
    runs = merge_runs(
        ((at + span.start, at + span.end) for at, span in zip(offsets, spans, strict=True)),
        max(0, int(getattr(store, "read_gap", 0))),
    )
    if sum(end - start for start, end in runs) >= WHOLE_FILE_SHARE * record.stored_size:
        return None
    handle = store.open_read(path)
    try:
        if handle.size != record.stored_size:
            raise IntegrityError(f"{name}: size is {handle.size} bytes, manifest says {record.stored_size}")
        _check_head(handle, record, name)
        buffers = [_read_run(handle, start, end, on_bytes) for start, end in runs]
    finally:
        handle.close()
    starts = [start for start, _ in runs]
    pieces: dict[int, list[Piece]] = {}
    for span in spans:
        entry = record.tensors[span.position]
        at = bisect.bisect_right(starts, entry.offset + span.start) - 1
        begin = entry.offset + span.start - starts[at]
        data = buffers[at][begin : begin + span.end - span.start]
        if choice is not None:
            if span.blocks is not None:
                _check_blocks(record, entry, span.blocks, data, choice, name)
            elif entry.digest and not digests_equal(entry.digest, digest_bytes(entry.digest.partition(":")[0], data)):
                raise IntegrityError(f"{name}: tensor {entry.key!r} fails its digest (file is corrupt)")
        pieces.setdefault(span.position, []).append(Piece(span.start, data))
    return pieces


def _read_run(handle: ReadHandle, start: int, end: int, on_bytes: Callable[[int], None] | None) -> memoryview:
    buffer = _uninitialized(end - start)
    for at in range(0, end - start, MAX_READ):
        part = buffer[at : at + MAX_READ]
        handle.read_into(start + at, part)
        if on_bytes:
            on_bytes(len(part))
    return buffer


def _uninitialized(nbytes: int) -> memoryview:
    """A writable buffer of ``nbytes`` whose pages are not written before ``read_into`` fills
    them (a ``bytearray`` would zero every byte first: one more pass over the data)."""
    return numpy.empty(nbytes, dtype=numpy.uint8).data.cast("B")


def _itemsize(entry: TensorEntry) -> int | None:
    """Bytes per element of ``entry`` (from its shape and size), or ``None`` when they disagree."""
    count = math.prod(entry.shape)
    if not count or entry.nbytes % count:
        return None
    return entry.nbytes // count


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
