"""The coordination wrapper over real gloo process groups (forked ranks on 127.0.0.1)."""

from __future__ import annotations

import pickle
import time
from pathlib import Path
from typing import Any

import pytest

import shardkeep as sk
from shardkeep.distributed.coordinator import SLOT_BYTES_MAX, SLOT_BYTES_MIN, Coordinator, slot_bytes
from tests.support.distributed_harness import results_or_raise, run_ranks


def test_without_a_process_group_it_is_a_no_op() -> None:
    coordinator = Coordinator()
    assert (coordinator.rank, coordinator.world_size, coordinator.is_coordinator) == (0, 1, True)
    assert coordinator.all_gather(5) == [5]
    assert coordinator.broadcast("x") == "x"
    coordinator.barrier()
    assert coordinator.step("work", lambda: 7) == [7]


def _largest_fitting(slot: int) -> int:
    """The length of the bytes value whose pickle fills a slot exactly."""
    return next(
        n for n in range(slot) if len(pickle.dumps(b"z" * (n + 1), protocol=pickle.HIGHEST_PROTOCOL)) > slot - 4
    )


#: Around the edge of a three-rank job's slot, and far beyond it.
_SIZES = (_largest_fitting(slot_bytes(3)), _largest_fitting(slot_bytes(3)) + 1, 3 * slot_bytes(3))


def test_slots_shrink_with_the_world_so_an_all_gather_stays_small() -> None:
    assert slot_bytes(1) == slot_bytes(64) == SLOT_BYTES_MAX
    assert slot_bytes(1024) == slot_bytes(16384) == SLOT_BYTES_MIN
    for world in (2, 64, 100, 512, 1024):
        assert SLOT_BYTES_MIN <= slot_bytes(world) <= SLOT_BYTES_MAX
        assert slot_bytes(world) * world <= max(256 << 10, SLOT_BYTES_MIN * world)
    assert len(pickle.dumps(b"z" * _SIZES[0], protocol=pickle.HIGHEST_PROTOCOL)) == slot_bytes(3) - 4


def _collectives(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    coordinator = Coordinator(timeout=30)
    assert coordinator.group is not dist.group.WORLD  # checkpoint traffic has its own group
    gathered = coordinator.all_gather({"rank": rank})
    chosen = coordinator.broadcast(f"from {rank}" if coordinator.is_coordinator else None)
    coordinator.barrier()
    results = coordinator.step("square", lambda: rank * rank)
    # Small values cross in fixed slots (4 bytes of length, then the pickle); one value too large
    # for its slot, on rank 1 only, sends every rank's value the usual way. Either way all
    # arrive intact.
    uneven = [coordinator.all_gather(b"z" * n if rank == 1 else bytes([rank]) * 9) for n in _SIZES]
    again = Coordinator(timeout=30)
    return {
        "uneven": uneven,
        "gathered": gathered,
        "chosen": chosen,
        "results": results,
        "same_group": again.group is coordinator.group,
        "rank": coordinator.rank,
    }


def test_collectives_on_three_ranks(tmp_path: Path) -> None:
    results = results_or_raise(run_ranks(3, _collectives, outbox=tmp_path))
    for rank, result in enumerate(results):
        assert result["gathered"] == [{"rank": 0}, {"rank": 1}, {"rank": 2}]
        assert result["chosen"] == "from 0"
        assert result["results"] == [0, 1, 4]
        assert result["uneven"] == [[bytes(9), b"z" * n, bytes([2]) * 9] for n in _SIZES]
        assert result["same_group"] is True
        assert result["rank"] == rank


def _one_rank_fails(rank: int, world_size: int) -> dict[str, Any]:
    coordinator = Coordinator(timeout=30)

    def work() -> int:
        if rank == 1:
            raise ValueError("disk on fire")
        return rank

    try:
        coordinator.step("write shards", work)
    except sk.CoordinationError as exc:
        return {"message": str(exc), "failures": exc.failures, "cause": type(exc.__cause__).__name__}
    return {"message": None}


def test_a_failure_on_one_rank_raises_on_every_rank(tmp_path: Path) -> None:
    results = results_or_raise(run_ranks(3, _one_rank_fails, outbox=tmp_path))
    for rank, result in enumerate(results):
        assert result["failures"] == {1: "ValueError: disk on fire"}, rank
        assert "write shards failed on rank(s) [1] of 3" in result["message"]
        assert result["cause"] == ("ValueError" if rank == 1 else "NoneType")


def _one_rank_hangs(rank: int, world_size: int, step: str = "step") -> dict[str, Any]:
    coordinator = Coordinator(timeout=3)
    if rank == 1:
        time.sleep(60)  # hung: never reaches the collective; the harness kills it
    started = time.monotonic()
    try:
        getattr(coordinator, step)("write shards", lambda: rank)
    except sk.CoordinationError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - started}
    return {"error": None, "seconds": time.monotonic() - started}


def _one_rank_hangs_before_sending(rank: int, world_size: int) -> dict[str, Any]:
    return _one_rank_hangs(rank, world_size, "step_to_coordinator")


@pytest.mark.slow
@pytest.mark.parametrize("hangs", [_one_rank_hangs, _one_rank_hangs_before_sending])
def test_a_hung_rank_produces_a_deadline_error_not_a_hang(tmp_path: Path, hangs: Any) -> None:
    """In an all-gather step and in a step whose results go to the coordinator alone (sizes,
    then one message per rank): the ranks still alive get a deadline error, never a hang."""
    outcomes = run_ranks(3, hangs, outbox=tmp_path, timeout=45, allow_unfinished=frozenset({1}))
    for rank in (0, 2):
        kind, result = outcomes[rank]
        assert kind == "ok", result
        assert result["error"] is not None and "deadline" in result["error"], result
        assert result["seconds"] < 30


def _coordinator_fails(rank: int, world_size: int) -> dict[str, Any]:
    coordinator = Coordinator(timeout=30)
    seen: dict[str, Any] = {"ok": coordinator.on_coordinator("list", lambda: ["step_1", rank])}

    def claim() -> None:
        raise sk.RunMismatchError("not yours", owner="run-a")

    try:
        coordinator.on_coordinator("claim", claim)
    except sk.RunMismatchError as exc:
        seen["owner"] = exc.owner
    for label, error in (("scan", sk.StorageError("cannot list the root")), ("other", ValueError("odd"))):

        def work(error: Exception = error) -> None:
            assert rank == 0, "runs on the coordinator only"
            raise error

        try:
            coordinator.on_coordinator(label, work)
        except sk.ShardkeepError as exc:
            seen[label] = (type(exc).__name__, str(exc), exc is error)
        except ValueError as exc:
            seen[label] = (type(exc).__name__, str(exc), exc is error)
    return seen


def test_an_error_on_the_coordinator_is_raised_with_its_type_on_every_rank(tmp_path: Path) -> None:
    results = results_or_raise(run_ranks(3, _coordinator_fails, outbox=tmp_path))
    for rank, result in enumerate(results):
        assert result["ok"] == ["step_1", 0]  # the coordinator's result everywhere
        assert result["owner"] == "run-a"  # the error's attributes too
        assert result["scan"] == ("StorageError", "cannot list the root", rank == 0)
        if rank == 0:
            assert result["other"] == ("ValueError", "odd", True)  # the original, on the coordinator
        else:
            assert result["other"][0] == "CoordinationError" and "other failed on the coordinator" in result["other"][1]


def _to_coordinator(rank: int, world_size: int) -> dict[str, Any]:
    coordinator = Coordinator(timeout=30)
    gathered = coordinator.gather({"rank": rank})
    # Payloads of very different sizes (3 MiB, a few bytes, an empty list) arrive intact.
    uneven = coordinator.gather([bytes([7]) * (3 << 20), "small", []][rank])
    results = coordinator.step_to_coordinator("square", lambda: rank * rank)

    def work() -> int:
        if rank == 2:
            raise ValueError("disk on fire")
        return rank

    try:
        coordinator.step_to_coordinator("write", work)
    except sk.CoordinationError as exc:
        return {
            "gathered": gathered,
            "uneven": uneven,
            "results": results,
            "error": str(exc),
            "failures": exc.failures,
        }
    return {"gathered": gathered, "uneven": uneven, "results": results, "error": None}


def test_results_to_the_coordinator_only_and_failures_everywhere(tmp_path: Path) -> None:
    """step_to_coordinator: the coordinator gets every rank's result, the others get None (they
    receive nothing but the outcome); a failure on rank 2 raises on every rank, naming it."""
    results = results_or_raise(run_ranks(3, _to_coordinator, outbox=tmp_path))
    assert results[0]["gathered"] == [{"rank": 0}, {"rank": 1}, {"rank": 2}]
    assert results[0]["results"] == [0, 1, 4]
    assert results[0]["uneven"] == [bytes([7]) * (3 << 20), "small", []]
    for rank in (1, 2):
        assert results[rank]["gathered"] is None and results[rank]["results"] is None
        assert results[rank]["uneven"] is None
    for result in results:
        assert result["error"] is not None and "rank(s) [2]" in result["error"] and "disk on fire" in result["error"]
        assert list(result["failures"]) == [2]
    assert Coordinator().step_to_coordinator("one process", lambda: 3) == [3]
    assert Coordinator().gather(4) == [4]


def _lying_rank(rank: int, world_size: int, lie: str) -> dict[str, Any]:
    """Rank 1 announces a report size other than what it has; every rank runs one step."""
    import resource

    from shardkeep.distributed import coordinator as coordination

    if rank == 1:
        honest = coordination._announce

        def lying(payload: bytes) -> tuple[int, int]:
            size, digest = honest(payload)
            return {"huge": 3 * 2**30, "short": size - 7, "long": size + 7}[lie], digest

        coordination._announce = lying  # type: ignore[assignment]
    coordinator = Coordinator(timeout=30)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        coordinator.step_to_coordinator("write the shards", lambda: {"files": ["rank_00001.safetensors"] * 50})
    except sk.CoordinationError as exc:
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        return {"error": str(exc), "failures": list(exc.failures), "grown_kib": grown}
    return {"error": None}


@pytest.mark.parametrize("lie", ["huge", "short", "long"])
def test_a_rank_whose_report_disagrees_with_its_announcement_fails_every_rank(tmp_path: Path, lie: str) -> None:
    # A claim of 3 GiB made the coordinator allocate it; a claim shorter than the bytes sent
    # aborted the coordinator's process inside gloo (SIGABRT).
    results = results_or_raise(run_ranks(2, _lying_rank, lie, outbox=tmp_path))
    for result in results:
        assert result["error"] is not None and result["failures"] == [1], result
        assert "rank 1" in result["error"]
    expected = "announced a report of 3221225472 bytes" if lie == "huge" else "do not match the digest it announced"
    assert expected in results[0]["error"]
    assert results[0]["grown_kib"] < 512 * 1024  # nothing near 3 GiB was allocated
