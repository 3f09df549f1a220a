"""A ``TrainingCheckpoint`` through ``MultiLevelManager`` (one process): saved from its
``to_state``, restored in place (modules and optimizer filled, plain fields taken, RNG states put
back), from the local level and, when the local level is wiped, from the persistent one."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import shardkeep as sk


def _levels(tmp: Path) -> list[sk.Level]:
    return [
        sk.Level(
            "local",
            str(tmp / "node{node}"),
            node_local=True,
            save_policy=sk.SavePolicy(every_steps=1),
            retention=sk.RetentionPolicy(keep_last=2, keep_best=0),
        ),
        sk.Level(
            "persistent",
            str(tmp / "persistent"),
            source="drain",
            save_policy=sk.SavePolicy(every_steps=2),
            retention=sk.RetentionPolicy(keep_last=2, keep_best=0),
        ),
    ]


def _checkpoint(iteration: int, *, seed: int = 0) -> sk.TrainingCheckpoint:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return sk.TrainingCheckpoint(
        model=model,
        optimizer=optimizer,
        model_args={"d_in": 4, "d_out": 3},
        iteration=iteration,
        best_val_loss=0.5,
        config={"lr": 1e-3},
        ema={"weight": model.weight.detach().clone()},
        data_position={"epoch": 1, "batch": iteration},
    )


def _draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def _empty_target() -> sk.TrainingCheckpoint:
    target = _checkpoint(0, seed=1)
    with torch.no_grad():
        target.model.weight.zero_()
    target.optimizer.state.clear()
    target.best_val_loss = None
    target.data_position = None
    return target


@pytest.mark.parametrize("wipe_local", [False, True])
def test_a_training_checkpoint_is_saved_and_restored_in_place(tmp_path: Path, wipe_local: bool) -> None:
    original = _checkpoint(4)
    manager = sk.MultiLevelManager(_levels(tmp_path))
    result = manager.save(original, step=4, metrics={"loss": 0.5})
    assert set(result.committed) | set(result.draining) == {"local", "persistent"}
    expected = _draws()  # what the saved run draws next
    manager.close()
    assert (tmp_path / "persistent" / "step_00000004" / "manifest.json").exists()
    if wipe_local:
        shutil.rmtree(tmp_path / "node0")
    for _ in range(5):  # the generators move on
        _draws()

    target = _empty_target()
    module, optimizer = target.model, target.optimizer
    restored = sk.MultiLevelManager(_levels(tmp_path)).restore(into=target)

    assert restored is not None and restored.step == 4 and restored.state is target
    assert target.model is module and target.optimizer is optimizer
    assert torch.equal(target.model.weight, original.model.weight)
    assert len(target.optimizer.state) == 2
    assert torch.equal(target.ema["weight"], original.ema["weight"])
    assert target.iteration == 4 and target.best_val_loss == 0.5
    assert target.data_position == {"epoch": 1, "batch": 4}
    assert target.model_args == {"d_in": 4, "d_out": 3}
    assert _draws() == expected  # the random stream resumes where the saved run was
    assert restored.report.levels_read


def test_without_into_a_saved_training_checkpoint_comes_back_as_one(tmp_path: Path) -> None:
    original = _checkpoint(2)
    manager = sk.MultiLevelManager(_levels(tmp_path))
    manager.save(original, step=2)
    manager.close()
    restored = sk.MultiLevelManager(_levels(tmp_path)).restore()
    assert restored is not None and isinstance(restored.state, sk.TrainingCheckpoint)
    assert restored.state.iteration == 2 and restored.state.data_position == {"epoch": 1, "batch": 2}
    assert torch.equal(restored.state.model["weight"], original.model.weight)


def test_track_rng_false_leaves_the_generators_alone(tmp_path: Path) -> None:
    original = _checkpoint(2)
    manager = sk.MultiLevelManager(_levels(tmp_path))
    manager.save(original, step=2)
    manager.close()
    target = _empty_target()
    target.track_rng = False
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    expected = _draws()
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    sk.MultiLevelManager(_levels(tmp_path)).restore(into=target)
    assert _draws() == expected and target.iteration == 2
