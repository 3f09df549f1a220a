"""Shared fixtures: small deterministic states and helpers that damage checkpoints on disk."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")


def make_state(seed: int = 0) -> dict[str, Any]:
    """A small training-like state: a module, an optimizer with state, JSON leaves, odd tensors."""
    generator = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8, generator=generator)).sum().backward()
    optimizer.step()
    return {
        "model": model,
        "optim": optimizer,
        "step": 7 + seed,
        "best_val_loss": float("inf"),
        "config": {"name": "tiny", "layers": [8, 6, 2], "dropout": 0.0},
        "ema": {"0.weight": torch.randn(6, 8, generator=generator)},
        "rng": torch.get_rng_state(),
    }


@pytest.fixture(autouse=True)
def _process_wide_torch_flags() -> Any:
    """Put back the torch flags a test's framework may set for the whole process (Lightning's
    ``Trainer(deterministic=True)`` turns on deterministic algorithms and leaves them on)."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(deterministic)


@pytest.fixture
def state() -> dict[str, Any]:
    return make_state()


def assert_same_tree(found: Any, expected: Any, where: str = "") -> None:
    """``found`` holds exactly ``expected``: the same keys, lengths, values, and tensors of the
    same dtype and values (a DTensor is compared by its full tensor)."""
    if isinstance(expected, torch.Tensor) or isinstance(found, torch.Tensor):
        assert isinstance(found, torch.Tensor) and isinstance(expected, torch.Tensor), where
        found = found.full_tensor() if hasattr(found, "full_tensor") else found
        assert found.dtype == expected.dtype and torch.equal(found, expected), where
    elif isinstance(expected, dict):
        assert isinstance(found, dict) and set(found) == set(expected), (where, sorted(found), sorted(expected))
        for key in expected:
            assert_same_tree(found[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(found) == len(expected), where
        for index, (a, b) in enumerate(zip(found, expected, strict=True)):
            assert_same_tree(a, b, f"{where}[{index}]")
    else:
        assert found == expected, (where, found, expected)


def flip_bit(path: Path, byte_index: int, bit: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(byte_index)
        value = handle.read(1)[0]
        handle.seek(byte_index)
        handle.write(bytes([value ^ (1 << bit)]))


def checkpoint_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and not p.is_symlink())


def reseal(checkpoint: Path, mutate: Any) -> None:
    """Change the manifest with ``mutate(raw_dict)`` and re-seal it, as an attacker who can write
    the directory could (the seal detects damage, not tampering)."""
    import json

    from shardkeep.integrity import seal_manifest

    raw = json.loads((checkpoint / "manifest.json").read_bytes())
    raw.pop("manifest_digest")
    mutate(raw)
    os.chmod(checkpoint / "manifest.json", 0o644)
    (checkpoint / "manifest.json").write_bytes(seal_manifest(json.dumps(raw, separators=(",", ":")).encode(), "blake3"))


def tree_listing(root: Path) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, name), root) for d, dirs, files in os.walk(root) for name in dirs + files
    )


# --------------------------------------------------------------------------------------------
# A real S3 server (SeaweedFS) for the whole session


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from s3server import running

    with running(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


@pytest.fixture
def s3_root(s3_server: Any) -> tuple[str, dict[str, Any]]:
    """A fresh bucket on the session's S3 server: (``s3://bucket/root``, storage options)."""
    bucket = s3_server.new_bucket()
    return f"s3://{bucket}/root", s3_server.storage_options
