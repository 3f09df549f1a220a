"""Format 2.0 at its intended shape: 8 gloo ranks on a 2 x 4 mesh (tensor parallel x FSDP)
save a model and its AdamW state as DTensors; the checkpoint loads on 4 ranks (a 1-D mesh), on
one process, and back on 8, with every value exact. The same state saved on 2 ranks has a root
manifest that differs from the 8-rank one by a small per-rank term only."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import shardkeep as sk
from tests.support.distributed_harness import results_or_raise, run_ranks

pytestmark = pytest.mark.slow

#: (name, shape, placements on a (tp, fsdp) mesh). On a 1-D mesh every tensor is Shard(0).
PARAMETERS = [
    ("embed.weight", (32, 16), ("S1", "S0")),
    ("block.0.attn.weight", (16, 16), ("S0", "S1")),
    ("block.0.mlp.weight", (24, 16), ("S0", "S0")),  # both mesh dimensions split rows
    ("block.0.norm.weight", (16,), ("R", "S0")),
    ("block.1.attn.weight", (16, 16), ("S1", "S0")),
    ("block.1.mlp.weight", (10, 16), ("S0", "S0")),  # uneven: 10 rows over 8 ranks
    ("head.weight", (7, 16), ("R", "R")),  # replicated everywhere
]


def _full_values() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    return {name: torch.randn(shape, generator=generator) for name, shape, _ in PARAMETERS}


def _placements(names: tuple[str, ...]) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if name == "R" else Shard(int(name[1:])) for name in names]


def _training_state(world_size: int, mesh_shape: tuple[int, ...], trained: bool) -> dict[str, Any]:
    """A module-free state (parameters in a dict) and an AdamW optimizer over them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", mesh_shape)
    full = _full_values()
    params = {}
    for name, shape, placements in PARAMETERS:
        names = placements if len(mesh_shape) == 2 else ("S0",)
        value = full[name] if trained else torch.zeros(shape)
        params[name] = torch.nn.Parameter(distribute_tensor(value, mesh, _placements(names)))
    optimizer = torch.optim.AdamW(params.values(), lr=0.01, foreach=False)
    if trained:
        for step in range(2):
            for index, param in enumerate(params.values()):
                param.grad = distribute_tensor(
                    torch.full(param.shape, 0.1 * (index + 1) * (step + 1)), mesh, list(param.placements)
                )
            optimizer.step()
    else:  # the state AdamW would make, to load into
        for param in params.values():
            param.grad = torch.zeros_like(param)
        optimizer.step()
    return {"model": params, "optim": optimizer}


def _full(value: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def _flat(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {f"model.{name}": _full(param.detach()) for name, param in state["model"].items()}
    for index, fields in state["optim"].state_dict()["state"].items():
        for field, value in fields.items():
            out[f"optim.{index}.{field}"] = _full(value)
    return out


def _save(rank: int, world_size: int, path: str, mesh_shape: tuple[int, ...], reference: str) -> str:
    state = _training_state(world_size, mesh_shape, trained=True)
    values = _flat(state)  # collectives: every rank takes part
    manifest = sk.save(state, path, step=7)
    if rank == 0:
        torch.save(values, reference)
    return manifest.metadata_version


def _load(rank: int, world_size: int, path: str, mesh_shape: tuple[int, ...], reference: str) -> list[str]:
    state = _training_state(world_size, mesh_shape, trained=False)
    sk.load(path, into=state)
    expected = torch.load(reference)
    loaded = _flat(state)
    assert loaded.keys() == expected.keys()
    return [key for key, value in expected.items() if not torch.equal(loaded[key], value)]


def _described(root: dict[str, Any]) -> int:
    """The described tensors of a root: singletons and every instance of a tensor family."""
    families = root.get("families", [])
    return len(root["sharded"]) + sum(math.prod(len(range(*r)) for r in f["indices"]) for f in families)


def test_a_2x4_mesh_checkpoint_loads_on_4_ranks_1_process_and_8_ranks(tmp_path: Path) -> None:
    path, reference = str(tmp_path / "ckpt8"), str(tmp_path / "reference.pt")
    versions = results_or_raise(run_ranks(8, _save, path, (2, 4), reference, outbox=tmp_path / "s8", timeout=300))
    assert versions == ["2.1"] * 8
    report = sk.verify(path)
    assert report.ok, report.problems
    for world_size, mesh_shape in ((4, (4,)), (8, (2, 4))):
        outcomes = run_ranks(
            world_size, _load, path, mesh_shape, reference, outbox=tmp_path / f"l{world_size}", timeout=300
        )
        for rank, differing in enumerate(results_or_raise(outcomes)):
            assert differing == [], (world_size, rank, differing)
    whole = sk.load(path)  # one process, no group: full tensors
    expected = torch.load(reference)
    for name, _, _ in PARAMETERS:
        assert torch.equal(whole["model"][name], expected[f"model.{name}"]), name
    for index, fields in whole["optim"]["state"].items():
        for field, value in fields.items():
            assert torch.equal(torch.as_tensor(value), expected[f"optim.{index}.{field}"]), (index, field)

    # The same state on 2 ranks: the root manifests differ by a per-rank term, not per chunk.
    path2 = str(tmp_path / "ckpt2")
    results_or_raise(run_ranks(2, _save, path2, (2,), str(tmp_path / "ref2.pt"), outbox=tmp_path / "s2"))
    root8 = json.loads((Path(path) / "manifest.json").read_bytes())
    root2 = json.loads((Path(path2) / "manifest.json").read_bytes())
    assert _described(root8) == _described(root2) == 2 * len(PARAMETERS) + len(PARAMETERS)
    size8 = (Path(path) / "manifest.json").stat().st_size
    size2 = (Path(path2) / "manifest.json").stat().st_size
    per_rank = (size8 - size2) / 6
    assert 0 < per_rank < 400, (size8, size2)
