"""MultiLevelManager end to end on real gloo ranks: "nodes" are groups of two ranks, each node with
its own local root; the persistent level is a directory (and, in a slow test, the S3 server).

Covered: saves on both levels with their own cadence and retention; a flipped local byte healed
from the persistent copy of the same step; a wiped local level; a persistent level that fails
(skipped, or fatal when required); a transient error on the persistent level retried; resharding
from each level; the status listing.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import shardkeep as sk
from tests.support.distributed_harness import results_or_raise, run_ranks

ROWS = 24


def _full(step: int) -> torch.Tensor:
    return torch.arange(ROWS * 4, dtype=torch.float32).reshape(ROWS, 4) + 1000 * step


def _state(step: int, *, zeros: bool = False) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.zeros(ROWS, 4) if zeros else _full(step)
    return {"weights": distribute_tensor(full, mesh, [Shard(0)]), "step": 0 if zeros else step}


def _levels(tmp: str, *, local_every: int = 2, persist_every: int = 4, **persistent: Any) -> list[sk.Level]:
    return [
        sk.Level(
            "local",
            tmp + "/node{node}",
            node_local=True,
            save_policy=sk.SavePolicy(every_steps=local_every),
            retention=sk.RetentionPolicy(keep_last=2, keep_best=0),
        ),
        sk.Level(
            "persistent",
            persistent.pop("root", tmp + "/persistent"),
            source="drain",
            save_policy=sk.SavePolicy(every_steps=persist_every),
            retention=sk.RetentionPolicy(keep_last=3, keep_best=0),
            **persistent,
        ),
    ]


def _node_of(rank: int) -> int:
    """Two "nodes" whatever the world size: the first half of the ranks and the second."""
    import torch.distributed as dist

    world_size = dist.get_world_size() if dist.is_initialized() else 1
    return rank * 2 // world_size if world_size > 1 else 0


def _train(rank: int, world_size: int, tmp: str, last: int) -> dict[str, Any]:
    manager = sk.MultiLevelManager(_levels(tmp), node_of=_node_of, timeout=60)
    results = []
    for step in range(last + 1):
        if manager.should_save(step):
            result = manager.save(_state(step), step=step)
            results.append((step, dict(result.committed), dict(result.draining), dict(result.skipped)))
    manager.close()
    return {"results": results}


def _restore(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    manager = sk.MultiLevelManager(_levels(tmp), node_of=_node_of, timeout=60)
    state = _state(0, zeros=True)
    restored = manager.restore(into=state)
    manager.close()
    if restored is None:
        return {"step": None}
    full = state["weights"].full_tensor()
    return {
        "step": restored.step,
        "equal": bool(torch.equal(full, _full(restored.step))),
        "healed": list(restored.report.healed),
        "refused": list(restored.report.refused),
        "levels_read": list(restored.report.levels_read),
    }


def _steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step_") and (p / "manifest.json").exists())


def test_two_levels_save_on_their_cadence_and_keep_their_retention(tmp_path: Path) -> None:
    results_or_raise(run_ranks(4, _train, str(tmp_path), 9, outbox=tmp_path / "out"))
    # local every 2 steps, keep the last 2, on each node; persistent every 4 steps (drained), keep 3
    for node in (0, 1):
        assert _steps(tmp_path / f"node{node}") == ["step_00000006", "step_00000008"]
    assert _steps(tmp_path / "persistent") == ["step_00000000", "step_00000004", "step_00000008"]
    for name in _steps(tmp_path / "persistent"):
        assert sk.verify(tmp_path / "persistent" / name).ok
    # each node holds only its own ranks' data files, and the manifest is the same bytes on both
    node0, node1 = tmp_path / "node0" / "step_00000008", tmp_path / "node1" / "step_00000008"
    assert (node0 / "manifest.json").read_bytes() == (node1 / "manifest.json").read_bytes()
    assert (node0 / "manifest.json").read_bytes() == (tmp_path / "persistent/step_00000008/manifest.json").read_bytes()
    data0 = {p.name for p in node0.rglob("*.safetensors")}
    data1 = {p.name for p in node1.rglob("*.safetensors")}
    assert data0 and data1 and not data0 & data1


def test_restore_resumes_at_the_newest_local_step(tmp_path: Path) -> None:
    results_or_raise(run_ranks(4, _train, str(tmp_path), 6, outbox=tmp_path / "out"))
    restored = results_or_raise(run_ranks(4, _restore, str(tmp_path), outbox=tmp_path / "out2"))
    assert {r["step"] for r in restored} == {6} and all(r["equal"] for r in restored)


def test_a_flipped_local_byte_heals_from_the_persistent_copy_of_the_same_step(tmp_path: Path) -> None:
    results_or_raise(run_ranks(4, _train, str(tmp_path), 8, outbox=tmp_path / "out"))
    victim = sorted((tmp_path / "node1" / "step_00000008").rglob("*.safetensors"))[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    restored = results_or_raise(run_ranks(4, _restore, str(tmp_path), outbox=tmp_path / "out2"))
    assert {r["step"] for r in restored} == {8} and all(r["equal"] for r in restored), restored
    healed = [h for r in restored for h in r["healed"]]
    assert healed and all("persistent" in str(h) for h in healed), healed
    assert sk.verify(tmp_path / "persistent" / "step_00000008").ok


def test_a_wiped_local_level_restores_from_the_persistent_level(tmp_path: Path) -> None:
    results_or_raise(run_ranks(4, _train, str(tmp_path), 9, outbox=tmp_path / "out"))
    for node in (0, 1):
        for child in (tmp_path / f"node{node}").iterdir():
            import shutil

            shutil.rmtree(child) if child.is_dir() else child.unlink()
    restored = results_or_raise(run_ranks(4, _restore, str(tmp_path), outbox=tmp_path / "out2"))
    assert {r["step"] for r in restored} == {8} and all(r["equal"] for r in restored), restored


def test_a_missing_local_part_without_a_persistent_copy_falls_back_and_says_why(tmp_path: Path) -> None:
    results_or_raise(run_ranks(4, _train, str(tmp_path), 6, outbox=tmp_path / "out"))
    import shutil

    shutil.rmtree(tmp_path / "node1" / "step_00000006")
    restored = results_or_raise(run_ranks(4, _restore, str(tmp_path), outbox=tmp_path / "out2"))
    # step 6 has no copy of node 1's part anywhere; step 4 is complete locally (and persisted)
    assert {r["step"] for r in restored} == {4} and all(r["equal"] for r in restored), restored
    refused = [entry for r in restored for entry in r["refused"]]
    assert any(entry[0] == 6 for entry in refused), refused


@pytest.mark.parametrize("ranks", [2, 3])
def test_resharding_from_the_local_level(tmp_path: Path, ranks: int) -> None:
    results_or_raise(run_ranks(4, _train, str(tmp_path), 6, outbox=tmp_path / "out"))
    restored = results_or_raise(run_ranks(ranks, _restore, str(tmp_path), outbox=tmp_path / "out2"))
    assert {r["step"] for r in restored} == {6} and all(r["equal"] for r in restored), restored


def _train_failing_persistent(rank: int, world_size: int, tmp: str, required: bool) -> dict[str, Any]:
    levels = _levels(tmp, root="/proc/shardkeep-no-such-dir/persistent")
    if required:
        levels[1] = sk.Level(
            "persistent",
            tmp + "/persistent",
            source="drain",
            save_policy=sk.SavePolicy(every_steps=4),
            required=True,
        )
    try:
        sk.MultiLevelManager(levels, node_of=_node_of, timeout=60)
    except sk.LevelUnreachableError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None}


def test_an_unreachable_persistent_level_is_refused_at_start_naming_it(tmp_path: Path) -> None:
    results = results_or_raise(run_ranks(2, _train_failing_persistent, str(tmp_path), False, outbox=tmp_path / "o"))
    assert all(r["error"] == "LevelUnreachableError" and "persistent" in r["message"] for r in results), results
    assert not (tmp_path / "node0").exists()  # nothing written


def _single(tmp: str, **persistent: Any) -> sk.MultiLevelManager:
    return sk.MultiLevelManager(_levels(tmp, **persistent), timeout=60)


def test_one_process_two_levels_and_status(tmp_path: Path) -> None:
    manager = _single(str(tmp_path))
    for step in range(9):
        if manager.should_save(step):
            manager.save({"w": torch.full((4,), float(step))}, step=step)
    manager.close()
    status = manager.status()
    local = {entry.step: entry.state for entry in status["local"]}
    persistent = {entry.step: entry.state for entry in status["persistent"]}
    assert local == {6: "committed", 8: "committed"}
    assert persistent == {0: "committed", 4: "committed", 8: "committed"}
    state = {"w": torch.zeros(4)}
    restored = _single(str(tmp_path)).restore(into=state)
    assert restored is not None and restored.step == 8 and torch.equal(state["w"], torch.full((4,), 8.0))


def _break(root: Path) -> None:
    """Make a persistent level unusable from now on: its root becomes a file."""
    import shutil

    shutil.rmtree(root)
    root.write_text("not a directory")


def test_a_failing_persistent_level_is_skipped_and_local_saves_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    manager = _single(str(tmp_path))
    manager.save({"w": torch.ones(4)}, step=0)
    manager.wait_for_drains()
    _break(tmp_path / "persistent")
    with caplog.at_level(logging.WARNING, logger="shardkeep.levels"):
        result = manager.save({"w": torch.ones(4)}, step=4)
        manager.close()
    assert result.committed == {"local": "step_00000004"}
    assert "persistent" in result.skipped, result
    assert any("'persistent'" in message for message in caplog.messages), caplog.messages


def test_a_required_level_that_fails_fails_the_save(tmp_path: Path) -> None:
    levels = _levels(str(tmp_path))
    levels[1] = sk.Level(
        "persistent",
        str(tmp_path / "persistent"),
        source="drain",
        save_policy=sk.SavePolicy(every_steps=4),
        required=True,
    )
    manager = sk.MultiLevelManager(levels)
    manager.save({"w": torch.ones(4)}, step=0)
    manager.wait_for_drains()
    _break(tmp_path / "persistent")
    with pytest.raises(sk.StorageError):
        manager.save({"w": torch.ones(4)}, step=4)
    manager.close(wait=False)
    # the local step committed before the drain failed
    assert (tmp_path / "node0" / "step_00000004" / "manifest.json").exists()


def test_the_retention_after_a_drain_does_not_block_the_caller(tmp_path: Path) -> None:
    import threading

    manager = _single(str(tmp_path))
    persistent = manager._shared["persistent"].manager
    entered, release = threading.Event(), threading.Event()
    pruned: list[str] = []
    real_prune = persistent.prune

    def slow_prune() -> list[str]:
        entered.set()
        assert release.wait(10)
        pruned.extend(real_prune())
        return pruned

    persistent.prune = slow_prune  # type: ignore[method-assign]
    for step in range(13):
        if manager.should_save(step):
            manager.save({"w": torch.full((4,), float(step))}, step=step)
        if step in (0, 4, 8):
            result = manager.wait_for_drains()  # the drain commits; its retention starts behind
            assert result.committed == {"persistent": f"step_{step:08d}"}
            assert entered.wait(30)
            entered.clear()
            release.set()  # lets this prune finish while training goes on
    manager.close()
    assert _steps(tmp_path / "persistent") == ["step_00000004", "step_00000008", "step_00000012"]
    assert "step_00000000" in pruned
