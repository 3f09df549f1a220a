"""The command line: inspect, verify, ls and prune; exit codes, JSON output, and no torch import."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardkeep as sk
from conftest import flip_bit, make_state
from shardkeep.cli import main


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "step_00000007"
    sk.save(make_state(), path, step=7, epoch=1, model_id="tiny")
    return path


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_inspect_prints_a_readable_summary(checkpoint: Path) -> None:
    code, out, _ = run("inspect", str(checkpoint))
    assert code == 0
    for expected in (
        "step 7",
        "epoch 1",
        "tiny",
        "AdamW",
        "blake3",
        "tier         hot",
        "rank_00000.safetensors",
        "model.0.weight",
        "F32",
        "optim_state  optim",
    ):
        assert expected in out, expected


def test_inspect_json_is_machine_readable(checkpoint: Path) -> None:
    code, out, _ = run("inspect", str(checkpoint), "--json")
    assert code == 0
    document = json.loads(out)
    assert document["manifest"]["step"] == 7
    assert document["summary"]["tensor_count"] == sum(len(f.tensors) for f in sk.read_manifest(checkpoint).files)
    assert "F32" in document["summary"]["dtypes"]


def test_verify_exit_codes(checkpoint: Path, tmp_path: Path) -> None:
    code, out, _ = run("verify", str(checkpoint))
    assert code == 0 and out.startswith("OK")
    shard = checkpoint / "shards" / "rank_00000.safetensors"
    flip_bit(shard, shard.stat().st_size - 3, 3)  # in the data, past the header
    (checkpoint / "junk").write_text("x")
    code, out, _ = run("verify", str(checkpoint))
    assert code == 1
    assert "PROBLEM  shards/rank_00000.safetensors: digest mismatch" in out
    assert "PROBLEM  junk: extra file" in out
    code, out, _ = run("verify", str(checkpoint), "--json")
    assert code == 1 and json.loads(out)["ok"] is False and len(json.loads(out)["problems"]) == 2
    code, _, err = run("inspect", str(tmp_path / "missing"))
    assert code == 2 and "no checkpoint" in err
    code, out, _ = run("verify", str(tmp_path / "missing"))
    assert code == 1 and "no checkpoint" in out


def test_cli_does_not_import_torch_and_module_entry_point_works(checkpoint: Path) -> None:
    program = (
        "import sys\n"
        "from shardkeep.cli import main\n"
        f"a = main(['inspect', {str(checkpoint)!r}])\n"
        f"b = main(['verify', {str(checkpoint)!r}])\n"
        f"c = main(['ls', {str(checkpoint.parent)!r}])\n"
        f"d = main(['prune', {str(checkpoint.parent)!r}])\n"
        "assert (a, b, c, d) == (0, 0, 0, 0)\n"
        "assert 'torch' not in sys.modules, 'the CLI imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", program], check=True, capture_output=True)
    result = subprocess.run(
        [sys.executable, "-m", "shardkeep", "verify", str(checkpoint)], capture_output=True, text=True
    )
    assert result.returncode == 0 and "OK" in result.stdout
    result = subprocess.run([sys.executable, "-m", "shardkeep", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "inspect" in result.stdout and "verify" in result.stdout


def test_inspect_escapes_control_characters_from_the_manifest(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    sk.save({"evil\x1b[2Jkey": torch.zeros(1)}, path, model_id="m\x1b]0;title\x07")
    code, out, _ = run("inspect", str(path))
    assert code == 0
    assert "\x1b" not in out and "\x07" not in out
    assert "evil\\x1b[2Jkey" in out


@pytest.fixture
def managed_root(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    manager = sk.CheckpointManager(root, keep_last=2, keep_best=1)
    for step, loss in [(0, None), (10, 2.0), (20, 1.0), (30, 1.5), (40, 1.7)]:
        manager.save(
            {"w": torch.full((8,), float(step))}, step=step, metrics=None if loss is None else {"val_loss": loss}
        )
    return root


def test_ls_shows_steps_metrics_marks_and_state(managed_root: Path) -> None:
    code, out, _ = run("ls", str(managed_root))
    assert code == 0
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("step_")}
    assert list(lines) == ["step_00000020", "step_00000030", "step_00000040"]
    assert "best" in lines["step_00000020"] and "last" not in lines["step_00000020"]
    assert "last" in lines["step_00000040"] and " 1.7 " in lines["step_00000040"] and "ok" in lines["step_00000040"]
    assert "keep_last=2 keep_best=1 metric=val_loss" in out  # the policy recorded in the manifests
    assert "pointer last -> step_00000040  ok" in out and "pointer best -> step_00000020  ok" in out

    flip_bit(next((managed_root / "step_00000030").rglob("*.safetensors")), 130, 0)
    code, out, _ = run("ls", str(managed_root))
    assert code == 0  # a flipped bit needs --verify
    code, out, _ = run("ls", str(managed_root), "--verify")
    assert code == 1 and "CORRUPT" in next(line for line in out.splitlines() if line.startswith("step_00000030"))
    assert out.count("verified") == 2

    code, out, _ = run("ls", str(managed_root), "--json", "--keep-last", "1", "--keep-best", "0")
    document = json.loads(out)
    assert [c["step"] for c in document["checkpoints"]] == [20, 30, 40]
    assert [c["prunable"] for c in document["checkpoints"]] == [True, True, False]
    assert document["policy"]["keep_last"] == 1 and document["run"]


def test_prune_is_a_dry_run_unless_applied(managed_root: Path) -> None:
    before = sorted(p.name for p in managed_root.iterdir())
    code, out, _ = run("prune", str(managed_root), "--keep-last", "1", "--keep-best", "0")
    assert code == 0 and "would delete  step_00000020" in out and "dry run" in out
    assert sorted(p.name for p in managed_root.iterdir()) == before
    code, out, _ = run("prune", str(managed_root), "--keep-last", "1", "--keep-best", "0", "--apply")
    assert code == 0 and "deleted 2 checkpoint(s)" in out
    assert sorted(p.name for p in managed_root.iterdir()) == ["last", "step_00000040"]
    code, _, err = run("prune", str(managed_root / "missing"))
    assert code == 2 and "does not exist" in err
    with pytest.raises(SystemExit):
        run("prune", str(managed_root), "--keep-last", "-1")
