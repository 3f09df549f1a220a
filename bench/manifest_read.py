"""What reading a manifest costs per tensor entry: ``read_manifest``, ``verify`` and ``load`` of a
wide unsharded checkpoint (many small tensors on one rank), phase by phase.

The checkpoint is ``{f"t{i}": torch.zeros(16) for i in range(N)}`` saved with ``shardkeep.save``
into a temporary directory (limits are lifted when N makes the manifest larger than the
defaults). Every measurement runs in a fresh process that imports torch and shardkeep, touches
and frees about 2.5 GiB of memory (first-touch memory is slow on the shared VMs, see
/work/shared/BENCHMARKING.md), resets its peak RSS, then times one call. Phases:

* ``read_manifest``: ``bytes`` (read the file), ``seal`` (self-digest), ``decode``
  (``decode_manifest``), ``validate`` (``validate_manifest`` + the chunk coverage check), and the
  whole ``sk.read_manifest``;
* ``verify``: ``shard`` (``check_shard`` of the one data file: digest and safetensors header) and
  the whole ``sk.verify``;
* ``load``: the ``LoadJob`` phases ``read`` (map and check the file) and ``assemble`` (build the
  tensors and the state), and the whole ``sk.load``.

``peak_mib`` is the process's peak RSS during the whole call (torch and shardkeep imported),
``peak_added_mib`` what the call added to the RSS it started with.

With ``--trees A,B`` the same checkpoint is read by two source trees (each a directory holding
the ``shardkeep`` package, put first on ``PYTHONPATH``), interleaved A, B, A, B, ...; the
per-repetition ratios B/A are reported as median (min-max).

    .venv/bin/python bench/manifest_read.py [--tensors 100000] [--reps 5] [--trees A,B]
    .venv/bin/python bench/manifest_read.py --tensors 1000000 --reps 1 --only read_manifest
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

_SAVE = r"""
import sys, time, warnings
import torch
import shardkeep as sk
from shardkeep.config import ManifestLimits
count, directory = int(sys.argv[1]), sys.argv[2]
warnings.simplefilter("ignore")
started = time.perf_counter()
sk.save({f"t{i}": torch.zeros(16) for i in range(count)}, directory)
print(f"saved {count:,d} tensors in {time.perf_counter() - started:.1f} s", file=sys.stderr)
"""

_MEASURE = r"""
import gc, json, os, sys, time
import numpy
import torch
import shardkeep as sk
from shardkeep.config import ManifestLimits
from shardkeep.config import LoadOptions
from shardkeep.integrity import unseal_manifest
from shardkeep.io import check_shard
from shardkeep.loading import LoadJob
from shardkeep.manifest import decode_manifest, validate_manifest
from shardkeep.tensors.coverage import coverage_problems
from shardkeep.verification import FileResolver, locate, read_manifest_bytes

step, directory, lifted = sys.argv[1], sys.argv[2], sys.argv[3] == "lifted"
limits = ManifestLimits(max_bytes=2**40, max_files=10**9, max_tensors=10**10) if lifted else None


def pretouch():
    gc.collect()
    block = numpy.ones(int(2.5 * 2**30), dtype=numpy.uint8)
    del block
    with open("/proc/self/clear_refs", "w") as handle:  # resets VmHWM, the peak RSS
        handle.write("5")


def status_mib(field):
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def timed(function, *args, **kwargs):
    pretouch()
    times["rss_before_mib"] = status_mib("VmRSS")  # of the last (whole) call
    started = time.perf_counter()
    result = function(*args, **kwargs)
    return result, time.perf_counter() - started


times = {}
if step == "read_manifest":
    location = locate(directory)
    data, times["bytes"] = timed(read_manifest_bytes, location, limits)
    _, times["seal"] = timed(unseal_manifest, data)
    manifest, times["decode"] = timed(decode_manifest, data, limits=limits)
    _, times["validate"] = timed(lambda: (validate_manifest(manifest, limits=limits), coverage_problems(manifest)))
    del manifest, data
    _, times["total"] = timed(sk.read_manifest, directory, limits=limits)
elif step == "verify":
    location = locate(directory)
    manifest = sk.read_manifest(directory, limits=limits)
    store, where = FileResolver(location, manifest)(manifest.files[0])
    (_, problems), times["shard"] = timed(check_shard, store, where, manifest.files[0], verify=True, keep=False)
    assert not problems, problems
    del manifest
    report, times["total"] = timed(sk.verify, directory, limits=limits)
    assert report.ok, report.problems[:3]
elif step == "load":
    location = locate(directory)
    manifest = sk.read_manifest(directory, limits=limits)
    job = LoadJob(location, manifest, LoadOptions(), into=None, tiers=None, sections=None, tier_locations=None,
                  storage_options=None, lazy=False, progress=False)
    job.select()
    _, times["read"] = timed(job.read)
    _, times["assemble"] = timed(job.assemble)
    del job, manifest
    _, times["total"] = timed(sk.load, directory, limits=limits)
times["peak_mib"] = status_mib("VmHWM")  # of the last (whole) call
times["peak_added_mib"] = times["peak_mib"] - times.pop("rss_before_mib")
print(json.dumps(times))
"""

STEPS = ("read_manifest", "verify", "load")


def run(script: str, *args: str, tree: str | None = None) -> str:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = tree + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"a measuring process failed:\n{done.stderr}")
    if done.stderr.strip():
        print(done.stderr.strip(), file=sys.stderr)
    return done.stdout


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=100_000, help="tensors in the checkpoint (default 100,000)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions (default 5)")
    parser.add_argument("--trees", default="", help="comma-separated source trees to compare, interleaved")
    parser.add_argument("--only", default=",".join(STEPS), help="steps to run (default: all)")
    parser.add_argument("--dir", default=None, help="where to put the checkpoint (default: a temporary directory)")
    args = parser.parse_args()
    trees: list[str | None] = [tree for tree in args.trees.split(",") if tree] or [None]
    steps = [step for step in args.only.split(",") if step]
    print(f"load average at start: {os.getloadavg()}")
    with tempfile.TemporaryDirectory(prefix="shardkeep-manifest-read-", dir=args.dir) as scratch:
        checkpoint = os.path.join(scratch, "wide")
        run(_SAVE, str(args.tensors), checkpoint, tree=trees[0])
        size = os.path.getsize(os.path.join(checkpoint, "manifest.json"))
        lifted = "lifted" if args.tensors > 150_000 else "default"
        print(f"{args.tensors:,d} tensors, manifest {size / 2**20:.1f} MiB, limits {lifted}")
        results: dict[tuple[int, str], list[dict[str, float]]] = {}
        for _ in range(args.reps):
            for step in steps:
                for index, tree in enumerate(trees):
                    out = run(_MEASURE, step, checkpoint, lifted, tree=tree)
                    results.setdefault((index, step), []).append(json.loads(out.strip().splitlines()[-1]))
    for step in steps:
        print(f"\n{step}: seconds, median (min-max) of {args.reps}")
        phases = list(results[(0, step)][0])
        for phase in phases:
            row = f"  {phase:<9}"
            for index in range(len(trees)):
                row += "  " + spread([r[phase] for r in results[(index, step)]])
            if len(trees) == 2:
                ratios = [b[phase] / a[phase] for a, b in zip(results[(0, step)], results[(1, step)], strict=True)]
                row += f"   B/A {spread(ratios)}"
            print(row)
    print(f"\nload average at end: {os.getloadavg()}")
    if len(trees) == 2:
        print(f"A = {trees[0]}\nB = {trees[1]}")


if __name__ == "__main__":
    main()
