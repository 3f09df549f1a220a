"""Bounded parallel shard I/O: writing data files with streamed digests, and reading them back
with verification.

One concurrency model: a bounded thread pool writes or reads whole files, and
a :class:`ByteBudget` bounds the bytes held in copies and buffers across all threads. Each file's
digest is computed from the same buffers that are written, in a second thread, so hashing
overlaps with the write and the data is never read twice.

This module does not import torch: tensors reach it as :class:`TensorSource` objects.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import zstandard

from shardkeep.errors import IntegrityError, ShardkeepError, StorageError, UnsupportedValueError
from shardkeep.integrity import Digester, digests_equal, format_digest, new_digester
from shardkeep.manifest import Compression, FileRecord
from shardkeep.storage.base import ByteStore, ReadHandle, WriteHandle
from shardkeep.tensors.shardfile import STALE, check_header, header_length, parse_header

__all__ = ["ByteBudget", "ShardPlan", "TensorSource", "check_shard", "digest_of", "write_shards"]

MiB = 1 << 20
#: Tensors up to this size are copied into a shared buffer and written together.
SMALL_TENSOR_BYTES = 256 * 1024
_HASH_SLICE = 16 * MiB


class TensorSource(Protocol):
    """The bytes of one tensor, as the writer needs them.

    ``address`` is the address of the tensor's bytes when they are already contiguous in host
    memory (``None`` otherwise); ``pieces`` yields contiguous byte views of at most ``max_bytes``
    each (one row may be larger), in order. The source keeps its tensor alive. With
    ``wants_digest``, the tensor gets a digest of its own (chunks, which a loading rank may read
    without reading the rest of their file).
    """

    nbytes: int
    wants_digest: bool

    @property
    def address(self) -> int | None: ...

    def pieces(self, max_bytes: int) -> Iterator[memoryview]: ...


class ByteBudget:
    """A counting limit on bytes held in copies and buffers; ``peak`` records the high-water mark."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.peak = 0
        self._condition = threading.Condition()

    def acquire(self, nbytes: int) -> None:
        if nbytes > self.limit:
            raise UnsupportedValueError(f"a single buffer of {nbytes} bytes exceeds the byte budget of {self.limit}")
        with self._condition:
            while self.held + nbytes > self.limit:
                self._condition.wait()
            self.held += nbytes
            self.peak = max(self.peak, self.held)

    def release(self, nbytes: int) -> None:
        with self._condition:
            self.held -= nbytes
            self._condition.notify_all()


@dataclass
class ShardPlan:
    """One data file to write: its path (relative to the store), header and tensor sources."""

    path: str
    header: bytes
    sources: Sequence[TensorSource]
    record: FileRecord
    store: ByteStore | None = None  # where it goes, when not the store given to write_shards


class _Sink:
    """Writes buffers to a handle while other threads digest the same buffers: the file's
    digest, and for a chunk that may be read on its own, the chunk's digest too."""

    def __init__(self, handle: WriteHandle, digester: Digester, hash_pool: ThreadPoolExecutor) -> None:
        self._handle = handle
        self._digester = digester
        self._hash_pool = hash_pool
        self.size = 0

    def put(self, view: memoryview, entry_digester: Digester | None = None) -> None:
        if len(view) == 0:
            return
        if len(view) >= MiB:
            pending = [self._hash_pool.submit(self._digester.update, view)]
            if entry_digester is not None:
                pending.append(self._hash_pool.submit(entry_digester.update, view))
            try:
                self._handle.write(view)
            finally:
                for future in pending:
                    future.result()
        else:
            self._digester.update(view)
            if entry_digester is not None:
                entry_digester.update(view)
            self._handle.write(view)
        self.size += len(view)


class _CompressingWriter:
    """A :class:`WriteHandle` that zstd-compresses everything written to ``inner``.

    Single-threaded with a fixed level and no dictionary, so the same bytes always produce the
    same compressed file; the frame records the content size, and no checksum (the manifest's
    digest of the uncompressed bytes is the check)."""

    def __init__(self, inner: WriteHandle, level: int, size: int) -> None:
        self._inner = inner
        compressor = zstandard.ZstdCompressor(level=level, write_checksum=False, write_content_size=True)
        self._compressor = compressor.compressobj(size=size)
        self.stored_size = 0

    def write(self, data: bytes | memoryview, /) -> None:
        out = self._compressor.compress(data)
        if out:
            self._inner.write(out)
            self.stored_size += len(out)

    def commit(self) -> None:
        tail = self._compressor.flush()
        if tail:
            self._inner.write(tail)
            self.stored_size += len(tail)
        self._inner.commit()

    def abort(self) -> None:
        self._inner.abort()


def _write_one(
    store: ByteStore,
    plan: ShardPlan,
    algorithm: str,
    budget: ByteBudget,
    share: int,
    hash_pool: ThreadPoolExecutor,
    on_bytes: Callable[[int], None] | None,
    compression_level: int | None,
) -> FileRecord:
    digester = new_digester(algorithm)
    handle: WriteHandle = (plan.store or store).open_write(plan.path)
    compressing = (
        _CompressingWriter(handle, compression_level, plan.record.size) if compression_level is not None else None
    )
    if compressing is not None:
        handle = compressing
    try:
        sink = _Sink(handle, digester, hash_pool)
        sink.put(memoryview(plan.header))
        # This thread holds at most one buffer of small tensors and one copied piece at once;
        # both fit in its share of the budget, so no thread ever waits on its own bytes.
        chunk_size = max(4096, min(8 * MiB, share // 4))
        piece_max = max(4096, min(8 * MiB, share - chunk_size))
        buffer: bytearray | None = None
        filled = 0
        try:
            for index, source in enumerate(plan.sources):
                address = source.address
                entry_digester = new_digester(algorithm) if source.wants_digest else None
                if address is not None and source.nbytes <= SMALL_TENSOR_BYTES and source.nbytes <= chunk_size:
                    if buffer is None:
                        budget.acquire(chunk_size)
                        buffer = bytearray(chunk_size)
                        buffer_address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
                    if filled + source.nbytes > chunk_size:
                        sink.put(memoryview(buffer)[:filled])
                        filled = 0
                    ctypes.memmove(buffer_address + filled, address, source.nbytes)
                    if entry_digester is not None:
                        entry_digester.update(memoryview(buffer)[filled : filled + source.nbytes])
                    filled += source.nbytes
                elif address is not None:
                    if filled:
                        assert buffer is not None
                        sink.put(memoryview(buffer)[:filled])
                        filled = 0
                    if source.nbytes:
                        view = memoryview((ctypes.c_ubyte * source.nbytes).from_address(address)).cast("B")
                        sink.put(view, entry_digester)
                else:
                    if filled:
                        assert buffer is not None
                        sink.put(memoryview(buffer)[:filled])
                        filled = 0
                    pieces = source.pieces(piece_max)
                    while True:
                        budget.acquire(piece_max)
                        try:
                            piece = next(pieces, None)
                            if piece is None:
                                break
                            sink.put(piece, entry_digester)
                            del piece
                        finally:
                            budget.release(piece_max)
                if entry_digester is not None:
                    plan.record.tensors[index].digest = format_digest(algorithm, entry_digester.hexdigest())
                if on_bytes:
                    on_bytes(source.nbytes)
            if filled:
                assert buffer is not None
                sink.put(memoryview(buffer)[:filled])
        finally:
            if buffer is not None:
                del buffer
                budget.release(chunk_size)
        if sink.size != plan.record.size:
            raise StorageError(
                f"{plan.path}: wrote {sink.size} bytes but planned {plan.record.size}; a tensor changed size while saving"
            )
        handle.commit()
    except BaseException:
        handle.abort()
        raise
    plan.record.digest = format_digest(algorithm, digester.hexdigest())
    if compressing is not None:
        assert compression_level is not None
        plan.record.compression = Compression(
            codec="zstd", level=compression_level, stored_size=compressing.stored_size
        )
    return plan.record


def write_shards(
    store: ByteStore,
    plans: Sequence[ShardPlan],
    *,
    algorithm: str,
    budget: ByteBudget,
    io_threads: int,
    on_bytes: Callable[[int], None] | None = None,
    compression_level: int | None = None,
) -> list[FileRecord]:
    """Write every planned file (at most ``io_threads`` at once), fsync each, and return their
    records with digests filled in. The first failure is raised after all writers stop.
    With ``compression_level``, each file is zstd-compressed at that level as it is written."""
    if not plans:
        return []
    workers = max(1, min(io_threads, len(plans), budget.limit // (64 * 1024)))
    share = budget.limit // workers
    with (
        ThreadPoolExecutor(workers, thread_name_prefix="shardkeep-write") as pool,
        ThreadPoolExecutor(2 * workers, thread_name_prefix="shardkeep-hash") as hash_pool,
    ):
        futures = [
            pool.submit(_write_one, store, plan, algorithm, budget, share, hash_pool, on_bytes, compression_level)
            for plan in plans
        ]
        records: list[FileRecord] = []
        first_error: BaseException | None = None
        for future in futures:
            try:
                records.append(future.result())
            except BaseException as exc:
                if first_error is None:
                    first_error = exc
        if first_error is not None:
            raise first_error
    return records


def digest_of(header: bytes, sources: Sequence[TensorSource], algorithm: str, piece_bytes: int = 8 * MiB) -> str:
    """The digest the planned file (``header`` then every source's bytes) would have, computed
    without writing it: an incremental save compares it with the previous checkpoint's."""
    digester = new_digester(algorithm)
    digester.update(memoryview(header))
    for source in sources:
        address = source.address
        if address is not None:
            if source.nbytes:
                view = memoryview((ctypes.c_ubyte * source.nbytes).from_address(address)).cast("B")
                for start in range(0, len(view), _HASH_SLICE):
                    digester.update(view[start : start + _HASH_SLICE])
        else:
            for piece in source.pieces(piece_bytes):
                digester.update(piece)
                del piece
    return format_digest(algorithm, digester.hexdigest())


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def _digest_view(algorithm: str, view: memoryview) -> str:
    digester = new_digester(algorithm)
    for start in range(0, len(view), _HASH_SLICE):
        digester.update(view[start : start + _HASH_SLICE])
    return format_digest(algorithm, digester.hexdigest())


def _stream_digest(handle: ReadHandle, algorithm: str, on_bytes: Callable[[int], None] | None) -> tuple[str, bytes]:
    """Digest a file by streaming reads through one reused buffer; also return its first bytes."""
    digester = new_digester(algorithm)
    buffer = bytearray(min(_HASH_SLICE, max(handle.size, 1)))
    view = memoryview(buffer)
    head = b""
    offset = 0
    while offset < handle.size:
        count = min(len(view), handle.size - offset)
        handle.read_into(offset, view[:count])
        if offset == 0:
            head = bytes(view[: min(count, 1 << 20)])
        digester.update(view[:count])
        offset += count
        if on_bytes:
            on_bytes(count)
    return format_digest(algorithm, digester.hexdigest()), head


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
        elif not digests_equal(record.digest, _digest_view(record.digest.partition(":")[0], data)):
            problems.append(f"{record.path}: digest mismatch (file is corrupt)")
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
) -> tuple[memoryview | None, list[str]]:
    """Open a data file and check it against its manifest record.

    Returns the file's bytes (when ``keep``: a private memory map, or a copy when ``use_mmap`` is
    false) and every problem found: size, digest, and safetensors header disagreements. With
    ``verify`` false only the size and header are checked.

    ``needed`` lists the indices of the tensor entries the caller will use (``None``: all). When
    it leaves some out and every needed entry has a digest of its own, only the header and the
    needed byte ranges are read and verified; the other bytes of the file are never touched.

    A file whose header version is older than the record's is *stale* (SPEC-029 3.2): it is
    read again once (a cache or a replica may have caught up); if it is still stale, the
    problem is reported.
    """
    data, problems = _check_shard_once(store, path, record, verify, keep, use_mmap, needed, on_bytes)
    if any(STALE in problem for problem in problems):
        data, problems = _check_shard_once(store, path, record, verify, keep, use_mmap, needed, None)
    return data, problems


def _check_shard_once(
    store: ByteStore,
    path: str,
    record: FileRecord,
    verify: bool,
    keep: bool,
    use_mmap: bool,
    needed: list[int] | None,
    on_bytes: Callable[[int], None] | None,
) -> tuple[memoryview | None, list[str]]:
    problems: list[str] = []
    try:
        handle = store.open_read(path)
    except ShardkeepError as exc:
        return None, [f"{record.path}: {exc}"]
    try:
        if handle.size != record.stored_size:
            return None, [f"{record.path}: size is {handle.size} bytes, manifest says {record.stored_size}"]
        if record.compression is not None:
            return _check_compressed(handle, record, verify=verify, keep=keep, on_bytes=on_bytes)
        data: memoryview | None = None
        partial = (
            keep
            and needed is not None
            and len(needed) < len(record.tensors)
            and all(record.tensors[index].digest for index in needed)
        )
        if partial:
            assert needed is not None
            data = _read_ranges(handle, record, needed, use_mmap)
            if verify:
                for index in needed:
                    entry = record.tensors[index]
                    assert entry.digest is not None
                    actual = _digest_view(
                        entry.digest.partition(":")[0], data[entry.offset : entry.offset + entry.nbytes]
                    )
                    if not digests_equal(entry.digest, actual):
                        problems.append(f"{record.path}: tensor {entry.key!r} fails its digest (file is corrupt)")
                if on_bytes:
                    on_bytes(sum(record.tensors[index].nbytes for index in needed))
            problems.extend(_header_problems(handle, data, record))
            return data, problems
        if keep:
            if use_mmap:
                data = handle.map()
            else:
                data = memoryview(bytearray(handle.size))
                if handle.size:
                    handle.read_into(0, data)
            head: bytes | memoryview = data
            if verify and record.digest:
                actual = _digest_view(record.digest.partition(":")[0], data)
                if on_bytes:
                    on_bytes(handle.size)
                if not digests_equal(record.digest, actual):
                    problems.append(f"{record.path}: digest mismatch (file is corrupt)")
        elif verify and record.digest:
            actual, head = _stream_digest(handle, record.digest.partition(":")[0], on_bytes)
            if not digests_equal(record.digest, actual):
                problems.append(f"{record.path}: digest mismatch (file is corrupt)")
        else:
            head_buffer = memoryview(bytearray(min(handle.size, 1 << 20)))
            handle.read_into(0, head_buffer)
            head = head_buffer
        if verify and not record.digest:
            problems.append(f"{record.path}: has no digest, so it cannot be verified")
        problems.extend(_header_problems(handle, head, record))
        return data, problems
    except ShardkeepError as exc:
        problems.append(f"{record.path}: {exc}")
        return None, problems
    finally:
        handle.close()
