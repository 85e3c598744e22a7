"""The asyncio worker: handlers run as tasks (coroutine functions) or in threads (plain
functions); every decision comes from ``_policy``, as for the thread :class:`Worker`."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import itertools
import logging
import queue
import random
import signal
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import psycopg

from .. import events as _events
from ..errors import (
    DatabaseError,
    InvalidArgumentError,
    LonnyMQError,
)
from ..metrics import WorkerMetrics
from ..queue_async import AsyncMessage, AsyncQueue
from ..types import AckStatus, DequeueBatch, Outcome
from . import _policy
from ._policy import (
    REPORT_TRIES,
    REPORT_WAIT_S,
    Action,
    Backoff,
    WorkerOptions,
    WorkerStats,
)

__all__ = ["AsyncWorker"]

log = logging.getLogger("lonnymq.worker")

AsyncHandler = Callable[[AsyncMessage], Awaitable[object] | object]


@dataclass(eq=False)
class _Run:
    message: AsyncMessage
    task: asyncio.Task[None] | None = None
    lost: bool = False
    abandoned: bool = False
    # Set once its handler has returned (or none runs): its outcome is being reported, so the
    # end of the grace period must not give the message back.
    reporting: bool = False
    # A message taken once the grace period was over, being given back unrun: not renewed
    # (once its give-back has committed, a renewal would call its lock lost).
    giving_back: bool = False


class AsyncWorker:
    """Runs ``handler(message)`` for the messages of an :class:`~lonnymq.AsyncQueue`: a
    coroutine function as a task, a plain function in a daemon thread (at most
    ``concurrency`` run at once). Same options and behaviour as :class:`~lonnymq.worker.Worker`;
    ``await worker.run()``. With many slots this is the faster of the two: its handlers are
    tasks on one event loop, not threads."""

    def __init__(
        self,
        queue: AsyncQueue,
        handler: AsyncHandler,
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
        if not isinstance(queue, AsyncQueue):
            raise InvalidArgumentError(f"queue must be a AsyncQueue, got {type(queue).__name__}")
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
        self._stopping = asyncio.Event()
        self._stopped_at = 0.0
        # stop() calls, all told and as of the end of the last run: a stop() asked for before
        # run() is kept, one left over from the previous run is not.
        self._stops = 0
        self._stops_seen = 0
        self._wake = asyncio.Event()
        # Every run until its outcome is reported, keyed by itself: a handler that yielded
        # (deferred to now) may still be reporting when its message is taken again.
        self._running: dict[_Run, None] = {}
        self._id = ""
        self._pending: _policy.Pending[_Run, AsyncMessage] = _policy.Pending()
        self._rng = random.Random()
        self._clock_offset_ms = 0
        self._threads: _HandlerThreads | None = None

    def stop(self) -> None:
        """Ask the worker to stop (call it from the worker's event loop). Asked before
        :meth:`run`, it makes that run return at once."""
        self._stops += 1
        if not self._stopping.is_set():
            self._stopped_at = time.monotonic()
        self._stopping.set()
        self._wake.set()

    async def run(self, *, handle_signals: bool = True, until_idle: bool = False) -> WorkerStats:
        """Work until :meth:`stop`, SIGTERM or SIGINT (or, with ``until_idle``, until nothing
        but schedules and paused channels is waiting and nothing is running). Returns what was
        done.

        Raises :class:`InvalidArgumentError` when ``dead_letter_channel`` is not paused."""
        dead = self.options.dead_letter_channel
        if dead is not None:
            _policy.check_dead_letter_channel(dead, await self.queue.channel(dead).stats())
        if self._stops == self._stops_seen:
            self._stopping.clear()
        elif not self._stopped_at:
            self._stopped_at = time.monotonic()
        self.stats = WorkerStats()  # this run's (a later run does not add to what it returned)
        self._id = uuid.uuid4().hex  # this run's, in the queue's worker table
        loop = asyncio.get_running_loop()
        signals = []
        if handle_signals and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.stop)
                signals.append(sig)
        self._threads = _HandlerThreads(self.options.concurrency)
        helpers = [asyncio.create_task(self._heartbeats())]
        if self.options.maintenance_ms is not None:
            helpers.append(asyncio.create_task(self._maintain(self.options.maintenance_ms)))
        helpers.append(asyncio.create_task(self._listen()))
        try:
            await self._loop(until_idle)
        finally:
            if not self._stopping.is_set():  # the end of the run, not a stop() asked for
                self._stopped_at = time.monotonic()
                self._stopping.set()
            await self._shutdown()
            self._threads.stop()
            self._stops_seen = self._stops
            self._stopped_at = 0.0
            for helper in helpers:
                helper.cancel()
            for helper in helpers:
                with contextlib.suppress(asyncio.CancelledError):
                    await helper
            # Its row in the worker table says it stopped.
            with contextlib.suppress(LonnyMQError, psycopg.Error):
                await self.queue._fetch("worker_stopped", {"id": self._id}, None)
            for sig in signals:
                loop.remove_signal_handler(sig)
        return self.stats

    # -- the settle loop -----------------------------------------------------------------

    def _db_now(self) -> int:
        return int(time.time() * 1000) + self._clock_offset_ms

    async def _sleep(self, seconds: float) -> None:
        """Sleep until woken (event, finished handler, stop) or ``seconds`` pass."""
        if not self._wake.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), seconds)
        self._wake.clear()

    async def _loop(self, until_idle: bool) -> None:
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
                    db_ms = await self.queue.now()
                    samples.append((sent, db_ms, time.time()))
                except DatabaseError as err:
                    failures += 1
                    await self._after_failure("dequeue", err, failures)
                    continue
                self._clock_offset_ms = _policy.clock_offset(samples)
                continue
            free = self.options.concurrency - len(self._running) + len(self._pending)
            wait = self._pending.wait_s(
                time.monotonic(), len(self._running) - len(self._pending), self.options
            )
            if wait is None and (free <= 0 or sleep_s is not None):
                await self._sleep(self.options.idle_ms / 1000 if free <= 0 else sleep_s or 0.0)
                sleep_s = None
                continue
            if wait is not None and wait > 0:
                await self._sleep(wait)
                continue
            try:
                batch = await self._flush(free)
                failures = 0
            except DatabaseError as err:
                failures += 1
                await self._after_failure("dequeue", err, failures)
                continue
            if batch.messages:
                empties = 0
                continue
            if until_idle and not self._running and await self._idle(batch.retry_at):
                return
            wait_ms, empties = _policy.sleep_ms(
                batch.retry_at, self._db_now(), self.options.idle_ms, empties
            )
            sleep_s = wait_ms / 1000

    async def _after_failure(self, what: str, err: LonnyMQError, failures: int) -> None:
        delay = _policy.reconnect_delay(failures)
        log.warning("%s failed (%s); retrying in %.1fs", what, err, delay)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), delay)

    async def _idle(self, retry_at: int | None) -> bool:
        if self._running:
            return False
        if retry_at is None:
            return True
        return _policy.only_schedules_left(await self.queue.stats())

    async def _flush(self, limit: int) -> DequeueBatch[AsyncMessage]:
        """As ``Worker._flush``: one call reports waiting outcomes and takes new messages."""
        reports = self._pending.take(self.options.batch_size, time.monotonic())
        if self._stopping.is_set():
            limit = 0
        outcomes = [r.outcome for r in reports]
        started = time.monotonic()
        for attempt in itertools.count(1):
            try:
                batch = await self.queue.settle(outcomes, limit, lock_ms=self.options.lock_ms)
                break
            except LonnyMQError as err:
                if not reports:
                    raise
                stopped_at = self._stopped_at if self._stopping.is_set() else None
                delay = _policy.report_retry(
                    log, err, attempt, started=started, options=self.options, stopped_at=stopped_at
                )
                if delay is not None:
                    await asyncio.sleep(delay)
                    continue
                for report in reports:
                    self._running.pop(report.run, None)
                _policy.log_unreported(log, [r.outcome.message for r in reports], err)
                return DequeueBatch(messages=[], retry_at=None)
        for report, status in zip(reports, batch.completed, strict=True):
            self._settled(report, status)
        late = self._stopping.is_set() and self._past_grace()
        for message in batch.messages:
            run = _Run(message)
            self._running[run] = None
            self.metrics.count("dequeued", message.channel)
            self._served.add(message.channel)
            if late:
                # Taken by a call that outlasted the grace period: given back unrun.
                run.reporting = run.giving_back = True
                self._submit(run, Outcome.defer(message), _policy.GIVE_BACK)
            else:
                run.task = asyncio.create_task(self._execute(run))
        self.metrics.running = len(self._running)
        return batch

    def _past_grace(self) -> bool:
        return time.monotonic() >= self._stopped_at + self.options.grace_s

    def _settled(self, report: _policy.Report[_Run, AsyncMessage], status: AckStatus) -> None:
        self._running.pop(report.run, None)
        counter = _policy.log_settled(log, report, status)
        if counter is not None:
            self._count(counter, report.outcome.message.channel)

    def _submit(self, run: _Run, outcome: Outcome[AsyncMessage], counter: str) -> None:
        """Queue ``run``'s outcome for the next flush."""
        self._pending.add(_policy.Report(run, outcome, counter), time.monotonic())
        self._wake.set()

    # -- one message -----------------------------------------------------------------------

    async def _call(self, message: AsyncMessage) -> None:
        if inspect.iscoroutinefunction(self.handler):
            await self.handler(message)
            return
        call = functools.partial(contextvars.copy_context().run, self.handler, message)
        assert self._threads is not None
        result = await self._threads.run(call)
        if inspect.isawaitable(result):
            await result

    async def _execute(self, run: _Run) -> None:
        """Run one message's handler and queue its outcome for the next flush (a schedule's
        driver is fired at once)."""
        message = run.message
        submitted = False
        try:
            decision = _policy.before_run(message, self.options)
            if decision.action is Action.FIRE:
                run.reporting = True
                await self._fire_with_retries(message)
                return
            if decision.action is Action.RUN:
                started = time.perf_counter()
                error: BaseException | None = None
                try:
                    await self._call(message)
                except Exception as exc:  # the handler's failure is the message's outcome
                    error = exc
                    self.metrics.count("handler_error", message.channel)
                except BaseException as exc:
                    current = asyncio.current_task()
                    if run.abandoned or (current is not None and current.cancelling()):
                        raise  # this run itself is being cancelled
                    # SystemExit, KeyboardInterrupt, a stray CancelledError raised by the
                    # handler: the message's failure, and the worker stops.
                    error = exc
                    self.metrics.count("handler_error", message.channel)
                    log.error(
                        "message %s: its handler raised %r: stopping the worker",
                        message.id,
                        exc,
                        extra=_policy.fields(message),
                    )
                    self.stop()
                self.metrics.observe(message.channel, time.perf_counter() - started)
                if run.abandoned or run.lost:
                    log.warning(
                        "message %s: handler ended after its lock was %s; result not reported",
                        message.id,
                        "given back" if run.abandoned else "lost",
                        extra=_policy.fields(message),
                    )
                    return
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
            run.reporting = True
            self._submit(run, _policy.outcome_of(message, decision), decision.action.value)
            submitted = True
        finally:
            if not submitted:
                self._running.pop(run, None)
                self.metrics.running = len(self._running)
                self._wake.set()

    async def _fire_with_retries(self, message: AsyncMessage) -> None:
        """Fire a schedule's driver, riding out a lost connection (the pool reconnects)."""
        for attempt in range(1, REPORT_TRIES + 1):
            try:
                await self._fire(message)
                return
            except LonnyMQError as err:
                delay = _policy.fire_retry_delay(log, message.id, err, attempt)
                if delay is None:
                    return
                await asyncio.sleep(delay)

    async def _fire(self, message: AsyncMessage) -> None:
        try:
            firing = await self.queue.fire_schedule(message)
        except InvalidArgumentError as err:  # not a driver: it would come back forever
            await message.fail(error=f"not a schedule driver: {err}")
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
        setattr(self.stats, outcome, getattr(self.stats, outcome) + 1)

    # -- helpers ---------------------------------------------------------------------------

    async def _heartbeats(self) -> None:
        """Renew every running message's lock each ``heartbeat_ms`` (from the start of one
        round to the next), all in one call on a connection of its own, so that handlers
        holding the pool's connections cannot hold renewals back; a lost lock is flagged."""
        period = self.options.heartbeat_ms / 1000
        conn: psycopg.AsyncConnection[Any] | None = None
        next_round = time.monotonic() + period
        try:
            # Connected before the first lock needs renewing (a connection made then would
            # eat into the lock's margin); connected again at a round when this fails.
            with contextlib.suppress(psycopg.Error):
                conn = await psycopg.AsyncConnection.connect(self.queue.dsn, autocommit=True)
            while True:
                # Reported between rounds, never between a round's start and its renewals.
                await self._report(conn)
                await asyncio.sleep(max(0.0, next_round - time.monotonic()))
                next_round = max(next_round + period, time.monotonic())
                runs = [r for r in self._running if not (r.lost or r.abandoned or r.giving_back)]
                if not runs:
                    continue
                try:
                    if conn is None:
                        conn = await psycopg.AsyncConnection.connect(
                            self.queue.dsn, autocommit=True
                        )
                    statuses = await self.queue.heartbeat_many(
                        [r.message for r in runs], lock_ms=self.options.lock_ms, conn=conn
                    )
                except (LonnyMQError, psycopg.Error) as err:
                    log.warning("heartbeats failed (%s); trying again next round", err)
                    if conn is not None:
                        await conn.close()
                        conn = None
                    continue
                running = [r.message for r in self._running]
                for run, status in zip(runs, statuses, strict=True):
                    outcome = _policy.renewal(status, run.message, running)
                    if outcome is _policy.Renewal.RENEWED or run not in self._running:
                        continue  # renewed, or finished during the call: nothing to renew
                    if outcome is not _policy.Renewal.LOST or run.reporting:
                        # (A run being reported: its handler has returned, perhaps after
                        # finishing or deferring the message itself; the report says whether
                        # it was still held.)
                        log.debug("message %s: not renewed (%s)", run.message.id, outcome.value)
                        continue
                    run.lost = True
                    self._count("lost", run.message.channel)
                    log.warning(
                        "message %s: lock lost while its handler runs",
                        run.message.id,
                        extra=_policy.fields(run.message),
                    )
        finally:
            if conn is not None:
                await conn.close()

    async def _report(self, conn: psycopg.AsyncConnection[Any] | None) -> None:
        """Say, in the queue's worker table, that this worker is alive and what it runs (one
        upsert a round, nothing per message); a failure waits for the next round."""
        if conn is None:
            return
        running = [r.message for r in self._running]
        try:
            await self.queue._fetch(
                "worker_report",
                _policy.presence(self._id, self.options, running, self._served),
                conn,
            )
        except (LonnyMQError, psycopg.Error) as err:
            log.debug("could not report this worker (%s)", err)

    async def _maintain(self, every_ms: int) -> None:
        """Run ``queue.maintain()`` every ``every_ms`` (the task is cancelled at the end)."""
        while True:
            await asyncio.sleep(every_ms / 1000)
            try:
                await self.queue.maintain()
            except LonnyMQError as err:
                log.warning("maintenance failed (%s); trying again later", err)

    async def _listen(self) -> None:
        """Wake the dequeue loop on every event of the queue's NOTIFY channel (read from the
        settings, again until it can be: a database out of reach at the start does not leave
        the worker polling for good); without one, return."""
        failures = 0
        channel: str | None = None
        while not self._stopping.is_set():
            try:
                if channel is None:
                    channel = (await self.queue.settings()).event_channel
                    if channel is None:
                        return
                conn = await psycopg.AsyncConnection.connect(self.queue.dsn, autocommit=True)
                async with conn:
                    await conn.execute(_events.listen_statement(channel))
                    failures = 0
                    self._wake.set()
                    async for _ in conn.notifies():
                        self._wake.set()
            except (psycopg.Error, LonnyMQError) as err:
                failures += 1
                log.warning("event listener lost its connection (%s); reconnecting", err)
                await asyncio.sleep(_policy.reconnect_delay(failures))

    async def _shutdown(self) -> None:
        """Keep reporting outcomes while running handlers get ``grace_s`` (from the stop) to
        finish; then give back the messages of those that did not, with the outcomes still
        waiting, and report them (for at most ``REPORT_WAIT_S``)."""
        while self._running and not self._past_grace():
            wait = self._pending.wait_s(
                time.monotonic(), len(self._running) - len(self._pending), self.options
            )
            if wait is not None and wait <= 0:
                await self._flush(0)
                continue
            until_grace = self._stopped_at + self.options.grace_s - time.monotonic()
            await self._sleep(max(0.0, until_grace if wait is None else min(wait, until_grace)))
        for run in list(self._running):
            if run.reporting:
                # Its handler has returned: its outcome is reported, never given back too.
                continue
            run.abandoned = True
            if run.task is not None:
                run.task.cancel()
            self._submit(run, Outcome.defer(run.message), _policy.GIVE_BACK)
            log.warning(
                "message %s: its handler outlived the grace period: giving it back",
                run.message.id,
                extra=_policy.fields(run.message),
            )
        deadline = time.monotonic() + REPORT_WAIT_S
        while self._pending and time.monotonic() < deadline:
            await self._flush(0)


class _HandlerThreads:
    """Threads for plain-function handlers: at most ``size``, started as needed and reused
    (a handler's thread-local state, such as a client session, lasts), and daemon threads,
    unlike an executor's, which the interpreter joins at exit: a handler that outlives the
    grace period, its message already given back, must not keep the process alive, or its
    work would run twice."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._started = 0
        self._work: queue.SimpleQueue[
            tuple[asyncio.AbstractEventLoop, asyncio.Future[Any], Callable[[], Any]] | None
        ] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)

    def run(self, call: Callable[[], Any]) -> asyncio.Future[Any]:
        """Run ``call`` in one of the threads; a future of its result."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        if not self._idle.acquire(blocking=False) and self._started < self._size:
            self._started += 1
            threading.Thread(target=self._serve, daemon=True, name="lonnymq-handler").start()
        self._work.put((loop, future, call))
        return future

    def stop(self) -> None:
        """Let the threads end once they are idle (no waiting for them)."""
        for _ in range(self._started):
            self._work.put(None)

    def _serve(self) -> None:
        while (item := self._work.get()) is not None:
            loop, future, call = item
            result: Any = None
            error: BaseException | None = None
            try:
                result = call()
            except StopIteration as err:
                # A future cannot hold StopIteration (set_exception refuses it): the handler's
                # failure would be lost and its slot hung.
                error = RuntimeError(f"the handler raised StopIteration: {err!r}")
                error.__cause__ = err
            except BaseException as err:  # handed to the awaiting task, as an executor would
                error = err
            # The loop may be closed by now (the worker stopped without it).
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, future, result, error)
            self._idle.release()


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
