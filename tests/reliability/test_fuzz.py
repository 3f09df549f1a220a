"""Hypothesis fuzzing of the four parsers that read untrusted bytes: the manifest, the shard
(safetensors) header, paths, and the signature file. The only errors
allowed are shardkeep's own types; 10,000+ inputs in the full run."""

from __future__ import annotations

import copy
import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardkeep as sk
from shardkeep.integrity import (
    SignaturePolicy,
    check_signature,
    digest_bytes,
    parse_signature,
    seal_manifest,
    sign_manifest,
)
from shardkeep.manifest import decode_manifest, encode_manifest, unsafe_path_reason, validate_manifest
from shardkeep.tensors.shardfile import build_header, check_header, parse_header
from tests.reliability import format2
from tests.support.figures import record, scale

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


# --------------------------------------------------------------------------------------------
# format 2.0: the root manifest's new fields (meshes, sharded, indexes) and the rank indexes
# --------------------------------------------------------------------------------------------

_DEEP = "__DEEP__"  # a value that becomes 100,000 nested lists in the written JSON
_DELETE = object()


def _dumps(raw: Any) -> bytes:
    body = json.dumps(raw, separators=(",", ":")).encode()
    return body.replace(f'"{_DEEP}"'.encode(), b"[" * 100_000 + b"]" * 100_000)


def _node(documents: dict[str, Any], path: str) -> tuple[Any, str | int]:
    """The container and the member that a dotted ``path`` names (``root.`` or ``index<r>.``
    first; a list is indexed by position, or by the ``key`` of its element)."""
    head, *parts = path.split(".")
    node: Any = documents[head]
    for part in parts[:-1]:
        if isinstance(node, list) and not part.isdigit():
            node = next(item for item in node if item.get("key") == part)
        else:
            node = node[int(part)] if isinstance(node, list) else node[part]
    last = parts[-1]
    if isinstance(node, list) and last not in ("+",) and not last.isdigit():
        return node, next(i for i, item in enumerate(node) if item.get("key") == last)
    return node, int(last) if isinstance(node, list) and last.isdigit() else last


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """Set ``value`` at ``path`` (``_DELETE`` removes the member; a last component ``+``
    appends; a callable value gets the old one)."""

    def edit(documents: dict[str, Any]) -> None:
        container, member = _node(documents, path)
        if member == "+":
            container.append(value)
        elif value is _DELETE:
            del container[member]
        else:
            container[member] = value(container[member]) if callable(value) else value

    return edit


def _all_of(*edits: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def edit(documents: dict[str, Any]) -> None:
        for one in edits:
            one(documents)

    return edit


def _duplicate(path: str) -> Callable[[dict[str, Any]], None]:
    def edit(documents: dict[str, Any]) -> None:
        container, member = _node(documents, path)
        container.append(copy.deepcopy(container[member]))

    return edit


_W = "root.sharded.w"
_CHUNK = "index1.files.0.tensors.w"
_TABLE = "root.indexes"
_SHARDED_X = {"key": "x", "path": ["x"], "dtype": "F32", "global_shape": [4, 2], "mesh": 0, "placements": ["S0"]}

#: name -> (the edit, whether the index records keep their pristine size and digest instead of
#: matching the edited indexes, whether a load may still succeed exactly: edits a newer 2.x
#: minor may make, or that change nothing a reader uses)
FORMAT2_CASES: dict[str, tuple[Callable[[dict[str, Any]], None], bool, bool]] = {
    # the root manifest's meshes
    "meshes not a list": (_set("root.meshes", {"shape": [2]}), False, False),
    "mesh shape a string": (_set("root.meshes.0.shape", "2"), False, False),
    "mesh shape empty": (_set("root.meshes.0.shape", []), False, False),
    "mesh shape 0": (_set("root.meshes.0.shape", [0]), False, False),
    "mesh shape negative": (_set("root.meshes.0.shape", [-2]), False, False),
    "mesh shape 1": (_set("root.meshes.0.shape", [1]), False, False),
    "mesh shape 2 x 2": (_set("root.meshes.0.shape", [2, 2]), False, False),
    "mesh shape 2**64": (_set("root.meshes.0.shape", [2**64]), False, False),
    "mesh shape 10**400": (_set("root.meshes.0.shape", [10**400]), False, False),
    "mesh shape of 1,000 dimensions": (_set("root.meshes.0.shape", [1] * 999 + [2]), False, False),
    "mesh ranks outside the world": (_set("root.meshes.0.ranks", [0, 2]), False, False),
    "mesh ranks negative": (_set("root.meshes.0.ranks", [-1, 0]), False, False),
    "mesh ranks repeated": (_set("root.meshes.0.ranks", [1, 1]), False, False),
    "mesh ranks swapped": (_set("root.meshes.0.ranks", [1, 0]), False, False),
    "mesh ranks too few": (_set("root.meshes.0.ranks", [0]), False, False),
    "mesh ranks nested deep": (_set("root.meshes.0.ranks", _DEEP), False, False),
    "mesh unknown field": (_set("root.meshes.0.future", 1), False, True),
    "meshes empty": (_set("root.meshes", []), False, False),
    "an unused second mesh": (_set("root.meshes.+", {"shape": [2]}), False, True),
    # the root manifest's sharded tensors
    "sharded not a list": (_set("root.sharded", "w"), False, False),
    "sharded empty": (_set("root.sharded", []), False, False),
    "sharded tensor removed": (_set(_W, _DELETE), False, False),
    "sharded tensor added": (_set("root.sharded.+", _SHARDED_X), False, False),
    "sharded tensor described twice": (_duplicate(_W), False, False),
    "sharded dtype of another size": (_set(f"{_W}.dtype", "F64"), False, False),
    "sharded dtype of the same size": (_set(f"{_W}.dtype", "I32"), False, False),
    "sharded dtype unknown": (_set(f"{_W}.dtype", "F128"), False, False),
    "sharded dtype a number": (_set(f"{_W}.dtype", 4), False, False),
    "sharded global_shape larger": (_set(f"{_W}.global_shape", [6, 2]), False, False),
    "sharded global_shape smaller": (_set(f"{_W}.global_shape", [2, 2]), False, False),
    "sharded global_shape transposed": (_set(f"{_W}.global_shape", [2, 4]), False, False),
    "sharded global_shape negative": (_set(f"{_W}.global_shape", [-4, 2]), False, False),
    "sharded global_shape 2**63": (_set(f"{_W}.global_shape", [2**63, 2]), False, False),
    "sharded global_shape 0 x 2**63": (_set(f"{_W}.global_shape", [0, 2**63]), False, False),
    "sharded global_shape 10**400": (_set(f"{_W}.global_shape", [10**400, 2]), False, False),
    "sharded global_shape a string": (_set(f"{_W}.global_shape", "4,2"), False, False),
    "sharded global_shape 0-D": (_set(f"{_W}.global_shape", []), False, False),
    "sharded global_shape of 1,000 dimensions": (_set(f"{_W}.global_shape", [4, 2] + [1] * 998), False, False),
    "sharded mesh 1": (_set(f"{_W}.mesh", 1), False, False),
    "sharded mesh -1": (_set(f"{_W}.mesh", -1), False, False),
    "sharded mesh 2**64": (_set(f"{_W}.mesh", 2**64), False, False),
    "sharded mesh null": (_set(f"{_W}.mesh", None), False, False),
    "placements S1 instead of S0": (_set(f"{_W}.placements", ["S1"]), False, False),
    "placements R instead of S0": (_set(f"{_W}.placements", ["R"]), False, False),
    "placements S0 instead of R": (_set("root.sharded.rep.placements", ["S0"]), False, False),
    "placements S2 of a 2-D tensor": (_set(f"{_W}.placements", ["S2"]), False, False),
    "placements S999": (_set(f"{_W}.placements", ["S999"]), False, False),
    "placements S-1": (_set(f"{_W}.placements", ["S-1"]), False, False),
    "placements two for a 1-D mesh": (_set(f"{_W}.placements", ["S0", "R"]), False, False),
    "placements none": (_set(f"{_W}.placements", []), False, False),
    "placements a string": (_set(f"{_W}.placements", "S0"), False, False),
    "placements a number": (_set(f"{_W}.placements", [0]), False, False),
    "placements Partial": (_set(f"{_W}.placements", ["P"]), False, False),
    "sharded key renamed": (_set(f"{_W}.key", "v"), False, False),
    "sharded key of the whole tensor": (_set(f"{_W}.key", "bias"), False, False),
    "sharded path changed": (_set(f"{_W}.path", ["v"]), False, False),
    "sharded path nested deep": (_set(f"{_W}.path", _DEEP), False, False),
    "sharded path with an object": (_set(f"{_W}.path", [{"a": 1}]), False, False),
    "sharded type expert": (_set(f"{_W}.type", "expert"), False, False),
    "sharded type unknown": (_set(f"{_W}.type", "other"), False, False),
    "sharded order changed": (_set(f"{_W}.order", 99), False, False),
    "sharded unknown field": (_set(f"{_W}.future", [1]), False, True),
    # the root manifest's index table
    "indexes not an object": (_set(_TABLE, 1), False, False),
    "indexes a list": (_set(_TABLE, []), False, False),
    "indexes removed": (_set(_TABLE, _DELETE), False, False),
    "index table empty": (_set(_TABLE, lambda t: {**t, "ranks": [], "sizes": [], "digests": []}), False, False),
    "index of rank 1 removed": (
        _set(_TABLE, lambda t: {k: v[:1] if isinstance(v, list) else v for k, v in t.items()}),
        False,
        False,
    ),
    "index ranks repeated": (_set(f"{_TABLE}.ranks", [0, 0]), False, False),
    "index rank 2": (_set(f"{_TABLE}.ranks", [0, 2]), False, False),
    "index rank -1": (_set(f"{_TABLE}.ranks", [0, -1]), False, False),
    "index rank 2**64": (_set(f"{_TABLE}.ranks", [0, 2**64]), False, False),
    "index rank a string": (_set(f"{_TABLE}.ranks", [0, "1"]), False, False),
    "index ranks swapped": (_set(f"{_TABLE}.ranks", [1, 0]), True, False),
    "index columns of different lengths": (_set(f"{_TABLE}.sizes", lambda old: old[:1]), True, False),
    "index size -1": (_set(f"{_TABLE}.sizes.1", -1), True, False),
    "index size one more": (_set(f"{_TABLE}.sizes.1", lambda old: old + 1), True, False),
    "index size 2**64": (_set(f"{_TABLE}.sizes.1", 2**64), True, False),
    "index size 10**400": (_set(f"{_TABLE}.sizes.1", 10**400), True, False),
    "index size a string": (_set(f"{_TABLE}.sizes.1", "1"), True, False),
    "index digest malformed": (_set(f"{_TABLE}.digests.1", "zz"), True, False),
    "index digest upper-case": (_set(f"{_TABLE}.digests.1", lambda old: old.upper()), True, False),
    "index digest of rank 0's index": (_set(f"{_TABLE}.digests", lambda old: [old[0], old[0]]), True, False),
    "index digest null": (_set(f"{_TABLE}.digests.1", None), True, False),
    "index algorithm unknown": (_set(f"{_TABLE}.algorithm", "md5"), True, False),
    "index algorithm of another length": (_set(f"{_TABLE}.algorithm", "xxh3-128"), True, False),
    "index algorithm sha256": (_set(f"{_TABLE}.algorithm", "sha256"), True, False),
    "index prefix ..": (_set(f"{_TABLE}.prefix", "../"), True, False),
    "index prefix absolute": (_set(f"{_TABLE}.prefix", "/etc/"), True, False),
    "index prefix without a slash": (_set(f"{_TABLE}.prefix", "x"), True, False),
    "index prefix with NUL": (_set(f"{_TABLE}.prefix", "a\x00/"), True, False),
    "index prefix of a missing directory": (_set(f"{_TABLE}.prefix", "attempt/"), True, False),
    "index data_bytes negative": (_set(f"{_TABLE}.data_bytes", -1), True, False),
    "index table unknown field": (_set(f"{_TABLE}.future", "x"), False, True),
    "world_size 1": (_set("root.world_size", 1), False, False),
    "world_size 3": (_set("root.world_size", 3), False, True),
    "world_size 2**64": (_set("root.world_size", 2**64), False, True),  # a record (as in 1.x): the meshes count
    "metadata_version 1.3": (_set("root.metadata_version", "1.3"), False, False),
    "metadata_version 2.9": (_set("root.metadata_version", "2.9"), False, True),
    # the rank indexes (their records in the root made to match their new bytes)
    "index: an unknown top-level field": (_set("index1.future", 1), False, False),
    "index: an unknown field in a file record": (_set("index1.files.0.future", 1), False, False),
    "index: an unknown field in a chunk entry": (_set(f"{_CHUNK}.future", 1), False, False),
    "index: not an object": (lambda d: d.__setitem__("index1", [1]), False, False),
    "index: nested deep": (lambda d: d.__setitem__("index1", _DEEP), False, False),
    "index: format changed": (_set("index1.format", "shardkeep"), False, False),
    "index: metadata_version 1.3": (_set("index1.metadata_version", "1.3"), False, False),
    "index: metadata_version 3.0": (_set("index1.metadata_version", "3.0"), False, False),
    "index: metadata_version a number": (_set("index1.metadata_version", 2.0), False, False),
    "index: rank of the other rank": (_set("index1.rank", 0), False, False),
    "index: rank 2**64": (_set("index1.rank", 2**64), False, False),
    "index: rank a string": (_set("index1.rank", "1"), False, False),
    "index: rank removed": (_set("index1.rank", _DELETE), False, False),
    "index: the other rank's index": (lambda d: d.__setitem__("index1", copy.deepcopy(d["index0"])), False, False),
    "index: files not a list": (_set("index1.files", {}), False, False),
    "index: files empty": (_set("index1.files", []), False, False),
    "index: files nested deep": (_set("index1.files", _DEEP), False, False),
    "index: file record twice": (_duplicate("index1.files.0"), False, False),
    "index: file path ..": (_set("index1.files.0.path", "../outside.safetensors"), False, False),
    "index: file path shards/../..": (_set("index1.files.0.path", "shards/../../x.safetensors"), False, False),
    "index: file path absolute": (_set("index1.files.0.path", "/etc/passwd"), False, False),
    "index: file path of rank 0's file": (
        _set("index1.files.0.path", "shards/rank_00000_sharded.safetensors"),
        False,
        False,
    ),
    "index: file path of the root's data file": (
        _set("index1.files.0.path", "shards/rank_00000.safetensors"),
        False,
        False,
    ),
    "index: file path of the manifest": (_set("index1.files.0.path", "manifest.json"), False, False),
    "index: file path of an index": (_set("index1.files.0.path", "index/rank_00000.json"), False, False),
    "index: file rank 0": (_set("index1.files.0.rank", 0), False, False),
    "index: file size -1": (_set("index1.files.0.size", -1), False, False),
    "index: file size one more": (_set("index1.files.0.size", lambda old: old + 1), False, False),
    "index: file size 2**64": (_set("index1.files.0.size", 2**64), False, False),
    "index: file size 10**400": (_set("index1.files.0.size", 10**400), False, False),
    "index: file digest null": (_set("index1.files.0.digest", None), False, False),
    "index: file digest malformed": (_set("index1.files.0.digest", "blake3:00"), False, False),
    # Both digests: a default load checks the fast one, verify and keyed loads the other
    # (tests/test_load_digests.py covers each alone).
    "index: file digests of other bytes": (
        lambda d: (
            _set("index1.files.0.digest", "blake3:" + "0" * 64)(d),
            _set("index1.files.0.fast_digest", "xxh3-128:" + "0" * 32)(d),
        ),
        False,
        False,
    ),
    "index: file ref ..": (_set("index1.files.0.ref", ".."), False, False),
    "index: file ref to another checkpoint": (_set("index1.files.0.ref", "other"), False, False),
    "index: file tier unknown": (_set("index1.files.0.tier", "cold"), False, False),
    "index: file version 0": (_set("index1.files.0.version", 0), False, False),
    "index: file version 2": (_set("index1.files.0.version", 2), False, False),
    "index: file compressed": (
        _set("index1.files.0.compression", {"codec": "zstd", "level": 3, "stored_size": 5}),
        False,
        False,
    ),
    "index: chunk entries removed": (_set("index1.files.0.tensors", []), False, False),
    "index: chunk of w removed": (_set(_CHUNK, _DELETE), False, False),
    "index: chunk twice": (_duplicate(_CHUNK), False, False),
    "index: chunk off the grid": (_set(f"{_CHUNK}.global_offset", [1, 0]), False, False),
    "index: chunk at rank 0's offset": (_set(f"{_CHUNK}.global_offset", [0, 0]), False, False),
    "index: chunk offset negative": (_set(f"{_CHUNK}.global_offset", [-2, 0]), False, False),
    "index: chunk offset 2**64": (_set(f"{_CHUNK}.global_offset", [2**64, 0]), False, False),
    "index: chunk offset of 1 dimension": (_set(f"{_CHUNK}.global_offset", [2]), False, False),
    "index: chunk offset null": (_set(f"{_CHUNK}.global_offset", None), False, False),
    "index: chunk offset removed": (_set(f"{_CHUNK}.global_offset", _DELETE), False, False),
    "index: chunk offset a string": (_set(f"{_CHUNK}.global_offset", "2,0"), False, False),
    "index: chunk shape larger": (_set(f"{_CHUNK}.shape", [3, 2]), False, False),
    "index: chunk shape of 3 dimensions": (_set(f"{_CHUNK}.shape", [2, 2, 1]), False, False),
    "index: chunk shape 2**63": (_set(f"{_CHUNK}.shape", [2**63, 2]), False, False),
    "index: chunk dtype of the same size": (_set(f"{_CHUNK}.dtype", "I32"), False, False),
    "index: chunk dtype unknown": (_set(f"{_CHUNK}.dtype", "F128"), False, False),
    "index: chunk global_shape mismatched": (_set(f"{_CHUNK}.global_shape", [6, 2]), False, False),
    "index: chunk global_shape null": (_set(f"{_CHUNK}.global_shape", None), False, False),
    "index: chunk global_shape 2**63": (_set(f"{_CHUNK}.global_shape", [2**63, 2]), False, False),
    "index: chunk key of another sharded tensor": (_set(f"{_CHUNK}.key", "col"), False, False),
    "index: chunk key of the whole tensor": (_set(f"{_CHUNK}.key", "bias"), False, False),
    "index: chunk key unknown": (_set(f"{_CHUNK}.key", "zzz"), False, False),
    "index: chunk path mismatched": (_set(f"{_CHUNK}.path", ["col"]), False, False),
    "index: chunk path nested deep": (_set(f"{_CHUNK}.path", _DEEP), False, False),
    "index: chunk byte offset -1": (_set(f"{_CHUNK}.offset", -1), False, False),
    "index: chunk byte offset past the end": (_set(f"{_CHUNK}.offset", 10**6), False, False),
    "index: chunk byte offset 2**64": (_set(f"{_CHUNK}.offset", 2**64), False, False),
    "index: chunk nbytes one more": (_set(f"{_CHUNK}.nbytes", lambda old: old + 1), False, False),
    "index: chunk nbytes -1": (_set(f"{_CHUNK}.nbytes", -1), False, False),
    "index: chunk digest malformed": (_set(f"{_CHUNK}.digest", "blake3:1"), False, False),
    "index: chunk digest of other bytes": (_set(f"{_CHUNK}.digest", "blake3:" + "ab" * 32), False, False),
    "index: chunk type expert": (_set(f"{_CHUNK}.type", "expert"), False, False),
    "index: chunk array_type numpy": (_set(f"{_CHUNK}.array_type", "numpy"), False, False),
    "index: chunk order changed": (_set(f"{_CHUNK}.order", lambda old: old + 1), False, False),
}


def _write_case(checkpoint: Path, edit: Callable[[dict[str, Any]], None], keep_records: bool) -> None:
    """Apply ``edit`` to the root manifest and the indexes of an unsigned copy, rewrite the
    indexes it changed and re-seal the root, with the index records matching the new index
    bytes (unless ``keep_records``): what a writer without the signing key can do."""
    root = json.loads((checkpoint / "manifest.json").read_bytes())
    root.pop("manifest_digest")
    originals = {rank: (checkpoint / "index" / f"rank_0000{rank}.json").read_bytes() for rank in (0, 1)}
    documents: dict[str, Any] = {"root": root, **{f"index{r}": json.loads(data) for r, data in originals.items()}}
    pristine = copy.deepcopy(documents)
    edit(documents)
    written = dict(originals)
    for rank in (0, 1):
        if documents[f"index{rank}"] != pristine[f"index{rank}"]:
            written[rank] = _dumps(documents[f"index{rank}"]) + b"\n"
            (checkpoint / "index" / f"rank_0000{rank}.json").write_bytes(written[rank])
    table = root.get("indexes")
    if not keep_records and isinstance(table, dict):
        ranks, sizes, digests = table.get("ranks"), table.get("sizes"), table.get("digests")
        if isinstance(ranks, list) and isinstance(sizes, list) and isinstance(digests, list):
            for position, rank in enumerate(ranks):
                if rank in (0, 1) and position < len(sizes) and position < len(digests):
                    data = written[rank]
                    sizes[position] = len(data)
                    digests[position] = digest_bytes("blake3", data).partition(":")[2]
    (checkpoint / "manifest.json").write_bytes(seal_manifest(_dumps(root), "blake3"))


def _chunks(manifest: sk.Manifest) -> list[tuple[str, tuple[int, ...]]]:
    return sorted((entry.key, tuple(entry.global_offset or ())) for _, entry in manifest.iter_tensors())


def _readers_outcome(checkpoint: Path, chunks: list[tuple[str, tuple[int, ...]]]) -> dict[str, str]:
    """What read_manifest, load and verify make of a checkpoint: ``refused`` (a
    ShardkeepError; for verify, a report with problems), ``ok`` (read_manifest: with every
    chunk of ``chunks``, no other), ``exact`` (load: the saved values), ``WRONG`` or
    ``untyped <error>`` (anything else raised)."""
    outcome: dict[str, str] = {}
    for name, call in {
        "read_manifest": lambda: sk.read_manifest(checkpoint),
        "load": lambda: sk.load(checkpoint),
        "verify": lambda: sk.verify(checkpoint),
    }.items():
        try:
            result = call()
        except sk.ShardkeepError:
            outcome[name] = "refused"
            continue
        except Exception as exc:
            outcome[name] = f"untyped {type(exc).__name__}: {str(exc)[:200]}"
            continue
        if name == "load":
            outcome[name] = "exact" if format2.same(result) else "WRONG"
        elif name == "verify":
            outcome[name] = "ok" if result.ok else "refused"
        else:
            outcome[name] = "ok" if _chunks(result) == chunks else "WRONG (other chunks)"
    return outcome


_PRISTINE_CHUNKS: list[tuple[str, tuple[int, ...]]] = []


def _format2_case_failure(factory: pytest.TempPathFactory, checkpoint: Path, name: str) -> str | None:
    """Run one case of the corpus; None when every reader did what it must."""
    edit, keep_records, may_load = FORMAT2_CASES[name]
    format2.copy(factory, checkpoint, signed=False)
    if not _PRISTINE_CHUNKS:
        _PRISTINE_CHUNKS.extend(_chunks(sk.read_manifest(checkpoint)))
    chunks = _PRISTINE_CHUNKS
    _write_case(checkpoint, edit, keep_records)
    outcome = _readers_outcome(checkpoint, chunks)
    shutil.rmtree(checkpoint)
    # read_manifest does not read data files: it may pass what only load and verify can see.
    refused = outcome["load"] == outcome["verify"] == "refused" and outcome["read_manifest"] in ("refused", "ok")
    loaded = outcome == {"read_manifest": "ok", "load": "exact", "verify": "ok"}
    return None if refused or (may_load and loaded) else f"{name}: {outcome}"


def test_hostile_format_2_fields_and_indexes_are_refused_by_every_reader(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """A corpus of hostile values in the root manifest's format 2.0 fields and in a rank index
    (wrong types, huge and negative numbers, deep nesting, unknown fields, another rank, paths
    that climb out or name other files, a dtype or global shape that disagrees, chunks off the
    grid...), each written as a writer without the signing key could (indexes re-digested, the
    root re-sealed). Load must raise a ShardkeepError and verify must report a problem;
    read_manifest must raise one too, or (for what only the data files show) return exactly the
    pristine chunks; never another exception, never other values. A few edits that a newer 2.x
    minor may make (unknown fields in the root, an unused mesh) may also load exactly."""
    cases = list(FORMAT2_CASES)
    failures = [
        failure
        for position, name in enumerate(cases)
        if (failure := _format2_case_failure(tmp_path_factory, tmp_path / f"case{position}", name)) is not None
    ]
    record(
        "hostile format 2.0 fields",
        trials=3 * len(cases),
        failures=len(failures),
        detail=f"{len(cases)} hostile edits of the root's meshes/sharded/indexes and of a rank index (re-digested "
        "and re-sealed) x read_manifest, load, verify: a ShardkeepError, nothing else",
    )
    assert failures == [], "\n".join(failures)
