"""What 2.1/1.4 writers record: the streaming block and dual digesters, every file's
``fast_digest``, ``block_size`` and its entries' ``blocks`` (equal to a recomputation from the
bytes on disk), compressed files without blocks, ``WriteOptions(block_size=0)`` writing exactly
2.0/1.3, incremental references gaining 2.1 digests, and signing refusing fast-only chunk
blocks."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Any

import blake3
import msgspec
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import shardkeep as sk
from shardkeep.config import WriteOptions
from shardkeep.integrity import (
    BlockDigester,
    DualDigester,
    block_digests,
    digest_bytes,
    generate_key_pair,
    uncovered_digests,
)
from shardkeep.io import check_shard
from shardkeep.layout import chunk_block_size
from shardkeep.manifest import FileRecord, IndexedManifest, Manifest, RankIndex, Sharding, TensorEntry
from shardkeep.storage import LocalStore
from tests.support.distributed_harness import results_or_raise, run_ranks

KIB = 1024
MIB = 1024 * KIB


# -- the streaming digesters ---------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    data=st.binary(min_size=0, max_size=3000),
    block_size=st.integers(min_value=1, max_value=300),
    cuts=st.lists(st.integers(min_value=0, max_value=3000), max_size=12),
    strong=st.sampled_from([None, "blake3", "sha256"]),
)
def test_the_block_digester_equals_block_digests_for_any_split(
    data: bytes, block_size: int, cuts: list[int], strong: str | None
) -> None:
    points = sorted({0, len(data), *(cut for cut in cuts if cut <= len(data))})
    digester = BlockDigester(block_size, strong)
    for start, stop in itertools.pairwise(points):
        digester.update(memoryview(data)[start:stop])
    assert digester.digest() == block_digests(data, block_size, strong)


@settings(max_examples=50, deadline=None)
@given(
    data=st.binary(min_size=1, max_size=2000),
    block_size=st.integers(min_value=1, max_value=200),
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=8),
)
def test_the_fast_and_strong_halves_can_be_fed_apart(data: bytes, block_size: int, cuts: list[int]) -> None:
    """As two hash tasks feed them: every fast piece first, then every strong piece."""
    points = sorted({0, len(data), *(cut for cut in cuts if cut <= len(data))})
    pieces = [data[start:stop] for start, stop in itertools.pairwise(points)]
    digester = BlockDigester(block_size, "blake3")
    for piece in pieces:
        digester.update_fast(piece)
    for piece in pieces:
        digester.update_strong(piece)
    assert digester.digest() == block_digests(data, block_size, "blake3")


def test_the_block_digester_refuses_bad_arguments() -> None:
    for size, strong in ((0, None), (-4, "blake3"), (16, "xxh3-128"), (16, "md5")):
        with pytest.raises(sk.ShardkeepError):
            BlockDigester(size, strong)


@pytest.mark.parametrize("algorithm", ["blake3", "sha256", "xxh3-128"])
def test_the_dual_digester_gives_both_file_digests(algorithm: str) -> None:
    data = bytes(range(256)) * 50
    dual = DualDigester(algorithm)
    dual.update_strong(data[:1000])
    dual.update_fast(data[:1000])
    dual.update(data[1000:])
    strong, fast = dual.digests()
    assert strong == digest_bytes(algorithm, data)
    assert fast == (None if algorithm == "xxh3-128" else digest_bytes("xxh3-128", data))
    assert DualDigester(algorithm, fast=False).digests()[1] is None


# -- the block size rule -----------------------------------------------------------------------------


def test_the_chunk_block_size_rule() -> None:
    assert chunk_block_size([]) == 0
    assert chunk_block_size([100, 200]) == 16 * KIB  # small chunks: the floor
    assert chunk_block_size([32 * MIB] * 16) == 1 * MIB  # gloo 1 GiB over 2 ranks: c_w / 32
    assert chunk_block_size([896 * KIB] * 1000) == 32 * KIB  # dense-70B at 1,024 ranks (design table)
    assert chunk_block_size([16 * MIB, 100]) == 512 * KIB  # the byte-weighted median is the big chunk
    assert chunk_block_size([1 << 40]) == 16 * MIB  # the ceiling
    assert chunk_block_size([64 * KIB] * 100_000) == 256 * KIB  # at most ~32K blocks per rank


# -- what a save records -----------------------------------------------------------------------------


def _file_bytes(root: Path, record: FileRecord) -> bytes:
    return (root / record.path).read_bytes()


def _check_record(root: Path, record: FileRecord, algorithm: str = "blake3") -> None:
    """The record's digests equal a recomputation from the file on disk."""
    data = _file_bytes(root, record)
    assert record.digest == digest_bytes(algorithm, data)
    assert record.fast_digest == (None if algorithm == "xxh3-128" else digest_bytes("xxh3-128", data))
    strong = None if algorithm == "xxh3-128" else algorithm
    for entry in record.tensors:
        if not entry.blocks:
            continue
        assert record.block_size > 0
        view = data[entry.offset : entry.offset + entry.nbytes]
        chunk = entry.global_offset is not None
        assert entry.blocks == block_digests(view, record.block_size, strong if chunk else None), entry.key
        assert entry.digest is None, entry.key  # blocks replace the chunk's own digest


def test_a_plain_save_records_fast_digests_and_whole_tensor_blocks(tmp_path: Path) -> None:
    state = {"big": torch.randn(5 * MIB), "small": torch.arange(1000.0), "tiny": torch.ones(3)}
    sk.save(state, tmp_path / "c")
    manifest = sk.read_manifest(tmp_path / "c")
    assert manifest.metadata_version == "1.4"
    (record,) = manifest.files
    assert record.block_size == 16 * MIB  # whole tensors over 16 MiB get fast-only 16 MiB blocks
    blocked = {entry.key: len(entry.blocks) for entry in record.tensors}
    assert blocked == {"big": 2 * 16, "small": 0, "tiny": 0}
    _check_record(tmp_path / "c", record)
    assert sk.verify(tmp_path / "c").ok


@pytest.mark.parametrize("algorithm", ["blake3", "sha256", "xxh3-128"])
def test_a_forced_block_size_gives_every_larger_whole_tensor_blocks(tmp_path: Path, algorithm: str) -> None:
    state = {"a": torch.randn(40_000), "b": torch.arange(3000, dtype=torch.int16), "c": torch.ones(5)}
    sk.save(state, tmp_path / "c", options=WriteOptions(block_size=16 * KIB, digest=algorithm))
    (record,) = sk.read_manifest(tmp_path / "c").files
    assert record.block_size == 16 * KIB
    assert {entry.key: len(entry.blocks) // 16 for entry in record.tensors} == {"a": 10, "b": 0, "c": 0}
    _check_record(tmp_path / "c", record, algorithm)
    loaded = sk.load(tmp_path / "c")
    assert all(torch.equal(loaded[key], value) for key, value in state.items())


def test_tensors_written_in_pieces_get_the_same_blocks(tmp_path: Path) -> None:
    """Non-contiguous tensors have no host address: the writer copies them piece by piece (small
    ones, and ones over 1 MiB whose pieces are hashed on the hash pool)."""
    state = {"small": torch.randn(300, 200).t(), "large": torch.randn(1000, 600).t()}
    sk.save(state, tmp_path / "c", options=WriteOptions(block_size=16 * KIB))
    (record,) = sk.read_manifest(tmp_path / "c").files
    assert all(entry.blocks for entry in record.tensors)
    _check_record(tmp_path / "c", record)
    loaded = sk.load(tmp_path / "c")
    assert all(torch.equal(loaded[key], value) for key, value in state.items())


def test_a_compressed_file_has_no_blocks_and_a_fast_digest_of_its_uncompressed_bytes(tmp_path: Path) -> None:
    state = {"w": torch.zeros(50 * MIB // 4)}
    sk.save(state, tmp_path / "c", options=WriteOptions(compression="zstd"))
    (record,) = sk.read_manifest(tmp_path / "c").files
    assert record.compression is not None and record.block_size == 0
    assert all(not entry.blocks for entry in record.tensors)
    plain = sk.load(tmp_path / "c")["w"]
    assert torch.equal(plain, state["w"])
    sk.save(state, tmp_path / "p", options=WriteOptions(block_size=0))
    (uncompressed,) = sk.read_manifest(tmp_path / "p").files
    data = _file_bytes(tmp_path / "p", uncompressed)
    assert record.digest == uncompressed.digest == digest_bytes("blake3", data)
    assert record.fast_digest == digest_bytes("xxh3-128", data)


def _without_times(raw: dict[str, Any]) -> dict[str, Any]:
    raw = dict(raw)
    for name in ("created_at", "timing", "manifest_digest"):
        raw.pop(name, None)
    return raw


def _stripped(raw: dict[str, Any], version: str) -> dict[str, Any]:
    """A 2.1/1.4 manifest (or index) as 2.0/1.3 would say it: no fast digests, no blocks."""
    raw = json.loads(json.dumps(raw))
    raw["metadata_version"] = version
    for record in raw.get("files", []):
        record.pop("fast_digest", None)
        record.pop("block_size", None)
        for entry in record["tensors"]:
            entry.pop("blocks", None)
    return raw


def test_block_size_0_writes_what_a_2_1_save_says_less_the_new_fields(tmp_path: Path) -> None:
    state = {"big": torch.randn(5 * MIB), "small": torch.arange(1000.0), "step": 3}
    sk.save(state, tmp_path / "new")
    sk.save(state, tmp_path / "old", options=WriteOptions(block_size=0))
    new = json.loads((tmp_path / "new" / "manifest.json").read_bytes())
    old = json.loads((tmp_path / "old" / "manifest.json").read_bytes())
    assert old["metadata_version"] == "1.3"
    assert _without_times(old) == _without_times(_stripped(new, "1.3"))
    assert (tmp_path / "new" / new["files"][0]["path"]).read_bytes() == (
        tmp_path / "old" / old["files"][0]["path"]
    ).read_bytes()


def test_the_chunk_blocks_of_a_signed_manifest_must_be_strong() -> None:
    data = blake3.blake3(b"x").hexdigest()
    entry = TensorEntry(
        key="w", path=["w"], dtype="F32", shape=[8], offset=100, nbytes=32, global_shape=[16], global_offset=[0]
    )
    record = FileRecord(path="a", rank=0, size=132, digest=f"blake3:{data}", block_size=16 * KIB)
    record.tensors = [entry]
    manifest = Manifest(digest_algorithm="blake3", files=[record], sharding=Sharding(shard_count=1))
    body = b'{"x":1,"manifest_digest":"blake3:' + data.encode() + b'"}\n'
    entry.blocks = xxhash.xxh3_128(b"0" * 32).digest()  # fast-only
    assert uncovered_digests(manifest, body) == ["a:w"]
    entry.blocks += blake3.blake3(b"0" * 32).digest()
    assert uncovered_digests(manifest, body) == []
    entry.global_offset = entry.global_shape = None  # a whole tensor may have fast-only blocks
    entry.blocks = entry.blocks[:16]
    assert uncovered_digests(manifest, body) == []


def test_a_signed_save_has_strong_blocks_and_verifies(tmp_path: Path) -> None:
    generate_key_pair(tmp_path / "key.pem", tmp_path / "key.pub")
    state = {"w": torch.randn(40_000)}
    sk.save(state, tmp_path / "c", signer=tmp_path / "key.pem", options=WriteOptions(block_size=16 * KIB))
    assert torch.equal(sk.load(tmp_path / "c", public_key=tmp_path / "key.pub")["w"], state["w"])


@pytest.mark.parametrize("trust", [False, True])
@pytest.mark.parametrize("base_block_size", [0, 16 * KIB, 32 * KIB])
def test_an_incremental_save_references_files_with_this_save_s_digests(
    tmp_path: Path, base_block_size: int, trust: bool
) -> None:
    """Over a 1.3 base (no fast or block digests), a 1.4 base with the same block size (copied)
    or another one (computed again); with version proofs or by hashing."""
    state = {
        "model": {"layers": {"0": {"experts": {"1": {"w": torch.randn(40_000)}}}}},
        "other": torch.randn(50_000),
    }
    options = WriteOptions(block_size=base_block_size)
    sk.save(state, tmp_path / "step_1", incremental=sk.Incremental(trust_versions=trust), options=options)
    base = sk.read_manifest(tmp_path / "step_1")
    assert base.metadata_version == ("1.4" if base_block_size else "1.3")
    state["other"] = torch.randn(50_000)
    sk.save(
        state,
        tmp_path / "step_2",
        incremental=sk.Incremental(base="step_1", trust_versions=trust),
        options=WriteOptions(block_size=16 * KIB),
    )
    manifest = sk.read_manifest(tmp_path / "step_2")
    referenced = [record for record in manifest.files if record.ref == "step_1"]
    assert referenced, [record.path for record in manifest.files]
    for record in manifest.files:
        owner = tmp_path / (record.ref or "step_2")
        _check_record(owner, record)
        assert record.fast_digest is not None
    assert any(entry.blocks for record in referenced for entry in record.tensors)
    assert sk.verify(tmp_path / "step_2").ok


# -- chunks, on real gloo ranks ---------------------------------------------------------------------


def _rows() -> torch.Tensor:
    """2 MiB: a chunk of 1 MiB on each of 2 ranks, hashed on the hash pool as it is written."""
    return torch.arange(512 * 1024, dtype=torch.float32).reshape(512, 1024)


def _sharded_state(world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    rows = _rows()
    cols = torch.arange(8 * 3000, dtype=torch.float32).reshape(8, 3000)
    return {"rows": distribute_tensor(rows, mesh, [Shard(0)]), "cols": distribute_tensor(cols, mesh, [Shard(1)])}


def _save_sharded(rank: int, world_size: int, path: str, block_size: int | None) -> str:
    return sk.save(
        _sharded_state(world_size), path, step=1, options=WriteOptions(block_size=block_size)
    ).metadata_version


def _indexed_records(path: Path) -> list[FileRecord]:
    records: list[FileRecord] = []
    for index in sorted((path / "index").iterdir()):
        records += msgspec.json.decode(index.read_bytes(), type=RankIndex).files
    return records


@pytest.mark.parametrize("block_size", [None, 16 * KIB])
def test_chunks_of_a_sharded_save_have_strong_blocks_and_no_digest(tmp_path: Path, block_size: int | None) -> None:
    path = tmp_path / "ckpt"
    versions = results_or_raise(run_ranks(2, _save_sharded, str(path), block_size, outbox=tmp_path / "save"))
    assert versions == ["2.1", "2.1"]
    records = _indexed_records(path)
    assert records
    for record in records:
        # Forced, or the rule: a byte-weighted median chunk of 1 MiB gets 1 MiB / 32 blocks.
        assert record.block_size == (block_size or 32 * KIB)
        assert all(entry.blocks and entry.digest is None for entry in record.tensors)
        _check_record(path, record)
    root = msgspec.json.decode((path / "manifest.json").read_bytes())
    assert root["metadata_version"] == "2.1"
    assert sk.verify(path).ok
    loaded = sk.load(path)
    assert torch.equal(loaded["rows"], _rows())


def test_a_partial_read_checks_a_chunk_by_its_blocks(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    results_or_raise(run_ranks(2, _save_sharded, str(path), 16 * KIB, outbox=tmp_path / "save"))
    record = next(r for r in _indexed_records(path) if len(r.tensors) == 2)
    store = LocalStore(str(path))
    for needed in ([0], [1]):
        data, problems = check_shard(store, record.path, record, verify=True, keep=True, needed=needed)
        assert data is not None and problems == []
    # A flipped byte in entry 1 fails a read of entry 1, and not one of entry 0 alone.
    damaged = bytearray((path / record.path).read_bytes())
    entry = record.tensors[1]
    damaged[entry.offset + random.randrange(entry.nbytes)] ^= 1
    (path / record.path).write_bytes(bytes(damaged))
    _, problems = check_shard(store, record.path, record, verify=True, keep=True, needed=[1])
    assert any(entry.key in problem for problem in problems), problems
    _, problems = check_shard(store, record.path, record, verify=True, keep=True, needed=[0])
    assert problems == []
    assert not sk.verify(path).ok


def test_block_size_0_sharded_saves_write_2_0_with_chunk_digests(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    versions = results_or_raise(run_ranks(2, _save_sharded, str(path), 0, outbox=tmp_path / "save"))
    assert versions == ["2.0", "2.0"]
    for index in sorted((path / "index").iterdir()):
        raw = json.loads(index.read_bytes())
        assert raw["metadata_version"] == "2.0"
        for record in raw["files"]:
            assert {"fast_digest", "block_size"}.isdisjoint(record)
            assert all("blocks" not in entry and entry["digest"].startswith("blake3:") for entry in record["tensors"])
    manifest = sk.read_manifest(path)
    assert isinstance(manifest, sk.Manifest)
    assert json.loads((path / "manifest.json").read_bytes())["metadata_version"] == "2.0"
    assert isinstance(sk.read_manifest(path), (Manifest, IndexedManifest))
    assert sk.verify(path).ok
