"""``shardkeep ls --level NAME=ROOT ...``: every level of a multi-level setup, with each step's
copies and their state (committed, protected, draining, damaged)."""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from shardkeep.cli.format import printable, write_json
from shardkeep.errors import ConfigError
from shardkeep.levels.status import LevelCopy, level_copies, steps_table


def add_level_arguments(listing: Any) -> None:
    """The ``--level`` and ``--node-local`` options of ``ls``."""
    listing.add_argument(
        "--level",
        action="append",
        default=[],
        metavar="NAME=ROOT",
        help="list a level of a MultiLevelManager instead of one root (repeatable, in the manager's order): each "
        "step's copies on every level and their state (committed, protected: with its peer replicas, draining, "
        "damaged). A root holding node parts "
        "(node-part.json) is read as this node's part of a node-local level",
    )


def parse_levels(specs: list[str]) -> list[tuple[str, str]]:
    """``NAME=ROOT`` pairs, refusing a malformed one or a name given twice."""
    levels: list[tuple[str, str]] = []
    for spec in specs:
        name, sep, root = spec.partition("=")
        if not sep or not name or not root:
            raise ConfigError(f"--level {spec!r} must be NAME=ROOT (for example local=/local_ssd/ckpt)")
        if name in {known for known, _ in levels}:
            raise ConfigError(f"--level {name!r} is given twice")
        levels.append((name, root))
    return levels


def run_ls_levels(args: argparse.Namespace, out: TextIO) -> int:
    """List every level; exit 1 when a copy is damaged or a level cannot be read, else 0."""
    if args.root is not None:
        raise ConfigError("give either ROOT or --level NAME=ROOT ..., not both")
    levels = parse_levels(args.level)
    copies: list[LevelCopy] = []
    for name, root in levels:
        copies.extend(level_copies(name, root, verify=args.verify))
    bad = any(copy.state in ("damaged", "unreachable") for copy in copies)
    table = steps_table([copy for copy in copies if copy.state != "unreachable"])
    unreachable = {copy.level: copy.detail for copy in copies if copy.state == "unreachable"}
    if args.json:
        write_json(
            out,
            {
                "levels": [{"name": name, "root": root, "unreachable": unreachable.get(name)} for name, root in levels],
                "digests_checked": bool(args.verify),
                "steps": [
                    {
                        "step": step,
                        "copies": {level: [copy.document() for copy in found] for level, found in row.items()},
                    }
                    for step, row in table.items()
                ],
            },
        )
        return 1 if bad else 0
    w = out.write
    for name, root in levels:
        w(
            printable(
                f"level   {name:<12} {root}{'   UNREACHABLE: ' + unreachable[name] if name in unreachable else ''}\n"
            )
        )
    width = max(12, *(len(name) for name, _ in levels))
    w(f"{'STEP':>10}  " + "  ".join(f"{name:<{width}}" for name, _ in levels) + "\n")
    details: list[str] = []
    for step, row in table.items():
        cells = []
        for name, _ in levels:
            found = row.get(name, [])
            cells.append(f"{(', '.join(sorted({copy.state for copy in found})) or '-'):<{width}}")
            details += [f"  step {step} {name}: {copy.state} ({copy.detail})" for copy in found if copy.detail]
        w(f"{step:>10}  " + "  ".join(cells) + "\n")
    for line in details:
        w(printable(line) + "\n")
    if not args.verify:
        w("note    without --verify only manifests and file sets are checked; --verify reads every file\n")
    return 1 if bad else 0
