"""Retrying a failed save: the classifier, the backoff schedule, the manager's retries on real
files, the ranks' one vote (real gloo ranks), and a retry on a real S3 server."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import Any

import pytest

import shardkeep as sk
from shardkeep.errors import (
    CheckpointExistsError,
    ConfigError,
    CoordinationError,
    IntegrityError,
    RetentionError,
    StorageError,
)
from shardkeep.retry import agreed_kind, failure_kind, is_transient, run_with_retries
from shardkeep.storage.local import LocalStore
from shardkeep.testing import FaultInjectingStore, InjectedFault
from tests.support.distributed_harness import results_or_raise, run_ranks
from tests.support.observe import logged_messages

torch = pytest.importorskip("torch")


def tiny(seed: int = 0) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, generator=generator), "step": seed}


def storage_error(cause: BaseException | None, message: str = "writing failed") -> StorageError:
    """A StorageError chained to ``cause`` the way the stores raise it."""
    try:
        try:
            if cause is not None:
                raise cause
            raise StorageError(message)
        except StorageError:
            raise
        except BaseException as exc:
            raise StorageError(message) from exc
    except StorageError as error:
        return error


class ClientError(Exception):
    """botocore's ClientError as far as the classifier looks at it: its name and ``response``."""

    def __init__(self, code: str, status: int | None) -> None:
        super().__init__(f"An error occurred ({code})")
        self.response: dict[str, Any] = {"Error": {"Code": code, "Message": code}}
        if status is not None:
            self.response["ResponseMetadata"] = {"HTTPStatusCode": status}


class EndpointConnectionError(Exception):
    """Named like botocore's connection error; matched by name, no botocore import."""


def wrapped(inner: BaseException, outer: BaseException) -> BaseException:
    outer.__cause__ = inner
    return outer


# --------------------------------------------------------------------------------------------
# The classifier


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (storage_error(OSError(errno.EIO, "Input/output error")), "transient"),
        (storage_error(OSError(errno.ETIMEDOUT, "timed out")), "transient"),
        (storage_error(ConnectionResetError(errno.ECONNRESET, "reset by peer")), "transient"),
        (storage_error(OSError(errno.ESTALE, "stale file handle")), "transient"),
        (storage_error(TimeoutError("read timed out")), "transient"),
        (storage_error(OSError(errno.ENOSPC, "No space left on device")), "no_space"),
        (storage_error(OSError(errno.EACCES, "Permission denied")), "permanent"),
        (storage_error(OSError(errno.EROFS, "Read-only file system")), "permanent"),
        (storage_error(FileNotFoundError(errno.ENOENT, "gone")), "permanent"),
        (storage_error(None), "permanent"),  # no evidence of anything transient
        (storage_error(ClientError("SlowDown", 503)), "transient"),
        (storage_error(ClientError("InternalError", 500)), "transient"),
        (storage_error(ClientError("ThrottlingException", None)), "transient"),
        (storage_error(ClientError("TooManyRequests", 429)), "transient"),
        (storage_error(ClientError("503", None)), "transient"),
        (storage_error(ClientError("AccessDenied", 403)), "permanent"),
        (storage_error(ClientError("NoSuchBucket", 404)), "permanent"),
        # s3fs maps unknown store errors to OSError(EIO) from the ClientError: the store's answer wins
        (storage_error(wrapped(ClientError("AccessDenied", 403), OSError(errno.EIO, "s3fs"))), "permanent"),
        (storage_error(wrapped(ClientError("SlowDown", 503), OSError(errno.EIO, "s3fs"))), "transient"),
        (storage_error(EndpointConnectionError("could not connect")), "transient"),
        # nested: a rank's CoordinationError whose cause is its own StorageError from EIO
        (wrapped(storage_error(OSError(errno.EIO, "eio")), CoordinationError("write failed", {1: "x"})), "transient"),
        # corruption, usage and committed checkpoints are never transient, whatever lies below
        (wrapped(OSError(errno.EIO, "eio"), IntegrityError("digest mismatch")), "permanent"),
        (wrapped(OSError(errno.EIO, "eio"), ConfigError("bad option")), "permanent"),
        (CheckpointExistsError("step_00000001 exists"), "permanent"),
        (wrapped(OSError(errno.EIO, "eio"), RetentionError("committed, but pruning failed", "p")), "permanent"),
        # a rank that died: the survivors' CoordinationError names no rank, caused by gloo's RuntimeError
        (wrapped(RuntimeError("Connection closed by peer"), CoordinationError("deadline", {})), "permanent"),
        (ValueError("not a storage failure"), "permanent"),
    ],
)
def test_failure_kind(error: BaseException, kind: str) -> None:
    assert failure_kind(error) == kind
    assert is_transient(error) is (kind == "transient")
    assert is_transient(error, space_freed=True) is (kind in ("transient", "no_space"))


def test_a_third_party_error_raised_while_handling_another_is_followed_to_it() -> None:
    try:
        try:
            raise OSError(errno.ECONNRESET, "reset")
        except OSError:
            raise RuntimeError("the client gave up")  # the context is the point
    except RuntimeError as exc:
        error = storage_error(exc)
    assert failure_kind(error) == "transient"


def test_the_injected_fault_carries_its_errno_as_its_cause(tmp_path: Path) -> None:
    store = FaultInjectingStore(LocalStore(tmp_path), fail_at=1, code=errno.EIO)
    with pytest.raises(InjectedFault) as caught:
        store.put_atomic("x", b"1")
    assert isinstance(caught.value.__cause__, OSError) and caught.value.__cause__.errno == errno.EIO
    assert is_transient(caught.value)


# --------------------------------------------------------------------------------------------
# The policy and the backoff schedule


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"attempts": 0}, "attempts"),
        ({"attempts": 2.5}, "attempts"),
        ({"attempts": True}, "attempts"),
        ({"initial_backoff": -1}, "initial_backoff"),
        ({"initial_backoff": float("nan")}, "initial_backoff"),
        ({"multiplier": 0.5}, "multiplier"),
        ({"max_backoff": float("inf")}, "max_backoff"),
        ({"deadline": -0.1}, "deadline"),
        ({"deadline": "60"}, "deadline"),
        ({"initial_backoff": 10, "max_backoff": 5}, "max_backoff"),
    ],
)
def test_a_bad_policy_names_its_field(options: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        sk.RetryPolicy(**options)


def test_the_backoff_grows_by_the_multiplier_up_to_the_cap() -> None:
    policy = sk.RetryPolicy(attempts=6, initial_backoff=0.5, multiplier=3, max_backoff=10)
    assert policy.schedule() == [0.5, 1.5, 4.5, 10.0, 10.0]
    assert sk.RetryPolicy(attempts=1).schedule() == []
    assert sk.RetryPolicy(attempts=3, multiplier=1).schedule() == [1.0, 1.0]


class OneProcess:
    distributed = False

    def all_gather(self, value: Any, *, label: str = "") -> list[Any]:
        return [value]


class FakeTime:
    """A clock that only sleeping moves, plus ``cost`` seconds per attempt."""

    def __init__(self, cost: float = 0.0) -> None:
        self.now = 1000.0
        self.cost = cost
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def failing(times: int, error: BaseException, fake: FakeTime) -> Any:
    calls: list[int] = []

    def attempt(number: int) -> str:
        calls.append(number)
        fake.now += fake.cost
        if len(calls) <= times:
            raise error
        return f"committed on attempt {number}"

    attempt.calls = calls  # type: ignore[attr-defined]  # the test reads them back
    return attempt


def eio() -> StorageError:
    return storage_error(OSError(errno.EIO, "Input/output error"))


def test_retries_follow_the_schedule_and_log_each_retry(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeTime()
    attempt = failing(3, eio(), fake)
    policy = sk.RetryPolicy(attempts=5, initial_backoff=1, multiplier=2, max_backoff=3, deadline=100)
    with caplog.at_level(logging.WARNING, logger="shardkeep.retry"):
        result = run_with_retries(
            attempt,
            policy,
            voters=OneProcess(),
            free_space=lambda: False,
            what="save",
            sleep=fake.sleep,
            clock=fake.clock,
        )
    assert result == "committed on attempt 4" and attempt.calls == [1, 2, 3, 4]
    assert fake.slept == [1, 2, 3]
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 3
    assert "attempt 1 of 5" in lines[0] and "StorageError" in lines[0] and "retrying in 1.0 s" in lines[0]
    assert "attempt 3 of 5" in lines[2] and "retrying in 3.0 s" in lines[2]


def test_exhausted_attempts_raise_the_error_with_the_attempts_noted() -> None:
    fake = FakeTime()
    error = eio()
    attempt = failing(10, error, fake)
    with pytest.raises(StorageError) as caught:
        run_with_retries(
            attempt,
            sk.RetryPolicy(attempts=3, initial_backoff=1, deadline=100),
            voters=OneProcess(),
            free_space=lambda: False,
            what="the save",
            sleep=fake.sleep,
            clock=fake.clock,
        )
    assert caught.value is error and attempt.calls == [1, 2, 3] and fake.slept == [1, 2]
    assert any("failed 3 times" in note for note in caught.value.__notes__)


def test_the_deadline_stops_retrying_early() -> None:
    fake = FakeTime(cost=4.0)  # each attempt takes 4 s
    attempt = failing(10, eio(), fake)
    policy = sk.RetryPolicy(attempts=10, initial_backoff=1, multiplier=2, deadline=12)
    with pytest.raises(StorageError) as caught:
        run_with_retries(
            attempt,
            policy,
            voters=OneProcess(),
            free_space=lambda: False,
            what="save",
            sleep=fake.sleep,
            clock=fake.clock,
        )
    # 4 (fail) +1 wait, 4 (fail) +2 wait = 11 s; after the third failure at 15 s nothing may start
    assert attempt.calls == [1, 2, 3] and fake.slept == [1, 2]
    assert any("deadline" in note for note in caught.value.__notes__)


@pytest.mark.parametrize(
    ("error", "freed", "calls"),
    [
        (storage_error(OSError(errno.EACCES, "denied")), True, [1]),
        (CheckpointExistsError("exists"), True, [1]),
        (storage_error(OSError(errno.ENOSPC, "full")), False, [1]),
        (storage_error(OSError(errno.ENOSPC, "full")), True, [1, 2]),
    ],
)
def test_only_transient_failures_are_retried(error: BaseException, freed: bool, calls: list[int]) -> None:
    fake = FakeTime()
    attempt = failing(1, error, fake)
    asked: list[bool] = []

    def free_space() -> bool:
        asked.append(True)
        return freed

    try:
        run_with_retries(
            attempt,
            sk.RetryPolicy(),
            voters=OneProcess(),
            free_space=free_space,
            what="save",
            sleep=fake.sleep,
            clock=fake.clock,
        )
    except type(error):
        pass
    assert attempt.calls == calls
    assert bool(asked) is (failure_kind(error) == "no_space")


class Votes:
    """Ranks whose votes are known: ``all_gather`` returns them with this rank's own in place."""

    distributed = True

    def __init__(self, others: list[tuple[str, float]]) -> None:
        self.others = others

    def all_gather(self, value: Any, *, label: str = "") -> list[Any]:
        return [value, *self.others]


@pytest.mark.parametrize(
    ("mine", "others", "agreed"),
    [
        (eio(), [("absent", 0.0)], "transient"),  # this rank failed with EIO, the other holds the report
        (CoordinationError("rank 1 failed", {1: "StorageError: x"}), [("transient", 0.0)], "transient"),
        (CoordinationError("rank 1 failed", {1: "StorageError: x"}), [("permanent", 0.0)], "permanent"),
        (eio(), [("permanent", 0.0)], "permanent"),
        (CoordinationError("rank 1 failed", {1: "x"}), [("absent", 0.0)], "permanent"),  # nobody knows
        (eio(), [("no_space", 0.0)], "transient"),
        (storage_error(OSError(errno.ENOSPC, "full")), [("absent", 0.0)], "no_space"),
        # no vote: a deadline (no failed rank named) or an error that not every rank raises
        (wrapped(RuntimeError("peer died"), CoordinationError("deadline", {})), [("transient", 0.0)], "permanent"),
        (wrapped(OSError(errno.EIO, "eio"), ConfigError("bad")), [("transient", 0.0)], "permanent"),
    ],
)
def test_the_ranks_vote(mine: BaseException, others: list[tuple[str, float]], agreed: str) -> None:
    assert agreed_kind(Votes(others), mine, 1.0)[0] == agreed


def test_the_slowest_ranks_clock_decides_the_deadline() -> None:
    assert agreed_kind(Votes([("absent", 7.5)]), eio(), 1.0) == ("transient", 7.5)


# --------------------------------------------------------------------------------------------
# The manager on real files


class FailingWrites(FaultInjectingStore):
    """Every file write fails with ``code`` (the first ``times`` of them)."""

    def __init__(self, inner: Any, *, code: int = errno.EIO, times: int = 1_000_000, after: int = 0) -> None:
        super().__init__(inner)
        self.code = code
        self.left = times
        self.after = after  # file writes that succeed before the failures start

    def open_write(self, path: str) -> Any:
        self.after -= 1
        if self.after < 0 and self.left > 0:
            self.left -= 1
            raise InjectedFault(f"injected {errno.errorcode[self.code]} opening {path}") from OSError(
                self.code, os.strerror(self.code), path
            )
        return super().open_write(path)


def committed(root: Path) -> list[str]:
    return sorted(name for name in os.listdir(root) if name.startswith("step_"))


QUICK = sk.RetryPolicy(attempts=3, initial_backoff=0.01, max_backoff=0.02)


def test_a_transient_failure_is_retried_and_the_second_attempt_commits(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = FailingWrites(LocalStore(tmp_path), times=1)
    manager = sk.CheckpointManager(tmp_path, storage=store, keep_best=0, retry=QUICK)
    with caplog.at_level(logging.WARNING, logger="shardkeep.retry"):
        entry = manager.save(tiny(1), step=1)
    assert entry.step == 1 and committed(tmp_path) == ["step_00000001"]
    assert not [name for name in os.listdir(tmp_path) if ".tmp" in name or "attempt" in name]
    assert sk.verify(tmp_path / "step_00000001").ok
    assert torch.equal(sk.load(tmp_path / "step_00000001")["w"], tiny(1)["w"])
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 1 and "attempt 1 of 3" in lines[0] and "InjectedFault" in lines[0], lines
    assert "step 1" in lines[0] and "retrying in 0.0" in lines[0]


def test_without_a_policy_the_save_fails_at_once(tmp_path: Path) -> None:
    store = FailingWrites(LocalStore(tmp_path), times=1)
    manager = sk.CheckpointManager(tmp_path, storage=store, keep_best=0)
    with pytest.raises(InjectedFault):
        manager.save(tiny(1), step=1)
    assert committed(tmp_path) == [] and manager.save(tiny(1), step=1).step == 1


def test_exhausted_attempts_raise_and_commit_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = FailingWrites(LocalStore(tmp_path))
    manager = sk.CheckpointManager(tmp_path, storage=store, keep_best=0, retry=QUICK)
    with caplog.at_level(logging.WARNING, logger="shardkeep.retry"), pytest.raises(InjectedFault) as caught:
        manager.save(tiny(1), step=1)
    assert any("failed 3 times" in note for note in caught.value.__notes__)
    assert len(caplog.records) == 2 and committed(tmp_path) == []
    assert store.left == 1_000_000 - 3


def test_the_deadline_stops_the_managers_retries_early(tmp_path: Path) -> None:
    store = FailingWrites(LocalStore(tmp_path))
    policy = sk.RetryPolicy(attempts=10, initial_backoff=0.05, max_backoff=0.05, deadline=0.12)
    manager = sk.CheckpointManager(tmp_path, storage=store, keep_best=0, retry=policy)
    with pytest.raises(InjectedFault) as caught:
        manager.save(tiny(1), step=1)
    made = 1_000_000 - store.left
    assert 1 <= made <= 3, made  # each wait is 0.05 s: at most two fit in 0.12 s
    assert any("deadline" in note for note in caught.value.__notes__)


def test_a_permanent_failure_is_not_retried(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = FailingWrites(LocalStore(tmp_path), code=errno.EACCES)
    manager = sk.CheckpointManager(tmp_path, storage=store, keep_best=0, retry=QUICK)
    with caplog.at_level(logging.WARNING, logger="shardkeep.retry"), pytest.raises(StorageError):
        manager.save(tiny(1), step=1)
    assert store.left == 1_000_000 - 1 and not caplog.records


def test_a_full_disk_is_retried_only_when_retention_freed_space(tmp_path: Path) -> None:
    roomy = sk.CheckpointManager(tmp_path, keep_last=3, keep_best=0)
    for step in (1, 2):
        roomy.save(tiny(step), step=step)
    # Nothing to free under the same policy: the full disk is not retried.
    full = FailingWrites(LocalStore(tmp_path), code=errno.ENOSPC, times=1)
    same = sk.CheckpointManager(tmp_path, storage=full, keep_last=3, keep_best=0, retry=QUICK, run_id=roomy.run_id)
    with pytest.raises(InjectedFault):
        same.save(tiny(3), step=3)
    assert full.left == 0 and committed(tmp_path) == ["step_00000001", "step_00000002"]
    # A tighter policy frees step 1 first; then the retry commits.
    full = FailingWrites(LocalStore(tmp_path), code=errno.ENOSPC, times=1)
    tight = sk.CheckpointManager(tmp_path, storage=full, keep_last=1, keep_best=0, retry=QUICK, run_id=roomy.run_id)
    assert tight.save(tiny(3), step=3).step == 3
    assert committed(tmp_path) == ["step_00000003"]


class LostCommitAnswer(FaultInjectingStore):
    """The rename that commits happens, then its answer is lost (EIO), once."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.lost = 0

    def rename(self, src: str, dst: str) -> None:
        super().rename(src, dst)
        if self.lost == 0 and dst.startswith("step_") and "/" not in dst:
            self.lost += 1
            raise InjectedFault(f"injected EIO after renaming {src}") from OSError(errno.EIO, "Input/output error")


def test_a_retry_after_the_commit_point_keeps_the_commit(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = LostCommitAnswer(LocalStore(tmp_path))
    manager = sk.CheckpointManager(tmp_path, storage=store, keep_last=2, keep_best=0, retry=QUICK)
    manager.save(tiny(1), step=1)  # the answer of this commit is lost; the retry finds the commit
    assert store.lost == 1 and committed(tmp_path) == ["step_00000001"]
    with caplog.at_level(logging.WARNING, logger="shardkeep"):
        entry = manager.save(tiny(2), step=2)
    assert entry.step == 2 and entry.is_newest and committed(tmp_path) == ["step_00000001", "step_00000002"]
    store.lost = 0
    with caplog.at_level(logging.WARNING, logger="shardkeep"):
        entry = manager.save(tiny(3), step=3)
    assert store.lost == 1 and entry.step == 3 and entry.is_newest and entry.verified
    assert committed(tmp_path) == ["step_00000002", "step_00000003"]  # retention ran after the kept commit
    assert any("committed by the attempt that failed" in record.getMessage() for record in caplog.records)
    assert torch.equal(sk.load(tmp_path / "step_00000003")["w"], tiny(3)["w"])


def test_eio_at_every_operation_of_a_managed_save_is_retried_or_after_the_commit(tmp_path: Path) -> None:
    (tmp_path / "probe").mkdir()
    probe = FaultInjectingStore(LocalStore(tmp_path / "probe"))
    sk.CheckpointManager(tmp_path / "probe", storage=probe, keep_last=1, keep_best=0, run_id="run").save(
        tiny(1), step=1
    )
    before = probe.operation_count
    sk.CheckpointManager(tmp_path / "probe", storage=probe, keep_last=1, keep_best=0, run_id="run").save(
        tiny(2), step=2
    )
    total = probe.operation_count - before
    outcomes = {"retried": 0, "retention failed": 0}
    for at in range(1, total + 1):
        root = tmp_path / f"at{at}"
        root.mkdir()
        sk.CheckpointManager(root, keep_last=1, keep_best=0, run_id="run").save(tiny(1), step=1)
        store = FaultInjectingStore(LocalStore(root), fail_at=10**9)
        manager = sk.CheckpointManager(root, storage=store, keep_last=1, keep_best=0, run_id="run", retry=QUICK)
        store._counter.fail_at = store.operation_count + at
        try:
            entry = manager.save(tiny(2), step=2)
            assert entry.step == 2 and entry.verified, at
            outcomes["retried"] += 1
        except RetentionError:  # after the commit: never retried, the checkpoint stands
            outcomes["retention failed"] += 1
        assert store.operation_count > store._counter.fail_at - 1, at  # the fault was injected
        assert sk.verify(root / "step_00000002").ok, at
        assert torch.equal(sk.load(root / "step_00000002")["w"], tiny(2)["w"]), at
        assert not [name for name in os.listdir(root) if ".tmp-" in name], (at, os.listdir(root))
    assert outcomes["retried"] >= 10 and sum(outcomes.values()) == total, outcomes


def test_retry_must_be_a_policy(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="retry="):
        sk.CheckpointManager(tmp_path, retry=3)  # type: ignore[arg-type]  # the wrong type is the point


# --------------------------------------------------------------------------------------------
# Two real gloo ranks: one vote, the same attempt on every rank


def _retry_log() -> list[str]:
    """The messages this process logs on ``shardkeep.retry`` from now on (a warning per retry)."""
    return logged_messages("shardkeep.retry")


def _save_with_faults(rank: int, world_size: int, root: str, codes: dict[int, int], after: int = 0) -> dict[str, Any]:
    messages = _retry_log()
    inner = LocalStore(root)
    store = (
        FailingWrites(inner, code=codes[rank], times=1, after=after) if rank in codes else FaultInjectingStore(inner)
    )
    manager = sk.CheckpointManager(root, storage=store, keep_best=0, retry=QUICK, timeout=60)
    state = {"w": torch.arange(64, dtype=torch.float32) + rank, "shared": torch.ones(8)}
    try:
        entry = manager.save({"rank_part": {f"r{rank}": state["w"]}, "shared": state["shared"]}, step=1)
        outcome: dict[str, Any] = {"step": entry.step, "error": None}
    except sk.ShardkeepError as exc:
        outcome = {"step": None, "error": type(exc).__name__, "failures": getattr(exc, "failures", None)}
    outcome["retries"] = messages
    return outcome


@pytest.mark.parametrize(
    ("codes", "after", "retried"),
    [
        ({1: errno.EIO}, 0, True),  # only rank 1 fails, transiently: both ranks retry once
        ({1: errno.EACCES}, 0, False),  # only rank 1 fails, permanently: nobody retries
        ({0: errno.EIO, 1: errno.EACCES}, 0, False),  # one transient, one permanent: nobody retries
        # the coordinator's manifest write fails: rank 1 holds only the error re-raised by type
        ({0: errno.EIO}, 1, True),
        ({0: errno.EACCES}, 1, False),
    ],
)
def test_every_rank_retries_the_same_attempt_or_none(
    tmp_path: Path, codes: dict[int, int], after: int, retried: bool
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    results = results_or_raise(run_ranks(2, _save_with_faults, str(root), codes, after, outbox=tmp_path / "out"))
    if retried:
        assert [result["step"] for result in results] == [1, 1], results
        for result in results:
            assert len(result["retries"]) == 1 and "attempt 1 of 3" in result["retries"][0], results
        assert committed(root) == ["step_00000001"] and sk.verify(root / "step_00000001").ok
        loaded = sk.load(root / "step_00000001")
        assert torch.equal(loaded["rank_part"]["r1"], torch.arange(64, dtype=torch.float32) + 1)
    else:
        assert len({result["error"] for result in results}) == 1 and results[0]["error"], results
        assert [result["retries"] for result in results] == [[], []]
        assert committed(root) == []


def _rank_1_dies_while_writing(rank: int, world_size: int, root: str) -> dict[str, Any]:
    messages = _retry_log()
    inner = LocalStore(root)
    store = (
        FaultInjectingStore(inner, fail_at=1, fault=lambda _: os._exit(3)) if rank == 1 else FaultInjectingStore(inner)
    )
    manager = sk.CheckpointManager(root, storage=store, keep_best=0, retry=QUICK, timeout=5)
    try:
        manager.save({"rank_part": {f"r{rank}": torch.ones(64) * rank}}, step=1)  # every rank writes
    except sk.ShardkeepError as exc:
        return {"error": type(exc).__name__, "failures": getattr(exc, "failures", None), "retries": messages}
    return {"error": None, "retries": messages}


@pytest.mark.slow
def test_a_rank_that_dies_is_not_retried(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    outcomes = run_ranks(
        2, _rank_1_dies_while_writing, str(root), outbox=tmp_path / "out", timeout=60, allow_unfinished=frozenset({1})
    )
    kind, result = outcomes[0]
    assert kind == "ok", result
    assert result["error"] == "GroupBrokenError" and result["failures"] == {}, result
    assert result["retries"] == []
    assert committed(root) == []


# --------------------------------------------------------------------------------------------
# A real S3 server: a throttled write, retried


class Throttled(FaultInjectingStore):
    """The first object written is answered with S3's 503 SlowDown (a real botocore ClientError)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.throttled = 0

    def open_write(self, path: str) -> Any:
        if self.throttled == 0:
            from botocore.exceptions import ClientError as BotoClientError

            self.throttled += 1
            answer: Any = {"Error": {"Code": "SlowDown", "Message": "Please reduce your request rate."}}
            answer["ResponseMetadata"] = {"HTTPStatusCode": 503}
            raise StorageError(f"cannot write {path}") from BotoClientError(answer, "PutObject")
        return super().open_write(path)


@pytest.mark.slow
def test_a_throttled_s3_save_is_retried_and_commits(s3_root: tuple[str, dict[str, Any]]) -> None:
    from shardkeep.storage import FsspecStore

    root, options = s3_root
    store = Throttled(FsspecStore(root, options))
    manager = sk.CheckpointManager(root, storage=store, keep_best=0, retry=QUICK)
    assert manager.save(tiny(5), step=5).step == 5
    assert store.throttled == 1
    assert [entry.step for entry in manager.list(verify=True)] == [5]
