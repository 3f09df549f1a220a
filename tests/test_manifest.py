"""The manifest: schema round trip, strict bounded decoding, versioning, validation, golden files."""

from __future__ import annotations

import base64
import json
import logging
import shutil
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

import shardkeep as sk
from shardkeep.config import ManifestLimits
from shardkeep.integrity import digest_bytes, seal_manifest, unseal_manifest
from shardkeep.manifest import (
    COMPATIBLE_INDEXED_VERSION,
    INDEXED_VERSION,
    SEAL_FIELD,
    WRITTEN_METADATA_VERSION,
    ContainerEntry,
    FileRecord,
    IndexedManifest,
    IndexTable,
    Manifest,
    RankIndex,
    Sharding,
    StateSection,
    TensorEntry,
    Tier,
    Training,
    ValueEntry,
    child_structs,
    decode_manifest,
    encode_manifest,
    unknown_fields_of,
    unsafe_path_reason,
    validate_manifest,
)
from shardkeep.saving import warn_if_over_read_limits

GOLDEN = Path(__file__).parent / "golden"
DIGEST = "blake3:" + "ab" * 32


def full_manifest() -> Manifest:
    """A manifest that sets every field of the schema."""
    return Manifest(
        model_id="lite-llm-base",
        epoch=5,
        step=10_000,
        world_size=2,
        coordinator_rank=0,
        digest_algorithm="blake3",
        sharding=Sharding(strategy="fsdp", shard_count=2, precision="bf16", strategy_info={"mesh": [2]}),
        training=Training(learning_rate=3e-4, optimizer_type="AdamW"),
        tiers=[
            Tier(tier_id=1, name="hot", size_budget="40GB", placement_policy="prioritized"),
            Tier(tier_id=2, name="warm", size_budget="200GB", placement_policy="lru", location="/mnt/warm"),
        ],
        files=[
            FileRecord(
                path="shards/rank_00000.safetensors",
                rank=0,
                size=4096,
                digest=DIGEST,
                version=1,
                tier="hot",
                tensors=[
                    TensorEntry(
                        key="attention_q",
                        path=["attention_q"],
                        dtype="BF16",
                        shape=[8, 16],
                        offset=128,
                        nbytes=256,
                        global_shape=[16, 16],
                        global_offset=[0, 0],
                    ),
                ],
            ),
            FileRecord(
                path="shards/rank_00001.safetensors",
                rank=1,
                size=4096,
                digest=DIGEST,
                version=0,
                tier="warm",
                tensors=[
                    TensorEntry(
                        key="attention_q",
                        path=["attention_q"],
                        dtype="BF16",
                        shape=[8, 16],
                        offset=128,
                        nbytes=256,
                        global_shape=[16, 16],
                        global_offset=[8, 0],
                    ),
                    TensorEntry(
                        key="layers.2.experts.1.w",
                        path=["layers.2.experts.1.w"],
                        dtype="F32",
                        shape=[4],
                        offset=384,
                        nbytes=16,
                        kind="expert",
                        expert_key=[2, 0, 1],
                    ),
                ],
            ),
        ],
        optim_state=StateSection(prefixes=["optim"], description="optimizer state"),
        router_state=StateSection(prefixes=["router"]),
        structure=[ContainerEntry(path=[], kind="dict")],
        values=[
            ValueEntry(key="step", path=["step"], value=10_000),
            ValueEntry(key="best", path=["best"], special="inf"),
        ],
        custom_fields={"owner": "team", "nested": {"a": [1, 2]}},
    )


def test_full_manifest_round_trips_and_validates() -> None:
    manifest = full_manifest()
    data = encode_manifest(manifest)
    assert decode_manifest(data) == manifest
    result = validate_manifest(manifest)
    assert result.errors == [] and result.warnings == []
    assert result.is_valid


def test_encoding_is_snake_case_json_with_type_field() -> None:
    raw = json.loads(encode_manifest(full_manifest()))
    assert raw["metadata_version"] == WRITTEN_METADATA_VERSION
    tensor = raw["files"][1]["tensors"][1]
    assert tensor["type"] == "expert" and tensor["expert_key"] == [2, 0, 1]
    assert {
        "model_id",
        "epoch",
        "step",
        "world_size",
        "sharding",
        "training",
        "tiers",
        "files",
        "optim_state",
        "router_state",
        "custom_fields",
        "values",
        "structure",
        "created_at",
    } <= set(raw)


def _sealed(raw: dict[str, object]) -> bytes:
    return seal_manifest(json.dumps(raw, separators=(",", ":")).encode(), "blake3")


def test_unknown_fields_of_a_newer_minor_are_kept_and_ignored() -> None:
    raw = json.loads(encode_manifest(full_manifest()))
    raw["metadata_version"] = "1.7"
    raw["new_top"] = {"x": 1}
    raw["files"][0]["new_file_field"] = "y"
    raw["files"][1]["tensors"][0]["new_tensor_field"] = [3]
    raw["sharding"]["new_sharding_field"] = True
    manifest = decode_manifest(json.dumps(raw).encode())
    assert manifest.unknown_fields == {
        "new_top": {"x": 1},
        "files[0].new_file_field": "y",
        "files[1].tensors[0].new_tensor_field": [3],
        "sharding.new_sharding_field": True,
    }
    assert manifest.files[1].tensors[0].key == "attention_q"
    assert manifest.metadata_version == "1.7"


class _Gauge(msgspec.Struct, kw_only=True):
    unit: str


class _Probe(msgspec.Struct, kw_only=True):
    gauge: _Gauge | None = None
    gauges: list[_Gauge] = msgspec.field(default_factory=list)


class _ExtendedManifest(Manifest, kw_only=True, dict=True):
    """A manifest with nested fields the schema does not have: the codec must find their
    unknown members with no table edited."""

    probe: _Probe | None = None
    probes: list[_Probe] = msgspec.field(default_factory=list)


def test_nested_structs_are_read_from_the_struct_annotations() -> None:
    assert child_structs(_ExtendedManifest) == {
        **child_structs(Manifest),
        "probe": (_Probe, False),
        "probes": (_Probe, True),
    }
    assert child_structs(_Probe) == {"gauge": (_Gauge, False), "gauges": (_Gauge, True)}
    assert child_structs(_Gauge) == {}
    raw = json.loads(encode_manifest(_ExtendedManifest(probe=_Probe(gauge=_Gauge(unit="s")), probes=[_Probe()])))
    raw["probe"]["gauge"]["new_a"] = 1
    raw["probes"][0]["new_b"] = 2
    raw["files"] = [{"path": "a", "new_c": 3}]
    assert unknown_fields_of(raw, _ExtendedManifest) == {
        "probe.gauge.new_a": 1,
        "probes[0].new_b": 2,
        "files[0].new_c": 3,
    }


def _struct_types_in(annotation: Any) -> set[type]:
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
        return {annotation}
    return set().union(*map(_struct_types_in, typing.get_args(annotation)))


@pytest.mark.parametrize("cls", [Manifest, IndexedManifest, RankIndex])
def test_every_nested_struct_of_the_schema_is_searched_for_unknown_fields(cls: type) -> None:
    """Walked with typing's view of the annotations, not msgspec's: every field that holds a
    struct (optional or in a list) is one the decoder looks into, down to the leaves."""
    pending, seen = [cls], set()
    while pending:
        struct = pending.pop()
        seen.add(struct)
        hints = typing.get_type_hints(struct)
        children = child_structs(struct)
        for info in msgspec.structs.fields(struct):
            inner = _struct_types_in(hints[info.name])
            assert {children[info.encode_name][0]} == inner if inner else info.encode_name not in children
            pending += [child for child in inner if child not in seen]
    assert TensorEntry in seen and (cls is RankIndex or Sharding in seen)


def test_state_besides_the_fields_is_never_encoded() -> None:
    """Unknown fields, a view's completeness and the index records are declared attributes
    that the encoded bytes never hold."""
    raw = json.loads(encode_manifest(full_manifest()))
    raw["metadata_version"] = "1.9"
    raw["new_top"] = 1
    manifest = decode_manifest(json.dumps(raw).encode())
    assert manifest.unknown_fields == {"new_top": 1}
    assert b"new_top" not in encode_manifest(manifest)
    indexed = IndexedManifest(indexes=IndexTable(algorithm="blake3", ranks=[0], sizes=[10], digests=["ab" * 32]))
    before = encode_manifest(indexed)
    assert indexed.complete is None and indexed.unknown_fields == {}
    indexed.complete = False
    assert [record.rank for record in indexed.index_records()] == [0]
    assert indexed.complete is False and encode_manifest(indexed) == before
    assert msgspec.structs.replace(indexed).complete is None
    assert "complete" not in {info.name for info in msgspec.structs.fields(IndexedManifest)}


def test_newer_major_version_is_refused_naming_both_versions() -> None:
    raw = json.loads(encode_manifest(full_manifest()))
    raw["metadata_version"] = "3.0"
    with pytest.raises(sk.ManifestVersionError, match=r"3\.0.*2\.1") as info:
        decode_manifest(json.dumps(raw).encode())
    assert info.value.found == "3.0" and info.value.supported == INDEXED_VERSION
    assert isinstance(info.value, sk.ManifestError)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b'{"metadata_version":"1.0","step":1,"step":2}', "duplicate key 'step'"),
        (b'{"metadata_version":"1.0","training":{"learning_rate":NaN}}', "NaN"),
        (b'{"metadata_version":"1.0","epoch":Infinity}', "Infinity"),
        (b'{"metadata_version":"1.0","model_id":"\xff"}', "UTF-8"),
        (b'{"metadata_version":"1.0",' + b'"custom_fields":' + b'{"a":' * 40 + b"1" + b"}" * 41, "nested deeper"),
        (b'{"metadata_version":"1.0"', "malformed"),
        (b"[1,2]", "must be an object"),
        (b'{"metadata_version":1}', "string"),
        (b'{"metadata_version":"1.0","step":"ten"}', "schema"),
        (b'{"metadata_version":"1.0","files":[{"path":"a"}]}', "schema"),
        (b'{"metadata_version":"1.0","format":"other"}', "not a shardkeep manifest"),
        (b'{"metadata_version":"1.0","step":' + b"9" * 5000 + b"}", "malformed"),
    ],
)
def test_strict_decoding_rejects_bad_json(data: bytes, message: str) -> None:
    with pytest.raises(sk.ManifestError, match=message):
        decode_manifest(data)


def test_decoding_is_bounded_in_size_and_counts() -> None:
    data = encode_manifest(full_manifest())
    with pytest.raises(sk.ManifestError, match="over the limit"):
        decode_manifest(data, limits=ManifestLimits(max_bytes=100))
    with pytest.raises(sk.ManifestError, match="files, over the limit"):
        decode_manifest(data, limits=ManifestLimits(max_files=1))
    with pytest.raises(sk.ManifestError, match="tensors, over the limit"):
        decode_manifest(data, limits=ManifestLimits(max_tensors=2))
    deep = b'{"metadata_version":"1.0","custom_fields":{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}}"
    with pytest.raises(sk.ManifestError, match="nested deeper"):
        decode_manifest(deep)


def test_decoding_never_mutates_input() -> None:
    """The decoder gets the caller's own mutable buffer (the fast path, and the strict path for
    reformatted JSON), and validation gets the decoded manifest: neither changes what it reads."""
    canonical = encode_manifest(full_manifest())
    reformatted = json.dumps(json.loads(canonical), indent=2).encode()
    for data in (canonical, reformatted):
        buffer = bytearray(data)
        manifest = decode_manifest(buffer)  # a bytearray on purpose: mutable
        assert bytes(buffer) == data
        before = encode_manifest(manifest)
        validate_manifest(manifest)
        assert encode_manifest(manifest) == before


def _errors(manifest: Manifest) -> list[str]:
    return validate_manifest(manifest).errors


def test_validator_reports_duplicate_keys() -> None:
    manifest = full_manifest()
    manifest.files[1].tensors[0].global_offset = [0, 0]
    assert any("duplicate key 'attention_q'" in e for e in _errors(manifest))
    manifest = full_manifest()
    manifest.values.append(ValueEntry(key="step", path=["step"], value=1))
    assert any("duplicate key 'step'" in e for e in _errors(manifest))


def test_validator_reports_overlapping_and_out_of_file_ranges() -> None:
    manifest = full_manifest()
    manifest.files[1].tensors[1].offset = 200
    assert any("overlap" in e for e in _errors(manifest))
    manifest = full_manifest()
    manifest.files[1].tensors[1].offset = 4090
    assert any("beyond the file size 4096" in e for e in _errors(manifest))


def test_validator_reports_shard_count_mismatch() -> None:
    manifest = full_manifest()
    manifest.sharding.shard_count = 3
    assert any("shard count mismatch" in e for e in _errors(manifest))


@pytest.mark.parametrize(
    "path",
    [
        "../escape.bin",
        "/etc/passwd",
        "shards/../../x",
        "a\\b",
        "a\x00b",
        "shards//x",
        "./x",
        "C:/x",
        "manifest.json",
        "",
    ],
)
def test_validator_reports_unsafe_paths(path: str) -> None:
    manifest = full_manifest()
    manifest.files[0].path = path
    assert any("unsafe path" in e for e in _errors(manifest)), path


def test_remote_and_absolute_tier_locations_are_accepted() -> None:
    manifest = full_manifest()
    manifest.tiers[1].location = "s3://bucket/prefix/step_00001000"
    assert validate_manifest(manifest).errors == []


def test_a_file_digest_with_another_algorithm_is_a_warning() -> None:
    manifest = full_manifest()
    manifest.files[0].digest = "sha256:" + "cd" * 32
    result = validate_manifest(manifest)
    assert result.errors == []
    assert result.warnings == ["file 'shards/rank_00000.safetensors' uses digest sha256, not the manifest's blake3"]


def test_missing_digest_is_a_warning_not_an_error() -> None:
    manifest = full_manifest()
    manifest.files[0].digest = None
    result = validate_manifest(manifest)
    assert result.errors == []
    assert result.warnings == ["file 'shards/rank_00000.safetensors' has no digest; its contents cannot be verified"]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda m: setattr(m.files[0].tensors[0], "dtype", "F99"), "unknown dtype"),
        (lambda m: setattr(m.files[0].tensors[0], "nbytes", 10), "needs 256 bytes"),
        (lambda m: setattr(m.files[0], "tier", "cold"), "does not define"),
        (lambda m: setattr(m.files[0], "rank", 5), "outside world_size"),
        (lambda m: setattr(m.files[0], "digest", "md5:00"), "unknown algorithm"),
        (lambda m: setattr(m.files[0], "digest", "blake3:zz"), "malformed"),
        (lambda m: setattr(m.files[0].tensors[0], "global_offset", [12, 0]), "outside"),
        (lambda m: setattr(m.files[0].tensors[0], "global_offset", None), "together"),
        (lambda m: setattr(m, "world_size", 0), "world_size"),
        (lambda m: setattr(m.files[1], "path", m.files[0].path), "listed twice"),
        (lambda m: setattr(m.files[0].tensors[0], "shape", [-1, 16]), "negative"),
        (lambda m: setattr(m.files[0].tensors[0], "key", "other"), "does not match its path"),
        (lambda m: setattr(m.files[0].tensors[0], "path", ["a"] * 100), "deeper"),
        (lambda m: m.tiers.append(Tier(tier_id=1, name="hot")), "defined twice"),
        (lambda m: setattr(m.tiers[1], "location", "../warm"), "absolute path or an object-store URL"),
        (lambda m: setattr(m.tiers[1], "location", "s3://bucket/../other"), "absolute path or an object-store URL"),
    ],
)
def test_validator_reports_inconsistencies(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    manifest = full_manifest()
    mutate(manifest)
    errors = _errors(manifest)
    assert any(message in e for e in errors), errors


def test_unsafe_path_reason_accepts_plain_relative_paths() -> None:
    assert unsafe_path_reason("shards/rank_00000.safetensors") is None
    assert unsafe_path_reason("a/b/c.d") is None
    assert unsafe_path_reason("..") is not None


def test_seal_detects_any_change_and_truncation() -> None:
    sealed = seal_manifest(encode_manifest(full_manifest()), "blake3")
    unseal_manifest(sealed)
    changed = sealed.replace(b'"step":10000', b'"step":10001')
    assert changed != sealed
    with pytest.raises(sk.IntegrityError):
        unseal_manifest(changed)
    with pytest.raises(sk.IntegrityError):
        unseal_manifest(sealed[:-5])


@pytest.mark.parametrize("algorithm", ["blake3", "xxh3-128", "sha256"])
@pytest.mark.parametrize("body", [b"{}", b"{ }", b'{"a":1}', b'{"x":"' + b"a" * 5000 + b'"}'])
def test_the_seal_is_the_body_a_comma_and_the_digest_of_both(body: bytes, algorithm: str) -> None:
    """The sealed bytes are exactly: the body without its closing brace, a comma unless the
    object is empty, and the seal member holding the digest of everything before it (the
    format every released checkpoint carries)."""
    sealed = seal_manifest(body, algorithm)
    prefix = body[:-1] + (b"" if body[1:-1].strip() == b"" else b",")
    digest = digest_bytes(algorithm, prefix)
    assert sealed == prefix + b'"' + SEAL_FIELD.encode() + b'":"' + digest.encode() + b'"}\n'
    unseal_manifest(sealed)


# ---------------------------------------------------------------------------------------------
# golden files
# ---------------------------------------------------------------------------------------------


def test_golden_v1_0_checkpoint_still_reads_verifies_and_loads(tmp_path: Path) -> None:
    checkpoint = tmp_path / "step_00000042"
    shutil.copytree(GOLDEN / "v1.0" / "step_00000042", checkpoint)
    manifest = sk.read_manifest(checkpoint)
    assert manifest.metadata_version == "1.0"
    assert (manifest.step, manifest.epoch, manifest.model_id) == (42, 3, "golden-model")
    assert manifest.custom_fields == {"owner": "tests"}
    assert sk.verify(checkpoint).ok
    import torch

    loaded = sk.load(checkpoint)
    assert torch.equal(loaded["model"]["weight"], torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert torch.equal(loaded["model"]["bias"], torch.tensor([1, 2, 3]))
    assert torch.equal(loaded["half"], torch.tensor([0.5, -2.0], dtype=torch.bfloat16))
    assert loaded["step"] == 42 and loaded["config"] == {"lr": 0.1, "name": "golden"}
    assert loaded["pair"] == (1, 2) and loaded["best"] == float("inf")


def test_golden_newer_minor_manifest_decodes_with_unknown_fields() -> None:
    data = (GOLDEN / "manifest-v1.1-unknown-fields.json").read_bytes()
    unseal_manifest(data)
    manifest = decode_manifest(data)
    assert manifest.metadata_version == "1.1"
    assert manifest.unknown_fields == {
        "future_top_level": {"hint": "added in 1.1"},
        "files[0].future_file_field": 7,
        "files[0].tensors[0].future_tensor_field": [1, 2],
    }
    assert validate_manifest(manifest).errors == []


def test_golden_newer_major_manifest_is_refused() -> None:
    data = (GOLDEN / "manifest-v3.0-newer-major.json").read_bytes()
    with pytest.raises(sk.ManifestVersionError, match=r"3\.0"):
        decode_manifest(data)


# ---------------------------------------------------------------------------------------------
# fuzzing: the parser raises only its own error types
# ---------------------------------------------------------------------------------------------


def test_fast_and_strict_decoding_paths_agree() -> None:
    manifest = full_manifest()
    canonical = seal_manifest(encode_manifest(manifest), "blake3")
    reformatted = json.dumps(json.loads(canonical), indent=2).encode()
    assert decode_manifest(canonical) == decode_manifest(reformatted) == manifest
    # A duplicate key spliced into otherwise canonical bytes is still refused.
    duplicated = canonical.replace(b'"step":10000,', b'"step":10000,"step":10000,', 1)
    with pytest.raises(sk.ManifestError, match="duplicate key 'step'"):
        decode_manifest(duplicated)
    trailing = canonical[:-2] + b',"extra":1}\n'
    assert decode_manifest(trailing).unknown_fields == {"extra": 1}


def test_surrogate_escapes_are_refused_but_escaped_backslashes_are_not(tmp_path: Path) -> None:
    text = "C:\\udbff\\x"  # a backslash followed by the letters udbff: plain text, no surrogate
    sk.save({"path": text, "w": torch.zeros(1)}, tmp_path / "c")
    assert sk.load(tmp_path / "c")["path"] == text
    canonical = seal_manifest(encode_manifest(full_manifest()), "blake3")
    lone = canonical.replace(b'"model_id":"', b'"model_id":"\\ud800', 1)
    assert lone != canonical
    with pytest.raises(sk.ManifestError, match="surrogate"):
        decode_manifest(lone)


def test_the_default_limits_bound_what_reading_a_manifest_costs(tmp_path: Path, caplog: Any) -> None:
    """Reading at the default limits costs about 5 s and 1 GiB at most on a 2-core machine
    (bench/manifest_limits.py measures it; docs/reliability.md has the figures). A checkpoint
    over them is written with a warning, refused by default with a typed error that says how
    to raise the limits, and read with limits= through load, verify, read_manifest and the
    manager."""
    limits = ManifestLimits()
    assert limits.max_bytes <= 40 * 2**20 and limits.max_tensors <= 500_000 and limits.max_files <= 500_000
    small = ManifestLimits(max_tensors=40)
    state = {f"t{index}": torch.full((2,), float(index)) for index in range(50)}
    manager = sk.CheckpointManager(tmp_path / "root", keep_last=1, keep_best=0)
    with caplog.at_level(logging.WARNING, logger="shardkeep"):
        sk.save(state, tmp_path / "big")
    assert not any("over the default read limits" in r.message for r in caplog.records)  # 50 < 500,000
    manager.save(state, step=1)
    checkpoint = tmp_path / "root" / "step_00000001"
    sealed = (checkpoint / "manifest.json").read_bytes()
    with caplog.at_level(logging.WARNING, logger="shardkeep"):
        warn_if_over_read_limits(checkpoint, sealed, sk.read_manifest(checkpoint), small)
    (warning,) = [r.message for r in caplog.records if "over the default read limits" in r.message]
    assert "50 tensor entries" in warning and "limits=ManifestLimits(" in warning
    with pytest.raises(sk.ManifestError, match=r"50 tensors, over the limit of 40.*limits=ManifestLimits"):
        sk.load(checkpoint, limits=small)
    assert not sk.verify(checkpoint, limits=small).ok
    assert sk.verify(checkpoint).ok and sk.read_manifest(checkpoint).step == 1
    strict = sk.CheckpointManager(tmp_path / "root", keep_last=1, keep_best=0, limits=small, read_only=True)
    with pytest.raises(sk.IntegrityError, match="over the limit of 40"):
        strict.restore()
    roomy = sk.CheckpointManager(tmp_path / "root", keep_last=1, keep_best=0, limits=ManifestLimits(max_tensors=50))
    assert torch.equal(roomy.restore().state["t7"], torch.full((2,), 7.0))


def test_an_invalid_manifest_message_is_bounded(tmp_path: Path, reseal: Callable[..., None]) -> None:
    sk.save({f"t{index}": torch.zeros(2) for index in range(100)}, tmp_path / "c")

    def break_every_entry(raw: dict) -> None:  # type: ignore[type-arg]
        for entry in raw["files"][0]["tensors"]:
            entry["nbytes"] += 1

    reseal(tmp_path / "c", break_every_entry)
    with pytest.raises(sk.ManifestError) as caught:
        sk.read_manifest(tmp_path / "c")
    assert "more problems" in str(caught.value) and len(str(caught.value)) < 5000


@pytest.mark.parametrize("version", ["1.1", "1.2", "1.3", "1.4"])
def test_golden_checkpoints_of_every_format_version_read_verify_load_and_restore(tmp_path: Path, version: str) -> None:
    """Checkpoints written by the shardkeep of each format version (tests/golden/make_golden_checkpoint.py):
    a managed save of a module, its AdamW state, a bf16 expert tensor and JSON values."""
    root = tmp_path / "root"
    shutil.copytree(GOLDEN / f"v{version}", root)
    checkpoint = root / "step_00000042"
    manifest = sk.read_manifest(checkpoint)
    assert manifest.metadata_version == version
    assert manifest.step == 42 and manifest.metrics == {"val_loss": 0.25}
    assert manifest.run is not None and manifest.run.run_id == "golden-run"
    assert sk.verify(checkpoint).ok
    loaded = sk.load(checkpoint)
    # What the generator saved: these weights after one AdamW step on a batch of ones.
    expected = torch.nn.Linear(4, 3)
    with torch.no_grad():
        expected.weight.copy_(torch.arange(12, dtype=torch.float32).reshape(3, 4) / 10)
        expected.bias.copy_(torch.tensor([0.5, -0.5, 1.0]))
    step = torch.optim.AdamW(expected.parameters(), lr=0.01)
    expected(torch.ones(2, 4)).sum().backward()
    step.step()
    weight = expected.weight.detach()
    assert torch.allclose(loaded["model"]["weight"], weight, atol=1e-6)
    assert torch.allclose(loaded["model"]["bias"], expected.bias.detach(), atol=1e-6)
    assert torch.allclose(loaded["optim"]["state"][0]["exp_avg"], step.state[expected.weight]["exp_avg"], atol=1e-6)
    assert torch.equal(loaded["experts"]["experts.0.w"], torch.arange(6, dtype=torch.bfloat16).reshape(2, 3))
    assert loaded["step"] == 42 and loaded["config"] == {"name": "golden", "lr": 0.01}
    model = torch.nn.Linear(4, 3)
    optim = torch.optim.AdamW(model.parameters(), lr=0.5)
    restored = sk.CheckpointManager(root, keep_last=1, keep_best=0, read_only=True).restore(
        {"model": model, "optim": optim, "experts": {}, "step": 0, "config": {}}
    )
    assert restored.step == 42 and torch.allclose(model.weight.detach(), weight, atol=1e-6)
    assert optim.param_groups[0]["lr"] == 0.01 and set(optim.state[model.weight]) == {"step", "exp_avg", "exp_avg_sq"}


def _golden_v2_values() -> dict[str, Any]:
    """What tests/golden/make_golden_checkpoint.py --v2 saved (constants here, not read back)."""
    return {
        "w": torch.tensor([[0.0, 0.25], [0.5, 0.75], [1.0, 1.25], [1.5, 1.75]]),
        "col": torch.tensor([[-3, -2, -1, 0], [1, 2, 3, 4]]),
        "rep": torch.tensor([1.5, -2.0, 3.25], dtype=torch.float64),
        "uneven": torch.tensor([[0.0, -1.0], [-2.0, -3.0], [-4.0, -5.0]]),
        "bias": torch.tensor([0.5, -0.5, 1.0]),
    }


def _exactly(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def test_golden_v2_0_checkpoint_reads_verifies_and_loads_on_one_process(tmp_path: Path) -> None:
    """The format 2.0 checkpoint written by a 2-rank gloo save (tests/golden/make_golden_checkpoint.py
    --v2): DTensors Shard(0), Shard(1), Replicate and an uneven Shard(0) on a mesh of 2, whole
    tensors (one bf16) and JSON values. The committed bytes are read from a copy, never rewritten."""
    root = tmp_path / "root"
    shutil.copytree(GOLDEN / "v2.0", root)
    checkpoint = root / "step_00000042"
    raw = json.loads((checkpoint / "manifest.json").read_bytes())
    assert raw["metadata_version"] == COMPATIBLE_INDEXED_VERSION == "2.0"
    assert raw["meshes"] == [{"shape": [2]}] and raw["indexes"]["ranks"] == [0, 1]
    assert {t["key"]: t["placements"] for t in raw["sharded"]} == {
        "model.col": ["S1"],
        "model.rep": ["R"],
        "model.uneven": ["S0"],
        "model.w": ["S0"],
    }
    manifest = sk.read_manifest(checkpoint)
    assert manifest.metadata_version == "2.0" and manifest.world_size == 2
    assert manifest.step == 42 and manifest.metrics == {"val_loss": 0.25}
    assert manifest.run is not None and manifest.run.run_id == "golden-run"
    chunks = sorted((e.key, tuple(e.global_offset or ())) for _, e in manifest.iter_tensors() if e.global_offset)
    assert chunks == [
        ("model.col", (0, 0)),
        ("model.col", (0, 2)),
        ("model.rep", (0,)),
        ("model.uneven", (0, 0)),
        ("model.uneven", (2, 0)),
        ("model.w", (0, 0)),
        ("model.w", (2, 0)),
    ]
    report = sk.verify(checkpoint)
    assert report.ok, report.problems
    loaded = sk.load(checkpoint)
    expected = _golden_v2_values()
    assert set(loaded["model"]) == set(expected)
    for key, value in expected.items():
        assert _exactly(loaded["model"][key], value), key
    assert _exactly(loaded["experts"]["experts.0.w"], torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.bfloat16))
    assert loaded["step"] == 42 and loaded["config"] == {"name": "golden", "lr": 0.01}
    restored = sk.CheckpointManager(root, keep_last=1, keep_best=0, read_only=True).restore()
    assert restored.step == 42 and _exactly(restored.state["model"]["uneven"], expected["uneven"])


def _load_golden_v2_into_dtensors(rank: int, world_size: int, path: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    placements = {"w": Shard(0), "col": Shard(1), "rep": Replicate(), "uneven": Shard(0)}
    model: dict[str, Any] = {
        key: distribute_tensor(torch.zeros_like(value), mesh, [placements[key]])
        if key in placements
        else torch.zeros_like(value)
        for key, value in _golden_v2_values().items()
    }
    target: dict[str, Any] = {"model": model, "experts": {}, "step": 0, "config": {}}
    sk.load(path, into=target)
    return {
        "locals": {k: v.to_local().clone() for k, v in model.items() if isinstance(v, DTensor)},
        "whole": {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in model.items()},
        "dtensors": sorted(k for k, v in model.items() if isinstance(v, DTensor)),
        "step": target["step"],
    }


def test_golden_v2_0_checkpoint_loads_into_dtensors_on_two_ranks(tmp_path: Path) -> None:
    from tests.support.distributed_harness import results_or_raise, run_ranks

    root = tmp_path / "root"
    shutil.copytree(GOLDEN / "v2.0", root)
    results = results_or_raise(
        run_ranks(2, _load_golden_v2_into_dtensors, str(root / "step_00000042"), outbox=tmp_path / "out")
    )
    expected = _golden_v2_values()
    # Each rank's local chunk, as torch.chunk splits the saved global tensors over 2 ranks.
    local = [
        {
            "w": expected["w"][:2],
            "col": expected["col"][:, :2],
            "rep": expected["rep"],
            "uneven": expected["uneven"][:2],
        },
        {
            "w": expected["w"][2:],
            "col": expected["col"][:, 2:],
            "rep": expected["rep"],
            "uneven": expected["uneven"][2:],
        },
    ]
    for rank, result in enumerate(results):
        assert result["dtensors"] == ["col", "rep", "uneven", "w"] and result["step"] == 42
        for key, value in local[rank].items():
            assert _exactly(result["locals"][key], value), (rank, key)
        for key, value in expected.items():
            assert _exactly(result["whole"][key], value), (rank, key)


def _load_golden_v2_held(rank: int, world_size: int, path: str) -> list[Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    model = {
        "w": distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)]),
        "uneven": distribute_tensor(torch.zeros(3, 2), mesh, [Shard(0)]),
    }
    sk.load(path, into={"model": model}, select=sk.LoadSelection(extra="ignore"))
    return [model["w"].full_tensor().clone(), model["uneven"].full_tensor().clone()]


def test_an_extra_ignore_load_fills_a_key_whose_region_on_a_rank_is_empty(tmp_path: Path) -> None:
    # On 3 ranks, rank 2 holds no row of model.w (4 rows: 2, 2, 0) but reads rank 1's file for
    # model.uneven; that file's chunk of model.w is skipped, and model.w is still not "absent".
    from tests.support.distributed_harness import results_or_raise, run_ranks

    root = tmp_path / "root"
    shutil.copytree(GOLDEN / "v2.0", root)
    results = results_or_raise(run_ranks(3, _load_golden_v2_held, str(root / "step_00000042"), outbox=tmp_path / "o"))
    expected = _golden_v2_values()
    for w, uneven in results:
        assert _exactly(w, expected["w"]) and _exactly(uneven, expected["uneven"])


def _golden_v21_values() -> dict[str, Any]:
    """What tests/golden/make_golden_checkpoint.py --v2.1 saved (constants here, not read back)."""
    model = _golden_v2_values()
    model["big"] = (torch.arange(64 * 384, dtype=torch.float32) % 1000).reshape(64, 384) / 8
    model["table"] = torch.arange(16384, dtype=torch.float32) / 16
    experts = {f"experts.{i}.w": torch.full((4, 2), float(i)) + torch.arange(8).reshape(4, 2) for i in range(4)}
    return {"model": model, "experts": experts, "steps": [torch.tensor(float(10 + i)) for i in range(4)]}


def test_golden_v2_1_checkpoint_records_blocks_fast_digests_and_families(tmp_path: Path) -> None:
    """The format 2.1 checkpoint written by a 2-rank gloo save with 16 KiB blocks
    (tests/golden/make_golden_checkpoint.py --v2.1): every data file has a fast digest, chunks
    have strong+fast blocks instead of a digest of their own, a whole tensor over one block
    has fast-only blocks, four experts are one tensor family and four optimizer ``step``
    scalars one entry family. Read, verified and loaded on one process from a copy."""
    root = tmp_path / "root"
    shutil.copytree(GOLDEN / "v2.1", root)
    checkpoint = root / "step_00000042"
    raw = json.loads((checkpoint / "manifest.json").read_bytes())
    assert raw["metadata_version"] == "2.1" and raw["indexes"]["ranks"] == [0, 1]
    assert [f["key"] for f in raw["families"]] == ["experts.experts.{0}.w"]
    assert raw["families"][0]["indices"] == [[0, 4, 1]]
    optim = next(f for f in raw["files"] if f["path"].endswith("_optim.safetensors"))
    assert [f["key"] for f in optim["families"]] == ["optim.state.{0}.step"] and "tensors" not in optim
    table = next(t for f in raw["files"] for t in f.get("tensors", []) if t["key"] == "model.table")
    assert len(base64.b64decode(table["blocks"])) == 4 * 16  # 64 KiB in 16 KiB blocks, xxh3-128 each
    index = json.loads((checkpoint / "index" / "rank_00000.json").read_bytes())
    assert index["metadata_version"] == "2.1"
    sharded = index["files"][0]
    assert sharded["block_size"] == 16384 and sharded["fast_digest"].startswith("xxh3-128:")
    big = next(t for t in sharded["tensors"] if t["key"] == "model.big")
    assert "digest" not in big and len(base64.b64decode(big["blocks"])) == 3 * 48  # 48 KiB chunk
    manifest = sk.read_manifest(checkpoint)
    assert manifest.metadata_version == "2.1" and manifest.step == 42 and manifest.world_size == 2
    assert all(record.fast_digest for record in manifest.files)
    report = sk.verify(checkpoint)
    assert report.ok, report.problems
    loaded = sk.load(checkpoint)
    expected = _golden_v21_values()
    assert set(loaded["model"]) == set(expected["model"])
    for key, value in expected["model"].items():
        assert _exactly(loaded["model"][key], value), key
    assert set(loaded["experts"]) == set(expected["experts"])
    for key, value in expected["experts"].items():
        assert _exactly(loaded["experts"][key], value), key
    assert [loaded["optim"]["state"][i]["step"].item() for i in range(4)] == [10.0, 11.0, 12.0, 13.0]
    assert loaded["step"] == 42 and loaded["config"] == {"name": "golden", "lr": 0.01}
    restored = sk.CheckpointManager(root, keep_last=1, keep_best=0, read_only=True).restore()
    assert restored.step == 42 and _exactly(restored.state["model"]["big"], expected["model"]["big"])


def _load_golden_v21_resharded(rank: int, world_size: int, path: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    values = _golden_v21_values()
    target: dict[str, Any] = {
        "model": {"big": distribute_tensor(torch.zeros(64, 384), mesh, [Shard(0)])},
        "experts": {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in values["experts"].items()},
    }
    sk.load(path, into=target, select=sk.LoadSelection(extra="ignore"))
    return {
        "big": target["model"]["big"].full_tensor().clone(),
        "experts": {k: v.full_tensor().clone() for k, v in target["experts"].items()},
    }


def test_golden_v2_1_checkpoint_loads_resharded_onto_three_ranks(tmp_path: Path) -> None:
    from tests.support.distributed_harness import results_or_raise, run_ranks

    root = tmp_path / "root"
    shutil.copytree(GOLDEN / "v2.1", root)
    results = results_or_raise(
        run_ranks(3, _load_golden_v21_resharded, str(root / "step_00000042"), outbox=tmp_path / "out")
    )
    expected = _golden_v21_values()
    for result in results:
        assert _exactly(result["big"], expected["model"]["big"])
        for key, value in expected["experts"].items():
            assert _exactly(result["experts"][key], value), key


#: What tests/golden/make_golden_checkpoint.py --dtypes saved: (dtype, width in bytes, count).
_GOLDEN_CARRIED = [
    ("complex128", 16, 3),
    ("complex32", 4, 3),
    ("float8_e8m0fnu", 1, 5),
    ("float4_e2m1fn_x2", 1, 5),
    ("bits8", 1, 5),
    ("bits16", 2, 4),
    ("bits1x8", 1, 5),
    ("bits2x4", 1, 5),
    ("bits4x2", 1, 5),
]


def test_golden_checkpoint_of_carried_dtypes_reads_verifies_and_loads(tmp_path: Path) -> None:
    """The checkpoint holding one tensor of each dtype a shard's header carries under another
    (tests/golden/make_golden_checkpoint.py --dtypes): the manifest names the true dtypes, and
    every byte loads back as saved."""
    root = tmp_path / "root"
    shutil.copytree(GOLDEN / "v1.3-dtypes", root)
    checkpoint = root / "step_00000042"
    manifest = sk.read_manifest(checkpoint)
    assert manifest.metadata_version == "1.3" and manifest.step == 42
    recorded = {entry.key: entry.dtype for record in manifest.files for entry in record.tensors}
    assert recorded["complex128"] == "C128" and recorded["bits4x2"] == "B4X2" and recorded["plain"] == "F32"
    assert sk.verify(checkpoint).ok
    loaded = sk.load(checkpoint)
    assert torch.equal(loaded["plain"], torch.tensor([0.0, 1.0, 2.0, 3.0]))
    for name, width, count in _GOLDEN_CARRIED:
        tensor = loaded[name]
        assert tensor.dtype == getattr(torch, name) and tuple(tensor.shape) == (count,), name
        raw = tensor.reshape(count, 1).view(torch.uint8).reshape(-1)
        expected = [index * 37 % 251 for index in range(count * width)]
        assert raw.tolist() == expected, name
