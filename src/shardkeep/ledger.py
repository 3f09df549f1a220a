"""The progress ledger: one locked, checksummed JSON file with the per-shard progress of a
multi-worker batch job (docs/ledger.md). Imports without torch.

N worker processes each own a shard of the input and record every batch they finish. When a
worker crashes or hangs, the job resumes its shard from the last recorded batch, or hands the
shard to a healthy worker, without redoing finished work and without losing a recorded batch.

Files, next to each other::

    progress.json          the ledger (schema version 2.0)
    progress.json.backup   the previous version, kept before every replace
    progress.json.tmp      the next version while it is being written
    progress.json.lock     the lock file: locked with ``flock``, never renamed or removed by us

Every version carries an increasing ``sequence`` number and a self-checksum (blake3 over the
file's exact bytes with the checksum's hex digits zeroed). A read takes the valid copy with the
highest sequence number among the primary, ``.tmp`` and ``.backup``; it raises
:class:`~shardkeep.errors.ManifestCorruptedError` only when none is valid. Reads take no lock:
every file is either replaced whole by a rename or detected as torn by its checksum.

An update, under the exclusive lock:

1. read the current version (the highest valid copy);
2. keep it as ``.backup``: hard-link the primary as ``.tmp`` (or write the recovered bytes there
   and fsync them) and rename it over ``.backup``;
3. write the new version to a fresh ``.tmp`` (created exclusively, never truncated: a leftover
   ``.tmp`` may be a hard link to the primary) and fsync it;
4. rename ``.tmp`` over the primary and fsync the directory. Only then does the call return.

Crash windows: before step 4's rename, the primary still holds the old version (and ``.backup``
too), so the update is simply absent. After the rename, the new version is the primary. A valid
``.tmp`` left by a crash after its fsync has the highest sequence and is adopted: that update
completed everything except the rename. A torn ``.tmp`` fails its checksum and is ignored. The
lock is released by the kernel when a holder dies, even with kill -9.

``flock`` locks belong to the open file description, so two threads or processes opening the
lock file exclude each other, and closing another descriptor does not drop the lock (unlike
``lockf``). An update holds two locks: on the lock file and on the ledger's directory. Someone
else may delete the lock file while a writer holds it; the next writer would then create and
lock a new file and run alongside. The directory cannot be deleted while the ledger is in it, so
its lock still excludes. The lock file is opened without following a symlink and must be a
regular file; once locked, it must still be the file at the path, or it is locked afresh. On
NFS, Lustre and other network filesystems locks may not exclude across machines: the ledger
warns once with :class:`LedgerLockWarning` (and again where the directory cannot be locked).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import shutil
import stat
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

import msgspec

from shardkeep.errors import (
    BatchFileMissingError,
    LedgerError,
    LedgerLockTimeoutError,
    LedgerMismatchError,
    LedgerNotFoundError,
    LedgerStateError,
    ManifestCorruptedError,
    StorageError,
    UnsafePathError,
    UnsupportedValueError,
)
from shardkeep.integrity import digest_bytes, digests_equal, file_kind, read_regular_file
from shardkeep.manifest import DELETING_MARKER, MANIFEST_FILENAME, STAGING_MARKER
from shardkeep.names import check_name_length, sibling_name
from shardkeep.storage.local import fsync_directory_path

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

logger = logging.getLogger(__name__)

LEDGER_VERSION = "2.0"
DEFAULT_STALENESS_SEC = 600.0
MAX_ORPHANED_RETRIES = 3
DEFAULT_LOCK_TIMEOUT = 120.0
DEFAULT_MAX_BYTES = 512 * 1024 * 1024
DEFAULT_LEFTOVER_LEASE = 3600.0
# The name save_batch gives each attempt at a batch: batch_<index>-<attempt id>.
UNRECORDED_BATCH = re.compile(r"batch_\d{8,20}-[0-9a-f]{12}")
NETWORK_FILESYSTEMS = frozenset(
    {
        "nfs",
        "nfs4",
        "lustre",
        "cifs",
        "smb3",
        "smbfs",
        "9p",
        "ceph",
        "fuse.ceph",
        "fuse.sshfs",
        "gpfs",
        "beegfs",
        "glusterfs",
        "fuse.glusterfs",
        "afs",
        "ocfs2",
        "gfs2",
    }
)

Status = Literal["in_progress", "complete", "failed"]
Timestamp = Annotated[datetime, msgspec.Meta(tz=True)]
_CHECKSUM_ALGORITHM = "blake3"
_CHECKSUM_HEAD = re.compile(rb'\A\{\s*"checksum"\s*:\s*"blake3:([0-9a-f]{64})"\s*,\s*"sequence"\s*:\s*(\d{1,19})\s*,')
_PLACEHOLDER = "blake3:" + "0" * 64
# What flock(LOCK_EX) on a directory fails with where a filesystem cannot lock one (NFS: EBADF,
# since it locks only files open for writing).
_NO_DIRECTORY_LOCKS = frozenset({errno.EBADF, errno.EINVAL, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS})


class LedgerLockWarning(UserWarning):
    """The ledger lives on a network filesystem where file locks may not exclude other machines."""


class BatchRecord(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One recorded batch: its index, size, file (relative to the checkpoint directory) and time."""

    batch_idx: int
    num_sequences: int
    file: str
    timestamp: Timestamp
    sequence_range: str | None = None
    removed_at: Timestamp | None = None


class Reassignment(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A shard moved from one worker to another."""

    from_rank: int
    to_rank: int
    timestamp: Timestamp


class ShardEntry(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Progress of one shard. ``original_rank`` never changes; ``assigned_rank`` is the worker that
    processes it now."""

    status: Status
    original_rank: int
    assigned_rank: int
    last_checkpoint_batch: int = -1
    total_sequences: int = 0
    last_checkpoint_time: Timestamp | None = None
    retry_count: int = 0
    error: str | None = None
    checkpoints: list[BatchRecord] = msgspec.field(default_factory=list)
    completed_at: Timestamp | None = None
    failed_at: Timestamp | None = None
    reassignments: list[Reassignment] = msgspec.field(default_factory=list)
    claim: int = 0
    claimed_at: Timestamp | None = None


class GlobalCheckpoint(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A barrier: every listed shard had recorded at least the given batch."""

    checkpoint_id: str
    timestamp: Timestamp
    batch_boundaries: dict[str, int]


class LedgerState(msgspec.Struct, kw_only=True):
    """The whole ledger. ``checksum`` and ``sequence`` come first in the file."""

    checksum: str
    sequence: int
    version: str
    world_size: int
    created_at: Timestamp
    updated_at: Timestamp
    input_fingerprint: str = ""
    model_config_hash: str = ""
    global_checkpoints: list[GlobalCheckpoint] = msgspec.field(default_factory=list)
    shards: dict[str, ShardEntry] = msgspec.field(default_factory=dict)


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(LedgerState, strict=True)


def encode_state(state: LedgerState) -> bytes:
    """The exact bytes of ``state`` as a ledger file, with ``state.checksum`` filled in."""
    state.checksum = _PLACEHOLDER
    raw = bytearray(_ENCODER.encode(state))
    raw += b"\n"
    match = _CHECKSUM_HEAD.match(raw)
    if match is None:  # pragma: no cover - the encoder puts checksum and sequence first
        raise LedgerError("ledger encoding lost its checksum header")
    digest = digest_bytes(_CHECKSUM_ALGORITHM, memoryview(raw))
    hex_digits = digest.split(":", 1)[1].encode()
    raw[match.start(1) : match.end(1)] = hex_digits
    state.checksum = digest
    return bytes(raw)


def checked_sequence(raw: bytes) -> int:
    """The sequence number of a ledger file whose checksum matches its bytes.

    Raises :class:`LedgerError` with the reason when the file is torn, edited or not a ledger.
    """
    match = _CHECKSUM_HEAD.match(raw)
    if match is None:
        raise LedgerError("no checksum header (torn, empty or not a ledger file)")
    recorded = match.group(1).decode()
    blanked = bytearray(raw)
    blanked[match.start(1) : match.end(1)] = b"0" * 64
    actual = digest_bytes(_CHECKSUM_ALGORITHM, memoryview(blanked)).split(":", 1)[1]
    if not digests_equal(recorded, actual):
        raise LedgerError("checksum mismatch (torn or modified file)")
    return int(match.group(2))


def decode_state(raw: bytes) -> LedgerState:
    """Decode a checksum-verified ledger file and check that it is internally consistent."""
    try:
        state = _DECODER.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise LedgerError(f"schema violation: {str(exc)[:200]}") from exc
    major = state.version.split(".", 1)[0]
    if major != LEDGER_VERSION.split(".", 1)[0]:
        raise _UnsupportedVersion(
            f"ledger schema version {state.version} is not supported (this shardkeep reads and writes "
            f"{LEDGER_VERSION}); use the shardkeep release that wrote it"
        )
    # The count first: a world_size of 10**12 must not build 10**12 names to compare with.
    if (
        state.world_size < 1
        or len(state.shards) != state.world_size
        or set(state.shards) != {str(shard) for shard in range(state.world_size)}
    ):
        raise LedgerError(f"shards {sorted(state.shards)[:10]} do not match world_size {state.world_size}")
    return state


def _claimed_version(raw: bytes) -> str | None:
    """The ``version`` field of a checksum-valid file that does not fit the schema."""
    try:
        document = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return None
    version = document.get("version") if isinstance(document, dict) else None
    return version if isinstance(version, str) else None


def filesystem_type(path: str | os.PathLike[str], mountinfo: str | None = None) -> str | None:
    """The filesystem type (``ext4``, ``nfs4``, ``lustre`` ...) of the mount holding ``path``,
    from ``/proc/self/mountinfo`` (or the given text); ``None`` when it cannot be told."""
    if mountinfo is None:
        try:
            with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as handle:
                mountinfo = handle.read()
        except OSError:
            return None
    target = os.path.realpath(path)
    best: tuple[int, str] | None = None
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        mount_point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        fstype = line.split(" - ", 1)[1].split()[0]
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and (best is None or len(mount_point) >= best[0]):
            best = (len(mount_point), fstype)
    return best[1] if best else None


def _now(clock: Callable[[], float]) -> datetime:
    return datetime.fromtimestamp(clock(), tz=UTC)


def _iso(timestamp: datetime | None) -> str | None:
    return None if timestamp is None else timestamp.isoformat()


def _check_index(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UnsupportedValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


class _LedgerFiles:
    """The file operations of one update, in order. A seam for crash tests: each method is one
    step that a test can interrupt."""

    def remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def link(self, source: str, target: str) -> None:
        os.link(source, target)

    def write(self, path: str, data: bytes) -> None:
        # O_EXCL: never truncate an existing file, which may share its inode with another copy.
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(data)
            while view:
                written = os.write(descriptor, view)
                view = view[written:]
            os.fsync(descriptor)
        finally:
            os.close(descriptor)

    def rename(self, source: str, target: str) -> None:
        os.replace(source, target)

    def sync_dir(self, directory: str) -> None:
        fsync_directory_path(directory)


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
        self.manifest_path = Path(path)
        if self.manifest_path.name in ("", ".", ".."):
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
        base = Path(checkpoint_dir) if checkpoint_dir is not None else self.manifest_path.parent
        self.checkpoint_dir = Path(os.path.abspath(base))
        self.clock: Callable[[], float] = clock or time.time
        self.lock_timeout = lock_timeout
        self.max_bytes = max_bytes
        name = self.manifest_path.name
        check_name_length(name, "progress ledger name")
        # A long ledger name is shortened with its digest in these (see names), the same each time.
        self.tmp_path = self.manifest_path.with_name(sibling_name(name, ".tmp"))
        self.backup_path = self.manifest_path.with_name(sibling_name(name, ".backup"))
        self.lock_path = self.manifest_path.with_name(sibling_name(name, ".lock"))
        self._files = _LedgerFiles()
        self._warned_filesystem = False
        self._warned_directory_lock = False

    def __repr__(self) -> str:
        return f"ProgressLedger({str(self.manifest_path)!r}, world_size={self.world_size})"

    # ----------------------------------------------------------------------------------------
    # Reading

    def exists(self) -> bool:
        """Whether any copy of the ledger exists (it may still need recovery)."""
        return any(path.exists() for path in (self.manifest_path, self.tmp_path, self.backup_path))

    def _read_copy(self, path: Path) -> bytes | None:
        """One copy's bytes, ``None`` if absent. A regular file only: no symlink is followed, and a
        FIFO or device never blocks the read. A copy that is not a readable ledger file is a
        :class:`LedgerError` (a problem of that copy); an I/O error is a :class:`StorageError`."""
        try:
            return read_regular_file(path, limit=self.max_bytes)
        except FileNotFoundError:
            return None
        except UnsafePathError as exc:
            raise LedgerError(str(exc)) from exc
        except OSError as exc:
            raise StorageError(f"cannot read ledger copy {path}: {exc}") from exc

    def _refuse_a_directory(self) -> None:
        """Raise :class:`LedgerError` when the ledger's path is a directory (a common slip: the
        job's directory instead of the ledger file in it), naming the file that was meant."""
        try:
            is_directory = stat.S_ISDIR(os.lstat(self.manifest_path).st_mode)
        except OSError:
            return  # absent or unreadable: the read that follows says so
        if is_directory:
            guess = self.manifest_path / "progress.json"
            hint = f"did you mean {guess}?" if guess.exists() else f"e.g. {guess}"
            raise LedgerError(
                f"{self.manifest_path} is a directory; a progress ledger is a JSON file: give its path, {hint}"
            )

    def _load(self, *, check_world_size: bool = True) -> tuple[LedgerState, bytes, str]:
        """The newest valid version: (state, its exact bytes, which copy it came from).

        Copies are read in the order ``.tmp``, primary, ``.backup``, the order in which a version
        moves between them (a rename moves ``.tmp`` onto the primary; the next update copies the
        primary to ``.backup``), so a reader without the lock never sees the sequence go back.
        They are then tried by the sequence their header claims, highest first (the primary wins
        a tie); the first whose checksum and schema hold is the answer.
        """
        self._refuse_a_directory()
        present: list[tuple[int, int, str, bytes]] = []
        problems: dict[str, str] = {}
        found = 0
        primary_missing = False
        preference = {"primary": 2, "tmp": 1, "backup": 0}
        for label in ("tmp", "primary", "backup"):
            path = self._path_of(label)
            try:
                raw = self._read_copy(path)
            except LedgerError as exc:
                found += 1
                problems[str(path)] = str(exc)
                continue
            if raw is None:
                primary_missing = primary_missing or label == "primary"
                continue
            found += 1
            match = _CHECKSUM_HEAD.match(raw)
            if match is None:
                problems[str(path)] = "no checksum header (torn, empty or not a ledger file)"
                continue
            present.append((int(match.group(2)), preference[label], label, raw))
        if found == 0:
            raise LedgerNotFoundError(f"no progress ledger at {self.manifest_path}; call initialize() first")
        for sequence, _, label, raw in sorted(present, reverse=True):
            path = self._path_of(label)
            try:
                checked_sequence(raw)
            except LedgerError as exc:
                problems[str(path)] = str(exc)
                continue
            try:
                state = decode_state(raw)
            except _UnsupportedVersion:
                raise  # never fall back to an older copy and overwrite a newer format
            except LedgerError as exc:
                version = _claimed_version(raw)
                if version != LEDGER_VERSION:
                    # Intact (the checksum holds) but written by another shardkeep version.
                    raise _UnsupportedVersion(
                        f"ledger {path} (schema version {version}) has fields or values this shardkeep "
                        f"({LEDGER_VERSION}) does not know ({exc}); upgrade shardkeep to read it"
                    ) from exc
                problems[str(path)] = str(exc)
                continue
            if check_world_size and self.world_size is not None and state.world_size != self.world_size:
                raise LedgerMismatchError(
                    f"ledger {self.manifest_path} has world_size {state.world_size}, "
                    f"this ledger was opened with world_size {self.world_size}",
                    [("world_size", str(state.world_size), str(self.world_size))],
                )
            # A reader without the lock may legitimately find a newer version in .tmp or .backup
            # than in the primary it read a moment earlier; only a broken primary is worth a warning.
            if label != "primary" and (primary_missing or str(self.manifest_path) in problems):
                logger.warning(
                    "progress ledger %s: primary copy unusable (%s); using sequence %d from %s",
                    self.manifest_path,
                    problems.get(str(self.manifest_path), "missing"),
                    sequence,
                    path.name,
                )
            return state, raw, label
        listing = "; ".join(f"{name}: {reason}" for name, reason in problems.items())
        raise ManifestCorruptedError(
            f"progress ledger {self.manifest_path} is corrupted: no valid copy among the primary, .tmp and "
            f".backup ({listing}). Restore it from an archive, or re-initialize and redo the work.",
            manifest_path=str(self.manifest_path),
            problems=problems,
        )

    def _path_of(self, label: str) -> Path:
        return {"primary": self.manifest_path, "tmp": self.tmp_path, "backup": self.backup_path}[label]

    def read(self) -> LedgerState:
        """The newest valid version of the ledger, as a typed structure (a fresh copy)."""
        return self._load()[0]

    def to_dict(self) -> dict[str, Any]:
        """The newest valid version as plain JSON data (the file's fields)."""
        result: dict[str, Any] = msgspec.to_builtins(self.read())
        return result

    # ----------------------------------------------------------------------------------------
    # Writing

    def _warn_if_network_filesystem(self) -> None:
        if self._warned_filesystem:
            return
        self._warned_filesystem = True
        fstype = filesystem_type(self.manifest_path.parent)
        if fstype is not None and fstype.lower() in NETWORK_FILESYSTEMS:
            warnings.warn(
                f"progress ledger {self.manifest_path} is on a {fstype} filesystem, where file locks may not "
                "exclude processes on other machines; run all workers on one machine or keep the ledger on a "
                "local disk",
                LedgerLockWarning,
                stacklevel=4,
            )

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the ledger's exclusive lock: ``flock`` on the lock file, then on the directory.

        The lock file alone cannot exclude if it is deleted while held: the next writer creates
        a new file at the path and locks that, while the holder still writes. So the ledger's
        directory is locked too. It cannot be removed while the ledger is in it, and deleting or
        replacing the lock file does not change it. The lock file is kept because it is what
        works on network filesystems, where a directory cannot be locked (then a warning says
        the deletion of the lock file is not guarded against), and it is checked after locking
        (:meth:`_lock_file`), so that a deleted one is replaced rather than held in vain.
        """
        self._warn_if_network_filesystem()
        self._refuse_a_directory()
        deadline = None if self.lock_timeout is None else time.monotonic() + self.lock_timeout
        with contextlib.ExitStack() as held:
            held.callback(self._unlock, self._lock_file(deadline))
            directory = self._lock_directory(deadline)
            if directory is not None:
                held.callback(self._unlock, directory)
            yield

    @staticmethod
    def _unlock(descriptor: int) -> None:
        # Unlock explicitly: a child forked meanwhile shares the descriptor and would keep the lock.
        try:
            fcntl.flock(descriptor, fcntl.LOCK_UN)
        finally:
            os.close(descriptor)

    def _lock_file(self, deadline: float | None) -> int:
        """Open and lock the file at :attr:`lock_path`, and return its locked descriptor.

        The file is opened without following a symlink (a dangling one never creates a file
        elsewhere) and without blocking, and must be a regular file. Once locked, it must still be
        the file at the path (same device and inode, not unlinked): if it was deleted or replaced
        while this process waited, the lock is dropped and the file now at the path is locked.
        """
        while True:
            descriptor = self._open_lock_file()
            try:
                self._acquire(descriptor, deadline, self.lock_path)
                current = self._holds_current_lock_file(descriptor)
            except BaseException:
                os.close(descriptor)
                raise
            if current:
                return descriptor
            self._unlock(descriptor)
            if deadline is not None and time.monotonic() >= deadline:
                raise LedgerLockTimeoutError(
                    f"the progress ledger lock file {self.lock_path} was deleted or replaced each time it was "
                    f"locked, for {self.lock_timeout:g} s; is something deleting it?"
                )

    def _open_lock_file(self) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            descriptor = os.open(self.lock_path, flags, 0o644)
        except FileNotFoundError as exc:
            raise LedgerNotFoundError(f"the ledger's directory {self.manifest_path.parent} does not exist") from exc
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafePathError(
                    f"the ledger lock file {self.lock_path} is a symlink; the lock is never taken through one"
                ) from exc
            if exc.errno in (errno.EISDIR, errno.ENXIO):
                try:
                    kind = file_kind(os.lstat(self.lock_path).st_mode)
                except OSError:
                    kind = "a special file"
                raise UnsafePathError(f"the ledger lock file {self.lock_path} is {kind}, not a regular file") from exc
            raise StorageError(f"cannot open the ledger lock file {self.lock_path}: {exc}") from exc
        try:
            mode = os.fstat(descriptor).st_mode
            if not stat.S_ISREG(mode):
                raise UnsafePathError(f"the ledger lock file {self.lock_path} is {file_kind(mode)}, not a regular file")
        except OSError as exc:
            os.close(descriptor)
            raise StorageError(f"cannot inspect the ledger lock file {self.lock_path}: {exc}") from exc
        except BaseException:
            os.close(descriptor)
            raise
        return descriptor

    def _holds_current_lock_file(self, descriptor: int) -> bool:
        """Whether the locked file is still the one linked at :attr:`lock_path`."""
        try:
            held = os.fstat(descriptor)
            current = os.lstat(self.lock_path)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise StorageError(f"cannot inspect the ledger lock file {self.lock_path}: {exc}") from exc
        return held.st_nlink > 0 and (held.st_dev, held.st_ino) == (current.st_dev, current.st_ino)

    def _lock_directory(self, deadline: float | None) -> int | None:
        """Lock the ledger's directory and return its descriptor; ``None`` (after a warning) where
        the filesystem cannot lock a directory, as NFS cannot (it locks files open for writing)."""
        directory = self.manifest_path.parent
        try:
            descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise LedgerNotFoundError(f"the ledger's directory {directory} does not exist") from exc
        except OSError as exc:
            raise StorageError(f"cannot open the ledger's directory {directory} to lock it: {exc}") from exc
        try:
            self._acquire(descriptor, deadline, directory)
        except StorageError as exc:
            os.close(descriptor)
            cause = exc.__cause__
            if not isinstance(cause, OSError) or cause.errno not in _NO_DIRECTORY_LOCKS:
                raise
            if not self._warned_directory_lock:
                self._warned_directory_lock = True
                warnings.warn(
                    f"the filesystem of progress ledger {self.manifest_path} cannot lock its directory ({cause}); "
                    f"only the lock file {self.lock_path.name} excludes writers, so it must never be deleted "
                    "while workers run",
                    LedgerLockWarning,
                    stacklevel=5,
                )
            return None
        except BaseException:
            os.close(descriptor)
            raise
        return descriptor

    def _acquire(self, descriptor: int, deadline: float | None, target: Path) -> None:
        """``flock(LOCK_EX)`` on ``descriptor`` (the file ``target``), waiting until ``deadline``."""
        if deadline is None:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX)
            except OSError as exc:
                raise StorageError(f"cannot lock {target}: {exc}") from exc
            return
        pause = 0.0002
        while True:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                pass
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EINTR):
                    raise StorageError(f"cannot lock {target}: {exc}") from exc
            if time.monotonic() >= deadline:
                raise LedgerLockTimeoutError(
                    f"the progress ledger lock {target} was held by another process for more than "
                    f"{self.lock_timeout:g} s; is a process stopped while holding it?"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.002)

    def _write(self, state: LedgerState, previous: bytes | None, source: str | None) -> None:
        """Steps 2-4 of an update (see the module docstring). Caller holds the lock."""
        raw = encode_state(state)
        files = self._files
        primary, tmp, backup = str(self.manifest_path), str(self.tmp_path), str(self.backup_path)
        wrote_tmp = renamed = False
        try:
            if previous is not None and source != "backup":
                if source == "tmp":
                    files.rename(tmp, backup)
                else:
                    files.remove(tmp)
                    try:
                        files.link(primary, tmp)
                    except OSError:
                        wrote_tmp = True
                        files.write(tmp, previous)
                    files.rename(tmp, backup)
            # Always a fresh inode: after a crash, .tmp may be a hard link to the primary, and a
            # rename between two links of one inode does nothing (POSIX), leaving it in place.
            files.remove(tmp)
            wrote_tmp = True
            files.write(tmp, raw)
            files.rename(tmp, primary)
            renamed = True
            files.sync_dir(str(self.manifest_path.parent))
        except OSError as exc:
            if renamed:
                raise StorageError(
                    f"the progress ledger {self.manifest_path} was replaced, but fsyncing its directory failed "
                    f"({exc}): the change may not survive a power loss; re-read the ledger before retrying"
                ) from exc
            if wrote_tmp:
                # A .tmp whose write or fsync failed must never be adopted by a later read.
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            raise StorageError(
                f"cannot write the progress ledger {self.manifest_path}: {exc}; the previous version is intact"
            ) from exc

    def _check_writable(self, state: LedgerState) -> None:
        if state.version != LEDGER_VERSION:
            raise LedgerError(
                f"ledger {self.manifest_path} has schema version {state.version}, newer than this shardkeep "
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
            state.updated_at = _now(self.clock)
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
            self.manifest_path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot create the ledger directory {self.manifest_path.parent}: {exc}") from exc
        with self._locked():
            previous: tuple[LedgerState, bytes, str] | None
            try:
                previous = self._load(check_world_size=False)
            except (LedgerNotFoundError, ManifestCorruptedError) as exc:
                if isinstance(exc, ManifestCorruptedError) and not overwrite:
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
                    state.updated_at = _now(self.clock)
                    self._write(state, raw, source)
                return dict(msgspec.to_builtins(state))
            now = _now(self.clock)
            state = LedgerState(
                checksum="",
                sequence=(previous[0].sequence + 1) if previous else 1,
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
            self._write(state, previous[1] if previous else None, previous[2] if previous else None)
            self.world_size = size
            logger.info("initialized progress ledger %s with %d shards", self.manifest_path, size)
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
            f"this run differs from the one recorded in {self.manifest_path}:\n{lines}\n"
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
                f"unknown shard {rank}: ledger {self.manifest_path} has shards 0..{state.world_size - 1}", rank
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
            now = _now(self.clock)
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
            entry.claimed_at = _now(self.clock)
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
            entry.completed_at = _now(self.clock)

        with contextlib.suppress(_AlreadyRecorded):
            self._mutate(change)
        logger.info("progress ledger %s: shard %d complete", self.manifest_path, rank)

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
            entry.failed_at = _now(self.clock)
            entry.retry_count += 1

        self._mutate(change)
        logger.warning("progress ledger %s: shard %d failed: %s", self.manifest_path, rank, error)

    # ----------------------------------------------------------------------------------------
    # Queries

    def get_shard_status(self, rank: int) -> dict[str, Any] | None:
        """Shard ``rank``'s entry as a dict, or ``None`` if there is no such shard."""
        entry = self.read().shards.get(str(rank))
        return None if entry is None else dict(msgspec.to_builtins(entry))

    def get_incomplete_shard_ranks(self) -> list[int]:
        """Shards that are in progress or failed, in order."""
        return sorted(int(key) for key, entry in self.read().shards.items() if entry.status != "complete")

    def get_resumable_shards(self) -> list[int]:
        """The same as :meth:`get_incomplete_shard_ranks`."""
        return self.get_incomplete_shard_ranks()

    def get_completed_shards(self) -> list[int]:
        return sorted(int(key) for key, entry in self.read().shards.items() if entry.status == "complete")

    def get_assigned_shards(self, worker: int) -> list[int]:
        """Unfinished shards currently assigned to ``worker`` (its own, plus any reassigned to it)."""
        return sorted(
            int(key)
            for key, entry in self.read().shards.items()
            if entry.assigned_rank == worker and entry.status != "complete"
        )

    def get_resume_info(self, rank: int) -> dict[str, Any]:
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

    def get_resume_points(self) -> dict[int, int]:
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

    def get_orphaned_shards(self) -> list[int]:
        """Failed shards with at least ``max_retries`` failures: candidates for reassignment."""
        return self._orphaned(self.read())

    def _orphaned(self, state: LedgerState) -> list[int]:
        return sorted(
            int(key)
            for key, entry in state.shards.items()
            if entry.status == "failed" and entry.retry_count >= self.max_retries
        )

    def get_global_progress(self) -> dict[str, Any]:
        """Counts over all shards: ``total_shards``, ``completed``, ``in_progress``, ``failed``,
        ``stale`` and ``stale_shards``, ``orphaned`` and ``orphaned_shards``,
        ``total_sequences_checkpointed``, ``total_batches``, the run's ``input_fingerprint`` and
        ``model_config_hash``, and the ledger's ``sequence``."""
        return self.progress_of(self.read())

    def progress_of(self, state: LedgerState) -> dict[str, Any]:
        """:meth:`get_global_progress` of a version already read (one consistent snapshot)."""
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
                Reassignment(from_rank=entry.assigned_rank, to_rank=new_assigned_rank, timestamp=_now(self.clock))
            )
            entry.assigned_rank = new_assigned_rank
            entry.claim += 1  # the previous worker's claim is void
            entry.status = "in_progress"

        with contextlib.suppress(_AlreadyRecorded):
            self._mutate(change)
        logger.info(
            "progress ledger %s: shard %d assigned to worker %d", self.manifest_path, shard_rank, new_assigned_rank
        )

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
                    timestamp=_now(self.clock),
                    batch_boundaries={str(rank): batch for rank, batch in sorted(boundaries.items())},
                )
            )

        self._mutate(change)

    def get_latest_global_checkpoint(self) -> dict[str, Any] | None:
        """The most recent barrier as a dict, or ``None``."""
        checkpoints = self.read().global_checkpoints
        return dict(msgspec.to_builtins(checkpoints[-1])) if checkpoints else None

    # ----------------------------------------------------------------------------------------
    # After completion

    def _require_complete(self, state: LedgerState, action: str) -> None:
        incomplete = sorted(int(key) for key, entry in state.shards.items() if entry.status != "complete")
        if incomplete:
            raise LedgerStateError(f"cannot {action}: shards {incomplete} are not complete")

    def archive_manifest(self, archive_dir: str | os.PathLike[str]) -> Path:
        """Copy the final ledger to ``archive_dir/<name>_final.json`` (durably) and return that
        path. Every shard must be complete. The copy is itself a valid ledger file."""
        directory = Path(archive_dir)
        with self._locked():
            state, raw, _ = self._load()
            self._require_complete(state, "archive the ledger")
            target = directory / sibling_name(self.manifest_path.stem, "_final.json")
            staging = directory / sibling_name(target.name, STAGING_MARKER, uuid.uuid4().hex[:12], lead=".")
            try:
                directory.mkdir(parents=True, exist_ok=True)
                self._files.write(str(staging), raw)
                self._files.rename(str(staging), str(target))
                self._files.sync_dir(str(directory))
            except OSError as exc:
                with contextlib.suppress(OSError):
                    os.unlink(staging)
                raise StorageError(f"cannot archive the ledger to {target}: {exc}") from exc
        logger.info("progress ledger %s archived to %s", self.manifest_path, target)
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
            if not force:
                self._require_complete(state, "clean up batch files")
            now = _now(self.clock)
            for entry in state.shards.values():
                keep_last = keep_final_only or force or entry.status != "complete"
                for record in entry.checkpoints[:-1] if keep_last else entry.checkpoints:
                    if record.removed_at is None:
                        record.removed_at = now

        self._mutate(mark)
        removed = 0
        with self._locked():
            state = self._load()[0]
            directories: set[Path] = set()
            kept = {
                record.file for entry in state.shards.values() for record in entry.checkpoints if not record.removed_at
            }
            for entry in state.shards.values():
                for record in entry.checkpoints:
                    _, absolute = self.resolve_file(record.file)
                    directories.add(absolute.parent)
                    # A file that a kept record also names (one file rewritten per batch) stays.
                    if record.removed_at is not None and record.file not in kept and self._delete_path(absolute):
                        removed += 1
            if not force and all(entry.status == "complete" for entry in state.shards.values()):
                names = {record.file for entry in state.shards.values() for record in entry.checkpoints}
                for directory in sorted(directories):
                    self._remove_leftovers(directory, names, lease)
        logger.info("progress ledger %s: removed %d batch files", self.manifest_path, removed)
        return removed

    @staticmethod
    def _delete_path(path: Path) -> bool:
        """Remove a file, symlink or directory without following symlinks; ``False`` if absent."""
        try:
            if path.is_symlink() or not path.is_dir():
                path.unlink()
                return True
            doomed = path.with_name(sibling_name(path.name, DELETING_MARKER, uuid.uuid4().hex[:12]))
            os.rename(path, doomed)
            shutil.rmtree(doomed)
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise StorageError(f"cannot delete batch file {path}: {exc}") from exc

    def _remove_leftovers(self, directory: Path, recorded: set[str], lease: float) -> None:
        try:
            if directory.is_symlink():
                return
            entries = list(os.scandir(directory))
        except FileNotFoundError:
            return
        except OSError as exc:
            raise StorageError(f"cannot list {directory}: {exc}") from exc
        now = time.time()
        for item in entries:
            leftover = directory / item.name
            is_leftover = STAGING_MARKER in item.name or DELETING_MARKER in item.name
            if not is_leftover and UNRECORDED_BATCH.fullmatch(item.name):
                is_leftover = self.resolve_file(leftover)[0] not in recorded
            if not is_leftover:
                continue
            try:
                touched = item.stat(follow_symlinks=False).st_mtime
                if item.is_dir(follow_symlinks=False):
                    touched = max(
                        [touched, *(child.stat(follow_symlinks=False).st_mtime for child in os.scandir(leftover))]
                    )
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise StorageError(f"cannot inspect leftover {leftover}: {exc}") from exc
            if now - touched < lease:
                continue
            self._delete_path(leftover)


class _UnsupportedVersion(LedgerError):
    """A checksum-valid ledger of another major schema version."""


class _AlreadyRecorded(Exception):
    """Internal: the change is already in the ledger; nothing to write."""
