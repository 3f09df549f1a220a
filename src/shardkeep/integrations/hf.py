"""Hugging Face model folders: writing a checkpoint's model as a folder that ``transformers``'
``from_pretrained`` loads, and reading such a folder (``--format hf``).

Export (:func:`export_hf`) loads the checkpoint with every digest (and, with ``public_key``, the
signature) checked before a byte is written, takes the tensors under one subtree (``model``:
``model.transformer.wte.weight`` becomes ``transformer.wte.weight``) and writes them as
safetensors files with ``{"format": "pt"}`` metadata, split at ``max_shard_size`` by
``huggingface_hub.split_torch_state_dict_into_shards`` and named as ``save_pretrained`` names
them (``model.safetensors``, or ``model-00001-of-0000N.safetensors`` plus
``model.safetensors.index.json`` with ``total_parameters`` and ``total_size``), with
``config.json`` beside them. The folder is built
under a temporary name next to the destination and renamed into place: it is there whole or
not at all. ``overwrite`` replaces only a folder holding nothing but those files (so never a
checkpoint, a directory holding one, or files an export would not write back), by swapping
the two folders in one ``renameat2(RENAME_EXCHANGE)`` and then removing the old one's files.

With a config, the exported keys and shapes are compared with the ones the model class expects
(the class, named by ``model_class``, the config's ``architectures`` or the keys, is built from
the config on the meta device, so no memory is spent on weights): a key the model expects and
the folder lacks would be initialised at random by ``from_pretrained`` without an error, so any
difference is refused, naming the keys (or the shapes) and the subtree that would fit. The same
meta model says which weights are tied (``lm_head.weight`` to ``transformer.wte.weight`` in
GPT-2): the tied copy is left out, as ``save_pretrained`` leaves it out, but only when its bytes
equal the kept one's. The model's keys are then written under the keys ``save_pretrained``
writes, through transformers' own key conversions (:func:`to_folder_keys`: per-expert weights
for the fused expert tensors of Mixtral and Qwen2-MoE). ``transformers`` is imported only for
the check.

Import (:func:`read_folder`) reads ``model.safetensors`` or the shards an index names, with
``safetensors`` only (no pickle): the index is checked first (every file named inside the
folder and present, every key in exactly one file, every file holding exactly the keys the
index gives it). A folder holding only ``pytorch_model.bin`` is refused: import that file with
``--format pt`` (read with ``torch.load(weights_only=True)``). :func:`model_keys_of` then puts
its tensors under the model's state_dict keys, converted as ``from_pretrained`` converts them
(:func:`to_model_keys`), so that they load into that model with ``shardkeep.load(..., into=)``.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import stat
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

import shardkeep.api as api
from shardkeep.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
    DependencyError,
    StorageError,
    UnsafePathError,
    UnsupportedValueError,
)
from shardkeep.manifest import MANIFEST_FILENAME, strict_json_hooks
from shardkeep.names import check_name_length, sibling_name
from shardkeep.storage import local
from shardkeep.tensors.convert import TORCH_TO_NAME
from shardkeep.tensors.flatten import flatten_state
from shardkeep.tensors.shardfile import CARRIED_DTYPES

if TYPE_CHECKING:
    from shardkeep.options import PublicKey

__all__ = [
    "CONFIG_VALUE_KEY",
    "HFExportSummary",
    "HFFolder",
    "export_hf",
    "is_hf_folder",
    "model_keys_of",
    "parse_size",
    "read_folder",
    "to_folder_keys",
    "to_model_keys",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
#: The top-level key under which an import stores ``config.json`` (as JSON values), and where an
#: export looks for a config when none is given.
CONFIG_VALUE_KEY = "hf_config"
DEFAULT_MAX_SHARD_SIZE = "5GB"
#: Bounds on the JSON files read from a folder (an index of a very large model is a few MiB).
_MAX_JSON_BYTES = 64 << 20
_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
}


def parse_size(value: int | str) -> int:
    """Bytes from ``value``: an int, or a string such as ``"5GB"``, ``"500MB"``, ``"2GiB"`` or
    ``"1000"`` (decimal units, as ``save_pretrained`` reads them; ``KiB``/``MiB``/``GiB`` binary)."""
    if isinstance(value, bool):
        raise ConfigError(f"max_shard_size={value!r} must be a size such as '5GB', '500MB' or a number of bytes")
    if isinstance(value, int):
        size = value
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(value))
        unit = match.group(2).upper() if match else ""
        if match is None or unit not in _SIZE_UNITS:
            raise ConfigError(f"max_shard_size={value!r} must be a size such as '5GB', '500MB' or a number of bytes")
        size = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if size <= 0:
        raise ConfigError(f"max_shard_size={value!r} must be positive")
    return size


@dataclass(frozen=True)
class HFExportSummary:
    """What :func:`export_hf` wrote and what it checked."""

    path: str
    files: tuple[str, ...]
    tensors: int
    bytes: int
    #: The tied copies left out (each equal, byte for byte, to the weight it is tied to).
    tied_dropped: tuple[str, ...]
    #: Where ``config.json`` came from (a path, ``checkpoint value 'hf_config'``, ``given``), or None.
    config_source: str | None
    #: The model class the keys were checked against, or None when the check was skipped.
    checked_against: str | None
    #: Sentences worth telling the user: a skipped key check, values left out, untied copies.
    notes: tuple[str, ...] = field(default=())


def _json_file(path: str, what: str) -> dict[str, Any]:
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


def _json_copy(config: Mapping[str, Any], source: str) -> dict[str, Any]:
    """A plain JSON copy of ``config`` (what ``config.json`` will hold), or ConfigError."""
    try:
        return json.loads(json.dumps(dict(config)))  # type: ignore[no-any-return]
    except (TypeError, ValueError, RecursionError) as exc:
        raise ConfigError(f"{_config_label(source)} is not JSON: {_one_line(exc)}") from exc


def _config_label(source: str) -> str:
    """``source`` (a path, ``given``, ``checkpoint value 'hf_config'``) as words for an error."""
    if source == "given":
        return "the config given"
    if source.startswith("checkpoint value "):
        return f"the config in the {source}"
    return f"config {source}"


def _one_line(exc: BaseException, limit: int = 400) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}"


def _given_config(config: str | os.PathLike[str] | Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    if isinstance(config, Mapping):
        return _json_copy(config, "given"), "given"
    path = os.fspath(config)
    if os.path.isdir(path):
        path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(path):
        raise CheckpointNotFoundError(f"config {path} does not exist")
    return _json_file(path, "config"), path


# --------------------------------------------------------------------------------- the key check


@dataclass(frozen=True)
class _ModelKeys:
    """The keys a model class reads from a folder, from an instance built on the meta device: its
    ``state_dict()`` keys, or (``folder``) the keys ``save_pretrained`` writes for it, after
    transformers' key conversions (Mixtral's fused ``experts.gate_up_proj`` is written as
    ``block_sparse_moe.experts.N.w1.weight`` and ``w3``)."""

    name: str
    expected: frozenset[str]
    #: key -> the shape of the model's tensor.
    shapes: dict[str, tuple[int, ...]]
    #: target -> source: the target is filled from the source when the folder lacks it.
    tied: dict[str, str]
    ignore_missing: re.Pattern[str] | None
    ignore_unexpected: re.Pattern[str] | None
    #: The model built on the meta device (for the key conversions).
    meta: Any = field(compare=False, repr=False)
    #: True: the keys of a folder; False: the model's state_dict keys.
    folder: bool = False

    def difference(self, keys: set[str]) -> tuple[list[str], list[str]]:
        """(missing, unexpected): keys the model needs that ``keys`` lacks, and keys it would not read."""
        missing = []
        for key in sorted(self.expected - keys):
            source = self.tied.get(key)
            if source is not None and source in keys:
                continue
            if any(target in keys for target, tied_source in self.tied.items() if tied_source == key):
                continue  # from_pretrained ties symmetrically: the target fills the source
            if self.ignore_missing is not None and self.ignore_missing.search(key):
                continue
            missing.append(key)
        unexpected = [
            key
            for key in sorted(keys - self.expected)
            if self.ignore_unexpected is None or not self.ignore_unexpected.search(key)
        ]
        return missing, unexpected

    def in_folder_layout(self) -> _ModelKeys | None:
        """The same model's keys as ``save_pretrained`` writes them, or None when transformers
        converts none of its keys (then they are its state_dict keys)."""
        if self.folder:
            return self
        meta_state = self.meta.state_dict()
        written = to_folder_keys(self.meta, meta_state)
        if set(written) == set(meta_state):
            return None
        return _ModelKeys(
            name=self.name,
            expected=frozenset(written),
            shapes={key: tuple(tensor.shape) for key, tensor in written.items()},
            tied={target: source for target, source in self.tied.items() if target in written and source in written},
            ignore_missing=self.ignore_missing,
            ignore_unexpected=self.ignore_unexpected,
            meta=self.meta,
            folder=True,
        )


def _pattern(patterns: Any) -> re.Pattern[str] | None:
    found = [str(item) for item in (patterns or ())]
    return re.compile("|".join(f"({item})" for item in found)) if found else None


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise DependencyError(
            "checking the exported keys against the model needs transformers (pip install transformers); "
            "or skip the check (check_keys=False, --skip-key-check)"
        ) from exc
    return transformers


def _architecture(transformers: Any, name: Any, label: str) -> Any:
    """The ``transformers.PreTrainedModel`` subclass ``name`` names (only a model class: any other
    attribute of the package, such as ``pipeline``, is refused)."""
    found = None
    if isinstance(name, str) and name.isidentifier():
        try:
            found = getattr(transformers, name, None)
        except Exception:  # a lazy attribute whose import fails (a missing backend)
            found = None
    if not (isinstance(found, type) and issubclass(found, transformers.PreTrainedModel)):
        raise ConfigError(
            f"{label} names the architecture {name!r}, which is not a model class of this transformers "
            f"({transformers.__version__}); use the class save_pretrained writes there, e.g. 'GPT2LMHeadModel'"
        )
    return found


#: The Auto classes whose model the keys choose when neither the config nor ``model_class``
#: names one: the task heads only. A base model's keys (``transformer.h.0...`` without the
#: head) also load into a head class, which would then initialise its head at random, so the
#: base class is used only for a ``model_type`` that has no head class.
_HEAD_AUTO_CLASSES = (
    "AutoModelForCausalLM",
    "AutoModelForSeq2SeqLM",
    "AutoModelForMaskedLM",
    "AutoModelForPreTraining",
    "AutoModelForSequenceClassification",
    "AutoModelForTokenClassification",
    "AutoModelForQuestionAnswering",
)


@dataclass(frozen=True)
class _Candidates:
    """The model classes a config allows; ``by_keys``: none was named, the keys choose one."""

    models: list[_ModelKeys]
    by_keys: bool


def _model_keys(config_doc: dict[str, Any], source: str, model_class: str | None = None) -> _Candidates:
    """The key sets of ``model_class``, else of the classes a config names (``architectures``),
    else of every task-head class transformers has for its ``model_type`` (the keys then choose:
    see :func:`_check_keys`). Whatever transformers raises on a bad config is a
    :class:`ConfigError` naming ``source`` (see :func:`_config_label`) and the class."""
    transformers = _transformers()
    label = _config_label(source)
    model_type = config_doc.get("model_type")
    if not isinstance(model_type, str):
        raise ConfigError(f"{label} has no 'model_type': it is not a transformers config.json")
    architectures = config_doc.get("architectures") or []
    if not isinstance(architectures, list):
        raise ConfigError(f"{label}: 'architectures' must be a list of model class names, not {architectures!r}")
    if model_class is not None:
        architectures = [model_class]
        label = f"{label} with the model class {model_class!r}"
    builders = [(str(name), _architecture(transformers, name, label)._from_config) for name in architectures]
    try:
        config = transformers.AutoConfig.for_model(**config_doc)
    except Exception as exc:  # ValueError, TypeError, huggingface_hub's validation errors ...
        raise ConfigError(
            f"transformers cannot build a config from {label} (model_type {model_type!r}"
            f"{''.join(f', architecture {name}' for name, _ in builders)}): {_one_line(exc)}"
        ) from exc
    by_keys = not builders
    if by_keys:
        builders = [(name, getattr(transformers, name).from_config) for name in (*_HEAD_AUTO_CLASSES, "AutoModel")]
    found: list[_ModelKeys] = []
    refused: list[str] = []
    for name, build in builders:
        if by_keys and name == "AutoModel" and found:
            break  # the base model only for a model_type without a head class
        try:
            with torch.device("meta"):
                model = build(config)
        except Exception as exc:  # AttributeError from a class of another model_type, ...
            if name.startswith("Auto") and isinstance(exc, ValueError):
                refused.append(f"{name}: {_one_line(exc, 200)}")
                continue  # an Auto class without this model_type
            raise ConfigError(
                f"cannot build {name} from {label} (model_type {model_type!r}): {_one_line(exc)}"
            ) from exc
        class_name = type(model).__name__ if name.startswith("Auto") else name
        if all(known.name != class_name for known in found):
            found.append(_keys_of(class_name, model))
    if not found:
        raise ConfigError(
            f"transformers has no model class for model_type {model_type!r} of {label} ({'; '.join(refused)})"
        )
    return _Candidates(found, by_keys)


def _keys_of(name: str, model: Any) -> _ModelKeys:
    state = model.state_dict()
    expected = frozenset(state.keys())
    tied: dict[str, str] = dict(getattr(model, "all_tied_weights_keys", None) or {})
    # Parameters that are one object are tied whatever the model declares.
    first_name: dict[int, str] = {}
    for key, parameter in model.named_parameters(remove_duplicate=False):
        source = first_name.setdefault(id(parameter), key)
        if source != key and key not in tied and key in expected:
            tied[key] = source
    unexpected_patterns = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    # from_pretrained also ignores the buffers that used to be persistent.
    if any(buffer.endswith("rotary_emb.inv_freq") for buffer, _ in model.named_buffers()):
        unexpected_patterns.add(r"rotary_emb\.inv_freq")
    if any(buffer.endswith("position_ids") for buffer, _ in model.named_buffers()):
        unexpected_patterns.add(r"(^|\.)position_ids$")
    return _ModelKeys(
        name=name,
        expected=expected,
        shapes={key: tuple(tensor.shape) for key, tensor in state.items()},
        tied=tied,
        ignore_missing=_pattern(getattr(model, "_keys_to_ignore_on_load_missing", None)),
        ignore_unexpected=_pattern(unexpected_patterns),
        meta=model,
    )


def _fitting_subtree(model: _ModelKeys, all_keys: set[str]) -> str | None:
    """The subtree of the checkpoint (a prefix of its dotted keys) whose keys fit ``model``."""
    probe = next((key for key in sorted(model.expected) if key not in model.tied), None)
    if probe is None:
        return None
    candidates = sorted(
        {key[: -len(probe)].rstrip(".") for key in all_keys if key == probe or key.endswith("." + probe)}
    )
    for prefix in candidates:
        keys = _strip(all_keys, prefix)
        missing, unexpected = model.difference(keys)
        if not missing and not unexpected:
            return prefix
    return None


def _strip(keys: set[str], prefix: str) -> set[str]:
    if not prefix:
        return set(keys)
    return {key[len(prefix) + 1 :] for key in keys if key.startswith(prefix + ".")}


def _check_keys(
    candidates: _Candidates, tensors: Mapping[str, torch.Tensor], all_keys: set[str], subtree: str, source: str
) -> _ModelKeys:
    """The model whose keys and shapes ``tensors`` match: the first of the classes named, or,
    when the keys choose (``by_keys``), the one class they fit (several is a ConfigError asking
    for the class). Each class is tried with its state_dict keys, then with the keys
    ``save_pretrained`` writes (an imported folder's). Else a ConfigError naming the keys that
    differ or, when the keys fit, each tensor whose shape differs (with both shapes:
    ``from_pretrained`` refuses those)."""
    keys = set(tensors)
    fitting: list[_ModelKeys] = []
    for model in candidates.models:
        for layout in (model, model.in_folder_layout()):
            if layout is None:
                continue
            missing, unexpected = layout.difference(keys)
            if not missing and not unexpected:
                fitting.append(layout)
                break
        if fitting and not candidates.by_keys:
            break
    if len(fitting) > 1:
        names = ", ".join(model.name for model in fitting)
        raise ConfigError(
            f"the tensors under subtree {subtree!r} fit {names}, and {_config_label(source)} names no architecture: "
            f"name the class with --model-class (model_class=), e.g. --model-class {fitting[0].name}"
        )
    if fitting:
        _check_shapes(fitting[0], tensors, subtree, source)
        return fitting[0]
    model = candidates.models[0]
    missing, unexpected = model.difference(keys)
    problems = []
    if missing:
        problems.append(f"{len(missing)} key(s) the model expects are missing ({', '.join(missing[:5])})")
    if unexpected:
        problems.append(f"{len(unexpected)} key(s) are not the model's ({', '.join(unexpected[:5])})")
    hint = ""
    subtree_fits = _fitting_subtree(model, all_keys)
    if subtree_fits is not None and subtree_fits != subtree:
        hint = f"; subtree {subtree_fits!r} fits (--subtree {subtree_fits or chr(39) * 2})"
    others = [other.name for other in candidates.models[1:]]
    tried = f" (nor {', '.join(others)})" if others else ""
    raise ConfigError(
        f"the tensors under subtree {subtree!r} do not fit {model.name}{tried}: {' and '.join(problems)}; "
        f"from_pretrained would initialise missing weights at random, so nothing was written{hint}"
    )


def _check_shapes(model: _ModelKeys, tensors: Mapping[str, torch.Tensor], subtree: str, source: str) -> None:
    wrong = [
        (key, model.shapes[key], tuple(tensor.shape))
        for key, tensor in sorted(tensors.items())
        if key in model.shapes and model.shapes[key] != tuple(tensor.shape)
    ]
    if wrong:
        shown = "; ".join(
            f"{key}: the model has {list(want)}, the checkpoint {list(got)}" for key, want, got in wrong[:5]
        )
        more = f" and {len(wrong) - 5} more" if len(wrong) > 5 else ""
        raise ConfigError(
            f"the tensors under subtree {subtree!r} have the keys of {model.name} built from {_config_label(source)}, "
            f"but {len(wrong)} differ in shape ({shown}{more}); from_pretrained would refuse them, so nothing was "
            "written: give the config the model was trained with"
        )


# ------------------------------------------------------------------------------ key conversions


def _conversions(meta: Any, *, loading: bool) -> list[Any]:
    """transformers' key conversions for the model ``meta`` (those ``from_pretrained`` applies
    when ``loading``, else those ``save_pretrained`` reverts); empty for a transformers that
    has none (before 5.0 the model's keys were the folder's)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return []
    return list(get_model_conversion_mapping(meta, add_legacy=loading) or [])


def to_folder_keys(meta: Any, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (the model's state_dict keys) under the keys ``save_pretrained`` writes for the
    model ``meta`` (built on the meta device): transformers' own ``revert_weight_conversion``
    (Mixtral's ``mlp.experts.gate_up_proj`` becomes ``block_sparse_moe.experts.N.w1.weight``
    and ``w3.weight``). Unchanged for a model without conversions."""
    if not _conversions(meta, loading=False):
        return dict(tensors)
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(meta, dict(tensors)))


def to_model_keys(meta: Any, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (a folder's keys) under the state_dict keys of the model ``meta`` (built on the
    meta device), converted as ``from_pretrained`` converts them: each key renamed by
    transformers' renamings, then gathered by at most one of its converters (per-expert
    weights stacked into the fused expert tensors). A key the model does not have is kept as
    it is; a key already in the model's form is taken as it is."""
    transforms = _conversions(meta, loading=True)
    if not transforms:
        return dict(tensors)
    from transformers.core_model_loading import WeightConverter, dot_natural_key, rename_source_key

    renamings = [entry for entry in transforms if not isinstance(entry, WeightConverter)]
    converters = [entry for entry in transforms if isinstance(entry, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    meta_state = meta.state_dict()
    converted: dict[str, torch.Tensor] = {}
    gathering: dict[str, Any] = {}
    for key, tensor in sorted(tensors.items(), key=lambda item: dot_natural_key(item[0])):
        renamed, pattern = rename_source_key(key, renamings, converters, meta.base_model_prefix, meta_state)
        if renamed not in meta_state:
            converted[key] = tensor
        elif pattern is None:
            converted[renamed] = tensor
        else:
            gathering.setdefault(renamed, copy.deepcopy(by_pattern[pattern])).add_tensor(renamed, key, pattern, tensor)
    for first, converter in gathering.items():
        for target, value in converter.convert(first, model=meta, config=meta.config).items():
            converted[target] = value[0] if isinstance(value, list) else value
    return converted


# ----------------------------------------------------------------------------------- the export


def _subtree_tensors(state: Any, subtree: str) -> tuple[dict[str, torch.Tensor], set[str], int]:
    """The tensors under ``subtree`` (keys without the prefix), every tensor key of the checkpoint,
    and how many JSON values lie under the subtree."""
    flat = flatten_state(state)
    every = {leaf.key for leaf in flat.tensors}
    prefix = f"{subtree}." if subtree else ""
    chosen: dict[str, torch.Tensor] = {}
    for leaf in flat.tensors:
        if leaf.key == subtree:
            raise ConfigError(f"{subtree!r} is a tensor, not a subtree; pick the key holding the model's state dict")
        if leaf.key.startswith(prefix):
            value = leaf.value
            chosen[leaf.key[len(prefix) :]] = torch.from_numpy(value) if isinstance(value, np.ndarray) else value
    values = sum(1 for entry in flat.values if entry.key.startswith(prefix) or entry.key == subtree)
    if not chosen:
        counts: dict[str, int] = {}
        for leaf in flat.tensors:
            head = str(leaf.path[0])
            counts[head] = counts.get(head, 0) + 1
        there = ", ".join(f"{name!r} ({count} tensor(s))" for name, count in sorted(counts.items())) or "none"
        raise _NoTensorsError(
            f"the checkpoint has no tensors under subtree {subtree!r}; the subtrees with tensors: {there}", every
        )
    return chosen, every, values


class _NoTensorsError(ConfigError):
    """No tensors under the subtree; carries the checkpoint's tensor keys, to suggest one."""

    def __init__(self, message: str, keys: set[str]) -> None:
        super().__init__(message)
        self.keys = keys


def _same_bytes(first: torch.Tensor, second: torch.Tensor) -> bool:
    if first.dtype != second.dtype or first.shape != second.shape:
        return False
    return torch.equal(
        first.contiguous().reshape(-1).view(torch.uint8), second.contiguous().reshape(-1).view(torch.uint8)
    )


def _split_into_shards() -> Any:
    """``huggingface_hub.split_torch_state_dict_into_shards``; without huggingface_hub, a
    :class:`DependencyError` saying what to install."""
    try:
        from huggingface_hub import split_torch_state_dict_into_shards
    except ImportError as exc:
        raise DependencyError(
            "exporting a Hugging Face folder needs huggingface_hub, whose file split save_pretrained uses: "
            "pip install huggingface_hub (or pip install 'shardkeep[hf]')"
        ) from exc
    return split_torch_state_dict_into_shards


def _check_writable_dtypes(tensors: Mapping[str, torch.Tensor]) -> None:
    """Refuse (:class:`UnsupportedValueError`, naming the key and the dtype) a tensor whose dtype
    safetensors has no name for: a weight file cannot hold it."""
    from safetensors import torch as safetensors_torch

    # The table save_file looks every tensor's dtype up in: a dtype it lacks makes it fail.
    known = getattr(safetensors_torch, "_SIZE", None)
    for key, tensor in tensors.items():
        name = TORCH_TO_NAME.get(tensor.dtype)
        writable = tensor.dtype in known if isinstance(known, Mapping) else name not in CARRIED_DTYPES
        if not writable:
            raise UnsupportedValueError(
                f"{key!r} is a {tensor.dtype} tensor, which a safetensors file cannot hold; "
                "convert it, or export the checkpoint to .pt"
            )


def _plan_files(tensors: dict[str, torch.Tensor], limit: int) -> tuple[dict[str, list[str]], int]:
    """(file name -> its keys, the index's ``total_size``) from
    ``huggingface_hub.split_torch_state_dict_into_shards``, which ``save_pretrained`` splits and
    names its files with: one ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` of
    at most ``limit`` bytes each (a larger tensor gets a file of its own; tensors sharing a
    storage, such as the experts split from one fused tensor, share a file)."""
    split = _split_into_shards()(tensors, filename_pattern="model{suffix}.safetensors", max_shard_size=limit)
    return {name: list(keys) for name, keys in split.filename_to_tensors.items()}, int(split.metadata["total_size"])


def _own_storages(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with each one in a storage of its own and of its size, as a model's parameters
    are (a memory-mapped load may give views of one file): the file split counts storages."""
    seen: set[int] = set()
    owned: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        storage = tensor.untyped_storage()
        alone = storage.data_ptr() not in seen and storage.nbytes() == tensor.numel() * tensor.element_size()
        owned[key] = tensor if alone and tensor.is_contiguous() else tensor.clone(memory_format=torch.contiguous_format)
        seen.add(owned[key].untyped_storage().data_ptr())
    return owned


def _fsync_directory(path: str) -> None:
    local.fsync_directory_path(path)


def _write_json(path: str, document: Any) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(json.dumps(document, indent=2, sort_keys=True) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def _write_folder(
    staging: str,
    tensors: dict[str, torch.Tensor],
    plan: dict[str, list[str]],
    config_doc: dict[str, Any] | None,
    total_parameters: int,
    total_size: int,
) -> list[str]:
    """Write the weight files of ``plan``, the index (with ``metadata`` holding
    ``total_parameters`` and ``total_size``, as ``save_pretrained`` writes it) when there are
    several, and ``config.json``; each fsynced."""
    from safetensors.torch import save_file

    names = list(plan)
    weight_map: dict[str, str] = {}
    for name, keys in plan.items():
        path = os.path.join(staging, name)
        save_file({key: tensors[key].contiguous() for key in keys}, path, metadata={"format": "pt"})
        with open(path, "rb+") as handle:
            os.fsync(handle.fileno())
        weight_map.update(dict.fromkeys(keys, name))
    written = list(names)
    if len(plan) > 1:
        metadata = {"total_parameters": total_parameters, "total_size": total_size}
        _write_json(os.path.join(staging, INDEX_FILE), {"metadata": metadata, "weight_map": weight_map})
        written.append(INDEX_FILE)
    if config_doc is not None:
        _write_json(os.path.join(staging, CONFIG_FILE), config_doc)
        written.append(CONFIG_FILE)
    _fsync_directory(staging)
    return written


# ------------------------------------------------------------------------- placing the folder

#: The files an export writes. ``overwrite`` replaces only a directory holding these and nothing
#: else: files added beside an export (tokenizer, README, generation_config.json) are user data
#: an export would not write back, so such a directory is refused, not emptied.
_SHARD_FILE = re.compile(r"model-\d{5,}-of-\d{5,}\.safetensors")


def _written_by_export(name: str) -> bool:
    return name in (SINGLE_FILE, INDEX_FILE, CONFIG_FILE) or _SHARD_FILE.fullmatch(name) is not None


def _local_checkpoint(checkpoint: str | os.PathLike[str], load_options: Mapping[str, Any]) -> str | None:
    """The local directory of the checkpoint being exported, or None (a URL, or a store given)."""
    if load_options.get("storage") is not None:
        return None
    text = os.fspath(checkpoint)
    if "://" in text:
        protocol, _, rest = text.partition("://")
        return os.path.abspath(rest) if protocol == "file" else None
    return os.path.abspath(text)


def _describe(folder: str, name: str) -> str:
    path = os.path.join(folder, name)
    if os.path.islink(path):
        return f"{name} (a symlink)"
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, MANIFEST_FILENAME)):
            return f"{name}/ (a shardkeep checkpoint)"
        return f"{name}/"
    return name


def _check_destination(target: str, overwrite: bool, source: str | None) -> None:
    """Refuse a destination that is, holds or lies inside the checkpoint ``source``, and an
    existing one unless ``overwrite`` and it is a Hugging Face folder holding only what an
    export writes. Nothing is changed here."""
    real = os.path.realpath(target)
    if source is not None:
        checkpoint = os.path.realpath(source)
        if real == checkpoint:
            raise CheckpointExistsError(
                f"{target} is the checkpoint being exported; an export never replaces a shardkeep checkpoint"
            )
        common = os.path.commonpath([real, checkpoint])
        if common == real:
            raise UnsafePathError(
                f"{target} holds the checkpoint being exported ({source}); an export never replaces a directory "
                "holding a checkpoint: choose a new folder beside it"
            )
        if common == checkpoint:
            raise UnsafePathError(
                f"{target} is inside the checkpoint being exported ({source}); an export never writes into a "
                "checkpoint: choose a folder outside it"
            )
    if not os.path.lexists(target):
        return
    if not overwrite:
        raise CheckpointExistsError(f"{target} already exists; pass overwrite=True (--force) to replace it")
    if os.path.islink(target) or not os.path.isdir(target):
        raise CheckpointExistsError(f"{target} exists and is not a directory; it is not replaced by a model folder")
    if os.path.exists(os.path.join(target, MANIFEST_FILENAME)):
        raise CheckpointExistsError(f"{target} is a shardkeep checkpoint; an export never replaces one")
    try:
        names = sorted(os.listdir(target))
        foreign = [
            name
            for name in names
            if not (_written_by_export(name) and stat.S_ISREG(os.lstat(os.path.join(target, name)).st_mode))
        ]
    except OSError as exc:
        raise StorageError(f"cannot read {target} to check it may be replaced: {exc}") from exc
    if foreign:
        shown = ", ".join(_describe(target, name) for name in foreign[:8])
        more = f" and {len(foreign) - 8} more" if len(foreign) > 8 else ""
        raise CheckpointExistsError(
            f"{target} holds {shown}{more}, which an export does not write; overwrite (--force) replaces only a Hugging Face "
            f"folder holding nothing but {SINGLE_FILE} or model-*-of-*.safetensors shards with {INDEX_FILE}, "
            f"and {CONFIG_FILE}: nothing was changed; move them away or choose another folder"
        )
    if not is_hf_folder(target):
        raise CheckpointExistsError(
            f"{target} is not a Hugging Face model folder (it holds no {SINGLE_FILE} or {INDEX_FILE}); overwrite "
            "(--force) replaces only a folder an export wrote: nothing was changed; remove it or choose another folder"
        )


def _place(staging: str, target: str, overwrite: bool, source: str | None) -> str | None:
    """Put the finished ``staging`` folder at ``target``; returns where the replaced folder now
    is (to be removed by :func:`_remove_previous`), or None. If it raises, ``staging`` still
    holds the new folder and ``target`` is as it was.

    A new ``target`` is a rename that never replaces anything (``RENAME_NOREPLACE``). An existing
    one is checked again, then swapped with ``staging`` in one step (``RENAME_EXCHANGE``):
    ``target`` is the old folder, then the new one, and never missing. Where the exchange is not
    supported it is two renames (old aside, new in), with a moment in which ``target`` is
    missing; a crash there leaves the old folder at ``.NAME.old-<id>`` beside it."""
    parent, name = os.path.split(target)
    if not os.path.lexists(target):
        local.rename_noreplace_path(staging, target)
        return None
    _check_destination(target, overwrite, source)
    try:
        local.exchange_paths(staging, target)
        return staging  # which now holds the replaced folder
    except local.ExchangeUnsupported:
        pass
    old = os.path.join(parent, sibling_name(name, ".old-", uuid.uuid4().hex[:12], lead="."))
    os.rename(target, old)
    try:
        os.rename(staging, target)
    except BaseException:
        os.rename(old, target)
        raise
    return old


def _remove_previous(old: str) -> bool:
    """Remove the replaced folder ``old`` file by file, only the files an export writes; a folder
    holding anything else (written into it after the check) is left where it is: False."""
    try:
        for entry in os.listdir(old):
            path = os.path.join(old, entry)
            if _written_by_export(entry) and stat.S_ISREG(os.lstat(path).st_mode):
                os.unlink(path)
        os.rmdir(old)
    except OSError:
        return False
    return True


def export_hf(
    checkpoint: str | os.PathLike[str],
    directory: str | os.PathLike[str],
    *,
    subtree: str = "model",
    config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    check_keys: bool = True,
    model_class: str | None = None,
    public_key: PublicKey | None = None,
    overwrite: bool = False,
    **load_options: Any,
) -> HFExportSummary:
    """Write the tensors under ``subtree`` of the checkpoint at ``checkpoint`` as a Hugging Face
    model folder at ``directory`` (see the module docstring).

    ``config`` is a ``config.json`` path (or the folder holding one) or a mapping; without it the
    checkpoint's ``hf_config`` value (stored by an import) is used when present, and otherwise
    only the weights are written. With a config and ``check_keys`` the keys are checked against
    the model class (needs ``transformers``) and tied copies are left out; a mismatch raises
    :class:`~shardkeep.errors.ConfigError` before anything is written, as is a config
    transformers cannot build the model from. The model class is ``model_class`` (a class name
    such as ``"BertForMaskedLM"``), else the config's ``architectures``, else the one task-head
    class of its ``model_type`` whose keys the tensors fit (several: a ConfigError asking for
    ``model_class``); ``config.json`` then names the class checked. Tensors under the model's
    state_dict keys are written under the keys ``save_pretrained`` writes (transformers' own
    key conversions, reverted as it reverts them); tensors already under those keys (an import
    without transformers) are read as ``from_pretrained`` reads them first, so the folder is
    the one ``save_pretrained`` writes either way. ``public_key`` and ``load_options`` go to
    :func:`shardkeep.load`, which checks every digest (and the signature) before any tensor is
    read.

    ``directory`` must not be the checkpoint, hold it or lie inside it
    (:class:`~shardkeep.errors.UnsafePathError`), and must not exist unless ``overwrite``
    (:class:`~shardkeep.errors.CheckpointExistsError`). With ``overwrite`` only a Hugging Face
    folder holding nothing but what an export writes (``model.safetensors`` or
    ``model-*-of-*.safetensors`` shards with ``model.safetensors.index.json``, and
    ``config.json``) is replaced, by an atomic swap; anything else there (a file, a checkpoint,
    a folder with other files or subdirectories) is refused and left untouched."""
    target = os.path.abspath(os.fspath(directory))
    check_name_length(os.path.basename(target), "export destination")
    if load_options.pop("verify", True) is not True:
        raise ConfigError("an export always verifies the checkpoint; verify=False is not accepted")
    limit = parse_size(max_shard_size)
    _split_into_shards()  # a missing dependency is said before the checkpoint is read
    source = _local_checkpoint(checkpoint, load_options)
    _check_destination(target, overwrite, source)
    config_doc, config_source = _given_config(config) if config is not None else (None, None)

    state = api.load(checkpoint, public_key=public_key, **load_options)
    if config_doc is None and isinstance(state, Mapping) and isinstance(state.get(CONFIG_VALUE_KEY), Mapping):
        config_source = f"checkpoint value {CONFIG_VALUE_KEY!r}"
        config_doc = _json_copy(state[CONFIG_VALUE_KEY], config_source)
    try:
        tensors, every_key, values = _subtree_tensors(state, subtree)
        tensors = _own_storages(tensors)
    except _NoTensorsError as exc:
        fitting = None
        if config_doc is not None and check_keys:
            fitting = _fitting_subtree(
                _model_keys(config_doc, config_source or "given", model_class).models[0], exc.keys
            )
        if fitting is None:
            raise
        raise ConfigError(f"{exc}; subtree {fitting!r} fits (--subtree {fitting or chr(39) * 2})") from exc

    if model_class is not None and (config_doc is None or not check_keys):
        raise ConfigError(
            "model_class= (--model-class) names the class the keys are checked against: it needs a config and the key check"
        )
    notes: list[str] = []
    if values:
        notes.append(f"{values} JSON value(s) under {subtree!r} are not tensors and were not written")
    checked_against = None
    dropped: list[str] = []
    total_parameters = None
    if config_doc is None:
        notes.append("no config: only the weights were written (no config.json), and the keys were not checked")
    elif not check_keys:
        notes.append("the key check was skipped: nothing guarantees from_pretrained finds every weight")
    else:
        label = config_source or "given"
        model = _check_keys(_model_keys(config_doc, label, model_class), tensors, every_key, subtree, label)
        checked_against = model.name
        if model.folder:
            # A folder's keys (an import without transformers): read as from_pretrained reads
            # them, to be written as save_pretrained writes the model.
            try:
                tensors = to_model_keys(model.meta, tensors)
            except Exception as exc:  # whatever transformers' converters raise
                raise ConfigError(
                    f"transformers could not convert the tensors to the keys of {model.name}: {_one_line(exc)}"
                ) from exc
        named = config_doc.get("architectures")
        if named != [model.name]:
            config_doc["architectures"] = [model.name]  # as save_pretrained writes it: the class checked
            said = f"names {', '.join(map(str, named))}" if named else "names no architecture"
            notes.append(f"the config {said}; config.json names {model.name}, the class checked")
        for target_key, source_key in sorted(model.tied.items()):
            if target_key in tensors and source_key in tensors:
                if _same_bytes(tensors[target_key], tensors[source_key]):
                    del tensors[target_key]
                    dropped.append(target_key)
                else:
                    notes.append(
                        f"{target_key} is tied to {source_key} in the config but differs from it; both were written "
                        "(from_pretrained will not tie them)"
                    )
        total_parameters = int(model.meta.num_parameters())
        order = {key: index for index, key in enumerate(model.meta.state_dict())}
        tensors = dict(sorted(tensors.items(), key=lambda item: order.get(item[0], len(order))))
        try:
            tensors = to_folder_keys(model.meta, tensors)
        except Exception as exc:  # whatever transformers' converters raise
            raise ConfigError(
                f"transformers could not convert the keys of {model.name} to the ones save_pretrained writes: "
                f"{_one_line(exc)}"
            ) from exc

    _check_writable_dtypes(tensors)
    plan, total_size = _plan_files(tensors, limit)
    if total_parameters is None:  # no model to count its parameters: every element written
        total_parameters = sum(tensor.numel() for tensor in tensors.values())
    parent = os.path.dirname(target)
    staging = os.path.join(parent, sibling_name(os.path.basename(target), ".tmp-", uuid.uuid4().hex[:12], lead="."))
    try:
        os.mkdir(staging)
        try:
            files = _write_folder(staging, tensors, plan, config_doc, total_parameters, total_size)
            previous = _place(staging, target, overwrite, source)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)  # still the new folder (see _place)
            raise
        _fsync_directory(parent)
    except OSError as exc:
        raise StorageError(f"cannot write {target}: {exc}") from exc
    if previous is not None and not _remove_previous(previous):
        notes.append(f"the replaced folder was kept at {previous}: it holds files an export does not write")
    return HFExportSummary(
        path=target,
        files=tuple(files),
        tensors=len(tensors),
        bytes=sum(tensor.numel() * tensor.element_size() for tensor in tensors.values()),
        tied_dropped=tuple(dropped),
        config_source=config_source,
        checked_against=checked_against,
        notes=tuple(notes),
    )


# ----------------------------------------------------------------------------------- the import


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
    index = _json_file(path, "index")
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


def model_keys_of(folder: HFFolder, source: str) -> tuple[dict[str, torch.Tensor], str]:
    """The tensors of ``folder`` under the state_dict keys of the model class its config names,
    converted as ``from_pretrained`` converts them (:func:`to_model_keys`: Mixtral's per-expert
    ``w1``/``w3`` weights become the fused ``mlp.experts.gate_up_proj``), so that they load into
    that model with ``shardkeep.load(..., into=)``; and a sentence saying which keys they are
    (recorded by an import). The folder's keys are kept as they are when there is no config, no
    transformers, or no class of the config that they fit; ``source`` names the folder."""
    if folder.config is None:
        return folder.tensors, f"as in the folder (it has no {CONFIG_FILE})"
    try:
        import transformers
    except ImportError:
        return folder.tensors, "as in the folder (transformers is not installed to convert them)"
    try:
        candidates = _model_keys(folder.config, os.path.join(source, CONFIG_FILE))
    except ConfigError as exc:
        return folder.tensors, f"as in the folder ({exc})"
    for model in candidates.models:
        try:
            converted = to_model_keys(model.meta, folder.tensors)
        except Exception as exc:  # whatever transformers' converters raise
            raise UnsupportedValueError(
                f"transformers could not convert the weights of {source} to the keys of {model.name}: {_one_line(exc)}"
            ) from exc
        missing, unexpected = model.difference(set(converted))
        if not missing and not unexpected:
            return converted, f"the state_dict keys of {model.name} (transformers {transformers.__version__})"
    names = ", ".join(model.name for model in candidates.models)
    return folder.tensors, f"as in the folder (they fit no model class of its config: {names})"


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
    config = _json_file(config_path, "config") if os.path.isfile(config_path) else None
    return HFFolder(tensors=tensors, config=config, files=names)
