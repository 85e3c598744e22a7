"""The worker runtime: run a handler on every message, correctly by default.

:class:`Worker` (threads) and :class:`AsyncWorker` (asyncio tasks) share one set of decisions
(``_policy``, no I/O) and differ only in how they wait and run handlers. A worker dequeues in
batches to fill its free slots, runs at most ``concurrency`` handlers at once, renews each
lock well before it expires, finishes messages whose handler returned, retries those that
raised (deferred with backoff, their saved state kept) and, after ``max_attempts``, finishes
them as failed (archived with the error) or moves them to a dead-letter channel. A message that
comes back past ``max_attempts`` (its workers crashed) is failed without running again. It
fires the queue's periodic schedules, sleeps exactly until the next message is due, wakes at
once on a NOTIFY when the queue publishes events, and rides out a lost database connection
(reconnecting with backoff). Every ``maintenance_ms`` it runs ``queue.maintain()``, which
vacuums the queue's high-churn tables when they need it (autovacuum is too slow for them).
On SIGTERM/SIGINT it stops dequeuing, lets running handlers finish within ``grace_s`` and
gives back the rest, so no lock is left to expire.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import random
import signal
import threading
import time
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
    StaleMessageError,
)
from ..metrics import WorkerMetrics
from ..queue import Message, Queue
from ..types import AckStatus
from . import _policy
from ._async import AsyncWorker
from ._policy import (
    REPORT_TRIES,
    REPORT_WAIT_S,
    Action,
    Backoff,
    Decision,
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


def _fields(message: Message) -> dict[str, object]:
    return {"message_id": message.id, "channel": message.channel, "attempt": message.num_attempts}


class Worker:
    """Runs ``handler(message)`` for the messages of ``queue`` in threads; see the module
    docstring. A coroutine function handler runs in its thread's own event loop."""

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
        )
        self.queue = queue
        self.handler = handler
        self.metrics = metrics or WorkerMetrics()
        self.stats = WorkerStats()
        self._stopping = threading.Event()
        # stop() calls, all told and as of the end of the last run: a stop() asked for before
        # run() is kept, one left over from the previous run is not.
        self._stops = 0
        self._stops_seen = 0
        self._wake = threading.Event()
        self._lock = threading.Lock()
        # Every run, keyed by itself: a handler that yielded (deferred to now) may still be
        # reporting when its message is taken again, as a second run of the same id.
        self._running: dict[_Task, None] = {}
        self._grace_over = False
        self._rng = random.Random()
        self._clock_offset_ms = 0

    # -- control -------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the worker to stop: no more dequeues; running handlers get ``grace_s``. Asked
        before :meth:`run`, it makes that run return at once."""
        self._stops += 1
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
            if self._stops != self._stops_seen:
                self._stopping.set()  # a stop() that came in between
        self.stats = WorkerStats()  # this run's (a later run does not add to what it returned)
        self._grace_over = False
        previous = self._install_signals() if handle_signals else {}
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
            self._stopping.set()
            self._shutdown()
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

    # -- the dequeue loop ----------------------------------------------------------------

    def _db_now(self) -> int:
        return int(time.time() * 1000) + self._clock_offset_ms

    def _loop(self, until_idle: bool) -> None:
        failures = 0
        empties = 0  # empty answers in a row that said "due now"
        measured = False
        while not self._stopping.is_set():
            with self._lock:
                free = self.options.concurrency - len(self._running)
            if free <= 0:
                self._wake.wait(self.options.idle_ms / 1000)
                self._wake.clear()
                continue
            try:
                if not measured:
                    # Database clock minus local clock, so that sleeps follow the queue's clock.
                    samples = []
                    for _ in range(_policy.CLOCK_SAMPLES):
                        sent = time.time()
                        db_ms = self.queue.now()
                        samples.append((sent, db_ms, time.time()))
                    self._clock_offset_ms = _policy.clock_offset(samples)
                    measured = True
                batch = self.queue.dequeue_batch(free, lock_ms=self.options.lock_ms)
                idle = until_idle and not batch.messages and self._idle(batch.retry_at)
                failures = 0
            except DatabaseError as err:
                failures += 1
                delay = _policy.reconnect_delay(failures)
                log.warning("dequeue failed (%s); retrying in %.1fs", err, delay)
                self._stopping.wait(delay)
                continue
            for message in batch.messages:
                self._start(message)
            if batch.messages:
                empties = 0
                continue
            if idle:
                return
            wait_ms, empties = _policy.sleep_ms(
                batch.retry_at, self._db_now(), self.options.idle_ms, empties
            )
            self._wake.wait(wait_ms / 1000)
            self._wake.clear()

    def _idle(self, retry_at: int | None) -> bool:
        with self._lock:
            if self._running:
                return False
        if retry_at is None:
            return True
        return _policy.only_schedules_left(self.queue.stats())

    def _start(self, message: Message) -> None:
        task = _Task(message)
        with self._lock:
            self._running[task] = None
            self.metrics.running = len(self._running)
        self.metrics.count("dequeued", message.channel)
        # Daemon threads: a handler that outlives the grace period (its message already given
        # back) must not keep the process alive.
        threading.Thread(
            target=self._execute, args=(task,), daemon=True, name="lonnymq-handler"
        ).start()

    # -- one message -----------------------------------------------------------------------

    def _execute(self, task: _Task) -> None:
        """Run the task's message; when finishing it hands this thread the next message
        (one transaction: see :meth:`_apply`), run that one too, and so on."""
        while True:
            following: Message | None = None
            try:
                following = self._run(task)
            finally:
                with self._lock:
                    self._running.pop(task, None)
                    # Under the lock that _shutdown takes to list what still runs: the next
                    # message replaces this one in the list at once, never left unlisted.
                    # One taken while stopping runs too, within the grace period: given back
                    # unrun, it would have spent an attempt (the dequeue counted one) that a
                    # later max_attempts check would hold against it.
                    # Once the grace period is over (_shutdown has listed what to give back),
                    # the next message is given back unrun instead, listed as being reported
                    # so that _shutdown waits for it.
                    done = task
                    give_back = following is not None and self._grace_over
                    if following is not None:
                        task = _Task(following)
                        task.reporting = task.giving_back = give_back
                        self._running[task] = None
                    self.metrics.running = len(self._running)
                done.done.set()
                if following is None:
                    self._wake.set()
            if following is None:
                return
            self.metrics.count("dequeued", following.channel)
            if give_back:
                try:
                    self._give_back(following, "taken after the grace period")
                finally:
                    with self._lock:
                        self._running.pop(task, None)
                        self.metrics.running = len(self._running)
                    task.done.set()
                return

    def _run(self, task: _Task) -> Message | None:
        """Run one message's handler and report its outcome; returns the next message when
        the report also took one."""
        message = task.message
        try:
            decision = _policy.before_run(message, self.options)
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
                            extra=_fields(message),
                        )
                        self.stop()
                self.metrics.observe(message.channel, time.perf_counter() - started)
                with self._lock:
                    skip = task.abandoned or task.lost
                    task.reporting = not skip
                if skip:
                    log.warning(
                        "message %s: handler ended after its lock was %s; result not reported",
                        message.id,
                        "given back" if task.abandoned else "lost",
                        extra=_fields(message),
                    )
                    return None
                decision = _policy.after_run(
                    message, error, self.options, self._db_now(), self._rng
                )
                if error is not None:
                    log.info(
                        "message %s failed (attempt %s): %s",
                        message.id,
                        message.num_attempts,
                        error,
                        extra=_fields(message),
                    )
            else:
                with self._lock:
                    task.reporting = True
            return self._apply_with_retries(message, decision)
        except StaleMessageError:
            # The handler may have deferred or finished the message itself.
            log.info(
                "message %s was no longer held when its handler returned",
                message.id,
                extra=_fields(message),
            )
        except LonnyMQError as err:
            log.error(
                "message %s: could not report the outcome (%s); its lock will "
                "expire and it will be retried",
                message.id,
                err,
                extra=_fields(message),
            )
        return None

    def _apply_with_retries(self, message: Message, decision: Decision) -> Message | None:
        """Report the outcome, riding out a lost connection (the pool reconnects) or a deadlock."""
        for attempt in range(1, REPORT_TRIES + 1):
            try:
                return self._apply(message, decision)
            except DatabaseError as err:
                if attempt == REPORT_TRIES:
                    raise
                delay = _policy.reconnect_delay(attempt)
                log.warning("report failed (%s); trying again in %.1fs", err, delay)
                time.sleep(delay)
        return None

    def _apply(self, message: Message, decision: Decision) -> Message | None:
        """The one place that finishes, retries or fires a message. Completing a message also
        takes the next one in the same transaction (one commit per message in the steady
        state), unless the worker is stopping; that message is returned."""
        action = decision.action
        following: Message | None = None
        if action is Action.FIRE:
            try:
                firing = self.queue.fire_schedule(message)
            except InvalidArgumentError as err:  # not a driver: it would come back forever
                message.fail(error=f"not a schedule driver: {err}")
                self._count("failed", message.channel)
                return None
            if firing.full:
                log.warning(
                    "schedule driver %s: the task's channel is full; trying again at %s",
                    message.id,
                    firing.next_at,
                    extra=_fields(message),
                )
            elif firing.fire_at is not None:
                self._count("fired", message.channel)
            return None
        if action is Action.COMPLETE and self._stopping.is_set():
            message.delete()
        elif action is Action.COMPLETE:
            batch = self.queue.complete_and_dequeue([message], 1, lock_ms=self.options.lock_ms)
            following = batch.messages[0] if batch.messages else None
            if batch.completed[0] is not AckStatus.OK:
                # The handler may have deferred or finished the message itself.
                log.info(
                    "message %s was no longer held when its handler returned",
                    message.id,
                    extra=_fields(message),
                )
                return following
        elif action is Action.RETRY:
            message.defer(dequeue_at=decision.dequeue_at)
        elif action is Action.DEAD_LETTER:
            assert decision.channel is not None
            assert decision.error is not None
            self.queue.dead_letter(message, channel=decision.channel, error=decision.error)
        else:
            assert decision.error is not None
            message.fail(error=decision.error)
        self._count(action.value, message.channel)
        if action in (Action.FAIL, Action.DEAD_LETTER):
            log.error(
                "message %s failed for good after %s attempts: %s",
                message.id,
                message.num_attempts,
                (decision.error or "").splitlines()[-1:],
                extra=_fields(message),
            )
        return following

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
            while True:
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
            extra=_fields(task.message),
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
        """Give running handlers ``grace_s`` to finish, then give their messages back; wait
        (at most ``REPORT_WAIT_S``) for the outcomes of those that did to be reported."""
        deadline = time.monotonic() + self.options.grace_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._running:
                    return
            time.sleep(0.02)
        with self._lock:
            # A run whose handler has returned is reporting (perhaps retrying after a lost
            # connection): giving its message back too would race the report, and when the
            # give-back won, the finished work would run again.
            self._grace_over = True
            tasks = [t for t in self._running if not t.done.is_set() and not t.reporting]
            for task in tasks:
                task.abandoned = True
            reporting = [t for t in self._running if t.reporting]
        for task in tasks:
            self._give_back(task.message, "its handler outlived the grace period")
        wait_until = time.monotonic() + REPORT_WAIT_S
        for task in reporting:
            task.done.wait(max(0.0, wait_until - time.monotonic()))
        # A report that took a message after the listing gives it back (_execute): wait for it.
        while time.monotonic() < wait_until:
            with self._lock:
                # (Handlers that outlived the grace period are not waited for: their messages
                # are given back and their threads left to die with the process.)
                if all(t.abandoned for t in self._running):
                    break
            time.sleep(0.02)

    def _give_back(self, message: Message, why: str) -> None:
        """Unlock a message whose handler outlived the grace period, or one taken once it was over
        (defer keeps its attempt count: the dequeue's attempt is spent). A lost connection or
        a deadlock is ridden out as a report is (the pool reconnects)."""
        for attempt in range(1, REPORT_TRIES + 1):
            try:
                message.defer()
            except LonnyMQError as err:
                if isinstance(err, DatabaseError) and attempt < REPORT_TRIES:
                    delay = _policy.reconnect_delay(attempt)
                    log.warning("give-back failed (%s); trying again in %.1fs", err, delay)
                    time.sleep(delay)
                    continue
                log.error(
                    "message %s could not be given back (%s); its lock will expire",
                    message.id,
                    err,
                )
                return
            self._count("given_back", message.channel)
            log.warning("message %s given back: %s", message.id, why, extra=_fields(message))
            return


async def _awaited(result: Any) -> None:
    await result
