"""One rule tells a local path from a store URL (shardkeep.storage.locations): ``file://PATH``
is the local path ``PATH`` wherever a location is taken, and any other ``<protocol>://`` text
is a store URL (or refused as a malformed one), never a local directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import shardkeep as sk
from shardkeep.catalog import CheckpointRoot
from shardkeep.storage import LocalStore, is_url, local_path, open_store, split_url
from shardkeep.tiers import check_tiers


def test_a_file_url_is_a_local_path_and_no_store_url(tmp_path: Path) -> None:
    assert not is_url(f"file://{tmp_path}")
    assert local_path(f"file://{tmp_path}/ckpt") == f"{tmp_path}/ckpt"
    assert split_url(f"file://{tmp_path}/ckpt") == ("file", f"{tmp_path}/ckpt")
    assert local_path("file://relative/ckpt") == os.path.abspath("relative/ckpt")
    assert local_path(tmp_path / "plain") == str(tmp_path / "plain")
    assert not is_url(tmp_path / "plain")


def test_a_store_url_is_no_local_path() -> None:
    assert is_url("s3://bucket/prefix")
    assert local_path("s3://bucket/prefix") is None
    assert split_url("s3://bucket/prefix/") == ("s3", "bucket/prefix")


@pytest.mark.parametrize("text", ["my dir://x", "://x", "s3://", "s3://bucket/../x"])
def test_a_malformed_url_is_refused_and_never_read_as_a_local_directory(text: str) -> None:
    assert local_path(text) is None
    with pytest.raises(sk.ShardkeepError):
        split_url(text)
    with pytest.raises(sk.ShardkeepError):
        open_store(text)


def test_a_file_url_without_a_path_is_refused() -> None:
    with pytest.raises(sk.UnsupportedValueError, match="names no local path"):
        local_path("file://")


def state(value: float) -> dict[str, object]:
    return {"model": {"w": torch.full((4,), value)}, "step": int(value)}


def test_save_and_load_take_a_file_url_as_the_local_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a wrong reading of file:///abs as the relative abs/... lands here
    target = tmp_path / "root" / "ckpt"
    target.parent.mkdir()
    sk.save(state(1.0), f"file://{target}")
    assert (target / "manifest.json").is_file()
    assert sorted(os.listdir(tmp_path)) == ["root"]
    assert torch.equal(sk.load(target)["model"]["w"], torch.full((4,), 1.0))
    assert torch.equal(sk.load(f"file://{target}")["model"]["w"], torch.full((4,), 1.0))
    assert sk.verify(f"file://{target}").ok
    assert sk.read_manifest(f"file://{target}").step == sk.read_manifest(target).step


def test_open_store_and_a_root_take_a_file_url_as_the_local_path(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}")
    assert isinstance(store, LocalStore) and store.root == str(tmp_path)
    root = CheckpointRoot.at(f"file://{tmp_path}")
    assert isinstance(root.store, LocalStore) and root.store.root == str(tmp_path)
    assert root.display == str(tmp_path)


def test_the_manager_takes_a_file_url_as_the_local_root(tmp_path: Path) -> None:
    root = tmp_path / "runs" / "a"
    manager = sk.CheckpointManager(f"file://{root}")
    manager.save(state(2.0), step=2)
    assert sorted(os.listdir(root)) == ["best", "last", "step_00000002"]
    restored = sk.CheckpointManager(root).restore()
    assert restored.step == 2 and torch.equal(restored.state["model"]["w"], torch.full((4,), 2.0))


def test_a_tier_location_given_as_a_file_url_is_its_local_path(tmp_path: Path) -> None:
    (tier,) = check_tiers([sk.Tier(tier_id=1, name="cold", location=f"file://{tmp_path}/cold")])
    assert tier.location == f"{tmp_path}/cold"
    (remote,) = check_tiers([sk.Tier(tier_id=1, name="cold", location="s3://bucket/cold")])
    assert remote.location == "s3://bucket/cold"
    with pytest.raises(sk.ConfigError, match="cold"):
        check_tiers([sk.Tier(tier_id=1, name="cold", location="file://")])
