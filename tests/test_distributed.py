"""Distributed save and load over real gloo process groups (forked ranks on 127.0.0.1)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import shardkeep as sk
from shardkeep.manifest import is_staging_name
from tests.support.distributed_harness import results_or_raise, run_ranks

ROWS = 10  # deliberately not divisible by 3 or 4: uneven chunks


def replicated_state() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(11)
    state: dict[str, Any] = {f"layer{i}.weight": torch.randn(64 * (i + 1), 32, generator=generator) for i in range(6)}
    state["bias"] = torch.randn(7, generator=generator)
    state["step"] = 42
    return state


def _save_replicated(rank: int, world_size: int, root: str) -> dict[str, Any]:
    manifest = sk.save(replicated_state(), os.path.join(root, "ckpt"), step=42)
    return {
        "world_size": manifest.world_size,
        "strategy": manifest.sharding.strategy,
        "by_rank": {record.rank: [entry.key for entry in record.tensors] for record in manifest.files},
        "bytes_by_rank": {record.rank: sum(e.nbytes for e in record.tensors) for record in manifest.files},
    }


def test_replicated_tensors_are_written_once_spread_across_ranks(tmp_path: Path) -> None:
    results = results_or_raise(run_ranks(3, _save_replicated, str(tmp_path), outbox=tmp_path / "out"))
    assert all(result == results[0] for result in results)  # every rank returns the same manifest
    result = results[0]
    assert result["world_size"] == 3 and result["strategy"] == "replicated"
    written = [key for keys in result["by_rank"].values() for key in keys]
    expected = replicated_state()
    assert sorted(written) == sorted(k for k, v in expected.items() if isinstance(v, torch.Tensor))
    assert set(result["by_rank"]) == {0, 1, 2}  # every rank wrote a share
    largest = max(v.nbytes for v in expected.values() if isinstance(v, torch.Tensor))
    assert max(result["bytes_by_rank"].values()) - min(result["bytes_by_rank"].values()) <= largest
    loaded = sk.load(tmp_path / "ckpt")
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(loaded[key], value), key
        else:
            assert loaded[key] == value
    assert sk.verify(tmp_path / "ckpt").ok


def _reference() -> dict[str, torch.Tensor]:
    """Full tensors, and the AdamW state after one step with a fixed gradient."""
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(ROWS, 6, generator=generator)
    bias = torch.randn(ROWS, generator=generator)
    params = [torch.nn.Parameter(weight.clone()), torch.nn.Parameter(bias.clone())]
    optimizer = torch.optim.AdamW(params, lr=0.1)
    for param in params:
        param.grad = torch.full_like(param, 0.5)
    optimizer.step()
    state = optimizer.state_dict()["state"]
    return {
        "weight": params[0].detach(),
        "bias": params[1].detach(),
        "exp_avg.0": state[0]["exp_avg"],
        "exp_avg_sq.0": state[0]["exp_avg_sq"],
        "exp_avg.1": state[1]["exp_avg"],
        "step.0": state[0]["step"],
    }


def _sharded_training_state(world_size: int, *, trained: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(ROWS, 6, generator=generator)
    bias = torch.randn(ROWS, generator=generator)
    if not trained:
        weight, bias = torch.zeros_like(weight), torch.zeros_like(bias)
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)]))
    module.bias = torch.nn.Parameter(distribute_tensor(bias, mesh, [Shard(0)]))
    optimizer = torch.optim.AdamW([module.weight, module.bias], lr=0.1)
    if trained:
        for param in (module.weight, module.bias):
            param.grad = distribute_tensor(torch.full(param.shape, 0.5), mesh, [Shard(0)])
        optimizer.step()
    return module, optimizer


def _save_sharded(rank: int, world_size: int, path: str) -> dict[str, Any]:
    module, optimizer = _sharded_training_state(world_size, trained=True)
    saved = sk.save({"model": module, "optim": optimizer, "note": "sharded"}, path)
    if rank != 0:
        return {}
    manifest = sk.read_manifest(path)  # format 2.0: with every rank index expanded
    chunks = [(e.key, e.global_offset, e.shape) for _, e in manifest.iter_tensors() if e.global_offset is not None]
    return {
        "version": saved.metadata_version,
        "strategy": manifest.sharding.strategy,
        "chunks": sorted(chunks, key=str),
        "files": len(manifest.files),
    }


def _load_sharded(rank: int, world_size: int, path: str) -> dict[str, bool]:
    from torch.distributed.tensor import DTensor

    module, optimizer = _sharded_training_state(world_size, trained=False)
    target = {"model": module, "optim": optimizer, "note": ""}
    sk.load(path, into=target)
    reference = _reference()
    checks: dict[str, bool] = {"note": target["note"] == "sharded"}

    def local(tensor: torch.Tensor) -> torch.Tensor:
        assert isinstance(tensor, DTensor)
        return tensor.full_tensor()

    checks["weight"] = torch.equal(local(module.weight.detach()), reference["weight"])
    checks["bias"] = torch.equal(local(module.bias.detach()), reference["bias"])
    state = optimizer.state_dict()["state"]
    checks["exp_avg.0"] = torch.equal(local(state[0]["exp_avg"]), reference["exp_avg.0"])
    checks["exp_avg_sq.0"] = torch.equal(local(state[0]["exp_avg_sq"]), reference["exp_avg_sq.0"])
    checks["exp_avg.1"] = torch.equal(local(state[1]["exp_avg"]), reference["exp_avg.1"])
    checks["step"] = float(state[0]["step"]) == float(reference["step.0"])
    checks["local_is_shard"] = module.weight.to_local().shape[0] < ROWS
    return checks


@pytest.mark.parametrize(("saved_on", "loaded_on"), [(2, [1, 3, 4]), (4, [2])])
def test_dtensor_state_reshards_across_world_sizes(tmp_path: Path, saved_on: int, loaded_on: list[int]) -> None:
    path = str(tmp_path / "ckpt")
    saved = results_or_raise(run_ranks(saved_on, _save_sharded, path, outbox=tmp_path / "save"))
    assert saved[0]["strategy"] == "dtensor"
    assert saved[0]["version"] == "2.1"  # regularly sharded: described once, chunks in rank indexes
    weight_chunks = [chunk for chunk in saved[0]["chunks"] if chunk[0] == "model.weight"]
    assert len(weight_chunks) == saved_on  # one chunk per rank, with its global offset
    assert sk.verify(path).ok
    reference = _reference()
    for world_size in loaded_on:
        if world_size == 1:
            loaded = sk.load(path)  # no process group: full tensors
            assert torch.equal(loaded["model"]["weight"], reference["weight"])
            assert torch.equal(loaded["optim"]["state"][0]["exp_avg"], reference["exp_avg.0"])
            continue
        checks = results_or_raise(run_ranks(world_size, _load_sharded, path, outbox=tmp_path / f"load{world_size}"))
        for rank, result in enumerate(checks):
            assert all(result.values()), (world_size, rank, result)


def _one_rank_cannot_save(rank: int, world_size: int, root: str) -> dict[str, Any]:
    state = replicated_state()
    if rank == 2:
        state["bad"] = object()  # refused on rank 2 only
    try:
        sk.save(state, os.path.join(root, "ckpt"))
    except sk.CoordinationError as exc:
        return {"failures": exc.failures}
    return {"failures": None}


def test_a_failing_rank_fails_every_rank_and_leaves_nothing(tmp_path: Path) -> None:
    root = tmp_path / "root"
    sk.save({"previous": torch.ones(3)}, root / "previous")
    results = results_or_raise(run_ranks(3, _one_rank_cannot_save, str(root), outbox=tmp_path / "out"))
    for result in results:
        assert list(result["failures"]) == [2]
        assert "UnsupportedValueError" in result["failures"][2] and "'bad'" in result["failures"][2]
    assert sorted(os.listdir(root)) == ["previous"]
    assert sk.verify(root / "previous").ok


def _one_rank_fails_while_writing(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from shardkeep.storage import LocalStore
    from shardkeep.testing import FaultInjectingStore

    store = FaultInjectingStore(LocalStore(root), fail_at=2 if rank == 1 else None)
    try:
        sk.save(replicated_state(), "ckpt", storage=store)
    except sk.CoordinationError as exc:
        return {"failures": exc.failures}
    return {"failures": None}


def test_an_io_error_on_one_rank_aborts_the_whole_save(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    results = results_or_raise(run_ranks(2, _one_rank_fails_while_writing, str(root), outbox=tmp_path / "out"))
    for result in results:
        assert list(result["failures"]) == [1] and "injected" in result["failures"][1]
    assert os.listdir(root) == []  # the staging directory was removed; nothing committed


def _one_rank_hangs_during_save(rank: int, world_size: int, root: str) -> dict[str, Any]:
    if rank == 1:
        time.sleep(60)  # never joins the save; the harness kills it
    started = time.monotonic()
    try:
        sk.save(replicated_state(), os.path.join(root, "ckpt"), timeout=3)
    except sk.CoordinationError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - started}
    return {"error": None}


@pytest.mark.slow
def test_a_hung_rank_gives_a_deadline_error(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    outcomes = run_ranks(
        2, _one_rank_hangs_during_save, str(root), outbox=tmp_path / "out", timeout=60, allow_unfinished=frozenset({1})
    )
    kind, result = outcomes[0]
    assert kind == "ok", result
    assert result["error"] is not None and "deadline" in result["error"]
    assert result["seconds"] < 45
    assert not any(not is_staging_name(name) for name in os.listdir(root))  # nothing committed


class RecordingStore:
    """A LocalStore that records which files are opened and which byte ranges are read."""

    def __init__(self, root: str) -> None:
        from shardkeep.storage import LocalStore

        self.inner = LocalStore(root)
        self.reads: list[tuple[str, int, int]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def open_read(self, path: str) -> Any:
        handle = self.inner.open_read(path)
        reads = self.reads

        class Recorded:
            size = handle.size

            def read_into(self, offset: int, buffer: memoryview) -> None:
                reads.append((path, offset, len(buffer)))
                handle.read_into(offset, buffer)

            def map(self) -> memoryview:
                raise AssertionError("this test loads with mmap=False")

            def close(self) -> None:
                handle.close()

        return Recorded()


def _load_recording_reads(rank: int, world_size: int, root: str) -> dict[str, Any]:
    module, optimizer = _sharded_training_state(world_size, trained=False)
    store = RecordingStore(root)
    sk.load("ckpt", into={"model": module, "optim": optimizer, "note": ""}, storage=store, mmap=False)
    manifest = sk.read_manifest(os.path.join(root, "ckpt"))
    sizes = {record.path: record.size for record in manifest.files}
    read_by_file: dict[str, int] = {}
    for path, _, length in store.reads:
        name = path.split("/", 1)[1]
        if name in sizes:
            read_by_file[name] = read_by_file.get(name, 0) + length
    weight = _reference()["weight"]
    offset = module.weight.to_local()
    return {
        "read_by_file": read_by_file,
        "sizes": sizes,
        "weight_ok": torch.equal(offset, weight[rank * 3 : rank * 3 + offset.shape[0]]),
    }


def test_each_loading_rank_reads_only_the_chunks_that_overlap_its_shard(tmp_path: Path) -> None:
    root = tmp_path / "root"
    results_or_raise(run_ranks(2, _save_sharded, str(root / "ckpt"), outbox=tmp_path / "save"))
    loads = results_or_raise(run_ranks(4, _load_recording_reads, str(root), outbox=tmp_path / "load"))
    for rank, result in enumerate(loads):
        assert result["weight_ok"], rank
        sharded = {
            name: size
            for name, size in result["sizes"].items()
            if name.endswith("_sharded.safetensors") and "_optim" not in name
        }
        assert len(sharded) == 2
        # Rows 0-2 and 3-5 lie in the first saved chunk (rows 0-4) only... except rank 1's rows
        # 3-5, which straddle both; rows 6-8 and 9 lie in the second only.
        overlapping = {0: ["rank_00000"], 1: ["rank_00000", "rank_00001"], 2: ["rank_00001"], 3: ["rank_00001"]}[rank]
        for name in sharded:
            touched = result["read_by_file"].get(name, 0)
            if any(stem in name for stem in overlapping):
                assert 0 < touched <= sharded[name], (rank, name, touched)
            else:
                assert touched == 0, (rank, name, touched)  # never opened
        if rank != 1:
            assert sum(result["read_by_file"].get(name, 0) for name in sharded) < sum(sharded.values())


def _recover_after_a_missed_deadline(rank: int, world_size: int, root: str) -> list[str]:
    import torch.distributed as dist

    from shardkeep.storage import LocalStore

    class SlowStore(LocalStore):
        def __init__(self, path: str, delay: float) -> None:
            super().__init__(path)
            self.delay = delay

        def open_write(self, path: str) -> Any:
            time.sleep(self.delay)
            return super().open_write(path)

    outcomes = []
    for attempt, delay in enumerate((4.0, 0.0)):
        store = SlowStore(root, delay if rank == 0 else 0.0)
        try:
            sk.save({"a": torch.ones(1000)}, f"ck{attempt}", storage=store, timeout=2.0)
            outcomes.append("ok")
        except sk.CoordinationError:
            outcomes.append("deadline")
        # The user's own group is untouched by the broken checkpoint group: resynchronize on it.
        dist.barrier()
    return outcomes


def test_saves_work_again_after_a_missed_deadline(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    results = results_or_raise(run_ranks(2, _recover_after_a_missed_deadline, str(root), outbox=tmp_path / "out"))
    assert results == [["deadline", "ok"], ["deadline", "ok"]]
    assert sk.verify(root / "ck1").ok and not (root / "ck0").exists()


def test_coverage_check_finds_gaps_and_overlaps_quickly() -> None:
    from shardkeep.distributed.plan import coverage_problems
    from shardkeep.manifest import FileRecord, Manifest, TensorEntry

    def manifest_with(chunks: list[tuple[list[int], list[int]]], global_shape: list[int]) -> Manifest:
        entries = [
            TensorEntry(
                key="w",
                path=["w"],
                dtype="F32",
                shape=shape,
                offset=0,
                nbytes=0,
                global_shape=global_shape,
                global_offset=offset,
            )
            for offset, shape in chunks
        ]
        return Manifest(files=[FileRecord(path="f", rank=0, size=0, digest=None, tensors=entries)])

    rows = [([i, 0], [1, 8]) for i in range(4096)]
    started = time.monotonic()
    assert coverage_problems(manifest_with(rows, [4096, 8])) == []
    columns = [([0, i], [8, 1]) for i in range(4096)]
    assert coverage_problems(manifest_with(columns, [8, 4096])) == []
    assert time.monotonic() - started < 5
    # Same total volume as the whole tensor, but two chunks share element (0, 1) and (1, 1) is missing.
    overlapping = [([0, 0], [1, 2]), ([0, 1], [2, 1])]
    assert any("overlap" in p for p in coverage_problems(manifest_with(overlapping, [2, 2])))
    gap = [([0, 0], [1, 4]), ([2, 0], [1, 4])]
    assert any("cover" in p for p in coverage_problems(manifest_with(gap, [3, 4])))


def _save_signed(rank: int, world_size: int, root: str, key_path: str, bad_key: str) -> str:
    # Only the coordinator (rank 0) has the key; the other ranks pass none.
    sk.save(replicated_state(), os.path.join(root, "signed"), signer=key_path if rank == 0 else None)
    # A key the coordinator cannot read fails every rank alike, with nothing committed.
    try:
        sk.save(replicated_state(), os.path.join(root, "unsigned"), signer=bad_key if rank == 0 else None)
    except sk.CoordinationError as exc:
        return str(exc)
    return "saved"


def test_only_the_coordinator_signs_a_distributed_save(tmp_path: Path) -> None:
    from shardkeep.integrity import generate_key_pair

    generate_key_pair(tmp_path / "key.pem", tmp_path / "key.pub")
    results = results_or_raise(
        run_ranks(
            2,
            _save_signed,
            str(tmp_path),
            str(tmp_path / "key.pem"),
            str(tmp_path / "missing.pem"),
            outbox=tmp_path / "out",
        )
    )
    assert all("missing.pem" in result and "rank(s) [0]" in result for result in results), results
    report = sk.verify(tmp_path / "signed", public_key=tmp_path / "key.pub")
    assert report.ok and report.signature.startswith("valid"), report
    assert {record.rank for record in report.manifest.files} == {0, 1}  # type: ignore[union-attr]
    assert not (tmp_path / "unsigned").exists()
    assert not [p for p in tmp_path.iterdir() if is_staging_name(p.name)]


def _save_on_rank_zero_alone(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Rank 0 saves on its own while rank 1 does something else (Lightning's rank-zero saves):
    with process_group=sk.LOCAL no collective runs, so neither waits for the other."""
    if rank != 0:
        return {"saved": None}
    state = {"w": torch.arange(6.0), "step": 4}
    manifest = sk.save(state, f"{root}/alone", process_group=sk.LOCAL, timeout=5)
    loaded = sk.load(f"{root}/alone")
    return {"saved": manifest.world_size, "same": torch.equal(loaded["w"], state["w"]) and loaded["step"] == 4}


def test_a_local_save_runs_on_one_rank_without_collectives(tmp_path: Path) -> None:
    results = results_or_raise(run_ranks(2, _save_on_rank_zero_alone, str(tmp_path), outbox=tmp_path / "out"))
    assert results[0] == {"saved": 1, "same": True}
    assert results[1] == {"saved": None}
    assert sk.verify(tmp_path / "alone").ok


def _one_rank_has_a_bad_value(rank: int, world_size: int, root: str, bad: int, mode: str) -> tuple[str, float]:
    """Rank ``bad`` passes custom_fields that are not JSON (NaN): it fails while building its
    part of the manifest, which happens inside the plan step, so every rank fails together."""
    state = {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(10)}
    fields = {"loss": float("nan")} if rank == bad else {"loss": 1.0}
    started = time.monotonic()
    try:
        if mode == "async":
            sk.async_save(state, f"{root}/ck", fields=sk.ManifestFields(custom_fields=fields), timeout=20).result(60)
        else:
            sk.save(state, f"{root}/ck", fields=sk.ManifestFields(custom_fields=fields), timeout=20)
    except sk.ShardkeepError as exc:
        return type(exc).__name__, time.monotonic() - started
    return "ok", time.monotonic() - started


@pytest.mark.parametrize(("bad", "mode"), [(0, "sync"), (1, "sync"), (0, "async"), (1, "async")])
def test_a_bad_value_on_one_rank_fails_every_rank_at_once_and_leaves_nothing(
    tmp_path: Path, bad: int, mode: str
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    results = results_or_raise(run_ranks(3, _one_rank_has_a_bad_value, str(root), bad, mode, outbox=tmp_path / "out"))
    for rank, (kind, seconds) in enumerate(results):
        assert kind == "CoordinationError", (rank, kind)
        assert seconds < 10, (rank, seconds)  # at once, not at a deadline (20 s)
    assert sorted(p.name for p in root.iterdir()) == []  # no checkpoint, no staging directory
