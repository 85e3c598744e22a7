"""Two workers' group commits at once (``queue.settle``), each reporting several kinds of outcome
over the same channels with a policy: a settle takes every lock it may wait for in one order
(its messages, then its channels by name), so two of them never wait for each other.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from lonnymq import Message, Outcome, Queue
from lonnymq.types import AckStatus

sys.path.insert(0, str(Path(__file__).parent))
from lock_helpers import in_thread, wait_until_blocked


def _take(queue: Queue, count: int) -> dict[bytes, Message]:
    taken = queue.dequeue_many(count, lock_ms=600_000)
    assert len(taken) == count
    return {message.content: message for message in taken}


def _waits_before_done(admin: psycopg.Connection[Any], pid: int, thread: threading.Thread) -> bool:
    """Whether backend ``pid`` waits for a lock before ``thread`` (its caller) is done."""
    deadline = time.monotonic() + 60
    while thread.is_alive():
        assert time.monotonic() < deadline, "the call neither ended nor waited"
        row = admin.execute(
            "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
        ).fetchone()
        if row is not None and row[0] == "Lock":
            return True
        thread.join(timeout=0.01)
    return False


@pytest.mark.parametrize("second", ["defer", "fail"])
def test_two_settles_over_the_same_policy_channels_do_not_deadlock(
    dsn: str, queue: Queue, admin: psycopg.Connection[Any], second: str
) -> None:
    """A completes a message of ``p2`` and defers (or fails) one of ``p1``; B completes one of
    ``p1`` and defers (or fails) one of ``p2``. A third session holds the row of A's second
    message, so A waits there. Had A locked ``p2``'s row on its way (its completes first, then
    the rest), B would wait for A at ``p2`` while holding ``p1``, and once the third session let
    go A would wait for B at ``p1``: a deadlock. B goes through, then A."""
    for name in ("p1", "p2"):
        queue.channel(name).set_policy(max_concurrency=10)
    queue.create(b"a-done", channel="p2")
    queue.create(b"a-back", channel="p1")
    queue.create(b"b-done", channel="p1")
    queue.create(b"b-back", channel="p2")
    held = _take(queue, 4)

    def then(message: Message) -> Outcome[Message]:
        return Outcome.defer(message) if second == "defer" else Outcome.fail(message, error="x")

    outcomes_a = [Outcome.complete(held[b"a-done"]), then(held[b"a-back"])]
    outcomes_b = [Outcome.complete(held[b"b-done"]), then(held[b"b-back"])]

    with (
        psycopg.connect(dsn, autocommit=True) as blocker,
        psycopg.connect(dsn, autocommit=True) as conn_a,
        psycopg.connect(dsn, autocommit=True) as conn_b,
    ):
        blocker.execute("BEGIN")
        blocker.execute(
            sql.SQL("SELECT FROM {}.message WHERE id = %s FOR UPDATE").format(
                sql.Identifier(queue.schema)
            ),
            (held[b"a-back"].id,),
        )
        pid_a = conn_a.info.backend_pid
        thread_a, out_a = in_thread(lambda: queue.settle(outcomes_a, lock_ms=60_000, conn=conn_a))
        wait_until_blocked(admin, pid_a)

        pid_b = conn_b.info.backend_pid
        thread_b, out_b = in_thread(lambda: queue.settle(outcomes_b, lock_ms=60_000, conn=conn_b))
        b_waited = _waits_before_done(admin, pid_b, thread_b)
        blocker.execute("ROLLBACK")
        thread_a.join(timeout=60)
        thread_b.join(timeout=60)

    assert not b_waited, "B waited for A, which waits for the third session"
    for out in (out_a, out_b):
        [result] = out
        assert not isinstance(result, BaseException), result
        assert result.completed == [AckStatus.OK, AckStatus.OK]
    rows = admin.execute(
        sql.SQL("SELECT content, is_locked FROM {}.message ORDER BY content").format(
            sql.Identifier(queue.schema)
        )
    ).fetchall()
    given_back = [(b"a-back", False), (b"b-back", False)] if second == "defer" else []
    assert [(bytes(content), locked) for content, locked in rows] == given_back
    concurrency = admin.execute(
        sql.SQL("SELECT name, current_concurrency FROM {}.channel ORDER BY name").format(
            sql.Identifier(queue.schema)
        )
    ).fetchall()
    assert concurrency == [("p1", 0), ("p2", 0)]
