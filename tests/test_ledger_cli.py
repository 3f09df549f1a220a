"""``shardkeep ledger status`` and ``shardkeep ledger reassign``."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardkeep.cli import main
from shardkeep.ledger import ProgressLedger


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def ledger(tmp_path: Path) -> ProgressLedger:
    ledger = ProgressLedger(tmp_path / "progress.json", 4)
    ledger.initialize(input_fingerprint="sha256:in", model_config_hash="cfg")
    (tmp_path / "b.bin").write_bytes(b"x")
    for batch in range(3):
        ledger.update_shard_checkpoint(0, batch, 100, "b.bin")
    ledger.update_shard_checkpoint(1, 0, 50, "b.bin")
    ledger.mark_shard_complete(1)
    ledger.update_shard_checkpoint(2, 0, 10, "b.bin")
    for attempt in range(3):
        ledger.mark_shard_failed(2, f"CUDA error {attempt}")
    ledger.record_global_checkpoint("barrier_1", {0: 2, 1: 0})
    return ledger


def test_status_prints_a_table_with_totals_and_markers(ledger: ProgressLedger) -> None:
    code, out, _ = run("ledger", "status", str(ledger.path))
    assert code == 0
    lines = out.splitlines()
    assert "sequence 11" in lines[0]  # initialize + 10 changes
    assert "input sha256:in   model cfg" in lines[1]
    assert lines[2].split() == [
        "SHARD", "ORIG", "WORKER", "STATUS", "LAST", "BATCH", "BATCHES", "SEQUENCES", "AGE", "RETRIES", "MARKS", "/", "ERROR"
    ]  # fmt: skip
    rows = {int(line.split()[0]): line for line in lines[3:7]}
    assert rows[0].split()[:8] == ["0", "0", "0", "in_progress", "2", "3", "300", "0s"]
    assert rows[1].split()[3] == "complete"
    assert "ORPHANED error: CUDA error 2" in rows[2]
    assert rows[3].split()[4:6] == ["-", "0"]
    assert lines[7] == (
        "total   4 shards: 1 complete, 2 in progress, 1 failed; 0 stale, 1 orphaned; 5 batches, 360 sequences"
    )
    assert lines[8].startswith("barrier barrier_1 at ")


def test_status_marks_stale_shards_with_a_threshold(ledger: ProgressLedger) -> None:
    code, out, _ = run("ledger", "status", str(ledger.path), "--stale-after", "0.000001")
    assert code == 0
    rows = {int(line.split()[0]): line for line in out.splitlines()[3:7]}
    assert rows[0].rstrip().endswith("STALE")
    assert "STALE" not in rows[3]  # no batch yet: not stale
    assert "1 stale" in out
    _, out, _ = run("ledger", "status", str(ledger.path), "--max-retries", "4")
    assert "ORPHANED" not in out


def test_status_json(ledger: ProgressLedger) -> None:
    code, out, _ = run("ledger", "status", str(ledger.path), "--json")
    assert code == 0
    document = json.loads(out)
    assert document["progress"]["orphaned_shards"] == [2]
    assert document["ledger"]["shards"]["0"]["last_checkpoint_batch"] == 2
    assert document["ledger"]["version"] == "2.0"


def test_reassign(ledger: ProgressLedger) -> None:
    code, out, _ = run("ledger", "reassign", str(ledger.path), "2", "3")
    assert code == 0
    assert out == "shard 2 (original rank 2): worker 2 -> 3\n"
    status = ledger.shard_status(2)
    assert status is not None
    assert (status["original_rank"], status["assigned_rank"], status["status"]) == (2, 3, "in_progress")
    _, out, _ = run("ledger", "status", str(ledger.path))
    assert "reassigned 2->3" in out
    code, _, err = run("ledger", "reassign", str(ledger.path), "1", "0")
    assert code == 2
    assert "shard 1 is complete" in err
    code, _, err = run("ledger", "reassign", str(ledger.path), "7", "0")
    assert code == 2
    assert "unknown shard 7" in err


def test_unreadable_ledgers_exit_2_with_the_reason(tmp_path: Path, ledger: ProgressLedger) -> None:
    code, _, err = run("ledger", "status", str(tmp_path / "missing.json"))
    assert code == 2
    assert "no progress ledger" in err
    for copy in (ledger.path, ledger.backup_path):
        copy.write_bytes(b"{garbage")
    code, _, err = run("ledger", "status", str(ledger.path))
    assert code == 2
    assert "no valid copy" in err


def test_a_directory_is_named_as_one_with_the_file_expected_in_it(tmp_path: Path, ledger: ProgressLedger) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out, err = run("ledger", "status", str(empty))
    assert (code, out) == (2, "")
    assert f"{empty} is a directory; a progress ledger is a JSON file" in err
    assert f"e.g. {empty / 'progress.json'}" in err
    assert "corrupted" not in err
    code, _, err = run("ledger", "status", str(tmp_path))  # the job's directory instead of its ledger
    assert code == 2
    assert f"did you mean {ledger.path}?" in err
    code, _, err = run("ledger", "reassign", str(tmp_path), "2", "3")
    assert code == 2
    assert "is a directory" in err
    assert not Path(f"{tmp_path}.lock").exists()  # no lock file created next to the directory
    assert ledger.shard_status(2)["assigned_rank"] == 2  # type: ignore[index]


def test_help_and_no_torch(ledger: ProgressLedger) -> None:
    program = (
        "import sys\n"
        "from shardkeep.cli import main\n"
        f"code = main(['ledger', 'status', {str(ledger.path)!r}])\n"
        "assert 'torch' not in sys.modules\n"
        "sys.exit(code)\n"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    result = subprocess.run([sys.executable, "-m", "shardkeep", "ledger", "--help"], capture_output=True, text=True)
    assert "status" in result.stdout and "reassign" in result.stdout
