"""Long names: every name a filesystem accepts (up to 255 bytes of UTF-8) can be saved, loaded,
verified, listed, pruned and removed through every entry point; the names shardkeep derives
from it (staging, being-deleted, temporary) never pass that limit; a longer name is refused
with a typed error before anything is written."""

from __future__ import annotations

import io
import multiprocessing
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import shardkeep as sk  # noqa: E402
from shardkeep.catalog import CheckpointRoot  # noqa: E402
from shardkeep.cli import main  # noqa: E402
from shardkeep.distributed.commit import CheckpointCommit  # noqa: E402
from shardkeep.storage import LocalStore  # noqa: E402

#: A checkpoint name as Lightning's ModelCheckpoint makes it from metrics (90 bytes), and 28 CJK
#: characters with the same suffix (89 bytes of UTF-8).
LIGHTNING_NAME = "epoch=12-step=3400-val_loss=0.1234-val_acc=0.9876-train_loss=0.2345-lr=0.0001-seed=42.ckpt"
CJK_NAME = "检查点" * 9 + "模" + ".ckpt"


def long_name(size: int, unit: str = "a") -> str:
    """A name of exactly ``size`` bytes of UTF-8 made of ``unit`` (then ASCII to fill up)."""
    width = len(unit.encode())
    name = unit * (size // width) + "b" * (size % width)
    assert len(name.encode()) == size
    return name


NAMES = [
    pytest.param(long_name(200), id="ascii-200"),
    pytest.param(long_name(219), id="ascii-219"),
    pytest.param(long_name(255), id="ascii-255"),
    pytest.param(long_name(255, "é"), id="2-byte-255"),
    pytest.param(long_name(255, "检"), id="3-byte-255"),
    pytest.param(long_name(254, "😀"), id="4-byte-254"),
]


def state() -> dict[str, object]:
    return {"w": torch.arange(6.0).reshape(2, 3), "step": 3}


@pytest.mark.parametrize("name", NAMES)
def test_save_load_verify_a_name_up_to_255_bytes(tmp_path: Path, name: str) -> None:
    target = tmp_path / name
    sk.save(state(), target)
    assert sk.verify(target).ok
    assert torch.equal(sk.load(target)["w"], torch.arange(6.0).reshape(2, 3))
    assert sorted(os.listdir(tmp_path)) == [name]


LIGHTNING_NAMES = [
    pytest.param(LIGHTNING_NAME, id="lightning-metrics-90"),
    pytest.param(CJK_NAME, id="cjk-89"),
    pytest.param(long_name(89), id="ascii-89"),
    pytest.param(long_name(100), id="ascii-100"),
    pytest.param(long_name(101), id="ascii-101"),
    pytest.param(long_name(255), id="ascii-255"),
    pytest.param(long_name(255, "检"), id="3-byte-255"),
]


@pytest.mark.parametrize("name", LIGHTNING_NAMES)
def test_lightning_saves_replaces_loads_and_removes_long_names(tmp_path: Path, name: str) -> None:
    pytest.importorskip("lightning")
    from shardkeep.lightning import ShardkeepCheckpointIO

    io = ShardkeepCheckpointIO()
    target = tmp_path / name
    io.save_checkpoint({"epoch": 1, "global_step": 8, "w": torch.ones(2)}, target)
    io.save_checkpoint({"epoch": 2, "global_step": 16, "w": torch.full((2,), 2.0)}, target)  # the replacement
    assert sorted(os.listdir(tmp_path)) == [name]
    loaded = io.load_checkpoint(target)
    assert loaded["global_step"] == 16 and torch.equal(loaded["w"], torch.full((2,), 2.0))
    io.remove_checkpoint(target)
    assert os.listdir(tmp_path) == []


def test_a_name_over_255_bytes_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    for name in (long_name(256), long_name(256, "检")):
        with pytest.raises(sk.UnsafePathError, match="256 bytes long; a file or directory name may have at most 255"):
            sk.save(state(), tmp_path / name)
        with pytest.raises(sk.UnsafePathError, match="256 bytes"):
            sk.async_save(state(), tmp_path / name).result(60)
    assert os.listdir(tmp_path) == []


def test_removing_a_name_too_long_for_the_filesystem_is_a_storage_error(tmp_path: Path) -> None:
    with pytest.raises(sk.StorageError, match="File name too long"):
        LocalStore(str(tmp_path)).remove_tree(long_name(256))


@pytest.mark.parametrize("name", [long_name(255), long_name(255, "检")], ids=["ascii-255", "3-byte-255"])
def test_async_save_and_a_manager_under_a_long_root(tmp_path: Path, name: str) -> None:
    target = tmp_path / name
    sk.async_save(state(), target).result(60)
    assert sk.verify(target).ok
    root = tmp_path / "roots" / name
    manager = sk.CheckpointManager(root, keep_last=1, keep_best=0, staging_lease=0)
    for step in (1, 2):
        manager.save(state(), step=step)
    manager.async_save(state(), step=3).result(60)
    assert [entry.step for entry in manager.list()] == [3]
    assert sk.verify(root / "step_00000003").ok


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized:UserWarning")
def test_dcp_writer_and_reader_with_a_long_checkpoint_id(tmp_path: Path) -> None:
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from shardkeep.dcp import ShardkeepReader, ShardkeepWriter

    path = tmp_path / long_name(255, "é")
    dcp.save({"w": torch.arange(4.0)}, storage_writer=ShardkeepWriter(path))
    assert sk.verify(path).ok
    loaded = {"w": torch.zeros(4)}
    dcp.load(loaded, storage_reader=ShardkeepReader(path))
    assert torch.equal(loaded["w"], torch.arange(4.0))
    with pytest.raises(sk.UnsafePathError, match="256 bytes"):
        dcp.save({"w": torch.arange(4.0)}, storage_writer=ShardkeepWriter(tmp_path / long_name(256)))


def test_hf_export_to_a_long_destination_and_over_it(tmp_path: Path) -> None:
    from shardkeep.hf import export_hf

    source = tmp_path / "ckpt"
    sk.save({"model": {"w": torch.arange(4.0)}}, source)
    destination = tmp_path / long_name(255, "检")
    export_hf(source, destination)
    export_hf(source, destination, overwrite=True)  # the replacement makes sibling names too
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt", destination.name])
    from safetensors.torch import load_file

    assert torch.equal(load_file(destination / "model.safetensors")["w"], torch.arange(4.0))
    with pytest.raises(sk.UnsafePathError, match="256 bytes"):
        export_hf(source, tmp_path / long_name(256))
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt", destination.name])


def test_cli_commands_on_long_paths(tmp_path: Path) -> None:
    def run(*argv: str) -> int:
        return main(list(argv), out=io.StringIO(), err=io.StringIO())

    root = tmp_path / long_name(255, "检")
    sk.CheckpointManager(root, keep_last=2, keep_best=0).save(state(), step=1)
    checkpoint = tmp_path / long_name(255)
    sk.save(state(), checkpoint)
    for path in (root / "step_00000001", checkpoint):
        assert run("verify", str(path)) == 0
        assert run("inspect", str(path)) == 0
    assert run("ls", str(root)) == 0
    assert run("prune", str(root), "--keep-last", "1", "--keep-best", "0", "--apply") == 0
    assert run("verify", str(tmp_path / long_name(256))) == 2


class _DiesAtTheCommit(LocalStore):
    """A local root whose process dies (``os._exit``, as by kill -9) at the commit rename, after
    every data file, in the root and in the tier location, is written."""

    def rename(self, src: str, dst: str) -> None:
        if ".tmp-" in src:
            os._exit(9)
        super().rename(src, dst)


TIERS_RULES = [("*.experts.*", "cold"), ("*", "hot")]


def _tiers(cold: Path) -> list[sk.Tier]:
    return [sk.Tier(tier_id=1, name="hot"), sk.Tier(tier_id=2, name="cold", location=str(cold))]


def _tiered_state() -> dict[str, object]:
    return {"model": {"layers.0.experts.0.w": torch.ones(8), "layers.0.attn.w": torch.zeros(8)}}


def _crashing_save(root: str, cold: str, name: str) -> None:
    store = _DiesAtTheCommit(root)
    sk.save(_tiered_state(), name, storage=store, tiers=sk.TierPlan(tiers=_tiers(Path(cold)), placement=TIERS_RULES))


def test_leftovers_of_a_crashed_save_under_a_long_name_are_collected_with_their_tier_files(tmp_path: Path) -> None:
    root, cold = tmp_path / "root", tmp_path / "cold"
    root.mkdir()
    committed = long_name(255, "é")
    sk.save(_tiered_state(), root / committed, tiers=sk.TierPlan(tiers=_tiers(cold), placement=TIERS_RULES))
    crashed = long_name(255, "检")
    child = multiprocessing.get_context("fork").Process(target=_crashing_save, args=(str(root), str(cold), crashed))
    child.start()
    child.join(60)
    assert child.exitcode == 9
    (staging,) = [name for name in os.listdir(root) if ".tmp-" in name]
    assert len(staging.encode()) <= 255 and crashed not in staging
    attempt = cold / crashed / f"attempt-{staging.rpartition('.tmp-')[2][:16]}"
    assert any(attempt.rglob("*.safetensors"))  # what the crash left in the tier location

    catalog = CheckpointRoot(LocalStore(str(root)))
    readable, unreadable = catalog.manifests()
    assert [name for name, _ in readable] == [committed] and unreadable == []  # never read as a checkpoint
    assert catalog.collect_leftovers(lease=3600) == []  # young: maybe a save in progress
    removed = catalog.collect_leftovers(lease=0)
    assert staging in removed and not (root / staging).exists() and not attempt.exists()
    assert sorted(os.listdir(root)) == [committed] and sk.verify(root / committed).ok
    assert sk.verify(root / committed).ok and (cold / committed).is_dir()  # the committed tier files stay


def test_prune_removes_a_long_named_checkpoint_and_a_long_named_staging_leftover(tmp_path: Path) -> None:
    root = tmp_path / long_name(255, "检")
    manager = sk.CheckpointManager(root, keep_last=1, keep_best=0, staging_lease=0)
    manager.save(state(), step=1)
    leftover = CheckpointCommit(LocalStore(str(root)), long_name(255))  # a save killed after its begin
    leftover.begin()
    os.makedirs(root / leftover.staging / "shards")
    (root / leftover.staging / "shards" / "rank_00000.safetensors").write_bytes(b"partial")
    assert len(leftover.staging.encode()) == 255
    err = io.StringIO()
    code = main(
        ["prune", str(root), "--apply", "--lease", "0", "--keep-last", "1", "--keep-best", "0"],
        out=io.StringIO(),
        err=err,
    )
    assert code == 0, err.getvalue()
    assert not (root / leftover.staging).exists()
    manager.save(state(), step=2)  # retention deletes step 1 through a being-deleted name of its own
    assert sorted(name for name in os.listdir(root) if name.startswith("step_")) == ["step_00000002"]


def test_a_progress_ledger_and_its_batch_files_under_long_names(tmp_path: Path) -> None:
    ledger = sk.ProgressLedger(tmp_path / long_name(255, "检"), 1)
    ledger.initialize()
    batch = tmp_path / "shard_0" / long_name(255, "é")  # a checkpoint of results: deleted via a sibling name
    sk.save(state(), batch)
    second = tmp_path / "shard_0" / long_name(255, "ü")
    second.write_bytes(b"result")
    ledger.update_shard_checkpoint(0, 0, 10, str(batch))
    ledger.update_shard_checkpoint(0, 1, 10, str(second))  # updates go through .tmp and .backup copies
    ledger.mark_shard_complete(0)
    archived = ledger.archive(tmp_path / "archive")
    assert len(archived.name.encode()) <= 255 and archived.name.endswith("_final.json")
    assert sk.ProgressLedger(archived).progress()["completed"] == 1
    assert ledger.cleanup_checkpoints(keep_final_only=False) == 2
    assert os.listdir(tmp_path / "shard_0") == []
    with pytest.raises(sk.UnsafePathError, match="256 bytes"):
        sk.ProgressLedger(tmp_path / long_name(256), 1)


def test_export_to_a_long_file_name(tmp_path: Path) -> None:
    from shardkeep.interop import export_checkpoint

    sk.save(state(), tmp_path / "ckpt")
    for suffix in (".pt", ".safetensors"):
        destination = tmp_path / (long_name(255 - len(suffix), "é") + suffix)
        export_checkpoint(tmp_path / "ckpt", destination)
        assert destination.is_file()
        export_checkpoint(tmp_path / "ckpt", destination, overwrite=True)
    assert len(os.listdir(tmp_path)) == 3
    with pytest.raises(sk.UnsafePathError, match="256 bytes"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / (long_name(253) + ".pt"))


def test_no_name_derived_from_a_lightning_working_name_is_shortened(tmp_path: Path) -> None:
    """Recovery finds a Lightning save's leftovers by their tag: the staging directory that
    shardkeep.save makes of a working name must keep it whole, for every name length."""
    pytest.importorskip("lightning")
    from shardkeep.integrations.lightning import checkpoint_io as skl

    for size in range(1, 256):
        for unit in ("a", "检"):
            name = long_name(size, unit) if size >= len(unit.encode()) else long_name(size)
            working = f"{skl._tag(name)}new-{'0' * 32}"
            staging = CheckpointCommit(LocalStore(str(tmp_path)), working).staging
            assert staging.startswith(f"{working}.tmp-") and len(staging.encode()) <= 255, size
