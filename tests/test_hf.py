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
    argv = ["export", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--format", "hf", "--config", config]
    assert _run(*argv)[0] == 0
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


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every entry under ``root`` (directories as None, files with their bytes)."""
    found: dict[str, bytes | None] = {}
    for path in sorted(root.rglob("*")):
        found[str(path.relative_to(root))] = None if path.is_dir() else path.read_bytes()
    return found


def test_overwrite_never_replaces_a_directory_holding_the_checkpoint(tmp_path: Path) -> None:
    # The reviewer's repro: exporting runs/step_2 to runs/ with overwrite removed both checkpoints
    # and notes.txt.
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "notes.txt").write_text("precious")
    sk.save({"model": {"w": torch.ones(2)}}, runs / "step_1")
    sk.save({"model": {"w": torch.ones(2) * 2}}, runs / "step_2")
    (tmp_path / "alias").symlink_to(runs)
    before = _tree(tmp_path)
    for dest in (runs, tmp_path, tmp_path / "alias"):
        with pytest.raises(sk.UnsafePathError, match="holds the checkpoint being exported"):
            export_hf(runs / "step_2", dest, check_keys=False, overwrite=True)
        code, out, err = _run("export", str(runs / "step_2"), str(dest), "--format", "hf", "--force")
        assert code == 2 and "holds the checkpoint being exported" in err and out == "", err
    assert _tree(tmp_path) == before
    assert sk.verify(runs / "step_1").ok and sk.verify(runs / "step_2").ok

    # Another checkpoint below the destination: refused too, naming it.
    other = tmp_path / "other"
    sk.save({"model": {"w": torch.ones(2)}}, other / "kept")
    (other / "model.safetensors").write_bytes(b"not an export")
    before = _tree(tmp_path)
    with pytest.raises(sk.CheckpointExistsError, match=r"holds kept/ \(a shardkeep checkpoint\)"):
        export_hf(runs / "step_2", other, check_keys=False, overwrite=True)
    assert _tree(tmp_path) == before


def test_a_destination_inside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    sk.save({"model": {"w": torch.ones(2)}}, tmp_path / "ckpt")
    before = _tree(tmp_path)
    for dest in (tmp_path / "ckpt" / "shards", tmp_path / "ckpt" / "hf"):
        for overwrite in (False, True):
            with pytest.raises(sk.UnsafePathError, match="is inside the checkpoint being exported"):
                export_hf(tmp_path / "ckpt", dest, check_keys=False, overwrite=overwrite)
        code, _, err = _run("export", str(tmp_path / "ckpt"), str(dest), "--format", "hf", "--force")
        assert code == 2 and "inside the checkpoint" in err
    assert _tree(tmp_path) == before
    assert sk.verify(tmp_path / "ckpt").ok


def test_overwrite_refuses_a_folder_holding_what_an_export_does_not_write(tmp_path: Path) -> None:
    sk.save({"model": {"w": torch.ones(2)}}, tmp_path / "ckpt")
    export_hf(tmp_path / "ckpt", tmp_path / "hf", check_keys=False)
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")  # added by the user after the export
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("precious")
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("precious")
    before = _tree(tmp_path)
    cases = {
        "hf": "holds tokenizer.json, which an export does not write",
        "plain": "holds notes.txt, which an export does not write",
        "empty": "is not a Hugging Face model folder",
        "file": "is not a directory",
    }
    for name, message in cases.items():
        with pytest.raises(sk.CheckpointExistsError, match=message):
            export_hf(tmp_path / "ckpt", tmp_path / name, check_keys=False, overwrite=True)
        code, _, err = _run("export", str(tmp_path / "ckpt"), str(tmp_path / name), "--format", "hf", "--force")
        assert code == 2 and message in err, err
        assert name == "file" or "nothing was changed" in err, err
    assert _tree(tmp_path) == before


class _Inotify:
    """The renames in one directory, read with Linux inotify (the kernel's own record)."""

    MOVED_FROM, MOVED_TO, DELETE = 0x40, 0x80, 0x200

    def __init__(self, directory: Path) -> None:
        import ctypes

        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK)
        assert self.fd >= 0
        mask = self.MOVED_FROM | self.MOVED_TO | self.DELETE
        assert self.libc.inotify_add_watch(self.fd, os.fsencode(directory), mask) >= 0

    def events(self) -> list[tuple[int, int, str]]:
        import struct

        found = []
        try:
            data = os.read(self.fd, 1 << 20)
        except BlockingIOError:
            return found
        offset = 0
        while offset < len(data):
            _, mask, cookie, length = struct.unpack_from("iIII", data, offset)
            name = data[offset + 16 : offset + 16 + length].rstrip(b"\0").decode()
            found.append((mask & 0xFFF, cookie, name))
            offset += 16 + length
        os.close(self.fd)
        return found


def _exchange_supported(directory: Path) -> bool:
    import ctypes

    if not sys.platform.startswith("linux"):
        return False
    (directory / "probe-a").mkdir()
    (directory / "probe-b").mkdir()
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
        renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        return renameat2(-100, os.fsencode(directory / "probe-a"), -100, os.fsencode(directory / "probe-b"), 2) == 0
    except AttributeError:
        return False
    finally:
        os.rmdir(directory / "probe-a")
        os.rmdir(directory / "probe-b")


def test_overwrite_swaps_a_previous_export_in_one_step(tmp_path: Path) -> None:
    if not _exchange_supported(tmp_path):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not supported here")
    sk.save({"model": {"w": torch.ones(2)}}, tmp_path / "one")
    sk.save({"model": {"w": torch.full((3,), 2.0), "b": torch.zeros(2)}}, tmp_path / "two")
    export_hf(tmp_path / "one", tmp_path / "hf", check_keys=False)
    old_inode = os.stat(tmp_path / "hf").st_ino
    watch = _Inotify(tmp_path)
    summary = export_hf(tmp_path / "two", tmp_path / "hf", check_keys=False, overwrite=True)
    events = watch.events()
    # Each rename is a MOVED_FROM and a MOVED_TO with one cookie.
    moves = [
        (source, target)
        for mask, cookie, source in events
        if mask == _Inotify.MOVED_FROM
        for mask_to, cookie_to, target in events
        if mask_to == _Inotify.MOVED_TO and cookie_to == cookie
    ]
    # One exchange: the new folder's name and "hf" swapped in one step (two renames would move "hf"
    # to a third name first, leaving no "hf" until the second rename).
    assert len(moves) == 2, events
    (staging, first_target), (second_source, second_target) = moves
    assert first_target == "hf" and staging.startswith(".hf.tmp-"), moves
    assert (second_source, second_target) == ("hf", staging), moves
    assert not [name for mask, _, name in events if mask == _Inotify.DELETE and name == "hf"]
    assert os.stat(tmp_path / "hf").st_ino != old_inode
    assert not any("kept" in note for note in summary.notes)
    assert torch.equal(read_folder(tmp_path / "hf").tensors["w"], torch.full((3,), 2.0))
    assert sorted(os.listdir(tmp_path)) == ["hf", "one", "two"]  # the old folder is removed


def test_overwrite_falls_back_to_two_renames_without_the_exchange(tmp_path: Path) -> None:
    from shardkeep.storage import localfs

    class WithoutExchange(localfs.LocalFS):  # as on a filesystem without renameat2
        def exchange(self, source: str, destination: str) -> None:
            raise localfs.ExchangeUnsupported(22, "not here")

    sk.save({"model": {"w": torch.ones(2)}}, tmp_path / "one")
    sk.save({"model": {"w": torch.full((3,), 2.0)}}, tmp_path / "two")
    export_hf(tmp_path / "one", tmp_path / "hf", check_keys=False)
    with localfs.using(WithoutExchange()):
        export_hf(tmp_path / "two", tmp_path / "hf", check_keys=False, overwrite=True)
    assert torch.equal(read_folder(tmp_path / "hf").tensors["w"], torch.full((3,), 2.0))
    assert sorted(os.listdir(tmp_path)) == ["hf", "one", "two"]


BAD_CONFIGS = {
    "not-a-model-class": ({"architectures": ["pipeline"]}, "names the architecture 'pipeline', which is not a model"),
    "class-of-another-type": ({"architectures": ["BertModel"]}, "cannot build BertModel from"),
    "bad-field": ({"n_embd": "x"}, r"cannot build a config from .*GPT2LMHeadModel.*n_embd"),
}


@pytest.mark.parametrize("where", ["config-file", "checkpoint-value"])
@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_a_config_transformers_cannot_build_is_a_config_error(case: str, where: str, tmp_path: Path) -> None:
    import re

    change, message = BAD_CONFIGS[case]
    config = _gpt2().config.to_dict() | change
    state: dict[str, Any] = {"model": {"w": torch.ones(2)}}
    argv = ["export", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--format", "hf"]
    if where == "config-file":
        (tmp_path / "config.json").write_text(json.dumps(config))
        argv += ["--config", str(tmp_path / "config.json")]
        source = f"config {tmp_path / 'config.json'}"
        given: Any = tmp_path / "config.json"
    else:
        state["hf_config"] = config
        source = "the config in the checkpoint value 'hf_config'"
        given = None
    sk.save(state, tmp_path / "ckpt")
    code, out, err = _run(*argv)
    assert code == 2 and out == "", err
    assert err.startswith("shardkeep export: error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert source in err and re.search(message, err), err
    with pytest.raises(sk.ConfigError, match=message) as caught:
        export_hf(tmp_path / "ckpt", tmp_path / "hf", config=given)
    assert source in str(caught.value)
    assert not (tmp_path / "hf").exists()


def test_a_config_mapping_that_is_not_json_is_a_config_error(tmp_path: Path) -> None:
    sk.save({"model": {"w": torch.ones(2)}}, tmp_path / "ckpt")
    config = _gpt2().config.to_dict() | {"extra": object()}
    with pytest.raises(sk.ConfigError, match="the config given is not JSON: TypeError"):
        export_hf(tmp_path / "ckpt", tmp_path / "hf", config=config)
    with pytest.raises(sk.ConfigError, match="not JSON"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "hf", format="hf", config=config)
    assert not (tmp_path / "hf").exists()


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
    assert manifest.custom_fields["imported_from"] == {
        "format": "hf",
        "path": "pretrained",
        "keys": f"the state_dict keys of GPT2LMHeadModel (transformers {transformers.__version__})",
    }
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


@pytest.mark.parametrize("name", sorted(MODELS))
def test_an_imported_folder_without_the_tied_copy_loads_into_a_tied_model(name: str, tmp_path: Path) -> None:
    model = MODELS[name]()
    model.config.tie_word_embeddings = True  # Llama ties only when asked
    model.tie_weights()
    model.save_pretrained(tmp_path / "hf-model")
    assert (
        "lm_head.weight" not in read_folder(tmp_path / "hf-model").tensors
    )  # save_pretrained leaves the tied copy out
    import_checkpoint(tmp_path / "hf-model", tmp_path / "ckpt", source_format="hf", subtree="model")
    fresh = MODELS[name]()
    fresh.config.tie_word_embeddings = True
    fresh.tie_weights()
    with torch.no_grad():
        for parameter in fresh.parameters():
            parameter.zero_()
    sk.load(tmp_path / "ckpt", into={"model": fresh})
    assert fresh.lm_head.weight is fresh.get_input_embeddings().weight  # still tied
    assert torch.equal(_logits(fresh), _logits(model))
    with torch.no_grad():
        fresh.get_input_embeddings().weight.zero_()
    sk.load(
        tmp_path / "ckpt", into={"model": fresh}, select=sk.LoadSelection(extra="ignore")
    )  # reading only what into= holds
    assert torch.equal(_logits(fresh), _logits(model))


def test_a_missing_key_is_satisfied_only_by_a_tensor_it_shares_storage_with(tmp_path: Path) -> None:
    model = _gpt2()
    state = {key: tensor for key, tensor in model.state_dict().items() if key != "lm_head.weight"}
    sk.save({"model": state}, tmp_path / "ckpt")
    untied = _gpt2()
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())  # its own storage now
    with pytest.raises(sk.StateMismatchError, match=r"missing \[.lm_head.weight.\]"):
        sk.load(tmp_path / "ckpt", into={"model": untied})


def test_a_config_of_other_shapes_is_refused_naming_the_key_and_both_shapes(tmp_path: Path) -> None:
    model = _gpt2()
    sk.save({"model": model}, tmp_path / "ckpt")
    config = model.config.to_dict() | {"vocab_size": 130}
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, out, err = _run(
        "export",
        str(tmp_path / "ckpt"),
        str(tmp_path / "hf"),
        "--format",
        "hf",
        "--config",
        str(tmp_path / "config.json"),
    )
    assert code == 2 and out == "", err
    assert "transformer.wte.weight" in err and "[130, 32]" in err and "[128, 32]" in err, err
    with pytest.raises(sk.ConfigError, match=r"transformer\.wte\.weight.*\[130, 32\].*\[128, 32\]"):
        export_hf(tmp_path / "ckpt", tmp_path / "hf", config=config)
    assert not (tmp_path / "hf").exists()
    assert not [entry for entry in os.listdir(tmp_path) if entry.startswith(".")]


def test_an_imported_folder_loads_into_a_tied_fsdp2_model(tmp_path: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _gpt2()
    model.save_pretrained(tmp_path / "hf-model")
    import_checkpoint(tmp_path / "hf-model", tmp_path / "ckpt", source_format="hf")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        torch.manual_seed(1)
        sharded = transformers.GPT2LMHeadModel(model.config).eval()
        fully_shard(sharded, mesh=init_device_mesh("cpu", (1,)))
        assert sharded.lm_head.weight is sharded.transformer.wte.weight  # one DTensor for both keys
        sk.load(tmp_path / "ckpt", into={"model": sharded})
        assert torch.equal(_logits(sharded), _logits(model))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.complex128, torch.complex32, torch.bits8, torch.bits16])
def test_a_dtype_safetensors_cannot_write_is_refused_naming_the_key_and_nothing_is_written(
    dtype: torch.dtype, tmp_path: Path
) -> None:
    odd = (torch.arange(4, dtype=torch.uint8) + 1).view(dtype) if dtype.itemsize == 1 else None
    if odd is None:
        odd = torch.arange(4 * dtype.itemsize, dtype=torch.uint8).view(dtype)
    sk.save({"model": {"odd.weight": odd, "w": torch.ones(2)}}, tmp_path / "ckpt")
    with pytest.raises(sk.UnsupportedValueError, match=rf"'odd\.weight'.*{dtype}"):
        export_hf(tmp_path / "ckpt", tmp_path / "hf")
    code, out, err = _run("export", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--format", "hf", "--json")
    assert code == 2 and out == ""
    error = json.loads(err)["error"]
    assert error["type"] == "UnsupportedValueError" and "odd.weight" in error["message"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_export_without_huggingface_hub_is_a_dependency_error(tmp_path: Path) -> None:
    import subprocess

    sk.save({"model": {"w": torch.ones(2)}}, tmp_path / "ckpt")
    blocker = tmp_path / "no-hub"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['huggingface_hub'] = None\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, "-m", "shardkeep", "export", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--format", "hf"]
    plain = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert plain.returncode == 2, plain.stderr
    assert plain.stderr.startswith("shardkeep export: error: ") and "Traceback" not in plain.stderr
    assert "pip install huggingface_hub" in plain.stderr
    as_json = subprocess.run([*argv, "--json"], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert as_json.returncode == 2 and as_json.stdout == ""
    assert json.loads(as_json.stderr)["error"]["type"] == "DependencyError"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "no-hub"]
