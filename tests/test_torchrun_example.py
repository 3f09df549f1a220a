"""The distributed example runs under torchrun with 2 ranks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
