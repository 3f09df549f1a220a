"""Local filesystem durability: the one home of every rename, fsync and removal that must
survive a crash on a local or shared POSIX filesystem.

:class:`LocalFS` has two kinds of methods:

- *steps*, each one system call or one well-known library call: :meth:`~LocalFS.rename`,
  :meth:`~LocalFS.replace`, :meth:`~LocalFS.rename_noreplace`, :meth:`~LocalFS.exchange`,
  :meth:`~LocalFS.link`, :meth:`~LocalFS.write_new_file` (exclusive create, write, fsync),
  :meth:`~LocalFS.fsync_directory`, :meth:`~LocalFS.fsync_file`, :meth:`~LocalFS.mkdir` and
  :meth:`~LocalFS.remove_tree`;
- *protocols* whose every change on disk is one of those steps: :meth:`~LocalFS.write_file_atomic` (temporary file
  beside the target, fsync, rename, fsync of the directory), :meth:`~LocalFS.makedirs_durable`,
  :meth:`~LocalFS.replace_dir` (exchange, or two renames), :meth:`~LocalFS.retire` and
  :meth:`~LocalFS.retire_and_remove` (rename aside under a marker, then remove), and
  :meth:`~LocalFS.remove_idle` (leftovers untouched for a lease).

A crash test substitutes a subclass whose step fails or stops at the moment under test
(:func:`using`), and every protocol of every caller then runs on it: nothing patches module
globals. The module-level functions call the instance in use (:func:`current`): the default
:data:`LOCAL`, or the one :func:`using` installed.

Every method raises the ``OSError`` of the step that failed; each caller turns it into its own
error (a :class:`~shardkeep.errors.StorageError`, a ``ConfigError`` ...) with its own words.
Marker names come from :mod:`shardkeep.names` and :mod:`shardkeep.manifest`.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from shardkeep.errors import StorageError
from shardkeep.manifest import DELETING_MARKER, STAGING_MARKER
from shardkeep.names import HF_OLD_MARKER, sibling_name

__all__ = [
    "LOCAL",
    "RENAME_EXCHANGE",
    "ExchangeUnsupported",
    "LocalFS",
    "current",
    "exchange_paths",
    "fsync_directory_path",
    "makedirs_durable",
    "remove_idle",
    "rename_noreplace_at",
    "rename_noreplace_path",
    "renameat2",
    "replace_dir",
    "retire_and_remove",
    "storage_error",
    "sync_file_range_function",
    "using",
    "write_file_atomic",
]

#: ``renameat2`` flag: fail rather than replace what is at the destination.
_RENAME_NOREPLACE = 1
#: ``renameat2`` flag: swap two existing paths in one step.
RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_FLAG_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}
#: Hex digits of the fresh id that ends a temporary file's name (``.NAME.tmp-<id>``).
_TEMPORARY_ID_CHARS = 12

#: What :meth:`LocalFS.write_file_atomic` writes: the bytes, or a function that writes the
#: (already created, empty) temporary file at the path it is given.
Content = bytes | bytearray | memoryview | Callable[[str], None]
#: A local path.
PathText = str | os.PathLike[str]
#: Which names of a directory :meth:`LocalFS.remove_idle` considers.
NameMatch = Callable[[str], bool]


def storage_error(action: str, path: str, exc: OSError) -> StorageError:
    """``StorageError("<action> '<path>' failed: <reason> (errno N)")``, the words every local
    failure is reported in."""
    return StorageError(f"{action} {path!r} failed: {exc.strerror or exc} (errno {exc.errno})")


class _Libc:
    """Two Linux calls that ``os`` lacks, resolved once through ctypes (``None`` if missing):
    ``renameat2`` (``RENAME_NOREPLACE``, ``RENAME_EXCHANGE``) and ``sync_file_range``, so that
    writeback starts while a large file is still being written."""

    lock = threading.Lock()
    resolved = False
    renameat2: Any = None
    sync_file_range: Any = None

    @classmethod
    def load(cls) -> type[_Libc]:
        with cls.lock:
            if not cls.resolved:
                cls.resolved = True
                try:
                    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
                except OSError:
                    return cls
                renameat2 = getattr(libc, "renameat2", None)
                if renameat2 is not None:
                    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
                    renameat2.restype = ctypes.c_int
                    cls.renameat2 = renameat2
                sync_file_range = getattr(libc, "sync_file_range", None)
                if sync_file_range is not None:
                    sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
                    sync_file_range.restype = ctypes.c_int
                    cls.sync_file_range = sync_file_range
            return cls


def _after_fork_in_child() -> None:
    """A parent thread may have held the lock at the fork."""
    _Libc.lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def sync_file_range_function() -> Any:
    """The C library's ``sync_file_range`` (``(fd, offset, count, flags) -> int``), or ``None``
    where there is none."""
    return _Libc.load().sync_file_range


class ExchangeUnsupported(OSError):
    """``renameat2`` with the requested flag is not available here (OS, C library or filesystem)."""


def renameat2(source: str, destination: str, flags: int) -> None:
    """``renameat2(2)`` on two paths (relative to the working directory). Raises
    :class:`ExchangeUnsupported` where the OS, the C library or the filesystem lacks it or the
    flag, and ``OSError`` for any other failure."""
    function = _Libc.load().renameat2
    if function is None:
        raise ExchangeUnsupported(errno.ENOSYS, "the C library has no renameat2 (Linux only)")
    if function(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(destination), flags) != 0:
        code = ctypes.get_errno()
        if code in _FLAG_UNSUPPORTED:
            raise ExchangeUnsupported(code, os.strerror(code), source, None, destination)
        raise OSError(code, os.strerror(code), source, None, destination)


def rename_noreplace_at(src_dir_fd: int, src: str, dst_dir_fd: int, dst: str) -> None:
    """Rename ``src`` (under ``src_dir_fd``) to ``dst`` (under ``dst_dir_fd``), never replacing
    anything there (``OSError`` ``EEXIST``). Where the filesystem lacks ``RENAME_NOREPLACE``:
    a check, then a rename (a racing writer could slip in between; staging names are unique and
    the final name is checked first)."""
    function = _Libc.load().renameat2
    if function is not None:
        if function(src_dir_fd, os.fsencode(src), dst_dir_fd, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        code = ctypes.get_errno()
        if code not in _FLAG_UNSUPPORTED:
            raise OSError(code, os.strerror(code))
    try:
        os.stat(dst, dir_fd=dst_dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        os.rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
        return
    raise OSError(errno.EEXIST, os.strerror(errno.EEXIST))


def _fsync_path(path: str, flags: int) -> None:
    handle = os.open(path, os.O_RDONLY | os.O_CLOEXEC | flags)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def _write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.write(fd, view)
        if written <= 0:
            raise OSError(errno.EIO, f"no progress (wrote {written} bytes)")
        view = view[written:]


class LocalFS:
    """The durable operations on local paths (see the module docstring). Stateless: one
    instance serves every thread. Subclass it and override a step to simulate a crash or a
    filesystem that lacks a feature; install it with :func:`using`."""

    # -- steps ------------------------------------------------------------------------------
    def rename(self, source: str, destination: str) -> None:
        """``os.rename``: replaces a file, or an empty directory, at ``destination``."""
        os.rename(source, destination)

    def replace(self, source: str, destination: str) -> None:
        """``os.replace``: replaces a file at ``destination`` in one step."""
        os.replace(source, destination)

    def rename_noreplace(self, source: str, destination: str) -> None:
        """Rename, never replacing anything at ``destination`` (``OSError`` ``EEXIST``)."""
        rename_noreplace_at(_AT_FDCWD, source, _AT_FDCWD, destination)

    def exchange(self, source: str, destination: str) -> None:
        """Swap ``source`` and ``destination`` (both exist) in one atomic step: at no moment is
        either name missing. :class:`ExchangeUnsupported` where that cannot be done here."""
        renameat2(source, destination, RENAME_EXCHANGE)

    def fsync_directory(self, path: str) -> None:
        """fsync the directory ``path``, so that the renames and creations in it are durable."""
        _fsync_path(path, os.O_DIRECTORY)

    def fsync_file(self, path: str) -> None:
        """fsync the regular file ``path`` (not following a symlink)."""
        _fsync_path(path, os.O_NOFOLLOW)

    def link(self, source: str, destination: str) -> None:
        """``os.link``: a second name for the file ``source`` (``FileExistsError`` when
        ``destination`` exists)."""
        os.link(source, destination)

    def write_new_file(
        self, path: str | os.PathLike[str], data: bytes | bytearray | memoryview, *, mode: int = 0o644
    ) -> None:
        """Create ``path`` exclusively (never truncating or following what is there:
        ``FileExistsError``), write all of ``data`` and fsync it. Not atomic: a crash can leave
        it short; :meth:`write_file_atomic` cannot."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

    def mkdir(self, path: str, mode: int = 0o755) -> None:
        """``os.mkdir`` (``FileExistsError`` when something is there)."""
        os.mkdir(path, mode)

    def remove_tree(self, path: str) -> bool:
        """Remove a file, a symlink (the link only) or a directory tree (never following a
        symlink inside it); ``False`` when nothing is at ``path``."""
        try:
            if os.path.islink(path) or not os.path.isdir(path):
                os.remove(path)
            else:
                shutil.rmtree(path)
        except FileNotFoundError:
            return False
        return True

    # -- protocols --------------------------------------------------------------------------
    def write_file_atomic(
        self, path: str | os.PathLike[str], content: Content, *, mode: int = 0o644, overwrite: bool = True
    ) -> None:
        """Write ``path`` whole or not at all: a fresh temporary file beside it
        (``.NAME.tmp-<id>``, created exclusively with ``mode``), filled with ``content`` (the
        bytes, or a function given the temporary path), fsynced, renamed onto ``path`` and the
        directory fsynced. With ``overwrite=False`` an existing ``path`` is never replaced
        (``FileExistsError``). On failure the temporary file is removed and ``path`` is as it
        was."""
        target = os.path.abspath(os.fspath(path))
        directory, name = os.path.split(target)
        temporary = os.path.join(
            directory, sibling_name(name, STAGING_MARKER, uuid.uuid4().hex[:_TEMPORARY_ID_CHARS], lead=".")
        )
        try:
            if callable(content):
                self.write_new_file(temporary, b"", mode=mode)  # created exclusively, with its mode
                content(temporary)
                self.fsync_file(temporary)
            else:
                self.write_new_file(temporary, content, mode=mode)
            if overwrite:
                self.replace(temporary, target)
            else:
                self.rename_noreplace(temporary, target)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
            raise
        self.fsync_directory(directory)

    def makedirs_durable(self, path: str | os.PathLike[str], mode: int = 0o755) -> None:
        """Create directory ``path`` and its missing parents, fsyncing each parent whose
        entries changed, so that the whole chain survives a crash. An existing directory is
        left as it is; anything else at ``path`` is ``FileExistsError``, a file above it
        ``NotADirectoryError``."""
        missing: list[str] = []
        at = os.path.abspath(os.fspath(path))
        while not os.path.lexists(at):
            missing.append(at)
            parent = os.path.dirname(at)
            if parent == at:
                break
            at = parent
        if not missing and not os.path.isdir(at):
            raise FileExistsError(errno.EEXIST, "exists and is not a directory", at)
        for directory in reversed(missing):
            try:
                self.mkdir(directory, mode)
            except FileExistsError:
                if not os.path.isdir(directory):
                    raise
                continue  # another process made it, and syncs its parent
            self.fsync_directory(os.path.dirname(directory))

    def replace_dir(self, staging: str, target: str, *, aside: str | None = None, restore: bool = True) -> str | None:
        """Put the finished directory ``staging`` at ``target``; return where the replaced
        directory now is (for the caller to remove), or ``None`` when ``target`` was free.
        If it raises, ``staging`` still holds the new directory and ``target`` is as it was
        (unless the process dies in the fallback's window, below; with ``restore=False`` a
        failed second rename leaves that window's state, for a caller whose recovery repairs
        it).

        A free ``target`` is a rename that never replaces anything. An existing one is swapped
        with ``staging`` in one step (:meth:`exchange`), so ``target`` is never missing, and
        ``staging`` then holds the old directory. Where the exchange is not supported it is two
        renames, the old directory to ``aside`` (default ``.NAME.old-<id>`` beside it), then
        the new one in: between them nothing is at ``target``. The parent is fsynced last."""
        parent, name = os.path.split(target)
        if not os.path.lexists(target):
            self.rename_noreplace(staging, target)
            self.fsync_directory(parent)
            return None
        try:
            self.exchange(staging, target)
            old = staging
        except ExchangeUnsupported:
            old = aside or os.path.join(
                parent, sibling_name(name, HF_OLD_MARKER, uuid.uuid4().hex[:_TEMPORARY_ID_CHARS], lead=".")
            )
            self.rename(target, old)
            try:
                self.rename(staging, target)
            except BaseException:
                if restore:
                    self.rename(old, target)
                raise
        self.fsync_directory(parent)
        return old

    def retire(self, path: str, marker: str = DELETING_MARKER, *, sync: bool = True, aside: str | None = None) -> str:
        """Rename ``path`` aside (never replacing anything) to ``aside``, by default
        ``<name><marker><32 hex digits>`` in its directory (a name that nothing reads as what it
        was), and return the new path; with ``sync`` the directory is fsynced, so the rename is
        durable before anything inside is deleted."""
        parent, name = os.path.split(path)
        doomed = aside or os.path.join(parent, sibling_name(name, marker, uuid.uuid4().hex))
        self.rename_noreplace(path, doomed)
        if sync:
            self.fsync_directory(parent or ".")
        return doomed

    def retire_and_remove(self, path: str, marker: str = DELETING_MARKER) -> bool:
        """Remove ``path``: a file or a symlink at once; a directory first renamed aside
        (:meth:`retire`, durable), then removed, so that a half-removed tree always has a
        marker name. ``False`` when nothing is at ``path``."""
        try:
            if os.path.islink(path) or not os.path.isdir(path):
                return self.remove_tree(path)
            doomed = self.retire(path, marker)
        except FileNotFoundError:
            return False
        self.remove_tree(doomed)
        return True

    def newest_change(self, path: str) -> float | None:
        """When anything at or below ``path`` last changed (its own and every entry's mtime,
        never following a symlink); ``None`` when it is gone."""
        try:
            newest = os.lstat(path).st_mtime
        except FileNotFoundError:
            return None
        if os.path.islink(path) or not os.path.isdir(path):
            return newest
        for directory, directories, files in os.walk(path, followlinks=False):
            for entry in (*directories, *files):
                with contextlib.suppress(FileNotFoundError):
                    newest = max(newest, os.lstat(os.path.join(directory, entry)).st_mtime)
        return newest

    def remove_idle(
        self,
        directory: PathText,
        match: NameMatch,
        lease: float,
        *,
        now: float | None = None,
        marker: str = DELETING_MARKER,
    ) -> list[str]:
        """Remove every entry of ``directory`` whose name ``match`` accepts and in which nothing
        changed for ``lease`` seconds (:meth:`newest_change`), each with
        :meth:`retire_and_remove` under ``marker``; return the names removed. A missing
        directory, or a symlink to one, holds nothing."""
        parent = os.fspath(directory)
        if os.path.islink(parent):
            return []
        try:
            names = os.listdir(parent)
        except (FileNotFoundError, NotADirectoryError):
            return []
        now = time.time() if now is None else now
        removed: list[str] = []
        for name in sorted(names):
            if not match(name):
                continue
            leftover = os.path.join(parent, name)
            touched = self.newest_change(leftover)
            if touched is None or now - touched < lease:
                continue
            if self.retire_and_remove(leftover, marker):
                removed.append(name)
        return removed


#: The default :class:`LocalFS`: the real filesystem.
LOCAL = LocalFS()
_in_use: list[LocalFS] = [LOCAL]


def current() -> LocalFS:
    """The :class:`LocalFS` the module-level functions use now (:data:`LOCAL` unless
    :func:`using` installed another)."""
    return _in_use[-1]


@contextlib.contextmanager
def using(fs: LocalFS) -> Iterator[LocalFS]:
    """Make ``fs`` the :class:`LocalFS` of every module-level function (and so of every caller
    in the library) inside the ``with`` block, process-wide. For tests: one at a time."""
    depth = len(_in_use)
    _in_use.append(fs)
    try:
        yield fs
    finally:
        del _in_use[depth:]


def exchange_paths(source: str, destination: str) -> None:
    """:meth:`LocalFS.exchange` of the filesystem in use."""
    current().exchange(source, destination)


def rename_noreplace_path(source: str, destination: str) -> None:
    """:meth:`LocalFS.rename_noreplace` of the filesystem in use: rename ``source`` to
    ``destination`` (paths), never replacing anything there (``FileExistsError``)."""
    current().rename_noreplace(source, destination)


def fsync_directory_path(path: str) -> None:
    """:meth:`LocalFS.fsync_directory` of the filesystem in use."""
    current().fsync_directory(path)


def write_file_atomic(
    path: str | os.PathLike[str], content: Content, *, mode: int = 0o644, overwrite: bool = True
) -> None:
    """:meth:`LocalFS.write_file_atomic` of the filesystem in use."""
    current().write_file_atomic(path, content, mode=mode, overwrite=overwrite)


def makedirs_durable(path: str | os.PathLike[str], mode: int = 0o755) -> None:
    """:meth:`LocalFS.makedirs_durable` of the filesystem in use."""
    current().makedirs_durable(path, mode)


def replace_dir(staging: str, target: str, *, aside: str | None = None, restore: bool = True) -> str | None:
    """:meth:`LocalFS.replace_dir` of the filesystem in use."""
    return current().replace_dir(staging, target, aside=aside, restore=restore)


def retire_and_remove(path: str, marker: str = DELETING_MARKER) -> bool:
    """:meth:`LocalFS.retire_and_remove` of the filesystem in use."""
    return current().retire_and_remove(path, marker)


def remove_idle(
    directory: PathText, match: NameMatch, lease: float, *, now: float | None = None, marker: str = DELETING_MARKER
) -> list[str]:
    """:meth:`LocalFS.remove_idle` of the filesystem in use."""
    return current().remove_idle(directory, match, lease, now=now, marker=marker)
