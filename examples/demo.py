"""The shardkeep demo (`make demo`): a mixture-of-experts model trained on several ranks,
killed in the middle of a save, resumed on a different number of ranks, inspected, damaged and
recovered.

    python examples/demo.py [--workdir NEW_DIR] [--steps 60] [--every 10] [--kill-at 40] [--s3]
                            [--nodes auto|netns|simulated]

1. Train on 2 ranks (``examples/train_moe.py``: FSDP2 on gloo, async checkpoints with a hot and
   a cold tier) and kill -9 rank 1 in the middle of the async save of step ``--kill-at``: its
   first shard is written into the staging directory and the save has not committed. Rank 1
   holds there (``train_moe.py --pause-save-at``) until the kill, so the kill lands inside the
   save however loaded the machine is.
2. The half-written save is invisible: the manager and ``shardkeep ls`` do not list it, and its
   staging directory cannot be read as a checkpoint.
3. Restart on 3 ranks: resume from the newest checkpoint that verifies (the save before the
   killed one), resharding 2 -> 3. The resumed run's manager removes the crashed save's
   staging directory (``--staging-lease`` of a few seconds instead of an hour).
4. Measure what each rank read: right after the restore, each rank loads the checkpoint once
   more with ``mmap=False`` through counting byte stores, and the kernel's ``rchar`` is read
   around it; the table compares it with the checkpoint's size and with the saved chunks that
   overlap each rank's rows.
5. Compare the loss of the steps that ran twice: the curve continues where it left off.
6. Load only the hot tier (the cold tier taken offline) and route tokens with it; then load
   everything into one process (3 -> 1) and check the validation loss against the manifest.
7. Run ``shardkeep ls``, ``inspect`` and ``verify``.
8. Flip one byte in a shard of the newest checkpoint: ``verify`` catches it, and
   ``CheckpointManager.restore`` falls back to the previous checkpoint. Draw the run (what
   ``shardkeep ls --plot`` draws, through ``shardkeep.report.plot_root``) with the kill and the
   resume marked.
9. Two levels on 2 nodes x 2 ranks (``examples/levels_train.py``): a ``MultiLevelManager`` saves
   each node's local disk every 2 steps with 1 peer replica and drains to a persistent directory
   every 10 steps. The nodes are two network namespaces running ``torchrun --nnodes 2
   --nproc-per-node 2`` (``tests/support/netns.py``) where they can be made (root), else 4
   forked gloo ranks as 2 simulated nodes with separate local roots; the demo says which. After
   step 17, kill -9 every rank of node 1 and delete its local disk; restart with a fresh node 1:
   the run resumes at the newest local step (16), node 1's files healed from node 0's replicas,
   where the persistent level alone would resume at step 10.
10. Send SIGTERM to every rank after step 25: the ranks agree, take an emergency save on the
   local level and exit 75; the restart resumes from that step and trains to the end. Draw the
   persistent level's saves with the node loss, the resume and the preemption marked.

Each step prints what it found and a PASS/FAIL line; the summary also goes to
``WORKDIR/demo_summary.json``. Exit status 0 only if every check passed. Every run works in a
fresh directory: a new one under the system's temporary directory, or ``--workdir``, which
must not exist yet or be empty (nothing is ever deleted). ``--s3`` puts the cold tier on a local
SeaweedFS server (the test suite's S3 server, on 127.0.0.1).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from train_moe import (
    PAUSED_SAVE,
    ModelArgs,
    MoETransformer,
    first_line,
    free_port,
    loss_of,
    spawn_ranks,
    supervise,
    validation_set,
)

import shardkeep as sk
from shardkeep.report import PlotEvent, plot_root

REPO = Path(__file__).resolve().parent.parent
LEVELS_TRAIN = Path(__file__).resolve().parent / "levels_train.py"
#: How long the resumed run leaves an untouched staging directory alone before removing it as a
#: crashed save's (the library's default is an hour; the demo cannot wait that long).
STAGING_LEASE = 2.0


def mib(size: float) -> str:
    return f"{size / 2**20:.2f} MiB"


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
        self.staging: str | None = None  # the killed save's staging directory
        self.levels = self.workdir / "levels"  # the multi-level run's log and persistent level

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

    def last_step(self) -> int | None:
        return max((e["step"] for e in self.events("step")), default=None)

    def train_argv(self, steps: int) -> list[str]:
        return ["--root", str(self.workdir), "--cold", self.cold, "--steps", str(steps), "--every",
                str(self.args.every), "--step-delay", str(self.args.step_delay), "--no-progress"]  # fmt: skip

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

    def staging_dirs(self) -> list[Path]:
        return sorted(p for p in self.ckpts.iterdir() if ".tmp-" in p.name) if self.ckpts.is_dir() else []

    def cold_leftovers(self) -> dict[str, int]:
        """Files in the local cold tier that no committed checkpoint's manifest lists: path ->
        size (a crashed save's attempt, ``step_N/attempt-<id>``, whose id begins with the id of its
        staging directory ``step_N.tmp-<id>``)."""
        if "://" in self.cold or not Path(self.cold).is_dir():
            return {}
        used = set()
        for entry in self.manager().list():
            manifest = sk.read_manifest(entry.path)
            used |= {f"{entry.name}/{record.path}" for record in manifest.files if record.tier == "cold"}
        files = {str(p.relative_to(self.cold)): p.stat().st_size for p in Path(self.cold).rglob("*") if p.is_file()}
        return {path: size for path, size in sorted(files.items()) if path not in used}

    # -- the steps ------------------------------------------------------------------------------
    def train_and_kill(self) -> bool:
        kill_at = self.args.kill_at
        self.heading(f"1. Train on 2 ranks; kill -9 rank 1 in the middle of the async save of step {kill_at}")
        # Far more steps than the kill allows: the run cannot finish before the kill, however
        # slow the machine is. Rank 1 holds inside the save of step kill_at once its first
        # shard is in the staging directory, and says so in PAUSED_SAVE.
        argv = [*self.train_argv(10 * self.args.steps), "--pause-save-at", str(kill_at)]
        processes = spawn_ranks(2, argv)
        print(f"  ranks started: pids {[p.pid for p in processes]}; checkpoint every {self.args.every} steps")
        announce = self.workdir / PAUSED_SAVE
        paused: dict[str, Any] | None = None
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and all(p.poll() is None for p in processes):
            if announce.exists():
                paused = json.loads(announce.read_text())
                break
            time.sleep(0.01)
        killed_after = staging_seen = None
        if paused is not None and paused["pid"] == processes[1].pid:
            staging = self.ckpts / paused["staging"]
            staging_seen = staging.is_dir() and not (self.ckpts / f"step_{kill_at:08d}").exists()
            killed_after = self.last_step()
            os.kill(processes[1].pid, signal.SIGKILL)
            self.staging = paused["staging"]
            print(f"  rank 1 wrote {paused['file'].partition('/')[2]} ({paused['bytes_written']} bytes) into the "
                  f"staging directory {paused['staging']}")  # fmt: skip
            print(f"  kill -9 sent to rank 1 (pid {processes[1].pid}) there; rank 0 had logged step {killed_after}")
        codes = supervise(processes, timeout=60)
        saves = [e["step"] for e in self.events("save")]
        print(f"  exit codes {codes} (the launcher stopped rank 0); async saves started: {saves}")
        self.summary.update(killed_save_step=kill_at, killed_after_step=killed_after,
                            first_run_last_step=self.last_step(), staging_dir=self.staging)  # fmt: skip
        return self.check(
            "kill",
            paused is not None and bool(staging_seen) and codes[1] == -signal.SIGKILL,
            f"rank 1 died of SIGKILL inside the save of step {kill_at}: its staging directory existed, "
            f"step_{kill_at:08d} did not",
        )

    def half_written_save_is_invisible(self) -> bool:
        kill_at = self.args.kill_at
        self.heading("2. The half-written save is invisible")
        leftovers = self.staging_dirs()
        for leftover in leftovers:
            files = [p for p in leftover.rglob("*") if p.is_file()]
            size = sum(p.stat().st_size for p in files)
            manifest = "present" if (leftover / "manifest.json").exists() else "absent"
            print(
                f"  left by the killed save: {leftover.name}/ ({len(files)} files, {size} bytes; manifest.json {manifest})"
            )
        orphans = self.cold_leftovers()
        if orphans:
            print(f"  and in the cold tier: {len(orphans)} files, {sum(orphans.values())} bytes that no manifest lists, "
                  f"in {', '.join(sorted({path.rpartition('/shards/')[0] for path in orphans}))}/")  # fmt: skip
        entries = self.manager().list(verify=True)
        names = [entry.name for entry in entries]
        newest = max((e for e in entries if e.verified), key=lambda e: e.step, default=None)
        print(f"  committed checkpoints (manager.list, verified): {', '.join(names)}")
        refused = ""
        if leftovers:
            try:
                sk.read_manifest(leftovers[0])
            except sk.CheckpointNotFoundError as exc:
                refused = f"{type(exc).__name__}: {exc}"
            print(f"  sk.read_manifest({leftovers[0].name}) -> {refused or 'no error!'}")
        listing = self.shardkeep("ls", str(self.ckpts))
        self.summary.update(newest_before_restart=newest.step if newest else None,
                            staging_after_kill=[p.name for p in leftovers], cold_orphans_after_kill=orphans)  # fmt: skip
        name = f"step_{kill_at:08d}"
        return self.check(
            "invisible",
            name not in names
            and not (self.ckpts / name).exists()
            and f"{name} " not in listing.stdout
            and newest is not None
            and newest.step == kill_at - self.args.every
            and all(not (p / "manifest.json").exists() for p in leftovers)
            and (not leftovers or bool(refused)),
            f"{name} is not listed by the manager or ls and cannot be read as a checkpoint; the newest checkpoint "
            f"that verifies is {newest.name if newest else 'none'}",
        )

    def resume_on_three(self) -> bool:
        self.heading("3. Restart on 3 ranks and resume from the newest checkpoint that verifies")
        argv = [*self.train_argv(self.args.steps), "--staging-lease", str(STAGING_LEASE), "--measure-reads"]
        codes = supervise(spawn_ranks(3, argv), timeout=300)
        resumes = self.events("resume")
        resume = resumes[-1] if resumes else {}
        print(f"  exit codes {codes}")
        print(
            f"  resumed from step {resume.get('step')} saved by {resume.get('from_world_size')} ranks, now on "
            f"{resume.get('world_size')} ranks; checkpoints restore skipped: {resume.get('skipped')}"
        )
        done = self.events("done")
        self.summary.update(resume_step=resume.get("step"), resume_world_sizes=[resume.get("from_world_size"), 3],
                            resume_skipped=resume.get("skipped"))  # fmt: skip
        resumed = self.check(
            "resume",
            codes == [0, 0, 0]
            and resume.get("step") == self.summary["newest_before_restart"]
            and resume.get("from_world_size") == 2
            and resume.get("skipped") == []
            and bool(done)
            and done[-1]["step"] == self.args.steps,
            f"resume step {resume.get('step')} (2 -> 3 ranks; the half-written save was never a candidate), "
            f"trained on to step {self.args.steps}",
        )
        leftovers = [p.name for p in self.staging_dirs()]
        orphans = self.cold_leftovers()
        print(f"  staging directories in {self.ckpts.name}/ now: {leftovers or 'none'} (the resumed run's manager "
              f"removed {self.staging or 'nothing'}: untouched for more than its {STAGING_LEASE:.0f} s lease)")  # fmt: skip
        if orphans:
            print(f"  the cold tier still holds {len(orphans)} files ({sum(orphans.values())} bytes) that no manifest "
                  f"lists, in {', '.join(sorted({p.rpartition('/shards/')[0] for p in orphans}))}/")  # fmt: skip
        self.summary.update(staging_after_resume=leftovers, cold_orphans_after_resume=orphans)
        cleaned = self.check(
            "cleanup",
            self.staging is not None and not leftovers and not orphans,
            f"the killed save's staging directory {self.staging} and its files in the cold tier were removed by "
            "the resumed run; none is left",
        )
        return resumed and cleaned

    def reads_per_rank(self) -> bool:
        self.heading("4. What each rank read to resume (2 -> 3 ranks), measured")
        found = self.events("reads")
        if not found:
            return self.check("reads", False, "the resumed run logged no read measurement")
        reads = found[-1]
        ranks, total = reads["ranks"], reads["data_bytes"]
        print(f"  {reads['checkpoint']}: {reads['files']} data files, {mib(total)} ({total} bytes) by its manifest, "
              f"saved on {reads['saved_world_size']} ranks")  # fmt: skip
        print(f"  {'rank':>6} {'files':>7} {'bytes read':>11} {'of all':>7} {'saved chunks':>13} {'its own':>9} "
              f"{'read() bytes':>13}")  # fmt: skip
        print(f"  {'':>6} {'opened':>7} {'(measured)':>11} {'':>7} {'overlapping':>13} {'rows':>9} {'(kernel)':>13}")
        for rank in ranks:
            kernel = rank["kernel_rchar"]
            print(f"  {rank['rank']:>6} {rank['files_opened']:>4}/{reads['files']:<2} {rank['data_bytes']:>11} "
                  f"{rank['data_bytes'] / total:>7.0%} {rank['needed_chunk_bytes']:>13} {rank['own_rows_bytes']:>9} "
                  f"{kernel if kernel is not None else '-':>13}")  # fmt: skip
        summed = sum(rank["data_bytes"] for rank in ranks)
        own = sum(rank["own_rows_bytes"] for rank in ranks)
        print(f"  {'sum':>6} {'':>7} {summed:>11} {summed / total:>7.0%} {'':>13} {own:>9}")
        print("  measured: right after its restore, each rank loaded the checkpoint once more with mmap=False, so")
        print("  that every byte came through read() (the restore memory-maps the same ranges, which read counters")
        print("  cannot see). 'bytes read': what the byte stores served from the data files, shard headers included;")
        print("  'read() bytes': the kernel's rchar for the whole process over that load (the manifest too; not")
        print("  what comes from S3 over a socket).")
        print("  'saved chunks overlapping' and 'its own rows' are worked out from the manifest. Format 2.1 records a")
        print("  digest per block of each chunk (16 KiB here), so a rank reads and checks only the blocks that hold")
        print("  its rows, not the whole chunks that overlap them; the tensors here are tens of KB, a few blocks")
        print("  each, so a rank still reads somewhat more than its own rows (from an object store, runs closer than")
        print("  1 MiB are fetched as one, so there it reads whole chunks).")
        straddling = [rank["rank"] for rank in ranks if rank["needed_chunk_bytes"] > 0.9 * total]
        if straddling:
            print(
                f"  rank(s) {straddling} hold rows of both saved shards of every tensor: whole chunks would be all of"
            )
            print("  the checkpoint for them.")
        self.summary["reads"] = reads
        bounded = all(
            rank["own_rows_bytes"] <= rank["data_bytes"] <= rank["needed_chunk_bytes"] + rank["header_bytes_at_most"]
            and (rank["kernel_rchar"] is None or rank["kernel_rchar"] >= rank["local_file_bytes"])
            for rank in ranks
        )
        shares = ", ".join(f"rank {rank['rank']} {rank['data_bytes'] / total:.0%}" for rank in ranks)
        return self.check(
            "reads",
            len(ranks) == 3 and bounded and min(rank["data_bytes"] for rank in ranks) < 0.6 * total,
            f"each rank read its own rows and at most the saved chunks overlapping them, plus headers: {shares} of "
            f"{mib(total)} (its own rows: about {own / len(ranks) / total:.0%} each)",
        )

    def loss_continues(self) -> bool:
        self.heading("5. The loss curve continues where it left off")
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
        self.heading("6. Inference from the hot tier only, then a full load into one process")
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
            hot = sk.load(newest.path, select=sk.LoadSelection(tiers={"hot"}))
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
        self.heading("7. The command line: ls, inspect, verify")
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
        self.heading("8. Flip one byte in a shard: verify catches it, restore falls back; the plot")
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
            print(f"  restore skipped {name}: {first_line(reason)}")
        model = MoETransformer(ModelArgs())
        model.load_state_dict(restored.state.model)
        print(f"  restore loaded {restored.entry.name} (iteration {restored.state.iteration}) into a one-process model")
        listing = self.shardkeep("ls", str(self.ckpts), "--verify")
        self.summary.update(
            corrupted=newest.name,
            verify_after=verify.returncode,
            restored_step=restored.step,
            skipped=[name for name, _ in restored.skipped],
        )
        fell_back = self.check(
            "fallback",
            verify.returncode == 1
            and shard.name in verify.stdout
            and restored.step == previous.step
            and [name for name, _ in restored.skipped] == [newest.name]
            and listing.returncode == 1,
            f"verify exit {verify.returncode} naming {shard.name}; restore fell back from {newest.name} to "
            f"{restored.entry.name}",
        )
        # The picture `shardkeep ls --verify --plot` draws, with what no manifest records marked.
        kill_at, resume = self.args.kill_at, self.summary["resume_step"]
        events = [
            PlotEvent(kill_at, f"kill -9 rank 1 during the\nsave of step {kill_at} (never committed)", "#c44e52"),
            PlotEvent(resume, f"resumed from step {resume}\non 3 ranks (saved on 2)", "#2a7f3f"),
        ]
        entries = manager.list(verify=True)
        run = next((entry.run_id for entry in reversed(entries) if entry.run_id), None)
        picture = self.workdir / "checkpoints.png"
        drawn = plot_root(entries, manager.policy, run, picture, title=f"{self.ckpts}   run {run}", events=events)
        print(f"  plot {picture}: {drawn.saves} saves ({drawn.kept} still present), the kill and the resume marked; "
              f"saves blocked training {drawn.blocked_seconds:.2f} s of {drawn.total_seconds:.2f} s in all")  # fmt: skip
        self.summary.update(plot=str(picture), plot_events=[[event.step, event.label] for event in events])
        plotted = self.check(
            "plot",
            picture.read_bytes().startswith(b"\x89PNG") and drawn.events == 2,
            f"plot written to {picture}",
        )
        return fell_back and plotted

    # -- steps 9 and 10: two levels on two nodes --------------------------------------------------
    def level_events(self, kind: str, run: int) -> list[dict[str, Any]]:
        path = self.levels / "levels_log.jsonl"
        lines = path.read_text().split("\n")[:-1] if path.exists() else []
        return [r for r in map(json.loads, lines) if r["event"] == kind and r["run"] == str(run)]

    def wait_for(self, nodes: Nodes, kind: str, run: int, step: int, timeout: float = 180) -> dict[str, Any] | None:
        """The first event ``kind`` of ``run`` at ``step`` or later; ``None`` if the run ended first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [e for e in self.level_events(kind, run) if e.get("step", 0) >= step]
            if found or not nodes.running():
                return found[0] if found else None
            time.sleep(0.02)
        return None

    def levels_argv(self, nodes: Nodes) -> list[str]:
        return ["--root", str(self.levels), "--local-root", nodes.local, "--steps", str(LEVELS_STEPS),
                "--local-every", str(LOCAL_EVERY), "--persist-every", str(PERSIST_EVERY)]  # fmt: skip

    def persisted(self) -> list[int]:
        root = self.levels / "persistent"
        return sorted(e.step for e in sk.CheckpointManager(root, read_only=True).list()) if root.is_dir() else []

    def node_loss(self, nodes: Nodes) -> bool:
        self.heading("9. Two levels on 2 nodes x 2 ranks: kill -9 one node, wipe its disk, resume from its replicas")
        print(f"  nodes: {nodes.kind}")
        print(f"  levels: local (each node's own disk, {nodes.local}) every {LOCAL_EVERY} steps with 1 peer replica; "
              f"persistent ({self.levels / 'persistent'}) every {PERSIST_EVERY} steps, drained from the local level")  # fmt: skip
        self.levels.mkdir(exist_ok=True)
        nodes.start([*self.levels_argv(nodes), "--pause-at", str(KILL_AFTER)], run=1)
        reached = self.wait_for(nodes, "step", 1, KILL_AFTER)
        if reached is None:
            nodes.wait(30)
            return self.check("node_loss", False, f"the first multi-level run never reached step {KILL_AFTER}")
        print(f"  {nodes.kill_node(1)}, after step {reached['step']}")
        nodes.wait(60)
        killed_after = max(e["step"] for e in self.level_events("step", 1))
        saves = self.level_events("save", 1)
        local = max((e["step"] for e in saves if "local" in e["committed"]), default=None)
        protected = saves[-1]["protected"] if saves else None
        errors = [line for line in nodes.output().splitlines() if "Error:" in line and "ChildFailed" not in line]
        stopped = first_line(errors[-1]) if errors else "no error logged"
        print(f"  node 0's ranks stopped at their next collective: {stopped}")
        persisted = max(self.persisted(), default=None)
        disk = nodes.disk(1)
        held = sorted(p.name for p in disk.iterdir()) if disk.is_dir() else []
        shutil.rmtree(disk, ignore_errors=True)
        disk.mkdir(parents=True)
        print(f"  node 1's local disk deleted ({', '.join(held)}) and replaced by an empty one")
        print(f"  before the kill: newest local step {local} (replication settled up to {protected}); newest persisted "
              f"step {persisted}")  # fmt: skip
        nodes.start(self.levels_argv(nodes), run=2)
        resume = self.wait_for(nodes, "resume", 2, 0, timeout=120) or {}
        healed = resume.get("healed", [])
        peers = sorted({source for _, _, source in healed})
        own = [name for _, name, _ in healed if "rank_00002" in name or "rank_00003" in name]  # node 1 wrote them
        print(f"  restarted with a fresh node 1: resumed at step {resume.get('step')} from {resume.get('levels_read')}, "
              f"in {resume.get('seconds', 0):.2f} s; {len(healed)} files of node 1 came from {peers}:")  # fmt: skip
        for rank, name, source in healed:
            whose = "node 1's own file: a replica" if name in own else "a file only node 0 writes"
            print(f"    rank {rank}: {name} <- {source} ({whose})")
        lost_multi = killed_after - resume["step"] if resume else None
        lost_single = killed_after - persisted if persisted is not None else killed_after
        print(f"  steps lost: {lost_multi} (trained up to {killed_after}, resumed at {resume.get('step')}); a single "
              f"persistent level every {PERSIST_EVERY} steps would have resumed at {persisted} and lost {lost_single}")  # fmt: skip
        self.summary["node_loss"] = {
            "nodes": "netns" if isinstance(nodes, NamespaceNodes) else "simulated",
            "killed_after_step": killed_after, "newest_local_step": local, "newest_persisted_step": persisted,
            "resume_step": resume.get("step"), "healed": healed, "levels_read": resume.get("levels_read"),
            "steps_lost": lost_multi, "steps_lost_single_level": lost_single,
        }  # fmt: skip
        return self.check(
            "node_loss",
            bool(resume) and resume["step"] == local and len(own) >= 2 and peers == ["local@node0"]
            and resume["levels_read"] == ["local"] and lost_multi is not None and lost_multi < lost_single,
            f"node 1 lost with its disk: resumed at the newest local step {local} from node 0's replicas; "
            f"{lost_multi} step(s) lost against {lost_single} with the persistent level alone",
        )  # fmt: skip

    def preemption(self, nodes: Nodes) -> bool:
        self.heading("10. Preempt the run with SIGTERM: the emergency save, exit 75, and the resume")
        if self.wait_for(nodes, "step", 2, PREEMPT_AFTER) is None:
            nodes.wait(30)
            return self.check("preemption", False, f"the resumed run never reached step {PREEMPT_AFTER}")
        pids = {e["rank"]: e["pid"] for e in self.level_events("start", 2)}
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        signaled = max(e["step"] for e in self.level_events("step", 2))
        print(f"  SIGTERM sent to every rank (pids {[pids[r] for r in sorted(pids)]}) at step {signaled}, as a "
              "scheduler does")  # fmt: skip
        nodes.wait(60)
        codes = sorted((e["rank"], e["code"]) for e in self.level_events("exit", 2))
        said = [line[line.index("preemption:") :] for line in nodes.output().splitlines() if "preemption:" in line]
        shown = {}  # once each: the ranks of a node say the same, their timings aside
        for line in said:
            shown.setdefault(re.sub(r"[\d.]+ s\b", "", line), line)
        for line in shown.values():
            print(f"    {line}")
        emergency = max(e["step"] for e in self.level_events("step", 2))
        saved = (nodes.disk(0) / f"step_{emergency:08d}" / "manifest.json").exists()
        print(f"  exit codes {[code for _, code in codes]}; the last step trained: {emergency}; emergency checkpoint "
              f"step_{emergency:08d} on node 0's local disk: {'present' if saved else 'missing'}")  # fmt: skip
        started = time.monotonic()
        nodes.start(self.levels_argv(nodes), run=3)
        nodes.wait(240)
        resume = next(iter(self.level_events("resume", 3)), {})
        after = [e["step"] for e in self.level_events("step", 3)]
        finished = sorted(e["code"] for e in self.level_events("exit", 3))
        print(f"  restarted: resumed at step {resume.get('step')} from {resume.get('levels_read')}, trained steps "
              f"{after[0] if after else '-'}..{after[-1] if after else '-'}, exit codes {finished} "
              f"({time.monotonic() - started:.0f} s)")  # fmt: skip
        self.summary["preemption"] = {
            "signaled_at_step": signaled, "exit_codes": [code for _, code in codes], "emergency_step": emergency,
            "resume_step": resume.get("step"), "resumed_steps": [after[0], after[-1]] if after else [],
            "exit_codes_after": finished,
        }  # fmt: skip
        preempted = self.check(
            "preemption",
            [code for _, code in codes] == [75] * 4 and saved and resume.get("step") == emergency
            and after == list(range(emergency + 1, LEVELS_STEPS + 1)) and finished == [0] * 4,
            f"every rank exited 75 after the emergency save of step {emergency}; the restart resumed there (0 steps "
            f"lost) and trained to step {LEVELS_STEPS}",
        )  # fmt: skip
        return self.levels_plot() and preempted

    def levels_plot(self) -> bool:
        node_loss = self.summary.get("node_loss", {})
        emergency = self.summary["preemption"]["emergency_step"]
        events = [
            PlotEvent(node_loss.get("killed_after_step", 0), "kill -9 of node 1,\nits disk wiped", "#c44e52"),
            PlotEvent(node_loss.get("resume_step", 0), "resumed from\nnode 0's replicas", "#2a7f3f"),
            PlotEvent(emergency, f"SIGTERM: emergency\nsave of step {emergency}, exit 75", "#dd8452"),
        ]
        manager = sk.CheckpointManager(self.levels / "persistent", metric="loss", read_only=True)
        entries = manager.list()
        run = next((entry.run_id for entry in reversed(entries) if entry.run_id), None)
        picture = self.workdir / "levels.png"
        drawn = plot_root(entries, manager.policy, run, picture, title=f"{manager.root}   run {run}", events=events)
        print(f"  plot {picture}: the persistent level's saves, the node loss, the resume and the preemption marked")
        self.summary.update(levels_plot=str(picture), levels_plot_events=[[e.step, e.label] for e in events])
        return picture.read_bytes().startswith(b"\x89PNG") and drawn.events == 3

    def on_two_nodes(self) -> list[bool]:
        """Steps 9 and 10; a failure of the nodes themselves (the namespaces could not be built,
        a run that hangs) fails the step it happened in, with the error."""
        results: list[bool] = []
        try:
            with two_nodes(self.workdir, self.args.nodes) as nodes:
                results.append(self.node_loss(nodes))
                if results[-1]:
                    results.append(self.preemption(nodes))
                else:
                    nodes.wait(30)
        except Exception as exc:
            name = "preemption" if "node_loss" in self.summary["checks"] else "node_loss"
            results.append(self.check(name, False, f"{type(exc).__name__}: {first_line(exc)}"))
        return results

    def run(self) -> int:
        steps = [self.train_and_kill, self.half_written_save_is_invisible, self.resume_on_three,
                 self.reads_per_rank, self.loss_continues, self.hot_tier_inference, self.cli,
                 self.corrupt_and_fall_back]  # fmt: skip
        results = []
        for step in steps:
            results.append(step())
            if not results[-1] and step in (self.train_and_kill, self.resume_on_three):
                break  # later steps need this one
        if len(results) == len(steps) and not self.args.no_levels:
            steps += [self.node_loss, self.preemption]  # type: ignore[list-item]
            results += self.on_two_nodes()
        elapsed = time.monotonic() - self.started
        self.summary.update(ok=all(results) and len(results) == len(steps), seconds=round(elapsed, 1))
        (self.workdir / "demo_summary.json").write_text(json.dumps(self.summary, indent=2) + "\n")
        self.heading("Summary")
        for name, check in self.summary["checks"].items():
            print(f"  {'PASS' if check['ok'] else 'FAIL'}  {name:<9} {check['detail']}")
        print(f"  {'all checks passed' if self.summary['ok'] else 'SOME CHECKS FAILED'} in {elapsed:.0f} s; "
              f"files in {self.workdir}; the plots: {self.summary.get('plot', 'not drawn')}, "
              f"{self.summary.get('levels_plot', 'not drawn')}")  # fmt: skip
        return 0 if self.summary["ok"] else 1


# -- the multi-level run: 2 nodes x 2 ranks ----------------------------------------------------
LEVELS_STEPS = 32  # the multi-level run trains steps 1..LEVELS_STEPS
LOCAL_EVERY, PERSIST_EVERY = 2, 10
KILL_AFTER = 17  # kill node 1 while the ranks pause after this step (local step 16, persistent step 10)
PREEMPT_AFTER = 25  # SIGTERM every rank once the resumed run logged this step


class SimulatedNodes:
    """Two "nodes" of 2 forked gloo ranks each on 127.0.0.1 (``SHARDKEEP_NODE`` = rank // 2),
    each with its own local disk directory ``WORK/disks/node<i>``."""

    kind = "simulated nodes (4 forked gloo ranks as 2 nodes of 2, separate local roots)"

    def __init__(self, work: Path) -> None:
        self.work = work
        self.local = str(work / "disks" / "node{node}")
        self.processes: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []

    def output(self) -> str:
        """What rank 0 of the current run printed."""
        return self.logs[0].read_text(errors="replace") if self.logs else ""

    def disk(self, node: int) -> Path:
        return self.work / "disks" / f"node{node}"

    def start(self, argv: list[str], run: int) -> None:
        port = free_port()
        self.processes = []
        for rank in range(4):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank % 2), WORLD_SIZE="4", LEVELS_RUN=str(run))
            env.update(
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", SHARDKEEP_NODE=str(rank // 2)
            )
            log = self.work / "logs" / f"run{run}-rank{rank}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "wb") as out:
                command = [sys.executable, str(LEVELS_TRAIN), *argv]
                self.processes.append(subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT))
        self.logs = [self.work / "logs" / f"run{run}-rank{rank}.log" for rank in range(4)]

    def running(self) -> bool:
        return any(process.poll() is None for process in self.processes)

    def kill_node(self, node: int) -> str:
        victims = self.processes[2 * node : 2 * node + 2]
        for process in victims:
            os.kill(process.pid, signal.SIGKILL)
        return f"kill -9 of ranks {2 * node} and {2 * node + 1} (pids {[p.pid for p in victims]})"

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for process in self.processes:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


class NamespaceNodes:
    """Two real nodes: network namespaces joined by a bridge, each with its own private local
    disk (``tests/support/netns.py``); ``torchrun --nnodes 2 --nproc-per-node 2`` on them."""

    kind = "real network namespaces (torchrun --nnodes 2 --nproc-per-node 2, c10d over a bridge)"

    def __init__(self, harness: Any) -> None:
        self.harness = harness
        self.local = str(harness.local)
        self.runs: list[Any] = []

    def output(self) -> str:
        """What node 0's torchrun and ranks of the current run printed."""
        return str(self.runs[0].output()) if self.runs else ""

    def disk(self, node: int) -> Path:
        return Path(self.harness.disks[node])

    def start(self, argv: list[str], run: int) -> None:
        env = {**os.environ, "LEVELS_RUN": str(run)}
        self.runs = self.harness.start_torchrun([str(LEVELS_TRAIN), *argv], env=env)

    def running(self) -> bool:
        return any(run.process.poll() is None for run in self.runs)

    def kill_node(self, node: int) -> str:
        self.harness.kill_node(node)
        return f"kill -9 of every process of node {node} (its torchrun and ranks {2 * node}, {2 * node + 1})"

    def wait(self, timeout: float) -> None:
        self.harness.wait(self.runs, timeout=timeout)


Nodes = SimulatedNodes | NamespaceNodes


@contextlib.contextmanager
def two_nodes(workdir: Path, wanted: str) -> Iterator[Nodes]:
    """Real namespaces when they can be made here (root) and ``wanted`` allows, else simulated."""
    why = "chosen with --nodes simulated"
    if wanted != "simulated":
        sys.path.insert(0, str(REPO))
        from tests.support import netns

        why = netns.probe() or ""
        if not why:
            with netns.two_nodes(workdir / "nodes") as harness:
                yield NamespaceNodes(harness)
            return
        if wanted == "netns":
            raise SystemExit(f"--nodes netns: network namespaces cannot be made here: {why}")
    nodes = SimulatedNodes(workdir / "nodes")
    nodes.kind += f"; {why if wanted == 'simulated' else f'no network namespaces here: {why}'}"
    yield nodes


@contextlib.contextmanager
def cold_tier_on_s3(demo: Demo) -> Iterator[None]:
    """Start the test suite's SeaweedFS server on 127.0.0.1 and put the cold tier in a bucket."""
    sys.path.insert(0, str(REPO))
    from tests.support.s3server import running

    with running(demo.workdir / "seaweedfs") as server:
        demo.env = server.environment
        os.environ.update(server.environment)  # the ranks and the shardkeep commands inherit it
        demo.cold = f"s3://{server.new_bucket('demo')}/cold-tier"
        print(f"cold tier on a local S3 server: {demo.cold} ({server.endpoint})")
        yield


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workdir",
        type=Path,
        help="a new (or empty) directory for this run (default: a fresh one under the temporary directory)",
    )
    parser.add_argument("--steps", type=int, default=60, help="train until this step")
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument(
        "--kill-at", type=int, default=40, help="kill rank 1 in the middle of the save of this step (a save step)"
    )
    parser.add_argument("--step-delay", type=float, default=0.02, help="sleep per training step")
    parser.add_argument("--s3", action="store_true", help="the cold tier on a local S3 server (SeaweedFS)")
    parser.add_argument(
        "--nodes",
        choices=["auto", "netns", "simulated"],
        default="auto",
        help="the multi-level run's 2 nodes: network namespaces (root), simulated (forked ranks), or the first that works",
    )
    parser.add_argument(
        "--no-levels",
        action="store_true",
        help="skip steps 9 and 10 (two levels on two nodes: node loss and preemption)",
    )
    args = parser.parse_args()
    if args.kill_at % args.every or not args.every < args.kill_at <= args.steps:
        parser.error(
            "--kill-at must be a save step (a multiple of --every) after the first save and at most --steps: "
            "a checkpoint to resume from, and the killed save to do again"
        )
    if args.workdir is None:
        args.workdir = Path(tempfile.mkdtemp(prefix="shardkeep-demo-"))
    elif args.workdir.is_symlink() or (
        args.workdir.exists() and (not args.workdir.is_dir() or any(args.workdir.iterdir()))
    ):
        parser.error(
            f"--workdir {args.workdir} exists and is not an empty directory; give a new path (nothing was deleted)"
        )
    else:
        args.workdir.mkdir(parents=True, exist_ok=True)
    demo = Demo(args)
    print(f"shardkeep demo in {args.workdir}: train {args.steps} steps, checkpoint every {args.every}")
    with cold_tier_on_s3(demo) if args.s3 else contextlib.nullcontext():
        return demo.run()


if __name__ == "__main__":
    raise SystemExit(main())
