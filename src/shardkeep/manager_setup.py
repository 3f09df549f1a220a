"""How a :class:`~shardkeep.manager.CheckpointManager` is set up: its option groups (and the
old keyword spellings it still accepts), the checks of its arguments, its root and its run id."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import errno
import os
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from shardkeep.config import WriteOptions
from shardkeep.errors import ConfigError, StorageError
from shardkeep.manifest import RUN_ID_PATTERN, Tier
from shardkeep.options import LEGACY_KEYWORDS, Incremental, ManifestFields, Regrouped, TierPlan, regroup
from shardkeep.saving import SaveSettings
from shardkeep.storage import ByteStore, LocalStore, StoreOperations, adapt_store, local_path, localfs, open_store

__all__ = ["MANAGER_LEGACY", "check_manager_arguments", "local_root", "manager_groups", "new_run_id", "open_root"]


#: The old keyword spellings ``CheckpointManager(**save_options)`` still accepts (the per-save
#: ones, such as ``step`` or ``metrics``, the manager sets itself).
MANAGER_LEGACY = (
    *(f.name for f in dataclasses.fields(WriteOptions) if f.name in LEGACY_KEYWORDS and f.name != "progress"),
    "placement",
    "trust_versions",
    *(f.name for f in dataclasses.fields(ManifestFields) if f.name != "metrics"),
)


def manager_groups(
    legacy: Mapping[str, Any],
    options: WriteOptions | None,
    tiers: TierPlan | Sequence[Tier] | None,
    incremental: bool | Incremental,
    fields: ManifestFields | None,
) -> Regrouped:
    """The manager's option groups, refusing what the manager decides for each save itself."""
    if not isinstance(incremental, (bool, Incremental)):
        raise ConfigError(f"incremental={incremental!r} must be True or False (the manager picks the base)")
    groups = regroup(
        "CheckpointManager",
        legacy,
        options=options,
        tiers=tiers,
        incremental=incremental,
        fields=fields,
        accepted=MANAGER_LEGACY,
    )
    if not isinstance(groups.incremental.base, bool):
        raise ConfigError(
            f"incremental=Incremental(base={groups.incremental.base!r}): the manager picks the base; pass base=True"
        )
    if groups.fields.metrics is not None:
        raise ConfigError("fields=ManifestFields(metrics=...): the metrics of each save go to CheckpointManager.save")
    return groups


def check_manager_arguments(
    run_id: str | None, staging_lease: float, incremental: bool, read_only: bool, settings: SaveSettings
) -> None:
    """Refuse bad ``CheckpointManager`` arguments, naming the argument and its value."""
    if run_id is not None and (not isinstance(run_id, str) or not RUN_ID_PATTERN.fullmatch(run_id)):
        raise ConfigError(
            f"run_id={run_id!r} must be 1-128 characters of letters, digits, '.', '_' or '-', starting alphanumeric"
        )
    if isinstance(staging_lease, bool) or not isinstance(staging_lease, (int, float)) or staging_lease < 0:
        raise ConfigError(f"staging_lease={staging_lease!r} must be a number of seconds >= 0")
    if not isinstance(incremental, bool):
        raise ConfigError(f"incremental={incremental!r} must be True or False (the manager picks the base)")
    if incremental and settings.compression:
        raise ConfigError(
            "incremental=True cannot be combined with compression yet; pass WriteOptions(compression=None)"
        )
    if not isinstance(read_only, bool):
        raise ConfigError(f"read_only={read_only!r} must be True or False")


def open_root(
    root: str, storage: StoreOperations | None, storage_options: Mapping[str, Any] | None, *, create: bool
) -> tuple[ByteStore, str]:
    """The manager's store and how its root is shown: a given store, an fsspec URL, or a local
    directory (created unless read-only)."""
    if storage is not None:
        return adapt_store(storage), root
    local = local_path(root)
    if local is None:
        return open_store(root, storage_options), root.rstrip("/")
    return local_root(local, create=create), local


def local_root(root: str, *, create: bool) -> LocalStore:
    """The local directory ``root`` as a byte store, created unless it exists (or ``create`` is
    false); an unusable root raises :class:`~shardkeep.errors.StorageError` naming it."""
    try:
        if create:
            localfs.makedirs_durable(root)
        if os.path.lexists(root) and not os.path.isdir(root):
            raise StorageError(f"checkpoint root {root} is not a directory")
        return LocalStore(root)
    except FileExistsError as exc:  # makedirs over a file
        raise StorageError(f"checkpoint root {root} is a file, not a directory") from exc
    except NotADirectoryError as exc:
        raise StorageError(f"checkpoint root {root} lies under a file, not a directory: {exc.filename}") from exc
    except OSError as exc:
        reason = "a read-only filesystem" if exc.errno == errno.EROFS else os.strerror(exc.errno or 0) or str(exc)
        raise StorageError(f"cannot create the checkpoint root {root}: {reason}") from exc


def new_run_id() -> str:
    now = _dt.datetime.now(_dt.UTC)
    return f"{now:%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:8]}"
