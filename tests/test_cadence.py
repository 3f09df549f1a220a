"""Save cadence: SavePolicy's rules table-tested against a fake clock, their validation, and
CheckpointManager.should_save on one process and on 2 gloo ranks whose clocks disagree."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shardkeep as sk
from shardkeep.cadence import SavePolicy, SaveSchedule
from tests.support.distributed_harness import results_or_raise, run_ranks


class FakeClock:
    """A monotonic clock that moves only when a test says so."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def due_steps(policy: SavePolicy, clock: FakeClock, steps: range, seconds_per_step: float = 0.0) -> list[int]:
    """The steps a training loop saves under ``policy``, one step every ``seconds_per_step``."""
    schedule = SaveSchedule(policy)
    saved = []
    for step in steps:
        clock.now += seconds_per_step
        if schedule.due(step):
            schedule.saved(step)
            saved.append(step)
    return saved


def multiple_of_seven(step: int) -> bool:
    return step % 7 == 0


@pytest.mark.parametrize(
    ("rules", "seconds_per_step", "saved"),
    [
        ({"every_steps": 1}, 0.0, list(range(1, 13))),
        ({"every_steps": 5}, 0.0, [5, 10]),
        ({"every_steps": 5}, 100.0, [5, 10]),  # the step rule ignores time
        ({"every_seconds": 30.0}, 10.0, [3, 6, 9, 12]),  # counts from the schedule's start, then each save
        ({"every_seconds": 25.0}, 10.0, [3, 6, 9, 12]),
        ({"every_seconds": 30.0}, 0.0, []),  # time stands still: never due
        ({"should_save_fn": multiple_of_seven}, 0.0, [7]),
        # any of them
        ({"every_steps": 5, "should_save_fn": multiple_of_seven}, 0.0, [5, 7, 10]),
        ({"every_steps": 4, "every_seconds": 50.0}, 10.0, [4, 8, 12]),  # each multiple restarts the clock
        ({"every_steps": 4, "every_seconds": 30.0}, 10.0, [3, 4, 7, 8, 11, 12]),
        ({"every_steps": 6, "every_seconds": 35.0, "should_save_fn": multiple_of_seven}, 10.0, [4, 6, 7, 11, 12]),
    ],
)
def test_every_rule_and_their_union(rules: dict[str, Any], seconds_per_step: float, saved: list[int]) -> None:
    clock = FakeClock()
    assert due_steps(SavePolicy(**rules, clock=clock), clock, range(1, 13), seconds_per_step) == saved


def test_a_step_at_or_below_the_last_saved_one_is_never_due() -> None:
    policy = SavePolicy(every_steps=1, should_save_fn=lambda step: True)
    assert policy.should_save(10, now=0.0, last_step=None, since=0.0)
    assert not policy.should_save(10, now=0.0, last_step=10, since=0.0)
    assert not policy.should_save(9, now=1e9, last_step=10, since=0.0)
    assert policy.should_save(11, now=0.0, last_step=10, since=0.0)


def test_step_zero_is_a_multiple_and_time_counts_from_since() -> None:
    assert SavePolicy(every_steps=100).should_save(0, now=0.0, last_step=None, since=0.0)
    timed = SavePolicy(every_seconds=60.0)
    assert not timed.should_save(1, now=159.9, last_step=None, since=100.0)
    assert timed.should_save(1, now=160.0, last_step=None, since=100.0)


def test_a_restore_or_save_restarts_the_clock_and_the_step() -> None:
    clock = FakeClock(0.0)
    schedule = SaveSchedule(SavePolicy(every_seconds=10.0, clock=clock))
    clock.now = 50.0
    schedule.saved(40)  # e.g. restored step 40
    assert (schedule.last_step, schedule.since) == (40, 50.0)
    clock.now = 59.0
    assert not schedule.due(41)
    clock.now = 60.0
    assert schedule.due(41) and not schedule.due(40)
    schedule.saved(30)  # an older step never moves the last step back
    assert schedule.last_step == 40


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        ({}, "would never save"),
        ({"every_steps": 0}, "every_steps=0 cannot be met"),
        ({"every_steps": -5}, "every_steps=-5"),
        ({"every_steps": 2.5}, "every_steps=2.5"),
        ({"every_steps": True}, "every_steps=True"),
        ({"every_seconds": 0}, "every_seconds=0 cannot be met"),
        ({"every_seconds": -1.0}, "every_seconds=-1.0"),
        ({"every_seconds": math.inf}, "every_seconds=inf"),
        ({"every_seconds": math.nan}, "every_seconds=nan"),
        ({"every_seconds": "60"}, "every_seconds='60'"),
        ({"should_save_fn": 5}, "should_save_fn=5"),
        ({"every_steps": 1, "clock": 3.0}, "clock=3.0"),
    ],
)
def test_impossible_cadences_raise_config_errors_naming_the_field(rules: dict[str, Any], message: str) -> None:
    with pytest.raises(sk.ConfigError, match=message):
        SavePolicy(**rules)


@pytest.mark.parametrize("step", [-1, 1.5, True, "3"])
def test_bad_steps_are_refused(step: Any) -> None:
    with pytest.raises(sk.ConfigError, match="step="):
        SavePolicy(every_steps=1).should_save(step, now=0.0, last_step=None, since=0.0)


def test_a_schedule_needs_a_save_policy() -> None:
    with pytest.raises(sk.ConfigError, match=r"save_policy=.*SavePolicy"):
        SaveSchedule({"every_steps": 10})  # type: ignore[arg-type]  # deliberately not a SavePolicy


def test_only_time_and_function_rules_need_the_ranks_to_agree() -> None:
    assert not SavePolicy(every_steps=3).needs_agreement
    assert SavePolicy(every_seconds=3.0).needs_agreement
    assert SavePolicy(every_steps=3, should_save_fn=bool).needs_agreement


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(st.none(), st.integers(1, 20)),
    st.one_of(st.none(), st.floats(0.5, 100.0)),
    st.lists(st.floats(0.0, 30.0), min_size=1, max_size=60),
)
def test_saved_steps_are_increasing_and_never_further_apart_than_the_rules_allow(
    every_steps: int | None, every_seconds: float | None, gaps: list[float]
) -> None:
    if every_steps is None and every_seconds is None:
        every_steps = 1
    clock = FakeClock(0.0)
    schedule = SaveSchedule(SavePolicy(every_steps=every_steps, every_seconds=every_seconds, clock=clock))
    saved: list[tuple[int, float]] = []
    for step, gap in enumerate(gaps, start=1):
        clock.now += gap
        if schedule.due(step):
            schedule.saved(step)
            saved.append((step, clock.now))
    steps = [step for step, _ in saved]
    assert steps == sorted(set(steps))
    if every_steps is not None:  # every multiple is saved
        assert {s for s in range(1, len(gaps) + 1) if s % every_steps == 0} <= set(steps)
    if every_seconds is not None:  # a save that no step rule asked for waits the whole interval
        previous = 0.0
        for step, now in saved:
            if every_steps is None or step % every_steps:
                assert now - previous >= every_seconds
            previous = now


# --------------------------------------------------------------------------------------------
# CheckpointManager(save_policy=)
# --------------------------------------------------------------------------------------------


def test_manager_without_a_save_policy_finds_every_step_due(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    manager = sk.CheckpointManager(tmp_path)
    assert all(manager.should_save(step) for step in (0, 1, 5, 5))
    manager.save({"w": torch.zeros(2)}, step=5)
    assert manager.should_save(5)  # no policy: the manager decides nothing, as before


def test_manager_saves_on_the_policy_cadence_and_resumes_it(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    clock = FakeClock()
    policy = SavePolicy(every_steps=4, every_seconds=25.0, clock=clock)
    manager = sk.CheckpointManager(tmp_path, keep_last=10, keep_best=0, save_policy=policy)
    for step in range(1, 11):
        clock.now += 10.0
        if manager.should_save(step):
            manager.save({"w": torch.full((2,), float(step))}, step=step)
    # 3 (30 s after the start), 4 (a multiple), 7 (30 s after 4), 8 (a multiple); 10 is only 20 s after 8
    assert [entry.step for entry in manager.list()] == [3, 4, 7, 8]
    pending = manager.async_save({"w": torch.ones(2)}, step=12)
    assert not manager.should_save(12)  # counted from the snapshot, before the commit
    pending.result(timeout=60)
    resumed = sk.CheckpointManager(tmp_path, keep_last=10, keep_best=0, save_policy=policy)
    clock.now += 100.0
    resumed.restore({"w": torch.zeros(2)})
    assert not resumed.should_save(12) and not resumed.should_save(11)  # at or below the restored step
    assert not resumed.should_save(13)  # the time rule counts from the restore
    assert resumed.should_save(16)
    clock.now += 25.0
    assert resumed.should_save(13)


def test_save_policy_must_be_a_save_policy(tmp_path: Path) -> None:
    with pytest.raises(sk.ConfigError, match="save_policy="):
        sk.CheckpointManager(tmp_path, save_policy=10)  # type: ignore[arg-type]  # deliberately wrong


def _decide_with_skewed_clocks(rank: int, world_size: int, root: str) -> list[bool]:
    # Rank 1's clock runs three times as fast, so on its own it would find every step due.
    clock = FakeClock(0.0)
    manager = sk.CheckpointManager(root, save_policy=SavePolicy(every_seconds=50.0, clock=clock))
    answers = []
    for step in range(1, 6):
        clock.now += 20.0 if rank == 0 else 60.0
        due = manager.should_save(step)
        answers.append(due)
        if due:
            manager.save({"w": torch_module().full((4,), float(step))}, step=step)
    return answers


def torch_module() -> Any:
    import torch

    return torch


def test_ranks_whose_clocks_disagree_follow_the_coordinator(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    results = results_or_raise(
        run_ranks(2, _decide_with_skewed_clocks, str(tmp_path / "root"), outbox=tmp_path / "out")
    )
    assert results[0] == results[1] == [False, False, True, False, False]


def test_a_failing_should_save_fn_is_a_config_error_naming_it() -> None:
    def broken(step: int) -> bool:
        raise ZeroDivisionError("no")

    with pytest.raises(sk.ConfigError, match="should_save_fn raised ZeroDivisionError at step 3") as raised:
        SavePolicy(should_save_fn=broken).should_save(3, now=0.0, last_step=None, since=0.0)
    assert isinstance(raised.value.__cause__, ZeroDivisionError)
    assert SavePolicy(every_steps=3, should_save_fn=broken).should_save(3, now=0.0, last_step=None, since=0.0)
