"""The gloo process groups shardkeep makes for itself (the checkpoint group of
:class:`~shardkeep.distributed.coordinator.Coordinator` and the group of async saves'
background retries, each made once per key and reused; the group of a node-local level's peer
replication, made per manager and destroyed by its ``close``).

A cached group must not outlive what torch knows of it:

- after the user's ``destroy_process_group()`` torch has forgotten it; a later lookup drops it
  (and makes a new one if asked), so a re-initialized default group never gets a dead group,
  even when its key (the ``id`` of the new default group) equals the old one's;
- at interpreter exit every group still cached is dropped (and destroyed, when torch still knows
  it) by an ``atexit`` hook, while the interpreter is whole. Otherwise the last reference went
  with this module's globals during finalization, and a gloo worker thread still holding a
  finished collective's tensors (whose storage may be a Python object) took the GIL to free them
  while the interpreter was going away: the process aborted with "terminate called without an
  active exception" (seen once in some hundred runs of ``examples/distributed_save.py``).
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["GroupCache", "release_all"]

_caches: weakref.WeakSet[GroupCache] = weakref.WeakSet()


def _known_to_torch(group: Any) -> bool:
    """Whether torch still has ``group`` (not destroyed); ``True`` when it cannot tell."""
    try:
        from torch.distributed import distributed_c10d

        return group in distributed_c10d._world.pg_map
    except Exception:  # a torch without this registry: keep the group, as before
        return True


class GroupCache:
    """Groups by key, made on the first :meth:`get` and reused while torch knows them."""

    def __init__(self) -> None:
        self._groups: dict[Hashable, Any] = {}
        self._lock = threading.RLock()
        _caches.add(self)

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """The group cached under ``key``, or ``make()``'s, cached. Groups torch has destroyed
        are dropped first."""
        with self._lock:
            for old, group in list(self._groups.items()):
                if not _known_to_torch(group):
                    del self._groups[old]
            group = self._groups.get(key)
            if group is None:
                group = make()
                self._groups[key] = group
            return group

    def forget(self, group: Any) -> None:
        """Drop ``group`` (a broken one: the next :meth:`get` makes a new one)."""
        with self._lock:
            for key, cached in list(self._groups.items()):
                if cached is group:
                    del self._groups[key]

    def destroy(self, group: Any) -> None:
        """Drop ``group`` and destroy it, when torch still knows it (no collective: a gloo group
        is destroyed on each rank alone). Call it only once nothing uses the group."""
        self.forget(group)
        _destroy(group)

    def __contains__(self, group: Any) -> bool:
        with self._lock:
            return any(cached is group for cached in self._groups.values())

    def release(self) -> None:
        """Destroy every cached group torch still knows, and drop them all (no collective: a
        gloo group is destroyed on each rank alone)."""
        with self._lock:
            groups, self._groups = list(self._groups.values()), {}
        for group in groups:
            _destroy(group)


def _destroy(group: Any) -> None:
    if _known_to_torch(group):
        try:
            import torch.distributed as dist

            dist.destroy_process_group(group)
        except Exception:  # what cannot be destroyed is at least not held
            pass


def release_all() -> None:
    """:meth:`GroupCache.release` on every cache (the exit hook)."""
    for cache in list(_caches):
        cache.release()


atexit.register(release_all)
