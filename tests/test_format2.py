"""Format 2.0 (regularly sharded tensors described once, chunks in rank indexes) on real gloo
ranks: what the root manifest holds, partial loads reading only the indexes they need, and the
checks every index gets (digest, grid, completeness)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

import shardkeep as sk
from shardkeep.integrity import digest_bytes, seal_manifest
from shardkeep.manifest import IndexedManifest, RankIndex
from shardkeep.storage import ForwardingStore, LocalStore, ReadHandle
from shardkeep.tensors.grid import chunk_writer
from tests.support.distributed_harness import results_or_raise, run_ranks

ROWS = 12


def _full() -> dict[str, torch.Tensor]:
    return {
        "w": torch.arange(ROWS * 4, dtype=torch.float32).reshape(ROWS, 4),
        "col": torch.arange(40, dtype=torch.float64).reshape(4, 10),
        "rep": torch.arange(6, dtype=torch.int64),
        "uneven": torch.arange(10, dtype=torch.float32).reshape(5, 2),
        "empty": torch.zeros(0, 3),
        "bias": torch.full((3,), 7.0),
    }


def _state(world_size: int, fill: bool = True) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = _full()
    if not fill:
        full = {key: torch.zeros_like(value) for key, value in full.items()}
    placements = {"w": Shard(0), "col": Shard(1), "rep": Replicate(), "uneven": Shard(0), "empty": Shard(0)}
    model: dict[str, Any] = {key: distribute_tensor(full[key], mesh, [p]) for key, p in placements.items()}
    model["bias"] = full["bias"]  # a plain tensor every rank holds
    return {"model": model, "note": "format 2.0"}


def _save(rank: int, world_size: int, path: str) -> dict[str, Any]:
    manifest = sk.save(_state(world_size), path, step=3)
    return {
        "type": type(manifest).__name__,
        "version": manifest.metadata_version,
        "listed": sorted(entry.key for _, entry in manifest.iter_tensors()),
        "sharded": sorted(tensor.key for tensor in manifest.sharded) if isinstance(manifest, IndexedManifest) else [],
    }


class _IndexReads(ForwardingStore):
    """Records which index files a load opens."""

    def __init__(self, inner: LocalStore) -> None:
        super().__init__(inner)
        self.opened: list[str] = []

    def open_read(self, path: str) -> ReadHandle:
        if "/index/" in path:
            self.opened.append(path.rpartition("/")[2])
        return self.inner.open_read(path)


def _load(rank: int, world_size: int, path: str) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    target = _state(world_size, fill=False)
    store = _IndexReads(LocalStore(str(Path(path).parent)))
    sk.load(Path(path).name, into=target, storage=store)
    full = _full()
    model = target["model"]
    same = {
        key: torch.equal(value.full_tensor() if isinstance(value, DTensor) else value, full[key])
        for key, value in model.items()
    }
    return {"same": same, "note": target["note"], "indexes": sorted(store.opened)}


def test_sharded_tensors_are_described_once_and_chunks_live_in_rank_indexes(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    saved = results_or_raise(run_ranks(4, _save, path, outbox=tmp_path / "save"))[0]
    assert saved["type"] == "IndexedManifest" and saved["version"] == "2.1"
    assert saved["sharded"] == ["model.col", "model.empty", "model.rep", "model.uneven", "model.w"]
    assert saved["listed"] == ["model.bias"]  # only the whole tensor is listed in the root
    root = json.loads((Path(path) / "manifest.json").read_bytes())
    assert root["indexes"]["ranks"] == [0, 1, 2, 3] and len(root["indexes"]["digests"]) == 4
    assert root["meshes"] == [{"shape": [4]}]
    assert {t["key"]: t["placements"] for t in root["sharded"]}["model.col"] == ["S1"]
    assert sorted(p.name for p in (Path(path) / "index").iterdir()) == [f"rank_0000{r}.json" for r in range(4)]
    # read_manifest expands every index: the chunks read like a 1.x manifest's, and the view
    # validates as it is.
    full = sk.read_manifest(path)
    assert sk.validate_manifest(full).errors == []
    chunks = [e for _, e in full.iter_tensors() if e.key == "model.w"]
    assert sorted(tuple(e.global_offset or ()) for e in chunks) == [(0, 0), (3, 0), (6, 0), (9, 0)]
    assert len([e for _, e in full.iter_tensors() if e.key == "model.rep"]) == 1  # replicated: written once
    assert len([e for _, e in full.iter_tensors() if e.key == "model.empty"]) == 1  # recorded by the origin
    uneven = sorted(tuple(e.global_offset or ()) for _, e in full.iter_tensors() if e.key == "model.uneven")
    assert uneven == [(0, 0), (2, 0), (4, 0)]  # 5 rows over 4 ranks: 2, 2, 1 and an empty chunk
    report = sk.verify(path)
    assert report.ok, report.problems
    loaded = sk.load(path)  # one process, no group: whole tensors
    for key, value in _full().items():
        assert torch.equal(loaded["model"][key], value), key
    # Loading on 2 ranks: each reads only the indexes of the ranks whose chunks overlap its own.
    for result in results_or_raise(run_ranks(2, _load, path, outbox=tmp_path / "load2")):
        assert all(result["same"].values()), result
    on_two = results_or_raise(run_ranks(2, _load, path, outbox=tmp_path / "load2b"))
    # Rank 0 of 2 holds rows 0-5 of w (saved by ranks 0, 1), columns 0-4 of col (0, 1), rows
    # 0-2 of uneven (0, 1), the empty tensor (recorded by rank 0), and rep (one writer).
    rep_writer = chunk_writer("model.rep", [0], 4)
    assert on_two[0]["indexes"] == [f"rank_0000{r}.json" for r in sorted({0, 1, rep_writer})]
    # Rank 1 holds rows 6-11 of w (2, 3), columns 5-9 of col (1, 2, 3), rows 3-4 of uneven (1, 2).
    assert on_two[1]["indexes"] == [f"rank_0000{r}.json" for r in range(4)]


def _save_then_copy(tmp_path: Path) -> str:
    path = str(tmp_path / "ckpt")
    results_or_raise(run_ranks(2, _save, path, outbox=tmp_path / "save"))
    return path


def _reseal(path: Path, edit: Any) -> None:
    """Rewrite manifest.json after ``edit(body)``, sealed again (what a hostile writer could do)."""
    raw = json.loads((path / "manifest.json").read_bytes())
    raw.pop("manifest_digest")
    edit(raw)
    (path / "manifest.json").write_bytes(seal_manifest(msgspec.json.encode(raw), raw["digest_algorithm"]))


def test_damaged_missing_and_forged_indexes_are_refused(tmp_path: Path) -> None:
    path = Path(_save_then_copy(tmp_path))
    index = path / "index" / "rank_00001.json"
    pristine = index.read_bytes()

    # A flipped byte: the digest the manifest records no longer matches.
    damaged = bytearray(pristine)
    damaged[len(damaged) // 2] ^= 0x01
    index.write_bytes(bytes(damaged))
    with pytest.raises(sk.IntegrityError, match=r"rank_00001\.json: digest mismatch"):
        sk.load(str(path))
    assert not sk.verify(str(path)).ok

    # A truncated index.
    index.write_bytes(pristine[:-10])
    with pytest.raises(sk.IntegrityError, match="size is"):
        sk.load(str(path))

    # A missing index.
    index.unlink()
    with pytest.raises(sk.ShardkeepError, match=r"rank_00001\.json"):
        sk.load(str(path))
    report = sk.verify(str(path))
    assert any("rank_00001.json" in problem for problem in report.problems), report.problems
    index.write_bytes(pristine)
    assert sk.verify(str(path)).ok

    # A forged index (digest and seal redone): a chunk moved off the grid is refused.
    forged = msgspec.json.decode(pristine, type=RankIndex)
    entry = next(e for f in forged.files for e in f.tensors if e.key == "model.w")
    assert entry.global_offset is not None
    entry.global_offset = [entry.global_offset[0] - 1, 0]
    data = msgspec.json.encode(forged) + b"\n"
    index.write_bytes(data)

    def point_at_forgery(raw: dict[str, Any]) -> None:
        table = raw["indexes"]
        position = table["ranks"].index(1)
        table["sizes"][position] = len(data)
        table["digests"][position] = digest_bytes(table["algorithm"], data).partition(":")[2]

    _reseal(path, point_at_forgery)
    with pytest.raises(sk.ManifestError, match="not the chunk rank 1 writes"):
        sk.load(str(path))
    report = sk.verify(str(path))
    assert any("not the chunk rank 1 writes" in problem for problem in report.problems), report.problems

    # An index that leaves out a chunk its rank writes is refused too.
    forged = msgspec.json.decode(pristine, type=RankIndex)
    for record in forged.files:
        record.tensors = [e for e in record.tensors if e.key != "model.col"]
    data = msgspec.json.encode(forged) + b"\n"
    index.write_bytes(data)
    _reseal(path, point_at_forgery)
    with pytest.raises(sk.ManifestError, match="lacks the chunks of 1 tensor"):
        sk.load(str(path))


def test_hostile_root_fields_are_refused(tmp_path: Path) -> None:
    path = Path(_save_then_copy(tmp_path))
    pristine = (path / "manifest.json").read_bytes()
    cases = {
        "bad placement": lambda raw: raw["sharded"][0].__setitem__("placements", ["S7"]),
        "unknown mesh": lambda raw: raw["sharded"][0].__setitem__("mesh", 5),
        "mesh too large": lambda raw: raw["meshes"][0].__setitem__("shape", [64]),
        "duplicate rank": lambda raw: raw["meshes"][0].__setitem__("ranks", [0, 0]),
        "index outside the world": lambda raw: raw["indexes"]["ranks"].__setitem__(0, 9),
        "unsafe index directory": lambda raw: raw["indexes"].__setitem__("prefix", "../"),
        "key described twice": lambda raw: raw["sharded"].append(raw["sharded"][0]),
        "negative shape": lambda raw: raw["sharded"][0].__setitem__("global_shape", [-1, 4]),
    }
    for name, edit in cases.items():
        (path / "manifest.json").write_bytes(pristine)
        _reseal(path, edit)
        with pytest.raises(sk.ManifestError):
            sk.read_manifest(str(path))
        assert not sk.verify(str(path)).ok, name


def test_a_copy_without_its_index_directory_is_not_loadable(tmp_path: Path) -> None:
    path = Path(_save_then_copy(tmp_path))
    copy = tmp_path / "copy"
    shutil.copytree(path, copy, ignore=shutil.ignore_patterns("index"))
    with pytest.raises(sk.ShardkeepError, match="index"):
        sk.load(str(copy))


def _save_uneven_trees(rank: int, world_size: int, path: str) -> str:
    """Each rank also holds a whole tensor of its own (expert-parallel style): the ranks' trees
    differ, so each sends its sharded tensors' descriptions, which the coordinator merges."""
    state = _state(world_size)
    state["model"][f"own{rank}"] = torch.full((2,), float(rank))
    return sk.save(state, path).metadata_version


def test_ranks_with_different_trees_still_describe_each_sharded_tensor_once(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    assert results_or_raise(run_ranks(3, _save_uneven_trees, path, outbox=tmp_path / "save")) == ["2.1"] * 3
    root = json.loads((Path(path) / "manifest.json").read_bytes())
    assert sorted(t["key"] for t in root["sharded"]) == [
        "model.col",
        "model.empty",
        "model.rep",
        "model.uneven",
        "model.w",
    ]
    assert sk.verify(path).ok
    loaded = sk.load(path)
    for key, value in _full().items():
        assert torch.equal(loaded["model"][key], value), key
    for rank in range(3):
        assert torch.equal(loaded["model"][f"own{rank}"], torch.full((2,), float(rank)))


def _async_save(rank: int, world_size: int, path: str) -> tuple[str, list[str]]:
    handle = sk.async_save(_state(world_size), path, step=4)
    manifest = handle.result()
    return manifest.metadata_version, [record.path for record in manifest.files]


def test_async_saves_write_format_2(tmp_path: Path) -> None:
    """Every rank gets the manifest alone, as the coordinator committed it: no rank reads
    every rank's index to return it."""
    path = str(tmp_path / "ckpt")
    results = results_or_raise(run_ranks(2, _async_save, path, outbox=tmp_path / "save"))
    assert results[0] == results[1] == ("2.1", ["shards/rank_00000.safetensors"])
    assert sk.verify(path).ok
    loaded = sk.load(path)
    for key, value in _full().items():
        assert torch.equal(loaded["model"][key], value), key


def _managed(rank: int, world_size: int, root: str) -> list[str]:
    manager = sk.CheckpointManager(root, keep_last=2, keep_best=0)
    for step in (1, 2, 3):
        manager.save(_state(world_size), step=step)
    target = _state(world_size, fill=False)
    manager.restore(into=target)
    from torch.distributed.tensor import DTensor

    return [
        key
        for key, value in target["model"].items()
        if not torch.equal(value.full_tensor() if isinstance(value, DTensor) else value, _full()[key])
    ]


def test_the_manager_keeps_prunes_and_restores_format_2_checkpoints(tmp_path: Path) -> None:
    root = tmp_path / "run"
    assert results_or_raise(run_ranks(2, _managed, str(root), outbox=tmp_path / "out")) == [[], []]
    kept = sorted(p.name for p in root.iterdir() if p.name.startswith("step_"))
    assert kept == ["step_00000002", "step_00000003"]
    for name in kept:
        assert sk.verify(str(root / name)).ok
    listing = sk.CheckpointManager(root, keep_last=2, keep_best=0, read_only=True).list()
    assert [info.size for info in listing] == [
        sum(p.stat().st_size for p in (root / name).rglob("*") if p.is_file() and not p.name.startswith("manifest"))
        for name in kept
    ]


def _incremental(rank: int, world_size: int, root: str) -> list[str]:
    first = _state(world_size)
    sk.save(first, f"{root}/step_00000001")
    first["model"]["bias"] = torch.full((3,), 8.0)  # only the whole tensor changes
    manifest = sk.save(first, f"{root}/step_00000002", incremental=f"{root}/step_00000001")
    if rank != 0:
        return []
    view = sk.read_manifest(f"{root}/step_00000002")
    return [*sorted(record.path for record in view.files if record.ref is not None), manifest.metadata_version]


def test_incremental_saves_reference_unchanged_chunk_files(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    referenced = results_or_raise(run_ranks(2, _incremental, root, outbox=tmp_path / "out"))[0]
    assert referenced[-1] == "2.1"
    assert referenced[:-1] == ["shards/rank_00000_sharded.safetensors", "shards/rank_00001_sharded.safetensors"]
    assert sk.verify(f"{root}/step_00000002").ok
    loaded = sk.load(f"{root}/step_00000002")
    assert torch.equal(loaded["model"]["bias"], torch.full((3,), 8.0))
    assert torch.equal(loaded["model"]["w"], _full()["w"])


def _strided_state(fill: bool) -> dict[str, Any]:
    """FSDP2 over tensor parallelism, as torchtitan places a column-parallel weight: on a
    (dp, tp) mesh, ``_StridedShard(0, split_factor=tp)`` on dp and ``Shard(0)`` on tp."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (2, 2))
    full = torch.arange(16 * 3, dtype=torch.float32).reshape(16, 3)
    value = full if fill else torch.zeros_like(full)
    return {"w": distribute_tensor(value, mesh, [_StridedShard(0, split_factor=2), Shard(0)])}


def _save_strided(rank: int, world_size: int, path: str) -> list[int]:
    state = _strided_state(fill=True)
    sk.save(state, path)
    return [int(state["w"].to_local()[0, 0].item()) // 3]  # the first global row this rank holds


def _load_strided(rank: int, world_size: int, path: str) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    target = {"w": distribute_tensor(torch.zeros(16, 3), init_device_mesh("cpu", (world_size,)), [Shard(0)])}
    sk.load(path, into=target)
    return torch.equal(target["w"].full_tensor(), torch.arange(16 * 3, dtype=torch.float32).reshape(16, 3))


def test_fsdp_over_tensor_parallel_strided_shards_are_described_once(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    first_rows = results_or_raise(run_ranks(4, _save_strided, path, outbox=tmp_path / "save"))
    assert first_rows == [[0], [8], [4], [12]]  # (dp, tp): TP chunk tp, its dp-th half
    root = json.loads((Path(path) / "manifest.json").read_bytes())
    assert [t["placements"] for t in root["sharded"]] == [["S0/2", "S0"]]
    assert all(not record["tensors"] for record in root["files"])
    assert sk.verify(path).ok
    assert torch.equal(sk.load(path)["w"], torch.arange(16 * 3, dtype=torch.float32).reshape(16, 3))
    assert results_or_raise(run_ranks(3, _load_strided, path, outbox=tmp_path / "load3")) == [True] * 3


def _save_scattered(rank: int, world_size: int, path: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (2,))
    tensor = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [_StridedShard(0, split_factor=2)])
    try:
        sk.save({"w": tensor}, path)
    except sk.ShardkeepError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "saved"


def test_a_strided_split_that_scatters_a_rank_s_rows_is_refused_by_name(tmp_path: Path) -> None:
    """Rank 0 holds rows 0 and 2, rank 1 rows 1 and 3: no box describes either part."""
    path = str(tmp_path / "ckpt")
    outcomes = results_or_raise(run_ranks(2, _save_scattered, path, outbox=tmp_path / "save"))
    for outcome in outcomes:
        assert outcome.startswith("CoordinationError") and "'w'" in outcome and "not one box" in outcome, outcome
    assert not Path(path).exists()


def test_merging_the_ranks_descriptions_leaves_their_reports_as_received() -> None:
    """The coordinator renumbers the ranks' meshes into one list; doing it twice (a commit
    attempted again) gives the same answer, because the reports are not changed."""
    from shardkeep.manifest import Mesh, ShardedTensor
    from shardkeep.saving.wire import RankReport, merged_descriptions

    def described(key: str, mesh: int) -> ShardedTensor:
        return ShardedTensor(key=key, path=[key], dtype="F32", global_shape=[4], mesh=mesh, placements=["S0"])

    reports = [
        RankReport(files=[], meshes=[Mesh(shape=[2], ranks=[0, 1])], sharded=[described("a", 0)]),
        RankReport(
            files=[],
            meshes=[Mesh(shape=[2], ranks=[2, 3]), Mesh(shape=[2], ranks=[0, 1])],
            sharded=[described("b", 0), described("a", 1)],
        ),
    ]
    first = merged_descriptions(reports)
    assert first == merged_descriptions(reports)
    meshes, tensors = first
    assert [m.ranks for m in meshes] == [[0, 1], [2, 3]]
    assert [(t.key, t.mesh) for t in tensors] == [("a", 0), ("b", 1)]
    assert reports[1].sharded[0].mesh == 0  # as received


def _save_on_tiers(rank: int, world_size: int, root: str) -> str:
    tiers = [sk.Tier(tier_id=1, name="hot"), sk.Tier(tier_id=2, name="cold", location=f"{root}/cold")]
    rules = [("model.col", "cold"), ("model.w", "cold"), ("*", "hot")]
    return sk.save(
        _state(world_size), f"{root}/main/step_00000001", tiers=sk.TierPlan(tiers=tiers, placement=rules)
    ).metadata_version


def test_indexed_chunk_files_on_a_tier_location_load_and_verify(tmp_path: Path) -> None:
    """The index lives with the manifest; the chunk files it lists may be on another tier's
    location, and are found there (and a load of the hot tier alone needs none of them)."""
    root = str(tmp_path)
    assert results_or_raise(run_ranks(2, _save_on_tiers, root, outbox=tmp_path / "save")) == ["2.1", "2.1"]
    path = f"{root}/main/step_00000001"
    assert sorted(p.name for p in (tmp_path / "cold").rglob("*_sharded*.safetensors"))
    assert sk.verify(path).ok
    loaded = sk.load(path)
    for key, value in _full().items():
        assert torch.equal(loaded["model"][key], value), key
    hot = sk.load(path, select=sk.LoadSelection(tiers=["hot"]))  # the cold tier's tensors are left out
    assert torch.equal(hot["model"]["bias"], _full()["bias"])
    assert "w" not in hot["model"] and "col" not in hot["model"]
    assert torch.equal(hot["model"]["rep"], _full()["rep"])


def test_meshes_and_strided_splits_too_large_to_work_out_are_refused(tmp_path: Path) -> None:
    """A root whose numbers would make a reader build huge rank lists or walk a huge strided
    grid is refused before any index is read."""
    path = Path(_save_then_copy(tmp_path))
    pristine = (path / "manifest.json").read_bytes()
    cases = {
        "a mesh of 2**21 ranks": lambda raw: (
            raw.__setitem__("world_size", 2**22),
            raw["meshes"][0].__setitem__("shape", [2**21]),
        ),
        "meshes of 2**23 ranks in all": lambda raw: (
            raw.__setitem__("world_size", 2**20),
            raw.__setitem__("meshes", [{"shape": [2**20]}] * 9),
        ),
        "a strided split of 10**5 on a mesh of 2**10": lambda raw: (
            raw.__setitem__("world_size", 2**10),
            raw["meshes"][0].__setitem__("shape", [2**10]),
            raw["sharded"][0].__setitem__("placements", ["S0/100000"]),
        ),
    }
    for name, edit in cases.items():
        (path / "manifest.json").write_bytes(pristine)
        _reseal(path, edit)
        with pytest.raises(sk.ManifestError, match=r"ranks|strided"):
            sk.read_manifest(str(path))
        assert not sk.verify(str(path)).ok, name


def _managed_incrementally(rank: int, world_size: int, root: str) -> list[str]:
    manager = sk.CheckpointManager(root, keep_last=1, keep_best=0, incremental=True)
    state = _state(world_size)
    for step in (1, 2, 3):
        state["model"]["bias"] = torch.full((3,), float(step))  # only the whole tensor changes
        manager.save(state, step=step)
    return sorted(p.name for p in Path(root).iterdir() if p.name.startswith("step_"))


def test_retention_keeps_the_chunk_files_an_incremental_format_2_checkpoint_references(tmp_path: Path) -> None:
    """keep_last=1 deletes steps 1 and 2, but step 3's indexes reference their unchanged chunk
    files (recorded in the root's index table, so retention knows without reading every
    index): those files stay, and step 3 loads and verifies."""
    root = tmp_path / "run"
    kept = results_or_raise(run_ranks(2, _managed_incrementally, str(root), outbox=tmp_path / "out"))[0]
    assert "step_00000003" in kept
    table = json.loads((root / "step_00000003" / "manifest.json").read_bytes())["indexes"]
    assert table["refs"] == ["step_00000001"]  # the chunk files were written once, at step 1
    assert sk.verify(str(root / "step_00000003")).ok
    loaded = sk.load(str(root / "step_00000003"))
    assert torch.equal(loaded["model"]["bias"], torch.full((3,), 3.0))
    for key in ("w", "col", "rep", "uneven"):
        assert torch.equal(loaded["model"][key], _full()[key]), key


def _load_only_w(rank: int, world_size: int, path: str, extra: str) -> dict[str, Any]:
    """A rank whose into= holds one sharded tensor of the checkpoint (as an expert-parallel rank
    holds only its own experts)."""
    target = {"model": {"w": _state(world_size, fill=False)["model"]["w"]}}
    store = _IndexReads(LocalStore(str(Path(path).parent)))
    sk.load(Path(path).name, into=target, storage=store, select=sk.LoadSelection(extra=extra))
    return {
        "same": torch.equal(target["model"]["w"].full_tensor(), _full()["w"]),
        "keys": sorted(target) + sorted(target["model"]),
        "indexes": sorted(store.opened),
    }


def test_extra_ignore_reads_only_the_indexes_of_what_into_holds(tmp_path: Path) -> None:
    """load(extra="ignore"): a rank whose into= lacks most of the checkpoint reads only the rank
    indexes that list chunks of what it holds (here its own), and into= gains nothing; the
    default (extra="add") reads every index, to add the described tensors into= lacks."""
    path = str(tmp_path / "ckpt")
    results_or_raise(run_ranks(4, _save, path, outbox=tmp_path / "save"))
    ignoring = results_or_raise(run_ranks(4, _load_only_w, path, "ignore", outbox=tmp_path / "ignore"))
    for rank, result in enumerate(ignoring):
        assert result["same"], rank
        assert result["keys"] == ["model", "w"], rank
        assert result["indexes"] == [f"rank_0000{rank}.json"], rank  # rows 3r..3r+2 of w: rank r's chunk
    adding = results_or_raise(run_ranks(4, _load_only_w, path, "add", outbox=tmp_path / "add"))
    for result in adding:
        assert result["same"]
        assert result["keys"] == ["model", "note", *sorted(_full())]
        assert result["indexes"] == [f"rank_0000{r}.json" for r in range(4)]
