"""A broken process group in a :class:`~shardkeep.levels.manager.MultiLevelManager`: the error that
ends the call in which it showed, and the sticky state that ends every later call at once.

A peer whose process dies closes its connections, so the ranks in a collective with it fail
within milliseconds, and :mod:`~shardkeep.distributed.coordinator` passes the news to the
ranks waiting on live peers through the store (a :class:`GroupBrokenError` on every rank within
about :data:`~shardkeep.distributed.coordinator.BROKEN_POLL` seconds). Such a job cannot go on:
the group has lost a rank for good, and every later collective would wait for it until its
deadline (a new group too). So the manager's call raises a :class:`GroupBrokenError` naming the
call, the collective, the rank that saw it, and the ranks (and nodes) that no longer answer a
roll call in the store; every later call raises again before any collective. A drain that
fails on storage is another matter: the group works, the level is skipped, training goes on.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardkeep.distributed.coordinator import GroupBrokenError, roll_call

__all__ = ["ROLL_CALL_SECONDS", "GroupLoss"]

#: How long the survivors of a broken group wait for each other in the roll call that names the
#: ranks lost (every survivor in a collective of the group learns of it within a fraction of it).
ROLL_CALL_SECONDS = 3.0


class GroupLoss:
    """Whether a manager's process group broke, and why (the first error, kept)."""

    def __init__(self) -> None:
        self.error: GroupBrokenError | None = None

    def check(self, call: str) -> None:
        """Raise at once, without a collective, when the group broke earlier."""
        if self.error is not None:
            raise GroupBrokenError(
                f"{call}: refused without a collective: {self.error}",
                dict(self.error.failures),
                label=self.error.label,
                seen_by=self.error.seen_by,
            ) from self.error

    def record(self, call: str, broken: GroupBrokenError, node_of: Sequence[int] | None) -> GroupBrokenError:
        """The error that ends ``call`` (kept for every later call): what broke, seen by whom,
        and the ranks and nodes lost (from a roll call of at most :data:`ROLL_CALL_SECONDS`)."""
        grace = ROLL_CALL_SECONDS
        lost = roll_call(broken, grace)
        if lost is None:
            who = "the ranks lost are unknown (the job's store does not answer: its host may be one of them)"
            failures: dict[int, str] = {}
        elif not lost:
            who = "every rank answered the roll call (a rank missed the deadline, or its connection broke)"
            failures = {}
        else:
            names = [_rank_and_node(rank, node_of) for rank in lost]
            who = f"{', '.join(names)} did not answer a roll call within {grace:g} s: lost"
            failures = {rank: f"lost: no answer within {grace:g} s after {broken.label!r} broke" for rank in lost}
        reason = str(broken).removeprefix(f"{broken.label}: ")
        error = GroupBrokenError(
            f"{call}: the process group broke in {broken.label!r} ({reason}); {who}. "
            "Nothing committed is affected; the job cannot go on: restart it (this manager refuses "
            "every later call, and close() does not wait)",
            failures,
            label=broken.label,
            seen_by=broken.seen_by,
            rank=broken.rank,
            world_size=broken.world_size,
            key=broken.key,
        )
        self.error = error
        return error


def _rank_and_node(rank: int, node_of: Sequence[int] | None) -> str:
    if node_of is not None and 0 <= rank < len(node_of):
        return f"rank {rank} (node {node_of[rank]})"
    return f"rank {rank}"
