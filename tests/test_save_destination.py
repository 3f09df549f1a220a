"""What a save finds at its destination, and what it says: an empty directory is used (the
commit's rename replaces it atomically), anything else that is not a committed checkpoint is
refused with a message saying what is there, and a filesystem that refuses writes is reported
under the path the caller gave, not the internal staging name."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import shardkeep as sk
from shardkeep.cli import main
from shardkeep.storage import LocalStore, MemoryStore


def _state() -> dict[str, object]:
    return {"w": torch.arange(6.0), "step": 4}


@pytest.mark.parametrize("how", ["save", "async_save"])
def test_an_existing_empty_directory_becomes_the_checkpoint(tmp_path: Path, how: str) -> None:
    target = tmp_path / "step_00000004"
    target.mkdir()
    if how == "save":
        sk.save(_state(), target)
    else:
        sk.async_save(_state(), target).result(60)
    assert sk.verify(target).ok
    assert torch.equal(sk.load(target)["w"], torch.arange(6.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004"]  # no staging leftover
    with pytest.raises(sk.CheckpointExistsError, match="committed checkpoint"):
        sk.save(_state(), target)  # now it is a checkpoint: never overwritten


def test_the_manager_and_import_use_an_empty_directory(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "step_00000002").mkdir(parents=True)
    (root / "step_00000005").mkdir()
    code, out, err = _cli("ls", str(root))
    assert code == 2 and "empty" not in out and "no checkpoints" in err  # an empty directory is not a checkpoint
    manager = sk.CheckpointManager(root, keep_last=2, keep_best=0)
    manager.save({"w": torch.ones(3)}, step=2)
    assert sk.verify(root / "step_00000002").ok
    assert sorted(p.name for p in root.iterdir()) == ["last", "step_00000002", "step_00000005"]  # none moved aside
    code, out, _ = _cli("ls", str(root))
    assert code == 0 and "step_00000005" not in out, out
    source = tmp_path / "weights.safetensors"
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, str(source))
    dest = tmp_path / "imported"
    dest.mkdir()
    code, _, err = _cli("import", str(source), str(dest))
    assert code == 0, err
    assert sk.verify(dest).ok


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda p: (p.mkdir(), (p / "notes.txt").write_text("mine")), r"not a checkpoint.*notes\.txt"),
        (lambda p: p.write_text("a file"), r"is a file, not a checkpoint"),
        (lambda p: p.symlink_to(p.parent), r"symbolic link or special file"),
    ],
    ids=["non-empty directory", "file", "symlink"],
)
def test_a_destination_that_is_not_a_checkpoint_is_refused_saying_what_is_there(
    tmp_path: Path, make: object, expected: str
) -> None:
    target = tmp_path / "dest"
    make(target)  # type: ignore[operator]  # one of the callables above
    before = sorted(os.listdir(tmp_path))
    for attempt in (lambda: sk.save(_state(), target), lambda: sk.async_save(_state(), target).result(60)):
        with pytest.raises(sk.CheckpointExistsError, match=expected) as caught:
            attempt()
        assert "committed checkpoints are never overwritten" not in str(caught.value)
        assert str(target) in str(caught.value)
    assert sorted(os.listdir(tmp_path)) == before  # nothing left behind, nothing changed
    if target.is_dir() and not target.is_symlink():
        assert (target / "notes.txt").read_text() == "mine"


def test_a_committed_checkpoint_is_still_named_as_one(tmp_path: Path) -> None:
    sk.save(_state(), tmp_path / "c")
    with pytest.raises(sk.CheckpointExistsError, match=r"a committed checkpoint.*never overwritten"):
        sk.save(_state(), tmp_path / "c")


def test_memory_store_rename_replaces_only_an_empty_directory() -> None:
    """The store contract (rename(2)'s): a directory replaces an empty directory, nothing else."""
    store = MemoryStore()
    for name in ("src/a", "full/x", "other/y"):
        store.put_atomic(name, b"1")
    store.put_atomic("empty/x", b"1")
    store.remove_tree("empty/x")  # leaves the directory "empty"
    assert store.stat("empty") is not None and store.list_dir("empty") == []
    store.rename("src", "empty")
    assert store.stat("src") is None and [name for name, _ in store.list_dir("empty")] == ["a"]
    with pytest.raises(sk.CheckpointExistsError):
        store.rename("other", "full")
    with pytest.raises(sk.CheckpointExistsError):
        store.rename("other/y", "full/x")  # a file never replaces anything


def test_local_store_rename_replaces_only_an_empty_directory(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a").write_text("1")
    (tmp_path / "empty").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("1")
    (tmp_path / "afile").write_text("1")
    store.rename("src", "empty")
    assert (tmp_path / "empty" / "a").read_text() == "1" and not (tmp_path / "src").exists()
    for target in ("full", "afile"):
        with pytest.raises(sk.CheckpointExistsError):
            store.rename("empty", target)
    assert (tmp_path / "full" / "x").exists() and (tmp_path / "afile").read_text() == "1"


@contextlib.contextmanager
def _tmpfs_mount(directory: Path, *, read_only: bool = False) -> Iterator[Path]:
    """A real tmpfs (read-only with ``read_only``) mounted on the new empty ``directory``
    (root only; skipped where mount is not permitted), unmounted afterwards."""
    directory.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    options = "ro,size=1m" if read_only else "size=1m"
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "none", str(directory)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"mount is not permitted here: {done.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", str(directory)], check=True)


def _read_only_mount(directory: Path) -> contextlib.AbstractContextManager[Path]:
    """A real read-only filesystem (a tmpfs mounted ``ro``) at ``directory``."""
    return _tmpfs_mount(directory, read_only=True)


@pytest.mark.parametrize(
    ("how", "below"), [("save", ""), ("async_save", ""), ("save", "new/dirs/")], ids=["save", "async", "new-parents"]
)
def test_a_read_only_filesystem_is_reported_under_the_given_path(tmp_path: Path, how: str, below: str) -> None:
    with _read_only_mount(tmp_path / "ro") as mounted:
        target = mounted / f"{below}step_00000004"
        with pytest.raises(sk.StorageError) as caught:
            if how == "save":
                sk.save(_state(), target)
            else:
                sk.async_save(_state(), target).result(60)
        message = str(caught.value)
        assert str(target) in message and "read-only" in message.lower(), message
        assert ".tmp-" not in message, message  # the staging name is an internal detail
        chain = []
        error: BaseException | None = caught.value
        while error is not None:
            chain.append(error)
            error = error.__cause__
        assert any(getattr(e, "errno", None) == 30 for e in chain)  # EROFS, kept in the chain
        if not below:
            assert any(".tmp-" in str(e) for e in chain)  # the staging file, kept for debugging


def test_permission_denied_is_reported_under_the_given_path(tmp_path: Path) -> None:
    """EACCES: root without the capability to override file permissions (``setpriv`` drops it
    from the bounding set) saving into a directory owned by another user, mode 0755."""
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and util-linux's setpriv to save without the permission override")
    locked = tmp_path / "locked"
    locked.mkdir()
    os.chown(locked, 65534, 65534)
    locked.chmod(0o755)
    target = locked / "step_00000004"
    program = (
        "import sys, torch, shardkeep as sk\n"
        "try:\n"
        "    sk.save({'w': torch.ones(2)}, sys.argv[1])\n"
        "except sk.StorageError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run(
        [setpriv, "--bounding-set=-dac_override,-dac_read_search", sys.executable, "-c", program, str(target)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert str(target) in done.stdout and "permission denied" in done.stdout.lower(), done.stdout
    assert ".tmp-" not in done.stdout, done.stdout
    assert os.listdir(locked) == []


@pytest.mark.parametrize("how", ["save", "manager"])
def test_an_empty_mount_point_is_refused_before_anything_is_written(tmp_path: Path, how: str) -> None:
    with _tmpfs_mount(tmp_path / "step_00000004") as mounted:
        with pytest.raises(sk.CheckpointExistsError, match="mount point") as caught:
            if how == "save":
                sk.save(_state(), mounted)
            else:
                sk.CheckpointManager(tmp_path, keep_best=0).save(_state(), step=4)
        assert str(mounted) in str(caught.value) and ".tmp-" not in str(caught.value)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004"]  # nothing written beside it
        assert os.listdir(mounted) == []


def test_an_empty_directory_keeps_its_mode_owner_and_group(tmp_path: Path) -> None:
    target = tmp_path / "step_00000004"
    target.mkdir()
    if os.geteuid() == 0:
        os.chown(target, 65534, 65534)
    target.chmod(0o2770)
    before = target.stat()
    sk.save(_state(), target)
    after = target.stat()
    assert sk.verify(target).ok
    assert oct(after.st_mode & 0o7777) == oct(before.st_mode & 0o7777) == oct(0o2770)
    assert (after.st_uid, after.st_gid) == (before.st_uid, before.st_gid)
