"""Explicit interleavings of two sessions on one channel."""

from __future__ import annotations

import threading
from typing import Any

import psycopg

from lonnymq import Message, Queue

LOCK_MS = 60_000


def test_dequeue_waits_for_a_busy_channel_instead_of_reporting_empty(
    dsn: str, queue: Queue
) -> None:
    """Session A dequeues from the only ready channel and keeps its transaction open, so it
    holds the channel's row. Session B's dequeue must not answer "empty" (a ready message
    exists): it waits for A to commit, then takes the next message."""
    queue.create(b"first", channel="hot")
    queue.create(b"second", channel="hot")
    got: list[Message | None] = []

    with psycopg.connect(dsn) as session_a:
        taken = queue.dequeue(lock_ms=LOCK_MS, conn=session_a)
        assert taken is not None
        assert taken.content == b"first"

        def session_b() -> None:
            got.append(queue.dequeue(lock_ms=LOCK_MS))

        thread = threading.Thread(target=session_b)
        thread.start()
        thread.join(timeout=0.5)
        assert thread.is_alive(), "B answered while A still held the channel"
        session_a.commit()
        thread.join(timeout=10)
        assert not thread.is_alive()
    assert len(got) == 1
    assert got[0] is not None
    assert got[0].content == b"second"


def test_a_waiting_dequeue_gives_up_when_the_channel_is_drained(dsn: str, queue: Queue) -> None:
    """Same interleaving with a single message: once A commits nothing is ready, so B returns
    None (after waiting once) rather than spinning."""
    queue.create(b"only", channel="hot")
    got: list[Any] = []
    with psycopg.connect(dsn) as session_a:
        assert queue.dequeue(lock_ms=LOCK_MS, conn=session_a) is not None
        thread = threading.Thread(target=lambda: got.append(queue.dequeue(lock_ms=LOCK_MS)))
        thread.start()
        thread.join(timeout=0.3)
        session_a.commit()
        thread.join(timeout=10)
    assert got == [None]
