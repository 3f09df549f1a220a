"""The ``ledger status`` and ``ledger reassign`` commands: show and change a progress ledger."""

from __future__ import annotations

import argparse
import json
from typing import Any, TextIO

import msgspec

from shardkeep.cli.format import age, json_argument, printable, write_json
from shardkeep.errors import (
    LedgerNotFoundError,
)
from shardkeep.ledger import DEFAULT_STALENESS_SEC, MAX_ORPHANED_RETRIES, ProgressLedger


def add_ledger(commands: Any) -> None:
    """``shardkeep ledger status|reassign``: progress ledgers."""
    ledger = commands.add_parser(
        "ledger",
        help="show or change a progress ledger of a multi-worker batch job",
        description="Work with a ProgressLedger file (the per-shard progress of a sharded batch job).",
    )
    ledger_commands = ledger.add_subparsers(dest="ledger_command", required=True, metavar="ACTION")
    status = ledger_commands.add_parser(
        "status",
        help="a table per shard with totals; marks stale and orphaned shards",
        description="Print each shard's status, assigned worker, last recorded batch, sequences, age of the last "
        "batch and retries, with totals. STALE: in progress with no activity (a recorded batch, a claim or a reassignment) for longer than "
        "the threshold. "
        "ORPHANED: failed at least --max-retries times. Exit 0 when readable, 2 when it cannot be read (no valid "
        "copy, or PATH is a directory or missing).",
    )
    status.add_argument("path", metavar="PATH", help="the ledger's JSON file")
    status.add_argument("--json", action="store_true", help="print the ledger and the progress summary as JSON")
    status.add_argument(
        "--stale-after",
        type=float,
        default=DEFAULT_STALENESS_SEC,
        metavar="SECONDS",
        help=f"staleness threshold (default {DEFAULT_STALENESS_SEC:.0f})",
    )
    status.add_argument(
        "--max-retries",
        type=int,
        default=MAX_ORPHANED_RETRIES,
        metavar="N",
        help=f"failures after which a failed shard is orphaned (default {MAX_ORPHANED_RETRIES})",
    )
    reassign = ledger_commands.add_parser(
        "reassign",
        help="give a shard to another worker (its original rank is kept)",
        description="Assign SHARD to worker RANK. A failed shard becomes in progress again; a complete shard "
        "cannot be reassigned. The previous worker's later updates are refused when it passes worker=.",
    )
    reassign.add_argument("path", metavar="PATH", help="the ledger's JSON file")
    reassign.add_argument("shard", metavar="SHARD", type=int, help="the shard (its original rank)")
    reassign.add_argument("rank", metavar="RANK", type=int, help="the worker that takes it over")
    json_argument(reassign, "the shard, its previous and its new worker")


def _ledger_missing(path: str) -> LedgerNotFoundError:
    """The ledger's "not found" in command-line words (the library's names a Python call)."""
    return LedgerNotFoundError(f"no progress ledger at {path}; the batch job creates it when it starts: check the path")


def run_ledger_status(args: argparse.Namespace, out: TextIO) -> int:
    ledger = ProgressLedger(args.path, staleness_threshold_sec=args.stale_after, max_retries=args.max_retries)
    try:
        state = ledger.read()
    except LedgerNotFoundError as exc:
        raise _ledger_missing(args.path) from exc
    progress = ledger.progress_of(state)  # the table, totals and barrier come from one read
    if args.json:
        document = {"ledger": msgspec.to_builtins(state), "progress": progress}
        out.write(json.dumps(document, indent=2) + "\n")
        return 0

    def w(text: str) -> None:
        out.write(printable(text))

    now = ledger.clock()
    w(
        f"ledger  {args.path}   version {state.version}   sequence {state.sequence}   updated {state.updated_at.isoformat()}\n"
        f"run     input {state.input_fingerprint or '-'}   model {state.model_config_hash or '-'}\n"
    )
    w(
        f"{'SHARD':>5} {'ORIG':>4} {'WORKER':>6}  {'STATUS':<11} {'LAST BATCH':>10} {'BATCHES':>7} "
        f"{'SEQUENCES':>11} {'AGE':>6} {'RETRIES':>7}  MARKS / ERROR\n"
    )
    stale = set(progress["stale_shards"])
    orphaned = set(progress["orphaned_shards"])
    for key in sorted(state.shards, key=int):
        entry = state.shards[key]
        shard = int(key)
        activity = ledger.last_activity(entry)
        marks = []
        if shard in stale:
            marks.append("STALE")
        if shard in orphaned:
            marks.append("ORPHANED")
        if entry.assigned_rank != entry.original_rank:
            marks.append(f"reassigned {entry.original_rank}->{entry.assigned_rank}")
        if entry.error and entry.status == "failed":
            marks.append(f"error: {entry.error}")
        last = "-" if entry.last_checkpoint_batch < 0 else str(entry.last_checkpoint_batch)
        w(
            f"{shard:>5} {entry.original_rank:>4} {entry.assigned_rank:>6}  {entry.status:<11} {last:>10} "
            f"{len(entry.checkpoints):>7} {entry.total_sequences:>11,} {age(None if activity is None else now - activity):>6} "
            f"{entry.retry_count:>7}  {' '.join(marks) or '-'}\n"
        )
    w(
        f"total   {progress['total_shards']} shards: {progress['completed']} complete, {progress['in_progress']} in "
        f"progress, {progress['failed']} failed; {progress['stale']} stale, {progress['orphaned']} orphaned; "
        f"{progress['total_batches']:,} batches, {progress['total_sequences_checkpointed']:,} sequences\n"
    )
    if state.global_checkpoints:
        latest = state.global_checkpoints[-1]
        w(
            f"barrier {latest.checkpoint_id} at {latest.timestamp.isoformat()} "
            f"({len(state.global_checkpoints)} recorded)\n"
        )
    return 0


def run_ledger_reassign(args: argparse.Namespace, out: TextIO) -> int:
    ledger = ProgressLedger(args.path)
    try:
        before = ledger.get_shard_status(args.shard)
        ledger.reassign_shard(args.shard, args.rank)
    except LedgerNotFoundError as exc:
        raise _ledger_missing(args.path) from exc
    previous = before["assigned_rank"] if before else "?"
    if args.json:
        document = {
            "path": args.path,
            "shard": args.shard,
            "original_rank": before["original_rank"] if before else None,
            "previous_worker": before["assigned_rank"] if before else None,
            "worker": args.rank,
        }
        write_json(out, document)
        return 0
    out.write(
        f"shard {args.shard} (original rank {before['original_rank'] if before else '?'}): worker {previous} -> {args.rank}\n"
    )
    return 0
