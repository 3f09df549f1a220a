"""Batch results of a ledger-tracked job: each written through :func:`shardkeep.save` first and
recorded in the :class:`~shardkeep.ledger.ProgressLedger` second, so the ledger never names a
result that is not durable.

A worker's loop::

    for batch_idx in range(ledger.get_resume_info(shard)["resume_from_batch"], num_batches):
        result = process(batch_idx)
        save_batch(ledger, {"result": result}, shard=shard, batch_idx=batch_idx,
                   num_sequences=len(result), worker=worker)
    ledger.mark_shard_complete(shard, worker=worker)

Crash windows: before :func:`shardkeep.save` commits, nothing is recorded and at most a
``*.tmp-*`` staging directory is left (removed by ``cleanup_checkpoints``). After the commit but
before the ledger records it, the batch is committed but unrecorded: the resumed worker redoes
that batch, and :func:`save_batch` un-commits (renames, then removes) the unrecorded copy before
writing the new one. After the ledger records it, the batch is done and never redone.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from shardkeep.api import load, save
from shardkeep.errors import LedgerStateError, StorageError, UnsupportedValueError
from shardkeep.ledger import ProgressLedger
from shardkeep.manifest import DELETING_MARKER, MANIFEST_FILENAME, Manifest

__all__ = ["batch_path", "iter_batches", "load_batch", "save_batch"]

logger = logging.getLogger(__name__)


def batch_path(ledger: ProgressLedger, shard: int, batch_idx: int) -> Path:
    """Where :func:`save_batch` puts a batch by default:
    ``<checkpoint_dir>/shard_<shard:05d>/batch_<batch_idx:08d>``."""
    return ledger.checkpoint_dir / f"shard_{shard:05d}" / f"batch_{batch_idx:08d}"


def _uncommit(path: Path) -> None:
    doomed = path.with_name(f"{path.name}{DELETING_MARKER}{uuid.uuid4().hex[:12]}")
    try:
        os.rename(path, doomed)
        shutil.rmtree(doomed)
    except OSError as exc:
        raise StorageError(f"cannot remove the unrecorded batch checkpoint {path}: {exc}") from exc


def save_batch(
    ledger: ProgressLedger,
    state: Mapping[str, Any],
    *,
    shard: int,
    batch_idx: int,
    num_sequences: int,
    sequence_range: str | None = None,
    worker: int | None = None,
    path: str | os.PathLike[str] | None = None,
    **save_options: Any,
) -> Manifest:
    """Save one batch result with :func:`shardkeep.save` (committed, fsynced), then record it in
    the ledger. Returns the checkpoint's manifest.

    ``path`` defaults to :func:`batch_path`; it must lie inside the ledger's checkpoint directory.
    ``worker`` (the calling worker's rank) fences the update: if the shard was reassigned to
    another worker, the ledger refuses it. ``save_options`` go to :func:`shardkeep.save`
    (``compression=``, ``digest=`` ...). A batch the ledger already records is refused before
    anything is written (:class:`~shardkeep.errors.LedgerStateError`).
    """
    if "process_group" not in save_options:
        _refuse_implicit_group()
    target = Path(path) if path is not None else batch_path(ledger, shard, batch_idx)
    name, absolute = ledger.resolve_file(target)
    info = ledger.get_resume_info(shard)
    if info["status"] == "unknown":
        raise LedgerStateError(f"unknown shard {shard} in ledger {ledger.manifest_path}", shard)
    if worker is not None and info["assigned_rank"] != worker:
        raise LedgerStateError(
            f"shard {shard} is assigned to worker {info['assigned_rank']}, not worker {worker}; not saving batch "
            f"{batch_idx}",
            shard,
        )
    if batch_idx < info["resume_from_batch"]:
        raise LedgerStateError(
            f"shard {shard} already recorded batch {info['last_completed_batch']}; batch {batch_idx} is done "
            f"(resume from batch {info['resume_from_batch']})",
            shard,
        )
    if (absolute / MANIFEST_FILENAME).exists():
        logger.warning("removing batch checkpoint %s: committed by an earlier attempt but never recorded", absolute)
        _uncommit(absolute)
    manifest = save(state, absolute, **save_options)
    ledger.update_shard_checkpoint(shard, batch_idx, num_sequences, name, sequence_range, worker=worker)
    return manifest


def _refuse_implicit_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise UnsupportedValueError(
            "save_batch saves one worker's result, but torch.distributed is initialized in this process, so "
            "shardkeep.save would coordinate every rank; pass process_group= a group that holds only this rank"
        )


def _record(ledger: ProgressLedger, shard: int, batch_idx: int) -> str:
    entry = ledger.get_shard_status(shard)
    if entry is None:
        raise LedgerStateError(f"unknown shard {shard} in ledger {ledger.manifest_path}", shard)
    for record in entry["checkpoints"]:
        if record["batch_idx"] == batch_idx:
            if record.get("removed_at"):
                raise LedgerStateError(
                    f"batch {batch_idx} of shard {shard} was removed by cleanup_checkpoints at {record['removed_at']}",
                    shard,
                )
            return str(record["file"])
    raise LedgerStateError(
        f"batch {batch_idx} of shard {shard} is not recorded (last recorded: {entry['last_checkpoint_batch']})", shard
    )


def load_batch(ledger: ProgressLedger, shard: int, batch_idx: int, **load_options: Any) -> Any:
    """Load a recorded batch with :func:`shardkeep.load` (verified by default)."""
    _, absolute = ledger.resolve_file(_record(ledger, shard, batch_idx))
    return load(absolute, **load_options)


def iter_batches(ledger: ProgressLedger, shard: int, **load_options: Any) -> Iterator[tuple[int, Any]]:
    """``(batch_idx, state)`` for every recorded, not removed batch of ``shard``, in order."""
    entry = ledger.get_shard_status(shard)
    if entry is None:
        raise LedgerStateError(f"unknown shard {shard} in ledger {ledger.manifest_path}", shard)
    for record in entry["checkpoints"]:
        if record.get("removed_at"):
            continue
        _, absolute = ledger.resolve_file(record["file"])
        yield record["batch_idx"], load(absolute, **load_options)
