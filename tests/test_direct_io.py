"""``O_DIRECT`` writes of large files (``LocalStore``).

- Files come out byte for byte as written, at every block boundary and for any split of the
  writes, from read-only and writable buffers; a whole save is byte-identical to one written
  through the page cache.
- Where the filesystem refuses ``O_DIRECT`` (no filesystem on these machines does, so the
  refusal is injected at the system call), the file is written through the page cache and the
  store records why; a refusal after the first block, or a failed background write, is a typed
  error that names the file, and nothing is committed.
- A simulated power cut at every system call of the writer: once ``commit`` returns, the file
  is durable; with the fsync removed, or fsynced before the background write lands, the sweep
  finds the loss (the mutation check for the new path).
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardkeep as sk
from shardkeep.storage import direct_io, localfs
from shardkeep.storage.local import DIRECT_IO_BLOCK, LocalStore

#: A block size the tests can afford many of (a multiple of the 4 KiB direct I/O alignment).
SMALL_BLOCK = 16 * 1024


class SmallBlocks(direct_io.FileCalls):
    """The real system calls, with blocks the tests can afford many of."""

    block = SMALL_BLOCK


@pytest.fixture
def small_blocks() -> direct_io.FileCalls:
    return SmallBlocks()


def _payload(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


def _write(store: LocalStore, path: str, data: bytes, splits: list[int], *, writable: bool) -> str:
    """Write ``data`` to a new file in pieces cut at ``splits``; return the path the writer took."""
    handle = store.open_write(path)
    source: bytes | bytearray = bytearray(data) if writable else data
    view = memoryview(source)
    start = 0
    for cut in [*sorted({min(max(cut, 0), len(data)) for cut in splits}), len(data)]:
        handle.write(view[start:cut])
        start = cut
    handle.commit()
    return handle.path_taken


@pytest.mark.parametrize(
    "size", [0, 1, DIRECT_IO_BLOCK - 1, DIRECT_IO_BLOCK, DIRECT_IO_BLOCK + 1, 3 * DIRECT_IO_BLOCK + 4097]
)
def test_files_are_byte_exact_at_every_block_boundary(tmp_path: Path, size: int) -> None:
    store = LocalStore(tmp_path)
    data = _payload(size, seed=size)
    for writable in (True, False):
        name = f"f{size}-{writable}"
        taken = _write(store, name, data, [5, DIRECT_IO_BLOCK // 2, DIRECT_IO_BLOCK + 3], writable=writable)
        assert (tmp_path / name).read_bytes() == data
        assert taken == ("direct" if size >= DIRECT_IO_BLOCK else "buffered")
    large = 2 if size >= DIRECT_IO_BLOCK else 0
    assert store.write_paths == {k: v for k, v in {"direct": large, "buffered": 2 - large}.items() if v}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    size=st.integers(0, 6 * SMALL_BLOCK + 100),
    splits=st.lists(st.integers(0, 6 * SMALL_BLOCK + 100), max_size=8),
    writable=st.booleans(),
)
def test_any_split_of_the_writes_gives_the_same_file(
    tmp_path: Path, small_blocks: direct_io.FileCalls, size: int, splits: list[int], writable: bool
) -> None:
    store = LocalStore(tmp_path, file_calls=small_blocks)
    data = _payload(size, seed=size + len(splits))
    name = f"f{time.monotonic_ns()}"
    taken = _write(store, name, data, splits, writable=writable)
    assert (tmp_path / name).read_bytes() == data
    assert taken == ("direct" if size >= SMALL_BLOCK else "buffered")


def _large_state() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(5)
    return {
        "big": torch.randn(3 * DIRECT_IO_BLOCK // 4 + 7, generator=generator),  # 3 blocks and 28 bytes
        "strided": torch.randn(1024, 1100, generator=generator).t(),  # copied in pieces
        "small": torch.arange(10),
        "step": 3,
    }


def _data_files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.rglob("*.safetensors"))}


def test_a_save_with_o_direct_is_byte_identical_to_one_through_the_page_cache(tmp_path: Path) -> None:
    state = _large_state()
    direct, buffered = LocalStore(tmp_path / "a"), LocalStore(tmp_path / "b", direct_io=False)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    sk.save(state, "ckpt", storage=direct, options=sk.WriteOptions(file_size_target=4 * DIRECT_IO_BLOCK))
    sk.save(state, "ckpt", storage=buffered, options=sk.WriteOptions(file_size_target=4 * DIRECT_IO_BLOCK))
    assert direct.write_paths["direct"] >= 1
    assert "direct" not in buffered.write_paths
    files = _data_files(tmp_path / "a" / "ckpt")
    assert files and files == _data_files(tmp_path / "b" / "ckpt")
    assert sk.verify(tmp_path / "a" / "ckpt").ok
    loaded = sk.load(tmp_path / "a" / "ckpt")
    assert torch.equal(loaded["big"], state["big"]) and torch.equal(loaded["strided"], state["strided"])


class _Refusing(direct_io.FileCalls):
    """A filesystem that refuses O_DIRECT: on ``fcntl`` (``where="fcntl"``), or only when the
    first aligned write is made (``where="write"``, as some network filesystems do)."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.direct: set[int] = set()

    def set_direct(self, fd: int, on: bool) -> None:
        if on and self.where == "fcntl":
            raise OSError(errno.EINVAL, "Invalid argument")
        super().set_direct(fd, on)
        (self.direct.add if on else self.direct.discard)(fd)

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        if fd in self.direct and self.where == "write":
            raise OSError(errno.EINVAL, "Invalid argument")
        return super().pwrite(fd, data, offset)


@pytest.mark.parametrize("where", ["fcntl", "write"])
def test_a_filesystem_that_refuses_o_direct_gets_the_page_cache(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    store = LocalStore(tmp_path, file_calls=_Refusing(where))
    state = _large_state()
    with caplog.at_level("INFO", logger="shardkeep"):
        sk.save(state, "ckpt", storage=store)
        sk.save(state, "ckpt2", storage=store)
    refused = "buffered: O_DIRECT refused (Invalid argument)"
    assert store.write_paths[refused] == 2 and "direct" not in store.write_paths
    logged = [r.getMessage() for r in caplog.records if "page cache" in r.getMessage()]
    assert logged == [f"{tmp_path}: files are written through the page cache: O_DIRECT refused (Invalid argument)"]
    assert sk.verify(tmp_path / "ckpt").ok
    assert torch.equal(sk.load(tmp_path / "ckpt")["big"], state["big"])


class _FailingLater(direct_io.FileCalls):
    """O_DIRECT works, then the write at byte ``offset`` fails with ``code``; records the order
    of writes and closes per file descriptor."""

    def __init__(self, offset: int, code: int) -> None:
        self.offset = offset
        self.code = code
        self.events: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        if offset == self.offset:
            time.sleep(0.05)  # still in flight when the writer moves on
            with self._lock:
                self.events.append(("failed write", fd))
            raise OSError(self.code, os.strerror(self.code))
        return super().pwrite(fd, data, offset)

    def close(self, fd: int) -> None:
        with self._lock:
            self.events.append(("close", fd))
        super().close(fd)


@pytest.mark.parametrize(
    ("offset", "code"),
    [(DIRECT_IO_BLOCK, errno.EINVAL), (DIRECT_IO_BLOCK, errno.EIO), (2 * DIRECT_IO_BLOCK, errno.ENOSPC)],
    ids=["einval-on-block-2", "eio-in-background", "enospc-in-background"],
)
def test_a_failed_direct_write_fails_the_save_and_commits_nothing(tmp_path: Path, offset: int, code: int) -> None:
    calls = _FailingLater(offset, code)
    with pytest.raises(sk.StorageError, match=r"writing '.*\.safetensors' failed: .*") as failure:
        sk.save(_large_state(), "ckpt", storage=LocalStore(tmp_path, file_calls=calls))
    assert f"errno {code}" in str(failure.value)
    assert sorted(os.listdir(tmp_path)) == []  # no checkpoint, no staging directory left
    failed_fd = next(fd for event, fd in calls.events if event == "failed write")
    order = [event for event, fd in calls.events if fd == failed_fd]
    assert order.index("failed write") < order.index("close"), order  # the fd outlived its write


class _PowerLossFile(SmallBlocks):
    """A simulated disk under the real writer: a file's bytes survive a power cut only once
    fsynced. ``cut_at=N`` cuts the power at the N-th call (1-based); ``skip_fsync`` makes fsync
    a no-op (the mutation). Background writes are slowed, so that an fsync issued before they
    land would be seen."""

    def __init__(self, cut_at: int | None = None, skip_fsync: bool = False) -> None:
        self.cut_at = cut_at
        self.skip_fsync = skip_fsync
        self.calls = 0
        self.volatile = bytearray()
        self.durable = b""
        self._lock = threading.Lock()

    def _tick(self) -> None:
        with self._lock:
            self.calls += 1
            if self.cut_at is not None and self.calls >= self.cut_at:
                raise OSError(errno.EIO, "power cut")

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.002)
        self._tick()
        written = super().pwrite(fd, data, offset)
        with self._lock:
            end = offset + written
            if len(self.volatile) < end:
                self.volatile.extend(bytes(end - len(self.volatile)))
            self.volatile[offset:end] = data[:written]
        return written

    def set_direct(self, fd: int, on: bool) -> None:
        self._tick()
        super().set_direct(fd, on)

    def fsync(self, fd: int) -> None:
        self._tick()
        if not self.skip_fsync:
            with self._lock:
                self.durable = bytes(self.volatile)
        super().fsync(fd)

    def close(self, fd: int) -> None:
        super().close(fd)  # closing never fails here, and is always allowed to happen


def _power_loss_sweep(tmp_path: Path, skip_fsync: bool = False) -> list[str]:
    data = _payload(5 * SMALL_BLOCK + 123, seed=9)
    probe = _PowerLossFile()
    assert _write(LocalStore(tmp_path, file_calls=probe), "probe", data, [SMALL_BLOCK // 3], writable=True) == "direct"
    violations = []
    for cut in range(1, probe.calls + 2):
        disk = _PowerLossFile(cut_at=cut, skip_fsync=skip_fsync)
        try:
            _write(LocalStore(tmp_path, file_calls=disk), f"cut{cut}", data, [SMALL_BLOCK // 3], writable=True)
        except sk.StorageError:
            continue  # the save fails, and its staging directory is never read as a checkpoint
        if disk.durable != data:
            violations.append(f"cut at call {cut}: commit returned, but {len(disk.durable)} bytes survive")
    return violations


def test_power_loss_at_every_call_of_a_direct_write(tmp_path: Path) -> None:
    assert _power_loss_sweep(tmp_path) == []


def test_removing_the_fsync_of_a_direct_write_is_caught(tmp_path: Path) -> None:
    assert _power_loss_sweep(tmp_path, skip_fsync=True)


def test_fsync_before_the_background_write_lands_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second mutation: a commit that does not wait for the blocks still in flight (the
    writer's own waiting methods are removed: a mutation of the writer, not a simulated disk)."""
    monkeypatch.setattr(direct_io.LocalWriter, "_wait_in_flight", lambda self: None)
    monkeypatch.setattr(direct_io.LocalWriter, "_settle", lambda self, future: None)
    assert _power_loss_sweep(tmp_path)


def test_a_store_with_direct_io_off_never_uses_it(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, direct_io=False)
    assert _write(store, "f", _payload(DIRECT_IO_BLOCK + 5), [], writable=True).startswith(
        "buffered: direct I/O is off"
    )
    assert (tmp_path / "f").read_bytes() == _payload(DIRECT_IO_BLOCK + 5)


def _write_in_child(root: str, name: str, size: int, seed: int) -> None:
    store = LocalStore(root, file_calls=SmallBlocks())
    for round_ in range(20):
        data = _payload(size, seed=seed + round_)
        _write(store, f"{name}-{round_}", data, [size // 3], writable=round_ % 2 == 0)
    os._exit(0)


@pytest.mark.parametrize("size", [300, 2 * SMALL_BLOCK + 17], ids=["small-file", "direct-file"])
def test_forked_writers_never_share_a_buffer(tmp_path: Path, small_blocks: direct_io.FileCalls, size: int) -> None:
    """The pooled buffers a parent made are its own after a fork: two forked children writing
    at once, with buffers the parent already holds in its pool, each write only their bytes."""
    parent = LocalStore(tmp_path, file_calls=small_blocks)
    _write(parent, "parent", _payload(3 * SMALL_BLOCK), [], writable=True)  # fills the pool
    import multiprocessing

    context = multiprocessing.get_context("fork")
    children = [
        context.Process(target=_write_in_child, args=(str(tmp_path), f"child{i}", size, 100 * i)) for i in range(2)
    ]
    for child in children:
        child.start()
    for child in children:
        child.join(60)
        assert child.exitcode == 0
    for i in range(2):
        for round_ in range(20):
            assert (tmp_path / f"child{i}-{round_}").read_bytes() == _payload(size, seed=100 * i + round_)


class _SlowBackground(SmallBlocks):
    """Background block writes take a while, and can fail; records writes and closes in order.
    ``interrupts`` are raised, one each, by the first waits for a background write (a Ctrl-C
    landing while the writer waits)."""

    def __init__(self, fail_offset: int | None = None, in_flight: int = direct_io.DIRECT_IN_FLIGHT) -> None:
        self.fail_offset = fail_offset
        self.in_flight = in_flight
        self.events: list[str] = []
        self.fsyncs = 0
        self.interrupts: list[BaseException] = []

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.2)
            if offset == self.fail_offset:
                self.events.append("failed write")
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            written = super().pwrite(fd, data, offset)
            self.events.append("background write done")
            return written
        return super().pwrite(fd, data, offset)

    def fsync(self, fd: int) -> None:
        self.fsyncs += 1
        super().fsync(fd)

    def close(self, fd: int) -> None:
        self.events.append("close")
        super().close(fd)

    def wait(self, future: Any) -> None:
        if self.interrupts:
            raise self.interrupts.pop()
        super().wait(future)


def _interrupt_the_first_wait(calls: _SlowBackground) -> None:
    """A Ctrl-C lands while the writer first waits for a background write."""
    calls.interrupts.append(KeyboardInterrupt())


def test_an_interrupt_while_waiting_for_a_background_write_closes_nothing_early(tmp_path: Path) -> None:
    """Ctrl-C while the writer waits for its block in flight: the wait goes on until the block
    is written, then the interrupt is raised and the descriptor closed (a descriptor closed
    first could be reused by another file, which the late write would land in)."""
    calls = _SlowBackground()
    _interrupt_the_first_wait(calls)
    handle = LocalStore(tmp_path, file_calls=calls).open_write("f")
    handle.write(_payload(2 * SMALL_BLOCK + 5))  # block 1 inline, block 2 in the background
    with pytest.raises(KeyboardInterrupt):
        handle.commit()
    assert calls.events == ["background write done", "close"], calls.events
    assert calls.fsyncs == 0  # never committed


def test_a_writer_whose_background_write_failed_refuses_to_commit(tmp_path: Path) -> None:
    calls = _SlowBackground(fail_offset=SMALL_BLOCK)
    handle = LocalStore(tmp_path, file_calls=calls).open_write("f")
    handle.write(_payload(2 * SMALL_BLOCK))  # block 2 goes to the background and fails
    with pytest.raises(sk.StorageError, match=r"writing 'f' failed"):  # a later block waits for it
        for _ in range(2 + calls.in_flight):
            handle.write(_payload(SMALL_BLOCK))
    with pytest.raises(sk.StorageError, match="a write to it failed"):
        handle.commit()
    assert calls.fsyncs == 0
    handle.abort()
    with pytest.raises(sk.StorageError, match="a write to it failed"):
        handle.write(b"x")
    closed = LocalStore(tmp_path, file_calls=calls).open_write("g")
    closed.write(b"y")
    closed.commit()
    with pytest.raises(sk.StorageError, match="it is closed"):
        closed.write(b"z")


def _open_write_in_child(root: str) -> None:
    handle = LocalStore(root).open_write("child")
    handle.write(b"x")
    handle.commit()
    os._exit(0)


def test_a_fork_while_another_thread_holds_the_stores_locks_does_not_hang_the_child(tmp_path: Path) -> None:
    import multiprocessing

    held = [localfs._Libc.lock, direct_io._BUFFERS._lock]
    for lock in held:
        lock.acquire()  # as a parent thread inside open_write would hold them at the fork
    try:
        child = multiprocessing.get_context("fork").Process(target=_open_write_in_child, args=(str(tmp_path),))
        child.start()
        child.join(20)
        hung = child.is_alive()
        if hung:
            child.kill()
            child.join()
    finally:
        for lock in held:
            lock.release()
    assert not hung, "the forked child hung on a lock its parent held"
    assert child.exitcode == 0 and (tmp_path / "child").read_bytes() == b"x"


@pytest.mark.parametrize("depth", [2, 3])
def test_several_blocks_in_flight_give_the_same_file(tmp_path: Path, depth: int) -> None:
    """The writer keeps up to ``in_flight`` blocks in the background (``DIRECT_IN_FLIGHT``, 1,
    by default; a deeper queue was measured and did not pay here): deeper queues write the same
    bytes."""
    calls = _PowerLossFile()  # slows background writes, so that several are in flight at once
    calls.in_flight = depth
    data = _payload(9 * SMALL_BLOCK + 77, seed=depth)
    store = LocalStore(tmp_path, file_calls=calls)
    assert _write(store, "f", data, [SMALL_BLOCK // 2, 4 * SMALL_BLOCK + 1], writable=True) == "direct"
    assert (tmp_path / "f").read_bytes() == data == calls.durable


class _SubmitThenInterrupted(_SlowBackground):
    """The job gets into the pool, then a Ctrl-C lands (while the pool starts a thread)."""

    def submit(self, job: Any) -> None:
        super().submit(job)
        raise KeyboardInterrupt


def test_an_interrupt_while_queueing_a_block_never_lets_it_land_elsewhere(tmp_path: Path) -> None:
    """Ctrl-C inside the pool's submit, after the job got in (while the pool starts a thread):
    the job is cancelled if it has not started, or waited for; either way the descriptor is
    closed after it, and a file opened next never receives its bytes."""
    calls = _SubmitThenInterrupted()
    handle = LocalStore(tmp_path, file_calls=calls).open_write("victim")
    with pytest.raises(KeyboardInterrupt):
        handle.write(_payload(2 * SMALL_BLOCK + 1))
    handle.abort()
    other = LocalStore(tmp_path).open_write("innocent")
    other.write(b"x" * 20)
    time.sleep(0.4)  # longer than a slowed background write
    other.commit()
    assert (tmp_path / "innocent").read_bytes() == b"x" * 20
    if "background write done" in calls.events:
        assert calls.events.index("background write done") < calls.events.index("close"), calls.events


def test_an_interrupt_during_abort_with_several_blocks_in_flight_closes_after_all(tmp_path: Path) -> None:
    calls = _SlowBackground(in_flight=2)
    handle = LocalStore(tmp_path, file_calls=calls).open_write("f")
    handle.write(_payload(3 * SMALL_BLOCK))  # block 1 inline, blocks 2 and 3 in the background
    _interrupt_the_first_wait(calls)
    with pytest.raises(KeyboardInterrupt):
        handle.abort()
    assert calls.events == ["background write done", "background write done", "close"], calls.events
