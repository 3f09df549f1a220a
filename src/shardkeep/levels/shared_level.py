"""The bookkeeping of a :class:`~shardkeep.levels.manager.MultiLevelManager` beside its
protocol: a shared level with its drain in flight and its background retention, the clean-up of
drains a crash cut off, and the small conversions of a restore and of local retention."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shardkeep.cadence import SaveSchedule
from shardkeep.distributed.coordinator import Coordinator
from shardkeep.levels.config import Level
from shardkeep.levels.drain import Drain, recover_drains
from shardkeep.levels.local_catalog import LocalStep, read_part
from shardkeep.manager import CheckpointManager
from shardkeep.retention import CheckpointInfo, RetentionPolicy
from shardkeep.training import TRAINING_CHECKPOINT_SCHEMA, TrainingCheckpoint

if TYPE_CHECKING:
    from shardkeep.storage import ByteStore

__all__ = ["DrainRecovery", "SharedLevel", "keep_every_step", "local_step_info", "training_state"]

logger = logging.getLogger("shardkeep.levels")


class SharedLevel:
    """A shared level: its configuration, its manager and schedule, and its drain in flight."""

    def __init__(self, level: Level, manager: CheckpointManager) -> None:
        self.level = level
        self.manager = manager
        self.schedule = SaveSchedule(level.save_policy) if level.save_policy is not None else None
        self.drain: Drain | None = None
        self.drain_step: int | None = None
        #: Due while no local step committed since: the next one is drained.
        self.drain_due = False
        #: On the coordinator: the level's retention after a drain committed, running.
        self.pruning: threading.Thread | None = None
        self.probed: ByteStore | None = None

    @classmethod
    def opened(cls, level: Level, probe: ByteStore, **manager_options: Any) -> SharedLevel:
        """The shared level ``level``, whose store ``probe`` was opened and listed (a restore
        lists through it), with its :class:`~shardkeep.manager.CheckpointManager` on its root:
        the level's retention (default: every step kept; the manager applies it) and storage
        options, and ``manager_options`` (``run_id``, ``process_group``, ``retry`` ...)."""
        policy = level.retention or RetentionPolicy(keep_last=1, keep_best=0, keep_fn=keep_every_step)
        manager = CheckpointManager(
            level.root_of(),
            keep_last=policy.keep_last,
            keep_best=policy.keep_best,
            metric=policy.metric,
            mode=policy.mode,
            storage_options=level.storage_options,
            # A drain checks every digest while copying: retention after it need not read
            # the newest checkpoint back on the training thread.
            verify_newest=level.source == "save",
            **manager_options,
        )
        manager.policy = policy
        shared = cls(level, manager)
        shared.probed = probe
        return shared

    def prune_later(self, coordinator: Coordinator) -> None:
        """Apply the level's retention on a background thread of the coordinator (a prune is
        the coordinator's alone, without a collective), so that a committed drain does not
        block training on listing, verifying and deleting; see :meth:`join_prune`."""
        self.join_prune()
        if not coordinator.is_coordinator:
            return

        def prune() -> None:
            try:
                self.manager.prune()
            except Exception as exc:  # logged: retention runs again after the next drain
                logger.warning("level %r: retention after a drain failed: %s", self.level.name, exc)

        self.pruning = threading.Thread(target=prune, name=f"shardkeep-retention-{self.level.name}", daemon=True)
        self.pruning.start()

    def join_prune(self) -> None:
        """Wait for the retention started by :meth:`prune_later` (before the level's next
        drain, a restore, a listing and close)."""
        if self.pruning is not None:
            self.pruning.join()
            self.pruning = None


@dataclass
class DrainRecovery:
    """The clean-up of drains a crash cut off, started after a restore: the coordinator's
    thread, and per drain level the local steps to drain again."""

    thread: threading.Thread | None = None
    again: dict[str, list[str]] = field(default_factory=dict)

    def start(self, levels: Sequence[Level], names: Sequence[str]) -> None:
        """On the coordinator: clean up, on a thread, what drains to ``levels`` cut off by a
        crash left there, given this node's committed local steps ``names``; each level's steps
        to drain again go to :attr:`again`."""

        def recover() -> None:
            for level in levels:
                try:
                    found = recover_drains(level.root_of(), list(names), storage_options=level.storage_options)
                except Exception as exc:  # logged: the leftovers stay until the next restore
                    logger.warning("level %r: cannot clean up interrupted drains: %s", level.name, exc)
                    continue
                self.again[level.name] = list(found.redrain)

        self.thread = threading.Thread(target=recover, name="shardkeep-recovery", daemon=True)
        self.thread.start()

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()


def keep_every_step(checkpoint: CheckpointInfo) -> bool:
    """The retention of a level given ``retention=None``: every step is kept."""
    return True


def training_state(into: Any, loaded: Any) -> Any:
    """The restored state as the caller wants it: ``into`` (a TrainingCheckpoint) updated from
    what was loaded into its target, with its RNG states put back; a loaded TrainingCheckpoint
    state as one; anything else as loaded."""
    if isinstance(into, TrainingCheckpoint):
        into.update_from({key: value for key, value in loaded.items() if key not in ("model_args", "config")})
        if into.track_rng and into.rng is not None and "rng" in loaded:
            TrainingCheckpoint.restore_rng(into.rng)
        return into
    if into is None and isinstance(loaded, Mapping) and loaded.get("schema") == TRAINING_CHECKPOINT_SCHEMA:
        return TrainingCheckpoint.from_state(loaded)
    return loaded


def local_step_info(root: str, found: LocalStep, metric: str) -> CheckpointInfo:
    """What retention needs of one committed local step (from its manifest)."""
    _, manifest, _ = read_part(root, found.name)
    value = (manifest.metrics or {}).get(metric)
    created = manifest.created_at
    return CheckpointInfo(
        name=found.name,
        step=found.step,
        metric=float(value) if isinstance(value, (int, float)) else None,
        verified=True,
        created=created.timestamp() if hasattr(created, "timestamp") else None,
    )
