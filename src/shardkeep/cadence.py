"""Save cadence: whether a training step should be saved, as a pure function of the step, the
last save and a clock reading passed in (Orbax's ``save_interval_steps``, its continuous
checkpointing's ``minimum_interval_secs``, and ``should_save_fn``).

:class:`SavePolicy` holds the rules; they compose as a union (a step is saved when any rule
says so):

- ``every_steps`` N: the steps that are multiples of N (step 0 included);
- ``every_seconds`` T: a step at least T seconds after the last save (or, before the first
  save, after the schedule started: a fresh run does not save at once);
- ``should_save_fn``: a user function of the step.

A step at or below the last saved step is never saved again, whatever the rules say. The
decision reads no clock of its own: the caller passes ``now`` (the checkpoint manager reads
``SavePolicy.clock``, :func:`time.monotonic` unless a test passes a fake one).

This module does not import torch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shardkeep.errors import ConfigError

__all__ = ["SavePolicy", "SaveSchedule"]


@dataclass(frozen=True)
class SavePolicy:
    """When to save: every ``every_steps`` steps, every ``every_seconds`` seconds, or when
    ``should_save_fn(step)`` is true (any of them; at least one must be given).

    ``clock`` is the time source of ``every_seconds`` (seconds, monotonic); it is read by the
    caller, never by :meth:`should_save`. ``should_save_fn`` must be a pure function of the
    step; what it raises is raised as a :class:`~shardkeep.errors.ConfigError` naming it, with
    the original as its cause. With several ranks, the checkpoint manager evaluates the time and function rules on
    the coordinator only and broadcasts the answer.
    """

    every_steps: int | None = None
    every_seconds: float | None = None
    should_save_fn: Callable[[int], bool] | None = None
    clock: Callable[[], float] = field(default=time.monotonic, compare=False, repr=False)

    def __post_init__(self) -> None:
        steps = self.every_steps
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ConfigError(f"every_steps={steps!r} cannot be met: it must be an integer >= 1 (or None)")
        seconds = self.every_seconds
        if seconds is not None and not (
            isinstance(seconds, (int, float))
            and not isinstance(seconds, bool)
            and math.isfinite(seconds)
            and seconds > 0
        ):
            raise ConfigError(f"every_seconds={seconds!r} cannot be met: it must be a finite number > 0 (or None)")
        if self.should_save_fn is not None and not callable(self.should_save_fn):
            raise ConfigError(f"should_save_fn={self.should_save_fn!r} must be a callable taking the step")
        if not callable(self.clock):
            raise ConfigError(f"clock={self.clock!r} must be a callable returning seconds")
        if steps is None and seconds is None and self.should_save_fn is None:
            raise ConfigError(
                "SavePolicy() would never save: give every_steps=, every_seconds= or should_save_fn= "
                "(every_steps=1 saves every step)"
            )

    @property
    def needs_agreement(self) -> bool:
        """Whether ranks can disagree: the time and function rules read state that is per
        process (a clock, user code), so one rank must decide for all."""
        return self.every_seconds is not None or self.should_save_fn is not None

    def should_save(self, step: int, *, now: float, last_step: int | None, since: float) -> bool:
        """Whether to save ``step``. ``last_step`` is the last saved step (``None`` before the
        first save), ``since`` the clock reading at that save (or when the schedule started),
        ``now`` the clock reading now."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"step={step!r} must be an integer >= 0")
        if last_step is not None and step <= last_step:
            return False
        if self.every_steps is not None and step % self.every_steps == 0:
            return True
        if self.every_seconds is not None and now - since >= self.every_seconds:
            return True
        if self.should_save_fn is None:
            return False
        try:
            return bool(self.should_save_fn(step))
        except Exception as exc:
            raise ConfigError(f"should_save_fn raised {type(exc).__name__} at step {step}: {exc}") from exc


class SaveSchedule:
    """One process's state under a :class:`SavePolicy`: the last saved step and the clock
    reading since when the time rule counts. Not thread-safe: its owner (the checkpoint
    manager) calls it under its own lock or from the training thread only."""

    def __init__(self, policy: SavePolicy) -> None:
        if not isinstance(policy, SavePolicy):
            raise ConfigError(f"save_policy={policy!r} must be a shardkeep.SavePolicy")
        self.policy = policy
        self.last_step: int | None = None
        self.since = policy.clock()

    def due(self, step: int) -> bool:
        """Whether ``step`` should be saved now."""
        return self.policy.should_save(step, now=self.policy.clock(), last_step=self.last_step, since=self.since)

    def saved(self, step: int) -> None:
        """Record that ``step`` was saved (or restored) now: the next save counts from it."""
        self.last_step = step if self.last_step is None else max(self.last_step, step)
        self.since = self.policy.clock()
