"""shardkeep: fast, crash-safe, verifiable checkpoints for distributed training.

``import shardkeep`` does not import torch, start threads or read the environment: the names
that need torch (``save``, ``load``) are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shardkeep.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CoordinationError,
    IntegrityError,
    ManifestError,
    ManifestVersionError,
    SaveInProgressError,
    ShardkeepError,
    StorageError,
    UnsafePathError,
    UnsupportedValueError,
)
from shardkeep.manifest import Manifest, ValidationResult, validate_manifest
from shardkeep.verification import VerifyReport, read_manifest, verify

if TYPE_CHECKING:
    from shardkeep.api import SaveHandle, async_save, load, save

__version__ = "0.1.0"

__all__ = [
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CoordinationError",
    "IntegrityError",
    "Manifest",
    "ManifestError",
    "ManifestVersionError",
    "SaveHandle",
    "SaveInProgressError",
    "ShardkeepError",
    "StorageError",
    "UnsafePathError",
    "UnsupportedValueError",
    "ValidationResult",
    "VerifyReport",
    "__version__",
    "async_save",
    "load",
    "read_manifest",
    "save",
    "validate_manifest",
    "verify",
]

_LAZY = {name: "shardkeep.api" for name in ("save", "load", "async_save", "SaveHandle")}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'shardkeep' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
