"""Worker processes for the ledger concurrency tests, started with ``spawn`` like a real batch job.

Each writer records batches of its own shard and appends a batch index to its log only after
``update_shard_checkpoint`` has returned, so the log is the set of updates that must survive.
Readers read the ledger without a lock until a stop file appears and report what they saw. The
lock deleter is the attack: it deletes the ledger's lock file again and again while writers run.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shardkeep.errors import ShardkeepError
from shardkeep.ledger import ProgressLedger
from shardkeep.ledger.lock import LedgerLock


class UnlockedLedger(ProgressLedger):
    """The control: the same ledger with its lock removed. It must lose updates."""

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        yield


class LockFileOnlyLedger(ProgressLedger):
    """The control for the deletion attack: an ``flock`` on whatever file is at the lock path,
    with no check that it is still there afterwards (the ledger checks that it still is)."""

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        descriptor = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
            yield
        finally:
            os.close(descriptor)


class _FileOnlyLock(LedgerLock):
    """The ledger's lock without its lock on the directory."""

    def _lock_directory(self, deadline: float | None, timeout: float | None) -> int | None:
        return None


class CheckedLockFileLedger(ProgressLedger):
    """The second control: the lock file checked after locking (still the file at the path), but
    without the lock on the directory. The check cannot help a holder whose lock file is deleted
    while it holds it: the next writer creates and locks a new one."""

    def __init__(self, path: str, **options: Any) -> None:
        super().__init__(path, **options)
        self._lock = _FileOnlyLock(self.path, self.lock_path)


LEDGERS: dict[str, type[ProgressLedger]] = {
    "locked": ProgressLedger,
    "unlocked": UnlockedLedger,
    "lock-file-only": LockFileOnlyLedger,
    "checked-lock-file": CheckedLockFileLedger,
}


def writer(path: str, shard: int, updates: int, log_path: str, variant: str = "locked") -> None:
    """Record batches ``0..updates-1`` of ``shard`` (from the resume point with the real ledger).
    The controls log an error and go on, since two writers inside at once may collide on ``.tmp``;
    the real ledger never may, so there an error ends the process."""
    ledger = LEDGERS[variant](path, lock_timeout=120)
    batch_file = f"shard_{shard}/result.bin"
    start = ledger.resume_info(shard)["resume_from_batch"] if variant == "locked" else 0
    with open(log_path, "a", encoding="utf-8") as log:
        for batch in range(start, updates):
            try:
                ledger.update_shard_checkpoint(shard, batch, 1, batch_file, f"{shard}:{batch}")
            except (ShardkeepError, OSError) as exc:
                if variant == "locked":
                    raise
                log.write(f"error {type(exc).__name__}\n")
                continue
            log.write(f"{batch}\n")
            log.flush()


def reader(path: str, stop_path: str, report_path: str) -> None:
    ledger = ProgressLedger(path)
    reads = failures = regressions = 0
    last_sequence = 0
    examples: list[str] = []
    while not os.path.exists(stop_path):
        try:
            progress = ledger.progress()
        except Exception as exc:  # every failure counts, whatever its type
            failures += 1
            if len(examples) < 5:
                examples.append(f"{type(exc).__name__}: {exc}")
            continue
        reads += 1
        if progress["sequence"] < last_sequence:
            regressions += 1
        last_sequence = progress["sequence"]
        time.sleep(0.005)
    Path(report_path).write_text(
        json.dumps({"reads": reads, "failures": failures, "regressions": regressions, "examples": examples})
    )


def lock_deleter(lock_path: str, stop_path: str, report_path: str) -> None:
    """Delete ``lock_path`` whenever it exists, until ``stop_path`` appears; report how often."""
    deletions = attempts = 0
    while not os.path.exists(stop_path):
        attempts += 1
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock_path)
            deletions += 1
        time.sleep(0.0005)
    Path(report_path).write_text(json.dumps({"deletions": deletions, "attempts": attempts}))
