"""The reliability figures: run the reliability suite at full size and print the reliability
table with what was measured (trials run, failures found).

    python bench/reliability.py            # full size: 1000 kill -9 trials, 10,000+ fuzz inputs ...
    python bench/reliability.py --ci       # the sizes `make test` runs
    python bench/reliability.py --markdown docs/reliability-figures.md

Every number comes from the tests in ``tests/reliability/`` (and the ledger's concurrency
tests), which record what they measured through ``tests/support/figures.py``; a failing test fails this
script too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = [
    "tests/reliability",
    "tests/test_ledger_concurrency.py::test_eight_writers_and_readers_lose_nothing",
    "tests/test_ledger_concurrency.py::test_writers_killed_mid_update_lose_nothing_that_returned",
    "tests/test_ledger_concurrency.py::test_deleting_the_lock_file_while_writers_run_loses_nothing",
]

#: The table's rows: (property, method, target, the recorded figures that make up the row).
ROWS = [
    (
        "process crash",
        "kill -9 the saving process at random moments",
        "0 committed checkpoints that fail to verify or load",
        ["process crash"],
    ),
    (
        "power loss",
        "simulated disk dropping unsynced writes, power cut at every operation; then each fsync removed in turn",
        "0 violations; every fsync removal caught",
        ["power loss", "power loss: mutation check"],
    ),
    (
        "I/O errors",
        "EIO/ENOSPC at the N-th operation for every N; one of 2 ranks failing at each of its operations",
        "typed error on every rank, no hang, previous checkpoint intact, no partial commit",
        ["I/O errors", "I/O errors: one rank failing"],
    ),
    (
        "bit flips, truncation, extra or missing files",
        "every single-bit flip of a small checkpoint, signed and unsigned; every truncation length; stray and removed files",
        "100 % detected",
        ["bit flips", "truncation", "extra or missing files"],
    ),
    (
        "parser fuzzing",
        "hypothesis on manifest, header, path and signature parsing",
        "0 errors other than our own types",
        ["parser fuzzing"],
    ),
    (
        "hostile paths",
        "../, absolute, NUL, backslash, symlinks, FIFOs, device files, sockets, tier locations",
        "100 % rejected; 0 bytes read or written outside the root",
        ["hostile paths"],
    ),
    (
        "pickle payloads",
        "payloads creating a sentinel file, on every public load API, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1",
        "0 executed",
        ["pickle payloads"],
    ),
    (
        "progress manifest",
        "8 processes x 500 updates with concurrent readers; writers killed with kill -9; the lock file deleted while writers run",
        "0 lost updates, 0 unreadable reads",
        ["progress manifest", "progress manifest: kill -9", "progress manifest: lock file deleted"],
    ),
]


def run_suite(full: bool, figures: Path) -> tuple[int, float]:
    env = dict(os.environ, SHARDKEEP_FIGURES=str(figures))
    if full:
        env["SHARDKEEP_RELIABILITY"] = "full"
    else:
        env.pop("SHARDKEEP_RELIABILITY", None)
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *TESTS],
        cwd=ROOT,
        env=env,
        check=False,
    )
    return result.returncode, time.perf_counter() - started


def table(figures: list[dict[str, object]]) -> tuple[list[str], bool]:
    lines = [
        "| property | method | target | trials | failures | measured |",
        "|---|---|---|---|---|---|",
    ]
    complete = True
    for prop, method, target, names in ROWS:
        found = [f for f in figures if f["property"] in names]
        if not found:
            complete = False
            lines.append(f"| {prop} | {method} | {target} | - | - | NOT MEASURED |")
            continue
        trials = sum(int(f["trials"]) for f in found)  # type: ignore[call-overload]
        failures = sum(int(f["failures"]) for f in found)  # type: ignore[call-overload]
        detail = "<br>".join(
            f"{f['property']}: {f['trials']:,} trials, {f['failures']} failures. {f['detail']}" for f in found
        )
        lines.append(f"| {prop} | {method} | {target} | {trials:,} | {failures} | {detail} |")
    return lines, complete


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ci", action="store_true", help="the CI sizes instead of the full ones")
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        figures_file = Path(scratch) / "figures.jsonl"
        code, seconds = run_suite(not args.ci, figures_file)
        figures = [json.loads(line) for line in figures_file.read_text().splitlines()] if figures_file.exists() else []
    lines, complete = table(figures)
    size = "CI size" if args.ci else "full size"
    header = f"Reliability figures ({size}; `python bench/reliability.py{' --ci' if args.ci else ''}`, {seconds:.0f} s)"
    print(f"\n{header}\n")
    print("\n".join(lines))
    if args.markdown:
        args.markdown.write_text(f"{header}\n\n" + "\n".join(lines) + "\n")
    if code != 0:
        print(f"\nthe suite FAILED (pytest exit {code}): the figures above are incomplete", file=sys.stderr)
        return 1
    if not complete:
        print("\nsome rows were not measured", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
