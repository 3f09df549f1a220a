"""Failure injection: an I/O error at every operation of a save, and kill -9 at random moments.

After any failure the previous checkpoint still verifies and nothing that looks committed is
left half-written.
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import shardkeep as sk
from shardkeep.manifest import is_staging_name
from shardkeep.storage import LocalStore
from shardkeep.testing import FaultInjectingStore
from tests.support.disk import tree_listing
from tests.support.figures import record, scale
from tests.support.states import make_state

CRASH_TRIALS = int(os.environ.get("SHARDKEEP_CRASH_TRIALS", scale(200, 1000)))


def _multi_file_state() -> dict[str, Any]:
    state = make_state(seed=3)
    state["big"] = {f"w{i}": torch.randn(128, 128) for i in range(4)}
    state["strided"] = torch.randn(64, 64).t()
    return state


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
def test_failure_at_every_operation_leaves_nothing_committed(tmp_path: Path, code: int) -> None:
    root = tmp_path / "root"
    sk.save(make_state(seed=1), root / "step_1")
    state = _multi_file_state()

    counter = FaultInjectingStore(LocalStore(root))
    sk.save(state, "step_2", storage=counter, options=sk.WriteOptions(file_size_target=100_000))
    total = counter.operation_count
    operations = counter.operations
    assert any(op.startswith("rename step_2.tmp-") for op in operations)
    assert sum(op.startswith("open_write") for op in operations) >= 4
    LocalStore(root).remove_tree("step_2")
    before = tree_listing(root)

    for fail_at in range(1, total + 1):
        store = FaultInjectingStore(LocalStore(root), fail_at=fail_at, code=code)
        with pytest.raises(sk.StorageError, match=f"operation {fail_at} "):
            sk.save(state, "step_2", storage=store, options=sk.WriteOptions(file_size_target=100_000))
        assert tree_listing(root) == before, f"leftovers after a failure at {operations[fail_at - 1]}"
    assert sk.verify(root / "step_1").ok
    assert not (root / "step_2").exists()
    record(
        "I/O errors",
        trials=total,
        failures=0,
        detail=f"{errno.errorcode[code]} at each of the {total} operations of a 5-file save: a typed StorageError, "
        "no leftovers, the previous checkpoint verifies",
    )


def test_storage_errors_are_typed_and_name_the_path(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(sk.ShardkeepError, match="file"):
        sk.save({"x": torch.zeros(1)}, blocker / "ckpt")
    store = LocalStore(tmp_path)
    handle = store.open_write("new.bin")
    handle.commit()
    with pytest.raises(sk.CheckpointExistsError, match=r"new\.bin"):
        store.open_write("new.bin")
    with pytest.raises(sk.UnsafePathError):
        store.open_write("../escape")
    with pytest.raises(sk.CheckpointNotFoundError):
        store.open_read("missing.bin")


def _keep_saving(root: str, first_step: int, state: dict[str, Any]) -> None:
    step = first_step
    while True:
        sk.save(state, os.path.join(root, f"step_{step:08d}"), options=sk.WriteOptions(file_size_target=200_000))
        step += 1


def _committed(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if not is_staging_name(p.name))


@pytest.mark.slow
def test_kill_9_during_save_never_leaves_a_committed_checkpoint_that_fails(tmp_path: Path) -> None:
    root = tmp_path / "root"
    state = _multi_file_state()
    # 9 MiB more, so a save spans several ms, and its file is written with O_DIRECT (an aligned
    # block, and a tail through the page cache): the kills land
    # in that path too.
    state["payload"] = torch.randn(1536, 1536)
    probe = LocalStore(tmp_path)
    sk.save(state, "probe", storage=probe, options=sk.WriteOptions(file_size_target=200_000))
    assert probe.write_paths["direct"] == 1, probe.write_paths
    sk.save(state, root / "step_00000000")
    context = multiprocessing.get_context("fork")
    rng = random.Random(1234)
    verified: set[str] = {"step_00000000"}
    killed_with_staging = 0
    for trial in range(CRASH_TRIALS):
        committed = _committed(root)
        next_step = int(committed[-1].name.split("_")[1]) + 1
        child = context.Process(target=_keep_saving, args=(str(root), next_step, state), daemon=True)
        child.start()
        time.sleep(rng.uniform(0.0, 0.08))
        os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]  # pid is set after start()
        child.join()
        assert child.exitcode == -signal.SIGKILL, f"trial {trial}: the saver died on its own ({child.exitcode})"
        if any(is_staging_name(p.name) for p in root.iterdir()):
            killed_with_staging += 1
        for checkpoint in _committed(root):
            if checkpoint.name in verified:
                continue
            report = sk.verify(checkpoint)
            assert report.ok, f"trial {trial}: {checkpoint.name} looks committed but fails: {report.problems}"
            sk.load(checkpoint)
            verified.add(checkpoint.name)
        assert sk.verify(root / "step_00000000").ok
    # The kills landed both inside saves (staging left behind) and between them.
    assert killed_with_staging > 0
    assert len(verified) > 1
    record(
        "process crash",
        trials=CRASH_TRIALS,
        failures=0,
        detail=f"kill -9 at a random moment (0-80 ms) of a save loop; {killed_with_staging} kills landed inside a "
        f"save; {len(verified)} committed checkpoints verified and loaded",
    )


def _rank_one_fails_at_every_operation(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from tests.test_distributed import replicated_state

    counter = FaultInjectingStore(LocalStore(root))
    sk.save(
        replicated_state(), "probe", storage=counter, options=sk.WriteOptions(file_size_target=20_000)
    )  # operations per rank
    totals = [0] * world_size
    import torch.distributed as dist

    dist.all_gather_object(totals, counter.operation_count)
    outcomes: dict[int, str] = {}
    for fail_at in range(1, totals[1] + 1):
        store = FaultInjectingStore(LocalStore(root), fail_at=fail_at if rank == 1 else None)
        started = time.monotonic()
        try:
            sk.save(
                replicated_state(),
                f"ckpt_{fail_at:03d}",
                storage=store,
                timeout=30,
                options=sk.WriteOptions(file_size_target=20_000),
            )
        except sk.CoordinationError as exc:
            failed = sorted(exc.failures)
            outcomes[fail_at] = f"CoordinationError ranks {failed} in {time.monotonic() - started:.1f} s"
        except Exception as exc:
            outcomes[fail_at] = f"untyped {type(exc).__name__}: {exc}"
        else:
            outcomes[fail_at] = "saved"
    return outcomes


def test_an_io_error_at_every_operation_of_one_rank_fails_every_rank(tmp_path: Path) -> None:
    from tests.support.distributed_harness import results_or_raise, run_ranks

    root = tmp_path / "root"
    sk.save({"previous": torch.ones(3)}, root / "previous")
    results = results_or_raise(
        run_ranks(2, _rank_one_fails_at_every_operation, str(root), outbox=tmp_path / "out", timeout=240)
    )
    assert results[0].keys() == results[1].keys() and len(results[0]) >= 5
    bad = {n: r for result in results for n, r in result.items() if not r.startswith("CoordinationError ranks [1]")}
    assert bad == {}, bad
    committed = sorted(p.name for p in root.iterdir() if not is_staging_name(p.name))
    assert committed == ["previous", "probe"]
    assert sk.verify(root / "previous").ok
    record(
        "I/O errors: one rank failing",
        trials=len(results[1]),
        failures=len(bad),
        detail=f"2 gloo ranks; rank 1 fails at each of its {len(results[1])} storage operations: every rank "
        "raises CoordinationError naming rank 1, no hang, nothing committed, the previous checkpoint verifies",
    )
