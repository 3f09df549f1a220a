"""Run a function on N forked ranks joined in a real gloo process group on 127.0.0.1.

Each rank writes its outcome to a file (a pickled result, or the formatted traceback), so a rank
that is killed or hangs cannot block the others' reports. Ranks still running at the deadline
are killed.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank_main(
    rank: int, world_size: int, port: int, outbox: str, target: Callable[..., Any], args: tuple[Any, ...]
) -> None:
    import torch
    import torch.distributed as dist

    # A forked child inherits the parent's intra-op (OpenMP) thread pool without its threads: a
    # parallel torch operation would wait on them forever once a test in the parent process ran
    # a large tensor operation. One thread per rank runs every operation inline.
    torch.set_num_threads(1)
    code = 0
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=60),
        )
        outcome: tuple[str, Any] = ("ok", target(rank, world_size, *args))
    except BaseException as exc:
        outcome = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        code = 1
    try:
        data = pickle.dumps(outcome)
    except Exception as exc:
        data = pickle.dumps(("error", f"result not picklable: {exc}"))
    Path(outbox, f"rank{rank}.tmp").write_bytes(data)
    os.replace(Path(outbox, f"rank{rank}.tmp"), Path(outbox, f"rank{rank}.pkl"))
    os._exit(code)  # skip interpreter teardown: a peer may be gone, and gloo could block on exit


def run_ranks(
    world_size: int,
    target: Callable[..., Any],
    *args: Any,
    outbox: Path,
    timeout: float = 120.0,
    allow_unfinished: frozenset[int] = frozenset(),
) -> dict[int, tuple[str, Any]]:
    """Run ``target(rank, world_size, *args)`` on forked ranks; return each rank's outcome.

    An outcome is ``("ok", result)`` or ``("error", formatted traceback)``. Ranks listed in
    ``allow_unfinished`` may still be running at the end (they are killed); any other rank that
    does not report is a test failure.
    """
    outbox.mkdir(parents=True, exist_ok=True)
    context = multiprocessing.get_context("fork")
    port = free_port()
    processes = [
        context.Process(target=_rank_main, args=(rank, world_size, port, str(outbox), target, args), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout
    expected = set(range(world_size)) - set(allow_unfinished)
    while time.monotonic() < deadline:
        if all((outbox / f"rank{rank}.pkl").exists() for rank in expected):
            break
        time.sleep(0.05)
    for rank, process in enumerate(processes):
        # Every expected rank has reported (or the deadline passed): a rank allowed to be
        # unfinished gets a moment to exit, not the 5 s a reporting rank may take to.
        wait = 0.1 if rank in allow_unfinished else max(0.1, min(5.0, deadline - time.monotonic()))
        process.join(timeout=wait)
        if process.is_alive():
            process.kill()
            process.join()
    outcomes: dict[int, tuple[str, Any]] = {}
    for rank in range(world_size):
        path = outbox / f"rank{rank}.pkl"
        if path.exists():
            outcomes[rank] = pickle.loads(path.read_bytes())
    missing = expected - set(outcomes)
    assert not missing, f"ranks {sorted(missing)} did not report within {timeout} s"
    return outcomes


def results_or_raise(outcomes: dict[int, tuple[str, Any]]) -> list[Any]:
    """Every rank's result in rank order, or an AssertionError with every failed rank's traceback."""
    failed = {rank: payload for rank, (kind, payload) in outcomes.items() if kind != "ok"}
    assert not failed, "\n".join(f"--- rank {rank} ---\n{text}" for rank, text in failed.items())
    return [outcomes[rank][1] for rank in sorted(outcomes)]
