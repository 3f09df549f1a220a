"""Simulated power loss at every operation of a save, and the mutation
check: with any one fsync of the save removed, the same sweep finds a violation.

A ``kill -9`` cannot see a missing fsync, because the page cache survives the kill. Here the
disk is simulated (``powerloss.PowerLossStore``): a power cut loses every file write not yet
fsynced and every directory change whose directory was not fsynced since. After each cut the
surviving disk must hold the previous checkpoint intact, and every checkpoint that looks
committed must verify and load; after a save that returned, the new checkpoint must survive.

The format 2.0 configuration saves DTensors on a 1-rank gloo group with a 1-rank device mesh
(the simulated disk lives in one process), which writes a rank index like a multi-rank save;
its sweeps run in a forked rank.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import shardkeep as sk
from shardkeep.manifest import is_staging_name
from tests.reliability.powerloss import PowerCut, PowerLossStore
from tests.support.distributed_harness import results_or_raise, run_ranks
from tests.support.figures import FULL, record

KEY = Ed25519PrivateKey.generate()


@dataclass(frozen=True)
class Config:
    name: str
    tensors: int
    options: dict[str, Any]
    #: DTensors on a 1-rank device mesh (format 2.0), saved in a forked 1-rank gloo group.
    format2: bool = False


CONFIGS = [
    Config("3 files, signed", 3, {"options": sk.WriteOptions(file_size_target=5_000), "signer": KEY}),
    Config(
        "format 2.0, 1 gloo rank, signed",
        3,
        {"options": sk.WriteOptions(file_size_target=5_000), "signer": KEY},
        format2=True,
    ),
    Config("8 files, zstd", 8, {"options": sk.WriteOptions(file_size_target=5_000, compression="zstd")}),
]
if not FULL:
    CONFIGS = CONFIGS[:2]


def _state(config: Config, seed: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {f"layer{i}": torch.randn(32, 32, generator=generator) for i in range(config.tensors)}
    state["step"] = seed
    if config.format2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (1,))
        state["layer0"] = distribute_tensor(state["layer0"], mesh, [Shard(0)])
        state["layer1"] = distribute_tensor(state["layer1"], mesh, [Replicate()])
    return state


def _whole(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def _violations(disk: Any, returned: bool, config: Config) -> list[str]:
    problems: list[str] = []
    names = [name for name, _ in disk.list_dir("")]
    if "step_1" not in names:
        problems.append("the previous checkpoint step_1 is gone")
    if returned and "step_2" not in names:
        problems.append("save() returned, but step_2 did not survive the power loss")
    for name in names:
        if is_staging_name(name):
            continue  # never read as a checkpoint
        signed = "signer" in config.options
        report = sk.verify(name, storage=disk, public_key=KEY.public_key() if signed else None)
        if not report.ok:
            problems.append(f"{name} looks committed but fails to verify: {report.problems[:2]}")
            continue
        if config.format2 and sk.read_manifest(name, storage=disk).metadata_version != "2.1":
            problems.append(f"{name} is not a format 2.1 checkpoint")
        loaded = sk.load(name, storage=disk)
        expected = _state(config, int(name.split("_")[1]))
        if not all(torch.equal(loaded[key], _whole(value)) for key, value in expected.items() if key != "step"):
            problems.append(f"{name} loads different data")
    return problems


def _sweep(config: Config, skip_sync: int | None = None, *, into_empty: bool = False) -> tuple[int, int, list[str]]:
    """Cut the power at every operation of saving step_2 (and once after it returned), into an
    existing, durable, empty directory step_2 when ``into_empty``. Returns (operations, fsyncs,
    violations)."""
    base = PowerLossStore()
    sk.save(_state(config, 1), "step_1", storage=base, **config.options)
    if into_empty:
        base._dir(["step_2"], create=True)
        base.sync_dir("")
    probe = copy.deepcopy(base)
    probe.arm(None)
    sk.save(_state(config, 2), "step_2", storage=probe, **config.options)
    total, syncs = len(probe.operations), len(probe.syncs)
    violations: list[str] = []
    for cut in range(1, total + 2):
        store = copy.deepcopy(base)
        store.arm(cut if cut <= total else None, skip_sync)
        returned = False
        try:
            sk.save(_state(config, 2), "step_2", storage=store, **config.options)
            returned = True
        except sk.StorageError as exc:
            assert isinstance(exc, PowerCut) or "power" in str(exc), f"cut {cut}: an unexpected error {exc!r}"
        where = store.operations[cut - 1] if cut <= total else "after save() returned"
        violations += [
            f"cut at {cut} ({where}): {problem}" for problem in _violations(store.after_power_loss(), returned, config)
        ]
    return total, syncs, violations


def _in_process(config: Config, tmp_path: Path, function: Any) -> Any:
    """``function(config)`` here, or for a format 2.0 configuration in a forked 1-rank gloo group."""
    if not config.format2:
        return function(config)

    def on_rank(rank: int, world_size: int) -> Any:
        return function(config)

    return results_or_raise(run_ranks(1, on_rank, outbox=tmp_path / "outbox", timeout=280))[0]


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_power_loss_at_every_operation_of_a_save(config: Config, tmp_path: Path) -> None:
    total, syncs, violations = _in_process(config, tmp_path, _sweep)
    record(
        "power loss",
        trials=total + 1,
        failures=len(violations),
        detail=f"{config.name}: power cut before each of {total} operations and after the save returned",
    )
    assert total >= 15 and syncs >= 6
    assert violations == []


def _unneeded_fsyncs(config: Config) -> tuple[list[str], list[str]]:
    """(the save's fsyncs, those whose removal the sweep does not catch)."""
    probe = PowerLossStore()
    sk.save(_state(config, 1), "step_1", storage=probe, **config.options)
    probe.arm(None)
    sk.save(_state(config, 2), "step_2", storage=probe, **config.options)
    fsyncs = list(probe.syncs)
    unneeded: list[str] = []
    for index, what in enumerate(fsyncs, start=1):
        _, _, violations = _sweep(config, skip_sync=index)
        if not violations:
            unneeded.append(f"#{index} {what}")
    return fsyncs, unneeded


@pytest.mark.parametrize(
    "config",
    [pytest.param(c, marks=[pytest.mark.slow] if c.format2 else []) for c in CONFIGS],  # about 6 s in a forked rank
    ids=[c.name for c in CONFIGS],
)
def test_removing_any_fsync_makes_the_power_loss_check_fail(config: Config, tmp_path: Path) -> None:
    fsyncs, unneeded = _in_process(config, tmp_path, _unneeded_fsyncs)
    if config.format2:  # the rank index is written durably: its fsync and its directory's are checked
        assert any("/index/rank_00000.json" in what for what in fsyncs), fsyncs
        assert any(what.endswith("/index") for what in fsyncs), fsyncs
    record(
        "power loss: mutation check",
        trials=len(fsyncs),
        failures=len(unneeded),
        detail=f"{config.name}: each of the save's {len(fsyncs)} fsyncs removed in turn; a failure is a removal "
        "the sweep did not catch",
    )
    assert unneeded == [], f"removing these fsyncs went unnoticed: {unneeded}"


def test_power_loss_at_every_operation_of_a_save_into_an_empty_directory() -> None:
    """The final rename replaces the empty directory: at every cut, step_2 is absent (or the
    empty directory) or a whole checkpoint, and step_1 is intact."""
    config = CONFIGS[0]
    total, _, violations = _sweep(config, into_empty=True)
    record(
        "power loss",
        trials=total + 1,
        failures=len(violations),
        detail=f"{config.name}, into an empty directory: power cut before each of {total} operations",
    )
    assert total >= 15 and violations == []
