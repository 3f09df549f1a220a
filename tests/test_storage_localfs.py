"""The local durability protocols of shardkeep.storage.localfs, each run on the real filesystem
and on a LocalFS whose steps are recorded or fail, substituted with ``localfs.using``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shardkeep.storage import localfs
from shardkeep.storage.localfs import ExchangeUnsupported, LocalFS


class Recording(LocalFS):
    """Records every step; ``fail_on`` makes the named step raise ``OSError(EIO)`` instead."""

    def __init__(self, fail_on: str | None = None, exchange: bool = True) -> None:
        self.steps: list[tuple[str, ...]] = []
        self.fail_on = fail_on
        self.can_exchange = exchange

    def _step(self, name: str, *paths: str) -> None:
        self.steps.append((name, *(os.path.basename(path) for path in paths)))
        if name == self.fail_on:
            raise OSError(5, f"simulated failure of {name}")

    def rename(self, source: str, destination: str) -> None:
        self._step("rename", source, destination)
        super().rename(source, destination)

    def replace(self, source: str, destination: str) -> None:
        self._step("replace", source, destination)
        super().replace(source, destination)

    def rename_noreplace(self, source: str, destination: str) -> None:
        self._step("rename_noreplace", source, destination)
        super().rename_noreplace(source, destination)

    def exchange(self, source: str, destination: str) -> None:
        if not self.can_exchange:
            raise ExchangeUnsupported(22, "not on this filesystem")
        self._step("exchange", source, destination)
        super().exchange(source, destination)

    def fsync_directory(self, path: str) -> None:
        self._step("fsync_directory", path)
        super().fsync_directory(path)

    def fsync_file(self, path: str) -> None:
        self._step("fsync_file", path)
        super().fsync_file(path)

    def mkdir(self, path: str, mode: int = 0o755) -> None:
        self._step("mkdir", path)
        super().mkdir(path, mode)

    def remove_tree(self, path: str) -> bool:
        self._step("remove_tree", path)
        return super().remove_tree(path)

    def names(self) -> list[str]:
        return [step[0] for step in self.steps]


def exchange_works(directory: Path) -> bool:
    first, second = directory / "probe_a", directory / "probe_b"
    first.mkdir()
    second.mkdir()
    try:
        localfs.exchange_paths(str(first), str(second))
    except ExchangeUnsupported:
        return False
    finally:
        first.rmdir()
        second.rmdir()
    return True


def test_write_file_atomic_replaces_the_file_and_syncs_its_directory_after_the_rename(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    target.write_bytes(b"old")
    fs = Recording()
    with localfs.using(fs):
        localfs.write_file_atomic(target, b"new contents")
    assert target.read_bytes() == b"new contents"
    assert os.listdir(tmp_path) == ["state.json"]
    assert fs.names() == ["replace", "fsync_directory"]
    assert fs.steps[0][1].startswith(".state.json.tmp-")


def test_write_file_atomic_with_a_writer_function_fsyncs_the_file_it_wrote(tmp_path: Path) -> None:
    fs = Recording()
    written: list[str] = []

    def write(path: str) -> None:
        written.append(path)
        with open(path, "wb") as handle:
            handle.write(b"by the function")

    fs.write_file_atomic(tmp_path / "out.pt", write)
    assert (tmp_path / "out.pt").read_bytes() == b"by the function"
    assert fs.names() == ["fsync_file", "replace", "fsync_directory"]
    assert os.path.dirname(written[0]) == str(tmp_path)


@pytest.mark.parametrize("failing", ["replace", "fsync_file", "writer"])
def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary(tmp_path: Path, failing: str) -> None:
    target = tmp_path / "model.safetensors"
    target.write_bytes(b"old")

    def write(path: str) -> None:
        Path(path).write_bytes(b"half")
        if failing == "writer":
            raise RuntimeError("the writer failed")

    with pytest.raises((OSError, RuntimeError)):
        Recording(fail_on=failing).write_file_atomic(target, write)
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["model.safetensors"]


def test_write_file_atomic_without_overwrite_never_replaces(tmp_path: Path) -> None:
    target = tmp_path / "key.pem"
    localfs.write_file_atomic(target, b"first", mode=0o600, overwrite=False)
    assert target.read_bytes() == b"first"
    assert target.stat().st_mode & 0o077 == 0
    with pytest.raises(FileExistsError):
        localfs.write_file_atomic(target, b"second", overwrite=False)
    assert target.read_bytes() == b"first"
    assert os.listdir(tmp_path) == ["key.pem"]


def test_makedirs_durable_syncs_the_parent_of_every_directory_it_makes(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    fs = Recording()
    fs.makedirs_durable(tmp_path / "a" / "b" / "c")
    assert (tmp_path / "a" / "b" / "c").is_dir()
    assert fs.steps == [("mkdir", "b"), ("fsync_directory", "a"), ("mkdir", "c"), ("fsync_directory", "b")]
    fs.steps.clear()
    fs.makedirs_durable(tmp_path / "a" / "b")
    assert fs.steps == []


def test_makedirs_durable_refuses_a_file_in_the_way(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(OSError):
        localfs.makedirs_durable(tmp_path / "file" / "below")


def folder(path: Path, value: str) -> Path:
    path.mkdir()
    (path / "value").write_text(value)
    return path


def test_replace_dir_to_a_free_name_never_replaces(tmp_path: Path) -> None:
    staging = folder(tmp_path / "staging", "new")
    fs = Recording()
    assert fs.replace_dir(str(staging), str(tmp_path / "target")) is None
    assert (tmp_path / "target" / "value").read_text() == "new"
    assert fs.names() == ["rename_noreplace", "fsync_directory"]


def test_replace_dir_exchanges_so_the_target_is_never_missing(tmp_path: Path) -> None:
    if not exchange_works(tmp_path):
        pytest.skip("RENAME_EXCHANGE is not supported here")
    folder(tmp_path / "target", "old")
    staging = folder(tmp_path / "staging", "new")
    fs = Recording()
    old = fs.replace_dir(str(staging), str(tmp_path / "target"))
    assert old == str(staging) and (staging / "value").read_text() == "old"
    assert (tmp_path / "target" / "value").read_text() == "new"
    assert fs.names() == ["exchange", "fsync_directory"]


def test_replace_dir_without_exchange_takes_two_renames(tmp_path: Path) -> None:
    folder(tmp_path / "target", "old")
    staging = folder(tmp_path / "staging", "new")
    fs = Recording(exchange=False)
    old = fs.replace_dir(str(staging), str(tmp_path / "target"))
    assert old is not None and os.path.basename(old).startswith(".target.old-")
    assert (Path(old) / "value").read_text() == "old"
    assert (tmp_path / "target" / "value").read_text() == "new"
    assert fs.names() == ["rename", "rename", "fsync_directory"]


def test_replace_dir_puts_the_old_directory_back_when_the_second_rename_fails(tmp_path: Path) -> None:
    folder(tmp_path / "target", "old")
    staging = folder(tmp_path / "staging", "new")

    class SecondRenameFails(Recording):
        def rename(self, source: str, destination: str) -> None:
            if os.path.basename(source) == "staging":
                raise OSError(5, "simulated")
            super().rename(source, destination)

    with pytest.raises(OSError):
        SecondRenameFails(exchange=False).replace_dir(str(staging), str(tmp_path / "target"))
    assert (tmp_path / "target" / "value").read_text() == "old"
    assert (staging / "value").read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["staging", "target"]

    aside = str(tmp_path / "aside")
    with pytest.raises(OSError):  # without restore: the window's state, for the caller's recovery
        SecondRenameFails(exchange=False).replace_dir(
            str(staging), str(tmp_path / "target"), aside=aside, restore=False
        )
    assert sorted(os.listdir(tmp_path)) == ["aside", "staging"]
    assert (Path(aside) / "value").read_text() == "old" and (staging / "value").read_text() == "new"


def test_retire_and_remove_renames_a_directory_aside_durably_before_removing_it(tmp_path: Path) -> None:
    doomed = folder(tmp_path / "step_1", "x")
    fs = Recording()
    assert fs.retire_and_remove(str(doomed)) is True
    assert os.listdir(tmp_path) == []
    assert fs.names() == ["rename_noreplace", "fsync_directory", "remove_tree"]
    assert fs.steps[0][2].startswith("step_1.deleting-")


def test_a_crash_while_removing_leaves_only_the_marker_name(tmp_path: Path) -> None:
    doomed = folder(tmp_path / "step_1", "x")
    with pytest.raises(OSError):
        Recording(fail_on="remove_tree").retire_and_remove(str(doomed), ".gone-")
    (left,) = os.listdir(tmp_path)
    assert left.startswith("step_1.gone-")


def test_retire_and_remove_of_a_file_a_symlink_or_nothing(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"x")
    target = folder(tmp_path / "kept", "x")
    (tmp_path / "link").symlink_to(target)
    assert localfs.retire_and_remove(str(tmp_path / "file")) is True
    assert localfs.retire_and_remove(str(tmp_path / "link")) is True
    assert localfs.retire_and_remove(str(tmp_path / "absent")) is False
    assert os.listdir(tmp_path) == ["kept"] and (target / "value").exists()


def test_remove_idle_removes_only_matching_leftovers_older_than_the_lease(tmp_path: Path) -> None:
    old = folder(tmp_path / "a.tmp-1", "x")
    fresh = folder(tmp_path / "b.tmp-2", "x")
    folder(tmp_path / "keep", "x")
    now = 10_000.0
    for path in (old, old / "value", tmp_path / "keep"):
        os.utime(path, (now - 100, now - 100))
    os.utime(fresh, (now - 100, now - 100))
    os.utime(fresh / "value", (now - 1, now - 1))  # something below it changed within the lease
    removed = localfs.remove_idle(tmp_path, lambda name: ".tmp-" in name, 60, now=now)
    assert removed == ["a.tmp-1"]
    assert sorted(os.listdir(tmp_path)) == ["b.tmp-2", "keep"]


def test_remove_idle_of_a_missing_directory_or_a_symlink_to_one(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    folder(real / "x.tmp-1", "x")
    (tmp_path / "link").symlink_to(real)
    assert localfs.remove_idle(tmp_path / "absent", lambda name: True, 0) == []
    assert localfs.remove_idle(tmp_path / "link", lambda name: True, 0) == []
    assert os.listdir(real) == ["x.tmp-1"]


def test_using_substitutes_the_filesystem_of_the_module_functions_for_the_block(tmp_path: Path) -> None:
    fs = Recording()
    with localfs.using(fs) as installed:
        assert installed is fs and localfs.current() is fs
        localfs.fsync_directory_path(str(tmp_path))
    assert localfs.current() is localfs.LOCAL
    localfs.fsync_directory_path(str(tmp_path))
    assert fs.names() == ["fsync_directory"]


def test_the_old_import_path_names_the_same_functions() -> None:
    from shardkeep.storage import local

    assert local.exchange_paths is localfs.exchange_paths
    assert local.rename_noreplace_path is localfs.rename_noreplace_path
    assert local.fsync_directory_path is localfs.fsync_directory_path
    assert local.ExchangeUnsupported is localfs.ExchangeUnsupported


def test_write_new_file_never_replaces_and_is_the_step_of_an_atomic_write(tmp_path: Path) -> None:
    localfs.LOCAL.write_new_file(tmp_path / "ledger.json", b"one")
    with pytest.raises(FileExistsError):
        localfs.LOCAL.write_new_file(tmp_path / "ledger.json", b"two")
    assert (tmp_path / "ledger.json").read_bytes() == b"one"

    class ShortDisk(LocalFS):
        def write_new_file(self, path: str | os.PathLike[str], data: object, *, mode: int = 0o644) -> None:
            Path(path).write_bytes(b"sh")
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        ShortDisk().write_file_atomic(tmp_path / "ledger.json", b"three")
    assert (tmp_path / "ledger.json").read_bytes() == b"one"
    assert os.listdir(tmp_path) == ["ledger.json"]


def test_retire_to_a_given_name_never_replaces(tmp_path: Path) -> None:
    folder(tmp_path / "a", "x")
    folder(tmp_path / "taken", "y")
    with pytest.raises(FileExistsError):
        localfs.LOCAL.retire(str(tmp_path / "a"), aside=str(tmp_path / "taken"))
    moved = localfs.LOCAL.retire(str(tmp_path / "a"), aside=str(tmp_path / ".tag.del-1"))
    assert moved == str(tmp_path / ".tag.del-1") and sorted(os.listdir(tmp_path)) == [".tag.del-1", "taken"]


def test_link_gives_a_second_name(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"x")
    localfs.LOCAL.link(str(tmp_path / "a"), str(tmp_path / "b"))
    assert (tmp_path / "a").stat().st_ino == (tmp_path / "b").stat().st_ino


def test_makedirs_durable_refuses_a_file_at_the_path(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(FileExistsError):
        localfs.makedirs_durable(tmp_path / "file")
