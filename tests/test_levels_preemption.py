"""The preemption handler of MultiLevelManager.

In process: installing (twice, off the main thread, an uncatchable signal), the flag-only
handler and its debouncing, the agreement, the emergency save and its exit codes, a repeat
signal that stops the emergency save's writes (nothing committed), drains settled or abandoned.

With real signals on real processes (``tests/support/preempt_train.py``, 1 process and 2 or 4
gloo ranks as nodes of two ranks): SIGTERM, delivered twice at once as torchrun plus SLURM do,
at a random moment of a step, during a drain, and a second SIGTERM during the emergency save.
After each: every committed checkpoint on every level verifies, nothing is left half committed,
the exit code says what happened, and the resumed run's losses and final state equal an
uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import shardkeep as sk
from shardkeep.distributed.coordinator import Coordinator
from shardkeep.levels.preemption import EXIT_PREEMPTED, EXIT_PREEMPTED_ABORTED, PreemptionHandler
from shardkeep.levels.status import level_copies
from shardkeep.writes import WriteControl, stop_writes_on
from tests.support import preempt_train
from tests.support.distributed_harness import free_port, results_or_raise, run_ranks

REPOSITORY = Path(__file__).resolve().parents[1]
SOURCE = Path(sk.__file__).resolve().parents[1]


# -- in process ----------------------------------------------------------------------------------
@pytest.fixture
def handlers() -> Iterator[list[PreemptionHandler]]:
    """Handlers a test installs; uninstalled afterwards whatever happened."""
    made: list[PreemptionHandler] = []
    yield made
    for handler in made:
        handler.uninstall()


def _local_levels(tmp_path: Path, *, every: int = 2, drain: bool = False) -> list[sk.Level]:
    levels = [
        sk.Level(
            "local",
            str(tmp_path / "node{node}"),
            node_local=True,
            save_policy=sk.SavePolicy(every_steps=every),
            retention=sk.RetentionPolicy(keep_last=2, keep_best=1, metric="loss"),
        )
    ]
    if drain:
        levels.append(
            sk.Level(
                "persistent", str(tmp_path / "persistent"), source="drain", save_policy=sk.SavePolicy(every_steps=every)
            )
        )
    return levels


def test_installing_twice_off_the_main_thread_or_for_sigkill_is_refused(
    tmp_path: Path, handlers: list[PreemptionHandler]
) -> None:
    manager = sk.MultiLevelManager(_local_levels(tmp_path))
    handlers.append(manager.handle_preemption(grace_seconds=5))
    with pytest.raises(sk.PreemptionHandlerError, match=r"already installed for SIGTERM"):
        manager.handle_preemption()
    with pytest.raises(sk.PreemptionHandlerError, match=r"already installed for SIGTERM"):
        sk.MultiLevelManager(_local_levels(tmp_path / "other")).handle_preemption()
    assert isinstance(sk.PreemptionHandlerError("x"), sk.ConfigError)
    caught: list[BaseException] = []

    def install_in_a_thread() -> None:
        try:
            PreemptionHandler([signal.SIGUSR2]).install()
        except BaseException as exc:
            caught.append(exc)

    thread = threading.Thread(target=install_in_a_thread, name="trainer-thread")
    thread.start()
    thread.join()
    assert len(caught) == 1 and isinstance(caught[0], sk.PreemptionHandlerError)
    assert "main thread" in str(caught[0]) and "trainer-thread" in str(caught[0])
    with pytest.raises(sk.PreemptionHandlerError, match="SIGKILL cannot be caught"):
        PreemptionHandler([signal.SIGKILL])
    with pytest.raises(sk.ConfigError, match="exit_code=0"):
        PreemptionHandler(exit_code=0)
    with pytest.raises(sk.ConfigError, match="must differ"):
        PreemptionHandler(exit_code=9, aborted_exit_code=9)
    with pytest.raises(sk.ConfigError, match="grace_seconds"):
        PreemptionHandler(grace_seconds=-1)
    # close() gives the signal back: another manager may install then
    manager.close()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    handlers.clear()
    other = sk.MultiLevelManager(_local_levels(tmp_path / "other"))
    handlers.append(other.handle_preemption())
    other.close()
    handlers.clear()


def test_the_handler_only_records_and_debounces_the_double_delivery(handlers: list[PreemptionHandler]) -> None:
    now = [100.0]
    handler = PreemptionHandler([signal.SIGUSR1], debounce_seconds=1.0, clock=lambda: now[0])
    handler.install()
    handlers.append(handler)
    coordinator = Coordinator(None)
    assert handler.agree(0, coordinator) is None
    signal.raise_signal(signal.SIGUSR1)
    now[0] += 0.01
    signal.raise_signal(signal.SIGUSR1)  # torchrun's forward: the same preemption
    assert (handler.received, handler.duplicates, handler.repeat.is_set()) == (2, 1, False)
    assert handler.agree(0, coordinator) is None  # cached for step 0
    decision = handler.agree(1, coordinator)
    assert decision is not None and decision.signal_name == "SIGUSR1" and not decision.abort
    assert decision.signaled_ranks == (0,) and decision.seconds_since_signal == pytest.approx(0.01)
    now[0] += 2.0
    signal.raise_signal(signal.SIGUSR1)  # a repeat, later than the debounce
    assert handler.repeat.is_set()
    repeated = handler.agree(2, coordinator)
    assert repeated is not None and repeated.abort


def test_a_stopped_scope_stops_the_writes_begun_inside_it() -> None:
    event = threading.Event()
    outside = WriteControl()
    with stop_writes_on(event):
        inside = WriteControl()
    assert not inside.stopped()
    event.set()
    assert inside.stopped() and not outside.stopped()


def _state(value: float) -> dict[str, Any]:
    return {"w": torch.full((64, 64), value), "step": int(value)}


def _train_in_process(manager: sk.MultiLevelManager, signal_at: int, steps: int = 10) -> int:
    for step in range(steps):
        if step == signal_at:
            signal.raise_signal(signal.SIGTERM)
        if manager.should_save(step):
            manager.save(_state(float(step)), step=step, metrics={"loss": 1.0 / (step + 1)})
    return steps


def test_a_signal_ends_in_one_emergency_save_and_exit_75(tmp_path: Path, handlers: list[PreemptionHandler]) -> None:
    manager = sk.MultiLevelManager(_local_levels(tmp_path, every=4))
    handler = manager.handle_preemption(grace_seconds=10)
    handlers.append(handler)
    with pytest.raises(SystemExit) as exited:
        _train_in_process(manager, signal_at=5)
    assert exited.value.code == EXIT_PREEMPTED
    assert handler.outcome is not None and handler.outcome.saved == "step_00000005"
    committed = sorted(p.name for p in (tmp_path / "node0").iterdir() if (p / "manifest.json").exists())
    assert committed == ["step_00000004", "step_00000005"]
    for name in committed:
        assert sk.verify(tmp_path / "node0" / name).ok
    restored = sk.MultiLevelManager(_local_levels(tmp_path, every=4)).restore()
    assert restored is not None and restored.step == 5 and restored.state["step"] == 5


def test_a_signal_at_a_saved_step_does_not_save_it_twice(tmp_path: Path, handlers: list[PreemptionHandler]) -> None:
    manager = sk.MultiLevelManager(_local_levels(tmp_path, every=2))
    manager.save(_state(2.0), step=2, metrics={"loss": 0.5})
    handler = manager.handle_preemption()
    handlers.append(handler)
    signal.raise_signal(signal.SIGTERM)
    assert manager.preempted(2) and manager.preempted(2)  # one agreement per step, cached
    with pytest.raises(SystemExit) as exited:
        manager.save(_state(2.0), step=2, metrics={"loss": 0.5})
    assert exited.value.code == EXIT_PREEMPTED and handler.outcome is not None
    assert handler.outcome.saved == "step_00000002"


def test_a_repeat_signal_during_the_emergency_save_aborts_it(
    tmp_path: Path, handlers: list[PreemptionHandler], monkeypatch: pytest.MonkeyPatch
) -> None:
    import shardkeep.saving.job as job_module

    manager = sk.MultiLevelManager(_local_levels(tmp_path, every=4), options=sk.WriteOptions(byte_budget=1 << 20))
    handler = manager.handle_preemption(grace_seconds=10)
    handler.debounce_seconds = 0.0
    handlers.append(handler)
    original = job_module.write_shards
    writes: list[int] = []

    def second_signal_while_writing(*args: Any, on_bytes: Callable[[int], None] | None = None, **kw: Any) -> Any:
        def written(count: int) -> None:
            if handler.emergency_started is None:
                return
            writes.append(count)
            if len(writes) == 1:
                os.kill(os.getpid(), signal.SIGTERM)  # from a writer thread: Python runs it on the main one
                time.sleep(0.2)

        return original(*args, on_bytes=written, **kw)

    monkeypatch.setattr(job_module, "write_shards", second_signal_while_writing)
    with pytest.raises(SystemExit) as exited:
        _train_in_process(manager, signal_at=6)
    assert exited.value.code == EXIT_PREEMPTED_ABORTED
    assert handler.outcome is not None and handler.outcome.saved is None
    assert "second SIGTERM" in handler.outcome.reason
    names = sorted(p.name for p in (tmp_path / "node0").iterdir())
    assert names == ["step_00000000", "step_00000004"]  # nothing of step 6, not even its staging
    for name in names:
        assert sk.verify(tmp_path / "node0" / name).ok


def test_a_repeat_before_the_emergency_save_skips_it(tmp_path: Path, handlers: list[PreemptionHandler]) -> None:
    manager = sk.MultiLevelManager(_local_levels(tmp_path, every=4))
    handler = manager.handle_preemption()
    handler.debounce_seconds = 0.0
    handlers.append(handler)
    manager.save(_state(0.0), step=0, metrics={"loss": 1.0})
    signal.raise_signal(signal.SIGTERM)
    signal.raise_signal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exited:
        manager.save(_state(1.0), step=1, metrics={"loss": 1.0})
    assert exited.value.code == EXIT_PREEMPTED_ABORTED
    assert sorted(p.name for p in (tmp_path / "node0").iterdir()) == ["step_00000000"]


def test_a_drain_in_flight_is_abandoned_within_the_grace_period(
    tmp_path: Path, handlers: list[PreemptionHandler], monkeypatch: pytest.MonkeyPatch
) -> None:
    import shardkeep.levels.drain as drain_module

    original = drain_module.copy_with_digest
    release = threading.Event()

    def stuck_copy(*args: Any, **kwargs: Any) -> Any:
        stop = kwargs["stop"]
        while not (stop.is_set() or release.is_set()):  # a drain slower than the grace period
            time.sleep(0.01)
        return original(*args, **kwargs)

    monkeypatch.setattr(drain_module, "copy_with_digest", stuck_copy)
    manager = sk.MultiLevelManager(_local_levels(tmp_path, every=2, drain=True))
    handler = manager.handle_preemption(grace_seconds=1.0)
    handlers.append(handler)
    manager.save(_state(0.0), step=0, metrics={"loss": 1.0})  # the drain of step 0 starts
    signal.raise_signal(signal.SIGTERM)
    started = time.monotonic()
    with pytest.raises(SystemExit) as exited:
        try:
            manager.save(_state(1.0), step=1, metrics={"loss": 1.0})
        finally:
            release.set()
    assert exited.value.code == EXIT_PREEMPTED
    assert time.monotonic() - started < 5
    assert handler.outcome is not None and handler.outcome.saved == "step_00000001"
    assert any("abandoned" in line for line in handler.outcome.drains), handler.outcome.drains
    assert not (tmp_path / "persistent").exists() or not [
        p for p in (tmp_path / "persistent").iterdir() if p.name.startswith("step_")
    ]


def _signal_one_rank(rank: int, world_size: int, root: str) -> dict[str, Any]:
    manager = sk.MultiLevelManager(_local_levels(Path(root), every=4), node_of=lambda r: r // 2, timeout=60)
    handler = manager.handle_preemption(grace_seconds=10)
    try:
        for step in range(10):
            if step == 3 and rank == world_size - 1:
                signal.raise_signal(signal.SIGTERM)
            if manager.should_save(step):
                manager.save(_state(float(step)), step=step, metrics={"loss": 1.0})
    except SystemExit as exited:
        assert handler.outcome is not None
        outcome = handler.outcome
        return {"code": exited.code, "saved": outcome.saved, "step": outcome.step, "replicas": outcome.replicas}
    finally:
        handler.uninstall()
    return {"code": None}


def test_a_signal_on_one_rank_is_agreed_by_every_rank_at_the_same_step(tmp_path: Path) -> None:
    """... and the emergency checkpoint gets its peer replicas within the grace period, so it
    survives the loss of either node."""
    outcomes = results_or_raise(run_ranks(4, _signal_one_rank, str(tmp_path), outbox=tmp_path / "out"))
    protected = "step 3 is protected (every part has its replicas)"
    assert outcomes == [{"code": EXIT_PREEMPTED, "saved": "step_00000003", "step": 3, "replicas": protected}] * 4
    for node in (0, 1):
        assert sk.verify(tmp_path / f"node{node}" / "step_00000003").ok
        assert level_copies("local", str(tmp_path / f"node{node}"))[-1].state == "protected"
    assert sorted(p.name for p in (tmp_path / "node1").iterdir()) == ["step_00000000", "step_00000003"]


# -- real signals on real processes --------------------------------------------------------------
class _Rank:
    """One rank of a run: a process forked from this one that runs ``tests/support/preempt_train.py``
    (no interpreter start and no import of torch per rank), with what of :class:`subprocess.Popen`
    the tests use."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
            elif time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            else:
                time.sleep(0.01)
        return self.returncode


def _launch(root: Path, world: int, run: str, **env: Any) -> list[_Rank]:
    port = free_port()
    processes = []
    root.mkdir(parents=True, exist_ok=True)
    for rank in range(world):
        environment = {
            **os.environ,
            "PYTHONPATH": f"{SOURCE}{os.pathsep}{REPOSITORY}",
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "PREEMPT_RUN": run,
            **{key: str(value) for key, value in env.items()},
        }
        processes.append(_Rank(preempt_train.forked(root, environment, root / f"run{run}-rank{rank}.log")))
    return processes


def _wait(processes: list[_Rank], root: Path, run: str, timeout: float = 240) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for process in processes:
        try:
            codes.append(process.wait(max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            for other in processes:
                other.wait(30)
            raise AssertionError(f"run {run} hung; logs:\n{_logs(root, run)}") from None
    return codes


def _logs(root: Path, run: str) -> str:
    return "\n".join(path.read_text(errors="replace")[-3000:] for path in sorted(root.glob(f"run{run}-rank*.log")))


def _until(condition: Callable[[], bool], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _steps_logged(root: Path) -> int:
    path = root / "losses-rank0.jsonl"
    return sum(1 for line in path.read_text().splitlines() if '"loss"' in line) if path.exists() else 0


def _terminate(processes: list[_Rank], *, twice: bool = True, only: int | None = None) -> None:
    """SIGTERM to each rank (or rank ``only``), twice at once when ``twice`` (the scheduler's and
    the launcher's), a few milliseconds apart between ranks."""
    for rank, process in enumerate(processes):
        if only is not None and rank != only:
            continue
        process.send_signal(signal.SIGTERM)
        if twice:
            process.send_signal(signal.SIGTERM)
        time.sleep(random.uniform(0, 0.02))


def _losses(root: Path, world: int) -> dict[int, float]:
    """Per step the loss of the run that last computed it (a resumed run recomputes the steps
    after the step it restored)."""
    found: dict[int, float] = {}
    for line in (root / "losses-rank0.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "restored" in record:
            for step in [s for s in found if s > record["restored"]]:
                del found[step]
        else:
            found[record["step"]] = record["loss"]
    return found


def _committed_everywhere_verifies(root: Path) -> list[str]:
    """Every committed step of every level verifies, and no staging directory is left behind;
    returns the committed local steps of node 0."""
    for level in [p for p in root.iterdir() if p.is_dir() and (p.name.startswith("node") or p.name == "persistent")]:
        for copy in level.iterdir():
            assert ".tmp-" not in copy.name, f"left half done: {copy}"
            if (copy / "manifest.json").exists():
                report = sk.verify(copy)
                assert report.ok, (copy, report.problems)
    return sorted(p.name for p in (root / "node0").iterdir() if (p / "manifest.json").exists())


_REFERENCES: dict[tuple[int, str], tuple[dict[int, float], list[Any]]] = {}

#: Knobs that only slow a run down, to widen the windows a signal is aimed at: the runs no signal
#: is sent to (the uninterrupted reference and the resume) go without them. The batches, the
#: values and the saves do not depend on them.
WAITS = ("PREEMPT_STEP_SECONDS", "PREEMPT_SLOW_WRITE", "PREEMPT_SLOW_DRAIN")


def _unhurried(env: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in env.items() if key not in WAITS}


def _reference(tmp_path_factory: pytest.TempPathFactory, world: int, **env: Any) -> tuple[dict[int, float], list[Any]]:
    """The losses and final state of an uninterrupted run (computed once per world and knobs)."""
    env = _unhurried(env)
    key = (world, json.dumps(env, sort_keys=True))
    if key not in _REFERENCES:
        root = tmp_path_factory.mktemp(f"reference{world}")
        codes = _wait(_launch(root, world, "ref", PREEMPT_HANDLE=0, **env), root, "ref")
        assert codes == [0] * world, _logs(root, "ref")
        finals = [json.loads((root / f"final-rank{rank}.json").read_text()) for rank in range(world)]
        _REFERENCES[key] = (_losses(root, world), finals)
    return _REFERENCES[key]


def _resume_and_compare(root: Path, world: int, reference: tuple[dict[int, float], list[Any]], **env: Any) -> None:
    codes = _wait(_launch(root, world, "resume", **_unhurried(env)), root, "resume")
    assert codes == [0] * world, _logs(root, "resume")
    losses, finals = reference
    assert _losses(root, world) == losses
    for rank in range(world):
        assert json.loads((root / f"final-rank{rank}.json").read_text()) == finals[rank]
    _committed_everywhere_verifies(root)


STEP_RUN = {"PREEMPT_STEPS": 10, "PREEMPT_STEP_SECONDS": 0.25}


@pytest.mark.parametrize("world", [1, 2])
def test_sigterm_at_a_random_moment_of_a_step(
    world: int, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    seed = random.randrange(1 << 30)
    chooser = random.Random(seed)
    reference = _reference(tmp_path_factory, world, **STEP_RUN)
    processes = _launch(tmp_path, world, "0", **STEP_RUN)
    after = chooser.randrange(1, 7)
    _until(lambda: _steps_logged(tmp_path) >= after, f"step {after}")
    time.sleep(chooser.uniform(0, 0.25))
    _terminate(processes)
    codes = _wait(processes, tmp_path, "0")
    assert codes == [EXIT_PREEMPTED] * world, (seed, _logs(tmp_path, "0"))
    logged = _steps_logged(tmp_path)
    committed = _committed_everywhere_verifies(tmp_path)
    # the step the ranks agreed at is the last one trained, and it is committed locally
    assert f"step_{logged - 1:08d}" in committed, (seed, committed, logged)
    assert "emergency checkpoint step_" in _logs(tmp_path, "0")
    _resume_and_compare(tmp_path, world, reference, **STEP_RUN)


@pytest.mark.slow
@pytest.mark.parametrize("world", [4])  # 2 nodes of 2 ranks; 2 ranks: the in-process test above
def test_sigterm_to_one_rank_is_agreed_by_every_rank(
    world: int, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    reference = _reference(tmp_path_factory, world, **STEP_RUN)
    processes = _launch(tmp_path, world, "0", **STEP_RUN)
    _until(lambda: _steps_logged(tmp_path) >= 3, "step 3")
    _terminate(processes, twice=False, only=world - 1)
    codes = _wait(processes, tmp_path, "0")
    assert codes == [EXIT_PREEMPTED] * world, _logs(tmp_path, "0")
    _committed_everywhere_verifies(tmp_path)
    _resume_and_compare(tmp_path, world, reference, **STEP_RUN)


DRAIN_RUN = {
    "PREEMPT_STEPS": 10,
    "PREEMPT_STEP_SECONDS": 0.05,
    "PREEMPT_ROWS": 4096,
    "PREEMPT_SLOW_DRAIN": 0.05,
    "PREEMPT_GRACE": 2,
}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2])
def test_sigterm_during_a_drain(world: int, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    reference = _reference(tmp_path_factory, world, **DRAIN_RUN)
    processes = _launch(tmp_path, world, "0", **DRAIN_RUN)
    persistent = tmp_path / "persistent"

    def draining() -> bool:
        return persistent.exists() and any(".tmp-" in p.name for p in persistent.iterdir())

    _until(draining, "a drain in flight")
    time.sleep(random.uniform(0, 0.2))
    _terminate(processes)
    codes = _wait(processes, tmp_path, "0")
    assert codes == [EXIT_PREEMPTED] * world, _logs(tmp_path, "0")
    _committed_everywhere_verifies(tmp_path)
    assert "drains: persistent" in _logs(tmp_path, "0")
    _resume_and_compare(tmp_path, world, reference, **DRAIN_RUN)


SAVE_RUN = {
    "PREEMPT_STEPS": 10,
    "PREEMPT_STEP_SECONDS": 0.05,
    "PREEMPT_ROWS": 1024,
    "PREEMPT_SLOW_WRITE": 0.4,
    "PREEMPT_DEBOUNCE": 0.3,
    "PREEMPT_LOCAL_EVERY": 3,
    "PREEMPT_PERSIST_EVERY": 3,
}


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 4])
def test_a_second_sigterm_during_the_emergency_save_aborts_it_cleanly(
    world: int, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    reference = _reference(tmp_path_factory, world, **SAVE_RUN)
    processes = _launch(tmp_path, world, "0", **SAVE_RUN)
    _until(lambda: _steps_logged(tmp_path) >= 4, "step 4")
    _terminate(processes)
    signaled = time.monotonic()
    _until(lambda: "emergency save of step" in _logs(tmp_path, "0"), "the emergency save")
    time.sleep(max(0.0, signaled + 0.4 - time.monotonic()) + random.uniform(0, 0.1))
    _terminate(processes, twice=False, only=random.randrange(world))
    codes = _wait(processes, tmp_path, "0")
    assert codes == [EXIT_PREEMPTED_ABORTED] * world, _logs(tmp_path, "0")
    logged = _steps_logged(tmp_path)
    committed = _committed_everywhere_verifies(tmp_path)
    assert f"step_{logged - 1:08d}" not in committed
    for node in range(max(1, world // 2)):
        assert not [p for p in (tmp_path / f"node{node}").iterdir() if p.name.startswith(f"step_{logged - 1:08d}")]
    _resume_and_compare(tmp_path, world, reference, **SAVE_RUN)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2])
def test_sigterm_during_a_local_save(world: int, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The save in progress completes (the flag is read at the next step boundary), then the
    next step is trained and saved as the emergency checkpoint."""
    reference = _reference(tmp_path_factory, world, **SAVE_RUN)
    processes = _launch(tmp_path, world, "0", **SAVE_RUN)
    node0 = tmp_path / "node0"

    def saving() -> bool:
        return _steps_logged(tmp_path) >= 2 and node0.exists() and any(".tmp-" in p.name for p in node0.iterdir())

    _until(saving, "a local save in progress")
    in_progress = _steps_logged(tmp_path) - 1
    time.sleep(random.uniform(0, 0.3))
    _terminate(processes)
    codes = _wait(processes, tmp_path, "0")
    assert codes == [EXIT_PREEMPTED] * world, _logs(tmp_path, "0")
    committed = _committed_everywhere_verifies(tmp_path)
    assert f"step_{in_progress:08d}" in committed and f"step_{in_progress + 1:08d}" in committed, committed
    _resume_and_compare(tmp_path, world, reference, **SAVE_RUN)
