"""Interleavings of an operator's actions on a waiting message (message_discard,
message_expedite) with a dequeue taking that message and with a create in its channel."""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from lonnymq import Queue
from lonnymq.errors import MessageLockedError

sys.path.insert(0, str(Path(__file__).parent))
from lock_helpers import in_thread, wait_until_blocked

LOCK_MS = 600_000


def test_an_action_on_a_message_being_taken_waits_then_is_refused(
    dsn: str, queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    """Session A dequeues the message and keeps its transaction open. B's discard (then B's
    expedite) waits for A's row lock; A commits; B finds the message locked and is refused:
    the message stays A's, its channel untouched."""
    message_id = queue.create(b"m", channel="c").id
    for name in ("message_discard", "message_expedite"):
        with psycopg.connect(dsn) as session_a:
            taken = queue.dequeue(lock_ms=LOCK_MS, conn=session_a)
            assert taken is not None
            assert taken.id == message_id
            pid = admin.execute("SELECT pg_backend_pid()").fetchone()
            assert pid is not None
            with psycopg.connect(dsn, autocommit=True) as session_b:
                b_pid = session_b.info.backend_pid
                params = {"id": message_id, "channel": None}
                thread, out = in_thread(partial(queue._fetch, name, params, session_b))
                wait_until_blocked(admin, b_pid)
                session_a.commit()
                thread.join(timeout=30)
                assert not thread.is_alive()
            assert len(out) == 1
            assert isinstance(out[0], MessageLockedError), out
        # Give it back for the next round.
        queue.defer(taken, dequeue_at=queue.now())
    assert queue.dequeue(lock_ms=LOCK_MS) is not None


def test_a_discard_beside_an_uncommitted_create_leaves_the_row_early_not_late(
    dsn: str, queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    """Session A creates a message in policy-free channel c, due after c's only message, and
    has not committed (it holds c's shared advisory lock, and has not written c's row: the row
    is due sooner than its message). B discards c's only message: its try for c's exclusive
    lock fails, so B leaves c's row as it was, too early rather than gone; once A commits,
    the row still says c is due no later than A's message."""
    now = queue.now()
    first = queue.create(b"first", channel="c", dequeue_at=now + 3_600_000).id
    with psycopg.connect(dsn) as session_a:
        queue.create(b"second", channel="c", dequeue_at=now + 7_200_000, conn=session_a)
        queue._fetch("message_discard", {"id": first, "channel": "c"}, None)
        session_a.commit()
    row = admin.execute(
        sql.SQL("SELECT next_dequeue_at FROM {}.channel WHERE name = 'c'").format(
            sql.Identifier(queue.schema)
        )
    ).fetchone()
    assert row is not None
    assert row[0] <= now + 7_200_000
    # Without A, the same discard finds nothing left to wait in c and removes its row.
    (second,) = admin.execute(
        sql.SQL("SELECT id FROM {}.message WHERE channel = 'c'").format(
            sql.Identifier(queue.schema)
        )
    ).fetchall()
    queue._fetch("message_discard", {"id": second[0], "channel": "c"}, None)
    assert admin.execute(
        sql.SQL("SELECT count(*) FROM {}.channel").format(sql.Identifier(queue.schema))
    ).fetchone() == (0,)
