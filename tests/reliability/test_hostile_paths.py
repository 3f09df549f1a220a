"""A corpus of hostile paths: manifest paths that climb out, absolute
paths, NUL and backslash; symlinks (to a shard, the shards directory, the manifest, the
signature, the checkpoint itself); FIFOs, device files and sockets in place of files; tier
locations that point elsewhere; hostile checkpoint names on save. Every case must be refused by
every API, and nothing outside the root may be opened or changed.

Every access outside the root is observed with inotify (open and read events on the outside
directory and everything in it). The outside directory holds byte-identical copies of the
checkpoint's files under the names a followed symlink would reach, so following one would
succeed (and be seen), not fail by accident.
"""

from __future__ import annotations

import ctypes
import hashlib
import io
import os
import shutil
import socket
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import shardkeep as sk
from shardkeep.cli import main
from tests.support.disk import reseal
from tests.support.figures import record

OUTSIDE_NAME = "OUTSIDE-SECRET"


class _Watch:
    """inotify on a directory tree: counts open and read events (Linux)."""

    IN_ACCESS, IN_OPEN, IN_NONBLOCK = 0x1, 0x20, 0o4000

    def __init__(self, root: Path) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(self.IN_NONBLOCK)
        assert self.fd >= 0, os.strerror(ctypes.get_errno())
        for directory in [root, *(p for p in root.rglob("*") if p.is_dir() and not p.is_symlink())]:
            wd = self._libc.inotify_add_watch(self.fd, os.fsencode(directory), self.IN_OPEN | self.IN_ACCESS)
            assert wd >= 0, os.strerror(ctypes.get_errno())

    def events(self) -> int:
        """Bytes of events since the last call (0: nothing outside was opened or read)."""
        total = 0
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                return total
            total += len(chunk)

    def close(self) -> None:
        os.close(self.fd)


def _snapshot(directory: Path) -> dict[str, str]:
    found = {}
    for path in sorted(directory.rglob("*")):
        info = path.lstat()
        if stat.S_ISREG(info.st_mode):
            found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest() + f"@{info.st_mtime_ns}"
        else:
            found[str(path)] = f"{stat.S_IFMT(info.st_mode)}@{info.st_mtime_ns}"
    return found


def _set_path(value: str) -> Callable[[Path, Path], None]:
    """A manifest path; ``{outside}`` stands for the outside directory."""

    def damage(checkpoint: Path, outside: Path) -> None:
        reseal(checkpoint, lambda raw: raw["files"][0].__setitem__("path", value.format(outside=outside)))

    return damage


def _set_ref(value: str) -> Callable[[Path, Path], None]:
    def damage(checkpoint: Path, outside: Path) -> None:
        reseal(checkpoint, lambda raw: raw["files"][0].__setitem__("ref", value))

    return damage


def _replace(relative: str, make: Callable[[Path, Path], None]) -> Callable[[Path, Path], None]:
    def damage(checkpoint: Path, outside: Path) -> None:
        target = checkpoint / relative
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        else:
            target.unlink()
        make(target, outside)

    return damage


def _symlink_to(name: str) -> Callable[[Path, Path], None]:
    return lambda target, outside: target.symlink_to(outside / name)


def _fifo(target: Path, outside: Path) -> None:
    os.mkfifo(target)


def _device(target: Path, outside: Path) -> None:
    os.mknod(target, 0o644 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero


def _socket(target: Path, outside: Path) -> None:
    server = socket.socket(socket.AF_UNIX)
    here = os.getcwd()
    os.chdir(target.parent)  # a socket path is limited to ~100 bytes: bind relative to its directory
    try:
        server.bind(target.name)
    finally:
        os.chdir(here)
        server.close()


def _tier_elsewhere(location: str) -> Callable[[Path, Path], None]:
    def damage(checkpoint: Path, outside: Path) -> None:
        def mutate(raw: dict[str, Any]) -> None:
            raw["tiers"] = [{"tier_id": 1, "name": "default", "location": location.format(outside=outside)}]

        reseal(checkpoint, mutate)

    return damage


SHARD = "shards/rank_00000.safetensors"
CASES: dict[str, Callable[[Path, Path], None]] = {
    "path ../": _set_path(f"../../../outside/{OUTSIDE_NAME}.safetensors"),
    "path ../../": _set_path(f"shards/../../../../outside/{OUTSIDE_NAME}.safetensors"),
    "path absolute": _set_path("/etc/passwd"),
    "path absolute outside": _set_path(f"{{outside}}/{OUTSIDE_NAME}.safetensors"),
    "path with NUL": _set_path("shards/rank\x00.safetensors"),
    "path with backslash": _set_path("shards\\..\\..\\x"),
    "path empty component": _set_path("shards//rank_00000.safetensors"),
    "path .": _set_path("./shards/rank_00000.safetensors"),
    "path drive letter": _set_path("C:/x.safetensors"),
    "ref ..": _set_ref(".."),
    "ref climbing": _set_ref("../../../outside"),
    "tier location http": _tier_elsewhere("http://127.0.0.1:9/x"),
    "tier location ..": _tier_elsewhere("{outside}/../x"),
    "tier location relative": _tier_elsewhere("outside"),
    "shard symlink": _replace(SHARD, _symlink_to(SHARD)),
    "shards dir symlink": _replace("shards", _symlink_to("shards")),
    "manifest symlink": _replace("manifest.json", _symlink_to("manifest.json")),
    "signature symlink": _replace("manifest.sig", _symlink_to("manifest.sig")),
    "shard FIFO": _replace(SHARD, _fifo),
    "manifest FIFO": _replace("manifest.json", _fifo),
    "shard device file": _replace(SHARD, _device),
    "shard socket": _replace(SHARD, _socket),
}


class _Refused(Exception):
    """An API that reports instead of raising (verify, the CLI) refused the input."""


def _apis(checkpoint: Path, root: Path, key: Any) -> dict[str, Callable[[], Any]]:
    quiet = {"out": io.StringIO(), "err": io.StringIO()}

    def verify_refuses(**options: Any) -> Callable[[], None]:
        def run() -> None:
            if sk.verify(checkpoint, **options).ok:
                raise AssertionError("verify accepted it")
            raise _Refused

        return run

    def cli(*args: str) -> Callable[[], None]:
        def run() -> None:
            if main(list(args), **quiet) == 0:
                raise AssertionError(f"shardkeep {' '.join(args)} exited 0")
            raise _Refused

        return run

    return {
        "load": lambda: sk.load(checkpoint),
        "load with key": lambda: sk.load(checkpoint, public_key=key.public_key()),
        "load lazy": lambda: sk.load(checkpoint, select=sk.LoadSelection(lazy=True))["w"] + 1,
        "load without verify": lambda: sk.load(checkpoint, verify=False),
        "verify": verify_refuses(),
        "verify with key": verify_refuses(public_key=key.public_key()),
        "manager restore": lambda: sk.CheckpointManager(root).restore(),
        "cli verify": cli("verify", str(checkpoint)),
    }


def test_the_hostile_path_corpus_is_refused_without_touching_anything_outside(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    outside = tmp_path / "outside"
    pristine = tmp_path / "pristine" / "step_00000001"
    sk.save({"w": torch.arange(4.0), "step": 1}, pristine, signer=key, step=1)
    # Byte-identical copies outside: the same layout (what a followed symlink reaches) and the
    # names the hostile manifest paths point at.
    shutil.copytree(pristine, outside)
    shutil.copy(pristine / SHARD, outside / f"{OUTSIDE_NAME}.safetensors")
    before = _snapshot(outside)
    watch = _Watch(outside)
    watch.events()

    accepted: list[str] = []
    reads_outside: list[str] = []
    trials = 0
    for case, damage in CASES.items():
        root = tmp_path / "cases" / case.replace(" ", "_").replace(".", "dot")
        checkpoint = root / "step_00000001"
        shutil.copytree(pristine, checkpoint, symlinks=True)
        try:
            damage(checkpoint, outside)
        except PermissionError:
            pytest.fail(f"cannot build case {case!r} here (mknod needs root)")
        watch.events()  # building the case may look at the outside directory
        for api, call in _apis(checkpoint, root, key).items():
            trials += 1
            try:
                call()
            except (sk.ShardkeepError, _Refused):
                pass
            except AssertionError as exc:
                accepted.append(f"{case} / {api}: {exc}")
            else:
                # An unverified load without a key never consults the signature, so a symlinked
                # manifest.sig is not read at all (inotify below proves it): the load is right.
                if (case, api) != ("signature symlink", "load without verify"):
                    accepted.append(f"{case} / {api}: accepted")
            if watch.events():
                reads_outside.append(f"{case} / {api}")
    watch.close()

    # Saving under hostile names never writes outside the root.
    from shardkeep.storage import LocalStore

    store = LocalStore(tmp_path / "saveroot")
    for name in ["../escape", "a/../../escape", "/abs", "x\x00y", "..", "a\\b"]:
        trials += 1
        try:
            sk.save({"w": torch.zeros(1)}, name, storage=store)
            accepted.append(f"save as {name!r}: accepted")
        except sk.ShardkeepError:
            pass
    assert not (tmp_path / "escape").exists()

    record(
        "hostile paths",
        trials=trials,
        failures=len(accepted) + len(reads_outside) + (before != _snapshot(outside)),
        detail=f"{len(CASES)} hostile checkpoints x {len(_apis(pristine, pristine.parent, key))} APIs (load, load with "
        "key, lazy load, load without verify, verify, verify with key, manager restore, CLI verify) + 6 hostile names "
        f"on save; accesses outside the root seen by inotify: {len(reads_outside)}",
    )
    assert accepted == []
    assert reads_outside == []
    assert _snapshot(outside) == before
