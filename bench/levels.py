"""One level against two: the steps a failure loses and the time training is blocked.

The same training loop (an MLP with AdamW; its state is ``--mb`` MiB of parameters and
optimizer moments) runs ``--steps`` steps twice per repetition:

- **single**: a ``CheckpointManager`` on the persistent level, saving every ``--persist-every``
  steps (100);
- **levels**: a ``MultiLevelManager`` with a node-local level every ``--local-every`` steps (10)
  and the persistent level fed by draining a committed local step every ``--persist-every``.

A failure is injected at a random step (the same one for both, from ``--seed``); the run then
restores as a restarted job would, and the steps lost are the failure's step minus the step it
resumed from (+1: the failed step itself). The blocked time is the wall time spent inside
``should_save``/``save`` (what training waits for); drains run in the background.

The persistent level is the S3 server the test suite uses (SeaweedFS on 127.0.0.1,
``--persistent s3``, the default when ``weed`` is installed) or a directory
(``--persistent dir``); the local level is a directory under ``/dev/shm`` (a RAM disk, as NVRx
recommends), or ``--local DIR``.

The restore times are reported per level: the restarted runs restore from S3 (single) and from
the local level (levels); then the levels run is restarted once more with its local level wiped
(a lost node), restoring from the persistent level.

Peer replicas (``--replica-mb``): 4 gloo ranks on 2 simulated nodes save one step to a
node-local level with one replica per node part and drain it; the replication traffic is the
bytes sent; node 1's local disk is then wiped and the same step restored with 4 ranks with both
levels (node 1's part from node 0's replicas), with the local level alone, and from the
persistent level alone (target: replicas <= 1/3 of the time), interleaved ``--replica-reps``
times (median and range of the per-repetition ratios); the report names the levels the
restore with both levels did not read. A run of 6 back-to-back local saves with 1 and 0
replicas gives how long a save blocks while the previous step replicates (``--skip-blocking``
leaves it out). ``--replicas-only`` runs this part alone.

Last, the drain's memory: a ``--drain-mb`` MiB local step (written by another process) is
drained in a fresh process under a ``--budget-mb`` byte budget, and its peak RSS (``VmHWM``,
reset just before the drain) above its RSS before the drain is reported. The results are in
docs/performance.md, "Two levels against one"::

    .venv/bin/python bench/levels.py                     # 3 repetitions, S3 persistent level
    .venv/bin/python bench/levels.py --reps 5 --json levels.json
    .venv/bin/python bench/levels.py --persistent dir --quick
    .venv/bin/python bench/levels.py --replica-mb 64 --replicas-only --replica-reps 7
    .venv/bin/python bench/levels.py --replica-mb 256 --replicas-only --replica-reps 3 --skip-blocking
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import shardkeep as sk
from common import fmt_range, median, touch_memory


def build(mb: float, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """An MLP whose parameters and two AdamW moments take about ``mb`` MiB together."""
    torch.manual_seed(seed)
    width = max(64, int((mb * 2**20 / 4 / 3 / 4) ** 0.5))  # 4 square layers, 3 copies (param, m, v)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optimizer


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    width = model[0].in_features  # type: ignore[index]
    batch = torch.randn(32, width)
    loss = model(batch).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    return float(loss.detach())


@contextmanager
def persistent_root(kind: str, workdir: Path) -> Iterator[tuple[Callable[[str], str], dict[str, Any] | None]]:
    """Yields ``(root_of(name), storage_options)`` for the persistent level."""
    if kind == "dir":
        yield (lambda name: str(workdir / "persistent" / name)), None
        return
    from tests.support import s3server

    server = s3server.start(workdir / "s3")
    try:
        bucket = server.new_bucket("bench")
        yield (lambda name: f"s3://{bucket}/{name}"), server.storage_options
    finally:
        s3server.stop(server)


def has_weed() -> bool:
    """Whether the SeaweedFS binary the test suite uses is installed (next to this Python, or on
    the PATH)."""
    return (Path(sys.executable).parent / "weed").exists() or shutil.which("weed") is not None


def one_run(
    label: str,
    make: Callable[[], Any],
    args: argparse.Namespace,
    fail_at: int,
) -> dict[str, float]:
    """Train until ``fail_at``, drop everything, restore with a fresh manager; return the steps
    lost, the blocked seconds and the seconds the restore took."""
    touch_memory(int(2.5 * 2**30))
    model, optimizer = build(args.mb, args.seed)
    state = {"model": model, "optimizer": optimizer}
    manager = make()
    blocked = 0.0
    for step in range(fail_at):
        loss = train_step(model, optimizer)
        started = time.perf_counter()
        if manager.should_save(step):
            manager.save(state, step=step, metrics={"loss": loss})
        blocked += time.perf_counter() - started
    # The failure: the process dies here. A drain still running is lost with it.
    close = getattr(manager, "close", None)
    if close is not None:
        close(wait=False)
    model, optimizer = build(args.mb, args.seed + 1)
    state = {"model": model, "optimizer": optimizer}
    restarted = make()
    started = time.perf_counter()
    restored = restarted.restore(into=state)
    restore_seconds = time.perf_counter() - started
    resumed = -1 if restored is None else restored.step
    close = getattr(restarted, "close", None)
    if close is not None:
        close(wait=False)
    return {
        "steps_lost": float(fail_at - resumed),
        "blocked_seconds": blocked,
        "restore_seconds": restore_seconds,
        "resumed_step": float(resumed),
    }


def restore_persistent(make: Callable[[], Any], local_root: Path, args: argparse.Namespace) -> dict[str, float]:
    """The levels setup restarted on a node whose local level is lost: its local root wiped, a
    fresh manager restores from the persistent level; the seconds it took and the step."""
    shutil.rmtree(local_root, ignore_errors=True)
    model, optimizer = build(args.mb, args.seed + 2)
    manager = make()
    started = time.perf_counter()
    restored = manager.restore(into={"model": model, "optimizer": optimizer})
    seconds = time.perf_counter() - started
    manager.close(wait=False)
    return {"restore_seconds": seconds, "resumed_step": float(-1 if restored is None else restored.step)}


_WRITE_STEP = """
import sys, torch
import shardkeep as sk
local, mib = sys.argv[1], float(sys.argv[2])
level = sk.Level("local", local, node_local=True, save_policy=sk.SavePolicy(every_steps=1))
writer = sk.MultiLevelManager([level])
writer.save({"big": torch.ones(int(mib * 2**20 // 4), dtype=torch.float32)}, step=0)
writer.close()
"""

_DRAIN_STEP = """
import json, resource, sys
import torch  # imported before the baseline, as in a training process
import shardkeep as sk
local, persistent, budget, storage_options = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
levels = [sk.Level("local", local, node_local=True, save_policy=sk.SavePolicy(every_steps=1)),
          sk.Level("persistent", persistent, source="drain", save_policy=sk.SavePolicy(every_steps=1),
                   storage_options=storage_options)]
manager = sk.MultiLevelManager(levels, options=sk.WriteOptions(byte_budget=budget))
manager.status()  # the node map and the levels' probes, before the baseline
def kib(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(field + ":"))
hwm_before = kib("VmHWM")
try:  # reset the high-water mark to the current RSS, so that only the drain can raise it
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    reset = True
except OSError:
    reset = False
before = kib("VmRSS")
result = manager.drain(0)
manager.close()
print(json.dumps({"rss_before_kib": before, "hwm_before_kib": hwm_before, "hwm_reset": reset,
                  "hwm_after_kib": kib("VmHWM"), "maxrss_after_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "committed": sorted(result.committed), "skipped": result.skipped}))
"""


def drain_peak_rss(
    args: argparse.Namespace, local_base: Path, persistent: str, storage_options: dict[str, Any] | None
) -> dict[str, Any]:
    """Drain a ``--drain-mb`` MiB local step under a ``--budget-mb`` byte budget in a fresh
    process (the step is written by another process, so the drain's process never held the
    state); the growth of its peak RSS (``VmHWM``, reset to the current RSS just before the
    drain) over its RSS just before the drain, in MiB."""
    local = local_base / "drain-local"
    env = dict(os.environ)
    subprocess.run([sys.executable, "-c", _WRITE_STEP, str(local), str(args.drain_mb)], check=True, env=env)
    argv = [str(local), persistent, str(int(args.budget_mb * 2**20)), json.dumps(storage_options or {})]
    done = subprocess.run(
        [sys.executable, "-c", _DRAIN_STEP, *argv], check=True, capture_output=True, text=True, env=env
    )
    found = json.loads(done.stdout.strip().splitlines()[-1])
    if "persistent" not in found["committed"]:
        raise RuntimeError(f"the drain did not commit: {found}")
    # VmHWM, not ru_maxrss: after fork and exec, ru_maxrss starts at the parent's peak (this
    # bench's, which touches 2.5 GiB), so it cannot show the drain's own growth.
    peak = found["hwm_after_kib"]
    return {
        "checkpoint_mib": args.drain_mb,
        "budget_mib": args.budget_mb,
        "rss_before_mib": round(found["rss_before_kib"] / 1024, 1),
        "peak_rss_above_start_mib": round((peak - found["rss_before_kib"]) / 1024, 1),
        "high_water_mark_reset": found["hwm_reset"],
        "ru_maxrss_after_mib": round(found["maxrss_after_kib"] / 1024, 1),
    }


# -- peer replicas ------------------------------------------------------------------------------


def _replica_state(mb: float, seed: int) -> dict[str, Any]:
    """``mb`` MiB of float32 rows sharded over every rank (each rank writes its rows)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    world = dist.get_world_size()
    rows = max(world, int(mb * 2**20 / 4 / 1024) // world * world)
    generator = torch.Generator().manual_seed(seed)
    full = torch.randn(rows, 1024, generator=generator)
    mesh = init_device_mesh("cpu", (world,))
    return {"weights": distribute_tensor(full, mesh, [Shard(0)])}


def _replica_levels(local: str, persistent: str | None, storage_options: Any, replicas: int) -> list[Any]:
    levels: list[Any] = []
    if local:
        keep = sk.RetentionPolicy(keep_last=2, keep_best=0)
        levels.append(sk.Level("local", local + "/node{node}", node_local=True, replicas=replicas, retention=keep))
    if persistent is not None:
        levels.append(
            sk.Level(
                "persistent",
                persistent,
                source="drain" if local else "save",
                storage_options=storage_options,
            )
        )
    return levels


def _node_of(rank: int) -> int:
    return rank // 2


def _replica_save(rank: int, world: int, local: str, persistent: str, options: Any, mb: float) -> dict[str, Any]:
    """Save one step to the local level (one replica per node part), drain it, wait for its
    replicas: the bytes replication sent and the seconds it took."""
    manager = sk.MultiLevelManager(_replica_levels(local, persistent, options, 1), node_of=_node_of, timeout=300)
    manager.save(_replica_state(mb, 0), step=0, levels=["local"])
    manager.drain(0)
    protected = manager.wait_for_replicas()
    replication = manager.replication
    assert replication is not None and protected == 0, protected
    outcome = replication.settled[0]
    manager.close()
    return {"bytes_sent": outcome.bytes_sent, "seconds": outcome.seconds}


def _replica_restore(
    rank: int, world: int, local: str, persistent: str | None, options: Any, mb: float
) -> dict[str, Any]:
    """Restore the step with both levels (``local`` given: node 1's part comes from node 0's
    replicas) or from the persistent level alone; the seconds ``restore`` took on this rank."""
    manager = sk.MultiLevelManager(_replica_levels(local, persistent, options, 1), node_of=_node_of, timeout=300)
    into = _replica_state(mb, 1)
    import torch.distributed as dist

    from shardkeep.distributed.coordinator import Coordinator

    Coordinator(None, timeout=300)  # the checkpoint process group, created before the clock starts
    touch_memory(int(mb * 2**20))  # this rank's reads land in touched memory
    dist.barrier()
    started = time.perf_counter()
    restored = manager.restore(into=into)
    seconds = time.perf_counter() - started
    manager.close()
    assert restored is not None and restored.step == 0
    expected = _replica_state(mb, 0)["weights"].to_local()
    assert torch.equal(into["weights"].to_local(), expected)
    report = restored.report
    healed = sorted({source for _, _, source in report.healed})
    return {"seconds": seconds, "healed_from": healed, "not_consulted": sorted(report.not_consulted)}


def _replica_blocking(rank: int, world: int, local: str, replicas: int, saves: int, mb: float) -> dict[str, Any]:
    """``saves`` local saves one after another (a short step between them): the seconds each
    save blocked, with the replication of the previous step still in flight."""
    manager = sk.MultiLevelManager(_replica_levels(local, None, None, replicas), node_of=_node_of, timeout=300)
    blocked = []
    for step in range(saves):
        time.sleep(0.05)  # a training step
        blocked.append(manager.save(_replica_state(mb, step), step=step).blocked_seconds)
    manager.close()
    return {"blocked": blocked}


def replica_recovery(
    args: argparse.Namespace, workdir: Path, local_base: Path, persistent: str, options: Any
) -> dict[str, Any]:
    """4 ranks on 2 simulated nodes: one replica per node part. Replication traffic per save;
    after node 1 loses its disk, the time to restore the same step with both levels (node 1's
    part from the replicas) and from the persistent level alone; how long a save blocks with
    replication on and off."""
    from tests.support.distributed_harness import results_or_raise, run_ranks

    local = str(local_base / "replica-local")
    mb = args.replica_mb
    saved = results_or_raise(
        run_ranks(4, _replica_save, local, persistent, options, mb, outbox=workdir / "r-save", timeout=600)
    )
    ratios: list[float] = []
    both: list[float] = []
    alone: list[float] = []
    persistent_only: list[float] = []
    for rep in range(args.replica_reps):  # interleaved: both levels, local level alone, persistent alone
        shutil.rmtree(Path(local) / "node1")  # the node is replaced: its local disk is empty
        from_replicas = results_or_raise(
            run_ranks(
                4, _replica_restore, local, persistent, options, mb, outbox=workdir / f"r-local{rep}", timeout=600
            )
        )
        shutil.rmtree(Path(local) / "node1")  # the same loss again, restored by the local level alone
        local_only = results_or_raise(
            run_ranks(4, _replica_restore, local, None, None, mb, outbox=workdir / f"r-local-only{rep}", timeout=600)
        )
        from_persistent = results_or_raise(
            run_ranks(
                4, _replica_restore, "", persistent, options, mb, outbox=workdir / f"r-persistent{rep}", timeout=600
            )
        )
        both.append(max(result["seconds"] for result in from_replicas))
        alone.append(max(result["seconds"] for result in local_only))
        persistent_only.append(max(result["seconds"] for result in from_persistent))
        ratios.append(both[-1] / max(persistent_only[-1], 1e-9))
        print(
            f"  replicas rep {rep}: both levels {both[-1]:.3f} s, local level alone {alone[-1]:.3f} s, "
            f"persistent level alone {persistent_only[-1]:.3f} s: {ratios[-1]:.2f}x  load {os.getloadavg()[0]:.1f}"
        )
    blocking = {}
    for replicas in (0, 1) if not args.skip_blocking else ():
        runs = results_or_raise(
            run_ranks(
                4,
                _replica_blocking,
                local + f"-block{replicas}",
                replicas,
                6,
                mb,
                outbox=workdir / f"r-block{replicas}",
                timeout=600,
            )
        )
        per_save = [max(run["blocked"][index] for run in runs) for index in range(6)]
        blocking[f"replicas={replicas}"] = {"median_seconds": median(per_save[1:]), "max_seconds": max(per_save[1:])}
    return {
        "checkpoint_mib": mb,
        "replication_bytes_per_save": sum(result["bytes_sent"] for result in saved),
        "replication_seconds": max(result["seconds"] for result in saved),
        "healed_from": from_replicas[0]["healed_from"],
        "persistent_not_consulted": from_replicas[0]["not_consulted"],
        "recovery_from_replicas_seconds": round(median(both), 3),
        "recovery_from_replicas_runs": [round(x, 3) for x in both],
        "recovery_local_level_only_seconds": round(median(alone), 3),
        "recovery_local_level_only_runs": [round(x, 3) for x in alone],
        "recovery_from_persistent_seconds": round(median(persistent_only), 3),
        "recovery_from_persistent_runs": [round(x, 3) for x in persistent_only],
        "ratio": round(median(ratios), 3),
        "ratio_runs": [round(x, 3) for x in ratios],
        "save_blocking": blocking,
    }


def makers(
    args: argparse.Namespace,
    root_of: Callable[[str], str],
    storage_options: dict[str, Any] | None,
    local_root: str,
    rep: int,
) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """The two setups of one repetition, as factories (a restarted job builds a fresh manager)."""
    single_root, levels_root = root_of(f"single-{rep}"), root_of(f"levels-{rep}")

    def single() -> Any:
        return sk.CheckpointManager(
            single_root,
            keep_last=3,
            keep_best=0,
            metric="loss",
            storage_options=storage_options,
            save_policy=sk.SavePolicy(every_steps=args.persist_every),
        )

    def levels() -> Any:
        local = sk.Level(
            "local",
            local_root,
            node_local=True,
            save_policy=sk.SavePolicy(every_steps=args.local_every),
            retention=sk.RetentionPolicy(keep_last=2, keep_best=0),
        )
        persistent = sk.Level(
            "persistent",
            levels_root,
            source="drain",
            save_policy=sk.SavePolicy(every_steps=args.persist_every),
            retention=sk.RetentionPolicy(keep_last=3, keep_best=0),
            storage_options=storage_options,
        )
        return sk.MultiLevelManager([local, persistent])

    return single, levels


def run_reps(args: argparse.Namespace, local_base: Path, workdir: Path) -> dict[str, Any]:
    """Every repetition (single, then levels, on the same failure step), then the drain's
    memory; the per-run figures."""
    rng = random.Random(args.seed)
    results: dict[str, Any] = {"single": [], "levels": [], "levels_from_persistent": []}
    with persistent_root(args.persistent, workdir) as (root_of, storage_options):
        # First: the replica runs fork gloo ranks, best before this process ran torch operations.
        results["replicas"] = replica_recovery(args, workdir, local_base, root_of("replicas"), storage_options)
        for rep in range(args.reps):
            fail_at = rng.randrange(args.steps // 2, args.steps)
            local_root = local_base / f"rep-{rep}"
            single, levels = makers(args, root_of, storage_options, str(local_root), rep)
            for label, make in (("single", single), ("levels", levels)):
                outcome = one_run(label, make, args, fail_at)
                results[label].append(outcome)
                print(
                    f"  rep {rep}  {label:<7} failure at step {fail_at}: lost {outcome['steps_lost']:.0f} steps, "
                    f"blocked {outcome['blocked_seconds']:.3f} s, restore of step {outcome['resumed_step']:.0f} "
                    f"{outcome['restore_seconds']:.3f} s"
                )
            wiped = restore_persistent(levels, local_root, args)
            results["levels_from_persistent"].append(wiped)
            print(
                f"  rep {rep}  levels, local level wiped: restore of step {wiped['resumed_step']:.0f} "
                f"{wiped['restore_seconds']:.3f} s"
            )
        results["drain_memory"] = drain_peak_rss(args, local_base, root_of("drain"), storage_options)
    return results


def mean(samples: list[float]) -> float:
    return sum(samples) / len(samples)


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Means over the repetitions (what ``--json`` writes), with the per-pair ratios."""
    summary: dict[str, Any] = {}
    for label in ("single", "levels"):
        runs = results[label]
        summary[label] = {
            "steps_lost": mean([r["steps_lost"] for r in runs]),
            "blocked_seconds": mean([r["blocked_seconds"] for r in runs]),
            "blocked_seconds_median": median([r["blocked_seconds"] for r in runs]),
            "restore_seconds": mean([r["restore_seconds"] for r in runs]),
            "runs": runs,
        }
    wiped = results["levels_from_persistent"]
    summary["levels"]["restore_seconds_from_persistent"] = mean([r["restore_seconds"] for r in wiped])
    summary["levels"]["runs_from_persistent"] = wiped
    pairs = list(zip(results["single"], results["levels"], strict=True))
    summary["blocked_ratio_per_pair"] = [b["blocked_seconds"] / a["blocked_seconds"] for a, b in pairs]
    summary["drain_memory"] = results["drain_memory"]
    summary["replicas"] = results["replicas"]
    return summary


def report(summary: dict[str, Any]) -> None:
    single, levels = summary["single"], summary["levels"]
    for label, figures in (("single", single), ("levels", levels)):
        print(
            f"{label}: lost {figures['steps_lost']:.1f} steps, blocked {figures['blocked_seconds']:.3f} s (mean; "
            f"median, min-max {fmt_range([r['blocked_seconds'] for r in figures['runs']])}), "
            f"restore {figures['restore_seconds']:.3f} s"
        )
    print(
        f"levels, local level wiped: restore from the persistent level {levels['restore_seconds_from_persistent']:.3f} s"
    )
    loss_ratio = levels["steps_lost"] / max(single["steps_lost"], 1e-9)
    block_ratio = levels["blocked_seconds"] / max(single["blocked_seconds"], 1e-9)
    ratios = summary["blocked_ratio_per_pair"]
    print(
        f"levels/single: steps lost {loss_ratio:.2f}x (target <= 0.20), blocked {block_ratio:.2f}x of the means, "
        f"per pair {fmt_range(ratios, lambda r: f'{r:.2f}x')} (target <= 1.00)"
    )
    drain = summary["drain_memory"]
    print(
        f"drain of a {drain['checkpoint_mib']:.0f} MiB step under a {drain['budget_mib']:.0f} MiB budget, fresh process: "
        f"peak RSS +{drain['peak_rss_above_start_mib']:.1f} MiB over {drain['rss_before_mib']:.0f} MiB before it "
        f"(high-water mark reset before the drain: {drain['high_water_mark_reset']})"
    )


def report_replicas(replicas: dict[str, Any]) -> None:
    blocking = replicas["save_blocking"]
    ratios = replicas["ratio_runs"]
    print(
        f"replicas ({replicas['checkpoint_mib']:.0f} MiB step, 4 ranks on 2 nodes, 1 replica): "
        f"{replicas['replication_bytes_per_save'] / 2**20:.1f} MiB sent per save in {replicas['replication_seconds']:.2f} s; "
        f"recovery after a node loss (median of {len(ratios)}) with both levels configured (from the replicas) "
        f"{replicas['recovery_from_replicas_seconds']:.2f} s, from the persistent level "
        f"{replicas['recovery_from_persistent_seconds']:.2f} s: {replicas['ratio']:.2f}x, per run "
        f"{fmt_range(ratios, lambda r: f'{r:.2f}x')} (target <= 0.33); "
        f"{replicas['recovery_local_level_only_seconds']:.2f} s with the local level alone; levels not read: "
        f"{replicas['persistent_not_consulted']}"
        + (
            f"; a save blocks {blocking['replicas=1']['median_seconds']:.3f} s with replication, "
            f"{blocking['replicas=0']['median_seconds']:.3f} s without (median)"
            if blocking
            else ""
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400, help="the failure falls in [steps/2, steps)")
    parser.add_argument("--mb", type=float, default=48.0, help="MiB of model and optimizer state")
    parser.add_argument("--local-every", type=int, default=10)
    parser.add_argument("--persist-every", type=int, default=100)
    parser.add_argument("--persistent", choices=("s3", "dir"), default="s3" if has_weed() else "dir")
    parser.add_argument("--local", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    parser.add_argument("--drain-mb", type=float, default=512.0)
    parser.add_argument("--budget-mb", type=float, default=64.0)
    parser.add_argument("--replica-mb", type=float, default=256.0, help="MiB of the step replicated and recovered")
    parser.add_argument("--replica-reps", type=int, default=1, help="repetitions of the recoveries from replicas")
    parser.add_argument("--replicas-only", action="store_true", help="only the peer-replica figures")
    parser.add_argument("--skip-blocking", action="store_true", help="leave out how long a save blocks with replicas")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="1 repetition, 200 steps, 16 MiB, drain 128 MiB")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.quick:
        args.reps, args.steps, args.mb, args.drain_mb, args.replica_mb = 1, 200, 16.0, 128.0, 64.0
    print(
        f"bench/levels.py  {time.strftime('%Y-%m-%d %H:%M:%S')}  load {os.getloadavg()}  "
        f"state {args.mb} MiB, {args.steps} steps, persistent={args.persistent}, local={args.local or 'tmp'}"
    )
    with tempfile.TemporaryDirectory(prefix="sk-levels-") as tmp:
        workdir = Path(tmp)
        local_base = Path(tempfile.mkdtemp(prefix="sk-levels-", dir=args.local)) if args.local else workdir / "local"
        try:
            if args.replicas_only:
                with persistent_root(args.persistent, workdir) as (root_of, storage_options):
                    summary = {
                        "replicas": replica_recovery(args, workdir, local_base, root_of("replicas"), storage_options)
                    }
            else:
                summary = summarize(run_reps(args, local_base, workdir))
        finally:
            if args.local:
                shutil.rmtree(local_base, ignore_errors=True)
    if not args.replicas_only:
        report(summary)
    report_replicas(summary["replicas"])
    print(f"load at the end {os.getloadavg()}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
