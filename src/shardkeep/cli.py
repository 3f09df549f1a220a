"""The ``shardkeep`` command line: argument parsing and printing. Imports without torch (``import``
and ``export`` load it when they run).

Exit status, for every command: 0 on success, 1 when a check finds a problem (``verify``, ``ls``),
2 on bad usage, or when the path is not what the command needs (no checkpoint there, a checkpoint
given as a root, a root without checkpoints) or cannot be read (permissions, a tier location that
is gone). Messages name the command-line flags, never the Python keyword arguments behind them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

import msgspec

from shardkeep.catalog import (
    DEFAULT_LEASE,
    CheckpointEntry,
    CheckpointRoot,
    missing_tier_problem,
    missing_tiers,
)
from shardkeep.config import ManifestLimits, WriteOptions
from shardkeep.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
    LedgerNotFoundError,
    ShardkeepError,
    StorageError,
    import_needing_torch,
)
from shardkeep.integrity import PASSPHRASE_ENV, SignaturePolicy, generate_key_pair
from shardkeep.ledger import DEFAULT_STALENESS_SEC, MAX_ORPHANED_RETRIES, ProgressLedger
from shardkeep.manifest import DELETING_MARKER, MANIFEST_FILENAME, IndexedManifest, Manifest, is_staging_name
from shardkeep.names import is_derived_name, step_of_name
from shardkeep.retention import RetentionDecision, RetentionPolicy
from shardkeep.verification import (
    CheckpointLocation,
    FileResolver,
    locate,
    read_checked_manifest,
    sign_checkpoint,
    verify,
)

__all__ = ["build_parser", "main"]


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("shardkeep")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardkeep",
        description="Inspect, verify, sign, list and prune shardkeep checkpoints; import and export other formats; "
        "show and change progress ledgers.",
        epilog="Exit status (every command): 0 success; 1 a check found problems (verify, ls); 2 usage error, or "
        "the path is not what the command needs (no checkpoint there, a checkpoint where a root of checkpoints is "
        "expected, a root without checkpoints) or cannot be read (permissions, a tier location that is gone). "
        "Paths may be s3:// URLs: credentials and endpoint come from the standard AWS environment variables "
        "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_REGION).",
    )
    parser.add_argument("--version", action="version", version=f"shardkeep {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _add_inspect(commands)
    _add_verify(commands)
    _add_keygen(commands)
    _add_sign(commands)
    _add_import_command(commands)
    _add_export_command(commands)
    _add_ls(commands)
    _add_prune(commands)
    _add_ledger(commands)
    return parser


def _add_inspect(commands: Any) -> None:
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
    _tier_location_argument(inspect)
    _limits_argument(inspect)


def _add_verify(commands: Any) -> None:
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
    _tier_location_argument(check)
    _limits_argument(check)
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    check.add_argument("--quiet", "-q", action="store_true", help="print only problems")
    check.add_argument(
        "--progress",
        choices=("auto", "always", "never"),
        default="auto",
        help="show a progress bar on stderr (default: when stderr is a terminal)",
    )


def _add_keygen(commands: Any) -> None:
    """``shardkeep keygen``: a new Ed25519 key pair."""
    keygen = commands.add_parser(
        "keygen",
        help="write a new Ed25519 key pair for signing checkpoints",
        description="Write PRIVATE (PKCS#8 PEM, mode 0600) and PRIVATE.pub (or --public). If "
        f"${PASSPHRASE_ENV} is set, the private key is encrypted with it (and read with it when signing). "
        "Existing files are never overwritten.",
    )
    keygen.add_argument("private", metavar="PRIVATE", help="where to write the private key, e.g. signing.pem")
    keygen.add_argument("--public", metavar="PATH", help="where to write the public key (default: PRIVATE.pub)")
    _json_argument(keygen, "the files written and the key id")


def _add_sign(commands: Any) -> None:
    """``shardkeep sign``: write manifest.sig."""
    sign = commands.add_parser(
        "sign",
        help="sign a committed checkpoint: write manifest.sig over the manifest's exact bytes",
        description="Check the manifest, then write manifest.sig: an Ed25519 signature over a domain-separation "
        "prefix and manifest.json's exact bytes. The manifest records every file's digest, so the signature covers "
        "the data; manifests with xxh3-128 digests are refused.",
    )
    sign.add_argument("path", metavar="PATH", help="a committed checkpoint: a directory or a URL")
    sign.add_argument("--key", required=True, metavar="PEM", help="the Ed25519 private key (from shardkeep keygen)")
    sign.add_argument("--replace", action="store_true", help="replace an existing signature")
    _json_argument(sign, "the checkpoint and the key id")


def _add_import_command(commands: Any) -> None:
    """``shardkeep import``: convert another format into a checkpoint."""
    importing = commands.add_parser(
        "import",
        help="convert a torch .pt, a safetensors file, a DCP directory or a Hugging Face model folder into a "
        "shardkeep checkpoint",
        description="Convert SOURCE into a new shardkeep checkpoint at DEST. Torch files are read only with "
        "torch.load(weights_only=True), even when TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set; safetensors files hold "
        "no code. A torch.distributed.checkpoint directory keeps its metadata as a Python pickle, and reading a "
        "pickle runs the code it names: it is refused unless --trust-pickle is given. A Hugging Face model folder "
        "(model.safetensors, or shards and model.safetensors.index.json) is read with safetensors only, after its "
        "index is checked; its tensors go under --subtree, under the model's state_dict keys as from_pretrained "
        "converts them (with transformers and a config.json), and its config.json under the value hf_config. A folder "
        "of pytorch_model.bin pickles is refused: import the .bin file itself (--format pt).",
    )
    importing.add_argument(
        "source",
        metavar="SOURCE",
        help="a .pt/.pth/.bin file, a .safetensors file, a DCP directory or a Hugging Face model folder",
    )
    importing.add_argument("dest", metavar="DEST", help="the new checkpoint: a directory or a URL (s3://...)")
    importing.add_argument(
        "--format",
        choices=("pt", "safetensors", "dcp", "hf"),
        help="the source format (default: from the name and content)",
    )
    importing.add_argument(
        "--subtree",
        metavar="KEY",
        help="with a Hugging Face folder: the dotted key to put its tensors under (default: model; '' for the top)",
    )
    importing.add_argument(
        "--trust-pickle",
        action="store_true",
        help="allow unpickling a DCP checkpoint's metadata and values (runs code from the files: trusted sources only)",
    )
    importing.add_argument("--key", metavar="PEM", help="sign the new checkpoint with this Ed25519 private key")
    importing.add_argument("--progress", action="store_true", help="show a progress bar while writing")
    _json_argument(importing, "the new checkpoint's summary")


def _add_export_command(commands: Any) -> None:
    """``shardkeep export``: convert a checkpoint into one file or a Hugging Face model folder."""
    exporting = commands.add_parser(
        "export",
        help="convert a checkpoint to a single torch .pt or safetensors file, or a Hugging Face model folder",
        description="Read PATH (verifying every digest) and write DEST as one torch .pt file (loadable with "
        "weights_only=True) or one safetensors file (tensors under dotted keys; JSON values in the header's "
        "metadata as shardkeep.values). With --format hf, DEST is a folder that transformers' from_pretrained "
        "loads: the tensors under --subtree (prefix stripped) in safetensors files split at --max-shard-size, "
        "config.json, tied copies left out, keys as save_pretrained writes them; with a config, the keys and shapes "
        "are checked against the model class and a mismatch is an error. DEST is written under a temporary name and renamed into place.",
    )
    exporting.add_argument("path", metavar="PATH", help="a committed checkpoint: a directory or a URL")
    exporting.add_argument(
        "dest",
        metavar="DEST",
        help="the file to write (*.pt or *.safetensors), or the folder to write with --format hf",
    )
    exporting.add_argument(
        "--format",
        choices=("pt", "torch", "safetensors", "hf"),
        help="the output format (default: from DEST); torch is another name for pt: a torch.save file, what "
        "torch.distributed.checkpoint's dcp_to_torch_save writes",
    )
    exporting.add_argument(
        "--subtree", metavar="KEY", help="--format hf: the dotted key holding the model's state dict (default: model)"
    )
    exporting.add_argument(
        "--config",
        metavar="JSON",
        help="--format hf: the model's config.json (default: the checkpoint's hf_config value, stored by an "
        "import; without one only the weights are written and the keys are not checked)",
    )
    exporting.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        help="--format hf: the largest weight file, e.g. 5GB, 500MB or bytes (default: 5GB)",
    )
    exporting.add_argument(
        "--model-class",
        metavar="CLASS",
        help="--format hf: the transformers model class to check the keys against and name in config.json, e.g. "
        "BertForMaskedLM (default: the config's architectures, else the one task-head class the keys fit)",
    )
    exporting.add_argument(
        "--skip-key-check",
        action="store_true",
        help="--format hf: do not check the keys against the model class (no transformers needed)",
    )
    exporting.add_argument("--public-key", metavar="PEM", help="require a valid signature by this key first")
    exporting.add_argument(
        "--force",
        action="store_true",
        help="replace DEST if it exists (--format hf: only a folder holding nothing but what an export writes)",
    )
    _tier_location_argument(exporting)
    _limits_argument(exporting)
    _json_argument(exporting, "what was written")


def _add_ls(commands: Any) -> None:
    """``shardkeep ls``: list the checkpoints of a root."""
    listing = commands.add_parser(
        "ls",
        help="list the checkpoints in a root: step, metric, size, last/best marks, verification state",
        description="List the committed checkpoints (step_<N> directories: step_ and the step in digits, e.g. "
        "step_100 or step_00000100) of a checkpoint-manager root. Marks and "
        "the policy come from the manifests (the newest one records the manager's policy); --keep-last/--keep-best/"
        "--metric/--mode override it. Without --verify only the manifests, file sets and sizes are checked (every "
        "tier's files too, wherever they are kept): such a "
        "checkpoint is listed as 'unverified', and the last/best marks are what the manager would keep if its data "
        "is sound. A checkpoint whose name disagrees with the step in its manifest (renamed or copied) is flagged "
        "and never marked. Exit 0 when every check passes, 1 if a checkpoint is corrupt or misnamed, 2 when ROOT "
        "holds no checkpoints (or is a checkpoint itself) or cannot be read, or a checkpoint's tier location is "
        "missing (remap it with --tier-location).",
    )
    listing.add_argument("root", metavar="ROOT", help="a directory or URL (s3://bucket/prefix) of step_<N> checkpoints")
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
    _policy_arguments(listing)
    _tier_location_argument(listing)
    _limits_argument(listing)


def _add_prune(commands: Any) -> None:
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
    _limits_argument(prune)
    prune.add_argument(
        "--lease",
        type=float,
        default=DEFAULT_LEASE,
        metavar="SECONDS",
        help="with --apply, also remove leftovers of unfinished saves (staging directories, unused attempt-<id>/ "
        f"prefixes, unfinished multipart uploads) untouched for this long (default {DEFAULT_LEASE:.0f}); "
        "<name>.deleting-<id> directories of unfinished deletions are removed whatever their age",
    )
    _policy_arguments(prune)
    _json_argument(prune, "the policy, what is kept, what is (or would be) deleted")


def _add_ledger(commands: Any) -> None:
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
    _json_argument(reassign, "the shard, its previous and its new worker")


def _json_argument(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--json", action="store_true", help=f"print {what} as one JSON object (schema: docs/cli.md); errors too"
    )


def _write_json(out: TextIO, document: Mapping[str, Any]) -> None:
    out.write(json.dumps(document, indent=2) + "\n")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def _tier_location(text: str) -> tuple[str, str]:
    name, separator, place = text.partition("=")
    if not separator or not name or not place:
        raise argparse.ArgumentTypeError(f"{text!r} must be NAME=LOCATION: a tier name, then a directory or URL")
    return name, place


def _tier_location_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tier-location",
        action="append",
        type=_tier_location,
        default=[],
        metavar="NAME=LOCATION",
        help="read tier NAME from LOCATION (a directory or URL) instead of the location its manifest records, e.g. "
        "after the tier was moved (repeatable)",
    )


def _limits_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--manifest-limit-mib",
        type=_positive_int,
        default=None,
        metavar="MIB",
        help=f"read manifests of up to MIB MiB (default {ManifestLimits().max_bytes >> 20}; the tensor and file "
        "count limits scale with it). The default bounds what reading an untrusted manifest costs; raise it for a "
        "large checkpoint you trust",
    )


def _limits(args: argparse.Namespace) -> ManifestLimits | None:
    mib = getattr(args, "manifest_limit_mib", None)
    return None if mib is None else ManifestLimits.scaled(mib)


def _tier_locations(args: argparse.Namespace) -> dict[str, str]:
    remapped: dict[str, str] = {}
    for name, place in args.tier_location:
        if remapped.get(name, place) != place:
            raise ConfigError(f"--tier-location {name}= is given twice, with different locations")
        remapped[name] = place
    return remapped


def _check_tier_names(manifest: Manifest, path: str, tiers: list[str] | None, remapped: dict[str, str]) -> None:
    """Refuse --tier and --tier-location names that the checkpoint does not define (a usage error)."""
    defined = sorted({tier.name for tier in manifest.tiers} | {record.tier for record in manifest.files})
    for flag, names in (("--tier", set(tiers or ())), ("--tier-location", set(remapped))):
        unknown = sorted(names - set(defined))
        if unknown:
            raise ConfigError(
                f"{flag} {', '.join(unknown)}: {path} has no such tier; its tiers are {', '.join(defined) or 'none'}"
            )


def _policy_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--keep-last", type=_count, metavar="N", help="last checkpoints to keep (default: recorded)")
    parser.add_argument("--keep-best", type=_count, metavar="M", help="best checkpoints to keep (default: recorded)")
    parser.add_argument("--metric", help="metric ranking the best (default: recorded, else val_loss)")
    parser.add_argument(
        "--mode", choices=("min", "max"), help="lower or higher is better (default: recorded, else min)"
    )
    parser.add_argument("--run", metavar="RUN_ID", help="the run whose checkpoints count (default: the root's owner)")


def summary(manifest: Manifest) -> dict[str, Any]:
    """A machine-readable summary of a manifest's contents."""
    by_dtype: Counter[str] = Counter()
    bytes_by_dtype: Counter[str] = Counter()
    for _, entry in manifest.iter_tensors():
        by_dtype[entry.dtype] += 1
        bytes_by_dtype[entry.dtype] += entry.nbytes
    indexed = manifest if isinstance(manifest, IndexedManifest) else None
    return {
        "sharded_tensors": len(indexed.sharded) if indexed is not None else 0,
        "rank_indexes": len(indexed.index_records()) if indexed is not None else 0,
        "tensor_count": sum(len(record.tensors) for record in manifest.files),
        "tensor_bytes": manifest.total_tensor_bytes,
        "file_count": len(manifest.files),
        "file_bytes": sum(record.size for record in manifest.files),
        "value_count": len(manifest.values),
        "dtypes": {name: {"count": by_dtype[name], "bytes": bytes_by_dtype[name]} for name in sorted(by_dtype)},
    }


_CONTROL = {code: f"\\x{code:02x}" for code in [*range(0x20), *range(0x7F, 0xA0)] if code != 0x0A}


def _printable(text: str) -> str:
    """Escape control characters, so names from a hostile manifest cannot drive the terminal;
    and name the CLI's flag where the library's message names a Python keyword."""
    return _cli_words(text).translate(_CONTROL)


#: The library's hints, in the CLI's words.
_HINTS = (
    ("pass limits=ManifestLimits(...) with larger values", "pass --manifest-limit-mib with a larger value"),
    ("pass limits=ManifestLimits(max_bytes=...)", "pass --manifest-limit-mib with a larger value"),
)


def _cli_words(text: str) -> str:
    for library, cli in _HINTS:
        text = text.replace(library, cli)
    return text


def _print_inspect(
    manifest: Manifest, path: str, limit: int | None, out: TextIO, tier_notes: dict[str, str] | None = None
) -> None:
    info = summary(manifest)
    tier_notes = tier_notes or {}

    def w(text: str) -> None:
        out.write(_printable(text))

    w(f"checkpoint   {path}\n")
    w(f"created      {manifest.created_at.isoformat()}   metadata_version {manifest.metadata_version}\n")
    w(f"model_id     {manifest.model_id or '-'}   step {_dash(manifest.step)}   epoch {_dash(manifest.epoch)}\n")
    w(
        f"sharding     {manifest.sharding.strategy}, world_size {manifest.world_size}, "
        f"{manifest.sharding.shard_count} shard file(s), precision {manifest.sharding.precision or '-'}\n"
    )
    w(
        f"training     learning_rate {_dash(manifest.training.learning_rate)}   "
        f"optimizer {manifest.training.optimizer_type or '-'}\n"
    )
    if isinstance(manifest, IndexedManifest):
        w(
            f"format 2.0   {info['sharded_tensors']} sharded tensor(s) described once, "
            f"{info['rank_indexes']} rank index(es) (index/rank_NNNNN.json)\n"
        )
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


def _dash(value: object) -> str:
    return "-" if value is None else str(value)


_REMAP_HINT = "--tier-location {tier}=NEW_LOCATION"


def _missing_tier_problems(
    location: CheckpointLocation, manifest: Manifest, remapped: dict[str, str], tiers: list[str] | None = None
) -> dict[str, str]:
    """One problem for each tier (of ``tiers``) whose location holds nothing of the checkpoint
    (one ``stat`` per tier; no file is opened)."""
    resolver = FileResolver(location, manifest, tier_locations=remapped)
    return {
        tier: missing_tier_problem(tier, found, _REMAP_HINT, tier in remapped)
        for tier, found in missing_tiers(resolver, manifest, tiers).items()
    }


def _run_inspect(args: argparse.Namespace, out: TextIO) -> int:
    location = locate(args.path)
    manifest = read_checked_manifest(location, SignaturePolicy(), _limits(args))
    remapped = _tier_locations(args)
    _check_tier_names(manifest, args.path, None, remapped)
    missing = _missing_tier_problems(location, manifest, remapped)
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


def _run_verify(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    if args.allow_unsigned and args.public_key is None:
        raise ConfigError("--allow-unsigned only applies with --public-key (the key a present signature must match)")
    policy = SignaturePolicy.of(args.public_key, False if args.allow_unsigned else None)
    remapped = _tier_locations(args)
    location = locate(args.path)
    # Nothing to check at all (no checkpoint there, unreadable) is exit 2, not "corrupt", so the
    # manifest is read here first (as verify reads it: with a key, the signature before the
    # manifest is parsed); it also says which tiers are reachable. Damage to the manifest is
    # left to verify to report (exit 1).
    manifest = None
    try:
        manifest = read_checked_manifest(location, policy, _limits(args), expand=False)
    except (CheckpointNotFoundError, StorageError):
        raise
    except ShardkeepError:
        manifest = None
    if isinstance(manifest, IndexedManifest):
        # A rank index that is missing or damaged is a problem of the checkpoint (exit 1), which
        # verify reports; only the manifest's absence means there is nothing to check (exit 2).
        try:
            manifest = read_checked_manifest(location, policy, _limits(args))
        except StorageError:
            raise
        except ShardkeepError:
            manifest = None
    tiers = args.tier
    missing: dict[str, str] = {}  # tier -> the one problem to print for it
    if manifest is not None:
        _check_tier_names(manifest, args.path, args.tier, remapped)
        missing = _missing_tier_problems(location, manifest, remapped, args.tier)
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
            limits=_limits(args),
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
        out.write(f"PROBLEM  {_printable(problem)}\n")
    for problem in missing.values():
        out.write(f"MISSING  {_printable(problem)}\n")
    if not args.quiet:
        for warning in report.warnings:
            out.write(f"warning  {_printable(warning)}\n")
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


def _run_keygen(args: argparse.Namespace, out: TextIO) -> int:
    public = args.public or f"{args.private}.pub"
    identity = generate_key_pair(args.private, public)
    if args.json:
        encrypted = bool(os.environ.get(PASSPHRASE_ENV))
        _write_json(out, {"private": args.private, "public": public, "key_id": identity, "encrypted": encrypted})
        return 0
    out.write(f"wrote {args.private} (private, keep it secret) and {public} (public)\nkey id {identity}\n")
    return 0


def _run_sign(args: argparse.Namespace, out: TextIO) -> int:
    try:
        identity = sign_checkpoint(args.path, args.key, replace=args.replace)
    except CheckpointExistsError as exc:  # the only one sign_checkpoint raises: a signature is there
        raise CheckpointExistsError(
            f"{args.path} is already signed (manifest.sig exists); pass --replace to replace the signature"
        ) from exc
    if args.json:
        _write_json(out, {"path": args.path, "key_id": identity, "replaced": bool(args.replace)})
        return 0
    out.write(f"signed {args.path} with key {identity[:16]}\n")
    return 0


def _torch_module(name: str) -> Any:
    """Import module ``name``, which needs torch (and numpy): without them, a
    :class:`DependencyError` saying what to install (exit 2, like every error)."""
    return import_needing_torch(name, "shardkeep import and export")


def _run_import(args: argparse.Namespace, out: TextIO) -> int:
    interop = _torch_module("shardkeep.integrations.convert")
    detect_format, import_checkpoint = interop.detect_format, interop.import_checkpoint

    source_format = args.format or detect_format(args.source)
    manifest = import_checkpoint(
        args.source,
        args.dest,
        source_format=args.format,
        trust_pickle=args.trust_pickle,
        subtree=args.subtree,
        signer=args.key,
        options=WriteOptions(progress=args.progress),
    )
    info = summary(manifest)
    if args.json:
        document = {"source": args.source, "dest": args.dest, "format": source_format, "signed": bool(args.key)}
        _write_json(out, document | {"summary": info})
        return 0
    out.write(
        f"imported {args.source} -> {args.dest}: {info['tensor_count']} tensor(s), "
        f"{human_bytes(info['tensor_bytes'])}, {info['value_count']} value(s)" + (", signed" if args.key else "") + "\n"
    )
    return 0


def _run_export(args: argparse.Namespace, out: TextIO) -> int:
    if args.format is None and not args.dest.endswith((".pt", ".pth", ".bin", ".ckpt", ".safetensors")):
        raise ConfigError(
            f"cannot tell the format from {args.dest!r}: end it in .pt or .safetensors, or pass --format "
            "(--format hf for a Hugging Face model folder)"
        )
    hf_flags = [
        flag
        for flag, given in (
            ("--subtree", args.subtree is not None),
            ("--config", args.config is not None),
            ("--max-shard-size", args.max_shard_size is not None),
            ("--skip-key-check", args.skip_key_check),
            ("--model-class", args.model_class is not None),
        )
        if given
    ]
    if hf_flags and args.format != "hf":
        raise ConfigError(f"{', '.join(hf_flags)} apply to --format hf only")
    remapped = _tier_locations(args)
    location = locate(args.path)
    policy = SignaturePolicy.of(args.public_key)
    manifest = read_checked_manifest(location, policy, _limits(args))
    _check_tier_names(manifest, args.path, None, remapped)
    missing = _missing_tier_problems(location, manifest, remapped)
    if missing:
        raise CheckpointNotFoundError(f"cannot export {args.path}: {'; '.join(missing.values())}")

    if args.format == "hf":
        hf = _torch_module("shardkeep.integrations.hf")

        try:
            folder = hf.export_hf(
                args.path,
                args.dest,
                subtree="model" if args.subtree is None else args.subtree,
                config=args.config,
                max_shard_size=args.max_shard_size or hf.DEFAULT_MAX_SHARD_SIZE,
                check_keys=not args.skip_key_check,
                model_class=args.model_class,
                overwrite=args.force,
                public_key=policy.public_key,
                tier_locations=remapped or None,
                limits=_limits(args),
            )
        except CheckpointExistsError as exc:
            if "pass overwrite=True" not in str(exc):  # a shardkeep checkpoint at DEST: never replaced
                raise
            raise CheckpointExistsError(f"{args.dest} already exists; pass --force to replace it") from exc
        weight_files = sum(1 for name in folder.files if name.endswith(".safetensors"))
        if args.json:
            document = {
                "path": args.path,
                "dest": folder.path,
                "format": "hf",
                "tensors": folder.tensors,
                "bytes": folder.bytes,
                "files": list(folder.files),
                "weight_files": weight_files,
                "config_source": folder.config_source,
                "checked_against": folder.checked_against,
                "tied_dropped": list(folder.tied_dropped),
                "notes": list(folder.notes),
            }
            _write_json(out, document)
            return 0
        checked = f"keys checked against {folder.checked_against}" if folder.checked_against else "keys not checked"
        tied = f"; tied copies left out: {', '.join(folder.tied_dropped)}" if folder.tied_dropped else ""
        out.write(
            f"exported {args.path} -> {folder.path} (hf): {folder.tensors} tensor(s), {human_bytes(folder.bytes)} "
            f"in {weight_files} weight file(s); config from {folder.config_source or '-'}; {checked}{tied}\n"
        )
        for note in folder.notes:
            out.write(f"note: {note}\n")
        return 0

    export_checkpoint = _torch_module("shardkeep.integrations.convert").export_checkpoint

    try:
        written = export_checkpoint(
            args.path,
            args.dest,
            format="pt" if args.format == "torch" else args.format,
            overwrite=args.force,
            public_key=policy.public_key,
            tier_locations=remapped or None,
            limits=_limits(args),
        )
    except CheckpointExistsError as exc:  # DEST exists (export_checkpoint checks nothing else so)
        raise CheckpointExistsError(f"{args.dest} already exists; pass --force to replace it") from exc
    if args.json:
        document = {
            "path": args.path,
            "dest": written.path,
            "format": written.format,
            "tensors": written.tensors,
            "bytes": written.bytes,
            "values": written.values,
        }
        _write_json(out, document)
        return 0
    out.write(
        f"exported {args.path} -> {written.path} ({written.format}): {written.tensors} tensor(s), "
        f"{human_bytes(written.bytes)}, {written.values} value(s)\n"
    )
    return 0


def _open_root(args: argparse.Namespace, *, allow_empty: bool = False) -> tuple[CheckpointRoot, list[Any]]:
    """The root ROOT names and its checkpoints; a usage error (exit 2) when it holds none (unless
    ``allow_empty``: a root holding only leftovers of unfinished saves), or is a checkpoint
    itself, saying what is there instead."""
    remapped = _tier_locations(args) if hasattr(args, "tier_location") else {}
    root = CheckpointRoot.at(args.root, tier_locations=remapped, remap_hint=_REMAP_HINT, limits=_limits(args))
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
    policy = RetentionPolicy(
        keep_last=recorded.keep_last if args.keep_last is None else args.keep_last,
        keep_best=recorded.keep_best if args.keep_best is None else args.keep_best,
        metric=args.metric or recorded.metric,
        mode=args.mode or recorded.mode,
    )
    if all(value is not None for value in given):
        source = "from the options"
    elif record is not None:
        source = f"recorded by {record[1]}" + (", with the options given" if any(v is not None for v in given) else "")
    else:
        source = "no checkpoint records a policy: " + (
            "the options given, defaults for the rest" if any(v is not None for v in given) else "defaults"
        )
    return policy, source


def _marks(entry: CheckpointEntry, decision: RetentionDecision, scoped: bool) -> str:
    marks = [name for name, on in (("last", entry.is_last), ("best", entry.is_best)) if on]
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


def _run_ls(args: argparse.Namespace, out: TextIO) -> int:
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
            "checkpoints": [
                {
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
                    "state": _state_word(entry),
                    "verified": entry.verified,
                    "misnamed": entry.misnamed,
                    "missing_tiers": list(entry.missing_tiers),
                    "problems": list(entry.problems),
                    "run_id": entry.run_id,
                    "created_at": entry.created_at.isoformat() if entry.created_at else None,
                    "timing": msgspec.to_builtins(entry.manifest.timing) if entry.manifest else None,
                }
                for entry in entries
            ],
            "pointers": pointers,
            "leftovers": leftovers,
            "plot": plotted.path if plotted else None,
        }
        out.write(json.dumps(document, indent=2) + "\n")
        return status

    def w(text: str) -> None:
        out.write(_printable(text))

    w(f"root    {root.display}\n")
    w(
        f"policy  keep_last={policy.keep_last} keep_best={policy.keep_best} metric={policy.metric} mode={policy.mode}"
        f"   ({source})   run {run or '-'}\n"
    )
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


def _policy_document(policy: RetentionPolicy, source: str) -> dict[str, Any]:
    """The retention policy as ``ls --json`` and ``prune --json`` print it."""
    return {
        "keep_last": policy.keep_last,
        "keep_best": policy.keep_best,
        "metric": policy.metric,
        "mode": policy.mode,
        "source": source,
    }


def _run_prune(args: argparse.Namespace, out: TextIO) -> int:
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
        _write_json(out, document)
        return 0
    verb = "deleted" if args.apply else "would delete"
    out.write(
        _printable(
            f"policy keep_last={policy.keep_last} keep_best={policy.keep_best} metric={policy.metric} "
            f"mode={policy.mode}   ({source})   run {run or '-'}\n"
        )
    )
    for name in decision.keep:
        out.write(_printable(f"keep          {name}\n"))
    for name in decision.delete:
        out.write(_printable(f"{verb:<13} {name}\n"))
    for name, reason in left_alone:
        out.write(_printable(f"leave alone   {name}: {reason}\n"))
    if not args.apply:
        for name, idle in pending:
            out.write(_printable(_leftover_line(name, idle, args.lease)))
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
        return f"would remove  {name} (staging: unchanged for {_age(idle)}, lease {_age(lease)})\n"
    return f"would wait    {name} (staging: changed {_age(idle)} ago; removed once unchanged for {_age(lease)})\n"


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = max(seconds, 0.0)
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def _ledger_missing(path: str) -> LedgerNotFoundError:
    """The ledger's "not found" in command-line words (the library's names a Python call)."""
    return LedgerNotFoundError(f"no progress ledger at {path}; the batch job creates it when it starts: check the path")


def _run_ledger_status(args: argparse.Namespace, out: TextIO) -> int:
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
        out.write(_printable(text))

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
            f"{len(entry.checkpoints):>7} {entry.total_sequences:>11,} {_age(None if activity is None else now - activity):>6} "
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


def _run_ledger_reassign(args: argparse.Namespace, out: TextIO) -> int:
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
        _write_json(out, document)
        return 0
    out.write(
        f"shard {args.shard} (original rank {before['original_rank'] if before else '?'}): worker {previous} -> {args.rank}\n"
    )
    return 0


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    args = build_parser().parse_args(argv)
    try:
        if args.command == "inspect":
            return _run_inspect(args, out)
        if args.command == "verify":
            return _run_verify(args, out, err)
        if args.command == "keygen":
            return _run_keygen(args, out)
        if args.command == "sign":
            return _run_sign(args, out)
        if args.command == "import":
            return _run_import(args, out)
        if args.command == "export":
            return _run_export(args, out)
        if args.command == "ls":
            return _run_ls(args, out)
        if args.command == "prune":
            return _run_prune(args, out)
        if args.command == "ledger" and args.ledger_command == "status":
            return _run_ledger_status(args, out)
        if args.command == "ledger" and args.ledger_command == "reassign":
            return _run_ledger_reassign(args, out)
    except ShardkeepError as exc:
        if getattr(args, "json", False):
            command = " ".join(part for part in (args.command, getattr(args, "ledger_command", None)) if part)
            _write_json(err, {"error": {"command": command, "type": type(exc).__name__, "message": str(exc)}})
            return 2
        err.write(f"shardkeep {args.command}: error: {_cli_words(str(exc))}\n")
        return 2
    except BrokenPipeError:
        return 0
    raise AssertionError(f"unhandled command {args.command}")
