"""The storage conformance suite: the contract every byte store passes, runnable against your own.

A store passes when every check in :data:`CHECKS` returns. Each check takes a fresh, empty
:class:`StoreUnderTest` and raises ``AssertionError`` when the store breaks the contract of
:class:`shardkeep.storage.ByteStore`, or ``unittest.SkipTest`` when the check does not apply to
it (a store without symbolic links). The checks cover, in order: create-only files and reads,
``stat`` and the listings, ``put_atomic``, ``rename`` (or its refusal by a store without one),
``remove_tree``, unsafe paths, symbolic links, then a save, load and verify through the store,
and an injected failure at every operation of a save (:class:`~shardkeep.testing.FaultInjectingStore`),
which must commit nothing. The last two need torch.

With pytest (which shardkeep does not need; ``unittest.SkipTest`` is a pytest skip)::

    import pytest
    from shardkeep.testing import CHECKS, StoreUnderTest

    @pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__)
    def test_my_store_conforms(check, tmp_path):
        check(StoreUnderTest(MyStore(tmp_path / "root")))

Without a test runner, :func:`check_store` runs every check on a fresh store from a factory and
raises one ``AssertionError`` naming each check that failed.

The checks are plain ``assert`` statements: run them without ``python -O``. For pytest's detailed
assertion messages, call ``pytest.register_assert_rewrite("shardkeep.testing")`` before importing
this module (in a ``conftest.py``).
"""

from __future__ import annotations

import contextlib
import re
import unittest
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from shardkeep.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    StorageError,
    UnsafePathError,
    UnsupportedValueError,
)
from shardkeep.names import MANIFEST_FILENAME
from shardkeep.storage.base import ByteStore, renames
from shardkeep.testing.faults import FaultInjectingStore, InjectedFault
from shardkeep.verification import read_manifest, verify

__all__ = ["CHECKS", "UNSAFE_PATHS", "StoreUnderTest", "check_store"]

#: Paths every store refuses with ``UnsafePathError``, for every operation that takes a path.
UNSAFE_PATHS = ("../escape", "/absolute", "a\\b", "a/./b", "a//b", "nul\x00", "")


@dataclass(frozen=True)
class StoreUnderTest:
    """A fresh, empty store, and how to put a symbolic link (or what stands for one) into it.

    ``make_special(path)`` creates a special entry at ``path`` inside the store; leave it ``None``
    for a store that has none (an object store), and the symbolic-link check is skipped.
    """

    store: ByteStore
    make_special: Callable[[str], None] | None = None


@contextlib.contextmanager
def _raises(kind: type[BaseException], match: str | None = None) -> Iterator[None]:
    try:
        yield
    except kind as exc:
        if match is not None and not re.search(match, str(exc)):
            raise AssertionError(f"{type(exc).__name__} raised, but {str(exc)!r} does not match {match!r}") from exc
    else:
        raise AssertionError(f"{kind.__name__} was not raised")


def _write(store: ByteStore, path: str, data: bytes) -> None:
    handle = store.open_write(path)
    handle.write(data[: len(data) // 2])
    handle.write(memoryview(data)[len(data) // 2 :])
    handle.commit()


def _read(store: ByteStore, path: str) -> bytes:
    handle = store.open_read(path)
    try:
        buffer = bytearray(handle.size)
        handle.read_into(0, memoryview(buffer))
        return bytes(buffer)
    finally:
        handle.close()


def files_are_create_only_and_read_back(subject: StoreUnderTest) -> None:
    """A written file reads back whole, in parts and mapped; a second ``open_write`` is refused."""
    store = subject.store
    _write(store, "a/b/data.bin", b"0123456789")
    assert _read(store, "a/b/data.bin") == b"0123456789"
    with _raises(CheckpointExistsError):
        store.open_write("a/b/data.bin")
    assert _read(store, "a/b/data.bin") == b"0123456789"
    handle = store.open_read("a/b/data.bin")
    assert handle.size == 10
    mapped = handle.map()
    assert bytes(mapped) == b"0123456789"
    mapped[0] = ord("X")  # a private view: storage is unchanged
    part = bytearray(4)
    handle.read_into(3, memoryview(part))
    assert part == b"3456"
    with _raises(StorageError, match="end of file"):
        handle.read_into(8, memoryview(bytearray(4)))
    handle.close()
    assert _read(store, "a/b/data.bin") == b"0123456789"
    _write(store, "empty", b"")
    assert _read(store, "empty") == b""


def stat_and_listings(subject: StoreUnderTest) -> None:
    """``stat``, ``list_files`` and ``list_dir`` see files and directories, sorted; missing is ``None``
    for ``stat`` and ``CheckpointNotFoundError`` for the listings and reads."""
    store = subject.store
    _write(store, "ckpt/manifest.json", b"{}")
    _write(store, "ckpt/shards/rank_00000.safetensors", b"x" * 5)
    _write(store, "other.txt", b"hello")
    file_info = store.stat("ckpt/shards/rank_00000.safetensors")
    assert file_info is not None and (file_info.kind, file_info.size) == ("file", 5)
    dir_info = store.stat("ckpt/shards")
    assert dir_info is not None and dir_info.kind == "dir"
    assert store.stat("ckpt/missing") is None
    assert store.stat("missing/deeper") is None
    assert [(name, info.kind, info.size) for name, info in store.list_files("ckpt")] == [
        (MANIFEST_FILENAME, "file", 2),
        ("shards/rank_00000.safetensors", "file", 5),
    ]
    assert [(name, info.kind) for name, info in store.list_dir("")] == [("ckpt", "dir"), ("other.txt", "file")]
    assert [name for name, _ in store.list_dir("ckpt")] == [MANIFEST_FILENAME, "shards"]
    with _raises(CheckpointNotFoundError):
        store.list_files("missing")
    with _raises(CheckpointNotFoundError):
        store.open_read("ckpt/missing.bin")


def put_atomic_replaces_whole(subject: StoreUnderTest) -> None:
    """``put_atomic`` replaces a small file whole and leaves no temporary behind."""
    store = subject.store
    store.put_atomic("pointers/last", b'{"checkpoint": "step_1"}')
    store.put_atomic("pointers/last", b'{"checkpoint": "step_2"}')
    assert _read(store, "pointers/last") == b'{"checkpoint": "step_2"}'
    assert [name for name, _ in store.list_dir("pointers")] == ["last"]  # no temporary left behind


def rename_moves_a_tree_and_never_replaces(subject: StoreUnderTest) -> None:
    """``rename`` moves a whole tree and refuses an existing target; a store without an atomic
    rename says so with ``UnsupportedValueError`` and changes nothing."""
    store = subject.store
    if not renames(store):
        # An object store has no rename: it says so, and the commit protocol never asks for one.
        _write(store, "step_1.tmp-abc/shards/a", b"a")
        with _raises(UnsupportedValueError, match="no atomic rename"):
            store.rename("step_1.tmp-abc", "step_1")
        assert _read(store, "step_1.tmp-abc/shards/a") == b"a"
        store.sync_dir("")
        return
    _write(store, "step_1.tmp-abc/manifest.json", b"{}")
    _write(store, "step_1.tmp-abc/shards/a", b"a")
    store.sync_dir("step_1.tmp-abc")
    store.rename("step_1.tmp-abc", "step_1")
    assert store.stat("step_1.tmp-abc") is None
    assert [name for name, _ in store.list_files("step_1")] == [MANIFEST_FILENAME, "shards/a"]
    _write(store, "step_2/manifest.json", b"{}")
    with _raises(CheckpointExistsError):
        store.rename("step_2", "step_1")
    assert _read(store, "step_1/shards/a") == b"a"
    with _raises(CheckpointNotFoundError):
        store.rename("step_9", "step_10")
    store.sync_dir("")
    with _raises(CheckpointNotFoundError):
        store.sync_dir("missing")


def remove_tree(subject: StoreUnderTest) -> None:
    """``remove_tree`` removes a tree and nothing else; a missing tree is not an error."""
    store = subject.store
    _write(store, "doomed/a/b", b"1")
    _write(store, "doomed/c", b"2")
    _write(store, "kept", b"3")
    store.remove_tree("doomed")
    assert store.stat("doomed") is None
    assert [name for name, _ in store.list_dir("")] == ["kept"]
    store.remove_tree("doomed")  # missing is fine
    store.remove_tree("nothing/below")


def unsafe_paths_are_refused(subject: StoreUnderTest) -> None:
    """Every operation refuses each of :data:`UNSAFE_PATHS` with ``UnsafePathError``."""
    store = subject.store
    for bad in UNSAFE_PATHS:
        operations: list[Callable[[str], Any]] = [
            store.open_write,
            store.open_read,
            store.stat,
            lambda path: store.put_atomic(path, b"x"),
            lambda path: store.rename(path, "fine"),
            store.remove_tree,
        ]
        for operation in operations:
            try:
                with _raises(UnsafePathError):
                    operation(bad)
            except AssertionError as exc:
                raise AssertionError(f"path {bad!r}: {exc}") from exc


def symlinks_are_refused_never_followed(subject: StoreUnderTest) -> None:
    """A symbolic link (or special entry) is listed as ``other``, never read or written through,
    and ``remove_tree`` removes the link itself."""
    store = subject.store
    if subject.make_special is None:
        raise unittest.SkipTest("the store has no symlinks or special files")
    subject.make_special("ckpt/shards/rank_00000.safetensors")
    info = store.stat("ckpt/shards/rank_00000.safetensors")
    assert info is not None and info.kind == "other"
    with _raises(UnsafePathError):
        store.open_read("ckpt/shards/rank_00000.safetensors")
    assert [(name, info.kind) for name, info in store.list_files("ckpt")] == [
        ("shards/rank_00000.safetensors", "other")
    ]
    subject.make_special("linked_dir")
    with _raises(UnsafePathError):
        store.open_write("linked_dir/file")
    with _raises(UnsafePathError):
        store.open_read("linked_dir/file")
    store.remove_tree("linked_dir")  # removes the link itself
    assert store.stat("linked_dir") is None


def _small_state() -> dict[str, object]:
    import torch

    generator = torch.Generator().manual_seed(3)
    return {
        "weight": torch.randn(16, 8, generator=generator),
        "bias": torch.randn(8, generator=generator),
        "step": 12,
        "config": {"name": "tiny"},
    }


def save_load_verify_through_the_store(subject: StoreUnderTest) -> None:
    """A signed save through the store verifies, loads and reads back; a second save to the same
    name is refused. Needs torch."""
    import torch
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from shardkeep.api import load, save

    store = subject.store
    state = _small_state()
    key = Ed25519PrivateKey.generate()
    save(state, "step_00000012", storage=store, step=12, signer=key)
    assert verify("step_00000012", storage=store, public_key=key.public_key()).ok
    loaded = load("step_00000012", storage=store, public_key=key.public_key())
    assert torch.equal(loaded["weight"], state["weight"])  # type: ignore[arg-type]  # the state holds a tensor there
    assert loaded["config"] == {"name": "tiny"}
    assert read_manifest("step_00000012", storage=store).step == 12
    assert [name for name, _ in store.list_dir("")] == ["step_00000012"]
    with _raises(CheckpointExistsError):
        save(state, "step_00000012", storage=store)


def a_failure_at_every_operation_of_a_save_commits_nothing(subject: StoreUnderTest) -> None:
    """A signed save failing at each of its operations in turn raises a ``StorageError`` and
    leaves the store as it was (the signature is written before the manifest and removed on
    failure; an object store signs after its create-only manifest, so a failure there leaves the
    checkpoint committed and unsigned, which readers that require a signature refuse). Needs torch."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from shardkeep.api import save

    store = subject.store
    state = _small_state()
    key = Ed25519PrivateKey.generate()
    save(state, "step_00000001", storage=store, signer=key)
    before = [name for name, _ in store.list_files("")]
    counter = FaultInjectingStore(store)
    save(state, "probe", storage=counter, signer=key)
    store.remove_tree("probe")
    total = counter.operation_count
    assert total >= 8
    assert any(op.endswith("probe/manifest.sig") or "/manifest.sig" in op for op in counter.operations)
    signed_after_commit = 0
    for fail_at in range(1, total + 1):
        faulty = FaultInjectingStore(store, fail_at=fail_at)
        try:
            save(state, "step_00000002", storage=faulty, signer=key)
        except StorageError as exc:
            caught = exc
        else:
            raise AssertionError(f"a save failing at operation {fail_at} of {total} raised nothing")
        assert (
            isinstance(caught, InjectedFault)
            or isinstance(caught.__cause__, InjectedFault)
            or ("injected" in str(caught))
        ), fail_at
        if "is committed, but writing its signature failed" in str(caught):
            assert not renames(store)
            assert verify("step_00000002", storage=store).ok
            report = verify("step_00000002", storage=store, public_key=key.public_key())
            assert "manifest.sig is missing" in report.problems[0]
            store.remove_tree("step_00000002")
            signed_after_commit += 1
        assert [name for name, _ in store.list_files("")] == before, fail_at
        assert verify("step_00000001", storage=store, public_key=key.public_key()).ok
    assert signed_after_commit == (0 if renames(store) else 1)


#: Every check, in the order :func:`check_store` runs them.
CHECKS: tuple[Callable[[StoreUnderTest], None], ...] = (
    files_are_create_only_and_read_back,
    stat_and_listings,
    put_atomic_replaces_whole,
    rename_moves_a_tree_and_never_replaces,
    remove_tree,
    unsafe_paths_are_refused,
    symlinks_are_refused_never_followed,
    save_load_verify_through_the_store,
    a_failure_at_every_operation_of_a_save_commits_nothing,
)


def check_store(make: Callable[[], StoreUnderTest]) -> list[str]:
    """Run every check of :data:`CHECKS`, each on a fresh store from ``make()``.

    Returns:
        the names of the checks that did not apply (skipped).

    Raises:
        AssertionError: naming every check that failed (an assertion, or an unexpected error),
            with its message.
        RuntimeError: under ``python -O``, where ``assert`` statements do not run.
    """
    if not __debug__:
        raise RuntimeError("the conformance checks are assert statements: run them without python -O")
    failures: list[str] = []
    skipped: list[str] = []
    for check in CHECKS:
        try:
            check(make())
        except unittest.SkipTest:
            skipped.append(check.__name__)
        except AssertionError as exc:
            failures.append(f"{check.__name__}: {exc or 'assertion failed'}")
        except Exception as exc:
            failures.append(f"{check.__name__}: raised {type(exc).__name__}: {exc}")
    if failures:
        raise AssertionError("the store breaks the storage contract:\n" + "\n".join(failures))
    return skipped
