"""Reading and verifying committed checkpoints without torch: locating a checkpoint, reading its
manifest (seal, strict decode, validation), and checking its file set, sizes, digests and
shard headers.

``verify`` reports every problem instead of stopping at the first, so a user sees the whole
damage at once. The CLI's ``inspect`` and ``verify`` use this module and never import torch.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from shardkeep.config import ManifestLimits
from shardkeep.dist.plan import coverage_problems
from shardkeep.errors import (
    CheckpointNotFoundError,
    IntegrityError,
    ManifestError,
    ShardkeepError,
    UnsafePathError,
    UnsupportedValueError,
)
from shardkeep.integrity import unseal_manifest
from shardkeep.io import check_shard
from shardkeep.manifest import (
    MANIFEST_FILENAME,
    SIGNATURE_FILENAME,
    Manifest,
    decode_manifest,
    is_staging_name,
    unsafe_path_reason,
    validate_manifest,
)
from shardkeep.storage.base import ByteStore, EntryInfo
from shardkeep.storage.local import LocalStore

__all__ = ["CheckpointLocation", "VerifyReport", "locate", "read_manifest", "verify"]


@dataclass(frozen=True)
class CheckpointLocation:
    """A checkpoint as a store (its parent directory) and its name inside that store."""

    store: ByteStore
    name: str

    def __str__(self) -> str:
        root = getattr(self.store, "root", repr(self.store))
        return f"{root}/{self.name}"


def locate(path: str | os.PathLike[str], storage: ByteStore | None = None) -> CheckpointLocation:
    """Split a checkpoint path into its parent store and name.

    With ``storage``, ``path`` is the checkpoint's name inside that store (one safe component).
    """
    text = os.fspath(path)
    if storage is not None:
        reason = unsafe_path_reason(text)
        if reason is not None or "/" in text:
            raise UnsafePathError(f"checkpoint name {text!r} must be a single safe path component")
        return CheckpointLocation(storage, text)
    if "://" in text:
        raise UnsupportedValueError(
            f"{text!r}: object-store URLs are not supported yet; use a local or shared filesystem path"
        )
    absolute = os.path.abspath(text)
    parent, name = os.path.split(absolute.rstrip("/"))
    if not name:
        raise UnsupportedValueError(f"{text!r} does not name a checkpoint directory")
    return CheckpointLocation(LocalStore(parent or "/"), name)


def read_manifest_bytes(location: CheckpointLocation, limits: ManifestLimits | None = None) -> bytes:
    limits = limits or ManifestLimits()
    if is_staging_name(location.name):
        raise CheckpointNotFoundError(f"{location} is an uncommitted staging directory, not a checkpoint")
    info = location.store.stat(location.name)
    if info is None:
        raise CheckpointNotFoundError(f"no checkpoint at {location}")
    if info.kind != "dir":
        raise CheckpointNotFoundError(f"{location} is not a checkpoint directory")
    manifest_path = f"{location.name}/{MANIFEST_FILENAME}"
    if location.store.stat(manifest_path) is None:
        raise CheckpointNotFoundError(f"{location} has no {MANIFEST_FILENAME}: it is not a committed checkpoint")
    handle = location.store.open_read(manifest_path)
    try:
        if handle.size > limits.max_bytes:
            raise ManifestError(f"{manifest_path} is {handle.size} bytes, over the limit of {limits.max_bytes}")
        buffer = bytearray(handle.size)
        handle.read_into(0, memoryview(buffer))
    finally:
        handle.close()
    return bytes(buffer)


def parse_manifest(data: bytes, *, where: str, limits: ManifestLimits | None = None) -> Manifest:
    """Check the seal, decode strictly and validate; raise on any error."""
    try:
        unseal_manifest(data)
    except IntegrityError as exc:
        raise IntegrityError(f"{where}: {exc}") from exc
    manifest = decode_manifest(data, limits=limits)
    errors = validate_manifest(manifest, limits=limits).errors + coverage_problems(manifest)
    if errors:
        raise ManifestError(f"{where}: invalid manifest: " + "; ".join(errors))
    return manifest


def read_manifest(
    path: str | os.PathLike[str], *, storage: ByteStore | None = None, limits: ManifestLimits | None = None
) -> Manifest:
    """The validated manifest of the committed checkpoint at ``path``."""
    location = locate(path, storage)
    return parse_manifest(read_manifest_bytes(location, limits), where=str(location), limits=limits)


def file_set_problems(
    location: CheckpointLocation, manifest: Manifest, listing: list[tuple[str, EntryInfo]] | None = None
) -> list[str]:
    """Missing, extra and non-regular entries: the files on disk must equal the manifest's.
    ``listing`` is the checkpoint directory's ``list_files`` when the caller already has it."""
    expected = {record.path: record for record in manifest.files}
    allowed = {MANIFEST_FILENAME, SIGNATURE_FILENAME}
    problems: list[str] = []
    found: set[str] = set()
    for relative, info in location.store.list_files(location.name) if listing is None else listing:
        if info.kind != "file":
            problems.append(f"{relative}: is a symlink or special file, not a regular file")
            continue
        found.add(relative)
        if relative not in expected and relative not in allowed:
            problems.append(f"{relative}: extra file not listed in the manifest")
    for relative in expected:
        if relative not in found:
            problems.append(f"{relative}: missing (listed in the manifest)")
    return problems


@dataclass
class VerifyReport:
    """The outcome of :func:`verify`. ``ok`` is true only when ``problems`` is empty."""

    path: str
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    files_checked: int = 0
    bytes_checked: int = 0
    manifest: Manifest | None = None

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(
    path: str | os.PathLike[str],
    *,
    io_threads: int = 2,
    on_bytes: Callable[[int], None] | None = None,
    storage: ByteStore | None = None,
    limits: ManifestLimits | None = None,
) -> VerifyReport:
    """Check a checkpoint completely and report every problem; never raises for bad content.

    Checks the manifest's seal, schema and consistency, that the file set on disk equals the
    manifest's, and each file's size, digest and safetensors header.
    """
    location = locate(path, storage)
    report = VerifyReport(path=str(location))
    try:
        data = read_manifest_bytes(location, limits)
        unseal_manifest(data)
        manifest = decode_manifest(data, limits=limits)
    except ShardkeepError as exc:
        report.problems.append(f"{MANIFEST_FILENAME}: {exc}")
        return report
    report.manifest = manifest
    validation = validate_manifest(manifest, limits=limits)
    validation.errors.extend(coverage_problems(manifest))
    report.problems.extend(f"{MANIFEST_FILENAME}: {message}" for message in validation.errors)
    report.warnings.extend(validation.warnings)
    if validation.errors:
        return report
    try:
        report.problems.extend(file_set_problems(location, manifest))
    except ShardkeepError as exc:
        report.problems.append(f"{location.name}: {exc}")

    def check(record_index: int) -> list[str]:
        record = manifest.files[record_index]
        _, problems = check_shard(
            location.store, f"{location.name}/{record.path}", record, verify=True, keep=False, on_bytes=on_bytes
        )
        return problems

    with ThreadPoolExecutor(max(1, io_threads), thread_name_prefix="shardkeep-verify") as pool:
        for problems in pool.map(check, range(len(manifest.files))):
            report.problems.extend(problems)
    report.files_checked = len(manifest.files)
    report.bytes_checked = sum(record.size for record in manifest.files)
    return report
