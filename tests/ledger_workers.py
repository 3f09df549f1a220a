"""Worker processes for the ledger concurrency tests, started with ``spawn`` like a real batch job.

Each writer records batches of its own shard and appends a batch index to its log only after
``update_shard_checkpoint`` has returned, so the log is the set of updates that must survive.
Readers read the ledger without a lock until a stop file appears and report what they saw.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

from shardkeep.errors import ShardkeepError
from shardkeep.ledger import ProgressLedger


class UnlockedLedger(ProgressLedger):
    """The control: the same ledger with its lock removed. It must lose updates."""

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        yield


def writer(path: str, shard: int, updates: int, log_path: str, locked: bool) -> None:
    ledger = (ProgressLedger if locked else UnlockedLedger)(path, lock_timeout=120)
    batch_file = f"shard_{shard}/result.bin"
    start = ledger.get_resume_info(shard)["resume_from_batch"] if locked else 0
    with open(log_path, "a", encoding="utf-8") as log:
        for batch in range(start, updates):
            try:
                ledger.update_shard_checkpoint(shard, batch, 1, batch_file, f"{shard}:{batch}")
            except (ShardkeepError, OSError) as exc:
                if locked:
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
            progress = ledger.get_global_progress()
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
