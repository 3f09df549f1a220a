"""Batch results of a ledger-tracked job: each written through :func:`shardkeep.save` first and
recorded in the :class:`~shardkeep.ledger.ProgressLedger` second, so the ledger never names a
result that is not durable.

A worker's loop::

    claim = ledger.claim_shard(shard, worker)
    for batch_idx in range(ledger.resume_info(shard)["resume_from_batch"], num_batches):
        result = process(batch_idx)
        save_batch(ledger, {"result": result}, shard=shard, batch_idx=batch_idx,
                   num_sequences=len(result), worker=worker, claim=claim)
    ledger.mark_shard_complete(shard, worker=worker, claim=claim)

Every attempt at a batch gets its own checkpoint directory, ``batch_<N>-<attempt id>``, and
nothing here ever deletes one. Crash windows: before :func:`shardkeep.save` commits, nothing is
recorded and at most a ``*.tmp-*`` staging directory is left. After the commit but before the
ledger records it, the attempt is committed but unrecorded: the resumed worker redoes the batch
under a new name, and the old attempt is left for ``cleanup_checkpoints`` (after a lease). A
zombie worker whose shard was reassigned can at worst leave such an unrecorded attempt: its
record is refused (``worker=``/``claim=`` fencing) and it never touches the new owner's files.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardkeep.api import load, save
from shardkeep.config import WriteOptions
from shardkeep.errors import LedgerStateError, UnsupportedValueError
from shardkeep.ledger.ledger import ProgressLedger
from shardkeep.manifest import Manifest
from shardkeep.options import ManifestFields

if TYPE_CHECKING:
    from shardkeep.options import Group, Signer

__all__ = ["iter_batches", "load_batch", "new_batch_path", "save_batch"]


def new_batch_path(ledger: ProgressLedger, shard: int, batch_idx: int) -> Path:
    """A fresh path for one attempt at a batch:
    ``<checkpoint_dir>/shard_<shard:05d>/batch_<batch_idx:08d>-<12 hex digits>``."""
    return ledger.checkpoint_dir / f"shard_{shard:05d}" / f"batch_{batch_idx:08d}-{uuid.uuid4().hex[:12]}"


def save_batch(
    ledger: ProgressLedger,
    state: Mapping[str, Any],
    *,
    shard: int,
    batch_idx: int,
    num_sequences: int,
    sequence_range: str | None = None,
    worker: int | None = None,
    claim: int | None = None,
    path: str | os.PathLike[str] | None = None,
    options: WriteOptions | None = None,
    fields: ManifestFields | None = None,
    signer: Signer | None = None,
    process_group: Group | None = None,
    **save_options: Any,
) -> Manifest:
    """Save one batch result with :func:`shardkeep.save` (committed, fsynced), then record it in
    the ledger. Returns the checkpoint's manifest.

    ``path`` defaults to :func:`new_batch_path`; a given one must lie inside the ledger's
    checkpoint directory and not exist (committed checkpoints are never replaced). ``worker``
    (the calling worker's rank) and ``claim`` (from :meth:`ProgressLedger.claim_shard`) fence
    the update: if the shard was reassigned or claimed again, the ledger refuses it.
    ``options``, ``fields``, ``signer``, ``process_group`` and ``save_options`` (any other
    keyword of :func:`shardkeep.save`, or its spelling of the previous release, with a
    :class:`DeprecationWarning`) go to :func:`shardkeep.save`. A batch
    the ledger already records, or a shard this worker no longer holds, is refused before
    anything is written (:class:`~shardkeep.errors.LedgerStateError`).
    """
    if process_group is None:
        _refuse_implicit_group()
    target = Path(path) if path is not None else new_batch_path(ledger, shard, batch_idx)
    name, absolute = ledger.resolve_file(target)
    ledger.check_batch(shard, batch_idx, worker=worker, claim=claim)
    manifest = save(
        state, absolute, options=options, fields=fields, signer=signer, process_group=process_group, **save_options
    )
    ledger.update_shard_checkpoint(shard, batch_idx, num_sequences, name, sequence_range, worker=worker, claim=claim)
    return manifest


def _refuse_implicit_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise UnsupportedValueError(
            "save_batch saves one worker's result, but torch.distributed is initialized in this process, so "
            "shardkeep.save would coordinate every rank; pass process_group=shardkeep.LOCAL (this process alone)"
        )


def _record(ledger: ProgressLedger, shard: int, batch_idx: int) -> str:
    entry = ledger.shard_status(shard)
    if entry is None:
        raise LedgerStateError(f"unknown shard {shard} in ledger {ledger.path}", shard)
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
    entry = ledger.shard_status(shard)
    if entry is None:
        raise LedgerStateError(f"unknown shard {shard} in ledger {ledger.path}", shard)
    for record in entry["checkpoints"]:
        if record.get("removed_at"):
            continue
        _, absolute = ledger.resolve_file(record["file"])
        yield record["batch_idx"], load(absolute, **load_options)
