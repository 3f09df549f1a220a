"""What each level holds, step by step: the copies of every step and their state, for
``MultiLevelManager.status`` and ``shardkeep ls --level``. Reads only; imports no torch.

A copy's state is one of:

- ``committed``: a committed checkpoint (on a node-local level: this node's part of it, whose
  own files were checked when ``verify``);
- ``protected``: on a node-local level, a committed part whose ``node-part.json`` records the
  peer replicas it holds: every rank's replication of that step ended with every file
  checked, so every part of the step has its replicas on other nodes and the step survives
  losing a node (:mod:`shardkeep.levels.replicas`);
- ``damaged``: committed, but a check failed (``detail`` says which);
- ``draining``: a staging directory (or attempt prefix) of a save or drain in progress, or
  left by one that a crash cut off (``detail`` gives its age);
- ``unreachable``: the level could not be read (``detail`` gives the reason; ``step`` is -1).

A node-local root may be given as a template with ``{node}`` (one host simulating several
nodes, as the tests do): every node's part is then listed, and :func:`step_summary` says which
nodes lack one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from shardkeep.catalog import CheckpointRoot
from shardkeep.errors import ShardkeepError, StorageError
from shardkeep.levels.local_catalog import scan
from shardkeep.names import MANIFEST_FILENAME, NODE_PART_FILENAME, STAGING_MARKER, is_derived_name, step_of_name
from shardkeep.storage import is_url, local_path

__all__ = [
    "NODE_FIELD",
    "CopyState",
    "LevelCopy",
    "StepSummary",
    "is_node_local_root",
    "level_copies",
    "step_summary",
    "steps_table",
]

#: The placeholder of a node-local root given for every node at once (``/tmp/run/node{node}``).
NODE_FIELD = "{node}"

CopyState = Literal["committed", "protected", "damaged", "draining", "unreachable"]


@dataclass(frozen=True)
class LevelCopy:
    """One copy of one step on one level: ``level``, ``name`` (``step_<N>`` or a staging name),
    ``step``, ``state``, ``detail`` (problems, the node's part, a staging's age), for a
    node-local level the ``node`` whose part this is and the node ``nodes`` count, and the
    ``root`` it was found in."""

    level: str
    name: str
    step: int
    state: CopyState
    detail: str = ""
    node: int | None = None
    nodes: int | None = None
    root: str = ""

    def document(self) -> dict[str, Any]:
        """This copy as plain JSON values."""
        return {
            "level": self.level,
            "name": self.name,
            "step": self.step,
            "state": self.state,
            "detail": self.detail,
            "node": self.node,
            "nodes": self.nodes,
            "root": self.root,
        }


def is_node_local_root(root: str) -> bool:
    """Whether ``root`` (a local path) holds parts of a node-local level: a committed step with
    a ``node-part.json``."""
    if is_url(root):
        return False
    path = local_path(root)
    if path is None:
        return False
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(
        step_of_name(name) is not None
        and os.path.exists(os.path.join(path, name, NODE_PART_FILENAME))
        and os.path.exists(os.path.join(path, name, MANIFEST_FILENAME))
        for name in names
    )


def _age(age: float | None) -> str:
    return "age unknown" if age is None else f"idle {age:.0f} s"


def _ranks(ranks: Sequence[int]) -> str:
    """``0-3`` for a run of ranks, else ``0,2,5``."""
    ordered = sorted(ranks)
    if len(ordered) > 2 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}-{ordered[-1]}"
    return ",".join(str(rank) for rank in ordered)


def node_local_copies(level: str, root: str, *, verify: bool = False) -> list[LevelCopy]:
    """The copies this node's part of a node-local level holds (see
    :func:`~shardkeep.levels.local_catalog.scan`). A root that does not exist or is not a
    directory raises :class:`~shardkeep.errors.StorageError`."""
    path = local_path(root) or root
    if not os.path.exists(path):
        raise StorageError(f"{root} does not exist")
    if not os.path.isdir(path):
        raise StorageError(f"{root} is not a directory")
    copies: list[LevelCopy] = []
    for found in scan(root, verify=verify):
        if found.state == "staging":
            copies.append(
                LevelCopy(level, found.name, found.step, "draining", f"a local save, {_age(found.age)}", root=root)
            )
            continue
        part = found.part
        node = part.node if part is not None else None
        nodes = part.nodes if part is not None else None
        if found.state == "damaged":
            detail = "; ".join(found.problems[:3])
        elif part is not None:
            files = f"{len(part.files)} data file{'s' if len(part.files) != 1 else ''}"
            checked = "digests verified" if verify else "files present, not read"
            detail = f"node {part.node} of {part.nodes}, ranks {_ranks(part.ranks)}: {files}, {checked}"
            if part.healed:
                detail += f", {len(part.healed)} healed from another copy"
            if part.replicas:
                sources = ",".join(str(source) for source in sorted(part.replicas))
                detail += f", replicas of node(s) {sources}"
        else:
            detail = ""
        state: CopyState = "damaged" if found.state == "damaged" else "committed"
        if state == "committed" and part is not None and part.replicas:
            state = "protected"
        copies.append(LevelCopy(level, found.name, found.step, state, detail, node, nodes, root))
    return copies


def every_node_copies(level: str, template: str, *, verify: bool = False) -> list[LevelCopy]:
    """Every node's part of a node-local level whose root is ``template`` with ``{node}``: the
    node count is the largest any part records (node 0, 1, ... are read until then; node 0's
    root must exist, another node's may be gone)."""
    copies: list[LevelCopy] = []
    node, nodes = 0, 1
    while node < nodes:
        root = template.replace(NODE_FIELD, str(node))
        if node > 0 and not os.path.exists(local_path(root) or root):
            node += 1  # a node whose root is gone: step_summary names it among the missing
            continue
        found = node_local_copies(level, root, verify=verify)
        nodes = max([nodes, *(copy.nodes for copy in found if copy.nodes is not None)])
        copies += found
        node += 1
    return sorted(copies, key=lambda copy: (copy.step, copy.name, copy.node if copy.node is not None else -1))


def shared_copies(
    level: str, root: str, *, verify: bool = False, storage_options: Mapping[str, Any] | None = None
) -> list[LevelCopy]:
    """The copies a shared level (a managed root, local or ``s3://``) holds."""
    catalog = CheckpointRoot.at(root, storage_options=storage_options)
    found = catalog.scan()
    copies: list[LevelCopy] = []
    for item in found:
        if item.manifest is None and catalog.store.stat(f"{item.name}/{MANIFEST_FILENAME}") is None:
            # files under the final name without a manifest: an object store's drain or save
            # in progress, or cut off (the next restore resumes or removes it)
            copies.append(LevelCopy(level, item.name, item.step, "draining", "files without a manifest", root=root))
            continue
        if verify:
            catalog.verify_fully(item)
        problems = list(item.problems)
        state: CopyState = "damaged" if problems else "committed"
        detail = "; ".join(problems[:3]) if problems else ("digests verified" if verify else "files present, not read")
        copies.append(LevelCopy(level, item.name, item.step, state, detail, root=root))
    listed = {item.name for item in found}
    for name, info in catalog.store.list_dir(""):
        step = step_of_name(name)
        if step is not None and info.kind == "dir" and name not in listed:  # an object store's, as above
            copies.append(LevelCopy(level, name, step, "draining", "files without a manifest", root=root))
    for name, idle in catalog.leftovers():
        if not is_derived_name(name, STAGING_MARKER):
            continue
        step = step_of_name(name.rpartition(STAGING_MARKER)[0])
        if step is not None:
            copies.append(LevelCopy(level, name, step, "draining", f"staging, {_age(idle)}", root=root))
    return sorted(copies, key=lambda copy: (copy.step, copy.name))


def level_copies(
    level: str,
    root: str,
    *,
    node_local: bool | None = None,
    verify: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> list[LevelCopy]:
    """Every copy ``level`` at ``root`` holds (node-local when ``node_local``, or, when
    ``None``, when the root holds node parts; a root with ``{node}`` is node-local and read for
    every node). A level that cannot be read gives one ``unreachable`` entry with the reason."""
    try:
        if NODE_FIELD in root and node_local is not False:
            return every_node_copies(level, root, verify=verify)
        if node_local if node_local is not None else is_node_local_root(root):
            return node_local_copies(level, root, verify=verify)
        return shared_copies(level, root, verify=verify, storage_options=storage_options)
    except ShardkeepError as exc:
        return [LevelCopy(level, "", -1, "unreachable", f"{type(exc).__name__}: {exc}", root=root)]


def steps_table(copies: Sequence[LevelCopy]) -> dict[int, dict[str, list[LevelCopy]]]:
    """``copies`` by step, newest first, then by level."""
    table: dict[int, dict[str, list[LevelCopy]]] = {}
    for copy in sorted(copies, key=lambda c: -c.step):
        table.setdefault(copy.step, {}).setdefault(copy.level, []).append(copy)
    return table


@dataclass(frozen=True)
class StepSummary:
    """One step on one level at a glance: ``state`` (``damaged`` when a copy is, else
    ``incomplete`` when a node-local step lacks some node's part, else ``committed`` when a
    copy is, else ``protected`` when every part read holds its peers' replicas, else
    ``draining``), ``nodes`` (the nodes holding a part, node-local only) and
    ``missing_nodes`` (the nodes of the step without one, when every node was read)."""

    state: str
    nodes: list[int]
    missing_nodes: list[int]


def step_summary(copies: Sequence[LevelCopy], *, every_node: bool = False) -> StepSummary:
    """Sum up ``copies`` (one step, one level); ``every_node``: every node's root was read, so a
    node without a part is missing."""
    states = {copy.state for copy in copies}
    held = sorted({copy.node for copy in copies if copy.node is not None and copy.state != "draining"})
    counts = [copy.nodes for copy in copies if copy.nodes is not None]
    missing = sorted(set(range(max(counts))) - set(held)) if every_node and counts else []
    if "damaged" in states:
        state = "damaged"
    elif missing and states & {"committed", "protected"}:
        state = "incomplete"
    elif "committed" in states:
        state = "committed"
    elif "protected" in states:
        state = "protected"  # every part read holds its peers' replicas
    else:
        state = "draining"
    return StepSummary(state, held, missing)
