"""Hugging Face Accelerate: save and restore what ``Accelerator.save_state`` saves, as one
verified shardkeep checkpoint instead of a folder of pickles.

``Accelerator.save_state`` writes ``model.safetensors``, then ``optimizer.bin``,
``scheduler.bin``, ``sampler.bin``, ``random_states_<i>.pkl`` and ``custom_checkpoint_<i>.pkl``
with ``torch.save`` (pickles). :func:`save_state` saves the same things through
:func:`shardkeep.save`:

- every prepared model (unwrapped), optimizer and scheduler, in the order Accelerate holds them;
- the grad scaler, when mixed precision uses one;
- each stateful data loader's state, and each seedable sampler's epoch and seed;
- every object registered with ``accelerator.register_for_checkpointing``;
- ``accelerator.step``;
- the RNG states of this process: Python's ``random``, numpy's, torch's CPU generator and, with
  CUDA, every CUDA device's, stored as JSON bytes, so nothing is pickled.

:func:`load_state` fills the live objects in place after checking every digest, and puts the
RNG states and the step back. Accelerate itself is never imported here: the functions read the
``Accelerator``'s own attributes.

Both follow ``Accelerator.save_state``/``load_state`` otherwise: automatic checkpoint naming
(``project_dir/checkpoints/checkpoint_<iteration>``), ``total_limit``,
``project_configuration.iteration``, the newest checkpoint when no path is given, and the
save-state and load-state pre-hooks. Where they differ, it is to lose nothing: ``total_limit``
deletes only after the new checkpoint is committed, and only committed ``checkpoint_<N>``
checkpoints (with a manifest that reads as shardkeep's); the files the save hooks write are part of the checkpoint, digested like the rest;
a registered object's state is converted losslessly where a state cannot hold it as it is.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from shardkeep.api import load, read_manifest, save
from shardkeep.catalog import CheckpointRoot
from shardkeep.config import WriteOptions
from shardkeep.conversions import ValueEncoder, decode_values
from shardkeep.distributed.coordinator import DEFAULT_TIMEOUT
from shardkeep.errors import (
    CheckpointExistsError,
    CheckpointFieldError,
    CheckpointNotFoundError,
    ConfigError,
    IntegrityError,
    ManifestError,
    RetentionError,
    ShardkeepError,
    StorageError,
    UnsafePathError,
    UnsupportedValueError,
)
from shardkeep.manifest import MANIFEST_FILENAME, Manifest, Tier, unsafe_path_reason
from shardkeep.options import LEGACY_KEYWORDS, Incremental, LoadSelection, ManifestFields, TierPlan, regroup
from shardkeep.storage.locations import local_path
from shardkeep.training import TrainingCheckpoint

if TYPE_CHECKING:
    from shardkeep.options import Group, Signer

#: What a load reads of a checkpoint: what ``into`` holds (this process's RNG states, not the others').
_OWN_STATE_ONLY = LoadSelection(extra="ignore")

__all__ = ["accelerator_state", "automatic_checkpoints", "load_state", "save_state"]

logger = logging.getLogger(__name__)


def _process_key(accelerator: Any) -> str:
    return f"process_{int(getattr(accelerator, 'process_index', 0))}"


def _inner_optimizer(optimizer: Any) -> Any:
    """Accelerate's ``AcceleratedOptimizer`` wraps the optimizer that holds the state."""
    return getattr(optimizer, "optimizer", optimizer)


def _sampler_of(loader: Any) -> Any:
    """The seedable sampler of a prepared data loader, if it has one (``epoch`` and
    ``initial_seed`` are all of its state)."""
    for holder in (loader, getattr(loader, "batch_sampler", None)):
        sampler = getattr(holder, "sampler", None)
        if sampler is not None and hasattr(sampler, "epoch") and hasattr(sampler, "initial_seed"):
            return sampler
    return None


def accelerator_state(accelerator: Any) -> dict[str, Any]:
    """The live objects :func:`save_state` saves and :func:`load_state` fills, keyed by kind and
    position (``models.0``, ``optimizers.0``, ``custom.0`` ...)."""
    state: dict[str, Any] = {
        "models": {str(i): accelerator.unwrap_model(model) for i, model in enumerate(accelerator._models)},
        "optimizers": {str(i): _inner_optimizer(opt) for i, opt in enumerate(accelerator._optimizers)},
        "schedulers": {str(i): scheduler for i, scheduler in enumerate(accelerator._schedulers)},
        "dataloaders": {
            str(i): loader
            for i, loader in enumerate(accelerator._dataloaders)
            if getattr(loader, "use_stateful_dataloader", False)
        },
        "custom": {},
    }
    for i, obj in enumerate(accelerator._custom_objects):
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise UnsupportedValueError(
                f"custom object {i} ({type(obj).__name__}) registered for checkpointing has no "
                "state_dict()/load_state_dict()"
            )
        state["custom"][str(i)] = _RegisteredObject(obj, i)
    scaler = getattr(accelerator, "scaler", None)
    if scaler is not None:
        state["scaler"] = scaler
    return state


#: The key, in a registered object's saved state, of the record of its converted values.
CONVERSIONS_KEY = "__shardkeep_conversions__"


class _RegisteredObject:
    """An object registered with ``register_for_checkpointing``, as a stateful value of the
    saved state: the values of its ``state_dict()`` that a state cannot hold as they are (the
    128-bit integers of a numpy ``Generator``'s ``bit_generator.state``, sets, bytes ...) are
    converted losslessly (:mod:`shardkeep.conversions`), the conversions recorded under
    :data:`CONVERSIONS_KEY` in its saved state and undone before its ``load_state_dict``."""

    def __init__(self, obj: Any, index: int) -> None:
        self.obj, self.index = obj, index

    def _encoder(self) -> ValueEncoder:
        return ValueEncoder(
            subject=f"state of the object registered for checkpointing at index {self.index} ({type(self.obj).__name__})",
            hint="; or have its state_dict() return such values",
        )

    def state_dict(self) -> Any:
        state = self.obj.state_dict()
        if not isinstance(state, Mapping):
            return state  # stored as it is, or refused by the save with its key named
        if CONVERSIONS_KEY in state:
            raise UnsupportedValueError(
                f"the state of the object registered at index {self.index} has the key {CONVERSIONS_KEY!r}, "
                "which shardkeep reserves"
            )
        encoder = self._encoder()
        encoded = encoder.mapping(state, ())
        if encoder.conversions:
            encoded[CONVERSIONS_KEY] = encoder.conversion_record()
        return encoded

    def load_state_dict(self, state: Any) -> None:
        if isinstance(state, Mapping) and CONVERSIONS_KEY in state:
            plain = {key: value for key, value in state.items() if key != CONVERSIONS_KEY}
            state = decode_values(
                plain,
                state[CONVERSIONS_KEY],
                source=f"custom.{self.index}",
                record_name=f"custom.{self.index}.{CONVERSIONS_KEY}",
            )
        self.obj.load_state_dict(state)


def _rng_bytes() -> torch.Tensor:
    """This process's RNG states (:meth:`TrainingCheckpoint.capture_rng`) as UTF-8 JSON bytes."""
    captured = TrainingCheckpoint.capture_rng()
    plain = {
        "python": captured["python"],
        "numpy": {**captured["numpy"], "key": captured["numpy"]["key"].tolist()},
        "torch": captured["torch"].tolist(),
    }
    if "cuda" in captured:
        plain["cuda"] = [state.tolist() for state in captured["cuda"]]
    return torch.frombuffer(bytearray(json.dumps(plain).encode()), dtype=torch.uint8)


class _ProcessRng:
    """This process's RNG states as a stateful object of the saved state: restored by the fill
    itself (``load_state_dict``), so a refused state rolls back everything the load changed."""

    def state_dict(self) -> dict[str, Any]:
        return {"states": _rng_bytes()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _restore_rng(state["states"])


class _Counters:
    """``accelerator.step`` and the samplers' epochs and seeds, restored inside the fill."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator
        self.samplers = {
            str(i): sampler
            for i, loader in enumerate(accelerator._dataloaders)
            if (sampler := _sampler_of(loader)) is not None
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": int(self.accelerator.step),
            "samplers": {
                index: {"epoch": int(sampler.epoch), "initial_seed": int(sampler.initial_seed)}
                for index, sampler in self.samplers.items()
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        try:
            step = int(state["step"])
            samplers = {
                index: (int(state["samplers"][index]["epoch"]), int(state["samplers"][index]["initial_seed"]))
                for index in self.samplers
            }
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointFieldError("counters", f"the saved step or sampler states are unusable: {exc!r}") from exc
        self.accelerator.step = step
        for index, (epoch, seed) in samplers.items():
            self.samplers[index].epoch, self.samplers[index].initial_seed = epoch, seed


def _state_with_counters(accelerator: Any) -> dict[str, Any]:
    state = accelerator_state(accelerator)
    state["counters"] = _Counters(accelerator)
    state["rng"] = {_process_key(accelerator): _ProcessRng()}
    return state


# --------------------------------------------------------------------------------------------
# Automatic checkpoint naming (ProjectConfiguration)
# --------------------------------------------------------------------------------------------

#: The names automatic checkpoint naming gives: ``checkpoint_<iteration>``.
AUTOMATIC_NAME = re.compile(r"checkpoint_([0-9]+)")


def _automatic(accelerator: Any) -> bool:
    config = getattr(accelerator, "project_configuration", None)
    return bool(getattr(config, "automatic_checkpoint_naming", False))


def _checkpoints_dir(accelerator: Any) -> str:
    project_dir = accelerator.project_dir
    if project_dir is None:
        raise ConfigError(
            "automatic_checkpoint_naming=True needs a project directory: ProjectConfiguration(project_dir=...) "
            "or Accelerator(project_dir=...)"
        )
    return os.path.join(os.fspath(project_dir), "checkpoints")


def automatic_checkpoints(directory: str | os.PathLike[str]) -> list[tuple[int, str]]:
    """The committed checkpoints named ``checkpoint_<N>`` in ``directory`` (a manifest is
    there), as ``(N, path)``, oldest (smallest ``N``) first. Staging directories, checkpoints
    being deleted and anything else in ``directory`` are not checkpoints and are left out."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise StorageError(f"cannot list {os.fspath(directory)}: {exc}") from exc
    found = []
    for name in names:
        match = AUTOMATIC_NAME.fullmatch(name)
        path = os.path.join(directory, name)
        if match is not None and os.path.isfile(os.path.join(path, MANIFEST_FILENAME)):
            found.append((int(match.group(1)), path))
    return sorted(found)


def _keep_newest(directory: str, total_limit: int, newest: str) -> None:
    """Delete the oldest ``checkpoint_<N>`` so that at most ``total_limit`` remain (at least the
    one just committed, ``newest``), each un-committed first (:meth:`CheckpointRoot.delete`).
    Only folders whose manifest reads as a shardkeep manifest count and are deleted: another
    tool's ``manifest.json``, or a damaged one, is left as it is."""
    root = CheckpointRoot.at(directory)
    known = root.manifests()
    readable = {name for name, _ in known[0]}
    found = [(step, path) for step, path in automatic_checkpoints(directory) if os.path.basename(path) in readable]
    doomed = [path for _, path in found if path != newest][: max(len(found) - max(total_limit, 1), 0)]
    if not doomed:
        return
    for path in doomed:
        try:
            root.delete(os.path.basename(path), known)
        except ShardkeepError as exc:
            raise RetentionError(
                f"{newest} is committed, but deleting {path} (total_limit={total_limit}) failed: {exc}", newest
            ) from exc
        known = root.manifests()


# --------------------------------------------------------------------------------------------
# Files the save-state pre-hooks write
# --------------------------------------------------------------------------------------------

#: The top-level key under which the files written by save-state pre-hooks are stored.
HOOK_FILES_KEY = "hook_files"


def _hook_files(directory: str) -> dict[str, dict[str, Any]]:
    """Every regular file under ``directory`` as ``{"<i>": {"path": relative, "data": uint8}}``,
    the bytes memory-mapped (a model a hook saved is not read into memory first). A path a load
    would refuse (:func:`~shardkeep.manifest.unsafe_path_reason`: a backslash, a control
    character, a drive letter ...) is an :class:`~shardkeep.errors.UnsafePathError`."""
    files: dict[str, dict[str, Any]] = {}
    for parent, dirs, names in os.walk(directory):
        dirs.sort()
        for name in sorted([*names, *(d for d in dirs if os.path.islink(os.path.join(parent, d)))]):
            full = os.path.join(parent, name)
            relative = os.path.relpath(full, directory).replace(os.sep, "/")
            reason = unsafe_path_reason(relative)
            if reason is not None:  # a load refuses it: a checkpoint holding it could never be loaded
                raise UnsafePathError(
                    f"a save-state pre-hook wrote {relative!r}, which a checkpoint cannot hold: {reason}"
                )
            if os.path.islink(full) or not os.path.isfile(full):
                raise UnsupportedValueError(
                    f"a save-state pre-hook wrote {relative!r}, which is not a regular file (a symlink, a FIFO ...): "
                    "shardkeep stores the regular files a hook writes"
                )
            size = os.path.getsize(full)
            data = np.memmap(full, dtype=np.uint8, mode="r") if size else np.empty(0, dtype=np.uint8)
            files[str(len(files))] = {"path": relative, "data": data}
    return files


class _HookFileWriter:
    """Writes the files a checkpoint's ``hook_files`` holds into a fresh directory, as the load
    fill hands them over (after their digests were checked)."""

    def __init__(self, directory: str, source: str) -> None:
        self.directory, self.source = directory, source

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for index, entry in state.items():
            try:
                relative, data = entry["path"], entry["data"]
            except (KeyError, TypeError) as exc:
                raise IntegrityError(f"{self.source}: {HOOK_FILES_KEY}.{index} is malformed") from exc
            reason = unsafe_path_reason(relative)
            if reason is not None:
                raise UnsafePathError(f"{self.source}: {HOOK_FILES_KEY}.{index}: {relative!r}: {reason}")
            target = os.path.join(self.directory, *relative.split("/"))
            try:
                os.makedirs(os.path.dirname(target), exist_ok=True)
                flags = (
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
                )
                with os.fdopen(os.open(target, flags, 0o600), "wb") as out:
                    out.write(np.ascontiguousarray(np.asarray(data), dtype=np.uint8).data)
            except OSError as exc:
                raise StorageError(
                    f"cannot restore {relative!r} of {self.source} into {self.directory}: {exc}"
                ) from exc


def _scratch_parent(target: str) -> str | None:
    """Where a save's scratch directory for hook files goes: next to the checkpoint, on the
    same filesystem, which has room for what is saved there (``None``: the system's temporary
    directory, for a store URL; ``file://PATH`` is the local path PATH)."""
    path = local_path(target)
    if path is None:
        return None
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    return parent


# --------------------------------------------------------------------------------------------
# save_state / load_state
# --------------------------------------------------------------------------------------------


def save_state(
    accelerator: Any,
    path: str | os.PathLike[str] | None = None,
    *,
    options: WriteOptions | None = None,
    tiers: TierPlan | Sequence[Tier] | None = None,
    incremental: Incremental | bool | str | os.PathLike[str] = False,
    fields: ManifestFields | None = None,
    signer: Signer | None = None,
    process_group: Group | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    **legacy: Any,
) -> Manifest:
    """Save what ``accelerator.save_state`` would save as one shardkeep checkpoint and return
    its manifest. The options are those of :func:`shardkeep.save` (``legacy``: its keyword
    spellings of the previous release, with a :class:`DeprecationWarning`). With several
    processes, every process calls it, as it calls ``save_state``; each keeps its own RNG states.

    Where, as ``Accelerator.save_state`` decides: with ``ProjectConfiguration(
    automatic_checkpoint_naming=True)``, ``project_dir/checkpoints/checkpoint_<iteration>``
    (``path`` is then ignored, as Accelerate ignores it), an existing one is a
    :class:`~shardkeep.errors.CheckpointExistsError`, and after the commit the oldest
    ``checkpoint_<N>`` beyond ``total_limit`` are deleted (by the main process; a failure there
    is a :class:`~shardkeep.errors.RetentionError`, the new checkpoint being committed);
    otherwise ``path``. Every save advances ``project_configuration.iteration`` by one.

    The save-state pre-hooks (``accelerator.register_save_state_pre_hook``) are called first,
    as Accelerate calls them: ``hook(models, weights, output_dir)`` with the prepared models,
    the state dicts of the unwrapped models (what is saved under ``models.<i>``: a hook that
    saves a model itself removes its weights from the list) and a fresh directory; every file
    the hooks write there is saved in the checkpoint (``hook_files``), digested like the rest.
    """
    groups = regroup(
        "save_state",
        legacy,
        options=options,
        tiers=tiers,
        incremental=incremental,
        fields=fields,
        accepted=LEGACY_KEYWORDS,
    )
    save_options: dict[str, Any] = {
        "options": groups.options,
        "tiers": groups.tiers,
        "incremental": groups.incremental,
        "fields": groups.fields,
        "signer": signer,
        "process_group": process_group,
        "timeout": timeout,
    }
    config = accelerator.project_configuration
    directory: str | None = None  # where total_limit applies
    if _automatic(accelerator):
        directory = _checkpoints_dir(accelerator)
        target = os.path.join(directory, f"checkpoint_{config.iteration}")
        if os.path.lexists(target):
            raise CheckpointExistsError(
                f"{target} already exists (project_configuration.iteration is {config.iteration}); set "
                "accelerator.project_configuration.iteration to the iteration to continue from"
            )
    elif path is None:
        raise ConfigError(
            "save_state needs a path, unless the Accelerator's ProjectConfiguration has automatic_checkpoint_naming=True"
        )
    else:
        target = os.fspath(path)
    state = _state_with_counters(accelerator)
    hooks = list(accelerator._save_model_state_pre_hook.values())
    if hooks:
        with tempfile.TemporaryDirectory(prefix=".shardkeep-hooks-", dir=_scratch_parent(target)) as scratch:
            weights = [accelerator.unwrap_model(model).state_dict() for model in accelerator._models]
            for hook in hooks:
                hook(accelerator._models, weights, scratch)
            state["models"] = {str(i): weight for i, weight in enumerate(weights)}
            files = _hook_files(scratch)
            if files:
                state[HOOK_FILES_KEY] = files
            manifest = save(state, target, **save_options)
    else:
        manifest = save(state, target, **save_options)
    config.iteration += 1
    if directory is not None and config.total_limit is not None and accelerator.is_main_process:
        _keep_newest(directory, int(config.total_limit), target)
    return manifest


def load_state(accelerator: Any, path: str | os.PathLike[str] | None = None, **load_options: Any) -> None:
    """Restore a checkpoint written by :func:`save_state` into ``accelerator``'s prepared
    objects, its step and samplers, and this process's RNG states, in place, after every digest
    is checked; all or nothing (a refused RNG state, say for another number of CUDA devices,
    leaves everything as it was). The objects must be prepared in the same order as when it
    was saved; other processes' RNG states are not read (``LoadSelection(extra="ignore")``). ``load_options``
    go to :func:`shardkeep.load` (``public_key=`` ...).

    Without ``path``, with automatic checkpoint naming, the newest committed
    ``project_dir/checkpoints/checkpoint_<N>``; if it cannot be read (a damaged file, a
    missing manifest), the previous one, with a logged warning (not when load-state pre-hooks
    are registered: they may have changed the models already). Without either, a
    :class:`~shardkeep.errors.ConfigError`.

    The load-state pre-hooks (``accelerator.register_load_state_pre_hook``) are called as
    Accelerate calls them, before the models are filled: ``hook(models, input_dir)``, with a
    list of the prepared models (a hook that loads a model itself removes it from the list; the
    models left are filled in order from ``models.<i>``) and a fresh directory holding the files
    the save hooks wrote, after their digests were checked. What a hook changes is its own doing
    and is not undone if the load fails afterwards.
    """
    if path is not None:
        candidates = [os.path.expanduser(os.fspath(path))]
    elif _automatic(accelerator):
        directory = _checkpoints_dir(accelerator)
        candidates = [found for _, found in reversed(automatic_checkpoints(directory))]
        if not candidates:
            raise CheckpointNotFoundError(f"no committed checkpoint_<N> in {directory} to load")
    else:
        raise ConfigError(
            "load_state needs a path, unless the Accelerator's ProjectConfiguration has automatic_checkpoint_naming=True"
        )
    hooks = list(accelerator._load_model_state_pre_hook.values())
    skipped: list[str] = []
    for index, candidate in enumerate(candidates):
        try:
            _load_checkpoint(accelerator, candidate, hooks, load_options)
            return
        except (IntegrityError, ManifestError, CheckpointNotFoundError) as exc:
            if path is not None or hooks or index == len(candidates) - 1:
                if skipped:
                    skipped.append(f"{candidate}: {exc}")
                    raise IntegrityError(
                        f"no checkpoint in {os.path.dirname(candidate)} can be loaded: {'; '.join(skipped)}", skipped
                    ) from exc
                raise
            logger.warning("checkpoint %s cannot be loaded (%s); loading the previous checkpoint", candidate, exc)
            skipped.append(f"{candidate}: {exc}")


_MANIFEST_OPTIONS = ("storage", "limits", "storage_options", "public_key", "require_signature")


def _load_checkpoint(accelerator: Any, path: str, hooks: list[Any], load_options: Mapping[str, Any]) -> None:
    state = _state_with_counters(accelerator)
    if not hooks:
        load(path, into=state, select=_OWN_STATE_ONLY, **load_options)
        return
    manifest = read_manifest(path, **{key: load_options[key] for key in _MANIFEST_OPTIONS if key in load_options})
    stored = {entry.key for _, entry in manifest.iter_tensors()} | {value.key for value in manifest.values}
    with tempfile.TemporaryDirectory(prefix="shardkeep-accelerate-hooks-") as scratch:
        if any(key.startswith(f"{HOOK_FILES_KEY}.") for key in stored):
            writer = _HookFileWriter(scratch, path)
            load(path, into={HOOK_FILES_KEY: writer}, select=_OWN_STATE_ONLY, **load_options)
        models = list(accelerator._models)
        for hook in hooks:
            hook(models, scratch)
        state["models"] = {str(i): accelerator.unwrap_model(model) for i, model in enumerate(models)}
        load(path, into=state, select=_OWN_STATE_ONLY, **load_options)


def _restore_rng(rng: Any) -> None:
    try:
        plain: Mapping[str, Any] = json.loads(bytes(np.asarray(rng, dtype=np.uint8)).decode())
    except (UnicodeDecodeError, ValueError, TypeError) as exc:
        raise CheckpointFieldError("rng", f"the saved RNG states are not JSON: {exc}") from exc
    TrainingCheckpoint.restore_rng(plain)
