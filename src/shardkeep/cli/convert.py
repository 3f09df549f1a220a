"""The ``import`` and ``export`` commands: other formats in and out (they import torch when they run)."""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from shardkeep.cli.checkpoints import missing_tier_problems
from shardkeep.cli.format import (
    check_tier_names,
    human_bytes,
    json_argument,
    limits_argument,
    limits_of,
    summary,
    tier_location_argument,
    tier_locations,
    torch_module,
    write_json,
)
from shardkeep.config import WriteOptions
from shardkeep.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
)
from shardkeep.integrity import SignaturePolicy
from shardkeep.verification import (
    locate,
    read_checked_manifest,
)


def add_import_command(commands: Any) -> None:
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
    json_argument(importing, "the new checkpoint's summary")


def add_export_command(commands: Any) -> None:
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
    tier_location_argument(exporting)
    limits_argument(exporting)
    json_argument(exporting, "what was written")


def run_import(args: argparse.Namespace, out: TextIO) -> int:
    interop = torch_module("shardkeep.integrations.convert")
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
        write_json(out, document | {"summary": info})
        return 0
    out.write(
        f"imported {args.source} -> {args.dest}: {info['tensor_count']} tensor(s), "
        f"{human_bytes(info['tensor_bytes'])}, {info['value_count']} value(s)" + (", signed" if args.key else "") + "\n"
    )
    return 0


def run_export(args: argparse.Namespace, out: TextIO) -> int:
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
    remapped = tier_locations(args)
    location = locate(args.path)
    policy = SignaturePolicy.of(args.public_key)
    manifest = read_checked_manifest(location, policy, limits_of(args))
    check_tier_names(manifest, args.path, None, remapped)
    missing = missing_tier_problems(location, manifest, remapped)
    if missing:
        raise CheckpointNotFoundError(f"cannot export {args.path}: {'; '.join(missing.values())}")

    if args.format == "hf":
        return _export_hf(args, out, policy, remapped)

    export_checkpoint = torch_module("shardkeep.integrations.convert").export_checkpoint

    try:
        written = export_checkpoint(
            args.path,
            args.dest,
            format="pt" if args.format == "torch" else args.format,
            overwrite=args.force,
            public_key=policy.public_key,
            tier_locations=remapped or None,
            limits=limits_of(args),
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
        write_json(out, document)
        return 0
    out.write(
        f"exported {args.path} -> {written.path} ({written.format}): {written.tensors} tensor(s), "
        f"{human_bytes(written.bytes)}, {written.values} value(s)\n"
    )
    return 0


def _export_hf(args: argparse.Namespace, out: TextIO, policy: SignaturePolicy, remapped: dict[str, str]) -> int:
    """``export --format hf``: a Hugging Face model folder, and its summary."""
    hf = torch_module("shardkeep.integrations.hf")

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
            limits=limits_of(args),
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
        write_json(out, document)
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
