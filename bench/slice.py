"""``load_slice`` of 1/8 of a 1 GiB tensor: bytes read from the store against 1/8 + one block.

One process saves a 1 GiB fp32 tensor (32,768 rows of 32 KiB) twice: with the default block
size (a whole tensor over 16 MiB gets 16 MiB blocks, fast-only) and with a forced
``WriteOptions(block_size=1 MiB)``. Then ``shardkeep.load_slice`` reads 1/8 of the rows, aligned
to a block and shifted by 100 rows (both ends inside a block), verified with the fast digest
(the default), and once with ``digest="cryptographic"`` (fast-only blocks cannot prove a
cryptographic digest: the whole file is read). Then two forked gloo ranks save the same tensor
as a ``Shard(0)`` DTensor (chunk blocks carry a strong half: the default block size of 512 MiB
chunks is 16 MiB), and the slices are read again, plus one across the two chunks. Bytes are counted through a byte store that
counts every ``read_into`` (and a ``map`` whole). For reference: ``shardkeep.load`` of the whole
tensor (``mmap=False``, verified). Warm page cache; each figure is the median (min-max) of
``--reps`` runs after one untimed run.

Run from the repository root::

    .venv/bin/python bench/slice.py               # 1 GiB, 5 repetitions (about a minute)
    .venv/bin/python bench/slice.py --quick       # 128 MiB, 2 repetitions
"""

from __future__ import annotations

import argparse
import datetime
import gc
import multiprocessing
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the repository root: examples/
from examples.store_probes import CountingStore as ProbeCountingStore

import shardkeep as sk
from common import fmt_bytes, fmt_range, table, touch_memory
from shardkeep.storage import LocalStore

MiB = 1 << 20


class CountingStore(ProbeCountingStore):
    """The example's counting store; ``data_bytes``: what was read from data files."""

    @property
    def data_bytes(self) -> int:
        return sum(n for path, n in self.bytes_read.items() if path.endswith(".safetensors"))


def _run(store_root: Path, call: Callable[[CountingStore], Any], reps: int) -> tuple[list[float], int]:
    call(CountingStore(LocalStore(str(store_root))))  # untimed: warms the cache, checks the result
    times: list[float] = []
    counted = 0
    for _ in range(reps):
        gc.collect()
        touch_memory(512 * MiB)
        store = CountingStore(LocalStore(str(store_root)))
        start = time.perf_counter()
        call(store)
        times.append(time.perf_counter() - start)
        counted = store.data_bytes
    return times, counted


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _full(rows: int) -> torch.Tensor:
    return torch.arange(rows * 8192, dtype=torch.float32).reshape(rows, 8192)


def _save_shard(rank: int, port: int, rows: int, path: str) -> None:
    """One of two forked ranks: save rows of the tensor as a ``Shard(0)`` DTensor."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=300)
    )
    mesh = init_device_mesh("cpu", (2,))
    half = rows // 2
    local = torch.arange(rank * half * 8192, (rank + 1) * half * 8192, dtype=torch.float32).reshape(half, 8192)
    sk.save({"w": DTensor.from_local(local, mesh, [Shard(0)])}, path)
    dist.destroy_process_group()
    os._exit(0)


def _save_sharded(rows: int, path: Path) -> None:
    context = multiprocessing.get_context("fork")
    port = free_port()
    ranks = [context.Process(target=_save_shard, args=(rank, port, rows, str(path))) for rank in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(600)
        if process.exitcode != 0:
            raise SystemExit(f"a saving rank failed (exit code {process.exitcode})")


def _cases(
    label: str, name: str, root: Path, nbytes: int, size: int, cases: list[tuple[str, slice, str | None]], reps: int
) -> list[list[str]]:
    out: list[list[str]] = []
    share = nbytes // 8
    for case, rows_slice, digest in cases:

        def call(store: CountingStore, r: slice = rows_slice, d: str | None = digest) -> Any:
            got = sk.load_slice(name, "w", r, storage=store, digest=d)  # type: ignore[arg-type]
            assert got.shape[0] == r.stop - r.start and torch.equal(got[0, :4], torch.arange(4) + r.start * 8192.0)
            return got

        times, counted = _run(root, call, reps)
        files = 2 if "across" in case else 1
        fits = counted <= share + files * (size + 64 * 1024)
        out.append(
            [label, case, fmt_range(times), fmt_bytes(counted), f"{counted / share:.3f}", "yes" if fits else "no"]
        )
    return out


def _chunk_block_size(path: Path) -> int:
    """The block size of the chunk files (``read_manifest`` lists the indexes' files)."""
    return max(record.block_size for record in sk.read_manifest(path).files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="128 MiB, 2 repetitions")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--dir", default=None, help="where to save (default: a temporary directory)")
    args = parser.parse_args()
    rows = 4096 if args.quick else 32768
    reps = args.reps or (2 if args.quick else 5)
    root = Path(tempfile.mkdtemp(prefix="sk-slice-", dir=args.dir))
    eighth = rows // 8
    out: list[list[str]] = []
    try:
        _save_sharded(rows, root / "sharded")  # forked first, before this process builds tensors
        tensor = _full(rows)
        nbytes = tensor.nbytes
        for label, block in (("default (16 MiB, fast-only)", None), ("forced 1 MiB", MiB)):
            name = f"b{block or 0}"
            sk.save({"w": tensor}, root / name, options=sk.WriteOptions(block_size=block))
            size = sk.read_manifest(root / name).files[0].block_size
            cases: list[tuple[str, slice, str | None]] = [
                ("1/8 aligned", slice(0, eighth), None),
                ("1/8 shifted 100 rows", slice(100, 100 + eighth), None),
                ("1/8, cryptographic", slice(0, eighth), "cryptographic"),
            ]
            out += _cases(label, name, root, nbytes, size, cases, reps)

            def whole(store: CountingStore, n: str = name) -> Any:
                return sk.load(n, storage=store, mmap=False)

            times, counted = _run(root, whole, reps)
            out.append([label, "whole load (mmap=False)", fmt_range(times), fmt_bytes(counted), "8.000", "-"])
            shutil.rmtree(root / name)
        del tensor
        size = _chunk_block_size(root / "sharded")
        middle = rows // 2 - eighth // 2 + 100
        cases = [
            ("1/8 aligned", slice(0, eighth), None),
            ("1/8 shifted 100 rows", slice(100, 100 + eighth), None),
            ("1/8, cryptographic", slice(0, eighth), "cryptographic"),
            ("1/8 shifted, cryptographic", slice(100, 100 + eighth), "cryptographic"),
            ("1/8 across both chunks", slice(middle, middle + eighth), None),
        ]
        out += _cases(f"2 ranks, Shard(0) ({fmt_bytes(size)} blocks)", "sharded", root, nbytes, size, cases, reps)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"tensor: {fmt_bytes(nbytes)} fp32 [{rows}, 8192]; 1/8 = {fmt_bytes(nbytes // 8)}")
    print(table(["blocks", "read", "time", "bytes read", "/ (1/8)", "<= 1/8 + 1 block + header"], out))


if __name__ == "__main__":
    main()
