"""The asyncio worker: handlers run as tasks (coroutine functions) or in threads (plain
functions); every decision comes from ``_policy``, as for the thread :class:`Worker`."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import logging
import queue
import random
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
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
from ..queue_async import AsyncMessage, AsyncQueue
from ..types import AckStatus
from . import _policy
from ._policy import (
    REPORT_TRIES,
    REPORT_WAIT_S,
    Action,
    Backoff,
    Decision,
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


def _fields(message: AsyncMessage) -> dict[str, object]:
    return {"message_id": message.id, "channel": message.channel, "attempt": message.num_attempts}


class AsyncWorker:
    """Runs ``handler(message)`` for the messages of an :class:`~lonnymq.AsyncQueue`: a
    coroutine function as a task, a plain function in a daemon thread (at most
    ``concurrency`` run at once). Same options and behaviour as :class:`~lonnymq.worker.Worker`;
    ``await worker.run()``."""

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
        )
        self.queue = queue
        self.handler = handler
        self.metrics = metrics or WorkerMetrics()
        self.stats = WorkerStats()
        self._stopping = asyncio.Event()
        # stop() calls, all told and as of the end of the last run: a stop() asked for before
        # run() is kept, one left over from the previous run is not.
        self._stops = 0
        self._stops_seen = 0
        self._wake = asyncio.Event()
        # Every run, keyed by itself: a handler that yielded (deferred to now) may still be
        # reporting when its message is taken again, as a second run of the same id.
        self._running: dict[_Run, None] = {}
        self._grace_over = False
        self._rng = random.Random()
        self._clock_offset_ms = 0
        self._threads: _HandlerThreads | None = None

    def stop(self) -> None:
        """Ask the worker to stop (call it from the worker's event loop). Asked before
        :meth:`run`, it makes that run return at once."""
        self._stops += 1
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
        self.stats = WorkerStats()  # this run's (a later run does not add to what it returned)
        self._grace_over = False
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
            self._stopping.set()
            await self._shutdown()
            self._threads.stop()
            self._stops_seen = self._stops
            for helper in helpers:
                helper.cancel()
            for helper in helpers:
                with contextlib.suppress(asyncio.CancelledError):
                    await helper
            for sig in signals:
                loop.remove_signal_handler(sig)
        return self.stats

    # -- the dequeue loop ----------------------------------------------------------------

    def _db_now(self) -> int:
        return int(time.time() * 1000) + self._clock_offset_ms

    async def _sleep(self, seconds: float) -> None:
        """Sleep until woken (event, finished handler, stop) or ``seconds`` pass."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)
        self._wake.clear()

    async def _loop(self, until_idle: bool) -> None:
        failures = 0
        empties = 0  # empty answers in a row that said "due now"
        measured = False
        while not self._stopping.is_set():
            free = self.options.concurrency - len(self._running)
            if free <= 0:
                await self._sleep(self.options.idle_ms / 1000)
                continue
            try:
                if not measured:
                    samples = []
                    for _ in range(_policy.CLOCK_SAMPLES):
                        sent = time.time()
                        db_ms = await self.queue.now()
                        samples.append((sent, db_ms, time.time()))
                    self._clock_offset_ms = _policy.clock_offset(samples)
                    measured = True
                batch = await self.queue.dequeue_batch(free, lock_ms=self.options.lock_ms)
                idle = until_idle and not batch.messages and await self._idle(batch.retry_at)
                failures = 0
            except DatabaseError as err:
                failures += 1
                delay = _policy.reconnect_delay(failures)
                log.warning("dequeue failed (%s); retrying in %.1fs", err, delay)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), delay)
                continue
            for message in batch.messages:
                run = _Run(message)
                self._running[run] = None
                self.metrics.running = len(self._running)
                self.metrics.count("dequeued", message.channel)
                run.task = asyncio.create_task(self._execute(run))
            if batch.messages:
                empties = 0
                continue
            if idle:
                return
            wait_ms, empties = _policy.sleep_ms(
                batch.retry_at, self._db_now(), self.options.idle_ms, empties
            )
            await self._sleep(wait_ms / 1000)

    async def _idle(self, retry_at: int | None) -> bool:
        if self._running:
            return False
        if retry_at is None:
            return True
        return _policy.only_schedules_left(await self.queue.stats())

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
        """Run the message; when finishing it hands this task the next message (one
        transaction: see :meth:`_apply`), run that one too, and so on."""
        while True:
            following: AsyncMessage | None = None
            try:
                following = await self._run(run)
            finally:
                self._running.pop(run, None)
                # No await between the pop and the registration: _shutdown, which lists what
                # still runs after the stop, sees every message taken before it. One taken
                # while stopping runs too, within the grace period: given back unrun, it would
                # have spent an attempt (the dequeue counted one) that a later max_attempts
                # check would hold against it.
                # Once the grace period is over (_shutdown has listed what to give back), the
                # next message is given back unrun instead, listed as being reported.
                give_back = following is not None and self._grace_over
                if following is not None:
                    run = _Run(following, task=run.task, reporting=give_back, giving_back=give_back)
                    self._running[run] = None
                self.metrics.running = len(self._running)
                if following is None:
                    self._wake.set()
            if following is None:
                return
            self.metrics.count("dequeued", following.channel)
            if give_back:
                try:
                    await self._give_back(following, "taken after the grace period")
                finally:
                    self._running.pop(run, None)
                    self.metrics.running = len(self._running)
                return

    async def _run(self, run: _Run) -> AsyncMessage | None:
        """Run one message's handler and report its outcome; returns the next message when
        the report also took one."""
        message = run.message
        try:
            decision = _policy.before_run(message, self.options)
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
                        extra=_fields(message),
                    )
                    self.stop()
                self.metrics.observe(message.channel, time.perf_counter() - started)
                run.reporting = not (run.abandoned or run.lost)
                if run.abandoned or run.lost:
                    log.warning(
                        "message %s: handler ended after its lock was %s; result not reported",
                        message.id,
                        "given back" if run.abandoned else "lost",
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
                run.reporting = True
            return await self._apply_with_retries(message, decision)
        except StaleMessageError:
            log.info(
                "message %s was no longer held when its handler returned",
                message.id,
                extra=_fields(message),
            )
        except LonnyMQError as err:
            log.error(
                "message %s: could not report the outcome (%s); its lock will expire",
                message.id,
                err,
                extra=_fields(message),
            )
        return None

    async def _apply_with_retries(
        self, message: AsyncMessage, decision: Decision
    ) -> AsyncMessage | None:
        for attempt in range(1, REPORT_TRIES + 1):
            try:
                return await self._apply(message, decision)
            except DatabaseError as err:
                if attempt == REPORT_TRIES:
                    raise
                delay = _policy.reconnect_delay(attempt)
                log.warning("report failed (%s); trying again in %.1fs", err, delay)
                await asyncio.sleep(delay)
        return None

    async def _apply(self, message: AsyncMessage, decision: Decision) -> AsyncMessage | None:
        """The one place that finishes, retries or fires a message. Completing a message also
        takes the next one in the same transaction, unless the worker is stopping; that
        message is returned."""
        action = decision.action
        following: AsyncMessage | None = None
        if action is Action.FIRE:
            try:
                firing = await self.queue.fire_schedule(message)
            except InvalidArgumentError as err:  # not a driver: it would come back forever
                await message.fail(error=f"not a schedule driver: {err}")
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
            await message.delete()
        elif action is Action.COMPLETE:
            batch = await self.queue.complete_and_dequeue(
                [message], 1, lock_ms=self.options.lock_ms
            )
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
            await message.defer(dequeue_at=decision.dequeue_at)
        elif action is Action.DEAD_LETTER:
            assert decision.channel is not None
            assert decision.error is not None
            await self.queue.dead_letter(message, channel=decision.channel, error=decision.error)
        else:
            assert decision.error is not None
            await message.fail(error=decision.error)
        self._count(action.value, message.channel)
        if action in (Action.FAIL, Action.DEAD_LETTER):
            log.error(
                "message %s failed for good after %s attempts",
                message.id,
                message.num_attempts,
                extra=_fields(message),
            )
        return following

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
            while True:
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
                        extra=_fields(run.message),
                    )
        finally:
            if conn is not None:
                await conn.close()

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
        """Give running handlers ``grace_s`` to finish, then give their messages back; wait
        (at most ``REPORT_WAIT_S``) for the outcomes of those that did to be reported."""
        runs = list(self._running)
        tasks = [r.task for r in runs if r.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=self.options.grace_s)
        # No await between this and the listing below: a report that takes a message from now
        # on gives it back (_execute), and its task, listed as reporting, is waited for.
        self._grace_over = True
        reporting: list[asyncio.Task[None]] = []
        for run in [r for r in self._running if r.task is not None]:
            assert run.task is not None
            if run.task.done():
                continue
            if run.reporting:
                # Its handler has returned: giving the message back too would race the report
                # (perhaps retrying after a lost connection), and the finished work could run
                # again.
                reporting.append(run.task)
                continue
            run.abandoned = True
            await self._give_back(run.message, "its handler outlived the grace period")
            run.task.cancel()
        if reporting:
            _, late = await asyncio.wait(reporting, timeout=REPORT_WAIT_S)
            for task in late:
                task.cancel()

    async def _give_back(self, message: AsyncMessage, why: str) -> None:
        """Unlock a message whose handler outlived the grace period, or one taken once it was over
        (defer keeps its attempt count: the dequeue's attempt is spent). A lost connection or
        a deadlock is ridden out as a report is (the pool reconnects)."""
        for attempt in range(1, REPORT_TRIES + 1):
            try:
                await message.defer()
            except LonnyMQError as err:
                if isinstance(err, DatabaseError) and attempt < REPORT_TRIES:
                    delay = _policy.reconnect_delay(attempt)
                    log.warning("give-back failed (%s); trying again in %.1fs", err, delay)
                    await asyncio.sleep(delay)
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
