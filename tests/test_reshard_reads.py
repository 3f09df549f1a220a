"""Resharding, lazy and ``extra="ignore"`` loads read and check only the digest blocks they need
(format 2.1), counted per rank on real forked gloo ranks; checkpoints without blocks read the
overlapping chunks whole."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from examples.store_probes import CountingStore

import shardkeep as sk
from shardkeep.integrity import generate_key_pair
from shardkeep.lazy import LazyTensor
from shardkeep.manifest import FAST_BLOCK_DIGEST_BYTES, RankIndex
from shardkeep.reads import merge_runs
from shardkeep.storage import LocalStore, MemoryStore
from shardkeep.storage.remote import READ_GAP, FsspecStore
from tests.support import disk
from tests.support.distributed_harness import results_or_raise, run_ranks

GOLDEN = Path(__file__).parent / "golden"
ROWS, COLS = 1024, 256  # fp32: 1 KiB rows, 1 MiB per tensor
KEYS = [f"t{i}" for i in range(4)]
WIDE = torch.arange(16 * 16384, dtype=torch.float32).reshape(16, 16384)  # 64 KiB rows: 4 blocks each
FLIPPED_ROW = 450  # in saved rank 0's chunk (rows 0-511 of 2): needed by loading rank 1 of 3 only


def _tensor(i: int) -> torch.Tensor:
    return ((torch.arange(ROWS * COLS, dtype=torch.float32) * (i + 1)) % 1009).reshape(ROWS, COLS)


def _data_bytes(store: CountingStore) -> dict[str, int]:
    return {path: n for path, n in store.bytes_read.items() if path.endswith(".safetensors") and n}


def _header_bytes(path: Path) -> int:
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


# -- ranks ---------------------------------------------------------------------------------------


def _save(rank: int, world_size: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    state = {key: distribute_tensor(_tensor(i), mesh, [Shard(0)]) for i, key in enumerate(KEYS)}
    sk.save(state, os.path.join(root, "blocks"), step=1)
    sk.save(state, os.path.join(root, "zero"), step=1, options=sk.WriteOptions(block_size=0))
    sk.save({"wide": distribute_tensor(WIDE, mesh, [Shard(0)])}, os.path.join(root, "wide"), step=1)
    sk.save(state, os.path.join(root, "signed"), step=1, signer=os.path.join(root, "key.pem"))


def _expected(key: str) -> torch.Tensor:
    return WIDE if key == "wide" else _tensor(KEYS.index(key))


#: (checkpoint name, keys, digest, the dimension of the loading ranks' Shard).
Load = tuple[str, list[str], Literal["fast", "cryptographic"] | None, int]


def _load(rank: int, world_size: int, root: str, loads: dict[str, Load]) -> dict[str, Any]:
    """Each load of ``loads`` (label: :data:`Load`) into DTensors of the keys (``extra="ignore"``
    when that is not every key): per label the bytes read per file, this rank's share, and
    whether the values are right (or the error)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    outcome: dict[str, Any] = {}
    for label, (name, keys, digest, dim) in loads.items():
        into = {key: distribute_tensor(torch.zeros_like(_expected(key)), mesh, [Shard(dim)]) for key in keys}
        store = CountingStore(LocalStore(root))
        select = sk.LoadSelection(extra="ignore") if set(keys) < set(KEYS) else None
        try:
            public_key = os.path.join(root, "key.pub") if name == "signed" else None
            sk.load(name, into=into, storage=store, select=select, digest=digest, public_key=public_key)
        except sk.IntegrityError as exc:
            outcome[label] = {"error": str(exc)}
            continue
        share = sum(into[key].to_local().nbytes for key in keys)
        right = all(torch.equal(into[key].to_local(), _expected(key).chunk(world_size, dim=dim)[rank]) for key in keys)
        outcome[label] = {"read": _data_bytes(store), "share": share, "right": right}
    return outcome


# -- fixtures ------------------------------------------------------------------------------------


class Run:
    """A root saved on some ranks (``blocks``: format 2.1 with the default block rule;
    ``zero``: the same state with ``block_size=0``, format 2.0; ``flipped``: ``blocks`` with a
    byte of t0 flipped in saved rank 0's chunk) and what each of 3 loading ranks read."""

    def __init__(self, root: Path, outcomes: list[dict[str, Any]]) -> None:
        self.root = root
        self.outcomes = outcomes


_RUNS: dict[int, Run] = {}


def _flip(root: Path, world_size: int) -> None:
    shutil.copytree(root / "blocks", root / "flipped")
    record = next(r for r in sk.read_manifest(root / "flipped").files if r.rank == 0 and r.tensors)
    entry = next(t for t in record.tensors if t.key == "t0")
    target = root / "flipped" / record.path
    os.chmod(target, 0o644)
    raw = bytearray(target.read_bytes())
    raw[entry.offset + (FLIPPED_ROW % (ROWS // world_size)) * COLS * 4 + 5] ^= 0x10
    target.write_bytes(bytes(raw))


def _change_strong_half(source: Path, target: Path) -> None:
    """A copy of ``source`` where the strong half of block 0 of t0 in saved rank 0's index is
    changed, the index re-digested and the root re-sealed (as anyone who can write the
    directory could): the fast halves still match the data."""
    shutil.copytree(source, target)

    def change(index: RankIndex) -> None:
        entry = next(t for record in index.files for t in record.tensors if t.key == "t0")
        blocks = bytearray(entry.blocks)
        blocks[FAST_BLOCK_DIGEST_BYTES] ^= 1
        entry.blocks = bytes(blocks)

    disk.rewrite_rank_index(target, 0, change)


def _run(saved_on: int, factory: pytest.TempPathFactory) -> Run:
    """Saved on ``saved_on`` ranks and loaded on 3 (once per module)."""
    if saved_on not in _RUNS:
        root = factory.mktemp(f"saved{saved_on}")
        generate_key_pair(root / "key.pem", root / "key.pub")
        results_or_raise(run_ranks(saved_on, _save, str(root), outbox=root / "out"))
        assert sk.read_manifest(root / "blocks").metadata_version == "2.1"
        assert sk.read_manifest(root / "zero").metadata_version == "2.0"
        _flip(root, saved_on)
        _change_strong_half(root / "blocks", root / "changed")
        loads: dict[str, Load] = {name: (name, KEYS, None, 0) for name in ("blocks", "zero", "flipped", "changed")}
        loads["ignore"] = ("blocks", ["t1"], None, 0)
        loads["cryptographic"] = ("blocks", KEYS, "cryptographic", 0)
        loads["changed-cryptographic"] = ("changed", KEYS, "cryptographic", 0)
        loads["columns"] = ("wide", ["wide"], None, 1)
        loads["signed"] = ("signed", KEYS, None, 0)
        _RUNS[saved_on] = Run(root, results_or_raise(run_ranks(3, _load, str(root), loads, outbox=root / "load")))
    return _RUNS[saved_on]


SAVED_ON = [2, pytest.param(4, marks=pytest.mark.slow)]


def _headers(root: Path, read: dict[str, int]) -> int:
    return sum(_header_bytes(root / path) for path in read)


# -- tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("saved_on", SAVED_ON)
def test_each_rank_reads_at_most_1_15_times_its_share_plus_headers(
    saved_on: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    run = _run(saved_on, tmp_path_factory)
    for rank, outcome in enumerate(run.outcomes):
        blocks = outcome["blocks"]
        assert blocks["right"], rank
        read = sum(blocks["read"].values())
        headers = _headers(run.root, blocks["read"])
        assert read <= 1.15 * blocks["share"] + headers, (rank, read, blocks["share"], headers)
        assert read >= blocks["share"]


@pytest.mark.parametrize("saved_on", SAVED_ON)
def test_without_blocks_the_overlapping_chunks_are_read_whole(
    saved_on: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    run = _run(saved_on, tmp_path_factory)
    ratios = []
    for rank, outcome in enumerate(run.outcomes):
        zero, blocks = outcome["zero"], outcome["blocks"]
        assert zero["right"], rank
        # Whole chunks: every t* chunk overlapping the rank's rows, whole.
        chunk = ROWS // saved_on
        first, last = rank * 342, min(ROWS, (rank + 1) * 342) - 1
        overlapping = last // chunk - first // chunk + 1
        expected = len(KEYS) * overlapping * chunk * COLS * 4
        assert sum(zero["read"].values()) == expected + _headers(run.root, zero["read"]), rank
        assert sum(zero["read"].values()) > sum(blocks["read"].values()), rank
        ratios.append(expected / zero["share"])
    assert max(ratios) >= 1.5  # the test can fail: whole chunks cost more than the blocks


def test_a_flipped_byte_fails_only_the_rank_that_needs_its_block(tmp_path_factory: pytest.TempPathFactory) -> None:
    run = _run(2, tmp_path_factory)
    outcomes = [outcome["flipped"] for outcome in run.outcomes]
    assert "error" in outcomes[1]
    assert "'t0'" in outcomes[1]["error"] and "rank_00000" in outcomes[1]["error"]
    assert "fails its digest" in outcomes[1]["error"]
    assert outcomes[0]["right"] and outcomes[2]["right"]  # their blocks of t0 are intact
    report = sk.verify(run.root / "flipped")
    assert not report.ok and any("rank_00000" in problem for problem in report.problems)


def test_cryptographic_and_signed_loads_read_by_range_and_a_changed_strong_digest_fails_only_them(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    run = _run(2, tmp_path_factory)
    for rank, outcome in enumerate(run.outcomes):
        assert outcome["changed"]["right"], rank  # the default load checks the fast halves
        for label in ("cryptographic", "signed"):  # strong halves, by range
            strong = outcome[label]
            assert strong["right"], (rank, label)
            read = sum(strong["read"].values())
            assert read <= 1.15 * strong["share"] + _headers(run.root, strong["read"]), (rank, label)
    assert "'t0'" in run.outcomes[0]["changed-cryptographic"]["error"]  # block 0 of t0: rank 0's rows
    assert all(outcome["changed-cryptographic"]["right"] for outcome in run.outcomes[1:])
    assert not sk.verify(run.root / "changed").ok


@pytest.mark.parametrize("saved_on", SAVED_ON)
def test_a_column_shard_of_wide_rows_reads_the_blocks_of_its_columns(
    saved_on: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    run = _run(saved_on, tmp_path_factory)
    for rank, outcome in enumerate(run.outcomes):
        columns = outcome["columns"]
        assert columns["right"], rank  # pieces of each row copied into place, holes never used
        read = sum(columns["read"].values()) - _headers(run.root, columns["read"])
        # A third of each 64 KiB row spans 2 of its 4 blocks (3 for the middle rank's, unaligned).
        assert read <= (3 if rank == 1 else 2) * 16 * (16 << 10) < WIDE.nbytes, (rank, read)


@pytest.mark.parametrize("saved_on", SAVED_ON)
def test_extra_ignore_reads_no_block_of_a_tensor_into_lacks(
    saved_on: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    run = _run(saved_on, tmp_path_factory)
    for rank, outcome in enumerate(run.outcomes):
        held = outcome["ignore"]
        assert held["right"], rank
        read = sum(held["read"].values())
        assert held["share"] <= read <= 1.15 * held["share"] + _headers(run.root, held["read"])


# -- one process: lazy tensors, extra="ignore", digests, the v2.0 golden -------------------------


BLOCK = 16 << 10


def _saved_whole(tmp_path: Path, **options: Any) -> tuple[Path, dict[str, Any]]:
    cold = tmp_path / "cold"
    tiers = [sk.Tier(tier_id=1, name="hot"), sk.Tier(tier_id=2, name="cold", location=str(cold))]
    state = {"hot": {"x": torch.ones(4)}, "cold": {"a": _tensor(0), "b": _tensor(1)}}
    plan = sk.TierPlan(tiers=tiers, placement=[("cold.*", "cold"), ("*", "hot")])
    sk.save(state, tmp_path / "root" / "c", tiers=plan, options=sk.WriteOptions(block_size=BLOCK, **options))
    return cold, state


def test_a_lazy_tensor_reads_only_its_own_blocks(tmp_path: Path) -> None:
    cold_dir, state = _saved_whole(tmp_path)
    cold = CountingStore(LocalStore(cold_dir))
    loaded = sk.load(
        tmp_path / "root" / "c", select=sk.LoadSelection(tiers={"hot"}, lazy=True), tier_locations={"cold": cold}
    )
    lazy = loaded["cold"]["a"]
    assert isinstance(lazy, LazyTensor) and not lazy.loaded
    assert torch.equal(lazy.materialize(), state["cold"]["a"])
    ((path, count),) = _data_bytes(cold).items()
    assert count == state["cold"]["a"].nbytes + _header_bytes(cold_dir / path)  # not b's bytes
    assert torch.equal(loaded["cold"]["b"].materialize(), state["cold"]["b"])
    assert cold.bytes_read[path] == count + state["cold"]["b"].nbytes + _header_bytes(cold_dir / path)


def test_a_cryptographic_lazy_load_of_fast_only_blocks_reads_the_whole_file(tmp_path: Path) -> None:
    cold_dir, state = _saved_whole(tmp_path)
    cold = CountingStore(LocalStore(cold_dir))
    loaded = sk.load(
        tmp_path / "root" / "c",
        select=sk.LoadSelection(tiers={"hot"}, lazy=True),
        tier_locations={"cold": cold},
        digest="cryptographic",
    )
    assert torch.equal(loaded["cold"]["a"].materialize(), state["cold"]["a"])
    ((path, count),) = _data_bytes(cold).items()
    assert count == (cold_dir / path).stat().st_size  # whole tensors' blocks are fast-only


def test_a_damaged_lazy_block_raises_and_names_the_file(tmp_path: Path) -> None:
    cold_dir, state = _saved_whole(tmp_path)
    record = next(r for r in sk.read_manifest(tmp_path / "root" / "c").files if r.tier == "cold")
    entry = next(t for t in record.tensors if t.key == "cold.b")
    target = next(cold_dir.rglob("*.safetensors"))
    os.chmod(target, 0o644)
    raw = bytearray(target.read_bytes())
    raw[entry.offset + 3] ^= 1
    target.write_bytes(bytes(raw))
    loaded = sk.load(tmp_path / "root" / "c", select=sk.LoadSelection(tiers={"hot"}, lazy=True))
    assert torch.equal(loaded["cold"]["a"].materialize(), state["cold"]["a"])  # its blocks are intact
    with pytest.raises(sk.IntegrityError, match=r"lazy load of .*'cold.b'.*fails its digest"):
        loaded["cold"]["b"].materialize()


def test_extra_ignore_of_whole_tensors_reads_only_the_held_blocks(tmp_path: Path) -> None:
    state = {"a": _tensor(0), "b": _tensor(1), "c": _tensor(2)}
    sk.save(state, tmp_path / "c", options=sk.WriteOptions(block_size=BLOCK))
    store = CountingStore(LocalStore(tmp_path))
    into = {"b": torch.zeros(ROWS, COLS)}
    sk.load("c", into=into, storage=store, select=sk.LoadSelection(extra="ignore"))
    assert torch.equal(into["b"], state["b"])
    ((path, count),) = _data_bytes(store).items()
    assert count == state["b"].nbytes + _header_bytes(tmp_path / path)


def test_the_v2_0_golden_reads_whole_chunks(tmp_path: Path) -> None:
    checkpoint = GOLDEN / "v2.0" / "step_00000042"
    whole = sk.load(checkpoint)
    manifest = sk.read_manifest(checkpoint)
    store = CountingStore(LocalStore(str(checkpoint.parent)))
    into = {"model": {"w": torch.zeros(4, 2)}}
    sk.load(checkpoint.name, into=into, storage=store, select=sk.LoadSelection(extra="ignore"))
    assert torch.equal(into["model"]["w"], whole["model"]["w"])
    chunks = {
        f"{checkpoint.name}/{r.path}": sum(t.nbytes for t in r.tensors if t.key == "model.w") for r in manifest.files
    }
    read = _data_bytes(store)
    assert read and all(chunks[path] for path in read)
    assert sum(read.values()) == sum(chunks[p] + _header_bytes(checkpoint.parent / p) for p in read)  # whole chunks


def test_stores_declare_their_read_gap(tmp_path: Path) -> None:
    assert LocalStore(tmp_path).read_gap == 0 and MemoryStore().read_gap == 0
    assert CountingStore(LocalStore(tmp_path)).read_gap == 0
    pytest.importorskip("fsspec")
    assert FsspecStore(f"memory://{tmp_path.name}/root").read_gap == READ_GAP == 1 << 20


def test_runs_merge_across_gaps_up_to_the_read_gap() -> None:
    runs = [(2100, 2600), (100, 1100), (1100, 1600)]
    assert merge_runs(runs, 0) == [(100, 1600), (2100, 2600)]
    assert merge_runs(runs, 500) == [(100, 2600)]
    assert merge_runs(runs, 499) == [(100, 1600), (2100, 2600)]
    assert merge_runs([(0, 10), (5, 8)], 0) == [(0, 10)]


class _RecordingStore(LocalStore):
    """A local store with a chosen ``read_gap`` that records every ``read_into`` of data files."""

    def __init__(self, root: Path, gap: int) -> None:
        super().__init__(root)
        self.gap = gap
        self.reads: list[tuple[int, int]] = []

    @property
    def read_gap(self) -> int:
        return self.gap

    def open_read(self, path: str) -> Any:
        handle = super().open_read(path)
        if not path.endswith(".safetensors"):
            return handle
        reads = self.reads

        class Recorded:
            size = handle.size

            def read_into(self, offset: int, buffer: memoryview) -> None:
                reads.append((offset, len(buffer)))
                handle.read_into(offset, buffer)

            def map(self) -> memoryview:
                raise AssertionError("a ranged read never maps")

            def close(self) -> None:
                handle.close()

        return Recorded()


@pytest.mark.parametrize(("gap", "max_read"), [(0, None), (1 << 20, None), (0, 4096)])
def test_runs_closer_than_the_read_gap_are_read_once_and_long_runs_in_pieces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gap: int, max_read: int | None
) -> None:
    if max_read is not None:
        monkeypatch.setattr("shardkeep.reads.MAX_READ", max_read)
    sk.save({"wide": WIDE}, tmp_path / "c", options=sk.WriteOptions(block_size=BLOCK))
    store = _RecordingStore(tmp_path, gap)
    got = sk.load_slice("c", "wide", (slice(0, 8), slice(0, 10)), storage=store)  # block 0 of 8 rows
    assert torch.equal(got, WIDE[:8, :10])
    data = [(offset, length) for offset, length in store.reads if offset >= 8]
    header = data.pop(0)  # the header after its 8-byte length
    assert header[0] == 8
    if gap:
        assert len(data) == 1 and data[0][1] == 7 * 4 * BLOCK + BLOCK  # rows of 4 blocks, through the gaps
    elif max_read is None:
        assert len(data) == 8 and all(length == BLOCK for _, length in data)  # one run per row
    else:
        assert len(data) == 8 * BLOCK // max_read and all(length == max_read for _, length in data)


def test_runs_covering_95_percent_of_a_file_read_it_whole(tmp_path: Path) -> None:
    sk.save({"wide": WIDE}, tmp_path / "c", options=sk.WriteOptions(block_size=BLOCK))
    size = next((tmp_path / "c").rglob("*.safetensors")).stat().st_size
    store = _RecordingStore(tmp_path, 1 << 20)
    got = sk.load_slice("c", "wide", (slice(None), slice(0, 10)), storage=store)  # 61 of 64 blocks with the gaps
    assert torch.equal(got, WIDE[:, :10])
    assert sum(length for _, length in store.reads) >= size
