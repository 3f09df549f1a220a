"""The lossless value codec of a Lightning checkpoint: what :func:`shardkeep.save` stores of a
checkpoint dict, and the dict back from what :func:`shardkeep.load` returns.

Values that are not tensors or JSON are converted losslessly and restored on load
(:mod:`shardkeep.conversions`); the conversions are recorded (by path) in the checkpoint itself
under :data:`RESERVED_KEY`: ``OrderedDict`` (with the ``_metadata`` of a module state dict),
Lightning's ``AttributeDict``, ``pathlib`` paths, ``set``/``frozenset``, ``bytes``/``bytearray``,
``complex``, integers beyond 64 bits, numpy scalars, ``torch.dtype``, ``torch.device``,
``argparse.Namespace``, enum members (by name) and dataclass instances (their attributes, with
the type's ``module:qualname``). On load an enum or dataclass type is looked up in the modules
already imported, never imported, and a dataclass is rebuilt as pickle rebuilds it, without
running ``__init__``; a type whose module is not imported is an
:class:`~shardkeep.errors.UnsupportedValueError` saying to import it. A concrete path recorded
on another OS (a ``WindowsPath`` loaded on Linux, a ``PosixPath`` on Windows) cannot be
instantiated there and comes back as its pure class (``PureWindowsPath``, ``PurePosixPath``):
same string, parts and comparisons. A malformed conversion record is an
:class:`~shardkeep.errors.IntegrityError` naming the checkpoint. Tuples, integer dict keys
(optimizer state), NaN and infinities are stored natively by shardkeep. Anything else (classes,
OmegaConf configs, arbitrary objects, dataclasses and enums defined inside functions) is refused
with an :class:`~shardkeep.errors.UnsupportedValueError` naming its key: nothing is pickled.
A DTensor is refused too: the plugin saves on rank 0 alone.

:func:`apply_map_location` moves the loaded tensors as ``torch.load(map_location=...)`` would.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from typing import Any

import torch

from shardkeep.conversions import ValueEncoder, decode_values, where
from shardkeep.errors import ConfigError, DependencyError, UnsupportedValueError
from shardkeep.tensors.convert import is_dtensor

try:
    from lightning.fabric.utilities.data import AttributeDict
except ModuleNotFoundError as _missing_lightning:  # pragma: no cover - depends on the environment
    try:  # the standalone ``lightning_fabric`` package
        from lightning_fabric.utilities.data import AttributeDict  # type: ignore[assignment,unused-ignore]
    except ModuleNotFoundError:
        raise DependencyError(
            "shardkeep.lightning needs Lightning, which is not installed: pip install lightning"
        ) from _missing_lightning

__all__ = ["RESERVED_KEY", "apply_map_location", "decode_checkpoint", "encode_checkpoint"]

#: The top-level key under which the plugin records its format and the value conversions.
RESERVED_KEY = "__shardkeep_lightning__"

#: Mapping classes of a Lightning checkpoint, restored by name.
_MAPPING_CLASSES: dict[str, type] = {"attribute_dict": AttributeDict}


def _refuse_dtensor(value: torch.Tensor, path: tuple[str | int, ...]) -> None:
    if is_dtensor(value):  # a subclass too
        raise UnsupportedValueError(
            f"{where(path)!r} is a DTensor: ShardkeepCheckpointIO saves on rank 0 alone and would keep only "
            "rank 0's shard; use a strategy that gathers a full state dict, or shardkeep.save on every rank"
        )


def encode_checkpoint(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """``checkpoint`` as a state :func:`shardkeep.save` stores, with the conversions
    (:mod:`shardkeep.conversions`) recorded under :data:`RESERVED_KEY`."""
    if not isinstance(checkpoint, Mapping):
        raise UnsupportedValueError(f"a Lightning checkpoint is a dict, got {type(checkpoint).__name__}")
    if RESERVED_KEY in checkpoint:
        raise UnsupportedValueError(f"the checkpoint already has the key {RESERVED_KEY!r}, which the plugin reserves")
    encoder = ValueEncoder(
        subject="Lightning checkpoint",
        hint="; for hyperparameters, convert the value or leave it out with save_hyperparameters(ignore=[...])",
        mapping_classes=_MAPPING_CLASSES,
        check_tensor=_refuse_dtensor,
    )
    if type(checkpoint) is not dict:
        encoder.record((), "ordered_dict" if type(checkpoint) is collections.OrderedDict else "dict")
    state = encoder.mapping(checkpoint, ())
    state[RESERVED_KEY] = encoder.conversion_record()
    return state  # type: ignore[return-value]  # the top level keys were checked to be str or int


def decode_checkpoint(state: dict[str, Any], source: str = "the checkpoint") -> dict[str, Any]:
    """The Lightning checkpoint dict that :func:`encode_checkpoint` turned into ``state``;
    ``source`` (the checkpoint's path) names it in errors."""
    record = state.pop(RESERVED_KEY, None)
    if record is None:
        return state  # a plain shardkeep checkpoint: nothing was converted
    restored: dict[str, Any] = decode_values(
        state, record, source=source, record_name=RESERVED_KEY, mapping_classes=_MAPPING_CLASSES
    )
    return restored


def apply_map_location(value: Any, map_location: Any) -> Any:
    """``value`` with every tensor moved as ``torch.load(map_location=...)`` would move it. Every
    tensor a shardkeep checkpoint returns is on the CPU, so ``"cpu"`` is its saved location."""
    if map_location is None:
        return value
    if isinstance(map_location, Mapping):
        target = map_location.get("cpu")
        if target is None:
            return value
        map_location = target
    if isinstance(map_location, (str, torch.device)):
        device = torch.device(map_location)
        if device.type == "cpu":
            return value
        return _map_tensors(value, lambda tensor: tensor.to(device))
    if callable(map_location):
        storages: dict[int, Any] = {}

        def move(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key not in storages:
                moved = map_location(storage, "cpu")
                storages[key] = storage if moved is None else moved
            new_storage = storages[key]
            if isinstance(new_storage, torch.Tensor):
                return new_storage
            if new_storage is storage:
                return tensor
            rebuilt = torch.empty(0, dtype=tensor.dtype, device=new_storage.device)
            return rebuilt.set_(new_storage, tensor.storage_offset(), tensor.size(), tensor.stride())

        return _map_tensors(value, move)
    raise ConfigError(f"map_location={map_location!r}: give a device, a string, a dict or a callable")


def _map_tensors(value: Any, move: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return move(value)
    if isinstance(value, dict):
        mapped = {key: _map_tensors(item, move) for key, item in value.items()}
        if type(value) is dict:
            return mapped
        result: Any = type(value)(mapped)
        if hasattr(value, "_metadata"):
            result._metadata = value._metadata
        return result
    if isinstance(value, list):
        return [_map_tensors(item, move) for item in value]
    if type(value) is tuple:
        return tuple(_map_tensors(item, move) for item in value)
    return value
