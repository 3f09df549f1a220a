"""Two-rank checkpointing: shardkeep against torch.distributed.checkpoint (DCP), same data, one run.

Two forked ranks join a gloo process group on 127.0.0.1. Each holds half of a 1 GiB state of
fp32 ``DTensor``\\ s sharded row-wise (``Shard(0)``), as FSDP2 or tensor parallelism produce.
Per repetition, in a fixed order, it measures:

* **durable save**: ``sk.save`` (fsyncs files and directories, commits by rename) against
  ``dcp.save`` followed by an fsync of every file each rank wrote (the clock stops after the
  fsyncs and a barrier);
* **async blocking time**: how long ``sk.async_save`` / ``dcp.async_save`` hold the caller
  before training could continue, and the total time until the save is complete;
* **load**: ``sk.load(..., into=)`` (verifying every chunk's blake3 digest) against ``dcp.load``
  into preallocated DTensors of zeros; warm: every file of both checkpoints is read once,
  untimed, before the timed load (shardkeep's ``O_DIRECT`` writes leave its large files out of
  the page cache, DCP's buffered writes leave its files in).

Each figure is the slowest rank's time. Ratios are per repetition, reported as median
(min-max). Before each timed step each rank touches and frees 1 GiB of memory (first-touch
memory is slow on these VMs). Run from the repository root::

    .venv/bin/python bench/distributed.py             # 1 GiB, 5 repetitions (a few minutes)
    .venv/bin/python bench/distributed.py --quick     # 128 MiB, 2 repetitions
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import multiprocessing
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import shardkeep as sk

MiB = 1 << 20
GiB = 1 << 30
WORLD = 2
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def make_state(mesh: Any, total_bytes: int, rank: int, *, zeros: bool) -> dict[str, DTensor]:
    """Eight row-sharded fp32 matrices holding ``total_bytes`` in all (half on each rank)."""
    count = 8
    columns = 4096
    rows = max(WORLD, total_bytes // count // columns // 4)
    generator = torch.Generator().manual_seed(1000 + rank)
    state = {}
    for index in range(count):
        local_rows = rows // WORLD
        local = torch.zeros(local_rows, columns) if zeros else torch.randn(local_rows, columns, generator=generator)
        state[f"layer{index}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    return state


def pretouch(nbytes: int) -> None:
    block = bytearray(nbytes)
    del block
    gc.collect()


def fsync_tree(root: str, rank: int) -> None:
    """fsync the files this rank wrote (DCP names them __<rank>_*.distcp), plus the metadata on rank 0."""
    for directory, _, files in os.walk(root):
        for name in files:
            mine = name.startswith(f"__{rank}_") or (rank == 0 and not name.startswith("__"))
            if mine:
                fd = os.open(os.path.join(directory, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)


def slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def timed(fn: Any) -> float:
    dist.barrier()
    started = time.perf_counter()
    fn()
    dist.barrier()
    return slowest(time.perf_counter() - started)


def rank_main(rank: int, port: int, scratch: str, total_bytes: int, reps: int, touch: int, out: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=600),
    )
    mesh = init_device_mesh("cpu", (WORLD,))
    state = make_state(mesh, total_bytes, rank, zeros=False)
    target = make_state(mesh, total_bytes, rank, zeros=True)
    nbytes = sum(t.to_local().nbytes for t in state.values()) * WORLD
    results: dict[str, list[float]] = {}

    def record(name: str, seconds: float) -> None:
        results.setdefault(name, []).append(seconds)

    def fresh(name: str, rep: int) -> str:
        path = os.path.join(scratch, f"{name}-{rep}")
        return path

    def clean() -> None:
        dist.barrier()
        if rank == 0:
            for entry in os.listdir(scratch):
                shutil.rmtree(os.path.join(scratch, entry), ignore_errors=True)
        dist.barrier()

    # Untimed warm-up of both libraries (imports, first-call costs, the gloo group).
    sk.save(state, fresh("warm-sk", 0))
    dcp.save(state, checkpoint_id=fresh("warm-dcp", 0))
    clean()
    for rep in range(reps):
        sk_path, dcp_path = fresh("sk", rep), fresh("dcp", rep)

        def sk_save(path: str = sk_path) -> None:
            sk.save(state, path)

        def dcp_save(path: str = dcp_path) -> None:
            dcp.save(state, checkpoint_id=path)
            fsync_tree(path, rank)

        def sk_load(path: str = sk_path) -> None:
            sk.load(path, into=target)

        def dcp_load(path: str = dcp_path) -> None:
            dcp.load(target, checkpoint_id=path)

        for name, step in (
            ("shardkeep save", sk_save),
            ("DCP save", dcp_save),
            ("shardkeep load", sk_load),
            ("DCP load", dcp_load),
        ):
            if name.endswith("load"):
                # Warm for both: shardkeep wrote its large files with O_DIRECT, which leaves them
                # out of the page cache, while DCP's are still there from its buffered write.
                warm_tree(sk_path if name.startswith("shardkeep") else dcp_path, rank)
            pretouch(touch)
            record(name, timed(step))

        pretouch(touch)
        dist.barrier()
        started = time.perf_counter()
        handle = sk.async_save(state, fresh("sk-async", rep))
        blocked = time.perf_counter() - started
        handle.result(timeout=600)
        dist.barrier()
        record("shardkeep async blocking", slowest(blocked))
        record("shardkeep async total", slowest(time.perf_counter() - started))

        pretouch(touch)
        dcp_async_path = fresh("dcp-async", rep)
        dist.barrier()
        started = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=dcp_async_path)
        blocked = time.perf_counter() - started
        future.result()
        fsync_tree(dcp_async_path, rank)
        dist.barrier()
        record("DCP async blocking", slowest(blocked))
        record("DCP async total", slowest(time.perf_counter() - started))
        clean()
        if rank == 0:
            print(f"  repetition {rep + 1}/{reps} done", flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps({"bytes": nbytes, "results": results}))
    dist.barrier()
    dist.destroy_process_group()


def warm_tree(root: str, rank: int) -> None:
    """Read every file under ``root`` once (rank 0 the first half, rank 1 the rest), so that it is
    in the page cache; then wait for the other rank."""
    names = sorted(os.path.join(d, f) for d, _, files in os.walk(root) for f in files)
    for name in names[rank::2]:
        with open(name, "rb", buffering=0) as file:
            while file.read(64 << 20):
                pass
    dist.barrier()


def ratio_summary(numerator: list[float], denominator: list[float]) -> str:
    ratios = [n / d for n, d in zip(numerator, denominator, strict=True)]
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="128 MiB and 2 repetitions")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--json", default=None, help="also write the results as JSON")
    args = parser.parse_args()
    total = 128 * MiB if args.quick else GiB
    reps = args.reps or (2 if args.quick else 5)
    touch = 256 * MiB if args.quick else GiB
    scratch = tempfile.mkdtemp(prefix="shardkeep-dist-bench-", dir=args.dir)
    out = os.path.join(scratch, "results.json")
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    print(f"torch {torch.__version__}, shardkeep {getattr(sk, '__version__', '?')}, ranks {WORLD} (gloo, forked)")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"state: {total / GiB:.3f} GiB of fp32 DTensors, Shard(0) over {WORLD} ranks; {reps} repetitions", flush=True)
    work = os.path.join(scratch, "work")
    os.mkdir(work)
    context = multiprocessing.get_context("fork")
    port = free_port()
    ranks = [context.Process(target=rank_main, args=(r, port, work, total, reps, touch, out)) for r in range(WORLD)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join()
    if any(process.exitcode != 0 for process in ranks):
        raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in ranks]}")
    data = json.loads(Path(out).read_text())
    shutil.rmtree(scratch, ignore_errors=True)
    results, nbytes = data["results"], data["bytes"]
    print()
    print(f"{'measure':28} {'median s':>10} {'GB/s or s/GiB':>16}")
    for name, values in results.items():
        median = statistics.median(values)
        rate = f"{median / (nbytes / GiB):.3f} s/GiB" if "blocking" in name else f"{nbytes / median / 1e9:.2f} GB/s"
        print(f"{name:28} {median:10.3f} {rate:>16}")
    print()
    print("ratios (median (min-max) of per-repetition ratios):")
    save = ratio_summary(results["DCP save"], results["shardkeep save"])
    load = ratio_summary(results["DCP load"], results["shardkeep load"])
    blocking = ratio_summary(results["shardkeep async blocking"], results["DCP async blocking"])
    print(f"  durable save, shardkeep speedup over DCP: {save}   (target >= 1.5x)")
    print(f"  load, shardkeep speedup over DCP:         {load}   (target >= 1.5x)")
    print(f"  async blocking, shardkeep / DCP:          {blocking}   (target <= 0.5x)")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=2))


if __name__ == "__main__":
    main()
