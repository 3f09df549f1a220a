"""Family detection's faster paths give exactly what the reference computation gives: key
skeletons built a dot-separated component at a time (cached) instead of from the whole key's
digit runs, range positions without a generator per member, and the coordinator's memo of the
last detections (``saving.manifest_build._LastDetection``)."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest

from shardkeep.manifest import INDEXED_VERSION, FileRecord, ShardedTensor, TensorEntry
from shardkeep.manifest import families as fam
from shardkeep.saving import manifest_build


def _reference_key_skeleton(member: object) -> tuple[tuple[object, ...], list[int]] | None:
    """The key skeleton from the whole key's digit runs, run by run (the reference partition for
    ``_key_skeleton``, which builds another but equivalent grouping key)."""
    parts = fam._RUNS.split(member.key)  # type: ignore[attr-defined]
    runs = parts[1::2]
    values = [int(run) if fam._canonical(run) else None for run in runs]
    digits = [value for value in values if value is not None]
    if not digits:
        return None
    texts = tuple(parts[0::2])
    key_shape = tuple(None if fam._canonical(run) else run for run in runs)
    path_shape = tuple(fam._component_shape(part) for part in member.path)  # type: ignore[attr-defined]
    expert = None if member.expert_key is None else len(member.expert_key)  # type: ignore[attr-defined]
    return (texts, key_shape, path_shape, member.kind, expert), digits  # type: ignore[attr-defined]


def _reference_positions(column: tuple[int, ...], start: int, _stop: int, step: int) -> tuple[int, ...]:
    return tuple((value - start) // step for value in column)


def _sharded(key: str, path: list[str | int], shape: list[int], mesh: int, order: int, expert: bool) -> ShardedTensor:
    return ShardedTensor(
        key=key,
        path=path,
        dtype="F32",
        global_shape=shape,
        mesh=mesh,
        placements=["S0"],
        kind="expert" if expert else "dense",
        expert_key=[1, int(key.split("experts.")[1].split(".")[0])] if expert else None,
        order=order,
    )


def _moe(layers: int = 6, experts: int = 16) -> Iterator[ShardedTensor]:
    """Per-expert MoE (fqn-keyed optimizer state) plus 405b-like stage meshes and odd keys."""
    order = 0
    for layer in range(layers):
        stage = layer * 4 // layers  # pipeline stages: each on its own mesh
        names = [(f"layers.{layer}.attention.wq.weight", [64, 64], stage, False)]
        names += [
            (f"layers.{layer}.moe.experts.{e}.w{w}", [32, 64], 4 + e // 4, True)
            for e in range(experts)
            for w in (1, 2, 3)
        ]
        for fqn, shape, mesh, expert in names:
            yield _sharded(f"model.{fqn}", ["model", fqn], shape, mesh, order, expert)
            order += 1
            for moment in ("exp_avg", "exp_avg_sq"):
                yield _sharded(
                    f"optim.state.{fqn}.{moment}", ["optim", "state", fqn, moment], shape, mesh, order, expert
                )
                order += 1
    odd = [
        "blocks.007.w",
        "blocks.008.w",
        "blocks.9.w",
        "big.3000000000.w",
        "big.3000000001.w",
        "v2.layer3x4.w",
        "v2.layer3x5.w",
    ]
    odd += ["e..1.w", "e..2.w", "f.{1}.7", "f.{1}.8", "g.1.2.3", "g.1.2.4", "h.\u0661.w", "h.\u0662.w"]
    for index, key in enumerate(odd):
        yield _sharded(key, key.split(".", 1), [8], 0, 10_000 + index, False)


def _dense(count: int = 40) -> Iterator[ShardedTensor]:
    """Dense, integer optimizer ids as integer path components."""
    for index in range(count):
        for moment in ("exp_avg", "exp_avg_sq"):
            shape = [16, 16] if index % 3 else [16]
            key = f"optim.state.{index}.{moment}"
            yield _sharded(
                key, ["optim", "state", index, moment], shape, 0, 2 * index + (moment == "exp_avg_sq"), False
            )


def _with_reference(monkeypatch: pytest.MonkeyPatch, work: functools.partial[object]) -> object:
    with monkeypatch.context() as patched:
        patched.setattr(fam, "_key_skeleton", _reference_key_skeleton)
        patched.setattr(fam, "_positions", _reference_positions)
        return work()


@pytest.mark.parametrize("tree", [_moe, _dense])
def test_tensor_detection_equals_the_reference(monkeypatch: pytest.MonkeyPatch, tree: object) -> None:
    tensors = list(tree())  # type: ignore[operator]
    tensors += tensors[:3]  # duplicate keys stay singletons
    found = fam.detect_tensor_families(tensors)
    assert found[0], "the tree has families"
    assert found == _with_reference(monkeypatch, functools.partial(fam.detect_tensor_families, tensors))


def test_entry_detection_equals_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    entries = [
        TensorEntry(key=key, path=path, dtype="F32", shape=[], offset=4 * index, nbytes=4, order=index)
        for index, (key, path) in enumerate(
            [(f"optim.state.{i}.step", ["optim", "state", i, "step"]) for i in range(50)]
            + [(f"optim.state.layers.{i}.w.step", ["optim", "state", f"layers.{i}.w", "step"]) for i in range(30)]
            + [("optim.state.x.007.step", ["optim", "state", "x.007", "step"])]
        )
    ]
    found = fam.detect_entry_families(entries)
    assert found[0]
    assert found == _with_reference(monkeypatch, functools.partial(fam.detect_entry_families, entries))


def test_the_memo_gives_the_same_families_for_an_equal_tree() -> None:
    first = list(_moe(layers=3))
    again = list(_moe(layers=3))  # equal, other objects
    cold = manifest_build.families_of(first)
    warm = manifest_build.families_of(again)
    assert warm == cold
    assert all(any(single is tensor for tensor in again) for single in warm[1])  # the new input's members
    assert warm[0][0] is not cold[0][0]  # new family objects
    changed = [*again[:-1], _sharded("other.1.w", ["other", "1.w"], [8], 0, 99_999, False)]
    assert manifest_build.families_of(changed) == fam_sorted(fam.detect_tensor_families(changed))


def fam_sorted(found: tuple[list[object], list[object]]) -> tuple[list[object], list[object]]:
    families, singles = found
    return sorted(families, key=lambda f: f.key), sorted(singles, key=lambda t: t.key)  # type: ignore[attr-defined]


def test_entry_families_detected_ahead_are_the_commits() -> None:
    entries = [
        TensorEntry(
            key=f"optim.state.w{i}.step",
            path=["optim", "state", f"w{i}", "step"],
            dtype="F32",
            shape=[],
            offset=8 * i,
            nbytes=4,
            order=i,
        )
        for i in range(40)
    ]
    record = FileRecord(
        path="shards/rank_00000.safetensors", size=400, digest="blake3:" + "0" * 64, rank=0, tensors=entries
    )
    manifest_build._ENTRY_DETECTION._results.clear()
    manifest_build.detect_entry_families_ahead([record], INDEXED_VERSION)
    assert len(manifest_build._ENTRY_DETECTION._results) == 1
    manifest_build.detect_entry_families_ahead([record], "2.0")  # another version: nothing detected
    assert len(manifest_build._ENTRY_DETECTION._results) == 1
    remembered = manifest_build._entry_families_of(record)
    manifest_build._ENTRY_DETECTION._results.clear()
    assert remembered == manifest_build._entry_families_of(record)
    assert remembered[0]
