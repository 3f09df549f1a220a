"""Incremental saves and partial (hot-tier) loads against full saves and loads, in one run.

The workload is a mixture-of-experts state: dense layers and routers (the "hot" tier, about 10%
of the bytes) and 64 experts (the "cold" tier, in a second directory). Between two saves, 10%
of the experts change (the other 90% are frozen).

Saves (each on the same state, fsynced before the clock stops):

* ``torch.save``, ``safetensors`` and ``DCP``: a full save, as those libraries can only do;
* ``shardkeep full``: a full save with tiers (``incremental=True`` layout, no base);
* ``shardkeep incremental``: the save after 10% of the experts changed, against the previous
  checkpoint: unchanged files are referenced, not written (their digests are still computed);
* ``shardkeep incremental, trust_versions``: the same save with ``trust_versions=True``: files
  whose tensors' version counters did not move since the full save are referenced without
  hashing them (the target: at most 0.15x the full save).

Loads (warm page cache; every loader touches every page it returns):

* full loads with ``torch.load(mmap)``, ``safetensors`` and ``DCP``, and ``shardkeep`` (all tiers);
* ``shardkeep hot``: ``load(path, select=LoadSelection(tiers={"hot"}))``, which reads only the hot tier's files.

Steps are interleaved and repeated; each ratio is computed per repetition and reported as
median (min-max). Run: ``make bench-tiers`` or ``.venv/bin/python bench/tiers.py [--quick]
[--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp

import shardkeep as sk

sys.path.insert(0, str(Path(__file__).resolve().parent))
from save_load import fsync_path, fsync_tree, pretouch, touch_pages

RULES = [("*.experts.*", "cold"), ("*", "hot")]
TRUSTED = "shardkeep incremental, trust_versions"
TARGET = 0.15  # the trusted incremental save, as a fraction of the full save


def build_state(layers: int, experts_per_layer: int, width: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    for layer in range(layers):
        state[f"layers.{layer}.attn.qkv"] = torch.randn(3 * width, width, generator=generator)
        state[f"layers.{layer}.router.weight"] = torch.randn(experts_per_layer, width, generator=generator)
        for expert in range(experts_per_layer):
            state[f"layers.{layer}.experts.{expert}.w_in"] = torch.randn(
                width, width // 2 + width // 4, generator=generator
            )
    return state


def change_experts(state: dict[str, torch.Tensor], fraction: float, round_number: int) -> None:
    experts = sorted(key for key in state if ".experts." in key)
    count = max(1, round(len(experts) * fraction))
    for key in experts[round_number * count % len(experts) :][:count]:
        state[key].add_(0.001)


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.nbytes for t in state.values())


def timed(work: Callable[[], Any], pretouch_bytes: int) -> float:
    pretouch(pretouch_bytes)
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def one_repetition(
    here: Path,
    state: dict[str, torch.Tensor],
    rep: int,
    pretouch_bytes: int,
    saves: dict[str, list[float]],
    loads: dict[str, list[float]],
    written: list[float],
    trusted_written: list[float],
) -> None:
    """Every save, then every load, once, interleaved; the directory is removed afterwards."""
    cold = here / "cold"
    tiers = [sk.Tier(tier_id=1, name="hot"), sk.Tier(tier_id=2, name="cold", location=str(cold))]
    root = here / "root"
    total = nbytes(state)

    def torch_save() -> None:
        with open(here / "model.pt", "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())

    def st_save() -> None:
        safetensors.torch.save_file(state, str(here / "model.safetensors"))
        fsync_path(str(here / "model.safetensors"))

    def dcp_save() -> None:
        dcp.save(state, checkpoint_id=str(here / "dcp"))
        fsync_tree(str(here / "dcp"))

    def sk_full() -> None:  # trust_versions records each file's proof: a few µs per tensor
        sk.save(
            state,
            root / "step_00000001",
            tiers=sk.TierPlan(tiers=tiers, placement=RULES),
            incremental=sk.Incremental(trust_versions=True),
        )

    def sk_incremental() -> None:
        manifest = sk.save(
            state,
            root / "step_00000002",
            tiers=sk.TierPlan(tiers=tiers, placement=RULES),
            incremental=root / "step_00000001",
        )
        written.append(sum(r.size for r in manifest.files if r.ref is None) / total)

    def sk_trusted() -> None:
        manifest = sk.save(
            state,
            root / "step_00000003",
            tiers=sk.TierPlan(tiers=tiers, placement=RULES),
            incremental=sk.Incremental(base=root / "step_00000001", trust_versions=True),
        )
        trusted_written.append(sum(r.size for r in manifest.files if r.ref is None) / total)

    here.mkdir()
    try:
        for name, work in (
            ("torch.save", torch_save),
            ("safetensors", st_save),
            ("DCP", dcp_save),
            ("shardkeep full", sk_full),
        ):
            saves.setdefault(name, []).append(timed(work, pretouch_bytes))
        change_experts(state, 0.10, rep)
        saves.setdefault("shardkeep incremental", []).append(timed(sk_incremental, pretouch_bytes))
        saves.setdefault(TRUSTED, []).append(timed(sk_trusted, pretouch_bytes))
        target = {key: torch.empty_like(value) for key, value in state.items()}

        def dcp_load() -> None:
            dcp.load(target, checkpoint_id=str(here / "dcp"))
            touch_pages(target)

        loaders: list[tuple[str, Callable[[], Any]]] = [
            ("torch.load mmap", lambda: touch_pages(torch.load(here / "model.pt", mmap=True, weights_only=True))),
            ("safetensors", lambda: touch_pages(safetensors.torch.load_file(str(here / "model.safetensors")))),
            ("DCP", dcp_load),
            ("shardkeep full", lambda: touch_pages(sk.load(root / "step_00000002"))),
            (
                "shardkeep hot",
                lambda: touch_pages(sk.load(root / "step_00000002", select=sk.LoadSelection(tiers={"hot"}))),
            ),
        ]
        for name, work in loaders:
            loads.setdefault(name, []).append(timed(work, pretouch_bytes))
    finally:
        shutil.rmtree(here, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small state and 3 repetitions")
    parser.add_argument("--repeat", type=int, default=None)
    parser.add_argument("--json", help="also write the results as JSON to this path")
    args = parser.parse_args()
    layers, experts, width = (4, 16, 256) if args.quick else (8, 16, 1024)
    repeat = args.repeat or (3 if args.quick else 5)
    state = build_state(layers, experts, width)
    total = nbytes(state)
    hot = sum(t.nbytes for k, t in state.items() if ".experts." not in k)
    print(f"state: {len(state)} tensors, {total / 1e6:.0f} MB; hot tier {hot / total:.0%} of it; {repeat} repetitions")
    print(f"load average at start: {os.getloadavg()}")
    scratch = Path(tempfile.mkdtemp(prefix="sk-bench-tiers-", dir=os.environ.get("BENCH_DIR")))
    pretouch_bytes = 2 * 2**30 if not args.quick else 256 * 2**20
    saves: dict[str, list[float]] = {}
    loads: dict[str, list[float]] = {}
    written: list[float] = []
    trusted_written: list[float] = []
    try:
        for rep in range(repeat):
            one_repetition(scratch / f"rep{rep}", state, rep, pretouch_bytes, saves, loads, written, trusted_written)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    def report(title: str, results: dict[str, list[float]], baseline: str) -> None:
        print(f"\n{title} (ratio = time / {baseline} time, per repetition; median (min-max))")
        for name, times in results.items():
            ratios = [t / b for t, b in zip(times, results[baseline], strict=True)]
            print(
                f"  {name:24s} {statistics.median(times) * 1e3:8.1f} ms   "
                f"{statistics.median(ratios):5.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
            )

    report("save", saves, "shardkeep full")
    print(f"  incremental save wrote {statistics.median(written):.1%} of the bytes (10% of experts changed)")
    ratios = [t / b for t, b in zip(saves[TRUSTED], saves["shardkeep full"], strict=True)]
    verdict = "met" if statistics.median(ratios) <= TARGET else "NOT MET"
    print(
        f"  [{verdict}] {TRUSTED} <= {TARGET}x the full save: {statistics.median(ratios):.2f}x"
        f" ({min(ratios):.2f}-{max(ratios):.2f}); it wrote {statistics.median(trusted_written):.1%} of the bytes"
    )
    report("load (warm cache)", loads, "shardkeep full")
    print(f"\nload average at end: {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(
                {
                    "command": [sys.executable, *sys.argv],
                    "saves": saves,
                    "loads": loads,
                    "written": written,
                    "trusted_written": trusted_written,
                    "trusted_ratios": ratios,
                    "target": TARGET,
                },
                handle,
                indent=2,
            )
        print(f"results written to {args.json}")


if __name__ == "__main__":
    main()
