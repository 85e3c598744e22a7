"""What every worker decides without I/O, shared by :class:`~lonnymq.worker.Worker` (threads)
and :class:`~lonnymq.worker.AsyncWorker` (asyncio): option checks, what to do with a message
before and after its handler runs, retry delays, sleeps and reconnect delays."""

from __future__ import annotations

import logging
import math
import os
import random
import socket
import threading
import time
import traceback
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, Protocol, TypeVar

from ..errors import DatabaseError, InvalidArgumentError, LonnyMQError, StaleMessageError
from ..schedule import SCHEDULE_CHANNEL
from ..types import AckStatus, ChannelStats, Outcome

__all__ = ["Action", "Backoff", "Decision", "WorkerOptions", "WorkerStats", "error_text"]


MAX_DELAY_MS = 10**12  # about 31 years: a longer retry delay is a mistake
MAX_WAIT_MS = 7 * 24 * 3600 * 1000  # the longest lock the queue grants; also caps idle and grace
MAX_CONCURRENCY = 10_000  # the most messages one dequeue can return
MAX_FLUSH_MS = 10_000  # an outcome reported later than this is a mistake


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delay before a retry: ``base_ms * factor ** (attempt - 1)``, capped at ``max_ms``.

    With ``jitter`` (the default) the delay is drawn between half and all of that, so that
    messages that failed together do not all come back together.
    """

    base_ms: int = 1_000
    max_ms: int = 300_000
    factor: float = 2.0
    jitter: bool = True

    def __post_init__(self) -> None:
        ints = all(
            isinstance(v, int) and not isinstance(v, bool) for v in (self.base_ms, self.max_ms)
        )
        factor_ok = (
            isinstance(self.factor, int | float)
            and not isinstance(self.factor, bool)
            and math.isfinite(self.factor)
        )
        if not ints or not factor_ok or not isinstance(self.jitter, bool):
            raise InvalidArgumentError(
                "Backoff needs int base_ms and max_ms, a finite number factor and a bool "
                f"jitter, got base_ms={self.base_ms!r}, max_ms={self.max_ms!r}, "
                f"factor={self.factor!r}, jitter={self.jitter!r}"
            )
        if (
            self.base_ms < 0
            or self.max_ms < self.base_ms
            or self.max_ms > MAX_DELAY_MS
            or self.factor < 1
        ):
            raise InvalidArgumentError(
                "Backoff needs 0 <= base_ms <= max_ms <= 10^12 and factor >= 1, got "
                f"base_ms={self.base_ms}, max_ms={self.max_ms}, factor={self.factor}"
            )

    def delay_ms(self, attempts: int, rng: random.Random | None = None) -> int:
        """The delay after the ``attempts``-th failed attempt."""
        exponent = max(attempts - 1, 0)
        try:
            raw = float(self.max_ms) if exponent > 64 else self.base_ms * self.factor**exponent
        except OverflowError:
            raw = float(self.max_ms)
        capped = min(float(self.max_ms), raw)
        if not self.jitter:
            return int(capped)
        return int((rng or random).uniform(capped / 2, capped))


def error_text(error: BaseException) -> str:
    """The error as the archive keeps it: type, message and traceback."""
    return "".join(traceback.format_exception(error)).strip()


@dataclass
class WorkerStats:
    """What a worker did during one ``run``."""

    completed: int = 0
    retried: int = 0
    failed: int = 0
    dead_lettered: int = 0
    lost: int = 0
    given_back: int = 0
    fired: int = 0


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    """A worker's options, checked once when it is built."""

    concurrency: int = 4
    lock_ms: int = 30_000
    heartbeat_ms: int = 10_000
    max_attempts: int = 5
    backoff: Backoff = Backoff()
    dead_letter_channel: str | None = None
    grace_s: float = 30.0
    idle_ms: int = 5_000
    maintenance_ms: int | None = 1_000
    flush_ms: int = 2
    batch_size: int = 100

    @classmethod
    def check(
        cls,
        *,
        concurrency: object,
        lock_ms: object,
        heartbeat_ms: object,
        max_attempts: object,
        backoff: object,
        dead_letter_channel: str | None,
        grace_s: object,
        idle_ms: object,
        maintenance_ms: object = 1_000,
        flush_ms: object = 2,
        batch_size: object = 100,
    ) -> WorkerOptions:
        """Validate the options; a bad one raises :class:`InvalidArgumentError`."""
        for name, value, low, high in (
            ("concurrency", concurrency, 1, MAX_CONCURRENCY),
            ("lock_ms", lock_ms, 100, MAX_WAIT_MS),
            ("max_attempts", max_attempts, 1, 2**31 - 1),
            ("idle_ms", idle_ms, 1, MAX_WAIT_MS),
            ("flush_ms", flush_ms, 0, MAX_FLUSH_MS),
            ("batch_size", batch_size, 1, MAX_CONCURRENCY),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise InvalidArgumentError(
                    f"{name} must be an int from {low} to {high}, got {value!r}"
                )
        assert isinstance(lock_ms, int)
        heartbeat = heartbeat_ms if heartbeat_ms is not None else lock_ms // 3
        if (
            not isinstance(heartbeat, int)
            or isinstance(heartbeat, bool)
            or not 1 <= heartbeat < lock_ms
        ):
            raise InvalidArgumentError(
                f"heartbeat_ms must be an int between 1 and lock_ms, got {heartbeat_ms!r}"
            )
        if (
            not isinstance(grace_s, int | float)
            or isinstance(grace_s, bool)
            or not 0 <= grace_s <= MAX_WAIT_MS / 1000
        ):
            raise InvalidArgumentError(
                f"grace_s must be a number from 0 to {MAX_WAIT_MS // 1000} (7 days), "
                f"got {grace_s!r}"
            )
        if maintenance_ms is not None and (
            not isinstance(maintenance_ms, int)
            or isinstance(maintenance_ms, bool)
            or not 10 <= maintenance_ms <= MAX_WAIT_MS
        ):
            raise InvalidArgumentError(
                f"maintenance_ms must be None (off) or an int from 10 to {MAX_WAIT_MS}, "
                f"got {maintenance_ms!r}"
            )
        if backoff is not None and not isinstance(backoff, Backoff):
            raise InvalidArgumentError(f"backoff must be a Backoff, got {backoff!r}")
        if dead_letter_channel == SCHEDULE_CHANNEL:
            raise InvalidArgumentError(f"channel {SCHEDULE_CHANNEL!r} is reserved for schedules")
        return cls(
            concurrency=concurrency,  # type: ignore[arg-type]
            lock_ms=lock_ms,
            heartbeat_ms=heartbeat,
            max_attempts=max_attempts,  # type: ignore[arg-type]
            backoff=backoff or Backoff(),
            dead_letter_channel=dead_letter_channel,
            grace_s=float(grace_s),
            idle_ms=idle_ms,  # type: ignore[arg-type]
            maintenance_ms=maintenance_ms,
            flush_ms=flush_ms,  # type: ignore[arg-type]
            batch_size=batch_size,  # type: ignore[arg-type]
        )


class Action(StrEnum):
    """What a worker does with a message."""

    RUN = "run"
    """Run the handler."""
    FIRE = "fire"
    """A schedule's driver: fire it (``queue.fire_schedule``)."""
    COMPLETE = "completed"
    """The handler returned: delete the message."""
    RETRY = "retried"
    """Defer the message to ``dequeue_at``."""
    FAIL = "failed"
    """Finish the message as failed with ``error``."""
    DEAD_LETTER = "dead_lettered"
    """Copy the message to ``channel`` and finish it as failed, in one transaction."""


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    dequeue_at: int | None = None
    error: str | None = None
    channel: str | None = None


class _Held(Protocol):
    @property
    def channel(self) -> str: ...
    @property
    def num_attempts(self) -> int: ...


def _give_up(message: _Held, options: WorkerOptions, error: str) -> Decision:
    # A message of the dead-letter channel itself (taken while someone let that channel run)
    # is failed: moving it into its own channel would make a new message to fail again.
    target = options.dead_letter_channel
    if target is not None and message.channel != target:
        return Decision(Action.DEAD_LETTER, error=error, channel=target)
    return Decision(Action.FAIL, error=error)


def before_run(message: _Held, options: WorkerOptions) -> Decision:
    """What to do with a message just dequeued. A message past ``max_attempts`` was taken by
    workers that never reported (they crashed, or lost its lock) or was yielded by its handler
    as often: it is finished as failed without running again, which bounds crash loops."""
    if message.channel == SCHEDULE_CHANNEL:
        return Decision(Action.FIRE)
    if message.num_attempts > options.max_attempts:
        return _give_up(
            message,
            options,
            f"attempt {message.num_attempts} exceeds max_attempts={options.max_attempts}: "
            "earlier attempts ended without an outcome (a worker crashed or lost the lock) "
            "or were yielded by the handler (message.defer)",
        )
    return Decision(Action.RUN)


def after_run(
    message: _Held,
    error: BaseException | None,
    options: WorkerOptions,
    now_ms: int,
    rng: random.Random,
) -> Decision:
    """What to do once the handler returned (``error`` is what it raised, if anything)."""
    if error is None:
        return Decision(Action.COMPLETE)
    if message.num_attempts < options.max_attempts:
        delay = options.backoff.delay_ms(message.num_attempts, rng)
        return Decision(Action.RETRY, dequeue_at=now_ms + delay)
    return _give_up(message, options, error_text(error))


EMPTY_SLEEP_MAX_MS = 100
"""The longest extra sleep after "due now" answers in a row (see :func:`sleep_ms`)."""
DUE_NOW_SLACK_MS = 2
"""A ``retry_at`` at most this far ahead of the worker's estimate of the database clock means
"due now" (the database's clock is read to the ms, floored). A channel's next message due a
few ms later (a release interval, a competing worker that took this one) is not "due now"."""
CLOCK_SAMPLES = 3
"""Readings of the database clock a worker takes to estimate it (see :func:`clock_offset`)."""


def clock_offset(samples: Iterable[tuple[float, int, float]]) -> int:
    """The database clock minus the local one, in ms, from readings ``(sent, db_ms,
    received)`` (local times in seconds): the reading with the shortest round trip, against
    its middle, when the server read its clock. A reading that waited for a connection (or
    for the event loop) before it was sent would put the estimate ahead by half that wait."""
    sent, db_ms, received = min(samples, key=lambda s: s[2] - s[0])
    return db_ms - int((sent + received) * 500)


def sleep_ms(retry_at: int | None, now_ms: int, idle_ms: int, empties: int = 0) -> tuple[int, int]:
    """How long an idle worker sleeps after a dequeue that returned nothing, and the new count
    of empty answers in a row that said "due now" (``empties`` before it).

    It sleeps until ``retry_at`` (the next message is due), at most ``idle_ms``. A message
    due now that the dequeue did not take sits in a channel whose row another transaction
    holds (a dequeue serving it, a policy change not yet committed), and the answer says
    "due now" again and again for as long as that transaction lasts: so after the first such
    answer the sleep is also at least 1, 2, 4... ms, up to 100 ms, and a long holder does not
    keep idle workers calling in a loop. An answer that names a later time starts the count
    again: a message due soon is not delayed by earlier answers. (With the clock estimate
    behind by more than the slack, held answers look a few ms ahead and are asked again after
    those few ms: more calls, not a loop.)
    """
    if retry_at is None:
        return idle_ms, 0
    wait = retry_at - now_ms
    if wait > DUE_NOW_SLACK_MS:
        return min(idle_ms, wait), 0
    backoff = 0 if empties <= 0 else min(EMPTY_SLEEP_MAX_MS, 2 ** min(empties - 1, 7))
    return min(idle_ms, max(wait, backoff)), empties + 1


REPORT_TRIES = 5
"""Attempts at firing a schedule's driver while the connection is being re-established."""

REPORT_WAIT_S = 30.0
"""How long a stopping worker waits, after the grace period, for outcomes being reported."""


def reconnect_delay(failures: int) -> float:
    """Seconds to wait after ``failures`` consecutive lost connections (0.1 s doubling, at most
    30 s)."""
    return float(min(30.0, 0.1 * 2 ** min(max(failures - 1, 0), 10)))


def report_retry(
    log: logging.Logger,
    err: LonnyMQError,
    attempt: int,
    *,
    started: float,
    options: WorkerOptions,
    stopped_at: float | None,
) -> float | None:
    """After attempt ``attempt`` at reporting outcomes, begun at ``started``, failed with
    ``err``: the seconds to wait before the next attempt, or None to give up. A lost connection
    is retried with backoff while the messages' locks may still be held (their heartbeats fail
    too while the database is out of reach: ``lock_ms`` from the start), so that a server
    restart does not make handlers that have returned run again, and, once the worker is
    stopping (since ``stopped_at``), until its grace period and ``REPORT_WAIT_S`` after it have
    passed, if that comes first; any other error gives up at once. Logs a retry on ``log``."""
    give_up_at = started + options.lock_ms / 1000
    if stopped_at is not None:
        give_up_at = min(give_up_at, stopped_at + options.grace_s + REPORT_WAIT_S)
    left_s = give_up_at - time.monotonic()
    if not isinstance(err, DatabaseError) or left_s <= 0:
        return None
    delay = min(reconnect_delay(attempt), left_s)
    log.warning("report failed (%s); trying again in %.1fs", err, delay)
    return delay


def log_unreported(log: logging.Logger, messages: Iterable[_Message], err: LonnyMQError) -> None:
    """Say on ``log`` that the outcomes of ``messages`` could not be reported."""
    for message in messages:
        log.error(
            "message %s: could not report the outcome (%s); its lock will expire",
            message.id,
            err,
            extra=fields(message),
        )


def fields(message: _Message) -> dict[str, object]:
    """What a log record says of ``message`` (structured logging's extra fields)."""
    return {"message_id": message.id, "channel": message.channel, "attempt": message.num_attempts}


def fire_retry_delay(
    log: logging.Logger, message_id: int, err: LonnyMQError, attempt: int
) -> float | None:
    """After attempt ``attempt`` at firing schedule driver ``message_id`` failed with ``err``:
    the seconds to wait before the next attempt, or None to give up (the driver is no longer
    held, the error is not a lost connection, or the tries are spent: its lock will expire).
    Logs what it decided on ``log``."""
    if isinstance(err, StaleMessageError):
        log.info("schedule driver %s was no longer held", message_id)
        return None
    if not isinstance(err, DatabaseError) or attempt == REPORT_TRIES:
        log.error("schedule driver %s: could not fire (%s); its lock will expire", message_id, err)
        return None
    delay = reconnect_delay(attempt)
    log.warning("firing failed (%s); trying again in %.1fs", err, delay)
    return delay


class _Claim(Protocol):
    @property
    def id(self) -> int: ...
    @property
    def num_attempts(self) -> int: ...


class Renewal(StrEnum):
    """What a heartbeat's status means for the run that holds the message."""

    RENEWED = "renewed"
    LOST = "lost"
    """Another attempt holds the message now: the run must not report."""
    YIELDED = "yielded"
    """The run's handler gave the message back and this worker took it again."""
    GONE = "gone"
    """The message no longer exists (its handler may have finished it itself)."""
    BUSY = "busy"
    """Another transaction holds the message's row (its handler finishing it, most likely):
    not renewed this round."""


def renewal(status: AckStatus, held: _Claim, running: Iterable[_Claim]) -> Renewal:
    """Read a heartbeat's status for ``held``, knowing the messages this worker runs now."""
    if status is AckStatus.OK:
        return Renewal.RENEWED
    if status is AckStatus.NOT_FOUND:
        return Renewal.GONE
    if status is AckStatus.BUSY:
        return Renewal.BUSY
    if any(r.id == held.id and r.num_attempts > held.num_attempts for r in running):
        return Renewal.YIELDED
    return Renewal.LOST


def check_dead_letter_channel(channel: str, stats: ChannelStats | None) -> None:
    """Refuse to start a worker whose dead-letter channel it would take messages from: every
    channel of the queue is served, so an unpaused dead-letter channel hands each message the
    worker moved there back to the same handler, which fails it and moves it again."""
    if stats is None or stats.policy.max_concurrency != 0:
        raise InvalidArgumentError(
            f"dead-letter channel {channel!r} is not paused, so this worker would take back "
            "the messages it moves there: pause it first with "
            f"queue.channel({channel!r}).set_policy(max_concurrency=0) "
            f"(CLI: lonnymq policy set {channel} --max-concurrency 0)"
        )


def only_schedules_left(stats: Iterable[ChannelStats]) -> bool:
    """Whether nothing a worker could take is left in the queue (``until_idle`` then stops):
    schedule drivers wait forever, and a paused channel (``max_concurrency`` 0, a dead-letter
    channel for one) gives nothing until someone lets it run."""
    return all(
        s.size == 0
        for s in stats
        if s.channel != SCHEDULE_CHANNEL
        and not (s.policy.max_concurrency == 0 and s.in_flight == 0)
    )


# -- group commit ----------------------------------------------------------------------------

R = TypeVar("R")
"""A worker's record of one run (its message, and flags)."""
M = TypeVar("M")
"""A message (sync or async)."""

GIVE_BACK = "given_back"
"""The counter of an outcome that gives a message back unrun or unfinished (a defer)."""


def outcome_of(message: M, decision: Decision) -> Outcome[M]:
    """The outcome a worker reports for ``decision`` (COMPLETE, RETRY, FAIL, DEAD_LETTER)."""
    if decision.action is Action.COMPLETE:
        return Outcome.complete(message)
    if decision.action is Action.RETRY:
        return Outcome.defer(message, dequeue_at=decision.dequeue_at)
    assert decision.error is not None
    if decision.action is Action.DEAD_LETTER:
        assert decision.channel is not None
        return Outcome.dead_letter(message, channel=decision.channel, error=decision.error)
    return Outcome.fail(message, error=decision.error)


@dataclass(frozen=True, slots=True)
class Report(Generic[R, M]):
    """One outcome waiting to be reported: the run it ends, what to report, and the counter
    it adds to once reported (``Action.value``, or :data:`GIVE_BACK`)."""

    run: R
    outcome: Outcome[M]
    counter: str


class Pending(Generic[R, M]):
    """The outcomes of handlers that returned, waiting for the next flush (no I/O, no lock:
    the thread worker calls it under its own)."""

    def __init__(self) -> None:
        self._reports: list[Report[R, M]] = []
        self._since: float | None = None  # monotonic time of the oldest report

    def __len__(self) -> int:
        return len(self._reports)

    def add(self, report: Report[R, M], now: float) -> None:
        if not self._reports:
            self._since = now
        self._reports.append(report)

    def wait_s(self, now: float, handlers: int, options: WorkerOptions) -> float | None:
        """Seconds before the next flush is due (0: now); ``None`` when nothing waits. A flush
        is due once ``batch_size`` outcomes wait, once the oldest has waited ``flush_ms``, or
        at once when no handler is running (nothing more is coming)."""
        if not self._reports or self._since is None:
            return None
        if len(self._reports) >= options.batch_size or handlers <= 0:
            return 0.0
        return max(0.0, self._since + options.flush_ms / 1000 - now)

    def take(self, limit: int, now: float) -> list[Report[R, M]]:
        """The oldest ``limit`` reports, out of the waiting list."""
        taken, self._reports = self._reports[:limit], self._reports[limit:]
        self._since = now if self._reports else None
        return taken


class Settled(StrEnum):
    """What a flush's status means for one report."""

    DONE = "done"
    """Reported: count it."""
    NOT_HELD = "not_held"
    """The message was no longer held (its lock was lost, or its handler finished or
    deferred it itself): nothing was changed, nothing is counted."""
    FULL = "full"
    """A dead letter whose channel is full: the message stays held until its lock expires."""


def settled(status: AckStatus) -> Settled:
    if status is AckStatus.OK:
        return Settled.DONE
    if status is AckStatus.FULL:
        return Settled.FULL
    return Settled.NOT_HELD


class _Message(Protocol):
    @property
    def id(self) -> int: ...
    @property
    def channel(self) -> str: ...
    @property
    def num_attempts(self) -> int: ...


def log_settled(log: logging.Logger, report: Report[R, M], status: AckStatus) -> str | None:
    """Log what a flush's ``status`` means for ``report``; the counter to add to, if any."""
    message: _Message = report.outcome.message  # type: ignore[assignment]
    fields = {"message_id": message.id, "channel": message.channel, "attempt": message.num_attempts}
    meaning = settled(status)
    if meaning is Settled.NOT_HELD:
        # The handler may have deferred or finished the message itself.
        log.info(
            "message %s was no longer held when its handler returned", message.id, extra=fields
        )
        return None
    if meaning is Settled.FULL:
        log.error(
            "message %s: could not report the outcome (dead-letter channel %r is full); "
            "its lock will expire",
            message.id,
            report.outcome.channel,
            extra=fields,
        )
        return None
    if report.counter == GIVE_BACK:
        log.warning("message %s given back", message.id, extra=fields)
    elif report.counter in (Action.FAIL.value, Action.DEAD_LETTER.value):
        log.error(
            "message %s failed for good after %s attempts",
            message.id,
            message.num_attempts,
            extra=fields,
        )
    return report.counter


# A worker's report names at most this many of the messages it runs (the dashboard's view).
REPORTED_MESSAGES = 20
# ... and at most this many of the channels it took messages from since its last report.
REPORTED_CHANNELS = 100
# Channels counted one by one between two reports; messages of any more count as "other".
COUNTED_CHANNELS = 10_000
# The longest time a report's counts may cover (worker_report refuses more).
COUNTED_MS = 86_400_000


class Served:
    """The messages a worker took from each channel since its last report (thread-safe):
    ``add`` counts one, ``drain`` hands over what was counted and starts again. Kept in
    memory, sent with the report once a heartbeat round: nothing is written per message."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._other = 0
        self._since = time.monotonic()

    def add(self, channel: str) -> None:
        with self._lock:
            if channel in self._counts or len(self._counts) < COUNTED_CHANNELS:
                self._counts[channel] += 1
            else:
                self._other += 1

    def drain(self) -> dict[str, object]:
        """``worker_report``'s served arguments: the time counted, the ``REPORTED_CHANNELS``
        channels taken from most with their counts, and the messages of all the others."""
        with self._lock:
            counts, other, since = self._counts, self._other, self._since
            self._counts, self._other, self._since = Counter(), 0, time.monotonic()
        named = counts.most_common(REPORTED_CHANNELS)
        return {
            "served_ms": min(COUNTED_MS, round((self._since - since) * 1000)),
            "served_channels": [channel for channel, _ in named],
            "served_counts": [count for _, count in named],
            "served_other": other + counts.total() - sum(count for _, count in named),
        }


def presence(
    worker_id: str, options: WorkerOptions, running: Iterable[_Message], served: Served
) -> dict[str, object]:
    """What a worker reports of itself once a heartbeat round (``worker_report``): its
    identity, how wide it is, what it runs now (the first ``REPORTED_MESSAGES``) and what it
    took from which channels since its last report (``served``, drained)."""
    held = list(running)
    shown = held[:REPORTED_MESSAGES]
    return {
        "id": worker_id,
        "host": socket.gethostname()[:255],
        "pid": os.getpid(),
        "every_ms": options.heartbeat_ms,
        "concurrency": options.concurrency,
        "running": len(held),
        "message_ids": [m.id for m in shown],
        "channels": [m.channel for m in shown],
        **served.drain(),
    }
