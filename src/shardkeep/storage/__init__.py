"""Storage backends: byte stores that the commit protocol writes through (local filesystem, and
an in-memory reference; both pass ``tests/test_storage_conformance.py``)."""

from shardkeep.storage.base import ByteStore, EntryInfo, ReadHandle, WriteHandle
from shardkeep.storage.faults import FaultInjectingStore
from shardkeep.storage.local import LocalStore
from shardkeep.storage.memory import MemoryStore

__all__ = ["ByteStore", "EntryInfo", "FaultInjectingStore", "LocalStore", "MemoryStore", "ReadHandle", "WriteHandle"]
