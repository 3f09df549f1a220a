"""Tensor families (format 2.1): detection then expansion is the identity, lookup by key agrees
with a dict of the expanded keys, and validation refuses malformed or huge families."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkeep.manifest.families import (
    FamilyIndex,
    detect_tensor_families,
    expand_tensor_family,
    family_problems,
)
from shardkeep.manifest.schema import ShardedTensor, TensorEntry, TensorFamily


def _tensor(key: str, path: list[str | int], order: int = 0, expert: list[int] | None = None) -> ShardedTensor:
    return ShardedTensor(
        key=key,
        path=path,
        dtype="F32",
        global_shape=[8, 4],
        mesh=0,
        placements=["S0"],
        kind="expert" if expert is not None else "dense",
        expert_key=expert,
        order=order,
    )


def _roundtrip(tensors: list[ShardedTensor]) -> tuple[list[TensorFamily], list[ShardedTensor]]:
    families, singles = detect_tensor_families(tensors)
    for family in families:
        assert family_problems(family, 10**6) == []
        # a family survives its own encoding
        assert msgspec.json.decode(msgspec.json.encode(family), type=TensorFamily) == family
    expanded = [t for f in families for t in expand_tensor_family(f)] + singles
    key = lambda t: t.key  # noqa: E731
    assert sorted(expanded, key=key) == sorted(tensors, key=key)
    index = FamilyIndex(families)
    members = {t.key: t for f in families for t in expand_tensor_family(f)}
    for tensor in tensors:
        assert index.find(tensor.key) == members.get(tensor.key)
    return families, singles


def test_moe_tree_becomes_one_family() -> None:
    tensors = [
        _tensor(
            f"model.layers.{layer}.mlp.experts.{e}.w{w}",
            ["model", "layers", str(layer), "mlp", "experts", str(e), f"w{w}"],
            order=1000 * layer + 10 * e + w,
            expert=[1, layer, e],
        )
        for layer in range(6)
        for e in range(8)
        for w in (1, 2, 3)
    ]
    tensors.append(_tensor("model.embed.weight", ["model", "embed", "weight"]))
    families, singles = _roundtrip(tensors)
    assert len(families) == 1 and [t.key for t in singles] == ["model.embed.weight"]
    assert families[0].key == "model.layers.{0}.mlp.experts.{1}.w{2}"
    assert families[0].order_steps == [1000, 10, 1]
    assert families[0].expert_key == [1, "{0}", "{1}"]


def test_integer_optimizer_ids_are_integer_path_parts() -> None:
    tensors = [_tensor(f"optim.state.{i}.exp_avg", ["optim", "state", i, "exp_avg"], order=i) for i in range(0, 40, 2)]
    families, singles = _roundtrip(tensors)
    assert singles == [] and families[0].int_parts == [2] and families[0].path[2] == "{0}"


def test_hostile_keys_round_trip_or_stay_single() -> None:
    tensors = [
        _tensor("layers.01.w", ["layers", "01", "w"]),
        _tensor("layers.02.w", ["layers", "02", "w"]),
        _tensor("a{0}.1.b}", ["a{0}", "1", "b}"]),
        _tensor("a{0}.2.b}", ["a{0}", "2", "b}"]),
        _tensor("x12y", ["x12y"]),
        _tensor("x13y", ["x13y"]),
        _tensor("big.4294967296", ["big", "4294967296"]),
        _tensor("big.4294967297", ["big", "4294967297"]),
        _tensor("odd.1", ["odd", "1"]),
        _tensor("odd.2", ["odd", "2"]),
        _tensor("odd.4", ["odd", "4"]),
    ]
    families, singles = _roundtrip(tensors)
    assert {t.key for t in singles} >= {"layers.01.w", "layers.02.w", "big.4294967296", "big.4294967297"}
    assert any(f.key == "a{{0}}.{0}.b}}" for f in families)


def test_find_rejects_near_misses() -> None:
    families, _ = detect_tensor_families([_tensor(f"l.{i}.w", ["l", str(i), "w"]) for i in range(0, 10, 3)])
    index = FamilyIndex(families)
    assert index.find("l.3.w") is not None
    for key in ("l.4.w", "l.03.w", "l.12.w", "l.3.v", "l.3", "x"):
        assert index.find(key) is None


_SEGMENT = st.sampled_from(["a", "b.", ".", "{", "}", "{{", "x{0}", "_", "0", "01", "7"])


@st.composite
def _key_sets(draw: st.DrawFn) -> list[ShardedTensor]:
    prefix = draw(st.lists(_SEGMENT, max_size=3).map("".join))
    middle = draw(st.lists(_SEGMENT, min_size=1, max_size=2).map("".join))
    suffix = draw(st.lists(_SEGMENT, max_size=3).map("".join))
    starts = draw(st.tuples(st.integers(0, 12), st.integers(0, 12)))
    steps = draw(st.tuples(st.integers(1, 3), st.integers(1, 3)))
    counts = draw(st.tuples(st.integers(1, 4), st.integers(1, 4)))
    affine = draw(st.booleans())
    int_path = draw(st.booleans())
    drop = draw(st.sets(st.integers(0, 15), max_size=3))
    out: dict[str, ShardedTensor] = {}
    n = 0
    for i in range(starts[0], starts[0] + steps[0] * counts[0], steps[0]):
        for j in range(starts[1], starts[1] + steps[1] * counts[1], steps[1]):
            n += 1
            if n in drop:
                continue
            path: list[str | int] = [prefix or "p", i if int_path else str(i), f"{middle}{j}{suffix}"]
            key = ".".join(map(str, path))
            order = 5 + 3 * i + j if affine else draw(st.integers(0, 50))
            out[key] = _tensor(key, path, order=order)
    extra = draw(st.lists(st.tuples(_SEGMENT, st.integers(0, 120)), max_size=4))
    for segment, value in extra:
        extra_path: list[str | int] = [prefix or "p", value, segment]
        key = ".".join(map(str, extra_path))
        out.setdefault(key, _tensor(key, extra_path))
    return list(out.values())


@settings(max_examples=300, deadline=None)
@given(_key_sets())
def test_detect_then_expand_is_the_identity(tensors: list[ShardedTensor]) -> None:
    _roundtrip(tensors)


def _family(**changes: object) -> TensorFamily:
    fields: dict[str, object] = {
        "key": "l.{0}.e.{1}",
        "path": ["l", "{0}", "e", "{1}"],
        "indices": [[0, 4, 1], [0, 8, 2]],
        "dtype": "F32",
        "global_shape": [4],
        "mesh": 0,
        "placements": ["S0"],
    }
    fields.update(changes)
    return TensorFamily(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"indices": [[0, 2**31, 1], [0, 2**31, 1]]}, "more instances"),
        ({"indices": [[0, 0, 1], [0, 8, 2]]}, "empty"),
        ({"indices": [[0, 4, 0], [0, 8, 2]]}, "empty"),
        ({"indices": [[0, 4], [0, 8, 2]]}, "[start, stop, step]"),
        ({"key": "l.{0}{1}"}, "next to a digit"),
        ({"key": "l.{0}7.e.{1}"}, "next to a digit"),
        ({"key": "l.{0}.e.{0}"}, "exactly once"),
        ({"key": "l.{0}.e"}, "exactly once"),
        ({"key": "l.{0.e.{1}"}, "template"),
        ({"key": "l.{00}.e.{1}"}, "placeholder"),
        ({"path": ["l", "{2}"]}, "no index range"),
        ({"path": ["l", "{0}", "e", "{1}", "x"]}, "joined with dots"),
        ({"int_parts": [0]}, "lone placeholder"),
        ({"expert_key": [1, "{5}"]}, "expert key"),
        ({"order_steps": [1]}, "one step per"),
        ({"order": 2**63 - 2, "order_steps": [1, 1]}, "2**63"),
        ({"order": 0, "order_steps": [-1, 0]}, "2**63"),
    ],
)
def test_validation_refuses(changes: dict[str, object], message: str) -> None:
    problems = family_problems(_family(**changes), 10**6)
    assert any(message in p for p in problems), problems


def test_valid_family_expands_row_major() -> None:
    family = _family(int_parts=[1], order=3, order_steps=[10, 1])
    assert family_problems(family, 16) == []
    assert family_problems(family, 15) != []
    keys = [(t.key, t.path, t.order) for t in expand_tensor_family(family)]
    assert keys[:2] == [("l.0.e.0", ["l", 0, "e", "0"], 3), ("l.0.e.2", ["l", 0, "e", "2"], 4)]
    assert len(keys) == 16


def _brute_overlap(a: TensorFamily, b: TensorFamily) -> bool:
    return bool({t.key for t in expand_tensor_family(a)} & {t.key for t in expand_tensor_family(b)})


_RANGE = st.tuples(st.integers(0, 30), st.integers(1, 12), st.integers(1, 7)).map(lambda t: [t[0], t[0] + t[1], t[2]])


@settings(max_examples=300, deadline=None)
@given(_RANGE, _RANGE, _RANGE, _RANGE, st.sampled_from(["l.{0}.e.{1}", "l.{0}.e.3", "l.4.e.{1}"]))
def test_overlap_agrees_with_expansion(r1: list[int], r2: list[int], r3: list[int], r4: list[int], other: str) -> None:
    from shardkeep.manifest.families import families_overlap

    a = _family(indices=[r1, r2])
    n = other.count("{")
    key = other.replace("{1}", "{0}") if n == 1 and "{1}" in other else other
    b = _family(key=key, path=key.split("."), indices=[r3, r4][:n])
    assert family_problems(b, 10**6) == []
    assert families_overlap(a, b) == _brute_overlap(a, b)


def test_family_set_refuses_collisions_and_huge_totals() -> None:
    from shardkeep.manifest.families import family_set_problems, instances_within

    a = _family()
    assert family_set_problems([a], ["l.0.e.1", "other"], 10**6) == []
    assert any("listed again" in p for p in family_set_problems([a], ["l.3.e.6"], 10**6))
    b = _family(indices=[[3, 9, 1], [6, 7, 1]])
    assert any("share an instance key" in p for p in family_set_problems([a, b], [], 10**6))
    c = _family(indices=[[4, 9, 1], [0, 8, 2]])
    assert family_set_problems([a, c], [], 10**6) == []
    assert instances_within([a, c], 50) == 36 and instances_within([a, c], 30) == 31
    huge = _family(indices=[[0, 2**31, 1], [0, 2**31, 1]])
    assert instances_within([huge], 10**6) == 10**6 + 1


def _indexed(families: list[TensorFamily], sharded: list[ShardedTensor] | None = None) -> object:
    from shardkeep.manifest import IndexedManifest
    from shardkeep.manifest.schema import INDEXED_VERSION, IndexTable, Mesh, Sharding

    return IndexedManifest(
        metadata_version=INDEXED_VERSION,
        meshes=[Mesh(shape=[1])],
        indexes=IndexTable(algorithm="blake3", ranks=[0], sizes=[10], digests=["0" * 64]),
        families=families,
        sharded=sharded or [],
        sharding=Sharding(shard_count=1),
    )


def _errors(manifest: object) -> list[str]:
    from shardkeep.manifest import validate_entries_one_by_one, validate_manifest

    fast, slow = validate_manifest(manifest), validate_entries_one_by_one(manifest)  # type: ignore[arg-type]
    assert fast.errors == slow.errors
    return fast.errors


def test_manifest_validation_checks_families_without_expanding_them() -> None:
    from shardkeep.manifest.schema import ContainerEntry, ValueEntry

    assert _errors(_indexed([_family()])) == []
    clash = _tensor("l.2.e.4", ["l", "2", "e", "4"])
    errors = _errors(_indexed([_family()], [clash]))
    assert any("listed again" in e for e in errors), errors
    manifest = _indexed([_family()])
    manifest.values = [ValueEntry(key="l.3.e.6", path=["l", "3", "e", "6"], value=1)]  # type: ignore[attr-defined]
    assert any("listed again" in e for e in _errors(manifest))
    errors = _errors(_indexed([_family(), _family(indices=[[3, 5, 1], [4, 5, 1]])]))
    assert any("share an instance key" in e for e in errors)
    errors = _errors(_indexed([_family(key="l.{0}{1}")]))
    assert any("next to a digit" in e for e in errors)
    errors = _errors(_indexed([_family(dtype="F99", placements=["S7"], mesh=0)]))
    assert any("unknown dtype" in e for e in errors) and any("placements" in e for e in errors), errors
    errors = _errors(_indexed([_family(mesh=3)]))
    assert any("mesh 3" in e for e in errors), errors
    # When structure lists containers, every instance's parent must be one.
    manifest = _indexed([_family()])
    parents = [["l", str(i), "e"] for i in range(4)]
    manifest.structure = [
        ContainerEntry(path=[]),
        ContainerEntry(path=["l"]),
        *(ContainerEntry(path=p) for p in [*[["l", str(i)] for i in range(4)], *parents]),
    ]  # type: ignore[attr-defined]
    assert _errors(manifest) == []
    manifest.structure = manifest.structure[:-1]  # type: ignore[attr-defined]
    errors = _errors(manifest)
    assert any("instance parent(s) are not containers" in e and "'l.3.e'" in e for e in errors), errors


def test_family_parents_are_built_over_the_placeholders_they_use() -> None:
    from shardkeep.manifest.families import family_parents

    family = _family(key="l.{0}.e.{1}.w", path=["l", "{0}", "e", "{1}", "w"])
    assert family_parents(family) == {("l", str(i), "e", str(j)) for i in range(4) for j in range(0, 8, 2)}
    assert family_parents(_family()) == {("l", str(i), "e") for i in range(4)}
    ints = _family(key="s.{0}.x", path=["s", "{0}", "x"], int_parts=[1], indices=[[0, 6, 3]])
    assert family_parents(ints) == {("s", 0), ("s", 3)}


def test_family_instances_count_toward_max_tensors_on_decode() -> None:
    from shardkeep.config import ManifestLimits
    from shardkeep.errors import ManifestError
    from shardkeep.integrity import seal_manifest
    from shardkeep.manifest import decode_manifest, encode_manifest

    data = seal_manifest(encode_manifest(_indexed([_family()])), "blake3")  # type: ignore[arg-type]
    assert decode_manifest(data, limits=ManifestLimits(max_tensors=16)).families == [_family()]  # type: ignore[union-attr]
    with pytest.raises(ManifestError, match="over the limit"):
        decode_manifest(data, limits=ManifestLimits(max_tensors=15))
    huge = seal_manifest(encode_manifest(_indexed([_family(indices=[[0, 2**31, 1]] * 2)])), "blake3")  # type: ignore[arg-type]
    with pytest.raises(ManifestError, match="over the limit"):
        decode_manifest(huge)


def _entry(key: str, path: list[str | int], offset: int, order: int, expert: list[int] | None = None) -> TensorEntry:
    return TensorEntry(
        key=key,
        path=path,
        dtype="F32",
        shape=[],
        offset=offset,
        nbytes=4,
        order=order,
        kind="expert" if expert is not None else "dense",
        expert_key=expert,
    )


def test_entry_families_round_trip_offsets_orders_and_expert_keys() -> None:
    from shardkeep.manifest.families import detect_entry_families, expand_entry_family

    entries = [_entry(f"optim.state.{i}.step", ["optim", "state", i, "step"], 100 + 8 * i, 7 + 3 * i) for i in range(6)]
    entries += [
        _entry(
            f"o.l.{layer}.experts.{e}.step",
            ["o", "l", str(layer), "experts", str(e), "step"],
            1000 + 32 * layer + 8 * e,
            50 + 4 * e + 100 * layer,
            [1, layer, e],
        )
        for layer in range(3)
        for e in range(4)
    ]
    entries += [_entry(f"x.{i}.s", ["x", str(i), "s"], 2000 + 4 * i, 1) for i in (0, 1, 2, 5)]  # no range: singles
    entries.append(_entry("lone", ["lone"], 0, 0))
    entries.append(msgspec.structs.replace(entries[0], key="d.0", path=["d", "0"], digest="blake3:" + "0" * 64))
    entries.append(msgspec.structs.replace(entries[0], key="d.1", path=["d", "1"], digest="blake3:" + "0" * 64))
    families, singles = detect_entry_families(entries)
    expanded = [e for f in families for e in expand_entry_family(f)] + singles
    assert sorted(expanded, key=lambda e: e.key) == sorted(entries, key=lambda e: e.key)
    assert sorted(f.key for f in families) == ["o.l.{0}.experts.{1}.step", "optim.state.{0}.step"]
    moe = next(f for f in families if f.key.startswith("o."))
    assert moe.offset_steps == [32, 8] and moe.expert_key == [1, "{0}", "{1}"] and moe.kind == "expert"
    assert {e.key for e in singles} == {"x.0.s", "x.1.s", "x.2.s", "x.5.s", "lone", "d.0", "d.1"}  # digests: never


def test_decoding_expands_entry_families_and_refuses_bad_ones() -> None:
    from shardkeep.config import ManifestLimits
    from shardkeep.errors import ManifestError
    from shardkeep.integrity import seal_manifest
    from shardkeep.manifest import FileRecord, decode_manifest, encode_manifest
    from shardkeep.manifest.schema import EntryFamily

    family = EntryFamily(
        key="s.{0}.step",
        path=["s", "{0}", "step"],
        int_parts=[1],
        indices=[[0, 4, 1]],
        dtype="F32",
        shape=[],
        nbytes=4,
        offset=16,
        offset_steps=[8],
        order=3,
        order_steps=[2],
    )
    lone = _entry("s.x", ["s", "x"], 8, 1)
    manifest = _indexed([])
    manifest.files = [FileRecord(path="a.safetensors", rank=0, size=64, digest=None, tensors=[lone], families=[family])]  # type: ignore[attr-defined]
    decoded = decode_manifest(seal_manifest(encode_manifest(manifest), "blake3"))  # type: ignore[arg-type]
    record = decoded.files[0]
    assert record.families == []
    assert [(e.key, e.path, e.offset, e.order) for e in record.tensors] == [
        ("s.x", ["s", "x"], 8, 1),
        *((f"s.{i}.step", ["s", i, "step"], 16 + 8 * i, 3 + 2 * i) for i in range(4)),
    ]
    with pytest.raises(ManifestError, match="over the limit"):
        decode_manifest(seal_manifest(encode_manifest(manifest), "blake3"), limits=ManifestLimits(max_tensors=4))  # type: ignore[arg-type]
    manifest.files[0].families = [msgspec.structs.replace(family, offset_steps=[-8])]  # type: ignore[attr-defined]
    with pytest.raises(ManifestError, match="byte offsets"):
        decode_manifest(seal_manifest(encode_manifest(manifest), "blake3"))  # type: ignore[arg-type]
    manifest.files[0].families = [msgspec.structs.replace(family, key="s.{0}{0}.step")]  # type: ignore[attr-defined]
    with pytest.raises(ManifestError, match=r"a\.safetensors"):
        decode_manifest(seal_manifest(encode_manifest(manifest), "blake3"))  # type: ignore[arg-type]
