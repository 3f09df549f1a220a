"""The ``inspect`` and ``verify`` commands: summarize a checkpoint and check its digests and signature."""

from __future__ import annotations

import argparse
import json
from typing import Any, TextIO

import msgspec

from shardkeep.catalog import (
    missing_tier_problem,
    missing_tiers,
)
from shardkeep.cli.format import (
    check_tier_names,
    dash,
    human_bytes,
    limits_argument,
    limits_of,
    printable,
    summary,
    tier_location_argument,
    tier_locations,
)
from shardkeep.errors import (
    CheckpointNotFoundError,
    ConfigError,
    ShardkeepError,
    StorageError,
)
from shardkeep.integrity import SignaturePolicy
from shardkeep.manifest import IndexedManifest, Manifest
from shardkeep.verification import (
    CheckpointLocation,
    FileResolver,
    locate,
    read_checked_manifest,
    verify,
)


def add_inspect(commands: Any) -> None:
    """``shardkeep inspect``: summarize a checkpoint."""
    inspect = commands.add_parser(
        "inspect",
        help="summarize a checkpoint: tensors, dtypes, sizes, files, tiers, training fields",
        description="Print a committed checkpoint's summary from its manifest: step, epoch, model id, training "
        "fields, digest, tiers (and any whose location is missing), files, and its tensors with dtype, shape and "
        "size. No data is read and no digest is checked (shardkeep verify checks them). Exit 0 when the manifest "
        "is read; 2 when there is no checkpoint at PATH or it cannot be read.",
    )
    inspect.add_argument(
        "path", metavar="PATH", help="a committed checkpoint: a directory or a URL (s3://bucket/prefix/step_N)"
    )
    inspect.add_argument("--json", action="store_true", help="print the manifest and a summary as JSON")
    inspect.add_argument(
        "--max-tensors", type=int, default=40, metavar="N", help="list at most N tensors (default 40; 0 for none)"
    )
    inspect.add_argument("--all", action="store_true", help="list every tensor")
    tier_location_argument(inspect)
    limits_argument(inspect)


def add_verify(commands: Any) -> None:
    """``shardkeep verify``: check a checkpoint completely."""
    check = commands.add_parser(
        "verify",
        help="check the file set, sizes, digests and headers; exit 0 only if all is well",
        description="Check a committed checkpoint completely and print every problem. Exit 0 when the file set, "
        "every size, digest and header match the manifest (and, with --public-key, the signature is valid); 1 when "
        "a problem is found; 2 when there is no checkpoint at PATH, it cannot be read, a tier's location is "
        "missing (remap it with --tier-location), or the options are wrong. A valid signature proves who wrote the "
        "checkpoint, not that it is the newest one, nor that it was saved under this name.",
    )
    check.add_argument(
        "path", metavar="PATH", help="a committed checkpoint: a directory or a URL (s3://bucket/prefix/step_N)"
    )
    check.add_argument(
        "--tier",
        action="append",
        metavar="NAME",
        help="check only the files of this tier (repeatable; default: every tier)",
    )
    check.add_argument(
        "--public-key",
        metavar="PEM",
        help="require manifest.sig to be a valid signature by this Ed25519 public key (checked before the "
        "manifest is parsed)",
    )
    check.add_argument(
        "--allow-unsigned",
        action="store_true",
        help="with --public-key, accept a checkpoint without manifest.sig (a present one must still be valid)",
    )
    tier_location_argument(check)
    limits_argument(check)
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    check.add_argument("--quiet", "-q", action="store_true", help="print only problems")
    check.add_argument(
        "--progress",
        choices=("auto", "always", "never"),
        default="auto",
        help="show a progress bar on stderr (default: when stderr is a terminal)",
    )


def _print_inspect(
    manifest: Manifest, path: str, limit: int | None, out: TextIO, tier_notes: dict[str, str] | None = None
) -> None:
    info = summary(manifest)
    tier_notes = tier_notes or {}

    def w(text: str) -> None:
        out.write(printable(text))

    w(f"checkpoint   {path}\n")
    w(f"created      {manifest.created_at.isoformat()}   metadata_version {manifest.metadata_version}\n")
    w(f"model_id     {manifest.model_id or '-'}   step {dash(manifest.step)}   epoch {dash(manifest.epoch)}\n")
    w(
        f"sharding     {manifest.sharding.strategy}, world_size {manifest.world_size}, "
        f"{manifest.sharding.shard_count} shard file(s), precision {manifest.sharding.precision or '-'}\n"
    )
    w(
        f"training     learning_rate {dash(manifest.training.learning_rate)}   "
        f"optimizer {manifest.training.optimizer_type or '-'}\n"
    )
    if isinstance(manifest, IndexedManifest):
        w(
            f"format 2.x   {info['sharded_tensors']} sharded tensor(s) described once, "
            f"{info['rank_indexes']} rank index(es) (index/rank_NNNNN.json)\n"
        )
        for family in info["tensor_families"]:
            w(f"  family     {family['key']}  {family['instances']} instance(s)\n")
    w(f"digest       {manifest.digest_algorithm}\n")
    for tier in manifest.tiers:
        w(
            f"tier         {tier.name} (id {tier.tier_id}, {tier.placement_policy}, "
            f"budget {tier.size_budget or 'none'}, location {tier.location or 'with the manifest'})\n"
        )
        if tier.name in tier_notes:
            w(f"             {tier_notes[tier.name]}\n")
    w(f"files        {info['file_count']} file(s), {human_bytes(info['file_bytes'])}\n")
    for record in manifest.files:
        w(
            f"  {record.path}  rank {record.rank}  tier {record.tier}  v{record.version}  "
            f"{human_bytes(record.size)}  {len(record.tensors)} tensor(s)  {(record.digest or 'NO DIGEST')[:24]}..."
            + (f"  (unchanged: kept in {record.ref})" if record.ref else "")
            + "\n"
        )
    w(f"tensors      {info['tensor_count']} tensor(s), {human_bytes(info['tensor_bytes'])}\n")
    for name, stats in info["dtypes"].items():
        w(f"  {name:<12} {stats['count']:>8} tensor(s)  {human_bytes(stats['bytes'])}\n")
    entries = manifest.iter_tensors()
    shown = entries if limit is None else entries[:limit]
    if shown:
        width = min(60, max(len(entry.key) for _, entry in shown))
        for record, entry in shown:
            kind = f"expert{entry.expert_key}" if entry.kind == "expert" else "dense"
            w(
                f"  {entry.key:<{width}}  {entry.dtype:<6} {entry.shape!s:<18} {human_bytes(entry.nbytes):>10}  {kind}  {record.path}\n"
            )
        if len(shown) < len(entries):
            w(f"  ... {len(entries) - len(shown)} more (use --all)\n")
    w(f"values       {info['value_count']} JSON leaf/leaves\n")
    for value in manifest.values[: limit if limit is not None else len(manifest.values)]:
        rendered = value.special or json.dumps(value.value)
        w(f"  {value.key} = {rendered if len(rendered) < 80 else rendered[:77] + '...'}\n")
    if manifest.optim_state:
        w(f"optim_state  {', '.join(manifest.optim_state.prefixes)}\n")
    if manifest.router_state:
        w(f"router_state {', '.join(manifest.router_state.prefixes)}\n")
    if manifest.custom_fields:
        w(f"custom       {json.dumps(manifest.custom_fields, sort_keys=True)}\n")
    if manifest.metrics:
        w(f"metrics      {json.dumps(manifest.metrics, sort_keys=True)}\n")
    if manifest.run is not None:
        w(f"run          {manifest.run.run_id}   fingerprint {(manifest.run.fingerprint or '-')[:24]}\n")
    if manifest.unknown_fields:
        w(
            f"unknown      {len(manifest.unknown_fields)} field(s) from a newer minor version, ignored: {', '.join(manifest.unknown_fields)}\n"
        )


REMAP_HINT = "--tier-location {tier}=NEW_LOCATION"


def missing_tier_problems(
    location: CheckpointLocation, manifest: Manifest, remapped: dict[str, str], tiers: list[str] | None = None
) -> dict[str, str]:
    """One problem for each tier (of ``tiers``) whose location holds nothing of the checkpoint
    (one ``stat`` per tier; no file is opened)."""
    resolver = FileResolver(location, manifest, tier_locations=remapped)
    return {
        tier: missing_tier_problem(tier, found, REMAP_HINT, tier in remapped)
        for tier, found in missing_tiers(resolver, manifest, tiers).items()
    }


def run_inspect(args: argparse.Namespace, out: TextIO) -> int:
    location = locate(args.path)
    manifest = read_checked_manifest(location, SignaturePolicy(), limits_of(args))
    remapped = tier_locations(args)
    check_tier_names(manifest, args.path, None, remapped)
    missing = missing_tier_problems(location, manifest, remapped)
    notes = {name: f"read from {place} (--tier-location)" for name, place in remapped.items()} | missing
    if args.json:
        document = {
            "path": args.path,
            "summary": summary(manifest),
            "manifest": msgspec.to_builtins(manifest),
            "tier_locations": remapped,
            "missing_tiers": missing,
        }
        out.write(json.dumps(document, indent=2, sort_keys=True) + "\n")
        return 0
    limit = None if args.all else max(0, args.max_tensors)
    _print_inspect(manifest, args.path, limit, out, notes)
    return 0


def run_verify(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    if args.allow_unsigned and args.public_key is None:
        raise ConfigError("--allow-unsigned only applies with --public-key (the key a present signature must match)")
    policy = SignaturePolicy.of(args.public_key, False if args.allow_unsigned else None)
    remapped = tier_locations(args)
    location = locate(args.path)
    # Nothing to check at all (no checkpoint there, unreadable) is exit 2, not "corrupt", so the
    # manifest is read here first (as verify reads it: with a key, the signature before the
    # manifest is parsed); it also says which tiers are reachable. Damage to the manifest is
    # left to verify to report (exit 1).
    manifest = None
    try:
        manifest = read_checked_manifest(location, policy, limits_of(args), expand=False)
    except (CheckpointNotFoundError, StorageError):
        raise
    except ShardkeepError:
        manifest = None
    if isinstance(manifest, IndexedManifest):
        # A rank index that is missing or damaged is a problem of the checkpoint (exit 1), which
        # verify reports; only the manifest's absence means there is nothing to check (exit 2).
        try:
            manifest = read_checked_manifest(location, policy, limits_of(args))
        except StorageError:
            raise
        except ShardkeepError:
            manifest = None
    tiers = args.tier
    missing: dict[str, str] = {}  # tier -> the one problem to print for it
    if manifest is not None:
        check_tier_names(manifest, args.path, args.tier, remapped)
        missing = missing_tier_problems(location, manifest, remapped, args.tier)
        if missing:
            wanted = set(args.tier) if args.tier else {record.tier for record in manifest.files}
            tiers = sorted(wanted - set(missing))
    show_bar = args.progress == "always" or (args.progress == "auto" and err.isatty() and not args.json)
    bar = None
    on_bytes = None
    if show_bar:
        from tqdm import tqdm

        total = None
        if manifest is not None:
            chosen = set(tiers) if tiers is not None else None
            total = sum(record.size for record in manifest.files if chosen is None or record.tier in chosen)
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="verify", file=err, leave=False)
        on_bytes = bar.update
    try:
        report = verify(
            args.path,
            on_bytes=on_bytes,
            tiers=tiers,
            tier_locations=remapped,
            public_key=policy.public_key,
            require_signature=policy.required,
            limits=limits_of(args),
        )
    finally:
        if bar is not None:
            bar.close()
    code = 1 if report.problems else (2 if missing else 0)
    if args.json:
        document = {
            "path": report.path,
            "ok": report.ok and not missing,
            "problems": report.problems,
            "missing_tiers": missing,
            "warnings": report.warnings,
            "files_checked": report.files_checked,
            "bytes_checked": report.bytes_checked,
            "signature": report.signature,
        }
        out.write(json.dumps(document, indent=2) + "\n")
        return code
    for problem in report.problems:
        out.write(f"PROBLEM  {printable(problem)}\n")
    for problem in missing.values():
        out.write(f"MISSING  {printable(problem)}\n")
    if not args.quiet:
        for warning in report.warnings:
            out.write(f"warning  {printable(warning)}\n")
    checked = f"{report.files_checked} file(s), {human_bytes(report.bytes_checked)} verified"
    if report.problems:
        out.write(f"FAILED  {report.path}: {len(report.problems)} problem(s)\n")
    elif missing:
        out.write(
            f"INCOMPLETE  {report.path}: tier(s) {', '.join(missing)} could not be read; {checked} without a "
            f"problem; {report.signature}\n"
        )
    elif not args.quiet:
        out.write(f"OK  {report.path}: {checked}; {report.signature}\n")
    return code
