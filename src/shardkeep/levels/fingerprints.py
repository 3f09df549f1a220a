"""The model args and config of a ``MultiLevelManager``'s steps, checked at restore.

Every save of a :class:`~shardkeep.levels.manager.MultiLevelManager` records in
``manifest.run`` the fingerprint a :class:`~shardkeep.manager.CheckpointManager` save records:
the digest and the flattened fields of a ``TrainingCheckpoint``'s ``model_args`` and
``config``, or of the manager's ``fingerprint=`` mapping for a plain-mapping state
(:func:`run_fingerprint`). A drained copy carries the node-local manifest, so every copy of a
step records the same fingerprint.

At restore (:func:`agree_fingerprint_check`, one all-gather before the restore's own
collectives), every rank offers its fingerprint of ``into`` and whether it checks at all; the
leader of each node lists the manifests of its node-local level, the coordinator those of the
shared levels. The ranks must agree (the same ``allow_fingerprint_change``, the same fingerprint
or none on every rank): a disagreement is a :class:`~shardkeep.errors.ConfigError` on every
rank. Then every rank derives the same verdict from the same listing, as
``CheckpointManager.restore`` decides: the steps are tried newest first, and the first whose
recorded fingerprint differs ends the restore with a
:class:`~shardkeep.errors.FingerprintMismatchError` (no fall back to an older step). So when
the newest step any level holds differs, the restore raises at once; when a newer step
matches, the restore runs over the steps newer than the newest differing one only (its
``floor``), and raises for that step if none of them can be completed. A step recording no
fingerprint is not checked (as ``CheckpointManager`` does).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardkeep.config import ManifestLimits
from shardkeep.distributed.coordinator import Coordinator
from shardkeep.errors import ConfigError, FingerprintMismatchError, ShardkeepError
from shardkeep.levels.copies import LevelView, shared_store
from shardkeep.names import step_of_name
from shardkeep.storage import ByteStore, LocalStore
from shardkeep.training import TrainingCheckpoint, fingerprint_differences, fingerprint_fields, fingerprint_of
from shardkeep.verification import CheckpointLocation, parse_manifest, read_manifest_bytes

__all__ = ["FingerprintCheck", "agree_fingerprint_check", "fingerprint_source", "run_fingerprint"]

#: One step's record in a listing: ``(step, level, recorded fingerprint, recorded fields)``; the
#: fields only when the fingerprint differs from the lister's (else ``None``).
_Record = tuple[int, str, str | None, dict[str, Any] | None]


def fingerprint_source(state: Any, fallback: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """What a save of ``state`` (or a restore into it) fingerprints: a ``TrainingCheckpoint``'s
    model args and config, else the manager's ``fingerprint=`` (``None``: nothing)."""
    return state.fingerprint_source() if isinstance(state, TrainingCheckpoint) else fallback


def run_fingerprint(source: Mapping[str, Any] | None) -> tuple[str | None, dict[str, Any]]:
    """The fingerprint and the fields a manifest records for ``source`` (as a
    ``CheckpointManager`` save does): ``(None, {})`` without one."""
    if source is None:
        return None, {}
    fields = fingerprint_fields(source)
    return fingerprint_of(fields), fields


@dataclass
class FingerprintCheck:
    """The verdict every rank reached: ``floor``, the newest step whose recorded fingerprint
    differs from ``into``'s, when a newer step matches (the restore reads only steps newer than
    it; ``None``: no step differs, or nothing is checked); :meth:`error` for that step."""

    floor: int | None = None
    levels: list[str] = field(default_factory=list)
    differences: list[tuple[str, str, str]] = field(default_factory=list)

    def error(self, why: str = "") -> FingerprintMismatchError:
        """The error for step ``floor``, named with the levels holding it and the fields that differ."""
        return mismatch_error(self.floor if self.floor is not None else -1, self.levels, self.differences, why)


def mismatch_error(
    step: int, levels: Sequence[str], differences: list[tuple[str, str, str]], why: str = ""
) -> FingerprintMismatchError:
    """The error :meth:`CheckpointManager.restore <shardkeep.manager.CheckpointManager.restore>`
    raises, for a step of a ``MultiLevelManager`` (its level(s) named)."""
    lines = "\n".join(f"  {name}: checkpoint {old}, now {new}" for name, old, new in differences[:50])
    more = f"\n  ... and {len(differences) - 50} more" if len(differences) > 50 else ""
    where = ("levels " if len(levels) > 1 else "level ") + ", ".join(repr(level) for level in levels)
    return FingerprintMismatchError(
        f"step {step} ({where}) was saved with different model args or config "
        f"({len(differences)} field(s) differ){why}:\n{lines}{more}\n"
        "pass allow_fingerprint_change=True to restore it anyway",
        differences,
    )


def agree_fingerprint_check(
    views: Sequence[LevelView],
    coordinator: Coordinator,
    *,
    leader: bool,
    source: Mapping[str, Any] | None,
    allowed: bool,
    limits: ManifestLimits | None = None,
) -> FingerprintCheck:
    """The fingerprint verdict of a restore, the same on every rank (one all-gather; see the
    module docstring). Raises :class:`~shardkeep.errors.FingerprintMismatchError` when the newest
    step differs, :class:`~shardkeep.errors.ConfigError` when the ranks disagree."""
    checks = not allowed and source is not None
    current, fields = run_fingerprint(source)
    listed: list[_Record] = []
    for view in views if checks else ():
        try:
            if view.node_local and leader and view.root is not None and os.path.isdir(view.root):
                listed += _records(view.name, LocalStore(view.root), current, limits)
            elif not view.node_local and view.root is not None and coordinator.is_coordinator:
                listed += _records(view.name, shared_store(view), current, limits)
        except Exception:  # any error: this rank must still reach the all-gather below
            continue  # an unreadable level: the restore names it unreachable; its steps are not checked
    offer = (allowed, current, fields if checks else {}, listed)
    gathered = coordinator.all_gather(offer, label="the fingerprints to restore with")
    _refuse_disagreement(gathered)
    if not checks:
        return FingerprintCheck()
    return _verdict([record for each in gathered for record in each[3]], fields)


def _records(level: str, store: ByteStore, current: str | None, limits: ManifestLimits | None) -> list[_Record]:
    """The fingerprint each readable manifest of ``store`` records."""
    found: list[_Record] = []
    for name, _ in store.list_dir(""):
        step = step_of_name(name)
        if step is None:
            continue
        try:
            location = CheckpointLocation(store, name)
            manifest = parse_manifest(read_manifest_bytes(location, limits), where=str(location), limits=limits)
        except ShardkeepError:
            continue  # not committed, or damaged: the restore refuses it on its own
        run = manifest.run
        recorded = run.fingerprint if run is not None else None
        differs = run is not None and recorded is not None and recorded != current
        found.append((step, level, recorded, dict(run.fingerprint_fields) if run is not None and differs else None))
    return found


def _refuse_disagreement(gathered: list[tuple[bool, str | None, dict[str, Any], list[_Record]]]) -> None:
    """A ConfigError on every rank when the ranks do not restore with the same fingerprint."""
    allowed = [each[0] for each in gathered]
    if len(set(allowed)) > 1:
        raise ConfigError(
            "the ranks disagree on allow_fingerprint_change: "
            + ", ".join(f"rank {rank}: {value}" for rank, value in enumerate(allowed))
            + "; pass the same value on every rank"
        )
    if allowed[0]:
        return
    first = gathered[0]
    for rank, each in enumerate(gathered[1:], start=1):
        if each[1] == first[1]:
            continue
        if first[1] is None or each[1] is None:
            which = 0 if first[1] is None else rank
            raise ConfigError(
                f"rank {which} restores with no model args or config to check (a plain mapping and no "
                "fingerprint=), other ranks with some: pass the same into= kind and fingerprint= on every rank"
            )
        differences = fingerprint_differences(first[2], each[2])
        names = ", ".join(name for name, _, _ in differences[:10])
        raise ConfigError(
            f"rank {rank} restores with other model args or config than rank 0 ({len(differences)} field(s) "
            f"differ: {names}): every rank must restore into the same model args and config"
        )


def _verdict(records: list[_Record], current: dict[str, Any]) -> FingerprintCheck:
    """From every level's records: raise when the newest step differs, else the floor."""
    if not records:
        return FingerprintCheck()
    newest = max(step for step, _, _, _ in records)
    differing = [record for record in records if record[3] is not None]
    if not differing:
        return FingerprintCheck()
    step = max(record[0] for record in differing)
    levels = sorted({level for s, level, _, recorded in differing if s == step})
    recorded = next(fields for s, _, _, fields in differing if s == step and fields is not None)
    check = FingerprintCheck(step, levels, fingerprint_differences(recorded, current))
    if step == newest:
        raise check.error()
    return check
