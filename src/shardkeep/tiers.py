"""Storage tiers: checking tier definitions, parsing size budgets, and placing tensors.

A save with ``tiers=[...]`` puts every tensor on one tier. ``placement`` decides which: an
ordered list of ``(glob on the tensor key, tier name)`` rules (the first match wins), or a
callable that receives a :class:`PlacementInfo` and returns a tier name. Without ``placement``
every tensor goes to the first tier (the lowest ``tier_id``).

Size budgets (``"40GB"``, ``"512MiB"``, or a number of bytes) are enforced per tier, over the
whole checkpoint (every rank's files), by the tier's ``placement_policy``:

- ``"prioritized"`` (the default): a tensor that would take its tier over budget spills to the
  next tier by ``tier_id`` that has room; the save fails only when no later tier has room;
- ``"strict"``: the save is refused, naming the tier, the budget and the tensor.

Placement is computed from the global list of tensors, which every rank has after the planning
collective, so every rank reaches the same decision without further communication. This module
does not import torch.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from shardkeep.errors import ConfigError, TierBudgetError, UnsupportedValueError
from shardkeep.manifest import Tier
from shardkeep.storage.locations import local_path
from shardkeep.tensors.keys import EXPERT_KEY, LAYER_KEY, section_of

__all__ = [
    "PLACEMENT_POLICIES",
    "Placement",
    "PlacementInfo",
    "TierBudgetError",
    "check_tiers",
    "parse_size",
    "place",
]

#: What a tier does when a tensor would take it over its size budget.
PLACEMENT_POLICIES = ("prioritized", "strict")

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgtp]?i?b?)?\s*", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "p": 10**15,
    "pb": 10**15,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
}


@dataclass(frozen=True)
class PlacementInfo:
    """What a placement callable sees of one tensor.

    ``kind`` is ``"expert"`` for a key with an ``experts.<n>`` component, else ``"dense"``;
    ``layer`` and ``expert`` are the numbers found in the key (``layers.<n>``, ``experts.<n>``),
    or ``None``; ``section`` is ``"optim"`` for optimizer state, ``"router"`` for router weights
    and state, ``"model"`` otherwise; ``nbytes`` is the tensor's whole size.
    """

    key: str
    kind: Literal["dense", "expert"]
    layer: int | None
    expert: int | None
    section: Literal["model", "optim", "router"]
    nbytes: int
    dtype: str


Placement = Sequence[tuple[str, str]] | Callable[[PlacementInfo], str]


def parse_size(value: str | int | None, *, where: str = "size_budget") -> int | None:
    """Bytes from ``"40GB"`` (powers of 1000), ``"40GiB"`` (powers of 1024) or an integer."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ConfigError(f"{where}={value!r} must be a size like '40GB' or a number of bytes")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{where}={value!r} must not be negative")
        return value
    if not isinstance(value, str):
        raise ConfigError(f"{where}={value!r} must be a size like '40GB' or a number of bytes")
    match = _SIZE.fullmatch(value)
    unit = (match.group(2) or "").lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(f"{where}={value!r} is not a size: use a number with B, KB, MB, GB, TB, KiB, MiB, GiB, TiB")
    return int(float(match.group(1)) * _UNITS[unit])


def check_tiers(tiers: Iterable[Tier]) -> list[Tier]:
    """The tiers sorted by ``tier_id``, after checking names, ids, budgets, policies and
    locations; relative local locations are made absolute."""
    checked: list[Tier] = []
    names: set[str] = set()
    ids: set[int] = set()
    for tier in tiers:
        if not isinstance(tier, Tier):
            raise ConfigError(f"tiers= must hold shardkeep.Tier objects, got {type(tier).__name__}")
        if isinstance(tier.tier_id, bool) or not isinstance(tier.tier_id, int) or tier.tier_id < 0:
            raise ConfigError(f"tier {tier.name!r}: tier_id={tier.tier_id!r} must be an integer >= 0")
        if not isinstance(tier.name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", tier.name):
            raise ConfigError(f"tier name {tier.name!r} must be 1-64 letters, digits, '_' or '-'")
        if tier.name in names:
            raise ConfigError(f"tier name {tier.name!r} is defined twice")
        if tier.tier_id in ids:
            raise ConfigError(f"tier_id {tier.tier_id} is defined twice")
        if tier.placement_policy not in PLACEMENT_POLICIES:
            raise ConfigError(
                f"tier {tier.name!r}: placement_policy={tier.placement_policy!r} is not one of "
                f"{', '.join(PLACEMENT_POLICIES)}"
            )
        parse_size(tier.size_budget, where=f"tier {tier.name!r} size_budget")
        location = tier.location
        if location is not None:
            if not isinstance(location, str) or not location or "\x00" in location:
                raise ConfigError(f"tier {tier.name!r}: location={location!r} must be a path or a URL")
            try:
                location = local_path(location) or location  # a path, or file://PATH: made absolute
            except UnsupportedValueError as exc:
                raise ConfigError(f"tier {tier.name!r}: {exc}") from exc
        names.add(tier.name)
        ids.add(tier.tier_id)
        checked.append(
            Tier(
                tier_id=tier.tier_id,
                name=tier.name,
                size_budget=tier.size_budget,
                placement_policy=tier.placement_policy,
                location=location,
            )
        )
    if not checked:
        raise ConfigError("tiers= must define at least one tier")
    return sorted(checked, key=lambda t: t.tier_id)


def describe(
    key: str, nbytes: int, dtype: str, optim_prefixes: Iterable[str], router_prefixes: Iterable[str] = ()
) -> PlacementInfo:
    expert = EXPERT_KEY.search(key)
    layer = LAYER_KEY.search(key)
    return PlacementInfo(
        key=key,
        kind="expert" if expert else "dense",
        layer=int(layer.group(1)) if layer else None,
        expert=int(expert.group(1)) if expert else None,
        section=section_of(key, optim_prefixes, router_prefixes),
        nbytes=nbytes,
        dtype=dtype,
    )


def _rule_function(placement: Placement | None, tiers: list[Tier]) -> Callable[[PlacementInfo], str]:
    names = {tier.name for tier in tiers}
    if placement is None:
        first = tiers[0].name
        return lambda info: first
    if callable(placement):
        return placement
    if isinstance(placement, (str, bytes)) or not isinstance(placement, Sequence):
        raise ConfigError("placement= must be a list of (glob, tier name) rules or a callable")
    rules: list[tuple[str, str]] = []
    for index, rule in enumerate(placement):
        if not isinstance(rule, (tuple, list)) or len(rule) != 2 or not all(isinstance(part, str) for part in rule):
            raise ConfigError(f"placement rule {index} ({rule!r}) must be a (glob, tier name) pair of strings")
        pattern, name = rule
        if name not in names:
            raise ConfigError(
                f"placement rule {index} ({pattern!r}, {name!r}) names unknown tier {name!r}; tiers: {sorted(names)}"
            )
        rules.append((pattern, name))

    def by_rules(info: PlacementInfo) -> str:
        for pattern, name in rules:
            if fnmatch.fnmatchcase(info.key, pattern):
                return name
        raise ConfigError(f"no placement rule matches tensor {info.key!r}; add a catch-all rule such as ('*', 'hot')")

    return by_rules


def place(
    items: Sequence[tuple[str, int, str]],
    tiers: list[Tier],
    placement: Placement | None,
    optim_prefixes: Iterable[str] = (),
    router_prefixes: Iterable[str] = (),
) -> dict[str, str]:
    """The tier of every tensor key in ``items`` (key, total bytes, dtype), in ``items`` order,
    with size budgets enforced as each tier's policy says."""
    if placement is None and len(tiers) == 1 and tiers[0].size_budget is None:
        return dict.fromkeys((key for key, _, _ in items), tiers[0].name)  # nothing to decide
    decide = _rule_function(placement, tiers)
    names = [tier.name for tier in tiers]
    by_name = {tier.name: tier for tier in tiers}
    budgets = {tier.name: parse_size(tier.size_budget) for tier in tiers}
    used = dict.fromkeys(names, 0)
    optim, router = list(optim_prefixes), list(router_prefixes)
    result: dict[str, str] = {}
    for key, nbytes, dtype in items:
        info = describe(key, nbytes, dtype, optim, router)
        try:
            wanted = decide(info)
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(f"the placement function failed for tensor {key!r}: {type(exc).__name__}: {exc}") from exc
        if wanted not in by_name:
            raise ConfigError(f"placement put tensor {key!r} on unknown tier {wanted!r}; tiers: {names}")
        chosen = wanted
        position = names.index(wanted)
        while True:
            budget = budgets[chosen]
            if budget is None or used[chosen] + nbytes <= budget:
                break
            tier = by_name[chosen]
            if tier.placement_policy == "strict":
                raise TierBudgetError(
                    f"tensor {key!r} ({nbytes} bytes) does not fit in tier {chosen!r}: {used[chosen]} of its "
                    f"{tier.size_budget} budget ({budget} bytes) is already placed, and its policy is 'strict'"
                )
            position += 1
            if position >= len(names):
                raise TierBudgetError(
                    f"tensor {key!r} ({nbytes} bytes) fits in no tier from {wanted!r} on: every later tier "
                    f"is over its size budget ({', '.join(f'{n}: {used[n]}/{budgets[n]}' for n in names)})"
                )
            chosen = names[position]
        used[chosen] += nbytes
        result[key] = chosen
    return result
