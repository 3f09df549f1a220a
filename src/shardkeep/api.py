"""The public verbs: ``save``, ``async_save`` and ``load`` (and, re-exported, ``read_manifest``
and ``verify``).

``save`` runs a :class:`~shardkeep.saving.SaveJob` (plan the files with :mod:`shardkeep.layout`,
write them in parallel under a byte budget with digests computed while writing, commit through
:class:`~shardkeep.distributed.commit.CheckpointCommit`: on a filesystem a staging directory,
manifest last, one rename; on an object store a fresh attempt prefix and a create-only manifest
last). ``load`` reads the manifest, checks the file set, memory-maps and verifies every file
it needs before it builds a single tensor, assembles resharded regions
(:mod:`shardkeep.tensors.regions`), and fills ``into`` all or nothing (:mod:`shardkeep.fill`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from shardkeep.async_saving import AsyncSaver, SaveHandle
from shardkeep.config import LoadOptions, ManifestLimits, SaveOptions
from shardkeep.distributed.coordinator import DEFAULT_TIMEOUT
from shardkeep.errors import (
    ConfigError,
    UnsupportedValueError,
)
from shardkeep.integrity import SignaturePolicy
from shardkeep.io import ByteBudget
from shardkeep.loading import LoadJob
from shardkeep.manifest import (
    Manifest,
    RunInfo,
    Tier,
)
from shardkeep.progress import collector_paused
from shardkeep.saving import SaveSettings, run_save
from shardkeep.storage import StoreOperations
from shardkeep.tiers import Placement
from shardkeep.verification import (
    TierLocations,
    locate,
    read_checked_manifest,
    read_manifest,
    verify,
)

__all__ = ["SaveHandle", "async_save", "load", "read_manifest", "save", "verify"]


def save(
    state: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    digest: str = SaveOptions.digest,
    byte_budget: int = SaveOptions.byte_budget,
    io_threads: int = SaveOptions.io_threads,
    file_size_target: int = SaveOptions.file_size_target,
    compression: str | None = SaveOptions.compression,
    compression_level: int = SaveOptions.compression_level,
    model_id: str | None = None,
    step: int | None = None,
    epoch: int | None = None,
    training: Mapping[str, Any] | None = None,
    sharding_strategy: str | None = None,
    custom_fields: Mapping[str, Any] | None = None,
    metrics: Mapping[str, float | None] | None = None,
    run: RunInfo | None = None,
    progress: bool = False,
    budget: ByteBudget | None = None,
    storage: StoreOperations | None = None,
    storage_options: Mapping[str, Any] | None = None,
    tiers: Sequence[Tier] | None = None,
    placement: Placement | None = None,
    incremental: bool | str | os.PathLike[str] = False,
    trust_versions: bool = False,
    signer: Any = None,
    process_group: Any = None,
    timeout: float = DEFAULT_TIMEOUT,
    started: float | None = None,
) -> Manifest:
    r"""Save ``state`` as a new committed checkpoint at ``path`` and return its manifest.

    ``state`` is a mapping whose leaves are tensors, ``DTensor``\ s, numpy arrays or JSON
    values; objects with ``state_dict()`` are expanded. The checkpoint appears at ``path``
    atomically, or not at all; saving onto an existing checkpoint raises
    :class:`~shardkeep.errors.CheckpointExistsError`, and so does saving onto a file, a symlink
    or a directory holding anything (an empty directory is used: the commit replaces it).

    When ``torch.distributed`` is initialized, every rank calls ``save`` with the same ``path``
    on a shared filesystem. Plain tensors are taken to be replicated (as in DDP) and are written
    once in total, spread across ranks; ``DTensor`` leaves are written as the chunks each rank
    holds, with their global shape and offset. JSON values and the tree structure come from the
    coordinator (the lowest rank). If any rank fails, every rank raises the same
    :class:`~shardkeep.errors.CoordinationError` and nothing is committed. ``process_group``
    picks the group (default: a dedicated gloo group); ``process_group=shardkeep.LOCAL`` saves
    what this process holds on its own, with no collective, even when ``torch.distributed`` is
    initialized (a rank-zero-only save). ``timeout`` bounds every wait.

    ``metrics`` (name to number; NaN and infinities are recorded as null) and ``run`` (a
    :class:`~shardkeep.manifest.RunInfo`) go into the manifest; the checkpoint manager sets them.
    ``step`` is recorded as the checkpoint's step; without it, an int ``"step"`` at the top of
    ``state`` is.

    ``byte_budget`` bounds the memory held beyond the caller's tensors; pass ``budget`` to
    observe its high-water mark. With ``storage`` (a byte store), ``path`` is the checkpoint's
    name inside that store. ``path`` may be a URL (``s3://bucket/prefix/step_00001000``);
    ``storage_options`` then go to fsspec (credentials, endpoint; the AWS environment variables
    are used otherwise). An object store has no rename: data objects go under a fresh
    ``attempt-<id>/`` prefix and the manifest is written last, create-only.

    ``tiers`` (a list of :class:`~shardkeep.manifest.Tier`) and ``placement`` (ordered
    ``(glob on the key, tier name)`` rules, or a callable taking a
    :class:`~shardkeep.tiers.PlacementInfo`) put each tensor on a tier; a tier's files go to
    its ``location`` (``None``: beside the manifest). Size budgets are enforced as each tier's
    ``placement_policy`` says (``"prioritized"`` spills to the next tier, ``"strict"`` refuses).

    ``incremental``: ``True`` lays files out so that unchanged parts can be referenced later
    (one file per expert); a path (an earlier checkpoint in the same root) also compares each
    file's digest with that checkpoint's and, where they are equal, records a reference to the
    existing file instead of writing it again.

    ``trust_versions`` (with ``incremental``; off by default): a file whose tensors are the same
    objects this process saved or proved before, alone on the same storage, with PyTorch
    version counters that have not moved since and no optimizer step with a gradient for them,
    is known unchanged without hashing it (module buffers are always hashed). Writes that bypass
    the counter are not seen (``tensor.data.add_()``, storage-level writes, native ops writing
    an argument other than their first, a NumPy view, another process writing shared memory):
    turn it on only when the saved tensors change through torch in-place ops on themselves and
    optimizer steps (docs/tiers.md lists every case).

    ``signer`` (an ``Ed25519PrivateKey`` or the path of a PEM private key file) signs the
    manifest: ``manifest.sig`` is written beside it, over its exact bytes, before the commit.
    Only the coordinator uses the key (other ranks may pass ``None``). The digest must be
    cryptographic (``blake3`` or ``sha256``).

    ``started`` (a ``time.perf_counter()`` value; default: now) is when the caller's pause
    began, recorded in the manifest's ``timing`` (the checkpoint manager passes its own start).
    """
    return run_save(state, path, SaveSettings.from_arguments(locals()))


def async_save(
    state: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    wait: bool = True,
    staging_budget: int | None = None,
    digest: str = SaveOptions.digest,
    byte_budget: int = SaveOptions.byte_budget,
    io_threads: int = SaveOptions.io_threads,
    file_size_target: int = SaveOptions.file_size_target,
    compression: str | None = SaveOptions.compression,
    compression_level: int = SaveOptions.compression_level,
    model_id: str | None = None,
    step: int | None = None,
    epoch: int | None = None,
    training: Mapping[str, Any] | None = None,
    sharding_strategy: str | None = None,
    custom_fields: Mapping[str, Any] | None = None,
    metrics: Mapping[str, float | None] | None = None,
    run: RunInfo | None = None,
    storage: StoreOperations | None = None,
    storage_options: Mapping[str, Any] | None = None,
    tiers: Sequence[Tier] | None = None,
    placement: Placement | None = None,
    incremental: bool | str | os.PathLike[str] = False,
    signer: Any = None,
    process_group: Any = None,
    timeout: float = DEFAULT_TIMEOUT,
    after_commit: Callable[[Manifest], None] | None = None,
    started: float | None = None,
) -> SaveHandle:
    """Snapshot ``state`` into reusable host buffers, then write and commit in the background.

    Returns once the snapshot is taken: training may change its tensors at once without
    changing what is saved. Options are those of :func:`save`. At most one save is in flight
    per process: a second call waits for the first (``wait=True``) or raises
    :class:`~shardkeep.errors.SaveInProgressError`. ``staging_budget`` (bytes) refuses states
    larger than that instead of growing the staging buffer.

    With several ranks, every rank calls ``async_save``; the collectives (planning, opening the
    staging directory) run here, on the caller's thread. The background thread runs none: each
    rank posts its outcome to the process group's key-value store, and the coordinator commits
    once every rank has reported (or fails at the ``timeout`` deadline).

    ``after_commit``, if given, is called on every rank in the background thread with the
    committed manifest before the handle completes; an exception from it becomes the handle's
    error (the checkpoint manager runs retention there).

    ``started`` (a ``time.perf_counter()`` value; default: now) is when the caller's pause
    began, for the manifest's ``timing``: the checkpoint manager passes the start of its own
    ``async_save``.
    """
    return AsyncSaver.default().save(
        state,
        path,
        SaveSettings.from_arguments(locals()),
        wait=wait,
        staging_budget=staging_budget,
        after_commit=after_commit,
    )


# --------------------------------------------------------------------------------------------
# load
# --------------------------------------------------------------------------------------------

SECTIONS = ("model", "optim", "router")


def load(
    path: str | os.PathLike[str],
    into: Any = None,
    *,
    verify: bool = True,
    mmap: bool = True,
    io_threads: int = LoadOptions.io_threads,
    progress: bool = False,
    storage: StoreOperations | None = None,
    limits: ManifestLimits | None = None,
    storage_options: Mapping[str, Any] | None = None,
    tiers: Iterable[str] | None = None,
    sections: Iterable[str] | None = None,
    lazy: bool = False,
    tier_locations: TierLocations | None = None,
    public_key: Any = None,
    require_signature: bool | None = None,
    extra: str = "add",
) -> Any:
    """Load the checkpoint at ``path`` (a local path or a URL such as ``s3://bucket/p/step_1``).

    Without ``into``, returns the saved state as a new nested dict (tensors view the files'
    memory maps when ``mmap``; writes to them never reach the files). With ``into``, fills that
    state in place (tensors are copied into, objects get ``load_state_dict``) and returns it.
    With ``verify`` (the default) the file set, every size, digest, version and shard header are
    checked before any tensor is built or any target modified.

    ``tiers`` (tier names) and ``sections`` (``"model"``, ``"optim"``, ``"router"``) select a
    part of the checkpoint: only the files holding it are read. Tensors left out are absent from
    the result (``None`` inside lists), or, with ``lazy=True``, :class:`~shardkeep.lazy.LazyTensor`
    placeholders that read and verify their file on first use. With ``into``, a partial load
    fills only what it read and leaves the rest of ``into`` as it is. ``tier_locations`` maps a
    tier name to where its files are now (a path, URL or byte store), for a tier that moved.

    ``extra`` says what becomes of saved state that ``into`` lacks: ``"add"`` (the default)
    loads it and adds it to ``into``; ``"ignore"`` never reads it, so a rank whose ``into``
    holds only its own experts reads only their files (and, in format 2.0, only the rank indexes
    that list their chunks). Keys of ``into`` that the checkpoint lacks are an error either way.

    ``public_key`` (an ``Ed25519PublicKey`` or the path of a PEM file): ``manifest.sig`` must
    be a valid signature by that key, checked before the manifest is parsed; since every file
    is then checked against the signed digests, the signature covers the data. An unsigned
    checkpoint is refused unless ``require_signature=False``. Raises
    :class:`~shardkeep.errors.SignatureError` otherwise.
    """
    options = LoadOptions(verify=verify, mmap=mmap, io_threads=io_threads)
    if extra not in ("add", "ignore"):
        raise UnsupportedValueError(f"extra={extra!r} must be 'add' or 'ignore'")
    if extra == "ignore" and into is None:
        raise UnsupportedValueError("extra='ignore' leaves out the saved state into= lacks: it needs into=")
    if lazy and into is not None:
        raise UnsupportedValueError("lazy=True returns placeholders; it cannot fill into= (load the tiers you need)")
    policy = SignaturePolicy.of(public_key, require_signature)
    if policy.public_key is not None and not options.verify:
        raise ConfigError(
            "public_key= with verify=False: the signature covers the data only through the digests, "
            "which verify=False does not check"
        )
    location = locate(path, storage, storage_options)
    with collector_paused():
        manifest = read_checked_manifest(location, policy, limits, expand=False)
    job = LoadJob(
        location,
        manifest,
        options,
        into=into,
        tiers=tiers,
        sections=_check_sections(sections),
        tier_locations=tier_locations,
        storage_options=storage_options,
        lazy=lazy,
        progress=progress,
        limits=limits,
        only_into=extra == "ignore",
    )
    return job.run()


def _check_sections(sections: Iterable[str] | None) -> set[str] | None:
    if sections is None:
        return None
    if not isinstance(sections, (str, Iterable)):
        raise UnsupportedValueError(f"sections={sections!r} must be a set of names from {list(SECTIONS)}")
    chosen = {sections} if isinstance(sections, str) else set(sections)
    unknown = sorted(chosen - set(SECTIONS))
    if unknown:
        raise UnsupportedValueError(
            f"sections={sorted(chosen)}: unknown section(s) {unknown}; choose from {list(SECTIONS)}"
        )
    return chosen
