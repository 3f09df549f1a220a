"""The node-local save: one step written to every node's local root, each node holding its own
ranks' data files, committed only when every node's part is durable.

On each node, ``<node root>/step_<N>/`` holds the sealed ``manifest.json`` (and
``manifest.sig``; the same bytes on every node), every rank index of format 2.x (all of them,
on every node, so any node can plan any load), the data files of that node's ranks only, and
``node-part.json`` (:class:`~shardkeep.levels.parts.NodePart`: which node, which ranks and
files, the attempt id and the digest of the sealed manifest). Copying every node's directory
into one gives an ordinary checkpoint (``node-part.json`` aside).

The protocol, driven by :func:`save_node_local` on every rank (collectives on the caller's
thread):

1. the coordinator picks the attempt id (a fresh staging name ``step_<N>.tmp-<id>``, as
   :class:`~shardkeep.distributed.commit.FilesystemCommit` names it); every node leader (the
   lowest rank of a node) refuses if ``step_<N>`` is committed on its node
   (:class:`~shardkeep.errors.CheckpointExistsError` on every rank: a committed step is never
   overwritten, as with :class:`~shardkeep.CheckpointManager`), then creates the staging
   directory, exclusively, and fsyncs the root (a staging directory already there means two
   nodes share one root: :class:`~shardkeep.errors.LevelConfigError` on every rank);
2. every rank writes its data files and its index into its own node's staging directory,
   each file fsynced, and sends its records and index bytes to the coordinator;
3. the coordinator builds, checks, seals and signs the manifest exactly as a save does
   (:class:`~shardkeep.saving.job.SaveJob`'s finish), without publishing it anywhere, and
   broadcasts the sealed bytes, the signature, every index and each node's file list;
4. every node leader writes the indexes its node lacks and ``node-part.json`` into its
   staging directory, fsyncs the data directories, writes the signature and the manifest
   (temporary name, fsync, rename), renames the staging directory to ``step_<N>`` and fsyncs
   the root (the steps of ``FilesystemCommit.commit``, on the node's store);
5. every rank learns every node's outcome (one all-gather). The step is *local-committed* only
   when every node renamed. On any failure every node leader removes this attempt's staging
   directory, and its ``step_<N>`` when that holds this attempt's manifest bytes (renamed
   aside first, so a half-removed tree never looks committed); never another attempt's.

Crash windows and what a later scan (:mod:`shardkeep.levels.local_catalog`) sees on a node:

- before that node's rename: only ``step_<N>.tmp-<id>`` (state ``staging``, with its age);
  it is never read as a step, and ``collect_leftovers`` removes it after the lease;
- after some nodes renamed, before the others did: those nodes hold a committed part whose
  ``manifest_digest`` names this attempt, the others a staging directory or nothing. The step
  is incomplete: a restore heals the missing parts from the persistent level or a peer with
  the same manifest digest, or falls back to an older step;
- after a node's rename, before its root's fsync: on power loss the rename may be lost (back
  to the staging directory) or kept (complete: every file below it was fsynced first);
- after every node renamed, before the outcome all-gather: every node holds the step, which is
  complete although no rank returned from the save;
- after the all-gather: committed on every node.

Supported: plain and format 2.x states, one or several ranks per node, signed saves. Not
supported (refused): tiers with a location of their own and incremental saves. An async
node-local save is not provided: the save blocks until step 5.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from shardkeep.distributed.commit import FilesystemCommit
from shardkeep.distributed.coordinator import Coordinator
from shardkeep.errors import CheckpointExistsError, LevelConfigError, StorageError, UnsupportedValueError
from shardkeep.indexes import encode_index
from shardkeep.integrity import digest_bytes, load_private_key
from shardkeep.levels.nodes import NodeMap
from shardkeep.levels.parts import NodePart, encode_node_part, manifest_identity
from shardkeep.manifest import FileRecord, IndexRecord, Manifest, index_path
from shardkeep.names import NODE_PART_FILENAME, STAGING_MARKER, check_name_length
from shardkeep.progress import collector_paused
from shardkeep.saving.job import SaveJob, ensure_directory
from shardkeep.saving.manifest_build import indexed_version
from shardkeep.saving.settings import SaveSettings
from shardkeep.saving.wire import RankReport, encode_report
from shardkeep.storage import LocalStore, adapt_store, local_path, write_new
from shardkeep.storage.localfs import current as current_fs
from shardkeep.storage.localfs import fsync_directory_path, retire_and_remove, storage_error
from shardkeep.verification import CheckpointLocation
from shardkeep.writes import ABANDONED

__all__ = ["NodeLocalSaveJob", "Sealed", "attempt_of", "node_location", "save_node_local"]

logger = logging.getLogger(__name__)

#: This node's root: a path, or a function of the node id.
NodeRoot = str | os.PathLike[str] | Callable[[int], "str | os.PathLike[str]"]


def attempt_of(staging: str) -> str:
    """The attempt id at the end of a staging name ``step_<N>.tmp-<id>``."""
    return staging.rpartition(STAGING_MARKER)[2]


@dataclass(frozen=True)
class Sealed:
    """What the coordinator broadcasts once the manifest is sealed: its bytes, its signature,
    every rank index (path -> (rank, bytes)) and each node's data files; ``manifest`` is the decoded
    manifest every rank returns."""

    manifest_bytes: bytes
    signature: bytes | None
    indexes: dict[str, tuple[int, bytes]]
    files_of_node: dict[int, list[str]]
    manifest: Manifest


class _SealingCommit(FilesystemCommit):
    """The coordinator's commit object in a node-local save: everything a save does up to the
    commit, where it keeps the sealed bytes and the signature instead of publishing them (each
    node leader publishes its own part)."""

    captured: tuple[bytes, bytes | None] | None = None

    def commit(self, manifest_bytes: bytes, signature: bytes | None = None) -> None:
        self.captured = (manifest_bytes, signature)


class NodeLocalSaveJob(SaveJob):
    """A :class:`~shardkeep.saving.job.SaveJob` whose files go to each rank's own node's
    store (``location.store``), staged under one attempt id on every node and published by
    each node leader (see the module docstring). Every rank builds one with its own node's
    location."""

    def __init__(
        self,
        state: Mapping[str, Any],
        location: CheckpointLocation,
        settings: SaveSettings,
        coordinator: Coordinator,
        nodes: NodeMap,
    ) -> None:
        if settings.incremental is not False:
            raise UnsupportedValueError("a node-local save cannot be incremental; pass incremental=False")
        if any(tier.location is not None for tier in settings.tiers or ()):
            raise UnsupportedValueError("a node-local save keeps every file on the node: tiers cannot have locations")
        if nodes.world_size != coordinator.world_size:
            raise UnsupportedValueError(
                f"the node map covers {nodes.world_size} ranks, the process group {coordinator.world_size}"
            )
        if not location.store.atomic_rename:
            raise UnsupportedValueError(f"a node-local level needs a local filesystem, not {location.store.root!r}")
        super().__init__(state, location, settings, coordinator)
        self.nodes = nodes
        self.node = nodes.node_of[coordinator.rank]
        self.leader = nodes.is_leader(coordinator.rank)
        self.staging = ""
        #: This rank's index (path -> bytes).
        self.index_bytes: dict[str, bytes] = {}
        #: On the coordinator: every rank's index (path -> (rank, bytes)).
        self.indexes: dict[str, tuple[int, bytes]] = {}
        #: On the coordinator: the data files each rank wrote.
        self.files_of_rank: dict[int, list[str]] = {}
        #: On a node leader, once it publishes: the commit that renamed (or tried to).
        self.published: FilesystemCommit | None = None
        self.opened = False

    # -- step 1 --------------------------------------------------------------------------------
    def prepare(self, digests: list[str] | None = None, described: list[Any] | None = None) -> None:
        coordinator = self.coordinator
        fresh = (
            FilesystemCommit(self.location.store, self.location.name).staging if coordinator.is_coordinator else None
        )
        self.staging = coordinator.broadcast(fresh, label="choose the node-local attempt")
        refusals = coordinator.step("open the node-local staging", self._open_staging)
        for refusal in refusals:
            if refusal is not None:
                kind, message = refusal
                raise (CheckpointExistsError if kind == "exists" else LevelConfigError)(message)
        super().prepare(digests, described)

    def _open_staging(self) -> tuple[str, str] | None:
        """On a node leader: refuse a committed step on this node, or a root another node
        shares (returned as (kind, message), so that every rank raises the same
        :class:`CheckpointExistsError` or :class:`LevelConfigError`); else create the staging
        directory, exclusively: the attempt id is fresh, so a staging directory already there
        was made by another node's leader in the same root."""
        if not self.leader:
            return None
        store = self.location.store
        with self._writes_refused_named():
            ensure_directory(store.root)
            try:
                FilesystemCommit(store, self.location.name, self.staging).begin()
            except CheckpointExistsError as exc:
                return "exists", f"node {self.node}: {exc}"
            try:
                current_fs().mkdir(os.path.join(store.root, self.staging))
            except FileExistsError:
                return "shared", (
                    f"node {self.node}: another node saves into the same node-local root {store.root!r} (a shared "
                    "filesystem?): give each node a root of its own"
                )
            except OSError as exc:
                raise storage_error("creating", self.staging, exc) from exc
            self.opened = True
            fsync_directory_path(store.root)
        return None

    def _begin(self) -> str | None:
        if not self.coordinator.is_coordinator:
            return None
        if self.settings.signer is not None:
            self.private_key = load_private_key(self.settings.signer)  # only the coordinator signs
        return self.staging

    def _commit_for(self, staging: str | None) -> FilesystemCommit:
        return _SealingCommit(self.location.store, self.location.name, staging)

    # -- step 2 --------------------------------------------------------------------------------
    def _write_index(self, files: list[FileRecord]) -> IndexRecord:
        assert self.commit is not None
        rank = self.coordinator.rank
        data = encode_index(rank, files, indexed_version(self.options.block_size))
        recorded, store, where = self.commit.place(index_path(rank))
        write_new(store, where, data)
        self.index_bytes[recorded] = data
        return IndexRecord(rank=rank, path=recorded, size=len(data), digest=digest_bytes(self.options.digest, data))

    def node_payload(self) -> tuple[bytes, dict[str, bytes], list[str]]:
        """Write this rank's files and index; return its report (as bytes), its index bytes and
        the paths of the data files it wrote."""
        report = encode_report(self.report())
        return report, dict(self.index_bytes), [plan.record.path for plan in self.plans]

    def read_node_payloads(self, payloads: list[tuple[bytes, dict[str, bytes], list[str]]]) -> list[RankReport]:
        """On the coordinator: every rank's :meth:`node_payload`."""
        for rank, (_, indexes, written) in enumerate(payloads):
            self.indexes.update((path, (rank, data)) for path, data in indexes.items())
            self.files_of_rank[rank] = written
        return self.read_payloads([report for report, _, _ in payloads])

    # -- step 3 --------------------------------------------------------------------------------
    def seal(self, reports: list[RankReport]) -> Sealed:
        """On the coordinator: the save's finish, sealed and signed but not published."""
        manifest = self.finish(reports)
        assert manifest is not None and isinstance(self.commit, _SealingCommit) and self.commit.captured is not None
        sealed, signature = self.commit.captured
        files_of_node: dict[int, list[str]] = {node: [] for node in self.nodes.nodes}
        for rank, written in self.files_of_rank.items():
            files_of_node[self.nodes.node_of[rank]].extend(written)
        return Sealed(sealed, signature, dict(self.indexes), files_of_node, manifest)

    # -- step 4 --------------------------------------------------------------------------------
    def publish(self, sealed: Sealed) -> None:
        """On a node leader: complete this node's staging directory and rename it to the step's
        name (nothing on the other ranks). A rank whose writes were stopped (its
        :class:`~shardkeep.writes.WriteControl`, e.g. by a second preemption signal) refuses
        instead, so that every node removes this attempt (step 5)."""
        if self.control.stopped():
            raise StorageError(f"node {self.node}, rank {self.coordinator.rank}: {ABANDONED} before its commit")
        if not self.leader:
            return
        store = self.location.store
        commit = FilesystemCommit(store, self.location.name, self.staging)
        self.published = commit
        with self._writes_refused_named():
            for path, (rank, data) in sorted(sealed.indexes.items()):
                if self.nodes.node_of[rank] != self.node:  # another node's rank wrote it there
                    write_new(store, f"{self.staging}/{path}", data)
                commit.add_data_file(path)
            files = sorted(sealed.files_of_node.get(self.node, []))
            for path in files:
                commit.add_data_file(path)
            run = self.settings.run
            part = NodePart(
                node=self.node,
                nodes=self.nodes.node_count,
                ranks=list(self.nodes.ranks_of(self.node)),
                world_size=self.nodes.world_size,
                files=files,
                attempt=attempt_of(self.staging),
                manifest_digest=manifest_identity(sealed.manifest_bytes),
                run_id=run.run_id if run is not None else None,
            )
            write_new(store, f"{self.staging}/{NODE_PART_FILENAME}", encode_node_part(part))
            commit.commit(sealed.manifest_bytes, sealed.signature)

    # -- step 5: failure -----------------------------------------------------------------------
    def abort(self) -> None:
        """On a node leader: remove this attempt's staging directory, and ``step_<N>`` when it
        holds this attempt's manifest (never another attempt's)."""
        if not self.leader or not self.opened:
            return
        store = self.location.store
        first: BaseException | None = None
        if self.published is not None and self.published.committed() is True:
            try:
                retire_and_remove(os.path.join(store.root, self.location.name))
            except Exception as exc:
                first = exc
        try:
            store.remove_tree(self.staging)
        except Exception as exc:
            first = first or exc
        if first is not None:
            raise first


def node_location(root: NodeRoot, name: str, node: int, settings: SaveSettings) -> CheckpointLocation:
    """Where ``name`` goes on ``node``: under ``root`` (a path, or a function of the node
    id), or in ``settings.storage`` when one is given (a store rooted at this node's root)."""
    check_name_length(name, "checkpoint name")
    if settings.storage is not None:
        return CheckpointLocation(adapt_store(settings.storage), name)
    path = local_path(os.fspath(root(node) if callable(root) else root))
    if path is None:
        raise UnsupportedValueError(f"a node-local root must be a local path, not {root!r}")
    return CheckpointLocation(LocalStore(path), name)


def save_node_local(
    state: Mapping[str, Any],
    root: NodeRoot,
    name: str,
    settings: SaveSettings,
    coordinator: Coordinator,
    nodes: NodeMap,
) -> Manifest:
    """Save ``state`` as step ``name`` of a node-local level (collective: every rank calls it).

    ``root`` is this node's root, or a function of the node id giving each node's;
    ``settings.storage``, when given, replaces it with a store rooted there (fault injection).
    Returns the manifest on every rank once every node committed; on any failure every rank
    raises the same error and no node keeps anything of this attempt (see the module
    docstring for the protocol and its crash windows)."""
    node = nodes.node_of[coordinator.rank]
    job = NodeLocalSaveJob(state, node_location(root, name, node, settings), settings, coordinator, nodes)
    try:
        with collector_paused():
            job.prepare()
        if coordinator.distributed:
            payloads = coordinator.step_to_coordinator("write the node-local shards", job.node_payload)
        else:
            payloads = [job.node_payload()]

        def seal() -> Sealed:
            assert payloads is not None
            return job.seal(job.read_node_payloads(payloads))

        sealed = coordinator.on_coordinator("seal the node-local manifest", seal)
        coordinator.step("commit the node-local parts", lambda: job.publish(sealed))
    except BaseException:
        try:
            job.abort()
        except Exception as exc:  # the save's own error matters more; the leftover is collected later
            logger.warning("could not remove the node-local attempt %s: %s", job.staging, exc)
        raise
    return sealed.manifest
