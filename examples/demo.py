"""The shardkeep demo (`make demo`): a mixture-of-experts model trained on several ranks,
crashed, resumed on a different number of ranks, inspected, damaged and recovered.

    python examples/demo.py [--workdir DIR] [--steps 60] [--every 10] [--kill-at 35] [--s3]

1. Train on 2 ranks (``examples/train_moe.py``: FSDP2 on gloo, async checkpoints with a hot and
   a cold tier) and kill -9 one rank partway.
2. Restart on 3 ranks: resume from the newest checkpoint that verifies, resharding 2 -> 3.
3. Compare the loss of the steps that ran twice: the curve continues where it left off.
4. Load only the hot tier (the cold tier taken offline) and route tokens with it; then load
   everything into one process (3 -> 1) and check the validation loss against the manifest.
5. Run ``shardkeep ls``, ``inspect`` and ``verify``.
6. Flip one byte in a shard of the newest checkpoint: ``verify`` catches it, and
   ``CheckpointManager.restore`` falls back to the previous checkpoint. ``shardkeep ls --plot``
   draws the run.

Each step prints what it found and a PASS/FAIL line; the summary also goes to
``WORKDIR/demo_summary.json``. Exit status 0 only if every check passed. ``--s3`` puts the cold
tier on a local SeaweedFS server (the test suite's S3 server, on 127.0.0.1).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from train_moe import (
    ModelArgs,
    MoETransformer,
    loss_of,
    spawn_ranks,
    supervise,
    validation_set,
)

import shardkeep as sk

REPO = Path(__file__).resolve().parent.parent


class Demo:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.workdir: Path = args.workdir
        self.ckpts = self.workdir / "ckpts"
        self.log = self.workdir / "train_log.jsonl"
        self.cold: str = str(self.workdir / "cold-tier")
        self.env: dict[str, str] = {}
        self.summary: dict[str, Any] = {"checks": {}}
        self.started = time.monotonic()

    # -- helpers ------------------------------------------------------------------------------
    def heading(self, text: str) -> None:
        print(f"\n== {text} " + "=" * max(0, 86 - len(text)), flush=True)

    def check(self, name: str, ok: bool, detail: str) -> bool:
        self.summary["checks"][name] = {"ok": ok, "detail": detail}
        print(f"  {'PASS' if ok else 'FAIL'}  {detail}", flush=True)
        return ok

    def events(self, kind: str) -> list[dict[str, Any]]:
        text = self.log.read_text() if self.log.exists() else ""
        lines = text.split("\n")[:-1]  # the last piece is empty, or a line still being written
        return [record for record in map(json.loads, lines) if record["event"] == kind]

    def train_argv(self, steps: int) -> list[str]:
        return ["--root", str(self.workdir), "--cold", self.cold, "--steps", str(steps),
                "--every", str(self.args.every), "--step-delay", str(self.args.step_delay)]  # fmt: skip

    def shardkeep(self, *argv: str, show: int = 40) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "shardkeep", *argv]
        print(f"  $ shardkeep {' '.join(argv)}", flush=True)
        result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **self.env}, timeout=300)
        lines = (result.stdout + result.stderr).rstrip().splitlines()
        for line in lines[:show]:
            print(f"    {line}")
        if len(lines) > show:
            print(f"    ... ({len(lines) - show} more lines)")
        print(f"    (exit {result.returncode})", flush=True)
        return result

    def manager(self) -> sk.CheckpointManager:
        return sk.CheckpointManager(self.ckpts, keep_last=2, keep_best=1, metric="val_loss")

    # -- the steps ------------------------------------------------------------------------------
    def train_and_kill(self) -> bool:
        self.heading("1. Train on 2 ranks, then kill -9 rank 1 partway")
        # Far more steps than the kill allows: the run cannot finish before the kill, however
        # slow the machine is.
        processes = spawn_ranks(2, self.train_argv(10 * self.args.steps))
        print(f"  ranks started: pids {[p.pid for p in processes]}; checkpoint every {self.args.every} steps")
        killed_at = None
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and all(p.poll() is None for p in processes):
            steps, saves = self.events("step"), self.events("save")
            # Kill once the step is reached and the save started before it has committed, so
            # that the run has a checkpoint to resume from (a save still in flight at the kill
            # would leave only its staging directory, which is never read as a checkpoint).
            committed = bool(saves) and (self.ckpts / f"step_{saves[-1]['step']:08d}").is_dir()
            if steps and steps[-1]["step"] >= self.args.kill_at and committed:
                killed_at = steps[-1]["step"]
                os.kill(processes[1].pid, signal.SIGKILL)
                break
            time.sleep(0.01)
        codes = supervise(processes, timeout=60)
        last_step = max((e["step"] for e in self.events("step")), default=0)
        saves = [e["step"] for e in self.events("save")]
        print(f"  kill -9 sent to rank 1 (pid {processes[1].pid}) after step {killed_at}; exit codes {codes}")
        print(f"  the launcher stopped rank 0; the last step rank 0 logged: {last_step}; async saves started: {saves}")
        entries = self.manager().list(verify=True)
        leftovers = sorted(p.name for p in self.ckpts.iterdir() if ".tmp-" in p.name)
        newest = max((e for e in entries if e.verified), key=lambda e: e.step, default=None)
        for entry in entries:
            print(f"  committed: {entry.name}  val_loss {entry.metric:.4f}  verified {entry.verified}")
        if leftovers:
            print(f"  left behind by the killed save (never read as a checkpoint): {', '.join(leftovers)}")
        self.summary.update(killed_after_step=killed_at, first_run_last_step=last_step,
                            newest_before_restart=newest.step if newest else None)  # fmt: skip
        return self.check(
            "kill",
            killed_at is not None and codes[1] == -signal.SIGKILL and newest is not None,
            f"rank 1 died of SIGKILL at step {killed_at}; newest checkpoint that verifies: "
            f"{newest.name if newest else 'none'}",
        )

    def resume_on_three(self) -> bool:
        self.heading("2. Restart on 3 ranks and resume from the newest checkpoint that verifies")
        codes = supervise(spawn_ranks(3, self.train_argv(self.args.steps)), timeout=300)
        resumes = self.events("resume")
        resume = resumes[-1] if resumes else {}
        print(f"  exit codes {codes}")
        print(
            f"  resumed from step {resume.get('step')} saved by {resume.get('from_world_size')} ranks, now on "
            f"{resume.get('world_size')} ranks (each rank read only the parts of each tensor it holds)"
        )
        done = self.events("done")
        self.summary.update(resume_step=resume.get("step"), resume_world_sizes=[resume.get("from_world_size"), 3])
        return self.check(
            "resume",
            codes == [0, 0, 0]
            and resume.get("step") == self.summary["newest_before_restart"]
            and resume.get("from_world_size") == 2
            and bool(done)
            and done[-1]["step"] == self.args.steps,
            f"resume step {resume.get('step')} (2 -> 3 ranks), trained on to step {self.args.steps}",
        )

    def loss_continues(self) -> bool:
        self.heading("3. The loss curve continues where it left off")
        first: dict[int, float] = {}
        second: dict[int, float] = {}
        for event in self.events("step"):
            (first if event["world_size"] == 2 else second)[event["step"]] = event["loss"]
        again = sorted(set(first) & set(second))
        print(f"  steps run before the kill and again after the resume: {again[0]}..{again[-1]}" if again else "")
        print(f"  {'step':>6} {'loss on 2 ranks':>16} {'loss on 3 ranks':>16} {'difference':>11}")
        for step in again:
            print(f"  {step:>6} {first[step]:>16.6f} {second[step]:>16.6f} {second[step] - first[step]:>+11.2e}")
        worst = max((abs(first[s] - second[s]) for s in again), default=float("nan"))
        resume = self.summary.get("resume_step") or 0
        before = [first[s] for s in sorted(first) if s <= resume][-3:]
        after = [second[s] for s in sorted(second)][:3]
        print(f"  train loss of the 3 steps up to the checkpoint (2 ranks): {[round(v, 4) for v in before]}")
        print(f"  train loss of the 3 steps after resuming (3 ranks):       {[round(v, 4) for v in after]}")
        vals = [(e["step"], round(e["val_loss"], 4)) for e in self.events("save")]
        print(f"  validation loss at each save (both runs): {vals}")
        self.summary.update(repeated_steps=again, max_loss_difference=worst)
        # The batch of each step is the same on any number of ranks; only the order of the float
        # additions in the reductions differs.
        return self.check(
            "loss",
            bool(again) and again[0] == resume + 1 and worst < 1e-5,
            f"{len(again)} repeated steps match within {worst:.1e} (limit 1e-5)",
        )

    def hot_tier_inference(self) -> bool:
        self.heading("4. Inference from the hot tier only, then a full load into one process")
        newest = self.manager().latest(verify=True)
        assert newest is not None
        manifest = sk.read_manifest(newest.path)
        tiers: dict[str, list[int]] = {}
        for record in manifest.files:
            tiers.setdefault(record.tier, []).append(record.size)
        for tier, sizes in sorted(tiers.items()):
            print(f"  tier {tier:<5} {len(sizes)} file(s), {sum(sizes) / 2**20:.2f} MiB")
        offline = None
        if "://" in self.cold:
            print("  (the cold tier is on S3: it stays online, and the load below reads only the hot files)")
        else:
            offline = Path(self.cold).with_name("cold-tier.offline")
            Path(self.cold).rename(offline)
            print(f"  the cold tier is offline (renamed to {offline.name})")
        try:
            hot = sk.load(newest.path, tiers={"hot"})
        finally:
            if offline is not None:
                offline.rename(self.cold)
        margs = ModelArgs()
        model = MoETransformer(margs)
        missing = model.load_state_dict(hot["ema"], strict=False).missing_keys
        print(f"  loaded the EMA's dense weights and routers; not loaded (cold): {missing}")
        _, validation = validation_set(margs, seed=0)
        with torch.no_grad():
            x = model.embed(validation[:, :-1]) + model.position[: margs.seq_len]
            block = model.blocks[0]
            x = x + block.attn(block.norm1(x))
            _, chosen = block.moe.route(block.norm2(x).reshape(-1, margs.d_model))
        share = torch.bincount(chosen.flatten(), minlength=margs.experts).float() / chosen.numel()
        print(f"  layer 0 routing of {chosen.shape[0]} validation tokens, share per expert: "
              f"{[round(float(s), 3) for s in share]}")  # fmt: skip

        full = MoETransformer(margs)
        sk.load(newest.path, into={"model": full})  # both tiers, saved on 3 ranks, loaded on 1
        with torch.no_grad():
            val_loss = float(loss_of(full, validation))
        recorded = newest.metrics["val_loss"]
        assert recorded is not None
        print(f"  full load into one process: validation loss {val_loss:.6f}; the manifest recorded {recorded:.6f}")
        self.summary.update(hot_missing=missing, one_process_val_loss=val_loss, recorded_val_loss=recorded)
        return self.check(
            "hot_tier",
            all(".experts." in key for key in missing) and len(missing) == 2 * margs.layers
            and abs(val_loss - recorded) < 1e-4,
            f"hot tier loaded without the cold tier; one-process validation loss matches ({val_loss:.5f})",
        )  # fmt: skip

    def cli(self) -> bool:
        self.heading("5. The command line: ls, inspect, verify")
        newest = self.manager().latest(verify=True)
        assert newest is not None
        listing = self.shardkeep("ls", str(self.ckpts), "--verify")
        inspect = self.shardkeep("inspect", newest.path, "--max-tensors", "4", show=30)
        verify = self.shardkeep("verify", newest.path)
        self.summary.update(verify_before=verify.returncode)
        return self.check(
            "cli",
            listing.returncode == 0 and inspect.returncode == 0 and verify.returncode == 0,
            f"ls, inspect and verify exit 0 on {newest.name}",
        )

    def corrupt_and_fall_back(self) -> bool:
        self.heading("6. Flip one byte in a shard: verify catches it, restore falls back")
        manager = self.manager()
        entries = sorted(manager.list(), key=lambda e: e.step)
        newest, previous = entries[-1], entries[-2]
        shard = sorted(Path(newest.path).rglob("*.safetensors"))[0]
        data = bytearray(shard.read_bytes())
        offset = len(data) * 2 // 3
        data[offset] ^= 0xFF
        shard.write_bytes(bytes(data))
        print(f"  flipped byte {offset} of {shard.relative_to(self.workdir)}")
        verify = self.shardkeep("verify", newest.path)
        restored = manager.restore()  # one process, no process group: full tensors
        for name, reason in restored.skipped:
            print(f"  restore skipped {name}: {reason[:160]}")
        model = MoETransformer(ModelArgs())
        model.load_state_dict(restored.state.model)
        print(f"  restore loaded {restored.entry.name} (iteration {restored.state.iteration}) into a one-process model")
        picture = self.workdir / "checkpoints.png"
        self.shardkeep("ls", str(self.ckpts), "--verify", "--plot", str(picture))
        self.summary.update(
            corrupted=newest.name,
            verify_after=verify.returncode,
            restored_step=restored.step,
            skipped=[name for name, _ in restored.skipped],
            plot=str(picture),
        )
        return self.check(
            "fallback",
            verify.returncode == 1
            and shard.name in verify.stdout
            and restored.step == previous.step
            and [name for name, _ in restored.skipped] == [newest.name]
            and picture.exists(),
            f"verify exit {verify.returncode} naming {shard.name}; restore fell back from {newest.name} to "
            f"{restored.entry.name}; plot written to {picture}",
        )

    def run(self) -> int:
        steps = [self.train_and_kill, self.resume_on_three, self.loss_continues, self.hot_tier_inference, self.cli,
                 self.corrupt_and_fall_back]  # fmt: skip
        results = []
        for step in steps:
            results.append(step())
            if not results[-1] and step in (self.train_and_kill, self.resume_on_three):
                break  # later steps need this one
        elapsed = time.monotonic() - self.started
        self.summary.update(ok=all(results) and len(results) == len(steps), seconds=round(elapsed, 1))
        (self.workdir / "demo_summary.json").write_text(json.dumps(self.summary, indent=2) + "\n")
        self.heading("Summary")
        for name, check in self.summary["checks"].items():
            print(f"  {'PASS' if check['ok'] else 'FAIL'}  {name:<9} {check['detail']}")
        print(f"  {'all checks passed' if self.summary['ok'] else 'SOME CHECKS FAILED'} in {elapsed:.0f} s; "
              f"files in {self.workdir}")  # fmt: skip
        return 0 if self.summary["ok"] else 1


@contextlib.contextmanager
def cold_tier_on_s3(demo: Demo) -> Iterator[None]:
    """Start the test suite's SeaweedFS server on 127.0.0.1 and put the cold tier in a bucket."""
    sys.path.insert(0, str(REPO / "tests"))
    from s3server import running

    with running(demo.workdir / "seaweedfs") as server:
        demo.env = server.environment
        os.environ.update(server.environment)  # the ranks and the shardkeep commands inherit it
        demo.cold = f"s3://{server.new_bucket('demo')}/cold-tier"
        print(f"cold tier on a local S3 server: {demo.cold} ({server.endpoint})")
        yield


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/shardkeep-demo"), help="replaced if it exists")
    parser.add_argument("--steps", type=int, default=60, help="train until this step")
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--kill-at", type=int, default=35, help="kill rank 1 once rank 0 logged this step")
    parser.add_argument("--step-delay", type=float, default=0.02, help="sleep per training step")
    parser.add_argument("--s3", action="store_true", help="the cold tier on a local S3 server (SeaweedFS)")
    args = parser.parse_args()
    if not args.every < args.kill_at < args.steps:
        parser.error("need --every < --kill-at < --steps: a checkpoint before the kill, and steps after it")
    if args.workdir.exists() and any(args.workdir.iterdir()) and not (args.workdir / "train_log.jsonl").exists():
        parser.error(f"--workdir {args.workdir} is not empty and not an earlier demo's; pick another directory")
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    demo = Demo(args)
    print(f"shardkeep demo in {args.workdir}: train {args.steps} steps, checkpoint every {args.every}")
    with cold_tier_on_s3(demo) if args.s3 else contextlib.nullcontext():
        return demo.run()


if __name__ == "__main__":
    raise SystemExit(main())
