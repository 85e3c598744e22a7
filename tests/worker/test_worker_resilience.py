"""Worker gaps beyond the basics: crash-loop bound, a lost connection, metrics, options."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from lonnymq import AckStatus, AsyncMessage, AsyncQueue, Message, NewMessage, Queue
from lonnymq.errors import InvalidArgumentError
from lonnymq.metrics import MetricsServer, OperationStats, WorkerMetrics
from lonnymq.worker import AsyncWorker, Backoff, Worker, WorkerStats
from lonnymq.worker._policy import reconnect_delay


def test_a_message_past_max_attempts_fails_without_running(
    make_queue: Callable[..., Queue], admin: psycopg.Connection[Any], schema_name: str
) -> None:
    queue = make_queue(archive=True)
    queue.create(b"crashes its worker", channel="c")
    # Three workers died holding it: each dequeue counted an attempt, the locks expired.
    for round_ in range(1, 4):
        queue.set_clock_offset(round_ * 10_000)
        assert queue.dequeue(lock_ms=1_000) is not None
    queue.set_clock_offset(40_000)
    ran: list[int] = []
    stats = Worker(queue, lambda m: ran.append(m.id), max_attempts=3).run(
        handle_signals=False, until_idle=True
    )
    assert ran == []
    assert stats.failed == 1
    row = admin.execute(
        sql.SQL("SELECT outcome, error, num_attempts FROM {}.archive").format(
            sql.Identifier(schema_name)
        )
    ).fetchone()
    assert row is not None
    assert row[0] == "failed"
    assert "exceeds max_attempts=3" in row[1]
    assert row[2] == 4


def test_worker_survives_its_connections_being_killed(
    dsn: str, make_queue: Callable[..., Queue], admin: psycopg.Connection[Any]
) -> None:
    app = f"lmq_{uuid.uuid4().hex[:10]}"
    make_queue(archive=True)  # installs
    queue = make_queue(install=False, event_channel=None)
    worker_queue = Queue(make_conninfo(dsn, application_name=app), schema=queue.schema)
    queue.create_many([NewMessage(f"m{i}".encode(), channel=f"c{i % 3}") for i in range(30)])
    seen: list[int] = []
    killed = threading.Event()

    def kill_worker_connections() -> int:
        rows = admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
            (app,),
        ).fetchall()
        return len(rows)

    def handler(message: Message) -> None:
        seen.append(message.id)
        if len(seen) == 10 and not killed.is_set():
            assert kill_worker_connections() >= 1
            killed.set()

    try:
        stats = Worker(worker_queue, handler, concurrency=1, lock_ms=30_000).run(
            handle_signals=False, until_idle=True
        )
    finally:
        worker_queue.close()
    assert killed.is_set()
    assert stats.completed == 30
    assert sorted(set(seen)) == sorted(seen)  # each handled once: nothing redone, nothing lost
    assert len(seen) == 30
    assert queue.stats() == []


def test_metrics_endpoint_serves_counters_histograms_and_depth(
    make_queue: Callable[..., Queue],
) -> None:
    queue = make_queue()
    queue.create_many([NewMessage(b"x", channel="m1"), NewMessage(b"y", channel="m2")])
    metrics = WorkerMetrics()

    def handler(message: Message) -> None:
        if message.content == b"y":
            raise ValueError("no")

    Worker(
        queue, handler, max_attempts=1, metrics=metrics, backoff=Backoff(base_ms=1, max_ms=1)
    ).run(handle_signals=False, until_idle=True)
    queue.create(b"later", channel="m2", dequeue_at=queue.now() + 3_600_000)
    stats = [(s.channel, s.size, s.in_flight) for s in queue.stats()]
    server = MetricsServer(lambda: metrics.render(queue.operation_stats, stats), port=0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics") as response:
            body = response.read().decode()
            assert response.headers["Content-Type"].startswith("text/plain")
    finally:
        server.close()
    assert 'lonnymq_worker_messages_total{channel="m1",event="completed"} 1' in body
    assert 'lonnymq_worker_messages_total{channel="m2",event="failed"} 1' in body
    assert 'lonnymq_worker_messages_total{channel="m2",event="handler_error"} 1' in body
    assert 'lonnymq_handler_seconds_count{channel="m1"} 1' in body
    assert 'lonnymq_channel_size{channel="m2"} 1' in body
    assert 'lonnymq_sql_calls_total{operation="message_settle"}' in body


def test_metrics_render_reads_sql_totals_after_the_counters() -> None:
    # A scrape that read the SQL totals first, then (after a slow query) the counters, showed a
    # worker's completions without the calls that made them (a CLI test failed so under load).
    metrics = WorkerMetrics()
    calls: list[OperationStats] = []

    def operations() -> list[OperationStats]:
        # A worker finishing a message while the scrape runs: its call, then its count.
        calls.append(OperationStats("message_complete_and_dequeue", len(calls) + 1, 0, 0.001))
        metrics.count("completed", "c")
        return list(calls)

    body = metrics.render(operations, None)
    assert 'lonnymq_sql_calls_total{operation="message_complete_and_dequeue"} 1' in body
    assert "completed" not in body  # counted after the totals were read: next scrape
    again = metrics.render(operations, None)
    assert 'event="completed"} 1' in again
    assert 'lonnymq_sql_calls_total{operation="message_complete_and_dequeue"} 2' in again


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"concurrency": 0}, "concurrency"),
        ({"lock_ms": 10}, "lock_ms"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"heartbeat_ms": 30_000}, "heartbeat_ms"),
        ({"grace_s": -1}, "grace_s"),
        ({"backoff": 5}, "backoff"),
        ({"dead_letter_channel": "lonnymq.schedules"}, "reserved"),
    ],
)
def test_bad_worker_options_are_refused(queue: Queue, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        Worker(queue, lambda m: None, **kwargs)


def test_bad_backoff_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="Backoff"):
        Backoff(base_ms=10, max_ms=5)


def test_reconnect_delays_start_at_a_tenth_of_a_second_and_double_up_to_30() -> None:
    delays = [reconnect_delay(failures) for failures in range(1, 12)]
    assert delays[:4] == [0.1, 0.2, 0.4, 0.8]
    assert delays[-1] == 30.0
    assert delays == sorted(delays)


# -- heartbeats and slots ------------------------------------------------------------------


@contextlib.contextmanager
def _competitor(other: Queue) -> Iterator[list[int]]:
    """Another consumer dequeuing every 50 ms while the block runs, from the moment every
    message is locked (the worker has taken them all: a competitor that started first could
    take them itself on a slow start); yields the ids it took."""
    taken: list[int] = []
    stop = threading.Event()
    waiting = sql.SQL("SELECT count(*) FROM {}.message WHERE NOT is_locked").format(
        sql.Identifier(other.schema)
    )

    def compete() -> None:
        with psycopg.connect(other.dsn, autocommit=True) as conn:
            while not stop.wait(0.01):
                row = conn.execute(waiting).fetchone()
                if row is not None and row[0] == 0:
                    break
        while not stop.wait(0.05):
            taken.extend(m.id for m in other.dequeue_many(10, lock_ms=60_000))

    thread = threading.Thread(target=compete)
    thread.start()
    try:
        yield taken
    finally:
        stop.set()
        thread.join()


@pytest.mark.parametrize("use_async", [False, True], ids=["Worker", "AsyncWorker"])
def test_heartbeats_do_not_wait_for_handlers_holding_the_pool(
    dsn: str, make_queue: Callable[..., Queue], use_async: bool
) -> None:
    """Handlers that finish their message in a transaction of their own hold every connection
    of a small pool for longer than the lock: the heartbeats, on a connection of their own,
    still renew the locks, so another consumer never gets those messages while they run."""
    queue = make_queue(pool_size=2)
    queue.create_many([NewMessage(b"x", channel=f"c{i}") for i in range(2)])
    with _competitor(make_queue(install=False)) as taken_by_other:
        if use_async:

            async def main() -> WorkerStats:
                async with AsyncQueue(dsn, schema=queue.schema, pool_size=2) as aqueue:

                    async def handler(message: AsyncMessage) -> None:
                        async with aqueue.transaction() as conn:
                            await conn.execute("SELECT pg_sleep(1.5)")  # the business work
                            await message.delete(conn=conn)

                    worker = AsyncWorker(aqueue, handler, concurrency=2, lock_ms=600, idle_ms=50)
                    return await worker.run(handle_signals=False, until_idle=True)

            stats = asyncio.run(main())
        else:

            def handler(message: Message) -> None:
                with queue.transaction() as conn:
                    conn.execute("SELECT pg_sleep(1.5)")  # the business work
                    message.delete(conn=conn)

            worker = Worker(queue, handler, concurrency=2, lock_ms=600, idle_ms=50)
            stats = worker.run(handle_signals=False, until_idle=True)
    assert taken_by_other == []
    assert (stats.lost, stats.retried) == (0, 0)
    assert queue.stats() == []


@pytest.mark.parametrize("use_async", [False, True], ids=["Worker", "AsyncWorker"])
def test_a_yielding_handler_still_holds_its_slot(
    dsn: str, make_queue: Callable[..., Queue], use_async: bool
) -> None:
    """A handler yields (defers its message to now) and goes on working: the message is taken
    again and runs beside it, and the two runs take both slots of concurrency 2 (before, the
    second run replaced the first in the count and a third handler started)."""
    queue = make_queue()
    queue.create(b"yielder", channel="y")
    later = queue.now() + 300
    queue.create_many([NewMessage(b"plain", channel=f"p{i}", dequeue_at=later) for i in range(3)])
    guard = threading.Lock()
    current = 0
    peak = 0

    def enter() -> None:
        nonlocal current, peak
        with guard:
            current += 1
            peak = max(peak, current)

    def leave() -> None:
        nonlocal current
        with guard:
            current -= 1

    if use_async:

        async def main() -> WorkerStats:
            async with AsyncQueue(dsn, schema=queue.schema) as aqueue:

                async def handler(message: AsyncMessage) -> None:
                    enter()
                    try:
                        if message.content == b"yielder" and message.num_attempts == 1:
                            await message.defer()
                        await asyncio.sleep(0.6)
                    finally:
                        leave()

                worker = AsyncWorker(aqueue, handler, concurrency=2, idle_ms=20)
                return await worker.run(handle_signals=False, until_idle=True)

        stats = asyncio.run(main())
    else:

        def handler(message: Message) -> None:
            enter()
            try:
                if message.content == b"yielder" and message.num_attempts == 1:
                    message.defer()
                time.sleep(0.6)
            finally:
                leave()

        stats = Worker(queue, handler, concurrency=2, idle_ms=20).run(
            handle_signals=False, until_idle=True
        )
    assert peak == 2
    assert (stats.completed, stats.lost) == (4, 0)
    assert queue.stats() == []


def test_async_worker_runs_as_many_plain_handlers_as_its_concurrency(
    dsn: str, make_queue: Callable[..., Queue]
) -> None:
    """Plain functions run in threads the worker owns, one per slot: the default executor
    (min(32, CPUs + 4) threads) would have left messages locked and waiting."""
    queue = make_queue()
    queue.create_many([NewMessage(b"x", channel=f"c{i}") for i in range(40)])
    barrier = threading.Barrier(40, timeout=20)

    def handler(message: AsyncMessage) -> None:
        barrier.wait()  # passes only when all 40 run at once

    async def main() -> WorkerStats:
        async with AsyncQueue(dsn, schema=queue.schema) as aqueue:
            worker = AsyncWorker(aqueue, handler, concurrency=40, idle_ms=20)
            return await worker.run(handle_signals=False, until_idle=True)

    stats = asyncio.run(main())
    assert (stats.completed, stats.retried) == (40, 0)


def test_heartbeat_many_reports_each_message(queue: Queue) -> None:
    queue.create_many([NewMessage(b"a"), NewMessage(b"b")])
    first, second = queue.dequeue_many(2, lock_ms=1_000)
    second.delete()
    queue.set_clock_offset(2_000)  # first's lock expires and another attempt takes it
    again = queue.dequeue(lock_ms=60_000)
    assert again is not None
    assert again.id == first.id
    assert queue.heartbeat_many([again, first, second], lock_ms=30_000) == [
        AckStatus.OK,
        AckStatus.STALE,
        AckStatus.NOT_FOUND,
    ]
    assert queue.heartbeat_many([], lock_ms=30_000) == []
    with pytest.raises(InvalidArgumentError):
        queue.heartbeat_many([again], lock_ms=0)


def test_heartbeat_many_skips_a_row_another_transaction_holds(dsn: str, queue: Queue) -> None:
    """A message finished in a transaction not yet committed is 'busy' to heartbeat_many,
    which renews the others at once instead of waiting for that transaction."""
    queue.create_many([NewMessage(b"a"), NewMessage(b"b")])
    first, second = queue.dequeue_many(2, lock_ms=60_000)
    with psycopg.connect(dsn) as finishing, psycopg.connect(dsn, autocommit=True) as beat:
        first.delete(conn=finishing)  # holds first's row until it commits
        beat.execute("SET lock_timeout = '5s'")  # waiting would fail the call, not hang
        statuses = queue.heartbeat_many([first, second], lock_ms=120_000, conn=beat)
        assert statuses == [AckStatus.BUSY, AckStatus.OK]
        finishing.commit()
    assert queue.heartbeat_many([first, second], lock_ms=120_000) == [
        AckStatus.NOT_FOUND,
        AckStatus.OK,
    ]
    assert queue.stats()[0].in_flight == 1


@pytest.mark.parametrize("use_async", [False, True], ids=["Worker", "AsyncWorker"])
def test_a_handler_finishing_in_its_own_transaction_does_not_stop_the_others_heartbeats(
    dsn: str, make_queue: Callable[..., Queue], use_async: bool
) -> None:
    """Handler "a" finishes its message in its own transaction and keeps working before the
    commit; handler "b" works as long. The round of heartbeats must not wait for a's row:
    b's lock (shorter than its work) is renewed, and no other consumer gets b's message."""
    queue = make_queue()
    queue.create_many([NewMessage(b"a", channel="a"), NewMessage(b"b", channel="b")])
    with _competitor(make_queue(install=False)) as taken_by_other:
        if use_async:

            async def main() -> WorkerStats:
                async with AsyncQueue(dsn, schema=queue.schema) as aqueue:

                    async def handler(message: AsyncMessage) -> None:
                        if message.content == b"a":
                            async with aqueue.transaction() as conn:
                                await message.delete(conn=conn)
                                await conn.execute("SELECT pg_sleep(2)")  # more work
                        else:
                            await asyncio.sleep(2)

                    worker = AsyncWorker(aqueue, handler, concurrency=2, lock_ms=900, idle_ms=50)
                    return await worker.run(handle_signals=False, until_idle=True)

            stats = asyncio.run(main())
        else:

            def handler(message: Message) -> None:
                if message.content == b"a":
                    with queue.transaction() as conn:
                        message.delete(conn=conn)
                        conn.execute("SELECT pg_sleep(2)")  # more work
                else:
                    time.sleep(2)

            worker = Worker(queue, handler, concurrency=2, lock_ms=900, idle_ms=50)
            stats = worker.run(handle_signals=False, until_idle=True)
    assert taken_by_other == []
    assert stats.lost == 0
    assert queue.stats() == []
