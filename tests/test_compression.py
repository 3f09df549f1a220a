"""Optional deterministic zstd compression of data files."""

from __future__ import annotations

import json
from pathlib import Path

import blake3
import pytest
import torch
import zstandard

import shardkeep as sk
from shardkeep.integrity import seal_manifest


def _state() -> dict[str, torch.Tensor]:
    return {
        "zeros": torch.zeros(256, 256),
        "ramp": torch.arange(10_000).float(),
        "noise": torch.randn(100, generator=torch.Generator().manual_seed(1)),
    }


def test_compressed_files_round_trip_and_record_their_settings(tmp_path: Path) -> None:
    manifest = sk.save(_state(), tmp_path / "ckpt", compression="zstd", compression_level=5)
    record = manifest.files[0]
    assert record.path.endswith(".safetensors.zst")
    assert record.compression is not None
    assert (record.compression.codec, record.compression.level) == ("zstd", 5)
    stored = (tmp_path / "ckpt" / record.path).read_bytes()
    assert len(stored) == record.compression.stored_size < record.size
    raw = zstandard.ZstdDecompressor().decompress(stored)
    assert len(raw) == record.size
    assert record.digest == "blake3:" + blake3.blake3(raw).hexdigest()  # digest of the uncompressed bytes
    loaded = sk.load(tmp_path / "ckpt")
    for key, tensor in _state().items():
        assert torch.equal(loaded[key], tensor)
    assert sk.verify(tmp_path / "ckpt").ok


def test_compression_is_deterministic(tmp_path: Path) -> None:
    first = sk.save(_state(), tmp_path / "a", compression="zstd")
    second = sk.save(_state(), tmp_path / "b", compression="zstd")
    path = first.files[0].path
    assert (tmp_path / "a" / path).read_bytes() == (tmp_path / "b" / path).read_bytes()
    assert first.files[0].digest == second.files[0].digest


def test_a_compression_bomb_is_refused(tmp_path: Path) -> None:
    manifest = sk.save(_state(), tmp_path / "ckpt", compression="zstd")
    record = manifest.files[0]
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 << 20))  # 64 MiB of zeros, tiny on disk
    (tmp_path / "ckpt" / record.path).write_bytes(bomb)
    raw = json.loads((tmp_path / "ckpt" / "manifest.json").read_bytes())
    raw.pop("manifest_digest")
    raw["files"][0]["compression"]["stored_size"] = len(bomb)
    (tmp_path / "ckpt" / "manifest.json").write_bytes(
        seal_manifest(json.dumps(raw, separators=(",", ":")).encode(), "blake3")
    )
    with pytest.raises(sk.IntegrityError, match="decompress"):
        sk.load(tmp_path / "ckpt")
    assert not sk.verify(tmp_path / "ckpt").ok


def test_bad_compression_options_are_refused(tmp_path: Path) -> None:
    with pytest.raises(sk.UnsupportedValueError, match="compression"):
        sk.save(_state(), tmp_path / "a", compression="gzip")
    with pytest.raises(sk.UnsupportedValueError, match="compression_level"):
        sk.save(_state(), tmp_path / "b", compression="zstd", compression_level=99)


def test_a_compressed_file_smaller_than_its_header_verifies_and_loads(tmp_path: Path) -> None:
    """A highly compressible tensor: the stored file is smaller than the safetensors header."""
    manifest = sk.save({"w": torch.ones(1000)}, tmp_path / "c", compression="zstd")
    assert manifest.files[0].stored_size < manifest.files[0].tensors[0].offset
    assert sk.verify(tmp_path / "c").ok
    assert torch.equal(sk.load(tmp_path / "c")["w"], torch.ones(1000))
