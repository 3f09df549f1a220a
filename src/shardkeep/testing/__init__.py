"""Tools for testing code that uses shardkeep, and custom stores: the storage conformance suite
and the fault-injecting store.

- :mod:`~shardkeep.testing.conformance`: :data:`CHECKS`, the contract every byte store passes
  (shardkeep's local, fsspec and in-memory stores run it in ``tests/test_storage_conformance.py``),
  :class:`StoreUnderTest` and :func:`check_store` to run it against your own store;
- :mod:`~shardkeep.testing.faults`: :class:`FaultInjectingStore`, which wraps any store and fails
  its N-th operation (:class:`InjectedFault`).

Nothing here imports pytest or torch when imported; the two checks that save need torch. Not part
of the checkpointing path: no production module imports this package (the old import path
``shardkeep.storage.FaultInjectingStore`` loads it on first use).
"""

from shardkeep.testing.conformance import CHECKS, UNSAFE_PATHS, StoreUnderTest, check_store
from shardkeep.testing.faults import FaultInjectingStore, InjectedFault

__all__ = ["CHECKS", "UNSAFE_PATHS", "FaultInjectingStore", "InjectedFault", "StoreUnderTest", "check_store"]
