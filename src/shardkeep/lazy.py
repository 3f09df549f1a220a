"""Lazy tensors: placeholders for the tensors a partial load left out.

``load(path, select=LoadSelection(tiers={"hot"}, lazy=True))`` returns a :class:`LazyTensor` for every tensor on
another tier. Nothing of its file is read until first use: ``materialize()``, ``.tensor``, or
passing it to any torch function (``torch.matmul(x, lazy)``, ``lazy.sum()`` through
``__torch_function__``). Then the file's header and the tensor's own bytes are read and checked
against its block digests (format 2.1/1.4, :func:`shardkeep.reads.read_needs`); a tensor with
no digest of its own (small whole tensors, format 2.0/1.x, compressed files) reads its whole
file once, checked (size, digest, version, safetensors header), and every placeholder of that
file shares the result. A damaged file raises :class:`~shardkeep.errors.IntegrityError` at that
moment, naming the file.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from shardkeep.errors import IntegrityError, ShardkeepError
from shardkeep.io import DigestChoice, check_shard
from shardkeep.manifest import FileRecord
from shardkeep.reads import Need, read_needs
from shardkeep.storage.base import ByteStore
from shardkeep.tensors.convert import NAME_TO_TORCH, array_from_buffer
from shardkeep.tensors.shardfile import STALE

__all__ = ["LazyFile", "LazyTensor"]


class LazyFile:
    """One data file, read and verified at most once, on first use of any of its tensors."""

    def __init__(
        self,
        store: ByteStore,
        path: str,
        record: FileRecord,
        *,
        verify: bool,
        describe: str,
        digest: DigestChoice = "strong",
    ) -> None:
        self.store = store
        self.digest: DigestChoice = digest
        self.path = path
        self.record = record
        self.verify = verify
        self.describe = describe
        self._lock = threading.Lock()
        self._buffer: memoryview | None = None

    @property
    def loaded(self) -> bool:
        return self._buffer is not None

    def entry_bytes(self, index: int) -> tuple[memoryview, int]:
        """The bytes holding entry ``index`` and where in them it starts: its own bytes, read
        and checked by its blocks (only them), or the whole file (:meth:`buffer`) when the
        entry has no digest of its own or the file was already read."""
        with self._lock:
            whole = self._buffer
        entry = self.record.tensors[index]
        if whole is None:
            choice: DigestChoice | None = self.digest if self.verify else None
            for attempt in range(2):
                try:
                    pieces = read_needs(self.store, self.path, self.record, [Need(index, None)], choice)
                except IntegrityError as exc:
                    if attempt or not any(STALE in problem for problem in exc.problems):
                        raise IntegrityError(
                            f"lazy load of {self.describe} failed verification: " + "; ".join(exc.problems),
                            exc.problems,
                        ) from exc
                    continue
                except ShardkeepError as exc:
                    raise IntegrityError(f"lazy load of {self.describe} failed: {exc}") from exc
                if pieces is not None:
                    found = pieces.get(index)
                    return (found[0].data, -found[0].start) if found else (memoryview(b""), 0)
                break
        return self.buffer(), entry.offset

    def buffer(self) -> memoryview:
        with self._lock:
            if self._buffer is None:
                data, problems = check_shard(
                    self.store, self.path, self.record, verify=self.verify, keep=True, digest=self.digest
                )
                if problems or data is None:
                    raise IntegrityError(
                        f"lazy load of {self.describe} failed verification: " + "; ".join(problems), problems
                    )
                self._buffer = data
            return self._buffer


class LazyTensor:
    """A tensor of a tier that was not loaded; read and verified on first use (only its own
    blocks where it has them, see :meth:`LazyFile.entry_bytes`)."""

    __slots__ = ("_file", "_index", "_value")

    def __init__(self, file: LazyFile, index: int) -> None:
        self._file = file
        self._index = index
        self._value: Any = None

    @property
    def key(self) -> str:
        return self._file.record.tensors[self._index].key

    @property
    def tier(self) -> str:
        return self._file.record.tier

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._file.record.tensors[self._index].shape)

    @property
    def dtype(self) -> torch.dtype | str:
        name = self._file.record.tensors[self._index].dtype
        return NAME_TO_TORCH.get(name, name)

    @property
    def nbytes(self) -> int:
        return self._file.record.tensors[self._index].nbytes

    @property
    def loaded(self) -> bool:
        return self._value is not None

    def materialize(self) -> Any:
        """The tensor (or numpy array), reading and verifying its file the first time."""
        if self._value is None:
            entry = self._file.record.tensors[self._index]
            data, offset = self._file.entry_bytes(self._index)
            self._value = array_from_buffer(
                data, entry.dtype, entry.shape, offset, entry.nbytes, entry.array_type, entry.key
            )
        return self._value

    @property
    def tensor(self) -> Any:
        return self.materialize()

    def __repr__(self) -> str:
        state = "loaded" if self.loaded else "not loaded"
        return f"LazyTensor({self.key!r}, tier={self.tier!r}, shape={list(self.shape)}, dtype={self.dtype}, {state})"

    def __getattr__(self, name: str) -> Any:
        # Tensor methods (x.sum(), x.float() ...) act on the real tensor.
        return getattr(self.materialize(), name)

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        def real(value: Any) -> Any:
            if isinstance(value, LazyTensor):
                return value.materialize()
            if isinstance(value, (list, tuple)):
                return type(value)(real(item) for item in value)
            return value

        return func(*real(args), **{name: real(value) for name, value in (kwargs or {}).items()})
