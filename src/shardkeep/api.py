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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

from shardkeep.async_saving import AsyncSaver, SaveHandle
from shardkeep.config import LoadOptions, ManifestLimits, WriteOptions
from shardkeep.distributed.coordinator import DEFAULT_TIMEOUT
from shardkeep.errors import (
    ConfigError,
    IntegrityError,
    UnsupportedValueError,
)
from shardkeep.integrity import CRYPTOGRAPHIC_DIGESTS, SignaturePolicy
from shardkeep.loading import LoadJob
from shardkeep.manifest import Manifest, Tier
from shardkeep.options import (
    INTERNAL_KEYWORDS,
    LEGACY_KEYWORDS,
    Incremental,
    LoadSelection,
    ManifestFields,
    TierPlan,
    regroup,
    reselect,
)
from shardkeep.progress import collector_paused
from shardkeep.saving import SaveSettings, run_save
from shardkeep.slicing import load_slice
from shardkeep.storage import StoreOperations
from shardkeep.verification import (
    TierLocations,
    locate,
    read_checked_manifest,
    read_manifest,
    verify,
)

if TYPE_CHECKING:
    from shardkeep.options import Group, PublicKey, Signer

__all__ = ["SaveHandle", "async_save", "load", "load_slice", "read_manifest", "save", "verify"]


def save(
    state: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    step: int | None = None,
    options: WriteOptions | None = None,
    tiers: TierPlan | Sequence[Tier] | None = None,
    incremental: Incremental | bool | str | os.PathLike[str] = False,
    fields: ManifestFields | None = None,
    signer: Signer | None = None,
    storage: StoreOperations | None = None,
    process_group: Group | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    **legacy: Any,
) -> Manifest:
    r"""Save ``state`` as a new committed checkpoint at ``path`` and return its manifest.

    ``state`` is a mapping whose leaves are tensors, ``DTensor``\ s, numpy arrays or JSON
    values; objects with ``state_dict()`` are expanded. The checkpoint appears at ``path``
    atomically, or not at all. With several ranks (``torch.distributed`` initialized), every
    rank calls ``save`` with the same ``path``: plain tensors count as replicated and are
    written once in total, ``DTensor`` leaves as the chunks each rank holds, and the JSON values
    come from the coordinator (the lowest rank). ``path`` may be a URL
    (``s3://bucket/prefix/step_00001000``); an object store has no rename, so data objects go
    under a fresh ``attempt-<id>/`` prefix and the manifest is written last, create-only.

    Args:
        step: recorded as the checkpoint's step (default: an int ``"step"`` at the top of ``state``).
        options: how bytes are written (:class:`~shardkeep.config.WriteOptions`: digest, byte
            budget, I/O threads, file size, compression, progress bar, fsspec ``storage_options``).
        tiers: a :class:`~shardkeep.options.TierPlan`, or a list of
            :class:`~shardkeep.manifest.Tier` (``TierPlan(tiers=...)``).
        incremental: an :class:`~shardkeep.options.Incremental`, or its ``base``: ``True`` lays
            files out to be referenced later, the path of an earlier checkpoint in the same root
            references its unchanged files instead of writing them again.
        fields: what the manifest records beside the state
            (:class:`~shardkeep.options.ManifestFields`: model id, epoch, metrics ...).
        signer: an Ed25519 private key or the path of a PEM file; ``manifest.sig`` is written
            over the manifest's exact bytes before the commit. Only the coordinator uses it. The
            digest must be cryptographic (``blake3`` or ``sha256``).
        storage: a byte store; ``path`` is then the checkpoint's name inside it.
        process_group: the group of ranks (default: a dedicated gloo group);
            :data:`shardkeep.LOCAL` saves what this process holds, with no collective.
        timeout: seconds that bound every wait.
        legacy: the keyword spellings of the previous release (``digest=``, ``model_id=``,
            ``placement=`` ...), folded into their group with a :class:`DeprecationWarning`.

    Raises:
        CheckpointExistsError: ``path`` holds a checkpoint, a file, a symlink or a non-empty
            directory (an empty directory is replaced by the commit).
        CoordinationError: a rank failed; every rank raises it and nothing is committed.
        ConfigError: an option is invalid (:class:`~shardkeep.errors.UnknownOptionError`, also a
            ``TypeError``, for an unknown keyword).
        UnsupportedValueError: a leaf of ``state`` cannot be stored; the message names its key.
        StorageError: writing, syncing or renaming failed.
    """
    groups = regroup("save", legacy, options=options, tiers=tiers, incremental=incremental, fields=fields)
    settings = SaveSettings.of(
        groups, step=step, signer=signer, storage=storage, process_group=process_group, timeout=timeout
    )
    return run_save(state, path, settings)


#: The old keyword spellings ``async_save`` accepts: those of ``save`` that it had.
_ASYNC_LEGACY = tuple(
    name for name in LEGACY_KEYWORDS + INTERNAL_KEYWORDS if name not in ("progress", "trust_versions", "budget")
)


def async_save(
    state: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    step: int | None = None,
    options: WriteOptions | None = None,
    tiers: TierPlan | Sequence[Tier] | None = None,
    incremental: Incremental | bool | str | os.PathLike[str] = False,
    fields: ManifestFields | None = None,
    signer: Signer | None = None,
    storage: StoreOperations | None = None,
    process_group: Group | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    wait: bool = True,
    staging_budget: int | None = None,
    **legacy: Any,
) -> SaveHandle:
    """Snapshot ``state`` into reusable host buffers, then write and commit in the background.

    Returns once the snapshot is taken: training may change its tensors at once without
    changing what is saved. The options are those of :func:`save`, except that an async save
    draws no progress bar and refuses ``trust_versions`` (its state is a staged copy). At most one save is
    in flight per process: a second call waits for the first (``wait=True``) or raises
    :class:`~shardkeep.errors.SaveInProgressError`. ``staging_budget`` (bytes) refuses states
    larger than that instead of growing the staging buffer.

    With several ranks, every rank calls ``async_save``; the collectives (planning, opening the
    staging directory) run here, on the caller's thread. The background thread runs none: each
    rank posts its outcome to the process group's key-value store, and the coordinator commits
    once every rank has reported (or fails at the ``timeout`` deadline).
    """
    groups = regroup(
        "async_save",
        legacy,
        options=options,
        tiers=tiers,
        incremental=incremental,
        fields=fields,
        accepted=_ASYNC_LEGACY,
    )
    if groups.incremental.trust_versions:
        raise ConfigError(
            "async_save cannot use incremental=Incremental(trust_versions=True): its state is a staged copy, "
            "whose files are always hashed"
        )
    settings = SaveSettings.of(
        replace(groups, options=replace(groups.options, progress=False)),
        step=step,
        signer=signer,
        storage=storage,
        process_group=process_group,
        timeout=timeout,
    )
    return AsyncSaver.default().save(
        state,
        path,
        settings,
        wait=wait,
        staging_budget=staging_budget,
        after_commit=groups.internal.get("after_commit"),
    )


# --------------------------------------------------------------------------------------------
# load
# --------------------------------------------------------------------------------------------

SECTIONS = ("model", "optim", "router")


def load(
    path: str | os.PathLike[str],
    into: Any = None,
    *,
    select: LoadSelection | None = None,
    verify: bool = True,
    mmap: bool = True,
    io_threads: int = LoadOptions.io_threads,
    progress: bool = False,
    storage: StoreOperations | None = None,
    storage_options: Mapping[str, Any] | None = None,
    limits: ManifestLimits | None = None,
    tier_locations: TierLocations | None = None,
    public_key: PublicKey | None = None,
    require_signature: bool | None = None,
    digest: Literal["fast", "cryptographic"] | None = None,
    **legacy: Any,
) -> Any:
    """Load the checkpoint at ``path`` (a local path or a URL such as ``s3://bucket/p/step_1``).

    Without ``into``, returns the saved state as a new nested dict (tensors view the files'
    memory maps when ``mmap``; writes to them never reach the files). With ``into``, fills that
    state in place (tensors are copied into, objects get ``load_state_dict``) and returns it.
    With ``verify`` (the default) the file set, every size, digest, version and shard header are
    checked before any tensor is built or any target modified.

    ``select`` (a :class:`~shardkeep.options.LoadSelection`: tiers, sections, ``extra``,
    ``lazy``) reads a part of the checkpoint: only the files holding it (and, in format 2.x, only
    the rank indexes that list its chunks). With ``into``, a partial load fills only what it read
    and leaves the rest of ``into`` as it is; keys of ``into`` that the checkpoint lacks are an
    error either way. ``tier_locations`` maps a tier name to where its files are now (a path, URL
    or byte store), for a tier that moved. ``storage_options`` go to fsspec for a URL.
    ``legacy``: the keyword spellings of the previous release (``tiers=``, ``sections=``,
    ``extra=``, ``lazy=``), folded into ``select`` with a :class:`DeprecationWarning`.

    ``public_key`` (an ``Ed25519PublicKey`` or the path of a PEM file): ``manifest.sig`` must
    be a valid signature by that key, checked before the manifest is parsed; since every file
    is then checked against the signed digests, the signature covers the data. An unsigned
    checkpoint is refused unless ``require_signature=False``. Raises
    :class:`~shardkeep.errors.SignatureError` otherwise.

    ``digest``: which recorded digests a verifying load checks (docs/trust.md). ``None`` (the
    default): the cryptographic ones under ``public_key``, else the fast ones (xxh3-128, which
    detect accidental damage) where the checkpoint records them (format 2.1/1.4);
    ``"cryptographic"`` asks for the save's own algorithm without a key. ``"fast"`` with
    ``public_key`` is a :class:`~shardkeep.errors.ConfigError`.
    """
    if digest == "fast" and public_key is not None:
        raise ConfigError(
            "digest='fast' with public_key=: the signature covers the data only through the cryptographic "
            "digests; use digest=None or 'cryptographic'"
        )
    if digest is None and verify:
        digest = "cryptographic" if public_key is not None else "fast"
    options = LoadOptions(verify=verify, mmap=mmap, io_threads=io_threads, digest=digest)
    chosen = reselect("load", legacy, select)
    extra, lazy = chosen.extra, chosen.lazy
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
    if digest == "cryptographic" and manifest.digest_algorithm not in CRYPTOGRAPHIC_DIGESTS:
        raise IntegrityError(
            f"{location}: digest='cryptographic', but the checkpoint records no cryptographic digest "
            f"(it was saved with digest={manifest.digest_algorithm!r})"
        )
    job = LoadJob(
        location,
        manifest,
        options,
        into=into,
        tiers=chosen.tiers,
        sections=_check_sections(chosen.sections),
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
