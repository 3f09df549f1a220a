"""Accelerate through shardkeep: ``shardkeep.accelerate.save_state``/``load_state`` save what
``Accelerator.save_state`` saves (models, optimizers, schedulers, samplers, registered objects,
the step, RNG states) as one verified checkpoint, with no pickle, and resume exactly."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import shardkeep as sk
from shardkeep.accelerate import load_state, save_state


class EmaTracker:
    """A custom object registered for checkpointing (state_dict/load_state_dict)."""

    def __init__(self) -> None:
        self.value = torch.zeros(4)
        self.updates = 0

    def update(self, model: torch.nn.Module) -> None:
        self.value = 0.9 * self.value + 0.1 * model.weight.detach()[0]
        self.updates += 1

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value, self.updates = state["value"].clone(), int(state["updates"])


def _setup(seed: int) -> tuple[Any, torch.nn.Module, Any, Any, Any, EmaTracker]:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    set_seed(seed)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    fixed = torch.Generator().manual_seed(7)  # the same data in every run, whatever the seed
    data = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=fixed), torch.randn(32, 2, generator=fixed))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    ema = EmaTracker()
    accelerator.register_for_checkpointing(ema)
    return accelerator, model, optimizer, loader, scheduler, ema


def _train(
    accelerator: Any, model: Any, optimizer: Any, loader: Any, scheduler: Any, ema: EmaTracker, steps: int
) -> list[float]:
    """``steps`` optimizer steps with dropout-like noise from every RNG (so a wrong RNG state
    changes the losses), returning each loss."""
    losses = []
    batches = iter(loader)
    for _ in range(steps):
        inputs, targets = next(batches)
        noise = torch.rand(1).item() * 0.01 + random.random() * 0.01 + float(np.random.rand()) * 0.01
        loss = torch.nn.functional.mse_loss(model(inputs) + noise, targets)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        ema.update(accelerator.unwrap_model(model))
        accelerator.step += 1
        losses.append(loss.item())
    return losses


def test_an_accelerate_run_resumes_exactly_from_a_shardkeep_checkpoint(tmp_path: Path) -> None:
    accelerator, model, optimizer, loader, scheduler, ema = _setup(seed=0)
    _train(accelerator, model, optimizer, loader, scheduler, ema, steps=3)
    manifest = save_state(accelerator, tmp_path / "ckpt")
    expected = _train(accelerator, model, optimizer, loader, scheduler, ema, steps=4)
    expected_weight = accelerator.unwrap_model(model).weight.detach().clone()

    assert sk.verify(tmp_path / "ckpt").ok
    keys = {entry.key for _, entry in manifest.iter_tensors()}
    assert {"models.0.weight", "custom.0.value", "rng.process_0.states", "counters.step"} <= {
        *keys,
        *(value.key for value in manifest.values),
    }
    assert not any(path.suffix in (".pkl", ".bin") for path in (tmp_path / "ckpt").rglob("*"))

    # A fresh run with other seeds, other weights and another scheduler position.
    accelerator2, model2, optimizer2, loader2, scheduler2, ema2 = _setup(seed=123)
    _train(accelerator2, model2, optimizer2, loader2, scheduler2, ema2, steps=1)
    load_state(accelerator2, tmp_path / "ckpt")
    assert accelerator2.step == 3 and ema2.updates == 3
    assert scheduler2.scheduler.last_epoch == 3
    resumed = _train(accelerator2, model2, optimizer2, loader2, scheduler2, ema2, steps=4)
    assert resumed == expected
    assert torch.equal(accelerator2.unwrap_model(model2).weight, expected_weight)


def test_a_damaged_checkpoint_changes_nothing(tmp_path: Path) -> None:
    accelerator, model, optimizer, loader, scheduler, ema = _setup(seed=0)
    _train(accelerator, model, optimizer, loader, scheduler, ema, steps=2)
    save_state(accelerator, tmp_path / "ckpt")
    shard = next((tmp_path / "ckpt" / "shards").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x40
    shard.write_bytes(bytes(data))
    before = accelerator.unwrap_model(model).weight.detach().clone()
    rng_before = torch.get_rng_state()
    with pytest.raises(sk.IntegrityError):
        load_state(accelerator, tmp_path / "ckpt")
    assert torch.equal(accelerator.unwrap_model(model).weight, before)
    assert torch.equal(torch.get_rng_state(), rng_before)


def test_a_refused_rng_state_rolls_back_the_whole_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """RNG states the generators refuse (here: saved as bytes that are not JSON) fail the load
    after the weights were filled, and the fill is rolled back: weights, optimizer, step and
    RNG as they were."""
    import shardkeep.accelerate as shardkeep_accelerate

    accelerator, model, optimizer, loader, scheduler, ema = _setup(seed=0)
    _train(accelerator, model, optimizer, loader, scheduler, ema, steps=2)
    monkeypatch.setattr(shardkeep_accelerate, "_rng_bytes", lambda: torch.tensor([0xFF, 0xFE], dtype=torch.uint8))
    save_state(accelerator, tmp_path / "ckpt")
    monkeypatch.undo()
    _train(accelerator, model, optimizer, loader, scheduler, ema, steps=1)
    weight = accelerator.unwrap_model(model).weight.detach().clone()
    step, rng = accelerator.step, torch.get_rng_state()
    with pytest.raises(sk.ShardkeepError, match="RNG states"):
        load_state(accelerator, tmp_path / "ckpt")
    assert torch.equal(accelerator.unwrap_model(model).weight, weight)
    assert accelerator.step == step and torch.equal(torch.get_rng_state(), rng)
