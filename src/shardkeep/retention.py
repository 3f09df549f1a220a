"""Retention: which committed checkpoints to keep, as a pure function of the checkpoints and a
policy. Nothing here touches storage; the checkpoint manager deletes what :func:`decide` says.

The rules (RELIABILITY.md rule 9 and the checkpointing requirements):

- the ``keep_last`` newest verified checkpoints are kept as *last*;
- the ``keep_best`` verified checkpoints with the best metric are kept as *best* (lower is
  better with ``mode="min"``; ties go to the newer step); 0 means none;
- the newest verified checkpoint is always kept, whatever the policy, so a run can resume;
- a checkpoint that a kept checkpoint references is kept;
- a checkpoint that fails verification is never counted as last or best; it is deleted only
  when a newer checkpoint verifies (then it is useless for resuming), and kept otherwise, so a
  human can look at it.

This module does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from shardkeep.errors import UnsupportedValueError

__all__ = ["CheckpointInfo", "RetentionDecision", "RetentionPolicy", "decide"]


@dataclass(frozen=True)
class RetentionPolicy:
    """How many last and best checkpoints to keep, and how to rank them."""

    keep_last: int = 1
    keep_best: int = 1
    metric: str = "val_loss"
    mode: Literal["min", "max"] = "min"

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_best"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UnsupportedValueError(f"{name}={value!r} must be an integer >= 0")
        if not isinstance(self.metric, str) or not self.metric:
            raise UnsupportedValueError(f"metric={self.metric!r} must be a non-empty string")
        if self.mode not in ("min", "max"):
            raise UnsupportedValueError(f"mode={self.mode!r} must be 'min' or 'max'")


@dataclass(frozen=True)
class CheckpointInfo:
    """What retention needs to know about one committed checkpoint."""

    name: str
    step: int
    metric: float | None = None
    verified: bool = True
    references: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True)
class RetentionDecision:
    """Names to keep and to delete (disjoint, together every input), and the last/best marks."""

    keep: tuple[str, ...]
    delete: tuple[str, ...]
    last: tuple[str, ...]
    best: tuple[str, ...]
    newest_verified: str | None


def _better_first(policy: RetentionPolicy, checkpoint: CheckpointInfo) -> tuple[float, int]:
    assert checkpoint.metric is not None
    score = checkpoint.metric if policy.mode == "min" else -checkpoint.metric
    return (score, -checkpoint.step)


def decide(checkpoints: list[CheckpointInfo], policy: RetentionPolicy) -> RetentionDecision:
    """Which of ``checkpoints`` to keep under ``policy`` (see the module docstring)."""
    names = [checkpoint.name for checkpoint in checkpoints]
    if len(set(names)) != len(names):
        raise UnsupportedValueError("checkpoint names passed to retention must be unique")
    by_name = {checkpoint.name: checkpoint for checkpoint in checkpoints}
    newest_first = sorted(checkpoints, key=lambda c: (-c.step, c.name))
    verified = [checkpoint for checkpoint in newest_first if checkpoint.verified]
    last = [checkpoint.name for checkpoint in verified[: policy.keep_last]]
    ranked = sorted(
        (c for c in verified if c.metric is not None and c.metric == c.metric),  # NaN never ranks
        key=lambda c: _better_first(policy, c),
    )
    best = [checkpoint.name for checkpoint in ranked[: policy.keep_best]]
    newest_verified = verified[0] if verified else None
    keep = set(last) | set(best)
    if newest_verified is not None:
        keep.add(newest_verified.name)
        keep.update(c.name for c in checkpoints if not c.verified and c.step > newest_verified.step)
    else:
        keep.update(c.name for c in checkpoints if not c.verified)
    pending = list(keep)
    while pending:
        for reference in by_name[pending.pop()].references:
            if reference in by_name and reference not in keep:
                keep.add(reference)
                pending.append(reference)
    return RetentionDecision(
        keep=tuple(c.name for c in newest_first if c.name in keep),
        delete=tuple(c.name for c in newest_first if c.name not in keep),
        last=tuple(last),
        best=tuple(best),
        newest_verified=newest_verified.name if newest_verified else None,
    )
