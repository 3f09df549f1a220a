"""Argument types, JSON output and printing shared by the command-line commands."""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from shardkeep.config import ManifestLimits
from shardkeep.errors import (
    ConfigError,
    import_needing_torch,
)
from shardkeep.manifest import IndexedManifest, Manifest, TensorFamily
from shardkeep.manifest.families import instances_within


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


def json_argument(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--json", action="store_true", help=f"print {what} as one JSON object (schema: docs/cli.md); errors too"
    )


def write_json(out: TextIO, document: Mapping[str, Any]) -> None:
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


def _seconds(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be a number of seconds > 0")
    return value


def _tier_location(text: str) -> tuple[str, str]:
    name, separator, place = text.partition("=")
    if not separator or not name or not place:
        raise argparse.ArgumentTypeError(f"{text!r} must be NAME=LOCATION: a tier name, then a directory or URL")
    return name, place


def tier_location_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tier-location",
        action="append",
        type=_tier_location,
        default=[],
        metavar="NAME=LOCATION",
        help="read tier NAME from LOCATION (a directory or URL) instead of the location its manifest records, e.g. "
        "after the tier was moved (repeatable)",
    )


def limits_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--manifest-limit-mib",
        type=_positive_int,
        default=None,
        metavar="MIB",
        help=f"read manifests of up to MIB MiB (default {ManifestLimits().max_bytes >> 20}; the tensor and file "
        "count limits scale with it). The default bounds what reading an untrusted manifest costs; raise it for a "
        "large checkpoint you trust",
    )


def limits_of(args: argparse.Namespace) -> ManifestLimits | None:
    mib = getattr(args, "manifest_limit_mib", None)
    return None if mib is None else ManifestLimits.scaled(mib)


def tier_locations(args: argparse.Namespace) -> dict[str, str]:
    remapped: dict[str, str] = {}
    for name, place in args.tier_location:
        if remapped.get(name, place) != place:
            raise ConfigError(f"--tier-location {name}= is given twice, with different locations")
        remapped[name] = place
    return remapped


def check_tier_names(manifest: Manifest, path: str, tiers: list[str] | None, remapped: dict[str, str]) -> None:
    """Refuse --tier and --tier-location names that the checkpoint does not define (a usage error)."""
    defined = sorted({tier.name for tier in manifest.tiers} | {record.tier for record in manifest.files})
    for flag, names in (("--tier", set(tiers or ())), ("--tier-location", set(remapped))):
        unknown = sorted(names - set(defined))
        if unknown:
            raise ConfigError(
                f"{flag} {', '.join(unknown)}: {path} has no such tier; its tiers are {', '.join(defined) or 'none'}"
            )


def policy_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--keep-last", type=_count, metavar="N", help="last checkpoints to keep (default: recorded)")
    parser.add_argument("--keep-best", type=_count, metavar="M", help="best checkpoints to keep (default: recorded)")
    parser.add_argument("--metric", help="metric ranking the best (default: recorded, else val_loss)")
    parser.add_argument(
        "--mode", choices=("min", "max"), help="lower or higher is better (default: recorded, else min)"
    )
    parser.add_argument(
        "--keep-period",
        type=_positive_int,
        metavar="K",
        help="also keep every checkpoint whose step is a multiple of K (manifests do not record it: default off)",
    )
    parser.add_argument(
        "--keep-interval",
        type=_seconds,
        metavar="SECONDS",
        help="also keep the last checkpoint created in each SECONDS-long window, aligned to the Unix epoch "
        "(86400: one per UTC day; manifests do not record it: default off)",
    )
    parser.add_argument("--run", metavar="RUN_ID", help="the run whose checkpoints count (default: the root's owner)")


def instance_total(families: Sequence[TensorFamily]) -> int:
    """The instances of some (valid) tensor families, counted without building one."""
    return instances_within(families, 1 << 62)


def summary(manifest: Manifest) -> dict[str, Any]:
    """A machine-readable summary of a manifest's contents: ``sharded_tensors`` counts every
    described tensor, each instance of a tensor family included; ``tensor_families`` lists each
    family once (its key template and instance count)."""
    by_dtype: Counter[str] = Counter()
    bytes_by_dtype: Counter[str] = Counter()
    for _, entry in manifest.iter_tensors():
        by_dtype[entry.dtype] += 1
        bytes_by_dtype[entry.dtype] += entry.nbytes
    indexed = manifest if isinstance(manifest, IndexedManifest) else None
    families = (indexed.families or []) if indexed is not None else []
    return {
        "sharded_tensors": len(indexed.sharded) + instance_total(families) if indexed is not None else 0,
        "tensor_families": [{"key": family.key, "instances": instance_total([family])} for family in families],
        "rank_indexes": len(indexed.index_records()) if indexed is not None else 0,
        "tensor_count": sum(len(record.tensors) for record in manifest.files),
        "tensor_bytes": manifest.total_tensor_bytes,
        "file_count": len(manifest.files),
        "file_bytes": sum(record.size for record in manifest.files),
        "value_count": len(manifest.values),
        "dtypes": {name: {"count": by_dtype[name], "bytes": bytes_by_dtype[name]} for name in sorted(by_dtype)},
    }


_CONTROL = {code: f"\\x{code:02x}" for code in [*range(0x20), *range(0x7F, 0xA0)] if code != 0x0A}


def printable(text: str) -> str:
    """Escape control characters, so names from a hostile manifest cannot drive the terminal;
    and name the CLI's flag where the library's message names a Python keyword."""
    return cli_words(text).translate(_CONTROL)


#: The library's hints, in the CLI's words.
_HINTS = (
    ("pass limits=ManifestLimits(...) with larger values", "pass --manifest-limit-mib with a larger value"),
    ("pass limits=ManifestLimits(max_bytes=...)", "pass --manifest-limit-mib with a larger value"),
)


def cli_words(text: str) -> str:
    for library, cli in _HINTS:
        text = text.replace(library, cli)
    return text


def dash(value: object) -> str:
    return "-" if value is None else str(value)


def torch_module(name: str) -> Any:
    """Import module ``name``, which needs torch (and numpy): without them, a
    :class:`DependencyError` saying what to install (exit 2, like every error)."""
    return import_needing_torch(name, "shardkeep import and export")


def age(seconds: float | None) -> str:
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
