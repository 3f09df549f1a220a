"""``load_slice`` of 1/8 of a 1 GiB tensor: bytes read from the store against 1/8 + one block.

One process saves a 1 GiB fp32 tensor (32,768 rows of 32 KiB) twice: with the default block
size (a whole tensor over 16 MiB gets 16 MiB blocks, fast-only) and with a forced
``WriteOptions(block_size=1 MiB)``. Then ``shardkeep.load_slice`` reads 1/8 of the rows, aligned
to a block and shifted by 100 rows (both ends inside a block), verified with the fast digest
(the default), and once with ``digest="cryptographic"`` (fast-only blocks cannot prove a
cryptographic digest: the whole file is read). Bytes are counted through a byte store that
counts every ``read_into`` (and a ``map`` whole). For reference: ``shardkeep.load`` of the whole
tensor (``mmap=False``, verified). Warm page cache; each figure is the median (min-max) of
``--reps`` runs after one untimed run.

Run from the repository root::

    .venv/bin/python bench/slice.py               # 1 GiB, 5 repetitions (about a minute)
    .venv/bin/python bench/slice.py --quick       # 128 MiB, 2 repetitions
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shardkeep as sk
from common import fmt_bytes, fmt_range, table, touch_memory
from shardkeep.storage import ForwardingStore, LocalStore, ReadHandle

MiB = 1 << 20


class _Counted:
    def __init__(self, handle: ReadHandle, count: Callable[[int], None]) -> None:
        self._handle, self._count, self.size = handle, count, handle.size

    def map(self) -> memoryview:
        self._count(self.size)
        return self._handle.map()

    def read_into(self, offset: int, buffer: memoryview, /) -> None:
        self._handle.read_into(offset, buffer)
        self._count(buffer.nbytes)

    def close(self) -> None:
        self._handle.close()


class CountingStore(ForwardingStore):
    """Counts the bytes read from data files."""

    def __init__(self, inner: LocalStore) -> None:
        super().__init__(inner)
        self.lock = threading.Lock()
        self.data_bytes = 0

    def open_read(self, path: str) -> ReadHandle:
        handle = self.inner.open_read(path)
        if not path.endswith(".safetensors"):
            return handle

        def count(size: int) -> None:
            with self.lock:
                self.data_bytes += size

        return _Counted(handle, count)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="128 MiB, 2 repetitions")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--dir", default=None, help="where to save (default: a temporary directory)")
    args = parser.parse_args()
    rows = 4096 if args.quick else 32768
    reps = args.reps or (2 if args.quick else 5)
    tensor = torch.arange(rows * 8192, dtype=torch.float32).reshape(rows, 8192)
    eighth = rows // 8
    root = Path(tempfile.mkdtemp(prefix="sk-slice-", dir=args.dir))
    out: list[list[str]] = []
    try:
        for label, block in (("default (16 MiB, fast-only)", None), ("forced 1 MiB", MiB)):
            name = f"b{block or 0}"
            sk.save({"w": tensor}, root / name, options=sk.WriteOptions(block_size=block))
            record = sk.read_manifest(root / name).files[0]
            size = record.block_size
            cases: list[tuple[str, slice, str | None]] = [
                ("1/8 aligned", slice(0, eighth), None),
                ("1/8 shifted 100 rows", slice(100, 100 + eighth), None),
                ("1/8, cryptographic", slice(0, eighth), "cryptographic"),
            ]
            for case, rows_slice, digest in cases:

                def call(store: CountingStore, r: slice = rows_slice, d: str | None = digest, n: str = name) -> Any:
                    got = sk.load_slice(n, "w", r, storage=store, digest=d)  # type: ignore[arg-type]
                    assert got.shape == (eighth, 8192)
                    return got

                times, counted = _run(root, call, reps)
                share = tensor.nbytes // 8
                out.append([
                    label, case, fmt_range(times), fmt_bytes(counted), f"{counted / share:.3f}",
                    "yes" if counted <= share + size + 64 * 1024 else "no",
                ])  # fmt: skip

            def whole(store: CountingStore, n: str = name) -> Any:
                return sk.load(n, storage=store, mmap=False)

            times, counted = _run(root, whole, reps)
            out.append([label, "whole load (mmap=False)", fmt_range(times), fmt_bytes(counted), "8.000", "-"])
            shutil.rmtree(root / name)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"tensor: {fmt_bytes(tensor.nbytes)} fp32 [{rows}, 8192]; 1/8 = {fmt_bytes(tensor.nbytes // 8)}")
    print(table(["blocks", "read", "time", "bytes read", "/ (1/8)", "<= 1/8 + 1 block + header"], out))


if __name__ == "__main__":
    main()
