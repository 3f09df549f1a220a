"""The golden node-local level (tests/golden/levels-v1, made by tests/golden/make_golden_levels.py):
two nodes' parts of one protected step, with ``node-part.json`` as first released, committed as
bytes. Each node's part still decodes, verifies and lists as protected, and each node alone, or
both on two ranks, still restores the whole state (a part plus its peer's replicas)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import shardkeep as sk
from shardkeep.levels.parts import decode_node_part
from shardkeep.levels.status import level_copies
from tests.support.distributed_harness import results_or_raise, run_ranks
from tests.support.states import full_rows, row_sharded

GOLDEN = Path(__file__).parent / "golden" / "levels-v1"
NAME = "step_00000008"


@pytest.fixture
def golden(tmp_path: Path) -> Path:
    shutil.copytree(GOLDEN, tmp_path / "levels")
    return tmp_path / "levels"


def test_each_golden_node_part_decodes_verifies_and_lists_as_protected(golden: Path) -> None:
    for node, other in ((0, 1), (1, 0)):
        where = golden / f"node{node}" / NAME / "node-part.json"
        part = decode_node_part(where.read_bytes(), where=str(where))
        mine = [f"shards/rank_{rank:05d}_sharded.safetensors" for rank in (2 * node, 2 * node + 1)]
        theirs = [f"shards/rank_{rank:05d}_sharded.safetensors" for rank in (2 * other, 2 * other + 1)]
        assert (part.node, part.nodes, part.ranks, part.world_size) == (node, 2, [2 * node, 2 * node + 1], 4)
        assert part.files == mine and part.replicas == {other: theirs} and part.healed == []
        assert part.manifest_digest.startswith("blake3:")
        assert sk.verify(golden / f"node{node}" / NAME).ok
        copies = level_copies("local", str(golden / f"node{node}"), verify=True)
        assert [(copy.name, copy.state, copy.node) for copy in copies] == [(NAME, "protected", node)]


@pytest.mark.parametrize("survivor", [0, 1])
def test_either_golden_node_alone_restores_the_whole_step_on_one_process(golden: Path, survivor: int) -> None:
    shutil.rmtree(golden / f"node{1 - survivor}")  # the other node is lost with its disk
    level = sk.Level("local", str(golden / f"node{survivor}"), node_local=True)
    manager = sk.MultiLevelManager([level])
    target: dict[str, Any] = {"weights": torch.zeros(24, 4), "step": 0}
    restored = manager.restore(into=target)
    manager.close()
    assert restored is not None and restored.step == 8
    assert torch.equal(target["weights"], full_rows(8)) and restored.state["step"] == 8


def _restore_on_two_ranks(rank: int, world_size: int, root: str) -> dict[str, Any]:
    level = sk.Level("local", root + "/node{node}", node_local=True)
    manager = sk.MultiLevelManager([level], node_of=lambda r: r, timeout=60)
    target = row_sharded(0, zeros=True)
    restored = manager.restore(into=target)
    manager.close()
    assert restored is not None
    return {"step": restored.step, "equal": bool(torch.equal(target["weights"].full_tensor(), full_rows(8)))}


def test_the_golden_level_restores_resharded_onto_two_ranks(golden: Path, tmp_path: Path) -> None:
    results = results_or_raise(run_ranks(2, _restore_on_two_ranks, str(golden), outbox=tmp_path / "out"))
    assert results == [{"step": 8, "equal": True}] * 2
