"""A small deterministic training run under torchrun for the two-node tests
(tests/test_two_nodes.py): DTensor weights sharded by rows over every rank, AdamW, a loss that
depends only on the weights and the step, and a :class:`shardkeep.MultiLevelManager` with a
node-local level on the node's own disk and a persistent level on S3 (drained).

    torchrun ... two_node_train.py --disk-root DIR --s3-url s3://bucket/run --last-step N --results DIR --tag NAME [--replicas K]

It restores the newest step any level can complete (none: starts at step 1), trains up to
``--last-step``, saves when a level is due, and writes ``<results>/<tag>-rank<r>.json``: the
restored step and its report, every step's loss and state digest (the blake2b of every full
tensor of the model and the optimizer, in order: the same bytes whatever the world size, since
every update is elementwise), and each save's result. Rank 0 also appends each step's loss and
digest to ``<results>/<tag>-trace.jsonl`` as it goes, for a run that is killed. The S3 server and its credentials come from
the standard AWS variables.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import inspect
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import shardkeep as sk

ROWS, COLUMNS = 64, 16


def build(mesh: Any, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    generator = torch.Generator().manual_seed(seed)
    model = torch.nn.Module()
    for name in ("w1", "w2"):
        full = torch.randn(ROWS, COLUMNS, generator=generator)
        model.register_parameter(name, torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)])))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> float:
    target = (step * 7919 % 13) / 13.0
    loss = ((model.w1 - target) ** 2).sum() + (model.w2.sin() * target).sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    value = loss.detach()
    return float(value.full_tensor()) if isinstance(value, DTensor) else float(value)


def digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """The blake2b of every full tensor of the model and the optimizer (collective)."""
    hasher = hashlib.blake2b(digest_size=16)
    tensors = [model.w1, model.w2]
    for parameter in (model.w1, model.w2):
        moments = optimizer.state.get(parameter, {})
        tensors += [moments[key] for key in ("exp_avg", "exp_avg_sq") if key in moments]
    for tensor in tensors:
        full = tensor.detach().full_tensor() if isinstance(tensor, DTensor) else tensor.detach()
        hasher.update(full.contiguous().numpy().tobytes())
    return hasher.hexdigest()


def supports_replicas() -> bool:
    """Whether this shardkeep has peer replicas of node-local parts (``Level(replicas=)``)."""
    return "replicas" in {f.name for f in dataclasses.fields(sk.Level)}


def levels(local: str, persistent: str, replicas: int | None) -> list[sk.Level]:
    s3 = {
        "key": os.environ["AWS_ACCESS_KEY_ID"],
        "secret": os.environ["AWS_SECRET_ACCESS_KEY"],
        "client_kwargs": {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]},
    }
    extra: dict[str, Any] = {}
    if replicas is not None and (replicas > 0 or supports_replicas()):
        extra["replicas"] = replicas  # a TypeError where replicas are not supported and asked for
    return [
        sk.Level(
            "local",
            local,
            node_local=True,
            save_policy=sk.SavePolicy(every_steps=2),
            retention=sk.RetentionPolicy(keep_last=2, keep_best=0),
            **extra,
        ),
        sk.Level(
            "persistent",
            persistent,
            source="drain",
            save_policy=sk.SavePolicy(every_steps=4),
            retention=sk.RetentionPolicy(keep_last=3, keep_best=0),
            storage_options=s3,
        ),
    ]


def run(args: argparse.Namespace) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model, optimizer = build(mesh, seed=0)
    # Steps take milliseconds here: a save waits for the drain (and the replication) still in
    # flight before it, so that every due step is persisted (and replicated) and the steps kept
    # do not depend on timing.
    waits: dict[str, Any] = {"drain_wait": 120}
    if "replicate_wait" in inspect.signature(sk.MultiLevelManager).parameters:
        waits["replicate_wait"] = 120
    manager = sk.MultiLevelManager(levels(args.disk_root, args.s3_url, args.replicas), timeout=args.timeout, **waits)
    started = time.monotonic()
    fresh_model, fresh_optimizer = build(mesh, seed=123)  # other weights: the restore replaces them
    state = {"model": fresh_model, "optim": fresh_optimizer, "step": 0}
    restored = manager.restore(into=state)
    outcome: dict[str, Any] = {"rank": rank, "world": world, "node": int(os.environ.get("GROUP_RANK", "-1"))}
    if restored is None:
        first = 1
        outcome["restored"] = None
    else:
        model, optimizer = fresh_model, fresh_optimizer
        first = restored.step + 1
        report = restored.report
        outcome["restored"] = {
            "step": restored.step,
            "state_step": int(state["step"]),
            "source": {str(r): level for r, level in report.source.items()},
            "healed": [list(map(str, entry)) for entry in report.healed],
            "refused": [list(map(str, entry)) for entry in report.refused],
            "levels_read": list(report.levels_read),
            "seconds": time.monotonic() - started,
            "digest": digest(model, optimizer),
        }
    losses, digests, saves = {}, {}, {}
    trace = args.results / f"{args.tag}-trace.jsonl"
    for step in range(first, args.last_step + 1):
        loss = train_step(model, optimizer, step)
        losses[step], digests[step] = loss, digest(model, optimizer)
        if rank == 0:  # as it goes: a run killed midway leaves what it trained
            with open(trace, "a") as lines:
                lines.write(json.dumps({"step": step, "loss": loss, "digest": digests[step]}) + "\n")
        time.sleep(args.step_seconds)
        if manager.should_save(step):
            result = manager.save({"model": model, "optim": optimizer, "step": step}, step=step, metrics={"loss": loss})
            saves[step] = {"committed": result.committed, "draining": result.draining, "skipped": result.skipped}
    manager.close()
    outcome.update(losses=losses, digests=digests, saves=saves, seconds=time.monotonic() - started)
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--disk-root", required=True, help="the node-local level's root (the node's own disk)")
    parser.add_argument("--s3-url", required=True, help="the persistent level's URL (s3://...)")
    parser.add_argument("--last-step", type=int, required=True)
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument("--tag", required=True)
    parser.add_argument("--timeout", type=float, default=120.0, help="the manager's collective deadline (s)")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="sleep after each step (a slower run)")
    parser.add_argument("--replicas", type=int, default=None, help="the local level's replicas (default: its own)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    try:
        outcome = run(args)
        (args.results / f"{args.tag}-rank{dist.get_rank()}.json").write_text(json.dumps(outcome, indent=1))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
