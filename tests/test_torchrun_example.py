"""The distributed example runs under torchrun with 2 ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import shardkeep as sk

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
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["step_a", "step_b"]


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
