"""examples/quickstart.py (the single-process tour) runs end to end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "quickstart.py"


def test_quickstart_runs_and_reports_every_step(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "weights identical after load: True" in result.stdout
    assert "PROBLEM  shards/rank_00000.safetensors: digest mismatch" in result.stdout
    assert "quickstart finished" in result.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["managed", "step_00000050", "step_00000050-damaged"]
    assert "restored step 30; skipped ['step_00000040']" in result.stdout
    assert sorted(p.name for p in (tmp_path / "out" / "managed").iterdir()) == [
        "best",
        "last",
        "step_00000020",
        "step_00000030",
        "step_00000040",
    ]
