"""``bench/scale.py --real``: the simulator's collective steps agree with 4 real gloo ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPOSITORY = Path(__file__).resolve().parent.parent


def _scale(output: Path, arguments: list[str], **environment: str) -> Any:
    """``bench/scale.py ARGUMENTS --json OUTPUT`` run to its end: what it wrote."""
    finished = subprocess.run(
        [sys.executable, str(REPOSITORY / "bench" / "scale.py"), *arguments, "--json", str(output)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPOSITORY / "src"), **environment},
        timeout=280,
        check=False,
    )
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    return json.loads(output.read_text())


@pytest.mark.slow
def test_real_ranks_run_the_collectives_the_simulator_predicts(tmp_path: Path) -> None:
    arguments = ["--src", "worktree", "--real", "4", "--workloads", "tiny-dense", "--real-timeout", "240"]
    (point,) = _scale(tmp_path / "real.json", arguments)["real"]
    assert point["ok"] and point["save"]["counts_agree"] and point["save"]["order_agrees"]
    assert point["load"]["real_collectives"] == 0
    kinds = {(row["label"], row["kind"]) for row in point["save"]["steps"]}
    assert ("commit the checkpoint", "broadcast") in kinds
    for row in point["save"]["steps"]:
        assert row["real"]["count"] == row["simulated"]["count"] >= 1


def _point(tmp_path: Path, name: str, pack: bool) -> dict[str, object]:
    arguments = ["--src", "worktree", "--workloads", "tiny-tp-fsdp", "--ranks", "8", "--reps", "1"]
    found = _scale(tmp_path / f"{name}.json", arguments, SHARDKEEP_SCALE_PACK="1" if pack else "0")
    points = [value for value in _walk(found) if isinstance(value, dict) and "manifest_bytes" in value]
    assert len(points) == 1, json.dumps(found)[:2000]
    return points[0]


def _walk(value: object) -> list[object]:
    found = [value]
    if isinstance(value, dict):
        for item in value.values():
            found.extend(_walk(item))
    elif isinstance(value, list):
        for item in value:
            found.extend(_walk(item))
    return found


@pytest.mark.slow
def test_packed_indexes_change_no_figure_but_the_times(tmp_path: Path) -> None:
    """``SHARDKEEP_SCALE_PACK=1`` (the 16,384-rank runs) keeps the simulated rank indexes
    compressed in memory: every byte count, of the save and of the load plans, is the same."""
    plain, packed = _point(tmp_path, "plain", False), _point(tmp_path, "packed", True)
    # The root records when it was saved, so two saves' roots may differ by a few bytes; the
    # rank indexes, which packing keeps compressed, are compared exactly.
    manifest_plain, manifest_packed = plain["manifest_bytes"], packed["manifest_bytes"]
    assert isinstance(manifest_plain, int) and isinstance(manifest_packed, int)
    assert abs(manifest_packed - manifest_plain) <= 16
    traffic_plain, traffic_packed = plain["traffic"], packed["traffic"]
    assert isinstance(traffic_plain, dict) and isinstance(traffic_packed, dict)
    counted = ("label", "kind", "pickled_max", "pickled_total", "msgpack_max", "msgpack_total")
    steps = [[{key: step[key] for key in counted} for step in t["steps"]] for t in (traffic_plain, traffic_packed)]
    assert len(steps[0]) == len(steps[1]) > 0
    for before, after in zip(*steps, strict=True):
        slack = 16 if before["label"] == "commit the checkpoint" else 0  # the root, in its compact form
        assert before["label"] == after["label"] and before["kind"] == after["kind"]
        for key in counted[2:]:
            assert abs(before[key] - after[key]) <= slack, (before, after)
    load_plain, load_packed = plain["load"], packed["load"]
    assert isinstance(load_plain, dict) and isinstance(load_packed, dict) and load_plain.keys() == load_packed.keys()
    for world, figures in load_plain.items():
        for key in ("files_opened", "entries", "data_bytes"):
            assert load_packed[world][key] == figures[key], (world, key)
        # What a plan read besides the root: the rank indexes (as written) and the file headers.
        indexes_plain = figures["metadata_bytes"] - manifest_plain
        assert load_packed[world]["metadata_bytes"] - manifest_packed == indexes_plain > 0, world
