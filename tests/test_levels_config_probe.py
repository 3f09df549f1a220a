"""A shared level that some rank cannot reach when the manager is built: every rank raises the
same LevelUnreachableError (naming the level, the ranks and nodes, and each one's reason) at the
first call, promptly and before anything is written; one process raises at construction."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

import shardkeep as sk
from shardkeep.errors import LevelUnreachableError
from shardkeep.levels.config import distributed_now, refuse_unreachable
from tests.support.distributed_harness import results_or_raise, run_ranks

torch = pytest.importorskip("torch")

TIMEOUT = 30.0


def _levels(tmp: str, persistent: str) -> list[sk.Level]:
    return [
        sk.Level("local", tmp + "/node{node}", node_local=True, save_policy=sk.SavePolicy(every_steps=2)),
        sk.Level("persistent", persistent, source="drain", save_policy=sk.SavePolicy(every_steps=4)),
    ]


def _unreachable_on_rank_1(rank: int, world_size: int, tmp: str, first_call: str) -> dict[str, Any]:
    base = Path(tmp)
    if rank == 1:  # this rank's view of the shared level: a path under a file
        (base / "blocker").write_text("not a directory")
        root = str(base / "blocker" / "persistent")
    else:
        root = str(base / "persistent")
    started = time.monotonic()
    manager = sk.MultiLevelManager(_levels(tmp, root), node_of=list(range(world_size)), timeout=TIMEOUT)
    built = time.monotonic() - started
    errors: list[tuple[str, str]] = []
    for _ in range(2):  # the second call raises again, without a collective
        try:
            if first_call == "save":
                manager.save({"w": torch.ones(4) * rank}, step=0)
            elif first_call == "restore":
                manager.restore()
            else:
                manager.should_save(0)
        except sk.ShardkeepError as exc:
            errors.append((type(exc).__name__, str(exc)))
    elapsed = time.monotonic() - started
    manager.close()  # nothing in flight: returns without a collective
    return {"built": built, "errors": errors, "elapsed": elapsed}


@pytest.mark.parametrize("first_call", ["should_save", "save", "restore"])
def test_a_level_one_rank_cannot_reach_is_refused_on_every_rank(tmp_path: Path, first_call: str) -> None:
    results = results_or_raise(
        run_ranks(2, _unreachable_on_rank_1, str(tmp_path), first_call, outbox=tmp_path / "out", timeout=120)
    )
    messages = set()
    for rank, result in enumerate(results):
        assert len(result["errors"]) == 2, (rank, result)
        for kind, message in result["errors"]:
            assert kind == "LevelUnreachableError", (rank, kind, message)
            messages.add(message)
        assert result["elapsed"] < TIMEOUT / 4, (rank, result["elapsed"])  # far below the timeout
    assert len(messages) == 1, messages  # the same error on every rank
    message = messages.pop()
    assert "level 'persistent'" in message and "rank(s) [1]" in message and "node(s) [1]" in message, message
    assert "rank 1 (node 1)" in message and "not a directory" in message.lower(), message
    assert "rank 0" not in message, message
    # nothing written: no local root, nothing on the level rank 0 reaches (its probe made it)
    assert not (tmp_path / "node0").exists() and not (tmp_path / "node1").exists()
    assert list((tmp_path / "persistent").iterdir()) == []


def test_one_process_is_refused_at_construction(tmp_path: Path) -> None:
    (tmp_path / "blocker").write_text("not a directory")
    assert not distributed_now()
    with pytest.raises(LevelUnreachableError, match=r"level 'persistent'.*unreachable"):
        sk.MultiLevelManager(_levels(str(tmp_path), str(tmp_path / "blocker" / "persistent")))
    assert not (tmp_path / "node0").exists()


def test_the_refusal_names_each_level_rank_node_and_reason() -> None:
    refuse_unreachable([{}, {}, {}], [0, 0, 1])  # every rank reached every level: nothing raised
    reports = [{}, {"persistent": "no route"}, {}, {"persistent": "denied", "archive": "no bucket"}]
    with pytest.raises(LevelUnreachableError) as caught:
        refuse_unreachable(reports, [0, 0, 1, 1])
    message = str(caught.value)
    assert "level 'archive' is unreachable from rank(s) [3] on node(s) [1] of 4 ranks (rank 3 (node 1): no bucket)" in (
        message
    )
    assert "level 'persistent' is unreachable from rank(s) [1, 3] on node(s) [0, 1]" in message
    assert "rank 1 (node 0): no route; rank 3 (node 1): denied" in message
