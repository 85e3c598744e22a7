"""Stopping a worker: what its handlers hold is finished or given back, never both."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg import sql

from lonnymq import AsyncMessage, AsyncQueue, Message, OutcomeKind, Queue
from lonnymq.errors import DatabaseUnavailableError
from lonnymq.worker import AsyncWorker, Worker, WorkerStats

GRACE_S = 0.5


class _Runner:
    """A Worker or AsyncWorker run in a thread, stopped from the test's thread."""

    def __init__(self, dsn: str, queue: Queue, handler: Callable[[Any], None], use_async: bool):
        self.stats: list[WorkerStats] = []
        self.errors: list[BaseException] = []
        self._ready = threading.Event()
        self._stop: Callable[[], None] = lambda: None
        if use_async:
            target = self._async_target(dsn, queue.schema, handler)
        else:
            worker = Worker(queue, handler, concurrency=1, grace_s=GRACE_S, idle_ms=50)
            self._stop = worker.stop

            def target() -> None:
                self._ready.set()
                self.stats.append(worker.run(handle_signals=False))

        self.thread = threading.Thread(target=self._guarded(target))

    def _guarded(self, target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except BaseException as exc:  # reported by the test
                self.errors.append(exc)

        return run

    def _async_target(
        self, dsn: str, schema: str, handler: Callable[[Any], None]
    ) -> Callable[[], None]:
        async def main() -> None:
            async with AsyncQueue(dsn, schema=schema) as aqueue:
                worker = AsyncWorker(aqueue, handler, concurrency=1, grace_s=GRACE_S, idle_ms=50)
                loop = asyncio.get_running_loop()

                def stop() -> None:
                    loop.call_soon_threadsafe(worker.stop)

                self._stop = stop
                self._ready.set()
                self.stats.append(await worker.run(handle_signals=False))

        return lambda: asyncio.run(main())

    def start(self) -> None:
        self.thread.start()
        assert self._ready.wait(30)

    def stop(self) -> None:
        self._stop()

    def join(self) -> WorkerStats:
        self.thread.join(timeout=60)
        assert not self.thread.is_alive()
        assert self.errors == []
        return self.stats[0]


def _waiting_reports(admin: psycopg.Connection[Any], holder_pid: int) -> list[int]:
    """Backends waiting, behind ``holder_pid``, for a lock in a statement that finishes a
    message (only those: another client of the server, a second test run, may have some)."""
    rows = admin.execute(
        "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
        " AND %s = ANY(pg_blocking_pids(pid))"
        " AND (query LIKE '%%message_settle%%' OR query LIKE '%%message_delete%%')",
        [holder_pid],
    ).fetchall()
    return [row[0] for row in rows]


@pytest.mark.parametrize("use_async", [False, True], ids=["Worker", "AsyncWorker"])
def test_a_run_reporting_when_the_grace_period_ends_is_not_given_back(
    dsn: str, queue: Queue, admin: psycopg.Connection[Any], use_async: bool
) -> None:
    """The handler has returned; its report waits for the message's row (held by another
    session) and fails a few times, so it is between retries when the grace period ends.
    The message must be finished by that report, not given back as well: a give-back that
    got the row first would make the finished work run again."""
    queue.create(b"work")
    calls: list[int] = []
    released = threading.Event()

    def handler(message: Message | AsyncMessage) -> None:
        calls.append(message.id)
        assert released.wait(30)

    runner = _Runner(dsn, queue, handler, use_async)
    runner.start()
    with psycopg.connect(dsn) as holder:
        deadline = time.monotonic() + 30
        while not calls:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        holder.execute(
            sql.SQL("SELECT 1 FROM {}.message FOR UPDATE").format(sql.Identifier(queue.schema))
        )
        released.set()  # the handler returns; its report now waits for the row
        while not _waiting_reports(admin, holder.info.backend_pid):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        runner.stop()
        stopped = time.monotonic()
        # Make the report fail (as on a lost connection) until the grace period has ended:
        # it then sleeps between retries (0.1, 0.2, 0.4 s...) while the worker decides.
        while time.monotonic() < stopped + GRACE_S + 0.05:
            for pid in _waiting_reports(admin, holder.info.backend_pid):
                admin.execute("SELECT pg_cancel_backend(%s)", (pid,))
            time.sleep(0.005)
        time.sleep(1.0)
        holder.commit()
    stats = runner.join()
    assert calls == [calls[0]]
    assert (stats.completed, stats.given_back) == (1, 0)
    assert queue.stats() == []  # finished, not back in the queue


@pytest.mark.parametrize("use_async", [False, True], ids=["Worker", "AsyncWorker"])
@pytest.mark.parametrize("raised", [SystemExit, KeyboardInterrupt])
def test_a_handler_raising_systemexit_or_keyboardinterrupt_stops_the_worker_cleanly(
    dsn: str, queue: Queue, use_async: bool, raised: type[BaseException]
) -> None:
    """Its message is not left locked (it is retried like any failure) and the worker stops
    gracefully, run() returning its stats instead of dying."""
    queue.create(b"work")

    def handler(message: Message | AsyncMessage) -> None:
        raise raised()

    runner = _Runner(dsn, queue, handler, use_async)
    runner.start()
    stats = runner.join()  # the worker stopped by itself
    assert stats.retried == 1
    [channel] = queue.stats()
    assert (channel.size, channel.in_flight) == (1, 0)


@pytest.mark.parametrize("use_async", [False, True], ids=["Worker", "AsyncWorker"])
def test_stop_before_run_makes_the_run_return_at_once(
    dsn: str, queue: Queue, use_async: bool
) -> None:
    queue.create(b"work")
    if use_async:

        async def main() -> WorkerStats:
            async with AsyncQueue(dsn, schema=queue.schema) as aqueue:
                worker = AsyncWorker(aqueue, lambda m: None, idle_ms=50)
                worker.stop()
                return await asyncio.wait_for(worker.run(handle_signals=False), 10)

        stats = asyncio.run(main())
    else:
        worker = Worker(queue, lambda m: None, idle_ms=50)
        worker.stop()
        done: list[WorkerStats] = []
        thread = threading.Thread(target=lambda: done.append(worker.run(handle_signals=False)))
        thread.start()
        thread.join(timeout=10)
        assert not thread.is_alive()
        stats = done[0]
        # A later run is not stopped by that old request.
        assert worker.run(handle_signals=False, until_idle=True).completed == 1
    assert stats.completed == 0


def test_a_handler_given_back_that_raises_later_does_not_stop_the_next_run(
    queue: Queue,
) -> None:
    """A handler outlives the grace period (its message is given back), then raises SystemExit
    after the run has ended: that is not a stop for the worker's next run."""
    queue.create(b"work")
    calls: list[int] = []

    def handler(message: Message) -> None:
        calls.append(message.id)
        if len(calls) == 1:
            time.sleep(1.0)
            raise SystemExit

    worker = Worker(queue, handler, concurrency=1, grace_s=0.2, idle_ms=50)
    first = threading.Thread(target=lambda: worker.run(handle_signals=False))
    first.start()
    deadline = time.monotonic() + 30
    while not calls:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    worker.stop()
    first.join(timeout=30)
    assert not first.is_alive()
    time.sleep(1.3)  # the abandoned handler has raised by now
    stats = worker.run(handle_signals=False, until_idle=True)
    assert (stats.completed, len(calls)) == (1, 2)


class _StoppingQueue(Queue):
    """A queue whose worker is told to stop while it reports one message and takes the next
    (the call then takes ``delay`` seconds more)."""

    worker: Worker | None = None
    delay = 0.0

    def settle(self, outcomes: Any, limit: int = 0, **kwargs: Any) -> Any:
        if outcomes and limit:
            assert self.worker is not None
            self.worker.stop()
            time.sleep(self.delay)
        return super().settle(outcomes, limit, **kwargs)


class _StoppingAsyncQueue(AsyncQueue):
    """The same for an AsyncWorker."""

    worker: AsyncWorker | None = None
    delay = 0.0

    async def settle(self, outcomes: Any, limit: int = 0, **kwargs: Any) -> Any:
        if outcomes and limit:
            assert self.worker is not None
            self.worker.stop()
            await asyncio.sleep(self.delay)
        return await super().settle(outcomes, limit, **kwargs)


def test_a_message_taken_while_stopping_runs_within_the_grace_period(
    dsn: str, queue: Queue
) -> None:
    """Finishing one message takes the next in the same call; when the stop comes meanwhile,
    the next one runs too (the dequeue counted its attempt: given back unrun, it would be
    failed unrun by a worker with max_attempts=1), and run() returns once it is finished."""
    queue.create(b"first", channel="a")
    queue.create(b"second", channel="a")
    ran: list[bytes] = []
    with _StoppingQueue(dsn, schema=queue.schema) as stopping:
        worker = Worker(
            stopping,
            lambda m: ran.append(m.content),
            concurrency=1,
            max_attempts=1,
            grace_s=5,
            idle_ms=50,
            heartbeat_ms=100,
        )
        stopping.worker = worker
        stats = worker.run(handle_signals=False)
    assert ran == [b"first", b"second"]
    assert (stats.completed, stats.given_back, stats.failed, stats.lost) == (2, 0, 0, 0)
    assert queue.stats() == []


def test_an_async_message_taken_while_stopping_runs_within_the_grace_period(
    dsn: str, queue: Queue
) -> None:
    queue.create(b"first", channel="a")
    queue.create(b"second", channel="a")
    ran: list[bytes] = []

    async def handler(message: AsyncMessage) -> None:
        await asyncio.sleep(0.2)
        ran.append(message.content)

    async def main() -> WorkerStats:
        async with _StoppingAsyncQueue(dsn, schema=queue.schema) as stopping:
            worker = AsyncWorker(
                stopping, handler, concurrency=1, max_attempts=1, grace_s=5, idle_ms=50
            )
            stopping.worker = worker
            return await worker.run(handle_signals=False)

    stats = asyncio.run(main())
    assert ran == [b"first", b"second"]
    assert (stats.completed, stats.given_back, stats.failed, stats.lost) == (2, 0, 0, 0)
    assert queue.stats() == []


def test_a_message_taken_once_the_grace_period_is_over_is_given_back_unrun(
    dsn: str, queue: Queue
) -> None:
    """The call that finishes one message and takes the next outlasts the grace period: the
    next one is given back, never run, and run() returns only once it is (no lock left behind
    a process that exits)."""
    queue.create(b"first", channel="a")
    queue.create(b"second", channel="a")
    ran: list[bytes] = []
    with _StoppingQueue(dsn, schema=queue.schema) as stopping:
        stopping.delay = 1.0
        worker = Worker(
            stopping, lambda m: ran.append(m.content), concurrency=1, grace_s=0.3, idle_ms=50
        )
        stopping.worker = worker
        stats = worker.run(handle_signals=False)
        [channel] = queue.stats()
    assert ran == [b"first"]
    assert (stats.completed, stats.given_back, stats.lost) == (1, 1, 0)
    assert (channel.size, channel.in_flight) == (1, 0)
    assert worker.metrics.counts()[("dequeued", "a")] == 2  # the one given back was taken


def test_an_async_message_taken_once_the_grace_period_is_over_is_given_back_unrun(
    dsn: str, queue: Queue
) -> None:
    queue.create(b"first", channel="a")
    queue.create(b"second", channel="a")
    ran: list[bytes] = []

    async def handler(message: AsyncMessage) -> None:
        ran.append(message.content)

    workers: list[AsyncWorker] = []

    async def main() -> WorkerStats:
        async with _StoppingAsyncQueue(dsn, schema=queue.schema) as stopping:
            stopping.delay = 1.0
            worker = AsyncWorker(stopping, handler, concurrency=1, grace_s=0.3, idle_ms=50)
            stopping.worker = worker
            workers.append(worker)
            return await worker.run(handle_signals=False)

    started = time.monotonic()
    stats = asyncio.run(main())
    [channel] = queue.stats()
    assert ran == [b"first"]
    assert (stats.completed, stats.given_back, stats.lost) == (1, 1, 0)
    assert (channel.size, channel.in_flight) == (1, 0)
    assert workers[0].metrics.counts()[("dequeued", "a")] == 2
    assert time.monotonic() - started < 20  # the report was waited for, not cancelled at 30 s


def _run_stuck(queue: Queue) -> tuple[WorkerStats, float]:
    """Run a Worker (grace_s 0.3) whose handler blocks until run() has returned, stopped once
    the handler has started: its stats, and how long run() took."""
    started, release = threading.Event(), threading.Event()

    def handler(message: Message) -> None:
        started.set()
        release.wait(60)

    worker = Worker(queue, handler, concurrency=1, grace_s=0.3, idle_ms=50)

    def stop_once_started() -> None:
        started.wait(30)
        worker.stop()

    stopper = threading.Thread(target=stop_once_started)
    stopper.start()
    begun = time.monotonic()
    try:
        stats = worker.run(handle_signals=False)
        return stats, time.monotonic() - begun
    finally:
        release.set()
        stopper.join()


def test_run_returns_soon_after_the_grace_period_beside_a_stuck_handler(
    queue: Queue,
) -> None:
    """A handler stuck past the grace period is given back and not waited for: run() returns
    about when the grace period ends, not after the 30 s allowed for reports."""
    queue.create(b"stuck", channel="a")
    stats, took = _run_stuck(queue)
    [channel] = queue.stats()
    assert (stats.given_back, channel.in_flight) == (1, 0)
    assert took < 20, took  # the reports' wait is 30 s


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_handler_deferring_its_own_message_is_not_counted_lost_while_reported(
    dsn: str, queue: Queue, kind: str
) -> None:
    """Heartbeats go on while a finished handler's outcome is reported (a report may be
    retried): a message the handler deferred itself is then no longer held, which is not a
    lost lock."""
    queue.create(b"x", channel="a")
    if kind == "sync":

        def handler(message: Message) -> None:
            message.defer(dequeue_at=queue.now() + 3_600_000)

        with _StoppingQueue(dsn, schema=queue.schema) as stopping:
            stopping.delay = 0.5
            worker = Worker(
                stopping, handler, concurrency=1, grace_s=5, idle_ms=50, heartbeat_ms=100
            )
            stopping.worker = worker
            stats = worker.run(handle_signals=False)
    else:

        async def async_handler(message: AsyncMessage) -> None:
            await message.defer(dequeue_at=queue.now() + 3_600_000)

        async def main() -> WorkerStats:
            async with _StoppingAsyncQueue(dsn, schema=queue.schema) as stopping:
                stopping.delay = 0.5
                worker = AsyncWorker(
                    stopping,
                    async_handler,
                    concurrency=1,
                    grace_s=5,
                    idle_ms=50,
                    heartbeat_ms=100,
                )
                stopping.worker = worker
                return await worker.run(handle_signals=False)

        stats = asyncio.run(main())
    assert stats.lost == 0
    [channel] = queue.stats()
    assert (channel.size, channel.in_flight) == (1, 0)


def _gives_back(outcomes: Any) -> bool:
    return any(o.kind is OutcomeKind.DEFERRED for o in outcomes)


class _FlakyDeferQueue(Queue):
    """A queue whose first give-back (a report that defers) fails as on a lost connection."""

    failed = 0

    def settle(self, outcomes: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.failed and _gives_back(outcomes):
            self.failed += 1
            raise DatabaseUnavailableError("connection lost (injected)")
        return super().settle(outcomes, *args, **kwargs)


class _FlakyDeferAsyncQueue(AsyncQueue):
    failed = 0

    async def settle(self, outcomes: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.failed and _gives_back(outcomes):
            self.failed += 1
            raise DatabaseUnavailableError("connection lost (injected)")
        return await super().settle(outcomes, *args, **kwargs)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_give_back_rides_out_a_lost_connection(dsn: str, queue: Queue, kind: str) -> None:
    """A handler outlives the grace period and the first try at giving its message back fails
    (a lost connection): it is tried again, as a report is, not left to its lock's expiry."""
    queue.create(b"stuck", channel="a")
    if kind == "sync":
        with _FlakyDeferQueue(dsn, schema=queue.schema) as flaky:
            stats, _ = _run_stuck(flaky)
            assert flaky.failed == 1
    else:

        async def main() -> WorkerStats:
            async with _FlakyDeferAsyncQueue(dsn, schema=queue.schema) as flaky:
                running = asyncio.Event()

                async def async_handler(message: AsyncMessage) -> None:
                    running.set()
                    await asyncio.sleep(60)

                worker = AsyncWorker(flaky, async_handler, concurrency=1, grace_s=0.3, idle_ms=50)
                task = asyncio.create_task(worker.run(handle_signals=False))
                await asyncio.wait_for(running.wait(), 30)
                worker.stop()
                result = await task
                assert flaky.failed == 1
                return result

        stats = asyncio.run(main())
    [channel] = queue.stats()
    assert (stats.given_back, channel.size, channel.in_flight) == (1, 1, 0)
