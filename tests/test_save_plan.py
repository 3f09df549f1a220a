"""The save plan at scale: what crosses ranks is a digest per rank in the usual case; chunks held
by several replicas are written once, spread over the replicas; ranks that hold different whole
tensors fall back to exchanging their lists; ranks that disagree about a sharded tensor are
refused. Real gloo ranks (forked, 127.0.0.1) and the pure planning functions."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardkeep as sk
from shardkeep.distributed.plan import (
    ItemDescriptor,
    agreement_digest,
    assign_by_class,
    assign_identical,
    assign_writers,
    chunk_writer,
    global_totals,
)
from tests.support.distributed_harness import results_or_raise, run_ranks


def _whole(key: str, nbytes: int) -> ItemDescriptor:
    return ItemDescriptor(key, "F32", (nbytes // 4,), nbytes, None, None)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=1 << 20), min_size=0, max_size=40),
    world_size=st.integers(min_value=1, max_value=9),
)
def test_assigning_alone_equals_assigning_over_every_rank(sizes: list[int], world_size: int) -> None:
    items = [_whole(f"t{index}", 4 * (size // 4)) for index, size in enumerate(sizes)]
    assert assign_identical(items, world_size) == assign_writers([items] * world_size)
    small = 1 << 18  # with sharded tensors, the small whole tensors all go to the lowest rank
    together = assign_identical(items, world_size, small=small)
    assert together == assign_writers([items] * world_size, small=small)
    assert all(item.ident in together[0] for item in items if item.nbytes <= small)


def test_chunk_writer_is_stable_and_spreads() -> None:
    assert chunk_writer("w", (0, 0), 1) == 0
    picks = [chunk_writer(f"layers.{index}.w", (index * 8, 0), 4) for index in range(400)]
    assert picks == [chunk_writer(f"layers.{index}.w", (index * 8, 0), 4) for index in range(400)]
    assert set(picks) == {0, 1, 2, 3} and min(picks.count(r) for r in range(4)) > 60


def test_agreement_digest_covers_whole_tensors_and_sharded_shapes() -> None:
    chunk = ItemDescriptor("s", "BF16", (4, 8), 64, (16, 8), (0, 0))
    other_chunk = ItemDescriptor("s", "BF16", (4, 8), 64, (16, 8), (4, 0))
    base = [_whole("a", 64), chunk]
    assert agreement_digest(base) == agreement_digest([_whole("a", 64), other_chunk])  # own chunks may differ
    assert agreement_digest(base) != agreement_digest([_whole("a", 68), chunk])
    assert agreement_digest(base) != agreement_digest([_whole("a", 64), chunk._replace(global_shape=(20, 8))])
    assert len(agreement_digest(base)) == 32
    assert global_totals(base) == {"a": (64, "F32"), "s": (16 * 8 * 2, "BF16")}


ROWS = 12


def _hsdp_state(world_size: int) -> dict[str, Any]:
    """Replicate over 2 groups x Shard(0) over world_size // 2 ranks (HSDP), plus whole tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, world_size // 2))
    generator = torch.Generator().manual_seed(3)
    state: dict[str, Any] = {}
    for index in range(8):
        full = torch.randn(ROWS, 4, generator=generator)
        state[f"layers.{index}.w"] = distribute_tensor(full, mesh, [Replicate(), Shard(0)])
    state["bias"] = torch.randn(5, generator=generator)
    return state


def _save_hsdp(rank: int, world_size: int, path: str) -> dict[str, Any]:
    sk.save(_hsdp_state(world_size), path)
    if rank != 0:
        return {}
    manifest = sk.read_manifest(path)  # format 2.0: with every rank index expanded
    writers = sorted({(record.rank, entry.key) for record in manifest.files for entry in record.tensors})
    return {"writers": writers, "strategy": manifest.sharding.strategy}


def test_replicated_chunks_are_written_once_spread_over_replicas(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    saved = results_or_raise(run_ranks(4, _save_hsdp, path, outbox=tmp_path / "out"))
    assert saved[0]["strategy"] == "dtensor"
    ranks_writing_chunks = {rank for rank, key in saved[0]["writers"] if key.startswith("layers.")}
    # Ranks 0, 1 are replica group 0 and ranks 2, 3 group 1: both groups write some chunks.
    assert ranks_writing_chunks & {0, 1} and ranks_writing_chunks & {2, 3}
    assert sk.verify(path).ok  # every chunk exactly once: coverage is checked at commit and here
    loaded = sk.load(path)
    generator = torch.Generator().manual_seed(3)
    for index in range(8):
        assert torch.equal(loaded[f"layers.{index}.w"], torch.randn(ROWS, 4, generator=generator))
    assert torch.equal(loaded["bias"], torch.randn(5, generator=generator))


def _save_rank_specific(rank: int, world_size: int, path: str) -> dict[str, Any]:
    state = {"shared": torch.arange(6.0), f"rank{rank}.extra": torch.full((3,), float(rank))}
    sk.save(state, path)
    return {}


def test_ranks_holding_different_whole_tensors_fall_back_to_exchanging_lists(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    results_or_raise(run_ranks(3, _save_rank_specific, path, outbox=tmp_path / "out"))
    loaded = sk.load(path)
    assert torch.equal(loaded["shared"], torch.arange(6.0))
    for rank in range(3):
        assert torch.equal(loaded[f"rank{rank}.extra"], torch.full((3,), float(rank)))


def _save_disagreeing(rank: int, world_size: int, path: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world_size,))
    rows = 8 if rank == 0 else 10  # rank 1 claims another global shape
    local = torch.zeros(rows // world_size, 2)
    tensor = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size([rows, 2]), stride=(2, 1))
    try:
        sk.save({"w": tensor}, path)
    except sk.CoordinationError as exc:
        return {"error": str(exc)}
    return {"error": None}


def test_ranks_that_disagree_about_a_sharded_tensor_are_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    results = results_or_raise(run_ranks(2, _save_disagreeing, path, outbox=tmp_path / "out"))
    for result in results:
        assert result["error"] is not None and "'w'" in result["error"], result
    assert not os.path.exists(path)


@pytest.mark.parametrize("world_size", [2])
def test_the_usual_save_exchanges_a_digest_not_descriptors(tmp_path: Path, world_size: int) -> None:
    """Counted on the real collectives: with every rank holding the same, the planning steps
    gather short strings, not descriptor lists."""
    results = results_or_raise(run_ranks(world_size, _count_planning_payloads, str(tmp_path / "c"), outbox=tmp_path))
    for sizes in results:
        assert sizes and max(sizes) < 200, sizes


def _count_planning_payloads(rank: int, world_size: int, path: str) -> list[int]:
    import pickle

    from shardkeep.distributed.coordinator import Coordinator

    sizes: list[int] = []
    real = Coordinator.all_gather

    def counting(self: Coordinator, value: Any, *, label: str = "all_gather") -> list[Any]:
        if label in ("prepare the save", "compare what the ranks hold"):
            sizes.append(len(pickle.dumps(value)))
        return real(self, value, label=label)

    Coordinator.all_gather = counting  # type: ignore[method-assign]  # this forked rank only
    state = {f"layer{i}.weight": torch.randn(64, 8) for i in range(200)}
    sk.save(state, path)
    return sizes


def _save_uneven(rank: int, world_size: int, path: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    state = {
        # 2 rows over 4 ranks: ranks 2 and 3 hold empty chunks at the same offset (2, 0).
        "two_rows": distribute_tensor(torch.arange(8.0).reshape(2, 4), mesh, [Shard(0)]),
        # A tensor with no elements at all: its key must still be recorded, once.
        "empty": distribute_tensor(torch.zeros(0, 4), mesh, [Shard(0)]),
        "cols": distribute_tensor(torch.arange(6.0).reshape(2, 3), mesh, [Shard(1)]),
    }
    sk.save(state, path)
    return {}


def test_empty_chunks_held_by_several_ranks_are_not_written_twice(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    results_or_raise(run_ranks(4, _save_uneven, path, outbox=tmp_path / "out"))
    assert sk.verify(path).ok
    loaded = sk.load(path)
    assert torch.equal(loaded["two_rows"], torch.arange(8.0).reshape(2, 4))
    assert loaded["empty"].shape == (0, 4)
    assert torch.equal(loaded["cols"], torch.arange(6.0).reshape(2, 3))
    manifest = sk.read_manifest(path)
    assert sum(1 for _, entry in manifest.iter_tensors() if entry.key == "empty") == 1


def test_a_distributed_manifest_omits_default_fields_like_a_single_process_one(tmp_path: Path) -> None:
    """File records cross ranks as msgpack: the coordinator's manifest omits default fields
    ("type": "dense", "tier": "hot" ...), as a one-process save does."""
    path = tmp_path / "ckpt"
    results_or_raise(run_ranks(2, _save_rank_specific, str(path), outbox=tmp_path / "out"))
    text = (path / "manifest.json").read_text()
    assert '"type":"dense"' not in text.replace(" ", "") and '"array_type":"torch"' not in text.replace(" ", "")


def _save_expert_parallel(rank: int, world_size: int, path: str) -> dict[str, Any]:
    # Expert parallelism: each rank holds its own experts, under containers the others lack.
    experts = {str(2 * rank + i): {"w": torch.full((2,), float(2 * rank + i))} for i in range(2)}
    sk.save({"shared": torch.zeros(2), "experts": experts, "names": ["a", "b"]}, path)
    return {}


def test_containers_only_other_ranks_hold_join_the_tree(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    results_or_raise(run_ranks(3, _save_expert_parallel, path, outbox=tmp_path / "out"))
    loaded = sk.load(path)
    assert sorted(loaded["experts"], key=int) == [str(i) for i in range(6)]
    for index in range(6):
        assert torch.equal(loaded["experts"][str(index)]["w"], torch.full((2,), float(index)))
    assert loaded["names"] == ["a", "b"]


@settings(max_examples=80, deadline=None)
@given(
    holdings=st.lists(
        st.lists(st.integers(min_value=0, max_value=12), min_size=0, max_size=8, unique=True), min_size=1, max_size=4
    ),
    world_size=st.integers(min_value=1, max_value=9),
    small=st.sampled_from([0, 64]),
    data=st.data(),
)
def test_assigning_by_class_equals_assigning_over_every_rank(
    holdings: list[list[int]], world_size: int, small: int, data: st.DataObject
) -> None:
    """Ranks in classes that hold the same: sent once per class, placed as if every rank had
    sent its own list."""
    classes = [[_whole(f"t{index}", 4 * (index * 37 % 97)) for index in held] for held in holdings]
    labels = [data.draw(st.integers(0, len(classes) - 1)) for _ in range(world_size)]
    members = [[rank for rank, label in enumerate(labels) if label == position] for position in range(len(classes))]
    present = [position for position in range(len(classes)) if members[position]]
    expected = assign_writers([classes[label] for label in labels], small=small)
    got = assign_by_class([classes[p] for p in present], [members[p] for p in present], world_size, small=small)
    assert got == expected
