"""The manager under crashes: kill -9 at every storage operation of a save (retention
included), kill -9 at random moments of a save loop, and a hypothesis state machine over random
save / metric / crash / corruption / restart sequences."""

from __future__ import annotations

import os
import random
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import shardkeep as sk
from shardkeep.retention import CheckpointInfo, RetentionPolicy, decide
from shardkeep.storage.local import LocalStore
from shardkeep.testing import FaultInjectingStore

torch = pytest.importorskip("torch")

RUN = "crash-run"


def tiny(seed: int) -> dict[str, Any]:
    return {"w": torch.randn(32, generator=torch.Generator().manual_seed(seed)), "seed": seed}


def on_disk(root: Path) -> list[int]:
    return sorted(
        int(p.name[5:]) for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and "." not in p.name
    )


def leftovers(root: Path) -> list[str]:
    return [p.name for p in root.iterdir() if ".tmp-" in p.name or ".deleting-" in p.name]


def _kill_this_process(operation: str) -> None:
    """The fault of a simulated crash: kill -9 this process at the chosen store operation."""
    os.kill(os.getpid(), signal.SIGKILL)


def _save_in_child(root: Path, kill_at: int) -> bool:
    """Fork; the child saves step 3 and is killed at operation ``kill_at``. True if it was."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            store = FaultInjectingStore(LocalStore(root), fail_at=kill_at, fault=_kill_this_process)
            manager = sk.CheckpointManager(root, storage=store, keep_last=1, keep_best=1, run_id=RUN)
            manager.save(tiny(3), step=3, metrics={"val_loss": 0.5})
        except BaseException:
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFEXITED(status):
        assert os.WEXITSTATUS(status) == 0, "the child failed without being killed"
        return False
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def _check_after_crash(root: Path) -> None:
    steps = on_disk(root)
    assert steps in ([1, 2], [1, 2, 3], [2, 3], [1, 3], [3]), steps
    for step in steps:  # whatever was killed, every committed checkpoint verifies
        report = sk.verify(root / f"step_{step:08d}")
        assert report.ok, report.problems
    if 3 not in steps:
        assert steps == [1, 2]  # nothing is deleted before the new commit is durable
    for pointer in ("last", "best"):
        path = root / pointer
        if path.exists():
            assert path.read_text().strip().startswith("{")  # replaced atomically, never torn
    # the next manager (the coordinator of the resumed run) heals the root
    healer = sk.CheckpointManager(root, keep_last=1, keep_best=1, staging_lease=0)
    restored = healer.restore()
    assert restored.step == max(steps)
    healer.prune()
    assert on_disk(root) == ([3] if 3 in steps else [1, 2])
    assert leftovers(root) == []


@pytest.mark.slow
def test_kill_9_at_every_operation_of_a_managed_save(tmp_path: Path) -> None:
    template = tmp_path / "template"
    manager = sk.CheckpointManager(template, keep_last=1, keep_best=1, run_id=RUN)
    for step, metric in [(0, 2.0), (1, 1.0), (2, 3.0)]:
        manager.save(tiny(step), step=step, metrics={"val_loss": metric})
    probe = tmp_path / "probe"
    shutil.copytree(template, probe)
    counting = FaultInjectingStore(LocalStore(probe))
    sk.CheckpointManager(probe, storage=counting, keep_last=1, keep_best=1, run_id=RUN).save(
        tiny(3), step=3, metrics={"val_loss": 0.5}
    )
    operations = counting.operations
    commit_index = next(i for i, op in enumerate(operations, 1) if op.endswith("-> step_00000003"))
    killed_in_retention = 0
    for kill_at in range(1, len(operations) + 1):
        root = tmp_path / f"kill-{kill_at}"
        shutil.copytree(template, root)
        assert _save_in_child(root, kill_at), f"operation {kill_at} was never reached"
        killed_in_retention += kill_at > commit_index
        _check_after_crash(root)
        shutil.rmtree(root)
    # retention deletes two checkpoints, rewrites two pointers and looks for leftovers
    assert killed_in_retention >= 25, operations[commit_index:]


@pytest.mark.slow
def test_kill_9_at_random_moments_of_a_save_loop(tmp_path: Path) -> None:
    trials = 20
    rng = random.Random(1234)
    for trial in range(trials):
        root = tmp_path / f"loop-{trial}"
        sk.CheckpointManager(root, keep_last=1, keep_best=1, run_id=RUN).save(
            tiny(0), step=0, metrics={"val_loss": 5.0}
        )
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                manager = sk.CheckpointManager(root, keep_last=1, keep_best=1, run_id=RUN)
                for step in range(1, 10_000):
                    manager.save(tiny(step), step=step, metrics={"val_loss": (step * 7919) % 13 / 3})
            finally:
                os._exit(0)
        time.sleep(rng.uniform(0.05, 0.6))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        steps = on_disk(root)
        assert steps, "retention deleted every checkpoint"
        for step in steps:
            assert sk.verify(root / f"step_{step:08d}").ok
        healer = sk.CheckpointManager(root, keep_last=1, keep_best=1, staging_lease=0)
        assert healer.restore().step == max(steps)
        healer.prune()
        assert len(on_disk(root)) <= 2 and leftovers(root) == []
        shutil.rmtree(root)


# --------------------------------------------------------------------------------------------
# State machine
# --------------------------------------------------------------------------------------------


def _data_file(root: Path, step: int) -> Path:
    return next((root / f"step_{step:08d}").rglob("*.safetensors"))


class ManagerMachine(RuleBasedStateMachine):
    """The manager against a model: steps with metrics and damage flags, and the retention rule
    replayed on the model with the manager's verification depth (the newest is verified fully,
    older ones by manifest, file set and sizes)."""

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="sk-machine-"))
        self.model: dict[int, dict[str, Any]] = {}
        self.step = 0

    def teardown(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    @initialize(keep_last=st.integers(0, 3), keep_best=st.integers(0, 3), mode=st.sampled_from(["min", "max"]))
    def start(self, keep_last: int, keep_best: int, mode: str) -> None:
        self.policy = RetentionPolicy(keep_last=keep_last, keep_best=keep_best, mode=mode)  # type: ignore[arg-type]  # min/max
        self.manager = self._manager()

    def _manager(self, store: Any = None) -> sk.CheckpointManager:
        p = self.policy
        return sk.CheckpointManager(
            self.root, p.keep_last, p.keep_best, p.metric, p.mode, run_id=RUN, storage=store, staging_lease=0
        )

    def _truly_valid(self, step: int) -> bool:
        return not self.model[step]["truncated"] and not self.model[step]["flipped"]

    def _decide(self, *, everything: bool = False) -> Any:
        """The retention decision as the manager makes it: newest verified fully, older ones by
        quick checks, unless ``everything`` was verified fully (``list(verify=True)``)."""
        verified: dict[int, bool] = {}
        full_done = False
        for step in sorted(self.model, reverse=True):
            damage = self.model[step]
            if damage["truncated"]:
                verified[step] = False
            elif everything:
                verified[step] = not damage["flipped"]
            elif not full_done:
                verified[step] = not damage["flipped"]
                full_done = verified[step]
            else:
                verified[step] = True  # a flipped bit in an older checkpoint passes the quick check
        infos = [CheckpointInfo(f"step_{s:08d}", s, self.model[s]["metric"], verified[s]) for s in self.model]
        return decide(infos, self.policy)

    def _retain_model(self) -> None:
        decision = self._decide()
        self.model = {s: v for s, v in self.model.items() if f"step_{s:08d}" in decision.keep}

    @rule(metric=st.one_of(st.none(), st.floats(-5, 5, allow_nan=False), st.just(float("nan"))))
    def save(self, metric: float | None) -> None:
        self.step += 1
        entry = self.manager.save(
            tiny(self.step), step=self.step, metrics=None if metric is None else {"val_loss": metric}
        )
        assert entry.is_newest and entry.verified is True
        self.model[self.step] = {
            "metric": None if metric is None or metric != metric else metric,
            "truncated": False,
            "flipped": False,
        }
        self._retain_model()

    @rule(fail_at=st.integers(1, 70), metric=st.floats(-5, 5, allow_nan=False))
    def failing_save(self, fail_at: int, metric: float) -> None:
        self.step += 1
        store = FaultInjectingStore(LocalStore(self.root), fail_at=fail_at)
        try:
            self._manager(store).save(tiny(self.step), step=self.step, metrics={"val_loss": metric})
        except sk.ShardkeepError:
            pass
        if (self.root / f"step_{self.step:08d}").exists():
            self.model[self.step] = {"metric": metric, "truncated": False, "flipped": False}
        # a failure inside retention may have deleted part of what the policy drops: finish it
        self.manager.prune()
        self._retain_model()

    @rule()
    def flip_a_bit_in_the_newest(self) -> None:
        if self.model and not self.model[max(self.model)]["flipped"]:  # a second flip would undo it
            newest = max(self.model)
            path = _data_file(self.root, newest)
            with open(path, "r+b") as handle:
                handle.seek(-4, os.SEEK_END)
                value = handle.read(1)[0]
                handle.seek(-4, os.SEEK_END)
                handle.write(bytes([value ^ 0x10]))
            self.model[newest]["flipped"] = True

    @rule(data=st.data())
    def truncate_one(self, data: st.DataObject) -> None:
        if self.model:
            step = data.draw(st.sampled_from(sorted(self.model)))
            path = _data_file(self.root, step)
            os.truncate(path, os.path.getsize(path) - 1)
            self.model[step]["truncated"] = True

    @rule()
    def restart_and_restore(self) -> None:
        self.manager = self._manager()
        valid = [s for s in self.model if self._truly_valid(s)]
        if not self.model:
            with pytest.raises(sk.CheckpointNotFoundError):
                self.manager.restore()
        elif not valid:
            with pytest.raises(sk.IntegrityError):
                self.manager.restore()
        else:
            restored = self.manager.restore()
            assert restored.step == max(valid)
            assert torch.equal(restored.state["w"], tiny(max(valid))["w"])

    @invariant()
    def kept_checkpoints_equal_the_policy(self) -> None:
        if hasattr(self, "manager"):
            assert on_disk(self.root) == sorted(self.model)

    @invariant()
    def the_best_is_the_true_best(self) -> None:
        if not hasattr(self, "manager") or not self.model:
            return
        decision = self._decide(everything=True)
        best = self.manager.best(verify=True)
        expected = decision.best[0] if decision.best else None
        assert (best.name if best else None) == expected
        if best is not None and best.metric is not None:
            sign = 1 if self.policy.mode == "min" else -1
            measured = [
                sign * self.model[s]["metric"]
                for s in self.model
                if self.model[s]["metric"] is not None and not self.model[s]["truncated"]
            ]
            # nothing better survives unflagged, except flipped ones the quick check cannot see
            assert sign * best.metric <= min(measured) or any(self.model[s]["flipped"] for s in self.model)

    @invariant()
    def the_newest_valid_checkpoint_exists_and_verifies(self) -> None:
        valid = [s for s in self.model if self._truly_valid(s)]
        if valid:
            assert sk.verify(self.root / f"step_{max(valid):08d}").ok
            latest = self.manager.latest(verify=True)
            assert latest is not None and latest.step == max(valid)


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(
    max_examples=40,
    stateful_step_count=14,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
