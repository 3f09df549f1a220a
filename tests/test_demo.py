"""The README's main-job command (`make demo` = examples/demo.py), run small: a 2-rank MoE run
killed with SIGKILL in the middle of an async save, resumed on 3 ranks (with each rank's reads
measured), loaded from the hot tier only, inspected, corrupted and restored from the previous
checkpoint; then a two-level run on 2 nodes x 2 ranks (network namespaces as root, else
simulated nodes) that loses a node with its disk and resumes from the peer replicas, and is
preempted with SIGTERM and resumes from the emergency save. Checks what it prints and what it
writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import shardkeep as sk
from tests.support.netns import probe

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]  # the subprocess timeouts below fire first
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
Demo = tuple[Path, str, dict[str, Any]]  # the work directory, what it printed, demo_summary.json


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Demo:
    """The demo without --workdir: it makes a fresh directory under the temporary directory."""
    temporary = tmp_path_factory.mktemp("tmpdir")
    command = [sys.executable, str(EXAMPLES / "demo.py"), "--steps", "30", "--every", "10", "--kill-at", "30"]
    env = {**os.environ, "TMPDIR": str(temporary)}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    (workdir,) = temporary.glob("shardkeep-demo-*")
    assert workdir.name.startswith("shardkeep-demo-") and f"shardkeep demo in {workdir}:" in result.stdout
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    return workdir, result.stdout, json.loads((workdir / "demo_summary.json").read_text())


def test_the_killed_run_resumes_on_three_ranks_from_the_newest_verified_checkpoint(demo: Demo) -> None:
    workdir, out, summary = demo
    assert summary["ok"] is True and all(check["ok"] for check in summary["checks"].values())
    assert list(summary["checks"]) == ["kill", "invisible", "resume", "cleanup", "reads", "loss", "hot_tier", "cli",
                                       "fallback", "plot", "node_loss", "preemption"]  # fmt: skip
    # Rank 1 was killed inside the save of step 30: the resume is from the save before it.
    assert summary["killed_save_step"] == 30 and summary["killed_after_step"] >= 30
    assert summary["newest_before_restart"] == summary["resume_step"] == 20
    assert summary["resume_world_sizes"] == [2, 3]
    assert summary["resume_skipped"] == []  # the half-written save was never a candidate
    assert f"resumed from step {summary['resume_step']} saved by 2 ranks, now on 3 ranks" in out
    events = [json.loads(line) for line in (workdir / "train_log.jsonl").read_text().splitlines()]
    resume = next(e for e in events if e["event"] == "resume")
    assert (resume["step"], resume["from_world_size"], resume["world_size"]) == (summary["resume_step"], 2, 3)
    assert [e["step"] for e in events if e["event"] == "step" and e["world_size"] == 3] == list(
        range(summary["resume_step"] + 1, 31)
    )


def test_the_save_killed_midway_is_invisible_and_cleaned_up(demo: Demo) -> None:
    workdir, out, summary = demo
    staging = summary["staging_dir"]
    assert staging.startswith("step_00000030.tmp-")
    # After the kill: the staging directory, and nothing under the checkpoint's name.
    assert summary["staging_after_kill"] == [staging]
    assert f"sk.read_manifest({staging}) -> CheckpointNotFoundError" in out
    assert "committed checkpoints (manager.list, verified): step_00000010, step_00000020\n" in out
    # After the resumed run: its manager removed the staging directory (a 2 s lease) ...
    assert summary["staging_after_resume"] == []
    assert not [p for p in (workdir / "ckpts").iterdir() if ".tmp-" in p.name]
    # ... and the files the killed save wrote to the cold tier, under the attempt id that is the
    # staging directory's: nothing in the cold tier is left that no manifest lists.
    assert summary["cold_orphans_after_resume"] == {}
    attempt = "attempt-" + staging.partition(".tmp-")[2][:16]
    assert not (workdir / "cold-tier" / "step_00000030" / attempt).exists()


def test_each_ranks_reads_are_measured_and_limited_to_the_blocks_it_needs(demo: Demo) -> None:
    _, out, summary = demo
    reads = summary["reads"]
    whole = reads["data_bytes"]
    assert reads["checkpoint"] == "step_00000020" and reads["saved_world_size"] == 2
    assert [rank["rank"] for rank in reads["ranks"]] == [0, 1, 2]
    for rank in reads["ranks"]:
        # A rank reads at least its own rows and never more than the saved chunks overlapping
        # them (what a checkpoint without block digests costs), plus the files' headers.
        assert rank["own_rows_bytes"] <= rank["data_bytes"] <= rank["needed_chunk_bytes"] + rank["header_bytes_at_most"]
        assert rank["local_file_bytes"] == rank["data_bytes"] + rank["other_bytes"]  # a local cold tier
        assert rank["kernel_rchar"] is not None and rank["kernel_rchar"] >= rank["local_file_bytes"]
        assert 0.3 * whole < rank["own_rows_bytes"] < 0.36 * whole
    first, middle, last = (rank["data_bytes"] for rank in reads["ranks"])
    # Whole chunks would be about half of the checkpoint for ranks 0 and 2, and all of it for
    # rank 1, whose rows straddle the 2-rank split of every tensor. With block digests (local
    # files: no read gap) each reads its own rows and the rest of the blocks they touch.
    assert [rank["needed_chunk_bytes"] > 0.95 * whole for rank in reads["ranks"]] == [False, True, False]
    assert first < 0.5 * whole and last < 0.5 * whole and middle < 0.6 * whole
    assert first + middle + last < 1.5 * whole  # whole chunks: about 2x
    assert 0.97 * whole < sum(rank["own_rows_bytes"] for rank in reads["ranks"]) <= whole
    assert "measured: right after its restore, each rank loaded the checkpoint once more with mmap=False" in out
    assert "only the blocks that hold" in out


def test_the_loss_curve_continues(demo: Demo) -> None:
    _, out, summary = demo
    repeated = summary["repeated_steps"]
    assert repeated[0] == summary["resume_step"] + 1 and repeated[-1] >= 30
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
    assert "saves blocked training" in out and "the kill and the resume marked" in out
    assert [step for step, _ in summary["plot_events"]] == [30, 20]


def test_a_lost_node_resumes_from_the_replicas_at_the_newest_local_step(demo: Demo) -> None:
    _, out, summary = demo
    loss = summary["node_loss"]
    expected = "netns" if probe() is None else "simulated"
    assert loss["nodes"] == expected  # where namespaces can be made, they are used: a failure is not hidden
    marker = "real network namespaces" if expected == "netns" else "simulated nodes"
    assert f"  nodes: {marker}" in out
    # Killed after step 17: the newest local step is 16, the newest persisted 10.
    assert loss["killed_after_step"] >= 17 and loss["newest_local_step"] == loss["resume_step"] == 16
    assert loss["newest_persisted_step"] == 10 and loss["levels_read"] == ["local"]
    assert {source for _, _, source in loss["healed"]} == {"local@node0"}
    assert {int(rank) for rank, _, _ in loss["healed"]} == {2, 3}  # node 1's ranks
    # node 1's own files, written by ranks 2 and 3, came back from node 0's replicas
    assert {"rank_00002", "rank_00003"} <= {name.split("/")[-1][:10] for _, name, _ in loss["healed"]}
    assert loss["steps_lost"] == loss["killed_after_step"] - 16
    assert loss["steps_lost_single_level"] == loss["killed_after_step"] - 10
    assert "PASS  node 1 lost with its disk: resumed at the newest local step 16 from node 0's replicas" in out


def test_sigterm_takes_an_emergency_save_and_the_restart_resumes_from_it(demo: Demo) -> None:
    workdir, out, summary = demo
    preemption = summary["preemption"]
    assert preemption["exit_codes"] == [75, 75, 75, 75] and preemption["exit_codes_after"] == [0, 0, 0, 0]
    emergency = preemption["emergency_step"]
    assert emergency >= preemption["signaled_at_step"] >= 25
    assert preemption["resume_step"] == emergency and preemption["resumed_steps"] == [emergency + 1, 32]
    assert f"preemption: emergency checkpoint step_{emergency:08d} committed on level 'local'" in out
    assert Path(summary["levels_plot"]).read_bytes().startswith(PNG_SIGNATURE)
    marks = [step for step, _ in summary["levels_plot_events"]]
    assert marks == [summary["node_loss"]["killed_after_step"], 16, emergency]
    # The persistent level is an ordinary checkpoint root; every copy verifies.
    persistent = workdir / "levels" / "persistent"
    names = sorted(p.name for p in persistent.iterdir() if p.name.startswith("step_") and ".tmp-" not in p.name)
    assert names and all(sk.verify(persistent / name).ok for name in names)


def test_the_workdir_must_be_new_or_empty(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "train_log.jsonl").write_text("not the demo's\n")  # an earlier version took this as its own
    command = [sys.executable, str(EXAMPLES / "demo.py"), "--workdir", str(mine)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "nothing was deleted" in result.stderr
    assert [p.name for p in mine.iterdir()] == ["train_log.jsonl"]
    assert (mine / "train_log.jsonl").read_text() == "not the demo's\n"


def test_the_demo_with_the_cold_tier_on_s3(tmp_path: Path) -> None:
    """`make demo DEMO_ARGS=--s3`: the cold tier in a bucket of a local SeaweedFS server (steps 1
    to 8 only: steps 9 and 10 do not use the cold tier, and the whole demo runs above)."""
    workdir = tmp_path / "run"
    command = [sys.executable, str(EXAMPLES / "demo.py"), "--workdir", str(workdir), "--s3", "--no-levels"]
    command += ["--steps", "20", "--every", "10", "--kill-at", "20"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    summary = json.loads((workdir / "demo_summary.json").read_text())
    assert summary["ok"] and summary["resume_step"] == 10 and summary["restored_step"] == 10
    assert "node_loss" not in summary["checks"] and "preemption" not in summary["checks"]
    manifest = sk.read_manifest(workdir / "ckpts" / "step_00000010")
    (cold,) = [tier.location for tier in manifest.tiers if tier.name == "cold"]
    assert cold is not None and cold.startswith("s3://")
    assert not (workdir / "cold-tier").exists()
