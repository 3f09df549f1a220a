"""Reading and verifying committed checkpoints without torch: locating a checkpoint, reading its
manifest (seal, strict decode, validation), and checking its file set, sizes, digests and
shard headers.

``verify`` reports every problem instead of stopping at the first, so a user sees the whole
damage at once. The CLI's ``inspect`` and ``verify`` use this module and never import torch.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from shardkeep.config import ManifestLimits
from shardkeep.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
    IntegrityError,
    ManifestError,
    ShardkeepError,
    SignatureError,
    UnsafePathError,
    UnsupportedValueError,
)
from shardkeep.indexes import expand_all, index_paths, is_partial_view, layouts_of, merged, read_index, read_small
from shardkeep.integrity import (
    MAX_SIGNATURE_BYTES,
    SignaturePolicy,
    SignatureStatus,
    check_signature,
    check_signed_digests,
    key_id,
    load_private_key,
    sign_manifest,
    unseal_manifest,
)
from shardkeep.io import check_shard
from shardkeep.manifest import (
    MANIFEST_FILENAME,
    SIGNATURE_FILENAME,
    FileRecord,
    IndexedManifest,
    Manifest,
    check_manifest,
    decode_manifest,
    is_staging_name,
    unsafe_path_reason,
)
from shardkeep.manifest.node_part import decode_node_part
from shardkeep.names import NODE_PART_FILENAME, check_name_length, is_temporary_sibling
from shardkeep.progress import collector_paused
from shardkeep.storage import (
    ByteStore,
    EntryInfo,
    LocalStore,
    StoreOperations,
    adapt_store,
    local_path,
    open_store,
    renames,
    split_url,
)

__all__ = [
    "CheckpointLocation",
    "read_checked_manifest",
    "FileResolver",
    "VerifyReport",
    "locate",
    "missing_tier_problem",
    "missing_tiers",
    "read_manifest",
    "select_files",
    "sign_checkpoint",
    "verify",
]

TierLocations = Mapping[str, "str | os.PathLike[str] | StoreOperations"]


@dataclass(frozen=True)
class CheckpointLocation:
    """A checkpoint as a store (its parent directory) and its name inside that store."""

    store: ByteStore
    name: str

    def __str__(self) -> str:
        return f"{self.store.root}/{self.name}"


def locate(
    path: str | os.PathLike[str],
    storage: StoreOperations | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> CheckpointLocation:
    """Split a checkpoint path (a local path, or a URL such as ``s3://bucket/prefix/step_1``)
    into its parent store and name.

    With ``storage``, ``path`` is the checkpoint's name inside that store (one safe component).
    ``storage_options`` go to the fsspec filesystem of a URL (credentials, endpoint).
    """
    text = os.fspath(path)
    if storage is not None:
        reason = unsafe_path_reason(text)
        if reason is not None or "/" in text:
            raise UnsafePathError(f"checkpoint name {text!r} must be a single safe path component")
        return CheckpointLocation(adapt_store(storage), text)
    absolute = local_path(text)
    if absolute is None:
        protocol, rest = split_url(text)
        parent, _, name = rest.rpartition("/")
        if not parent:
            raise UnsupportedValueError(f"{text!r} names a bucket, not a checkpoint inside it (s3://bucket/step_1)")
        return CheckpointLocation(open_store(f"{protocol}://{parent}", storage_options), name)
    parent, name = os.path.split(absolute.rstrip("/"))
    if not name:
        raise UnsupportedValueError(f"{text!r} does not name a checkpoint directory")
    check_name_length(name, "checkpoint name")
    return CheckpointLocation(LocalStore(parent or "/"), name)


def read_manifest_bytes(location: CheckpointLocation, limits: ManifestLimits | None = None) -> bytes:
    limits = limits or ManifestLimits()
    if is_staging_name(location.name):
        raise CheckpointNotFoundError(f"{location} is an uncommitted staging directory, not a checkpoint")
    manifest_path = f"{location.name}/{MANIFEST_FILENAME}"
    if renames(location.store):
        info = location.store.stat(location.name)
        if info is None:
            raise CheckpointNotFoundError(f"no checkpoint at {location}")
        if info.kind != "dir":
            raise CheckpointNotFoundError(f"{location} is not a checkpoint directory")
    # On an object store only the manifest object itself proves a checkpoint, never a listing.
    if location.store.stat(manifest_path) is None:
        raise CheckpointNotFoundError(f"{location} has no {MANIFEST_FILENAME}: it is not a committed checkpoint")
    return read_small(location.store, manifest_path, limits.max_bytes, ManifestError)


def authenticate(location: CheckpointLocation, data: bytes, policy: SignaturePolicy) -> SignatureStatus:
    """Check ``manifest.sig`` against ``data`` (the manifest's bytes, not yet parsed) as
    ``policy`` says; raise :class:`SignatureError` when it is not met."""
    path = f"{location.name}/{SIGNATURE_FILENAME}"
    signature = None
    if location.store.stat(path) is not None:
        signature = read_small(location.store, path, MAX_SIGNATURE_BYTES, SignatureError)
    return check_signature(data, signature, policy)


def parse_manifest(data: bytes, *, where: str, limits: ManifestLimits | None = None) -> Manifest:
    """Check the seal, decode strictly and validate; raise on any error."""
    try:
        unseal_manifest(data)
    except IntegrityError as exc:
        raise IntegrityError(f"{where}: {exc}") from exc
    with collector_paused():  # the checks build columns of every tensor entry; see decode_manifest
        manifest = decode_manifest(data, limits=limits)
        errors = check_manifest(manifest, limits=limits).errors
    if errors:
        more = f"; ... and {len(errors) - 20} more problems" if len(errors) > 20 else ""
        raise ManifestError(f"{where}: invalid manifest: " + "; ".join(errors[:20]) + more)
    return manifest


def read_checked_manifest(
    location: CheckpointLocation,
    policy: SignaturePolicy,
    limits: ManifestLimits | None = None,
    *,
    expand: bool = True,
) -> Manifest:
    """Read the manifest, check its signature as ``policy`` says (before parsing), then parse
    and validate it. A format 2.x manifest is expanded with every rank index (checked; see
    :mod:`shardkeep.indexes`) unless ``expand=False``, which returns the manifest alone (what a
    load reads before it expands only the indexes it needs)."""
    data = read_manifest_bytes(location, limits)
    try:
        status = authenticate(location, data, policy) if policy.public_key is not None else None
        manifest = parse_manifest(data, where=str(location), limits=limits)
        if status is not None and status.verified:
            check_signed_digests(manifest, data)
    except SignatureError as exc:
        raise SignatureError(f"{location}: {exc}") from exc
    if expand and isinstance(manifest, IndexedManifest):
        manifest = expand_all(location.store, location.name, manifest, limits=limits)
    return manifest


def read_manifest(
    path: str | os.PathLike[str],
    *,
    storage: StoreOperations | None = None,
    limits: ManifestLimits | None = None,
    storage_options: Mapping[str, Any] | None = None,
    public_key: Any = None,
    require_signature: bool | None = None,
) -> Manifest:
    """The validated manifest of the committed checkpoint at ``path``. With ``public_key`` (an
    ``Ed25519PublicKey`` or the path of a PEM file), ``manifest.sig`` is checked first; see
    :func:`verify` for ``require_signature``. A format 2.x manifest comes with every rank index
    read, checked and expanded into its ``files``, so that it reads like a 1.x manifest."""
    policy = SignaturePolicy.of(public_key, require_signature)
    return read_checked_manifest(locate(path, storage, storage_options), policy, limits)


def sign_checkpoint(
    path: str | os.PathLike[str],
    signer: Any,
    *,
    replace: bool = False,
    storage: StoreOperations | None = None,
    limits: ManifestLimits | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> str:
    """Sign the committed checkpoint at ``path`` after the fact: write ``manifest.sig`` for its
    manifest's exact bytes (which are checked and parsed first). An existing signature is
    replaced only with ``replace``. Returns the signing key's id."""
    private_key = load_private_key(signer)
    location = locate(path, storage, storage_options)
    data = read_manifest_bytes(location, limits)
    signature = sign_manifest(data, private_key, parse_manifest(data, where=str(location), limits=limits))
    target = f"{location.name}/{SIGNATURE_FILENAME}"
    if not replace and location.store.stat(target) is not None:
        raise CheckpointExistsError(f"{location} is already signed ({SIGNATURE_FILENAME} exists); pass replace=True")
    location.store.put_atomic(target, signature)
    return key_id(private_key.public_key())


class FileResolver:
    """Where each file of a checkpoint lives: ``(store, path in that store)``.

    A file is at ``<tier store>/<owner>/<path>``: the tier store is the checkpoint's own store
    for a tier without a location, else the tier's location (or what ``tier_locations`` remaps
    it to: a path, a URL or a byte store); the owner is the record's ``ref`` (an earlier
    checkpoint in the same root whose unchanged file this one references) or the checkpoint.
    Stores are opened once, when first needed.
    """

    def __init__(
        self,
        location: CheckpointLocation,
        manifest: Manifest,
        *,
        tier_locations: TierLocations | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.location = location
        self.tiers = {tier.name: tier for tier in manifest.tiers}
        if tier_locations is not None and not isinstance(tier_locations, Mapping):
            raise ConfigError("tier_locations= must map tier names to paths, URLs or byte stores")
        remapped = dict(tier_locations or {})
        for tier_name, place in remapped.items():
            if not isinstance(place, (str, os.PathLike)) and not callable(getattr(place, "open_read", None)):
                raise ConfigError(f"tier_locations[{tier_name!r}]={place!r} must be a path, a URL or a byte store")
        unknown = sorted(set(remapped) - set(self.tiers))
        if unknown:
            raise ConfigError(
                f"tier_locations names unknown tier(s) {unknown}; the checkpoint defines {sorted(self.tiers)}"
            )
        self._remapped = remapped
        self._options = storage_options
        self._stores: dict[str, ByteStore] = {}

    def store_of(self, tier: str) -> ByteStore:
        """The store holding files of ``tier``."""
        store = self._stores.get(tier)
        if store is not None:
            return store
        given = self._remapped.get(tier)
        definition = self.tiers.get(tier)
        if given is None and (definition is None or definition.location is None):
            store = self.location.store
        elif given is None:
            assert definition is not None and definition.location is not None
            store = open_store(definition.location, self._options)
        elif isinstance(given, (str, os.PathLike)):
            store = open_store(given, self._options)
        else:
            store = adapt_store(given)
        self._stores[tier] = store
        return store

    def own_directory(self, record: FileRecord) -> bool:
        """Whether ``record`` lies inside the checkpoint's own directory. Never opens a tier's
        location (which may fail: a backend not installed, a bucket offline): a tier given by
        a path or URL is always elsewhere."""
        if record.ref is not None:
            return False
        given = self._remapped.get(record.tier)
        definition = self.tiers.get(record.tier)
        if given is None and (definition is None or definition.location is None):
            return True
        if given is None or isinstance(given, (str, os.PathLike)):
            return False
        return self.store_of(record.tier) is self.location.store

    def __call__(self, record: FileRecord) -> tuple[ByteStore, str]:
        owner = record.ref or self.location.name
        return self.store_of(record.tier), f"{owner}/{record.path}"

    def annotate(self, record: FileRecord, problems: list[str]) -> list[str]:
        """``problems`` of a file outside the checkpoint's own directory, saying where it is."""
        if not problems or self.own_directory(record):
            return problems
        return [f"{problem} (at {self.describe(record)})" for problem in problems]

    def describe(self, record: FileRecord) -> str:
        store, path = self(record)
        return f"{store.root}/{path}"


#: How :func:`missing_tiers` begins the finding of a tier location that holds nothing.
_NOTHING_AT = "nothing at "


def missing_tiers(resolver: FileResolver, manifest: Manifest, tiers: Iterable[str] | None = None) -> dict[str, str]:
    """The tiers (of ``tiers``, default all) kept outside the checkpoint's directory whose
    location holds nothing of the checkpoint, or cannot be opened or read: tier name -> where it
    was looked for and what was found. One ``stat`` per tier and owner; files are not opened."""
    wanted = None if tiers is None else set(tiers)
    owners: dict[str, set[str]] = {}
    missing: dict[str, str] = {}
    for record in manifest.files:
        if (wanted is not None and record.tier not in wanted) or record.tier in missing:
            continue
        try:
            store = resolver.store_of(record.tier)
        except ShardkeepError as exc:  # its location cannot be opened here (a backend missing ...)
            missing[record.tier] = str(exc)
            continue
        if store is resolver.location.store:
            continue  # beside the manifest (or remapped there): the file-set check covers it
        owners.setdefault(record.tier, set()).add(record.ref or resolver.location.name)
    for tier, names in sorted(owners.items()):
        if tier in missing:
            continue
        store = resolver.store_of(tier)
        root = store.root.rstrip("/")
        absent = []
        for owner in sorted(names):
            try:
                info = store.stat(owner)
            except ShardkeepError as exc:
                missing[tier] = f"{root}/{owner}: {exc}"
                break
            if info is None:
                absent.append(f"{root}/{owner}")
        else:
            if len(absent) == len(names):
                missing[tier] = f"{_NOTHING_AT}{', '.join(absent)}"
    return missing


def missing_tier_problem(tier: str, found: str, remap_hint: str, remapped: bool) -> str:
    """One problem for a tier whose location is missing or cannot be read (``found``, as
    :func:`missing_tiers` says it), saying how to point at its new place."""
    hint = remap_hint.format(tier=tier)
    state = "is missing" if found.startswith(_NOTHING_AT) else "cannot be read"
    if remapped:
        return f"tier {tier!r} {state}: {found}; check the location given for it ({hint})"
    return f"tier {tier!r} {state}: {found} (moved, unmounted or offline?); if it moved, remap it: {hint}"


def select_files(manifest: Manifest, tiers: Iterable[str] | None) -> list[int]:
    """Indices of the files on the selected tiers (every file when ``tiers`` is ``None``),
    refusing tier names the checkpoint does not define."""
    if tiers is None:
        return list(range(len(manifest.files)))
    if isinstance(tiers, str):
        tiers = {tiers}
    if not isinstance(tiers, Iterable):
        raise ConfigError(f"tiers={tiers!r} must be a set of tier names")
    wanted = set(tiers)
    if not all(isinstance(name, str) for name in wanted):
        raise ConfigError(f"tiers={sorted(map(repr, wanted))} must be tier names (strings)")
    defined = {tier.name for tier in manifest.tiers} | {record.tier for record in manifest.files}
    unknown = sorted(wanted - defined)
    if unknown:
        raise ConfigError(
            f"tiers={sorted(wanted)} names unknown tier(s) {unknown}; the checkpoint defines {sorted(defined)}"
        )
    return [index for index, record in enumerate(manifest.files) if record.tier in wanted]


def file_set_problems(
    location: CheckpointLocation,
    manifest: Manifest,
    listing: list[tuple[str, EntryInfo]] | None = None,
    resolver: FileResolver | None = None,
    *,
    holds: Collection[str] | None = None,
) -> list[str]:
    """Missing, extra and non-regular entries in the checkpoint's own directory: its files must
    equal the manifest's records that live there. ``listing`` is the directory's
    ``list_files`` when the caller already has it.

    ``holds``: the directory is one node's part of a node-local step, which must hold these
    data files (and every index, and ``node-part.json``); other files of the manifest may be
    there too (healed copies), files the manifest does not list may not.

    On an object store a listing proves nothing and other attempts' leftovers may sit
    beside the committed objects: only the committed objects' presence is checked there, by
    reading each of them.
    """
    if not renames(location.store):
        return []
    resolver = resolver or FileResolver(location, manifest)
    expected: dict[str, FileRecord | None] = {
        record.path: record for record in manifest.files if resolver.own_directory(record)
    }
    expected.update((path, None) for path in index_paths(manifest))
    allowed = {MANIFEST_FILENAME, SIGNATURE_FILENAME}
    if holds is not None:
        allowed |= {NODE_PART_FILENAME, *expected}
        expected = {path: record for path, record in expected.items() if record is None or path in holds}
    # A load of a format 2.x checkpoint expands only the indexes it needs: the files the others
    # list are not known, so only missing files are reported.
    complete = not is_partial_view(manifest)
    problems: list[str] = []
    found: set[str] = set()
    for relative, info in location.store.list_files(location.name) if listing is None else listing:
        if info.kind != "file":
            problems.append(f"{relative}: is a symlink or special file, not a regular file")
            continue
        found.add(relative)
        if holds is not None and is_temporary_sibling(relative.rpartition("/")[2]):
            # A node's part: a replica or heal whose sender or receiver was killed mid-file
            # left its temporary file; never read, removed by the next save's cleanup.
            continue
        if complete and relative not in expected and relative not in allowed:
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
    signature: str = "not checked"

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(
    path: str | os.PathLike[str],
    *,
    io_threads: int = 2,
    on_bytes: Callable[[int], None] | None = None,
    storage: StoreOperations | None = None,
    limits: ManifestLimits | None = None,
    tiers: Iterable[str] | None = None,
    tier_locations: TierLocations | None = None,
    storage_options: Mapping[str, Any] | None = None,
    public_key: Any = None,
    require_signature: bool | None = None,
) -> VerifyReport:
    """Check a checkpoint completely and report every problem; never raises for bad content.

    Checks the manifest's seal, schema and consistency, that the file set on disk equals the
    manifest's, and each file's size, digest, version and safetensors header, wherever it lives
    (tier locations, files referenced from earlier checkpoints). ``tiers`` limits the data
    checks to those tiers; ``tier_locations`` remaps moved tiers.

    With ``public_key`` (an ``Ed25519PublicKey`` or the path of a PEM file), ``manifest.sig``
    must be a valid signature by that key over the manifest's exact bytes; it is checked before
    the manifest is parsed, and a failure stops the check there. A missing signature is then a
    problem too, unless ``require_signature=False``. Without a key, a present signature is
    only checked for form; ``report.signature`` says what was found.
    """
    location = locate(path, storage, storage_options)
    policy = SignaturePolicy.of(public_key, require_signature)
    report = VerifyReport(path=str(location))
    manifest = _verify_read_manifest(report, location, policy, limits)
    if manifest is None or not _verify_consistency(report, manifest, limits):
        return report
    if isinstance(manifest, IndexedManifest):
        manifest = _verify_indexes(report, location, manifest, limits)
        if manifest is None:
            return report
    with collector_paused():  # many small header objects, no cycles (see LoadJob.run)
        _verify_data_files(
            report,
            location,
            manifest,
            tiers=tiers,
            tier_locations=tier_locations,
            storage_options=storage_options,
            io_threads=io_threads,
            on_bytes=on_bytes,
        )
    return report


def _verify_read_manifest(
    report: VerifyReport, location: CheckpointLocation, policy: SignaturePolicy, limits: ManifestLimits | None
) -> Manifest | None:
    """Phase 1 of :func:`verify`: read the manifest's bytes, check its signature, unseal and
    decode it (and check the signed digests). Returns ``None`` when a problem stops the check
    here (it is in ``report``)."""
    try:
        data = read_manifest_bytes(location, limits)
    except ShardkeepError as exc:
        report.problems.append(f"{MANIFEST_FILENAME}: {exc}")
        return None
    status = _verify_signature(report, location, data, policy)
    if status is None:
        return None
    try:
        unseal_manifest(data)
        manifest = decode_manifest(data, limits=limits)
        if status.verified:
            check_signed_digests(manifest, data)
    except ShardkeepError as exc:
        report.problems.append(f"{MANIFEST_FILENAME}: {exc}")
        return None
    report.manifest = manifest
    return manifest


def _verify_signature(
    report: VerifyReport, location: CheckpointLocation, data: bytes, policy: SignaturePolicy
) -> SignatureStatus | None:
    """Check ``manifest.sig`` against the manifest's bytes as ``policy`` says and record what
    was found in ``report``. Returns ``None`` when a key was given and the check failed: an
    unauthenticated manifest is not parsed."""
    try:
        status = authenticate(location, data, policy)
    except ShardkeepError as exc:
        report.signature = "invalid" if policy.public_key is not None else "malformed"
        report.problems.append(f"{SIGNATURE_FILENAME}: {exc}")
        if policy.public_key is not None:
            return None
        return SignatureStatus(False, report.signature)
    report.signature = status.text
    return status


def _verify_consistency(report: VerifyReport, manifest: Manifest, limits: ManifestLimits | None) -> bool:
    """Phase 2 of :func:`verify`: validate the manifest and check that the chunks of each
    sharded tensor tile it exactly once. Returns whether the data files can be checked."""
    validation = check_manifest(manifest, limits=limits)
    report.problems.extend(f"{MANIFEST_FILENAME}: {message}" for message in validation.errors)
    report.warnings.extend(validation.warnings)
    return not validation.errors


def _verify_indexes(
    report: VerifyReport, location: CheckpointLocation, manifest: IndexedManifest, limits: ManifestLimits | None
) -> Manifest | None:
    """Phase 2b of :func:`verify` (format 2.x): read and check every rank index, reporting each
    bad one, then check that all chunks together tile each tensor exactly once. Returns the
    expanded manifest, or ``None`` when a problem stops the check here."""
    parts = []
    records = manifest.index_records()
    layouts = layouts_of(manifest)
    for record in records:
        try:
            parts.append(read_index(location.store, location.name, manifest, record, limits, layouts))
        except ShardkeepError as exc:
            report.problems.append(str(exc))
    if len(parts) < len(records):
        return None
    try:
        view = merged(location.name, manifest, parts, complete=True)
    except ShardkeepError as exc:
        report.problems.append(str(exc))
        return None
    report.manifest = view
    return view


def _node_part_holds(report: VerifyReport, location: CheckpointLocation) -> set[str] | None:
    """The data files a node's part of a node-local step holds (its ``node-part.json``), with a
    warning saying that only they are checked; ``None`` for an ordinary checkpoint."""
    where = f"{location.name}/{NODE_PART_FILENAME}"
    if not renames(location.store) or location.store.stat(where) is None:
        return None
    try:
        part = decode_node_part(read_small(location.store, where, 64 * 2**20, ManifestError), where=str(location))
    except ShardkeepError as exc:
        report.problems.append(f"{NODE_PART_FILENAME}: {exc}")
        return None
    holds = part.holds()  # by design, healed, and peer replicas
    report.warnings.append(
        f"node {part.node}'s part of a node-local step ({part.nodes} nodes): only its {len(holds)} data files "
        "are here and checked; the other nodes hold the rest"
    )
    return holds


def _verify_data_files(
    report: VerifyReport,
    location: CheckpointLocation,
    manifest: Manifest,
    *,
    tiers: Iterable[str] | None,
    tier_locations: TierLocations | None,
    storage_options: Mapping[str, Any] | None,
    io_threads: int,
    on_bytes: Callable[[int], None] | None,
) -> None:
    """Phase 3 of :func:`verify`: the file set of the checkpoint's own directory, then each
    selected file's size, digest, version and header, wherever it lives, ``io_threads`` at once."""
    try:
        selected = select_files(manifest, tiers)
        resolver = FileResolver(location, manifest, tier_locations=tier_locations, storage_options=storage_options)
    except ShardkeepError as exc:
        report.problems.append(str(exc))
        return
    holds = _node_part_holds(report, location)
    if holds is not None:
        selected = [index for index in selected if manifest.files[index].path in holds]
    try:
        report.problems.extend(file_set_problems(location, manifest, resolver=resolver, holds=holds))
    except ShardkeepError as exc:
        report.problems.append(f"{location.name}: {exc}")

    def check(record_index: int) -> list[str]:
        record = manifest.files[record_index]
        try:
            store, where = resolver(record)
        except ShardkeepError as exc:
            return [f"{record.path}: {exc}"]
        _, problems = check_shard(store, where, record, verify=True, keep=False, on_bytes=on_bytes, digest="all")
        return resolver.annotate(record, problems)

    if len(selected) <= 1 or io_threads <= 1:  # no pool: starting its thread costs more than one file
        for problems in map(check, selected):
            report.problems.extend(problems)
    else:
        with ThreadPoolExecutor(min(io_threads, len(selected)), thread_name_prefix="shardkeep-verify") as pool:
            for problems in pool.map(check, selected):
                report.problems.extend(problems)
    report.files_checked = len(selected)
    report.bytes_checked = sum(manifest.files[index].size for index in selected)
