"""The options of one save: :class:`SaveSettings`, the single source of the keyword options of
``save`` and ``async_save`` and of what ``CheckpointManager`` forwards."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import Field, dataclass, field, fields
from typing import Any

from shardkeep.config import SaveOptions
from shardkeep.distributed.coordinator import DEFAULT_TIMEOUT
from shardkeep.io import ByteBudget
from shardkeep.manifest import RunInfo, Tier
from shardkeep.storage import StoreOperations
from shardkeep.tiers import Placement

__all__ = ["SaveSettings"]

_CALL = {"scope": "call"}  # set per call (the checkpoint manager sets these itself)
_SYNC_ONLY = {"scope": "call", "async": False}  # not an option of ``async_save``
_NOT_ASYNC = {"async": False}  # a manager option, not one of ``async_save`` (whose state is a copy)


@dataclass(frozen=True, kw_only=True)
class SaveSettings:
    """Every option of a save, in one frozen object: the single source of the keyword options
    of :func:`~shardkeep.save` and :func:`~shardkeep.async_save` (a test checks their
    signatures against these fields: names, defaults and annotations), and what
    :class:`~shardkeep.CheckpointManager` holds and forwards.

    The fields come in four groups: how files are written (validated at once as a
    :class:`~shardkeep.config.SaveOptions`, :attr:`io`); what the manifest records; where
    tensors go and who signs; and the call's context. Fields marked ``scope="call"`` are
    per-save facts that the checkpoint manager sets itself (``step``, ``metrics`` ...); the
    others are what ``CheckpointManager(**options)`` accepts (:meth:`manager_options`).
    """

    # How files are written.
    digest: str = SaveOptions.digest
    byte_budget: int = SaveOptions.byte_budget
    io_threads: int = SaveOptions.io_threads
    file_size_target: int = SaveOptions.file_size_target
    compression: str | None = SaveOptions.compression
    compression_level: int = SaveOptions.compression_level
    # What the manifest records.
    model_id: str | None = None
    step: int | None = field(default=None, metadata=_CALL)
    epoch: int | None = None
    training: Mapping[str, Any] | None = None
    sharding_strategy: str | None = None
    custom_fields: Mapping[str, Any] | None = None
    metrics: Mapping[str, float | None] | None = field(default=None, metadata=_CALL)
    run: RunInfo | None = field(default=None, metadata=_CALL)
    # Where tensors go, and who signs.
    tiers: Sequence[Tier] | None = None
    placement: Placement | None = None
    incremental: bool | str | os.PathLike[str] = field(default=False, metadata=_CALL)
    trust_versions: bool = field(default=False, metadata=_NOT_ASYNC)
    signer: Any = None
    # The call's context.
    progress: bool = field(default=False, metadata=_SYNC_ONLY)
    budget: ByteBudget | None = field(default=None, metadata=_SYNC_ONLY)
    storage: StoreOperations | None = field(default=None, metadata=_CALL)
    storage_options: Mapping[str, Any] | None = field(default=None, metadata=_CALL)
    process_group: Any = field(default=None, metadata=_CALL)
    timeout: float = field(default=DEFAULT_TIMEOUT, metadata=_CALL)
    started: float | None = field(default=None, metadata=_CALL)
    #: The write options, validated (built from the first group of fields).
    io: SaveOptions = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        io = SaveOptions(
            digest=self.digest,
            byte_budget=self.byte_budget,
            io_threads=self.io_threads,
            file_size_target=self.file_size_target,
            compression=self.compression,
            compression_level=self.compression_level,
        )
        object.__setattr__(self, "io", io)

    @classmethod
    def option_fields(cls, *, for_async: bool = False) -> list[Field[Any]]:
        """The fields that are keyword options of ``save`` (or of ``async_save``), in order."""
        return [f for f in fields(cls) if f.init and (not for_async or f.metadata.get("async", True))]

    @classmethod
    def manager_options(cls) -> list[str]:
        """The names ``CheckpointManager(**options)`` accepts and forwards to every save."""
        return [f.name for f in cls.option_fields() if f.metadata.get("scope") != "call"]

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any]) -> SaveSettings:
        """The settings of a call, from its ``locals()`` (``save`` and ``async_save``)."""
        return cls(**{f.name: arguments[f.name] for f in cls.option_fields() if f.name in arguments})
