"""Bounded parallel writes of data files, each digested from the buffers being written.

One concurrency model: a bounded thread pool writes whole files, and a :class:`ByteBudget`
bounds the bytes held in copies and buffers across all threads. Each file's digests (the
strong one, the fast one, and the block digests of the tensors that want them) are computed
from the same buffers that are written, on other threads, so hashing overlaps with the write
and the data is never read twice. :func:`digest_of` computes the same digests without writing.
Reading files back and checking them is :mod:`shardkeep.io`.

This module does not import torch: tensors reach it as :class:`TensorSource` objects.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import zstandard

from shardkeep.errors import IntegrityError, StorageError, UnsupportedValueError
from shardkeep.integrity import BlockDigester, Digester, DualDigester, format_digest, new_digester
from shardkeep.manifest import FAST_DIGEST, Compression, FileRecord
from shardkeep.progress import collector_paused
from shardkeep.storage.base import ByteStore, WriteHandle
from shardkeep.tensors.shardfile import built_header_agrees, check_header, parse_built_header

__all__ = [
    "ABANDONED",
    "ByteBudget",
    "FileDigests",
    "SMALL_TENSOR_BYTES",
    "ShardPlan",
    "TensorSource",
    "WriteControl",
    "digest_of",
    "stop_writes_on",
    "write_shards",
]

MiB = 1 << 20
#: Tensors up to this size are copied into a shared buffer and written together.
SMALL_TENSOR_BYTES = 256 * 1024
#: :func:`digest_of` hashes a tensor in host memory this many bytes at a time.
_HASH_SLICE = 16 * MiB
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
