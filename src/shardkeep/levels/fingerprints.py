"""The model args and config of a ``MultiLevelManager``'s steps, checked at restore.

Every save of a :class:`~shardkeep.levels.manager.MultiLevelManager` records in
``manifest.run`` the fingerprint a :class:`~shardkeep.manager.CheckpointManager` save records:
the digest and the flattened fields of a ``TrainingCheckpoint``'s ``model_args`` and
``config``, or of the manager's ``fingerprint=`` mapping for a plain-mapping state
(:func:`run_fingerprint`). A drained copy carries the node-local manifest, so every copy of a
step records the same fingerprint.

At restore, each rank brings a :class:`FingerprintRule` (its fingerprint of ``into``, and
whether it checks at all). The check adds no collective and reads no manifest of its own: each
candidate step's manifest is parsed by every rank anyway (:mod:`~shardkeep.levels.restore`),
and the verdict and the rule ride on the agreement that ends that phase. The ranks must agree
on the rule (the same ``allow_fingerprint_change``, the same fingerprint or none on every
rank): a disagreement is a :class:`~shardkeep.errors.ConfigError` on every rank
(:func:`refuse_disagreement`). A step whose recorded fingerprint differs ends the restore with
a :class:`~shardkeep.errors.FingerprintMismatchError` on every rank, before anything is filled
into ``into``, as ``CheckpointManager.restore`` decides: the steps are tried newest first, and
there is no fall back past a differing step. A step recording no fingerprint is not checked (as
``CheckpointManager`` does). The check comes with the check of a step's files, so a newer step
whose manifest no rank can place (its metadata phase fails: no copy of it where it is needed)
is refused as incomplete without a verdict, as ``CheckpointManager`` passes over a checkpoint
whose manifest it cannot read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardkeep.errors import ConfigError, FingerprintMismatchError
from shardkeep.manifest import Manifest
from shardkeep.training import TrainingCheckpoint, fingerprint_differences, fingerprint_fields, fingerprint_of

__all__ = ["FingerprintRule", "fingerprint_source", "mismatch_error", "refuse_disagreement", "run_fingerprint"]


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


@dataclass(frozen=True)
class FingerprintRule:
    """What one rank checks a restored step against: ``fields`` and ``digest``, its fingerprint
    of ``into`` (``None``: nothing to check), and ``allowed``, ``allow_fingerprint_change``."""

    digest: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    allowed: bool = False

    @classmethod
    def of(cls, source: Mapping[str, Any] | None, allowed: bool) -> FingerprintRule:
        digest, fields = run_fingerprint(source)
        return cls(digest, fields, allowed)

    @property
    def checks(self) -> bool:
        return not self.allowed and self.digest is not None

    def differences(self, manifest: Manifest) -> list[tuple[str, str, str]] | None:
        """The fields in which ``manifest``'s recorded fingerprint differs from this rule's
        (``None``: it does not differ, records none, or nothing is checked)."""
        run = manifest.run
        if not self.checks or run is None or run.fingerprint is None or run.fingerprint == self.digest:
            return None
        return fingerprint_differences(run.fingerprint_fields, self.fields)


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


def refuse_disagreement(rules: Sequence[FingerprintRule]) -> None:
    """A ConfigError on every rank when the ranks (``rules``, in rank order, gathered) do not
    restore with the same fingerprint."""
    allowed = [rule.allowed for rule in rules]
    if len(set(allowed)) > 1:
        raise ConfigError(
            "the ranks disagree on allow_fingerprint_change: "
            + ", ".join(f"rank {rank}: {value}" for rank, value in enumerate(allowed))
            + "; pass the same value on every rank"
        )
    if allowed[0]:
        return
    first = rules[0]
    for rank, each in enumerate(rules[1:], start=1):
        if each.digest == first.digest:
            continue
        if first.digest is None or each.digest is None:
            which = 0 if first.digest is None else rank
            raise ConfigError(
                f"rank {which} restores with no model args or config to check (a plain mapping and no "
                "fingerprint=), other ranks with some: pass the same into= kind and fingerprint= on every rank"
            )
        differences = fingerprint_differences(first.fields, each.fields)
        names = ", ".join(name for name, _, _ in differences[:10])
        raise ConfigError(
            f"rank {rank} restores with other model args or config than rank 0 ({len(differences)} field(s) "
            f"differ: {names}): every rank must restore into the same model args and config"
        )
