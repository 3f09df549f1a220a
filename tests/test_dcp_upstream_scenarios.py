"""Scenarios rebuilt from the test suite of ``torch.distributed.checkpoint`` (test_dtensor_checkpoint,
test_file_system_checkpoint, test_state_dict, test_planner, test_format_utils, async and partial
loads), each run both ways: through DCP's own ``FileSystemWriter``/``FileSystemReader`` and
through ``ShardkeepWriter``/``ShardkeepReader``, and the outcomes compared.

An outcome is what the load filled in, or the step that refused. The two ways must load the same
values, or both refuse. The few scenarios where shardkeep differs by design say so in
``expect``: a value DCP can only pickle (``BytesIO``, ``bytes``, a ``set``, an int beyond 64 bits)
is kept as opaque bytes that ``ShardkeepReader`` refuses unless ``trust_pickle=True`` (then the
values match DCP's), and a committed checkpoint is never overwritten. Multi-rank scenarios run on
real gloo process groups of forked processes; every shardkeep checkpoint must also pass
``sk.verify``.
"""

from __future__ import annotations

import dataclasses
import io
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

import shardkeep as sk
from shardkeep import WriteOptions
from shardkeep.dcp import ShardkeepReader, ShardkeepWriter
from tests.support.distributed_harness import results_or_raise, run_ranks

pytestmark = [
    # DCP on one process (no process group) warns on every call; ShardedTensor is deprecated.
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized:UserWarning"),
    pytest.mark.filterwarnings("ignore:Please use DTensor instead:FutureWarning"),
    pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning"),
]

Way = Literal["dcp", "shardkeep"]
WAYS: tuple[Way, Way] = ("dcp", "shardkeep")
Expect = Literal["same", "both refuse", "shardkeep refuses opaque bytes", "shardkeep refuses plan caching"]


def _writer(way: Way, path: Path | str, **options: Any) -> Any:
    return (
        FileSystemWriter(path, **options.get("dcp", {}))
        if way == "dcp"
        else ShardkeepWriter(path, **options.get("shardkeep", {}))
    )


def _reader(way: Way, path: Path | str, **options: Any) -> Any:
    return FileSystemReader(path) if way == "dcp" else ShardkeepReader(path, **options)


# -- comparing outcomes ---------------------------------------------------------------------------


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


def assert_same_values(found: Any, expected: Any, where: str = "") -> None:
    """Equal trees: tensors bit for bit (dtype and shape too; a DTensor or ShardedTensor by its
    full value), BytesIO by content, floats NaN-safe, everything else by ``==``."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(found, torch.Tensor), (where, type(found))
        assert _same_tensor(_full(found), _full(expected)), where
    elif isinstance(expected, io.BytesIO):
        assert isinstance(found, io.BytesIO) and found.getvalue() == expected.getvalue(), where
    elif isinstance(expected, dict):
        assert isinstance(found, dict) and set(found) == set(expected), (where, sorted(map(str, found)))
        for key in expected:
            assert_same_values(found[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert type(found) is type(expected) and len(found) == len(expected), (where, found)
        for index, (a, b) in enumerate(zip(found, expected, strict=True)):
            assert_same_values(a, b, f"{where}[{index}]")
    elif isinstance(expected, float) and math.isnan(expected):
        assert isinstance(found, float) and math.isnan(found), where
    else:
        assert type(found) is type(expected) and found == expected, (where, found, expected)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    if hasattr(tensor, "full_tensor"):
        return tensor.full_tensor()
    return tensor.detach()


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one way did: ``"ok"`` with the loaded target, or the step that refused and why."""

    step: Literal["ok", "save", "reader", "load"]
    value: Any

    def __repr__(self) -> str:
        return f"{self.step}: {self.value!r}"[:400]


def _refused(exc: BaseException) -> str:
    if isinstance(exc, CheckpointException):
        return "; ".join(f"{type(error).__name__}: {error}" for error, _ in exc.failures.values())
    return f"{type(exc).__name__}: {exc}"


# -- one-process scenarios -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Scenario:
    """``state()`` is saved, ``target()`` loaded into; planners and options as the upstream test
    sets them. ``reader_options`` go to ``ShardkeepReader`` only."""

    state: Callable[[], dict[str, Any]]
    target: Callable[[], dict[str, Any]]
    expect: Expect = "same"
    save_planner: Callable[[], Any] | None = None
    load_planner: Callable[[], Any] | None = None
    writer_options: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    reader_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    async_save: bool = False
    #: Further keyword arguments of dcp.save (no_dist, use_collectives).
    save_options: dict[str, Any] = dataclasses.field(default_factory=dict)


def _numbered(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape).to(dtype)


def _zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    """A load target of ``state``'s structure: every tensor zeroed, every other value kept (DCP
    replaces non-tensor values)."""

    def blank(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            raw = torch.zeros(value.numel() * value.element_size(), dtype=torch.uint8)
            return raw.view(value.dtype).reshape(value.shape) if value.numel() else torch.empty_like(value)
        if isinstance(value, dict):
            return {key: blank(item) for key, item in value.items()}
        if isinstance(value, list):
            return [blank(item) for item in value]
        return value

    return {key: blank(value) for key, value in state.items()}


def _scenario(state: Callable[[], dict[str, Any]], **options: Any) -> Scenario:
    """A scenario whose target is ``state``'s structure, zeroed (the usual upstream pattern)."""
    return Scenario(state=state, target=options.pop("target", lambda: _zeros_like(state())), **options)


@dataclasses.dataclass
class _Point:
    x: int
    y: int


class _Counter:
    """A DCP ``Stateful``: DCP saves its ``state_dict()`` and calls ``load_state_dict`` on load."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.weights = torch.full((3,), float(count))

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "weights": self.weights}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = state["count"]
        self.weights.copy_(state["weights"])


def _model_and_optimizer(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def _model_state(seed: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(*_model_and_optimizer(seed))
    return {"model": model_state, "optim": optim_state}


#: Every dtype DCP's FileSystemWriter saves on torch 2.13 (the bits dtypes fail in DCP's planner,
#: quantized tensors lose their quantization: see tests/test_dtypes.py and docs/manifest.md).
DCP_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.uint16,
    torch.int32,
    torch.uint32,
    torch.int64,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex32,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2,
    torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu,
    torch.float4_e2m1fn_x2,
]


def _dtype_state(dtype: torch.dtype) -> dict[str, Any]:
    raw = torch.arange(12 * dtype.itemsize, dtype=torch.uint8) + 1
    if dtype == torch.bool:
        raw = raw % 2
    tensor = raw.view(dtype).reshape(3, 4)
    return {"t": tensor, "scalar": tensor[1, 2].clone(), "empty": tensor[:0], "transposed": tensor.t()}


SCENARIOS: dict[str, Scenario] = {
    # test_file_system_checkpoint / test_dcp basics: flat, nested, lists, odd tensors
    "flat-tensors": _scenario(lambda: {"a": _numbered(4, 3), "b": _numbered(7), "c": _numbered(2, 2, 2)}),
    "nested-dicts": _scenario(
        lambda: {"model": {"layer": {"weight": _numbered(3, 3), "bias": _numbered(3)}}, "ema": {"w": _numbered(2)}}
    ),
    "lists-of-tensors": _scenario(lambda: {"buffers": [_numbered(2), _numbered(3), {"inner": _numbered(1)}]}),
    "zero-dim-tensors": _scenario(
        lambda: {"step": torch.tensor(7), "loss": torch.tensor(0.25), "flag": torch.tensor(True)}
    ),
    "empty-tensors": _scenario(
        lambda: {"none": torch.empty(0), "rows": torch.empty(0, 3), "cols": torch.empty(4, 0, dtype=torch.int64)}
    ),
    "non-contiguous-tensors": _scenario(
        lambda: {
            "t": _numbered(4, 6).t(),
            "strided": _numbered(6, 6)[::2, 1::3],
            "expanded": _numbered(1, 3).expand(4, 3),
        }
    ),
    "parameters-and-requires-grad": _scenario(
        lambda: {"p": nn.Parameter(_numbered(3, 2)), "g": _numbered(2).requires_grad_()}
    ),
    "large-tensor-over-many-files": _scenario(
        lambda: {
            f"w{index}": torch.randn(64, 64, generator=torch.Generator().manual_seed(index)) for index in range(6)
        },
        writer_options={
            "dcp": {"thread_count": 2},
            "shardkeep": {"options": WriteOptions(io_threads=2, file_size_target=20_000)},
        },
    ),
    # non-tensor values: JSON-able ones are the same both ways
    "ints-floats-strings-bools-none": _scenario(
        lambda: {"step": 12, "lr": 3e-4, "name": "run-a", "done": False, "nothing": None, "w": _numbered(2)},
        target=lambda: {"step": 0, "lr": 0.0, "name": "", "done": True, "nothing": 1, "w": torch.zeros(2)},
    ),
    "non-finite-floats": _scenario(
        lambda: {"best": float("-inf"), "worst": float("inf"), "unknown": float("nan")},
        target=lambda: {"best": 0.0, "worst": 0.0, "unknown": 0.0},
    ),
    "lists-tuples-and-dicts-of-values": _scenario(
        lambda: {"betas": (0.9, 0.999), "schedule": [1, 2, 3], "meta": {"tags": ["a", "b"], "sizes": {"x": 1}}},
        target=lambda: {"betas": (0.0, 0.0), "schedule": [0, 0, 0], "meta": {"tags": ["", ""], "sizes": {"x": 0}}},
    ),
    "stateful-object": Scenario(
        state=lambda: {"counter": _Counter(5)},
        target=lambda: {"counter": _Counter(0)},
    ),
    # values DCP can only pickle: opaque bytes, refused by ShardkeepReader by default
    "bytesio-object": _scenario(
        lambda: {"blob": io.BytesIO(b"\x00raw bytes\xff"), "w": _numbered(2)},
        target=lambda: {"blob": io.BytesIO(), "w": torch.zeros(2)},
        expect="shardkeep refuses opaque bytes",
    ),
    "python-bytes": _scenario(
        lambda: {"blob": b"\x01\x02\x03"}, target=lambda: {"blob": b""}, expect="shardkeep refuses opaque bytes"
    ),
    "set-and-dataclass": _scenario(
        lambda: {"seen": {1, 2, 3}, "point": _Point(1, 2)},
        target=lambda: {"seen": set(), "point": None},
        expect="shardkeep refuses opaque bytes",
    ),
    "int-beyond-64-bits": _scenario(
        lambda: {"seed": 2**70 + 1}, target=lambda: {"seed": 0}, expect="shardkeep refuses opaque bytes"
    ),
    # test_state_dict on one process: a model and its optimizer through get/set_state_dict
    "model-and-optimizer-state-dict": Scenario(state=lambda: _model_state(0), target=lambda: _model_state(1)),
    # partial loads, missing keys, strictness (DefaultLoadPlanner)
    "partial-load-of-a-subset": Scenario(
        state=lambda: {"a": _numbered(3), "b": _numbered(4), "step": 3},
        target=lambda: {"a": torch.zeros(3)},
    ),
    "missing-key-is-refused": Scenario(
        state=lambda: {"a": _numbered(3)},
        target=lambda: {"a": torch.zeros(3), "not_saved": torch.zeros(2)},
        expect="both refuse",
    ),
    "missing-key-with-allow-partial-load": Scenario(
        state=lambda: {"a": _numbered(3)},
        target=lambda: {"a": torch.zeros(3), "not_saved": torch.full((2,), 5.0)},
        load_planner=lambda: DefaultLoadPlanner(allow_partial_load=True),
    ),
    "shape-mismatch-is-refused": Scenario(
        state=lambda: {"a": _numbered(3, 4)},
        target=lambda: {"a": torch.zeros(4, 3)},
        expect="both refuse",
    ),
    "tensor-saved-value-expected": Scenario(
        state=lambda: {"a": _numbered(3)},
        target=lambda: {"a": 0},
        expect="both refuse",
    ),
    # planner options (test_planner)
    "save-planner-without-flattening": _scenario(
        lambda: {"a": _numbered(3), "b": _numbered(2, 2)},
        save_planner=lambda: DefaultSavePlanner(flatten_state_dict=False),
    ),
    "save-planner-dedup-to-lowest-rank": _scenario(
        lambda: {"model": {"w": _numbered(3)}}, save_planner=lambda: DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    ),
    "save-planner-with-plan-caching": _scenario(
        lambda: {"model": {"w": _numbered(5)}},
        save_planner=lambda: DefaultSavePlanner(enable_plan_caching=True),
        expect="shardkeep refuses plan caching",
    ),
    "load-planner-without-flattening": _scenario(
        lambda: {"a": _numbered(3), "b": _numbered(4)},
        load_planner=lambda: DefaultLoadPlanner(flatten_state_dict=False),
    ),
    # dcp.save's own options on one process
    "save-with-no-dist": _scenario(lambda: {"w": _numbered(4), "step": 1}, save_options={"no_dist": True}),
    "save-without-collectives": _scenario(
        lambda: {"w": _numbered(4), "step": 1}, save_options={"use_collectives": False}
    ),
    # async_save on one process (thread executor)
    "async-save": _scenario(lambda: {"model": {"w": _numbered(8, 8)}, "step": 4}, async_save=True),
    **{
        f"dtype-{str(dtype).removeprefix('torch.')}": _scenario(lambda dtype=dtype: _dtype_state(dtype))
        for dtype in DCP_DTYPES
    },
}


def _run(way: Way, scenario: Scenario, root: Path, **reader_options: Any) -> Outcome:
    path = root / way
    try:
        writer = _writer(way, path, **scenario.writer_options)
        planner = scenario.save_planner() if scenario.save_planner else None
        if scenario.async_save:
            dcp.async_save(scenario.state(), storage_writer=writer, planner=planner).result()
        else:
            dcp.save(scenario.state(), storage_writer=writer, planner=planner, **scenario.save_options)
    except (Exception, CheckpointException) as exc:
        return Outcome("save", _refused(exc))
    if way == "shardkeep":
        report = sk.verify(path)
        assert report.ok, report.problems
    target = scenario.target()
    try:
        reader = _reader(way, path, **reader_options)
    except Exception as exc:
        return Outcome("reader", _refused(exc))
    try:
        planner = scenario.load_planner() if scenario.load_planner else None
        dcp.load(target, storage_reader=reader, planner=planner)
    except (Exception, CheckpointException) as exc:
        return Outcome("load", _refused(exc))
    return Outcome("ok", target)


def _loaded_values(target: dict[str, Any]) -> dict[str, Any]:
    """The target as comparable values (a Stateful by its state)."""
    return {key: value.state_dict() if isinstance(value, _Counter) else value for key, value in target.items()}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_scenario_gives_the_same_outcome_through_dcp_and_through_shardkeep(tmp_path: Path, name: str) -> None:
    scenario = SCENARIOS[name]
    native, ours = (_run(way, scenario, tmp_path) for way in WAYS)
    if scenario.expect == "both refuse":
        assert native.step != "ok" and ours.step != "ok", (native, ours)
        return
    assert native.step == "ok", native
    expected = _loaded_values(native.value)
    if scenario.expect == "shardkeep refuses opaque bytes":
        # Refused when the reader is built, naming the keys, before anything is loaded.
        assert ours.step == "reader" and "UnsupportedValueError" in ours.value and "trust_pickle" in ours.value, ours
        trusted = _run_load_only("shardkeep", scenario, tmp_path, trust_pickle=True)
        assert trusted.step == "ok", trusted
        assert_same_values(_loaded_values(trusted.value), expected)
        return
    if scenario.expect == "shardkeep refuses plan caching":
        # A cached plan names an earlier save's staging directory: refused, nothing left behind.
        assert ours.step == "save" and "enable_plan_caching" in ours.value, ours
        assert not (tmp_path / "shardkeep").exists() and not list(tmp_path.glob("*.tmp-*"))
        return
    assert ours.step == "ok", ours
    assert_same_values(_loaded_values(ours.value), expected)


def _run_load_only(way: Way, scenario: Scenario, root: Path, **reader_options: Any) -> Outcome:
    target = scenario.target()
    reader = _reader(way, root / way, **reader_options)
    dcp.load(target, storage_reader=reader, planner=scenario.load_planner() if scenario.load_planner else None)
    return Outcome("ok", target)


@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint:UserWarning")  # DCP's, when it overwrites
def test_a_second_save_to_the_same_path_overwrites_with_dcp_and_is_refused_by_shardkeep(tmp_path: Path) -> None:
    """By design: FileSystemWriter(overwrite=True) is DCP's default; a committed shardkeep
    checkpoint is never overwritten, and the first save stays loadable."""
    for way in WAYS:
        dcp.save({"w": _numbered(3)}, storage_writer=_writer(way, tmp_path / way))
    dcp.save({"w": _numbered(3) + 1}, storage_writer=_writer("dcp", tmp_path / "dcp", dcp={"overwrite": True}))
    with pytest.raises(sk.CheckpointExistsError):
        dcp.save({"w": _numbered(3) + 1}, storage_writer=_writer("shardkeep", tmp_path / "shardkeep"))
    loaded = {way: {"w": torch.zeros(3)} for way in WAYS}
    for way in WAYS:
        dcp.load(loaded[way], storage_reader=_reader(way, tmp_path / way))
    assert torch.equal(loaded["dcp"]["w"], _numbered(3) + 1) and torch.equal(loaded["shardkeep"]["w"], _numbered(3))


def test_one_writer_saves_several_checkpoints_through_checkpoint_id(tmp_path: Path) -> None:
    """DCP resets the writer with each ``checkpoint_id`` (a training loop's pattern)."""
    writers = {"dcp": FileSystemWriter(tmp_path / "unused-dcp"), "shardkeep": ShardkeepWriter(tmp_path / "unused-sk")}
    for step in (1, 2):
        for way in WAYS:
            dcp.save({"w": _numbered(3) * step}, checkpoint_id=tmp_path / f"{way}-{step}", storage_writer=writers[way])
    for step in (1, 2):
        for way in WAYS:
            target = {"w": torch.zeros(3)}
            reader = _reader(way, tmp_path / f"{way}-{step}")
            dcp.load(target, checkpoint_id=tmp_path / f"{way}-{step}", storage_reader=reader)
            assert torch.equal(target["w"], _numbered(3) * step), (way, step)


def test_format_utils_dcp_to_torch_save_gives_the_same_file_both_ways(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from shardkeep.dcp import dcp_to_torch_save as shardkeep_to_torch_save

    state = {**_model_state(0), "meta": {"epoch": 2, "betas": (0.9, 0.95)}, "t": _numbered(2, 3).t()}
    for way in WAYS:
        dcp.save(state, storage_writer=_writer(way, tmp_path / way))
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "dcp.pt")
    shardkeep_to_torch_save(tmp_path / "shardkeep", tmp_path / "shardkeep.pt")
    native = torch.load(tmp_path / "dcp.pt", weights_only=True)
    ours = torch.load(tmp_path / "shardkeep.pt", weights_only=True)
    assert_same_values(ours, native)
    # torch_save_to_dcp's counterpart: the torch.save file back into a checkpoint, both ways.
    for way in WAYS:
        dcp.save(
            torch.load(tmp_path / f"{way}.pt", weights_only=True), storage_writer=_writer(way, tmp_path / f"{way}2")
        )
    back = {way: _zeros_like(native) for way in WAYS}
    for way in WAYS:
        dcp.load(back[way], storage_reader=_reader(way, tmp_path / f"{way}2"))
    assert_same_values(back["shardkeep"], back["dcp"])
    assert_same_values(back["dcp"], native)


# -- multi-rank scenarios (real gloo process groups on forked processes) -----------------------


def _dtensor_scenarios(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """test_dtensor_checkpoint: a DTensor saved Shard(0) on a 1-D mesh of every rank, loaded
    into Replicate(), Shard(1) and a plain tensor; and a DTensor saved Replicate()."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = _numbered(6, 4)
    saved = {
        "sharded": distribute_tensor(full, mesh, [Shard(0)]),
        "replicated": distribute_tensor(full * 2, mesh, [Replicate()]),
        "uneven": distribute_tensor(_numbered(5, 3), mesh, [Shard(0)]),
        "step": 9,
    }
    results: dict[str, Any] = {}
    for way in WAYS:
        path = f"{root}/{way}"
        dcp.save(saved, storage_writer=_writer(way, path))
        torch.distributed.barrier()
        target = {
            "sharded": distribute_tensor(torch.zeros(6, 4), mesh, [Replicate()]),
            "replicated": distribute_tensor(torch.zeros(6, 4), mesh, [Shard(1)]),
            "uneven": torch.zeros(5, 3),
            "step": 0,
        }
        dcp.load(target, storage_reader=_reader(way, path))
        results[way] = {
            key: _full(value) if isinstance(value, torch.Tensor) else value for key, value in target.items()
        }
        # async_save on the ranks (a group of its own, as training would use), loaded back.
        group = torch.distributed.new_group(backend="gloo")
        dcp.async_save(saved, storage_writer=_writer(way, f"{path}-async"), process_group=group).result()
        torch.distributed.barrier()
        again = {"sharded": torch.zeros(6, 4), "uneven": distribute_tensor(torch.zeros(5, 3), mesh, [Shard(1)])}
        dcp.load(again, storage_reader=_reader(way, f"{path}-async"))
        results[f"{way}-async"] = {key: _full(value) for key, value in again.items()}
    return results


def _sharded_tensor(world_size: int, plan: str, fill: torch.Tensor) -> Any:
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec, ShardMetadata

    if plan == "enumerable":
        blocks = [([0, 0], 0), ([0, 2], 1), ([4, 0], 1), ([4, 2], 0)]
        spec: Any = EnumerableShardingSpec(
            [
                ShardMetadata(shard_offsets=offsets, shard_sizes=[4, 2], placement=f"rank:{owner % world_size}/cpu")
                for offsets, owner in blocks
            ]
        )
    else:
        count = {"chunks-per-rank": world_size, "more-chunks-than-ranks": 4, "columns": world_size}[plan]
        spec = ChunkShardingSpec(
            dim=1 if plan == "columns" else 0,
            placements=[f"rank:{index % world_size}/cpu" for index in range(count)],
        )
    tensor = sharded_tensor.empty(spec, *fill.shape)
    for shard in tensor.local_shards():
        region = fill
        for dim, (start, size) in enumerate(zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes, strict=True)):
            region = region.narrow(dim, start, size)
        shard.tensor.copy_(region)
    return tensor


def _gathered(tensor: Any) -> torch.Tensor:
    pieces = [(list(s.metadata.shard_offsets), s.tensor.clone()) for s in tensor.local_shards()]
    everyone: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, pieces)
    full = torch.full(tuple(tensor.size()), float("nan"))
    for rank_pieces in everyone:
        for offsets, piece in rank_pieces:
            region = full
            for dim, start in enumerate(offsets):
                region = region.narrow(dim, start, piece.shape[dim])
            region.copy_(piece)
    return full


#: test_file_system_checkpoint: (saved as, loaded into) for a (8, 4) tensor.
SHARD_PLANS = [
    ("more-chunks-than-ranks", "enumerable"),  # test_load_with_different_shard_plan
    ("enumerable", "chunks-per-rank"),
    ("more-chunks-than-ranks", "tensor"),  # test_switch_between_sharded_tensor_to_tensor
    ("tensor", "more-chunks-than-ranks"),
    ("chunks-per-rank", "more-chunks-than-ranks"),
    ("chunks-per-rank", "columns"),  # test_load_rowwise_to_colwise
    ("columns", "enumerable"),
]


def _sharded_tensor_scenarios(rank: int, world_size: int, root: str) -> dict[str, Any]:
    full = _numbered(8, 4)
    results: dict[str, Any] = {way: {} for way in WAYS}
    for index, (save_plan, load_plan) in enumerate(SHARD_PLANS):
        saved = full.clone() if save_plan == "tensor" else _sharded_tensor(world_size, save_plan, full)
        for way in WAYS:
            path = f"{root}/{way}-{index}"
            outcome: Any
            try:
                dcp.save({"st": saved, "plain": _numbered(3)}, storage_writer=_writer(way, path))
                torch.distributed.barrier()
                if way == "shardkeep" and rank == 0:
                    report = sk.verify(path)
                    assert report.ok, report.problems
                target_tensor = (
                    torch.zeros(8, 4)
                    if load_plan == "tensor"
                    else _sharded_tensor(world_size, load_plan, torch.zeros(8, 4))
                )
                target = {"st": target_tensor, "plain": torch.zeros(3)}
                dcp.load(target, storage_reader=_reader(way, path))
                loaded = target["st"] if load_plan == "tensor" else _gathered(target["st"])
                outcome = ("ok", loaded, target["plain"])
            except (Exception, CheckpointException) as exc:
                outcome = ("refused", _refused(exc))
            torch.distributed.barrier()
            results[way][f"{save_plan}->{load_plan}"] = outcome
    return results


def _ddp_state_dict_scenario(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """test_state_dict with DDP: model + optimizer through get_state_dict on every rank, saved,
    loaded into a fresh DDP model and optimizer, set_state_dict; then one more step."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.nn.parallel import DistributedDataParallel

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)

    def train(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        model(torch.ones(2, 4) * (rank + 1)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    model, optimizer = build(0)
    train(model, optimizer)
    model_state, optim_state = get_state_dict(model, optimizer)
    results: dict[str, Any] = {}
    for way in WAYS:
        path = f"{root}/{way}"
        dcp.save({"model": model_state, "optim": optim_state}, storage_writer=_writer(way, path))
        fresh, fresh_optimizer = build(1)
        loaded_model, loaded_optim = get_state_dict(fresh, fresh_optimizer)
        state = {"model": loaded_model, "optim": loaded_optim}
        dcp.load(state, storage_reader=_reader(way, path))
        set_state_dict(fresh, fresh_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        train(fresh, fresh_optimizer)  # the resumed run goes on
        results[way] = {name: value.detach().clone() for name, value in fresh.module.state_dict().items()}
    train(model, optimizer)
    results["uninterrupted"] = {name: value.detach().clone() for name, value in model.module.state_dict().items()}
    return results


def _fsdp2_save(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """FSDP2 (fully_shard on a 1-D mesh) + AdamW, one step, saved both ways; the full state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.ones(4, 8)).square().mean().backward()
    optimizer.step()
    model_state, optim_state = get_state_dict(model, optimizer)
    for way in WAYS:
        dcp.save({"model": model_state, "optim": optim_state}, storage_writer=_writer(way, f"{root}/{way}"))
    full_model, full_optim = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    return {"model": full_model, "optim": full_optim}


def _plain_model_and_optimizer(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _load_resharded_on_one_process(root: Path) -> dict[Way, dict[str, Any]]:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    loaded: dict[Way, dict[str, Any]] = {}
    for way in WAYS:
        model, optimizer = _plain_model_and_optimizer(1)
        model(torch.ones(1, 8)).sum().backward()
        optimizer.step()  # the optimizer has state to load into
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, storage_reader=_reader(way, root / way))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        loaded[way] = dict(zip(("model", "optim"), get_state_dict(model, optimizer), strict=True))
    return loaded


def _fsdp2_load(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Load both checkpoints into FSDP2 on ``world_size`` ranks; the full state of each."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    loaded: dict[str, Any] = {}
    for way in WAYS:
        model, optimizer = _plain_model_and_optimizer(1)
        mesh = init_device_mesh("cpu", (world_size,))
        for layer in (model[0], model[2], model):
            fully_shard(layer, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        model(torch.ones(1, 8)).sum().backward()
        optimizer.step()
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, storage_reader=_reader(way, f"{root}/{way}"))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        full_model, full_optim = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
        loaded[way] = {"model": full_model, "optim": full_optim}
    return loaded


def test_dtensors_saved_sharded_and_async_load_replicated_resharded_and_as_tensors(tmp_path: Path) -> None:
    outcomes = results_or_raise(run_ranks(2, _dtensor_scenarios, str(tmp_path), outbox=tmp_path / "out"))
    assert sk.verify(tmp_path / "shardkeep").ok
    assert sk.verify(tmp_path / "shardkeep-async").ok
    for result in outcomes:
        assert_same_values(result["shardkeep"], result["dcp"])
        assert_same_values(result["dcp"]["sharded"], _numbered(6, 4))
        assert_same_values(result["shardkeep-async"], result["dcp-async"])
        assert_same_values(result["dcp-async"], {"sharded": _numbered(6, 4), "uneven": _numbered(5, 3)})
    # On one process, without a process group: plain tensors from both checkpoints.
    loaded = {way: {"sharded": torch.zeros(6, 4), "uneven": torch.zeros(5, 3), "step": 0} for way in WAYS}
    for way in WAYS:
        dcp.load(loaded[way], storage_reader=_reader(way, tmp_path / way))
    assert_same_values(loaded["shardkeep"], loaded["dcp"])


def test_sharded_tensors_load_with_other_shard_plans_and_switch_to_and_from_tensors(tmp_path: Path) -> None:
    outcomes = results_or_raise(run_ranks(2, _sharded_tensor_scenarios, str(tmp_path), outbox=tmp_path / "out"))
    for result in outcomes:
        assert set(result["shardkeep"]) == {f"{s}->{t}" for s, t in SHARD_PLANS}
        for case, native in result["dcp"].items():
            ours = result["shardkeep"][case]
            assert native[0] == "ok", (case, native)
            assert ours[0] == "ok", (case, ours)
            assert_same_values(list(ours[1:]), list(native[1:]), case)
            assert_same_values(native[1], _numbered(8, 4), case)


def test_ddp_model_and_optimizer_resume_the_same_through_both(tmp_path: Path) -> None:
    outcomes = results_or_raise(run_ranks(2, _ddp_state_dict_scenario, str(tmp_path), outbox=tmp_path / "out"))
    assert sk.verify(tmp_path / "shardkeep").ok
    for result in outcomes:
        assert_same_values(result["shardkeep"], result["dcp"])
        assert_same_values(result["dcp"], result["uninterrupted"])


def test_fsdp2_saved_on_two_ranks_reshards_to_one_process_the_same_both_ways(tmp_path: Path) -> None:
    reference = results_or_raise(run_ranks(2, _fsdp2_save, str(tmp_path), outbox=tmp_path / "out"))[0]
    assert sk.verify(tmp_path / "shardkeep").ok
    loaded = _load_resharded_on_one_process(tmp_path)
    assert_same_values(loaded["shardkeep"], loaded["dcp"])
    assert_same_values(loaded["dcp"]["model"], reference["model"])


def test_fsdp2_saved_on_two_ranks_reshards_to_three_ranks_the_same_both_ways(tmp_path: Path) -> None:
    reference = results_or_raise(run_ranks(2, _fsdp2_save, str(tmp_path), outbox=tmp_path / "save"))[0]
    loaded = results_or_raise(run_ranks(3, _fsdp2_load, str(tmp_path), outbox=tmp_path / "load"))[0]
    assert_same_values(loaded["shardkeep"], loaded["dcp"])
    assert_same_values(loaded["dcp"]["model"], reference["model"])
    assert_same_values(loaded["dcp"]["optim"]["state"], reference["optim"]["state"])
