"""Explicit interleavings of two sessions on one channel."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from lonnymq import Message, Queue

LOCK_MS = 60_000
TimedDequeues = Callable[[Queue, int], tuple[list[Message], float]]
# A channel with a policy is served under its row, so a second dequeue waits for the row's
# holder; a channel without one is "ridden along" instead (tests/concurrency/test_fast_paths.py).
MAX_CONCURRENCY = 10


def test_dequeue_waits_for_a_busy_channel_instead_of_reporting_empty(
    dsn: str, queue: Queue
) -> None:
    """Session A dequeues from the only ready channel and keeps its transaction open a moment,
    so it holds the channel's row. Session B's dequeue must not answer "empty" (a ready message
    exists): it waits for A to commit, then takes the next message. (A channel with a policy:
    one without is served to B at once, see below.)"""
    queue.channel("hot").set_policy(max_concurrency=MAX_CONCURRENCY)
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
    """If A keeps the row of a channel with a policy for long, B gives up after a short wait
    (it never blocks on a lock, so it can never deadlock) and reports nothing ready."""
    queue.channel("hot").set_policy(max_concurrency=MAX_CONCURRENCY)
    queue.create(b"first", channel="hot")
    queue.create(b"second", channel="hot")
    with psycopg.connect(dsn) as session_a:
        assert queue.dequeue(lock_ms=LOCK_MS, conn=session_a) is not None
        started = time.monotonic()
        assert queue.dequeue(lock_ms=LOCK_MS) is None
        assert time.monotonic() - started < 5
        session_a.commit()
    assert queue.dequeue(lock_ms=LOCK_MS) is not None


def test_policy_free_channel_is_served_behind_a_long_transaction(
    dsn: str, queue: Queue, timed_dequeues: TimedDequeues
) -> None:
    """Without a policy B does not wait for A's row at all: it takes the next message at once
    ("rides along"), and the two never share a message."""
    for content in (b"first", b"second", b"third", b"fourth", b"fifth"):
        queue.create(content, channel="hot")
    with psycopg.connect(dsn) as session_a:
        taken = queue.dequeue(lock_ms=LOCK_MS, conn=session_a)
        assert taken is not None
        assert taken.content == b"first"
        others, best = timed_dequeues(queue, 3)
        assert [m.content for m in others] == [b"second", b"third", b"fourth"]
        assert best < 0.09  # under the 0.1 s at least that a channel with a policy polls
        session_a.commit()
    fifth = queue.dequeue(lock_ms=LOCK_MS)
    assert fifth is not None
    assert fifth.content == b"fifth"
    assert queue.dequeue(lock_ms=LOCK_MS) is None


@pytest.mark.parametrize("policy", [True, False], ids=["policy", "no_policy"])
def test_a_waiting_dequeue_gives_up_when_the_channel_is_drained(
    dsn: str, queue: Queue, policy: bool
) -> None:
    """Same interleaving with a single message: once A commits nothing is ready, so B returns
    None (after waiting once, with a policy; at once, without) rather than spinning."""
    if policy:
        queue.channel("hot").set_policy(max_concurrency=MAX_CONCURRENCY)
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
