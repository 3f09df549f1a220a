"""shardkeep.lightning.ShardkeepCheckpointIO: conversions, the atomic replacement of a checkpoint
saved over the same path, removal, loading, and Lightning training runs (resume, top-k, DDP)."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import pathlib
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("lightning.pytorch")

import shardkeep as sk  # noqa: E402
import shardkeep.lightning as skl  # noqa: E402
from shardkeep.lightning import RESERVED_KEY, ShardkeepCheckpointIO  # noqa: E402

pytestmark = [
    # Lightning 2.6.6 with torch 2.13 warns on every fit from its own code.
    pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings(r"ignore:The '\w+_dataloader' does not have many workers"),
    pytest.mark.filterwarnings(r"ignore:The number of training batches \(\d+\) is smaller than the logging interval"),
]


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def assert_same(actual: Any, expected: Any, where: str = "") -> None:
    """Equal values of exactly the same types, all the way down (tensors bit for bit)."""
    assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert torch.equal(actual, expected) or (actual.isnan() == expected.isnan()).all(), where
    elif isinstance(expected, np.ndarray):
        assert actual.dtype == expected.dtype and np.array_equal(actual, expected), where
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), where
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}.{key}")
        if hasattr(expected, "_metadata"):
            assert actual._metadata == expected._metadata, where
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{where}[{index}]")
    elif isinstance(expected, float) and math.isnan(expected):
        assert math.isnan(actual), where
    elif isinstance(expected, argparse.Namespace):
        assert_same(vars(actual), vars(expected), where)
    else:
        assert actual == expected, where


def tricky_checkpoint() -> dict[str, Any]:
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    from lightning.fabric.utilities.data import AttributeDict

    return {
        "epoch": 3,
        "global_step": 40,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": model.state_dict(),  # an OrderedDict with _metadata
        "optimizer_states": [optimizer.state_dict()],  # int keys, a tuple of betas
        "lr_schedulers": [{"last_epoch": 2, "_last_lr": [0.1], "milestones": collections.Counter({2: 1, 5: 1})}],
        "callbacks": {
            "EarlyStopping{'monitor': 'val_loss', 'mode': 'min'}": {
                "wait_count": 1,
                "best_score": torch.tensor(math.inf),
            }
        },
        "hyper_parameters": {
            "lr": 1e-3,
            "data": pathlib.PurePosixPath("/data/train"),
            "out": pathlib.Path("runs/1"),
            "tags": {"a", "b"},
            "frozen": frozenset({1, 2}),
            "blob": b"\x00\xffbytes",
            "buffer": bytearray(b"xy"),
            "z": 1 + 2j,
            "big": 1 << 80,
            "scale": np.float32(0.25),
            "flag": np.bool_(True),
            "dtype": torch.bfloat16,
            "device": torch.device("cpu"),
            "args": argparse.Namespace(layers=2, names=("x", "y")),
            "nested": AttributeDict(inner=AttributeDict(k=1)),
            "limits": (float("inf"), float("-inf"), float("nan")),
            "by_id": {0: "zero", 7: [1, 2]},
        },
        "hparams_name": "kwargs",
    }


# ---------------------------------------------------------------------------------------------
# conversions
# ---------------------------------------------------------------------------------------------


def test_lightning_values_round_trip_with_their_types(tmp_path: Path) -> None:
    checkpoint = tricky_checkpoint()
    checkpoint["lr_schedulers"][0].pop("milestones")  # a Counter is refused (see below)
    io = ShardkeepCheckpointIO()
    target = tmp_path / "epoch=3-step=40.ckpt"
    io.save_checkpoint(checkpoint, target)
    assert sk.verify(target).ok
    assert io.last_manifest is not None and io.last_manifest.step == 40
    loaded = io.load_checkpoint(target)
    assert RESERVED_KEY not in loaded
    assert_same(loaded, checkpoint)
    assert list(loaded["optimizer_states"][0]["state"]) == [0, 1, 2, 3]
    # every tensor went to safetensors, none into the manifest
    assert any(p.suffix == ".safetensors" for p in target.rglob("*"))


@dataclasses.dataclass
class Config:
    width: int = 3


@pytest.mark.parametrize(
    ("value", "where"),
    [
        (Config(), "hyper_parameters.config"),
        (collections.Counter({2: 1}), "hyper_parameters.config"),
        (int, "hyper_parameters.config"),
        ({("a", 1): 2}, "hyper_parameters.config"),
        (lambda: 1, "hyper_parameters.config"),
    ],
)
def test_unsupported_values_are_refused_by_key(tmp_path: Path, value: Any, where: str) -> None:
    checkpoint = {"epoch": 0, "hyper_parameters": {"config": value}}
    with pytest.raises(sk.UnsupportedValueError, match=re_escape(where)):
        ShardkeepCheckpointIO().save_checkpoint(checkpoint, tmp_path / "x.ckpt")
    assert os.listdir(tmp_path) == []


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


def test_reserved_key_and_storage_options_are_refused(tmp_path: Path) -> None:
    io = ShardkeepCheckpointIO()
    with pytest.raises(sk.UnsupportedValueError, match=RESERVED_KEY):
        io.save_checkpoint({RESERVED_KEY: 1}, tmp_path / "a.ckpt")
    with pytest.raises(sk.ConfigError, match="storage_options"):
        io.save_checkpoint({"epoch": 0}, tmp_path / "a.ckpt", storage_options={"x": 1})
    with pytest.raises(sk.UnsupportedValueError, match="local paths only"):
        io.save_checkpoint({"epoch": 0}, "s3://bucket/a.ckpt")
    with pytest.raises(sk.ConfigError, match="process_group"):
        ShardkeepCheckpointIO(save_options={"process_group": None})


def test_map_location(tmp_path: Path) -> None:
    io = ShardkeepCheckpointIO()
    target = tmp_path / "m.ckpt"
    weights = torch.arange(6.0).reshape(2, 3)
    io.save_checkpoint({"state_dict": collections.OrderedDict(w=weights), "optimizer_states": []}, target)
    for location in (None, "cpu", torch.device("cpu"), {"cuda:0": "cpu"}, {"cpu": "cpu"}):
        loaded = io.load_checkpoint(target, map_location=location)
        assert loaded["state_dict"]["w"].device.type == "cpu" and torch.equal(loaded["state_dict"]["w"], weights)
    meta = io.load_checkpoint(target, map_location="meta")  # a real move, on a machine without GPUs
    assert meta["state_dict"]["w"].device.type == "meta" and meta["state_dict"]["w"].shape == (2, 3)
    assert type(meta["state_dict"]) is collections.OrderedDict
    assert io.load_checkpoint(target, map_location={"cpu": "meta"})["state_dict"]["w"].is_meta
    calls: list[str] = []

    def relocate(storage: Any, location: str) -> Any:
        calls.append(location)
        return storage.clone()

    moved = io.load_checkpoint(target, map_location=relocate)["state_dict"]["w"]
    assert calls == ["cpu"] and torch.equal(moved, weights)
    assert io.load_checkpoint(target, map_location=lambda storage, location: storage)["state_dict"]["w"].sum() == 15


def test_signed_and_compressed_checkpoints(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    io = ShardkeepCheckpointIO(signer=key, public_key=key.public_key(), compression="zstd", digest="sha256")
    target = tmp_path / "s.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.zeros(64)}, "epoch": 0}, target)
    assert (target / "manifest.sig").is_file()
    assert sk.read_manifest(target).files[0].compression.codec == "zstd"
    assert torch.equal(io.load_checkpoint(target)["state_dict"]["w"], torch.zeros(64))
    unsigned = tmp_path / "u.ckpt"
    ShardkeepCheckpointIO().save_checkpoint({"epoch": 0}, unsigned)
    with pytest.raises(sk.SignatureError):
        io.load_checkpoint(unsigned)


def test_load_verifies_digests_and_refuses_files(tmp_path: Path) -> None:
    io = ShardkeepCheckpointIO()
    target = tmp_path / "d.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(1000)}}, target)
    shard = next(p for p in target.rglob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(sk.IntegrityError):
        io.load_checkpoint(target)
    plain = tmp_path / "torch.ckpt"
    torch.save({"w": torch.ones(1)}, plain)
    with pytest.raises(sk.UnsupportedValueError, match="never unpickles"):
        io.load_checkpoint(plain)
    with pytest.raises(sk.CheckpointNotFoundError):
        io.load_checkpoint(tmp_path / "missing.ckpt")


# ---------------------------------------------------------------------------------------------
# atomic replacement of the same path (last.ckpt)
# ---------------------------------------------------------------------------------------------


def value_at(target: Path) -> float:
    return float(ShardkeepCheckpointIO().load_checkpoint(target)["state_dict"]["w"][0])


def state(value: float) -> dict[str, Any]:
    return {"state_dict": {"w": torch.full((256,), value)}, "epoch": int(value)}


def entries(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def exchange_supported(directory: Path) -> bool:
    a, b = directory / "probe_a", directory / "probe_b"
    a.mkdir()
    b.mkdir()
    try:
        skl.exchange(str(a), str(b))
        return True
    except skl.ExchangeUnsupported:
        return False
    finally:
        a.rmdir()
        b.rmdir()


def test_overwrite_swaps_atomically_and_a_complete_checkpoint_is_always_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not exchange_supported(tmp_path):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not supported on this filesystem")
    target = tmp_path / "last.ckpt"
    io = ShardkeepCheckpointIO()
    io.save_checkpoint(state(1), target)
    steps: list[str] = []
    real_exchange, real_remove = skl.exchange, skl._remove_tree

    def checked(name: str, function: Any) -> Any:
        def run(*args: Any) -> Any:
            assert sk.verify(target).ok, f"before {name}"  # the old or the new one, whole
            steps.append(name)
            result = function(*args)
            assert sk.verify(target).ok, f"after {name}"
            return result

        return run

    monkeypatch.setattr(skl, "exchange", checked("exchange", real_exchange))
    monkeypatch.setattr(skl, "_remove_tree", checked("remove", real_remove))
    for value in (2, 3):
        io.save_checkpoint(state(value), target)
        assert value_at(target) == value
    assert steps == ["exchange", "remove"] * 2
    assert entries(tmp_path) == ["last.ckpt"]


def test_crash_after_the_swap_leaves_the_new_checkpoint_and_the_next_save_cleans_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "last.ckpt"
    io = ShardkeepCheckpointIO()
    io.save_checkpoint(state(1), target)

    def crash(path: str) -> None:
        raise KeyboardInterrupt("killed while removing the old checkpoint")

    monkeypatch.setattr(skl, "_remove_tree", crash)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint(state(2), target)
    monkeypatch.undo()
    assert value_at(target) == 2 and sk.verify(target).ok
    leftovers = [name for name in entries(tmp_path) if name != "last.ckpt"]
    assert len(leftovers) == 1 and leftovers[0].startswith(".sk-")
    # Lightning's search for last*.ckpt files never sees a leftover
    assert "last" not in leftovers[0]
    io.save_checkpoint(state(3), target)
    assert entries(tmp_path) == ["last.ckpt"] and value_at(target) == 3


def test_crash_inside_shardkeep_save_leaves_the_old_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "last.ckpt"
    io = ShardkeepCheckpointIO()
    io.save_checkpoint(state(1), target)
    # what a kill -9 inside shardkeep.save leaves: a staging directory beside the target
    staging = tmp_path / f"{skl._tag('last.ckpt')}new-0123.tmp-abcd"
    (staging / "shards").mkdir(parents=True)
    (staging / "shards" / "rank_00000.safetensors").write_bytes(b"partial")
    assert value_at(target) == 1
    io.save_checkpoint(state(2), target)
    assert entries(tmp_path) == ["last.ckpt"] and value_at(target) == 2
    # a save that fails removes its own staging directory and leaves the old checkpoint
    with pytest.raises(sk.UnsupportedValueError):
        io.save_checkpoint({"state_dict": {"w": object()}}, target)
    assert entries(tmp_path) == ["last.ckpt"] and value_at(target) == 2


def test_fallback_two_renames_and_repair_of_a_crash_between_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "last.ckpt"
    io = ShardkeepCheckpointIO()
    io.save_checkpoint(state(1), target)

    def unsupported(source: str, destination: str) -> None:
        raise skl.ExchangeUnsupported(22, "not here")

    monkeypatch.setattr(skl, "exchange", unsupported)
    io.save_checkpoint(state(2), target)
    assert entries(tmp_path) == ["last.ckpt"] and value_at(target) == 2

    real_rename = skl._rename
    renames: list[tuple[str, str]] = []

    def crash_on_second(source: str, destination: str) -> None:
        if renames:
            raise KeyboardInterrupt("killed between the two renames")
        renames.append((source, destination))
        real_rename(source, destination)

    monkeypatch.setattr(skl, "_rename", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint(state(3), target)
    # the documented window: nothing at the path, both complete checkpoints beside it
    assert not target.exists()
    assert len([name for name in entries(tmp_path) if name.startswith(".sk-")]) == 2
    with pytest.raises(sk.CheckpointNotFoundError, match="interrupted save"):
        io.load_checkpoint(target)
    monkeypatch.undo()
    handled = ShardkeepCheckpointIO.clean_leftovers(tmp_path)
    assert len(handled) == 2
    # the new checkpoint (already committed when the crash came) is put in place
    assert entries(tmp_path) == ["last.ckpt"] and value_at(target) == 3 and sk.verify(target).ok


def test_next_save_repairs_a_crash_between_the_fallback_renames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "last.ckpt"
    io = ShardkeepCheckpointIO()
    io.save_checkpoint(state(1), target)
    monkeypatch.setattr(skl, "exchange", lambda a, b: (_ for _ in ()).throw(skl.ExchangeUnsupported(22, "no")))
    calls = []

    def crash_on_second(source: str, destination: str) -> None:
        calls.append(source)
        if len(calls) == 2:
            raise KeyboardInterrupt
        os.rename(source, destination)

    monkeypatch.setattr(skl, "_rename", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint(state(2), target)
    monkeypatch.undo()
    io.save_checkpoint(state(4), target)
    assert entries(tmp_path) == ["last.ckpt"] and value_at(target) == 4


def test_first_save_never_replaces_and_a_crash_before_its_rename_is_repaired(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "epoch=0-step=1.ckpt"
    io = ShardkeepCheckpointIO()
    monkeypatch.setattr(skl, "_rename_noreplace", lambda a, b: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint(state(5), target)
    monkeypatch.undo()
    assert not target.exists()
    assert ShardkeepCheckpointIO.clean_leftovers(tmp_path)
    assert entries(tmp_path) == [target.name] and value_at(target) == 5


def test_a_directory_that_is_not_a_checkpoint_is_never_replaced_or_removed(tmp_path: Path) -> None:
    io = ShardkeepCheckpointIO()
    other = tmp_path / "last.ckpt"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(sk.UnsupportedValueError, match="not a shardkeep checkpoint"):
        io.save_checkpoint(state(1), other)
    with pytest.raises(sk.UnsupportedValueError, match="not a shardkeep checkpoint"):
        io.remove_checkpoint(other)
    assert (other / "notes.txt").read_text() == "mine"
    assert entries(tmp_path) == ["last.ckpt"]


def test_remove_checkpoint(tmp_path: Path) -> None:
    io = ShardkeepCheckpointIO()
    target = tmp_path / "epoch=0-step=1.ckpt"
    io.save_checkpoint(state(1), target)
    io.remove_checkpoint(target)
    assert entries(tmp_path) == []
    single = tmp_path / "old.ckpt"
    single.write_bytes(b"a torch file from before")
    io.remove_checkpoint(single)
    assert entries(tmp_path) == []
    with pytest.raises(sk.CheckpointNotFoundError):
        io.remove_checkpoint(tmp_path / "gone.ckpt")


def test_a_crash_while_removing_never_brings_the_checkpoint_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    io = ShardkeepCheckpointIO()
    target = tmp_path / "epoch=0-step=1.ckpt"
    io.save_checkpoint(state(1), target)
    monkeypatch.setattr(skl, "_remove_tree", lambda path: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        io.remove_checkpoint(target)
    monkeypatch.undo()
    assert not target.exists() and len(entries(tmp_path)) == 1  # gone from its name at once
    assert len(ShardkeepCheckpointIO.clean_leftovers(tmp_path)) == 1
    assert entries(tmp_path) == []


def test_a_failed_rename_puts_the_checkpoint_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "last.ckpt"
    io = ShardkeepCheckpointIO()
    io.save_checkpoint(state(1), target)
    monkeypatch.setattr(skl, "exchange", lambda a, b: (_ for _ in ()).throw(skl.ExchangeUnsupported(22, "no")))
    calls: list[str] = []

    def fail_second(source: str, destination: str) -> None:
        calls.append(source)
        if len(calls) == 2:
            raise OSError(5, "I/O error")
        os.rename(source, destination)

    monkeypatch.setattr(skl, "_rename", fail_second)
    with pytest.raises(sk.StorageError, match="I/O error"):
        io.save_checkpoint(state(2), target)
    assert entries(tmp_path) == ["last.ckpt"] and value_at(target) == 2


def test_importing_shardkeep_does_not_import_lightning() -> None:
    code = "import sys, shardkeep; assert 'lightning' not in sys.modules and 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---------------------------------------------------------------------------------------------
# training with Lightning
# ---------------------------------------------------------------------------------------------


def dataset() -> Any:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(32, 4, generator=generator)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(32, 1, generator=generator)
    return torch.utils.data.TensorDataset(x, y)


class Tiny(pl.LightningModule):
    def __init__(
        self, lr: float = 0.05, data_dir: pathlib.Path = pathlib.Path("/data"), widths: tuple[int, ...] = (4, 8)
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(widths[0], widths[1]), torch.nn.Tanh(), torch.nn.Linear(widths[1], 1)
        )
        self.losses: list[tuple[int, int, float]] = []
        self.val_steps = 0

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append((self.current_epoch, self.global_step, loss.item()))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        # bad at the first and the fourth epoch: top-k saves epoch 0, removes it, never saves epoch 3
        loss = torch.nn.functional.mse_loss(self.net(x), y) + 10.0 * (self.current_epoch in (0, 3))
        self.log("val_loss", loss)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(dataset(), batch_size=8, shuffle=False, num_workers=0)

    def val_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(dataset(), batch_size=16, num_workers=0)


class Counter(pl.Callback):
    """A callback with state that must come back on resume (a tuple and a path in it)."""

    def __init__(self) -> None:
        self.batches = 0
        self.marks: tuple[Any, ...] = ()

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.batches += 1

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        self.marks = (*self.marks, (trainer.current_epoch, pathlib.PurePosixPath(f"e{trainer.current_epoch}")))

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches, "marks": self.marks}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.batches = state_dict["batches"]
        self.marks = state_dict["marks"]


def trainer(root: Path, max_epochs: int, **kwargs: Any) -> Any:
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=root, save_top_k=2, save_last=True, monitor="val_loss")
    return pl.Trainer(
        max_epochs=max_epochs,
        accelerator="cpu",
        devices=1,
        deterministic=True,
        plugins=[ShardkeepCheckpointIO()],
        callbacks=[checkpoint, Counter()],
        enable_progress_bar=False,
        logger=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        **kwargs,
    )


def callback(run: Any, kind: type) -> Any:
    return next(c for c in run.callbacks if isinstance(c, kind))


@pytest.mark.filterwarnings(r"ignore:Checkpoint directory .* exists and is not empty:UserWarning")  # resuming there
def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    swaps: list[str] = []
    real_exchange = skl.exchange

    def counting(source: str, destination: str) -> None:
        swaps.append(os.path.basename(destination))
        real_exchange(source, destination)

    monkeypatch.setattr(skl, "exchange", counting)

    full_model = Tiny()
    full = trainer(tmp_path / "full", 4)
    full.fit(full_model)
    assert [epoch for epoch, _, _ in full_model.losses] == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4

    first_model = Tiny()
    first = trainer(tmp_path / "resumed", 2)
    first.fit(first_model)
    last = tmp_path / "resumed" / "last.ckpt"
    assert sk.verify(last).ok

    resumed_model = Tiny()
    resumed = trainer(tmp_path / "resumed", 4)
    resumed.fit(resumed_model, ckpt_path=str(last))

    assert first_model.losses == full_model.losses[:8]
    assert resumed_model.losses == full_model.losses[8:]  # exactly equal floats, same steps
    for name, parameter in full_model.state_dict().items():
        assert torch.equal(parameter, resumed_model.state_dict()[name]), name
    full_opt, resumed_opt = full.optimizers[0].state_dict(), resumed.optimizers[0].state_dict()
    assert_same(resumed_opt["param_groups"], full_opt["param_groups"])
    for index, entry in full_opt["state"].items():
        for key, tensor in entry.items():
            assert torch.equal(resumed_opt["state"][index][key], tensor)
    assert resumed.lr_scheduler_configs[0].scheduler.state_dict() == full.lr_scheduler_configs[0].scheduler.state_dict()
    assert resumed.global_step == full.global_step == 16 and resumed.current_epoch == full.current_epoch
    assert callback(resumed, Counter).state_dict() == callback(full, Counter).state_dict()
    resumed_ckpt, full_ckpt = (
        callback(resumed, pl.callbacks.ModelCheckpoint),
        callback(full, pl.callbacks.ModelCheckpoint),
    )
    assert {os.path.basename(p) for p in resumed_ckpt.best_k_models} == {
        os.path.basename(p) for p in full_ckpt.best_k_models
    }
    # ModelCheckpoint saves last.ckpt whenever it saved a top-k checkpoint (epochs 0, 1, 2, not 3),
    # over the same path after the first time, each time by an exchange
    monkeypatch.undo()
    if exchange_supported(tmp_path):
        assert swaps == ["last.ckpt"] * (2 + 1 + 1)

    # top-k: what is on disk is exactly what ModelCheckpoint reports, and every checkpoint verifies
    for run, root in ((full, tmp_path / "full"), (resumed, tmp_path / "resumed")):
        model_checkpoint = callback(run, pl.callbacks.ModelCheckpoint)
        expected = {os.path.basename(p) for p in model_checkpoint.best_k_models} | {"last.ckpt"}
        assert len(model_checkpoint.best_k_models) == 2
        assert set(os.listdir(root)) == expected
        for name in expected:
            assert sk.verify(root / name).ok, name
    # the best two: epochs 1 and 2 (0-based); epoch 0 was saved and then removed, 3 never kept
    assert {os.path.basename(p) for p in full_ckpt.best_k_models} == {"epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt"}
    loaded = ShardkeepCheckpointIO().load_checkpoint(tmp_path / "full" / "last.ckpt")
    assert loaded["hyper_parameters"] == {"lr": 0.05, "data_dir": pathlib.Path("/data"), "widths": (4, 8)}
    assert loaded["epoch"] == 2 and loaded["global_step"] == 12


def test_save_last_link_makes_a_symlink_to_a_verified_checkpoint(tmp_path: Path) -> None:
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_top_k=1, save_last="link", monitor="val_loss")
    run = pl.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=1,
        plugins=[ShardkeepCheckpointIO()],
        callbacks=[checkpoint],
        enable_progress_bar=False,
        logger=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    run.fit(Tiny())
    last = tmp_path / "last.ckpt"
    assert last.is_symlink() and os.readlink(last) == "epoch=1-step=8.ckpt"
    assert not sk.verify(last).ok  # shardkeep itself never follows a symlinked checkpoint ...
    assert sk.verify(tmp_path / "epoch=1-step=8.ckpt").ok
    loaded = ShardkeepCheckpointIO().load_checkpoint(last)  # ... the plugin follows Lightning's link
    assert loaded["epoch"] == 1 and loaded["global_step"] == 8
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(tmp_path / "epoch=1-step=8.ckpt", elsewhere / "last.ckpt")
    with pytest.raises(sk.UnsafePathError, match="same directory"):
        ShardkeepCheckpointIO().load_checkpoint(elsewhere / "last.ckpt")


DDP_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, warnings
    warnings.simplefilter("ignore")
    import torch
    import lightning.pytorch as pl
    sys.path.insert(0, os.environ["TEST_DIR"])
    from test_lightning import Tiny, Counter
    from shardkeep.lightning import ShardkeepCheckpointIO

    root, epochs, resume = sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=root, save_top_k=2, save_last=True, monitor="val_loss")
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=2, strategy="ddp",
                         plugins=[ShardkeepCheckpointIO()], callbacks=[checkpoint, Counter()],
                         enable_progress_bar=False, logger=False, enable_model_summary=False, log_every_n_steps=1)
    model = Tiny()
    trainer.fit(model, ckpt_path=resume)
    if trainer.global_rank == 0:
        with open(os.path.join(root, "..", "result.json" if resume is None else "result2.json"), "w") as f:
            json.dump({"best": sorted(os.path.basename(p) for p in checkpoint.best_k_models),
                       "step": trainer.global_step, "world": trainer.world_size}, f)
    """
)


@pytest.mark.slow
def test_ddp_rank_zero_saves_do_not_hang_and_verify(tmp_path: Path) -> None:
    script = tmp_path / "ddp_run.py"
    script.write_text(DDP_SCRIPT)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {
        **os.environ,
        "TEST_DIR": str(Path(__file__).parent),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
    }
    root = tmp_path / "ckpts"
    subprocess.run([sys.executable, str(script), str(root), "2"], env=env, check=True, timeout=240, cwd=tmp_path)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["world"] == 2 and result["step"] == 4  # 32 samples, 2 ranks, batch 8: 2 steps an epoch
    assert set(os.listdir(root)) == {*result["best"], "last.ckpt"}
    for name in os.listdir(root):
        assert sk.verify(root / name).ok
    # every rank loads the checkpoint (reads only) and training goes on from it
    env["MASTER_PORT"] = str(port + 1 if port < 65535 else port - 1)
    subprocess.run(
        [sys.executable, str(script), str(root), "3", str(root / "last.ckpt")],
        env=env,
        check=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert json.loads((tmp_path / "result2.json").read_text())["step"] == 6
    assert sk.verify(root / "last.ckpt").ok
