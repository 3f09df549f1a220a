"""The ledger's exclusive lock: ``flock`` on the lock file and on the ledger's directory, and the
warning where a network filesystem may not honour it. Imports without torch.

``flock`` locks belong to the open file description, so two threads or processes opening the
lock file exclude each other, and closing another descriptor does not drop the lock (unlike
``lockf``). An update holds two locks: on the lock file and on the ledger's directory. Someone
else may delete the lock file while a writer holds it; the next writer would then create and
lock a new file and run alongside. The directory cannot be deleted while the ledger is in it, so
its lock still excludes. The lock file is opened without following a symlink and must be a
regular file; once locked, it must still be the file at the path, or it is locked afresh. On
NFS, Lustre and other network filesystems locks may not exclude across machines: the ledger
warns once with :class:`LedgerLockWarning` (and again where the directory cannot be locked).
The kernel releases a lock when its holder dies, even with kill -9.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

from shardkeep.errors import LedgerLockTimeoutError, LedgerNotFoundError, StorageError, UnsafePathError
from shardkeep.integrity import file_kind

__all__ = ["NETWORK_FILESYSTEMS", "LedgerLock", "LedgerLockWarning", "filesystem_type"]

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
# What flock(LOCK_EX) on a directory fails with where a filesystem cannot lock one (NFS: EBADF,
# since it locks only files open for writing).
_NO_DIRECTORY_LOCKS = frozenset({errno.EBADF, errno.EINVAL, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS})


class LedgerLockWarning(UserWarning):
    """The ledger lives on a network filesystem where file locks may not exclude other machines."""


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


class LedgerLock:
    """The exclusive lock of the ledger at ``ledger_path``, taken through the file ``lock_path``
    and the ledger's directory. One object per :class:`~shardkeep.ledger.ProgressLedger`; it
    warns at most once per kind of warning."""

    def __init__(self, ledger_path: Path, lock_path: Path) -> None:
        self.ledger_path = ledger_path
        self.lock_path = lock_path
        self._warned_filesystem = False
        self._warned_directory_lock = False

    def warn_if_network_filesystem(self) -> None:
        """Warn (once) with :class:`LedgerLockWarning` when the ledger's directory is on a
        network filesystem, where ``flock`` may not exclude other machines."""
        if self._warned_filesystem:
            return
        self._warned_filesystem = True
        fstype = filesystem_type(self.ledger_path.parent)
        if fstype is not None and fstype.lower() in NETWORK_FILESYSTEMS:
            warnings.warn(
                f"progress ledger {self.ledger_path} is on a {fstype} filesystem, where file locks may not "
                "exclude processes on other machines; run all workers on one machine or keep the ledger on a "
                "local disk",
                LedgerLockWarning,
                stacklevel=4,
            )

    @contextlib.contextmanager
    def held(self, timeout: float | None) -> Iterator[None]:
        """Hold the ledger's exclusive lock: ``flock`` on the lock file, then on the directory,
        waiting at most ``timeout`` seconds in all (``None``: forever) before
        :class:`~shardkeep.errors.LedgerLockTimeoutError`.

        The lock file alone cannot exclude if it is deleted while held: the next writer creates
        a new file at the path and locks that, while the holder still writes. So the ledger's
        directory is locked too. It cannot be removed while the ledger is in it, and deleting or
        replacing the lock file does not change it. The lock file is kept because it is what
        works on network filesystems, where a directory cannot be locked (then a warning says
        the deletion of the lock file is not guarded against), and it is checked after locking
        (:meth:`_lock_file`), so that a deleted one is replaced rather than held in vain.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with contextlib.ExitStack() as held:
            held.callback(self._unlock, self._lock_file(deadline, timeout))
            directory = self._lock_directory(deadline, timeout)
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

    def _lock_file(self, deadline: float | None, timeout: float | None) -> int:
        """Open and lock the file at :attr:`lock_path`, and return its locked descriptor.

        The file is opened without following a symlink (a dangling one never creates a file
        elsewhere) and without blocking, and must be a regular file. Once locked, it must still be
        the file at the path (same device and inode, not unlinked): if it was deleted or replaced
        while this process waited, the lock is dropped and the file now at the path is locked.
        """
        while True:
            descriptor = self._open_lock_file()
            try:
                self._acquire(descriptor, deadline, timeout, self.lock_path)
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
                    f"locked, for {timeout:g} s; is something deleting it?"
                )

    def _open_lock_file(self) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            descriptor = os.open(self.lock_path, flags, 0o644)
        except FileNotFoundError as exc:
            raise LedgerNotFoundError(f"the ledger's directory {self.ledger_path.parent} does not exist") from exc
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

    def _lock_directory(self, deadline: float | None, timeout: float | None) -> int | None:
        """Lock the ledger's directory and return its descriptor; ``None`` (after a warning) where
        the filesystem cannot lock a directory, as NFS cannot (it locks files open for writing)."""
        directory = self.ledger_path.parent
        try:
            descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise LedgerNotFoundError(f"the ledger's directory {directory} does not exist") from exc
        except OSError as exc:
            raise StorageError(f"cannot open the ledger's directory {directory} to lock it: {exc}") from exc
        try:
            self._acquire(descriptor, deadline, timeout, directory)
        except StorageError as exc:
            os.close(descriptor)
            cause = exc.__cause__
            if not isinstance(cause, OSError) or cause.errno not in _NO_DIRECTORY_LOCKS:
                raise
            if not self._warned_directory_lock:
                self._warned_directory_lock = True
                warnings.warn(
                    f"the filesystem of progress ledger {self.ledger_path} cannot lock its directory ({cause}); "
                    f"only the lock file {self.lock_path.name} excludes writers, so it must never be deleted "
                    "while workers run",
                    LedgerLockWarning,
                    stacklevel=6,
                )
            return None
        except BaseException:
            os.close(descriptor)
            raise
        return descriptor

    @staticmethod
    def _acquire(descriptor: int, deadline: float | None, timeout: float | None, target: Path) -> None:
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
                    f"the progress ledger lock {target} was held by another process for more than {timeout:g} s; "
                    "is a process stopped while holding it?"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.002)
