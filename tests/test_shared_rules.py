"""One rule per question, whatever the entry point: what the manifest stores as a plain value
(``is_manifest_value``), what a size string means (``parse_size``), and what ``into=`` holds at a
key (``tensors.targets.resolve``)."""

from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import shardkeep as sk
from shardkeep.loading import held_keys
from shardkeep.tensors.flatten import as_manifest_mapping, is_manifest_value, is_plain_json
from shardkeep.tensors.regions import wanted_regions
from shardkeep.tensors.targets import resolve
from shardkeep.training import json_mapping
from shardkeep.verification import read_manifest
from tests.support.distributed_harness import results_or_raise, run_ranks


class _Text(str):
    pass


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


# value -> (one JSON value; expanded with NaN and int keys; expanded with exact types only)
VALUES: list[tuple[str, Any, tuple[bool, bool, bool]]] = [
    ("none", None, (True, True, True)),
    ("bool", True, (True, True, True)),
    ("uint64 max", (1 << 64) - 1, (True, True, True)),
    ("int64 min", -(1 << 63), (True, True, True)),
    ("65-bit int", 1 << 64, (False, False, False)),
    ("below int64", -(1 << 63) - 1, (False, False, False)),
    ("float", 1.5, (True, True, True)),
    ("nan", math.nan, (False, True, True)),
    ("-inf", -math.inf, (False, True, True)),
    ("text", "héllo", (True, True, True)),
    ("lone surrogate", "\ud800", (True, True, False)),
    ("str subclass", _Text("x"), (True, True, False)),
    ("numpy float", np.float64(0.5), (True, True, False)),
    ("list", [1, "a", None], (True, True, True)),
    ("tuple", (1, 2), (False, True, True)),
    ("tuple in a list", [1, (2, 3)], (False, True, True)),
    ("str keys", {"a": {"b": [1]}}, (True, True, True)),
    ("int keys", {1: "a"}, (False, True, True)),
    ("bool keys", {True: "a"}, (False, False, False)),
    ("surrogate key", {"\udc80": 1}, (True, True, False)),
    ("OrderedDict", OrderedDict(a=1), (False, False, False)),
    ("set", {1, 2}, (False, False, False)),
    ("bytes", b"x", (False, False, False)),
    ("nested 24", _nested(24), (True, True, True)),
    ("nested 25", _nested(25), (False, True, True)),
    ("nested 65", _nested(65), (False, False, False)),
]


@pytest.mark.parametrize(("name", "value", "expected"), VALUES, ids=[case[0] for case in VALUES])
def test_one_rule_says_what_the_manifest_stores_as_a_value(name: str, value: Any, expected: tuple[bool, ...]) -> None:
    plain, expanded, exact = expected
    assert is_manifest_value(value) is plain
    assert is_plain_json(value) is plain
    assert is_manifest_value(value, allow_nonfinite=True, allow_int_keys=True) is expanded
    assert is_manifest_value(value, allow_nonfinite=True, allow_int_keys=True, exact_types=True) is exact
    assert is_manifest_value(value, allow_nonfinite=True) is (plain or name in ("nan", "-inf"))


@pytest.mark.parametrize(("name", "value", "expected"), VALUES, ids=[case[0] for case in VALUES])
def test_custom_fields_and_training_fields_accept_the_same_values(
    tmp_path: Path, name: str, value: Any, expected: tuple[bool, ...]
) -> None:
    """``sk.save(custom_fields=)``, a TrainingCheckpoint's ``model_args`` and the manager's
    ``fingerprint`` refuse exactly the mappings that are not one JSON value."""
    fields = {"k": value}
    accepted = expected[0] and name != "nested 24"  # the mapping adds one level
    assert (as_manifest_mapping(fields) == fields) is accepted
    if accepted:
        assert json_mapping("model_args", fields) == fields
    else:
        with pytest.raises(sk.CheckpointFieldError, match="model_args"):
            json_mapping("model_args", fields)
        with pytest.raises(sk.UnsupportedValueError, match="custom_fields= must be a mapping of plain JSON"):
            sk.save({"w": torch.ones(1)}, tmp_path / "c", fields=sk.ManifestFields(custom_fields=fields))
        assert not (tmp_path / "c").exists()


# -- sizes: one unit table for a tier's size_budget and an export's max_shard_size ------------

# Every unit either parser read, with what it means: K/KB ... PB are powers of 1000 (as
# save_pretrained reads them), KiB ... PiB powers of 1024, in any case.
SIZES = {
    "1000": 1000,
    "7B": 7,
    "40GB": 40 * 10**9,
    "40gb": 40 * 10**9,
    "5 GB": 5 * 10**9,
    "500MB": 500 * 10**6,
    "3KB": 3000,
    "2TB": 2 * 10**12,
    "1PB": 10**15,
    "3k": 3000,
    "2m": 2 * 10**6,
    "1g": 10**9,
    "1t": 10**12,
    "1p": 10**15,
    "2KiB": 2048,
    "1.5MiB": 1572864,
    "2GiB": 2 << 30,
    "2gib": 2 << 30,
    "1TiB": 1 << 40,
    "1PiB": 1 << 50,
    " 12 mb ": 12 * 10**6,
}


def test_one_size_table_for_tier_budgets_and_shard_sizes() -> None:
    from shardkeep.config import parse_size
    from shardkeep.integrations.hf import parse_size as shard_size
    from shardkeep.tiers import parse_size as budget

    for text, size in SIZES.items():
        assert parse_size(text, where="x") == size, text
        assert budget(text) == size and shard_size(text) == size, text
    assert budget(None) is None and budget(0) == 0 and budget("0") == 0 and budget(7) == 7
    assert shard_size(1234) == 1234 and shard_size(2e9) == 2 * 10**9
    for bad in ("5 parsecs", "-1", "", "1 KiBB", "ki", "1e3", "GB", True, [1], math.nan):
        with pytest.raises(sk.ConfigError, match=r"size_budget=.*(not a size|must be a size)"):
            budget(bad)  # type: ignore[arg-type]  # wrong types on purpose
        with pytest.raises(sk.ConfigError, match=r"max_shard_size=.*(not a size|must be a size)"):
            shard_size(bad)  # type: ignore[arg-type]  # wrong types on purpose
    with pytest.raises(sk.ConfigError, match="size_budget=-1 must not be negative"):
        budget(-1)
    for empty in (0, "0", "0GB"):  # a shard holds at least one byte; a tier may have no room
        with pytest.raises(sk.ConfigError, match=r"max_shard_size=.* must be positive"):
            shard_size(empty)


# -- into=: one walk decides what into= holds and which DTensor region a rank reads ---------


class _LoadsOnly:
    """A stateful object with ``load_state_dict`` and no ``state_dict`` (the fill loads it)."""

    def load_state_dict(self, state: Any) -> None:
        self.state = state


def test_one_resolver_says_what_into_holds_at_a_saved_path() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 3))
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(5))], lr=0.1)
    stateful = _LoadsOnly()
    into: dict[str, Any] = {
        "w": torch.zeros(2),
        "slot": None,
        "list": [torch.zeros(1), (torch.zeros(6),)],
        "model": model,
        "optim": optimizer,
        "other": stateful,
        "plain": 3,
    }
    params = optimizer.param_groups[0]["params"]

    assert resolve(into, ["w"]).kind == "slot" and resolve(into, ["w"]).tensor is into["w"]
    assert resolve(into, ["slot"]).held and resolve(into, ["slot"]).value is None
    assert resolve(into, ["list", 1, 0]).tensor is into["list"][1][0]
    module_entry = resolve(into, ["model", "0.weight"])
    assert module_entry.kind == "module" and module_entry.owner is model
    assert module_entry.tensor is not None and module_entry.tensor.data_ptr() == model[0].weight.data_ptr()
    # Everything below an optimizer is its own; a state tensor is shaped like its parameter,
    # whether its id is an int (torch) or a decimal string (DCP).
    assert resolve(into, ["optim", "state", 0, "momentum_buffer"]).tensor is params[0]
    assert resolve(into, ["optim", "state", "1", "momentum_buffer"]).tensor is params[1]
    group = resolve(into, ["optim", "param_groups", 0, "lr"])
    assert group.kind == "whole_object" and group.owner is optimizer and group.tensor is None
    assert resolve(into, ["optim", "state", 7, "momentum_buffer"]).kind == "whole_object"
    assert resolve(into, ["other", "anything", 0]).owner is stateful
    for missing in (["slot", "x"], ["list", 2], ["list", "0"], ["model", "0.nope"], ["plain", "x"], ["absent"]):
        assert not resolve(into, missing).held, missing


def _save_and_resolve(rank: int, world_size: int, path: str) -> tuple[list[str], list[str], bool]:
    """A 2-rank save of DTensors that into= holds in a list and under an optimizer (state ids
    written as DCP writes them, decimal strings); then what each entry point says of them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))

    def sharded(value: torch.Tensor) -> Any:
        return distribute_tensor(value, mesh, [Shard(0)])

    saved = {
        "blocks": [sharded(torch.arange(32.0).reshape(8, 4))],
        "optim": {"state": {"0": {"exp_avg": sharded(torch.arange(8.0))}}, "param_groups": [{"params": ["0"]}]},
    }
    sk.save(saved, path)
    into = {
        "blocks": [sharded(torch.zeros(8, 4))],
        "optim": torch.optim.SGD([torch.nn.Parameter(sharded(torch.zeros(8)))], lr=0.1),
    }
    manifest = read_manifest(path)
    held = sorted(held_keys(into, manifest))
    wanted = sorted(wanted_regions(into, manifest))
    sk.load(path, into={"blocks": into["blocks"]}, select=sk.LoadSelection(extra="ignore"))
    return held, wanted, bool(torch.equal(into["blocks"][0].full_tensor(), torch.arange(32.0).reshape(8, 4)))


def test_what_into_holds_and_the_regions_a_rank_reads_agree(tmp_path: Path) -> None:
    """Every sharded key that into= holds as a DTensor (here in a list, and as the state of an
    optimizer over a DTensor parameter) is read as this rank's region only, and loads right."""
    outcomes = results_or_raise(run_ranks(2, _save_and_resolve, str(tmp_path / "ckpt"), outbox=tmp_path / "out"))
    for held, wanted, loaded in outcomes:
        assert held == ["blocks.0", "optim.state.0.exp_avg"]
        assert wanted == held
        assert loaded
