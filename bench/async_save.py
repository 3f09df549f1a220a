"""How long ``sk.async_save`` blocks training, and where that time goes.

For each state size (default 4 MiB, 64 MiB and 1 GiB of fp32 tensors of 1 MiB each, plus a
step counter) and each world size (1 process, and 3 forked gloo ranks on 127.0.0.1), it runs
``--reps`` async saves one after another into fresh paths, each after ``--think`` seconds of
"training", and reports per save:

* **blocked**: ``SaveHandle.blocked_seconds``, the time from the call until it returned (what
  training waits for; starting the background thread included); on several ranks the slowest
  rank's;
* **copy**: the staging copy alone (``snapshot_state`` inside the first step), measured by
  timing that function;
* **blocked - copy**: everything else on the critical path, the figure the target bounds
  (<= 15 ms for 4 MiB), computed per rank and then the slowest;
* **total**: from the call until ``result()`` returned (the save committed);
* the time spent in each collective step of the blocked part (``Coordinator.step`` labels),
  measured by wrapping ``Coordinator.step``; this instrumentation lives in this script only.

Each figure is the median (min-max) over the repetitions after the first (the first save of a
process pays one-time costs: the dedicated gloo group, the staging arena's first touch; it is
shown separately). Run from the repository root::

    .venv/bin/python bench/async_save.py                    # 4 MiB, 64 MiB, 1 GiB; 1 and 3 ranks
    .venv/bin/python bench/async_save.py --quick            # 4 MiB and 64 MiB, fewer repetitions
    .venv/bin/python bench/async_save.py --json out.json
    .venv/bin/python bench/async_save.py --manager          # through CheckpointManager.async_save
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import socket
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fmt_range, median, table

MiB = 1 << 20
#: Save through ``CheckpointManager.async_save`` (``--manager``), as the demo does.
MANAGER = False
warnings.filterwarnings("ignore", category=UserWarning)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def make_state(total_bytes: int, rank: int) -> dict[str, Any]:
    count = max(1, total_bytes // MiB)
    per = total_bytes // count // 4
    return {"layers": {str(i): torch.full((per,), float(rank + i)) for i in range(count)}, "step": 0}


def instrument() -> tuple[dict[str, float], dict[str, float]]:
    """Wrap ``Coordinator.step`` and ``snapshot_state`` to time each step of the blocked part
    (returns the dicts the wrappers fill: step label -> seconds, and ``copy`` -> seconds)."""
    import shardkeep.async_saving as async_saving
    from shardkeep.distributed.coordinator import Coordinator

    steps: dict[str, float] = {}
    copy: dict[str, float] = {}
    original_snapshot = async_saving.snapshot_state

    def timed_by_label(original: Any) -> Any:
        """``original`` (a Coordinator method taking a label), timed per label on the main thread."""

        def timed(self: Any, label: str, work: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(self, label, work)
            finally:
                if threading_main():
                    steps[label] = steps.get(label, 0.0) + time.perf_counter() - started

        return timed

    def snapshot(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return original_snapshot(*args, **kwargs)
        finally:
            copy["copy"] = copy.get("copy", 0.0) + time.perf_counter() - started

    Coordinator.step = timed_by_label(Coordinator.step)  # type: ignore[method-assign]
    Coordinator.on_coordinator = timed_by_label(Coordinator.on_coordinator)  # type: ignore[method-assign]
    async_saving.snapshot_state = snapshot  # type: ignore[assignment]
    return steps, copy


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def run_saves(rank: int, world: int, scratch: str, total_bytes: int, reps: int, think: float) -> list[dict[str, Any]]:
    import shardkeep as sk

    steps, copy = instrument()
    state = make_state(total_bytes, rank)
    results = []
    handle: Any = None
    manager = (
        sk.CheckpointManager(os.path.join(scratch, f"{total_bytes}-{world}-root"), keep_last=2) if MANAGER else None
    )
    for rep in range(reps):
        if handle is not None:
            handle.result(600)
        time.sleep(think)  # training between saves: the previous save's writes are done
        steps.clear()
        copy.clear()
        state["step"] = rep
        path = os.path.join(scratch, f"{total_bytes}-{world}", f"step_{rep:08d}")
        started = time.perf_counter()
        if manager is not None:
            handle = manager.async_save(state, step=rep + 1, metrics={"val_loss": 1.0 / (rep + 1)})
        else:
            handle = sk.async_save(state, path)
        returned = time.perf_counter()
        handle.result(600)
        done = time.perf_counter()
        results.append(
            {
                "beyond": handle.blocked_seconds - copy.get("copy", 0.0),
                "blocked": handle.blocked_seconds,
                "call": returned - started,
                "copy": copy.get("copy", 0.0),
                "total": done - started,
                "steps": dict(steps),
            }
        )
    return results


def rank_main(
    rank: int, world: int, port: int, scratch: str, total_bytes: int, reps: int, think: float, out: str
) -> None:
    import torch.distributed as dist

    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = run_saves(rank, world, scratch, total_bytes, reps, think)
        with open(f"{out}.{rank}", "w") as handle:
            json.dump(results, handle)
    finally:
        if world > 1:
            dist.destroy_process_group()


def measure(world: int, total_bytes: int, reps: int, think: float) -> list[dict[str, Any]]:
    """Per repetition: the slowest rank's figures (each step: the slowest rank's time)."""
    scratch = tempfile.mkdtemp(prefix="sk-async-bench-", dir=os.environ.get("BENCH_DIR"))
    try:
        # Every point runs in fresh forked processes, one process too: this one never starts the
        # async saver's threads, which a fork would copy in whatever state they were.
        out = os.path.join(scratch, "result")
        context = multiprocessing.get_context("fork")
        port = free_port()
        workers = [
            context.Process(target=rank_main, args=(rank, world, port, scratch, total_bytes, reps, think, out))
            for rank in range(world)
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(900)
        if any(worker.exitcode != 0 for worker in workers):
            for worker in workers:  # a hung rank must not keep the benchmark (or make bench) alive
                if worker.is_alive():
                    worker.kill()
                    worker.join()
            raise RuntimeError(f"a rank failed or hung: exit codes {[worker.exitcode for worker in workers]}")
        per_rank = []
        for rank in range(world):
            with open(f"{out}.{rank}") as handle:
                per_rank.append(json.load(handle))
        merged = []
        for rep in range(reps):
            runs = [ranks[rep] for ranks in per_rank]
            labels = {label for run in runs for label in run["steps"]}
            merged.append(
                {key: max(run[key] for run in runs) for key in ("blocked", "call", "copy", "total")}
                # Beyond the copy per rank, then the slowest: the two maxima may be other ranks'.
                | {"beyond": max(run["blocked"] - run["copy"] for run in runs)}
                | {"steps": {label: max(run["steps"].get(label, 0.0) for run in runs) for label in labels}}
            )
        return merged
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=None, help="MiB, comma-separated (default 4,64,1024; --quick 4,64)")
    parser.add_argument("--worlds", default="1,3", help="world sizes, comma-separated (default 1,3)")
    parser.add_argument("--reps", type=int, default=None, help="saves per point (default 6; --quick 4)")
    parser.add_argument("--think", type=float, default=0.2, help="seconds of 'training' between saves")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None, help="write every figure to this file")
    parser.add_argument("--manager", action="store_true", help="save through CheckpointManager.async_save")
    args = parser.parse_args()
    global MANAGER
    MANAGER = args.manager
    sizes = [int(s) for s in (args.sizes or ("4,64" if args.quick else "4,64,1024")).split(",")]
    worlds = [int(w) for w in args.worlds.split(",")]
    reps = args.reps or (4 if args.quick else 6)
    print(
        f"bench/async_save.py  {time.strftime('%Y-%m-%d %H:%M:%S')}  torch {torch.__version__}  load {os.getloadavg()}"
    )
    figures: dict[str, Any] = {}
    rows = []
    for world in worlds:
        for size in sizes:
            runs = measure(world, size * MiB, reps, args.think)
            first, rest = runs[0], runs[1:] or runs
            blocked = [run["blocked"] for run in rest]
            copy = [run["copy"] for run in rest]
            other = [run["beyond"] for run in rest]
            total = [run["total"] for run in rest]
            steps: dict[str, list[float]] = defaultdict(list)
            for run in rest:
                for label, seconds in run["steps"].items():
                    steps[label].append(seconds)
            figures[f"{size}MiB-{world}"] = {"runs": runs}
            rows.append(
                [
                    str(world),
                    f"{size} MiB",
                    fmt_range(blocked, ms),
                    fmt_range(copy, ms),
                    fmt_range(other, ms),
                    "met" if size == 4 and median(other) <= 0.015 else ("not met" if size == 4 else "-"),
                    fmt_range(total, ms),
                    ms(first["blocked"]),
                ]
            )
            print(
                f"  ranks {world}, {size} MiB: steps of the blocked part (median): "
                + ", ".join(f"{label} {ms(median(values))}" for label, values in sorted(steps.items()))
            )
    headers = ["ranks", "state", "blocked", "copy", "blocked - copy", "<= 15 ms", "total", "first save blocked"]
    print(table(headers, rows))
    print("median (min-max) over the saves after the first; several ranks: the slowest rank's figure per save")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(figures, handle, indent=2)


if __name__ == "__main__":
    main()
