"""shardkeep.lightning.ShardkeepCheckpointIO: conversions, the atomic replacement of a checkpoint
saved over the same path, removal, loading, and Lightning training runs (resume, top-k, DDP)."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import json
import math
import os
import pathlib
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("lightning.pytorch")

import shardkeep as sk  # noqa: E402
import shardkeep.lightning as skl  # noqa: E402
from shardkeep.integrations.lightning import checkpoint_io as skl_io  # noqa: E402
from shardkeep.lightning import RESERVED_KEY, ShardkeepCheckpointIO  # noqa: E402
from shardkeep.storage import localfs  # noqa: E402

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


def _local_dataclass() -> Any:
    @dataclasses.dataclass
    class Local:  # defined in a function: nothing could import it back
        width: int = 3

    return Local()


@pytest.mark.parametrize(
    ("value", "where"),
    [
        (_local_dataclass(), "hyper_parameters.config"),
        (Config, "hyper_parameters.config"),
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


def test_a_file_url_is_the_local_path_it_names(tmp_path: Path) -> None:
    """As everywhere a location is taken (shardkeep.storage.locations): ``file://PATH`` is the
    local path PATH, saved, loaded and removed there."""
    io = ShardkeepCheckpointIO()
    url = f"file://{tmp_path / 'u.ckpt'}"
    io.save_checkpoint(state(3), url)
    assert entries(tmp_path) == ["u.ckpt"] and value_at(tmp_path / "u.ckpt") == 3
    assert float(io.load_checkpoint(url)["state_dict"]["w"][0]) == 3
    io.remove_checkpoint(url)
    assert entries(tmp_path) == []


def save_crafted(target: Path, record: Any, **values: Any) -> None:
    """A checkpoint as the plugin would write it, with ``record`` as its conversion record."""
    sk.save({"epoch": 0, "hyper_parameters": values, RESERVED_KEY: record}, target)


def test_a_concrete_path_from_another_os_comes_back_as_its_pure_class(tmp_path: Path) -> None:
    # On Linux a checkpoint saved on Windows names WindowsPath, which cannot be instantiated here
    # (NotImplementedError); on Windows the same holds for a PosixPath saved on Linux.
    foreign, pure, text = (
        ("PosixPath", pathlib.PurePosixPath, "/data/train")
        if os.name == "nt"
        else ("WindowsPath", pathlib.PureWindowsPath, "C:\\runs\\1")
    )
    native = "WindowsPath" if os.name == "nt" else "PosixPath"
    target = tmp_path / "foreign.ckpt"
    conversions = [
        {"path": ["hyper_parameters", "out"], "type": "path", "cls": foreign},
        {"path": ["hyper_parameters", "here"], "type": "path", "cls": native},
    ]
    save_crafted(target, {"format": 1, "conversions": conversions}, out=text, here="runs/2")
    hparams = ShardkeepCheckpointIO().load_checkpoint(target)["hyper_parameters"]
    assert type(hparams["out"]) is pure and hparams["out"] == pure(text) and str(hparams["out"]) == text
    assert type(hparams["here"]) is type(pathlib.Path()) and hparams["here"] == pathlib.Path("runs/2")


@pytest.mark.parametrize(
    ("record", "values"),
    [
        ({"format": 1, "conversions": 5}, {}),
        ({"format": 1, "conversions": [{"path": [["hyper_parameters"]], "type": "set"}]}, {}),
        ({"format": 1, "conversions": [{"path": ["hyper_parameters", "x"], "type": 3}]}, {"x": [1]}),
        ({"format": 1, "conversions": ["junk"]}, {}),
        ({"format": 1, "conversions": [{"path": ["nowhere", 0], "type": "set"}]}, {}),
        ({"format": True, "conversions": []}, {}),
        ({"format": 1, "conversions": [{"path": ["hyper_parameters", "x"], "type": "set"}] * 2}, {"x": [1]}),
        ({"format": 1, "conversions": [{"path": ["hyper_parameters", "x"], "type": "torch.device"}]}, {"x": "no:pe"}),
        ({"format": 1, "conversions": [{"path": ["hyper_parameters", "x"], "type": "int"}]}, {"x": math.inf}),
        ({"format": 1, "conversions": [{"path": ["hyper_parameters", "x"], "type": "path", "cls": ["P"]}]}, {"x": "a"}),
        (
            {"format": 1, "conversions": [{"path": ["hyper_parameters", "x"], "type": "path", "cls": "PosixPath"}]},
            {"x": 5},
        ),
        # dataclass and enum records naming what is not one: nothing is called
        (
            {
                "format": 1,
                "conversions": [{"path": ["hyper_parameters", "x"], "type": "dataclass", "cls": "os:system"}],
            },
            {"x": {}},
        ),
        (
            {
                "format": 1,
                "conversions": [{"path": ["hyper_parameters", "x"], "type": "dataclass", "cls": "subprocess:Popen"}],
            },
            {"x": {"args": "true"}},
        ),
        (
            {"format": 1, "conversions": [{"path": ["hyper_parameters", "x"], "type": "enum", "cls": "enum:Enum"}]},
            {"x": "A"},
        ),
        (
            {
                "format": 1,
                "conversions": [
                    {"path": ["hyper_parameters", "x"], "type": "enum", "cls": f"{__name__}:Mode", "by": "value"}
                ],
            },
            {"x": 1},
        ),
        (
            {
                "format": 1,
                "conversions": [{"path": ["hyper_parameters", "x"], "type": "enum", "cls": f"{__name__}:Mode"}],
            },
            {"x": "MISSING"},
        ),
        (
            {
                "format": 1,
                "conversions": [{"path": ["hyper_parameters", "x"], "type": "dataclass", "cls": f"{__name__}:Optim"}],
            },
            {"x": [1]},
        ),
        ({"format": 1, "conversions": [{"path": ["hyper_parameters", "x"], "type": "dataclass", "cls": 7}]}, {"x": {}}),
        (
            {"format": 1, "conversions": [{"path": ["hyper_parameters", "x"], "type": "dataclass", "cls": "nocolon"}]},
            {"x": {}},
        ),
    ],
    ids=[
        "conversions-not-a-list",
        "unhashable-path-element",
        "type-not-a-str",
        "record-not-a-mapping",
        "path-not-in-the-checkpoint",
        "format-true",
        "two-records-at-one-path",
        "bad-device-runtime-error",
        "int-from-inf-overflow-error",
        "unhashable-path-class",
        "path-from-a-number",
        "dataclass-a-function",
        "dataclass-a-class",
        "enum-without-members",
        "enum-by-value-not-a-flag",
        "enum-unknown-member",
        "dataclass-from-a-list",
        "dataclass-type-not-a-str",
        "dataclass-type-not-module-qualname",
    ],
)
def test_a_hostile_conversion_record_is_an_integrity_error_naming_the_checkpoint(
    tmp_path: Path, record: Any, values: dict[str, Any]
) -> None:
    target = tmp_path / "hostile.ckpt"
    save_crafted(target, record, **values)
    with pytest.raises(sk.IntegrityError, match=re_escape(str(target))):
        ShardkeepCheckpointIO().load_checkpoint(target)


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


def test_the_old_import_path_is_the_package_and_the_recorded_plugin_name_resolves(tmp_path: Path) -> None:
    import importlib

    assert skl is importlib.import_module("shardkeep.integrations.lightning")
    assert skl.ShardkeepCheckpointIO is ShardkeepCheckpointIO and skl.RESERVED_KEY == RESERVED_KEY
    target = tmp_path / "named.ckpt"
    ShardkeepCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(2)}}, target)
    recorded = sk.read_manifest(target).custom_fields["lightning"]["checkpoint_io"]
    module, _, name = recorded.rpartition(".")
    assert recorded == "shardkeep.lightning.ShardkeepCheckpointIO"
    assert getattr(importlib.import_module(module), name) is ShardkeepCheckpointIO


def test_signed_and_compressed_checkpoints(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    io = ShardkeepCheckpointIO(
        signer=key, public_key=key.public_key(), options=sk.WriteOptions(digest="sha256", compression="zstd")
    )
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


def saved_last(tmp_path: Path) -> tuple[Path, ShardkeepCheckpointIO]:
    """``last.ckpt`` saved once (value 1) in ``tmp_path``, and the plugin that saved it."""
    target = tmp_path / "last.ckpt"
    io = ShardkeepCheckpointIO()
    io.save_checkpoint(state(1), target)
    return target, io


class ScriptedFS(localfs.LocalFS):
    """The real filesystem but for the steps a test replaces (``fs.steps["rename"] = ...``):
    installed for the whole test by the ``fs`` fixture, so the plugin's swap and removal run on
    it; ``fs.steps.clear()`` gives back the real steps (as after a restart)."""

    def __init__(self) -> None:
        self.steps: dict[str, Callable[..., Any]] = {}

    def exchange(self, source: str, destination: str) -> None:
        self.steps.get("exchange", super().exchange)(source, destination)

    def rename(self, source: str, destination: str) -> None:
        self.steps.get("rename", super().rename)(source, destination)

    def rename_noreplace(self, source: str, destination: str) -> None:
        self.steps.get("rename_noreplace", super().rename_noreplace)(source, destination)

    def remove_tree(self, path: str) -> bool:
        return bool(self.steps.get("remove_tree", super().remove_tree)(path))


@pytest.fixture
def fs() -> Iterator[ScriptedFS]:
    scripted = ScriptedFS()
    with localfs.using(scripted):
        yield scripted


def without_exchange(fs: ScriptedFS) -> None:
    """As on a filesystem without RENAME_EXCHANGE: the replace falls back to two renames."""

    def unsupported(source: str, destination: str) -> None:
        raise localfs.ExchangeUnsupported(22, "no")

    fs.steps["exchange"] = unsupported


def entries(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def exchange_supported(directory: Path) -> bool:
    a, b = directory / "probe_a", directory / "probe_b"
    a.mkdir()
    b.mkdir()
    try:
        localfs.LOCAL.exchange(str(a), str(b))
        return True
    except localfs.ExchangeUnsupported:
        return False
    finally:
        a.rmdir()
        b.rmdir()


def test_overwrite_swaps_atomically_and_a_complete_checkpoint_is_always_there(tmp_path: Path, fs: ScriptedFS) -> None:
    if not exchange_supported(tmp_path):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not supported on this filesystem")
    target, io = saved_last(tmp_path)
    steps: list[str] = []
    real_exchange, real_remove = localfs.LOCAL.exchange, localfs.LOCAL.remove_tree

    def checked(name: str, function: Any) -> Any:
        def run(*args: Any) -> Any:
            assert sk.verify(target).ok, f"before {name}"  # the old or the new one, whole
            steps.append(name)
            result = function(*args)
            assert sk.verify(target).ok, f"after {name}"
            return result

        return run

    fs.steps["exchange"] = checked("exchange", real_exchange)
    fs.steps["remove_tree"] = checked("remove", real_remove)
    for value in (2, 3):
        io.save_checkpoint(state(value), target)
        assert value_at(target) == value
    assert steps == ["exchange", "remove"] * 2
    assert entries(tmp_path) == ["last.ckpt"]


def test_crash_after_the_swap_leaves_the_new_checkpoint_and_the_next_save_cleans_up(
    tmp_path: Path, fs: ScriptedFS
) -> None:
    target, io = saved_last(tmp_path)

    def crash(path: str) -> None:
        raise KeyboardInterrupt("killed while removing the old checkpoint")

    fs.steps["remove_tree"] = crash
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint(state(2), target)
    fs.steps.clear()
    assert value_at(target) == 2 and sk.verify(target).ok
    leftovers = [name for name in entries(tmp_path) if name != "last.ckpt"]
    assert len(leftovers) == 1 and leftovers[0].startswith(".sk-")
    # Lightning's search for last*.ckpt files never sees a leftover
    assert "last" not in leftovers[0]
    io.save_checkpoint(state(3), target)
    assert entries(tmp_path) == ["last.ckpt"] and value_at(target) == 3


def test_crash_inside_shardkeep_save_leaves_the_old_checkpoint(tmp_path: Path) -> None:
    target, io = saved_last(tmp_path)
    # what a kill -9 inside shardkeep.save leaves: a staging directory beside the target
    staging = tmp_path / f"{skl_io._tag('last.ckpt')}new-0123.tmp-abcd"
    (staging / "shards").mkdir(parents=True)
    (staging / "shards" / "rank_00000.safetensors").write_bytes(b"partial")
    assert value_at(target) == 1
    io.save_checkpoint(state(2), target)
    assert entries(tmp_path) == ["last.ckpt"] and value_at(target) == 2
    # a save that fails removes its own staging directory and leaves the old checkpoint
    with pytest.raises(sk.UnsupportedValueError):
        io.save_checkpoint({"state_dict": {"w": object()}}, target)
    assert entries(tmp_path) == ["last.ckpt"] and value_at(target) == 2


def test_fallback_two_renames_and_repair_of_a_crash_between_them(tmp_path: Path, fs: ScriptedFS) -> None:
    target, io = saved_last(tmp_path)

    def unsupported(source: str, destination: str) -> None:
        raise localfs.ExchangeUnsupported(22, "not here")

    fs.steps["exchange"] = unsupported
    io.save_checkpoint(state(2), target)
    assert entries(tmp_path) == ["last.ckpt"] and value_at(target) == 2

    real_rename = localfs.LOCAL.rename
    renames: list[tuple[str, str]] = []

    def crash_on_second(source: str, destination: str) -> None:
        if renames:
            raise KeyboardInterrupt("killed between the two renames")
        renames.append((source, destination))
        real_rename(source, destination)

    fs.steps["rename"] = crash_on_second
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint(state(3), target)
    # the documented window: nothing at the path, both complete checkpoints beside it
    assert not target.exists()
    assert len([name for name in entries(tmp_path) if name.startswith(".sk-")]) == 2
    with pytest.raises(sk.CheckpointNotFoundError, match="interrupted save"):
        io.load_checkpoint(target)
    fs.steps.clear()
    handled = ShardkeepCheckpointIO.clean_leftovers(tmp_path)
    assert len(handled) == 2
    # the new checkpoint (already committed when the crash came) is put in place
    assert entries(tmp_path) == ["last.ckpt"] and value_at(target) == 3 and sk.verify(target).ok


def test_next_save_repairs_a_crash_between_the_fallback_renames(tmp_path: Path, fs: ScriptedFS) -> None:
    target, io = saved_last(tmp_path)
    without_exchange(fs)
    calls = []

    def crash_on_second(source: str, destination: str) -> None:
        calls.append(source)
        if len(calls) == 2:
            raise KeyboardInterrupt
        os.rename(source, destination)

    fs.steps["rename"] = crash_on_second
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint(state(2), target)
    fs.steps.clear()
    io.save_checkpoint(state(4), target)
    assert entries(tmp_path) == ["last.ckpt"] and value_at(target) == 4


def test_first_save_never_replaces_and_a_crash_before_its_rename_is_repaired(tmp_path: Path, fs: ScriptedFS) -> None:
    target = tmp_path / "epoch=0-step=1.ckpt"
    io = ShardkeepCheckpointIO()
    fs.steps["rename_noreplace"] = lambda a, b: (_ for _ in ()).throw(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint(state(5), target)
    fs.steps.clear()
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


def test_a_crash_while_removing_never_brings_the_checkpoint_back(tmp_path: Path, fs: ScriptedFS) -> None:
    io = ShardkeepCheckpointIO()
    target = tmp_path / "epoch=0-step=1.ckpt"
    io.save_checkpoint(state(1), target)
    fs.steps["remove_tree"] = lambda path: (_ for _ in ()).throw(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        io.remove_checkpoint(target)
    fs.steps.clear()
    assert not target.exists() and len(entries(tmp_path)) == 1  # gone from its name at once
    assert len(ShardkeepCheckpointIO.clean_leftovers(tmp_path)) == 1
    assert entries(tmp_path) == []


def test_a_failed_rename_puts_the_checkpoint_back(tmp_path: Path, fs: ScriptedFS) -> None:
    target, io = saved_last(tmp_path)
    without_exchange(fs)
    calls: list[str] = []

    def fail_second(source: str, destination: str) -> None:
        calls.append(source)
        if len(calls) == 2:
            raise OSError(5, "I/O error")
        os.rename(source, destination)

    fs.steps["rename"] = fail_second
    with pytest.raises(sk.StorageError, match="I/O error"):
        io.save_checkpoint(state(2), target)
    assert entries(tmp_path) == ["last.ckpt"] and value_at(target) == 2


def test_removing_a_missing_checkpoint_does_nothing(tmp_path: Path) -> None:
    # as TorchCheckpointIO.remove_checkpoint: ModelCheckpoint may remove a stale last_model_path
    io = ShardkeepCheckpointIO()
    keep = tmp_path / "keep.ckpt"
    io.save_checkpoint(state(1), keep)
    io.remove_checkpoint(tmp_path / "gone.ckpt")
    io.remove_checkpoint(tmp_path / "no" / "such" / "dir" / "gone.ckpt")
    io.remove_checkpoint(keep / "manifest.json" / "gone.ckpt")  # a path under a regular file
    assert entries(tmp_path) == ["keep.ckpt"] and value_at(keep) == 1


def test_removing_a_missing_checkpoint_removes_its_leftovers_so_it_never_comes_back(
    tmp_path: Path, fs: ScriptedFS
) -> None:
    target, io = saved_last(tmp_path)
    without_exchange(fs)
    real_rename = localfs.LOCAL.rename

    def crash_on_second(source: str, destination: str) -> None:
        if not target.exists():
            raise KeyboardInterrupt("killed between the two renames")
        real_rename(source, destination)

    fs.steps["rename"] = crash_on_second
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint(state(2), target)
    fs.steps.clear()
    assert not target.exists() and len(entries(tmp_path)) == 2  # old- and new-, both complete
    io.remove_checkpoint(target)
    assert entries(tmp_path) == []
    assert ShardkeepCheckpointIO.clean_leftovers(tmp_path) == [] and entries(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# crash points: a removed or replaced checkpoint never comes back
# ---------------------------------------------------------------------------------------------


def crash_removing(fs: ScriptedFS) -> None:
    """Kill the next remove_checkpoint once its checkpoint is gone from its name."""
    fs.steps["remove_tree"] = lambda path: (_ for _ in ()).throw(KeyboardInterrupt("killed"))


def test_a_crash_right_after_the_exchange_then_a_crashed_removal_does_not_resurrect_the_old_checkpoint(
    tmp_path: Path, fs: ScriptedFS
) -> None:
    if not exchange_supported(tmp_path):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not supported on this filesystem")
    target, io = saved_last(tmp_path)
    real_exchange = localfs.LOCAL.exchange

    def exchange_then_crash(source: str, destination: str) -> None:
        real_exchange(source, destination)
        raise KeyboardInterrupt("killed right after the exchange")

    fs.steps["exchange"] = exchange_then_crash
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint(state(2), target)
    fs.steps.clear()
    # the new checkpoint is in place; the exchanged-out side (the OLD checkpoint) is left over
    assert value_at(target) == 2 and len(entries(tmp_path)) == 2
    # a removal killed after the checkpoint is renamed: nothing may come back as last.ckpt
    crash_removing(fs)
    with pytest.raises(KeyboardInterrupt):
        io.remove_checkpoint(target)
    fs.steps.clear()
    assert not target.exists()
    ShardkeepCheckpointIO.clean_leftovers(tmp_path)
    assert entries(tmp_path) == []
    io.save_checkpoint(state(3), target)  # and a later save starts from nothing stale
    assert entries(tmp_path) == ["last.ckpt"] and value_at(target) == 3


def test_a_removal_killed_before_the_checkpoint_is_renamed_leaves_it_whole(tmp_path: Path, fs: ScriptedFS) -> None:
    target, io = saved_last(tmp_path)
    stale = tmp_path / f"{skl_io._tag(target.name)}new-0123"  # e.g. an exchanged-out side
    io.save_checkpoint(state(0), stale)

    def crash_at_the_checkpoint(source: str, destination: str) -> None:
        if source == str(target):  # renaming the checkpoint itself to its del- name
            raise KeyboardInterrupt("killed before renaming the checkpoint itself")
        localfs.LOCAL.rename_noreplace(source, destination)

    fs.steps["rename_noreplace"] = crash_at_the_checkpoint
    with pytest.raises(KeyboardInterrupt):
        io.remove_checkpoint(target)
    fs.steps.clear()
    assert value_at(target) == 1  # the leftovers went first; the checkpoint is untouched
    assert all(".del-" in name for name in entries(tmp_path) if name != target.name)
    ShardkeepCheckpointIO.clean_leftovers(tmp_path)
    assert entries(tmp_path) == ["last.ckpt"] and value_at(target) == 1


def partial_delete_then_crash(path: str) -> None:
    """What a kill inside shutil.rmtree can leave: the tensors gone, the manifest still there."""
    for root, _, files in os.walk(path):
        for name in files:
            if name != "manifest.json":
                os.remove(os.path.join(root, name))
    raise KeyboardInterrupt("killed while deleting")


CRASH_POINTS = {
    # point: (exchange available, what the path holds right after the crash)
    "after-exchange": (True, 2),
    "after-retire": (True, 2),
    "during-delete": (True, 2),
    "fallback-between-renames": (False, None),
    "fallback-after-second-rename": (False, 2),
    "fallback-during-delete": (False, 2),
}


def crash_save_at(point: str, fs: ScriptedFS, target: Path) -> None:
    if not CRASH_POINTS[point][0]:
        without_exchange(fs)
    if point == "after-exchange":
        real_exchange = localfs.LOCAL.exchange

        def exchange_then_crash(source: str, destination: str) -> None:
            real_exchange(source, destination)
            raise KeyboardInterrupt

        fs.steps["exchange"] = exchange_then_crash
    elif point == "fallback-between-renames":
        real_rename = localfs.LOCAL.rename

        def crash_when_gone(source: str, destination: str) -> None:
            if not target.exists():
                raise KeyboardInterrupt
            real_rename(source, destination)

        fs.steps["rename"] = crash_when_gone
    elif point == "fallback-after-second-rename":
        real_rename, calls = localfs.LOCAL.rename, []

        def rename_then_crash_on_second(source: str, destination: str) -> None:
            real_rename(source, destination)
            calls.append(source)
            if len(calls) == 2:
                raise KeyboardInterrupt

        fs.steps["rename"] = rename_then_crash_on_second
    elif point == "after-retire":
        crash_removing(fs)
    else:
        fs.steps["remove_tree"] = partial_delete_then_crash


#: Working names of a name beyond 88 bytes are tagged with its digest (90 bytes: a
#: ModelCheckpoint name with metrics; 255 bytes: the longest name a directory can have).
LONG_NAMES = {
    "last.ckpt": "last.ckpt",
    "90-bytes": "epoch=12-step=3400-val_loss=0.1234-val_acc=0.9876-train_loss=0.2345-lr=0.0001-seed=42.ckpt",
    "255-bytes": "检" * 83 + "epoch.ckpt"[:6],
}


@pytest.mark.parametrize("name", list(LONG_NAMES))
@pytest.mark.parametrize("then", ["recover", "remove"])
@pytest.mark.parametrize("point", list(CRASH_POINTS))
def test_every_crash_point_of_a_replace(tmp_path: Path, fs: ScriptedFS, point: str, then: str, name: str) -> None:
    if CRASH_POINTS[point][0] and not exchange_supported(tmp_path):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not supported on this filesystem")
    target = tmp_path / LONG_NAMES[name]
    assert len(target.name.encode()) in (9, 90, 255)
    io = ShardkeepCheckpointIO()
    io.save_checkpoint({**state(1), "global_step": 100}, target)
    crash_save_at(point, fs, target)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({**state(2), "global_step": 5}, target)  # a run resumed from an earlier step
    fs.steps.clear()
    expected = CRASH_POINTS[point][1]
    if expected is None:
        assert not target.exists()
    else:
        assert value_at(target) == expected and sk.verify(target).ok
    if then == "recover":
        ShardkeepCheckpointIO.clean_leftovers(tmp_path)
        assert entries(tmp_path) == [target.name] and value_at(target) == 2 and sk.verify(target).ok
    else:
        crash_removing(fs)  # killed once everything is renamed away, before any deletion
        with pytest.raises(KeyboardInterrupt):
            io.remove_checkpoint(target)  # (when the path is gone already: its leftovers)
        fs.steps.clear()
        assert not target.exists()
        ShardkeepCheckpointIO.clean_leftovers(tmp_path)  # nothing comes back
        assert entries(tmp_path) == []


def test_recovery_puts_back_the_last_committed_leftover_not_the_one_named_new(tmp_path: Path) -> None:
    # After an exchange the entry named "new-" holds the *previous* checkpoint, and a run resumed
    # from an earlier checkpoint saves a lower step: only the commit time tells which is newer.
    tag = skl_io._tag("last.ckpt")
    sk.save({"w": torch.zeros(1), "epoch": 1}, tmp_path / f"{tag}new-aaaa", step=100)
    sk.save({"w": torch.ones(1), "epoch": 2}, tmp_path / f"{tag}old-bbbb", step=5)
    sk.save({"w": torch.full((1,), 7.0)}, tmp_path / f"{tag}del-cccc", step=200)  # being deleted
    ShardkeepCheckpointIO.clean_leftovers(tmp_path)
    assert entries(tmp_path) == ["last.ckpt"]
    assert int(ShardkeepCheckpointIO().load_checkpoint(tmp_path / "last.ckpt")["epoch"]) == 2


def test_a_checkpoint_being_deleted_is_never_put_back(tmp_path: Path) -> None:
    tag = skl_io._tag("last.ckpt")
    sk.save({"w": torch.zeros(1), "epoch": 1}, tmp_path / f"{tag}del-aaaa")
    assert ShardkeepCheckpointIO.clean_leftovers(tmp_path) == [f"{tag}del-aaaa"]
    assert entries(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# I/O errors are StorageError naming the path
# ---------------------------------------------------------------------------------------------


def test_io_errors_are_storage_errors_naming_the_path(tmp_path: Path) -> None:
    io = ShardkeepCheckpointIO()
    regular = tmp_path / "a-file"
    regular.write_text("not a directory")
    with pytest.raises(sk.StorageError, match=re_escape(str(regular))) as saving:
        io.save_checkpoint(state(1), regular / "x.ckpt")  # ENOTDIR
    assert isinstance(saving.value.__cause__, OSError)
    with pytest.raises(sk.StorageError, match=re_escape(str(regular))) as saving:
        io.save_checkpoint(state(1), regular / "sub" / "x.ckpt")
    assert isinstance(saving.value.__cause__, OSError)
    with pytest.raises(sk.StorageError, match=re_escape(str(regular))) as cleaning:
        ShardkeepCheckpointIO.clean_leftovers(regular)
    assert isinstance(cleaning.value.__cause__, OSError)
    with pytest.raises(sk.StorageError, match=re_escape(str(tmp_path / "missing"))):
        ShardkeepCheckpointIO.clean_leftovers(tmp_path / "missing")
    with pytest.raises(sk.CheckpointNotFoundError, match=re_escape(str(regular / "x.ckpt"))):
        io.load_checkpoint(regular / "x.ckpt")
    for bad in (None, 5, "a\x00b"):
        with pytest.raises(sk.UnsupportedValueError):
            io.save_checkpoint(state(1), bad)  # type: ignore[arg-type]
    assert entries(tmp_path) == ["a-file"]


def test_a_failed_delete_while_removing_is_a_storage_error(tmp_path: Path, fs: ScriptedFS) -> None:
    io = ShardkeepCheckpointIO()
    target = tmp_path / "epoch=0-step=1.ckpt"
    io.save_checkpoint(state(1), target)

    def failing(path: str) -> None:
        raise PermissionError(13, "Permission denied", path)

    fs.steps["remove_tree"] = failing
    with pytest.raises(sk.StorageError, match=re_escape(str(target))) as removing:
        io.remove_checkpoint(target)
    assert isinstance(removing.value.__cause__, PermissionError)
    fs.steps.clear()
    assert not target.exists()
    ShardkeepCheckpointIO.clean_leftovers(tmp_path)
    assert entries(tmp_path) == []


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="chmod does not restrict root")
def test_unwritable_and_unlistable_directories_are_storage_errors(tmp_path: Path) -> None:
    io = ShardkeepCheckpointIO()
    locked = tmp_path / "locked"
    locked.mkdir()
    target = locked / "epoch=0-step=1.ckpt"
    io.save_checkpoint(state(1), target)
    locked.chmod(0o500)  # r-x: cannot rename, create or delete entries in it
    try:
        with pytest.raises(sk.StorageError, match=re_escape(str(target))):
            io.remove_checkpoint(target)
        with pytest.raises(sk.StorageError, match=re_escape(str(locked / "sub"))):
            io.save_checkpoint(state(2), locked / "sub" / "x.ckpt")
        locked.chmod(0o000)  # cannot list it either
        with pytest.raises(sk.StorageError, match=re_escape(str(locked))):
            ShardkeepCheckpointIO.clean_leftovers(locked)
    finally:
        locked.chmod(0o700)
    assert value_at(target) == 1 and entries(locked) == [target.name]


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
def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path: Path, fs: ScriptedFS) -> None:
    swaps: list[str] = []
    real_exchange = localfs.LOCAL.exchange

    def counting(source: str, destination: str) -> None:
        swaps.append(os.path.basename(destination))
        real_exchange(source, destination)

    fs.steps["exchange"] = counting

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
    fs.steps.clear()
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
    # every rank loads the checkpoint (reads only) and training goes on from it, on a port the
    # kernel says is free now (the first run's may linger in TIME_WAIT; its neighbour may be taken)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        env["MASTER_PORT"] = str(probe.getsockname()[1])
    subprocess.run(
        [sys.executable, str(script), str(root), "3", str(root / "last.ckpt")],
        env=env,
        check=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert json.loads((tmp_path / "result2.json").read_text())["step"] == 6
    assert sk.verify(root / "last.ckpt").ok


def _save_a_dtensor(rank: int, world_size: int, path: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    class Tagged(DTensor):  # a subclass: recognised as a DTensor too
        pass

    mesh = init_device_mesh("cpu", (world_size,))
    sharded = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
    messages = []
    for value in (sharded, Tagged.__new__(Tagged, sharded._local_tensor, sharded._spec, requires_grad=False)):
        try:
            ShardkeepCheckpointIO().save_checkpoint({"state_dict": {"w": value}}, f"{path}-{len(messages)}")
            messages.append("saved")
        except sk.UnsupportedValueError as exc:
            messages.append(str(exc))
    return " | ".join(messages)


def test_a_dtensor_in_a_lightning_checkpoint_is_refused_by_key(tmp_path: Path) -> None:
    """Rank 0 alone saves: a DTensor (a subclass too) would keep only rank 0's shard, so it is
    refused, naming its key, before anything is written."""
    from tests.support.distributed_harness import results_or_raise, run_ranks

    (message,) = results_or_raise(run_ranks(1, _save_a_dtensor, str(tmp_path / "ckpt"), outbox=tmp_path / "out"))
    assert message.split(" | ") == [message.split(" | ")[0]] * 2, message  # both refused alike
    assert message.startswith("'state_dict.w' is a DTensor: ShardkeepCheckpointIO saves on rank 0 alone"), message
    assert not any(p.name.startswith("ckpt") for p in tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------
# dataclass and Enum hyperparameters
# ---------------------------------------------------------------------------------------------


class Mode(enum.Enum):
    FAST = "fast"
    SLOW = "slow"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Access(enum.Flag):
    READ = 1
    WRITE = 2


@dataclasses.dataclass(frozen=True)
class Optim:
    lr: float = 0.05
    betas: tuple[float, float] = (0.9, 0.99)


@dataclasses.dataclass
class ModelConfig:
    width: int = 8
    mode: Mode = Mode.SLOW
    optim: Optim = dataclasses.field(default_factory=Optim)
    layers: list[Level] = dataclasses.field(default_factory=lambda: [Level.LOW, Level.HIGH])
    data: pathlib.Path = pathlib.Path("/data")
    access: Access = Access.READ | Access.WRITE


class Configured(pl.LightningModule):
    def __init__(self, config: ModelConfig, mode: Mode = Mode.FAST, extra: Optim | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(4, config.width)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, _ = batch
        return self.net(x).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.config.optim.lr)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(dataset(), batch_size=8)


def _trained_checkpoint(path: Path, plugins: list[Any]) -> Configured:
    model = Configured(ModelConfig(width=6, mode=Mode.FAST), mode=Mode.SLOW, extra=Optim(lr=0.5))
    run = pl.Trainer(
        max_steps=1,
        accelerator="cpu",
        devices=1,
        plugins=plugins,
        enable_checkpointing=False,
        enable_progress_bar=False,
        logger=False,
        enable_model_summary=False,
    )
    run.fit(model)
    run.save_checkpoint(path)
    return model


def test_dataclass_and_enum_hyperparameters_round_trip_as_with_lightnings_own_io(tmp_path: Path) -> None:
    model = _trained_checkpoint(tmp_path / "torch.ckpt", [])
    _trained_checkpoint(tmp_path / "shardkeep.ckpt", [ShardkeepCheckpointIO()])
    theirs = Configured.load_from_checkpoint(tmp_path / "torch.ckpt", weights_only=False)
    checkpoint = ShardkeepCheckpointIO().load_checkpoint(tmp_path / "shardkeep.ckpt")
    assert_same(
        checkpoint["hyper_parameters"], torch.load(tmp_path / "torch.ckpt", weights_only=False)["hyper_parameters"]
    )
    ours = Configured(**checkpoint["hyper_parameters"])
    ours.load_state_dict(checkpoint["state_dict"])
    assert ours.hparams == theirs.hparams == model.hparams
    config = ours.hparams.config
    assert type(config) is ModelConfig and type(config.optim) is Optim and type(config.mode) is Mode
    assert config.layers == [Level.LOW, Level.HIGH] and all(type(level) is Level for level in config.layers)
    assert config.access is Access.READ | Access.WRITE and ours.hparams.mode is Mode.SLOW
    assert sk.verify(tmp_path / "shardkeep.ckpt").ok


POST_INITS: list[int] = []


@dataclasses.dataclass(slots=True)
class Slotted:
    size: int = 1
    derived: int = dataclasses.field(init=False, default=0)

    def __post_init__(self) -> None:
        POST_INITS.append(self.size)
        self.derived = self.size * 10


def test_a_dataclass_keeps_attributes_set_after_init_and_init_is_not_run(tmp_path: Path) -> None:
    config = ModelConfig(width=2)
    config.note = "set later"  # type: ignore[attr-defined]  # pickle keeps it too
    slotted = Slotted(3)
    slotted.derived = 7  # changed after __post_init__: loading must not recompute it
    io = ShardkeepCheckpointIO()
    io.save_checkpoint({"hyper_parameters": {"config": config, "slotted": slotted}}, tmp_path / "x.ckpt")
    POST_INITS.clear()
    loaded = io.load_checkpoint(tmp_path / "x.ckpt")["hyper_parameters"]
    assert loaded["config"] == config and loaded["config"].note == "set later"
    assert type(loaded["slotted"]) is Slotted and loaded["slotted"].derived == 7 and POST_INITS == []


def test_a_hyperparameter_type_that_is_not_imported_is_a_typed_error_and_nothing_is_imported(tmp_path: Path) -> None:
    io = ShardkeepCheckpointIO()
    target = tmp_path / "x.ckpt"
    io.save_checkpoint({"hyper_parameters": {"config": ModelConfig(), "mode": Mode.FAST}}, target)
    # Rewrite the recorded type as a module that is installed but not imported: loading must not import it.
    state = sk.load(target)
    record = state[RESERVED_KEY]
    for conversion in record["conversions"]:
        if conversion["path"] == ["hyper_parameters", "config"]:
            conversion["cls"] = "antigravity:ModelConfig"  # importing it would open a web browser
    sk.save(state, tmp_path / "edited.ckpt")
    assert "antigravity" not in sys.modules
    with pytest.raises(sk.UnsupportedValueError, match=r"hyper_parameters\.config.*'antigravity' is not imported"):
        io.load_checkpoint(tmp_path / "edited.ckpt")
    assert "antigravity" not in sys.modules
    for conversion in record["conversions"]:
        if conversion["path"] == ["hyper_parameters", "config"]:
            conversion["cls"] = f"{__name__}:Tiny"  # importable, but not a dataclass
    sk.save(state, tmp_path / "edited2.ckpt")
    with pytest.raises(sk.IntegrityError, match="not a dataclass"):
        io.load_checkpoint(tmp_path / "edited2.ckpt")


#: What the user code of the classes below ran; a hostile record must run none of it.
USER_CODE_CALLS: list[str] = []


@dataclasses.dataclass
class Guarded:
    size: int = 1

    @property
    def limit(self) -> int:
        return 0

    @limit.setter
    def limit(self, value: int) -> None:
        USER_CODE_CALLS.append(f"limit setter {value}")


class Lenient(enum.Flag):
    READ = 1
    WRITE = 2

    @classmethod
    def _missing_(cls, value: object) -> Any:
        USER_CODE_CALLS.append(f"_missing_ {value}")
        return cls.READ


@pytest.mark.parametrize(
    ("conversion", "value"),
    [
        ({"type": "dataclass", "cls": f"{__name__}:Guarded"}, {"size": 2, "limit": 5}),
        ({"type": "dataclass", "cls": f"{__name__}:Guarded"}, {"__class__": "x"}),
        ({"type": "dataclass", "cls": f"{__name__}:Guarded"}, {"__dict__": {"size": 3}}),
        ({"type": "dataclass", "cls": f"{__name__}:Slotted"}, {"size": 2, "other": 1}),
        ({"type": "enum", "cls": f"{__name__}:Lenient", "by": "value"}, 3),
        ({"type": "enum", "cls": f"{__name__}:Lenient", "by": "value"}, 64),
        ({"type": "torch.dtype"}, "float32_not"),
        ({"type": "torch.dtype"}, "Tensor"),
    ],
    ids=[
        "dataclass-property-setter",
        "dataclass-class-attribute",
        "dataclass-dict-attribute",
        "slots-dataclass-unknown-attribute",
        "flag-with-user-missing",
        "flag-with-user-missing-unknown-bit",
        "dtype-unknown",
        "dtype-not-a-dtype",
    ],
)
def test_a_hostile_conversion_record_runs_no_user_code(tmp_path: Path, conversion: dict[str, Any], value: Any) -> None:
    target = tmp_path / "hostile.ckpt"
    record = {"format": 1, "conversions": [{"path": ["hyper_parameters", "x"], **conversion}]}
    save_crafted(target, record, x=value)
    USER_CODE_CALLS.clear()
    with pytest.raises(sk.IntegrityError, match=re_escape(str(target))):
        ShardkeepCheckpointIO().load_checkpoint(target)
    assert USER_CODE_CALLS == []


def test_a_dataclass_with_a_property_and_a_flag_with_missing_still_round_trip(tmp_path: Path) -> None:
    guarded = Guarded(4)
    guarded.note = "kept"  # type: ignore[attr-defined]  # a plain instance attribute
    io = ShardkeepCheckpointIO()
    io.save_checkpoint({"hyper_parameters": {"g": guarded, "f": Lenient.READ}}, tmp_path / "x.ckpt")
    USER_CODE_CALLS.clear()
    loaded = io.load_checkpoint(tmp_path / "x.ckpt")["hyper_parameters"]
    assert loaded["g"] == guarded and loaded["g"].note == "kept" and loaded["f"] is Lenient.READ
    assert USER_CODE_CALLS == []


@pytest.mark.parametrize("submodule", ["onnx", "_dynamo"])
def test_a_torch_dtype_record_imports_no_torch_submodule(submodule: str) -> None:
    # In a fresh process: this one imported Lightning, which imports these submodules itself.
    script = f"""
import sys
import shardkeep as sk
from shardkeep.conversions import decode_values
assert "torch.{submodule}" not in sys.modules
record = {{"format": 1, "conversions": [{{"path": ["x"], "type": "torch.dtype"}}]}}
try:
    decode_values({{"x": "{submodule}"}}, record, source="crafted")
except sk.IntegrityError as exc:
    assert "crafted" in str(exc), exc
else:
    raise SystemExit("no IntegrityError")
print("torch.{submodule}" in sys.modules)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
