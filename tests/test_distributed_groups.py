"""The gloo groups shardkeep makes for itself (``distributed/groups.py``): never handed out
after torch destroyed them, and destroyed at exit while the interpreter is whole."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path
from typing import Any

from tests.support.distributed_harness import results_or_raise, run_ranks


def _reinit(rank: int, world_size: int, store: str) -> dict[str, Any]:
    import torch.distributed as dist

    from shardkeep.distributed.coordinator import Coordinator, _groups

    first = Coordinator()
    assert first.all_gather(rank) == list(range(world_size))
    old = weakref.ref(first.group)
    del first
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    second = Coordinator()
    gathered = second.all_gather(rank * 10)
    gc.collect()
    result = {"gathered": gathered, "old_dropped": old() is None, "fresh": second.group is not None}
    result["cached"] = second.group in _groups
    dist.destroy_process_group()
    return result


def test_a_group_torch_destroyed_is_dropped_and_a_fresh_one_made(tmp_path: Path) -> None:
    results = results_or_raise(run_ranks(2, _reinit, str(tmp_path / "store"), outbox=tmp_path / "out"))
    for result in results:
        assert result["gathered"] == [0, 10]
        assert result["old_dropped"], "the destroyed checkpoint group is still held"
        assert result["cached"]


def _released(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed import distributed_c10d

    from shardkeep.async_saving import background_group
    from shardkeep.distributed.coordinator import Coordinator
    from shardkeep.distributed.groups import release_all

    coordinator = Coordinator()
    coordinator.all_gather(rank)
    ours = [coordinator.group, background_group(None, 30.0)]
    known_before = [group in distributed_c10d._world.pg_map for group in ours]
    refs = [weakref.ref(group) for group in ours]
    del coordinator, ours
    release_all()
    gc.collect()
    return {"known_before": known_before, "dropped": [ref() is None for ref in refs]}


def test_release_all_destroys_and_drops_every_group_shardkeep_made(tmp_path: Path) -> None:
    results = results_or_raise(run_ranks(2, _released, outbox=tmp_path / "out"))
    for result in results:
        assert result["known_before"] == [True, True]
        assert result["dropped"] == [True, True]


def test_the_exit_hook_destroys_the_checkpoint_group_before_the_interpreter_goes(tmp_path: Path) -> None:
    """A process that never destroys its groups: the hook runs at exit (before finalization),
    and says so through a hook of the script's own registered before shardkeep's (so it runs
    after it)."""
    script = textwrap.dedent(
        f"""
        import atexit, os, weakref
        import torch.distributed as dist
        from torch.distributed import distributed_c10d
        dist.init_process_group("gloo", init_method="file://{tmp_path / "store"}", rank=0, world_size=1)
        seen = {{}}
        atexit.register(lambda: print("after the hook: known", seen["ref"]() in distributed_c10d._world.pg_map))
        from shardkeep.distributed.coordinator import Coordinator
        coordinator = Coordinator()
        coordinator.all_gather("x")
        seen["ref"] = weakref.ref(coordinator.group)
        print("before exit: known", coordinator.group in distributed_c10d._world.pg_map)
        """
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": str(root / "src"), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "before exit: known True" in done.stdout
    assert "after the hook: known False" in done.stdout, done.stdout


def _replicated(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    import torch
    from torch.distributed import distributed_c10d

    import shardkeep as sk
    from shardkeep.levels import replicas

    level = sk.Level("local", tmp + "/node{node}", node_local=True, replicas=1)
    manager = sk.MultiLevelManager([level], node_of=lambda r: r, timeout=60)
    manager.save({"w": torch.full((4,), float(rank))}, step=1)
    assert manager.wait_for_replicas() == 1  # step 1 is protected
    replication = manager.replication
    assert replication is not None and replication.replicator is not None
    group = replication.replicator.group
    known_before = group in distributed_c10d._world.pg_map
    manager.close()
    return {
        "known_before": known_before,
        "known_after": group in distributed_c10d._world.pg_map,
        "cached_after": group in replicas._replication_groups,
    }


def test_a_managers_replication_group_is_destroyed_by_its_close(tmp_path: Path) -> None:
    results = results_or_raise(run_ranks(2, _replicated, str(tmp_path), outbox=tmp_path / "out"))
    for result in results:
        assert result == {"known_before": True, "known_after": False, "cached_after": False}


def _creation_fails(rank: int, world_size: int) -> str:
    import torch.distributed as dist

    from shardkeep.distributed.coordinator import Coordinator, GroupBrokenError

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("wait timeout after 3000ms")  # what a peer that never came gives

    dist.new_group = failing  # type: ignore[assignment]  # this forked rank only
    try:
        Coordinator(timeout=3)
    except GroupBrokenError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_a_checkpoint_group_that_cannot_be_created_is_a_group_broken_error(tmp_path: Path) -> None:
    """(A CI run: a rank that hung while the group was made gave an AttributeError instead.)"""
    [result] = results_or_raise(run_ranks(1, _creation_fails, outbox=tmp_path / "out"))
    assert result.startswith("GroupBrokenError: creating the checkpoint process group"), result
    assert "wait timeout after 3000ms" in result
