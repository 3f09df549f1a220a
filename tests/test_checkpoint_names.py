"""A checkpoint is trusted only under its own name.

Copying a validly signed ``step_00000003`` to ``step_00000099`` keeps every digest and the
signature valid: a signature proves who wrote the bytes, not when, nor under which name. The
manager and ``shardkeep ls`` compare the directory's name with the step its manifest records,
so such a copy is never restored as the newest, never marked last or best, never decides who
owns the root, and is never deleted by retention as if it were the step its name says.
"""

from __future__ import annotations

import io
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import shardkeep as sk
from shardkeep.cli import main


@pytest.fixture
def key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def _manager(root: Path, key: Ed25519PrivateKey, **options: Any) -> sk.CheckpointManager:
    return sk.CheckpointManager(root, keep_last=3, keep_best=1, signer=key, public_key=key.public_key(), **options)


def _signed_run(root: Path, key: Ed25519PrivateKey, steps: range = range(1, 6)) -> sk.CheckpointManager:
    manager = _manager(root, key)
    for step in steps:
        manager.save({"w": torch.full((4,), float(step))}, step=step, metrics={"val_loss": 1.0 / step})
    return manager


def _ls(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(["ls", *argv], out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_a_renamed_signed_checkpoint_still_verifies_alone(tmp_path: Path, key: Ed25519PrivateKey) -> None:
    """What a signature does not prove: the copy is signed bytes by the right key."""
    root = tmp_path / "run"
    _signed_run(root, key)
    shutil.copytree(root / "step_00000003", root / "step_00000099")
    report = sk.verify(root / "step_00000099", public_key=key.public_key())
    assert report.ok and report.signature.startswith("valid signature"), report.problems


def test_restore_skips_a_renamed_checkpoint_and_takes_the_real_newest(
    tmp_path: Path, key: Ed25519PrivateKey, caplog: Any
) -> None:
    root = tmp_path / "run"
    _signed_run(root, key)
    shutil.copytree(root / "step_00000003", root / "step_00000099")

    resumed = _manager(root, key)
    latest = resumed.latest()
    assert latest is not None and latest.name == "step_00000005"
    with caplog.at_level(logging.WARNING, logger="shardkeep"):
        restored = resumed.restore()
    assert restored.entry.name == "step_00000005"
    assert torch.equal(restored.state["w"], torch.full((4,), 5.0))
    # Loudly, as for a corrupt checkpoint: the copy is named in the fallback.
    assert [name for name, _ in restored.skipped] == ["step_00000099"]
    assert "manifest says step 3" in restored.skipped[0][1]
    assert "step_00000099" in caplog.text and "falling back" in caplog.text
    # Asked for by its (false) name, it is refused rather than loaded as step 99.
    with pytest.raises(sk.IntegrityError, match="manifest says step 3"):
        _manager(root, key).restore(step=99)


def test_list_and_retention_ignore_a_renamed_checkpoint(tmp_path: Path, key: Ed25519PrivateKey) -> None:
    root = tmp_path / "run"
    manager = _signed_run(root, key)
    # Two copies of step 3: one named above every real step, one below them (where retention
    # would otherwise delete it as an old, unverified step 0).
    shutil.copytree(root / "step_00000003", root / "step_00000099")
    shutil.copytree(root / "step_00000003", root / "step_00000000")

    entries = {entry.name: entry for entry in manager.list()}
    for name in ("step_00000099", "step_00000000"):
        copy = entries[name]
        assert copy.misnamed and not copy.ok
        assert not (copy.is_last or copy.is_best or copy.is_newest)
        assert f"name {name} but the manifest says step 3" in copy.problems[0]
    assert [name for name, entry in entries.items() if entry.is_newest] == ["step_00000005"]
    best = manager.best()
    assert best is not None and best.name == "step_00000005"

    manager.save({"w": torch.full((4,), 6.0)}, step=6, metrics={"val_loss": 1 / 6})
    assert manager.prune() == []
    names = sorted(path.name for path in root.iterdir() if path.name.startswith("step_"))
    assert names == ["step_00000000", "step_00000004", "step_00000005", "step_00000006", "step_00000099"]
    pointer = json.loads((root / "last").read_text())
    assert pointer["checkpoint"] == "step_00000006"


def test_a_renamed_checkpoint_of_another_run_does_not_take_over_the_root(
    tmp_path: Path, key: Ed25519PrivateKey
) -> None:
    root, other = tmp_path / "run", tmp_path / "other"
    _signed_run(root, key, range(1, 4))
    _signed_run(other, key, range(1, 3))
    shutil.copytree(other / "step_00000002", root / "step_00000099")

    # A manager without a run id takes the root's owner: still the run that wrote steps 1-3.
    manager = _manager(root, key)
    restored = manager.restore()
    assert restored.entry.name == "step_00000003"
    manager.save({"w": torch.full((4,), 4.0)}, step=4, metrics={"val_loss": 0.25})
    assert manager.run_id == restored.entry.run_id


def test_ls_flags_a_renamed_checkpoint_and_exits_1(tmp_path: Path, key: Ed25519PrivateKey) -> None:
    root = tmp_path / "run"
    _signed_run(root, key)
    shutil.copytree(root / "step_00000003", root / "step_00000099")

    code, out, _ = _ls(str(root))
    assert code == 1
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("step_")}
    assert "MISNAMED: name step_00000099 but the manifest says step 3 (renamed or copied?)" in lines["step_00000099"]
    assert "last" not in lines["step_00000099"] and "best" not in lines["step_00000099"]
    assert "last,best" in lines["step_00000005"]
    assert "pointer last -> step_00000005  current" in out

    code, out, _ = _ls(str(root), "--verify", "--json")
    document = json.loads(out)
    assert code == 1 and document["digests_checked"] is True
    states = {entry["name"]: (entry["state"], entry["misnamed"]) for entry in document["checkpoints"]}
    assert states["step_00000099"] == ("misnamed", True)
    assert states["step_00000005"] == ("verified", False)

    out_prune = io.StringIO()
    assert main(["prune", str(root), "--keep-last", "1", "--keep-best", "0"], out=out_prune) == 0
    assert "leave alone   step_00000099" in out_prune.getvalue()
    assert "would delete  step_00000099" not in out_prune.getvalue()


# -- the state's "step" and the name's ----------------------------------------------------------
def test_a_state_step_that_contradicts_the_name_is_not_recorded(tmp_path: Path) -> None:
    for s in range(3):  # the directory counts saves, the state the next step to run
        sk.save({"w": torch.ones(1), "step": s + 1}, tmp_path / f"step_{s}")
        assert sk.read_manifest(tmp_path / f"step_{s}").step is None
    out = io.StringIO()
    assert main(["ls", str(tmp_path)], out=out, err=io.StringIO()) == 0, out.getvalue()
    assert "MISNAMED" not in out.getvalue()
    manager = sk.CheckpointManager(tmp_path, keep_best=0, read_only=True)
    assert manager.restore().entry.name == "step_2"


def test_a_state_step_is_recorded_when_the_name_agrees_or_says_no_step(tmp_path: Path) -> None:
    sk.save({"w": torch.ones(1), "step": 7}, tmp_path / "step_7")
    sk.save({"w": torch.ones(1), "step": 7}, tmp_path / "step_00000007-copy")
    sk.save({"w": torch.ones(1), "step": 7}, tmp_path / "model")
    assert sk.read_manifest(tmp_path / "step_7").step == 7
    assert sk.read_manifest(tmp_path / "step_00000007-copy").step == 7
    assert sk.read_manifest(tmp_path / "model").step == 7


# -- what blocks a manager's step ---------------------------------------------------------------
def test_a_foreign_directory_under_another_spelling_does_not_block_the_step(tmp_path: Path) -> None:
    foreign = tmp_path / "step_100"
    foreign.mkdir()
    (foreign / "model.bin").write_bytes(b"not a checkpoint")
    manager = sk.CheckpointManager(tmp_path, keep_best=0)
    manager.save({"w": torch.ones(1)}, step=100)
    assert sk.verify(tmp_path / "step_00000100").ok
    assert (foreign / "model.bin").read_bytes() == b"not a checkpoint"  # never touched
    sk.save({"w": torch.ones(1)}, tmp_path / "step_101", step=101)  # committed: it blocks
    with pytest.raises(sk.CheckpointExistsError, match="step_101"):
        manager.save({"w": torch.ones(1)}, step=101)


def test_a_step_name_beyond_what_a_manifest_holds_is_no_checkpoint_name(tmp_path: Path) -> None:
    sk.save({"w": torch.ones(1)}, tmp_path / "step_1", step=1)
    huge = tmp_path / "step_99999999999999999999"  # 10**20 - 1 > 2**64 - 1
    sk.save({"w": torch.ones(1)}, huge)
    largest = tmp_path / f"step_{2**64 - 1}"
    sk.save({"w": torch.ones(1)}, largest, step=2**64 - 1)
    names = [entry.name for entry in sk.CheckpointManager(tmp_path, keep_best=0, read_only=True).list()]
    assert names == ["step_1", largest.name]
