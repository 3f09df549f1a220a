"""Restore from the best copy: the newest step that every rank can complete from some level's
verified files, healing node-local copies on the way, and a report saying per rank and level
where each file came from and why each step was refused.

:func:`restore_best` is a collective of every rank. It runs in this order:

1. **Listing.** Each node's leader lists its node-local parts (``step_<N>`` directories with
   their manifest's identity, :func:`~shardkeep.levels.parts.manifest_identity`, and
   ``node-part.json``); one all-gather. Meanwhile the coordinator lists each shared
   (persistent) level's names only (one listing, no manifest read) on a thread. A level that
   cannot be read is recorded as unreachable with the reason, and the others are used. The
   candidates are the ``(step, manifest identity)`` pairs of every copy, newest step first
   (for one step: the identity a shared level holds first, then the one most nodes hold). A
   node part whose ``manifest_digest`` differs from the candidate's identity is another
   attempt of that step and is never read.

   The node-local candidates are tried first, from node-local copies and peers alone. Before
   one is filled into the state, and after one fails, every rank learns the newest step the
   shared levels name (the coordinator's listing rides on the last agreement before the fill;
   after a failure, one broadcast); a node-local step is loaded only if no shared level
   names a newer one, and older node-local candidates are tried only while they are at least
   as new. Otherwise the coordinator lists the shared levels fully (reading each step's
   manifest), and every candidate is tried in order, a node-local one again only if a shared
   level holds its step. So a restore never resumes at an older step than the newest one some
   level can complete, and a shared level is read only when it names a step at least as new
   as the node-local ones, or the node-local level cannot complete its newest step
   (``RestoreReport.not_consulted`` names the shared levels not read).
2. **Metadata.** A node whose local level has no part of the step gets one rebuilt in a
   staging directory (``step_<N>.tmp-<manifest digest>``): the manifest, its signature and
   every rank index, copied from a shared copy of the same identity or sent by a node holding
   the part (:mod:`.transfer`). A node holding the part replaces a missing or damaged rank
   index from the shared copy. A node whose local directory of that step is another attempt,
   or whose local level cannot be read, reads the shared copy directly. Every manifest is
   checked as a load checks it (signature policy, seal, schema) and must have the candidate's
   identity and step.
3. **Files.** Each rank selects the files it needs with the load machinery
   (:class:`~shardkeep.loading.LoadJob`, resharding included: every node holds every rank
   index) and checks each in its node's directory: present at its size at once, its digest on
   a thread while the missing files are fetched; a file damaged there is healed in a second
   round of fetching. A file missing or damaged there comes, in this order, from: a peer node
   holding it, in its own part or as a replica (sent over the process group; a copy refused on
   arrival is asked of the next node holding the file, in node order; the plan of each
   exchange is known to every rank, so it gathers nothing more), then the shared copy of the
   same step (when its record has the same digest). Who holds what: while some node rebuilds
   its part, each holding node's leader offers the peer replicas its ``node-part.json`` lists
   with the check's outcome; when they cover every file a node lacks, the fetch starts at
   once, else one all-gather asks every holding node which of the lacking files it has. Each
   file arrives checked and is written atomically with identical bytes; the node part records
   it in ``healed``. One rank of a node fetches each file the node lacks.
4. **Agreement.** Each phase ends with an all-gather of every rank's outcome: all ranks go on
   with the step, or all move on to the next candidate (a rebuild's staging is removed), and
   each rank's reasons go to the report as ``(step, rank, level, reason)``: every rank that
   needed a file its node could not heal is named, with the reason per level.
5. **Load.** Each rank reads its files with the ordinary load path (verified when read from a
   shared copy; the local ones were just checked, so they are read without their digests a
   second time) and the ranks agree once more. When no file a node lacks is lacked by two of
   its ranks (each rank fetches what it lacks itself), a rank reads as soon as its own files
   are in and checked, and the fetch's agreement is also the reading's. Then, on a thread
   while every rank fills ``into`` (all or nothing) or returns the state, the node leaders
   record healed files in their ``node-part.json`` (a rebuilt part is renamed into place:
   every rank has read by then; a failure there is logged, never a refusal of the step read),
   and the ranks agree on the fill once that record is done. The files a load mapped are
   unmapped on a background thread meanwhile.

No candidate left: :class:`~shardkeep.errors.NoCompleteStepError` with every refusal.

Limits: only files inside the checkpoint's own directory are healed (a tier with its own
location or an incremental reference is read where the manifest says); the first node-local
level listed is the one healed; rank indexes
are healed from a shared copy only; each rank checks the local files it needs itself, so a
file several ranks of a node need is read once by each.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from shardkeep.config import LoadOptions, ManifestLimits
from shardkeep.distributed.coordinator import Coordinator
from shardkeep.errors import ManifestError, NoCompleteStepError, ShardkeepError
from shardkeep.indexes import read_small
from shardkeep.integrity import SignaturePolicy, check_signed_digests, digest_bytes, digests_equal
from shardkeep.io import DigestChoice, check_shard
from shardkeep.levels.copies import (
    LevelView,
    SharedNames,
    StepCopy,
    candidates,
    gather_copies,
    gather_shared,
    newest_named,
    shared_store,
)
from shardkeep.levels.fingerprints import FingerprintRule, mismatch_error, refuse_disagreement
from shardkeep.levels.parts import NodePart, decode_node_part, encode_node_part, manifest_identity
from shardkeep.levels.transfer import (
    DEFAULT_BLOCK_BYTES,
    WIRE_BLOCK_BYTES,
    FileReceive,
    FileSend,
    copy_file,
    run_exchange,
)
from shardkeep.loading import LoadJob
from shardkeep.manifest import FileRecord, IndexedManifest, Manifest
from shardkeep.names import (
    INDEX_DIRECTORY,
    MANIFEST_FILENAME,
    NODE_PART_FILENAME,
    SIGNATURE_FILENAME,
    STAGING_MARKER,
    checkpoint_name,
    sibling_name,
)
from shardkeep.storage import ByteStore, LocalStore
from shardkeep.storage.localfs import current as local_fs
from shardkeep.verification import (
    CheckpointLocation,
    authenticate,
    parse_manifest,
    read_checked_manifest,
)

__all__ = ["LevelView", "NodeLayout", "RestoreReport", "StepCopy", "restore_best"]

logger = logging.getLogger("shardkeep")


class NodeLayout(Protocol):
    """Which node each rank is on (``node_of[rank]``), as :func:`levels.nodes.node_map` gives."""

    @property
    def node_of(self) -> tuple[int, ...]: ...


@dataclass
class RestoreReport:
    """What a restore did, the same on every rank.

    ``step``: the step restored. ``source``: per rank, the level it loaded from. ``healed``:
    ``(rank, file, source)`` for each file copied into a node-local directory, ``source`` being
    a shared level's name or ``"<level>@node<N>"`` for a peer node's copy. ``refused``:
    ``(step, rank, level, reason)`` for each copy of a newer step (or of this one) that could
    not be used. ``levels_read``: the levels any byte was read from. ``unreachable``: the
    levels that could not be listed, with the reason. ``not_consulted``: the shared levels whose
    copies were not read (only their step names were listed: none newer than the node-local
    step restored), with the reason. ``run_id``: the run that saved the step
    (``None`` when its manifest records none); ``metrics``: its recorded metrics.
    ``newest_local_step``: the newest step of which any node holds a directory on the first
    node-local level, as listed (``-1``: none; ``None``: unknown, some node could not be
    listed, or no node-local level)."""

    step: int
    source: dict[int, str] = field(default_factory=dict)
    healed: list[tuple[int, str, str]] = field(default_factory=list)
    refused: list[tuple[int, int, str, str]] = field(default_factory=list)
    levels_read: list[str] = field(default_factory=list)
    unreachable: dict[str, str] = field(default_factory=dict)
    not_consulted: dict[str, str] = field(default_factory=dict)
    run_id: str | None = None
    metrics: dict[str, float | None] = field(default_factory=dict)
    newest_local_step: int | None = None


@dataclass(frozen=True)
class _Settings:
    signatures: SignaturePolicy
    limits: ManifestLimits | None
    block_bytes: int
    io_threads: int
    fingerprint: FingerprintRule

    @property
    def wire_bytes(self) -> int:
        """Bytes per block sent between ranks: at most ``block_bytes``, and small enough to stay
        in the CPU's cache (:data:`~shardkeep.levels.transfer.WIRE_BLOCK_BYTES`)."""
        return min(self.block_bytes, WIRE_BLOCK_BYTES)

    @property
    def fast(self) -> bool:
        """Whether data files are checked with their fast digest (where the manifest records
        one): as a load does, unless a public key asks for the cryptographic digests."""
        return self.signatures.public_key is None


def restore_best(
    levels: Sequence[LevelView],
    into: Any,
    coordinator: Coordinator,
    nodes: NodeLayout,
    *,
    signatures: SignaturePolicy | None = None,
    limits: ManifestLimits | None = None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    io_threads: int = LoadOptions.io_threads,
    fingerprint: FingerprintRule | None = None,
) -> tuple[Any, RestoreReport]:
    """Load the newest step every rank can complete from ``levels`` (collective; see the module
    docstring). Returns the loaded state (``into``, filled, when given) and the report; raises
    :class:`~shardkeep.errors.NoCompleteStepError` naming every refusal when no step is left.
    ``fingerprint``: this rank's model args and config to check each step against
    (:mod:`~shardkeep.levels.fingerprints`): the first step whose manifest records others
    raises :class:`~shardkeep.errors.FingerprintMismatchError` on every rank."""
    if len(nodes.node_of) != coordinator.world_size:
        raise ShardkeepError(f"the node map covers {len(nodes.node_of)} ranks, the group has {coordinator.world_size}")
    settings = _Settings(
        signatures or SignaturePolicy(), limits, block_bytes, io_threads, fingerprint or FingerprintRule()
    )
    shared = [view for view in levels if not view.node_local and view.root is not None]
    with ThreadPoolExecutor(1, thread_name_prefix="shardkeep-restore-listing") as pool:
        # The coordinator lists the shared levels' names on a thread while the node-local
        # candidates are gathered and tried; the answer is waited for before a fill, or when
        # a node-local candidate fails.
        listing = pool.submit(newest_named, shared) if coordinator.is_coordinator and shared else None
        names = SharedNames(listing, bool(shared))
        copies, unreachable, unusable, newest_dirs = gather_copies(levels, coordinator, nodes, settings.limits)
        home = next((view.name for view in levels if view.node_local), None)
        newest_local = newest_dirs.get(home) if home is not None else None
        refused: list[tuple[int, int, str, str]] = []
        tried: set[tuple[int, str]] = set()
        for step, identity in candidates(copies):
            newest = names.newest(coordinator, unreachable) if tried else None
            if newest is not None and step < newest:
                break
            outcome, gated = _attempt(
                levels, coordinator, nodes, settings, copies, step, identity, unusable, refused, into,
                gate=lambda step: names.allows(step, coordinator, unreachable), names=names, unreachable=unreachable,
            )  # fmt: skip
            if gated:
                break  # a shared level names a newer step: list it
            tried.add((step, identity))
            if outcome is not None:
                state, report = outcome
                report.refused, report.unreachable = refused, unreachable
                report.not_consulted = _not_consulted(names.named, step, coordinator.is_coordinator)
                report.newest_local_step = newest_local
                return state, report
            newest = names.newest(coordinator, unreachable)
            if coordinator.is_coordinator and (newest is None or step > newest):
                _log_lost(step, refused)
        if names.newest(coordinator, unreachable) is not None:
            listed, failed = gather_shared(levels, coordinator, settings.limits, names.named)
            copies = copies + listed
            unreachable.update(failed)
    shared_steps = {copy.step for copy in copies if copy.node is None}
    for step, identity in candidates(copies):
        if (step, identity) in tried:
            if step not in shared_steps:
                continue  # refused above, and no shared level holds this step
            refused[:] = [entry for entry in refused if entry[0] != step]  # tried again, with the shared copies
        outcome, _ = _attempt(levels, coordinator, nodes, settings, copies, step, identity, unusable, refused, into)
        if outcome is not None:
            state, report = outcome
            report.refused, report.unreachable = refused, unreachable
            report.newest_local_step = newest_local
            return state, report
        if coordinator.is_coordinator:
            _log_lost(step, refused)
    text = "; ".join(f"step {step}, rank {rank}, level {level}: {reason}" for step, rank, level, reason in refused)
    where = ", ".join(f"{name} unreachable ({why})" for name, why in unreachable.items())
    raise NoCompleteStepError(
        "no step can be completed from any level" + (f" ({where})" if where else "") + (f": {text}" if text else ""),
        refused,
    )


def _attempt(
    levels: Sequence[LevelView],
    coordinator: Coordinator,
    nodes: NodeLayout,
    settings: _Settings,
    copies: list[StepCopy],
    step: int,
    identity: str,
    unusable: set[tuple[str, int]],
    refused: list[tuple[int, int, str, str]],
    into: Any,
    gate: Callable[[int], bool] | None = None,
    names: SharedNames | None = None,
    unreachable: dict[str, str] | None = None,
) -> tuple[tuple[Any, RestoreReport] | None, bool]:
    """Try one candidate (collective); its refusals are added to ``refused``. Returns the
    outcome, and whether ``gate`` (asked, collectively, before the state is filled) stopped it.
    ``names``, not yet known: learned with the last agreement before the fill (no collective
    of its own), failures added to ``unreachable``."""
    newer_failed = any(entry[0] > step for entry in refused)
    attempt = _StepAttempt(levels, coordinator, nodes, settings, copies, step, identity, unusable, newer_failed)
    outcome = attempt.run(into, gate, names, unreachable)
    refused.extend(entry for entry in attempt.refused if entry not in refused)
    return outcome, attempt.gated


def _fetched_alone(lacking: list[list[tuple[str, int]]], node_of: Sequence[int]) -> bool:
    """Whether each file a node lacks is lacked by one of its ranks only: each rank then
    fetches every file it lacks itself (no node-mate fetches one for it)."""
    seen: set[tuple[int, str]] = set()
    for rank, files in enumerate(lacking):
        for path, _ in files:
            if (node_of[rank], path) in seen:
                return False
            seen.add((node_of[rank], path))
    return True


_released: queue.SimpleQueue[Any] = queue.SimpleQueue()
_releaser: threading.Thread | None = None
_releaser_lock = threading.Lock()


def _release_later(item: Any) -> None:
    """Drop ``item`` (a load's file buffers, once filled into the caller's tensors) on a
    background thread: unmapping the files a load mapped takes milliseconds per 64 MiB, which
    the caller then spends waiting in the next agreement instead. Buffers the returned state
    still uses stay mapped (they are only unreferenced here)."""
    global _releaser
    with _releaser_lock:
        if _releaser is None or not _releaser.is_alive():  # (a forked child has no thread yet)
            _releaser = threading.Thread(target=_release_forever, name="shardkeep-release", daemon=True)
            _releaser.start()
    _released.put(item)


def _release_forever() -> None:
    while True:
        item = _released.get()
        del item


def _log_lost(step: int, refused: list[tuple[int, int, str, str]]) -> None:
    reasons = sorted({f"{level}: {reason}" for refused_step, _, level, reason in refused if refused_step == step})
    logger.warning(
        "restore: step %d is lost: no copy completes it (%s); trying an older step",
        step, "; ".join(reasons[:4]) + (f"; and {len(reasons) - 4} more" if len(reasons) > 4 else ""),
    )  # fmt: skip


def _not_consulted(named: Mapping[str, int | None], restored: int, coordinator: bool) -> dict[str, str]:
    """The shared levels whose copies a restore of node-local step ``restored`` did not read:
    only their step names were listed, and none is newer."""
    found: dict[str, str] = {}
    for name, newest in named.items():
        holds = "no step" if newest is None else f"step {newest} at the newest"
        found[name] = f"not read: its listing names {holds}, and step {restored} was complete on the node-local level"
        if coordinator:
            logger.info("restore: level %s was not read (%s)", name, found[name])
    return found


# -- one step ---------------------------------------------------------------------------------


@dataclass
class _Outcome:
    """One rank's outcome of a phase, as gathered: ``reasons`` per level when it failed."""

    reasons: list[tuple[str, str]] = field(default_factory=list)
    payload: Any = None


class _StepAttempt:
    """One candidate ``(step, identity)`` on this rank: the phases of the module docstring, each
    ending in an all-gather so that every rank runs the same collectives in the same order."""

    def __init__(
        self,
        levels: Sequence[LevelView],
        coordinator: Coordinator,
        nodes: NodeLayout,
        settings: _Settings,
        copies: list[StepCopy],
        step: int,
        identity: str,
        unusable: set[tuple[str, int]],
        newer_failed: bool = False,
    ) -> None:
        self.coordinator, self.settings, self.step, self.identity = coordinator, settings, step, identity
        self.rank = coordinator.rank
        self.node_of = nodes.node_of
        self.node = self.node_of[self.rank]
        self.node_ranks = [r for r, n in enumerate(self.node_of) if n == self.node]
        self.leader = self.rank == self.node_ranks[0]
        self.refused: list[tuple[int, int, str, str]] = []
        #: Whether the gate of :meth:`run` stopped this attempt before the fill.
        self.gated = False
        #: Whether a newer candidate was refused before this one (said when this one's
        #: fingerprint differs).
        self.newer_failed = newer_failed
        #: How this step's recorded fingerprint differs from this rank's (:meth:`check`).
        self.differences: list[tuple[str, str, str]] | None = None
        self.views = {view.name: view for view in levels}
        home = next((view for view in levels if view.node_local), None)
        self.home = home
        of_step = [copy for copy in copies if copy.step == step]
        self.exact_shared = [c for c in of_step if c.node is None and c.identity == identity]
        self.other_shared = [c for c in of_step if c.node is None and c.identity != identity]
        self.holders: dict[int, StepCopy] = {}
        self.foreign: dict[int, StepCopy] = {}
        for copy in of_step:
            if copy.node is None or home is None or copy.level != home.name:
                continue
            if copy.identity == identity and copy.problem is None:
                self.holders.setdefault(copy.node, copy)
            else:
                self.foreign.setdefault(copy.node, copy)
        shared_first = self.exact_shared[0] if self.exact_shared else None
        #: A copy of this manifest whose listing gives its size, signature, attempt and run.
        self.template: StepCopy | None = next(iter(self.holders.values()), shared_first)
        #: ``(node-local level, node)`` pairs the listing could not read.
        self.unusable = unusable
        self.mode = {node: self._mode_of(node) for node in sorted(set(self.node_of))}
        self.directory: str | None = None  # this node's local directory of the step (or its staging)
        self.location: CheckpointLocation | None = None
        self.source_level = ""
        self.job: LoadJob | None = None
        #: The files this rank's load needs inside the checkpoint's directory, by path.
        self.needed: dict[str, FileRecord] = {}
        #: Why each lacking file's local copy was refused.
        self.local_problems: dict[str, str] = {}
        self.other_records: dict[tuple[str, str], dict[str, FileRecord]] = {}
        #: Rank indexes this (leader) rank replaced, with their source.
        self.healed_metadata: list[tuple[str, str]] = []
        self.stores: dict[str, ByteStore] = {}
        #: The digest check of the present local files, running while the missing ones arrive.
        self._checker: ThreadPoolExecutor | None = None
        self._checking: Future[dict[str, str]] | None = None

    def _mode_of(self, node: int) -> str:
        """``local`` (the node holds the part), ``rebuild`` (its local level has nothing of the
        step), ``shared`` (read the shared copy directly: no usable local level, or its
        directory of the step is another attempt) or ``none`` (no way to this step). The same
        on every rank: it depends on the listing only."""
        home = self.home
        if home is not None and node in self.holders:
            return "local"
        usable_home = home is not None and node not in self.foreign and (home.name, node) not in self.unusable
        if usable_home and (self.exact_shared or self.holders):
            return "rebuild"
        return "shared" if self.exact_shared else "none"

    def refuse(self, rank: int, level: str, reason: str) -> None:
        if (self.step, rank, level, reason) not in self.refused:
            self.refused.append((self.step, rank, level, reason))

    def agree(self, label: str, outcome: _Outcome) -> list[_Outcome] | None:
        """All-gather the ranks' outcomes; ``None`` (and the refusals recorded) when any failed."""
        return self.agreed(self.gather(label, outcome))

    def gather(self, label: str, outcome: _Outcome) -> list[_Outcome]:
        return self.coordinator.all_gather(outcome, label=f"restore step {self.step}: {label}")

    def agreed(self, everyone: list[_Outcome]) -> list[_Outcome] | None:
        """The gathered outcomes when every rank succeeded; else ``None``, the refusals recorded."""
        if all(not each.reasons for each in everyone):
            return everyone
        for rank, each in enumerate(everyone):
            for level, reason in each.reasons:
                self.refuse(rank, level, reason)
        return None

    def run(
        self,
        into: Any,
        gate: Callable[[int], bool] | None = None,
        names: SharedNames | None = None,
        unreachable: dict[str, str] | None = None,
    ) -> tuple[Any, RestoreReport] | None:
        self._refuse_foreign_parts()
        try:
            return self._run(into, gate, names, unreachable)
        finally:
            self._stop_checking()

    def _run(
        self,
        into: Any,
        gate: Callable[[int], bool] | None,
        names: SharedNames | None,
        unreachable: dict[str, str] | None,
    ) -> tuple[Any, RestoreReport] | None:
        gathered = self.agree("metadata", self.metadata())
        if gathered is not None:
            checked = self._phase(lambda: self.check(into))
            if checked.reasons:  # the verdict on the manifest still counts (a changed model may not load)
                checked.payload = ([], [], self.settings.fingerprint, self.differences)
            everyone = self.gather("checking the files", checked)
            if self._judge_fingerprints(everyone, gate, names, unreachable):
                self.gated = True  # a shared level names a newer step: it is looked at first
                with contextlib.suppress(OSError, ShardkeepError):
                    self.discard()
                return None
            gathered = self.agreed(everyone)
        healed: list[tuple[int, str, str]] = []
        read: list[tuple[str, Any]] | None = None  # each rank's source level, and the listing offered
        if gathered is not None:
            lacking = [each.payload[0] for each in gathered]
            offered = [each.payload[1] for each in gathered]
            # When no rank needs a file a node-mate fetches, each rank reads once its own files
            # are in: the fetch's agreement is then also the reading's.
            alone = _fetched_alone(lacking, self.node_of)
            offer = names.offer(self.coordinator) if names is not None and alone else None
            gathered = self._fetch_round(
                "fetching the files", lacking, healed, first=True, offered=offered, read=alone, offer=offer
            )
            if gathered is not None and all(each.payload[3] is not None for each in gathered):
                read = [(each.payload[3], each.payload[4]) for each in gathered]
        if gathered is not None and read is None and any(each.payload[2] for each in gathered):
            # A local file present at its size failed its digest (found while the missing files
            # were fetched): every node heals its damaged files in a second round.
            gathered = self._fetch_round(
                "fetching the damaged files", [each.payload[2] for each in gathered], healed, first=False
            )
        if gathered is not None and read is None:
            # The coordinator's outcome carries the shared levels' listing (the gate's answer).
            offer = names.offer(self.coordinator) if names is not None else None
            sources = self.agree("reading", self._phase(lambda: (self.read(), offer)))
            read = [each.payload for each in sources] if sources is not None else None
        if read is not None:
            # Every rank has read: a rebuilt part may move. Its leader records it on a thread
            # while the state is filled (the files read are mapped already).
            recording = threading.Thread(
                target=self.finalize_quietly, args=(healed,), name="shardkeep-restore-record", daemon=True
            )
            recording.start()
            try:
                if names is not None:
                    names.learn(read[0][1], unreachable)
                if gate is not None and not gate(self.step):
                    self.gated = True  # not refused: the healed part stays, a newer step is looked for
                    return None
                return self._loaded(healed, [source for source, _ in read], recording)
            finally:
                recording.join()
        with contextlib.suppress(OSError, ShardkeepError):
            self.discard()
        return None

    def _judge_fingerprints(
        self,
        everyone: list[_Outcome],
        gate: Callable[[int], bool] | None,
        names: SharedNames | None,
        unreachable: dict[str, str] | None,
    ) -> bool:
        """After the check, on every rank alike: a :class:`ConfigError` when the ranks restore
        with different model args or config, a :class:`FingerprintMismatchError` when this
        step's manifest records others (unless a shared level names a newer step, which is
        then looked at first: ``True``, the attempt gated); ``False`` when nothing differs."""
        refuse_disagreement([each.payload[2] for each in everyone])
        differences = next((each.payload[3] for each in everyone if each.payload[3]), None)
        if differences is None:
            return False
        if gate is not None and not gate(self.step):
            return True
        with contextlib.suppress(OSError, ShardkeepError):
            self.discard()
        levels = [self.home.name] if self.home is not None and self.holders else []
        levels += [copy.level for copy in self.exact_shared if copy.level not in levels]
        if names is not None and names.known:
            levels += sorted(name for name, newest in names.named.items() if newest == self.step and name not in levels)
        why = ", and no newer step can be completed" if self.newer_failed else ""
        raise mismatch_error(self.step, levels, differences, why)

    def _fetch_round(
        self,
        label: str,
        lacking: list[list[tuple[str, int]]],
        healed: list[tuple[int, str, str]],
        *,
        first: bool,
        offered: list[list[str]] | None = None,
        read: bool = False,
        offer: Any = None,
    ) -> list[_Outcome] | None:
        """Fetch what each rank lacks (collective), then agree; ``healed`` gains what arrived.
        Each outcome's payload: the files healed, the reasons of those that could not be, the
        files this rank's digest check found damaged meanwhile (empty after the first round),
        and with ``read``, the level this rank read its files from once every one of them was
        in and checked (``None``: not read), with ``offer``."""
        fetched = self.fetch(lacking, with_metadata=first, offered=offered)
        try:
            damaged = self.damaged()
        except Exception as exc:  # the check itself failed: this rank refuses the step
            fetched.reasons.append((self._level_name(), f"checking the local files: {type(exc).__name__}: {exc}"))
            damaged = []
        source = None
        if read and not fetched.reasons and not fetched.payload[1] and not damaged:
            done = self._phase(self.read)
            fetched.reasons.extend(done.reasons)
            source = done.payload if not done.reasons else None
        gathered = self.agree(label, _Outcome(fetched.reasons, (*fetched.payload, damaged, source, offer)))
        if gathered is not None and self._refuse_unhealed(lacking, gathered):
            return None
        if gathered is not None:
            healed.extend(
                (rank, file, source) for rank, each in enumerate(gathered) for file, source in each.payload[0]
            )
        return gathered

    def _refuse_unhealed(self, lacking: list[list[tuple[str, int]]], fetched: list[_Outcome]) -> bool:
        """Refuse the step for every rank that lacks a file its node could not heal (with the
        reasons its node's fetching rank found); whether any did."""
        fetcher: dict[tuple[int, str], int] = {}
        for rank, files in enumerate(lacking):
            for path, _ in files:
                fetcher.setdefault((self.node_of[rank], path), rank)
        refused = False
        for rank, files in enumerate(lacking):
            for path, _ in files:
                for level, reason in fetched[fetcher[(self.node_of[rank], path)]].payload[1].get(path, []):
                    self.refuse(rank, level, reason)
                    refused = True
        return refused

    def _loaded(
        self, healed: list[tuple[int, str, str]], sources: list[str], recording: threading.Thread
    ) -> tuple[Any, RestoreReport]:
        assert self.job is not None
        report = RestoreReport(self.step, dict(enumerate(sources)), healed)
        report.levels_read = sorted({*sources, *(source.partition("@")[0] for _, _, source in healed)})
        manifest = self.job.manifest
        report.run_id = manifest.run.run_id if manifest.run is not None else None
        report.metrics = dict(manifest.metrics)
        job = self.job
        filled: list[Any] = []

        def fill() -> None:
            filled.append(job.fill(job.assemble()))
            buffers, job.buffers = job.buffers, []
            _release_later(buffers)  # unmapped while this rank waits for the others
            recording.join()  # the healed part is recorded before the ranks agree

        # One agreement after the fill: a rank whose fill fails (a value that does not fit
        # into=) fails the restore on every rank, instead of the others returning success.
        self.coordinator.step(f"restore step {self.step}: fill", fill)
        return filled[0], report

    def _refuse_foreign_parts(self) -> None:
        """The same on every rank: the listing is everyone's."""
        for node, copy in sorted(self.foreign.items()):
            reason = copy.problem or f"another attempt of this step (manifest {copy.identity})"
            self.refuse(self.node_of.index(node), copy.level, f"node {node}'s part is not used: {reason}")

    def _phase(self, work: Any, payload: Any = None) -> _Outcome:
        """Run this rank's local ``work`` (never a collective): any error becomes this rank's
        reason to refuse the step, so that the ranks still agree instead of waiting on it. The
        outcome's payload: what ``work`` returned, else ``payload``."""
        try:
            result = work()
        except Exception as exc:
            return _Outcome([(self.source_level or self._level_name(), f"{type(exc).__name__}: {exc}")], payload)
        if isinstance(result, _Outcome):
            return result
        return _Outcome(payload=payload if result is None else result)

    def _level_name(self) -> str:
        if self.mode[self.node] in ("local", "rebuild") and self.home is not None:
            return self.home.name
        return self.exact_shared[0].level if self.exact_shared else (self.home.name if self.home else "?")

    # -- phase: metadata ------------------------------------------------------------------------
    def metadata(self) -> _Outcome:
        """Place this node's directory of the step, and its manifest and indexes, or say why not.
        Collective: the peer exchanges of metadata run on every rank, whatever failed here."""
        problem = self._phase(self._place)
        self._metadata_from_peers()
        if problem.reasons:
            return problem
        return self._phase(self._locate)

    def _place(self) -> _Outcome | None:
        """This rank's part of :meth:`metadata` before the peers' exchanges (no collective)."""
        mode = self.mode[self.node]
        if mode == "none":
            level = self.home.name if self.home is not None else self._level_name()
            reason = "no part on this node and no shared copy of this manifest"
            if self.node in self.foreign:
                reason = "this node's part is another attempt and no shared copy of this manifest exists"
            return _Outcome([(level, reason)])
        if mode == "shared":
            self.source_level = self.exact_shared[0].level
            return None
        assert self.home is not None and self.home.root is not None
        self.source_level = self.home.name
        if mode == "local":
            self.directory = os.path.join(self.home.root, self.holders[self.node].name)
            if self.leader and self.exact_shared:
                self._heal_indexes()
            return None
        # A rebuild: its staging is named after the manifest, so that every rank of the node agrees.
        tail = self.identity.partition(":")[2][:32]
        self.directory = os.path.join(self.home.root, sibling_name(checkpoint_name(self.step), STAGING_MARKER, tail))
        if self.leader:
            local_fs().remove_tree(self.directory)  # a rebuild of this manifest cut short
            local_fs().makedirs_durable(self.directory)
            if self.exact_shared:
                self._metadata_from_shared()
        return None

    def _heal_indexes(self) -> None:
        """Check this node's rank indexes (small files) and replace a missing or damaged one
        with the shared copy's (same manifest, so the same digest)."""
        assert self.directory is not None
        parent, name = os.path.split(self.directory)
        manifest = self._parse(CheckpointLocation(LocalStore(parent), name))
        copy = self.exact_shared[0]
        for record in self._metadata_records(manifest):
            if record.path in (MANIFEST_FILENAME, SIGNATURE_FILENAME):
                continue
            where = os.path.join(self.directory, record.path)
            try:
                with open(where, "rb") as file:
                    data = file.read(record.size + 1)
                if (
                    len(data) == record.size
                    and record.digest is not None
                    and digests_equal(record.digest, digest_bytes(record.digest.partition(":")[0], data))
                ):
                    continue
            except OSError:
                pass
            copy_file((self._store(copy.level), f"{copy.name}/{record.path}"), where, record)
            self.healed_metadata.append((record.path, copy.level))

    def _store(self, level: str) -> ByteStore:
        """A shared level's store, opened once."""
        if level not in self.stores:
            self.stores[level] = shared_store(self.views[level])
        return self.stores[level]

    def _locate(self) -> None:
        if self.directory is not None:
            parent, name = os.path.split(self.directory)
            self.location = CheckpointLocation(LocalStore(parent), name)
        else:
            copy = self.exact_shared[0]
            self.location = CheckpointLocation(self._store(copy.level), copy.name)

    def _metadata_records(self, manifest: Manifest | None) -> list[FileRecord]:
        """The manifest, its signature and (given the parsed manifest) the rank indexes as records."""
        template = self.template
        assert template is not None
        records = [FileRecord(path=MANIFEST_FILENAME, rank=0, size=template.manifest_size, digest=self.identity)]
        if template.signature is not None:
            size, digest = template.signature
            records.append(FileRecord(path=SIGNATURE_FILENAME, rank=0, size=size, digest=digest))
        if isinstance(manifest, IndexedManifest):
            records.extend(
                FileRecord(path=index.path, rank=index.rank, size=index.size, digest=index.digest)
                for index in manifest.index_records()
            )
        return records

    def _metadata_from_shared(self) -> None:
        copy = self.exact_shared[0]
        store = self._store(copy.level)
        assert self.directory is not None
        head = self._metadata_records(None)
        for record in head:
            copy_file((store, f"{copy.name}/{record.path}"), os.path.join(self.directory, record.path), record)
        manifest = self._parse(CheckpointLocation(store, copy.name))
        for record in self._metadata_records(manifest)[len(head) :]:
            copy_file(
                (store, f"{copy.name}/{record.path}"), os.path.join(self.directory, record.path), record,
                block_bytes=self.settings.block_bytes,
            )  # fmt: skip

    def _metadata_from_peers(self) -> None:
        """Nodes rebuilding without a shared copy get the metadata from the lowest holder node's
        leader: the manifest and signature first, then the indexes it lists (two exchanges)."""
        needing = [node for node, mode in self.mode.items() if mode == "rebuild" and not self.exact_shared]
        if not needing or not self.holders:
            return
        sender_node = min(self.holders)
        sender = self.node_of.index(sender_node)
        receivers = {node: self.node_of.index(node) for node in needing}
        own_manifest: Manifest | None = None
        if self.rank == sender and self.home is not None and self.home.root is not None:
            parent = self.home.root
            with contextlib.suppress(ShardkeepError, OSError):
                own_manifest = self._parse(CheckpointLocation(LocalStore(parent), self.holders[sender_node].name))
        for with_indexes in (False, True):
            sends: list[FileSend] = []
            receives: list[FileReceive] = []
            if self.rank == sender and self.home is not None and self.home.root is not None:
                source = os.path.join(self.home.root, self.holders[sender_node].name)
                head = len(self._metadata_records(None))
                records = self._metadata_records(own_manifest)
                chosen = records[head:] if with_indexes else records[:head]
                sends = [FileSend(rank, os.path.join(source, r.path), r) for rank in receivers.values() for r in chosen]
            if self.rank in receivers.values() and self.directory is not None:
                head = len(self._metadata_records(None))
                manifest = None
                if with_indexes:
                    with contextlib.suppress(ShardkeepError, OSError):
                        parent, name = os.path.split(self.directory)
                        manifest = self._parse(CheckpointLocation(LocalStore(parent), name))
                records = self._metadata_records(manifest)
                chosen = records[head:] if with_indexes else records[:head]
                receives = [FileReceive(sender, os.path.join(self.directory, r.path), r) for r in chosen]
            pairs = [(sender, receiver) for receiver in receivers.values()]
            run_exchange(self.coordinator.group, sends, receives, block_bytes=self.settings.wire_bytes, pairs=pairs)

    def _parse(self, location: CheckpointLocation) -> Manifest:
        """The manifest at ``location`` (a committed directory or a rebuild's staging), checked
        like a load checks it (signature policy, seal, schema), with this candidate's identity
        and step."""
        limits = self.settings.limits
        path = f"{location.name}/{MANIFEST_FILENAME}"
        sealed = read_small(location.store, path, (limits or ManifestLimits()).max_bytes, ManifestError)
        if manifest_identity(sealed) != self.identity:
            raise ShardkeepError(f"{location}: the manifest is not {self.identity} (changed since it was listed)")
        policy = self.settings.signatures
        status = authenticate(location, sealed, policy) if policy.public_key is not None else None
        manifest = parse_manifest(sealed, where=str(location), limits=limits)
        if status is not None and status.verified:
            check_signed_digests(manifest, sealed)
        if manifest.step is not None and manifest.step != self.step:
            raise ShardkeepError(f"{location}: the manifest says step {manifest.step}, not {self.step}")
        return manifest

    # -- phase: which files, and checking them ---------------------------------------------------
    def check(self, into: Any) -> tuple[list[tuple[str, int]], list[str], FingerprintRule, Any]:
        """Build this rank's load job, select the files it needs, and check the local copies of
        them: the files this rank lacks, as ``(path, stored size)``, the replicas this node
        offers to the nodes rebuilding their part (:meth:`_replicas_offered`), this rank's
        fingerprint rule, and how the manifest's recorded fingerprint differs from it."""
        assert self.location is not None
        manifest = self._parse(self.location)
        rule = self.settings.fingerprint
        self.differences = differences = rule.differences(manifest)
        if differences:
            return [], [], rule, differences  # refused on every rank after the agreement
        shared = self.mode[self.node] == "shared"
        digest: Literal["fast", "cryptographic"] = "fast" if self.settings.fast else "cryptographic"
        options = LoadOptions(verify=shared, io_threads=self.settings.io_threads, digest=digest if shared else None)
        view = self.views.get(self.source_level)
        self.job = job = LoadJob(
            self.location, manifest, options, into=into, tiers=None, sections=None, tier_locations=None,
            storage_options=view.storage_options if view is not None else None, lazy=False, progress=False,
            limits=self.settings.limits,
        )  # fmt: skip
        job.select()
        for record, wanted in zip(job.manifest.files, job.needed, strict=True):
            if wanted != [] and job.resolver.own_directory(record):
                self.needed[record.path] = record
        if shared:
            return [], [], rule, differences  # read, and verified, by the load
        lacking: list[tuple[str, int]] = []
        present: list[FileRecord] = []
        for path, record in sorted(self.needed.items()):
            if self.directory is not None:
                try:
                    size = os.stat(os.path.join(self.directory, path), follow_symlinks=False).st_size
                except FileNotFoundError:
                    self.local_problems[path] = "missing"
                    lacking.append((path, record.stored_size))
                    continue
                except OSError:
                    size = None  # the full check below says why
                if size is not None and size != record.stored_size:
                    self.local_problems[path] = f"size is {size} bytes, manifest says {record.stored_size}"
                    lacking.append((path, record.stored_size))
                    continue
            present.append(record)
        if present:
            # Digests are checked on a thread while the missing files are fetched.
            self._checker = ThreadPoolExecutor(1, thread_name_prefix="shardkeep-restore-check")
            self._checking = self._checker.submit(self._check_present, job, present, self.settings.fast)
        return lacking, self._replicas_offered(), rule, differences

    def _replicas_offered(self) -> list[str]:
        """On the leader of a node holding its part, while some node rebuilds its own: the peer
        replicas this node holds (its ``node-part.json``), present here. They ride on the
        check's agreement, so that the fetch needs no gathering of who holds what when they
        cover every file the nodes lack (:meth:`fetch`)."""
        if not self.leader or self.mode[self.node] != "local" or "rebuild" not in self.mode.values():
            return []
        assert self.directory is not None
        where = os.path.join(self.directory, NODE_PART_FILENAME)
        try:
            with open(where, "rb") as handle:
                part = decode_node_part(handle.read(1 << 24), where=where)
        except (OSError, ShardkeepError):
            return []  # the fetch gathers who holds what
        paths = sorted({path for paths in part.replicas.values() for path in paths})
        return [path for path in paths if os.path.isfile(os.path.join(self.directory, path))]

    @staticmethod
    def _check_present(job: LoadJob, records: list[FileRecord], fast: bool) -> dict[str, str]:
        """Check the digests of the local files present at their size (the fast ones with
        ``fast``): the problems by path."""
        problems: dict[str, str] = {}
        chosen: DigestChoice = "fast" if fast else "strong"
        for record in records:
            try:
                store, where = job.resolver(record)
                _, found = check_shard(store, where, record, verify=True, keep=False, digest=chosen)
            except (OSError, ShardkeepError) as exc:
                found = [f"{record.path}: {exc}"]
            if found:
                problems[record.path] = found[0].removeprefix(f"{record.path}: ")
        return problems

    def damaged(self) -> list[tuple[str, int]]:
        """Wait for the digest check :meth:`check` started: the present files that failed it,
        as ``(path, stored size)`` (their reasons go to ``local_problems``)."""
        if self._checking is None:
            return []
        problems = self._checking.result()
        self._checking = None
        self.local_problems.update(problems)
        return [(path, self.needed[path].stored_size) for path in sorted(problems)]

    def _stop_checking(self) -> None:
        if self._checker is not None:
            self._checker.shutdown(wait=True)
            self._checker, self._checking = None, None

    # -- phase: fetching what a node lacks ------------------------------------------------------
    def fetch(
        self,
        lacking: list[list[tuple[str, int]]],
        *,
        with_metadata: bool = True,
        offered: list[list[str]] | None = None,
    ) -> _Outcome:
        """Heal what this node lacks: each file by the node's lowest rank lacking it, from a
        peer node holding it (its own part or a replica), else from a shared copy. Collective
        (the peers' exchanges on every rank, whatever happens here, after one all-gather of who
        holds what unless ``offered``, each rank's replicas offered with the check, covers every
        file a node lacks). The payload: the files healed with their source, and for each file
        that could not be, the reasons per level."""
        claims: list[dict[str, int]] = [{} for _ in lacking]
        claimed: set[tuple[int, str]] = set()
        for rank, files in enumerate(lacking):
            for path, size in files:
                key = (self.node_of[rank], path)
                if key not in claimed:
                    claimed.add(key)
                    claims[rank][path] = size
        healed: list[tuple[str, str]] = list(self.healed_metadata) if with_metadata else []
        still = sorted(claims[self.rank].items())
        holders = self._offered_holders(claimed, offered) if offered is not None else None
        if holders is None:
            offers = self._offers(claimed, lacking) if self.leader and self.mode[self.node] == "local" else []
            everyone = self.coordinator.all_gather((still, offers), label=f"restore step {self.step}: who holds what")
            holders = {}
            for rank, (_, offer) in enumerate(everyone):
                for path in offer:
                    holders.setdefault(path, []).append(self.node_of[rank])
        pending = [(rank, path, size) for rank, mine in enumerate(claims) for path, size in sorted(mine.items())]
        peer_reasons: dict[str, str] = {}
        for path, _ in still:
            if not [node for node in holders.get(path, []) if node != self.node]:
                peer_reasons[path] = "no other node holds it"
        turns = max((len([n for n in holders.get(p, []) if n != self.node_of[r]]) for r, p, _ in pending), default=0)
        received: set[str] = set()
        for turn in range(turns):
            written = self._from_peers(pending, holders, turn, healed, peer_reasons)
            received.update(written)
            if turn + 1 < turns:  # who still lacks what, for the next turn's holders
                done = self.coordinator.all_gather(written, label=f"restore step {self.step}: files sent by peers")
                pending = [(rank, path, size) for rank, path, size in pending if path not in done[rank]]
        failed: dict[str, list[tuple[str, str]]] = {}
        home = self.home.name if self.home is not None else "?"
        for path, _ in still:
            if path in received:
                continue
            source, shared_reasons = self._from_shared(self.needed[path])
            if source is not None:
                healed.append((path, source))
                continue
            local = self.local_problems.get(path, "missing")
            why = peer_reasons.get(path, "no other node sent it")
            failed[path] = [(home, f"{path}: {local} on node {self.node}; {why}"), *shared_reasons]
        return _Outcome(payload=(healed, failed))

    def _from_shared(self, record: FileRecord) -> tuple[str | None, list[tuple[str, str]]]:
        """Copy ``record``'s file from a shared copy of this step whose record of it has the
        same digest: the level it came from, or ``None`` and why each shared level could not."""
        assert self.directory is not None
        destination = os.path.join(self.directory, record.path)
        reasons: list[tuple[str, str]] = []
        for copy in [*self.exact_shared, *self.other_shared]:
            try:
                store = self._store(copy.level)
                if copy.identity != self.identity:
                    theirs = self._shared_record(store, copy, record.path)
                    if theirs is None or theirs.digest != record.digest or theirs.stored_size != record.stored_size:
                        reasons.append((copy.level, f"{record.path}: step {self.step} there is another attempt"))
                        continue
                copy_file(
                    (store, f"{copy.name}/{record.path}"), destination, record,
                    block_bytes=self.settings.block_bytes, fast=self.settings.fast,
                )  # fmt: skip
            except (OSError, ShardkeepError) as exc:
                reasons.append((copy.level, f"{record.path}: {exc}"))
                continue
            return copy.level, []
        shared_levels = [view.name for view in self.views.values() if not view.node_local]
        listed = {copy.level for copy in [*self.exact_shared, *self.other_shared]}
        reasons.extend((name, f"no copy of step {self.step}") for name in shared_levels if name not in listed)
        return None, reasons

    def _shared_record(self, store: ByteStore, copy: StepCopy, path: str) -> FileRecord | None:
        """The record of ``path`` in another attempt's manifest on a shared level (read once)."""
        key = (copy.level, copy.name)
        if key not in self.other_records:
            location = CheckpointLocation(store, copy.name)
            manifest = read_checked_manifest(location, self.settings.signatures, self.settings.limits, expand=True)
            self.other_records[key] = {record.path: record for record in manifest.files}
        return self.other_records[key].get(path)

    def _offers(self, claimed: set[tuple[int, str]], lacking: list[list[tuple[str, int]]]) -> list[str]:
        """Which of the files other nodes lack this (holding) node has, at the right size."""
        assert self.directory is not None
        sizes = {path: size for files in lacking for path, size in files}
        offered: list[str] = []
        for node, path in sorted(claimed):
            if node == self.node or path in offered:
                continue
            with contextlib.suppress(OSError):
                info = os.stat(os.path.join(self.directory, path), follow_symlinks=False)
                if info.st_size == sizes[path] and os.path.isfile(os.path.join(self.directory, path)):
                    offered.append(path)
        return offered

    def _offered_holders(self, claimed: set[tuple[int, str]], offered: list[list[str]]) -> dict[str, list[int]] | None:
        """The nodes holding each file, from the replicas offered with the check, when some
        other node offers every ``(node, path)`` claimed; else ``None`` (gather who holds what).
        The same on every rank: both were gathered."""
        holders: dict[str, list[int]] = {}
        for rank, paths in enumerate(offered):
            for path in paths:
                holders.setdefault(path, []).append(self.node_of[rank])
        if all(any(node != lacking for node in holders.get(path, [])) for lacking, path in claimed):
            return holders
        return None

    def _from_peers(
        self,
        pending: list[tuple[int, str, int]],
        holders: dict[str, list[int]],
        turn: int,
        healed: list[tuple[str, str]],
        reasons: dict[str, str],
    ) -> list[str]:
        """One exchange of the files nodes still lack: each request goes to the ``turn``-th
        other node offering the file (in node order), served by that node's ranks in turn; the
        same plan on every rank. Collective. Returns the paths this rank received; adds them
        to ``healed`` and the refusals to ``reasons``."""
        sends: list[FileSend] = []
        receives: list[FileReceive] = []
        pairs: set[tuple[int, int]] = set()
        for count, (rank, path, size) in enumerate(pending):
            servers = sorted(node for node in holders.get(path, []) if node != self.node_of[rank])
            if turn >= len(servers):
                continue
            ranks = [r for r, n in enumerate(self.node_of) if n == servers[turn]]
            server = ranks[count % len(ranks)]
            pairs.add((server, rank))
            if server == self.rank and self.directory is not None:
                record = FileRecord(path=path, rank=0, size=size, digest=None)
                sends.append(FileSend(rank, os.path.join(self.directory, path), record))
            if rank == self.rank and self.directory is not None:
                receives.append(FileReceive(server, os.path.join(self.directory, path), self.needed[path]))
        exchange = run_exchange(
            self.coordinator.group, sends, receives,
            block_bytes=self.settings.wire_bytes, pairs=sorted(pairs), fast=self.settings.fast,
        )  # fmt: skip
        home = self.home.name if self.home is not None else "?"
        received: list[str] = []
        for receive in receives:
            path, destination = receive.record.path, os.fspath(receive.destination)
            if destination in exchange.written:
                received.append(path)
                healed.append((path, f"{home}@node{self.node_of[receive.peer]}"))
                reasons.pop(path, None)
        for path, source, reason in [*exchange.refused, *exchange.failed]:
            said = f"node {self.node_of[source]} (rank {source}): {reason}"
            reasons[path] = f"{reasons[path]}; {said}" if path in reasons else said
        return received

    # -- phases: reading, committing, loading ---------------------------------------------------
    def read(self) -> str:
        """Read this rank's files (verified when read from a shared copy; the local ones were
        checked or arrived checked); the level they were read from."""
        assert self.job is not None
        self.job.read()
        return self.source_level

    def finalize_quietly(self, healed: list[tuple[int, str, str]]) -> None:
        """:meth:`finalize`, once every rank has read (no collective): a failure is logged, and
        the step is still restored from the bytes read (the healed files stay where they are;
        a rebuilt part left in its staging directory is rebuilt again by the next restore)."""
        try:
            self.finalize(healed)
        except (OSError, ShardkeepError) as exc:
            logger.warning(
                "restore: node %d could not record the files it healed for step %d (%s: %s)",
                self.node, self.step, type(exc).__name__, exc,
            )  # fmt: skip

    def finalize(self, healed: list[tuple[int, str, str]]) -> None:
        """The node leader records the node's healed files in its part, or renames a rebuilt
        part into place with its ``node-part.json``."""
        if not self.leader or self.directory is None or self.home is None or self.home.root is None:
            return
        metadata = (MANIFEST_FILENAME, SIGNATURE_FILENAME, INDEX_DIRECTORY)
        files = sorted({f for rank, f, _ in healed if self.node_of[rank] == self.node and not f.startswith(metadata)})
        fs = local_fs()
        mode = self.mode[self.node]
        if mode == "local" and files:
            where = os.path.join(self.directory, NODE_PART_FILENAME)
            with open(where, "rb") as handle:
                part = decode_node_part(handle.read(1 << 24), where=where)
            part.healed = sorted(set(part.healed) | (set(files) - set(part.files)))
            fs.write_file_atomic(where, encode_node_part(part))
        elif mode == "rebuild":
            template = self.template
            part = NodePart(
                node=self.node, nodes=len(set(self.node_of)), ranks=self.node_ranks, world_size=len(self.node_of),
                files=[], attempt=(template.attempt if template else None) or "restored",
                manifest_digest=self.identity, run_id=template.run_id if template else None, healed=files,
            )  # fmt: skip
            fs.write_file_atomic(os.path.join(self.directory, NODE_PART_FILENAME), encode_node_part(part))
            final = os.path.join(self.home.root, checkpoint_name(self.step))
            if os.path.lexists(final):
                # This node's old directory of the step is unusable (another attempt's part, or
                # no readable manifest): it gives way to the part rebuilt from verified copies.
                logger.warning(
                    "restore: replacing %s, which cannot serve step %d, by the rebuilt part", final, self.step
                )
                fs.retire_and_remove(final)
            fs.rename_noreplace(self.directory, final)
            fs.fsync_directory(self.home.root)
            self.directory = final

    def discard(self) -> None:
        """After a refused step: remove a rebuilt part's staging directory (healed files in an
        existing part stay: they are the step's own bytes)."""
        if self.leader and self.mode[self.node] == "rebuild" and self.directory is not None:
            local_fs().remove_tree(self.directory)
