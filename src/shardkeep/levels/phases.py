"""What the phases of a restore attempt share (:mod:`shardkeep.levels.restore`,
:mod:`~shardkeep.levels.attempt`, :mod:`~shardkeep.levels.fetching`): the node layout, the
settings, one rank's outcome of a phase, and the report a restore returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from shardkeep.config import ManifestLimits
from shardkeep.integrity import SignaturePolicy
from shardkeep.levels.fingerprints import FingerprintRule
from shardkeep.levels.transfer import (
    WIRE_BLOCK_BYTES,
)

__all__ = ["NodeLayout", "Outcome", "RestoreReport", "RestoreSettings"]


class NodeLayout(Protocol):
    """Which node each rank is on (``node_of[rank]``), as :func:`levels.nodes.node_map` gives."""

    @property
    def node_of(self) -> tuple[int, ...]: ...


@dataclass
class RestoreReport:
    """What a restore did, the same on every rank.

    ``step``: the step restored. ``source``: per rank, the level it loaded from. ``healed``:
    ``(rank, file, source)`` for each file copied into a node-local directory, ``source`` being
    a shared level's name or ``"<level>@node<N>"`` for a peer node's copy. ``refused``:
    ``(step, rank, level, reason)`` for each copy of a newer step (or of this one) that could
    not be used. ``levels_read``: the levels any byte was read from. ``unreachable``: the
    levels that could not be listed, with the reason. ``not_consulted``: the shared levels whose
    copies were not read (only their step names were listed: none newer than the node-local
    step restored), with the reason. ``run_id``: the run that saved the step
    (``None`` when its manifest records none); ``metrics``: its recorded metrics.
    ``newest_local_step``: the newest step of which any node holds a directory on the first
    node-local level, as listed (``-1``: none; ``None``: unknown, some node could not be
    listed, or no node-local level)."""

    step: int
    source: dict[int, str] = field(default_factory=dict)
    healed: list[tuple[int, str, str]] = field(default_factory=list)
    refused: list[tuple[int, int, str, str]] = field(default_factory=list)
    levels_read: list[str] = field(default_factory=list)
    unreachable: dict[str, str] = field(default_factory=dict)
    not_consulted: dict[str, str] = field(default_factory=dict)
    run_id: str | None = None
    metrics: dict[str, float | None] = field(default_factory=dict)
    newest_local_step: int | None = None


@dataclass(frozen=True)
class RestoreSettings:
    signatures: SignaturePolicy
    limits: ManifestLimits | None
    block_bytes: int
    io_threads: int
    fingerprint: FingerprintRule

    @property
    def wire_bytes(self) -> int:
        """Bytes per block sent between ranks: at most ``block_bytes``, and small enough to stay
        in the CPU's cache (:data:`~shardkeep.levels.transfer.WIRE_BLOCK_BYTES`)."""
        return min(self.block_bytes, WIRE_BLOCK_BYTES)

    @property
    def fast(self) -> bool:
        """Whether data files are checked with their fast digest (where the manifest records
        one): as a load does, unless a public key asks for the cryptographic digests."""
        return self.signatures.public_key is None


@dataclass
class Outcome:
    """One rank's outcome of a phase, as gathered: ``reasons`` per level when it failed."""

    reasons: list[tuple[str, str]] = field(default_factory=list)
    payload: Any = None
