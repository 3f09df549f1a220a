"""How the golden checkpoints ``v1.1``-``v1.3`` and the golden ledger were made.

Each ``v<version>/step_00000042`` holds format ``<version>`` as the code that wrote that format
writes it: a checkout of that code beside this one, put first on the path::

    PYTHONPATH=/path/to/old/checkout/src .venv/bin/python tests/golden/make_golden_checkpoint.py OUT
    PYTHONPATH=src .venv/bin/python tests/golden/make_golden_checkpoint.py OUT --ledger

(format 1.1: commit ee04182, 1.2: 5587072, 1.3: b925bbe.) They are never regenerated once
committed: the tests read the committed bytes, so a reader change that breaks old checkpoints
fails loudly.

``v1.3-dtypes/step_00000042`` holds one tensor of each dtype that a shard's safetensors header
carries under another dtype (complex128, complex32, float8_e8m0fnu, float4_e2m1fn_x2 and the
``bits*`` dtypes: the manifest records the true dtype), in format 1.3 (the code after commit
4c930e2 stores these dtypes)::

    PYTHONPATH=src .venv/bin/python tests/golden/make_golden_checkpoint.py tests/golden --dtypes

``v2.0/step_00000042`` (format 2.0: DTensors described once, chunks in rank indexes) was
written by a real 2-rank gloo save (this script forks the 2 ranks itself)::

    PYTHONPATH=src .venv/bin/python tests/golden/make_golden_checkpoint.py tests/golden --v2

(format 2.0 with the rank indexes as a column table, from the code after commit 2874581; the
manager's ``last`` pointer file is removed, as for 1.x.) Its state: on a 1-D mesh of 2, ``model.w`` Shard(0),
``model.col`` Shard(1), ``model.rep`` Replicate and ``model.uneven`` Shard(0) of 3 rows (2 and
1); a whole tensor, a bf16 tensor and JSON values (:func:`golden_v2_state`).
"""

import sys
from pathlib import Path

import torch

import shardkeep as sk

# The versions saves write (what the golden directories are named after).
from shardkeep.manifest import WRITTEN_INDEXED_VERSION as INDEXED_VERSION
from shardkeep.manifest import WRITTEN_METADATA_VERSION as METADATA_VERSION


def golden_state() -> dict:
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.copy_(torch.arange(12, dtype=torch.float32).reshape(3, 4) / 10)
        model.bias.copy_(torch.tensor([0.5, -0.5, 1.0]))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.ones(2, 4)).sum().backward()
    optim.step()
    return {
        "model": model,
        "optim": optim,
        "experts": {"experts.0.w": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)},
        "step": 42,
        "config": {"name": "golden", "lr": 0.01},
    }


def golden_v2_values() -> dict:
    """The values of the format 2.0 golden state, whole (as a load on one process returns them)."""
    return {
        "model": {
            "w": torch.arange(8, dtype=torch.float32).reshape(4, 2) / 4,
            "col": torch.arange(8, dtype=torch.int64).reshape(2, 4) - 3,
            "rep": torch.tensor([1.5, -2.0, 3.25], dtype=torch.float64),
            "uneven": torch.arange(6, dtype=torch.float32).reshape(3, 2) * -1,
            "bias": torch.tensor([0.5, -0.5, 1.0]),
        },
        "experts": {"experts.0.w": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)},
        "step": 42,
        "config": {"name": "golden", "lr": 0.01},
    }


def golden_v2_state(world_size: int) -> dict:
    """The format 2.0 golden state as each rank holds it (a process group must be initialized)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    state = golden_v2_values()
    placements = {"w": Shard(0), "col": Shard(1), "rep": Replicate(), "uneven": Shard(0)}
    for key, placement in placements.items():
        state["model"][key] = distribute_tensor(state["model"][key], mesh, [placement])
    return state


def _save_v2(rank: int, world_size: int, out: str) -> str:
    manager = sk.CheckpointManager(out, keep_last=1, keep_best=0, run_id="golden-run")
    manager.save(golden_v2_state(world_size), step=42, metrics={"val_loss": 0.25})
    return sk.read_manifest(Path(out) / "step_00000042").metadata_version


def make_v2(out: Path) -> None:
    """``v2.0/step_00000042``, saved by 2 forked gloo ranks."""
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
    from tests.support.distributed_harness import results_or_raise, run_ranks

    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as outbox:
        versions = results_or_raise(run_ranks(2, _save_v2, str(out), outbox=Path(outbox)))
    assert versions == [INDEXED_VERSION, INDEXED_VERSION], versions
    print(out, INDEXED_VERSION)


#: Bytes per block of the format 2.1 golden (forced, so that small tensors get several blocks).
GOLDEN_BLOCK_SIZE = 16 << 10


def golden_v21_values() -> dict:
    """The values of the format 2.1 golden state, whole: the 2.0 golden's, plus ``model.big``
    (96 KiB: 3 blocks of 16 KiB per chunk on 2 ranks), ``model.table`` (a whole 64 KiB tensor:
    4 fast-only blocks), four experts ``experts.<i>.w`` sharded
    alike (one tensor family) and four ``optim.state.<i>.step`` scalars (one entry family)."""
    values = golden_v2_values()
    values["model"]["big"] = (torch.arange(64 * 384, dtype=torch.float32) % 1000).reshape(64, 384) / 8
    values["model"]["table"] = torch.arange(16384, dtype=torch.float32) / 16  # whole, 64 KiB: fast-only blocks
    values["experts"] = {
        f"experts.{i}.w": torch.full((4, 2), float(i)) + torch.arange(8).reshape(4, 2) for i in range(4)
    }
    values["optim"] = {"state": {i: {"step": torch.tensor(float(10 + i))} for i in range(4)}}
    return values


def golden_v21_state(world_size: int) -> dict:
    """The format 2.1 golden state as each rank holds it (a process group must be initialized)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    state = golden_v21_values()
    placements = {"w": Shard(0), "col": Shard(1), "rep": Replicate(), "uneven": Shard(0), "big": Shard(0)}
    for key, placement in placements.items():
        state["model"][key] = distribute_tensor(state["model"][key], mesh, [placement])
    for key, value in state["experts"].items():
        state["experts"][key] = distribute_tensor(value, mesh, [Shard(0)])
    return state


def _save_v21(rank: int, world_size: int, out: str) -> str:
    options = sk.WriteOptions(block_size=GOLDEN_BLOCK_SIZE)
    manager = sk.CheckpointManager(out, keep_last=1, keep_best=0, run_id="golden-run", options=options)
    manager.save(golden_v21_state(world_size), step=42, metrics={"val_loss": 0.25})
    return sk.read_manifest(Path(out) / "step_00000042").metadata_version


def make_v21(out: Path) -> None:
    """``v2.1/step_00000042``, saved by 2 forked gloo ranks with 16 KiB blocks."""
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
    from tests.support.distributed_harness import results_or_raise, run_ranks

    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as outbox:
        versions = results_or_raise(run_ranks(2, _save_v21, str(out), outbox=Path(outbox)))
    assert versions == [INDEXED_VERSION, INDEXED_VERSION], versions
    (out / "last").unlink(missing_ok=True)
    print(out, INDEXED_VERSION)


#: The dtypes stored under a carrier dtype in the safetensors header (the manifest records the
#: true one), with the golden tensor of each: ``golden_dtype_bytes(width, count)`` viewed as it.
GOLDEN_CARRIED_DTYPES = {
    "complex128": (16, 3),
    "complex32": (4, 3),
    "float8_e8m0fnu": (1, 5),
    "float4_e2m1fn_x2": (1, 5),
    "bits8": (1, 5),
    "bits16": (2, 4),
    "bits1x8": (1, 5),
    "bits2x4": (1, 5),
    "bits4x2": (1, 5),
}


def golden_dtype_bytes(width: int, count: int) -> torch.Tensor:
    """``count`` elements of ``width`` bytes each, as a (count, width) uint8 tensor of fixed bytes."""
    return (torch.arange(count * width, dtype=torch.int64) * 37 % 251).to(torch.uint8).reshape(count, width)


def golden_dtypes_state() -> dict:
    """One tensor of each dtype of :data:`GOLDEN_CARRIED_DTYPES`, plus a float32 one."""
    state: dict = {"plain": torch.arange(4, dtype=torch.float32)}
    for name, (width, count) in GOLDEN_CARRIED_DTYPES.items():
        state[name] = golden_dtype_bytes(width, count).view(getattr(torch, name)).reshape(count)
    return state


def main() -> None:
    if "--dtypes" in sys.argv:
        out = Path(sys.argv[1]) / f"v{METADATA_VERSION}-dtypes"
        out.mkdir(parents=True)
        sk.save(golden_dtypes_state(), out / "step_00000042", step=42)
        print(out, METADATA_VERSION)
        return
    if "--v2" in sys.argv:
        make_v2(Path(sys.argv[1]) / f"v{INDEXED_VERSION}")
        return
    if "--v2.1" in sys.argv:
        make_v21(Path(sys.argv[1]) / f"v{INDEXED_VERSION}")
        return
    if "--ledger" in sys.argv:
        make_ledger(Path(sys.argv[1]) / "ledger-v1")
        return
    out = Path(sys.argv[1]) / f"v{METADATA_VERSION}"
    out.mkdir(parents=True)
    manager = sk.CheckpointManager(out, keep_last=1, keep_best=0, run_id="golden-run")
    manager.save(golden_state(), step=42, metrics={"val_loss": 0.25})
    print(out, METADATA_VERSION)


def make_ledger(directory: Path) -> None:
    """``ledger-v1/progress.json``: a ledger of 2 shards, one with two recorded batches."""
    directory.mkdir(parents=True)
    (directory / "batch_0.bin").write_bytes(b"0")
    (directory / "batch_1.bin").write_bytes(b"1")
    ledger = sk.ProgressLedger(directory / "progress.json", 2)
    ledger.initialize(input_fingerprint="golden-input", model_config_hash="golden-model")
    ledger.update_shard_checkpoint(0, 0, 10, "batch_0.bin", "0-9")
    ledger.update_shard_checkpoint(0, 1, 12, "batch_1.bin", "10-21")


if __name__ == "__main__":
    main()
