"""The Hugging Face model folder on disk: its file names, and reading one (``--format hf``).

:func:`read_folder` reads ``model.safetensors`` or the shards an index names, with
``safetensors`` only (no pickle): the index is checked first (every file named inside the
folder and present, every key in exactly one file, every file holding exactly the keys the
index gives it). A folder holding only ``pytorch_model.bin`` is refused: import that file with
``--format pt`` (read with ``torch.load(weights_only=True)``). JSON files (the index,
``config.json``) are bounded in size and refuse duplicate keys.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from shardkeep.errors import CheckpointNotFoundError, UnsafePathError, UnsupportedValueError
from shardkeep.manifest import strict_json_hooks

__all__ = [
    "CONFIG_FILE",
    "CONFIG_VALUE_KEY",
    "HFFolder",
    "INDEX_FILE",
    "SINGLE_FILE",
    "is_hf_folder",
    "read_folder",
    "read_json_file",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
#: The top-level key under which an import stores ``config.json`` (as JSON values), and where an
#: export looks for a config when none is given.
CONFIG_VALUE_KEY = "hf_config"
#: Bounds on the JSON files read from a folder (an index of a very large model is a few MiB).
_MAX_JSON_BYTES = 64 << 20


def read_json_file(path: str, what: str) -> dict[str, Any]:
    """The JSON object in the file ``path`` (``what`` names it in errors): at most
    :data:`_MAX_JSON_BYTES`, no repeated key; NaN and Infinity allowed, as configs hold them."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(_MAX_JSON_BYTES + 1)
    except OSError as exc:
        raise CheckpointNotFoundError(f"cannot read {what} {path}: {exc}") from exc
    if len(data) > _MAX_JSON_BYTES:
        raise UnsupportedValueError(f"{what} {path} is larger than {_MAX_JSON_BYTES >> 20} MiB")

    # Duplicate keys refused, as in manifests (NaN and Infinity are allowed: configs hold them).
    no_repeats = strict_json_hooks(UnsupportedValueError, f"{what} {path}")["object_pairs_hook"]
    try:
        document = json.loads(data, object_pairs_hook=no_repeats)
    except (ValueError, RecursionError) as exc:
        raise UnsupportedValueError(f"{what} {path} is not valid JSON: {exc}") from exc
    if not isinstance(document, dict):
        raise UnsupportedValueError(f"{what} {path} must hold a JSON object")
    return document


@dataclass(frozen=True)
class HFFolder:
    """What a Hugging Face model folder holds: its tensors by key, its ``config.json`` and the
    weight files read."""

    tensors: dict[str, torch.Tensor]
    config: dict[str, Any] | None
    files: tuple[str, ...]


def is_hf_folder(path: str) -> bool:
    """True when ``path`` is a directory holding ``model.safetensors``, an index of shards, or
    ``pytorch_model.bin`` weights (refused by :func:`read_folder`, with the way to import them)."""
    if not os.path.isdir(path):
        return False
    names = (SINGLE_FILE, INDEX_FILE, "pytorch_model.bin", "pytorch_model.bin.index.json")
    return any(os.path.isfile(os.path.join(path, name)) for name in names)


def _read_weights(path: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as handle:
            return {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118  # safe_open has no iterator
    except (SafetensorError, OSError, ValueError) as exc:
        raise UnsupportedValueError(f"{path} is not a valid safetensors file: {exc}") from exc


def _index_files(folder: str) -> dict[str, list[str]]:
    """File name -> the keys the index puts in it, after checking every name stays in ``folder``."""
    path = os.path.join(folder, INDEX_FILE)
    index = read_json_file(path, "index")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise UnsupportedValueError(f"{path} has no 'weight_map' object naming the file of each weight")
    files: dict[str, list[str]] = {}
    for key, name in weight_map.items():
        if not isinstance(name, str):
            raise UnsupportedValueError(f"{path}: the file of {key!r} is not a string")
        if name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name or os.path.basename(name) != name:
            raise UnsafePathError(f"{path}: the file {name!r} of {key!r} is not a plain name inside the folder")
        files.setdefault(name, []).append(key)
    for name in files:
        if not os.path.isfile(os.path.join(folder, name)):
            raise CheckpointNotFoundError(f"{path} names {name}, which is not in {folder}")
    return files


def read_folder(folder: str | os.PathLike[str]) -> HFFolder:
    """The tensors and config of the Hugging Face model folder ``folder`` (see the module
    docstring for what is checked). Raises :class:`~shardkeep.errors.UnsupportedValueError`
    for a folder without safetensors weights or a damaged index or file."""
    root = os.fspath(folder)
    single = os.path.join(root, SINGLE_FILE)
    has_index = os.path.isfile(os.path.join(root, INDEX_FILE))
    if os.path.isfile(single) and has_index:
        raise UnsupportedValueError(
            f"{root} holds both {SINGLE_FILE} and {INDEX_FILE}; which one is the model is unclear: remove one"
        )
    tensors: dict[str, torch.Tensor] = {}
    if has_index:
        files = _index_files(root)
        owner = {key: name for name, keys in files.items() for key in keys}
        for name, keys in files.items():
            found = _read_weights(os.path.join(root, name))
            absent = sorted(set(keys) - set(found))
            if absent:
                raise UnsupportedValueError(f"{INDEX_FILE} puts {absent[:5]} in {name}, which does not hold them")
            for key in sorted(set(found) - set(keys)):
                if key in owner:
                    raise UnsupportedValueError(f"{key!r} is in two files: {name} and {owner[key]}")
                raise UnsupportedValueError(f"{name} holds {key!r}, which {INDEX_FILE} does not list")
            tensors.update(found)
        names = tuple(files)
    elif os.path.isfile(single):
        tensors = _read_weights(single)
        names = (SINGLE_FILE,)
    elif os.path.isfile(os.path.join(root, "pytorch_model.bin")) or os.path.isfile(
        os.path.join(root, "pytorch_model.bin.index.json")
    ):
        raise UnsupportedValueError(
            f"{root} holds pytorch_model.bin weights (Python pickles), not safetensors; import the file itself with "
            "--format pt (format 'pt', read with torch.load(weights_only=True)), or save the model again with "
            "save_pretrained(safe_serialization=True)"
        )
    else:
        raise CheckpointNotFoundError(f"{root} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
    config_path = os.path.join(root, CONFIG_FILE)
    config = read_json_file(config_path, "config") if os.path.isfile(config_path) else None
    return HFFolder(tensors=tensors, config=config, files=names)
