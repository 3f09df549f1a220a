"""The persistent level on the real S3 server (SeaweedFS): a MultiLevelManager with a node-local
level and an ``s3://`` drain level saves and drains; ``shardkeep ls --level`` lists the S3 copies
(and a drain's objects without a manifest as draining); a flipped local byte heals from the S3
copy of the same step; a wiped local level restores from S3."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import shardkeep as sk
from shardkeep.cli import main

pytestmark = pytest.mark.slow


def _levels(tmp: Path, root: str, options: dict[str, Any]) -> list[sk.Level]:
    return [
        sk.Level(
            "local",
            str(tmp / "node{node}"),
            node_local=True,
            save_policy=sk.SavePolicy(every_steps=2),
            retention=sk.RetentionPolicy(keep_last=2, keep_best=0),
        ),
        sk.Level(
            "persistent",
            root,
            source="drain",
            save_policy=sk.SavePolicy(every_steps=4),
            retention=sk.RetentionPolicy(keep_last=2, keep_best=0),
            storage_options=options,
        ),
    ]


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.arange(64.0).reshape(16, 4) + step, "b": torch.full((3,), float(step)), "step": step}


def _zeros() -> dict[str, Any]:
    return {"w": torch.zeros(16, 4), "b": torch.zeros(3), "step": 0}


def _ls(*argv: str) -> tuple[int, dict[str, Any]]:
    out, err = io.StringIO(), io.StringIO()
    code = main(["ls", *argv, "--json"], out=out, err=err)
    assert out.getvalue(), err.getvalue()
    return code, json.loads(out.getvalue())


def _restore(tmp: Path, root: str, options: dict[str, Any]) -> tuple[sk.LevelsRestored, dict[str, Any]]:
    state = _zeros()
    manager = sk.MultiLevelManager(_levels(tmp, root, options))
    restored = manager.restore(into=state)
    manager.close()
    assert restored is not None
    return restored, state


def test_a_persistent_level_on_s3(
    tmp_path: Path, s3_root: tuple[str, dict[str, Any]], s3_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, options = s3_root
    # a save may wait up to 60 s for the drain before it (the loop is faster than S3 here)
    manager = sk.MultiLevelManager(_levels(tmp_path, root, options), drain_wait=60)
    for step in range(9):
        if manager.should_save(step):
            manager.save(_state(step), step=step)
    manager.close()
    for step in (4, 8):
        assert sk.verify(f"{root}/step_{step:08d}", storage_options=options).ok

    # shardkeep ls --level lists the S3 copies (credentials from the environment, as everywhere)
    for name, value in s3_server.environment.items():
        monkeypatch.setenv(name, value)
    levels = ["--level", f"local={tmp_path / 'node{node}'}", "--level", f"persistent={root}"]
    code, document = _ls(*levels, "--verify")
    assert code == 0 and document["ok"], document
    by_step = {entry["step"]: entry["levels"] for entry in document["steps"]}
    assert sorted(by_step) == [4, 6, 8]
    assert by_step[8]["persistent"]["state"] == "committed" and by_step[8]["local"]["state"] == "committed"
    assert by_step[4]["persistent"]["copies"][0]["detail"] == "digests verified" and "local" not in by_step[4]
    # a drain in progress (or cut off) on an object store: objects under the name, no manifest
    fs = s3_server.filesystem()
    fs.pipe(f"{root}/step_00000012/shards/rank_00000.safetensors".removeprefix("s3://"), b"partial")
    code, document = _ls(*levels)
    assert code == 0
    twelve = next(entry for entry in document["steps"] if entry["step"] == 12)["levels"]
    assert twelve == {
        "persistent": {
            "state": "draining",
            "nodes": None,
            "missing_nodes": [],
            "copies": [
                {
                    "level": "persistent",
                    "name": "step_00000012",
                    "step": 12,
                    "state": "draining",
                    "detail": "files without a manifest",
                    "node": None,
                    "nodes": None,
                    "root": root,
                }
            ],
        }
    }

    # a flipped local byte heals from the S3 copy of the same step
    victim = sorted((tmp_path / "node0" / "step_00000008").rglob("*.safetensors"))[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    code, document = _ls(*levels, "--verify")
    eight = next(entry for entry in document["steps"] if entry["step"] == 8)["levels"]
    assert code == 1 and eight["local"]["state"] == "damaged" and eight["persistent"]["state"] == "committed"
    restored, state = _restore(tmp_path, root, options)
    assert restored.step == 8 and torch.equal(state["w"], _state(8)["w"]) and state["step"] == 8
    assert restored.report.healed and all("persistent" in str(entry) for entry in restored.report.healed)
    code, document = _ls(*levels, "--verify")  # the healed local part verifies
    eight = next(entry for entry in document["steps"] if entry["step"] == 8)["levels"]
    assert code == 0 and eight["local"]["state"] == "committed", eight

    # a wiped local level restores from S3
    shutil.rmtree(tmp_path / "node0")
    restored, state = _restore(tmp_path, root, options)
    assert restored.step == 8 and torch.equal(state["b"], _state(8)["b"])
    assert "persistent" in restored.report.levels_read
