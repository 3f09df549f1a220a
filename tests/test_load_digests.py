"""Which recorded digests a load checks (docs/trust.md "Two digests"): the fast one (xxh3-128)
by default, the cryptographic one under a public key or with ``digest="cryptographic"``, and
both (with every block) in ``verify``. A recorded digest is changed and the manifest re-sealed,
so only the check that compares that digest can notice."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

import shardkeep as sk
from shardkeep.integrity import generate_key_pair
from shardkeep.io import check_shard
from shardkeep.manifest import FileRecord
from shardkeep.storage import LocalStore

STATE = {"w": torch.arange(64 * 1024, dtype=torch.float32), "b": torch.ones(3)}


def _save(path: Path, **options: Any) -> Path:
    sk.save(STATE, path, step=1, options=sk.WriteOptions(**options) if options else None)
    return path


def _wrong(digest: str) -> str:
    algorithm, _, hexdigest = digest.partition(":")
    return f"{algorithm}:{'0' if hexdigest[0] != '0' else '1'}{hexdigest[1:]}"


def _break_file_digest(field: str) -> Callable[[dict[str, Any]], None]:
    def mutate(raw: dict[str, Any]) -> None:
        raw["files"][0][field] = _wrong(raw["files"][0][field])

    return mutate


def test_a_default_load_checks_the_fast_digest_and_a_cryptographic_one_the_strong(
    tmp_path: Path, reseal: Callable[..., None]
) -> None:
    path = _save(tmp_path / "c")
    reseal(path, _break_file_digest("digest"))
    loaded = sk.load(path)  # the fast digest matches: a default load does not compare the strong one
    assert torch.equal(loaded["w"], STATE["w"])
    with pytest.raises(sk.IntegrityError, match="digest mismatch"):
        sk.load(path, digest="cryptographic")
    report = sk.verify(path)
    assert not report.ok and any("digest mismatch" in problem for problem in report.problems)


def test_a_wrong_fast_digest_fails_a_default_load_and_verify_but_not_a_cryptographic_load(
    tmp_path: Path, reseal: Callable[..., None]
) -> None:
    path = _save(tmp_path / "c")
    reseal(path, _break_file_digest("fast_digest"))
    with pytest.raises(sk.IntegrityError, match="digest mismatch"):
        sk.load(path)
    assert torch.equal(sk.load(path, digest="cryptographic")["w"], STATE["w"])
    assert not sk.verify(path).ok


def test_a_flipped_byte_fails_every_kind_of_load(tmp_path: Path) -> None:
    path = _save(tmp_path / "c")
    shard = next((path / "shards").iterdir())
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x10
    shard.write_bytes(bytes(data))
    for digest in (None, "fast", "cryptographic"):
        with pytest.raises(sk.IntegrityError):
            sk.load(path, digest=digest)
    assert not sk.verify(path).ok


def test_a_signed_checkpoint_is_loaded_with_its_cryptographic_digests(
    tmp_path: Path, reseal: Callable[..., None]
) -> None:
    private, public = tmp_path / "key.pem", tmp_path / "key.pub"
    generate_key_pair(private, public)
    path = tmp_path / "c"
    sk.save(STATE, path, step=1, signer=private)
    assert torch.equal(sk.load(path, public_key=public)["w"], STATE["w"])
    assert torch.equal(sk.load(path, public_key=public, digest="cryptographic")["w"], STATE["w"])
    with pytest.raises(sk.ConfigError, match="digest='fast' with public_key"):
        sk.load(path, public_key=public, digest="fast")


def test_digest_options_are_checked() -> None:
    with pytest.raises(sk.ConfigError, match="verify=False"):
        sk.load("unused", verify=False, digest="cryptographic")
    with pytest.raises(sk.ConfigError, match="must be None"):
        sk.load("unused", digest="sha256")  # type: ignore[arg-type]


def test_a_checkpoint_without_fast_digests_is_checked_with_its_own(tmp_path: Path, reseal: Callable[..., None]) -> None:
    path = _save(tmp_path / "c", block_size=0)  # format 1.3: one digest per file
    assert sk.read_manifest(path).metadata_version == "1.3"
    reseal(path, _break_file_digest("digest"))
    with pytest.raises(sk.IntegrityError, match="digest mismatch"):
        sk.load(path)  # digest=None falls back to the only digest recorded


def test_verify_checks_whole_tensor_blocks_a_load_does_not_need(tmp_path: Path, reseal: Callable[..., None]) -> None:
    path = _save(tmp_path / "c", block_size=16 << 10)

    def break_blocks(raw: dict[str, Any]) -> None:
        entry = next(t for t in raw["files"][0]["tensors"] if t.get("blocks"))
        blocks = bytearray(base64.b64decode(entry["blocks"]))
        blocks[0] ^= 1
        entry["blocks"] = base64.b64encode(bytes(blocks)).decode()

    reseal(path, break_blocks)
    assert torch.equal(sk.load(path)["w"], STATE["w"])  # whole-file reads check the file digest
    report = sk.verify(path)
    assert not report.ok and any("fails its digest" in problem for problem in report.problems)


def _save_two_chunks(rank: int, world_size: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    state = {
        "a": distribute_tensor(torch.arange(64 * 128, dtype=torch.float32).reshape(128, 64), mesh, [Shard(0)]),
        "b": distribute_tensor(torch.ones(128, 64), mesh, [Shard(0)]),
    }
    sk.save(state, path, step=1, options=sk.WriteOptions(block_size=16 << 10))


def test_a_partial_read_compares_the_fast_or_the_strong_halves_of_the_blocks(tmp_path: Path) -> None:
    from tests.support.distributed_harness import results_or_raise, run_ranks

    path = tmp_path / "c"
    results_or_raise(run_ranks(2, _save_two_chunks, str(path), outbox=tmp_path / "save"))
    index = path / "index" / "rank_00000.json"
    raw = json.loads(index.read_bytes())
    record = raw["files"][0]
    assert record["block_size"] == 16 << 10 and len(record["tensors"]) == 2
    blocks = bytearray(base64.b64decode(record["tensors"][1]["blocks"]))
    blocks[16] ^= 1  # the first byte of block 0's strong half
    record["tensors"][1]["blocks"] = base64.b64encode(bytes(blocks)).decode()
    parsed = msgspec.json.decode(msgspec.json.encode(record), type=FileRecord)
    store = LocalStore(str(path))
    _, problems = check_shard(store, parsed.path, parsed, verify=True, keep=True, needed=[1], digest="fast")
    assert problems == []
    _, problems = check_shard(store, parsed.path, parsed, verify=True, keep=True, needed=[1], digest="strong")
    assert any("fails its digest" in problem for problem in problems), problems
    _, problems = check_shard(store, parsed.path, parsed, verify=True, keep=False, digest="all")
    assert any("fails its digest" in problem for problem in problems), problems
    _, problems = check_shard(store, parsed.path, parsed, verify=True, keep=False, digest="fast")
    assert problems == []  # a whole-file fast check compares the file's fast digest only


def test_a_cryptographic_load_of_a_checkpoint_without_cryptographic_digests_is_refused(tmp_path: Path) -> None:
    path = _save(tmp_path / "c", digest="xxh3-128")
    assert torch.equal(sk.load(path)["w"], STATE["w"])
    with pytest.raises(sk.IntegrityError, match="records no cryptographic digest"):
        sk.load(path, digest="cryptographic")
