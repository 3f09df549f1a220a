"""The node map: which node each rank runs on, agreed by every rank in one collective.

A node-local level places each rank's files on its node's local disk, so every rank must
know the same map from ranks to nodes. :func:`node_map` takes each rank's own node id from
the first source that gives one, then gathers them:

1. the explicit ``node_of`` (a callable ``rank -> node id``, or a sequence indexed by rank);
2. the environment variable ``SHARDKEEP_NODE`` (an integer);
3. ``GROUP_RANK`` (set by ``torchrun`` to the node's index in the job);
4. the host name: hosts are numbered in the order of their lowest rank.

Explicit and environment ids must number the nodes ``0 .. K-1``, each with at least one rank.
Every rank validates the same gathered list, so a bad id raises the same
:class:`~shardkeep.errors.LevelConfigError` (naming the rank) on every rank; so does a layout
the ranks disagree on (ranks of one node id on different hosts: :func:`check_hosts`).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from shardkeep.distributed.coordinator import Coordinator
from shardkeep.errors import LevelConfigError

__all__ = ["NODE_ENVIRONMENT", "NodeMap", "NodeOf", "check_hosts", "node_map", "node_map_with"]

#: The environment variable naming this process's node id (an integer).
NODE_ENVIRONMENT = "SHARDKEEP_NODE"
T = TypeVar("T")

#: What ``torchrun`` sets to the node's index.
_GROUP_RANK = "GROUP_RANK"

#: An explicit node map: a function of the rank, or a sequence indexed by rank.
NodeOf = Callable[[int], int] | Sequence[int]


@dataclass(frozen=True)
class NodeMap:
    """``node_of[rank]`` is the node of each rank; nodes are numbered ``0 .. node_count-1``
    and each has at least one rank. ``source`` says where the ids came from (``"explicit"``,
    ``"SHARDKEEP_NODE"``, ``"GROUP_RANK"`` or ``"hostname"``)."""

    node_of: tuple[int, ...]
    source: str = "explicit"

    def __post_init__(self) -> None:
        _check_numbering(list(self.node_of))

    @property
    def world_size(self) -> int:
        return len(self.node_of)

    @property
    def node_count(self) -> int:
        return max(self.node_of) + 1

    @property
    def nodes(self) -> tuple[int, ...]:
        return tuple(range(self.node_count))

    def ranks_of(self, node: int) -> tuple[int, ...]:
        """The ranks on ``node``, in increasing order."""
        return tuple(rank for rank, owner in enumerate(self.node_of) if owner == node)

    def leader(self, node: int) -> int:
        """The lowest rank on ``node``: the one that creates, commits and removes that node's
        directories."""
        ranks = self.ranks_of(node)
        if not ranks:
            raise LevelConfigError(f"node {node} is not in the node map (nodes 0 .. {self.node_count - 1})")
        return ranks[0]

    def is_leader(self, rank: int) -> bool:
        return self.leader(self.node_of[rank]) == rank


def _own_id(rank: int, node_of: NodeOf | None) -> tuple[str, object]:
    """(source, raw id) of this rank, from the first source that gives one."""
    if node_of is not None:
        try:
            value = node_of(rank) if callable(node_of) else node_of[rank]
        except Exception as exc:
            return "explicit", f"<node_of failed for rank {rank}: {type(exc).__name__}: {exc}>"
        return "explicit", value
    for variable in (NODE_ENVIRONMENT, _GROUP_RANK):
        text = os.environ.get(variable)
        if text is not None and text.strip():
            return variable, text.strip()
    return "hostname", socket.gethostname()


def _as_id(source: str, rank: int, value: object) -> int:
    """The integer node id of ``rank`` from ``value``; a :class:`LevelConfigError` naming the
    rank when it is not one."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and source != "explicit":
        try:
            number = int(value)
        except ValueError:
            number = -1
        if number >= 0:
            return number
    raise LevelConfigError(
        f"rank {rank}: node id {value!r} (from {source}) is not an integer >= 0; give node_of= or set "
        f"{NODE_ENVIRONMENT} to the node's index"
    )


def _check_numbering(ids: list[int]) -> None:
    if not ids:
        raise LevelConfigError("the node map is empty: a job has at least one rank")
    for rank, node in enumerate(ids):
        if isinstance(node, bool) or not isinstance(node, int) or node < 0:
            raise LevelConfigError(f"rank {rank}: node id {node!r} is not an integer >= 0")
    empty = sorted(set(range(max(ids) + 1)) - set(ids))
    if empty:
        raise LevelConfigError(
            f"node(s) {empty} have no rank: node ids must number the nodes 0 .. K-1 (the ranks' ids are {ids})"
        )


def resolve(gathered: list[tuple[str, object]]) -> NodeMap:
    """The node map from every rank's (source, raw id), in rank order: the pure half of
    :func:`node_map`."""
    sources = {source for source, _ in gathered}
    if len(sources) > 1:
        by_source = {
            source: [rank for rank, (s, _) in enumerate(gathered) if s == source] for source in sorted(sources)
        }
        raise LevelConfigError(
            f"the ranks took their node ids from different sources ({by_source}); set the same one on every rank"
        )
    source = gathered[0][0]
    if source == "hostname":
        numbers: dict[object, int] = {}
        ids = [numbers.setdefault(host, len(numbers)) for _, host in gathered]
    else:
        ids = [_as_id(source, rank, value) for rank, (_, value) in enumerate(gathered)]
    return NodeMap(tuple(ids), source=source)


def check_hosts(nodes: NodeMap, hosts: Sequence[str]) -> None:
    """Refuse a layout whose ranks disagree about what a node is: ranks given one node id on
    different hosts (each host's local disk would hold part of that node's files). Several
    nodes on one host are allowed (simulations, network namespaces)."""
    for node in nodes.nodes:
        ranks = nodes.ranks_of(node)
        first = ranks[0]
        for rank in ranks[1:]:
            if hosts[rank] != hosts[first]:
                raise LevelConfigError(
                    f"rank {rank} says it is on node {node} (from {nodes.source}) but runs on host {hosts[rank]!r}, "
                    f"while rank {first} of node {node} runs on host {hosts[first]!r}: one node id must name one "
                    f"machine; fix node_of= or {NODE_ENVIRONMENT}"
                )


def node_map(coordinator: Coordinator, node_of: NodeOf | None = None) -> NodeMap:
    """The node map of the job (collective: every rank calls it, in the same order as its other
    collectives). See the module docstring for the sources of the ids and their checks; ranks
    given one node id on different hosts are refused (:func:`check_hosts`)."""
    return node_map_with(coordinator, node_of, None)[0]


def node_map_with(coordinator: Coordinator, node_of: NodeOf | None, extra: T) -> tuple[NodeMap, list[T]]:
    """:func:`node_map`, and every rank's ``extra`` (picklable, small), gathered in the same
    collective, in rank order: what the ranks must agree on at the same point (each rank's
    probe of the shared levels) joins the node map instead of adding a collective."""
    source, value = _own_id(coordinator.rank, node_of)
    gathered = coordinator.all_gather((source, value, socket.gethostname(), extra), label="gather the node map")
    nodes = resolve([(str(source), value) for source, value, _, _ in gathered])
    check_hosts(nodes, [str(host) for _, _, host, _ in gathered])
    return nodes, [item for _, _, _, item in gathered]
