"""``--format hf``: exporting a checkpoint's model as a folder that transformers'
``from_pretrained`` loads exactly, and importing such a folder; tiny GPT-2 (tied embeddings)
and Llama models built in code, nothing downloaded."""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import shardkeep as sk
from shardkeep.cli import main
from shardkeep.hf import export_hf, parse_size, read_folder
from shardkeep.interop import detect_format, export_checkpoint, import_checkpoint

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def _gpt2() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    config.architectures = ["GPT2LMHeadModel"]
    return transformers.GPT2LMHeadModel(config).eval()


def _llama() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=1,
    )
    config.architectures = ["LlamaForCausalLM"]
    return transformers.LlamaForCausalLM(config).eval()


MODELS = {"gpt2": _gpt2, "llama": _llama}
TOKENS = torch.tensor([[3, 17, 42, 5, 99, 1, 64, 7]])


def _logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def _load_exact(folder: Path, model: Any) -> Any:
    """The model from_pretrained builds from ``folder``, after checking it found every weight and
    gives the same logits as ``model``."""
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    loaded.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert torch.equal(_logits(loaded), _logits(model))
    for key, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], tensor), key
    return loaded


def _config_file(model: Any, tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    model.config.to_json_file(path)
    return path


def _run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_cli_export_loads_with_from_pretrained_exactly(name: str, tmp_path: Path) -> None:
    model = MODELS[name]()
    sk.save({"model": model, "step": 3}, tmp_path / "ckpt")
    config = _config_file(model, tmp_path)
    code, out, err = _run(
        "export", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--format", "hf", "--config", str(config)
    )
    assert code == 0, err
    assert f"keys checked against {type(model).__name__}" in out
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors"]
    from safetensors import safe_open

    with safe_open(tmp_path / "hf" / "model.safetensors", framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}
        keys = set(handle.keys())
    if name == "gpt2":  # the tied copy is written once, as save_pretrained writes it
        assert "lm_head.weight" not in keys and "transformer.wte.weight" in keys
        assert "tied copies left out: lm_head.weight" in out
    else:
        assert "lm_head.weight" in keys
    assert not [entry for entry in os.listdir(tmp_path) if entry.startswith(".")]
    _load_exact(tmp_path / "hf", model)


def test_api_export_shards_by_size_with_a_correct_index(tmp_path: Path) -> None:
    model = _llama()
    sk.save({"model": model, "step": 3}, tmp_path / "ckpt")
    summary = export_hf(tmp_path / "ckpt", tmp_path / "hf", config=_config_file(model, tmp_path), max_shard_size="20KB")
    weight_files = sorted(name for name in os.listdir(tmp_path / "hf") if name.endswith(".safetensors"))
    count = len(weight_files)
    assert count > 2 and weight_files[0] == f"model-00001-of-{count:05d}.safetensors"
    assert summary.files[-2:] == ("model.safetensors.index.json", "config.json")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    state = model.state_dict()
    assert set(index["weight_map"]) == set(state)
    assert set(index["weight_map"].values()) == set(weight_files)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    _load_exact(tmp_path / "hf", model)

    # Through export_checkpoint too, with a size in bytes.
    written = export_checkpoint(
        tmp_path / "ckpt", tmp_path / "hf2", format="hf", config=_config_file(model, tmp_path), max_shard_size=30_000
    )
    assert written.format == "hf" and written.tensors == len(state)
    _load_exact(tmp_path / "hf2", model)


def test_a_wrong_subtree_is_an_error_naming_the_keys_and_the_right_subtree(tmp_path: Path) -> None:
    model = _gpt2()
    sk.save({"model": model, "step": 3}, tmp_path / "ckpt")
    config = _config_file(model, tmp_path)
    with pytest.raises(
        sk.ConfigError, match=r"do not fit GPT2LMHeadModel: \d+ key\(s\) the model expects are missing"
    ) as caught:
        export_hf(tmp_path / "ckpt", tmp_path / "hf", subtree="model.transformer", config=config)
    assert "transformer.h.0.attn.c_attn.weight" in str(caught.value) and "not the model's (h.0." in str(caught.value)
    assert "subtree 'model' fits" in str(caught.value)
    code, _, err = _run(
        "export", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--format", "hf", "--subtree", "model.transformer",
        "--config", str(config),
    )  # fmt: skip
    assert code == 2 and "--subtree model" in err
    with pytest.raises(sk.ConfigError, match=r"no tensors under subtree 'net'.*'model' \(29 tensor\(s\)\)"):
        export_hf(tmp_path / "ckpt", tmp_path / "hf", subtree="net")
    with pytest.raises(sk.ConfigError, match="not the model's"):  # a Llama config for GPT-2 weights
        export_hf(tmp_path / "ckpt", tmp_path / "hf", config=_llama().config.to_dict())
    assert not (tmp_path / "hf").exists()
    assert not [entry for entry in os.listdir(tmp_path) if entry.startswith(".")]


def test_without_a_config_weights_only_and_the_check_is_said_skipped(tmp_path: Path) -> None:
    model = _gpt2()
    sk.save({"model": model, "step": 3}, tmp_path / "ckpt")
    code, out, err = _run("export", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--format", "hf")
    assert code == 0, err
    assert "keys not checked" in out and "note: no config" in out
    assert os.listdir(tmp_path / "hf") == ["model.safetensors"]
    # Both tied copies are there (nothing said which is the copy); from_pretrained ties equal ones.
    model.config.to_json_file(tmp_path / "hf" / "config.json")
    _load_exact(tmp_path / "hf", model)


def test_an_existing_destination_is_refused_unless_forced(tmp_path: Path) -> None:
    model = _gpt2()
    sk.save({"model": model, "step": 3}, tmp_path / "ckpt")
    config = str(_config_file(model, tmp_path))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "stale.txt").write_text("old")
    argv = ["export", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--format", "hf", "--config", config]
    code, _, err = _run(*argv)
    assert code == 2 and "already exists; pass --force" in err
    with pytest.raises(sk.CheckpointExistsError, match="already exists"):
        export_hf(tmp_path / "ckpt", tmp_path / "hf", config=config)
    assert _run(*argv, "--force")[0] == 0
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors"]
    with pytest.raises(sk.CheckpointExistsError, match="never replaces"):  # a checkpoint is never replaced
        export_hf(tmp_path / "ckpt", tmp_path / "ckpt", config=config, overwrite=True)
    code, _, err = _run("export", str(tmp_path / "ckpt"), str(tmp_path / "x.pt"), "--subtree", "model")
    assert code == 2 and "--subtree apply to --format hf only" in err
    assert not [entry for entry in os.listdir(tmp_path) if entry.startswith(".")]


def test_a_damaged_checkpoint_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    model = _gpt2()
    sk.save({"model": model, "step": 3}, tmp_path / "ckpt")
    shard = next((tmp_path / "ckpt" / "shards").iterdir())
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(sk.IntegrityError):
        export_hf(tmp_path / "ckpt", tmp_path / "hf", config=_config_file(model, tmp_path))
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_import_of_a_save_pretrained_folder_and_round_trip(sharded: bool, tmp_path: Path) -> None:
    model = _gpt2()
    model.save_pretrained(tmp_path / "pretrained", max_shard_size="20KB" if sharded else "5GB")
    assert (tmp_path / "pretrained" / "model.safetensors.index.json").exists() == sharded
    assert detect_format(tmp_path / "pretrained") == "hf"
    code, _, err = _run("import", str(tmp_path / "pretrained"), str(tmp_path / "ckpt"))
    assert code == 0, err
    assert sk.verify(tmp_path / "ckpt").ok
    manifest = sk.read_manifest(tmp_path / "ckpt")
    assert manifest.custom_fields["imported_from"] == {"format": "hf", "path": "pretrained"}
    state = sk.load(tmp_path / "ckpt")
    assert state["hf_config"]["model_type"] == "gpt2"
    written = state["model"]
    assert "lm_head.weight" not in written  # save_pretrained left the tied copy out
    for key, tensor in written.items():
        assert torch.equal(tensor, model.state_dict()[key]), key
    fresh = _gpt2()
    with torch.no_grad():
        for parameter in fresh.parameters():
            parameter.zero_()
    fresh.load_state_dict(written, strict=False)
    assert torch.equal(_logits(fresh), _logits(model))

    # Round trip: the config stored by the import is used by the export.
    summary = export_hf(tmp_path / "ckpt", tmp_path / "back")
    assert summary.config_source == "checkpoint value 'hf_config'" and summary.checked_against == "GPT2LMHeadModel"
    _load_exact(tmp_path / "back", model)


def test_import_under_another_subtree_through_the_api(tmp_path: Path) -> None:
    model = _llama()
    model.save_pretrained(tmp_path / "pretrained")
    import_checkpoint(tmp_path / "pretrained", tmp_path / "ckpt", source_format="hf", subtree="net.base")
    state = sk.load(tmp_path / "ckpt")
    assert set(state["net"]["base"]) == set(model.state_dict())
    code, _, err = _run("export", str(tmp_path / "ckpt"), str(tmp_path / "back"), "--format", "hf")
    assert code == 2 and "subtree 'net.base' fits" in err and "--subtree net.base" in err
    assert (
        _run("export", str(tmp_path / "ckpt"), str(tmp_path / "back"), "--format", "hf", "--subtree", "net.base")[0]
        == 0
    )
    _load_exact(tmp_path / "back", model)
    with pytest.raises(sk.ConfigError, match="Hugging Face folders only"):
        import_checkpoint(tmp_path / "x.pt", tmp_path / "c", source_format="pt", subtree="m")


def _sharded_folder(tmp_path: Path) -> Path:
    model = _gpt2()
    model.save_pretrained(tmp_path / "folder", max_shard_size="20KB")
    return tmp_path / "folder"


def _edit_index(folder: Path, edit: Any) -> None:
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    edit(index["weight_map"])
    path.write_text(json.dumps(index))


def test_a_bad_index_is_refused(tmp_path: Path) -> None:
    folder = _sharded_folder(tmp_path)

    _edit_index(folder, lambda weights: weights.update({"transformer.wte.weight": "../outside.safetensors"}))
    with pytest.raises(sk.UnsafePathError, match="not a plain name"):
        read_folder(folder)
    _edit_index(folder, lambda weights: weights.update({"transformer.wte.weight": "model-09999.safetensors"}))
    with pytest.raises(sk.CheckpointNotFoundError, match=r"model-09999\.safetensors"):
        read_folder(folder)
    folder = _sharded_folder(tmp_path / "again")
    _edit_index(folder, lambda weights: weights.pop(next(iter(weights))))
    with pytest.raises(sk.UnsupportedValueError, match="does not list"):
        read_folder(folder)
    folder = _sharded_folder(tmp_path / "third")
    key = next(iter(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]))
    other = sorted(name for name in os.listdir(folder) if name.endswith(".safetensors"))[-1]
    _edit_index(folder, lambda weights: weights.update({key: other}))
    with pytest.raises(sk.UnsupportedValueError, match=r"does not hold them|in two files"):
        read_folder(folder)
    # A key held by two files.
    from safetensors.torch import load_file, save_file

    folder = _sharded_folder(tmp_path / "fourth")
    names = sorted(name for name in os.listdir(folder) if name.endswith(".safetensors"))
    moved = load_file(folder / names[1])
    extra_key = next(iter(load_file(folder / names[0])))
    moved[extra_key] = load_file(folder / names[0])[extra_key]
    save_file(moved, folder / names[1], metadata={"format": "pt"})
    with pytest.raises(sk.UnsupportedValueError, match="in two files"):
        read_folder(folder)


def test_pickle_weights_are_refused_with_the_way_to_import_them(tmp_path: Path) -> None:
    _gpt2().save_pretrained(tmp_path / "bin")
    (tmp_path / "bin" / "model.safetensors").rename(tmp_path / "bin" / "pytorch_model.bin")
    code, _, err = _run("import", str(tmp_path / "bin"), str(tmp_path / "ckpt"))
    assert code == 2 and "pytorch_model.bin" in err and "--format pt" in err
    assert not (tmp_path / "ckpt").exists()


def test_sizes_parse_as_save_pretrained_reads_them() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 500 * 10**6 and parse_size(1234) == 1234
    assert parse_size("2GiB") == 2 << 30 and parse_size("1000") == 1000
    for bad in ("5 parsecs", "-1", "0", "", True):
        with pytest.raises(sk.ConfigError, match="max_shard_size"):
            parse_size(bad)  # type: ignore[arg-type]  # bool on purpose


def test_tied_copies_that_differ_are_both_written(tmp_path: Path) -> None:
    model = _gpt2()
    state = {key: tensor.clone() for key, tensor in model.state_dict().items()}
    state["lm_head.weight"] += 1.0
    sk.save({"model": state}, tmp_path / "ckpt")
    summary = export_hf(tmp_path / "ckpt", tmp_path / "hf", config=_config_file(model, tmp_path))
    assert summary.tied_dropped == () and any("differs" in note for note in summary.notes)
    assert set(read_folder(tmp_path / "hf").tensors) == set(state)


def test_export_without_transformers_when_no_check_is_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _gpt2()
    sk.save({"model": model, "step": 3}, tmp_path / "ckpt")
    config = _config_file(model, tmp_path)
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    with pytest.raises(sk.DependencyError, match="--skip-key-check"):
        export_hf(tmp_path / "ckpt", tmp_path / "hf", config=config)
    summary = export_hf(tmp_path / "ckpt", tmp_path / "hf", config=config, check_keys=False)
    assert summary.checked_against is None and any("key check was skipped" in note for note in summary.notes)
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors"]
    code, out, err = _run("export", str(tmp_path / "ckpt"), str(tmp_path / "w"), "--format", "hf")
    assert code == 0 and "keys not checked" in out, err


def test_a_config_naming_no_architecture_is_checked_against_the_causal_lm_class(tmp_path: Path) -> None:
    model = _gpt2()
    sk.save({"model": model}, tmp_path / "ckpt")
    config = model.config.to_dict()
    config.pop("architectures")
    # The base model's keys would fit GPT2Model, but from_pretrained of a causal LM would then
    # load them with its own head: refused, not checked against the base class.
    with pytest.raises(sk.ConfigError, match="do not fit GPT2LMHeadModel"):
        export_hf(tmp_path / "ckpt", tmp_path / "hf", subtree="model.transformer", config=config)
    summary = export_hf(tmp_path / "ckpt", tmp_path / "hf", config=config)
    assert summary.checked_against == "GPT2LMHeadModel" and summary.tied_dropped == ("lm_head.weight",)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    _load_exact(tmp_path / "hf", model)
