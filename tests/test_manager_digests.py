"""Which recorded digests ``CheckpointManager.restore`` checks (``digest=``, as ``load``'s):
the fast one by default, the cryptographic one under the manager's public key or with
``digest="cryptographic"``. A recorded digest is changed and the manifest re-sealed, so only
the check that compares that digest can notice; a checkpoint that fails the check asked for is
skipped like a damaged one."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import shardkeep as sk
from shardkeep.integrity import generate_key_pair

STATES = {
    step: {"w": torch.arange(64 * 1024, dtype=torch.float32) + step, "b": torch.ones(3) * step} for step in (1, 2)
}


def _manager(root: Path, **options: Any) -> sk.CheckpointManager:
    return sk.CheckpointManager(root, keep_last=5, keep_best=0, **options)


def _saved(root: Path, **write: Any) -> sk.CheckpointManager:
    manager = _manager(root, options=sk.WriteOptions(**write) if write else None)
    for step, state in STATES.items():
        manager.save(state, step=step)
    return manager


def _break_strong_digest(raw: dict[str, Any]) -> None:
    """Change the recorded cryptographic digest of every data file, and only that: the fast
    digest (and the bytes) stay right."""
    for record in raw["files"]:
        algorithm, _, hexdigest = record["digest"].partition(":")
        assert algorithm == "blake3" and record.get("fast_digest")
        record["digest"] = f"{algorithm}:{'0' if hexdigest[0] != '0' else '1'}{hexdigest[1:]}"


def test_a_default_restore_checks_the_fast_digest_and_a_cryptographic_one_the_strong(
    tmp_path: Path, reseal: Callable[..., None], caplog: pytest.LogCaptureFixture
) -> None:
    manager = _saved(tmp_path / "root")
    reseal(tmp_path / "root" / "step_00000002", _break_strong_digest)

    restored = manager.restore()  # the fast digests match: the strong one is not compared
    assert restored.entry.step == 2 and not restored.skipped
    assert torch.equal(restored.state["w"], STATES[2]["w"])
    assert _manager(tmp_path / "root").restore(digest="fast").entry.step == 2

    with caplog.at_level(logging.WARNING, logger="shardkeep"):
        strong = _manager(tmp_path / "root").restore(digest="cryptographic")
    assert strong.entry.step == 1 and torch.equal(strong.state["w"], STATES[1]["w"])
    assert [name for name, _ in strong.skipped] == ["step_00000002"]
    assert "digest mismatch" in strong.skipped[0][1]
    assert "falling back" in caplog.text


def test_a_restore_whose_only_checkpoint_fails_the_cryptographic_check_raises(
    tmp_path: Path, reseal: Callable[..., None]
) -> None:
    manager = _manager(tmp_path / "root")
    manager.save(STATES[1], step=1)
    reseal(tmp_path / "root" / "step_00000001", _break_strong_digest)
    with pytest.raises(sk.IntegrityError, match="digest mismatch"):
        manager.restore(digest="cryptographic")
    assert manager.restore(step=1).entry.step == 1


def test_a_signed_root_is_restored_with_its_cryptographic_digests(tmp_path: Path, reseal: Callable[..., None]) -> None:
    private, public = tmp_path / "key.pem", tmp_path / "key.pub"
    generate_key_pair(private, public)
    root = tmp_path / "root"
    writer = _manager(root, signer=private, public_key=public)
    writer.save(STATES[1], step=1)
    reader = _manager(root, public_key=public, read_only=True)
    assert reader.restore().entry.step == 1
    assert reader.restore(digest="cryptographic").entry.step == 1
    with pytest.raises(sk.ConfigError, match="digest='fast' with the manager's public_key"):
        reader.restore(digest="fast")


def test_the_digest_choice_is_checked_before_anything_is_read(tmp_path: Path) -> None:
    manager = _manager(tmp_path / "root")
    with pytest.raises(sk.ConfigError, match="must be None"):
        manager.restore(digest="sha256")  # type: ignore[arg-type]


def test_a_checkpoint_without_cryptographic_digests_is_not_restored_cryptographically(tmp_path: Path) -> None:
    manager = _manager(tmp_path / "root", options=sk.WriteOptions(digest="xxh3-128"))
    manager.save(STATES[1], step=1)
    assert torch.equal(manager.restore().state["w"], STATES[1]["w"])
    with pytest.raises(sk.IntegrityError, match="records no cryptographic digest"):
        manager.restore(digest="cryptographic")


def test_a_checkpoint_without_fast_digests_is_checked_with_its_own(tmp_path: Path, reseal: Callable[..., None]) -> None:
    manager = _saved(tmp_path / "root", block_size=0)  # format 1.3: one digest per file

    def break_digest(raw: dict[str, Any]) -> None:
        assert raw["metadata_version"] == "1.3" and "fast_digest" not in raw["files"][0]
        raw["files"][0]["digest"] = raw["files"][0]["digest"][:-1] + (
            "0" if raw["files"][0]["digest"][-1] != "0" else "1"
        )

    reseal(tmp_path / "root" / "step_00000002", break_digest)
    restored = manager.restore()  # digest=None falls back to the only digest recorded
    assert restored.entry.step == 1 and [name for name, _ in restored.skipped] == ["step_00000002"]
