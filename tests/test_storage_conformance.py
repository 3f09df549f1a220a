"""One conformance suite for every byte-store backend (local filesystem, in-memory reference, and
fsspec against a real S3 server): every check of :mod:`shardkeep.testing.conformance` (the
contract of ``shardkeep.storage.base.ByteStore``, then save/load/verify through each store, then
an injected failure at every operation of a save through each store) runs on each store. Object
stores have no rename and no symlinks; the checks that need them say what an object store does
instead. The last tests show that the suite fails a store that breaks the contract."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from shardkeep.storage import EntryInfo, FsspecStore, LocalStore, WriteHandle
from shardkeep.storage.memory import MemoryStore
from shardkeep.testing import CHECKS, StoreUnderTest, check_store
from shardkeep.testing.conformance import files_are_create_only_and_read_back, unsafe_paths_are_refused


def _local(tmp_path: Path) -> StoreUnderTest:
    root = tmp_path / "root"
    root.mkdir()
    target = tmp_path / "outside.bin"
    target.write_bytes(b"outside")

    def make_special(path: str) -> None:
        link = root / path
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, link)

    return StoreUnderTest(LocalStore(root), make_special)


def _memory(tmp_path: Path) -> StoreUnderTest:
    store = MemoryStore()
    return StoreUnderTest(store, store.add_special)


def _s3(request: pytest.FixtureRequest) -> StoreUnderTest:
    root, options = request.getfixturevalue("s3_root")  # a fresh bucket, removed after the test
    return StoreUnderTest(FsspecStore(root, options), None)


BACKENDS = {"local": _local, "memory": _memory, "s3": _s3}


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> StoreUnderTest:
    return BACKENDS[request.param](request) if request.param == "s3" else BACKENDS[request.param](tmp_path)


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__)
def test_the_store_conforms(backend: StoreUnderTest, check: Callable[[StoreUnderTest], None]) -> None:
    check(backend)


class _Overwriting(MemoryStore):
    """Breaks the contract: a second ``open_write`` of a path replaces the file."""

    def open_write(self, path: str) -> WriteHandle:
        self.remove_tree(path)
        return super().open_write(path)


class _LaxPaths(MemoryStore):
    """Breaks the contract: ``stat`` of a path with a ``..`` component answers instead of refusing."""

    def stat(self, path: str) -> EntryInfo | None:
        return None if ".." in path else super().stat(path)


def test_a_store_that_overwrites_fails_the_create_only_check() -> None:
    with pytest.raises(AssertionError, match="CheckpointExistsError was not raised"):
        files_are_create_only_and_read_back(StoreUnderTest(_Overwriting()))


def test_a_store_that_answers_for_an_unsafe_path_fails_the_path_check() -> None:
    with pytest.raises(AssertionError, match=r"path '\.\./escape': UnsafePathError was not raised"):
        unsafe_paths_are_refused(StoreUnderTest(_LaxPaths()))


def test_check_store_names_each_failing_check_and_the_skipped_ones() -> None:
    with pytest.raises(AssertionError) as caught:
        check_store(lambda: StoreUnderTest(_Overwriting()))
    assert "files_are_create_only_and_read_back: CheckpointExistsError was not raised" in str(caught.value)
    assert "stat_and_listings" not in str(caught.value)
    assert check_store(lambda: StoreUnderTest(MemoryStore())) == ["symlinks_are_refused_never_followed"]


def test_the_suite_imports_without_pytest_and_the_old_paths_are_the_same_objects() -> None:
    program = (
        "import sys\n"
        "sys.modules['pytest'] = None  # a user without pytest\n"
        "import shardkeep.testing, shardkeep.storage, shardkeep.storage.faults\n"
        "assert shardkeep.storage.faults is shardkeep.testing.faults\n"
        "assert shardkeep.storage.FaultInjectingStore is shardkeep.testing.FaultInjectingStore\n"
        "assert 'FaultInjectingStore' not in shardkeep.storage.__all__\n"
    )
    subprocess.run([sys.executable, "-c", program], check=True)
