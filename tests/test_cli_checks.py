"""The command line as a new user meets it: import/export without torch, verify of a format 2.0
checkpoint missing a rank index, ``ls`` checking tier locations without ``--verify``, the
``step_<N>`` names it sees, ``prune`` of leftovers alone, and the help of every command."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import shardkeep as sk
from shardkeep.cli import build_parser, main
from tests.support.distributed_harness import results_or_raise, run_ranks


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


# -- import and export without torch -----------------------------------------------------------
def _without_torch(tmp_path: Path) -> dict[str, str]:
    """An environment whose Python cannot import torch, as when it is not installed: a
    ``sitecustomize`` on PYTHONPATH makes ``import torch`` raise ModuleNotFoundError."""
    blocker = tmp_path / "no-torch"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.parametrize("command", ["import", "export"])
def test_import_and_export_without_torch_are_a_dependency_error(tmp_path: Path, command: str) -> None:
    checkpoint = tmp_path / "ckpt"
    sk.save({"w": torch.ones(2)}, checkpoint)
    source = tmp_path / "weights.pt"
    torch.save({"w": torch.ones(2)}, source)
    argv = {
        "import": ["import", str(source), str(tmp_path / "new")],
        "export": ["export", str(checkpoint), str(tmp_path / "out.safetensors")],
    }[command]
    env = _without_torch(tmp_path)
    probe = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True, env=env)
    assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr  # the harness works
    plain = subprocess.run([sys.executable, "-m", "shardkeep", *argv], capture_output=True, text=True, env=env)
    assert plain.returncode == 2, plain.stderr
    assert plain.stderr.startswith(f"shardkeep {command}: error: ") and "Traceback" not in plain.stderr
    assert "PyTorch" in plain.stderr and "pip install torch" in plain.stderr
    as_json = subprocess.run(
        [sys.executable, "-m", "shardkeep", *argv, "--json"], capture_output=True, text=True, env=env
    )
    assert as_json.returncode == 2 and as_json.stdout == ""
    error = json.loads(as_json.stderr)["error"]
    assert error["type"] == "DependencyError" and error["command"] == command and "PyTorch" in error["message"]
    assert not (tmp_path / "new").exists() and not (tmp_path / "out.safetensors").exists()


# -- verify of a format 2.0 checkpoint missing a rank index ------------------------------------
def _save_sharded(rank: int, world_size: int, path: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    state = {"w": distribute_tensor(torch.arange(32.0).reshape(8, 4), mesh, [Shard(0)])}
    return sk.save(state, path, step=1).metadata_version


def test_verify_reports_a_missing_rank_index_as_a_problem(tmp_path: Path) -> None:
    path = tmp_path / "step_00000001"
    versions = results_or_raise(run_ranks(2, _save_sharded, str(path), outbox=tmp_path / "outbox"))
    assert set(versions) == {"2.1"}
    (path / "index" / "rank_00001.json").unlink()
    code, out, err = run("verify", str(path))
    assert code == 1, (out, err)
    assert "PROBLEM" in out and "rank_00001.json" in out
    code, out, _ = run("verify", str(path), "--json")
    report = json.loads(out)
    assert code == 1 and not report["ok"]
    assert any("rank_00001.json" in problem for problem in report["problems"])
    code, out, _ = run("ls", str(tmp_path))
    assert code == 1 and "rank_00001.json" in out


# -- ls checks every tier's files --------------------------------------------------------------
def _tiered_root(tmp_path: Path) -> tuple[Path, Path]:
    root, cold = tmp_path / "root", tmp_path / "cold"
    tiers = [sk.Tier(tier_id=1, name="hot"), sk.Tier(tier_id=2, name="cold", location=str(cold))]
    for step in (1, 2):
        state = {"body": torch.full((64,), float(step)), "experts": {"e0": torch.full((256,), float(step))}}
        sk.save(
            state,
            root / f"step_{step:08d}",
            step=step,
            tiers=sk.TierPlan(tiers=tiers, placement=[("experts.*", "cold"), ("*", "hot")]),
        )
    return root, cold


def test_ls_without_verify_reports_a_missing_cold_tier_and_marks_nothing_on_it(tmp_path: Path) -> None:
    root, cold = _tiered_root(tmp_path)
    code, out, _ = run("ls", str(root))
    assert code == 0, out
    (cold / "step_00000002").rename(tmp_path / "elsewhere")
    code, out, _ = run("ls", str(root))
    assert code == 2, out
    line = next(line for line in out.splitlines() if line.startswith("step_00000002"))
    assert "UNREADABLE" in line and "cold" in line and "last" not in line and "best" not in line
    code, out, _ = run("ls", str(root), "--json")
    entry = next(item for item in json.loads(out)["checkpoints"] if item["name"] == "step_00000002")
    assert code == 2 and entry["missing_tiers"] == ["cold"] and not entry["is_last"] and not entry["is_best"]
    assert next(item for item in json.loads(out)["checkpoints"] if item["name"] == "step_00000001")["is_last"]


def test_ls_without_verify_checks_each_tier_file_exists_with_its_size(tmp_path: Path) -> None:
    root, cold = _tiered_root(tmp_path)
    files = sorted(p for p in (cold / "step_00000002").rglob("*.safetensors"))
    assert files
    with open(files[0], "ab") as handle:
        handle.write(b"x")
    code, out, _ = run("ls", str(root))
    assert code == 1 and "CORRUPT" in out and "size" in out, out
    files[0].unlink()
    code, out, _ = run("ls", str(root))
    assert code == 1 and "CORRUPT" in out and "missing" in out, out


# -- step_<N> names ----------------------------------------------------------------------------
def test_the_readme_quickstart_names_are_seen_by_ls_and_the_manager(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 4)
    optim = torch.optim.AdamW(model.parameters())
    root = tmp_path / "ckpts"
    sk.save({"model": model, "optim": optim, "step": 100}, root / "step_100")
    assert sk.read_manifest(root / "step_100").step == 100  # recorded from the state's "step"
    code, out, _ = run("ls", str(root))
    assert code == 0, out
    assert any(line.split()[:2] == ["step_100", "100"] for line in out.splitlines()), out
    manager = sk.CheckpointManager(root, keep_last=2, keep_best=0)
    assert [entry.name for entry in manager.list()] == ["step_100"]
    restored = manager.restore()
    assert restored.entry.name == "step_100" and restored.step == 100
    with pytest.raises(sk.CheckpointExistsError, match="step_100"):
        manager.save({"w": torch.ones(1)}, step=100)  # the same step under its padded name


def test_an_explicit_step_wins_over_the_state_and_other_states_record_none(tmp_path: Path) -> None:
    assert sk.save({"step": 5, "w": torch.ones(1)}, tmp_path / "a", step=7).step == 7
    assert sk.save({"step": True, "w": torch.ones(1)}, tmp_path / "b").step is None
    assert sk.save({"step": "5", "w": torch.ones(1)}, tmp_path / "c").step is None
    assert sk.save({"w": torch.ones(1)}, tmp_path / "d").step is None


def test_two_names_of_one_step_the_padded_one_is_used(tmp_path: Path) -> None:
    root = tmp_path / "root"
    sk.save({"w": torch.ones(1)}, root / "step_100", step=100)
    sk.save({"w": torch.zeros(1)}, root / "step_00000100", step=100)
    code, out, _ = run("ls", str(root))
    assert code == 1, out
    line = next(line for line in out.splitlines() if line.startswith("step_100 "))
    assert "step_00000100" in line and "last" not in line
    entries = {entry.name: entry for entry in sk.CheckpointManager(root, read_only=True).list()}
    assert entries["step_00000100"].is_newest and entries["step_100"].misnamed
    assert torch.equal(sk.CheckpointManager(root, read_only=True).restore().state["w"], torch.zeros(1))


def test_ls_of_a_root_with_other_names_says_what_it_expects(tmp_path: Path) -> None:
    root = tmp_path / "root"
    sk.save({"w": torch.ones(1)}, root / "ckpt-100")
    (root / "step_abc").mkdir()
    code, _, err = run("ls", str(root))
    assert code == 2
    assert "step_<N>" in err and "ckpt-100" in err, err


# -- prune, help -------------------------------------------------------------------------------
def test_prune_removes_leftovers_in_a_root_without_checkpoints(tmp_path: Path) -> None:
    leftover = tmp_path / "root" / "step_00000001.tmp-0123456789abcdef0123456789abcdef"
    (leftover / "shards").mkdir(parents=True)
    (leftover / "shards" / "rank_00000.safetensors").write_bytes(b"partial")
    code, out, err = run("prune", str(tmp_path / "root"))
    assert code == 0 and leftover.exists(), (out, err)
    assert "1 leftover" in out
    code, out, err = run("prune", str(tmp_path / "root"), "--apply", "--lease", "0")
    assert code == 0, (out, err)
    assert not leftover.exists() and "removed 1 leftover" in out
    code, _, err = run("prune", str(tmp_path / "root"), "--apply", "--lease", "0")
    assert code == 2 and "no checkpoints" in err  # nothing at all left


HEX = "0123456789abcdef0123456789abcdef"


def _foreign_names(root: Path) -> list[Path]:
    """Entries a user keeps in a root whose names merely contain a marker: never leftovers."""
    root.mkdir(parents=True, exist_ok=True)
    foreign = [root / "notes.deleting-old", root / "data.tmp-v2", root / f"step_1.tmp-{HEX}x", root / f".tmp-{HEX}"]
    for path in foreign[:3]:
        (path / "sub").mkdir(parents=True)
        (path / "sub" / "precious.txt").write_text("precious")
    foreign[3].write_text("precious")
    return foreign


@pytest.mark.parametrize("with_checkpoint", [False, True])
def test_prune_removes_only_names_of_the_shapes_shardkeep_creates(tmp_path: Path, with_checkpoint: bool) -> None:
    root = tmp_path / "root"
    foreign = _foreign_names(root)
    staging = root / f"step_00000002.tmp-{HEX}"
    deleting = root / f"step_00000001.deleting-{HEX}"
    shortened = root / f"{'x' * 100}~0123456789abcdef.deleting-{HEX}"
    for path in (staging, deleting, shortened):
        (path / "shards").mkdir(parents=True)
    if with_checkpoint:
        sk.CheckpointManager(root, keep_best=0).save({"w": torch.ones(1)}, step=3)  # collects too
        assert staging.exists() and not deleting.exists() and not shortened.exists()
        assert all(path.exists() for path in foreign)
        (deleting / "shards").mkdir(parents=True)
    code, out, err = run("prune", str(root), "--lease", "3600")
    assert code == 0, (out, err)
    assert f"would remove  {deleting.name} (being deleted: removed whatever its age)" in out, out
    assert f"would wait    {staging.name} (staging: changed" in out, out
    assert not {path.name for path in foreign} & {word for line in out.splitlines() for word in line.split()}, out
    code, out, _ = run("prune", str(root), "--lease", "3600", "--json")
    document = json.loads(out)
    assert sorted(document["leftovers"]) == sorted(p.name for p in (deleting, shortened, staging) if p.exists())
    assert sorted(document["leftovers_due"]) == sorted(p.name for p in (deleting, shortened) if p.exists())
    code, out, err = run("prune", str(root), "--apply", "--lease", "0")
    assert code == 0, (out, err)
    assert not staging.exists() and not deleting.exists() and not shortened.exists()
    assert all(path.exists() for path in foreign), sorted(p.name for p in root.iterdir())


@pytest.mark.parametrize("marker", [".tmp-", ".deleting-"])
def test_save_refuses_a_name_of_the_shape_of_a_leftover(tmp_path: Path, marker: str) -> None:
    with pytest.raises(sk.UnsafePathError, match=f"step_1{marker}{HEX}"):
        sk.save({"w": torch.ones(1)}, tmp_path / f"step_1{marker}{HEX}")
    assert not list(tmp_path.iterdir())
    sk.save({"w": torch.ones(1)}, tmp_path / f"run{marker}v2")  # a marker alone is a name like any other
    assert sk.load(tmp_path / f"run{marker}v2")["w"].tolist() == [1.0]


def test_every_command_has_a_description_in_its_help() -> None:
    parser = build_parser()
    commands: Any = next(action for action in parser._actions if action.dest == "command")
    for name, sub in commands.choices.items():
        assert sub.description, name
        text = io.StringIO()
        with contextlib.redirect_stdout(text), pytest.raises(SystemExit):
            main([name, "--help"])
        assert sub.description.split()[0] in text.getvalue(), name
