"""The node-local save and one node's catalog: real gloo ranks, where a "node" is a group of two
ranks with a local root of its own under tmp_path."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

import shardkeep as sk
from shardkeep.distributed.coordinator import Coordinator
from shardkeep.errors import CheckpointExistsError, StorageError
from shardkeep.levels import local_catalog
from shardkeep.levels.local_save import save_node_local
from shardkeep.levels.nodes import NodeMap, node_map
from shardkeep.levels.parts import decode_node_part, manifest_identity
from shardkeep.names import MANIFEST_FILENAME, NODE_PART_FILENAME, STAGING_MARKER
from shardkeep.saving.settings import SaveSettings
from shardkeep.storage import LocalStore
from shardkeep.testing.faults import FaultInjectingStore
from tests.support.distributed_harness import results_or_raise, run_ranks

STEP = "step_3"


def _full() -> dict[str, torch.Tensor]:
    return {
        "w": torch.arange(48, dtype=torch.float32).reshape(12, 4),
        "col": torch.arange(40, dtype=torch.float64).reshape(4, 10),
        "bias": torch.full((3,), 7.0),
    }


def _plain_state() -> dict[str, Any]:
    model = {f"layer{index}": torch.full((64,), float(index)) for index in range(8)}
    return {"model": model, "note": "plain"}


def _sharded_state(world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = _full()
    model: dict[str, Any] = {"w": distribute_tensor(full["w"], mesh, [Shard(0)])}
    model["col"] = distribute_tensor(full["col"], mesh, [Shard(1)])
    model["bias"] = full["bias"]
    return {"model": model, "note": "format 2.0"}


def _state(kind: str, world_size: int) -> dict[str, Any]:
    return _plain_state() if kind == "plain" else _sharded_state(world_size)


def _node_root(base: str) -> str:
    return os.path.join(base, "node{node}")


def _root_of(base: str, node: int) -> Path:
    return Path(base) / f"node{node}"


def _save(
    rank: int,
    world_size: int,
    base: str,
    kind: str,
    store_of: Any = None,
    timeout: float = 60.0,
    signer: Any = None,
) -> dict[str, Any]:
    coordinator = Coordinator(timeout=timeout)
    nodes = node_map(coordinator, lambda r: r // 2)
    node = nodes.node_of[rank]
    storage = store_of(rank, str(_root_of(base, node))) if store_of is not None else None
    root = (lambda n: _root_of(base, 0)) if kind == "shared" else (lambda n: _root_of(base, n))
    kind = "plain" if kind == "shared" else kind
    settings = SaveSettings(step=3, storage=storage, timeout=timeout, signer=signer)
    try:
        manifest = save_node_local(_state(kind, world_size), root, STEP, settings, coordinator, nodes)
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"version": manifest.metadata_version, "node": node}


def _data_files(step_dir: Path) -> set[str]:
    skip = {MANIFEST_FILENAME, NODE_PART_FILENAME, "manifest.sig"}
    return {
        str(path.relative_to(step_dir))
        for path in step_dir.rglob("*")
        if path.is_file() and path.name not in skip and not str(path.relative_to(step_dir)).startswith("index/")
    }


def _merged(base: Path, nodes: int, into: Path) -> Path:
    """Every node's part of the step copied into one directory (node-part.json left out)."""
    target = into / STEP
    for node in range(nodes):
        shutil.copytree(_root_of(str(base), node) / STEP, target, dirs_exist_ok=True)
    (target / NODE_PART_FILENAME).unlink()
    return target


def _load_merged(rank: int, world_size: int, path: str) -> bool:
    from torch.distributed.tensor import DTensor

    target = _sharded_state(world_size)
    for value in target["model"].values():
        (value.to_local() if isinstance(value, DTensor) else value).zero_()
    sk.load(path, into=target)
    full = _full()
    return all(
        torch.equal(value.full_tensor() if isinstance(value, DTensor) else value, full[key])
        for key, value in target["model"].items()
    )


def _no_leftovers(base: Path, nodes: int) -> None:
    for node in range(nodes):
        root = _root_of(str(base), node)
        names = sorted(os.listdir(root)) if root.exists() else []
        assert names == [], (node, names)


@pytest.mark.parametrize("kind", ["plain", "sharded"])
def test_a_local_save_commits_on_every_node_with_one_manifest_and_each_nodes_own_files(
    tmp_path: Path, kind: str
) -> None:
    base = tmp_path / "local"
    results = results_or_raise(run_ranks(4, _save, str(base), kind, outbox=tmp_path / "out"))
    assert all("error" not in result for result in results), results
    assert {result["version"] for result in results} == ({"2.1"} if kind == "sharded" else {results[0]["version"]})
    step_dirs = [_root_of(str(base), node) / STEP for node in range(2)]
    sealed = [(directory / MANIFEST_FILENAME).read_bytes() for directory in step_dirs]
    assert sealed[0] == sealed[1]
    parts = [decode_node_part((d / NODE_PART_FILENAME).read_bytes(), where=str(d)) for d in step_dirs]
    for node, (directory, part) in enumerate(zip(step_dirs, parts, strict=True)):
        assert part.node == node and part.nodes == 2 and part.ranks == [2 * node, 2 * node + 1]
        assert part.manifest_digest == manifest_identity(sealed[0]) and part.world_size == 4
        assert _data_files(directory) == set(part.files)  # only this node's ranks' data files
        ranks = {int(path.split("rank_")[1][:5]) for path in part.files}
        assert ranks <= set(part.ranks)
        if kind == "sharded":
            indexes = sorted(p.name for p in (directory / "index").iterdir())
            assert indexes == [f"rank_0000{r}.json" for r in range(4)]  # every index on every node
        assert [(s.name, s.state) for s in local_catalog.scan(directory.parent, verify=True)] == [(STEP, "committed")]
    assert not set(parts[0].files) & set(parts[1].files)
    assert parts[0].attempt == parts[1].attempt
    merged = _merged(base, 2, tmp_path / "merged")
    assert sk.verify(merged).ok
    if kind == "sharded":
        assert all(results_or_raise(run_ranks(4, _load_merged, str(merged), outbox=tmp_path / "load")))
    else:
        loaded = sk.load(merged)
        assert all(torch.equal(loaded["model"][k], v) for k, v in _plain_state()["model"].items())
        files = json.loads(sealed[0])["files"]
        assert {record["path"] for record in files} == set(parts[0].files) | set(parts[1].files)


def test_one_rank_saves_and_loads_its_local_step(tmp_path: Path) -> None:
    settings = SaveSettings(step=3)
    manifest = save_node_local(_plain_state(), tmp_path / "local", STEP, settings, Coordinator(), NodeMap((0,)))
    part = local_catalog.read_part(tmp_path / "local", STEP)[2]
    assert part.ranks == [0] and len(part.files) == len(manifest.files)
    (tmp_path / "local" / STEP / NODE_PART_FILENAME).unlink()
    assert sk.verify(tmp_path / "local" / STEP).ok


def test_saving_a_committed_step_again_is_refused_and_keeps_the_first(tmp_path: Path) -> None:
    base = tmp_path / "local"
    results_or_raise(run_ranks(4, _save, str(base), "plain", outbox=tmp_path / "first"))
    before = (_root_of(str(base), 1) / STEP / MANIFEST_FILENAME).read_bytes()
    again = results_or_raise(run_ranks(4, _save, str(base), "plain", outbox=tmp_path / "again"))
    assert {result["error"] for result in again} == {"CheckpointExistsError"}, again
    assert "node 0" in again[0]["message"]
    for node in range(2):
        root = _root_of(str(base), node)
        assert sorted(os.listdir(root)) == [STEP]  # the first attempt alone, no staging left
        assert local_catalog.verify_part(root, STEP) == []
    assert (_root_of(str(base), 1) / STEP / MANIFEST_FILENAME).read_bytes() == before


def _faulty_on_rank_3(rank: int, root: str) -> Any:
    return FaultInjectingStore(LocalStore(root), fail_at=2) if rank == 3 else None


def test_a_write_failing_on_one_rank_leaves_nothing_on_any_node(tmp_path: Path) -> None:
    base = tmp_path / "local"
    results = results_or_raise(run_ranks(4, _save, str(base), "sharded", _faulty_on_rank_3, outbox=tmp_path / "o"))
    assert {result.get("error") for result in results} == {"CoordinationError"}, results
    assert "rank 3" in results[0]["message"]
    _no_leftovers(base, 2)


class _RenameFails(LocalStore):
    """Node 1's leader: the rename of its staging directory to the step's name fails."""

    def rename(self, src: str, dst: str) -> None:
        if dst == STEP:
            raise StorageError(f"injected: renaming {src} to {dst}")
        super().rename(src, dst)


def _rename_fails_on_node_1(rank: int, root: str) -> Any:
    return _RenameFails(root) if rank == 2 else None


def test_a_node_failing_its_rename_removes_the_step_every_node_committed(tmp_path: Path) -> None:
    base = tmp_path / "local"
    results = results_or_raise(run_ranks(4, _save, str(base), "plain", _rename_fails_on_node_1, outbox=tmp_path / "o"))
    assert {result.get("error") for result in results} == {"CoordinationError"}, results
    assert "rank 2" in results[0]["message"]
    _no_leftovers(base, 2)  # node 0 had renamed: its step of this attempt is gone too


class _CrashAtRename(LocalStore):
    """Kill this process right after (node 0) or right before (node 1) the step's rename."""

    def __init__(self, root: str, after: bool) -> None:
        super().__init__(root)
        self.after = after

    def rename(self, src: str, dst: str) -> None:
        if dst == STEP and not self.after:
            os.kill(os.getpid(), signal.SIGKILL)
        super().rename(src, dst)
        if dst == STEP and self.after:
            os.kill(os.getpid(), signal.SIGKILL)


def _crash_between_node_renames(rank: int, root: str) -> Any:
    return _CrashAtRename(root, after=rank == 0) if rank in (0, 2) else None


def test_a_crash_between_node_renames_leaves_one_node_committed_and_the_other_staging(tmp_path: Path) -> None:
    base = tmp_path / "local"
    outcomes = run_ranks(
        4,
        _save,
        str(base),
        "plain",
        _crash_between_node_renames,
        10.0,
        outbox=tmp_path / "o",
        allow_unfinished=frozenset({0, 2}),
    )
    assert {outcomes[rank][0] for rank in (1, 3) if rank in outcomes} <= {"ok"}
    node0 = local_catalog.scan(_root_of(str(base), 0), verify=True)
    node1 = local_catalog.scan(_root_of(str(base), 1), verify=True)
    assert [(s.name, s.state) for s in node0] == [(STEP, "committed")]
    assert [(s.step, s.state) for s in node1] == [(3, "staging")]
    assert node1[0].attempt == node0[0].part.attempt if node0[0].part else False
    assert node1[0].age is not None and node1[0].age >= 0
    # A new attempt of the step is refused while node 0 holds the old one ...
    again = results_or_raise(run_ranks(4, _save, str(base), "plain", outbox=tmp_path / "again"))
    assert {result["error"] for result in again} == {"CheckpointExistsError"}
    assert sorted(os.listdir(_root_of(str(base), 1))) == [node1[0].name]  # its staging was not ours
    # ... and goes through once the old part and the leftover are removed.
    assert local_catalog.remove_step(_root_of(str(base), 0), STEP)
    assert local_catalog.collect_leftovers(_root_of(str(base), 1), lease=0.0) == [node1[0].name]
    fresh = results_or_raise(run_ranks(4, _save, str(base), "plain", outbox=tmp_path / "fresh"))
    assert all("error" not in result for result in fresh), fresh
    digests = {local_catalog.read_part(_root_of(str(base), n), STEP)[2].manifest_digest for n in range(2)}
    assert len(digests) == 1


def test_verify_part_finds_a_flipped_byte_and_a_missing_file(tmp_path: Path) -> None:
    root = tmp_path / "local"
    settings = SaveSettings(step=3, file_size_target=256)
    save_node_local(_plain_state(), root, STEP, settings, Coordinator(), NodeMap((0,)))
    assert local_catalog.verify_part(root, STEP) == []
    part = local_catalog.read_part(root, STEP)[2]
    first, second = sorted(part.files)[:2]
    data = bytearray((root / STEP / first).read_bytes())
    data[-1] ^= 0xFF
    (root / STEP / first).write_bytes(bytes(data))
    (root / STEP / second).unlink()
    problems = local_catalog.verify_part(root, STEP)
    assert any(first in problem and "digest" in problem for problem in problems), problems
    assert any(second in problem and "missing" in problem for problem in problems), problems
    assert [(s.name, s.state) for s in local_catalog.scan(root, verify=True)] == [(STEP, "damaged")]
    assert local_catalog.scan(root)[0].state == "committed"  # without verify: the manifest and part only
    (root / STEP / "stray.bin").write_bytes(b"x")
    assert any("stray.bin" in p and "extra" in p for p in local_catalog.verify_part(root, STEP))


def test_a_part_of_another_manifest_is_damaged(tmp_path: Path) -> None:
    root = tmp_path / "local"
    save_node_local(_plain_state(), root, STEP, SaveSettings(step=3), Coordinator(), NodeMap((0,)))
    path = root / STEP / NODE_PART_FILENAME
    part = json.loads(path.read_bytes())
    part["manifest_digest"] = "blake3:" + "0" * 64
    path.write_text(json.dumps(part))
    found = local_catalog.scan(root)
    assert found[0].state == "damaged" and "another manifest" in found[0].problems[0]
    assert local_catalog.remove_step(root, STEP) and local_catalog.scan(root) == []


def test_a_node_local_save_refuses_incremental_saves(tmp_path: Path) -> None:
    with pytest.raises(sk.UnsupportedValueError, match="incremental"):
        save_node_local(
            _plain_state(), tmp_path, STEP, SaveSettings(step=3, incremental=True), Coordinator(), NodeMap((0,))
        )
    assert list(tmp_path.iterdir()) == []


def test_a_single_process_refusal_names_the_committed_step(tmp_path: Path) -> None:
    root = tmp_path / "local"
    save_node_local(_plain_state(), root, STEP, SaveSettings(step=3), Coordinator(), NodeMap((0,)))
    with pytest.raises(CheckpointExistsError, match="node 0"):
        save_node_local(_plain_state(), root, STEP, SaveSettings(step=3), Coordinator(), NodeMap((0,)))
    assert sorted(os.listdir(root)) == [STEP]
    assert not any(STAGING_MARKER in name for name in os.listdir(root))


def test_a_signed_local_save_puts_one_signature_on_every_node(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    base = tmp_path / "local"
    results = results_or_raise(run_ranks(4, _save, str(base), "sharded", None, 60.0, key, outbox=tmp_path / "o"))
    assert all("error" not in result for result in results), results
    signatures = {(_root_of(str(base), node) / STEP / "manifest.sig").read_bytes() for node in range(2)}
    assert len(signatures) == 1
    assert local_catalog.read_signature(_root_of(str(base), 1), STEP) in signatures
    assert local_catalog.read_signature(tmp_path, STEP) is None
    merged = _merged(base, 2, tmp_path / "merged")
    assert sk.verify(merged, public_key=key.public_key(), require_signature=True).ok


def test_uneven_nodes_of_two_and_one_ranks(tmp_path: Path) -> None:
    base = tmp_path / "local"
    results = results_or_raise(run_ranks(3, _save, str(base), "sharded", outbox=tmp_path / "o"))
    assert all("error" not in result for result in results), results
    parts = [local_catalog.read_part(_root_of(str(base), node), STEP)[2] for node in range(2)]
    assert [part.ranks for part in parts] == [[0, 1], [2]]
    assert all(local_catalog.verify_part(_root_of(str(base), node), STEP) == [] for node in range(2))
    merged = _merged(base, 2, tmp_path / "merged")
    assert sk.verify(merged).ok


def test_two_nodes_on_one_root_are_refused(tmp_path: Path) -> None:
    base = tmp_path / "local"
    results = results_or_raise(run_ranks(4, _save, str(base), "shared", outbox=tmp_path / "o"))
    assert {result["error"] for result in results} == {"LevelConfigError"}, results
    assert "same node-local root" in results[0]["message"]
    _no_leftovers(base, 1)
