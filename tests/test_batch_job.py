"""The ledger example end to end: a 4-worker spawned job where one worker is killed with SIGKILL;
on restart its shard resumes from its last recorded batch, and the output equals a run with no
crash."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import shardkeep as sk

pytestmark = pytest.mark.slow  # worker processes killed and resumed

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "batch_job.py"
SIZES = ["--workers", "4", "--batches", "8", "--batch-size", "16", "--delay", "0.05", "--kill-after", "3"]


def run_job(out: Path, *extra: str) -> tuple[str, dict[str, Any]]:
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--out", str(out), *SIZES, *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout, json.loads((out / "summary.json").read_text())


def test_killed_worker_resumes_from_its_last_recorded_batch(tmp_path: Path) -> None:
    stdout, summary = run_job(tmp_path / "crash")
    assert summary["killed"] == {"worker": 2, "exit_code": -9}
    assert "driver: killed worker 2 with SIGKILL after it recorded batch" in stdout
    resume = summary["resume"]
    assert list(resume) == ["2"]  # only the killed worker's shard had work left
    assert 4 <= resume["2"] < 8
    assert f"driver: shard 2 resumes from batch {resume['2']} on worker 2" in stdout
    assert f"worker 2: shard 2 from batch {resume['2']}" in stdout
    for shard in (0, 1, 3):
        assert f"worker {shard}: shard {shard} from batch 0" in stdout
        assert f"worker {shard}: shard {shard} from batch" not in stdout.split("phase 2")[1]
    assert "failed               " in stdout and "error: worker 2 died with signal 9" in stdout
    assert summary["matches"] is True
    assert summary["batches"] == 32 and summary["sequences"] == 512 and summary["completed"] == 4

    ledger = sk.ProgressLedger(tmp_path / "crash" / "progress.json")
    shard_2 = ledger.shard_status(2)
    assert shard_2 is not None
    assert [record["batch_idx"] for record in shard_2["checkpoints"]] == list(range(8))  # each batch once
    assert shard_2["retry_count"] == 1
    assert (tmp_path / "crash" / "archive" / "progress_final.json").is_file()
    assert sk.verify(tmp_path / "crash" / "final").ok
    # The merged output equals the same computation with no crash (done by the example in one
    # process, without workers or ledger).
    assert summary["digest"] == summary["reference_digest"]


def test_killed_workers_shard_can_move_to_a_healthy_worker(tmp_path: Path) -> None:
    stdout, summary = run_job(tmp_path / "job", "--reassign")
    assert summary["reassigned"] == {"2": 0}
    assert "driver: reassigned shard 2 to worker 0 (original rank stays 2)" in stdout
    assert f"driver: shard 2 resumes from batch {summary['resume']['2']} on worker 0" in stdout
    assert f"worker 0: shard 2 from batch {summary['resume']['2']}" in stdout
    assert "reassigned 2->0" in stdout
    assert summary["matches"] is True
    status = sk.ProgressLedger(tmp_path / "job" / "progress.json").shard_status(2)
    assert status is not None
    assert (status["original_rank"], status["assigned_rank"], status["status"]) == (2, 0, "complete")


@pytest.mark.parametrize("bad", [["--kill-worker", "9"], ["--kill-after", "7"]])
def test_bad_arguments_are_refused(tmp_path: Path, bad: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--out", str(tmp_path / "x"), *SIZES, *bad], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert "--kill-worker must be a worker" in result.stderr


def test_a_non_empty_output_directory_it_did_not_make_is_refused_and_kept(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    (mine / "data").mkdir(parents=True)
    (mine / "notes.txt").write_text("keep me")
    (mine / "data" / "results.csv").write_text("1,2,3")
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--out", str(mine), *SIZES], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "is not empty" in result.stderr and "nothing was deleted" in result.stderr and "--force" in result.stderr
    assert sorted(str(p.relative_to(mine)) for p in mine.rglob("*")) == ["data", "data/results.csv", "notes.txt"]
    assert "phase 1" not in result.stdout


def test_its_own_output_directory_is_reused_and_force_takes_any(tmp_path: Path) -> None:
    small = ["--workers", "2", "--batches", "2", "--batch-size", "4", "--delay", "0", "--no-kill"]
    small += ["--kill-worker", "0", "--kill-after", "0"]

    def job(out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, str(EXAMPLE), "--out", str(out), *small, *extra]
        return subprocess.run(command, capture_output=True, text=True, timeout=300)

    first = job(tmp_path / "job")
    assert first.returncode == 0, first.stdout + first.stderr
    assert (tmp_path / "job" / ".shardkeep-example-output").read_text().startswith("made by batch_job.py")
    again = job(tmp_path / "job")  # the directory it made: emptied and reused, a fresh ledger
    assert again.returncode == 0, again.stdout + again.stderr
    assert json.loads((tmp_path / "job" / "summary.json").read_text())["matches"] is True

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("not needed any more")
    forced = job(mine, "--force")
    assert forced.returncode == 0, forced.stdout + forced.stderr
    assert not (mine / "notes.txt").exists() and (mine / "summary.json").is_file()
