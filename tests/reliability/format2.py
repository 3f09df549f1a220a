"""A small format 2.0 checkpoint for the reliability suite, written by a real 2-rank gloo save.

The state holds DTensors on a 1-D mesh of 2 (``Shard(0)``, an uneven ``Shard(1)`` and
``Replicate``), a whole tensor every rank holds, and plain values, so the checkpoint has every
kind of file a format 2.0 save writes: ``manifest.json`` (with ``meshes``, ``sharded`` and
``indexes``), ``manifest.sig``, ``index/rank_0000{0,1}.json``, the ``_sharded`` data files of
both ranks and the coordinator's data file of the whole tensor.

:func:`pristine` saves it once per test session (a save forks 2 ranks, about 3 s); tests copy
it before damaging it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import shardkeep as sk
from tests.support.distributed_harness import results_or_raise, run_ranks

#: The key the pristine checkpoint is signed with (forked ranks inherit it).
KEY = Ed25519PrivateKey.generate()

#: Every file of the pristine checkpoint.
FILES = [
    "index/rank_00000.json",
    "index/rank_00001.json",
    "manifest.json",
    "manifest.sig",
    "shards/rank_00000.safetensors",
    "shards/rank_00000_sharded.safetensors",
    "shards/rank_00001_sharded.safetensors",
]


def expected() -> dict[str, Any]:
    """What a load of the checkpoint returns on one process (DTensors as whole tensors)."""
    return {
        "w": torch.arange(8, dtype=torch.float32).reshape(4, 2) / 4,
        "col": torch.arange(6, dtype=torch.int64).reshape(2, 3),  # 3 columns over 2 ranks: 2 and 1
        "rep": torch.tensor([1.5, -2.0, 3.25], dtype=torch.float64),
        "bias": torch.tensor([0.5, -1.0], dtype=torch.bfloat16),
        "step": 3,
        "note": "format 2.0",
    }


def state(world_size: int, fill: bool = True) -> dict[str, Any]:
    """The state as each rank holds it (call with a process group initialized)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = expected()
    if not fill:
        full = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in full.items()}
    placements = {"w": Shard(0), "col": Shard(1), "rep": Replicate()}
    built: dict[str, Any] = dict(full)
    for key, placement in placements.items():
        built[key] = distribute_tensor(full[key], mesh, [placement])
    return built


def _save(rank: int, world_size: int, path: str, signed: bool) -> str:
    return sk.save(state(world_size), path, step=3, signer=KEY if signed else None).metadata_version


def save(path: Path, *, signed: bool = True, outbox: Path) -> None:
    """Save the checkpoint at ``path`` on 2 forked gloo ranks."""
    versions = results_or_raise(run_ranks(2, _save, str(path), signed, outbox=outbox))
    assert versions == ["2.1", "2.1"]


_PRISTINE: dict[str, Path] = {}


def pristine(factory: pytest.TempPathFactory) -> Path:
    """The signed checkpoint, saved once per session; never damage it (copy it first)."""
    found = _PRISTINE.get("signed")
    if found is None:
        base = factory.mktemp("format2")
        found = base / "pristine"
        save(found, outbox=base / "outbox")
        assert sorted(str(p.relative_to(found)) for p in found.rglob("*") if p.is_file()) == FILES
        assert sk.read_manifest(found).metadata_version == "2.1"
        _PRISTINE["signed"] = found
    return found


def copy(factory: pytest.TempPathFactory, destination: Path, *, signed: bool = True) -> Path:
    """A fresh copy of the pristine checkpoint at ``destination`` (without ``manifest.sig``
    when not ``signed``: what an unsigned save writes)."""
    shutil.copytree(pristine(factory), destination)
    if not signed:
        (destination / "manifest.sig").unlink()
    return destination


def same(loaded: Any) -> bool:
    """Whether a single-process load returned exactly the saved values (dtypes included)."""
    if not isinstance(loaded, dict) or set(loaded) != set(expected()):
        return False
    for key, value in expected().items():
        got = loaded[key]
        if isinstance(value, torch.Tensor):
            if not (
                isinstance(got, torch.Tensor)
                and got.dtype == value.dtype
                and got.shape == value.shape
                and torch.equal(got, value)
            ):
                return False
        elif got != value or type(got) is not type(value):
            return False
    return True
