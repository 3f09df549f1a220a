"""Reading data files back with verification: the whole file, or only some of its entries,
checked against the digests its manifest record holds; and copying a file with a digest.

Writing data files is :mod:`shardkeep.writes`; the verified ranged reads of a box are
:mod:`shardkeep.reads`.

This module does not import torch.
"""

from __future__ import annotations

import hmac
import threading
from collections.abc import Callable, Sequence
from typing import Literal

import zstandard

from shardkeep.errors import IntegrityError, ShardkeepError, StorageError
from shardkeep.integrity import (
    BlockDigester,
    Digester,
    block_digests,
    block_width,
    blocks_check,
    blocks_strong,
    digests_equal,
    fast_block_digests,
    format_digest,
    new_digester,
)
from shardkeep.manifest import FileRecord, TensorEntry
from shardkeep.storage.base import ByteStore, ReadHandle, WriteHandle
from shardkeep.tensors.shardfile import (
    STALE,
    check_header,
    header_length,
    parse_header,
)

__all__ = [
    "DigestChoice",
    "check_shard",
    "copy_with_digest",
]

MiB = 1 << 20
_HASH_SLICE = 16 * MiB
#: Views at least this large are hashed on every core (blake3); smaller ones on one thread.
_PARALLEL_HASH_BYTES = 1 * MiB


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


class _EntryDigests:
    """The digests of a file's entries that carry one of their own (the chunks of sharded
    tensors), computed from pieces of the file fed in order of offset, so that a whole-file check
    also proves each chunk digest a partial read would later trust. With ``blocks``, the block
    digests of the entries that have them are checked too (both halves), as ``verify`` does.
    Without ``chunks``, the entries' own digests are left alone."""

    def __init__(self, record: FileRecord, *, chunks: bool = True, blocks: bool = False) -> None:
        self._record = record
        self._waiting = sorted(
            (entry.offset, entry.offset + entry.nbytes, index)
            for index, entry in enumerate(record.tensors)
            if (chunks and entry.digest) or (blocks and entry.blocks and record.block_size > 0)
        )
        self._next = 0
        self._open: list[tuple[int, int, int]] = []
        self._digesters: dict[int, Digester | BlockDigester] = {}
        for _, _, index in self._waiting:
            entry = record.tensors[index]
            if chunks and entry.digest:
                self._digesters[index] = new_digester(entry.digest.partition(":")[0])
            else:
                self._digesters[index] = BlockDigester(record.block_size, blocks_strong(record, entry))

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def feed(self, offset: int, view: memoryview) -> None:
        """Hash the parts of the entries that ``view`` (the file's bytes from ``offset``) holds."""
        end = offset + len(view)
        while self._next < len(self._waiting) and self._waiting[self._next][0] < end:
            self._open.append(self._waiting[self._next])
            self._next += 1
        still_open = []
        for start, stop, index in self._open:
            low, high = max(start, offset), min(stop, end)
            if high > low:
                self._digesters[index].update(view[low - offset : high - offset])
            if stop > end:
                still_open.append((start, stop, index))
        self._open = still_open

    def problems(self) -> list[str]:
        """One problem per entry whose bytes do not give its recorded digest (or blocks)."""
        found = []
        for _, _, index in self._waiting:
            entry = self._record.tensors[index]
            digester = self._digesters[index]
            if isinstance(digester, BlockDigester):
                intact = hmac.compare_digest(entry.blocks, digester.digest())
            else:
                algorithm = entry.digest.partition(":")[0]  # type: ignore[union-attr]
                intact = digests_equal(entry.digest, format_digest(algorithm, digester.hexdigest()))  # type: ignore[arg-type]
            if not intact:
                found.append(f"{self._record.path}: tensor {entry.key!r} fails its digest (file is corrupt)")
        return found


#: Which recorded digests a check compares (:func:`check_shard`): ``"fast"`` the file's
#: xxh3-128 digest (and the blocks' fast halves) where recorded, ``"strong"`` the save's own
#: digest, ``"all"`` both, with every block (what ``verify`` checks).
DigestChoice = Literal["fast", "strong", "all"]


def _file_digests(record: FileRecord, choice: DigestChoice) -> list[str]:
    """The file digests ``choice`` compares for ``record`` (its only one, for a file without a
    fast digest)."""
    if not record.digest:
        return []
    if choice == "fast" and record.fast_digest:
        return [record.fast_digest]
    if choice == "all" and record.fast_digest:
        return [record.digest, record.fast_digest]
    return [record.digest]


def _entries_for(record: FileRecord, choice: DigestChoice) -> _EntryDigests:
    """The entry digests a whole-file check proves on the way: the chunks' own digests (format
    2.0), unless only the fast digest is checked and the file has one; with ``"all"``, every
    entry's blocks too."""
    if choice == "fast" and record.fast_digest:
        return _EntryDigests(record, chunks=False)
    return _EntryDigests(record, blocks=choice == "all")


def _compare_files(record: FileRecord, expected: list[str], actual: list[str], problems: list[str]) -> None:
    if not all(digests_equal(want, got) for want, got in zip(expected, actual, strict=True)):
        problems.append(f"{record.path}: digest mismatch (file is corrupt)")


def _digest_view(algorithm: str, view: memoryview, entries: _EntryDigests | None = None) -> str:
    """The digest of ``view``, hashed on every core where the algorithm allows it and the view
    is large enough to gain from it (a small chunk pays more for the threads than it saves);
    ``entries`` are fed the same slices on the way."""
    return _digests_view([algorithm], view, entries)[0]


def _digests_view(algorithms: Sequence[str], view: memoryview, entries: _EntryDigests | None = None) -> list[str]:
    """:func:`_digest_view` for several algorithms in one pass over ``view``."""
    digesters = [new_digester(algorithm, parallel=len(view) >= _PARALLEL_HASH_BYTES) for algorithm in algorithms]
    for start in range(0, len(view), _HASH_SLICE):
        piece = view[start : start + _HASH_SLICE]
        for digester in digesters:
            digester.update(piece)
        if entries:
            entries.feed(start, piece)
    return [format_digest(algorithm, d.hexdigest()) for algorithm, d in zip(algorithms, digesters, strict=True)]


def _stream_digest(
    handle: ReadHandle,
    algorithms: Sequence[str],
    on_bytes: Callable[[int], None] | None,
    entries: _EntryDigests | None = None,
) -> tuple[list[str], bytes]:
    """Digest a file by streaming reads through one reused buffer (one digest per algorithm, in
    one pass); also return its first bytes. ``entries`` are fed every piece on the way. Each
    piece is hashed on every core where the algorithm allows it, for files large enough to
    gain from it."""
    digesters = [new_digester(algorithm, parallel=handle.size >= _PARALLEL_HASH_BYTES) for algorithm in algorithms]
    buffer = bytearray(min(_HASH_SLICE, max(handle.size, 1)))
    view = memoryview(buffer)
    head = b""
    offset = 0
    while offset < handle.size:
        count = min(len(view), handle.size - offset)
        handle.read_into(offset, view[:count])
        if offset == 0:
            head = bytes(view[: min(count, 1 << 20)])
        for digester in digesters:
            digester.update(view[:count])
        if entries:
            entries.feed(offset, view[:count])
        offset += count
        if on_bytes:
            on_bytes(count)
    return [format_digest(algorithm, d.hexdigest()) for algorithm, d in zip(algorithms, digesters, strict=True)], head


class _CopyingReader:
    """A file-like reader of ``source`` (for zstd's stream reader) that writes every block it
    hands out to ``target`` as well, so the stored bytes are copied as they are decompressed."""

    def __init__(
        self,
        source: ReadHandle,
        target: WriteHandle,
        stop: threading.Event | None,
        on_bytes: Callable[[int], None] | None,
    ) -> None:
        self.source, self.target, self.stop, self.on_bytes = source, target, stop, on_bytes
        self.offset = 0

    def read(self, size: int = -1) -> bytes:
        if self.stop is not None and self.stop.is_set():
            raise StorageError(f"copy stopped at byte {self.offset} of {self.source.size}")
        left = self.source.size - self.offset
        count = left if size < 0 else min(size, left)
        if count <= 0:
            return b""
        block = bytearray(count)
        self.source.read_into(self.offset, memoryview(block))
        self.target.write(memoryview(block))
        self.offset += count
        if self.on_bytes:
            self.on_bytes(count)
        return bytes(block)


def copy_with_digest(
    source: ReadHandle,
    target: WriteHandle,
    algorithm: str,
    *,
    block: int,
    stop: threading.Event | None = None,
    on_bytes: Callable[[int], None] | None = None,
    decompressed_size: int | None = None,
) -> str:
    """Copy all of ``source`` to ``target`` in blocks of at most ``block`` bytes, hashing the
    same bytes on the way (the file is read once and never held whole); return the formatted
    digest. For a zstd-compressed file give ``decompressed_size``: the digest is then of the
    decompressed bytes (what a record's digest describes), decompressed as a stream of
    ``block``-sized pieces, and any other size is an :class:`~shardkeep.errors.IntegrityError`.
    ``target`` is neither committed nor aborted here. With ``stop`` set, the copy fails with
    :class:`~shardkeep.errors.StorageError` before the next block. Peak memory: one block (about
    three, plus zstd's window, for a compressed file), and what ``target`` buffers itself."""
    digester = new_digester(algorithm)
    if decompressed_size is None:  # one reused buffer
        view = memoryview(bytearray(max(1, min(block, source.size))))
        offset = 0
        while offset < source.size:
            if stop is not None and stop.is_set():
                raise StorageError(f"copy stopped at byte {offset} of {source.size}")
            count = min(len(view), source.size - offset)
            source.read_into(offset, view[:count])
            digester.update(view[:count])
            target.write(view[:count])
            offset += count
            if on_bytes:
                on_bytes(count)
        return format_digest(algorithm, digester.hexdigest())
    reader = _CopyingReader(source, target, stop, on_bytes)
    output = memoryview(bytearray(max(1, min(block, decompressed_size + 1))))
    produced = 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(
            reader,  # type: ignore[arg-type]  # a reader: zstd calls only read()
            read_size=block,
            read_across_frames=True,
            closefd=False,
        ) as stream:
            while (count := stream.readinto(output)) > 0:
                produced += count
                if produced > decompressed_size:
                    break
                digester.update(output[:count])
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"cannot be decompressed ({exc})") from exc
    if produced != decompressed_size:
        raise IntegrityError(f"decompresses to {produced}+ bytes, the manifest records {decompressed_size}")
    while reader.offset < source.size:  # bytes after the last frame: copied, as stored
        reader.read(block)
    return format_digest(algorithm, digester.hexdigest())


def _header_problems(
    handle: ReadHandle, head: bytes | memoryview, record: FileRecord, size: int | None = None
) -> list[str]:
    """Cross-check the safetensors header (read from ``head``, or the file) with the record.
    ``size`` is the safetensors file's size when ``head`` holds all of it (a decompressed file,
    whose stored size is smaller)."""
    try:
        length = header_length(head, handle.size if size is None else size)
        if len(head) < 8 + length:
            extra = memoryview(bytearray(8 + length))
            handle.read_into(0, extra)
            head = extra
        return check_header(parse_header(head[: 8 + length]), record)
    except IntegrityError as exc:
        return [f"{record.path}: {exc}"]


def _read_ranges(handle: ReadHandle, record: FileRecord, needed: list[int], use_mmap: bool) -> memoryview:
    """The file's bytes where only the needed entries (and the header) are read: a lazy memory
    map whose other pages are never touched, or a buffer filled only at those ranges."""
    if use_mmap:
        return handle.map()
    data = memoryview(bytearray(handle.size))
    prefix = min(handle.size, 8)
    handle.read_into(0, data[:prefix])
    header_end = min(handle.size, 8 + header_length(data[:prefix], handle.size))
    handle.read_into(0, data[:header_end])
    for index in needed:
        entry = record.tensors[index]
        if entry.nbytes:
            handle.read_into(entry.offset, data[entry.offset : entry.offset + entry.nbytes])
    return data


#: The most a zstd block can expand: 128 KiB of output per 3-byte block header.
_MAX_ZSTD_EXPANSION = 128 * 1024


def _check_compressed(
    handle: ReadHandle,
    record: FileRecord,
    *,
    verify: bool,
    keep: bool,
    on_bytes: Callable[[int], None] | None,
    choice: DigestChoice = "strong",
) -> tuple[memoryview | None, list[str]]:
    """Decompress a whole file, never beyond the size the manifest declares (a compression bomb
    is refused), then check its digest and header like an uncompressed file."""
    stored = memoryview(bytearray(handle.size))
    if handle.size:
        handle.read_into(0, stored)
    # Checked before the output buffer is allocated: the frame must declare the manifest's size,
    # and no zstd frame can expand beyond 128 KiB per 3-byte block header.
    if record.size > _MAX_ZSTD_EXPANSION * (handle.size // 3 + 1):
        return None, [
            f"{record.path}: {handle.size} compressed bytes cannot hold the {record.size} the manifest declares"
        ]
    try:
        declared = zstandard.get_frame_parameters(stored).content_size
    except zstandard.ZstdError as exc:
        return None, [f"{record.path}: cannot be decompressed ({exc})"]
    if declared != record.size:
        size = "no size" if declared == zstandard.CONTENTSIZE_UNKNOWN else f"{declared} bytes"
        return None, [f"{record.path}: the zstd frame declares {size}, the manifest {record.size} bytes"]
    data = memoryview(bytearray(record.size))
    try:
        # Stream into a buffer of exactly the declared size, asking for one byte more: output
        # beyond the manifest's size is never produced, whatever the frame claims.
        with zstandard.ZstdDecompressor().stream_reader(stored, read_across_frames=True) as reader:
            filled = reader.readinto(data)
            while filled < record.size:
                more = reader.readinto(data[filled:])
                if more == 0:
                    break
                filled += more
            extra = reader.read(1)
    except (zstandard.ZstdError, OSError) as exc:
        return None, [f"{record.path}: cannot be decompressed ({exc})"]
    if filled != record.size or extra:
        return None, [f"{record.path}: decompresses to a different size than the manifest's {record.size} bytes"]
    problems: list[str] = []
    if verify:
        if not record.digest:
            problems.append(f"{record.path}: has no digest, so it cannot be verified")
        else:
            expected = _file_digests(record, choice)
            entries = _entries_for(record, choice)
            actual = _digests_view([d.partition(":")[0] for d in expected], data, entries)
            _compare_files(record, expected, actual, problems)
            problems.extend(entries.problems())
        if on_bytes:
            on_bytes(handle.size)
    problems.extend(_header_problems(handle, data, record, size=len(data)))
    return (data if keep else None), problems


def check_shard(
    store: ByteStore,
    path: str,
    record: FileRecord,
    *,
    verify: bool,
    keep: bool,
    use_mmap: bool = True,
    needed: list[int] | None = None,
    on_bytes: Callable[[int], None] | None = None,
    digest: DigestChoice = "strong",
) -> tuple[memoryview | None, list[str]]:
    """Open a data file and check it against its manifest record.

    ``digest`` (with ``verify``): which recorded digests are compared (:data:`DigestChoice`):
    ``"fast"`` the xxh3-128 ones where the record has them (the default of a load without a
    public key), ``"strong"`` the save's own, ``"all"`` both and every block (``verify``).

    Returns the file's bytes (when ``keep``: a private memory map, or a copy when ``use_mmap`` is
    false) and every problem found: size, digest, and safetensors header disagreements. With
    ``verify`` false only the size and header are checked. A verified whole-file read checks the
    file's digest and each entry's own digest (chunks have one), hashing both in one pass.

    ``needed`` lists the indices of the tensor entries the caller will use (``None``: all). When
    it leaves some out and every needed entry has a digest of its own, only the header and the
    needed byte ranges are read and verified; the other bytes of the file are never touched.

    A file whose header version is older than the record's is *stale* (SPEC-029 3.2): it is
    read again once (a cache or a replica may have caught up); if it is still stale, the
    problem is reported.
    """
    data, problems = _check_shard_once(
        store, path, record, verify=verify, keep=keep, use_mmap=use_mmap, needed=needed, on_bytes=on_bytes,
        choice=digest,
    )  # fmt: skip
    if any(STALE in problem for problem in problems):
        data, problems = _check_shard_once(
            store, path, record, verify=verify, keep=keep, use_mmap=use_mmap, needed=needed, on_bytes=None,
            choice=digest,
        )  # fmt: skip
    return data, problems


def _check_shard_once(
    store: ByteStore,
    path: str,
    record: FileRecord,
    *,
    verify: bool,
    keep: bool,
    use_mmap: bool,
    needed: list[int] | None,
    on_bytes: Callable[[int], None] | None,
    choice: DigestChoice,
) -> tuple[memoryview | None, list[str]]:
    """One reading of the file for :func:`check_shard`: open it, compare its stored size, and
    check it by the reading that fits (compressed, only the needed entries, or the whole file)."""
    problems: list[str] = []
    try:
        handle = store.open_read(path)
    except ShardkeepError as exc:
        return None, [f"{record.path}: {exc}"]
    try:
        if handle.size != record.stored_size:
            return None, [f"{record.path}: size is {handle.size} bytes, manifest says {record.stored_size}"]
        if record.compression is not None:
            return _check_compressed(handle, record, verify=verify, keep=keep, on_bytes=on_bytes, choice=choice)
        if (
            keep
            and needed is not None
            and len(needed) < len(record.tensors)
            and all(_checkable_alone(record, record.tensors[index]) for index in needed)
        ):
            data: memoryview | None = _check_needed_entries(
                handle, record, needed, problems, verify=verify, use_mmap=use_mmap, on_bytes=on_bytes, choice=choice
            )
        else:
            data = _check_whole_file(
                handle, record, problems, verify=verify, keep=keep, use_mmap=use_mmap, on_bytes=on_bytes, choice=choice
            )
        return data, problems
    except ShardkeepError as exc:
        problems.append(f"{record.path}: {exc}")
        return None, problems
    finally:
        handle.close()


def _checkable_alone(record: FileRecord, entry: TensorEntry) -> bool:
    """Whether a partial read can check ``entry`` by itself: by its own digest, or by its blocks
    when they hold a strong digest each (or the save's digest is xxh3-128, so the blocks are as
    strong as the file's digest)."""
    return bool(entry.digest) or blocks_check(record, entry, strong=True)


def _check_needed_entries(
    handle: ReadHandle,
    record: FileRecord,
    needed: list[int],
    problems: list[str],
    *,
    verify: bool,
    use_mmap: bool,
    on_bytes: Callable[[int], None] | None,
    choice: DigestChoice = "strong",
) -> memoryview:
    """Read only the header and the ``needed`` entries (each of which has a digest of its own, or
    block digests), verify each entry's digest (or all its blocks) with ``verify``, and check the
    header. Problems are appended to ``problems`` as they are found (so that an I/O error later
    still reports them)."""
    data = _read_ranges(handle, record, needed, use_mmap)
    if verify:
        for index in needed:
            entry = record.tensors[index]
            view = data[entry.offset : entry.offset + entry.nbytes]
            if entry.digest is not None:
                intact = digests_equal(entry.digest, _digest_view(entry.digest.partition(":")[0], view))
            elif choice == "fast":
                intact = hmac.compare_digest(
                    fast_block_digests(entry.blocks, block_width(record, entry)),
                    block_digests(view, record.block_size, None),
                )
            else:
                intact = hmac.compare_digest(
                    entry.blocks, block_digests(view, record.block_size, blocks_strong(record, entry))
                )
            if not intact:
                problems.append(f"{record.path}: tensor {entry.key!r} fails its digest (file is corrupt)")
        if on_bytes:
            on_bytes(sum(record.tensors[index].nbytes for index in needed))
    problems.extend(_header_problems(handle, data, record))
    return data


def _check_whole_file(
    handle: ReadHandle,
    record: FileRecord,
    problems: list[str],
    *,
    verify: bool,
    keep: bool,
    use_mmap: bool,
    on_bytes: Callable[[int], None] | None,
    choice: DigestChoice = "strong",
) -> memoryview | None:
    """Check the file's digests (with ``verify``: those ``choice`` names, and in the same pass
    each chunk's own digest, or with ``"all"`` its blocks) and header. With ``keep`` the whole file is
    mapped (or read into memory) and returned; without it, it is digested by streaming reads, or
    only its first MiB is read when there is no digest to check. Problems are appended to
    ``problems`` as they are found. Checking the chunk digests too keeps a whole-file reader
    (verify, a full load) from passing a file that a reader of one chunk would refuse."""
    data: memoryview | None = None
    expected = _file_digests(record, choice)
    algorithms = [digest.partition(":")[0] for digest in expected]
    if keep:
        data = handle.map() if use_mmap else _read_whole(handle)
        head: bytes | memoryview = data
        if verify and record.digest:
            entries = _entries_for(record, choice)
            actual = _digests_view(algorithms, data, entries)
            if on_bytes:
                on_bytes(handle.size)
            _compare_files(record, expected, actual, problems)
            problems.extend(entries.problems())
    elif verify and record.digest:
        entries = _entries_for(record, choice)
        actual, head = _stream_digest(handle, algorithms, on_bytes, entries)
        _compare_files(record, expected, actual, problems)
        problems.extend(entries.problems())
    else:
        head_buffer = memoryview(bytearray(min(handle.size, 1 << 20)))
        handle.read_into(0, head_buffer)
        head = head_buffer
    if verify and not record.digest:
        problems.append(f"{record.path}: has no digest, so it cannot be verified")
    problems.extend(_header_problems(handle, head, record))
    return data


def _read_whole(handle: ReadHandle) -> memoryview:
    """The whole file, read into a private buffer."""
    data = memoryview(bytearray(handle.size))
    if handle.size:
        handle.read_into(0, data)
    return data
