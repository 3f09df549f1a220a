"""The copies a restore chooses from (see :mod:`shardkeep.levels.restore`): each node's
node-local parts, each shared level's names (one listing, on the coordinator's thread) and,
when needed, its committed copies, and the candidate ``(step, manifest identity)`` pairs, best
first."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from shardkeep.config import ManifestLimits
from shardkeep.distributed.coordinator import Coordinator
from shardkeep.errors import ShardkeepError
from shardkeep.integrity import digest_bytes
from shardkeep.levels.parts import decode_node_part, manifest_identity
from shardkeep.names import NODE_PART_FILENAME, SIGNATURE_FILENAME, step_of_name
from shardkeep.storage import ByteStore, LocalStore, local_path, open_store
from shardkeep.verification import CheckpointLocation, read_manifest_bytes

__all__ = [
    "LevelView",
    "SharedNames",
    "StepCopy",
    "candidates",
    "gather_copies",
    "gather_shared",
    "list_node_parts",
    "list_shared",
    "newest_named",
    "newest_step_directory",
    "shared_store",
    "signature_of",
]

logger = logging.getLogger("shardkeep")

#: Bytes a signature file may have.
_MAX_SIGNATURE_BYTES = 1 << 16


class _Nodes(Protocol):
    @property
    def node_of(self) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class LevelView:
    """One level as a restore sees it from this rank: its ``name``; ``root``, this node's local
    root for a ``node_local`` level, else the shared root (a path or URL); ``None`` when this
    node has no root for it. ``store``: a shared level's store already open on ``root``, to
    list and read it through (else one is opened)."""

    name: str
    root: str | None
    node_local: bool = False
    storage_options: Mapping[str, Any] | None = None
    store: ByteStore | None = None


@dataclass(frozen=True)
class StepCopy:
    """One copy of a step found by the listing: on a shared level (``node`` is ``None``) or one
    node's part on a node-local level. ``problem`` is set when the part cannot serve its own
    manifest (no readable ``node-part.json``, or one recording another manifest)."""

    level: str
    node: int | None
    name: str
    step: int
    identity: str
    manifest_size: int
    signature: tuple[int, str] | None = None
    attempt: str | None = None
    run_id: str | None = None
    problem: str | None = None


class SharedNames:
    """The newest step each shared level's listing names, listed by the coordinator on a thread
    and learned by every rank on first use (one broadcast, at the same point on every rank)."""

    def __init__(self, listing: Future[tuple[dict[str, int | None], dict[str, str]]] | None, any_shared: bool) -> None:
        self.listing = listing
        self.any_shared = any_shared
        self.named: dict[str, int | None] = {}
        self.known = not any_shared

    def newest(self, coordinator: Coordinator, unreachable: dict[str, str]) -> int | None:
        """The newest step any shared level names (collective on first use); a level that could
        not be listed is added to ``unreachable``."""
        if not self.known:
            self.learn(
                coordinator.broadcast(self.offer(coordinator), label="the shared levels' newest steps"), unreachable
            )
        return max((step for step in self.named.values() if step is not None), default=None)

    def offer(self, coordinator: Coordinator) -> tuple[dict[str, int | None], dict[str, str]] | None:
        """The coordinator's listing (waited for) while no rank knows it, to carry to every rank
        in a collective that runs anyway; ``None`` elsewhere and once known."""
        if self.known or not coordinator.is_coordinator:
            return None
        return self.listing.result() if self.listing is not None else ({}, {})

    def learn(
        self, listing: tuple[dict[str, int | None], dict[str, str]] | None, unreachable: dict[str, str] | None
    ) -> None:
        """Take the coordinator's :meth:`offer` (``None``: nothing offered, nothing learned); a
        level that could not be listed is added to ``unreachable``."""
        if self.known or listing is None:
            return
        self.named, failed = listing
        self.known = True
        for name, why in failed.items():
            logger.warning("restore: level %s is unreachable: %s", name, why)
            if unreachable is not None:
                unreachable[name] = f"{unreachable[name]}; {why}" if name in unreachable else why

    def allows(self, step: int, coordinator: Coordinator, unreachable: dict[str, str]) -> bool:
        """Whether node-local step ``step`` may be loaded: no shared level names a newer one."""
        newest = self.newest(coordinator, unreachable)
        return newest is None or newest <= step


def gather_copies(
    levels: Sequence[LevelView], coordinator: Coordinator, nodes: _Nodes, limits: ManifestLimits | None
) -> tuple[list[StepCopy], dict[str, str], set[tuple[str, int]], dict[str, int | None]]:
    """Every copy of every step on every node-local level, the unreachable levels with the
    reasons, the ``(node-local level, node)`` pairs that could not be read, and per node-local
    level the newest step any node holds a directory of (readable or not; ``-1``: none;
    ``None``: unknown, a node could not be listed). One all-gather."""
    node = nodes.node_of[coordinator.rank]
    leader = coordinator.rank == min(r for r, n in enumerate(nodes.node_of) if n == node)
    mine: list[StepCopy] = []
    unreachable: dict[str, str] = {}
    newest: dict[str, int] = {}
    for view in levels:
        if view.node_local and leader and view.root is None:
            unreachable[view.name] = f"node {node}: no local root"
        elif view.node_local and leader and view.root is not None:
            try:
                mine.extend(list_node_parts(view, node, limits))
                newest[view.name] = newest_step_directory(view.root)
            except (OSError, ShardkeepError) as exc:
                unreachable[view.name] = f"node {node}: {exc}"
    gathered = coordinator.all_gather((mine, unreachable, newest), label="listing the node-local copies")
    copies = [copy for listed, _, _ in gathered for copy in listed]
    merged: dict[str, str] = {}
    unusable: set[tuple[str, int]] = set()
    for rank, (_, found, _) in enumerate(gathered):
        for name, why in found.items():
            merged[name] = f"{merged[name]}; {why}" if name in merged else why
            unusable.add((name, nodes.node_of[rank]))
    for name, why in merged.items():
        logger.warning("restore: level %s is unreachable: %s", name, why)
    newest_of: dict[str, int | None] = {}
    for view in levels:
        if view.node_local:
            listed = [each[view.name] for _, _, each in gathered if view.name in each]
            newest_of[view.name] = None if view.name in merged else max(listed, default=-1)
    return copies, merged, unusable, newest_of


def newest_step_directory(root: str) -> int:
    """The newest step ``root`` holds a directory of (``-1``: none; staging directories are
    not steps)."""
    if not os.path.isdir(root):
        return -1
    steps = [step_of_name(entry.name) for entry in os.scandir(root) if entry.is_dir(follow_symlinks=False)]
    return max((step for step in steps if step is not None), default=-1)


def newest_named(views: Sequence[LevelView]) -> tuple[dict[str, int | None], dict[str, str]]:
    """Per shared level, the newest step a name in its root says (``None``: none), from one
    listing without reading a manifest; and the levels that could not be listed."""
    named: dict[str, int | None] = {}
    failed: dict[str, str] = {}
    for view in views:
        try:
            entries = shared_store(view).list_dir("")
        except Exception as exc:  # on a thread: any error makes the level unreachable, named
            failed[view.name] = f"{type(exc).__name__}: {exc}" if not isinstance(exc, ShardkeepError) else str(exc)
            continue
        steps = [step for step in (step_of_name(name) for name, _ in entries) if step is not None]
        named[view.name] = max(steps, default=None)
    return named, failed


def gather_shared(
    levels: Sequence[LevelView],
    coordinator: Coordinator,
    limits: ManifestLimits | None,
    named: Mapping[str, int | None],
) -> tuple[list[StepCopy], dict[str, str]]:
    """The copies on the shared levels ``named`` (listed by the coordinator, with their
    manifests read), and those that could not be listed, on every rank."""

    def listing() -> tuple[list[StepCopy], dict[str, str]]:
        found: list[StepCopy] = []
        failed: dict[str, str] = {}
        for view in levels:
            if view.node_local or view.root is None or view.name not in named:
                continue
            try:
                found.extend(list_shared(view, limits))
            except (OSError, ShardkeepError) as exc:
                failed[view.name] = str(exc)
        return found, failed

    copies, failed = coordinator.on_coordinator("listing the shared levels' copies", listing)
    for name, why in failed.items():
        logger.warning("restore: level %s is unreachable: %s", name, why)
    return copies, failed


def signature_of(store: ByteStore, name: str) -> tuple[int, str] | None:
    path = f"{name}/{SIGNATURE_FILENAME}"
    if store.stat(path) is None:
        return None
    handle = store.open_read(path)
    try:
        if handle.size > _MAX_SIGNATURE_BYTES:
            raise ShardkeepError(f"{path}: {handle.size} bytes is too large for a signature")
        data = memoryview(bytearray(handle.size))
        handle.read_into(0, data)
    finally:
        handle.close()
    return handle.size, digest_bytes("blake3", data)


def list_node_parts(view: LevelView, node: int, limits: ManifestLimits | None) -> list[StepCopy]:
    assert view.root is not None
    if not os.path.isdir(view.root):
        if os.path.lexists(view.root):
            raise ShardkeepError(f"{view.root} is not a directory")
        return []  # an empty (wiped or new) node: no parts
    store = LocalStore(view.root)
    found: list[StepCopy] = []
    for name in sorted(os.listdir(view.root)):
        step = step_of_name(name)
        if step is None or not os.path.isdir(os.path.join(view.root, name)):
            continue
        try:
            sealed = read_manifest_bytes(CheckpointLocation(store, name), limits)
        except ShardkeepError as exc:
            logger.warning("restore: %s/%s is not usable: %s", view.root, name, exc)
            continue
        identity = manifest_identity(sealed)
        problem, part = None, None
        try:
            with open(os.path.join(view.root, name, NODE_PART_FILENAME), "rb") as file:
                part = decode_node_part(file.read(1 << 24), where=f"{view.root}/{name}")
        except (OSError, ShardkeepError) as exc:
            problem = f"no readable {NODE_PART_FILENAME} ({exc})"
        if part is not None and part.manifest_digest != identity:
            problem = f"{NODE_PART_FILENAME} records manifest {part.manifest_digest}, the manifest is {identity}"
        found.append(
            StepCopy(
                view.name, node, name, step, identity, len(sealed), signature_of(store, name),
                part.attempt if part else None, part.run_id if part else None, problem,
            )
        )  # fmt: skip
    return found


def shared_store(view: LevelView) -> ByteStore:
    if view.store is not None:
        return view.store
    assert view.root is not None
    local = local_path(view.root)
    if local is not None:
        if not os.path.isdir(local):
            raise ShardkeepError(f"{view.root} is not a directory")
        return LocalStore(local)
    return open_store(view.root, view.storage_options)


def list_shared(view: LevelView, limits: ManifestLimits | None) -> list[StepCopy]:
    store = shared_store(view)
    found: list[StepCopy] = []
    for name, _ in store.list_dir(""):
        step = step_of_name(name)
        if step is None:
            continue
        try:
            sealed = read_manifest_bytes(CheckpointLocation(store, name), limits)
        except ShardkeepError:
            continue  # not committed (a drain in flight, leftovers): not a copy
        found.append(
            StepCopy(view.name, None, name, step, manifest_identity(sealed), len(sealed), signature_of(store, name))
        )
    return found


def candidates(copies: list[StepCopy]) -> list[tuple[int, str]]:
    """``(step, identity)`` pairs to try, best first."""
    score: dict[tuple[int, str], tuple[int, int]] = {}
    for copy in copies:
        shared, parts = score.get((copy.step, copy.identity), (0, 0))
        if copy.node is None:
            shared = 1
        elif copy.problem is None:
            parts += 1
        score[(copy.step, copy.identity)] = (shared, parts)
    return sorted(score, key=lambda key: (-key[0], -score[key][0], -score[key][1], key[1]))
