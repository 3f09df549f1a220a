"""One conformance suite for every byte-store backend (local filesystem, in-memory reference, and
fsspec against a real S3 server): the contract of ``shardkeep.storage.base.ByteStore``, then
save/load/verify through each store, then an injected failure at every operation of a save
through each store. Object stores have no rename and no symlinks; the tests that need them say
what an object store does instead."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import shardkeep as sk
from shardkeep.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    StorageError,
    UnsafePathError,
    UnsupportedValueError,
)
from shardkeep.storage import ByteStore, FaultInjectingStore, FsspecStore, LocalStore, renames
from shardkeep.storage.faults import InjectedFault
from shardkeep.storage.memory import MemoryStore


@dataclass
class Backend:
    store: ByteStore
    make_special: Callable[[str], None] | None  # put a symlink (or what stands for one) at a path


def _local(tmp_path: Path) -> Backend:
    root = tmp_path / "root"
    root.mkdir()
    target = tmp_path / "outside.bin"
    target.write_bytes(b"outside")

    def make_special(path: str) -> None:
        link = root / path
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, link)

    return Backend(LocalStore(root), make_special)


def _memory(tmp_path: Path) -> Backend:
    store = MemoryStore()
    return Backend(store, store.add_special)


def _s3(request: pytest.FixtureRequest) -> Backend:
    server = request.getfixturevalue("s3_server")
    bucket = server.new_bucket("conf")
    return Backend(FsspecStore(f"s3://{bucket}/root", server.storage_options), None)


BACKENDS = {"local": _local, "memory": _memory, "s3": _s3}


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    yield BACKENDS[request.param](request) if request.param == "s3" else BACKENDS[request.param](tmp_path)


def write(store: ByteStore, path: str, data: bytes) -> None:
    handle = store.open_write(path)
    handle.write(data[: len(data) // 2])
    handle.write(memoryview(data)[len(data) // 2 :])
    handle.commit()


def read(store: ByteStore, path: str) -> bytes:
    handle = store.open_read(path)
    try:
        buffer = bytearray(handle.size)
        handle.read_into(0, memoryview(buffer))
        return bytes(buffer)
    finally:
        handle.close()


def test_files_are_create_only_and_read_back(backend: Backend) -> None:
    store = backend.store
    write(store, "a/b/data.bin", b"0123456789")
    assert read(store, "a/b/data.bin") == b"0123456789"
    with pytest.raises(CheckpointExistsError):
        store.open_write("a/b/data.bin")
    assert read(store, "a/b/data.bin") == b"0123456789"
    handle = store.open_read("a/b/data.bin")
    assert handle.size == 10
    mapped = handle.map()
    assert bytes(mapped) == b"0123456789"
    mapped[0] = ord("X")  # a private view: storage is unchanged
    part = bytearray(4)
    handle.read_into(3, memoryview(part))
    assert part == b"3456"
    with pytest.raises(StorageError, match="end of file"):
        handle.read_into(8, memoryview(bytearray(4)))
    handle.close()
    assert read(store, "a/b/data.bin") == b"0123456789"
    write(store, "empty", b"")
    assert read(store, "empty") == b""


def test_stat_and_listings(backend: Backend) -> None:
    store = backend.store
    write(store, "ckpt/manifest.json", b"{}")
    write(store, "ckpt/shards/rank_00000.safetensors", b"x" * 5)
    write(store, "other.txt", b"hello")
    file_info = store.stat("ckpt/shards/rank_00000.safetensors")
    assert file_info is not None and (file_info.kind, file_info.size) == ("file", 5)
    dir_info = store.stat("ckpt/shards")
    assert dir_info is not None and dir_info.kind == "dir"
    assert store.stat("ckpt/missing") is None
    assert store.stat("missing/deeper") is None
    assert [(name, info.kind, info.size) for name, info in store.list_files("ckpt")] == [
        ("manifest.json", "file", 2),
        ("shards/rank_00000.safetensors", "file", 5),
    ]
    assert [(name, info.kind) for name, info in store.list_dir("")] == [("ckpt", "dir"), ("other.txt", "file")]
    assert [name for name, _ in store.list_dir("ckpt")] == ["manifest.json", "shards"]
    with pytest.raises(CheckpointNotFoundError):
        store.list_files("missing")
    with pytest.raises(CheckpointNotFoundError):
        store.open_read("ckpt/missing.bin")


def test_put_atomic_replaces_whole(backend: Backend) -> None:
    store = backend.store
    store.put_atomic("pointers/last", b'{"checkpoint": "step_1"}')
    store.put_atomic("pointers/last", b'{"checkpoint": "step_2"}')
    assert read(store, "pointers/last") == b'{"checkpoint": "step_2"}'
    assert [name for name, _ in store.list_dir("pointers")] == ["last"]  # no temporary left behind


def test_rename_moves_a_tree_and_never_replaces(backend: Backend) -> None:
    store = backend.store
    if not renames(store):
        # An object store has no rename: it says so, and the commit protocol never asks for one.
        write(store, "step_1.tmp-abc/shards/a", b"a")
        with pytest.raises(UnsupportedValueError, match="no atomic rename"):
            store.rename("step_1.tmp-abc", "step_1")
        assert read(store, "step_1.tmp-abc/shards/a") == b"a"
        store.sync_dir("")
        return
    write(store, "step_1.tmp-abc/manifest.json", b"{}")
    write(store, "step_1.tmp-abc/shards/a", b"a")
    store.sync_dir("step_1.tmp-abc")
    store.rename("step_1.tmp-abc", "step_1")
    assert store.stat("step_1.tmp-abc") is None
    assert [name for name, _ in store.list_files("step_1")] == ["manifest.json", "shards/a"]
    write(store, "step_2/manifest.json", b"{}")
    with pytest.raises(CheckpointExistsError):
        store.rename("step_2", "step_1")
    assert read(store, "step_1/shards/a") == b"a"
    with pytest.raises(CheckpointNotFoundError):
        store.rename("step_9", "step_10")
    store.sync_dir("")
    with pytest.raises(CheckpointNotFoundError):
        store.sync_dir("missing")


def test_remove_tree(backend: Backend) -> None:
    store = backend.store
    write(store, "doomed/a/b", b"1")
    write(store, "doomed/c", b"2")
    write(store, "kept", b"3")
    store.remove_tree("doomed")
    assert store.stat("doomed") is None
    assert [name for name, _ in store.list_dir("")] == ["kept"]
    store.remove_tree("doomed")  # missing is fine
    store.remove_tree("nothing/below")


@pytest.mark.parametrize("bad", ["../escape", "/absolute", "a\\b", "a/./b", "a//b", "nul\x00", ""])
def test_unsafe_paths_are_refused(backend: Backend, bad: str) -> None:
    store = backend.store
    for operation in (
        lambda: store.open_write(bad),
        lambda: store.open_read(bad),
        lambda: store.stat(bad),
        lambda: store.put_atomic(bad, b"x"),
        lambda: store.rename(bad, "fine"),
        lambda: store.remove_tree(bad),
    ):
        with pytest.raises(UnsafePathError):
            operation()


def test_symlinks_are_refused_never_followed(backend: Backend) -> None:
    store = backend.store
    if backend.make_special is None:
        pytest.skip("an object store has no symlinks or special files")
    backend.make_special("ckpt/shards/rank_00000.safetensors")
    info = store.stat("ckpt/shards/rank_00000.safetensors")
    assert info is not None and info.kind == "other"
    with pytest.raises(UnsafePathError):
        store.open_read("ckpt/shards/rank_00000.safetensors")
    assert [(name, info.kind) for name, info in store.list_files("ckpt")] == [
        ("shards/rank_00000.safetensors", "other")
    ]
    backend.make_special("linked_dir")
    with pytest.raises(UnsafePathError):
        store.open_write("linked_dir/file")
    with pytest.raises(UnsafePathError):
        store.open_read("linked_dir/file")
    store.remove_tree("linked_dir")  # removes the link itself
    assert store.stat("linked_dir") is None


# --------------------------------------------------------------------------------------------
# The library through each store


def small_state() -> dict[str, object]:
    generator = torch.Generator().manual_seed(3)
    return {
        "weight": torch.randn(16, 8, generator=generator),
        "bias": torch.randn(8, generator=generator),
        "step": 12,
        "config": {"name": "tiny"},
    }


def test_save_load_verify_through_the_store(backend: Backend) -> None:
    store = backend.store
    state = small_state()
    key = Ed25519PrivateKey.generate()
    sk.save(state, "step_00000012", storage=store, step=12, signer=key)
    assert sk.verify("step_00000012", storage=store, public_key=key.public_key()).ok
    loaded = sk.load("step_00000012", storage=store, public_key=key.public_key())
    assert torch.equal(loaded["weight"], state["weight"])  # type: ignore[arg-type]
    assert loaded["config"] == {"name": "tiny"}
    assert sk.read_manifest("step_00000012", storage=store).step == 12
    assert [name for name, _ in store.list_dir("")] == ["step_00000012"]
    with pytest.raises(CheckpointExistsError):
        sk.save(state, "step_00000012", storage=store)


def test_a_failure_at_every_operation_of_a_save_commits_nothing(backend: Backend) -> None:
    """A signed save: the signature is written before the manifest, and removed on failure."""
    store = backend.store
    state = small_state()
    key = Ed25519PrivateKey.generate()
    sk.save(state, "step_00000001", storage=store, signer=key)
    before = [name for name, _ in store.list_files("")]
    counter = FaultInjectingStore(store)
    sk.save(state, "probe", storage=counter, signer=key)
    store.remove_tree("probe")
    total = counter.operation_count
    assert total >= 8
    assert any(op.endswith("probe/manifest.sig") or "/manifest.sig" in op for op in counter.operations)
    signed_after_commit = 0
    for fail_at in range(1, total + 1):
        faulty = FaultInjectingStore(store, fail_at=fail_at)
        with pytest.raises(StorageError) as caught:
            sk.save(state, "step_00000002", storage=faulty, signer=key)
        assert (
            isinstance(caught.value, InjectedFault)
            or isinstance(caught.value.__cause__, InjectedFault)
            or ("injected" in str(caught.value))
        ), fail_at
        if "is committed, but writing its signature failed" in str(caught.value):
            # An object store signs after the create-only manifest: a failure there leaves the
            # checkpoint committed and unsigned, which readers requiring a signature refuse.
            assert not renames(store)
            assert sk.verify("step_00000002", storage=store).ok
            report = sk.verify("step_00000002", storage=store, public_key=key.public_key())
            assert "manifest.sig is missing" in report.problems[0]
            store.remove_tree("step_00000002")
            signed_after_commit += 1
        assert [name for name, _ in store.list_files("")] == before, fail_at
        assert sk.verify("step_00000001", storage=store, public_key=key.public_key()).ok
    assert signed_after_commit == (0 if renames(store) else 1)
