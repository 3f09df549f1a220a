"""Optional deterministic zstd compression of data files."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import blake3
import pytest
import torch
import zstandard

import shardkeep as sk


def _state() -> dict[str, torch.Tensor]:
    return {
        "zeros": torch.zeros(256, 256),
        "ramp": torch.arange(10_000).float(),
        "noise": torch.randn(100, generator=torch.Generator().manual_seed(1)),
    }


def test_compressed_files_round_trip_and_record_their_settings(tmp_path: Path) -> None:
    manifest = sk.save(_state(), tmp_path / "ckpt", options=sk.WriteOptions(compression="zstd", compression_level=5))
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
    first = sk.save(_state(), tmp_path / "a", options=sk.WriteOptions(compression="zstd"))
    second = sk.save(_state(), tmp_path / "b", options=sk.WriteOptions(compression="zstd"))
    path = first.files[0].path
    assert (tmp_path / "a" / path).read_bytes() == (tmp_path / "b" / path).read_bytes()
    assert first.files[0].digest == second.files[0].digest


def _bombs(honest: bytes, size: int) -> dict[str, tuple[bytes, int]]:
    """Hostile zstd files: (the stored bytes, the size the re-sealed manifest declares)."""
    zeros = b"\0" * (64 << 20)  # 64 MiB of zeros, tiny on disk
    unsized = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    return {
        "a frame declaring 64 MiB": (zstandard.ZstdCompressor().compress(zeros), size),
        "a frame without a size": (unsized.compress(zeros) + unsized.flush(), size),
        "an honest frame, then 64 MiB more": (honest + zstandard.ZstdCompressor().compress(zeros), size),
        "a manifest declaring 16 TiB": (honest, 1 << 44),
    }


def test_compression_bombs_are_refused_before_allocating(tmp_path: Path, reseal: Callable[..., None]) -> None:
    manifest = sk.save(_state(), tmp_path / "pristine", options=sk.WriteOptions(compression="zstd"))
    record = manifest.files[0]
    honest = (tmp_path / "pristine" / record.path).read_bytes()
    for name, (stored, declared) in _bombs(honest, record.size).items():
        checkpoint = tmp_path / name.replace(" ", "_")
        shutil.copytree(tmp_path / "pristine", checkpoint)
        os.chmod(checkpoint / record.path, 0o644)
        (checkpoint / record.path).write_bytes(stored)

        def lie(raw: dict, stored: bytes = stored, declared: int = declared) -> None:  # type: ignore[type-arg]
            raw["files"][0]["compression"]["stored_size"] = len(stored)
            raw["files"][0]["size"] = declared

        reseal(checkpoint, lie)
        with pytest.raises(sk.IntegrityError, match=r"zstd frame declares|decompress|cannot hold"):
            sk.load(checkpoint)
        assert not sk.verify(checkpoint).ok, name


def test_bad_compression_options_are_refused(tmp_path: Path) -> None:
    with pytest.raises(sk.UnsupportedValueError, match="compression"):
        sk.save(_state(), tmp_path / "a", options=sk.WriteOptions(compression="gzip"))
    with pytest.raises(sk.UnsupportedValueError, match="compression_level"):
        sk.save(_state(), tmp_path / "b", options=sk.WriteOptions(compression="zstd", compression_level=99))


def test_a_compressed_file_smaller_than_its_header_verifies_and_loads(tmp_path: Path) -> None:
    """A highly compressible tensor: the stored file is smaller than the safetensors header."""
    manifest = sk.save({"w": torch.ones(1000)}, tmp_path / "c", options=sk.WriteOptions(compression="zstd"))
    assert manifest.files[0].stored_size < manifest.files[0].tensors[0].offset
    assert sk.verify(tmp_path / "c").ok
    assert torch.equal(sk.load(tmp_path / "c")["w"], torch.ones(1000))
