"""What the ledger does after a job: the archived final copy, the removal of recorded batch files,
and the removal of leftovers no record names. Imports without torch.

Removal is recorded before it happens: :func:`mark_removals` sets ``removed_at`` on the records
whose files go (the caller writes that version durably), and only then does
:func:`remove_marked` delete the files, so a crash or error never leaves the ledger naming a
deleted file as present, and running it again finishes an interrupted cleanup.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from shardkeep.errors import LedgerStateError, StorageError
from shardkeep.ledger.format import LedgerState
from shardkeep.names import DELETING_MARKER, STAGING_MARKER, sibling_name
from shardkeep.storage.localfs import LocalFS

__all__ = [
    "DEFAULT_LEFTOVER_LEASE",
    "UNRECORDED_BATCH",
    "delete_path",
    "mark_removals",
    "remove_leftovers",
    "remove_marked",
    "require_complete",
    "write_archive",
]

DEFAULT_LEFTOVER_LEASE = 3600.0
# The name save_batch gives each attempt at a batch: batch_<index>-<attempt id>.
UNRECORDED_BATCH = re.compile(r"batch_\d{8,20}-[0-9a-f]{12}")

# resolve_file of the ledger: (recorded name, absolute path) of a batch file.
Resolve = Callable[[str | os.PathLike[str]], tuple[str, Path]]


def require_complete(state: LedgerState, action: str) -> None:
    """Raise :class:`~shardkeep.errors.LedgerStateError` naming the shards that are not complete."""
    incomplete = sorted(int(key) for key, entry in state.shards.items() if entry.status != "complete")
    if incomplete:
        raise LedgerStateError(f"cannot {action}: shards {incomplete} are not complete")


def write_archive(raw: bytes, ledger_path: Path, archive_dir: Path, fs: LocalFS) -> Path:
    """Write the ledger's exact bytes ``raw`` to ``archive_dir/<name>_final.json`` with
    :meth:`~shardkeep.storage.localfs.LocalFS.write_file_atomic` (a fresh temporary file,
    fsynced, renamed into place, the directory fsynced) and return that path. An earlier archive
    of the same name is replaced."""
    target = archive_dir / sibling_name(ledger_path.stem, "_final.json")
    try:
        fs.makedirs_durable(archive_dir)
        fs.write_file_atomic(target, raw)
    except OSError as exc:
        raise StorageError(f"cannot archive the ledger to {target}: {exc}") from exc
    return target


def mark_removals(state: LedgerState, *, keep_final_only: bool, force: bool, now: datetime) -> None:
    """Set ``removed_at`` on every record whose file a cleanup deletes: all but each shard's last
    with ``keep_final_only``, with ``force``, and for a shard that is not complete; all of them
    otherwise. Every shard must be complete unless ``force``."""
    if not force:
        require_complete(state, "clean up batch files")
    for entry in state.shards.values():
        keep_last = keep_final_only or force or entry.status != "complete"
        for record in entry.checkpoints[:-1] if keep_last else entry.checkpoints:
            if record.removed_at is None:
                record.removed_at = now


def remove_marked(state: LedgerState, resolve: Resolve, fs: LocalFS, *, force: bool, lease: float) -> int:
    """Delete the files of the records marked removed (never a file a kept record also names),
    and return how many were deleted. When every shard is complete and not ``force``, then remove
    the leftovers beside the batch files (:func:`remove_leftovers`). The caller holds the lock."""
    removed = 0
    directories: set[Path] = set()
    kept = {record.file for entry in state.shards.values() for record in entry.checkpoints if not record.removed_at}
    for entry in state.shards.values():
        for record in entry.checkpoints:
            _, absolute = resolve(record.file)
            directories.add(absolute.parent)
            # A file that a kept record also names (one file rewritten per batch) stays.
            if record.removed_at is not None and record.file not in kept and delete_path(absolute, fs):
                removed += 1
    if not force and all(entry.status == "complete" for entry in state.shards.values()):
        names = {record.file for entry in state.shards.values() for record in entry.checkpoints}
        for directory in sorted(directories):
            remove_leftovers(directory, names, lease, resolve, fs)
    return removed


def delete_path(path: Path, fs: LocalFS) -> bool:
    """Remove a file, symlink or directory without following symlinks; ``False`` if absent. A
    directory is first renamed to ``*.deleting-<id>`` (durably), so a half-removed one is never
    taken for a checkpoint (:meth:`~shardkeep.storage.localfs.LocalFS.retire_and_remove`)."""
    try:
        return fs.retire_and_remove(str(path))
    except OSError as exc:
        raise StorageError(f"cannot delete batch file {path}: {exc}") from exc


def remove_leftovers(directory: Path, recorded: set[str], lease: float, resolve: Resolve, fs: LocalFS) -> None:
    """Remove what no record in ``recorded`` names inside ``directory`` and in which nothing
    changed for ``lease`` seconds (:meth:`~shardkeep.storage.localfs.LocalFS.remove_idle`):
    interrupted saves (``*.tmp-*``), interrupted removals (``*.deleting-*``) and batch
    checkpoints saved but never recorded (``batch_<N>-<id>``). A symlinked directory is left."""

    def is_leftover(name: str) -> bool:
        if STAGING_MARKER in name or DELETING_MARKER in name:
            return True
        return UNRECORDED_BATCH.fullmatch(name) is not None and resolve(directory / name)[0] not in recorded

    try:
        fs.remove_idle(directory, is_leftover, lease)
    except OSError as exc:
        raise StorageError(f"cannot remove the leftovers in {directory}: {exc}") from exc
