"""async_save: staging snapshots, background commit, one save in flight, failures, and ranks."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import shardkeep as sk
from shardkeep.storage import LocalStore
from shardkeep.testing import FaultInjectingStore
from tests.support.distributed_harness import results_or_raise, run_ranks


def test_saved_values_are_the_staged_ones_even_after_mutation(tmp_path: Path) -> None:
    weights = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB: copied on the staging threads
    small = torch.ones(3)
    state = {"weights": weights, "small": small, "strided": weights[::2], "array": np.arange(5), "meta": {"n": 1}}
    handle = sk.async_save(state, tmp_path / "ckpt", step=1)
    assert handle.wait_staged()
    weights.zero_()
    small.fill_(7)
    state["array"][:] = -1
    state["meta"]["n"] = 99
    manifest = handle.result(timeout=60)
    assert handle.done() and manifest.step == 1
    loaded = sk.load(tmp_path / "ckpt")
    assert torch.equal(loaded["weights"], torch.arange(1 << 20, dtype=torch.float32))
    assert torch.equal(loaded["small"], torch.ones(3))
    assert torch.equal(loaded["strided"], torch.arange(1 << 20, dtype=torch.float32)[::2])
    assert np.array_equal(loaded["array"], np.arange(5))
    assert loaded["meta"] == {"n": 1}


def test_modules_and_optimizers_are_snapshotted_and_load_back(
    tmp_path: Path, make_state: Callable[..., dict[str, Any]]
) -> None:
    state = make_state(seed=4)
    expected = {k: v.clone() for k, v in state["model"].state_dict().items()}
    handle = sk.async_save(state, tmp_path / "ckpt")
    with torch.no_grad():
        for parameter in state["model"].parameters():
            parameter.add_(1.0)
    manifest = handle.result(timeout=60)
    assert manifest.training.optimizer_type == "AdamW"
    assert manifest.optim_state is not None
    target = make_state(seed=9)
    sk.load(tmp_path / "ckpt", into=target)
    for key, tensor in target["model"].state_dict().items():
        assert torch.equal(tensor, expected[key]), key


def test_one_save_in_flight_a_second_call_waits_or_raises(tmp_path: Path) -> None:
    gate = threading.Event()
    store = LocalStore(tmp_path)
    original = store.open_write

    def slow_open_write(path: str) -> Any:
        gate.wait(timeout=30)
        return original(path)

    store.open_write = slow_open_write  # type: ignore[method-assign]  # hold the first save's writes
    first = sk.async_save({"x": torch.ones(4)}, "first", storage=store)
    with pytest.raises(sk.SaveInProgressError, match="first"):
        sk.async_save({"x": torch.ones(4)}, "second", wait=False)
    assert not first.done()
    gate.set()
    second = sk.async_save({"x": torch.zeros(4)}, tmp_path / "second")  # waits for the first
    assert first.done()
    second.result(timeout=60)
    assert torch.equal(sk.load(tmp_path / "first")["x"], torch.ones(4))
    assert torch.equal(sk.load(tmp_path / "second")["x"], torch.zeros(4))


def test_a_background_failure_is_reraised_with_its_type_and_nothing_is_left(tmp_path: Path) -> None:
    store = FaultInjectingStore(LocalStore(tmp_path), fail_at=3)
    handle = sk.async_save({"x": torch.ones(1000)}, "ckpt", storage=store)
    with pytest.raises(sk.StorageError, match="injected"):
        handle.result(timeout=60)
    assert os.listdir(tmp_path) == []
    sk.async_save({"x": torch.ones(1)}, tmp_path / "again").result(timeout=60)
    with pytest.raises(sk.CheckpointExistsError):  # refused while staging, before any write
        sk.async_save({"x": torch.zeros(1)}, tmp_path / "again")
    with pytest.raises(sk.UnsupportedValueError, match="staging budget"):
        sk.async_save({"x": torch.ones(1000)}, tmp_path / "big", staging_budget=100)


def test_the_staging_buffer_is_reused(tmp_path: Path) -> None:
    from shardkeep.async_saving import AsyncSaver

    state = {"x": torch.randn(1 << 18)}
    sk.async_save(state, tmp_path / "a").result(timeout=60)
    pointer = AsyncSaver.default().arena.reserve(1).data_ptr()
    sk.async_save(state, tmp_path / "b").result(timeout=60)
    assert AsyncSaver.default().arena.reserve(1).data_ptr() == pointer


def _async_on_ranks(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    sharded = distribute_tensor(full.clone(), mesh, [Shard(0)])
    replicated = torch.full((6,), 3.0)
    handle = sk.async_save({"sharded": sharded, "replicated": replicated}, os.path.join(root, "ckpt"), timeout=30)
    sharded.to_local().zero_()  # training moves on
    replicated.zero_()
    manifest = handle.result(timeout=60)
    failing = None
    if rank == 1:
        failing = FaultInjectingStore(LocalStore(root), fail_at=1)
    store = failing or LocalStore(root)
    broken = sk.async_save(
        {"replicated": torch.ones(6) * rank, "more": torch.ones(3)}, "broken", storage=store, timeout=30
    )
    try:
        broken.result(timeout=60)
        error = None
    except sk.CoordinationError as exc:
        error = {"failures": list(exc.failures), "msg": str(exc)}
    return {"files": len(manifest.files), "error": error}


def test_async_save_across_ranks_commits_through_the_store(tmp_path: Path) -> None:
    results = results_or_raise(run_ranks(2, _async_on_ranks, str(tmp_path), outbox=tmp_path / "out"))
    for result in results:
        assert result["error"]["failures"] == [1], result["error"]
    loaded = sk.load(tmp_path / "ckpt")
    assert torch.equal(loaded["sharded"], torch.arange(40, dtype=torch.float32).reshape(10, 4))
    assert torch.equal(loaded["replicated"], torch.full((6,), 3.0))
    assert not (tmp_path / "broken").exists()
    assert [name for name in os.listdir(tmp_path) if name.startswith("broken")] == []


def test_async_manifest_records_the_same_sections_as_a_sync_save(
    tmp_path: Path, make_state: Callable[..., dict[str, Any]]
) -> None:
    state = make_state(seed=2)
    state["layers.0.router.weight"] = torch.zeros(2)
    synchronous = sk.save(state, tmp_path / "sync")
    asynchronous = sk.async_save(state, tmp_path / "async").result(timeout=60)
    assert asynchronous.optim_state == synchronous.optim_state
    assert asynchronous.router_state == synchronous.router_state
    assert asynchronous.training == synchronous.training


def test_the_handle_tells_the_staged_bytes_and_the_arena_size(tmp_path: Path) -> None:
    """``staged_bytes`` is what was copied (this rank's tensors); ``staging_arena_bytes`` the
    host memory the reused arena holds, at least the staged bytes, and unchanged by a second
    save of the same state (the arena is reused, not grown)."""
    state = {"a": torch.zeros(1000), "b": torch.ones(10, 10, dtype=torch.float64), "step": 1}
    first = sk.async_save(state, tmp_path / "one")
    first.result(60)
    second = sk.async_save(state, tmp_path / "two")
    second.result(60)
    assert first.staged_bytes == second.staged_bytes == 1000 * 4 + 100 * 8
    assert second.staging_arena_bytes >= second.staged_bytes
    assert second.staging_arena_bytes == first.staging_arena_bytes
