"""A picture of a checkpoint root: ``shardkeep ls ROOT --plot out.png``.

The metric curve comes from the newest checkpoint's ``run.history`` (every earlier save of the
run on its lineage, including the ones retention deleted) plus the checkpoints that exist now;
the kept ones are marked as *last*, *best* or the newest. A second panel shows, for each save,
how long it paused training (``timing.blocked_seconds``) against how long it took in all
(``timing.total_seconds``): for an async save, the difference ran in the background. Events
the manifests do not record (a crash, a resume on another number of ranks) can be marked on
both panels with :class:`PlotEvent`. Every label is kept inside its panel's frame.

matplotlib is optional (``pip install 'shardkeep[plot]'``) and imported only here, only when a
plot is asked for.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shardkeep.catalog import CheckpointEntry
from shardkeep.errors import ConfigError
from shardkeep.manifest import HistoryPoint, lineage
from shardkeep.retention import RetentionPolicy

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.text import Annotation

__all__ = ["PlotEvent", "PlotSummary", "plot_root"]


@dataclass(frozen=True)
class PlotEvent:
    """Something that happened to the run at ``step`` that no manifest records (a rank killed,
    a resume on another number of ranks ...): a dashed vertical line through both panels, with
    ``label`` (one or a few short lines) beside it at the top of the metric panel."""

    step: float
    label: str
    color: str = "#555555"


@dataclass(frozen=True)
class PlotSummary:
    """What :func:`plot_root` drew."""

    path: str
    saves: int
    kept: int
    blocked_seconds: float
    total_seconds: float
    events: int = 0


def _curve(entries: Sequence[CheckpointEntry], run: str | None) -> list[HistoryPoint]:
    """Every save on the newest checkpoint's lineage, then the run's other existing checkpoints
    (a newer one whose manifest is readable but whose data is damaged has a lineage too)."""
    scoped = [e for e in entries if e.manifest is not None and (run is None or e.run_id == run)]
    if not scoped:
        return []
    newest = max(scoped, key=lambda e: e.step)
    assert newest.manifest is not None
    points = {point.step: point for point in lineage(newest.manifest)}
    for entry in scoped:
        assert entry.manifest is not None
        points.setdefault(entry.step, lineage(entry.manifest)[-1])
    return [points[step] for step in sorted(points)]


def plot_root(
    entries: Sequence[CheckpointEntry],
    policy: RetentionPolicy,
    run: str | None,
    path: str | os.PathLike[str],
    *,
    title: str,
    events: Sequence[PlotEvent] = (),
) -> PlotSummary:
    """Draw the metric over steps and each save's blocking time, with ``events`` marked on both
    panels; write a PNG to ``path``."""
    target = os.fspath(path)
    if not target.lower().endswith(".png"):
        raise ConfigError(f"--plot {target!r}: the picture is a PNG file; name it *.png")
    directory = os.path.dirname(os.path.abspath(target))
    if not os.path.isdir(directory):
        raise ConfigError(f"--plot {target!r}: directory {directory!r} does not exist")
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ConfigError("--plot needs matplotlib: pip install 'shardkeep[plot]'") from exc

    points = _curve(entries, run)
    if not points:
        raise ConfigError(f"nothing to plot in {title}: no checkpoint with a readable manifest")
    existing = {entry.step: entry for entry in entries if run is None or entry.run_id == run or entry.manifest is None}
    figure = Figure(figsize=(9, 6.5), layout="constrained")
    metric_axes, time_axes = figure.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    labels: list[tuple[Axes, Annotation]] = []

    measured = [(p.step, p.metrics.get(policy.metric)) for p in points]
    curve = [(step, value) for step, value in measured if value is not None]
    if curve:
        metric_axes.plot(*zip(*curve, strict=True), color="#4c72b0", linewidth=1.5, zorder=1, label=policy.metric)
    deleted = [(s, v) for s, v in curve if s not in existing]
    if deleted:
        metric_axes.scatter(*zip(*deleted, strict=True), s=14, color="#9a9a9a", zorder=2, label="deleted by retention")
    labels.extend(_mark_checkpoints(metric_axes, curve, existing, policy))
    labels.extend(_mark_events(metric_axes, time_axes, events))
    metric_axes.set_ylabel(policy.metric)
    metric_axes.set_title(title, fontsize=10)
    metric_axes.grid(alpha=0.3)
    if curve:
        values = [value for _, value in curve]
        spread = (max(values) - min(values)) or abs(max(values)) or 1.0
        metric_axes.set_ylim(min(values) - 0.12 * spread, max(values) + 0.12 * spread)

    timed = [(p.step, p.timing) for p in points if p.timing is not None]
    steps = [step for step, _ in timed]
    width = 0.6 * min((b - a for a, b in itertools.pairwise(steps)), default=1)
    drawn = [step for step, _ in measured] + [event.step for event in events]
    low, high = min(drawn), max(drawn)
    margin = max(0.06 * (high - low), 0.8 * width)  # room for the outermost bars and markers
    metric_axes.set_xlim(low - margin, high + margin)
    total = [timing.total_seconds for _, timing in timed]
    blocked = [timing.blocked_seconds for _, timing in timed]
    if timed:
        time_axes.bar(steps, total, width=width, color="#c6d4e8", label="whole save (background for async)")
        time_axes.bar(steps, blocked, width=width, color="#c44e52", label="training blocked")
    time_axes.set_xlabel("step")
    time_axes.set_ylabel("seconds")
    time_axes.set_title("time each save took, and how much of it blocked training", fontsize=9)
    time_axes.grid(alpha=0.3, axis="y")
    if timed:
        time_axes.legend(fontsize=8, loc="upper right" if not events else "best")
    if metric_axes.get_legend_handles_labels()[0]:
        metric_axes.legend(fontsize=8, loc="upper right" if not events else "best")
    else:
        metric_axes.text(0.5, 0.5, f"no {policy.metric!r} recorded", transform=metric_axes.transAxes, ha="center")
    _keep_inside(figure, labels)
    try:
        figure.savefig(target, dpi=110, format="png")
    except OSError as exc:
        raise ConfigError(f"--plot {target!r}: cannot write the picture: {exc}") from exc
    return PlotSummary(
        path=target,
        saves=len(points),
        kept=sum(1 for step, _ in measured if step in existing),
        blocked_seconds=sum(blocked),
        total_seconds=sum(total),
        events=len(events),
    )


def _mark_checkpoints(
    metric_axes: Axes,
    curve: Sequence[tuple[int, float]],
    existing: Mapping[int, CheckpointEntry],
    policy: RetentionPolicy,
) -> list[tuple[Axes, Annotation]]:
    """Mark each present checkpoint on the metric curve by what retention keeps it for, and
    label the last and the best; return the labels."""
    labels: list[tuple[Axes, Annotation]] = []
    groups: dict[str, list[tuple[int, float]]] = {"best": [], "last": [], "newest": [], "corrupt": [], "kept": []}
    for step, value in curve:
        entry = existing.get(step)
        if entry is None:
            continue
        if entry.verified is False:
            groups["corrupt"].append((step, value))
        elif entry.is_best:
            groups["best"].append((step, value))
        elif entry.is_last:
            groups["last"].append((step, value))
        elif entry.is_newest:
            groups["newest"].append((step, value))
        else:
            groups["kept"].append((step, value))
    styles: dict[str, dict[str, Any]] = {
        "best": {"marker": "*", "s": 260, "color": "#dd8452", "label": f"kept: best ({policy.mode} {policy.metric})"},
        "last": {"marker": "o", "s": 90, "color": "#55a868", "label": "kept: last"},
        "newest": {"marker": "D", "s": 70, "color": "#8172b3", "label": "kept: newest (resume point)"},
        "corrupt": {"marker": "X", "s": 110, "color": "#c44e52", "label": "fails a check"},
        "kept": {"marker": "s", "s": 60, "color": "#937860", "label": "present (other)"},
    }
    for name, found in groups.items():
        if found:
            metric_axes.scatter(*zip(*found, strict=True), zorder=3, edgecolors="black", linewidths=0.6, **styles[name])
    for step, value in curve:
        entry = existing.get(step)
        if entry is not None and (entry.is_last or entry.is_best):
            marks = "+".join(mark for mark, on in (("last", entry.is_last), ("best", entry.is_best)) if on)
            note = metric_axes.annotate(
                f"{entry.name}\n{marks}",
                (step, value),
                textcoords="offset points",
                xytext=(6, 8),
                multialignment="left",
                fontsize=7,
            )
            labels.append((metric_axes, note))
    return labels


def _mark_events(metric_axes: Axes, time_axes: Axes, events: Sequence[PlotEvent]) -> list[tuple[Axes, Annotation]]:
    """Draw each event as a dashed line on both panels, labelled on the metric panel; return the labels."""
    labels: list[tuple[Axes, Annotation]] = []
    for index, event in enumerate(sorted(events, key=lambda e: e.step)):
        for axes in (metric_axes, time_axes):
            axes.axvline(event.step, color=event.color, linestyle="--", linewidth=1.1, zorder=0.5)
        # Staggered down from the top so that two events close together do not overlap.
        note = metric_axes.annotate(
            event.label,
            (event.step, 1.0),
            xycoords=("data", "axes fraction"),
            textcoords="offset points",
            xytext=(5, -6 - 26 * (index % 3)),
            va="top",
            multialignment="left",
            fontsize=7.5,
            color="#222222",
            bbox={"boxstyle": "round,pad=0.25", "facecolor": "white", "edgecolor": event.color, "alpha": 0.9},
            zorder=4,
        )
        labels.append((metric_axes, note))
    return labels


def _keep_inside(figure: Figure, labels: Sequence[tuple[Axes, Annotation]]) -> None:
    """Move every label that sticks out of its panel's frame back inside: first to the other
    side of the point it labels, then, if it still sticks out, by the amount it does. Labels
    take no part in the figure's layout, so the frames do not move after this."""
    if not labels:
        return
    for _, note in labels:
        note.set_in_layout(False)
    points_per_pixel = 72.0 / figure.dpi

    def overshoot(axes: Axes, note: Annotation) -> tuple[float, float]:
        """Pixels to move ``note`` by (x, y) to bring it inside ``axes``."""
        frame, box = axes.get_window_extent(), note.get_window_extent()
        dx = min(0.0, frame.x1 - box.x1) or max(0.0, frame.x0 - box.x0)
        dy = min(0.0, frame.y1 - box.y1) or max(0.0, frame.y0 - box.y0)
        return dx, dy

    figure.draw_without_rendering()
    for axes, note in labels:
        dx, dy = overshoot(axes, note)
        x, y = note.xyann
        if dx:
            note.xyann = (-x, y)
            note.set_horizontalalignment("right" if dx < 0 else "left")
        if dy and note.get_verticalalignment() == "baseline":
            note.xyann = (note.xyann[0], -y)
            note.set_verticalalignment("top" if dy < 0 else "bottom")
    figure.draw_without_rendering()
    for axes, note in labels:
        dx, dy = overshoot(axes, note)
        if dx or dy:
            x, y = note.xyann
            note.xyann = (x + dx * points_per_pixel, y + dy * points_per_pixel)
