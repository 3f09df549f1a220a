"""The object-store backend, through fsspec (tested against S3: SeaweedFS in the test suite).

An object store has no rename and no directories, so :class:`FsspecStore` says so
(``atomic_rename`` is ``False``) and the commit protocol changes accordingly (see
:mod:`shardkeep.distributed.commit`): data objects go under a fresh per-attempt prefix, the
manifest is the last object and is written create-only (``If-None-Match: *``), and nothing is
ever renamed or overwritten. Directories are key prefixes: ``stat`` of a prefix with objects
below it says ``"dir"``, and creating parents is free.

Credentials and endpoint come from ``storage_options`` (passed to the fsspec filesystem, e.g.
``{"key": ..., "secret": ..., "client_kwargs": {"endpoint_url": ...}}``) or, by default, from the
standard AWS environment variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_ENDPOINT_URL``, ``AWS_REGION`` ...), read by botocore.

Every failure is a :class:`~shardkeep.errors.StorageError` (or a more specific shardkeep
error); a refused create-only write is a :class:`~shardkeep.errors.CheckpointExistsError`.
"""

from __future__ import annotations

import datetime as _dt
import time
from collections.abc import Mapping
from typing import Any

from shardkeep.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ShardkeepError,
    StorageError,
    UnsafePathError,
    UnsupportedValueError,
)
from shardkeep.names import unsafe_path_reason
from shardkeep.storage.base import EntryInfo, StoreBase
from shardkeep.storage.locations import split_url

__all__ = ["FsspecStore", "split_url"]

#: Objects are uploaded in parts of this size (S3's minimum part size is 5 MiB).
PART_SIZE = 16 * 2**20


def _is_precondition_failure(exc: BaseException) -> bool:
    """A refused ``If-None-Match: *`` (HTTP 412), as s3fs reports it."""
    if isinstance(exc, FileExistsError):
        return True
    text = str(exc)
    return "PreconditionFailed" in text or "pre-conditions you specified did not hold" in text


def _error(action: str, path: str, exc: BaseException) -> ShardkeepError:
    if isinstance(exc, ShardkeepError):
        return exc
    if isinstance(exc, FileNotFoundError):
        return CheckpointNotFoundError(f"{action} {path!r}: not found")
    if isinstance(exc, PermissionError):
        return StorageError(f"{action} {path!r}: access denied (check the credentials and endpoint): {exc}")
    return StorageError(f"{action} {path!r} failed: {type(exc).__name__}: {exc}")


class _RemoteWriter:
    """A create-only upload: small objects are one PUT, larger ones a multipart upload; both
    complete with ``If-None-Match: *``. ``abort`` aborts a started multipart upload."""

    def __init__(self, store: FsspecStore, path: str) -> None:
        self._path = path
        self._store = store
        try:
            self._file: Any = store.fs.open(store.full(path), "xb", block_size=PART_SIZE)
        except Exception as exc:
            raise _error("creating", path, exc) from exc
        self._done = False

    def write(self, data: bytes | memoryview, /) -> None:
        if self._done:
            raise StorageError(f"writing to {self._path!r} after it was closed")
        try:
            self._file.write(data)
        except Exception as exc:
            raise _error("writing", self._path, exc) from exc

    def commit(self) -> None:
        self._done = True
        try:
            self._file.close()
        except Exception as exc:
            self._discard()
            if _is_precondition_failure(exc):
                raise CheckpointExistsError(
                    f"{self._path!r} already exists in {self._store!r}; objects are never overwritten"
                ) from exc
            raise _error("uploading", self._path, exc) from exc

    def _discard(self) -> None:
        try:
            self._file.discard()  # aborts a started multipart upload
        except Exception:
            pass
        self._file.closed = True  # nothing more to flush, ever

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self._discard()


class _RemoteReader:
    def __init__(self, store: FsspecStore, path: str, size: int) -> None:
        self._store = store
        self._path = path
        self.size = size

    def map(self) -> memoryview:
        buffer = memoryview(bytearray(self.size))
        if self.size:
            self.read_into(0, buffer)
        return buffer

    def read_into(self, offset: int, buffer: memoryview, /) -> None:
        view = buffer.cast("B") if buffer.format != "B" else buffer
        length = len(view)
        if offset < 0 or offset + length > self.size:
            raise StorageError(
                f"reading {length} bytes at offset {offset} of {self._path!r} ({self.size} bytes): past the end of file"
            )
        if length == 0:
            return
        try:
            data = self._store.fs.cat_file(self._store.full(self._path), start=offset, end=offset + length)
        except Exception as exc:
            raise _error("reading", self._path, exc) from exc
        if len(data) != length:
            raise StorageError(
                f"reading {self._path!r}: got {len(data)} bytes at offset {offset}, expected {length} (end of file)"
            )
        view[:] = data

    def close(self) -> None:
        pass


#: The gap a ranged read of an object reads through instead of a second request (``read_gap``).
READ_GAP = 1 << 20


class FsspecStore(StoreBase):
    """A byte store rooted at ``url`` (``s3://bucket/prefix``) on an fsspec filesystem. Its
    ``root`` is that URL; it cannot rename; ``remove_file`` deletes one object and
    ``abort_uploads`` aborts S3 multipart uploads."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        import fsspec

        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise UnsupportedValueError(
                f"storage_options must be a mapping of fsspec options, got {type(storage_options).__name__}"
            )
        self.protocol, self._root = split_url(url)
        self._url = f"{self.protocol}://{self._root}"
        options = dict(storage_options or {})
        options.setdefault("skip_instance_cache", True)
        if self.protocol in ("s3", "s3a"):
            # Listings must be fresh: a listing never proves anything, but a stale one would
            # hide leftovers from cleanup.
            options.setdefault("use_listings_cache", False)
        try:
            self.fs: Any = fsspec.filesystem(self.protocol, **options)
        except ImportError as exc:
            raise UnsupportedValueError(
                f"{url!r} needs the fsspec backend for {self.protocol}:// ({exc}); for S3: pip install s3fs"
            ) from exc
        except (TypeError, ValueError) as exc:
            raise UnsupportedValueError(f"storage_options for {url!r} were refused: {exc}") from exc

    @property
    def root(self) -> str:
        return self._url

    @property
    def atomic_rename(self) -> bool:
        """An object store cannot rename: the commit protocol writes under final keys instead."""
        return False

    @property
    def read_gap(self) -> int:
        """A GET costs tens of ms: ranged reads read through gaps of up to 1 MiB."""
        return READ_GAP

    def __repr__(self) -> str:
        return f"FsspecStore({self.root!r})"

    def full(self, path: str) -> str:
        return f"{self._root}/{path}" if path else self._root

    @staticmethod
    def _check(path: str, *, allow_root: bool = False) -> None:
        if allow_root and path == "":
            return
        reason = unsafe_path_reason(path)
        if reason is not None:
            raise UnsafePathError(f"unsafe storage path {path!r}: {reason}")

    # -- files ----------------------------------------------------------------------------------
    def open_write(self, path: str) -> _RemoteWriter:
        """Create-only: refused at once if the object exists, and enforced again by the server
        (``If-None-Match: *``) when the upload completes, for a writer that raced us."""
        self._check(path)
        if self.stat(path) is not None:
            raise CheckpointExistsError(f"{path!r} already exists in {self.root}; objects are never overwritten")
        return _RemoteWriter(self, path)

    def open_read(self, path: str) -> _RemoteReader:
        self._check(path)
        info = self.stat(path)
        if info is None:
            raise CheckpointNotFoundError(f"no object {path!r} in {self.root}")
        if info.kind != "file":
            raise UnsafePathError(f"{path!r} in {self.root} is not an object")
        return _RemoteReader(self, path, info.size)

    def stat(self, path: str) -> EntryInfo | None:
        self._check(path)
        try:
            info = self.fs.info(self.full(path))
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise _error("inspecting", path, exc) from exc
        entry = _entry_info(info)
        if entry.kind == "dir" and not self._has_objects(path):
            return None  # an empty prefix (some servers keep one after its objects are deleted)
        return entry

    def _has_objects(self, path: str) -> bool:
        """Whether any object lies below the prefix ``path``."""
        bucket, _, prefix = self.full(path).partition("/")
        try:
            if self.protocol in ("s3", "s3a"):
                page = self.fs.call_s3(
                    "list_objects_v2", Bucket=bucket, Prefix=f"{prefix}/" if prefix else "", MaxKeys=1
                )
                return bool(page.get("Contents"))
            return bool(self.fs.find(self.full(path), withdirs=False))
        except FileNotFoundError:
            return False
        except Exception as exc:
            raise _error("listing", path, exc) from exc

    def list_files(self, path: str) -> list[tuple[str, EntryInfo]]:
        self._check(path, allow_root=True)
        base = self.full(path)
        try:
            found = self.fs.find(base, detail=True, withdirs=False)
        except FileNotFoundError:
            found = {}
        except Exception as exc:
            raise _error("listing", path, exc) from exc
        result: list[tuple[str, EntryInfo]] = []
        for key, info in found.items():
            relative = key[len(base) :].lstrip("/")
            if not relative or info.get("type") == "directory":
                continue
            result.append((relative, _entry_info(info)))
        if not result:
            info = self.stat(path) if path else EntryInfo(kind="dir", size=0)
            if info is None or info.kind != "dir":
                raise CheckpointNotFoundError(f"no directory {path!r} in {self.root}")
        return sorted(result)

    def list_dir(self, path: str = "") -> list[tuple[str, EntryInfo]]:
        self._check(path, allow_root=True)
        base = self.full(path)
        try:
            found = self.fs.ls(base, detail=True)
        except FileNotFoundError:
            return []
        except Exception as exc:
            raise _error("listing", path, exc) from exc
        result: dict[str, EntryInfo] = {}
        for info in found:
            name = str(info["name"]).rstrip("/")[len(base) :].strip("/")
            if not name or "/" in name:
                continue
            entry = _entry_info(info)
            if entry.kind == "dir" and not self._has_objects(f"{path}/{name}" if path else name):
                continue  # an empty prefix left behind by a deletion
            result[name] = entry
        return sorted(result.items())

    def put_atomic(self, path: str, data: bytes) -> None:
        """One PUT: readers see the old object or the new one."""
        self._check(path)
        try:
            self.fs.pipe_file(self.full(path), bytes(data))
        except Exception as exc:
            raise _error("writing", path, exc) from exc

    def rename(self, src: str, dst: str) -> None:
        self._check(src)
        self._check(dst)
        raise UnsupportedValueError(f"{self.root} is an object store: it has no atomic rename ({src!r} -> {dst!r})")

    def sync_dir(self, path: str) -> None:
        """Nothing to do: a completed PUT is durable."""
        self._check(path, allow_root=True)

    def remove_tree(self, path: str) -> None:
        """Delete every object under ``path`` (or the object itself) and abort unfinished
        multipart uploads below it."""
        self._check(path)
        self.abort_uploads(path)
        base = self.full(path)
        try:
            keys = list(self.fs.find(base, withdirs=False))
            if self.fs.isfile(base):
                keys.append(base)
            if keys:
                self.fs.rm(sorted(set(keys)))
        except FileNotFoundError:
            return
        except Exception as exc:
            raise _error("removing", path, exc) from exc
        if keys and (self._has_objects(path) or self.stat(path) is not None):
            # A bulk delete reports failures per key without raising: check the outcome.
            raise StorageError(f"removing {path!r} from {self.root} left objects behind")

    # -- capabilities beyond the defaults -----------------------------------------------------------
    def remove_file(self, path: str) -> None:
        """Delete one object (missing is fine) and confirm that it is gone: a bulk delete can
        fail per key without raising, this cannot."""
        self._check(path)
        try:
            self.fs.rm_file(self.full(path))
        except FileNotFoundError:
            pass
        except Exception as exc:
            raise _error("removing", path, exc) from exc
        if self.stat(path) is not None:
            raise StorageError(f"removing {path!r} from {self.root} did not take effect")

    def abort_uploads(self, path: str = "", *, older_than: float = 0.0) -> list[str]:
        """Abort unfinished multipart uploads below ``path`` started more than ``older_than``
        seconds ago (an aborted checkpoint must leave nothing behind, and a killed writer leaves parts that cost money and
        that no listing shows). Returns the keys whose uploads were aborted. Stores that are not
        S3 have nothing to abort."""
        self._check(path, allow_root=True)
        if self.protocol not in ("s3", "s3a"):
            return []
        bucket, _, prefix = self.full(path).partition("/")
        if prefix:
            prefix += "/"
        aborted: list[str] = []
        now = time.time()
        try:
            pages = self.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
            for upload in pages.get("Uploads", []):
                started = upload.get("Initiated")
                age = now - started.timestamp() if isinstance(started, _dt.datetime) else float("inf")
                if age < older_than:
                    continue
                self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                aborted.append(str(upload["Key"]))
        except Exception as exc:
            raise _error("aborting unfinished uploads under", path or "/", exc) from exc
        return aborted


def _entry_info(info: Mapping[str, Any]) -> EntryInfo:
    if info.get("type") == "directory":
        return EntryInfo(kind="dir", size=0)
    modified = info.get("LastModified") or info.get("mtime") or info.get("last_modified")
    if isinstance(modified, _dt.datetime):
        mtime = modified.timestamp()
    elif isinstance(modified, (int, float)):
        mtime = float(modified)
    else:
        mtime = 0.0
    return EntryInfo(kind="file", size=int(info.get("size") or 0), mtime=mtime)
