"""The manifest validator's column-at-a-time checks: for any manifest they give exactly the errors
and warnings of the entry-by-entry checks (which word every problem), and real checkpoints take
them. The decoder's typed fast path and its strict path agree (tests/test_manifest.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardkeep as sk
from shardkeep.config import ManifestLimits
from shardkeep.manifest import (
    DTYPE_ITEMSIZE,
    Compression,
    ContainerEntry,
    FileRecord,
    Manifest,
    Sharding,
    TensorEntry,
    ValidationResult,
    ValueEntry,
    key_for_path,
    validate_entries_one_by_one,
    validate_manifest,
)
from shardkeep.manifest.validate import check_file_tensors
from shardkeep.manifest.validate_columns import TensorTable, tensors_pass

BLAKE3 = "blake3:" + "ab" * 32
XXH3 = "xxh3-128:" + "cd" * 16
BLOCK = 16 * 1024
ZSTD = Compression(codec="zstd", level=3, stored_size=10)


def both_ways(manifest: Manifest, limits: ManifestLimits | None = None) -> tuple[ValidationResult, ValidationResult]:
    """The results with the column checks of tensor entries and parents, and without them."""
    fast = validate_manifest(manifest, limits=limits)
    slow = validate_entries_one_by_one(manifest, limits=limits)
    return fast, slow


def column_checks_pass(manifest: Manifest, limits: ManifestLimits | None = None) -> bool:
    table = TensorTable(manifest.files)
    return bool(tensors_pass(manifest.files, table, limits or ManifestLimits()))


def entry_checks(manifest: Manifest, limits: ManifestLimits | None = None) -> ValidationResult:
    """What the entry-by-entry checks of every file's tensor entries find."""
    result = ValidationResult()
    seen_keys: dict[tuple[str, tuple[int, ...]], str] = {}
    for record in manifest.files:
        check_file_tensors(record, f"file {record.path!r}", limits or ManifestLimits(), seen_keys, result)
    return result


# -- generated manifests: mostly valid entries, each with a chance of one problem ---------------------

COMPONENTS = st.one_of(st.sampled_from(["a", "b", "w.x", "layers", "\0", ""]), st.integers(0, 2))
HUGE = 2**64 + 3


@st.composite
def tensor_entries(draw: Any, offset: int) -> TensorEntry:
    path: list[str | int] = draw(st.lists(COMPONENTS, min_size=1, max_size=3))
    dtype = draw(st.sampled_from(["F32", "BF16", "I64", "U8", "F99"]))
    shape: list[int] = draw(st.lists(st.integers(0, 4), min_size=0, max_size=3))
    itemsize = DTYPE_ITEMSIZE.get(dtype, 4)
    count = 1
    for dimension in shape:
        count *= dimension
    entry = TensorEntry(
        key=key_for_path(path), path=path, dtype=dtype, shape=shape, offset=offset, nbytes=count * itemsize
    )
    if draw(st.integers(0, 7)):
        return entry  # most entries are left valid, so that one problem decides
    problem = draw(
        st.sampled_from(
            [
                "key",
                "long_key",
                "deep_path",
                "root_path",
                "ndim",
                "negative_dim",
                "huge_dim",
                "empty_huge",
                "nbytes",
                "negative_offset",
                "huge_offset",
                "beyond_file",
                "float_offset",
                "digest",
                "bad_digest",
                "empty_digest",
                "expert",
                "expert_keyed",
                "chunk",
                "half_chunk",
                "chunk_outside",
                "chunk_rank",
                "numpy_chunk",
                "huge_global",
                "blocks",
                "bad_blocks",
            ]
        )
    )
    if problem == "key":
        entry.key += draw(st.sampled_from(["x", ".", "\0"]))
    elif problem == "long_key":
        entry.key = entry.key + "k" * draw(st.sampled_from([1030, 5000]))
        entry.path = [entry.key]
    elif problem == "deep_path":
        entry.path = ["p"] * 70
        entry.key = key_for_path(entry.path)
    elif problem == "root_path":
        entry.path, entry.key = [], draw(st.sampled_from(["", "x"]))
    elif problem == "ndim":
        entry.shape = [1] * 70
    elif problem == "negative_dim":
        entry.shape = [*shape, -1]
    elif problem == "huge_dim":
        entry.shape, entry.nbytes = [HUGE], HUGE * itemsize
    elif problem == "empty_huge":
        entry.shape, entry.nbytes = [0, 2**62, 16], 0
    elif problem == "nbytes":
        entry.nbytes += draw(st.sampled_from([1, -1, HUGE]))
    elif problem == "negative_offset":
        entry.offset = -8
    elif problem == "huge_offset":
        entry.offset = 2**63 + draw(st.integers(0, 2))
    elif problem == "beyond_file":
        entry.offset += 10**6
    elif problem == "float_offset":
        entry.offset = float(entry.offset)  # a manifest built in Python can hold anything
    elif problem == "digest":
        entry.digest = draw(st.sampled_from([BLAKE3, XXH3]))
    elif problem == "bad_digest":
        entry.digest = draw(st.sampled_from(["md5:00", BLAKE3.upper(), BLAKE3 + "\n" + BLAKE3, "blake3:"]))
    elif problem == "empty_digest":
        entry.digest = ""
    elif problem == "blocks":  # valid in a file of 16 KiB blocks, an error in one without blocks
        entry.blocks = b"\1" * (-(-entry.nbytes // BLOCK) * draw(st.sampled_from([16, 48])))
    elif problem == "bad_blocks":
        entry.blocks = b"\1" * draw(st.sampled_from([1, 15, 32, 47, 49, 96]))
    elif problem in ("expert", "expert_keyed"):
        entry.kind = "expert"
        entry.expert_key = [1, 0, 1] if problem == "expert_keyed" else None
    elif problem.startswith("chunk") or problem in ("half_chunk", "numpy_chunk", "huge_global"):
        entry.global_shape = [dimension * 2 for dimension in shape]
        entry.global_offset = [draw(st.sampled_from([0, dimension])) for dimension in shape]
        if problem == "half_chunk":
            entry.global_offset = None
        elif problem == "chunk_outside":
            entry.global_offset = [dimension * 2 + 1 for dimension in shape]
        elif problem == "chunk_rank":
            entry.global_shape = [*entry.global_shape, 1]
        elif problem == "numpy_chunk":
            entry.array_type = "numpy"
        elif problem == "huge_global":
            entry.global_shape = [2**62, 8, *entry.global_shape]
            entry.global_offset = [0, 0, *entry.global_offset]
            entry.shape = [1, 1, *shape]
    return entry


@st.composite
def manifests(draw: Any) -> Manifest:
    files = []
    for file_index in range(draw(st.integers(1, 3))):
        tensors: list[TensorEntry] = []
        offset = 64
        for _ in range(draw(st.integers(0, 6))):
            entry = draw(tensor_entries(offset))
            tensors.append(entry)
            if isinstance(entry.nbytes, int) and 0 <= entry.nbytes < 10**6:
                offset += entry.nbytes if draw(st.integers(0, 9)) else 0  # sometimes overlapping
        if tensors and not draw(st.integers(0, 3)):
            tensors.append(tensors[draw(st.integers(0, len(tensors) - 1))])  # a duplicate key
        if draw(st.booleans()):
            tensors.reverse()  # listed out of byte order
        files.append(
            FileRecord(
                path=f"shards/rank_{file_index:05d}.safetensors",
                rank=0,
                size=offset,
                digest=BLAKE3,
                tensors=tensors,
                block_size=draw(st.sampled_from([0, BLOCK, BLOCK, 3])),
                compression=draw(st.sampled_from([None, None, None, ZSTD])),
            )
        )
    structure: list[ContainerEntry] = []
    if draw(st.booleans()):
        structure = [ContainerEntry(path=[])] + [ContainerEntry(path=[name]) for name in draw(st.sets(COMPONENTS))]
    values = [
        ValueEntry(key=key_for_path(path), path=path, value=1)
        for path in draw(st.lists(st.lists(COMPONENTS, min_size=1, max_size=2), max_size=2))
    ]
    return Manifest(sharding=Sharding(shard_count=len(files)), files=files, structure=structure, values=values)


LIMITS = st.sampled_from(
    [None, ManifestLimits(max_key_bytes=8, max_ndim=2, max_path_components=2), ManifestLimits(max_key_bytes=4100)]
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(manifest=manifests(), limits=LIMITS)
def test_column_checks_give_exactly_the_entry_by_entry_results(
    manifest: Manifest, limits: ManifestLimits | None
) -> None:
    try:
        fast, slow = both_ways(manifest, limits)
    except TypeError:  # a float offset can break the entry-by-entry checks; then both must fail
        with pytest.raises(TypeError):
            validate_entries_one_by_one(manifest, limits=limits)
        assert not column_checks_pass(manifest, limits)
        return
    assert fast.errors == slow.errors
    assert fast.warnings == slow.warnings
    # The column pass's contract: it never passes what the entry-by-entry checks refuse.
    if column_checks_pass(manifest, limits):
        entries = entry_checks(manifest, limits)
        assert entries.errors == [] and entries.warnings == []


@pytest.mark.parametrize(
    ("entry", "clean"),
    [
        (TensorEntry(key="a", path=["a"], dtype="F32", shape=[2, 3], offset=0, nbytes=24), True),
        (TensorEntry(key="a.0.b", path=["a", 0, "b"], dtype="BF16", shape=[], offset=0, nbytes=2), True),
        (TensorEntry(key="e", path=["e"], dtype="U8", shape=[0, 5], offset=0, nbytes=0), True),
        (TensorEntry(key="a", path=["a"], dtype="F32", shape=[2, 3], offset=0, nbytes=20), False),
        (TensorEntry(key="a", path=["a"], dtype="F32", shape=[2, 3], offset=-4, nbytes=24), False),
        (TensorEntry(key="a", path=["a"], dtype="F32", shape=[2, -3], offset=0, nbytes=-24), False),
        (TensorEntry(key="a", path=["b"], dtype="F32", shape=[2], offset=0, nbytes=8), False),
        (TensorEntry(key="a", path=["a"], dtype="F99", shape=[2], offset=0, nbytes=8), False),
        (TensorEntry(key="a", path=["a"], dtype="F32", shape=[2], offset=0, nbytes=8, digest="blake3:ab"), False),
        (TensorEntry(key="a", path=["a"], dtype="F32", shape=[2], offset=0, nbytes=8, kind="expert"), False),
        (TensorEntry(key="a", path=["a"], dtype="F32", shape=[2**40, 2**40], offset=0, nbytes=2**82 * 4), False),
    ],
)
def test_column_checks_pass_exactly_the_clean_entries(entry: TensorEntry, clean: bool) -> None:
    manifest = Manifest(
        sharding=Sharding(shard_count=1),
        files=[FileRecord(path="f", rank=0, size=4096, digest=BLAKE3, tensors=[entry])],
    )
    assert column_checks_pass(manifest) is clean
    fast, slow = both_ways(manifest)
    assert (fast.errors, fast.warnings) == (slow.errors, slow.warnings)
    assert (not fast.errors and not fast.warnings) is clean


def test_saved_checkpoints_take_the_column_checks(tmp_path: Path) -> None:
    """A module with an optimizer (integer path components, mixed dtypes, so byte ranges listed
    out of order), sharded chunks and expert tensors: all pass the column checks."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    state = {
        "model": model,
        "optim": optimizer,
        "ids": torch.arange(5),
        "half": torch.zeros(3, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(1.5),
    }
    sk.save(state, tmp_path / "c")
    manifest = sk.read_manifest(tmp_path / "c")
    assert column_checks_pass(manifest)
    assert any(isinstance(part, int) for _, entry in manifest.iter_tensors() for part in entry.path)

    chunked = Manifest(
        world_size=2,
        sharding=Sharding(shard_count=2),
        files=[
            FileRecord(
                path=f"shards/rank_{rank:05d}.safetensors",
                rank=rank,
                size=4096,
                digest=BLAKE3,
                tensors=[
                    TensorEntry(
                        key="w",
                        path=["w"],
                        dtype="BF16",
                        shape=[8, 16],
                        offset=128,
                        nbytes=256,
                        global_shape=[16, 16],
                        global_offset=[8 * rank, 0],
                        digest=BLAKE3,
                    ),
                    TensorEntry(
                        key=f"experts.{rank}.w",
                        path=["experts", f"{rank}.w"],
                        dtype="F32",
                        shape=[4],
                        offset=384,
                        nbytes=16,
                        kind="expert",
                        expert_key=[1, 0, rank],
                    ),
                ],
            )
            for rank in range(2)
        ],
    )
    assert column_checks_pass(chunked)
    fast, slow = both_ways(chunked)
    assert fast.errors == slow.errors == [] and fast.warnings == slow.warnings == []


def test_parent_checks_agree() -> None:
    manifest = Manifest(
        structure=[ContainerEntry(path=[]), ContainerEntry(path=["m"]), ContainerEntry(path=["x", "y"])],
        files=[
            FileRecord(
                path="f",
                rank=0,
                size=64,
                digest=BLAKE3,
                tensors=[
                    TensorEntry(key="m.w", path=["m", "w"], dtype="U8", shape=[1], offset=0, nbytes=1),
                    TensorEntry(key="n.w", path=["n", "w"], dtype="U8", shape=[1], offset=1, nbytes=1),
                ],
            )
        ],
        sharding=Sharding(shard_count=1),
        values=[ValueEntry(key="v", path=["v"], value=1), ValueEntry(key="q.v", path=["q", "v"], value=1)],
    )
    fast, slow = both_ways(manifest)
    assert fast.errors == slow.errors
    assert any("3 state path(s) have no parent container" in error for error in fast.errors)
    manifest.structure.append(ContainerEntry(path=["n"]))
    manifest.structure.append(ContainerEntry(path=["q"]))
    manifest.structure.append(ContainerEntry(path=["x"]))
    fast, slow = both_ways(manifest)
    assert fast.errors == slow.errors == []


def clean_manifest() -> Manifest:
    """Two files of valid entries: nested paths with integer components, mixed dtypes listed out
    of byte order, an empty tensor, digests, an expert tensor and the chunks of a sharded one."""

    def chunk(rank: int) -> TensorEntry:
        return TensorEntry(
            key="w",
            path=["w"],
            dtype="BF16",
            shape=[8, 16],
            offset=512,
            nbytes=256,
            global_shape=[16, 16],
            global_offset=[8 * rank, 0],
            digest=XXH3,
            blocks=b"\1" * 48,
        )

    first = [
        TensorEntry(key="m.l.0.w", path=["m", "l", 0, "w"], dtype="F32", shape=[2, 3], offset=64, nbytes=24),
        TensorEntry(key="o.state.0.step", path=["o", "state", 0, "step"], dtype="I64", shape=[], offset=0, nbytes=8),
        TensorEntry(key="m.empty", path=["m", "empty"], dtype="F32", shape=[0, 4], offset=88, nbytes=0),
        TensorEntry(key="m.b", path=["m", "b"], dtype="BF16", shape=[4], offset=88, nbytes=8, digest=BLAKE3),
        TensorEntry(
            key="x.1.w",
            path=["x", "1.w"],
            dtype="U8",
            shape=[3],
            offset=96,
            nbytes=3,
            kind="expert",
            expert_key=[1, 0, 1],
        ),
        chunk(0),
    ]
    second = [TensorEntry(key="m.l.1.w", path=["m", "l", 1, "w"], dtype="F32", shape=[2], offset=0, nbytes=8), chunk(1)]
    return Manifest(
        sharding=Sharding(shard_count=2),
        files=[
            FileRecord(path="a", rank=0, size=1024, digest=BLAKE3, tensors=first, block_size=BLOCK, fast_digest=XXH3),
            FileRecord(path="b", rank=0, size=1024, digest=BLAKE3, tensors=second, block_size=BLOCK),
        ],
        structure=[ContainerEntry(path=path) for path in ([], ["m"], ["m", "l"], ["o"], ["o", "state"], ["x"])]
        + [
            ContainerEntry(path=["m", "l", 0]),
            ContainerEntry(path=["m", "l", 1]),
            ContainerEntry(path=["o", "state", 0]),
        ],
    )


def _set(index: int, file: int = 0, **fields: Any) -> Any:
    def mutate(manifest: Manifest) -> None:
        for name, value in fields.items():
            setattr(manifest.files[file].tensors[index], name, value)

    return mutate


def _record(**fields: Any) -> Any:
    def mutate(manifest: Manifest) -> None:
        for name, value in fields.items():
            setattr(manifest.files[0], name, value)

    return mutate


def _nul_keys(manifest: Manifest) -> None:
    """Keys and components holding NULs that line up when joined: ``x.y\0z`` + ``w`` against
    ``x.y`` + ``z\0w``."""
    tensors = manifest.files[0].tensors
    tensors[0].path, tensors[0].key = ["x", "y\0z"], "x.y"
    tensors[1].path, tensors[1].key = ["w"], "z\0w"


def _overlap(manifest: Manifest) -> None:
    """Two ranges listed out of byte order that overlap: [60, 84) and [70, 78)."""
    manifest.files[0].tensors[0].offset = 60
    manifest.files[0].tensors[1].offset = 70


def _only_root_parents(manifest: Manifest) -> None:
    manifest.structure = [ContainerEntry(path=["m"])]
    for record in manifest.files:
        for entry in record.tensors:
            entry.path = [entry.key]


ONE_PROBLEM = {
    "clean": lambda m: None,
    "overlap": _overlap,
    "overlap-in-order": _set(3, offset=80),
    "duplicate-key": _set(0, file=1, path=["m", "l", 0, "w"], key="m.l.0.w"),
    "duplicate-chunk": _set(1, file=1, global_offset=[0, 0]),
    "key-not-path": _set(0, key="m.l.0.v"),
    "nul-keys": _nul_keys,
    "root-parent-missing": _only_root_parents,
    "digest": _set(3, digest="blake3:" + "AB" * 32),
    "digest-newline": _set(3, digest=BLAKE3 + "\n" + BLAKE3),
    "beyond-file": _set(4, offset=1023),
    "empty-huge": _set(2, shape=[0, 2**62, 4]),
    "expert-without-key": _set(4, expert_key=None),
    "chunk-outside": _set(5, global_offset=[9, 0]),
    "chunk-rank": _set(5, global_offset=[0]),
    "chunk-half": _set(5, global_offset=None),
    "chunk-numpy": _set(5, array_type="numpy"),
    "chunk-huge": _set(5, global_shape=[2**61, 16]),
    "nbytes": _set(0, nbytes=25),
    "negative-offset": _set(0, offset=-1),
    "negative-dimensions": _set(0, shape=[-2, -3]),  # their product matches nbytes
    "ndim": _set(1, shape=[1] * 65),
    "dtype": _set(1, dtype="F64X"),
    "blocks-fast-only": _set(5, blocks=b"\1" * 16),
    "blocks-length": _set(5, blocks=b"\1" * 47),
    "blocks-two": _set(5, blocks=b"\1" * 96),
    "blocks-on-whole": _set(0, blocks=b"\1" * 16),
    "blocks-on-empty": _set(2, blocks=b"\1" * 16),
    "blocks-no-block-size": _record(block_size=0),
    "blocks-odd-block-size": _record(block_size=3 * 1024),
    "blocks-compressed": _record(compression=ZSTD),
    "fast-digest": _record(fast_digest=BLAKE3),
}


@pytest.mark.parametrize("name", list(ONE_PROBLEM))
def test_each_problem_alone_is_found_as_entry_by_entry(name: str) -> None:
    manifest = clean_manifest()
    ONE_PROBLEM[name](manifest)
    fast, slow = both_ways(manifest)
    assert (fast.errors, fast.warnings) == (slow.errors, slow.warnings)
    clean = name in ("clean", "blocks-fast-only", "blocks-on-whole")
    assert not (fast.errors or fast.warnings) if clean else (fast.errors or fast.warnings), fast
    if clean:
        assert column_checks_pass(manifest)
