"""CheckpointManager and TrainingCheckpoint on real directories: policy, pointers, resume,
fallback, run identity, configs, leftovers, async saves and injected failures."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import shardkeep as sk
from shardkeep.retention import CheckpointInfo, RetentionPolicy, decide
from shardkeep.storage.local import LocalStore
from shardkeep.testing import FaultInjectingStore, InjectedFault

torch = pytest.importorskip("torch")


def tiny(seed: int = 0) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(16, generator=generator), "step": seed}


def training_checkpoint(iteration: int = 0, lr: float = 1e-3) -> sk.TrainingCheckpoint:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return sk.TrainingCheckpoint(
        model=model,
        optimizer=optimizer,
        model_args={"d_in": 4, "d_out": 3},
        iteration=iteration,
        best_val_loss=None,
        config={"lr": lr, "schedule": {"warmup": 10}},
        ema={"weight": model.weight.detach().clone()},
        rng=sk.TrainingCheckpoint.capture_rng(),
        data_position={"epoch": 0, "batch": iteration},
    )


def on_disk(root: Path) -> list[int]:
    return sorted(
        int(p.name.split("_")[1])
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith("step_") and "." not in p.name
    )


def expected_kept(metrics: list[float | None], keep_last: int, keep_best: int, mode: str = "min") -> list[int]:
    """Replay retention after every save, as the manager does."""
    alive: list[tuple[int, float | None]] = []
    for step, metric in enumerate(metrics):
        alive.append((step, metric))
        decision = decide(
            [CheckpointInfo(f"s{s}", s, m) for s, m in alive],
            RetentionPolicy(keep_last=keep_last, keep_best=keep_best, mode=mode),  # type: ignore[arg-type]  # min/max
        )
        alive = [(s, m) for s, m in alive if f"s{s}" in decision.keep]
    return [s for s, _ in alive]


# --------------------------------------------------------------------------------------------
# TrainingCheckpoint
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"iteration": -1}, "iteration"),
        ({"iteration": True}, "iteration"),
        ({"iteration": "7"}, "iteration"),
        ({"best_val_loss": "low"}, "best_val_loss"),
        ({"model_args": [1, 2]}, "model_args"),
        ({"config": {"fn": print}}, "config"),
        ({"model": 3}, "model"),
        ({"optimizer": None}, "optimizer"),
        ({"ema": "weights"}, "ema"),
        ({"rng": [1, 2]}, "rng"),
    ],
)
def test_training_checkpoint_fields_are_checked_and_named(changes: dict[str, Any], field: str) -> None:
    good = training_checkpoint()
    fields = {name: getattr(good, name) for name in good.__dataclass_fields__} | changes
    with pytest.raises(sk.CheckpointFieldError, match=f"'{field}'") as info:
        sk.TrainingCheckpoint(**fields)
    assert info.value.field == field


def test_training_checkpoint_round_trip_through_the_manager(tmp_path: Path) -> None:
    original = training_checkpoint(iteration=5)
    original.best_val_loss = float("inf")
    manager = sk.CheckpointManager(tmp_path)
    manager.save(original, step=5)
    restored = sk.CheckpointManager(tmp_path).restore()
    loaded = restored.state
    assert isinstance(loaded, sk.TrainingCheckpoint) and restored.step == 5
    assert loaded.iteration == 5 and loaded.best_val_loss == float("inf")
    assert loaded.model_args == {"d_in": 4, "d_out": 3} and loaded.config["schedule"] == {"warmup": 10}
    assert torch.equal(loaded.model["weight"], original.model.weight)
    assert torch.equal(loaded.ema["weight"], original.ema["weight"])
    assert loaded.data_position == {"epoch": 0, "batch": 5}

    # in place: modules and optimizer are filled, plain fields replaced
    target = training_checkpoint(iteration=0)
    with torch.no_grad():
        target.model.weight.zero_()
    target.optimizer.state.clear()
    module = target.model
    result = sk.CheckpointManager(tmp_path).restore(into=target)
    assert result.state is target and target.model is module
    assert torch.equal(target.model.weight, original.model.weight)
    assert target.iteration == 5 and len(target.optimizer.state) == 2


def test_rng_states_are_restored(tmp_path: Path) -> None:
    import random

    import numpy as np

    checkpoint = training_checkpoint()
    checkpoint.track_rng = False  # the states given as rng= are saved as they are
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    manager = sk.CheckpointManager(tmp_path)
    manager.save(checkpoint, step=0)
    for _ in range(5):
        random.random(), np.random.rand(), torch.rand(1)
    loaded = sk.CheckpointManager(tmp_path).restore().state
    sk.TrainingCheckpoint.restore_rng(loaded.rng)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected


def test_by_default_each_save_records_the_rng_at_that_save_and_restore_puts_it_back(tmp_path: Path) -> None:
    import random

    import numpy as np

    checkpoint = training_checkpoint()  # rng= captured once, at the start of the run
    for _ in range(3):  # training draws from every generator
        random.random(), np.random.rand(), torch.rand(1)
    sk.CheckpointManager(tmp_path).save(checkpoint, step=3)
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    for _ in range(5):
        random.random(), np.random.rand(), torch.rand(1)
    sk.CheckpointManager(tmp_path).restore(into=checkpoint)  # no restore_rng call needed
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected


def test_track_rng_false_leaves_the_generators_alone_on_restore(tmp_path: Path) -> None:
    checkpoint = training_checkpoint()
    checkpoint.track_rng = False
    sk.CheckpointManager(tmp_path).save(checkpoint, step=0)
    torch.manual_seed(123)
    expected = torch.rand(1)
    torch.manual_seed(123)
    sk.CheckpointManager(tmp_path).restore(into=checkpoint)
    assert torch.equal(torch.rand(1), expected)
    with pytest.raises(sk.CheckpointFieldError, match="track_rng"):
        sk.TrainingCheckpoint(
            model=checkpoint.model,
            optimizer=checkpoint.optimizer,
            model_args={},
            iteration=0,
            best_val_loss=None,
            config={},
            track_rng="yes",  # type: ignore[arg-type]
        )


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda s: s.update(iteration="ten"), "iteration"),
        (lambda s: s.pop("config"), "config"),
        (lambda s: s.update(surprise=1), "surprise"),
        (lambda s: s.update(schema="someone.else/9"), "schema"),
        (lambda s: s.update(model=[1, 2]), "model"),
    ],
)
def test_a_bad_saved_field_is_refused_on_load_naming_it(tmp_path: Path, mutate: Any, field: str) -> None:
    state = training_checkpoint().to_state()
    mutate(state)
    sk.save(state, tmp_path / "step_00000001", step=1)
    target = training_checkpoint()
    weight = target.model.weight.detach().clone()
    for into in (None, target):
        with pytest.raises(sk.CheckpointFieldError, match=f"'{field}'"):
            sk.CheckpointManager(tmp_path).restore(into=into) if field != "schema" or into is not None else (
                _raise_field_error(sk.CheckpointManager(tmp_path).restore())
            )
    assert torch.equal(target.model.weight, weight)  # refused before anything was modified


def _raise_field_error(restored: sk.Restored) -> None:
    # A state whose schema is not ours loads as a plain dict; asking for a TrainingCheckpoint fails.
    assert isinstance(restored.state, dict)
    sk.TrainingCheckpoint.from_state(restored.state)


# --------------------------------------------------------------------------------------------
# Policy
# --------------------------------------------------------------------------------------------

METRICS: list[float | None] = [None, 5.0, 3.0, 4.0, 1.0, 2.0, 6.0, 1.0]


@pytest.mark.parametrize(
    ("keep_last", "keep_best"), [(0, 0), (0, 1), (0, 2), (1, 0), (2, 0), (1, 1), (2, 1), (1, 3), (3, 2)]
)
def test_every_policy_combination_on_disk(tmp_path: Path, keep_last: int, keep_best: int) -> None:
    manager = sk.CheckpointManager(tmp_path, keep_last=keep_last, keep_best=keep_best)
    for step, metric in enumerate(METRICS):
        entry = manager.save(tiny(step), step=step, metrics=None if metric is None else {"val_loss": metric})
        assert entry.is_newest and entry.verified is True
        assert on_disk(tmp_path) == expected_kept(METRICS[: step + 1], keep_last, keep_best)
    kept = on_disk(tmp_path)
    # exactly the policy: keep_last newest, keep_best best (ties: the older), the newest always
    best = sorted((m, s) for s, m in enumerate(METRICS) if m is not None)[:keep_best]
    assert set(kept) == set(range(8)[-keep_last:] if keep_last else []) | {s for _, s in best} | {7}
    entries = manager.list()
    assert [e.step for e in entries if e.is_last] == sorted(range(8))[8 - keep_last :]
    assert sorted(e.step for e in entries if e.is_best) == sorted(s for _, s in best)
    best_entry = manager.best()
    if keep_best:
        assert best_entry is not None and best_entry.step == 4 and best_entry.metric == 1.0  # ties keep the older
    else:
        assert best_entry is None
    assert json.loads((tmp_path / "last").read_text())["checkpoint"] == "step_00000007"
    assert (tmp_path / "best").exists() == bool(keep_best)


def test_first_checkpoint_is_last_and_best_and_stored_once(tmp_path: Path) -> None:
    manager = sk.CheckpointManager(tmp_path, keep_last=1, keep_best=1)
    entry = manager.save(tiny(), step=0)
    assert entry.is_last and entry.is_best and entry.metric is None
    assert on_disk(tmp_path) == [0]
    for pointer in ("last", "best"):
        path = tmp_path / pointer
        assert path.is_file() and not path.is_symlink()
        assert json.loads(path.read_text())["checkpoint"] == "step_00000000"
    # an improving save is both last and best: one directory, two pointers
    entry = manager.save(tiny(1), step=10, metrics={"val_loss": 0.5})
    assert entry.is_last and entry.is_best and on_disk(tmp_path) == [10]


def test_max_mode(tmp_path: Path) -> None:
    manager = sk.CheckpointManager(tmp_path, keep_last=1, keep_best=1, metric="acc", mode="max")
    for step, acc in enumerate([0.1, 0.9, 0.5]):
        manager.save(tiny(step), step=step, metrics={"acc": acc, "val_loss": 1.0})
    assert on_disk(tmp_path) == [1, 2]
    best = manager.best()
    assert best is not None and best.step == 1 and best.metrics == {"acc": 0.9, "val_loss": 1.0}


def test_resume_after_restart_enforces_the_same_policy(tmp_path: Path) -> None:
    first = sk.CheckpointManager(tmp_path, keep_last=2, keep_best=1)
    for step, metric in [(0, 3.0), (1, 1.0), (2, 2.0), (3, 2.5)]:
        first.save(tiny(step), step=step, metrics={"val_loss": metric})
    assert on_disk(tmp_path) == [1, 2, 3]
    del first
    second = sk.CheckpointManager(tmp_path, keep_last=2, keep_best=1)
    restored = second.restore()
    assert restored.step == 3 and second.run_id is not None
    second.save(tiny(4), step=4, metrics={"val_loss": 9.0})
    # step 1 is still the best: its metric came from its manifest, not from memory
    assert on_disk(tmp_path) == [1, 3, 4]
    second.save(tiny(5), step=5, metrics={"val_loss": 0.5})
    assert on_disk(tmp_path) == [4, 5]
    best = second.best()
    assert best is not None and best.step == 5


# --------------------------------------------------------------------------------------------
# Restore and fallback
# --------------------------------------------------------------------------------------------


def data_file(checkpoint: Path) -> Path:
    return next(p for p in sorted(checkpoint.rglob("*.safetensors")))


def test_corrupt_newest_falls_back_to_the_previous_with_a_warning(
    tmp_path: Path, caplog: Any, flip_bit: Callable[[Path, int, int], None]
) -> None:
    manager = sk.CheckpointManager(tmp_path, keep_last=3, keep_best=0)
    for step in range(3):
        manager.save(tiny(step), step=step)
    flip_bit(data_file(tmp_path / "step_00000002"), os.path.getsize(data_file(tmp_path / "step_00000002")) - 3, 0)
    with caplog.at_level(logging.WARNING, logger="shardkeep"):
        restored = sk.CheckpointManager(tmp_path).restore()
    assert restored.step == 1 and [name for name, _ in restored.skipped] == ["step_00000002"]
    assert torch.equal(restored.state["w"], tiny(1)["w"])
    assert "step_00000002" in caplog.text and "falling back" in caplog.text
    latest = manager.latest(verify=True)
    assert latest is not None and latest.step == 1

    # every checkpoint corrupt: an error, never a silent fresh start
    for step in (0, 1):
        (data_file(tmp_path / f"step_{step:08d}")).write_bytes(b"garbage")
    with pytest.raises(sk.IntegrityError, match=r"no checkpoint .* verifies"):
        sk.CheckpointManager(tmp_path).restore()


def test_saving_over_a_corrupt_step_moves_it_aside(
    tmp_path: Path, caplog: Any, flip_bit: Callable[[Path, int, int], None]
) -> None:
    manager = sk.CheckpointManager(tmp_path, keep_last=2, keep_best=0)
    manager.save(tiny(0), step=0)
    manager.save(tiny(1), step=1)
    flip_bit(data_file(tmp_path / "step_00000001"), os.path.getsize(data_file(tmp_path / "step_00000001")) - 5, 1)
    resumed = sk.CheckpointManager(tmp_path, keep_last=2, keep_best=0)
    assert resumed.restore().step == 0
    with caplog.at_level(logging.WARNING, logger="shardkeep"):
        resumed.save(tiny(11), step=1)
    assert "moved it to" in caplog.text
    aside = [p.name for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    assert len(aside) == 1 and aside[0].startswith("step_00000001")
    assert sk.verify(tmp_path / "step_00000001").ok
    # a valid checkpoint is never replaced
    with pytest.raises(sk.CheckpointExistsError, match="step_00000001"):
        resumed.save(tiny(12), step=1)


def test_restore_of_an_empty_root_raises(tmp_path: Path) -> None:
    with pytest.raises(sk.CheckpointNotFoundError, match="no checkpoints"):
        sk.CheckpointManager(tmp_path).restore()


def test_restore_a_given_step(tmp_path: Path) -> None:
    manager = sk.CheckpointManager(tmp_path, keep_last=3)
    for step in range(3):
        manager.save(tiny(step), step=step)
    assert manager.restore(step=1).step == 1
    with pytest.raises(sk.CheckpointNotFoundError, match="step 7"):
        manager.restore(step=7)


# --------------------------------------------------------------------------------------------
# Run identity and fingerprint
# --------------------------------------------------------------------------------------------


def test_a_root_owned_by_another_run_is_refused(tmp_path: Path) -> None:
    owner = sk.CheckpointManager(tmp_path, keep_last=1, keep_best=0)
    owner.save(tiny(0), step=0)
    intruder = sk.CheckpointManager(tmp_path, keep_last=1, keep_best=0)
    with pytest.raises(sk.RunMismatchError, match="belongs to run") as info:
        intruder.save(tiny(1), step=1)
    assert owner.run_id is not None and owner.run_id in str(info.value)
    with pytest.raises(sk.RunMismatchError):
        sk.CheckpointManager(tmp_path, run_id="someone-else").save(tiny(1), step=1)
    with pytest.raises(sk.RunMismatchError, match="before pruning"):
        sk.CheckpointManager(tmp_path, keep_last=0, keep_best=0).prune()
    assert on_disk(tmp_path) == [0]

    # told to: it writes beside the other run and never deletes the other run's checkpoints
    beside = sk.CheckpointManager(tmp_path, keep_last=1, keep_best=0, allow_other_runs=True, run_id="second")
    beside.save(tiny(1), step=1)
    beside.save(tiny(2), step=2)
    assert on_disk(tmp_path) == [0, 2]
    assert {e.run_id for e in beside.list()} == {owner.run_id, "second"}
    # the original run resumes its own checkpoints, not the newer ones of the other run
    resumed = sk.CheckpointManager(tmp_path, run_id=owner.run_id, allow_other_runs=True)
    assert resumed.restore().step == 0


def test_changed_fingerprint_is_refused_with_a_field_diff(tmp_path: Path) -> None:
    sk.CheckpointManager(tmp_path).save(training_checkpoint(lr=1e-3), step=0)
    changed = training_checkpoint(lr=3e-4)
    changed.model_args = {"d_in": 4, "d_out": 3, "bias": False}
    with pytest.raises(sk.FingerprintMismatchError) as info:
        sk.CheckpointManager(tmp_path).restore(into=changed)
    assert ("config.lr", "0.001", "0.0003") in info.value.differences
    assert ("model_args.bias", "<absent>", "false") in info.value.differences
    assert "config.lr: checkpoint 0.001, now 0.0003" in str(info.value)
    assert changed.iteration == 0  # nothing was loaded
    restored = sk.CheckpointManager(tmp_path).restore(into=changed, allow_fingerprint_change=True)
    assert restored.step == 0

    # plain mappings use the manager's fingerprint=
    plain = tmp_path / "plain"
    sk.CheckpointManager(plain, fingerprint={"layers": 2}).save(tiny(), step=0)
    with pytest.raises(sk.FingerprintMismatchError, match="layers: checkpoint 2, now 3"):
        sk.CheckpointManager(plain, fingerprint={"layers": 3}).restore()
    assert sk.read_manifest(plain / "step_00000000").run.fingerprint_fields == {"layers": 2}  # type: ignore[union-attr]  # set by the manager


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"keep": {"last": -1}}, r"checkpointing\.keep\.last=-1"),
        ({"keep": {"best": 1.5}}, r"checkpointing\.keep\.best=1\.5"),
        ({"keep": {"best": True}}, r"checkpointing\.keep\.best=True"),
        ({"keep": {"last": "2"}}, r"checkpointing\.keep\.last='2'"),
        ({"keep": {"lats": 2}}, r"checkpointing\.keep\.lats: unknown key"),
        ({"keep_last": 2}, r"checkpointing\.keep_last: unknown key"),
        ({"keep": 3}, r"checkpointing\.keep must be a mapping"),
        ({"mode": "lowest"}, r"checkpointing\.mode='lowest'"),
        ({"metric": ""}, r"checkpointing\.metric=''"),
        ({"keep": {"period": 0}}, r"checkpointing\.keep\.period=0"),
        ({"keep": {"period": "10"}}, r"checkpointing\.keep\.period='10'"),
        ({"keep": {"interval_seconds": -5}}, r"checkpointing\.keep\.interval_seconds=-5"),
        ({"keep": {"interval_seconds": True}}, r"checkpointing\.keep\.interval_seconds=True"),
        ({"keep": {"fn": "mod.f"}}, r"checkpointing\.keep\.fn: unknown key"),
        ([1], "must be a mapping"),
    ],
)
def test_bad_configs_name_the_key_and_value(tmp_path: Path, config: Any, message: str) -> None:
    with pytest.raises(sk.ConfigError, match=message):
        sk.CheckpointManager.from_config(tmp_path, config)


def test_configs_from_a_dict_and_from_yaml(tmp_path: Path) -> None:
    manager = sk.CheckpointManager.from_config(tmp_path / "a", {"keep": {"last": 3, "best": 0}})
    assert (manager.policy.keep_last, manager.policy.keep_best) == (3, 0)
    section = tmp_path / "checkpointing.yaml"
    section.write_text("keep:\n  last: 2\n  best: 4\nmetric: val_acc\nmode: max\n")
    manager = sk.CheckpointManager.from_config(tmp_path / "b", section)
    assert manager.policy == RetentionPolicy(keep_last=2, keep_best=4, metric="val_acc", mode="max")
    runtime = tmp_path / "runtime.yaml"
    runtime.write_text("model:\n  layers: 4\ncheckpointing:\n  keep:\n    last: 0\n    best: 1\n")
    manager = sk.CheckpointManager.from_config(tmp_path / "c", runtime)
    assert (manager.policy.keep_last, manager.policy.keep_best) == (0, 1)
    duplicate = tmp_path / "dup.yaml"
    duplicate.write_text("keep:\n  last: 1\n  last: 5\n")
    with pytest.raises(sk.ConfigError, match="duplicate key 'last'"):
        sk.CheckpointManager.from_config(tmp_path / "d", duplicate)
    broken = tmp_path / "broken.yaml"
    broken.write_text("keep: [1,\n")
    with pytest.raises(sk.ConfigError, match="invalid YAML"):
        sk.CheckpointManager.from_config(tmp_path / "e", broken)
    with pytest.raises(sk.ConfigError, match="cannot read"):
        sk.CheckpointManager.from_config(tmp_path / "f", tmp_path / "missing.yaml")


def test_configs_carry_keep_period_and_interval_to_the_manager(tmp_path: Path) -> None:
    section = tmp_path / "checkpointing.yaml"
    section.write_text("keep:\n  last: 1\n  best: 0\n  period: 2\n  interval_seconds: 86400\n")
    manager = sk.CheckpointManager.from_config(tmp_path / "root", section)
    assert manager.policy == RetentionPolicy(keep_last=1, keep_best=0, keep_period=2, keep_interval_seconds=86400)
    off = sk.CheckpointManager.from_config(tmp_path / "off", {"keep": {"period": None, "interval_seconds": None}})
    assert (off.policy.keep_period, off.policy.keep_interval_seconds) == (None, None)
    manager = sk.CheckpointManager.from_config(tmp_path / "saved", {"keep": {"last": 1, "best": 0, "period": 2}})
    for step in range(1, 6):
        manager.save({"w": torch.full((2,), float(step))}, step=step)
    # keep_last=1 keeps step 5, keep_period=2 keeps 2 and 4; 1 and 3 are pruned
    assert [entry.step for entry in manager.list()] == [2, 4, 5]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"keep_last": -2}, "keep_last=-2"),
        ({"keep_best": "1"}, "keep_best='1'"),
        ({"mode": "up"}, "mode='up'"),
        ({"run_id": "../x"}, "run_id='../x'"),
        ({"compresion": "zstd"}, "unknown option"),
        ({"staging_lease": -1}, "staging_lease=-1"),
    ],
)
def test_bad_manager_arguments(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(sk.ConfigError, match=message):
        sk.CheckpointManager(tmp_path, **kwargs)


def test_bad_save_arguments(tmp_path: Path) -> None:
    manager = sk.CheckpointManager(tmp_path)
    with pytest.raises(sk.ConfigError, match="step=-1"):
        manager.save(tiny(), step=-1)
    with pytest.raises(sk.ConfigError, match="metrics has no 'val_loss'"):
        manager.save(tiny(), step=1, metrics={"val-loss": 1.0})
    with pytest.raises(sk.UnsupportedValueError, match="'val_loss'='low'"):
        manager.save(tiny(), step=1, metrics={"val_loss": "low"})
    assert on_disk(tmp_path) == []
    manager.save(tiny(), step=1, metrics={"val_loss": float("nan")})  # recorded as null
    assert sk.read_manifest(tmp_path / "step_00000001").metrics == {"val_loss": None}


# --------------------------------------------------------------------------------------------
# Leftovers
# --------------------------------------------------------------------------------------------


def test_leftovers_are_collected_after_their_lease_only(tmp_path: Path) -> None:
    manager = sk.CheckpointManager(tmp_path, staging_lease=600)
    old = tmp_path / f"step_00000005.tmp-{'0123abcd' * 4}"
    (old / "shards").mkdir(parents=True)
    (old / "shards" / "rank_00000.safetensors").write_bytes(b"x" * 10)
    stamp = time.time() - 3600
    for path in (old / "shards" / "rank_00000.safetensors", old / "shards", old):
        os.utime(path, (stamp, stamp))
    fresh = tmp_path / f"step_00000006.tmp-{'4567cdef' * 4}"
    fresh.mkdir()
    deleting = tmp_path / f"step_00000001.deleting-{'89ab' * 8}"
    (deleting / "x").mkdir(parents=True)
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("precious")
    link = tmp_path / f"step_00000007.tmp-{'1234abcd' * 4}"
    os.symlink(outside, link)
    os.utime(link, (stamp, stamp), follow_symlinks=False)
    manager.save(tiny(), step=0)
    assert not old.exists() and not deleting.exists() and fresh.exists()
    assert (outside / "keep.txt").read_text() == "precious"  # a symlink is removed, never followed
    assert not os.path.lexists(link)


# --------------------------------------------------------------------------------------------
# Async saves
# --------------------------------------------------------------------------------------------


def test_async_save_runs_retention_after_the_commit(tmp_path: Path) -> None:
    manager = sk.CheckpointManager(tmp_path, keep_last=1, keep_best=0)
    manager.save(tiny(0), step=0)
    state = tiny(1)
    pending = manager.async_save(state, step=1, metrics={"val_loss": 1.0})
    state["w"].zero_()  # the snapshot was taken: training may go on
    entry = pending.result(timeout=60)
    assert entry.step == 1 and entry.is_last and entry.verified is True
    assert on_disk(tmp_path) == [1]
    assert torch.equal(sk.load(tmp_path / "step_00000001")["w"], tiny(1)["w"])
    second = manager.async_save(tiny(2), step=2)
    assert manager.list()[-1].step == 2  # list() waits for the pending save
    assert second.done() and on_disk(tmp_path) == [2]


def test_a_failed_async_save_deletes_nothing(tmp_path: Path) -> None:
    LocalStore(tmp_path)
    counting = FaultInjectingStore(LocalStore(tmp_path))
    sk.CheckpointManager(tmp_path, storage=counting, keep_last=1, keep_best=0).save(tiny(0), step=0)
    failing = FaultInjectingStore(LocalStore(tmp_path), fail_at=1_000_000)
    manager = sk.CheckpointManager(tmp_path, storage=failing, keep_last=1, keep_best=0)
    manager.restore()
    failing._counter.fail_at = failing.operation_count + 12  # inside the background write
    pending = manager.async_save(tiny(1), step=1)
    with pytest.raises(InjectedFault):
        pending.result(timeout=60)
    assert on_disk(tmp_path) == [0] and sk.verify(tmp_path / "step_00000000").ok


# --------------------------------------------------------------------------------------------
# Injected I/O errors at every operation of a managed save
# --------------------------------------------------------------------------------------------


def _seeded_root(template: Path) -> str:
    manager = sk.CheckpointManager(template, keep_last=1, keep_best=1, run_id="run-a")
    for step, metric in [(0, 2.0), (1, 1.0), (2, 3.0)]:
        manager.save(tiny(step), step=step, metrics={"val_loss": metric})
    assert on_disk(template) == [1, 2]
    return "run-a"


def test_an_io_error_at_every_operation_of_a_managed_save(tmp_path: Path) -> None:
    template = tmp_path / "template"
    run_id = _seeded_root(template)
    probe_root = tmp_path / "probe"
    shutil.copytree(template, probe_root)
    counting = FaultInjectingStore(LocalStore(probe_root))
    sk.CheckpointManager(probe_root, storage=counting, keep_last=1, keep_best=1, run_id=run_id).save(
        tiny(3), step=3, metrics={"val_loss": 0.5}
    )
    total = counting.operation_count
    assert total > 20
    outcomes = {"save failed": 0, "retention failed": 0, "absorbed": 0}
    for fail_at in range(1, total + 1):
        root = tmp_path / f"trial-{fail_at}"
        shutil.copytree(template, root)
        store = FaultInjectingStore(LocalStore(root), fail_at=fail_at)
        manager = sk.CheckpointManager(root, storage=store, keep_last=1, keep_best=1, run_id=run_id)
        try:
            manager.save(tiny(3), step=3, metrics={"val_loss": 0.5})
        except sk.RetentionError as exc:
            outcomes["retention failed"] += 1
            assert "committed" in str(exc)
            assert sk.verify(root / "step_00000003").ok
        except sk.ShardkeepError:
            outcomes["save failed"] += 1
            assert not (root / "step_00000003").exists()
            assert on_disk(root) == [1, 2]  # nothing deleted before a durable commit
        else:
            # a failed read during the full verification of the new checkpoint makes it count as
            # unverified: then nothing older may be deleted
            outcomes["absorbed"] += 1
            assert sk.verify(root / "step_00000003").ok and on_disk(root) == [1, 2, 3]
        # whatever happened, every committed checkpoint verifies, and a fresh manager heals the root
        for step in on_disk(root):
            assert sk.verify(root / f"step_{step:08d}").ok
        healer = sk.CheckpointManager(root, keep_last=1, keep_best=1, run_id=run_id, staging_lease=0)
        healer.prune()
        assert on_disk(root) == ([3] if (root / "step_00000003").exists() else [1, 2])
        assert not [p for p in root.iterdir() if ".tmp-" in p.name or ".deleting-" in p.name]
        shutil.rmtree(root)
    assert outcomes["save failed"] > 0 and outcomes["retention failed"] > 0


def test_a_step_below_a_valid_newer_checkpoint_is_refused(tmp_path: Path) -> None:
    manager = sk.CheckpointManager(tmp_path, keep_last=1, keep_best=1)
    for step, loss in [(100, 1.0), (200, 0.5), (300, 0.9)]:
        manager.save(tiny(step), step=step, metrics={"val_loss": loss})
    assert manager.restore(step=200).step == 200
    with pytest.raises(sk.CheckpointExistsError, match="newer checkpoint that verifies, step_00000300"):
        manager.save(tiny(250), step=250, metrics={"val_loss": 0.7})
    assert on_disk(tmp_path) == [200, 300]
    with pytest.raises(sk.ConfigError, match="step=-1"):
        manager.restore(step=-1)


def test_pointers_name_the_new_checkpoint_even_when_retention_fails_to_delete(tmp_path: Path) -> None:
    class NoDeleting(LocalStore):
        def rename(self, source: str, destination: str) -> None:
            if ".deleting-" in destination:
                raise sk.StorageError(f"{source}: injected EIO while deleting")
            super().rename(source, destination)

    manager = sk.CheckpointManager(tmp_path, storage=NoDeleting(tmp_path), keep_last=1, keep_best=1)
    manager.save(tiny(1), step=1, metrics={"val_loss": 2.0})
    with pytest.raises(sk.RetentionError, match="injected EIO"):
        manager.save(tiny(2), step=2, metrics={"val_loss": 1.0})
    with pytest.raises(sk.RetentionError, match="injected EIO"):
        manager.save(tiny(3), step=3, metrics={"val_loss": 0.5})
    for pointer in ("last", "best"):
        assert json.loads((tmp_path / pointer).read_text())["checkpoint"] == "step_00000003", pointer


def test_restoring_a_checkpoint_without_rng_states_leaves_the_generators_alone(tmp_path: Path) -> None:
    checkpoint = training_checkpoint()
    checkpoint.track_rng = False
    checkpoint.rng = None
    sk.CheckpointManager(tmp_path).save(checkpoint, step=0)  # holds no RNG states
    torch.manual_seed(5)
    early = sk.TrainingCheckpoint.capture_rng()  # what into.rng holds: not from the checkpoint
    target = training_checkpoint()
    target.rng = early
    torch.manual_seed(123)
    expected = torch.rand(1)
    torch.manual_seed(123)
    sk.CheckpointManager(tmp_path).restore(into=target)
    assert torch.equal(torch.rand(1), expected)


def test_a_failing_keep_fn_fails_retention_not_the_commit(tmp_path: Path) -> None:
    def broken(info: CheckpointInfo) -> bool:
        raise ValueError("bad tag")

    manager = sk.CheckpointManager(tmp_path, keep_last=1, keep_best=0)
    manager.policy = RetentionPolicy(keep_last=1, keep_best=0, keep_fn=broken)
    with pytest.raises(sk.RetentionError, match="keep_fn raised ValueError") as raised:
        manager.save(tiny(1), step=1)
    assert isinstance(raised.value.__cause__, sk.ConfigError)
    assert sk.verify(tmp_path / "step_00000001").ok  # committed all the same


def test_keep_fn_keeps_what_it_chooses_through_the_manager(tmp_path: Path) -> None:
    manager = sk.CheckpointManager(tmp_path, keep_last=1, keep_best=0)
    manager.policy = RetentionPolicy(keep_last=1, keep_best=0, keep_fn=lambda info: info.step in (2, 3))
    for step in range(1, 6):
        manager.save(tiny(step), step=step)
    assert [entry.step for entry in manager.list()] == [2, 3, 5]
