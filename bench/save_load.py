"""Durable save and warm verified load: shardkeep against raw I/O, torch.save, safetensors and DCP.

What it measures, for two workloads (flat dicts of CPU tensors built with a fixed seed):

* ``1GiB-mixed``: a few large fp32 matrices (64-256 MiB), a few hundred medium bf16/fp32 tensors
  (1-4 MiB) and some small int64/bool tensors, about 1 GiB in all;
* ``20k-small``: 20,000 fp32 tensors of 1024 elements (4 KiB each).

**Durable save**: the clock stops only once the data is on disk (fsynced). Contenders: a raw
``os.write`` of the same bytes in 64 MiB chunks plus ``fsync`` (and, for reference, without
``fsync``), ``torch.save`` into an open file plus ``fsync``, ``safetensors.torch.save_file`` plus
``fsync``, ``torch.distributed.checkpoint.save`` (single process) plus ``fsync`` of every file it
wrote, and ``shardkeep.save`` (which fsyncs files and directories itself; files of 8 MiB or more
go out with ``O_DIRECT``); for reference, ``shardkeep.save`` through a
``LocalStore(direct_io=False)`` (what ``O_DIRECT`` is worth) and with ``digest="xxh3-128"``
(fast, not cryptographic). The baselines do not fsync directories, which favours them. How
shardkeep's files were written (``O_DIRECT`` or the page cache) is printed with the targets.

**Warm verified load**: the files were just written, so they are in the page cache; each loader
runs once untimed before its timed run. Contenders: a raw ``readinto`` of the raw file into a
preallocated buffer, ``torch.load`` with and without ``mmap=True``, ``safetensors.torch.load_file``,
``torch.distributed.checkpoint.load`` into a preallocated state of zero tensors, and
``shardkeep.load`` (memory-mapped, verifying every file's fast xxh3-128 digest, the default
without a public key), ``shardkeep.load(digest="cryptographic")`` (every file's blake3 digest,
what a load under a public key checks), and ``shardkeep.load``
with ``verify=False`` (reported against safetensors), and the verified load of the
``xxh3-128`` checkpoint (reported against the raw read). Several loaders return
tensors that view a lazy memory map (``torch.load(mmap=True)``, shardkeep, and also
``safetensors.torch.load_file``, which maps the file by default since safetensors 0.8), so every
tensor loader has one byte of every memory page of every loaded tensor read before the clock
stops; lazy mapping is not mistaken for speed, and all loaders pay the same touching cost (printed
per workload). The untimed run of the first repetition also checks that every loader returns
exactly the saved tensors.

Method (see /work/shared/BENCHMARKING.md): within each repetition every contender runs once, in a
fixed order (saves, then loads, then the outputs are deleted); before each timed step the garbage
collector runs and about 2.5 GiB of memory is touched and freed, because first-touch memory is
slow on the shared VMs. Ratios are computed per repetition and reported as median (min-max).

Run from the repository root::

    .venv/bin/python bench/save_load.py              # full size, 5 repetitions (several minutes)
    .venv/bin/python bench/save_load.py --quick --reps 2
    .venv/bin/python bench/save_load.py --dir /scratch --json results.json
    .venv/bin/python bench/save_load.py --keyed-pairs 10    # keyed load, format 2.1 against 2.0

**Keyed loads before and after** (``--keyed-pairs N``, instead of the tables): the 1 GiB mixed
workload (``--keyed-size-mib``) is saved twice, as this version writes it and with
``WriteOptions(block_size=0)``, which writes exactly what the previous format wrote; once as
DTensors on a one-rank gloo group (format 2.1 against 2.0: a chunk of 2.0 carries a digest of its
own, which a whole-file check proves in the same pass as the file's), loaded into a resident
state of DTensors as a sharded restore does, and once as plain tensors (1.4 against 1.3), loaded
as a new state. Each is loaded with ``digest="cryptographic"`` (what a load under a public key
checks) in N alternating pairs; printed: each side's median (min-max) and the per-pair ratio
after/before (median, min-max; below 1: the current format loads faster).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import gc
import json
import os
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import safetensors
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp

import shardkeep as sk
from shardkeep.storage.local import LocalStore

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
RAW_CHUNK = 64 * MiB
#: Tensors smaller than this are gathered into the staging buffer by the raw writer.
RAW_GATHER_LIMIT = 1 * MiB
PAGE = os.sysconf("SC_PAGE_SIZE")
#: Above this size a tensor's pages are touched with one strided torch reduction, below it one
#: byte per page is read through ctypes (a torch op costs ~10 µs per tensor, ctypes ~1 µs).
TORCH_TOUCH_LIMIT = 256 * KiB
SEED = 1234

# torch.distributed.checkpoint warns on every call that it runs without a process group.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")

State = dict[str, torch.Tensor]


# --------------------------------------------------------------------------------------------
# Workloads


@dataclass
class Workload:
    """One state to save and load, with the buffers its loaders reuse."""

    role: str  # "mixed" or "small": what the targets refer to
    label: str
    state: State
    per_tensor: bool  # report µs per tensor rather than GB/s
    nbytes: int = 0
    count: int = 0
    read_buffer: bytearray = field(default_factory=bytearray)
    dcp_target: State = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.nbytes = sum(t.nbytes for t in self.state.values())
        self.count = len(self.state)

    def allocate_load_buffers(self) -> None:
        """Allocate (and touch) the raw read buffer and DCP's in-place target once, outside any timing."""
        self.read_buffer = bytearray(self.nbytes)
        self.dcp_target = {key: torch.zeros_like(t) for key, t in self.state.items()}

    def release(self) -> None:
        self.state = {}
        self.read_buffer = bytearray()
        self.dcp_target = {}


def size_label(nbytes: int) -> str:
    return f"{nbytes / GiB:g}GiB" if nbytes >= GiB else f"{nbytes / MiB:g}MiB"


def build_mixed_workload(total_bytes: int, seed: int = SEED) -> Workload:
    """Large fp32 matrices, medium bf16/fp32 tensors and small int64/bool tensors, ``total_bytes`` in all."""
    scale = total_bytes / GiB
    layout = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    state: State = {}
    for index, mib in enumerate((256, 128, 64)):
        elements = int(mib * MiB * scale) // 4
        state[f"large.{index}.weight"] = torch.randn(elements // 4096, 4096, generator=generator)
    for index in range(200):
        state[f"small.{index:03d}.ids"] = torch.randint(0, 1 << 40, (layout.randint(1, 512),), generator=generator)
    for index in range(100):
        state[f"small.{index:03d}.mask"] = torch.rand(layout.randint(1, 4096), generator=generator) < 0.5
    used = sum(t.nbytes for t in state.values())
    index = 0
    while used < total_bytes:
        dtype = torch.bfloat16 if index % 2 == 0 else torch.float32
        nbytes = min(int(layout.randint(1, 4) * MiB * scale), total_bytes - used)
        rows = max(1, nbytes // (1024 * dtype.itemsize))
        tensor = torch.randn(rows, 1024, generator=generator, dtype=dtype)
        state[f"medium.{index:03d}.weight"] = tensor
        used += tensor.nbytes
        index += 1
    return Workload(role="mixed", label=f"{size_label(total_bytes)}-mixed", state=state, per_tensor=False)


def build_small_workload(count: int, seed: int = SEED) -> Workload:
    """``count`` fp32 tensors of 1024 elements (4 KiB) each."""
    generator = torch.Generator().manual_seed(seed)
    state = {f"small.{index:05d}": torch.randn(1024, generator=generator) for index in range(count)}
    label = f"{count // 1000}k-small" if count % 1000 == 0 else f"{count}-small"
    return Workload(role="small", label=label, state=state, per_tensor=True)


# --------------------------------------------------------------------------------------------
# Helpers: bytes of tensors, fsync, page touching, memory pretouch


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16
        tensor = tensor.view(torch.int16)
    return memoryview(tensor.numpy()).cast("B")


def write_all(fd: int, data: memoryview) -> None:
    while data:
        written = os.write(fd, data)
        data = data[written:]


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """fsync every file under ``root``."""
    for directory, _, files in os.walk(root):
        for name in files:
            fsync_path(os.path.join(directory, name))


def iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from iter_tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from iter_tensors(item)


def touch_pages(value: Any) -> int:
    """Read one byte of every memory page of every tensor in ``value`` (faults in lazy mmaps)."""
    total = 0
    for tensor in iter_tensors(value):
        nbytes = tensor.nbytes
        if nbytes == 0:
            continue
        if nbytes >= TORCH_TOUCH_LIMIT:
            flat = tensor.reshape(-1).view(torch.uint8)
            total += int(flat[::PAGE].sum()) + int(flat[-1])
        else:
            start = tensor.data_ptr()
            total += ctypes.c_ubyte.from_address(start).value
            for address in range((start | (PAGE - 1)) + 1, start + nbytes, PAGE):
                total += ctypes.c_ubyte.from_address(address).value
    return total


def pretouch(nbytes: int) -> None:
    """Touch and free ``nbytes`` of memory so the next allocations do not pay first-touch costs."""
    buffer = bytearray(nbytes)  # zero-filled by memset, so every page is written
    del buffer


# --------------------------------------------------------------------------------------------
# Contenders


class RawFile:
    """The raw baselines: one file holding every tensor's bytes in order, and reading it back."""

    def __init__(self) -> None:
        self.staging = bytearray(RAW_CHUNK)  # allocated once and reused, as a real writer would

    def write(self, state: State, path: str, *, fsync: bool) -> None:
        """Small tensors are gathered into the staging buffer; large ones are written from their own
        memory; every ``os.write`` is at most 64 MiB."""
        staging = memoryview(self.staging)
        filled = 0
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for tensor in state.values():
                data = tensor_bytes(tensor)
                size = len(data)
                if size < RAW_GATHER_LIMIT:
                    if filled + size > RAW_CHUNK:
                        write_all(fd, staging[:filled])
                        filled = 0
                    staging[filled : filled + size] = data
                    filled += size
                    continue
                if filled:
                    write_all(fd, staging[:filled])
                    filled = 0
                for begin in range(0, size, RAW_CHUNK):
                    write_all(fd, data[begin : begin + RAW_CHUNK])
            if filled:
                write_all(fd, staging[:filled])
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    @staticmethod
    def read(path: str, into: bytearray) -> int:
        view = memoryview(into)
        position = 0
        with open(path, "rb", buffering=0) as file:
            while position < len(view):
                count = file.readinto(view[position : position + RAW_CHUNK])
                if not count:
                    break
                position += count
        if position != len(view):
            raise RuntimeError(f"raw read of {path} returned {position} bytes, expected {len(view)}")
        return position


RAW = RawFile()


def save_raw_fsync(workload: Workload, path: str) -> None:
    RAW.write(workload.state, path, fsync=True)


def save_raw_no_fsync(workload: Workload, path: str) -> None:
    RAW.write(workload.state, path, fsync=False)


def save_torch(workload: Workload, path: str) -> None:
    with open(path, "wb") as file:
        torch.save(workload.state, file)
        file.flush()
        os.fsync(file.fileno())


def save_safetensors(workload: Workload, path: str) -> None:
    safetensors.torch.save_file(workload.state, path)
    fsync_path(path)


def save_dcp(workload: Workload, path: str) -> None:
    dcp.save(workload.state, checkpoint_id=path)
    fsync_tree(path)


#: How shardkeep's data files were written (O_DIRECT or the page cache), per contender.
WRITE_PATHS: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)


def _save_shardkeep_with(workload: Workload, path: str, *, direct_io: bool, contender: str) -> None:
    store = LocalStore(os.path.dirname(path), direct_io=direct_io)
    sk.save(workload.state, os.path.basename(path), storage=store)
    WRITE_PATHS[contender].update(store.write_paths)


def save_shardkeep(workload: Workload, path: str) -> None:
    _save_shardkeep_with(workload, path, direct_io=True, contender=SHARDKEEP)


def save_shardkeep_xxh3(workload: Workload, path: str) -> None:
    """shardkeep with the fast non-cryptographic digest (no signatures possible)."""
    sk.save(workload.state, path, options=sk.WriteOptions(digest="xxh3-128"))


def save_shardkeep_page_cache(workload: Workload, path: str) -> None:
    """shardkeep with O_DIRECT turned off: what the O_DIRECT lever is worth in this run."""
    _save_shardkeep_with(workload, path, direct_io=False, contender=SHARDKEEP_PAGE_CACHE)


def load_raw(workload: Workload, path: str) -> int:
    return RAW.read(path, workload.read_buffer)


# Every tensor loader touches the pages of what it loaded (see the module docstring).


def load_torch_mmap(workload: Workload, path: str) -> Any:
    loaded = torch.load(path, mmap=True, weights_only=True)
    touch_pages(loaded)
    return loaded


def load_torch(workload: Workload, path: str) -> Any:
    loaded = torch.load(path, weights_only=True)
    touch_pages(loaded)
    return loaded


def load_safetensors(workload: Workload, path: str) -> Any:
    loaded = safetensors.torch.load_file(path)  # memory-mapped by default since safetensors 0.8
    touch_pages(loaded)
    return loaded


def load_dcp(workload: Workload, path: str) -> Any:
    dcp.load(workload.dcp_target, checkpoint_id=path)
    touch_pages(workload.dcp_target)
    return workload.dcp_target


def load_shardkeep(workload: Workload, path: str) -> Any:
    loaded = sk.load(path)
    touch_pages(loaded)
    return loaded


def load_shardkeep_cryptographic(workload: Workload, path: str) -> Any:
    loaded = sk.load(path, digest="cryptographic")
    touch_pages(loaded)
    return loaded


def load_shardkeep_unverified(workload: Workload, path: str) -> Any:
    loaded = sk.load(path, verify=False)
    touch_pages(loaded)
    return loaded


@dataclass(frozen=True)
class Step:
    name: str
    run: Callable[[Workload, str], Any]
    output: str  # file or directory name inside the repetition's scratch directory
    check: bool = True  # compare the loaded tensors with the saved state


SHARDKEEP = "shardkeep"
SHARDKEEP_PAGE_CACHE = "shardkeep, page cache"
SHARDKEEP_UNVERIFIED = "shardkeep verify=False"
SHARDKEEP_XXH3 = "shardkeep xxh3-128"
SHARDKEEP_CRYPTO = "shardkeep, cryptographic digests"
RAW_SAVE = "raw write+fsync"
RAW_LOAD = "raw read"

SAVE_STEPS = [
    Step(RAW_SAVE, save_raw_fsync, "raw.bin"),
    Step("raw write (no fsync)", save_raw_no_fsync, "raw-nofsync.bin"),
    Step("torch.save", save_torch, "torch.pt"),
    Step("safetensors", save_safetensors, "model.safetensors"),
    Step("DCP", save_dcp, "dcp"),
    Step(SHARDKEEP_PAGE_CACHE, save_shardkeep_page_cache, "shardkeep-page-cache"),
    Step(SHARDKEEP_XXH3, save_shardkeep_xxh3, "shardkeep-xxh3"),
    Step(SHARDKEEP, save_shardkeep, "shardkeep"),
]
LOAD_STEPS = [
    Step(RAW_LOAD, load_raw, "raw.bin", check=False),
    Step("torch.load mmap", load_torch_mmap, "torch.pt"),
    Step("torch.load", load_torch, "torch.pt"),
    Step("safetensors", load_safetensors, "model.safetensors"),
    Step("DCP", load_dcp, "dcp"),
    Step(SHARDKEEP_UNVERIFIED, load_shardkeep_unverified, "shardkeep"),
    Step(SHARDKEEP_XXH3, load_shardkeep, "shardkeep-xxh3"),
    Step(SHARDKEEP_CRYPTO, load_shardkeep_cryptographic, "shardkeep"),
    Step(SHARDKEEP, load_shardkeep, "shardkeep"),
]
PHASES = {"save": ("durable save", SAVE_STEPS, RAW_SAVE), "load": ("warm verified load", LOAD_STEPS, RAW_LOAD)}


# --------------------------------------------------------------------------------------------
# Running


def check_loaded(step: str, workload: Workload, loaded: Any) -> list[str]:
    """Problems with ``loaded`` as a copy of the workload's state (empty when it matches exactly)."""
    if not isinstance(loaded, dict) or set(loaded) != set(workload.state):
        return [f"{step}: loaded keys differ from the saved keys"]
    problems = []
    for key, expected in workload.state.items():
        found = loaded[key]
        if not isinstance(found, torch.Tensor) or found.dtype != expected.dtype or not torch.equal(found, expected):
            problems.append(f"{step}: tensor {key!r} differs from the saved tensor")
    return problems


@dataclass
class Runner:
    reps: int
    pretouch_bytes: int
    scratch: str
    times: dict[str, dict[str, dict[str, list[float]]]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def timed(self, step: Step, workload: Workload, path: str) -> float:
        gc.collect()
        pretouch(self.pretouch_bytes)
        start = time.perf_counter()
        result = step.run(workload, path)
        elapsed = time.perf_counter() - start
        del result
        return elapsed

    def record(self, workload: Workload, phase: str, step: Step, seconds: float) -> None:
        self.times.setdefault(workload.label, {}).setdefault(phase, {}).setdefault(step.name, []).append(seconds)

    def run_workload(self, workload: Workload) -> None:
        workload.allocate_load_buffers()
        for rep in range(self.reps):
            directory = os.path.join(self.scratch, f"{workload.label}-rep{rep}")
            os.mkdir(directory)
            for step in SAVE_STEPS:
                seconds = self.timed(step, workload, os.path.join(directory, step.output))
                os.sync()  # untimed: no step competes with the previous one's writeback
                self.record(workload, "save", step, seconds)
            for step in LOAD_STEPS:
                path = os.path.join(directory, step.output)
                loaded = step.run(workload, path)  # untimed warm-up
                if rep == 0 and step.check:
                    self.problems.extend(check_loaded(step.name, workload, loaded))
                del loaded
                self.record(workload, "load", step, self.timed(step, workload, path))
            shutil.rmtree(directory)
            print(f"  {workload.label}: repetition {rep + 1}/{self.reps} done", flush=True)


def warm_up_code_paths(scratch: str) -> None:
    """Save and load a tiny state once with every contender so first-call costs (imports, lazy
    initialisation) do not land in the first repetition."""
    workload = build_small_workload(8)
    workload.allocate_load_buffers()
    directory = os.path.join(scratch, "warm-up")
    os.mkdir(directory)
    for step in SAVE_STEPS:
        step.run(workload, os.path.join(directory, step.output))
    for step in LOAD_STEPS:
        step.run(workload, os.path.join(directory, step.output))
    shutil.rmtree(directory)


# --------------------------------------------------------------------------------------------
# Keyed loads before and after format 2.1 (--keyed-pairs)


@dataclass(frozen=True)
class KeyedKind:
    """One kind of state for :func:`run_keyed_pairs`: the name printed, how the state is built
    from the workload's tensors, and the manifest versions its two saves must have."""

    name: str
    after_version: str
    before_version: str


KEYED_KINDS = (
    KeyedKind("sharded (DTensors on one rank)", after_version="2.1", before_version="2.0"),
    KeyedKind("plain tensors", after_version="1.4", before_version="1.3"),
)


def load_keyed(path: str, into: dict[str, Any] | None) -> float:
    """One timed load with every cryptographic digest checked (what a load under a public key
    checks): into ``into`` (copied into its tensors, which are resident), or as a new state
    whose every page is touched before the clock stops."""
    gc.collect()
    start = time.perf_counter()
    loaded = sk.load(path, into=into, digest="cryptographic")
    if into is None:
        touch_pages(loaded)
    elapsed = time.perf_counter() - start
    del loaded
    return elapsed


def run_keyed_pairs(pairs: int, size_mib: int, scratch: str, pretouch_bytes: int) -> dict[str, Any]:
    """Alternating pairs of keyed loads (``digest="cryptographic"``) of the same state saved
    twice: as this version writes it (format 2.1 with DTensors, 1.4 without) and with
    ``WriteOptions(block_size=0)`` (exactly 2.0/1.3, what the previous release wrote). The two
    take turns to go first; before each load the garbage collector runs and memory is
    pretouched. Returns, per kind, both loads' seconds and the per-pair ratios after/before."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{scratch}/process-group", rank=0, world_size=1)
    results: dict[str, Any] = {}
    try:
        workload = build_mixed_workload(size_mib * MiB)
        mesh = init_device_mesh("cpu", (1,))
        print(f"\nkeyed loads: {workload.label}, {workload.count} tensors, {pairs} alternating pairs", flush=True)
        for kind in KEYED_KINDS:
            # DTensors are loaded into a resident target, as a sharded restore does: a new state
            # would be freshly allocated memory, whose first touch is slow on these VMs.
            state: dict[str, Any] = workload.state
            target: dict[str, Any] | None = None
            if kind.after_version.startswith("2."):
                state = {key: distribute_tensor(t, mesh, [Shard(0)]) for key, t in workload.state.items()}
                target = {key: distribute_tensor(torch.zeros_like(t), mesh, [Shard(0)]) for key, t in state.items()}
            paths = {"after": os.path.join(scratch, "keyed-after"), "before": os.path.join(scratch, "keyed-before")}
            sk.save(state, paths["after"])
            sk.save(state, paths["before"], options=sk.WriteOptions(block_size=0))
            versions = {side: sk.read_manifest(path).metadata_version for side, path in paths.items()}
            expected = {"after": kind.after_version, "before": kind.before_version}
            if versions != expected:
                raise SystemExit(f"{kind.name}: saved formats {versions}, expected {expected}")
            for side, path in paths.items():  # untimed warm-up, and the loaded tensors checked
                loaded = sk.load(path, into=target, digest="cryptographic")
                local = {key: getattr(value, "to_local", lambda value=value: value)() for key, value in loaded.items()}
                problems = check_loaded(f"keyed {side}", workload, local)
                del local
                del loaded
                if problems:
                    raise SystemExit("; ".join(problems[:5]))
            times: dict[str, list[float]] = {"after": [], "before": []}
            for pair in range(pairs):
                for side in ("after", "before") if pair % 2 == 0 else ("before", "after"):
                    pretouch(pretouch_bytes)
                    times[side].append(load_keyed(paths[side], target))
            ratios = per_rep_ratios(times["after"], times["before"])
            print(f"  {kind.name}: format {versions['after']} against {versions['before']}")
            for side in ("after", "before"):
                spread = Spread.of(times[side])
                print(
                    f"    {versions[side]}: {spread.median:.3f} s ({spread.low:.3f}-{spread.high:.3f}),"
                    f" {throughput_text(workload, spread.median)}"
                )
            fastest = min(times["after"]) / min(times["before"])
            print(f"    per-pair ratio {versions['after']}/{versions['before']}: {ratios.ratio_text()}", flush=True)
            print(
                f"    fastest {versions['after']} / fastest {versions['before']}: {format_ratio(fastest)}x", flush=True
            )
            results[kind.name] = {
                "versions": versions,
                "seconds": times,
                "ratio_median": ratios.median,
                "fastest_ratio": fastest,
            }
            for path in paths.values():
                shutil.rmtree(path)
            del state, target
    finally:
        dist.destroy_process_group()
    return results


# --------------------------------------------------------------------------------------------
# Reporting


@dataclass(frozen=True)
class Spread:
    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values))

    def ratio_text(self) -> str:
        return f"{format_ratio(self.median)}x ({format_ratio(self.low)}-{format_ratio(self.high)})"


def format_ratio(value: float) -> str:
    """Two decimals, or two significant digits for ratios below 0.1 (so they do not print as 0.00)."""
    return f"{value:.2f}" if value >= 0.095 else f"{value:.2g}"


def per_rep_ratios(numerators: list[float], denominators: list[float]) -> Spread:
    return Spread.of([n / d for n, d in zip(numerators, denominators, strict=True)])


def throughput_text(workload: Workload, seconds: float) -> str:
    if workload.per_tensor:
        return f"{seconds / workload.count * 1e6:10.1f} µs/tensor"
    return f"{workload.nbytes / seconds / 1e9:10.2f} GB/s"


def print_table(workload: Workload, phase: str, times: dict[str, list[float]]) -> None:
    title, _, raw_name = PHASES[phase]
    reps = len(times[SHARDKEEP])
    print(f"\n== {workload.label}: {title} ({workload.nbytes / GiB:.3f} GiB, {workload.count} tensors, {reps} reps) ==")
    print(f"{'contender':<22}{'median s':>10}{'throughput':>21}   {'shardkeep speedup':<26}speed vs raw")
    for name, seconds in times.items():
        median = statistics.median(seconds)
        speedup = per_rep_ratios(seconds, times[SHARDKEEP]).ratio_text()
        versus_raw = per_rep_ratios(times[raw_name], seconds).ratio_text()
        print(f"{name:<22}{median:>10.4f}{throughput_text(workload, median):>21}   {speedup:<26}{versus_raw}")
    print(
        "  shardkeep speedup = contender time / shardkeep time; speed vs raw = raw time / contender time;"
        " both median (min-max) of per-rep ratios"
    )


@dataclass(frozen=True)
class Target:
    description: str
    role: str
    phase: str
    contender: str
    minimum: float


TARGETS = [
    Target("durable save 1 GiB vs torch.save", "mixed", "save", "torch.save", 1.2),
    Target("durable save 1 GiB vs DCP", "mixed", "save", "DCP", 1.4),
    Target("durable save 20k small vs torch.save", "small", "save", "torch.save", 3.0),
    Target("durable save 20k small vs DCP", "small", "save", "DCP", 20.0),
    Target("verified load 1 GiB vs DCP", "mixed", "load", "DCP", 2.0),
    # Against the raw baselines of the same run: shardkeep's overhead over plain I/O.
    Target("durable save 1 GiB vs raw write+fsync", "mixed", "save", RAW_SAVE, 1.3),
    Target("verified load 1 GiB vs raw read", "mixed", "load", RAW_LOAD, 3.0),
]


def check_targets(runner: Runner, workloads: dict[str, Workload], quick: bool) -> list[dict[str, Any]]:
    print("\n== targets (shardkeep speedup, median (min-max) of per-rep ratios) ==")
    if quick:
        print("  (--quick: measured on the small workloads, so these say nothing about the real targets)")
    results = []
    for target in TARGETS:
        workload = workloads[target.role]
        times = runner.times[workload.label][target.phase]
        spread = per_rep_ratios(times[target.contender], times[SHARDKEEP])
        met = spread.median >= target.minimum
        verdict = "met" if met else "NOT MET"
        print(
            f"  [{verdict:>7}] {target.description} >= {target.minimum:g}x: {spread.ratio_text()}  ({workload.label})"
        )
        results.append({**target.__dict__, "workload": workload.label, "median": spread.median, "met": met})
    mixed = runner.times[workloads["mixed"].label]
    for phase, contender, against in (
        ("save", SHARDKEEP_PAGE_CACHE, SHARDKEEP),
        ("load", "safetensors", SHARDKEEP_UNVERIFIED),
        ("load", RAW_LOAD, SHARDKEEP_XXH3),
        ("load", RAW_LOAD, SHARDKEEP_CRYPTO),
    ):
        spread = per_rep_ratios(mixed[phase][contender], mixed[phase][against])
        print(f"  [   info] {phase}, {against} vs {contender}: {spread.ratio_text()}  ({workloads['mixed'].label})")
    for contender, paths in WRITE_PATHS.items():
        print(f"  [   info] files written by {contender}: {dict(paths)}")
    small = workloads["small"]
    microseconds = statistics.median(runner.times[small.label]["save"][SHARDKEEP]) / small.count * 1e6
    print(f"  [   info] shardkeep durable save, {small.label}: {microseconds:.1f} µs per tensor")
    return results


def load_average() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / KiB  # ru_maxrss is in KiB on Linux


# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small workloads (64 MiB, 2,000 tensors): a smoke run")
    parser.add_argument("--reps", type=int, default=5, help="repetitions of every contender (default 5)")
    parser.add_argument("--dir", help="scratch directory (a fresh subdirectory is made in it and removed at the end)")
    parser.add_argument("--json", help="also write the results as JSON to this path")
    parser.add_argument(
        "--keyed-pairs",
        type=int,
        default=0,
        help="instead of the tables: this many alternating pairs of keyed loads (digest='cryptographic'),"
        " format 2.1/1.4 against the same state saved with block_size=0 (2.0/1.3)",
    )
    parser.add_argument(
        "--keyed-size-mib", type=int, default=1024, help="the keyed loads' mixed workload (default 1024: 1 GiB)"
    )
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    if args.keyed_pairs < 0 or args.keyed_size_mib < 1:
        parser.error("--keyed-pairs must be at least 0 and --keyed-size-mib at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mixed_bytes, small_count, pretouch_bytes = (
        (64 * MiB, 2_000, 256 * MiB) if args.quick else (GiB, 20_000, 5 * GiB // 2)
    )
    start_load = load_average()
    print(f"command: {sys.executable} {' '.join(sys.argv)}")
    print(f"torch {torch.__version__}, safetensors {safetensors.__version__}, shardkeep {sk.__version__}")
    print(f"load average at start: {start_load}")
    repetitions = f"keyed pairs: {args.keyed_pairs}" if args.keyed_pairs else f"repetitions: {args.reps}"
    print(f"{repetitions}, pretouch before each timed step: {pretouch_bytes / GiB:g} GiB")

    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="shardkeep-bench-", dir=args.dir or "/tmp")
    print(f"scratch directory: {scratch}")
    if args.keyed_pairs:
        try:
            keyed = run_keyed_pairs(args.keyed_pairs, args.keyed_size_mib, scratch, pretouch_bytes)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        print(f"\npeak RSS: {peak_rss_mib():.0f} MiB")
        print(f"load average at end: {load_average()}")
        if args.json:
            with open(args.json, "w") as file:
                json.dump({"command": [sys.executable, *sys.argv], "keyed_pairs": keyed}, file, indent=2)
        return 0
    runner = Runner(reps=args.reps, pretouch_bytes=pretouch_bytes, scratch=scratch)
    workloads: dict[str, Workload] = {}
    try:
        warm_up_code_paths(scratch)
        for build in (lambda: build_mixed_workload(mixed_bytes), lambda: build_small_workload(small_count)):
            workload = build()
            workloads[workload.role] = workload
            print(
                f"\nworkload {workload.label}: {workload.count} tensors, {workload.nbytes} bytes"
                f" ({workload.nbytes / GiB:.3f} GiB)",
                flush=True,
            )
            start = time.perf_counter()
            touch_pages(workload.state)
            print(
                f"  page-touch cost on resident tensors (paid by every tensor loader): {time.perf_counter() - start:.4f} s"
            )
            runner.run_workload(workload)
            for phase in PHASES:
                print_table(workload, phase, runner.times[workload.label][phase])
            workload.release()
            gc.collect()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    targets = check_targets(runner, workloads, args.quick)
    if runner.problems:
        print("\n== PROBLEMS: loaded data differs from saved data ==")
        for problem in runner.problems[:50]:
            print(f"  {problem}")
        if len(runner.problems) > 50:
            print(f"  ... and {len(runner.problems) - 50} more")
    else:
        print("\nall loaders returned exactly the saved tensors (checked in the first repetition)")
    end_load = load_average()
    print(f"\npeak RSS: {peak_rss_mib():.0f} MiB")
    print(f"load average at end: {end_load}")

    if args.json:
        report = {
            "command": [sys.executable, *sys.argv],
            "versions": {
                "torch": torch.__version__,
                "safetensors": safetensors.__version__,
                "shardkeep": sk.__version__,
            },
            "quick": args.quick,
            "reps": args.reps,
            "load_average": {"start": start_load, "end": end_load},
            "peak_rss_mib": peak_rss_mib(),
            "workloads": {
                w.label: {"role": w.role, "tensors": w.count, "bytes": w.nbytes, "seconds": runner.times[w.label]}
                for w in workloads.values()
            },
            "targets": targets,
            "write_paths": {contender: dict(paths) for contender, paths in WRITE_PATHS.items()},
            "problems": runner.problems,
        }
        with open(args.json, "w") as file:
            json.dump(report, file, indent=2)
        print(f"results written to {args.json}")
    return 1 if runner.problems else 0


if __name__ == "__main__":
    sys.exit(main())
