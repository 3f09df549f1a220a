"""Fetching what a node lacks during a restore: each file from a peer node holding it (its own
part or a replica, sent over the process group by :mod:`~shardkeep.levels.transfer`), else from
a shared copy of the same step. The phase of :class:`~shardkeep.levels.attempt.StepAttempt`
that the :mod:`shardkeep.levels.restore` docstring calls "Files"."""

from __future__ import annotations

import contextlib
import os

from shardkeep.distributed.coordinator import Coordinator
from shardkeep.errors import ShardkeepError
from shardkeep.levels.copies import (
    LevelView,
    StepCopy,
)
from shardkeep.levels.phases import Outcome, RestoreSettings
from shardkeep.levels.transfer import (
    FileReceive,
    FileSend,
    copy_file,
    run_exchange,
)
from shardkeep.manifest import FileRecord
from shardkeep.storage import ByteStore
from shardkeep.verification import (
    CheckpointLocation,
    read_checked_manifest,
)

__all__ = ["PeerFetch"]


class PeerFetch:
    """The fetching phase of one restore attempt, as a part of
    :class:`~shardkeep.levels.attempt.StepAttempt` (which sets these attributes)."""

    coordinator: Coordinator
    settings: RestoreSettings
    step: int
    identity: str
    rank: int
    node: int
    node_of: tuple[int, ...]
    leader: bool
    home: LevelView | None
    views: dict[str, LevelView]
    mode: dict[int, str]
    directory: str | None
    needed: dict[str, FileRecord]
    local_problems: dict[str, str]
    healed_metadata: list[tuple[str, str]]
    exact_shared: list[StepCopy]
    other_shared: list[StepCopy]
    other_records: dict[tuple[str, str], dict[str, FileRecord]]

    def _store(self, level: str) -> ByteStore:
        raise NotImplementedError

    def fetch(
        self,
        lacking: list[list[tuple[str, int]]],
        *,
        with_metadata: bool = True,
        offered: list[list[str]] | None = None,
    ) -> Outcome:
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
        return Outcome(payload=(healed, failed))

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
        """The nodes holding each file, from the files offered with the check (a node's offer of
        a file it lacks itself left out), when some other node offers every ``(node, path)``
        claimed; else ``None`` (gather who holds what). The same on every rank: both were
        gathered."""
        holders: dict[str, list[int]] = {}
        for rank, paths in enumerate(offered):
            node = self.node_of[rank]
            for path in paths:
                if (node, path) not in claimed:
                    holders.setdefault(path, []).append(node)
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
