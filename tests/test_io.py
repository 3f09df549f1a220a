"""Unit tests of ``io``: every copy strategy of ``write_shards`` (small tensors coalesced into a
buffer, large host tensors written in place, tensors copied in pieces, compression), with the
digests computed while writing, the byte budget, and the cleanup on failure; and every reading
of ``check_shard`` (whole file mapped, copied or streamed, only the needed entries)."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zstandard

from shardkeep import WriteOptions
from shardkeep.errors import StorageError
from shardkeep.integrity import digest_bytes
from shardkeep.io import _digest_view, check_shard
from shardkeep.manifest import FileRecord, TensorEntry
from shardkeep.storage.memory import MemoryStore
from shardkeep.tensors.shardfile import build_header
from shardkeep.writes import SMALL_TENSOR_BYTES, ByteBudget, ShardPlan, write_shards

MiB = 1 << 20


class _Source:
    """Bytes standing in for a tensor: in host memory (with an address), or only as pieces (a
    tensor on a device, or not contiguous). ``fail_after`` pieces, the next one raises."""

    def __init__(self, data: bytes, *, in_host: bool, wants_digest: bool = False, fail_after: int = -1) -> None:
        self.data = data
        self._buffer = bytearray(data or b"\0")  # kept alive: the writer reads its address
        self.nbytes = len(data)
        self.wants_digest = wants_digest
        self.wants_blocks = False
        self._in_host = in_host
        self._fail_after = fail_after

    @property
    def address(self) -> int | None:
        if not self._in_host:
            return None
        return ctypes.addressof(ctypes.c_char.from_buffer(self._buffer))

    def pieces(self, max_bytes: int) -> Iterator[memoryview]:
        for count, start in enumerate(range(0, self.nbytes, max_bytes)):
            if count == self._fail_after:
                raise RuntimeError("the device went away")
            yield memoryview(self.data)[start : start + max_bytes]


class _RecordingStore(MemoryStore):
    """A memory store that records which files were committed and which aborted."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, str]] = []

    def open_write(self, path: str):  # type: ignore[no-untyped-def]  # returns the base class's private handle type
        handle = super().open_write(path)
        commit, abort = handle.commit, handle.abort

        def on_commit() -> None:
            self.events.append(("commit", path))
            commit()

        def on_abort() -> None:
            self.events.append(("abort", path))
            abort()

        handle.commit, handle.abort = on_commit, on_abort  # type: ignore[method-assign]  # instance hooks
        return handle


def _plan(path: str, sources: list[_Source]) -> ShardPlan:
    spans = []
    position = 0
    for index, source in enumerate(sources):
        spans.append((f"t{index}", "U8", [source.nbytes], position, position + source.nbytes))
        position += source.nbytes
    header = build_header(spans, 1)
    record = FileRecord(path=path, rank=0, size=len(header) + position, digest=None)
    record.tensors = [
        TensorEntry(key=key, path=[key], dtype=dtype, shape=shape, offset=len(header) + begin, nbytes=end - begin)
        for key, dtype, shape, begin, end in spans
    ]
    return ShardPlan(path=path, header=header, sources=sources, record=record)


def _pattern(nbytes: int, seed: int) -> bytes:
    return bytes((seed * 31 + index * 7) % 251 for index in range(nbytes))


def _mixed_sources() -> list[_Source]:
    """Every copy strategy, with switches between them in both directions."""
    return [
        _Source(_pattern(100, 1), in_host=True, wants_digest=True),  # small: coalesced
        _Source(_pattern(3000, 2), in_host=True),
        *(_Source(_pattern(200 * 1024, 10 + n), in_host=True, wants_digest=n == 1) for n in range(4)),  # overflow
        _Source(_pattern(SMALL_TENSOR_BYTES + 1, 3), in_host=True, wants_digest=True),  # large: in place
        _Source(_pattern(MiB + MiB // 2 + 5, 4), in_host=False, wants_digest=True),  # pieces
        _Source(_pattern(10, 5), in_host=True),
        _Source(b"", in_host=True, wants_digest=True),
        _Source(b"", in_host=False),
        _Source(_pattern(70_000, 6), in_host=False),
        _Source(_pattern(17, 7), in_host=True, wants_digest=True),  # small, last: flushed at the end
    ]


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
def test_every_copy_strategy_writes_the_bytes_and_their_digests(algorithm: str) -> None:
    store = _RecordingStore()
    sources = _mixed_sources()
    plan = _plan("shards/a.safetensors", sources)
    budget = ByteBudget(1 * MiB)
    counted: list[int] = []

    (record,) = write_shards(store, [plan], algorithm=algorithm, budget=budget, io_threads=1, on_bytes=counted.append)

    expected = plan.header + b"".join(source.data for source in sources)
    assert bytes(store.open_read(plan.path).map()) == expected
    assert record.digest == digest_bytes(algorithm, expected)
    for source, entry in zip(sources, record.tensors, strict=True):
        assert entry.digest == (digest_bytes(algorithm, source.data) if source.wants_digest else None)
    assert counted == [source.nbytes for source in sources]
    assert store.events == [("commit", plan.path)]
    assert budget.held == 0
    assert 0 < budget.peak <= budget.limit
    assert check_shard(store, plan.path, record, verify=True, keep=False)[1] == []


def test_parallel_writers_share_the_budget() -> None:
    store = _RecordingStore()
    plans = [_plan(f"shards/{n}.safetensors", _mixed_sources()) for n in range(4)]
    budget = ByteBudget(512 * 1024)

    records = write_shards(store, plans, algorithm="blake3", budget=budget, io_threads=4)

    assert [record.path for record in records] == [plan.path for plan in plans]
    assert budget.held == 0
    assert budget.peak <= budget.limit
    assert sorted(store.events) == sorted(("commit", plan.path) for plan in plans)
    for record in records:
        assert check_shard(store, record.path, record, verify=True, keep=False)[1] == []


def test_compressed_file_holds_the_same_bytes_and_the_uncompressed_digest() -> None:
    store = _RecordingStore()
    sources = _mixed_sources()
    plan = _plan("shards/z.safetensors", sources)

    (record,) = write_shards(
        store, [plan], algorithm="blake3", budget=ByteBudget(MiB), io_threads=1, compression_level=3
    )

    stored = bytes(store.open_read(plan.path).map())
    expected = plan.header + b"".join(source.data for source in sources)
    assert zstandard.ZstdDecompressor().decompress(stored) == expected
    assert record.digest == digest_bytes("blake3", expected)
    assert record.compression is not None
    assert (record.compression.codec, record.compression.level) == ("zstd", 3)
    assert record.compression.stored_size == len(stored)
    data, problems = check_shard(store, plan.path, record, verify=True, keep=True)
    assert problems == []
    assert data is not None and bytes(data) == expected


def test_a_failing_source_aborts_its_file_and_returns_the_budget() -> None:
    store = _RecordingStore()
    failing = _Source(_pattern(3 * MiB, 8), in_host=False, fail_after=1)
    plan = _plan("shards/bad.safetensors", [_Source(_pattern(64, 9), in_host=True), failing])
    budget = ByteBudget(MiB)

    with pytest.raises(RuntimeError, match="the device went away"):
        write_shards(store, [plan], algorithm="blake3", budget=budget, io_threads=1)

    assert store.events == [("abort", plan.path)]
    assert budget.held == 0
    assert plan.record.digest is None


def test_a_tensor_that_changed_size_is_refused_and_aborted() -> None:
    store = _RecordingStore()
    plan = _plan("shards/grew.safetensors", [_Source(_pattern(64, 1), in_host=True)])
    plan.record.size += 1

    with pytest.raises(StorageError, match=r"wrote \d+ bytes but planned"):
        write_shards(store, [plan], algorithm="blake3", budget=ByteBudget(MiB), io_threads=1)

    assert store.events == [("abort", plan.path)]


@pytest.fixture
def written() -> tuple[MemoryStore, FileRecord, bytes]:
    store = _RecordingStore()
    sources = _mixed_sources()
    plan = _plan("shards/r.safetensors", sources)
    (record,) = write_shards(store, [plan], algorithm="blake3", budget=ByteBudget(MiB), io_threads=1)
    return store, record, plan.header + b"".join(source.data for source in sources)


@pytest.mark.parametrize(
    ("keep", "use_mmap", "needed"),
    [(False, True, None), (True, True, None), (True, False, None), (True, True, [0, 7]), (True, False, [0, 7])],
)
def test_every_reading_returns_the_bytes_it_checked(
    written: tuple[MemoryStore, FileRecord, bytes], keep: bool, use_mmap: bool, needed: list[int] | None
) -> None:
    store, record, expected = written
    counted: list[int] = []

    data, problems = check_shard(
        store, record.path, record, verify=True, keep=keep, use_mmap=use_mmap, needed=needed, on_bytes=counted.append
    )

    assert problems == []
    if not keep:
        assert data is None
        assert sum(counted) == len(expected)
    elif needed is None:
        assert data is not None and bytes(data) == expected
        assert sum(counted) == len(expected)
    else:
        assert data is not None
        for index in needed:
            entry = record.tensors[index]
            assert (
                bytes(data[entry.offset : entry.offset + entry.nbytes])
                == expected[entry.offset : entry.offset + entry.nbytes]
            )
        assert sum(counted) == sum(record.tensors[index].nbytes for index in needed)


@pytest.mark.parametrize(("keep", "needed"), [(False, None), (True, None), (True, [0, 7])])
def test_every_reading_finds_a_flipped_byte(
    written: tuple[MemoryStore, FileRecord, bytes], keep: bool, needed: list[int] | None
) -> None:
    _, record, expected = written
    damaged = MemoryStore()
    entry = record.tensors[7]
    flipped = bytearray(expected)
    flipped[entry.offset + 5] ^= 0x10
    handle = damaged.open_write(record.path)
    handle.write(bytes(flipped))
    handle.commit()

    _, problems = check_shard(damaged, record.path, record, verify=True, keep=keep, needed=needed)

    chunk_problem = f"{record.path}: tensor {entry.key!r} fails its digest (file is corrupt)"
    if needed is None:
        assert problems == [f"{record.path}: digest mismatch (file is corrupt)", chunk_problem]
    else:
        assert problems == [chunk_problem]


@pytest.mark.parametrize(("keep", "use_mmap"), [(False, True), (True, True), (True, False)])
def test_a_whole_file_reading_checks_each_chunk_digest_too(
    written: tuple[MemoryStore, FileRecord, bytes], keep: bool, use_mmap: bool
) -> None:
    """A file whose bytes match its own digest but whose record gives one chunk another digest
    (a writer that re-sealed the manifest) is refused by a whole-file reading (verify, a full
    load) exactly as a reading of that chunk alone refuses it: both readers agree."""
    store, record, _ = written
    entry = record.tensors[3]
    assert entry.digest is not None
    entry.digest = entry.digest.partition(":")[0] + ":" + "ab" * 32

    _, whole = check_shard(store, record.path, record, verify=True, keep=keep, use_mmap=use_mmap)
    _, alone = check_shard(store, record.path, record, verify=True, keep=True, use_mmap=use_mmap, needed=[3])
    _, unverified = check_shard(store, record.path, record, verify=False, keep=keep, use_mmap=use_mmap)

    expected = [f"{record.path}: tensor {entry.key!r} fails its digest (file is corrupt)"]
    assert whole == alone == expected
    assert unverified == []


def test_a_file_without_a_digest_is_reported_unverifiable(written: tuple[MemoryStore, FileRecord, bytes]) -> None:
    store, record, _ = written
    record.digest = None

    _, verified = check_shard(store, record.path, record, verify=True, keep=False)
    _, unverified = check_shard(store, record.path, record, verify=False, keep=False)

    assert verified == [f"{record.path}: has no digest, so it cannot be verified"]
    assert unverified == []


@pytest.mark.parametrize("size", [0, 1, 1023, (16 << 20) + 12345])
def test_parallel_blake3_gives_the_sequential_digest(size: int) -> None:
    """Loads and verify hash whole files with blake3 on every core: the digest must be the one
    the save recorded sequentially, whatever the size and the update boundaries."""
    from shardkeep.integrity import format_digest, new_digester

    data = memoryview(np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes())
    sequential = new_digester("blake3")
    sequential.update(data)
    parallel = new_digester("blake3", parallel=True)
    for start in range(0, size, 7 << 20):
        parallel.update(data[start : start + (7 << 20)])
    assert parallel.hexdigest() == sequential.hexdigest()
    assert _digest_view("blake3", data) == format_digest("blake3", sequential.hexdigest())


def test_a_forked_child_hashes_after_the_parent_hashed_in_parallel() -> None:
    """blake3's worker threads do not survive fork(), but its pool thinks they do: a parallel
    update in a child (a DataLoader worker, an evaluation subprocess) after the parent hashed in
    parallel would wait forever. Children hash on their own thread, with the same digest."""
    import os
    import select
    import signal

    data = memoryview(np.random.default_rng(3).integers(0, 256, 8 << 20, dtype=np.uint8).tobytes())
    expected = _digest_view("blake3", data)  # the parent's pool is running now
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        try:
            os.write(write_end, _digest_view("blake3", data).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], 60)
        assert ready, "the forked child's hash did not finish within 60 s (it hangs)"
        assert os.read(read_end, 200).decode() == expected
    finally:
        os.close(read_end)
        if os.waitpid(child, os.WNOHANG)[0] == 0:  # still running (hung, or about to exit)
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)


def _colliding_header(original: Any) -> Any:
    """``build_header`` as if every tensor of a file had the first one's name: the header then
    lists one tensor where the manifest lists all of them (a naming bug in a writer)."""

    def build(spans: Any, version: int | None = None) -> bytes:
        return bytes(original([(spans[0][0], *span[1:]) for span in spans], version))

    return build


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_file_whose_header_disagrees_with_its_record_is_never_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compression: str | None
) -> None:
    import torch

    import shardkeep as sk
    from shardkeep import layout

    monkeypatch.setattr(layout, "build_header", _colliding_header(layout.build_header))
    state = {"w": torch.ones(4), "b": torch.zeros(2), "step": 3}
    with pytest.raises(sk.IntegrityError, match=r"rank_00000.*header lists 1 tensors, manifest lists 2"):
        sk.save(state, tmp_path / "ckpt", options=WriteOptions(compression=compression))
    assert list(tmp_path.iterdir()) == []  # nothing committed, the staging directory removed
    monkeypatch.undo()
    sk.save(state, tmp_path / "ckpt", options=WriteOptions(compression=compression))
    assert sk.verify(tmp_path / "ckpt").ok


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")
def test_the_quick_header_comparison_agrees_with_the_full_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``built_header_agrees`` (the check every file passes before it is written) accepts exactly
    the headers ``check_header`` (the check of every load) accepts, for real plans of every kind
    of tensor and for each single change to a record."""
    import copy

    import torch

    import shardkeep as sk
    from shardkeep import writes as shard_writes
    from shardkeep.tensors.shardfile import built_header_agrees, check_header, parse_built_header

    plans: list[ShardPlan] = []
    real = shard_writes._refuse_disagreeing_header

    def keep(plan: ShardPlan) -> None:
        plans.append(plan)
        real(plan)

    monkeypatch.setattr(shard_writes, "_refuse_disagreeing_header", keep)
    state = {
        "f32": torch.randn(3, 4),
        "c128": torch.randn(2, dtype=torch.complex128),
        "c32": torch.randn(2, dtype=torch.complex64).to(torch.complex32),
        "bool": torch.ones(3, dtype=torch.bool),
        "empty": torch.empty(0, 5),
        "scalar": torch.tensor(7),
        "many": {str(i): torch.full((i + 1,), float(i)) for i in range(20)},
    }
    sk.save(state, tmp_path / "ckpt")
    sk.save(state, tmp_path / "packed", options=WriteOptions(file_size_target=64))
    assert plans
    for plan in plans:
        assert built_header_agrees(plan.header, plan.record), plan.record.path
        assert check_header(parse_built_header(plan.header), plan.record) == []
        for index in range(len(plan.record.tensors)):
            for change in ("shape", "dtype", "offset", "nbytes", "key", "drop"):
                record = copy.deepcopy(plan.record)
                entry = record.tensors[index]
                if change == "shape":
                    entry.shape = [*entry.shape, 1]
                elif change == "dtype":
                    entry.dtype = "I8" if entry.dtype != "I8" else "U8"
                elif change == "offset":
                    entry.offset += 1
                elif change == "nbytes":
                    entry.nbytes += 1
                elif change == "key":
                    entry.key += ".other"
                else:
                    del record.tensors[index]
                full = check_header(parse_built_header(plan.header), record)
                assert not built_header_agrees(plan.header, record), (plan.record.path, index, change)
                assert full, (plan.record.path, index, change)  # the fast refusal is always a real one
