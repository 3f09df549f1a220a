"""The ledger's three copies on disk: reading the highest valid one, and the crash-safe write of
the next version through ``.backup`` and ``.tmp``. Imports without torch.

Files, next to each other::

    progress.json          the ledger
    progress.json.backup   the previous version, kept before every replace
    progress.json.tmp      the next version while it is being written
    progress.json.lock     the lock file (see :mod:`shardkeep.ledger.lock`)

A read takes the valid copy with the highest sequence number among the primary, ``.tmp`` and
``.backup``; it raises :class:`~shardkeep.errors.LedgerCorruptedError` only when none is
valid. Reads take no lock: every file is either replaced whole by a rename or detected as torn
by its checksum.

An update, under the exclusive lock:

1. read the current version (the highest valid copy);
2. keep it as ``.backup``: hard-link the primary as ``.tmp`` (or write the recovered bytes there
   and fsync them) and rename it over ``.backup``;
3. write the new version to a fresh ``.tmp`` (whatever is at ``.tmp`` is removed first; created
   exclusively, never truncated: a leftover ``.tmp`` may be a hard link to the primary) and fsync
   it;
4. rename ``.tmp`` over the primary and fsync the directory. Only then does the call return.

Crash windows: before step 4's rename, the primary still holds the old version (and ``.backup``
too), so the update is simply absent. After the rename, the new version is the primary. A valid
``.tmp`` left by a crash after its fsync has the highest sequence and is adopted: that update
completed everything except the rename. A torn ``.tmp`` fails its checksum and is ignored.

Each file operation of steps 2-4 is one step of the :class:`~shardkeep.storage.localfs.LocalFS`
in use (``remove_tree``, ``link``, ``write_new_file``, ``replace``, ``fsync_directory``), so a
crash test that installs its own with :func:`~shardkeep.storage.localfs.using` can fail or stop
the update at any of them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from pathlib import Path
from typing import Literal, NamedTuple

from shardkeep.errors import (
    LedgerCorruptedError,
    LedgerError,
    LedgerMismatchError,
    LedgerNotFoundError,
    StorageError,
    UnsafePathError,
)
from shardkeep.integrity import read_regular_file
from shardkeep.ledger.format import (
    LEDGER_VERSION,
    LedgerState,
    UnsupportedLedgerVersionError,
    checked_sequence,
    claimed_sequence,
    claimed_version,
    decode_state,
    encode_state,
)
from shardkeep.names import check_name_length, sibling_name
from shardkeep.storage.localfs import LocalFS

__all__ = ["Copy", "LedgerCopies", "Loaded"]

logger = logging.getLogger(__name__)

Copy = Literal["primary", "tmp", "backup"]
# A version moves .tmp -> primary -> .backup; on equal sequence numbers the primary wins.
_PREFERENCE: dict[Copy, int] = {"primary": 2, "tmp": 1, "backup": 0}


class Loaded(NamedTuple):
    """The newest valid version: the state, its exact bytes, and the copy it came from."""

    state: LedgerState
    raw: bytes
    source: Copy


class LedgerCopies:
    """The primary, ``.tmp`` and ``.backup`` copies of the ledger file at ``path``, and the lock
    file's path beside them. A long ledger name is shortened with its digest in the siblings'
    names (see :mod:`shardkeep.names`), the same each time."""

    def __init__(self, path: Path) -> None:
        name = path.name
        check_name_length(name, "progress ledger name")
        self.path = path
        self.tmp_path = path.with_name(sibling_name(name, ".tmp"))
        self.backup_path = path.with_name(sibling_name(name, ".backup"))
        self.lock_path = path.with_name(sibling_name(name, ".lock"))

    def exists(self) -> bool:
        """Whether any copy of the ledger exists (it may still need recovery)."""
        return any(path.exists() for path in (self.path, self.tmp_path, self.backup_path))

    def path_of(self, label: Copy) -> Path:
        return {"primary": self.path, "tmp": self.tmp_path, "backup": self.backup_path}[label]

    def refuse_a_directory(self) -> None:
        """Raise :class:`LedgerError` when the ledger's path is a directory (a common slip: the
        job's directory instead of the ledger file in it), naming the file that was meant."""
        try:
            is_directory = stat.S_ISDIR(os.lstat(self.path).st_mode)
        except OSError:
            return  # absent or unreadable: the read that follows says so
        if is_directory:
            guess = self.path / "progress.json"
            hint = f"did you mean {guess}?" if guess.exists() else f"e.g. {guess}"
            raise LedgerError(f"{self.path} is a directory; a progress ledger is a JSON file: give its path, {hint}")

    @staticmethod
    def read_copy(path: Path, max_bytes: int) -> bytes | None:
        """One copy's bytes, ``None`` if absent. A regular file only: no symlink is followed, and a
        FIFO or device never blocks the read. A copy that is not a readable ledger file is a
        :class:`LedgerError` (a problem of that copy); an I/O error is a :class:`StorageError`."""
        try:
            return read_regular_file(path, limit=max_bytes)
        except FileNotFoundError:
            return None
        except UnsafePathError as exc:
            raise LedgerError(str(exc)) from exc
        except OSError as exc:
            raise StorageError(f"cannot read ledger copy {path}: {exc}") from exc

    def load(self, *, max_bytes: int, world_size: int | None = None) -> Loaded:
        """The newest valid version.

        Copies are read in the order ``.tmp``, primary, ``.backup``, the order in which a version
        moves between them (a rename moves ``.tmp`` onto the primary; the next update copies the
        primary to ``.backup``), so a reader without the lock never sees the sequence go back.
        They are then tried by the sequence their header claims, highest first (the primary wins
        a tie); the first whose checksum and schema hold is the answer. A ``world_size`` other
        than the answer's is a :class:`~shardkeep.errors.LedgerMismatchError`.
        """
        self.refuse_a_directory()
        present: list[tuple[int, int, Copy, bytes]] = []
        problems: dict[str, str] = {}
        found = 0
        primary_missing = False
        for label in ("tmp", "primary", "backup"):
            path = self.path_of(label)
            try:
                raw = self.read_copy(path, max_bytes)
            except LedgerError as exc:
                found += 1
                problems[str(path)] = str(exc)
                continue
            if raw is None:
                primary_missing = primary_missing or label == "primary"
                continue
            found += 1
            sequence = claimed_sequence(raw)
            if sequence is None:
                problems[str(path)] = "no checksum header (torn, empty or not a ledger file)"
                continue
            present.append((sequence, _PREFERENCE[label], label, raw))
        if found == 0:
            raise LedgerNotFoundError(f"no progress ledger at {self.path}; call initialize() first")
        for sequence, _, label, raw in sorted(present, reverse=True):
            state = self._believe(label, raw, problems)
            if state is None:
                continue
            if world_size is not None and state.world_size != world_size:
                raise LedgerMismatchError(
                    f"ledger {self.path} has world_size {state.world_size}, "
                    f"this ledger was opened with world_size {world_size}",
                    [("world_size", str(state.world_size), str(world_size))],
                )
            # A reader without the lock may legitimately find a newer version in .tmp or .backup
            # than in the primary it read a moment earlier; only a broken primary is worth a warning.
            if label != "primary" and (primary_missing or str(self.path) in problems):
                logger.warning(
                    "progress ledger %s: primary copy unusable (%s); using sequence %d from %s",
                    self.path,
                    problems.get(str(self.path), "missing"),
                    sequence,
                    self.path_of(label).name,
                )
            return Loaded(state, raw, label)
        listing = "; ".join(f"{name}: {reason}" for name, reason in problems.items())
        raise LedgerCorruptedError(
            f"progress ledger {self.path} is corrupted: no valid copy among the primary, .tmp and "
            f".backup ({listing}). Restore it from an archive, or re-initialize and redo the work.",
            manifest_path=str(self.path),
            problems=problems,
        )

    def _believe(self, label: Copy, raw: bytes, problems: dict[str, str]) -> LedgerState | None:
        """The state of one copy if its checksum and schema hold; otherwise ``None``, with the
        reason in ``problems``. A copy another shardkeep version wrote is refused, never passed
        over for an older one (which the next update would then write over it)."""
        path = self.path_of(label)
        try:
            checked_sequence(raw)
        except LedgerError as exc:
            problems[str(path)] = str(exc)
            return None
        try:
            return decode_state(raw)
        except UnsupportedLedgerVersionError:
            raise
        except LedgerError as exc:
            version = claimed_version(raw)
            if version != LEDGER_VERSION:
                # Intact (the checksum holds) but written by another shardkeep version.
                raise UnsupportedLedgerVersionError(
                    f"ledger {path} (schema version {version}) has fields or values this shardkeep "
                    f"({LEDGER_VERSION}) does not know ({exc}); upgrade shardkeep to read it"
                ) from exc
            problems[str(path)] = str(exc)
            return None

    def write(self, state: LedgerState, previous: bytes | None, source: Copy | None, fs: LocalFS) -> None:
        """Steps 2-4 of an update (see the module docstring), each one step of ``fs``. The caller
        holds the lock; ``previous`` and ``source`` are what :meth:`load` returned (``None``:
        none)."""
        raw = encode_state(state)
        primary, tmp, backup = str(self.path), str(self.tmp_path), str(self.backup_path)
        wrote_tmp = renamed = False
        try:
            if previous is not None and source != "backup":
                if source == "tmp":
                    fs.replace(tmp, backup)
                else:
                    fs.remove_tree(tmp)
                    try:
                        fs.link(primary, tmp)
                    except OSError:
                        wrote_tmp = True
                        fs.write_new_file(tmp, previous)
                    fs.replace(tmp, backup)
            # Always a fresh inode: after a crash, .tmp may be a hard link to the primary, and a
            # rename between two links of one inode does nothing (POSIX), leaving it in place.
            fs.remove_tree(tmp)
            wrote_tmp = True
            fs.write_new_file(tmp, raw)
            fs.replace(tmp, primary)
            renamed = True
            fs.fsync_directory(str(self.path.parent))
        except OSError as exc:
            if renamed:
                raise StorageError(
                    f"the progress ledger {self.path} was replaced, but fsyncing its directory failed "
                    f"({exc}): the change may not survive a power loss; re-read the ledger before retrying"
                ) from exc
            if wrote_tmp:
                # A .tmp whose write or fsync failed must never be adopted by a later read.
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            raise StorageError(
                f"cannot write the progress ledger {self.path}: {exc}; the previous version is intact"
            ) from exc
