"""The manifest of a save, built and committed in one way for every writer (``sk.save``,
``async_save`` and the DCP adapter's ``ShardkeepWriter``): the state's sections and training
fields, metric values, the dominant precision, the sharded-tensor descriptions of format 2.x,
and :func:`commit_manifest`, which checks, seals, signs and commits it."""

from __future__ import annotations

import itertools
import logging
import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec
import torch

from shardkeep.config import ManifestLimits
from shardkeep.distributed.commit import CheckpointCommit
from shardkeep.errors import CommitRefusedError, UnsupportedValueError
from shardkeep.integrity import CRYPTOGRAPHIC_DIGESTS, digest_bytes, seal_manifest, sign_manifest
from shardkeep.layout import PlannedItem, expert_key_of
from shardkeep.manifest import (
    COMPATIBLE_INDEXED_VERSION,
    COMPATIBLE_METADATA_VERSION,
    DTYPE_ITEMSIZE,
    INDEXED_VERSION,
    WRITTEN_INDEXED_VERSION,
    WRITTEN_METADATA_VERSION,
    ContainerEntry,
    EntryFamily,
    FileRecord,
    IndexedManifest,
    IndexTable,
    Manifest,
    Mesh,
    RunInfo,
    ShardedTensor,
    Sharding,
    StateSection,
    TensorEntry,
    TensorFamily,
    Tier,
    Training,
    ValueEntry,
    encode_manifest,
    has_chunks,
    validate_manifest,
)
from shardkeep.manifest.families import detect_entry_families, detect_tensor_families
from shardkeep.names import MAX_STEP, step_of_name
from shardkeep.saving.wire import Descriptions, RankReport, merged_descriptions
from shardkeep.tensors.coverage import coverage_problems
from shardkeep.tensors.flatten import as_manifest_mapping
from shardkeep.tensors.keys import ROUTER_KEY

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

__all__ = [
    "DEFAULT_TIER",
    "OPTIMIZER_NAMES",
    "RecordedFields",
    "Sections",
    "commit_manifest",
    "describe_sharded",
    "detect_entry_families_ahead",
    "families_of",
    "indexed_manifest",
    "indexed_version",
    "merged_structure",
    "metadata_version",
    "metric_values",
    "new_manifest",
    "plain_json_mapping",
    "precision_of",
    "require_cryptographic_digest",
    "state_sections",
    "step_of",
    "training_fields",
    "warn_if_over_read_limits",
    "with_entry_families",
]

logger = logging.getLogger("shardkeep")

#: The tier of a save that names none.
DEFAULT_TIER = "hot"

#: Top-level names whose values are an optimizer's state even as plain mappings (an async save's
#: snapshot, a DCP state dict).
OPTIMIZER_NAMES = frozenset({"optim", "optimizer"})

_PRECISION = {"F32": "fp32", "BF16": "bf16", "F16": "fp16", "F64": "fp64", "F8_E4M3": "fp8", "F8_E5M2": "fp8"}


class Sections(NamedTuple):
    """What a manifest records about the state's parts: the optimizer and router sections and
    the detected training fields."""

    optim: StateSection | None
    router: StateSection | None
    training: Training


def state_sections(state: Mapping[str, Any], keys: list[str]) -> Sections:
    """The sections of ``state`` (whose tensors have ``keys``): the optimizer section names the
    top-level entries that are optimizers or are named in :data:`OPTIMIZER_NAMES`, the router
    section the prefixes of router keys; the training fields come from the first optimizer."""
    optim_prefixes = sorted(
        str(name)
        for name, value in state.items()
        if isinstance(value, torch.optim.Optimizer) or name in OPTIMIZER_NAMES
    )
    router_prefixes = sorted(
        {key[: match.end()] for key in keys if "router" in key and (match := ROUTER_KEY.search(key))}
    )
    training = Training()
    for name in optim_prefixes:
        optimizer = state.get(name)
        if isinstance(optimizer, torch.optim.Optimizer):
            training.optimizer_type = type(optimizer).__name__
            lr = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
            training.learning_rate = float(lr) if isinstance(lr, (int, float)) else None
            break
    optim = StateSection(prefixes=optim_prefixes, description="optimizer state") if optim_prefixes else None
    router = StateSection(prefixes=router_prefixes, description="router weights and state") if router_prefixes else None
    return Sections(optim, router, training)


def metadata_version(block_size: int | None) -> str:
    """The version a save without sharded tensors writes with ``WriteOptions.block_size``: 1.3
    with ``block_size=0`` (no fast digests, no blocks), else 1.4."""
    return COMPATIBLE_METADATA_VERSION if block_size == 0 else WRITTEN_METADATA_VERSION


def indexed_version(block_size: int | None) -> str:
    """The version a sharded save writes (root and indexes) with ``WriteOptions.block_size``: 2.0
    with ``block_size=0``, else 2.1."""
    return COMPATIBLE_INDEXED_VERSION if block_size == 0 else WRITTEN_INDEXED_VERSION


class RecordedFields(NamedTuple):
    """What the caller asks a manifest to record, beside what the save itself knows."""

    model_id: str | None = None
    step: int | None = None
    epoch: int | None = None
    training: Mapping[str, Any] | None = None
    sharding_strategy: str | None = None
    #: Checked already (:func:`plain_json_mapping`, :func:`metric_values`).
    custom_fields: dict[str, Any] | None = None
    metrics: dict[str, float | None] | None = None
    run: RunInfo | None = None


def new_manifest(
    records: list[FileRecord],
    fields: RecordedFields,
    sections: Sections,
    *,
    digest: str,
    world_size: int,
    chunked: bool,
    precision: str | None,
    tiers: list[Tier],
    structure: list[ContainerEntry],
    values: list[ValueEntry],
    version: str = WRITTEN_METADATA_VERSION,
) -> Manifest:
    """A format 1.x manifest of ``records`` (the coordinator merges every rank's records into
    it; format 2.x is built from it by :func:`indexed_manifest`). The sharding strategy, unless
    given, is ``dtensor`` with chunks, ``replicated`` on several ranks, else ``none``."""
    strategy = fields.sharding_strategy or ("dtensor" if chunked else "replicated" if world_size > 1 else "none")
    return Manifest(
        metadata_version=version,
        model_id=fields.model_id,
        step=fields.step,
        epoch=fields.epoch,
        world_size=world_size,
        digest_algorithm=digest,
        sharding=Sharding(strategy=strategy, shard_count=len(records), precision=precision),
        training=training_fields(fields.training, sections.training),
        tiers=tiers,
        files=records,
        optim_state=sections.optim,
        router_state=sections.router,
        structure=structure,
        values=values,
        custom_fields=fields.custom_fields if fields.custom_fields is not None else {},
        metrics=fields.metrics if fields.metrics is not None else {},
        run=fields.run,
    )


def step_of(state: Mapping[str, Any], name: str) -> int | None:
    """The step a state records in its top-level ``"step"`` key (an int >= 0, not a bool), which
    a save without ``step=`` to checkpoint ``name`` records as the checkpoint's step, unless it
    contradicts the name: ``step_<N>`` with another ``N`` (a directory counting saves while the
    state holds the next step to run) would make the checkpoint misnamed."""
    value = state.get("step")
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_STEP:
        return None
    named = step_of_name(name)
    return value if named is None or named == value else None


def metric_values(metrics: Mapping[str, Any] | None) -> dict[str, float | None]:
    """Metrics as recorded: finite floats, or ``None`` for NaN and infinities."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise UnsupportedValueError(f"metrics= must be a mapping of names to numbers, got {type(metrics).__name__}")
    recorded: dict[str, float | None] = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name:
            raise UnsupportedValueError(f"metric name {name!r} must be a non-empty string")
        try:
            if value is not None and hasattr(value, "item") and callable(value.item):
                value = value.item()  # a 0-d tensor or numpy scalar
            if value is None:
                recorded[name] = None
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                raise UnsupportedValueError(f"metric {name!r}={value!r} must be a number")
            else:
                number = float(value)
                recorded[name] = number if math.isfinite(number) else None
        except (RuntimeError, ValueError, OverflowError) as exc:
            raise UnsupportedValueError(f"metric {name!r} must be a single finite-size number: {exc}") from exc
    return recorded


def plain_json_mapping(name: str, value: Mapping[str, Any] | None) -> dict[str, Any]:
    """The option ``name`` (``custom_fields=``) as a dict, refused unless plain JSON."""
    if value is None:
        return {}
    plain = as_manifest_mapping(value)
    if plain is None:
        raise UnsupportedValueError(
            f"{name}= must be a mapping of plain JSON values (string keys, finite numbers, lists, dicts)"
        )
    return plain


def training_fields(given: Mapping[str, Any] | None, detected: Training) -> Training:
    """The manifest's training fields: ``given`` (``training=``) over what the state showed."""
    if not given:
        return detected
    unknown = set(given) - {"learning_rate", "optimizer_type"}
    if unknown:
        raise UnsupportedValueError(
            f"training= has unknown fields {sorted(unknown)}; known: learning_rate, optimizer_type"
        )
    learning_rate = given.get("learning_rate", detected.learning_rate)
    if learning_rate is not None and (
        isinstance(learning_rate, bool)
        or not isinstance(learning_rate, (int, float))
        or not math.isfinite(learning_rate)
    ):
        raise UnsupportedValueError(f"training learning_rate={learning_rate!r} must be a finite number")
    optimizer_type = given.get("optimizer_type", detected.optimizer_type)
    if optimizer_type is not None and not isinstance(optimizer_type, str):
        raise UnsupportedValueError(f"training optimizer_type={optimizer_type!r} must be a string")
    return Training(
        learning_rate=None if learning_rate is None else float(learning_rate), optimizer_type=optimizer_type
    )


def precision_of(totals: Mapping[str, tuple[int, str]]) -> str | None:
    """The floating-point dtype holding the most bytes, as fp32/bf16/fp16/fp64/fp8, of
    ``totals`` (each key's (bytes, dtype))."""
    float_bytes: dict[str, int] = {}
    for nbytes, dtype in totals.values():
        if dtype in _PRECISION:
            float_bytes[dtype] = float_bytes.get(dtype, 0) + nbytes
    return _PRECISION[max(float_bytes, key=float_bytes.__getitem__)] if float_bytes else None


def describe_sharded(planned: list[PlannedItem], tier_of: Mapping[str, str], tiers: list[Tier]) -> Descriptions:
    """The meshes and the descriptions of the regularly sharded tensors among ``planned``."""
    tier_ids = {tier.name: tier.tier_id for tier in tiers}
    meshes: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    described: dict[str, ShardedTensor] = {}
    for item in planned:
        if item.layout is None or item.leaf.key in described:
            continue
        mesh_shape, ranks, _, placements = item.layout
        mesh = meshes.setdefault((mesh_shape, ranks), len(meshes))
        key = item.leaf.key
        expert = expert_key_of(key, tier_ids.get(tier_of.get(key, ""), 1))
        assert item.global_shape is not None
        described[key] = ShardedTensor(
            key=key,
            path=list(item.leaf.path),
            dtype=item.dtype,
            global_shape=list(item.global_shape),
            mesh=mesh,
            placements=list(placements),
            kind="expert" if expert else "dense",
            expert_key=expert,
            order=item.leaf.order,
        )
    mesh_list = [
        Mesh(shape=list(shape), ranks=None if list(ranks) == list(range(len(ranks))) else list(ranks))
        for (shape, ranks) in meshes
    ]
    return Descriptions(mesh_list, sorted(described.values(), key=lambda tensor: tensor.key))


def indexed_manifest(
    manifest: Manifest, descriptions: Descriptions | None, reports: list[RankReport], location: object
) -> IndexedManifest:
    """The format 2.x manifest: the sharded tensors described once (``descriptions``, or, when
    ``None`` because the ranks hold different trees, merged from every rank's report), and the
    rank indexes; refused unless the ranks' indexed chunks hold exactly the described bytes."""
    meshes, sharded = descriptions if descriptions is not None else merged_descriptions(reports)
    expected = sum(math.prod(t.global_shape) * DTYPE_ITEMSIZE.get(t.dtype, 1) for t in sharded)
    written = sum(report.indexed_bytes for report in reports)
    if written != expected:
        raise CommitRefusedError(
            f"cannot commit {location}: the ranks wrote {written} bytes of chunks of sharded tensors, "
            f"but those tensors hold {expected} bytes"
        )
    base = {name: getattr(manifest, name) for name in Manifest.__struct_fields__}
    compatible = manifest.metadata_version == COMPATIBLE_METADATA_VERSION
    base["metadata_version"] = COMPATIBLE_INDEXED_VERSION if compatible else WRITTEN_INDEXED_VERSION
    families, sharded = families_of(sharded, base["metadata_version"])
    indexed = IndexedManifest(
        **base,
        meshes=meshes,
        sharded=sharded,
        indexes=msgspec.structs.replace(
            IndexTable.of([report.index for report in reports if report.index is not None]),
            refs=sorted({ref for report in reports for ref in report.refs}),
        ),
    )
    if families:
        indexed.families = families
    return indexed


#: Whether sharded saves describe tensors that differ only in the integers of their keys as
#: tensor families (:func:`families_of`); only roots of :data:`INDEXED_VERSION` hold them.
WRITE_FAMILIES = True


def families_of(
    sharded: list[ShardedTensor], version: str = INDEXED_VERSION
) -> tuple[list[TensorFamily], list[ShardedTensor]]:
    """The tensor families (format 2.1) and the remaining singletons of a root of ``version``
    describing ``sharded``: detected (:func:`~shardkeep.manifest.families.detect_tensor_families`,
    their instances are exactly those tensors) when ``version`` is :data:`INDEXED_VERSION` (a
    save that writes 2.0, ``WriteOptions(block_size=0)``, gets none) and :data:`WRITE_FAMILIES`
    is on; else no family and ``sharded`` itself. Singletons stay in key order."""
    if not WRITE_FAMILIES or version != INDEXED_VERSION or len(sharded) < 2:
        return [], sharded
    families, singles = _TENSOR_DETECTION.detect(sharded, detect_tensor_families, TensorFamily)
    families.sort(key=lambda family: family.key)
    singles.sort(key=lambda tensor: tensor.key)
    return families, singles


class _LastDetection:
    """The input and result of the last family detections of one kind, so that a training run,
    which saves the same tree again and again, detects the families of a tree once: an input
    equal to one of the last ``kept`` (compared by the BLAKE3 digest of its msgpack bytes,
    which no later change to the input objects can alter) gets that result again, as new family objects and, for
    singletons, the members of the new input at the same positions. Thread-safe (async saves
    commit on background threads)."""

    def __init__(self, kept: int) -> None:
        self._kept = kept
        self._lock = threading.Lock()
        self._results: dict[str, tuple[bytes, list[int]]] = {}

    def detect(
        self,
        members: Sequence[Any],
        detect: Callable[[Sequence[Any]], tuple[list[Any], list[Any]]],
        family_type: type[Any],
    ) -> tuple[list[Any], list[Any]]:
        key = digest_bytes("blake3", _DETECTION_ENCODER.encode(members))
        with self._lock:
            found = self._results.get(key)
        if found is not None:
            encoded, positions = found
            families = msgspec.msgpack.decode(encoded, type=list[family_type])  # type: ignore[valid-type]
            return families, [members[position] for position in positions]
        families, singles = detect(members)
        position_of = {id(member): position for position, member in enumerate(members)}
        result = (_DETECTION_ENCODER.encode(families), [position_of[id(single)] for single in singles])
        with self._lock:
            if len(self._results) >= self._kept:
                self._results.pop(next(iter(self._results)))
            self._results[key] = result
        return families, singles


_DETECTION_ENCODER = msgspec.msgpack.Encoder()
_TENSOR_DETECTION = _LastDetection(kept=8)
#: Per file: a root lists a few files of whole tensors (rank 0's), each detected alone.
_ENTRY_DETECTION = _LastDetection(kept=64)


def with_entry_families(manifest: Manifest) -> Manifest:
    """What a root of :data:`INDEXED_VERSION` records of ``manifest`` (with
    :data:`WRITE_FAMILIES`): each file's whole tensors that differ only in the integers of their
    keys, with affine orders and byte offsets, as entry families
    (:func:`~shardkeep.manifest.families.detect_entry_families`); a copy, ``manifest`` is left
    as it is. Only a file whose entries are in strictly increasing byte order is rewritten,
    since a reader puts the instances back in that order. Else ``manifest`` itself."""
    if not WRITE_FAMILIES or not isinstance(manifest, IndexedManifest) or manifest.metadata_version != INDEXED_VERSION:
        return manifest
    files: list[FileRecord] = []
    changed = False
    for record in manifest.files:
        families, singles = _entry_families_of(record)
        if families:
            changed = True
            families.sort(key=lambda family: family.offset)
            singles.sort(key=lambda entry: entry.offset)
            record = msgspec.structs.replace(record, tensors=singles, families=families)
        files.append(record)
    return msgspec.structs.replace(manifest, files=files) if changed else manifest


def _entry_families_of(record: FileRecord) -> tuple[list[EntryFamily], list[TensorEntry]]:
    """The entry families of one file (none unless its entries are in strictly increasing byte
    order) and the entries left as they are; detected once per equal list of entries."""
    offsets = [entry.offset for entry in record.tensors]
    if len(offsets) > 1 and all(a < b for a, b in itertools.pairwise(offsets)):
        return _ENTRY_DETECTION.detect(record.tensors, detect_entry_families, EntryFamily)
    return [], record.tensors


def detect_entry_families_ahead(records: Iterable[FileRecord], version: str) -> None:
    """Detect the entry families a root of ``version`` records for ``records`` ahead of the
    commit, so that :func:`with_entry_families` finds them remembered: the coordinator runs it
    on its own files once they are written, while other ranks still write theirs."""
    if WRITE_FAMILIES and version == INDEXED_VERSION:
        for record in records:
            _entry_families_of(record)


def merged_structure(own: list[ContainerEntry], others: list[list[ContainerEntry]]) -> list[ContainerEntry]:
    """The coordinator's containers plus those only other ranks hold (expert-parallel ranks
    hold different experts); ranks that disagree about a container's kind are refused."""
    merged = {tuple(entry.path): entry for entry in own}
    for containers in others:
        for entry in containers:
            known = merged.setdefault(tuple(entry.path), entry)
            if known.kind != entry.kind:
                raise UnsupportedValueError(
                    f"ranks disagree about the container at {'.'.join(map(str, entry.path)) or '<root>'}: "
                    f"{known.kind} and {entry.kind}"
                )
    return list(merged.values())


def require_cryptographic_digest(signer: object, digest: str) -> None:
    """Refuse a signer beside a non-cryptographic digest: a signature covers the data only
    through the digests."""
    if signer is not None and digest not in CRYPTOGRAPHIC_DIGESTS:
        raise UnsupportedValueError(
            f"signer= needs a cryptographic digest, not digest={digest!r}: a signature covers the "
            "data only through the digests (use 'blake3' or 'sha256')"
        )


def warn_if_over_read_limits(
    location: object, sealed: bytes, manifest: Manifest, limits: ManifestLimits | None = None
) -> None:
    """Log a warning when readers will need ``limits=``: the default limits (or ``limits``)
    bound what reading any manifest may cost, and this one is over them."""
    limits = limits or ManifestLimits()
    entries = sum(len(record.tensors) for record in manifest.files)
    if len(sealed) > limits.max_bytes or entries > limits.max_tensors or len(manifest.files) > limits.max_files:
        logger.warning(
            "the manifest of %s (%.1f MiB, %d tensor entries, %d files) is over the default read limits "
            "(%g MiB, %d entries, %d files): load, verify and CheckpointManager need "
            "limits=ManifestLimits(max_bytes=..., max_tensors=..., max_files=...) to read it",
            location,
            len(sealed) / 2**20,
            entries,
            len(manifest.files),
            limits.max_bytes / 2**20,
            limits.max_tensors,
            limits.max_files,
        )


def commit_manifest(
    commit: CheckpointCommit,
    manifest: Manifest,
    *,
    location: object,
    private_key: Ed25519PrivateKey | None,
    data_files: Iterable[str],
    validate: bool = True,
) -> None:
    """Commit ``manifest``, the last step of every save: refuse what load would refuse with a
    :class:`~shardkeep.errors.CommitRefusedError` (the manifest's own checks unless
    ``validate=False``, where they already ran, and every chunked tensor tiled exactly once),
    register the ``data_files`` whose directories the commit makes durable, seal with the
    manifest's digest, warn when readers will need ``limits=``, sign with ``private_key`` and
    commit."""
    problems = validate_manifest(manifest).errors if validate else []
    if has_chunks(manifest):  # coverage_problems finds nothing without chunks
        problems += coverage_problems(manifest)
    if problems:
        raise CommitRefusedError(f"cannot commit {location}: " + "; ".join(problems[:5]))
    for path in data_files:
        commit.add_data_file(path)
    sealed = seal_manifest(encode_manifest(with_entry_families(manifest)), manifest.digest_algorithm)
    warn_if_over_read_limits(location, sealed, manifest)
    signature = sign_manifest(sealed, private_key, manifest) if private_key is not None else None
    commit.commit(sealed, signature)
