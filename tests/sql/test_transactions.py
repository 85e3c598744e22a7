"""Caller transactions, schema isolation, install, and the archive."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import dict_row, namedtuple_row

from lonnymq import CreateStatus, InvalidArgumentError, NewMessage, Queue
from lonnymq.migrate import latest_version
from lonnymq.migrate import migrations as all_migrations

LOCK_MS = 60_000


def archive_rows(admin: psycopg.Connection[Any], schema: str) -> list[tuple[Any, ...]]:
    query = sql.SQL(
        "SELECT id, channel, content, state, num_attempts, outcome, error,"
        " created_at, dequeue_at, locked_at, finished_at FROM {}.archive ORDER BY id"
    ).format(sql.Identifier(schema))
    return [tuple(row) for row in admin.execute(query)]


# -- conn= -------------------------------------------------------------------------------


def test_create_rolled_back_with_the_callers_transaction(queue: Queue, dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        created = queue.create(b"x", channel="a", conn=conn)
        assert created.status is CreateStatus.CREATED
        # Visible inside the caller's transaction...
        assert [s.channel for s in queue.stats(conn=conn)] == ["a"]
        # ...but not outside it until commit.
        assert queue.stats() == []
        conn.rollback()
    assert queue.stats() == []
    assert queue.dequeue(lock_ms=LOCK_MS) is None


def test_create_commits_with_a_business_write(
    queue: Queue, dsn: str, admin: psycopg.Connection[Any], schema_name: str
) -> None:
    orders = sql.Identifier(schema_name, "orders")
    admin.execute(sql.SQL("CREATE TABLE {} (id INT PRIMARY KEY)").format(orders))
    with psycopg.connect(dsn) as conn:
        with conn.transaction():
            conn.execute(sql.SQL("INSERT INTO {} VALUES (1)").format(orders))
            queue.create(b"order-1", channel="orders", conn=conn)
        # The business write fails after the create: both are rolled back.
        queue.create(b"order-2", channel="orders", conn=conn)
        with pytest.raises(psycopg.errors.UniqueViolation):
            conn.execute(sql.SQL("INSERT INTO {} VALUES (1)").format(orders))
        conn.rollback()

    assert admin.execute(sql.SQL("SELECT id FROM {}").format(orders)).fetchall() == [(1,)]
    messages = queue.dequeue_many(10, lock_ms=LOCK_MS)
    assert [m.content for m in messages] == [b"order-1"]


def test_dequeue_rolled_back_leaves_the_message_available(queue: Queue, dsn: str) -> None:
    created = queue.create(b"x", channel="a")
    with psycopg.connect(dsn) as conn:
        taken = queue.dequeue(lock_ms=LOCK_MS, conn=conn)
        assert taken is not None
        assert taken.id == created.id
        conn.rollback()
    message = queue.dequeue(lock_ms=LOCK_MS)
    assert message is not None
    assert (message.id, message.num_attempts) == (created.id, 1)
    stats = queue.channel("a").stats()
    assert stats is not None
    assert stats.in_flight == 1


def test_delete_rolled_back_keeps_the_message_locked(queue: Queue, dsn: str) -> None:
    queue.create(b"x", channel="a")
    message = queue.dequeue(lock_ms=LOCK_MS)
    assert message is not None
    with psycopg.connect(dsn) as conn:
        message.delete(conn=conn)
        conn.rollback()
    stats = queue.channel("a").stats()
    assert stats is not None
    assert (stats.size, stats.in_flight) == (1, 1)
    message.delete()
    assert queue.stats() == []


def test_delete_commits_with_a_business_write(
    queue: Queue, dsn: str, admin: psycopg.Connection[Any], schema_name: str
) -> None:
    results = sql.Identifier(schema_name, "results")
    admin.execute(sql.SQL("CREATE TABLE {} (content BYTEA)").format(results))
    queue.create(b"work", channel="a")
    message = queue.dequeue(lock_ms=LOCK_MS)
    assert message is not None
    with psycopg.connect(dsn) as conn, conn.transaction():
        conn.execute(sql.SQL("INSERT INTO {} VALUES (%s)").format(results), [message.content])
        message.delete(conn=conn)
    rows = admin.execute(sql.SQL("SELECT content FROM {}").format(results)).fetchall()
    assert rows == [(b"work",)]
    assert queue.stats() == []


@pytest.mark.parametrize(
    "factory",
    [
        {"row_factory": dict_row},
        {"row_factory": namedtuple_row},
        {"cursor_factory": psycopg.ClientCursor},
        {"cursor_factory": psycopg.RawCursor},
    ],
    ids=["dict_row", "namedtuple_row", "ClientCursor", "RawCursor"],
)
def test_a_callers_row_and_cursor_factories_do_not_change_results(
    make_queue: Callable[..., Queue], dsn: str, factory: dict[str, Any]
) -> None:
    """The queue reads its statements' rows through cursors of its own: a dict_row used to
    turn settings() and stats() into column names, silently, and a ClientCursor or RawCursor
    refused the statements (or failed after they ran)."""
    queue = make_queue(event_channel="ev_factories")
    queue.channel("p").set_policy(max_size=5)
    with psycopg.connect(dsn, autocommit=True, **factory) as conn:
        assert queue.install(conn=conn) == latest_version()
        assert queue.settings(conn=conn) == queue.settings()
        assert queue.settings(conn=conn).event_channel == "ev_factories"
        assert queue.now(conn=conn) > 0
        created = queue.create(b"x", channel="p", conn=conn)
        assert (created.status, created.channel_size) == (CreateStatus.CREATED, 1)
        [many] = queue.create_many([NewMessage(b"y", channel="p")], conn=conn)
        assert (many.status, many.channel_size) == (CreateStatus.CREATED, 2)
        assert queue.stats(conn=conn) == queue.stats()
        assert [(s.channel, s.size, s.policy.max_size) for s in queue.stats(conn=conn)] == [
            ("p", 2, 5)
        ]
        message = queue.dequeue(lock_ms=LOCK_MS, conn=conn)
        assert message is not None
        assert (message.id, message.content) == (created.id, b"x")
        message.delete(conn=conn)
        assert queue.verify(conn=conn) == []
        queue.schedule("tick", cron="0 0 * * *", content=b"t", channel="tasks", conn=conn)
        assert [s.name for s in queue.schedules(conn=conn)] == ["tick"]
    assert [(s.channel, s.size) for s in queue.stats()] == [("lonnymq.schedules", 1), ("p", 1)]


# -- schemas and install -----------------------------------------------------------------


def test_schemas_are_isolated(
    queue: Queue, make_queue: Callable[..., Queue], other_schema: str
) -> None:
    other = make_queue(schema=other_schema)
    queue.create(b"mine", channel="a")
    other.create(b"theirs", channel="a")
    other.channel("b").set_policy(max_concurrency=1)

    assert [(s.channel, s.size) for s in queue.stats()] == [("a", 1)]
    assert [(s.channel, s.size) for s in other.stats()] == [("a", 1), ("b", 0)]
    mine = queue.dequeue_many(10, lock_ms=LOCK_MS)
    theirs = other.dequeue_many(10, lock_ms=LOCK_MS)
    assert [m.content for m in mine] == [b"mine"]
    assert [m.content for m in theirs] == [b"theirs"]

    other.set_clock_offset(1_000_000)
    assert queue.now() < other.now() - 900_000


def test_install_is_idempotent(
    queue: Queue, admin: psycopg.Connection[Any], schema_name: str
) -> None:
    created = queue.create(b"kept", channel="a")
    queue.channel("a").set_policy(max_size=5)
    version = latest_version()
    assert queue.install() == version
    assert queue.install() == version
    stats = queue.stats()
    assert [(s.channel, s.size, s.policy.max_size) for s in stats] == [("a", 1, 5)]
    message = queue.dequeue(lock_ms=LOCK_MS)
    assert message is not None
    assert message.id == created.id
    migrations = admin.execute(
        sql.SQL("SELECT version FROM {}.migration ORDER BY version").format(
            sql.Identifier(schema_name)
        )
    ).fetchall()
    assert migrations == [(m.version,) for m in all_migrations()]
    assert migrations[-1] == (version,)


def test_install_in_a_callers_transaction_leaves_its_search_path_alone(
    dsn: str, schema_name: str, other_schema: str, admin: psycopg.Connection[Any]
) -> None:
    """The migrations set the queue's schema as the search_path (SET LOCAL): it used to stay
    for the rest of the caller's transaction, so the caller's own 'message' table resolved to
    the queue's."""
    app = sql.Identifier(other_schema)
    admin.execute(sql.SQL("CREATE SCHEMA {}").format(app))
    admin.execute(sql.SQL("CREATE TABLE {}.message (id INT, note TEXT)").format(app))
    with Queue(dsn, schema=schema_name) as queue, psycopg.connect(dsn) as conn:
        conn.execute(sql.SQL("SET search_path TO {}").format(app))
        conn.execute("INSERT INTO message VALUES (1, 'before install')")
        before = conn.execute("SHOW search_path").fetchone()
        assert queue.install(conn=conn) == latest_version()
        assert conn.execute("SHOW search_path").fetchone() == before
        conn.execute("INSERT INTO message VALUES (2, 'after install')")
        conn.commit()
        assert queue.create(b"x").status is CreateStatus.CREATED
    notes = admin.execute(sql.SQL("SELECT note FROM {}.message ORDER BY id").format(app))
    assert notes.fetchall() == [("before install",), ("after install",)]


def test_install_on_a_callers_idle_connection_commits_with_the_caller(
    dsn: str, schema_name: str, admin: psycopg.Connection[Any]
) -> None:
    """On a connection not in autocommit mode install() used to commit on its own (psycopg's
    transaction() on an idle connection); it runs in the caller's transaction now, as every
    operation with conn= does."""
    installed = "SELECT count(*) FROM pg_namespace WHERE nspname = %s"
    with Queue(dsn, schema=schema_name) as queue, psycopg.connect(dsn) as conn:
        assert queue.install(conn=conn) == latest_version()
        assert conn.info.transaction_status is psycopg.pq.TransactionStatus.INTRANS
        conn.rollback()
        assert admin.execute(installed, [schema_name]).fetchone() == (0,)
        assert queue.install(conn=conn) == latest_version()
        conn.commit()
        assert admin.execute(installed, [schema_name]).fetchone() == (1,)
        assert queue.create(b"x").status is CreateStatus.CREATED


def test_concurrent_installs_into_a_new_schema(
    dsn: str, admin: psycopg.Connection[Any], other_schema: str
) -> None:
    script = (
        "import sys\n"
        "from lonnymq import Queue\n"
        "q = Queue(sys.argv[1], schema=sys.argv[2])\n"
        "print(q.install())\n"
        "q.close()\n"
    )
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", script, dsn, other_schema],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    outputs = [p.communicate(timeout=60) for p in processes]
    for process, (out, err) in zip(processes, outputs, strict=True):
        assert process.returncode == 0, err
        assert out.strip() == str(latest_version())
    migrations = admin.execute(
        sql.SQL("SELECT version FROM {}.migration ORDER BY version").format(
            sql.Identifier(other_schema)
        )
    ).fetchall()
    assert migrations == [(m.version,) for m in all_migrations()]
    assert migrations[-1] == (latest_version(),)

    with Queue(dsn, schema=other_schema) as q:
        assert q.create(b"x").status is CreateStatus.CREATED
        assert q.dequeue(lock_ms=LOCK_MS) is not None


# -- archive -----------------------------------------------------------------------------


def test_archive_keeps_finished_messages(
    make_queue: Callable[..., Queue], admin: psycopg.Connection[Any], schema_name: str
) -> None:
    queue = make_queue(archive=True)
    created_at = queue.now()
    created = queue.create(b"payload", channel="a")
    queue.set_clock_offset(1_000)
    first = queue.dequeue(lock_ms=1_000)
    assert first is not None
    queue.set_clock_offset(3_000)  # the first lock expired: attempt 2
    second = queue.dequeue(lock_ms=LOCK_MS)
    assert second is not None
    second.defer(state=b"progress")
    third = queue.dequeue(lock_ms=LOCK_MS)
    assert third is not None
    locked_at = third.unlock_at - LOCK_MS
    queue.set_clock_offset(10_000)
    third.delete()

    rows = archive_rows(admin, schema_name)
    assert len(rows) == 1
    (
        row_id,
        channel,
        content,
        state,
        num_attempts,
        outcome,
        error,
        row_created_at,
        dequeue_at,
        row_locked_at,
        finished_at,
    ) = rows[0]
    assert (row_id, channel, bytes(content), bytes(state)) == (
        created.id,
        "a",
        b"payload",
        b"progress",
    )
    assert (num_attempts, outcome, error) == (3, "completed", None)
    assert created_at <= row_created_at < created_at + 1_000
    assert dequeue_at == third.dequeue_at
    assert row_locked_at == locked_at
    assert finished_at >= locked_at + 7_000
    assert queue.stats() == []


@pytest.mark.parametrize("finish", ["delete", "fail", "delete_many"])
def test_a_message_finished_in_the_transaction_that_took_it_is_not_finished_before_it(
    make_queue: Callable[..., Queue], admin: psycopg.Connection[Any], schema_name: str, finish: str
) -> None:
    """The dequeue stamps the clock as it runs, finishing stamped the transaction's start: a
    transaction that waited before its dequeue archived a negative processing time."""
    queue = make_queue(archive=True)
    queue.create(b"job", channel="a")
    with queue.transaction() as conn:
        conn.execute("SELECT pg_sleep(0.2)")
        message = queue.dequeue(lock_ms=LOCK_MS, conn=conn)
        assert message is not None
        if finish == "delete":
            message.delete(conn=conn)
        elif finish == "fail":
            message.fail(error="boom", conn=conn)
        else:
            queue.delete_many([message], conn=conn)
    rows = archive_rows(admin, schema_name)
    assert len(rows) == 1
    locked_at, finished_at = rows[0][9], rows[0][10]
    assert locked_at >= rows[0][7] + 150  # the dequeue's own clock, after the sleep
    assert finished_at >= locked_at


def test_archive_off_keeps_nothing(
    queue: Queue, admin: psycopg.Connection[Any], schema_name: str
) -> None:
    queue.create(b"x", channel="a")
    queue.create(b"y", channel="a")
    messages = queue.dequeue_many(10, lock_ms=LOCK_MS)
    messages[0].delete()
    queue.delete_many(messages[1:])
    assert queue.stats() == []
    assert archive_rows(admin, schema_name) == []


def test_archive_records_batch_deletes(
    make_queue: Callable[..., Queue], admin: psycopg.Connection[Any], schema_name: str
) -> None:
    queue = make_queue(archive=True)
    queue.create(b"x", channel="a")
    queue.create(b"y", channel="b")
    messages = queue.dequeue_many(10, lock_ms=LOCK_MS)
    queue.delete_many(messages)
    rows = archive_rows(admin, schema_name)
    assert sorted((r[1], bytes(r[2]), r[4], r[5]) for r in rows) == [
        ("a", b"x", 1, "completed"),
        ("b", b"y", 1, "completed"),
    ]


def test_archive_can_be_turned_off_again(
    make_queue: Callable[..., Queue], admin: psycopg.Connection[Any], schema_name: str
) -> None:
    queue = make_queue(archive=True)
    queue.install(archive=False)
    queue.create(b"x", channel="a")
    message = queue.dequeue(lock_ms=LOCK_MS)
    assert message is not None
    message.delete()
    assert archive_rows(admin, schema_name) == []


# -- isolation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "level", [psycopg.IsolationLevel.REPEATABLE_READ, psycopg.IsolationLevel.SERIALIZABLE]
)
def test_writes_refuse_a_connection_above_read_committed(
    queue: Queue, dsn: str, level: psycopg.IsolationLevel
) -> None:
    """At REPEATABLE READ a create can miss the deletion of its channel's row by a dequeue
    that took the channel's last message, and leave its message behind no row, where no
    dequeue finds it: such a connection is refused before any SQL runs."""
    queue.create(b"held", channel="a")
    held = queue.dequeue(lock_ms=LOCK_MS)
    assert held is not None
    with psycopg.connect(dsn) as conn:
        conn.isolation_level = level
        for attempt in (
            lambda: queue.create(b"x", channel="a", conn=conn),
            lambda: queue.create_many([NewMessage(b"x", channel="a")], conn=conn),
            lambda: queue.dequeue(lock_ms=LOCK_MS, conn=conn),
            lambda: queue.complete_and_dequeue([held], 1, lock_ms=LOCK_MS, conn=conn),
            lambda: queue.defer_many([held], conn=conn),
        ):
            with pytest.raises(InvalidArgumentError, match="must run at READ COMMITTED"):
                attempt()
        # Reads are fine at any level.
        assert [(s.channel, s.in_flight) for s in queue.stats(conn=conn)] == [("a", 1)]
    held.delete()
    assert queue.stats() == []


def _repeatable_read(dsn: str) -> psycopg.Connection[Any]:
    conn = psycopg.connect(dsn)
    conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    return conn


def test_set_policy_refuses_a_connection_above_read_committed(queue: Queue, dsn: str) -> None:
    """At REPEATABLE READ the policy set would count the channel's messages from the caller's
    snapshot, missing those created since: the channel's size wrong for good."""
    queue.create(b"m1", channel="p")
    with _repeatable_read(dsn) as conn:
        assert [s.size for s in queue.stats(conn=conn)] == [1]  # the caller's snapshot
        queue.create(b"m2", channel="p")
        queue.create(b"m3", channel="p")
        with pytest.raises(InvalidArgumentError, match="channel_policy_set must run at READ"):
            queue.channel("p").set_policy(max_size=10, conn=conn)
        conn.rollback()
    queue.channel("p").set_policy(max_size=10)
    assert [s.size for s in queue.stats()] == [3]
    assert queue.verify() == []


def test_delete_refuses_a_connection_above_read_committed(queue: Queue, dsn: str) -> None:
    """At REPEATABLE READ a delete would read its channel as policy-free when the policy was
    set after the caller's snapshot, and not count the message out of the channel's size."""
    queue.create(b"m1", channel="p")
    held = queue.dequeue(lock_ms=LOCK_MS)
    assert held is not None
    with _repeatable_read(dsn) as conn:
        assert [s.size for s in queue.stats(conn=conn)] == [1]  # the caller's snapshot
        queue.channel("p").set_policy(max_size=10)  # counts m1
        with pytest.raises(InvalidArgumentError, match="message_delete must run at READ"):
            held.delete(conn=conn)
        conn.rollback()
    held.delete()
    assert [(s.channel, s.size) for s in queue.stats()] == [("p", 0)]
    assert queue.verify() == []


def test_policies_and_finishing_refuse_a_connection_above_read_committed(
    queue: Queue, dsn: str
) -> None:
    queue.create(b"m1", channel="p")
    queue.channel("q").set_policy(max_size=10)
    held = queue.dequeue(lock_ms=LOCK_MS)
    assert held is not None
    queue.schedule("tick", cron="0 0 * * *", content=b"t", channel="tasks")
    for attempt in (
        lambda conn: queue.channel("p").set_policy(max_size=5, conn=conn),
        lambda conn: queue.channel("q").clear_policy(conn=conn),
        lambda conn: queue.delete(held, conn=conn),
        lambda conn: queue.fail(held, error="x", conn=conn),
        lambda conn: queue.delete_many([held], conn=conn),
        lambda conn: queue.dead_letter(held, channel="dead", error="x", conn=conn),
        lambda conn: queue.unschedule("tick", conn=conn),
    ):
        with _repeatable_read(dsn) as conn:
            with pytest.raises(InvalidArgumentError, match="must run at READ COMMITTED"):
                attempt(conn)
            conn.rollback()
    assert {s.channel: (s.size, s.in_flight) for s in queue.stats()} == {
        "lonnymq.schedules": (1, 0),
        "p": (1, 1),
        "q": (0, 0),
    }
    held.delete()
    assert queue.unschedule("tick")
    assert queue.verify() == []


def _at_repeatable_read(dsn: str, how: str) -> psycopg.Connection[Any]:
    """A connection whose next transaction runs at REPEATABLE READ, though psycopg's
    ``isolation_level`` is unset: the level comes from the server or from SQL."""
    if how == "dsn options":
        options = conninfo_to_dict(dsn).get("options") or ""
        at_rr = make_conninfo(
            dsn, options=f"{options} -c default_transaction_isolation=repeatable\\ read".strip()
        )
        return psycopg.connect(at_rr)
    conn = psycopg.connect(dsn, autocommit=how == "BEGIN on autocommit")
    if how == "session default":  # as ALTER ROLE/DATABASE ... SET would make it
        conn.execute("SET default_transaction_isolation TO 'repeatable read'")
        conn.commit()
    elif how == "SET TRANSACTION":
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    else:
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    return conn


@pytest.mark.parametrize(
    "how", ["dsn options", "session default", "SET TRANSACTION", "BEGIN on autocommit"]
)
def test_writes_refuse_a_connection_the_server_puts_above_read_committed(
    queue: Queue, dsn: str, how: str
) -> None:
    """psycopg's ``isolation_level`` is None on these connections: the server is asked. Had
    the create gone through, its message would wait behind no channel row (the drain below
    deleted it after the caller's snapshot), where no dequeue finds it."""
    queue.create(b"first", channel="a")
    with _at_repeatable_read(dsn, how) as conn:
        assert conn.isolation_level is None
        assert queue.stats(conn=conn) != []  # the snapshot: channel a has its row
        taken = queue.dequeue(lock_ms=LOCK_MS)
        assert taken is not None
        taken.delete()  # the channel is drained: its row is gone
        with pytest.raises(InvalidArgumentError, match="conn is at REPEATABLE READ"):
            queue.create(b"second", channel="a", conn=conn)
        conn.rollback()
    assert queue.stats() == []
    assert queue.verify() == []


def test_an_autocommit_connection_runs_at_the_servers_level_whatever_psycopg_says(
    queue: Queue, dsn: str
) -> None:
    """In autocommit mode psycopg's ``isolation_level`` applies only to the transactions it
    begins (``conn.transaction()``); a statement on its own runs at the session's default."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.isolation_level = psycopg.IsolationLevel.SERIALIZABLE
        assert queue.create(b"x", channel="a", conn=conn).status is CreateStatus.CREATED
        with (
            conn.transaction(),
            pytest.raises(InvalidArgumentError, match="conn is at SERIALIZABLE"),
        ):
            queue.create(b"y", channel="a", conn=conn)
    assert [(s.channel, s.size) for s in queue.stats()] == [("a", 1)]


def _traced_statements(conn: psycopg.Connection[Any], run: Callable[[], object], tmp: Path) -> str:
    """What ``run()`` sent on ``conn``, from libpq's protocol trace."""
    path = tmp / "trace"
    with open(path, "w") as trace:
        conn.pgconn.trace(trace.fileno())
        try:
            run()
        finally:
            conn.pgconn.untrace()
    return path.read_text()


def test_the_level_is_asked_of_a_callers_connection_only(
    queue: Queue, dsn: str, tmp_path: Path
) -> None:
    """One more round trip for a write on a caller's connection whose level psycopg does not
    set; none on the queue's own (pooled, READ COMMITTED) connections, lent by transaction()."""
    with psycopg.connect(dsn) as conn:
        sent = _traced_statements(conn, lambda: queue.create(b"x", conn=conn), tmp_path)
        assert "transaction_isolation" in sent
        conn.commit()
        conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
        sent = _traced_statements(conn, lambda: queue.create(b"x", conn=conn), tmp_path)
        assert "transaction_isolation" not in sent
        assert "message_create" in sent
    with queue.transaction() as lent:
        sent = _traced_statements(lent, lambda: queue.create(b"x", conn=lent), tmp_path)
        assert "transaction_isolation" not in sent
        assert "message_create" in sent


def test_pooled_connections_run_at_read_committed_whatever_the_default(
    schema_name: str, dsn: str
) -> None:
    options = conninfo_to_dict(dsn).get("options") or ""
    at_rr = make_conninfo(
        dsn, options=f"{options} -c default_transaction_isolation=serializable".strip()
    )
    with Queue(at_rr, schema=schema_name) as queue:
        queue.install()
        with queue.transaction() as conn:
            row = conn.execute("SHOW transaction_isolation").fetchone()
        assert row == ("read committed",)
        queue.create(b"x", channel="a")
        taken = queue.dequeue(lock_ms=LOCK_MS)
        assert taken is not None
        taken.delete()
        assert queue.verify() == []
