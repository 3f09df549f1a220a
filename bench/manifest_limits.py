"""How much reading a manifest costs per byte, on its fast and slow paths, and therefore which
``ManifestLimits.max_bytes`` keeps a manifest at the limit within a time and memory budget.

Every size runs in a fresh process (peak RSS is per process): the manifest is built from a
realistic template (a chunk of a sharded tensor per entry, 32 entries per file, digests on
every entry), sealed, written to a checkpoint directory, and read with
``shardkeep.read_manifest`` (seal check, decode, validation), with the limits lifted so that
the cost itself is measured. The slow path is the same manifest written with indentation: it
is not byte-for-byte canonical, so it goes through the strict JSON parser, which a hostile
writer can always force.

    python bench/manifest_limits.py [--sizes 8,32,64] [--budget-seconds 5] [--budget-mib 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from shardkeep.config import ManifestLimits

_CHILD = r"""
import json, os, resource, sys, time
import msgspec
import shardkeep as sk
from shardkeep.config import ManifestLimits
from shardkeep.integrity import seal_manifest

target, kind, directory, most = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
indent, minimal = kind.startswith("indent"), kind.endswith("minimal")
digest = "blake3:" + "ab" * 32
per_file, files, count = 32, [], 0
size_estimate = 0
while size_estimate < target and count + per_file <= most:
    index = len(files)
    if minimal:  # the smallest valid entries: the most per byte
        tensors = [{"key": f"{count + n:x}", "path": [f"{count + n:x}"], "dtype": "U8", "shape": [1], "offset": n,
                    "nbytes": 1, "order": 2 + count + n} for n in range(per_file)]
        size_estimate += (186 if indent else 100) * per_file
    else:  # a realistic entry: a long key and a digest of its own
        tensors = [
            {"key": f"model.layers.{index}.mlp.experts.{n}.weight", "path": [f"model.layers.{index}.mlp.experts.{n}.weight"],
             "dtype": "BF16", "shape": [128, 4096], "offset": 1024 + n * 1048576, "nbytes": 1048576, "order": 2 + count + n,
             "digest": digest}
            for n in range(per_file)
        ]
        size_estimate += (370 if indent else 272) * per_file
    count += per_file
    files.append({"path": f"shards/rank_{index:07d}.safetensors", "rank": 0, "size": 1024 + per_file * 1048576, "digest": digest, "tensors": tensors})
body = {"metadata_version": "1.3", "format": "shardkeep", "created_at": "2026-11-23T00:00:00Z", "world_size": 1,
        "coordinator_rank": 0, "digest_algorithm": "blake3", "sharding": {"shard_count": len(files)}, "files": files,
        "structure": [{"path": [], "order": 1}], "values": [], "custom_fields": {}, "metrics": {}}
manifest = msgspec.json.decode(msgspec.json.encode(body), type=sk.Manifest)
from shardkeep.manifest import encode_manifest
encoded = encode_manifest(manifest)
if indent:
    encoded = json.dumps(json.loads(encoded), indent=1).encode()
sealed = seal_manifest(encoded, "blake3")
os.makedirs(directory, exist_ok=True)
with open(os.path.join(directory, "manifest.json"), "wb") as handle:
    handle.write(sealed)
"""

_READER = r"""
import json, resource, sys, time
import shardkeep as sk
from shardkeep.config import ManifestLimits

directory, lifted = sys.argv[1], sys.argv[2] == "lifted"
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
limits = ManifestLimits(max_bytes=2**40, max_files=10**9, max_tensors=10**10) if lifted else ManifestLimits()
started = time.perf_counter()
read = sk.read_manifest(directory, limits=limits)
seconds = time.perf_counter() - started
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"bytes": __import__("os").path.getsize(directory + "/manifest.json"), "entries": sum(len(f.tensors) for f in read.files), "seconds": seconds, "peak_mib": max(after - before, 0) / 1024,
                  "rss_mib": after / 1024}))
"""


def measure(target: int, kind: str, *, lifted: bool = True) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="shardkeep-manifest-bench-") as directory:
        checkpoint = os.path.join(directory, "c")
        _run(_CHILD, str(target), kind, checkpoint, str(ManifestLimits().max_tensors if not lifted else 10**10))
        return json.loads(_run(_READER, checkpoint, "lifted" if lifted else "default").strip().splitlines()[-1])  # type: ignore[no-any-return]


def _run(script: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"a measuring process failed:\n{done.stderr}")
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="8,32,64", help="manifest sizes to measure, in MiB (default 8,32,64)")
    parser.add_argument("--budget-seconds", type=float, default=5.0, help="time allowed at the limit (default 5)")
    parser.add_argument("--budget-mib", type=float, default=1024.0, help="memory allowed at the limit (default 1024)")
    args = parser.parse_args()

    print(f"{'manifest':<16} {'MiB':>7} {'entries':>9} {'seconds':>8} {'peak MiB':>9} {'s/MiB':>7} {'MiB/MiB':>8}")
    worst_seconds = worst_memory = 0.0
    for size in (float(s) for s in args.sizes.split(",")):
        for kind in ("compact", "indent", "compact-minimal", "indent-minimal"):
            result = measure(int(size * 2**20), kind)
            mib = result["bytes"] / 2**20
            per_second, per_memory = result["seconds"] / mib, result["peak_mib"] / mib
            worst_seconds, worst_memory = max(worst_seconds, per_second), max(worst_memory, per_memory)
            print(
                f"{kind:<16} {mib:7.1f} {result['entries']:9,d} {result['seconds']:8.2f} "
                f"{result['peak_mib']:9.0f} {per_second:7.3f} {per_memory:8.1f}"
            )
    fits = min(args.budget_seconds / worst_seconds, args.budget_mib / worst_memory)
    print(
        f"worst case: {worst_seconds:.3f} s and {worst_memory:.1f} MiB of memory per MiB of manifest; "
        f"{args.budget_seconds:g} s and {args.budget_mib:g} MiB allow about {fits:.0f} MiB"
    )
    limits = ManifestLimits()
    print(
        f"\nat the default limits ({limits.max_bytes / 2**20:g} MiB, {limits.max_tensors:,d} tensor entries), read "
        "with the default limits:"
    )
    for kind in ("compact-minimal", "indent-minimal"):
        result = measure(limits.max_bytes - 2**20, kind, lifted=False)  # the size estimate runs over by up to 1 %
        print(
            f"{kind:<16} {result['bytes'] / 2**20:7.1f} {result['entries']:9,d} {result['seconds']:8.2f} "
            f"{result['peak_mib']:9.0f}"
        )


if __name__ == "__main__":
    main()
