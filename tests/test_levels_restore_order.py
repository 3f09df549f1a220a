"""The order in which a restore consults the levels: the node-local copies (own node, peers and
replicas) first; a shared level is read (beyond one listing of its names) only when it names a
step at least as new as the newest node-local one, or when the node-local level cannot complete
that step. The clean-up of interrupted drains runs after the state is loaded.

Covered: a restore with both levels whose local step suffices reads nothing of the persistent
level but one listing before the state is loaded, and cleans up drains after it; a persistent
level holding a newer step (saved directly) is restored from; a local step that cannot be
completed falls back to the persistent copy of the same step; node loss on 2 nodes with replicas
restores from the replicas without reading the persistent level.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import shardkeep as sk
from shardkeep.storage import LocalStore
from tests.support.distributed_harness import results_or_raise, run_ranks
from tests.support.states import row_sharded


def _levels(tmp: Path, *, source: str = "drain", replicas: int | None = 0) -> list[sk.Level]:
    return [
        sk.Level("local", str(tmp / "node{node}"), node_local=True, replicas=replicas),
        sk.Level("persistent", str(tmp / "persistent"), source=source),
    ]


class _Events:
    """What a restore did, in order: calls on the persistent level's store, the drain clean-up,
    and the fill of the state."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, persistent: Path) -> None:
        import shardkeep.levels.attempt as attempt_module
        import shardkeep.levels.copies as copies_module
        import shardkeep.levels.shared_level as shared_level_module
        from shardkeep.loading import LoadJob

        self.seen: list[str] = []
        seen = self.seen
        root = str(persistent)

        class CountingStore(LocalStore):
            def _note(self, what: str) -> None:
                if str(self.root).startswith(root):
                    seen.append(what)

            def list_dir(self, path: str = "") -> Any:
                self._note("list_dir")
                return super().list_dir(path)

            def stat(self, path: str) -> Any:
                self._note("stat")
                return super().stat(path)

            def open_read(self, path: str) -> Any:
                self._note("open_read")
                return super().open_read(path)

        real_recover, real_fill = shared_level_module.recover_drains, LoadJob.fill

        def recover(*args: Any, **kwargs: Any) -> Any:
            seen.append("recover_drains")
            return real_recover(*args, **kwargs)

        def fill(job: Any, *args: Any, **kwargs: Any) -> Any:
            seen.append("fill")
            return real_fill(job, *args, **kwargs)

        import shardkeep.levels.config as config_module

        # the manager opens (and probes) the persistent level's store once and a restore lists
        # through it; a store a restore opens itself counts too
        monkeypatch.setattr(copies_module, "LocalStore", CountingStore)
        monkeypatch.setattr(attempt_module, "LocalStore", CountingStore)
        monkeypatch.setattr(config_module, "open_store", lambda root, options=None: CountingStore(str(root)))
        monkeypatch.setattr(shared_level_module, "recover_drains", recover)
        monkeypatch.setattr(LoadJob, "fill", fill)

    def before_fill(self) -> list[str]:
        return self.seen[: self.seen.index("fill")]


def test_a_complete_local_step_is_restored_without_reading_the_persistent_level(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = sk.MultiLevelManager(_levels(tmp_path))
    for step in (0, 1):
        manager.save({"w": torch.full((64,), float(step))}, step=step, levels=["local", "persistent"])
        manager.wait_for_drains()
    manager.close()
    assert (tmp_path / "persistent" / "step_00000001" / "manifest.json").exists()
    events = _Events(monkeypatch, tmp_path / "persistent")
    state = {"w": torch.zeros(64)}
    restarted = sk.MultiLevelManager(_levels(tmp_path))
    assert events.seen == ["list_dir"]  # the manager's probe of the level
    events.seen.clear()
    restored = restarted.restore(into=state)
    assert restored is not None and restored.step == 1 and torch.equal(state["w"], torch.full((64,), 1.0))
    # one listing of the names, no manifest read, no drain clean-up before the state is loaded
    assert events.before_fill() == ["list_dir"], events.seen
    report = restored.report
    assert report.source == {0: "local"} and report.levels_read == ["local"]
    assert report.unreachable == {} and report.refused == []
    assert "persistent" in report.not_consulted and "step 1" in report.not_consulted["persistent"]
    restarted.close()
    assert "recover_drains" in events.seen[events.seen.index("fill") :]  # after the load, settled by close


def test_a_newer_step_saved_directly_to_the_persistent_level_is_restored(tmp_path: Path) -> None:
    manager = sk.MultiLevelManager(_levels(tmp_path, source="save"))
    manager.save({"w": torch.full((64,), 0.0)}, step=0, levels=["local", "persistent"])
    manager.save({"w": torch.full((64,), 1.0)}, step=1, levels=["local"])
    manager.save({"w": torch.full((64,), 2.0)}, step=2, levels=["persistent"])
    manager.close()
    assert sorted(p.name for p in (tmp_path / "node0").iterdir() if p.name.startswith("step_"))[-1] == "step_00000001"
    state = {"w": torch.zeros(64)}
    restarted = sk.MultiLevelManager(_levels(tmp_path, source="save"))
    restored = restarted.restore(into=state)
    restarted.close()
    assert restored is not None and restored.step == 2 and torch.equal(state["w"], torch.full((64,), 2.0))
    # the node-local level gets the step rebuilt from the persistent copy on the way
    assert "persistent" in restored.report.levels_read and restored.report.not_consulted == {}


def test_a_local_step_it_cannot_complete_falls_back_to_the_persistent_copy_of_that_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = sk.MultiLevelManager(_levels(tmp_path))
    manager.save({"w": torch.full((64,), 3.0)}, step=3, levels=["local", "persistent"])
    manager.wait_for_drains()
    manager.close()
    shard = next((tmp_path / "node0" / "step_00000003").rglob("*.safetensors"))
    shard.unlink()
    events = _Events(monkeypatch, tmp_path / "persistent")
    state = {"w": torch.zeros(64)}
    restarted = sk.MultiLevelManager(_levels(tmp_path))
    restored = restarted.restore(into=state)
    restarted.close()
    assert restored is not None and restored.step == 3 and torch.equal(state["w"], torch.full((64,), 3.0))
    assert "open_read" in events.before_fill()  # the persistent level was read, as it had to be
    report = restored.report
    assert report.not_consulted == {} and report.refused == []
    assert any(source == "persistent" for _, _, source in report.healed), report.healed
    assert shard.exists()


def _node_of(rank: int) -> int:
    return rank // 2


def _save(rank: int, world_size: int, tmp: str) -> None:
    manager = sk.MultiLevelManager(_levels(Path(tmp), replicas=1), node_of=_node_of, timeout=60)
    manager.save(row_sharded(4), step=4, levels=["local", "persistent"])
    manager.wait_for_replicas()
    manager.wait_for_drains()
    manager.close()


def _restore(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    manager = sk.MultiLevelManager(_levels(Path(tmp), replicas=1), node_of=_node_of, timeout=60)
    state = row_sharded(0, zeros=True)
    restored = manager.restore(into=state)
    manager.close()
    assert restored is not None
    expected = row_sharded(4)
    assert torch.equal(state["weights"].to_local(), expected["weights"].to_local()) and state["step"] == 4
    report = restored.report
    return {"step": restored.step, "healed": sorted({s for _, _, s in report.healed}), "not": report.not_consulted}


def test_node_loss_with_replicas_does_not_read_the_persistent_level(tmp_path: Path) -> None:
    results_or_raise(run_ranks(4, _save, str(tmp_path), outbox=tmp_path / "out"))
    assert (tmp_path / "persistent" / "step_00000004" / "manifest.json").exists()
    shutil.rmtree(tmp_path / "node1")  # node 1 is replaced: its local disk is empty
    results = results_or_raise(run_ranks(4, _restore, str(tmp_path), outbox=tmp_path / "out2"))
    assert all(r["step"] == 4 and r["healed"] == ["local@node0"] for r in results), results
    assert all(set(r["not"]) == {"persistent"} for r in results), results


@pytest.mark.slow
def test_on_s3_a_complete_local_step_is_restored_with_one_listing_of_the_bucket(
    tmp_path: Path, s3_root: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    import shardkeep.levels.config as config_module
    import shardkeep.levels.shared_level as shared_level_module
    from shardkeep.loading import LoadJob
    from shardkeep.storage import FsspecStore

    root, options = s3_root
    levels = [
        sk.Level("local", str(tmp_path / "node{node}"), node_local=True, replicas=0),
        sk.Level("persistent", root, source="drain", storage_options=options),
    ]
    manager = sk.MultiLevelManager(levels)
    manager.save({"w": torch.full((64,), 5.0)}, step=5, levels=["local", "persistent"])
    manager.wait_for_drains()
    manager.close()
    seen: list[str] = []

    class CountingStore(FsspecStore):
        def list_dir(self, path: str = "") -> Any:
            seen.append("list_dir")
            return super().list_dir(path)

        def stat(self, path: str) -> Any:
            seen.append("stat")
            return super().stat(path)

        def open_read(self, path: str) -> Any:
            seen.append("open_read")
            return super().open_read(path)

    real_recover, real_fill = shared_level_module.recover_drains, LoadJob.fill
    real_open = config_module.open_store

    def open_store(url: Any, opts: Any = None) -> Any:
        return CountingStore(str(url), opts) if str(url).startswith("s3://") else real_open(url, opts)

    monkeypatch.setattr(config_module, "open_store", open_store)
    monkeypatch.setattr(
        shared_level_module, "recover_drains", lambda *a, **k: seen.append("recover") or real_recover(*a, **k)
    )
    monkeypatch.setattr(LoadJob, "fill", lambda job, *a, **k: seen.append("fill") or real_fill(job, *a, **k))
    restarted = sk.MultiLevelManager(levels)
    seen.clear()  # the manager's probe of the bucket
    state = {"w": torch.zeros(64)}
    restored = restarted.restore(into=state)
    assert restored is not None and restored.step == 5 and torch.equal(state["w"], torch.full((64,), 5.0))
    assert seen[: seen.index("fill")] == ["list_dir"], seen
    assert set(restored.report.not_consulted) == {"persistent"} and restored.report.unreachable == {}
    restarted.close()
    assert "recover" in seen[seen.index("fill") :]
