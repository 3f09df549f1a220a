"""Peak memory beyond the tensors themselves: save, async save and load of a 1 GiB
state, each in a fresh process.

Each operation runs in its own process, which builds the state (fp32 tensors of 4 MiB), then
resets the kernel's high-water mark of its resident set (``/proc/self/clear_refs`` with 5) and
reads ``VmHWM`` after the operation. Reported per operation:

* **peak growth**: the high-water mark minus the resident set just before the operation; for
  save and async save the state's tensors were resident then, so this is what the save needs
  beyond them; a load builds the state, so its growth includes the loaded tensors;
* the bound it should stay under:
  - ``save``: the byte budget (``byte_budget``, 256 MiB by default);
  - ``async_save``: the byte budget plus one staging arena (``SaveHandle.staging_arena_bytes``,
    at least the state's size);
  - ``load`` (fresh process, no state built): the tensors it returns are the mapped files'
    pages, so the bound is the state's size plus the byte budget; ``load(into=...)`` copies
    into the existing tensors: the bound is the byte budget plus the mapped file pages the copy
    touches (the state's size), since the maps are released only after the fill.

    .venv/bin/python bench/memory.py                # 1 GiB
    .venv/bin/python bench/memory.py --mib 256
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fmt_bytes, table

CHILD = r"""
import json, os, sys, time, torch
import shardkeep as sk
mib, operation, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
def reset_peak():
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
def state():
    return {"layers": {str(i): torch.full((1 << 20,), float(i)) for i in range(mib // 4)}, "step": 1}
extra = {}
if operation in ("save", "async_save", "load_into"):
    built = state()
if operation == "load_into":
    sk.save(built, path)
reset_peak()
before = status("VmRSS")
if operation == "save":
    sk.save(built, path)
elif operation == "async_save":
    handle = sk.async_save(built, path)
    handle.result(600)
    extra = {"staging_arena_bytes": handle.staging_arena_bytes}
elif operation == "load":
    loaded = sk.load(path)
    total = 0
    for tensor in loaded["layers"].values():
        total += int(tensor.sum() != -1)  # touch every page, as a training step would
elif operation == "load_into":
    sk.load(path, into=built)
peak = status("VmHWM")
print(json.dumps({"before": before, "peak": peak, **extra}))
"""


def run(mib: int, operation: str, path: str) -> dict[str, int]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(mib), operation, path], check=True, capture_output=True, text=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=1024, help="state size in MiB (default 1024)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    state_bytes = args.mib << 20
    budget = 256 << 20
    print(
        f"bench/memory.py  {time.strftime('%Y-%m-%d %H:%M:%S')}  state {fmt_bytes(state_bytes)}  load {os.getloadavg()}"
    )
    rows, figures = [], {}
    with tempfile.TemporaryDirectory(prefix="sk-memory-", dir=os.environ.get("BENCH_DIR")) as directory:
        results = {
            "save": run(args.mib, "save", os.path.join(directory, "saved")),
            "async_save": run(args.mib, "async_save", os.path.join(directory, "async")),
            "load": run(args.mib, "load", os.path.join(directory, "saved")),
            "load_into": run(args.mib, "load_into", os.path.join(directory, "into")),
        }
    for operation, result in results.items():
        beyond = result["peak"] - result["before"]
        if operation == "save":
            bound, rule = budget, "byte budget"
        elif operation == "async_save":
            bound, rule = budget + result["staging_arena_bytes"], "byte budget + staging arena"
        else:
            bound, rule = budget + state_bytes, "byte budget + the mapped files"
        figures[operation] = result | {"beyond": beyond, "bound": bound}
        rows.append([operation, fmt_bytes(beyond), f"{fmt_bytes(bound)} ({rule})", "yes" if beyond <= bound else "no"])
    print(table(["operation", "peak growth", "bound", "within"], rows))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(figures, handle, indent=2)


if __name__ == "__main__":
    main()
