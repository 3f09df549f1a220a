"""examples/quickstart.py (the single-process tour) runs end to end, with warnings as errors,
and never deletes a directory it did not make."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the example script, run in subprocesses

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "quickstart.py"
MARKER = ".shardkeep-example-output"


def quickstart(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run the example with every warning an error, in it and in the `shardkeep` commands it runs."""
    return subprocess.run(
        [sys.executable, "-W", "error", str(EXAMPLE), *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env={**os.environ, "PYTHONWARNINGS": "error"},
    )


def user_directory(path: Path) -> Path:
    path.mkdir()
    (path / "thesis.tex").write_text("years of work")
    (path / "data").mkdir()
    (path / "data" / "results.csv").write_text("1,2,3")
    return path


def test_quickstart_runs_and_reports_every_step(tmp_path: Path) -> None:
    result = quickstart("--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Warning" not in result.stderr, result.stderr
    assert "weights identical after load: True" in result.stdout
    assert "PROBLEM  shards/rank_00000.safetensors: digest mismatch" in result.stdout
    assert "quickstart finished" in result.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        MARKER,
        "managed",
        "step_00000050",
        "step_00000050-damaged",
    ]
    assert "restored step 30; skipped ['step_00000040']" in result.stdout
    assert sorted(p.name for p in (tmp_path / "out" / "managed").iterdir()) == [
        "best",
        "last",
        "step_00000020",
        "step_00000030",
        "step_00000040",
    ]

    # A second run into the directory the first one made (and marked) empties and reuses it.
    (tmp_path / "out" / "stray.txt").write_text("left by the first run's user")
    again = quickstart("--out", str(tmp_path / "out"))
    assert again.returncode == 0, again.stdout + again.stderr
    assert "quickstart finished" in again.stdout
    assert not (tmp_path / "out" / "stray.txt").exists()


def test_a_non_empty_directory_it_did_not_make_is_refused_and_kept(tmp_path: Path) -> None:
    mine = user_directory(tmp_path / "mine")
    before = sorted(str(p.relative_to(mine)) for p in mine.rglob("*"))
    result = quickstart("--out", str(mine))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "is not empty" in result.stderr and "nothing was deleted" in result.stderr and "--force" in result.stderr
    assert sorted(str(p.relative_to(mine)) for p in mine.rglob("*")) == before
    assert (mine / "thesis.tex").read_text() == "years of work"
    assert "=== 1." not in result.stdout  # refused before doing anything


def test_force_empties_a_directory_it_did_not_make(tmp_path: Path) -> None:
    mine = user_directory(tmp_path / "mine")
    result = quickstart("--out", str(mine), "--force")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "quickstart finished" in result.stdout
    assert not (mine / "thesis.tex").exists() and not (mine / "data").exists()
    assert (mine / MARKER).is_file() and (mine / "step_00000050").is_dir()


@pytest.mark.parametrize("where", ["cwd", "parent_of_cwd", "symlink", "file"])
def test_what_even_force_does_not_delete(tmp_path: Path, where: str) -> None:
    mine = user_directory(tmp_path / "mine")
    work = mine / "data"
    out = {"cwd": mine / "data", "parent_of_cwd": mine, "symlink": tmp_path / "link", "file": mine / "thesis.tex"}[
        where
    ]
    if where == "symlink":
        out.symlink_to(mine)
    result = quickstart("--out", str(out), "--force", cwd=work)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "nothing was deleted" in result.stderr
    assert (mine / "thesis.tex").read_text() == "years of work"
    assert (mine / "data" / "results.csv").read_text() == "1,2,3"
