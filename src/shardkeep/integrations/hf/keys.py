"""The keys a Hugging Face model class reads: the check of exported keys and shapes against the
class built from a config, and transformers' key conversions between a model and its folder.

The model class (named by ``model_class``, the config's ``architectures`` or the keys) is built
from the config on the meta device, so no memory is spent on weights: a key the model expects
and the folder lacks would be initialised at random by ``from_pretrained`` without an error, so
any difference is refused, naming the keys (or the shapes) and the subtree that would fit. The
same meta model says which weights are tied (``lm_head.weight`` to ``transformer.wte.weight`` in
GPT-2). :func:`to_folder_keys` and :func:`to_model_keys` convert keys as ``save_pretrained`` and
``from_pretrained`` do (per-expert weights for the fused expert tensors of Mixtral and
Qwen2-MoE). ``transformers`` is imported only when a check or a conversion runs.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from shardkeep.errors import ConfigError, DependencyError, UnsupportedValueError
from shardkeep.integrations.hf.folder import CONFIG_FILE, HFFolder

__all__ = [
    "Candidates",
    "ModelKeys",
    "config_label",
    "error_line",
    "fitting_subtree",
    "matching_model",
    "model_candidates",
    "model_keys_of",
    "to_folder_keys",
    "to_model_keys",
]


def config_label(source: str) -> str:
    """``source`` (a path, ``given``, ``checkpoint value 'hf_config'``) as words for an error."""
    if source == "given":
        return "the config given"
    if source.startswith("checkpoint value "):
        return f"the config in the {source}"
    return f"config {source}"


def error_line(exc: BaseException, limit: int = 400) -> str:
    """``exc`` as one line of at most ``limit`` characters, after its type's name."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}"


@dataclass(frozen=True)
class ModelKeys:
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

    def in_folder_layout(self) -> ModelKeys | None:
        """The same model's keys as ``save_pretrained`` writes them, or None when transformers
        converts none of its keys (then they are its state_dict keys)."""
        if self.folder:
            return self
        meta_state = self.meta.state_dict()
        written = to_folder_keys(self.meta, meta_state)
        if set(written) == set(meta_state):
            return None
        return ModelKeys(
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
class Candidates:
    """The model classes a config allows; ``by_keys``: none was named, the keys choose one."""

    models: list[ModelKeys]
    by_keys: bool


def model_candidates(config_doc: dict[str, Any], source: str, model_class: str | None = None) -> Candidates:
    """The key sets of ``model_class``, else of the classes a config names (``architectures``),
    else of every task-head class transformers has for its ``model_type`` (the keys then choose:
    see :func:`matching_model`). Whatever transformers raises on a bad config is a
    :class:`ConfigError` naming ``source`` (see :func:`config_label`) and the class."""
    transformers = _transformers()
    label = config_label(source)
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
            f"{''.join(f', architecture {name}' for name, _ in builders)}): {error_line(exc)}"
        ) from exc
    by_keys = not builders
    if by_keys:
        builders = [(name, getattr(transformers, name).from_config) for name in (*_HEAD_AUTO_CLASSES, "AutoModel")]
    found: list[ModelKeys] = []
    refused: list[str] = []
    for name, build in builders:
        if by_keys and name == "AutoModel" and found:
            break  # the base model only for a model_type without a head class
        try:
            with torch.device("meta"):
                model = build(config)
        except Exception as exc:  # AttributeError from a class of another model_type, ...
            if name.startswith("Auto") and isinstance(exc, ValueError):
                refused.append(f"{name}: {error_line(exc, 200)}")
                continue  # an Auto class without this model_type
            raise ConfigError(
                f"cannot build {name} from {label} (model_type {model_type!r}): {error_line(exc)}"
            ) from exc
        class_name = type(model).__name__ if name.startswith("Auto") else name
        if all(known.name != class_name for known in found):
            found.append(_keys_of(class_name, model))
    if not found:
        raise ConfigError(
            f"transformers has no model class for model_type {model_type!r} of {label} ({'; '.join(refused)})"
        )
    return Candidates(found, by_keys)


def _keys_of(name: str, model: Any) -> ModelKeys:
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
    return ModelKeys(
        name=name,
        expected=expected,
        shapes={key: tuple(tensor.shape) for key, tensor in state.items()},
        tied=tied,
        ignore_missing=_pattern(getattr(model, "_keys_to_ignore_on_load_missing", None)),
        ignore_unexpected=_pattern(unexpected_patterns),
        meta=model,
    )


def fitting_subtree(model: ModelKeys, all_keys: set[str]) -> str | None:
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


def matching_model(
    candidates: Candidates, tensors: Mapping[str, torch.Tensor], all_keys: set[str], subtree: str, source: str
) -> ModelKeys:
    """The model whose keys and shapes ``tensors`` match: the first of the classes named, or,
    when the keys choose (``by_keys``), the one class they fit (several is a ConfigError asking
    for the class). Each class is tried with its state_dict keys, then with the keys
    ``save_pretrained`` writes (an imported folder's). Else a ConfigError naming the keys that
    differ or, when the keys fit, each tensor whose shape differs (with both shapes:
    ``from_pretrained`` refuses those)."""
    keys = set(tensors)
    fitting: list[ModelKeys] = []
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
            f"the tensors under subtree {subtree!r} fit {names}, and {config_label(source)} names no architecture: "
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
    subtree_fits = fitting_subtree(model, all_keys)
    if subtree_fits is not None and subtree_fits != subtree:
        hint = f"; subtree {subtree_fits!r} fits (--subtree {subtree_fits or chr(39) * 2})"
    others = [other.name for other in candidates.models[1:]]
    tried = f" (nor {', '.join(others)})" if others else ""
    raise ConfigError(
        f"the tensors under subtree {subtree!r} do not fit {model.name}{tried}: {' and '.join(problems)}; "
        f"from_pretrained would initialise missing weights at random, so nothing was written{hint}"
    )


def _check_shapes(model: ModelKeys, tensors: Mapping[str, torch.Tensor], subtree: str, source: str) -> None:
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
            f"the tensors under subtree {subtree!r} have the keys of {model.name} built from {config_label(source)}, "
            f"but {len(wrong)} differ in shape ({shown}{more}); from_pretrained would refuse them, so nothing was "
            "written: give the config the model was trained with"
        )


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
        candidates = model_candidates(folder.config, os.path.join(source, CONFIG_FILE))
    except ConfigError as exc:
        return folder.tensors, f"as in the folder ({exc})"
    for model in candidates.models:
        try:
            converted = to_model_keys(model.meta, folder.tensors)
        except Exception as exc:  # whatever transformers' converters raise
            raise UnsupportedValueError(
                f"transformers could not convert the weights of {source} to the keys of {model.name}: {error_line(exc)}"
            ) from exc
        missing, unexpected = model.difference(set(converted))
        if not missing and not unexpected:
            return converted, f"the state_dict keys of {model.name} (transformers {transformers.__version__})"
    names = ", ".join(model.name for model in candidates.models)
    return folder.tensors, f"as in the folder (they fit no model class of its config: {names})"
