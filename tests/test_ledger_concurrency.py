"""ProgressLedger across processes (spawned, like a real batch job): 8 writers x 500 updates with
concurrent readers lose nothing; without the lock the same load loses updates (the control that
shows the test can fail); writers killed with SIGKILL mid-update lose nothing that returned;
writers lose nothing while another process keeps deleting the lock file, where a lock on the
file alone (the controls) loses updates.

The figure in docs/reliability.md: "progress manifest | 8 processes x 500 updates, with kill -9 of
writers | 0 lost updates, 0 unreadable reads".
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import time
from multiprocessing.context import SpawnProcess
from pathlib import Path
from typing import Any

import pytest

from shardkeep.ledger import ProgressLedger
from tests.support import ledger_workers
from tests.support.figures import record

pytestmark = pytest.mark.slow  # many writer processes

WRITERS = 8
context = multiprocessing.get_context("spawn")


def _prepare(tmp_path: Path) -> ProgressLedger:
    ledger = ProgressLedger(tmp_path / "progress.json", WRITERS)
    ledger.initialize(input_fingerprint="sha256:test-input")
    for shard in range(WRITERS):
        (tmp_path / f"shard_{shard}").mkdir()
        (tmp_path / f"shard_{shard}" / "result.bin").write_bytes(b"x")
    return ledger


def _start_writer(tmp_path: Path, shard: int, updates: int, variant: str = "locked") -> SpawnProcess:
    process = context.Process(
        target=ledger_workers.writer,
        args=(str(tmp_path / "progress.json"), shard, updates, str(tmp_path / f"log_{shard}.txt"), variant),
    )
    process.start()
    return process


def _start_readers(tmp_path: Path, count: int) -> list[SpawnProcess]:
    readers = []
    for index in range(count):
        process = context.Process(
            target=ledger_workers.reader,
            args=(str(tmp_path / "progress.json"), str(tmp_path / "stop"), str(tmp_path / f"reader_{index}.json")),
        )
        process.start()
        readers.append(process)
    return readers


def _stop_readers(tmp_path: Path, readers: list[SpawnProcess]) -> list[dict[str, Any]]:
    (tmp_path / "stop").touch()
    reports = []
    for index, process in enumerate(readers):
        process.join(60)
        assert process.exitcode == 0
        reports.append(json.loads((tmp_path / f"reader_{index}.json").read_text()))
    return reports


def _returned(tmp_path: Path, shard: int) -> list[int]:
    """Batches whose update returned, from the writer's log (a killed writer's last line may be cut)."""
    path = tmp_path / f"log_{shard}.txt"
    if not path.exists():
        return []
    lines = path.read_text().split("\n")
    return [int(line) for line in lines[:-1] if line.isdigit()]


def _recorded(ledger: ProgressLedger, shard: int) -> list[int]:
    return [record.batch_idx for record in ledger.read().shards[str(shard)].checkpoints]


def test_eight_writers_and_readers_lose_nothing(tmp_path: Path) -> None:
    updates = 500
    ledger = _prepare(tmp_path)
    readers = _start_readers(tmp_path, 2)
    started = time.monotonic()
    writers = [_start_writer(tmp_path, shard, updates) for shard in range(WRITERS)]
    for process in writers:
        process.join(600)
        assert process.exitcode == 0
    elapsed = time.monotonic() - started
    reports = _stop_readers(tmp_path, readers)
    lost = 0
    for shard in range(WRITERS):
        returned = _returned(tmp_path, shard)
        assert returned == list(range(updates))
        recorded = _recorded(ledger, shard)
        lost += len(set(returned) - set(recorded))
        assert recorded == list(range(updates))
    reads = sum(report["reads"] for report in reports)
    unreadable = sum(report["failures"] for report in reports)
    print(
        f"\nledger: {WRITERS} writers x {updates} updates in {elapsed:.1f} s "
        f"({WRITERS * updates / elapsed:.0f} updates/s); {reads} concurrent reads; "
        f"lost {lost}, unreadable {unreadable}"
    )
    record(
        "progress manifest",
        trials=WRITERS * updates,
        failures=lost + unreadable,
        detail=f"{WRITERS} writer processes x {updates} updates, {reads} concurrent unlocked reads: lost {lost}, "
        f"unreadable {unreadable}",
    )
    assert lost == 0
    assert unreadable == 0, [report["examples"] for report in reports]
    assert sum(report["regressions"] for report in reports) == 0
    assert reads > 0
    state = ledger.read()
    assert state.sequence == 1 + WRITERS * updates
    assert ledger.progress()["total_sequences_checkpointed"] == WRITERS * updates


def test_without_the_lock_updates_are_lost(tmp_path: Path) -> None:
    """The control: the same writers with the lock removed lose updates, so the test above is
    able to fail."""
    updates = 150
    ledger = _prepare(tmp_path)
    writers = [_start_writer(tmp_path, shard, updates, "unlocked") for shard in range(WRITERS)]
    for process in writers:
        process.join(300)
        assert process.exitcode == 0
    lost = 0
    for shard in range(WRITERS):
        recorded = set(_recorded(ledger, shard))
        lost += len(set(_returned(tmp_path, shard)) - recorded)
    print(f"\nledger without its lock: {lost} of {WRITERS * updates} returned updates lost")
    assert lost > 0


def test_writers_killed_mid_update_lose_nothing_that_returned(tmp_path: Path) -> None:
    updates = 200
    kills_wanted = 24
    ledger = _prepare(tmp_path)
    readers = _start_readers(tmp_path, 2)
    writers = {shard: _start_writer(tmp_path, shard, updates) for shard in range(WRITERS)}
    chooser = random.Random(1234)
    kills = restarts = 0
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        for shard, process in list(writers.items()):
            if process.exitcode is not None and process.exitcode != 0 and process.exitcode != -signal.SIGKILL:
                raise AssertionError(f"writer {shard} failed with exit code {process.exitcode}")
        alive = [shard for shard, process in writers.items() if process.is_alive()]
        done = [shard for shard, process in writers.items() if process.exitcode == 0]
        if len(done) == WRITERS:
            break
        if kills < kills_wanted and alive:
            time.sleep(chooser.uniform(0.05, 0.4))
            victim = chooser.choice(alive)
            if writers[victim].is_alive():
                os.kill(writers[victim].pid, signal.SIGKILL)  # type: ignore[arg-type]
                writers[victim].join(30)
                kills += 1
        else:
            time.sleep(0.05)
        for shard, process in list(writers.items()):
            if process.exitcode == -signal.SIGKILL:
                # Restart it: it resumes from the ledger's last recorded batch.
                writers[shard] = _start_writer(tmp_path, shard, updates)
                restarts += 1
    else:
        raise AssertionError("writers did not finish in time")
    reports = _stop_readers(tmp_path, readers)
    lost = 0
    for shard in range(WRITERS):
        recorded = _recorded(ledger, shard)
        lost += len(set(_returned(tmp_path, shard)) - set(recorded))
        assert recorded == list(range(updates)), shard  # every batch once, none skipped
    unreadable = sum(report["failures"] for report in reports)
    reads = sum(report["reads"] for report in reports)
    print(
        f"\nledger with kill -9: {kills} writers killed and restarted, {reads} concurrent reads; "
        f"lost {lost}, unreadable {unreadable}"
    )
    record(
        "progress manifest: kill -9",
        trials=kills,
        failures=lost + unreadable,
        detail=f"{WRITERS} writers x {updates} updates, {kills} kill -9 of writers (restarted), {reads} reads: lost "
        f"{lost}, unreadable {unreadable}",
    )
    assert kills >= kills_wanted // 2
    assert lost == 0
    assert unreadable == 0, [report["examples"] for report in reports]
    assert sum(report["regressions"] for report in reports) == 0


def _run_with_lock_deleter(tmp_path: Path, writers: int, updates: int, variant: str) -> tuple[int, int, int, float]:
    """``writers`` processes record ``updates`` batches each while another process deletes the
    lock file whenever it exists: (updates lost, updates that did not return, deletions, seconds)."""
    ledger = _prepare(tmp_path)
    deleter = context.Process(
        target=ledger_workers.lock_deleter,
        args=(str(ledger.lock_path), str(tmp_path / "stop"), str(tmp_path / "deleter.json")),
    )
    deleter.start()
    try:
        started = time.monotonic()
        processes = [_start_writer(tmp_path, shard, updates, variant) for shard in range(writers)]
        for process in processes:
            process.join(300)
        elapsed = time.monotonic() - started
    finally:
        (tmp_path / "stop").touch()
        deleter.join(60)
    assert deleter.exitcode == 0
    deletions = json.loads((tmp_path / "deleter.json").read_text())["deletions"]
    lost = failed = 0
    for shard in range(writers):
        returned = set(_returned(tmp_path, shard))
        failed += updates - len(returned)  # raised, or never tried after a writer died of an error
        lost += len(returned - set(_recorded(ledger, shard)))
    assert all(process.exitcode is not None for process in processes), "a writer hung"
    return lost, failed, deletions, elapsed


def test_deleting_the_lock_file_while_writers_run_loses_nothing(tmp_path: Path) -> None:
    writers, updates = 4, 150
    lost, failed, deletions, elapsed = _run_with_lock_deleter(tmp_path, writers, updates, "locked")
    print(
        f"\nledger with its lock file deleted {deletions} times: {writers} writers x {updates} updates in "
        f"{elapsed:.1f} s, lost {lost}, failed {failed}"
    )
    record(
        "progress manifest: lock file deleted",
        trials=writers * updates,
        failures=lost + failed,
        detail=f"{writers} writer processes x {updates} updates while another process deleted the lock file "
        f"{deletions} times: lost {lost}, failed {failed}",
    )
    assert deletions >= 20  # the attack ran while the writers did
    assert (lost, failed) == (0, 0)


@pytest.mark.parametrize("variant", ["lock-file-only", "checked-lock-file"])
def test_deleting_the_lock_file_defeats_a_lock_on_the_file_alone(tmp_path: Path, variant: str) -> None:
    """The controls: under the same attack, a lock on the file alone (an ``flock`` on whatever
    file is at the lock path) loses updates, and so does that lock with a check after locking
    that it is still the file at the path, without the lock on the directory. So the test above
    can fail, and the directory lock is what makes it pass."""
    writers, updates = 4, 150
    lost, failed, deletions, _ = _run_with_lock_deleter(tmp_path, writers, updates, variant)
    print(f"\n{variant}, lock file deleted {deletions} times: lost {lost}, failed {failed} of {writers * updates}")
    assert lost > 0
