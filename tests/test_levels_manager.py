"""MultiLevelManager end to end on real gloo ranks: "nodes" are groups of two ranks, each node with
its own local root; the persistent level is a directory (and, in a slow test, the S3 server).

Covered: saves on both levels with their own cadence and retention; a flipped local byte healed
from the persistent copy of the same step; a wiped local level; a persistent level that fails
(skipped, or fatal when required); a transient error on the persistent level retried; resharding
from each level; the status listing.
"""

from __future__ import annotations

import errno
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import shardkeep as sk
from tests.support.distributed_harness import results_or_raise, run_ranks
from tests.support.states import full_rows, row_sharded

_full = full_rows
_state = row_sharded


def _levels(
    tmp: str, *, local_every: int = 2, persist_every: int = 4, replicas: int | None = 0, **persistent: Any
) -> list[sk.Level]:
    """Peer replicas are off unless asked for: these tests are about the persistent copy."""
    return [
        sk.Level(
            "local",
            tmp + "/node{node}",
            node_local=True,
            replicas=replicas,
            save_policy=sk.SavePolicy(every_steps=local_every),
            retention=sk.RetentionPolicy(keep_last=2, keep_best=0),
        ),
        sk.Level(
            "persistent",
            persistent.pop("root", tmp + "/persistent"),
            source="drain",
            save_policy=sk.SavePolicy(every_steps=persist_every),
            retention=sk.RetentionPolicy(keep_last=3, keep_best=0),
            **persistent,
        ),
    ]


def _node_of(rank: int) -> int:
    """Two "nodes" whatever the world size: the first half of the ranks and the second."""
    import torch.distributed as dist

    world_size = dist.get_world_size() if dist.is_initialized() else 1
    return rank * 2 // world_size if world_size > 1 else 0


def _train(rank: int, world_size: int, tmp: str, last: int, replicas: int | None = 0) -> dict[str, Any]:
    manager = sk.MultiLevelManager(_levels(tmp, replicas=replicas), node_of=_node_of, timeout=60)
    results = []
    for step in range(last + 1):
        if manager.should_save(step):
            result = manager.save(_state(step), step=step)
            results.append((step, dict(result.committed), dict(result.draining), dict(result.skipped)))
    manager.close()
    return {"results": results}


def _restore(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    manager = sk.MultiLevelManager(_levels(tmp), node_of=_node_of, timeout=60)
    state = _state(0, zeros=True)
    restored = manager.restore(into=state)
    manager.close()
    if restored is None:
        return {"step": None}
    full = state["weights"].full_tensor()
    return {
        "step": restored.step,
        "equal": bool(torch.equal(full, _full(restored.step))),
        "healed": list(restored.report.healed),
        "refused": list(restored.report.refused),
        "levels_read": list(restored.report.levels_read),
        "newest_local": restored.report.newest_local_step,
    }


def _steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step_") and (p / "manifest.json").exists())


def test_two_levels_save_on_their_cadence_and_keep_their_retention(tmp_path: Path) -> None:
    results_or_raise(run_ranks(4, _train, str(tmp_path), 9, None, outbox=tmp_path / "out"))
    # local every 2 steps, keep the last 2, on each node; persistent every 4 steps (drained), keep 3
    for node in (0, 1):
        assert _steps(tmp_path / f"node{node}") == ["step_00000006", "step_00000008"]
    assert _steps(tmp_path / "persistent") == ["step_00000000", "step_00000004", "step_00000008"]
    for name in _steps(tmp_path / "persistent"):
        assert sk.verify(tmp_path / "persistent" / name).ok
    # each node holds only its own ranks' data files, and the manifest is the same bytes on both
    node0, node1 = tmp_path / "node0" / "step_00000008", tmp_path / "node1" / "step_00000008"
    assert (node0 / "manifest.json").read_bytes() == (node1 / "manifest.json").read_bytes()
    assert (node0 / "manifest.json").read_bytes() == (tmp_path / "persistent/step_00000008/manifest.json").read_bytes()
    # each node's own part holds its ranks' data files; with two nodes the default of one
    # replica puts each node's files on the other node too, recorded once replicated
    part0 = json.loads((node0 / "node-part.json").read_bytes())
    part1 = json.loads((node1 / "node-part.json").read_bytes())
    assert part0["files"] and part1["files"] and not set(part0["files"]) & set(part1["files"])
    assert part0["replicas"] == {"1": part1["files"]} and part1["replicas"] == {"0": part0["files"]}
    data0 = {str(p.relative_to(node0)) for p in node0.rglob("*.safetensors")}
    assert data0 == set(part0["files"]) | set(part1["files"])


def test_restore_resumes_at_the_newest_local_step(tmp_path: Path) -> None:
    results_or_raise(run_ranks(4, _train, str(tmp_path), 6, outbox=tmp_path / "out"))
    restored = results_or_raise(run_ranks(4, _restore, str(tmp_path), outbox=tmp_path / "out2"))
    assert {r["step"] for r in restored} == {6} and all(r["equal"] for r in restored)
    assert {r["newest_local"] for r in restored} == {6}  # nothing newer to retire
    assert _steps(tmp_path / "node0") == _steps(tmp_path / "node1") == ["step_00000004", "step_00000006"]


def test_local_directories_newer_than_the_restored_step_are_retired_even_unreadable(tmp_path: Path) -> None:
    results_or_raise(run_ranks(4, _train, str(tmp_path), 6, outbox=tmp_path / "out"))
    # a save of step 10 cut off on node 1 before its manifest: no copy lists it, yet the
    # resumed run saves step 10 again, so the directory must go
    torn = tmp_path / "node1" / "step_00000010"
    torn.mkdir()
    (torn / "rank_00002.safetensors").write_bytes(b"torn")
    restored = results_or_raise(run_ranks(4, _restore, str(tmp_path), outbox=tmp_path / "out2"))
    assert {r["step"] for r in restored} == {6} and {r["newest_local"] for r in restored} == {10}
    assert not torn.exists()


def test_a_flipped_local_byte_heals_from_the_persistent_copy_of_the_same_step(tmp_path: Path) -> None:
    results_or_raise(run_ranks(4, _train, str(tmp_path), 8, outbox=tmp_path / "out"))
    victim = sorted((tmp_path / "node1" / "step_00000008").rglob("*.safetensors"))[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    restored = results_or_raise(run_ranks(4, _restore, str(tmp_path), outbox=tmp_path / "out2"))
    assert {r["step"] for r in restored} == {8} and all(r["equal"] for r in restored), restored
    healed = [h for r in restored for h in r["healed"]]
    assert healed and all("persistent" in str(h) for h in healed), healed
    assert sk.verify(tmp_path / "persistent" / "step_00000008").ok


def test_a_wiped_local_level_restores_from_the_persistent_level(tmp_path: Path) -> None:
    results_or_raise(run_ranks(4, _train, str(tmp_path), 9, outbox=tmp_path / "out"))
    for node in (0, 1):
        for child in (tmp_path / f"node{node}").iterdir():
            import shutil

            shutil.rmtree(child) if child.is_dir() else child.unlink()
    restored = results_or_raise(run_ranks(4, _restore, str(tmp_path), outbox=tmp_path / "out2"))
    assert {r["step"] for r in restored} == {8} and all(r["equal"] for r in restored), restored


def test_a_missing_local_part_without_a_persistent_copy_falls_back_and_says_why(tmp_path: Path) -> None:
    results_or_raise(run_ranks(4, _train, str(tmp_path), 6, outbox=tmp_path / "out"))
    import shutil

    shutil.rmtree(tmp_path / "node1" / "step_00000006")
    restored = results_or_raise(run_ranks(4, _restore, str(tmp_path), outbox=tmp_path / "out2"))
    # step 6 has no copy of node 1's part anywhere; step 4 is complete locally (and persisted)
    assert {r["step"] for r in restored} == {4} and all(r["equal"] for r in restored), restored
    refused = [entry for r in restored for entry in r["refused"]]
    assert any(entry[0] == 6 for entry in refused), refused
    # node 0's part of step 6 cannot be completed: retired, so the resumed run saves step 6 anew
    assert {r["newest_local"] for r in restored} == {6}
    assert not (tmp_path / "node0" / "step_00000006").exists()


@pytest.mark.parametrize("ranks", [2, 3])
def test_resharding_from_the_local_level(tmp_path: Path, ranks: int) -> None:
    results_or_raise(run_ranks(4, _train, str(tmp_path), 6, outbox=tmp_path / "out"))
    restored = results_or_raise(run_ranks(ranks, _restore, str(tmp_path), outbox=tmp_path / "out2"))
    assert {r["step"] for r in restored} == {6} and all(r["equal"] for r in restored), restored


def _train_failing_persistent(rank: int, world_size: int, tmp: str, required: bool) -> dict[str, Any]:
    levels = _levels(tmp, root="/proc/shardkeep-no-such-dir/persistent")
    if required:
        levels[1] = sk.Level(
            "persistent",
            tmp + "/persistent",
            source="drain",
            save_policy=sk.SavePolicy(every_steps=4),
            required=True,
        )
    try:
        manager = sk.MultiLevelManager(levels, node_of=_node_of, timeout=60)
        manager.should_save(0)  # several ranks agree on the probes at the first call
    except sk.LevelUnreachableError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None}


def test_an_unreachable_persistent_level_is_refused_at_start_naming_it(tmp_path: Path) -> None:
    results = results_or_raise(run_ranks(2, _train_failing_persistent, str(tmp_path), False, outbox=tmp_path / "o"))
    assert all(r["error"] == "LevelUnreachableError" and "persistent" in r["message"] for r in results), results
    assert not (tmp_path / "node0").exists()  # nothing written


def _single(tmp: str, **persistent: Any) -> sk.MultiLevelManager:
    return sk.MultiLevelManager(_levels(tmp, **persistent), timeout=60)


def test_one_process_two_levels_and_status(tmp_path: Path) -> None:
    manager = _single(str(tmp_path))
    for step in range(9):
        if manager.should_save(step):
            manager.save({"w": torch.full((4,), float(step))}, step=step)
    manager.close()
    status = manager.status()
    local = {entry.step: entry.state for entry in status["local"]}
    persistent = {entry.step: entry.state for entry in status["persistent"]}
    assert local == {6: "committed", 8: "committed"}
    assert persistent == {0: "committed", 4: "committed", 8: "committed"}
    state = {"w": torch.zeros(4)}
    restored = _single(str(tmp_path)).restore(into=state)
    assert restored is not None and restored.step == 8 and torch.equal(state["w"], torch.full((4,), 8.0))


def _break(root: Path) -> None:
    """Make a persistent level unusable from now on: its root becomes a file."""
    import shutil

    shutil.rmtree(root)
    root.write_text("not a directory")


def test_a_failing_persistent_level_is_skipped_and_local_saves_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    manager = _single(str(tmp_path))
    manager.save({"w": torch.ones(4)}, step=0)
    manager.wait_for_drains()
    _break(tmp_path / "persistent")
    with caplog.at_level(logging.WARNING, logger="shardkeep.levels"):
        result = manager.save({"w": torch.ones(4)}, step=4)
        manager.close()
    assert result.committed == {"local": "step_00000004"}
    assert "persistent" in result.skipped, result
    assert any("'persistent'" in message for message in caplog.messages), caplog.messages


def test_a_required_level_that_fails_fails_the_save(tmp_path: Path) -> None:
    levels = _levels(str(tmp_path))
    levels[1] = sk.Level(
        "persistent",
        str(tmp_path / "persistent"),
        source="drain",
        save_policy=sk.SavePolicy(every_steps=4),
        required=True,
    )
    manager = sk.MultiLevelManager(levels)
    manager.save({"w": torch.ones(4)}, step=0)
    manager.wait_for_drains()
    _break(tmp_path / "persistent")
    with pytest.raises(sk.StorageError):
        manager.save({"w": torch.ones(4)}, step=4)
    manager.close(wait=False)
    # the local step committed before the drain failed
    assert (tmp_path / "node0" / "step_00000004" / "manifest.json").exists()


def _one_level_pair(tmp: Path, *, drain_wait: float = 0.0) -> sk.MultiLevelManager:
    """A local level and a drain level, both every step (one process)."""
    return sk.MultiLevelManager(
        [
            sk.Level("local", str(tmp / "node{node}"), node_local=True, save_policy=sk.SavePolicy(every_steps=1)),
            sk.Level("persistent", str(tmp / "persistent"), source="drain", save_policy=sk.SavePolicy(every_steps=1)),
        ],
        drain_wait=drain_wait,
    )


def test_a_save_waits_for_a_slow_drain_at_most_drain_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    import shardkeep.levels.drain as drain_module

    release = threading.Event()
    real_copy = drain_module.copy_with_digest

    def slow_copy(*args: Any, **kwargs: Any) -> Any:
        release.wait(30)  # the persistent level is stuck until the test releases it
        return real_copy(*args, **kwargs)

    monkeypatch.setattr(drain_module, "copy_with_digest", slow_copy)
    manager = _one_level_pair(tmp_path, drain_wait=0.3)
    first = manager.save({"w": torch.ones(1000)}, step=0)
    assert first.draining == {"persistent": "step_00000000"}
    second = manager.save({"w": torch.ones(1000) * 2}, step=1)
    # the local save committed; the drain of step 1 was skipped after waiting drain_wait at most
    assert second.committed == {"local": "step_00000001"}
    assert "still running" in second.skipped["persistent"]
    assert second.blocked_seconds < 0.3 + 5.0
    release.set()
    manager.close()
    assert _steps(tmp_path / "persistent") == ["step_00000000"]
    assert sk.verify(tmp_path / "persistent" / "step_00000000").ok


_CRASH_IN_DRAIN = """
import os, sys, threading, torch
import shardkeep as sk
import shardkeep.levels.drain as drain_module
tmp = sys.argv[1]
levels = [
    sk.Level("local", tmp + "/node{node}", node_local=True, save_policy=sk.SavePolicy(every_steps=1)),
    sk.Level("persistent", tmp + "/persistent", source="drain", save_policy=sk.SavePolicy(every_steps=1)),
]
manager = sk.MultiLevelManager(levels)
manager.save({"w": torch.full((1000,), 0.0)}, step=0)
manager.wait_for_drains()
real_copy = drain_module.copy_with_digest
copied = threading.Event()
def copy_then_stall(*args, **kwargs):
    found = real_copy(*args, **kwargs)
    copied.set()
    threading.Event().wait()  # the process dies while the drain is still open
    return found
drain_module.copy_with_digest = copy_then_stall
manager.save({"w": torch.full((1000,), 1.0)}, step=1)
copied.wait(30)
os._exit(9)
"""


def test_a_drain_cut_off_by_a_crash_is_cleaned_up_and_resumed(tmp_path: Path) -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _CRASH_IN_DRAIN, str(tmp_path)], capture_output=True, timeout=120)
    assert done.returncode == 9, done.stderr.decode()[-2000:]
    persistent = tmp_path / "persistent"
    assert _steps(persistent) == ["step_00000000"]
    assert [p.name for p in persistent.iterdir() if ".tmp-" in p.name], "the cut-off drain left its staging"
    manager = _one_level_pair(tmp_path)
    state = {"w": torch.zeros(1000)}
    restored = manager.restore(into=state)
    assert restored is not None and restored.step == 1 and torch.equal(state["w"], torch.full((1000,), 1.0))
    manager.close()  # the resumed drain of step 1 commits
    assert _steps(persistent) == ["step_00000000", "step_00000001"]
    assert not [p.name for p in persistent.iterdir() if ".tmp-" in p.name]
    assert sk.verify(persistent / "step_00000001").ok
    assert (persistent / "step_00000001" / "manifest.json").read_bytes() == (
        tmp_path / "node0" / "step_00000001" / "manifest.json"
    ).read_bytes()


def test_a_transient_error_on_the_persistent_level_is_retried_and_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import shardkeep.levels.drain as drain_module

    real_copy = drain_module.copy_with_digest
    failures = []

    def flaky_copy(*args: Any, **kwargs: Any) -> Any:
        if not failures:
            failures.append(1)
            raise sk.StorageError("write failed (injected)") from OSError(errno.EIO, "Input/output error")
        return real_copy(*args, **kwargs)

    monkeypatch.setattr(drain_module, "copy_with_digest", flaky_copy)
    levels = _levels(str(tmp_path), local_every=1, persist_every=1)
    manager = sk.MultiLevelManager(levels, retry=sk.RetryPolicy(attempts=3, initial_backoff=0.01))
    with caplog.at_level(logging.WARNING):
        manager.save({"w": torch.ones(64)}, step=0)
        manager.close()
    assert failures == [1]
    assert any("attempt 1 of 3" in message for message in caplog.messages), caplog.messages
    assert _steps(tmp_path / "persistent") == ["step_00000000"]
    assert sk.verify(tmp_path / "persistent" / "step_00000000").ok


def test_verify_checks_a_node_part_against_its_node_part_json(tmp_path: Path) -> None:
    results_or_raise(run_ranks(4, _train, str(tmp_path), 8, outbox=tmp_path / "out"))
    part = tmp_path / "node1" / "step_00000008"
    report = sk.verify(part)
    assert report.ok, report.problems
    assert any("node 1's part" in warning for warning in report.warnings), report.warnings
    held = sorted(part.rglob("*.safetensors"))
    assert report.files_checked == len(held)
    data = bytearray(held[0].read_bytes())
    data[-1] ^= 0xFF
    held[0].write_bytes(bytes(data))
    damaged = sk.verify(part)
    assert not damaged.ok and any(held[0].name in problem for problem in damaged.problems), damaged.problems


def _readme_levels_code(tmp: Path) -> str:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("## Two levels: save often to local disks, persist less often", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert '"/local_nvme/ckpt"' in code and '"s3://bucket/run-17"' in code
    return code.replace('"/local_nvme/ckpt"', repr(str(tmp / "local"))).replace(
        '"s3://bucket/run-17"', repr(str(tmp / "persistent"))
    )


def test_the_readme_levels_loop_runs_and_resumes(tmp_path: Path) -> None:
    prelude = (
        "import torch\nimport shardkeep as sk\n"
        "state = {'w': torch.zeros(4)}\n"
        "def train_step():\n    state['w'] += 1\n    return float(state['w'][0])\n"
    )
    code = _readme_levels_code(tmp_path)
    first: dict[str, Any] = {"total_steps": 215}
    exec(compile(prelude + code, "README.md", "exec"), first)
    assert _steps(tmp_path / "local") == ["step_00000200", "step_00000210"]
    assert _steps(tmp_path / "persistent") == ["step_00000000", "step_00000100", "step_00000200"]
    again: dict[str, Any] = {"total_steps": 215}
    exec(compile(prelude.replace("torch.zeros(4)", "torch.full((4,), -1.0)") + code, "README.md", "exec"), again)
    # resumed from the newest local step: 211 increments in all, then 4 more after the restore
    assert again["restored"].step == 210 and float(again["state"]["w"][0]) == 211 + 4


def test_a_level_without_retention_keeps_every_step(tmp_path: Path) -> None:
    manager = sk.MultiLevelManager(
        [
            sk.Level("local", str(tmp_path / "node{node}"), node_local=True, save_policy=sk.SavePolicy(every_steps=1)),
            sk.Level("persistent", str(tmp_path / "persistent"), source="drain"),
        ]
    )
    for step in range(4):
        manager.save({"w": torch.full((4,), float(step))}, step=step)
        manager.wait_for_drains()
    manager.close()
    assert len(_steps(tmp_path / "node0")) == 4
    assert len(_steps(tmp_path / "persistent")) == 4


def _resave_after_rollback(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    manager = sk.MultiLevelManager(_levels(tmp), node_of=_node_of, timeout=60)
    state = _state(0, zeros=True)
    restored = manager.restore(into=state)
    assert restored is not None
    saved = manager.save(_state(8), step=8)
    manager.close()
    return {"restored": restored.step, "committed": dict(saved.committed), "skipped": dict(saved.skipped)}


def test_a_step_saved_again_after_a_rollback_replaces_the_abandoned_parts(tmp_path: Path) -> None:
    import shutil

    results_or_raise(run_ranks(4, _train, str(tmp_path), 8, outbox=tmp_path / "out"))
    # node 1 lost step 8 and so did the persistent level: step 8 cannot be completed
    shutil.rmtree(tmp_path / "node1" / "step_00000008")
    shutil.rmtree(tmp_path / "persistent" / "step_00000008")
    results = results_or_raise(run_ranks(4, _resave_after_rollback, str(tmp_path), outbox=tmp_path / "out2"))
    assert {r["restored"] for r in results} == {6}
    assert all(r["committed"].get("local") == "step_00000008" for r in results), results
    manifests = {(tmp_path / f"node{n}" / "step_00000008" / "manifest.json").read_bytes() for n in (0, 1)}
    assert len(manifests) == 1  # one timeline: both nodes hold the new save's part


def _train_compressed(rank: int, world_size: int, tmp: str, last: int) -> None:
    manager = sk.MultiLevelManager(
        _levels(tmp), node_of=_node_of, timeout=60, options=sk.WriteOptions(compression="zstd")
    )
    for step in range(last + 1):
        if manager.should_save(step):
            manager.save(_state(step), step=step)
    manager.close()


def test_a_compressed_file_damaged_on_every_level_falls_back_on_every_rank(tmp_path: Path) -> None:
    results_or_raise(run_ranks(2, _train_compressed, str(tmp_path), 8, outbox=tmp_path / "out"))
    victim = sorted((tmp_path / "node1" / "step_00000008").rglob("*.safetensors*"))[0]
    relative = victim.relative_to(tmp_path / "node1" / "step_00000008")
    for copy in (victim, tmp_path / "persistent" / "step_00000008" / relative):
        data = bytearray(copy.read_bytes())
        data[0] ^= 0xFF  # the zstd frame header: the stream does not even decode
        data[1] ^= 0xFF
        copy.write_bytes(bytes(data))
    restored = results_or_raise(run_ranks(2, _restore, str(tmp_path), outbox=tmp_path / "out2"))
    assert {r["step"] for r in restored} == {6} and all(r["equal"] for r in restored), restored
    assert any(entry[0] == 8 for r in restored for entry in r["refused"])


def test_a_node_part_without_its_manifest_is_rebuilt_from_the_persistent_copy(tmp_path: Path) -> None:
    results_or_raise(run_ranks(4, _train, str(tmp_path), 8, outbox=tmp_path / "out"))
    (tmp_path / "node1" / "step_00000008" / "manifest.json").unlink()
    restored = results_or_raise(run_ranks(4, _restore, str(tmp_path), outbox=tmp_path / "out2"))
    assert {r["step"] for r in restored} == {8} and all(r["equal"] for r in restored), restored
    assert sk.verify(tmp_path / "node1" / "step_00000008").ok


def test_a_save_nothing_is_due_for_goes_to_the_local_level(tmp_path: Path) -> None:
    levels = _levels(str(tmp_path))
    manager = sk.MultiLevelManager([levels[1], levels[0]])  # the drain level listed first
    result = manager.save({"w": torch.ones(4)}, step=3)  # neither level is due at step 3
    manager.close()
    assert result.committed == {"local": "step_00000003"}


def test_a_failing_local_level_does_not_stop_persisting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shardkeep.levels.manager as manager_module

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise sk.StorageError("the local disk failed (injected)") from OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(manager_module, "save_node_local", broken)
    manager = _single(str(tmp_path))
    result = manager.save({"w": torch.ones(4)}, step=4)
    manager.close()
    assert "local" in result.skipped and result.committed == {"persistent": "step_00000004"}, result
    assert sk.verify(tmp_path / "persistent" / "step_00000004").ok


def test_restore_finishes_a_drain_in_flight_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    import shardkeep.levels.drain as drain_module

    release = threading.Event()
    real_copy = drain_module.copy_with_digest

    def slow_copy(*args: Any, **kwargs: Any) -> Any:
        release.wait(30)
        return real_copy(*args, **kwargs)

    monkeypatch.setattr(drain_module, "copy_with_digest", slow_copy)
    manager = _one_level_pair(tmp_path)
    manager.save({"w": torch.ones(1000)}, step=0)
    threading.Timer(0.5, release.set).start()
    state = {"w": torch.zeros(1000)}
    restored = manager.restore(into=state)
    assert restored is not None and restored.step == 0
    assert _steps(tmp_path / "persistent") == ["step_00000000"]  # the drain committed, not cut off
    assert not [p.name for p in (tmp_path / "persistent").iterdir() if ".tmp-" in p.name]
    assert not [t for t in threading.enumerate() if "drain" in t.name.lower()]
    manager.close()


def _unmounted(rank: int, world_size: int, tmp: str) -> list[tuple[int, dict[str, str], dict[str, str]]]:
    # node 1 lacks the shared mount: the same path is a local directory there
    root = tmp + ("/shared" if rank == 0 else "/node1-local-view-of-shared")
    manager = sk.MultiLevelManager(_levels(tmp, root=root), node_of=_node_of, timeout=60)
    out = []
    for step in range(5):
        if manager.should_save(step):
            result = manager.save(_state(step), step=step)
            manager.wait_for_drains()
            out.append((step, dict(result.committed), dict(result.skipped)))
    manager.close()
    return out


def test_a_drain_never_commits_files_a_node_wrote_elsewhere(tmp_path: Path) -> None:
    results_or_raise(run_ranks(2, _unmounted, str(tmp_path), outbox=tmp_path / "out"))
    shared = tmp_path / "shared"
    assert _steps(shared) == [], "a persistent step was committed without node 1's files"


def test_the_retention_after_a_drain_does_not_block_the_caller(tmp_path: Path) -> None:
    import threading

    manager = _single(str(tmp_path))
    persistent = manager._shared["persistent"].manager
    entered, release = threading.Event(), threading.Event()
    pruned: list[str] = []
    real_prune = persistent.prune

    def slow_prune() -> list[str]:
        entered.set()
        assert release.wait(10)
        pruned.extend(real_prune())
        return pruned

    persistent.prune = slow_prune  # type: ignore[method-assign]
    for step in range(13):
        if manager.should_save(step):
            manager.save({"w": torch.full((4,), float(step))}, step=step)
        if step in (0, 4, 8):
            result = manager.wait_for_drains()  # the drain commits; its retention starts behind
            assert result.committed == {"persistent": f"step_{step:08d}"}
            assert entered.wait(30)
            entered.clear()
            release.set()  # lets this prune finish while training goes on
    manager.close()
    assert _steps(tmp_path / "persistent") == ["step_00000004", "step_00000008", "step_00000012"]
    assert "step_00000000" in pruned


def test_a_replica_cut_off_mid_file_is_not_a_damaged_part_and_is_cleaned_up(tmp_path: Path) -> None:
    import os

    from shardkeep.levels.local_catalog import collect_leftovers

    results_or_raise(run_ranks(4, _train, str(tmp_path), 8, outbox=tmp_path / "out"))
    part = tmp_path / "node1" / "step_00000008"
    shards = next(p.parent for p in part.rglob("*.safetensors"))
    leftover = shards / ".rank_00000_sharded.safetensors.tmp-0123456789ab"  # a killed transfer's file
    leftover.write_bytes(b"half a file")
    assert sk.verify(part).ok, sk.verify(part).problems
    stranger = shards / "not-from-shardkeep.bin"
    stranger.write_bytes(b"x")
    assert not sk.verify(part).ok  # anything else is still an extra file
    stranger.unlink()
    os.utime(leftover, (1, 1))
    removed = collect_leftovers(tmp_path / "node1", lease=60)
    assert any(name.endswith(leftover.name) for name in removed) and not leftover.exists()


def test_a_drained_manifest_records_the_persistent_levels_retention(tmp_path: Path) -> None:
    manager = _single(str(tmp_path))
    manager.save({"w": torch.ones(4)}, step=0)
    manager.close()
    record = sk.read_manifest(tmp_path / "persistent" / "step_00000000").run
    assert record is not None and record.retention is not None
    # `shardkeep prune` on the persistent root reads this: the persistent level's keep_last=3
    assert (record.retention.keep_last, record.retention.keep_best) == (3, 0)
