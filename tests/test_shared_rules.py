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
from shardkeep.tensors.flatten import as_manifest_mapping, is_manifest_value, is_plain_json
from shardkeep.training import json_mapping


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
            sk.save({"w": torch.ones(1)}, tmp_path / "c", custom_fields=fields)
        assert not (tmp_path / "c").exists()
