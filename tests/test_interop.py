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
from shardkeep.cli import main
from shardkeep.integrity import generate_key_pair
from shardkeep.interop import detect_format, export_checkpoint, import_checkpoint
from tests.support.states import assert_same_tree, make_state


def _training_state() -> dict[str, Any]:
    state = make_state()
    return {
        "model": state["model"].state_dict(),
        "optim": state["optim"].state_dict(),
        "step": 7,
        "config": {"name": "tiny"},
    }


def test_a_torch_file_round_trips_through_a_checkpoint(tmp_path: Path) -> None:
    state = _training_state()
    torch.save(state, tmp_path / "model.pt")
    manifest = import_checkpoint(tmp_path / "model.pt", tmp_path / "ckpt")
    assert manifest.custom_fields["imported_from"] == {"format": "pt", "path": "model.pt"}
    assert_same_tree(state, sk.load(tmp_path / "ckpt"))
    summary = export_checkpoint(tmp_path / "ckpt", tmp_path / "back.pt")
    assert summary.format == "pt" and summary.tensors == 16  # 4 parameters, 2 x 6 optimizer tensors
    assert_same_tree(state, torch.load(tmp_path / "back.pt", weights_only=True))
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
    assert_same_tree(tensors, sk.load(tmp_path / "ckpt"))

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
    assert_same_tree(state, sk.load(tmp_path / "ckpt"))


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


def _adamw_trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    return model, optim


def test_a_dcp_import_gives_every_parameter_its_optimizer_state_back(tmp_path: Path) -> None:
    """DCP writes optimizer.state_dict()'s integer state keys as '0', '1' ...: the import turns
    them back, so a load into an optimizer restores the Adam state of every parameter."""
    import torch.distributed.checkpoint as dcp

    model, optim = _adamw_trained(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        state = {"model": model.state_dict(), "optim": optim.state_dict()}
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")), no_dist=True)
    import_checkpoint(tmp_path / "dcp", tmp_path / "ckpt", trust_pickle=True)
    target_model, target_optim = _adamw_trained(1)
    target_optim.state.clear()
    sk.load(tmp_path / "ckpt", into={"model": target_model, "optim": target_optim})
    params = list(target_model.parameters())
    assert len(target_optim.state) == len(params)
    for param, original in zip(params, model.parameters(), strict=True):
        saved = optim.state[original]
        for field in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(target_optim.state[param][field], saved[field]), field


def test_string_keyed_optimizer_state_is_matched_or_refused_on_load(tmp_path: Path) -> None:
    """A checkpoint already holding string state keys (an import by an older shardkeep, or any
    string-keyed source) loads with its state matched to the parameters; a key that matches no
    parameter is refused instead of dropped in silence."""
    model, optim = _adamw_trained(0)
    saved = optim.state_dict()
    as_strings = {"state": {str(k): v for k, v in saved["state"].items()}, "param_groups": saved["param_groups"]}
    sk.save({"optim": as_strings}, tmp_path / "strings")
    target_model, target_optim = _adamw_trained(1)
    sk.load(tmp_path / "strings", into={"optim": target_optim})
    assert all(
        torch.equal(target_optim.state[p]["exp_avg"], optim.state[o]["exp_avg"])
        for p, o in zip(target_model.parameters(), model.parameters(), strict=True)
    )
    stray = {"state": {"7": saved["state"][0], 1: saved["state"][1]}, "param_groups": saved["param_groups"]}
    sk.save({"optim": stray}, tmp_path / "stray")
    _, fresh = _adamw_trained(2)
    before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in fresh.state.items()}
    with pytest.raises(sk.UnsupportedValueError, match=r"'optim'.*parameter id\(s\) \['7'\].*without their state"):
        sk.load(tmp_path / "stray", into={"optim": fresh})
    after = {id(p): s for p, s in fresh.state.items()}
    assert after.keys() == before.keys()
    assert all(torch.equal(after[p][k], v) for p, fields in before.items() for k, v in fields.items())


def test_adamw_state_into_sgd_is_refused_naming_both(tmp_path: Path) -> None:
    model, optim = _adamw_trained(0)
    sk.save({"model": model, "optim": optim}, tmp_path / "ckpt")
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(sk.UnsupportedValueError, match=r"'optim'.*AdamW state but the target is SGD.*momentum"):
        sk.load(tmp_path / "ckpt", into={"model": model, "optim": sgd})
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert sgd.param_groups[0]["momentum"] == 0.9 and "betas" not in sgd.param_groups[0]
    adam = torch.optim.Adam(model.parameters())  # same layout and options as AdamW: accepted, as torch does
    sk.load(tmp_path / "ckpt", into={"model": model, "optim": adam})


def test_a_damaged_dcp_directory_raises_a_typed_error(tmp_path: Path) -> None:
    """DCP's CheckpointException derives from BaseException only; it must not escape."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"w": torch.randn(64, 64)}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")), no_dist=True)
    data = next(p for p in (tmp_path / "dcp").iterdir() if p.suffix == ".distcp")
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(sk.IntegrityError, match=r"reading the DCP checkpoint failed") as caught:
        import_checkpoint(tmp_path / "dcp", tmp_path / "ckpt", trust_pickle=True)
    assert caught.value.__cause__ is not None
    assert not (tmp_path / "ckpt").exists()


def test_state_of_an_optimizer_with_the_same_options_but_other_fields_is_refused(tmp_path: Path) -> None:
    """Adamax and RAdam have the same group options; Adamax keeps exp_inf, RAdam exp_avg_sq.
    Refused whether the target has stepped or not (then one step on a scratch parameter tells)."""
    model = torch.nn.Linear(3, 3)
    adamax = torch.optim.Adamax(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    adamax.step()
    sk.save({"optim": adamax}, tmp_path / "ckpt")
    fresh = torch.optim.RAdam(model.parameters())
    stepped = torch.optim.RAdam(model.parameters())
    stepped.step()
    for target in (fresh, stepped):
        with pytest.raises(sk.UnsupportedValueError, match=r"'optim'.*Adamax.*exp_inf.*RAdam keeps.*exp_avg_sq"):
            sk.load(tmp_path / "ckpt", into={"optim": target})
    assert not fresh.state
    again = torch.optim.Adamax(model.parameters())
    sk.load(tmp_path / "ckpt", into={"optim": again})
    assert all(torch.equal(again.state[p]["exp_inf"], adamax.state[p]["exp_inf"]) for p in model.parameters())
