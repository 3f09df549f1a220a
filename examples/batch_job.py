"""A sharded batch job that survives a killed worker, tracked by a ProgressLedger.

Four worker processes (started with ``spawn``, one per "GPU") each embed their shard of a
synthetic input, one batch at a time. Every batch result is written with ``shardkeep.save`` and
then recorded in the ledger. Partway through, the driver kills one worker with SIGKILL. On the
restart, the finished shards are skipped and the killed worker's shard resumes from its last
recorded batch (``--reassign`` hands it to a healthy worker instead). The merged output is
compared with the same computation done without any crash.

    python examples/batch_job.py --out batch-output            # kill worker 2, restart, compare
    python examples/batch_job.py --out batch-output --reassign  # shard 2 moves to worker 0
    python examples/batch_job.py --out clean --no-kill           # the same job, no crash

The driver prints each phase and writes ``summary.json`` into the output directory. ``--out``
must be new, empty, or an earlier output of this script (which is emptied); any other non-empty
directory is refused (exit 2, nothing deleted) unless ``--force`` is given.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import blake3
import torch
from output_dir import OutputDirError, prepare_output

import shardkeep as sk

FEATURES = 64
EMBEDDING = 16


def model_weights() -> torch.Tensor:
    return torch.randn(FEATURES, EMBEDDING, generator=torch.Generator().manual_seed(1234)) / FEATURES**0.5


def input_batch(shard: int, batch_idx: int, batch_size: int) -> torch.Tensor:
    """The synthetic input: deterministic per (shard, batch)."""
    generator = torch.Generator().manual_seed(shard * 1_000_003 + batch_idx)
    return torch.randn(batch_size, FEATURES, generator=generator)


def embed(inputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return torch.tanh(inputs @ weights)


def fingerprints(args: argparse.Namespace) -> tuple[str, str]:
    input_id = f"synthetic-v1 shards={args.workers} batches={args.batches} batch_size={args.batch_size}"
    model_hash = blake3.blake3(model_weights().numpy().tobytes()).hexdigest()[:16]
    return "blake3:" + blake3.blake3(input_id.encode()).hexdigest()[:16], model_hash


def worker_main(worker: int, ledger_path: str, batches: int, batch_size: int, delay: float) -> None:
    """One worker: process every unfinished shard assigned to it, from its resume point."""
    torch.set_num_threads(1)
    ledger = sk.ProgressLedger(ledger_path)
    weights = model_weights()
    for shard in ledger.assigned_shards(worker):
        # The claim makes this process the shard's only writer: a replaced process's late
        # updates (same rank or not) are refused.
        claim = ledger.claim_shard(shard, worker)
        start = ledger.resume_info(shard)["resume_from_batch"]
        print(f"  worker {worker}: shard {shard} from batch {start}", flush=True)
        for batch_idx in range(start, batches):
            inputs = input_batch(shard, batch_idx, batch_size)
            first = (shard * batches + batch_idx) * batch_size
            sk.save_batch(
                ledger,
                {"embeddings": embed(inputs, weights), "first_sequence": first},
                shard=shard,
                batch_idx=batch_idx,
                num_sequences=batch_size,
                sequence_range=f"seq_{first}-seq_{first + batch_size - 1}",
                worker=worker,
                claim=claim,
            )
            time.sleep(delay)  # stands in for the rest of a real batch's work
        ledger.mark_shard_complete(shard, worker=worker, claim=claim)


def run_workers(
    args: argparse.Namespace, ledger: sk.ProgressLedger, workers: list[int], kill: tuple[int, int] | None
) -> dict[int, int]:
    """Start the workers; with ``kill=(worker, batch)``, SIGKILL that worker once its shard has
    recorded that batch. Returns each worker's exit code."""
    context = multiprocessing.get_context("spawn")
    processes = {}
    for worker in workers:
        process = context.Process(
            target=worker_main,
            args=(worker, str(ledger.path), args.batches, args.batch_size, args.delay),
        )
        process.start()
        processes[worker] = process
    killed = False
    while any(process.is_alive() for process in processes.values()):
        if kill is not None and not killed:
            victim, after = kill
            info = ledger.resume_info(victim)
            if info["last_completed_batch"] >= after and processes[victim].is_alive():
                os.kill(processes[victim].pid, signal.SIGKILL)  # type: ignore[arg-type]
                killed = True
                print(
                    f"driver: killed worker {victim} with SIGKILL after it recorded batch "
                    f"{info['last_completed_batch']}",
                    flush=True,
                )
        time.sleep(0.01)
    return {worker: int(process.exitcode or 0) for worker, process in processes.items()}


def merged_output(ledger: sk.ProgressLedger, shards: int) -> torch.Tensor:
    parts = []
    for shard in range(shards):
        for _, state in sk.iter_batches(ledger, shard):
            parts.append(state["embeddings"])
    return torch.cat(parts)


def reference_output(args: argparse.Namespace) -> torch.Tensor:
    """The same computation in one process, with no crash and no ledger."""
    weights = model_weights()
    return torch.cat(
        [
            embed(input_batch(shard, batch_idx, args.batch_size), weights)
            for shard in range(args.workers)
            for batch_idx in range(args.batches)
        ]
    )


def digest(tensor: torch.Tensor) -> str:
    return blake3.blake3(tensor.contiguous().numpy().tobytes()).hexdigest()[:16]


def show_status(path: Path) -> None:
    print(f"$ shardkeep ledger status {path}", flush=True)
    subprocess.run([sys.executable, "-m", "shardkeep", "ledger", "status", str(path)], check=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--out", type=Path, default=Path("batch-output"), help="output directory: new, empty, or made by this script"
    )
    parser.add_argument("--force", action="store_true", help="empty --out even if this script did not make it")
    parser.add_argument("--workers", type=int, default=4, help="worker processes = shards (default 4)")
    parser.add_argument("--batches", type=int, default=12, help="batches per shard (default 12)")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per batch (default 32)")
    parser.add_argument("--delay", type=float, default=0.05, help="extra seconds per batch (default 0.05)")
    parser.add_argument("--kill-worker", type=int, default=2, help="the worker to kill (default 2)")
    parser.add_argument("--kill-after", type=int, default=4, help="kill it once this batch is recorded (default 4)")
    parser.add_argument("--no-kill", action="store_true", help="run without killing anything")
    parser.add_argument("--reassign", action="store_true", help="give the killed worker's shard to worker 0")
    args = parser.parse_args()
    if not 0 <= args.kill_worker < args.workers or not 0 <= args.kill_after < args.batches - 1:
        parser.error("--kill-worker must be a worker and --kill-after must leave batches to do")

    try:
        prepare_output(args.out, "batch_job.py", force=args.force)
    except OutputDirError as exc:
        parser.error(str(exc))
    ledger_path = args.out / "progress.json"
    input_fingerprint, model_hash = fingerprints(args)
    summary: dict[str, Any] = {"killed": None, "resume": {}, "reassigned": None}

    print(f"=== phase 1: {args.workers} workers x {args.batches} batches of {args.batch_size} ===", flush=True)
    ledger = sk.ProgressLedger(ledger_path, args.workers)
    ledger.initialize(input_fingerprint=input_fingerprint, model_config_hash=model_hash)
    kill = None if args.no_kill else (args.kill_worker, args.kill_after)
    exits = run_workers(args, ledger, list(range(args.workers)), kill)
    for worker, code in sorted(exits.items()):
        if code != 0:
            reason = f"worker {worker} died with signal {-code}" if code < 0 else f"worker {worker} exited {code}"
            for shard in ledger.assigned_shards(worker):
                ledger.mark_shard_failed(shard, reason)
            summary["killed"] = {"worker": worker, "exit_code": code}
    show_status(ledger_path)

    incomplete = ledger.incomplete_shards()
    if incomplete:
        print("\n=== phase 2: restart ===", flush=True)
        # A restarted driver: initialize() keeps the ledger and checks that the run is the same.
        ledger = sk.ProgressLedger(ledger_path, args.workers)
        ledger.initialize(input_fingerprint=input_fingerprint, model_config_hash=model_hash)
        if args.reassign:
            for shard in incomplete:
                ledger.reassign_shard(shard, 0)
                print(f"driver: reassigned shard {shard} to worker 0 (original rank stays {shard})", flush=True)
            summary["reassigned"] = {str(shard): 0 for shard in incomplete}
        for shard, batch in ledger.resume_points().items():
            owner = ledger.resume_info(shard)["assigned_rank"]
            print(f"driver: shard {shard} resumes from batch {batch} on worker {owner}", flush=True)
            summary["resume"][str(shard)] = batch
        workers = sorted({ledger.resume_info(shard)["assigned_rank"] for shard in incomplete})
        exits = run_workers(args, ledger, workers, None)
        if any(exits.values()):
            print(f"driver: restart failed: {exits}", flush=True)
            return 1
        show_status(ledger_path)

    print("\n=== result ===", flush=True)
    progress = ledger.progress()
    output = merged_output(ledger, args.workers)
    expected = reference_output(args)
    matches = bool(torch.equal(output, expected))
    archived = ledger.archive(args.out / "archive")
    final = args.out / "final"
    sk.save({"embeddings": output}, final)
    print(
        f"final output: {tuple(output.shape)} from {progress['total_batches']} batches, "
        f"{progress['total_sequences_checkpointed']} sequences, digest {digest(output)}",
        flush=True,
    )
    print(f"matches the no-crash computation: {'yes' if matches else 'NO'} (digest {digest(expected)})", flush=True)
    print(f"ledger archived to {archived}; output saved to {final}", flush=True)
    summary.update(
        {
            "digest": digest(output),
            "reference_digest": digest(expected),
            "matches": matches,
            "batches": progress["total_batches"],
            "sequences": progress["total_sequences_checkpointed"],
            "completed": progress["completed"],
            "ledger_sequence": progress["sequence"],
        }
    )
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if matches else 1


if __name__ == "__main__":
    raise SystemExit(main())
