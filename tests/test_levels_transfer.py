"""Moving files between ranks (levels/transfer.py): real gloo ranks exchange files in bounded
blocks; a file whose digest does not match on arrival is refused, named and never written."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import zstandard

from shardkeep.errors import IntegrityError
from shardkeep.integrity import digest_bytes
from shardkeep.levels.transfer import (
    FileReceive,
    FileSend,
    arrival_digest,
    copy_file,
    exchange_files,
    run_exchange,
)
from shardkeep.manifest import FileRecord
from shardkeep.manifest.schema import Compression
from tests.support.distributed_harness import results_or_raise, run_ranks

pytest.importorskip("torch")

BLOCK = 64 << 10


def payload(name: str, size: int) -> bytes:
    seed = digest_bytes("blake3", name.encode()).encode()
    return (seed * (size // len(seed) + 1))[:size]


def record(name: str, data: bytes, *, digest_of: bytes | None = None) -> FileRecord:
    return FileRecord(
        path=name, rank=0, size=len(data), digest=digest_bytes("blake3", data if digest_of is None else digest_of)
    )


#: (sender, receiver, file name, size). Rank 1's file spans many blocks and a short last one.
PLAN = [
    (0, 1, "a.bin", 1000),
    (0, 2, "b.bin", 0),
    (2, 0, "c.bin", 3 * BLOCK),
    (1, 0, "big.bin", 40 * BLOCK + 17),
    (1, 1, "own.bin", 10),
]


def _exchange(rank: int, world_size: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    sent_sizes: list[int] = []
    isend = dist.isend

    def counting_isend(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        sent_sizes.append(tensor.numel() * tensor.element_size())
        return isend(tensor, *args, **kwargs)

    dist.isend = counting_isend  # type: ignore[assignment]  # this forked rank only
    mine = Path(root, f"rank{rank}")
    (mine / "out").mkdir(parents=True)
    sends, receives = [], []
    for sender, receiver, name, size in PLAN:
        data = payload(name, size)
        if sender == rank:
            (mine / name).write_bytes(data)
            sends.append(FileSend(receiver, str(mine / name), record(name, data)))
        if receiver == rank:
            receives.append(FileReceive(sender, str(mine / "out" / name), record(name, data)))
    written = exchange_files(None, sends, receives, block_bytes=BLOCK)
    return {"written": sorted(Path(p).name for p in written), "largest_message": max(sent_sizes, default=0)}


def test_files_cross_between_ranks_in_bounded_blocks(tmp_path: Path) -> None:
    results = results_or_raise(run_ranks(3, _exchange, str(tmp_path), outbox=tmp_path / "out"))
    assert [r["written"] for r in results] == [["big.bin", "c.bin"], ["a.bin", "own.bin"], ["b.bin"]]
    assert max(r["largest_message"] for r in results) <= BLOCK
    for _sender, receiver, name, size in PLAN:
        assert (tmp_path / f"rank{receiver}" / "out" / name).read_bytes() == payload(name, size)
    leftovers = [p.name for p in tmp_path.rglob("*") if ".tmp-" in p.name]
    assert leftovers == []


def _damaged(rank: int, world_size: int, root: str) -> dict[str, Any]:
    good, bad = payload("good", 5000), payload("bad", 5000)
    sends, receives = [], []
    if rank == 0:
        Path(root, "good").write_bytes(good)
        Path(root, "bad").write_bytes(bad[:-1] + b"\x00")  # one byte flipped at the source
        sends = [
            FileSend(1, str(Path(root, "good")), record("good", good)),
            FileSend(1, str(Path(root, "bad")), record("bad", bad)),
        ]
        sends.append(FileSend(1, str(Path(root, "gone")), record("gone", good)))  # unreadable at the source
    if rank == 1:
        receives = [
            FileReceive(0, str(Path(root, "in", name)), record(name, data))
            for name, data in [("good", good), ("bad", bad), ("gone", good)]
        ]
        receives.append(FileReceive(0, str(Path(root, "in", "never")), record("never", good)))  # not sent
    exchange = run_exchange(None, sends, receives, block_bytes=1024)
    outcome: dict[str, Any] = {"written": exchange.written, "refused": exchange.refused}
    try:
        exchange.raise_for_problems()
    except IntegrityError as exc:
        outcome["error"] = str(exc)
    return outcome


def test_a_digest_mismatch_on_arrival_is_refused_and_named(tmp_path: Path) -> None:
    sender, receiver = results_or_raise(run_ranks(2, _damaged, str(tmp_path), outbox=tmp_path / "out"))
    assert sender == {"written": [], "refused": []}
    assert receiver["written"] == [str(tmp_path / "in" / "good")]
    reasons = {path: (source, reason) for path, source, reason in receiver["refused"]}
    assert reasons == {
        "bad": (0, "digest mismatch on arrival"),
        "gone": (0, "the source rank could not read it"),
        "never": (0, "the source rank did not send it"),
    }
    assert "bad: from rank 0 to rank 1: digest mismatch on arrival" in receiver["error"]
    assert sorted(p.name for p in (tmp_path / "in").iterdir()) == ["good"]  # nothing else, no temporaries


def test_a_compressed_file_is_checked_against_its_uncompressed_digest(tmp_path: Path) -> None:
    raw = payload("raw", 300_000)
    stored = zstandard.ZstdCompressor().compress(raw)
    (tmp_path / "z").write_bytes(stored)
    good = FileRecord(
        path="z",
        rank=0,
        size=len(raw),
        digest=digest_bytes("blake3", raw),
        compression=Compression(codec="zstd", level=3, stored_size=len(stored)),
    )
    bad = FileRecord(
        path="z",
        rank=0,
        size=len(raw),
        digest=digest_bytes("blake3", raw[:-1] + b"!"),
        compression=good.compression,
    )
    # One process, no group: a send to oneself is a copy through the same checks.
    written = exchange_files(
        None,
        [FileSend(0, str(tmp_path / "z"), good)],
        [FileReceive(0, str(tmp_path / "a" / "z"), good)],
        block_bytes=4096,
    )
    assert written == [str(tmp_path / "a" / "z")] and (tmp_path / "a" / "z").read_bytes() == stored
    with pytest.raises(IntegrityError, match="z: from rank 0 to rank 0: digest mismatch"):
        exchange_files(None, [FileSend(0, str(tmp_path / "z"), bad)], [FileReceive(0, str(tmp_path / "b" / "z"), bad)])
    assert not (tmp_path / "b" / "z").exists() and os.listdir(tmp_path / "b") == []
    with pytest.raises(IntegrityError, match=f"z: copied from {tmp_path}/z: digest mismatch on arrival"):
        copy_file(str(tmp_path / "z"), tmp_path / "c" / "z", bad)
    assert os.listdir(tmp_path / "c") == []


def test_fast_checks_the_fast_digest_and_the_default_the_recorded_digest(tmp_path: Path) -> None:
    data = payload("fast", 200_000)
    (tmp_path / "f").write_bytes(data)
    wrong_strong = FileRecord(
        path="f",
        rank=0,
        size=len(data),
        digest=digest_bytes("blake3", data[:-1] + b"!"),
        fast_digest=digest_bytes("xxh3-128", data),
    )
    wrong_fast = FileRecord(
        path="f",
        rank=0,
        size=len(data),
        digest=digest_bytes("blake3", data),
        fast_digest=digest_bytes("xxh3-128", data[:-1] + b"!"),
    )
    assert arrival_digest(wrong_strong, True) == wrong_strong.fast_digest
    assert arrival_digest(wrong_strong, False) == wrong_strong.digest
    copy_file(str(tmp_path / "f"), tmp_path / "a" / "f", wrong_strong, block_bytes=4096, fast=True)
    assert (tmp_path / "a" / "f").read_bytes() == data
    with pytest.raises(IntegrityError, match="digest mismatch on arrival"):
        copy_file(str(tmp_path / "f"), tmp_path / "b" / "f", wrong_strong, block_bytes=4096)
    with pytest.raises(IntegrityError, match="digest mismatch on arrival"):
        copy_file(str(tmp_path / "f"), tmp_path / "c" / "f", wrong_fast, block_bytes=4096, fast=True)
    # A record without a fast digest (format 2.0) is checked by its digest either way.
    plain = record("f", data[:-1] + b"!")
    with pytest.raises(IntegrityError, match="digest mismatch on arrival"):
        copy_file(str(tmp_path / "f"), tmp_path / "d" / "f", plain, fast=True)
    assert not any((tmp_path / name / "f").exists() for name in "bcd")


def _all_to_all(rank: int, world_size: int, root: str) -> list[str]:
    """Every rank sends two files to every other rank (and one to itself)."""
    sends, receives = [], []
    for peer in range(world_size):
        for index in range(2 if peer != rank else 1):
            outgoing, incoming = f"{rank}-{peer}-{index}", f"{peer}-{rank}-{index}"
            data = payload(outgoing, 3000 + 100 * rank + index)
            Path(root, outgoing).write_bytes(data)
            sends.append(FileSend(peer, str(Path(root, outgoing)), record(outgoing, data)))
            expected = payload(incoming, 3000 + 100 * peer + index)
            receives.append(FileReceive(peer, str(Path(root, "in", incoming)), record(incoming, expected)))
    return sorted(Path(p).name for p in exchange_files(None, sends, receives, block_bytes=512))


def test_every_rank_sending_to_every_other_completes(tmp_path: Path) -> None:
    results = results_or_raise(run_ranks(4, _all_to_all, str(tmp_path), outbox=tmp_path / "out"))
    for rank, written in enumerate(results):
        assert written == sorted(
            f"{peer}-{rank}-{index}" for peer in range(4) for index in range(2 if peer != rank else 1)
        )


def _planned(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Rank 0 sends two multi-block files to rank 2 (one damaged in its last block) with the plan
    given, so no rank gathers who sends to whom; rank 1 is planned to send to rank 0 and has
    nothing: its stream is empty."""
    good, bad = payload("good", 9 * 1024 + 5), payload("bad", 9 * 1024 + 5)
    sends, receives = [], []
    if rank == 0:
        Path(root, "good").write_bytes(good)
        Path(root, "bad").write_bytes(bad[:-1] + b"\x00")
        sends = [FileSend(2, str(Path(root, n)), record(n, d)) for n, d in [("good", good), ("bad", bad)]]
    if rank == 2:
        receives = [FileReceive(0, str(Path(root, "in", n)), record(n, d)) for n, d in [("good", good), ("bad", bad)]]
    exchange = run_exchange(None, sends, receives, block_bytes=1024, pairs=[(0, 2), (1, 0)])
    return {"written": [Path(p).name for p in exchange.written], "refused": exchange.refused}


def test_a_known_plan_skips_the_gather_and_still_refuses_a_damaged_file(tmp_path: Path) -> None:
    results = results_or_raise(run_ranks(3, _planned, str(tmp_path), outbox=tmp_path / "out"))
    assert results[2]["written"] == ["good"]
    assert [(path, source) for path, source, _ in results[2]["refused"]] == [("bad", 0)]
    assert "digest mismatch" in results[2]["refused"][0][2]
    assert results[0]["written"] == [] and results[0]["refused"] == []
    assert (tmp_path / "in" / "good").read_bytes() == payload("good", 9 * 1024 + 5)
    assert not (tmp_path / "in" / "bad").exists()
    assert [p.name for p in tmp_path.rglob("*") if ".tmp-" in p.name] == []


def _outside_plan(rank: int, world_size: int, root: str) -> str:
    import torch.distributed as dist

    Path(root, f"f{rank}").write_bytes(b"x")
    sends = [FileSend(1, str(Path(root, f"f{rank}")), record("f", b"x"))] if rank == 0 else []
    said = ""
    try:
        run_exchange(None, sends, [], pairs=[])
    except Exception as exc:
        said = str(exc)
    # No traffic at all: without a collective, rank 1 could exit while rank 0's gloo mesh is
    # still connecting.
    dist.barrier()
    return said


def test_a_send_outside_the_plan_is_an_error(tmp_path: Path) -> None:
    results = results_or_raise(run_ranks(2, _outside_plan, str(tmp_path), outbox=tmp_path / "out"))
    assert "plan leaves out" in results[0] and results[1] == ""
