"""Manifest validation: whether a decoded manifest is internally consistent, entry by entry.

:func:`validate_manifest` never raises for bad content; it returns every problem, worded, in a
fixed order (the top-level fields, the tiers, the files and their tensors, format 2.x's
described tensors and rank indexes, the state tree, the run record, the containers). The
tensor entries and the state tree's parents are first checked a column at a time
(:mod:`shardkeep.manifest.validate_columns`); only when that finds something are they checked
one by one, which words each problem. :func:`validate_entries_one_by_one` skips the column
pass: it is what the column pass must agree with. :func:`check_manifest` adds the coverage
check of chunks: every problem that keeps a manifest from being committed or read.
This module does not import torch.
"""

from __future__ import annotations

import itertools
import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import compress, repeat

import msgspec

from shardkeep.config import DIGEST_ALGORITHMS, ManifestLimits
from shardkeep.errors import ManifestError
from shardkeep.manifest.codec import parse_version
from shardkeep.manifest.coverage import coverage_problems
from shardkeep.manifest.families import (
    READERS_EXPAND_FAMILIES,
    family_parents,
    family_set_problems,
    parents_signature,
)
from shardkeep.manifest.format2 import check_indexed
from shardkeep.manifest.schema import (
    BLOCK_SIZES,
    DTYPE_ITEMSIZE,
    FAST_BLOCK_DIGEST_BYTES,
    FAST_DIGEST,
    MAX_HISTORY,
    RUN_ID_PATTERN,
    STRONG_BLOCK_DIGEST_BYTES,
    FileRecord,
    IndexedManifest,
    Manifest,
    SaveTiming,
    TensorEntry,
    TensorFamily,
    digest_problem,
    has_chunks,
    key_for_path,
    path_problem,
    shape_problem,
    short_shape,
)
from shardkeep.manifest.validate_columns import TensorTable, parents_pass, tensors_pass
from shardkeep.names import MANIFEST_FILENAME, SIGNATURE_FILENAME, unsafe_path_reason
from shardkeep.progress import collector_paused

__all__ = [
    "TIER_URL_SCHEMES",
    "ValidationResult",
    "check_file_tensors",
    "check_manifest",
    "check_tensor",
    "validate_entries_one_by_one",
    "validate_manifest",
]


@dataclass
class ValidationResult:
    """Errors make a manifest unusable; warnings are worth a look but do not block loading."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def is_valid(self) -> bool:
        return not self.errors

    def add_error(self, message: str) -> None:
        self.errors.append(message)

    def add_warning(self, message: str) -> None:
        self.warnings.append(message)


_URL = re.compile(r"^[a-z][a-z0-9+.-]*://[^\x00-\x1f]+$")


#: URL schemes a tier location may use: object stores, never a web server or a shell.
TIER_URL_SCHEMES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "file"})


def _is_safe_location(location: str) -> bool:
    """A tier location is an absolute local path or an object-store URL (``s3://bucket/prefix``)."""
    if any(ord(ch) < 0x20 for ch in location):
        return False
    if _URL.match(location):
        scheme, _, rest = location.partition("://")
        return scheme in TIER_URL_SCHEMES and ".." not in rest.split("/")
    return location.startswith("/") and ".." not in location.split("/")


def validate_manifest(manifest: Manifest, *, limits: ManifestLimits | None = None) -> ValidationResult:
    """Check a decoded manifest for internal consistency. Never raises for bad content.

    The checks run in a fixed order, so the errors are reported in it: the top-level fields,
    the tiers, the files and their tensors, the state tree (parents, values), the run record,
    and the containers."""
    return _validate(manifest, limits or ManifestLimits(), columns=True)


def validate_entries_one_by_one(manifest: Manifest, *, limits: ManifestLimits | None = None) -> ValidationResult:
    """:func:`validate_manifest` without the column pass: every tensor entry and every parent
    checked one by one. Its result is the one :func:`validate_manifest` must give."""
    return _validate(manifest, limits or ManifestLimits(), columns=False)


def check_manifest(manifest: Manifest, *, limits: ManifestLimits | None = None) -> ValidationResult:
    """:func:`validate_manifest`, and then the coverage check of chunks
    (:func:`~shardkeep.manifest.coverage.coverage_problems`), whose problems are errors too:
    every error in the result keeps ``manifest`` from being committed or read."""
    result = validate_manifest(manifest, limits=limits)
    if has_chunks(manifest):  # coverage_problems finds nothing without chunks
        result.errors += coverage_problems(manifest)
    return result


def _validate(manifest: Manifest, limits: ManifestLimits, *, columns: bool) -> ValidationResult:
    result = ValidationResult()
    with collector_paused():
        table = TensorTable(manifest.files)
        _check_top_level(manifest, result.add_error)
        tier_names = _check_tiers(manifest, result.add_error)
        tensor_keys = _check_files(manifest, table, tier_names, limits, result, columns=columns)
        if isinstance(manifest, IndexedManifest):
            offsets = map(operator.attrgetter("global_offset"), table.entries)
            chunk_keys = set(compress(table.keys, map(operator.is_not, offsets, repeat(None))))
            # A view expanded from the indexes lists the chunks of family instances as entries.
            listed = (tensor_keys if manifest.complete is None else tensor_keys - chunk_keys) | _described_keys(
                manifest
            )
            families = _check_families(manifest, listed, limits, result.add_error)
            tensor_keys = tensor_keys | check_indexed(
                manifest, tensor_keys, chunk_keys, limits, result.add_error, result.add_warning, families
            )
        _check_parents(manifest, table, result.add_error, columns=columns)
        _check_values(manifest, tensor_keys, limits, result.add_error)
        _validate_run(manifest, limits, result)
        _check_containers(manifest, limits, result.add_error)
    return result


def _check_top_level(manifest: Manifest, err: Callable[[str], None]) -> None:
    """The version, ranks, digest algorithm and shard count."""
    try:
        parse_version(manifest.metadata_version)
    except ManifestError as exc:
        err(str(exc))
    if manifest.world_size < 1:
        err(f"world_size must be >= 1, got {manifest.world_size}")
    if not 0 <= manifest.coordinator_rank < max(manifest.world_size, 1):
        err(f"coordinator_rank {manifest.coordinator_rank} is outside world_size {manifest.world_size}")
    if manifest.digest_algorithm not in DIGEST_ALGORITHMS:
        err(f"digest_algorithm {manifest.digest_algorithm!r} is not one of {', '.join(DIGEST_ALGORITHMS)}")
    if isinstance(manifest, IndexedManifest):
        if manifest.sharding.shard_count < len(manifest.files):
            err(
                f"shard count mismatch: sharding.shard_count is {manifest.sharding.shard_count} "
                f"but the manifest lists {len(manifest.files)} files besides its rank indexes"
            )
    elif manifest.sharding.shard_count != len(manifest.files):
        err(
            f"shard count mismatch: sharding.shard_count is {manifest.sharding.shard_count} "
            f"but the manifest lists {len(manifest.files)} files"
        )


def _check_tiers(manifest: Manifest, err: Callable[[str], None]) -> set[str]:
    """Tier names and ids are unique and locations safe; returns the tier names."""
    tier_names: set[str] = set()
    tier_ids: set[int] = set()
    for tier in manifest.tiers:
        if tier.name in tier_names:
            err(f"tier name {tier.name!r} is defined twice")
        if tier.tier_id in tier_ids:
            err(f"tier_id {tier.tier_id} is defined twice")
        tier_names.add(tier.name)
        tier_ids.add(tier.tier_id)
        if tier.location is not None and not _is_safe_location(tier.location):
            err(
                f"tier {tier.name!r} has location {tier.location!r}: it must be an absolute path or an object-store URL ("
                + ", ".join(sorted(TIER_URL_SCHEMES))
                + ")"
            )
    return tier_names


def _check_files(
    manifest: Manifest,
    table: TensorTable,
    tier_names: set[str],
    limits: ManifestLimits,
    result: ValidationResult,
    *,
    columns: bool,
) -> set[str]:
    """Every file record and its tensors, with keys unique across files; returns the tensor keys.

    The tensor entries are first checked a column at a time (:func:`~shardkeep.manifest.validate_columns.tensors_pass`). When that
    finds nothing, only the file records are checked one by one; otherwise every entry is checked
    one by one, which words each problem, in the same order as always."""
    seen_paths: set[str] = set()
    if columns and tensors_pass(manifest.files, table, limits):
        for record in manifest.files:
            _check_file_record(record, f"file {record.path!r}", manifest, tier_names, seen_paths, result)
        return table.key_set if table.key_set is not None else set(table.keys)
    seen_keys: dict[tuple[str, tuple[int, ...]], str] = {}
    for record in manifest.files:
        where = f"file {record.path!r}"
        _check_file_record(record, where, manifest, tier_names, seen_paths, result)
        check_file_tensors(record, where, limits, seen_keys, result)
    return {key for key, _ in seen_keys}


def _check_file_record(
    record: FileRecord,
    where: str,
    manifest: Manifest,
    tier_names: set[str],
    seen_paths: set[str],
    result: ValidationResult,
) -> None:
    """One file's path (safe, unreserved, listed once), rank, size, compression, version, ref, tier, digest."""
    err = result.add_error
    reason = unsafe_path_reason(record.path)
    if reason is not None:
        err(f"unsafe path {record.path!r}: {reason}")
    elif record.path in (MANIFEST_FILENAME, SIGNATURE_FILENAME):
        err(f"unsafe path {record.path!r}: data files may not use a reserved name")
    if record.path in seen_paths:
        err(f"{where} is listed twice")
    seen_paths.add(record.path)
    if not 0 <= record.rank < max(manifest.world_size, 1):
        err(f"{where} has rank {record.rank}, outside world_size {manifest.world_size}")
    if record.size < 0:
        err(f"{where} has a negative size {record.size}")
    if record.compression is not None and (
        record.compression.stored_size < 0 or not -7 <= record.compression.level <= 22
    ):
        err(f"{where} has invalid compression settings {msgspec.to_builtins(record.compression)}")
    if record.version < 0:
        err(f"{where} has a negative version {record.version}")
    if record.ref is not None and (unsafe_path_reason(record.ref) is not None or "/" in record.ref):
        err(f"{where} references checkpoint {record.ref!r}: it must be a single safe name")
    if tier_names and record.tier not in tier_names:
        err(f"{where} is on tier {record.tier!r}, which the manifest does not define")
    if record.digest is None or record.digest == "":
        result.add_warning(f"{where} has no digest; its contents cannot be verified")
    else:
        algorithm = record.digest.partition(":")[0]
        problem = digest_problem(record.digest)
        if problem:
            err(f"{where} has {problem}")
        elif algorithm != manifest.digest_algorithm:
            result.add_warning(f"{where} uses digest {algorithm}, not the manifest's {manifest.digest_algorithm}")
    if record.fast_digest is not None or record.block_size or record.families:
        _check_blocks_and_fast_digest(record, where, err)


def _check_blocks_and_fast_digest(record: FileRecord, where: str, err: Callable[[str], None]) -> None:
    """A file's 1.4/2.1 fields: ``fast_digest`` (an xxh3-128 digest), ``block_size`` (0, or one
    of :data:`BLOCK_SIZES` when the file is not compressed) and ``families`` (which
    :func:`~shardkeep.manifest.decode_manifest` expands into ``tensors``: one left in a manifest
    is refused, so that no tensor of a family goes unseen)."""
    fast = record.fast_digest
    if fast is not None:
        problem = digest_problem(fast) if isinstance(fast, str) else "not a string"
        if problem or fast.partition(":")[0] != FAST_DIGEST:
            err(
                f"{where} has fast_digest {fast!r}: it must be an {FAST_DIGEST} digest ({problem or 'another algorithm'})"
            )
    size = record.block_size
    if size and size not in BLOCK_SIZES:
        err(
            f"{where} has block_size {size!r}: it must be 0 or a power of two from {BLOCK_SIZES[0]} to {BLOCK_SIZES[-1]}"
        )
    elif size and record.compression is not None:
        err(f"{where} has block_size {size} but is compressed: a compressed file is read whole and has no blocks")
    for family in record.families:
        err(f"{where} lists the entry family {family.key!r}, not expanded (decoding a manifest expands them)")


def check_file_tensors(
    record: FileRecord,
    where: str,
    limits: ManifestLimits,
    seen_keys: dict[tuple[str, tuple[int, ...]], str],
    result: ValidationResult,
) -> None:
    """One file's tensor entries: each valid (:func:`check_tensor`), no (key, chunk) in
    ``seen_keys`` (which gains this file's), no byte ranges overlapping."""
    ranges: list[tuple[int, int, str]] = []
    for entry in record.tensors:
        check_tensor(entry, record, where, limits, result)
        ranges.append((entry.offset, entry.offset + entry.nbytes, entry.key))
        chunk = tuple(entry.global_offset or ())
        previous = seen_keys.get((entry.key, chunk))
        if previous is not None:
            result.add_error(f"duplicate key {entry.key!r} (in {previous} and {record.path!r})")
        else:
            seen_keys[(entry.key, chunk)] = repr(record.path)
    ranges.sort()
    for (start_a, end_a, key_a), (start_b, _end_b, key_b) in itertools.pairwise(ranges):
        if start_b < end_a and end_a > start_a:
            result.add_error(f"{where}: byte ranges of {key_a!r} and {key_b!r} overlap")


def _check_parents(manifest: Manifest, table: TensorTable, err: Callable[[str], None], *, columns: bool) -> None:
    """When ``structure`` lists containers, every tensor, value and container has its parent there."""
    containers = {tuple(container.path) for container in manifest.structure}
    if not containers or (columns and parents_pass(manifest, table, containers)):
        return
    orphans = [
        entry.key for record in manifest.files for entry in record.tensors if tuple(entry.path[:-1]) not in containers
    ]
    if isinstance(manifest, IndexedManifest):
        orphans += [tensor.key for tensor in manifest.sharded if tuple(tensor.path[:-1]) not in containers]
    orphans += [value.key for value in manifest.values if tuple(value.path[:-1]) not in containers]
    orphans += [key_for_path(c.path) for c in manifest.structure if c.path and tuple(c.path[:-1]) not in containers]
    if orphans:
        err(f"{len(orphans)} state path(s) have no parent container in structure, e.g. {orphans[0]!r}")


def _check_values(
    manifest: Manifest, tensor_keys: set[str], limits: ManifestLimits, err: Callable[[str], None]
) -> None:
    """Plain values: keys unique (and not a tensor's), ``value`` or ``special`` set, paths matching keys."""
    value_keys: set[str] = set()
    for value in manifest.values:
        if value.key in value_keys or value.key in tensor_keys:
            err(f"duplicate key {value.key!r} in values")
        value_keys.add(value.key)
        if value.special is not None and value.value is not None:
            err(f"value {value.key!r} sets both value and special")
        problem = path_problem(value.key, value.path, limits)
        if problem:
            err(problem)


def _check_containers(manifest: Manifest, limits: ManifestLimits, err: Callable[[str], None]) -> None:
    """Containers are listed once each and are not nested too deeply."""
    container_paths: set[str] = set()
    for container in manifest.structure:
        rendered = repr(container.path)
        if rendered in container_paths:
            err(f"container {key_for_path(container.path)!r} is listed twice")
        container_paths.add(rendered)
        if len(container.path) > limits.max_path_components:
            err(f"container {key_for_path(container.path[:8])!r}...: path is nested too deeply")


def _validate_run(manifest: Manifest, limits: ManifestLimits, result: ValidationResult) -> None:
    """Metrics and the run record (1.1): names are bounded, numbers finite or null."""
    err = result.add_error
    for name, value in manifest.metrics.items():
        if not name or len(name.encode("utf-8", "surrogatepass")) > limits.max_key_bytes:
            err(f"metric name {name[:64]!r} must be non-empty and at most {limits.max_key_bytes} bytes")
        if value is not None and not math.isfinite(value):
            err(f"metric {name!r} is {value}; non-finite metrics are recorded as null")
    _validate_timing(manifest.timing, "timing", err)
    run = manifest.run
    if run is None:
        return
    if len(run.history) > MAX_HISTORY:
        err(f"run history has {len(run.history)} points; at most {MAX_HISTORY}")
    previous = -1
    for index, point in enumerate(run.history[:MAX_HISTORY]):
        if not previous < point.step < (manifest.step if manifest.step is not None else math.inf):
            err(f"run history[{index}]: step {point.step} must be >= 0, after the previous point and before this save")
        previous = max(previous, point.step)
        if any(
            not name
            or len(name.encode("utf-8", "surrogatepass")) > limits.max_key_bytes
            or (value is not None and not math.isfinite(value))
            for name, value in point.metrics.items()
        ):
            err(f"run history[{index}]: metric names must be non-empty and short, values finite numbers or null")
        _validate_timing(point.timing, f"run history[{index}].timing", err)
    if not RUN_ID_PATTERN.fullmatch(run.run_id):
        err(f"run_id {run.run_id[:64]!r} must be 1-128 characters of letters, digits, '.', '_' or '-'")
    if run.fingerprint is not None:
        problem = digest_problem(run.fingerprint)
        if problem:
            err(f"run fingerprint has {problem}")
    for name, value in run.fingerprint_fields.items():
        if isinstance(value, (dict, list)):
            err(f"fingerprint field {name!r} must be a scalar (nested values are flattened to dotted paths)")
    if run.retention is not None:
        policy = run.retention
        if policy.keep_last < 0 or policy.keep_best < 0:
            err(f"retention keep_last={policy.keep_last} and keep_best={policy.keep_best} must be >= 0")
        if not policy.metric:
            err("retention metric must be a non-empty string")


def _validate_timing(timing: SaveTiming | None, where: str, err: Callable[[str], None]) -> None:
    if timing is None:
        return
    for name, value in (("blocked_seconds", timing.blocked_seconds), ("total_seconds", timing.total_seconds)):
        if not math.isfinite(value) or value < 0:
            err(f"{where}.{name}={value} must be a finite number >= 0")
    if timing.blocked_seconds > timing.total_seconds:
        err(f"{where}: blocked_seconds={timing.blocked_seconds} exceeds total_seconds={timing.total_seconds}")


def check_tensor(
    entry: TensorEntry, record: FileRecord, where: str, limits: ManifestLimits, result: ValidationResult
) -> None:
    """Checks for one tensor entry. This runs for every tensor on every load, so the common
    (valid) case does no string formatting and no generator expressions."""

    def err(message: str) -> None:
        result.add_error(f"tensor {entry.key!r} in {where}: {message}")

    key = entry.key
    if len(key) * 4 > limits.max_key_bytes and len(key.encode("utf-8", "surrogatepass")) > limits.max_key_bytes:
        err(f"key is longer than {limits.max_key_bytes} bytes")
    path = entry.path
    if len(path) > limits.max_path_components or (key != path[0] if len(path) == 1 else key != key_for_path(path)):
        problem = path_problem(key, path, limits)
        if problem:
            result.add_error(problem)
    itemsize = DTYPE_ITEMSIZE.get(entry.dtype)
    if itemsize is None:
        err(f"unknown dtype {entry.dtype!r}")
    shape = entry.shape
    if len(shape) > limits.max_ndim:
        err(f"{len(shape)} dimensions, over the limit of {limits.max_ndim}")
        return
    if shape and min(shape) < 0:
        err(f"negative dimension in shape {shape}")
        return
    if itemsize is not None:
        count = math.prod(shape)
        if count * itemsize != entry.nbytes:
            err(f"shape {shape} of {entry.dtype} needs {count * itemsize} bytes, not {entry.nbytes}")
        elif count == 0 and shape_problem(shape, itemsize):
            err(f"shape {short_shape(shape)}: {shape_problem(shape, itemsize)}")
    if entry.offset < 0 or entry.nbytes < 0:
        err("negative byte offset or size")
    elif entry.offset + entry.nbytes > record.size:
        err(f"byte range [{entry.offset}, {entry.offset + entry.nbytes}) is beyond the file size {record.size}")
    if entry.digest is not None:
        problem = digest_problem(entry.digest)
        if problem:
            err(f"has {problem}")
    if entry.blocks:
        _check_blocks(entry, record, err)
    if entry.kind == "expert" and entry.expert_key is None:
        result.add_warning(f"tensor {key!r} in {where}: expert tensor without an expert_key")
    if entry.global_shape is None and entry.global_offset is None:
        return
    if entry.array_type != "torch":
        err("a chunk of a sharded tensor must be a torch tensor")
    if entry.global_shape is None or entry.global_offset is None:
        err("global_shape and global_offset must be given together")
    elif not len(entry.global_shape) == len(entry.global_offset) == len(shape):
        err("shape, global_shape and global_offset have different ranks")
    elif min(entry.global_shape, default=0) < 0 or shape_problem(entry.global_shape, itemsize or 1):
        err(f"global_shape {short_shape(entry.global_shape)}: {shape_problem(entry.global_shape, itemsize or 1)}")
    elif any(o < 0 or o + s > g for o, s, g in zip(entry.global_offset, shape, entry.global_shape, strict=True)):
        err(f"chunk at {entry.global_offset} of shape {shape} lies outside {entry.global_shape}")


def _check_blocks(entry: TensorEntry, record: FileRecord, err: Callable[[str], None]) -> None:
    """An entry's ``blocks``: its file is not compressed and has a block size ``B``, and the
    value holds ``ceil(nbytes / B)`` digests of 16 bytes (fast) or 48 (fast and strong)."""
    held = len(entry.blocks)
    if record.compression is not None:
        err(f"has {held} bytes of blocks but its file is compressed (a compressed file has no blocks)")
        return
    size = record.block_size
    if size <= 0:
        err(f"has {held} bytes of blocks but its file's block_size is {size}")
        return
    if entry.nbytes < 0:
        return  # reported above
    count = -(-entry.nbytes // size)
    if held not in (count * FAST_BLOCK_DIGEST_BYTES, count * _FULL_BLOCK_DIGEST_BYTES):
        err(
            f"blocks hold {held} bytes; its {count} blocks of {size} bytes need {count * FAST_BLOCK_DIGEST_BYTES} "
            f"(fast digests) or {count * _FULL_BLOCK_DIGEST_BYTES} (fast and strong)"
        )


_FULL_BLOCK_DIGEST_BYTES = FAST_BLOCK_DIGEST_BYTES + STRONG_BLOCK_DIGEST_BYTES


def _described_keys(manifest: IndexedManifest) -> set[str]:
    """The keys of the root's described (singleton) sharded tensors and of its values."""
    return {tensor.key for tensor in manifest.sharded} | {value.key for value in manifest.values}


def _check_families(
    manifest: IndexedManifest, keys: set[str], limits: ManifestLimits, err: Callable[[str], None]
) -> list[TensorFamily]:
    """Described tensor families (2.1), checked without expanding one
    (:func:`~shardkeep.manifest.families.family_set_problems`): templates, ranges, instance
    counts, no two families sharing a key, and no entry, described tensor or value of ``keys``
    an instance; then, when ``structure`` lists containers, every instance's parent is one
    (built per distinct parent). Returns the families when all of that holds (each is then
    checked as a described tensor by :func:`~shardkeep.manifest.format2.check_indexed`), else
    ``[]``. Valid families are refused while :data:`~shardkeep.manifest.families.
    READERS_EXPAND_FAMILIES` is false, so that no instance goes unseen."""
    families = manifest.families or []
    if not families:
        return []
    problems = family_set_problems(families, keys, limits.max_tensors)
    if not problems and manifest.structure:
        containers = {tuple(container.path) for container in manifest.structure}
        checked: set[tuple[object, ...]] = set()
        for family in families:
            signature = parents_signature(family)
            if signature in checked:
                continue  # the same parents as a family checked already
            checked.add(signature)
            orphans = family_parents(family) - containers
            if orphans:
                problems.append(
                    f"tensor family {family.key[:80]!r}: {len(orphans)} instance parent(s) are not containers in "
                    f"structure, e.g. {key_for_path(list(min(orphans, key=repr)))!r}"
                )
    for problem in problems:
        err(problem)
    if problems:
        return []
    if not READERS_EXPAND_FAMILIES:
        for family in families:
            err(f"the tensor family {family.key!r} cannot be expanded by this version of shardkeep")
    return families
