"""The format 2.1/1.4 contract: the new manifest fields (``FileRecord.fast_digest`` and
``block_size``, ``TensorEntry.blocks``, the family structs), their validation, the rank-index
version gate, the new options and the reference definition of block digests."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import msgspec
import pytest
import torch
import xxhash

import shardkeep as sk
from shardkeep.config import BLOCK_SIZES, LoadOptions, WriteOptions
from shardkeep.errors import ConfigError, ManifestError, ManifestVersionError
from shardkeep.integrity import block_digests, digest_bytes, seal_manifest
from shardkeep.manifest import (
    COMPATIBLE_INDEXED_VERSION,
    COMPATIBLE_METADATA_VERSION,
    FAST_DIGEST,
    INDEXED_VERSION,
    METADATA_VERSION,
    WRITTEN_INDEXED_VERSION,
    WRITTEN_METADATA_VERSION,
    Compression,
    EntryFamily,
    FileRecord,
    IndexedManifest,
    Manifest,
    Mesh,
    RankIndex,
    Sharding,
    TensorEntry,
    TensorFamily,
    decode_manifest,
    encode_manifest,
    validate_entries_one_by_one,
    validate_manifest,
)
from shardkeep.manifest.families import expand_entry_family
from shardkeep.saving.manifest_build import with_entry_families

GOLDEN = Path(__file__).parent / "golden"
BLAKE3 = "blake3:" + "ab" * 32
XXH3 = "xxh3-128:" + "cd" * 16
KIB = 1024


def blocked_manifest(*, width: int = 48) -> Manifest:
    """One file of block size 16 KiB: an entry of 40,000 bytes (3 blocks), a 0-byte one (no
    block) and a small whole tensor without blocks."""
    entries = [
        TensorEntry(
            key="w", path=["w"], dtype="F32", shape=[10_000], offset=64, nbytes=40_000, blocks=b"\x01" * (3 * width)
        ),
        TensorEntry(key="e", path=["e"], dtype="F32", shape=[0], offset=40_064, nbytes=0),
        TensorEntry(key="s", path=["s"], dtype="I64", shape=[], offset=40_064, nbytes=8),
    ]
    record = FileRecord(
        path="shards/rank_00000.safetensors",
        rank=0,
        size=40_072,
        digest=BLAKE3,
        fast_digest=XXH3,
        block_size=16 * KIB,
        tensors=entries,
    )
    return Manifest(metadata_version=METADATA_VERSION, sharding=Sharding(shard_count=1), files=[record])


def results(manifest: Manifest) -> tuple[list[str], list[str]]:
    """The errors and warnings, which the column pass and the entry-by-entry pass must agree on."""
    fast = validate_manifest(manifest)
    slow = validate_entries_one_by_one(manifest)
    assert (fast.errors, fast.warnings) == (slow.errors, slow.warnings)
    return fast.errors, fast.warnings


# -- constants --------------------------------------------------------------------------------------


def test_the_format_constants() -> None:
    assert (METADATA_VERSION, INDEXED_VERSION) == ("1.4", "2.1")
    assert (WRITTEN_METADATA_VERSION, WRITTEN_INDEXED_VERSION) == ("1.4", "2.1")
    assert (COMPATIBLE_METADATA_VERSION, COMPATIBLE_INDEXED_VERSION) == ("1.3", "2.0")
    assert FAST_DIGEST == "xxh3-128"
    assert tuple(1 << n for n in range(14, 25)) == BLOCK_SIZES
    assert BLOCK_SIZES[0] == 16 * KIB and BLOCK_SIZES[-1] == 16 * KIB * KIB


def test_block_size_0_writes_1_3(tmp_path: Path) -> None:
    sk.save({"w": torch.ones(3)}, tmp_path / "c", options=WriteOptions(block_size=0))
    raw = json.loads((tmp_path / "c" / "manifest.json").read_bytes())
    assert raw["metadata_version"] == "1.3"
    record = raw["files"][0]
    assert {"fast_digest", "block_size", "families"}.isdisjoint(record)
    assert all("blocks" not in entry for entry in record["tensors"])


def test_writers_write_1_4(tmp_path: Path) -> None:
    sk.save({"w": torch.ones(3)}, tmp_path / "c")
    raw = json.loads((tmp_path / "c" / "manifest.json").read_bytes())
    assert raw["metadata_version"] == "1.4"
    assert raw["files"][0]["fast_digest"].startswith("xxh3-128:")


# -- encoding and decoding ----------------------------------------------------------------------------


def test_absent_fields_are_not_encoded() -> None:
    record = FileRecord(
        path="a",
        rank=0,
        size=8,
        digest=BLAKE3,
        tensors=[TensorEntry(key="x", path=["x"], dtype="I64", shape=[], offset=0, nbytes=8)],
    )
    raw = json.loads(msgspec.json.encode(record))
    assert set(raw) == {"path", "rank", "size", "digest", "tensors"}
    assert set(raw["tensors"][0]) == {"key", "path", "dtype", "shape", "offset", "nbytes"}
    assert (record.fast_digest, record.block_size, record.families, record.tensors[0].blocks) == (None, 0, [], b"")
    indexed = IndexedManifest()
    assert "families" not in json.loads(encode_manifest(indexed))
    assert not indexed.families


def test_new_fields_round_trip_on_both_decoding_paths() -> None:
    manifest = blocked_manifest()
    data = seal_manifest(encode_manifest(manifest), "blake3")
    raw = json.loads(data)
    record = raw["files"][0]
    assert (record["fast_digest"], record["block_size"]) == (XXH3, 16 * KIB)
    assert record["tensors"][0]["blocks"] == "AQEB" * 48  # base64 of 144 bytes of 0x01
    fast = decode_manifest(data)
    strict = decode_manifest(json.dumps(raw, indent=1).encode())  # not canonical: the strict path
    assert fast == strict == manifest
    assert strict.unknown_fields == {}
    assert fast.files[0].tensors[0].blocks == b"\x01" * 144


def test_a_blocks_value_that_is_not_base64_is_refused() -> None:
    raw = json.loads(encode_manifest(blocked_manifest()))
    raw["files"][0]["tensors"][0]["blocks"] = "!!not base64"
    with pytest.raises(ManifestError, match="blocks"):
        decode_manifest(json.dumps(raw).encode())


def tensor_family() -> TensorFamily:
    return TensorFamily(
        key="model.layers.{0}.experts.{1}.w1",
        path=["model", "layers.{0}.experts.{1}.w1"],
        indices=[[0, 4, 1], [0, 8, 2]],
        dtype="BF16",
        global_shape=[64, 32],
        mesh=0,
        placements=["S0"],
        kind="expert",
        expert_key=[1, "{0}", "{1}"],
        order=10,
        order_steps=[4, 1],
    )


def entry_family() -> EntryFamily:
    return EntryFamily(
        key="optim.state.{0}.step",
        path=["optim", "state", "{0}", "step"],
        int_parts=[2],
        indices=[[0, 100, 1]],
        dtype="F32",
        shape=[],
        nbytes=4,
        offset=64,
        offset_steps=[4],
        order=3,
        order_steps=[2],
    )


def test_families_round_trip_and_are_searched_for_unknown_fields() -> None:
    manifest = IndexedManifest(
        metadata_version=INDEXED_VERSION,
        meshes=[Mesh(shape=[2])],
        families=[tensor_family()],
        files=[FileRecord(path="a", rank=0, size=464, digest=BLAKE3, families=[entry_family()])],
        sharding=Sharding(shard_count=1),
    )
    data = seal_manifest(encode_manifest(manifest), "blake3")
    decoded = decode_manifest(data)  # entry families are expanded into the file's entries
    assert decoded.files[0].tensors == list(expand_entry_family(entry_family()))
    assert decoded == msgspec.structs.replace(
        manifest, files=[msgspec.structs.replace(manifest.files[0], tensors=decoded.files[0].tensors, families=[])]
    )
    raw = json.loads(data)
    assert raw["families"][0]["indices"] == [[0, 4, 1], [0, 8, 2]]
    assert raw["files"][0]["families"][0]["offset_steps"] == [4]
    raw["metadata_version"] = "2.9"
    raw["families"][0]["new_a"] = 1
    raw["files"][0]["families"][0]["new_b"] = 2
    decoded = decode_manifest(json.dumps(raw).encode())
    assert decoded.unknown_fields == {"families[0].new_a": 1, "files[0].families[0].new_b": 2}
    assert isinstance(decoded, IndexedManifest) and decoded.families == [tensor_family()]


def test_entry_families_left_unexpanded_are_refused_by_validation() -> None:
    manifest = IndexedManifest(
        metadata_version=INDEXED_VERSION,
        meshes=[Mesh(shape=[2])],
        families=[tensor_family()],
        files=[FileRecord(path="a", rank=0, size=464, digest=BLAKE3, families=[entry_family()])],
        sharding=Sharding(shard_count=1),
    )
    errors, _ = results(manifest)
    assert not any("model.layers.{0}.experts.{1}.w1" in e for e in errors), errors  # tensor families are read
    assert any("file 'a'" in e and "optim.state.{0}.step" in e for e in errors), errors


def _golden_manifests() -> list[Path]:
    return sorted(GOLDEN.glob("v*/step_*/manifest.json"))


@pytest.mark.parametrize("path", _golden_manifests(), ids=lambda p: p.parent.parent.name)
def test_every_golden_manifest_and_index_re_encodes_byte_for_byte(path: Path) -> None:
    """Goldens written by this schema's writers (1.3 and later) re-encode byte for byte (2.1's
    root only after its entry families, expanded at decode, are folded again); the older ones
    gain none of the new fields."""
    data = path.read_bytes()
    manifest = decode_manifest(data)
    version = path.parent.parent.name
    encoded = encode_manifest(with_entry_families(manifest) if version == "v2.1" else manifest)
    if version in ("v1.3", "v1.3-dtypes", "v2.0", "v1.4", "v2.1"):
        assert seal_manifest(encoded, manifest.digest_algorithm) == data
    if version not in ("v1.4", "v2.1"):
        for name in (b'"fast_digest"', b'"block_size"', b'"blocks"', b'"families"'):
            assert name not in encoded
    for index in sorted((path.parent / "index").glob("rank_*.json")):
        raw = index.read_bytes()
        decoded = msgspec.json.decode(raw, type=RankIndex)
        assert msgspec.json.encode(decoded) + b"\n" == raw


# -- validation -------------------------------------------------------------------------------------


@pytest.mark.parametrize("width", [16, 48])
def test_a_valid_blocked_manifest_validates_on_both_paths(width: int) -> None:
    assert results(blocked_manifest(width=width)) == ([], [])


def _record(manifest: Manifest) -> FileRecord:
    return manifest.files[0]


def _entry(manifest: Manifest) -> TensorEntry:
    return manifest.files[0].tensors[0]


INVALID: dict[str, tuple[Callable[[Manifest], object], str]] = {
    "blocks-short": (lambda m: setattr(_entry(m), "blocks", b"\x01" * 143), r"tensor 'w' in file '.*'.*143.*3 blocks"),
    "blocks-long": (lambda m: setattr(_entry(m), "blocks", b"\x01" * 192), r"tensor 'w'.*192"),
    "blocks-width": (lambda m: setattr(_entry(m), "blocks", b"\x01" * 96), r"tensor 'w'.*96"),
    "blocks-on-empty": (lambda m: setattr(m.files[0].tensors[1], "blocks", b"\x01" * 16), r"tensor 'e'.*16"),
    "blocks-without-size": (lambda m: setattr(_record(m), "block_size", 0), r"tensor 'w'.*block_size is 0"),
    "size-not-power": (lambda m: setattr(_record(m), "block_size", 24 * KIB), r"file 'shards/.*block_size 24576"),
    "size-too-small": (lambda m: setattr(_record(m), "block_size", 8 * KIB), r"file 'shards/.*block_size 8192"),
    "size-too-large": (lambda m: setattr(_record(m), "block_size", 32 * KIB * KIB), r"block_size 33554432"),
    "size-negative": (lambda m: setattr(_record(m), "block_size", -16 * KIB), r"block_size -16384"),
    "compressed": (
        lambda m: setattr(_record(m), "compression", Compression(codec="zstd", level=3, stored_size=100)),
        r"file 'shards/.*block_size 16384.*compress",
    ),
    "fast-digest-algorithm": (
        lambda m: setattr(_record(m), "fast_digest", BLAKE3),
        r"file 'shards/.*fast_digest 'blake3:",
    ),
    "fast-digest-length": (
        lambda m: setattr(_record(m), "fast_digest", "xxh3-128:abcd"),
        r"fast_digest 'xxh3-128:abcd'",
    ),
    "fast-digest-case": (
        lambda m: setattr(_record(m), "fast_digest", XXH3.upper().replace("XXH3", "xxh3")),
        r"fast_digest 'xxh3-128:CDCD",
    ),
}


@pytest.mark.parametrize("name", list(INVALID))
def test_each_invalid_new_field_is_an_error_naming_where_and_the_value(name: str) -> None:
    mutate, message = INVALID[name]
    manifest = blocked_manifest()
    mutate(manifest)
    errors, _ = results(manifest)
    assert errors, name
    assert any(re.search(message, error) for error in errors), errors


def test_a_compressed_file_with_blocks_names_both_problems() -> None:
    manifest = blocked_manifest()
    _record(manifest).compression = Compression(codec="zstd", level=3, stored_size=100)
    _record(manifest).block_size = 0
    errors, _ = results(manifest)
    assert any("tensor 'w'" in e and "compressed" in e for e in errors), errors


def test_a_compressed_file_may_have_a_fast_digest() -> None:
    manifest = blocked_manifest()
    _record(manifest).compression = Compression(codec="zstd", level=3, stored_size=100)
    _record(manifest).block_size = 0
    for entry in _record(manifest).tensors:
        entry.blocks = b""
    assert results(manifest) == ([], [])


@pytest.mark.parametrize("nbytes", [1, 16 * KIB - 1, 16 * KIB, 16 * KIB + 1, 3 * 16 * KIB])
def test_the_block_count_is_the_ceiling_of_the_entry_bytes(nbytes: int) -> None:
    manifest = blocked_manifest()
    entry = _entry(manifest)
    entry.dtype, entry.shape, entry.nbytes = "U8", [nbytes], nbytes
    _record(manifest).size = 64 + nbytes + 8
    manifest.files[0].tensors[1].offset = manifest.files[0].tensors[2].offset = 64 + nbytes
    count = math.ceil(nbytes / (16 * KIB))
    for width in (16, 48):
        entry.blocks = b"\0" * (count * width)
        assert results(manifest) == ([], []), (nbytes, width)
        entry.blocks = b"\0" * ((count + 1) * width)
        assert results(manifest)[0], (nbytes, width)


# -- the rank-index version gate ----------------------------------------------------------------------


def _golden_v2(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    shutil.copytree(GOLDEN / "v2.0", root)
    for directory, _dirs, files in os.walk(root):
        os.chmod(directory, 0o755)
        for name in files:
            os.chmod(os.path.join(directory, name), 0o644)
    return root / "step_00000042"


def _rewrite_index(checkpoint: Path, root_version: str, rewrite: Callable[[dict[str, Any]], object]) -> None:
    """Rewrite rank 0's index with ``rewrite(raw)`` (compact JSON, fields in the order given)
    and give the other indexes its version; record their sizes and digests in the root, set the
    root's version and re-seal it."""
    root = json.loads((checkpoint / "manifest.json").read_bytes())
    root.pop("manifest_digest")
    root["metadata_version"] = root_version
    table = root["indexes"]
    version = None
    for position, rank in sorted(enumerate(table["ranks"]), key=lambda pair: pair[1]):
        path = checkpoint / "index" / f"rank_{rank:05d}.json"
        raw = json.loads(path.read_bytes())
        if rank == 0:
            rewrite(raw)
            version = raw.get("metadata_version")
        else:
            raw["metadata_version"] = version
        data = json.dumps(raw, separators=(",", ":")).encode() + b"\n"
        path.write_bytes(data)
        table["sizes"][position] = len(data)
        table["digests"][position] = digest_bytes(table["algorithm"], data).partition(":")[2]
    (checkpoint / "manifest.json").write_bytes(
        seal_manifest(json.dumps(root, separators=(",", ":")).encode(), "blake3")
    )


def _versioned(version: str, **extra: Any) -> Callable[[dict[str, Any]], None]:
    def rewrite(raw: dict[str, Any]) -> None:
        raw["metadata_version"] = version
        raw.update(extra)

    return rewrite


def test_a_newer_minor_index_with_unknown_fields_reads_leniently(tmp_path: Path) -> None:
    checkpoint = _golden_v2(tmp_path)

    def rewrite(raw: dict[str, Any]) -> None:
        raw["metadata_version"] = "2.2"
        raw["new_top"] = {"a": 1}
        raw["files"][0]["new_file_field"] = 2
        raw["files"][0]["tensors"][0]["new_entry_field"] = [3]

    _rewrite_index(checkpoint, "2.2", rewrite)
    assert sk.verify(checkpoint).ok
    loaded = sk.load(checkpoint)
    assert loaded["model"]["w"].shape == (4, 2)


def test_a_newer_minor_index_is_still_checked_against_the_grid(tmp_path: Path) -> None:
    checkpoint = _golden_v2(tmp_path)

    def rewrite(raw: dict[str, Any]) -> None:
        raw["metadata_version"] = "2.2"
        raw["files"][0]["tensors"][0]["global_offset"] = [1, 0]

    _rewrite_index(checkpoint, "2.2", rewrite)
    with pytest.raises(ManifestError, match=r"rank_00000\.json: invalid rank index"):
        sk.load(checkpoint)


def test_a_newer_minor_index_that_is_not_strict_json_is_refused(tmp_path: Path) -> None:
    checkpoint = _golden_v2(tmp_path)

    def rewrite(raw: dict[str, Any]) -> None:
        raw["metadata_version"] = "2.2"
        raw["rank"] = 1.5e999  # json.dumps writes Infinity, which strict JSON refuses

    _rewrite_index(checkpoint, "2.2", rewrite)
    with pytest.raises(ManifestError, match=r"rank_00000\.json: invalid rank index.*Infinity"):
        sk.load(checkpoint)


def test_a_newer_minor_index_with_a_surrogate_escape_is_refused(tmp_path: Path) -> None:
    checkpoint = _golden_v2(tmp_path)

    def rewrite(raw: dict[str, Any]) -> None:
        raw["metadata_version"] = "2.2"
        raw["files"][0]["path"] += "\ud800"  # json.dumps writes the escape

    _rewrite_index(checkpoint, "2.2", rewrite)
    with pytest.raises(ManifestError, match=r"rank_00000\.json: invalid rank index.*surrogate"):
        sk.load(checkpoint)


def test_a_newer_major_index_is_a_version_error(tmp_path: Path) -> None:
    checkpoint = _golden_v2(tmp_path)
    _rewrite_index(checkpoint, INDEXED_VERSION, _versioned("3.0", new_top=1))
    with pytest.raises(ManifestVersionError, match=r"3\.0") as info:
        sk.load(checkpoint)
    assert info.value.found == "3.0" and info.value.supported == INDEXED_VERSION


def test_a_newer_major_index_written_in_another_order_is_a_version_error(tmp_path: Path) -> None:
    checkpoint = _golden_v2(tmp_path)

    def rewrite(raw: dict[str, Any]) -> None:
        version = "3.1"
        raw.clear()
        raw.update({"metadata_version": version, "format": "shardkeep-index", "rank": 0, "entries": []})

    _rewrite_index(checkpoint, INDEXED_VERSION, rewrite)
    with pytest.raises(ManifestVersionError, match=r"3\.1"):
        sk.load(checkpoint)


@pytest.mark.parametrize(("root", "index"), [("2.1", "2.0"), ("2.0", "2.1"), ("2.2", "2.1"), ("2.1", "2.2")])
def test_an_index_of_another_version_than_the_root_is_refused(tmp_path: Path, root: str, index: str) -> None:
    checkpoint = _golden_v2(tmp_path)
    _rewrite_index(checkpoint, root, _versioned(index))
    with pytest.raises(ManifestError, match=rf"version {index}.*root.*{root}") as info:
        sk.load(checkpoint)
    assert not isinstance(info.value, ManifestVersionError)


def test_an_index_of_this_minor_is_decoded_strictly(tmp_path: Path) -> None:
    checkpoint = _golden_v2(tmp_path)
    _rewrite_index(checkpoint, "2.1", _versioned("2.1"))
    assert sk.load(checkpoint)["model"]["w"].shape == (4, 2)
    _rewrite_index(checkpoint, "2.1", _versioned("2.1", new_top=1))
    with pytest.raises(ManifestError, match=r"unknown field|canonical"):
        sk.load(checkpoint)


# -- options ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("digest", [None, "fast", "cryptographic"])
def test_load_options_accept_the_digest_choices(digest: Any) -> None:
    assert LoadOptions(digest=digest).digest == digest


@pytest.mark.parametrize("digest", ["both", "blake3", "xxh3-128", "", 1, True])
def test_load_options_refuse_another_digest(digest: Any) -> None:
    with pytest.raises(ConfigError, match=rf"digest={digest!r}".replace("(", r"\(")):
        LoadOptions(digest=digest)


def test_a_cryptographic_load_must_verify() -> None:
    with pytest.raises(ConfigError, match=r"digest='cryptographic'.*verify=False"):
        LoadOptions(digest="cryptographic", verify=False)
    assert LoadOptions(digest="fast", verify=False).verify is False


@pytest.mark.parametrize("size", [None, 0, *BLOCK_SIZES])
def test_write_options_accept_the_block_sizes(size: int | None) -> None:
    assert WriteOptions(block_size=size).block_size == size


@pytest.mark.parametrize("size", [1, 8 * KIB, 24 * KIB, 32 * KIB * KIB, -16 * KIB, True, 16.0 * KIB, "16KiB"])
def test_write_options_refuse_another_block_size(size: Any) -> None:
    with pytest.raises(ConfigError, match=rf"block_size={size!r}"):
        WriteOptions(block_size=size)


def test_compressed_saves_take_no_block_size() -> None:
    with pytest.raises(ConfigError, match=r"block_size=16384.*compression='zstd'"):
        WriteOptions(block_size=16 * KIB, compression="zstd")
    assert WriteOptions(block_size=0, compression="zstd").block_size == 0


# -- block digests ----------------------------------------------------------------------------------


def test_block_digests_by_hand() -> None:
    data = bytes(range(40))
    blocks = [data[0:16], data[16:32], data[32:40]]
    expected = b"".join(xxhash.xxh3_128(b).digest() + blake3.blake3(b).digest() for b in blocks)
    assert block_digests(memoryview(data), 16, "blake3") == expected
    assert len(expected) == 3 * 48
    assert block_digests(data, 16, None) == b"".join(xxhash.xxh3_128(b).digest() for b in blocks)
    assert block_digests(data, 16, "sha256") == b"".join(
        xxhash.xxh3_128(b).digest() + hashlib.sha256(b).digest() for b in blocks
    )
    assert block_digests(data, 64, "blake3") == xxhash.xxh3_128(data).digest() + blake3.blake3(data).digest()
    assert block_digests(b"", 16, "blake3") == b""


def test_block_digests_of_a_known_value() -> None:
    """Literal digests of ``b"abc"`` (one block), so that a change of library or definition shows:
    xxh3-128 as its canonical big-endian bytes, then blake3 (the published test value)."""
    xxh3_abc = "06b05ab6733a618578af5f94892f3950"
    blake3_abc = "6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85"
    assert block_digests(b"abc", 16 * KIB, "blake3").hex() == xxh3_abc + blake3_abc
    assert block_digests(b"abcabc", 3, None).hex() == xxh3_abc * 2
    data = b"shardkeep" * 4000  # 36,000 bytes: blocks of 16,384, 16,384 and 3,232
    digests = block_digests(data, 16 * KIB, "blake3")
    assert len(digests) == 3 * 48
    assert digests[96:112] == xxhash.xxh3_128(data[32 * KIB :]).digest()
    assert digests[112:] == blake3.blake3(data[32 * KIB :]).digest()


@pytest.mark.parametrize(("size", "strong"), [(0, "blake3"), (-1, None), (16, "xxh3-128"), (16, "md5")])
def test_block_digests_refuse_bad_arguments(size: int, strong: str | None) -> None:
    with pytest.raises(sk.ShardkeepError):
        block_digests(b"abc", size, strong)


def test_block_size_is_an_option_not_a_flat_keyword(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="block_size"):
        sk.save({"w": torch.ones(2)}, tmp_path / "a", block_size=0)  # type: ignore[call-arg]
    sk.save({"w": torch.ones(2)}, tmp_path / "b", options=WriteOptions(block_size=0))
    assert sk.load(tmp_path / "b")["w"].tolist() == [1.0, 1.0]
