"""Snapshots for asynchronous saves: a copy of a state's tensors in a reusable host arena.

:func:`snapshot_state` copies every tensor of a state (plain tensors, ``DTensor`` local shards,
numpy arrays) into one host buffer, the :class:`StagingArena`, and returns a plain nested state
that views the copies. Training may then change its own tensors freely. The arena is allocated
once and reused by later snapshots (first-touch memory is slow; re-used memory is not), and
large copies run on two threads (``memmove`` releases the GIL).

Only one snapshot may be in use at a time: ``async_save`` allows one save in flight per process.
"""

from __future__ import annotations

import copy
import ctypes
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from shardkeep.errors import UnsupportedValueError
from shardkeep.tensors.convert import NAME_TO_NUMPY, describe_array, dtensor_chunk, is_dtensor
from shardkeep.tensors.flatten import flatten_state, rebuild_state

__all__ = ["StagingArena", "snapshot_state"]

_ALIGNMENT = 64
#: Tensors at least this large are copied on the thread pool; smaller ones inline.
_PARALLEL_COPY_BYTES = 4 << 20


class StagingArena:
    """One growing host buffer, reused by every snapshot of this process."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        """Bytes of host memory the arena holds now (0 before the first snapshot)."""
        buffer = self._buffer
        return 0 if buffer is None else int(buffer.numel())

    def reserve(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of at least ``nbytes`` (grown by a quarter more when too small)."""
        with self._lock:
            if self._buffer is None or self._buffer.numel() < nbytes:
                self._buffer = None  # free the old one first: peak memory stays one arena
                self._buffer = torch.empty(max(nbytes, nbytes + nbytes // 4), dtype=torch.uint8)
            return self._buffer


def _aligned(offset: int) -> int:
    return (offset + _ALIGNMENT - 1) // _ALIGNMENT * _ALIGNMENT


def snapshot_state(state: Any, arena: StagingArena, *, budget: int | None = None) -> dict[str, Any]:
    """A copy of ``state`` whose tensors live in ``arena``; JSON values are deep-copied.

    ``budget`` (bytes) refuses a state larger than that before anything is copied.
    """
    flat = flatten_state(state)
    layout: list[tuple[Any, Any, int, str, list[int], int]] = []
    total = 0
    for leaf in flat.tensors:
        chunk = dtensor_chunk(leaf.key, leaf.value)
        source = chunk[0] if chunk is not None else leaf.value
        dtype, shape, nbytes, _, _, _ = describe_array(leaf.key, source)
        offset = _aligned(total)
        layout.append((leaf, source, offset, dtype, shape, nbytes))
        total = offset + nbytes
    if budget is not None and total > budget:
        raise UnsupportedValueError(
            f"the state holds {total} tensor bytes, more than the staging budget of {budget} bytes"
        )
    buffer = arena.reserve(max(total, 1))
    base = buffer.data_ptr()
    staged: list[tuple[list[str | int], int, Any]] = []
    large: list[tuple[int, int, int]] = []
    for leaf, source, offset, dtype, shape, nbytes in layout:
        region = buffer[offset : offset + nbytes]
        if isinstance(source, np.ndarray):
            target_array = region.numpy().view(NAME_TO_NUMPY[dtype]).reshape(shape)
            if source.flags.c_contiguous and nbytes >= _PARALLEL_COPY_BYTES:
                large.append((base + offset, int(source.__array_interface__["data"][0]), nbytes))
            else:
                np.copyto(target_array, source)
            value: Any = target_array
        else:
            target = region.view(source.dtype).view(shape) if shape else region.view(source.dtype).view(())
            if source.is_cpu and source.is_contiguous() and not source.is_conj() and not source.is_neg():
                if nbytes >= _PARALLEL_COPY_BYTES:
                    large.append((base + offset, source.data_ptr(), nbytes))
                elif nbytes:
                    ctypes.memmove(base + offset, source.data_ptr(), nbytes)
            else:
                with torch.no_grad():
                    target.copy_(source)
            value = target
            if is_dtensor(leaf.value):
                from torch.distributed.tensor import DTensor  # imported already: leaf.value is one

                original = leaf.value
                value = DTensor.from_local(
                    target,
                    original.device_mesh,
                    original.placements,
                    run_check=False,
                    shape=original.shape,
                    stride=original.stride(),
                )
        staged.append((list(leaf.path), leaf.order, value))
    if large:
        with ThreadPoolExecutor(2, thread_name_prefix="shardkeep-stage") as pool:
            list(pool.map(lambda job: ctypes.memmove(*job), large))
    values = copy.deepcopy(flat.values)
    return rebuild_state(flat.containers, values, staged)
