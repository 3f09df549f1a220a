"""The typed state of a training run: :class:`TrainingCheckpoint`, its schema checks, its RNG
capture, and the fingerprint of its model args and config that a resumed run is compared with.

The checkpoint manager saves and restores it; nothing here touches storage.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from shardkeep.errors import CheckpointFieldError
from shardkeep.integrity import digest_bytes
from shardkeep.manifest import Manifest
from shardkeep.tensors.flatten import as_manifest_mapping, rebuild_state
from shardkeep.tensors.targets import is_stateful

__all__ = [
    "FILLED",
    "TRAINING_CHECKPOINT_SCHEMA",
    "TrainingCheckpoint",
    "check_training_state",
    "fingerprint_differences",
    "fingerprint_fields",
    "fingerprint_of",
    "is_training_checkpoint",
    "json_mapping",
    "skeleton",
]

#: The ``schema`` value that marks a saved :class:`TrainingCheckpoint`.
TRAINING_CHECKPOINT_SCHEMA = "shardkeep.TrainingCheckpoint/1"
_REQUIRED = ("model", "optimizer", "model_args", "iteration", "best_val_loss", "config")
_OPTIONAL = ("ema", "scheduler", "rng", "data_position")
#: Fields whose objects ``restore(into=...)`` fills in place; the others are replaced.
FILLED = ("model", "optimizer", "ema", "scheduler")


@dataclass(kw_only=True)
class TrainingCheckpoint:
    """The whole state of a training run, as a typed object.

    ``model``, ``optimizer``, ``ema`` and ``scheduler`` may be live objects (a module, an
    optimizer, anything with ``state_dict``) or state dicts. ``model_args`` and ``config`` are
    mappings (or dataclasses) of plain JSON values; they also form the run's fingerprint.
    ``rng`` holds RNG states (see :meth:`capture_rng`), ``data_position`` any JSON value (an
    epoch and batch index, a sampler offset ...). Every field is checked on construction and on
    load; an error names the field.

    With ``track_rng=True`` (the default) every save records the RNG states as they are at that
    save (:meth:`capture_rng`, whatever ``rng`` holds), and
    :meth:`~shardkeep.CheckpointManager.restore` with this object as ``into`` puts them back,
    so a resumed run continues the random stream where the saved run was (dropout, sampling,
    augmentation). ``track_rng=False`` saves ``rng`` as given (``None``: no RNG states) and
    leaves the generators alone on restore.
    """

    model: Any
    optimizer: Any
    model_args: Mapping[str, Any]
    iteration: int
    best_val_loss: float | None
    config: Mapping[str, Any]
    ema: Any = None
    scheduler: Any = None
    rng: Mapping[str, Any] | None = None
    data_position: Any = None
    track_rng: bool = True

    def __post_init__(self) -> None:
        self.model_args = json_mapping("model_args", self.model_args)
        self.config = json_mapping("config", self.config)
        if not isinstance(self.track_rng, bool):
            raise CheckpointFieldError("track_rng", f"must be True or False, got {self.track_rng!r}")
        _check_fields(self.__dict__, loaded=False)

    def to_state(self) -> dict[str, Any]:
        """The state mapping saved for this checkpoint (live objects are kept as they are; with
        ``track_rng``, the RNG states captured now)."""
        _check_fields(self.__dict__, loaded=False)
        state: dict[str, Any] = {"schema": TRAINING_CHECKPOINT_SCHEMA}
        for name in _REQUIRED:
            state[name] = getattr(self, name)
        state["model_args"] = dict(self.model_args)
        state["config"] = dict(self.config)
        for name in _OPTIONAL:
            value = getattr(self, name)
            if value is not None:
                state[name] = value
        if self.track_rng:
            state["rng"] = self.capture_rng()  # as they are now, at this save
        return state

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> TrainingCheckpoint:
        """Build a checkpoint from a loaded state, checking every field."""
        check_training_state(state)
        return cls(**{name: state[name] for name in (*_REQUIRED, *_OPTIONAL) if name in state})

    def fingerprint_source(self) -> dict[str, Any]:
        return {"model_args": dict(self.model_args), "config": dict(self.config)}

    def load_target(self) -> dict[str, Any]:
        """The mapping a restore loads into: the objects of :data:`FILLED` that are set (filled
        in place); the load adds the plain fields, for :meth:`update_from`."""
        return {name: value for name, value in self.to_state().items() if name in FILLED and value is not None}

    def update_from(self, state: Mapping[str, Any]) -> None:
        """After an in-place load: take the plain fields from ``state`` (live objects were filled
        in place and are kept)."""
        for name in (*_REQUIRED, *_OPTIONAL):
            if name not in state:
                continue
            current = getattr(self, name)
            if is_stateful(current):
                continue
            setattr(self, name, state[name])

    _update_from = update_from

    @staticmethod
    def capture_rng() -> dict[str, Any]:
        """The RNG states of Python's ``random``, numpy's global generator and torch's CPU
        generator, as a value for ``rng=``; with CUDA available, also each CUDA device's
        generator (``"cuda"``: one uint8 tensor per device; never run on the CPU-only machines
        the tests run on)."""
        python_state = random.getstate()
        states: dict[str, Any] = {
            "python": [python_state[0], list(python_state[1]), python_state[2]],
            "numpy": _numpy_rng_state(),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            states["cuda"] = list(torch.cuda.get_rng_state_all())
        return states

    @staticmethod
    def restore_rng(rng: Mapping[str, Any]) -> None:
        """Put back RNG states captured by :meth:`capture_rng` (as loaded from a checkpoint).

        All or nothing: if any state is refused, :class:`~shardkeep.errors.CheckpointFieldError`
        is raised and every generator keeps the state it had. CUDA states (``"cuda"``) are put
        back when CUDA is available, and must then number one per device; on a machine without
        CUDA they are left unused, so a GPU run's checkpoint resumes on the CPU."""
        previous = TrainingCheckpoint.capture_rng()
        try:
            _set_rng(rng)
        except (KeyError, TypeError, ValueError, OverflowError, RuntimeError) as exc:
            _set_rng(previous)
            raise CheckpointFieldError("rng", f"cannot restore the RNG states: {exc}") from exc


def _set_rng(rng: Mapping[str, Any]) -> None:
    """Set the RNG states of :meth:`TrainingCheckpoint.capture_rng`; raises what the generators
    raise for a state they refuse."""
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = rng["numpy"]
    np.random.set_state(
        (
            numpy_state["bit_generator"],
            np.asarray(numpy_state["key"], dtype=np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(torch.as_tensor(rng["torch"], dtype=torch.uint8))
    cuda = rng.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if len(cuda) != torch.cuda.device_count():
            raise ValueError(f"{len(cuda)} CUDA generator states for {torch.cuda.device_count()} CUDA devices")
        torch.cuda.set_rng_state_all([torch.as_tensor(state, dtype=torch.uint8) for state in cuda])


def _numpy_rng_state() -> dict[str, Any]:
    name, key, pos, has_gauss, cached = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state(legacy=True))
    return {
        "bit_generator": name,
        "key": key.copy(),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }


def json_mapping(name: str, value: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if not isinstance(value, Mapping):
        raise CheckpointFieldError(name, f"must be a mapping or a dataclass, got {type(value).__name__}")
    as_dict = as_manifest_mapping(value)
    if as_dict is None:
        raise CheckpointFieldError(
            name, "must hold only plain JSON values (string keys, numbers, strings, lists, dicts)"
        )
    return as_dict


def _check_fields(fields: Mapping[str, Any], *, loaded: bool) -> None:
    """Type checks shared by construction (live objects allowed) and load (state dicts)."""
    for name in ("model", "optimizer"):
        value = fields.get(name)
        if not isinstance(value, Mapping) and (loaded or not callable(getattr(value, "state_dict", None))):
            expected = "a state dict" if loaded else "a module/optimizer or its state dict"
            raise CheckpointFieldError(name, f"must be {expected}, got {type(value).__name__}")
    for name in ("ema", "scheduler"):
        value = fields.get(name)
        if (
            value is not None
            and not isinstance(value, Mapping)
            and (loaded or not callable(getattr(value, "state_dict", None)))
        ):
            raise CheckpointFieldError(
                name, f"must be None, an object with state_dict() or a state dict, got {type(value).__name__}"
            )
    iteration = fields.get("iteration")
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise CheckpointFieldError("iteration", f"must be an integer >= 0, got {iteration!r}")
    loss = fields.get("best_val_loss")
    if loss is not None and (isinstance(loss, bool) or not isinstance(loss, (int, float))):
        raise CheckpointFieldError("best_val_loss", f"must be a number or None, got {loss!r}")
    for name in ("model_args", "config"):
        if not isinstance(fields.get(name), Mapping):
            raise CheckpointFieldError(name, f"must be a mapping, got {type(fields.get(name)).__name__}")
    rng = fields.get("rng")
    if rng is not None and not isinstance(rng, Mapping):
        raise CheckpointFieldError("rng", f"must be None or a mapping of RNG states, got {type(rng).__name__}")


def check_training_state(state: Mapping[str, Any]) -> None:
    """Check a loaded (or skeleton) state against the TrainingCheckpoint schema; the error
    names the first bad field."""
    if not isinstance(state, Mapping):
        raise CheckpointFieldError(
            "<root>", f"a TrainingCheckpoint state must be a mapping, got {type(state).__name__}"
        )
    schema = state.get("schema")
    if schema != TRAINING_CHECKPOINT_SCHEMA:
        raise CheckpointFieldError("schema", f"expected {TRAINING_CHECKPOINT_SCHEMA!r}, got {schema!r}")
    for name in _REQUIRED:
        if name not in state:
            raise CheckpointFieldError(name, "is missing from the checkpoint")
    unknown = sorted(set(state) - {"schema", *_REQUIRED, *_OPTIONAL})
    if unknown:
        raise CheckpointFieldError(unknown[0], f"is not a TrainingCheckpoint field (unknown fields: {unknown})")
    _check_fields(state, loaded=True)


class _TensorStub:
    """Stands for a tensor when checking a state's shape from its manifest alone."""


def skeleton(manifest: Manifest) -> dict[str, Any]:
    """The saved state with every tensor replaced by a stub: enough to check field types
    before loading a single byte of tensor data."""
    seen: set[str] = set()
    tensors: list[tuple[list[str | int], int, Any]] = []
    for _, entry in manifest.iter_tensors():
        if entry.key not in seen:
            seen.add(entry.key)
            tensors.append((entry.path, entry.order, _TensorStub()))
    return rebuild_state(manifest.structure, manifest.values, tensors)


def is_training_checkpoint(manifest: Manifest) -> bool:
    return any(value.path == ["schema"] and value.value == TRAINING_CHECKPOINT_SCHEMA for value in manifest.values)


# --------------------------------------------------------------------------------------------
# Fingerprints
# --------------------------------------------------------------------------------------------


def fingerprint_fields(source: Mapping[str, Any]) -> dict[str, Any]:
    """``{"config": {"lr": 0.1}}`` -> ``{"config.lr": 0.1}``; list items by index; empty
    containers as ``{}``/``[]`` strings so that they still show in a diff."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping):
            if not value:
                flat[prefix] = "{}"
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        elif isinstance(value, (list, tuple)):
            if not value:
                flat[prefix] = "[]"
            for index, item in enumerate(value):
                walk(f"{prefix}.{index}", item)
        else:
            flat[prefix] = value

    walk("", source)
    return flat


def fingerprint_of(fields: Mapping[str, Any]) -> str:
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()
    return digest_bytes("blake3", canonical)


def fingerprint_differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    absent = object()
    differences = []
    for name in sorted(set(recorded) | set(current)):
        old, new = recorded.get(name, absent), current.get(name, absent)
        if old is absent or new is absent or (type(old) is not type(new) and not _same_number(old, new)) or old != new:
            differences.append(
                (
                    name,
                    "<absent>" if old is absent else json.dumps(old),
                    "<absent>" if new is absent else json.dumps(new),
                )
            )
    return differences


def _same_number(a: Any, b: Any) -> bool:
    numbers = (int, float)
    return isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool) and not isinstance(b, bool)
