"""A create that commits while a dequeue rotates the same policy-free channel.

The interleaving (session D dequeues the channel's last waiting message, session C creates):

1. D locks the channel's row and its head, then (channel_rotate) reads the channel's next
   waiting message: none, because C's message is not committed yet;
2. C, holding the channel's shared advisory lock, sees the row due already, so it does not
   write it, inserts its message and commits (releasing the advisory lock);
3. D takes the channel's exclusive advisory lock (free now) and, having read "nothing
   waiting", deletes the row.

Unless D reads the channel again once it holds the exclusive lock, C's message is left with
no channel row: no dequeue finds it (verify reports ``channel_missing``). The pause between
steps 1 and 3 is injected by wrapping the schema's channel_key() (which D calls right before
taking the lock) so that D's call of a given number waits on a test-held advisory lock.

A batch take (``message_dequeue_loop``) sends the channels it drained to the back together,
after its first calls of channel_key() (the shared advisory lock of each channel it takes
from): the same race, replayed by pausing at the first lock it tries for the rotation.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from lonnymq import Message, Queue

LOCK_MS = 60_000
# This run's own key: advisory locks are shared by every client of the database.
BARRIER = -1 - secrets.randbits(48)

# channel_key() as sql/schema/20_channel.sql defines it, plus: in a session with
# lonnymq_test.pause on, the call numbered lonnymq_test.pause_at (of the transaction) first
# waits for the barrier (the test holds it).
PAUSING_CHANNEL_KEY = """
CREATE OR REPLACE FUNCTION {s}.channel_key(p_channel TEXT) RETURNS BIGINT
LANGUAGE plpgsql VOLATILE
SET search_path = {s}
AS $$
DECLARE
    v_calls INTEGER;
BEGIN
    IF current_setting('lonnymq_test.pause', TRUE) = 'on' THEN
        v_calls := coalesce(nullif(current_setting('lonnymq_test.calls', TRUE), ''), '0')::INTEGER
            + 1;
        PERFORM set_config('lonnymq_test.calls', v_calls::TEXT, TRUE);
        IF v_calls = current_setting('lonnymq_test.pause_at')::INTEGER THEN
            PERFORM pg_advisory_xact_lock({barrier});
        END IF;
    END IF;
    RETURN hashtextextended(p_channel, hashtext(current_schema())::BIGINT);
END;
$$
"""


def _wait_for_a_waiter(admin: psycopg.Connection[Any], pids: list[int]) -> None:
    """Return once session D (its pid lands in ``pids``) waits for an advisory lock: only D,
    since another client of the server (a second test run) may be waiting for one too."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        row = admin.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            " AND pid = ANY(%s)",
            [pids],
        ).fetchone()
        if row is not None and row[0] > 0:
            return
        time.sleep(0.01)
    raise AssertionError("the dequeue never reached the pause")


def _take_while_paused(
    dsn: str,
    queue: Queue,
    admin: psycopg.Connection[Any],
    take: Callable[[psycopg.Connection[Any]], list[Message]],
    pause_at: int,
) -> list[Message]:
    """Session D runs ``take`` on its connection, paused at its ``pause_at``-th call of
    channel_key(); session C creates b"second" in channel "a" meanwhile. Returns what D took."""
    admin.execute(
        sql.SQL(PAUSING_CHANNEL_KEY).format(
            s=sql.Identifier(queue.schema), barrier=sql.Literal(BARRIER)
        )
    )
    admin.execute("SELECT pg_advisory_lock(%s)", (BARRIER,))
    got: list[Message] = []
    errors: list[BaseException] = []
    d_pids: list[int] = []

    def session_d() -> None:
        try:
            with psycopg.connect(dsn) as conn:
                d_pids.append(conn.info.backend_pid)
                conn.execute("SET lonnymq_test.pause = 'on'")
                conn.execute(
                    "SELECT set_config('lonnymq_test.pause_at', %s, FALSE)", (str(pause_at),)
                )
                got.extend(take(conn))
                conn.commit()
        except BaseException as err:  # reported by the main thread
            errors.append(err)

    thread = threading.Thread(target=session_d)
    thread.start()
    try:
        _wait_for_a_waiter(admin, d_pids)
        # Session C: a ready message in the same channel, committed while D is paused.
        queue.create(b"second", channel="a")
    finally:
        admin.execute("SELECT pg_advisory_unlock(%s)", (BARRIER,))
        thread.join(timeout=30)
    assert not errors, errors
    return got


def _second_is_served(queue: Queue) -> None:
    assert queue.verify() == []
    second = queue.dequeue(lock_ms=LOCK_MS)
    assert second is not None
    assert second.content == b"second"


def test_create_committing_during_rotate_is_not_stranded(
    dsn: str, queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    queue.create(b"first", channel="a")

    def take(conn: psycopg.Connection[Any]) -> list[Message]:
        message = queue.dequeue(lock_ms=LOCK_MS, conn=conn)
        return [] if message is None else [message]

    # channel_key()'s first call is the take's shared lock, its second the rotation's.
    got = _take_while_paused(dsn, queue, admin, take, pause_at=2)
    assert [m.content for m in got] == [b"first"]
    _second_is_served(queue)


def test_create_committing_during_batch_rotate_is_not_stranded(
    dsn: str, queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    queue.create(b"first", channel="a")
    queue.create(b"other", channel="b")

    def take(conn: psycopg.Connection[Any]) -> list[Message]:
        return queue.dequeue_batch(2, lock_ms=LOCK_MS, conn=conn).messages

    # The batch takes one head from each channel (channel_key() twice: their shared locks),
    # drains both, and sends them to the back: the third call is the first lock it tries.
    got = _take_while_paused(dsn, queue, admin, take, pause_at=3)
    assert sorted(m.content for m in got) == [b"first", b"other"]
    _second_is_served(queue)
