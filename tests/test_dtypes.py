"""Every dtype of the installed torch: saved and loaded exactly by ``sk.save``/``sk.load`` and by
the DCP adapter, or refused with the typed error that docs/manifest.md's refusal table lists
for it. The dtypes come from torch itself, so a dtype a new torch adds fails here until it is
supported or documented."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import shardkeep as sk
from shardkeep.dcp import ShardkeepReader, ShardkeepWriter

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized:UserWarning"),
    pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*quantize_per_tensor.*deprecated:UserWarning"),
]

DOCS = Path(__file__).resolve().parent.parent / "docs" / "manifest.md"
#: Every dtype the installed torch defines.
TORCH_DTYPES = sorted({value for value in vars(torch).values() if isinstance(value, torch.dtype)}, key=str)
_QUANTIZED = {torch.qint8, torch.qint32, torch.quint8, torch.quint4x2, torch.quint2x4}
#: Dtypes DCP's own planner cannot save (with its FileSystemWriter too): torch.iinfo refuses them.
_DCP_CANNOT = {torch.bits8, torch.bits16, torch.bits1x8, torch.bits2x4, torch.bits4x2}


def _documented_refusals() -> dict[str, str]:
    """torch dtype name -> error class name, from the refusal table of docs/manifest.md."""
    text = DOCS.read_text(encoding="utf-8")
    section = text.split("| refused torch dtype |", 1)[1].split("\n\n", 1)[0]
    return dict(re.findall(r"^\| `torch\.(\w+)` \| `(\w+)` \|", section, flags=re.MULTILINE))


def _sample(dtype: torch.dtype) -> torch.Tensor:
    """A 2x3 tensor of ``dtype`` whose bytes all differ (valid values for bool)."""
    if dtype in _QUANTIZED:
        return torch.quantize_per_tensor(torch.arange(6.0).reshape(2, 3), 0.5, 1, dtype)
    raw = torch.arange(6 * dtype.itemsize, dtype=torch.uint8) + 1
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(2, 3)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _zeros(like: torch.Tensor) -> torch.Tensor:
    """A tensor of ``like``'s dtype and shape holding zero bytes (zeros_like is not defined for
    every dtype)."""
    return torch.zeros(like.numel() * like.element_size(), dtype=torch.uint8).view(like.dtype).reshape(like.shape)


def _same_bytes(found: Any, expected: torch.Tensor) -> bool:
    return (
        isinstance(found, torch.Tensor)
        and found.dtype == expected.dtype
        and found.shape == expected.shape
        and torch.equal(_bytes(found), _bytes(expected))
    )


def test_the_refusal_table_lists_only_dtypes_torch_has() -> None:
    names = {str(dtype).removeprefix("torch.") for dtype in TORCH_DTYPES}
    refused = _documented_refusals()
    assert refused and set(refused) <= names, sorted(set(refused) - names)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_every_torch_dtype_round_trips_or_is_a_documented_refusal(tmp_path: Path, dtype: torch.dtype) -> None:
    tensor = _sample(dtype)
    refused = _documented_refusals().get(str(dtype).removeprefix("torch."))
    if refused is not None:
        with pytest.raises(getattr(sk, refused), match="'t'"):
            sk.save({"t": tensor, "ok": torch.ones(2)}, tmp_path / "ckpt")
        assert list(tmp_path.iterdir()) == []
        # Through DCP: refused too (by DCP's own planner, or by the writer, wrapped by DCP).
        with pytest.raises((CheckpointException, TypeError, sk.UnsupportedValueError)):
            dcp.save({"t": tensor}, storage_writer=ShardkeepWriter(tmp_path / "dcp"))
        assert not (tmp_path / "dcp").exists()
        return
    state = {"t": tensor, "scalar": tensor.reshape(-1)[1].clone(), "empty": tensor[:0], "strided": tensor.t()}
    sk.save(state, tmp_path / "ckpt")
    report = sk.verify(tmp_path / "ckpt")
    assert report.ok, report.problems
    loaded = sk.load(tmp_path / "ckpt")
    for key, value in state.items():
        assert _same_bytes(loaded[key], value.contiguous()), key
    targets = {key: _zeros(value) for key, value in state.items()}
    sk.load(tmp_path / "ckpt", into=targets)
    for key, value in state.items():
        assert _same_bytes(targets[key], value.contiguous()), key
    if dtype in _DCP_CANNOT:  # DCP's planner fails before any writer is called, its own included
        with pytest.raises(CheckpointException):
            dcp.save({"t": tensor}, checkpoint_id=tmp_path / "native")
        return
    dcp.save({"t": tensor}, storage_writer=ShardkeepWriter(tmp_path / "dcp"))
    target = {"t": _zeros(tensor)}
    dcp.load(target, storage_reader=ShardkeepReader(tmp_path / "dcp"))
    assert _same_bytes(target["t"], tensor)
    # An sk.save checkpoint, read through DCP.
    target = {"t": _zeros(tensor)}
    dcp.load(target, storage_reader=ShardkeepReader(tmp_path / "ckpt"))
    assert _same_bytes(target["t"], tensor)


def test_a_carried_dtype_leaves_every_shard_a_valid_safetensors_file(tmp_path: Path) -> None:
    from safetensors import safe_open

    values = torch.complex(torch.arange(6.0, dtype=torch.float64), -torch.arange(6.0, dtype=torch.float64))
    scales = torch.arange(4, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    sk.save({"z": values.reshape(2, 3), "scales": scales, "n": np.arange(3, dtype=np.complex128)}, tmp_path / "c")
    (shard,) = (tmp_path / "c" / "shards").iterdir()
    with safe_open(str(shard), framework="pt") as opened:
        assert torch.equal(opened.get_tensor("z"), torch.view_as_real(values.reshape(2, 3)))
        assert torch.equal(opened.get_tensor("scales"), scales.view(torch.uint8))
    loaded = sk.load(tmp_path / "c")
    assert torch.equal(loaded["z"], values.reshape(2, 3)) and loaded["scales"].dtype == torch.float8_e8m0fnu
    assert loaded["n"].dtype == np.complex128 and np.array_equal(loaded["n"], np.arange(3, dtype=np.complex128))


def test_a_dtype_safetensors_has_no_name_for_exports_to_pt_and_is_refused_for_safetensors(tmp_path: Path) -> None:
    from shardkeep.interop import export_checkpoint

    values = torch.arange(4.0, dtype=torch.float64).to(torch.complex128)
    sk.save({"z": values, "w": torch.ones(2)}, tmp_path / "c")
    with pytest.raises(sk.UnsupportedValueError, match=r"'z'.*complex128.*\.pt"):
        export_checkpoint(tmp_path / "c", tmp_path / "c.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    export_checkpoint(tmp_path / "c", tmp_path / "c.pt")
    assert torch.equal(torch.load(tmp_path / "c.pt", weights_only=True)["z"], values)


def test_shardkeep_imports_and_round_trips_on_a_torch_without_the_newest_dtypes(tmp_path: Path) -> None:
    """torch 2.4 to 2.6 (which pyproject allows) lack float8_e8m0fnu, float4_e2m1fn_x2 and may
    lack the bits* dtypes: the import must not name them, plain tensors still save and load, and
    a checkpoint holding such a dtype is refused on load with the documented typed error."""
    newer = tmp_path / "newer"
    sk.save({"scale": torch.ones(3).to(torch.float8_e8m0fnu)}, newer)
    script = f"""
import torch
for name in ("float8_e8m0fnu", "float4_e2m1fn_x2", "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2"):
    delattr(torch, name)
import shardkeep as sk
value = torch.arange(6, dtype=torch.float32)
sk.save({{"w": value}}, {str(tmp_path / "ckpt")!r})
assert torch.equal(sk.load({str(tmp_path / "ckpt")!r})["w"], value)
try:
    sk.load({str(newer)!r})
except sk.UnsupportedValueError as exc:
    assert "F8_E8M0" in str(exc), exc
else:
    raise SystemExit("loaded a dtype this torch lacks")
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
