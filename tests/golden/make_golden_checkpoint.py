"""How the golden checkpoints ``v1.1``-``v1.3`` and the golden ledger were made.

Each ``v<version>/step_00000042`` was written by the shardkeep of that format version: the last
commit before the next version, checked out beside this one and put first on the path::

    PYTHONPATH=/path/to/old/checkout/src .venv/bin/python tests/golden/make_golden_checkpoint.py OUT
    PYTHONPATH=src .venv/bin/python tests/golden/make_golden_checkpoint.py OUT --ledger

(1.1: ee04182, 1.2: 5587072, 1.3: this session's code.) They are never regenerated once
committed: the tests read the committed bytes, so a reader change that breaks old checkpoints
fails loudly.
"""

import sys
from pathlib import Path

import torch

import shardkeep as sk
from shardkeep.manifest import METADATA_VERSION


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


def main() -> None:
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
