"""Storage backends: byte stores that the commit protocol writes through."""

from shardkeep.storage.base import ByteStore, EntryInfo, ReadHandle, WriteHandle
from shardkeep.storage.faults import FaultInjectingStore
from shardkeep.storage.local import LocalStore

__all__ = ["ByteStore", "EntryInfo", "FaultInjectingStore", "LocalStore", "ReadHandle", "WriteHandle"]
