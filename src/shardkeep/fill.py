"""Applying a loaded state to ``into``, all or nothing.

:func:`fill_into` checks every target against what was loaded (keys, shapes, dtypes,
writability, optimizer groups and kind), then applies a list of explicit actions
(:class:`_FillAction`): first the ones that can still fail, the objects' own
``load_state_dict``, each after a snapshot, and then the copies and assignments, which cannot.
If an object refuses its state, every action already applied is undone before the error is
raised, so nothing in ``into`` changes unless everything can be applied.
"""

from __future__ import annotations

import copy
import functools
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from shardkeep.errors import ShardkeepError, StateMismatchError, UnsupportedValueError
from shardkeep.tensors.convert import is_dtensor, local_region
from shardkeep.tensors.regions import Region, region_slices
from shardkeep.tensors.targets import is_stateful

__all__ = ["fill_into", "restore_optimizer_ids"]


def fill_into(
    target: Any,
    loaded: dict[str, Any],
    *,
    partial: bool = False,
    absent: frozenset[str] = frozenset(),
    add_extra: bool = True,
) -> None:
    """Fill ``target`` with ``loaded``, all or nothing. What ``loaded`` holds and ``target``
    lacks is added to it, or with ``add_extra`` false left out.

    First every target is checked (keys, shapes, dtypes, writability, optimizer groups): a
    mismatch raises before anything is modified. Then the fills that can still fail, the
    objects' own ``load_state_dict`` calls, run first (other stateful objects, then optimizers,
    then modules with load hooks of their own), each after a snapshot of its current state; if
    one refuses its state, every one already applied, and the failing one itself, is restored
    from its snapshot before the error is raised. Tensor and array copies and plain
    assignments, which cannot fail once checked, run last.
    """
    actions: list[_FillAction] = []
    _plan_fill(target, loaded, "", actions, partial=partial, absent=absent, add_extra=add_extra)
    actions.sort(key=lambda action: action.order)
    applied: list[_FillAction] = []
    with torch.no_grad():
        try:
            for action in actions:
                action.prepare_undo()
                applied.append(action)
                action.apply()
        except BaseException as exc:
            _roll_back(applied, exc)
            raise


def _roll_back(applied: list[_FillAction], cause: BaseException) -> None:
    """Undo every action in ``applied``, in reverse order, after ``cause``; if any cannot be
    restored, raise one error naming each (the others are restored all the same)."""
    failed: list[str] = []
    for action in reversed(applied):
        try:
            action.undo()
        except Exception as exc:
            failed.append(f"{action.name!r} ({exc})")
    if failed:
        raise UnsupportedValueError(
            f"the load into into= failed ({cause}), and restoring the previous state failed for "
            f"{', '.join(failed)}: those parts of into= are partly filled; everything else was restored"
        ) from cause


class _FillAction:
    """One change to ``into``: ``prepare_undo`` (take a snapshot), ``apply``, and ``undo``.

    ``order`` sorts the fills that may fail first (lower runs earlier)."""

    order = 9

    def __init__(self, name: str) -> None:
        self.name = name

    def prepare_undo(self) -> None:
        """Record what ``undo`` needs; infallible actions need nothing."""

    def apply(self) -> None:
        raise NotImplementedError

    def undo(self) -> None:
        """Restore the state before ``apply`` (only called for actions that may fail, or that
        ran before one that failed)."""


class _Copy(_FillAction):
    """A checked copy into a tensor, a DTensor's local shard or an array of ``into``, which
    cannot fail once checked (so it runs after every fill that can, and needs no snapshot)."""

    order = 8

    def __init__(self, name: str, copy: Callable[[], object]) -> None:
        super().__init__(name)
        self.copy = copy

    def apply(self) -> None:
        self.copy()


class _Assign(_FillAction):
    """``target[key] = value``: a new value for a plain (JSON) field or a new key."""

    _MISSING = object()

    def __init__(self, name: str, target: Any, key: Any, value: Any) -> None:
        super().__init__(name)
        self.target, self.key, self.value = target, key, value
        self.previous: Any = self._MISSING

    def prepare_undo(self) -> None:
        if isinstance(self.target, Mapping) and self.key in self.target:
            self.previous = self.target[self.key]

    def apply(self) -> None:
        self.target[self.key] = self.value

    def undo(self) -> None:
        if self.previous is not self._MISSING:
            self.target[self.key] = self.previous
        elif isinstance(self.target, dict) and self.key in self.target:
            del self.target[self.key]


class _LoadState(_FillAction):
    """``obj.load_state_dict(new)``, which runs the object's own checks and may refuse.

    Its snapshot is ``obj.state_dict()`` taken just before, deep-copied for objects whose
    ``load_state_dict`` may change tensors in place (modules, other objects). An optimizer's
    ``load_state_dict`` replaces its state with new tensors and never writes into the old ones,
    so its snapshot keeps references only, and a module's snapshot is kept on the CPU. An object
    without ``state_dict()`` runs first and cannot be restored: if it or anything after it
    fails, the error names it as partly filled."""

    def __init__(self, name: str, obj: Any, new: Any) -> None:
        super().__init__(name)
        self.obj, self.new = obj, new
        self.snapshot: Any = None
        if isinstance(obj, torch.optim.Optimizer):
            self.order = 2
        elif isinstance(obj, torch.nn.Module):
            self.order = 3
        else:
            self.order = 0 if callable(getattr(obj, "state_dict", None)) else -1

    def prepare_undo(self) -> None:
        if self.order < 0:
            return
        try:
            state = self.obj.state_dict()
            if isinstance(self.obj, torch.optim.Optimizer):
                self.snapshot = {
                    "state": {key: dict(value) for key, value in state["state"].items()},
                    "param_groups": copy.deepcopy(state["param_groups"]),
                }
            else:
                self.snapshot = _detached_copy(state, to_cpu=isinstance(self.obj, torch.nn.Module))
        except Exception as exc:
            raise UnsupportedValueError(
                f"{self.name!r}: cannot snapshot {type(self.obj).__name__}.state_dict() before loading "
                f"(needed to undo the load if another part of into= fails): {exc}"
            ) from exc

    def apply(self) -> None:
        try:
            self.obj.load_state_dict(self.new)
        except ShardkeepError:
            raise
        except Exception as exc:
            raise UnsupportedValueError(
                f"{self.name!r}: {type(self.obj).__name__}.load_state_dict refused the checkpoint's state "
                f"(into= is restored to what it was): {exc}"
            ) from exc

    def undo(self) -> None:
        if self.order < 0:
            raise UnsupportedValueError(f"{type(self.obj).__name__} has no state_dict() to restore it from")
        if self.snapshot is not None:
            self.obj.load_state_dict(self.snapshot)


def _detached_copy(value: Any, *, to_cpu: bool = False) -> Any:
    """A deep copy of a state dict in which tensors are cloned (``copy.deepcopy`` refuses
    tensors that are not graph leaves), onto the CPU with ``to_cpu``."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True) if to_cpu else value.detach().clone()
    if isinstance(value, Mapping):
        copied = {key: _detached_copy(item, to_cpu=to_cpu) for key, item in value.items()}
        return type(value)(copied) if isinstance(value, OrderedDict) else copied
    if isinstance(value, list):
        return [_detached_copy(item, to_cpu=to_cpu) for item in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_detached_copy(item, to_cpu=to_cpu) for item in value)
    return copy.deepcopy(value)


def _plain_module(module: torch.nn.Module) -> bool:
    """True when ``module.load_state_dict`` would only copy into its parameters and buffers: no
    submodule has load hooks, extra state or saving or loading code of its own (torch.nn's
    built-in layers excepted; BatchNorm's only adapts old key versions), and every state_dict
    entry is one of its parameters or buffers. Such a module is filled by plain tensor copies,
    which cannot fail."""
    for submodule in module.modules():
        if submodule._load_state_dict_pre_hooks or submodule._load_state_dict_post_hooks:
            return False
        if submodule._state_dict_hooks or submodule._state_dict_pre_hooks:
            return False
        kind = type(submodule)
        for method in ("state_dict", "load_state_dict", "_load_from_state_dict", "set_extra_state"):
            defined = next(klass for klass in kind.__mro__ if method in vars(klass))
            if defined is not torch.nn.Module and not (
                defined.__module__.startswith("torch.nn.modules.") and "lazy" not in defined.__module__
            ):
                return False
    own = module.state_dict(keep_vars=True)
    tensors = {id(t) for t in module.parameters()} | {id(t) for t in module.buffers()}
    return all(isinstance(value, torch.Tensor) and id(value) in tensors for value in own.values())


def _check_writable(current: Any, name: str) -> None:
    """Refuse targets that a copy would fail on (or silently corrupt) before touching anything."""
    if isinstance(current, torch.Tensor):
        if current.is_meta:
            raise UnsupportedValueError(
                f"{name!r}: the target is on the meta device and holds no data; materialize it first "
                "(for a module: module.to_empty(device='cpu'))"
            )
        if current.layout is not torch.strided:
            raise UnsupportedValueError(f"{name!r}: the target is a {current.layout} tensor; fill needs a dense one")
        if type(current).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
            raise UnsupportedValueError(
                f"{name!r}: the target is a {type(current).__name__}, a tensor subclass with its own dispatch; "
                "fill needs a plain tensor (or a DTensor)"
            )
        if current.is_inference():
            raise UnsupportedValueError(f"{name!r}: the target is an inference-mode tensor and cannot be written")
        if any(stride == 0 and size > 1 for stride, size in zip(current.stride(), current.shape, strict=True)):
            raise UnsupportedValueError(f"{name!r}: the target is an expanded view (stride 0) and cannot be written")
    elif isinstance(current, np.ndarray) and not current.flags.writeable:
        raise UnsupportedValueError(f"{name!r}: the target numpy array is read-only")


def _check_optimizer(optimizer: torch.optim.Optimizer, new: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    """Refuse optimizer state that ``optimizer.load_state_dict`` would take wrongly or drop in
    silence, and return it with its state keys matched to the parameter ids of its groups.

    - the groups must have the target's sizes, and hold the target's kind of optimizer (AdamW
      state into SGD is refused, naming both);
    - every state key must be one of the groups' parameter ids: torch keeps a key that matches
      none and gives that parameter no state at all. Keys that a format turned into strings
      (DCP saves ``0`` as ``'0'``) are turned back when that is unambiguous.
    """
    groups = new.get("param_groups")
    state = new.get("state")
    if not isinstance(groups, list) or not isinstance(state, Mapping):
        raise UnsupportedValueError(f"{name!r}: the checkpoint's optimizer state has no param_groups/state")
    if not all(isinstance(group, Mapping) and isinstance(group.get("params"), list) for group in groups):
        raise UnsupportedValueError(f"{name!r}: the checkpoint's optimizer param_groups are malformed")
    mine = [len(group["params"]) for group in optimizer.param_groups]
    theirs = [len(group["params"]) for group in groups]
    if mine != theirs:
        raise StateMismatchError(
            f"{name!r}: the optimizer has parameter groups of sizes {mine}, the checkpoint {theirs}"
        )
    _check_optimizer_kind(optimizer, new, name)
    restored = restore_optimizer_ids(new)
    ids = {_id_key(index) for group in groups for index in group["params"]}
    stray = [key for key in restored["state"] if _id_key(key) not in ids]
    if stray:
        raise UnsupportedValueError(
            f"{name!r}: the checkpoint has optimizer state for parameter id(s) {stray[:10]!r} that match no "
            f"parameter of its param_groups ({sorted(ids, key=str)[:10]!r}...); loading it would leave those "
            "parameters without their state"
        )
    return restored


def _id_key(index: Any) -> tuple[str, Any]:
    """A parameter id as a dictionary key that tells ``1`` from ``'1'`` and ``True``."""
    return (type(index).__name__, index)


def restore_optimizer_ids(new: Mapping[str, Any]) -> Mapping[str, Any]:
    """``new`` (an optimizer state dict) with state keys that are decimal strings of integer
    parameter ids (``'0'`` for ``0``, as DCP and other string-keyed formats write them) turned
    back into those integers. Anything else, or an ambiguous case, is returned unchanged."""
    groups, state = new.get("param_groups"), new.get("state")
    if not isinstance(groups, list) or not isinstance(state, Mapping):
        return new
    ids = [
        index
        for group in groups
        if isinstance(group, Mapping) and isinstance(group.get("params"), list)
        for index in group["params"]
    ]
    integers = {index for index in ids if isinstance(index, int) and not isinstance(index, bool)}
    if not integers or len(integers) != len(ids):
        return new
    renamed: dict[Any, Any] = {}
    for key, value in state.items():
        if isinstance(key, str) and key.isdecimal() and str(int(key)) == key and int(key) in integers:
            if int(key) in state or int(key) in renamed:
                return new  # both spellings present: ambiguous, left for the check to refuse
            renamed[int(key)] = value
        else:
            renamed[key] = value
    if renamed.keys() == state.keys():
        return new
    return {**new, "state": renamed}


# Group options that say how an optimizer runs, not which algorithm it is (or that schedulers add).
_OPTIMIZER_FLAGS = frozenset(
    {
        "params",
        "param_names",
        "initial_lr",
        "capturable",
        "differentiable",
        "foreach",
        "fused",
        "maximize",
        "decoupled_weight_decay",
    }
)


@functools.cache
def _known_optimizers() -> dict[frozenset[str], list[str]]:
    """torch.optim's optimizers by the options of their parameter groups."""
    import inspect

    known: dict[frozenset[str], list[str]] = {}
    for attribute in sorted(dir(torch.optim)):
        kind = getattr(torch.optim, attribute)
        if not (inspect.isclass(kind) and issubclass(kind, torch.optim.Optimizer)) or kind is torch.optim.Optimizer:
            continue
        try:
            group = kind([torch.zeros(2, 2, requires_grad=True)]).param_groups[0]  # type: ignore[call-arg]  # each subclass has its own defaults
        except Exception:  # an optimizer that needs arguments of its own: not recognised by name
            continue
        known.setdefault(frozenset(group) - _OPTIMIZER_FLAGS, []).append(attribute)
    return known


def _check_optimizer_kind(optimizer: torch.optim.Optimizer, new: Mapping[str, Any], name: str) -> None:
    """Refuse another optimizer's state: by the options of the parameter groups, then by the
    fields of the per-parameter state (Adamax and RAdam have the same options, but Adamax keeps
    ``exp_inf`` where RAdam keeps ``exp_avg_sq``)."""
    groups = new["param_groups"]
    if not groups or not optimizer.param_groups:
        return
    known = _known_optimizers()
    target = frozenset(optimizer.param_groups[0]) - _OPTIMIZER_FLAGS
    saved = frozenset(groups[0]) - _OPTIMIZER_FLAGS
    saved_names, target_names = known.get(saved), known.get(target)
    saved_kind = " or ".join(saved_names) if saved_names else "another optimizer's"
    mine = type(optimizer).__name__
    # A known torch optimizer on each side and they differ; or, for optimizers of other
    # libraries, options on each side that the other lacks (an older torch missing a newer
    # option only is accepted, as torch accepts it).
    if saved != target and (
        (saved_names and target_names and saved_names != target_names) or (saved - target and target - saved)
    ):
        raise StateMismatchError(
            f"{name!r}: the checkpoint holds {saved_kind} state but the target is {mine}: its parameter groups "
            f"have {sorted(saved - target)} where {mine} has {sorted(target - saved)}"
        )
    saved_fields = frozenset(
        field for values in new["state"].values() if isinstance(values, Mapping) for field in values
    )
    target_fields = _state_fields(optimizer)
    if saved_fields and target_fields and not (saved_fields <= target_fields or target_fields <= saved_fields):
        raise StateMismatchError(
            f"{name!r}: the checkpoint holds {saved_kind} state with fields {sorted(saved_fields)}, but the target "
            f"{mine} keeps {sorted(target_fields)}"
        )


def _state_fields(optimizer: torch.optim.Optimizer) -> frozenset[str] | None:
    """The fields of ``optimizer``'s per-parameter state: from its state, or, before its first
    step, from one step of the same optimizer on a scratch parameter. None if unknown."""
    fields = frozenset(field for values in optimizer.state.values() for field in values)
    if fields:
        return fields
    try:
        defaults = tuple(sorted(optimizer.defaults.items()))
        hash(defaults)
    except TypeError:  # a tensor learning rate, say: not probed
        return None
    return _probe_state_fields(type(optimizer), defaults)  # type: ignore[arg-type]  # classes are hashable; mypy sees the instance __hash__


@functools.lru_cache(maxsize=64)
def _probe_state_fields(
    kind: type[torch.optim.Optimizer], defaults: tuple[tuple[str, Any], ...]
) -> frozenset[str] | None:
    try:
        parameter = torch.zeros(2, 2, requires_grad=True)
        parameter.grad = torch.ones(2, 2)
        probe = kind([parameter], **dict(defaults))
        probe.step()
    except Exception:  # needs a closure (LBFGS), a GPU (fused), or arguments of its own: unknown
        return None
    return frozenset(field for values in probe.state.values() for field in values) or None


def _describe_mismatch(key: str, expected: Any, found: Any) -> str:
    return f"{key!r}: the target has {expected} but the checkpoint has {found}"


class _ListTarget(dict[int, Any]):
    """A list seen as a mapping of indices whose writes reach the list (partial loads fill a
    list element by element, skipping the elements that were not loaded)."""

    def __init__(self, items: list[Any]) -> None:
        super().__init__(enumerate(items))
        self._items = items

    def __setitem__(self, key: int, value: Any) -> None:
        super().__setitem__(key, value)
        self._items[key] = value


def _plan_fill(
    target: Any,
    loaded: Any,
    prefix: str,
    actions: list[_FillAction],
    *,
    partial: bool = False,
    absent: frozenset[str] = frozenset(),
    add_extra: bool = True,
) -> None:
    """Check ``loaded`` against ``target`` and queue the copies. ``partial`` (a load of some
    tiers or sections): what was not loaded (the keys in ``absent``) is left as it is in
    ``target``. Keys ``target`` lacks are added, or skipped without ``add_extra``."""
    if not isinstance(target, Mapping) or not isinstance(loaded, Mapping):
        raise StateMismatchError(f"{prefix or '<root>'!r}: into= must mirror the saved state's mappings")
    missing = [key for key in target if key not in loaded]
    if missing and not partial:
        raise StateMismatchError(f"keys {[_join(prefix, k) for k in missing]} of into= are not in the checkpoint")
    for key, new in loaded.items():
        name = _join(prefix, key)
        if key not in target:
            if not add_extra:
                continue
            if not hasattr(target, "__setitem__"):
                raise UnsupportedValueError(f"{name!r} is in the checkpoint but not in into=, which is read-only")
            actions.append(_Assign(name, target, key, new))
        else:
            _plan_entry(target, key, new, name, actions, partial=partial, absent=absent, add_extra=add_extra)


def _plan_entry(
    target: Any,
    key: Any,
    new: Any,
    name: str,
    actions: list[_FillAction],
    *,
    partial: bool,
    absent: frozenset[str],
    add_extra: bool = True,
) -> None:
    """Check and queue the fill of ``target[key]`` (which exists) with ``new``, by the kind of
    object it is: tensor, array, module, optimizer, stateful object, mapping, list, plain value."""
    current = target[key]
    if is_dtensor(current):
        actions.append(_fill_dtensor(current, new, name))
    elif isinstance(current, torch.Tensor):
        actions.append(_fill_tensor(current, new, name))
    elif isinstance(current, np.ndarray):
        actions.append(_fill_array(current, new, name))
    elif isinstance(current, torch.nn.Module):
        _plan_module(current, new, name, actions, partial=partial, absent=absent)
    elif isinstance(current, torch.optim.Optimizer) and isinstance(new, Mapping):
        actions.append(_fill_optimizer(current, new, name, partial=partial, absent=absent))
    elif is_stateful(current):
        actions.append(_LoadState(name, current, new))
    elif isinstance(current, Mapping) and isinstance(new, Mapping):
        _plan_fill(current, new, name, actions, partial=partial, absent=absent, add_extra=add_extra)
    elif isinstance(current, list) and isinstance(new, (list, tuple)) and len(current) == len(new):
        # Element by element, like a mapping: modules, optimizers and tensors in the list are
        # filled in place, never replaced by their loaded state; elements a partial load left
        # out keep their value.
        loaded_elements = {i: v for i, v in enumerate(new) if not (v is None and _join(name, i) in absent)}
        _plan_fill(
            _ListTarget(current), loaded_elements, name, actions, partial=partial, absent=absent, add_extra=add_extra
        )
    else:
        if isinstance(current, (list, tuple)) and any(_is_live(element) for element in current):
            size = len(new) if isinstance(new, (list, tuple)) else None
            raise StateMismatchError(
                f"{name!r}: into= holds a {type(current).__name__} of {len(current)} with modules, optimizers, "
                f"tensors or arrays in it, and the checkpoint "
                + (f"a list of {size}" if size is not None else f"a {type(new).__name__}")
                + ": they cannot be filled in place"
            )
        if not hasattr(target, "__setitem__"):
            raise UnsupportedValueError(f"{name!r} cannot be replaced in a read-only into=")
        actions.append(_Assign(name, target, key, new))


def _is_live(value: Any) -> bool:
    """A value of ``into`` that is filled in place, never replaced."""
    return isinstance(value, (torch.Tensor, np.ndarray)) or is_stateful(value)


def _fill_tensor(current: torch.Tensor, new: Any, name: str) -> _FillAction:
    """Copy a loaded tensor of the same shape and dtype into a writable tensor of ``into``."""
    if not isinstance(new, torch.Tensor):
        raise StateMismatchError(_describe_mismatch(name, "a tensor", type(new).__name__))
    if current.shape != new.shape or current.dtype != new.dtype:
        raise StateMismatchError(
            _describe_mismatch(name, f"{current.dtype}{list(current.shape)}", f"{new.dtype}{list(new.shape)}")
        )
    _check_writable(current, name)
    return _Copy(name, functools.partial(current.copy_, new))


def _fill_array(current: np.ndarray, new: Any, name: str) -> _FillAction:
    """Copy a loaded numpy array of the same shape and dtype into a writable array of ``into``."""
    if not isinstance(new, np.ndarray) or current.shape != new.shape or current.dtype != new.dtype:
        raise StateMismatchError(
            _describe_mismatch(name, f"array {current.dtype}{list(current.shape)}", repr(getattr(new, "shape", new)))
        )
    _check_writable(current, name)
    return _Copy(name, functools.partial(np.copyto, current, new))


def _plan_module(
    module: torch.nn.Module,
    new: Any,
    name: str,
    actions: list[_FillAction],
    *,
    partial: bool,
    absent: frozenset[str],
) -> None:
    """Queue a module's fill: tensor copies into its own parameters and buffers when that is
    all its ``load_state_dict`` would do (or it is sharded, or the load is partial), else its
    own ``load_state_dict``."""
    if not isinstance(new, Mapping):
        raise StateMismatchError(_describe_mismatch(name, "a module", type(new).__name__))
    own = module.state_dict()
    new = _with_tied_copies(own, new)
    if partial:
        # Only what was loaded: each tensor copied into the module's own, in place.
        unexpected = sorted(set(new) - set(own))
        if unexpected:
            raise StateMismatchError(f"{name!r}: the checkpoint has keys the module lacks: {unexpected}")
        _plan_fill(dict(own), new, name, actions, partial=partial, absent=absent)
        return
    _check_module(module, new, name)
    if any(is_dtensor(tensor) for tensor in own.values()) or _plain_module(module):
        # Parameters and buffers only (and sharded ones: FSDP2, tensor parallel, copy each
        # rank's region): copied in place, which cannot fail once checked.
        _plan_fill(dict(own), new, name, actions)
    else:
        actions.append(_LoadState(name, module, new))


def _fill_optimizer(
    optimizer: torch.optim.Optimizer, new: Mapping[str, Any], name: str, *, partial: bool, absent: frozenset[str]
) -> _FillAction:
    """The optimizer's own ``load_state_dict`` with its checked (and, for sharded parameters,
    sharded) state; refused when a partial load left part of its state out."""
    if partial and any(key == name or key.startswith(f"{name}.") for key in absent):
        raise UnsupportedValueError(
            f"{name!r}: this partial load left out part of the optimizer state; load its tier and the "
            "'optim' section, or leave the optimizer out of into="
        )
    checked = _check_optimizer(optimizer, new, name)
    return _LoadState(name, optimizer, _shard_optimizer_state(optimizer, checked, name))


def _fill_dtensor(current: Any, new: Any, name: str) -> _FillAction:
    """Copy this rank's region of the loaded tensor into a DTensor's local shard."""
    offset, local_shape = local_region(current)
    if isinstance(new, Region):
        if new.global_shape != list(current.shape) or new.offset != offset or new.dtype != current.dtype:
            raise StateMismatchError(
                _describe_mismatch(
                    name, f"DTensor {current.dtype}{list(current.shape)}", f"{new.dtype}{new.global_shape}"
                )
            )
        local = current.to_local()
        return _Copy(name, functools.partial(new.copy_into, local))
    if not isinstance(new, torch.Tensor) or tuple(current.shape) != tuple(new.shape) or current.dtype != new.dtype:
        found = f"{getattr(new, 'dtype', type(new).__name__)}{list(getattr(new, 'shape', []))}"
        raise StateMismatchError(_describe_mismatch(name, f"DTensor {current.dtype}{list(current.shape)}", found))
    return _Copy(name, functools.partial(current.to_local().copy_, new[region_slices(offset, local_shape)]))


def _shard_optimizer_state(optimizer: torch.optim.Optimizer, new: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    """Loaded optimizer state holds full tensors; for sharded (DTensor) parameters, turn each
    state tensor shaped like its parameter into a DTensor with the parameter's placement,
    keeping only this rank's region. Other optimizers get the state unchanged."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    if not any(is_dtensor(param) for param in params):
        return new
    from torch.distributed.tensor import DTensor  # imported already: the parameters are DTensors

    groups = new.get("param_groups")
    state = new.get("state")
    if not isinstance(groups, list) or not isinstance(state, Mapping):
        raise UnsupportedValueError(f"{name!r}: the checkpoint's optimizer state has no param_groups/state")
    if not all(isinstance(group, Mapping) and isinstance(group.get("params"), list) for group in groups):
        raise UnsupportedValueError(f"{name!r}: the checkpoint's optimizer param_groups are malformed")
    ids = [index for group in groups for index in group["params"]]
    if len(ids) != len(params):
        raise StateMismatchError(
            f"{name!r}: the optimizer has {len(params)} parameters but the checkpoint has {len(ids)}"
        )
    by_id = dict(zip(ids, params, strict=True))
    sharded: dict[Any, Any] = {}
    for index, values in state.items():
        param = by_id.get(index)
        if not isinstance(values, Mapping):
            raise UnsupportedValueError(f"{name!r}: optimizer state {index!r} in the checkpoint is not a mapping")
        converted: dict[str, Any] = {}
        for field_name, value in values.items():
            if isinstance(value, Region) and isinstance(param, DTensor):
                value = DTensor.from_local(
                    value.materialize(),
                    param.device_mesh,
                    param.placements,
                    run_check=False,
                    shape=param.shape,
                    stride=param.stride(),
                )
            elif (
                isinstance(param, DTensor)
                and isinstance(value, torch.Tensor)
                and not isinstance(value, DTensor)
                and tuple(value.shape) == tuple(param.shape)
            ):
                offset, local_shape = local_region(param)
                value = DTensor.from_local(
                    value[region_slices(offset, local_shape)].clone(),
                    param.device_mesh,
                    param.placements,
                    run_check=False,
                    shape=param.shape,
                    stride=param.stride(),
                )
            converted[field_name] = value
        sharded[index] = converted
    return {**new, "state": sharded}


def _join(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _with_tied_copies(own: Mapping[str, Any], new: Mapping[str, Any]) -> Mapping[str, Any]:
    """``new`` completed with the tied keys of a module's state dict ``own`` (detached views of
    the same storage) that it lacks: a key is tied when its tensor is
    the very tensor (the same view of the same storage) of another key, as GPT-2's
    ``lm_head.weight`` is ``transformer.wte.weight``. Formats that write each tensor once
    (``save_pretrained``, and so an imported Hugging Face folder) keep only one of the keys; the
    value loaded for the one kept fills the other, which is the same tensor. A key whose tensor
    is its own stays missing."""
    absent = [key for key in own if key not in new]
    if not absent:
        return new
    present: dict[tuple[Any, ...], str] = {}
    for key, tensor in own.items():
        view = _storage_view(tensor)
        if key in new and view is not None:
            present.setdefault(view, key)
    completed = dict(new)
    for key in absent:
        view = _storage_view(own[key])
        source = present.get(view) if view is not None else None
        if source is not None:
            completed[key] = new[source]
    return completed


def _storage_view(tensor: Any) -> tuple[Any, ...] | None:
    """What makes ``tensor`` one tensor with another: its storage, offset, shape, strides, dtype
    and device (for a DTensor, those of its local shard, with its global shape and placements);
    None for what holds no data (meta tensors, other values)."""
    if not isinstance(tensor, torch.Tensor):
        return None
    extra: tuple[Any, ...] = ()
    if is_dtensor(tensor):
        sharded: Any = tensor
        extra = (tuple(sharded.shape), tuple(sharded.placements))
        tensor = sharded.to_local()
    if tensor.is_meta or tensor.layout is not torch.strided:
        return None
    try:
        address = tensor.untyped_storage().data_ptr()
    except RuntimeError:  # a wrapper subclass without a storage of its own: not recognised as tied
        return None
    if address == 0:
        return None
    return (
        tensor.device,
        address,
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
        *extra,
    )


def _check_module(module: torch.nn.Module, new: Mapping[str, Any], name: str) -> None:
    expected = module.state_dict()
    missing = sorted(set(expected) - set(new))
    unexpected = sorted(set(new) - set(expected))
    if missing or unexpected:
        raise StateMismatchError(
            f"{name!r}: module keys differ from the checkpoint: missing {missing}, unexpected {unexpected}"
        )
    for key, tensor in expected.items():
        found = new[key]
        if isinstance(found, Region):
            continue  # a sharded region: _fill_dtensor checks it against the parameter
        if isinstance(tensor, torch.Tensor) and (
            not isinstance(found, torch.Tensor) or found.shape != tensor.shape or found.dtype != tensor.dtype
        ):
            raise StateMismatchError(
                _describe_mismatch(
                    f"{name}.{key}",
                    f"{tensor.dtype}{list(tensor.shape)}",
                    f"{getattr(found, 'dtype', type(found).__name__)}{list(getattr(found, 'shape', []))}",
                )
            )
