"""shardkeep: fast, crash-safe, verifiable checkpoints for distributed training.

``import shardkeep`` does not import torch, start threads or read the environment: the names
that need torch (``save``, ``load``) are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shardkeep.cadence import SavePolicy
from shardkeep.catalog import CheckpointEntry
from shardkeep.config import LOCAL, WriteOptions
from shardkeep.errors import (
    CheckpointDataError,
    CheckpointExistsError,
    CheckpointFieldError,
    CheckpointNotFoundError,
    CommitRefusedError,
    ConfigError,
    CoordinationError,
    DependencyError,
    DrainError,
    FingerprintMismatchError,
    IntegrityError,
    LedgerCorruptedError,
    LedgerError,
    LedgerMismatchError,
    LedgerStateError,
    LevelConfigError,
    LevelUnreachableError,
    LevelWarning,
    ManagerError,
    ManifestCorruptedError,
    ManifestError,
    ManifestVersionError,
    NoCompleteStepError,
    PlacementError,
    PreemptionHandlerError,
    RetentionError,
    RunMismatchError,
    SaveInProgressError,
    ShardkeepError,
    SignatureError,
    StateMismatchError,
    StorageError,
    TierBudgetError,
    UnknownOptionError,
    UnsafePathError,
    UnsupportedValueError,
    UsageError,
    import_needing_torch,
)
from shardkeep.ledger import ProgressLedger
from shardkeep.levels.config import Level
from shardkeep.manifest import Manifest, Tier, ValidationResult, validate_manifest
from shardkeep.options import Incremental, LoadSelection, ManifestFields, TierPlan
from shardkeep.retention import RetentionPolicy
from shardkeep.retry import RetryPolicy
from shardkeep.tiers import PlacementInfo
from shardkeep.verification import VerifyReport, read_manifest, verify

if TYPE_CHECKING:
    from shardkeep.api import SaveHandle, async_save, load, load_slice, save
    from shardkeep.lazy import LazyTensor
    from shardkeep.ledger.batches import iter_batches, load_batch, save_batch
    from shardkeep.levels.manager import LevelsRestored, LevelsSaveResult, MultiLevelManager
    from shardkeep.manager import CheckpointManager, PendingSave, Restored
    from shardkeep.training import TrainingCheckpoint

__version__ = "0.1.0"

__all__ = [
    "CheckpointDataError",
    "CheckpointEntry",
    "CheckpointExistsError",
    "CheckpointFieldError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CommitRefusedError",
    "ConfigError",
    "CoordinationError",
    "DependencyError",
    "DrainError",
    "FingerprintMismatchError",
    "Incremental",
    "IntegrityError",
    "LOCAL",
    "LazyTensor",
    "LedgerCorruptedError",
    "LedgerError",
    "LedgerMismatchError",
    "LedgerStateError",
    "Level",
    "LevelConfigError",
    "LevelUnreachableError",
    "LevelWarning",
    "LevelsRestored",
    "LevelsSaveResult",
    "ManagerError",
    "LoadSelection",
    "Manifest",
    "ManifestCorruptedError",
    "ManifestError",
    "ManifestFields",
    "ManifestVersionError",
    "MultiLevelManager",
    "NoCompleteStepError",
    "PendingSave",
    "PlacementError",
    "PreemptionHandlerError",
    "PlacementInfo",
    "ProgressLedger",
    "Restored",
    "RetentionError",
    "RetentionPolicy",
    "RetryPolicy",
    "RunMismatchError",
    "SaveHandle",
    "SavePolicy",
    "SaveInProgressError",
    "ShardkeepError",
    "SignatureError",
    "StateMismatchError",
    "StorageError",
    "Tier",
    "TierBudgetError",
    "TierPlan",
    "TrainingCheckpoint",
    "UnknownOptionError",
    "UnsafePathError",
    "UnsupportedValueError",
    "UsageError",
    "ValidationResult",
    "VerifyReport",
    "WriteOptions",
    "__version__",
    "async_save",
    "iter_batches",
    "load",
    "load_batch",
    "load_slice",
    "read_manifest",
    "save",
    "save_batch",
    "validate_manifest",
    "verify",
]

_LAZY = {name: "shardkeep.api" for name in ("save", "load", "load_slice", "async_save", "SaveHandle")}
_LAZY.update({name: "shardkeep.ledger.batches" for name in ("save_batch", "load_batch", "iter_batches")})
_LAZY["LazyTensor"] = "shardkeep.lazy"
_LAZY["TrainingCheckpoint"] = "shardkeep.training"
_LAZY.update({name: "shardkeep.manager" for name in ("CheckpointManager", "PendingSave", "Restored")})
_LAZY.update({name: "shardkeep.levels.manager" for name in ("MultiLevelManager", "LevelsSaveResult", "LevelsRestored")})


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'shardkeep' has no attribute {name!r}")
    module = import_needing_torch(module_name, f"shardkeep.{name}")
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
