"""An async save that the script never waits for: at interpreter exit (normal, or after Ctrl-C)
the save completes or is cleaned up, a warning says which, and a manager's pointers never lag
a committed save. Each case runs a real script in a subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import shardkeep as sk

# A state large enough that the background write is still running when the script's last line
# returns (64 MiB: a few hundred milliseconds on this machine).
_PRELUDE = """
import sys, time, torch, shardkeep as sk
root = sys.argv[1]
torch.manual_seed(0)
state = {"w": torch.randn(16 * 2**20), "step": 3}
"""


def _run(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(_PRELUDE) + textwrap.dedent(body))
    return subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpts")],
        capture_output=True,
        text=True,
        timeout=240,
    )


def _leftovers(root: Path) -> list[str]:
    return sorted(path.name for path in root.iterdir() if ".tmp-" in path.name) if root.exists() else []


def test_an_unwaited_async_save_as_the_last_line_commits_before_exit(tmp_path: Path) -> None:
    done = _run(tmp_path, 'sk.async_save(state, f"{root}/step_00000003")\n')
    assert done.returncode == 0, done.stderr
    assert "RuntimeError" not in done.stderr
    checkpoint = tmp_path / "ckpts" / "step_00000003"
    assert sk.verify(checkpoint).ok
    assert sk.load(checkpoint)["step"] == 3
    assert "waiting for the async save" in done.stderr
    assert "committed" in done.stderr


def test_an_unwaited_manager_save_commits_and_its_pointers_name_it(tmp_path: Path) -> None:
    body = """
    manager = sk.CheckpointManager(root, keep_last=2, keep_best=1)
    manager.async_save(state, step=1, metrics={"val_loss": 2.0})
    manager.async_save(state, step=2, metrics={"val_loss": 1.0})
    """
    done = _run(tmp_path, body)
    assert done.returncode == 0, done.stderr
    root = tmp_path / "ckpts"
    assert [entry.step for entry in sk.CheckpointManager(root).list(verify=True)] == [1, 2]
    for pointer in ("last", "best"):
        assert json.loads((root / pointer).read_text())["checkpoint"] == "step_00000002", pointer


def test_a_save_that_fails_in_the_background_is_reported_at_exit(tmp_path: Path) -> None:
    # The script never calls result(): the failure must still be said, and nothing is left.
    body = """
    import os
    from shardkeep.storage import LocalStore

    class FailingStore(LocalStore):
        def open_write(self, path):
            if path.endswith(".safetensors"):
                time.sleep(0.5)  # after the script's last line has returned
                raise sk.StorageError(f"{path}: injected EIO")
            return super().open_write(path)

    os.makedirs(root)
    sk.async_save(state, "step_00000003", storage=FailingStore(root))
    """
    done = _run(tmp_path, body)
    assert done.returncode == 0, done.stderr
    assert "failed" in done.stderr and "injected EIO" in done.stderr, done.stderr
    assert sorted(os.listdir(tmp_path / "ckpts")) == []


def _start_training(tmp_path: Path, body: str) -> subprocess.Popen[str]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_PRELUDE) + textwrap.dedent(body))
    return subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "ckpts")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


_TRAINING = """
from shardkeep.storage import LocalStore
import os

class SlowStore(LocalStore):
    # Each file write is slowed so that the save is surely in flight when the signal comes.
    def open_write(self, path):
        handle = super().open_write(path)
        write = handle.write
        def slow(data, /):
            time.sleep(0.2)
            write(data)
        handle.write = slow
        return handle

os.makedirs(root, exist_ok=True)
state = {f"w{i}": torch.randn(2**18) for i in range(16)}  # 16 writes of 1 MiB: about 3 s
state["step"] = 3
{save}
print("saving", flush=True)
while True:  # training goes on until Ctrl-C
    time.sleep(0.01)
"""


def _interrupt(process: subprocess.Popen[str], times: int) -> tuple[int, str]:
    assert process.stdout is not None and process.stderr is not None
    assert process.stdout.readline().strip() == "saving"
    for _ in range(times):
        process.send_signal(signal.SIGINT)
        time.sleep(0.3)
    _, stderr = process.communicate(timeout=240)
    return process.returncode, stderr


@pytest.mark.parametrize("through", ["async_save", "manager"])
def test_ctrl_c_during_training_completes_the_save_in_flight_and_says_so(tmp_path: Path, through: str) -> None:
    save = (
        'sk.async_save(state, "step_00000003", storage=SlowStore(root), options=sk.WriteOptions(io_threads=1))'
        if through == "async_save"
        else "manager = sk.CheckpointManager(root, keep_last=1, keep_best=1, storage=SlowStore(root), "
        "options=sk.WriteOptions(io_threads=1))\n"
        'manager.async_save(state, step=3, metrics={"val_loss": 1.0})'
    )
    process = _start_training(tmp_path, _TRAINING.replace("{save}", save))
    returncode, stderr = _interrupt(process, 1)
    assert returncode != 0  # the KeyboardInterrupt still ends the script
    assert "KeyboardInterrupt" in stderr
    assert "committed" in stderr, stderr
    root = tmp_path / "ckpts"
    assert sk.verify(root / "step_00000003").ok
    assert _leftovers(root) == []
    if through == "manager":
        for pointer in ("last", "best"):
            assert json.loads((root / pointer).read_text())["checkpoint"] == "step_00000003"


def test_a_second_ctrl_c_abandons_the_save_and_cleans_it_up(tmp_path: Path) -> None:
    save = 'sk.async_save(state, "step_00000003", storage=SlowStore(root), options=sk.WriteOptions(io_threads=1))'
    process = _start_training(tmp_path, _TRAINING.replace("{save}", save))
    returncode, stderr = _interrupt(process, 2)
    assert returncode != 0
    assert "abandon" in stderr and "removed" in stderr, stderr
    root = tmp_path / "ckpts"
    assert not (root / "step_00000003").exists()
    assert _leftovers(root) == []


def test_a_slow_save_that_keeps_writing_is_waited_for_past_its_timeout(tmp_path: Path) -> None:
    # timeout= bounds how long the exit waits for a save that writes nothing, not a slow one.
    body = _TRAINING.split("state = {", 1)[0].replace("{save}", "") + textwrap.dedent(
        """
        state = {f"w{i}": torch.randn(2**18) for i in range(16)}  # 16 slowed writes: about 3 s
        sk.async_save(state, "step_00000003", storage=SlowStore(root), options=sk.WriteOptions(io_threads=1), timeout=1)
        """
    )
    done = _run(tmp_path, body)
    assert done.returncode == 0, done.stderr
    assert "committed before exit" in done.stderr, done.stderr
    assert sk.verify(tmp_path / "ckpts" / "step_00000003").ok


def test_a_retention_failure_at_exit_says_the_save_committed(tmp_path: Path) -> None:
    body = """
    import os
    from shardkeep.storage import LocalStore

    class NoDeleting(LocalStore):
        def rename(self, source, destination):
            if ".deleting-" in destination:
                raise sk.StorageError(f"{source}: injected EIO while deleting")
            super().rename(source, destination)

    os.makedirs(root)
    manager = sk.CheckpointManager(root, keep_last=1, keep_best=1, storage=NoDeleting(root))
    manager.save(state, step=1, metrics={"val_loss": 2.0})
    manager.async_save(state, step=2, metrics={"val_loss": 1.0})
    """
    done = _run(tmp_path, body)
    assert done.returncode == 0, done.stderr
    assert "committed before exit, but" in done.stderr and "retention failed" in done.stderr, done.stderr
    assert "nothing" not in done.stderr
    assert sk.verify(tmp_path / "ckpts" / "step_00000002").ok


def test_a_background_thread_that_cannot_start_fails_the_call_and_holds_nothing(tmp_path: Path) -> None:
    body = """
    import threading, os
    real_start = threading.Thread.start

    def refused(self):
        if self.name == "shardkeep-async-save":
            raise RuntimeError("can't start new thread")
        return real_start(self)

    threading.Thread.start = refused
    try:
        sk.async_save(state, f"{root}/step_00000001")
    except RuntimeError as exc:
        print("refused:", exc)
    threading.Thread.start = real_start
    sk.async_save(state, f"{root}/step_00000002", timeout=5).result()  # not blocked by the first
    print("leftovers:", sorted(name for name in os.listdir(root) if ".tmp-" in name))
    """
    started = time.monotonic()
    done = _run(tmp_path, body)
    assert done.returncode == 0, done.stderr
    assert "refused: can't start new thread" in done.stdout
    assert "leftovers: []" in done.stdout
    assert time.monotonic() - started < 60
    assert not (tmp_path / "ckpts" / "step_00000001").exists()
    assert sk.verify(tmp_path / "ckpts" / "step_00000002").ok
