"""Fixtures shared by every test: a real PostgreSQL and one fresh schema per test.

The server is ``$LONNYMQ_TEST_DSN`` when set (CI sets it to the machine's PostgreSQL), else an
embedded server started in a temporary directory for the session.
"""

from __future__ import annotations

import itertools
import os
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from lonnymq import Message, NewMessage, Queue
from lonnymq.embedded import embedded_dsn

TEST_DSN_ENV = "LONNYMQ_TEST_DSN"


def _without_commit_waits(dsn: str) -> str:
    """``dsn`` with ``synchronous_commit`` off for every session opened with it (the queue's
    pools, CLI subprocesses, Spark tasks): a commit then returns before its WAL reaches the
    disk. What other sessions see, and when, is unchanged; only a crash of the server could
    lose the last commits, and no test crashes the server it gets here (the restart and
    durability tests run a private server of their own, with every default)."""
    options = conninfo_to_dict(dsn).get("options") or ""
    return make_conninfo(dsn, options=f"{options} -c synchronous_commit=off".strip())


# Every test installs the queue into a schema of its own and drops it: some 150 functions, each
# altered by every later migration, so each install leaves a few thousand dead rows in the
# system catalogs. On a server without autovacuum (as CI's machine server is) they pile up
# from run to run, and every install's scan of pg_proc reads them all. The suite cleans up
# after itself: it vacuums those catalogs when it starts, every DROPS_PER_VACUUM schemas and
# when it ends (as a role that may not, VACUUM only warns).
CATALOGS = ("pg_proc", "pg_attribute", "pg_class", "pg_depend", "pg_type")
DROPS_PER_VACUUM = 100
_drops = itertools.count(1)


def _vacuum_catalogs(dsn: str) -> None:
    names = sql.SQL(", ").join(sql.Identifier("pg_catalog", name) for name in CATALOGS)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("VACUUM {}").format(names))


@pytest.fixture(scope="session")
def dsn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A connection string for the server the tests run against."""
    configured = os.environ.get(TEST_DSN_ENV)
    if configured:
        chosen = _without_commit_waits(configured)
    else:
        chosen = _without_commit_waits(embedded_dsn(tmp_path_factory.mktemp("pg") / "data"))
    _vacuum_catalogs(chosen)
    yield chosen
    _vacuum_catalogs(chosen)


@pytest.fixture
def admin(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection for looking at tables directly."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        yield conn


def _fresh_schema(dsn: str) -> Iterator[str]:
    name = f"t_{uuid.uuid4().hex[:16]}"
    yield name
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))
    if next(_drops) % DROPS_PER_VACUUM == 0:
        _vacuum_catalogs(dsn)


@pytest.fixture
def schema_name(dsn: str) -> Iterator[str]:
    """A schema name no other test uses; the schema is dropped afterwards."""
    yield from _fresh_schema(dsn)


@pytest.fixture
def other_schema(dsn: str) -> Iterator[str]:
    """A second fresh schema name, dropped afterwards."""
    yield from _fresh_schema(dsn)


@pytest.fixture
def make_queue(dsn: str, schema_name: str) -> Iterator[Callable[..., Queue]]:
    """Build installed queues on the test's schema (closed at the end of the test)."""
    made: list[Queue] = []

    def make(*, install: bool = True, archive: bool | None = None, **kwargs: Any) -> Queue:
        kwargs.setdefault("schema", schema_name)
        queue = Queue(dsn, **kwargs)
        made.append(queue)
        if install:
            queue.install(archive=archive)
        return queue

    yield make
    for queue in made:
        queue.close()


@pytest.fixture
def queue(make_queue: Callable[..., Queue]) -> Queue:
    """An installed queue in a fresh schema."""
    return make_queue()


@pytest.fixture
def churn(admin: psycopg.Connection[Any]) -> Callable[[Queue, int, int], None]:
    """Create ``messages`` over ``channels`` in ``queue``, then take and finish them all, on
    the ``admin`` connection, and flush that backend's statistics (PostgreSQL 15+) so that the
    next reader of pg_stat_* counts the dead row versions left behind."""

    def run(queue: Queue, messages: int, channels: int) -> None:
        # Autovacuum (the embedded server runs it) must not clean up behind the test's back.
        for table in ("channel", "message"):
            admin.execute(
                sql.SQL("ALTER TABLE {}.{} SET (autovacuum_enabled = false)").format(
                    sql.Identifier(queue.schema), sql.Identifier(table)
                )
            )
        queue.create_many(
            [NewMessage(b"x", channel=f"c{i % channels}") for i in range(messages)], conn=admin
        )
        while taken := queue.dequeue_many(100, lock_ms=60_000, conn=admin):
            queue.delete_many(taken, conn=admin)
        admin.execute("SELECT pg_stat_force_next_flush()")
        admin.execute("SELECT 1")

    return run


@pytest.fixture
def timed_dequeues() -> Callable[[Queue, int], tuple[list[Message], float]]:
    """``run(queue, n)`` dequeues ``n`` messages one call at a time (each must find one) and
    returns them with the shortest call's duration in seconds: the best of several calls, as a
    loaded machine may stall any one of them."""

    def run(queue: Queue, count: int) -> tuple[list[Message], float]:
        taken: list[Message] = []
        best = float("inf")
        for _ in range(count):
            started = time.monotonic()
            message = queue.dequeue(lock_ms=60_000)
            best = min(best, time.monotonic() - started)
            assert message is not None
            taken.append(message)
        return taken, best

    return run


@pytest.fixture
def report_worker(queue: Queue) -> Callable[..., None]:
    """``report_worker(worker_id, **changes)``: a worker's report of itself into the test's
    queue (``worker_report``, as a Worker sends it once a heartbeat round), ``changes`` made to
    a report of an idle worker."""

    def report(worker_id: str, **changes: Any) -> None:
        params: dict[str, Any] = {
            "id": worker_id,
            "host": "host-1",
            "pid": 42,
            "every_ms": 1000,
            "concurrency": 4,
            "running": 0,
            "message_ids": [],
            "channels": [],
            "served_ms": 0,
            "served_channels": [],
            "served_counts": [],
            "served_other": 0,
        }
        params.update(changes)
        queue._fetch("worker_report", params, None)

    return report
