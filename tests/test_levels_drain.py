"""The drain of a committed node-local step to a persistent level: one node and two (real gloo
ranks, separate local roots), damaged local files, a crash and an EIO at every store operation
of a drain, recovery, retries, abandoning, the memory bound, and a real S3 server."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

import shardkeep as sk
from shardkeep.config import WriteOptions
from shardkeep.distributed.coordinator import Coordinator
from shardkeep.errors import DrainError
from shardkeep.levels.drain import Drain, DrainState, recover_drains
from shardkeep.names import MANIFEST_FILENAME, STAGING_MARKER, checkpoint_name
from shardkeep.retry import RetryPolicy
from shardkeep.storage import ForwardingStore, LocalStore
from shardkeep.storage.base import WriteHandle
from shardkeep.testing import FaultInjectingStore
from tests.support.distributed_harness import results_or_raise, run_ranks
from tests.support.node_parts import split_into_nodes

torch = pytest.importorskip("torch")

NAME = checkpoint_name(100)
SMALL_FILES = WriteOptions(file_size_target=4096)


def small_state(seed: int = 0) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "model": {f"layer{i}": torch.randn(1000, generator=generator) for i in range(3)},
        "note": "drained",
        "step": 100,
    }


def local_step(base: Path, state: dict[str, Any] | None = None, options: WriteOptions = SMALL_FILES) -> Path:
    """A committed one-node local step under ``base/local0``; returns that local root."""
    sk.save(state or small_state(), base / "src" / NAME, step=100, options=options)
    split_into_nodes(base / "src" / NAME, [base / "local0"], [0])
    return base / "local0"


def snapshot(root: Path) -> dict[str, str]:
    """Every file below ``root`` and the sha256 of its bytes."""
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def drain_once(local: Path, persistent: Any, **kwargs: Any) -> DrainState:
    drain = Drain(local, NAME, persistent, Coordinator(), [0], **kwargs)
    drain.start()
    return drain.wait(60)


def assert_drained(base: Path, persistent: Path) -> None:
    """The persistent copy verifies, loads as the saved state and has the local manifest bytes."""
    assert sk.verify(persistent / NAME).ok, sk.verify(persistent / NAME).problems
    assert (persistent / NAME / MANIFEST_FILENAME).read_bytes() == (
        base / "src" / NAME / MANIFEST_FILENAME
    ).read_bytes()
    loaded = sk.load(persistent / NAME)
    expected = sk.load(base / "src" / NAME)
    for key, value in expected["model"].items():
        assert torch.equal(loaded["model"][key], value)
    assert loaded["note"] == "drained"


# --------------------------------------------------------------------------------------------
# One node


def test_a_drained_step_verifies_loads_and_keeps_its_manifest_bytes(tmp_path: Path) -> None:
    local = local_step(tmp_path)
    before = snapshot(local)
    persistent = tmp_path / "persistent"
    persistent.mkdir()
    state = drain_once(local, str(persistent))
    assert state.state == "committed" and state.error is None, state
    assert state.bytes_copied == sum(p.stat().st_size for p in (tmp_path / "src" / NAME).rglob("*.safetensors"))
    assert_drained(tmp_path, persistent)
    assert sorted(os.listdir(persistent)) == [NAME]  # no staging left, no node-part.json copied
    assert not (persistent / NAME / "node-part.json").exists()
    assert snapshot(local) == before
    # Draining it again finds the same manifest there: committed, nothing copied.
    again = drain_once(local, str(persistent))
    assert again.state == "committed" and again.bytes_copied == 0


def test_a_signed_step_keeps_its_signature(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    public = key.public_key()
    sk.save(small_state(), tmp_path / "src" / NAME, options=SMALL_FILES, signer=key)
    split_into_nodes(tmp_path / "src" / NAME, [tmp_path / "local0"], [0])
    persistent = tmp_path / "persistent"
    persistent.mkdir()
    assert drain_once(tmp_path / "local0", persistent).state == "committed"
    report = sk.verify(persistent / NAME, public_key=public, require_signature=True)
    assert report.ok, report.problems
    assert (persistent / NAME / "manifest.sig").read_bytes() == (tmp_path / "src" / NAME / "manifest.sig").read_bytes()


def test_a_flipped_byte_in_a_local_file_fails_the_drain_naming_it(tmp_path: Path) -> None:
    local = local_step(tmp_path)
    victim = sorted((local / NAME / "shards").iterdir())[1]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    persistent = tmp_path / "persistent"
    persistent.mkdir()
    state = drain_once(local, persistent)
    assert state.state == "failed" and isinstance(state.error, DrainError), state
    message = str(state.error)
    assert NAME in message and f"shards/{victim.name}" in message, message
    assert "node 0" in message and "rank 0" in message and "digest" in message, message
    assert os.listdir(persistent) == []  # nothing committed, the staging removed


@pytest.mark.parametrize("damaged", [False, True])
def test_a_compressed_step_is_checked_against_its_decompressed_digest(tmp_path: Path, damaged: bool) -> None:
    state = {"model": {"zeros": torch.zeros(4096), "ramp": torch.arange(4096, dtype=torch.float32)}, "note": "drained"}
    local = local_step(tmp_path, state, WriteOptions(compression="zstd", file_size_target=8192))
    record = sk.read_manifest(local / NAME).files[-1]
    assert record.compression is not None
    if damaged:
        victim = local / NAME / record.path
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0x10
        victim.write_bytes(bytes(data))
    persistent = tmp_path / "persistent"
    persistent.mkdir()
    result = drain_once(local, persistent)
    if damaged:
        assert result.state == "failed" and record.path in str(result.error), result
        assert os.listdir(persistent) == []
    else:
        assert result.state == "committed", result
        assert_drained(tmp_path, persistent)


def test_a_missing_local_file_fails_the_plan_on_every_rank(tmp_path: Path) -> None:
    local = local_step(tmp_path)
    victim = sorted((local / NAME / "shards").iterdir())[0]
    victim.unlink()
    persistent = tmp_path / "persistent"
    persistent.mkdir()
    drain = Drain(local, NAME, persistent, Coordinator(), [0])
    with pytest.raises(DrainError, match=f"shards/{victim.name}.*held by no node"):
        drain.start()
    assert os.listdir(persistent) == []
    assert drain.poll().state == "failed"


def test_another_attempt_on_the_persistent_level_is_never_overwritten(tmp_path: Path) -> None:
    local = local_step(tmp_path)
    persistent = tmp_path / "persistent"
    sk.save(small_state(seed=7), persistent / NAME)  # another timeline's step 100
    with pytest.raises(DrainError, match="another manifest"):
        Drain(local, NAME, persistent, Coordinator(), [0]).start()


# --------------------------------------------------------------------------------------------
# Crashes and EIO at every store operation of a drain


def _count_operations(local: Path, persistent: Path) -> list[str]:
    counting = FaultInjectingStore(LocalStore(str(persistent)))
    assert drain_once(local, counting).state == "committed"
    operations = counting.operations
    for entry in os.listdir(persistent):
        LocalStore(str(persistent)).remove_tree(entry)
    return operations


def _crashing_drain(local: str, persistent: str, fail_at: int) -> None:
    store = FaultInjectingStore(LocalStore(persistent), fail_at=fail_at, fault=lambda _: os._exit(3))
    drain_once(Path(local), store)
    os._exit(0)


def test_a_crash_at_every_operation_leaves_nothing_half_committed(tmp_path: Path) -> None:
    local = local_step(tmp_path)
    persistent = tmp_path / "persistent"
    persistent.mkdir()
    before = snapshot(local)
    operations = _count_operations(local, persistent)
    assert any(op.startswith("write ") for op in operations) and any(op.startswith("rename ") for op in operations)
    context = multiprocessing.get_context("fork")
    outcomes: dict[str, int] = {}
    for fail_at in range(1, len(operations) + 1):
        child = context.Process(target=_crashing_drain, args=(str(local), str(persistent), fail_at))
        child.start()
        child.join(60)
        assert child.exitcode == 3, (fail_at, operations[fail_at - 1], child.exitcode)
        committed = (persistent / NAME / MANIFEST_FILENAME).exists()
        if committed:  # the crash came after the commit point: a whole checkpoint
            assert sk.verify(persistent / NAME).ok
        assert snapshot(local) == before, "the local copy changed"
        recovery = recover_drains(persistent, [NAME])
        assert not any(STAGING_MARKER in entry for entry in os.listdir(persistent)), fail_at
        assert recovery.persisted == ([NAME] if committed else [])
        if not committed and recovery.removed:
            assert recovery.redrain == [NAME]
        state = drain_once(local, persistent)
        assert state.state == "committed", (fail_at, state)
        assert_drained(tmp_path, persistent)
        outcomes[operations[fail_at - 1].split(" ")[0]] = fail_at
        for entry in os.listdir(persistent):
            LocalStore(str(persistent)).remove_tree(entry)
    assert {"write", "commit", "rename"} <= set(outcomes), outcomes


def test_an_eio_at_every_operation_fails_cleanly_or_commits(tmp_path: Path) -> None:
    local = local_step(tmp_path)
    persistent = tmp_path / "persistent"
    persistent.mkdir()
    operations = _count_operations(local, persistent)
    for fail_at in range(1, len(operations) + 1):
        store = FaultInjectingStore(LocalStore(str(persistent)), fail_at=fail_at)
        drain = Drain(local, NAME, store, Coordinator(), [0])
        try:
            drain.start()
            state = drain.wait(60)
        except DrainError as exc:  # the plan failed (a stat, or creating the staging)
            assert "EIO" in str(exc), exc
            state = drain.poll()
        assert (state.state == "committed") == (persistent / NAME / MANIFEST_FILENAME).exists(), fail_at
        if state.state == "committed":
            assert_drained(tmp_path, persistent)
        else:
            assert state.state == "failed" and "EIO" in str(state.error), (fail_at, state)
            assert os.listdir(persistent) == [], (fail_at, operations[fail_at - 1], os.listdir(persistent))
        for entry in os.listdir(persistent):
            LocalStore(str(persistent)).remove_tree(entry)


def test_a_transient_error_is_retried_under_the_policy(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    local = local_step(tmp_path)
    persistent = tmp_path / "persistent"
    persistent.mkdir()
    operations = _count_operations(local, persistent)
    first_write = next(i for i, op in enumerate(operations, 1) if op.startswith("write "))
    quick = RetryPolicy(attempts=3, initial_backoff=0.01, max_backoff=0.01)
    store = FaultInjectingStore(LocalStore(str(persistent)), fail_at=first_write)
    with caplog.at_level("WARNING", logger="shardkeep.levels.drain"):
        state = drain_once(local, store, retry=quick)
    assert state.state == "committed", state
    assert any("attempt 1 of 3" in record.getMessage() for record in caplog.records)
    assert_drained(tmp_path, persistent)


def test_a_permanent_error_is_not_retried(tmp_path: Path) -> None:
    import errno

    local = local_step(tmp_path)
    persistent = tmp_path / "persistent"
    persistent.mkdir()
    operations = _count_operations(local, persistent)
    first_write = next(i for i, op in enumerate(operations, 1) if op.startswith("write "))
    store = FaultInjectingStore(LocalStore(str(persistent)), fail_at=first_write, code=errno.EACCES)
    state = drain_once(local, store, retry=RetryPolicy(attempts=3, initial_backoff=0.01, max_backoff=0.01))
    assert state.state == "failed" and "EACCES" in str(state.error), state
    assert os.listdir(persistent) == []


def test_recover_drains_removes_stale_staging_and_names_the_step(tmp_path: Path) -> None:
    local = local_step(tmp_path)
    persistent = tmp_path / "persistent"
    stale = persistent / f"{NAME}{STAGING_MARKER}{'0' * 32}"
    (stale / "shards").mkdir(parents=True)
    (stale / "shards" / "rank_00000.safetensors").write_bytes(b"partial")
    other = persistent / f"{checkpoint_name(5)}{STAGING_MARKER}{'1' * 32}"  # not a local step: left to the catalog
    other.mkdir()
    recovery = recover_drains(persistent, [NAME])
    assert recovery.removed == [stale.name] and recovery.redrain == [NAME] and recovery.persisted == []
    assert sorted(os.listdir(persistent)) == [other.name]
    assert drain_once(local, persistent).state == "committed"
    assert recover_drains(persistent, [NAME]).persisted == [NAME]


# --------------------------------------------------------------------------------------------
# Waiting, abandoning, memory


class SlowWrites(ForwardingStore):
    """Every write waits ``delay`` seconds (a slow persistent level)."""

    def __init__(self, inner: Any, delay: float) -> None:
        super().__init__(inner)
        self.delay = delay

    def open_write(self, path: str) -> WriteHandle:
        handle = self.inner.open_write(path)
        delay = self.delay

        class Slow:
            def write(self, data: bytes | memoryview, /) -> None:
                time.sleep(delay)
                handle.write(data)

            def commit(self) -> None:
                handle.commit()

            def abort(self) -> None:
                handle.abort()

        return Slow()


def test_wait_is_bounded_and_abandon_removes_what_was_written(tmp_path: Path) -> None:
    local = local_step(tmp_path)
    persistent = tmp_path / "persistent"
    persistent.mkdir()
    drain = Drain(local, NAME, SlowWrites(LocalStore(str(persistent)), 0.5), Coordinator(), [0])
    drain.start()
    began = time.monotonic()
    state = drain.wait(0.2)
    assert state.state == "running" and time.monotonic() - began < 2.0, state
    state = drain.abandon()
    assert state.state == "failed" and "abandoned" in str(state.error), state
    assert os.listdir(persistent) == []
    assert drain.poll() is state  # terminal: the same state, no collective


def test_copying_a_64_mib_file_holds_about_the_byte_budget(tmp_path: Path) -> None:
    budget = 4 << 20
    state = {"big": torch.arange(16 << 20, dtype=torch.float32)}  # 64 MiB in one file
    sk.save(state, tmp_path / "src" / NAME)
    del state
    split_into_nodes(tmp_path / "src" / NAME, [tmp_path / "local0"], [0])
    persistent = tmp_path / "persistent"
    persistent.mkdir()
    tracemalloc.start()
    try:
        result = drain_once(tmp_path / "local0", persistent, options=WriteOptions(byte_budget=budget))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.state == "committed" and result.bytes_copied > 64 << 20, result
    assert peak < 2 * budget, f"peak {peak / 2**20:.1f} MiB with a {budget >> 20} MiB budget"
    assert sk.verify(persistent / NAME).ok


# --------------------------------------------------------------------------------------------
# Four ranks on two nodes, each node its own local root


def _sharded_state(world_size: int, seed: int = 3) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    generator = torch.Generator().manual_seed(seed)
    full = {"w": torch.randn(64, 16, generator=generator), "v": torch.randn(32, generator=generator)}
    return {
        "model": {key: distribute_tensor(value, mesh, [Shard(0)]) for key, value in full.items()},
        "bias": torch.ones(4),
    }


def _drain_on_two_nodes(rank: int, world_size: int, base: str, damage_node: int | None) -> dict[str, Any]:
    root = Path(base)
    node_of = [r // 2 for r in range(world_size)]
    coordinator = Coordinator()
    sk.save(_sharded_state(world_size), root / "src" / NAME, step=100)
    if rank == 0:
        parts = split_into_nodes(root / "src" / NAME, [root / "node0", root / "node1"], node_of)
        if damage_node is not None:
            victim = root / f"node{damage_node}" / NAME / parts[damage_node].files[0]
            data = bytearray(victim.read_bytes())
            data[-1] ^= 0xFF
            victim.write_bytes(bytes(data))
    coordinator.barrier()
    drain = Drain(root / f"node{node_of[rank]}", NAME, str(root / "persistent"), coordinator, node_of)
    drain.start()
    assert drain.plan is not None
    mine = [(task.path, task.node) for task in drain.plan.tasks.get(rank, [])]
    state = drain.wait(60)
    while state.state == "running":
        state = drain.wait(1)
    return {"state": state.state, "error": str(state.error or ""), "mine": mine, "bytes": state.bytes_copied}


@pytest.mark.parametrize("damage_node", [None, 1])
def test_four_ranks_on_two_nodes_drain_each_file_once_from_its_node(tmp_path: Path, damage_node: int | None) -> None:
    base = tmp_path / "run"
    (base / "persistent").mkdir(parents=True)
    results = results_or_raise(run_ranks(4, _drain_on_two_nodes, str(base), damage_node, outbox=tmp_path / "out"))
    if damage_node is not None:
        assert {result["state"] for result in results} == {"failed"}
        assert len({result["error"] for result in results}) == 1  # the same error on every rank
        assert f"node {damage_node}" in results[0]["error"] and "digest" in results[0]["error"], results[0]
        assert os.listdir(base / "persistent") == []
        return
    assert [result["state"] for result in results] == ["committed"] * 4, results
    copied = [path for result in results for path, _ in result["mine"]]
    assert len(copied) == len(set(copied))  # each file once
    for rank, result in enumerate(results):
        assert all(node == rank // 2 for _, node in result["mine"]), (rank, result["mine"])
    assert all(result["mine"] for result in results), "every rank of a node holding files copies some"
    assert any(path.startswith("index/") for path, _ in results[0]["mine"])  # the indexes: the coordinator
    persistent = base / "persistent" / NAME
    assert sk.verify(persistent).ok, sk.verify(persistent).problems
    assert (persistent / MANIFEST_FILENAME).read_bytes() == (base / "src" / NAME / MANIFEST_FILENAME).read_bytes()
    assert snapshot(persistent) == {
        path: digest for path, digest in snapshot(base / "src" / NAME).items() if path != "node-part.json"
    }
    loaded = sk.load(persistent)
    expected = sk.load(base / "src" / NAME)
    assert torch.equal(loaded["model"]["w"], expected["model"]["w"])


# --------------------------------------------------------------------------------------------
# A real S3 server


@pytest.mark.slow
def test_a_drain_to_s3_commits_create_only_and_recovers_leftovers(
    tmp_path: Path, s3_root: tuple[str, dict[str, Any]]
) -> None:
    from shardkeep.storage import FsspecStore

    root, options = s3_root
    local = local_step(tmp_path)
    store = FsspecStore(root, options)
    # A drain cut off earlier left objects under the name, and no manifest.
    from shardkeep.storage.base import write_new

    write_new(store, f"{NAME}/shards/rank_00000.safetensors", b"partial")
    recovery = recover_drains(root, [NAME], storage_options=options)
    assert recovery.redrain == [NAME] and recovery.removed, recovery
    assert store.stat(NAME) is None
    write_new(store, f"{NAME}/shards/rank_00000.safetensors", b"partial")  # start() clears them too
    state = drain_once(local, root, storage_options=options)
    assert state.state == "committed", state
    report = sk.verify(f"{root}/{NAME}", storage_options=options)
    assert report.ok, report.problems
    loaded = sk.load(f"{root}/{NAME}", storage_options=options)
    assert torch.equal(loaded["model"]["layer0"], sk.load(tmp_path / "src" / NAME)["model"]["layer0"])
    handle = store.open_read(f"{NAME}/{MANIFEST_FILENAME}")
    sealed = bytearray(handle.size)
    handle.read_into(0, memoryview(sealed))
    handle.close()
    assert bytes(sealed) == (tmp_path / "src" / NAME / MANIFEST_FILENAME).read_bytes()
    assert recover_drains(root, [NAME], storage_options=options).persisted == [NAME]
    # A damaged local file: nothing committed, the drain's objects removed.
    other = checkpoint_name(200)
    sk.save(small_state(2), tmp_path / "src2" / other, options=SMALL_FILES)
    split_into_nodes(tmp_path / "src2" / other, [tmp_path / "local2"], [0])
    victim = sorted((tmp_path / "local2" / other / "shards").iterdir())[-1]
    victim.write_bytes(victim.read_bytes()[:-1] + b"\x00")
    drain = Drain(tmp_path / "local2", other, root, Coordinator(), [0], storage_options=options)
    drain.start()
    failed = drain.wait(60)
    assert failed.state == "failed" and "digest" in str(failed.error), failed
    assert store.stat(other) is None


def test_threads_stop_with_the_drain(tmp_path: Path) -> None:
    local = local_step(tmp_path)
    persistent = tmp_path / "persistent"
    persistent.mkdir()
    priority = os.getpriority(os.PRIO_PROCESS, 0)
    drain_once(local, persistent)
    assert os.getpriority(os.PRIO_PROCESS, 0) == priority  # only the copying thread was lowered
    assert not [thread for thread in threading.enumerate() if thread.name.startswith("shardkeep-drain")]


@pytest.mark.slow
def test_an_eio_at_every_operation_on_s3_fails_cleanly_or_commits(
    tmp_path: Path, s3_root: tuple[str, dict[str, Any]]
) -> None:
    from shardkeep.storage import FsspecStore

    root, options = s3_root
    local = local_step(tmp_path)
    inner = FsspecStore(root, options)
    counting = FaultInjectingStore(inner)
    assert drain_once(local, counting).state == "committed"
    operations = counting.operations
    inner.remove_tree(NAME)
    for fail_at in range(1, len(operations) + 1):
        drain = Drain(local, NAME, FaultInjectingStore(inner, fail_at=fail_at), Coordinator(), [0])
        try:
            drain.start()
            state = drain.wait(60)
        except DrainError:
            state = drain.poll()
        assert (state.state == "committed") == (inner.stat(f"{NAME}/{MANIFEST_FILENAME}") is not None), fail_at
        if state.state == "committed":
            assert sk.verify(f"{root}/{NAME}", storage_options=options).ok, (fail_at, operations[fail_at - 1])
        else:
            assert state.state == "failed", state
            assert inner.stat(NAME) is None, (fail_at, operations[fail_at - 1], inner.list_files(NAME))
        inner.remove_tree(NAME)


def _drain_where_a_rank_dies(rank: int, world_size: int, base: str, crash: bool) -> dict[str, Any]:
    root = Path(base)
    node_of = list(range(world_size))  # one rank per node
    coordinator = Coordinator(timeout=20)
    if crash:
        sk.save(_sharded_state(world_size), root / "src" / NAME, step=100)
        if rank == 0:
            split_into_nodes(root / "src" / NAME, [root / f"node{n}" for n in node_of], node_of)
        coordinator.barrier()
    store: Any = LocalStore(str(root / "persistent"))
    if crash and rank == 1:  # dies at its first write into the staging directory
        store = FaultInjectingStore(store, fail_at=2, fault=lambda _: os._exit(3))
    drain = Drain(root / f"node{rank}", NAME, store, coordinator, node_of)
    drain.start()
    try:
        state = drain.wait(60)
        while state.state == "running":
            state = drain.wait(1)
    except sk.ShardkeepError as exc:
        return {"state": "raised", "error": type(exc).__name__}
    return {"state": state.state, "error": str(state.error or "")}


@pytest.mark.slow
def test_a_rank_dying_during_a_drain_leaves_no_checkpoint_and_a_redrain_commits(tmp_path: Path) -> None:
    base = tmp_path / "run"
    (base / "persistent").mkdir(parents=True)
    outcomes = run_ranks(
        2, _drain_where_a_rank_dies, str(base), True, outbox=tmp_path / "crash", allow_unfinished=frozenset({1})
    )
    assert outcomes[0] == ("ok", {"state": "raised", "error": "GroupBrokenError"}), outcomes[0]
    assert 1 not in outcomes or outcomes[1][0] == "error"
    assert not (base / "persistent" / NAME).exists()
    before = {node: snapshot(base / f"node{node}") for node in (0, 1)}
    recovery = recover_drains(base / "persistent", [NAME])
    assert recovery.redrain == [NAME] and os.listdir(base / "persistent") == [], recovery
    results = results_or_raise(run_ranks(2, _drain_where_a_rank_dies, str(base), False, outbox=tmp_path / "again"))
    assert [result["state"] for result in results] == ["committed", "committed"], results
    assert sk.verify(base / "persistent" / NAME).ok
    assert {node: snapshot(base / f"node{node}") for node in (0, 1)} == before
