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

import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shardkeep.config import LoadOptions, ManifestLimits
from shardkeep.distributed.coordinator import Coordinator
from shardkeep.errors import NoCompleteStepError, ShardkeepError
from shardkeep.integrity import SignaturePolicy
from shardkeep.levels.attempt import StepAttempt
from shardkeep.levels.copies import (
    LevelView,
    SharedNames,
    StepCopy,
    candidates,
    gather_copies,
    gather_shared,
    newest_named,
)
from shardkeep.levels.fingerprints import FingerprintRule
from shardkeep.levels.phases import NodeLayout, RestoreReport, RestoreSettings
from shardkeep.levels.transfer import (
    DEFAULT_BLOCK_BYTES,
)

__all__ = ["LevelView", "NodeLayout", "RestoreReport", "StepCopy", "restore_best"]

logger = logging.getLogger("shardkeep")


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
    settings = RestoreSettings(
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
    settings: RestoreSettings,
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
    attempt = StepAttempt(levels, coordinator, nodes, settings, copies, step, identity, unusable, newer_failed)
    outcome = attempt.run(into, gate, names, unreachable)
    refused.extend(entry for entry in attempt.refused if entry not in refused)
    return outcome, attempt.gated


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
