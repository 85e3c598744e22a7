"""A batch finish deletes its messages in one statement, locking them in id order (the order a
mixed settle locks them in too), whatever the order of their channels or of the caller's list."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from lonnymq import AckStatus, Queue

sys.path.insert(0, str(Path(__file__).parent))
from lock_helpers import in_thread, wait_until_blocked


def test_a_batch_finish_locks_its_messages_in_id_order(
    queue: Queue, admin: psycopg.Connection[Any], dsn: str
) -> None:
    """The low id is in channel ``z``, the high one in ``a``, and the caller names the high one
    first: whatever the order of the channels' names or of the call's list, the finish locks
    (and deletes) the low id before it waits for the high one, which another session holds."""
    low = queue.create(b"low", channel="z").id
    high = queue.create(b"high", channel="a").id
    assert low is not None
    assert high is not None
    assert low < high
    held = {m.id: m for m in queue.dequeue_many(2, lock_ms=600_000)}
    assert sorted(held) == [low, high]
    table = sql.Identifier(queue.schema, "message")
    with psycopg.connect(dsn) as holder, psycopg.connect(dsn) as finisher:
        holder.execute(sql.SQL("SELECT FROM {} WHERE id = %s FOR UPDATE").format(table), [high])
        pid = finisher.info.backend_pid
        thread, out = in_thread(lambda: queue.delete_many([held[high], held[low]], conn=finisher))
        try:
            wait_until_blocked(admin, pid)
            # The low id is locked by the waiting finish already: a lock of it cannot be had.
            with psycopg.connect(dsn) as probe:
                try:
                    probe.execute(
                        sql.SQL("SELECT FROM {} WHERE id = %s FOR UPDATE NOWAIT").format(table),
                        [low],
                    )
                except psycopg.errors.LockNotAvailable:
                    locked = True
                else:
                    locked = False
        finally:
            holder.rollback()
            thread.join(30)
        assert locked, "the finish waited for the high id before it locked the low one"
        assert not thread.is_alive()
        assert out == [[AckStatus.OK, AckStatus.OK]]
        finisher.commit()
    count = admin.execute(
        sql.SQL("SELECT count(*) FROM {} WHERE id IN (%s, %s)").format(table), [low, high]
    ).fetchone()
    assert count == (0,)
