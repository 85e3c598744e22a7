"""Order of delivery: FIFO, scheduling, priority, ids within a transaction, round robin."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg import sql

from lonnymq import CreateStatus, InvalidArgumentError, NewMessage, Queue

LOCK_MS = 60_000
HOUR_MS = 3_600_000


def drain(queue: Queue) -> list[bytes]:
    """Dequeue one message at a time until none is ready; return the contents in order."""
    contents: list[bytes] = []
    while (message := queue.dequeue(lock_ms=LOCK_MS)) is not None:
        contents.append(message.content)
    return contents


def test_fifo_within_a_channel(queue: Queue) -> None:
    for i in range(5):
        queue.create(f"m{i}".encode(), channel="a")
    assert drain(queue) == [b"m0", b"m1", b"m2", b"m3", b"m4"]


def test_fifo_is_kept_while_earlier_messages_are_in_flight(queue: Queue) -> None:
    for i in range(3):
        queue.create(f"m{i}".encode(), channel="a")
    first = queue.dequeue(lock_ms=LOCK_MS)
    assert first is not None
    assert first.content == b"m0"
    queue.create(b"m3", channel="a")
    assert drain(queue) == [b"m1", b"m2", b"m3"]


def test_future_message_waits_for_its_dequeue_at(queue: Queue) -> None:
    now = queue.now()
    created = queue.create(b"later", channel="a", dequeue_at=now + 10_000)
    assert queue.dequeue(lock_ms=LOCK_MS) is None

    queue.set_clock_offset(5_000)
    assert queue.dequeue(lock_ms=LOCK_MS) is None

    queue.set_clock_offset(10_000)
    message = queue.dequeue(lock_ms=LOCK_MS)
    assert message is not None
    assert (message.id, message.dequeue_at) == (created.id, now + 10_000)


def test_future_message_does_not_block_ready_ones_behind_it(queue: Queue) -> None:
    now = queue.now()
    queue.create(b"later", channel="a", dequeue_at=now + 10_000)
    queue.create(b"now", channel="a")
    assert drain(queue) == [b"now"]
    queue.set_clock_offset(10_000)
    assert drain(queue) == [b"later"]


def test_scheduled_messages_leave_in_dequeue_at_order(queue: Queue) -> None:
    now = queue.now()
    queue.create(b"third", channel="a", dequeue_at=now + 3_000)
    queue.create(b"first", channel="a", dequeue_at=now + 1_000)
    queue.create(b"second", channel="a", dequeue_at=now + 2_000)
    assert drain(queue) == []
    queue.set_clock_offset(3_000)
    assert drain(queue) == [b"first", b"second", b"third"]


def test_now_reflects_the_clock_offset(queue: Queue) -> None:
    before = queue.now()
    moved = queue.set_clock_offset(3_600_000)
    after = queue.now()
    assert moved >= before + 3_600_000
    assert after >= moved
    assert after < before + 3_600_000 + 60_000


def test_historic_dequeue_at_jumps_the_line(queue: Queue) -> None:
    queue.create(b"normal-1", channel="a")
    queue.create(b"normal-2", channel="a")
    queue.create(b"p2", channel="a", dequeue_at=2)
    queue.create(b"p0", channel="a", dequeue_at=0)
    queue.create(b"p1", channel="a", dequeue_at=1)
    assert drain(queue) == [b"p0", b"p1", b"p2", b"normal-1", b"normal-2"]


def test_priority_sugar_maps_to_dequeue_at(queue: Queue) -> None:
    queue.create(b"normal", channel="a")
    urgent = queue.create(b"urgent", channel="a", priority=5)
    urgent_first = queue.create(b"urgent-first", channel="a", priority=0)
    assert urgent.status is CreateStatus.CREATED
    assert urgent_first.status is CreateStatus.CREATED

    first = queue.dequeue(lock_ms=LOCK_MS)
    second = queue.dequeue(lock_ms=LOCK_MS)
    assert first is not None
    assert second is not None
    assert (first.content, first.dequeue_at) == (b"urgent-first", 0)
    assert (second.content, second.dequeue_at) == (b"urgent", 5)
    assert drain(queue) == [b"normal"]


def test_priority_cannot_be_combined_with_dequeue_at(queue: Queue) -> None:
    now = queue.now()
    with pytest.raises(InvalidArgumentError):
        queue.create(b"x", channel="a", priority=1, dequeue_at=now + 1_000)
    assert queue.stats() == []


def test_priority_in_create_many_and_channel_create(queue: Queue) -> None:
    queue.create(b"normal", channel="a")
    results = queue.create_many(
        [NewMessage(b"urgent", channel="a", priority=5), NewMessage(b"later", channel="a")]
    )
    assert [r.status for r in results] == [CreateStatus.CREATED] * 2
    queue.channel("a").create(b"urgent-first", priority=0)
    assert drain(queue) == [b"urgent-first", b"urgent", b"normal", b"later"]
    with pytest.raises(InvalidArgumentError, match="priority and dequeue_at cannot be combined"):
        queue.create_many([NewMessage(b"x", priority=1, dequeue_at=queue.now() + 1_000)])
    with pytest.raises(InvalidArgumentError, match="priority must be an int between 0"):
        queue.create_many([NewMessage(b"ok"), NewMessage(b"x", priority=-1)])
    with pytest.raises(InvalidArgumentError, match="priority must be an int between 0"):
        queue.channel("a").create(b"x", priority=1_000_001)
    # The refused calls created nothing: the four taken above are all the channel holds.
    assert [(s.channel, s.size, s.in_flight) for s in queue.stats()] == [("a", 4, 4)]


def test_order_inside_one_transaction_is_by_id(queue: Queue, dsn: str) -> None:
    """Time does not move inside a transaction: every message gets the same dequeue_at."""
    with psycopg.connect(dsn) as conn:
        ids: list[int] = []
        with conn.transaction():
            t0 = queue.now(conn=conn)
            for i in range(5):
                created = queue.create(f"m{i}".encode(), channel="a", conn=conn)
                assert created.id is not None
                ids.append(created.id)
            assert queue.now(conn=conn) == t0
    messages = queue.dequeue_many(10, lock_ms=LOCK_MS)
    assert [m.id for m in messages] == ids
    assert ids == sorted(ids)
    assert {m.dequeue_at for m in messages} == {t0}


def test_dequeue_many_inside_one_transaction_keeps_fifo(queue: Queue, dsn: str) -> None:
    for i in range(4):
        queue.create(f"m{i}".encode(), channel="a")
    conn: psycopg.Connection[Any]
    with psycopg.connect(dsn) as conn, conn.transaction():
        first = queue.dequeue(lock_ms=LOCK_MS, conn=conn)
        second = queue.dequeue(lock_ms=LOCK_MS, conn=conn)
    assert first is not None
    assert second is not None
    assert (first.content, second.content) == (b"m0", b"m1")


def _round_robin_fixture(queue: Queue) -> None:
    """Three messages in each of channels a, b, c; a's are oldest, then b's, then c's."""
    base = queue.now() - 10_000
    items = [
        NewMessage(f"{channel}{i}".encode(), channel=channel, dequeue_at=base + offset)
        for offset, channel in enumerate("abc")
        for i in range(3)
    ]
    results = queue.create_many(items)
    assert [r.status for r in results] == [CreateStatus.CREATED] * 9


def test_round_robin_across_channels(queue: Queue) -> None:
    _round_robin_fixture(queue)
    order = drain(queue)
    assert order == [b"a0", b"b0", b"c0", b"a1", b"b1", b"c1", b"a2", b"b2", b"c2"]


@pytest.mark.parametrize("plans", ["custom", "generic"])
def test_round_robin_within_one_dequeue_many_batch(queue: Queue, dsn: str, plans: str) -> None:
    """Also with the generic plans a session caches after five calls (message_dequeue_loop, in
    sql/schema/40_take.sql, takes the heads by id and puts them back in turn by their
    places)."""
    _round_robin_fixture(queue)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"SET plan_cache_mode = force_{plans}_plan")
        batch = queue.dequeue_many(9, lock_ms=LOCK_MS, conn=conn)
    assert [m.content for m in batch] == [
        b"a0",
        b"b0",
        b"c0",
        b"a1",
        b"b1",
        b"c1",
        b"a2",
        b"b2",
        b"c2",
    ]


def test_round_robin_with_plain_creates(queue: Queue) -> None:
    """Created with default dequeue_at, one channel after the other: a busy channel does not
    keep the turn; each round serves every channel once, in a stable order."""
    for channel in "abc":
        for i in range(4):
            queue.create(f"{channel}{i}".encode(), channel=channel)
    order = [m.channel for m in queue.dequeue_many(12, lock_ms=LOCK_MS)]
    first_round = order[:3]
    assert sorted(first_round) == ["a", "b", "c"]
    assert order == first_round * 4


def test_a_batch_sends_the_channels_it_drained_to_the_back_together(
    queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    """The channels a batch leaves with no due head (channel_rotate_many): a drained one's row
    goes, one whose next message is scheduled waits for it, and the others are served on."""
    now = queue.now()
    queue.create(b"a0", channel="a")
    queue.create(b"b0", channel="b")
    queue.create(b"b1", channel="b", dequeue_at=now + HOUR_MS)
    queue.create(b"c0", channel="c")
    queue.create(b"c1", channel="c")
    # (Locked for longer than b1 waits: retry_at is the sooner of the two.)
    held = 2 * HOUR_MS
    taken = queue.dequeue_many(3, lock_ms=held)
    assert [m.content for m in taken] == [b"a0", b"b0", b"c0"]
    rows = dict(
        admin.execute(
            sql.SQL("SELECT name, next_dequeue_at FROM {}.channel ORDER BY name").format(
                sql.Identifier(queue.schema)
            )
        ).fetchall()
    )
    assert rows.keys() == {"b", "c"}
    assert rows["b"] == now + HOUR_MS
    assert rows["c"] <= queue.now()
    after = queue.dequeue_batch(5, lock_ms=held)
    assert [m.content for m in after.messages] == [b"c1"]
    assert queue.dequeue_batch(5, lock_ms=held).retry_at == now + HOUR_MS
    assert queue.verify() == []


def test_busy_channel_does_not_starve_a_newcomer(queue: Queue) -> None:
    for i in range(20):
        queue.create(f"busy{i}".encode(), channel="busy")
    queue.dequeue_many(3, lock_ms=LOCK_MS)
    queue.create(b"new", channel="newcomer")
    next_two = queue.dequeue_many(2, lock_ms=LOCK_MS)
    assert b"new" in [m.content for m in next_two]


def test_dequeue_returns_none_when_nothing_is_ready(queue: Queue) -> None:
    assert queue.dequeue(lock_ms=LOCK_MS) is None
    batch = queue.dequeue_batch(5, lock_ms=LOCK_MS)
    assert batch.messages == []
    assert batch.retry_at is None


def test_retry_at_is_the_earliest_future_message(queue: Queue) -> None:
    now = queue.now()
    queue.create(b"late", channel="a", dequeue_at=now + 20_000)
    queue.create(b"early", channel="b", dequeue_at=now + 7_000)
    queue.create(b"middle", channel="a", dequeue_at=now + 9_000)
    assert queue.dequeue(lock_ms=LOCK_MS) is None
    batch = queue.dequeue_batch(5, lock_ms=LOCK_MS)
    assert batch.messages == []
    assert batch.retry_at == now + 7_000

    queue.set_clock_offset(7_000)
    ready = queue.dequeue_batch(5, lock_ms=LOCK_MS)
    assert [m.content for m in ready.messages] == [b"early"]
    assert ready.retry_at is None
    after = queue.dequeue_batch(5, lock_ms=LOCK_MS)
    assert after.messages == []
    assert after.retry_at == now + 9_000


def test_retry_at_is_none_once_everything_is_finished(queue: Queue) -> None:
    now = queue.now()
    queue.create(b"x", channel="a", dequeue_at=now + 1_000)
    queue.set_clock_offset(1_000)
    message = queue.dequeue(lock_ms=LOCK_MS)
    assert message is not None
    message.delete()
    batch = queue.dequeue_batch(1, lock_ms=LOCK_MS)
    assert (batch.messages, batch.retry_at) == ([], None)


def test_retry_at_counts_in_flight_lock_expiry(queue: Queue) -> None:
    """A locked message comes back when its lock expires, so that is when to try again."""
    queue.create(b"x", channel="a")
    message = queue.dequeue(lock_ms=5_000)
    assert message is not None
    batch = queue.dequeue_batch(1, lock_ms=LOCK_MS)
    assert batch.messages == []
    assert batch.retry_at == message.unlock_at
