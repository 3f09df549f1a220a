"""DCP's side of bench/scale.py: the size of ``torch.distributed.checkpoint``'s ``.metadata`` file and
the time DCP's planners spend on it, for the dense-70B layout of bench/scale.py on R simulated
ranks, in one process, without a process group and without writing tensor data.

The layout is bench/scale.py's ``dense_70b`` (imported, so the two benches cannot drift): Llama-70B
(80 layers + embeddings, 723 parameters) with AdamW state (``step`` a plain 0-d tensor,
``exp_avg`` and ``exp_avg_sq`` placed like the parameter), every parameter FSDP2 ``Shard(0)`` over
all R ranks; the state tree is ``{"model": ..., "optim": {"state": {i: ...}, "param_groups":
[...]}}`` with integer optimizer keys, as scale.py uses (``--optim-keys fqn``: parameter names,
as torch's ``get_optimizer_state_dict`` gives them; longer keys, a larger file).

DCP's real code, called unchanged:

* per rank, ``DefaultSavePlanner.set_up_planner`` (``flatten_state_dict``) and
  ``create_local_plan`` (``create_default_local_save_plan`` over the flattened state);
* ``DefaultSavePlanner.create_global_plan`` on the gathered plans (``dedup_save_plans``,
  ``create_default_global_save_plan``, the merged flatten mappings, ``_validate_global_plan``)
  followed by ``FileSystemWriter.prepare_global_plan``: the coordinator's ``global_step``;
* ``FileSystemWriter.finish``: ``storage_data`` from every rank's ``WriteResult``s, then
  ``pickle.dump`` of the ``Metadata`` into ``.metadata`` (``.metadata.tmp``, fsync, rename) in a
  temporary directory: the only file written;
* ``FileSystemReader.read_metadata``: open and unpickle ``.metadata``, what every loading rank does
  in the loader's ``local_step`` (the file is in the page cache);
* ``DefaultLoadPlanner.set_up_planner`` and ``create_local_plan`` (``create_default_local_load_plan``,
  ``_create_read_items``, ``create_read_items_for_chunk_list``) on one rank of a world of R/2,
  against the unpickled metadata.

Constructed, because DCP would need a process group, DTensors or tensor bytes:

* every DTensor leaf is a stand-in (:class:`DTensorStandIn`): a wrapper tensor with the global
  size and dtype and no storage (DTensor is one too) whose ``__create_write_items__`` and
  ``__create_chunk_list__`` hooks, the two that DCP's planners call, compute this rank's chunk
  with torch's DTensor arithmetic (``_compute_local_shape_and_global_offset``, given the mesh
  shape and the rank's coordinate instead of a ``DeviceMesh``) and fill the same fields as
  ``planner_helpers._create_write_items_for_dtensor`` and ``_create_chunk_from_dtensor``;
* the collectives: every rank's local plan is pickled and unpickled (as ``gather_object`` does;
  the sizes are reported), and so are every rank's global plan (``scatter_object_list``) and write
  results (``gather_object``), so that the coordinator holds per-rank copies, as in a real run;
* ``write_data``: the ``WriteResult``s are built, not written: one ``__<rank>_0.distcp`` file per
  rank (``single_file_per_rank``, one thread), items in the order ``_write_files_from_queue``
  writes them, each length the ``torch.save`` size (the default ``SerializationFormat``): the
  chunk's bytes plus the ``torch.save`` overhead of a one-element tensor of that dtype and rank
  (the real overhead differs by the zip alignment padding, a few bytes); BYTE_IO lengths are
  exact (``torch.save`` of the value).

The end of a real save also broadcasts the same ``Metadata`` object to every rank
(``_DistWrapper.all_reduce``), about as many bytes again; not timed here.

Timed (median with min-max over ``--reps``, each in a fresh subprocess per R, with about 2.5 GiB
touched and freed before each timed step, garbage collector running): global plan, finish,
read_metadata and the R/2 load plan; the local save plan once per rank (median and max over
ranks). Sizes: ``.metadata`` bytes and the pickled plans the coordinator gathers.

    .venv/bin/python bench/dcp_metadata.py                 # R = 8, 64, 256, 1024 (about 35 minutes)
    .venv/bin/python bench/dcp_metadata.py --quick         # R = 8, 64, 256 (about 8 minutes)
    .venv/bin/python bench/dcp_metadata.py --ranks 1024 --reps 5 --json dcp.json
    .venv/bin/python bench/dcp_metadata.py --quick --with-shardkeep   # then bench/scale.py, same R
"""

from __future__ import annotations

import argparse
import gc
import io
import itertools
import json
import math
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    FileSystemReader,
    FileSystemWriter,
    _StorageInfo,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from common import fmt_bytes, fmt_range, fmt_seconds, growth, median, status_kib, table, touch_memory

BENCH = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20
QUICK_RANKS = (8, 64, 256)
DEFAULT_RANKS = (8, 64, 256, 1024)
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _scale_module() -> Any:
    """bench/scale.py, for its workload definitions. It picks which shardkeep to import when it
    is imported; in the measuring child ``--child`` is on the command line, which makes it take
    the working tree's (only its workloads are used here)."""
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    import scale

    return scale


# ---------------------------------------------------------------------------------------------
# The state dict as DCP sees it on one rank
# ---------------------------------------------------------------------------------------------


class Position:
    """Which rank the stand-ins currently answer for: its coordinate on each mesh."""

    def __init__(self, workload: Any) -> None:
        self.coordinates_by_mesh = [mesh.coordinates() for mesh in workload.meshes]
        self.coordinate: list[tuple[int, ...] | None] = [None] * len(workload.meshes)

    def become(self, rank: int) -> None:
        self.coordinate = [found.get(rank) for found in self.coordinates_by_mesh]


class DTensorStandIn(torch.Tensor):
    """A DTensor as DCP's planners see it: the global size and dtype (a wrapper tensor with no
    storage) and the hooks ``__create_write_items__`` (save) and ``__create_chunk_list__``
    (load), answering for the rank ``position`` currently names. Any tensor operation raises."""

    mesh_index: int
    mesh_shape: tuple[int, ...]
    dtensor_placements: tuple[Any, ...]
    position: Position

    @staticmethod
    def make(
        global_shape: tuple[int, ...],
        dtype: torch.dtype,
        mesh_index: int,
        mesh_shape: tuple[int, ...],
        placements: tuple[Any, ...],
        position: Position,
    ) -> DTensorStandIn:
        made = torch.Tensor._make_wrapper_subclass(
            DTensorStandIn, global_shape, dtype=dtype, device="cpu", requires_grad=False
        )
        made.mesh_index, made.mesh_shape, made.dtensor_placements = mesh_index, mesh_shape, placements
        made.position = position
        return made  # type: ignore[no-any-return]  # _make_wrapper_subclass is typed as Tensor

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise RuntimeError(f"{func} called on a planning stand-in")

    def _local_shape_and_offset(self) -> tuple[torch.Size, torch.Size]:
        coordinate = self.position.coordinate[self.mesh_index]
        assert coordinate is not None, "this rank is not on the tensor's mesh"
        sizes, offsets = _compute_local_shape_and_global_offset(
            self.shape, self.mesh_shape, list(coordinate), self.dtensor_placements
        )
        return torch.Size(sizes), torch.Size(offsets)

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        """As ``planner_helpers._create_write_items_for_dtensor``."""
        sizes, offsets = self._local_shape_and_offset()
        properties = TensorProperties(  # TensorProperties.create_from_tensor(dtensor.to_local())
            dtype=self.dtype,
            layout=torch.strided,
            requires_grad=False,
            memory_format=torch.contiguous_format,
            pin_memory=False,
        )
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes), properties=properties, size=self.size()
                ),
            )
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        """As ``planner_helpers._create_chunk_from_dtensor``."""
        sizes, offsets = self._local_shape_and_offset()
        return [ChunkStorageMetadata(offsets=offsets, sizes=sizes)]


def state_dict(workload: Any, position: Position, optim_keys: str) -> dict[str, Any]:
    """The nested state dict of one rank (whichever ``position`` names): stand-ins for DTensors,
    a real 0-d tensor for every ``step``, the real ``param_groups`` values."""
    param_names = [spec.path[1] for spec in workload.tensors if spec.path[0] == "model"]

    def renamed(part: Any) -> Any:
        return param_names[part] if optim_keys == "fqn" and isinstance(part, int) else part

    step = torch.zeros((), dtype=torch.float32)
    root: dict[str, Any] = {}
    for spec in workload.tensors:
        path = [renamed(part) for part in spec.path] if spec.path[0] == "optim" else list(spec.path)
        node = root
        for part in path[:-1]:
            node = node.setdefault(part, {})
        if spec.placements is None:
            node[path[-1]] = step
        else:
            mesh = workload.meshes[spec.mesh]
            node[path[-1]] = DTensorStandIn.make(
                spec.global_shape, DTYPES[spec.dtype], spec.mesh, mesh.shape, spec.placements, position
            )
    for top, value in workload.extra_state.items():
        value = json.loads(json.dumps(value))  # a copy; tuples become lists as in a real state dict
        if optim_keys == "fqn":
            for group in value.get("param_groups", []):
                group["params"] = [param_names[i] for i in group["params"]]
        root.setdefault(top, {}).update(value)
    return root


# ---------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------


def timed(samples: list[float], touch: int, work: Callable[..., Any], *args: Any) -> Any:
    gc.collect()
    touch_memory(touch)
    started = time.perf_counter()
    result = work(*args)
    samples.append(time.perf_counter() - started)
    return result


def _torch_save_length(value: Any) -> int:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return len(buffer.getvalue())


def global_step(gathered: list[SavePlan], writer: FileSystemWriter) -> tuple[list[SavePlan], Metadata]:
    """The coordinator's ``global_step`` of ``_save_state_dict``."""
    plans, metadata = DefaultSavePlanner().create_global_plan(gathered)
    return writer.prepare_global_plan(plans), metadata


def read_metadata(directory: str) -> Metadata:
    """What every loading rank does first in ``_load_state_dict``'s ``local_step``."""
    return FileSystemReader(directory).read_metadata()


def load_plan(state: dict[str, Any], metadata: Metadata) -> int:
    """One loading rank's local plan (``_load_state_dict``'s ``local_step``); its read items."""
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state, metadata, is_coordinator=False)
    return len(planner.create_local_plan().items)


def run_point(world: int, reps: int, touch: int, optim_keys: str, directory: str) -> dict[str, Any]:
    scale = _scale_module()
    workload = scale.dense_70b(world)
    position = Position(workload)
    state = state_dict(workload, position, optim_keys)
    flat, _ = flatten_state_dict(state)
    out: dict[str, Any] = {"world": world, "reps": reps, "optim_keys": optim_keys}

    # Every rank's local plan, then what gather_object does to it (pickle, unpickle).
    gc.disable()
    local_s: list[float] = []
    plan_bytes: list[int] = []
    gathered: list[SavePlan] = []
    for rank in range(world):
        position.become(rank)
        started = time.perf_counter()
        planner = DefaultSavePlanner()
        planner.set_up_planner(state, storage_meta=None, is_coordinator=rank == 0)
        plan = planner.create_local_plan()
        local_s.append(time.perf_counter() - started)
        payload = pickle.dumps(plan)
        plan_bytes.append(len(payload))
        gathered.append(pickle.loads(payload))
    del planner, plan, payload
    gc.enable()
    out["local_plan_s"] = local_s
    out["plan_bytes"] = plan_bytes
    out["write_items"] = sum(len(p.items) for p in gathered)

    # The coordinator's global_step.
    writer = FileSystemWriter(directory)
    global_s: list[float] = []
    for _ in range(reps):
        global_plan = metadata = None
        global_plan, metadata = timed(global_s, touch, global_step, gathered, writer)
    assert global_plan is not None and metadata is not None
    out["global_plan_s"] = global_s
    del gathered

    # scatter_object_list, write_data (the results, not the bytes), gather_object.
    gc.disable()
    lengths: dict[Any, int] = {}
    scattered_bytes: list[int] = []
    results: list[list[WriteResult]] = []
    for plan in global_plan:
        payload = pickle.dumps(plan)
        scattered_bytes.append(len(payload))
        plan = pickle.loads(payload)
        storage_key = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        items = [i for i in plan.items if i.type == WriteItemType.BYTE_IO]
        items += [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
        offset, written = 0, []
        for item in items:
            if item.type == WriteItemType.BYTE_IO:
                length = _torch_save_length(flat[item.index.fqn])
            else:
                chunk = item.tensor_data.chunk
                dtype = item.tensor_data.properties.dtype
                key = (dtype, len(chunk.sizes))
                if key not in lengths:
                    lengths[key] = _torch_save_length(torch.zeros([1] * len(chunk.sizes), dtype=dtype))
                    lengths[key] -= torch.zeros((), dtype=dtype).element_size()
                length = lengths[key] + math.prod(chunk.sizes) * torch.zeros((), dtype=dtype).element_size()
            written.append(
                WriteResult(
                    index=item.index, size_in_bytes=length, storage_data=_StorageInfo(storage_key, offset, length)
                )
            )
            offset += length
        results.append(pickle.loads(pickle.dumps(written)))
    del global_plan, plan, payload, written
    gc.enable()
    out["scattered_bytes"] = scattered_bytes

    finish_s: list[float] = []
    for _ in range(reps):
        timed(finish_s, touch, writer.finish, metadata, results)
    out["finish_s"] = finish_s
    chunks = sum(len(m.chunks) for m in metadata.state_dict_metadata.values() if isinstance(m, TensorStorageMetadata))
    out["tensors"] = len(metadata.state_dict_metadata)
    out["chunks"] = chunks
    out["storage_entries"] = len(metadata.storage_data)
    path = os.path.join(directory, ".metadata")
    out["metadata_bytes"] = os.path.getsize(path)
    del metadata, results, writer, state, flat
    gc.collect()

    # Every loading rank: read_metadata (open + unpickle).
    read_s: list[float] = []
    loaded = None
    for _ in range(reps):
        loaded = None
        loaded = timed(read_s, touch, read_metadata, directory)
    out["read_s"] = read_s

    # One rank of a world of R/2: DefaultLoadPlanner's local plan against that metadata.
    load_world = max(1, world // 2)
    target = scale.dense_70b(load_world)
    target_position = Position(target)
    target_position.become(load_world // 2)
    target_state = state_dict(target, target_position, optim_keys)
    plan_s: list[float] = []
    read_items = 0
    for _ in range(reps):
        read_items = timed(plan_s, touch, load_plan, target_state, loaded)
    out["load_world"] = load_world
    out["load_rank"] = load_world // 2
    out["load_plan_s"] = plan_s
    out["read_items"] = read_items
    out["peak_rss_mib"] = status_kib("VmHWM") / 1024
    return out


# ---------------------------------------------------------------------------------------------
# The parent: one subprocess per R, tables
# ---------------------------------------------------------------------------------------------


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    command = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    finished = subprocess.run(command, capture_output=True, text=True, check=False)
    if finished.returncode != 0:
        raise SystemExit(f"R={spec['world']}: the measuring process failed:\n{finished.stderr}")
    return json.loads(finished.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


LEGEND = """\
columns: chunks = ChunkStorageMetadata entries in .metadata (= storage_data entries for tensors); .metadata = the
  pickled Metadata (FileSystemWriter.finish); gathered = the pickled local plans the coordinator receives
  (gather_object), all ranks together; local plan = DefaultSavePlanner set_up_planner + create_local_plan on one
  rank, median (max) over ranks, once; global plan = create_global_plan + prepare_global_plan (the coordinator's
  global_step); finish = FileSystemWriter.finish (storage_data, pickle.dump, fsync, rename); read_metadata = open +
  unpickle .metadata (every loading rank, page cache warm); load plan =
  DefaultLoadPlanner set_up_planner + create_local_plan on one rank of a world of R/2 (read items = its ReadItems).
  Times: median (min-max) over --reps."""

GROWTH = [
    ("chunks", lambda p: p["chunks"]),
    (".metadata", lambda p: p["metadata_bytes"]),
    ("gathered", lambda p: sum(p["plan_bytes"])),
    ("global plan", lambda p: median(p["global_plan_s"])),
    ("finish", lambda p: median(p["finish_s"])),
    ("read_metadata", lambda p: median(p["read_s"])),
    ("load plan R/2", lambda p: median(p["load_plan_s"])),
]


def report(points: list[dict[str, Any]]) -> str:
    rows = [
        [
            str(p["world"]),
            f"{p['tensors']:,}",
            f"{p['chunks']:,}",
            fmt_bytes(p["metadata_bytes"]),
            f"{p['metadata_bytes'] / p['chunks']:.0f} B",
            fmt_bytes(sum(p["plan_bytes"])),
            f"{fmt_seconds(median(p['local_plan_s']))} ({fmt_seconds(max(p['local_plan_s']))})",
            fmt_range(p["global_plan_s"]),
            fmt_range(p["finish_s"]),
            fmt_range(p["read_s"]),
            fmt_range(p["load_plan_s"]),
            f"{p['read_items']:,}",
        ]
        for p in points
    ]
    headers = ["R", "keys", "chunks", ".metadata", "per chunk", "gathered", "local plan", "global plan", "finish"]
    headers += ["read_metadata", "load plan R/2", "read items"]
    out = [table(headers, rows)]
    rows = []
    for a, b in itertools.pairwise(points):
        row = [f"{a['world']}->{b['world']}"]
        for _, metric in GROWTH:
            k = growth(metric(a), metric(b), a["world"], b["world"])
            row.append("-" if math.isnan(k) else f"{k:.2f}")
        rows.append(row)
    if rows:
        out += ["growth exponent log(m2/m1)/log(R2/R1)", table(["R"] + [name for name, _ in GROWTH], rows)]
    return "\n".join(out)


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", default=None, help="comma-separated world sizes (default 8,64,256,1024)")
    parser.add_argument("--quick", action="store_true", help="ranks 8,64,256")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per timed step (default 3)")
    parser.add_argument("--optim-keys", default="index", choices=("index", "fqn"), help="optimizer state keys")
    parser.add_argument("--pretouch-mib", type=int, default=2560, help="memory touched before each timed step")
    parser.add_argument("--dir", default=None, help="where .metadata is written (default: a temporary directory)")
    parser.add_argument("--json", default=None, help="write every figure to this file")
    parser.add_argument(
        "--with-shardkeep", action="store_true", help="then run bench/scale.py on dense-70b at the same ranks"
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child is not None:
        spec = json.loads(args.child)
        result = run_point(spec["world"], spec["reps"], spec["touch_mib"] * MiB, spec["optim_keys"], spec["dir"])
        print(json.dumps(result))
        return

    ranks = (
        [int(r) for r in args.ranks.split(",")] if args.ranks else list(QUICK_RANKS if args.quick else DEFAULT_RANKS)
    )
    print(f"bench/dcp_metadata.py  {time.strftime('%Y-%m-%d %H:%M:%S %Z')}  torch {torch.__version__}")
    print(f"dense-70b (bench/scale.py), optimizer keys {args.optim_keys}; ranks {ranks}  reps {args.reps}")
    print(f"load average at start: {load_average()}")
    print(LEGEND)
    points = []
    for world in ranks:
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="dcp-metadata-", dir=args.dir) as directory:
            spec = {
                "world": world,
                "reps": args.reps,
                "touch_mib": args.pretouch_mib,
                "optim_keys": args.optim_keys,
                "dir": directory,
            }
            point = _child(spec)
        points.append(point)
        print(
            f"  R={world}: {point['chunks']:,} chunks, {fmt_bytes(point['metadata_bytes'])}, peak RSS "
            f"{point['peak_rss_mib']:.0f} MiB, {time.perf_counter() - started:.0f} s",
            flush=True,
        )
        if args.json:  # after every point, so that a long run leaves what it measured
            with open(args.json, "w") as handle:
                json.dump({"torch": torch.__version__, "points": points}, handle, indent=1)
    print(f"\n== DCP (torch {torch.__version__}), dense-70b ==")
    print(report(points))
    print(f"\nload average at end: {load_average()}")
    if args.json:
        print(f"wrote {args.json}")
    if args.with_shardkeep:
        command = [sys.executable, os.path.join(BENCH, "scale.py"), "--workloads", "dense-70b"]
        command += ["--ranks", ",".join(map(str, ranks)), "--reps", str(args.reps)]
        print(f"\n== shardkeep: {' '.join(command[1:])} ==", flush=True)
        subprocess.run(command, check=True)


if __name__ == "__main__":
    main()
