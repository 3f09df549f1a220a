"""Checkpoints on disk: list their files, flip a bit in one, re-seal a changed manifest."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def flip_bit(path: Path, byte_index: int, bit: int) -> None:
    """Flip one bit of the file at ``path`` in place."""
    with open(path, "r+b") as handle:
        handle.seek(byte_index)
        value = handle.read(1)[0]
        handle.seek(byte_index)
        handle.write(bytes([value ^ (1 << bit)]))


def checkpoint_files(directory: Path) -> list[Path]:
    """Every regular file under ``directory`` (symbolic links left out), sorted."""
    return sorted(p for p in directory.rglob("*") if p.is_file() and not p.is_symlink())


def reseal(checkpoint: Path, mutate: Callable[[dict[str, Any]], object]) -> None:
    """Change the manifest with ``mutate(raw_dict)`` and re-seal it, as an attacker who can write
    the directory could (the seal detects damage, not tampering)."""
    from shardkeep.integrity import seal_manifest

    raw = json.loads((checkpoint / "manifest.json").read_bytes())
    raw.pop("manifest_digest")
    mutate(raw)
    os.chmod(checkpoint / "manifest.json", 0o644)
    (checkpoint / "manifest.json").write_bytes(seal_manifest(json.dumps(raw, separators=(",", ":")).encode(), "blake3"))


def rewrite_rank_index(checkpoint: Path, rank: int, change: Callable[[Any], object]) -> None:
    """Change rank ``rank``'s index of a format 2.x checkpoint with ``change(index)`` (a decoded
    ``RankIndex``), write it back, and record its new size and digest in the re-sealed root, as
    someone who can write the directory could."""
    import msgspec

    from shardkeep.indexes import encode_index
    from shardkeep.integrity import digest_bytes
    from shardkeep.manifest import RankIndex

    index_path = checkpoint / "index" / f"rank_{rank:05d}.json"
    index = msgspec.json.decode(index_path.read_bytes(), type=RankIndex)
    change(index)
    data = encode_index(rank, index.files, index.metadata_version)
    os.chmod(index_path, 0o644)
    index_path.write_bytes(data)

    def mutate(raw: dict[str, Any]) -> None:
        table = raw["indexes"]
        position = table["ranks"].index(rank)
        table["sizes"][position] = len(data)
        table["digests"][position] = digest_bytes(table["algorithm"], data).partition(":")[2]

    reseal(checkpoint, mutate)


def tree_listing(root: Path) -> list[str]:
    """Every file and directory under ``root``, as sorted paths relative to it."""
    return sorted(
        os.path.relpath(os.path.join(d, name), root) for d, dirs, files in os.walk(root) for name in dirs + files
    )
