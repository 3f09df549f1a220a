"""Restore from the best copy (levels/restore.py) on real gloo ranks, where "nodes" are groups
of ranks with separate local roots: healing a damaged or missing local part from the persistent
copy or a peer node, falling back to an older step with the reasons per rank and level, never
mixing attempts, resharding from every level, and an unreachable level."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

import shardkeep as sk
from shardkeep.errors import NoCompleteStepError
from shardkeep.integrity import SignaturePolicy, generate_key_pair
from shardkeep.levels.restore import LevelView, RestoreReport, restore_best
from shardkeep.names import NODE_PART_FILENAME, checkpoint_name
from shardkeep.storage import localfs
from tests.support.distributed_harness import results_or_raise, run_ranks
from tests.support.node_parts import split_into_nodes
from tests.support.observe import counted_all_gathers, logged_messages

torch = pytest.importorskip("torch")

ROWS = 12
RANK2_FILE = "shards/rank_00002_sharded.safetensors"
RANK0_FILE = "shards/rank_00000_sharded.safetensors"


def full_state(seed: int) -> dict[str, Any]:
    return {
        "w": torch.arange(ROWS * 4, dtype=torch.float32).reshape(ROWS, 4) + seed,
        "col": torch.arange(40, dtype=torch.float64).reshape(4, 10) * (seed + 1),
        "rep": torch.arange(6, dtype=torch.int64) + seed,
        "bias": torch.full((3,), float(seed)),
    }


def sharded_state(world_size: int, seed: int, *, fill: bool = True) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = full_state(seed)
    if not fill:
        full = {key: torch.zeros_like(value) for key, value in full.items()}
    placements = {"w": Shard(0), "col": Shard(1), "rep": Replicate()}
    model: dict[str, Any] = {key: distribute_tensor(full[key], mesh, [p]) for key, p in placements.items()}
    model["bias"] = full["bias"]
    return {"model": model}


def _save(rank: int, world_size: int, path: str, seed: int, signer: str | None) -> None:
    sk.save(sharded_state(world_size, seed), path, step=int(Path(path).name.removeprefix("step_")), signer=signer)


def save_step(
    tmp_path: Path, step: int, seed: int, *, into: str = "saved", signer: str | None = None, world_size: int = 4
) -> Path:
    """Step ``step`` of the state of ``seed``, saved by ``world_size`` gloo ranks."""
    path = tmp_path / f"{into}-{step}-{seed}" / checkpoint_name(step)
    outbox = tmp_path / f"save-{into}-{step}-{seed}"
    results_or_raise(run_ranks(world_size, _save, str(path), seed, signer, outbox=outbox))
    return path


@dataclass(frozen=True)
class Nodes:
    node_of: tuple[int, ...]


@dataclass(frozen=True)
class Setup:
    node_roots: list[str]
    persistent: str | None
    node_of: Callable[[int], int]
    seed: int
    local: bool = True
    options: dict[str, Any] | None = None
    public_key: str | None = None
    #: Fail the rename of a rebuilt part into place (EIO), and return the warnings logged.
    fail_rename: bool = False


def _restore(rank: int, world_size: int, setup: Setup) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    from shardkeep.distributed.coordinator import Coordinator

    levels: list[LevelView] = []
    if setup.local:
        levels.append(LevelView("local", setup.node_roots[setup.node_of(rank)], node_local=True))
    if setup.persistent is not None:
        levels.append(LevelView("persistent", setup.persistent, storage_options=setup.options))
    into = sharded_state(world_size, 0, fill=False)
    nodes = Nodes(tuple(setup.node_of(r) for r in range(world_size)))
    warnings = logged_messages("shardkeep") if setup.fail_rename else []
    try:
        signatures = SignaturePolicy.of(setup.public_key) if setup.public_key is not None else None
        with counted_all_gathers() as gathers, _renames_failing() if setup.fail_rename else contextlib.nullcontext():
            _, report = restore_best(levels, into, Coordinator(), nodes, block_bytes=100, signatures=signatures)
    except NoCompleteStepError as exc:
        return {"error": str(exc), "refusals": exc.refusals}
    full = full_state(setup.seed)
    same = {
        key: torch.equal(value.full_tensor() if isinstance(value, DTensor) else value, full[key])
        for key, value in into["model"].items()
    }
    return {"report": report, "same": same, "warnings": warnings, "gathers": gathers}


@contextlib.contextmanager
def _renames_failing() -> Iterator[None]:
    """Renaming a step directory into place fails with EIO."""

    class FailingRename(localfs.LocalFS):
        def rename_noreplace(self, source: str, destination: str) -> None:
            if os.path.basename(destination).startswith("step_"):
                raise OSError(errno.EIO, "injected", destination)
            super().rename_noreplace(source, destination)

    with localfs.using(FailingRename()):
        yield


def restore(tmp_path: Path, world_size: int, setup: Setup, label: str) -> list[dict[str, Any]]:
    return results_or_raise(run_ranks(world_size, _restore, setup, outbox=tmp_path / f"restore-{label}"))


def two_nodes(tmp_path: Path, saved: Path, *, persistent: bool = True, **kwargs: Any) -> Setup:
    roots = [tmp_path / "node0", tmp_path / "node1"]
    split_into_nodes(saved, roots, lambda r: r // 2, 4, **kwargs)
    shared = tmp_path / "persistent"
    shared.mkdir(exist_ok=True)
    if persistent:
        shutil.copytree(saved, shared / saved.name)
    return Setup(
        [str(root) for root in roots], str(shared), lambda r: r // 2, seed=int(saved.parent.name.split("-")[-1])
    )


def the_report(results: list[dict[str, Any]]) -> RestoreReport:
    for result in results:
        assert "error" not in result, result
        assert all(result["same"].values()), result
    reports = [result["report"] for result in results]
    assert all(report == reports[0] for report in reports)  # every rank reports the same
    report = reports[0]
    assert isinstance(report, RestoreReport)
    return report


def test_a_flipped_local_file_heals_from_the_persistent_copy_of_the_same_step(tmp_path: Path) -> None:
    saved = save_step(tmp_path, 5, seed=3)
    setup = two_nodes(tmp_path, saved)
    damaged = Path(setup.node_roots[1], saved.name, RANK2_FILE)
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    report = the_report(restore(tmp_path, 4, setup, "flipped"))
    assert report.step == 5 and report.source == {0: "local", 1: "local", 2: "local", 3: "local"}
    assert (2, RANK2_FILE, "persistent") in report.healed
    assert damaged.read_bytes() == (saved / RANK2_FILE).read_bytes()
    assert report.refused == [] and report.unreachable == {}
    assert report.levels_read == ["local", "persistent"]
    # Files a node needed beyond its design (the replicated tensor's, the plain tensor's) are
    # recorded as healed in its part; the part's own files are not.
    part = json.loads((Path(setup.node_roots[1], saved.name, NODE_PART_FILENAME)).read_bytes())
    assert RANK2_FILE in part["files"] and RANK2_FILE not in part["healed"]
    assert part["healed"] == sorted({file for rank, file, _ in report.healed if rank >= 2} - set(part["files"]))


def test_a_damaged_rank_index_heals_from_the_persistent_copy(tmp_path: Path) -> None:
    # rank 2 needs its index: the node-local step alone cannot be loaded, so the persistent
    # copy of the same step is listed and heals it
    saved = save_step(tmp_path, 5, seed=14)
    setup = two_nodes(tmp_path, saved)
    index = Path(setup.node_roots[1], saved.name, "index", "rank_00002.json")
    index.write_bytes(index.read_bytes().replace(b"rank", b"RANK", 1))
    report = the_report(restore(tmp_path, 4, setup, "index"))
    assert report.step == 5 and report.source[2] == "local" and report.not_consulted == {}
    assert (2, "index/rank_00002.json", "persistent") in report.healed
    assert index.read_bytes() == (saved / "index" / "rank_00002.json").read_bytes()
    part = json.loads((Path(setup.node_roots[1], saved.name, NODE_PART_FILENAME)).read_bytes())
    assert "index/rank_00002.json" not in part["healed"]  # every node holds every index by design


def test_a_persistent_copy_of_another_attempt_heals_only_files_with_the_same_digest(tmp_path: Path) -> None:
    ours = save_step(tmp_path, 10, seed=15, into="ours")
    again = save_step(tmp_path, 10, seed=15, into="again")  # the same state saved again: same data files
    other = save_step(tmp_path, 10, seed=16, into="other")  # another state
    assert (ours / "manifest.json").read_bytes() != (again / "manifest.json").read_bytes()
    assert (ours / RANK2_FILE).read_bytes() == (again / RANK2_FILE).read_bytes()
    for persistent, expected in [(again, 10), (other, None)]:
        root = tmp_path / f"case-{persistent.parent.name}"
        setup = two_nodes(root, ours, persistent=False)
        shutil.copytree(persistent, Path(setup.persistent or "", persistent.name))
        # The persistent copy is incomplete (else, being complete, it would be restored as it is).
        Path(setup.persistent or "", persistent.name, "shards", "rank_00000.safetensors").unlink()
        Path(setup.node_roots[1], ours.name, RANK2_FILE).unlink()
        results = restore(root, 4, setup, "attempt")
        if expected is None:
            assert all("error" in result for result in results)
            assert f"{RANK2_FILE}: step 10 there is another attempt" in results[0]["error"]
        else:
            report = the_report(results)
            assert report.step == 10 and (2, RANK2_FILE, "persistent") in report.healed


def test_a_wiped_node_is_rebuilt_from_the_persistent_copy(tmp_path: Path) -> None:
    saved = save_step(tmp_path, 5, seed=4)
    setup = two_nodes(tmp_path, saved)
    shutil.rmtree(setup.node_roots[1])
    report = the_report(restore(tmp_path, 4, setup, "wiped"))
    assert report.step == 5 and report.source[2] == "local"
    # node 1's own files exist only on the persistent level; the files node 0 holds (which ranks
    # 2 and 3 also need: the replicated tensors) come from node 0 first
    assert (2, RANK2_FILE, "persistent") in report.healed
    assert {source for rank, _, source in report.healed if rank >= 2} <= {"persistent", "local@node0"}
    rebuilt = Path(setup.node_roots[1], saved.name)
    assert (rebuilt / "manifest.json").read_bytes() == (saved / "manifest.json").read_bytes()
    assert sorted(p.name for p in (rebuilt / "index").iterdir()) == [f"rank_0000{r}.json" for r in range(4)]
    part = json.loads((rebuilt / NODE_PART_FILENAME).read_bytes())
    assert part["files"] == [] and RANK2_FILE in part["healed"] and part["ranks"] == [2, 3]
    assert [p.name for p in Path(setup.node_roots[1]).iterdir()] == [saved.name]  # no staging left


def test_a_rebuilt_part_that_cannot_be_renamed_into_place_is_logged_and_the_step_still_restored(
    tmp_path: Path,
) -> None:
    saved = save_step(tmp_path, 5, seed=7)
    setup = two_nodes(tmp_path, saved)
    shutil.rmtree(setup.node_roots[1])
    results = restore(tmp_path, 4, replace(setup, fail_rename=True), "rename-fails")
    report = the_report(results)  # every rank restored step 5, byte for byte
    assert report.step == 5 and report.refused == []
    assert any("node 1 could not record the files it healed for step 5" in w for w in results[2]["warnings"])
    left = [p.name for p in Path(setup.node_roots[1]).iterdir()]
    assert left and saved.name not in left  # the rebuilt part stayed in its staging directory
    # the next restore rebuilds it and renames it into place
    report = the_report(restore(tmp_path, 4, setup, "rename-again"))
    assert report.step == 5 and [p.name for p in Path(setup.node_roots[1]).iterdir()] == [saved.name]


def test_a_wiped_node_is_rebuilt_from_a_peer_without_a_persistent_copy(tmp_path: Path) -> None:
    saved = save_step(tmp_path, 5, seed=5)
    everything = [str(p.relative_to(saved)) for p in (saved / "shards").iterdir()]
    setup = two_nodes(tmp_path, saved, persistent=False, also=lambda node: everything if node == 0 else [])
    shutil.rmtree(setup.node_roots[1])
    report = the_report(restore(tmp_path, 4, setup, "peer"))
    assert report.step == 5
    assert {source for rank, _, source in report.healed} == {"local@node0"}
    assert (2, RANK2_FILE, "local@node0") in report.healed
    assert Path(setup.node_roots[1], saved.name, RANK2_FILE).read_bytes() == (saved / RANK2_FILE).read_bytes()
    assert report.levels_read == ["local"]


def test_a_missing_file_and_a_flipped_one_heal_from_peers_in_one_restore(tmp_path: Path) -> None:
    # node 1 lacks rank 2's file (fetched while the present files' digests are checked); node
    # 0's copy of rank 0's file is the right size but flipped (found by that check, healed in
    # a second round from node 1, which holds a copy)
    saved = save_step(tmp_path, 5, seed=23)
    everything = [str(p.relative_to(saved)) for p in (saved / "shards").iterdir()]
    setup = two_nodes(tmp_path, saved, persistent=False, also=lambda node: everything)
    Path(setup.node_roots[1], saved.name, RANK2_FILE).unlink()
    flipped = Path(setup.node_roots[0], saved.name, RANK0_FILE)
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x01
    flipped.write_bytes(bytes(data))
    report = the_report(restore(tmp_path, 4, setup, "two-rounds"))
    assert report.step == 5 and report.refused == []
    assert (2, RANK2_FILE, "local@node0") in report.healed
    assert (0, RANK0_FILE, "local@node1") in report.healed
    assert flipped.read_bytes() == (saved / RANK0_FILE).read_bytes()
    assert Path(setup.node_roots[1], saved.name, RANK2_FILE).read_bytes() == (saved / RANK2_FILE).read_bytes()


def test_a_peer_copy_refused_on_arrival_is_asked_of_the_next_node(tmp_path: Path) -> None:
    saved = save_step(tmp_path, 5, seed=19, world_size=3)
    everything = [str(p.relative_to(saved)) for p in (saved / "shards").iterdir()]
    roots = [tmp_path / f"node{n}" for n in range(3)]
    split_into_nodes(saved, roots, lambda r: r, 3, also=lambda node: everything if node < 2 else [])
    shutil.rmtree(roots[2])
    damaged = roots[0] / saved.name / RANK2_FILE
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    setup = Setup([str(root) for root in roots], None, lambda r: r, seed=19)
    results = restore(tmp_path, 3, setup, "next-peer")
    report = the_report(results)
    assert report.step == 5 and (2, RANK2_FILE, "local@node1") in report.healed
    # nodes 0 and 1 offered every file they hold with the check: no gathering of who holds
    # what, and node 0's damaged copy was asked of node 1 next
    assert not any("who holds what" in label for label in results[0]["gathers"]), results[0]["gathers"]
    assert (roots[2] / saved.name / RANK2_FILE).read_bytes() == (saved / RANK2_FILE).read_bytes()


def test_a_signed_step_is_rebuilt_from_a_peer_with_its_signature_and_checked(tmp_path: Path) -> None:
    generate_key_pair(tmp_path / "key.pem", tmp_path / "key.pub")
    saved = save_step(tmp_path, 5, seed=18, signer=str(tmp_path / "key.pem"))
    everything = [str(p.relative_to(saved)) for p in (saved / "shards").iterdir()]
    setup = two_nodes(tmp_path, saved, persistent=False, also=lambda node: everything if node == 0 else [])
    shutil.rmtree(setup.node_roots[1])
    signed = Setup(setup.node_roots, None, setup.node_of, setup.seed, public_key=str(tmp_path / "key.pub"))
    report = the_report(restore(tmp_path, 4, signed, "signed"))
    assert report.step == 5
    rebuilt = Path(setup.node_roots[1], saved.name)
    assert (rebuilt / "manifest.sig").read_bytes() == (saved / "manifest.sig").read_bytes()
    # Another key: the signature is refused on every rank, and no step is left.
    generate_key_pair(tmp_path / "other.pem", tmp_path / "other.pub")
    other = Setup(setup.node_roots, None, setup.node_of, setup.seed, public_key=str(tmp_path / "other.pub"))
    results = restore(tmp_path, 4, other, "other-key")
    assert all("SignatureError" in result["error"] for result in results)


def test_a_newer_local_step_missing_a_node_part_falls_back_and_says_why(tmp_path: Path) -> None:
    older = save_step(tmp_path, 5, seed=6)
    newer = save_step(tmp_path, 10, seed=7)
    setup = two_nodes(tmp_path, older)  # step 5: both nodes and persistent
    split_into_nodes(newer, [Path(setup.node_roots[0]), tmp_path / "elsewhere"], lambda r: r // 2, 4)
    report = the_report(restore(tmp_path, 4, setup, "fallback"))
    assert report.step == 5
    refused = {(step, rank, level) for step, rank, level, _ in report.refused}
    # Ranks 2 and 3 lack their own files; ranks 0 and 1 lack chunks that node 1's ranks wrote.
    assert refused == {(10, rank, level) for rank in range(4) for level in ("local", "persistent")}
    reasons = {(rank, level, reason) for _, rank, level, reason in report.refused}
    assert (2, "local", f"{RANK2_FILE}: missing on node 1; no other node holds it") in reasons
    assert {reason for rank, level, reason in reasons if level == "persistent"} == {"no copy of step 10"}
    assert not any(".tmp-" in p.name for p in Path(setup.node_roots[1]).iterdir())  # the rebuild was removed


def test_a_node_part_of_another_attempt_is_never_used(tmp_path: Path) -> None:
    older = save_step(tmp_path, 5, seed=8)
    ours = save_step(tmp_path, 10, seed=9, into="ours")
    theirs = save_step(tmp_path, 10, seed=10, into="theirs")
    setup = two_nodes(tmp_path, older)
    split_into_nodes(ours, [Path(setup.node_roots[0]), tmp_path / "x1"], lambda r: r // 2, 4)
    split_into_nodes(theirs, [tmp_path / "x0", Path(setup.node_roots[1])], lambda r: r // 2, 4, attempt="1" * 32)
    before = sorted(p.name for p in Path(setup.node_roots[1], ours.name).rglob("*"))
    report = the_report(restore(tmp_path, 4, setup, "attempts"))
    assert report.step == 5  # step 10 never mixes the two attempts' parts
    assert any("another attempt" in reason for step, _, _, reason in report.refused if step == 10)
    assert sorted(p.name for p in Path(setup.node_roots[1], ours.name).rglob("*")) == before


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("level", ["local", "persistent"])
def test_resharding_from_every_level(tmp_path: Path, world_size: int, level: str) -> None:
    saved = save_step(tmp_path, 5, seed=11)
    setup = two_nodes(tmp_path, saved, persistent=level == "persistent")
    if level == "local":
        # 2 ranks: one node each; 3 ranks: ranks 0, 1 on node 0, rank 2 on node 1. Each node
        # lacks chunks the other holds: they come over the process group.
        node_of = (lambda r: r) if world_size == 2 else (lambda r: r // 2)
        setup = Setup(setup.node_roots, None, node_of, setup.seed)
    else:
        setup = Setup(setup.node_roots, setup.persistent, lambda r: r, setup.seed, local=False)
    report = the_report(restore(tmp_path, world_size, setup, f"reshard-{level}-{world_size}"))
    assert report.step == 5 and set(report.source.values()) == {level}
    if level == "local":
        assert report.healed and {source for _, _, source in report.healed} <= {"local@node0", "local@node1"}
    else:
        assert report.healed == []


def test_an_unreachable_persistent_level_is_reported_and_local_is_restored(tmp_path: Path) -> None:
    saved = save_step(tmp_path, 5, seed=12)
    setup = two_nodes(tmp_path, saved, persistent=False)
    (tmp_path / "gone").write_text("not a directory")
    setup = Setup(setup.node_roots, str(tmp_path / "gone"), setup.node_of, setup.seed)
    report = the_report(restore(tmp_path, 4, setup, "unreachable"))
    assert report.step == 5 and set(report.unreachable) == {"persistent"}
    assert "not a directory" in report.unreachable["persistent"]


def test_no_complete_step_raises_with_the_refusals(tmp_path: Path) -> None:
    saved = save_step(tmp_path, 5, seed=13)
    setup = two_nodes(tmp_path, saved, persistent=False)
    shutil.rmtree(setup.node_roots[1])
    results = restore(tmp_path, 4, setup, "none")
    assert all("error" in result for result in results), results
    refusals = results[0]["refusals"]
    assert {(step, rank, level) for step, rank, level, _ in refusals} >= {(5, 2, "local"), (5, 3, "local")}
    assert "step 5, rank 2, level local" in results[0]["error"]


@pytest.mark.slow
def test_a_wiped_node_is_rebuilt_from_a_persistent_copy_on_s3(
    tmp_path: Path, s3_server: Any, s3_root: tuple[str, dict[str, Any]]
) -> None:
    saved = save_step(tmp_path, 5, seed=17)
    setup = two_nodes(tmp_path, saved, persistent=False)
    root, options = s3_root
    s3_server.filesystem().put(str(saved), f"{root.removeprefix('s3://')}/{saved.name}", recursive=True)
    shutil.rmtree(setup.node_roots[1])
    setup = Setup(setup.node_roots, root, setup.node_of, setup.seed, options=options)
    report = the_report(restore(tmp_path, 4, setup, "s3"))
    assert report.step == 5 and report.source == {0: "local", 1: "local", 2: "local", 3: "local"}
    assert (2, RANK2_FILE, "persistent") in report.healed
    assert Path(setup.node_roots[1], saved.name, RANK2_FILE).read_bytes() == (saved / RANK2_FILE).read_bytes()
    # Resharding 4 -> 3 straight from the S3 copy.
    direct = Setup(setup.node_roots, setup.persistent, lambda r: r, setup.seed, local=False, options=setup.options)
    report = the_report(restore(tmp_path, 3, direct, "s3-direct"))
    assert report.step == 5 and set(report.source.values()) == {"persistent"}


def test_one_process_restores_the_newest_step_and_returns_the_state(tmp_path: Path) -> None:
    from shardkeep.distributed.coordinator import Coordinator

    state = {"w": torch.arange(10.0), "step": 7}
    for step in (3, 7):
        sk.save({**state, "step": step}, tmp_path / "saved" / checkpoint_name(step))
        split_into_nodes(tmp_path / "saved" / checkpoint_name(step), [tmp_path / "local"], lambda r: 0, 1)
    shutil.copytree(tmp_path / "saved" / checkpoint_name(3), tmp_path / "persistent" / checkpoint_name(3))
    Path(tmp_path, "local", checkpoint_name(7), "shards", "rank_00000.safetensors").write_bytes(b"damaged")
    levels = [
        LevelView("local", str(tmp_path / "local"), node_local=True),
        LevelView("persistent", str(tmp_path / "persistent")),
    ]
    loaded, report = restore_best(levels, None, Coordinator(), Nodes((0,)))
    assert report.step == 3 and loaded["step"] == 3 and torch.equal(loaded["w"], state["w"])
    assert [(step, rank, level) for step, rank, level, _ in report.refused] == [(7, 0, "local"), (7, 0, "persistent")]
    assert "size is 7 bytes" in report.refused[0][3]


def test_a_local_file_is_read_once_the_bytes_checked_are_the_bytes_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The digest check of the local files keeps each one's bytes for the load: no second
    reading of a file that passed, and a file that failed is healed and read from its new copy."""
    import shardkeep.io
    import shardkeep.levels.attempt
    import shardkeep.loading
    from shardkeep.distributed.coordinator import Coordinator

    state = {"w": torch.arange(1000.0), "b": torch.ones(3), "step": 4}
    sk.save(state, tmp_path / "saved" / checkpoint_name(4))
    split_into_nodes(tmp_path / "saved" / checkpoint_name(4), [tmp_path / "local"], lambda r: 0, 1)
    opened: dict[str, list[str]] = {"check": [], "load": []}
    original = shardkeep.io.check_shard

    def counting(by: str) -> Callable[..., Any]:
        def check_shard(store: Any, path: str, record: Any, **kwargs: Any) -> Any:
            if record.path.endswith(".safetensors"):
                opened[by].append(record.path)
            return original(store, path, record, **kwargs)

        return check_shard

    monkeypatch.setattr(shardkeep.levels.attempt, "check_shard", counting("check"))
    monkeypatch.setattr(shardkeep.loading, "check_shard", counting("load"))
    levels = [LevelView("local", str(tmp_path / "local"), node_local=True)]
    loaded, report = restore_best(levels, None, Coordinator(), Nodes((0,)))
    assert report.step == 4 and torch.equal(loaded["w"], state["w"]) and loaded["step"] == 4
    data = opened["check"]
    assert data and sorted(data) == sorted(set(data)) and opened["load"] == [], opened

    # A flipped file: refused by the check, healed from the persistent copy, and read by the
    # load from that copy (the bytes that failed are never used).
    shutil.copytree(tmp_path / "saved" / checkpoint_name(4), tmp_path / "persistent" / checkpoint_name(4))
    target = Path(tmp_path, "local", checkpoint_name(4), data[0])
    flipped = bytearray(target.read_bytes())
    flipped[-1] ^= 0xFF
    target.write_bytes(bytes(flipped))
    opened = {"check": [], "load": []}
    levels.append(LevelView("persistent", str(tmp_path / "persistent")))
    loaded, report = restore_best(levels, None, Coordinator(), Nodes((0,)))
    assert report.step == 4 and torch.equal(loaded["w"], state["w"])
    assert (0, data[0], "persistent") in report.healed
    assert opened["load"] == [data[0]], opened
