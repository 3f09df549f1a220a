"""Hypothesis fuzzing of the four parsers that read untrusted bytes: the manifest, the shard
(safetensors) header, paths, and the signature file (RELIABILITY.md rule 16). The only errors
allowed are shardkeep's own types; 10,000+ inputs in the full run."""

from __future__ import annotations

import json
import struct
from typing import Any

import msgspec
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardkeep as sk
from figures import record, scale
from shardkeep.integrity import SignaturePolicy, check_signature, parse_signature, seal_manifest, sign_manifest
from shardkeep.manifest import decode_manifest, encode_manifest, unsafe_path_reason, validate_manifest
from shardkeep.tensors.shardfile import build_header, check_header, parse_header

EXAMPLES = scale(500, 2600)
KEY = Ed25519PrivateKey.generate()
_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=16,
)


def _reference_manifest(tmp_dir: str) -> tuple[bytes, sk.Manifest]:
    manifest = sk.save({"w": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([1, 2]), "step": 3}, f"{tmp_dir}/c")
    return seal_manifest(encode_manifest(manifest), "blake3"), manifest


def _mutate(data: bytes, edits: list[tuple[int, int, bytes]]) -> bytes:
    out = bytearray(data)
    for position, length, replacement in edits:
        at = position % (len(out) + 1)
        out[at : at + length] = replacement
    return bytes(out)


_edits = st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 8), st.binary(max_size=8)), min_size=1, max_size=4)


def _record(name: str, seen: int) -> None:
    record("parser fuzzing", trials=seen, failures=0, detail=name)
    assert seen >= EXAMPLES // 2


def test_fuzz_the_manifest_parser(tmp_path: Any) -> None:
    canonical, _ = _reference_manifest(str(tmp_path))
    keys = ["metadata_version", "files", "step", "tiers", "sharding", "values", "structure", "run", "x"]

    seen = 0

    @_SETTINGS
    @given(
        st.one_of(
            st.binary(max_size=600),
            _edits.map(lambda edits: _mutate(canonical, edits)),
            st.dictionaries(st.sampled_from(keys), _json, max_size=6).map(msgspec.json.encode),
        )
    )
    def run(data: bytes) -> None:
        nonlocal seen
        seen += 1
        try:
            validate_manifest(decode_manifest(data))
        except sk.ManifestError:
            pass

    run()

    _record("manifest: arbitrary bytes, edits of a real manifest, JSON objects with manifest keys", seen)


def test_fuzz_the_shard_header_parser(tmp_path: Any) -> None:
    _, manifest = _reference_manifest(str(tmp_path))
    record_ = manifest.files[0]
    spans = [(e.key, e.dtype, e.shape, e.offset - 0, e.offset + e.nbytes) for e in record_.tensors]
    real = build_header(spans, version=1)
    entry = st.fixed_dictionaries(
        {"dtype": st.sampled_from(["F32", "I64", "BF16", "X"]) | _json, "shape": _json, "data_offsets": _json}
    )

    def framed(body: bytes) -> bytes:
        return struct.pack("<Q", len(body)) + body + b"\0" * 64

    seen = 0

    @_SETTINGS
    @given(
        st.one_of(
            st.binary(max_size=300),
            _edits.map(lambda edits: _mutate(real, edits)),
            st.dictionaries(st.text(max_size=6), entry | _json, max_size=4).map(
                lambda d: framed(json.dumps(d).encode())
            ),
            st.tuples(st.integers(0, (1 << 64) - 1), st.binary(max_size=50)).map(
                lambda t: struct.pack("<Q", t[0]) + t[1]
            ),
        )
    )
    def run(data: bytes) -> None:
        nonlocal seen
        seen += 1
        try:
            check_header(parse_header(data), record_)
        except sk.IntegrityError:
            pass

    run()

    _record("shard header: arbitrary bytes, edits of a real header, JSON entries, huge length prefixes", seen)


def test_fuzz_the_path_checker() -> None:
    parts = st.sampled_from(["..", ".", "", "a", "shards", "\\", "\0", "/", "~", "x" * 300, "é", "\ud800", " "])

    seen = 0

    @_SETTINGS
    @given(st.text(max_size=60) | st.lists(parts | st.text(max_size=5), max_size=8).map("/".join))
    def run(path: str) -> None:
        nonlocal seen
        seen += 1
        reason = unsafe_path_reason(path)
        if reason is None:
            components = path.split("/")
            assert path and not path.startswith("/") and "\\" not in path and "\0" not in path
            assert all(c not in ("", ".", "..") for c in components)

    run()

    _record("paths: text and slash-joined hostile components", seen)


def test_fuzz_the_signature_parser(tmp_path: Any) -> None:
    canonical, manifest = _reference_manifest(str(tmp_path))
    signature = sign_manifest(canonical, KEY, manifest)
    policy = SignaturePolicy.of(KEY.public_key())
    assert check_signature(canonical, signature, policy).verified

    seen = 0

    @_SETTINGS
    @given(
        st.one_of(
            st.binary(max_size=300),
            _edits.map(lambda edits: _mutate(signature, edits)),
            st.dictionaries(st.sampled_from(["format", "algorithm", "key_id", "signature", "x"]), _json).map(
                msgspec.json.encode
            ),
        )
    )
    def run(data: bytes) -> None:
        nonlocal seen
        seen += 1
        try:
            parse_signature(data)
            status = check_signature(canonical, data, policy)
        except sk.SignatureError:
            return
        assert data == signature and status.verified  # only the genuine signature passes

    run()

    _record("signature: arbitrary bytes, edits of a real signature, JSON objects", seen)
