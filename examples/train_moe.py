"""Train a small mixture-of-experts transformer on several ranks, checkpointing with shardkeep.

    python examples/train_moe.py --root /tmp/moe --nproc 2            # its own launcher
    torchrun --standalone --nproc-per-node 2 examples/train_moe.py --root /tmp/moe

The model is plain PyTorch: token and position embeddings, blocks of causal self-attention and
a mixture-of-experts feed-forward layer (a linear router picks the top 2 of 6 experts for each
token), and a language-model head. It learns synthetic sequences drawn from a fixed random
Markov chain, so the loss has somewhere to go. Every parameter is sharded with FSDP2
(``fully_shard``) over a CPU device mesh and gloo: the experts' weights are stacked as
``[experts, ...]`` tensors, so each rank holds whole experts. AdamW trains it and an EMA copy of
the weights (sharded the same way) follows it.

Checkpoints go through ``shardkeep.CheckpointManager``: every ``--every`` steps an async save
(training resumes as soon as the state is copied), keep the last 2 and the best 1 by validation
loss, with two storage tiers: the dense weights and the routers on ``hot`` (beside the
manifests, under ``ROOT/ckpts``) and the experts and the optimizer state on ``cold`` (``--cold``,
another directory or an ``s3://`` URL standing in for remote storage).

A restart, with any number of ranks that divides the batch (1, 2, 3, 4, 6 ...), resumes from the
newest checkpoint that verifies: each rank reads only the saved chunks that overlap the part of
each tensor it holds (whole chunks: a chunk's digest covers all of it). The batch for step N is
the same whatever the world size, so the loss curve continues where it left off. Rank 0 appends
one JSON line per step and per save to ``ROOT/train_log.jsonl``.

Progress: on a terminal, a tqdm bar; otherwise (a pipe, a log file, a CI job) plain lines from
rank 0 on stdout: the start or the resume, the step and loss every ``--print-every`` steps, and
one line per save. ``--no-progress`` prints neither.

The demo (``examples/demo.py``) uses three more options: ``--staging-lease`` (how long an
untouched staging directory of a crashed save is kept before the manager removes it),
``--pause-save-at`` (rank 1 pauses inside one save, so that the demo can kill it there) and
``--measure-reads`` (after a resume, the bytes each rank reads to load the checkpoint).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from store_probes import CountingStore, PausingStore, kernel_read_bytes
from torch import nn
from tqdm import tqdm

import shardkeep as sk
from shardkeep.catalog import DEFAULT_LEASE, checkpoint_name
from shardkeep.storage import ByteStore, LocalStore, open_store

GLOBAL_BATCH = 12  # sequences per step, split evenly across the ranks
VALIDATION_BATCH = 24
HOT_AND_COLD = [("*.experts.*", "cold"), ("optimizer.*", "cold"), ("*", "hot")]
PAUSED_SAVE = "paused-save.json"  # written by the rank that --pause-save-at holds


@dataclass(frozen=True)
class ModelArgs:
    vocab: int = 96
    d_model: int = 64
    heads: int = 4
    layers: int = 2
    experts: int = 6
    top_k: int = 2
    d_expert: int = 128
    seq_len: int = 32


# -- the model ----------------------------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.heads = args.heads
        self.qkv = nn.Linear(args.d_model, 3 * args.d_model, bias=False)
        self.proj = nn.Linear(args.d_model, args.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Experts(nn.Module):
    """``experts`` two-layer MLPs, stacked so that sharding dim 0 hands each rank whole experts."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(args.experts, args.d_model, args.d_expert) * args.d_model**-0.5)
        self.w_out = nn.Parameter(torch.randn(args.experts, args.d_expert, args.d_model) * args.d_expert**-0.5)


class MoE(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k = args.top_k
        self.router = nn.Linear(args.d_model, args.experts, bias=False)
        self.experts = Experts(args)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k experts of each token and their renormalized gate weights."""
        weights, chosen = self.router(x).softmax(dim=-1).topk(self.top_k, dim=-1)
        return weights / weights.sum(dim=-1, keepdim=True), chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = self.route(flat)
        out = torch.zeros_like(flat)
        for expert in range(self.experts.w_in.shape[0]):
            token, slot = (chosen == expert).nonzero(as_tuple=True)
            if token.numel():
                hidden = F.gelu(flat[token] @ self.experts.w_in[expert]) @ self.experts.w_out[expert]
                out.index_add_(0, token, hidden * weights[token, slot, None])
        return out.view_as(x)


class Block(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(args.d_model)
        self.attn = Attention(args)
        self.norm2 = nn.LayerNorm(args.d_model)
        self.moe = MoE(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.moe(self.norm2(x))


class MoETransformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed = nn.Embedding(args.vocab, args.d_model)
        self.position = nn.Parameter(torch.randn(args.seq_len, args.d_model) * 0.02)
        self.blocks = nn.ModuleList(Block(args) for _ in range(args.layers))
        self.norm = nn.LayerNorm(args.d_model)
        self.head = nn.Linear(args.d_model, args.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


# -- synthetic data -------------------------------------------------------------------------------
def markov_table(args: ModelArgs, seed: int) -> torch.Tensor:
    """Each token is followed by one of 3 tokens, with fixed random probabilities."""
    generator = torch.Generator().manual_seed(seed)
    table = torch.zeros(args.vocab, args.vocab)
    for token in range(args.vocab):
        nxt = torch.randperm(args.vocab, generator=generator)[:3]
        table[token, nxt] = torch.rand(3, generator=generator) + 0.2
    return table / table.sum(dim=1, keepdim=True)


def sequences(table: torch.Tensor, count: int, length: int, seed: int) -> torch.Tensor:
    """``count`` sequences of ``length + 1`` tokens; the same for a given seed on every rank."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.empty(count, length + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(table.shape[0], (count,), generator=generator)
    for t in range(length):
        tokens[:, t + 1] = torch.multinomial(table[tokens[:, t]], 1, generator=generator).squeeze(1)
    return tokens


def validation_set(args: ModelArgs, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The Markov chain of run ``seed`` and its fixed validation sequences."""
    table = markov_table(args, seed)
    return table, sequences(table, VALIDATION_BATCH, args.seq_len, seed=seed * 7919 + 1)


def my_rows(tokens: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = tokens.shape[0] // world
    return tokens[rank * per : (rank + 1) * per]


# -- launching without torchrun -----------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def spawn_ranks(world: int, argv: list[str]) -> list[subprocess.Popen[bytes]]:
    """Start ``world`` worker processes of this script, rendezvousing on 127.0.0.1."""
    port = free_port()
    processes = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        processes.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv], env=env))
    return processes


def stop(processes: list[subprocess.Popen[bytes]], grace: float = 10.0) -> None:
    """SIGTERM every rank still running, then SIGKILL what is left after ``grace`` seconds."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for process in processes:
        try:
            process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def supervise(processes: list[subprocess.Popen[bytes]], timeout: float | None = None) -> list[int]:
    """Wait for every rank, as torchrun does: once one fails, stop the others (they would wait
    for it forever in the next collective). Returns each rank's exit code (negative: the
    signal that ended it). The ranks are stopped too if ``timeout`` seconds pass, or if this
    process is interrupted."""
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            codes = [process.poll() for process in processes]
            if all(code is not None for code in codes):
                return [code for code in codes if code is not None]
            if any(code not in (None, 0) for code in codes):
                stop(processes)
            elif deadline is not None and time.monotonic() > deadline:
                print(f"the ranks did not finish within {timeout:.0f} s; stopping them", file=sys.stderr)
                stop(processes)
            time.sleep(0.05)
    finally:
        stop(processes)


# -- training ----------------------------------------------------------------------------------
def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--root", type=Path, required=True, help="run directory: ckpts/, train_log.jsonl")
    parser.add_argument("--cold", help="where the cold tier goes: a directory or s3:// URL (default ROOT/cold-tier)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks to start when not run under torchrun")
    parser.add_argument("--steps", type=int, default=60, help="train until this step")
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--ema-decay", type=float, default=0.9, help="EMA weight of the old average")
    parser.add_argument("--seed", type=int, default=0, help="weights, data and validation seed")
    parser.add_argument("--step-delay", type=float, default=0.0, help="sleep per step (to watch it, or kill it)")
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--progress: a progress bar; --no-progress: nothing (default: a bar on a terminal, else plain lines)",
    )
    parser.add_argument("--print-every", type=int, default=10, help="plain progress: a line every N steps")
    parser.add_argument(
        "--staging-lease",
        type=float,
        default=DEFAULT_LEASE,
        help="seconds after which the manager removes an untouched staging directory of a crashed save "
        f"(default {DEFAULT_LEASE:.0f}, the library's)",
    )
    parser.add_argument(
        "--pause-save-at",
        type=int,
        default=None,
        metavar="STEP",
        help="(demo) rank 1 pauses inside the save of STEP, after writing its first file into the staging "
        "directory, and writes ROOT/paused-save.json; the demo kills it there",
    )
    parser.add_argument(
        "--measure-reads",
        action="store_true",
        help="(demo) after a resume, load the checkpoint once more with mmap=False through counting stores "
        "and log the bytes each rank read",
    )
    args = parser.parse_args(argv)
    if args.steps < 1 or args.every < 1 or args.print_every < 1:
        parser.error("--steps, --every and --print-every must be >= 1")
    if args.staging_lease < 0:
        parser.error("--staging-lease must be >= 0")
    return args


class Progress:
    """What rank 0 shows while training: a tqdm bar (``"bar"``), plain lines on stdout
    (``"lines"``: a pipe or a log file gets something it can show), or nothing (``"off"``).
    Other ranks show nothing."""

    def __init__(self, mode: str, *, first: int, total: int, world: int, print_every: int) -> None:
        self.mode = mode
        self.total = total
        self.world = world
        self.print_every = print_every
        self.bar = tqdm(total=total, initial=first - 1, desc=f"train on {world} ranks", disable=mode != "bar")
        if mode == "lines":
            # The manager's own notes (a leftover removed, a checkpoint deleted by retention).
            handler = logging.StreamHandler(sys.stdout)
            handler.setFormatter(logging.Formatter("shardkeep: %(message)s"))
            logging.getLogger("shardkeep").addHandler(handler)
            logging.getLogger("shardkeep").setLevel(logging.INFO)

    @staticmethod
    def mode_for(option: bool | None, rank: int) -> str:
        if rank != 0 or option is False:
            return "off"
        if option or (sys.stdout.isatty() and sys.stderr.isatty()):
            return "bar"
        return "lines"

    def line(self, text: str) -> None:
        if self.mode == "lines":
            print(text, flush=True)

    def step(self, step: int, loss: float) -> None:
        self.bar.set_postfix(loss=f"{loss:.3f}")
        self.bar.update(1)
        if step % self.print_every == 0 or step == self.total:
            self.line(f"step {step}/{self.total}  loss {loss:.4f}  ({self.world} ranks)")

    def saved(self, step: int, val_loss: float, blocked: float) -> None:
        self.bar.set_postfix(val=f"{val_loss:.3f}", saved=step)
        self.line(f"save of step {step} started: val_loss {val_loss:.4f}, training paused {blocked:.3f} s")

    def close(self) -> None:
        self.bar.close()


def evaluate(model: nn.Module, tokens: torch.Tensor, rank: int, world: int) -> float:
    with torch.no_grad():
        loss = loss_of(model, my_rows(tokens, rank, world)).detach()
    dist.all_reduce(loss)
    return float(loss) / world


def log_line(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as file:
        file.write(json.dumps(record) + "\n")


def train(args: argparse.Namespace) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if GLOBAL_BATCH % world or VALIDATION_BATCH % world:
        raise SystemExit(f"the world size ({world}) must divide the batch of {GLOBAL_BATCH} sequences")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    margs = ModelArgs()
    torch.manual_seed(args.seed)  # the same full weights on every rank; each keeps its shard
    model, ema = MoETransformer(margs), MoETransformer(margs)
    ema.load_state_dict(model.state_dict())
    ema.requires_grad_(False)
    for module in (model, ema):
        for block in module.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(module, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    config = {"lr": args.lr, "ema_decay": args.ema_decay, "seed": args.seed, "global_batch": GLOBAL_BATCH}
    ckpt = sk.TrainingCheckpoint(
        model=model, optimizer=optimizer, ema=ema, model_args=asdict(margs), config=config,
        iteration=0, best_val_loss=None, data_position={"next_step": 1},
    )  # fmt: skip
    cold = args.cold or str(args.root / "cold-tier")
    storage: ByteStore | None = None
    if args.pause_save_at is not None and rank == 1:
        (args.root / "ckpts").mkdir(parents=True, exist_ok=True)
        storage = PausingStore(
            LocalStore(args.root / "ckpts"), checkpoint_name(args.pause_save_at), args.root / PAUSED_SAVE
        )
    manager = sk.CheckpointManager(
        args.root / "ckpts",
        keep_last=2,
        keep_best=1,
        metric="val_loss",
        tiers=sk.TierPlan(
            tiers=[sk.Tier(tier_id=1, name="hot"), sk.Tier(tier_id=2, name="cold", location=cold)],
            placement=HOT_AND_COLD,
        ),
        timeout=120,
        storage=storage,
        staging_lease=args.staging_lease,
    )
    log = args.root / "train_log.jsonl"
    table, validation = validation_set(margs, args.seed)

    first = 1
    try:
        restored = manager.restore(into=ckpt)
    except sk.CheckpointNotFoundError:
        restored = None
    progress_mode = Progress.mode_for(args.progress, rank)
    if restored is not None:
        first = ckpt.data_position["next_step"]
        saved_world = restored.entry.manifest.world_size if restored.entry.manifest else None
        skipped = [name for name, _ in restored.skipped]
        reads = measure_reads(args, cold, restored.entry.name, ckpt) if args.measure_reads else None
        if rank == 0:
            log_line(log, {"event": "resume", "step": restored.step, "from_world_size": saved_world,
                           "world_size": world, "skipped": skipped})  # fmt: skip
            if reads is not None:
                log_line(log, {"event": "reads", **reads})
    elif rank == 0:
        log_line(log, {"event": "start", "world_size": world})

    progress = Progress(progress_mode, first=first, total=args.steps, world=world, print_every=args.print_every)
    if restored is not None:
        progress.line(
            f"resumed from step {restored.step} ({restored.entry.name}, saved on {saved_world} ranks), now on "
            f"{world} ranks; skipped: {', '.join(skipped) or 'none'}"
        )
    else:
        progress.line(f"training from step 1 on {world} ranks; a checkpoint every {args.every} steps")
    decay = args.ema_decay
    for step in range(first, args.steps + 1):
        batch = my_rows(sequences(table, GLOBAL_BATCH, margs.seq_len, seed=args.seed * 1_000_003 + step), rank, world)
        loss = loss_of(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            for average, current in zip(ema.parameters(), model.parameters(), strict=True):
                average.lerp_(current, 1 - decay)
        reported = loss.detach().clone()
        dist.all_reduce(reported)
        train_loss = float(reported) / world
        if rank == 0:
            log_line(log, {"event": "step", "step": step, "loss": train_loss, "world_size": world})
        progress.step(step, train_loss)
        if step % args.every == 0 or step == args.steps:
            val_loss = evaluate(model, validation, rank, world)
            ckpt.iteration = step
            ckpt.best_val_loss = val_loss if ckpt.best_val_loss is None else min(ckpt.best_val_loss, val_loss)
            ckpt.data_position = {"next_step": step + 1}
            pending = manager.async_save(ckpt, step=step, metrics={"val_loss": val_loss, "train_loss": train_loss})
            if rank == 0:
                log_line(log, {"event": "save", "step": step, "val_loss": val_loss,
                               "blocked_seconds": pending.blocked_seconds})  # fmt: skip
            progress.saved(step, val_loss, pending.blocked_seconds)
        if args.step_delay:
            time.sleep(args.step_delay)
    manager.wait()
    progress.close()
    progress.line(f"done: step {args.steps} on {world} ranks; the last save committed")
    if rank == 0:
        log_line(log, {"event": "done", "step": args.steps, "world_size": world})
    dist.barrier()
    dist.destroy_process_group()


def measure_reads(args: argparse.Namespace, cold: str, name: str, ckpt: sk.TrainingCheckpoint) -> dict[str, Any] | None:
    """Every rank loads checkpoint ``name`` once more into its own shards, as the restore just
    did, but with ``mmap=False`` so that every byte comes through ``read()``: the counting stores
    see what each file served, and the kernel's ``rchar`` sees the whole process. The values
    loaded are those the restore loaded.

    Each rank also works out, from the manifest alone, the bytes of the saved chunks that
    overlap the rows it holds (FSDP2 shards dim 0 as ``torch.chunk`` does) and the bytes of just
    those rows. Returns (on rank 0) every rank's figures and the checkpoint's data size."""
    rank, world = dist.get_rank(), dist.get_world_size()
    hot = CountingStore(LocalStore(args.root / "ckpts"))
    cold_store = CountingStore(open_store(cold))
    targets = {"model": ckpt.model, "optimizer": ckpt.optimizer, "ema": ckpt.ema}
    dist.barrier()
    before = kernel_read_bytes()
    sk.load(name, into=targets, storage=hot, tier_locations={"cold": cold_store}, mmap=False)
    after = kernel_read_bytes()

    manifest = sk.read_manifest(name, storage=LocalStore(args.root / "ckpts"))
    # Both stores are opened at the level of the checkpoint names: "step_N/<path in the manifest>".
    served = {path.partition("/")[2]: size for store in (hot, cold_store) for path, size in store.bytes_read.items()}
    # What the kernel's rchar can see: files read with read(), not objects fetched over a socket.
    local = [hot, cold_store] if isinstance(cold_store.inner, LocalStore) else [hot]
    needed = own = headers = 0
    for record in manifest.files:
        overlapping = 0
        for entry in record.tensors:
            if entry.key.partition(".")[0] not in targets:
                continue
            if not entry.global_shape or not entry.global_offset or entry.global_shape == entry.shape:
                overlapping += entry.nbytes  # whole on every rank
                own += entry.nbytes
                continue
            rows = -(-entry.global_shape[0] // world)  # torch.chunk: ceil(n / world) rows per rank
            first, last = rank * rows, min(entry.global_shape[0], (rank + 1) * rows)
            start, stop = entry.global_offset[0], entry.global_offset[0] + entry.shape[0]
            common = min(last, stop) - max(first, start)
            if common > 0:
                overlapping += entry.nbytes
                own += entry.nbytes * common // entry.shape[0]
        if overlapping:
            needed += overlapping
            headers += 16 + _header_length(hot if record.tier == "hot" else cold_store, f"{name}/{record.path}")
    data_files = {record.path for record in manifest.files}
    mine = {
        "rank": rank,
        "data_bytes": sum(size for path, size in served.items() if path in data_files),
        "other_bytes": sum(size for path, size in served.items() if path not in data_files),
        "files_opened": sum(1 for record in manifest.files if record.path in served),
        "needed_chunk_bytes": needed,
        "header_bytes_at_most": headers,
        "own_rows_bytes": own,
        "local_file_bytes": sum(size for store in local for size in store.bytes_read.values()),
        "kernel_rchar": None if before is None or after is None else after - before,
    }
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank != 0:
        return None
    return {
        "checkpoint": name,
        "saved_world_size": manifest.world_size,
        "data_bytes": sum(record.stored_size for record in manifest.files),
        "files": len(manifest.files),
        "ranks": gathered,
    }


def _header_length(store: CountingStore, path: str) -> int:
    """The length of a safetensors file's JSON header (its first 8 bytes), read past the counts."""
    handle = store.inner.open_read(path)
    try:
        prefix = memoryview(bytearray(8))
        handle.read_into(0, prefix)
    finally:
        handle.close()
    return int.from_bytes(prefix, "little")


def first_line(error: BaseException | str) -> str:
    """The first non-empty line of an error message, whole: a message is cut only at a line end,
    never inside a word."""
    return next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if "RANK" in os.environ:  # a worker: started by torchrun or by spawn_ranks
        try:
            train(args)
        except RuntimeError as exc:
            if "Connection reset by peer" not in str(exc) and "Connection closed by peer" not in str(exc):
                raise
            # Another rank died: a collective cannot finish. Say so in one line; the launcher
            # (or torchrun) stops this rank too, and a restart resumes from the checkpoints.
            print(f"rank {os.environ['RANK']}: lost another rank ({first_line(exc)})", file=sys.stderr)
            return 1
        return 0
    args.root.mkdir(parents=True, exist_ok=True)
    codes = supervise(spawn_ranks(args.nproc, argv))
    failed = {rank: code for rank, code in enumerate(codes) if code != 0}
    if failed:
        print(f"ranks failed (exit codes; negative = signal): {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
