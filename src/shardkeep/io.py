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
import hmac
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol

import zstandard

from shardkeep.errors import IntegrityError, ShardkeepError, StorageError, UnsupportedValueError
from shardkeep.integrity import (
    BlockDigester,
    Digester,
    DualDigester,
    block_digests,
    digests_equal,
    format_digest,
    new_digester,
)
from shardkeep.manifest import (
    FAST_BLOCK_DIGEST_BYTES,
    FAST_DIGEST,
    STRONG_BLOCK_DIGEST_BYTES,
    Compression,
    FileRecord,
    TensorEntry,
)
from shardkeep.progress import collector_paused
from shardkeep.storage.base import ByteStore, ReadHandle, WriteHandle
from shardkeep.tensors.shardfile import (
    STALE,
    built_header_agrees,
    check_header,
    header_length,
    parse_built_header,
    parse_header,
)

__all__ = [
    "ByteBudget",
    "DigestChoice",
    "FileDigests",
    "ShardPlan",
    "TensorSource",
    "WriteControl",
    "check_shard",
    "copy_with_digest",
    "digest_of",
    "stop_writes_on",
    "write_shards",
]

MiB = 1 << 20
#: Tensors up to this size are copied into a shared buffer and written together.
SMALL_TENSOR_BYTES = 256 * 1024
_HASH_SLICE = 16 * MiB
#: Views at least this large are hashed on every core (blake3); smaller ones on one thread.
_PARALLEL_HASH_BYTES = 1 * MiB
_memmove = ctypes.memmove  # one lookup per small tensor copied, not two


class TensorSource(Protocol):
    """The bytes of one tensor, as the writer needs them.

    ``address`` is the address of the tensor's bytes when they are already contiguous in host
    memory (``None`` otherwise); ``pieces`` yields contiguous byte views of at most ``max_bytes``
    each (one row may be larger), in order. The source keeps its tensor alive. With
    ``wants_digest``, the tensor's bytes get a strong digest of their own (chunks, which a
    loading rank may read without reading the rest of their file). With ``wants_blocks``, and
    when its file record has a ``block_size``, the tensor gets block digests
    (``TensorEntry.blocks``): with a strong digest per block when it ``wants_digest`` (these
    replace the entry's own digest), fast-only otherwise.
    """

    nbytes: int
    wants_digest: bool
    wants_blocks: bool

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


#: What the error of a writer stopped through a :class:`WriteControl` says.
ABANDONED = "the save was abandoned"


#: The event of the innermost :func:`stop_writes_on` block of this thread (or context).
_STOP_SCOPE: ContextVar[threading.Event | None] = ContextVar("shardkeep_stop_writes", default=None)


@contextmanager
def stop_writes_on(event: threading.Event) -> Iterator[None]:
    """Every :class:`WriteControl` created inside this block (on this thread) also counts as
    cancelled once ``event`` is set: setting it from anywhere (a signal handler included: it is
    one flag) stops the writes of the saves begun in the block at their next buffer."""
    token = _STOP_SCOPE.set(event)
    try:
        yield
    finally:
        _STOP_SCOPE.reset(token)


class WriteControl:
    """Lets another thread follow and stop a :func:`write_shards` call: ``progressed`` is the
    ``time.monotonic()`` of the last buffer written (or of the control's creation), and after
    :meth:`cancel` (or once the event of the :func:`stop_writes_on` block it was created in is
    set) the next buffer any writer would write fails the call instead."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self.progressed = time.monotonic()
        self.scope = _STOP_SCOPE.get()

    def cancel(self) -> None:
        self.cancelled.set()

    def stopped(self) -> bool:
        """Whether writes must stop: cancelled, or the enclosing block's event is set."""
        return self.cancelled.is_set() or (self.scope is not None and self.scope.is_set())


class _Sink:
    """Writes buffers to a handle while other threads digest the same buffers: the file's
    digests (strong, and fast unless the save writes none), and for a tensor that may be read
    on its own, its digest or its blocks' digests too. A large buffer is hashed by two tasks on
    the hash pool, one for the strong digests and one for the fast ones."""

    def __init__(
        self,
        handle: WriteHandle,
        digester: DualDigester,
        hash_pool: ThreadPoolExecutor,
        control: WriteControl | None = None,
        path: str = "",
    ) -> None:
        self._handle = handle
        self._digester = digester
        self._hash_pool = hash_pool
        self._control = control
        self._path = path
        self.size = 0

    def put(
        self, view: memoryview, entry_digester: Digester | None = None, blocks: BlockDigester | None = None
    ) -> None:
        if len(view) == 0:
            return
        control = self._control
        if control is not None:
            if control.stopped():
                raise StorageError(f"{self._path}: {ABANDONED} before this file was complete")
            control.progressed = time.monotonic()
        digester = self._digester
        if len(view) >= MiB:
            submit = self._hash_pool.submit
            pending: list[Future[object]] = [submit(_hash_strong, digester, blocks, view)]
            if digester.fast is not None or blocks is not None:
                pending.append(submit(_hash_fast, digester, blocks, view))
            if entry_digester is not None:
                pending.append(submit(entry_digester.update, view))
            try:
                self._handle.write(view)
            finally:
                for future in pending:
                    future.result()
        else:
            digester.update(view)
            if blocks is not None:
                blocks.update(view)
            if entry_digester is not None:
                entry_digester.update(view)
            self._handle.write(view)
        self.size += len(view)


#: A buffer hashed twice (the file's digest and its blocks') is fed to both a slice of this
#: size at a time, so the second digest reads the slice from the cache, not from memory.
_CACHED_SLICE = 1 * MiB


def _hash_strong(digester: DualDigester, blocks: BlockDigester | None, view: memoryview) -> None:
    """The strong pass over one buffer: the file's strong digest and the blocks' strong ones."""
    if blocks is None or not blocks.strong:
        digester.update_strong(view)
        return
    for start in range(0, len(view), _CACHED_SLICE):
        piece = view[start : start + _CACHED_SLICE]
        digester.update_strong(piece)
        blocks.update_strong(piece)


def _hash_fast(digester: DualDigester, blocks: BlockDigester | None, view: memoryview) -> None:
    """The fast pass over one buffer: the file's xxh3-128 digest and the blocks' xxh3-128 ones."""
    if blocks is None:
        digester.update_fast(view)
        return
    for start in range(0, len(view), _CACHED_SLICE):
        piece = view[start : start + _CACHED_SLICE]
        digester.update_fast(piece)
        blocks.update_fast(piece)


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


@dataclass(frozen=True)
class _WriteSettings:
    """What every file of one :func:`write_shards` call is written with.

    ``coalesce_bytes`` is the size of a writer thread's buffer of small tensors and
    ``piece_bytes`` the most one copied piece of a tensor may hold: a thread holds at most one
    of each at once, and both fit in its share of the budget, so no thread ever waits on its
    own bytes.
    """

    algorithm: str
    budget: ByteBudget
    hash_pool: ThreadPoolExecutor
    #: Whether files get a ``fast_digest`` (not with ``block_size=0``, which writes 2.0/1.3).
    fast: bool
    on_bytes: Callable[[int], None] | None
    compression_level: int | None
    coalesce_bytes: int
    piece_bytes: int
    control: WriteControl | None = None

    @staticmethod
    def split_share(share: int) -> tuple[int, int]:
        """``(coalesce_bytes, piece_bytes)`` for a writer thread's ``share`` of the budget."""
        coalesce_bytes = max(4096, min(8 * MiB, share // 4))
        return coalesce_bytes, max(4096, min(8 * MiB, share - coalesce_bytes))


class _SmallTensorBuffer:
    """Copy strategy for small tensors in host memory: each is copied into one shared buffer,
    written in a single call when the next tensor would not fit, or by :meth:`flush`.

    The buffer is taken from the budget when first needed and given back by :meth:`release`.
    A tensor with a digest (or block digests) of its own is hashed from its copy in the buffer."""

    __slots__ = ("_address", "_budget", "_buffer", "_filled", "_sink", "size")

    def __init__(self, sink: _Sink, budget: ByteBudget, size: int) -> None:
        self._sink = sink
        self._budget = budget
        self.size = size
        self._buffer: bytearray | None = None
        self._address = 0
        self._filled = 0

    def add(self, address: int, nbytes: int, entry_digester: Digester | None, blocks: BlockDigester | None) -> None:
        """Copy ``nbytes`` (at most ``size``) from ``address`` into the buffer."""
        buffer = self._buffer
        if buffer is None:
            self._budget.acquire(self.size)
            buffer = self._buffer = bytearray(self.size)
            self._address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
        filled = self._filled
        if filled + nbytes > self.size:
            self._sink.put(memoryview(buffer)[:filled])
            filled = 0
        _memmove(self._address + filled, address, nbytes)
        if entry_digester is not None:
            entry_digester.update(memoryview(buffer)[filled : filled + nbytes])
        if blocks is not None:
            blocks.update(memoryview(buffer)[filled : filled + nbytes])
        self._filled = filled + nbytes

    def flush(self) -> None:
        """Write what the buffer holds, if anything."""
        if self._filled:
            assert self._buffer is not None
            self._sink.put(memoryview(self._buffer)[: self._filled])
            self._filled = 0

    def release(self) -> None:
        """Free the buffer and give its bytes back to the budget (whatever is still unwritten
        is dropped: called after :meth:`flush`, or on failure)."""
        if self._buffer is not None:
            self._buffer = None
            self._budget.release(self.size)


def _write_in_place(
    sink: _Sink, address: int, nbytes: int, entry_digester: Digester | None, blocks: BlockDigester | None
) -> None:
    """Copy strategy for a large contiguous tensor in host memory: written (and hashed)
    straight from the tensor's own bytes, with no copy and nothing taken from the budget."""
    if nbytes:
        view = memoryview((ctypes.c_ubyte * nbytes).from_address(address)).cast("B")
        sink.put(view, entry_digester, blocks)


def _write_in_pieces(
    sink: _Sink,
    source: TensorSource,
    budget: ByteBudget,
    piece_bytes: int,
    entry_digester: Digester | None,
    blocks: BlockDigester | None,
) -> None:
    """Copy strategy for a tensor with no host address (on a device, or not contiguous): the
    source copies it to host memory one piece of at most ``piece_bytes`` at a time, each piece
    held in the budget until it is written."""
    pieces = source.pieces(piece_bytes)
    while True:
        budget.acquire(piece_bytes)
        try:
            piece = next(pieces, None)
            if piece is None:
                break
            sink.put(piece, entry_digester, blocks)
            del piece
        finally:
            budget.release(piece_bytes)


def _write_sources(sink: _Sink, plan: ShardPlan, settings: _WriteSettings) -> None:
    """Write every tensor of ``plan`` after its header, each by the copy strategy that fits it,
    in order; record the block digests of each tensor that wants them (in a file with a
    ``block_size``), else the digest of each tensor that wants one of its own."""
    small = _SmallTensorBuffer(sink, settings.budget, settings.coalesce_bytes)
    # Locals, not attribute lookups: this loop runs once per tensor (20,000 small ones, say).
    algorithm, on_bytes, add_small = settings.algorithm, settings.on_bytes, small.add
    block_size, strong = plan.record.block_size, _strong_block_algorithm(algorithm)
    small_limit = min(SMALL_TENSOR_BYTES, small.size)
    try:
        for index, source in enumerate(plan.sources):
            address, nbytes = source.address, source.nbytes
            entry_digester: Digester | None = None
            blocks: BlockDigester | None = None
            if block_size and source.wants_blocks:
                blocks = BlockDigester(block_size, strong if source.wants_digest else None)
            elif source.wants_digest:
                entry_digester = new_digester(algorithm)
            if address is not None and nbytes <= small_limit:
                add_small(address, nbytes, entry_digester, blocks)
            else:
                small.flush()
                if address is not None:
                    _write_in_place(sink, address, nbytes, entry_digester, blocks)
                else:
                    _write_in_pieces(sink, source, settings.budget, settings.piece_bytes, entry_digester, blocks)
            if blocks is not None:
                plan.record.tensors[index].blocks = blocks.digest()
            elif entry_digester is not None:
                plan.record.tensors[index].digest = format_digest(algorithm, entry_digester.hexdigest())
            if on_bytes:
                on_bytes(nbytes)
        small.flush()
    finally:
        small.release()


def _strong_block_algorithm(algorithm: str) -> str | None:
    """The strong digest of a save's blocks: its own algorithm, none for an xxh3-128 save."""
    return None if algorithm == FAST_DIGEST else algorithm


def _write_one(store: ByteStore, plan: ShardPlan, settings: _WriteSettings) -> FileRecord:
    """Write one planned file (zstd-compressed with ``settings.compression_level``), digesting
    its bytes as they are written, and commit it; on any failure the file is aborted. Returns
    its record with the digests (and compression) filled in: a compressed file gets no blocks,
    and its digests are of the uncompressed bytes."""
    if settings.compression_level is not None:
        plan.record.block_size = 0
    digester = DualDigester(settings.algorithm, fast=settings.fast)
    handle: WriteHandle = (plan.store or store).open_write(plan.path)
    compressing: _CompressingWriter | None = None
    if settings.compression_level is not None:
        handle = compressing = _CompressingWriter(handle, settings.compression_level, plan.record.size)
    try:
        sink = _Sink(handle, digester, settings.hash_pool, settings.control, plan.path)
        sink.put(memoryview(plan.header))
        _write_sources(sink, plan, settings)
        if sink.size != plan.record.size:
            raise StorageError(
                f"{plan.path}: wrote {sink.size} bytes but planned {plan.record.size}; a tensor changed size while saving"
            )
        handle.commit()
    except BaseException:
        handle.abort()
        raise
    plan.record.digest, plan.record.fast_digest = digester.digests()
    if compressing is not None:
        assert settings.compression_level is not None
        plan.record.compression = Compression(
            codec="zstd", level=settings.compression_level, stored_size=compressing.stored_size
        )
    return plan.record


def _refuse_disagreeing_header(plan: ShardPlan) -> None:
    """Refuse a planned file whose header, once written, would fail the header check of every
    load and verify (:func:`~shardkeep.tensors.shardfile.check_header`): a writer's bug, such
    as two entries under one name, must fail the save, never commit a checkpoint that cannot
    load. The header bytes are the ones written, and the digest covers them.
    :func:`~shardkeep.tensors.shardfile.built_header_agrees` settles the usual case quickly; the
    full check, the one every load makes, decides whenever it does not."""
    if built_header_agrees(plan.header, plan.record):
        return
    try:
        problems = check_header(parse_built_header(plan.header), plan.record)
    except IntegrityError as exc:
        problems = [f"{plan.record.path}: {exc}"]
    if problems:
        raise IntegrityError(
            f"refusing to write {plan.record.path}: its safetensors header disagrees with its manifest record: "
            + "; ".join(problems[:5]),
            problems,
        )


def write_shards(
    store: ByteStore,
    plans: Sequence[ShardPlan],
    *,
    algorithm: str,
    budget: ByteBudget,
    io_threads: int,
    on_bytes: Callable[[int], None] | None = None,
    compression_level: int | None = None,
    control: WriteControl | None = None,
    fast: bool = True,
) -> list[FileRecord]:
    """Write every planned file (at most ``io_threads`` at once), fsync each, and return their
    records with digests filled in: the strong ``digest``, with ``fast`` the ``fast_digest``
    too, and the block digests of the tensors that want them in files with a ``block_size``. The first failure is raised after all writers stop.
    With ``compression_level``, each file is zstd-compressed at that level as it is written.
    ``control`` records each buffer written; once it is cancelled, the next buffer any writer
    would write raises a :class:`~shardkeep.errors.StorageError` instead (each file is aborted).

    A file whose header disagrees with its record (the manifest's entries of that file) is
    refused with an :class:`~shardkeep.errors.IntegrityError` before any file is written: load
    and verify check every file by the same rule, so such a file could never be read back."""
    if not plans:
        return []
    with collector_paused():  # 20,000 entries make as many small dicts and lists
        for plan in plans:
            _refuse_disagreeing_header(plan)
    workers = max(1, min(io_threads, len(plans), budget.limit // (64 * 1024)))
    coalesce_bytes, piece_bytes = _WriteSettings.split_share(budget.limit // workers)
    with (
        ThreadPoolExecutor(workers, thread_name_prefix="shardkeep-write") as pool,
        ThreadPoolExecutor(2 * workers, thread_name_prefix="shardkeep-hash") as hash_pool,
    ):
        settings = _WriteSettings(
            algorithm=algorithm,
            budget=budget,
            hash_pool=hash_pool,
            fast=fast,
            on_bytes=on_bytes,
            compression_level=compression_level,
            coalesce_bytes=coalesce_bytes,
            piece_bytes=piece_bytes,
            control=control,
        )
        futures = [pool.submit(_write_one, store, plan, settings) for plan in plans]
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


class FileDigests(NamedTuple):
    """What :func:`digest_of` computes for a planned file: its ``digest``, its ``fast_digest``
    (``None`` unless asked for) and, per source, its ``blocks`` value (``b""`` for none)."""

    digest: str
    fast_digest: str | None
    blocks: list[bytes]


def digest_of(
    header: bytes,
    sources: Sequence[TensorSource],
    algorithm: str,
    piece_bytes: int = 8 * MiB,
    *,
    block_size: int = 0,
    fast: bool = False,
) -> FileDigests:
    """The digests the planned file (``header`` then every source's bytes) would have, computed
    without writing it, as :func:`write_shards` would record them (``block_size`` the file
    record's, ``fast`` whether files get a ``fast_digest``): an incremental save compares the
    digest with the previous checkpoint's, and takes the others for the record that references
    that file."""
    digester = DualDigester(algorithm, fast=fast)
    digester.update(memoryview(header))
    strong = _strong_block_algorithm(algorithm)
    blocks: list[bytes] = []
    for source in sources:
        entry = (
            BlockDigester(block_size, strong if source.wants_digest else None)
            if block_size and source.wants_blocks
            else None
        )
        for view in _source_views(source, piece_bytes):
            digester.update(view)
            if entry is not None:
                entry.update(view)
        blocks.append(entry.digest() if entry is not None else b"")
    digest, fast_digest = digester.digests()
    return FileDigests(digest, fast_digest, blocks)


def _source_views(source: TensorSource, piece_bytes: int) -> Iterator[memoryview]:
    """A source's bytes in views of at most :data:`_HASH_SLICE` (or ``piece_bytes``) bytes."""
    address = source.address
    if address is not None:
        if source.nbytes:
            view = memoryview((ctypes.c_ubyte * source.nbytes).from_address(address)).cast("B")
            for start in range(0, len(view), _HASH_SLICE):
                yield view[start : start + _HASH_SLICE]
    else:
        for piece in source.pieces(piece_bytes):
            yield piece
            del piece


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


class _EntryDigests:
    """The digests of a file's entries that carry one of their own (the chunks of sharded
    tensors), computed from pieces of the file fed in order of offset, so that a whole-file check
    also proves each chunk digest a partial read would later trust. With ``blocks``, the block
    digests of the entries that have them are checked too (both halves), as ``verify`` does."""

    def __init__(self, record: FileRecord, *, blocks: bool = False) -> None:
        self._record = record
        self._waiting = sorted(
            (entry.offset, entry.offset + entry.nbytes, index)
            for index, entry in enumerate(record.tensors)
            if entry.digest or (blocks and entry.blocks and record.block_size > 0)
        )
        self._next = 0
        self._open: list[tuple[int, int, int]] = []
        self._digesters: dict[int, Digester | BlockDigester] = {}
        for _, _, index in self._waiting:
            entry = record.tensors[index]
            if entry.digest:
                self._digesters[index] = new_digester(entry.digest.partition(":")[0])
            else:
                self._digesters[index] = BlockDigester(record.block_size, _blocks_strong(record, entry))

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
        return _EntryDigests(FileRecord(path=record.path, rank=record.rank, size=record.size, digest=None))
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
    if entry.digest:
        return True
    if not entry.blocks or record.block_size <= 0 or not record.digest:
        return False
    return _blocks_strong(record, entry) is not None or record.digest.partition(":")[0] == FAST_DIGEST


def _blocks_strong(record: FileRecord, entry: TensorEntry) -> str | None:
    """The strong algorithm of ``entry``'s blocks (the file digest's), or ``None`` when they are
    fast-only."""
    count = -(-entry.nbytes // record.block_size) if record.block_size > 0 else 0
    if record.digest and count and len(entry.blocks) == count * (FAST_BLOCK_DIGEST_BYTES + STRONG_BLOCK_DIGEST_BYTES):
        return record.digest.partition(":")[0]
    return None


def _fast_halves(blocks: bytes, record: FileRecord, entry: TensorEntry) -> bytes:
    """The xxh3-128 half of each block digest of ``entry`` (all of them when fast-only)."""
    if _blocks_strong(record, entry) is None:
        return blocks
    width = FAST_BLOCK_DIGEST_BYTES + STRONG_BLOCK_DIGEST_BYTES
    return b"".join(blocks[start : start + FAST_BLOCK_DIGEST_BYTES] for start in range(0, len(blocks), width))


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
                    _fast_halves(entry.blocks, record, entry), block_digests(view, record.block_size, None)
                )
            else:
                intact = hmac.compare_digest(
                    entry.blocks, block_digests(view, record.block_size, _blocks_strong(record, entry))
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
