"""ProgressLedger, one process: operations, refusals, on-disk format, recovery, crash windows."""

from __future__ import annotations

import fcntl
import json
import logging
import multiprocessing
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import shardkeep as sk
from shardkeep.errors import (
    BatchFileMissingError,
    LedgerLockTimeoutError,
    LedgerNotFoundError,
    LedgerStateError,
    ShardkeepError,
    StorageError,
    UnsafePathError,
    UnsupportedValueError,
)
from shardkeep.ledger import (
    LedgerLockWarning,
    ProgressLedger,
    checked_sequence,
    filesystem_type,
)
from shardkeep.storage import localfs
from shardkeep.storage.localfs import LocalFS


class FakeClock:
    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def make_ledger(tmp_path: Path, world_size: int = 4, **options: Any) -> ProgressLedger:
    ledger = ProgressLedger(tmp_path / "progress.json", world_size, **options)
    ledger.initialize()
    return ledger


def batch_file(tmp_path: Path, shard: int, batch: int) -> str:
    name = f"shard_{shard}/batch_{batch:05d}.bin"
    path = tmp_path / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(b"result")
    return name


def record(ledger: ProgressLedger, tmp_path: Path, shard: int, batch: int, sequences: int = 10) -> None:
    ledger.update_shard_checkpoint(shard, batch, sequences, batch_file(tmp_path, shard, batch))


# --------------------------------------------------------------------------------------------
# Lifecycle and compatibility


def test_initialize_creates_one_in_progress_shard_per_worker(tmp_path: Path) -> None:
    ledger = ProgressLedger(tmp_path / "run" / "progress.json", 3)
    assert not ledger.exists()
    document = ledger.initialize(input_fingerprint="in-1", model_config_hash="model-1")
    assert ledger.exists()
    assert document["version"] == "2.0"
    assert document["world_size"] == 3
    assert document["input_fingerprint"] == "in-1"
    on_disk = json.loads((tmp_path / "run" / "progress.json").read_text())
    assert list(on_disk)[:2] == ["checksum", "sequence"]
    assert on_disk["shards"]["2"] == {
        "status": "in_progress",
        "original_rank": 2,
        "assigned_rank": 2,
        "last_checkpoint_batch": -1,
        "total_sequences": 0,
        "last_checkpoint_time": None,
        "retry_count": 0,
        "error": None,
        "checkpoints": [],
        "completed_at": None,
        "failed_at": None,
        "reassignments": [],
        "claim": 0,
        "claimed_at": None,
    }
    assert ledger.incomplete_shards() == [0, 1, 2]
    assert ledger.completed_shards() == []


def test_the_names_of_the_original_design_are_the_ledger_methods(tmp_path: Path) -> None:
    """``manifest_path``, ``archive_manifest`` and the ``get_*`` queries keep working: each is the
    ledger's own name under another spelling, with the same result."""
    ledger = make_ledger(tmp_path, 2)
    assert ledger.manifest_path == ledger.path == tmp_path / "progress.json"
    aliases = {
        "archive_manifest": "archive",
        "get_shard_status": "shard_status",
        "get_incomplete_shard_ranks": "incomplete_shards",
        "get_resumable_shards": "incomplete_shards",
        "get_completed_shards": "completed_shards",
        "get_assigned_shards": "assigned_shards",
        "get_resume_info": "resume_info",
        "get_resume_points": "resume_points",
        "get_orphaned_shards": "orphaned_shards",
        "get_global_progress": "progress",
        "get_latest_global_checkpoint": "latest_global_checkpoint",
    }
    for old, new in aliases.items():
        assert getattr(ProgressLedger, old) is getattr(ProgressLedger, new), old
    record(ledger, tmp_path, 1, 0)
    assert ledger.get_resume_info(1) == ledger.resume_info(1) and ledger.resume_info(1)["resume_from_batch"] == 1
    assert ledger.get_global_progress() == ledger.progress()


def test_initialize_again_keeps_progress_and_fills_missing_metadata(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path)
    record(ledger, tmp_path, 1, 0)
    again = ProgressLedger(tmp_path / "progress.json", 4)
    document = again.initialize(input_fingerprint="in-1")
    assert document["shards"]["1"]["last_checkpoint_batch"] == 0
    assert again.read().input_fingerprint == "in-1"
    assert again.resume_info(1)["resume_from_batch"] == 1


def test_initialize_overwrite_starts_afresh_with_a_higher_sequence(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path)
    record(ledger, tmp_path, 1, 0)
    before = ledger.read().sequence
    ledger.initialize(overwrite=True)
    state = ledger.read()
    assert state.sequence == before + 1
    assert state.shards["1"].checkpoints == []
    # The backup holds the old version, with a lower sequence: it never wins recovery.
    assert checked_sequence(ledger.backup_path.read_bytes()) == before


def test_run_mismatch_gives_a_readable_diff(tmp_path: Path) -> None:
    ledger = ProgressLedger(tmp_path / "progress.json", 4)
    ledger.initialize(input_fingerprint="sha256:aaa", model_config_hash="cfg-1")
    ok, messages = ledger.validate_run_compatibility("sha256:aaa", "cfg-1")
    assert (ok, messages) == (True, [])
    ok, messages = ledger.validate_run_compatibility("sha256:bbb", "cfg-2")
    assert not ok
    assert len(messages) == 2
    assert "input_fingerprint mismatch: recorded 'sha256:aaa', current 'sha256:bbb'" in messages[0]
    assert "model_config_hash" in messages[1]
    with pytest.raises(sk.LedgerMismatchError) as caught:
        ledger.check_run_compatibility("sha256:bbb", "cfg-1")
    assert caught.value.differences == [("input_fingerprint", "sha256:aaa", "sha256:bbb")]
    with pytest.raises(sk.LedgerMismatchError) as caught:
        ProgressLedger(tmp_path / "progress.json", 8).initialize(input_fingerprint="sha256:bbb")
    text = str(caught.value)
    assert "world_size: recorded '4', now '8'" in text
    assert "input_fingerprint: recorded 'sha256:aaa', now 'sha256:bbb'" in text
    assert ledger.read().input_fingerprint == "sha256:aaa"  # nothing changed
    ledger.set_global_metadata("sha256:bbb", "cfg-2")
    assert ledger.validate_run_compatibility("sha256:bbb", "cfg-2") == (True, [])


def test_opening_with_the_wrong_world_size_is_refused(tmp_path: Path) -> None:
    make_ledger(tmp_path, 4)
    with pytest.raises(sk.LedgerMismatchError, match="world_size 4"):
        ProgressLedger(tmp_path / "progress.json", 2).progress()
    assert ProgressLedger(tmp_path / "progress.json").progress()["total_shards"] == 4


def test_reading_a_missing_ledger_says_to_initialize(tmp_path: Path) -> None:
    ledger = ProgressLedger(tmp_path / "progress.json", 2)
    with pytest.raises(LedgerNotFoundError, match="initialize"):
        ledger.progress()
    with pytest.raises(FileNotFoundError):  # the seed's callers catch this
        ledger.mark_shard_complete(0)


def test_bad_options_are_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedValueError, match="world_size"):
        ProgressLedger(tmp_path / "p.json", 0)
    with pytest.raises(UnsupportedValueError, match="staleness_threshold_sec"):
        ProgressLedger(tmp_path / "p.json", 2, staleness_threshold_sec=0)
    with pytest.raises(UnsupportedValueError, match="max_retries"):
        ProgressLedger(tmp_path / "p.json", 2, max_retries=0)
    with pytest.raises(UnsupportedValueError, match="needs a world_size"):
        ProgressLedger(tmp_path / "p.json").initialize()


# --------------------------------------------------------------------------------------------
# Shard updates


def test_update_records_batches_and_resume_info(tmp_path: Path) -> None:
    clock = FakeClock()
    ledger = make_ledger(tmp_path, clock=clock)
    ledger.update_shard_checkpoint(2, 0, 100, batch_file(tmp_path, 2, 0), "seq_0-seq_99")
    clock.now += 5
    ledger.update_shard_checkpoint(2, 1, 50, batch_file(tmp_path, 2, 1))
    status = ledger.shard_status(2)
    assert status is not None
    assert status["last_checkpoint_batch"] == 1
    assert status["total_sequences"] == 150
    assert [c["batch_idx"] for c in status["checkpoints"]] == [0, 1]
    assert status["checkpoints"][0]["sequence_range"] == "seq_0-seq_99"
    assert status["checkpoints"][0]["file"] == "shard_2/batch_00000.bin"
    info = ledger.resume_info(2)
    assert info["resume_from_batch"] == 2
    assert info["last_completed_batch"] == 1
    assert info["last_checkpoint_file"] == "shard_2/batch_00001.bin"
    assert info["total_sequences_completed"] == 150
    assert info["last_checkpoint_time"].startswith("2027-01-15T08:00:05")
    assert ledger.resume_info(0)["resume_from_batch"] == 0
    assert ledger.resume_info(99) == {"rank": 99, "status": "unknown"}
    assert ledger.shard_status(99) is None
    assert ledger.resume_points() == {0: 0, 1: 0, 2: 2, 3: 0}


def test_update_refuses_a_missing_file_and_records_nothing(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path)
    sequence = ledger.read().sequence
    with pytest.raises(BatchFileMissingError, match="does not exist") as caught:
        ledger.update_shard_checkpoint(0, 0, 10, "shard_0/never_written.pt")
    assert isinstance(caught.value, FileNotFoundError)
    assert isinstance(caught.value, ShardkeepError)
    (tmp_path / "half_saved").mkdir()
    with pytest.raises(BatchFileMissingError, match="without a committed manifest"):
        ledger.update_shard_checkpoint(0, 0, 10, "half_saved")
    assert ledger.read().sequence == sequence
    assert ledger.shard_status(0)["checkpoints"] == []  # type: ignore[index]


def test_update_accepts_absolute_paths_inside_and_refuses_escapes(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path / "job")
    name = batch_file(tmp_path / "job", 0, 0)
    ledger.update_shard_checkpoint(0, 0, 1, tmp_path / "job" / name)
    assert ledger.resume_info(0)["last_checkpoint_file"] == name
    (tmp_path / "outside.bin").write_bytes(b"x")
    for bad in ("../outside.bin", str(tmp_path / "outside.bin"), "a/../../outside.bin", ""):
        with pytest.raises(UnsafePathError):
            ledger.update_shard_checkpoint(0, 1, 1, bad)


def test_update_refuses_regressions_finished_shards_and_unknown_shards(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path)
    record(ledger, tmp_path, 0, 0)
    record(ledger, tmp_path, 0, 3)  # gaps are allowed
    sequence = ledger.read().sequence
    record(ledger, tmp_path, 0, 3)  # the same batch and file again: a retried call, a no-op
    assert ledger.read().sequence == sequence
    with pytest.raises(LedgerStateError, match="resume from batch 4") as caught:
        record(ledger, tmp_path, 0, 2)
    assert caught.value.shard == 0
    with pytest.raises(LedgerStateError, match="unknown shard 7"):
        record(ledger, tmp_path, 7, 0)
    ledger.mark_shard_complete(0)
    with pytest.raises(LedgerStateError, match="complete"):
        record(ledger, tmp_path, 0, 4)
    with pytest.raises(UnsupportedValueError, match="batch_idx"):
        ledger.update_shard_checkpoint(1, -1, 1, batch_file(tmp_path, 1, 0))
    with pytest.raises(UnsupportedValueError, match="num_sequences"):
        ledger.update_shard_checkpoint(1, 0, True, batch_file(tmp_path, 1, 0))
    assert ledger.shard_status(0)["last_checkpoint_batch"] == 3  # type: ignore[index]


def test_complete_and_failed_count_retries(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path)
    record(ledger, tmp_path, 1, 0)
    ledger.mark_shard_failed(1, "CUDA out of memory")
    status = ledger.shard_status(1)
    assert status is not None
    assert (status["status"], status["retry_count"], status["error"]) == ("failed", 1, "CUDA out of memory")
    assert status["failed_at"] is not None
    assert ledger.incomplete_shards() == [0, 1, 2, 3]
    assert ledger.get_resumable_shards() == [0, 1, 2, 3]
    # A retry that records a batch is in progress again; the failure count stays.
    record(ledger, tmp_path, 1, 1)
    assert ledger.shard_status(1)["status"] == "in_progress"  # type: ignore[index]
    assert ledger.shard_status(1)["retry_count"] == 1  # type: ignore[index]
    ledger.mark_shard_complete(1)
    ledger.mark_shard_complete(1)  # idempotent
    assert ledger.completed_shards() == [1]
    assert ledger.incomplete_shards() == [0, 2, 3]
    with pytest.raises(LedgerStateError, match="complete"):
        ledger.mark_shard_failed(1, "late error from a zombie")
    progress = ledger.progress()
    assert (progress["completed"], progress["in_progress"], progress["failed"]) == (1, 3, 0)
    assert progress["total_sequences_checkpointed"] == 20
    assert progress["total_batches"] == 2


# --------------------------------------------------------------------------------------------
# Staleness, reassignment, orphans, barriers


def test_staleness_uses_the_injected_clock_and_threshold(tmp_path: Path) -> None:
    clock = FakeClock()
    ledger = make_ledger(tmp_path, clock=clock, staleness_threshold_sec=600)
    record(ledger, tmp_path, 0, 0)
    record(ledger, tmp_path, 1, 0)
    clock.now += 300
    record(ledger, tmp_path, 1, 1)
    assert ledger.progress()["stale_shards"] == []
    clock.now += 301  # shard 0: 601 s since its last batch; shard 1: 301 s
    assert ledger.is_shard_stale(0)
    assert not ledger.is_shard_stale(1)
    assert ledger.is_shard_stale(1, threshold_sec=300)
    assert not ledger.is_shard_stale(2)  # no batch yet: maybe still starting up
    assert not ledger.is_shard_stale(42)
    progress = ledger.progress()
    assert (progress["stale"], progress["stale_shards"]) == (1, [0])
    assert ledger.resume_info(0)["stale"] is True
    clock.now += 300
    assert ledger.progress()["stale_shards"] == [0, 1]
    # Finished and failed shards are never stale.
    ledger.mark_shard_complete(0)
    ledger.mark_shard_failed(1, "hung")
    assert ledger.progress()["stale_shards"] == []
    # The default threshold is ten minutes.
    assert ProgressLedger(tmp_path / "progress.json").staleness_threshold_sec == 600


def test_reassign_keeps_the_original_rank_and_fences_the_old_worker(tmp_path: Path) -> None:
    clock = FakeClock()
    ledger = make_ledger(tmp_path, clock=clock)
    ledger.update_shard_checkpoint(2, 0, 10, batch_file(tmp_path, 2, 0), worker=2)
    clock.now += 1000  # worker 2 hangs
    assert ledger.progress()["stale_shards"] == [2]
    ledger.reassign_shard(2, 0)
    status = ledger.shard_status(2)
    assert status is not None
    assert (status["original_rank"], status["assigned_rank"]) == (2, 0)
    assert status["reassignments"][0]["from_rank"] == 2
    assert ledger.progress()["stale_shards"] == []  # the reassignment is activity
    assert ledger.assigned_shards(0) == [0, 2]
    assert ledger.assigned_shards(2) == []
    # The hung worker wakes up: its update is refused; the new owner's is accepted.
    with pytest.raises(LedgerStateError, match="assigned to worker 0, not worker 2"):
        ledger.update_shard_checkpoint(2, 1, 10, batch_file(tmp_path, 2, 1), worker=2)
    with pytest.raises(LedgerStateError, match="not worker 2"):
        ledger.mark_shard_complete(2, worker=2)
    ledger.update_shard_checkpoint(2, 1, 10, batch_file(tmp_path, 2, 1), worker=0)
    assert ledger.resume_info(2)["resume_from_batch"] == 2
    with pytest.raises(LedgerStateError, match=r"workers are 0\.\.3"):
        ledger.reassign_shard(2, 4)
    ledger.mark_shard_complete(2, worker=0)
    with pytest.raises(LedgerStateError, match="nothing to reassign"):
        ledger.reassign_shard(2, 1)
    assert ledger.shard_status(2)["original_rank"] == 2  # type: ignore[index]


def test_orphans_are_failed_three_times_and_reassignment_revives_them(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path)
    record(ledger, tmp_path, 3, 0)
    for attempt in range(2):
        ledger.mark_shard_failed(3, f"attempt {attempt}")
    assert ledger.orphaned_shards() == []
    ledger.mark_shard_failed(3, "attempt 2")
    assert ledger.orphaned_shards() == [3]
    progress = ledger.progress()
    assert (progress["orphaned"], progress["orphaned_shards"], progress["failed"]) == (1, [3], 1)
    ledger.reassign_shard(3, 1)
    assert ledger.orphaned_shards() == []
    info = ledger.resume_info(3)
    assert (info["status"], info["assigned_rank"], info["retry_count"], info["resume_from_batch"]) == (
        "in_progress",
        1,
        3,
        1,
    )
    # A custom limit.
    assert ProgressLedger(tmp_path / "progress.json", max_retries=4).orphaned_shards() == []


def test_global_checkpoints_record_barriers_that_exist(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path, 2)
    assert ledger.latest_global_checkpoint() is None
    record(ledger, tmp_path, 0, 0)
    record(ledger, tmp_path, 1, 0)
    record(ledger, tmp_path, 1, 1)
    ledger.record_global_checkpoint("barrier_1", {0: 0, 1: 0})
    ledger.record_global_checkpoint("barrier_2", {0: 0, 1: 1})
    latest = ledger.latest_global_checkpoint()
    assert latest is not None
    assert (latest["checkpoint_id"], latest["batch_boundaries"]) == ("barrier_2", {"0": 0, "1": 1})
    with pytest.raises(LedgerStateError, match="already recorded"):
        ledger.record_global_checkpoint("barrier_2", {0: 0})
    with pytest.raises(LedgerStateError, match="claims batch 5 of shard 0"):
        ledger.record_global_checkpoint("barrier_3", {0: 5})
    with pytest.raises(LedgerStateError, match="unknown shard 9"):
        ledger.record_global_checkpoint("barrier_3", {9: 0})
    assert len(ledger.read().global_checkpoints) == 2


def test_archive_and_cleanup_after_completion(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path, 2)
    for batch in range(3):
        record(ledger, tmp_path, 0, batch)
        record(ledger, tmp_path, 1, batch)
    with pytest.raises(LedgerStateError, match=r"shards \[0, 1\] are not complete"):
        ledger.archive(tmp_path / "archive")
    with pytest.raises(LedgerStateError, match="not complete"):
        ledger.cleanup_checkpoints()
    # A leftover of an interrupted save next to the batch files.
    leftover = tmp_path / "shard_0" / "batch_00003.bin.tmp-0123abcd"
    leftover.mkdir()
    ledger.mark_shard_complete(0)
    ledger.mark_shard_complete(1)
    archived = ledger.archive(tmp_path / "archive")
    assert archived == tmp_path / "archive" / "progress_final.json"
    assert ProgressLedger(archived).progress()["completed"] == 2  # a valid ledger itself
    assert ledger.cleanup_checkpoints() == 4
    assert sorted(p.name for p in (tmp_path / "shard_0").iterdir()) == ["batch_00002.bin", leftover.name]
    # Leftovers go only once untouched for the lease (default one hour): a save may be running.
    two_hours_ago = time.time() - 7200
    os.utime(leftover, (two_hours_ago, two_hours_ago))
    assert ledger.cleanup_checkpoints() == 0
    assert sorted(p.name for p in (tmp_path / "shard_0").iterdir()) == ["batch_00002.bin"]
    status = ledger.shard_status(0)
    assert status is not None
    assert [c["removed_at"] is not None for c in status["checkpoints"]] == [True, True, False]
    assert ledger.cleanup_checkpoints(keep_final_only=False) == 2
    assert list((tmp_path / "shard_1").iterdir()) == []
    assert ledger.cleanup_checkpoints(keep_final_only=False) == 0


def test_cleanup_records_before_deleting_and_finishes_after_an_error(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path, 1)
    for batch in range(3):
        record(ledger, tmp_path, 0, batch)
    ledger.mark_shard_complete(0)

    class FailingDirectorySync(LocalFS):
        def fsync_directory(self, path: str) -> None:
            raise OSError(5, "Input/output error")

    files = sorted((tmp_path / "shard_0").iterdir())
    with pytest.raises(StorageError, match="may not survive a power loss"), localfs.using(FailingDirectorySync()):
        ledger.cleanup_checkpoints()
    assert all(path.exists() for path in files)  # the marking failed: nothing deleted yet
    assert ledger.cleanup_checkpoints() == 2
    assert [path.exists() for path in files] == [False, False, True]


def test_cleanup_keeps_a_file_that_a_kept_record_names(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path, 1)
    (tmp_path / "accumulated.bin").write_bytes(b"all results so far")
    for batch in range(3):
        ledger.update_shard_checkpoint(0, batch, 1, "accumulated.bin")
    ledger.mark_shard_complete(0)
    assert ledger.cleanup_checkpoints() == 0
    assert (tmp_path / "accumulated.bin").exists()


def test_cleanup_force_keeps_what_resume_needs(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path, 1)
    for batch in range(3):
        record(ledger, tmp_path, 0, batch)
    assert ledger.cleanup_checkpoints(keep_final_only=False, force=True) == 2
    assert (tmp_path / "shard_0" / "batch_00002.bin").exists()


# --------------------------------------------------------------------------------------------
# On-disk format, locking, recovery


def test_every_write_bumps_the_sequence_and_keeps_the_previous_as_backup(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path)
    lock_inode = os.stat(ledger.lock_path).st_ino
    sequences = []
    for batch in range(3):
        record(ledger, tmp_path, 0, batch)
        sequences.append(checked_sequence(ledger.path.read_bytes()))
        assert checked_sequence(ledger.backup_path.read_bytes()) == sequences[-1] - 1
        assert not ledger.tmp_path.exists()
    assert sequences == [2, 3, 4]
    assert os.stat(ledger.lock_path).st_ino == lock_inode  # never renamed or recreated


def test_any_edit_breaks_the_checksum(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path)
    raw = ledger.path.read_bytes()
    edited = raw.replace(b'"world_size":4', b'"world_size":5')
    assert edited != raw
    with pytest.raises(sk.LedgerError, match="checksum mismatch"):
        checked_sequence(edited)
    with pytest.raises(sk.LedgerError, match="no checksum header"):
        checked_sequence(raw[: len(raw) // 2].replace(b'"checksum"', b'"checksun"'))


def _corrupt(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x20
    path.write_bytes(bytes(raw))


def test_corrupted_primary_recovers_from_backup_and_is_repaired(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = make_ledger(tmp_path)
    record(ledger, tmp_path, 0, 0)
    record(ledger, tmp_path, 0, 1)
    _corrupt(ledger.path)
    with caplog.at_level(logging.WARNING, logger="shardkeep.ledger"):
        info = ledger.resume_info(0)
    assert info["resume_from_batch"] == 1  # the backup is the version before the last update
    assert "primary copy unusable" in caplog.text
    record(ledger, tmp_path, 0, 1)  # the worker redoes batch 1; the primary is rewritten
    assert checked_sequence(ledger.path.read_bytes()) == ledger.read().sequence
    assert ledger.resume_info(0)["resume_from_batch"] == 2


def test_torn_or_missing_primary_recovers(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path)
    record(ledger, tmp_path, 0, 0)
    raw = ledger.path.read_bytes()
    ledger.path.write_bytes(raw[: len(raw) // 3])
    assert ledger.read().sequence == 1  # the initialize version, from .backup
    ledger.path.unlink()
    assert ledger.read().sequence == 1


def test_corrupted_backup_is_ignored(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path)
    record(ledger, tmp_path, 0, 0)
    _corrupt(ledger.backup_path)
    assert ledger.resume_info(0)["resume_from_batch"] == 1
    record(ledger, tmp_path, 0, 1)
    assert checked_sequence(ledger.backup_path.read_bytes()) == ledger.read().sequence - 1


def test_all_copies_corrupted_raises_manifest_corrupted(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path)
    record(ledger, tmp_path, 0, 0)
    ledger.tmp_path.write_bytes(ledger.path.read_bytes()[:100])
    _corrupt(ledger.path)
    _corrupt(ledger.backup_path)
    with pytest.raises(sk.LedgerCorruptedError) as caught:
        ledger.progress()
    error = caught.value
    assert isinstance(error, ShardkeepError)
    assert error.ledger_path == error.manifest_path == str(ledger.path)
    assert set(error.problems) == {str(ledger.path), str(ledger.tmp_path), str(ledger.backup_path)}
    assert "no valid copy" in str(error)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    with pytest.raises(sk.LedgerCorruptedError):
        record(ledger, tmp_path, 0, 1)
    with pytest.raises(sk.LedgerCorruptedError):
        ledger.initialize()
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    assert before == after  # nothing was overwritten
    ledger.initialize(overwrite=True)
    assert ledger.progress()["total_batches"] == 0


def test_a_valid_tmp_with_a_higher_sequence_wins(tmp_path: Path) -> None:
    """A writer that died after fsyncing .tmp but before the rename: that version is adopted."""
    ledger = make_ledger(tmp_path)
    record(ledger, tmp_path, 0, 0)
    old_primary = ledger.backup_path.read_bytes()  # the version before the update
    newest = ledger.path.read_bytes()
    ledger.path.write_bytes(old_primary)
    ledger.tmp_path.write_bytes(newest)
    assert ledger.resume_info(0)["resume_from_batch"] == 1
    record(ledger, tmp_path, 0, 1)
    assert not ledger.tmp_path.exists()
    assert [c.batch_idx for c in ledger.read().shards["0"].checkpoints] == [0, 1]


def test_a_newer_minor_version_is_read_only_and_another_major_is_refused(tmp_path: Path) -> None:
    from shardkeep.ledger import encode_state

    ledger = make_ledger(tmp_path)
    state = ledger.read()
    state.version = "2.1"
    ledger.path.write_bytes(encode_state(state))
    assert ledger.progress()["total_shards"] == 4
    with pytest.raises(sk.LedgerError, match="read-only here"):
        ledger.mark_shard_complete(0)
    state.version = "3.0"
    state.sequence += 10
    ledger.path.write_bytes(encode_state(state))
    with pytest.raises(sk.LedgerError, match=r"schema version 3\.0 is not supported") as caught:
        ledger.read()
    assert not isinstance(caught.value, sk.LedgerCorruptedError)  # an older copy never replaces it
    with pytest.raises(sk.LedgerError, match=r"3\.0"):
        ledger.mark_shard_complete(0)


def _hold_lock(path: str, ready: Any, release: Any) -> None:
    import fcntl

    descriptor = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(descriptor, fcntl.LOCK_EX)
    ready.set()
    release.wait(30)


def test_a_held_lock_times_out_with_a_typed_error(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path, lock_timeout=0.3)
    context = multiprocessing.get_context("fork")
    ready, release = context.Event(), context.Event()
    holder = context.Process(target=_hold_lock, args=(str(ledger.lock_path), ready, release))
    holder.start()
    try:
        assert ready.wait(10)
        started = time.monotonic()
        with pytest.raises(LedgerLockTimeoutError, match="held by another process"):
            ledger.mark_shard_complete(0)
        assert time.monotonic() - started < 5
        assert ledger.progress()["completed"] == 0  # reads need no lock
    finally:
        release.set()
        holder.join(10)
    ledger.mark_shard_complete(0)  # the holder exited: the kernel released its lock
    assert ledger.completed_shards() == [0]


class _PausedWrite(LocalFS):
    """Writes pause until the test lets them go, so the test can look at the lock mid-update."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def write_new_file(
        self, path: str | os.PathLike[str], data: bytes | bytearray | memoryview, *, mode: int = 0o644
    ) -> None:
        self.entered.set()
        assert self.release.wait(30)
        super().write_new_file(path, data, mode=mode)


def _descriptors_of(inode: tuple[int, int], but: int) -> list[int]:
    """This process's open descriptors of the file with this (device, inode), except ``but``."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            info = os.stat(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if (info.st_dev, info.st_ino) == inode and int(name) != but:
            found.append(int(name))
    return found


def test_a_lock_file_deleted_while_a_writer_waits_is_not_held_in_vain(tmp_path: Path) -> None:
    """A writer waiting on the lock file when it is deleted must, once it gets the lock, lock the
    file now at the path: a lock on the deleted file would exclude nobody (another process, an
    older shardkeep, or a filesystem that cannot lock the directory, opens the new file)."""
    ledger = make_ledger(tmp_path, lock_timeout=30)
    files = _PausedWrite()
    holder = os.open(ledger.lock_path, os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)
    held = os.fstat(holder)
    errors: list[BaseException] = []

    def update() -> None:
        try:
            ledger.mark_shard_complete(0)
        except BaseException as exc:
            errors.append(exc)

    writer = threading.Thread(target=update)
    with localfs.using(files):
        writer.start()
        try:
            deadline = time.monotonic() + 10
            while not _descriptors_of((held.st_dev, held.st_ino), but=holder):
                assert time.monotonic() < deadline, "the writer never opened the lock file"
                time.sleep(0.01)
            os.unlink(ledger.lock_path)  # while the writer waits on it
            fcntl.flock(holder, fcntl.LOCK_UN)
            os.close(holder)
            assert files.entered.wait(10), errors
            # The writer is inside its update: the lock file at the path must be locked by it.
            probe = os.open(ledger.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                with pytest.raises(BlockingIOError):
                    fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            finally:
                os.close(probe)
        finally:
            files.release.set()
            writer.join(30)
    assert not errors
    assert ledger.completed_shards() == [0]


def test_the_lock_path_must_be_a_regular_file(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path, lock_timeout=5)
    sequence = ledger.read().sequence
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.unlink(ledger.lock_path)
    # A dangling symlink: following it would create a file in another directory.
    os.symlink(elsewhere / "planted.lock", ledger.lock_path)
    with pytest.raises(UnsafePathError, match=r"progress\.json\.lock is a symlink"):
        ledger.mark_shard_complete(0)
    assert not (elsewhere / "planted.lock").exists()
    assert os.listdir(elsewhere) == []
    # A symlink to an existing file is refused too, and the file is left alone.
    (elsewhere / "real.lock").write_bytes(b"mine")
    os.unlink(ledger.lock_path)
    os.symlink(elsewhere / "real.lock", ledger.lock_path)
    with pytest.raises(UnsafePathError, match="is a symlink"):
        ledger.mark_shard_complete(0)
    assert (elsewhere / "real.lock").read_bytes() == b"mine"
    os.unlink(ledger.lock_path)
    os.mkfifo(ledger.lock_path)
    started = time.monotonic()
    with pytest.raises(UnsafePathError, match="is a FIFO, not a regular file"):
        ledger.mark_shard_complete(0)
    assert time.monotonic() - started < 5
    os.unlink(ledger.lock_path)
    os.mkdir(ledger.lock_path)
    with pytest.raises(UnsafePathError, match="is a directory, not a regular file"):
        ledger.mark_shard_complete(0)
    os.rmdir(ledger.lock_path)
    assert ledger.read().sequence == sequence  # nothing was written without the lock
    ledger.mark_shard_complete(0)  # a regular lock file is created again
    assert ledger.lock_path.is_file() and not ledger.lock_path.is_symlink()


@pytest.mark.timeout(30)
def test_special_files_as_ledger_copies_are_problems_not_hangs(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path)
    record(ledger, tmp_path, 0, 0)  # now there is a .backup
    sequence = ledger.read().sequence
    os.unlink(ledger.path)
    os.mkfifo(ledger.path)  # a read of it would block forever
    assert ledger.read().sequence == sequence - 1  # recovered from .backup
    target = tmp_path / "other.json"
    os.rename(ledger.backup_path, target)
    os.symlink(target, ledger.backup_path)
    with pytest.raises(sk.LedgerCorruptedError) as caught:
        ledger.read()
    assert caught.value.problems == {
        str(ledger.path): "is a FIFO, not a regular file",
        str(ledger.backup_path): "is a symlink, which is never followed",
    }


def test_a_directory_as_the_ledger_path_is_named_as_such(tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir()
    ledger = ProgressLedger(job)
    with pytest.raises(
        sk.LedgerError, match=rf"{re.escape(str(job))} is a directory; .* e\.g\. .*job/progress\.json"
    ) as caught:
        ledger.read()
    assert not isinstance(caught.value, sk.LedgerCorruptedError)
    ProgressLedger(job / "progress.json", 2).initialize()
    with pytest.raises(sk.LedgerError, match=r"did you mean .*job/progress\.json\?"):
        ledger.reassign_shard(0, 1)
    with pytest.raises(sk.LedgerError, match="is a directory"):
        ledger.initialize(2)
    assert sorted(os.listdir(tmp_path)) == ["job"]  # no job.lock or anything else next to it


def test_network_filesystems_are_detected_and_warned_about(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mountinfo = (
        "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
        "40 22 0:35 / /scratch rw,relatime shared:20 - lustre 10.0.0.1@tcp:/scratch rw\n"
        "41 22 0:36 / /home/my\\040data rw - nfs4 server:/home rw\n"
    )
    assert filesystem_type("/scratch/job/progress.json", mountinfo) == "lustre"
    assert filesystem_type("/home/my data/x", mountinfo) == "nfs4"
    assert filesystem_type("/scratchpad/x", mountinfo) == "ext4"
    assert filesystem_type(tmp_path) is not None  # this machine's /proc/self/mountinfo parses

    import shardkeep.ledger.lock as lock_module

    monkeypatch.setattr(lock_module, "filesystem_type", lambda path, mountinfo=None: "nfs4")
    ledger = ProgressLedger(tmp_path / "progress.json", 1)
    with pytest.warns(LedgerLockWarning, match="nfs4 filesystem, where file locks may not exclude"):
        ledger.initialize()
    record(ledger, tmp_path, 0, 0)  # warned once per ledger object, not on every update


# --------------------------------------------------------------------------------------------
# kill -9 at every file operation of an update


class _KillAt(LocalFS):
    """Counts the file operations of an update and kills the process before the chosen one (or,
    with ``torn``, halfway through the chosen write)."""

    def __init__(self, kill_at: int, *, torn: bool = False) -> None:
        self.count = 0
        self.kill_at = kill_at
        self.torn = torn

    def _reached(self) -> bool:
        reached = self.count == self.kill_at
        self.count += 1
        if reached and not self.torn:
            os.kill(os.getpid(), signal.SIGKILL)
        return reached

    def remove_tree(self, path: str) -> bool:
        self._reached()
        return super().remove_tree(path)

    def link(self, source: str, destination: str) -> None:
        self._reached()
        super().link(source, destination)

    def write_new_file(
        self, path: str | os.PathLike[str], data: bytes | bytearray | memoryview, *, mode: int = 0o644
    ) -> None:
        if self._reached():
            with open(path, "wb") as handle:
                handle.write(data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        super().write_new_file(path, data, mode=mode)

    def replace(self, source: str, destination: str) -> None:
        self._reached()
        super().replace(source, destination)

    def fsync_directory(self, path: str) -> None:
        self._reached()
        super().fsync_directory(path)


def _update_and_die(path: str, kill_at: int, torn: bool, action: Callable[[ProgressLedger], None]) -> None:
    with localfs.using(_KillAt(kill_at, torn=torn)):
        action(ProgressLedger(path))
    os._exit(0)


@pytest.mark.parametrize("start", ["clean", "primary_corrupted", "primary_missing", "tmp_newer"])
def test_kill_at_every_operation_of_an_update_leaves_old_or_new(tmp_path: Path, start: str) -> None:
    ledger = make_ledger(tmp_path, 2)
    record(ledger, tmp_path, 0, 0)
    if start == "primary_corrupted":
        record(ledger, tmp_path, 1, 0)
        _corrupt(ledger.path)  # the backup (shard 0 at batch 0) is the newest valid copy
    elif start == "primary_missing":
        record(ledger, tmp_path, 1, 0)
        ledger.path.unlink()
    elif start == "tmp_newer":
        # A writer died after fsyncing its .tmp: that version (shard 1 at batch 0) is the newest.
        record(ledger, tmp_path, 1, 0)
        os.replace(ledger.path, ledger.tmp_path)
        os.link(ledger.backup_path, ledger.path)
    name = batch_file(tmp_path, 0, 1)
    shard_1_before = [c.batch_idx for c in ProgressLedger(ledger.path).read().shards["1"].checkpoints]
    assert shard_1_before == ([0] if start == "tmp_newer" else [])

    def update(target: ProgressLedger) -> None:
        target.update_shard_checkpoint(0, 1, 10, name)

    copies = (ledger.path, ledger.tmp_path, ledger.backup_path)
    snapshot = {path: path.read_bytes() for path in copies if path.exists()}

    def roll_back() -> None:
        for path in copies:
            path.unlink(missing_ok=True)
        for path, data in snapshot.items():
            path.write_bytes(data)

    counter = _KillAt(-1)
    with localfs.using(counter):
        update(ledger)
    roll_back()
    operations = counter.count
    if start == "clean":
        # remove .tmp, link the primary as .tmp, rename it to .backup, remove .tmp, write .tmp,
        # rename it to the primary, fsync the directory
        assert operations == 7
    writes = [index for index in range(operations) if index not in (0, 1, 2, 3, 5, 6)] if start == "clean" else []
    context = multiprocessing.get_context("fork")
    present = []
    skipped = 0
    points = [(index, False) for index in range(operations)] + [(index, True) for index in range(operations)]
    for kill_at, torn in points:
        child = context.Process(target=_update_and_die, args=(str(ledger.path), kill_at, torn, update))
        child.start()
        child.join(30)
        if torn and child.exitcode == 0:
            roll_back()
            skipped += 1
            continue  # that operation is not a write
        assert child.exitcode == -signal.SIGKILL, (kill_at, child.exitcode)
        state = ProgressLedger(ledger.path).read()  # always readable
        batches = [c.batch_idx for c in state.shards["0"].checkpoints]
        assert batches in ([0], [0, 1]), (kill_at, batches)
        # What the starting state had is never lost.
        assert [c.batch_idx for c in state.shards["1"].checkpoints] == shard_1_before, kill_at
        if torn:
            assert batches == [0], kill_at  # a torn write is never adopted
        else:
            present.append(batches == [0, 1])
        # The next writer repairs whatever was left, then the update goes through.
        repaired = ProgressLedger(ledger.path)
        repaired.update_shard_checkpoint(0, 1, 10, name)
        assert [c.batch_idx for c in repaired.read().shards["0"].checkpoints] == [0, 1]
        assert checked_sequence(ledger.path.read_bytes()) == repaired.read().sequence
        assert not ledger.tmp_path.exists(), kill_at
        roll_back()
    kills = len(present) + sum(1 for kill_at, torn in points if torn) - skipped
    print(f"\nledger crash windows from a {start} start: {operations} operations, {kills} kills")
    # Absent until the new version is fsynced in .tmp, present from then on.
    first = present.index(True)
    assert present == [False] * first + [True] * (operations - first)
    assert present[-2:] == [True, True]  # killed before the rename onto the primary, and after it
    if start == "clean":
        assert writes == [4]
        assert first == 5


def test_storage_errors_leave_the_previous_version(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path)

    class FailingWrite(LocalFS):
        def write_new_file(
            self, path: str | os.PathLike[str], data: bytes | bytearray | memoryview, *, mode: int = 0o644
        ) -> None:
            raise OSError(28, "No space left on device")

    with (
        pytest.raises(StorageError, match="No space left on device; the previous version is intact"),
        localfs.using(FailingWrite()),
    ):
        record(ledger, tmp_path, 0, 0)
    assert ledger.resume_info(0)["resume_from_batch"] == 0
    record(ledger, tmp_path, 0, 0)
    assert ledger.resume_info(0)["resume_from_batch"] == 1


# --------------------------------------------------------------------------------------------
# Failed writes, foreign versions, odd input


def _reseal(raw: bytes) -> bytes:
    """Recompute the checksum of an edited ledger file, as a newer shardkeep would write it."""
    import re

    from shardkeep.integrity import digest_bytes

    match = re.match(rb'\{"checksum":"blake3:([0-9a-f]{64})"', raw)
    assert match is not None
    blanked = raw[: match.start(1)] + b"0" * 64 + raw[match.end(1) :]
    digest = digest_bytes("blake3", blanked).split(":", 1)[1].encode()
    return raw[: match.start(1)] + digest + raw[match.end(1) :]


def test_a_failed_fsync_never_leaves_a_tmp_that_is_adopted(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path)

    class FsyncFails(LocalFS):
        def write_new_file(
            self, path: str | os.PathLike[str], data: bytes | bytearray | memoryview, *, mode: int = 0o644
        ) -> None:
            with open(path, "xb") as handle:
                handle.write(data)  # the bytes are there; only the fsync fails
            raise OSError(5, "Input/output error")

    with pytest.raises(StorageError, match="the previous version is intact"), localfs.using(FsyncFails()):
        ledger.mark_shard_failed(0, "oom")
    assert not ledger.tmp_path.exists()
    assert ledger.shard_status(0)["retry_count"] == 0  # type: ignore[index]
    ledger.mark_shard_failed(0, "oom")  # the caller's retry counts once
    assert ledger.shard_status(0)["retry_count"] == 1  # type: ignore[index]


def test_a_failed_directory_fsync_says_the_outcome_is_uncertain(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path)

    class DirectorySyncFails(LocalFS):
        def fsync_directory(self, path: str) -> None:
            raise OSError(5, "Input/output error")

    with pytest.raises(StorageError, match="re-read the ledger before retrying"), localfs.using(DirectorySyncFails()):
        ledger.mark_shard_failed(0, "oom")
    assert ledger.shard_status(0)["retry_count"] == 1  # type: ignore[index]


def test_a_newer_minor_version_with_new_fields_is_never_replaced_by_an_older_copy(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path)
    record(ledger, tmp_path, 0, 0)
    raw = ledger.path.read_bytes()
    newer = _reseal(
        raw.replace(b'"version":"2.0"', b'"version":"2.1"').replace(
            b'"status":"in_progress"', b'"status":"in_progress","priority":5', 1
        )
    )
    ledger.path.write_bytes(newer)
    with pytest.raises(sk.LedgerError, match=r"schema version 2\.1\) has fields or values this shardkeep"):
        ledger.progress()
    with pytest.raises(sk.LedgerError, match=r"2\.1"):
        record(ledger, tmp_path, 0, 1)
    with pytest.raises(sk.LedgerError, match=r"2\.1"):
        ledger.initialize(input_fingerprint="x")
    assert ledger.path.read_bytes() == newer


def test_a_checksummed_file_with_a_bad_timestamp_is_a_typed_error(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path)
    raw = ledger.path.read_bytes()
    broken = _reseal(re.sub(rb'"created_at":"[^"]+"', b'"created_at":"yesterday"', raw))
    ledger.path.write_bytes(broken)
    with pytest.raises(sk.LedgerCorruptedError, match="created_at"):
        ledger.progress()


def test_odd_file_arguments_are_typed_errors(tmp_path: Path) -> None:
    ledger = make_ledger(tmp_path)
    with pytest.raises(ShardkeepError):
        ledger.update_shard_checkpoint(0, 0, 1, "x" * 300)
    with pytest.raises(UnsupportedValueError, match="checkpoint_file must be a str or path"):
        ledger.update_shard_checkpoint(0, 0, 1, 42)  # type: ignore[arg-type]


def test_a_claimed_shard_that_records_nothing_becomes_stale(tmp_path: Path) -> None:
    clock = FakeClock()
    ledger = make_ledger(tmp_path, clock=clock)
    assert ledger.claim_shard(1, 1) == 1
    clock.now += 601
    assert ledger.is_shard_stale(1)  # claimed, then hung before its first batch
    assert not ledger.is_shard_stale(0)  # never started: not stale
    ledger.claim_shard(1, 1)  # the restarted worker claims it again
    assert not ledger.is_shard_stale(1)
    with pytest.raises(LedgerStateError, match="assigned to worker 1, not worker 0"):
        ledger.claim_shard(1, 0)
    ledger.mark_shard_complete(1)
    with pytest.raises(LedgerStateError, match="nothing to claim"):
        ledger.claim_shard(1, 1)


# --------------------------------------------------------------------------------------------
# Power loss: a simulated disk that keeps only what was fsynced


class PowerLossFiles(LocalFS):
    """Performs every operation for real and models what a power cut would keep: a file's data
    only once fsynced, directory entries (creates, links, renames, removals) only once the
    directory is fsynced. ``skip`` removes one kind of fsync (the mutation check)."""

    def __init__(self, directory: Path, skip: str | None = None) -> None:
        self.directory = directory
        self.skip = skip
        self.operations = 0
        self.crash_at: int | None = None
        self.inodes: dict[int, bytes | None] = {}  # durable data of each inode
        self.current: dict[str, int] = {}
        self.durable: dict[str, int] = {}
        for path in sorted(directory.iterdir()):
            if path.name.startswith("progress.json") and path.name != "progress.json.lock":
                inode = os.stat(path).st_ino
                self.inodes[inode] = path.read_bytes()
                self.current[path.name] = inode
        self.durable = dict(self.current)

    def _step(self) -> None:
        if self.crash_at is not None and self.operations == self.crash_at:
            raise _PowerCut
        self.operations += 1

    def remove_tree(self, path: str) -> bool:
        self._step()
        removed = super().remove_tree(path)
        self.current.pop(os.path.basename(path), None)
        return removed

    def link(self, source: str, destination: str) -> None:
        self._step()
        super().link(source, destination)
        self.current[os.path.basename(destination)] = self.current[os.path.basename(source)]

    def write_new_file(
        self, path: str | os.PathLike[str], data: bytes | bytearray | memoryview, *, mode: int = 0o644
    ) -> None:
        self._step()
        super().write_new_file(path, data, mode=mode)
        inode = os.stat(path).st_ino
        self.inodes[inode] = None if self.skip == "file" else bytes(data)
        self.current[os.path.basename(os.fspath(path))] = inode

    def replace(self, source: str, destination: str) -> None:
        self._step()
        super().replace(source, destination)
        self.current[os.path.basename(destination)] = self.current.pop(os.path.basename(source))

    def fsync_directory(self, path: str) -> None:
        self._step()
        super().fsync_directory(path)
        if self.skip != "directory":
            self.durable = dict(self.current)

    def materialize(self) -> None:
        """Replace the ledger's files with what survived the power cut."""
        for path in self.directory.iterdir():
            if path.name.startswith("progress.json") and path.name != "progress.json.lock":
                path.unlink()
        for name, inode in self.durable.items():
            data = self.inodes.get(inode)
            (self.directory / name).write_bytes(data if data is not None else b"")


class _PowerCut(Exception):
    pass


def _power_loss_violations(tmp_path: Path, skip: str | None) -> tuple[int, int]:
    """Cut the power at every operation of three updates; count cut points after which the
    ledger is unreadable or lost an update that had returned."""
    points = violations = 0
    crash_at = 0
    while True:
        directory = tmp_path / f"{skip}-{crash_at}"
        directory.mkdir()
        make_ledger(directory, 1)
        names = [batch_file(directory, 0, batch) for batch in range(3)]
        files = PowerLossFiles(directory, skip)
        files.crash_at = crash_at
        ledger = ProgressLedger(directory / "progress.json")
        returned = []
        try:
            with localfs.using(files):
                for batch, name in enumerate(names):
                    ledger.update_shard_checkpoint(0, batch, 1, name)
                    returned.append(batch)
        except _PowerCut:
            pass
        if files.crash_at is not None and files.operations < crash_at:
            return points, violations  # every operation has been a cut point
        points += 1
        files.materialize()
        try:
            survived = [c.batch_idx for c in ProgressLedger(directory / "progress.json").read().shards["0"].checkpoints]
        except sk.LedgerError:
            violations += 1
        else:
            if survived[: len(returned)] != returned:
                violations += 1
        crash_at += 1


def test_power_loss_at_every_operation_keeps_every_returned_update(tmp_path: Path) -> None:
    points, violations = _power_loss_violations(tmp_path, None)
    print(f"\nledger power loss: {points} cut points, {violations} violations")
    assert points == 3 * 7 + 1  # before each of the 7 operations of 3 updates, and after the last
    assert violations == 0


@pytest.mark.parametrize("skip", ["file", "directory"])
def test_power_loss_check_fails_without_each_fsync(tmp_path: Path, skip: str) -> None:
    """The mutation check: drop the file fsync, or the directory fsync, and the test above finds
    violations; so it would catch the removal of either."""
    _, violations = _power_loss_violations(tmp_path, skip)
    assert violations > 0


def test_the_golden_ledger_reads_and_accepts_updates(tmp_path: Path) -> None:
    """A ledger file written by this format version (tests/golden/ledger-v1), committed as bytes:
    a later shardkeep must read it and continue it."""
    import shutil

    directory = tmp_path / "job"
    shutil.copytree(Path(__file__).parent / "golden" / "ledger-v1", directory)
    ledger = ProgressLedger(directory / "progress.json", 2)
    state = ledger.read()
    assert state.world_size == 2 and state.input_fingerprint == "golden-input"
    assert [c.batch_idx for c in state.shards["0"].checkpoints] == [0, 1]
    assert state.shards["0"].total_sequences == 22
    assert ledger.resume_points() == {0: 2, 1: 0}
    (directory / "batch_2.bin").write_bytes(b"2")
    ledger.update_shard_checkpoint(0, 2, 5, "batch_2.bin")
    assert ledger.read().shards["0"].total_sequences == 27
