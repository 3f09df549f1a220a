"""Distributed checkpointing with shardkeep: run on 2+ ranks with torchrun.

    torchrun --standalone --nproc-per-node 2 examples/distributed_save.py --out /tmp/sk-dist

Every rank holds a model whose weights are sharded across ranks as DTensors (row-wise, as
tensor or FSDP-style sharding would), an AdamW optimizer over them, and a replicated buffer.
The script trains a few steps, saves synchronously and then asynchronously (training goes on
while the second save is written), reloads the newest checkpoint into a fresh model on the same
ranks, checks that every shard matches, and loads it once more without a process group, as one
full state, to show resharding N -> 1.

``--out`` must be new, empty, or an earlier output of this script (which is emptied); any other
non-empty directory is refused (exit 2 on every rank, nothing deleted) unless ``--force``.

Resume a run from its newest checkpoint (the highest step in ``--out``), train ``--steps`` more
steps and save ``step_<N>`` there; the losses continue exactly where the first run's left off
(the same numbers it printed for those steps):

    torchrun --standalone --nproc-per-node 2 examples/distributed_save.py --out /tmp/sk-dist --resume --steps 2
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from output_dir import MARKER, OutputDirError, prepare_output
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import shardkeep as sk


def build(mesh: object, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    generator = torch.Generator().manual_seed(seed)
    model = torch.nn.Module()
    model.w1 = torch.nn.Parameter(distribute_tensor(torch.randn(64, 32, generator=generator), mesh, [Shard(0)]))
    model.w2 = torch.nn.Parameter(distribute_tensor(torch.randn(64, 32, generator=generator), mesh, [Shard(0)]))
    model.register_buffer("scale", torch.ones(32))  # replicated on every rank
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    loss = (model.w1**2).sum() * float(model.scale.mean()) + model.w2.sin().sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    loss = loss.detach()
    return float(loss.full_tensor()) if isinstance(loss, DTensor) else float(loss)


def report_loss(step: int, loss: float) -> None:
    if dist.get_rank() == 0:
        print(f"loss at step {step}: {loss:.10g}", flush=True)


def newest_checkpoint(out: Path) -> Path:
    """The committed checkpoint with the highest step in ``out``, an earlier output of this
    script (:class:`OutputDirError` otherwise)."""
    if not (out / MARKER).is_file():
        raise OutputDirError(f"--resume: {out} is not an output of distributed_save.py; run without --resume first")
    found = []
    for child in out.iterdir():
        if child.is_dir() and (child / "manifest.json").is_file():
            step = sk.read_manifest(child).step
            if step is not None:
                found.append((step, child))
    if not found:
        raise OutputDirError(f"--resume: no checkpoint in {out}; run without --resume first")
    return max(found)[1]


def resume(path: Path, out: Path, steps: int, mesh: object) -> None:
    """Load ``path`` into a fresh model (other weights) on these ranks, train ``steps`` steps,
    save ``step_<N>`` into ``out`` and verify it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = build(mesh, seed=123)  # replaced by the checkpoint's weights and moments
    state = {"model": model, "optim": optimizer, "step": 0}
    sk.load(path, into=state)
    step = int(state["step"])
    if rank == 0:
        print(f"resumed from {path.name} at step {step} on {world} ranks", flush=True)
    for _ in range(steps):
        step += 1
        report_loss(step, train_step(model, optimizer))
    target = out / f"step_{step:08d}"
    sk.save({"model": model, "optim": optimizer, "step": step}, target, step=step)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print(f"saved {target.name}; verify: {'OK' if sk.verify(target).ok else 'FAILED'}")


def main() -> None:
    parser = argparse.ArgumentParser(description="distributed save/load example (run with torchrun)")
    parser.add_argument("--out", type=Path, required=True, help="a directory shared by every rank")
    parser.add_argument("--force", action="store_true", help="empty --out even if this script did not make it")
    parser.add_argument("--steps", type=int, default=3, help="steps to train (with --resume: after the checkpoint)")
    parser.add_argument(
        "--resume", action="store_true", help="continue from the newest checkpoint in --out (an earlier output)"
    )
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    refusal: list[str | None] = [None]
    newest: list[Path | None] = [None]
    if rank == 0:
        try:
            if args.resume:
                newest = [newest_checkpoint(args.out)]
            else:
                prepare_output(args.out, "distributed_save.py", force=args.force)
        except OutputDirError as exc:
            refusal = [str(exc)]
    dist.broadcast_object_list(refusal, src=0)  # every rank stops alike
    if refusal[0] is not None:
        dist.destroy_process_group()
        if rank == 0:
            parser.error(refusal[0])
        raise SystemExit(2)
    if args.resume:
        dist.broadcast_object_list(newest, src=0)  # every rank resumes from the same checkpoint
        assert newest[0] is not None
        resume(newest[0], args.out, args.steps, mesh)
        return

    model, optimizer = build(mesh, seed=0)
    for step in range(1, args.steps + 1):
        loss = train_step(model, optimizer)
        report_loss(step, loss)
    sk.save({"model": model, "optim": optimizer, "step": args.steps}, args.out / "step_a", step=args.steps)

    report_loss(args.steps + 1, train_step(model, optimizer))
    handle = sk.async_save(
        {"model": model, "optim": optimizer, "step": args.steps + 1}, args.out / "step_b", step=args.steps + 1
    )
    expected_w1 = model.w1.to_local().detach().clone()
    loss = train_step(model, optimizer)  # training continues while step_b is written
    report_loss(args.steps + 2, loss)
    manifest = handle.result(timeout=120)

    fresh_model, fresh_optimizer = build(mesh, seed=123)
    state = {"model": fresh_model, "optim": fresh_optimizer, "step": 0}
    sk.load(args.out / "step_b", into=state)
    same = torch.equal(fresh_model.w1.to_local(), expected_w1)
    ok = torch.tensor([1 if same and state["step"] == args.steps + 1 else 0])
    dist.all_reduce(ok)

    if rank == 0:
        files = ", ".join(f"{record.path} ({record.size} B)" for record in manifest.files)
        print(f"ranks: {world}; last loss {loss:.4f}")
        print(f"step_b committed by {world} ranks: {files}")
        print(f"reloaded into a fresh model on every rank: {'OK' if int(ok) == world else 'MISMATCH'}")
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        full = sk.load(args.out / "step_b")  # no process group now: one full state
        print(f"loaded without a process group: model.w1 {list(full['model']['w1'].shape)}, step {full['step']}")
        print(f"verify: {'OK' if sk.verify(args.out / 'step_b').ok else 'FAILED'}")
    if int(ok) != world:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
