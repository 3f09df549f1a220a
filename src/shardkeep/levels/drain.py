"""The drain: a committed node-local checkpoint copied to a persistent level in the background,
committed there through the persistent store's own protocol with the same sealed manifest bytes.

A drain never saves a second time: it copies the committed files byte for byte, checks each
file's digest (and stored size) against the manifest record while copying, and commits the
manifest the local step was sealed with (and its signature), so the persistent copy is the
same checkpoint, with the same identity (:func:`~shardkeep.levels.parts.manifest_identity`).

Who calls what, in order (every rank, the same calls in the same order; collectives only on
the caller's thread, never on the copying thread):

1. ``Drain(...)``, then :meth:`Drain.start` (collective, cheap): each node's leader reports
   which data files its node holds (its ``node-part.json`` whose ``manifest_digest`` is the
   manifest's, and the files present); the coordinator reads the local manifest, opens the
   persistent commit (:class:`~shardkeep.distributed.commit.CheckpointCommit`), assigns each
   data file to exactly one rank (the lowest node holding it: the rank that wrote it if it is
   there, else spread over that node's ranks) and takes the rank index files itself, and
   broadcasts the plan. Each rank then starts up to ``io_threads`` daemon threads that copy
   its files, block by block.
2. :meth:`Drain.poll` (collective, at a safe point: the manager calls it at each save): every
   rank's state is gathered; when every rank is done, the coordinator commits; when a rank
   failed, every rank stops its thread and the coordinator aborts. :meth:`Drain.wait` waits
   (bounded) for the local copy, then polls once; :meth:`Drain.abandon` (collective) stops and
   aborts; :meth:`Drain.abandon_locally` does so without a collective, once the process group
   broke (a peer died): the collectives above then raise
   :class:`~shardkeep.distributed.coordinator.GroupBrokenError`, and a drain cannot end together.
3. After a restart, the coordinator calls :func:`recover_drains` before draining again.

Where the files go on the persistent level: on a store that renames, into the commit's
staging directory (``<final>.tmp-<id>/<path>``, :meth:`CheckpointCommit.place`); on an object
store, directly under ``<final>/<path>``, because the manifest (the same bytes as the local
one) records the paths without an attempt prefix. The commit point is the store's usual one:
the final rename, or the create-only manifest object.

Crash windows and what recovery sees:

- while copying: on a filesystem, ``<final>.tmp-<id>/`` holds part of the files and no
  manifest (never read as a checkpoint); on an object store, ``<final>/`` holds part of the
  objects (and perhaps an unfinished multipart upload) and no ``manifest.json``, so no reader
  takes it for a checkpoint. :func:`recover_drains` removes it (the staging through the commit's
  own ``abort``; the objects of the drain, never ``attempt-*`` prefixes of a direct save) and
  names the step for a new drain, which copies again from the intact local copy. A later
  :meth:`Drain.start` of the same step on an object store also clears such leftovers first.
  Stale staging directories of steps no longer held locally are collected by
  :meth:`~shardkeep.catalog.CheckpointRoot.collect_leftovers` after its lease.
- after every file was copied, before the manifest: the same as above (all files, no manifest).
- during the manifest write and the rename: the commit's own windows
  (:class:`~shardkeep.distributed.commit.FilesystemCommit`,
  :class:`~shardkeep.distributed.commit.ObjectStoreCommit`): either no manifest under the final
  name (as above), or a committed checkpoint whose every file was durable before its manifest.
- after the commit point, when a later step fails (the signature on an object store) or its
  response is lost: the manifest under the final name is this drain's, so the drain reports the
  step committed (and logs the failure) rather than removing a committed checkpoint's files.
- after the commit, before the caller's bookkeeping: the persistent level holds the step,
  committed. :func:`recover_drains` reports it as persisted; a new drain of it finds the same
  manifest there and reports it committed without copying.

Retries on the coordinator. A transient failure (:func:`~shardkeep.retry.is_transient`) of the
plan or of the commit is retried on the coordinator under the drain's ``retry`` policy, each
retry logged (what failed, attempt k of n, the wait); a :class:`DrainError` or a permanent error
never is. The other ranks wait in the broadcast that follows, so no vote is needed, and the
retries of one plan or one commit end once the next wait would pass
``min(retry.deadline, COORDINATOR_RETRY_SHARE * coordinator.timeout)`` (half the collective
deadline) after its first attempt (:meth:`Drain.retry_bound`). Each node's leader retries the
reading of its node's part the same way. What each retry sees:

- planning (the local manifest and indexes, the persistent manifest's stat and read, clearing
  an object store's leftovers, ``begin``): retried whole. Nothing of the drain is on the
  persistent level yet; each attempt opens a fresh commit (``begin`` writes nothing), and
  clearing leftovers without a manifest is idempotent.
- commit, before the manifest write (the local manifest and signature, the visibility checks,
  ``add_data_file``): retried whole; nothing was written.
- commit, the manifest write attempted and failed: the next attempt first reads the manifest
  under the final name (a failure there is itself retried, never guessed). None there: on a
  store that renames, the entries the failed write left at the top of the unpublished staging
  directory (signature, manifest, its temporary; never a copied file) are removed and the commit
  runs again with a fresh write; on an object store the create-only write runs again. Another
  attempt's manifest: the commit refuses it (not retried) and the drain aborts what it wrote.
- commit, past the commit point (the manifest there is this drain's: a lost response, a failed
  signature write or fsync after it): never committed a second time; only what follows the
  commit point is done again (the fsync of the root after the final rename; on an object store
  the signature, or the removal of a stale one). When that keeps failing the step is reported
  committed, with a warning, as above.
- retries exhausted before the commit point: the drain fails, the coordinator removes what it
  wrote (the staging, or the drain's objects), and the manager skips it with the reason.

The local copy is only ever read: a drain cut off anywhere leaves it intact.

Bounds: a rank's copying threads hold one buffer each, together at most half the byte budget
(each at most 16 MiB; a file is never held whole; the persistent store's writer may buffer one
upload part of its own, and a compressed file adds zstd's window); they run at a lower CPU
priority (``nice``) and drop the local files they read from the page cache
(``POSIX_FADV_DONTNEED``). A failed copy of one file is retried under the ``retry`` policy on
the copying thread (transient errors only: the thread waits and copies the file again; no
vote, no collective). :meth:`Drain.wait` returns after its timeout plus one collective;
:meth:`Drain.start` and the :meth:`Drain.poll` that commits take at most
:meth:`Drain.retry_bound` seconds of retries on the coordinator, besides the work itself.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from shardkeep.config import ManifestLimits, WriteOptions
from shardkeep.distributed.commit import CheckpointCommit
from shardkeep.distributed.coordinator import Coordinator
from shardkeep.errors import CheckpointNotFoundError, DrainError, IntegrityError, ShardkeepError
from shardkeep.indexes import expand_all, read_small
from shardkeep.integrity import digests_equal, unseal_manifest
from shardkeep.io import copy_with_digest
from shardkeep.levels.parts import decode_node_part, manifest_identity
from shardkeep.manifest import Manifest
from shardkeep.manifest.schema import IndexedManifest
from shardkeep.names import (
    ATTEMPT_PREFIX,
    MANIFEST_FILENAME,
    NODE_PART_FILENAME,
    SIGNATURE_FILENAME,
    STAGING_MARKER,
    is_sibling_of,
)
from shardkeep.retry import RetryPolicy, is_transient
from shardkeep.storage import ByteStore, LocalStore, StoreOperations, adapt_store, open_store
from shardkeep.verification import parse_manifest

__all__ = ["COORDINATOR_RETRY_SHARE", "CopyTask", "Drain", "DrainPlan", "DrainRecovery", "DrainState", "recover_drains"]

logger = logging.getLogger(__name__)

MiB = 1 << 20
#: The largest copy buffer, whatever the byte budget.
MAX_BLOCK = 16 * MiB
#: What a rank's small files are capped at when read whole (node part, signature).
_SMALL_FILE_LIMIT = 1 * MiB

#: The share of the coordinator's collective ``timeout`` that the retries of one plan or one
#: commit may take, from its first attempt (the other ranks wait for it in a collective).
COORDINATOR_RETRY_SHARE = 0.5

T = TypeVar("T")

PersistentLocation = str | os.PathLike[str] | StoreOperations


@dataclass(frozen=True)
class CopyTask:
    """One file to copy: its path as the manifest records it (relative to the checkpoint), its
    bytes on storage, its recorded digest (``None``: none recorded, the size is checked), the
    node it is copied from, and for a compressed file its decompressed size (the digest is of
    the decompressed bytes)."""

    path: str
    size: int
    digest: str | None
    node: int
    decompressed_size: int | None = None


@dataclass(frozen=True)
class DrainPlan:
    """What the coordinator broadcasts at start: where the files go on the persistent level
    (the staging directory, or the checkpoint's own prefix on an object store), each rank's
    files, and the identity of the manifest they belong to. ``persisted``: the persistent level
    already holds this very step (nothing to copy)."""

    staging: str
    tasks: dict[int, list[CopyTask]]
    manifest_digest: str
    persisted: bool = False


@dataclass(frozen=True)
class DrainState:
    """A drain's state, the same on every rank once :meth:`Drain.poll` returned it:
    ``running``, ``committed`` or ``failed`` (then ``error`` is the :class:`DrainError`, with
    the same message on every rank). ``bytes_copied`` sums every rank's copied bytes;
    ``seconds`` is the slowest rank's copying time so far."""

    name: str
    state: Literal["running", "committed", "failed"]
    bytes_copied: int
    seconds: float
    error: DrainError | None = None


@dataclass
class _Progress:
    """The files left to copy and what the copying threads report to the caller's thread
    (under ``lock``)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    pending: list[CopyTask] = field(default_factory=list)
    workers: int = 0
    copied: int = 0
    done: bool = False
    failure: str | None = None
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None

    def elapsed(self) -> float:
        return (self.finished if self.finished is not None else time.monotonic()) - self.started


def _open_persistent(location: PersistentLocation, storage_options: Mapping[str, Any] | None) -> ByteStore:
    if isinstance(location, (str, os.PathLike)):
        return open_store(location, storage_options)
    return adapt_store(location)


class Drain:
    """Copy the committed node-local checkpoint ``name`` (under this node's ``local_root``) to
    the persistent level ``persistent`` (a path, a URL, or a byte store), in the background.

    ``node_of[rank]`` is each rank's node (every rank of the coordinator's group); every rank
    passes its own node's ``local_root``. ``options`` gives the byte budget and the digest
    algorithm is the manifest's; ``retry`` (default: no retry) governs a failed file copy on
    the copying threads (up to ``options.io_threads`` per rank, sharing the byte budget), and
    the plan and the commit on the coordinator, within :meth:`retry_bound` seconds each.
    ``nice`` lowers the copying threads' CPU priority by that much on Linux (0: unchanged), so
    the drain yields to training. Every method but :meth:`state` is collective (see the module
    docstring).
    """

    def __init__(
        self,
        local_root: str | os.PathLike[str],
        name: str,
        persistent: PersistentLocation,
        coordinator: Coordinator,
        node_of: Sequence[int],
        *,
        options: WriteOptions | None = None,
        retry: RetryPolicy | None = None,
        storage_options: Mapping[str, Any] | None = None,
        limits: ManifestLimits | None = None,
        nice: int = 10,
    ) -> None:
        if len(node_of) != coordinator.world_size:
            raise DrainError(
                f"draining {name}: node_of names {len(node_of)} ranks, the group has {coordinator.world_size}"
            )
        self.name = name
        self.local_root = os.fspath(local_root)
        self.local = LocalStore(self.local_root)
        self.store = _open_persistent(persistent, storage_options)
        self.coordinator = coordinator
        self.node_of = tuple(int(node) for node in node_of)
        self.node = self.node_of[coordinator.rank]
        self.options = options or WriteOptions()
        self.retry = retry or RetryPolicy(attempts=1)
        self.limits = limits or ManifestLimits()
        self.nice = nice
        self.block = max(64 * 1024, min(self.options.byte_budget // 2, MAX_BLOCK))  # set again by start
        self.plan: DrainPlan | None = None
        self._commit: CheckpointCommit | None = None
        self._progress = _Progress()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._final: DrainState | None = None

    # -- start -----------------------------------------------------------------------------
    def start(self) -> None:
        """Plan the drain on the coordinator and start this rank's copying thread (collective).
        Raises the same :class:`DrainError` on every rank when the plan cannot be made (no node
        holds a file, the local manifest is damaged, the persistent level holds another step of
        this name); nothing is left on the persistent level then."""
        if self.plan is not None:
            raise DrainError(f"draining {self.name}: start() was already called")
        holdings = self.coordinator.step_to_coordinator(f"draining {self.name}: holdings", self._holdings)
        outcome: tuple[str, DrainPlan | str] | None = None
        if self.coordinator.is_coordinator:
            assert holdings is not None
            outcome = self._planned(holdings)
        kind, payload = self.coordinator.broadcast(outcome, label=f"draining {self.name}: plan")
        if kind != "ok":
            assert isinstance(payload, str)
            self._final = DrainState(self.name, "failed", 0, 0.0, DrainError(payload))
            raise DrainError(payload)
        assert isinstance(payload, DrainPlan)
        self.plan = payload
        if payload.persisted:
            self._final = DrainState(self.name, "committed", 0, 0.0)
            return
        if not self.coordinator.is_coordinator and self.store.atomic_rename:
            self._commit = CheckpointCommit(self.store, self.name, staging=payload.staging)
        tasks = payload.tasks.get(self.coordinator.rank, [])
        workers = max(1, min(self.options.io_threads, len(tasks)))
        self.block = max(64 * 1024, min(self.options.byte_budget // (2 * workers), MAX_BLOCK))
        self._progress = _Progress(pending=list(tasks), workers=workers)
        self._threads = [
            threading.Thread(target=self._copy_all, name=f"shardkeep-drain-{self.name}-{index}", daemon=True)
            for index in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def _holdings(self) -> tuple[int, str | None, list[str], str]:
        """(node, the part's manifest digest, data files present, why none) of this rank's
        node, reported by the node's leader only (other ranks report nothing); a transient
        failure reading them is retried (:meth:`_with_retries`)."""
        if self.coordinator.rank != self.node_of.index(self.node):
            return self.node, None, [], ""
        try:
            digest, present = self._with_retries(f"reading node {self.node}'s part", self._read_holdings)
        except ShardkeepError as exc:
            return self.node, None, [], f"{type(exc).__name__}: {exc}"
        return self.node, digest, present, ""

    def _read_holdings(self) -> tuple[str, list[str]]:
        raw = read_small(self.local, f"{self.name}/{NODE_PART_FILENAME}", _SMALL_FILE_LIMIT, DrainError)
        part = decode_node_part(raw, where=f"{self.local_root}/{self.name}/{NODE_PART_FILENAME}")
        present = [
            path for path in dict.fromkeys([*part.files, *part.healed]) if self.local.stat(f"{self.name}/{path}")
        ]
        return part.manifest_digest, present

    # -- the coordinator's retries -----------------------------------------------------------
    def retry_bound(self) -> float:
        """The most seconds the retries of one plan or commit may take, from its first attempt:
        ``min(retry.deadline, COORDINATOR_RETRY_SHARE * coordinator.timeout)``, so that the
        other ranks, waiting in the collective that follows, keep the rest of their deadline
        for the work itself."""
        return min(self.retry.deadline, COORDINATOR_RETRY_SHARE * self.coordinator.timeout)

    def _with_retries(self, what: str, attempt: Callable[[], T]) -> T:
        """``attempt()``, run again after each transient failure (:func:`~shardkeep.retry.is_transient`)
        under the drain's policy, each retry logged (what failed, attempt k of n, the wait); no
        retry whose wait would end more than :meth:`retry_bound` seconds after the first attempt
        started. A :class:`DrainError` or a permanent error is raised at once, as it is; a
        transient one that ends the retries as a :class:`DrainError` saying how many attempts
        were made and why there was no other."""
        started = time.monotonic()
        bound = self.retry_bound()
        number = 1
        while True:
            try:
                return attempt()
            except DrainError:
                raise
            except Exception as exc:
                if self.retry.attempts == 1 or not is_transient(exc):
                    raise
                wait = self.retry.backoff(number) if number < self.retry.attempts else None
                elapsed = time.monotonic() - started
                if wait is None or elapsed + wait > bound:
                    why = (
                        f"all {self.retry.attempts} attempts were made"
                        if wait is None
                        else f"a {wait:.1f} s wait would pass the {bound:g} s bound (retry.deadline, or "
                        f"{COORDINATOR_RETRY_SHARE:g} of the coordinator's {self.coordinator.timeout:g} s timeout)"
                    )
                    raise DrainError(
                        f"draining {self.name}: {what} failed on attempt {number} of {self.retry.attempts} "
                        f"({type(exc).__name__}: {exc}); no retry: {why}"
                    ) from exc
                logger.warning(
                    "drain of %s: %s failed (%s), attempt %d of %d; retrying in %.1f s",
                    self.name,
                    what,
                    exc,
                    number,
                    self.retry.attempts,
                    wait,
                )
                time.sleep(wait)
                number += 1

    def _planned(self, holdings: list[tuple[int, str | None, list[str], str]]) -> tuple[str, DrainPlan | str]:
        """The coordinator's plan, or why there is none (``("error", message)``), the plan
        retried whole after a transient failure (:meth:`_with_retries`). Nothing is written on
        the persistent level before the plan is made (on an object store, the leftovers of an
        earlier drain of this name without a manifest are removed first)."""
        try:
            return "ok", self._with_retries("planning", lambda: self._plan(holdings))
        except Exception as exc:  # every rank waits for the plan: any failure goes to all of them
            message = str(exc) if isinstance(exc, DrainError) else f"draining {self.name}: {type(exc).__name__}: {exc}"
            return "error", message

    def _plan(self, holdings: list[tuple[int, str | None, list[str], str]]) -> DrainPlan:
        """One attempt at the plan: each attempt reads again and opens a fresh commit (its
        ``begin`` writes nothing; clearing an object store's leftovers is idempotent)."""
        sealed, manifest = self._local_manifest()
        identity = manifest_identity(sealed)
        if self._already_persisted(identity):
            return DrainPlan(staging="", tasks={}, manifest_digest=identity, persisted=True)
        tasks = self._assign(manifest, identity, holdings)
        commit = CheckpointCommit(self.store, self.name)
        if not self.store.atomic_rename:
            _clear_object_leftovers(self.store, self.name)
        commit.begin()
        self._commit = commit
        staging = commit.staging if self.store.atomic_rename else self.name
        return DrainPlan(staging=staging, tasks=tasks, manifest_digest=identity)

    def _local_manifest(self) -> tuple[bytes, Manifest]:
        where = f"{self.local_root}/{self.name}"
        sealed = read_small(self.local, f"{self.name}/{MANIFEST_FILENAME}", self.limits.max_bytes, DrainError)
        manifest = parse_manifest(sealed, where=where, limits=self.limits)
        if isinstance(manifest, IndexedManifest):
            manifest = expand_all(self.local, self.name, manifest, limits=self.limits)
        return sealed, manifest

    def _already_persisted(self, identity: str) -> bool:
        """Whether the persistent level already holds this step: ``True`` when its manifest is
        the same bytes; :class:`DrainError` when it is another step of the same name."""
        path = f"{self.name}/{MANIFEST_FILENAME}"
        if self.store.stat(path) is None:
            return False
        found = read_small(self.store, path, self.limits.max_bytes, DrainError)
        if manifest_identity(found) == identity:
            return True
        raise DrainError(
            f"draining {self.name}: {self.store.root.rstrip('/')}/{self.name} is committed with another manifest "
            "(another attempt of this step); committed checkpoints are never overwritten"
        )

    def _assign(
        self, manifest: Manifest, identity: str, holdings: list[tuple[int, str | None, list[str], str]]
    ) -> dict[int, list[CopyTask]]:
        """Each data file to one rank of the lowest node holding it (the rank that wrote it
        when it is on that node, else round robin over that node's ranks); the index files to
        the coordinator (every node holds all of them). Files of other checkpoints (an
        incremental save's references) and of tiers with a location of their own are refused:
        the drain copies the checkpoint's own directory."""
        located = {tier.name for tier in manifest.tiers if tier.location}
        held: dict[str, list[int]] = {}
        refused: dict[int, str] = {}
        for node, digest, present, why in holdings:
            if digest is None:
                if why:
                    refused[node] = why
                continue
            if digest != identity:
                refused[node] = "its node-part.json belongs to another attempt of this step"
                continue
            for path in present:
                held.setdefault(path, []).append(node)
        ranks_of: dict[int, list[int]] = {}
        for rank, node in enumerate(self.node_of):
            ranks_of.setdefault(node, []).append(rank)
        turn: dict[int, int] = {}
        tasks: dict[int, list[CopyTask]] = {}
        for record in manifest.files:
            if record.ref is not None or record.tier in located:
                where = (
                    f"file of {record.ref}" if record.ref is not None else f"file in tier {record.tier!r}'s location"
                )
                raise DrainError(
                    f"draining {self.name}: {record.path} is a {where}; a drain copies only the checkpoint's own files"
                )
            nodes = sorted(held.get(record.path, []))
            if not nodes:
                why = "; ".join(f"node {node}: {reason}" for node, reason in sorted(refused.items()))
                raise DrainError(
                    f"draining {self.name}: file {record.path} (rank {record.rank}) is held by no node"
                    + (f" ({why})" if why else "")
                )
            node = nodes[0]
            ranks = ranks_of[node]
            if record.rank in ranks:  # the rank that wrote it, where it still holds it
                rank = record.rank
            else:
                rank = ranks[turn.get(node, 0) % len(ranks)]
                turn[node] = turn.get(node, 0) + 1
            decompressed = record.size if record.compression is not None else None
            task = CopyTask(record.path, record.stored_size, record.digest, node, decompressed)
            tasks.setdefault(rank, []).append(task)
        if isinstance(manifest, IndexedManifest):
            for index in manifest.index_records():
                tasks.setdefault(0, []).append(CopyTask(index.path, index.size, index.digest, self.node_of[0]))
        return tasks

    # -- the copying thread ----------------------------------------------------------------
    def _copy_all(self) -> None:
        """One copying thread: take the next file until none is left or a copy failed (the
        first failure stops the others at their next block)."""
        progress = self._progress
        _lower_priority(self.nice)
        try:
            while True:
                with progress.lock:
                    if progress.failure is not None or not progress.pending:
                        break
                    task = progress.pending.pop(0)
                self._copy_with_retries(task)
        except BaseException as exc:  # reported through poll(); the thread never raises
            message = str(exc) if isinstance(exc, DrainError) else f"{type(exc).__name__}: {exc}"
            with progress.lock:
                if progress.failure is None:
                    progress.failure = message
                    self._stop.set()
        finally:
            with progress.lock:
                progress.workers -= 1
                if progress.workers == 0:
                    progress.done = progress.failure is None
                    progress.finished = time.monotonic()

    def _describe(self, task: CopyTask) -> str:
        return f"{self.name} (file {task.path}, node {task.node}, rank {self.coordinator.rank})"

    def _destination(self, task: CopyTask) -> str:
        assert self.plan is not None
        if self._commit is not None and self.store.atomic_rename:
            return self._commit.place(task.path)[2]
        return f"{self.plan.staging}/{task.path}"

    def _copy_with_retries(self, task: CopyTask) -> None:
        """Copy one file; a transient failure is retried under the policy (the partial copy
        removed first), a damaged local file never."""
        first = time.monotonic()
        for attempt in range(1, self.retry.attempts + 1):
            if self._stop.is_set():
                raise DrainError(f"draining stopped (abandoned) at {self._describe(task)}")
            try:
                self._copy_one(task)
                return
            except DrainError:
                raise
            except ShardkeepError as exc:
                wait = self.retry.backoff(attempt) if attempt < self.retry.attempts else None
                if wait is None or not is_transient(exc) or time.monotonic() - first + wait > self.retry.deadline:
                    raise DrainError(f"draining failed at {self._describe(task)}: {exc}") from exc
                logger.warning(
                    "drain: copying %s failed (%s), attempt %d of %d; retrying in %.1f s",
                    self._describe(task),
                    exc,
                    attempt,
                    self.retry.attempts,
                    wait,
                )
                self.store.remove_file(self._destination(task))
                self._stop.wait(wait)

    def _copy_one(self, task: CopyTask) -> None:
        source = self.local.open_read(f"{self.name}/{task.path}")
        try:
            if source.size != task.size:
                raise DrainError(
                    f"draining refused {self._describe(task)}: the local file is {source.size} bytes, "
                    f"the manifest records {task.size} (the local copy is damaged)"
                )
            target = self.store.open_write(self._destination(task))
            try:
                algorithm = (task.digest or "blake3").partition(":")[0]
                try:
                    found = copy_with_digest(
                        source,
                        target,
                        algorithm,
                        block=self.block,
                        stop=self._stop,
                        on_bytes=self._count,
                        decompressed_size=task.decompressed_size,
                    )
                except IntegrityError as exc:
                    raise DrainError(
                        f"draining refused {self._describe(task)}: the local file {exc} (the local copy is damaged)"
                    ) from exc
                if task.digest is not None and not digests_equal(task.digest, found):
                    raise DrainError(
                        f"draining refused {self._describe(task)}: the local file fails its digest "
                        f"(recorded {task.digest}, read {found}; the local copy is damaged)"
                    )
                target.commit()
            except BaseException:
                target.abort()
                raise
        finally:
            source.close()
        _drop_from_page_cache(os.path.join(self.local_root, self.name, task.path))

    def _count(self, nbytes: int) -> None:
        with self._progress.lock:
            self._progress.copied += nbytes

    # -- poll, wait, abandon ---------------------------------------------------------------
    def _report(self) -> tuple[str, str, int, float]:
        progress = self._progress
        with progress.lock:
            kind = "failed" if progress.failure is not None else ("done" if progress.done else "running")
            return kind, progress.failure or "", progress.copied, progress.elapsed()

    def poll(self) -> DrainState:
        """Every rank's state, gathered (collective); commits when every rank is done, aborts
        (removing what the drain wrote) when any failed. Once committed or failed, returns that
        state again without a collective (every rank reached it at the same call)."""
        if self._final is not None:
            return self._final
        self._require_started()
        reports = self.coordinator.all_gather(self._report(), label=f"draining {self.name}: poll")
        copied = sum(report[2] for report in reports)
        seconds = max(report[3] for report in reports)
        failed = [(rank, report[1]) for rank, report in enumerate(reports) if report[0] == "failed"]
        if failed:
            message = "; ".join(f"rank {rank}: {text}" for rank, text in failed)
            return self._fail(DrainError(f"draining {self.name} failed ({message}); nothing was committed"), copied)
        if any(report[0] == "running" for report in reports):
            return DrainState(self.name, "running", copied, seconds)
        outcome = self._committed() if self.coordinator.is_coordinator else None
        outcome = self.coordinator.broadcast(outcome, label=f"draining {self.name}: commit")
        if outcome:
            self._final = DrainState(self.name, "failed", copied, seconds, DrainError(outcome))
        else:
            self._final = DrainState(self.name, "committed", copied, seconds)
            logger.info("drained %s to %s: %d bytes in %.2f s", self.name, self.store.root, copied, seconds)
        return self._final

    def _committed(self) -> str:
        """The coordinator's commit with the local step's sealed manifest (and signature):
        ``""``, or why it failed (after aborting what the drain wrote). Retried after a
        transient failure (:meth:`_commit_once`, :meth:`_with_retries`)."""
        assert self.plan is not None and self._commit is not None
        try:
            self._with_retries("committing", self._commit_once)
        except Exception as exc:  # every rank waits for the outcome: any failure goes to all of them
            if self._commit.sealed is not None and self._commit.committed():
                # Past the commit point (the manifest is ours; a later step failed, or its
                # response was lost): the step is committed, and stays so.
                logger.warning("drain of %s: committed, but the commit then failed (%s)", self.name, exc)
                return ""
            self._abort_quietly()
            return str(exc) if isinstance(exc, DrainError) else f"draining {self.name}: committing failed: {exc}"
        return ""

    def _commit_once(self) -> None:
        """One attempt at the commit. Once an earlier attempt reached the manifest write, it
        first reads the manifest under the final name: this drain's (past the commit point),
        only what follows the commit point is done again (:meth:`_complete_commit`); none, what
        the failed write left at the top of the staging directory is removed and the commit
        runs again; another manifest: the commit refuses it (not retried)."""
        assert self.plan is not None and self._commit is not None
        sealed = read_small(self.local, f"{self.name}/{MANIFEST_FILENAME}", self.limits.max_bytes, DrainError)
        unseal_manifest(sealed)
        if manifest_identity(sealed) != self.plan.manifest_digest:
            raise DrainError(f"draining {self.name}: the local step's manifest changed during the drain")
        signature = None
        if self.local.stat(f"{self.name}/{SIGNATURE_FILENAME}") is not None:
            signature = read_small(self.local, f"{self.name}/{SIGNATURE_FILENAME}", _SMALL_FILE_LIMIT, DrainError)
        if self._commit.sealed is not None:  # an earlier attempt reached the manifest write
            if self._manifest_is(sealed):
                self._complete_commit(signature)
                return
            self._clear_manifest_write()
        for rank, tasks in self.plan.tasks.items():
            for task in tasks:
                if self.store.atomic_rename:
                    self._check_visible(task, rank)
                self._commit.add_data_file(task.path)
        self._commit.commit(sealed, signature)

    def _manifest_is(self, sealed: bytes) -> bool:
        """Whether the manifest under the final name is ``sealed`` (a store error is raised as
        it is, to be retried when transient: the outcome is never guessed)."""
        path = f"{self.name}/{MANIFEST_FILENAME}"
        if self.store.stat(path) is None:
            return False
        return read_small(self.store, path, self.limits.max_bytes, DrainError) == sealed

    def _clear_manifest_write(self) -> None:
        """Before committing again on a store that renames: remove what a failed manifest write
        left at the top of the unpublished staging directory (the signature, the manifest, its
        temporary: every entry that holds no copied file), so that the commit writes them anew."""
        if not self.store.atomic_rename:
            return  # the create-only manifest was not written: nothing of it to remove
        assert self.plan is not None
        kept = {task.path.partition("/")[0] for tasks in self.plan.tasks.values() for task in tasks}
        for entry, _ in self.store.list_dir(self.plan.staging):
            if entry not in kept:
                self.store.remove_file(f"{self.plan.staging}/{entry}")

    def _complete_commit(self, signature: bytes | None) -> None:
        """What follows the commit point, done again after it failed: on a store that renames,
        the fsync of the root that makes the final rename durable; on an object store, the
        signature (written again, replacing any) or, unsigned, the removal of an earlier
        attempt's leftover signature."""
        if self.store.atomic_rename:
            self.store.sync_dir("")
            return
        path = f"{self.name}/{SIGNATURE_FILENAME}"
        if signature is not None:
            self.store.put_atomic(path, signature)
        elif self.store.stat(path) is not None:
            self.store.remove_tree(path)

    def _check_visible(self, task: CopyTask, rank: int) -> None:
        """On a shared filesystem, refuse to commit unless the coordinator sees the file rank
        ``rank`` copied, with its size: a node where the filesystem is not mounted writes into a
        local directory of the same name, and its files would be missing from the commit."""
        info = self.store.stat(self._destination(task))
        if info is None or info.size != task.size:
            found = "nothing" if info is None else f"{info.size} bytes"
            raise DrainError(
                f"draining {self.name}: rank {rank} (node {self.node_of[rank]}) copied {task.path}, but the "
                f"coordinator finds {found} there, not {task.size} bytes: is the persistent level "
                "the same shared filesystem on every node?"
            )

    def _fail(self, error: DrainError, copied: int) -> DrainState:
        """Stop every rank's thread, then (once every rank stopped) abort on the coordinator."""
        seconds = self._stop_thread()
        self.coordinator.all_gather(True, label=f"draining {self.name}: stopped")
        if self.coordinator.is_coordinator:
            self._abort_quietly()
        logger.warning("%s", error)
        self._final = DrainState(self.name, "failed", copied, seconds, error)
        return self._final

    def _stop_thread(self) -> float:
        self._stop.set()
        deadline = time.monotonic() + self.coordinator.timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if any(thread.is_alive() for thread in self._threads):
            logger.warning("drain of %s: a copying thread did not stop within the deadline", self.name)
        return self._progress.elapsed()

    def _abort_quietly(self) -> None:
        """Remove what the drain wrote on the persistent level (never a committed checkpoint:
        the commit's ``abort`` checks); a failure is logged, the leftovers are collected later."""
        if self._commit is None:
            return
        try:
            if self.store.atomic_rename:
                self._commit.abort()
            elif self._commit.committed() is False:
                _clear_object_leftovers(self.store, self.name)
        except ShardkeepError as exc:
            logger.warning(
                "drain of %s: removing its leftovers failed (%s); recover_drains removes them", self.name, exc
            )

    def wait(self, timeout: float | None) -> DrainState:
        """Wait up to ``timeout`` seconds (``None``: without a limit) for this rank's copy, then
        poll once (collective): returns within about ``timeout`` plus one collective,
        committed, failed or running (another rank still copying)."""
        if self._final is not None:
            return self._final
        self._require_started()
        if timeout is None or math.isinf(timeout):
            for thread in self._threads:
                thread.join()
            return self.poll()
        deadline = time.monotonic() + max(0.0, timeout)
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return self.poll()

    def abandon(self) -> DrainState:
        """Stop the copy at the next block on every rank and remove what it wrote (collective);
        the drain's state is then ``failed`` with a :class:`DrainError` saying so."""
        if self._final is not None:
            return self._final
        self._require_started()
        copied = sum(self.coordinator.all_gather(self._report()[2], label=f"draining {self.name}: abandon"))
        return self._fail(DrainError(f"draining {self.name} was abandoned; nothing was committed"), copied)

    def stop(self) -> None:
        """Stop this rank's copying threads at their next block (not collective; for a drain
        whose collectives failed, e.g. a peer died, so that no thread outlives it)."""
        self._stop_thread()

    def abandon_locally(self) -> None:
        """Abandon the drain without a collective (its process group broke): stop this rank's
        copying threads; on the coordinator, remove what the drain wrote, once its own threads
        stopped (a survivor still copying may write a file after that: :func:`recover_drains`
        removes it at the next start). Nothing is committed."""
        if self._final is not None and self._final.state == "committed":
            return
        seconds = self._stop_thread()
        if self.coordinator.is_coordinator:
            self._abort_quietly()
        error = DrainError(f"draining {self.name} was abandoned: the process group broke; nothing was committed")
        self._final = DrainState(self.name, "failed", self._report()[2], seconds, error)

    def state(self) -> DrainState | None:
        """The drain's last agreed state (``None`` while running): local, no collective."""
        return self._final

    def _require_started(self) -> None:
        if self.plan is None:
            raise DrainError(f"draining {self.name}: start() was not called")


def _lower_priority(increment: int) -> None:
    """Lower the calling thread's CPU priority (Linux: a thread is its own scheduling entity);
    best effort."""
    if increment <= 0 or not hasattr(os, "setpriority"):
        return
    with contextlib.suppress(OSError):
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + increment))


def _drop_from_page_cache(path: str) -> None:
    """Tell the kernel the local file's cached pages are not needed again (the drain read them
    once), so a drain does not push training's data out of the page cache; best effort."""
    if not hasattr(os, "posix_fadvise"):
        return
    with contextlib.suppress(OSError):
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)


# -- recovery ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class DrainRecovery:
    """What :func:`recover_drains` found: ``removed``, the leftovers of drains cut off (staging
    directories, or objects under a checkpoint's name without a manifest); ``redrain``, the
    local steps whose drain was cut off and which the persistent level does not hold (drain
    them again from the intact local copy); ``persisted``, the local steps the persistent level
    holds, committed."""

    removed: list[str]
    redrain: list[str]
    persisted: list[str]


def _clear_object_leftovers(store: ByteStore, name: str) -> list[str]:
    """On an object store, remove what a drain of ``name`` left without a manifest: every
    object under ``<name>/`` except ``attempt-*`` prefixes (a direct save's, collected by the
    catalog after its lease), and unfinished uploads there. Nothing when ``name`` is committed."""
    if store.stat(f"{name}/{MANIFEST_FILENAME}") is not None:
        return []
    try:
        entries = store.list_dir(name)
    except CheckpointNotFoundError:
        entries = []
    removed: list[str] = []
    for entry, _ in entries:
        if not entry.startswith(ATTEMPT_PREFIX):
            store.remove_tree(f"{name}/{entry}")
            removed.append(f"{name}/{entry}")
    removed.extend(f"upload:{key}" for key in store.abort_uploads(name))
    return removed


def recover_drains(
    persistent: PersistentLocation,
    local_names: Sequence[str],
    *,
    storage_options: Mapping[str, Any] | None = None,
) -> DrainRecovery:
    """Clean up the drains of ``local_names`` (the committed steps this node's local level
    holds) that a crash cut off, on the persistent level; the coordinator calls it once at
    start, before any drain (not a collective; every staging of these names is this job's and
    stale then). A staging directory is removed through its commit's own ``abort``; on an
    object store, the drain's objects under a name without a manifest. Steps whose drain was
    cut off and that are not committed are reported in ``redrain``."""
    store = _open_persistent(persistent, storage_options)
    removed: list[str] = []
    cut: set[str] = set()
    persisted = [name for name in local_names if store.stat(f"{name}/{MANIFEST_FILENAME}") is not None]
    if store.atomic_rename:
        entries = [entry for entry, _ in store.list_dir("") if STAGING_MARKER in entry]
        for name in local_names:
            for entry in entries:
                if is_sibling_of(entry, name, STAGING_MARKER):
                    CheckpointCommit(store, name, staging=entry).abort()
                    removed.append(entry)
                    cut.add(name)
    else:
        for name in local_names:
            found = _clear_object_leftovers(store, name)
            if found:
                removed.extend(found)
                cut.add(name)
    for entry in removed:
        logger.info("removed the leftover %s of a drain cut off", f"{store.root.rstrip('/')}/{entry}")
    redrain = [name for name in local_names if name in cut and name not in persisted]
    return DrainRecovery(removed=removed, redrain=redrain, persisted=persisted)
