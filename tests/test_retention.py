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


# --------------------------------------------------------------------------------------------
# keep_period, keep_interval_seconds and keep_fn, composed with keep_last and keep_best
# --------------------------------------------------------------------------------------------

HOUR = 3600.0


def history(*rows: tuple[int, float | None, float, bool | None]) -> list[CheckpointInfo]:
    """Checkpoints from (step, metric, created, verified) rows."""
    return [
        CheckpointInfo(f"s{step}", step, metric, verified, created=created) for step, metric, created, verified in rows
    ]


# Steps 0..50 every 10, one save every 20 minutes, the best metric at step 20; step 50 is damaged.
SCHEDULED = history(
    (0, None, 0.0, True),
    (10, 3.0, 1200.0, True),
    (20, 1.0, 2400.0, True),
    (30, 2.0, 3600.0, True),
    (40, 4.0, 4800.0, True),
    (50, 0.5, 6000.0, False),
)


def keep_forty(info: CheckpointInfo) -> bool:
    return info.step == 40


@pytest.mark.parametrize(
    ("policy", "kept"),
    [
        # each rule alone (keep_last=keep_best=0): the newest verified (40) is always kept
        (RetentionPolicy(keep_last=0, keep_best=0), [40, 50]),
        (RetentionPolicy(keep_last=0, keep_best=0, keep_period=20), [0, 20, 40, 50]),
        (RetentionPolicy(keep_last=0, keep_best=0, keep_period=30), [0, 30, 40, 50]),
        # windows [0, 1h) and [1h, 2h): the newest verified in each is 20 and 40
        (RetentionPolicy(keep_last=0, keep_best=0, keep_interval_seconds=HOUR), [20, 40, 50]),
        # windows of 30 min: [0, 30m) holds steps 0 and 10, [30m, 1h) 20, [1h, 1h30m) 30 and 40
        (RetentionPolicy(keep_last=0, keep_best=0, keep_interval_seconds=1800.0), [10, 20, 40, 50]),
        (RetentionPolicy(keep_last=0, keep_best=0, keep_fn=lambda info: info.step == 10), [10, 40, 50]),
        # composed: the union of what each keeps
        (RetentionPolicy(keep_last=1, keep_best=1, keep_period=30), [0, 20, 30, 40, 50]),
        (RetentionPolicy(keep_last=2, keep_best=0, keep_interval_seconds=2 * HOUR), [30, 40, 50]),
        (RetentionPolicy(keep_last=1, keep_best=1, keep_interval_seconds=HOUR), [20, 40, 50]),
        (
            RetentionPolicy(
                keep_last=1, keep_best=1, keep_period=25, keep_interval_seconds=HOUR, keep_fn=lambda i: i.step == 10
            ),
            [0, 10, 20, 40, 50],
        ),
        (RetentionPolicy(keep_last=1, keep_best=0, keep_fn=keep_forty), [40, 50]),
    ],
)
def test_scheduled_rules_compose_as_a_union(policy: RetentionPolicy, kept: list[int]) -> None:
    decision = decide(SCHEDULED, policy)
    assert sorted(int(name[1:]) for name in decision.keep) == kept
    assert decision.newest_verified == "s40"  # the damaged newer step 50 is kept, never counted


def test_each_rule_marks_what_it_keeps() -> None:
    policy = RetentionPolicy(
        keep_last=1, keep_best=1, keep_period=20, keep_interval_seconds=HOUR, keep_fn=lambda i: i.metric == 3.0
    )
    decision = decide(SCHEDULED, policy)
    assert decision.last == ("s40",) and decision.best == ("s20",)
    assert decision.periodic == ("s40", "s20", "s0")  # newest first; the damaged s50 is no multiple kept
    assert decision.per_interval == ("s40", "s20")
    assert decision.chosen == ("s10",)
    assert decision.delete == ("s30",)


def test_rules_off_leave_their_marks_empty() -> None:
    decision = decide(SCHEDULED, RetentionPolicy())
    assert decision.periodic == decision.per_interval == decision.chosen == ()


def test_damaged_and_unknown_checkpoints_are_never_periodic_interval_or_chosen() -> None:
    checkpoints = history(
        (10, 1.0, 100.0, True),
        (20, 1.0, 200.0, False),  # damaged, older than a verified one: deleted whatever the rules say
        (30, 1.0, 300.0, True),
        (40, 1.0, 400.0, None),  # unknown: kept, but never counted
    )
    policy = RetentionPolicy(keep_last=0, keep_best=0, keep_period=10, keep_interval_seconds=1000.0, keep_fn=bool)
    decision = decide(checkpoints, policy)
    assert decision.periodic == ("s30", "s10") and decision.chosen == ("s30", "s10")
    assert decision.per_interval == ("s30",)  # the newest verified of the window [0, 1000)
    assert decision.delete == ("s20",) and set(decision.keep) == {"s10", "s30", "s40"}


def test_a_damaged_newest_leaves_the_newest_verified_protected_under_every_rule() -> None:
    checkpoints = history((5, 1.0, 10.0, True), (7, 2.0, 20.0, True), (9, 0.1, 30.0, False))
    policy = RetentionPolicy(
        keep_last=0, keep_best=0, keep_period=5, keep_interval_seconds=1.0, keep_fn=lambda i: False
    )
    decision = decide(checkpoints, policy)
    assert decision.newest_verified == "s7" and set(decision.keep) == {"s5", "s7", "s9"}


def test_the_interval_keeps_the_last_created_and_skips_unknown_times() -> None:
    checkpoints = history((1, None, 50.0, True), (2, None, 40.0, True), (3, None, 120.0, True))
    checkpoints.append(CheckpointInfo("s4", 4, created=None))
    checkpoints.append(CheckpointInfo("s5", 5, created=math.nan))
    decision = decide(checkpoints, RetentionPolicy(keep_last=0, keep_best=0, keep_interval_seconds=100.0))
    # window [0, 100): step 1 was created last (a clock step back does not matter); [100, 200): step 3
    assert decision.per_interval == ("s3", "s1")
    assert set(decision.keep) == {"s1", "s3", "s5"}  # s5 is the newest verified


def test_an_interval_tie_goes_to_the_higher_step() -> None:
    checkpoints = history((1, None, 10.0, True), (2, None, 10.0, True), (3, None, 500.0, True))
    decision = decide(checkpoints, RetentionPolicy(keep_last=0, keep_best=0, keep_interval_seconds=100.0))
    assert decision.per_interval == ("s3", "s2")


def test_keep_fn_sees_the_checkpoint_info_and_its_errors_are_typed() -> None:
    seen: list[CheckpointInfo] = []

    def record(info: CheckpointInfo) -> bool:
        seen.append(info)
        return False

    decide(SCHEDULED, RetentionPolicy(keep_fn=record))
    assert sorted(info.step for info in seen) == [0, 10, 20, 30, 40]  # verified ones only

    def broken(info: CheckpointInfo) -> bool:
        raise KeyError("tag")

    with pytest.raises(sk.ConfigError, match="keep_fn raised KeyError on s40: 'tag'") as raised:
        decide(SCHEDULED, RetentionPolicy(keep_fn=broken))
    assert isinstance(raised.value.__cause__, KeyError)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"keep_period": 0}, "keep_period=0"),
        ({"keep_period": -3}, "keep_period=-3"),
        ({"keep_period": 2.0}, "keep_period=2.0"),
        ({"keep_period": True}, "keep_period=True"),
        ({"keep_interval_seconds": 0}, "keep_interval_seconds=0"),
        ({"keep_interval_seconds": -1.0}, "keep_interval_seconds=-1.0"),
        ({"keep_interval_seconds": math.inf}, "keep_interval_seconds=inf"),
        ({"keep_interval_seconds": math.nan}, "keep_interval_seconds=nan"),
        ({"keep_interval_seconds": "3600"}, "keep_interval_seconds='3600'"),
        ({"keep_interval_seconds": False}, "keep_interval_seconds=False"),
        ({"keep_fn": 3}, "keep_fn=3"),
    ],
)
def test_bad_scheduled_rules_name_the_field(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(sk.ConfigError, match=message):
        RetentionPolicy(**kwargs)  # type: ignore[arg-type]  # deliberately bad values


_scheduled = st.lists(
    st.tuples(
        st.one_of(st.none(), st.floats(-10, 10)),
        st.sampled_from([True, True, False, None]),
        st.one_of(st.none(), st.floats(0, 10_000)),
    ),
    min_size=0,
    max_size=14,
).map(
    lambda rows: [
        CheckpointInfo(f"s{i}", i, metric, verified, created=created)
        for i, (metric, verified, created) in enumerate(rows)
    ]
)


@settings(max_examples=400, deadline=None)
@given(
    _scheduled,
    st.integers(0, 4),
    st.integers(0, 4),
    st.one_of(st.none(), st.integers(1, 6)),
    st.one_of(st.none(), st.floats(1, 5000)),
    st.one_of(st.none(), st.integers(0, 13)),
)
def test_scheduled_rules_never_drop_what_last_best_or_newest_keep(
    checkpoints: list[CheckpointInfo],
    keep_last: int,
    keep_best: int,
    period: int | None,
    interval: float | None,
    chosen_step: int | None,
) -> None:
    keep_fn = None if chosen_step is None else (lambda info: info.step == chosen_step)
    policy = RetentionPolicy(
        keep_last=keep_last, keep_best=keep_best, keep_period=period, keep_interval_seconds=interval, keep_fn=keep_fn
    )
    decision = decide(checkpoints, policy)
    plain = decide(checkpoints, RetentionPolicy(keep_last=keep_last, keep_best=keep_best))
    assert set(plain.keep) <= set(decision.keep)  # adding rules only ever keeps more
    assert set(decision.keep) | set(decision.delete) == {c.name for c in checkpoints}
    verified = sorted((c for c in checkpoints if c.verified is True), key=lambda c: -c.step)
    if verified:
        assert decision.newest_verified == verified[0].name and verified[0].name in decision.keep
    assert not {c.name for c in checkpoints if c.verified is None} & set(decision.delete)
    expected_periodic = {c.name for c in verified if period is not None and c.step % period == 0}
    assert set(decision.periodic) == expected_periodic
    if interval is not None:  # exactly one per window that holds a verified, dated checkpoint
        windows = {math.floor(c.created / interval) for c in verified if c.created is not None}
        assert len(decision.per_interval) == len(windows)
    else:
        assert decision.per_interval == ()
    scheduled = set(decision.periodic) | set(decision.per_interval) | set(decision.chosen)
    assert scheduled <= set(decision.keep)
    assert set(decision.keep) == set(plain.keep) | scheduled
