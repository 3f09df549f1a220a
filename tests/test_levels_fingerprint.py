"""``MultiLevelManager.restore`` checks the model args and config a step was saved with, as
``CheckpointManager.restore`` does: every save records the fingerprint (the node-local one the
same as a ``CheckpointManager`` save), a step that differs is refused on every rank naming the
step, its level and the fields, ``allow_fingerprint_change=True`` restores it, and the restore
never falls back past such a step. One process, and two real gloo ranks on two "nodes"."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import shardkeep as sk
from tests.support.distributed_harness import results_or_raise, run_ranks
from tests.support.states import full_rows, row_sharded

ARGS = {"model_args": {"n_layer": 2, "d_model": 8}, "config": {"lr": 0.001}}
CHANGED = {"model_args": {"n_layer": 3, "d_model": 8}, "config": {"lr": 0.001}}


def _levels(tmp: Path | str, *, persistent: bool = True) -> list[sk.Level]:
    levels = [
        sk.Level(
            "local",
            str(tmp) + "/node{node}",
            node_local=True,
            replicas=0,
            save_policy=sk.SavePolicy(every_steps=2),
            retention=sk.RetentionPolicy(keep_last=3, keep_best=0),
        )
    ]
    if persistent:
        levels.append(
            sk.Level(
                "persistent",
                str(tmp) + "/persistent",
                source="drain",
                save_policy=sk.SavePolicy(every_steps=4),
                retention=sk.RetentionPolicy(keep_last=3, keep_best=0),
            )
        )
    return levels


def _training(iteration: int, *, n_layer: int = 2, zero: bool = False) -> sk.TrainingCheckpoint:
    torch.manual_seed(iteration)
    model = torch.nn.Linear(4, 3)
    if zero:
        with torch.no_grad():
            model.weight.zero_()
    return sk.TrainingCheckpoint(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.001),
        best_val_loss=0.5,
        model_args={"n_layer": n_layer, "d_model": 8},
        iteration=iteration,
        config={"lr": 0.001},
        track_rng=False,
    )


def _save_training(tmp: Path, steps: tuple[int, ...], *, n_layer: int = 2, **kwargs: Any) -> None:
    manager = sk.MultiLevelManager(_levels(tmp, **kwargs))
    for step in steps:
        manager.save(_training(step, n_layer=n_layer), step=step)
    manager.close()


def test_the_node_local_save_records_the_fingerprint_a_checkpoint_manager_save_records(tmp_path: Path) -> None:
    _save_training(tmp_path / "levels", (4,))
    sk.CheckpointManager(tmp_path / "single").save(_training(4), step=4)
    local = sk.read_manifest(tmp_path / "levels" / "node0" / "step_00000004")
    drained = sk.read_manifest(tmp_path / "levels" / "persistent" / "step_00000004")
    single = sk.read_manifest(tmp_path / "single" / "step_00000004")
    assert local.run is not None and drained.run is not None and single.run is not None
    assert local.run.fingerprint is not None
    assert local.run.fingerprint == drained.run.fingerprint == single.run.fingerprint
    assert (
        local.run.fingerprint_fields
        == single.run.fingerprint_fields
        == {
            "model_args.n_layer": 2,
            "model_args.d_model": 8,
            "config.lr": 0.001,
        }
    )


def test_a_matching_training_checkpoint_restores(tmp_path: Path) -> None:
    _save_training(tmp_path, (2, 4))
    target = _training(0, zero=True)
    restored = sk.MultiLevelManager(_levels(tmp_path)).restore(into=target)
    assert restored is not None and restored.step == 4
    assert torch.equal(target.model.weight, _training(4).model.weight)


@pytest.mark.parametrize("wipe_local", [False, True])
def test_a_changed_model_arg_is_refused_naming_it_and_allowed_on_request(tmp_path: Path, wipe_local: bool) -> None:
    _save_training(tmp_path, (2, 4))
    if wipe_local:  # the step comes from the persistent level alone
        shutil.rmtree(tmp_path / "node0")
    target = _training(0, n_layer=3, zero=True)
    with pytest.raises(sk.FingerprintMismatchError) as caught:
        sk.MultiLevelManager(_levels(tmp_path)).restore(into=target)
    message = str(caught.value)
    assert "step 4" in message and "model_args.n_layer: checkpoint 2, now 3" in message
    assert ("'persistent'" in message) and (("'local'" in message) != wipe_local)
    assert caught.value.differences == [("model_args.n_layer", "2", "3")]
    assert not target.model.weight.any()  # refused before anything was loaded into it

    restored = sk.MultiLevelManager(_levels(tmp_path)).restore(into=target, allow_fingerprint_change=True)
    assert restored is not None and restored.step == 4
    assert torch.equal(target.model.weight, _training(4).model.weight)
    assert target.model_args["n_layer"] == 3  # the caller's, as CheckpointManager keeps them


def test_a_shared_level_only_manager_checks_too(tmp_path: Path) -> None:
    levels = [sk.Level("persistent", str(tmp_path / "persistent"), retention=sk.RetentionPolicy(keep_last=2))]
    manager = sk.MultiLevelManager(levels, fingerprint=ARGS)
    manager.save({"w": torch.ones(3)}, step=1)
    manager.close()
    with pytest.raises(sk.FingerprintMismatchError, match=r"step 1 \(level 'persistent'\)"):
        sk.MultiLevelManager(levels, fingerprint=CHANGED).restore(into={"w": torch.zeros(3)})
    restored = sk.MultiLevelManager(levels, fingerprint=ARGS).restore(into={"w": torch.zeros(3)})
    assert restored is not None and restored.step == 1


def test_a_plain_mapping_records_and_checks_the_fingerprint_keyword(tmp_path: Path) -> None:
    manager = sk.MultiLevelManager(_levels(tmp_path), fingerprint=ARGS)
    manager.save({"w": torch.ones(3)}, step=4)
    manager.close()
    manifest = sk.read_manifest(tmp_path / "node0" / "step_00000004")
    assert manifest.run is not None and manifest.run.fingerprint_fields["model_args.n_layer"] == 2
    with pytest.raises(sk.FingerprintMismatchError, match=r"model_args\.n_layer"):
        sk.MultiLevelManager(_levels(tmp_path), fingerprint=CHANGED).restore(into={"w": torch.zeros(3)})
    # No fingerprint on the restoring side: nothing to check, as with CheckpointManager.
    assert sk.MultiLevelManager(_levels(tmp_path)).restore(into={"w": torch.zeros(3)}) is not None


def test_a_newer_matching_step_is_restored_and_an_older_differing_one_is_never_fallen_back_to(
    tmp_path: Path,
) -> None:
    _save_training(tmp_path, (2,), persistent=False)
    # The run resumes with a changed model arg, allowed once, and saves step 4.
    resumed = sk.MultiLevelManager(_levels(tmp_path, persistent=False))
    target = _training(0, n_layer=3, zero=True)
    assert resumed.restore(into=target, allow_fingerprint_change=True) is not None
    resumed.save(_training(4, n_layer=3), step=4)
    resumed.close()

    target = _training(0, n_layer=3, zero=True)
    restored = sk.MultiLevelManager(_levels(tmp_path, persistent=False)).restore(into=target)
    assert restored is not None and restored.step == 4

    with pytest.raises(sk.FingerprintMismatchError, match="step 4"):  # the newest differs for the old args
        sk.MultiLevelManager(_levels(tmp_path, persistent=False)).restore(into=_training(0, zero=True))

    # Step 4 loses a data file and has no other copy: the restore stops at step 2, which differs.
    step4 = tmp_path / "node0" / "step_00000004"
    data = [path for path in step4.rglob("*") if path.is_file() and path.suffix == ".safetensors"]
    assert data
    for path in data:
        path.unlink()
    target = _training(0, n_layer=3, zero=True)
    with pytest.raises(sk.FingerprintMismatchError, match="no newer step can be completed") as caught:
        sk.MultiLevelManager(_levels(tmp_path, persistent=False)).restore(into=target)
    assert "step 2 (level 'local')" in str(caught.value)
    assert not target.model.weight.any()


# -- two real gloo ranks, one per "node" -------------------------------------------------------


def _node_of(rank: int) -> int:
    return rank


def _attempt(manager: sk.MultiLevelManager, **kwargs: Any) -> tuple[str, str, int | None, bool]:
    """(outcome, message, step, whether the target is still zero) of one restore."""
    state = row_sharded(0, zeros=True)
    try:
        restored = manager.restore(into=state, **kwargs)
    except sk.ShardkeepError as exc:
        return type(exc).__name__, str(exc), None, not state["weights"].full_tensor().any()
    finally:
        manager.close()
    assert restored is not None
    return "ok", "", restored.step, torch.equal(state["weights"].full_tensor(), full_rows(restored.step))


def _two_ranks(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    import torch.distributed as dist

    def manager(fingerprint: dict[str, Any]) -> sk.MultiLevelManager:
        return sk.MultiLevelManager(_levels(tmp), node_of=_node_of, timeout=60, fingerprint=fingerprint)

    saver = manager(ARGS)
    for step in (2, 4):
        saver.save(row_sharded(step), step=step)
    saver.close()
    found = {
        "matching": _attempt(manager(ARGS)),
        "changed": _attempt(manager(CHANGED)),
        "allowed": _attempt(manager(CHANGED), allow_fingerprint_change=True),
        "ranks_disagree": _attempt(manager(ARGS if rank == 0 else CHANGED)),
        "allow_disagrees": _attempt(manager(ARGS), allow_fingerprint_change=rank == 1),
    }
    shutil.rmtree(f"{tmp}/node{rank}")  # every node loses its local level
    dist.barrier()
    found["shared_changed"] = _attempt(manager(CHANGED))
    found["shared_matching"] = _attempt(manager(ARGS))
    return found


def test_two_ranks_refuse_a_changed_model_arg_alike(tmp_path: Path) -> None:
    ranks = results_or_raise(run_ranks(2, _two_ranks, str(tmp_path), outbox=tmp_path / "out", timeout=240))
    for found in ranks:
        assert found["matching"] == ("ok", "", 4, True)
        assert found["allowed"] == ("ok", "", 4, True)
        assert found["shared_matching"] == ("ok", "", 4, True)
        kind, message, _, untouched = found["changed"]
        assert kind == "FingerprintMismatchError" and untouched
        assert "step 4 (levels 'local', 'persistent')" in message
        assert "model_args.n_layer: checkpoint 2, now 3" in message
        kind, message, _, untouched = found["shared_changed"]
        assert kind == "FingerprintMismatchError" and untouched
        assert "step 4 (level 'persistent')" in message
        kind, message, _, _ = found["ranks_disagree"]
        assert kind == "ConfigError" and "rank 1 restores with other model args or config" in message
        assert "model_args.n_layer" in message
        kind, message, _, _ = found["allow_disagrees"]
        assert kind == "ConfigError" and "allow_fingerprint_change" in message
    assert ranks[0]["changed"][1] == ranks[1]["changed"][1]  # the same verdict, word for word
