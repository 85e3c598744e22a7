"""The worker runtime: run a handler on every message, correctly by default.

:class:`Worker` (threads) and :class:`AsyncWorker` (asyncio tasks) share one set of decisions
(``_policy``, no I/O) and differ only in how they wait and run handlers. A worker dequeues in
batches to fill its free slots, runs at most ``concurrency`` handlers at once, renews each
lock well before it expires, finishes messages whose handler returned, retries those that
raised (deferred with backoff, their saved state kept) and, after ``max_attempts``, finishes
them as failed (archived with the error) or moves them to a dead-letter channel. Outcomes are
reported in groups: one waits at most ``flush_ms`` (or until ``batch_size`` wait, or until no
handler runs) and a group goes in one call, ``queue.settle``, that also takes a message for
every free slot; each outcome stays fenced by its attempt. A message that
comes back past ``max_attempts`` (its workers crashed) is failed without running again. It
fires the queue's periodic schedules, sleeps exactly until the next message is due, wakes at
once on a NOTIFY when the queue publishes events, and rides out a lost database connection
(reconnecting with backoff). Every ``maintenance_ms`` it runs ``queue.maintain()``, which
vacuums the queue's high-churn tables when they need it (autovacuum is too slow for them)
and compacts them while a long transaction keeps VACUUM from removing their dead rows.
On SIGTERM/SIGINT it stops dequeuing, lets running handlers finish within ``grace_s`` and
gives back the rest, so no lock is left to expire.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import logging
import queue
import random
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import psycopg

from .. import events as _events
from ..errors import (
    DatabaseError,
    InvalidArgumentError,
    LonnyMQError,
)
from ..metrics import WorkerMetrics
from ..queue import Message, Queue
from ..types import AckStatus, DequeueBatch, Outcome
from . import _policy
from ._async import AsyncWorker
from ._policy import (
    REPORT_TRIES,
    REPORT_WAIT_S,
    Action,
    Backoff,
    WorkerOptions,
    WorkerStats,
    error_text,
)

__all__ = ["AsyncWorker", "Backoff", "Worker", "WorkerStats", "error_text"]

log = logging.getLogger("lonnymq.worker")

Handler = Callable[[Message], object]


@dataclass(eq=False)
class _Task:
    message: Message
    lost: bool = False
    abandoned: bool = False
    # Set once its handler has returned (or none runs): its outcome is being reported, so the
    # end of the grace period must not give the message back.
    reporting: bool = False
    # A message taken once the grace period was over, being given back unrun: not renewed
    # (once its give-back has committed, a renewal would call its lock lost).
    giving_back: bool = False
    done: threading.Event = field(default_factory=threading.Event)


class Worker:
    """Runs ``handler(message)`` for the messages of ``queue`` in threads; see the module
    docstring. A coroutine function handler runs in its thread's own event loop.

    ``flush_ms`` (0 to 10,000) is the longest a finished handler's outcome waits for others
    before they are reported together, and ``batch_size`` (1 to 10,000) the most reported in
    one call (a full batch goes at once)."""

    def __init__(
        self,
        queue: Queue,
        handler: Handler,
        *,
        concurrency: int = 4,
        lock_ms: int = 30_000,
        heartbeat_ms: int | None = None,
        max_attempts: int = 5,
        backoff: Backoff | None = None,
        dead_letter_channel: str | None = None,
        grace_s: float = 30.0,
        idle_ms: int = 5_000,
        maintenance_ms: int | None = 1_000,
        flush_ms: int = 2,
        batch_size: int = 100,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        if not isinstance(queue, Queue):
            raise InvalidArgumentError(f"queue must be a Queue, got {type(queue).__name__}")
        if not callable(handler):
            raise InvalidArgumentError("handler must be callable")
        self.options = WorkerOptions.check(
            concurrency=concurrency,
            lock_ms=lock_ms,
            heartbeat_ms=heartbeat_ms,
            max_attempts=max_attempts,
            backoff=backoff,
            dead_letter_channel=(
                queue.channel(dead_letter_channel).name if dead_letter_channel is not None else None
            ),
            grace_s=grace_s,
            idle_ms=idle_ms,
            maintenance_ms=maintenance_ms,
            flush_ms=flush_ms,
            batch_size=batch_size,
        )
        self.queue = queue
        self.handler = handler
        self.metrics = metrics or WorkerMetrics()
        self._served = _policy.Served()
        self.stats = WorkerStats()
        self._stopping = threading.Event()
        self._stopped_at = 0.0
        # stop() calls, all told and as of the end of the last run: a stop() asked for before
        # run() is kept, one left over from the previous run is not.
        self._stops = 0
        self._stops_seen = 0
        self._wake = threading.Event()
        self._lock = threading.Lock()
        # Every run until its outcome is reported, keyed by itself: a handler that yielded
        # (deferred to now) may still be reporting when its message is taken again.
        self._running: dict[_Task, None] = {}
        self._pending: _policy.Pending[_Task, Message] = _policy.Pending()
        self._slots: _Slots | None = None
        self._rng = random.Random()
        self._clock_offset_ms = 0
        self._id = ""

    # -- control -------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the worker to stop: no more dequeues; running handlers get ``grace_s``. Asked
        before :meth:`run`, it makes that run return at once."""
        self._stops += 1
        self._halt()

    def _halt(self) -> None:
        if not self._stopping.is_set():
            self._stopped_at = time.monotonic()
        self._stopping.set()
        self._wake.set()

    def run(self, *, handle_signals: bool = True, until_idle: bool = False) -> WorkerStats:
        """Work until :meth:`stop`, SIGTERM or SIGINT (or, with ``until_idle``, until nothing
        but schedules and paused channels is waiting and nothing is running). Returns what was
        done.

        Raises :class:`InvalidArgumentError` when ``dead_letter_channel`` is not paused."""
        dead = self.options.dead_letter_channel
        if dead is not None:
            _policy.check_dead_letter_channel(dead, self.queue.channel(dead).stats())
        if self._stops == self._stops_seen:
            self._stopping.clear()
            self._stopped_at = 0.0
            if self._stops != self._stops_seen:
                self._halt()  # a stop() that came in between
        elif not self._stopped_at:
            self._stopped_at = time.monotonic()
        self.stats = WorkerStats()  # this run's (a later run does not add to what it returned)
        self._id = uuid.uuid4().hex  # this run's, in the queue's worker table
        previous = self._install_signals() if handle_signals else {}
        self._slots = _Slots(self.options.concurrency, self._execute)
        helpers = [threading.Thread(target=self._heartbeats, daemon=True, name="lonnymq-hb")]
        if self.options.maintenance_ms is not None:
            helpers.append(
                threading.Thread(
                    target=self._maintain,
                    args=(self.options.maintenance_ms,),
                    daemon=True,
                    name="lonnymq-maint",
                )
            )
        helpers.append(
            threading.Thread(target=self._listen, daemon=True, name="lonnymq-ev"),
        )
        for helper in helpers:
            helper.start()
        try:
            self._loop(until_idle)
        finally:
            self._halt()
            self._shutdown()
            # Its row in the worker table says it stopped (a report still under way leaves
            # that so).
            with contextlib.suppress(LonnyMQError, psycopg.Error):
                self.queue._fetch("worker_stopped", {"id": self._id}, None)
            # A maintain() under way finishes before run() returns: the caller may close
            # the queue next.
            for helper in helpers:
                if helper.name == "lonnymq-maint":
                    helper.join()
            self._slots.stop()
            self._stops_seen = self._stops
            self._wake.set()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return self.stats

    def _install_signals(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def on_signal(signum: int, frame: FrameType | None) -> None:
            log.info("received signal %s: stopping", signum)
            self.stop()

        previous: dict[int, Any] = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, on_signal)
        return previous

    # -- the settle loop -----------------------------------------------------------------

    def _db_now(self) -> int:
        return int(time.time() * 1000) + self._clock_offset_ms

    def _sleep(self, seconds: float) -> None:
        """Sleep until woken (event, finished handler, stop) or ``seconds`` pass."""
        self._wake.wait(seconds)
        self._wake.clear()

    def _state(self) -> tuple[int, float | None]:
        """Free slots once the waiting outcomes are reported, and when to report them."""
        with self._lock:
            pending = len(self._pending)
            free = self.options.concurrency - len(self._running) + pending
            wait = self._pending.wait_s(
                time.monotonic(), len(self._running) - pending, self.options
            )
        return free, wait

    def _loop(self, until_idle: bool) -> None:
        """Report the outcomes of the handlers that returned and take a message for every free
        slot, in one call (``queue.settle``) per flush; sleep when there is nothing to do."""
        failures = 0
        empties = 0  # empty answers in a row that said "due now"
        sleep_s: float | None = None  # after an empty take: how long to sleep unless woken
        samples: list[tuple[float, int, float]] = []
        while not self._stopping.is_set():
            if len(samples) < _policy.CLOCK_SAMPLES:
                # Database clock minus local clock, so that sleeps follow the queue's clock.
                try:
                    sent = time.time()
                    db_ms = self.queue.now()
                    samples.append((sent, db_ms, time.time()))
                except DatabaseError as err:
                    failures += 1
                    self._after_failure("dequeue", err, failures)
                    continue
                self._clock_offset_ms = _policy.clock_offset(samples)
                continue
            free, wait = self._state()
            if wait is None and (free <= 0 or sleep_s is not None):
                self._sleep(self.options.idle_ms / 1000 if free <= 0 else sleep_s or 0.0)
                sleep_s = None
                continue
            if wait is not None and wait > 0:
                self._sleep(wait)
                continue
            try:
                batch = self._flush(free)
                failures = 0
            except DatabaseError as err:
                failures += 1
                self._after_failure("dequeue", err, failures)
                continue
            if batch.messages:
                empties = 0
                continue
            if until_idle and self._idle(batch.retry_at):
                return
            wait_ms, empties = _policy.sleep_ms(
                batch.retry_at, self._db_now(), self.options.idle_ms, empties
            )
            sleep_s = wait_ms / 1000

    def _after_failure(self, what: str, err: LonnyMQError, failures: int) -> None:
        delay = _policy.reconnect_delay(failures)
        log.warning("%s failed (%s); retrying in %.1fs", what, err, delay)
        self._stopping.wait(delay)

    def _idle(self, retry_at: int | None) -> bool:
        with self._lock:
            if self._running:
                return False
        if retry_at is None:
            return True
        return _policy.only_schedules_left(self.queue.stats())

    def _flush(self, limit: int) -> DequeueBatch[Message]:
        """One call: report up to ``batch_size`` waiting outcomes (retried while the pool
        reconnects) and take up to ``limit`` messages (none once stopping), which start at once
        (or, taken after the grace period, are given back unrun). Raises ``DatabaseError``
        only when there was nothing to report."""
        with self._lock:
            reports = self._pending.take(self.options.batch_size, time.monotonic())
        if self._stopping.is_set():
            limit = 0
        outcomes = [r.outcome for r in reports]
        started = time.monotonic()
        for attempt in itertools.count(1):
            try:
                batch = self.queue.settle(outcomes, limit, lock_ms=self.options.lock_ms)
                break
            except LonnyMQError as err:
                if not reports:
                    raise
                stopped_at = self._stopped_at if self._stopping.is_set() else None
                delay = _policy.report_retry(
                    log, err, attempt, started=started, options=self.options, stopped_at=stopped_at
                )
                if delay is not None:
                    time.sleep(delay)
                    continue
                with self._lock:
                    for report in reports:
                        self._running.pop(report.run, None)
                        report.run.done.set()
                _policy.log_unreported(log, [r.outcome.message for r in reports], err)
                return DequeueBatch(messages=[], retry_at=None)
        for report, status in zip(reports, batch.completed, strict=True):
            self._settled(report, status)
        assert self._slots is not None
        late = self._stopping.is_set() and self._past_grace()
        for message in batch.messages:
            task = _Task(message)
            with self._lock:
                self._running[task] = None
                self.metrics.running = len(self._running)
            self.metrics.count("dequeued", message.channel)
            self._served.add(message.channel)
            if late:
                # Taken by a call that outlasted the grace period: given back unrun.
                task.reporting = task.giving_back = True
                self._submit(task, Outcome.defer(message), _policy.GIVE_BACK)
            else:
                self._slots.start(task)
        return batch

    def _past_grace(self) -> bool:
        return time.monotonic() >= self._stopped_at + self.options.grace_s

    def _settled(self, report: _policy.Report[_Task, Message], status: AckStatus) -> None:
        with self._lock:
            self._running.pop(report.run, None)
            self.metrics.running = len(self._running)
        report.run.done.set()
        counter = _policy.log_settled(log, report, status)
        if counter is not None:
            self._count(counter, report.outcome.message.channel)

    def _submit(self, task: _Task, outcome: Outcome[Message], counter: str) -> None:
        """Queue ``task``'s outcome for the next flush."""
        with self._lock:
            self._pending.add(_policy.Report(task, outcome, counter), time.monotonic())
        self._wake.set()

    # -- one message -----------------------------------------------------------------------

    def _execute(self, task: _Task) -> None:
        """Run one message's handler and queue its outcome for the next flush (a schedule's
        driver is fired at once)."""
        message = task.message
        submitted = False
        try:
            decision = _policy.before_run(message, self.options)
            if decision.action is Action.FIRE:
                with self._lock:
                    task.reporting = True
                self._fire_with_retries(message)
                return
            if decision.action is Action.RUN:
                started = time.perf_counter()
                error: BaseException | None = None
                try:
                    result = self.handler(message)
                    if inspect.isawaitable(result):
                        asyncio.run(_awaited(result))
                except Exception as exc:  # the handler's failure is the message's outcome
                    error = exc
                    self.metrics.count("handler_error", message.channel)
                except BaseException as exc:  # SystemExit, KeyboardInterrupt: a failure, and stop
                    error = exc
                    self.metrics.count("handler_error", message.channel)
                    with self._lock:
                        # A handler given back at the end of a run has nothing to stop.
                        abandoned = task.abandoned
                    if not abandoned:
                        log.error(
                            "message %s: its handler raised %r: stopping the worker",
                            message.id,
                            exc,
                            extra=_policy.fields(message),
                        )
                        self.stop()
                self.metrics.observe(message.channel, time.perf_counter() - started)
                decision = _policy.after_run(
                    message, error, self.options, self._db_now(), self._rng
                )
                if error is not None:
                    log.info(
                        "message %s failed (attempt %s): %s",
                        message.id,
                        message.num_attempts,
                        error,
                        extra=_policy.fields(message),
                    )
            report = _policy.Report(
                task, _policy.outcome_of(message, decision), decision.action.value
            )
            with self._lock:
                # Checked, marked and queued at once: a shutdown sees this run either still
                # running (it gives the message back, and the outcome is dropped here) or with
                # its outcome waiting (it reports it), never between the two.
                skip = task.abandoned or task.lost
                if not skip:
                    task.reporting = True
                    self._pending.add(report, time.monotonic())
            if skip:
                log.warning(
                    "message %s: handler ended after its lock was %s; result not reported",
                    message.id,
                    "given back" if task.abandoned else "lost",
                    extra=_policy.fields(message),
                )
                return
            self._wake.set()
            submitted = True
        finally:
            if not submitted:
                with self._lock:
                    self._running.pop(task, None)
                    self.metrics.running = len(self._running)
                task.done.set()
                self._wake.set()

    def _fire_with_retries(self, message: Message) -> None:
        """Fire a schedule's driver, riding out a lost connection (the pool reconnects)."""
        for attempt in range(1, REPORT_TRIES + 1):
            try:
                self._fire(message)
                return
            except LonnyMQError as err:
                delay = _policy.fire_retry_delay(log, message.id, err, attempt)
                if delay is None:
                    return
                time.sleep(delay)

    def _fire(self, message: Message) -> None:
        try:
            firing = self.queue.fire_schedule(message)
        except InvalidArgumentError as err:  # not a driver: it would come back forever
            message.fail(error=f"not a schedule driver: {err}")
            self._count("failed", message.channel)
            return
        if firing.full:
            log.warning(
                "schedule driver %s: the task's channel is full; trying again at %s",
                message.id,
                firing.next_at,
                extra=_policy.fields(message),
            )
        elif firing.fire_at is not None:
            self._count("fired", message.channel)

    def _count(self, outcome: str, channel: str) -> None:
        self.metrics.count(outcome, channel)
        with self._lock:
            setattr(self.stats, outcome, getattr(self.stats, outcome) + 1)

    # -- helpers ---------------------------------------------------------------------------

    def _heartbeats(self) -> None:
        """Renew every running message's lock each ``heartbeat_ms`` (a third of the lock by
        default, from the start of one round to the next), all in one call on a connection of
        its own, so that handlers holding the pool's connections cannot hold renewals back; a
        lost lock is flagged."""
        period = self.options.heartbeat_ms / 1000
        conn: psycopg.Connection[Any] | None = None
        next_round = time.monotonic() + period
        try:
            # Connected before the first lock needs renewing (a connection made then would
            # eat into the lock's margin); connected again at a round when this fails.
            with contextlib.suppress(psycopg.Error):
                conn = psycopg.connect(self.queue.dsn, autocommit=True)
            while True:
                # Reported between rounds, never between a round's start and its renewals.
                self._report(conn)
                wait = max(0.0, next_round - time.monotonic())
                if self._stopping.is_set():
                    # Keep renewing during the grace period, until the last handler is done.
                    with self._lock:
                        if not self._running:
                            return
                    time.sleep(wait)
                else:
                    self._stopping.wait(wait)
                next_round = max(next_round + period, time.monotonic())
                with self._lock:
                    tasks = [
                        t
                        for t in self._running
                        if not (t.lost or t.abandoned or t.giving_back or t.done.is_set())
                    ]
                if not tasks:
                    continue
                try:
                    if conn is None:
                        conn = psycopg.connect(self.queue.dsn, autocommit=True)
                    statuses = self.queue.heartbeat_many(
                        [t.message for t in tasks], lock_ms=self.options.lock_ms, conn=conn
                    )
                except (LonnyMQError, psycopg.Error) as err:
                    log.warning("heartbeats failed (%s); trying again next round", err)
                    if conn is not None:
                        conn.close()
                        conn = None
                    continue
                with self._lock:
                    running = [t.message for t in self._running]
                for task, status in zip(tasks, statuses, strict=True):
                    self._renewed(task, _policy.renewal(status, task.message, running))
        finally:
            if conn is not None:
                conn.close()

    def _report(self, conn: psycopg.Connection[Any] | None) -> None:
        """Say, in the queue's worker table, that this worker is alive and what it runs (one
        upsert a round, nothing per message); a failure waits for the next round."""
        if conn is None:
            return
        with self._lock:
            running = [t.message for t in self._running]
        if self._stopping.is_set() and not running:
            return  # the round that a stop woke: the run is over
        try:
            self.queue._fetch(
                "worker_report",
                _policy.presence(self._id, self.options, running, self._served),
                conn,
            )
        except (LonnyMQError, psycopg.Error) as err:
            log.debug("could not report this worker (%s)", err)

    def _renewed(self, task: _Task, outcome: _policy.Renewal) -> None:
        if outcome is _policy.Renewal.RENEWED or task.done.is_set():
            return  # renewed, or finished during the call: nothing to renew
        if outcome is not _policy.Renewal.LOST or task.reporting:
            # (A run being reported: its handler has returned, perhaps after finishing or
            # deferring the message itself; the report says whether it was still held.)
            log.debug("message %s: not renewed (%s)", task.message.id, outcome.value)
            return
        with self._lock:
            task.lost = True
        self._count("lost", task.message.channel)
        log.warning(
            "message %s: lock lost while its handler runs",
            task.message.id,
            extra=_policy.fields(task.message),
        )

    def _maintain(self, every_ms: int) -> None:
        """Run ``queue.maintain()`` every ``every_ms`` until the worker stops."""
        while not self._stopping.wait(every_ms / 1000):
            try:
                self.queue.maintain()
            except LonnyMQError as err:
                log.warning("maintenance failed (%s); trying again later", err)

    def _listen(self) -> None:
        """Wake the dequeue loop on every event of the queue's NOTIFY channel (read from the
        settings, again until it can be: a database out of reach at the start does not leave
        the worker polling for good); without one, return."""
        failures = 0
        channel: str | None = None
        while not self._stopping.is_set():
            try:
                if channel is None:
                    channel = self.queue.settings().event_channel
                    if channel is None:
                        return
                with psycopg.connect(self.queue.dsn, autocommit=True) as conn:
                    conn.execute(_events.listen_statement(channel))
                    failures = 0
                    # Events may have been missed while reconnecting: look again.
                    self._wake.set()
                    while not self._stopping.is_set():
                        for _ in conn.notifies(timeout=0.5, stop_after=1):
                            self._wake.set()
            except (psycopg.Error, LonnyMQError) as err:
                failures += 1
                log.warning("event listener lost its connection (%s); reconnecting", err)
                self._stopping.wait(_policy.reconnect_delay(failures))

    def _shutdown(self) -> None:
        """Keep reporting outcomes while running handlers get ``grace_s`` (from the stop) to
        finish; then give back the messages of those that did not, with the outcomes still
        waiting, and report them (for at most ``REPORT_WAIT_S``)."""
        while True:
            with self._lock:
                running = bool(self._running)
            if not running or self._past_grace():
                break
            _, wait = self._state()
            if wait is not None and wait <= 0:
                self._flush(0)
                continue
            until_grace = self._stopped_at + self.options.grace_s - time.monotonic()
            self._sleep(max(0.0, until_grace if wait is None else min(wait, until_grace)))
        with self._lock:
            # A run whose handler has returned is reported, never given back too.
            abandoned = [t for t in self._running if not t.reporting]
            for task in abandoned:
                task.abandoned = True
        for task in abandoned:
            # Its thread is left to die with the process.
            self._submit(task, Outcome.defer(task.message), _policy.GIVE_BACK)
            log.warning(
                "message %s: its handler outlived the grace period: giving it back",
                task.message.id,
                extra=_policy.fields(task.message),
            )
        deadline = time.monotonic() + REPORT_WAIT_S
        while True:
            with self._lock:
                pending = bool(self._pending)
            if not pending or time.monotonic() >= deadline:
                break
            self._flush(0)


class _Slots:
    """``size`` daemon threads that run ``target(task)`` for each task started, started as
    needed and reused (a handler's thread-local state, such as a client session, lasts):
    a handler that outlives the grace period, its message already given back, must not keep
    the process alive, or its work would run twice."""

    def __init__(self, size: int, target: Callable[[_Task], None]) -> None:
        self._size = size
        self._target = target
        self._started = 0
        self._work: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)

    def start(self, task: _Task) -> None:
        if not self._idle.acquire(blocking=False) and self._started < self._size:
            self._started += 1
            threading.Thread(target=self._serve, daemon=True, name="lonnymq-handler").start()
        self._work.put(task)

    def stop(self) -> None:
        """Let the threads end once they are idle (no waiting for them)."""
        for _ in range(self._started):
            self._work.put(None)

    def _serve(self) -> None:
        while (task := self._work.get()) is not None:
            self._target(task)
            self._idle.release()


async def _awaited(result: Any) -> None:
    await result
