"""ProgressLedger update cost: shardkeep against the naive unlocked ``json.dump`` + rename.

What it measures, for ledgers already holding 0, 1,000, 4,000 and 16,000 batch records (8
shards), the time of one ``update_shard_checkpoint`` call (median of the timed calls):

* ``seed-style``: the naive pattern (the original requirements' sketch): load the JSON, append, ``json.dump(indent=2)`` into
  ``.tmp``, rename. No lock, no fsync, no backup, no checksum: fast but neither durable nor safe
  with two writers (see ``tests/test_ledger_concurrency.py``'s control).
* ``json+fsync``: the same plus ``fsync`` of the file and the directory: the price of
  durability alone.
* ``shardkeep``: ``ProgressLedger.update_shard_checkpoint``: the lock, recovery read of every
  copy, checksum, backup, fsync, rename, directory fsync.

Then 8 spawned writers record 200 batches each into one ledger: total updates per second.

Run: ``make bench-ledger`` or ``.venv/bin/python bench/ledger.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from shardkeep.ledger import BatchRecord, ProgressLedger, encode_state

SHARDS = 8


def seed_style_update(path: Path, shard: int, batch: int, durable: bool) -> None:
    with open(path) as handle:
        manifest = json.load(handle)
    entry = manifest["shards"][str(shard)]
    now = datetime.now(UTC).isoformat()
    entry["last_checkpoint_batch"] = batch
    entry["total_sequences"] += 1
    entry["last_checkpoint_time"] = now
    entry["checkpoints"].append(
        {"batch_idx": batch, "num_sequences": 1, "file": "r.bin", "timestamp": now, "sequence_range": f"{batch}"}
    )
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as handle:
        json.dump(manifest, handle, indent=2)
        if durable:
            handle.flush()
            os.fsync(handle.fileno())
    tmp.replace(path)
    if durable:
        descriptor = os.open(path.parent, os.O_RDONLY)
        os.fsync(descriptor)
        os.close(descriptor)


def prepare(directory: Path, records: int) -> tuple[ProgressLedger, Path]:
    directory.mkdir(parents=True)
    (directory / "r.bin").write_bytes(b"x")
    ledger = ProgressLedger(directory / "progress.json", SHARDS)
    ledger.initialize()
    seed_path = directory / "seed.json"
    seed = {
        "version": "2.0",
        "world_size": SHARDS,
        "shards": {
            str(shard): {"last_checkpoint_batch": -1, "total_sequences": 0, "checkpoints": []}
            for shard in range(SHARDS)
        },
    }
    seed_path.write_text(json.dumps(seed))
    # Fill both quickly: write the ledger's state directly once, then continue with real updates.
    state = ledger.read()
    for index in range(records):
        shard, batch = index % SHARDS, index // SHARDS
        moment = datetime.now(UTC)
        now = moment.isoformat()
        entry = state.shards[str(shard)]
        entry.checkpoints.append(
            BatchRecord(
                batch_idx=batch, num_sequences=1, file=f"r{index}.bin", timestamp=moment, sequence_range=f"{batch}"
            )
        )
        entry.last_checkpoint_batch = batch
        seed["shards"][str(shard)]["checkpoints"].append(  # type: ignore[index]
            {"batch_idx": batch, "num_sequences": 1, "file": "r.bin", "timestamp": now, "sequence_range": f"{batch}"}
        )
        seed["shards"][str(shard)]["last_checkpoint_batch"] = batch  # type: ignore[index]
    state.sequence += 1
    ledger.path.write_bytes(encode_state(state))  # no other process has the ledger yet
    seed_path.write_text(json.dumps(seed, indent=2))
    return ledger, seed_path


def time_calls(call: Callable[[int], None], first_batch: int, count: int) -> float:
    samples = []
    for offset in range(count):
        started = time.perf_counter()
        call(first_batch + offset)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def measure_size(records: int, calls: int) -> None:
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as scratch:
        ledger, seed_path = prepare(Path(scratch) / "ledger", records)
        first = records // SHARDS + 1
        seed = time_calls(lambda batch: seed_style_update(seed_path, 0, batch, False), first, calls)
        durable = time_calls(lambda batch: seed_style_update(seed_path, 0, batch, True), first + calls, calls)
        ours = time_calls(lambda batch: ledger.update_shard_checkpoint(0, batch, 1, "r.bin", f"{batch}"), first, calls)
        size = ledger.path.stat().st_size
        print(
            f"{records:>8} {seed * 1e3:>10.2f}ms {durable * 1e3:>10.2f}ms {ours * 1e3:>10.2f}ms   "
            f"{ours / durable:>5.2f}x   (ledger file {size / 1024:.0f} KiB)",
            flush=True,
        )


def single_writer(sizes: list[int], calls: int) -> None:
    print(f"{'records':>8} {'seed-style':>12} {'json+fsync':>12} {'shardkeep':>12}   shardkeep / json+fsync")
    for records in sizes:
        measure_size(records, calls)


def _writer(path: str, shard: int, updates: int) -> None:
    ledger = ProgressLedger(path)
    for batch in range(updates):
        ledger.update_shard_checkpoint(shard, batch, 1, "r.bin")


def many_writers(updates: int) -> None:
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as scratch:
        ledger, _ = prepare(Path(scratch) / "ledger", 0)
        context = multiprocessing.get_context("spawn")
        processes = [
            context.Process(target=_writer, args=(str(ledger.path), shard, updates)) for shard in range(SHARDS)
        ]
        started = time.perf_counter()
        for process in processes:
            process.start()
        for process in processes:
            process.join()
        elapsed = time.perf_counter() - started
        total = ledger.progress()["total_batches"]
        assert total == SHARDS * updates, total
        print(
            f"{SHARDS} spawned writers x {updates} updates: {elapsed:.1f} s including process start, "
            f"{total / elapsed:.0f} updates/s, ledger ends with {total} records",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer calls")
    args = parser.parse_args()
    sizes = [0, 1000] if args.quick else [0, 1000, 4000, 16000]
    calls = 10 if args.quick else 30
    print(f"one writer, median of {calls} updates each")
    single_writer(sizes, calls)
    many_writers(50 if args.quick else 200)


if __name__ == "__main__":
    main()
