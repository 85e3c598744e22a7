"""Where a channel's waiting messages begin (its row's head_at, head_id): a worker's take (in
message_settle) moves the mark up to the channel's first waiting message, and every way a
message comes to wait before the mark brings it back down, so no waiting message is ever passed
(sql/schema/20_channel.sql)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from lonnymq import Message, NewMessage, Queue

sys.path.insert(0, str(Path(__file__).parent))
from lock_helpers import in_thread, wait_until_blocked

LOCK_MS = 600_000
HOUR_MS = 3_600_000
# A take moves the mark only once this many ids were drawn since it was set.
STEP = 1_000

Conn = psycopg.Connection[Any]


def mark(admin: Conn, queue: Queue, channel: str) -> tuple[int, int] | None:
    row = admin.execute(
        sql.SQL("SELECT head_at, head_id FROM {}.channel WHERE name = %s").format(
            sql.Identifier(queue.schema)
        ),
        (channel,),
    ).fetchone()
    return None if row is None else (row[0], row[1])


def first_waiting(admin: Conn, queue: Queue, channel: str) -> tuple[int, int] | None:
    row = admin.execute(
        sql.SQL(
            "SELECT dequeue_at, id FROM {}.message WHERE channel = %s AND NOT is_locked "
            "ORDER BY dequeue_at, id LIMIT 1"
        ).format(sql.Identifier(queue.schema)),
        (channel,),
    ).fetchone()
    return None if row is None else (row[0], row[1])


def fill(queue: Queue, channel: str, n: int) -> list[int]:
    """``n`` messages due one millisecond apart, the last one a second ago."""
    start = queue.now() - 1_000 - n
    results = queue.create_many(
        [NewMessage(b"%d" % i, channel=channel, dequeue_at=start + i) for i in range(n)]
    )
    return [r.id for r in results if r.id is not None]


def take(queue: Queue, n: int, conn: Conn | None = None) -> list[Message]:
    """Take as a worker does (message_settle): the take may move the mark."""
    return queue.settle([], n, lock_ms=LOCK_MS, conn=conn).messages


def skip_ids(admin: Conn, queue: Queue) -> None:
    """Draw STEP ids, as other channels' messages would: the next take may move the mark."""
    seq = sql.Identifier(queue.schema, "message_id_seq")
    admin.execute(
        sql.SQL("SELECT setval(%s::regclass, (SELECT last_value FROM {}) + %s)").format(seq),
        (seq.as_string(admin), STEP),
    )


def test_a_take_moves_the_mark_to_the_first_waiting_message(queue: Queue, admin: Conn) -> None:
    ids = fill(queue, "c", STEP + 5)
    before = mark(admin, queue, "c")
    first = first_waiting(admin, queue, "c")
    assert first is not None
    assert first[1] == ids[0]
    # Made for the channel's first message: a second below it, so that creators whose
    # transactions began up to a second earlier need not bring it down.
    assert before == (first[0] - 1_000, first[1])
    # A dequeue of one's own (perhaps in a long transaction) leaves the mark alone.
    assert [m.id for m in queue.dequeue_many(5, lock_ms=LOCK_MS)] == ids[:5]
    assert mark(admin, queue, "c") == before
    taken = take(queue, 5)
    assert [m.id for m in taken] == ids[5:10]
    assert mark(admin, queue, "c") == first_waiting(admin, queue, "c")
    assert mark(admin, queue, "c") != before
    # Fewer than STEP ids since: the next take leaves the mark where it is.
    moved = mark(admin, queue, "c")
    take(queue, 10)
    assert mark(admin, queue, "c") == moved
    assert queue.verify() == []


def test_a_batch_over_several_channels_moves_each_ones_mark(queue: Queue, admin: Conn) -> None:
    """A batch take serves its channels together and moves each one's mark in the statement
    that sends them to the back: to the first message each still has waiting."""
    names = ("a", "b", "c")
    ids = {name: fill(queue, name, 3) for name in names}
    before = {name: mark(admin, queue, name) for name in names}
    skip_ids(admin, queue)
    taken = take(queue, len(names))
    assert sorted(m.id for m in taken) == sorted(ids[name][0] for name in names)
    for name in names:
        assert mark(admin, queue, name) == first_waiting(admin, queue, name)
        assert mark(admin, queue, name) != before[name]
    assert queue.verify() == []
    # What the marks now pass over is taken; the rest comes out in order.
    rest = take(queue, 10)
    assert sorted(m.id for m in rest) == sorted(i for name in names for i in ids[name][1:])


def test_a_message_created_before_the_mark_is_taken_first(queue: Queue, admin: Conn) -> None:
    fill(queue, "c", STEP + 100)
    take(queue, 10)
    at, _ = mark(admin, queue, "c") or (0, 0)
    # One create, one batch on the fast path, one with a dedup key (the locked path).
    early = [
        queue.create(b"early", channel="c", dequeue_at=at - 3).id,
        queue.create_many([NewMessage(b"early", channel="c", dequeue_at=at - 2)])[0].id,
        queue.create_many([NewMessage(b"early", channel="c", dequeue_at=at - 1, dedup_key="k")])[
            0
        ].id,
    ]
    assert queue.verify() == []
    assert [m.id for m in queue.dequeue_many(3, lock_ms=LOCK_MS)] == early


def test_a_message_due_now_is_found_while_the_mark_waits_on_a_later_one(
    queue: Queue, admin: Conn
) -> None:
    later = queue.create(b"later", channel="c", dequeue_at=queue.now() + HOUR_MS).id
    # Each way a message comes to wait now, before the later one.
    makers: list[Callable[[], int | None]] = [
        lambda: queue.create(b"now", channel="c").id,
        lambda: queue.create_many([NewMessage(b"now", channel="c")])[0].id,
        lambda: queue.create(b"now", channel="c", dedup_key="k").id,
    ]
    for make in makers:
        # The channel drains down to the later message: the mark moves onto it.
        queue.create(b"due", channel="c")
        skip_ids(admin, queue)
        (due,) = take(queue, 1)
        due.delete()
        assert mark(admin, queue, "c") == first_waiting(admin, queue, "c")
        assert (mark(admin, queue, "c") or (0, 0))[1] == later
        made = make()
        assert queue.verify() == []
        taken = queue.dequeue(lock_ms=LOCK_MS)
        assert taken is not None
        assert taken.id == made
        taken.delete()


def test_a_message_given_back_or_expedited_before_the_mark_is_found(
    queue: Queue, admin: Conn
) -> None:
    fill(queue, "c", STEP + 100)
    held = take(queue, 10)
    assert mark(admin, queue, "c") == first_waiting(admin, queue, "c")
    # Given back to wait at its old time: it sorts before every message still waiting.
    held[0].defer(dequeue_at=held[0].dequeue_at)
    assert queue.verify() == []
    again = queue.dequeue(lock_ms=LOCK_MS)
    assert again is not None
    assert again.id == held[0].id

    # A message due in an hour, alone in its channel; made due now by an operator.
    later = queue.create(b"later", channel="d", dequeue_at=queue.now() + HOUR_MS).id
    first = first_waiting(admin, queue, "d")
    assert first is not None
    assert mark(admin, queue, "d") == (first[0] - 1_000, first[1])
    queue._fetch("message_expedite", {"id": later, "channel": None}, None)
    assert queue.verify() == []


def test_the_mark_stays_while_a_create_in_the_channel_is_uncommitted(
    dsn: str, queue: Queue, admin: Conn
) -> None:
    """A create holds the channel's shared lock from before it reads the mark until it
    commits: a take meanwhile cannot move the mark past the message it is creating (here one
    due before every waiting message, which the create saw no reason to report)."""
    fill(queue, "c", STEP + 100)
    base = mark(admin, queue, "c")
    assert base is not None
    with psycopg.connect(dsn) as producer:
        # Due after the first waiting message, before the fiftieth.
        early = queue.create(b"early", channel="c", dequeue_at=base[0] + 1, conn=producer).id
        assert early is not None
        taken = take(queue, 50)
        assert len(taken) == 50
        assert mark(admin, queue, "c") == base
        producer.commit()
    assert queue.verify() == []
    first = queue.dequeue(lock_ms=LOCK_MS)
    assert first is not None
    assert first.id == early


def test_a_create_waiting_for_a_take_that_moved_the_mark_brings_it_back(
    dsn: str, queue: Queue, admin: Conn
) -> None:
    """A take that moved the mark holds the channel's exclusive lock until it commits; a
    create in the channel waits for it, then reads the mark as moved and brings it back down
    to its message."""
    fill(queue, "c", STEP + 100)
    base = mark(admin, queue, "c")
    assert base is not None
    with psycopg.connect(dsn) as consumer:
        taken = take(queue, 50, conn=consumer)
        assert len(taken) == 50
        with psycopg.connect(dsn, autocommit=True) as producer:
            thread, out = in_thread(
                lambda: queue.create(b"early", channel="c", dequeue_at=base[0] + 1, conn=producer)
            )
            wait_until_blocked(admin, producer.info.backend_pid)
            assert mark(admin, queue, "c") == base  # (the move is not committed yet)
            consumer.commit()
            thread.join()
    early = out[0].id
    assert (mark(admin, queue, "c") or (0, 0))[1] == early
    assert queue.verify() == []
    first = queue.dequeue(lock_ms=LOCK_MS)
    assert first is not None
    assert first.id == early
