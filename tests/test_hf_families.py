"""Hugging Face model families, both ways, theirs and ours: for GPT-2, Llama (untied and tied),
BERT (masked LM), T5, Mixtral and Qwen2-MoE, each a tiny config built in code (nothing
downloaded):

- theirs: ``save_pretrained`` then ``from_pretrained`` gives the same outputs;
- import: ``save_pretrained`` -> ``shardkeep import`` -> ``shardkeep.load(into=)`` a fresh model
  gives the same outputs, and the checkpoint holds the model's own state_dict keys (the fused
  expert tensors of transformers 5 for the MoE models);
- export: ``shardkeep.save`` -> ``shardkeep export --format hf`` with the config written by
  ``config.to_json_file`` (no ``architectures``, as docs/integrations.md does it) ->
  ``from_pretrained`` finds every weight and gives the same outputs; the folder holds the files,
  keys, bytes and index ``save_pretrained`` writes for the same shard size;
- re-export: an imported folder exported again is the folder ``save_pretrained`` wrote.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import shardkeep as sk
from shardkeep.cli import main
from shardkeep.hf import read_folder

transformers = pytest.importorskip("transformers")

TOKENS = torch.tensor([[3, 17, 42, 5, 60, 1, 33, 7]])
SHARD = "20KB"  # several files for every family


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def _gpt2() -> Any:
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    return transformers.GPT2LMHeadModel(config)


def _llama(tied: bool) -> Callable[[], Any]:
    def build() -> Any:
        config = transformers.LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=64,
            max_position_embeddings=32,
            tie_word_embeddings=tied,
        )
        return transformers.LlamaForCausalLM(config)

    return build


def _bert() -> Any:
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=64,
        max_position_embeddings=32,
    )  # fmt: skip
    return transformers.BertForMaskedLM(config)


def _t5() -> Any:
    config = transformers.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=2, vocab_size=64)
    return transformers.T5ForConditionalGeneration(config)


def _mixtral() -> Any:
    config = transformers.MixtralConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config)


def _qwen2_moe() -> Any:
    config = transformers.Qwen2MoeConfig(
        hidden_size=32, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=64, num_experts=4,
        num_experts_per_tok=2, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.Qwen2MoeForCausalLM(config)


#: name -> (builder, the --model-class the docs' export recipe needs: None when the keys tell).
FAMILIES: dict[str, tuple[Callable[[], Any], str | None]] = {
    "gpt2": (_gpt2, None),
    "llama": (_llama(tied=False), None),
    "llama-tied": (_llama(tied=True), None),
    # BertForMaskedLM and BertLMHeadModel have the same keys: the class must be named.
    "bert-mlm": (_bert, "BertForMaskedLM"),
    "t5": (_t5, None),
    "mixtral": (_mixtral, None),
    "qwen2-moe": (_qwen2_moe, None),
}


def _model(name: str, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return FAMILIES[name][0]().eval()


def _outputs(model: Any) -> torch.Tensor:
    with torch.no_grad():
        if model.config.is_encoder_decoder:
            return model(input_ids=TOKENS, decoder_input_ids=TOKENS[:, :4]).logits
        return model(TOKENS).logits


def _from_pretrained(folder: Path) -> Any:
    """The class ``config.json`` names, loaded from ``folder``, after checking every weight was found."""
    names = json.loads((folder / "config.json").read_text())["architectures"]
    loaded, info = getattr(transformers, names[0]).from_pretrained(folder, output_loading_info=True)
    assert not any(info[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return loaded.eval()


def _run(*argv: str) -> str:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    assert code == 0, err.getvalue()
    return out.getvalue()


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return read_folder(folder).tensors


def _same_folder(ours: Path, theirs: Path) -> None:
    """Same weight files, keys, bytes and index as ``save_pretrained`` wrote."""
    weight_files = sorted(name for name in os.listdir(theirs) if name.endswith(".safetensors"))
    assert sorted(name for name in os.listdir(ours) if name.endswith(".safetensors")) == weight_files
    assert len(weight_files) > 1
    assert json.loads((ours / "model.safetensors.index.json").read_text()) == json.loads(
        (theirs / "model.safetensors.index.json").read_text()
    )
    mine, expected = _weights(ours), _weights(theirs)
    assert set(mine) == set(expected)
    for key, tensor in expected.items():
        assert mine[key].dtype == tensor.dtype and torch.equal(mine[key], tensor), key
    assert (
        json.loads((ours / "config.json").read_text())["architectures"]
        == json.loads((theirs / "config.json").read_text())["architectures"]
    )


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_both_ways_theirs_and_ours(name: str, tmp_path: Path) -> None:
    model = _model(name)
    expected = _outputs(model)
    model.config.to_json_file(tmp_path / "config.json")  # the docs' recipe, before save_pretrained names the class
    theirs = tmp_path / "theirs"
    model.save_pretrained(theirs, max_shard_size=SHARD)
    assert torch.equal(_outputs(_from_pretrained(theirs)), expected)  # their round trip

    # Import: what from_pretrained reads, sk.load fills into a fresh model.
    _run("import", str(theirs), str(tmp_path / "imported"), "--format", "hf")
    manifest = sk.read_manifest(tmp_path / "imported")
    assert manifest.custom_fields["imported_from"]["keys"].startswith(f"the state_dict keys of {type(model).__name__}")
    fresh = _model(name, seed=1)
    assert not torch.equal(_outputs(fresh), expected)
    sk.load(tmp_path / "imported", into={"model": fresh})
    assert torch.equal(_outputs(fresh), expected)
    stored = set(sk.load(tmp_path / "imported")["model"])
    assert stored <= set(model.state_dict()), sorted(stored - set(model.state_dict()))[:5]

    # Re-export of the import: the folder save_pretrained wrote.
    _run("export", str(tmp_path / "imported"), str(tmp_path / "again"), "--format", "hf", "--max-shard-size", SHARD)
    _same_folder(tmp_path / "again", theirs)

    # Export of a training checkpoint with the docs' recipe (config.to_json_file: no architectures).
    sk.save({"model": model, "step": 3}, tmp_path / "ckpt")
    assert not json.loads((tmp_path / "config.json").read_text()).get("architectures")
    argv = ["export", str(tmp_path / "ckpt"), str(tmp_path / "ours"), "--format", "hf", "--max-shard-size", SHARD]
    argv += ["--config", str(tmp_path / "config.json")]
    model_class = FAMILIES[name][1]
    if model_class is not None:
        out, err = io.StringIO(), io.StringIO()
        assert main(argv, out=out, err=err) == 2 and "--model-class" in err.getvalue(), err.getvalue()
        assert model_class in err.getvalue() and not (tmp_path / "ours").exists()
        argv += ["--model-class", model_class]
    out = _run(*argv)
    assert f"keys checked against {type(model).__name__}" in out
    _same_folder(tmp_path / "ours", theirs)
    assert torch.equal(_outputs(_from_pretrained(tmp_path / "ours")), expected)


def test_an_import_without_transformers_keeps_the_folder_keys_and_exports_the_same_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model("mixtral")
    model.save_pretrained(tmp_path / "theirs", max_shard_size=SHARD)
    with monkeypatch.context() as hidden:
        hidden.setitem(__import__("sys").modules, "transformers", None)  # import transformers raises ImportError
        _run("import", str(tmp_path / "theirs"), str(tmp_path / "imported"))
    keys = sk.read_manifest(tmp_path / "imported").custom_fields["imported_from"]["keys"]
    assert keys == "as in the folder (transformers is not installed to convert them)"
    assert set(sk.load(tmp_path / "imported")["model"]) == set(_weights(tmp_path / "theirs"))
    # The export recognises a folder's keys: the folder written is the one save_pretrained wrote.
    out = _run(
        "export", str(tmp_path / "imported"), str(tmp_path / "again"), "--format", "hf", "--max-shard-size", SHARD
    )
    assert "keys checked against MixtralForCausalLM" in out
    _same_folder(tmp_path / "again", tmp_path / "theirs")


def test_the_model_class_given_is_the_one_checked(tmp_path: Path) -> None:
    from shardkeep.hf import export_hf

    model = _model("bert-mlm")
    sk.save({"model": model}, tmp_path / "ckpt")
    config = model.config.to_dict()
    with pytest.raises(sk.ConfigError, match="do not fit BertForSequenceClassification"):
        export_hf(tmp_path / "ckpt", tmp_path / "hf", config=config, model_class="BertForSequenceClassification")
    with pytest.raises(sk.ConfigError, match="names the architecture 'pipeline'"):
        export_hf(tmp_path / "ckpt", tmp_path / "hf", config=config, model_class="pipeline")
    with pytest.raises(sk.ConfigError, match="needs a config and the key check"):
        export_hf(tmp_path / "ckpt", tmp_path / "hf", model_class="BertForMaskedLM")
    assert not (tmp_path / "hf").exists()
    # A config naming another class: the class given wins, and config.json names it.
    config["architectures"] = ["BertLMHeadModel"]
    summary = export_hf(tmp_path / "ckpt", tmp_path / "hf", config=config, model_class="BertForMaskedLM")
    assert summary.checked_against == "BertForMaskedLM" and any("names BertLMHeadModel" in n for n in summary.notes)
    assert torch.equal(_outputs(_from_pretrained(tmp_path / "hf")), _outputs(model))
