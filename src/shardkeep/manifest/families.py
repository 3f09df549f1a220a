"""Tensor families (format 2.1): detection, expansion, lookup by key and validation.

A family describes tensors whose keys differ only in some of their integers once, as a key
template (``"layers.{0}.experts.{1}.w1"``; ``{{`` and ``}}`` are literal braces), one template
per path component, and per placeholder a range ``[start, stop, step]``; its instances are the
cartesian product of the ranges, row-major. Only the maximal digit runs of a key written in
canonical decimal (no leading zero, below 2**31) can become placeholders, and a placeholder is
never next to a digit or another placeholder, so every instance key maps back to one index
tuple: detection then expansion is the identity, and :class:`FamilyIndex` finds a key without
expanding anything. Anything detection cannot represent exactly stays a singleton.

Entry families (:class:`~shardkeep.manifest.schema.EntryFamily`) are the same for the whole
tensors of one data file, with an affine byte offset besides the affine order; a decoded
manifest has them expanded into their file's entries (:func:`expand_entry_families`).
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .schema import EntryFamily, FileRecord, KeyPath, ShardedTensor, TensorEntry, TensorFamily

__all__ = [
    "READERS_EXPAND_FAMILIES",
    "FamilyIndex",
    "detect_entry_families",
    "detect_tensor_families",
    "entry_family_problems",
    "expand_entry_families",
    "expand_entry_family",
    "expand_tensor_family",
    "families_overlap",
    "family_parents",
    "parents_signature",
    "family_problems",
    "family_set_problems",
    "family_size",
    "instance_count",
    "instances_within",
    "last_instance",
]

#: Whether the reading side (indexes, loading, regions) resolves keys against families
#: (``IndexedManifest.described()``/``find()``). Off, validation refuses even valid families,
#: so that no instance goes unseen.
READERS_EXPAND_FAMILIES = True

#: Integers at or above this never become placeholders (and no range may reach past it).
INDEX_LIMIT = 2**31
#: Orders of instances stay below this.
ORDER_LIMIT = 2**63

_RUNS = re.compile(r"(\d+)")
_TOKEN = re.compile(r"\{\{|\}\}|\{(\d+)\}|[{}]|[^{}]+")


class _NoFamily(Exception):
    """A group whose members one family cannot describe exactly."""


@functools.lru_cache(maxsize=1 << 16)
def _canonical(digits: str) -> bool:
    return (digits == "0" or not digits.startswith("0")) and int(digits) < INDEX_LIMIT


def _escape(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


# -- templates ---------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class _Template:
    """A parsed template: ``texts`` (the non-digit text between digit runs, one more than
    ``runs``) and ``runs`` (each a literal digit string or a placeholder number)."""

    texts: tuple[str, ...]
    runs: tuple[str | int, ...]

    @functools.cached_property
    def _format(self) -> str:
        """The template as a :meth:`str.format` string of the placeholders' values."""
        out = [_format_escape(self.texts[0])]
        for run, text in zip(self.runs, self.texts[1:], strict=True):
            out.append(f"{{{run}}}" if isinstance(run, int) else run)
            out.append(_format_escape(text))
        return "".join(out)

    def render(self, values: Sequence[int]) -> str:
        return self._format.format(*values)


def _format_escape(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


@functools.lru_cache(maxsize=4096)
def _parse(template: str) -> _Template:
    """The template's digit-run form; ``ValueError`` for a bad brace, or for a placeholder
    next to a digit or another placeholder (its instances would not parse back)."""
    pieces: list[str | int] = []
    pos = 0
    for match in _TOKEN.finditer(template):
        if match.start() != pos:
            raise ValueError(f"bad template {template!r}")
        pos = match.end()
        token = match.group(0)
        if match.group(1) is not None:
            if not _canonical(match.group(1)):
                raise ValueError(f"bad placeholder in template {template!r}")
            pieces.append(int(match.group(1)))
        elif token in ("{", "}"):
            raise ValueError(f"unmatched brace in template {template!r}")
        else:
            pieces.append(token[0] if token in ("{{", "}}") else token)
    if pos != len(template):
        raise ValueError(f"bad template {template!r}")
    texts: list[str] = [""]
    runs: list[str | int] = []
    for piece in pieces:
        if isinstance(piece, int):
            if texts[-1] == "" and runs:
                raise ValueError(f"placeholder next to a digit or placeholder in {template!r}")
            runs.append(piece)
            texts.append("")
            continue
        for i, part in enumerate(_RUNS.split(piece)):
            if i % 2 == 0:
                texts[-1] += part
            elif texts[-1] == "" and runs:
                raise ValueError(f"placeholder next to a digit or placeholder in {template!r}")
            else:
                runs.append(part)
                texts.append("")
    return _Template(tuple(texts), tuple(runs))


@functools.lru_cache(maxsize=1 << 16)
def _split_key(key: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    parts = _RUNS.split(key)
    return tuple(parts[0::2]), tuple(parts[1::2])


# -- expansion ---------------------------------------------------------------------------------


def _axes(family: TensorFamily | EntryFamily) -> list[range]:
    return [range(start, stop, step) for start, stop, step in family.indices]


def instance_count(indices: Sequence[Sequence[int]]) -> int:
    """How many instances a family with these ranges has (no instance is built)."""
    count = 1
    for start, stop, step in indices:
        count *= len(range(start, stop, step))
    return count


def _resolve_path(family: TensorFamily | EntryFamily, parsed: list[_Template | int], values: Sequence[int]) -> KeyPath:
    path: KeyPath = []
    for position, part in enumerate(parsed):
        if isinstance(part, int):
            path.append(part)
        elif position in family.int_parts:
            path.append(values[part.runs[0]] if isinstance(part.runs[0], int) else int(part.runs[0]))
        else:
            path.append(part.render(values))
    return path


def _affine_at(base: int, steps: Sequence[int], values: Sequence[int], indices: Sequence[Sequence[int]]) -> int:
    """``base + sum(steps[k] * (values[k] - start_k) / step_k)``: an instance's order or offset."""
    for step_k, value, (start, _stop, step) in zip(steps, values, indices, strict=False):
        base += step_k * ((value - start) // step)
    return base


def _expert_at(family: TensorFamily | EntryFamily, values: Sequence[int]) -> list[int] | None:
    if family.expert_key is None:
        return None
    return [values[int(e[1:-1])] if isinstance(e, str) else e for e in family.expert_key]


def _instance(
    family: TensorFamily, values: Sequence[int], key: _Template, path: list[_Template | int]
) -> ShardedTensor:
    order = _affine_at(family.order, family.order_steps, values, family.indices)
    expert = _expert_at(family, values)
    return ShardedTensor(
        key=key.render(values),
        path=_resolve_path(family, path, values),
        dtype=family.dtype,
        global_shape=list(family.global_shape),
        mesh=family.mesh,
        placements=list(family.placements),
        kind=family.kind,
        expert_key=expert,
        order=order,
    )


def _parsed_path(family: TensorFamily | EntryFamily) -> list[_Template | int]:
    return [part if isinstance(part, int) else _parse(part) for part in family.path]


def last_instance(family: TensorFamily) -> ShardedTensor:
    """The instance at the end of every range of a valid family: its integers are the largest,
    so its key and path are the longest; the other fields every instance shares."""
    values = [start + step * (len(range(start, stop, step)) - 1) for start, stop, step in family.indices]
    return _instance(family, values, _parse(family.key), _parsed_path(family))


def expand_tensor_family(family: TensorFamily) -> Iterator[ShardedTensor]:
    """The instances of a validated family, row-major."""
    key, path = _parse(family.key), _parsed_path(family)
    for values in itertools.product(*_axes(family)):
        yield _instance(family, values, key, path)


def expand_entry_family(family: EntryFamily) -> Iterator[TensorEntry]:
    """The whole-tensor entries of a validated entry family, row-major."""
    key, path = _parse(family.key), _parsed_path(family)
    for values in itertools.product(*_axes(family)):
        yield TensorEntry(
            key=key.render(values),
            path=_resolve_path(family, path, values),
            dtype=family.dtype,
            shape=list(family.shape),
            offset=_affine_at(family.offset, family.offset_steps, values, family.indices),
            nbytes=family.nbytes,
            kind=family.kind,
            expert_key=_expert_at(family, values),
            order=_affine_at(family.order, family.order_steps, values, family.indices),
        )


def entry_family_problems(family: EntryFamily, max_tensors: int) -> list[str]:
    """What makes an entry family invalid, checked without building an instance: as
    :func:`family_problems`, and the byte offsets (one step per range, every instance's offset
    in ``[0, 2**63)``, ``nbytes`` not negative). The instances' dtype, shape and byte ranges
    are checked as entries once expanded."""
    problems = family_problems(family, max_tensors)
    if problems:
        return problems
    where = f"entry family {family.key!r}"
    if len(family.offset_steps) not in (0, len(family.indices)):
        problems.append(f"{where}: offset_steps must have one step per index range")
    low = high = family.offset
    for step_k, (start, stop, step) in zip(family.offset_steps, family.indices, strict=False):
        span = step_k * (len(range(start, stop, step)) - 1)
        low, high = low + min(0, span), high + max(0, span)
    if low < 0 or high >= ORDER_LIMIT or family.nbytes < 0:
        problems.append(f"{where}: instance byte offsets leave [0, 2**63)")
    return problems


def expand_entry_families(record: FileRecord) -> None:
    """Put the instances of ``record``'s entry families (valid: :func:`entry_family_problems`)
    among its ``tensors``, all in byte-offset order (stable), and clear ``families``."""
    instances = [entry for family in record.families for entry in expand_entry_family(family)]
    record.tensors = sorted([*record.tensors, *instances], key=lambda entry: entry.offset)
    record.families = []


def _parent_placeholders(parsed: list[_Template | int]) -> list[int]:
    return sorted({run for part in parsed if isinstance(part, _Template) for run in part.runs if isinstance(run, int)})


def parents_signature(family: TensorFamily) -> tuple[object, ...]:
    """What :func:`family_parents` depends on: families with equal signatures (the weights of
    one expert, say) have the same parents."""
    parents = family.path[:-1]
    used = _parent_placeholders(_parsed_path(family)[:-1])
    ints = tuple(p for p in family.int_parts if p < len(parents))
    return (tuple(parents), ints, tuple((k, tuple(family.indices[k])) for k in used))


def family_parents(family: TensorFamily) -> set[tuple[str | int, ...]]:
    """The distinct parent paths (the path without its last component) of a valid family's
    instances, built over the ranges of the placeholders the parent uses only."""
    parsed = _parsed_path(family)[:-1]
    used = _parent_placeholders(parsed)
    axes = _axes(family)
    values = [axis[0] for axis in axes]
    parents: set[tuple[str | int, ...]] = set()
    for chosen in itertools.product(*(axes[k] for k in used)):
        for k, value in zip(used, chosen, strict=True):
            values[k] = value
        parents.add(tuple(_resolve_path(family, parsed, values)))
    return parents


# -- lookup ------------------------------------------------------------------------------------


class FamilyIndex:
    """Finds the instance of a key among validated families in constant time per family
    sharing the key's non-digit skeleton: the digits are parsed and the ranges checked."""

    def __init__(self, families: Sequence[TensorFamily]) -> None:
        self._by_skeleton: dict[tuple[str, ...], list[tuple[TensorFamily, _Template, list[_Template | int]]]] = {}
        for family in families:
            key = _parse(family.key)
            self._by_skeleton.setdefault(key.texts, []).append((family, key, _parsed_path(family)))

    def find(self, key: str) -> ShardedTensor | None:
        texts, digits = _split_key(key)
        for family, template, path in self._by_skeleton.get(texts, ()):
            values = _match(family, template, digits)
            if values is not None:
                return _instance(family, values, template, path)
        return None


def _match(family: TensorFamily, template: _Template, digits: tuple[str, ...]) -> list[int] | None:
    values = [0] * len(family.indices)
    for run, text in zip(template.runs, digits, strict=True):
        if isinstance(run, str):
            if run != text:
                return None
            continue
        if not _canonical(text):
            return None
        value = int(text)
        start, stop, step = family.indices[run]
        if not (start <= value < stop and (value - start) % step == 0):
            return None
        values[run] = value
    return values


# -- validation --------------------------------------------------------------------------------


def family_size(family: TensorFamily | EntryFamily, limit: int) -> int:
    """The instance count, or ``limit + 1`` as soon as it exceeds ``limit`` (checked range by
    range, so a hostile product never becomes a huge integer)."""
    count = 1
    for start, stop, step in family.indices:
        count *= max(0, len(range(start, stop, step)))
        if count > limit:
            return limit + 1
    return count


def _joins(family: TensorFamily | EntryFamily) -> bool:
    """Whether every instance's key is its path joined with dots (checked on the templates)."""
    return family.key == ".".join(_escape(str(part)) if isinstance(part, int) else part for part in family.path)


def family_problems(family: TensorFamily | EntryFamily, max_tensors: int) -> list[str]:
    """What makes a family invalid, checked without building an instance: ranges, templates,
    placeholders, integer path parts, expert keys, orders, and the instance count against
    ``max_tensors``."""
    where = f"tensor family {family.key!r}"
    n = len(family.indices)
    for bounds in family.indices:
        if len(bounds) != 3:
            return [f"{where}: each index range is [start, stop, step]"]
        start, stop, step = bounds
        if not (0 <= start < stop <= INDEX_LIMIT and step >= 1):
            return [f"{where}: index range {bounds} is empty or out of bounds"]
    if family_size(family, max_tensors) > max_tensors:
        return [f"{where}: more instances than the limit of {max_tensors}"]
    if n == 0:
        return [f"{where}: a family has at least one index range"]
    try:
        key = _parse(family.key)
        path = _parsed_path(family)
    except ValueError as exc:
        return [f"{where}: {exc}"]
    problems: list[str] = []
    if not _joins(family):
        problems.append(f"{where}: key template not equal to its path templates joined with dots")
    placeholders = [run for run in key.runs if isinstance(run, int)]
    if sorted(placeholders) != list(range(n)):
        problems.append(f"{where}: the key must hold each placeholder 0..{n - 1} exactly once")
    for part in path:
        if isinstance(part, _Template) and any(isinstance(r, int) and r >= n for r in part.runs):
            problems.append(f"{where}: a path placeholder has no index range")
    for position in family.int_parts:
        lone = path[position] if 0 <= position < len(path) else None
        if not (isinstance(lone, _Template) and lone.texts == ("", "") and isinstance(lone.runs[0], int)):
            problems.append(f"{where}: integer path part {position} is not a lone placeholder")
    if len(set(family.int_parts)) != len(family.int_parts):
        problems.append(f"{where}: repeated integer path part")
    for entry in family.expert_key or []:
        if isinstance(entry, str) and not (re.fullmatch(r"\{(0|[1-9]\d{0,8})\}", entry) and int(entry[1:-1]) < n):
            problems.append(f"{where}: bad expert key entry {entry!r}")
    if len(family.order_steps) not in (0, n):
        problems.append(f"{where}: order_steps must have one step per index range")
    low = high = family.order
    for step_k, (start, stop, step) in zip(family.order_steps, family.indices, strict=False):
        span = step_k * (len(range(start, stop, step)) - 1)
        low, high = low + min(0, span), high + max(0, span)
    if low < 0 or high >= ORDER_LIMIT:
        problems.append(f"{where}: instance orders leave [0, 2**63)")
    return problems


# -- detection ---------------------------------------------------------------------------------


#: What detection groups: a described tensor, or a whole-tensor entry of one file.
_Member = ShardedTensor | TensorEntry


@dataclass(slots=True)
class _Item:
    tensor: Any  # a ShardedTensor or a TensorEntry (the fields both have are used)
    digits: list[int]  # the key's placeholder-eligible digit runs


def _key_skeleton(member: _Member) -> tuple[tuple[object, ...], list[int]] | None:
    """The key with canonical digit runs masked, the path likewise, and the expert-key length;
    with the key's canonical integers. ``None`` when the key has nothing to vary.

    The key is taken a dot-separated component at a time (:func:`_component_skeleton`, cached:
    keys are unique, their components repeat), which partitions keys exactly as masking the
    runs of the whole key would: no run spans a dot, so the components' texts and masked runs
    and the whole key's determine each other."""
    found = list(map(_component_skeleton, member.key.split(".")))
    digits = list(itertools.chain.from_iterable(map(_VALUES, found)))
    if not digits:
        return None
    key_shape = tuple(map(_SHAPE, found))
    expert = None if member.expert_key is None else len(member.expert_key)
    return (key_shape, tuple(map(_component_shape, member.path)), member.kind, expert), digits


@functools.lru_cache(maxsize=1 << 16)
def _component_skeleton(component: str) -> tuple[tuple[tuple[str, ...], tuple[str | None, ...]], tuple[int, ...]]:
    """One dot-separated component of a key: its texts between digit runs and its runs, the
    canonical ones masked (``None``); and the canonical runs' integers."""
    parts = _RUNS.split(component)
    runs = parts[1::2]
    return (tuple(parts[0::2]), tuple(map(_masked, runs))), tuple(int(run) for run in runs if _canonical(run))


_SHAPE = operator.itemgetter(0)
_VALUES = operator.itemgetter(1)


@functools.lru_cache(maxsize=1 << 16)
def _masked(run: str) -> str | None:
    """A digit run as a key skeleton has it: ``None`` where it can become a placeholder."""
    return None if _canonical(run) else run


@functools.lru_cache(maxsize=1 << 16, typed=True)
def _component_shape(part: str | int) -> tuple[object, ...]:
    return ("int",) if isinstance(part, int) else ("str", _split_key(part)[0])


def _skeleton(tensor: ShardedTensor) -> tuple[tuple[object, ...], list[int]] | None:
    """The grouping key of a described tensor (its key skeleton and the fixed fields), and its
    key's integers."""
    found = _key_skeleton(tensor)
    if found is None:
        return None
    return (found[0], tensor.dtype, tuple(tensor.global_shape), tensor.mesh, tuple(tensor.placements)), found[1]


def _entry_skeleton(entry: TensorEntry) -> tuple[tuple[object, ...], list[int]] | None:
    """The grouping key of a whole-tensor entry (its key skeleton and the fixed fields) and its
    key's integers; ``None``
    for an entry a family cannot describe (a chunk, one with its own digest or blocks, a numpy
    array)."""
    if (
        entry.global_shape is not None
        or entry.global_offset is not None
        or entry.digest is not None
        or entry.blocks
        or entry.array_type != "torch"
    ):
        return None
    found = _key_skeleton(entry)
    if found is None:
        return None
    return (found[0], entry.dtype, tuple(entry.shape), entry.nbytes), found[1]


def _detect(
    members: Sequence[_Member],
    skeleton: Callable[[Any], tuple[tuple[object, ...], list[int]] | None],
    build: Callable[[list[_Item]], Any],
) -> tuple[list[Any], list[Any]]:
    """Group ``members`` by skeleton in one pass and build each group's families."""
    groups: dict[tuple[object, ...], list[_Item]] = {}
    singles: list[Any] = []
    keys = [member.key for member in members]
    unique = set(keys)
    duplicates: set[str] = set()
    if len(unique) != len(keys):
        seen: set[str] = set()
        for key in keys:
            (duplicates if key in seen else seen).add(key)
    for member in members:
        found = None if duplicates and member.key in duplicates else skeleton(member)
        if found is None:
            singles.append(member)
            continue
        groups.setdefault(found[0], []).append(_Item(member, found[1]))
    families: list[Any] = []
    for items in groups.values():
        _detect_group(items, families, singles, build)
    return families, singles


def detect_tensor_families(
    tensors: Sequence[ShardedTensor],
) -> tuple[list[TensorFamily], list[ShardedTensor]]:
    """Split ``tensors`` into families (at least 2 instances each) and singletons, so that
    expanding the families gives back exactly the family members, keys, paths, orders and
    expert keys included. Groups that are not a product of arithmetic ranges with affine
    orders are split on their first varying integer and tried again."""
    return _detect(tensors, _skeleton, _family_of)


def detect_entry_families(entries: Sequence[TensorEntry]) -> tuple[list[EntryFamily], list[TensorEntry]]:
    """Split the entries of one file into entry families (whole tensors whose keys differ only
    in integers, with affine orders and byte offsets) and the entries left as they are;
    expanding the families gives back exactly the family members."""
    return _detect(entries, _entry_skeleton, _entry_family_of)


def _detect_group(
    items: list[_Item], families: list[Any], singles: list[Any], build: Callable[[list[_Item]], Any]
) -> None:
    if len(items) < 2:
        singles.extend(item.tensor for item in items)
        return
    family = build(items)
    if family is not None:
        families.append(family)
        return
    width = len(items[0].digits)
    varying = [k for k in range(width) if len({item.digits[k] for item in items}) > 1]
    if not varying:
        singles.extend(item.tensor for item in items)
        return
    split: dict[int, list[_Item]] = {}
    for item in items:
        split.setdefault(item.digits[varying[0]], []).append(item)
    if len(split) == 1:  # cannot happen with a varying position; kept for termination
        singles.extend(item.tensor for item in items)
        return
    for part in split.values():
        _detect_group(part, families, singles, build)


def _ranges(columns: list[tuple[int, ...]], varying: list[int], count: int) -> list[list[int]] | None:
    ranges: list[list[int]] = []
    for k in varying:
        values = sorted(set(columns[k]))
        step = values[1] - values[0]
        if any(b - a != step for a, b in itertools.pairwise(values)):
            return None
        ranges.append([values[0], values[-1] + 1, step])
    if instance_count(ranges) != count:
        return None
    if len(set(zip(*(columns[k] for k in varying), strict=True))) != count:
        return None
    return ranges


@dataclass
class _Shape:
    """What a family of a group is, whatever its kind: templates, ranges and affine orders."""

    key: str
    path: list[str | int]
    int_parts: list[int]
    indices: list[list[int]]
    expert_key: list[int | str] | None
    order: int
    order_steps: list[int]
    varying: list[int]
    first: Any
    positions: list[tuple[int, ...]]  # per placeholder, each member's position in its range


def _shape_of(items: list[_Item]) -> _Shape | None:
    """The family shape of a group with one skeleton, or ``None`` when it is not one. The
    checks run a column (one digit position over the group) at a time."""
    first = items[0]
    columns = list(zip(*(item.digits for item in items), strict=True))
    varying = [k for k, column in enumerate(columns) if len(set(column)) > 1]
    if not varying:
        return None
    ranges = _ranges(columns, varying, len(items))
    if ranges is None:
        return None
    slot = {k: i for i, k in enumerate(varying)}
    key = _template_of(first.tensor.key, first.digits, slot)
    try:
        path_templates, int_parts = _path_templates(items, slot, columns)
        expert = _expert_template(items, slot, columns)
    except _NoFamily:
        return None
    positions = [_positions(columns[k], *r) for k, r in zip(varying, ranges, strict=True)]
    found = _affine(items, positions, "order")
    if found is None:
        return None
    order_steps, origin = found
    base = items[origin].tensor
    shape = _Shape(
        key,
        path_templates,
        int_parts,
        ranges,
        expert,
        base.order,
        order_steps if any(order_steps) else [],
        varying,
        base,
        positions,
    )
    joined = ".".join(_escape(str(p)) if isinstance(p, int) else p for p in shape.path)
    return shape if joined == shape.key else None


def _positions(column: tuple[int, ...], start: int, _stop: int, step: int) -> tuple[int, ...]:
    """Each value's position in ``range(start, _stop, step)`` (which holds them all)."""
    if step == 1:
        return column if start == 0 else tuple(map(operator.sub, column, itertools.repeat(start)))
    return tuple((value - start) // step for value in column)


def _family_of(items: list[_Item]) -> TensorFamily | None:
    """The tensor family of a group of described tensors, or ``None``."""
    shape = _shape_of(items)
    if shape is None:
        return None
    tensor = shape.first
    return TensorFamily(
        key=shape.key,
        path=shape.path,
        int_parts=shape.int_parts,
        indices=shape.indices,
        dtype=tensor.dtype,
        global_shape=list(tensor.global_shape),
        mesh=tensor.mesh,
        placements=list(tensor.placements),
        kind=tensor.kind,
        expert_key=shape.expert_key,
        order=shape.order,
        order_steps=shape.order_steps,
    )


def _entry_family_of(items: list[_Item]) -> EntryFamily | None:
    """The entry family of a group of whole-tensor entries of one file, or ``None``."""
    shape = _shape_of(items)
    if shape is None:
        return None
    found = _affine(items, shape.positions, "offset")
    if found is None:
        return None
    offset_steps = found[0]
    entry = shape.first
    return EntryFamily(
        key=shape.key,
        path=shape.path,
        int_parts=shape.int_parts,
        indices=shape.indices,
        dtype=entry.dtype,
        shape=list(entry.shape),
        nbytes=entry.nbytes,
        offset=entry.offset,
        offset_steps=offset_steps if any(offset_steps) else [],
        kind=entry.kind,
        expert_key=shape.expert_key,
        order=shape.order,
        order_steps=shape.order_steps,
    )


def _template_of(text: str, digits: list[int], slot: dict[int, int]) -> str:
    """``text`` with its varying canonical digit runs turned into placeholders, the rest
    escaped literally."""
    texts, runs = _split_key(text)
    out = [_escape(texts[0])]
    k = 0
    for run, after in zip(runs, texts[1:], strict=True):
        if _canonical(run):
            out.append(f"{{{slot[k]}}}" if k in slot else run)
            k += 1
        else:
            out.append(run)
        out.append(_escape(after))
    return "".join(out)


def _binding(values: Sequence[int], slot: dict[int, int], columns: list[tuple[int, ...]]) -> int | None:
    """How a path or expert-key integer relates to the key: the placeholder it always equals,
    or ``None`` when it is constant; :class:`_NoFamily` when neither."""
    values = tuple(values)
    if len(set(values)) == 1:
        return None
    for k, placeholder in slot.items():
        if values == columns[k]:
            return placeholder
    raise _NoFamily


def _path_templates(
    items: list[_Item], slot: dict[int, int], columns: list[tuple[int, ...]]
) -> tuple[list[str | int], list[int]]:
    templates: list[str | int] = []
    int_parts: list[int] = []
    paths = [item.tensor.path for item in items]
    for position, part in enumerate(items[0].tensor.path):
        if not isinstance(part, int) and len(_split_key(part)[0]) == 1:
            templates.append(_escape(part))  # no digit: the same text in every member (the skeleton)
            continue
        component = [path[position] for path in paths]
        if isinstance(part, int):
            bound = _binding(list(map(int, component)), slot, columns)
            if bound is None:
                templates.append(part)
            else:
                templates.append(f"{{{bound}}}")
                int_parts.append(position)
            continue
        texts = _split_key(part)[0]
        out = [_escape(texts[0])]
        runs = [_split_key(str(value))[1] for value in component] if len(texts) > 1 else []
        for r, after in enumerate(texts[1:]):
            column = [found[r] for found in runs]
            if len(set(column)) == 1:
                out.append(column[0])
            elif all(map(_canonical, column)):
                bound = _binding(list(map(int, column)), slot, columns)
                if bound is None:
                    raise _NoFamily
                out.append(f"{{{bound}}}")
            else:
                raise _NoFamily
            out.append(_escape(after))
        templates.append("".join(out))
    return templates, int_parts


def _expert_template(
    items: list[_Item], slot: dict[int, int], columns: list[tuple[int, ...]]
) -> list[int | str] | None:
    first = items[0].tensor.expert_key
    if first is None:
        return None
    out: list[int | str] = []
    for position, value in enumerate(first):
        column = [item.tensor.expert_key[position] for item in items]
        bound = _binding(column, slot, columns)
        out.append(value if bound is None else f"{{{bound}}}")
    return out


def _affine(items: list[_Item], positions: list[tuple[int, ...]], field: str) -> tuple[list[int], int] | None:
    """Per-placeholder steps making the members' ``field`` affine in their range positions
    (``positions``: per placeholder, each member's), and the index of the member at the origin;
    ``None`` when it is not affine. Decided a column at a time."""
    values = list(map(operator.attrgetter(field), (item.tensor for item in items)))
    index = dict(zip(zip(*positions, strict=True), range(len(items)), strict=True))
    width = len(positions)
    origin = index[(0,) * width]
    base = values[origin]
    steps: list[int] = []
    for axis in range(width):
        unit = index.get(tuple(1 if a == axis else 0 for a in range(width)))
        steps.append(values[unit] - base if unit is not None else 0)
    predicted = [base] * len(items)
    for step, column in zip(steps, positions, strict=True):
        if step:
            predicted = list(map(operator.add, predicted, map(step.__mul__, column)))
    return (steps, origin) if predicted == values else None


# -- validation of a set of families -----------------------------------------------------------

#: Families sharing one key skeleton are compared pairwise; more than this many is refused.
MAX_FAMILIES_PER_SKELETON = 1024


def instances_within(families: Sequence[TensorFamily | EntryFamily], limit: int) -> int:
    """The instances of ``families`` together, or ``limit + 1`` once past ``limit``; nothing
    is built, so a hostile product costs nothing (the count behind ``max_tensors``)."""
    total = 0
    for family in families:
        total += family_size(family, limit)
        if total > limit:
            return limit + 1
    return total


def _progressions_meet(a: Sequence[int], b: Sequence[int]) -> bool:
    """Whether ``range(*a)`` and ``range(*b)`` share an integer (exact arithmetic)."""
    (start_a, stop_a, step_a), (start_b, stop_b, step_b) = a, b
    g = math.gcd(step_a, step_b)
    if (start_b - start_a) % g:
        return False
    modulus = step_b // g
    k = ((start_b - start_a) // g * pow(step_a // g, -1, modulus)) % modulus if modulus > 1 else 0
    first, period = start_a + step_a * k, step_a * modulus
    low = max(start_a, start_b)
    if first < low:
        first += -(-(low - first) // period) * period
    return first < min(stop_a, stop_b)


def _run_meets(run_a: str | int, run_b: str | int, fa: TensorFamily, fb: TensorFamily) -> bool:
    if isinstance(run_a, str) and isinstance(run_b, str):
        return run_a == run_b
    if isinstance(run_a, str) or isinstance(run_b, str):
        literal, run, family = (run_a, run_b, fb) if isinstance(run_a, str) else (run_b, run_a, fa)
        assert isinstance(literal, str) and isinstance(run, int)
        return _canonical(literal) and int(literal) in range(*family.indices[run])
    return _progressions_meet(fa.indices[run_a], fb.indices[run_b])


def families_overlap(a: TensorFamily, b: TensorFamily) -> bool:
    """Whether two valid families share an instance key (no instance is built)."""
    ta, tb = _parse(a.key), _parse(b.key)
    if ta.texts != tb.texts:
        return False
    return all(_run_meets(ra, rb, a, b) for ra, rb in zip(ta.runs, tb.runs, strict=True))


def family_set_problems(families: Sequence[TensorFamily], other_keys: Iterable[str], max_tensors: int) -> list[str]:
    """Every family valid (:func:`family_problems`), no two sharing an instance key, and no key
    of ``other_keys`` (entries, described singletons) an instance of a family. Checked without
    expanding a family; the cost is the families, the keys and the pairs of families that share
    a key skeleton."""
    problems: list[str] = []
    for family in families:
        problems += family_problems(family, max_tensors)
    if problems:
        return problems
    buckets: dict[tuple[str, ...], list[TensorFamily]] = {}
    for family in families:
        buckets.setdefault(_parse(family.key).texts, []).append(family)
    for bucket in buckets.values():
        if len(bucket) > MAX_FAMILIES_PER_SKELETON:
            return [
                f"{len(bucket)} tensor families share the key shape of {bucket[0].key!r}, over {MAX_FAMILIES_PER_SKELETON}"
            ]
        for i, first in enumerate(bucket):
            for second in bucket[i + 1 :]:
                if families_overlap(first, second):
                    problems.append(f"tensor families {first.key!r} and {second.key!r} share an instance key")
    index = FamilyIndex(families)
    for key in other_keys:
        if index.find(key) is not None:
            problems.append(f"duplicate key {key[:80]!r} (an instance of a tensor family and listed again)")
    return problems
