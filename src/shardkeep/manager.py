"""The training-loop layer: :class:`CheckpointManager` (and, re-exported from
:mod:`shardkeep.training`, :class:`TrainingCheckpoint`).

A manager owns a root directory of checkpoints named ``step_<N>``. Each save goes through
:func:`shardkeep.save` (sharded and distributed like any other save), and its manifest records
the run id, a fingerprint of the model args and config, the metrics and the retention policy.
Everything the manager decides (latest, best, what to keep, who owns the root) is rebuilt from
those manifests, so a restarted run enforces the same policy. See ``docs/manager.md``.
"""

from __future__ import annotations

import builtins
import dataclasses
import logging
import os
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

import shardkeep.api as api
from shardkeep.async_saving import AsyncSaver, BackgroundRetry, background_group
from shardkeep.cadence import SavePolicy, SaveSchedule
from shardkeep.catalog import (
    DEFAULT_LEASE,
    CheckpointEntry,
    CheckpointRoot,
    Found,
    checkpoint_name,
    load_config_file,
    misnamed_problem,
)
from shardkeep.config import LoadOptions, ManifestLimits, WriteOptions
from shardkeep.distributed.coordinator import DEFAULT_TIMEOUT, Coordinator
from shardkeep.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
    CoordinationError,
    FingerprintMismatchError,
    IntegrityError,
    ManifestError,
    RetentionError,
    RunMismatchError,
    ShardkeepError,
)
from shardkeep.integrity import SignaturePolicy
from shardkeep.manager_setup import check_manager_arguments, manager_groups, new_run_id, open_root
from shardkeep.manifest import (
    HistoryPoint,
    Manifest,
    RetentionRecord,
    RunInfo,
    Tier,
    lineage,
    stored_bytes,
)
from shardkeep.names import CORRUPT_MARKER, sibling_name, step_of_checkpoint
from shardkeep.options import Incremental, ManifestFields, TierPlan
from shardkeep.retention import RetentionPolicy, policy_from_config
from shardkeep.retry import RetryPolicy, run_with_retries
from shardkeep.saving import SaveSettings, run_save
from shardkeep.storage import (
    StoreOperations,
    renames,
)
from shardkeep.training import (
    FILLED,
    TrainingCheckpoint,
    check_training_state,
    fingerprint_differences,
    fingerprint_fields,
    fingerprint_of,
    is_training_checkpoint,
    json_mapping,
    skeleton,
)

if TYPE_CHECKING:
    from shardkeep.options import Group, PublicKey, Signer

__all__ = ["CheckpointManager", "PendingSave", "Restored", "TrainingCheckpoint"]

logger = logging.getLogger("shardkeep")

# --------------------------------------------------------------------------------------------
# CheckpointManager
# --------------------------------------------------------------------------------------------


@dataclass
class Restored:
    """What :meth:`CheckpointManager.restore` loaded: the entry, the state (the ``into`` object,
    a :class:`TrainingCheckpoint`, or a dict), and the newer checkpoints it skipped, with why."""

    entry: CheckpointEntry
    state: Any
    skipped: list[tuple[str, str]] = field(default_factory=list)

    @property
    def step(self) -> int:
        return self.entry.step


class PendingSave:
    """A save started by :meth:`CheckpointManager.async_save`. ``result()`` waits for the commit
    and for retention, and returns the new entry (or raises what failed)."""

    def __init__(self, manager: CheckpointManager, handle: api.SaveHandle, name: str) -> None:
        self._manager = manager
        self._handle = handle
        self.name = name
        self.blocked_seconds = handle.blocked_seconds

    def __repr__(self) -> str:
        return f"PendingSave({self.name!r}, {'done' if self.done() else 'running'})"

    def done(self) -> bool:
        return self._handle.done()

    def result(self, timeout: float | None = None) -> CheckpointEntry:
        manifest = self._handle.result(timeout)
        return self._manager._entry_after_save(self.name, manifest)


class CheckpointManager:
    """Keeps the last and best checkpoints of a training run in ``root``.

    ``keep_last``/``keep_best`` checkpoints are kept (0 means none), ranked by ``metric``
    (``mode`` ``"min"`` or ``"max"``). Whatever the policy, the newest checkpoint that verifies
    is never deleted, and neither is anything another run wrote. Options:

    - ``run_id``: this run's id. By default a new run gets a fresh id at its first save, and a
      resumed run takes the id of the checkpoint :meth:`restore` loads.
    - ``allow_other_runs``: write into a root whose newest checkpoint belongs to another run.
    - ``fingerprint``: a mapping of the model args and config for plain-mapping states (a
      :class:`TrainingCheckpoint` supplies its own).
    - ``verify_newest`` (default true): before deleting anything, read back and verify the
      newest checkpoint fully.
    - ``staging_lease``: seconds after which an untouched staging directory counts as a
      leftover of a crashed save and is removed (by the coordinator).
    - ``storage``: a byte store rooted at ``root`` (instead of the local directory), which is
      created if missing; a root that is a file, lies under a file or cannot be created raises
      :class:`~shardkeep.errors.StorageError`.
    - ``signer``, ``public_key``, ``require_signature``: sign every save, and restore only
      checkpoints signed by that key. A manager that requires signatures must have a
      ``signer`` (on every rank), or be ``read_only``.
    - ``limits``: a :class:`~shardkeep.config.ManifestLimits` for reading manifests larger
      than the default limits allow (over 40 MiB, about 150,000 tensor entries of a typical size).
    - ``tier_locations``: where tiers that moved are now (``{"cold": "/new/place"}``), for
      listing, verifying and restoring.
    - ``read_only``: list and restore only (``save`` and ``prune`` raise ``ConfigError``); the
      root is not created.
    - ``process_group``, ``timeout``: as for :func:`shardkeep.save`.
    - ``options``, ``tiers``, ``fields``: the option groups of :func:`shardkeep.save`
      (:class:`~shardkeep.config.WriteOptions`, :class:`~shardkeep.options.TierPlan`,
      :class:`~shardkeep.options.ManifestFields`), applied to every save; the metrics come
      from each :meth:`save`. ``incremental`` is ``True``/``False`` or an
      :class:`~shardkeep.options.Incremental` whose ``base`` is ``True`` (the manager picks each
      save's base), with ``trust_versions``.
    - ``save_policy``: a :class:`~shardkeep.cadence.SavePolicy` that :meth:`should_save`
      follows (every N steps, every T seconds, a function); without one, every step is due.
      :meth:`save` itself saves whatever it is given.
    - ``retry``: a :class:`~shardkeep.retry.RetryPolicy`; a :meth:`save` (or the background
      part of an :meth:`async_save`) that fails with a transient storage error is tried again,
      every rank together (default: no retry).
    - ``save_options``: the keyword spellings of the previous release (``digest=`` ...), folded
      into their group with a :class:`DeprecationWarning`.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        keep_last: int = 1,
        keep_best: int = 1,
        metric: str = "val_loss",
        mode: Literal["min", "max"] = "min",
        *,
        run_id: str | None = None,
        allow_other_runs: bool = False,
        fingerprint: Mapping[str, Any] | None = None,
        verify_newest: bool = True,
        staging_lease: float = DEFAULT_LEASE,
        storage: StoreOperations | None = None,
        storage_options: Mapping[str, Any] | None = None,
        incremental: bool | Incremental = False,
        public_key: PublicKey | None = None,
        require_signature: bool | None = None,
        read_only: bool = False,
        limits: ManifestLimits | None = None,
        tier_locations: Mapping[str, str] | None = None,
        process_group: Group | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        progress: bool = False,
        options: WriteOptions | None = None,
        tiers: TierPlan | Sequence[Tier] | None = None,
        fields: ManifestFields | None = None,
        signer: Signer | None = None,
        save_policy: SavePolicy | None = None,
        retry: RetryPolicy | None = None,
        **save_options: Any,
    ) -> None:
        self.policy = RetentionPolicy(keep_last=keep_last, keep_best=keep_best, metric=metric, mode=mode)
        self._schedule = SaveSchedule(save_policy) if save_policy is not None else None
        groups = manager_groups(save_options, options, tiers, incremental, fields)
        incremental = groups.incremental.base is True
        if storage_options is None:
            storage_options = groups.options.storage_options
        #: The save settings this manager applies to every save (validated now, not at the first save).
        self.save_settings = SaveSettings.of(groups, signer=signer)
        check_manager_arguments(run_id, staging_lease, incremental, read_only, self.save_settings)
        self.signatures = SignaturePolicy.of(public_key, require_signature)
        if self.signatures.required and self.save_settings.signer is None and not read_only:
            raise ConfigError(
                "this manager requires signed checkpoints (public_key= or require_signature=True) but has no "
                "signer=, so its own saves would be unsigned and then refused: pass signer= (on every rank), "
                "require_signature=False, or read_only=True for a manager that only lists and restores"
            )
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise ConfigError(f"retry= must be a RetryPolicy or None, got {type(retry).__name__}")
        self.retry = retry
        self.read_only = read_only
        self.root = os.fspath(root)
        storage, display = open_root(self.root, storage, storage_options, create=not read_only)
        self.store = storage
        self.storage_options = storage_options
        self.incremental = incremental
        self._base: str | None = None
        self.limits = limits
        self.tier_locations = dict(tier_locations or {})
        self.catalog = CheckpointRoot(
            storage,
            display=display,
            storage_options=storage_options,
            signatures=self.signatures,
            limits=limits,
            tier_locations=self.tier_locations,
        )
        self.catalog.tier_homes = {
            tier.location for tier in self.save_settings.tiers or () if isinstance(tier, Tier) and tier.location
        }
        self._run_id = run_id
        self.allow_other_runs = allow_other_runs
        self._fingerprint = json_mapping("fingerprint", fingerprint) if fingerprint is not None else None
        self.verify_newest = verify_newest
        self.staging_lease = float(staging_lease)
        self.process_group = process_group
        self.timeout = timeout
        self.progress = progress or groups.options.progress
        self._pending: PendingSave | None = None
        self._lock = threading.RLock()
        self._flags: dict[str, tuple[bool, bool, bool, bool | None]] = {}
        #: The run's earlier saves on the lineage of the newest checkpoint this manager saved or
        #: restored; recorded in the next manifest's ``run.history``.
        self._history: builtins.list[HistoryPoint] = []

    @classmethod
    def from_config(
        cls, root: str | os.PathLike[str], config: Mapping[str, Any] | str | os.PathLike[str], **options: Any
    ) -> CheckpointManager:
        """A manager whose policy comes from a ``checkpointing`` mapping
        (``{"keep": {"last": N, "best": M, "period": K, "interval_seconds": T}}``, optionally
        ``metric`` and ``mode``; see :func:`~shardkeep.retention.policy_from_config`) or from a YAML
        file holding that section (or a whole RuntimeConfig with a ``checkpointing:`` key)."""
        is_file = isinstance(config, (str, os.PathLike))
        policy = load_config_file(config) if is_file else policy_from_config(config)  # type: ignore[arg-type]  # a mapping here
        clashing = sorted({"keep_last", "keep_best", "metric", "mode"} & set(options))
        if clashing:
            raise ConfigError(f"{clashing} come from the config; do not pass them to from_config as well")
        manager = cls(root, policy.keep_last, policy.keep_best, policy.metric, policy.mode, **options)
        manager.policy = policy  # with keep_period and keep_interval_seconds, which the constructor lacks
        return manager

    def __repr__(self) -> str:
        p = self.policy
        return (
            f"CheckpointManager({self.catalog.display!r}, keep_last={p.keep_last}, keep_best={p.keep_best}, "
            f"metric={p.metric!r}, mode={p.mode!r}, run_id={self._run_id!r})"
        )

    @property
    def run_id(self) -> str | None:
        """This run's id: given, adopted by :meth:`restore`, or created by the first save."""
        return self._run_id

    def adopt_run_id(self, run_id: str) -> None:
        """Take ``run_id`` as this run's id when the manager has none yet (a run resumed
        elsewhere, e.g. by a ``MultiLevelManager`` restoring from another level); a manager
        that already has another id keeps it."""
        if self._run_id is None:
            check_manager_arguments(run_id, self.staging_lease, False, True, self.save_settings)
            self._run_id = run_id

    def _refuse_if_read_only(self, verb: str) -> None:
        if self.read_only:
            raise ConfigError(f"this manager of {self.catalog.display} is read_only=True; it cannot {verb}")

    def _coordinator(self) -> Coordinator:
        return Coordinator(self.process_group, timeout=self.timeout)

    # -- saving -----------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """Whether ``step`` is due under ``save_policy`` (always, without one); never a step at or
        below the last one this manager saved or restored. Every rank calls it: with several
        ranks and a time or function rule, the coordinator decides and broadcasts."""
        schedule = self._schedule
        if schedule is None:
            return True
        coordinator = self._coordinator()
        if not (coordinator.distributed and schedule.policy.needs_agreement):
            return schedule.due(step)
        return coordinator.on_coordinator("should_save", lambda: schedule.due(step))

    def save(
        self, state: TrainingCheckpoint | Mapping[str, Any], *, step: int, metrics: Mapping[str, Any] | None = None
    ) -> CheckpointEntry:
        """Save ``state`` as checkpoint ``step``, then apply retention; return the new entry.

        Every rank calls it when distributed. Retention runs only after the commit is durable;
        if it fails, :class:`~shardkeep.errors.RetentionError` is raised and the new checkpoint
        is still committed and usable. With ``retry=``, a transient failure is retried (see
        :mod:`shardkeep.retry`); a failed retention never is.
        """
        started = time.perf_counter()
        self._refuse_if_read_only("save")
        with self._lock:
            self.wait()
            coordinator = self._coordinator()

            def attempt(number: int) -> tuple[str, Manifest]:  # a fresh claim and staging each time
                earlier = (
                    None if number == 1 else coordinator.on_coordinator("find a commit", lambda: self._committed(step))
                )
                if earlier is not None:  # the failed attempt failed after its commit point
                    return checkpoint_name(step), earlier
                name, payload, run = self._prepare(state, step, metrics, coordinator)
                settings = replace(self._settings_for(step, metrics, run, started), progress=self.progress)
                return name, run_save(payload, name, settings)

            def free_space() -> bool:
                return bool(coordinator.on_coordinator("free space to retry the save", self.prune))

            what = f"the save of step {step} to {self.catalog.display}"
            name, manifest = run_with_retries(attempt, self.retry, voters=coordinator, free_space=free_space, what=what)
            if self._schedule is not None:
                self._schedule.saved(step)
            self._history = lineage(manifest)  # committed: on record even if retention fails
            coordinator.on_coordinator("apply retention", lambda: self._retain(name))
            return self._entry_after_save(name, manifest)

    def async_save(
        self,
        state: TrainingCheckpoint | Mapping[str, Any],
        *,
        step: int,
        metrics: Mapping[str, Any] | None = None,
    ) -> PendingSave:
        """Snapshot ``state`` and return at once; writing, commit and then retention run in the
        background. A previous pending save is waited for first. ``result()`` on the returned
        :class:`PendingSave` gives the entry. With ``retry=``, a transient failure of the write
        or commit is retried in the background from the snapshot, every rank together (see
        :mod:`shardkeep.async_saving`); the error that ends the retries is ``result()``'s."""
        started = time.perf_counter()
        self._refuse_if_read_only("save")
        with self._lock:
            self.wait()
            coordinator = self._coordinator()
            name, payload, run = self._prepare(state, step, metrics, coordinator)

            def after_commit(manifest: Manifest) -> None:
                self._history = lineage(manifest)  # committed: on record even if retention fails
                if coordinator.is_coordinator:  # background thread: no collectives, the coordinator prunes
                    self._retain(name)

            settings = replace(self._settings_for(step, metrics, run, started), progress=False)
            retry = None
            if self.retry is not None and self.retry.attempts > 1:
                retry = BackgroundRetry(
                    self.retry,
                    f"the async save of step {step} to {self.catalog.display}",
                    background_group(self.process_group, self.timeout) if coordinator.distributed else None,
                    committed=lambda: self._committed(step),
                    free_space=lambda: bool(self._prune_here()),
                )
            handle = AsyncSaver.default().save(payload, name, settings, after_commit=after_commit, retry=retry)
            self._pending = PendingSave(self, handle, name)
            if self._schedule is not None:  # the cadence counts from the snapshot
                self._schedule.saved(step)
            return self._pending

    def wait(self, timeout: float | None = None) -> CheckpointEntry | None:
        """Wait for the pending async save (if any) and return its entry, or raise its error."""
        pending = self._pending
        if pending is None:
            return None
        try:
            return pending.result(timeout)
        except RetentionError as exc:
            # Only the coordinator sees it (it alone prunes); raising here would desynchronize
            # the ranks at the next collective. The checkpoint itself committed.
            logger.error("retention after the async save of %s failed: %s", pending.name, exc)
            return None
        finally:
            if pending.done():
                self._pending = None

    def _settings_for(self, step: int, metrics: Mapping[str, Any] | None, run: RunInfo, started: float) -> SaveSettings:
        """This manager's save settings, with the facts of one save filled in."""
        return replace(
            self.save_settings,
            step=step,
            metrics=metrics,
            run=run,
            storage=self.store,
            storage_options=self.storage_options,
            incremental=(self._base or True) if self.incremental else False,
            process_group=self.process_group,
            timeout=self.timeout,
            started=started,
        )

    def _prepare(
        self,
        state: TrainingCheckpoint | Mapping[str, Any],
        step: int,
        metrics: Mapping[str, Any] | None,
        coordinator: Coordinator,
    ) -> tuple[str, Mapping[str, Any], RunInfo]:
        """Check the arguments and the root's owner (coordinator), agree on the run id."""
        name = checkpoint_name(step)
        if metrics is not None:
            if not isinstance(metrics, Mapping):
                raise ConfigError(f"metrics= must be a mapping of names to numbers, got {type(metrics).__name__}")
            if metrics and self.policy.metric not in metrics:
                raise ConfigError(
                    f"metrics has no {self.policy.metric!r}, the metric this manager ranks by; got {sorted(metrics)}"
                )
        if isinstance(state, TrainingCheckpoint):
            payload: Mapping[str, Any] = state.to_state()
            source: Mapping[str, Any] | None = state.fingerprint_source()
        elif isinstance(state, Mapping):
            payload = state
            source = self._fingerprint
        else:
            raise ConfigError(f"state must be a TrainingCheckpoint or a mapping, got {type(state).__name__}")
        run_id, self._base = coordinator.on_coordinator("check the checkpoint root", lambda: self._claim(name))
        self._run_id = run_id
        fields = fingerprint_fields(source) if source is not None else {}
        run = RunInfo(
            run_id=run_id,
            fingerprint=fingerprint_of(fields) if source is not None else None,
            fingerprint_fields=fields,
            retention=RetentionRecord(
                keep_last=self.policy.keep_last,
                keep_best=self.policy.keep_best,
                metric=self.policy.metric,
                mode=self.policy.mode,
            ),
            history=[point for point in self._history if point.step < step],
        )
        return name, payload, run

    def _claim(self, name: str) -> tuple[str, str | None]:
        """On the coordinator: refuse a root owned by another run, move a corrupt checkpoint of
        this run out of the way of ``name``, and collect leftovers. Returns the run id and the
        base of an incremental save."""
        found = self.catalog.scan()
        owner = CheckpointRoot.owner(found)
        run_id = self._run_id
        if owner is not None and owner != run_id and not self.allow_other_runs:
            newest = next(item for item in reversed(found) if CheckpointRoot.run_of(item) == owner)
            hint = (
                f"call restore() to resume run {owner!r}, pass run_id={owner!r} to continue it"
                if run_id is None
                else f"this manager is run {run_id!r}"
            )
            raise RunMismatchError(
                f"{self.catalog.display} belongs to run {owner!r} (newest checkpoint {newest.name}); {hint}, "
                "or pass allow_other_runs=True to write beside it",
                owner=owner,
            )
        if run_id is None:
            run_id = new_run_id()
        step = step_of_checkpoint(name)
        for newer in reversed(found):
            if newer.step <= step or CheckpointRoot.run_of(newer) != run_id:
                continue
            self.catalog.verify_fully(newer)
            if not newer.problems:
                raise CheckpointExistsError(
                    f"run {run_id!r} already has a newer checkpoint that verifies, {newer.name}; a save of "
                    f"step {step} would never be resumed from. Save with a step above {newer.step}, or "
                    "remove the newer checkpoints first",
                )
        existing = next((item for item in found if item.name == name), None)
        # Only a committed checkpoint (a readable manifest) under another spelling holds the step;
        # anything else there is not in the way of this name and is left alone.
        spelled = next(
            (
                item
                for item in found
                if item.step == step and item.manifest is not None and not item.misnamed and item.name != name
            ),
            None,
        )
        if existing is None and spelled is not None:
            raise CheckpointExistsError(
                f"step {step} is already saved as {self.catalog.path_of(spelled.name)}; committed checkpoints are "
                "never overwritten: save under another step"
            )
        if existing is not None:
            if CheckpointRoot.run_of(existing) == run_id:
                self.catalog.verify_fully(existing)
            if existing.missing_tiers:  # unknown, not corrupt: never moved out of the way
                raise CheckpointExistsError(
                    f"checkpoint {self.catalog.path_of(name)} exists, and a tier of it cannot be seen "
                    f"({'; '.join(existing.problems[:2])}); bring the tier back or remap it (tier_locations=), "
                    "or save under another step",
                )
            if existing.problems and not renames(self.store):
                raise CheckpointExistsError(
                    f"checkpoint {self.catalog.path_of(name)} exists but fails verification "
                    f"({'; '.join(existing.problems[:2])}); an object store cannot move it aside: inspect it, "
                    "delete it, or save under another step",
                )
            if existing.problems and CheckpointRoot.run_of(existing) in (run_id, None):
                aside = sibling_name(name, CORRUPT_MARKER, uuid.uuid4().hex[:12])
                self.store.rename(name, aside)
                logger.warning(
                    "checkpoint %s fails verification (%s); moved it to %s for inspection and saving afresh",
                    self.catalog.path_of(name),
                    "; ".join(existing.problems[:3]),
                    aside,
                )
            else:
                raise CheckpointExistsError(
                    f"checkpoint {self.catalog.path_of(name)} already exists; committed checkpoints are never overwritten"
                )
        self.catalog.collect_leftovers(lease=self.staging_lease)
        base = None
        if self.incremental:
            # The base of an incremental save: this run's newest checkpoint that verifies.
            for item in reversed(found):
                if item.step >= step or CheckpointRoot.run_of(item) != run_id or item.manifest is None:
                    continue
                self.catalog.verify_fully(item)
                if not item.problems:
                    base = item.name
                    break
        return run_id, base

    def _committed(self, step: int) -> Manifest | None:
        """On the coordinator, before a retry: the manifest of ``step`` if the failed attempt
        committed it after all (it is this run's and verifies in full), else None."""
        name = checkpoint_name(step)
        found = next((item for item in self.catalog.scan() if item.name == name), None)
        if found is None or found.manifest is None or CheckpointRoot.run_of(found) != self._run_id:
            return None
        self.catalog.verify_fully(found)
        logger.warning("%s: committed by the attempt that failed, so kept", self.catalog.path_of(name))
        return None if found.problems else found.manifest

    def _retain(self, name: str) -> None:
        """On the coordinator, after ``name`` committed: delete what the policy no longer keeps,
        update the pointers, remove leftovers, and record the new entry's flags. Raises
        :class:`~shardkeep.errors.RetentionError` (the checkpoint stays committed), with the
        original error as its cause."""
        path = self.catalog.path_of(name)
        try:
            found = self.catalog.scan()
            entries, decision = self.catalog.decide(found, self.policy, self._run_id, verify_newest=self.verify_newest)
            mine = {item.name for item in found if CheckpointRoot.run_of(item) == self._run_id}
            skipped = [item.name for item in found if item.manifest is None]
            if skipped:
                logger.warning(
                    "retention leaves %s alone: unreadable manifest(s), owner unknown (%s)",
                    ", ".join(skipped),
                    "; ".join(item.problems[0] for item in found if item.manifest is None)[:500],
                )
            if name in decision.delete:  # never delete the checkpoint this save just committed
                decision = dataclasses.replace(
                    decision,
                    keep=(*decision.keep, name),
                    delete=tuple(other for other in decision.delete if other != name),
                )
            # Pointers first: they name only checkpoints the decision keeps, so a failure while
            # deleting never leaves them behind the save that just committed.
            self.catalog.write_pointers(entries, decision, self.policy.metric)
            self.catalog.apply(decision, found)
            self.catalog.collect_leftovers(lease=self.staging_lease)
        except ShardkeepError as exc:
            raise RetentionError(
                f"checkpoint {path} committed, but retention failed: {type(exc).__name__}: {exc}", checkpoint=path
            ) from exc
        entry = next((entry for entry in entries if entry.name == name), None)
        if entry is None or name not in mine:
            raise RetentionError(f"checkpoint {name} committed but is missing from {self.catalog.display}", path)
        self._flags[name] = (entry.is_last, entry.is_best, entry.is_newest, entry.verified)
        if entry.verified is False:
            raise RetentionError(
                f"checkpoint {entry.path} committed but fails verification: {'; '.join(entry.problems[:3])}", path
            )

    def _entry_after_save(self, name: str, manifest: Manifest) -> CheckpointEntry:
        flags = self._flags.pop(name, None)
        if flags is None:  # not the coordinator: the decision is rebuilt from the manifests
            try:
                entry = next((entry for entry in self._entries(verify=False) if entry.name == name), None)
            except ShardkeepError:  # the coordinator's retention is changing the root right now
                entry = None
            if entry is not None:
                return entry
            flags = (self.policy.keep_last > 0, False, True, None)
        is_last, is_best, is_newest, verified = flags
        return CheckpointEntry(
            name=name,
            path=self.catalog.path_of(name),
            step=manifest.step if manifest.step is not None else -1,
            metric=manifest.metrics.get(self.policy.metric),
            metrics=dict(manifest.metrics),
            is_last=is_last,
            is_best=is_best,
            is_newest=is_newest,
            verified=verified,
            size=stored_bytes(manifest),
            run_id=self._run_id,
            created_at=manifest.created_at,
            manifest=manifest,
        )

    # -- reading ----------------------------------------------------------------------------
    def _scope(self, found: builtins.list[Found]) -> str | None:
        return self._run_id if self._run_id is not None else CheckpointRoot.owner(found)

    def _entries(self, *, verify: bool) -> builtins.list[CheckpointEntry]:
        found = self.catalog.scan()
        if verify:
            for item in found:
                self.catalog.verify_fully(item)
        entries, _ = self.catalog.decide(found, self.policy, self._scope(found), verify_newest=False)
        return entries

    def list(self, *, verify: bool = False) -> builtins.list[CheckpointEntry]:
        """Every committed checkpoint in the root, oldest first (other runs' too: see
        ``run_id``). With ``verify``, every digest is checked; otherwise the manifest, the file
        set and the sizes."""
        self.wait()
        return self._entries(verify=verify)

    def latest(self, *, verify: bool = False) -> CheckpointEntry | None:
        """The newest checkpoint of this run (or of the root's owner before the first save or
        restore) that passes the checks; with ``verify``, that passes a full verification."""
        self.wait()
        found = self.catalog.scan()
        scope = self._scope(found)
        for item in reversed(found):
            if CheckpointRoot.run_of(item) != scope and scope is not None:
                continue
            if verify:
                self.catalog.verify_fully(item)
            if not item.problems:
                entries, _ = self.catalog.decide(found, self.policy, scope, verify_newest=False)
                return next(entry for entry in entries if entry.name == item.name)
        return None

    def best(self, *, verify: bool = False) -> CheckpointEntry | None:
        """The best checkpoint under the policy's metric and mode (``None`` if keep_best is 0
        or there is none)."""
        entries = self.list(verify=verify)
        found = [entry for entry in entries if entry.is_best]
        if not found:
            return None
        sign = 1.0 if self.policy.mode == "min" else -1.0
        return min(found, key=lambda e: (e.metric is None, sign * e.metric if e.metric is not None else 0.0, e.step))

    def prune(self) -> builtins.list[str]:
        """Apply retention now (coordinator only; other ranks return ``[]``) and return the names
        deleted. Saves do this on their own; this is for a policy that changed."""
        self._refuse_if_read_only("prune")
        self.wait()
        coordinator = self._coordinator()
        if not coordinator.is_coordinator:
            return []
        return self._prune_here()

    def _prune_here(self) -> builtins.list[str]:
        """:meth:`prune`'s work, on the coordinator, without waiting for a pending save (a
        background retry frees space with it)."""
        found = self.catalog.scan()
        scope = self._scope(found)
        if self._run_id is None and scope is not None and not self.allow_other_runs:
            raise RunMismatchError(
                f"{self.catalog.display} belongs to run {scope!r}; restore() it or pass run_id={scope!r} "
                "before pruning its checkpoints with this manager's policy",
                owner=scope,
            )
        entries, decision = self.catalog.decide(found, self.policy, scope, verify_newest=self.verify_newest)
        deleted = self.catalog.apply(decision, found)
        self.catalog.write_pointers(entries, decision, self.policy.metric)
        self.catalog.collect_leftovers(lease=self.staging_lease)
        return deleted

    # -- restoring --------------------------------------------------------------------------
    def restore(
        self,
        into: Any = None,
        *,
        step: int | None = None,
        allow_fingerprint_change: bool = False,
        digest: Literal["fast", "cryptographic"] | None = None,
    ) -> Restored:
        """Load the newest checkpoint that verifies (or checkpoint ``step``).

        If the newest fails verification, fall back to the previous one with a logged warning;
        raise :class:`~shardkeep.errors.IntegrityError` if none verifies, and
        :class:`~shardkeep.errors.CheckpointNotFoundError` if there is none. With a
        :class:`TrainingCheckpoint` as ``into``, its modules and optimizer are filled in place
        and its iteration, best_val_loss, rng and data_position replaced (model_args and config
        stay as given), and with its ``track_rng`` (the default) the saved RNG states are put back
        into Python's, numpy's and torch's generators; ``into=None`` returns a new TrainingCheckpoint (for a
        checkpoint saved from one) or a dict. A checkpoint whose model args or config differ
        from ``into``'s (or the manager's ``fingerprint``) raises
        :class:`~shardkeep.errors.FingerprintMismatchError` with a field-by-field diff, unless
        ``allow_fingerprint_change``. A resumed run takes the restored checkpoint's run id.

        ``digest`` chooses which recorded digests are checked, as in :func:`shardkeep.load`:
        ``None`` (the default) the cryptographic ones under the manager's ``public_key``, else the
        fast ones (xxh3-128) where the checkpoints record them; ``"cryptographic"`` the save's
        own algorithm without a key. ``"fast"`` with a ``public_key`` is a
        :class:`~shardkeep.errors.ConfigError`, raised before anything is read. A checkpoint
        that records no cryptographic digest (saved with ``digest="xxh3-128"``) cannot be
        checked with ``"cryptographic"``: it is skipped like a damaged one.
        """
        LoadOptions(digest=digest)  # a ConfigError names a value load() does not take
        if digest == "fast" and self.signatures.public_key is not None:
            raise ConfigError(
                "digest='fast' with the manager's public_key: the signature covers the data only through the "
                "cryptographic digests; use digest=None or 'cryptographic'"
            )
        with self._lock:
            self.wait()
            if step is not None:
                checkpoint_name(step)  # a bad step fails on every rank alike
            coordinator = self._coordinator()
            candidates = coordinator.on_coordinator("list checkpoints", lambda: self._candidates(step))
            skipped: builtins.list[tuple[str, str]] = []
            for name in candidates:
                kind, detail, result = self._try_load(name, into, allow_fingerprint_change, digest)
                outcomes = coordinator.all_gather((kind, detail), label=f"restore {name}")
                errors = [(rank, d) for rank, (k, d) in enumerate(outcomes) if k == "error"]
                if errors:
                    if kind == "error":
                        assert isinstance(result, BaseException)
                        raise result
                    raise CoordinationError(
                        f"restoring {name} failed on rank(s) {[rank for rank, _ in errors]}: {errors[0][1]}",
                        dict(errors),
                    )
                corrupt = [(rank, d) for rank, (k, d) in enumerate(outcomes) if k == "corrupt"]
                if corrupt:
                    reason = (
                        "; ".join(f"rank {rank}: {d}" for rank, d in corrupt)
                        if coordinator.distributed
                        else corrupt[0][1]
                    )
                    logger.warning(
                        "checkpoint %s cannot be restored (%s); falling back to the previous checkpoint",
                        self.catalog.path_of(name),
                        reason[:2000],
                    )
                    skipped.append((name, reason))
                    continue
                manifest, state = result
                if (
                    isinstance(into, TrainingCheckpoint)
                    and into.track_rng
                    and into.rng is not None
                    and "rng" in skeleton(manifest)
                ):
                    # Every rank loaded: resume the random stream (only from states this checkpoint
                    # holds: into.rng keeps what it had when the checkpoint has none).
                    TrainingCheckpoint.restore_rng(into.rng)
                if self._run_id is None and manifest.run is not None:
                    self._run_id = manifest.run.run_id
                self._history = lineage(manifest)
                entry = self._restored_entry(name, manifest)
                if self._schedule is not None:
                    self._schedule.saved(entry.step)
                return Restored(entry=entry, state=state, skipped=skipped)
            details = "; ".join(f"{name}: {reason}" for name, reason in skipped)
            raise IntegrityError(
                f"no checkpoint in {self.catalog.display} verifies ({len(skipped)} tried): {details}",
                [f"{name}: {reason}" for name, reason in skipped],
            )

    def _candidates(self, step: int | None) -> builtins.list[str]:
        """On the coordinator: the names to try, newest first."""
        found = self.catalog.scan()
        scope = self._scope(found)
        names = [
            item.name
            for item in reversed(found)
            if (scope is None or CheckpointRoot.run_of(item) == scope or item.manifest is None)
            and not item.duplicate
            and (step is None or item.step == step)
        ]
        if not names:
            which = f"checkpoint step {step}" if step is not None else "checkpoints"
            of_run = f" of run {scope!r}" if scope is not None else ""
            raise CheckpointNotFoundError(f"no {which}{of_run} in {self.catalog.display}")
        return names

    def _try_load(
        self, name: str, into: Any, allow_fingerprint_change: bool, digest: Literal["fast", "cryptographic"] | None
    ) -> tuple[str, str, Any]:
        """Load ``name`` on this rank: ("ok", "", (manifest, state)), ("corrupt", why, None) to
        fall back, or ("error", why, exception) for an error that must not be skipped."""
        try:
            manifest = api.read_manifest(
                name,
                storage=self.store,
                public_key=self.signatures.public_key,
                require_signature=self.signatures.required,
                limits=self.limits,
            )
            misnamed = misnamed_problem(name, manifest)
            if misnamed is not None:  # a renamed or copied checkpoint: never restored under a false step
                return ("corrupt", misnamed, None)
            if manifest.run is not None and self._run_id is not None and manifest.run.run_id != self._run_id:
                raise RunMismatchError(f"{name} belongs to run {manifest.run.run_id!r}, not {self._run_id!r}")
            self._check_fingerprint(name, manifest, into, allow_fingerprint_change)
            training = is_training_checkpoint(manifest)
            if isinstance(into, TrainingCheckpoint) or (into is None and training):
                check_training_state(skeleton(manifest))
            if isinstance(into, TrainingCheckpoint):
                # Objects are filled in place; plain fields are taken from the checkpoint, except
                # model_args and config, which stay the caller's (they matched, or the change
                # was allowed).
                target = {k: v for k, v in into.to_state().items() if k in FILLED and v is not None}
                self._load(name, target, manifest, digest)
                into._update_from({k: v for k, v in target.items() if k not in ("model_args", "config")})
                state: Any = into
            elif into is None and training:
                state = TrainingCheckpoint.from_state(self._load(name, None, manifest, digest))
            else:
                state = self._load(name, into, manifest, digest)
        except (IntegrityError, ManifestError, CheckpointNotFoundError) as exc:
            return ("corrupt", f"{type(exc).__name__}: {exc}", None)
        except ShardkeepError as exc:
            return ("error", f"{type(exc).__name__}: {exc}", exc)
        return ("ok", "", (manifest, state))

    def _load(self, name: str, into: Any, manifest: Manifest, digest: Literal["fast", "cryptographic"] | None) -> Any:
        return api.load(
            name,
            into=into,
            storage=self.store,
            storage_options=self.storage_options,
            progress=self.progress,
            public_key=self.signatures.public_key,
            require_signature=self.signatures.required,
            limits=self.limits,
            tier_locations=self.catalog.tiers_remapped(manifest),
            digest=digest,
        )

    def _check_fingerprint(self, name: str, manifest: Manifest, into: Any, allowed: bool) -> None:
        source = into.fingerprint_source() if isinstance(into, TrainingCheckpoint) else self._fingerprint
        if source is None or manifest.run is None or manifest.run.fingerprint is None or allowed:
            return
        current = fingerprint_fields(source)
        if fingerprint_of(current) == manifest.run.fingerprint:
            return
        differences = fingerprint_differences(manifest.run.fingerprint_fields, current)
        lines = "\n".join(f"  {field}: checkpoint {old}, now {new}" for field, old, new in differences[:50])
        more = f"\n  ... and {len(differences) - 50} more" if len(differences) > 50 else ""
        raise FingerprintMismatchError(
            f"{self.catalog.path_of(name)} was saved with different model args or config "
            f"({len(differences)} field(s) differ):\n{lines}{more}\n"
            "pass allow_fingerprint_change=True to restore it anyway",
            differences,
        )

    def _restored_entry(self, name: str, manifest: Manifest) -> CheckpointEntry:
        for entry in self._entries(verify=False):
            if entry.name == name:
                return dataclasses.replace(entry, verified=True)
        return CheckpointEntry(name=name, path=self.catalog.path_of(name), step=manifest.step or 0, verified=True)
