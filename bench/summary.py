"""One table of every performance target, met or not, from the JSON the benchmarks wrote.

``make bench`` runs ``bench/save_load.py``, ``bench/distributed.py``, ``bench/async_save.py``,
``bench/cold_start.py``, ``bench/memory.py`` and ``bench/tiers.py`` with ``--json DIR/<name>.json``, then this
script::

    .venv/bin/python bench/summary.py DIR

A benchmark whose JSON is missing (not run, or failed) shows its targets as "not measured".
Targets whose lever is not built yet are listed as such, so the table is the whole list.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import table

Row = tuple[str, str, str, str]  # target, measured, bound, verdict


def _load(directory: str, name: str) -> Any:
    path = os.path.join(directory, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as handle:
        return json.load(handle)


def _ratio_rows(data: Any) -> list[Row]:
    rows = []
    for target in data["targets"]:
        rows.append(
            (
                f"{target['description']} ({target['workload']})",
                f"{target['median']:.2f}x",
                f">= {target['minimum']:g}x",
                "met" if target["met"] else "not met",
            )
        )
    return rows


def _distributed_rows(data: Any) -> list[Row]:
    results = data["results"]

    def ratio(numerator: str, denominator: str) -> float:
        return statistics.median(a / b for a, b in zip(results[numerator], results[denominator], strict=True))

    save = ratio("DCP save", "shardkeep save")
    load = ratio("DCP load", "shardkeep load")
    return [
        ("2-rank durable save vs DCP (bench/distributed.py)", f"{save:.2f}x", ">= 1.5x", _verdict(save >= 1.5)),
        ("2-rank load vs DCP (bench/distributed.py)", f"{load:.2f}x", ">= 1.5x", _verdict(load >= 1.5)),
    ]


def _async_rows(data: Any) -> list[Row]:
    rows = []
    for key, figures in sorted(data.items()):
        size, _, world = key.partition("-")
        if size != "4MiB":
            continue
        runs = figures["runs"][1:] or figures["runs"]
        beyond = statistics.median(run.get("beyond", run["blocked"] - run["copy"]) for run in runs)
        rows.append(
            (
                f"async save 4 MiB, {world} rank(s): blocked beyond the copy",
                f"{beyond * 1000:.1f} ms",
                "<= 15 ms",
                _verdict(beyond <= 0.015),
            )
        )
    return rows


def _cold_rows(data: Any) -> list[Row]:
    ratio = statistics.median(data["ratios"])
    return [
        ("first save of 1 MiB in a fresh process vs torch.save", f"{ratio:.2f}x", "<= 1.5x", _verdict(ratio <= 1.5))
    ]


def _memory_rows(data: Any) -> list[Row]:
    return [
        (
            f"peak memory growth: {operation}",
            f"{figures['beyond'] / 2**20:.0f} MiB",
            f"<= {figures['bound'] / 2**20:.0f} MiB",
            _verdict(figures["beyond"] <= figures["bound"]),
        )
        for operation, figures in data.items()
    ]


def _tiers_rows(data: Any) -> list[Row]:
    ratio = statistics.median(data["trusted_ratios"])
    return [
        (
            "incremental save, 10 % of experts changed, trust_versions, vs a full save (bench/tiers.py)",
            f"{ratio:.2f}x",
            f"<= {data['target']:g}x",
            _verdict(ratio <= data["target"]),
        )
    ]


def _verdict(met: bool) -> str:
    return "met" if met else "not met"


SOURCES: list[tuple[str, Callable[[Any], list[Row]], list[str]]] = [
    ("save_load", _ratio_rows, ["bench/save_load.py targets"]),
    ("distributed", _distributed_rows, ["2-rank durable save and load vs DCP"]),
    ("async_save", _async_rows, ["async save 4 MiB: blocked beyond the copy"]),
    ("cold_start", _cold_rows, ["first save in a fresh process vs torch.save"]),
    ("memory", _memory_rows, ["peak memory growth"]),
    ("tiers", _tiers_rows, ["incremental save with trust_versions vs a full save"]),
]

#: Targets whose lever is not built (none now; kept so that one can be listed before it is).
NOT_BUILT: list[Row] = []


def main(argv: list[str]) -> int:
    directory = argv[1] if len(argv) > 1 else ".bench"
    rows: list[Row] = []
    for name, render, missing in SOURCES:
        data = _load(directory, name)
        if data is None:
            rows += [(f"{what} ({name}.json missing)", "-", "-", "not measured") for what in missing]
            continue
        rows += render(data)
    rows += NOT_BUILT
    print(f"== every performance target ({directory}) ==")
    print(table(["target", "measured", "target", "verdict"], [list(row) for row in rows]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
