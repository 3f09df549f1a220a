"""Moving checkpoint files between ranks over the job's own process group, in bounded blocks,
each file checked against its manifest record on arrival and written atomically.

:func:`exchange_files` is a collective: every rank of ``group`` calls it, each with the files it
sends (to whom, from where, and the file's :class:`~shardkeep.manifest.FileRecord`) and the files
it receives (from whom, to where, and the record). A rank that neither sends nor receives still
calls it.

What crosses the wire, per ordered pair of ranks that has traffic, as raw ``int64`` and
``uint8`` tensors (never pickle): the number of files; then per file a header (the length of
its path and its stored size), the path's UTF-8 bytes, the file's bytes in blocks of at most
``block_bytes``, and a trailer saying whether the sender read the whole file. The stream
describes itself, so a receiver consumes exactly what its sender sends even when the two
disagree on the list of files (a file nobody asked for is read and dropped; a file asked for
and not sent is reported).

Order: after one all-gather of who sends to whom, the pairs run in rounds ``d = 1 .. W-1``;
in round ``d`` rank ``r`` sends to ``r + d`` and receives from ``r - d`` (mod ``W``): one
message out at a time, and up to two receives posted (the next block of a file's data is
posted before the current one is awaited; a header, a path or a trailer is posted alone, as
what follows it is known only once it arrives). Every receive a rank can post is posted before
it waits, and each rank's incoming stream in a round is exactly its sender's outgoing stream,
so every posted send meets its receive and no cycle of waits can form. Every wait draws on the
group's timeout: a dead peer is an error, never a hang. Memory per rank: four blocks (one sent;
three received into in turn: two posted, the bytes of one written and digested on a thread).

On arrival a file is written to a temporary sibling (``.NAME.tmp-<id>``), its digest computed
while it streams in (over the decompressed bytes for a compressed file, as the manifest
records it) and compared with the record's (its fast digest, xxh3-128, when the caller asks for
``fast`` and the record has one: see docs/trust.md); only a file whose size and digest match is
fsynced and renamed onto its destination (the directory fsynced). A mismatch leaves the
destination as it was; :func:`exchange_files` raises
:class:`~shardkeep.errors.IntegrityError` naming the file, the source rank and the destination
rank once the whole exchange is over, so that no peer is left waiting. A peer that dies or
times out is a :class:`~shardkeep.errors.CoordinationError`. Sends to oneself are
copies through the same checks.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from shardkeep.errors import CoordinationError, IntegrityError, ShardkeepError, StorageError
from shardkeep.integrity import Digester, digests_equal, format_digest, new_digester
from shardkeep.manifest import FileRecord
from shardkeep.names import STAGING_MARKER, sibling_name
from shardkeep.storage import ByteStore
from shardkeep.storage.localfs import current as local_fs

__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "WIRE_BLOCK_BYTES",
    "Exchange",
    "FileReceive",
    "FileSend",
    "arrival_digest",
    "copy_file",
    "exchange_files",
    "run_exchange",
]

#: Bytes per read and write of a copy from a store (:func:`copy_file`) unless the caller says
#: otherwise.
DEFAULT_BLOCK_BYTES = 8 << 20
#: Bytes per block on the wire (:func:`run_exchange`) unless the caller says otherwise: small
#: enough that a block is still in the CPU's cache when the receiver writes and digests it
#: (``bench/transfer_blocks.py``: 8 MiB blocks take 1.20x the time of 2 MiB blocks with blake3
#: on arrival, 1.04x with xxh3-128; docs/performance.md).
WIRE_BLOCK_BYTES = 2 << 20

#: Receives of a file's blocks posted ahead of the one being waited for.
_RECEIVES_AHEAD = 2

_OK = 0
_UNREADABLE = 1

#: Where a sent file's bytes come from: a local path, or a path inside a byte store.
Source = str | os.PathLike[str] | tuple[ByteStore, str]


class FileSend(NamedTuple):
    """One file this rank sends: to rank ``peer`` (of the group), read from ``source``."""

    peer: int
    source: Source
    record: FileRecord


class FileReceive(NamedTuple):
    """One file this rank receives from rank ``peer`` (of the group), written to
    ``destination`` (a local path) once its size and digest match ``record``."""

    peer: int
    destination: str | os.PathLike[str]
    record: FileRecord


@dataclass
class Exchange:
    """What one rank's part of an exchange did: the destinations written, and each file
    refused (``(path, source rank, reason)``: digest or size mismatch, unreadable at the source,
    not sent) or that could not be written (``failed``)."""

    rank: int
    written: list[str] = field(default_factory=list)
    refused: list[tuple[str, int, str]] = field(default_factory=list)
    failed: list[tuple[str, int, str]] = field(default_factory=list)

    def problems(self) -> list[str]:
        return [
            f"{path}: from rank {source} to rank {self.rank}: {reason}"
            for path, source, reason in [*self.refused, *self.failed]
        ]

    def raise_for_problems(self) -> None:
        """:class:`IntegrityError` when a file was refused, :class:`StorageError` when one could
        not be written; each names the file, the source rank and this (destination) rank."""
        problems = self.problems()
        if self.refused:
            raise IntegrityError(f"rank {self.rank} refused received files: " + "; ".join(problems), problems)
        if self.failed:
            raise StorageError(f"rank {self.rank} could not write received files: " + "; ".join(problems))


def exchange_files(
    group: Any,
    sends: Sequence[FileSend | tuple[int, Source, FileRecord]],
    receives: Sequence[FileReceive | tuple[int, str | os.PathLike[str], FileRecord]],
    block_bytes: int = WIRE_BLOCK_BYTES,
    *,
    fast: bool = False,
) -> list[str]:
    """Send and receive files between the ranks of ``group`` (a ``torch.distributed`` process
    group; ``None``: the default group). Collective. Returns the destinations written; raises as
    :meth:`Exchange.raise_for_problems` says once every rank's traffic is over. ``fast``: check
    each file with its record's fast digest where it has one (:func:`arrival_digest`)."""
    exchange = run_exchange(group, sends, receives, block_bytes=block_bytes, fast=fast)
    exchange.raise_for_problems()
    return exchange.written


def copy_file(
    source: Source,
    destination: str | os.PathLike[str],
    record: FileRecord,
    *,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    fast: bool = False,
) -> None:
    """Copy one file on this rank (no collective) through the checks of an exchange: streamed in
    blocks, size and digest compared with ``record`` (its fast digest with ``fast``, where it
    has one), written atomically; raises as :meth:`Exchange.raise_for_problems` says (the
    destination untouched)."""
    exchange = Exchange(0)
    itself = _Receiver(0, [FileReceive(0, destination, record)], exchange, block_bytes, fast=fast)
    itself.copy_local(FileSend(0, source, record))
    itself.finish_missing(itself.sent)
    where = f"{source[0].root}/{source[1]}" if isinstance(source, tuple) else os.fspath(source)
    problems = [f"{path}: copied from {where}: {reason}" for path, _, reason in [*exchange.refused, *exchange.failed]]
    if exchange.refused:
        raise IntegrityError("; ".join(problems), problems)
    if exchange.failed:
        raise StorageError("; ".join(problems))


def run_exchange(
    group: Any,
    sends: Sequence[FileSend | tuple[int, Source, FileRecord]],
    receives: Sequence[FileReceive | tuple[int, str | os.PathLike[str], FileRecord]],
    *,
    block_bytes: int = WIRE_BLOCK_BYTES,
    pairs: Sequence[tuple[int, int]] | None = None,
    fast: bool = False,
) -> Exchange:
    """:func:`exchange_files` without raising: every rank's outcome as an :class:`Exchange`.

    ``pairs``: the ``(sender, receiver)`` ranks that have traffic, when every rank knows the
    same plan (then the all-gather of who sends to whom is skipped). A rank named as a sender
    sends its stream to that receiver even with no file in it; a send outside the plan is an
    error. ``fast``: check each arriving file with its record's fast digest where it has one
    (:func:`arrival_digest`)."""
    import torch.distributed as dist

    if block_bytes <= 0:
        raise ShardkeepError(f"block_bytes={block_bytes!r} must be positive")
    outgoing = [FileSend(*send) for send in sends]
    incoming = [FileReceive(*receive) for receive in receives]
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    exchange = Exchange(rank)
    for send in outgoing + incoming:
        if not 0 <= send.peer < world:
            raise ShardkeepError(f"rank {send.peer} is not a rank of the group (world size {world})")
    # Sends to oneself: copies through the same checks, no traffic.
    itself = _Receiver(rank, [r for r in incoming if r.peer == rank], exchange, block_bytes, fast=fast)
    for send in outgoing:
        if send.peer == rank:
            itself.copy_local(send)
    itself.finish_missing(itself.sent)
    if world == 1:
        return exchange
    rows = _traffic(group, rank, world, outgoing, pairs)
    senders_of_mine = {peer for peer in range(world) if peer != rank and rows[peer][rank]}
    for distance in range(1, world):
        to_peer, from_peer = (rank + distance) % world, (rank - distance) % world
        to_send = [s for s in outgoing if s.peer == to_peer] if rows[rank][to_peer] else []
        expected = [r for r in incoming if r.peer == from_peer]
        messages = _outgoing_messages(to_send, block_bytes) if rows[rank][to_peer] else iter(())
        stream = (
            _Receiver(from_peer, expected, exchange, block_bytes, fast=fast) if from_peer in senders_of_mine else None
        )
        try:
            _run_round(group, to_peer, from_peer, messages, stream)
        finally:
            if stream is not None:
                stream.close()
        if stream is None:
            _Receiver(from_peer, expected, exchange, block_bytes, fast=fast).finish_missing(sent=set())
    return exchange


def _traffic(
    group: Any, rank: int, world: int, outgoing: list[FileSend], pairs: Sequence[tuple[int, int]] | None
) -> list[list[int]]:
    """``rows[sender][receiver]``: whether that pair has traffic, from ``pairs`` or gathered."""
    import torch
    import torch.distributed as dist

    if pairs is not None:
        rows = [[0] * world for _ in range(world)]
        for sender, receiver in pairs:
            if sender != receiver:
                rows[sender][receiver] = 1
        for send in outgoing:
            if send.peer != rank and not rows[rank][send.peer]:
                raise ShardkeepError(f"rank {rank} sends to rank {send.peer}, which the exchange's plan leaves out")
        return rows
    row = torch.zeros(world, dtype=torch.uint8)
    for send in outgoing:
        if send.peer != rank:
            row[send.peer] = 1
    gathered = [torch.zeros(world, dtype=torch.uint8) for _ in range(world)]
    try:
        dist.all_gather(gathered, row, group=group)
    except RuntimeError as exc:
        raise CoordinationError(f"gathering who sends files to whom failed: {exc}", {}) from exc
    return [[int(flag) for flag in each.tolist()] for each in gathered]


def _run_round(group: Any, to_peer: int, from_peer: int, messages: Iterator[Any], stream: _Receiver | None) -> None:
    """One round: this rank's messages to ``to_peer``, one at a time, and ``stream``'s from
    ``from_peer``, with up to :data:`_RECEIVES_AHEAD` receives of a file's blocks posted ahead.
    Every receive a rank can post is posted before it waits on anything, so each posted send
    meets its receive."""
    import torch.distributed as dist

    posted: deque[tuple[Any, Any]] = deque()
    while True:
        outgoing = next(messages, None)
        arrived = None
        try:
            while stream is not None and len(posted) < _RECEIVES_AHEAD:
                buffer = stream.next_buffer(ahead=bool(posted))
                if buffer is None:
                    break
                posted.append((buffer, dist.irecv(buffer, group=group, group_src=from_peer)))
            if outgoing is None and not posted:
                return
            if outgoing is not None:
                work = dist.isend(outgoing, group=group, group_dst=to_peer)
                if work is not None:
                    work.wait()
            if posted:
                arrived, work = posted.popleft()
                if work is not None:
                    work.wait()
        except RuntimeError as exc:  # gloo reports a dead peer and a timeout so
            raise CoordinationError(
                f"exchanging files with ranks {to_peer} (to) and {from_peer} (from) failed: {exc}", {}
            ) from exc
        if arrived is not None and stream is not None:
            stream.deliver(arrived)


def _outgoing_messages(sends: list[FileSend], block_bytes: int) -> Iterator[Any]:
    """The messages of one sender's stream to one peer, in order (see the module docstring)."""
    import torch

    sends = sorted(sends, key=lambda send: send.record.path)
    yield torch.tensor([len(sends)], dtype=torch.int64)
    for send in sends:
        path = send.record.path.encode()
        handle: _Reader | None
        try:
            handle = _Reader.open(send.source)
        except (OSError, ShardkeepError):
            handle = None
        size = handle.size if handle is not None else 0
        yield torch.tensor([len(path), size], dtype=torch.int64)
        yield torch.frombuffer(bytearray(path), dtype=torch.uint8)
        status = _OK if handle is not None else _UNREADABLE
        offset = 0
        block = bytearray(min(block_bytes, size))
        while offset < size:
            length = min(block_bytes, size - offset)
            view = memoryview(block)[:length]
            if status == _OK:
                assert handle is not None
                try:
                    handle.read_into(offset, view)
                except (OSError, ShardkeepError):
                    status = _UNREADABLE
            if status != _OK:
                view[:] = bytes(length)  # the promised bytes still go out; the trailer says why
            yield torch.frombuffer(block, dtype=torch.uint8)[:length]
            offset += length
        if handle is not None:
            handle.close()
        yield torch.tensor([status], dtype=torch.int64)


class _Reader:
    """A sent file's bytes: a local file or a store's read handle."""

    def __init__(self, size: int, read_into: Any, close: Any) -> None:
        self.size = size
        self.read_into = read_into
        self.close = close

    @classmethod
    def open(cls, source: Source) -> _Reader:
        if isinstance(source, tuple):
            store, path = source
            handle = store.open_read(path)
            return cls(handle.size, handle.read_into, handle.close)
        file = open(os.fspath(source), "rb")  # noqa: SIM115  # closed by the stream when sent
        size = os.fstat(file.fileno()).st_size

        def read_into(offset: int, view: memoryview) -> None:
            got = os.preadv(file.fileno(), [view], offset)
            if got != len(view):
                raise OSError(f"{source}: short read ({got} of {len(view)} bytes at {offset})")

        return cls(size, read_into, file.close)


class _Incoming:
    """One file arriving: its temporary sibling, digest and byte counts."""

    def __init__(self, path: str, size: int, expected: FileReceive | None, fast: bool) -> None:
        self.path = path
        self.size = size
        self.expected = expected
        self.received = 0
        self.problem: str | None = None
        self.temporary: str | None = None
        self.fd: int | None = None
        self.digester: Digester | None = None
        self.inflated: Any = None
        self.inflated_bytes = 0
        self.digest: str | None = None
        if expected is None:
            self.problem = "not asked for"
            return
        record = expected.record
        self.digest = arrival_digest(record, fast)
        if size != record.stored_size:
            self.problem = f"size is {size} bytes, manifest says {record.stored_size}"
        elif not self.digest:
            self.problem = "has no digest, so it cannot be verified"
        else:
            self.digester = new_digester(self.digest.partition(":")[0])
            if record.compression is not None:
                self.inflated = _inflater(self)

    def open(self) -> None:
        """Create the temporary sibling of the destination (making its directory)."""
        assert self.expected is not None
        destination = os.path.abspath(os.fspath(self.expected.destination))
        directory, name = os.path.split(destination)
        fs = local_fs()
        fs.makedirs_durable(directory)
        self.temporary = os.path.join(directory, sibling_name(name, STAGING_MARKER, uuid.uuid4().hex[:12], lead="."))
        self.fd = os.open(self.temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)

    def take(self, data: memoryview) -> None:
        self.received += len(data)
        if self.problem is not None:
            return
        if self.fd is None:
            self.open()
        assert self.fd is not None
        written = 0
        while written < len(data):
            written += os.write(self.fd, data[written:])
        if self.inflated is not None:
            self.inflated.write(data)
        else:
            assert self.digester is not None
            self.digester.update(data)

    def finish(self, status: int) -> None:
        """Check and rename onto the destination, or remove the temporary file."""
        try:
            if status != _OK and self.expected is not None:
                self.problem = "the source rank could not read it"
            if self.problem is None:
                self._check()
            if self.problem is None:
                if self.fd is None:
                    self.open()  # an empty file
                assert self.fd is not None and self.temporary is not None and self.expected is not None
                os.fsync(self.fd)
                os.close(self.fd)
                self.fd = None
                fs = local_fs()
                destination = os.path.abspath(os.fspath(self.expected.destination))
                fs.replace(self.temporary, destination)
                fs.fsync_directory(os.path.dirname(destination))
                self.temporary = None
        finally:
            if self.fd is not None:
                os.close(self.fd)
            if self.temporary is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.temporary)

    def _check(self) -> None:
        assert self.expected is not None and self.digester is not None
        record = self.expected.record
        assert self.digest is not None
        if self.inflated is not None:
            try:
                self.inflated.flush()
            except Exception as exc:  # zstandard.ZstdError and what the codec raises
                self.problem = f"cannot be decompressed ({exc})"
                return
            if self.inflated_bytes != record.size:
                self.problem = f"decompresses to {self.inflated_bytes} bytes, manifest says {record.size}"
                return
        actual = format_digest(self.digest.partition(":")[0], self.digester.hexdigest())
        if not digests_equal(self.digest, actual):
            self.problem = "digest mismatch on arrival"


def arrival_digest(record: FileRecord, fast: bool) -> str | None:
    """The digest a file arriving for ``record`` is checked against: its fast digest
    (xxh3-128, of the same bytes) with ``fast`` when the record has one, else its digest."""
    if fast and record.fast_digest:
        return record.fast_digest
    return record.digest


def _inflater(incoming: _Incoming) -> Any:
    """A zstd stream writer that digests the decompressed bytes of ``incoming`` as they come,
    in bounded pieces, refusing output beyond the manifest's size."""
    import zstandard

    expected = incoming.expected
    assert expected is not None
    limit = expected.record.size

    class _DigestSink:
        def write(self, data: bytes) -> int:
            incoming.inflated_bytes += len(data)
            if incoming.inflated_bytes <= limit:
                assert incoming.digester is not None
                incoming.digester.update(data)
            return len(data)

    # The sink has the one method a stream writer calls: write.
    return zstandard.ZstdDecompressor().stream_writer(_DigestSink(), write_size=1 << 20)  # type: ignore[arg-type]


class _Receiver:
    """The incoming stream from one peer: which buffer to receive next, and what to do with
    it (see the module docstring for the order of messages)."""

    def __init__(
        self, peer: int, expected: list[FileReceive], exchange: Exchange, block_bytes: int, *, fast: bool = False
    ) -> None:
        self.peer = peer
        self.fast = fast
        self.expected = {receive.record.path: receive for receive in expected}
        self.exchange = exchange
        self.block_bytes = block_bytes
        self.remaining_files: int | None = None
        self.state = "count"
        self.path_length = 0
        self.pending_size = 0
        self.current: _Incoming | None = None
        self.sent: set[str] = set()
        #: Bytes of the current file received from the wire (written and digested behind).
        self.arrived = 0
        #: Bytes of the current file whose receive is posted (ahead of those arrived).
        self.posted = 0
        #: The blocks received into in turn (:data:`_RECEIVES_AHEAD` posted, one more being
        #: written and digested), each with the write of its bytes in flight.
        self.blocks: list[Any] = [None] * (_RECEIVES_AHEAD + 1)
        self.writes: list[Future[None] | None] = [None] * (_RECEIVES_AHEAD + 1)
        self.turn = 0
        #: The turns of the blocks posted and not yet delivered, oldest first.
        self.receiving: deque[int] = deque()
        self.writer: ThreadPoolExecutor | None = None

    def next_buffer(self, *, ahead: bool = False) -> Any:
        """The buffer the next message from the peer is received into (``None``: the stream
        ended). With ``ahead`` (a receive is posted already and not yet delivered): the next
        block of the current file's data, or ``None`` when the message after the posted ones
        cannot be known yet."""
        import torch

        if ahead:
            if self.state != "data" or self.current is None or self.posted >= self.current.size:
                return None
        elif self.state == "count":
            return torch.zeros(1, dtype=torch.int64)
        if self.state == "header":
            return torch.zeros(2, dtype=torch.int64)
        if self.state == "path":
            return torch.zeros(self.path_length, dtype=torch.uint8)
        if self.state == "data":
            assert self.current is not None
            length = min(self.block_bytes, self.current.size - self.posted)
            turn = self.turn
            write = self.writes[turn]
            if write is not None:
                write.result()  # this block's previous bytes are written: it may be received into
                self.writes[turn] = None
            block = self.blocks[turn]
            if block is None or len(block) < length:
                block = self.blocks[turn] = torch.empty(
                    min(self.block_bytes, max(length, self.current.size)), dtype=torch.uint8
                )
            self.posted += length
            self.turn = (turn + 1) % len(self.blocks)
            self.receiving.append(turn)
            return block[:length]
        if self.state == "trailer":
            return torch.zeros(1, dtype=torch.int64)
        return None

    def deliver(self, buffer: Any) -> None:
        if self.state == "count":
            self.remaining_files = int(buffer[0])
            self._next_file()
        elif self.state == "header":
            self.path_length, self.pending_size = int(buffer[0]), int(buffer[1])
            self.state = "path"
        elif self.state == "path":
            path = bytes(buffer.numpy()).decode(errors="replace")
            self.sent.add(path)
            self.current = _Incoming(path, self.pending_size, self.expected.get(path), self.fast)
            self.arrived = self.posted = 0
            self.state = "data" if self.pending_size else "trailer"
        elif self.state == "data":
            assert self.current is not None
            self.arrived += len(buffer)
            # Written and digested on the stream's writer thread, in order, while the next block
            # comes in (into the other block).
            if self.writer is None:
                self.writer = ThreadPoolExecutor(1, thread_name_prefix="shardkeep-receive")
            data = memoryview(buffer.numpy()).cast("B")
            turn = self.receiving.popleft()
            self.writes[turn] = self.writer.submit(self._take, data)
            if self.arrived >= self.current.size:
                self.state = "trailer"
        elif self.state == "trailer":
            self.settle()
            self._finish(int(buffer[0]))
            self._next_file()

    def settle(self) -> None:
        """Wait for the writes in flight (a write's own failure is recorded by :meth:`_take`)."""
        for turn, write in enumerate(self.writes):
            if write is not None:
                write.result()
                self.writes[turn] = None

    def close(self) -> None:
        """Settle the writes in flight and stop the writer thread."""
        try:
            self.settle()
        finally:
            if self.writer is not None:
                self.writer.shutdown(wait=True)
                self.writer = None

    def _next_file(self) -> None:
        assert self.remaining_files is not None
        if self.remaining_files == 0:
            self.state = "done"
            self.close()
            self.finish_missing(self.sent)
        else:
            self.remaining_files -= 1
            self.state = "header"

    def _take(self, data: memoryview) -> None:
        assert self.current is not None
        try:
            self.current.take(data)
        except Exception as exc:  # a write, or a compressed stream that does not decode (zstd)
            self._fail(f"writing failed: {type(exc).__name__}: {exc}")

    def _fail(self, reason: str) -> None:
        current = self.current
        assert current is not None
        if current.problem is None:
            self.exchange.failed.append((current.path, self.peer, reason))
            current.problem = reason
            current.expected = None  # written nowhere; still consumed from the wire

    def _finish(self, status: int) -> None:
        current = self.current
        assert current is not None
        failed_before = current.expected is None and current.problem is not None
        try:
            current.finish(status)
        except Exception as exc:  # a write, or a compressed stream that does not decode (zstd)
            self._fail(f"writing failed: {type(exc).__name__}: {exc}")
            return
        if current.problem is None:
            assert current.expected is not None
            self.exchange.written.append(os.fspath(current.expected.destination))
        elif not failed_before and current.path in self.expected:
            self.exchange.refused.append((current.path, self.peer, current.problem))

    def copy_local(self, send: FileSend) -> None:
        """A send to this rank itself: read ``send.source`` through the same checks."""
        path = send.record.path
        self.sent.add(path)
        try:
            reader = _Reader.open(send.source)
        except (OSError, ShardkeepError):
            self.current = _Incoming(path, 0, self.expected.get(path), self.fast)
            self._finish(_UNREADABLE)
            return
        self.current = _Incoming(path, reader.size, self.expected.get(path), self.fast)
        status, offset = _OK, 0
        block = memoryview(bytearray(min(self.block_bytes, reader.size)))
        try:
            while offset < reader.size:
                view = block[: min(self.block_bytes, reader.size - offset)]
                reader.read_into(offset, view)
                self._take(view)
                offset += len(view)
        except (OSError, ShardkeepError):
            status = _UNREADABLE
        finally:
            reader.close()
        self._finish(status)

    def finish_missing(self, sent: set[str]) -> None:
        """Report every file expected from this peer that it did not send."""
        for path in sorted(set(self.expected) - sent):
            self.exchange.refused.append((path, self.peer, "the source rank did not send it"))
