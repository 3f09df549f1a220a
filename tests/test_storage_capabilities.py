"""The optional capabilities of a byte store (``root``, ``atomic_rename``, ``remove_file``,
``abort_uploads``): declared by every built-in store, given their defaults for a store from
elsewhere that implements only the operations, and such a store working everywhere a store is
accepted (save, load, verify, the manager and its retention)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import shardkeep as sk
from shardkeep.distributed.commit import CheckpointCommit, FilesystemCommit, ObjectStoreCommit
from shardkeep.storage import (
    ByteStore,
    EntryInfo,
    FsspecStore,
    LocalStore,
    MemoryStore,
    ReadHandle,
    StoreBase,
    StoreOperations,
    WriteHandle,
    adapt_store,
    renames,
)
from shardkeep.testing import FaultInjectingStore


class OperationsOnly:
    """A store from elsewhere: the nine operations, passed to ``inner``, and nothing more (no
    ``root``, no ``atomic_rename``, no ``remove_file``, no ``abort_uploads``, no
    ``__getattr__``)."""

    def __init__(self, inner: StoreOperations) -> None:
        self._inner = inner
        self.calls: list[str] = []

    def open_write(self, path: str) -> WriteHandle:
        self.calls.append("open_write")
        return self._inner.open_write(path)

    def open_read(self, path: str) -> ReadHandle:
        self.calls.append("open_read")
        return self._inner.open_read(path)

    def stat(self, path: str) -> EntryInfo | None:
        return self._inner.stat(path)

    def list_files(self, path: str) -> list[tuple[str, EntryInfo]]:
        return self._inner.list_files(path)

    def list_dir(self, path: str = "") -> list[tuple[str, EntryInfo]]:
        return self._inner.list_dir(path)

    def put_atomic(self, path: str, data: bytes) -> None:
        self._inner.put_atomic(path, data)

    def rename(self, src: str, dst: str) -> None:
        self.calls.append("rename")
        self._inner.rename(src, dst)

    def sync_dir(self, path: str) -> None:
        self._inner.sync_dir(path)

    def remove_tree(self, path: str) -> None:
        self.calls.append(f"remove_tree {path}")
        self._inner.remove_tree(path)


class WithoutRename(OperationsOnly):
    """A store from elsewhere that says it cannot rename (as the old protocol allowed)."""

    atomic_rename = False

    def rename(self, src: str, dst: str) -> None:
        raise AssertionError(f"rename({src!r}, {dst!r}) called on a store without rename")


def tiny(seed: int = 0) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(16, generator=generator), "layer": {"b": torch.arange(4)}, "step": seed}


def write_file(store: ByteStore, path: str, data: bytes) -> None:
    handle = store.open_write(path)
    handle.write(data)
    handle.commit()


# -- the built-in stores declare their capabilities ---------------------------------------------


@pytest.mark.parametrize("kind", ["local", "memory", "faulty-local", "fsspec-memory"])
def test_built_in_stores_declare_every_capability(kind: str, tmp_path: Path) -> None:
    if kind == "local":
        store: ByteStore = LocalStore(tmp_path)
        root, renaming = str(tmp_path), True
    elif kind == "memory":
        store = MemoryStore()
        root, renaming = repr(store), True
    elif kind == "faulty-local":
        store = FaultInjectingStore(LocalStore(tmp_path))
        root, renaming = str(tmp_path), True
    else:
        pytest.importorskip("fsspec")
        store = FsspecStore(f"memory://{tmp_path.name}/root")
        root, renaming = f"memory://{tmp_path.name}/root", False
    assert isinstance(store, StoreBase)
    assert adapt_store(store) is store  # nothing to adapt
    assert store.root == root
    assert store.atomic_rename is renaming and renames(store) is renaming
    write_file(store, "step_1/manifest.json", b"{}")
    store.remove_file("step_1/manifest.json")
    assert store.stat("step_1/manifest.json") is None
    store.remove_file("step_1/manifest.json")  # missing is fine
    assert store.abort_uploads("") == []  # no multipart uploads here


def test_a_fault_injecting_store_passes_capabilities_through_uncounted(tmp_path: Path) -> None:
    pytest.importorskip("fsspec")
    inner = FsspecStore(f"memory://{tmp_path.name}/root")
    store = FaultInjectingStore(inner, fail_at=1)
    assert store.root == inner.root and store.atomic_rename is False
    store.inner.put_atomic("step_1/manifest.json", b"{}")
    store.remove_file("step_1/manifest.json")  # would be operation 1 if it were counted
    assert store.abort_uploads("") == [] and store.operation_count == 0


# -- a store from elsewhere gets the defaults ---------------------------------------------------


def test_a_store_with_only_the_operations_gets_the_default_capabilities(tmp_path: Path) -> None:
    user = OperationsOnly(LocalStore(tmp_path))
    store = adapt_store(user)
    assert isinstance(store, StoreBase)
    assert adapt_store(user) is store  # one store, one adapter: identity comparisons still hold
    assert adapt_store(store) is store
    assert store.root == repr(user)
    assert store.atomic_rename is True and renames(user) is True
    assert store.abort_uploads("", older_than=0.0) == []
    write_file(store, "step_1/manifest.json", b"{}")
    store.remove_file("step_1/manifest.json")
    assert user.calls[-1] == "remove_tree step_1/manifest.json"  # the default: remove_tree
    assert not (tmp_path / "step_1" / "manifest.json").exists()


def test_capabilities_a_store_from_elsewhere_has_are_kept(tmp_path: Path) -> None:
    removed: list[str] = []

    class Declaring(WithoutRename):
        root = "custom://root"

        def remove_file(self, path: str) -> None:
            removed.append(path)
            self._inner.remove_tree(path)

        def abort_uploads(self, path: str = "", *, older_than: float = 0.0) -> list[str]:
            return [f"{path}upload-older-than-{older_than:g}"]

    store = adapt_store(Declaring(MemoryStore()))
    assert store.root == "custom://root" and store.atomic_rename is False
    write_file(store, "a", b"x")
    store.remove_file("a")
    assert removed == ["a"] and store.stat("a") is None
    assert store.abort_uploads("", older_than=5) == ["upload-older-than-5"]


def test_the_commit_protocol_follows_the_store_capability(tmp_path: Path) -> None:
    assert type(CheckpointCommit(LocalStore(tmp_path), "step_1")) is FilesystemCommit
    assert type(CheckpointCommit(adapt_store(WithoutRename(MemoryStore())), "step_1")) is ObjectStoreCommit
    pytest.importorskip("fsspec")
    assert type(CheckpointCommit(FsspecStore(f"memory://{tmp_path.name}/r"), "step_1")) is ObjectStoreCommit


# -- such a store works everywhere a store is accepted ------------------------------------------


@pytest.mark.parametrize("store_class", [OperationsOnly, WithoutRename])
def test_save_load_verify_through_a_store_with_only_the_operations(
    store_class: type[OperationsOnly], tmp_path: Path
) -> None:
    user = store_class(LocalStore(tmp_path) if store_class is OperationsOnly else MemoryStore())
    state = tiny(3)
    manifest = sk.save(state, "step_00000003", storage=user, step=3)  # type: ignore[arg-type]  # a store from elsewhere
    assert manifest.step == 3
    assert ("rename" in user.calls) is (store_class is OperationsOnly)
    loaded = sk.load("step_00000003", storage=user)  # type: ignore[arg-type]  # a store from elsewhere
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["layer"]["b"], state["layer"]["b"])
    report = sk.verify("step_00000003", storage=user)  # type: ignore[arg-type]  # a store from elsewhere
    assert report.ok, report
    with pytest.raises(sk.CheckpointExistsError):
        sk.save(state, "step_00000003", storage=user)  # type: ignore[arg-type]  # a store from elsewhere


def test_an_incremental_base_by_path_is_refused_for_a_store_without_a_root(tmp_path: Path) -> None:
    user = OperationsOnly(LocalStore(tmp_path))
    sk.save(tiny(1), "step_00000001", storage=user, step=1)  # type: ignore[arg-type]  # a store from elsewhere
    with pytest.raises(sk.UnsupportedValueError, match="same root"):
        sk.save(
            tiny(2),
            "step_00000002",
            storage=user,  # type: ignore[arg-type]  # a store from elsewhere
            step=2,
            incremental=str(tmp_path / "step_00000001"),
        )


@pytest.mark.parametrize("store_class", [OperationsOnly, WithoutRename])
def test_the_manager_keeps_last_and_best_through_a_store_with_only_the_operations(
    store_class: type[OperationsOnly], tmp_path: Path
) -> None:
    inner: StoreOperations = LocalStore(tmp_path) if store_class is OperationsOnly else MemoryStore()
    user = store_class(inner)
    manager = sk.CheckpointManager(
        "managed",
        storage=user,  # type: ignore[arg-type]  # a store from elsewhere
        keep_last=2,
        keep_best=1,
        staging_lease=0,
    )
    losses = [0.5, 0.1, 0.7, 0.9, 0.8]
    for step, loss in enumerate(losses):
        manager.save(tiny(step), step=step, metrics={"val_loss": loss})
    kept = sorted(entry.step for entry in manager.list())
    assert kept == [1, 3, 4]  # the best (step 1) and the last two
    committed = sorted(name for name, _ in inner.list_dir("") if name.startswith("step_") and "." not in name)
    on_store = [name for name in committed if inner.stat(f"{name}/manifest.json") is not None]
    assert on_store == ["step_00000001", "step_00000003", "step_00000004"]
    restored = manager.restore()
    assert restored.step == 4
    assert torch.equal(restored.state["w"], tiny(4)["w"])
    if store_class is WithoutRename:  # un-committed by removing the manifest: the default remove_file
        assert "remove_tree step_00000000/manifest.json" in user.calls
    manager.prune()  # retention and leftover collection again, on the store's capabilities
    assert sorted(entry.step for entry in manager.list()) == [1, 3, 4]
