"""How the block size of ``levels.transfer.run_exchange`` sets the speed of moving files between
ranks (the peer replicas of a save, and the files a restore fetches from another node).

Four forked gloo ranks on 127.0.0.1: ranks 0 and 1 each send one file of ``--mib`` MiB (random
bytes, on ``--dir``, ``/dev/shm`` by default) to ranks 2 and 3, which write it beside, checking
its digest on arrival (the fast one, xxh3-128, as a restore without a public key does; with
``--strong``, the save's blake3, as peer replication after a save does). Each
block size is timed ``--reps`` times, the sizes interleaved so that the machine's load falls on
every size alike; a run's time is the slowest rank's, between two barriers. Prints the median
and the range per size, and each against the default (:data:`WIRE_BLOCK_BYTES`).

Run from the repository root::

    PYTHONPATH=$PWD/src .venv/bin/python bench/transfer_blocks.py                 # 64 MiB, 0.5-8 MiB blocks
    PYTHONPATH=$PWD/src .venv/bin/python bench/transfer_blocks.py --sizes 2,8 --reps 9
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests.support


def _record(path: Path, name: str, rank: int) -> Any:
    from shardkeep.integrity import digest_bytes
    from shardkeep.manifest import FileRecord

    data = path.read_bytes()
    return FileRecord(
        path=name,
        rank=rank,
        size=len(data),
        digest=digest_bytes("blake3", data),
        fast_digest=digest_bytes("xxh3-128", data),
    )


def _rank(
    rank: int, world: int, base: str, mib: int, sizes: list[float], reps: int, fast: bool
) -> dict[float, list[float]]:
    import numpy as np
    import torch.distributed as dist

    from shardkeep.levels.transfer import FileReceive, FileSend, run_exchange

    if rank < 2:
        data = np.random.default_rng(rank).integers(0, 256, mib << 20, dtype=np.uint8)
        Path(base, f"source{rank}").write_bytes(data.tobytes())
    dist.barrier()
    records = {sender: _record(Path(base, f"source{sender}"), f"file{sender}", sender) for sender in (0, 1)}
    times: dict[float, list[float]] = {size: [] for size in sizes}
    for rep in range(reps):
        for size in sizes:
            destination = Path(base, f"received{rank}-{rep}-{size}")
            sends = [FileSend(rank + 2, str(Path(base, f"source{rank}")), records[rank])] if rank < 2 else []
            receives = [FileReceive(rank - 2, str(destination), records[rank - 2])] if rank >= 2 else []
            dist.barrier()
            started = time.perf_counter()
            exchange = run_exchange(
                None, sends, receives, block_bytes=int(size * 2**20), pairs=[(0, 2), (1, 3)], fast=fast
            )
            dist.barrier()
            times[size].append(time.perf_counter() - started)
            if rank >= 2:
                assert exchange.written == [str(destination)], exchange.problems()
                destination.unlink()
    return times


def main() -> None:
    from tests.support.distributed_harness import results_or_raise, run_ranks

    from shardkeep.levels.transfer import WIRE_BLOCK_BYTES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="MiB each of the two senders sends")
    parser.add_argument("--sizes", default="0.5,1,2,4,8", help="block sizes in MiB, comma-separated")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--strong", action="store_true", help="check arrivals with blake3, not xxh3-128")
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    args = parser.parse_args()
    sizes = [float(size) for size in args.sizes.split(",")]
    base = tempfile.mkdtemp(prefix="shardkeep-transfer-", dir=args.dir)
    outbox = Path(tempfile.mkdtemp(prefix="shardkeep-transfer-outbox-"))
    try:
        results = results_or_raise(
            run_ranks(4, _rank, base, args.mib, sizes, args.reps, not args.strong, outbox=outbox, timeout=900)
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(outbox, ignore_errors=True)
    medians = {}
    print(
        f"2 x {args.mib} MiB, rank 0 -> 2 and 1 -> 3, {args.reps} runs per block size, "
        f"{'blake3' if args.strong else 'xxh3-128'} on arrival, load {os.getloadavg()[0]:.1f}"
    )
    for size in sizes:
        runs = [max(result[size][rep] for result in results) for rep in range(args.reps)]
        medians[size] = statistics.median(runs)
        rate = 2 * args.mib / 1024 / medians[size]
        print(f"  {size:g} MiB blocks: {medians[size]:.3f} s ({min(runs):.3f}-{max(runs):.3f}), {rate:.2f} GiB/s")
    default = WIRE_BLOCK_BYTES / 2**20
    if default in medians:
        for size in sizes:
            print(f"  {size:g} MiB against the default {default:g} MiB: {medians[size] / medians[default]:.2f}x")


if __name__ == "__main__":
    main()
