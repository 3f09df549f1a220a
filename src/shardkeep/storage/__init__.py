"""Storage backends: byte stores that the commit protocol writes through (local filesystem,
fsspec object stores such as S3, and an in-memory reference; all pass
:mod:`shardkeep.testing.conformance`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from shardkeep.storage.base import (
    ATTEMPT_PREFIX,
    ByteStore,
    EntryInfo,
    ForwardingStore,
    ReadHandle,
    StoreBase,
    StoreOperations,
    WriteHandle,
    adapt_store,
    renames,
    write_new,
)
from shardkeep.storage.local import LocalStore
from shardkeep.storage.locations import is_url, local_path, split_url
from shardkeep.storage.memory import MemoryStore
from shardkeep.storage.remote import FsspecStore

__all__ = [
    "ATTEMPT_PREFIX",
    "ByteStore",
    "EntryInfo",
    "ForwardingStore",
    "FsspecStore",
    "LocalStore",
    "MemoryStore",
    "ReadHandle",
    "StoreBase",
    "StoreOperations",
    "WriteHandle",
    "adapt_store",
    "is_url",
    "local_path",
    "open_store",
    "renames",
    "split_url",
    "write_new",
]


def __getattr__(name: str) -> object:
    # The old import path of the fault injector, which lives in shardkeep.testing (no test tool
    # among the production exports): imported on first use only.
    if name == "FaultInjectingStore":
        from shardkeep.testing.faults import FaultInjectingStore

        return FaultInjectingStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_store(location: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> ByteStore:
    """The store rooted at ``location``: a local directory (a path, or ``file://PATH``), or a
    URL such as ``s3://bucket/prefix`` (through fsspec, with ``storage_options``); see
    :mod:`shardkeep.storage.locations`."""
    path = local_path(location)
    if path is None:
        return FsspecStore(os.fspath(location), storage_options)
    return LocalStore(path)
