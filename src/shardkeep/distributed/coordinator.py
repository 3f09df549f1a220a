"""The one coordination wrapper: every cross-rank step of a checkpoint goes through it.

:class:`Coordinator` wraps a ``torch.distributed`` process group. With no process group
initialized it is a no-op of world size 1, so a single process runs exactly the same code path.

Errors are values: :meth:`Coordinator.step` runs a function on every rank, gathers each rank's
outcome, and if any rank failed raises the same :class:`~shardkeep.errors.CoordinationError`
on every rank, naming each failed rank and its message. Every collective has a deadline (the
group's timeout): a dead or hung rank produces an error, never a hang.

A group that breaks (a peer's process died and closed its connections, or a collective missed
its deadline) raises :class:`GroupBrokenError`. gloo tells only the dead rank's direct peers in
a collective at once; a rank waiting on live peers would wait for the whole deadline. So the
first rank that sees the group break posts it in the job's key-value store, and every rank
waiting in a collective of that group on a gloo group looks there every :data:`BROKEN_POLL`
seconds and raises the same error within about that long (a store that stops answering
there means its host is gone: the group is broken too). :func:`roll_call` then names the ranks
that no longer answer.

By default checkpoint traffic uses a dedicated gloo group created once per default group and
timeout, so it never interleaves with the user's own collectives (which may run on NCCL).
Collectives are only ever called from the thread that called ``save``/``load``; background
completion of an async save waits on a store-based barrier, never on a collective.

Who calls what: every rank constructs a ``Coordinator`` and calls the same methods in the
same order. Not thread-safe; one operation at a time per process.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import pickle
import re
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import xxhash

from shardkeep.config import LOCAL
from shardkeep.distributed.groups import GroupCache
from shardkeep.errors import CoordinationError, ShardkeepError, same_error

__all__ = [
    "BROKEN_POLL",
    "DEFAULT_TIMEOUT",
    "LOCAL",
    "MAX_REPORT_BYTES",
    "Coordinator",
    "GroupBrokenError",
    "RankFailure",
    "group_broken",
    "roll_call",
]

T = TypeVar("T")

#: Seconds any single collective may wait before the operation fails with a deadline error.
DEFAULT_TIMEOUT = 300.0


#: Seconds between two looks, while waiting in a collective, for another rank's report that the
#: group broke (one small store read each).
BROKEN_POLL = 0.25

#: The dedicated checkpoint groups, by (default group, timeout): see :mod:`.groups`.
_groups = GroupCache()


class GroupBrokenError(CoordinationError):
    """The process group itself failed in the collective ``label``: a peer's process died (its
    connections closed), or a rank missed the deadline. No rank reported an error of its own
    (``failures`` is empty, so no retry votes on it); the group cannot be used again. ``seen_by``:
    the rank that saw it first (this one, or another that posted it in the store)."""

    def __init__(
        self,
        message: str,
        failures: dict[int, str] | None = None,
        *,
        label: str = "",
        seen_by: int = -1,
        rank: int = -1,
        world_size: int = 0,
        key: str = "",
    ) -> None:
        super().__init__(message, failures)
        self.label = label
        self.seen_by = seen_by
        #: This rank and the group's size, and the group's key in the store (for :func:`roll_call`).
        self.rank = rank
        self.world_size = world_size
        self.key = key

    @classmethod
    def reported(cls, message: str, details: Mapping[str, object] | None = None) -> GroupBrokenError:
        error = cls(message)
        error.__dict__.update(details or {})
        return error


def group_broken(error: BaseException) -> GroupBrokenError | None:
    """The :class:`GroupBrokenError` behind ``error`` (itself, or in its chain of causes and
    contexts), or ``None``: whether a failure was the group breaking rather than a rank's
    reported error."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        found = pending.pop()
        if found is None or id(found) in seen:
            continue
        seen.add(id(found))
        if isinstance(found, GroupBrokenError):
            return found
        pending += [found.__cause__, found.__context__]
    return None


def roll_call(error: GroupBrokenError, grace: float) -> list[int] | None:
    """After ``error``: the ranks of its group that do not answer within ``grace`` seconds
    (every rank that survived and calls it answers: a store write, then a wait for the others),
    or ``None`` when the store cannot tell (it is gone: its host may be the rank lost). When the
    store goes away during the wait, the ranks not heard from until then. Not a
    collective, and it never touches the broken group."""
    try:
        from torch.distributed import distributed_c10d

        store = distributed_c10d._get_default_store()
    except Exception:
        return None
    if error.world_size <= 1 or not error.key:
        return None
    prefix = error.key.replace("/broken/", "/alive/")
    keys = [f"{prefix}/{rank}" for rank in range(error.world_size)]
    heard: list[int] | None = None  # None until the store answered once
    deadline = time.monotonic() + grace
    try:
        store.set(keys[error.rank], "1")
        while True:
            heard = [rank for rank, key in enumerate(keys) if (heard and rank in heard) or store.check([key])]
            if len(heard) == error.world_size or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
    except Exception:  # the store went away (a survivor that hosts it may have exited): what was seen
        if heard is None:
            return None
    return [rank for rank in range(error.world_size) if rank not in heard]


def _transport_text(exc: BaseException) -> str:
    """The first line of a transport error, without gloo's source location and advice
    ("[.../pair.cc:553] Connection closed by peer [10.0.0.2]:41234. This is typically ...")."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\] ", "", text)
    return text.partition(". This is typically")[0]


class _BrokenElsewhere(Exception):
    """Another rank posted that the group broke (raised out of a wait, turned into a
    :class:`GroupBrokenError` by ``Coordinator._collective``)."""

    def __init__(self, report: dict[str, Any]) -> None:
        super().__init__(report.get("error", ""))
        self.report = report


class RankFailure:
    """One rank's failed outcome, as exchanged between ranks (picklable, no live exception)."""

    __slots__ = ("error_type", "message", "rank")

    def __init__(self, rank: int, error_type: str, message: str) -> None:
        self.rank = rank
        self.error_type = error_type
        self.message = message

    def __repr__(self) -> str:
        return f"RankFailure(rank={self.rank}, {self.error_type}: {self.message})"


def _torch_distributed() -> Any:
    """``torch.distributed`` if a process group is initialized, else ``None`` (imports lazily)."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist


class Coordinator:
    """Cross-rank steps over ``process_group`` (or a dedicated gloo group; or none at all).

    ``timeout`` is the deadline in seconds for each collective. The coordinator is the lowest
    rank of the group; it alone writes the manifest and commits.
    """

    def __init__(self, process_group: Any = None, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        if timeout <= 0:
            raise ShardkeepError(f"timeout={timeout!r} must be positive")
        self.timeout = float(timeout)
        local = isinstance(process_group, str) and process_group == LOCAL
        self._dist: Any = None if local else _torch_distributed()
        if local:
            process_group = None
        if self._dist is None:
            if process_group is not None:
                raise ShardkeepError("process_group= was given but torch.distributed is not initialized")
            self.group: Any = None
            self.rank = 0
            self.world_size = 1
            return
        self.group = process_group if process_group is not None else self._dedicated_group()
        self.rank = self._dist.get_rank(self.group)
        self.world_size = self._dist.get_world_size(self.group)

    def _dedicated_group(self) -> Any:
        dist = self._dist
        # new_group is itself a collective: every rank reaches this line in the same order.
        return _groups.get(
            (id(dist.group.WORLD), self.timeout),
            lambda: self._collective(
                "creating the checkpoint process group",
                lambda: dist.new_group(backend="gloo", timeout=_dt.timedelta(seconds=self.timeout)),
            ),
        )

    def _forget_group(self) -> None:
        """A gloo group that timed out stays broken: drop it so the next save makes a new one.
        Every rank gets the same error and drops it too, so all create the next one together."""
        group = getattr(self, "group", None)  # unset while the group is being created
        if group is not None:
            _groups.forget(group)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    # -- collectives --------------------------------------------------------------------------
    def _collective(self, label: str, run: Callable[[], T]) -> T:
        try:
            return run()
        except ShardkeepError:
            raise
        except _BrokenElsewhere as exc:
            self._forget_group()
            report = exc.report
            raise GroupBrokenError(
                f"{label}: a rank did not respond within the {self.timeout:.0f} s deadline or the group broke "
                f"(rank {report.get('rank')} saw it"
                + (f" in {report['label']!r}" if report.get("label") else "")
                + f": {report.get('error')})",
                label=label,
                seen_by=int(report.get("rank", -1)),
                rank=self.rank,
                world_size=self.world_size,
                key=self._broken_key(),
            ) from None
        except Exception as exc:  # gloo reports timeouts and dead peers as RuntimeError
            self._forget_group()
            made = getattr(self, "group", None) is not None  # not while the group is being created
            if made:
                self._post_broken(label, exc)
            raise GroupBrokenError(
                f"{label}: a rank did not respond within the {self.timeout:.0f} s deadline or the group broke: "
                f"{_transport_text(exc)}",
                label=label,
                seen_by=self.rank if made else -1,
                rank=self.rank if made else -1,
                world_size=self.world_size if made else 0,
                key=self._broken_key() if made else "",
            ) from exc

    # -- a broken group, told through the store ------------------------------------------------
    def _store(self) -> Any:
        """The job's key-value store (the default group's), or ``None``."""
        try:
            from torch.distributed import distributed_c10d

            return distributed_c10d._get_default_store()
        except Exception:
            return None

    def _broken_key(self) -> str:
        name = getattr(self.group, "group_name", None) or "default"
        return f"shardkeep/broken/{name}"

    def _post_broken(self, label: str, exc: BaseException) -> None:
        """Post in the store that this group broke (best effort: the store may be gone too)."""
        store = self._store()
        if store is None:
            return
        report = json.dumps({"rank": self.rank, "label": label, "error": _transport_text(exc)[:500]})
        with contextlib.suppress(Exception):
            if not store.check([self._broken_key()]):
                store.set(self._broken_key(), report)

    def _wait(self, work: Any) -> None:
        """Wait for the async collective ``work`` (its errors raised as they are); raise
        ``_BrokenElsewhere`` once another rank posted that the group broke. The store is read
        every :data:`BROKEN_POLL` seconds while waiting, never on the fast path."""
        done = threading.Event()
        work.get_future().add_done_callback(lambda _: done.set())
        store = self._store()
        key = self._broken_key()
        while not done.wait(BROKEN_POLL):
            if store is None:
                continue
            try:
                posted = store.get(key) if store.check([key]) else None
            except Exception as exc:  # the store answered before: its host (a rank, or the agent) is gone
                text = _transport_text(exc)
                raise _BrokenElsewhere(
                    {"rank": self.rank, "label": "", "error": f"the job's store stopped answering: {text}"}
                ) from exc
            if posted is not None:
                raise _BrokenElsewhere(json.loads(posted))
        work.wait()

    def all_gather(self, value: T, *, label: str = "all_gather") -> list[T]:
        """Every rank's ``value``, in rank order, on every rank.

        On a gloo group, values that pickle to at most :func:`slot_bytes` - 4 bytes on every rank
        (the outcomes of most steps: "ok" and a digest, a staging name, ``None``) cross in one
        collective of fixed-size slots; torch's ``all_gather_object`` takes two (sizes, then
        payloads), and each costs milliseconds that an async save's caller waits for. A
        larger value on any rank (every rank sees which) is gathered again the usual way."""
        if not self.distributed:
            return [value]
        if self._dist.get_backend(self.group) == "gloo":
            return self._collective(label, lambda: self._all_gather_slots(value))
        gathered: list[Any] = [None] * self.world_size
        self._collective(label, lambda: self._dist.all_gather_object(gathered, value, group=self.group))
        return gathered

    def _all_gather_slots(self, value: T) -> list[T]:
        """:meth:`all_gather` through one all-gather of :func:`slot_bytes`-byte slots (a 4-byte
        length, then the pickled value), falling back to ``all_gather_object`` when a value
        does not fit. Pickled, like torch's object collectives: only between one job's ranks."""
        import torch

        size_of_slot = slot_bytes(self.world_size)
        payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        fits = len(payload) <= size_of_slot - 4
        slot = bytearray(size_of_slot)
        slot[:4] = (len(payload) if fits else _TOO_LARGE).to_bytes(4, "little")
        if fits:
            slot[4 : 4 + len(payload)] = payload
        slots = [torch.empty(size_of_slot, dtype=torch.uint8) for _ in range(self.world_size)]
        self._wait(
            self._dist.all_gather(slots, torch.frombuffer(slot, dtype=torch.uint8), group=self.group, async_op=True)
        )
        received = [slot_tensor.numpy().tobytes() for slot_tensor in slots]
        sizes = [int.from_bytes(raw[:4], "little") for raw in received]
        if _TOO_LARGE in sizes:
            gathered: list[Any] = [None] * self.world_size
            self._dist.all_gather_object(gathered, value, group=self.group)
            return gathered
        return [pickle.loads(raw[4 : 4 + size]) for raw, size in zip(received, sizes, strict=True)]

    def all_reduce_max(self, values: list[float], *, label: str = "all_reduce") -> list[float]:
        """The element-wise maximum of every rank's ``values`` (the same length on every rank),
        on every rank: one all-reduce of a small float64 tensor, cheaper than :meth:`all_gather`
        (no pickling), for checks that run every step."""
        if not self.distributed:
            return [float(value) for value in values]
        import torch

        tensor = torch.tensor([float(value) for value in values], dtype=torch.float64)
        if self._dist.get_backend(self.group) == "gloo":
            self._collective(
                label,
                lambda: self._wait(
                    self._dist.all_reduce(tensor, op=self._dist.ReduceOp.MAX, group=self.group, async_op=True)
                ),
            )
        else:
            self._collective(label, lambda: self._dist.all_reduce(tensor, op=self._dist.ReduceOp.MAX, group=self.group))
        return [float(value) for value in tensor.tolist()]

    def broadcast(self, value: T | None, *, label: str = "broadcast", source: int = 0) -> T:
        """The ``value`` of rank ``source`` (the coordinator by default) on every rank (other
        ranks pass anything, e.g. ``None``)."""
        if not self.distributed:
            assert value is not None
            return value
        box: list[Any] = [value if self.rank == source else None]
        root = self._dist.get_global_rank(self.group, source) if self.group is not None else source
        if self._dist.get_backend(self.group) == "gloo":
            return self._collective(label, lambda: self._broadcast_slots(value, root, self.rank == source))
        self._collective(label, lambda: self._dist.broadcast_object_list(box, src=root, group=self.group))
        return box[0]  # type: ignore[no-any-return]  # the coordinator's value, typed T

    def _broadcast_slots(self, value: T | None, root: int, sending: bool) -> T:
        """:meth:`broadcast` on gloo: one broadcast of a :func:`slot_bytes`-byte slot (a 4-byte
        length, the pickled value), and for a larger value one more of exactly its bytes; each
        waited for through :meth:`_wait`, so that a broken group ends it at once."""
        import torch

        size_of_slot = slot_bytes(self.world_size)
        payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL) if sending else b""
        slot = bytearray(size_of_slot)
        if sending:
            fits = len(payload) <= size_of_slot - 4
            slot[:4] = (len(payload) if fits else _TOO_LARGE).to_bytes(4, "little")
            if fits:
                slot[4 : 4 + len(payload)] = payload
            else:
                slot[4:12] = len(payload).to_bytes(8, "little")
        head = torch.frombuffer(slot, dtype=torch.uint8)
        self._wait(self._dist.broadcast(head, src=root, group=self.group, async_op=True))
        raw = head.numpy().tobytes()
        size = int.from_bytes(raw[:4], "little")
        if size != _TOO_LARGE:
            return pickle.loads(raw[4 : 4 + size])  # type: ignore[no-any-return]  # the source's value, typed T
        body = bytearray(payload) if sending else bytearray(int.from_bytes(raw[4:12], "little"))
        tensor = torch.frombuffer(body, dtype=torch.uint8)
        self._wait(self._dist.broadcast(tensor, src=root, group=self.group, async_op=True))
        return pickle.loads(tensor.numpy().tobytes())  # type: ignore[no-any-return]  # the source's value, typed T

    def barrier(self, *, label: str = "barrier") -> None:
        """Wait until every rank arrives, or fail at the deadline naming the missing ranks."""
        if not self.distributed:
            return
        self._collective(
            label,
            lambda: self._dist.monitored_barrier(
                group=self.group, timeout=_dt.timedelta(seconds=self.timeout), wait_all_ranks=True
            ),
        )

    def gather(self, value: T, *, label: str = "gather") -> list[T] | None:
        """Every rank's ``value``, in rank order, on the coordinator; ``None`` on the other ranks
        (each sends its own value once and receives nothing).

        On a gloo group the coordinator receives exactly the bytes the ranks send: one small
        gather of sizes, then one message per rank. (torch's ``gather_object`` pads every payload
        to the largest, so one large payload, the lists of one expert-parallel class, say,
        would cost ranks times its size.) No rank's announcement is trusted: a report over
        :data:`MAX_REPORT_BYTES`, or bytes that disagree with the announced size and digest,
        come back as that rank's ``("error", RankFailure)`` (see :meth:`_gather_exact`). Other
        backends go through ``gather_object``, whose tensors live where the backend wants them."""
        if not self.distributed:
            return [value]
        destination = self._dist.get_global_rank(self.group, 0) if self.group is not None else 0
        if self._dist.get_backend(self.group) == "gloo":
            return self._collective(label, lambda: self._gather_exact(value, destination))
        gathered: list[Any] | None = [None] * self.world_size if self.is_coordinator else None
        self._collective(label, lambda: self._dist.gather_object(value, gathered, dst=destination, group=self.group))
        return gathered

    def _gather_exact(self, value: T, destination: int) -> list[Any] | None:
        """:meth:`gather` without padding: each rank announces the size and xxh64 of its
        payload (16 bytes a rank), then sends exactly the announced number of bytes as one
        message. Pickled, like torch's object collectives: it only ever moves values between
        the ranks of one job.

        The coordinator trusts no announcement: a size above :data:`MAX_REPORT_BYTES` is that
        rank's failure, refused before anything is allocated (the rank sends nothing then),
        and bytes that do not match the announced digest are that rank's failure too. A
        refused rank's value is ``("error", RankFailure)``, the shape of a failed outcome of
        :meth:`step_to_coordinator`, so every rank then raises a
        :class:`~shardkeep.errors.CoordinationError` naming it. A rank sends exactly what it
        announced (its payload cut or padded to that size), so no message can outgrow the
        buffer the coordinator posts for it (gloo aborts the process on that)."""
        import torch

        dist = self._dist
        payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        size, digest = _announce(payload)
        announced = torch.tensor([size, digest], dtype=torch.int64)
        announcements = (
            [torch.zeros(2, dtype=torch.int64) for _ in range(self.world_size)] if self.is_coordinator else None
        )
        self._wait(dist.gather(announced, announcements, dst=destination, group=self.group, async_op=True))
        if not self.is_coordinator:
            if 0 < size <= MAX_REPORT_BYTES:
                message = bytearray(payload[:size].ljust(size, b"\0"))
                # A send (and a receive) has no future on gloo, and waits on its one peer: a
                # dead coordinator fails it at once.
                dist.send(torch.frombuffer(message, dtype=torch.uint8), dst=destination, group=self.group)
            return None
        assert announcements is not None
        claims = [(int(item[0]), int(item[1])) for item in announcements]
        buffers: dict[int, Any] = {}
        gathered: list[Any] = [value] + [None] * (self.world_size - 1)
        for rank in range(1, self.world_size):
            claimed = claims[rank][0]
            if not 0 < claimed <= MAX_REPORT_BYTES:
                gathered[rank] = _refused(
                    rank, f"announced a report of {claimed} bytes; a rank may send 1 to {MAX_REPORT_BYTES} bytes"
                )
            else:
                buffers[rank] = torch.empty(claimed, dtype=torch.uint8)
        pending = [
            dist.irecv(buffer, src=dist.get_global_rank(self.group, rank), group=self.group)
            for rank, buffer in buffers.items()
        ]
        deadline = _dt.timedelta(seconds=self.timeout)
        for work in pending:
            work.wait(deadline)
        for rank, buffer in buffers.items():
            received = buffer.numpy().tobytes()
            if _announce(received)[1] != claims[rank][1]:
                gathered[rank] = _refused(rank, f"sent {len(received)} bytes that do not match the digest it announced")
                continue
            try:
                gathered[rank] = pickle.loads(received)
            except Exception as exc:
                gathered[rank] = _refused(rank, f"sent a report that cannot be decoded: {type(exc).__name__}: {exc}")
        return gathered

    # -- errors as values ---------------------------------------------------------------------
    def step(self, label: str, work: Callable[[], T]) -> list[T]:
        """Run ``work`` on every rank and return every rank's result, in rank order.

        If ``work`` raises on any rank, every rank raises one :class:`CoordinationError` that
        names each failed rank with its error; a local failure is chained as ``__cause__``.
        With one process the error from ``work`` propagates unchanged.
        """
        if not self.distributed:
            return [work()]  # one process: the original error, with its own type
        outcome, local_error = self._attempt(work)
        outcomes = self.all_gather(outcome, label=label)
        self._raise_failures(label, _failures(outcomes), local_error)
        return [payload for _, payload in outcomes]

    def step_to_coordinator(self, label: str, work: Callable[[], T]) -> list[T] | None:
        """Like :meth:`step`, but the results reach the coordinator only (``None`` elsewhere):
        each rank sends its result once instead of receiving everyone's, so a step whose results
        only the coordinator needs (the file records of a save) moves O(own result) bytes per
        rank. The outcome (ok, or which ranks failed) is then broadcast, and every rank raises
        the same :class:`CoordinationError` on failure."""
        if not self.distributed:
            return [work()]
        outcome, local_error = self._attempt(work)
        # The coordinator keeps its own result: torch's object gather pads every rank's payload
        # to the largest, so a large result of its own (the whole tensors it writes) would
        # otherwise cost R times its size.
        sent: tuple[Any, Any] = ("ok", None) if self.is_coordinator and outcome[0] == "ok" else outcome
        outcomes: list[Any] | None = self.gather(sent, label=label)
        if outcomes is not None:
            outcomes[self.rank] = outcome
        failures = _failures(outcomes) if outcomes is not None else None
        self._raise_failures(label, self.broadcast(failures, label=label), local_error)
        return None if outcomes is None else [payload for _, payload in outcomes]

    def _attempt(self, work: Callable[[], T]) -> tuple[Any, BaseException | None]:
        """Run ``work``: (("ok", result), None), or (("error", RankFailure), the exception)."""
        try:
            return ("ok", work()), None
        except Exception as exc:
            summary = str(exc).splitlines()[0] if str(exc) else traceback.format_exception_only(exc)[-1].strip()
            return ("error", RankFailure(self.rank, type(exc).__name__, summary[:2000])), exc

    def _raise_failures(self, label: str, failures: dict[int, str], local_error: BaseException | None) -> None:
        """Raise one :class:`CoordinationError` naming every failed rank (``rank: "Type:
        message"``), chained to this rank's own error; nothing when no rank failed."""
        if not failures:
            return
        details = "; ".join(f"rank {rank}: {text}" for rank, text in failures.items())
        error = CoordinationError(
            f"{label} failed on rank(s) {sorted(failures)} of {self.world_size}: {details}", failures
        )
        if local_error is not None:
            raise error from local_error
        raise error

    def on_coordinator(self, label: str, work: Callable[[], T]) -> T:
        """Run ``work`` on the coordinator alone and return its result on every rank.

        If it raises a :class:`ShardkeepError`, every rank raises an error of the same class with
        the same message and plain attributes (``owner``, ``checkpoint`` ...); the coordinator
        (and a single process) raises the original. Any other
        error reaches the other ranks as a :class:`CoordinationError` naming it.
        """
        if not self.distributed:
            return work()
        failure: BaseException | None = None
        outcome: Any = None
        if self.is_coordinator:
            try:
                outcome = ("ok", work())
            except Exception as exc:
                failure = exc
                if isinstance(exc, ShardkeepError):
                    details = {k: v for k, v in vars(exc).items() if isinstance(v, (str, int, float, bool, type(None)))}
                    outcome = ("error", (type(exc).__name__, str(exc), details))
                else:
                    outcome = ("error", ("CoordinationError", f"{label} failed on the coordinator: {exc!r}", {}))
        kind, payload = self.broadcast(outcome, label=label)
        if kind == "ok":
            return payload  # type: ignore[no-any-return]  # the coordinator's result, typed T
        if failure is not None:
            raise failure
        raise same_error(*payload)

    def finish_through_store(
        self,
        key: str,
        local: Callable[[], bytes],
        complete: Callable[[list[bytes]], None],
        abort: Callable[[], None],
    ) -> None:
        """The commit barrier of an async save, for a background thread: no collectives.

        Every rank posts the bytes ``local()`` returns (or its error) under ``key`` in the process
        group's key-value store. The coordinator waits for every rank within the deadline, then
        calls ``complete`` with their bytes in rank order, or ``abort``, and posts the outcome;
        the other ranks wait for it (up to twice the deadline: the coordinator may spend one
        waiting for the slowest rank). If any rank or the commit failed, every rank raises
        :class:`CoordinationError`. Only raw bytes and JSON cross the store: no pickle.
        """
        from torch.distributed import distributed_c10d

        store = distributed_c10d._get_default_store()
        deadline = _dt.timedelta(seconds=self.timeout)
        try:
            posted = b"ok\n" + local()
        except Exception as exc:
            posted = b"error\n" + f"{type(exc).__name__}: {exc}".encode()
        store.set(f"{key}/rank{self.rank}", posted)  # type: ignore[arg-type]  # Store.set takes bytes too
        if self.is_coordinator:
            try:
                keys = [f"{key}/rank{rank}" for rank in range(self.world_size)]
                store.wait(keys, deadline)
                outcomes = [store.get(name) for name in keys]
                for name in keys:
                    store.delete_key(name)
                failures = {
                    rank: data.partition(b"\n")[2].decode(errors="replace")
                    for rank, data in enumerate(outcomes)
                    if not data.startswith(b"ok\n")
                }
                if failures:
                    raise CoordinationError(
                        f"writing the shards failed on rank(s) {sorted(failures)} of {self.world_size}: "
                        + "; ".join(f"rank {rank}: {text}" for rank, text in failures.items()),
                        failures,
                    )
                complete([data[3:] for data in outcomes])
                result = b"ok"
            except BaseException as exc:
                failures = exc.failures if isinstance(exc, CoordinationError) else {0: f"{type(exc).__name__}: {exc}"}
                message = str(exc) if isinstance(exc, CoordinationError) else f"committing failed on rank 0: {exc}"
                if "deadline" not in message and not isinstance(exc, ShardkeepError):
                    message = f"{message} (a rank may have missed the {self.timeout:.0f} s deadline)"
                try:
                    abort()
                except ShardkeepError as cleanup:
                    message = f"{message}; removing the staging directory failed too: {cleanup}"
                result = b"error\n" + json.dumps({"message": message, "failures": failures}).encode()
            store.set(f"{key}/result", result)  # type: ignore[arg-type]  # Store.set takes bytes too
            self._await_acknowledgements(store, key, deadline)
        else:
            try:
                store.wait([f"{key}/result"], 2 * deadline)
                result = store.get(f"{key}/result")
                store.set(f"{key}/ack{self.rank}", b"1")  # type: ignore[arg-type]  # Store.set takes bytes too
            except Exception as exc:
                raise CoordinationError(
                    f"the coordinator did not report the outcome within twice the {self.timeout:.0f} s "
                    f"deadline; the checkpoint may or may not have been committed ({exc})"
                ) from exc
        if result != b"ok":
            report = json.loads(result.partition(b"\n")[2])
            raise CoordinationError(report["message"], {int(rank): text for rank, text in report["failures"].items()})

    def _await_acknowledgements(self, store: Any, key: str, deadline: _dt.timedelta) -> None:
        """The coordinator hosts the key-value store in the usual TCP setup: before it returns
        (after which its process may exit), wait until every other rank has read the outcome. A
        rank that never acknowledges is not waited for beyond the deadline."""
        keys = [f"{key}/ack{rank}" for rank in range(1, self.world_size)]
        with contextlib.suppress(Exception):
            store.wait(keys, deadline)
        with contextlib.suppress(Exception):
            for name in [*keys, f"{key}/result"]:
                store.delete_key(name)


#: The most bytes one rank may send the coordinator in one gather (:meth:`Coordinator.gather`,
#: which carries each rank's file records in a save). A rank's report holds a few hundred bytes
#: per file it wrote (and per tensor entry in format 1.x), so real reports stay far below it; a
#: larger announcement is refused as that rank's failure before anything is allocated.
MAX_REPORT_BYTES = 256 * 2**20


def _announce(payload: bytes) -> tuple[int, int]:
    """What a rank announces before sending ``payload``: its size, and its xxh64 as a signed
    64-bit integer (what an int64 tensor carries)."""
    digest = xxhash.xxh64_intdigest(payload)
    return len(payload), digest - (1 << 64) if digest >= 1 << 63 else digest


def _refused(rank: int, why: str) -> tuple[str, RankFailure]:
    """The failed outcome the coordinator records for a rank whose report it cannot take."""
    return ("error", RankFailure(rank, "CoordinationError", f"rank {rank} {why}"))


#: The smallest and largest slot (bytes per rank) of the fixed-size collectives of small values
#: (see ``Coordinator.all_gather``), and the most bytes one such all-gather may deliver to a
#: rank while its slots are above the smallest.
SLOT_BYTES_MIN, SLOT_BYTES_MAX, _SLOTS_TOTAL = 256, 4096, 256 << 10


def slot_bytes(world_size: int) -> int:
    """The slot of the fixed-size collectives on ``world_size`` ranks: 4 KiB up to 64 ranks (the
    listings and outcomes of a small job fit, one collective each), shrinking so that an
    all-gather delivers at most 256 KiB, down to 256 bytes from 1,024 ranks on."""
    return max(SLOT_BYTES_MIN, min(SLOT_BYTES_MAX, _SLOTS_TOTAL // max(1, world_size)))


_TOO_LARGE = 0xFFFFFFFF


def _failures(outcomes: list[Any]) -> dict[int, str]:
    """The failed ranks of a step's outcomes, as ``{rank: "Type: message"}``."""
    return {
        rank: f"{payload.error_type}: {payload.message}"
        for rank, (kind, payload) in enumerate(outcomes)
        if kind == "error"
    }
