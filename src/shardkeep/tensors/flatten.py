"""The state tree: flattening a nested state into tensor leaves, JSON leaves and containers, and
rebuilding it on load.

A leaf's *key* is its path joined with dots (``model.layers.0.weight``). Its *path* keeps the
exact components, with ``int`` dict keys kept as ints, so optimizer state round-trips. A subtree
without tensors that is plain JSON (string keys, lists, finite floats) is stored as one JSON
leaf; anything else (tuples, int keys, non-finite floats, tensors) is expanded and every container
is recorded, empty ones included, so load rebuilds the tree exactly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from shardkeep.errors import ManifestError, UnsupportedValueError
from shardkeep.manifest import ContainerEntry, KeyPath, ValueEntry, key_for_path

__all__ = [
    "FlatState",
    "TensorLeaf",
    "as_manifest_mapping",
    "flatten_state",
    "is_manifest_value",
    "is_plain_json",
    "rebuild_state",
]

#: Deeper nesting than this is refused on save (and catches reference cycles). It equals the
#: manifest's default ``max_path_components``.
MAX_PATH_DEPTH = 64
#: A JSON subtree nested deeper than this is expanded into containers rather than stored as one
#: value, so the manifest stays within the parser's depth limit.
MAX_VALUE_DEPTH = 24
#: Keys longer than this (in UTF-8) are refused; it equals the manifest's ``max_key_bytes``.
MAX_KEY_BYTES = 4096
_INT64_MIN = -(1 << 63)
_UINT64_MAX = (1 << 64) - 1


class TensorLeaf:
    """A tensor (or numpy array) found in the state, with its key, exact path and position."""

    __slots__ = ("key", "order", "path", "value")

    def __init__(self, key: str, path: tuple[str | int, ...], value: Any, order: int) -> None:
        self.key = key
        self.path = path
        self.value = value
        self.order = order


@dataclass
class FlatState:
    tensors: list[TensorLeaf] = field(default_factory=list)
    values: list[ValueEntry] = field(default_factory=list)
    containers: list[ContainerEntry] = field(default_factory=list)


def is_manifest_value(
    value: Any, *, allow_nonfinite: bool = False, allow_int_keys: bool = False, exact_types: bool = False
) -> bool:
    """True when the manifest can store ``value`` and give it back equal: the one rule for what a
    manifest holds as plain values.

    With every flag off, the rule for one JSON value (a value entry's ``value``, the manifest's
    ``custom_fields``, a :class:`~shardkeep.training.TrainingCheckpoint`'s ``model_args``):
    ``None``, bools, ints that fit in 64 bits (signed or unsigned), finite floats, strings, and
    lists and dicts with string keys of those, nested at most ``MAX_VALUE_DEPTH`` deep.

    - ``allow_int_keys``: the value is stored expanded into containers (:func:`flatten_state`),
      which also record int dict keys and tuples; the nesting limit is then ``MAX_PATH_DEPTH``.
    - ``allow_nonfinite``: NaN and infinite floats too (a value entry's ``special``).
    - ``exact_types``: only the exact built-in types, and strings that are valid Unicode (no lone
      surrogates), so that the value comes back as the very same types: a subclass (a ``str``
      or ``IntEnum`` subclass, ``numpy.float64``, ``OrderedDict``, a named tuple) is refused.
      Without it a scalar subclass is accepted and comes back as its built-in base type; a
      container must always be an exact ``list``, ``tuple`` or ``dict``.
    """
    limit = MAX_PATH_DEPTH if allow_int_keys else MAX_VALUE_DEPTH
    return _is_value(value, 0, limit, allow_nonfinite, allow_int_keys, exact_types)


def _is_value(value: Any, depth: int, limit: int, nonfinite: bool, expanded: bool, exact: bool) -> bool:
    """:func:`is_manifest_value` at nesting ``depth``."""
    if depth > limit:
        return False
    if value is None:
        return True
    kind = type(value)
    if exact:
        if kind is str:
            return _valid_text(value)
        if kind is bool:
            return True
        if kind is int:
            return bool(_INT64_MIN <= value <= _UINT64_MAX)
        if kind is float:
            return nonfinite or math.isfinite(value)
    elif isinstance(value, (str, bool)):
        return True
    elif isinstance(value, int):
        return _INT64_MIN <= value <= _UINT64_MAX
    elif isinstance(value, float):
        return nonfinite or math.isfinite(value)
    if kind is list or (expanded and kind is tuple):
        return all(_is_value(item, depth + 1, limit, nonfinite, expanded, exact) for item in value)
    if kind is dict:
        return all(
            _is_key(key, expanded, exact) and _is_value(item, depth + 1, limit, nonfinite, expanded, exact)
            for key, item in value.items()
        )
    return False


def _is_key(key: Any, int_keys: bool, exact: bool) -> bool:
    if exact:
        return (type(key) is str and _valid_text(key)) or (int_keys and type(key) is int)
    return isinstance(key, str) or (int_keys and isinstance(key, int) and not isinstance(key, bool))


def _valid_text(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def is_plain_json(value: Any) -> bool:
    """True when ``value`` is one JSON value the manifest stores: :func:`is_manifest_value`
    with every flag off (string keys, finite floats, lists)."""
    return _is_value(value, 0, MAX_VALUE_DEPTH, False, False, False)


def as_manifest_mapping(value: Any) -> dict[str, Any] | None:
    """``value`` copied into a dict when it is a mapping of JSON values the manifest stores
    (:func:`is_plain_json`); ``None`` otherwise. Callers raise their own error naming the field."""
    if not isinstance(value, Mapping):
        return None
    copied = dict(value)
    return copied if _is_value(copied, 0, MAX_VALUE_DEPTH, False, False, False) else None


def _has_state_dict(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


class _Flattener:
    def __init__(self, keep_vars: bool = False) -> None:
        self.keep_vars = keep_vars
        self.flat = FlatState()
        self.keys: dict[str, tuple[str | int, ...]] = {}
        self.order = 0

    def next_order(self) -> int:
        self.order += 1
        return self.order

    def claim(self, path: tuple[str | int, ...], key: str | None = None) -> str:
        if key is None:
            key = key_for_path(path)
        if not key.isascii():
            try:
                key.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise UnsupportedValueError(f"key {key!r} is not valid Unicode text (a lone surrogate?)") from exc
        if len(key) * 4 > MAX_KEY_BYTES and len(key.encode("utf-8")) > MAX_KEY_BYTES:
            raise UnsupportedValueError(f"key {key[:60]!r}... is longer than {MAX_KEY_BYTES} bytes")
        previous = self.keys.get(key)
        if previous is not None:
            raise UnsupportedValueError(
                f"state paths {list(previous)} and {list(path)} both flatten to the key {key!r}; rename one"
            )
        self.keys[key] = path
        return key

    @staticmethod
    def _module_state(value: Any) -> Any:
        """A module's parameters themselves (``state_dict(keep_vars=True)``), and detached
        copies of everything else: buffers change in ways their version counters do not show
        (BatchNorm's running statistics), so only parameters may be proved unchanged."""
        if not isinstance(value, torch.nn.Module):
            return value.state_dict()
        try:
            state = value.state_dict(keep_vars=True)
        except TypeError:  # an override without keep_vars: its leaves get no proof
            return value.state_dict()
        if not isinstance(state, Mapping):
            return state
        return {
            key: item.detach() if isinstance(item, torch.Tensor) and not isinstance(item, torch.nn.Parameter) else item
            for key, item in state.items()
        }

    def visit(self, value: Any, path: tuple[str | int, ...]) -> None:
        if len(path) > MAX_PATH_DEPTH:
            raise UnsupportedValueError(
                f"state is nested deeper than {MAX_PATH_DEPTH} levels at {key_for_path(path[:8])!r}... (a reference cycle?)"
            )
        if isinstance(value, (torch.Tensor, np.ndarray)):
            self.flat.tensors.append(TensorLeaf(self.claim(path), path, value, self.next_order()))
            return
        if isinstance(value, np.generic):
            value = value.item()
        if isinstance(value, float) and not math.isfinite(value):
            special: Literal["nan", "inf", "-inf"] = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
            self.flat.values.append(
                ValueEntry(key=self.claim(path), path=list(path), special=special, order=self.next_order())
            )
            return
        if path and _is_value(value, 0, MAX_VALUE_DEPTH, False, False, False):
            self.flat.values.append(
                ValueEntry(key=self.claim(path), path=list(path), value=value, order=self.next_order())
            )
            return
        if _has_state_dict(value) and not isinstance(value, Mapping):
            state = self._module_state(value) if self.keep_vars else value.state_dict()
            if not isinstance(state, Mapping):
                raise UnsupportedValueError(
                    f"{type(value).__name__}.state_dict() at {key_for_path(path)!r} returned {type(state).__name__}, not a mapping"
                )
            self._mapping(state, path, "state_dict")
            return
        if isinstance(value, Mapping):
            self._mapping(value, path, "dict")
            return
        if isinstance(value, (list, tuple)):
            self.flat.containers.append(
                ContainerEntry(
                    path=list(path), kind="tuple" if isinstance(value, tuple) else "list", order=self.next_order()
                )
            )
            for index, item in enumerate(value):
                self.visit(item, (*path, index))
            return
        if isinstance(value, int) and not isinstance(value, bool):
            raise UnsupportedValueError(f"integer at {key_for_path(path)!r} does not fit in 64 bits")
        raise UnsupportedValueError(
            f"value at {key_for_path(path) or '<root>'!r} has type {type(value).__module__}.{type(value).__qualname__}, "
            "which shardkeep does not store: use tensors, numpy arrays, JSON values, or objects "
            "with state_dict()/load_state_dict()"
        )

    def _mapping(self, mapping: Mapping[Any, Any], path: tuple[str | int, ...], kind: str) -> None:
        self.flat.containers.append(ContainerEntry(path=list(path), kind=kind, order=self.next_order()))  # type: ignore[arg-type]  # kind is one of the Literal values
        prefix = key_for_path(path) + "." if path else ""
        tensors = self.flat.tensors
        for key, item in mapping.items():
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise UnsupportedValueError(
                    f"key {key!r} under {key_for_path(path) or '<root>'!r} has type {type(key).__name__}; keys must be str or int"
                )
            if isinstance(item, torch.Tensor):
                # The common case, kept short: most leaves of a training state are tensors.
                child = (*path, key)
                self.order += 1
                tensors.append(TensorLeaf(self.claim(child, prefix + str(key)), child, item, self.order))
            else:
                self.visit(item, (*path, key))


def flatten_state(state: Mapping[str, Any], *, keep_vars: bool = False) -> FlatState:
    """Split ``state`` into tensor leaves, JSON leaves and containers (root included). With
    ``keep_vars``, a module's parameters are leaves themselves, not detached copies of them
    (``state_dict(keep_vars=True)``): the same objects from one save to the next, which a
    version proof needs (:mod:`shardkeep.versions`); its buffers stay detached copies."""
    if not isinstance(state, Mapping):
        raise UnsupportedValueError(f"state must be a mapping (a dict), got {type(state).__name__}")
    flattener = _Flattener(keep_vars)
    flattener.visit(state, ())
    return flattener.flat


_SPECIAL = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class _Node:
    __slots__ = ("children", "kind", "order")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.children: dict[str | int, Any] = {}
        self.order: dict[str | int, int] = {}


def rebuild_state(
    containers: list[ContainerEntry], values: list[ValueEntry], tensors: list[tuple[KeyPath, int, Any]]
) -> dict[str, Any]:
    """The nested state described by a manifest's containers, values and loaded tensors."""
    root = _Node("dict")
    nodes: dict[tuple[str | int, ...], _Node] = {(): root}
    for container in sorted(containers, key=lambda c: len(c.path)):
        path = tuple(container.path)
        if not path:
            continue
        node = _Node(container.kind)
        _place(nodes, path, node, container.order)
        nodes[path] = node
    for entry in values:
        _place(nodes, tuple(entry.path), _SPECIAL[entry.special] if entry.special else entry.value, entry.order)
    for tensor_path, order, tensor in tensors:
        _place(nodes, tuple(tensor_path), tensor, order)
    result = _finish(root)
    assert isinstance(result, dict)
    return result


def _place(nodes: dict[tuple[str | int, ...], _Node], path: tuple[str | int, ...], value: Any, order: int) -> None:
    parent = _parent_node(nodes, path)
    parent.children[path[-1]] = value
    parent.order[path[-1]] = order


def _parent_node(nodes: dict[tuple[str | int, ...], _Node], path: tuple[str | int, ...]) -> _Node:
    if not path:
        raise ManifestError("a state leaf has an empty path")
    parent = nodes.get(path[:-1])
    if parent is None:
        raise ManifestError(f"state leaf {key_for_path(path)!r} has no recorded parent container")
    if path[-1] in parent.children:
        raise ManifestError(f"state path {key_for_path(path)!r} is defined twice")
    return parent


def _finish(node: _Node) -> Any:
    keys = sorted(node.children, key=node.order.__getitem__)
    children: dict[str | int, Any] = {}
    for key in keys:
        child = node.children[key]
        children[key] = _finish(child) if isinstance(child, _Node) else child
    if node.kind in ("list", "tuple"):
        if sorted(children, key=repr) != sorted(range(len(children)), key=repr) or not all(
            isinstance(k, int) for k in children
        ):
            raise ManifestError("a list in the state tree has missing or non-integer indices")
        items = [children[index] for index in range(len(children))]
        return tuple(items) if node.kind == "tuple" else items
    return children
