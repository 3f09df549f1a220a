"""Cold start: the first save of a small state in a fresh process, timed from process
start, against ``torch.save`` in a fresh process.

Each contender is a new Python process that imports what it needs, builds a state of 1 MiB
(fp32 tensors of 64 KiB each, and a step counter) and saves it durably to a fresh path:
``torch.save`` then ``os.fsync`` of the file, or ``shardkeep.save`` (which fsyncs its files and
directories and commits). The clock is the wall time of the whole process, measured by the
parent from ``fork``/``exec`` to exit. Contenders alternate, ``--reps`` each, after one untimed
run of each (the page cache then holds torch's files for both). It also reports which heavy
modules shardkeep's process imported (``torch.distributed.tensor``, ``sympy``)::

    .venv/bin/python bench/cold_start.py            # 7 repetitions
    .venv/bin/python bench/cold_start.py --reps 15
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
from common import fmt_range, median

STATE = "state = {'layers': {str(i): torch.full((16384,), float(i)) for i in range(16)}, 'step': 1}\n"
PROGRAMS = {
    "torch.save": (
        "import os, sys, torch\n" + STATE + "path = sys.argv[1] + '.pt'\n"
        "torch.save(state, path)\n"
        "fd = os.open(path, os.O_RDONLY); os.fsync(fd); os.close(fd)\n"
    ),
    "shardkeep.save": (
        "import json, sys, torch\nimport shardkeep as sk\n" + STATE + "sk.save(state, sys.argv[1])\n"
        "print(json.dumps({name: name in sys.modules for name in ('torch.distributed.tensor', 'sympy')}))\n"
    ),
}


def run(name: str, directory: str, index: int) -> tuple[float, str]:
    path = os.path.join(directory, f"{name}-{index}")
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PROGRAMS[name], path], check=True, capture_output=True, text=True)
    return time.perf_counter() - started, done.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print(f"bench/cold_start.py  {time.strftime('%Y-%m-%d %H:%M:%S')}  load {os.getloadavg()}")
    times: dict[str, list[float]] = {name: [] for name in PROGRAMS}
    imported = ""
    with tempfile.TemporaryDirectory(prefix="sk-cold-") as directory:
        for name in PROGRAMS:
            run(name, directory, -1)  # untimed: warms the page cache for both
        for index in range(args.reps):
            for name in PROGRAMS:
                seconds, output = run(name, directory, index)
                times[name].append(seconds)
                imported = output or imported
    ratios = [s / t for s, t in zip(times["shardkeep.save"], times["torch.save"], strict=True)]
    for name, samples in times.items():
        print(f"{name:<16}{fmt_range(samples)}")
    verdict = "met" if median(ratios) <= 1.5 else "not met"
    print(
        f"shardkeep / torch.save, per repetition: {median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}); "
        f"target <= 1.5x: {verdict}"
    )
    print(f"heavy modules in shardkeep's process: {imported}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"times": times, "ratios": ratios, "imported": json.loads(imported or "{}")}, handle, indent=2)


if __name__ == "__main__":
    main()
