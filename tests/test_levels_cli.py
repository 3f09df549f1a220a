"""``shardkeep ls --level NAME=ROOT ...`` after a real MultiLevelManager run on 4 gloo ranks as 2
"nodes" (roots ``node0``/``node1``) with a drained persistent level: committed copies on each
level, a flipped byte found by ``--verify`` (damaged, exit 1), a drain in progress or cut off
(draining), an unreachable level, the JSON document, bad ``--level`` specs, and no torch import."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

import shardkeep as sk
from shardkeep.cli import main
from tests.support.distributed_harness import results_or_raise, run_ranks


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def _node_of(rank: int) -> int:
    return rank // 2


def _train(rank: int, world_size: int, tmp: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    levels = [
        sk.Level(
            "local",
            tmp + "/node{node}",
            node_local=True,
            save_policy=sk.SavePolicy(every_steps=2),
            retention=sk.RetentionPolicy(keep_last=2, keep_best=0),
            replicas=0,  # the states without replicas (test_levels_replicas lists "protected")
        ),
        sk.Level(
            "persistent",
            tmp + "/persistent",
            source="drain",
            save_policy=sk.SavePolicy(every_steps=4),
            retention=sk.RetentionPolicy(keep_last=3, keep_best=0),
        ),
    ]
    manager = sk.MultiLevelManager(levels, node_of=_node_of, timeout=60, drain_wait=60)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for step in range(9):
        if manager.should_save(step):
            full = torch.arange(32.0).reshape(8, 4) + step
            manager.save({"w": distribute_tensor(full, mesh, [Shard(0)]), "step": step}, step=step)
    manager.close()


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Local steps 6 and 8 on both nodes, persistent steps 0, 4 and 8."""
    tmp = tmp_path_factory.mktemp("levels")
    results_or_raise(run_ranks(4, _train, str(tmp / "run"), outbox=tmp / "out"))
    return tmp / "run"


@pytest.fixture
def run_dir(trained: Path, tmp_path: Path) -> Path:
    """A copy of the trained run this test may change."""
    shutil.copytree(trained, tmp_path / "run")
    return tmp_path / "run"


def _levels(run_dir: Path, local: str = "node{node}") -> list[str]:
    return ["--level", f"local={run_dir / local}", "--level", f"persistent={run_dir / 'persistent'}"]


def _json(*argv: str) -> tuple[int, dict[str, Any]]:
    code, out, _ = run("ls", *argv, "--json")
    return code, json.loads(out)


def test_every_level_with_each_steps_copies(trained: Path) -> None:
    code, out, err = run("ls", *_levels(trained))
    assert code == 0, err
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip().split(" ")[0].isdigit()}
    assert set(rows) == {"0", "4", "6", "8"}, out
    assert "committed (2/2 nodes)" in rows["8"] and rows["8"].count("committed") == 2, out
    assert "committed (2/2 nodes)" in rows["6"] and rows["6"].rstrip().endswith("-"), out
    assert rows["4"].split()[1] == "-" and rows["4"].split()[2] == "committed", out
    assert "node-local, every node read (2 nodes)" in out
    assert "node 1 of 2, ranks 2,3" in out and "without --verify" in out


def test_one_nodes_root_shows_that_nodes_part(trained: Path) -> None:
    code, out, _ = run("ls", *_levels(trained, "node1"), "--verify")
    assert code == 0
    assert "this node's part only" in out
    assert "committed (node 1's part of 2)" in out
    assert "digests verified" in out and "without --verify" not in out


def test_json_document(trained: Path) -> None:
    code, document = _json(*_levels(trained))
    assert code == 0 and document["ok"] is True and document["digests_checked"] is False
    assert [level["name"] for level in document["levels"]] == ["local", "persistent"]
    local, persistent = document["levels"]
    assert local["node_local"] is True and local["every_node"] is True and local["nodes"] == 2
    assert persistent["node_local"] is False and persistent["nodes"] is None and persistent["unreachable"] is None
    assert [entry["step"] for entry in document["steps"]] == [8, 6, 4, 0]
    newest = document["steps"][0]["levels"]
    assert newest["local"]["state"] == "committed" and newest["local"]["nodes"] == [0, 1]
    assert newest["local"]["missing_nodes"] == []
    assert [(c["node"], c["nodes"], c["state"]) for c in newest["local"]["copies"]] == [
        (0, 2, "committed"),
        (1, 2, "committed"),
    ]
    assert newest["persistent"]["state"] == "committed" and newest["persistent"]["nodes"] is None
    copy = newest["persistent"]["copies"][0]
    assert set(copy) == {"level", "name", "step", "state", "detail", "node", "nodes", "root"}
    assert copy["name"] == "step_00000008" and copy["root"] == str(trained / "persistent")
    assert set(document["steps"][2]["levels"]) == {"persistent"}


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_flipped_byte_is_damaged_with_verify(run_dir: Path) -> None:
    _flip(sorted((run_dir / "node1" / "step_00000008").rglob("*.safetensors"))[0])
    _flip(sorted((run_dir / "persistent" / "step_00000004").rglob("*.safetensors"))[0])
    assert run("ls", *_levels(run_dir))[0] == 0  # sizes match: only --verify reads the data
    code, out, _ = run("ls", *_levels(run_dir), "--verify")
    assert code == 1
    row = next(line for line in out.splitlines() if line.split()[:1] == ["8"])
    assert "damaged" in row.split()[1], out
    assert "step 8 local step_00000008: damaged" in out
    code, document = _json(*_levels(run_dir), "--verify")
    assert code == 1 and document["ok"] is False
    by_step = {entry["step"]: entry["levels"] for entry in document["steps"]}
    assert by_step[8]["local"]["state"] == "damaged" and by_step[8]["persistent"]["state"] == "committed"
    assert [c["state"] for c in by_step[8]["local"]["copies"]] == ["committed", "damaged"]
    assert by_step[4]["persistent"]["state"] == "damaged" and by_step[4]["persistent"]["copies"][0]["detail"]


def test_a_drain_in_progress_or_cut_off_shows_draining(run_dir: Path) -> None:
    staging = run_dir / "persistent" / f"step_00000012.tmp-{uuid.uuid4().hex}"
    (staging / "shards").mkdir(parents=True)
    (staging / "shards" / "rank_00000.safetensors").write_bytes(b"partial")
    # an object store's drain writes under the final name, without a manifest until it commits
    partial = run_dir / "persistent" / "step_00000016" / "shards"
    partial.mkdir(parents=True)
    (partial / "rank_00000.safetensors").write_bytes(b"partial")
    code, out, _ = run("ls", *_levels(run_dir))
    assert code == 0, out
    rows = {line.split()[0]: line for line in out.splitlines() if line.split()[:1] and line.split()[0].isdigit()}
    assert rows["12"].split()[1:] == ["-", "draining"] and rows["16"].split()[1:] == ["-", "draining"], out
    assert "staging, idle" in out and "files without a manifest" in out
    code, document = _json(*_levels(run_dir))
    assert code == 0
    by_step = {entry["step"]: entry["levels"] for entry in document["steps"]}
    assert by_step[12]["persistent"]["state"] == "draining" and by_step[16]["persistent"]["state"] == "draining"
    assert by_step[12]["persistent"]["copies"][0]["name"] == staging.name


def test_a_node_without_its_part_is_named(run_dir: Path) -> None:
    shutil.rmtree(run_dir / "node1" / "step_00000006")
    code, out, _ = run("ls", *_levels(run_dir))
    assert code == 0
    assert "incomplete (no part on node 1)" in out
    _, document = _json(*_levels(run_dir))
    six = next(entry for entry in document["steps"] if entry["step"] == 6)["levels"]["local"]
    assert six["state"] == "incomplete" and six["missing_nodes"] == [1] and six["nodes"] == [0]


def test_an_unreachable_level_is_named(run_dir: Path) -> None:
    shutil.rmtree(run_dir / "persistent")
    (run_dir / "persistent").write_text("not a directory")
    code, out, _ = run("ls", *_levels(run_dir))
    assert code == 1
    assert any(line.startswith("level   persistent") and "UNREACHABLE" in line for line in out.splitlines()), out
    assert "committed (2/2 nodes)" in out  # the other level is still listed
    code, document = _json(*_levels(run_dir))
    assert code == 1 and document["ok"] is False
    assert document["levels"][1]["unreachable"] and document["levels"][0]["unreachable"] is None
    (run_dir / "elsewhere").write_text("a file")
    code, out, _ = run("ls", "--level", f"local={run_dir / 'elsewhere'}")
    assert code == 1 and "UNREACHABLE" in out


@pytest.mark.parametrize(
    ("specs", "named"),
    [
        (["local"], "'local'"),
        (["=/tmp/x"], "'=/tmp/x'"),
        (["local="], "'local='"),
        (["a=/tmp/x", "a=/tmp/y"], "level 'a' is given twice"),
        (["a=/tmp/x", "b=/tmp/x"], "root '/tmp/x' is given for two levels"),
    ],
)
def test_a_bad_level_spec_is_a_usage_error_naming_it(specs: list[str], named: str) -> None:
    argv = [arg for spec in specs for arg in ("--level", spec)]
    code, out, err = run("ls", *argv)
    assert code == 2 and not out and named in err and "--level" in err, err
    code, out, err = run("ls", *argv, "--json")
    assert code == 2 and not out and named in json.loads(err)["error"]["message"]


def test_root_and_level_together_are_refused(trained: Path) -> None:
    code, out, err = run("ls", str(trained / "persistent"), *_levels(trained))
    assert code == 2 and not out and "not both" in err


def test_help_describes_level() -> None:
    out = io.StringIO()
    with pytest.raises(SystemExit), contextlib.redirect_stdout(out):
        main(["ls", "--help"])
    text = " ".join(out.getvalue().split())
    assert "--level NAME=ROOT" in text and "committed, draining, damaged" in text


def test_listing_levels_imports_no_torch(trained: Path) -> None:
    argv = [*_levels(trained), "--verify", "--json"]
    program = (
        "import io, json, sys\n"
        "from shardkeep.cli import main\n"
        "out = io.StringIO()\n"
        f"code = main(['ls', *{argv!r}], out=out, err=io.StringIO())\n"
        "document = json.loads(out.getvalue())\n"
        "heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "print(json.dumps({'code': code, 'steps': [s['step'] for s in document['steps']], 'torch': heavy}))\n"
    )
    done = subprocess.run([sys.executable, "-c", program], check=True, capture_output=True, text=True)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {"code": 0, "steps": [8, 6, 4, 0], "torch": []}


def test_a_node_whose_root_is_gone_is_named_and_a_missing_level_is_unreachable(run_dir: Path) -> None:
    shutil.rmtree(run_dir / "node1")
    code, document = _json(*_levels(run_dir))
    assert code == 0
    newest = document["steps"][0]["levels"]["local"]
    assert newest["state"] == "incomplete" and newest["missing_nodes"] == [1]
    code, document = _json("--level", f"local={run_dir / 'nowhere{node}'}")
    assert code == 1 and "does not exist" in document["levels"][0]["unreachable"]
