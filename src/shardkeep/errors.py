"""The exception tree: every error shardkeep raises derives from :class:`ShardkeepError`.

The tree is grouped by what a caller can do about an error, the way httpx groups its
exceptions: a usage error is fixed by changing the call, a checkpoint-data error means the bytes
on storage are bad, a manager error concerns a managed root, and a ledger error the batch ledger.
A class drawn under two parents derives from both, so every ``except`` that caught it still does.

::

    ShardkeepError
    ├── UsageError                   a call shardkeep refuses: fix the call, not the data
    │   ├── UnsupportedValueError    a state leaf, dtype or option value shardkeep cannot store
    │   │   ├── StateMismatchError   a loaded value does not fit its target in into= (shape, dtype,
    │   │   │                        keys, kind of object, optimizer kind or parameter groups)
    │   │   ├── ConfigError          an option value that is invalid (manager, tiers, signing, hf ...)
    │   │   │   ├── TierBudgetError  a tensor does not fit its tier's budget and may not spill
    │   │   │   │                    (also a PlacementError)
    │   │   │   ├── UnknownOptionError a keyword no option has, nor an old spelling of one
    │   │   │   │                    (also a TypeError)
    │   │   │   ├── LevelConfigError levels that cannot work as configured (two on one root,
    │   │   │   │                    a cadence that cannot be met); names the level
    │   │   │   └── PreemptionHandlerError a preemption handler that cannot be installed (twice,
    │   │   │                        off the main thread, a signal that cannot be caught)
    │   │   └── CommitRefusedError   the written files do not cover the state (coverage or bytes
    │   │                            mismatch), so the checkpoint is not committed
    │   ├── CheckpointFieldError     a TrainingCheckpoint field that is missing or has a wrong type
    │   └── SaveInProgressError      async_save(wait=False) while another save is still in flight
    ├── CheckpointDataError          what is on storage is not a checkpoint shardkeep can trust
    │   ├── ManifestError            malformed, invalid or oversized manifest
    │   │   └── ManifestVersionError a manifest from a newer major format version
    │   ├── IntegrityError           sizes, digests, headers or the file set disagree with the manifest
    │   │   └── SignatureError       manifest.sig is missing (when required), malformed, by another key or invalid
    │   └── UnsafePathError          a path that escapes the checkpoint or is not a regular file
    ├── CheckpointNotFoundError      no committed checkpoint (or file) where one was expected
    │   └── NoCompleteStepError      no step can be completed from any level's verified copies
    ├── CheckpointExistsError        saving onto a checkpoint that is already committed
    ├── ManagerError                 a CheckpointManager refuses or half-completes an operation
    │   ├── RunMismatchError         a manager asked to write into a root another run owns
    │   ├── FingerprintMismatchError restoring a checkpoint whose model args or config differ
    │   └── RetentionError           the save committed, but pruning old checkpoints failed
    ├── PlacementError               tensors cannot be placed on the storage tiers as asked
    │   └── TierBudgetError          (also a ConfigError, above)
    ├── StorageError                 an I/O operation failed (write, fsync, rename, read ...)
    │   ├── LevelUnreachableError    a level's root cannot be reached; names the level
    │   └── DrainError               copying a local step to a persistent level failed
    ├── CoordinationError            one or more ranks failed a collective step
    ├── DependencyError              a package a feature needs (torch ...) is not installed (an ImportError)
    └── LedgerError                  a progress-ledger operation failed
        ├── LedgerCorruptedError     no copy of the ledger (primary, .tmp, .backup) is valid
        │                            (also named ManifestCorruptedError)
        ├── LedgerNotFoundError      the ledger was never initialized (also a FileNotFoundError)
        ├── LedgerMismatchError      input fingerprint, model hash or world size differ from the run's
        ├── LedgerStateError         a change the ledger refuses: unknown shard, finished shard,
        │                            a batch recorded twice, a worker the shard is not assigned to
        ├── BatchFileMissingError    recording a batch whose file does not exist (a FileNotFoundError)
        └── LedgerLockTimeoutError   the ledger's lock was not acquired in time (a TimeoutError)

Third-party errors (``OSError``, ``msgspec.DecodeError`` ...) are mapped at the boundary and
chained with ``raise ... from``, so the original cause is always in ``__cause__``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Self

__all__ = [
    "BatchFileMissingError",
    "CheckpointDataError",
    "CheckpointExistsError",
    "CheckpointFieldError",
    "CheckpointNotFoundError",
    "CommitRefusedError",
    "ConfigError",
    "CoordinationError",
    "DependencyError",
    "DrainError",
    "FingerprintMismatchError",
    "IntegrityError",
    "LedgerCorruptedError",
    "LedgerError",
    "LedgerLockTimeoutError",
    "LedgerMismatchError",
    "LedgerNotFoundError",
    "LedgerStateError",
    "LevelConfigError",
    "LevelUnreachableError",
    "LevelWarning",
    "ManagerError",
    "ManifestCorruptedError",
    "ManifestError",
    "ManifestVersionError",
    "NoCompleteStepError",
    "PlacementError",
    "PreemptionHandlerError",
    "RetentionError",
    "RunMismatchError",
    "SaveInProgressError",
    "ShardkeepError",
    "SignatureError",
    "StateMismatchError",
    "StorageError",
    "TierBudgetError",
    "UnknownOptionError",
    "UnsafePathError",
    "UnsupportedValueError",
    "UsageError",
    "import_needing_torch",
    "same_error",
]


class ShardkeepError(Exception):
    """Root of every error shardkeep raises."""

    @classmethod
    def reported(cls, message: str, details: Mapping[str, object] | None = None) -> Self:
        """An error of this class as another rank reported it: ``message``, and ``details`` set
        as its plain attributes (``owner``, ``checkpoint`` ...). A class whose constructor does
        not take the message alone overrides this."""
        error = cls(message)
        error.__dict__.update(details or {})
        return error


# Usage errors: the call is refused; changing the call (its values, options or order) fixes it.


class UsageError(ShardkeepError):
    """shardkeep refuses the call as made: a value, an option or a call order it cannot accept.
    Nothing was written or changed."""


class UnsupportedValueError(UsageError):
    """A value (state leaf, dtype, option) cannot be stored; the message names its key."""


class StateMismatchError(UnsupportedValueError):
    """``load(..., into=...)`` found a value that does not fit its target: a shape or dtype
    that differs, keys one side lacks, another kind of object, another optimizer kind or other
    parameter groups. The message names the key and both sides; nothing in ``into`` changed.
    (An :class:`UnsupportedValueError`, so code that catches that keeps working.)"""


class ConfigError(UnsupportedValueError):
    """An option value is invalid: a manager setting, a tier or budget, a signing key, an
    integration's option ... The message names the option and the value.
    (An :class:`UnsupportedValueError`, so code that catches that keeps working.)"""


class LevelConfigError(ConfigError):
    """The levels of a ``MultiLevelManager`` cannot work as configured (two levels on one root,
    a cadence that cannot be met ...); the message names the level(s). Raised before anything
    is written."""


class PreemptionHandlerError(ConfigError):
    """A preemption handler cannot be installed as asked: a second handler for a signal one
    already handles, a call from a thread other than the main thread (Python runs signal
    handlers there only), or a signal that cannot be caught; the message names the signal and
    the thread."""


class LevelWarning(UserWarning):
    """A level is configured in a way that works but defeats its purpose (a node-local level on
    a network filesystem); the message names the level."""


class CommitRefusedError(UnsupportedValueError):
    """The files the ranks wrote do not cover the state the manifest describes (a chunk missing
    or overlapping, or another byte count than planned), so the checkpoint is not committed.
    (An :class:`UnsupportedValueError`, so code that catches that keeps working.)"""


class CheckpointFieldError(UsageError):
    """A :class:`~shardkeep.training.TrainingCheckpoint` field is missing or has the wrong type.

    ``field`` names it (``"iteration"``, ``"model_args"`` ...).
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"TrainingCheckpoint field {field!r}: {message}")
        self.field = field

    @classmethod
    def reported(cls, message: str, details: Mapping[str, object] | None = None) -> Self:
        """The error another rank reported, whose ``message`` already names the field."""
        error = cls.__new__(cls)
        Exception.__init__(error, message)
        error.field = ""
        error.__dict__.update(details or {})
        return error


class SaveInProgressError(UsageError):
    """``async_save(..., wait=False)`` was called while this process's previous save runs."""


# Checkpoint-data errors: what is on storage cannot be trusted as a checkpoint.


class CheckpointDataError(ShardkeepError):
    """What is on storage is not a checkpoint shardkeep can trust: its manifest, its data files or
    a path in it is bad. Retrying the same read fails the same way."""


class ManifestError(CheckpointDataError):
    """The manifest is malformed, violates the schema, or exceeds a parsing limit."""


class ManifestVersionError(ManifestError):
    """The manifest was written by a newer, incompatible major format version."""

    def __init__(self, found: str, supported: str) -> None:
        super().__init__(
            f"manifest metadata_version {found} is newer than this shardkeep supports "
            f"(major version of {supported}); upgrade shardkeep to read it"
        )
        self.found = found
        self.supported = supported

    @classmethod
    def reported(cls, message: str, details: Mapping[str, object] | None = None) -> Self:
        """The error another rank reported, whose ``message`` already names both versions."""
        error = cls.__new__(cls)
        Exception.__init__(error, message)
        error.found = error.supported = ""
        error.__dict__.update(details or {})
        return error


class IntegrityError(CheckpointDataError):
    """Data on storage does not match what the manifest records."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems: list[str] = list(problems) if problems else [message]


class SignatureError(IntegrityError):
    """The manifest's signature is required but absent, malformed, made with another key, or
    does not match the manifest's bytes. (An unusable key file is a :class:`ConfigError`.)"""


class UnsafePathError(CheckpointDataError):
    """A path is absolute, climbs out with ``..``, or names a symlink or special file."""


# Where a checkpoint is (or is not).


class CheckpointNotFoundError(ShardkeepError):
    """No committed checkpoint, or no file, exists at the given location."""


class NoCompleteStepError(CheckpointNotFoundError):
    """No step can be completed from any level's verified copies. The message says, per step,
    rank and level, why each copy was refused; ``refusals`` holds the same as
    ``(step, rank, level, reason)`` tuples."""

    def __init__(self, message: str, refusals: list[tuple[int, int, str, str]] | None = None) -> None:
        super().__init__(message)
        self.refusals = list(refusals or [])


class CheckpointExistsError(ShardkeepError):
    """A committed checkpoint already exists at the destination; it is never overwritten."""


# Manager errors: a CheckpointManager refuses an operation on its root, or completes it in part.


class ManagerError(ShardkeepError):
    """A :class:`~shardkeep.manager.CheckpointManager` refuses an operation on its root (another
    run's root, another model) or completes it only in part (the save, not the pruning)."""


class RunMismatchError(ManagerError):
    """A checkpoint manager was asked to write into a root whose checkpoints belong to another
    run. ``owner`` is that run's id."""

    def __init__(self, message: str, owner: str | None = None) -> None:
        super().__init__(message)
        self.owner = owner


class FingerprintMismatchError(ManagerError):
    """The model args or config recorded in a checkpoint differ from the caller's.

    ``differences`` lists one ``(field, checkpoint value, current value)`` per changed field;
    a missing side is ``"<absent>"``.
    """

    def __init__(self, message: str, differences: list[tuple[str, str, str]] | None = None) -> None:
        super().__init__(message)
        self.differences = list(differences or ())


class RetentionError(ManagerError):
    """A checkpoint committed, but deleting old checkpoints or updating pointers failed.

    The new checkpoint is safe and usable; ``checkpoint`` names it. Nothing is deleted unless it
    was first un-committed (renamed), so a failure here never leaves a half-valid checkpoint.
    """

    def __init__(self, message: str, checkpoint: str | None = None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint


# Placement errors: tensors cannot be put on the storage tiers as asked.


class PlacementError(ShardkeepError):
    """The tensors cannot be placed on the storage tiers as the tier plan asks."""


class TierBudgetError(ConfigError, PlacementError):
    """A tensor does not fit in its tier's size budget, and the policy does not let it spill.
    (A :class:`ConfigError` and so an :class:`UnsupportedValueError` too.)"""


class UnknownOptionError(ConfigError, TypeError):
    """A call got a keyword argument that is neither one of its options nor an old spelling of
    one; a :class:`TypeError` too, as Python raises for an unexpected keyword."""


# Errors of the machinery: storage I/O, the ranks, missing packages.


class StorageError(ShardkeepError):
    """A storage operation (write, fsync, close, rename, read, delete) failed."""


class LevelUnreachableError(StorageError):
    """A level's root cannot be reached (at start, or later for a ``required`` level); the
    message names the level and the reason."""


class DrainError(StorageError):
    """Copying a committed local checkpoint to a persistent level failed; the message names the
    step, the file, the node and the rank. Nothing was committed on the persistent level."""


class CoordinationError(ShardkeepError):
    """One or more ranks failed a collective step; raised on every rank.

    ``failures`` maps each failed rank to a one-line summary of its error.
    """

    def __init__(self, message: str, failures: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures: dict[int, str] = dict(failures) if failures else {}


class DependencyError(ShardkeepError, ImportError):
    """A feature needs a package that is not installed (``torch`` for saving and loading
    tensors); the message says what to install."""


# Ledger errors: the batch-job progress ledger.


class LedgerError(ShardkeepError):
    """A :class:`~shardkeep.ledger.ProgressLedger` operation failed; the ledger is unchanged."""


class LedgerCorruptedError(LedgerError):
    """No copy of the progress ledger is valid: the primary, ``.tmp`` and ``.backup`` files are all
    missing, torn or fail their checksum. Also named ``ManifestCorruptedError``.

    ``ledger_path`` (also ``manifest_path``) is the ledger's primary path; ``problems`` maps each
    copy to what is wrong.
    """

    def __init__(self, message: str, manifest_path: str = "", problems: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.ledger_path = self.manifest_path = manifest_path
        self.problems: dict[str, str] = dict(problems) if problems else {}


ManifestCorruptedError = LedgerCorruptedError


class LedgerNotFoundError(LedgerError, FileNotFoundError):
    """The ledger file does not exist: call ``initialize()`` first."""


class LedgerMismatchError(LedgerError):
    """The caller's run (input fingerprint, model config hash, world size) differs from the one the
    ledger records. ``differences`` lists ``(field, recorded, current)`` for each field."""

    def __init__(self, message: str, differences: list[tuple[str, str, str]] | None = None) -> None:
        super().__init__(message)
        self.differences = list(differences or ())


class LedgerStateError(LedgerError):
    """The ledger refuses a change: an unknown or finished shard, a batch at or below the last
    recorded one, or a worker that the shard is no longer assigned to. ``shard`` names the shard
    when there is one."""

    def __init__(self, message: str, shard: int | None = None) -> None:
        super().__init__(message)
        self.shard = shard


class BatchFileMissingError(LedgerError, FileNotFoundError):
    """A batch was to be recorded, but its checkpoint file (or committed checkpoint directory) does
    not exist, so the ledger would name data that is not durable. Nothing was recorded."""


class LedgerLockTimeoutError(LedgerError, TimeoutError):
    """The ledger's lock file stayed locked by another process for longer than ``lock_timeout``."""


def same_error(type_name: str, message: str, details: Mapping[str, object] | None = None) -> ShardkeepError:
    """An error of the :class:`ShardkeepError` subclass named ``type_name`` carrying ``message``,
    so that a rank can re-raise, with its type, an error that another rank reported by name;
    ``details`` are its plain attributes (``owner``, ``checkpoint`` ...), set on the result
    (see :meth:`ShardkeepError.reported`). An unknown name gives a plain :class:`ShardkeepError`."""
    found: type[ShardkeepError] = ShardkeepError
    pending: list[type[ShardkeepError]] = [ShardkeepError]
    while pending:
        klass = pending.pop()
        if klass.__name__ == type_name:
            found = klass
            break
        pending.extend(klass.__subclasses__())
    return found.reported(message, details)


def import_needing_torch(module_name: str, needed_by: str) -> Any:
    """Import the module ``module_name``, which needs torch (and numpy); where either is missing,
    a :class:`DependencyError` saying that ``needed_by`` needs it and how to install it (the CPU
    build of torch included). Any other import failure propagates as it is."""
    import importlib

    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if missing not in ("torch", "numpy"):
            raise
        raise DependencyError(
            f"{needed_by} needs {'PyTorch' if missing == 'torch' else 'NumPy'}, which is not installed: "
            f"pip install {missing}"
            + (
                " (for PyTorch without CUDA, use the CPU wheel: pip install torch --index-url "
                "https://download.pytorch.org/whl/cpu)"
                if missing == "torch"
                else ""
            )
        ) from exc
