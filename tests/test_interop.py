"""``shardkeep import`` / ``export``: torch files, safetensors files and DCP directories in, one
torch or safetensors file out."""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import shardkeep as sk
from conftest import make_state
from shardkeep.cli import main
from shardkeep.integrity import generate_key_pair
from shardkeep.interop import detect_format, export_checkpoint, import_checkpoint


def _training_state() -> dict[str, Any]:
    state = make_state()
    return {
        "model": state["model"].state_dict(),
        "optim": state["optim"].state_dict(),
        "step": 7,
        "config": {"name": "tiny"},
    }


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b) and a.dtype == b.dtype, where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{index}]")
    else:
        assert a == b, where


def test_a_torch_file_round_trips_through_a_checkpoint(tmp_path: Path) -> None:
    state = _training_state()
    torch.save(state, tmp_path / "model.pt")
    manifest = import_checkpoint(tmp_path / "model.pt", tmp_path / "ckpt")
    assert manifest.custom_fields["imported_from"] == {"format": "pt", "path": "model.pt"}
    _assert_same(state, sk.load(tmp_path / "ckpt"))
    summary = export_checkpoint(tmp_path / "ckpt", tmp_path / "back.pt")
    assert summary.format == "pt" and summary.tensors == 16  # 4 parameters, 2 x 6 optimizer tensors
    _assert_same(state, torch.load(tmp_path / "back.pt", weights_only=True))
    with pytest.raises(sk.CheckpointExistsError, match="already exists"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "back.pt")
    export_checkpoint(tmp_path / "ckpt", tmp_path / "back.pt", overwrite=True)
    assert not list(tmp_path.glob(".*.tmp"))
    sk.save({"array": np.arange(5, dtype=np.int32), "w": torch.ones(2)}, tmp_path / "with_numpy")
    export_checkpoint(tmp_path / "with_numpy", tmp_path / "numpy.pt")
    exported = torch.load(tmp_path / "numpy.pt", weights_only=True)  # numpy arrays become tensors
    assert torch.equal(exported["array"], torch.arange(5, dtype=torch.int32))


def test_a_safetensors_file_round_trips_with_its_values(tmp_path: Path) -> None:
    tensors = {"embed.weight": torch.randn(10, 4), "head.bias": torch.arange(3, dtype=torch.int64)}
    save_file(tensors, tmp_path / "m.safetensors", metadata={"format": "pt", "origin": "test"})
    assert detect_format(tmp_path / "m.safetensors") == "safetensors"
    manifest = import_checkpoint(tmp_path / "m.safetensors", tmp_path / "ckpt")
    assert manifest.custom_fields["safetensors_metadata"] == {"format": "pt", "origin": "test"}
    _assert_same(tensors, sk.load(tmp_path / "ckpt"))

    sk.save(_training_state(), tmp_path / "train")
    export_checkpoint(tmp_path / "train", tmp_path / "flat.safetensors")
    flat = load_file(tmp_path / "flat.safetensors")
    assert torch.equal(flat["model.0.weight"], _training_state()["model"]["0.weight"])
    assert "optim.state.0.exp_avg" in flat
    reimported = tmp_path / "again"
    import_checkpoint(tmp_path / "flat.safetensors", reimported)
    again = sk.load(reimported)
    assert again["step"] == 7 and again["config"] == {"name": "tiny"}  # JSON values come back
    assert torch.equal(again["model.0.weight"], flat["model.0.weight"])


def test_a_dcp_directory_needs_trust_pickle(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.randn(6, 3), "nested": {"b": torch.arange(4)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")), no_dist=True)
    assert detect_format(tmp_path / "dcp") == "dcp"
    with pytest.raises(sk.UnsupportedValueError, match=r"pickle.*runs whatever code.*--trust-pickle"):
        import_checkpoint(tmp_path / "dcp", tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
    err = io.StringIO()
    assert main(["import", str(tmp_path / "dcp"), str(tmp_path / "ckpt")], out=io.StringIO(), err=err) == 2
    assert "--trust-pickle" in err.getvalue()
    out = io.StringIO()
    assert main(["import", str(tmp_path / "dcp"), str(tmp_path / "ckpt"), "--trust-pickle"], out=out) == 0
    _assert_same(state, sk.load(tmp_path / "ckpt"))


def test_refusals_are_typed_and_name_the_input(tmp_path: Path) -> None:
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(sk.UnsupportedValueError, match=r"junk\.pt"):
        import_checkpoint(tmp_path / "junk.pt", tmp_path / "a")
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    with pytest.raises(sk.UnsupportedValueError, match=r"junk\.safetensors"):
        import_checkpoint(tmp_path / "junk.safetensors", tmp_path / "b")
    torch.save([torch.zeros(1)], tmp_path / "list.pt")
    with pytest.raises(sk.UnsupportedValueError, match="not a mapping"):
        import_checkpoint(tmp_path / "list.pt", tmp_path / "c")
    with pytest.raises(sk.CheckpointNotFoundError):
        import_checkpoint(tmp_path / "missing.pt", tmp_path / "d")
    (tmp_path / "plain_dir").mkdir()
    with pytest.raises(sk.UnsupportedValueError, match=r"\.metadata"):
        import_checkpoint(tmp_path / "plain_dir", tmp_path / "e")
    sk.save({"x": float("nan"), "w": torch.zeros(1)}, tmp_path / "nan")
    with pytest.raises(sk.UnsupportedValueError, match="no safetensors form"):
        export_checkpoint(tmp_path / "nan", tmp_path / "nan.safetensors")
    with pytest.raises(sk.ConfigError, match="cannot tell the format"):
        export_checkpoint(tmp_path / "nan", tmp_path / "out.bin2")
    assert not list(tmp_path.glob(".*.tmp"))


def test_cli_import_signs_and_export_checks_the_signature(tmp_path: Path) -> None:
    generate_key_pair(tmp_path / "k.pem", tmp_path / "k.pub")
    torch.save(_training_state(), tmp_path / "model.pt")
    out = io.StringIO()
    assert (
        main(["import", str(tmp_path / "model.pt"), str(tmp_path / "ckpt"), "--key", str(tmp_path / "k.pem")], out=out)
        == 0
    )
    assert "16 tensor(s)" in out.getvalue() and "signed" in out.getvalue()
    assert sk.verify(tmp_path / "ckpt", public_key=tmp_path / "k.pub").ok
    out = io.StringIO()
    args = [
        "export",
        str(tmp_path / "ckpt"),
        str(tmp_path / "out.safetensors"),
        "--public-key",
        str(tmp_path / "k.pub"),
    ]
    assert main(args, out=out) == 0
    assert "safetensors" in out.getvalue()
    meta = json.loads(load_file_metadata(tmp_path / "out.safetensors")["shardkeep.values"])
    assert meta["step"] == 7
    generate_key_pair(tmp_path / "other.pem", tmp_path / "other.pub")
    err = io.StringIO()
    args = ["export", str(tmp_path / "ckpt"), str(tmp_path / "x.pt"), "--public-key", str(tmp_path / "other.pub")]
    assert main(args, out=io.StringIO(), err=err) == 2
    assert "made with key" in err.getvalue() and not (tmp_path / "x.pt").exists()


def load_file_metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return dict(handle.metadata() or {})
