"""``shardkeep ls --level NAME=ROOT ...``: every level of a multi-level setup, with each step's
copies and their state (committed, protected, draining, damaged)."""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from shardkeep.cli.format import printable, write_json
from shardkeep.errors import ConfigError
from shardkeep.levels.status import NODE_FIELD, LevelCopy, level_copies, step_summary, steps_table


def add_level_arguments(listing: Any) -> None:
    """The ``--level`` and ``--node-local`` options of ``ls``."""
    listing.add_argument(
        "--level",
        action="append",
        default=[],
        metavar="NAME=ROOT",
        help="list a level of a MultiLevelManager instead of one root (repeatable, in the manager's order): each "
        "step's copies on every level and their state (committed, protected: with its peer replicas, draining, "
        "damaged). A root holding node parts (node-part.json) is read as this node's part of a node-local level; "
        "a root with {node} (/tmp/run/node{node}) is read for every node",
    )


def parse_levels(specs: list[str]) -> list[tuple[str, str]]:
    """``NAME=ROOT`` pairs, refusing a malformed one, a name given twice or a root given twice."""
    levels: list[tuple[str, str]] = []
    for spec in specs:
        name, sep, root = spec.partition("=")
        name, root = name.strip(), root.strip()
        if not sep or not name or not root:
            raise ConfigError(f"--level {spec!r} must be NAME=ROOT (for example local=/local_ssd/ckpt)")
        if name in {known for known, _ in levels}:
            raise ConfigError(f"--level {spec!r}: level {name!r} is given twice")
        if root in {known for _, known in levels}:
            raise ConfigError(f"--level {spec!r}: root {root!r} is given for two levels")
        levels.append((name, root))
    return levels


def _level_document(name: str, root: str, copies: list[LevelCopy]) -> dict[str, Any]:
    """One level of ``ls --level --json``: its name and root, how it was read, and why not."""
    nodes = max((copy.nodes for copy in copies if copy.nodes is not None), default=None)
    unreachable = next((copy.detail for copy in copies if copy.state == "unreachable"), None)
    return {
        "name": name,
        "root": root,
        "node_local": nodes is not None or NODE_FIELD in root,
        "every_node": NODE_FIELD in root,
        "nodes": nodes,
        "unreachable": unreachable,
    }


def _step_cell(copies: list[LevelCopy], every_node: bool) -> str:
    """A level's cell of a step's row: its state, and on a node-local level its nodes."""
    if not copies:
        return "-"
    summary = step_summary(copies, every_node=every_node)
    if summary.missing_nodes:
        return f"{summary.state} (no part on node {','.join(map(str, summary.missing_nodes))})"
    nodes = max((copy.nodes for copy in copies if copy.nodes is not None), default=None)
    if nodes is not None and summary.state != "draining":
        if every_node:
            return f"{summary.state} ({len(summary.nodes)}/{nodes} nodes)"
        return f"{summary.state} (node {','.join(map(str, summary.nodes))}'s part of {nodes})"
    return summary.state


def run_ls_levels(args: argparse.Namespace, out: TextIO) -> int:
    """List every level; exit 1 when a copy is damaged or a level cannot be read, else 0."""
    if args.root is not None:
        raise ConfigError(
            f"give either ROOT ({args.root}) or --level NAME=ROOT ..., not both: with --level, name the shared "
            "level's root as one more --level"
        )
    levels = parse_levels(args.level)
    by_level = {name: level_copies(name, root, verify=args.verify) for name, root in levels}
    copies = [copy for found in by_level.values() for copy in found]
    bad = any(copy.state in ("damaged", "unreachable") for copy in copies)
    table = steps_table([copy for copy in copies if copy.state != "unreachable"])
    documents = [_level_document(name, root, by_level[name]) for name, root in levels]
    every_node = {document["name"]: bool(document["every_node"]) for document in documents}
    if args.json:
        steps = []
        for step, row in table.items():
            entry: dict[str, Any] = {}
            for name, found in row.items():
                summary = step_summary(found, every_node=every_node[name])
                entry[name] = {
                    "state": summary.state,
                    "nodes": summary.nodes if any(copy.nodes is not None for copy in found) else None,
                    "missing_nodes": summary.missing_nodes,
                    "copies": [copy.document() for copy in found],
                }
            steps.append({"step": step, "levels": entry})
        write_json(out, {"levels": documents, "digests_checked": bool(args.verify), "steps": steps, "ok": not bad})
        return 1 if bad else 0
    _write_levels_text(out, documents, table, every_node, verify=bool(args.verify))
    return 1 if bad else 0


def _write_levels_text(
    out: TextIO,
    documents: list[dict[str, Any]],
    table: dict[int, dict[str, list[LevelCopy]]],
    every_node: dict[str, bool],
    *,
    verify: bool,
) -> None:
    """The text of ``ls --level``: the levels, one row per step, then each copy's detail."""
    w = out.write
    names = [str(document["name"]) for document in documents]
    label = max(12, *(len(name) for name in names))
    for document in documents:
        how = ""
        if document["unreachable"] is not None:
            how = f"   UNREACHABLE: {document['unreachable']}"
        elif document["every_node"]:
            count = int(document["nodes"] or 0)
            how = f"   node-local, every node read ({count} node{'s' if count != 1 else ''})"
        elif document["node_local"]:
            how = "   node-local: this node's part only (use {node} in ROOT to read every node's root)"
        w(printable(f"level   {document['name']:<{label}} {document['root']}{how}\n"))
    rows = [(step, [_step_cell(row.get(name, []), every_node[name]) for name in names]) for step, row in table.items()]
    width = max([label, *(len(cell) for _, cells in rows for cell in cells)])
    w(f"{'STEP':>10}  " + "  ".join(f"{name:<{width}}" for name in names).rstrip() + "\n")
    for step, cells in rows:
        w(f"{step:>10}  " + "  ".join(f"{cell:<{width}}" for cell in cells).rstrip() + "\n")
    if not rows:
        w("(no step on any level)\n")
    for step, row in table.items():
        for name in names:
            for copy in row.get(name, []):
                if copy.detail:
                    w(printable(f"  step {step} {name} {copy.name}: {copy.state} ({copy.detail})\n"))
    if not verify:
        w("note    without --verify only manifests and file sets are checked; --verify reads every file\n")
