"""The committed manifest as the commit broadcast carries it (``saving.wire.encode_committed``):
every rank gets back a manifest equal to the coordinator's, in fewer bytes than its pickle."""

from __future__ import annotations

import pickle
from pathlib import Path

import msgspec

from shardkeep.manifest import IndexedManifest, IndexTable, Manifest
from shardkeep.saving.manifest_build import with_entry_families
from shardkeep.saving.wire import decode_committed, encode_committed
from shardkeep.verification import parse_manifest

GOLDEN = Path(__file__).parent / "golden"


def _root(version: str) -> Manifest:
    data = (GOLDEN / version / "step_00000042" / "manifest.json").read_bytes()
    return parse_manifest(data, where=version)


def _same(decoded: Manifest, original: Manifest) -> None:
    assert type(decoded) is type(original)
    assert msgspec.to_builtins(decoded) == msgspec.to_builtins(original)
    assert decoded == original


def test_golden_roots_come_back_equal() -> None:
    for version in ("v1.3", "v1.4", "v2.0", "v2.1"):
        original = _root(version)
        _same(decode_committed(encode_committed(original)), original)


def _wide_table(manifest: IndexedManifest, ranks: list[int], digests: list[str]) -> IndexedManifest:
    table = IndexTable(algorithm="blake3", ranks=ranks, sizes=[1000 + r for r in ranks], digests=digests)
    return msgspec.structs.replace(manifest, indexes=table)


def test_index_digests_travel_as_raw_bytes() -> None:
    root = _root("v2.1")
    assert isinstance(root, IndexedManifest)
    digests = [f"{rank:064x}" for rank in range(4096)]
    many = _wide_table(root, list(range(4096)), digests)
    sent = encode_committed(many)
    _same(decode_committed(sent), many)
    # 32 bytes a rank for the digest, a few for the size, nothing for the rank itself.
    assert len(sent) < len(pickle.dumps(many)) * 0.6
    assert len(sent) - len(encode_committed(_wide_table(root, [], []))) < 4096 * 38


def test_unusual_tables_travel_as_they_are() -> None:
    root = _root("v2.1")
    assert isinstance(root, IndexedManifest)
    for ranks, digests in (
        ([0, 2, 5], ["ab" * 32, "cd" * 32, "ef" * 32]),  # ranks with gaps
        ([0, 1], ["AB" * 32, "cd" * 32]),  # upper case: kept exactly
        ([0, 1], ["ab" * 32, "cd" * 16]),  # lengths differ
        ([0, 1], ["zz" * 32, "cd" * 32]),  # not hexadecimal
    ):
        unusual = _wide_table(root, ranks, digests)
        _same(decode_committed(encode_committed(unusual)), unusual)
    no_table = msgspec.structs.replace(root, indexes=None)
    _same(decode_committed(encode_committed(no_table)), no_table)


def test_entry_families_travel_as_the_root_records_them() -> None:
    root = _root("v2.1")  # decoded: entry families expanded into the files' entries
    assert isinstance(root, IndexedManifest)
    compact = with_entry_families(root)
    assert any(record.families for record in compact.files)
    sent = encode_committed(compact)
    _same(decode_committed(sent), root)
    assert len(sent) < len(encode_committed(root))
