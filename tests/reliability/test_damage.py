"""Damage detection: every single-bit flip (signature included), every truncation, extra and
missing files, and hostile paths in a manifest are caught by both ``load`` and ``verify``."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import blake3
import pytest
import torch
import xxhash
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import shardkeep as sk
from tests.reliability import format2
from tests.support.disk import checkpoint_files, flip_bit, reseal
from tests.support.figures import FULL, record

KEY = Ed25519PrivateKey.generate()


def _tiny_checkpoint(path: Path, signed: bool = True) -> None:
    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor([1, 2]), "step": 3}
    sk.save(state, path, signer=KEY if signed else None)


def _damage_detected(path: Path, signed: bool = True) -> tuple[bool, bool]:
    """(verify failed, load raised a ShardkeepError); a signed checkpoint is read with its key, an
    unsigned one without (where the manifest's seal and the digests must catch everything)."""
    key = KEY.public_key() if signed else None
    verify_failed = not sk.verify(path, public_key=key).ok
    try:
        sk.load(path, public_key=key)
    except sk.ShardkeepError:
        load_failed = True
    else:
        load_failed = False
    return verify_failed, load_failed


@pytest.mark.slow
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_every_single_bit_flip_is_detected_by_load_and_verify(tmp_path: Path, signed: bool) -> None:
    pristine = tmp_path / "pristine"
    _tiny_checkpoint(pristine, signed)
    work = tmp_path / "work"
    shutil.copytree(pristine, work)
    assert _damage_detected(work, signed) == (False, False)
    undetected: list[str] = []
    flips = 0
    sizes = {p.name: p.stat().st_size for p in checkpoint_files(pristine)}
    assert set(sizes) == {"manifest.json", "rank_00000.safetensors"} | ({"manifest.sig"} if signed else set())
    for original in checkpoint_files(pristine):
        relative = original.relative_to(pristine)
        target = work / relative
        content = original.read_bytes()
        for byte_index in range(len(content)):
            for bit in range(8):
                flip_bit(target, byte_index, bit)
                flips += 1
                verify_failed, load_failed = _damage_detected(work, signed)
                if not (verify_failed and load_failed):
                    undetected.append(f"{relative}[{byte_index}] bit {bit}: verify={verify_failed} load={load_failed}")
                flip_bit(target, byte_index, bit)
    assert flips > 8000
    kind = "signed checkpoint, read with its public key" if signed else "unsigned checkpoint, read without a key"
    record(
        "bit flips",
        trials=flips,
        failures=len(undetected),
        detail=f"every bit of a small {kind} ("
        + ", ".join(f"{name} {size} B" for name, size in sorted(sizes.items()))
        + "), one at a time; verify and load must both refuse",
    )
    assert undetected == []
    assert _damage_detected(work, signed) == (False, False)


@pytest.mark.slow
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_every_truncation_is_detected(tmp_path: Path, signed: bool) -> None:
    pristine = tmp_path / "pristine"
    _tiny_checkpoint(pristine, signed)
    work = tmp_path / "work"
    shutil.copytree(pristine, work)
    undetected: list[str] = []
    truncations = 0
    for original in checkpoint_files(pristine):
        relative = original.relative_to(pristine)
        content = original.read_bytes()
        for length in range(len(content)):
            truncations += 1
            (work / relative).write_bytes(content[:length])
            if _damage_detected(work, signed) != (True, True):
                undetected.append(f"{relative} truncated to {length}")
        (work / relative).write_bytes(content)  # restored: one file damaged at a time
    assert sorted(p.read_bytes() for p in checkpoint_files(work)) == sorted(
        p.read_bytes() for p in checkpoint_files(pristine)
    )
    record(
        "truncation",
        trials=truncations,
        failures=len(undetected),
        detail=f"each file of the {'signed' if signed else 'unsigned'} checkpoint truncated to every shorter length",
    )
    assert undetected == []


def test_extra_and_missing_files_are_reported(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    _tiny_checkpoint(checkpoint)
    (checkpoint / "shards" / "stray.bin").write_bytes(b"x")
    report = sk.verify(checkpoint)
    assert report.problems == ["shards/stray.bin: extra file not listed in the manifest"]
    with pytest.raises(sk.IntegrityError, match=r"stray\.bin"):
        sk.load(checkpoint)
    (checkpoint / "shards" / "stray.bin").unlink()
    (checkpoint / "shards" / "rank_00000.safetensors").unlink()
    report = sk.verify(checkpoint)
    assert report.problems[0] == "shards/rank_00000.safetensors: missing (listed in the manifest)"
    with pytest.raises(sk.IntegrityError, match="missing"):
        sk.load(checkpoint)


def test_every_extra_or_missing_file_is_detected(tmp_path: Path) -> None:
    pristine = tmp_path / "pristine"
    _tiny_checkpoint(pristine)
    cases = {
        "a stray file in shards/": lambda c: (c / "shards" / "stray.bin").write_bytes(b"x"),
        "a stray file beside the manifest": lambda c: (c / "notes.txt").write_bytes(b""),
        "a stray directory with a file": lambda c: (c / "extra").mkdir() or (c / "extra" / "x").write_bytes(b"1"),
        "the shard removed": lambda c: (c / "shards" / "rank_00000.safetensors").unlink(),
        "the shards directory removed": lambda c: shutil.rmtree(c / "shards"),
        "the signature removed": lambda c: (c / "manifest.sig").unlink(),
    }
    missed = []
    for name, damage in cases.items():
        work = tmp_path / "work"
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(pristine, work)
        damage(work)
        if _damage_detected(work) != (True, True):
            missed.append(name)
    record("extra or missing files", trials=len(cases), failures=len(missed), detail=", ".join(cases))
    assert missed == []


def test_verify_reports_every_problem_at_once(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    sk.save(
        {f"t{i}": torch.full((1000,), float(i)) for i in range(4)},
        checkpoint,
        options=sk.WriteOptions(file_size_target=4000),
    )
    files = sorted((checkpoint / "shards").iterdir())
    assert len(files) == 4
    flip_bit(files[0], files[0].stat().st_size - 1, 0)
    flip_bit(files[2], files[2].stat().st_size - 1, 0)
    (checkpoint / "extra").write_bytes(b"")
    report = sk.verify(checkpoint)
    assert len(report.problems) == 3, report.problems
    assert report.files_checked == 4


@pytest.mark.parametrize(
    "hostile", ["../outside.safetensors", "/etc/passwd", "shards/../../outside.safetensors", "shards\\x", "a\x00b"]
)
def test_hostile_paths_in_a_manifest_are_rejected_without_reading(tmp_path: Path, hostile: str) -> None:
    checkpoint = tmp_path / "root" / "ckpt"
    _tiny_checkpoint(checkpoint)
    outside = tmp_path / "root" / "outside.safetensors"
    shutil.copy(checkpoint / "shards" / "rank_00000.safetensors", outside)

    def point_outside(raw: dict) -> None:  # type: ignore[type-arg]
        raw["files"][0]["path"] = hostile

    reseal(checkpoint, point_outside)
    with pytest.raises(sk.ManifestError, match="unsafe path"):
        sk.load(checkpoint)
    with pytest.raises(sk.ManifestError, match="unsafe path"):
        sk.read_manifest(checkpoint)
    report = sk.verify(checkpoint)
    assert not report.ok and any("unsafe path" in p for p in report.problems)


def test_symlinked_shard_or_directory_is_refused(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    _tiny_checkpoint(checkpoint)
    shard = checkpoint / "shards" / "rank_00000.safetensors"
    elsewhere = tmp_path / "elsewhere.safetensors"
    shutil.move(shard, elsewhere)
    shard.symlink_to(elsewhere)  # identical bytes, but reached through a symlink
    with pytest.raises(sk.ShardkeepError, match="symlink"):
        sk.load(checkpoint)
    assert any("symlink" in p for p in sk.verify(checkpoint).problems)

    shard.unlink()
    shutil.move(checkpoint / "shards", tmp_path / "real_shards")
    shutil.move(elsewhere, tmp_path / "real_shards" / "rank_00000.safetensors")
    (checkpoint / "shards").symlink_to(tmp_path / "real_shards")
    with pytest.raises(sk.ShardkeepError, match="symlink"):
        sk.load(checkpoint)
    assert not sk.verify(checkpoint).ok


def test_fifo_in_place_of_a_shard_is_refused_without_blocking(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    _tiny_checkpoint(checkpoint)
    shard = checkpoint / "shards" / "rank_00000.safetensors"
    shard.unlink()
    os.mkfifo(shard)
    with pytest.raises(sk.ShardkeepError, match=r"special file|not a regular file"):
        sk.load(checkpoint)
    assert not sk.verify(checkpoint).ok


def test_header_that_disagrees_with_the_manifest_is_caught(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    _tiny_checkpoint(checkpoint)

    def relabel(raw: dict) -> None:  # type: ignore[type-arg]
        for entry in raw["files"][0]["tensors"]:
            if entry["key"] == "w":
                entry["shape"] = [3, 2]

    reseal(checkpoint, relabel)
    with pytest.raises(sk.IntegrityError, match="header"):
        sk.load(checkpoint)
    assert any("header" in p for p in sk.verify(checkpoint).problems)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (b'"w":{"dtype"', b'"b" :{"dtype"'),  # a second entry named "b", hidden by a space
        (b'"shape":[2,3],', b'"shape":[2,3],"dtype":"F32",'),  # a repeated member
        (b'"data_offsets":[16,40]', b'"data_offsets":[16.0,40]'),  # not an integer
        (b'"data_offsets":[16,40]', b'"data_offsets":["16",40]'),
        (b'"shardkeep.version":"1"', b'"shardkeep.version":1'),  # metadata must be strings
        (b'"data_offsets":[16,40]', b'"data_offsets":[40,16]'),  # ends before it begins
    ],
)
def test_a_hostile_shard_header_is_refused_even_with_matching_digests(tmp_path: Path, old: bytes, new: bytes) -> None:
    """An attacker who rewrites a shard and re-seals the manifest with its new size and digest
    (no signature): the header's strict parsing and cross-check still refuse it."""
    checkpoint = tmp_path / "ckpt"
    _tiny_checkpoint(checkpoint, signed=False)
    shard = checkpoint / "shards" / "rank_00000.safetensors"
    data = shard.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = data[8 : 8 + length].rstrip(b" ")
    assert old in header
    header = header.replace(old, new, 1)
    header += b" " * (-(len(header) + 8) % 8)
    rewritten = struct.pack("<Q", len(header)) + header + data[8 + length :]
    os.chmod(shard, 0o644)
    shard.write_bytes(rewritten)
    offset_shift = len(header) - length

    def follow(raw: dict) -> None:  # type: ignore[type-arg]
        record = raw["files"][0]
        record["size"] = len(rewritten)
        record["digest"] = "blake3:" + blake3.blake3(rewritten).hexdigest()
        if "fast_digest" in record:
            record["fast_digest"] = "xxh3-128:" + xxhash.xxh3_128_hexdigest(rewritten)
        for entry in record["tensors"]:
            entry["offset"] += offset_shift

    reseal(checkpoint, follow)
    with pytest.raises(sk.IntegrityError, match="header"):
        sk.load(checkpoint)
    assert any("header" in p for p in sk.verify(checkpoint).problems)


def test_a_very_deep_directory_tree_inside_a_checkpoint_is_a_typed_problem(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    _tiny_checkpoint(checkpoint)
    deep = checkpoint
    for _ in range(200):  # far deeper than any legitimate layout; walked without recursion
        deep = deep / "a"
    deep.mkdir(parents=True)
    assert not sk.verify(checkpoint).ok
    with pytest.raises(sk.IntegrityError):
        sk.load(checkpoint)


def _forge_shape(checkpoint: Path, key: str, shape: list[int], *, in_manifest: bool = True) -> None:
    """Rewrite ``key``'s shape in the shard header (and the manifest), with the file's size and
    digest and the manifest's seal made to match, as an attacker who can write the directory."""
    shard = next((checkpoint / "shards").iterdir())
    data = shard.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    header[key]["shape"] = shape
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-(len(body) + 8) % 8)
    rewritten = struct.pack("<Q", len(body)) + body + data[8 + length :]
    os.chmod(shard, 0o644)
    shard.write_bytes(rewritten)

    def follow(raw: dict) -> None:  # type: ignore[type-arg]
        record_ = raw["files"][0]
        record_["size"] = len(rewritten)
        record_["digest"] = "blake3:" + blake3.blake3(rewritten).hexdigest()
        if "fast_digest" in record_:
            record_["fast_digest"] = "xxh3-128:" + xxhash.xxh3_128_hexdigest(rewritten)
        for entry in record_["tensors"]:
            entry["offset"] += len(body) - length
            if entry["key"] == key and in_manifest:
                entry["shape"] = shape

    reseal(checkpoint, follow)


@pytest.mark.parametrize("dimension", [2**63, 2**62, 10**400], ids=["2**63", "2**62", "10**400"])
@pytest.mark.parametrize("in_manifest", [True, False], ids=["header+manifest", "header"])
def test_a_shape_that_overflows_is_refused_alike_by_verify_load_and_restore(
    tmp_path: Path, dimension: int, in_manifest: bool
) -> None:
    """An empty tensor whose other dimension overflows 64 bits, with matching digests: verify
    and load agree with a typed error, and the manager falls back to the previous checkpoint."""
    manager = sk.CheckpointManager(tmp_path / "root", keep_last=2, keep_best=0)
    for step in (1, 2):
        manager.save({"empty": torch.zeros(0, 3), "w": torch.full((2,), float(step))}, step=step)
    newest = tmp_path / "root" / "step_00000002"
    _forge_shape(newest, "empty", [0, dimension], in_manifest=in_manifest)
    report = sk.verify(newest)
    assert not report.ok and any("shape" in problem for problem in report.problems), report.problems
    with pytest.raises(sk.ShardkeepError, match="shape"):
        sk.load(newest)
    restored = manager.restore()
    assert restored.step == 1 and [name for name, _ in restored.skipped] == ["step_00000002"]
    assert torch.equal(restored.state["w"], torch.full((2,), 1.0))


def test_the_largest_representable_empty_shape_still_loads(tmp_path: Path) -> None:
    """The bound is the 64-bit extent, not a smaller arbitrary limit."""
    checkpoint = tmp_path / "ckpt"
    sk.save({"empty": torch.zeros(0, 3)}, checkpoint)
    _forge_shape(checkpoint, "empty", [0, 2**40])
    assert sk.verify(checkpoint).ok
    assert sk.load(checkpoint)["empty"].shape == (0, 2**40)


# --------------------------------------------------------------------------------------------
# format 2.0: a checkpoint saved by 2 gloo ranks (root manifest, rank indexes, _sharded files)
# --------------------------------------------------------------------------------------------


def _format2_outcome(path: Path, signed: bool, io_threads: int | None = None) -> tuple[bool, str]:
    """(verify failed, what load did): ``"refused"`` (a ShardkeepError), ``"exact"`` (the saved
    values, bit for bit), ``"WRONG"`` (other values) or ``"untyped <error>"``. ``io_threads``
    (default: verify's and load's own) is passed to both."""
    key = format2.KEY.public_key() if signed else None
    threads = {} if io_threads is None else {"io_threads": io_threads}
    verify_failed = not sk.verify(path, public_key=key, **threads).ok
    try:
        loaded = sk.load(path, public_key=key, **threads)
    except sk.ShardkeepError:
        return verify_failed, "refused"
    except Exception as exc:
        return verify_failed, f"untyped {type(exc).__name__}: {exc}"
    return verify_failed, "exact" if format2.same(loaded) else "WRONG"


def _format2_checkpoint(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, signed: bool) -> Path:
    work = format2.copy(tmp_path_factory, tmp_path / "work", signed=signed)
    assert _format2_outcome(work, signed) == (False, "exact")
    return work


#: The exhaustive sweeps below verify and load each damaged copy with ``io_threads=1``: the
#: same checks on the same bytes, run in the calling thread instead of a pool started and joined
#: for every one of the ~20k tiny checkpoints (about a quarter of each check's time). The sampled
#: sweep keeps the default pools.
SERIAL = 1


def _format2_flips(work: Path, positions: Any, io_threads: int | None = None) -> tuple[int, list[str], dict[str, int]]:
    """Flip ``positions(relative, size)`` -> [(byte, bit)] of every file, one at a time (each
    restored after). Returns (flips, failures, what load did -> count)."""
    flips = 0
    failures: list[str] = []
    outcomes: dict[str, int] = {}
    signed = (work / "manifest.sig").exists()
    for target in checkpoint_files(work):
        relative = target.relative_to(work)
        for byte_index, bit in positions(str(relative), target.stat().st_size):
            flip_bit(target, byte_index, bit)
            flips += 1
            verify_failed, load = _format2_outcome(work, signed, io_threads)
            outcomes[load.partition(":")[0]] = outcomes.get(load.partition(":")[0], 0) + 1
            if not verify_failed or load not in ("refused", "exact"):
                failures.append(f"{relative}[{byte_index}] bit {bit}: verify failed={verify_failed}, load {load}")
            flip_bit(target, byte_index, bit)
    return flips, failures, outcomes


def _format2_truncations(
    work: Path, lengths: Any, io_threads: int | None = None
) -> tuple[int, list[str], dict[str, int]]:
    """Truncate every file to each of ``lengths(relative, size)`` (restored after)."""
    truncations = 0
    failures: list[str] = []
    outcomes: dict[str, int] = {}
    signed = (work / "manifest.sig").exists()
    for target in checkpoint_files(work):
        relative = target.relative_to(work)
        content = target.read_bytes()
        for length in lengths(str(relative), len(content)):
            target.write_bytes(content[:length])
            truncations += 1
            verify_failed, load = _format2_outcome(work, signed, io_threads)
            outcomes[load.partition(":")[0]] = outcomes.get(load.partition(":")[0], 0) + 1
            if not verify_failed or load not in ("refused", "exact"):
                failures.append(f"{relative} truncated to {length}: verify failed={verify_failed}, load {load}")
        target.write_bytes(content)
    return truncations, failures, outcomes


def _sizes(work: Path) -> str:
    return ", ".join(f"{p.relative_to(work)} {p.stat().st_size} B" for p in checkpoint_files(work))


def test_sampled_bit_flips_and_truncations_of_a_format_2_checkpoint_are_detected(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """The fast sample of the sweeps below: 24 evenly spread bytes of every file (the first and
    the last included, the bit rotating), and 6 truncations of every file. Verify reports each
    one; load refuses it (or returns exactly the saved values: never other ones)."""
    work = _format2_checkpoint(tmp_path_factory, tmp_path, signed=True)
    assert sorted(str(p.relative_to(work)) for p in checkpoint_files(work)) == format2.FILES

    def spread(relative: str, size: int) -> list[tuple[int, int]]:
        return [(i * (size - 1) // 23, i % 8) for i in range(24)]

    flips, flip_failures, _ = _format2_flips(work, spread)
    truncations, cut_failures, _ = _format2_truncations(
        work, lambda relative, size: sorted({0, 1, size // 3, size // 2, size - 8, size - 1})
    )
    assert flips == 24 * len(format2.FILES) and truncations >= 5 * len(format2.FILES)
    assert flip_failures == [] and cut_failures == []
    assert _format2_outcome(work, True) == (False, "exact")


@pytest.mark.slow
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_bit_flips_in_every_byte_of_a_format_2_checkpoint_are_detected(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, signed: bool
) -> None:
    """Every byte of every file of a format 2.0 checkpoint (the rank indexes and the _sharded
    data files included), one flip at a time: all 8 bits of every byte of the files format 2.0
    adds (the rank indexes and the _sharded data files) in the signed checkpoint, one bit per
    byte otherwise, rotating over the 8 bit positions (the 1.x sweeps above flip every bit of
    those formats); all 8 bits everywhere with SHARDKEEP_RELIABILITY=full. Every byte is covered
    by a digest (the manifest's seal, an index digest in the manifest, a file digest in an
    index or the manifest, the signature), so verify must report each flip, and load must refuse
    it or return exactly the saved values."""
    work = _format2_checkpoint(tmp_path_factory, tmp_path, signed)
    sizes = _sizes(work)

    def every_byte(relative: str, size: int) -> list[tuple[int, int]]:
        if FULL or (signed and (relative.startswith("index/") or "_sharded" in relative)):
            return [(i, bit) for i in range(size) for bit in range(8)]
        return [(i, (i + len(relative)) % 8) for i in range(size)]

    flips, failures, outcomes = _format2_flips(work, every_byte, SERIAL)
    kind = "signed checkpoint, read with its public key" if signed else "unsigned checkpoint, read without a key"
    record(
        "bit flips (format 2.0)",
        trials=flips,
        failures=len(failures),
        detail=f"{'every bit' if FULL else 'every bit of the indexes and _sharded files, else one rotating bit' if signed else 'one rotating bit'} "
        f"of every byte of a format 2.0 {kind} saved by 2 "
        f"gloo ranks ({sizes}); verify must report each, load refuse it or return the exact values "
        f"(load: {outcomes})",
    )
    assert flips > 3000
    assert failures == []
    assert _format2_outcome(work, signed) == (False, "exact")


@pytest.mark.slow
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_every_truncation_of_a_format_2_checkpoint_is_detected(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, signed: bool
) -> None:
    work = _format2_checkpoint(tmp_path_factory, tmp_path, signed)
    truncations, failures, outcomes = _format2_truncations(work, lambda relative, size: range(size), SERIAL)
    record(
        "truncation (format 2.0)",
        trials=truncations,
        failures=len(failures),
        detail=f"each file of the {'signed' if signed else 'unsigned'} format 2.0 checkpoint (rank indexes and "
        f"_sharded files included) truncated to every shorter length (load: {outcomes})",
    )
    assert failures == []


def test_every_extra_or_missing_file_of_a_format_2_checkpoint_is_detected(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    pristine = format2.pristine(tmp_path_factory)
    cases = {
        "an index removed": lambda c: (c / "index" / "rank_00001.json").unlink(),
        "the index directory removed": lambda c: shutil.rmtree(c / "index"),
        "a stray file in index/": lambda c: (c / "index" / "rank_00002.json").write_bytes(b"{}"),
        "a rank's _sharded file removed": lambda c: (c / "shards" / "rank_00001_sharded.safetensors").unlink(),
        "the indexes swapped": lambda c: (
            (c / "index" / "rank_00000.json").rename(c / "index" / "x"),
            (c / "index" / "rank_00001.json").rename(c / "index" / "rank_00000.json"),
            (c / "index" / "x").rename(c / "index" / "rank_00001.json"),
        ),
        "the _sharded files swapped": lambda c: (
            (c / "shards" / "rank_00000_sharded.safetensors").rename(c / "shards" / "x"),
            (c / "shards" / "rank_00001_sharded.safetensors").rename(c / "shards" / "rank_00000_sharded.safetensors"),
            (c / "shards" / "x").rename(c / "shards" / "rank_00001_sharded.safetensors"),
        ),
    }
    missed = []
    for name, damage in cases.items():
        work = tmp_path / "work"
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(pristine, work)
        damage(work)
        verify_failed, load = _format2_outcome(work, signed=True)
        if not verify_failed or load != "refused":
            missed.append(f"{name}: verify failed={verify_failed}, load {load}")
    record("extra or missing files (format 2.0)", trials=len(cases), failures=len(missed), detail=", ".join(cases))
    assert missed == []
