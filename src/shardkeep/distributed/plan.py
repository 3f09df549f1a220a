"""The save plan: which rank writes which tensor or chunk. (The coverage check at commit,
:func:`coverage_problems`, lives in :mod:`shardkeep.tensors.coverage`, which readers use without
this package; it is re-exported here.)

Every rank describes the tensors it holds as :class:`ItemDescriptor` values; after an
all-gather, every rank computes the same :func:`assign_writers` result, so no second round trip
is needed. A replicated tensor (the DDP case: every rank holds the same key) and a chunk held by
several replicas are written once in total; items are placed largest first on the rank with the
fewest bytes so far, so ranks write about the same number of bytes.

This module does not import torch.
"""

from __future__ import annotations

from typing import NamedTuple

from shardkeep.errors import CoordinationError
from shardkeep.tensors.coverage import coverage_problems

__all__ = ["ItemDescriptor", "assign_writers", "coverage_problems"]


class ItemDescriptor(NamedTuple):
    """What one rank holds for one key: a whole tensor (``global_offset`` is ``None``) or a chunk."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    global_shape: tuple[int, ...] | None
    global_offset: tuple[int, ...] | None

    @property
    def ident(self) -> tuple[str, tuple[int, ...] | None]:
        return (self.key, self.global_offset)


def assign_writers(held: list[list[ItemDescriptor]]) -> list[set[tuple[str, tuple[int, ...] | None]]]:
    """For each rank, the idents it writes. ``held[r]`` lists what rank ``r`` holds.

    Raises :class:`CoordinationError` when ranks disagree about an item (dtype or shape).
    """
    holders: dict[tuple[str, tuple[int, ...] | None], list[int]] = {}
    first: dict[tuple[str, tuple[int, ...] | None], ItemDescriptor] = {}
    for rank, items in enumerate(held):
        for item in items:
            ident = item.ident
            known = first.get(ident)
            if known is None:
                first[ident] = item
                holders[ident] = [rank]
                continue
            if (known.dtype, known.shape, known.global_shape) != (item.dtype, item.shape, item.global_shape):
                raise CoordinationError(
                    f"ranks disagree about tensor {item.key!r}: rank {holders[ident][0]} has "
                    f"{known.dtype}{list(known.shape)}, rank {rank} has {item.dtype}{list(item.shape)}"
                )
            holders[ident].append(rank)
    assigned: list[set[tuple[str, tuple[int, ...] | None]]] = [set() for _ in held]
    load = [0] * len(held)
    order = sorted(first, key=lambda ident: (-first[ident].nbytes, ident[0], ident[1] or ()))
    for ident in order:
        writer = min(holders[ident], key=lambda rank: (load[rank], rank))
        assigned[writer].add(ident)
        load[writer] += first[ident].nbytes
    return assigned
