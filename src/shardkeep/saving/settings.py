"""The settings of one save: :class:`SaveSettings`, flat, as the save job reads them, built
from the public option groups of :mod:`shardkeep.options` by ``save``, ``async_save`` and
``CheckpointManager``."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from shardkeep.config import WriteOptions
from shardkeep.distributed.coordinator import DEFAULT_TIMEOUT
from shardkeep.manifest import RunInfo, Tier
from shardkeep.storage import StoreOperations
from shardkeep.tiers import Placement
from shardkeep.writes import ByteBudget

if TYPE_CHECKING:
    from shardkeep.options import Group, Regrouped, Signer

__all__ = ["SaveSettings"]


@dataclass(frozen=True, kw_only=True)
class SaveSettings:
    """Every setting of one save, flat, as the save job reads them.

    :func:`~shardkeep.save`, :func:`~shardkeep.async_save` and
    :class:`~shardkeep.CheckpointManager` build it with :meth:`of` from the public option groups
    (:class:`~shardkeep.config.WriteOptions`, :class:`~shardkeep.options.TierPlan`,
    :class:`~shardkeep.options.Incremental`, :class:`~shardkeep.options.ManifestFields`) and the
    other arguments of ``save``. ``run``, ``budget`` and ``started`` are set by the checkpoint
    manager (and tests) only. ``tests/test_save_settings.py`` checks that every field is
    reachable from a group or an argument.
    """

    # How files are written (WriteOptions).
    digest: str = WriteOptions.digest
    byte_budget: int = WriteOptions.byte_budget
    io_threads: int = WriteOptions.io_threads
    file_size_target: int = WriteOptions.file_size_target
    compression: str | None = WriteOptions.compression
    compression_level: int = WriteOptions.compression_level
    progress: bool = False
    storage_options: Mapping[str, Any] | None = None
    block_size: int | None = None
    # What the manifest records (ManifestFields, and the step).
    model_id: str | None = None
    step: int | None = None
    epoch: int | None = None
    training: Mapping[str, Any] | None = None
    sharding_strategy: str | None = None
    custom_fields: Mapping[str, Any] | None = None
    metrics: Mapping[str, float | None] | None = None
    # Where tensors go (TierPlan), what an incremental save compares against (Incremental), who signs.
    tiers: Sequence[Tier] | None = None
    placement: Placement | None = None
    incremental: bool | str | os.PathLike[str] = False
    trust_versions: bool = False
    signer: Signer | None = None
    # The call's context.
    storage: StoreOperations | None = None
    process_group: Group | None = None
    timeout: float = DEFAULT_TIMEOUT
    # Set by the checkpoint manager only.
    run: RunInfo | None = None
    budget: ByteBudget | None = None
    started: float | None = None
    #: The write options, validated (built from the first group of fields).
    io: WriteOptions = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        io = WriteOptions(
            digest=self.digest,
            byte_budget=self.byte_budget,
            io_threads=self.io_threads,
            file_size_target=self.file_size_target,
            compression=self.compression,
            compression_level=self.compression_level,
            progress=self.progress,
            storage_options=self.storage_options,
            block_size=self.block_size,
        )
        object.__setattr__(self, "io", io)

    @classmethod
    def of(
        cls,
        groups: Regrouped,
        *,
        step: int | None = None,
        signer: Signer | None = None,
        storage: StoreOperations | None = None,
        process_group: Group | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> SaveSettings:
        """The settings of one save, from its option groups and the other arguments of ``save``
        (and the manager-only ``run``, ``budget`` and ``started`` in ``groups.internal``)."""
        written, recorded = groups.options, groups.fields
        return cls(
            **{f.name: getattr(written, f.name) for f in fields(written)},
            **{f.name: getattr(recorded, f.name) for f in fields(recorded)},
            step=step,
            tiers=groups.tiers.tiers or None,
            placement=groups.tiers.placement,
            incremental=groups.incremental.base,
            trust_versions=groups.incremental.trust_versions,
            signer=signer,
            storage=storage,
            process_group=process_group,
            timeout=timeout,
            **{name: value for name, value in groups.internal.items() if name in ("run", "budget", "started")},
        )
