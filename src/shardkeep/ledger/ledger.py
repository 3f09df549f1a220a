"""The progress ledger's state machine: :class:`ProgressLedger`, the per-shard progress of a
multi-worker batch job in one locked, checksummed JSON file. Imports without torch.

N worker processes each own a shard of the input and record every batch they finish. When a
worker crashes or hangs, the job resumes its shard from the last recorded batch, or hands the
shard to a healthy worker, without redoing finished work and without losing a recorded batch.

Every change takes the lock (:mod:`shardkeep.ledger.lock`), reads the newest valid copy, applies
the change and writes the next version durably (:mod:`shardkeep.ledger.files`) before it
returns. Reads take no lock. The bytes of each version are :mod:`shardkeep.ledger.format`; what
happens after the job (archive, removal of batch files and leftovers) is
:mod:`shardkeep.ledger.cleanup`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from pathlib import Path, PurePosixPath
from typing import Any

import msgspec

from shardkeep.errors import (
    BatchFileMissingError,
    LedgerCorruptedError,
    LedgerError,
    LedgerMismatchError,
    LedgerNotFoundError,
    LedgerStateError,
    StorageError,
    UnsafePathError,
    UnsupportedValueError,
)
from shardkeep.ledger.cleanup import (
    DEFAULT_LEFTOVER_LEASE,
    mark_removals,
    remove_marked,
    require_complete,
    write_archive,
)
from shardkeep.ledger.files import Copy, LedgerCopies, Loaded
from shardkeep.ledger.format import (
    LEDGER_VERSION,
    BatchRecord,
    GlobalCheckpoint,
    LedgerState,
    Reassignment,
    ShardEntry,
    timestamp_now,
)
from shardkeep.ledger.lock import LedgerLock
from shardkeep.names import MANIFEST_FILENAME
from shardkeep.storage import localfs

__all__ = [
    "DEFAULT_LOCK_TIMEOUT",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_STALENESS_SEC",
    "MAX_ORPHANED_RETRIES",
    "ProgressLedger",
]

logger = logging.getLogger(__name__)

DEFAULT_STALENESS_SEC = 600.0
MAX_ORPHANED_RETRIES = 3
DEFAULT_LOCK_TIMEOUT = 120.0
DEFAULT_MAX_BYTES = 512 * 1024 * 1024


def _iso(timestamp: datetime | None) -> str | None:
    return None if timestamp is None else timestamp.isoformat()


def _check_index(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UnsupportedValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


class _AlreadyRecorded(Exception):
    """Internal: the change is already in the ledger; nothing to write."""


class ProgressLedger:
    """Cross-process progress of a sharded batch job: which batch each shard has finished, who
    processes it, and whether it is complete, failed, stale or orphaned.

    ``path`` is the ledger's JSON file; ``world_size`` the number of shards (one per worker at the
    start). Pass ``world_size=None`` to open an existing ledger with whatever it records.

    Keyword options:

    - ``staleness_threshold_sec`` (600): an in-progress shard with no recorded batch (or
      reassignment) for longer than this is *stale*: its worker may be hung.
    - ``max_retries`` (3): a failed shard with this many failures is *orphaned*.
    - ``checkpoint_dir``: the directory batch files are recorded relative to (default: the
      ledger's directory). Recorded files must lie inside it.
    - ``clock``: a function returning seconds since the epoch (default ``time.time``), for tests.
    - ``lock_timeout`` (120 s): how long a change waits for the lock before
      :class:`~shardkeep.errors.LedgerLockTimeoutError`.
    - ``max_bytes``: refuse to read a ledger file larger than this.

    Every method that changes the ledger takes the lock, re-reads the newest valid version, applies
    the change, and writes it durably before returning. Methods that only read take no lock.
    Processes started with ``spawn`` each construct their own ``ProgressLedger`` on the same path.
    Every file operation is a step of the :class:`~shardkeep.storage.localfs.LocalFS` in use
    (:func:`~shardkeep.storage.localfs.current`; crash tests install theirs with
    :func:`~shardkeep.storage.localfs.using`).

    The names of the progress-manifest design are aliases: ``manifest_path`` of :attr:`path`,
    ``archive_manifest`` of :meth:`archive`, and each ``get_*`` query of the query without the
    prefix (``get_global_progress`` of :meth:`progress`).
    """

    MAX_ORPHANED_RETRIES = MAX_ORPHANED_RETRIES

    def __init__(
        self,
        path: str | os.PathLike[str],
        world_size: int | None = None,
        *,
        staleness_threshold_sec: float = DEFAULT_STALENESS_SEC,
        max_retries: int = MAX_ORPHANED_RETRIES,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        clock: Callable[[], float] | None = None,
        lock_timeout: float | None = DEFAULT_LOCK_TIMEOUT,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        self.path = Path(path)
        if self.path.name in ("", ".", ".."):
            raise UnsupportedValueError(f"ledger path must name a file, got {str(path)!r}")
        if world_size is not None:
            _check_index("world_size", world_size)
            if world_size < 1:
                raise UnsupportedValueError(f"world_size must be at least 1, got {world_size}")
        if not staleness_threshold_sec > 0:
            raise UnsupportedValueError(f"staleness_threshold_sec must be positive, got {staleness_threshold_sec!r}")
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 1:
            raise UnsupportedValueError(f"max_retries must be a positive int, got {max_retries!r}")
        self.world_size = world_size
        self.staleness_threshold_sec = float(staleness_threshold_sec)
        self.max_retries = max_retries
        base = Path(checkpoint_dir) if checkpoint_dir is not None else self.path.parent
        self.checkpoint_dir = Path(os.path.abspath(base))
        self.clock: Callable[[], float] = clock or time.time
        self.lock_timeout = lock_timeout
        self.max_bytes = max_bytes
        self._copies = LedgerCopies(self.path)
        self.tmp_path = self._copies.tmp_path
        self.backup_path = self._copies.backup_path
        self.lock_path = self._copies.lock_path
        self._lock = LedgerLock(self.path, self.lock_path)

    @property
    def manifest_path(self) -> Path:
        """The ledger's path: the deprecated spelling of :attr:`path`."""
        return self.path

    def __repr__(self) -> str:
        return f"ProgressLedger({str(self.path)!r}, world_size={self.world_size})"

    # ----------------------------------------------------------------------------------------
    # Reading

    def exists(self) -> bool:
        """Whether any copy of the ledger exists (it may still need recovery)."""
        return self._copies.exists()

    def _load(self, *, check_world_size: bool = True) -> Loaded:
        """The newest valid version: (state, its exact bytes, which copy it came from)."""
        world_size = self.world_size if check_world_size else None
        return self._copies.load(max_bytes=self.max_bytes, world_size=world_size)

    def read(self) -> LedgerState:
        """The newest valid version of the ledger, as a typed structure (a fresh copy)."""
        return self._load()[0]

    def to_dict(self) -> dict[str, Any]:
        """The newest valid version as plain JSON data (the file's fields)."""
        result: dict[str, Any] = msgspec.to_builtins(self.read())
        return result

    # ----------------------------------------------------------------------------------------
    # Writing

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the ledger's exclusive lock (see :class:`~shardkeep.ledger.lock.LedgerLock`),
        waiting at most :attr:`lock_timeout` seconds."""
        self._lock.warn_if_network_filesystem()
        self._copies.refuse_a_directory()
        with self._lock.held(self.lock_timeout):
            yield

    def _write(self, state: LedgerState, previous: bytes | None, source: Copy | None) -> None:
        """Write ``state`` as the next version over ``previous`` (read from ``source``). Caller
        holds the lock."""
        self._copies.write(state, previous, source, localfs.current())

    def _check_writable(self, state: LedgerState) -> None:
        if state.version != LEDGER_VERSION:
            raise LedgerError(
                f"ledger {self.path} has schema version {state.version}, newer than this shardkeep "
                f"writes ({LEDGER_VERSION}); it is read-only here: upgrade shardkeep to change it"
            )

    def _mutate(self, change: Callable[[LedgerState], Any]) -> Any:
        """Apply ``change`` to the newest version under the lock and write the result durably."""
        with self._locked():
            state, raw, source = self._load()
            self._check_writable(state)
            try:
                result = change(state)
            except _AlreadyRecorded:
                if source == "primary":
                    raise
                result = None  # nothing to change, but rewrite the primary from the recovered copy
            state.sequence += 1
            state.updated_at = timestamp_now(self.clock)
            self._write(state, raw, source)
            return result

    # ----------------------------------------------------------------------------------------
    # Lifecycle and run compatibility

    def initialize(
        self,
        world_size: int | None = None,
        input_fingerprint: str = "",
        model_config_hash: str = "",
        *,
        overwrite: bool = False,
    ) -> dict[str, Any]:
        """Create the ledger with one in-progress shard per worker, and return it as a dict.

        If a ledger already exists it is kept: its world size, input fingerprint and model config
        hash must match the ones given (``LedgerMismatchError`` lists the differences), and empty
        recorded values are filled in. So a restarted driver can call ``initialize`` again without
        losing progress. ``overwrite=True`` starts afresh (the sequence number keeps increasing, so
        an old copy never wins recovery).
        """
        size = world_size if world_size is not None else self.world_size
        if size is None:
            raise UnsupportedValueError("initialize() needs a world_size (here or in the constructor)")
        _check_index("world_size", size)
        if size < 1:
            raise UnsupportedValueError(f"world_size must be at least 1, got {size}")
        if self.world_size is not None and size != self.world_size:
            raise UnsupportedValueError(
                f"initialize(world_size={size}) disagrees with the constructor's world_size={self.world_size}"
            )
        for name, value in (("input_fingerprint", input_fingerprint), ("model_config_hash", model_config_hash)):
            if not isinstance(value, str):
                raise UnsupportedValueError(f"{name} must be a str, got {type(value).__name__}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot create the ledger directory {self.path.parent}: {exc}") from exc
        with self._locked():
            previous: Loaded | None
            try:
                previous = self._load(check_world_size=False)
            except (LedgerNotFoundError, LedgerCorruptedError) as exc:
                if isinstance(exc, LedgerCorruptedError) and not overwrite:
                    raise
                previous = None
            if previous is not None and not overwrite:
                state, raw, source = previous
                differences = self._differences(state, size, input_fingerprint, model_config_hash)
                if differences:
                    raise self._mismatch(differences)
                self.world_size = state.world_size
                if (input_fingerprint and not state.input_fingerprint) or (
                    model_config_hash and not state.model_config_hash
                ):
                    state.input_fingerprint = state.input_fingerprint or input_fingerprint
                    state.model_config_hash = state.model_config_hash or model_config_hash
                    self._check_writable(state)
                    state.sequence += 1
                    state.updated_at = timestamp_now(self.clock)
                    self._write(state, raw, source)
                return dict(msgspec.to_builtins(state))
            now = timestamp_now(self.clock)
            state = LedgerState(
                checksum="",
                sequence=(previous.state.sequence + 1) if previous else 1,
                version=LEDGER_VERSION,
                world_size=size,
                created_at=now,
                updated_at=now,
                input_fingerprint=input_fingerprint,
                model_config_hash=model_config_hash,
                shards={
                    str(rank): ShardEntry(status="in_progress", original_rank=rank, assigned_rank=rank)
                    for rank in range(size)
                },
            )
            self._write(state, previous.raw if previous else None, previous.source if previous else None)
            self.world_size = size
            logger.info("initialized progress ledger %s with %d shards", self.path, size)
            return dict(msgspec.to_builtins(state))

    @staticmethod
    def _differences(
        state: LedgerState, world_size: int | None, input_fingerprint: str, model_config_hash: str
    ) -> list[tuple[str, str, str]]:
        differences: list[tuple[str, str, str]] = []
        if world_size is not None and state.world_size != world_size:
            differences.append(("world_size", str(state.world_size), str(world_size)))
        if input_fingerprint and state.input_fingerprint and state.input_fingerprint != input_fingerprint:
            differences.append(("input_fingerprint", state.input_fingerprint, input_fingerprint))
        if model_config_hash and state.model_config_hash and state.model_config_hash != model_config_hash:
            differences.append(("model_config_hash", state.model_config_hash, model_config_hash))
        return differences

    def _mismatch(self, differences: list[tuple[str, str, str]]) -> LedgerMismatchError:
        lines = "\n".join(f"  {field}: recorded {old!r}, now {new!r}" for field, old, new in differences)
        return LedgerMismatchError(
            f"this run differs from the one recorded in {self.path}:\n{lines}\n"
            "resuming would mix results of different inputs or models; use a new ledger path, or "
            "initialize(..., overwrite=True) to start over",
            differences,
        )

    def set_global_metadata(self, input_fingerprint: str, model_config_hash: str) -> None:
        """Record the run's input fingerprint and model config hash (replacing earlier values)."""
        for name, value in (("input_fingerprint", input_fingerprint), ("model_config_hash", model_config_hash)):
            if not isinstance(value, str):
                raise UnsupportedValueError(f"{name} must be a str, got {type(value).__name__}")

        def change(state: LedgerState) -> None:
            state.input_fingerprint = input_fingerprint
            state.model_config_hash = model_config_hash

        self._mutate(change)

    def validate_run_compatibility(self, input_fingerprint: str, model_config_hash: str) -> tuple[bool, list[str]]:
        """``(compatible, messages)``: one readable message per field that differs from the
        recorded run. Fields the ledger does not record yet are not compared."""
        differences = self._differences(self.read(), None, input_fingerprint, model_config_hash)
        hints = {
            "input_fingerprint": "the input files may have changed",
            "model_config_hash": "the model weights or config may have changed",
        }
        messages = [
            f"{field} mismatch: recorded {old!r}, current {new!r} ({hints[field]})" for field, old, new in differences
        ]
        return not messages, messages

    def check_run_compatibility(self, input_fingerprint: str, model_config_hash: str) -> None:
        """Raise :class:`~shardkeep.errors.LedgerMismatchError` (with a field-by-field diff) if
        this run differs from the recorded one."""
        differences = self._differences(self.read(), None, input_fingerprint, model_config_hash)
        if differences:
            raise self._mismatch(differences)

    # ----------------------------------------------------------------------------------------
    # Shard updates

    def _shard(self, state: LedgerState, rank: int) -> ShardEntry:
        _check_index("shard", rank)
        entry = state.shards.get(str(rank))
        if entry is None:
            raise LedgerStateError(
                f"unknown shard {rank}: ledger {self.path} has shards 0..{state.world_size - 1}", rank
            )
        return entry

    @staticmethod
    def _fence(entry: ShardEntry, rank: int, worker: int | None, claim: int | None) -> None:
        if worker is not None and entry.assigned_rank != worker:
            raise LedgerStateError(
                f"shard {rank} is assigned to worker {entry.assigned_rank}, not worker {worker}: it was reassigned, "
                f"so worker {worker}'s update is refused",
                rank,
            )
        if claim is not None and entry.claim != claim:
            raise LedgerStateError(
                f"shard {rank} was claimed again (claim {entry.claim}) after claim {claim}: the process holding "
                f"claim {claim} was replaced, so its update is refused",
                rank,
            )

    def resolve_file(self, checkpoint_file: str | os.PathLike[str]) -> tuple[str, Path]:
        """``(recorded name, absolute path)`` of a batch file given relative to the checkpoint
        directory or as an absolute path inside it. Raises ``UnsafePathError`` for anything that
        is, or through a symlink resolves to, a place outside it."""
        try:
            text = os.fspath(checkpoint_file)
        except TypeError as exc:
            raise UnsupportedValueError(
                f"checkpoint_file must be a str or path, got {type(checkpoint_file).__name__}"
            ) from exc
        if not isinstance(text, str) or not text or "\x00" in text:
            raise UnsafePathError(f"invalid checkpoint file name {checkpoint_file!r}")
        relative = os.path.relpath(os.path.normpath(text), self.checkpoint_dir) if os.path.isabs(text) else text
        parts = PurePosixPath(relative.replace(os.sep, "/")).parts
        outside = UnsafePathError(
            f"checkpoint file {text!r} is outside the checkpoint directory {self.checkpoint_dir}; "
            "record files inside it (pass checkpoint_dir= to change it)"
        )
        if not parts or ".." in parts or parts[0] == "/" or "\\" in relative:
            raise outside
        name = "/".join(part for part in parts if part != ".")
        absolute = self.checkpoint_dir / name
        root = os.path.realpath(self.checkpoint_dir)
        if os.path.commonpath([root, os.path.realpath(absolute.parent)]) != root:
            raise outside  # a symlinked directory leads out of the checkpoint directory
        return name, absolute

    @staticmethod
    def _is_durable(path: Path) -> bool:
        try:
            if path.is_symlink():
                return False
            if path.is_dir():
                return (path / MANIFEST_FILENAME).is_file()
            return path.is_file()
        except OSError as exc:
            raise StorageError(f"cannot check batch file {path}: {exc}") from exc

    def update_shard_checkpoint(
        self,
        rank: int,
        batch_idx: int,
        num_sequences: int,
        checkpoint_file: str | os.PathLike[str],
        sequence_range: str | None = None,
        *,
        worker: int | None = None,
        claim: int | None = None,
    ) -> None:
        """Record that shard ``rank`` finished batch ``batch_idx`` with ``num_sequences`` sequences,
        stored in ``checkpoint_file`` (relative to the checkpoint directory, or absolute inside it;
        a file, or a committed shardkeep checkpoint directory).

        Refused, with nothing recorded, when: the file does not exist
        (:class:`~shardkeep.errors.BatchFileMissingError`); the shard is complete, ``batch_idx`` is
        not above the last recorded batch, ``worker`` is given and the shard is assigned to another worker, or ``claim`` is given and the shard
        was claimed again since (:class:`~shardkeep.errors.LedgerStateError`). Recording the same
        batch and file again is a no-op, so a retried call is safe. A failed shard that records a batch is in
        progress again. ``sequence_range`` is kept for diagnostics only.
        """
        _check_index("batch_idx", batch_idx)
        _check_index("num_sequences", num_sequences)
        if sequence_range is not None and not isinstance(sequence_range, str):
            raise UnsupportedValueError(f"sequence_range must be a str or None, got {type(sequence_range).__name__}")
        name, absolute = self.resolve_file(checkpoint_file)
        if not self._is_durable(absolute):
            raise BatchFileMissingError(
                f"cannot record batch {batch_idx} of shard {rank}: {absolute} does not exist, or is a symlink or a "
                "directory without a committed manifest.json; write it (and let the write finish) before recording it"
            )

        def change(state: LedgerState) -> None:
            entry = self._shard(state, rank)
            self._fence(entry, rank, worker, claim)
            last = entry.checkpoints[-1] if entry.checkpoints else None
            if last is not None and last.batch_idx == batch_idx and last.file == name:
                raise _AlreadyRecorded
            self._check_progress(entry, rank, batch_idx)
            now = timestamp_now(self.clock)
            entry.checkpoints.append(
                BatchRecord(
                    batch_idx=batch_idx,
                    num_sequences=num_sequences,
                    file=name,
                    timestamp=now,
                    sequence_range=sequence_range,
                )
            )
            entry.last_checkpoint_batch = batch_idx
            entry.total_sequences += num_sequences
            entry.last_checkpoint_time = now
            entry.status = "in_progress"

        with contextlib.suppress(_AlreadyRecorded):
            self._mutate(change)

    @staticmethod
    def _check_progress(entry: ShardEntry, rank: int, batch_idx: int) -> None:
        if entry.status == "complete":
            raise LedgerStateError(f"shard {rank} is complete; batch {batch_idx} cannot be recorded", rank)
        if batch_idx <= entry.last_checkpoint_batch:
            raise LedgerStateError(
                f"shard {rank} already recorded batch {entry.last_checkpoint_batch}; batch {batch_idx} is done "
                f"(resume from batch {entry.last_checkpoint_batch + 1})",
                rank,
            )

    def check_batch(self, rank: int, batch_idx: int, *, worker: int | None = None, claim: int | None = None) -> None:
        """Raise the :class:`~shardkeep.errors.LedgerStateError` that recording batch
        ``batch_idx`` of shard ``rank`` would raise now (unknown or finished shard, batch already
        done, another worker or claim), without changing anything. For checking before the
        batch's result is written."""
        _check_index("batch_idx", batch_idx)
        entry = self._shard(self.read(), rank)
        self._fence(entry, rank, worker, claim)
        self._check_progress(entry, rank, batch_idx)

    def claim_shard(self, rank: int, worker: int) -> int:
        """Called by a worker when it starts (or restarts) processing shard ``rank``: checks that
        the shard is assigned to ``worker`` and unfinished, marks it in progress, counts the shard
        as active now (for staleness), and returns a new claim number. Pass it as ``claim=`` to
        later updates: once the shard is claimed again (a restarted worker) or reassigned, updates
        from the old claim are refused, even from a process with the same rank."""
        _check_index("worker", worker)

        def change(state: LedgerState) -> int:
            entry = self._shard(state, rank)
            self._fence(entry, rank, worker, None)
            if entry.status == "complete":
                raise LedgerStateError(f"shard {rank} is complete; there is nothing to claim", rank)
            entry.claim += 1
            entry.claimed_at = timestamp_now(self.clock)
            entry.status = "in_progress"
            return entry.claim

        claim: int = self._mutate(change)
        return claim

    def mark_shard_complete(self, rank: int, *, worker: int | None = None, claim: int | None = None) -> None:
        """Mark shard ``rank`` complete (a no-op if it already is)."""

        def change(state: LedgerState) -> None:
            entry = self._shard(state, rank)
            self._fence(entry, rank, worker, claim)
            if entry.status == "complete":
                raise _AlreadyRecorded
            entry.status = "complete"
            entry.completed_at = timestamp_now(self.clock)

        with contextlib.suppress(_AlreadyRecorded):
            self._mutate(change)
        logger.info("progress ledger %s: shard %d complete", self.path, rank)

    def mark_shard_failed(self, rank: int, error: str, *, worker: int | None = None, claim: int | None = None) -> None:
        """Mark shard ``rank`` failed with ``error`` and count a retry. Its recorded batches stay;
        after ``max_retries`` failures the shard is orphaned. A complete shard cannot fail."""
        if not isinstance(error, str):
            raise UnsupportedValueError(f"error must be a str, got {type(error).__name__}")

        def change(state: LedgerState) -> None:
            entry = self._shard(state, rank)
            self._fence(entry, rank, worker, claim)
            if entry.status == "complete":
                raise LedgerStateError(f"shard {rank} is complete; it cannot be marked failed", rank)
            entry.status = "failed"
            entry.error = error
            entry.failed_at = timestamp_now(self.clock)
            entry.retry_count += 1

        self._mutate(change)
        logger.warning("progress ledger %s: shard %d failed: %s", self.path, rank, error)

    # ----------------------------------------------------------------------------------------
    # Queries

    def shard_status(self, rank: int) -> dict[str, Any] | None:
        """Shard ``rank``'s entry as a dict, or ``None`` if there is no such shard."""
        entry = self.read().shards.get(str(rank))
        return None if entry is None else dict(msgspec.to_builtins(entry))

    def incomplete_shards(self) -> list[int]:
        """Shards that are in progress or failed, in order (the shards to resume)."""
        return sorted(int(key) for key, entry in self.read().shards.items() if entry.status != "complete")

    def completed_shards(self) -> list[int]:
        """Shards that are complete, in order."""
        return sorted(int(key) for key, entry in self.read().shards.items() if entry.status == "complete")

    def assigned_shards(self, worker: int) -> list[int]:
        """Unfinished shards currently assigned to ``worker`` (its own, plus any reassigned to it)."""
        return sorted(
            int(key)
            for key, entry in self.read().shards.items()
            if entry.assigned_rank == worker and entry.status != "complete"
        )

    def resume_info(self, rank: int) -> dict[str, Any]:
        """Where shard ``rank`` resumes: ``resume_from_batch`` (the batch after the last recorded
        one), ``last_completed_batch``, ``last_checkpoint_file``, ``total_sequences_completed``,
        ``status``, ``original_rank``, ``assigned_rank``, ``retry_count``, ``last_checkpoint_time``
        and ``stale``. An unknown shard gives ``{"rank": rank, "status": "unknown"}``."""
        state = self.read()
        entry = state.shards.get(str(rank))
        if entry is None:
            return {"rank": rank, "status": "unknown"}
        last_file = entry.checkpoints[-1].file if entry.checkpoints else None
        return {
            "rank": rank,
            "resume_from_batch": entry.last_checkpoint_batch + 1,
            "last_completed_batch": entry.last_checkpoint_batch,
            "last_checkpoint_file": last_file,
            "total_sequences_completed": entry.total_sequences,
            "status": entry.status,
            "original_rank": entry.original_rank,
            "assigned_rank": entry.assigned_rank,
            "retry_count": entry.retry_count,
            "last_checkpoint_time": _iso(entry.last_checkpoint_time),
            "claim": entry.claim,
            "stale": self._stale(entry, self.clock(), self.staleness_threshold_sec),
        }

    def resume_points(self) -> dict[int, int]:
        """For every unfinished shard, the batch to restart from."""
        return {
            int(key): entry.last_checkpoint_batch + 1
            for key, entry in sorted(self.read().shards.items(), key=lambda item: int(item[0]))
            if entry.status != "complete"
        }

    @staticmethod
    def last_activity(entry: ShardEntry) -> float | None:
        """Seconds since the epoch of the shard's last recorded batch, claim or reassignment."""
        times = [entry.last_checkpoint_time.timestamp()] if entry.last_checkpoint_time else []
        if entry.reassignments:
            times.append(entry.reassignments[-1].timestamp.timestamp())
        if entry.claimed_at is not None:
            times.append(entry.claimed_at.timestamp())
        return max(times) if times else None

    @classmethod
    def _stale(cls, entry: ShardEntry, now: float, threshold: float) -> bool:
        if entry.status != "in_progress":
            return False
        activity = cls.last_activity(entry)
        return activity is not None and now - activity > threshold

    def is_shard_stale(self, rank: int, threshold_sec: float | None = None) -> bool:
        """Whether shard ``rank`` is in progress and has shown no activity (a recorded batch, a
        claim by its worker, a reassignment) for more than ``threshold_sec`` (default: the
        ledger's threshold). A shard with no activity at all yet is not stale: no worker has
        started it. A worker that claims its shard (:meth:`claim_shard`) and then hangs before its
        first batch becomes stale; so does a resumed shard whose worker does not claim it."""
        entry = self.read().shards.get(str(rank))
        if entry is None:
            return False
        threshold = self.staleness_threshold_sec if threshold_sec is None else float(threshold_sec)
        return self._stale(entry, self.clock(), threshold)

    def orphaned_shards(self) -> list[int]:
        """Failed shards with at least ``max_retries`` failures: candidates for reassignment."""
        return self._orphaned(self.read())

    def _orphaned(self, state: LedgerState) -> list[int]:
        return sorted(
            int(key)
            for key, entry in state.shards.items()
            if entry.status == "failed" and entry.retry_count >= self.max_retries
        )

    def progress(self) -> dict[str, Any]:
        """Counts over all shards: ``total_shards``, ``completed``, ``in_progress``, ``failed``,
        ``stale`` and ``stale_shards``, ``orphaned`` and ``orphaned_shards``,
        ``total_sequences_checkpointed``, ``total_batches``, the run's ``input_fingerprint`` and
        ``model_config_hash``, and the ledger's ``sequence``."""
        return self.progress_of(self.read())

    def progress_of(self, state: LedgerState) -> dict[str, Any]:
        """:meth:`progress` of a version already read (one consistent snapshot)."""
        now = self.clock()
        statuses = [entry.status for entry in state.shards.values()]
        stale = sorted(
            int(key) for key, entry in state.shards.items() if self._stale(entry, now, self.staleness_threshold_sec)
        )
        orphaned = self._orphaned(state)
        return {
            "total_shards": state.world_size,
            "completed": statuses.count("complete"),
            "in_progress": statuses.count("in_progress"),
            "failed": statuses.count("failed"),
            "stale": len(stale),
            "stale_shards": stale,
            "orphaned": len(orphaned),
            "orphaned_shards": orphaned,
            "total_sequences_checkpointed": sum(entry.total_sequences for entry in state.shards.values()),
            "total_batches": sum(len(entry.checkpoints) for entry in state.shards.values()),
            "input_fingerprint": state.input_fingerprint,
            "model_config_hash": state.model_config_hash,
            "sequence": state.sequence,
        }

    # ----------------------------------------------------------------------------------------
    # Redistribution

    def reassign_shard(self, shard_rank: int, new_assigned_rank: int) -> None:
        """Give shard ``shard_rank`` to worker ``new_assigned_rank``. ``original_rank`` never
        changes; the move is kept in the shard's ``reassignments``. A failed shard becomes in
        progress again (its retry count is kept); a complete shard cannot be reassigned. Updates
        from the previous worker that pass ``worker=`` are refused from now on."""
        _check_index("new_assigned_rank", new_assigned_rank)

        def change(state: LedgerState) -> None:
            entry = self._shard(state, shard_rank)
            if new_assigned_rank >= state.world_size:
                raise LedgerStateError(
                    f"cannot reassign shard {shard_rank} to worker {new_assigned_rank}: workers are "
                    f"0..{state.world_size - 1}",
                    shard_rank,
                )
            if entry.status == "complete":
                raise LedgerStateError(f"shard {shard_rank} is complete; there is nothing to reassign", shard_rank)
            if entry.assigned_rank == new_assigned_rank and entry.status != "failed":
                raise _AlreadyRecorded
            entry.reassignments.append(
                Reassignment(
                    from_rank=entry.assigned_rank, to_rank=new_assigned_rank, timestamp=timestamp_now(self.clock)
                )
            )
            entry.assigned_rank = new_assigned_rank
            entry.claim += 1  # the previous worker's claim is void
            entry.status = "in_progress"

        with contextlib.suppress(_AlreadyRecorded):
            self._mutate(change)
        logger.info("progress ledger %s: shard %d assigned to worker %d", self.path, shard_rank, new_assigned_rank)

    # ----------------------------------------------------------------------------------------
    # Global barriers

    def record_global_checkpoint(self, checkpoint_id: str, batch_boundaries: Mapping[int, int]) -> None:
        """Record a barrier named ``checkpoint_id``: for each shard, the batch it had reached. A
        shard cannot be claimed past its last recorded batch, and ids are unique."""
        if not isinstance(checkpoint_id, str) or not checkpoint_id:
            raise UnsupportedValueError(f"checkpoint_id must be a non-empty str, got {checkpoint_id!r}")
        boundaries = {
            int(_check_index("shard", rank)): _check_index("batch", batch) for rank, batch in batch_boundaries.items()
        }

        def change(state: LedgerState) -> None:
            if any(existing.checkpoint_id == checkpoint_id for existing in state.global_checkpoints):
                raise LedgerStateError(f"global checkpoint {checkpoint_id!r} is already recorded")
            for rank, batch in boundaries.items():
                entry = self._shard(state, rank)
                if batch > entry.last_checkpoint_batch:
                    raise LedgerStateError(
                        f"global checkpoint {checkpoint_id!r} claims batch {batch} of shard {rank}, which has only "
                        f"recorded up to batch {entry.last_checkpoint_batch}",
                        rank,
                    )
            state.global_checkpoints.append(
                GlobalCheckpoint(
                    checkpoint_id=checkpoint_id,
                    timestamp=timestamp_now(self.clock),
                    batch_boundaries={str(rank): batch for rank, batch in sorted(boundaries.items())},
                )
            )

        self._mutate(change)

    def latest_global_checkpoint(self) -> dict[str, Any] | None:
        """The most recent barrier as a dict, or ``None``."""
        checkpoints = self.read().global_checkpoints
        return dict(msgspec.to_builtins(checkpoints[-1])) if checkpoints else None

    # ----------------------------------------------------------------------------------------
    # After completion

    def archive(self, archive_dir: str | os.PathLike[str]) -> Path:
        """Copy the final ledger to ``archive_dir/<name>_final.json`` (durably) and return that
        path. Every shard must be complete. The copy is itself a valid ledger file."""
        with self._locked():
            state, raw, _ = self._load()
            require_complete(state, "archive the ledger")
            target = write_archive(raw, self.path, Path(archive_dir), localfs.current())
        logger.info("progress ledger %s archived to %s", self.path, target)
        return target

    def cleanup_checkpoints(
        self, keep_final_only: bool = True, *, force: bool = False, lease: float = DEFAULT_LEFTOVER_LEASE
    ) -> int:
        """Delete recorded batch files to reclaim space, and return how many were deleted.

        With ``keep_final_only`` the last batch of each shard is kept. Every shard must be
        complete unless ``force=True`` (then a shard's last batch is always kept, so it can still
        resume). First the ledger durably marks the batches it will delete (``removed_at``), then
        the files go, so a crash or error never leaves the ledger naming a deleted file as
        present; calling again finishes an interrupted cleanup. A shardkeep checkpoint directory
        is renamed to ``*.deleting-<id>`` before removal. Symlinks are removed, never followed.

        When every shard is complete (and not ``force``), leftovers next to the batch files that
        no record names are removed too, once untouched for ``lease`` seconds (default one hour):
        interrupted saves (``*.tmp-*``, ``*.deleting-*``) and batch checkpoints that were saved but
        never recorded (``batch_<N>-<id>``, see :func:`shardkeep.save_batch`).
        """

        def mark(state: LedgerState) -> None:
            mark_removals(state, keep_final_only=keep_final_only, force=force, now=timestamp_now(self.clock))

        self._mutate(mark)
        with self._locked():
            removed = remove_marked(self._load().state, self.resolve_file, localfs.current(), force=force, lease=lease)
        logger.info("progress ledger %s: removed %d batch files", self.path, removed)
        return removed

    # ----------------------------------------------------------------------------------------
    # The names of the original progress-manifest design, kept as aliases

    archive_manifest = archive
    get_shard_status = shard_status
    get_incomplete_shard_ranks = incomplete_shards
    get_resumable_shards = incomplete_shards
    get_completed_shards = completed_shards
    get_assigned_shards = assigned_shards
    get_resume_info = resume_info
    get_resume_points = resume_points
    get_orphaned_shards = orphaned_shards
    get_global_progress = progress
    get_latest_global_checkpoint = latest_global_checkpoint
