"""One candidate step of a restore (:func:`~shardkeep.levels.restore.restore_best`), on this
rank: its phases, each ending in an agreement, as the :mod:`shardkeep.levels.restore` docstring
describes them (metadata, checking the files, fetching what a node lacks from peers and shared
copies, reading, and the fill), and the :class:`RestoreReport` it yields."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

from shardkeep.config import LoadOptions, ManifestLimits
from shardkeep.distributed.coordinator import Coordinator
from shardkeep.errors import ManifestError, ShardkeepError
from shardkeep.indexes import read_small
from shardkeep.integrity import check_signed_digests, digest_bytes, digests_equal
from shardkeep.io import DigestChoice, check_shard
from shardkeep.levels.copies import (
    LevelView,
    SharedNames,
    StepCopy,
    shared_store,
)
from shardkeep.levels.fetching import PeerFetch
from shardkeep.levels.fingerprints import FingerprintRule, mismatch_error, refuse_disagreement
from shardkeep.levels.parts import NodePart, decode_node_part, encode_node_part, manifest_identity
from shardkeep.levels.phases import NodeLayout, Outcome, RestoreReport, RestoreSettings
from shardkeep.levels.transfer import (
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
)

__all__ = ["StepAttempt", "fetched_alone"]

logger = logging.getLogger("shardkeep")


def fetched_alone(lacking: list[list[tuple[str, int]]], node_of: Sequence[int]) -> bool:
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


# -- one step ---------------------------------------------------------------------------------


class StepAttempt(PeerFetch):
    """One candidate ``(step, identity)`` on this rank: the phases of the module docstring, each
    ending in an all-gather so that every rank runs the same collectives in the same order."""

    def __init__(
        self,
        levels: Sequence[LevelView],
        coordinator: Coordinator,
        nodes: NodeLayout,
        settings: RestoreSettings,
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
        self._checking: Future[tuple[dict[str, str], dict[str, memoryview]]] | None = None
        #: The local files the check passed, by path: their bytes, which the load reads from.
        self.checked: dict[str, memoryview] = {}

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

    def agree(self, label: str, outcome: Outcome) -> list[Outcome] | None:
        """All-gather the ranks' outcomes; ``None`` (and the refusals recorded) when any failed."""
        return self.agreed(self.gather(label, outcome))

    def gather(self, label: str, outcome: Outcome) -> list[Outcome]:
        return self.coordinator.all_gather(outcome, label=f"restore step {self.step}: {label}")

    def agreed(self, everyone: list[Outcome]) -> list[Outcome] | None:
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
            alone = fetched_alone(lacking, self.node_of)
            gathered = self._fetch_round(
                "fetching the files", lacking, healed, first=True, offered=offered, read=alone, names=names
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
            # (the coordinator waits for its listing only once this rank's read is done)
            offer = names.offer if names is not None else (lambda _: None)
            sources = self.agree("reading", self._phase(lambda: (self.read(), offer(self.coordinator))))
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
        everyone: list[Outcome],
        gate: Callable[[int], bool] | None,
        names: SharedNames | None,
        unreachable: dict[str, str] | None,
    ) -> bool:
        """After the check, on every rank alike: a :class:`ConfigError` when the ranks restore
        with different model args or config, a :class:`FingerprintMismatchError` when this
        step's manifest records others (unless a shared level names a newer step, which is
        then looked at first: ``True``, the attempt gated); ``False`` when nothing differs."""
        try:
            refuse_disagreement([each.payload[2] for each in everyone])
        except ShardkeepError:
            with contextlib.suppress(OSError, ShardkeepError):
                self.discard()
            raise
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
        names: SharedNames | None = None,
    ) -> list[Outcome] | None:
        """Fetch what each rank lacks (collective), then agree; ``healed`` gains what arrived.
        Each outcome's payload: the files healed, the reasons of those that could not be, the
        files this rank's digest check found damaged meanwhile (empty after the first round),
        and with ``read``, the level this rank read its files from once every one of them was
        in and checked (``None``: not read), with the coordinator's listing of ``names``."""
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
        offer = names.offer(self.coordinator) if names is not None and read else None
        gathered = self.agree(label, Outcome(fetched.reasons, (*fetched.payload, damaged, source, offer)))
        if gathered is not None and self._refuse_unhealed(lacking, gathered):
            return None
        if gathered is not None:
            healed.extend(
                (rank, file, source) for rank, each in enumerate(gathered) for file, source in each.payload[0]
            )
        return gathered

    def _refuse_unhealed(self, lacking: list[list[tuple[str, int]]], fetched: list[Outcome]) -> bool:
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

    def _phase(self, work: Any, payload: Any = None) -> Outcome:
        """Run this rank's local ``work`` (never a collective): any error becomes this rank's
        reason to refuse the step, so that the ranks still agree instead of waiting on it. The
        outcome's payload: what ``work`` returned, else ``payload``."""
        try:
            result = work()
        except Exception as exc:
            return Outcome([(self.source_level or self._level_name(), f"{type(exc).__name__}: {exc}")], payload)
        if isinstance(result, Outcome):
            return result
        return Outcome(payload=payload if result is None else result)

    def _level_name(self) -> str:
        if self.mode[self.node] in ("local", "rebuild") and self.home is not None:
            return self.home.name
        return self.exact_shared[0].level if self.exact_shared else (self.home.name if self.home else "?")

    # -- phase: metadata ------------------------------------------------------------------------
    def metadata(self) -> Outcome:
        """Place this node's directory of the step, and its manifest and indexes, or say why not.
        Collective: the peer exchanges of metadata run on every rank, whatever failed here."""
        problem = self._phase(self._place)
        self._metadata_from_peers()
        if problem.reasons:
            return problem
        return self._phase(self._locate)

    def _place(self) -> Outcome | None:
        """This rank's part of :meth:`metadata` before the peers' exchanges (no collective)."""
        mode = self.mode[self.node]
        if mode == "none":
            level = self.home.name if self.home is not None else self._level_name()
            reason = "no part on this node and no shared copy of this manifest"
            if self.node in self.foreign:
                reason = "this node's part is another attempt and no shared copy of this manifest exists"
            return Outcome([(level, reason)])
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
        """On the leader of a node holding its part, while some node rebuilds its own: every
        data file this node's ``node-part.json`` says it holds (its own, healed ones and peer
        replicas) that is a file here. They ride on the check's agreement, so that the fetch
        needs no gathering of who holds what when they cover every file the nodes lack
        (:meth:`fetch`); a copy refused on arrival is asked of the next node offering it."""
        if not self.leader or self.mode[self.node] != "local" or "rebuild" not in self.mode.values():
            return []
        assert self.directory is not None
        where = os.path.join(self.directory, NODE_PART_FILENAME)
        try:
            with open(where, "rb") as handle:
                part = decode_node_part(handle.read(1 << 24), where=where)
        except (OSError, ShardkeepError):
            return []  # the fetch gathers who holds what
        return [path for path in sorted(part.holds()) if os.path.isfile(os.path.join(self.directory, path))]

    @staticmethod
    def _check_present(
        job: LoadJob, records: list[FileRecord], fast: bool
    ) -> tuple[dict[str, str], dict[str, memoryview]]:
        """Check the digests of the local files present at their size (the fast ones with
        ``fast``): the problems by path, and the bytes of each file that passed, as the load
        keeps them (a private memory map, or a copy without ``mmap``), so that :meth:`read`
        reads none of them again."""
        problems: dict[str, str] = {}
        kept: dict[str, memoryview] = {}
        chosen: DigestChoice = "fast" if fast else "strong"
        for record in records:
            try:
                store, where = job.resolver(record)
                data, found = check_shard(
                    store, where, record, verify=True, keep=True, use_mmap=job.options.mmap, digest=chosen
                )
            except (OSError, ShardkeepError) as exc:
                data, found = None, [f"{record.path}: {exc}"]
            if found:
                problems[record.path] = found[0].removeprefix(f"{record.path}: ")
            elif data is not None:
                kept[record.path] = data
        return problems, kept

    def damaged(self) -> list[tuple[str, int]]:
        """Wait for the digest check :meth:`check` started: the present files that failed it,
        as ``(path, stored size)`` (their reasons go to ``local_problems``)."""
        if self._checking is None:
            return []
        problems, self.checked = self._checking.result()
        self._checking = None
        self.local_problems.update(problems)
        return [(path, self.needed[path].stored_size) for path in sorted(problems)]

    def _stop_checking(self) -> None:
        if self._checker is not None:
            self._checker.shutdown(wait=True)
            self._checker, self._checking = None, None

    # -- phases: reading, committing, loading ---------------------------------------------------
    def read(self) -> str:
        """Read this rank's files (verified when read from a shared copy; the local ones were
        checked or arrived checked); the level they were read from."""
        assert self.job is not None
        checked, self.checked = self.checked, {}
        self.job.read(checked)
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
