"""``sk.load_slice``: a box of one tensor, reading only its digest blocks (counted), verified."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from examples.store_probes import CountingStore as ProbeCountingStore

import shardkeep as sk
from shardkeep.integrity import generate_key_pair
from shardkeep.manifest import RankIndex
from shardkeep.storage import LocalStore
from tests.support.disk import rewrite_rank_index
from tests.support.distributed_harness import results_or_raise, run_ranks

GOLDEN = Path(__file__).parent / "golden"
BLOCK = 16 << 10
ROWS, COLS = 1024, 256  # fp32: 1 KiB rows, 1 MiB in all
W = (torch.arange(ROWS * COLS, dtype=torch.float32) % 1013).reshape(ROWS, COLS) / 7
WIDE = torch.arange(8 * 8192, dtype=torch.float32).reshape(8, 8192)  # 32 KiB rows: two blocks each


class CountingStore(ProbeCountingStore):
    """The example's counting store (``read_into`` counted exactly, a ``map`` whole), per path."""

    def data_bytes(self) -> dict[str, int]:
        return {path: n for path, n in self.bytes_read.items() if path.endswith(".safetensors") and n}


def _header_bytes(path: Path) -> int:
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("slice")
    sk.save({"w": W, "wide": WIDE, "b": torch.ones(3)}, root / "c", options=sk.WriteOptions(block_size=BLOCK))
    return root


def _fresh(tmp_path: Path, saved: Path) -> Path:
    """A writable copy of the saved checkpoint."""
    target = tmp_path / "c"
    target.mkdir()
    for source in (saved / "c").rglob("*"):
        relative = source.relative_to(saved / "c")
        if source.is_dir():
            (target / relative).mkdir(exist_ok=True)
        else:
            (target / relative).parent.mkdir(parents=True, exist_ok=True)
            (target / relative).write_bytes(source.read_bytes())
    return target


@pytest.mark.parametrize("rows", [(128, 256), (100, 228), (896, 1024)])
def test_an_eighth_of_the_rows_reads_an_eighth_and_at_most_one_block_more(saved: Path, rows: tuple[int, int]) -> None:
    store = CountingStore(LocalStore(str(saved)))
    got = sk.load_slice("c", "w", slice(*rows), storage=store)
    assert torch.equal(got, W[slice(*rows)])
    (path, count), *others = store.data_bytes().items()
    assert not others
    header = _header_bytes(saved / path)
    assert count <= W.nbytes // 8 + BLOCK + header, count
    assert count >= W.nbytes // 8


@pytest.mark.parametrize(
    ("key", "index"),
    [
        ("w", 5),
        ("w", -1),
        ("w", (3, 7)),
        ("w", (-3, slice(-10, None))),
        ("w", (slice(10, 20), slice(3, 9))),
        ("w", (slice(None), 255)),
        ("w", slice(1000, 2000)),
        ("w", slice(5, 5)),
        ("w", ()),
        ("wide", (slice(None), slice(0, 10))),
        ("wide", (slice(2, 6), slice(8000, 8192))),
        ("wide", (7, slice(4096, 12288))),
        ("b", slice(1, None)),
        ("b", -2),
    ],
)
def test_ints_slices_and_negative_indices_read_what_indexing_gives(saved: Path, key: str, index: Any) -> None:
    tensor = {"w": W, "wide": WIDE, "b": torch.ones(3)}[key]
    got = sk.load_slice(saved / "c", key, index)
    expected = tensor[index]
    assert got.shape == expected.shape and torch.equal(got, expected)


def test_a_column_slice_of_wide_rows_reads_only_the_blocks_of_each_row(saved: Path) -> None:
    store = CountingStore(LocalStore(str(saved)))
    assert torch.equal(sk.load_slice("c", "wide", (slice(None), slice(0, 10)), storage=store), WIDE[:, :10])
    ((path, count),) = store.data_bytes().items()
    assert count <= 8 * BLOCK + _header_bytes(saved / path)


def test_a_cryptographic_slice_of_fast_only_blocks_reads_the_whole_file(saved: Path) -> None:
    store = CountingStore(LocalStore(str(saved)))
    got = sk.load_slice("c", "w", slice(0, 8), storage=store, digest="cryptographic")
    assert torch.equal(got, W[:8])
    ((path, count),) = store.data_bytes().items()
    assert count == (saved / path).stat().st_size  # whole tensors' blocks are fast-only: the file digest


def test_a_stale_header_is_reported(tmp_path: Path, saved: Path, reseal: Callable[..., None]) -> None:
    checkpoint = _fresh(tmp_path, saved)

    def newer(raw: dict[str, Any]) -> None:
        for record in raw["files"]:
            record["version"] = record.get("version", 0) + 5

    reseal(checkpoint, newer)
    with pytest.raises(sk.IntegrityError, match="stale: the file on storage is version 1"):
        sk.load_slice(checkpoint, "w", slice(0, 8))


@pytest.mark.parametrize(
    ("index", "message"),
    [
        (slice(0, 10, 2), "step 2"),
        (slice(None, None, -1), "step -1"),
        ((1, 2, 3), "3 entries"),
        (1024, "out of range"),
        (-1025, "out of range"),
        (True, "not an int"),
        (..., "not an int"),
        ([1, 2], "not an int"),
    ],
)
def test_unsupported_indices_are_refused_naming_the_key(saved: Path, index: Any, message: str) -> None:
    with pytest.raises(sk.UnsupportedValueError, match=rf"'w'.*{message}|{message}.*'w'"):
        sk.load_slice(saved / "c", "w", index)


def test_an_unknown_key_and_bad_digest_options_are_refused(saved: Path) -> None:
    with pytest.raises(sk.UnsupportedValueError, match="no tensor 'nope'"):
        sk.load_slice(saved / "c", "nope", 0)
    with pytest.raises(sk.ConfigError, match="digest="):
        sk.load_slice(saved / "c", "w", 0, digest="md5")  # type: ignore[arg-type]


def test_a_flipped_byte_fails_only_a_slice_that_needs_its_block(tmp_path: Path, saved: Path) -> None:
    checkpoint = _fresh(tmp_path, saved)
    manifest = sk.read_manifest(checkpoint)
    record = next(r for r in manifest.files if any(t.key == "w" for t in r.tensors))
    entry = next(t for t in record.tensors if t.key == "w")
    data_file = checkpoint / record.path
    os.chmod(data_file, 0o644)
    raw = bytearray(data_file.read_bytes())
    raw[entry.offset + 200 * COLS * 4 + 17] ^= 0x40  # row 200: block 12
    data_file.write_bytes(bytes(raw))
    with pytest.raises(sk.IntegrityError, match=r"shards/.*'w'.*fails its digest"):
        sk.load_slice(checkpoint, "w", slice(128, 256))
    assert torch.equal(sk.load_slice(checkpoint, "w", slice(256, 384)), W[256:384])
    report = sk.verify(checkpoint)
    assert not report.ok


# -- sharded tensors: a real 2-rank gloo save ----------------------------------------------------


def _save_sharded(rank: int, world_size: int, path: str, signer: str | None = None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    state = {"w": distribute_tensor(W, mesh, [Shard(0)]), "c": distribute_tensor(W[:64], mesh, [Shard(1)])}
    sk.save(state, path, step=1, options=sk.WriteOptions(block_size=BLOCK))
    if signer is not None:
        sk.save(state, path + "-signed", step=1, options=sk.WriteOptions(block_size=BLOCK), signer=signer)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sharded")
    generate_key_pair(root / "key.pem", root / "key.pub")
    results_or_raise(run_ranks(2, _save_sharded, str(root / "c"), str(root / "key.pem"), outbox=root / "out"))
    return root


def test_a_signed_sharded_slice_reads_only_its_blocks_checked_by_their_strong_halves(sharded: Path) -> None:
    public = sharded / "key.pub"
    store = CountingStore(LocalStore(str(sharded)))
    assert torch.equal(sk.load_slice("c-signed", "w", slice(0, 128), storage=store, public_key=public), W[:128])
    ((path, count),) = store.data_bytes().items()
    assert count <= W.nbytes // 8 + BLOCK + _header_bytes(sharded / path)
    with pytest.raises(sk.ConfigError, match="digest='fast' with public_key"):
        sk.load_slice(sharded / "c-signed", "w", 0, public_key=public, digest="fast")
    with pytest.raises(sk.SignatureError):
        sk.load_slice(sharded / "c", "w", 0, public_key=public)


def test_a_slice_of_a_sharded_tensor_reads_only_the_index_and_blocks_it_needs(sharded: Path) -> None:
    assert sk.read_manifest(sharded / "c").metadata_version == "2.1"
    store = CountingStore(LocalStore(str(sharded)))
    assert torch.equal(sk.load_slice("c", "w", slice(0, 128), storage=store), W[:128])
    assert not store.bytes_read.get("c/index/rank_00001.json")
    ((path, count),) = store.data_bytes().items()
    assert count <= W.nbytes // 8 + BLOCK + _header_bytes(sharded / path)
    store = CountingStore(LocalStore(str(sharded)))
    assert torch.equal(sk.load_slice("c", "w", slice(500, 628), storage=store), W[500:628])  # both chunks
    counts = store.data_bytes()
    assert len(counts) == 2
    assert sum(counts.values()) <= W.nbytes // 8 + 2 * BLOCK + sum(_header_bytes(sharded / p) for p in counts)


@pytest.mark.parametrize(
    ("key", "index"),
    [("w", -1), ("w", (slice(510, 515), slice(1, 3))), ("c", (slice(None), slice(120, 136))), ("c", (3, 200))],
)
def test_sharded_slices_equal_indexing(sharded: Path, key: str, index: Any) -> None:
    tensor = {"w": W, "c": W[:64]}[key]
    assert torch.equal(sk.load_slice(sharded / "c", key, index), tensor[index])


def _change_strong_half(checkpoint: Path) -> None:
    """Flip a byte of block 0's strong digest of rank 0's ``w`` chunk; re-digest the index and
    re-seal the root, as someone who can write the directory could."""

    def change(index: RankIndex) -> None:
        entry = next(t for t in index.files[0].tensors if t.key == "w")
        blocks = bytearray(entry.blocks)
        assert len(blocks) == 64 * 48 // 2  # 32 blocks of 16 B fast + 32 B strong
        blocks[16] ^= 1
        entry.blocks = bytes(blocks)

    rewrite_rank_index(checkpoint, 0, change)


def test_a_changed_strong_block_digest_passes_a_default_slice_not_a_cryptographic_one(
    tmp_path: Path, sharded: Path
) -> None:
    checkpoint = _fresh(tmp_path, sharded)
    _change_strong_half(checkpoint)
    assert torch.equal(sk.load_slice(checkpoint, "w", slice(0, 8)), W[:8])
    with pytest.raises(sk.IntegrityError, match=r"'w'.*fails its digest"):
        sk.load_slice(checkpoint, "w", slice(0, 8), digest="cryptographic")
    assert torch.equal(sk.load_slice(checkpoint, "w", slice(600, 700), digest="cryptographic"), W[600:700])
    assert not sk.verify(checkpoint).ok


# -- older formats: whole entries ---------------------------------------------------------------


def test_a_v2_0_golden_slice_is_read_from_whole_chunks(tmp_path: Path) -> None:
    checkpoint = GOLDEN / "v2.0" / "step_00000042"
    whole = sk.load(checkpoint)
    store = CountingStore(LocalStore(str(checkpoint.parent)))
    got = sk.load_slice(checkpoint.name, "model.w", slice(1, 3), storage=store)
    assert torch.equal(got, whole["model"]["w"][1:3])
    assert store.data_bytes()  # chunks without blocks: read and checked whole
    for key, index in [("model.col", (slice(None), 1)), ("model.uneven", -1), ("model.rep", slice(0, 2))]:
        path = key.split(".")
        assert torch.equal(sk.load_slice(checkpoint, key, index), whole[path[0]][path[1]][index])
    assert torch.equal(sk.load_slice(checkpoint, "model.bias", 0), whole["model"]["bias"][0])


def test_a_v2_1_golden_slice_reads_blocks(tmp_path: Path) -> None:
    checkpoint = GOLDEN / "v2.1" / "step_00000042"
    whole = sk.load(checkpoint)
    assert torch.equal(sk.load_slice(checkpoint, "model.big", slice(8, 16)), whole["model"]["big"][8:16])
    assert torch.equal(sk.load_slice(checkpoint, "model.table", slice(100, 5000)), whole["model"]["table"][100:5000])


def _same(a: torch.Tensor, b: Any) -> bool:
    """Equal dtype, shape and bytes (NaNs and every dtype included)."""
    b = b if isinstance(b, torch.Tensor) else torch.as_tensor(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("version", ["v1.0", "v1.1", "v1.2", "v1.3", "v1.3-dtypes", "v1.4", "v2.0", "v2.1"])
def test_every_tensor_of_every_golden_slices_like_its_load(version: str) -> None:
    checkpoint = GOLDEN / version / "step_00000042"
    manifest = sk.read_manifest(checkpoint)
    loaded = sk.load(checkpoint)
    described = [(entry.key, entry.path) for _, entry in manifest.iter_tensors()]
    described += [(tensor.key, tensor.path) for tensor in getattr(manifest, "described", list)()]
    assert described
    for key, path in dict(described).items():
        value: Any = loaded
        for part in path:
            value = value[part]
        whole = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
        assert _same(sk.load_slice(checkpoint, key), whole), key
        if whole.dim() and whole.shape[0]:
            assert _same(sk.load_slice(checkpoint, key, -1), whole[-1]), key
            assert _same(sk.load_slice(checkpoint, key, slice(1, None)), whole[1:]), key
