"""Peer replicas of node-local parts: each node's data files are also kept on ``replicas`` other
nodes, so that a committed local step survives losing a node (its disk included).

**Placement** (NVRx's clique strategy, by node): node ``n``'s part goes to nodes
``(n + k * jump) % N`` for ``k = 1 .. replicas``
(:func:`~shardkeep.levels.config.replica_holders`, which refuses more replicas than other
nodes and a jump that maps a node onto itself). A replica lives inside the holder node's own
``step_<N>/`` directory, at the same relative paths as on the source node (each data file is
written by one rank, so paths never collide), and, once the step is protected, is listed in the
holder's ``node-part.json`` under ``replicas`` (source node -> files).

**Transfer.** After a local commit, every rank hands the step to its :class:`Replicator`: one
background thread per rank that owns a dedicated gloo process group (created once, collectively,
on the caller's thread: the default group's collectives stay there). For each step, the thread
plans the same transfers on every rank from the step's manifest (the same bytes on every node):
each data file is sent by the rank that wrote it to one rank of each holder node (the rank at
the same position among that node's ranks), in batches of at most ``batch_bytes`` per sender,
each batch one :func:`~shardkeep.levels.transfer.run_exchange` (bounded blocks on the wire,
digest and size checked on arrival, written atomically). Before each batch one ``all_reduce``
(MAX) on the dedicated group agrees whether to go on: a rank that could not plan, or a step the
caller cancelled, stops every rank at the same batch. A replica that fails its digest is never
written; it is named (file, source rank and node, receiving rank and node) and the step is not
protected.

**Protected.** The caller's thread settles replication at safe points (the manager's
``save``, ``should_save`` while a replication is in flight, ``wait_for_replicas`` and
``close``): one all-gather on the default group of each rank's outcome per step. When every rank
replicated a step completely, each node's leader records the replicas its node holds in its
``node-part.json`` (an atomic rewrite): the step is *protected*. Local retention keeps the
newest protected step until a newer one is protected, and every step whose replication is in
flight.

**Bounds.** A new local step while an older one is still replicating (or queued): the save
waits at most ``replicate_wait`` seconds, then cancels the older one (logged) and queues the new
one. A cancelled step stops before its next batch (a queued one before its first), so a save
never waits for replication beyond ``replicate_wait`` plus one all-gather; the steps are
replicated one at a time, in order. Memory per rank: two blocks of the exchange.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from shardkeep.distributed.coordinator import Coordinator, group_broken
from shardkeep.distributed.groups import GroupCache
from shardkeep.errors import ShardkeepError
from shardkeep.indexes import expand_all
from shardkeep.levels.config import Level, replica_holders
from shardkeep.levels.local_catalog import read_part
from shardkeep.levels.nodes import NodeMap
from shardkeep.levels.parts import decode_node_part, encode_node_part
from shardkeep.levels.transfer import WIRE_BLOCK_BYTES, FileReceive, FileSend, run_exchange
from shardkeep.manifest import FileRecord, IndexedManifest
from shardkeep.names import NODE_PART_FILENAME
from shardkeep.storage import LocalStore
from shardkeep.storage.localfs import current as local_fs

__all__ = [
    "DEFAULT_BATCH_BYTES",
    "Replication",
    "ReplicaPlan",
    "ReplicationOutcome",
    "Replicator",
    "plan_replicas",
    "record_replicas",
]

logger = logging.getLogger("shardkeep.levels")

#: Bytes each sender sends per batch (between two agreements to go on).
DEFAULT_BATCH_BYTES = 256 << 20


@dataclass
class ReplicaPlan:
    """One rank's part of replicating one step: its sends and receives per batch (every rank
    has the same number of batches), and the files its node receives, per source node."""

    batches: list[tuple[list[FileSend], list[FileReceive]]]
    received: dict[int, list[str]]


def plan_replicas(
    records: Sequence[FileRecord],
    nodes: NodeMap,
    level: Level,
    rank: int,
    directory: str,
    *,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
) -> ReplicaPlan:
    """The transfers of one step for ``rank`` (pure; the same global plan on every rank).
    ``records``: the step's data files (the rank that wrote each one holds it); ``directory``:
    this node's directory of the step (where this rank reads and writes)."""
    node = nodes.node_of[rank]
    per_sender: dict[int, list[tuple[FileRecord, int]]] = {}
    # Every node this node holds replicas of, even one with no data file (its part is then
    # protected by nothing to copy): the recorded replicas name each source.
    received: dict[int, list[str]] = {
        source: [] for source in range(nodes.node_count) if node in replica_holders(level, source, nodes.node_count)
    }
    for record in sorted(records, key=lambda r: r.path):
        source = nodes.node_of[record.rank]
        sources = nodes.ranks_of(source)
        for holder in replica_holders(level, source, nodes.node_count):
            ranks = nodes.ranks_of(holder)
            receiver = ranks[sources.index(record.rank) % len(ranks)]
            per_sender.setdefault(record.rank, []).append((record, receiver))
            if holder == node:
                received.setdefault(source, []).append(record.path)
    chunks: dict[int, list[list[tuple[FileRecord, int]]]] = {}
    for sender, items in per_sender.items():
        chunks[sender] = [[]]
        size = 0
        for record, receiver in items:
            if chunks[sender][-1] and size + record.stored_size > batch_bytes:
                chunks[sender].append([])
                size = 0
            chunks[sender][-1].append((record, receiver))
            size += record.stored_size
    count = max((len(each) for each in chunks.values()), default=0)
    batches: list[tuple[list[FileSend], list[FileReceive]]] = []
    for index in range(count):
        sends: list[FileSend] = []
        receives: list[FileReceive] = []
        for sender, each in sorted(chunks.items()):
            for record, receiver in each[index] if index < len(each) else []:
                where = os.path.join(directory, record.path)
                if sender == rank:
                    sends.append(FileSend(receiver, where, record))
                if receiver == rank:
                    receives.append(FileReceive(sender, where, record))
        batches.append((sends, receives))
    return ReplicaPlan(batches, received)


def step_records(root: str, name: str) -> list[FileRecord]:
    """The data files of step ``name`` in this node's ``root`` (rank indexes expanded)."""
    _, manifest, _ = read_part(root, name)
    if isinstance(manifest, IndexedManifest):
        manifest = expand_all(LocalStore(os.path.abspath(root)), name, manifest)
    return list(manifest.files)


def record_replicas(root: str, name: str, received: dict[int, list[str]]) -> None:
    """Record the replicas this node holds in its ``node-part.json`` of step ``name`` (an
    atomic rewrite; on a node leader)."""
    where = os.path.join(root, name, NODE_PART_FILENAME)
    with open(where, "rb") as handle:
        part = decode_node_part(handle.read(1 << 24), where=where)
    part.replicas = {source: sorted(files) for source, files in sorted(received.items())}
    local_fs().write_file_atomic(where, encode_node_part(part))


@dataclass
class ReplicationOutcome:
    """One step's replication on one rank: ``state`` is ``queued``, ``running``, ``done``,
    ``cancelled`` or ``failed``; ``problems`` names each file refused or not written (and why
    the step stopped); the bytes this rank sent and received; the files its node received."""

    step: int
    state: str = "queued"
    problems: list[str] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    received: dict[int, list[str]] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def finished(self) -> bool:
        return self.state in ("done", "cancelled", "failed")


@dataclass(frozen=True)
class _Job:
    step: int
    name: str
    root: str


class Replicator:
    """One rank's replication thread and its dedicated process group (see the module
    docstring). Only this thread uses ``group``."""

    def __init__(
        self,
        group: Any,
        level: Level,
        nodes: NodeMap,
        rank: int,
        *,
        block_bytes: int = WIRE_BLOCK_BYTES,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
    ) -> None:
        self.group = group
        self.level = level
        self.nodes = nodes
        self.rank = rank
        self.block_bytes = block_bytes
        self.batch_bytes = batch_bytes
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._lock = threading.Condition()
        self.outcomes: dict[int, ReplicationOutcome] = {}
        self._cancelled: set[int] = set()
        #: Why the dedicated group cannot be used any more (a peer died or timed out).
        self.broken: str | None = None
        self._thread = threading.Thread(target=self._run, name="shardkeep-replicas", daemon=True)
        self._thread.start()

    def submit(self, step: int, name: str, root: str) -> None:
        with self._lock:
            self.outcomes[step] = ReplicationOutcome(step)
        self._jobs.put(_Job(step, name, root))

    def cancel(self, step: int) -> None:
        with self._lock:
            self._cancelled.add(step)

    def outcome(self, step: int) -> ReplicationOutcome:
        with self._lock:
            found = self.outcomes[step]
            return ReplicationOutcome(**found.__dict__)

    def wait(self, steps: Sequence[int], timeout: float | None) -> bool:
        """Wait (at most ``timeout`` seconds; ``None``: no bound) until ``steps`` ended on this
        rank; whether they did."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while not all(self.outcomes[step].finished for step in steps if step in self.outcomes):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._lock.wait(left)
            return True

    def stop(self) -> None:
        """Let the thread end after its current job (queued jobs are cancelled)."""
        with self._lock:
            self._cancelled.update(self.outcomes)
        self._jobs.put(None)

    def join(self, timeout: float) -> None:
        with contextlib.suppress(RuntimeError):
            self._thread.join(timeout=timeout)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with self._lock:
                outcome = self.outcomes[job.step]
                outcome.state = "running"
            started = time.perf_counter()
            try:
                final = self._replicate(job, outcome)
            except Exception as exc:  # never leave the caller waiting on an outcome
                outcome.problems.append(f"{type(exc).__name__}: {exc}")
                final = "failed"
            with self._lock:
                outcome.seconds = time.perf_counter() - started
                outcome.state = final
                self._lock.notify_all()

    def _agree(self, stop: bool, batches: int) -> tuple[bool, int]:
        """One all_reduce (MAX) on the dedicated group: whether any rank stops, and the batch
        count."""
        import torch
        import torch.distributed as dist

        vote = torch.tensor([int(stop), batches], dtype=torch.int64)
        dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self.group)
        return bool(vote[0]), int(vote[1])

    def _replicate(self, job: _Job, outcome: ReplicationOutcome) -> str:
        """Replicate one step; its final state."""
        if self.broken is not None:
            outcome.problems.append(f"not replicated: the replication group failed earlier ({self.broken})")
            return "failed"
        plan: ReplicaPlan | None = None
        try:
            records = step_records(job.root, job.name)
            directory = os.path.join(job.root, job.name)
            plan = plan_replicas(records, self.nodes, self.level, self.rank, directory, batch_bytes=self.batch_bytes)
        except (OSError, ShardkeepError) as exc:
            node = self.nodes.node_of[self.rank]
            outcome.problems.append(f"rank {self.rank} (node {node}) cannot read step {job.step}: {exc}")
        try:
            return self._batches(job, plan, outcome)
        except (RuntimeError, ShardkeepError) as exc:  # gloo: a dead peer or a timeout
            self.broken = f"{type(exc).__name__}: {exc}"
            outcome.problems.append(f"replicating step {job.step} failed: {self.broken}")
            return "failed"

    def _batches(self, job: _Job, plan: ReplicaPlan | None, outcome: ReplicationOutcome) -> str:
        """The batches of one step, each after an agreement to go on; the final state."""
        mine = len(plan.batches) if plan is not None else 0
        node = self.nodes.node_of[self.rank]
        index, count = 0, mine
        while True:
            with self._lock:
                cancelled = job.step in self._cancelled
            stop, count = self._agree(plan is None or cancelled, mine if index == 0 else count)
            if stop:
                return "failed" if plan is None or outcome.problems else "cancelled"
            if index >= count:
                break
            assert plan is not None
            sends, receives = plan.batches[index] if index < len(plan.batches) else ([], [])
            exchange = run_exchange(self.group, sends, receives, block_bytes=self.block_bytes)
            outcome.bytes_sent += sum(send.record.stored_size for send in sends)
            written = set(exchange.written)
            outcome.bytes_received += sum(r.record.stored_size for r in receives if os.fspath(r.destination) in written)
            for path, source, reason in [*exchange.refused, *exchange.failed]:
                outcome.problems.append(
                    f"{path}: replica from rank {source} (node {self.nodes.node_of[source]}) to rank {self.rank} "
                    f"(node {node}) of step {job.step}: {reason}; skipped, never loaded"
                )
            index += 1
            if index >= count:
                break
        assert plan is not None
        outcome.received = plan.received
        return "failed" if outcome.problems else "done"


def new_replication_group(process_group: Any, timeout: float) -> Any:
    """A gloo process group of the same ranks as ``process_group`` (``None``: every rank), used
    only by the replication thread. Collective: every rank of the default group calls it."""
    import torch.distributed as dist

    ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
    # Kept in a cache of its own, so that one never destroyed by close is destroyed at exit.
    return _replication_groups.get(
        next(_made), lambda: dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout))
    )


#: The replication groups not yet destroyed (each under its own number).
_replication_groups = GroupCache()
_made = itertools.count()


class Replication:
    """The caller's-thread side of replicating a node-local level: the steps in flight (the same
    list on every rank), the agreement at safe points, and the recording of protected steps."""

    def __init__(self, level: Level, *, process_group: Any, timeout: float, replicate_wait: float) -> None:
        self.level = level
        self.process_group = process_group
        self.timeout = timeout
        self.replicate_wait = replicate_wait
        self.replicator: Replicator | None = None
        #: Steps submitted and not settled yet, oldest first (the same on every rank).
        self.inflight: list[int] = []
        self._names: dict[int, str] = {}
        #: The newest step this manager saw protected.
        self.protected: int | None = None
        #: Per step settled: this rank's outcome.
        self.settled: dict[int, ReplicationOutcome] = {}
        #: Seconds saves waited for an older replication (``replicate_wait``).
        self.blocked_seconds = 0.0
        #: Why this manager does not replicate (the group could not be created), or ``None``.
        self.disabled: str | None = None

    def active(self, nodes: NodeMap) -> bool:
        return self.level.replicas_for(nodes.node_count) > 0

    def after_commit(self, step: int, name: str, root: str, coordinator: Coordinator, nodes: NodeMap) -> None:
        """Queue step ``name`` (committed on every node) for replication; collective. An older
        step still replicating gets ``replicate_wait`` seconds, then is cancelled."""
        if not self.active(nodes) or not coordinator.distributed:
            return
        if self.disabled is not None:
            return
        if self.replicator is None:
            made: list[Any] = []
            try:
                coordinator.step(
                    "create the replication group",
                    lambda: made.append(new_replication_group(self.process_group, self.timeout)),
                )
            except ShardkeepError as exc:  # every rank gets the same error: none replicates
                if group_broken(exc) is not None:
                    raise  # the job's group broke, not just the replication's
                self.disabled = f"{type(exc).__name__}: {exc}"
                logger.warning(
                    "level %r: no peer replicas (the replication group cannot be created: %s)",
                    self.level.name, self.disabled,
                )  # fmt: skip
                return
            self.replicator = Replicator(made[0], self.level, nodes, coordinator.rank)
        if self.inflight:
            started = time.perf_counter()
            self.settle(root, coordinator, nodes, wait=self.replicate_wait)
            self.blocked_seconds += time.perf_counter() - started
            for older in self.inflight:
                logger.warning(
                    "level %r: the replication of step %d is still running after replicate_wait=%g s: it is "
                    "skipped (cancelled before its next batch; a step not replicated completely is not protected) "
                    "and step %d is queued",
                    self.level.name, older, self.replicate_wait, step,
                )  # fmt: skip
                self.replicator.cancel(older)
        self.replicator.submit(step, name, root)
        self.inflight.append(step)
        self._names[step] = name

    def settle(self, root: str, coordinator: Coordinator, nodes: NodeMap, *, wait: float | None = 0.0) -> None:
        """Agree on the steps in flight (collective): after waiting at most ``wait`` seconds
        (``None``: until they end) on this rank, one all-gather of every rank's outcomes; a
        step every rank replicated completely is recorded and protected, a step that ended
        otherwise is logged with its problems."""
        if not self.inflight or self.replicator is None:
            return
        replicator = self.replicator
        if wait is None or wait > 0:
            replicator.wait(self.inflight, wait)
        mine = {step: replicator.outcome(step) for step in self.inflight}
        everyone = coordinator.all_gather(mine, label="settle the replicas")
        complete: list[int] = []
        for step in list(self.inflight):
            outcomes = [each[step] for each in everyone]
            if not all(outcome.finished for outcome in outcomes):
                continue
            self.inflight.remove(step)
            self.settled[step] = mine[step]
            if all(outcome.state == "done" for outcome in outcomes):
                complete.append(step)
            else:
                problems = [problem for outcome in outcomes for problem in outcome.problems]
                states = sorted({outcome.state for outcome in outcomes})
                logger.warning(
                    "level %r: step %d is not protected (replication %s): %s",
                    self.level.name, step, "/".join(states), "; ".join(problems) or "cancelled",
                )  # fmt: skip
        if complete:
            self._protect(complete, root, mine, coordinator, nodes)

    def _protect(
        self,
        steps: list[int],
        root: str,
        mine: dict[int, ReplicationOutcome],
        coordinator: Coordinator,
        nodes: NodeMap,
    ) -> None:
        """Every node's leader records the replicas its node holds (collective: when this
        returns, every node's part says so); a step is protected when every leader recorded."""
        leader = nodes.is_leader(coordinator.rank)

        def record() -> list[tuple[int, str]]:
            failed: list[tuple[int, str]] = []
            for step in steps if leader else []:
                try:
                    record_replicas(root, self._names[step], mine[step].received)
                except (OSError, ShardkeepError) as exc:
                    failed.append((step, f"node {nodes.node_of[coordinator.rank]}: {exc}"))
            return failed

        failures = [item for each in coordinator.step("record the replicas", record) for item in each]
        for step in steps:
            reasons = [reason for failed, reason in failures if failed == step]
            if reasons:
                logger.warning(
                    "level %r: step %d is not protected: recording its replicas failed: %s",
                    self.level.name, step, "; ".join(reasons),
                )  # fmt: skip
                continue
            self.protected = step if self.protected is None else max(self.protected, step)
            logger.info("level %r: step %d is protected (every part has its replicas)", self.level.name, step)

    def pinned(self) -> set[int]:
        """Steps local retention must keep: those whose replication is in flight."""
        return set(self.inflight)

    def abandon(self) -> None:
        """Stop replicating without a collective (the process group broke): the thread is told
        to stop and not waited for beyond a moment (it may sit in a collective of its own group
        until that group's deadline; a daemon thread); the steps in flight stay unprotected, and
        a replica half received stays a temporary file, removed with the local level's leftovers."""
        if self.replicator is not None:
            self.replicator.stop()
            self.replicator.join(0.1)
            self.replicator = None
        self.inflight.clear()

    def close(
        self, root: str | None, coordinator: Coordinator, nodes: NodeMap | None, *, wait: bool, timeout: float | None
    ) -> None:
        """Settle what is in flight (``wait``: at most ``timeout`` seconds), then stop the
        thread; collective when anything is in flight."""
        if self.replicator is None:
            return
        if wait and root is not None and nodes is not None:
            self.settle(root, coordinator, nodes, wait=timeout)
        self.replicator.stop()
        self.replicator.join(1.0)
        if not self.replicator.alive():
            _replication_groups.destroy(self.replicator.group)  # else at exit
        self.replicator = None
