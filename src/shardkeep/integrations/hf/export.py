"""The export of a checkpoint's model as a Hugging Face folder that ``transformers``'
``from_pretrained`` loads (``shardkeep export --format hf``).

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
"""

from __future__ import annotations

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
import shardkeep.config as shardkeep_config
from shardkeep.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
    DependencyError,
    StorageError,
    UnsafePathError,
    UnsupportedValueError,
)
from shardkeep.integrations.hf.folder import (
    CONFIG_FILE,
    CONFIG_VALUE_KEY,
    INDEX_FILE,
    SINGLE_FILE,
    is_hf_folder,
    read_json_file,
)
from shardkeep.integrations.hf.keys import (
    ModelKeys,
    config_label,
    error_line,
    fitting_subtree,
    matching_model,
    model_candidates,
    to_folder_keys,
    to_model_keys,
)
from shardkeep.manifest import MANIFEST_FILENAME
from shardkeep.names import STAGING_MARKER, check_name_length, sibling_name
from shardkeep.storage.localfs import current, fsync_directory_path, replace_dir, write_file_atomic
from shardkeep.storage.locations import local_path
from shardkeep.tensors.convert import TORCH_TO_NAME
from shardkeep.tensors.flatten import flatten_state
from shardkeep.tensors.shardfile import CARRIED_DTYPES

if TYPE_CHECKING:
    from shardkeep.options import PublicKey

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "HFExportSummary", "export_hf", "parse_size"]

DEFAULT_MAX_SHARD_SIZE = "5GB"


def parse_size(value: int | float | str) -> int:
    """Bytes from ``value``: an int, or a string such as ``"5GB"``, ``"500MB"``, ``"2GiB"`` or
    ``"1000"`` (decimal units, as ``save_pretrained`` reads them; ``KiB``/``MiB``/``GiB`` binary;
    :func:`shardkeep.config.parse_size`), at least one byte."""
    return shardkeep_config.parse_size(value, where="max_shard_size", positive=True)


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


def _json_copy(config: Mapping[str, Any], source: str) -> dict[str, Any]:
    """A plain JSON copy of ``config`` (what ``config.json`` will hold), or ConfigError."""
    try:
        return json.loads(json.dumps(dict(config)))  # type: ignore[no-any-return]
    except (TypeError, ValueError, RecursionError) as exc:
        raise ConfigError(f"{config_label(source)} is not JSON: {error_line(exc)}") from exc


def _given_config(config: str | os.PathLike[str] | Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    if isinstance(config, Mapping):
        return _json_copy(config, "given"), "given"
    path = os.fspath(config)
    if os.path.isdir(path):
        path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(path):
        raise CheckpointNotFoundError(f"config {path} does not exist")
    return read_json_file(path, "config"), path


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


def _write_json(path: str, document: Any) -> None:
    write_file_atomic(path, (json.dumps(document, indent=2, sort_keys=True) + "\n").encode("utf-8"))


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
        current().fsync_file(path)
        weight_map.update(dict.fromkeys(keys, name))
    written = list(names)
    if len(plan) > 1:
        metadata = {"total_parameters": total_parameters, "total_size": total_size}
        _write_json(os.path.join(staging, INDEX_FILE), {"metadata": metadata, "weight_map": weight_map})
        written.append(INDEX_FILE)
    if config_doc is not None:
        _write_json(os.path.join(staging, CONFIG_FILE), config_doc)
        written.append(CONFIG_FILE)
    fsync_directory_path(staging)
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
    return local_path(checkpoint)


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

    An existing ``target`` is checked again first. Then
    :meth:`~shardkeep.storage.localfs.LocalFS.replace_dir`: a new ``target`` is a rename that
    never replaces anything (``RENAME_NOREPLACE``); an existing one is swapped with ``staging``
    in one step (``RENAME_EXCHANGE``): ``target`` is the old folder, then the new one, and never
    missing. Where the exchange is not supported it is two renames (old aside, new in), with a
    moment in which ``target`` is missing; a crash there leaves the old folder at
    ``.NAME.old-<id>`` beside it."""
    if os.path.lexists(target):
        _check_destination(target, overwrite, source)
    return replace_dir(staging, target)


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


def _chosen_tensors(
    state: Any, subtree: str, config_doc: dict[str, Any] | None, config_source: str | None, model_class: str | None
) -> tuple[dict[str, torch.Tensor], set[str], int]:
    """:func:`_subtree_tensors`, each tensor in a storage of its own; when ``subtree`` holds no
    tensor and a config is there to check the keys against, the error names the subtree that
    fits the model."""
    try:
        tensors, every_key, values = _subtree_tensors(state, subtree)
        return _own_storages(tensors), every_key, values
    except _NoTensorsError as exc:
        fitting = None
        if config_doc is not None:
            fitting = fitting_subtree(
                model_candidates(config_doc, config_source or "given", model_class).models[0], exc.keys
            )
        if fitting is None:
            raise
        raise ConfigError(f"{exc}; subtree {fitting!r} fits (--subtree {fitting or chr(39) * 2})") from exc


def _as_save_pretrained_writes(
    model: ModelKeys, tensors: dict[str, torch.Tensor], config_doc: dict[str, Any], notes: list[str]
) -> tuple[dict[str, torch.Tensor], list[str], int]:
    """``tensors`` (which fit ``model``) as ``save_pretrained`` writes that model: under its
    folder keys, in its order, each tied copy equal to its source left out; and the tied copies
    left out and the model's parameter count. ``config_doc`` is made to name the class checked;
    what the user should know is appended to ``notes``."""
    if model.folder:
        # A folder's keys (an import without transformers): read as from_pretrained reads
        # them, to be written as save_pretrained writes the model.
        try:
            tensors = to_model_keys(model.meta, tensors)
        except Exception as exc:  # whatever transformers' converters raise
            raise ConfigError(
                f"transformers could not convert the tensors to the keys of {model.name}: {error_line(exc)}"
            ) from exc
    named = config_doc.get("architectures")
    if named != [model.name]:
        config_doc["architectures"] = [model.name]  # as save_pretrained writes it: the class checked
        said = f"names {', '.join(map(str, named))}" if named else "names no architecture"
        notes.append(f"the config {said}; config.json names {model.name}, the class checked")
    dropped: list[str] = []
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
    order = {key: index for index, key in enumerate(model.meta.state_dict())}
    tensors = dict(sorted(tensors.items(), key=lambda item: order.get(item[0], len(order))))
    try:
        tensors = to_folder_keys(model.meta, tensors)
    except Exception as exc:  # whatever transformers' converters raise
        raise ConfigError(
            f"transformers could not convert the keys of {model.name} to the ones save_pretrained writes: "
            f"{error_line(exc)}"
        ) from exc
    return tensors, dropped, int(model.meta.num_parameters())


def _write_and_place(
    target: str,
    tensors: dict[str, torch.Tensor],
    plan: dict[str, list[str]],
    config_doc: dict[str, Any] | None,
    totals: tuple[int, int],
    overwrite: bool,
    source: str | None,
) -> tuple[list[str], str | None]:
    """Write the folder under a temporary name beside ``target`` and put it in place
    (:func:`_place`); the files written, and where the replaced folder is (or None). ``totals``
    are the index's ``total_parameters`` and ``total_size``."""
    parent = os.path.dirname(target)
    staging = os.path.join(
        parent, sibling_name(os.path.basename(target), STAGING_MARKER, uuid.uuid4().hex[:12], lead=".")
    )
    try:
        os.mkdir(staging)
        try:
            files = _write_folder(staging, tensors, plan, config_doc, *totals)
            previous = _place(staging, target, overwrite, source)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)  # still the new folder (see _place)
            raise
        fsync_directory_path(parent)
    except OSError as exc:
        raise StorageError(f"cannot write {target}: {exc}") from exc
    return files, previous


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
    tensors, every_key, values = _chosen_tensors(
        state, subtree, config_doc if check_keys else None, config_source, model_class
    )
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
        model = matching_model(model_candidates(config_doc, label, model_class), tensors, every_key, subtree, label)
        checked_against = model.name
        tensors, dropped, total_parameters = _as_save_pretrained_writes(model, tensors, config_doc, notes)

    _check_writable_dtypes(tensors)
    plan, total_size = _plan_files(tensors, limit)
    if total_parameters is None:  # no model to count its parameters: every element written
        total_parameters = sum(tensor.numel() for tensor in tensors.values())
    files, previous = _write_and_place(
        target, tensors, plan, config_doc, (total_parameters, total_size), overwrite, source
    )
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
