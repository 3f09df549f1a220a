"""The retry of a failed save: which failures are transient, how long to wait, and the one
agreement that makes every rank retry the same attempt or none.

:class:`RetryPolicy` bounds the retries (attempts, exponential backoff, a deadline);
:func:`failure_kind` and :func:`is_transient` classify one error from its cause chain;
:func:`run_with_retries` runs a save's attempts under a policy.

What is transient. An ``OSError`` whose ``errno`` says the device or the network hiccuped
(``EIO``, ``ETIMEDOUT``, ``ECONNRESET`` ...), a ``TimeoutError``, or an object store's answer
of 5xx, 429 or a throttling code (``SlowDown`` ...) found in the cause chain: botocore-like
errors are recognized by their ``response`` mapping and their class names, without importing
botocore. ``ENOSPC`` is a kind of its own, ``"no_space"``: retrying into a full disk fails
again, so it is retried only once something freed space (the manager runs its retention first
and retries only if that deleted a checkpoint). Everything else is permanent: a usage error, bad
data on storage, a committed checkpoint in the way, a failed retention, a rank that died or
missed a deadline (a :class:`~shardkeep.errors.CoordinationError` that names no failed rank),
and any error whose cause chain holds no evidence of a transient failure.

The decision is collective. A failed save raises on every rank, but only the rank that failed
holds the original error as a cause; the others hold a report of it (a
:class:`~shardkeep.errors.CoordinationError` naming the rank, or the coordinator's error
re-raised by type). So every rank votes from its own evidence (``"transient"``,
``"no_space"``, ``"permanent"`` or ``"absent"`` when it holds only a report), and one small
all-gather of the votes and of each rank's elapsed time gives every rank the same verdict:
retry only if no rank saw a permanent failure and at least one saw a transient one, and only
if the slowest rank's clock is still within the deadline. The vote runs only for the errors
every rank receives alike from a collective step (a :class:`~shardkeep.errors.StorageError`,
or a :class:`~shardkeep.errors.CoordinationError` that names failed ranks): any other error is
permanent on every rank without a vote, so no rank waits in a collective the others skip. A
vote that itself fails (a broken group) is a permanent verdict, and the save's own error is
raised.
"""

from __future__ import annotations

import errno
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

from shardkeep.errors import (
    CheckpointDataError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
    CoordinationError,
    DependencyError,
    LedgerError,
    ManagerError,
    PlacementError,
    ShardkeepError,
    StorageError,
    UsageError,
)

__all__ = ["FailureKind", "RetryPolicy", "Voters", "agreed_kind", "failure_kind", "is_transient", "run_with_retries"]

logger = logging.getLogger("shardkeep.retry")

T = TypeVar("T")

#: What one error says about retrying: see :func:`failure_kind`.
FailureKind = Literal["transient", "no_space", "permanent"]

#: ``errno`` values of failures that a later attempt may not meet.
TRANSIENT_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "EIO",
        "EAGAIN",
        "EBUSY",
        "EINTR",
        "ETIMEDOUT",
        "ECONNRESET",
        "ECONNABORTED",
        "ECONNREFUSED",
        "EPIPE",
        "ENETDOWN",
        "ENETUNREACH",
        "ENETRESET",
        "EHOSTDOWN",
        "EHOSTUNREACH",
        "ESTALE",
        "EREMOTEIO",
        "ENOLINK",
        "ECOMM",
        "EPROTO",
    )
    if hasattr(errno, name)
)

#: Object-store error codes (S3, GCS, Azure spellings) that mean "slow down" or "try again".
TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "TooManyRequests",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "RequestThrottled",
        "RequestThrottledException",
        "ProvisionedThroughputExceededException",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "InternalFailure",
        "ServiceUnavailable",
        "ServerBusy",
        "OperationTimedOut",
    }
)

#: Class names of connection and timeout errors of botocore, urllib3 and aiohttp (the clients
#: under s3fs and gcsfs); matched by name so that none of them is imported.
TRANSIENT_CLASS_NAMES = frozenset(
    {
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "ConnectTimeout",
        "ReadTimeout",
        "ResponseStreamingError",
        "IncompleteReadError",
        "ProtocolError",
        "ServerDisconnectedError",
        "ClientConnectionError",
        "ClientConnectorError",
        "ClientOSError",
        "ClientPayloadError",
        "ServerTimeoutError",
    }
)

#: shardkeep errors that no retry can fix: the call, the data or the root must change first.
PERMANENT_ERRORS: tuple[type[ShardkeepError], ...] = (
    UsageError,
    CheckpointDataError,
    CheckpointNotFoundError,
    CheckpointExistsError,
    ManagerError,
    PlacementError,
    DependencyError,
    LedgerError,
)


@dataclass(frozen=True)
class RetryPolicy:
    """How a failed save is retried: at most ``attempts`` attempts in all (1 means no retry),
    waiting ``initial_backoff`` seconds before the first retry, then ``multiplier`` times longer
    before each next one, never more than ``max_backoff``; and no retry that would start more
    than ``deadline`` seconds after the first attempt started. Only transient failures are
    retried (see :func:`failure_kind`). There is no jitter: every rank of a job waits the same
    time, and the next attempt's collectives line the ranks up again."""

    attempts: int = 3
    initial_backoff: float = 1.0
    multiplier: float = 2.0
    max_backoff: float = 60.0
    deadline: float = 600.0

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 1:
            raise ConfigError(f"RetryPolicy attempts={self.attempts!r} must be an int >= 1 (1: no retry)")
        for field, value, low in (
            ("initial_backoff", self.initial_backoff, 0.0),
            ("multiplier", self.multiplier, 1.0),
            ("max_backoff", self.max_backoff, 0.0),
            ("deadline", self.deadline, 0.0),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"RetryPolicy {field}={value!r} must be a finite number of seconds")
            if value < low:
                raise ConfigError(f"RetryPolicy {field}={value!r} must be at least {low}")
        if self.max_backoff < self.initial_backoff:
            raise ConfigError(
                f"RetryPolicy max_backoff={self.max_backoff!r} is below initial_backoff={self.initial_backoff!r}"
            )

    def backoff(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (1 for the second attempt)."""
        if retry < 1:
            raise ValueError(f"retry numbers start at 1, got {retry}")
        wait = self.initial_backoff * self.multiplier ** min(retry - 1, 1000)
        return float(min(wait, self.max_backoff))

    def schedule(self) -> list[float]:
        """The waits before each retry, in order (``attempts - 1`` of them), deadline aside."""
        return [self.backoff(retry) for retry in range(1, self.attempts)]


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error``, then its causes, each once. A third-party error raised while handling another
    (no ``from``) is followed to that context too; a shardkeep error always names its cause."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        follow_context = not current.__suppress_context__ and not isinstance(current, ShardkeepError)
        current = current.__cause__ or (current.__context__ if follow_context else None)


def _http_verdict(error: BaseException) -> FailureKind | None:
    """What an object store's answer in ``error.response`` (botocore's shape) says, if any."""
    response = getattr(error, "response", None)
    if not isinstance(response, Mapping):
        return None
    details = response.get("Error")
    code = str(details.get("Code", "")) if isinstance(details, Mapping) else ""
    metadata = response.get("ResponseMetadata")
    status = metadata.get("HTTPStatusCode") if isinstance(metadata, Mapping) else None
    if code in TRANSIENT_CODES or (code.isdigit() and (int(code) >= 500 or int(code) == 429)):
        return "transient"
    if isinstance(status, int) and (status >= 500 or status == 429):
        return "transient"
    if code or isinstance(status, int):
        return "permanent"  # an answer the store gave on purpose: access denied, no such bucket ...
    return None


def failure_kind(error: BaseException) -> FailureKind:
    """What ``error`` says about retrying, from this process's evidence alone.

    ``"permanent"`` if any error in the cause chain is a shardkeep error no retry fixes (usage,
    bad data, a checkpoint in the way, a failed retention ...) or an object store's deliberate
    answer (4xx other than 429); else ``"transient"`` for an object store's 5xx, 429 or
    throttling code, a transient ``errno``, a ``TimeoutError`` or a client's connection error;
    else ``"no_space"`` for ``ENOSPC`` (or ``EDQUOT``); else ``"permanent"``."""
    links = list(_chain(error))
    if any(isinstance(link, PERMANENT_ERRORS) for link in links):
        return "permanent"
    answers = [verdict for verdict in map(_http_verdict, links) if verdict is not None]
    if answers:
        return "permanent" if "permanent" in answers else "transient"
    codes = {link.errno for link in links if isinstance(link, OSError) and link.errno is not None}
    if codes & TRANSIENT_ERRNOS:
        return "transient"
    if any(isinstance(link, TimeoutError) or type(link).__name__ in TRANSIENT_CLASS_NAMES for link in links):
        return "transient"
    if codes & {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}:
        return "no_space"
    return "permanent"


def is_transient(error: BaseException, *, space_freed: bool = False) -> bool:
    """Whether a new attempt may succeed where ``error`` failed (see :func:`failure_kind`); a
    full disk counts only when ``space_freed``."""
    kind = failure_kind(error)
    return kind == "transient" or (kind == "no_space" and space_freed)


class Voters(Protocol):
    """The ranks that vote (a :class:`~shardkeep.distributed.coordinator.Coordinator`): every
    rank calls ``all_gather`` with its vote, in the same order."""

    @property
    def distributed(self) -> bool: ...

    def all_gather(self, value: T, *, label: str = ...) -> list[T]: ...


def _shared_by_every_rank(error: BaseException) -> bool:
    """Whether every rank raised an error like ``error`` from the same collective step, so that
    every rank reaches the vote: a StorageError (re-raised by type from the coordinator), or a
    CoordinationError naming failed ranks (not a deadline or a broken group)."""
    if isinstance(error, CoordinationError):
        return bool(error.failures)
    return isinstance(error, StorageError)


def _vote(error: BaseException) -> str:
    """This rank's vote on ``error``: its own kind, or ``"absent"`` when it holds only another
    rank's report (no cause chain) that says nothing transient."""
    kind = failure_kind(error)
    if kind == "permanent" and error.__cause__ is None:
        return "absent"
    return kind


def agreed_kind(voters: Voters, error: BaseException, elapsed: float) -> tuple[FailureKind, float]:
    """The kind of ``error`` every rank agrees on, and the largest elapsed time of any rank.

    One process decides alone; ranks vote with one all-gather (see the module docstring)."""
    if not voters.distributed:
        return failure_kind(error), elapsed
    if not _shared_by_every_rank(error):
        return "permanent", elapsed
    try:
        votes = voters.all_gather((_vote(error), elapsed), label="agree whether to retry the save")
    except ShardkeepError as exc:
        logger.warning("the ranks could not agree whether to retry the save (%s); not retrying", exc)
        return "permanent", elapsed
    kinds = {kind for kind, _ in votes}
    slowest = max(seconds for _, seconds in votes)
    if "permanent" in kinds or kinds == {"absent"}:
        return "permanent", slowest
    return ("transient" if "transient" in kinds else "no_space"), slowest


def run_with_retries(
    attempt: Callable[[int], T],
    policy: RetryPolicy | None,
    *,
    voters: Voters,
    free_space: Callable[[], bool],
    what: str,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """``attempt(1)``, and under ``policy`` ``attempt(2)`` ... after each transient failure.

    Every rank calls it with the same arguments. ``attempt`` must be a fresh attempt each time
    (its own staging). ``free_space`` runs before retrying a full disk and says whether it freed
    anything; it must return the same on every rank (run it on the coordinator and broadcast).
    Each retry is logged as one warning naming ``what``, the attempt, the error and the wait. The
    error that ends the retries is raised as it is, with a note of the attempts made."""
    if policy is None or policy.attempts == 1:
        return attempt(1)
    started = clock()
    number = 1
    while True:
        try:
            return attempt(number)
        except ShardkeepError as error:
            kind, elapsed = agreed_kind(voters, error, clock() - started)
            if kind == "no_space":
                kind = "transient" if free_space() else "permanent"
            if kind == "permanent":
                if number > 1:
                    error.add_note(f"shardkeep: {what} failed on attempt {number}; the error is not transient")
                raise
            if number >= policy.attempts:
                error.add_note(f"shardkeep: {what} failed {number} times; gave up after {policy.attempts} attempts")
                raise
            wait = policy.backoff(number)
            if elapsed + wait > policy.deadline:
                error.add_note(
                    f"shardkeep: {what} failed {number} times; no retry after {elapsed:.1f} s "
                    f"(a {wait:.1f} s wait would pass the {policy.deadline:g} s deadline)"
                )
                raise
            logger.warning(
                "%s: attempt %d of %d failed with a transient error (%s: %s); retrying in %.1f s",
                what,
                number,
                policy.attempts,
                type(error).__name__,
                str(error).splitlines()[0] if str(error) else "",
                wait,
            )
            sleep(wait)
            number += 1
