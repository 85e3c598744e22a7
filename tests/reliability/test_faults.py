"""PostgreSQL restarted in immediate mode under the queue: calls fail with a typed error while
it is down, the same Queue works again once it is back, and the soak with restarts loses
nothing (the long variant: ``tests/reliability/soak.py --restart-every``).

These tests run on a private server of their own (``pgserver.py``), whatever
``$LONNYMQ_TEST_DSN`` says: the machine's server is not theirs to restart.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from lonnymq import AsyncMessage, AsyncQueue, Message, NewMessage, Queue
from lonnymq.errors import DatabaseUnavailableError
from lonnymq.queue import RECONNECT_GIVE_UP_S
from lonnymq.worker import AsyncWorker, Worker, _policy

sys.path.insert(0, str(Path(__file__).parent))
from pgserver import RestartableServer
from test_soak import soak

pytestmark = pytest.mark.own_server


def _archived(server: RestartableServer, schema: str) -> list[tuple[Any, ...]]:
    """Per outcome: the distinct messages archived, and the archive's rows (the same when
    nothing was finished twice)."""
    with psycopg.connect(server.dsn) as conn:
        return conn.execute(
            sql.SQL(
                "SELECT outcome, count(DISTINCT id), count(*) FROM {}.archive GROUP BY 1"
            ).format(sql.Identifier(schema))
        ).fetchall()


@pytest.fixture(scope="module")
def server() -> Iterator[RestartableServer]:
    with RestartableServer() as private:
        yield private
    shutil.rmtree(private.data_dir.parent, ignore_errors=True)


@pytest.fixture
def fault_queue(server: RestartableServer, schema_name: str) -> Iterator[Queue]:
    with Queue(server.dsn, schema=schema_name, pool_size=3) as queue:
        queue.install()
        yield queue


def test_pooled_connections_closed_by_a_restart_are_replaced(
    server: RestartableServer, fault_queue: Queue
) -> None:
    # Fill the pool with several idle connections, all of which the restart closes.
    fault_queue.create_many([])
    with fault_queue.transaction() as one, fault_queue.transaction() as two:
        assert fault_queue.now(conn=one) > 0
        assert fault_queue.now(conn=two) > 0
    server.restart()
    # The first calls after the restart get live connections: nothing fails.
    for i in range(5):
        assert fault_queue.create(f"c{i}".encode()).id is not None
    message = fault_queue.dequeue(lock_ms=10_000)
    assert message is not None
    message.delete()
    assert sum(s.size for s in fault_queue.stats()) == 4


def test_a_call_cut_by_a_restart_raises_unavailable_and_the_queue_recovers(
    server: RestartableServer, fault_queue: Queue
) -> None:
    fault_queue.create(b"kept")

    def cut() -> None:
        with fault_queue.transaction() as conn:
            fault_queue.create(b"rolled back", conn=conn)
            server.restart()
            fault_queue.create(b"never", conn=conn)

    with pytest.raises(DatabaseUnavailableError):
        cut()
    # The same Queue, no new one: the lost transaction left nothing behind.
    assert [s.size for s in fault_queue.stats()] == [1]
    message = fault_queue.dequeue(lock_ms=10_000)
    assert message is not None
    assert message.content == b"kept"
    message.delete()


@pytest.mark.slow
def test_a_call_waiting_through_a_long_outage_goes_through_once_the_server_is_back(
    server: RestartableServer, fault_queue: Queue
) -> None:
    # Down for longer than the pool's reconnection attempts last (RECONNECT_GIVE_UP_S): the
    # pool gives up, and the call must still get a connection once the server is back, not
    # sit out its 30 s wait.
    fault_queue.create(b"before")
    server.kill()
    starter = threading.Timer(RECONNECT_GIVE_UP_S + 3, server.start)
    starter.start()
    try:
        started = time.monotonic()
        created = fault_queue.create(b"through the outage")
        waited = time.monotonic() - started
    finally:
        starter.join()
    assert created.id is not None
    assert waited < 25, f"the call waited {waited:.1f}s: the pool did not try again"
    assert sum(s.size for s in fault_queue.stats()) == 2


def test_a_call_while_the_server_is_down_raises_unavailable_then_the_queue_works(
    server: RestartableServer, schema_name: str
) -> None:
    with Queue(server.dsn, schema=schema_name, pool_size=2, pool_timeout=1.5) as queue:
        queue.install()
        queue.create(b"before")
        server.kill()
        try:
            started = time.monotonic()
            # The pool waits for a connection (pool_timeout), then gives up with a typed error.
            with pytest.raises(DatabaseUnavailableError):
                queue.create(b"while down")
            waited = time.monotonic() - started
        finally:
            server.start()
        # The default would wait 30 s; this one gives up after its 1.5 s (plus a reconnect).
        assert waited < 10, f"the call waited {waited:.1f}s"
        # While the server was down the pool kept trying with a growing delay (1 s, 2 s, 4 s,
        # ...): a call before its next attempt still gives up after 1.5 s, having sent nothing.
        # The queue works again at that attempt, with nothing lost.
        deadline = time.monotonic() + 30
        while True:
            try:
                after = queue.create(b"after")
                break
            except DatabaseUnavailableError:
                assert time.monotonic() < deadline, "the queue did not come back within 30 s"
                time.sleep(0.2)
        assert after.id is not None
        contents = []
        while (message := queue.dequeue(lock_ms=10_000)) is not None:
            contents.append(message.content)
            message.delete()
    assert contents == [b"before", b"after"]


def test_a_short_pool_timeout_fails_fast_on_the_async_queue_too(
    server: RestartableServer, schema_name: str
) -> None:
    async def scenario() -> tuple[float, list[bytes]]:
        async with AsyncQueue(
            server.dsn, schema=schema_name, pool_size=2, pool_timeout=1.5
        ) as queue:
            await queue.install()
            await queue.create(b"before")
            await asyncio.to_thread(server.kill)
            try:
                started = time.monotonic()
                with pytest.raises(DatabaseUnavailableError):
                    await queue.create(b"while down")
                waited = time.monotonic() - started
            finally:
                await asyncio.to_thread(server.start)
            # The pool reconnects on its own backoff, which grew while the server was down: a
            # call soon after the start may still time out (1.5 s), and the next one not.
            deadline = time.monotonic() + 60
            while True:
                try:
                    await queue.create(b"after")
                    break
                except DatabaseUnavailableError:
                    if time.monotonic() > deadline:
                        raise
            taken = await queue.dequeue_many(10, lock_ms=60_000)
            return waited, sorted(m.content for m in taken)

    waited, contents = asyncio.run(scenario())
    assert waited < 10, f"the call waited {waited:.1f}s"
    assert contents == [b"after", b"before"]


def test_the_async_queue_recovers_after_a_restart(
    server: RestartableServer, schema_name: str
) -> None:
    async def cut(queue: AsyncQueue) -> None:
        async with queue.transaction() as conn:
            server.restart()
            await queue.create(b"never", conn=conn)

    async def scenario() -> int:
        async with AsyncQueue(server.dsn, schema=schema_name, pool_size=2) as queue:
            await queue.install()
            await queue.create(b"before")
            server.restart()  # the pool's idle connection is closed: it must not be lent
            await queue.create(b"after a restart")
            with pytest.raises(DatabaseUnavailableError):
                await cut(queue)
            await queue.create(b"after")
            return sum(s.size for s in await queue.stats())

    assert asyncio.run(scenario()) == 3


def test_a_worker_rides_out_restarts_without_being_restarted(
    server: RestartableServer, fault_queue: Queue
) -> None:
    fault_queue.install(archive=True)
    fault_queue.create_many([NewMessage(f"m{i}".encode(), channel=f"c{i % 3}") for i in range(30)])
    seen: list[int] = []

    def handler(message: Message) -> None:
        seen.append(message.id)
        if len(seen) in (10, 20):
            server.restart()  # between this handler's start and its report

    # 10 s locks, as for AsyncWorker below: a dequeue whose commit a restart hid leaves its
    # message locked until then (it comes back; nothing is lost), and a restart takes far less.
    stats = Worker(fault_queue, handler, concurrency=2, lock_ms=10_000).run(
        handle_signals=False, until_idle=True
    )
    # A report cut by a restart may have committed unseen (the retry then finds the message
    # gone), so the worker's own count may be short by one per restart and handler; the
    # archive is not.
    assert 26 <= stats.completed <= 30
    assert sorted(seen) == sorted(set(seen))  # locks outlast a handler: nothing ran twice
    assert len(seen) == 30
    assert sum(s.size for s in fault_queue.stats()) == 0
    assert _archived(server, fault_queue.schema) == [("completed", 30, 30)]


@pytest.mark.parametrize("kind", ["Worker", "AsyncWorker"])
def test_an_outcome_waiting_through_an_outage_is_reported_once_the_server_is_back(
    server: RestartableServer, schema_name: str, kind: str
) -> None:
    # Each report fails within a second (pool_timeout) while the server is down for ten: more
    # than a handful of tries, less than the lock. The outcome must wait for the server rather
    # than be dropped to the lock's expiry (the handler would run again).
    seen: list[int] = []
    down = threading.Event()

    def outage() -> None:
        server.kill()
        down.set()
        threading.Timer(10.0, server.start).start()

    async def run_async() -> int:
        async with AsyncQueue(server.dsn, schema=schema_name, pool_timeout=1.0) as queue:

            async def handler(message: AsyncMessage) -> None:
                seen.append(message.id)
                if len(seen) == 2:
                    await asyncio.to_thread(outage)

            worker = AsyncWorker(queue, handler, concurrency=1, lock_ms=60_000)
            return (await worker.run(handle_signals=False, until_idle=True)).completed

    with Queue(server.dsn, schema=schema_name) as setup:
        setup.install(archive=True)
        setup.create_many([NewMessage(b"m%d" % i, channel="c") for i in range(4)])
    try:
        if kind == "Worker":
            with Queue(server.dsn, schema=schema_name, pool_timeout=1.0) as queue:

                def handler(message: Message) -> None:
                    seen.append(message.id)
                    if len(seen) == 2:
                        outage()

                worker = Worker(queue, handler, concurrency=1, lock_ms=60_000)
                completed = worker.run(handle_signals=False, until_idle=True).completed
        else:
            completed = asyncio.run(run_async())
    finally:
        if down.is_set():
            server.wait_ready()
    assert completed == 4
    assert sorted(seen) == sorted(set(seen))  # nothing ran twice
    assert len(seen) == 4
    assert _archived(server, schema_name) == [("completed", 4, 4)]


def test_a_worker_stopping_during_an_outage_gives_up_its_report_after_grace(
    server: RestartableServer, schema_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A report is retried while its lock may be held (here 10 minutes), but once the worker
    # stops, only until its grace period and REPORT_WAIT_S after it (2 s here) are over.
    monkeypatch.setattr(_policy, "REPORT_WAIT_S", 2.0)
    with Queue(server.dsn, schema=schema_name) as setup:
        setup.install()
        setup.create_many([NewMessage(b"m%d" % i, channel="c") for i in range(2)])
    try:
        with Queue(server.dsn, schema=schema_name, pool_timeout=1.0) as queue:

            def handler(message: Message) -> None:
                server.kill()
                worker.stop()

            worker = Worker(queue, handler, concurrency=1, lock_ms=600_000, grace_s=0.5)
            started = time.monotonic()
            stats = worker.run(handle_signals=False)
            took = time.monotonic() - started
    finally:
        server.start()
    assert took < 0.5 + 2.0 + 10  # (one more try after the last wait: its pool_timeout)
    assert stats.completed == 0
    with Queue(server.dsn, schema=schema_name) as after:  # nothing lost: held until it expires
        assert [(s.channel, s.size, s.in_flight) for s in after.stats()] == [("c", 2, 1)]


def test_an_async_worker_rides_out_restarts_without_being_restarted(
    server: RestartableServer, schema_name: str
) -> None:
    seen: list[int] = []
    problems: list[str] = []

    async def scenario() -> tuple[int, int]:
        async with AsyncQueue(server.dsn, schema=schema_name, pool_size=4) as queue:
            await queue.install(archive=True)
            await queue.create_many(
                [NewMessage(f"m{i}".encode(), channel=f"c{i % 3}") for i in range(30)]
            )

            async def handler(message: AsyncMessage) -> None:
                seen.append(message.id)
                if len(seen) in (10, 20):
                    try:
                        await asyncio.to_thread(server.restart)  # between start and report
                    except Exception as err:  # not the handler's failure: the test's
                        problems.append("\n".join([repr(err), *getattr(err, "__notes__", [])]))

            # 10 s locks: a dequeue whose commit a restart hid leaves its message locked
            # until then (it comes back; nothing is lost), and a restart takes far less.
            worker = AsyncWorker(queue, handler, concurrency=2, lock_ms=10_000)
            stats = await worker.run(handle_signals=False, until_idle=True)
            return stats.completed, sum(s.size for s in await queue.stats())

    completed, left = asyncio.run(scenario())
    assert problems == []
    # As for Worker: a report cut by a restart may have committed unseen.
    assert 26 <= completed <= 30
    assert left == 0
    assert sorted(seen) == sorted(set(seen))  # nothing ran twice
    assert len(seen) == 30
    assert _archived(server, schema_name) == [("completed", 30, 30)]


@pytest.mark.slow
def test_restarts_during_the_soak_lose_nothing_and_finish_nothing_twice(
    server: RestartableServer, schema_name: str
) -> None:
    config = soak.SoakConfig(
        messages=1_000,
        workers=3,
        kill_every_s=2.0,
        restart_every_s=4.0,
        max_restarts=2,
        produce_s=10.0,
        timeout_s=300,
    )
    report = soak.run_soak(server.dsn, schema_name, config, server=server)
    print(report.line())
    assert report.problems == []
    assert report.restarts == 2
    assert report.messages == config.messages  # every producer call was acknowledged once
    assert (report.lost, report.finished_twice, report.violations) == (0, 0, 0)
    assert (report.stale_finishes, report.untyped_errors, report.worker_deaths) == (0, 0, 0)
    assert report.stale_refused >= 1  # the stale holder on purpose was turned away
    # The same facts, read here again on the restarted server.
    with Queue(server.dsn, schema=schema_name) as queue:
        assert sum(s.size for s in queue.stats()) == 0
        assert queue.verify() == []
