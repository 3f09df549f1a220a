"""save_batch / load_batch / iter_batches: a batch is saved with shardkeep.save, then recorded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import shardkeep as sk
from shardkeep.batches import batch_path
from shardkeep.errors import LedgerStateError, UnsafePathError


@pytest.fixture
def ledger(tmp_path: Path) -> sk.ProgressLedger:
    ledger = sk.ProgressLedger(tmp_path / "job" / "progress.json", 2)
    ledger.initialize()
    return ledger


def result(batch: int) -> dict[str, object]:
    return {"embeddings": torch.full((4, 3), float(batch)), "batch": batch}


def test_saved_batches_are_recorded_and_load_back(ledger: sk.ProgressLedger) -> None:
    for batch in range(3):
        manifest = sk.save_batch(ledger, result(batch), shard=1, batch_idx=batch, num_sequences=4, worker=1)
        assert manifest.files
    info = ledger.get_resume_info(1)
    assert info["resume_from_batch"] == 3
    assert info["last_checkpoint_file"] == "shard_00001/batch_00000002"
    assert sk.verify(batch_path(ledger, 1, 2)).ok
    loaded = sk.load_batch(ledger, 1, 1)
    assert torch.equal(loaded["embeddings"], torch.full((4, 3), 1.0))
    assert [batch for batch, _ in sk.iter_batches(ledger, 1)] == [0, 1, 2]
    with pytest.raises(LedgerStateError, match="batch 5 of shard 1 is not recorded"):
        sk.load_batch(ledger, 1, 5)


def test_a_recorded_batch_is_never_saved_again(ledger: sk.ProgressLedger) -> None:
    sk.save_batch(ledger, result(0), shard=0, batch_idx=0, num_sequences=4)
    with pytest.raises(LedgerStateError, match="batch 0 is done"):
        sk.save_batch(ledger, result(99), shard=0, batch_idx=0, num_sequences=4)
    assert torch.equal(sk.load_batch(ledger, 0, 0)["embeddings"], torch.zeros(4, 3))


def test_a_committed_but_unrecorded_batch_is_replaced(ledger: sk.ProgressLedger) -> None:
    """A worker killed between shardkeep.save and the ledger update left a committed batch that
    the ledger does not name: the resumed worker redoes it and replaces it."""
    sk.save(result(7), batch_path(ledger, 0, 0))
    sk.save_batch(ledger, result(0), shard=0, batch_idx=0, num_sequences=4)
    assert torch.equal(sk.load_batch(ledger, 0, 0)["embeddings"], torch.zeros(4, 3))
    assert sorted(p.name for p in batch_path(ledger, 0, 0).parent.iterdir()) == ["batch_00000000"]


def test_a_reassigned_shard_refuses_the_old_worker_before_writing(ledger: sk.ProgressLedger) -> None:
    ledger.reassign_shard(1, 0)
    with pytest.raises(LedgerStateError, match="assigned to worker 0, not worker 1"):
        sk.save_batch(ledger, result(0), shard=1, batch_idx=0, num_sequences=4, worker=1)
    assert not batch_path(ledger, 1, 0).exists()
    sk.save_batch(ledger, result(0), shard=1, batch_idx=0, num_sequences=4, worker=0)
    assert ledger.get_resume_info(1)["resume_from_batch"] == 1


def test_paths_outside_the_checkpoint_directory_are_refused(ledger: sk.ProgressLedger, tmp_path: Path) -> None:
    with pytest.raises(UnsafePathError, match="outside the checkpoint directory"):
        sk.save_batch(ledger, result(0), shard=0, batch_idx=0, num_sequences=4, path=tmp_path / "elsewhere")
    assert not (tmp_path / "elsewhere").exists()
    with pytest.raises(LedgerStateError, match="unknown shard 5"):
        sk.save_batch(ledger, result(0), shard=5, batch_idx=0, num_sequences=4)


def test_cleanup_removes_batches_and_iteration_skips_them(ledger: sk.ProgressLedger) -> None:
    for shard in (0, 1):
        for batch in range(3):
            sk.save_batch(ledger, result(batch), shard=shard, batch_idx=batch, num_sequences=4)
        ledger.mark_shard_complete(shard)
    assert ledger.cleanup_checkpoints() == 4
    assert [batch for batch, _ in sk.iter_batches(ledger, 0)] == [2]
    assert not batch_path(ledger, 0, 0).exists()
    with pytest.raises(LedgerStateError, match="removed by cleanup_checkpoints"):
        sk.load_batch(ledger, 0, 0)
