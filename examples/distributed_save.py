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
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from output_dir import OutputDirError, prepare_output
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


def main() -> None:
    parser = argparse.ArgumentParser(description="distributed save/load example (run with torchrun)")
    parser.add_argument("--out", type=Path, required=True, help="a directory shared by every rank")
    parser.add_argument("--force", action="store_true", help="empty --out even if this script did not make it")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    refusal: list[str | None] = [None]
    if rank == 0:
        try:
            prepare_output(args.out, "distributed_save.py", force=args.force)
        except OutputDirError as exc:
            refusal = [str(exc)]
    dist.broadcast_object_list(refusal, src=0)  # every rank stops alike
    if refusal[0] is not None:
        dist.destroy_process_group()
        if rank == 0:
            parser.error(refusal[0])
        raise SystemExit(2)

    model, optimizer = build(mesh, seed=0)
    for _ in range(args.steps):
        loss = train_step(model, optimizer)
    sk.save({"model": model, "optim": optimizer, "step": args.steps}, args.out / "step_a", step=args.steps)

    train_step(model, optimizer)
    handle = sk.async_save({"model": model, "optim": optimizer, "step": args.steps + 1}, args.out / "step_b")
    expected_w1 = model.w1.to_local().detach().clone()
    loss = train_step(model, optimizer)  # training continues while step_b is written
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
