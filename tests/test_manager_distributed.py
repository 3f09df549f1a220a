"""The manager on 2 real gloo ranks: one run id, retention by the coordinator only, sync and
async saves, consistent fallback, typed errors on every rank, and resuming on 1 rank."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import shardkeep as sk
from tests.support.distributed_harness import results_or_raise, run_ranks

torch = pytest.importorskip("torch")


def _state(rank: int, step: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(64, dtype=torch.float32).reshape(8, 8) + step
    return {
        "sharded": distribute_tensor(full, mesh, [Shard(0)]),
        "replicated": torch.full((4,), float(step)),
        "step": step,
    }


def _train(rank: int, world_size: int, root: str) -> dict[str, Any]:
    manager = sk.CheckpointManager(root, keep_last=1, keep_best=1)
    entries = []
    for step, loss in [(0, None), (1, 2.0), (2, 1.0), (3, 3.0)]:
        metrics = None if loss is None else {"val_loss": loss}
        entry = manager.save(_state(rank, step), step=step, metrics=metrics)
        entries.append((entry.step, entry.is_last, entry.is_best))
    pending = manager.async_save(_state(rank, 4), step=4, metrics={"val_loss": 0.5})
    async_entry = pending.result(timeout=120)
    listing = sorted(p for p in os.listdir(root) if p.startswith("step_"))
    return {
        "run_id": manager.run_id,
        "entries": entries,
        "async": (async_entry.step, async_entry.is_last, async_entry.is_best),
        "listing": listing,
    }


def test_two_ranks_share_one_run_and_the_coordinator_prunes(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    results = results_or_raise(run_ranks(2, _train, str(root), outbox=tmp_path / "out"))
    assert results[0]["run_id"] == results[1]["run_id"] is not None
    assert results[0]["entries"] == [(0, True, True), (1, True, True), (2, True, True), (3, True, False)]
    assert results[0]["async"] == (4, True, True)
    assert results[1]["async"][0] == 4
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == ["step_00000004"]
    manifest = sk.read_manifest(root / "step_00000004")
    assert manifest.world_size == 2 and manifest.run is not None and manifest.run.run_id == results[0]["run_id"]
    assert not [p for p in root.iterdir() if ".tmp-" in p.name or ".deleting-" in p.name]

    # resume on ONE rank (a different world size): the full tensor comes back, the policy holds
    manager = sk.CheckpointManager(root, keep_last=1, keep_best=1)
    restored = manager.restore()
    assert restored.step == 4 and manager.run_id == results[0]["run_id"]
    assert torch.equal(restored.state["sharded"], torch.arange(64, dtype=torch.float32).reshape(8, 8) + 4)
    manager.save(
        {"sharded": restored.state["sharded"], "replicated": torch.zeros(4), "step": 5},
        step=5,
        metrics={"val_loss": 9.0},
    )
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == ["step_00000004", "step_00000005"]


def _restore_after_corruption(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    manager = sk.CheckpointManager(root, keep_last=2, keep_best=0)
    restored = manager.restore(into=None)
    mesh = init_device_mesh("cpu", (2,))
    target = {
        "sharded": distribute_tensor(torch.zeros(8, 8), mesh, [Shard(0)]),
        "replicated": torch.zeros(4),
        "step": -1,
    }
    in_place = manager.restore(into=target)
    return {
        "step": restored.step,
        "skipped": [name for name, _ in restored.skipped],
        "in_place_step": in_place.step,
        "local": target["sharded"].to_local().clone(),
    }


def _save_two(rank: int, world_size: int, root: str) -> None:
    manager = sk.CheckpointManager(root, keep_last=2, keep_best=0)
    manager.save(_state(rank, 1), step=1)
    manager.save(_state(rank, 2), step=2)


def test_fallback_is_the_same_on_every_rank(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    results_or_raise(run_ranks(2, _save_two, str(root), outbox=tmp_path / "out1"))
    # damage one file of the newest checkpoint: only one rank's region lives in it
    newest = root / "step_00000002"
    victim = max(newest.rglob("*.safetensors"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[-2] ^= 0xFF
    victim.write_bytes(bytes(data))
    results = results_or_raise(run_ranks(2, _restore_after_corruption, str(root), outbox=tmp_path / "out2"))
    for rank, result in enumerate(results):
        assert result["step"] == 1 and result["skipped"] == ["step_00000002"]
        assert result["in_place_step"] == 1
        expected = (torch.arange(64, dtype=torch.float32).reshape(8, 8) + 1)[rank * 4 : rank * 4 + 4]
        assert torch.equal(result["local"], expected)


def _intrude(rank: int, world_size: int, root: str) -> str:
    manager = sk.CheckpointManager(root)
    try:
        manager.save({"x": torch.zeros(2)}, step=9)
    except sk.RunMismatchError as exc:
        return f"RunMismatchError: {exc}"
    return "saved"


def test_a_foreign_root_is_refused_on_every_rank_with_the_same_type(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    sk.CheckpointManager(root).save({"x": torch.ones(2)}, step=0)
    results = results_or_raise(run_ranks(2, _intrude, str(root), outbox=tmp_path / "out"))
    assert all(result.startswith("RunMismatchError: ") and "belongs to run" in result for result in results)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == ["step_00000000"]
