"""A worker's report of itself in the queue's worker table (what the dashboard's workers page
shows): one upsert a heartbeat round, whatever it runs, with what it runs now; its row marked
stopped when its run ends; a dead worker's row ages and is removed after an hour."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg import sql

from lonnymq import AsyncMessage, AsyncQueue, Message, NewMessage, Queue
from lonnymq.errors import InvalidArgumentError, InvalidChannelError
from lonnymq.worker import AsyncWorker, Worker

WAIT_S = 30.0
COLUMNS = "host, pid, concurrency, running, message_ids, channels, stopped_at, seen_at, started_at"


def _rows(admin: psycopg.Connection[Any], queue: Queue) -> list[tuple[Any, ...]]:
    return admin.execute(
        sql.SQL("SELECT " + COLUMNS + " FROM {}.worker ORDER BY started_at").format(
            sql.Identifier(queue.schema)
        )
    ).fetchall()


def _wait_for(
    admin: psycopg.Connection[Any], queue: Queue, ok: Callable[[list[tuple[Any, ...]]], bool]
) -> list[tuple[Any, ...]]:
    """The worker table once ``ok`` holds of it (a worker reports once a round: polled)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        rows = _rows(admin, queue)
        if ok(rows):
            return rows
        assert time.monotonic() < deadline, f"the worker table never got there: {rows}"
        time.sleep(0.02)


def test_a_running_worker_reports_what_it_runs_and_its_stop(
    queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    ids = [r.id for r in queue.create_many([NewMessage(b"x", channel=f"c{i}") for i in range(3)])]
    release = threading.Event()
    started: list[int] = []

    def handler(message: Message) -> None:
        started.append(message.id)
        assert release.wait(WAIT_S)

    worker = Worker(queue, handler, concurrency=5, lock_ms=3_000, heartbeat_ms=100)
    thread = threading.Thread(target=worker.run, kwargs={"handle_signals": False})
    thread.start()
    try:
        (row,) = _wait_for(admin, queue, lambda rows: len(rows) == 1 and rows[0][3] == 3)
        host, pid, concurrency, running, message_ids, channels, stopped_at, _, _ = row
        assert (host, pid, concurrency, running, stopped_at) == (
            socket.gethostname(),
            os.getpid(),
            5,
            3,
            None,
        )
        assert sorted(zip(message_ids, channels, strict=True)) == [
            (ids[i], f"c{i}") for i in range(3)
        ]
    finally:
        release.set()
        worker.stop()
        thread.join(WAIT_S)
    assert not thread.is_alive()
    (row,) = _rows(admin, queue)
    assert row[3:7] == (0, [], [], row[6])
    assert row[6] is not None  # stopped


def test_a_report_is_written_once_a_round_not_per_message(
    queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    """With rounds a minute apart, a worker that finishes 200 messages writes its row twice:
    its first report, as it starts, and its stop (counted by a trigger of the test's own)."""
    read_log = _log_writes(admin, queue, [("op", "TEXT", "TG_OP")], "INSERT OR UPDATE OR DELETE")
    queue.create_many([NewMessage(b"x", channel=f"c{i % 7}") for i in range(200)])
    stats = Worker(queue, lambda m: None, lock_ms=180_000, heartbeat_ms=60_000).run(
        handle_signals=False, until_idle=True
    )
    assert stats.completed == 200
    writes = admin.execute(read_log).fetchall()
    assert writes == [("INSERT",), ("UPDATE",)]
    (row,) = _rows(admin, queue)
    assert row[6] is not None  # the update was the stop


def _log_writes(
    admin: psycopg.Connection[Any],
    queue: Queue,
    columns: list[tuple[str, str, str]],
    ops: str = "INSERT OR UPDATE",
) -> sql.Composed:
    """Log each write (``ops``) of the worker table into a table of the test's own, by a
    trigger, so that no write goes unseen: ``columns`` are (name, type, value from the
    trigger). Returns the query that reads the log, oldest first."""
    schema = sql.Identifier(queue.schema)
    names = sql.SQL(", ").join(sql.Identifier(name) for name, _, _ in columns)
    admin.execute(
        sql.SQL("CREATE TABLE {}.worker_log (at BIGSERIAL, {})").format(
            schema, sql.SQL(", ").join(sql.SQL(f"{name} {kind}") for name, kind, _ in columns)
        )
    )
    admin.execute(
        sql.SQL(
            "CREATE FUNCTION {}.worker_logged() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
            " INSERT INTO {}.worker_log ({}) VALUES ({}); RETURN NULL; END $$"
        ).format(
            schema, schema, names, sql.SQL(", ").join(sql.SQL(value) for _, _, value in columns)
        )
    )
    admin.execute(
        sql.SQL(
            "CREATE TRIGGER logged AFTER " + ops + " ON {}.worker"
            " FOR EACH ROW EXECUTE FUNCTION {}.worker_logged()"
        ).format(schema, schema)
    )
    return sql.SQL("SELECT {} FROM {}.worker_log ORDER BY at").format(names, schema)


def _served(reports: list[tuple[Any, ...]]) -> dict[str, int]:
    """The messages taken per channel, summed over ``reports``, each checked: a report that
    names a channel covers some time, and names its channels once each."""
    total: dict[str, int] = {}
    for served_ms, channels, counts, other in reports:
        assert other == 0
        assert len(set(channels)) == len(channels) == len(counts)
        assert served_ms > 0 or not channels
        for channel, count in zip(channels, counts, strict=True):
            total[channel] = total.get(channel, 0) + count
    return total


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_worker_reports_what_it_took_from_each_channel(
    kind: str, dsn: str, queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    """Summed over its reports, what a worker says it took from each channel is exactly what
    it took: 15, 10 and 5 messages of three channels, all held by blocked handlers."""
    read_log = _log_writes(
        admin,
        queue,
        [
            ("served_ms", "BIGINT", "NEW.served_ms"),
            ("channels", "TEXT[]", "NEW.served_channels"),
            ("counts", "BIGINT[]", "NEW.served_counts"),
            ("other", "BIGINT", "NEW.served_other"),
        ],
    )
    sizes = {"a": 15, "b": 10, "c": 5}
    queue.create_many(
        [NewMessage(b"x", channel=name) for name, n in sizes.items() for _ in range(n)]
    )

    def counted() -> dict[str, int]:
        return _served(admin.execute(read_log).fetchall())

    def wait_counted(deadline: float) -> bool:
        return counted() == sizes or time.monotonic() > deadline

    if kind == "sync":
        release = threading.Event()
        worker = Worker(
            queue, lambda m: release.wait(WAIT_S), concurrency=30, lock_ms=3_000, heartbeat_ms=100
        )
        thread = threading.Thread(target=worker.run, kwargs={"handle_signals": False})
        thread.start()
        try:
            deadline = time.monotonic() + WAIT_S
            while not wait_counted(deadline):
                time.sleep(0.02)
        finally:
            release.set()
            worker.stop()
            thread.join(WAIT_S)
        assert not thread.is_alive()
    else:

        async def main() -> None:
            release = asyncio.Event()

            async def handler(message: AsyncMessage) -> None:
                await release.wait()

            async with AsyncQueue(dsn, schema=queue.schema) as aqueue:
                worker = AsyncWorker(
                    aqueue, handler, concurrency=30, lock_ms=3_000, heartbeat_ms=100
                )
                task = asyncio.create_task(worker.run(handle_signals=False))
                deadline = time.monotonic() + WAIT_S
                while not wait_counted(deadline):
                    await asyncio.sleep(0.02)
                release.set()
                worker.stop()
                await asyncio.wait_for(task, WAIT_S)

        asyncio.run(main())
    assert counted() == sizes
    # The stop clears the counts: a stopped worker serves nothing.
    (row,) = admin.execute(
        sql.SQL(
            "SELECT served_ms, served_channels, served_counts, served_other FROM {}.worker"
        ).format(sql.Identifier(queue.schema))
    ).fetchall()
    assert row == (0, [], [], 0)


def test_an_async_worker_reports_itself_too(dsn: str, queue: Queue, admin: Any) -> None:
    queue.create(b"x", channel="async")

    async def main() -> None:
        release = asyncio.Event()

        async def handler(message: AsyncMessage) -> None:
            await release.wait()

        async with AsyncQueue(dsn, schema=queue.schema) as aqueue:
            worker = AsyncWorker(aqueue, handler, concurrency=2, lock_ms=3_000, heartbeat_ms=100)
            task = asyncio.create_task(worker.run(handle_signals=False))
            deadline = time.monotonic() + WAIT_S
            while not any(r[3] == 1 for r in _rows(admin, queue)):
                assert time.monotonic() < deadline, _rows(admin, queue)
                await asyncio.sleep(0.02)
            (row,) = _rows(admin, queue)
            assert (row[2], row[3], row[5], row[6]) == (2, 1, ["async"], None)
            release.set()
            worker.stop()
            await asyncio.wait_for(task, WAIT_S)

    asyncio.run(main())
    (row,) = _rows(admin, queue)
    assert row[3] == 0
    assert row[6] is not None


def test_reports_are_checked_and_old_rows_removed(
    queue: Queue, admin: psycopg.Connection[Any], report_worker: Callable[..., None]
) -> None:
    report_worker("w1", running=1, message_ids=[7], channels=["c"])
    before = _rows(admin, queue)
    for changes, error in (
        ({"id": ""}, InvalidArgumentError),
        ({"id": "x" * 65}, InvalidArgumentError),
        ({"host": "h" * 256}, InvalidArgumentError),
        ({"pid": -1}, InvalidArgumentError),
        ({"concurrency": 0}, InvalidArgumentError),
        ({"every_ms": 0}, InvalidArgumentError),
        ({"running": -1}, InvalidArgumentError),
        ({"message_ids": [1, 2]}, InvalidArgumentError),
        ({"message_ids": [None], "channels": ["c"]}, InvalidArgumentError),
        ({"message_ids": list(range(101)), "channels": ["c"] * 101}, InvalidArgumentError),
        ({"message_ids": [7], "channels": [""]}, InvalidChannelError),
        ({"served_ms": -1}, InvalidArgumentError),
        ({"served_ms": 86_400_001}, InvalidArgumentError),
        ({"served_other": -1}, InvalidArgumentError),
        ({"served_channels": ["c"]}, InvalidArgumentError),
        ({"served_channels": ["c"], "served_counts": [0]}, InvalidArgumentError),
        ({"served_channels": ["c"], "served_counts": [None]}, InvalidArgumentError),
        (
            {"served_channels": [f"c{i}" for i in range(101)], "served_counts": [1] * 101},
            InvalidArgumentError,
        ),
        ({"served_channels": [""], "served_counts": [1]}, InvalidChannelError),
    ):
        with pytest.raises(error):
            report_worker("w2", **changes)
    assert _rows(admin, queue) == before
    # A row not seen for an hour goes with the next report of any worker.
    queue.set_clock_offset(3_600_001)
    report_worker("w2")
    assert [r[0] for r in _rows(admin, queue)] == ["host-1"]
    (count,) = admin.execute(
        sql.SQL("SELECT count(*) FROM {}.worker WHERE id = 'w1'").format(
            sql.Identifier(queue.schema)
        )
    ).fetchall()
    assert count == (0,)
