"""``bench/scale.py --real N[,M...]``: the simulator's collectives checked against real ranks.

For each workload of ``--workloads`` (default ``tiny-dense``, ``tiny-tp-fsdp`` and
``tiny-moe-stacked``: the layouts of ``dense-70b``, ``tp-fsdp-70b`` and ``moe-stacked`` at a size
real ranks save in seconds) and each N:

* **real**: N forked processes join a gloo process group on 127.0.0.1
  (``tests/support/distributed_harness.run_ranks``). Each builds the workload's meshes as CPU
  ``DeviceMesh``es and its tensors as ``DTensor.from_local`` of its own chunk (the local shape
  that ``Workload.rank_chunks`` gives, deterministic values), calls the public ``sk.save`` into
  a temporary directory, then ``sk.load`` into a zeroed state of the same layout and checks that
  every local value came back. While they run, ``Coordinator``'s transport primitives
  (``all_gather``, ``gather``, ``broadcast``, ``barrier``, and ``all_reduce_max`` and
  ``finish_through_store``, which the simulator does not model, so that a call to them shows
  up as a difference) are wrapped on the class, in the rank's process: each call records its
  label, primitive, and what this rank sends, measured as :class:`scale.Baton` measures it
  (``pickle.dumps`` of the value, and its ``msgspec.msgpack`` size; a broadcast counts the
  source's value only, a barrier nothing);
* **simulated**: the same :class:`scale.Workload` (the same tree, keys, shapes, meshes and
  placements) saved by ``CurrentFormat().save`` on N simulated ranks, in this process.

Compared per collective step (label and primitive): how often it ran, the largest payload any
rank sent and the sum over ranks (pickled), real against simulated. A count that differs, or a
load that runs a collective (``LoadJob`` runs none: each rank reads the root and the indexes it
needs on its own, so the simulator predicts none), is a failure: the exit status is 1. So is a
load plan that differs: for every rank, the data files its real ``sk.load`` opened and the rank
index bytes it read, against ``CurrentFormat.plan_load`` for that rank of the same world.

Bytes could differ where a payload holds what the simulator makes up: its digests
(``FAKE_DIGEST``, as long as a real blake3 digest) and its checkpoint's place (a name in a
memory store, where the real one is a directory on disk; the payloads carry only relative
names). A ratio more than :data:`BYTES_TOLERANCE` from 1 is marked ``!`` (at 16 and 32 ranks
every step's bytes were identical: docs/performance.md).

    .venv/bin/python bench/scale.py --real 4 --workloads tiny-dense
    .venv/bin/python bench/scale.py --real 16,32 --json real.json
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import pickle
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
import torch

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPOSITORY not in sys.path:
    sys.path.insert(1, REPOSITORY)  # tests.support; after the shardkeep that scale.py chose

from tests.support.distributed_harness import results_or_raise, run_ranks  # noqa: E402

import shardkeep as sk  # noqa: E402  (the one scale.py imported: already in sys.modules)
from common import fmt_bytes, table  # noqa: E402
from shardkeep.distributed.coordinator import Coordinator  # noqa: E402
from shardkeep.storage import ForwardingStore, LocalStore  # noqa: E402

DEFAULT_WORKLOADS = ("tiny-dense", "tiny-tp-fsdp", "tiny-moe-stacked")
#: The Coordinator methods recorded on real ranks: the simulator's four primitives, and the
#: two it does not model (a call to them is a difference in counts).
RECORDED = ("all_gather", "gather", "broadcast", "barrier", "all_reduce_max", "finish_through_store")
#: Bytes that differ by more than this fraction are marked in the table.
BYTES_TOLERANCE = 0.05

#: The scale module (``bench/scale.py`` run as a script), set by :func:`run` before the fork.
HOST: Any = None

Record = tuple[str, str, int, int, int]  # (label, primitive, source rank, pickled bytes, msgpack bytes)


# ---------------------------------------------------------------------------------------------
# On a real rank
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def recording(records: list[Record]) -> Iterator[None]:
    """Every call of a :data:`RECORDED` method of ``Coordinator`` (on a group of more than one
    rank) appended to ``records`` before it runs; the class's methods restored afterwards."""
    encoder = msgspec.msgpack.Encoder()

    def size(value: Any) -> tuple[int, int]:
        try:
            packed = len(encoder.encode(value))
        except (TypeError, msgspec.EncodeError):
            packed = -1
        return len(pickle.dumps(value)), packed

    def wrap(name: str, original: Any) -> Any:
        def call(self: Coordinator, *args: Any, **kwargs: Any) -> Any:
            if self.distributed:
                label = str(kwargs.get("label", name if name != "finish_through_store" else args[0]))
                source = int(kwargs.get("source", 0))
                if name in ("barrier", "finish_through_store") or (name == "broadcast" and self.rank != source):
                    pickled, packed = 0, 0
                else:
                    pickled, packed = size(args[0] if args else kwargs.get("value", kwargs.get("values")))
                records.append((label, name, source, pickled, packed))
            return original(self, *args, **kwargs)

        return call

    originals = {name: getattr(Coordinator, name) for name in RECORDED}
    for name, original in originals.items():
        setattr(Coordinator, name, wrap(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(Coordinator, name, original)


class OpenedFiles(ForwardingStore):
    """A store that notes every file opened for reading, with its size."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.opened: dict[str, int] = {}

    def open_read(self, path: str) -> Any:
        handle = self.inner.open_read(path)
        self.opened[path] = handle.size
        return handle

    def plan(self) -> dict[str, int]:
        """The rank indexes (files, bytes) and the data files this rank opened."""
        indexes = {path: size for path, size in self.opened.items() if "/index/" in path}
        data = [
            path for path in self.opened if path not in indexes and not path.rpartition("/")[2].startswith("manifest")
        ]
        return {"index_files": len(indexes), "index_bytes": sum(indexes.values()), "data_files": len(data)}


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= size
    return tuple(reversed(stride))


def build_state(workload: Any, rank: int, meshes: list[Any], *, filled: bool) -> tuple[dict[str, Any], list[Any]]:
    """This rank's state of ``workload``: plain tensors whole, DTensors from this rank's chunk
    (deterministic values when ``filled``, zeros otherwise); and the local tensors, in order."""
    from torch.distributed.tensor import DTensor

    chunks = {index: shape for index, shape, _ in workload.rank_chunks(rank)}
    state: dict[str, Any] = {}
    local: list[Any] = []
    for index, spec in enumerate(workload.tensors):
        shape = chunks[index]
        values = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) + index
        tensor = values if filled else torch.zeros(shape, dtype=torch.float32)
        local.append(tensor)
        leaf: Any = tensor
        if spec.placements is not None:
            leaf = DTensor.from_local(
                tensor,
                meshes[spec.mesh],
                list(spec.placements),
                run_check=False,
                shape=torch.Size(spec.global_shape),
                stride=_contiguous_stride(spec.global_shape),
            )
        node = state
        for part in spec.path[:-1]:
            node = node.setdefault(part, {})
        node[spec.path[-1]] = leaf
    for top, value in workload.extra_state.items():
        state.setdefault(top, {}).update(pickle.loads(pickle.dumps(value)))
    return state, local


def _on_rank(rank: int, world: int, name: str, directory: str) -> dict[str, Any]:
    """One real rank: save, then load into a zeroed state of the same layout; what it sent."""
    from torch.distributed.device_mesh import DeviceMesh

    logging.getLogger("shardkeep").setLevel(logging.ERROR)
    workload = HOST.WORKLOADS[name](world)
    meshes = [DeviceMesh("cpu", torch.tensor(mesh.ranks).reshape(mesh.shape)) for mesh in workload.meshes]
    state, _ = build_state(workload, rank, meshes, filled=True)
    path = os.path.join(directory, "step_00000001")
    saved: list[Record] = []
    started = time.perf_counter()
    with recording(saved):
        sk.save(state, path, step=1)
    save_s = time.perf_counter() - started
    expected = [leaf.clone() for leaf in build_state(workload, rank, meshes, filled=True)[1]]
    target, local = build_state(workload, rank, meshes, filled=False)
    loaded: list[Record] = []
    store = OpenedFiles(LocalStore(directory))
    started = time.perf_counter()
    with recording(loaded):
        sk.load("step_00000001", into=target, storage=store)
    load_s = time.perf_counter() - started
    wrong = [workload.tensors[i].key for i, (a, b) in enumerate(zip(local, expected, strict=True)) if not a.equal(b)]
    if wrong:
        raise AssertionError(f"rank {rank}: {len(wrong)} tensors did not load back, e.g. {wrong[:3]}")
    return {"save": saved, "load": loaded, "plan": store.plan(), "save_s": save_s, "load_s": load_s}


# ---------------------------------------------------------------------------------------------
# Comparing
# ---------------------------------------------------------------------------------------------


def real_steps(per_rank: list[list[Record]]) -> tuple[list[dict[str, Any]], list[str]]:
    """The collective steps of the real ranks, as ``Baton.summary`` lists them (label, kind,
    pickled max and total, msgpack max and total), and any disagreement between the ranks."""
    problems: list[str] = []
    sequences = [[(label, kind) for label, kind, *_ in records] for records in per_rank]
    for rank, sequence in enumerate(sequences):
        if sequence != sequences[0]:
            problems.append(f"rank {rank} ran {len(sequence)} collectives, rank 0 {len(sequences[0])}, or others")
            break
    steps: list[dict[str, Any]] = []
    for position, (label, kind) in enumerate(sequences[0]):
        mine = [records[position] for records in per_rank if position < len(records)]
        pickled = [record[3] for record in mine]
        packed = [max(0, record[4]) for record in mine]
        steps.append(
            {
                "label": label,
                "kind": kind,
                "pickled_max": max(pickled),
                "pickled_total": sum(pickled),
                "msgpack_max": max(packed),
                "msgpack_total": sum(packed),
            }
        )
    return steps, problems


def by_step(steps: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, int]]:
    """Steps grouped by (label, primitive), in order of first call: count, largest payload of
    any rank, and the sum of every payload (pickled and msgpack)."""
    grouped: dict[tuple[str, str], dict[str, int]] = {}
    for step in steps:
        kind = str(step["kind"]).partition("@")[0]
        entry = grouped.setdefault((step["label"], kind), {"count": 0, "max": 0, "sum": 0, "msgpack": 0})
        entry["count"] += 1
        entry["max"] = max(entry["max"], int(step["pickled_max"]))
        entry["sum"] += int(step["pickled_total"])
        entry["msgpack"] += int(step["msgpack_total"])
    return grouped


def _ratio(real: int, simulated: int) -> float:
    if simulated == 0:
        return 1.0 if real == 0 else math.inf
    return real / simulated


def compare(real: list[dict[str, Any]], simulated: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (label, primitive): counts and bytes, real against simulated; the totals; whether
    the counts (and the order of the steps) agree."""
    ours, theirs = by_step(real), by_step(simulated)
    rows = []
    for key in [*ours, *(k for k in theirs if k not in ours)]:
        a = ours.get(key, {"count": 0, "max": 0, "sum": 0, "msgpack": 0})
        b = theirs.get(key, {"count": 0, "max": 0, "sum": 0, "msgpack": 0})
        rows.append({"label": key[0], "kind": key[1], "real": a, "simulated": b, "ratio": _ratio(a["sum"], b["sum"])})
    order_real = [(s["label"], str(s["kind"]).partition("@")[0]) for s in real]
    order_simulated = [(s["label"], str(s["kind"]).partition("@")[0]) for s in simulated]
    totals = {
        side: {
            "count": sum(r[side]["count"] for r in rows),
            "sum": sum(r[side]["sum"] for r in rows),
            "msgpack": sum(r[side]["msgpack"] for r in rows),
        }
        for side in ("real", "simulated")
    }
    return {
        "steps": rows,
        "totals": totals,
        "ratio": _ratio(totals["real"]["sum"], totals["simulated"]["sum"]),
        "counts_agree": all(r["real"]["count"] == r["simulated"]["count"] for r in rows),
        "order_agrees": order_real == order_simulated,
    }


def simulated_plans(fmt: Any, save: Any, workload: Any) -> list[dict[str, int]]:
    """The simulator's load plan of every rank of the same world: the data files it opens and
    the bytes of the rank indexes it reads (``CurrentFormat.plan_load``)."""
    sealed = fmt.build_manifest(save)
    parsed = fmt.read(sealed)
    plans = []
    for rank in range(workload.world):
        plan = fmt.plan_load(parsed, workload, rank, save, len(sealed))
        plans.append(
            {"index_bytes": int(getattr(save.location.store, "index_bytes", 0)), "data_files": plan.files_opened}
        )
    return plans


def compare_plans(real: list[dict[str, int]], simulated: list[dict[str, int]]) -> dict[str, Any]:
    """Per rank: the data files opened and the index bytes read, real against simulated."""
    differing = [
        rank
        for rank, (a, b) in enumerate(zip(real, simulated, strict=True))
        if (a["data_files"], a["index_bytes"]) != (b["data_files"], b["index_bytes"])
    ]
    summary: dict[str, Any] = {"agree": not differing, "differing_ranks": differing}
    for side, plans in (("real", real), ("simulated", simulated)):
        summary[side] = {
            "data_files_max": max(p["data_files"] for p in plans),
            "data_files_sum": sum(p["data_files"] for p in plans),
            "index_bytes_max": max(p["index_bytes"] for p in plans),
            "index_bytes_sum": sum(p["index_bytes"] for p in plans),
        }
    summary["real"]["index_files_max"] = max(p.get("index_files", 0) for p in real)
    return summary


def run_point(name: str, world: int, timeout: float) -> dict[str, Any]:
    """One workload at ``world`` real ranks, and the simulator's prediction for it."""
    workload = HOST.WORKLOADS[name](world)
    if workload.world != world:
        raise SystemExit(f"{name} cannot be laid out on {world} ranks (it takes {workload.world})")
    if any(len(mesh.ranks) != world for mesh in workload.meshes):
        raise SystemExit(f"{name}: --real builds meshes over all ranks only (a sub-mesh needs more setup)")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="shardkeep-scale-real-") as root:
        outcomes = run_ranks(
            world, _on_rank, name, os.path.join(root, "checkpoints"), outbox=Path(root, "outbox"), timeout=timeout
        )
        results = results_or_raise(outcomes)
    real_s = time.perf_counter() - started
    save_steps, problems = real_steps([result["save"] for result in results])
    load_steps, load_problems = real_steps([result["load"] for result in results])
    started = time.perf_counter()
    fmt = HOST.CurrentFormat()
    simulated = fmt.save(workload)
    simulate_s = time.perf_counter() - started
    comparison = compare(save_steps, simulated.traffic["steps"])
    plans = compare_plans([result["plan"] for result in results], simulated_plans(fmt, simulated, workload))
    return {
        "workload": name,
        "world": world,
        "tensors": len(workload.tensors),
        "save": comparison,
        "load": {"real_collectives": len(load_steps), "predicted": 0, "steps": load_steps, "plans": plans},
        "problems": problems + load_problems,
        "real_save_s": max(result["save_s"] for result in results),
        "real_load_s": max(result["load_s"] for result in results),
        "real_wall_s": real_s,
        "simulate_s": simulate_s,
        "ok": comparison["counts_agree"]
        and comparison["order_agrees"]
        and not load_steps
        and not problems
        and plans["agree"],
    }


def _mark(ratio: float) -> str:
    text = "-" if math.isinf(ratio) else f"{ratio:.3f}"
    return text + (" !" if math.isinf(ratio) or abs(ratio - 1) > BYTES_TOLERANCE else "")


def report(point: dict[str, Any]) -> str:
    save = point["save"]
    out = [
        f"\n== {point['workload']} ({point['tensors']} tensors) on {point['world']} real gloo ranks against the "
        f"simulator: the save's collectives =="
    ]
    rows = []
    for row in save["steps"]:
        a, b = row["real"], row["simulated"]
        count = f"{a['count']} / {b['count']}" + ("" if a["count"] == b["count"] else "  COUNT MISMATCH")
        rows.append(
            [
                row["label"],
                row["kind"],
                count,
                f"{fmt_bytes(a['max'])} / {fmt_bytes(b['max'])}",
                f"{fmt_bytes(a['sum'])} / {fmt_bytes(b['sum'])}",
                _mark(row["ratio"]),
            ]
        )
    a, b = save["totals"]["real"], save["totals"]["simulated"]
    rows.append(
        [
            "total",
            "",
            f"{a['count']} / {b['count']}",
            "",
            f"{fmt_bytes(a['sum'])} / {fmt_bytes(b['sum'])}",
            _mark(save["ratio"]),
        ]
    )
    headers = ["step", "primitive", "count real / sim", "largest payload real / sim", "all ranks real / sim", "ratio"]
    out.append(table(headers, rows))
    load = point["load"]
    out.append(
        f"load (sk.load into the same layout, values checked): {load['real_collectives']} collectives on the real "
        f"ranks, {load['predicted']} predicted (LoadJob runs none)"
    )
    plans = load["plans"]
    a, b = plans["real"], plans["simulated"]
    out.append(
        f"load plan per rank, real / simulated: data files opened max {a['data_files_max']} / {b['data_files_max']}, "
        f"sum {a['data_files_sum']} / {b['data_files_sum']}; rank-index bytes read max {fmt_bytes(a['index_bytes_max'])}"
        f" / {fmt_bytes(b['index_bytes_max'])}, sum {fmt_bytes(a['index_bytes_sum'])} / {fmt_bytes(b['index_bytes_sum'])}"
        + ("" if plans["agree"] else f"  PLAN MISMATCH on ranks {plans['differing_ranks'][:8]}")
    )
    out.append(
        f"real: save {point['real_save_s']:.2f} s, load {point['real_load_s']:.2f} s (slowest rank), "
        f"{point['real_wall_s']:.0f} s with process start; simulated save {point['simulate_s']:.2f} s"
    )
    if not save["order_agrees"]:
        out.append("ORDER MISMATCH: the real ranks ran the collective steps in another order than the simulator")
    out += [f"PROBLEM: {text}" for text in point["problems"]]
    out.append(
        "counts and load plans agree"
        if point["ok"]
        else "DIFFERENT: the simulator does not predict what the real ranks do (counts, order or load plan)"
    )
    return "\n".join(out)


def run(args: argparse.Namespace, host: ModuleType) -> int:
    """``--real``: every workload at every N; the tables; 0 if every count agreed, else 1."""
    global HOST
    HOST = host
    worlds = [int(n) for n in str(args.real).split(",")]
    names = args.workloads.split(",") if args.workloads else list(DEFAULT_WORKLOADS)
    unknown = [name for name in names if name not in host.WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}; choose from {sorted(host.WORKLOADS)}")
    print(f"bench/scale.py --real  {time.strftime('%Y-%m-%d %H:%M:%S %Z')}  torch {torch.__version__}")
    print(f"shardkeep: {host.SOURCE}  ranks {worlds}  workloads {names}  load average {host.load_average()}")
    print("cells: real / simulated; payload bytes pickled as the simulator pickles them (a broadcast: the source's)")
    points = []
    for name in names:
        for world in worlds:
            point = run_point(name, world, timeout=args.real_timeout)
            points.append(point)
            print(report(point), flush=True)
    failed = [f"{p['workload']}@{p['world']}" for p in points if not p["ok"]]
    print(f"\nload average at end: {host.load_average()}")
    print("all counts and load plans agree" if not failed else f"DIFFERENT in {', '.join(failed)}")
    if args.json:
        with open(args.json, "w") as handle:
            import json

            json.dump({"shardkeep": host.SOURCE, "real": points}, handle, indent=1, default=str)
        print(f"wrote {args.json}")
    return 1 if failed else 0
