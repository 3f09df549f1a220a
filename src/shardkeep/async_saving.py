"""Async saves: :class:`SaveHandle` and the :class:`AsyncSaver` that owns the save in flight.

``async_save`` stages the state into reusable host buffers on the caller's thread (with the
collectives that planning needs), then a background thread writes this rank's files and
completes the commit without any collective: ranks exchange outcomes through the process
group's key-value store, and the coordinator commits once every rank has reported.

A save still in flight when the interpreter exits (the script's last line, or a Ctrl-C during
training) is settled before the interpreter's own thread pools shut down: the exit waits for
it while it makes progress, and logs whether it committed or failed. A save that writes nothing
for its ``timeout=`` (twice that on a rank that waits for the coordinator's commit), or a Ctrl-C
during the wait, abandons it: its writers stop at their next buffer (a buffer being written is
finished first) and the staging directory is removed; the log says which happened. The background thread is a daemon, joined once its save has finished.

With a :class:`BackgroundRetry`, a save whose write or commit fails is retried on the
background thread, from the staged copy, under the manager's :class:`~shardkeep.retry.RetryPolicy`
(:func:`~shardkeep.retry.run_with_retries`: the same vote, backoff, deadline and log line as a
synchronous save). Every collective of the vote and of a retried attempt runs on a group of
their own (:func:`background_group`, made on the caller's thread by the first such save), never
on the group the caller's thread uses. The failed attempt's staging directory is removed by the
coordinator (the commit barrier's abort), and before a retry the coordinator looks for a commit
the failed attempt made after all (kept, not saved again), as the synchronous save does.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

from shardkeep.config import LOCAL
from shardkeep.distributed.coordinator import Coordinator
from shardkeep.distributed.groups import GroupCache
from shardkeep.distributed.plan import ItemDescriptor
from shardkeep.errors import CoordinationError, RetentionError, SaveInProgressError
from shardkeep.integrity import SignaturePolicy
from shardkeep.manifest import Manifest
from shardkeep.progress import collector_paused
from shardkeep.retry import RetryPolicy, run_with_retries
from shardkeep.saving import SaveJob, SaveSettings, run_job, state_sections
from shardkeep.snapshot import StagingArena, snapshot_state
from shardkeep.verification import (
    locate,
    read_checked_manifest,
)
from shardkeep.writes import ABANDONED

logger = logging.getLogger("shardkeep")

#: How long the exit waits, after a Ctrl-C abandoned a save, for its writers to stop and its
#: staging directory to be removed.
ABANDON_SECONDS = 30.0

#: The groups of the background retries, by (process group, timeout): made once per process.
_background_groups = GroupCache()


@dataclass(frozen=True)
class BackgroundRetry:
    """How the background thread retries a failed async save: ``policy``; ``what`` (the save,
    as each retry's log line names it); ``group``, the process group of the vote and of the
    retried attempts (:func:`background_group`; ``None`` for a single process); and two calls
    the coordinator makes on that group: ``committed`` (the manifest the failed attempt committed
    after all, or ``None``) and ``free_space`` (apply retention before retrying a full disk;
    whether it deleted anything)."""

    policy: RetryPolicy
    what: str
    group: Any
    committed: Callable[[], Manifest | None]
    free_space: Callable[[], bool]


def background_group(process_group: Any, timeout: float) -> Any:
    """A gloo group of the ranks of ``process_group`` (the default group when ``None``) for the
    collectives of async saves' retries, made on the first call (a collective: call it on the
    caller's thread, on every rank, in the same order) and reused."""
    import torch.distributed as dist

    group = process_group if process_group is not None else dist.group.WORLD
    ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
    return _background_groups.get(
        (id(group), float(timeout)),
        lambda: dist.new_group(
            ranks=ranks,
            backend="gloo",
            timeout=timedelta(seconds=timeout),
            use_local_synchronization=ranks is not None,
        ),
    )


class SaveHandle:
    """The result of :func:`async_save`: the state is already staged when you get one.

    ``done()`` tells whether the background write and commit have finished; ``result(timeout)``
    waits and returns the committed :class:`~shardkeep.manifest.Manifest`, or raises the
    failure with its own type (a :class:`~shardkeep.errors.CoordinationError` when ranks
    failed). ``wait_staged()`` returns at once: staging finished before ``async_save`` returned.
    ``blocked_seconds`` is how long the call held the caller; ``staged_bytes`` the tensor bytes
    copied, and ``staging_arena_bytes`` the host memory the process's staging arena holds (it
    is reused by every async save of the process, and grows by a quarter when too small).
    """

    def __init__(self, path: str, job: SaveJob | None = None, exit_wait: float = 0.0) -> None:
        self.path = path
        self._finished = threading.Event()
        self._manifest: Manifest | None = None
        self._error: BaseException | None = None
        self._reported = False  # result() has handed the outcome to the caller
        self._job = job  # kept while in flight, to abandon the save at exit
        self._exit_wait = exit_wait  # how long the exit waits for this save without progress
        self._pid = os.getpid()  # a forked child inherits the handle, not the thread behind it
        self._worker: threading.Thread | None = None  # the background thread (a daemon)
        self.blocked_seconds = 0.0
        self.staged_bytes = 0
        self.staging_arena_bytes = 0

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self._error else "committed")
        return f"SaveHandle({self.path!r}, {state})"

    def wait_staged(self, timeout: float | None = None) -> bool:
        return True

    def done(self) -> bool:
        return self._finished.is_set()

    def result(self, timeout: float | None = None) -> Manifest:
        if not self._finished.wait(timeout):
            raise SaveInProgressError(f"the save of {self.path} is still running after {timeout} s")
        self._reported = True
        if self._error is not None:
            raise self._error
        assert self._manifest is not None
        return self._manifest

    def _complete(self, manifest: Manifest | None, error: BaseException | None) -> None:
        self._manifest = manifest
        self._error = error
        self._job = None
        self._finished.set()

    def _settle_at_exit(self) -> None:
        """At interpreter exit: wait for this save (at most ``exit_wait`` seconds from now), or
        abandon it on Ctrl-C, and log the outcome the script never asked for."""
        if self._pid != os.getpid():
            return
        try:
            self._settle()
            # The daemon thread may still be returning from a completed save: the interpreter
            # must not finalize under it (native code then aborts the process).
            worker = self._worker
            if worker is not None and self.done():
                worker.join(ABANDON_SECONDS)
        except KeyboardInterrupt:  # outside the waits that handle it: stop the writers, leave
            job = self._job
            if job is not None and not self.done():
                job.control.cancel()
                logger.warning("shardkeep: exit interrupted; the async save of %s is abandoned", self.path)

    def _settle(self) -> None:
        if self.done() and self._reported:
            return
        if not self.done():
            logger.warning(
                "shardkeep: waiting for the async save of %s to finish before the interpreter exits "
                "(while it makes progress; abandoned after %.0f s without, its timeout=; Ctrl-C abandons it)",
                self.path,
                self._exit_wait,
            )
            try:
                finished = self._wait_while_progressing()
            except KeyboardInterrupt:
                self._abandon("a second Ctrl-C")
                return
            if not finished:
                self._abandon(f"{self._exit_wait:.0f} s without progress")
                return
        self._log_outcome("before exit")

    def _wait_while_progressing(self) -> bool:
        """Wait until the save finishes, or until it has written nothing for ``exit_wait``
        seconds (measured from now at the earliest); whether it finished."""
        began = time.monotonic()
        while not self._finished.wait(min(1.0, self._exit_wait)):
            job = self._job
            progressed = max(began, job.control.progressed if job is not None else began)
            if time.monotonic() - progressed >= self._exit_wait:
                return self.done()
        return True

    def _log_outcome(self, when: str) -> None:
        error = self._error
        if error is None:
            logger.warning("shardkeep: the async save of %s committed %s", self.path, when)
        elif isinstance(error, RetentionError):
            logger.error("shardkeep: the async save of %s committed %s, but %s", self.path, when, error)
        else:
            logger.error("shardkeep: the async save of %s failed: %s: %s", self.path, type(error).__name__, error)

    def _abandon(self, why: str) -> None:
        job = self._job
        if job is not None:
            job.control.cancel()
        logger.warning("shardkeep: abandoning the async save of %s after %s", self.path, why)
        try:
            finished = self._finished.wait(ABANDON_SECONDS)
        except KeyboardInterrupt:
            finished = False
        if not finished:
            logger.error(
                "shardkeep: the async save of %s was left unfinished (its writers did not stop within %.0f s); "
                "unless it had reached its commit, what it wrote stays in its staging directory, which is never "
                "read as a checkpoint and is removed by a later save or `shardkeep prune` once its lease expires",
                self.path,
                ABANDON_SECONDS,
            )
        elif self._error is not None and _abandoned(self._error):
            logger.warning(
                "shardkeep: the async save of %s was abandoned: nothing committed, its staging directory removed",
                self.path,
            )
        else:
            self._log_outcome("before it could be abandoned")


def _abandoned(error: BaseException) -> bool:
    """Whether ``error`` is the failure that abandoning a save causes (on this rank, or on
    another rank as reported through the coordinator)."""
    return ABANDONED in str(error)


class AsyncSaver:
    """This process's async saves: the lock that lets one save stage at a time, the handle of
    the save still in flight, and the staging arena whose host buffers are reused from one save
    to the next (first-touch memory is slow). :meth:`default` is the one every ``async_save``
    of the process uses."""

    _default: AsyncSaver | None = None
    _default_lock = threading.Lock()

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.arena = StagingArena()
        self._inflight: SaveHandle | None = None

    @classmethod
    def default(cls) -> AsyncSaver:
        """The process's saver (made on first use: importing shardkeep allocates nothing and
        registers no exit hook)."""
        with cls._default_lock:
            if cls._default is None:
                cls._default = cls()
                _register_exit_hook()
            return cls._default

    def settle_at_exit(self) -> None:
        """Settle the save in flight, if any (see the module docstring)."""
        handle = self._inflight
        if handle is not None:
            handle._settle_at_exit()

    def save(
        self,
        state: Mapping[str, Any],
        path: str | os.PathLike[str],
        settings: SaveSettings,
        *,
        wait: bool = True,
        staging_budget: int | None = None,
        after_commit: Callable[[Manifest], None] | None = None,
        retry: BackgroundRetry | None = None,
    ) -> SaveHandle:
        """The body of :func:`~shardkeep.async_save`: one save stages at a time, from the
        snapshot until its handle is registered (two threads must never stage into the shared
        arena together). ``retry``: retry a failed write or commit in the background."""
        if settings.started is None:
            settings = replace(settings, started=time.perf_counter())
        if not self.lock.acquire(blocking=wait, timeout=settings.timeout if wait else -1):
            raise SaveInProgressError("another async_save is staging in this process; pass wait=True to queue")
        try:
            return self._submit(state, path, settings, wait, staging_budget, after_commit, retry)
        finally:
            self.lock.release()

    def _submit(
        self,
        state: Mapping[str, Any],
        path: str | os.PathLike[str],
        settings: SaveSettings,
        wait: bool,
        staging_budget: int | None,
        after_commit: Callable[[Manifest], None] | None,
        retry: BackgroundRetry | None = None,
    ) -> SaveHandle:
        """Wait for the save in flight, stage the state, prepare the job (collectives) and
        start the background thread; called while holding the lock."""
        timeout = settings.timeout
        previous = self._inflight
        if previous is not None and not previous.done():
            if not wait:
                raise SaveInProgressError(f"a save of {previous.path} is still in flight; pass wait=True to queue")
            if not previous._finished.wait(timeout):
                raise SaveInProgressError(
                    f"the previous save of {previous.path} is still running after {timeout:.0f} s"
                )
        coordinator = Coordinator(settings.process_group, timeout=timeout)
        location = locate(path, settings.storage, settings.storage_options)
        jobs: list[SaveJob] = []
        described: list[ItemDescriptor] = []

        def stage_and_describe() -> str:
            # The staging copy and the save's first collective step are one step: the caller
            # waits for every collective, each of which costs milliseconds on a real group.
            with collector_paused():
                staged = snapshot_state(state, self.arena, budget=staging_budget)
                # The staged copy lives in reused buffers: no version proof about it would hold.
                unproved = replace(settings, trust_versions=False)
                jobs.append(SaveJob(staged, location, unproved, coordinator, sections=state_sections(state, [])))
                return jobs[0].describe_for_agreement(described)

        digests = coordinator.step("stage and prepare the save", stage_and_describe)
        job = jobs[0]
        try:
            with collector_paused():
                job.prepare(digests, described)
        except BaseException:
            job.abort()
            raise
        # The exit waits as long as the save's own deadline allows, twice on a rank that waits for
        # the coordinator's commit through the store (which allows it twice the timeout).
        handle = SaveHandle(str(location), job, timeout * (2 if coordinator.distributed else 1))
        handle.staged_bytes = sum(item.nbytes for item in job.planned)
        handle.staging_arena_bytes = self.arena.capacity
        started = threading.Event()
        worker = threading.Thread(
            target=_finish_in_background,
            args=(job, handle, after_commit, started, retry),
            name="shardkeep-async-save",
            daemon=True,  # the exit hook, not the interpreter's join, bounds the wait for it
        )
        handle._worker = worker
        try:
            worker.start()
        except BaseException:  # no thread (a process limit): nothing will ever finish this save
            job.abort()
            raise
        self._inflight = handle
        # Starting the thread is part of what the caller waits for (it can hand the interpreter
        # to the new thread for milliseconds); the worker reads the figure only after this.
        job.blocked_seconds = handle.blocked_seconds = time.perf_counter() - job.started
        started.set()
        return handle


def _register_exit_hook() -> None:
    """Settle the save in flight when the interpreter exits, before the thread pools shut down.

    ``concurrent.futures`` refuses new work once its own exit hook has run ("cannot schedule
    new futures after interpreter shutdown"), and every write goes through a pool. Hooks
    registered with ``threading._register_atexit`` run in reverse order of registration at the
    start of shutdown, and ``concurrent.futures.thread`` registered its hook when it was
    imported (``shardkeep.writes`` imports it), so ours, registered later, runs first.
    ``atexit`` would run too late: after the pools have shut down.
    """
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is not None:
            register(_settle_at_exit)
        else:  # pragma: no cover - CPython 3.11+ has it
            import atexit

            atexit.register(_settle_at_exit)
    except RuntimeError:  # already shutting down: there is nothing left to protect
        pass


def _settle_at_exit() -> None:
    saver = AsyncSaver._default
    if saver is not None:
        saver.settle_at_exit()


def _finish_in_background(
    job: SaveJob,
    handle: SaveHandle,
    after_commit: Callable[[Manifest], None] | None = None,
    started: threading.Event | None = None,
    retry: BackgroundRetry | None = None,
) -> None:
    """Write this rank's files and complete the commit without any collective (retrying under
    ``retry``), then run ``after_commit``. The handle is always completed, even when cleaning
    up after a failure fails too. ``started`` is set once the caller has recorded how long it
    was blocked."""
    manifest: Manifest | None = None
    error: BaseException | None = None
    if started is not None:
        started.wait()
    try:
        manifest = _finish(job) if retry is None else _finish_with_retries(job, handle, retry)
        if after_commit is not None:
            assert manifest is not None
            after_commit(manifest)
    except BaseException as exc:
        error = exc
    finally:
        handle._complete(manifest, error)


def _finish(job: SaveJob) -> Manifest:
    """Write and commit the prepared ``job``, without a collective; the staging directory is
    removed on failure."""
    if job.coordinator.distributed:
        return _finish_through_store(job)
    try:
        manifest = job.finish([job.report()])
    except BaseException:
        job.abort()
        raise
    assert manifest is not None
    return manifest


def _finish_with_retries(job: SaveJob, handle: SaveHandle, retry: BackgroundRetry) -> Manifest:
    """:func:`_finish`, then, after a failure every rank agrees is transient, a fresh attempt
    from the staged copy (its own plan, staging directory and commit), all on ``retry.group``."""
    voters = Coordinator(retry.group if job.coordinator.distributed else LOCAL, timeout=job.coordinator.timeout)

    def attempt(number: int) -> Manifest:
        if number == 1:
            return _finish(job)
        earlier = voters.on_coordinator("find a commit", retry.committed)
        if earlier is not None:  # the failed attempt failed after its commit point
            return earlier
        again = SaveJob(job.state, job.location, job.settings, voters, sections=job.sections)
        again.blocked_seconds = job.blocked_seconds
        again.control = job.control  # one control for every attempt: the exit's progress and abandon
        return run_job(again)

    def free_space() -> bool:
        return bool(voters.on_coordinator("free space to retry the save", retry.free_space))

    return run_with_retries(attempt, retry.policy, voters=voters, free_space=free_space, what=retry.what)


def _finish_through_store(job: SaveJob) -> Manifest:
    """Exchange each rank's file records through the coordinator's store barrier (JSON, no
    pickle); the coordinator commits, the other ranks read the committed manifest. A failure is
    a :class:`~shardkeep.errors.CoordinationError` on every rank; on the rank where it happened,
    its cause is that rank's own error (the evidence a retry vote reads)."""
    assert job.commit is not None
    committed: list[Manifest] = []
    own: list[BaseException] = []

    def write() -> bytes:
        try:
            return job.write_payload()
        except Exception as exc:
            own.append(exc)
            raise

    def complete(payloads: list[bytes]) -> None:
        try:
            manifest = job.finish(job.read_payloads(payloads))
        except Exception as exc:
            own.append(exc)
            raise
        assert manifest is not None
        committed.append(manifest)

    try:
        job.coordinator.finish_through_store(f"shardkeep/{job.commit.staging}", write, complete, job.abort)
    except CoordinationError as exc:
        if own and exc.__cause__ is None:
            raise exc from own[0]
        raise
    if committed:
        return committed[0]
    # The manifest alone, as the coordinator returns it: a format 2.x manifest's rank indexes
    # are not read (every rank reading every index would cost tensors x ranks).
    return read_checked_manifest(job.location, SignaturePolicy(), expand=False)
