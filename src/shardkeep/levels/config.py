"""A level of multi-level checkpointing (:class:`Level`) and the checks of a list of levels,
run before anything is written.

A level is a root with its own cadence and retention. A *node-local* level has one root per
node (a local SSD or RAM disk); each node's directory of a step holds that node's ranks' data
files (see :mod:`shardkeep.levels.local_save`). Any other level is *persistent*: one root
shared by every node (a shared filesystem or an object store URL), written directly
(``source="save"``) or by draining committed steps of the node-local level
(``source="drain"``).

What :func:`check_levels` refuses, with a :class:`~shardkeep.errors.LevelConfigError` naming
the level(s):

- an empty list, a name used twice, a name that is not a plain identifier-like string;
- two levels on one root, or a root inside another level's root (local paths compared after
  ``realpath``, URLs by scheme, bucket and path);
- more than one node-local level (a drain would not know which to copy), a node-local level
  whose root is a URL, a node-local level with ``source="drain"``;
- ``source="drain"`` without a node-local level to drain from;
- a drain whose step cadence cannot be met: its ``every_steps`` must be a multiple of the
  node-local level's ``every_steps`` (else a due persistent step is never a local step). A
  drain with ``every_seconds`` or ``should_save_fn`` is evaluated at committed local steps
  and drains the newest local step that is due;
- a persistent root given per node (a callable, or a string with ``{node}``);
- ``replicas`` on a shared level; more replicas than other nodes, or a ``replica_jump`` that
  puts a replica on the node that holds the part (once the node count is known).

``save_policy=None`` means every step the manager is asked to save is saved on that level
(as :class:`~shardkeep.CheckpointManager` without a policy), and for a drain level every
committed local step is drained; ``retention=None`` keeps every step.

:func:`probe_level` opens a persistent level's store and lists it (creating a local root), and
raises :class:`~shardkeep.errors.LevelUnreachableError` naming the level and the reason. When
several ranks probe (:func:`distributed_now`), each rank's outcome is gathered and
:func:`refuse_unreachable` gives every rank the same error, naming the level and each rank (and
node) that could not reach it with its reason; a
node-local level on a network filesystem is warned about (:class:`~shardkeep.errors.LevelWarning`)
by :func:`warn_if_network_filesystem`, from the filesystem type the ledger's lock reads.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from shardkeep.cadence import SavePolicy
from shardkeep.config import LOCAL
from shardkeep.errors import LevelConfigError, LevelUnreachableError, LevelWarning, ShardkeepError
from shardkeep.ledger.lock import NETWORK_FILESYSTEMS, filesystem_type
from shardkeep.retention import RetentionPolicy
from shardkeep.storage import ByteStore, local_path, open_store, split_url
from shardkeep.storage.localfs import makedirs_durable

__all__ = [
    "Level",
    "LevelRoot",
    "check_levels",
    "distributed_now",
    "normalized_root",
    "probe_level",
    "refuse_unreachable",
    "replica_holders",
    "warn_if_network_filesystem",
]

#: A level's root: a path or URL, or for a node-local level a function of the node id.
LevelRoot = str | os.PathLike[str] | Callable[[int], "str | os.PathLike[str]"]
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_NODE_FIELD = "{node}"


@dataclass(frozen=True)
class Level:
    """One level: ``name``, ``root``, when to save (``save_policy``), what to keep
    (``retention``), and how steps get there (``source``: ``"save"`` writes them, ``"drain"``
    copies committed steps of the node-local level).

    ``node_local=True``: ``root`` is each node's own local directory. The same path on every
    machine (``"/local_ssd/ckpt"``) is the usual case; for several "nodes" on one machine (tests,
    simulations) ``root`` may be a callable ``node -> path`` or a string containing ``{node}``,
    formatted with the node id. ``required=True``: a failure of this level fails the save
    (otherwise it is logged and skipped while another level commits). ``storage_options`` go
    to the fsspec filesystem of a URL root.

    ``replicas`` (node-local only): how many other nodes keep a copy of each node's part,
    placed like NVRx's clique strategy by node: node ``n``'s part goes to nodes
    ``(n + k * replica_jump) % N`` for ``k = 1 .. replicas`` (``replica_jump`` defaults to 1).
    ``None`` means 1 with two nodes or more and 0 with one node (see :meth:`replicas_for`).
    """

    name: str
    root: LevelRoot
    node_local: bool = field(default=False, kw_only=True)
    save_policy: SavePolicy | None = field(default=None, kw_only=True)
    retention: RetentionPolicy | None = field(default=None, kw_only=True)
    source: Literal["save", "drain"] = field(default="save", kw_only=True)
    required: bool = field(default=False, kw_only=True)
    storage_options: Mapping[str, Any] | None = field(default=None, kw_only=True, compare=False)
    replicas: int | None = field(default=None, kw_only=True)
    replica_jump: int | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise LevelConfigError(
                f"level name {self.name!r} must be 1-64 letters, digits, '_', '-' or '.', starting with a letter or digit"
            )
        where = f"level {self.name!r}"
        for flag in ("node_local", "required"):
            if not isinstance(getattr(self, flag), bool):
                raise LevelConfigError(f"{where}: {flag}={getattr(self, flag)!r} must be True or False")
        if self.source not in ("save", "drain"):
            raise LevelConfigError(f"{where}: source={self.source!r} must be 'save' or 'drain'")
        if self.save_policy is not None and not isinstance(self.save_policy, SavePolicy):
            raise LevelConfigError(f"{where}: save_policy= must be a shardkeep.SavePolicy (or None: every step)")
        if self.retention is not None and not isinstance(self.retention, RetentionPolicy):
            raise LevelConfigError(f"{where}: retention= must be a shardkeep.RetentionPolicy (or None: keep all)")
        if not (callable(self.root) or isinstance(self.root, (str, os.PathLike))):
            raise LevelConfigError(
                f"{where}: root={self.root!r} must be a path, a URL, or (node-local) a function of the node"
            )
        per_node = callable(self.root) or _NODE_FIELD in os.fspath(self.root)
        if per_node and not self.node_local:
            raise LevelConfigError(
                f"{where}: a root given per node (a function, or {_NODE_FIELD!r} in the path) needs node_local=True"
            )
        if self.node_local and self.source == "drain":
            raise LevelConfigError(f"{where}: a node-local level is saved, never drained into (source='save')")
        for name, least in (("replicas", 0), ("replica_jump", 1)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
                raise LevelConfigError(f"{where}: {name}={value!r} must be an integer >= {least} (or None)")
        if not self.node_local and (self.replicas or self.replica_jump is not None):
            raise LevelConfigError(
                f"{where}: replicas= and replica_jump= copy a node-local level's parts to other nodes; a shared "
                "level holds every file already (set node_local=True, or leave them out)"
            )

    def replicas_for(self, node_count: int) -> int:
        """How many other nodes keep a copy of each node's part: ``replicas``, or by default 1
        when there are at least two nodes and 0 with one node (or on a shared level)."""
        if not self.node_local:
            return 0
        if self.replicas is not None:
            return self.replicas
        return 1 if node_count >= 2 else 0

    def root_of(self, node: int = 0) -> str:
        """The root of this level on ``node`` (the same for every node unless the root is given
        per node); a node-local root is an absolute local path."""
        where = f"level {self.name!r}"
        if callable(self.root):
            try:
                root = os.fspath(self.root(node))
            except Exception as exc:
                raise LevelConfigError(f"{where}: root(node={node}) failed: {type(exc).__name__}: {exc}") from exc
        else:
            root = os.fspath(self.root)
            if _NODE_FIELD in root:
                root = root.replace(_NODE_FIELD, str(node))
        if not isinstance(root, str) or not root:
            raise LevelConfigError(f"{where}: root(node={node}) is {root!r}, not a path")
        if not self.node_local:
            return root
        path = local_path(root)
        if path is None:
            raise LevelConfigError(f"{where}: a node-local level needs a local path, not the URL {root!r}")
        return path


def normalized_root(root: str) -> tuple[str, str]:
    """(scheme, path) identifying where ``root`` is: ``("file", realpath)`` for a local path,
    ``(scheme, "bucket/prefix")`` for a URL."""
    path = local_path(root)
    if path is not None:
        return "file", os.path.realpath(path)
    scheme, rest = split_url(root)
    return scheme, rest.strip("/")


def _overlap(first: tuple[str, str], second: tuple[str, str]) -> bool:
    if first[0] != second[0]:
        return False
    a, b = first[1].rstrip("/") + "/", second[1].rstrip("/") + "/"
    return a.startswith(b) or b.startswith(a)


def _check_roots(levels: Sequence[Level], node_count: int) -> None:
    """Two levels on one root, or one inside another's, on any node."""
    roots: list[tuple[Level, int, tuple[str, str]]] = []
    for level in levels:
        for node in range(node_count if level.node_local else 1):
            roots.append((level, node, normalized_root(level.root_of(node))))
    for index, (level, node, root) in enumerate(roots):
        for other, other_node, other_root in roots[index + 1 :]:
            if other is level or not _overlap(root, other_root):
                continue
            same = "the same root" if root == other_root else "nested roots"
            raise LevelConfigError(
                f"levels {level.name!r} and {other.name!r} are on {same} ({level.root_of(node)!r} and "
                f"{other.root_of(other_node)!r}): each level needs a root of its own, outside the others'"
            )


def _check_drain(level: Level, local: Level | None) -> None:
    if local is None:
        raise LevelConfigError(
            f"level {level.name!r}: source='drain' copies the steps of a node-local level, and none is configured "
            "(add a Level(..., node_local=True), or use source='save')"
        )
    drain_every = level.save_policy.every_steps if level.save_policy is not None else None
    local_every = local.save_policy.every_steps if local.save_policy is not None else None
    local_other_rules = local.save_policy is not None and (
        local.save_policy.every_seconds is not None or local.save_policy.should_save_fn is not None
    )
    if drain_every is None or local_every is None or local_other_rules:
        return  # the local level saves every step, or the drain takes the newest due local step
    if drain_every % local_every:
        raise LevelConfigError(
            f"level {level.name!r}: every_steps={drain_every} cannot be met by draining level {local.name!r} "
            f"(every_steps={local_every}): a due step is a local step only if {drain_every} is a multiple of "
            f"{local_every}"
        )


def check_levels(levels: Sequence[Level], *, node_count: int | None = None) -> None:
    """Refuse a list of levels that cannot work (see the module docstring), naming the
    level(s). Pure: nothing is read or written (see :func:`probe_level`). ``node_count`` is how
    many nodes resolve a node-local root given per node and hold replicas (``None``: not known
    yet; roots are checked for one node and the replica placement is not checked)."""
    if isinstance(levels, (str, bytes)) or not isinstance(levels, Sequence):
        raise LevelConfigError(f"levels must be a list of shardkeep.Level, not {type(levels).__name__}")
    if not levels:
        raise LevelConfigError("no levels: give at least one shardkeep.Level")
    for item in levels:
        if not isinstance(item, Level):
            raise LevelConfigError(f"levels must be shardkeep.Level objects, not {item!r}")
    names = [level.name for level in levels]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise LevelConfigError(f"level name(s) {twice} are used twice: each level needs a name of its own")
    local = [level for level in levels if level.node_local]
    if len(local) > 1:
        raise LevelConfigError(
            f"levels {[level.name for level in local]} are all node-local: configure at most one node-local level"
        )
    _check_roots(levels, node_count or 1)
    for level in local:
        if node_count is not None:
            replica_holders(level, 0, node_count)  # refuses a placement that cannot work, naming it
    for level in levels:
        if level.source == "drain":
            _check_drain(level, local[0] if local else None)


def replica_holders(level: Level, node: int, node_count: int) -> list[int]:
    """The nodes that keep a copy of ``node``'s part of the node-local ``level`` (the clique
    placement by node: ``(node + k * jump) % node_count`` for ``k = 1 .. replicas``).
    :class:`~shardkeep.errors.LevelConfigError` naming the level and the node count when there
    are more replicas than other nodes, or when the jump maps a node onto itself."""
    replicas = level.replicas_for(node_count)
    jump = 1 if level.replica_jump is None else level.replica_jump
    if replicas > node_count - 1:
        raise LevelConfigError(
            f"level {level.name!r}: replicas={replicas} needs {replicas + 1} nodes or more, the job has {node_count} "
            f"node(s): a node's part can have at most {node_count - 1} replica(s) on other nodes"
        )
    holders = [(node + k * jump) % node_count for k in range(1, replicas + 1)]
    for k, holder in enumerate(holders, start=1):
        if holder == node or holders.index(holder) != k - 1:
            raise LevelConfigError(
                f"level {level.name!r}: replica_jump={jump} with {node_count} nodes puts replica {k} of node {node} "
                f"on node {holder}, which already holds that part; choose a jump whose multiples 1..{replicas} "
                f"are not multiples of {node_count}"
            )
    return holders


def probe_level(level: Level, node: int = 0) -> ByteStore:
    """Open ``level``'s store on ``node`` and list it, creating a local root (durably) if it
    is missing; return the store. :class:`~shardkeep.errors.LevelUnreachableError` naming the
    level and the reason when it cannot (a missing bucket, no permission, a file where the
    root should be ...)."""
    root = level.root_of(node)
    try:
        path = local_path(root)
        if path is not None:
            try:
                makedirs_durable(path)
            except FileExistsError:
                pass
            if not os.path.isdir(path):
                raise LevelUnreachableError(f"level {level.name!r} at {root!r} is unreachable: not a directory")
        store = open_store(root, level.storage_options)
        store.list_dir("")
        filesystem = getattr(store, "fs", None)  # an fsspec store: a missing bucket lists as empty
        if path is None and filesystem is not None:
            bucket = normalized_root(root)[1].partition("/")[0]
            if not filesystem.exists(bucket):
                raise LevelUnreachableError(f"level {level.name!r} at {root!r} is unreachable: no bucket {bucket!r}")
    except LevelUnreachableError:
        raise
    except (ShardkeepError, OSError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise LevelUnreachableError(f"level {level.name!r} at {root!r} is unreachable: {reason}") from exc
    except Exception as exc:  # an object store client's own errors (botocore, aiohttp ...)
        raise LevelUnreachableError(
            f"level {level.name!r} at {root!r} is unreachable: {type(exc).__name__}: {exc}"
        ) from exc
    return store


def distributed_now(process_group: Any = None) -> bool:
    """Whether this process is one of several ranks of ``process_group`` (``None``: the default
    group) now: ``torch.distributed`` is initialized and the group has more than one rank. No
    collective; ``False`` without torch, before ``init_process_group``, and for ``LOCAL``."""
    if isinstance(process_group, str) and process_group == LOCAL:
        return False
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    if not dist.is_available() or not dist.is_initialized():
        return False
    return int(dist.get_world_size(process_group)) > 1


def refuse_unreachable(reports: Sequence[Mapping[str, str]], node_of: Sequence[int]) -> None:
    """Raise the same :class:`~shardkeep.errors.LevelUnreachableError` on every rank when any
    rank could not reach a shared level. ``reports[rank]`` maps the name of each level that
    rank could not reach to the reason it gave (:func:`probe_level`'s message), as gathered
    from every rank, in rank order; ``node_of[rank]`` is its node. The message names each such
    level, the ranks and nodes that could not reach it and each one's reason."""
    failed: dict[str, list[tuple[int, str]]] = {}
    for rank, report in enumerate(reports):
        for name, reason in report.items():
            failed.setdefault(name, []).append((rank, reason))
    if not failed:
        return
    parts = []
    for name, where in sorted(failed.items()):
        ranks = [rank for rank, _ in where]
        nodes = sorted({node_of[rank] for rank in ranks})
        reasons = "; ".join(f"rank {rank} (node {node_of[rank]}): {reason}" for rank, reason in where)
        parts.append(
            f"level {name!r} is unreachable from rank(s) {ranks} on node(s) {nodes} of {len(reports)} ranks ({reasons})"
        )
    raise LevelUnreachableError(
        "; ".join(parts) + "; nothing was written: make the level reachable from every rank, or leave it out"
    )


def warn_if_network_filesystem(level: Level, node: int = 0, *, mountinfo: str | None = None) -> bool:
    """Warn (:class:`~shardkeep.errors.LevelWarning`) when the node-local ``level``'s root on
    ``node`` is on a network filesystem (NFS, Lustre ...): it works, but every node's "local"
    writes then cross the network. Returns whether it warned."""
    if not level.node_local:
        return False
    root = level.root_of(node)
    probe = root
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)  # the root may not exist yet: its nearest existing parent
    fstype = filesystem_type(probe, mountinfo)
    if fstype is None or fstype.lower() not in NETWORK_FILESYSTEMS:
        return False
    warnings.warn(
        f"level {level.name!r} is node-local but its root {root!r} is on a {fstype} filesystem: every node's "
        "saves then cross the network; point it at a local disk (or a RAM disk)",
        LevelWarning,
        stacklevel=2,
    )
    return True
