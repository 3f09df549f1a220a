"""The preemption handler: on SIGTERM (or a chosen signal), every rank finishes its step, settles
the drains in flight within the grace period, saves once to the fastest level, and exits with a
distinct code (see docs/levels.md, "Preemption").

:class:`PreemptionHandler` is installed by ``MultiLevelManager.handle_preemption`` (opt-in). Its
parts, in the order they run:

1. **The signal handler only records.** Python runs it on the main thread between bytecodes: it
   notes the time of the first signal, counts the signals, and sets one event for a *repeat*.
   No save, no collective, no logging happens inside it (LEVELS.md §4.10).
2. **Debouncing.** torchrun forwards SIGTERM to its workers, and SLURM signals every process of
   the step, so a worker usually gets two SIGTERMs at once. A signal within
   ``debounce_seconds`` (1 s) of the first is counted as a duplicate and ignored; a later one is
   a repeat.
3. **Agreement at a safe point.** :meth:`PreemptionHandler.agree`, called by the manager's
   ``should_save``, ``save`` and ``preempted`` on the caller's thread, reduces every rank's
   ``(state, seconds since its first signal, signal, which rank)`` with one all-reduce (MAX) of
   a few numbers (one collective per step; nothing at all with one process), so the ranks, which
   the launcher signals at slightly different times, decide together at the same step. The
   answer is cached per step: ``should_save(step)`` then ``save(step)`` cost one collective.
4. **The emergency** (:meth:`PreemptionHandler.run_emergency`, every rank): the drains in flight
   get at most ``drain_seconds`` (default: half of what is left of ``grace_seconds``), then the
   ones still copying are abandoned (nothing committed; their staging removed); the state is
   saved once to the fastest level, inside :func:`~shardkeep.writes.stop_writes_on` the repeat event;
   its peer replicas get what is left of the grace period (less :data:`EXIT_MARGIN_SECONDS`), so
   that the emergency checkpoint survives the loss of its node when time allows; then
   :class:`SystemExit` with ``exit_code`` (the save committed) or ``aborted_exit_code`` (no
   emergency checkpoint: a repeat signal aborted it, or it failed).
5. **A repeat signal** during the emergency save stops its writes at the next buffer on that
   rank (and a node-local save refuses to publish), so the save fails on every rank together and
   each node removes this attempt: nothing half committed. A repeat before the emergency save
   starts skips it. After the files are published the save is no longer stopped (the commit is
   a rename and an fsync per node); it commits and the exit code says so.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import NoReturn

from shardkeep.distributed.coordinator import Coordinator
from shardkeep.errors import ConfigError, PreemptionHandlerError, ShardkeepError
from shardkeep.writes import ABANDONED, stop_writes_on

__all__ = [
    "DEBOUNCE_SECONDS",
    "EXIT_MARGIN_SECONDS",
    "EXIT_PREEMPTED",
    "EXIT_PREEMPTED_ABORTED",
    "Preemption",
    "PreemptionHandler",
    "PreemptionOutcome",
]

logger = logging.getLogger("shardkeep.levels")

#: The exit code after a committed emergency save (``EX_TEMPFAIL``: "try again later"; SLURM's
#: ``RequeueExit=75`` requeues the job on it).
EXIT_PREEMPTED = 75
#: The exit code when no emergency checkpoint was saved (a repeat signal aborted it, or it
#: failed): the job resumes from the newest checkpoint before it.
EXIT_PREEMPTED_ABORTED = 76
#: A signal this soon after the first one is the same preemption delivered twice (torchrun's
#: forward and the scheduler's own), not a repeat.
DEBOUNCE_SECONDS = 1.0
#: The part of the grace period kept for the exit itself (a barrier, the process group's
#: teardown) when the emergency save waits for its peer replicas.
EXIT_MARGIN_SECONDS = 2.0

#: Which handler owns each signal in this process (one handler per signal).
_installed: dict[int, PreemptionHandler] = {}
_installed_lock = threading.RLock()

# The votes of the agreement: nothing seen, a signal, a repeat signal.
_QUIET, _SIGNALED, _REPEATED = 0, 1, 2


@dataclass(frozen=True)
class Preemption:
    """What the ranks agreed at ``step``: the signal (its name, as the first rank that got one
    saw it), the ranks that got one, the most seconds since any rank's first signal, and whether
    a repeat signal asks to skip the emergency save."""

    step: int
    signal_name: str
    signaled_ranks: tuple[int, ...]
    seconds_since_signal: float
    abort: bool


@dataclass
class PreemptionOutcome:
    """What the emergency did, as the exit reports it: the step, the level saved to and the
    checkpoint's name (``None`` when nothing was saved, with ``reason``), the drains waited for
    or abandoned, what became of its peer replicas, the seconds it took, and the exit code."""

    step: int
    level: str
    saved: str | None
    exit_code: int
    seconds: float
    reason: str = ""
    drains: list[str] = field(default_factory=list)
    replicas: str = ""


def _signal_number(value: int | signal.Signals) -> signal.Signals:
    try:
        number = signal.Signals(value)
    except (ValueError, TypeError) as exc:
        raise PreemptionHandlerError(f"signals=: {value!r} is not a signal") from exc
    if number in (signal.SIGKILL, signal.SIGSTOP):
        raise PreemptionHandlerError(f"signals=: {number.name} cannot be caught; a handler for it is impossible")
    return number


def _checked_seconds(name: str, value: float | None, *, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ConfigError(f"{name}={value!r} must be a number of seconds >= 0")
    return float(value)


def _checked_code(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 255:
        raise ConfigError(
            f"{name}={value!r} must be an exit code from 1 to 255 (0 tells torchrun and SLURM that the job succeeded)"
        )
    return value


class PreemptionHandler:
    """Turns a preemption signal into one agreed emergency save and a distinct exit.

    ``signals``: the signals handled (SIGTERM by default; SLURM's early warning is often
    ``SIGUSR1`` through ``--signal=B:USR1@<seconds>``). ``grace_seconds``: the time from the
    first signal to the launcher's SIGKILL (torchrun's ``--shutdown-timeout``, 30 s by default;
    SLURM's ``KillWait``). ``drain_seconds``: the longest the drains in flight are waited for
    (default: half of what is left of the grace period). ``exit_code`` / ``aborted_exit_code``:
    the process's exit after an emergency save that committed / that did not.
    ``debounce_seconds``: a signal this soon after the first is a duplicate.

    Not thread-safe: :meth:`install`, :meth:`uninstall` and :meth:`agree` run on the main
    thread (the one Python runs signal handlers on), as the training loop does.
    """

    def __init__(
        self,
        signals: Sequence[int | signal.Signals] = (signal.SIGTERM,),
        *,
        grace_seconds: float = 30.0,
        drain_seconds: float | None = None,
        exit_code: int = EXIT_PREEMPTED,
        aborted_exit_code: int = EXIT_PREEMPTED_ABORTED,
        debounce_seconds: float = DEBOUNCE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(signals, (int, signal.Signals)):
            signals = (signals,)
        self.signals = tuple(dict.fromkeys(_signal_number(value) for value in signals))
        if not self.signals:
            raise PreemptionHandlerError("signals=: give at least one signal to handle")
        self.grace_seconds = _checked_seconds("grace_seconds", grace_seconds) or 0.0
        self.drain_seconds = _checked_seconds("drain_seconds", drain_seconds, allow_none=True)
        self.debounce_seconds = _checked_seconds("debounce_seconds", debounce_seconds) or 0.0
        self.exit_code = _checked_code("exit_code", exit_code)
        self.aborted_exit_code = _checked_code("aborted_exit_code", aborted_exit_code)
        if self.exit_code == self.aborted_exit_code:
            raise ConfigError(f"exit_code and aborted_exit_code are both {exit_code}: they must differ")
        self._clock = clock
        self._previous: dict[int, object] = {}
        #: The first signal: its time (``clock()``) and number.
        self.first_at: float | None = None
        self.first_signal: int | None = None
        #: Every signal received; those ignored as duplicates of the first.
        self.received = 0
        self.duplicates = 0
        #: Set by a repeat signal: stops the emergency save's writes, or skips it.
        self.repeat = threading.Event()
        self._agreed: tuple[int, Preemption | None] | None = None
        #: Set once the emergency began (the agreement is then no longer asked).
        self.emergency_started: float | None = None
        self.outcome: PreemptionOutcome | None = None

    def __repr__(self) -> str:
        names = ",".join(number.name for number in self.signals)
        return f"PreemptionHandler({names}, grace_seconds={self.grace_seconds:g})"

    # -- installing ----------------------------------------------------------------------------
    @property
    def installed(self) -> bool:
        return any(_installed.get(number) is self for number in self.signals)

    def install(self) -> None:
        """Handle the signals from now on. Raises :class:`PreemptionHandlerError` off the main
        thread, or when another handler of this module already handles one of the signals (a
        second ``handle_preemption``), before changing anything."""
        thread = threading.current_thread()
        if thread is not threading.main_thread():
            raise PreemptionHandlerError(
                f"a preemption handler can only be installed from the main thread (Python runs signal handlers "
                f"there), not from thread {thread.name!r}"
            )
        with _installed_lock:
            taken = [number.name for number in self.signals if number in _installed]
            if taken:
                raise PreemptionHandlerError(
                    f"a preemption handler is already installed for {', '.join(taken)} in this process: install "
                    "it once (MultiLevelManager.handle_preemption), or uninstall the first"
                )
            for number in self.signals:
                self._previous[number] = signal.signal(number, self._on_signal)
                _installed[number] = self

    def uninstall(self) -> None:
        """Give the signals back to the handlers they had before :meth:`install` (main thread)."""
        if threading.current_thread() is not threading.main_thread():
            raise PreemptionHandlerError("a preemption handler can only be uninstalled from the main thread")
        with _installed_lock:
            for number in self.signals:
                if _installed.get(number) is self:
                    previous = self._previous.pop(number, signal.SIG_DFL)
                    signal.signal(number, previous if previous is not None else signal.SIG_DFL)  # type: ignore[arg-type]  # what signal.signal returned
                    del _installed[number]

    def _on_signal(self, number: int, frame: FrameType | None) -> None:
        """The signal handler: records the signal and nothing else."""
        now = self._clock()
        self.received += 1
        if self.first_at is None:
            self.first_at, self.first_signal = now, number
        elif now - self.first_at < self.debounce_seconds:
            self.duplicates += 1
        else:
            self.repeat.set()

    # -- agreeing ------------------------------------------------------------------------------
    @property
    def signaled(self) -> bool:
        """Whether this process got a signal (no collective)."""
        return self.first_at is not None

    def _vote(self, rank: int, world_size: int) -> list[float]:
        """This rank's vote: its state, the seconds since its first signal, the signal's number,
        then one flag per rank (this rank's set when it got a signal)."""
        flags = [0.0] * world_size
        if self.first_at is None:
            return [float(_QUIET), 0.0, 0.0, *flags]
        flags[rank] = 1.0
        state = _REPEATED if self.repeat.is_set() else _SIGNALED
        return [float(state), max(0.0, self._clock() - self.first_at), float(self.first_signal or 0), *flags]

    def agree(self, step: int, coordinator: Coordinator) -> Preemption | None:
        """Whether the ranks are preempted at ``step`` (collective: one all-reduce (MAX) of
        ``3 + world_size`` numbers when distributed, none with one process; the answer is
        cached for ``step``)."""
        if self._agreed is not None and self._agreed[0] == step:
            return self._agreed[1]
        vote = self._vote(coordinator.rank, coordinator.world_size)
        agreed = coordinator.all_reduce_max(vote, label=f"preemption check at step {step}")
        state, seconds, number = int(agreed[0]), agreed[1], int(agreed[2])
        decision = None
        if state != _QUIET:
            decision = Preemption(
                step=step,
                signal_name=signal.Signals(number).name if number else "signal",
                signaled_ranks=tuple(rank for rank, flag in enumerate(agreed[3:]) if flag),
                seconds_since_signal=seconds,
                abort=state == _REPEATED,
            )
        self._agreed = (step, decision)
        return decision

    # -- the emergency -------------------------------------------------------------------------
    def run_emergency(
        self,
        decision: Preemption,
        *,
        level: str,
        settle: Callable[[float], list[str]],
        save: Callable[[], str],
        coordinator: Coordinator,
        protect: Callable[[float], str] | None = None,
    ) -> NoReturn:
        """Settle the drains (``settle(seconds)``: wait at most that long, abandon the rest,
        return what happened to each), save once to ``level`` (``save()``: the committed name;
        raises a :class:`~shardkeep.errors.ShardkeepError` when it did not commit), wait for
        its peer replicas (``protect(seconds)``: at most what is left of the grace period less
        :data:`EXIT_MARGIN_SECONDS`; what became of them), wait for every rank at one barrier (the ranks leave together, so none tears its process group
        down under a peer still in a collective), then raise :class:`SystemExit`. Every rank
        calls it with the same decision."""
        started = self._clock()
        self.emergency_started = started
        left = max(0.0, self.grace_seconds - decision.seconds_since_signal)
        wait = min(left, self.drain_seconds if self.drain_seconds is not None else left / 2)
        outcome = PreemptionOutcome(
            step=decision.step, level=level, saved=None, exit_code=self.aborted_exit_code, seconds=0.0
        )
        logger.warning(
            "preemption: %s on rank(s) %s; %.1f s of the %g s grace period left at step %d",
            decision.signal_name,
            ",".join(map(str, decision.signaled_ranks)),
            left,
            self.grace_seconds,
            decision.step,
        )
        try:
            outcome.drains = settle(0.0 if decision.abort else wait)
            if decision.abort:
                outcome.reason = f"a second {decision.signal_name} came before the emergency save began"
            else:
                logger.warning("preemption: emergency save of step %d to level %r", decision.step, level)
                with stop_writes_on(self.repeat):
                    outcome.saved = save()
                outcome.exit_code = self.exit_code
                if protect is not None:
                    outcome.replicas = self._protect(protect, decision, started)
        except ShardkeepError as exc:
            if self.repeat.is_set() or ABANDONED in str(exc):
                outcome.reason = f"aborted by a second {decision.signal_name} (on this rank or another): {exc}"
            else:
                outcome.reason = f"{type(exc).__name__}: {exc}"
        outcome.seconds = self._clock() - started
        self.outcome = outcome
        self._log(outcome)
        try:
            coordinator.barrier(label="preemption: every rank exits")
        except ShardkeepError as exc:
            logger.warning("preemption: not every rank reached the exit: %s", exc)
        raise SystemExit(outcome.exit_code)

    def _protect(self, protect: Callable[[float], str], decision: Preemption, started: float) -> str:
        """Wait for the emergency checkpoint's peer replicas within the grace period left; what
        became of them (the checkpoint is committed whatever the answer)."""
        spent = decision.seconds_since_signal + (self._clock() - started)
        seconds = max(0.0, self.grace_seconds - spent - EXIT_MARGIN_SECONDS)
        try:
            return protect(0.0 if self.repeat.is_set() else seconds)
        except ShardkeepError as exc:
            return f"not waited for: {type(exc).__name__}: {exc}"

    def _log(self, outcome: PreemptionOutcome) -> None:
        drains = f"; drains: {'; '.join(outcome.drains)}" if outcome.drains else ""
        drains += f"; replicas: {outcome.replicas}" if outcome.replicas else ""
        signals = f"{self.received} signal(s) received, {self.duplicates} duplicate(s) ignored"
        if outcome.saved is not None:
            logger.warning(
                "preemption: emergency checkpoint %s committed on level %r in %.2f s (%s%s); exiting with %d",
                outcome.saved,
                outcome.level,
                outcome.seconds,
                signals,
                drains,
                outcome.exit_code,
            )
        else:
            logger.error(
                "preemption: no emergency checkpoint of step %d (%s; %s%s); nothing was half committed; exiting "
                "with %d: the run resumes from the newest checkpoint before it",
                outcome.step,
                outcome.reason,
                signals,
                drains,
                outcome.exit_code,
            )
