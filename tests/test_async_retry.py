"""``CheckpointManager.async_save`` under ``retry=``: a transient failure of the background
write or commit is retried from the snapshot (one process, and 2 real gloo ranks with the fault
on one rank), every rank together or none, each retry logged; a permanent one is not retried;
the error that ends the retries comes out of ``result()`` on every rank; what commits is the
snapshot, bit for bit."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import Any

import pytest

import shardkeep as sk
from shardkeep.storage.local import LocalStore
from shardkeep.testing import FaultInjectingStore, InjectedFault
from tests.support.distributed_harness import results_or_raise, run_ranks
from tests.support.observe import logged_messages
from tests.test_retry import QUICK, FailingWrites, LostCommitAnswer, committed

torch = pytest.importorskip("torch")


def _state(seed: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, generator=generator), "b": torch.randn(8, generator=generator), "step": seed}


def _no_leftovers(root: Path) -> bool:
    return not [name for name in os.listdir(root) if ".tmp" in name or "attempt" in name]


def test_a_transient_failure_is_retried_from_the_snapshot(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = FailingWrites(LocalStore(tmp_path), times=1)
    manager = sk.CheckpointManager(tmp_path, storage=store, keep_best=0, retry=QUICK)
    state = _state(1)
    expected = {key: value.clone() for key, value in state.items() if isinstance(value, torch.Tensor)}
    with caplog.at_level(logging.WARNING, logger="shardkeep.retry"):
        pending = manager.async_save(state, step=1)
        state["w"].add_(1.0)  # the live state moves on: the snapshot is what is saved, and saved again
        entry = pending.result(timeout=60)
    assert entry.step == 1 and committed(tmp_path) == ["step_00000001"] and _no_leftovers(tmp_path)
    assert sk.verify(tmp_path / "step_00000001").ok
    loaded = sk.load(tmp_path / "step_00000001")
    for key, value in expected.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key].view(torch.uint8), value.view(torch.uint8))
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 1 and "the async save of step 1" in lines[0] and "attempt 1 of 3" in lines[0], lines
    assert store.left == 0


def test_a_failure_after_the_commit_point_keeps_the_commit(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = LostCommitAnswer(LocalStore(tmp_path))
    manager = sk.CheckpointManager(tmp_path, storage=store, keep_last=2, keep_best=0, retry=QUICK)
    with caplog.at_level(logging.WARNING, logger="shardkeep"):
        entry = manager.async_save(_state(1), step=1).result(timeout=60)
    assert store.lost == 1 and entry.step == 1 and committed(tmp_path) == ["step_00000001"]
    assert any("committed by the attempt that failed" in record.getMessage() for record in caplog.records)
    assert sk.verify(tmp_path / "step_00000001").ok and _no_leftovers(tmp_path)
    assert torch.equal(sk.load(tmp_path / "step_00000001")["w"], _state(1)["w"])


def test_a_permanent_failure_is_not_retried(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = FailingWrites(LocalStore(tmp_path), code=errno.EACCES, times=1)
    manager = sk.CheckpointManager(tmp_path, storage=store, keep_best=0, retry=QUICK)
    with caplog.at_level(logging.WARNING, logger="shardkeep.retry"):
        pending = manager.async_save(_state(1), step=1)
        with pytest.raises(sk.StorageError, match="permission denied"):
            pending.result(timeout=60)
    assert not caplog.records and committed(tmp_path) == [] and _no_leftovers(tmp_path)


def test_exhausted_attempts_raise_from_result(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = FailingWrites(LocalStore(tmp_path))
    manager = sk.CheckpointManager(tmp_path, storage=store, keep_best=0, retry=QUICK)
    with caplog.at_level(logging.WARNING, logger="shardkeep.retry"):
        pending = manager.async_save(_state(1), step=1)
        with pytest.raises(InjectedFault) as caught:
            pending.result(timeout=60)
    assert any("failed 3 times" in note for note in caught.value.__notes__)
    assert len(caplog.records) == 2 and committed(tmp_path) == [] and _no_leftovers(tmp_path)
    assert store.left == 1_000_000 - 3
    with pytest.raises(InjectedFault):  # wait() gives the same error, once
        manager.wait()
    # The manager goes on: the next save commits.
    store.left = 0
    assert manager.async_save(_state(2), step=2).result(timeout=60).step == 2


def test_without_a_policy_an_async_save_fails_at_once(tmp_path: Path) -> None:
    store = FailingWrites(LocalStore(tmp_path), times=1)
    manager = sk.CheckpointManager(tmp_path, storage=store, keep_best=0)
    with pytest.raises(InjectedFault):
        manager.async_save(_state(1), step=1).result(timeout=60)
    assert committed(tmp_path) == []


# -- two real gloo ranks -------------------------------------------------------------------------


def _retry_log() -> list[str]:
    return logged_messages("shardkeep.retry")


def _rank_state(rank: int) -> dict[str, Any]:
    return {"rank_part": {f"r{rank}": torch.arange(64, dtype=torch.float32) + rank}, "shared": torch.ones(8)}


def _async_with_faults(
    rank: int, world_size: int, root: str, codes: dict[int, int], after: int, times: int
) -> dict[str, Any]:
    messages = _retry_log()
    inner = LocalStore(root)
    store = (
        FailingWrites(inner, code=codes[rank], times=times, after=after)
        if rank in codes
        else FaultInjectingStore(inner)
    )
    manager = sk.CheckpointManager(root, storage=store, keep_last=2, keep_best=0, retry=QUICK, timeout=60)
    state = _rank_state(rank)
    pending = manager.async_save(state, step=1)
    state["rank_part"][f"r{rank}"].mul_(-1)  # the snapshot is saved, not the live tensor
    try:
        entry = pending.result(timeout=120)
        outcome: dict[str, Any] = {"step": entry.step, "error": None}
    except sk.ShardkeepError as exc:
        outcome = {"step": None, "error": type(exc).__name__, "notes": getattr(exc, "__notes__", [])}
    outcome["retries"] = messages
    # The training thread's own collectives still work after the background ones.
    outcome["next"] = manager.save(_rank_state(rank), step=2).step if outcome["error"] is None else None
    return outcome


@pytest.mark.parametrize(
    ("codes", "after", "times", "retried"),
    [
        ({1: errno.EIO}, 0, 1, True),  # rank 1's data write fails once: both ranks retry once
        ({0: errno.EIO}, 1, 1, True),  # the coordinator's manifest write fails once
        ({1: errno.EACCES}, 0, 1, False),  # permanent: nobody retries
        ({1: errno.EIO}, 0, 1_000_000, False),  # attempts exhausted: the error on every rank
    ],
)
def test_two_ranks_retry_an_async_save_together(
    tmp_path: Path, codes: dict[int, int], after: int, times: int, retried: bool
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    outcomes = run_ranks(2, _async_with_faults, str(root), codes, after, times, outbox=tmp_path / "out", timeout=240)
    results = results_or_raise(outcomes)
    if retried:
        assert [result["step"] for result in results] == [1, 1], results
        assert [result["next"] for result in results] == [2, 2], results
        for result in results:
            assert len(result["retries"]) == 1 and "attempt 1 of 3" in result["retries"][0], results
            assert "the async save of step 1" in result["retries"][0]
        assert committed(root) == ["step_00000001", "step_00000002"] and _no_leftovers(root)
        assert sk.verify(root / "step_00000001").ok
        loaded = sk.load(root / "step_00000001")
        for rank in range(2):
            expected = _rank_state(rank)["rank_part"][f"r{rank}"]
            assert torch.equal(loaded["rank_part"][f"r{rank}"].view(torch.uint8), expected.view(torch.uint8))
        return
    errors = {result["error"] for result in results}
    assert len(errors) == 1 and results[0]["error"], results
    assert committed(root) == [] and _no_leftovers(root)
    if times == 1:  # permanent
        assert [result["retries"] for result in results] == [[], []]
    else:  # exhausted: two retries logged on every rank, the last error noted
        assert [len(result["retries"]) for result in results] == [2, 2], results
        assert all(any("failed 3 times" in note for note in result["notes"]) for result in results), results
