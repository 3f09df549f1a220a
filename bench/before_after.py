"""Before and after: run the speed benchmarks on two revisions of shardkeep, back to back in one
run, and print each measure side by side with its ratio.

    .venv/bin/python bench/before_after.py --base eac246a

For each benchmark (``save_load.py --quick``, ``scale.py --quick`` and ``cold_start.py`` by
default), the base revision's own copy of the benchmark runs against its own ``src/``, then this
tree's copy against this tree's ``src/``; with ``--rounds 2`` the pair runs twice, alternating,
so that a change in the machine's load hits both sides. The base revision is checked out with
``git worktree add --detach`` into a temporary directory, removed at the end.

Every number is compared only with the same measure of the other side (the same JSON path);
timings are medians of the benchmark's own repetitions. A ratio above 1 means this tree is
slower. The machine is shared and noisy (docs/performance.md says how to read that), so a ratio
within about 10 % is noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: benchmark -> (arguments, the JSON paths to compare: a prefix per measure family)
BENCHMARKS: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "save_load": (["--quick", "--reps", "5"], ("workloads.",)),
    "scale": (["--quick", "--src", "worktree"], ("",)),
    "cold_start": (["--reps", "5"], ("times.",)),
}


def _leaves(value: Any, prefix: str = "") -> Iterator[tuple[str, float]]:
    """Every number of a JSON document, by its dotted path; a list of numbers is its median."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, f"{prefix}{key}.")
    elif isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
        yield prefix.rstrip("."), statistics.median(value)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _leaves(item, f"{prefix}{index}.")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield prefix.rstrip("."), float(value)


def _is_timing(path: str) -> bool:
    words = path.lower()
    return any(word in words for word in ("seconds", "_s.", "time", "_ms", "_us")) or words.endswith(("_s", "ms"))


def _run(tree: str, name: str, arguments: list[str], out: str) -> dict[str, Any]:
    command = [sys.executable, os.path.join(tree, "bench", f"{name}.py"), *arguments, "--json", out]
    environment = {**os.environ, "PYTHONPATH": os.path.join(tree, "src")}
    started = time.perf_counter()
    done = subprocess.run(command, cwd=tree, env=environment, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        raise SystemExit(f"{name} failed in {tree} (exit {done.returncode})")
    print(f"  {name:<11} {os.path.basename(tree) or tree}: {time.perf_counter() - started:.0f} s", flush=True)
    with open(out) as handle:
        document: dict[str, Any] = json.load(handle)
    return document


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the revision to compare with (a commit, tag or branch)")
    parser.add_argument("--only", default=",".join(BENCHMARKS), help="comma-separated, from " + ", ".join(BENCHMARKS))
    parser.add_argument("--rounds", type=int, default=1, help="times to run each pair, alternating (default 1)")
    parser.add_argument("--json", help="also write every compared measure to this path")
    args = parser.parse_args()
    chosen = [name for name in args.only.split(",") if name]
    unknown = sorted(set(chosen) - set(BENCHMARKS))
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}")

    print(f"bench/before_after.py  {time.strftime('%Y-%m-%d %H:%M:%S')}  base {args.base}  load {os.getloadavg()}")
    scratch = tempfile.mkdtemp(prefix="sk-before-after-")
    base_tree = os.path.join(scratch, "base")
    subprocess.run(["git", "-C", HERE, "worktree", "add", "-q", "--detach", base_tree, args.base], check=True)
    results: dict[str, dict[str, dict[str, list[float]]]] = {}
    try:
        for name in chosen:
            arguments, prefixes = BENCHMARKS[name]
            sides: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
            for round_ in range(args.rounds):
                for side, tree in (("before", base_tree), ("after", HERE)):
                    document = _run(tree, name, arguments, os.path.join(scratch, f"{name}-{side}-{round_}.json"))
                    for path, number in _leaves(document):
                        if path.startswith(prefixes) and _is_timing(path):
                            sides[side].setdefault(path, []).append(number)
            results[name] = sides
    finally:
        subprocess.run(["git", "-C", HERE, "worktree", "remove", "--force", base_tree], check=False)
        subprocess.run(["rm", "-rf", scratch], check=False)

    for name, sides in results.items():
        print(f"\n== {name}  (median of the benchmark's repetitions; ratio = after / before)")
        shared = [path for path in sides["after"] if path in sides["before"]]
        for path in shared:
            before = statistics.median(sides["before"][path])
            after = statistics.median(sides["after"][path])
            ratio = after / before if before > 0 else float("nan")
            print(f"  {path:<78} {before:>11.4g} {after:>11.4g}  {ratio:5.2f}x")
        only = sorted(set(sides["after"]) ^ set(sides["before"]))
        if only:
            print(f"  ({len(only)} measure(s) on one side only, not compared)")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"base": args.base, "results": results}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
