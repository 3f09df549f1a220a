"""Where a saved state path lands in ``load(..., into=...)``: one walk through the mappings,
lists, modules, optimizers and other stateful objects of ``into``.

Load asks it twice for each saved tensor: whether ``into`` holds the key at all (what
``extra="ignore"`` reads) and, for a sharded tensor, which DTensor the key fills, so that a rank
reads only the region it holds. The fill (:mod:`shardkeep.fill`) classifies the objects of
``into`` with the same :func:`is_stateful`. The rules:

- a mapping holds its keys, a list or tuple its indices; a slot holding ``None`` is a place for
  whatever was saved there, but nothing below it is;
- a module is its ``state_dict()``: each of its state keys (``"0.weight"``) is one path part;
- an optimizer, or any other object with ``load_state_dict`` (a scheduler, a data loader ...),
  takes its whole state: everything below it is its own. An optimizer's state tensor
  (``["state", <parameter id>, <field>]``) is shaped and sharded like its parameter, the
  parameter ids being positions in its parameter groups, as ``Optimizer.state_dict`` numbers
  them (DCP writes them as decimal strings);
- anything else holds nothing below it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = ["Target", "TargetResolver", "is_stateful", "resolve"]

#: ``missing``: ``into`` has no place for the path. ``slot``: a key of a mapping or an index of
#: a list or tuple. ``module``: an entry of a module's state (or inside one). ``whole_object``:
#: below an optimizer or another stateful object, which loads its whole state itself.
TargetKind = Literal["missing", "slot", "module", "whole_object"]


@dataclass(frozen=True, slots=True)
class Target:
    """What ``into`` holds at one saved path.

    ``value`` is the object found there (``None`` when missing or below a whole object);
    ``owner`` the module or stateful object whose state the path is in; ``tensor`` the tensor
    the saved leaf is loaded into, or (for an optimizer's state) the parameter it is shaped and
    sharded like, else ``None``.
    """

    kind: TargetKind
    value: Any = None
    owner: Any = None
    tensor: torch.Tensor | None = None

    @property
    def held(self) -> bool:
        """Whether ``into`` has a place for the path."""
        return self.kind != "missing"


MISSING = Target("missing")


def is_stateful(value: Any) -> bool:
    """An object of ``into`` that loads its own state through ``load_state_dict`` (an
    optimizer, a module, a scheduler ...), never a mapping."""
    return callable(getattr(value, "load_state_dict", None)) and not isinstance(value, Mapping)


class TargetResolver:
    """Resolves paths in one ``into``; each module's ``state_dict()`` is taken once."""

    def __init__(self, into: Any) -> None:
        self.into = into
        self._module_states: dict[int, Mapping[str, Any]] = {}

    def resolve(self, path: list[str | int] | tuple[str | int, ...]) -> Target:
        """The target of ``into`` at the saved state ``path``."""
        node = self.into
        kind: TargetKind = "slot"
        owner: Any = None
        for position, part in enumerate(path):
            if isinstance(node, torch.optim.Optimizer):
                return Target("whole_object", owner=node, tensor=_parameter_of(node, path[position:]))
            if isinstance(node, torch.nn.Module):
                state = self._state_of(node)
                if str(part) not in state:
                    return MISSING
                owner, kind, node = node, "module", state[str(part)]
            elif is_stateful(node):
                return Target("whole_object", owner=node)
            elif isinstance(node, Mapping):
                if part not in node:
                    return MISSING
                node = node[part]
            elif isinstance(node, (list, tuple)):
                if isinstance(part, bool) or not isinstance(part, int) or not 0 <= part < len(node):
                    return MISSING
                node = node[part]
            else:
                return MISSING
        return Target(kind, value=node, owner=owner, tensor=node if isinstance(node, torch.Tensor) else None)

    def _state_of(self, module: torch.nn.Module) -> Mapping[str, Any]:
        state = self._module_states.get(id(module))
        if state is None:
            state = self._module_states[id(module)] = module.state_dict()
        return state


def resolve(into: Any, path: list[str | int] | tuple[str | int, ...]) -> Target:
    """The target of ``into`` at the saved state ``path`` (for many paths, use one
    :class:`TargetResolver`, which takes each module's state once)."""
    return TargetResolver(into).resolve(path)


def _parameter_of(optimizer: torch.optim.Optimizer, rest: list[str | int] | tuple[str | int, ...]) -> Any:
    """The parameter that the optimizer state at ``rest`` (below the optimizer) belongs to:
    ``["state", <id>, ...]``, the id an int or its decimal string; else ``None``."""
    if len(rest) < 2 or rest[0] != "state":
        return None
    index = rest[1]
    if isinstance(index, str) and index.isdecimal() and str(int(index)) == index:
        index = int(index)
    if isinstance(index, bool) or not isinstance(index, int):
        return None
    params = [param for group in optimizer.param_groups for param in group["params"]]
    return params[index] if 0 <= index < len(params) else None
