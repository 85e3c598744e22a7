"""The ready floor (channel_ready_floor, sql/schema/20_channel.sql): a take looks for the next due
channel from it rather than from the low end of channel_ready_ix; about once a second a take
looks from the low end and sets it again; every change that makes a channel servable sooner
brings it down at once, so such a channel is served first, as before."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from lonnymq import Queue

LOCK_MS = 600_000
DAY_MS = 86_400_000

Conn = psycopg.Connection[Any]


def floor(admin: Conn, queue: Queue) -> int:
    row = admin.execute(
        sql.SQL("SELECT last_value FROM {}").format(sql.Identifier(queue.schema, "ready_floor_seq"))
    ).fetchone()
    assert row is not None
    return int(row[0])


def set_floor(admin: Conn, queue: Queue, value: int) -> None:
    name = sql.Identifier(queue.schema, "ready_floor_seq").as_string(admin)
    admin.execute("SELECT setval(%s::regclass, %s)", (name, value))


def test_a_take_sets_the_floor_from_the_low_end_about_once_a_second(
    queue: Queue, admin: Conn
) -> None:
    first = queue.create(b"a", channel="a", dequeue_at=queue.now() - DAY_MS).id
    b_at = queue.now()
    queue.create(b"b", channel="b", dequeue_at=b_at)
    taken = queue.dequeue(lock_ms=LOCK_MS)
    assert taken is not None
    assert taken.id == first
    # The first take looked from the low end: the floor is channel a's time as it found it.
    assert floor(admin, queue) == taken.dequeue_at
    # A second and a half later a take looks again and raises the floor to the earliest
    # servable channel (b), 2 s before its clock at most.
    queue.set_clock_offset(1_500)
    before = queue.now()
    assert queue.dequeue(lock_ms=LOCK_MS) is not None
    after = queue.now()
    assert min(b_at, before - 2_000) <= floor(admin, queue) <= after - 2_000


def test_a_channel_made_due_below_the_floor_is_served_first(queue: Queue, admin: Conn) -> None:
    queue.create(b"a", channel="a")
    queue.create(b"a", channel="a")
    assert queue.dequeue(lock_ms=LOCK_MS) is not None
    raised = floor(admin, queue)
    # A message with an early time in a new channel, then in a channel already due.
    early = queue.create(b"early", channel="b", dequeue_at=raised - DAY_MS).id
    assert floor(admin, queue) == raised - DAY_MS
    taken = queue.dequeue(lock_ms=LOCK_MS)
    assert taken is not None
    assert taken.id == early


def test_a_saturated_channel_given_a_slot_below_the_floor_is_served_first(
    queue: Queue, admin: Conn
) -> None:
    limited = queue.channel("p")
    limited.set_policy(max_concurrency=1)
    limited.create(b"p1")
    limited.create(b"p2")
    held = queue.dequeue(lock_ms=LOCK_MS)
    assert held is not None
    assert held.channel == "p"
    # Time passes; p, saturated, is out of the index while a take raises the floor past its
    # next time (the earliest servable channel is q, due now).
    queue.set_clock_offset(10_000)
    queue.create(b"q1", channel="q")
    queue.create(b"q2", channel="q")
    assert queue.dequeue(lock_ms=LOCK_MS) is not None
    assert floor(admin, queue) > held.dequeue_at
    held.delete()
    # The freed slot brings the floor down to p's time: p comes first again.
    taken = queue.dequeue(lock_ms=LOCK_MS)
    assert taken is not None
    assert taken.channel == "p"


def test_a_channel_left_below_the_floor_is_found_by_the_next_look_from_the_low_end(
    queue: Queue, admin: Conn
) -> None:
    """In a race (a look from the low end setting the floor over a change that brought it
    down) a channel can be left below the floor: the next such look, within a second, finds
    it."""
    queue.create(b"x", channel="x")
    assert queue.dequeue(lock_ms=LOCK_MS) is not None
    hidden = queue.create(b"h", channel="h").id
    set_floor(admin, queue, queue.now() + DAY_MS)
    queue.set_clock_offset(1_000)
    taken = queue.dequeue(lock_ms=LOCK_MS)
    assert taken is not None
    assert taken.id == hidden
