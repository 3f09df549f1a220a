"""Pickle payloads that try to create a sentinel file, fed to every public load API with
``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` set: none may run."""

from __future__ import annotations

import io
import os
import pickle
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import shardkeep as sk
from shardkeep.cli import main
from shardkeep.interop import import_checkpoint
from tests.support.figures import record


class _Payload:
    """Unpickling this calls ``exec``, which creates the sentinel file."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({str(self.sentinel)!r}, 'w').close()",))


def _payloads(sentinel: Path, work: Path) -> dict[str, bytes]:
    """Byte strings that run code when unpickled (checked: each does, with pickle.loads)."""
    plain = pickle.dumps(_Payload(sentinel))
    nested = pickle.dumps({"model": {"weight": _Payload(sentinel)}})
    torch_zip = work / "payload.pt"
    torch.save({"w": torch.zeros(2), "evil": _Payload(sentinel)}, torch_zip)
    legacy = io.BytesIO()
    torch.save({"evil": _Payload(sentinel)}, legacy, _use_new_zipfile_serialization=False)
    return {
        "plain pickle": plain,
        "pickle in a dict": nested,
        "torch zip file": torch_zip.read_bytes(),
        "legacy torch file": legacy.getvalue(),
    }


def _checkpoint(root: Path) -> Path:
    path = root / "step_00000001"
    sk.save({"w": torch.arange(4.0), "step": 1}, path, step=1)
    return path


def _targets(work: Path, payload: bytes) -> dict[str, Callable[[], Any]]:
    """Every public load API, each pointed at a place where the payload sits."""

    def planted(name: str, relative: str) -> Path:
        root = work / name
        checkpoint = _checkpoint(root)
        target = checkpoint / relative
        os.chmod(target, 0o644) if target.exists() else None
        target.write_bytes(payload)
        return checkpoint

    shard = planted("shard", "shards/rank_00000.safetensors")
    manifest = planted("manifest", "manifest.json")
    signature = planted("signature", "manifest.sig")
    pt_file = work / "import.pt"
    pt_file.write_bytes(payload)
    dcp = work / "dcp"
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(payload)
    (dcp / "__0_0.distcp").write_bytes(payload)
    ledger_dir = work / "ledger"
    ledger = sk.ProgressLedger(ledger_dir / "progress.json", world_size=1)
    ledger.initialize()
    sk.save_batch(ledger, {"w": torch.zeros(2)}, shard=0, batch_idx=0, num_sequences=1)
    batch_shard = next(ledger_dir.rglob("*.safetensors"))
    os.chmod(batch_shard, 0o644)
    batch_shard.write_bytes(payload)
    key = work / "key.pem"
    if not key.exists():
        from shardkeep.integrity import generate_key_pair

        generate_key_pair(key, work / "key.pub")
    quiet = {"out": io.StringIO(), "err": io.StringIO()}
    return {
        "load (shard)": lambda: sk.load(shard),
        "load lazy (shard)": lambda: sk.load(shard, select=sk.LoadSelection(lazy=True))["w"] + 1,
        "load (manifest)": lambda: sk.load(manifest),
        "load with key (signature)": lambda: sk.load(signature, public_key=work / "key.pub"),
        "verify (shard)": lambda: sk.verify(shard),
        "verify (manifest)": lambda: sk.verify(manifest),
        "verify (signature)": lambda: sk.verify(signature),
        "read_manifest": lambda: sk.read_manifest(manifest),
        "manager restore": lambda: sk.CheckpointManager(work / "shard").restore(),
        "cli inspect": lambda: main(["inspect", str(manifest)], **quiet),
        "cli verify": lambda: main(["verify", str(shard)], **quiet),
        "cli ls": lambda: main(["ls", str(work / "manifest")], **quiet),
        "load_batch": lambda: sk.load_batch(ledger, 0, 0),
        "ledger read (pickle as the ledger)": lambda: _ledger_from(work / "bad-ledger", payload),
        "import .pt": lambda: import_checkpoint(pt_file, work / "imported-pt"),
        "import as safetensors": lambda: import_checkpoint(pt_file, work / "imported-st", source_format="safetensors"),
        "import DCP (no --trust-pickle)": lambda: import_checkpoint(dcp, work / "imported-dcp"),
        "cli import .pt": lambda: main(["import", str(pt_file), str(work / "cli-imported")], **quiet),
    }


def _ledger_from(directory: Path, payload: bytes) -> Any:
    directory.mkdir(exist_ok=True)
    (directory / "progress.json").write_bytes(payload)
    return sk.ProgressLedger(directory / "progress.json", world_size=1).read()


def test_no_pickle_payload_runs_on_any_load_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    sentinel = tmp_path / "SENTINEL"
    payloads = _payloads(sentinel, tmp_path)
    # The payloads are live: plain pickle runs them (this is what DCP's .metadata reader does).
    pickle.loads(payloads["plain pickle"])
    assert sentinel.exists()
    sentinel.unlink()
    with zipfile.ZipFile(io.BytesIO(payloads["torch zip file"])) as archive:
        assert any(name.endswith("data.pkl") for name in archive.namelist())

    executed: list[str] = []
    untyped: list[str] = []
    trials = 0
    for payload_name, payload in payloads.items():
        work = tmp_path / f"work-{len(executed)}-{trials}"
        work.mkdir()
        for api_name, call in _targets(work, payload).items():
            trials += 1
            try:
                call()
            except sk.ShardkeepError:
                pass
            except Exception as exc:
                untyped.append(f"{payload_name} -> {api_name}: {type(exc).__name__}: {exc}")
            if sentinel.exists():
                executed.append(f"{payload_name} -> {api_name}")
                sentinel.unlink()
        shutil.rmtree(work)
    record(
        "pickle payloads",
        trials=trials,
        failures=len(executed),
        detail=f"{len(payloads)} payloads (plain pickle, nested, torch zip, legacy torch) x "
        f"{trials // len(payloads)} load APIs and places (shard, manifest, signature, ledger, batch, .pt/DCP import, "
        "CLI), with TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1",
    )
    assert executed == []
    assert untyped == []
