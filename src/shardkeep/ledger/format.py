"""The ledger's file format: the msgspec structs of schema version 2.0, their exact bytes with a
self-checksum, and the checks a copy must pass before it is believed. Imports without torch.

A ledger file is the JSON of :class:`LedgerState` with ``checksum`` and ``sequence`` first.
``checksum`` is ``blake3:`` over the file's exact bytes with its own 64 hex digits zeroed, so a
torn write, a bit flip or a hand edit makes the copy invalid. ``sequence`` increases by one with
every write; recovery believes the valid copy with the highest one.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Annotated, Literal

import msgspec

from shardkeep.errors import LedgerError
from shardkeep.integrity import digest_bytes, digests_equal

__all__ = [
    "LEDGER_VERSION",
    "BatchRecord",
    "GlobalCheckpoint",
    "LedgerState",
    "Reassignment",
    "ShardEntry",
    "UnsupportedLedgerVersionError",
    "checked_sequence",
    "claimed_sequence",
    "claimed_version",
    "decode_state",
    "encode_state",
    "timestamp_now",
]

LEDGER_VERSION = "2.0"

Status = Literal["in_progress", "complete", "failed"]
Timestamp = Annotated[datetime, msgspec.Meta(tz=True)]
_CHECKSUM_ALGORITHM = "blake3"
_CHECKSUM_HEAD = re.compile(rb'\A\{\s*"checksum"\s*:\s*"blake3:([0-9a-f]{64})"\s*,\s*"sequence"\s*:\s*(\d{1,19})\s*,')
_PLACEHOLDER = "blake3:" + "0" * 64


class BatchRecord(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One recorded batch: its index, size, file (relative to the checkpoint directory) and time."""

    batch_idx: int
    num_sequences: int
    file: str
    timestamp: Timestamp
    sequence_range: str | None = None
    removed_at: Timestamp | None = None


class Reassignment(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A shard moved from one worker to another."""

    from_rank: int
    to_rank: int
    timestamp: Timestamp


class ShardEntry(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Progress of one shard. ``original_rank`` never changes; ``assigned_rank`` is the worker that
    processes it now."""

    status: Status
    original_rank: int
    assigned_rank: int
    last_checkpoint_batch: int = -1
    total_sequences: int = 0
    last_checkpoint_time: Timestamp | None = None
    retry_count: int = 0
    error: str | None = None
    checkpoints: list[BatchRecord] = msgspec.field(default_factory=list)
    completed_at: Timestamp | None = None
    failed_at: Timestamp | None = None
    reassignments: list[Reassignment] = msgspec.field(default_factory=list)
    claim: int = 0
    claimed_at: Timestamp | None = None


class GlobalCheckpoint(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A barrier: every listed shard had recorded at least the given batch."""

    checkpoint_id: str
    timestamp: Timestamp
    batch_boundaries: dict[str, int]


class LedgerState(msgspec.Struct, kw_only=True):
    """The whole ledger. ``checksum`` and ``sequence`` come first in the file."""

    checksum: str
    sequence: int
    version: str
    world_size: int
    created_at: Timestamp
    updated_at: Timestamp
    input_fingerprint: str = ""
    model_config_hash: str = ""
    global_checkpoints: list[GlobalCheckpoint] = msgspec.field(default_factory=list)
    shards: dict[str, ShardEntry] = msgspec.field(default_factory=dict)


class UnsupportedLedgerVersionError(LedgerError):
    """A checksum-valid ledger of another schema version than this shardkeep reads: never
    replaced by an older copy."""


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(LedgerState, strict=True)


def timestamp_now(clock: Callable[[], float]) -> datetime:
    """The time ``clock`` (seconds since the epoch) tells, as a UTC timestamp of the format."""
    return datetime.fromtimestamp(clock(), tz=UTC)


def encode_state(state: LedgerState) -> bytes:
    """The exact bytes of ``state`` as a ledger file, with ``state.checksum`` filled in."""
    state.checksum = _PLACEHOLDER
    raw = bytearray(_ENCODER.encode(state))
    raw += b"\n"
    match = _CHECKSUM_HEAD.match(raw)
    if match is None:  # pragma: no cover - the encoder puts checksum and sequence first
        raise LedgerError("ledger encoding lost its checksum header")
    digest = digest_bytes(_CHECKSUM_ALGORITHM, memoryview(raw))
    hex_digits = digest.split(":", 1)[1].encode()
    raw[match.start(1) : match.end(1)] = hex_digits
    state.checksum = digest
    return bytes(raw)


def claimed_sequence(raw: bytes) -> int | None:
    """The sequence number a file's header claims, before its checksum is checked; ``None``
    when it has no checksum header (torn, empty or not a ledger file)."""
    match = _CHECKSUM_HEAD.match(raw)
    return None if match is None else int(match.group(2))


def checked_sequence(raw: bytes) -> int:
    """The sequence number of a ledger file whose checksum matches its bytes.

    Raises :class:`LedgerError` with the reason when the file is torn, edited or not a ledger.
    """
    match = _CHECKSUM_HEAD.match(raw)
    if match is None:
        raise LedgerError("no checksum header (torn, empty or not a ledger file)")
    recorded = match.group(1).decode()
    blanked = bytearray(raw)
    blanked[match.start(1) : match.end(1)] = b"0" * 64
    actual = digest_bytes(_CHECKSUM_ALGORITHM, memoryview(blanked)).split(":", 1)[1]
    if not digests_equal(recorded, actual):
        raise LedgerError("checksum mismatch (torn or modified file)")
    return int(match.group(2))


def decode_state(raw: bytes) -> LedgerState:
    """Decode a checksum-verified ledger file and check that it is internally consistent.

    Raises :class:`UnsupportedLedgerVersionError` for another major schema version and
    :class:`LedgerError` for anything else that does not fit the schema."""
    try:
        state = _DECODER.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise LedgerError(f"schema violation: {str(exc)[:200]}") from exc
    major = state.version.split(".", 1)[0]
    if major != LEDGER_VERSION.split(".", 1)[0]:
        raise UnsupportedLedgerVersionError(
            f"ledger schema version {state.version} is not supported (this shardkeep reads and writes "
            f"{LEDGER_VERSION}); use the shardkeep release that wrote it"
        )
    # The count first: a world_size of 10**12 must not build 10**12 names to compare with.
    if (
        state.world_size < 1
        or len(state.shards) != state.world_size
        or set(state.shards) != {str(shard) for shard in range(state.world_size)}
    ):
        raise LedgerError(f"shards {sorted(state.shards)[:10]} do not match world_size {state.world_size}")
    return state


def claimed_version(raw: bytes) -> str | None:
    """The ``version`` field of a checksum-valid file that does not fit the schema."""
    try:
        document = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return None
    version = document.get("version") if isinstance(document, dict) else None
    return version if isinstance(version, str) else None
