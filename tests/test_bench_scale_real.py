"""``bench/scale.py --real``: the simulator's collective steps agree with 4 real gloo ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_real_ranks_run_the_collectives_the_simulator_predicts(tmp_path: Path) -> None:
    output = tmp_path / "real.json"
    environment = {**os.environ, "PYTHONPATH": str(REPOSITORY / "src")}
    arguments = ["--src", "worktree", "--real", "4", "--workloads", "tiny-dense", "--real-timeout", "240"]
    finished = subprocess.run(
        [sys.executable, str(REPOSITORY / "bench" / "scale.py"), *arguments, "--json", str(output)],
        capture_output=True,
        text=True,
        env=environment,
        timeout=280,
        check=False,
    )
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    (point,) = json.loads(output.read_text())["real"]
    assert point["ok"] and point["save"]["counts_agree"] and point["save"]["order_agrees"]
    assert point["load"]["real_collectives"] == 0
    kinds = {(row["label"], row["kind"]) for row in point["save"]["steps"]}
    assert ("commit the checkpoint", "broadcast") in kinds
    for row in point["save"]["steps"]:
        assert row["real"]["count"] == row["simulated"]["count"] >= 1
