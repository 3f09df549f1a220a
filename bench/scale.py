"""Scale simulator for the target "metadata that grows with tensors plus ranks, not tensors times
ranks": how the checkpoint metadata of a save and of a resharding load grows with the number of
tensors T and of ranks R, measured by running the real shardkeep code for R simulated ranks in
one process.

The save is the real ``saving.run_save``, called once per rank in R threads that run one at a
time, in rank order, each until its next collective (so every rank's own work is timed alone).
Only the collective transport is replaced: :class:`InProcessCoordinator` subclasses the real
``Coordinator`` and overrides just ``all_gather``, ``gather``, ``broadcast`` and ``barrier``, so
``step``, ``step_to_coordinator`` and ``on_coordinator`` are the real ones and the protocol
(which step all-gathers, which gathers) is whatever the imported shardkeep does. Each payload is
pickled as ``all_gather_object`` pickles it (its size recorded, and the padding torch adds: every
payload padded to the largest, times R; a gather is exact where shardkeep's is), also ``msgspec.msgpack``-encoded for its logical size,
and unpickled once for the receivers. No data file is written; files are laid out (headers and
byte offsets are real) and committed into an in-memory store.

Which shardkeep: ``--src head`` (default) imports a ``git archive`` snapshot of the committed
``src/`` (read-only; the working tree may be mid-edit), ``--src worktree`` the working tree,
``--src <rev>`` any revision.

Real shardkeep code, called unchanged:

* ``saving.run_job`` on every rank (the body of ``saving.run_save``): ``SaveJob.prepare`` (the
  real protocol: ``Coordinator.step`` and friends, the writer assignment, tier placement, a real
  ``CheckpointCommit`` on a ``MemoryStore``, ``plan_files``, ``file_header`` and the real
  safetensors header bytes, the manifest of ``saving.manifest_build``), ``SaveJob.write``
  (its validation of the rank's part), ``SaveJob.finish`` on the coordinator (merge,
  ``validate_manifest``, ``coverage_problems``, ``encode_manifest``, ``seal_manifest``);
* ``tensors.flatten.flatten_state`` on a placeholder state with the workload's exact tree;
* ``verification.parse_manifest`` (seal check, strict decode, validation, coverage): the read
  path of every loading rank;
* ``loading.LoadJob.select`` (``select_files``, ``needed_entries``) on sampled ranks of a
  world of R/2 and 2R; and ``sk.save``/``read_manifest``/``verify``/``load`` on disk for the
  wide workload.

Constructed, because the real code needs a process group, DTensors or tensor bytes:

* ``SaveJob.describe`` (flatten + ``PlannedItem(leaf)`` on real tensors) is overridden: the
  items are filled field by field, with each chunk's (local shape, global offset) from torch's
  own DTensor arithmetic, ``torch.distributed.tensor._utils._compute_local_shape_and_global_offset``
  (what ``compute_local_shape_and_global_offset`` calls, given the mesh shape and the rank's mesh
  coordinate instead of a ``DeviceMesh``), with FSDP2's ``_StridedShard`` where FSDP and TP shard
  one dimension; ``replica`` and ``mesh_origin`` (where the version has them) as ``replica_of``
  and ``at_mesh_origin`` compute them;
* ``SaveJob.write_files`` (``write_shards``) is replaced by a function that records what it would (a well-formed blake3
  digest per file and per chunk) and writes nothing; after the real ``write``, a rank's job drops
  what no later step reads (its planned items, a non-coordinator's manifest), so R ranks fit in
  one process;
* each rank runs a ``SimulatedSaveJob`` (a ``SaveJob`` with those steps replaced: the internal
  API ``shardkeep.saving.job`` documents) on its in-process coordinator; a revision older than
  ``run_job`` is driven by swapping ``saving.SaveJob``, ``saving.Coordinator`` and
  ``saving.write_shards`` while the rank threads run ``run_save``;
* the coordinator's ``commit.commit`` keeps the sealed bytes instead of writing them, so that
  ``finish`` can be timed ``--reps`` times (after the save, with the other ranks' objects freed);
* a deterministic computation every rank repeats on identical gathered input (``assign_writers``,
  ``precision_of``, ``SaveJob.place``, ``check_sharded_agreement``) runs once (timed on rank 0) and
  its result is shared, keeping the simulation O(T x R) instead of O(T x R^2) where it can (the
  loop over every rank's summaries in the writer assignment cannot be shared: MoE points cost
  O(T x R^2) to simulate at that commit);
* the garbage collector is paused while the rank threads run (the simulator's heap holds every
  rank's objects; a real rank's does not); ``finish`` and the read are timed with it running;
* on load, ``wanted_regions`` needs DTensors in ``into``: its loop is rerun with each key's region
  taken from the target placements (``local_region``'s arithmetic), swapped in for
  ``loading.wanted_regions`` while ``LoadJob.select`` runs;
* MoE and 405b-3d: the coordinator's state tree is the union of every rank's (see ``moe``).

Workloads (``--workloads``): ``dense-70b`` (FSDP2), ``tp-fsdp-70b`` (TP 8 x FSDP2), ``moe``
(60 layers x 64 experts, one tensor per expert weight, EP 8), ``moe-stacked`` (the same experts
stacked into one ``[E, ...]`` tensor per layer and weight, EP x FSDP2 on a 2-D mesh, as
torchtitan keeps them), ``405b-3d`` (Llama-3-405B, TP 8 x PP 16 x FSDP2: 16,384 ranks give
dp_shard = 128), and ``wide`` (many small whole tensors on one rank).

Measured per workload and R (medians with min-max over ``--reps``; each point in a fresh
subprocess): chunk entries, files, sealed manifest bytes, metadata bytes sent per rank and
received per rank and at the coordinator over the save's collectives, per-rank CPU of the save
(all steps but the coordinator's ``finish``), coordinator seconds (``finish``: gathered records
-> sealed manifest) and its RSS growth, read+validate seconds and RSS growth, the load plan of a
rank of a world of R/2 and 2R (seconds, metadata bytes read: the manifest plus the safetensors
header of every file it opens, files opened), and growth exponents log(m2/m1)/log(R2/R1) between
successive R. Points over ``--max-entries`` are not built: their entry count is exact, every other
metric is extrapolated with the last measured growth exponent and marked '~'.

    .venv/bin/python bench/scale.py --quick                      # 8, 64, 256 ranks; wide 100k
    .venv/bin/python bench/scale.py --workloads dense-70b --ranks 1024
    .venv/bin/python bench/scale.py --json scale.json            # 8 ... 4096 ranks, wide 100k
    .venv/bin/python bench/scale.py --full                       # also wide 1M on disk
    .venv/bin/python bench/scale.py --workloads 405b-3d --ranks 1024,16384 --reps 1
    SHARDKEEP_SCALE_PACK=1 .venv/bin/python bench/scale.py --workloads 405b-3d --ranks 16384 --reps 2 --max-entries 4000000
    .venv/bin/python bench/scale.py --real 16,32 --json real.json  # real gloo ranks against the simulator
    .venv/bin/python bench/scale.py --reshard 1024:768 --workloads dense-70b,moe  # bytes read when resharding
    .venv/bin/python bench/scale.py --reshard 1024:768 --workloads moe --block-kib 16  # with block_size=16 KiB

``SHARDKEEP_SCALE_PACK=1`` keeps the simulated rank indexes zlib-compressed in memory (their
block digests are zeros of the real length), which lets 405b-3d at 16,384 ranks fit in 23 GB
(17.4 GB at its peak). Every byte figure is the same (``tests/test_bench_scale_real.py``); a load
plan's time then includes inflating the indexes it reads.

``--real N[,M]`` (``bench/scale_real.py``) saves and loads the ``tiny-*`` workloads (the layouts
of ``dense-70b``, ``tp-fsdp-70b`` and ``moe-stacked`` with a 2-layer model of hidden size 64) on
N real gloo processes and compares each collective step's count and bytes with what this
simulator predicts for the same workload at N; it exits 1 if a count differs.

:class:`CurrentFormat` measures whatever the imported shardkeep writes: format 2.0 for the
DTensor workloads (regular placements; the TP x FSDP workload's ``_StridedShard`` chunks are
listed one by one, as in 1.x), 1.3 for the wide one. Another format class with the same methods
(``save``, ``build_manifest``, ``read``, ``plan_load``) registered in ``FORMATS`` plugs into
``--format``. ``--format families`` (:class:`FamiliesFormat`) stamps sharded saves 2.1, so the
coordinator writes tensor and entry families (what a 2.1 writer writes):

    PYTHONPATH=$PWD/src .venv/bin/python bench/scale.py --src worktree --workloads moe --ranks 64 --reps 3 --format families
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import gc
import hashlib
import inspect
import io
import itertools
import json
import logging
import math
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import torch
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard, _StridedShard

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _argument(name: str, default: str | None) -> str | None:
    for index, argument in enumerate(sys.argv):
        if argument == name and index + 1 < len(sys.argv):
            return sys.argv[index + 1]
        if argument.startswith(name + "="):
            return argument.partition("=")[2]
    return default


def _snapshot(revision: str) -> str:
    """``src/`` of ``revision``, extracted from ``git archive`` (read-only) into a temporary
    directory; returns the directory to put first on ``sys.path``."""
    commit = subprocess.run(
        ["git", "-C", REPOSITORY, "rev-parse", "--verify", f"{revision}^{{commit}}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    archive = subprocess.run(
        ["git", "-C", REPOSITORY, "archive", commit, "src"], capture_output=True, check=True
    ).stdout
    directory = tempfile.mkdtemp(prefix=f"shardkeep-src-{commit[:10]}-")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(directory, filter="data")
    with open(os.path.join(directory, "COMMIT"), "w") as handle:
        handle.write(commit)
    return os.path.join(directory, "src")


def _choose_shardkeep() -> tuple[str | None, str]:
    """Put the chosen shardkeep first on ``sys.path`` before it is imported: (snapshot source
    directory or None for the working tree, a description)."""
    given = _argument("--src-dir", None)
    if given is None:
        revision = _argument("--src", "head")
        if revision == "worktree" or "--child" in sys.argv:
            return None, "working tree"
        given = _snapshot("HEAD" if revision == "head" else str(revision))
        atexit.register(shutil.rmtree, os.path.dirname(given), ignore_errors=True)
    sys.path.insert(0, given)
    with open(os.path.join(os.path.dirname(given), "COMMIT")) as handle:
        return given, f"commit {handle.read()[:10]}"


SOURCE_DIR, SOURCE = _choose_shardkeep()

# The imports of shardkeep follow the choice of which shardkeep to import (hence noqa: E402).
import shardkeep as sk  # noqa: E402
from common import fmt_bytes, fmt_count, fmt_range, fmt_seconds, growth, median, status_kib, table, touch_memory  # noqa: E402  (bench/ is the script's directory)
from shardkeep import loading, saving  # noqa: E402
from shardkeep.config import LoadOptions, ManifestLimits  # noqa: E402
from shardkeep.distributed.coordinator import Coordinator  # noqa: E402

#: Whether the imported shardkeep gathers to the coordinator without padding (see ``padded``).
_EXACT_GATHER = hasattr(Coordinator, "_gather_exact")
from shardkeep.layout import PlannedItem  # noqa: E402
from shardkeep.manifest import DTYPE_ITEMSIZE, FileRecord, Manifest, parse_placements  # noqa: E402
from shardkeep.progress import collector_paused  # noqa: E402
from shardkeep.storage import ForwardingStore, MemoryStore  # noqa: E402
from shardkeep.tensors.flatten import FlatState, TensorLeaf, flatten_state  # noqa: E402
from shardkeep.tensors.grid import Grid  # noqa: E402
from shardkeep.verification import CheckpointLocation, locate, parse_manifest  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
#: Limits lifted so that the cost itself is measured (the defaults refuse large manifests).
LIFTED = ManifestLimits(max_bytes=1 << 40, max_files=10**9, max_tensors=10**10)
#: What ``write_shards`` would record: a well-formed blake3 digest (files and chunks).
FAKE_DIGEST = "blake3:" + "5e" * 32
FAKE_FAST_DIGEST = "xxh3-128:" + "5e" * 16
QUICK_RANKS = (8, 64, 256)
DEFAULT_RANKS = (8, 64, 256, 1024, 4096)


# ---------------------------------------------------------------------------------------------
# Workloads: tensors, meshes, and the chunk each rank holds
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mesh:
    """A device mesh: its shape and the global rank at each coordinate (row-major)."""

    shape: tuple[int, ...]
    ranks: tuple[int, ...]

    def coordinates(self) -> dict[int, tuple[int, ...]]:
        found: dict[int, tuple[int, ...]] = {}
        for index, rank in enumerate(self.ranks):
            coordinate = []
            for size in reversed(self.shape):
                coordinate.append(index % size)
                index //= size
            found[rank] = tuple(reversed(coordinate))
        return found


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the state. ``placements`` None: a plain tensor, held whole by every rank of
    its mesh (written once); else a DTensor on that mesh."""

    key: str
    path: tuple[str | int, ...]
    dtype: str
    global_shape: tuple[int, ...]
    mesh: int
    placements: tuple[Placement, ...] | None


_CHUNKS: dict[tuple[Any, ...], tuple[tuple[int, ...], tuple[int, ...]]] = {}


def chunk_of(
    global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...], placements: tuple[Any, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of the chunk at ``coordinate``: torch's DTensor arithmetic."""
    cache_key = (global_shape, mesh_shape, coordinate, placements)
    found = _CHUNKS.get(cache_key)
    if found is None:
        shape, offset = _compute_local_shape_and_global_offset(global_shape, mesh_shape, list(coordinate), placements)
        found = _CHUNKS[cache_key] = (tuple(int(s) for s in shape), tuple(int(o) for o in offset))
    return found


Chunk = tuple[int, tuple[int, ...], tuple[int, ...] | None]  # (tensor index, shape, global offset)


@dataclass
class Workload:
    """The tensors of a training state on ``world`` ranks, and the state tree they sit in."""

    name: str
    world: int
    tensors: list[TensorSpec]
    meshes: list[Mesh]
    extra_state: dict[str, Any] = field(default_factory=dict)  # JSON leaves (param_groups ...)
    _by_mesh: dict[int, list[int]] | None = None
    _coordinates: list[dict[int, tuple[int, ...]]] | None = None

    def _index(self) -> tuple[dict[int, list[int]], list[dict[int, tuple[int, ...]]]]:
        if self._by_mesh is None or self._coordinates is None:
            self._by_mesh = {}
            for index, spec in enumerate(self.tensors):
                self._by_mesh.setdefault(spec.mesh, []).append(index)
            self._coordinates = [mesh.coordinates() for mesh in self.meshes]
        return self._by_mesh, self._coordinates

    def rank_chunks(self, rank: int) -> list[Chunk]:
        """What ``rank`` holds, in state order: whole tensors and its chunks of DTensors."""
        by_mesh, coordinates = self._index()
        held: list[Chunk] = []
        for mesh_index, indices in by_mesh.items():
            coordinate = coordinates[mesh_index].get(rank)
            if coordinate is None:
                continue
            mesh_shape = self.meshes[mesh_index].shape
            for index in indices:
                spec = self.tensors[index]
                if spec.placements is None:
                    held.append((index, spec.global_shape, None))
                else:
                    shape, offset = chunk_of(spec.global_shape, mesh_shape, coordinate, spec.placements)
                    held.append((index, shape, offset))
        held.sort(key=lambda chunk: chunk[0])
        return held

    def coordinate_of(self, index: int, rank: int) -> tuple[int, ...]:
        """This rank's coordinate on the mesh of tensor ``index``."""
        _, coordinates = self._index()
        return tuple(coordinates[self.tensors[index].mesh][rank])

    def replica_of(self, index: int, rank: int) -> tuple[int, int]:
        """(this rank's index among the holders of its chunk, how many hold it): the ranks that
        differ only on ``Replicate`` mesh dimensions, as ``tensors.convert.replica_of`` computes."""
        _, coordinates = self._index()
        spec = self.tensors[index]
        coordinate = coordinates[spec.mesh][rank]
        position, count = 0, 1
        for dim, placement in enumerate(spec.placements or ()):
            if placement.is_replicate():
                size = self.meshes[spec.mesh].shape[dim]
                position, count = position * size + coordinate[dim], count * size
        return position, count

    def entry_count(self) -> int:
        """Tensor entries the manifest will list: one per distinct (key, global offset), as
        ``assign_writers`` deduplicates replicas (empty chunks share one offset)."""
        _, coordinates = self._index()
        distinct: dict[tuple[Any, ...], int] = {}
        total = 0
        for spec in self.tensors:
            if spec.placements is None:
                total += 1
                continue
            mesh = self.meshes[spec.mesh]
            cache_key = (spec.global_shape, mesh.shape, spec.placements)
            count = distinct.get(cache_key)
            if count is None:
                offsets = {
                    chunk_of(spec.global_shape, mesh.shape, coordinate, spec.placements)[1]
                    for coordinate in coordinates[spec.mesh].values()
                }
                count = distinct[cache_key] = len(offsets)
            total += count
        return total

    def held_upper_bound(self) -> int:
        """Items all ranks hold together (replicas counted): an upper bound of the entries."""
        return sum(len(self.meshes[spec.mesh].ranks) for spec in self.tensors)

    def state(self) -> dict[str, Any]:
        """A placeholder state with the real tree: every tensor leaf is one shared empty tensor."""
        placeholder = torch.empty(0)
        state: dict[str, Any] = {}
        for spec in self.tensors:
            node = state
            for part in spec.path[:-1]:
                node = node.setdefault(part, {})
            node[spec.path[-1]] = placeholder
        for top, value in self.extra_state.items():
            node = state.setdefault(top, {})
            node.update(value)
        return state


def _adamw(
    params: list[tuple[str, tuple[int, ...], int, tuple[Placement, ...] | None]],
    *,
    name: str,
    world: int,
    meshes: list[Mesh],
    state_keys: str,
    step_mesh: Callable[[int], int] | None = None,
) -> Workload:
    """Parameters (fqn, shape, mesh, placements) plus AdamW state: ``step`` (a plain 0-d tensor,
    as FSDP2's AdamW keeps it), ``exp_avg`` and ``exp_avg_sq`` (placed like the parameter).
    ``state_keys`` "index": ``optim.state.<i>`` as ``optimizer.state_dict()`` gives it; "fqn":
    ``optim.state.<fqn>`` (needed when ranks hold different parameters, as under EP)."""
    tensors = [
        TensorSpec(f"model.{fqn}", ("model", fqn), "F32", shape, mesh, placements)
        for fqn, shape, mesh, placements in params
    ]
    ids: list[str | int] = []
    for index, (fqn, shape, mesh, placements) in enumerate(params):
        ident: str | int = index if state_keys == "index" else fqn
        ids.append(ident)
        step_on = step_mesh(index) if step_mesh is not None else mesh
        tensors.append(
            TensorSpec(f"optim.state.{ident}.step", ("optim", "state", ident, "step"), "F32", (), step_on, None)
        )
        for moment in ("exp_avg", "exp_avg_sq"):
            tensors.append(
                TensorSpec(
                    f"optim.state.{ident}.{moment}", ("optim", "state", ident, moment), "F32", shape, mesh, placements
                )
            )
    group = {
        "lr": 3e-4,
        "betas": (0.9, 0.95),
        "eps": 1e-8,
        "weight_decay": 0.1,
        "amsgrad": False,
        "foreach": None,
        "maximize": False,
        "capturable": False,
        "differentiable": False,
        "fused": None,
        "decoupled_weight_decay": True,
        "params": ids,
    }
    return Workload(name, world, tensors, meshes, extra_state={"optim": {"param_groups": [group]}})


def _llama(
    *, layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int
) -> list[tuple[str, tuple[int, ...], str]]:
    """(fqn, shape, tensor-parallel style) of a Llama model in torchtitan's naming and order."""
    kv = kv_heads * (hidden // heads)
    params = [("tok_embeddings.weight", (vocab, hidden), "embedding")]
    for layer in range(layers):
        p = f"layers.{layer}."
        params += [
            (p + "attention.wq.weight", (hidden, hidden), "colwise"),
            (p + "attention.wk.weight", (kv, hidden), "colwise"),
            (p + "attention.wv.weight", (kv, hidden), "colwise"),
            (p + "attention.wo.weight", (hidden, hidden), "rowwise"),
            (p + "feed_forward.w1.weight", (intermediate, hidden), "colwise"),
            (p + "feed_forward.w2.weight", (hidden, intermediate), "rowwise"),
            (p + "feed_forward.w3.weight", (intermediate, hidden), "colwise"),
            (p + "attention_norm.weight", (hidden,), "norm"),
            (p + "ffn_norm.weight", (hidden,), "norm"),
        ]
    params += [("norm.weight", (hidden,), "norm"), ("output.weight", (vocab, hidden), "colwise")]
    return params


LLAMA_70B = {"layers": 80, "hidden": 8192, "intermediate": 28672, "heads": 64, "kv_heads": 8, "vocab": 128256}


def dense_70b(world: int, *, config: dict[str, int] = LLAMA_70B, name: str = "dense-70b") -> Workload:
    """Llama-70B + AdamW under FSDP2: every parameter ``Shard(0)`` over all ``world`` ranks."""
    mesh = Mesh((world,), tuple(range(world)))
    params = [(fqn, shape, 0, (Shard(0),)) for fqn, shape, _ in _llama(**config)]
    return _adamw(params, name=name, world=world, meshes=[mesh], state_keys="index")


def tp_fsdp_70b(world: int, *, config: dict[str, int] = LLAMA_70B, name: str = "tp-fsdp-70b") -> Workload:
    """Llama-70B + AdamW under TP x FSDP2 on a 2-D mesh (dp_shard, tp), TP = 8 (or ``world``
    if smaller), as torchtitan places it: column-parallel (wq, wk, wv, w1, w3, output) and the
    row-parallel embedding ``Shard(0)`` on TP, row-parallel wo/w2 ``Shard(1)``, norms replicated
    on TP (sequence parallel); FSDP2 adds ``Shard(0)`` on dp_shard, a ``_StridedShard`` where TP
    shards dim 0 too."""
    tp = min(8, world)
    dp = world // tp
    mesh = Mesh((dp, tp), tuple(range(dp * tp)))
    strided: Placement = _StridedShard(0, split_factor=tp) if tp > 1 else Shard(0)
    styles: dict[str, tuple[Placement, ...]] = {
        "colwise": (strided, Shard(0)),
        "embedding": (strided, Shard(0)),
        "rowwise": (Shard(0), Shard(1)),
        "norm": (Shard(0), Replicate()),
    }
    params = [(fqn, shape, 0, styles[style]) for fqn, shape, style in _llama(**config)]
    return _adamw(params, name=name, world=dp * tp, meshes=[mesh], state_keys="index")


MOE = {
    "layers": 60,
    "experts": 64,
    "hidden": 4096,
    "expert_intermediate": 1408,
    "heads": 32,
    "kv_heads": 8,
    "vocab": 102400,
}


def moe(world: int) -> Workload:
    """A 60-layer MoE (64 experts x 3 weights per layer as separate tensors, ``experts.<e>`` with
    the global expert index) + AdamW. Expert parallelism: the ranks form a (dp, ep) mesh with
    EP = 8 (or ``world``); expert e lives on EP group e // (64 / EP), where FSDP2 shards it
    ``Shard(0)`` over that group's dp ranks. Attention, norms, router and embeddings: FSDP2
    ``Shard(0)`` over all ranks. Optimizer state is keyed by FQN (integer ids would name
    different experts on different ranks).

    Today's coordinator takes the state tree (containers) from its own state, so it would refuse
    this save: ``optim.state.<expert fqn>`` containers of experts it does not hold are missing
    ("state paths have no parent container"). The simulator gives it the union tree."""
    cfg = MOE
    ep = min(8, world)
    dp = world // ep
    world = dp * ep
    grid = [[row * ep + column for column in range(ep)] for row in range(dp)]
    meshes = [Mesh((world,), tuple(range(world)))]
    meshes += [Mesh((dp,), tuple(grid[row][group] for row in range(dp))) for group in range(ep)]
    hidden, kv = cfg["hidden"], cfg["kv_heads"] * (cfg["hidden"] // cfg["heads"])
    inter, experts_per_group = cfg["expert_intermediate"], cfg["experts"] // ep
    fsdp = (Shard(0),)
    params: list[tuple[str, tuple[int, ...], int, tuple[Placement, ...] | None]] = [
        ("tok_embeddings.weight", (cfg["vocab"], hidden), 0, fsdp)
    ]
    for layer in range(cfg["layers"]):
        p = f"layers.{layer}."
        params += [
            (p + "attention.wq.weight", (hidden, hidden), 0, fsdp),
            (p + "attention.wk.weight", (kv, hidden), 0, fsdp),
            (p + "attention.wv.weight", (kv, hidden), 0, fsdp),
            (p + "attention.wo.weight", (hidden, hidden), 0, fsdp),
            (p + "moe.router.gate.weight", (cfg["experts"], hidden), 0, fsdp),
        ]
        for expert in range(cfg["experts"]):
            group = 1 + expert // experts_per_group
            e = f"{p}moe.experts.{expert}."
            params += [
                (e + "w1", (inter, hidden), group, fsdp),
                (e + "w2", (hidden, inter), group, fsdp),
                (e + "w3", (inter, hidden), group, fsdp),
            ]
        params += [(p + "attention_norm.weight", (hidden,), 0, fsdp), (p + "ffn_norm.weight", (hidden,), 0, fsdp)]
    params += [("norm.weight", (hidden,), 0, fsdp), ("output.weight", (cfg["vocab"], hidden), 0, fsdp)]
    return _adamw(params, name="moe", world=world, meshes=meshes, state_keys="fqn")


LLAMA3_405B = {"layers": 126, "hidden": 16384, "intermediate": 53248, "heads": 128, "kv_heads": 8, "vocab": 128256}


def llama_405b_3d(world: int) -> Workload:
    """Llama-3-405B + AdamW under TP x PP x FSDP2, torchtitan's 3-D layout: a (pp, dp_shard, tp)
    mesh with TP = 8 and PP = 16 (each as large as ``world`` allows), pp outermost. The 126
    layers are split over the stages as evenly as possible (the first stages take the extra
    layers); the first stage also holds the embedding, the last the final norm and output.
    Each stage's tensors live on that stage's (dp_shard, tp) sub-mesh, placed as
    ``tp-fsdp-70b`` places them. Ranks of different stages hold different layers, so their
    state trees differ (as under expert parallelism): optimizer state is keyed by FQN."""
    tp = min(8, world)
    pp = max(1, min(16, world // tp))
    dp = max(1, world // (tp * pp))
    world = pp * dp * tp
    meshes = [Mesh((dp, tp), tuple(range(stage * dp * tp, (stage + 1) * dp * tp))) for stage in range(pp)]
    strided: Placement = _StridedShard(0, split_factor=tp) if tp > 1 else Shard(0)
    styles: dict[str, tuple[Placement, ...]] = {
        "colwise": (strided, Shard(0)),
        "embedding": (strided, Shard(0)),
        "rowwise": (Shard(0), Shard(1)),
        "norm": (Shard(0), Replicate()),
    }
    layers = LLAMA3_405B["layers"]
    per_stage = [layers // pp + (1 if stage < layers % pp else 0) for stage in range(pp)]
    first_layer = [sum(per_stage[:stage]) for stage in range(pp)]

    def stage_of(fqn: str) -> int:
        if fqn.startswith("tok_embeddings."):
            return 0
        if not fqn.startswith("layers."):
            return pp - 1  # norm, output
        layer = int(fqn.split(".")[1])
        return max(stage for stage in range(pp) if first_layer[stage] <= layer)

    params = [(fqn, shape, stage_of(fqn), styles[style]) for fqn, shape, style in _llama(**LLAMA3_405B)]
    return _adamw(params, name="405b-3d", world=world, meshes=meshes, state_keys="fqn")


def moe_stacked(world: int, *, config: dict[str, int] = MOE, name: str = "moe-stacked") -> Workload:
    """The ``moe`` model with each layer's experts stacked, as torchtitan keeps them: three
    ``[experts, ...]`` tensors per layer (``moe.experts.w1``, ``w2``, ``w3``) on a (dp, ep)
    mesh over all ranks, ``Shard(0)`` (the expert dimension) on EP and ``Shard(1)`` on dp
    (FSDP2 shards the next dimension when the first is taken). The rest as in ``moe``. Every
    rank holds a chunk of every tensor, so optimizer state is keyed by parameter index."""
    cfg = config
    ep = min(8, world)
    dp = world // ep
    world = dp * ep
    meshes = [Mesh((world,), tuple(range(world))), Mesh((dp, ep), tuple(range(world)))]
    hidden, kv = cfg["hidden"], cfg["kv_heads"] * (cfg["hidden"] // cfg["heads"])
    inter, experts = cfg["expert_intermediate"], cfg["experts"]
    fsdp = (Shard(0),)
    stacked = (Shard(1), Shard(0))
    params: list[tuple[str, tuple[int, ...], int, tuple[Placement, ...] | None]] = [
        ("tok_embeddings.weight", (cfg["vocab"], hidden), 0, fsdp)
    ]
    for layer in range(cfg["layers"]):
        p = f"layers.{layer}."
        params += [
            (p + "attention.wq.weight", (hidden, hidden), 0, fsdp),
            (p + "attention.wk.weight", (kv, hidden), 0, fsdp),
            (p + "attention.wv.weight", (kv, hidden), 0, fsdp),
            (p + "attention.wo.weight", (hidden, hidden), 0, fsdp),
            (p + "moe.router.gate.weight", (experts, hidden), 0, fsdp),
            (p + "moe.experts.w1", (experts, inter, hidden), 1, stacked),
            (p + "moe.experts.w2", (experts, hidden, inter), 1, stacked),
            (p + "moe.experts.w3", (experts, inter, hidden), 1, stacked),
            (p + "attention_norm.weight", (hidden,), 0, fsdp),
            (p + "ffn_norm.weight", (hidden,), 0, fsdp),
        ]
    params += [("norm.weight", (hidden,), 0, fsdp), ("output.weight", (cfg["vocab"], hidden), 0, fsdp)]
    return _adamw(params, name=name, world=world, meshes=meshes, state_keys="index")


def wide(count: int) -> Workload:
    """``count`` small whole tensors (64 x fp32) on one rank."""
    tensors = [
        TensorSpec(
            f"model.block{i // 100}.weight{i % 100}",
            ("model", f"block{i // 100}.weight{i % 100}"),
            "F32",
            (64,),
            0,
            None,
        )
        for i in range(count)
    ]
    return Workload(f"wide-{count // 1000}k", 1, tensors, [Mesh((1,), (0,))])


#: The tiny shapes of the ``tiny-*`` workloads, the same layouts at a size real ranks can save
#: (``--real``): a 2-layer Llama of hidden size 64, and a 2-layer MoE of 8 experts.
TINY_LLAMA = {"layers": 2, "hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 2, "vocab": 256}
TINY_MOE = {
    "layers": 2,
    "experts": 8,
    "hidden": 64,
    "expert_intermediate": 32,
    "heads": 4,
    "kv_heads": 2,
    "vocab": 256,
}

WORKLOADS: dict[str, Callable[[int], Workload]] = {
    "dense-70b": dense_70b,
    "tp-fsdp-70b": tp_fsdp_70b,
    "moe": moe,
    "moe-stacked": moe_stacked,
    "405b-3d": llama_405b_3d,
    "tiny-dense": lambda world: dense_70b(world, config=TINY_LLAMA, name="tiny-dense"),
    "tiny-tp-fsdp": lambda world: tp_fsdp_70b(world, config=TINY_LLAMA, name="tiny-tp-fsdp"),
    "tiny-moe-stacked": lambda world: moe_stacked(world, config=TINY_MOE, name="tiny-moe-stacked"),
}
#: Run by default (the ``tiny-*`` ones are for ``--real``, or named in ``--workloads``).
DEFAULT_WORKLOADS = [name for name in WORKLOADS if not name.startswith("tiny-")]


# ---------------------------------------------------------------------------------------------
# The collective transport, in process: R rank threads taking turns
# ---------------------------------------------------------------------------------------------


@dataclass
class StepTraffic:
    """One collective: the pickled and msgpack size of what each rank sent. ``kind`` is the
    ``Coordinator`` primitive: "all_gather" (every rank receives every payload), "gather" (the
    coordinator receives them), "broadcast" (the coordinator's payload to every rank) or
    "barrier"."""

    label: str
    kind: str
    pickled: list[int]
    msgpack: list[int]
    unpickle_seconds: float = 0.0  # what one receiver spends unpickling what it receives

    def received(self, sizes: list[int], *, coordinator: bool) -> int:
        """Logical bytes one rank receives (the coordinator, or any other rank)."""
        if self.kind == "all_gather":
            return sum(sizes)
        if self.kind == "gather":
            return sum(sizes) if coordinator else 0
        if self.kind == "broadcast":
            return 0 if coordinator else sizes[0]
        return 0

    def padded(self, *, coordinator: bool) -> int:
        """Bytes one rank receives through the transport: ``all_gather_object`` pads every payload
        to the largest, ``broadcast_object_list`` does not; a gather pads like ``gather_object``
        in shardkeep versions that used it, and is exact (8 bytes of size per rank, then each
        payload) in those whose ``Coordinator`` has ``_gather_exact``."""
        if self.kind == "gather" and coordinator and _EXACT_GATHER:
            return 8 * len(self.pickled) + sum(self.pickled)
        if self.kind == "all_gather" or (self.kind == "gather" and coordinator):
            return len(self.pickled) * max(self.pickled)
        if self.kind == "broadcast" and not coordinator:
            return self.pickled[0]
        return 0


class _Aborted(BaseException):
    """Another rank failed: unwind this rank's thread (a BaseException, so that the real code's
    ``except Exception`` turns it into no rank failure of its own)."""


class Baton:
    """Runs one function per rank in R threads, one thread at a time, in rank order: each runs
    until its next collective (:meth:`exchange`), hands the turn to the next rank, and the last
    rank to arrive completes the collective. So the time a rank spends between two collectives
    is its own work alone (``compute[label][rank]``: the work before the collective ``label``)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.turn = [threading.Event() for _ in range(world)]
        self.pending: list[tuple[str, str, Any]] = [("", "", None)] * world
        self.results: list[Any] = [None] * world
        self.returned: list[Any] = [None] * world
        self.failure: BaseException | None = None
        self.resumed = [0.0] * world
        self.compute: dict[str, list[float]] = {}
        self.traffic: list[StepTraffic] = []
        self._msgpack = msgspec.msgpack.Encoder()

    def run(self, body: Callable[[int], Any]) -> list[Any]:
        threads = [threading.Thread(target=self._rank, args=(rank, body), daemon=True) for rank in range(self.world)]
        for thread in threads:
            thread.start()
        self.turn[0].set()
        for thread in threads:
            thread.join()
        if self.failure is not None:
            raise RuntimeError(f"a simulated rank failed: {self.failure!r}") from self.failure
        return self.returned

    def _rank(self, rank: int, body: Callable[[int], Any]) -> None:
        try:
            self._wait(rank)
            self.returned[rank] = body(rank)
            self._note(rank, "after the last collective")
        except _Aborted:
            return
        except BaseException as exc:
            self.failure = self.failure or exc
            for event in self.turn:
                event.set()
            return
        if rank + 1 < self.world:
            self.turn[rank + 1].set()

    def _wait(self, rank: int) -> None:
        self.turn[rank].wait()
        self.turn[rank].clear()
        if self.failure is not None:
            raise _Aborted()
        self.resumed[rank] = time.perf_counter()

    def _note(self, rank: int, label: str) -> None:
        spent = time.perf_counter() - self.resumed[rank]
        self.compute.setdefault(label, [0.0] * self.world)[rank] += spent

    def exchange(self, rank: int, kind: str, label: str, value: Any) -> Any:
        self._note(rank, label)
        self.pending[rank] = (kind, label, value)
        if rank + 1 < self.world:
            self.turn[rank + 1].set()
        else:
            try:
                self._complete()
            except BaseException as exc:
                self.failure = exc
                for event in self.turn:
                    event.set()
                raise _Aborted() from exc
            self.turn[0].set()
        self._wait(rank)
        return self.results[rank]

    def _msgpack_size(self, value: Any) -> int:
        try:
            return len(self._msgpack.encode(value))
        except (TypeError, msgspec.EncodeError):
            return -1  # not encodable (a RankFailure): only on errors

    def _complete(self) -> None:
        kinds = {(kind, label) for kind, label, _ in self.pending}
        if len(kinds) != 1:
            raise RuntimeError(f"ranks reached different collectives: {sorted(kinds)}")
        ((kind, label),) = kinds
        source = 0
        if kind.startswith("broadcast@"):  # from rank ``source`` (the coordinator by default)
            kind, source = "broadcast", int(kind.partition("@")[2])
        values = [value for _, _, value in self.pending]
        self.pending = [("", "", None)] * self.world
        senders = [source] if kind == "broadcast" else [] if kind == "barrier" else list(range(self.world))
        blobs = {rank: pickle.dumps(values[rank]) for rank in senders}
        pickled = [len(blobs[rank]) if rank in blobs else 0 for rank in range(self.world)]
        packed = [self._msgpack_size(values[rank]) if rank in blobs else 0 for rank in range(self.world)]
        started = time.perf_counter()
        if kind == "all_gather":
            received = [pickle.loads(blobs[rank]) for rank in range(self.world)]
            self.results = [received] * self.world  # one decoded copy, shared by the receivers
        elif kind == "gather":
            self.results = [[pickle.loads(blobs[rank]) for rank in range(self.world)]] + [None] * (self.world - 1)
        elif kind == "broadcast":
            received = pickle.loads(blobs[source])
            self.results = [values[source] if rank == source else received for rank in range(self.world)]
        else:
            self.results = [None] * self.world
        self.traffic.append(StepTraffic(label, kind, pickled, packed, time.perf_counter() - started))
        del blobs

    def summary(self) -> dict[str, Any]:
        def per_rank(sizes: Callable[[StepTraffic], list[int]]) -> dict[str, int]:
            sent = [sum(max(0, sizes(step)[rank]) for step in self.traffic) for rank in range(self.world)]
            return {
                "sent_per_rank": max(sent, default=0),
                "recv_per_rank": sum(
                    step.received([max(0, s) for s in sizes(step)], coordinator=False) for step in self.traffic
                ),
                "recv_coordinator": sum(
                    step.received([max(0, s) for s in sizes(step)], coordinator=True) for step in self.traffic
                ),
            }

        return {
            "steps": [
                {
                    "label": step.label,
                    "kind": step.kind,
                    "pickled_max": max(step.pickled),
                    "pickled_total": sum(step.pickled),
                    "msgpack_max": max(step.msgpack),
                    "msgpack_total": sum(max(0, s) for s in step.msgpack),
                    "unpickle_s": step.unpickle_seconds,
                }
                for step in self.traffic
            ],
            "msgpack": per_rank(lambda step: step.msgpack),
            "pickle": per_rank(lambda step: step.pickled),
            "recv_per_rank_padded": sum(step.padded(coordinator=False) for step in self.traffic),
            "recv_coordinator_padded": sum(step.padded(coordinator=True) for step in self.traffic),
            "unpickle_s_per_rank": sum(
                s.unpickle_seconds for s in self.traffic if s.kind in ("all_gather", "broadcast")
            ),
            "unpickle_s_coordinator": sum(
                s.unpickle_seconds for s in self.traffic if s.kind in ("all_gather", "gather")
            ),
            "compute": {
                label: {"rank0": seconds[0], "max": max(seconds), "median": statistics.median(seconds)}
                for label, seconds in self.compute.items()
            },
        }


class InProcessCoordinator(Coordinator):
    """The real ``Coordinator`` (``step``, ``step_to_coordinator``, ``on_coordinator``) with its
    four transport primitives sent through a :class:`Baton` instead of a process group."""

    def __init__(self, rank: int, world_size: int, baton: Baton) -> None:
        self.timeout = 300.0
        self._dist = None
        self.group = None
        self.rank = rank
        self.world_size = world_size
        self.baton = baton

    def all_gather(self, value: Any, *, label: str = "all_gather") -> list[Any]:
        if not self.distributed:
            return [value]
        return self.baton.exchange(self.rank, "all_gather", label, value)  # type: ignore[no-any-return]

    def gather(self, value: Any, *, label: str = "gather") -> list[Any] | None:
        if not self.distributed:
            return [value]
        return self.baton.exchange(self.rank, "gather", label, value)  # type: ignore[no-any-return]

    def broadcast(self, value: Any, *, label: str = "broadcast", source: int = 0) -> Any:
        if not self.distributed:
            return value
        return self.baton.exchange(self.rank, f"broadcast@{source}", label, value)

    def barrier(self, *, label: str = "barrier") -> None:
        if self.distributed:
            self.baton.exchange(self.rank, "barrier", label, None)


# ---------------------------------------------------------------------------------------------
# The save job with its tensor-touching steps replaced
# ---------------------------------------------------------------------------------------------


class RecordingCommit:
    """The coordinator's commit at ``finish``: the real commit object's bookkeeping, but the
    sealed manifest is kept instead of written (so that ``finish`` can run again)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.sealed: bytes | None = None

    def add_data_file(self, path: str) -> None:
        if self.real is not None:
            self.real.add_data_file(path)

    def commit(self, manifest_bytes: bytes, signature: bytes | None = None) -> None:
        self.sealed = manifest_bytes

    def abort(self) -> None:
        if self.real is not None:
            self.real.abort()


class Simulation:
    """One simulated save: the workload's placeholder state and its leaves, and what the ranks
    left for measuring (the coordinator's job and gathered records, header sizes)."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.state = workload.state()
        self.flat: FlatState = flatten_state(self.state)
        self.leaves: dict[str, TensorLeaf] = {leaf.key: leaf for leaf in self.flat.tensors}
        self.header_bytes: dict[str, int] = {}
        self.finish_inputs: tuple[Any, Any] | None = None
        self.finish_seconds = 0.0
        self.local = threading.local()
        self.has_replica = "replica" in PlannedItem.__slots__
        self.has_mesh_origin = "mesh_origin" in PlannedItem.__slots__
        self.has_layout = "layout" in PlannedItem.__slots__
        self.layouts: dict[int, Any] = {}

    def layout(self, index: int) -> Any:
        """``tensors.convert.regular_layout`` of tensor ``index`` (``None`` off a regular grid)."""
        found = self.layouts.get(index, False)
        if found is not False:
            return found
        spec = self.workload.tensors[index]
        names: list[str] | None = []
        for placement in spec.placements or ():
            if type(placement) is Shard and placement.dim >= 0:
                names.append(f"S{placement.dim}")  # type: ignore[union-attr]
            elif isinstance(placement, _StridedShard) and placement.dim >= 0:
                names.append(f"S{placement.dim}/{placement.split_factor}")  # type: ignore[union-attr]
            elif placement.is_replicate():
                names.append("R")  # type: ignore[union-attr]
            else:
                names = None
                break
        layout = None
        if names is not None and spec.placements is not None:
            mesh = self.workload.meshes[spec.mesh]
            token = hashlib.blake2b(repr((mesh.shape, mesh.ranks)).encode(), digest_size=8).hexdigest()
            dims = parse_placements(names, len(spec.global_shape))
            if dims is not None and Grid.of(tuple(spec.global_shape), mesh.shape, dims).regular:
                layout = (mesh.shape, mesh.ranks, token, tuple(names))
        self.layouts[index] = layout
        return layout

    def planned(self, rank: int) -> list[PlannedItem]:
        """This rank's PlannedItems, as ``PlannedItem(leaf)`` would describe its tensors."""
        workload = self.workload
        items: list[PlannedItem] = []
        for index, shape, offset in workload.rank_chunks(rank):
            spec = workload.tensors[index]
            item = PlannedItem.__new__(PlannedItem)
            item.leaf = self.leaves[spec.key]
            item.array = None
            item.wants_digest = offset is not None
            item.global_shape = list(spec.global_shape) if offset is not None else None
            item.global_offset = list(offset) if offset is not None else None
            item.dtype = spec.dtype
            item.shape = list(shape)
            item.itemsize = DTYPE_ITEMSIZE[spec.dtype]
            item.nbytes = math.prod(shape) * item.itemsize
            item.array_type = "torch"
            item.address = None
            if self.has_replica:
                item.replica = workload.replica_of(index, rank) if offset is not None else (0, 1)
            if self.has_mesh_origin:  # as tensors.convert.at_mesh_origin computes
                item.mesh_origin = offset is None or not any(workload.coordinate_of(index, rank))
            if self.has_layout:
                item.layout = self.layout(index) if offset is not None else None
            items.append(item)
        return items


SIMULATION: Simulation | None = None


#: Whether the imported shardkeep has the simulation API of ``shardkeep.saving.job``
#: (``run_job`` and the replaceable steps ``describe``, ``place`` and ``write_files``); older
#: revisions are driven through their private step names instead, for before/after runs.
_SIMULATION_API = hasattr(saving, "run_job")


class SimulatedSaveJob(saving.SaveJob):
    """``SaveJob`` with ``describe`` built from the workload instead of tensors, ``place``
    computed once for identical gathered input, ``write_files`` recording instead of writing,
    and ``finish`` recording its inputs."""

    def describe(self, descriptors: bool = True) -> list[Any]:
        assert SIMULATION is not None
        self.flat = SIMULATION.flat
        self.planned = SIMULATION.planned(self.coordinator.rank)
        if hasattr(self, "on_grid"):
            self.on_grid = {item.leaf.key for item in self.planned if item.layout is not None}
        return [item.descriptor for item in self.planned]

    def place(self, *arguments: Any) -> None:
        real = saving.SaveJob.place if _SIMULATION_API else getattr(saving.SaveJob, "_place")  # noqa: B009
        self.tier_of = _memo("SaveJob.place", lambda: (real(self, *arguments), self.tier_of)[1], arguments)

    def write_files(self, on_bytes: Any) -> None:
        _fake_write_shards(None, self.plans, fast=getattr(self.options, "block_size", 0) != 0)

    if hasattr(saving.SaveJob, "_writers"):

        def _writers(self, *arguments: Any) -> Any:
            """The real writer assignment; its global totals (the same dict on every rank)
            shared by the ranks whose totals are equal, so that R ranks do not keep R copies
            of a T-entry dict (the 405b-3d trees at R = 16,384)."""
            planned_here, totals = super()._writers(*arguments)
            return planned_here, _equal_shared("totals", totals)

    if not _SIMULATION_API:  # the same steps under an older revision's names
        _describe = describe
        _place = place

    def write(self) -> Any:
        """The real ``write``; then what no later step uses is dropped (the planned items, and a
        non-coordinator's manifest), so that R ranks' objects fit in one process."""
        records = super().write()
        self.planned = []
        self.plans = []
        if not self.coordinator.is_coordinator:
            self.manifest = None
        return records

    def finish(self, records: Any) -> Any:
        assert SIMULATION is not None
        if self.coordinator.is_coordinator:
            SIMULATION.finish_inputs = (self, records)
            self.commit = RecordingCommit(self.commit)  # type: ignore[assignment]
            started = time.perf_counter()
            try:
                return super().finish(records)
            finally:
                SIMULATION.finish_seconds = time.perf_counter() - started
        return super().finish(records)


_MEMO: dict[str, tuple[Any, Any, Any]] = {}


def _identity(arguments: Any) -> Any:
    """What makes two calls' inputs the same objects: the identity of each argument or, for a
    list (each rank's own list of the same gathered per-rank payloads), of each element."""
    return tuple(tuple(map(id, a)) if isinstance(a, list) else id(a) for a in arguments)


def _memo(name: str, compute: Callable[[], Any], arguments: Any) -> Any:
    """``compute()``, or its result for the previous call with the very same input objects."""
    found = _MEMO.get(name)
    key = _identity(arguments)
    if found is not None and found[0] == key:
        return found[2]
    result = compute()
    _MEMO[name] = (key, arguments, result)  # the arguments are kept alive, so their ids stay unique
    return result


_EQUAL: dict[str, Any] = {}


def _equal_shared(name: str, value: Any) -> Any:
    """The object kept under ``name`` when it equals ``value``, else ``value`` (kept)."""
    found = _EQUAL.get(name)
    if found is not None and found == value:
        return found
    _EQUAL[name] = value
    return value


def _memoized(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    def call(*arguments: Any, **options: Any) -> Any:
        # Keyword options are plain values (``small=``): they name the memo, the arguments key it.
        return _memo(f"{name}{sorted(options.items())}", lambda: function(*arguments, **options), arguments)

    return call


#: Zeroed block digests by length, shared by every entry of that length (memory at 16,384 ranks).
_ZEROS: dict[int, bytes] = {}


def _fake_write_shards(store: Any, plans: Sequence[Any], *, fast: bool = False, **_: Any) -> list[FileRecord]:
    """What ``write_shards`` records, without writing: the file digest, with ``fast`` (format
    2.1/1.4 writers) the file's fast digest, and per tensor its block digests (16 bytes of fast
    digest per block, 32 more of strong digest for a chunk) in a file with a ``block_size``,
    else a chunk's own digest. Digests are well-formed constants of the real lengths."""
    assert SIMULATION is not None
    for plan in plans:
        record = plan.record
        record.digest = FAKE_DIGEST
        if fast and hasattr(record, "fast_digest"):
            record.fast_digest = FAKE_FAST_DIGEST
        block_size = getattr(record, "block_size", 0)
        for index, source in enumerate(plan.sources):
            if block_size and getattr(source, "wants_blocks", False):
                width = 48 if source.wants_digest else 16
                length = -(-source.nbytes // block_size) * width
                record.tensors[index].blocks = _ZEROS.get(length) or _ZEROS.setdefault(length, bytes(length))
            elif source.wants_digest:
                record.tensors[index].digest = FAKE_DIGEST
        SIMULATION.header_bytes[record.path] = len(plan.header)
    return [plan.record for plan in plans]


#: The functions every rank calls on the same gathered input, computed once (module globals of
#: the module that calls them: ``saving.job``, or ``saving`` in older revisions).
_SHARED = ("assign_writers", "precision_of", "_precision", "check_sharded_agreement")


@contextlib.contextmanager
def _simulated_saving(baton: Baton) -> Iterator[None]:
    """The shared computations of ``_SHARED`` memoized while the ranks save (and, in older
    revisions without ``run_job``, ``saving``'s job, coordinator and writer swapped)."""
    assert SIMULATION is not None
    simulation = SIMULATION
    module = getattr(saving, "job", saving)
    replaced: dict[str, Any] = {}
    if not _SIMULATION_API:
        replaced.update(
            SaveJob=SimulatedSaveJob,
            Coordinator=lambda *_, **__: simulation.local.coordinator,
            write_shards=_fake_write_shards,
        )
    for name in _SHARED:
        if hasattr(module, name):
            replaced[name] = _memoized(name, getattr(module, name))
    original = {name: getattr(module, name) for name in replaced}
    for name, value in replaced.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in original.items():
            setattr(module, name, value)
        _MEMO.clear()


def _save_on_rank(state: Any, name: str, settings: Any, coordinator: Any) -> None:
    """One simulated rank's save: the real ``saving.run_job`` of a :class:`SimulatedSaveJob`."""
    if _SIMULATION_API:
        location = locate(name, settings.storage, settings.storage_options)
        saving.run_job(SimulatedSaveJob(state, location, settings, coordinator))
    else:
        saving.run_save(state, name, settings)


class _Regions:
    """Stands in for ``into`` on load: each sharded key's (offset, shape, global shape) on this
    rank, and every key it holds (an expert-parallel rank holds only its own experts)."""

    def __init__(self, regions: dict[str, tuple[list[int], list[int], list[int]]], held: set[str]) -> None:
        self.regions = regions
        self.held = held


def _held_keys_of_regions(into: _Regions, manifest: Manifest) -> set[str]:
    """``loading.held_keys`` for :class:`_Regions`: the keys the loading rank holds."""
    return into.held


def _wanted_regions_from_placements(into: _Regions, manifest: Manifest) -> dict[str, tuple[list[int], list[int]]]:
    """``tensors.regions.wanted_regions``' loop over the manifest, with the DTensor found in
    ``into`` replaced by the region its placements give (``local_region``'s arithmetic)."""
    regions: dict[str, tuple[list[int], list[int]]] = {}
    described: list[Any] = [entry for _, entry in manifest.iter_tensors()]
    if hasattr(manifest, "described"):  # format 2.1: tensor families' instances too
        described += manifest.described()
    else:
        described += getattr(manifest, "sharded", [])  # format 2.0
    for entry in described:
        if entry.global_shape is None or entry.key in regions:
            continue
        target = into.regions.get(entry.key)
        if target is not None and target[2] == entry.global_shape:
            regions[entry.key] = (target[0], target[1])
    return regions


@contextlib.contextmanager
def _plain_regions() -> Iterator[None]:
    original = loading.wanted_regions
    original_held = getattr(loading, "held_keys", None)
    loading.wanted_regions = _wanted_regions_from_placements  # type: ignore[assignment]
    if original_held is not None:
        loading.held_keys = _held_keys_of_regions  # type: ignore[assignment]
    try:
        yield
    finally:
        loading.wanted_regions = original
        if original_held is not None:
            loading.held_keys = original_held


# ---------------------------------------------------------------------------------------------
# Measuring: clocks, memory, pretouch
# ---------------------------------------------------------------------------------------------


class Memory:
    """RSS growth of a phase: the peak (``VmHWM``, reset through ``/proc/self/clear_refs``)
    minus the RSS before it; and the process's peak over the run, pretouching excluded."""

    def __init__(self) -> None:
        self.process_peak_kib = 0

    def note(self) -> None:
        self.process_peak_kib = max(self.process_peak_kib, status_kib("VmHWM"))

    @staticmethod
    def clear() -> None:
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
        except OSError:
            pass

    @contextlib.contextmanager
    def phase(self, out: dict[str, float], key: str) -> Iterator[None]:
        self.note()
        gc.collect()
        self.clear()
        before = status_kib("VmRSS")
        try:
            yield
        finally:
            peak = status_kib("VmHWM")
            self.process_peak_kib = max(self.process_peak_kib, peak)
            out[key] = max(out.get(key, 0.0), (peak - before) / 1024)

    def peak_mib(self) -> float:
        self.note()
        return self.process_peak_kib / 1024


MEMORY = Memory()


def pretouch(nbytes: int) -> None:
    """Touch and free ``nbytes``: memory this VM handed back to its host is slow on first touch
    (/work/shared/BENCHMARKING.md). The touched memory is left out of the peak RSS."""
    if nbytes <= 0:
        return
    MEMORY.note()
    touch_memory(nbytes)
    MEMORY.clear()


def timed(samples: list[float], work: Callable[[], Any], touch: int) -> Any:
    pretouch(touch)
    started = time.perf_counter()
    result = work()
    samples.append(time.perf_counter() - started)
    return result


# ---------------------------------------------------------------------------------------------
# The format interface, and the format this shardkeep writes
# ---------------------------------------------------------------------------------------------


@dataclass
class SaveRound:
    """What the ranks of one save left: the coordinator's inputs, traffic and per-rank CPU."""

    world: int
    coordinator_input: Any
    traffic: dict[str, Any]
    header_bytes: dict[str, int]  # data file path -> safetensors header bytes (8 + length)
    rank_seconds: float  # the most any rank spent on its own work, the coordinator's finish left out
    first_finish_seconds: float
    location: Any = None  # where the save's files (format 2.0: its rank indexes) were written


class _PackedIndexes(ForwardingStore):
    """A memory store that keeps the rank indexes zlib-compressed (``SHARDKEEP_SCALE_PACK=1``),
    so that the largest worlds fit in memory: the simulated writer records block digests as
    zeros of their real length, which compress to almost nothing. Readers see the bytes as
    written (sizes included); a load plan's time then includes inflating the indexes it reads
    (about 10 ms for the 6-7 MB a 405b-3d rank reads)."""

    def __init__(self) -> None:
        super().__init__(MemoryStore())
        self.sizes: dict[str, int] = {}

    def open_write(self, path: str) -> Any:
        handle = self.inner.open_write(path)
        if "/index/" not in path:
            return handle
        return _PackingWriter(self, path, handle)

    def open_read(self, path: str) -> Any:
        if path not in self.sizes:
            return self.inner.open_read(path)
        handle = self.inner.open_read(path)
        try:
            packed = memoryview(bytearray(handle.size))
            handle.read_into(0, packed)
        finally:
            handle.close()
        return _InflatedReader(zlib.decompress(packed))

    def stat(self, path: str) -> Any:
        found = self.inner.stat(path)
        if found is not None and path in self.sizes:
            return dataclasses.replace(found, size=self.sizes[path])
        return found

    def rename(self, src: str, dst: str) -> None:
        self.inner.rename(src, dst)
        for path in [p for p in self.sizes if p == src or p.startswith(src + "/")]:
            self.sizes[dst + path[len(src) :]] = self.sizes.pop(path)


class _PackingWriter:
    def __init__(self, store: _PackedIndexes, path: str, handle: Any) -> None:
        self.store, self.path, self.handle = store, path, handle
        self.data = bytearray()

    def write(self, data: bytes | memoryview, /) -> None:
        self.data += memoryview(data).cast("B")

    def commit(self) -> None:
        self.handle.write(zlib.compress(self.data, 1))
        self.handle.commit()
        self.store.sizes[self.path] = len(self.data)
        self.data = bytearray()

    def abort(self) -> None:
        self.handle.abort()


class _InflatedReader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.size = len(data)

    def map(self) -> memoryview:
        return memoryview(bytearray(self.data))

    def read_into(self, offset: int, buffer: memoryview, /) -> None:
        view = buffer.cast("B") if buffer.format != "B" else buffer
        view[:] = self.data[offset : offset + len(view)]

    def close(self) -> None:
        self.data = b""


def _simulated_store() -> Any:
    """Where a simulated save writes: a memory store, its rank indexes packed with
    ``SHARDKEEP_SCALE_PACK=1`` (:class:`_PackedIndexes`)."""
    return _PackedIndexes() if os.environ.get("SHARDKEEP_SCALE_PACK") == "1" else MemoryStore()


class _IndexReads(ForwardingStore):
    """Counts the bytes of the rank indexes a load plan reads."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.index_bytes = 0

    def open_read(self, path: str) -> Any:
        handle = self.inner.open_read(path)
        if "/index/" in path:
            self.index_bytes += handle.size
        return handle


@dataclass
class LoadPlan:
    """What one loading rank reads."""

    files_opened: int
    entries: int
    metadata_bytes: int  # the manifest and the header of every file it opens
    data_bytes: int


class ManifestFormat(Protocol):
    """A manifest format under test, called in this order for one (workload, R) point:
    ``save`` (every rank's side of the save, its collectives recorded), ``build_manifest`` (the
    coordinator: gathered records -> sealed bytes; timed, repeated), ``read`` (a loading rank:
    sealed bytes -> checked manifest; timed), ``plan_load`` (a rank of another world: the files
    and byte ranges it needs; timed)."""

    name: str

    def save(self, workload: Workload) -> SaveRound: ...

    def build_manifest(self, save: SaveRound) -> bytes: ...

    def read(self, sealed: bytes) -> Any: ...

    def plan_load(self, parsed: Any, target: Workload, rank: int, save: SaveRound, sealed_size: int) -> LoadPlan: ...


class CurrentFormat:
    """The manifest as the imported shardkeep writes it (format 2.0 with DTensors on regular
    grids: the root, and one index per rank that the load plan reads as it needs; 1.x: one
    TensorEntry per chunk), built and validated by the coordinator."""

    name = "current"

    def __init__(self) -> None:
        self.location = CheckpointLocation(_simulated_store(), "step_00000001")

    def save(self, workload: Workload) -> SaveRound:
        global SIMULATION
        SIMULATION = simulation = Simulation(workload)
        baton = Baton(workload.world)
        store = _simulated_store()
        settings = saving.SaveSettings(step=1, storage=store)

        def rank(index: int) -> None:
            simulation.local.coordinator = InProcessCoordinator(index, workload.world, baton)
            _save_on_rank(simulation.state, "step_00000001", settings, simulation.local.coordinator)

        # The collector is paused while the ranks run: the simulator's heap holds every rank's
        # objects, so collections would cost R times what they cost a real rank.
        with _simulated_saving(baton), collector_paused():
            baton.run(rank)
        assert simulation.finish_inputs is not None
        traffic = baton.summary()
        compute = baton.compute
        per_rank = [
            sum(seconds[index] for label, seconds in compute.items() if label != "commit the checkpoint")
            for index in range(workload.world)
        ]
        # The coordinator's work before "commit the checkpoint" is its finish.
        if workload.world == 1:
            per_rank[0] -= simulation.finish_seconds
        job = simulation.finish_inputs[0]
        staging = getattr(job.commit, "real", job.commit).staging
        result = SaveRound(
            workload.world,
            simulation.finish_inputs,
            traffic,
            simulation.header_bytes,
            max(per_rank),
            simulation.finish_seconds,
            CheckpointLocation(_IndexReads(store), staging),
        )
        SIMULATION = None
        return result

    def build_manifest(self, save: SaveRound) -> bytes:
        job, records = save.coordinator_input
        job.commit = RecordingCommit(None)
        super(SimulatedSaveJob, job).finish(records)
        assert job.commit.sealed is not None
        return job.commit.sealed  # type: ignore[no-any-return]

    def read(self, sealed: bytes) -> Manifest:
        with collector_paused():  # as api.load reads it
            return parse_manifest(sealed, where="simulated", limits=LIFTED)

    def plan_load(self, parsed: Manifest, target: Workload, rank: int, save: SaveRound, sealed_size: int) -> LoadPlan:
        regions: dict[str, tuple[list[int], list[int], list[int]]] = {}
        held: set[str] = set()
        for index, shape, offset in target.rank_chunks(rank):
            spec = target.tensors[index]
            held.add(spec.key)
            if offset is not None:
                regions[spec.key] = (list(offset), list(shape), list(spec.global_shape))
        # load(into=..., extra="ignore") where shardkeep has it: a rank reads what it holds.
        only_into = {"only_into": True} if "only_into" in inspect.signature(loading.LoadJob).parameters else {}
        location = save.location or self.location
        if isinstance(location.store, _IndexReads):
            location.store.index_bytes = 0
        with _plain_regions():
            job = loading.LoadJob(
                location,
                parsed,
                LoadOptions(),
                into=_Regions(regions, held),
                tiers=None,
                sections=None,
                tier_locations=None,
                storage_options=None,
                lazy=False,
                progress=False,
                limits=LIFTED,
                **only_into,
            )
            job.select()
        opened = entries = metadata = data = 0
        metadata += getattr(location.store, "index_bytes", 0)
        for record, needed in zip(job.manifest.files, job.needed, strict=True):
            if needed == []:
                continue
            header = save.header_bytes[record.path]
            opened += 1
            metadata += header
            if needed is None:  # the whole file is read and digested (check_shard)
                entries += len(record.tensors)
                data += record.size - header
            else:
                entries += len(needed)
                data += sum(record.tensors[index].nbytes for index in needed)
        return LoadPlan(opened, entries, sealed_size + metadata, data)


class FamiliesFormat(CurrentFormat):
    """:class:`CurrentFormat` with sharded saves stamped ``INDEXED_VERSION`` (2.1), root and
    indexes, so that the coordinator describes the sharded tensors as tensor families
    (``saving.manifest_build.families_of``): what a 2.1 writer writes, on a shardkeep whose
    writers still stamp 2.0. Where ``WRITTEN_INDEXED_VERSION`` is already 2.1 it is ``current``."""

    name = "families"

    def __init__(self) -> None:
        super().__init__()
        from shardkeep import indexes
        from shardkeep.manifest import INDEXED_VERSION
        from shardkeep.saving import manifest_build

        if not hasattr(manifest_build, "families_of"):
            raise SystemExit("--format families needs a shardkeep that writes tensor families")
        indexes.WRITTEN_INDEXED_VERSION = manifest_build.WRITTEN_INDEXED_VERSION = INDEXED_VERSION  # type: ignore[attr-defined]


FORMATS: dict[str, Callable[[], ManifestFormat]] = {"current": CurrentFormat, "families": FamiliesFormat}


# ---------------------------------------------------------------------------------------------
# One point, in a child process
# ---------------------------------------------------------------------------------------------


def _touch_bytes(entries: int, override_mib: int | None) -> int:
    if override_mib is not None:
        return override_mib * MiB
    return int(min(2.5 * GiB, max(256 * MiB, entries * 1200)))


def make_workload(name: str, world: int) -> Workload:
    if name.startswith("wide:"):
        return wide(int(name.split(":")[1]))
    return WORKLOADS[name](world)


def _forget_detections() -> None:
    """Clear the coordinator's memo of tensor-family detections (``manifest_build._LastDetection``,
    where the imported shardkeep has it), so that a timed commit detects them from scratch. The
    entry families of the coordinator's own files stay remembered where the coordinator
    detects them in its write step (``detect_entry_families_ahead``), as in a real save."""
    module = getattr(saving, "manifest_build", None)
    names = ["_TENSOR_DETECTION"]
    if not hasattr(module, "detect_entry_families_ahead"):
        names.append("_ENTRY_DETECTION")
    for name in names:
        memo = getattr(module, name, None)
        if memo is not None:
            memo._results.clear()


def run_point(workload_name: str, world: int, reps: int, format_name: str, touch_mib: int | None) -> dict[str, Any]:
    """Every measurement of one (workload, R) point."""
    started = time.perf_counter()
    workload = make_workload(workload_name, world)
    fmt = FORMATS[format_name]()
    memory = MEMORY
    out: dict[str, Any] = {
        "workload": workload.name,
        "world": workload.world,
        "format": fmt.name,
        "reps": reps,
        "shardkeep": SOURCE,
    }
    touch = _touch_bytes(workload.held_upper_bound(), touch_mib)
    rss: dict[str, float] = {}
    with memory.phase(rss, "save_mib"):
        save = fmt.save(workload)
    out["build_s"] = time.perf_counter() - started
    gc.collect()
    coord_s: list[float] = []
    sealed = b""
    for _ in range(reps):
        pretouch(touch)
        _forget_detections()  # each repetition a first save of its tree (see coord_warm_s)
        with memory.phase(rss, "coord_mib"):
            t0 = time.perf_counter()
            sealed = fmt.build_manifest(save)
            coord_s.append(time.perf_counter() - t0)
    # The same tree saved again (a training run's later saves): the families detected once.
    t0 = time.perf_counter()
    fmt.build_manifest(save)
    out["coord_warm_s"] = time.perf_counter() - t0
    job, _ = save.coordinator_input
    root = msgspec.json.decode(sealed)  # what the manifest lists (format 2.0: the root alone)
    out["version"] = root["metadata_version"]
    out["entries"] = sum(len(record.get("tensors", [])) for record in root["files"]) + len(root.get("sharded", []))
    # Format 2.1: every instance of a tensor or entry family counts, as it does for the limits.
    families = [*root.get("families", []), *(f for record in root["files"] for f in record.get("families", []))]
    out["entries"] += sum(math.prod(len(range(*bounds)) for bounds in family["indices"]) for family in families)
    out["families"] = len(families)
    out["files"] = len(root["files"]) + len((root.get("indexes") or {}).get("ranks", []))
    out["manifest_bytes"] = len(sealed)
    out["over_read_limits"] = len(sealed) > ManifestLimits().max_bytes or out["entries"] > ManifestLimits().max_tensors
    out["traffic"] = save.traffic
    out["rank_s"] = save.rank_seconds
    out["coord_s"] = coord_s
    out["coord_in_flow_s"] = save.first_finish_seconds
    del job
    save.coordinator_input = None
    gc.collect()
    read_s: list[float] = []
    parsed = None
    for _ in range(reps):
        parsed = None
        pretouch(touch)
        with memory.phase(rss, "read_mib"):
            t0 = time.perf_counter()
            parsed = fmt.read(sealed)
            read_s.append(time.perf_counter() - t0)
    out["read_s"] = read_s
    out["load"] = {}
    if workload.world > 1:
        for target_world in (workload.world // 2, workload.world * 2):
            target = make_workload(workload_name, target_world)
            ranks = sorted({0, target.world - 1})
            seconds: list[float] = []
            plans: list[LoadPlan] = []
            for _ in range(reps):
                for rank in ranks:
                    pretouch(min(touch, 256 * MiB))
                    t0 = time.perf_counter()
                    plans.append(fmt.plan_load(parsed, target, rank, save, len(sealed)))
                    seconds.append(time.perf_counter() - t0)
            out["load"][str(target.world)] = {
                "ranks": ranks,
                "plan_s": seconds,
                "metadata_bytes": max(p.metadata_bytes for p in plans),
                "files_opened": max(p.files_opened for p in plans),
                "entries": max(p.entries for p in plans),
                "data_bytes": max(p.data_bytes for p in plans),
            }
    out.update(rss)
    out["peak_rss_mib"] = memory.peak_mib()
    out["total_s"] = time.perf_counter() - started
    return out


def run_wide_on_disk(count: int, reps: int, touch_mib: int | None) -> dict[str, Any]:
    """The real ``sk.save``/``read_manifest``/``verify``/``load`` of ``count`` small tensors."""
    workload = wide(count)
    state = {"model": {spec.path[1]: torch.randn(64) for spec in workload.tensors}}
    touch = _touch_bytes(count * 4, touch_mib)
    samples: dict[str, list[float]] = {"save": [], "read_manifest": [], "verify": [], "load": []}
    root = tempfile.mkdtemp(prefix="shardkeep-scale-")
    try:
        for rep in range(reps):
            path = os.path.join(root, f"step_{rep:08d}")
            timed(samples["save"], lambda path=path, rep=rep: sk.save(state, path, step=rep), touch)
            timed(samples["read_manifest"], lambda path=path: sk.read_manifest(path, limits=LIFTED), touch)
            report = timed(samples["verify"], lambda path=path: sk.verify(path, limits=LIFTED), touch)
            if not report.ok:
                raise RuntimeError(f"verify failed: {report.problems[:3]}")
            loaded = timed(samples["load"], lambda path=path: sk.load(path, limits=LIFTED), touch)
            del loaded
            shutil.rmtree(path)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"count": count, "seconds": samples}


# ---------------------------------------------------------------------------------------------
# The parent: points, extrapolation, tables
# ---------------------------------------------------------------------------------------------


class PointFailed(RuntimeError):
    """A point's subprocess failed; the message is the last line of its error output."""


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    command = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    if SOURCE_DIR is not None:
        command += ["--src-dir", SOURCE_DIR]
    finished = subprocess.run(command, capture_output=True, text=True, check=False)
    if finished.returncode != 0:
        lines = [line for line in finished.stderr.splitlines() if line.strip()]
        raise PointFailed(lines[-1] if lines else f"exit {finished.returncode}")
    return json.loads(finished.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _metric(point: dict[str, Any] | None, name: str) -> float:
    """One scalar of a measured point (the median of timed samples)."""
    if point is None:
        return float("nan")
    traffic = point.get("traffic", {})
    loads = point.get("load", {})
    world = point["world"]
    half, double = loads.get(str(world // 2), {}), loads.get(str(world * 2), {})
    values: dict[str, Callable[[], float]] = {
        "entries": lambda: point["entries"],
        "files": lambda: point["files"],
        "manifest": lambda: point["manifest_bytes"],
        "sent": lambda: traffic["msgpack"]["sent_per_rank"],
        "recv": lambda: traffic["msgpack"]["recv_per_rank"],
        "coord_recv": lambda: traffic["msgpack"]["recv_coordinator"],
        "padded": lambda: traffic["recv_per_rank_padded"],
        "coord_padded": lambda: traffic["recv_coordinator_padded"],
        "rank_s": lambda: point["rank_s"],
        "coord_s": lambda: median(point["coord_s"]),
        "coord_mib": lambda: point["coord_mib"],
        "read_s": lambda: median(point["read_s"]),
        "read_mib": lambda: point["read_mib"],
        "half_s": lambda: median(half["plan_s"]),
        "half_meta": lambda: half["metadata_bytes"],
        "half_files": lambda: half["files_opened"],
        "double_s": lambda: median(double["plan_s"]),
        "double_meta": lambda: double["metadata_bytes"],
        "double_files": lambda: double["files_opened"],
    }
    try:
        return float(values[name]())
    except (KeyError, TypeError, statistics.StatisticsError):
        return float("nan")


EXTRAPOLATED_METRICS = [
    "files", "manifest", "sent", "recv", "coord_recv", "padded", "coord_padded", "rank_s", "coord_s", "coord_mib",
    "read_s", "read_mib", "half_s", "half_meta", "half_files", "double_s", "double_meta", "double_files",
]  # fmt: skip


def extrapolate(measured: list[dict[str, Any]], world: int, entries: int) -> dict[str, Any]:
    """A point past the cap: every metric from the last two measured points, m2 * (R/R2)^k
    with k their growth exponent (one measured point: proportional to R)."""
    point: dict[str, Any] = {"world": world, "entries": entries, "extrapolated": True, "values": {}}
    last = measured[-1]
    previous = measured[-2] if len(measured) > 1 else None
    for name in EXTRAPOLATED_METRICS:
        m2 = _metric(last, name)
        k = growth(_metric(previous, name), m2, previous["world"], last["world"]) if previous else 1.0
        point["values"][name] = m2 * (world / last["world"]) ** (1.0 if math.isnan(k) else k)
    return point


def value(point: dict[str, Any], name: str) -> float:
    if point.get("extrapolated"):
        return float(point["entries"]) if name == "entries" else float(point["values"].get(name, float("nan")))
    return _metric(point, name)


def fmt_mib(n: float) -> str:
    return fmt_bytes(n * MiB)


def timing(point: dict[str, Any], name: str, samples: Callable[[dict[str, Any]], list[float]]) -> str:
    """A timed metric: median (min-max) when measured, '~' and the value when extrapolated."""
    if point.get("extrapolated"):
        return "~" + fmt_seconds(point["values"][name])
    try:
        return fmt_range(samples(point), fmt_seconds)
    except KeyError:
        return "-"


def cell(point: dict[str, Any], name: str, render: Callable[[float], str]) -> str:
    text = render(value(point, name))
    return ("~" + text) if point.get("extrapolated") and name != "entries" and text != "-" else text


LEGEND = """\
columns: entries = TensorEntries in the manifest (format 2.0: in the root, plus one per described sharded tensor; exact,
  also where '~'); files = data files listed (format 2.0: in the root, plus one index per rank); manifest = sealed bytes;
  sent/rank = the most any rank sends over the save's collectives; recv/rank and coord recv = what any other rank, and
  the coordinator, receive (both msgpack-encoded, logical); padded = what torch's object collectives move to one rank
  (pickled, every payload padded to the largest, times R); rank CPU = the most any rank spends on its own part of the
  save (the coordinator's finish left out); coordinator = SaveJob.finish (merge, validate, coverage, encode, seal);
  dRSS = RSS growth of that step; read+validate = parse_manifest of the sealed bytes (every loading rank does it);
  plan = LoadJob (format 2.0: the indexes it needs, read and checked) and select on one rank of a world of R/2 or
  2R; meta read = the manifest, the indexes read and the safetensors headers of the files that rank opens. Times: median (min-max) over --reps. '~' = extrapolated with the last growth exponent."""


def report_workload(name: str, points: list[dict[str, Any]], tensors: int, sharded: int) -> str:
    versions = sorted({str(p.get("version", "1.x")) for p in points if "version" in p}) or ["?"]
    out = [f"\n== {name}: {tensors} tensors ({sharded} DTensors); manifest format {', '.join(versions)} =="]
    rows = [
        [
            str(p["world"]),
            cell(p, "entries", fmt_count),
            cell(p, "files", fmt_count),
            cell(p, "manifest", fmt_bytes),
            cell(p, "sent", fmt_bytes),
            cell(p, "recv", fmt_bytes),
            cell(p, "coord_recv", fmt_bytes),
            cell(p, "padded", fmt_bytes),
            cell(p, "coord_padded", fmt_bytes),
            cell(p, "rank_s", fmt_seconds),
            timing(p, "coord_s", lambda q: q["coord_s"]),
            cell(p, "coord_mib", fmt_mib),
        ]
        for p in points
    ]
    headers = ["R", "entries", "files", "manifest", "sent/rank", "recv/rank", "coord recv", "padded/rank"]
    headers += ["coord padded", "rank CPU", "coordinator", "coord dRSS"]
    out += ["save", table(headers, rows)]
    warm = [f"R={p['world']}: {fmt_seconds(p['coord_warm_s'])}" for p in points if "coord_warm_s" in p]
    if warm:
        out.append("coordinator, the same tree saved again (families detected once): " + ", ".join(warm))
    rows = []
    for p in points:
        w = p["world"]
        rows.append(
            [
                str(w),
                timing(p, "read_s", lambda q: q["read_s"]),
                cell(p, "read_mib", fmt_mib),
                timing(p, "half_s", lambda q, w=w: q["load"][str(w // 2)]["plan_s"]),
                cell(p, "half_meta", fmt_bytes),
                cell(p, "half_files", fmt_count),
                timing(p, "double_s", lambda q, w=w: q["load"][str(w * 2)]["plan_s"]),
                cell(p, "double_meta", fmt_bytes),
                cell(p, "double_files", fmt_count),
            ]
        )
    headers = ["R", "read+validate", "read dRSS", "R/2: plan", "meta read", "files", "2R: plan", "meta read", "files"]
    out += [
        "read (every loading rank), and the load plan of one rank of a world of R/2 and of 2R",
        table(headers, rows),
    ]
    growth_names = [
        ("entries", "entries"), ("manifest", "manifest"), ("recv", "recv/rank"), ("coord_recv", "coord recv"),
        ("padded", "padded"), ("rank_s", "rank CPU"), ("coord_s", "coordinator"), ("coord_mib", "coord dRSS"),
        ("read_s", "read"), ("half_meta", "meta R/2"), ("half_s", "plan R/2"),
    ]  # fmt: skip
    rows = []
    for a, b in itertools.pairwise(points):
        mark = "~" if b.get("extrapolated") else ""
        row = [f"{a['world']}->{b['world']}"]
        for metric, _ in growth_names:
            k = growth(value(a, metric), value(b, metric), a["world"], b["world"])
            row.append("-" if math.isnan(k) else f"{mark if metric != 'entries' else ''}{k:.2f}")
        rows.append(row)
    if rows:
        out += ["growth exponent log(m2/m1)/log(R2/R1)", table(["R"] + [label for _, label in growth_names], rows)]
    measured = [p for p in points if not p.get("extrapolated")]
    if measured:
        steps = measured[-1]["traffic"]["steps"]
        rows = [
            [
                s["label"],
                s["kind"],
                fmt_bytes(s["msgpack_max"]),
                fmt_bytes(s["msgpack_total"]),
                fmt_bytes(s["pickled_max"]),
                fmt_seconds(s.get("unpickle_s", float("nan"))),
            ]
            for s in steps
        ]
        out.append(f"collective steps of the save at R={measured[-1]['world']}")
        out.append(
            table(
                ["step", "primitive", "largest payload", "all payloads", "largest pickled", "unpickle/receiver"], rows
            )
        )
    return "\n".join(out)


def report_wide(point: dict[str, Any], disk: dict[str, Any] | None) -> str:
    count = point["entries"]
    out = [f"\n== wide: {count} whole tensors of 64 x fp32 on one rank; manifest format 1.3 =="]
    out.append(
        f"simulated: {count} entries, {point['files']} file(s), manifest {fmt_bytes(point['manifest_bytes'])}, "
        f"rank CPU {fmt_seconds(point['rank_s'])}, coordinator {fmt_range(point['coord_s'], fmt_seconds)} "
        f"(dRSS {fmt_mib(point['coord_mib'])}), read+validate {fmt_range(point['read_s'], fmt_seconds)} "
        f"(dRSS {fmt_mib(point['read_mib'])})"
    )
    if disk is not None:
        rows = []
        for op, samples in disk["seconds"].items():
            per = [s / disk["count"] * 1e6 for s in samples]
            rows.append([op, fmt_range(samples, fmt_seconds), fmt_range(per, lambda x: f"{x:.1f}")])
        out.append(f"on disk (the real sk.* calls, {disk['count']} tensors, a temporary directory):")
        out.append(table(["operation", "seconds", "us/tensor"], rows))
    return "\n".join(out)


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _source_differences() -> str:
    """How the working tree's src/shardkeep differs from the snapshot measured (no git)."""
    if SOURCE_DIR is None:
        return ""
    measured = os.path.join(SOURCE_DIR, "shardkeep")
    current = os.path.join(REPOSITORY, "src", "shardkeep")
    changed = []
    for directory, _, names in os.walk(current):
        for name in names:
            if not name.endswith(".py"):
                continue
            path = os.path.join(directory, name)
            relative = os.path.relpath(path, current)
            other = os.path.join(measured, relative)
            with open(path, "rb") as handle:
                mine = handle.read()
            theirs = open(other, "rb").read() if os.path.exists(other) else None  # noqa: SIM115
            if mine != theirs:
                changed.append(relative)
    return f" (the working tree differs in {', '.join(sorted(changed))})" if changed else " (= the working tree)"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", default=None, help="comma-separated world sizes (default 8,64,256,1024,4096)")
    parser.add_argument("--workloads", default=None, help=f"comma-separated, from {', '.join([*WORKLOADS, 'wide'])}")
    parser.add_argument(
        "--quick", action="store_true", help="ranks 8,64,256, wide 100k, 1 rep, cap 1M entries (a few minutes)"
    )
    parser.add_argument("--full", action="store_true", help="also wide 1M on disk (minutes)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per timed step (default 3; --quick 1)")
    parser.add_argument(
        "--max-entries", type=int, default=None, help="extrapolate points with more entries (default 3M; --quick 1M)"
    )
    parser.add_argument(
        "--pretouch-mib", type=int, default=None, help="memory touched before each timed step (default: by size)"
    )
    parser.add_argument("--format", default="current", choices=sorted(FORMATS))
    parser.add_argument("--src", default="head", help="which shardkeep: head (default), worktree, or a git revision")
    parser.add_argument("--json", default=None, help="write every figure to this file")
    parser.add_argument(
        "--real",
        default=None,
        help="comma-separated N: save and load on N real gloo processes and compare the collectives with the "
        "simulator's (bench/scale_real.py; default workloads tiny-dense,tiny-tp-fsdp,tiny-moe-stacked)",
    )
    parser.add_argument("--real-timeout", type=float, default=1200.0, help="seconds a --real point may take")
    parser.add_argument(
        "--reshard",
        default=None,
        help="comma-separated R:R2: bytes each rank of R2 reads of a save by R, block reads against whole chunks "
        "(bench/scale_reshard.py; default workloads dense-70b,moe)",
    )
    parser.add_argument(
        "--block-kib",
        type=float,
        default=None,
        help="with --reshard: every saving rank's block size in KiB, as WriteOptions(block_size=...) sets it "
        "(default: each rank's own, layout.chunk_block_size)",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--src-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child is not None:
        logging.getLogger("shardkeep").setLevel(logging.ERROR)  # over_read_limits is recorded instead
        spec = json.loads(args.child)
        if spec["kind"] == "disk":
            result = run_wide_on_disk(spec["count"], spec["reps"], spec["touch_mib"])
        else:
            result = run_point(spec["workload"], spec["world"], spec["reps"], spec["format"], spec["touch_mib"])
        print(json.dumps(result))
        return
    if args.reshard is not None:
        import scale_reshard  # bench/ is the script's directory

        sys.exit(scale_reshard.run(args, sys.modules[__name__]))
    if args.real is not None:
        import scale_real  # bench/ is the script's directory

        sys.exit(scale_real.run(args, sys.modules[__name__]))
    run_parent(args, parser)


def run_parent(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    ranks = (
        [int(r) for r in args.ranks.split(",")] if args.ranks else list(QUICK_RANKS if args.quick else DEFAULT_RANKS)
    )
    names = args.workloads.split(",") if args.workloads else [*DEFAULT_WORKLOADS, "wide"]
    reps = args.reps or (1 if args.quick else 3)
    if args.max_entries is None:
        args.max_entries = 1_000_000 if args.quick else 3_000_000
    wide_counts = [100_000] + ([1_000_000] if args.full and not args.quick else [])
    print(f"bench/scale.py  {time.strftime('%Y-%m-%d %H:%M:%S %Z')}  torch {torch.__version__}  format {args.format}")
    print(f"shardkeep: {SOURCE}{_source_differences()}")
    print(f"ranks {ranks}  reps {reps}  max entries {args.max_entries:,}  load average at start: {load_average()}")
    print(LEGEND)
    results: dict[str, Any] = {"shardkeep": SOURCE, "ranks": ranks, "reps": reps, "max_entries": args.max_entries}
    results["workloads"] = {}
    for name in names:
        if name == "wide":
            continue
        if name not in WORKLOADS:
            parser.error(f"unknown workload {name!r}")
        points: list[dict[str, Any]] = []
        for world in ranks:
            workload = WORKLOADS[name](world)
            entries = workload.entry_count() if workload.held_upper_bound() > args.max_entries else None
            if entries is not None and entries > args.max_entries:
                measured = [p for p in points if not p.get("extrapolated")]
                if not measured:
                    print(
                        f"  {name} R={world}: {entries:,} entries, over the cap with nothing measured to extrapolate from"
                    )
                    continue
                points.append(extrapolate(measured, workload.world, entries))
                print(f"  {name} R={workload.world}: {entries:,} entries, over the cap: extrapolated", flush=True)
                continue
            started = time.perf_counter()
            spec = {"kind": "point", "workload": name, "world": world, "reps": reps, "format": args.format}
            try:
                point = _child({**spec, "touch_mib": args.pretouch_mib})
            except PointFailed as exc:
                print(f"  {name} R={world}: FAILED: {exc}", flush=True)
                results.setdefault("failures", []).append({"workload": name, "world": world, "error": str(exc)})
                continue
            points.append(point)
            print(
                f"  {name} R={point['world']}: {point['entries']:,} entries, {time.perf_counter() - started:.0f} s",
                flush=True,
            )
        template = WORKLOADS[name](8)
        sharded = sum(1 for spec in template.tensors if spec.placements is not None)
        results["workloads"][name] = points
        if points:
            print(report_workload(name, points, len(template.tensors), sharded), flush=True)
    if "wide" in names:
        results["wide"] = []
        for count in wide_counts:
            spec = {"kind": "point", "workload": f"wide:{count}", "world": 1, "reps": reps, "format": args.format}
            point = _child({**spec, "touch_mib": args.pretouch_mib})
            disk = _child({"kind": "disk", "count": count, "reps": reps, "touch_mib": args.pretouch_mib})
            results["wide"].append({"simulated": point, "disk": disk})
            print(report_wide(point, disk), flush=True)
    print(f"\nload average at end: {load_average()}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
