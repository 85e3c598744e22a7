"""Queue.maintain(): the queue vacuums its own high-churn tables once they hold enough dead
row versions, and leaves them alone otherwise; the worker runtime calls it periodically."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from lonnymq import AsyncQueue, NewMessage, Queue
from lonnymq.errors import InvalidArgumentError
from lonnymq.worker import AsyncWorker, Worker

Conn = psycopg.Connection[Any]
Churn = Callable[[Queue, int, int], None]


def _vacuums(admin: Conn, schema: str) -> dict[str, int]:
    rows = admin.execute(
        "SELECT relname::text, vacuum_count FROM pg_stat_all_tables"
        " WHERE schemaname = %s AND relname IN ('channel', 'message')",
        [schema],
    ).fetchall()
    return dict(rows)


def _no_older_snapshots(conn: Conn, timeout_s: float = 60.0) -> None:
    """Wait until no other session of ``conn``'s database holds a snapshot or a transaction
    that began before this call: VACUUM may then remove every row version deleted so far.
    (Here, in a database of the test's own, the only other sessions are the queue's idle pool
    and autovacuum, whose ANALYZE holds a snapshot for a moment.)"""
    marker = conn.execute("SELECT xid(pg_current_xact_id())::text").fetchone()
    assert marker is not None
    deadline = time.monotonic() + timeout_s
    while True:
        older = conn.execute(
            "SELECT pid, backend_type, state, xact_start::text FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            " AND greatest(age(backend_xmin), age(backend_xid)) > age(%s::xid)",
            [marker[0]],
        ).fetchall()
        if not older:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"sessions still hold a snapshot older than the churn: {older}")
        time.sleep(0.05)


class TestOnADatabaseOfItsOwn:
    """VACUUM removes a dead row version only once no snapshot in the same database can still
    see it. A test that checks what a VACUUM removed therefore runs in a database of its own:
    on a shared server, any other client's transaction that began before the churn ended
    (another test run, a benchmark, autovacuum's ANALYZE of some other table) would keep rows
    the VACUUM then reports as still dead, and ``maintain()`` would rightly find the table due
    again. Within its own database, the test waits out autovacuum's snapshots as well."""

    @pytest.fixture(scope="class")
    @classmethod
    def dsn(cls, dsn: str) -> Iterator[str]:
        name = f"t_{uuid.uuid4().hex[:16]}"
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("CREATE DATABASE {} TEMPLATE template0").format(sql.Identifier(name))
            )
        yield make_conninfo(dsn, dbname=name)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))

    def test_maintain_vacuums_the_tables_that_gathered_dead_rows_and_only_those(
        self, queue: Queue, admin: Conn, churn: Churn
    ) -> None:
        before = _vacuums(admin, queue.schema)
        assert queue.maintain() == []  # a fresh queue: nothing to do
        churn(queue, 3_000, 600)
        _no_older_snapshots(admin)
        assert queue.maintain() == ["channel", "message"]
        after = _vacuums(admin, queue.schema)
        assert after["channel"] == before["channel"] + 1
        assert after["message"] == before["message"] + 1
        # VACUUM removed every dead row: nothing is due until more churn.
        assert queue.maintain() == []
        assert _vacuums(admin, queue.schema) == after
        # The queue works on as before.
        queue.create(b"after", channel="c1")
        taken = queue.dequeue(lock_ms=60_000)
        assert taken is not None
        assert taken.content == b"after"
        taken.delete()
        assert {op.name for op in queue.operation_stats()} >= {"maintenance_due", "vacuum"}

    def test_a_vacuum_an_older_snapshot_held_back_is_not_repeated_before_more_churn(
        self, dsn: str, queue: Queue, churn: Churn
    ) -> None:
        with psycopg.connect(dsn, autocommit=True) as holder:
            holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            holder.execute("SELECT 1")  # the snapshot: it still sees every row churned below
            churn(queue, 3_000, 600)
            assert queue.maintain() == ["channel", "message"]
            # That VACUUM could remove none of the rows; another one would remove none either.
            assert queue.maintain() == []
            # Rows that die after it count: enough of them make the tables due again.
            churn(queue, 3_000, 600)
            assert queue.maintain() == ["channel", "message"]
            assert queue.maintain() == []
            holder.execute("ROLLBACK")


def test_after_a_statistics_reset_the_dead_rows_count_whole(
    queue: Queue, admin: Conn, churn: Churn
) -> None:
    # maintain() counts the dead rows made since its last VACUUM by the statistics' running
    # totals: once those are reset, they are below what it recorded, and it counts the dead
    # rows the statistics report instead.
    churn(queue, 3_000, 600)
    assert queue.maintain() == ["channel", "message"]
    for table in ("channel", "message"):
        admin.execute(
            "SELECT pg_stat_reset_single_table_counters(%s::regclass)",
            [sql.Identifier(queue.schema, table).as_string(admin)],
        )
    churn(queue, 1_500, 10)  # fewer updates and deletes than before the reset
    assert "message" in queue.maintain()


def test_a_small_churn_is_not_worth_a_vacuum(queue: Queue, churn: Churn) -> None:
    churn(queue, 50, 5)
    assert queue.maintain() == []


def test_async_maintain_vacuums_too(dsn: str, queue: Queue, churn: Churn) -> None:
    churn(queue, 3_000, 600)

    async def main() -> list[str]:
        async with AsyncQueue(dsn, schema=queue.schema) as aqueue:
            return await aqueue.maintain()

    assert asyncio.run(main()) == ["channel", "message"]


def test_workers_maintain_the_queue_while_they_run(dsn: str, queue: Queue) -> None:
    queue.create_many([NewMessage(b"x", channel=f"c{i % 50}") for i in range(300)])
    worker = Worker(queue, lambda message: None, concurrency=2, idle_ms=100, maintenance_ms=20)
    worker.run(handle_signals=False, until_idle=True)
    calls = {op.name: op.calls for op in queue.operation_stats()}
    assert calls.get("maintenance_due", 0) >= 1

    async def main() -> int:
        async with AsyncQueue(dsn, schema=queue.schema) as aqueue:
            await aqueue.create_many([NewMessage(b"y", channel="a") for _ in range(100)])
            runner = AsyncWorker(aqueue, _noop, concurrency=2, idle_ms=100, maintenance_ms=20)
            await runner.run(handle_signals=False, until_idle=True)
            return {op.name: op.calls for op in aqueue.operation_stats()}.get("maintenance_due", 0)

    assert asyncio.run(main()) >= 1


def test_workers_without_maintenance_never_call_it(queue: Queue) -> None:
    queue.create_many([NewMessage(b"x", channel="a") for _ in range(100)])
    Worker(queue, lambda message: None, idle_ms=100, maintenance_ms=None).run(
        handle_signals=False, until_idle=True
    )
    assert "maintenance_due" not in {op.name for op in queue.operation_stats()}


async def _noop(message: Any) -> None:
    return None


@pytest.mark.parametrize("value", [0, 9, -1, 1.5, True, "1000", 7 * 24 * 3_600_000 + 1])
def test_bad_maintenance_intervals_are_refused(queue: Queue, value: object) -> None:
    with pytest.raises(InvalidArgumentError, match="maintenance_ms"):
        Worker(queue, lambda message: None, maintenance_ms=value)  # type: ignore[arg-type]
