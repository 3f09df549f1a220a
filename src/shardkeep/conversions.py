"""Lossless conversions of the Python values a state cannot hold as they are, and back.

A state :func:`shardkeep.save` stores has tensors, numpy arrays and JSON values for leaves.
Integrations meet other values: Lightning checkpoints, the state of an object registered with
Accelerate. :class:`ValueEncoder` turns each of these into such leaves and records the
conversion by its path; the integration stores the record (:meth:`ValueEncoder.record`) with
the state, and :func:`decode_values` restores every value from it:

``OrderedDict`` (with the ``_metadata`` of a module state dict), ``pathlib`` paths,
``set``/``frozenset``, ``bytes``/``bytearray``, ``complex``, integers beyond 64 bits (the
128-bit state of numpy's ``PCG64`` generators), numpy scalars, ``torch.dtype``,
``torch.device``, ``argparse.Namespace``, mapping classes an integration names
(Lightning's ``AttributeDict``), and instances of module-level dataclasses and enums (by the
type's ``module:qualname``: on load the type is looked up in modules already imported, never
imported, unpickled or called; a dataclass is rebuilt as pickle rebuilds it, without running
``__init__``, ``__post_init__``, ``__setattr__`` or a property setter; a ``Flag`` combination is
looked up by value only when no ``_missing_`` of the class's own would run). A concrete path recorded on another OS (a ``WindowsPath``
loaded on Linux, a ``PosixPath`` on Windows) cannot be instantiated there and comes back as its
pure class (``PureWindowsPath``, ``PurePosixPath``): same string, parts and comparisons. Tuples,
integer dict keys, NaN and infinities are stored natively. Anything else is refused with an
:class:`~shardkeep.errors.UnsupportedValueError` naming its key: nothing is pickled. A
malformed record is an :class:`~shardkeep.errors.IntegrityError` naming the checkpoint.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import pathlib
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from shardkeep.errors import IntegrityError, UnsupportedValueError

__all__ = ["FORMAT_VERSION", "ValueEncoder", "decode_values"]

#: The version of the conversion record (``{"format": 1, "conversions": [...]}``).
FORMAT_VERSION = 1

_INT64_MIN = -(1 << 63)
_UINT64_MAX = (1 << 64) - 1
_PATH_CLASSES = {cls.__name__: cls for cls in (pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.PosixPath)}
_PATH_CLASSES["WindowsPath"] = pathlib.WindowsPath
#: What a concrete path class recorded on another OS comes back as: its pure flavour, which keeps
#: the string, the parts and the comparisons exactly (the native ``Path`` would not: it would read
#: ``C:\\data`` as one relative POSIX name, or ``/data`` without a drive on Windows).
_PURE_FLAVOUR: dict[type, type] = {
    pathlib.PosixPath: pathlib.PurePosixPath,
    pathlib.WindowsPath: pathlib.PureWindowsPath,
}

#: The types every encoder stores, for refusal messages.
SUPPORTED = (
    "tensors, JSON values, paths, sets, bytes, numpy scalars, torch dtypes/devices, Namespaces, dataclasses or enums"
)


def where(path: tuple[str | int, ...]) -> str:
    """``path`` as the dotted key errors name."""
    return ".".join(str(part) for part in path) or "<root>"


class ValueEncoder:
    """Converts one state, recording each conversion by path.

    ``subject`` names what is converted in errors (``"Lightning checkpoint"``); ``hint`` ends
    the refusal of an unsupported value; ``mapping_classes`` (record name to class) are mapping
    types restored by calling the class on a dict; ``check_tensor(tensor, path)`` may refuse a
    tensor (raise)."""

    def __init__(
        self,
        *,
        subject: str,
        hint: str = "",
        mapping_classes: Mapping[str, type] | None = None,
        check_tensor: Callable[[torch.Tensor, tuple[str | int, ...]], None] | None = None,
    ) -> None:
        self.subject, self.hint = subject, hint
        self.mapping_classes = {cls: name for name, cls in (mapping_classes or {}).items()}
        self.check_tensor = check_tensor
        self.conversions: list[dict[str, Any]] = []

    def record(self, path: tuple[str | int, ...], kind: str, **extra: Any) -> None:
        """Record that the value at ``path`` was converted from ``kind``."""
        self.conversions.append({"path": list(path), "type": kind, **extra})

    def conversion_record(self) -> dict[str, Any]:
        """What :func:`decode_values` needs: the format and every conversion recorded."""
        return {"format": FORMAT_VERSION, "conversions": self.conversions}

    def mapping(self, value: Mapping[Any, Any], path: tuple[str | int, ...]) -> dict[str | int, Any]:
        out: dict[str | int, Any] = {}
        for key, item in value.items():
            if isinstance(key, bool) or type(key) not in (str, int):
                raise UnsupportedValueError(
                    f"{self.subject} key {key!r} under {where(path)!r} has type {type(key).__name__}; "
                    "shardkeep stores dict keys that are str or int only"
                )
            out[key] = self.encode(item, (*path, key))
        return out

    def encode(self, value: Any, path: tuple[str | int, ...]) -> Any:
        kind = type(value)
        if isinstance(value, torch.Tensor):
            if self.check_tensor is not None:
                self.check_tensor(value, path)
            return value
        if isinstance(value, np.ndarray) or value is None or kind in (bool, str, float):
            return value
        if kind is int:
            if _INT64_MIN <= value <= _UINT64_MAX:
                return value
            self.record(path, "int")
            return str(value)
        if kind is dict:
            return self.mapping(value, path)
        if kind is collections.OrderedDict:
            metadata = getattr(value, "_metadata", None)
            extra: dict[str, Any] = {}
            if metadata is not None:
                extra["metadata"] = self._module_metadata(metadata, path)
            self.record(path, "ordered_dict", **extra)
            return self.mapping(value, path)
        if kind in self.mapping_classes:
            self.record(path, self.mapping_classes[kind])
            return self.mapping(value, path)
        if kind is argparse.Namespace:
            self.record(path, "namespace")
            return self.mapping(vars(value), path)
        if kind is list:
            return [self.encode(item, (*path, index)) for index, item in enumerate(value)]
        if kind is tuple:
            return tuple(self.encode(item, (*path, index)) for index, item in enumerate(value))
        if kind in (set, frozenset):
            self.record(path, kind.__name__)
            return [self.encode(item, (*path, index)) for index, item in enumerate(value)]
        if kind in (bytes, bytearray):
            self.record(path, kind.__name__)
            return np.frombuffer(bytes(value), dtype=np.uint8).copy()
        if kind is complex:
            self.record(path, "complex")
            return [value.real, value.imag]
        if kind.__name__ in _PATH_CLASSES and _PATH_CLASSES[kind.__name__] is kind:
            self.record(path, "path", cls=kind.__name__)
            return str(value)
        if isinstance(value, (np.number, np.bool_)):
            self.record(path, "numpy_scalar")
            return np.asarray(value)
        if isinstance(value, torch.dtype):
            self.record(path, "torch.dtype")
            return str(value).removeprefix("torch.")
        if isinstance(value, torch.device):
            self.record(path, "torch.device")
            return str(value)
        if isinstance(value, enum.Enum):
            return self.enum_member(value, path)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return self.dataclass_instance(value, path)
        raise UnsupportedValueError(
            f"{self.subject} value at {where(path)!r} has type {kind.__module__}.{kind.__qualname__}, which "
            f"shardkeep does not store (it never pickles): use {SUPPORTED}{self.hint}"
        )

    def enum_member(self, value: enum.Enum, path: tuple[str | int, ...]) -> Any:
        """A member by its name; a combination of ``Flag`` members (which has no name of its own
        in every Python version) by its value."""
        cls = self._class_name(type(value), path)
        if isinstance(value.name, str) and type(value).__members__.get(value.name) is value:
            self.record(path, "enum", cls=cls)
            return value.name
        if (
            not isinstance(value, enum.Flag)
            or type(value.value) is not int
            or not _INT64_MIN <= value.value <= _UINT64_MAX
        ):
            raise UnsupportedValueError(
                f"{self.subject} value at {where(path)!r} is {value!r}, an enum value without a member name "
                "whose value is not a 64-bit int; shardkeep cannot store it"
            )
        self.record(path, "enum", cls=cls, by="value")
        return value.value

    def dataclass_instance(self, value: Any, path: tuple[str | int, ...]) -> dict[str | int, Any]:
        """Every attribute, as pickle keeps it: the fields (slots included) and whatever else is
        in the instance's ``__dict__``."""
        cls = self._class_name(type(value), path)
        attributes: dict[str, Any] = {
            field.name: getattr(value, field.name) for field in dataclasses.fields(value) if hasattr(value, field.name)
        }
        for name, item in getattr(value, "__dict__", {}).items():
            attributes.setdefault(name, item)
        self.record(path, "dataclass", cls=cls)
        return self.mapping(attributes, path)

    def _class_name(self, cls: type, path: tuple[str | int, ...]) -> str:
        """``module:qualname`` of a dataclass or enum type, refused unless :func:`resolved_class`
        finds that very type by it (a class defined inside a function could never be loaded)."""
        name = f"{cls.__module__}:{cls.__qualname__}"
        try:
            found = resolved_class(name)
        except (LookupError, TypeError):
            found = None
        if found is not cls:
            raise UnsupportedValueError(
                f"{self.subject} value at {where(path)!r} has type {cls.__module__}.{cls.__qualname__}, which "
                "cannot be found by its module and name (a class defined inside a function?); shardkeep "
                "restores dataclasses and enums only of module-level (or nested) classes"
            )
        return name

    def _module_metadata(self, metadata: Any, path: tuple[str | int, ...]) -> dict[str, Any]:
        """The ``_metadata`` of a module state dict (prefix to ``{"version": n}``) as plain JSON."""
        from shardkeep.tensors.flatten import is_plain_json

        try:
            plain = {str(prefix): dict(entry) for prefix, entry in metadata.items()}
        except (AttributeError, TypeError, ValueError):
            plain = None
        if plain is None or not is_plain_json(plain) or set(plain) != set(metadata):
            raise UnsupportedValueError(
                f"the _metadata of the state dict at {where(path)!r} in the {self.subject} is not plain JSON "
                "(module prefixes to {'version': n}); shardkeep cannot store it"
            )
        return plain


def resolved_class(name: str) -> type:
    """The class ``module:qualname`` names, looked up in an already imported module without
    running any code: no import, no module ``__getattr__``, no descriptor (attributes are read
    from ``vars``). :class:`KeyError` when the module is not imported or lacks the name."""
    module_name, found, qualname = name.partition(":")
    if not found:
        raise ValueError(f"{name!r} is not module:qualname")
    module = sys.modules.get(module_name)
    if module is None:
        raise _NotImported(module_name)
    value: Any = module
    for part in qualname.split("."):
        value = vars(value)[part]
    if not isinstance(value, type):
        raise TypeError(f"{name} is not a class")
    return value


class _NotImported(KeyError):
    """The module of a recorded type is not imported in this process."""


def _restored_instance(value: Any, conversion: Mapping[str, Any], at: str) -> Any:
    """An enum member or a dataclass instance: its type is looked up, never imported (see
    :func:`resolved_class`), and must be an enum or a dataclass; a dataclass is rebuilt as
    pickle rebuilds it (``object.__new__``, then its attributes written into the instance's
    ``__dict__``, a ``__slots__`` field through its slot: ``__init__``, ``__post_init__``,
    ``__setattr__`` and property setters are not run; an attribute naming another class-level
    data descriptor is refused). A ``Flag`` value is looked up only when neither the class nor
    its metaclass brings its own ``_missing_`` or ``__call__``, which the lookup would run."""
    kind, name = conversion["type"], conversion.get("cls")
    if not isinstance(name, str):
        raise TypeError(f"its type is recorded as {short(name)}, not a str")
    try:
        cls = resolved_class(name)
    except _NotImported as exc:
        raise UnsupportedValueError(
            f"the {kind} at {at!r} has type {name}, and module {exc.args[0]!r} is not imported: shardkeep never "
            "imports a module a checkpoint names; import it before loading"
        ) from exc
    if kind == "enum":
        if not issubclass(cls, enum.Enum):
            raise TypeError(f"{name} is not an enum")
        if conversion.get("by") == "value":
            if not issubclass(cls, enum.Flag):
                raise TypeError(f"{name} is not a Flag: its members are stored by name")
            if type(value) is not int:
                raise TypeError(f"a {name} value is stored as an int, found {type(value).__name__}")
            _check_no_user_lookup(cls, name)
            return cls(value)
        if not isinstance(value, str):
            raise TypeError(f"a {name} member is stored as its name, found {type(value).__name__}")
        return cls.__members__[value]
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{name} is not a dataclass")
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        raise TypeError(f"a {name} is stored as a dict of attributes, found {short(value)}")
    instance = object.__new__(cls)
    fields = {field.name for field in dataclasses.fields(cls)}
    for attribute, item in value.items():
        found = _class_attribute(cls, attribute)
        if isinstance(found, types.MemberDescriptorType) and attribute in fields:
            found.__set__(instance, item)  # a __slots__ field: the slot itself, no user code
        elif found is not _ABSENT and _is_data_descriptor(found):
            # A property, __class__, __dict__ ...: setting it would run code or change the type.
            raise TypeError(f"{name}.{attribute} is a class-level {type(found).__name__}, not an attribute to set")
        else:
            # Into the instance's __dict__ directly (as pickle does, and for frozen dataclasses):
            # no __setattr__ is run.
            dict_descriptor = _class_attribute(cls, "__dict__")
            if not isinstance(dict_descriptor, types.GetSetDescriptorType):
                raise TypeError(f"{name} has no attribute {attribute!r} to set (its instances have no __dict__)")
            dict_descriptor.__get__(instance, cls)[attribute] = item
    return instance


_ABSENT = object()


def _class_attribute(cls: type, name: str) -> Any:
    """``name`` as the class defines it (first in its MRO), read from ``vars``: no code run."""
    for klass in cls.__mro__:
        found = vars(klass).get(name, _ABSENT)
        if found is not _ABSENT:
            return found
    return _ABSENT


def _is_data_descriptor(value: Any) -> bool:
    """``value``'s type defines ``__set__`` or ``__delete__`` (looked up in ``vars``)."""
    return any("__set__" in vars(klass) or "__delete__" in vars(klass) for klass in type(value).__mro__)


def _check_no_user_lookup(cls: type, name: str) -> None:
    """Refuse a Flag class whose value lookup would run user code: a ``_missing_`` (or a
    metaclass ``__call__``) defined outside the ``enum`` module."""
    metaclass: type = type(cls)
    for klass, attribute in [
        *((klass, "_missing_") for klass in cls.__mro__),
        *((meta, "__call__") for meta in metaclass.__mro__),
    ]:
        if attribute in vars(klass) and klass.__module__ not in ("enum", "builtins"):
            raise TypeError(
                f"{name} defines its own {attribute} (in {klass.__qualname__}), which a value would run; "
                "shardkeep restores its values only by member name"
            )


def short(value: Any, limit: int = 200) -> str:
    """``repr(value)``, cut at ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


def _restored_value(
    value: Any, conversion: Mapping[str, Any], source: str, record_name: str, mapping_classes: Mapping[str, type]
) -> Any:
    kind = conversion["type"]
    at = where(tuple(conversion["path"]))
    try:
        if kind == "dict":
            return dict(value)
        if kind == "ordered_dict":
            result: Any = collections.OrderedDict(value)
            if "metadata" in conversion:
                result._metadata = collections.OrderedDict(
                    (prefix, dict(entry)) for prefix, entry in conversion["metadata"].items()
                )
            return result
        if kind in mapping_classes:
            return mapping_classes[kind](value)
        if kind == "namespace":
            return argparse.Namespace(**value)
        if kind == "int":
            return int(value)
        if kind in ("set", "frozenset"):
            return set(value) if kind == "set" else frozenset(value)
        if kind in ("bytes", "bytearray"):
            raw = _as_numpy(value).astype(np.uint8, copy=False).tobytes()
            return raw if kind == "bytes" else bytearray(raw)
        if kind == "complex":
            real, imag = value
            return complex(real, imag)
        if kind == "path":
            cls = _PATH_CLASSES[conversion["cls"]]
            if not isinstance(value, str):
                raise TypeError(f"a path is stored as a str, found {type(value).__name__}")
            try:
                return cls(value)
            except NotImplementedError:  # WindowsPath on POSIX, PosixPath on Windows
                return _PURE_FLAVOUR[cls](value)
        if kind == "numpy_scalar":
            return _as_numpy(value)[()]
        if kind == "torch.dtype":
            # From the module's own namespace: getattr(torch, name) could import a submodule.
            dtype = vars(torch).get(value)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"{value!r} is not a torch dtype")
            return dtype
        if kind == "torch.device":
            return torch.device(value)
        if kind in ("enum", "dataclass"):
            return _restored_instance(value, conversion, at)
    # Whatever a damaged or hostile record holds, the result is an IntegrityError naming it
    # (torch.device("nonsense") raises RuntimeError, int(float("inf")) OverflowError ...).
    except (LookupError, TypeError, ValueError, AttributeError, ArithmeticError, RuntimeError) as exc:
        raise IntegrityError(f"{source}: cannot restore the {kind} at {at!r}: {exc}") from exc
    raise IntegrityError(f"{source}: {record_name} records an unknown conversion {short(kind)} at {at!r}")


def _as_numpy(value: Any) -> np.ndarray[Any, Any]:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _conversion_records(record: Any, source: str, record_name: str) -> dict[tuple[str | int, ...], Mapping[str, Any]]:
    """The conversions ``record`` lists, by path; every malformed record (whatever its shape)
    is an :class:`IntegrityError` naming ``source``."""
    if not isinstance(record, Mapping) or type(record.get("format")) is not int or record["format"] != FORMAT_VERSION:
        found = record.get("format") if isinstance(record, Mapping) else record
        raise IntegrityError(
            f"{source}: {record_name} records format {short(found)}; this shardkeep reads format {FORMAT_VERSION}"
        )
    listed = record.get("conversions", [])
    if not isinstance(listed, (list, tuple)):
        raise IntegrityError(
            f"{source}: {record_name}.conversions is a {type(listed).__name__} ({short(listed)}), not a list"
        )
    conversions: dict[tuple[str | int, ...], Mapping[str, Any]] = {}
    for conversion in listed:
        path = conversion.get("path") if isinstance(conversion, Mapping) else None
        if (
            not isinstance(path, (list, tuple))
            or not all(type(part) in (str, int) for part in path)
            or not isinstance(conversion.get("type"), str)
        ):
            raise IntegrityError(
                f"{source}: {record_name} holds a malformed conversion record {short(conversion)} "
                "(a mapping with a 'path' list of str/int and a 'type' str)"
            )
        key = tuple(path)
        if key in conversions:
            raise IntegrityError(f"{source}: {record_name} records two conversions at {where(key)!r}")
        conversions[key] = conversion
    return conversions


def decode_values(
    state: Any,
    record: Any,
    *,
    source: str = "the checkpoint",
    record_name: str = "the conversion record",
    mapping_classes: Mapping[str, type] | None = None,
) -> Any:
    """``state`` with every value ``record`` (a :meth:`ValueEncoder.conversion_record`) lists
    restored. ``source`` (the checkpoint's path) and ``record_name`` (the key the record is
    stored under) name them in errors; ``mapping_classes`` are the encoder's."""
    conversions = _conversion_records(record, source, record_name)
    if not conversions:
        return state
    classes = dict(mapping_classes or {})
    prefixes = {path[:length] for path in conversions for length in range(len(path) + 1)}
    applied: set[tuple[str | int, ...]] = set()

    def restore(value: Any, path: tuple[str | int, ...]) -> Any:
        if path not in prefixes:
            return value
        if isinstance(value, dict):
            value = {key: restore(item, (*path, key)) for key, item in value.items()}
        elif isinstance(value, (list, tuple)):
            value = type(value)(restore(item, (*path, index)) for index, item in enumerate(value))
        conversion = conversions.get(path)
        if conversion is None:
            return value
        applied.add(path)
        return _restored_value(value, conversion, source, record_name, classes)

    restored = restore(state, ())
    if len(applied) != len(conversions):
        missing = sorted(where(path) for path in conversions if path not in applied)
        raise IntegrityError(
            f"{source}: {record_name} records conversions at {missing[:5]} where the checkpoint holds no such value"
        )
    return restored
