"""save_batch / load_batch / iter_batches: a batch is saved with shardkeep.save, then recorded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import shardkeep as sk
from shardkeep.errors import CheckpointExistsError, LedgerStateError, UnsafePathError
from shardkeep.ledger.batches import new_batch_path


@pytest.fixture
def ledger(tmp_path: Path) -> sk.ProgressLedger:
    ledger = sk.ProgressLedger(tmp_path / "job" / "progress.json", 2)
    ledger.initialize()
    return ledger


def result(batch: int) -> dict[str, object]:
    return {"embeddings": torch.full((4, 3), float(batch)), "batch": batch}


def recorded_path(ledger: sk.ProgressLedger, shard: int) -> Path:
    return ledger.resolve_file(ledger.resume_info(shard)["last_checkpoint_file"])[1]


def test_saved_batches_are_recorded_and_load_back(ledger: sk.ProgressLedger) -> None:
    claim = ledger.claim_shard(1, 1)
    for batch in range(3):
        manifest = sk.save_batch(
            ledger, result(batch), shard=1, batch_idx=batch, num_sequences=4, worker=1, claim=claim
        )
        assert manifest.files
    info = ledger.resume_info(1)
    assert info["resume_from_batch"] == 3
    assert info["last_checkpoint_file"].startswith("shard_00001/batch_00000002-")
    assert sk.verify(recorded_path(ledger, 1)).ok
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
    assert len(list(recorded_path(ledger, 0).parent.iterdir())) == 1


def test_a_reused_path_is_refused_and_the_recorded_batch_kept(ledger: sk.ProgressLedger) -> None:
    latest = ledger.checkpoint_dir / "latest"
    sk.save_batch(ledger, result(0), shard=0, batch_idx=0, num_sequences=4, path=latest)
    with pytest.raises(CheckpointExistsError):
        sk.save_batch(ledger, result(1), shard=0, batch_idx=1, num_sequences=4, path=latest)
    assert torch.equal(sk.load_batch(ledger, 0, 0)["embeddings"], torch.zeros(4, 3))
    assert ledger.resume_info(0)["resume_from_batch"] == 1


def test_a_committed_but_unrecorded_attempt_is_left_for_cleanup(ledger: sk.ProgressLedger) -> None:
    """A worker killed between shardkeep.save and the ledger update left a committed attempt that
    the ledger does not name: the resumed worker redoes the batch under a new name; cleanup
    removes the orphaned attempt once its lease has passed."""
    orphan = new_batch_path(ledger, 0, 0)
    sk.save(result(7), orphan)
    sk.save_batch(ledger, result(0), shard=0, batch_idx=0, num_sequences=4)
    assert torch.equal(sk.load_batch(ledger, 0, 0)["embeddings"], torch.zeros(4, 3))
    assert orphan.exists()
    for shard in (0, 1):
        ledger.mark_shard_complete(shard)
    ledger.cleanup_checkpoints()
    assert orphan.exists()  # younger than the lease: it may belong to a running save
    ledger.cleanup_checkpoints(lease=0)
    assert not orphan.exists()
    assert sk.verify(recorded_path(ledger, 0)).ok  # the recorded batch is kept


def test_a_reassigned_shard_refuses_the_old_worker_before_writing(ledger: sk.ProgressLedger) -> None:
    old_claim = ledger.claim_shard(1, 1)
    ledger.reassign_shard(1, 0)
    with pytest.raises(LedgerStateError, match="assigned to worker 0, not worker 1"):
        sk.save_batch(ledger, result(0), shard=1, batch_idx=0, num_sequences=4, worker=1, claim=old_claim)
    assert not (ledger.checkpoint_dir / "shard_00001").exists()
    claim = ledger.claim_shard(1, 0)
    sk.save_batch(ledger, result(0), shard=1, batch_idx=0, num_sequences=4, worker=0, claim=claim)
    assert ledger.resume_info(1)["resume_from_batch"] == 1


def test_a_replaced_process_with_the_same_rank_is_fenced_by_its_claim(ledger: sk.ProgressLedger) -> None:
    """A hung worker 0 is restarted as worker 0: only the new process's claim is accepted."""
    hung = ledger.claim_shard(0, 0)
    restarted = ledger.claim_shard(0, 0)
    assert restarted == hung + 1
    with pytest.raises(LedgerStateError, match="claimed again"):
        sk.save_batch(ledger, result(0), shard=0, batch_idx=0, num_sequences=4, worker=0, claim=hung)
    name = ledger.resolve_file(new_batch_path(ledger, 0, 0))[0]
    sk.save(result(0), ledger.checkpoint_dir / name)
    with pytest.raises(LedgerStateError, match="claimed again"):
        ledger.update_shard_checkpoint(0, 0, 4, name, worker=0, claim=hung)
    with pytest.raises(LedgerStateError, match="claimed again"):
        ledger.mark_shard_complete(0, worker=0, claim=hung)
    ledger.update_shard_checkpoint(0, 0, 4, name, worker=0, claim=restarted)
    ledger.mark_shard_complete(0, worker=0, claim=restarted)
    assert ledger.completed_shards() == [0]


def test_paths_outside_the_checkpoint_directory_are_refused(ledger: sk.ProgressLedger, tmp_path: Path) -> None:
    with pytest.raises(UnsafePathError, match="outside the checkpoint directory"):
        sk.save_batch(ledger, result(0), shard=0, batch_idx=0, num_sequences=4, path=tmp_path / "elsewhere")
    assert not (tmp_path / "elsewhere").exists()
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "data.bin").write_bytes(b"keep me")
    os.symlink(tmp_path / "precious", ledger.checkpoint_dir / "link")
    with pytest.raises(UnsafePathError, match="outside the checkpoint directory"):
        ledger.update_shard_checkpoint(0, 0, 1, "link/data.bin")
    with pytest.raises(UnsafePathError):
        sk.save_batch(ledger, result(0), shard=0, batch_idx=0, num_sequences=4, path=ledger.checkpoint_dir / "link/x")
    assert sorted(p.name for p in (tmp_path / "precious").iterdir()) == ["data.bin"]
    with pytest.raises(LedgerStateError, match="unknown shard 5"):
        sk.save_batch(ledger, result(0), shard=5, batch_idx=0, num_sequences=4)


def test_cleanup_removes_batches_and_iteration_skips_them(ledger: sk.ProgressLedger) -> None:
    for shard in (0, 1):
        for batch in range(3):
            sk.save_batch(ledger, result(batch), shard=shard, batch_idx=batch, num_sequences=4)
        ledger.mark_shard_complete(shard)
    assert ledger.cleanup_checkpoints() == 4
    assert [batch for batch, _ in sk.iter_batches(ledger, 0)] == [2]
    assert len(list((ledger.checkpoint_dir / "shard_00000").iterdir())) == 1
    with pytest.raises(LedgerStateError, match="removed by cleanup_checkpoints"):
        sk.load_batch(ledger, 0, 0)


def test_the_old_import_path_is_the_same_module() -> None:
    """``shardkeep.batches`` is the module ``shardkeep.ledger.batches`` itself (so patching either
    patches what ``sk.save_batch`` calls)."""
    import shardkeep.batches as old
    import shardkeep.ledger.batches as moved

    assert old is moved
    assert sk.save_batch is moved.save_batch and old.new_batch_path is new_batch_path
