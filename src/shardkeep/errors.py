"""The exception tree: every error shardkeep raises derives from :class:`ShardkeepError`.

::

    ShardkeepError
    ├── ManifestError            malformed, invalid or oversized manifest
    │   └── ManifestVersionError a manifest from a newer major format version
    ├── IntegrityError           sizes, digests, headers or the file set disagree with the manifest
    │   └── SignatureError       manifest.sig is missing (when required), malformed, by another key or invalid
    ├── CheckpointNotFoundError  no committed checkpoint (or file) where one was expected
    ├── CheckpointExistsError    saving onto a checkpoint that is already committed
    ├── UnsafePathError          a path that escapes the checkpoint or is not a regular file
    ├── UnsupportedValueError    a state leaf, dtype or option value shardkeep cannot store
    │   ├── StateMismatchError   a loaded value does not fit its target in into= (shape, dtype,
    │   │                        keys, kind of object, optimizer kind or parameter groups)
    │   └── ConfigError          a checkpoint-manager configuration that is invalid
    │       ├── TierBudgetError  a tensor does not fit its tier's budget and may not spill
    │       └── UnknownOptionError a keyword no save option has (also a TypeError)
    ├── CheckpointFieldError     a TrainingCheckpoint field that is missing or has a wrong type
    ├── RunMismatchError         a manager asked to write into a root another run owns
    ├── FingerprintMismatchError restoring a checkpoint whose model args or config differ
    ├── RetentionError           the save committed, but pruning old checkpoints failed
    ├── StorageError             an I/O operation failed (write, fsync, rename, read ...)
    ├── SaveInProgressError      async_save(wait=False) while another save is still in flight
    ├── CoordinationError        one or more ranks failed a collective step
    ├── DependencyError          a package a feature needs (torch ...) is not installed (an ImportError)
    └── LedgerError              a progress-ledger operation failed
        ├── ManifestCorruptedError     no copy of the ledger (primary, .tmp, .backup) is valid
        ├── LedgerNotFoundError        the ledger was never initialized (also a FileNotFoundError)
        ├── LedgerMismatchError        input fingerprint, model hash or world size differ from the run's
        ├── LedgerStateError           a change the ledger refuses: unknown shard, finished shard,
        │                              a batch recorded twice, a worker the shard is not assigned to
        ├── BatchFileMissingError      recording a batch whose file does not exist (a FileNotFoundError)
        └── LedgerLockTimeoutError     the ledger's lock was not acquired in time (a TimeoutError)

Third-party errors (``OSError``, ``msgspec.DecodeError`` ...) are mapped at the boundary and
chained with ``raise ... from``, so the original cause is always in ``__cause__``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CheckpointExistsError",
    "CheckpointFieldError",
    "CheckpointNotFoundError",
    "ConfigError",
    "CoordinationError",
    "DependencyError",
    "FingerprintMismatchError",
    "BatchFileMissingError",
    "IntegrityError",
    "LedgerError",
    "LedgerLockTimeoutError",
    "LedgerMismatchError",
    "LedgerNotFoundError",
    "LedgerStateError",
    "ManifestCorruptedError",
    "ManifestError",
    "ManifestVersionError",
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
    "import_needing_torch",
    "same_error",
]


class ShardkeepError(Exception):
    """Root of every error shardkeep raises."""


class ManifestError(ShardkeepError):
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


class IntegrityError(ShardkeepError):
    """Data on storage does not match what the manifest records."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems: list[str] = list(problems) if problems else [message]


class SignatureError(IntegrityError):
    """The manifest's signature is required but absent, malformed, made with another key, or
    does not match the manifest's bytes. (An unusable key file is a :class:`ConfigError`.)"""


class CheckpointNotFoundError(ShardkeepError):
    """No committed checkpoint, or no file, exists at the given location."""


class CheckpointExistsError(ShardkeepError):
    """A committed checkpoint already exists at the destination; it is never overwritten."""


class UnsafePathError(ShardkeepError):
    """A path is absolute, climbs out with ``..``, or names a symlink or special file."""


class UnsupportedValueError(ShardkeepError):
    """A value (state leaf, dtype, option) cannot be stored; the message names its key."""


class StateMismatchError(UnsupportedValueError):
    """``load(..., into=...)`` found a value that does not fit its target: a shape or dtype
    that differs, keys one side lacks, another kind of object, another optimizer kind or other
    parameter groups. The message names the key and both sides; nothing in ``into`` changed.
    (An :class:`UnsupportedValueError`, so code that catches that keeps working.)"""


class StorageError(ShardkeepError):
    """A storage operation (write, fsync, close, rename, read, delete) failed."""


class SaveInProgressError(ShardkeepError):
    """``async_save(..., wait=False)`` was called while this process's previous save runs."""


class CoordinationError(ShardkeepError):
    """One or more ranks failed a collective step; raised on every rank.

    ``failures`` maps each failed rank to a one-line summary of its error.
    """

    def __init__(self, message: str, failures: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures: dict[int, str] = dict(failures) if failures else {}


class ConfigError(UnsupportedValueError):
    """A checkpoint-manager configuration is invalid; the message names the key and value."""


class TierBudgetError(ConfigError):
    """A tensor does not fit in its tier's size budget, and the policy does not let it spill."""


class UnknownOptionError(ConfigError, TypeError):
    """A call got a keyword argument that is neither one of its options nor an old spelling of
    one; a :class:`TypeError` too, as Python raises for an unexpected keyword."""


class CheckpointFieldError(ShardkeepError):
    """A :class:`~shardkeep.training.TrainingCheckpoint` field is missing or has the wrong type.

    ``field`` names it (``"iteration"``, ``"model_args"`` ...).
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"TrainingCheckpoint field {field!r}: {message}")
        self.field = field


class RunMismatchError(ShardkeepError):
    """A checkpoint manager was asked to write into a root whose checkpoints belong to another
    run. ``owner`` is that run's id."""

    def __init__(self, message: str, owner: str | None = None) -> None:
        super().__init__(message)
        self.owner = owner


class FingerprintMismatchError(ShardkeepError):
    """The model args or config recorded in a checkpoint differ from the caller's.

    ``differences`` lists one ``(field, checkpoint value, current value)`` per changed field;
    a missing side is ``"<absent>"``.
    """

    def __init__(self, message: str, differences: list[tuple[str, str, str]]) -> None:
        super().__init__(message)
        self.differences = list(differences)


class RetentionError(ShardkeepError):
    """A checkpoint committed, but deleting old checkpoints or updating pointers failed.

    The new checkpoint is safe and usable; ``checkpoint`` names it. Nothing is deleted unless it
    was first un-committed (renamed), so a failure here never leaves a half-valid checkpoint.
    """

    def __init__(self, message: str, checkpoint: str | None = None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint


class LedgerError(ShardkeepError):
    """A :class:`~shardkeep.ledger.ProgressLedger` operation failed; the ledger is unchanged."""


class ManifestCorruptedError(LedgerError):
    """No copy of the progress ledger is valid: the primary, ``.tmp`` and ``.backup`` files are all
    missing, torn or fail their checksum.

    ``manifest_path`` is the ledger's primary path; ``problems`` maps each copy to what is wrong.
    """

    def __init__(self, message: str, manifest_path: str, problems: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.manifest_path = manifest_path
        self.problems: dict[str, str] = dict(problems) if problems else {}


class LedgerNotFoundError(LedgerError, FileNotFoundError):
    """The ledger file does not exist: call ``initialize()`` first."""


class LedgerMismatchError(LedgerError):
    """The caller's run (input fingerprint, model config hash, world size) differs from the one the
    ledger records. ``differences`` lists ``(field, recorded, current)`` for each field."""

    def __init__(self, message: str, differences: list[tuple[str, str, str]]) -> None:
        super().__init__(message)
        self.differences = list(differences)


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


class DependencyError(ShardkeepError, ImportError):
    """A feature needs a package that is not installed (``torch`` for saving and loading
    tensors); the message says what to install."""


def same_error(type_name: str, message: str, details: dict[str, object] | None = None) -> ShardkeepError:
    """An error of the :class:`ShardkeepError` subclass named ``type_name`` carrying ``message``,
    so that a rank can re-raise, with its type, an error that another rank reported by name;
    ``details`` are its plain attributes (``owner``, ``checkpoint`` ...), set on the result.

    A class whose constructor needs more than a message is replaced by its nearest base class
    that takes only one; an unknown name gives a plain :class:`ShardkeepError`."""
    found: type[ShardkeepError] = ShardkeepError
    pending: list[type[ShardkeepError]] = [ShardkeepError]
    while pending:
        klass = pending.pop()
        if klass.__name__ == type_name:
            found = klass
            break
        pending.extend(klass.__subclasses__())
    error = ShardkeepError(message)
    for klass in found.__mro__:
        if isinstance(klass, type) and issubclass(klass, ShardkeepError):
            try:
                error = klass(message)
            except TypeError:
                continue
            break
    for name, value in (details or {}).items():
        setattr(error, name, value)
    return error


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
