"""The README's main-job command (`make demo` = examples/demo.py), run small: a 2-rank MoE run
killed with SIGKILL, resumed on 3 ranks, loaded from the hot tier only, inspected, corrupted and
restored from the previous checkpoint. Checks what it prints and what it writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import shardkeep as sk

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
pytestmark = pytest.mark.timeout(900)  # the subprocess timeouts below fire first
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
Demo = tuple[Path, str, dict[str, Any]]  # the work directory, what it printed, demo_summary.json


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Demo:
    workdir = tmp_path_factory.mktemp("demo") / "run"
    command = [sys.executable, str(EXAMPLES / "demo.py"), "--workdir", str(workdir)]
    command += ["--steps", "30", "--every", "10", "--kill-at", "25"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    return workdir, result.stdout, json.loads((workdir / "demo_summary.json").read_text())


def test_the_killed_run_resumes_on_three_ranks_from_the_newest_verified_checkpoint(demo: Demo) -> None:
    workdir, out, summary = demo
    assert summary["ok"] is True and all(check["ok"] for check in summary["checks"].values())
    assert summary["killed_after_step"] >= 25
    # The demo kills once the save of step 20 has committed.
    assert summary["newest_before_restart"] == summary["resume_step"] == 20
    assert summary["resume_world_sizes"] == [2, 3]
    assert f"resumed from step {summary['resume_step']} saved by 2 ranks, now on 3 ranks" in out
    events = [json.loads(line) for line in (workdir / "train_log.jsonl").read_text().splitlines()]
    resume = next(e for e in events if e["event"] == "resume")
    assert (resume["step"], resume["from_world_size"], resume["world_size"]) == (summary["resume_step"], 2, 3)
    assert [e["step"] for e in events if e["event"] == "step" and e["world_size"] == 3] == list(
        range(summary["resume_step"] + 1, 31)
    )


def test_the_loss_curve_continues(demo: Demo) -> None:
    _, out, summary = demo
    repeated = summary["repeated_steps"]
    assert repeated[0] == summary["resume_step"] + 1 and repeated[-1] >= 25
    assert summary["max_loss_difference"] < 1e-3
    assert "PASS  loss" in out


def test_hot_tier_only_and_a_one_process_load(demo: Demo) -> None:
    _, out, summary = demo
    assert sorted(summary["hot_missing"]) == [f"blocks.{i}.moe.experts.{w}" for i in (0, 1) for w in ("w_in", "w_out")]
    assert abs(summary["one_process_val_loss"] - summary["recorded_val_loss"]) < 1e-4
    assert "the cold tier is offline" in out


def test_verify_catches_the_flipped_byte_and_restore_falls_back(demo: Demo) -> None:
    workdir, out, summary = demo
    assert summary["verify_before"] == 0 and summary["verify_after"] == 1
    assert summary["corrupted"] == "step_00000030" and summary["skipped"] == ["step_00000030"]
    assert summary["restored_step"] == 20
    assert "digest mismatch (file is corrupt)" in out and "FAILED  " in out
    assert not sk.verify(workdir / "ckpts" / "step_00000030").ok
    assert sk.verify(workdir / "ckpts" / "step_00000020").ok
    # the files the demo leaves: the two kept checkpoints, both tiers, the log and the plot
    assert sorted(p.name for p in (workdir / "ckpts").iterdir() if p.name.startswith("step_")) == [
        "step_00000020",
        "step_00000030",
    ]
    assert sorted(p.name for p in (workdir / "cold-tier").iterdir()) == ["step_00000020", "step_00000030"]
    assert Path(summary["plot"]).read_bytes().startswith(PNG_SIGNATURE)
    assert "saves blocked training" in out


def test_the_demo_with_the_cold_tier_on_s3(tmp_path: Path) -> None:
    """`make demo DEMO_ARGS=--s3`: the cold tier in a bucket of a local SeaweedFS server."""
    workdir = tmp_path / "run"
    command = [sys.executable, str(EXAMPLES / "demo.py"), "--workdir", str(workdir), "--s3"]
    command += ["--steps", "20", "--every", "10", "--kill-at", "15"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    summary = json.loads((workdir / "demo_summary.json").read_text())
    assert summary["ok"] and summary["resume_step"] == 10 and summary["restored_step"] == 10
    manifest = sk.read_manifest(workdir / "ckpts" / "step_00000010")
    (cold,) = [tier.location for tier in manifest.tiers if tier.name == "cold"]
    assert cold is not None and cold.startswith("s3://")
    assert not (workdir / "cold-tier").exists()
