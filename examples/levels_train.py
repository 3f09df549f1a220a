"""The multi-level run of the demo (``examples/demo.py``, steps 9 and 10): one worker per rank,
started by torchrun on each of two nodes or by the demo as forked gloo ranks (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; the node from ``SHARDKEEP_NODE`` or torchrun's
``GROUP_RANK``).

    python examples/levels_train.py --root DIR --local-root PATH --steps N [--local-every 2] [--persist-every 10]

The state: a small model replicated on every rank (gradients averaged as DDP does) with its
optimizer, and a table sharded by rows over the ranks (a DTensor). A :class:`MultiLevelManager`
saves a node-local level (``--local-root``: the node's own disk, or a path with ``{node}``) every
``--local-every`` steps with one peer replica, and drains it to ``ROOT/persistent`` every
``--persist-every`` steps. SIGTERM is handled: the ranks agree at the next step boundary, take
an emergency save on the local level and exit 75.

Each rank appends JSON lines (with ``run``: the ``LEVELS_RUN`` variable) to ``ROOT/levels_log.jsonl``: ``start`` (its pid and node),
``resume`` (rank 0: the step and the restore report), ``step`` (rank 0: the loss), ``save``
(rank 0: what each level did, the newest protected step) and ``exit`` (the exit code).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import shardkeep as sk

ROWS_PER_RANK = 256


def log(root: Path, **record: Any) -> None:
    with open(root / "levels_log.jsonl", "a") as out:
        out.write(json.dumps({**record, "run": os.environ.get("LEVELS_RUN", "0")}) + "\n")


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    inputs = torch.randn(32, 16, generator=generator)
    return inputs, inputs.sum(dim=1, keepdim=True) * 0.5 + torch.randn(32, 1, generator=generator) * 0.1


def manager(args: argparse.Namespace) -> sk.MultiLevelManager:
    return sk.MultiLevelManager(
        [
            sk.Level(
                "local",
                args.local_root,
                node_local=True,
                replicas=1,
                save_policy=sk.SavePolicy(every_steps=args.local_every),
                retention=sk.RetentionPolicy(keep_last=2, keep_best=0),
            ),
            sk.Level(
                "persistent",
                str(args.root / "persistent"),
                source="drain",
                save_policy=sk.SavePolicy(every_steps=args.persist_every),
                retention=sk.RetentionPolicy(keep_last=3, keep_best=0),
            ),
        ],
        # Steps take a fraction of a second here: a save waits for the drain and the
        # replication before it, so that every due step is persisted and replicated.
        drain_wait=60,
        replicate_wait=60,
        timeout=30,
    )


def train(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    log(
        args.root,
        event="start",
        rank=rank,
        pid=os.getpid(),
        node=os.environ.get("SHARDKEEP_NODE", os.environ.get("GROUP_RANK")),
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    mesh = init_device_mesh("cpu", (world,))
    table = distribute_tensor(torch.zeros(world * ROWS_PER_RANK, 64), mesh, [Shard(0)])
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "table": table}
    levels = manager(args)
    levels.handle_preemption(grace_seconds=20, signals=[signal.SIGTERM])
    started = time.monotonic()
    restored = levels.restore(into=state)
    first = 1 if restored is None else restored.step + 1
    if rank == 0 and restored is not None:
        report = restored.report
        log(args.root, event="resume", step=restored.step, world_size=world, seconds=time.monotonic() - started,
            source=sorted(set(report.source.values())), healed=[list(map(str, h)) for h in report.healed],
            refused=[list(map(str, r)) for r in report.refused], levels_read=list(report.levels_read))  # fmt: skip
    for step in range(first, args.steps + 1):
        inputs, targets = batch(step, rank)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        for parameter in model.parameters():
            assert parameter.grad is not None
            dist.all_reduce(parameter.grad)
            parameter.grad /= world
        value = loss.detach().clone()
        dist.all_reduce(value)
        optimizer.step()
        table.to_local().add_(float(value) / world)
        time.sleep(args.step_seconds)
        if rank == 0:
            log(args.root, event="step", step=step, loss=float(value) / world, world_size=world)
        if step == args.pause_at:
            time.sleep(args.pause_seconds)  # a window for the demo's kill -9, whatever the machine's load
        if levels.should_save(step):  # True at the step the ranks agree they are preempted
            result = levels.save(state, step=step, metrics={"loss": float(value) / world})
            replication = levels.replication
            if rank == 0:
                log(args.root, event="save", step=step, committed=result.committed, draining=result.draining,
                    skipped=result.skipped, protected=replication.protected if replication else None)  # fmt: skip
    levels.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, required=True, help="the log and the persistent level (ROOT/persistent)")
    parser.add_argument("--local-root", required=True, help="the node-local level's root (the node's own disk)")
    parser.add_argument("--steps", type=int, required=True, help="train until this step")
    parser.add_argument("--local-every", type=int, default=2)
    parser.add_argument("--persist-every", type=int, default=10)
    parser.add_argument("--step-seconds", type=float, default=0.1, help="sleep per step")
    parser.add_argument("--pause-at", type=int, default=None, help="sleep --pause-seconds after this step")
    parser.add_argument("--pause-seconds", type=float, default=2.0)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    train(args)


if __name__ == "__main__":
    code = 0
    try:
        main()
    except SystemExit as exited:  # the emergency save's exit, with its code
        code = exited.code if isinstance(exited.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    log(Path(sys.argv[sys.argv.index("--root") + 1]), event="exit", rank=int(os.environ.get("RANK", "0")), code=code)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown: gloo's sometimes aborts, which would hide the exit code.
    os._exit(code)
