"""Every failure is its own ShardkeepError subclass with the original error as __cause__: an
unusable manager root, a failure inside the manager's coordinator-only steps, a manager that
requires signatures but cannot sign, and shardkeep without torch."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import shardkeep as sk


def test_a_root_that_is_a_file_is_a_storage_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(sk.StorageError, match=r"file.*is a file, not a directory") as caught:
        sk.CheckpointManager(tmp_path / "file")
    assert isinstance(caught.value.__cause__, OSError)
    with pytest.raises(sk.StorageError, match=r"lies under a file") as caught:
        sk.CheckpointManager(tmp_path / "file" / "root")
    assert isinstance(caught.value.__cause__, OSError)


@pytest.fixture
def read_only_mount(tmp_path: Path) -> Iterator[Path]:
    """A real read-only filesystem (a tmpfs mounted ro); needs the privilege to mount."""
    mount_point = tmp_path / "ro"
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", f"shardkeep-ro-{uuid.uuid4().hex[:6]}", str(mount_point)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def test_a_root_on_a_read_only_filesystem_is_a_storage_error(read_only_mount: Path) -> None:
    with pytest.raises(sk.StorageError, match="read-only filesystem") as caught:
        sk.CheckpointManager(read_only_mount / "root")
    assert isinstance(caught.value.__cause__, OSError)
    manager = sk.CheckpointManager(read_only_mount, keep_last=1, keep_best=0)  # exists: reading works
    with pytest.raises(sk.CheckpointNotFoundError):
        manager.restore()
    with pytest.raises(sk.StorageError) as saved:
        manager.save({"w": torch.ones(2)}, step=1)
    assert saved.value.__cause__ is not None


def test_a_storage_error_while_scanning_keeps_its_type(tmp_path: Path) -> None:
    """One process: a failure in the coordinator's scan of the root (here the root replaced by
    a file after the manager opened it) is raised as itself, not as a CoordinationError."""
    root = tmp_path / "root"
    manager = sk.CheckpointManager(root, keep_last=1, keep_best=0)
    manager.save({"w": torch.ones(2)}, step=1)
    shutil.rmtree(root)
    root.write_text("a file now")
    for attempt in (lambda: manager.save({"w": torch.ones(2)}, step=2), manager.restore):
        with pytest.raises(sk.StorageError) as caught:
            attempt()
        assert isinstance(caught.value.__cause__, OSError), caught.value.__cause__


def test_same_error_rebuilds_the_class_by_name() -> None:
    from shardkeep.errors import same_error

    assert type(same_error("StorageError", "disk")) is sk.StorageError
    assert type(same_error("SignatureError", "bad")) is sk.SignatureError
    assert type(same_error("RunMismatchError", "other run")) is sk.RunMismatchError
    # Every class is rebuilt as itself, whatever its constructor takes, with the message as sent.
    too_new = same_error("ManifestVersionError", "too new", {"found": "9.0", "supported": "2.0"})
    assert type(too_new) is sk.ManifestVersionError and isinstance(too_new, sk.ManifestError)
    assert str(too_new) == "too new" and (too_new.found, too_new.supported) == ("9.0", "2.0")
    differs = same_error("FingerprintMismatchError", "differs")
    assert type(differs) is sk.FingerprintMismatchError and differs.differences == []
    field = same_error("CheckpointFieldError", "TrainingCheckpoint field 'rng': bad", {"field": "rng"})
    assert type(field) is sk.CheckpointFieldError and str(field).endswith("'rng': bad") and field.field == "rng"
    corrupted = same_error(
        "LedgerCorruptedError", "no valid copy", {"manifest_path": "/l.json", "ledger_path": "/l.json"}
    )
    assert isinstance(corrupted, sk.ManifestCorruptedError) and corrupted.ledger_path == "/l.json"
    assert corrupted.problems == {}
    integrity = same_error("IntegrityError", "digest")
    assert type(integrity) is sk.IntegrityError and integrity.problems == ["digest"]
    assert type(same_error("NoSuchError", "x")) is sk.ShardkeepError
    assert str(same_error("StorageError", "disk")) == "disk"
    retention = same_error("RetentionError", "pruning failed", {"checkpoint": "step_00000002"})
    assert isinstance(retention, sk.RetentionError) and retention.checkpoint == "step_00000002"


def test_a_manager_that_requires_signatures_must_be_able_to_sign(tmp_path: Path) -> None:
    key = Ed25519PrivateKey.generate()
    with pytest.raises(sk.ConfigError, match=r"requires signed checkpoints.*no signer="):
        sk.CheckpointManager(tmp_path / "a", public_key=key.public_key())
    with pytest.raises(sk.ConfigError, match="no signer="):
        sk.CheckpointManager(tmp_path / "a", public_key=key.public_key(), require_signature=True)
    assert not (tmp_path / "a").exists()
    signing = sk.CheckpointManager(tmp_path / "root", signer=key, public_key=key.public_key(), keep_best=0)
    signing.save({"w": torch.ones(3)}, step=1)
    reader = sk.CheckpointManager(tmp_path / "root", public_key=key.public_key(), read_only=True)
    assert torch.equal(reader.restore().state["w"], torch.ones(3))
    with pytest.raises(sk.ConfigError, match="read_only"):
        reader.save({"w": torch.ones(3)}, step=2)
    with pytest.raises(sk.ConfigError, match="read_only"):
        reader.prune()
    assert sorted(p.name for p in (tmp_path / "root").iterdir() if p.name.startswith("step_")) == ["step_00000001"]
    with pytest.raises(sk.CheckpointNotFoundError, match="absent"):
        sk.CheckpointManager(tmp_path / "absent", read_only=True, keep_best=0).restore()
    assert not (tmp_path / "absent").exists()


def test_save_without_torch_is_a_dependency_error(tmp_path: Path) -> None:
    """A Python in which ``import torch`` fails (as when it is not installed)."""
    script = (
        "import sys; sys.modules['torch'] = None\n"  # makes 'import torch' raise ModuleNotFoundError
        "import shardkeep as sk\n"
        "try:\n"
        "    sk.save({'x': 1}, sys.argv[1])\n"
        "except sk.DependencyError as exc:\n"
        "    assert isinstance(exc, sk.ShardkeepError) and isinstance(exc, ImportError)\n"
        "    assert isinstance(exc.__cause__, ModuleNotFoundError), exc.__cause__\n"
        "    print('DependencyError:', exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "c")], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "DependencyError: shardkeep.save needs PyTorch" in done.stdout and "pip install torch" in done.stdout


# Each public error class with every class it derived from before the tree was grouped (builtins
# named by name). Code that catches any of these must keep catching the same errors.
ANCESTORS: dict[str, set[str]] = {
    "BatchFileMissingError": {"LedgerError", "ShardkeepError", "FileNotFoundError"},
    "CheckpointExistsError": {"ShardkeepError"},
    "CheckpointFieldError": {"ShardkeepError"},
    "CheckpointNotFoundError": {"ShardkeepError"},
    "ConfigError": {"UnsupportedValueError", "ShardkeepError"},
    "CoordinationError": {"ShardkeepError"},
    "DependencyError": {"ShardkeepError", "ImportError"},
    "FingerprintMismatchError": {"ShardkeepError"},
    "IntegrityError": {"ShardkeepError"},
    "LedgerError": {"ShardkeepError"},
    "LedgerLockTimeoutError": {"LedgerError", "ShardkeepError", "TimeoutError"},
    "LedgerMismatchError": {"LedgerError", "ShardkeepError"},
    "LedgerNotFoundError": {"LedgerError", "ShardkeepError", "FileNotFoundError"},
    "LedgerStateError": {"LedgerError", "ShardkeepError"},
    "ManifestCorruptedError": {"LedgerError", "ShardkeepError"},
    "ManifestError": {"ShardkeepError"},
    "ManifestVersionError": {"ManifestError", "ShardkeepError"},
    "RetentionError": {"ShardkeepError"},
    "RunMismatchError": {"ShardkeepError"},
    "SaveInProgressError": {"ShardkeepError"},
    "ShardkeepError": set(),
    "SignatureError": {"IntegrityError", "ShardkeepError"},
    "StateMismatchError": {"UnsupportedValueError", "ShardkeepError"},
    "StorageError": {"ShardkeepError"},
    "TierBudgetError": {"ConfigError", "UnsupportedValueError", "ShardkeepError"},
    "UnsafePathError": {"ShardkeepError"},
    "UnsupportedValueError": {"ShardkeepError"},
}

# The intermediate bases and the classes each one groups.
GROUPS: dict[str, set[str]] = {
    "UsageError": {
        "UnsupportedValueError",
        "StateMismatchError",
        "ConfigError",
        "TierBudgetError",
        "UnknownOptionError",
        "CommitRefusedError",
        "CheckpointFieldError",
        "SaveInProgressError",
        "LevelConfigError",
        "PreemptionHandlerError",
    },
    "CheckpointDataError": {
        "ManifestError",
        "ManifestVersionError",
        "IntegrityError",
        "SignatureError",
        "UnsafePathError",
    },
    "StorageError": {"LevelUnreachableError", "DrainError"},
    "CheckpointNotFoundError": {"NoCompleteStepError"},
    "ManagerError": {"RunMismatchError", "FingerprintMismatchError", "RetentionError"},
    "PlacementError": {"TierBudgetError"},
    "LedgerError": {
        "LedgerCorruptedError",
        "LedgerNotFoundError",
        "LedgerMismatchError",
        "LedgerStateError",
        "BatchFileMissingError",
        "LedgerLockTimeoutError",
    },
}


def _error_class(name: str) -> type[BaseException]:
    import builtins

    from shardkeep import errors

    found = getattr(errors, name, None) or getattr(builtins, name)
    assert isinstance(found, type) and issubclass(found, BaseException), name
    return found


def test_every_error_is_caught_by_exactly_what_caught_it_before() -> None:
    """Among the classes that existed before the grouping, ``except B`` catches ``A`` exactly
    when it did then: no relation lost, none gained."""
    for name, ancestors in ANCESTORS.items():
        klass = _error_class(name)
        for ancestor in ancestors:
            assert issubclass(klass, _error_class(ancestor)), f"except {ancestor} no longer catches {name}"
        for other in ANCESTORS.keys() - ancestors - {name}:
            gained = issubclass(klass, _error_class(other)) and _error_class(other) is not klass
            assert not gained, f"except {other} now catches {name}"


def test_the_intermediate_bases_group_their_classes() -> None:
    from shardkeep import errors

    for base, members in GROUPS.items():
        base_class = _error_class(base)
        assert issubclass(base_class, sk.ShardkeepError) and getattr(sk, base) is base_class, base
        grouped = {name for name in errors.__all__ if name[0].isupper() and issubclass(_error_class(name), base_class)}
        assert grouped - {base, "ManifestCorruptedError"} == members, base
    assert sk.ManifestCorruptedError is sk.LedgerCorruptedError
    corrupted = sk.ManifestCorruptedError("no valid copy", "/job/progress.json")
    assert corrupted.ledger_path == corrupted.manifest_path == "/job/progress.json"
    # A refused commit stays an UnsupportedValueError, as before it had its own class.
    assert issubclass(sk.CommitRefusedError, sk.UnsupportedValueError)
    assert not issubclass(sk.CommitRefusedError, sk.ConfigError)
    # Nothing on storage is a usage error, and no usage error is about the data.
    assert not issubclass(sk.CheckpointDataError, sk.UsageError) and not issubclass(
        sk.UsageError, sk.CheckpointDataError
    )


def test_the_tree_drawn_in_the_docstring_names_every_error() -> None:
    from shardkeep import errors

    drawn = set(re.findall(r"\b([A-Z]\w+Error)\b", (errors.__doc__ or "").partition("::")[2]))
    public = {name for name in errors.__all__ if name.endswith("Error")}
    assert public - drawn == set()
