"""The progress ledger of a multi-worker batch job: one locked, checksummed JSON file with the
progress of every shard, and the batch results recorded in it. Imports without torch.

The package, bottom-up: :mod:`~shardkeep.ledger.format` (the structs and the checksummed bytes),
:mod:`~shardkeep.ledger.lock` (the ``flock`` protocol), :mod:`~shardkeep.ledger.files` (reading
the highest valid copy, the crash-safe write), :mod:`~shardkeep.ledger.cleanup` (archive,
removal of batch files and leftovers), :mod:`~shardkeep.ledger.ledger` (:class:`ProgressLedger`,
the state machine) and :mod:`~shardkeep.ledger.batches` (batch results saved with
:func:`shardkeep.save`; it needs torch and is imported only when used, e.g. through
``shardkeep.save_batch``). See docs/ledger.md.
"""

from __future__ import annotations

# Also importable from here, outside __all__ (spelled `X as X`).
from shardkeep.ledger.cleanup import DEFAULT_LEFTOVER_LEASE as DEFAULT_LEFTOVER_LEASE
from shardkeep.ledger.cleanup import UNRECORDED_BATCH as UNRECORDED_BATCH
from shardkeep.ledger.format import (
    LEDGER_VERSION,
    BatchRecord,
    GlobalCheckpoint,
    LedgerState,
    Reassignment,
    ShardEntry,
)
from shardkeep.ledger.format import Status as Status
from shardkeep.ledger.format import Timestamp as Timestamp
from shardkeep.ledger.format import checked_sequence as checked_sequence
from shardkeep.ledger.format import decode_state as decode_state
from shardkeep.ledger.format import encode_state as encode_state
from shardkeep.ledger.ledger import DEFAULT_LOCK_TIMEOUT as DEFAULT_LOCK_TIMEOUT
from shardkeep.ledger.ledger import DEFAULT_MAX_BYTES as DEFAULT_MAX_BYTES
from shardkeep.ledger.ledger import (
    DEFAULT_STALENESS_SEC,
    MAX_ORPHANED_RETRIES,
    ProgressLedger,
)
from shardkeep.ledger.lock import NETWORK_FILESYSTEMS as NETWORK_FILESYSTEMS
from shardkeep.ledger.lock import LedgerLockWarning, filesystem_type

__all__ = [
    "DEFAULT_STALENESS_SEC",
    "LEDGER_VERSION",
    "MAX_ORPHANED_RETRIES",
    "BatchRecord",
    "GlobalCheckpoint",
    "LedgerLockWarning",
    "LedgerState",
    "ProgressLedger",
    "Reassignment",
    "ShardEntry",
    "filesystem_type",
]
