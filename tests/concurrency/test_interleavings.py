"""Explicit interleavings of two sessions on one channel."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg

from lonnymq import Message, Queue

LOCK_MS = 60_000


def test_dequeue_waits_for_a_busy_channel_instead_of_reporting_empty(
    dsn: str, queue: Queue
) -> None:
    """Session A dequeues from the only ready channel and keeps its transaction open a moment,
    so it holds the channel's row. Session B's dequeue must not answer "empty" (a ready message
    exists): it waits for A to commit, then takes the next message."""
    queue.create(b"first", channel="hot")
    queue.create(b"second", channel="hot")
    got: list[Message | None] = []

    with psycopg.connect(dsn) as session_a:
        taken = queue.dequeue(lock_ms=LOCK_MS, conn=session_a)
        assert taken is not None
        assert taken.content == b"first"
        thread = threading.Thread(target=lambda: got.append(queue.dequeue(lock_ms=LOCK_MS)))
        thread.start()
        time.sleep(0.03)
        session_a.commit()
        thread.join(timeout=10)
        assert not thread.is_alive()
    assert len(got) == 1
    assert got[0] is not None
    assert got[0].content == b"second"


def test_dequeue_does_not_block_behind_a_long_transaction(dsn: str, queue: Queue) -> None:
    """If A keeps the channel's row for long, B gives up after a short wait (it never blocks
    on a lock, so it can never deadlock) and reports nothing ready."""
    queue.create(b"first", channel="hot")
    queue.create(b"second", channel="hot")
    with psycopg.connect(dsn) as session_a:
        assert queue.dequeue(lock_ms=LOCK_MS, conn=session_a) is not None
        started = time.monotonic()
        assert queue.dequeue(lock_ms=LOCK_MS) is None
        assert time.monotonic() - started < 5
        session_a.commit()
    assert queue.dequeue(lock_ms=LOCK_MS) is not None


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
