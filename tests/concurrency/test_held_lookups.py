"""A message you hold is found by its primary key, whatever the planner's statistics say.

Finishing, failing, deferring and heartbeating a held message (one or many) look it up by id and
check that the caller's attempt still holds it. The statistics of ``message`` are taken while
nothing is locked (as after any quiet moment, or on a server whose autovacuum is off), then
thousands of messages are locked: the partial index of locked messages, ``message_unlock_ix``,
now looks empty to the planner while it holds an entry per locked message. Left to those
statistics, the planner would answer these lookups by scanning that index whole (a hash join
over all of it for a batch), so each call would cost O(messages locked). The tests count, inside
the caller's transaction, the scans of each index (``pg_stat_get_xact_numscans``): the operation
must probe the primary key and never touch ``message_unlock_ix``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg import sql

from lonnymq import AckStatus, Message, NewMessage, Queue

HELD = 2_000
LOCK_MS = 600_000


@pytest.fixture
def held(queue: Queue, admin: psycopg.Connection[Any]) -> list[Message]:
    """HELD locked messages over 10 channels, the statistics taken before any was locked."""
    queue.create_many([NewMessage(b"x", channel=f"c{i % 10}") for i in range(HELD + 100)])
    admin.execute(sql.SQL("VACUUM ANALYZE {}.message").format(sql.Identifier(queue.schema)))
    messages = queue.dequeue_many(HELD, lock_ms=LOCK_MS)
    assert len(messages) == HELD
    return messages


def _index_scans(conn: psycopg.Connection[Any], schema: str) -> dict[str, int]:
    rows = conn.execute(
        "SELECT c.relname, pg_stat_get_xact_numscans(c.oid) FROM pg_class c "
        "WHERE c.relnamespace = %s::regnamespace "
        "AND c.relname IN ('message_pkey', 'message_unlock_ix')",
        [sql.Identifier(schema).as_string()],
    ).fetchall()
    return {name: int(scans) for name, scans in rows}


def _heartbeat_many(queue: Queue, messages: list[Message], conn: psycopg.Connection[Any]) -> None:
    rows = conn.execute(
        sql.SQL("SELECT status FROM {}.message_heartbeat_many(%s, %s, %s)").format(
            sql.Identifier(queue.schema)
        ),
        [[m.id for m in messages], [m.num_attempts for m in messages], LOCK_MS],
    ).fetchall()
    assert [r[0] for r in rows] == ["ok"] * len(messages)


def _assert_all_ok(statuses: list[AckStatus]) -> None:
    assert statuses == [AckStatus.OK] * len(statuses)


OPERATIONS: dict[str, Callable[[Queue, list[Message], psycopg.Connection[Any]], object]] = {
    "delete": lambda q, ms, c: q.delete(ms[0], conn=c),
    "fail": lambda q, ms, c: q.fail(ms[0], error="boom", conn=c),
    "heartbeat": lambda q, ms, c: q.heartbeat(ms[0], lock_ms=LOCK_MS, conn=c),
    "defer": lambda q, ms, c: q.defer(ms[0], conn=c),
    "delete_many": lambda q, ms, c: _assert_all_ok(q.delete_many(ms[:100], conn=c)),
    "defer_many": lambda q, ms, c: _assert_all_ok(q.defer_many(ms[:100], conn=c)),
    "heartbeat_many": lambda q, ms, c: _heartbeat_many(q, ms[:100], c),
}


@pytest.mark.parametrize("operation", sorted(OPERATIONS))
def test_a_held_message_is_looked_up_by_primary_key_with_stale_statistics(
    queue: Queue, held: list[Message], dsn: str, operation: str
) -> None:
    # Several calls on one connection: the first ones run custom plans, later ones may run the
    # function's cached generic plan; neither may scan the index of locked messages.
    with psycopg.connect(dsn) as conn:
        for round_ in range(7):
            batch = held[round_ * 100 : (round_ + 1) * 100]
            with conn.transaction():
                before = _index_scans(conn, queue.schema)
                OPERATIONS[operation](queue, batch, conn)
                after = _index_scans(conn, queue.schema)
            assert after["message_unlock_ix"] == before["message_unlock_ix"], (
                f"{operation} scanned message_unlock_ix ({HELD} entries) to find a held message"
            )
            assert after["message_pkey"] > before["message_pkey"]
