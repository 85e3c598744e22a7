"""Finishing a message as failed, and ``Queue.transaction()``."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row, tuple_row

from lonnymq import (
    ChannelFullError,
    CreateStatus,
    DatabaseError,
    InvalidArgumentError,
    Queue,
    StaleMessageError,
)

LOCK_MS = 60_000


def _archive(admin: psycopg.Connection[Any], schema: str) -> list[tuple[Any, ...]]:
    query = sql.SQL("SELECT id, outcome, error FROM {}.archive ORDER BY id")
    return admin.execute(query.format(sql.Identifier(schema))).fetchall()


def test_fail_finishes_the_message_and_archives_the_error(
    make_queue: Callable[..., Queue], admin: psycopg.Connection[Any], schema_name: str
) -> None:
    queue = make_queue(archive=True)
    created = queue.create(b"x", channel="c")
    message = queue.dequeue(lock_ms=LOCK_MS)
    assert message is not None
    message.fail(error="it broke\x00badly")
    assert queue.stats() == []
    assert _archive(admin, schema_name) == [(created.id, "failed", "it broke\ufffdbadly")]


def test_fail_by_a_stale_holder_is_refused(queue: Queue) -> None:
    queue.create(b"x")
    first = queue.dequeue(lock_ms=1_000)
    assert first is not None
    queue.set_clock_offset(2_000)
    second = queue.dequeue(lock_ms=LOCK_MS)
    assert second is not None
    with pytest.raises(StaleMessageError):
        first.fail(error="late")
    assert [s.in_flight for s in queue.stats()] == [1]


def test_fail_needs_a_text_error(queue: Queue) -> None:
    queue.create(b"x")
    message = queue.dequeue(lock_ms=LOCK_MS)
    assert message is not None
    with pytest.raises(InvalidArgumentError, match="error must be a str"):
        message.fail(error=42)  # type: ignore[arg-type]
    message.delete()


def test_transaction_commits_together_or_not_at_all(queue: Queue) -> None:
    with queue.transaction() as conn:
        queue.create(b"a", channel="t", conn=conn)
        queue.create(b"b", channel="t", conn=conn)
    assert [s.size for s in queue.stats()] == [2]

    class Boom(Exception):
        pass

    def create_then_fail() -> None:
        with queue.transaction() as conn:
            queue.create(b"c", channel="t", conn=conn)
            raise Boom

    with pytest.raises(Boom):
        create_then_fail()
    assert [s.size for s in queue.stats()] == [2]


def test_dead_letter_moves_the_content_and_fails_the_original(
    make_queue: Callable[..., Queue], admin: psycopg.Connection[Any], schema_name: str
) -> None:
    queue = make_queue(archive=True)
    created = queue.create(b"poison", channel="work")
    message = queue.dequeue(lock_ms=LOCK_MS)
    assert message is not None
    message.defer(state=b"step 2")
    message = queue.dequeue(lock_ms=LOCK_MS)
    assert message is not None
    assert message.state == b"step 2"
    moved = queue.dead_letter(message, channel="dead", error="gave up")
    assert moved.status is CreateStatus.CREATED
    assert _archive(admin, schema_name) == [(created.id, "failed", "gave up")]
    copy = queue.dequeue(lock_ms=LOCK_MS)
    assert copy is not None
    # The copy carries the content, not the saved state.
    assert (copy.id, copy.channel, copy.content, copy.state) == (moved.id, "dead", b"poison", None)


def test_dead_letter_into_a_full_channel_raises_and_keeps_the_message_held(
    make_queue: Callable[..., Queue], admin: psycopg.Connection[Any], schema_name: str
) -> None:
    queue = make_queue(archive=True)
    queue.channel("dead").set_policy(max_size=1)
    queue.create(b"earlier", channel="dead", dequeue_at=queue.now() + 3_600_000)
    created = queue.create(b"poison", channel="work")
    message = queue.dequeue(lock_ms=LOCK_MS)
    assert message is not None
    assert message.id == created.id
    with pytest.raises(ChannelFullError, match=r"'dead' is at its max_size.*still held"):
        queue.dead_letter(message, channel="dead", error="gave up")
    # Nothing changed: the message is still held by this attempt, the dead channel as it was.
    assert _archive(admin, schema_name) == []
    by_channel = {s.channel: (s.size, s.in_flight) for s in queue.stats()}
    assert by_channel == {"dead": (1, 0), "work": (1, 1)}
    queue.channel("dead").set_policy(max_size=2)
    assert queue.dead_letter(message, channel="dead", error="gave up").status is (
        CreateStatus.CREATED
    )
    assert _archive(admin, schema_name) == [(created.id, "failed", "gave up")]


# -- two statements on an autocommit connection ------------------------------------------


def test_dead_letter_on_an_autocommit_connection_is_one_transaction(queue: Queue, dsn: str) -> None:
    """The copy used to commit on its own before the stale holder's fail was refused: the job
    finished by its new holder was also in the dead-letter channel."""
    queue.channel("dead").set_policy(max_concurrency=0)  # keeps the copy, if any, in sight
    queue.create(b"job", channel="work")
    first = queue.dequeue(lock_ms=1_000)
    assert first is not None
    queue.set_clock_offset(2_000)  # its lock expired
    second = queue.dequeue(lock_ms=LOCK_MS)
    assert second is not None
    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(StaleMessageError):
            queue.dead_letter(first, channel="dead", error="gave up", conn=conn)
        assert conn.info.transaction_status is psycopg.pq.TransactionStatus.IDLE
        # The holder may still move it, atomically too.
        moved = queue.dead_letter(second, channel="dead", error="gave up", conn=conn)
    assert moved.status is CreateStatus.CREATED
    assert {s.channel: s.size for s in queue.stats()} == {"dead": 1}
    assert queue.verify() == []


def test_fire_schedule_on_an_autocommit_connection_is_one_transaction(
    queue: Queue, dsn: str
) -> None:
    """The task used to commit on its own before the stale driver's defer was refused: the
    schedule fired twice for one time."""
    queue.schedule("tick", cron="* * * * *", content=b"task", channel="tasks")
    queue.set_clock_offset(61_000)
    first = queue.dequeue(lock_ms=1_000)
    assert first is not None
    assert first.channel == "lonnymq.schedules"
    queue.set_clock_offset(63_000)  # its lock expired
    second = queue.dequeue(lock_ms=LOCK_MS)
    assert second is not None
    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(StaleMessageError):
            queue.fire_schedule(first, conn=conn)
        assert [s.channel for s in queue.stats()] == ["lonnymq.schedules"]
        firing = queue.fire_schedule(second, conn=conn)
    assert firing.fire_at is not None
    tasks = queue.dequeue_many(10, lock_ms=LOCK_MS)
    assert [(t.channel, t.content) for t in tasks] == [("tasks", b"task")]
    queue.delete_many(tasks)
    assert queue.verify() == []


def test_dead_letter_in_a_callers_transaction_is_not_committed_by_the_queue(
    queue: Queue, dsn: str
) -> None:
    queue.create(b"job", channel="work")
    held = queue.dequeue(lock_ms=LOCK_MS)
    assert held is not None
    with psycopg.connect(dsn) as conn:
        queue.dead_letter(held, channel="dead", error="gave up", conn=conn)
        assert conn.info.transaction_status is psycopg.pq.TransactionStatus.INTRANS
        conn.rollback()
    assert {s.channel: (s.size, s.in_flight) for s in queue.stats()} == {"work": (1, 1)}
    held.delete()


# -- the connection transaction() lends --------------------------------------------------


def _session(conn: psycopg.Connection[Any]) -> tuple[Any, ...]:
    with psycopg.Cursor(conn) as cursor:
        cursor.execute(
            "SELECT pg_backend_pid(), current_setting('statement_timeout'),"
            " current_setting('default_transaction_isolation'), current_setting('search_path'),"
            " current_setting('application_name')"
        )
        row = cursor.fetchone()
    assert row is not None
    return tuple(row)


def test_what_a_transaction_block_sets_does_not_stay_on_the_pooled_connection(
    make_queue: Callable[..., Queue],
) -> None:
    queue = make_queue(pool_size=1)  # every block gets the same connection
    queue.create(b"x", channel="a")
    with queue.transaction() as conn:
        before = _session(conn)
        conn.row_factory = dict_row  # to read the caller's own rows as dicts
        conn.cursor_factory = psycopg.ClientCursor
        conn.execute("SET statement_timeout = 1")
        conn.execute("SET default_transaction_isolation TO 'serializable'")
        conn.execute("SET search_path TO nowhere")
        conn.execute("SET application_name TO 'the caller'")
    with queue.transaction() as conn:
        assert conn.row_factory is tuple_row
        assert conn.cursor_factory is psycopg.Cursor
        assert _session(conn) == before
        assert before[1:3] == ("0", "read committed")
    # The pooled operations see the queue's own settings.
    assert queue.settings().archive is False
    assert [(s.channel, s.size) for s in queue.stats()] == [("a", 1)]
    assert queue.create(b"y", channel="a").status is CreateStatus.CREATED


def test_a_role_set_in_a_transaction_block_does_not_stay_on_the_pooled_connection(
    make_queue: Callable[..., Queue], admin: psycopg.Connection[Any]
) -> None:
    # RESET ALL leaves a SET ROLE in place: the next pooled operation ran as that role.
    role = f"lmq_r_{uuid.uuid4().hex[:12]}"
    admin.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(role)))
    try:
        queue = make_queue(pool_size=1)
        with queue.transaction() as conn:
            me = conn.execute("SELECT current_user").fetchone()
            conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(role)))
        with queue.transaction() as conn:
            assert conn.execute("SELECT current_user").fetchone() == me
        assert queue.create(b"y", channel="a").status is CreateStatus.CREATED
    finally:
        admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_only_a_lent_connection_is_restored(
    make_queue: Callable[..., Queue], tmp_path: Path
) -> None:
    """The restore is one round trip paid at the end of a transaction() block; pooled
    operations, dead_letter and fire_schedule among them, do not pay it."""
    queue = make_queue(pool_size=1)
    queue.create(b"x", channel="a")
    held = queue.dequeue(lock_ms=LOCK_MS)
    assert held is not None
    trace_path = tmp_path / "trace"
    with open(trace_path, "w") as trace:
        with queue.transaction() as conn:
            conn.pgconn.trace(trace.fileno())
        queue.create(b"y", channel="a")
        queue.dead_letter(held, channel="dead", error="gave up")
        with queue.transaction() as conn:
            conn.pgconn.untrace()
    sent = trace_path.read_text()
    assert "message_create" in sent
    assert "message_delete" in sent
    assert sent.count("RESET ALL") == 1


def test_a_transaction_block_that_caught_an_error_raises_at_its_end(queue: Queue) -> None:
    """The error aborted the transaction and everything in it was rolled back: the block used
    to end as if it had committed."""
    queue.create(b"job", channel="w")
    first = queue.dequeue(lock_ms=1_000)
    assert first is not None
    queue.set_clock_offset(2_000)  # its lock expired
    second = queue.dequeue(lock_ms=LOCK_MS)
    assert second is not None

    def catch_inside() -> None:
        with queue.transaction() as conn:
            queue.create(b"side effect", channel="other", conn=conn)
            with pytest.raises(StaleMessageError):
                first.delete(conn=conn)

    with pytest.raises(DatabaseError, match="aborted by an error caught") as caught:
        catch_inside()
    assert caught.value.sqlstate == "25P02"
    assert [(s.channel, s.size) for s in queue.stats()] == [("w", 1)]
    # A savepoint (psycopg's nested transaction) keeps the rest of the block.
    with queue.transaction() as conn:
        queue.create(b"side effect", channel="other", conn=conn)
        with pytest.raises(StaleMessageError), conn.transaction():
            first.delete(conn=conn)
        second.delete(conn=conn)
    assert [(s.channel, s.size) for s in queue.stats()] == [("other", 1)]


@pytest.mark.parametrize(
    ("statement", "error"),
    [
        ("INSERT INTO no_such_orders VALUES (1)", psycopg.errors.UndefinedTable),
        ("SELECT 1/0", psycopg.errors.DivisionByZero),
    ],
)
def test_a_transaction_block_keeps_its_own_errors(
    queue: Queue, statement: str, error: type[psycopg.Error]
) -> None:
    """The caller's own failing statement used to come out as a lonnymq error: a missing table
    of theirs as SchemaNotInstalledError ('call install() first')."""

    def fail_inside() -> None:
        with queue.transaction() as conn:
            queue.create(b"x", channel="a", conn=conn)
            conn.execute(statement)

    with pytest.raises(error):
        fail_inside()
    assert queue.stats() == []


def test_a_transaction_blocks_commit_error_is_a_lonnymq_error(
    queue: Queue, admin: psycopg.Connection[Any], schema_name: str
) -> None:
    """The COMMIT is transaction()'s own: what it raises is translated."""
    orders = sql.Identifier(schema_name, "orders")
    admin.execute(
        sql.SQL("CREATE TABLE {} (id INT UNIQUE DEFERRABLE INITIALLY DEFERRED)").format(orders)
    )

    def commit_fails() -> None:
        with queue.transaction() as conn:
            queue.create(b"x", channel="a", conn=conn)
            conn.execute(sql.SQL("INSERT INTO {} VALUES (1), (1)").format(orders))

    with pytest.raises(DatabaseError) as caught:
        commit_fails()
    assert caught.value.sqlstate == "23505"
    assert queue.stats() == []
