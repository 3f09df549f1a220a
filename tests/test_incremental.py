"""Versions and incremental checkpoints: unchanged files are referenced instead of written again,
loads follow references, and retention never deletes a file that a kept checkpoint references
(reference counts come from the manifests alone)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import shardkeep as sk
from shardkeep.cli import main as cli_main


def moe(experts: int = 20, width: int = 64, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    state = {"embed.weight": torch.randn(8, width, generator=generator)}
    for expert in range(experts):
        state[f"layers.0.experts.{expert}.w1"] = torch.randn(width, 4 * width, generator=generator)
    return state


def written_bytes(manifest: sk.Manifest) -> int:
    return sum(record.size for record in manifest.files if record.ref is None)


def files_under(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file() and p.name != "manifest.json")


def test_ninety_percent_frozen_experts_write_about_ten_percent(tmp_path: Path) -> None:
    root = tmp_path / "root"
    model = moe()
    first = sk.save({"model": model}, root / "step_00000001", incremental=True)
    assert all(record.version == 1 and record.ref is None for record in first.files)
    total = written_bytes(first)
    for expert in (3, 11):  # 2 of 20 experts train; the other 18 are frozen
        model[f"layers.0.experts.{expert}.w1"] += 0.5
    second = sk.save({"model": model}, root / "step_00000002", incremental=root / "step_00000001")
    fraction = written_bytes(second) / total
    assert 0.05 < fraction < 0.15, fraction
    assert files_under(root / "step_00000002") == written_bytes(second)  # nothing else was written
    by_file = {record.path.rsplit("/", 1)[-1]: record for record in second.files}
    changed = by_file["rank_00000_L000_E003.safetensors"]
    frozen = by_file["rank_00000_L000_E004.safetensors"]
    assert (changed.version, changed.ref) == (2, None)
    assert (frozen.version, frozen.ref) == (1, "step_00000001")
    # Loading follows the references, and verification covers the referenced files.
    assert sk.verify(root / "step_00000002").ok
    loaded = sk.load(root / "step_00000002")
    for key, value in model.items():
        assert torch.equal(loaded["model"][key], value), key
    # A third save still references the first checkpoint's frozen files (not a chain of refs).
    model["layers.0.experts.3.w1"] += 1.0
    third = sk.save({"model": model}, root / "step_00000003", incremental="step_00000002")
    third_by_file = {record.path.rsplit("/", 1)[-1]: record for record in third.files}
    assert third_by_file["rank_00000_L000_E004.safetensors"].ref == "step_00000001"
    assert third_by_file["rank_00000_L000_E003.safetensors"].version == 3
    assert third_by_file["rank_00000_L000_E011.safetensors"].ref == "step_00000002"
    out = io.StringIO()
    assert cli_main(["inspect", str(root / "step_00000003"), "--all"], out=out, err=io.StringIO()) == 0
    assert "unchanged: kept in step_00000001" in out.getvalue()


def test_a_damaged_referenced_file_fails_every_checkpoint_that_uses_it(tmp_path: Path) -> None:
    root = tmp_path / "root"
    model = moe(experts=4)
    sk.save({"model": model}, root / "step_00000001", incremental=True)
    model["embed.weight"] += 1
    second = sk.save({"model": model}, root / "step_00000002", incremental="step_00000001")
    shared = next(record for record in second.files if record.ref == "step_00000001")
    target = root / "step_00000001" / shared.path
    data = bytearray(target.read_bytes())
    data[-1] ^= 1
    target.chmod(0o644)
    target.write_bytes(bytes(data))
    report = sk.verify(root / "step_00000002")
    assert not report.ok and any("step_00000001" in problem for problem in report.problems)
    with pytest.raises(sk.IntegrityError):
        sk.load(root / "step_00000002")


def test_incremental_refuses_a_base_in_another_root(tmp_path: Path) -> None:
    sk.save({"w": torch.ones(2)}, tmp_path / "a" / "step_00000001", incremental=True)
    with pytest.raises(sk.UnsupportedValueError, match="same root"):
        sk.save({"w": torch.ones(2)}, tmp_path / "b" / "step_00000002", incremental=tmp_path / "a" / "step_00000001")


def _train(manager: sk.CheckpointManager, model: dict[str, torch.Tensor], steps: list[int], moving: list[int]) -> None:
    for step in steps:
        for expert in moving:
            model[f"layers.0.experts.{expert}.w1"] += 0.1
        manager.save({"model": model, "step": step}, step=step, metrics={"val_loss": 1.0 / step})


def test_retention_keeps_every_file_a_kept_checkpoint_references(tmp_path: Path) -> None:
    root = tmp_path / "root"
    manager = sk.CheckpointManager(root, keep_last=1, keep_best=0, incremental=True)
    model = moe(experts=6)
    _train(manager, model, [1, 2, 3], moving=[0])
    assert [entry.name for entry in manager.list()] == ["step_00000003"]
    newest = sk.read_manifest(root / "step_00000003")
    owners = {record.ref for record in newest.files if record.ref}
    assert owners == {"step_00000001"}  # the frozen experts still live in the first checkpoint
    # The first checkpoint is no longer a checkpoint (no manifest), but its referenced files stay;
    # the second is gone entirely.
    assert not (root / "step_00000001" / "manifest.json").exists()
    assert (root / "step_00000001").is_dir()
    assert not (root / "step_00000002").exists()
    kept = {record.path for record in newest.files if record.ref == "step_00000001"}
    on_disk = {
        p.relative_to(root / "step_00000001").as_posix() for p in (root / "step_00000001").rglob("*.safetensors")
    }
    assert on_disk == kept
    assert sk.verify(root / "step_00000003").ok
    restored = manager.restore()
    assert torch.equal(restored.state["model"]["layers.0.experts.0.w1"], model["layers.0.experts.0.w1"])
    out = io.StringIO()
    assert cli_main(["ls", str(root), "--json"], out=out, err=io.StringIO()) == 0
    assert [entry["name"] for entry in json.loads(out.getvalue())["checkpoints"]] == ["step_00000003"]
    # Once every expert has changed, nothing references the first checkpoint: it is removed.
    _train(manager, model, [4], moving=list(range(6)))
    model["embed.weight"] += 1
    _train(manager, model, [5], moving=[])
    assert not (root / "step_00000001").exists()
    # Step 5 changed only the embedding: its experts are step 4's files, which stay (no manifest).
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == ["step_00000004", "step_00000005"]
    assert not (root / "step_00000004" / "manifest.json").exists()
    final = sk.read_manifest(root / "step_00000005")
    assert {record.ref for record in final.files} <= {None, "step_00000004"}
    assert sk.verify(root / "step_00000005").ok


def test_prune_never_deletes_a_referenced_file(tmp_path: Path) -> None:
    root = tmp_path / "root"
    manager = sk.CheckpointManager(root, keep_last=3, keep_best=0, incremental=True)
    model = moe(experts=4)
    _train(manager, model, [1, 2, 3], moving=[1])
    out = io.StringIO()
    code = cli_main(["prune", str(root), "--keep-last", "1", "--keep-best", "0", "--apply"], out=out, err=io.StringIO())
    assert code == 0, out.getvalue()
    assert sk.verify(root / "step_00000003").ok
    loaded = sk.load(root / "step_00000003")
    assert torch.equal(loaded["model"]["layers.0.experts.2.w1"], model["layers.0.experts.2.w1"])


def test_incremental_manager_on_s3(s3_root: tuple[str, dict[str, Any]], s3_server: Any) -> None:
    root, options = s3_root
    manager = sk.CheckpointManager(root, keep_last=1, keep_best=0, incremental=True, storage_options=options)
    model = moe(experts=5)
    _train(manager, model, [1, 2, 3], moving=[2])
    newest = sk.read_manifest(f"{root}/step_00000003", storage_options=options)
    assert {record.ref for record in newest.files if record.ref} == {"step_00000001"}
    assert sk.verify(f"{root}/step_00000003", storage_options=options).ok
    restored = manager.restore()
    assert torch.equal(restored.state["model"]["layers.0.experts.2.w1"], model["layers.0.experts.2.w1"])
    assert [entry.name for entry in manager.list()] == ["step_00000003"]


def test_retention_keeps_files_while_a_manifest_cannot_be_read(tmp_path: Path) -> None:
    root = tmp_path / "root"
    model = moe(experts=4)
    sk.save({"model": model}, root / "step_00000001", incremental=True, step=1)
    model["embed.weight"] += 1
    sk.save({"model": model}, root / "step_00000002", incremental="step_00000001", step=2)
    model["embed.weight"] += 1
    sk.save({"model": model}, root / "step_00000003", incremental=True, step=3)  # references nothing
    manifest_2 = root / "step_00000002" / "manifest.json"
    original = manifest_2.read_bytes()
    manifest_2.chmod(0o644)
    manifest_2.write_bytes(original[:-20] + b"x" * 20)  # damaged: its references are unknown
    out = io.StringIO()
    assert cli_main(
        ["prune", str(root), "--keep-last", "1", "--keep-best", "0", "--apply"], out=out, err=io.StringIO()
    ) in (0, 1)
    assert not (root / "step_00000001" / "manifest.json").exists()  # step 1 was un-committed ...
    manifest_2.write_bytes(original)  # ... but once step 2's manifest is repaired, it loads
    assert sk.verify(root / "step_00000002").ok
    assert sk.verify(root / "step_00000003").ok


def test_a_checkpoint_under_another_name_protects_what_it_references(tmp_path: Path) -> None:
    root = tmp_path / "root"
    model = moe(experts=4)
    sk.save({"model": model}, root / "step_00000001", incremental=True, step=1)
    model["embed.weight"] += 1
    sk.save({"model": model}, root / "export", incremental="step_00000001")  # not a step_<N> name
    model["embed.weight"] += 1
    sk.save({"model": model}, root / "step_00000002", incremental=True, step=2)
    cli_main(
        ["prune", str(root), "--keep-last", "1", "--keep-best", "0", "--apply"], out=io.StringIO(), err=io.StringIO()
    )
    assert not (root / "step_00000001" / "manifest.json").exists()
    assert sk.verify(root / "export").ok


def test_an_incremental_save_never_references_a_missing_base_file(tmp_path: Path) -> None:
    root = tmp_path / "root"
    model = moe(experts=3)
    first = sk.save({"model": model}, root / "step_00000001", incremental=True)
    lost = next(record for record in first.files if "_E001" in record.path)
    (root / "step_00000001" / lost.path).unlink()
    second = sk.save({"model": model}, root / "step_00000002", incremental="step_00000001")
    rewritten = next(record for record in second.files if record.path.endswith("_E001.safetensors"))
    assert rewritten.ref is None  # written again instead of referencing a missing file
    assert sum(1 for record in second.files if record.ref) == len(second.files) - 1
    assert sk.verify(root / "step_00000002").ok


def test_incremental_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(sk.UnsupportedValueError, match="incremental="):
        sk.save({"w": torch.ones(2)}, tmp_path / "a", incremental=3)  # type: ignore[arg-type]
    with pytest.raises(sk.ConfigError, match="compression"):
        sk.CheckpointManager(tmp_path / "m", incremental=True, options=sk.WriteOptions(compression="zstd"))
    sk.save({"w": torch.ones(2)}, tmp_path / "b" / "step_00000001", incremental=True)
    with pytest.raises(sk.UnsupportedValueError, match="compressed"):
        sk.save(
            {"w": torch.ones(2)},
            tmp_path / "b" / "step_00000002",
            incremental="step_00000001",
            options=sk.WriteOptions(compression="zstd"),
        )
