"""Save timing and run history in the manifest (1.3), and `shardkeep ls --plot`."""

from __future__ import annotations

import io
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

import shardkeep as sk
from shardkeep.cli import main
from shardkeep.manifest import HistoryPoint, RunInfo, SaveTiming, validate_manifest

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def losses(step: int) -> dict[str, float]:
    """Improving until step 40, worse afterwards: step 40 stays the best."""
    return {"val_loss": 10.0 / (step + 1) if step <= 40 else step / 20}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Seven saves (one async) of which retention keeps three; the last one after a restore."""
    root = tmp_path / "ckpts"
    model = torch.nn.Linear(8, 8)
    manager = sk.CheckpointManager(root, keep_last=2, keep_best=1)
    for step in range(0, 50, 10):
        manager.save({"model": model}, step=step, metrics=losses(step))
    manager.async_save({"model": model}, step=50, metrics=losses(50)).result(timeout=60)
    resumed = sk.CheckpointManager(root, keep_last=2, keep_best=1)
    resumed.restore()
    resumed.save({"model": model}, step=60, metrics=losses(60))
    return root


def test_every_manifest_records_its_timing_and_the_runs_earlier_saves(root: Path) -> None:
    newest = sk.read_manifest(root / "step_00000060")
    assert newest.run is not None
    history = newest.run.history
    assert [point.step for point in history] == [0, 10, 20, 30, 40, 50]  # 0-30 were deleted
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == [
        "step_00000040",
        "step_00000050",
        "step_00000060",
    ]
    assert [point.metrics["val_loss"] for point in history] == [losses(p.step)["val_loss"] for p in history]
    for manifest in (newest, *(sk.read_manifest(root / f"step_000000{s}") for s in (40, 50))):
        assert manifest.timing is not None
        assert 0 < manifest.timing.blocked_seconds <= manifest.timing.total_seconds
    # A synchronous save blocks throughout; an async one only until the snapshot is taken.
    synchronous, asynchronous = history[4].timing, history[5].timing
    assert synchronous is not None and synchronous.blocked_seconds == synchronous.total_seconds
    assert asynchronous is not None and asynchronous.blocked_seconds < asynchronous.total_seconds
    assert history[5].timing == sk.read_manifest(root / "step_00000050").timing


def test_a_plain_save_records_timing_but_no_history(tmp_path: Path) -> None:
    began = time.perf_counter()
    manifest = sk.save({"w": torch.ones(4)}, tmp_path / "c")
    wall = time.perf_counter() - began
    assert manifest.run is None and manifest.timing is not None
    assert 0 < manifest.timing.blocked_seconds == manifest.timing.total_seconds <= wall


def test_manager_timing_starts_with_the_managers_call(tmp_path: Path) -> None:
    """An async save's blocked time includes the manager's wait for the previous save."""
    manager = sk.CheckpointManager(tmp_path / "r", keep_last=1, keep_best=0)
    state = {"w": torch.randn(256, 256)}
    manager.async_save(state, step=1)
    began = time.perf_counter()
    pending = manager.async_save(state, step=2)  # waits for step 1 first
    call = time.perf_counter() - began
    timing = pending.result(timeout=60).manifest.timing  # type: ignore[union-attr]
    assert timing is not None and abs(timing.blocked_seconds - call) < 0.05
    assert timing.blocked_seconds == pytest.approx(pending.blocked_seconds, abs=0.05)


def test_history_keeps_a_save_whose_retention_failed_and_ignores_stale_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = sk.CheckpointManager(tmp_path / "r", keep_last=1, keep_best=0)
    state = {"w": torch.ones(2)}
    manager.save(state, step=1)

    def broken(*args: object, **kwargs: object) -> None:
        raise sk.StorageError("the disk went away")

    monkeypatch.setattr(manager.catalog, "apply", broken)
    with pytest.raises(sk.RetentionError):
        manager.save(state, step=2)  # committed; retention failed
    monkeypatch.undo()
    third = manager.async_save(state, step=3)
    manager.async_save(state, step=4)
    manager.wait()
    third.result()  # an old handle, read late
    manifest = manager.save(state, step=5).manifest
    assert manifest is not None and manifest.run is not None
    assert [point.step for point in manifest.run.history] == [1, 2, 3, 4]


def test_history_after_a_fallback_follows_the_restored_checkpoint(
    tmp_path: Path, flip_bit: Callable[[Path, int, int], None]
) -> None:
    manager = sk.CheckpointManager(tmp_path / "r", keep_last=3, keep_best=0)
    for step in (1, 2, 3):
        manager.save({"w": torch.ones(2) * step}, step=step)
    shard = next((tmp_path / "r" / "step_00000003").rglob("*.safetensors"))
    flip_bit(shard, shard.stat().st_size - 1, 0)
    resumed = sk.CheckpointManager(tmp_path / "r", keep_last=3, keep_best=0)
    assert resumed.restore().step == 2
    manifest = resumed.save({"w": torch.ones(2)}, step=4).manifest
    assert manifest is not None and manifest.run is not None
    assert [point.step for point in manifest.run.history] == [1, 2]  # not the abandoned step 3


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"timing": SaveTiming(blocked_seconds=-1.0, total_seconds=1.0)}, "timing.blocked_seconds=-1.0"),
        ({"timing": SaveTiming(blocked_seconds=1.0, total_seconds=float("inf"))}, "timing.total_seconds=inf"),
        ({"run": RunInfo(run_id="r", history=[HistoryPoint(step=-3)])}, "history[0]: step -3"),
        (
            {"run": RunInfo(run_id="r", history=[HistoryPoint(step=1, metrics={"l": float("nan")})])},
            "history[0]: metric names must be non-empty and short, values finite",
        ),
        (
            {"run": RunInfo(run_id="r", history=[HistoryPoint(step=5), HistoryPoint(step=5)])},
            "history[1]: step 5 must be >= 0, after the previous point",
        ),
        ({"timing": SaveTiming(blocked_seconds=2.0, total_seconds=1.0)}, "blocked_seconds=2.0 exceeds total"),
        (
            {
                "run": RunInfo(
                    run_id="r", history=[HistoryPoint(step=1, timing=SaveTiming(blocked_seconds=2, total_seconds=-2))]
                )
            },
            "history[0].timing.total_seconds=-2",
        ),
    ],
)
def test_bad_timing_and_history_are_refused(tmp_path: Path, change: dict[str, object], message: str) -> None:
    manifest = sk.save({"w": torch.ones(4)}, tmp_path / "c")
    broken = msgspec.structs.replace(manifest, **change)
    errors = validate_manifest(broken).errors
    assert any(message in error for error in errors), errors


def test_ls_plot_draws_the_curve_marks_and_blocking_times(root: Path, tmp_path: Path) -> None:
    picture = tmp_path / "out.png"
    code, out, _ = run("ls", str(root), "--plot", str(picture))
    assert code == 0, out
    assert "plot    " + str(picture) + ": 7 saves (3 still present)" in out
    assert picture.read_bytes().startswith(PNG_SIGNATURE) and picture.stat().st_size > 20_000
    assert " BLOCKED " in out.splitlines()[2]

    code, out, _ = run("ls", str(root), "--json", "--plot", str(tmp_path / "again.png"))
    document = json.loads(out)
    assert code == 0 and document["plot"] == str(tmp_path / "again.png")
    timings = {entry["name"]: entry["timing"] for entry in document["checkpoints"]}
    assert set(timings) == {"step_00000040", "step_00000050", "step_00000060"}
    assert all(0 < t["blocked_seconds"] <= t["total_seconds"] for t in timings.values())


def test_ls_plot_shows_a_corrupt_checkpoint_and_still_exits_1(
    root: Path, tmp_path: Path, flip_bit: Callable[[Path, int, int], None]
) -> None:
    flip_bit(next((root / "step_00000060").rglob("*.safetensors")), 200, 0)
    code, out, _ = run("ls", str(root), "--verify", "--plot", str(tmp_path / "c.png"))
    assert code == 1 and "CORRUPT" in out and "7 saves (3 still present)" in out
    assert (tmp_path / "c.png").read_bytes().startswith(PNG_SIGNATURE)


def test_ls_plot_without_matplotlib_is_a_clear_usage_error(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import now raises ImportError
    code, _out, err = run("ls", str(root), "--plot", str(tmp_path / "x.png"))
    assert code == 2 and "pip install 'shardkeep[plot]'" in err
    assert not (tmp_path / "x.png").exists()


def test_ls_plot_of_an_empty_root_names_it(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    code, _, err = run("ls", str(tmp_path / "empty"), "--plot", str(tmp_path / "x.png"))
    assert code == 2 and "nothing to plot" in err and "empty" in err


def test_ls_plot_of_a_run_without_the_metric_still_draws_the_timing(tmp_path: Path) -> None:
    manager = sk.CheckpointManager(tmp_path / "r", keep_last=1, keep_best=0)
    manager.save({"w": torch.ones(3)}, step=5)
    code, out, _ = run("ls", str(tmp_path / "r"), "--plot", str(tmp_path / "p.png"))
    assert code == 0 and "1 save (1 still present)" in out
    assert (tmp_path / "p.png").read_bytes().startswith(PNG_SIGNATURE)


@pytest.mark.parametrize(("name", "message"), [("out.jpg", "name it *.png"), ("missing/out.png", "does not exist")])
def test_ls_plot_refuses_a_bad_output_path(root: Path, tmp_path: Path, name: str, message: str) -> None:
    code, _, err = run("ls", str(root), "--plot", str(tmp_path / name))
    assert code == 2 and message in err
    assert not (tmp_path / name).exists()


def test_newer_fields_inside_run_history_and_timing_are_kept_as_unknown(tmp_path: Path) -> None:
    from shardkeep.integrity import seal_manifest
    from shardkeep.manifest import decode_manifest, encode_manifest

    manifest = sk.CheckpointManager(tmp_path / "r").save({"w": torch.ones(2)}, step=1).manifest
    assert manifest is not None
    manifest = msgspec.structs.replace(manifest, step=2, run=msgspec.structs.replace(manifest.run, history=[
        HistoryPoint(step=1, timing=SaveTiming(blocked_seconds=0.1, total_seconds=0.2))]))  # fmt: skip
    raw = json.loads(encode_manifest(manifest))
    raw["metadata_version"] = "1.9"
    raw["timing"]["gpu_seconds"] = 1.5
    raw["run"]["owner"] = "team-a"
    raw["run"]["history"][0]["note"] = "x"
    raw["run"]["history"][0]["timing"]["io_seconds"] = 0.1
    decoded = decode_manifest(seal_manifest(json.dumps(raw).encode(), "blake3"))
    assert decoded.unknown_fields == {
        "timing.gpu_seconds": 1.5,
        "run.owner": "team-a",
        "run.history[0].note": "x",
        "run.history[0].timing.io_seconds": 0.1,
    }


def drawn_figure(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Record every matplotlib figure saved from now on (to measure what plot_root drew)."""
    from matplotlib.figure import Figure

    saved: list[Any] = []
    original = Figure.savefig

    def spy(self: Figure, *args: Any, **kwargs: Any) -> None:
        saved.append(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    return saved


def labels_outside_their_frame(figure: Any) -> list[str]:
    """Every text drawn inside a panel (point labels, event labels) that sticks out of it."""
    figure.draw_without_rendering()
    outside = []
    for axes in figure.axes:
        frame = axes.get_window_extent()
        for text in axes.texts:
            box = text.get_window_extent()
            if box.x0 < frame.x0 - 0.5 or box.x1 > frame.x1 + 0.5 or box.y0 < frame.y0 - 0.5 or box.y1 > frame.y1 + 0.5:
                outside.append(text.get_text())
    return outside


def test_plot_keeps_every_label_inside_its_frame(root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The newest checkpoint (the rightmost point) is `last`: its label, the widest, stays inside
    the right edge of the frame."""
    saved = drawn_figure(monkeypatch)
    code, out, _ = run("ls", str(root), "--plot", str(tmp_path / "p.png"))
    assert code == 0, out
    (figure,) = saved
    assert any("step_00000060" in text.get_text() for axes in figure.axes for text in axes.texts)
    assert labels_outside_their_frame(figure) == []


def test_plot_marks_events_on_both_panels_inside_the_frame(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardkeep.report import PlotEvent, plot_root

    saved = drawn_figure(monkeypatch)
    manager = sk.CheckpointManager(root, keep_last=2, keep_best=1)
    entries = manager.list(verify=True)
    run_id = entries[-1].run_id
    events = [
        PlotEvent(0, "an event at the very first step\nwith a long label that must not leave the frame"),
        PlotEvent(52, "kill -9 rank 1 during\nthe save of step 52", "#c44e52"),
        PlotEvent(60, "resumed on 3 ranks at the very last step\n(a long label again)", "#2a7f3f"),
    ]
    picture = tmp_path / "events.png"
    summary = plot_root(entries, manager.policy, run_id, picture, title=str(root), events=events)
    assert summary.events == 3 and summary.saves == 7
    assert picture.read_bytes().startswith(PNG_SIGNATURE)
    (figure,) = saved
    metric_axes, time_axes = figure.axes
    texts = [text.get_text() for text in metric_axes.texts]
    assert all(event.label in texts for event in events)
    for axes in (metric_axes, time_axes):  # a vertical line through each panel at each event
        vertical = {line.get_xdata()[0] for line in axes.get_lines() if len(set(line.get_xdata())) == 1}
        assert {0, 52, 60} <= vertical
    assert labels_outside_their_frame(figure) == []
