"""The old import path of the coverage check, which lives in :mod:`shardkeep.manifest.coverage`
(beside the other checks of a manifest, below this layer); the names are the same objects."""

from shardkeep.manifest.coverage import coverage_problems

__all__ = ["coverage_problems"]
