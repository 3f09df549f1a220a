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
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from shardkeep.catalog import CheckpointRoot
from shardkeep.errors import ShardkeepError
from shardkeep.levels.local_catalog import scan
from shardkeep.names import MANIFEST_FILENAME, NODE_PART_FILENAME, STAGING_MARKER, is_derived_name, step_of_name
from shardkeep.storage import is_url, local_path

__all__ = ["CopyState", "LevelCopy", "is_node_local_root", "level_copies", "steps_table"]

CopyState = Literal["committed", "protected", "damaged", "draining", "unreachable"]


@dataclass(frozen=True)
class LevelCopy:
    """One copy of one step on one level: ``level``, ``name`` (``step_<N>`` or a staging name),
    ``step``, ``state``, ``detail`` (problems, the node's part, a staging's age), and for a
    node-local level the ``node`` whose part this is and the node ``nodes`` count."""

    level: str
    name: str
    step: int
    state: CopyState
    detail: str = ""
    node: int | None = None
    nodes: int | None = None

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


def node_local_copies(level: str, root: str, *, verify: bool = False) -> list[LevelCopy]:
    """The copies this node's part of a node-local level holds (see
    :func:`~shardkeep.levels.local_catalog.scan`)."""
    copies: list[LevelCopy] = []
    for found in scan(root, verify=verify):
        if found.state == "staging":
            copies.append(LevelCopy(level, found.name, found.step, "draining", f"a local save, {_age(found.age)}"))
            continue
        part = found.part
        node = part.node if part is not None else None
        nodes = part.nodes if part is not None else None
        if found.state == "damaged":
            detail = "; ".join(found.problems[:3])
        elif part is not None:
            ranks = ",".join(str(rank) for rank in part.ranks)
            checked = "files verified" if verify else "files not read"
            detail = f"node {part.node} of {part.nodes}: ranks {ranks}, {len(part.files)} files, {checked}"
            if part.healed:
                detail += f", {len(part.healed)} healed"
            if part.replicas:
                sources = ",".join(str(source) for source in sorted(part.replicas))
                detail += f", replicas of node(s) {sources}"
        else:
            detail = ""
        state: CopyState = "damaged" if found.state == "damaged" else "committed"
        if state == "committed" and part is not None and part.replicas:
            state = "protected"
        copies.append(LevelCopy(level, found.name, found.step, state, detail, node, nodes))
    return copies


def shared_copies(
    level: str, root: str, *, verify: bool = False, storage_options: Mapping[str, Any] | None = None
) -> list[LevelCopy]:
    """The copies a shared level (a managed root, local or ``s3://``) holds."""
    catalog = CheckpointRoot.at(root, storage_options=storage_options)
    found = catalog.scan()
    copies: list[LevelCopy] = []
    for item in found:
        if verify:
            catalog.verify_fully(item)
        problems = list(item.problems)
        state: CopyState = "damaged" if problems else "committed"
        detail = "; ".join(problems[:3]) if problems else ("verified" if verify else "files present, not read")
        copies.append(LevelCopy(level, item.name, item.step, state, detail))
    for name, idle in catalog.leftovers():
        if not is_derived_name(name, STAGING_MARKER):
            continue
        step = step_of_name(name.rpartition(STAGING_MARKER)[0])
        if step is not None:
            copies.append(LevelCopy(level, name, step, "draining", f"staging, {_age(idle)}"))
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
    ``None``, when the root holds node parts). A level that cannot be read gives one
    ``unreachable`` entry with the reason."""
    try:
        if node_local if node_local is not None else is_node_local_root(root):
            return node_local_copies(level, root, verify=verify)
        return shared_copies(level, root, verify=verify, storage_options=storage_options)
    except ShardkeepError as exc:
        return [LevelCopy(level, "", -1, "unreachable", f"{type(exc).__name__}: {exc}")]


def steps_table(copies: Sequence[LevelCopy]) -> dict[int, dict[str, list[LevelCopy]]]:
    """``copies`` by step, newest first, then by level."""
    table: dict[int, dict[str, list[LevelCopy]]] = {}
    for copy in sorted(copies, key=lambda c: -c.step):
        table.setdefault(copy.step, {}).setdefault(copy.level, []).append(copy)
    return table
