"""The ``ls`` and ``prune`` commands: the checkpoints of a root, their state, and retention."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from typing import Any, TextIO

import msgspec

from shardkeep.catalog import (
    DEFAULT_LEASE,
    CheckpointEntry,
    CheckpointRoot,
)
from shardkeep.cli.checkpoints import REMAP_HINT
from shardkeep.cli.format import (
    age,
    human_bytes,
    json_argument,
    limits_argument,
    limits_of,
    policy_arguments,
    printable,
    tier_location_argument,
    tier_locations,
    write_json,
)
from shardkeep.cli.levels import add_level_arguments, run_ls_levels
from shardkeep.errors import (
    CheckpointNotFoundError,
    ConfigError,
    ShardkeepError,
)
from shardkeep.manifest import DELETING_MARKER, MANIFEST_FILENAME, is_staging_name
from shardkeep.names import is_derived_name, step_of_name
from shardkeep.retention import RetentionDecision, RetentionPolicy


def add_ls(commands: Any) -> None:
    """``shardkeep ls``: list the checkpoints of a root."""
    listing = commands.add_parser(
        "ls",
        help="list the checkpoints in a root (step, metric, size, last/best marks, verification state), or each "
        "level's copies of every step (--level)",
        description="List the committed checkpoints (step_<N> directories: step_ and the step in digits, e.g. "
        "step_100 or step_00000100) of a checkpoint-manager root. Marks and "
        "the policy come from the manifests (the newest one records the manager's policy); --keep-last/--keep-best/"
        "--metric/--mode override it, and --keep-period/--keep-interval add to it (manifests do not record "
        "those two). Without --verify only the manifests, file sets and sizes are checked (every "
        "tier's files too, wherever they are kept): such a "
        "checkpoint is listed as 'unverified', and the last/best marks are what the manager would keep if its data "
        "is sound. A checkpoint whose name disagrees with the step in its manifest (renamed or copied) is flagged "
        "and never marked. Exit 0 when every check passes, 1 if a checkpoint is corrupt or misnamed, 2 when ROOT "
        "holds no checkpoints (or is a checkpoint itself) or cannot be read, or a checkpoint's tier location is "
        "missing (remap it with --tier-location). With --level NAME=ROOT (repeated, instead of ROOT) it lists "
        "the levels of a MultiLevelManager: one row per step, each level's copies of it and their state "
        "(committed, draining, damaged; on a node-local level, which nodes hold a part); exit 1 when a copy is "
        "damaged or a level cannot be read.",
    )
    listing.add_argument(
        "root",
        metavar="ROOT",
        nargs="?",
        help="a directory or URL (s3://bucket/prefix) of step_<N> checkpoints (or give --level NAME=ROOT ...)",
    )
    add_level_arguments(listing)
    listing.add_argument(
        "--verify",
        action="store_true",
        help="check every digest (reads everything); without it the state is a quick check",
    )
    listing.add_argument("--json", action="store_true", help="print the entries as JSON")
    listing.add_argument(
        "--plot",
        metavar="PNG",
        help="also draw the metric over steps (with the saves retention deleted), the kept last/best checkpoints, "
        "and the time each save blocked training, into this PNG file (needs matplotlib: shardkeep[plot])",
    )
    policy_arguments(listing)
    tier_location_argument(listing)
    limits_argument(listing)


def add_prune(commands: Any) -> None:
    """``shardkeep prune``: apply a retention policy to a root."""
    prune = commands.add_parser(
        "prune",
        help="delete checkpoints that the retention policy no longer keeps (dry run unless --apply)",
        description="Apply a retention policy to a root. Without --apply, only print what would be deleted. "
        "Never deletes the newest verified checkpoint, another run's checkpoints, or one whose manifest is "
        "unreadable, nor any file that a kept checkpoint references (incremental saves). Deletion un-commits a "
        "checkpoint first (a rename to <name>.deleting-<uuid>, or removing its manifest on an object store or "
        "when later checkpoints reference its files), then removes what nothing references. Exit 2 when ROOT holds "
        "no checkpoints and no leftovers of unfinished saves (or is a checkpoint itself) or cannot be read.",
    )
    prune.add_argument("root", metavar="ROOT", help="a directory or URL (s3://bucket/prefix) of step_<N> checkpoints")
    prune.add_argument("--apply", action="store_true", help="delete for real (default: dry run)")
    limits_argument(prune)
    prune.add_argument(
        "--lease",
        type=float,
        default=DEFAULT_LEASE,
        metavar="SECONDS",
        help="with --apply, also remove leftovers of unfinished saves (staging directories, unused attempt-<id>/ "
        f"prefixes, unfinished multipart uploads) untouched for this long (default {DEFAULT_LEASE:.0f}); "
        "<name>.deleting-<id> directories of unfinished deletions are removed whatever their age",
    )
    policy_arguments(prune)
    json_argument(prune, "the policy, what is kept, what is (or would be) deleted")


def _open_root(args: argparse.Namespace, *, allow_empty: bool = False) -> tuple[CheckpointRoot, list[Any]]:
    """The root ROOT names and its checkpoints; a usage error (exit 2) when it holds none (unless
    ``allow_empty``: a root holding only leftovers of unfinished saves), or is a checkpoint
    itself, saying what is there instead."""
    remapped = tier_locations(args) if hasattr(args, "tier_location") else {}
    root = CheckpointRoot.at(args.root, tier_locations=remapped, remap_hint=REMAP_HINT, limits=limits_of(args))
    found = root.scan()
    if not found and not (allow_empty and _leftovers(root)):
        raise CheckpointNotFoundError(_nothing_in(root, args))
    if remapped:
        defined = {tier.name for item in found if item.manifest is not None for tier in item.manifest.tiers}
        unknown = sorted(set(remapped) - defined)
        if unknown:
            raise ConfigError(
                f"--tier-location {', '.join(unknown)}: no checkpoint in {root.display} has such a tier; "
                f"their tiers are {', '.join(sorted(defined)) or 'none'}"
            )
    return root, found


def _leftovers(root: CheckpointRoot) -> list[str]:
    """The names of unfinished saves' staging directories and of unfinished deletions."""
    return [name for name, _ in root.leftovers()]


def _nothing_in(root: CheckpointRoot, args: argparse.Namespace) -> str:
    """What ROOT holds when it holds no checkpoints."""
    display = root.display
    parent = display.rstrip("/").rpartition("/")[0] or "/"
    info = root.store.stat(MANIFEST_FILENAME)
    if info is not None and info.kind == "file":
        return (
            f"{display} is a checkpoint, not a root of checkpoints; use `shardkeep inspect {display}` or "
            f"`shardkeep verify {display}` for it, or `shardkeep {args.command} {parent}` for the root it is in"
        )
    entries = root.store.list_dir("")
    leftovers = [name for name, _ in entries if is_staging_name(name)]
    roots = []
    other_names = []
    for name, entry in entries[:200]:
        if entry.kind != "dir" or step_of_name(name) is not None or name in leftovers:
            continue
        try:
            if root.store.stat(f"{name}/{MANIFEST_FILENAME}") is not None:
                other_names.append(name)
            elif any(step_of_name(child) is not None for child, _ in root.store.list_dir(name)):
                roots.append(f"{display}/{name}")
        except ShardkeepError:
            continue
    text = (
        f"no checkpoints under {display} (no step_<N> directory with a manifest: step_ and the step in ASCII "
        "digits, e.g. step_100 or step_00000100)"
    )
    if other_names:
        text += (
            f"; checkpoints under other names are not listed: {', '.join(other_names[:5])}"
            f"{' ...' if len(other_names) > 5 else ''} (rename them step_<N>)"
        )
    if not entries:
        text += ": the directory is empty"
    if leftovers:
        text += f"; {len(leftovers)} leftover(s) of unfinished saves or deletions: {', '.join(leftovers[:3])}"
    if roots:
        text += f"; roots of checkpoints below it: {', '.join(roots[:5])}"
    if getattr(args, "plot", None):
        text += "; nothing to plot"
    return text


def _policy_for(
    args: argparse.Namespace, root: CheckpointRoot, found: list[Any], run: str | None
) -> tuple[RetentionPolicy, str]:
    """The policy to apply and where it comes from (the manifests, the options, or defaults)."""
    record = root.policy_record(found, run)
    recorded = record[0] if record is not None else RetentionPolicy()
    given = [args.keep_last, args.keep_best, args.metric, args.mode]
    # keep_period and keep_interval_seconds are not recorded in manifests: only the options set them.
    scheduled = [args.keep_period, args.keep_interval]
    policy = RetentionPolicy(
        keep_last=recorded.keep_last if args.keep_last is None else args.keep_last,
        keep_best=recorded.keep_best if args.keep_best is None else args.keep_best,
        metric=args.metric or recorded.metric,
        mode=args.mode or recorded.mode,
        keep_period=args.keep_period,
        keep_interval_seconds=args.keep_interval,
    )
    any_given = any(value is not None for value in given + scheduled)
    if all(value is not None for value in given):
        source = "from the options"
    elif record is not None:
        source = f"recorded by {record[1]}" + (", with the options given" if any_given else "")
    else:
        source = "no checkpoint records a policy: " + (
            "the options given, defaults for the rest" if any_given else "defaults"
        )
    return policy, source


def _policy_words(policy: RetentionPolicy) -> str:
    """The policy on one line of ``ls`` and ``prune``."""
    words = f"keep_last={policy.keep_last} keep_best={policy.keep_best} metric={policy.metric} mode={policy.mode}"
    if policy.keep_period is not None:
        words += f" keep_period={policy.keep_period}"
    if policy.keep_interval_seconds is not None:
        words += f" keep_interval={policy.keep_interval_seconds:g}s"
    return words


def _marks(entry: CheckpointEntry, decision: RetentionDecision, scoped: bool) -> str:
    marks = [name for name, on in (("last", entry.is_last), ("best", entry.is_best)) if on]
    marks += [
        mark
        for mark, names in (("period", decision.periodic), ("interval", decision.per_interval))
        if entry.name in names
    ]
    if entry.is_newest and not entry.is_last:
        marks.append("newest")
    if entry.name in decision.delete:
        marks.append("prunable")
    if not scoped:
        marks.append("other-run")
    return ",".join(marks) or "-"


def _state_word(entry: CheckpointEntry) -> str:
    """``verified``, ``unverified`` (quick check only), ``corrupt``, ``misnamed`` (renamed or
    copied), or ``unreadable`` (only a tier's location is missing)."""
    if entry.misnamed:
        return "misnamed"
    if entry.verified is False:
        return "unreadable" if len(entry.problems) == len(entry.missing_tiers) else "corrupt"
    return "verified" if entry.verified else "unverified"


def _state(entry: CheckpointEntry) -> str:
    word = _state_word(entry)
    if word in ("misnamed", "corrupt", "unreadable"):
        return f"{word.upper()}: " + (entry.problems[0] if entry.problems else "?")
    return word


def _ls_status(entries: list[CheckpointEntry]) -> int:
    """1 when a checkpoint is corrupt or misnamed; else 2 when one could not be read whole."""
    states = {_state_word(entry) for entry in entries}
    if states & {"corrupt", "misnamed"}:
        return 1
    return 2 if "unreadable" in states else 0


def _runs_line(entries: list[CheckpointEntry], run: str | None) -> str | None:
    """A note when the root holds checkpoints of more than one run."""
    counts = Counter(entry.run_id for entry in entries if entry.run_id is not None and not entry.misnamed)
    if len(counts) < 2:
        return None
    listed = ", ".join(f"{name} ({count})" for name, count in counts.most_common(5))
    return f"runs    {len(counts)} runs in this root: {listed}; marks are for run {run or '-'} (--run to choose)\n"


def run_ls(args: argparse.Namespace, out: TextIO) -> int:
    if args.level:
        return run_ls_levels(args, out)
    if args.root is None:
        raise ConfigError("ls needs ROOT (a directory or URL of checkpoints) or --level NAME=ROOT ...")
    root, found = _open_root(args)
    run = args.run or root.owner(found)
    policy, source = _policy_for(args, root, found, run)
    if args.verify:
        for item in found:
            root.verify_fully(item)
    entries, decision = root.decide(found, policy, run, verify_newest=False)
    leftovers = _leftovers(root)
    pointers = {name: root.read_pointer(name) for name in ("last", "best")}
    status = _ls_status(entries)
    unverified = any(entry.verified is None for entry in entries)
    plotted = None
    if args.plot:
        from shardkeep.report import plot_root  # imports matplotlib

        title = f"{root.display}   run {run or '-'}"
        if not args.verify:
            title += "\nquick check only: digests not verified (shardkeep ls --verify checks them)"
        # A misnamed checkpoint's step is not the one its name says: it has no place on the curve.
        plotted = plot_root([entry for entry in entries if not entry.misnamed], policy, run, args.plot, title=title)
    if args.json:
        document = {
            "root": root.display,
            "run": run,
            "digests_checked": bool(args.verify),
            "policy": _policy_document(policy, source),
            "checkpoints": [_entry_document(entry, decision) for entry in entries],
            "pointers": pointers,
            "leftovers": leftovers,
            "plot": plotted.path if plotted else None,
        }
        out.write(json.dumps(document, indent=2) + "\n")
        return status

    def w(text: str) -> None:
        out.write(printable(text))

    w(f"root    {root.display}\n")
    w(f"policy  {_policy_words(policy)}   ({source})   run {run or '-'}\n")
    runs = _runs_line(entries, run)
    if runs:
        w(runs)
    metric_header = policy.metric[:16]
    w(
        f"{'NAME':<16} {'STEP':>10} {metric_header:>16} {'SIZE':>10} {'BLOCKED':>9}  {'MARKS':<22} {'CREATED':<20} STATE\n"
    )
    for entry in entries:
        metric = "-" if entry.metric is None else f"{entry.metric:.6g}"
        created = entry.created_at.strftime("%Y-%m-%d %H:%M:%S") if entry.created_at else "-"
        scoped = run is None or entry.run_id == run or entry.manifest is None
        timing = entry.manifest.timing if entry.manifest is not None else None
        blocked = f"{timing.blocked_seconds:.3f}s" if timing is not None else "-"
        w(
            f"{entry.name:<16} {entry.step:>10} {metric:>16} {human_bytes(entry.size):>10} {blocked:>9}  "
            f"{_marks(entry, decision, scoped):<22} {created:<20} {_state(entry)}\n"
        )
        for problem in entry.problems[1:3]:
            w(f"{'':<16} {'':>10} {'':>16} {'':>10} {'':>9}  {_state_word(entry).upper()}: {problem}\n")
        if len(entry.problems) > 3:
            w(f"{'':<70} ... {len(entry.problems) - 3} more problem(s): shardkeep verify {entry.path}\n")
    for name, pointer in pointers.items():
        target = pointer.get("checkpoint") if pointer else None
        expected = decision.newest_verified if name == "last" else (decision.best[0] if decision.best else None)
        agreement = "current" if target == expected else f"stale (truth: {expected or 'none'})"
        w(f"pointer {name} -> {target or 'none'}  {agreement}\n")
    if leftovers:
        w(f"leftovers {len(leftovers)}: {', '.join(leftovers[:5])}{' ...' if len(leftovers) > 5 else ''}\n")
    if plotted is not None:
        w(
            f"plot    {plotted.path}: {plotted.saves} save{'s' if plotted.saves != 1 else ''} ({plotted.kept} still "
            f"present); saves blocked training "
            f"{plotted.blocked_seconds:.2f} s of {plotted.total_seconds:.2f} s in all\n"
        )
    if unverified:
        w(
            "note    unverified: only the manifest, the file set and the sizes (in every tier's location too) were "
            "checked, not the data; last/best/newest assume the data is sound. --verify checks every digest (reads "
            "everything).\n"
        )
    return status


def _entry_document(entry: CheckpointEntry, decision: RetentionDecision) -> dict[str, Any]:
    """One checkpoint of ``ls --json``."""
    return {
        "name": entry.name,
        "path": entry.path,
        "step": entry.step,
        "metric": entry.metric,
        "metrics": dict(entry.metrics),
        "size": entry.size,
        "is_last": entry.is_last,
        "is_best": entry.is_best,
        "is_newest": entry.is_newest,
        "prunable": entry.name in decision.delete,
        "is_periodic": entry.name in decision.periodic,
        "is_per_interval": entry.name in decision.per_interval,
        "state": _state_word(entry),
        "verified": entry.verified,
        "misnamed": entry.misnamed,
        "missing_tiers": list(entry.missing_tiers),
        "problems": list(entry.problems),
        "run_id": entry.run_id,
        "created_at": entry.created_at.isoformat() if entry.created_at else None,
        "timing": msgspec.to_builtins(entry.manifest.timing) if entry.manifest else None,
    }


def _policy_document(policy: RetentionPolicy, source: str) -> dict[str, Any]:
    """The retention policy as ``ls --json`` and ``prune --json`` print it."""
    return {
        "keep_last": policy.keep_last,
        "keep_best": policy.keep_best,
        "metric": policy.metric,
        "mode": policy.mode,
        "keep_period": policy.keep_period,
        "keep_interval_seconds": policy.keep_interval_seconds,
        "source": source,
    }


def run_prune(args: argparse.Namespace, out: TextIO) -> int:
    root, found = _open_root(args, allow_empty=True)
    run = args.run or root.owner(found)
    policy, source = _policy_for(args, root, found, run)
    entries, decision = root.decide(found, policy, run, verify_newest=True)
    left_alone = [(entry.name, entry.problems[0]) for entry in entries if entry.misnamed or entry.missing_tiers]
    pending = root.leftovers()
    leftovers = [name for name, _ in pending]
    removed: list[str] = []
    if args.apply:
        if found:  # a root holding only leftovers has no checkpoint to decide on, nor pointers
            root.apply(decision)
            root.write_pointers(entries, decision, policy.metric)
        removed = list(root.collect_leftovers(lease=args.lease))
    if args.json:
        document = {
            "root": root.display,
            "run": run,
            "applied": bool(args.apply),
            "policy": _policy_document(policy, source),
            "keep": list(decision.keep),
            "delete": list(decision.delete),
            "left_alone": [{"name": name, "reason": reason} for name, reason in left_alone],
            "leftovers": leftovers,
            "leftovers_due": [name for name, idle in pending if _leftover_due(name, idle, args.lease)],
            "leftovers_removed": removed,
        }
        write_json(out, document)
        return 0
    verb = "deleted" if args.apply else "would delete"
    out.write(printable(f"policy {_policy_words(policy)}   ({source})   run {run or '-'}\n"))
    for name in decision.keep:
        out.write(printable(f"keep          {name}\n"))
    for name in decision.delete:
        out.write(printable(f"{verb:<13} {name}\n"))
    for name, reason in left_alone:
        out.write(printable(f"leave alone   {name}: {reason}\n"))
    if not args.apply:
        for name, idle in pending:
            out.write(printable(_leftover_line(name, idle, args.lease)))
        out.write(
            f"dry run: {len(decision.delete)} checkpoint(s) would be deleted; {len(leftovers)} leftover(s) of "
            "unfinished saves or deletions (--apply removes those of deletions at once, of saves once unchanged "
            "for --lease seconds); pass --apply to delete them\n"
        )
        return 0
    out.write(f"deleted {len(decision.delete)} checkpoint(s), removed {len(removed)} leftover(s)\n")
    return 0


def _leftover_due(name: str, idle: float | None, lease: float) -> bool:
    """Whether ``prune --apply`` removes leftover ``name`` now (``idle``: seconds unchanged)."""
    return is_derived_name(name, DELETING_MARKER) or (idle is not None and idle >= lease)


def _leftover_line(name: str, idle: float | None, lease: float) -> str:
    """What ``prune --apply`` would do with leftover ``name`` (``idle``: seconds unchanged)."""
    if is_derived_name(name, DELETING_MARKER):
        return f"would remove  {name} (being deleted: removed whatever its age)\n"
    if idle is None:
        return f"would wait    {name} (staging: cannot be read now; left for a later pass)\n"
    if idle >= lease:
        return f"would remove  {name} (staging: unchanged for {age(idle)}, lease {age(lease)})\n"
    return f"would wait    {name} (staging: changed {age(idle)} ago; removed once unchanged for {age(lease)})\n"
