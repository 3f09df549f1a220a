"""A single-process tour of shardkeep: save, inspect, verify, load, catch damage, and keep the
last and best checkpoints of a short training run with a CheckpointManager.

    python examples/quickstart.py [--out DIR] [--force]

It writes into ``--out`` (default ``demo-output/`` at the top of the repository) and prints what
each step shows. The directory is created and marked as this script's; a later run empties and
reuses only a directory it marked itself. Any other non-empty directory is refused (exit 2,
nothing deleted) unless ``--force`` is given. The multi-rank training demo is ``make demo``
(``examples/demo.py``).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from output_dir import OutputDirError, prepare_output

import shardkeep as sk

OUT = Path(__file__).resolve().parent.parent / "demo-output"


def banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def train_a_little(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> float:
    generator = torch.Generator().manual_seed(0)
    loss = torch.tensor(0.0)
    for _ in range(steps):
        inputs = torch.randn(32, 64, generator=generator)
        target = inputs.sum(dim=1, keepdim=True)
        loss = torch.nn.functional.mse_loss(model(inputs), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return float(loss.detach())


def cli(*args: str) -> int:
    print(f"$ shardkeep {' '.join(args)}", flush=True)
    return subprocess.run([sys.executable, "-m", "shardkeep", *args], check=False).returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--out", type=Path, default=OUT, help=f"output directory, new or made by this script (default {OUT})"
    )
    parser.add_argument("--force", action="store_true", help="empty --out even if this script did not make it")
    args = parser.parse_args()
    try:
        out = prepare_output(args.out, "quickstart.py", force=args.force)
    except OutputDirError as exc:
        parser.error(str(exc))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    banner("1. train 50 steps and save model + optimizer + training fields")
    loss = train_a_little(model, optimizer, 50)
    state = {"model": model, "optim": optimizer, "step": 50, "loss": loss, "rng": torch.get_rng_state()}
    checkpoint = out / "step_00000050"
    manifest = sk.save(state, checkpoint, step=50, fields=sk.ManifestFields(model_id="quickstart-mlp"))
    print(
        f"saved {checkpoint} ({len(manifest.files)} file(s), {manifest.total_tensor_bytes} tensor bytes), loss {loss:.4f}"
    )

    banner("2. inspect it (the CLI does not import torch)")
    cli("inspect", str(checkpoint), "--max-tensors", "8")

    banner("3. verify it")
    assert cli("verify", str(checkpoint)) == 0

    banner("4. load into a fresh model and optimizer, in place")
    fresh_model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1))
    fresh_optimizer = torch.optim.AdamW(fresh_model.parameters(), lr=1e-3)
    target = {"model": fresh_model, "optim": fresh_optimizer, "step": 0, "loss": 0.0, "rng": torch.get_rng_state()}
    sk.load(checkpoint, into=target)
    same = all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh_model.state_dict().values(), strict=True)
    )
    print(f"weights identical after load: {same}; step restored: {target['step']}")
    assert same and target["step"] == 50

    banner("5. flip one byte in a copy of the shard: verify and load both refuse it")
    damaged = out / "step_00000050-damaged"
    shutil.copytree(checkpoint, damaged)
    shard = damaged / manifest.files[0].path
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0x01
    shard.write_bytes(bytes(data))
    assert cli("verify", str(damaged)) == 1
    try:
        sk.load(damaged)
    except sk.IntegrityError as exc:
        print(f"load refused the damaged checkpoint: {exc}")
    else:
        raise SystemExit("load accepted a damaged checkpoint")

    banner("6. a second save onto the same step is refused; the first is untouched")
    try:
        sk.save(state, checkpoint)
    except sk.CheckpointExistsError as exc:
        print(f"refused: {exc}")
    assert sk.verify(checkpoint).ok

    banner("7. a CheckpointManager: keep the last 2 and the best 1 by validation loss")
    root = out / "managed"
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    checkpoint_state = sk.TrainingCheckpoint(
        model=model,
        optimizer=optimizer,
        model_args={"layers": [64, 32, 1]},
        iteration=0,
        best_val_loss=None,
        config={"lr": 1e-3},
    )  # every save records the RNG states of that moment; restore(into=...) puts them back
    manager = sk.CheckpointManager(root, keep_last=2, keep_best=1)
    manager.save(checkpoint_state, step=0)  # right after init: both last and best
    for step, val_loss in [(10, 3.0), (20, 1.0), (30, 2.0), (40, 2.5)]:
        train_a_little(model, optimizer, steps=2)
        checkpoint_state.iteration = step
        checkpoint_state.best_val_loss = min(val_loss, checkpoint_state.best_val_loss or val_loss)
        entry = manager.save(checkpoint_state, step=step, metrics={"val_loss": val_loss})
        print(f"saved {entry.name}: last={entry.is_last} best={entry.is_best}")
    assert cli("ls", str(root)) == 0

    banner("8. the newest checkpoint is damaged: restore falls back to the previous one")
    newest = root / "step_00000040"
    shard = next(newest.rglob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0x01
    shard.write_bytes(bytes(data))
    resumed = sk.CheckpointManager(root, keep_last=2, keep_best=1)
    restored = resumed.restore()
    print(f"restored step {restored.step}; skipped {[name for name, _ in restored.skipped]}")
    assert restored.step == 30 and isinstance(restored.state, sk.TrainingCheckpoint)
    print("\nquickstart finished: all steps behaved as expected")


if __name__ == "__main__":
    main()
