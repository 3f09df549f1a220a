"""Accelerate through shardkeep: ``shardkeep.accelerate.save_state``/``load_state`` save what
``Accelerator.save_state`` saves (models, optimizers, schedulers, samplers, registered objects,
the step, RNG states) as one verified checkpoint, with no pickle, and resume exactly."""

from __future__ import annotations

import os
import random
import re
import threading
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
    import shardkeep.integrations.accelerate as shardkeep_accelerate

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


@pytest.fixture(autouse=True)
def _fresh_accelerator_state() -> Any:
    """Each test builds its own ``Accelerator``: the process-wide state is reset after it."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)


def _project_accelerator(project: Path, **config: Any) -> tuple[Any, torch.nn.Module]:
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    accelerator = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True, **config),
    )
    return accelerator, accelerator.prepare(torch.nn.Linear(3, 2))


def test_automatic_checkpoint_naming_counts_iterations_and_keeps_total_limit(tmp_path: Path) -> None:
    """Without a path, ``save_state`` writes ``project_dir/checkpoints/checkpoint_<iteration>``,
    advances ``project_configuration.iteration``, and keeps the newest ``total_limit``;
    ``load_state()`` without a path restores the newest."""
    accelerator, model = _project_accelerator(tmp_path, total_limit=2)
    weights = []
    for _ in range(3):
        with torch.no_grad():
            model.weight.add_(1.0)
        weights.append(model.weight.detach().clone())
        save_state(accelerator)
    assert accelerator.project_configuration.iteration == 3
    assert sorted(path.name for path in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_1", "checkpoint_2"]
    assert all(sk.verify(tmp_path / "checkpoints" / name).ok for name in ("checkpoint_1", "checkpoint_2"))
    with torch.no_grad():
        model.weight.zero_()
    load_state(accelerator)
    assert torch.equal(model.weight, weights[2])


def test_save_and_load_pre_hooks_are_called_like_accelerate_calls_them(tmp_path: Path) -> None:
    """The hooks get the prepared models, the weights (a save hook that saves a model itself
    removes its weights) and a directory; what the save hook writes there is in the checkpoint,
    verified, and the load hook finds it in the directory it gets."""
    import json

    from accelerate import Accelerator
    from safetensors.torch import load_file, save_file

    accelerator = Accelerator(cpu=True)
    first, second = accelerator.prepare(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    calls: list[str] = []

    def save_hook(models: list[Any], weights: list[dict[str, torch.Tensor]], output_dir: str) -> None:
        calls.append("save")
        assert models == [first, second] and len(weights) == 2
        assert torch.equal(weights[1]["weight"], second.weight)
        Path(output_dir, "second").mkdir()
        save_file(weights.pop(), str(Path(output_dir, "second", "weights.safetensors")))
        Path(output_dir, "config.json").write_text(json.dumps({"class_name": type(second).__name__}))

    def load_hook(models: list[Any], input_dir: str) -> None:
        calls.append("load")
        assert models == [first, second]
        model = models.pop()
        model.load_state_dict(load_file(str(Path(input_dir, "second", "weights.safetensors"))))
        model.class_name = json.loads(Path(input_dir, "config.json").read_text())["class_name"]

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
    expected = [first.weight.detach().clone(), second.weight.detach().clone()]
    manifest = save_state(accelerator, tmp_path / "ckpt")
    keys = {entry.key for _, entry in manifest.iter_tensors()}
    assert "models.0.weight" in keys and "models.1.weight" not in keys
    assert sk.verify(tmp_path / "ckpt").ok
    with torch.no_grad():
        first.weight.zero_()
        second.weight.zero_()
    load_state(accelerator, tmp_path / "ckpt")
    assert calls == ["save", "load"]
    assert torch.equal(first.weight, expected[0]) and torch.equal(second.weight, expected[1])
    assert second.class_name == "Linear"


def _plain(value: Any) -> Any:
    """``value`` with arrays as (dtype, list), to compare nested states exactly."""
    if isinstance(value, np.ndarray):
        return (str(value.dtype), value.tolist())
    if isinstance(value, dict):
        return {key: (type(item).__name__, _plain(item)) for key, item in value.items()}
    return value


class NumpyGeneratorHolder:
    """A registered object whose state is a numpy ``Generator``'s (PCG64's holds 128-bit ints)."""

    def __init__(self, bit_generator: type[np.random.BitGenerator], seed: int) -> None:
        self.rng = np.random.Generator(bit_generator(seed))

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state, "name": "sampler"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]


@pytest.mark.parametrize(
    "bit_generator", [np.random.PCG64, np.random.PCG64DXSM, np.random.MT19937, np.random.Philox, np.random.SFC64]
)
def test_a_registered_numpy_generator_state_round_trips_exactly(
    tmp_path: Path, bit_generator: type[np.random.BitGenerator]
) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    holder = NumpyGeneratorHolder(bit_generator, seed=2**100 + 5)
    accelerator.register_for_checkpointing(holder)
    holder.rng.random(3)
    saved_state = holder.rng.bit_generator.state
    save_state(accelerator, tmp_path / "ckpt")
    expected = holder.rng.random(5)
    holder.rng = np.random.Generator(bit_generator(1))
    load_state(accelerator, tmp_path / "ckpt")
    assert _plain(holder.rng.bit_generator.state) == _plain(saved_state)
    assert np.array_equal(holder.rng.random(5), expected)


def test_total_limit_deletes_only_after_the_new_checkpoint_commits(tmp_path: Path) -> None:
    """A save that fails leaves the checkpoints ``total_limit`` kept, and the iteration, as they
    were. (``Accelerator.save_state`` deletes the oldest first: the same failing save leaves
    a partial folder and no complete checkpoint.)"""

    class Unstorable:
        def state_dict(self) -> dict[str, Any]:
            return {"handle": threading.Lock()}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    for way in ("accelerate", "shardkeep"):
        project = tmp_path / way
        accelerator, _ = _project_accelerator(project, total_limit=1)
        if way == "shardkeep":
            save_state(accelerator)
        else:
            accelerator.save_state()
        accelerator.register_for_checkpointing(Unstorable())
        if way == "shardkeep":
            with pytest.raises(sk.UnsupportedValueError, match=r"custom\.0|index 0"):
                save_state(accelerator)
            assert sorted(p.name for p in (project / "checkpoints").iterdir()) == ["checkpoint_0"]
            assert sk.verify(project / "checkpoints" / "checkpoint_0").ok
            assert accelerator.project_configuration.iteration == 1
        else:
            with pytest.raises(TypeError, match="pickle"):
                accelerator.save_state()
            assert not (project / "checkpoints" / "checkpoint_0").exists()
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(True)


def test_total_limit_leaves_what_is_not_a_committed_checkpoint(tmp_path: Path) -> None:
    accelerator, _ = _project_accelerator(tmp_path, total_limit=1)
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    (checkpoints / "checkpoint_0.tmp-0123").mkdir()  # another save's staging directory
    (checkpoints / "notes").mkdir()
    (checkpoints / "checkpoint_7").mkdir()  # no manifest: not a checkpoint, never deleted
    accelerator.project_configuration.iteration = 1
    save_state(accelerator)
    save_state(accelerator)
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "checkpoint_0.tmp-0123",
        "checkpoint_2",
        "checkpoint_7",
        "notes",
    ]


def test_an_existing_checkpoint_name_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    accelerator, _ = _project_accelerator(tmp_path)
    save_state(accelerator)
    accelerator.project_configuration.iteration = 0
    called = []
    accelerator.register_save_state_pre_hook(lambda *args: called.append(args))
    with pytest.raises(sk.CheckpointExistsError, match=r"checkpoint_0.*iteration"):
        save_state(accelerator)
    assert called == [] and accelerator.project_configuration.iteration == 0


def test_without_a_path_or_automatic_naming_is_a_config_error(tmp_path: Path) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    with pytest.raises(sk.ConfigError, match="automatic_checkpoint_naming"):
        save_state(accelerator)
    with pytest.raises(sk.ConfigError, match="automatic_checkpoint_naming"):
        load_state(accelerator)
    accelerator, _ = _project_accelerator(tmp_path)
    with pytest.raises(sk.CheckpointNotFoundError, match="checkpoint_<N>"):
        load_state(accelerator)


def test_load_state_without_a_path_falls_back_from_a_damaged_newest_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    accelerator, model = _project_accelerator(tmp_path)
    save_state(accelerator)
    first = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    save_state(accelerator)
    shard = next((tmp_path / "checkpoints" / "checkpoint_1" / "shards").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x40
    shard.write_bytes(bytes(data))
    with pytest.raises(sk.IntegrityError):  # named explicitly: no fallback
        load_state(accelerator, tmp_path / "checkpoints" / "checkpoint_1")
    with caplog.at_level("WARNING", logger="shardkeep.accelerate"):
        load_state(accelerator)
    assert torch.equal(model.weight, first)
    assert "checkpoint_1 cannot be loaded" in caplog.text and "previous" in caplog.text
    shard = next((tmp_path / "checkpoints" / "checkpoint_0" / "shards").glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(sk.IntegrityError, match=r"no checkpoint .* can be loaded"):
        load_state(accelerator)


def test_a_save_hook_that_writes_a_symlink_is_refused(tmp_path: Path) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(2, 2))
    (tmp_path / "secret").write_text("not for the checkpoint")
    accelerator.register_save_state_pre_hook(
        lambda models, weights, output_dir: os.symlink(tmp_path / "secret", os.path.join(output_dir, "link"))
    )
    with pytest.raises(sk.UnsupportedValueError, match=r"'link'.*not a regular file"):
        save_state(accelerator, tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["secret"]


@pytest.mark.parametrize("hostile", ["../escaped", "/abs/escaped", "a/../../escaped"])
def test_hook_files_with_an_unsafe_path_are_refused(tmp_path: Path, hostile: str) -> None:
    """A checkpoint whose ``hook_files`` name a path outside the hooks' directory writes
    nothing and calls no hook."""
    from accelerate import Accelerator

    sk.save(
        {"hook_files": {"0": {"path": hostile, "data": np.frombuffer(b"owned", dtype=np.uint8)}}}, tmp_path / "ckpt"
    )
    accelerator = Accelerator(cpu=True)
    called = []
    accelerator.register_load_state_pre_hook(lambda models, input_dir: called.append(input_dir))
    with pytest.raises(sk.UnsafePathError, match=re.escape(repr(hostile))):
        load_state(accelerator, tmp_path / "ckpt")
    assert called == []
    assert not list(tmp_path.parent.rglob("escaped"))


def test_a_failing_save_hook_commits_nothing_and_leaves_nothing(tmp_path: Path) -> None:
    accelerator, _ = _project_accelerator(tmp_path)

    def failing_hook(models: list[Any], weights: list[Any], output_dir: str) -> None:
        Path(output_dir, "partial.bin").write_bytes(b"half")
        raise RuntimeError("the hook failed")

    accelerator.register_save_state_pre_hook(failing_hook)
    with pytest.raises(RuntimeError, match="the hook failed"):
        save_state(accelerator)
    assert accelerator.project_configuration.iteration == 0
    assert list((tmp_path / "checkpoints").iterdir()) == []


@pytest.mark.parametrize("name", ["back\\slash.bin", "bell\x07.bin", "C:drive.bin", "sub/new\nline.bin"])
def test_a_save_hook_file_a_load_would_refuse_is_refused_on_save(tmp_path: Path, name: str) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(2, 2))

    def hook(models: list[Any], weights: list[Any], output_dir: str) -> None:
        Path(output_dir, *name.split("/")).parent.mkdir(exist_ok=True)
        Path(output_dir, *name.split("/")).write_bytes(b"hook data")

    accelerator.register_save_state_pre_hook(hook)
    with pytest.raises(sk.UnsafePathError, match=re.escape(repr(name))):
        save_state(accelerator, tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []


def _tree_bytes(root: Path) -> dict[str, bytes | None]:
    return {
        str(path.relative_to(root)): path.read_bytes() if path.is_file() else None for path in sorted(root.rglob("*"))
    }


def test_total_limit_leaves_another_tools_checkpoint_folders_untouched(tmp_path: Path) -> None:
    """Only ``checkpoint_<N>`` folders (ASCII digits) holding a shardkeep manifest are counted
    and deleted: another tool's ``manifest.json``, or a name with other digits, is left as it is."""
    accelerator, _ = _project_accelerator(tmp_path, total_limit=2)
    checkpoints = tmp_path / "checkpoints"
    foreign = checkpoints / "checkpoint_0"
    foreign.mkdir(parents=True)
    (foreign / "manifest.json").write_text('{"tool": "another", "files": ["data.bin"]}')
    (foreign / "data.bin").write_bytes(b"another tool's data")
    sk.save({"w": torch.ones(2)}, checkpoints / "checkpoint_\u0661")  # ARABIC-INDIC DIGIT ONE
    before = {name: _tree_bytes(checkpoints / name) for name in ("checkpoint_0", "checkpoint_\u0661")}
    accelerator.project_configuration.iteration = 1
    for _ in range(3):
        save_state(accelerator)
    assert {name: _tree_bytes(checkpoints / name) for name in before} == before
    # checkpoint_1 is un-committed; its files are kept while a manifest in the root cannot be
    # read (the foreign one), as CheckpointRoot.delete keeps them.
    committed = sorted(p.name for p in checkpoints.iterdir() if (p / "manifest.json").is_file())
    assert committed == ["checkpoint_0", "checkpoint_2", "checkpoint_3", "checkpoint_\u0661"]
