"""The distributed examples: distributed_save.py under torchrun with 2 ranks, and train_moe.py
under torchrun and under its own launcher (what it prints when its output is not a terminal)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import shardkeep as sk

pytestmark = pytest.mark.slow  # real training runs under torchrun and the own launcher

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "distributed_save.py"


def test_torchrun_two_ranks_save_async_save_and_reload(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(EXAMPLE),
        "--out",
        str(tmp_path / "out"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "reloaded into a fresh model on every rank: OK" in result.stdout
    assert "loaded without a process group: model.w1 [64, 32], step 4" in result.stdout
    assert "verify: OK" in result.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".shardkeep-example-output", "step_a", "step_b"]


def _losses(output: str) -> dict[int, str]:
    return {
        int(line.split()[3].rstrip(":")): line.split()[4]
        for line in output.splitlines()
        if line.startswith("loss at step ")
    }


def test_distributed_save_resumes_where_the_run_left_off(tmp_path: Path) -> None:
    """A first run trains steps 1-5 (step_a at 3, step_b at 4); --resume loads step_b into a
    model with other weights and trains steps 5 and 6: step 5's loss is the first run's, to the
    last printed digit (weights and AdamW moments restored exactly)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(EXAMPLE)]
    out = tmp_path / "out"
    first = subprocess.run([*command, "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    resumed = subprocess.run(
        [*command, "--out", str(out), "--resume", "--steps", "2"], capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from step_b at step 4 on 2 ranks" in resumed.stdout
    before, after = _losses(first.stdout), _losses(resumed.stdout)
    assert sorted(before) == [1, 2, 3, 4, 5] and sorted(after) == [5, 6]
    assert after[5] == before[5]
    assert "saved step_00000006; verify: OK" in resumed.stdout
    assert sk.read_manifest(out / "step_00000006").step == 6
    empty = tmp_path / "empty"
    empty.mkdir()
    refused = subprocess.run([*command, "--out", str(empty), "--resume"], capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "not an output of distributed_save.py" in refused.stderr


def test_distributed_save_refuses_a_directory_it_did_not_make(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(EXAMPLE)]
    result = subprocess.run([*command, "--out", str(mine)], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "nothing was deleted" in result.stderr
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (mine / "notes.txt").read_text() == "keep me"


@pytest.mark.timeout(400)
def test_train_moe_under_torchrun_checkpoints_with_two_tiers(tmp_path: Path) -> None:
    example = EXAMPLE.parent / "train_moe.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(example)]
    command += ["--root", str(tmp_path), "--steps", "6", "--every", "3"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    events = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "save"] == [3, 6]
    assert events[-1] == {"event": "done", "step": 6, "world_size": 2}
    manifest = sk.read_manifest(tmp_path / "ckpts" / "step_00000006")
    assert manifest.world_size == 2
    tiers = {entry.key: record.tier for record, entry in manifest.iter_tensors()}
    assert tiers["model.blocks.0.moe.router.weight"] == "hot"
    assert tiers["model.blocks.0.moe.experts.w_in"] == "cold"
    assert {tier for key, tier in tiers.items() if key.startswith("optimizer.")} == {"cold"}
    assert sk.verify(tmp_path / "ckpts" / "step_00000006").ok


@pytest.mark.timeout(400)
def test_train_moe_prints_plain_progress_through_a_pipe_and_says_it_resumed(tmp_path: Path) -> None:
    """Output captured through a pipe (not a terminal): plain lines, no progress bar."""
    example = EXAMPLE.parent / "train_moe.py"
    command = [sys.executable, str(example), "--root", str(tmp_path), "--every", "3", "--print-every", "2"]
    first = subprocess.run([*command, "--nproc", "2", "--steps", "6"], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    lines = first.stdout.splitlines()
    assert lines[0] == "training from step 1 on 2 ranks; a checkpoint every 3 steps"
    assert [line.split()[1] for line in lines if line.startswith("step ")] == ["2/6", "4/6", "6/6"]
    saves = [line for line in lines if line.startswith("save of step")]
    assert len(saves) == 2 and saves[0].startswith("save of step 3 started: val_loss")
    assert lines[-1] == "done: step 6 on 2 ranks; the last save committed"
    assert "it/s" not in first.stderr  # no tqdm bar

    again = subprocess.run([*command, "--nproc", "3", "--steps", "9"], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    lines = again.stdout.splitlines()
    assert "resumed from step 6 (step_00000006, saved on 2 ranks), now on 3 ranks; skipped: none" in lines
    assert [line.split()[1] for line in lines if line.startswith("step ")] == ["8/9", "9/9"]
    assert any(line.startswith("save of step 9 started") for line in lines)
    assert "it/s" not in again.stderr
