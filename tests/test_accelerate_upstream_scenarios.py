"""Accelerate's own checkpoint tests, rebuilt and run both ways.

Each scenario is the body of a test from Accelerate's suite (``tests/test_state_checkpointing.py``
``CheckpointTest``, and the save/load tests of ``tests/test_accelerator.py``), as close to the
upstream body as one CPU process allows (data loaders without worker processes). Each runs
twice: with ``Accelerator.save_state``/``load_state`` and with
``shardkeep.accelerate.save_state``/``load_state``. Each run keeps the upstream assertions and
returns what it observed (restored weights, optimizer and scheduler states, the random numbers
drawn after a resume, ``project_configuration.iteration``, the directories left under
``total_limit``, the errors raised); the two runs must observe the same things.
"""

from __future__ import annotations

import json
import os
import random
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import shardkeep as sk
import shardkeep.accelerate as shardkeep_accelerate

#: Accelerate's own checkpointing (``safe_serialization`` true and false, as upstream
#: parameterizes ``CheckpointTest``) and shardkeep's.
WAYS = ("accelerate", "accelerate-pickle", "shardkeep")


class Checkpointing:
    """``save_state``/``load_state`` one way or another, with the upstream call shapes. Each
    shardkeep checkpoint is verified right after its save, with no pickle in it."""

    def __init__(self, way: str) -> None:
        self.way = way

    def save(self, accelerator: Any, path: str | None = None) -> None:
        if self.way != "shardkeep":
            accelerator.save_state(path, safe_serialization=self.way == "accelerate")
            return
        shardkeep_accelerate.save_state(accelerator, path)
        if accelerator.project_configuration.automatic_checkpoint_naming:
            path = os.path.join(accelerator.project_dir, "checkpoints", f"checkpoint_{accelerator.save_iteration - 1}")
        assert path is not None
        assert sk.verify(path).ok
        assert not [name for name in os.listdir(path) if name.endswith((".pkl", ".bin"))]

    def load(self, accelerator: Any, path: str | None = None) -> None:
        if self.way != "shardkeep":
            accelerator.load_state(path)
        else:
            shardkeep_accelerate.load_state(accelerator, path)


def _reset_accelerator_state() -> None:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)


@pytest.fixture(autouse=True)
def _fresh_accelerator_state() -> Any:
    yield
    _reset_accelerator_state()


def _plain(value: Any) -> Any:
    """``value`` with tensors as lists, to compare the two runs' observations."""
    if isinstance(value, torch.Tensor):
        return ["tensor", str(value.dtype), value.tolist()]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def _both_ways(scenario: Callable[[Checkpointing, Path], dict[str, Any]], tmp_path: Path) -> dict[str, Any]:
    observed = {}
    for way in WAYS:
        directory = tmp_path / way
        directory.mkdir()
        observed[way] = _plain(scenario(Checkpointing(way), directory))
        _reset_accelerator_state()
    assert observed["shardkeep"] == observed["accelerate"]
    assert observed["accelerate-pickle"] == observed["accelerate"]
    return observed["shardkeep"]


# --------------------------------------------------------------------------------------------
# tests/test_state_checkpointing.py: CheckpointTest
# --------------------------------------------------------------------------------------------


def dummy_dataloaders(
    a: int = 2, b: int = 3, batch_size: int = 16, n_train_batches: int = 10, n_valid_batches: int = 2
) -> tuple[DataLoader[Any], DataLoader[Any]]:
    def get_dataset(n_batches: int) -> TensorDataset:
        x = torch.randn(batch_size * n_batches, 1)
        return TensorDataset(x, a * x + b + 0.1 * torch.randn(batch_size * n_batches, 1))

    train = DataLoader(get_dataset(n_train_batches), shuffle=True, batch_size=batch_size)
    valid = DataLoader(get_dataset(n_valid_batches), shuffle=False, batch_size=batch_size)
    return train, valid


def train(
    num_epochs: int, model: Any, dataloader: Any, optimizer: Any, accelerator: Any, scheduler: Any = None
) -> list[float]:
    rands = []
    for _ in range(num_epochs):
        model.train()
        for x, y in dataloader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        rands.append(random.random())
        if scheduler is not None:
            scheduler.step()
    return rands


class DummyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(1))
        self.b = nn.Parameter(torch.randn(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.a + self.b


def _accelerator(**kwargs: Any) -> Any:
    from accelerate import Accelerator

    return Accelerator(cpu=True, **kwargs)


def _project(**kwargs: Any) -> Any:
    from accelerate.utils import ProjectConfiguration

    return ProjectConfiguration(**kwargs)


def _fresh_run(**accelerator_kwargs: Any) -> tuple[Any, Any, Any, Any]:
    from accelerate.utils import set_seed

    set_seed(42)
    model = DummyModel()
    optimizer = torch.optim.Adam(params=model.parameters(), lr=1e-3)
    train_dataloader, valid_dataloader = dummy_dataloaders()
    accelerator = _accelerator(**accelerator_kwargs)
    model, optimizer, train_dataloader, _ = accelerator.prepare(model, optimizer, train_dataloader, valid_dataloader)
    return accelerator, model, optimizer, train_dataloader


def _listing(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def scenario_with_save_limit(ckpt: Checkpointing, tmp: Path) -> dict[str, Any]:
    accelerator, *_ = _fresh_run(
        project_config=_project(total_limit=1, project_dir=str(tmp), automatic_checkpoint_naming=True)
    )
    ckpt.save(accelerator)
    ckpt.save(accelerator)
    assert len(os.listdir(accelerator.project_dir)) == 1
    return {
        "project_dir": _listing(tmp),
        "kept": _listing(tmp / "checkpoints"),
        "iteration": accelerator.save_iteration,
    }


def scenario_can_resume_training_with_folder(ckpt: Checkpointing, tmp: Path) -> dict[str, Any]:
    accelerator, model, optimizer, train_dataloader = _fresh_run()
    initial = os.path.join(tmp, "initial")
    ckpt.save(accelerator, initial)
    (a, b) = model.a.item(), model.b.item()
    opt_state = optimizer.state_dict()
    ground_truth_rands = train(3, model, train_dataloader, optimizer, accelerator)
    (a1, b1) = model.a.item(), model.b.item()
    opt_state1 = optimizer.state_dict()

    accelerator, model, optimizer, train_dataloader = _fresh_run()
    ckpt.load(accelerator, initial)
    (a2, b2) = model.a.item(), model.b.item()
    opt_state2 = optimizer.state_dict()
    assert (a, b) == (a2, b2)
    assert opt_state == opt_state2

    test_rands = train(2, model, train_dataloader, optimizer, accelerator)
    checkpoint = os.path.join(tmp, "checkpoint")
    ckpt.save(accelerator, checkpoint)
    ckpt.load(accelerator, checkpoint)
    test_rands += train(1, model, train_dataloader, optimizer, accelerator)
    (a3, b3) = model.a.item(), model.b.item()
    opt_state3 = optimizer.state_dict()
    assert (a1, b1) == (a3, b3)
    assert opt_state1 == opt_state3
    assert ground_truth_rands == test_rands
    return {"weights": [a, b, a1, b1, a3, b3], "optimizer": opt_state3, "rands": test_rands}


def scenario_can_resume_training(ckpt: Checkpointing, tmp: Path) -> dict[str, Any]:
    return _resume_from_automatic_names(ckpt, tmp, str(tmp), infer_first_load=False)


def scenario_can_resume_training_checkpoints_relative_path(ckpt: Checkpointing, tmp: Path) -> dict[str, Any]:
    """As upstream: a relative project directory, and the first load finds the checkpoint."""
    os.chdir(tmp)
    os.mkdir("relative_project")
    return _resume_from_automatic_names(ckpt, tmp / "relative_project", "relative_project", infer_first_load=True)


def _resume_from_automatic_names(
    ckpt: Checkpointing, tmp: Path, project_dir: str, infer_first_load: bool
) -> dict[str, Any]:
    accelerator, model, optimizer, train_dataloader = _fresh_run(
        project_dir=project_dir, project_config=_project(automatic_checkpoint_naming=True)
    )
    ckpt.save(accelerator)
    (a, b) = model.a.item(), model.b.item()
    opt_state = optimizer.state_dict()
    ground_truth_rands = train(3, model, train_dataloader, optimizer, accelerator)
    (a1, b1) = model.a.item(), model.b.item()
    opt_state1 = optimizer.state_dict()

    accelerator, model, optimizer, train_dataloader = _fresh_run(
        project_dir=project_dir, project_config=_project(iteration=1, automatic_checkpoint_naming=True)
    )
    ckpt.load(accelerator, None if infer_first_load else os.path.join(project_dir, "checkpoints", "checkpoint_0"))
    (a2, b2) = model.a.item(), model.b.item()
    opt_state2 = optimizer.state_dict()
    assert (a, b) == (a2, b2)
    assert opt_state == opt_state2

    test_rands = train(2, model, train_dataloader, optimizer, accelerator)
    ckpt.save(accelerator)
    ckpt.load(accelerator, os.path.join(project_dir, "checkpoints", "checkpoint_1"))
    test_rands += train(1, model, train_dataloader, optimizer, accelerator)
    (a3, b3) = model.a.item(), model.b.item()
    opt_state3 = optimizer.state_dict()
    assert (a1, b1) == (a3, b3)
    assert opt_state1 == opt_state3
    assert ground_truth_rands == test_rands
    return {
        "weights": [a, b, a1, b1, a3, b3],
        "optimizer": opt_state3,
        "rands": test_rands,
        "iteration": accelerator.save_iteration,
        "kept": _listing(tmp / "checkpoints"),
    }


def scenario_invalid_registration(ckpt: Checkpointing, tmp: Path) -> dict[str, Any]:
    """Upstream: registering objects without ``state_dict``/``load_state_dict`` raises a
    ValueError naming their indexes. Added: an object that got into the registered list
    anyway fails the save on both ways; Accelerate's leaves a partial folder behind, shardkeep's
    nothing."""
    t = torch.tensor([1, 2, 3])
    t1 = torch.tensor([2, 3, 4])
    net = DummyModel()
    opt = torch.optim.Adam(net.parameters())
    accelerator = _accelerator()
    with pytest.raises(ValueError) as ve:
        accelerator.register_for_checkpointing(t, t1, net, opt)
    message = str(ve.value)
    assert "Item at index 0" in message and "Item at index 1" in message
    assert "Item at index 2" not in message and "Item at index 3" not in message

    accelerator._custom_objects.append(t)
    error: type[BaseException] = sk.UnsupportedValueError if ckpt.way == "shardkeep" else AttributeError
    with pytest.raises(error, match="state_dict"):
        ckpt.save(accelerator, str(tmp / "ckpt"))
    assert (tmp / "ckpt").exists() == (ckpt.way != "shardkeep")
    return {"registered": len(accelerator._custom_objects)}


def scenario_with_scheduler(ckpt: Checkpointing, tmp: Path) -> dict[str, Any]:
    from accelerate.utils import set_seed

    set_seed(42)
    model = DummyModel()
    optimizer = torch.optim.Adam(params=model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.99)
    train_dataloader, valid_dataloader = dummy_dataloaders()
    accelerator = _accelerator(project_dir=str(tmp), project_config=_project(automatic_checkpoint_naming=True))
    model, optimizer, train_dataloader, valid_dataloader, scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, valid_dataloader, scheduler
    )
    ckpt.save(accelerator)
    scheduler_state = scheduler.state_dict()
    train(3, model, train_dataloader, optimizer, accelerator, scheduler)
    assert scheduler_state != scheduler.state_dict()
    ckpt.load(accelerator, os.path.join(tmp, "checkpoints", "checkpoint_0"))
    assert scheduler_state == scheduler.state_dict()
    # Added: the RNG states came back too (the same numbers are drawn after the load).
    drawn = [random.random(), float(np.random.rand()), torch.rand(2)]
    return {"scheduler": scheduler.state_dict(), "drawn": drawn, "step": accelerator.step}


def scenario_automatic_loading(ckpt: Checkpointing, tmp: Path) -> dict[str, Any]:
    from accelerate.utils import set_seed

    set_seed(42)
    model = DummyModel()
    optimizer = torch.optim.Adam(params=model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.99)
    train_dataloader, valid_dataloader = dummy_dataloaders()
    accelerator = _accelerator(project_dir=str(tmp), project_config=_project(automatic_checkpoint_naming=True))
    model, optimizer, train_dataloader, valid_dataloader, scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, valid_dataloader, scheduler
    )
    ckpt.save(accelerator)
    train(2, model, train_dataloader, optimizer, accelerator, scheduler)
    (a2, b2) = model.a.item(), model.b.item()
    ckpt.save(accelerator)
    train(1, model, train_dataloader, optimizer, accelerator, scheduler)
    (a3, b3) = model.a.item(), model.b.item()
    ckpt.load(accelerator)
    assert a3 != model.a.item() and b3 != model.b.item()
    assert a2 == model.a.item() and b2 == model.b.item()
    return {"weights": [a2, b2], "scheduler": scheduler.state_dict(), "optimizer": optimizer.state_dict()}


def scenario_checkpoint_deletion(ckpt: Checkpointing, tmp: Path) -> dict[str, Any]:
    from accelerate.utils import set_seed

    set_seed(42)
    model = DummyModel()
    accelerator = _accelerator(
        project_dir=str(tmp), project_config=_project(automatic_checkpoint_naming=True, total_limit=2)
    )
    model = accelerator.prepare(model)
    for _ in range(11):
        ckpt.save(accelerator)
    assert not os.path.exists(os.path.join(tmp, "checkpoints", "checkpoint_0"))
    assert os.path.exists(os.path.join(tmp, "checkpoints", "checkpoint_9"))
    assert os.path.exists(os.path.join(tmp, "checkpoints", "checkpoint_10"))
    return {"kept": _listing(tmp / "checkpoints"), "iteration": accelerator.save_iteration}


# --------------------------------------------------------------------------------------------
# tests/test_accelerator.py: saving and loading with the prepared components, and the hooks
# --------------------------------------------------------------------------------------------


class ModelWithTiedWeights(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(2, 4)
        self.linear2 = nn.Linear(4, 2)
        self.linear2.weight = self.linear1.weight
        self.linear2.bias = self.linear1.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.linear1(x))


def create_components(tied_weights: bool = False) -> tuple[Any, Any, Any, Any, Any]:
    model = ModelWithTiedWeights() if tied_weights else nn.Linear(2, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.01, steps_per_epoch=2, epochs=1)
    train_dl = DataLoader(TensorDataset(torch.tensor([1, 2, 3])))
    valid_dl = DataLoader(TensorDataset(torch.tensor([4, 5, 6])))
    return model, optimizer, scheduler, train_dl, valid_dl


def load_random_weights(model: nn.Module) -> None:
    if isinstance(model, nn.Linear):
        state = nn.Linear(*tuple(model.weight.T.shape)).state_dict()
    else:
        state = ModelWithTiedWeights().state_dict()
    model.load_state_dict(state)


def get_signature(model: nn.Module) -> float:
    return sum(param.abs().sum().item() for param in model.parameters())


def _save_load_model(ckpt: Checkpointing, tmp: Path, tied_weights: bool) -> dict[str, Any]:
    from accelerate.utils import set_seed

    set_seed(0)
    accelerator = _accelerator()
    model, optimizer, scheduler, train_dl, valid_dl = create_components(tied_weights)
    accelerator.prepare(model, optimizer, scheduler, train_dl, valid_dl)
    model_signature = get_signature(model)
    ckpt.save(accelerator, str(tmp / "ckpt"))
    load_random_weights(model)
    assert abs(model_signature - get_signature(model)) > 1e-3
    ckpt.load(accelerator, str(tmp / "ckpt"))
    assert abs(model_signature - get_signature(model)) < 1e-3
    tied = not tied_weights or model.linear2.weight is model.linear1.weight
    return {"weights": model.state_dict(), "tied": tied}


def scenario_save_load_model(ckpt: Checkpointing, tmp: Path) -> dict[str, Any]:
    return _save_load_model(ckpt, tmp, tied_weights=False)


def scenario_save_load_model_tied_weights(ckpt: Checkpointing, tmp: Path) -> dict[str, Any]:
    return _save_load_model(ckpt, tmp, tied_weights=True)


def scenario_save_load_model_with_hooks(ckpt: Checkpointing, tmp: Path) -> dict[str, Any]:
    from accelerate.utils import set_seed

    set_seed(0)
    accelerator = _accelerator()
    model, optimizer, scheduler, train_dl, valid_dl = create_components()
    accelerator.prepare(model, optimizer, scheduler, train_dl, valid_dl)
    model_signature = get_signature(model)

    def save_config(models: list[Any], weights: list[Any], output_dir: str) -> None:
        config = {"class_name": models[0].__class__.__name__}
        with open(os.path.join(output_dir, "data.json"), "w") as f:
            json.dump(config, f)

    def load_config(models: list[Any], input_dir: str) -> None:
        with open(os.path.join(input_dir, "data.json")) as f:
            config = json.load(f)
        models[0].class_name = config["class_name"]

    save_hook = accelerator.register_save_state_pre_hook(save_config)
    load_hook = accelerator.register_load_state_pre_hook(load_config)
    ckpt.save(accelerator, str(tmp / "with_hooks"))
    load_random_weights(model)
    assert abs(model_signature - get_signature(model)) > 1e-3
    model.class_name = "random"
    ckpt.load(accelerator, str(tmp / "with_hooks"))
    assert abs(model_signature - get_signature(model)) < 1e-3
    assert model.class_name == model.__class__.__name__

    save_hook.remove()
    load_hook.remove()
    ckpt.save(accelerator, str(tmp / "without_hooks"))
    load_random_weights(model)
    assert abs(model_signature - get_signature(model)) > 1e-3
    model.class_name = "random"
    ckpt.load(accelerator, str(tmp / "without_hooks"))
    assert abs(model_signature - get_signature(model)) < 1e-3
    assert model.class_name != model.__class__.__name__
    return {"weights": model.state_dict(), "class_name": model.class_name}


def scenario_hook_saves_a_model_itself(ckpt: Checkpointing, tmp: Path) -> dict[str, Any]:
    """The diffusers/PEFT pattern: the save hook saves a model its own way and removes its
    weights, the load hook loads it its own way and removes it from the models."""
    from accelerate.utils import set_seed
    from safetensors.torch import load_file, save_file

    set_seed(0)
    accelerator = _accelerator()
    first, second = accelerator.prepare(nn.Linear(2, 3), nn.Linear(3, 2))
    calls = []

    def save_model_hook(models: list[Any], weights: list[Any], output_dir: str) -> None:
        calls.append(("save", len(models), len(weights)))
        os.makedirs(os.path.join(output_dir, "second"))
        save_file(weights.pop(), os.path.join(output_dir, "second", "model.safetensors"))

    def load_model_hook(models: list[Any], input_dir: str) -> None:
        calls.append(("load", len(models), 0))
        model = models.pop()
        model.load_state_dict(load_file(os.path.join(input_dir, "second", "model.safetensors")))

    accelerator.register_save_state_pre_hook(save_model_hook)
    accelerator.register_load_state_pre_hook(load_model_hook)
    saved = [get_signature(first), get_signature(second)]
    ckpt.save(accelerator, str(tmp / "ckpt"))
    load_random_weights(first)
    load_random_weights(second)
    ckpt.load(accelerator, str(tmp / "ckpt"))
    assert [get_signature(first), get_signature(second)] == saved
    return {"first": first.state_dict(), "second": second.state_dict(), "calls": calls}


class ModelForTest(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(3, 4)
        self.batchnorm = nn.BatchNorm1d(4)
        self.linear2 = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.batchnorm(self.linear1(x)))


def create_dataloaders_for_test(
    batch_size: int = 3, n_train_batches: int = 12, n_valid_batches: int = 2
) -> tuple[DataLoader[Any], DataLoader[Any]]:
    def get_dataset(n_batches: int) -> TensorDataset:
        return TensorDataset(torch.randn(batch_size * n_batches, 3), torch.randn(batch_size * n_batches, 5))

    train_dl = DataLoader(get_dataset(n_train_batches), batch_size=batch_size)
    valid_dl = DataLoader(get_dataset(n_valid_batches), batch_size=batch_size)
    return train_dl, valid_dl


def scenario_save_model_with_stateful_dataloader(ckpt: Checkpointing, tmp: Path) -> dict[str, Any]:
    """``test_save_model_with_stateful_dataloader`` (one process, no loader workers, batches not
    dispatched): saved after 3 batches, trained to the end, resumed: the loader resumes at batch
    4 and the model ends as it did."""
    with warnings.catch_warnings():
        # torchdata 0.11 calls its own deprecated set_vital() on every new iterator.
        warnings.filterwarnings("ignore", "'set_vital' is deprecated", UserWarning)
        return _stateful_dataloader_run(ckpt, tmp)


def _stateful_dataloader_run(ckpt: Checkpointing, tmp: Path) -> dict[str, Any]:
    from accelerate.utils import DataLoaderConfiguration, set_seed

    set_seed(42)
    accelerator = _accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    _, optimizer, scheduler, _, _ = create_components()
    train_dl, valid_dl = create_dataloaders_for_test(n_train_batches=16)
    model = ModelForTest()
    prepared = accelerator.prepare(model, optimizer, scheduler, train_dl, valid_dl)
    prepared_model, prepared_optimizer, prepared_scheduler, prepared_train_dl, _ = prepared

    def train_step(batch: Any) -> None:
        x, y = batch
        accelerator.backward(torch.nn.functional.mse_loss(prepared_model(x), y))
        prepared_optimizer.step()
        prepared_scheduler.step()
        prepared_optimizer.zero_grad()

    untrained_batches = []
    for step, batch in enumerate(prepared_train_dl):
        train_step(batch)
        if step == 2:
            ckpt.save(accelerator, f"{tmp}/state")
        if step >= 3:
            untrained_batches.append(batch)
    original = {key: value.clone() for key, value in accelerator.unwrap_model(prepared_model).state_dict().items()}
    ckpt.load(accelerator, f"{tmp}/state")
    seen = [batch for batch in prepared_train_dl if train_step(batch) is None]
    assert len(seen) == len(untrained_batches)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(seen, untrained_batches, strict=True))
    final = accelerator.unwrap_model(prepared_model).state_dict()
    assert all(torch.allclose(original[key].float(), final[key].float()) for key in original)
    return {"seen": len(seen), "final": final, "scheduler": prepared_scheduler.state_dict()}


class NumpySampler:
    """A registered object holding a numpy ``Generator`` (PCG64: 128-bit integers in its state)."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(2**90 + 3)

    def state_dict(self) -> dict[str, Any]:
        return {"bit_generator": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["bit_generator"]


def scenario_registered_numpy_generator(ckpt: Checkpointing, tmp: Path) -> dict[str, Any]:
    """``register_for_checkpointing`` of an object whose state is a numpy ``Generator``'s."""
    accelerator = _accelerator()
    sampler = NumpySampler()
    accelerator.register_for_checkpointing(sampler)
    sampler.rng.random(4)
    ckpt.save(accelerator, str(tmp / "ckpt"))
    expected = sampler.rng.random(6).tolist()
    sampler.rng = np.random.default_rng(0)
    ckpt.load(accelerator, str(tmp / "ckpt"))
    drawn = sampler.rng.random(6).tolist()
    assert drawn == expected
    return {"drawn": drawn, "state": repr(sampler.rng.bit_generator.state)}


SCENARIOS = {
    name.removeprefix("scenario_"): function for name, function in globals().items() if name.startswith("scenario_")
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_upstream_scenario_observes_the_same_both_ways(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the relative-path scenario changes directory
    _both_ways(SCENARIOS[name], tmp_path)
