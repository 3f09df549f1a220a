"""Exception mapping: every third-party error that can reach the public API arrives as a
:class:`~shardkeep.errors.ShardkeepError` subclass, in the style of httpx's ``test_exceptions.py``.

Each case drives one failure from below (an ``OSError`` from the kernel, a ``msgspec``, ``json``,
``zstandard``, ``cryptography``, ``safetensors``, ``yaml`` or ``torch`` error) through a public
entry point (``save``, ``async_save``, ``load``, ``verify``, ``read_manifest``,
``CheckpointManager``, ``ProgressLedger``, ``import_checkpoint``, ``TrainingCheckpoint``) and
checks four things: the exact ``ShardkeepError`` subclass; the original error somewhere in the
``__cause__`` chain where one error maps to one error (problems that ``load`` and ``verify``
gather from many files are strings, with no single cause); a message naming the path or key;
and, where it applies, that nothing was lost (no staging directory left, the previous checkpoint
or ledger version intact, ``into=`` untouched).

OS errors are raised at the syscall (``os.write``, ``os.open`` ... patched for one path), the
lowest layer the library calls; a real ``EFBIG`` comes from ``RLIMIT_FSIZE`` in a subprocess, and
real ``EACCES`` from ``chmod`` (skipped as root, which ignores permission bits). A case marked
``xfail(strict=True, raises=...)`` is a known leak in a module this file does not own; its
reason names the place and the fix.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import yaml
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors import SafetensorError

import shardkeep as sk
from shardkeep.integrity import PASSPHRASE_ENV, digest_bytes
from tests.support.disk import reseal


def _permission_bits_enforced() -> bool:
    """Whether ``chmod`` can deny this process anything: not as root (``os.geteuid() == 0``),
    unless root runs without ``CAP_DAC_OVERRIDE`` (``setpriv --inh-caps=-dac_override ...``)."""
    if os.geteuid() != 0:
        return True
    with tempfile.TemporaryDirectory() as directory:
        os.chmod(directory, 0)
        try:
            os.listdir(directory)
        except PermissionError:
            return True
        finally:
            os.chmod(directory, 0o700)
    return False


ROOT_IGNORES_PERMISSIONS = pytest.mark.skipif(
    not _permission_bits_enforced(),
    reason="root ignores permission bits; the simulated EACCES cases cover these paths",
)


# --------------------------------------------------------------------------------------------
# Failing one syscall for one path


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def _target_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The absolute path a patched ``os`` call acts on (a descriptor, or a name relative to
    ``dir_fd``, as the local store opens every component)."""
    first = args[0]
    if isinstance(first, int):
        return _fd_path(first)
    name = os.fsdecode(first)
    dir_fd = kwargs.get("dir_fd")
    return os.path.join(_fd_path(dir_fd), name) if dir_fd is not None and not os.path.isabs(name) else name


def fail_syscall(monkeypatch: pytest.MonkeyPatch, call: str, code: int, when: Callable[[str], bool]) -> None:
    """Make ``os.<call>`` raise ``OSError(code)`` (its subclass: ``PermissionError`` for
    ``EACCES`` ...) whenever the path it acts on satisfies ``when``; other calls run as usual.
    ``"write"`` fails ``os.pwrite`` too: the local store writes data files at explicit offsets."""
    for name in ("write", "pwrite") if call == "write" else (call,):
        real = getattr(os, name)

        def failing(*args: Any, real: Any = real, **kwargs: Any) -> Any:
            if when(_target_of(args, kwargs)):
                raise OSError(code, os.strerror(code))
            return real(*args, **kwargs)

        monkeypatch.setattr(os, name, failing)


def under(path: Path) -> Callable[[str], bool]:
    return lambda target: target == str(path) or target.startswith(f"{path}/")


def named(path: Path) -> Callable[[str], bool]:
    return lambda target: target == str(path)


def staging_of(checkpoint: Path) -> Callable[[str], bool]:
    return lambda target: f"/{checkpoint.name}.tmp-" in target


# --------------------------------------------------------------------------------------------
# Checkpoints to damage


def small_state() -> dict[str, Any]:
    return {"w": torch.arange(4096, dtype=torch.float32).reshape(64, 64), "step": 3}


def saved(tmp: Path, name: str = "ckpt", **options: Any) -> Path:
    path = tmp / name
    sk.save(small_state(), path, **options)
    return path


def shard_of(checkpoint: Path) -> Path:
    return next(path for path in sorted((checkpoint / "shards").rglob("*")) if path.is_file())


def rewrite_shard(checkpoint: Path, mutate: Callable[[bytearray], bytes | bytearray]) -> None:
    """Replace the data file's bytes and re-record its size and digest in the re-sealed manifest,
    as anyone who can write the directory could: only the shard's own checks can catch it."""
    shard = shard_of(checkpoint)
    data = bytes(mutate(bytearray(shard.read_bytes())))
    shard.chmod(0o644)
    shard.write_bytes(data)

    def record(raw: dict[str, Any]) -> None:
        entry = raw["files"][0]
        if entry.get("compression"):
            entry["compression"]["stored_size"] = len(data)  # the digest is of the uncompressed bytes
        else:
            entry["size"] = len(data)
            entry["digest"] = digest_bytes("blake3", data)

    reseal(checkpoint, record)


def with_header(text: str) -> Callable[[bytearray], bytearray]:
    """A shard mutation: its safetensors JSON header replaced by ``text`` (ASCII), padded to the
    same length so that every offset stays where the manifest says."""

    def mutate(data: bytearray) -> bytearray:
        (length,) = struct.unpack("<Q", data[:8])
        assert len(text) <= length
        data[8 : 8 + length] = text.ljust(length).encode("ascii")
        return data

    return mutate


def with_header_length(length: int) -> Callable[[bytearray], bytearray]:
    return lambda data: bytearray(struct.pack("<Q", length)) + data[8:]


def flip_byte(index: int) -> Callable[[bytearray], bytearray]:
    def mutate(data: bytearray) -> bytearray:
        data[index] ^= 0xFF
        return data

    return mutate


def reserved_block_type(data: bytearray) -> bytearray:
    """The zstd frame's first block header marked with the reserved block type (3), which every
    decoder refuses, past a frame header left intact (RFC 8878, 3.1.1.1 and 3.1.1.2)."""
    descriptor = data[4]
    single_segment = bool(descriptor & 0x20)
    content_size_bytes = (1 if single_segment else 0, 2, 4, 8)[descriptor >> 6]
    header = 5 + (0 if single_segment else 1) + (0, 1, 2, 4)[descriptor & 0x03] + content_size_bytes
    data[header] |= 0b110
    return data


HEADER_OF_W = '"w":{"dtype":"F32","shape":[64,64],"data_offsets":[0,16384]}'


def write_sealed_manifest(checkpoint: Path, body: bytes) -> None:
    from shardkeep.integrity import seal_manifest

    (checkpoint / "manifest.json").chmod(0o644)
    (checkpoint / "manifest.json").write_bytes(seal_manifest(body, "blake3"))


def reseal_ledger(raw: bytes) -> bytes:
    """An edited ledger file with its checksum recomputed (the checksum detects damage, not
    tampering)."""
    match = re.match(rb'\{"checksum":"blake3:([0-9a-f]{64})"', raw)
    assert match is not None
    blanked = raw[: match.start(1)] + b"0" * 64 + raw[match.end(1) :]
    digest: bytes = digest_bytes("blake3", blanked).split(":", 1)[1].encode()
    return raw[: match.start(1)] + digest + raw[match.end(1) :]


def pem_file(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def private_pem(key: Any, encryption: serialization.KeySerializationEncryption | None = None) -> bytes:
    """A private key of any algorithm as PKCS#8 PEM (encrypted with ``encryption``)."""
    pem: bytes = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption or serialization.NoEncryption()
    )
    return pem


def public_pem(key: Any) -> bytes:
    """The public half of a private key of any algorithm as SubjectPublicKeyInfo PEM."""
    pem: bytes = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return pem


def quietly(build: Callable[[], Any]) -> Any:
    """``build()`` with torch's beta and deprecation warnings silenced (warnings are errors here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build()


class WrapperTensor(torch.Tensor):
    """A wrapper subclass (as torchao's quantized tensors are): no storage of its own; its data
    pointer is 0."""

    wrapped: torch.Tensor

    @staticmethod
    def __new__(cls, wrapped: torch.Tensor) -> WrapperTensor:
        made: WrapperTensor = torch.Tensor._make_wrapper_subclass(cls, wrapped.shape, dtype=wrapped.dtype)
        made.wrapped = wrapped
        return made

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]  # torch's stub leaves out func, which the dispatcher passes
        def unwrap(value: Any) -> Any:
            return value.wrapped if isinstance(value, WrapperTensor) else value

        return func(*[unwrap(arg) for arg in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})


def fake_tensor(*shape: int) -> torch.Tensor:
    from torch._subclasses.fake_tensor import FakeTensorMode  # what torch.compile traces with

    with FakeTensorMode():
        return torch.empty(*shape)


class RefusingLinear(torch.nn.Linear):
    """A module whose own ``load_state_dict`` refuses, as a module with custom loading may."""

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        raise RuntimeError("this module refuses its state")


# --------------------------------------------------------------------------------------------
# The cases


@dataclass
class Scene:
    """What one case works in: its directory, the test's monkeypatch, and objects the trigger
    keeps for the ``intact`` check."""

    tmp: Path
    monkeypatch: pytest.MonkeyPatch
    kept: dict[str, Any]


@dataclass(frozen=True)
class Case:
    """``trigger`` drives one third-party failure through a public entry point; it must raise
    ``expected`` (exactly), with a message containing ``mentions``, the original error of type
    ``cause`` in its ``__cause__`` chain (when given), and ``intact`` (when given) passing after."""

    trigger: Callable[[Scene], object]
    expected: type[sk.ShardkeepError]
    mentions: str
    cause: type[BaseException] | None = None
    intact: Callable[[Scene], None] | None = None


def leak(raises: type[BaseException], reason: str) -> pytest.MarkDecorator:
    return pytest.mark.xfail(strict=True, raises=raises, reason=f"leak: {reason}")


def nothing_committed(name: str) -> Callable[[Scene], None]:
    def check(scene: Scene) -> None:
        assert not (scene.tmp / name).exists()
        assert not [path.name for path in scene.tmp.iterdir() if ".tmp-" in path.name]

    return check


def into_unchanged(scene: Scene) -> None:
    into = scene.kept["into"]
    for key, before in scene.kept["before"].items():
        now = copy_of(into[key])
        assert now is not None and torch.equal(now, before), key


def still_restores_step_1(scene: Scene) -> None:
    reader = sk.CheckpointManager(scene.tmp / "root", keep_best=0, read_only=True)
    assert reader.restore().entry.name == "step_00000001"
    assert not [path.name for path in (scene.tmp / "root").iterdir() if ".tmp-" in path.name]


# -- OSError family ----------------------------------------------------------------------------


def save_with_enospc_on_write(scene: Scene) -> None:
    fail_syscall(scene.monkeypatch, "write", errno.ENOSPC, staging_of(scene.tmp / "ckpt"))
    sk.save(small_state(), scene.tmp / "ckpt")


def save_with_enospc_on_fsync(scene: Scene) -> None:
    fail_syscall(scene.monkeypatch, "fsync", errno.ENOSPC, staging_of(scene.tmp / "ckpt"))
    sk.save(small_state(), scene.tmp / "ckpt")


def async_save_with_eio_on_write(scene: Scene) -> None:
    fail_syscall(scene.monkeypatch, "write", errno.EIO, staging_of(scene.tmp / "ckpt"))
    sk.async_save(small_state(), scene.tmp / "ckpt").result()


def save_with_staging_mkdir_denied(scene: Scene) -> None:
    fail_syscall(scene.monkeypatch, "mkdir", errno.EACCES, staging_of(scene.tmp / "ckpt"))
    sk.save(small_state(), scene.tmp / "ckpt")


def save_into_read_only_directory(scene: Scene) -> None:
    root = scene.tmp / "ro"
    root.mkdir()
    root.chmod(0o555)
    try:
        sk.save(small_state(), root / "ckpt")
    finally:
        root.chmod(0o755)


def save_under_a_file(scene: Scene) -> None:
    (scene.tmp / "afile").write_text("not a directory")
    sk.save(small_state(), scene.tmp / "afile" / "ckpt")


def load_under_a_file(scene: Scene) -> None:
    (scene.tmp / "afile").write_text("not a directory")
    sk.load(scene.tmp / "afile" / "ckpt")


def load_a_file(scene: Scene) -> None:
    (scene.tmp / "afile").write_text("not a checkpoint")
    sk.load(scene.tmp / "afile")


def open_denied(target: Callable[[Path], Path], read: Callable[[Path], object]) -> Callable[[Scene], object]:
    """A trigger: save a checkpoint, make ``os.open`` of ``target(checkpoint)`` fail with EACCES,
    then ``read(checkpoint)``."""

    def trigger(scene: Scene) -> object:
        checkpoint = saved(scene.tmp)
        fail_syscall(scene.monkeypatch, "open", errno.EACCES, named(target(checkpoint)))
        return read(checkpoint)

    return trigger


def load_from_unreadable_directory(scene: Scene) -> None:
    checkpoint = saved(scene.tmp)
    checkpoint.chmod(0o000)
    try:
        sk.load(checkpoint)
    finally:
        checkpoint.chmod(0o755)


def damaged(damage: Callable[[Path], object], read: Callable[[Path], object]) -> Callable[[Scene], object]:
    """A trigger: save a checkpoint, ``damage`` it, then ``read`` it."""

    def trigger(scene: Scene) -> object:
        checkpoint = saved(scene.tmp)
        damage(checkpoint)
        return read(checkpoint)

    return trigger


def remove_shard(checkpoint: Path) -> None:
    shard_of(checkpoint).unlink()


def directory_for_shard(checkpoint: Path) -> None:
    shard = shard_of(checkpoint)
    shard.unlink()
    shard.mkdir()


def file_for_shards_directory(checkpoint: Path) -> None:
    shutil.rmtree(checkpoint / "shards")
    (checkpoint / "shards").write_text("not a directory")


def directory_for_manifest(checkpoint: Path) -> None:
    (checkpoint / "manifest.json").unlink()
    (checkpoint / "manifest.json").mkdir()


def manager_root_mkdir_denied(scene: Scene) -> None:
    fail_syscall(scene.monkeypatch, "mkdir", errno.EACCES, named(scene.tmp / "root"))
    sk.CheckpointManager(scene.tmp / "root")


def manager_root_in_read_only_directory(scene: Scene) -> None:
    (scene.tmp / "ro").mkdir()
    (scene.tmp / "ro").chmod(0o555)
    try:
        sk.CheckpointManager(scene.tmp / "ro" / "root")
    finally:
        (scene.tmp / "ro").chmod(0o755)


def manager_with_step_1(scene: Scene) -> sk.CheckpointManager:
    manager = sk.CheckpointManager(scene.tmp / "root", keep_last=2, keep_best=0)
    manager.save({"w": torch.ones(8)}, step=1)
    return manager


def manager_save_with_enospc(scene: Scene) -> None:
    manager = manager_with_step_1(scene)
    fail_syscall(scene.monkeypatch, "write", errno.ENOSPC, staging_of(scene.tmp / "root" / "step_00000002"))
    manager.save({"w": torch.zeros(8)}, step=2)


def manager_restore_with_open_denied(name: str) -> Callable[[Scene], object]:
    def trigger(scene: Scene) -> object:
        manager = manager_with_step_1(scene)
        fail_syscall(scene.monkeypatch, "open", errno.EACCES, named(scene.tmp / "root" / name))
        return manager.restore()

    return trigger


def manager_list_with_listing_denied(scene: Scene) -> None:
    manager = manager_with_step_1(scene)
    fail_syscall(scene.monkeypatch, "listdir", errno.EACCES, named(scene.tmp / "root"))
    manager.list()


def initialized_ledger(scene: Scene) -> sk.ProgressLedger:
    (scene.tmp / "job").mkdir()
    ledger = sk.ProgressLedger(scene.tmp / "job" / "progress.json", world_size=2)
    ledger.initialize()
    return ledger


def ledger_update_with_enospc(scene: Scene) -> None:
    ledger = scene.kept["ledger"] = initialized_ledger(scene)
    fail_syscall(scene.monkeypatch, "write", errno.ENOSPC, under(scene.tmp / "job"))
    ledger.mark_shard_failed(0, "out of memory")


def ledger_unchanged(scene: Scene) -> None:
    status = scene.kept["ledger"].get_shard_status(0)
    assert status is not None and status["retry_count"] == 0 and status["status"] == "in_progress"


def ledger_read_with_open_denied(scene: Scene) -> None:
    ledger = initialized_ledger(scene)
    fail_syscall(scene.monkeypatch, "open", errno.EACCES, named(ledger.manifest_path))
    ledger.read()


def ledger_lock_open_denied(scene: Scene) -> None:
    ledger = initialized_ledger(scene)
    fail_syscall(scene.monkeypatch, "open", errno.EACCES, named(ledger.lock_path))
    ledger.mark_shard_complete(0)


def ledger_under_a_file(scene: Scene) -> None:
    (scene.tmp / "afile").write_text("not a directory")
    sk.ProgressLedger(scene.tmp / "afile" / "progress.json", world_size=1).initialize()


def ledger_in_read_only_directory(scene: Scene) -> None:
    (scene.tmp / "job").mkdir()
    (scene.tmp / "job").chmod(0o555)
    try:
        sk.ProgressLedger(scene.tmp / "job" / "progress.json", world_size=1).initialize()
    finally:
        (scene.tmp / "job").chmod(0o755)


OS_CASES = [
    pytest.param(
        Case(save_with_enospc_on_write, sk.StorageError, "ckpt.tmp-", OSError, nothing_committed("ckpt")),
        id="save-ENOSPC-write",
    ),
    pytest.param(
        Case(save_with_enospc_on_fsync, sk.StorageError, "rank_00000.safetensors", OSError, nothing_committed("ckpt")),
        id="save-ENOSPC-fsync",
    ),
    pytest.param(
        Case(async_save_with_eio_on_write, sk.StorageError, "ckpt.tmp-", OSError, nothing_committed("ckpt")),
        id="async_save-EIO-write",
    ),
    pytest.param(
        Case(
            save_with_staging_mkdir_denied,
            sk.StorageError,
            "ckpt: permission denied",  # the path given; the staging name stays in the cause
            PermissionError,
            nothing_committed("ckpt"),
        ),
        id="save-EACCES-staging-mkdir",
    ),
    pytest.param(
        Case(save_into_read_only_directory, sk.StorageError, "ckpt: permission denied", PermissionError),
        id="save-EACCES-read-only-dir",
        marks=ROOT_IGNORES_PERMISSIONS,
    ),
    pytest.param(Case(save_under_a_file, sk.StorageError, "afile", NotADirectoryError), id="save-ENOTDIR"),
    pytest.param(
        Case(lambda scene: sk.load(scene.tmp / "absent"), sk.CheckpointNotFoundError, "absent"), id="load-ENOENT"
    ),
    pytest.param(Case(load_a_file, sk.CheckpointNotFoundError, "afile"), id="load-file-not-directory"),
    pytest.param(Case(load_under_a_file, sk.StorageError, "afile", NotADirectoryError), id="load-ENOTDIR"),
    pytest.param(
        Case(open_denied(lambda c: c / "manifest.json", sk.load), sk.StorageError, "manifest.json", PermissionError),
        id="load-EACCES-manifest",
    ),
    pytest.param(
        Case(open_denied(lambda c: c, sk.load), sk.StorageError, "ckpt", PermissionError),
        id="load-EACCES-checkpoint-dir",
    ),
    pytest.param(
        Case(load_from_unreadable_directory, sk.StorageError, "ckpt", PermissionError),
        id="load-EACCES-chmod-000",
        marks=ROOT_IGNORES_PERMISSIONS,
    ),
    pytest.param(
        Case(open_denied(shard_of, sk.load), sk.IntegrityError, "rank_00000.safetensors"),
        id="load-EACCES-shard",
    ),
    pytest.param(
        Case(damaged(remove_shard, sk.load), sk.IntegrityError, "rank_00000.safetensors: missing"),
        id="load-ENOENT-shard",
    ),
    pytest.param(
        Case(damaged(directory_for_shard, sk.load), sk.IntegrityError, "is not a regular file"),
        id="load-EISDIR-shard",
    ),
    pytest.param(
        Case(damaged(file_for_shards_directory, sk.load), sk.IntegrityError, "shards"),
        id="load-ENOTDIR-shards-dir",
    ),
    pytest.param(
        Case(damaged(directory_for_manifest, sk.load), sk.UnsafePathError, "manifest.json"),
        id="load-EISDIR-manifest",
    ),
    pytest.param(
        Case(lambda scene: sk.read_manifest(scene.tmp / "absent"), sk.CheckpointNotFoundError, "absent"),
        id="read_manifest-ENOENT",
    ),
    pytest.param(
        Case(
            open_denied(lambda c: c / "manifest.json", sk.read_manifest),
            sk.StorageError,
            "manifest.json",
            PermissionError,
        ),
        id="read_manifest-EACCES-manifest",
    ),
    pytest.param(
        Case(open_denied(lambda c: c, sk.read_manifest), sk.StorageError, "ckpt", PermissionError),
        id="read_manifest-EACCES-checkpoint-dir",
    ),
    pytest.param(
        Case(manager_root_mkdir_denied, sk.StorageError, "root", PermissionError), id="manager-EACCES-root-mkdir"
    ),
    pytest.param(
        Case(manager_root_in_read_only_directory, sk.StorageError, "root", PermissionError),
        id="manager-EACCES-read-only-parent",
        marks=ROOT_IGNORES_PERMISSIONS,
    ),
    pytest.param(
        Case(manager_save_with_enospc, sk.StorageError, "step_00000002.tmp-", OSError, still_restores_step_1),
        id="manager-save-ENOSPC",
    ),
    pytest.param(
        Case(
            manager_restore_with_open_denied("step_00000001/manifest.json"),
            sk.StorageError,
            "manifest.json",
            PermissionError,
        ),
        id="manager-restore-EACCES-manifest",
    ),
    pytest.param(
        Case(manager_restore_with_open_denied("step_00000001"), sk.StorageError, "step_00000001", PermissionError),
        id="manager-restore-EACCES-checkpoint-dir",
    ),
    pytest.param(
        Case(manager_list_with_listing_denied, sk.StorageError, "root", PermissionError), id="manager-list-EACCES"
    ),
    pytest.param(
        Case(ledger_update_with_enospc, sk.StorageError, "progress.json", OSError, ledger_unchanged),
        id="ledger-update-ENOSPC",
    ),
    pytest.param(
        Case(ledger_read_with_open_denied, sk.StorageError, "progress.json", PermissionError),
        id="ledger-read-EACCES",
    ),
    pytest.param(
        Case(ledger_lock_open_denied, sk.StorageError, "progress.json.lock", PermissionError),
        id="ledger-lock-EACCES",
    ),
    pytest.param(Case(ledger_under_a_file, sk.StorageError, "afile", OSError), id="ledger-ENOTDIR"),
    pytest.param(
        Case(ledger_in_read_only_directory, sk.StorageError, "progress.json", PermissionError),
        id="ledger-EACCES-read-only-dir",
        marks=ROOT_IGNORES_PERMISSIONS,
    ),
]


# -- msgspec and json: manifests and ledgers -------------------------------------------------------


def _resealed(mutate: Callable[[dict[str, Any]], object]) -> Callable[[Path], None]:
    return lambda checkpoint: reseal(checkpoint, mutate)


def _sealed_body(body: bytes) -> Callable[[Path], None]:
    return lambda checkpoint: write_sealed_manifest(checkpoint, body)


def _garbage_manifest(checkpoint: Path) -> None:
    (checkpoint / "manifest.json").chmod(0o644)
    (checkpoint / "manifest.json").write_bytes(b"\x00 not a manifest {")


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


#: (id, damage, expected, mentions, cause): each is read by load and read_manifest (and by
#: verify and the manager below).
MANIFEST_DAMAGE: list[tuple[str, Callable[[Path], None], type[sk.ShardkeepError], str, type[BaseException] | None]] = [
    ("malformed-json", _sealed_body(b'{"format":"shardkeep",,"x":1}'), sk.ManifestError, "malformed", ValueError),
    (
        "wrong-type",
        _resealed(lambda raw: raw.update(world_size="two")),
        sk.ManifestError,
        "world_size",
        msgspec.ValidationError,
    ),
    (
        "files-not-a-list",
        _resealed(lambda raw: raw.update(files={"a": 1})),
        sk.ManifestError,
        "files",
        msgspec.ValidationError,
    ),
    (
        "shape-of-strings",
        _resealed(lambda raw: raw["files"][0]["tensors"][0].update(shape=["a", "b"])),
        sk.ManifestError,
        "shape",
        msgspec.ValidationError,
    ),
    (
        "bad-timestamp",
        _resealed(lambda raw: raw.update(created_at="yesterday")),
        sk.ManifestError,
        "created_at",
        msgspec.ValidationError,
    ),
    (
        "nested-too-deep",
        _resealed(lambda raw: raw.update(custom_fields={"deep": _nested(40)})),
        sk.ManifestError,
        "nested deeper",
        None,
    ),
    ("duplicate-key", _sealed_body(b'{"format":"shardkeep","format":"x"}'), sk.ManifestError, "'format'", None),
    ("NaN", _sealed_body(b'{"format":"shardkeep","x":NaN}'), sk.ManifestError, "NaN", None),
    ("invalid-utf8", _sealed_body(b'{"format":"shardkeep","x":"\xff"}'), sk.ManifestError, "UTF-8", UnicodeDecodeError),
    (
        "newer-major-version",
        _resealed(lambda raw: raw.update(metadata_version="9.0")),
        sk.ManifestVersionError,
        "9.0",
        None,
    ),
    ("unsealed-garbage", _garbage_manifest, sk.IntegrityError, "self-digest", None),
]

MANIFEST_CASES = [
    pytest.param(Case(damaged(damage, read), expected, mentions, cause), id=f"{reader}-manifest-{name}")
    for name, damage, expected, mentions, cause in MANIFEST_DAMAGE
    for reader, read in (("load", sk.load), ("read_manifest", sk.read_manifest))
]


def manager_restore_of_damaged_manifest(scene: Scene) -> None:
    manager = manager_with_step_1(scene)
    reseal(scene.tmp / "root" / "step_00000001", lambda raw: raw.update(world_size="two"))
    manager.restore()


def ledger_with_bytes(make: Callable[[bytes], bytes]) -> Callable[[Scene], object]:
    def trigger(scene: Scene) -> object:
        ledger = initialized_ledger(scene)
        ledger.manifest_path.write_bytes(make(ledger.manifest_path.read_bytes()))
        return sk.ProgressLedger(ledger.manifest_path).read()

    return trigger


MSGSPEC_CASES = [
    *MANIFEST_CASES,
    pytest.param(
        Case(manager_restore_of_damaged_manifest, sk.IntegrityError, "step_00000001"),
        id="manager-restore-manifest-wrong-type",
    ),
    pytest.param(
        Case(ledger_with_bytes(lambda raw: b"\x00garbage{"), sk.ManifestCorruptedError, "progress.json"),
        id="ledger-garbage",
    ),
    pytest.param(
        Case(
            ledger_with_bytes(lambda raw: reseal_ledger(raw.replace(b'"world_size":2', b'"world_size":"two"'))),
            sk.ManifestCorruptedError,
            "world_size",
        ),
        id="ledger-checksummed-wrong-type",
    ),
    pytest.param(
        Case(
            ledger_with_bytes(lambda raw: reseal_ledger(raw.replace(b'"created_at":"', b'"created_at":"x', 1))),
            sk.ManifestCorruptedError,
            "created_at",
        ),
        id="ledger-checksummed-bad-timestamp",
    ),
]


# -- zstandard ---------------------------------------------------------------------------------
# A compressed file's digest is of its uncompressed bytes, so the decoder always runs before the
# digest check: corrupted compressed bytes reach zstd on every load and verify.


def compressed_and(damage: Callable[[bytearray], bytes | bytearray], **load: Any) -> Callable[[Scene], object]:
    def trigger(scene: Scene) -> object:
        checkpoint = saved(scene.tmp, options=sk.WriteOptions(compression="zstd"))
        rewrite_shard(checkpoint, damage)
        return sk.load(checkpoint, **load)

    return trigger


ZSTD_CASES = [
    pytest.param(
        Case(compressed_and(flip_byte(0)), sk.IntegrityError, "rank_00000.safetensors.zst: cannot be decompressed"),
        id="load-zstd-frame-magic",
    ),
    pytest.param(
        Case(
            compressed_and(reserved_block_type), sk.IntegrityError, "rank_00000.safetensors.zst: cannot be decompressed"
        ),
        id="load-zstd-block-corrupt",
    ),
    pytest.param(
        Case(
            compressed_and(reserved_block_type, verify=False),
            sk.IntegrityError,
            "rank_00000.safetensors.zst: cannot be decompressed",
        ),
        id="load-zstd-block-corrupt-verify-False",
    ),
    pytest.param(
        Case(
            compressed_and(lambda data: data[: len(data) // 2]),
            sk.IntegrityError,
            "rank_00000.safetensors.zst: decompresses to a different size",
        ),
        id="load-zstd-truncated",
    ),
]


# -- cryptography ------------------------------------------------------------------------------


def save_signed_with(make_key_file: Callable[[Path], Path]) -> Callable[[Scene], object]:
    def trigger(scene: Scene) -> object:
        scene.monkeypatch.delenv(PASSPHRASE_ENV, raising=False)
        return sk.save(small_state(), scene.tmp / "ckpt", signer=make_key_file(scene.tmp))

    return trigger


def read_with_public_key(
    make_key_file: Callable[[Path], Path], read: Callable[..., object] = sk.load
) -> Callable[[Scene], object]:
    def trigger(scene: Scene) -> object:
        checkpoint = saved(scene.tmp, signer=Ed25519PrivateKey.generate())
        return read(checkpoint, public_key=make_key_file(scene.tmp))

    return trigger


def encrypted_key_with_passphrase(passphrase: str | None) -> Callable[[Scene], object]:
    def trigger(scene: Scene) -> object:
        path = pem_file(
            scene.tmp / "enc.pem",
            private_pem(Ed25519PrivateKey.generate(), serialization.BestAvailableEncryption(b"the right one")),
        )
        if passphrase is None:
            scene.monkeypatch.delenv(PASSPHRASE_ENV, raising=False)
        else:
            scene.monkeypatch.setenv(PASSPHRASE_ENV, passphrase)
        return sk.save(small_state(), scene.tmp / "ckpt", signer=path)

    return trigger


def signed_with_signature_file(make: Callable[[bytes], bytes]) -> Callable[[Scene], object]:
    def trigger(scene: Scene) -> object:
        key = Ed25519PrivateKey.generate()
        checkpoint = saved(scene.tmp, signer=key)
        signature = checkpoint / "manifest.sig"
        signature.chmod(0o644)
        signature.write_bytes(make(signature.read_bytes()))
        return sk.load(checkpoint, public_key=key.public_key())

    return trigger


def _other_signature(good: bytes) -> bytes:
    record = json.loads(good)
    record["signature"] = "ab" * 64
    return (json.dumps(record, separators=(",", ":")) + "\n").encode()


def _garbage_pem(tmp: Path) -> Path:
    return pem_file(
        tmp / "garbage.pem", b"-----BEGIN PRIVATE KEY-----\nnot base64 at all!\n-----END PRIVATE KEY-----\n"
    )


CRYPTO_CASES = [
    pytest.param(
        Case(save_signed_with(_garbage_pem), sk.ConfigError, "garbage.pem", ValueError, nothing_committed("ckpt")),
        id="signer-garbage-PEM",
    ),
    pytest.param(
        Case(
            save_signed_with(lambda tmp: pem_file(tmp / "rsa.pem", private_pem(rsa.generate_private_key(65537, 2048)))),
            sk.ConfigError,
            "rsa.pem' holds a RSAPrivateKey",
            None,
            nothing_committed("ckpt"),
        ),
        id="signer-RSA-key",
    ),
    pytest.param(
        Case(
            save_signed_with(
                lambda tmp: pem_file(tmp / "ec.pem", private_pem(ec.generate_private_key(ec.SECP256R1())))
            ),
            sk.ConfigError,
            "ec.pem' holds a ECPrivateKey",
        ),
        id="signer-EC-key",
    ),
    pytest.param(
        Case(
            save_signed_with(lambda tmp: pem_file(tmp / "pub.pem", public_pem(Ed25519PrivateKey.generate()))),
            sk.ConfigError,
            "pub.pem",
            ValueError,
        ),
        id="signer-public-key-file",
    ),
    pytest.param(
        Case(encrypted_key_with_passphrase(None), sk.ConfigError, PASSPHRASE_ENV, TypeError),
        id="signer-encrypted-no-passphrase",
    ),
    pytest.param(
        Case(encrypted_key_with_passphrase("a wrong one"), sk.ConfigError, "enc.pem", ValueError),
        id="signer-encrypted-wrong-passphrase",
    ),
    pytest.param(
        Case(save_signed_with(lambda tmp: tmp / "absent.pem"), sk.ConfigError, "absent.pem", FileNotFoundError),
        id="signer-ENOENT",
    ),
    pytest.param(
        Case(read_with_public_key(_garbage_pem), sk.ConfigError, "garbage.pem", ValueError),
        id="load-public_key-garbage-PEM",
    ),
    pytest.param(
        Case(
            read_with_public_key(
                lambda tmp: pem_file(tmp / "rsa.pub", public_pem(rsa.generate_private_key(65537, 2048))), sk.verify
            ),
            sk.ConfigError,
            "rsa.pub' holds a RSAPublicKey",
        ),
        id="verify-public_key-RSA",
    ),
    pytest.param(
        Case(
            read_with_public_key(
                lambda tmp: pem_file(tmp / "ec.pub", public_pem(ec.generate_private_key(ec.SECP256R1()))),
                sk.read_manifest,
            ),
            sk.ConfigError,
            "ec.pub' holds a ECPublicKey",
        ),
        id="read_manifest-public_key-EC",
    ),
    pytest.param(
        Case(
            read_with_public_key(lambda tmp: pem_file(tmp / "priv.pem", private_pem(Ed25519PrivateKey.generate()))),
            sk.ConfigError,
            "priv.pem",
            ValueError,
        ),
        id="load-public_key-is-a-private-key",
    ),
    pytest.param(
        Case(
            lambda scene: sk.CheckpointManager(scene.tmp / "root", public_key=_garbage_pem(scene.tmp), read_only=True),
            sk.ConfigError,
            "garbage.pem",
            ValueError,
        ),
        id="manager-public_key-garbage-PEM",
    ),
    pytest.param(
        Case(
            signed_with_signature_file(lambda good: b"\x00\xff garbage"),
            sk.SignatureError,
            "manifest.sig is malformed",
            msgspec.DecodeError,
        ),
        id="load-signature-garbage",
    ),
    pytest.param(
        Case(
            signed_with_signature_file(lambda good: b'{"format":1,"algorithm":2,"key_id":3,"signature":4}\n'),
            sk.SignatureError,
            "format",
            msgspec.ValidationError,
        ),
        id="load-signature-wrong-types",
    ),
    pytest.param(
        Case(signed_with_signature_file(_other_signature), sk.SignatureError, "manifest.sig", InvalidSignature),
        id="load-signature-invalid",
    ),
]


# -- torch -------------------------------------------------------------------------------------


def in_a_child_process(trigger: Callable[[Scene], object]) -> Callable[[Scene], object]:
    """``trigger`` run in a forked child, for failures that once crashed the interpreter (saving
    a tensor whose data pointer is 0 read memory at address 0): a regression fails its case
    instead of killing the test run. The child's ShardkeepError is raised here again, same class
    and message (:func:`shardkeep.errors.same_error`); any other error is raised as a leak."""

    def run(scene: Scene) -> object:
        from shardkeep.errors import same_error

        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report the outcome as JSON, never return into pytest
            try:
                os.close(read_end)
                outcome = {"kind": "returned"}
                try:
                    trigger(scene)
                except sk.ShardkeepError as exc:
                    outcome = {"kind": "shardkeep", "type": type(exc).__name__, "message": str(exc)}
                except BaseException as exc:
                    outcome = {"kind": "leak", "type": type(exc).__name__, "message": str(exc)}
                os.write(write_end, json.dumps(outcome).encode())
            finally:
                os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            reported = pipe.read()
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status):
            pytest.fail(f"the process crashed (signal {os.WTERMSIG(status)}) instead of raising a ShardkeepError")
        outcome = json.loads(reported)
        if outcome["kind"] == "shardkeep":
            raise same_error(outcome["type"], outcome["message"])
        if outcome["kind"] == "leak":
            raise AssertionError(f"leak: {outcome['type']}: {outcome['message']}")
        return None

    return run


def save_leaf(make: Callable[[], Any]) -> Callable[[Scene], object]:
    return lambda scene: sk.save({"x": quietly(make)}, scene.tmp / "ckpt")


def async_save_leaf(make: Callable[[], Any]) -> Callable[[Scene], object]:
    return lambda scene: sk.async_save({"x": quietly(make)}, scene.tmp / "ckpt").result()


def load_into(make_into: Callable[[], dict[str, Any]]) -> Callable[[Scene], object]:
    """A trigger: save ``{"w": 2x3 float32, "model": Linear(3, 2)}``, then load it into
    ``make_into()``, keeping a copy of what the target held for ``into_unchanged``."""

    def trigger(scene: Scene) -> object:
        sk.save({"w": torch.ones(2, 3), "model": torch.nn.Linear(3, 2)}, scene.tmp / "ckpt")
        into = scene.kept["into"] = make_into()
        scene.kept["before"] = {key: copy_of(value) for key, value in into.items() if copy_of(value) is not None}
        return sk.load(scene.tmp / "ckpt", into=into)

    return trigger


def copy_of(value: Any) -> torch.Tensor | None:
    """What a target of ``into=`` holds (a module's weight), for comparing after a refused load;
    ``None`` for targets without data of their own (meta and fake tensors)."""
    if isinstance(value, torch.nn.Module):
        weight: torch.Tensor = value.state_dict()["weight"]
        return weight.detach().clone()
    if type(value) is torch.Tensor and not value.is_meta:
        return value.detach().clone()
    return None


TORCH_CASES = [
    pytest.param(
        Case(save_leaf(lambda: torch.zeros(2, dtype=torch.int4)), sk.UnsupportedValueError, "'x'"),
        id="save-int4",
    ),
    pytest.param(
        Case(save_leaf(lambda: torch.eye(3).to_sparse()), sk.UnsupportedValueError, "'x' has layout torch.sparse_coo"),
        id="save-sparse-COO",
    ),
    pytest.param(
        Case(
            save_leaf(lambda: torch.eye(3).to_sparse_csr()), sk.UnsupportedValueError, "'x' has layout torch.sparse_csr"
        ),
        id="save-sparse-CSR",
    ),
    pytest.param(
        Case(
            save_leaf(lambda: torch.empty(3, device="meta")),
            sk.UnsupportedValueError,
            "'x' is on the meta device",
            None,
            nothing_committed("ckpt"),
        ),
        id="save-meta",
    ),
    pytest.param(
        Case(
            save_leaf(lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)),
            sk.UnsupportedValueError,
            "'x' is quantized",
        ),
        id="save-quantized",
    ),
    # These three crashed the process (a data pointer of 0 read in place) or raised RuntimeError.
    pytest.param(
        Case(
            in_a_child_process(save_leaf(lambda: fake_tensor(3))),
            sk.UnsupportedValueError,
            "'x' is a torch._subclasses",
        ),
        id="save-FakeTensor",
    ),
    pytest.param(
        Case(
            in_a_child_process(save_leaf(lambda: WrapperTensor(torch.ones(3)))),
            sk.UnsupportedValueError,
            "WrapperTensor",
        ),
        id="save-wrapper-subclass",
    ),
    pytest.param(
        Case(
            save_leaf(lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])),
            sk.UnsupportedValueError,
            "'x' has layout nested",
        ),
        id="save-nested-strided",
    ),
    pytest.param(
        Case(
            save_leaf(lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)),
            sk.UnsupportedValueError,
            "'x'",
        ),
        id="save-nested-jagged",
    ),
    pytest.param(
        Case(
            in_a_child_process(async_save_leaf(lambda: fake_tensor(3))),
            sk.UnsupportedValueError,
            "'x'",
            None,
            nothing_committed("ckpt"),
        ),
        id="async_save-FakeTensor",
    ),
    pytest.param(
        Case(async_save_leaf(lambda: torch.eye(3).to_sparse()), sk.UnsupportedValueError, "'x'"),
        id="async_save-sparse",
    ),
    pytest.param(
        Case(
            load_into(lambda: {"w": torch.zeros(2, 3, dtype=torch.float64), "model": torch.nn.Linear(3, 2)}),
            sk.StateMismatchError,
            "'w': the target has torch.float64[2, 3]",
            None,
            into_unchanged,
        ),
        id="load-into-dtype-mismatch",
    ),
    pytest.param(
        Case(
            load_into(lambda: {"w": torch.zeros(3, 2), "model": torch.nn.Linear(3, 2)}),
            sk.StateMismatchError,
            "'w': the target has torch.float32[3, 2]",
            None,
            into_unchanged,
        ),
        id="load-into-shape-mismatch",
    ),
    pytest.param(
        Case(
            load_into(lambda: {"w": torch.zeros(2, 3), "model": torch.nn.Linear(4, 2)}),
            sk.StateMismatchError,
            "'model.weight'",
            None,
            into_unchanged,
        ),
        id="load-into-module-wrong-shapes",
    ),
    pytest.param(
        Case(
            load_into(lambda: {"w": torch.zeros(2, 3), "model": RefusingLinear(3, 2)}),
            sk.UnsupportedValueError,
            "'model': RefusingLinear.load_state_dict refused",
            RuntimeError,
            into_unchanged,
        ),
        id="load-into-module-that-refuses",
    ),
    pytest.param(
        Case(
            load_into(lambda: {"w": fake_tensor(2, 3), "model": torch.nn.Linear(3, 2)}), sk.UnsupportedValueError, "'w'"
        ),
        id="load-into-FakeTensor",
    ),
    pytest.param(
        Case(
            load_into(lambda: {"w": torch.zeros(2, 3).to_sparse(), "model": torch.nn.Linear(3, 2)}),
            sk.UnsupportedValueError,
            "sparse",
        ),
        id="load-into-sparse-tensor",
    ),
    pytest.param(
        Case(
            load_into(lambda: {"w": torch.empty(2, 3, device="meta"), "model": torch.nn.Linear(3, 2)}),
            sk.UnsupportedValueError,
            "'w'",
        ),
        id="load-into-meta-tensor",
    ),
]


# -- safetensors headers in data files ------------------------------------------------------------


def shard_with(damage: Callable[[bytearray], bytes | bytearray], **load: Any) -> Callable[[Scene], object]:
    def trigger(scene: Scene) -> object:
        checkpoint = saved(scene.tmp)
        rewrite_shard(checkpoint, damage)
        return sk.load(checkpoint, **load)

    return trigger


def import_file(name: str, data: bytes) -> Callable[[Scene], object]:
    from shardkeep.interop import import_checkpoint

    return lambda scene: import_checkpoint(pem_file(scene.tmp / name, data), scene.tmp / "imported")


def safetensors_with_values(text: str) -> Callable[[Scene], object]:
    def trigger(scene: Scene) -> object:
        import safetensors.torch

        from shardkeep.interop import import_checkpoint

        source = scene.tmp / "values.safetensors"
        safetensors.torch.save_file({"a": torch.ones(2)}, str(source), metadata={"shardkeep.values": text})
        return import_checkpoint(source, scene.tmp / "imported")

    return trigger


HEADER_CASES = [
    pytest.param(
        Case(shard_with(with_header("{{{ not json")), sk.IntegrityError, "rank_00000.safetensors: safetensors header"),
        id="load-header-not-JSON",
    ),
    pytest.param(
        Case(
            shard_with(with_header("{{{ not json"), verify=False),
            sk.IntegrityError,
            "rank_00000.safetensors: safetensors header",
        ),
        id="load-header-not-JSON-verify-False",
    ),
    pytest.param(
        Case(shard_with(with_header("[1, 2, 3]")), sk.IntegrityError, "rank_00000.safetensors"),
        id="load-header-a-list",
    ),
    pytest.param(
        Case(shard_with(with_header_length(1 << 63)), sk.IntegrityError, "rank_00000.safetensors"),
        id="load-header-length-huge",
    ),
    pytest.param(
        Case(
            shard_with(with_header("{" + HEADER_OF_W.replace("[64,64]", "[64.0,64]") + "}")),
            sk.IntegrityError,
            "64.0",
        ),
        id="load-header-float-shape",
    ),
    pytest.param(
        Case(
            shard_with(with_header('{"__metadata__":{"shardkeep.version":"\\u00b2"},' + HEADER_OF_W + "}")),
            sk.IntegrityError,
            "rank_00000.safetensors: header version",
        ),
        id="load-header-version-superscript-digit",  # str.isdigit() accepts it, int() raised ValueError
    ),
    pytest.param(
        Case(
            import_file("garbage.safetensors", struct.pack("<Q", 8) + b"{garbage"),
            sk.UnsupportedValueError,
            "garbage.safetensors",
            SafetensorError,
        ),
        id="import-safetensors-garbage-header",
    ),
    pytest.param(
        Case(
            import_file("huge.safetensors", struct.pack("<Q", 1 << 63) + b"{}"),
            sk.UnsupportedValueError,
            "huge.safetensors",
            SafetensorError,
        ),
        id="import-safetensors-header-length-huge",
    ),
    pytest.param(
        Case(safetensors_with_values("[" * 100_000), sk.UnsupportedValueError, "values.safetensors", RecursionError),
        id="import-safetensors-values-too-deep",
    ),
    pytest.param(
        Case(import_file("garbage.pt", b"PK\x03\x04 garbage"), sk.UnsupportedValueError, "garbage.pt", RuntimeError),
        id="import-torch-file-garbage",
    ),
]


# -- YAML configs and RNG states ---------------------------------------------------------------


def from_config_file(data: bytes) -> Callable[[Scene], object]:
    def trigger(scene: Scene) -> object:
        (scene.tmp / "config.yaml").write_bytes(data)
        return sk.CheckpointManager.from_config(scene.tmp / "root", scene.tmp / "config.yaml")

    return trigger


def from_config_fifo(scene: Scene) -> object:
    """A config path that is a FIFO with no writer: reading it must not block."""
    fifo = scene.tmp / "config.yaml"
    os.mkfifo(fifo)
    return sk.CheckpointManager.from_config(scene.tmp / "root", fifo)


def restore_rng_state(mutate: Callable[[dict[str, Any]], object]) -> Callable[[Scene], object]:
    def trigger(scene: Scene) -> object:
        from shardkeep.training import TrainingCheckpoint

        state = TrainingCheckpoint.capture_rng()
        state["numpy"] = dict(state["numpy"], key=state["numpy"]["key"].tolist())
        mutate(state)
        torch.manual_seed(1234)  # states that the refused restore must leave as they are
        random.seed(1234)
        scene.kept["rng_before"] = (torch.get_rng_state(), random.getstate())
        return TrainingCheckpoint.restore_rng(state)

    return trigger


def rng_unchanged(scene: Scene) -> None:
    torch_state, python_state = scene.kept["rng_before"]
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert random.getstate() == python_state


OTHER_CASES = [
    pytest.param(
        Case(
            from_config_file(b"checkpointing:\n  metric: \xff\xfe\n"), sk.ConfigError, "config.yaml", UnicodeDecodeError
        ),
        id="from_config-invalid-UTF-8",
    ),
    pytest.param(
        Case(from_config_file(b"? [a, b]\n: 1\n"), sk.ConfigError, "config.yaml", TypeError),
        id="from_config-unhashable-key",
    ),
    pytest.param(
        Case(
            from_config_file(b"a: " + b"[" * 20_000 + b"]" * 20_000 + b"\n"),
            sk.ConfigError,
            "config.yaml",
            RecursionError,
        ),
        id="from_config-nested-too-deep",
    ),
    pytest.param(
        Case(from_config_file(b"{{{{ : : :\n"), sk.ConfigError, "config.yaml", yaml.YAMLError),
        id="from_config-invalid-YAML",
    ),
    pytest.param(
        Case(from_config_fifo, sk.ConfigError, "FIFO", sk.UnsafePathError),
        id="from_config-FIFO-does-not-block",
    ),
    pytest.param(
        Case(
            restore_rng_state(lambda state: state["numpy"].update(key=[-1] * 624)),
            sk.CheckpointFieldError,
            "'rng'",
            OverflowError,
            rng_unchanged,
        ),
        id="restore_rng-numpy-key-overflow",
    ),
    pytest.param(
        Case(
            restore_rng_state(lambda state: state.update(torch=[300] * 10)),
            sk.CheckpointFieldError,
            "'rng'",
            RuntimeError,
            rng_unchanged,
        ),
        id="restore_rng-torch-state-refused",
    ),
]


# --------------------------------------------------------------------------------------------
# The tests


def cause_chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cause = error.__cause__
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        yield cause
        cause = cause.__cause__


@pytest.mark.parametrize(
    "case", [*OS_CASES, *MSGSPEC_CASES, *ZSTD_CASES, *CRYPTO_CASES, *TORCH_CASES, *HEADER_CASES, *OTHER_CASES]
)
def test_third_party_errors_arrive_as_shardkeep_errors(
    case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scene = Scene(tmp_path, monkeypatch, {})
    with pytest.raises(sk.ShardkeepError) as caught:  # anything else escapes and fails the test: a leak
        case.trigger(scene)
    error = caught.value
    assert type(error) is case.expected, f"{type(error).__name__}: {error}"
    assert case.mentions in str(error), str(error)
    if case.cause is not None:
        causes = list(cause_chain(error))
        assert any(isinstance(cause, case.cause) for cause in causes), causes
    if case.intact is not None:
        case.intact(scene)


# -- verify reports what load raises ---------------------------------------------------------------


@dataclass(frozen=True)
class ReportCase:
    """``prepare`` damages a saved checkpoint (``scene.tmp / "ckpt"``); ``verify`` must then
    return a failed report (never raise) with a problem containing ``mentions``."""

    prepare: Callable[[Scene, Path], None]
    mentions: str
    verify_options: tuple[tuple[str, Any], ...] = ()


def damage_with(damage: Callable[[Path], object]) -> Callable[[Scene, Path], None]:
    def prepare(scene: Scene, checkpoint: Path) -> None:
        damage(checkpoint)

    return prepare


def deny_open(target: Callable[[Path], Path]) -> Callable[[Scene, Path], None]:
    return lambda scene, checkpoint: fail_syscall(scene.monkeypatch, "open", errno.EACCES, named(target(checkpoint)))


REPORT_CASES = [
    pytest.param(ReportCase(damage_with(remove_shard), "rank_00000.safetensors: missing"), id="ENOENT-shard"),
    pytest.param(ReportCase(damage_with(directory_for_shard), "is not a regular file"), id="EISDIR-shard"),
    pytest.param(ReportCase(damage_with(file_for_shards_directory), "shards"), id="ENOTDIR-shards-dir"),
    pytest.param(ReportCase(damage_with(directory_for_manifest), "manifest.json"), id="EISDIR-manifest"),
    pytest.param(ReportCase(deny_open(shard_of), "Permission denied"), id="EACCES-shard"),
    pytest.param(ReportCase(deny_open(lambda c: c / "manifest.json"), "Permission denied"), id="EACCES-manifest"),
    pytest.param(
        ReportCase(deny_open(lambda c: c), "Permission denied"),
        id="EACCES-checkpoint-dir",
    ),
    *[
        pytest.param(ReportCase(damage_with(damage), mentions), id=f"manifest-{name}")
        for name, damage, _, mentions, _ in MANIFEST_DAMAGE
    ],
    pytest.param(
        ReportCase(damage_with(lambda c: rewrite_shard(c, with_header("{{{ not json"))), "safetensors header"),
        id="header-not-JSON",
    ),
    pytest.param(
        ReportCase(
            damage_with(
                lambda c: rewrite_shard(
                    c, with_header('{"__metadata__":{"shardkeep.version":"\\u00b2"},' + HEADER_OF_W + "}")
                )
            ),
            "header version",
        ),
        id="header-version-superscript-digit",
    ),
    pytest.param(
        ReportCase(
            damage_with(lambda c: (c / "manifest.sig").write_bytes(b"\x00 garbage")), "manifest.sig is malformed"
        ),
        id="signature-garbage-without-key",
    ),
]


@pytest.mark.parametrize("case", REPORT_CASES)
def test_verify_reports_third_party_failures_as_problems(
    case: ReportCase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``verify`` never raises for bad content: every failure above is a problem in its report."""
    checkpoint = saved(tmp_path)
    case.prepare(Scene(tmp_path, monkeypatch, {}), checkpoint)
    report = sk.verify(checkpoint, **dict(case.verify_options))
    assert not report.ok
    assert any(case.mentions in problem for problem in report.problems), report.problems


def test_verify_reports_a_corrupted_compressed_file(tmp_path: Path) -> None:
    checkpoint = saved(tmp_path, options=sk.WriteOptions(compression="zstd"))
    rewrite_shard(checkpoint, reserved_block_type)
    report = sk.verify(checkpoint)
    assert report.problems and "rank_00000.safetensors.zst: cannot be decompressed" in report.problems[0]


# -- failures that need a process of their own --------------------------------------------------


def run_python(script: str, *args: str) -> dict[str, Any]:
    """Run ``script`` in a fresh interpreter; it prints one JSON object. A traceback (an error that
    is not a ShardkeepError escaped) fails the test with it."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args], capture_output=True, text=True, check=False, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


REPORT_ERROR = """
    def report(exc):
        cause = exc.__cause__
        print(json.dumps({"type": type(exc).__name__, "message": str(exc),
                          "cause": type(cause).__name__, "errno": getattr(cause, "errno", None)}))
"""


def test_a_real_file_size_limit_fails_the_save_with_a_storage_error(tmp_path: Path) -> None:
    """A real ``EFBIG`` from the kernel (``RLIMIT_FSIZE``, the unprivileged stand-in for a full
    disk): a typed error naming the file, with the ``OSError`` as its cause, and nothing committed."""
    script = (
        "import json, resource, signal, sys\nimport torch\nimport shardkeep as sk\n"
        + textwrap.dedent(REPORT_ERROR)
        + textwrap.dedent("""
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG from write() instead of a fatal signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
        try:
            sk.save({"w": torch.ones(256, 1024)}, sys.argv[1])
        except sk.ShardkeepError as exc:
            report(exc)
        """)
    )
    result = run_python(script, str(tmp_path / "ckpt"))
    assert result["type"] == "StorageError" and result["errno"] == errno.EFBIG, result
    assert "ckpt.tmp-" in result["message"] and "rank_00000.safetensors" in result["message"], result
    assert os.listdir(tmp_path) == []


def test_a_ledger_claiming_a_huge_world_size_is_refused_in_bounded_memory(tmp_path: Path) -> None:
    """A checksum-valid ledger whose ``world_size`` is 10**12 is refused before the reader builds
    10**12 shard names to compare with (which would be killed for memory). The reader
    runs under a 1 GiB address-space limit, so a regression is a ``MemoryError``, not a dead host."""
    ledger = sk.ProgressLedger(tmp_path / "progress.json", world_size=2)
    ledger.initialize()
    raw = ledger.manifest_path.read_bytes()
    ledger.manifest_path.write_bytes(reseal_ledger(raw.replace(b'"world_size":2', b'"world_size":1000000000000')))
    script = (
        "import json, resource, sys\nimport shardkeep as sk\n"
        + textwrap.dedent(REPORT_ERROR)
        + textwrap.dedent("""
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
        try:
            sk.ProgressLedger(sys.argv[1]).read()
        except sk.ShardkeepError as exc:
            report(exc)
        """)
    )
    result = run_python(script, str(ledger.manifest_path))
    assert result["type"] == "LedgerCorruptedError" and "world_size 1000000000000" in result["message"], result


# -- the zstd decoder wrapper --------------------------------------------------------------------


def test_the_zstd_decoder_wrapper_turns_decoder_errors_into_problems(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The digest of a compressed file is of its uncompressed bytes, so the decoder runs before
    any digest check and its errors are reachable (the zstd cases above). ``check_shard``, the
    wrapper around it, turns every ``ZstdError`` into a problem naming the file and never raises
    it; ``load`` then raises one ``IntegrityError`` listing the problems."""
    import zstandard

    from shardkeep.io import check_shard
    from shardkeep.storage import LocalStore

    checkpoint = saved(tmp_path, options=sk.WriteOptions(compression="zstd"))
    record = sk.read_manifest(checkpoint).files[0]
    store, path = LocalStore(tmp_path), f"ckpt/{record.path}"
    assert check_shard(store, path, record, verify=True, keep=False) == (None, [])

    class RefusingDecompressor:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def stream_reader(self, *args: Any, **kwargs: Any) -> Any:
            raise zstandard.ZstdError("the decoder refused")

    monkeypatch.setattr(zstandard, "ZstdDecompressor", RefusingDecompressor)
    for verify in (True, False):
        data, problems = check_shard(store, path, record, verify=verify, keep=True)
        assert data is None and problems == [f"{record.path}: cannot be decompressed (the decoder refused)"]
    with pytest.raises(sk.IntegrityError, match=r"safetensors\.zst: cannot be decompressed \(the decoder refused\)"):
        sk.load(checkpoint)

    monkeypatch.undo()
    with pytest.raises(zstandard.ZstdError):  # what the wrapper maps: the real decoder on garbage
        zstandard.get_frame_parameters(b"\x00" * 32)
    shard = shard_of(checkpoint)
    shard.chmod(0o644)
    shard.write_bytes(b"\x00" * shard.stat().st_size)
    data, problems = check_shard(store, path, record, verify=True, keep=True)
    assert data is None and len(problems) == 1 and "cannot be decompressed (cannot get frame parameters" in problems[0]
