"""Peer replicas of node-local parts (levels/replicas.py) and recovery after losing a node, on real
gloo ranks where "nodes" are groups of ranks with separate local roots.

Covered: the placement and its checks; the per-rank plan; a node lost after its step was
protected (its root wiped: the run resumes at the newest local step from the replicas, no
persistent copy needed); replication not finished for the newest step (that step is lost and
named, the run resumes at the newest protected step); two of three nodes lost with one replica
(a clear fallback to the persistent level); a replica that fails its digest on arrival (skipped,
named, never written); a restart on fewer nodes resharding from the replicas; retention keeping
the newest protected step; a new save while the previous step is still replicating; the status
listing and ``shardkeep ls --level`` showing ``protected``.
"""

from __future__ import annotations

import functools
import io
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import shardkeep as sk
from shardkeep.errors import LevelConfigError
from shardkeep.levels.config import check_levels, replica_holders
from shardkeep.levels.nodes import NodeMap, check_hosts
from shardkeep.levels.parts import NodePart, decode_node_part, encode_node_part
from shardkeep.levels.replicas import plan_replicas
from shardkeep.levels.status import level_copies
from shardkeep.manifest import FileRecord
from tests.support.distributed_harness import results_or_raise, run_ranks
from tests.support.observe import counted_all_gathers
from tests.support.states import full_rows, row_sharded

# -- placement and configuration ------------------------------------------------------------------


def _local(**kwargs: Any) -> sk.Level:
    return sk.Level("local", "/tmp/shardkeep-replicas-{node}", node_local=True, **kwargs)


def test_the_default_is_one_replica_with_two_nodes_or_more_and_none_with_one() -> None:
    level = _local()
    assert level.replicas is None
    assert level.replicas_for(1) == 0 and level.replicas_for(2) == 1 and level.replicas_for(8) == 1
    assert _local(replicas=0).replicas_for(4) == 0
    assert sk.Level("p", "/tmp/shardkeep-shared").replicas_for(4) == 0


@pytest.mark.parametrize(
    ("nodes", "replicas", "jump", "holders_of_0"),
    [(2, 1, None, [1]), (4, 1, None, [1]), (4, 2, None, [1, 2]), (4, 3, None, [1, 2, 3]), (5, 2, 2, [2, 4])],
)
def test_the_clique_placement_by_node(nodes: int, replicas: int, jump: int | None, holders_of_0: list[int]) -> None:
    level = _local(replicas=replicas, replica_jump=jump)
    assert replica_holders(level, 0, nodes) == holders_of_0
    for node in range(nodes):  # never the node itself, each node holds as many parts as it gives
        assert node not in replica_holders(level, node, nodes)
    received = [h for node in range(nodes) for h in replica_holders(level, node, nodes)]
    assert sorted(received) == sorted(list(range(nodes)) * replicas)


def test_more_replicas_than_other_nodes_is_refused_naming_the_level_and_the_node_count() -> None:
    with pytest.raises(LevelConfigError, match=r"level 'local': replicas=2 needs 3 nodes or more, the job has 2"):
        check_levels([_local(replicas=2)], node_count=2)
    with pytest.raises(LevelConfigError, match="the job has 1 node"):
        check_levels([_local(replicas=1)], node_count=1)
    check_levels([_local(replicas=2)])  # the node count is not known yet: checked once it is
    check_levels([_local()], node_count=1)  # the default: no replica on one node


def test_a_jump_that_maps_a_node_onto_itself_is_refused_naming_it() -> None:
    with pytest.raises(LevelConfigError, match=r"replica_jump=2 with 4 nodes puts replica 2 of node 0 on node 0"):
        check_levels([_local(replicas=2, replica_jump=2)], node_count=4)
    with pytest.raises(LevelConfigError, match=r"replica_jump=3 with 3 nodes puts replica 1 of node 0 on node 0"):
        check_levels([_local(replicas=1, replica_jump=3)], node_count=3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"replicas": -1}, "replicas=-1 must be an integer >= 0"),
        ({"replicas": True}, "replicas=True must be an integer"),
        ({"replicas": 1.5}, "replicas=1.5 must be an integer"),
        ({"replica_jump": 0}, "replica_jump=0 must be an integer >= 1"),
    ],
)
def test_bad_replica_settings_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(LevelConfigError, match=message):
        _local(**kwargs)


def test_replicas_on_a_shared_level_are_refused() -> None:
    with pytest.raises(LevelConfigError, match="level 'p': replicas= and replica_jump= copy a node-local level"):
        sk.Level("p", "/tmp/shardkeep-shared", replicas=1)


def test_ranks_of_one_node_on_different_hosts_are_refused_naming_the_rank_and_the_node() -> None:
    nodes = NodeMap((0, 0, 1, 1), source="SHARDKEEP_NODE")
    check_hosts(nodes, ["a", "a", "a", "a"])  # several nodes on one host: simulations, namespaces
    with pytest.raises(
        LevelConfigError, match=r"rank 3 says it is on node 1 \(from SHARDKEEP_NODE\) but runs on host 'c'"
    ):
        check_hosts(nodes, ["a", "a", "b", "c"])


def test_a_node_part_without_replicas_still_decodes_and_one_with_them_round_trips() -> None:
    old = (
        b'{"node":1,"nodes":2,"ranks":[2,3],"world_size":4,"files":["shards/a"],"attempt":"x",'
        b'"manifest_digest":"blake3:00","run_id":null,"healed":["shards/b"]}'
    )
    part = decode_node_part(old, where="old")
    assert part.replicas == {} and part.holds() == {"shards/a", "shards/b"}
    part.replicas = {0: ["shards/c"]}
    again = decode_node_part(encode_node_part(part), where="new")
    assert again == part and again.holds() == {"shards/a", "shards/b", "shards/c"}
    assert isinstance(again, NodePart)


def test_the_plan_sends_each_file_from_its_writer_to_one_rank_of_each_holder_in_bounded_batches() -> None:
    nodes = NodeMap((0, 0, 1, 1))
    records = [FileRecord(path=f"shards/r{rank}-{i}", rank=rank, size=40, digest="blake3:00") for rank in range(4) for i in range(3)]  # fmt: skip
    level = _local()
    plans = [plan_replicas(records, nodes, level, rank, f"/n{nodes.node_of[rank]}/step", batch_bytes=80) for rank in range(4)]  # fmt: skip
    assert {len(plan.batches) for plan in plans} == {2}  # 3 files of 40 bytes per sender, 80 per batch
    for rank, plan in enumerate(plans):
        sends = [send for sends, _ in plan.batches for send in sends]
        receives = [receive for _, receives in plan.batches for receive in receives]
        assert sorted(send.record.path for send in sends) == [f"shards/r{rank}-{i}" for i in range(3)]
        assert {send.peer for send in sends} == {(rank + 2) % 4}  # same position on the other node
        assert {receive.peer for receive in receives} == {(rank + 2) % 4}
        assert all(str(receive.destination).startswith(f"/n{nodes.node_of[rank]}/step/") for receive in receives)
    assert plans[0].received == {1: sorted(f"shards/r{r}-{i}" for r in (2, 3) for i in range(3))}
    assert plans[2].received == {0: sorted(f"shards/r{r}-{i}" for r in (0, 1) for i in range(3))}


# -- on gloo ranks --------------------------------------------------------------------------------


_full = full_rows
_state = row_sharded


def _node_of(per_node: int, rank: int) -> int:
    return rank // per_node


def _levels(tmp: str, spec: dict[str, Any]) -> list[sk.Level]:
    levels = [
        sk.Level(
            "local",
            tmp + "/node{node}",
            node_local=True,
            replicas=spec.get("replicas"),
            save_policy=sk.SavePolicy(every_steps=2),
            retention=sk.RetentionPolicy(keep_last=spec.get("keep_last", 2), keep_best=0),
        )
    ]
    if spec.get("persistent", True):
        levels.append(
            sk.Level(
                "persistent",
                tmp + "/persistent",
                source="drain",
                save_policy=sk.SavePolicy(every_steps=4),
                retention=sk.RetentionPolicy(keep_last=3, keep_best=0),
            )
        )
    return levels


def _patch_replication(rank: int, tmp: str, spec: dict[str, Any]) -> None:
    """In this (forked) rank only: skip the replication of ``spec["skip"]`` steps (the node died
    before it ran), damage this rank's file before ``spec["flip"]`` steps are replicated, and
    slow each exchange down by ``spec["slow"]`` seconds."""
    import time

    from shardkeep.levels import replicas

    after_commit = replicas.Replication.after_commit
    run_exchange = replicas.run_exchange

    def patched(self: Any, step: int, name: str, root: str, coordinator: Any, nodes: Any) -> None:
        if step in spec.get("skip", ()):
            return
        if step in spec.get("flip", ()) and rank == spec.get("flip_rank", 2):
            victim = Path(root, name, "shards", f"rank_{rank:05d}_sharded.safetensors")
            data = bytearray(victim.read_bytes())
            data[-1] ^= 0xFF
            victim.write_bytes(bytes(data))
        after_commit(self, step, name, root, coordinator, nodes)

    def slow_exchange(*args: Any, **kwargs: Any) -> Any:
        time.sleep(spec.get("slow", 0.0))
        return run_exchange(*args, **kwargs)

    replicas.Replication.after_commit = patched  # type: ignore[method-assign]
    replicas.run_exchange = slow_exchange  # type: ignore[assignment]


def _train(rank: int, world_size: int, tmp: str, spec: dict[str, Any]) -> dict[str, Any]:
    _patch_replication(rank, tmp, spec)
    manager = sk.MultiLevelManager(
        _levels(tmp, spec),
        node_of=functools.partial(_node_of, spec.get("per_node", 2)),
        timeout=60,
        replicate_wait=spec.get("replicate_wait", 0.0),
    )
    saves = []
    for step in range(spec.get("first", 0), spec["last"] + 1):
        if manager.should_save(step):
            result = manager.save(_state(step), step=step)
            saves.append((step, dict(result.committed), result.blocked_seconds))
            if spec.get("wait_each", True):
                manager.wait_for_replicas()
    protected = manager.wait_for_replicas()
    replication = manager.replication
    assert replication is not None
    settled = {
        step: (outcome.state, list(outcome.problems), outcome.bytes_sent, outcome.bytes_received)
        for step, outcome in replication.settled.items()
    }
    status = {level: [(copy.step, copy.state) for copy in copies] for level, copies in manager.status().items()}
    manager.close()
    return {
        "saves": saves,
        "protected": protected,
        "settled": settled,
        "status": status,
        "waited": replication.blocked_seconds,
    }


def _restore(rank: int, world_size: int, tmp: str, spec: dict[str, Any]) -> dict[str, Any]:
    manager = sk.MultiLevelManager(
        _levels(tmp, spec), node_of=functools.partial(_node_of, spec.get("per_node", 2)), timeout=60
    )
    state = _state(0, zeros=True)
    with counted_all_gathers() as gathers:  # the labels of the restore's all-gathers, in order
        restored = manager.restore(into=state)
    manager.close()
    assert restored is not None
    return {
        "step": restored.step,
        "equal": bool(torch.equal(state["weights"].full_tensor(), _full(restored.step))),
        "source": dict(restored.report.source),
        "healed": list(restored.report.healed),
        "refused": list(restored.report.refused),
        "levels_read": list(restored.report.levels_read),
        "gathers": gathers,
    }


def train(tmp_path: Path, ranks: int, **spec: Any) -> list[dict[str, Any]]:
    return results_or_raise(run_ranks(ranks, _train, str(tmp_path), spec, outbox=tmp_path / "train"))


def restore(tmp_path: Path, ranks: int, label: str, **spec: Any) -> dict[str, Any]:
    results = results_or_raise(run_ranks(ranks, _restore, str(tmp_path), spec, outbox=tmp_path / label))
    assert all(result["equal"] for result in results), results
    assert all(result == results[0] for result in results[1:]), results  # every rank reports the same
    return results[0]


def wipe(root: Path) -> None:
    """A node replaced by a fresh one: its local disk is empty."""
    shutil.rmtree(root)
    root.mkdir()


def _part(root: Path, step: int) -> dict[str, Any]:
    loaded = json.loads((root / f"step_{step:08d}" / "node-part.json").read_bytes())
    assert isinstance(loaded, dict)
    return loaded


def test_a_lost_node_resumes_at_the_newest_local_step_from_the_replicas(tmp_path: Path) -> None:
    results = train(tmp_path, 4, last=6)
    assert {result["protected"] for result in results} == {6}
    sent = sum(result["settled"][6][2] for result in results)
    received = sum(result["settled"][6][3] for result in results)
    assert sent == received > 0  # every byte sent arrived and was checked
    assert all(result["status"]["local"][-1] == (6, "protected") for result in results), results[0]["status"]
    assert _part(tmp_path / "node0", 6)["replicas"] == {"1": _part(tmp_path / "node1", 6)["files"]}
    # the persistent level holds steps 0 and 4 only: step 6 exists on the local disks alone
    assert not (tmp_path / "persistent" / "step_00000006").exists()
    wipe(tmp_path / "node1")
    report = restore(tmp_path, 4, "after-loss")
    assert report["step"] == 6, report
    assert report["levels_read"] == ["local"], report
    # node 0's replicas ride on the check's agreement: no gathering of who holds what; each
    # rank reads once its own files are in, so one agreement ends the fetch and the read: the
    # node map, the listing, metadata, check, fetch and read, fill
    assert not any("who holds what" in label for label in report["gathers"]), report["gathers"]
    assert len(report["gathers"]) == 6, report["gathers"]
    assert {source for _, _, source in report["healed"]} == {"local@node0"}, report
    healed_files = {file for _, file, _ in report["healed"] if file.startswith("shards/")}
    assert healed_files == set(_part(tmp_path / "node0", 6)["replicas"]["1"])
    # node 1's part is rebuilt (a plain part: its replicas come with the next protected save)
    rebuilt = _part(tmp_path / "node1", 6)
    assert set(rebuilt["healed"]) >= healed_files and rebuilt["replicas"] == {}
    assert sk.verify(tmp_path / "node1" / "step_00000006").ok


def test_a_lost_node_takes_its_part_from_the_replicas_before_the_persistent_copy(tmp_path: Path) -> None:
    train(tmp_path, 4, last=4)  # step 4: protected on the local level and drained
    assert (tmp_path / "persistent" / "step_00000004" / "manifest.json").exists()
    wipe(tmp_path / "node1")
    report = restore(tmp_path, 4, "after-loss")
    assert report["step"] == 4 and report["levels_read"] == ["local"], report
    assert {source for _, file, source in report["healed"] if file.startswith("shards/")} == {"local@node0"}


def test_replication_not_finished_loses_that_step_and_names_it(tmp_path: Path) -> None:
    results = train(tmp_path, 4, last=6, skip=[6])  # the node dies before step 6 is replicated
    assert {result["protected"] for result in results} == {4}
    assert results[0]["status"]["local"][-2:] == [(4, "protected"), (6, "committed")]
    wipe(tmp_path / "node1")
    report = restore(tmp_path, 4, "after-loss")
    assert report["step"] == 4, report  # the newest protected step (persisted too)
    lost = [entry for entry in report["refused"] if entry[0] == 6]
    assert lost and all(entry[2] in ("local", "persistent") for entry in lost), report
    assert any("no other node holds it" in entry[3] for entry in lost), lost
    assert any(entry[2] == "persistent" and "no copy of step 6" in entry[3] for entry in lost), lost


def test_two_of_three_nodes_lost_with_one_replica_falls_back_to_the_persistent_level(tmp_path: Path) -> None:
    results = train(tmp_path, 6, last=6)
    assert {result["protected"] for result in results} == {6}
    # node 1's part is on node 1 and on node 2 only: losing both loses it
    assert _part(tmp_path / "node2", 6)["replicas"] == {"1": _part(tmp_path / "node1", 6)["files"]}
    wipe(tmp_path / "node1")
    wipe(tmp_path / "node2")
    report = restore(tmp_path, 6, "after-loss")
    assert report["step"] == 4, report
    assert "persistent" in report["levels_read"], report
    assert {entry[0] for entry in report["refused"]} == {6}, report
    assert any("rank_00002" in entry[3] and "no other node holds it" in entry[3] for entry in report["refused"])


def test_a_replica_that_fails_its_digest_is_skipped_named_and_never_written(tmp_path: Path) -> None:
    results = train(tmp_path, 4, last=2, flip=[2], flip_rank=2, persistent=False)
    assert {result["protected"] for result in results} == {0}  # step 2 is not protected
    state, problems, _, _ = results[0]["settled"][2]  # rank 0 received rank 2's file
    assert state == "failed", results[0]["settled"]
    assert len(problems) == 1 and problems[0].startswith("shards/rank_00002_sharded.safetensors: replica from rank 2 (node 1) to rank 0 (node 0) of step 2"), problems  # fmt: skip
    assert "skipped, never loaded" in problems[0]
    assert not (tmp_path / "node0" / "step_00000002" / "shards" / "rank_00002_sharded.safetensors").exists()
    assert (tmp_path / "node0" / "step_00000002" / "shards" / "rank_00003_sharded.safetensors").exists()
    assert _part(tmp_path / "node0", 2)["replicas"] == {} and _part(tmp_path / "node1", 2)["replicas"] == {}
    assert results[0]["status"]["local"] == [(0, "protected"), (2, "committed")]


def test_a_restart_on_fewer_nodes_reshards_from_the_replicas(tmp_path: Path) -> None:
    train(tmp_path, 4, last=6, persistent=False)
    shutil.rmtree(tmp_path / "node1")  # node 1 is gone: the job restarts with node 0's two ranks
    report = restore(tmp_path, 2, "fewer", persistent=False)
    assert report["step"] == 6 and report["levels_read"] == ["local"] and report["healed"] == [], report


def test_retention_keeps_the_newest_protected_step_until_a_newer_one_is_protected(tmp_path: Path) -> None:
    train(tmp_path, 2, last=6, keep_last=1, skip=[4, 6], persistent=False, per_node=1)
    names = sorted(p.name for p in (tmp_path / "node0").iterdir())
    assert names == ["step_00000002", "step_00000006"], names  # 2: protected, 6: the newest
    assert level_copies("local", str(tmp_path / "node0"))[0].state == "protected"
    out = io.StringIO()
    code = sk_cli(["ls", "--level", f"local={tmp_path / 'node0'}"], out)
    assert code == 0 and "protected" in out.getvalue() and "replicas of node(s) 1" in out.getvalue(), out.getvalue()
    train(tmp_path, 2, first=8, last=8, keep_last=1, persistent=False, per_node=1)  # step 8 protected: 2 and 6 go
    assert sorted(p.name for p in (tmp_path / "node0").iterdir()) == ["step_00000008"]


def sk_cli(argv: list[str], out: io.StringIO) -> int:
    from shardkeep.cli import main

    return main(argv, out=out, err=io.StringIO())


def test_a_save_while_the_previous_step_replicates_skips_it_within_replicate_wait(tmp_path: Path) -> None:
    # each exchange takes 6 s: step 0 is still replicating when steps 2 and 4 are saved; step 2
    # waits in the queue behind it and is skipped when step 4 comes
    results = train(tmp_path, 2, last=4, slow=6.0, wait_each=False, persistent=False, per_node=1)
    for result in results:
        assert result["protected"] == 4, result
        states = {step: settled[0] for step, settled in result["settled"].items()}
        assert states == {0: "done", 2: "cancelled", 4: "done"}, result["settled"]
        assert all(blocked < 3.0 for _, _, blocked in result["saves"]), result["saves"]  # replicate_wait=0
    assert _part(tmp_path / "node0", 2)["replicas"] == {} and _part(tmp_path / "node0", 4)["replicas"]
    assert sorted(p.name for p in (tmp_path / "node0").iterdir()) == ["step_00000002", "step_00000004"]


def test_replicate_wait_lets_a_save_wait_for_the_previous_step_and_measures_it(tmp_path: Path) -> None:
    results = train(tmp_path, 2, last=4, slow=2.0, wait_each=False, persistent=False, per_node=1, replicate_wait=30.0)
    for result in results:
        states = {step: settled[0] for step, settled in result["settled"].items()}
        assert states == {0: "done", 2: "done", 4: "done"} and result["protected"] == 4, result
        assert 1.0 < result["waited"] < 30.0, result["waited"]  # the saves of steps 2 and 4 waited
        assert result["saves"][1][2] >= 1.0, result["saves"]
