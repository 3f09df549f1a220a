"""Digests known without hashing: the proof, from PyTorch's version counters, that a file an
incremental save lays out holds the same bytes as a file this process wrote (or proved) before.

An in-place operation through torch on a tensor, or on a view of it (``add_``, ``copy_``,
``lerp_``, a foreach or single-tensor optimizer step, under ``no_grad`` or not), increments the
version counter the tensor shares with its views (``tensor._version``). So when a file's
tensors are the very objects this process saved before, each alone on the very same storage
object (not a view into a larger buffer), with the same shape, strides and dtype, and every
version counter is where it was when their bytes were read, then their bytes are the bytes
that were read, and the file's digest is the digest computed then.

Some writes do not move the counter, and are handled or documented:

- ``torch.optim``'s fused kernels (``fused=True``) and other optimizers' custom kernels update
  parameters and their state without moving it. Global optimizer step hooks (before and after
  the step) therefore forget every record that involves the storage of a parameter with a
  gradient, or of that parameter's state: any :class:`torch.optim.Optimizer`'s step is covered.
- Native ops that write an argument other than their first do not move its counter (BatchNorm's
  forward updates its running statistics so): a module's buffers are never proved (the
  flattener gives detached copies of them, new objects each time).
- A tensor that views a larger buffer (the flat-parameter buffers of FSDP1, DeepSpeed or
  Megatron, assigned with ``param.data = flat[...]``) is never proved: writes through the
  buffer move the buffer's counter, not the parameter's.
- Writes through another tensor given the same storage with ``.data =`` or ``set_``, through
  ``tensor.data``, through storage objects (``untyped_storage().copy_()``), through native ops
  on tensors the state holds outside modules (``F.batch_norm`` on your own running statistics,
  a functional fused optimizer update outside ``Optimizer.step``), through NumPy or DLPack,
  through raw pointers or custom kernels outside an optimizer step, or by another process into
  shared memory, are not seen. That is why the proof is used only when the caller asks for it
  (``save(..., incremental=Incremental(trust_versions=True))``); docs/tiers.md lists these limits for users.

Collectives write tensors without moving their version counters either: ``broadcast``,
``all_reduce``, ``recv``, ``scatter``, ``all_gather_single``, ``all_to_all_single``, DDP's
parameter sync and FSDP's gathers all write through the backend. No proof is therefore made or
used in a process that is part of a distributed job: one with an initialized
``torch.distributed`` process group, or launched as one rank of a job (torchrun's and SLURM's
environment: ``TORCHELASTIC_RUN_ID``, ``WORLD_SIZE`` above 1, ``SLURM_NTASKS`` above 1). There,
``trust_versions=True`` hashes every file, and says so once in the log.

The proof is made per file and falls back to hashing whenever any part of it is missing:
another process (nothing recorded), a new tensor object, another storage object, a view, an
inference-mode tensor (no counter), shared memory, a tensor subclass, a changed header.

No reference to the tensor object itself is kept (a weak reference would make
``torch.utils.swap_tensors``, and ``load_state_dict`` under
``torch.__future__.set_swap_module_params_on_conversion(True)``, refuse the parameter). A
tensor is recognised instead by a mark, a process-unique integer stored in its ``__dict__``
when it is first proved (an ``int``, so ``torch.save`` and ``weights_only`` loads of the tensor
are unaffected), together with its ``id``, its C++ tensor's address and its storage object
(held weakly). Addresses are reused once an object is freed, so a new object at the same
address, such as ``param.data`` made anew for each save, has no mark and is hashed; a copy
that carries the mark (``copy.deepcopy``, pickling) has another storage; ``swap_tensors``
swaps the marks with the rest of the objects' state.

What is recorded is only a fact about bytes: "this header and these tensors, at these versions,
have this digest". It holds whatever became of the save that computed it, so it is recorded as
soon as the digest is known; the base checkpoint's manifest and the file's presence on disk are
checked by the save itself, as for a hashed proof.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["KNOWN", "KnownDigests", "TensorVersions", "capture"]

Key = tuple[str, str, str]  # (store root, tier, path of the file in the checkpoint)

logger = logging.getLogger("shardkeep")
_told_distributed = False

#: The ``__dict__`` key of a proved tensor's mark, and where marks come from.
_MARK = "_shardkeep_version_mark"
_marks = itertools.count(1)


@dataclass(frozen=True)
class _Seen:
    """One tensor as it was when its bytes were read."""

    mark: int  # the tensor's own mark (``_MARK`` in its ``__dict__``)
    tensor_id: int
    impl: int  # the address of the C++ tensor behind the Python object (``_cdata``)
    storage: weakref.ref[Any]
    version: int
    data_ptr: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: Any

    def holds(self, tensor: Any) -> bool:
        if id(tensor) != self.tensor_id or self.storage() is None:
            return False
        if getattr(tensor, "__dict__", {}).get(_MARK) != self.mark:
            return False  # another object at a reused address
        try:
            return (
                tensor._cdata == self.impl
                and tensor._version == self.version
                and self.storage() is tensor.untyped_storage()
                and tensor.data_ptr() == self.data_ptr
                and tensor.storage_offset() == 0
                and tuple(tensor.shape) == self.shape
                and tuple(tensor.stride()) == self.stride
                and tensor.dtype == self.dtype
            )
        except (RuntimeError, TypeError):
            return False


#: The tensors of one file, as they were when its bytes were read (``None`` where no proof can
#: be made for one of them).
TensorVersions = tuple[_Seen, ...] | None


def capture(arrays: Sequence[Any]) -> TensorVersions:
    """The version proof of ``arrays`` as they are now, taken before their bytes are read."""
    import torch

    if _in_distributed_job():
        return None
    seen = []
    for array in arrays:
        tensor: Any = array
        plain = type(tensor) is torch.Tensor or type(tensor) is torch.nn.Parameter
        if not plain:
            return None  # a subclass may keep its bytes elsewhere
        if tensor.is_inference() or tensor.device.type != "cpu" or tensor.is_shared():
            return None  # no counter; or bytes another process or device may change unseen
        try:
            storage = tensor.untyped_storage()
            if tensor.storage_offset() != 0 or storage.nbytes() != tensor.nbytes:
                return None  # a view into a larger buffer, which other tensors may write unseen
            mark = tensor.__dict__.get(_MARK)
            if type(mark) is not int:
                mark = tensor.__dict__[_MARK] = next(_marks)
            seen.append(
                _Seen(
                    mark=mark,
                    tensor_id=id(tensor),
                    impl=tensor._cdata,
                    storage=weakref.ref(storage),
                    version=tensor._version,
                    data_ptr=tensor.data_ptr(),
                    shape=tuple(tensor.shape),
                    stride=tuple(tensor.stride()),
                    dtype=tensor.dtype,
                )
            )
        except (RuntimeError, TypeError, AttributeError):
            return None
    _watch_optimizers()
    return tuple(seen)


class KnownDigests:
    """Per process: for each file (by store root, tier and path in the checkpoint), the digest of
    the last bytes written or proved there, with the header and the tensors they came from.
    One entry per file path, so it holds as many entries as a checkpoint has files."""

    def __init__(self) -> None:
        self._entries: dict[Key, tuple[bytes, tuple[_Seen, ...], str]] = {}
        #: The keys whose tensors' storage starts at each address (a superset: a stale key only
        #: costs a record dropped for nothing).
        self._by_storage: dict[int, set[Key]] = {}
        self._lock = threading.Lock()
        self._min_prune = self._prune_at = 1024

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, key: Key, header: bytes, versions: TensorVersions, digest: str) -> None:
        with self._lock:
            if versions is None:
                self._entries.pop(key, None)
                return
            self._entries[key] = (header, versions, digest)
            for seen in versions:
                self._by_storage.setdefault(seen.data_ptr, set()).add(key)
            if len(self._entries) >= self._prune_at:
                self._prune()

    def _prune(self) -> None:
        """Drop the entries whose tensors are all gone: they can never prove anything again (a
        process that saves into many roots would otherwise keep them all)."""
        self._entries = {
            key: entry for key, entry in self._entries.items() if any(seen.storage() is not None for seen in entry[1])
        }
        self._by_storage = {}
        for key, (_, seen_all, _) in self._entries.items():
            for seen in seen_all:
                self._by_storage.setdefault(seen.data_ptr, set()).add(key)
        self._prune_at = max(self._min_prune, 2 * len(self._entries))

    def forget_storages(self, addresses: set[int]) -> None:
        """Drop every record involving a tensor whose storage starts at one of ``addresses``
        (bytes that may have changed without moving a version counter)."""
        with self._lock:
            for address in addresses:
                for key in self._by_storage.pop(address, ()):
                    self._entries.pop(key, None)

    def digest(self, key: Key, header: bytes, arrays: Sequence[Any]) -> str | None:
        """The digest of ``header`` then ``arrays``' bytes, if the version proof holds."""
        with self._lock:
            entry = self._entries.get(key)
        if entry is None or _in_distributed_job():
            return None
        known_header, seen, digest = entry
        if known_header != header or len(seen) != len(arrays):
            return None
        if all(item.holds(array) for item, array in zip(seen, arrays, strict=True)):
            return digest
        return None

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._by_storage.clear()


def _in_distributed_job() -> bool:
    """Whether this process is, or may be, one rank of a distributed job, where collectives
    write tensors unseen by their version counters (said once in the log)."""
    global _told_distributed
    import torch.distributed as dist

    launched = bool(os.environ.get("TORCHELASTIC_RUN_ID")) or any(
        os.environ.get(name, "1").isdigit() and int(os.environ.get(name, "1")) > 1
        for name in ("WORLD_SIZE", "SLURM_NTASKS")
    )
    if not launched and not (dist.is_available() and dist.is_initialized()):
        return False
    if not _told_distributed:
        _told_distributed = True
        logger.warning(
            "trust_versions=True proves nothing in a distributed job (collectives write tensors without moving "
            "their version counters): every file is hashed"
        )
    return True


#: The process's record (a forked child inherits it: the same objects, at the same versions).
KNOWN = KnownDigests()

_watching = threading.Lock()
_hooks: list[Any] = []


def _watch_optimizers() -> None:
    """Install, once, the global optimizer step hooks that forget what a step may write
    without moving a version counter (fused and custom kernels)."""
    global _hooks
    if _hooks:
        return
    with _watching:
        if not _hooks:
            from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

            # Before the step too: an optimizer may free each gradient as soon as it applies it,
            # and after it: a closure (LBFGS) computes the gradients inside the step.
            _hooks = [
                register_optimizer_step_pre_hook(_around_optimizer_step),
                register_optimizer_step_post_hook(_around_optimizer_step),
            ]


def _around_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """Forget every record that involves a parameter with a gradient, or its state."""
    if not len(KNOWN):
        return
    addresses: set[int] = set()
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is None:
                continue  # torch.optim leaves a parameter without a gradient, and its state, alone
            _storages_of((param, optimizer.state.get(param, {})), addresses, 0)
    KNOWN.forget_storages(addresses)


def _storages_of(value: Any, addresses: set[int], depth: int) -> None:
    """The storage addresses of every tensor in ``value`` (nested lists and dicts included)."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        if depth < 8:
            for item in value:
                _storages_of(item, addresses, depth + 1)
        return
    local = getattr(value, "_local_tensor", value)  # a DTensor's bytes are its local tensor's
    try:
        addresses.add(local.untyped_storage().data_ptr())
    except (AttributeError, RuntimeError, TypeError):
        return  # not a tensor with storage (a step count, a meta tensor)


def _after_fork_in_child() -> None:
    KNOWN._lock = threading.Lock()  # a parent thread may have held it at the fork
    global _watching
    _watching = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
