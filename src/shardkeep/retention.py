"""Retention: which committed checkpoints to keep, as a pure function of the checkpoints and a
policy. Nothing here touches storage (the checkpoint manager deletes what :func:`decide` says);
:func:`load_config_file` reads a policy from a run's YAML config, as :func:`policy_from_config`
builds it from a mapping.

The rules:

- the ``keep_last`` newest verified checkpoints are kept as *last*;
- the ``keep_best`` verified checkpoints with the best metric are kept as *best* (lower is
  better with ``mode="min"``). A tie goes to the older step: *best* changes only when the
  metric strictly improves. A checkpoint without the metric (or with NaN) ranks below every
  checkpoint that has it, older first, so the first checkpoint of a run, saved right after
  model init and before any validation, is *best* until a measured one exists. 0 means none;
- with ``keep_period`` K, every verified checkpoint whose step is a multiple of K is kept as
  *periodic*, forever (Orbax's ``keep_period``; steps that are not multiples never count);
- with ``keep_interval_seconds`` T, time is cut into windows ``[n*T, (n+1)*T)`` of POSIX
  seconds, aligned to the Unix epoch (so 86400 keeps one checkpoint per UTC day), and in each
  window the verified checkpoint created last (ties: the higher step) is kept as *per
  interval*. The newest window's choice moves forward as newer checkpoints are saved in it. A
  checkpoint without a creation time is in no window;
- with ``keep_fn``, every verified checkpoint for which ``keep_fn(info)`` is true is kept as
  *chosen*. It must be a pure function of its :class:`CheckpointInfo`; what it raises is raised
  as a :class:`~shardkeep.errors.ConfigError` naming ``keep_fn`` and the checkpoint, with the
  original as its cause;
- these rules compose as a union: a checkpoint is kept when any of them keeps it;
- the newest verified checkpoint is always kept, whatever the policy, so a run can resume;
- a checkpoint that a kept checkpoint references is kept;
- a checkpoint that fails verification is never counted as last or best; it is deleted only
  when a newer checkpoint verifies (then it is useless for resuming), and kept otherwise, so a
  human can look at it;
- a checkpoint whose state is unknown (``verified=None``: a tier's location is missing or
  cannot be read, so nothing proves it sound or broken) is never last, best or newest, and
  never deleted.

This module does not import torch.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from shardkeep.errors import ConfigError, UnsafePathError, UnsupportedValueError
from shardkeep.integrity import read_regular_file

__all__ = [
    "CONFIG_FILE_LIMIT",
    "CheckpointInfo",
    "RetentionDecision",
    "RetentionPolicy",
    "decide",
    "load_config_file",
    "policy_from_config",
]


@dataclass(frozen=True)
class CheckpointInfo:
    """What retention needs to know about one committed checkpoint."""

    name: str
    step: int
    metric: float | None = None
    #: ``True`` sound, ``False`` a check failed, ``None`` unknown (part of it cannot be seen).
    verified: bool | None = True
    references: frozenset[str] = field(default_factory=frozenset)
    #: When it was created, in POSIX seconds (the manifest's ``created_at``); ``None`` unknown.
    created: float | None = None


@dataclass(frozen=True)
class RetentionPolicy:
    """Which checkpoints to keep: the last and best (ranked by ``metric`` and ``mode``), every
    ``keep_period``-th step, one per ``keep_interval_seconds`` window, and those ``keep_fn``
    chooses (see the module docstring). ``None`` turns a rule off."""

    keep_last: int = 1
    keep_best: int = 1
    metric: str = "val_loss"
    mode: Literal["min", "max"] = "min"
    keep_period: int | None = None
    keep_interval_seconds: float | None = None
    keep_fn: Callable[[CheckpointInfo], bool] | None = None

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_best"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name}={value!r} must be an integer >= 0")
        if not isinstance(self.metric, str) or not self.metric:
            raise ConfigError(f"metric={self.metric!r} must be a non-empty string")
        if self.mode not in ("min", "max"):
            raise ConfigError(f"mode={self.mode!r} must be 'min' or 'max'")
        period = self.keep_period
        if period is not None and (isinstance(period, bool) or not isinstance(period, int) or period < 1):
            raise ConfigError(f"keep_period={period!r} must be an integer >= 1 (or None)")
        interval = self.keep_interval_seconds
        if interval is not None and not _positive_seconds(interval):
            raise ConfigError(f"keep_interval_seconds={interval!r} must be a finite number of seconds > 0 (or None)")
        if self.keep_fn is not None and not callable(self.keep_fn):
            raise ConfigError(f"keep_fn={self.keep_fn!r} must be a callable taking a CheckpointInfo (or None)")


def _positive_seconds(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


@dataclass(frozen=True)
class RetentionDecision:
    """Names to keep and to delete (disjoint, together every input), and the marks of each rule
    (``periodic``, ``per_interval`` and ``chosen`` are empty when their rule is off)."""

    keep: tuple[str, ...]
    delete: tuple[str, ...]
    last: tuple[str, ...]
    best: tuple[str, ...]
    newest_verified: str | None
    periodic: tuple[str, ...] = ()
    per_interval: tuple[str, ...] = ()
    chosen: tuple[str, ...] = ()


def _better_first(policy: RetentionPolicy, checkpoint: CheckpointInfo) -> tuple[int, float, int]:
    metric = checkpoint.metric
    if metric is None or math.isnan(metric):
        return (1, 0.0, checkpoint.step)
    return (0, metric if policy.mode == "min" else -metric, checkpoint.step)


def decide(checkpoints: list[CheckpointInfo], policy: RetentionPolicy) -> RetentionDecision:
    """Which of ``checkpoints`` to keep under ``policy`` (see the module docstring)."""
    names = [checkpoint.name for checkpoint in checkpoints]
    if len(set(names)) != len(names):
        raise UnsupportedValueError("checkpoint names passed to retention must be unique")
    by_name = {checkpoint.name: checkpoint for checkpoint in checkpoints}
    newest_first = sorted(checkpoints, key=lambda c: (-c.step, c.name))
    verified = [checkpoint for checkpoint in newest_first if checkpoint.verified is True]
    last = [checkpoint.name for checkpoint in verified[: policy.keep_last]]
    ranked = sorted(verified, key=lambda c: _better_first(policy, c))
    best = [checkpoint.name for checkpoint in ranked[: policy.keep_best]]
    periodic, per_interval, chosen = _kept_by_schedule(verified, policy)
    newest_verified = verified[0] if verified else None
    keep = set(last) | set(best) | set(periodic) | set(per_interval) | set(chosen)
    keep |= {c.name for c in checkpoints if c.verified is None}
    if newest_verified is not None:
        keep.add(newest_verified.name)
        keep.update(c.name for c in checkpoints if c.verified is False and c.step > newest_verified.step)
    else:
        keep.update(c.name for c in checkpoints if c.verified is False)
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
        periodic=tuple(periodic),
        per_interval=tuple(per_interval),
        chosen=tuple(chosen),
    )


def _kept_by_schedule(
    verified: list[CheckpointInfo], policy: RetentionPolicy
) -> tuple[list[str], list[str], list[str]]:
    """The names ``keep_period``, ``keep_interval_seconds`` and ``keep_fn`` keep among the
    ``verified`` checkpoints (given newest first), each newest first."""
    period, interval = policy.keep_period, policy.keep_interval_seconds
    periodic = [c.name for c in verified if period is not None and c.step % period == 0]
    newest_in_window: dict[int, CheckpointInfo] = {}
    for checkpoint in verified:
        window = _window(checkpoint, interval)
        held = newest_in_window.get(window) if window is not None else None
        if window is not None and (held is None or _created_order(checkpoint) > _created_order(held)):
            newest_in_window[window] = checkpoint
    in_a_window = {checkpoint.name for checkpoint in newest_in_window.values()}
    per_interval = [c.name for c in verified if c.name in in_a_window]
    chosen = [c.name for c in verified if policy.keep_fn is not None and _chosen(policy.keep_fn, c)]
    return periodic, per_interval, chosen


def _chosen(keep_fn: Callable[[CheckpointInfo], bool], checkpoint: CheckpointInfo) -> bool:
    try:
        return bool(keep_fn(checkpoint))
    except Exception as exc:
        raise ConfigError(f"keep_fn raised {type(exc).__name__} on {checkpoint.name}: {exc}") from exc


def _created_order(checkpoint: CheckpointInfo) -> tuple[float, int]:
    return (checkpoint.created if checkpoint.created is not None else -math.inf, checkpoint.step)


def _window(checkpoint: CheckpointInfo, interval: float | None) -> int | None:
    if interval is None or checkpoint.created is None or not math.isfinite(checkpoint.created):
        return None
    return math.floor(checkpoint.created / interval)


_SECTION_KEYS = ("keep", "metric", "mode")
_KEEP_KEYS = ("last", "best", "period", "interval_seconds")


def policy_from_config(config: Mapping[str, Any], *, where: str = "checkpointing") -> RetentionPolicy:
    """A policy from a mapping shaped like a training config's ``checkpointing`` section
    (``RuntimeConfig.checkpointing``).

    ``{"keep": {"last": N, "best": M, "period": K, "interval_seconds": T}, "metric": "val_loss",
    "mode": "min"}``; every key is optional (defaults 1, 1, off, off, ``val_loss``, ``min``;
    ``period`` and ``interval_seconds`` may be ``null`` for off). ``keep_fn`` is a Python
    function and cannot come from a config. Validation is strict: counts are integers >= 0
    (not booleans, floats or strings), ``period`` an integer >= 1, ``interval_seconds`` a
    number > 0, unknown keys are refused, and each error names the dotted key and the bad
    value. There are no legacy spellings and no fallbacks.
    """
    if not isinstance(config, Mapping):
        raise ConfigError(f"{where} must be a mapping, got {type(config).__name__}")
    _refuse_unknown(config, _SECTION_KEYS, where)
    keep = config.get("keep", {})
    if not isinstance(keep, Mapping):
        raise ConfigError(f"{where}.keep must be a mapping with 'last' and/or 'best', got {keep!r}")
    _refuse_unknown(keep, _KEEP_KEYS, f"{where}.keep")
    counts = {}
    for name in ("last", "best"):
        value = keep.get(name, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{where}.keep.{name}={value!r}: must be an integer >= 0")
        counts[name] = value
    period = keep.get("period")
    if period is not None and (isinstance(period, bool) or not isinstance(period, int) or period < 1):
        raise ConfigError(f"{where}.keep.period={period!r}: must be an integer >= 1 (or null for off)")
    interval = keep.get("interval_seconds")
    if interval is not None and not _positive_seconds(interval):
        raise ConfigError(f"{where}.keep.interval_seconds={interval!r}: must be a number of seconds > 0 (or null)")
    metric = config.get("metric", "val_loss")
    if not isinstance(metric, str) or not metric:
        raise ConfigError(f"{where}.metric={metric!r}: must be a non-empty string")
    mode = config.get("mode", "min")
    if mode not in ("min", "max"):
        raise ConfigError(f"{where}.mode={mode!r}: must be 'min' or 'max'")
    return RetentionPolicy(
        keep_last=counts["last"],
        keep_best=counts["best"],
        metric=metric,
        mode=mode,
        keep_period=period,
        keep_interval_seconds=interval,
    )


def _refuse_unknown(mapping: Mapping[str, Any], known: tuple[str, ...], where: str) -> None:
    for key in mapping:
        if key not in known:
            raise ConfigError(
                f"{where}.{key}: unknown key (value {mapping[key]!r}); expected one of: {', '.join(known)}"
            )


#: The largest config file read (a run's whole YAML config is a few kilobytes).
CONFIG_FILE_LIMIT = 4 << 20


def load_config_file(path: str | os.PathLike[str]) -> RetentionPolicy:
    """A retention policy from a YAML file: either the ``checkpointing`` section itself, or a
    ``RuntimeConfig`` file with a top-level ``checkpointing:`` key (other keys belong to the
    rest of the run's config and are not read). Duplicate keys are refused."""
    import yaml

    class _StrictLoader(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML ships no type stubs
        pass

    def construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        mapping: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError as exc:  # a YAML "? [a, b]" key, which no dict can hold
                raise ConfigError(
                    f"{os.fspath(path)}: a key must be a plain value, got {type(key).__name__} "
                    f"(line {key_node.start_mark.line + 1})"
                ) from exc
            if key in mapping:
                raise ConfigError(f"{os.fspath(path)}: duplicate key {key!r} (line {key_node.start_mark.line + 1})")
            mapping[key] = loader.construct_object(value_node, deep=deep)
        return mapping

    _StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    try:
        # A bounded regular file: a FIFO or device never blocks, a huge file is refused.
        text = read_regular_file(path, limit=CONFIG_FILE_LIMIT, follow_symlinks=True).decode("utf-8")
        document = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass
    except UnsafePathError as exc:
        raise ConfigError(f"config file {os.fspath(path)!r} {exc}") from exc
    except OSError as exc:
        raise ConfigError(f"cannot read config file {os.fspath(path)!r}: {exc.strerror}") from exc
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError) as exc:
        raise ConfigError(f"{os.fspath(path)}: invalid YAML: {exc}") from exc
    if document is None:
        document = {}
    if isinstance(document, Mapping) and "checkpointing" in document:
        return policy_from_config(document["checkpointing"])
    if not isinstance(document, Mapping):
        raise ConfigError(f"{os.fspath(path)}: the config must be a mapping, got {type(document).__name__}")
    return policy_from_config(document)
