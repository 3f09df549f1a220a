"""Saving a checkpoint: one pipeline for ``sk.save``, ``async_save`` and the DCP adapter.

- :mod:`~shardkeep.saving.settings`: :class:`SaveSettings`, every option of a save;
- :mod:`~shardkeep.saving.job`: :class:`SaveJob`, the phases prepare -> write -> finish -> abort,
  and :func:`run_save`;
- :mod:`~shardkeep.saving.manifest_build`: the manifest of a save and :func:`commit_manifest`,
  shared with :class:`shardkeep.integrations.dcp.ShardkeepWriter`;
- :mod:`~shardkeep.saving.incremental`: files equal to an incremental base's, and version proofs;
- :mod:`~shardkeep.saving.wire`: :class:`RankReport`, what a rank sends the coordinator.
"""

from shardkeep.saving.job import SaveJob, run_job, run_save
from shardkeep.saving.manifest_build import DEFAULT_TIER, metric_values, state_sections, warn_if_over_read_limits
from shardkeep.saving.settings import SaveSettings
from shardkeep.saving.wire import RankReport

__all__ = [
    "DEFAULT_TIER",
    "RankReport",
    "SaveJob",
    "SaveSettings",
    "metric_values",
    "run_job",
    "run_save",
    "state_sections",
    "warn_if_over_read_limits",
]
