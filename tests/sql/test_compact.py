"""Queue.compact(): while an older snapshot keeps VACUUM from removing anything, the queue
rewrites its two high-churn tables with their live rows only, and every message, lock and
channel mark comes through unchanged; it never does so while a transaction has the table open,
nor to ``message`` while a Spark snapshot is held."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from lonnymq import NewMessage, Queue
from lonnymq._core import SNAPSHOT_LOCK_KEY
from lonnymq.errors import InvalidArgumentError
from lonnymq.spark import snapshot
from lonnymq.types import CreateStatus
from lonnymq.worker import Worker

Conn = psycopg.Connection[Any]
Churn = Callable[[Queue, int, int], None]


@pytest.fixture
def holder(dsn: str) -> Iterator[Conn]:
    """A session idle in a REPEATABLE READ transaction whose snapshot predates what the test
    does next, and that has not touched the queue: no VACUUM can remove what dies after it."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        conn.execute("SELECT 1")
        yield conn
        conn.execute("ROLLBACK")


def _rows(admin: Conn, schema: str, table: str) -> list[tuple[Any, ...]]:
    order = "id" if table == "message" else "name"
    return admin.execute(
        sql.SQL("SELECT * FROM {} ORDER BY {}").format(
            sql.Identifier(schema, table), sql.Identifier(order)
        )
    ).fetchall()


def _pages(admin: Conn, schema: str, table: str) -> int:
    row = admin.execute(
        "SELECT pg_relation_size(%s::regclass) / current_setting('block_size')::int",
        [sql.Identifier(schema, table).as_string(admin)],
    ).fetchone()
    assert row is not None
    return int(row[0])


def _dead(admin: Conn, schema: str) -> dict[str, int]:
    admin.execute("SELECT pg_stat_clear_snapshot()")
    return dict(
        admin.execute(
            "SELECT relname::text, n_dead_tup FROM pg_stat_all_tables"
            " WHERE schemaname = %s AND relname IN ('channel', 'message')",
            [schema],
        ).fetchall()
    )


def test_a_compaction_keeps_every_live_message_lock_and_mark(
    queue: Queue, admin: Conn, holder: Conn, churn: Churn
) -> None:
    churn(queue, 6_000, 500)  # 12,000 dead row versions in message, 6,500 in channel
    # Then live state of every kind: waiting (due and scheduled, with a dedup key), deferred
    # with state, locked, and a channel with a policy and its counters.
    now = queue.now()
    queue.channel("limited").set_policy(max_concurrency=3, max_size=100)
    for i in range(5):
        queue.create(f"limited {i}".encode(), channel="limited")
    queue.create(b"later", channel="free", dequeue_at=now + 3_600_000)
    queue.create(b"keyed", channel="free", dedup_key="k1")
    held = queue.dequeue_many(2, lock_ms=600_000)
    assert len(held) == 2
    deferred = queue.dequeue(lock_ms=600_000)
    assert deferred is not None
    deferred.defer(state=b"progress")
    dead = _dead(admin, queue.schema)
    assert dead["message"] >= 10_000, dead
    assert dead["channel"] >= 1_000, dead
    before = {t: _rows(admin, queue.schema, t) for t in ("channel", "message")}
    pages = {t: _pages(admin, queue.schema, t) for t in ("channel", "message")}

    assert queue.compact() == ["channel", "message"]

    after = {t: _rows(admin, queue.schema, t) for t in ("channel", "message")}
    assert after == before
    for table in ("channel", "message"):
        assert _pages(admin, queue.schema, table) < pages[table] / 10, table
    assert queue.verify() == []
    # Nothing left worth a second compaction.
    assert queue.compact() == []
    # The dedup key still names its live message, and the locks are still fenced by their
    # attempts: their holders finish them.
    assert queue.create(b"keyed again", channel="free", dedup_key="k1").status is (
        CreateStatus.DEDUPLICATED
    )
    for locked in held:
        locked.delete()
    taken = []
    while message := queue.dequeue(lock_ms=60_000):
        taken.append(message)
        message.delete()
    # Every due message once (the held ones were finished above), the scheduled one not yet,
    # and the deferred one with its saved state.
    assert sorted([m.content for m in taken] + [m.content for m in held]) == sorted(
        [b"keyed"] + [f"limited {i}".encode() for i in range(5)]
    )
    assert {m.content: m.state for m in taken}[deferred.content] == b"progress"
    # The cost, said in the docs: the old snapshot, reading the table for the first time
    # after the rewrite, finds it empty (TRUNCATE is not MVCC-safe).
    seen = holder.execute(
        sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(queue.schema, "message"))
    ).fetchone()
    assert seen == (0,)


def test_no_compaction_while_a_transaction_has_the_table_open(
    queue: Queue, admin: Conn, holder: Conn, churn: Churn, dsn: str
) -> None:
    churn(queue, 6_000, 10)
    queue.create(b"live", channel="a")
    pages = _pages(admin, queue.schema, "message")
    with psycopg.connect(dsn, autocommit=True) as reader:
        reader.execute("BEGIN")
        reader.execute(
            sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(queue.schema, "message"))
        )
        # It gives up after its tries: had it queued for the lock behind the reader, which
        # commits only below, it would never return.
        assert "message" not in queue.compact()
        assert _pages(admin, queue.schema, "message") == pages
        reader.execute("COMMIT")
    assert "message" in queue.compact()
    assert [m[2] for m in _rows(admin, queue.schema, "message")] == [b"live"]


def test_a_spark_snapshot_lets_compaction_go_as_its_block_ends(dsn: str) -> None:
    """The shared lock that keeps compactions away is released when the block ends, not some
    time after (when the closed connection's backend exits): at once, a compaction's exclusive
    try of it succeeds. Each time of many, the lock and the block one right after the other."""
    with psycopg.connect(dsn, autocommit=True) as other:
        for _ in range(50):
            with snapshot(dsn):
                pass
            with other.transaction():
                row = other.execute(
                    f"SELECT pg_catalog.pg_try_advisory_xact_lock({SNAPSHOT_LOCK_KEY})"
                ).fetchone()
            assert row == (True,)


def test_no_compaction_of_message_while_a_spark_snapshot_is_held(
    queue: Queue, admin: Conn, holder: Conn, churn: Churn, dsn: str
) -> None:
    """A Spark read in the snapshot reads ``message`` (never ``channel``): ``message`` waits
    for the block to end; ``channel``, whose row every take rewrites, is compacted meanwhile."""
    churn(queue, 6_000, 500)  # 12,000 dead row versions in message, 6,500 in channel
    queue.create(b"live", channel="a")
    channels = _rows(admin, queue.schema, "channel")
    with snapshot(dsn) as snap:
        assert queue.compact() == ["channel"]
        assert _rows(admin, queue.schema, "channel") == channels
        with psycopg.connect(dsn) as task:
            task.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            task.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snap)))
            seen = task.execute(
                sql.SQL("SELECT content FROM {}").format(sql.Identifier(queue.schema, "message"))
            ).fetchall()
            assert seen == [(b"live",)]
    assert "message" in queue.compact()


def test_a_fresh_queue_or_a_small_churn_needs_no_compaction(
    queue: Queue, holder: Conn, churn: Churn
) -> None:
    assert queue.compact() == []
    churn(queue, 400, 10)  # 800 dead row versions in message, 410 in channel
    assert queue.compact() == []


def test_a_table_with_more_live_rows_than_allowed_is_left_alone(
    queue: Queue, admin: Conn, holder: Conn, churn: Churn
) -> None:
    churn(queue, 6_000, 10)
    queue.create_many([NewMessage(b"live", channel="a") for _ in range(3)])
    pages = _pages(admin, queue.schema, "message")
    assert "message" not in queue.compact(max_live=2)
    assert _pages(admin, queue.schema, "message") == pages
    assert "message" in queue.compact(max_live=3)


@pytest.mark.parametrize("value", [0, -1, 1_000_001, 1.5, True, "10", None])
def test_bad_max_live_is_refused(queue: Queue, value: object) -> None:
    with pytest.raises(InvalidArgumentError, match="max_live"):
        queue.compact(max_live=value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("table", "max_live", "match"),
    [("archive", 10, "table_name"), (None, 10, "table_name"), ("message", 0, "max_live")],
)
def test_the_function_refuses_bad_arguments(
    queue: Queue, admin: Conn, table: str | None, max_live: int, match: str
) -> None:
    with pytest.raises(psycopg.Error, match=match) as raised:
        admin.execute(
            sql.SQL("SELECT {}.maintenance_compact(%s, %s)").format(sql.Identifier(queue.schema)),
            [table, max_live],
        )
    assert raised.value.sqlstate == "LQ003"


@pytest.mark.slow
def test_compactions_beside_a_running_worker_lose_and_repeat_nothing(
    make_queue: Callable[..., Queue], admin: Conn, holder: Conn, churn: Churn
) -> None:
    queue = make_queue(archive=True)
    churn(queue, 6_000, 10)  # worth a compaction from the start (archived with content b"x")
    total = 8_000
    queue.create_many([NewMessage(f"{i}".encode(), channel=f"c{i % 20}") for i in range(total)])
    handled: list[bytes] = []

    def handle(message: Any) -> None:
        handled.append(message.content)
        time.sleep(0.001)  # 4 slots: the worker runs for 2 s at least

    worker = Worker(queue, handle, concurrency=4, idle_ms=200, maintenance_ms=None)
    thread = threading.Thread(
        target=worker.run, kwargs={"handle_signals": False, "until_idle": True}
    )
    thread.start()
    compactions = 0
    while thread.is_alive():
        compactions += "message" in queue.compact()
        time.sleep(0.02)
    thread.join()
    assert compactions >= 1
    assert sorted(handled, key=int) == [f"{i}".encode() for i in range(total)]
    archived = admin.execute(
        sql.SQL(
            "SELECT outcome, count(*), count(DISTINCT id) FROM {} WHERE content <> 'x'::bytea"
            " GROUP BY outcome"
        ).format(sql.Identifier(queue.schema, "archive"))
    ).fetchall()
    assert archived == [("completed", total, total)]
    assert queue.verify() == []


def test_no_function_that_reads_the_hot_tables_reads_with_its_callers_snapshot(
    queue: Queue, admin: Conn
) -> None:
    # A STABLE function reads with the snapshot of the statement that called it, taken
    # before the function locks the tables it reads: a compaction committed in between would
    # show it the table empty. So every function that reads channel or message is VOLATILE
    # (each of its statements takes its snapshot after its locks).
    rows = admin.execute(
        r"""SELECT p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
        WHERE n.nspname = %s AND p.provolatile <> 'v'
          AND p.prosrc ~* '(FROM|JOIN|UPDATE|INTO)\s+(message|channel)\M|channel_first'
        ORDER BY 1""",
        [queue.schema],
    ).fetchall()
    assert rows == []
    names = admin.execute(
        "SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
        " WHERE n.nspname = %s AND p.prosrc ~* '(FROM|JOIN)\\s+message\\M'",
        [queue.schema],
    ).fetchone()
    assert names is not None
    assert names[0] > 20  # the pattern finds the readers
