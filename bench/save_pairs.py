"""The durable save of two shardkeep trees in alternating pairs: finer than ``before_after.py``
when the question is a few percent on one measure.

One persistent process per tree (``PYTHONPATH=<tree>/src``) builds ``save_load.py``'s
``1GiB-mixed`` workload once, saves it once untimed, then saves it once per pair, the trees
taking turns to go first; before each save the garbage collector runs and 2.5 GiB of memory is
touched and freed (as ``save_load.py`` does). The save is ``save_load.py``'s shardkeep contender
(``O_DIRECT``, fsynced). Printed: each pair, each tree's median (min-max), and the per-pair
ratio ``--src`` / ``--base-src`` (median, min-max; above 1: ``--src`` is slower).

    .venv/bin/python bench/save_pairs.py --base-src /path/to/base/src --pairs 16
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def _save_load() -> Any:
    spec = importlib.util.spec_from_file_location("save_load", os.path.join(HERE, "save_load.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["save_load"] = module
    spec.loader.exec_module(module)
    return module


def worker(size_mib: int, directory: str | None) -> None:
    """One tree's side: build the workload, then one timed save per line read from stdin."""
    bench = _save_load()
    import shardkeep

    workload = bench.build_mixed_workload(size_mib * bench.MiB)
    scratch = tempfile.mkdtemp(prefix="save-pairs-", dir=directory)
    print("ready", shardkeep.__file__, flush=True)
    try:
        for count, _ in enumerate(sys.stdin):
            path = os.path.join(scratch, f"c{count}")
            gc.collect()
            bench.pretouch(int(2.5 * bench.GiB))
            gc.collect()
            start = time.perf_counter()
            bench.save_shardkeep(workload, path)
            elapsed = time.perf_counter() - start
            shutil.rmtree(path)
            print(f"{elapsed:.4f}", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _spread(values: list[float], unit: str = "") -> str:
    return f"{statistics.median(values):.3f}{unit} ({min(values):.3f}-{max(values):.3f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-src", required=True, help="the src/ directory of the tree to compare with")
    parser.add_argument("--src", default=os.path.join(os.path.dirname(HERE), "src"), help="this tree's src/ (default)")
    parser.add_argument("--pairs", type=int, default=16, help="alternating pairs of timed saves (default 16)")
    parser.add_argument("--size-mib", type=int, default=1024, help="workload size (default 1024: 1GiB-mixed)")
    parser.add_argument("--dir", help="scratch directory (default: the system's temporary directory)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.size_mib, args.dir)
        return 0
    sides = {"base": os.path.abspath(args.base_src), "this": os.path.abspath(args.src)}
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        "--base-src",
        "-",
        "--size-mib",
        str(args.size_mib),
    ]
    command += ["--dir", args.dir] if args.dir else []
    processes: dict[str, subprocess.Popen[str]] = {}
    for name, src in sides.items():
        environment = dict(os.environ, PYTHONPATH=src)
        process = subprocess.Popen(command, env=environment, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert process.stdout is not None
        ready = process.stdout.readline()
        if not ready.startswith("ready") or src not in ready:
            raise SystemExit(f"{name}: the worker did not import shardkeep from {src}: {ready!r}")
        processes[name] = process

    def save(name: str) -> float:
        process = processes[name]
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write("go\n")
        process.stdin.flush()
        return float(process.stdout.readline())

    for name in sides:
        save(name)  # untimed
    times: dict[str, list[float]] = {name: [] for name in sides}
    ratios: list[float] = []
    for pair in range(args.pairs):
        order = list(sides) if pair % 2 == 0 else list(reversed(sides))
        got = {name: save(name) for name in order}
        for name, seconds in got.items():
            times[name].append(seconds)
        ratios.append(got["this"] / got["base"])
        print(f"pair {pair:2d}: base {got['base']:.3f} s, this {got['this']:.3f} s", flush=True)
    for process in processes.values():
        assert process.stdin is not None
        process.stdin.close()
        process.wait()
    print(f"base {sides['base']}: {_spread(times['base'], ' s')}")
    print(f"this {sides['this']}: {_spread(times['this'], ' s')}")
    print(f"per-pair ratio this/base: {_spread(ratios)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
