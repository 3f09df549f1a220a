"""The save plan: which rank writes which tensor or chunk. (The coverage check at commit,
:func:`coverage_problems`, lives in :mod:`shardkeep.tensors.coverage`, which readers use without
this package; it is re-exported here.)

Every rank describes the tensors it holds as :class:`ItemDescriptor` values, and every tensor or
chunk is written once in total. What crosses ranks stays small at any world size:

- **Chunks of sharded tensors** (``DTensor``) never cross: a chunk held by several replicas
  (``Replicate`` mesh dimensions) is written by the replica :func:`chunk_writer` names, which
  every holder computes alone from the chunk's key and offset.
- **Whole tensors** (replicated, as in DDP) are placed largest first on the rank with the fewest
  bytes so far. Ranks first exchange one digest of what they hold (:func:`agreement_digest`:
  the whole tensors, and each sharded tensor's key, dtype and global shape). When every rank
  holds the same (the usual case), each computes the placement alone
  (:func:`assign_identical`); otherwise the whole-tensor lists are all-gathered and
  :func:`assign_writers` places them, and ranks that disagree about a sharded tensor are
  refused (:func:`check_sharded_agreement`).

This module does not import torch.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from typing import NamedTuple

import msgspec

from shardkeep.errors import CoordinationError
from shardkeep.manifest import DTYPE_ITEMSIZE
from shardkeep.tensors.coverage import coverage_problems
from shardkeep.tensors.grid import chunk_writer

__all__ = [
    "SMALL_WHOLE",
    "ItemDescriptor",
    "agreement_digest",
    "assign_identical",
    "assign_by_class",
    "assign_writers",
    "check_sharded_agreement",
    "chunk_writer",
    "coverage_problems",
    "global_totals",
    "sharded_facts",
    "sharded_totals",
]

Ident = tuple[str, tuple[int, ...] | None]


class ItemDescriptor(NamedTuple):
    """What one rank holds for one key: a whole tensor (``global_offset`` is ``None``) or a chunk."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    global_shape: tuple[int, ...] | None
    global_offset: tuple[int, ...] | None
    #: A chunk on a regular grid: (mesh shape, mesh token, placement names); see ``regular_layout``.
    layout: tuple[tuple[int, ...], str, tuple[str, ...]] | None = None

    @property
    def ident(self) -> tuple[str, tuple[int, ...] | None]:
        return (self.key, self.global_offset)


def _holders(
    lists: list[list[ItemDescriptor]], ranks: list[int]
) -> tuple[dict[Ident, ItemDescriptor], dict[Ident, list[int]]]:
    """Each ident's first description, and the positions (in ``lists``) of the lists holding
    it; raises :class:`CoordinationError` when two lists disagree about an item (dtype or
    shape), naming the rank ``ranks[position]`` each list came from."""
    holders: dict[Ident, list[int]] = {}
    first: dict[Ident, ItemDescriptor] = {}
    for position, items in enumerate(lists):
        for item in items:
            ident = item.ident
            known = first.get(ident)
            if known is None:
                first[ident] = item
                holders[ident] = [position]
                continue
            if (known.dtype, known.shape, known.global_shape) != (item.dtype, item.shape, item.global_shape):
                raise CoordinationError(
                    f"ranks disagree about tensor {item.key!r}: rank {ranks[holders[ident][0]]} has "
                    f"{known.dtype}{list(known.shape)}, rank {ranks[position]} has {item.dtype}{list(item.shape)}"
                )
            holders[ident].append(position)
    return first, holders


def assign_writers(
    held: list[list[ItemDescriptor]], *, small: int = 0
) -> list[set[tuple[str, tuple[int, ...] | None]]]:
    """For each rank, the idents it writes. ``held[r]`` lists what rank ``r`` holds.

    Largest first, each tensor goes to the holder with the fewest bytes so far; a whole tensor
    of at most ``small`` bytes goes to its lowest holder instead (see :data:`SMALL_WHOLE`).
    Raises :class:`CoordinationError` when ranks disagree about an item (dtype or shape).
    """
    first, holders = _holders(held, list(range(len(held))))
    assigned: list[set[tuple[str, tuple[int, ...] | None]]] = [set() for _ in held]
    load = [0] * len(held)
    order = sorted(first, key=lambda ident: (-first[ident].nbytes, ident[0], ident[1] or ()))
    for ident in order:
        if first[ident].nbytes <= small and ident[1] is None:
            writer = holders[ident][0]
        else:
            writer = min(holders[ident], key=lambda rank: (load[rank], rank))
        assigned[writer].add(ident)
        load[writer] += first[ident].nbytes
    return assigned


def assign_by_class(
    classes: list[list[ItemDescriptor]], members: list[list[int]], world_size: int, *, small: int = 0
) -> list[set[Ident]]:
    """:func:`assign_writers` when ranks come in classes that hold the same (equal
    :func:`agreement_digest`): ``classes[c]`` is what the ranks ``members[c]`` hold (ascending).
    The same result, in O(tensors x classes + ranks log ranks) instead of over every rank's list:
    each class keeps a heap of its ranks by (bytes so far, rank), and a tensor goes to the best
    top among the classes that hold it."""
    first, holders = _holders(classes, [ranks[0] for ranks in members])
    heaps = [[(0, rank) for rank in ranks] for ranks in members]  # sorted ascending: already heaps
    assigned: list[set[Ident]] = [set() for _ in range(world_size)]
    order = sorted(first, key=lambda ident: (-first[ident].nbytes, ident[0], ident[1] or ()))
    for ident in order:
        nbytes = first[ident].nbytes
        if nbytes <= small and ident[1] is None:
            position = min(holders[ident], key=lambda c: members[c][0])
            rank = members[position][0]  # the lowest holder; small ones come last: loads no longer matter
            assigned[rank].add(ident)
            continue
        position = min(holders[ident], key=lambda c: heaps[c][0])
        load, rank = heapq.heappop(heaps[position])
        assigned[rank].add(ident)
        heapq.heappush(heaps[position], (load + nbytes, rank))
    return assigned


#: In a save with sharded tensors, whole tensors of at most this many bytes (optimizer step
#: counters, norms' buffers) all go to the lowest rank holding them: every loading rank needs
#: every whole tensor, and one file of them beats one file per rank (a 70B model's AdamW has
#: 723 step counters). Larger whole tensors are still spread over the ranks.
SMALL_WHOLE = 1 << 20


Fact = tuple[str, str, tuple[int, ...], tuple[tuple[int, ...], str, tuple[str, ...]] | None]


def sharded_facts(items: list[ItemDescriptor]) -> list[Fact]:
    """(key, dtype, global shape, layout) of each sharded tensor among ``items``, sorted by key."""
    facts = {
        item.key: (item.key, item.dtype, item.global_shape, item.layout)
        for item in items
        if item.global_shape is not None
    }
    return [fact for _, fact in sorted(facts.items())]


def agreement_digest(items: list[ItemDescriptor], tree: object = None) -> str:
    """A digest of what every rank must hold alike: its whole tensors (key, dtype, shape), each
    sharded tensor's key, dtype and global shape, and ``tree`` (the state's containers, any
    msgspec-encodable value). Equal digests on every rank let each rank plan alone; 32 hex
    characters per rank is all that crosses."""
    whole = sorted((item.key, item.dtype, item.shape, item.nbytes) for item in items if item.global_offset is None)
    encoded = msgspec.msgpack.encode([whole, sharded_facts(items), tree])
    return hashlib.blake2b(encoded, digest_size=16).hexdigest()


def check_sharded_agreement(per_rank: list[list[Fact]], *, ranks: list[int] | None = None) -> None:
    """Refuse ranks that hold one sharded tensor with different dtypes, global shapes or
    layouts (a rank may lack a key: pipeline stages hold different layers). ``ranks`` names
    the rank of each list (default: its position)."""
    first: dict[str, tuple[int, Fact]] = {}
    for position, facts in enumerate(per_rank):
        rank = ranks[position] if ranks is not None else position
        for fact in facts:
            key, dtype, shape, layout = fact[0], fact[1], tuple(fact[2]), _plain(fact[3])
            known = first.setdefault(key, (rank, (key, dtype, shape, layout)))  # type: ignore[arg-type]
            _, known_dtype, known_shape, known_layout = known[1]
            if (known_dtype, known_shape) != (dtype, shape):
                raise CoordinationError(
                    f"ranks disagree about sharded tensor {key!r}: rank {known[0]} has {known_dtype}{list(known_shape)}, "
                    f"rank {rank} has {dtype}{list(shape)}"
                )
            if known_layout != layout:
                raise CoordinationError(
                    f"ranks disagree about how sharded tensor {key!r} is laid out: rank {known[0]} has {known_layout}, "
                    f"rank {rank} has {layout}"
                )


def _plain(layout: object) -> object:
    """A layout as tuples (msgpack gives lists back)."""
    if isinstance(layout, (list, tuple)):
        return tuple(_plain(part) for part in layout)
    return layout


def assign_identical(items: list[ItemDescriptor], world_size: int, *, small: int = 0) -> list[set[Ident]]:
    """:func:`assign_writers` for whole tensors that every rank holds alike (equal
    :func:`agreement_digest`): the same result, computed by each rank alone in
    O(n log R) instead of over every rank's list."""
    assigned: list[set[Ident]] = [set() for _ in range(world_size)]
    loads = [(0, rank) for rank in range(world_size)]  # (bytes so far, rank): a heap
    whole = [item for item in items if item.global_offset is None]
    for item in sorted(whole, key=lambda item: (-item.nbytes, item.key)):
        if item.nbytes <= small:  # to rank 0, the lowest holder (small ones come last: no load to track)
            assigned[0].add(item.ident)
            continue
        load, rank = heapq.heappop(loads)
        assigned[rank].add(item.ident)
        heapq.heappush(loads, (load + item.nbytes, rank))
    return assigned


def global_totals(items: list[ItemDescriptor]) -> dict[str, tuple[int, str]]:
    """Per key, the bytes it takes in the whole checkpoint and its dtype: a whole tensor's own
    size, a sharded tensor's global size (from its global shape)."""
    totals = {item.key: (item.nbytes, item.dtype) for item in items if item.global_shape is None}
    totals.update(sharded_totals(sharded_facts(items)))
    return totals


def sharded_totals(facts: list[Fact]) -> dict[str, tuple[int, str]]:
    """Per sharded key (from :func:`sharded_facts`), its global size in bytes and its dtype."""
    return {fact[0]: (math.prod(fact[2]) * DTYPE_ITEMSIZE.get(fact[1], 1), fact[1]) for fact in facts}
