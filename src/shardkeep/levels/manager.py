"""``MultiLevelManager``: save often to a fast node-local level, persist less often, restore from
the best copy (see docs/levels.md).

It composes the parts of :mod:`shardkeep.levels`:

- the node-local level: :func:`~shardkeep.levels.local_save.save_node_local` writes each step,
  :mod:`~shardkeep.levels.local_catalog` lists and removes this node's parts (retention is
  decided by the coordinator from its node's parts, the same bytes on every node, and applied
  by every node's leader);
- each shared level is a :class:`~shardkeep.manager.CheckpointManager` on its root (its catalog,
  retention and retries): ``source="save"`` levels save through it, ``source="drain"`` levels
  are fed by a :class:`~shardkeep.levels.drain.Drain` of the newest committed local step;
- :func:`~shardkeep.levels.restore.restore_best` restores;
- :class:`~shardkeep.levels.preemption.PreemptionHandler` (opt-in, :meth:`MultiLevelManager.handle_preemption`)
  turns a preemption signal into one agreed emergency save and a distinct exit.

Every public method is collective: every rank calls it, in the same order. Collectives run on
the caller's thread only; a drain's background threads copy bytes and never take part in one.
A process group that breaks (a peer died) ends the call with a
:class:`~shardkeep.distributed.coordinator.GroupBrokenError`, and every later call at once
(:mod:`~shardkeep.levels.group_loss`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from shardkeep.cadence import SaveSchedule
from shardkeep.catalog import DEFAULT_LEASE
from shardkeep.config import WriteOptions
from shardkeep.distributed.coordinator import DEFAULT_TIMEOUT, Coordinator, group_broken
from shardkeep.errors import ConfigError, LevelUnreachableError, NoCompleteStepError, ShardkeepError
from shardkeep.levels.config import (
    Level,
    check_levels,
    distributed_now,
    probe_level,
    refuse_unreachable,
    warn_if_network_filesystem,
)
from shardkeep.levels.drain import Drain
from shardkeep.levels.fingerprints import FingerprintRule, fingerprint_source, run_fingerprint
from shardkeep.levels.group_loss import GroupLoss
from shardkeep.levels.local_catalog import collect_leftovers, remove_step, scan
from shardkeep.levels.local_save import save_node_local
from shardkeep.levels.nodes import NodeMap, node_map_with
from shardkeep.levels.preemption import EXIT_PREEMPTED, EXIT_PREEMPTED_ABORTED, Preemption, PreemptionHandler
from shardkeep.levels.replicas import Replication
from shardkeep.levels.restore import LevelView, RestoreReport, restore_best
from shardkeep.levels.shared_level import (
    DrainRecovery,
    SharedLevel,
    local_step_info,
    training_state,
)
from shardkeep.levels.status import LevelCopy, level_copies
from shardkeep.manager_setup import manager_groups, new_run_id
from shardkeep.manifest import RetentionRecord, RunInfo
from shardkeep.names import checkpoint_name, step_of_checkpoint
from shardkeep.options import ManifestFields
from shardkeep.retention import decide
from shardkeep.retry import RetryPolicy, run_with_retries
from shardkeep.saving import SaveSettings
from shardkeep.training import TrainingCheckpoint, json_mapping

if TYPE_CHECKING:
    from shardkeep.options import Group, Signer

__all__ = ["LevelsRestored", "LevelsSaveResult", "MultiLevelManager"]

logger = logging.getLogger("shardkeep.levels")


@dataclass
class LevelsSaveResult:
    """What one :meth:`MultiLevelManager.save` did, per level: ``committed`` (level -> name),
    ``draining`` (level -> name: a drain started in the background), ``skipped`` (level ->
    reason), and the seconds the caller was blocked."""

    step: int
    committed: dict[str, str] = field(default_factory=dict)
    draining: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    blocked_seconds: float = 0.0


@dataclass
class LevelsRestored:
    """What :meth:`MultiLevelManager.restore` loaded: the step, the state (``into`` filled, or
    a new state) and the :class:`~shardkeep.levels.restore.RestoreReport` (per rank and level:
    where each part came from, what was healed, which copies were refused and why)."""

    step: int
    state: Any
    report: RestoreReport


class MultiLevelManager:
    """Checkpoints on several levels, each with its own root, cadence and retention.

    ``levels``: :class:`~shardkeep.levels.config.Level` objects (checked with
    :func:`~shardkeep.levels.config.check_levels` before anything is written; at most one is
    node-local). ``retry``: a :class:`~shardkeep.retry.RetryPolicy` for every level's saves and
    drains. ``drain_wait``: the longest a save waits (seconds) for a drain still in flight when
    the next drain of that level is due; after it, that drain is skipped and logged (the
    documented bound on how long a slow persistent level can block training). ``node_of``: the
    node of each rank (see :func:`~shardkeep.levels.nodes.node_map`). ``replicate_wait``: the
    longest a save waits (seconds) for the peer replication of the previous local step before
    that step is skipped (see :mod:`~shardkeep.levels.replicas`). ``options``, ``fields``,
    ``signer``: as for :class:`~shardkeep.manager.CheckpointManager`. ``fingerprint``: the
    model args and config of a plain-mapping state, recorded by every save and checked by
    :meth:`restore` (a ``TrainingCheckpoint`` brings its own), as for ``CheckpointManager``.

    Every rank probes each shared level here (:func:`~shardkeep.levels.config.probe_level`).
    Building the manager makes no collective: one process (or a manager built before
    ``torch.distributed`` is initialized) raises
    :class:`~shardkeep.errors.LevelUnreachableError` here; with several ranks, the outcomes join
    the node map's all-gather at the first call, where every rank raises the same error naming
    the level and the ranks that cannot reach it, before anything is written.
    """

    def __init__(
        self,
        levels: Sequence[Level],
        *,
        retry: RetryPolicy | None = None,
        drain_wait: float = 0.0,
        replicate_wait: float = 0.0,
        node_of: Callable[[int], int] | Sequence[int] | None = None,
        process_group: Group | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        options: WriteOptions | None = None,
        fields: ManifestFields | None = None,
        signer: Signer | None = None,
        run_id: str | None = None,
        progress: bool = False,
        staging_lease: float = DEFAULT_LEASE,
        fingerprint: Mapping[str, Any] | None = None,
    ) -> None:
        check_levels(levels)
        self.levels = list(levels)
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise ConfigError(f"retry= must be a RetryPolicy or None, got {type(retry).__name__}")
        if isinstance(drain_wait, bool) or not isinstance(drain_wait, (int, float)) or not drain_wait >= 0:
            raise ConfigError(f"drain_wait={drain_wait!r} must be a number of seconds >= 0")
        if isinstance(replicate_wait, bool) or not isinstance(replicate_wait, (int, float)) or not replicate_wait >= 0:
            raise ConfigError(f"replicate_wait={replicate_wait!r} must be a number of seconds >= 0")
        self.retry = retry
        self.drain_wait = float(drain_wait)
        self.staging_lease = float(staging_lease)
        self.process_group = process_group
        self.timeout = timeout
        self.options = options or WriteOptions()
        self.progress = progress
        self._node_of = node_of
        self._nodes: NodeMap | None = None
        self._local_opened = False
        self._run_id = run_id
        self._fingerprint = json_mapping("fingerprint", fingerprint) if fingerprint is not None else None
        self._lock = threading.RLock()
        self._loss = GroupLoss()
        self.local: Level | None = next((level for level in self.levels if level.node_local), None)
        self._replication = (
            Replication(self.local, process_group=process_group, timeout=timeout, replicate_wait=float(replicate_wait))
            if self.local is not None
            else None
        )
        self._local_schedule = (
            SaveSchedule(self.local.save_policy)
            if self.local is not None and self.local.save_policy is not None
            else None
        )
        self._settings = SaveSettings.of(
            manager_groups({}, self.options, None, False, fields), signer=signer, process_group=process_group
        )
        self._shared: dict[str, SharedLevel] = {}
        self._preemption: PreemptionHandler | None = None
        self._recovery: DrainRecovery | None = None
        #: The newest step this process committed on the fastest level (an emergency save skips it).
        self._fastest_step: int | None = None
        # Several ranks agree on the shared levels' probes at the first call's node map
        # (_coordinator), so that every rank raises the same error; one process raises here.
        self._agree_probes = distributed_now(process_group)
        self._unreachable: dict[str, str] = {}  # this rank's failed probes: level -> reason
        self._refused: LevelUnreachableError | None = None
        for level in self.levels:
            if level.node_local:
                continue
            try:
                probe = probe_level(level)
            except LevelUnreachableError as exc:
                if not self._agree_probes:
                    raise
                self._unreachable[level.name] = str(exc)
                continue
            self._shared[level.name] = SharedLevel.opened(
                level,
                probe,
                run_id=run_id,
                process_group=process_group,
                timeout=timeout,
                options=self.options,
                fields=fields,
                signer=signer,
                retry=retry,
                progress=progress,
                fingerprint=self._fingerprint,
            )

    def __repr__(self) -> str:
        return f"MultiLevelManager({[level.name for level in self.levels]!r}, run_id={self._run_id!r})"

    # -- helpers -------------------------------------------------------------------------------
    def _coordinator(self) -> Coordinator:
        """The coordinator of a call; with several ranks, the first call's agrees on the node
        map and the shared levels' probes first (:meth:`_node_map`), before anything is written."""
        if self._refused is not None:
            raise LevelUnreachableError(str(self._refused))
        coordinator = Coordinator(self.process_group, timeout=self.timeout)
        if self._agree_probes and self._nodes is None:
            self._node_map(coordinator)
        return coordinator

    @contextlib.contextmanager
    def _guard(self, call: str) -> Iterator[None]:
        """Run a public call: refused at once when the process group broke earlier; when it
        breaks now, the drains and the replication are abandoned without a collective and the
        call raises :class:`~shardkeep.distributed.coordinator.GroupBrokenError`."""
        self._loss.check(call)
        try:
            yield
        except ShardkeepError as exc:
            broken = group_broken(exc)
            if broken is None or self._loss.error is not None:  # not broken, or told already
                raise
            self._abandon_in_flight()
            raise self._loss.record(call, broken, self._nodes.node_of if self._nodes else None) from exc

    def _abandon_in_flight(self) -> None:
        """Stop the drains and the replication in flight without a collective (the group broke)."""
        for shared in self._shared.values():
            if shared.drain is not None:
                shared.drain.abandon_locally()
                shared.drain = None
        if self._replication is not None:
            self._replication.abandon()

    def _node_map(self, coordinator: Coordinator) -> NodeMap:
        if self._nodes is None:
            nodes, unreachable = node_map_with(coordinator, self._node_of, self._unreachable)
            try:
                refuse_unreachable(unreachable, nodes.node_of)
            except LevelUnreachableError as exc:
                self._refused = exc
                raise
            check_levels(self.levels, node_count=nodes.node_count)
            self._nodes = nodes
        return self._nodes

    def _open_local_level(self, coordinator: Coordinator) -> None:
        """Before the first node-local save (collective, once): each node's leader creates and
        probes its local root, and warns when it is on a network filesystem. A restore reads
        the local roots without it: its listing reports a root that cannot be read."""
        if self._local_opened or self.local is None:
            return
        nodes = self._node_map(coordinator)
        node = nodes.node_of[coordinator.rank]
        leader = nodes.is_leader(coordinator.rank)
        coordinator.step(
            f"open the local level {self.local.name!r}", lambda: self._open_local(node) if leader else None
        )
        self._local_opened = True

    def _open_local(self, node: int) -> None:
        assert self.local is not None
        probe_level(self.local, node)
        warn_if_network_filesystem(self.local, node)

    def _local_root(self, coordinator: Coordinator) -> str:
        assert self.local is not None
        nodes = self._node_map(coordinator)
        return self.local.root_of(nodes.node_of[coordinator.rank])

    # -- saving --------------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """Whether any level is due at ``step`` (collective: every rank calls it). While a peer
        replication is in flight it is also the safe point that settles it (one all-gather). With
        :meth:`handle_preemption`, also ``True`` once the ranks agree they are preempted: the
        ``save`` that follows is the emergency save."""
        with self._lock, self._guard(f"should_save({step})"):
            coordinator = self._coordinator()
            self._settle_replicas(coordinator, wait=0.0)
            if self._preempted_at(step, coordinator) is not None:
                return True
            return bool(self._due(step, coordinator))

    def _due(self, step: int, coordinator: Coordinator) -> list[str]:
        schedules: list[tuple[str, SaveSchedule | None]] = []
        if self.local is not None:
            schedules.append((self.local.name, self._local_schedule))
        schedules += [(name, shared.schedule) for name, shared in self._shared.items()]

        def due() -> list[str]:
            return [name for name, schedule in schedules if schedule is None or schedule.due(step)]

        agree = any(s is not None and s.policy.needs_agreement for _, s in schedules)
        if coordinator.distributed and agree:
            return coordinator.on_coordinator("should_save", due)
        return due()

    def save(
        self,
        state: TrainingCheckpoint | Mapping[str, Any],
        *,
        step: int,
        metrics: Mapping[str, Any] | None = None,
        levels: Sequence[str] | None = None,
    ) -> LevelsSaveResult:
        """Save ``state`` as step ``step`` to the levels due at it (or to ``levels``; when none
        is due, to the fastest level: a save asked for is never dropped).

        The node-local level commits first; a drain level due at this step then starts copying
        that local step in the background. A level that fails is logged and skipped (and named
        in the result) unless it is ``required=True``. Every rank calls it.
        """
        started = time.perf_counter()
        payload = state.to_state() if isinstance(state, TrainingCheckpoint) else state
        if not isinstance(payload, Mapping):
            raise ConfigError(f"state must be a TrainingCheckpoint or a mapping, got {type(state).__name__}")
        with self._lock, self._guard(f"save(step={step})"):
            coordinator = self._coordinator()
            self._open_local_level(coordinator)
            preempted = self._preempted_at(step, coordinator)
            if preempted is not None:
                self._emergency(preempted, state, metrics, coordinator)
            result = LevelsSaveResult(step=step)
            self._settle_recovery(coordinator)
            self._settle_drains(coordinator, result, wait=0.0)
            self._settle_replicas(coordinator, wait=0.0)
            if levels is None:
                wanted = self._due(step, coordinator) or [self._fastest().name]
            else:
                unknown = sorted(set(levels) - {level.name for level in self.levels})
                if unknown:
                    raise ConfigError(f"levels={list(levels)!r}: no level named {unknown}")
                wanted = list(levels)
            self._check_metrics(wanted, metrics)
            self._ensure_run_id(coordinator)
            if self.local is not None and self.local.name in wanted:
                self._save_local(state, step, metrics, coordinator, result)
            local_name = self.local.name if self.local is not None else None
            for name, shared in self._shared.items():
                if shared.level.source == "save":
                    if name in wanted:
                        self._save_shared(shared, state, step, metrics, result)
                    continue
                # A drain level due at a step the local level did not save drains the next
                # local step that commits (a time or function rule: the newest local step).
                shared.drain_due = shared.drain_due or name in wanted
                if shared.drain_due and local_name in result.committed:
                    shared.drain_due = False
                    self._start_drain(shared, step, coordinator, result)
                elif name in wanted and local_name in result.skipped:
                    # No local step to copy: the level is saved directly, so that a failing
                    # local level does not stop persisting.
                    logger.warning("level %r: the local save of step %d failed; saving it directly", name, step)
                    shared.drain_due = False
                    self._save_shared(shared, state, step, metrics, result)
            if (self.local or self.levels[0]).name in result.committed:
                self._fastest_step = step
            result.blocked_seconds = time.perf_counter() - started
            return result

    def _fastest(self) -> Level:
        """The level a save nobody asked for goes to: the node-local level, else the first
        level that saves directly, else the first."""
        if self.local is not None:
            return self.local
        return next((level for level in self.levels if level.source == "save"), self.levels[0])

    def _check_metrics(self, wanted: Sequence[str], metrics: Mapping[str, Any] | None) -> None:
        """Refuse metrics that lack the metric a level about to save ranks by (as
        ``CheckpointManager.save`` does), before anything is written."""
        if metrics is None:
            return
        if not isinstance(metrics, Mapping):
            raise ConfigError(f"metrics= must be a mapping of names to numbers, got {type(metrics).__name__}")
        for level in self.levels:
            policy = level.retention
            if level.name in wanted and policy is not None and policy.keep_best and policy.metric not in metrics:
                raise ConfigError(
                    f"level {level.name!r} keeps the best {policy.keep_best} by {policy.metric!r}, but metrics has "
                    f"no {policy.metric!r}: got {sorted(metrics)} (or give it keep_best=0)"
                )

    @property
    def replication(self) -> Replication | None:
        """The peer replication of the node-local level (``None`` without one): the steps in
        flight, the newest protected step, each settled step's outcome on this rank (bytes
        sent and received, problems) and the seconds saves waited for it."""
        return self._replication

    @property
    def run_id(self) -> str | None:
        """This run's id: given, adopted by :meth:`restore`, or created by the first save."""
        return self._run_id

    def _ensure_run_id(self, coordinator: Coordinator) -> None:
        if self._run_id is None:
            self._adopt_run_id(coordinator.broadcast(new_run_id() if coordinator.is_coordinator else None))

    def _adopt_run_id(self, run_id: str) -> None:
        """Take ``run_id`` as this run's, on every level (each shared level's manager too)."""
        self._run_id = run_id
        for shared in self._shared.values():
            shared.manager.adopt_run_id(run_id)

    def _fail(self, level: Level, what: str, exc: BaseException, result: LevelsSaveResult) -> None:
        if level.required or group_broken(exc) is not None:  # a broken group ends the call
            raise exc
        reason = f"{type(exc).__name__}: {exc}"
        logger.warning("level %r: %s failed and is skipped: %s", level.name, what, reason)
        result.skipped[level.name] = reason

    def _save_local(
        self,
        state: TrainingCheckpoint | Mapping[str, Any],
        step: int,
        metrics: Mapping[str, Any] | None,
        coordinator: Coordinator,
        result: LevelsSaveResult,
    ) -> None:
        assert self.local is not None
        level = self.local
        name = checkpoint_name(step)
        self._open_local_level(coordinator)
        payload = state.to_state() if isinstance(state, TrainingCheckpoint) else state
        fingerprint, fingerprint_fields = run_fingerprint(fingerprint_source(state, self._fingerprint))
        root = self._local_root(coordinator)
        nodes = self._node_map(coordinator)
        # The manifest is drained byte for byte: it records the policy of the level it will be
        # pruned under by `shardkeep prune` (the first drain level's), not the local level's,
        # which the manager applies itself.
        drained = [shared.level.retention for shared in self._shared.values() if shared.level.source == "drain"]
        policy = drained[0] if drained and drained[0] is not None else level.retention
        run = RunInfo(
            run_id=self._run_id or "",
            fingerprint=fingerprint,
            fingerprint_fields=fingerprint_fields,
            retention=RetentionRecord(
                keep_last=policy.keep_last if policy else 1,
                keep_best=policy.keep_best if policy else 1,
                metric=policy.metric if policy else "val_loss",
                mode=policy.mode if policy else "min",
            ),
        )
        settings = replace(
            self._settings,
            step=step,
            metrics=metrics,
            run=run,
            process_group=self.process_group,
            timeout=self.timeout,
            progress=self.progress,
        )

        def attempt(number: int) -> str:
            save_node_local(payload, root, name, settings, coordinator, nodes)
            return name

        try:
            run_with_retries(
                attempt,
                self.retry,
                voters=coordinator,
                free_space=lambda: self._retain_local(coordinator),
                what=f"the local save of step {step} ({level.name!r})",
            )
        except ShardkeepError as exc:
            self._fail(level, f"the save of step {step}", exc, result)
            return
        result.committed[level.name] = name
        if self._local_schedule is not None:
            self._local_schedule.saved(step)
        if self._replication is not None:
            self._replication.after_commit(step, name, root, coordinator, nodes)
        self._retain_local(coordinator)

    def _retain_local(self, coordinator: Coordinator) -> bool:
        """Apply the local level's retention on every node: the coordinator decides from its
        node's parts (the manifests are the same bytes on every node), every node's leader
        removes what is not kept, and the leftovers of local saves cut off by a crash (after
        ``staging_lease``). A step being drained is kept until its drain ends. Whether a step
        was removed."""
        assert self.local is not None
        policy = self.local.retention
        root = self._local_root(coordinator)
        pinned = {shared.drain_step for shared in self._shared.values() if shared.drain is not None}
        pinned |= self._replication.pinned() if self._replication is not None else set()

        def decided() -> list[str]:
            if policy is None:
                return []
            steps = [found for found in scan(root) if found.state == "committed"]
            protected = [found.step for found in steps if found.part is not None and found.part.replicas]
            pinned.update(protected[-1:])  # the newest protected step, until a newer one is
            infos = [local_step_info(root, found, policy.metric) for found in steps]
            decision = decide(infos, policy)
            return [found.name for found in steps if found.name not in decision.keep and found.step not in pinned]

        doomed = coordinator.on_coordinator("decide the local retention", decided)
        leader = self._node_map(coordinator).is_leader(coordinator.rank)

        def remove() -> None:
            if leader:
                for name in doomed:
                    remove_step(root, name)
                collect_leftovers(root, lease=self.staging_lease)

        try:  # every rank learns of a failure on any node: none leaves save() alone
            coordinator.step(f"apply the retention of {self.local.name!r}", remove)
        except ShardkeepError as exc:
            if group_broken(exc) is not None:
                raise
            logger.warning("level %r: retention failed (the save committed): %s", self.local.name, exc)
        return bool(doomed)

    def _save_shared(
        self,
        shared: SharedLevel,
        state: TrainingCheckpoint | Mapping[str, Any],
        step: int,
        metrics: Mapping[str, Any] | None,
        result: LevelsSaveResult,
    ) -> None:
        try:
            entry = shared.manager.save(state, step=step, metrics=metrics)
        except ShardkeepError as exc:
            self._fail(shared.level, f"the save of step {step}", exc, result)
            return
        result.committed[shared.level.name] = entry.name
        if shared.schedule is not None:
            shared.schedule.saved(step)

    # -- draining ------------------------------------------------------------------------------
    def _start_drain(self, shared: SharedLevel, step: int, coordinator: Coordinator, result: LevelsSaveResult) -> None:
        level = shared.level
        if self.local is None or result.committed.get(self.local.name) != checkpoint_name(step):
            result.skipped[level.name] = f"step {step} was not committed on the local level: nothing to drain"
            logger.warning("level %r: %s", level.name, result.skipped[level.name])
            return
        if shared.drain is not None:
            self._settle(shared, coordinator, result, wait=self.drain_wait)
            if shared.drain is not None:
                reason = (
                    f"the drain of step {shared.drain_step} is still running after drain_wait={self.drain_wait:g} s; "
                    f"step {step} is not drained"
                )
                logger.warning("level %r: %s", level.name, reason)
                result.skipped[level.name] = reason
                return
        shared.join_prune()
        try:
            shared.drain = self._new_drain(shared, step, coordinator)
            shared.drain.start()
        except ShardkeepError as exc:
            shared.drain = None
            self._fail(level, f"the drain of step {step}", exc, result)
            return
        shared.drain_step = step
        if shared.schedule is not None:  # the cadence counts from the drain's start
            shared.schedule.saved(step)
        result.draining[level.name] = checkpoint_name(step)

    def _new_drain(self, shared: SharedLevel, step: int, coordinator: Coordinator) -> Drain:
        nodes = self._node_map(coordinator)
        return Drain(
            self._local_root(coordinator),
            checkpoint_name(step),
            shared.level.root_of(),
            coordinator,
            nodes.node_of,
            options=self.options,
            retry=self.retry,
            storage_options=shared.level.storage_options,
        )

    def _settle_drains(self, coordinator: Coordinator, result: LevelsSaveResult, *, wait: float) -> None:
        for shared in self._shared.values():
            if shared.drain is not None:
                self._settle(shared, coordinator, result, wait=wait)

    def _settle(self, shared: SharedLevel, coordinator: Coordinator, result: LevelsSaveResult, *, wait: float) -> None:
        """Poll the drain in flight (collective); on its commit apply the level's retention, on
        its failure log it; either way the level has no drain in flight afterwards."""
        drain = shared.drain
        assert drain is not None and shared.drain_step is not None
        step = shared.drain_step
        try:
            outcome = drain.wait(wait) if wait > 0 else drain.poll()
            while outcome.state == "running" and math.isinf(wait):  # another rank still copying
                outcome = drain.wait(None)
        except ShardkeepError as exc:
            drain.stop()
            shared.drain = None
            self._fail(shared.level, f"the drain of step {step}", exc, result)
            return
        if outcome.state == "running":
            return
        shared.drain = None
        if outcome.state == "failed":
            assert outcome.error is not None
            self._fail(shared.level, f"the drain of step {step}", outcome.error, result)
            return
        if shared.schedule is not None:
            shared.schedule.saved(step)
        result.committed[shared.level.name] = checkpoint_name(step)
        shared.prune_later(coordinator)

    def drain(self, step: int, *, timeout: float | None = None) -> LevelsSaveResult:
        """Drain local step ``step`` to every drain level now and wait for it (at most
        ``timeout`` seconds each); collective."""
        with self._lock, self._guard(f"drain({step})"):
            coordinator = self._coordinator()
            self._settle_recovery(coordinator)
            result = LevelsSaveResult(step=step)
            if self.local is not None:
                result.committed[self.local.name] = checkpoint_name(step)
            for shared in self._shared.values():
                if shared.level.source != "drain":
                    continue
                self._start_drain(shared, step, coordinator, result)
                if shared.drain is not None:
                    self._settle(shared, coordinator, result, wait=float("inf") if timeout is None else timeout)
            if self.local is not None:
                result.committed.pop(self.local.name, None)
            return result

    def wait_for_drains(self, timeout: float | None = None) -> LevelsSaveResult:
        """Wait (at most ``timeout`` seconds) for every drain in flight, and for the retention
        that follows a committed drain; collective."""
        with self._lock, self._guard("wait_for_drains()"):
            result = LevelsSaveResult(step=-1)
            self._settle_recovery(self._coordinator())
            self._settle_drains(self._coordinator(), result, wait=float("inf") if timeout is None else timeout)
            for shared in self._shared.values():
                shared.join_prune()
            return result

    def _settle_replicas(self, coordinator: Coordinator, *, wait: float | None) -> None:
        replication = self._replication
        if replication is not None and replication.inflight and self._nodes is not None:
            before = replication.protected
            replication.settle(self._local_root(coordinator), coordinator, self._nodes, wait=wait)
            if replication.protected != before:  # a newer protected step frees the older one
                self._retain_local(coordinator)

    def wait_for_replicas(self, timeout: float | None = None) -> int | None:
        """Wait (at most ``timeout`` seconds on each rank) for the peer replication in flight and
        settle it (collective); the newest protected step this manager saw, or ``None``."""
        with self._lock, self._guard("wait_for_replicas()"):
            self._settle_replicas(self._coordinator(), wait=timeout)
            return self._replication.protected if self._replication is not None else None

    def close(self, *, wait: bool = True, timeout: float | None = None) -> None:
        """Finish (``wait``, bounded by ``timeout``) or abandon the drains and the peer
        replication in flight; an abandoned drain leaves nothing committed, and its staging is
        removed; an abandoned replication leaves the step unprotected. The preemption signals go
        back to their previous handlers (on the main thread). Once the process group broke, it
        abandons them without a collective (the coordinator removes the drains' staging) and
        returns at once; when it breaks during ``close``, it raises after that."""
        with self._lock:
            try:
                if self._loss.error is None and self._refused is None:  # refused: nothing in flight
                    with self._guard("close()"):
                        self._close_in_flight(wait=wait, timeout=timeout)
            finally:
                self._abandon_in_flight()
                for shared in self._shared.values():
                    shared.join_prune()
                handler = self._preemption
                main = threading.current_thread() is threading.main_thread()
                if handler is not None and handler.emergency_started is None and main:
                    handler.uninstall()  # the signals go back to their previous handlers
                    self._preemption = None

    def _close_in_flight(self, *, wait: bool, timeout: float | None) -> None:
        """:meth:`close`'s collective part: settle or abandon the replication and the drains."""
        if self._replication is not None:
            coordinator = self._coordinator()
            root = self._local_root(coordinator) if self._nodes is not None else None
            self._replication.close(root, coordinator, self._nodes, wait=wait, timeout=timeout)
        self._settle_recovery(self._coordinator(), resume=wait)
        if wait:
            limit = float("inf") if timeout is None else timeout
            self._settle_drains(self._coordinator(), LevelsSaveResult(step=-1), wait=limit)
        for shared in self._shared.values():
            if shared.drain is not None:
                shared.drain.abandon()
                shared.drain = None

    # -- preemption (see shardkeep.levels.preemption) -------------------------------------------
    def handle_preemption(
        self,
        signals: Sequence[int] = (signal.SIGTERM,),
        *,
        grace_seconds: float = 30.0,
        drain_seconds: float | None = None,
        exit_code: int = EXIT_PREEMPTED,
        aborted_exit_code: int = EXIT_PREEMPTED_ABORTED,
    ) -> PreemptionHandler:
        """Handle preemption ``signals`` from now on (main thread; once per process, else
        :class:`~shardkeep.errors.PreemptionHandlerError`): once a rank gets one, the ranks
        agree at the next :meth:`should_save`, :meth:`save` or :meth:`preempted`, settle the
        drains within ``grace_seconds``, save to the fastest level and exit with ``exit_code``
        (``aborted_exit_code`` when no emergency checkpoint committed). :meth:`close`
        uninstalls it."""
        handler = PreemptionHandler(
            signals,
            grace_seconds=grace_seconds,
            drain_seconds=drain_seconds,
            exit_code=exit_code,
            aborted_exit_code=aborted_exit_code,
        )
        handler.install()
        self._preemption = handler
        return handler

    def preempted(self, step: int) -> bool:
        """Whether the ranks agree they are preempted at ``step`` (collective: one all-reduce
        per step, cached; call it every step when ``should_save`` is not). When ``True``, the
        next :meth:`save` is the emergency save and exits."""
        with self._lock, self._guard(f"preempted({step})"):
            return self._preempted_at(step, self._coordinator()) is not None

    def _preempted_at(self, step: int, coordinator: Coordinator) -> Preemption | None:
        handler = self._preemption
        if handler is None or handler.emergency_started is not None:
            return None
        return handler.agree(step, coordinator)

    def _emergency(
        self,
        decision: Preemption,
        state: TrainingCheckpoint | Mapping[str, Any],
        metrics: Mapping[str, Any] | None,
        coordinator: Coordinator,
    ) -> None:
        """Settle the drains, save once to the fastest level (no drain started, no metric
        required), wait for its peer replicas within the grace period left, exit:
        :meth:`PreemptionHandler.run_emergency`."""
        assert self._preemption is not None
        step = decision.step
        fastest = self.local or self.levels[0]

        def settle(seconds: float) -> list[str]:
            result = LevelsSaveResult(step=step)
            self._settle_drains(coordinator, result, wait=seconds)
            report = [f"{name}: {checkpoint}" for name, checkpoint in result.committed.items()]
            report += [f"{name}: {reason}" for name, reason in result.skipped.items()]
            for name, shared in self._shared.items():
                if shared.drain is not None:
                    report.append(f"{name}: the drain of step {shared.drain_step} was abandoned")
                    shared.drain.abandon()
                    shared.drain = None
                # a retention after a drain committed finishes before the process exits (its
                # pointer files are written through a temporary sibling)
                shared.join_prune()
            return report

        def save() -> str:
            if self._fastest_step == step:
                return checkpoint_name(step)  # saved at this step already
            result = LevelsSaveResult(step=step)
            self._ensure_run_id(coordinator)
            if fastest.node_local:
                self._save_local(state, step, metrics, coordinator, result)
            else:
                self._save_shared(self._shared[fastest.name], state, step, metrics, result)
            if fastest.name not in result.committed:
                raise ShardkeepError(result.skipped.get(fastest.name, f"step {step} was not saved"))
            return result.committed[fastest.name]

        def protect(seconds: float) -> str:
            replication = self._replication
            if replication is None or step not in replication.inflight:
                return ""
            self._settle_replicas(coordinator, wait=seconds)
            if step in replication.inflight:
                return f"step {step} is not protected: its replication was still in flight after {seconds:.1f} s"
            if replication.protected == step:
                return f"step {step} is protected (every part has its replicas)"
            return f"step {step} is not protected: its replication failed (see the warning above)"

        self._preemption.run_emergency(
            decision, level=fastest.name, settle=settle, save=save, coordinator=coordinator, protect=protect
        )

    # -- listing -------------------------------------------------------------------------------
    def status(self, *, verify: bool = False) -> dict[str, list[LevelCopy]]:
        """Every level's copies, oldest step first, as this rank sees them (this node's part
        of a node-local level): see :mod:`shardkeep.levels.status`. ``verify`` reads every file
        (this node's files of a node-local level). Collective only the first time, when the
        node map is not known yet."""
        coordinator = self._coordinator()
        for shared in self._shared.values():
            shared.join_prune()
        found: dict[str, list[LevelCopy]] = {}
        for level in self.levels:
            if level.node_local:
                found[level.name] = level_copies(
                    level.name, self._local_root(coordinator), node_local=True, verify=verify
                )
            else:
                found[level.name] = level_copies(
                    level.name,
                    level.root_of(),
                    node_local=False,
                    verify=verify,
                    storage_options=level.storage_options,
                )
        return found

    # -- restoring -----------------------------------------------------------------------------
    def restore(self, into: Any = None, *, allow_fingerprint_change: bool = False) -> LevelsRestored | None:
        """Restore the newest step that can be completed from any level's verified copies
        (see docs/levels.md); ``None`` when no level holds any step. A drain in flight is
        waited for first; the clean-up of drains a crash cut off starts after the load.
        Collective.

        With a :class:`~shardkeep.training.TrainingCheckpoint` as ``into``, as
        :meth:`CheckpointManager.restore <shardkeep.manager.CheckpointManager.restore>` does: its
        modules, optimizer, EMA and scheduler are filled in place, its plain fields (iteration,
        best_val_loss, data_position, rng) are taken from the checkpoint (``model_args`` and
        ``config`` stay the caller's), and with ``track_rng`` the RNG states the checkpoint holds
        are put back. Without ``into``, a saved ``TrainingCheckpoint`` comes back as one.

        A step whose recorded model args or config differ from ``into``'s (or the manager's
        ``fingerprint``) raises :class:`~shardkeep.errors.FingerprintMismatchError` on every
        rank, naming the step, its levels and the fields, unless ``allow_fingerprint_change``;
        as ``CheckpointManager.restore`` does, the restore never falls back past such a step
        (see :mod:`~shardkeep.levels.fingerprints`)."""
        with self._lock, self._guard("restore()"):
            coordinator = self._coordinator()
            # A drain still in flight is finished first: recovery must not take its staging
            # for a crash's leftovers.
            self._settle_drains(coordinator, LevelsSaveResult(step=-1), wait=math.inf)
            self._settle_recovery(coordinator)
            for shared in self._shared.values():
                shared.join_prune()
            views = self._views(coordinator)
            rule = FingerprintRule.of(fingerprint_source(into, self._fingerprint), allow_fingerprint_change)
            target = into.load_target() if isinstance(into, TrainingCheckpoint) else into
            try:
                state, report = restore_best(views, target, coordinator, self._node_map(coordinator), fingerprint=rule)
            except NoCompleteStepError as exc:
                if exc.refusals:
                    raise
                return None  # no level holds any step: a fresh run
            if self._run_id is None and report.run_id:
                self._adopt_run_id(report.run_id)
            if report.newest_local_step is None or report.newest_local_step > report.step:
                # (the listing every rank saw names no newer local step: nothing to retire)
                self._retire_newer_local_steps(report.step, coordinator)
            self._recover(coordinator)
            state = training_state(into, state)
            for shared in self._shared.values():
                if shared.schedule is not None:
                    shared.schedule.saved(report.step)
            if self._local_schedule is not None:
                self._local_schedule.saved(report.step)
            return LevelsRestored(step=report.step, state=state, report=report)

    def _retire_newer_local_steps(self, restored: int, coordinator: Coordinator) -> None:
        """Remove, on every node, the local parts of steps newer than the step restored: they
        could not be completed, and the resumed run saves those step numbers again (one step,
        one timeline: a part of the abandoned timeline must never sit beside the new one)."""
        if self.local is None:
            return
        root = self._local_root(coordinator)
        leader = self._node_map(coordinator).is_leader(coordinator.rank)

        def retire() -> None:
            if not leader:
                return
            for found in scan(root):
                if found.step > restored and found.state != "staging":
                    logger.warning(
                        "level %r: removing this node's part of step %d, newer than the step restored (%d): "
                        "it cannot be completed, and the resumed run saves that step again",
                        self.local.name if self.local else "",
                        found.step,
                        restored,
                    )
                    remove_step(root, found.name)

        try:
            coordinator.step("retire local steps newer than the restored one", retire)
        except ShardkeepError as exc:
            logger.warning("level %r: cannot remove steps newer than the restored one: %s", self.local.name, exc)

    def _views(self, coordinator: Coordinator) -> list[LevelView]:
        views = []
        for level in self.levels:
            if level.node_local:
                views.append(LevelView(level.name, self._local_root(coordinator), node_local=True))
            else:
                store = self._shared[level.name].probed
                views.append(LevelView(level.name, level.root_of(), storage_options=level.storage_options, store=store))
        return views

    def _recover(self, coordinator: Coordinator) -> None:
        """Start cleaning up what drains cut off by a crash left on the shared levels: the
        coordinator, on a thread, from its node's committed local steps, after the restore (off
        its critical path). :meth:`_settle_recovery` drains again, per drain level, the newest
        local step whose drain was cut off and that is not persisted; every save, drain, wait
        and close settles it before any drain starts."""
        drained = [shared for shared in self._shared.values() if shared.level.source == "drain"]
        if not drained or self.local is None:
            return
        self._recovery = DrainRecovery()
        if coordinator.is_coordinator:
            names = [found.name for found in scan(self._local_root(coordinator)) if found.state == "committed"]
            self._recovery.start([shared.level for shared in drained], names)

    def _settle_recovery(self, coordinator: Coordinator, *, resume: bool = True) -> None:
        """Wait for the clean-up :meth:`_recover` started, then (``resume``) drain again what a
        crash cut off (collective)."""
        recovery, self._recovery = self._recovery, None
        if recovery is None:
            return
        recovery.join()
        again = coordinator.broadcast(recovery.again, label="interrupted drains to resume")
        if resume:
            self._resume_drains(again, coordinator)

    def _resume_drains(self, again: dict[str, list[str]], coordinator: Coordinator) -> None:
        """Drain again the newest local step whose drain a crash cut off (collective)."""
        result = LevelsSaveResult(step=-1)
        for level_name, names in again.items():
            if not names:
                continue
            shared = self._shared[level_name]
            step = max(step_of_checkpoint(name) for name in names)
            logger.warning("level %r: the drain of step %d was cut off; draining it again", level_name, step)
            try:
                shared.drain = self._new_drain(shared, step, coordinator)
                shared.drain.start()
            except ShardkeepError as exc:
                shared.drain = None
                self._fail(shared.level, f"the resumed drain of step {step}", exc, result)
                continue
            shared.drain_step = step
