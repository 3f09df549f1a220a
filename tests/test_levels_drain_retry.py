"""The retries of a drain's plan and commit on the coordinator: a transient failure (EIO, an
object store's 503) at each store operation of the plan and of the commit is retried and the
step committed with the local step's manifest bytes; a permanent one is not retried; retries
that run out leave nothing; the retries stay within min(retry.deadline, half the coordinator's
timeout); past the commit point nothing is committed twice; two real gloo ranks."""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import shardkeep as sk
from shardkeep.distributed.coordinator import Coordinator
from shardkeep.errors import DrainError, StorageError
from shardkeep.levels.drain import COORDINATOR_RETRY_SHARE, Drain, DrainState
from shardkeep.names import MANIFEST_FILENAME, SIGNATURE_FILENAME
from shardkeep.retry import RetryPolicy
from shardkeep.storage import ForwardingStore, LocalStore
from shardkeep.storage.base import ReadHandle, StoreOperations, WriteHandle
from shardkeep.testing import FaultInjectingStore, InjectedFault
from tests.support.distributed_harness import results_or_raise, run_ranks
from tests.support.node_parts import split_into_nodes
from tests.test_levels_drain import NAME, SMALL_FILES, assert_drained, local_step, small_state

torch = pytest.importorskip("torch")

QUICK = RetryPolicy(attempts=3, initial_backoff=0.01, max_backoff=0.01)
ALWAYS = 10**6


def _fault(operation: str, code: int = errno.EIO) -> InjectedFault:
    """The failure a store gives: a StorageError caused by an OSError of ``code``."""
    error = InjectedFault(f"injected {errno.errorcode[code]} at {operation}")
    error.__cause__ = OSError(code, os.strerror(code), operation)
    return error


class Flaky(ForwardingStore):
    """Fails the first ``failures[operation]`` calls of each operation (on a path ending with
    ``match``) with an EIO (or ``code``), then lets them through. ``lost`` names operations
    whose first call is done and then reported failed (a lost response). ``renames=False``
    makes it an object store's protocol (create-only writes on a local directory). ``fault``
    makes the error (default: :func:`_fault` with ``code``)."""

    def __init__(
        self,
        inner: StoreOperations,
        failures: dict[str, int] | None = None,
        *,
        match: str = "",
        code: int = errno.EIO,
        lost: frozenset[str] = frozenset(),
        renames: bool | None = None,
        fault: Callable[[str], Exception] | None = None,
    ) -> None:
        super().__init__(inner)
        self.left = dict(failures or {})
        self.match = match
        self.lost = set(lost)
        self.renames = renames
        self.fault = fault or (lambda operation: _fault(operation, code))
        self.failed: list[str] = []

    @property
    def atomic_rename(self) -> bool:
        return self._atomic_rename if self.renames is None else self.renames

    def _before(self, operation: str, path: str) -> None:
        if self.left.get(operation, 0) > 0 and path.endswith(self.match):
            self.left[operation] -= 1
            self.failed.append(f"{operation} {path}")
            raise self.fault(f"{operation} {path}")

    def _after(self, operation: str, path: str) -> None:
        if operation in self.lost and path.endswith(self.match):
            self.lost.discard(operation)
            self.failed.append(f"{operation} {path} (done, answer lost)")
            raise self.fault(f"{operation} {path}")

    def open_write(self, path: str) -> WriteHandle:
        self._before("open_write", path)
        handle = super().open_write(path)
        if "commit" not in self.lost or self.match not in path:
            return handle
        store = self

        class LostCommit:
            def write(self, data: bytes | memoryview, /) -> None:
                handle.write(data)

            def commit(self) -> None:
                handle.commit()
                store._after("commit", path)

            def abort(self) -> None:
                handle.abort()

        return LostCommit()

    def open_read(self, path: str) -> ReadHandle:
        self._before("open_read", path)
        return super().open_read(path)

    def stat(self, path: str) -> Any:
        self._before("stat", path)
        return super().stat(path)

    def list_dir(self, path: str = "") -> Any:
        self._before("list_dir", path)
        return super().list_dir(path)

    def put_atomic(self, path: str, data: bytes) -> None:
        self._before("put_atomic", path)
        super().put_atomic(path, data)
        self._after("put_atomic", path)

    def rename(self, src: str, dst: str) -> None:
        self._before("rename", dst)
        super().rename(src, dst)
        self._after("rename", dst)

    def sync_dir(self, path: str) -> None:
        self._before("sync_dir", path)
        super().sync_dir(path)


def drain_once(local: Path, persistent: Any, coordinator: Coordinator | None = None, **kwargs: Any) -> DrainState:
    drain = Drain(local, NAME, persistent, coordinator or Coordinator(), [0], **kwargs)
    drain.start()
    return drain.wait(60)


def retries_logged(caplog: pytest.LogCaptureFixture, what: str) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.name == "shardkeep.levels.drain" and f"{what} failed" in record.getMessage()
    ]


def _phases(local: Path, persistent: Path) -> tuple[list[str], list[str], list[str]]:
    """The persistent store's operations of a drain: (plan, copy, commit), learned by counting."""
    counting = FaultInjectingStore(LocalStore(str(persistent)))
    assert drain_once(local, counting).state == "committed"
    operations = counting.operations
    for entry in os.listdir(persistent):
        LocalStore(str(persistent)).remove_tree(entry)
    first_copy = next(i for i, op in enumerate(operations) if op.startswith("open_write "))
    last_copy = max(i for i, op in enumerate(operations) if op.startswith("commit ") and "/shards/" in op)
    return operations[:first_copy], operations[first_copy : last_copy + 1], operations[last_copy + 1 :]


def _clear(persistent: Path) -> None:
    for entry in os.listdir(persistent):
        LocalStore(str(persistent)).remove_tree(entry)


# --------------------------------------------------------------------------------------------
# A transient failure at each operation of the plan and of the commit


def test_an_eio_at_each_plan_and_commit_operation_is_retried_and_commits(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    local = local_step(tmp_path)
    persistent = tmp_path / "persistent"
    persistent.mkdir()
    plan, copy, commit = _phases(local, persistent)
    assert [op.split(" ")[0] for op in plan] == ["stat", "stat"]  # the persistent manifest, begin
    kinds = {op.split(" ")[0] for op in commit}
    assert {"stat", "sync_dir", "open_write", "write", "commit", "rename"} <= kinds, commit
    cases = [(index, "planning") for index in range(1, len(plan) + 1)]
    cases += [(len(plan) + len(copy) + index, "committing") for index in range(1, len(commit) + 1)]
    for fail_at, phase in cases:
        caplog.clear()
        store = FaultInjectingStore(LocalStore(str(persistent)), fail_at=fail_at)
        with caplog.at_level(logging.WARNING, logger="shardkeep.levels.drain"):
            state = drain_once(local, store, retry=QUICK)
        operation = store.operations[fail_at - 1]
        assert state.state == "committed", (fail_at, operation, state)
        assert_drained(tmp_path, persistent)  # the local step's manifest bytes
        assert os.listdir(persistent) == [NAME], (fail_at, operation, os.listdir(persistent))
        logged = retries_logged(caplog, phase)
        assert len(logged) == 1 and "attempt 1 of 3" in logged[0] and "EIO" in logged[0], (fail_at, logged)
        _clear(persistent)


def test_an_eio_reading_the_local_manifest_is_retried(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    local = local_step(tmp_path)
    persistent = tmp_path / "persistent"
    persistent.mkdir()
    for what, operation in [("planning", "open_read"), ("committing", "open_read"), ("planning", "read")]:
        caplog.clear()
        drain = Drain(local, NAME, str(persistent), Coordinator(), [0], retry=QUICK)
        counting = FaultInjectingStore(LocalStore(str(local)))
        drain.local = counting
        drain.start()
        assert drain.wait(60).state == "committed"
        manifest_ops = [
            i for i, op in enumerate(counting.operations, 1) if op == f"{operation} {NAME}/{MANIFEST_FILENAME}"
        ]
        fail_at = manifest_ops[0 if what == "planning" else -1]
        _clear(persistent)
        drain = Drain(local, NAME, str(persistent), Coordinator(), [0], retry=QUICK)
        drain.local = FaultInjectingStore(LocalStore(str(local)), fail_at=fail_at)
        with caplog.at_level(logging.WARNING, logger="shardkeep.levels.drain"):
            drain.start()
            state = drain.wait(60)
        assert state.state == "committed", (what, state)
        assert_drained(tmp_path, persistent)
        assert len(retries_logged(caplog, what)) == 1, (what, caplog.text)
        _clear(persistent)


def test_an_eio_reading_the_persistent_manifest_of_a_drained_step_is_retried(tmp_path: Path) -> None:
    local = local_step(tmp_path)
    persistent = tmp_path / "persistent"
    persistent.mkdir()
    assert drain_once(local, str(persistent)).state == "committed"
    store = Flaky(LocalStore(str(persistent)), {"open_read": 1}, match=MANIFEST_FILENAME)
    again = drain_once(local, store, retry=QUICK)
    assert again.state == "committed" and again.bytes_copied == 0, again
    assert store.failed == [f"open_read {NAME}/{MANIFEST_FILENAME}"]


# --------------------------------------------------------------------------------------------
# Permanent failures, retries that run out, the bound


@pytest.mark.parametrize("phase", ["planning", "committing"])
def test_a_permanent_failure_in_the_plan_or_commit_is_not_retried(
    tmp_path: Path, phase: str, caplog: pytest.LogCaptureFixture
) -> None:
    local = local_step(tmp_path)
    persistent = tmp_path / "persistent"
    persistent.mkdir()
    plan, copy, _ = _phases(local, persistent)
    fail_at = 1 if phase == "planning" else len(plan) + len(copy) + 1
    store = FaultInjectingStore(LocalStore(str(persistent)), fail_at=fail_at, code=errno.EACCES)
    drain = Drain(local, NAME, store, Coordinator(), [0], retry=QUICK)
    with caplog.at_level(logging.WARNING, logger="shardkeep.levels.drain"):
        if phase == "planning":
            with pytest.raises(DrainError, match="EACCES"):
                drain.start()
            state = drain.poll()
        else:
            drain.start()
            state = drain.wait(60)
    assert state.state == "failed" and "EACCES" in str(state.error), state
    assert retries_logged(caplog, phase) == []
    assert os.listdir(persistent) == []


def test_retries_that_run_out_in_the_commit_leave_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    local = local_step(tmp_path)
    persistent = tmp_path / "persistent"
    persistent.mkdir()
    store = Flaky(LocalStore(str(persistent)), {"rename": ALWAYS}, match=NAME)
    with caplog.at_level(logging.WARNING, logger="shardkeep.levels.drain"):
        state = drain_once(local, store, retry=QUICK)
    assert state.state == "failed", state
    message = str(state.error)
    assert "committing failed on attempt 3 of 3" in message and "EIO" in message, message
    assert [m.split("attempt ")[1][:6] for m in retries_logged(caplog, "committing")] == ["1 of 3", "2 of 3"]
    assert len(store.failed) == 3
    assert os.listdir(persistent) == []  # nothing committed, the staging removed


def test_retries_that_run_out_in_the_plan_leave_nothing(tmp_path: Path) -> None:
    local = local_step(tmp_path)
    persistent = tmp_path / "persistent"
    persistent.mkdir()
    store = Flaky(LocalStore(str(persistent)), {"stat": ALWAYS})
    drain = Drain(local, NAME, store, Coordinator(), [0], retry=QUICK)
    with pytest.raises(DrainError, match="planning failed on attempt 3 of 3"):
        drain.start()
    assert drain.poll().state == "failed"
    assert os.listdir(persistent) == []


def test_the_retries_stay_within_half_the_coordinators_timeout(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    local = local_step(tmp_path)
    persistent = tmp_path / "persistent"
    persistent.mkdir()
    slow = RetryPolicy(attempts=10, initial_backoff=0.3, multiplier=1.0, max_backoff=0.3, deadline=600)
    store = Flaky(LocalStore(str(persistent)), {"rename": ALWAYS}, match=NAME)
    drain = Drain(local, NAME, store, Coordinator(timeout=1.0), [0], retry=slow)
    assert drain.retry_bound() == COORDINATOR_RETRY_SHARE * 1.0 == 0.5
    assert Drain(local, NAME, store, Coordinator(timeout=1.0), [0], retry=QUICK).retry_bound() == 0.5
    short = RetryPolicy(attempts=3, deadline=10)
    assert Drain(local, NAME, store, Coordinator(timeout=100), [0], retry=short).retry_bound() == 10
    drain.start()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="shardkeep.levels.drain"):
        state = drain.wait(60)
    assert state.state == "failed" and "bound" in str(state.error), state
    assert len(store.failed) == 2  # one wait of 0.3 s fits in 0.5 s, a second does not
    assert time.monotonic() - started < 0.5 + 0.5
    assert os.listdir(persistent) == []


# --------------------------------------------------------------------------------------------
# Past the commit point: never committed twice, never removed


def _signed_step(base: Path) -> Path:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    sk.save(small_state(), base / "src" / NAME, options=SMALL_FILES, signer=Ed25519PrivateKey.generate())
    split_into_nodes(base / "src" / NAME, [base / "local0"], [0])
    return base / "local0"


@pytest.mark.parametrize(
    ("renames", "match", "failures", "lost"),
    [
        (True, "shards", {"sync_dir": 2}, frozenset()),  # before the manifest: a data directory
        (True, MANIFEST_FILENAME, {"rename": 1}, frozenset()),  # the manifest's rename in the staging
        (True, MANIFEST_FILENAME, {}, frozenset({"rename"})),  # that rename done, its answer lost
        (True, NAME, {}, frozenset({"rename"})),  # the final rename done, its answer lost
        (False, MANIFEST_FILENAME, {"open_write": 1}, frozenset()),  # the create-only manifest not written
        (False, MANIFEST_FILENAME, {}, frozenset({"commit"})),  # the manifest written, its answer lost
        (False, SIGNATURE_FILENAME, {"put_atomic": 2}, frozenset()),  # the signature after the commit point
    ],
)
def test_a_commit_retried_around_the_commit_point_commits_once(
    tmp_path: Path, renames: bool, match: str, failures: dict[str, int], lost: frozenset[str]
) -> None:
    local = _signed_step(tmp_path)
    persistent = tmp_path / "persistent"
    persistent.mkdir()
    inner = LocalStore(str(persistent))
    store = Flaky(inner, failures, match=match, lost=lost, renames=renames)
    drain = Drain(local, NAME, store, Coordinator(), [0], retry=QUICK)
    drain.start()
    state = drain.wait(60)
    assert state.state == "committed", (failures, lost, store.failed, state)
    assert store.failed, "the fault was injected"
    assert_drained(tmp_path, persistent)
    assert (persistent / NAME / SIGNATURE_FILENAME).read_bytes() == (
        tmp_path / "src" / NAME / SIGNATURE_FILENAME
    ).read_bytes()
    assert sorted(os.listdir(persistent)) == [NAME]
    assert not any(entry.endswith(".tmp") for entry in os.listdir(persistent / NAME))


# --------------------------------------------------------------------------------------------
# Two real gloo ranks: the coordinator retries, the other rank waits in the broadcast


def _drain_with_a_flaky_coordinator(rank: int, world_size: int, base: str) -> dict[str, Any]:
    root = Path(base)
    node_of = list(range(world_size))
    coordinator = Coordinator(timeout=30)
    sk.save(small_state(), root / "src" / NAME, step=100, options=SMALL_FILES)
    if rank == 0:
        split_into_nodes(root / "src" / NAME, [root / f"node{n}" for n in range(world_size)], node_of)
    coordinator.barrier()
    persistent: Any = str(root / "persistent")
    if rank == 0:  # the plan's first stat and the final rename fail once, on the coordinator only
        persistent = Flaky(LocalStore(persistent), {"stat": 1, "rename": 1})
    drain = Drain(root / f"node{rank}", NAME, persistent, coordinator, node_of, retry=QUICK)
    drain.start()
    state = drain.wait(60)
    while state.state == "running":
        state = drain.wait(1)
    failed = persistent.failed if isinstance(persistent, Flaky) else []
    return {"state": state.state, "error": str(state.error or ""), "failed": failed}


def test_two_ranks_commit_after_the_coordinator_retried_its_plan_and_commit(tmp_path: Path) -> None:
    base = tmp_path / "run"
    (base / "persistent").mkdir(parents=True)
    results = results_or_raise(run_ranks(2, _drain_with_a_flaky_coordinator, str(base), outbox=tmp_path / "out"))
    assert [result["state"] for result in results] == ["committed", "committed"], results
    failed = results[0]["failed"]
    assert [entry.split(" ")[0] for entry in failed] == ["stat", "rename"], failed
    persistent = base / "persistent" / NAME
    assert sk.verify(persistent).ok, sk.verify(persistent).problems
    assert (persistent / MANIFEST_FILENAME).read_bytes() == (base / "src" / NAME / MANIFEST_FILENAME).read_bytes()
    assert sorted(os.listdir(base / "persistent")) == [NAME]


# --------------------------------------------------------------------------------------------
# A real S3 server (SeaweedFS): a 503 SlowDown at the commit


def _slow_down(operation: str) -> Exception:
    """S3's answer to a throttled request: a real botocore ClientError, 503 SlowDown."""
    from botocore.exceptions import ClientError

    answer: Any = {"Error": {"Code": "SlowDown", "Message": "Please reduce your request rate."}}
    answer["ResponseMetadata"] = {"HTTPStatusCode": 503}
    error = StorageError(f"S3 answered 503 SlowDown at {operation}")
    error.__cause__ = ClientError(answer, "PutObject")
    return error


@pytest.mark.slow
def test_a_slow_down_at_the_s3_commit_is_retried_and_commits_once(
    tmp_path: Path, s3_root: tuple[str, dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from shardkeep.storage import FsspecStore

    root, options = s3_root
    key = Ed25519PrivateKey.generate()
    sk.save(small_state(), tmp_path / "src" / NAME, options=SMALL_FILES, signer=key)
    split_into_nodes(tmp_path / "src" / NAME, [tmp_path / "local0"], [0])
    # The create-only manifest is written, and its answer is a 503 (a lost response); then the
    # signature's first write is answered 503.
    lost = Flaky(FsspecStore(root, options), match=MANIFEST_FILENAME, lost=frozenset({"commit"}), fault=_slow_down)
    store = Flaky(lost, {"put_atomic": 1}, match=SIGNATURE_FILENAME, fault=_slow_down)
    with caplog.at_level(logging.WARNING, logger="shardkeep.levels.drain"):
        state = drain_once(tmp_path / "local0", store, retry=QUICK)
    assert state.state == "committed", (state, lost.failed, store.failed)
    assert len(lost.failed) == 1 and len(store.failed) == 1, (lost.failed, store.failed)
    assert len(retries_logged(caplog, "committing")) == 2, caplog.text
    report = sk.verify(f"{root}/{NAME}", storage_options=options, public_key=key.public_key(), require_signature=True)
    assert report.ok, report.problems
    plain = FsspecStore(root, options)
    for name in (MANIFEST_FILENAME, SIGNATURE_FILENAME):
        handle = plain.open_read(f"{NAME}/{name}")
        found = bytearray(handle.size)
        handle.read_into(0, memoryview(found))
        handle.close()
        assert bytes(found) == (tmp_path / "src" / NAME / name).read_bytes(), name
    assert not any(entry.startswith("attempt-") for entry, _ in plain.list_dir(NAME))
