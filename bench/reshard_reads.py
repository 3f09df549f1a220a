"""Reshard reads: what each of 3 loading gloo ranks reads of a checkpoint saved on 2 or 4.

Forked gloo ranks save 16 fp32 tensors of 16 MiB (``[1024, 4096]``, 256 MiB in all) as
``Shard(0)`` DTensors twice: with the default block digests (format 2.1, the block size of the
rule in docs/manifest.md) and with ``WriteOptions(block_size=0)`` (format 2.0: one digest per
chunk). Three forked ranks then load each into ``Shard(0)`` DTensors (verified, the default
fast digest), counting the bytes every ``read_into`` returns from data files (a ``map`` is
counted whole) with ``examples/store_probes.CountingStore``, and the kernel's ``rchar``. A
rank's share is the bytes of its local shards; the ratio is bytes read / share (headers
included). Times are the load's wall time on that rank, the median (min-max) of ``--reps``
loads after one untimed load (warm page cache).

Run from the repository root::

    .venv/bin/python bench/reshard_reads.py            # 256 MiB, 3 repetitions
    .venv/bin/python bench/reshard_reads.py --quick    # 16 x 1 MiB, 1 repetition
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the repository root: examples/
from examples.store_probes import CountingStore, kernel_read_bytes
from tests.support.distributed_harness import results_or_raise
from tests.support.distributed_harness import run_ranks as ranks_of

import shardkeep as sk
from common import fmt_bytes, fmt_range, table
from shardkeep.storage import LocalStore

MiB = 1 << 20
TENSORS = 16
LOAD_RANKS = 3


def run_ranks(world: int, target: Callable[..., Any], *args: Any, out: Path) -> list[Any]:
    """``target(rank, world, *args)`` on ``world`` forked gloo ranks (the test suite's harness);
    each rank's result."""
    return results_or_raise(ranks_of(world, target, *args, outbox=out, timeout=1200))


def _tensor(index: int, rows: int) -> torch.Tensor:
    return torch.full((rows, 4096), float(index), dtype=torch.float32)


def _save(rank: int, world: int, root: str, rows: int) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {f"t{i:02d}": distribute_tensor(_tensor(i, rows), mesh, [Shard(0)]) for i in range(TENSORS)}
    sk.save(state, os.path.join(root, "blocks"))
    sk.save(state, os.path.join(root, "zero"), options=sk.WriteOptions(block_size=0))
    return 0


def _load(rank: int, world: int, root: str, name: str, rows: int, reps: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    into = {f"t{i:02d}": distribute_tensor(torch.zeros(rows, 4096), mesh, [Shard(0)]) for i in range(TENSORS)}
    share = sum(tensor.to_local().nbytes for tensor in into.values())
    times: list[float] = []
    counted = rchar = 0
    for repetition in range(reps + 1):
        store = CountingStore(LocalStore(root))
        dist.barrier()
        before = kernel_read_bytes() or 0
        start = time.perf_counter()
        sk.load(name, into=into, storage=store)
        elapsed = time.perf_counter() - start
        if repetition:
            times.append(elapsed)
        counted = sum(n for path, n in store.bytes_read.items() if path.endswith(".safetensors"))
        rchar = (kernel_read_bytes() or 0) - before
    assert all(
        torch.equal(tensor.to_local(), torch.full_like(tensor.to_local(), i)) for i, tensor in enumerate(into.values())
    )
    return {"share": share, "read": counted, "rchar": rchar, "times": times}


def _block_size(path: Path) -> int:
    return max(record.block_size for record in sk.read_manifest(path).files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="16 x 1 MiB tensors, 1 repetition")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--dir", default=None, help="where to save (default: a temporary directory)")
    args = parser.parse_args()
    rows = 64 if args.quick else 1024
    reps = args.reps or (1 if args.quick else 3)
    rows_out: list[list[str]] = []
    worst: dict[str, float] = {}
    for saved_on in (2, 4):
        root = Path(tempfile.mkdtemp(prefix=f"sk-reshard-{saved_on}-", dir=args.dir))
        try:
            run_ranks(saved_on, _save, str(root), rows, out=root / "out-save")
            for name, label in (
                ("blocks", f"blocks ({fmt_bytes(_block_size(root / 'blocks'))})"),
                ("zero", "block_size=0"),
            ):
                loads = run_ranks(LOAD_RANKS, _load, str(root), name, rows, reps, out=root / f"out-{name}")
                for rank, result in enumerate(loads):
                    ratio = result["read"] / result["share"]
                    key = f"{saved_on}->3 {name}"
                    worst[key] = max(worst.get(key, 0.0), ratio)
                    rows_out.append(
                        [
                            f"{saved_on} -> {LOAD_RANKS}",
                            label,
                            str(rank),
                            fmt_bytes(result["share"]),
                            fmt_bytes(result["read"]),
                            f"{ratio:.3f}",
                            f"{result['rchar'] / result['share']:.3f}",
                            fmt_range(result["times"]),
                        ]
                    )
        finally:
            shutil.rmtree(root, ignore_errors=True)
    total = TENSORS * rows * 4096 * 4
    print(f"state: {TENSORS} x fp32 [{rows}, 4096] = {fmt_bytes(total)}; loaded on {LOAD_RANKS} ranks, verified (fast)")
    print(
        table(
            ["saved", "digests", "rank", "share", "bytes read", "read / share", "rchar / share", "load time"], rows_out
        )
    )
    print("worst read / share: " + ", ".join(f"{key} {value:.3f}" for key, value in worst.items()))


if __name__ == "__main__":
    main()
