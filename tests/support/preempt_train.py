"""A deterministic training loop with a MultiLevelManager and the preemption handler, run as a
real process per rank (``python -m tests.support.preempt_train ROOT``, or forked from the test
process by :func:`forked`), for the tests that send it
real signals (tests/test_levels_preemption.py).

The rank and world come from ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` (gloo) when
``WORLD_SIZE`` > 1. Nodes are pairs of ranks (``rank // 2``), each with its own local root
``ROOT/node<k>``; the persistent level ``ROOT/persistent`` is drained from it.

The state: a replicated linear model and its SGD-with-momentum optimizer (gradients averaged over
the ranks, as DDP does) and a row-sharded table (a DTensor when distributed) that each step
updates. Every batch is a function of the step, so a resumed run computes exactly the losses of
an uninterrupted one. Each rank appends ``{"step", "loss", "run"}`` lines to
``ROOT/losses-rank<r>.jsonl`` after each step, and at the end writes ``ROOT/final-rank<r>.json``.

Knobs (environment): ``PREEMPT_STEPS``, ``PREEMPT_STEP_SECONDS`` (sleep per step),
``PREEMPT_LOCAL_EVERY``, ``PREEMPT_PERSIST_EVERY``, ``PREEMPT_GRACE``, ``PREEMPT_DEBOUNCE``,
``PREEMPT_SLOW_WRITE`` and ``PREEMPT_SLOW_DRAIN`` (seconds slept per buffer written by a save /
copied by a drain, to widen the windows a signal is aimed at), ``PREEMPT_ROWS`` (table rows per
rank), ``PREEMPT_HANDLE`` (0: no handler, the uninterrupted reference run).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import shardkeep as sk
import shardkeep.levels.drain as drain_module
import shardkeep.levels.preemption as preemption_module
import shardkeep.saving.job as job_module


def _env(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def _slowed(original: Callable[..., Any], delay: float) -> Callable[..., Any]:
    """``original`` with ``delay`` seconds slept on each buffer it reports through ``on_bytes``."""

    def slowed(*args: Any, on_bytes: Callable[[int], None] | None = None, **kwargs: Any) -> Any:
        def report(count: int) -> None:
            time.sleep(delay)
            if on_bytes is not None:
                on_bytes(count)

        return original(*args, on_bytes=report, **kwargs)

    return slowed


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    inputs = torch.randn(16, 8, generator=generator)
    targets = inputs.sum(dim=1, keepdim=True) * 0.5 + torch.randn(16, 1, generator=generator) * 0.1
    return inputs, targets


def _table(world: int, rows: int) -> Any:
    full = torch.zeros(world * rows, 64)
    if world == 1:
        return full
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    return distribute_tensor(full, mesh, [Shard(0)])


def _local(table: Any) -> torch.Tensor:
    return table.to_local() if hasattr(table, "to_local") else table  # type: ignore[no-any-return]


def main() -> None:
    root = Path(sys.argv[1])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format=f"rank{rank} %(levelname)s %(message)s")
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    if _env("PREEMPT_SLOW_WRITE", 0) > 0:
        job_module.write_shards = _slowed(job_module.write_shards, _env("PREEMPT_SLOW_WRITE", 0))
    if _env("PREEMPT_SLOW_DRAIN", 0) > 0:
        drain_module.copy_with_digest = _slowed(drain_module.copy_with_digest, _env("PREEMPT_SLOW_DRAIN", 0))

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    table = _table(world, int(_env("PREEMPT_ROWS", 64)))
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "table": table}

    levels = sk.MultiLevelManager(
        [
            sk.Level(
                "local",
                str(root / "node{node}"),
                node_local=True,
                save_policy=sk.SavePolicy(every_steps=int(_env("PREEMPT_LOCAL_EVERY", 2))),
                retention=sk.RetentionPolicy(keep_last=2, keep_best=0),
            ),
            sk.Level(
                "persistent",
                str(root / "persistent"),
                source="drain",
                save_policy=sk.SavePolicy(every_steps=int(_env("PREEMPT_PERSIST_EVERY", 4))),
                retention=sk.RetentionPolicy(keep_last=3, keep_best=0),
            ),
        ],
        node_of=lambda r: r // 2,
        timeout=60,
        options=sk.WriteOptions(byte_budget=1 << 20, io_threads=2),
    )
    if _env("PREEMPT_HANDLE", 1):
        handler = levels.handle_preemption(
            grace_seconds=_env("PREEMPT_GRACE", 30),
            signals=[int(s) for s in os.environ.get("PREEMPT_SIGNALS", "15").split(",")],
        )
        handler.debounce_seconds = _env("PREEMPT_DEBOUNCE", preemption_module.DEBOUNCE_SECONDS)
    restored = levels.restore(into=state)
    start = 0 if restored is None else restored.step + 1
    run = os.environ.get("PREEMPT_RUN", "0")
    losses = root / f"losses-rank{rank}.jsonl"
    step_seconds = _env("PREEMPT_STEP_SECONDS", 0.0)
    with losses.open("a") as out:
        if restored is not None:
            out.write(json.dumps({"restored": restored.step, "run": run}) + "\n")
            out.flush()
        for step in range(start, int(_env("PREEMPT_STEPS", 12))):
            inputs, targets = _batch(step, rank)
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            loss.backward()
            if world > 1:
                import torch.distributed as dist

                for parameter in model.parameters():
                    assert parameter.grad is not None
                    dist.all_reduce(parameter.grad)
                    parameter.grad /= world
                reduced = loss.detach().clone()
                dist.all_reduce(reduced)
                value = float(reduced) / world
            else:
                value = float(loss)
            optimizer.step()
            _local(table).add_(torch.full_like(_local(table), value) * (step + 1) + rank)
            time.sleep(step_seconds)
            out.write(json.dumps({"step": step, "loss": value, "run": run}) + "\n")
            out.flush()
            if levels.should_save(step):
                levels.save(state, step=step, metrics={"loss": value})
    levels.close()
    final = {
        "model": [p.detach().flatten().tolist() for p in model.parameters()],
        "table": _local(table).flatten()[:256].tolist(),
        "table_sum": float(_local(table).sum()),
    }
    (root / f"final-rank{rank}.json").write_text(json.dumps(final))


def run_and_exit() -> None:
    """Run :func:`main` and end the process with its exit code (the preemption's, 0, or 1 with
    the traceback on stderr)."""
    code = 0
    try:
        main()
    except SystemExit as exited:  # the preemption's exit, with its code
        code = exited.code if isinstance(exited.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown, as tests/support/distributed_harness.py does: torch's gloo
    # teardown sometimes aborts ("terminate called without an active exception"), with or
    # without a preemption, which would hide the exit code under test.
    os._exit(code)


def forked(root: Path, environment: dict[str, str], log: Path) -> int:
    """Start a rank as a child forked from the calling process (torch and shardkeep already
    imported: no interpreter start), with ``environment`` as its whole environment and its
    output (Python's and the C++ libraries') in ``log``; returns its pid. The child runs
    :func:`run_and_exit` as ``python -m tests.support.preempt_train ROOT`` would."""
    pid = os.fork()
    if pid:
        return pid
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115  # until os._exit
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        for handler in logging.root.handlers[:]:  # the parent's (pytest's capture): main() sets its own
            logging.root.removeHandler(handler)
        warnings.resetwarnings()  # a new interpreter's filters, not the parent's (pytest: errors)
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", category)
        os.environ.clear()
        os.environ.update(environment)
        sys.argv = [__file__, str(root)]
        # A forked child inherits the parent's intra-op thread pool without its threads (see
        # tests/support/distributed_harness.py): every operation inline.
        torch.set_num_threads(1)
    except BaseException:
        os._exit(1)
    run_and_exit()
    return 0  # not reached


if __name__ == "__main__":
    run_and_exit()
