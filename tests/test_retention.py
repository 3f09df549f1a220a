"""Retention is a pure function: every policy combination, and properties over random inputs."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shardkeep as sk
from shardkeep.retention import CheckpointInfo, RetentionPolicy, decide


def run(
    metrics: list[float | None], keep_last: int, keep_best: int, mode: str = "min"
) -> tuple[list[int], list[int], list[int]]:
    checkpoints = [CheckpointInfo(name=f"step_{i}", step=i, metric=m) for i, m in enumerate(metrics)]
    decision = decide(checkpoints, RetentionPolicy(keep_last=keep_last, keep_best=keep_best, mode=mode))  # type: ignore[arg-type]  # mode is "min" or "max"

    def steps(names: tuple[str, ...]) -> list[int]:
        return sorted(int(name.split("_")[1]) for name in names)

    return steps(decision.keep), steps(decision.last), steps(decision.best)


METRICS = [5.0, 3.0, 4.0, 1.0, 2.0, 6.0]


@pytest.mark.parametrize(
    ("keep_last", "keep_best", "kept"),
    [
        (0, 0, [5]),  # nothing asked for, but the newest verified is always kept
        (0, 1, [3, 5]),
        (0, 2, [3, 4, 5]),
        (1, 0, [5]),
        (2, 0, [4, 5]),
        (1, 1, [3, 5]),
        (3, 2, [3, 4, 5]),
        (10, 10, [0, 1, 2, 3, 4, 5]),
    ],
)
def test_every_policy_combination(keep_last: int, keep_best: int, kept: list[int]) -> None:
    assert run(METRICS, keep_last, keep_best)[0] == kept


def test_same_iteration_last_and_best_is_kept_once() -> None:
    kept, last, best = run([3.0, 2.0, 1.0], 1, 1)
    assert kept == [2] and last == [2] and best == [2]


def test_max_mode_and_ties_keep_the_older_step() -> None:
    # best changes only when the metric strictly improves
    assert run([1.0, 9.0, 9.0, 2.0], 1, 1, mode="max")[2] == [1]


def test_missing_and_nan_metrics_rank_below_measured_ones() -> None:
    assert run([None, math.nan, 4.0, None], 1, 1)[2] == [2]
    assert run([None, math.nan, 4.0, None], 1, 3)[2] == [0, 1, 2]


def test_the_first_checkpoint_without_a_metric_is_both_last_and_best() -> None:
    kept, last, best = run([None], 1, 1)
    assert kept == last == best == [0]
    assert run([None, None, None], 1, 1)[2] == [0]  # no improvement was ever measured


def test_unverified_checkpoints_are_never_last_or_best() -> None:
    checkpoints = [
        CheckpointInfo("a", 1, 1.0),
        CheckpointInfo("b", 2, 0.5, verified=False),  # older than a verified one: deleted
        CheckpointInfo("c", 3, 2.0),
        CheckpointInfo("d", 4, 0.1, verified=False),  # newer than every verified one: kept
    ]
    decision = decide(checkpoints, RetentionPolicy(keep_last=1, keep_best=1))
    assert decision.last == ("c",) and decision.best == ("a",)
    assert set(decision.keep) == {"a", "c", "d"} and decision.delete == ("b",)
    assert decision.newest_verified == "c"


def test_checkpoints_of_unknown_state_are_never_deleted_last_best_or_newest() -> None:
    checkpoints = [
        CheckpointInfo("a", 1, 0.1, verified=None),  # the best metric, but a tier cannot be seen
        CheckpointInfo("b", 2, 0.9),
        CheckpointInfo("c", 3, 0.5, verified=None),
    ]
    decision = decide(checkpoints, RetentionPolicy(keep_last=1, keep_best=1))
    assert decision.last == decision.best == ("b",) and decision.newest_verified == "b"
    assert set(decision.keep) == {"a", "b", "c"} and decision.delete == ()


def test_referenced_checkpoints_are_kept() -> None:
    checkpoints = [CheckpointInfo("base", 1, 5.0), CheckpointInfo("delta", 2, 4.0, references=frozenset({"base"}))]
    assert set(decide(checkpoints, RetentionPolicy(keep_last=1, keep_best=0)).keep) == {"base", "delta"}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"keep_last": -1}, "keep_last=-1"),
        ({"keep_best": 1.5}, "keep_best=1.5"),
        ({"keep_last": True}, "keep_last=True"),
        ({"mode": "lowest"}, "mode='lowest'"),
        ({"metric": ""}, "metric=''"),
    ],
)
def test_bad_policies_name_the_key_and_value(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(sk.UnsupportedValueError, match=message):
        RetentionPolicy(**kwargs)  # type: ignore[arg-type]  # deliberately bad values


_checkpoints = st.lists(
    st.tuples(st.one_of(st.none(), st.floats(-10, 10)), st.booleans()), min_size=0, max_size=12
).map(lambda rows: [CheckpointInfo(f"s{i}", i, metric, verified) for i, (metric, verified) in enumerate(rows)])


@settings(max_examples=400, deadline=None)
@given(_checkpoints, st.integers(0, 5), st.integers(0, 5), st.sampled_from(["min", "max"]))
def test_invariants_over_random_histories(
    checkpoints: list[CheckpointInfo], keep_last: int, keep_best: int, mode: str
) -> None:
    policy = RetentionPolicy(keep_last=keep_last, keep_best=keep_best, mode=mode)  # type: ignore[arg-type]  # "min"/"max"
    decision = decide(checkpoints, policy)
    assert set(decision.keep) | set(decision.delete) == {c.name for c in checkpoints}
    assert not set(decision.keep) & set(decision.delete)
    verified = sorted((c for c in checkpoints if c.verified), key=lambda c: -c.step)
    if verified:  # the newest verified checkpoint always survives
        assert verified[0].name in decision.keep
    assert list(decision.last) == [c.name for c in verified[:keep_last]]
    ranked = [c for c in verified if c.metric is not None and not math.isnan(c.metric)]
    assert len(decision.best) == min(keep_best, len(verified))
    if decision.best and ranked:  # the best is the true best
        sign = 1 if mode == "min" else -1
        true_best = min(sign * c.metric for c in ranked)  # type: ignore[operator]  # metric is not None here
        best = next(c for c in checkpoints if c.name == decision.best[0])
        assert sign * best.metric == true_best  # type: ignore[operator]  # metric is not None here
    # Exactly the policy: kept = last + best + newest verified + unverified newer than it.
    expected = set(decision.last) | set(decision.best) | ({verified[0].name} if verified else set())
    expected |= {c.name for c in checkpoints if not c.verified and (not verified or c.step > verified[0].step)}
    assert set(decision.keep) == expected
