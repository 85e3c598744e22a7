"""An operator's actions on one waiting message (message_discard, message_expedite): each
keeps its channel's row as the queue's own operations do (size, next time, the row of a
drained policy-free channel gone), and refuses a locked message, a missing one, one of
another channel and a schedule's driver with a typed error, changing nothing."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg import sql

from lonnymq import Queue
from lonnymq.errors import (
    InvalidArgumentError,
    InvalidChannelError,
    MessageLockedError,
    MessageNotFoundError,
)

LOCK_MS = 600_000
HOUR_MS = 3_600_000


def _discard(queue: Queue, message_id: Any, channel: str | None = None) -> str:
    rows = queue._fetch("message_discard", {"id": message_id, "channel": channel}, None)
    return str(rows[0][0])


def _expedite(queue: Queue, message_id: Any, channel: str | None = None) -> tuple[str, bool]:
    rows = queue._fetch("message_expedite", {"id": message_id, "channel": channel}, None)
    return str(rows[0][0]), bool(rows[0][1])


def _row(admin: psycopg.Connection[Any], queue: Queue, channel: str) -> tuple[Any, ...] | None:
    """The channel's row: (next_dequeue_at, current_size, has_policy)."""
    return admin.execute(
        sql.SQL(
            "SELECT next_dequeue_at, current_size, has_policy FROM {}.channel WHERE name = %s"
        ).format(sql.Identifier(queue.schema)),
        [channel],
    ).fetchone()


def _state(admin: psycopg.Connection[Any], queue: Queue) -> tuple[Any, ...]:
    schema = sql.Identifier(queue.schema)
    return (
        admin.execute(sql.SQL("SELECT * FROM {}.message ORDER BY id").format(schema)).fetchall(),
        admin.execute(sql.SQL("SELECT * FROM {}.channel ORDER BY name").format(schema)).fetchall(),
        admin.execute(sql.SQL("SELECT * FROM {}.archive ORDER BY id").format(schema)).fetchall(),
    )


def test_discarding_the_last_waiting_message_of_a_policy_free_channel_removes_its_row(
    make_queue: Any, admin: psycopg.Connection[Any]
) -> None:
    queue = make_queue(archive=True)
    now = queue.now()
    later = queue.create(b"later", channel="c", dequeue_at=now + HOUR_MS).id
    assert later is not None
    assert _row(admin, queue, "c") is not None
    assert _discard(queue, later, "c") == "c"
    assert _row(admin, queue, "c") is None
    assert queue.dequeue(lock_ms=LOCK_MS) is None
    (archived,) = queue.archived()
    assert (archived.id, archived.outcome, archived.content) == (later, "discarded", b"later")
    # The dashboard's overview does not count it as a failure.
    (overview,) = queue._fetch("dashboard_overview", {"window_ms": 3_600_000}, None)
    assert overview[7] == 0


def test_discarding_the_head_moves_the_channel_to_its_next_message(
    queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    now = queue.now()
    head = queue.create(b"head", channel="c", dequeue_at=now - 1000).id
    queue.create(b"next", channel="c", dequeue_at=now + HOUR_MS)
    assert _discard(queue, head) == "c"
    row = _row(admin, queue, "c")
    assert row is not None
    assert row[0] == now + HOUR_MS
    assert queue.dequeue(lock_ms=LOCK_MS) is None  # the next one is not due yet
    assert queue.archived() == []  # the archive is off


def test_discarding_in_a_channel_with_a_policy_counts_it_out(
    queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    queue.channel("p").set_policy(max_size=10)
    now = queue.now()
    first = queue.create(b"1", channel="p", dequeue_at=now + 1000).id
    second = queue.create(b"2", channel="p", dequeue_at=now + 2000).id
    assert _row(admin, queue, "p") == (now + 1000, 2, True)
    _discard(queue, first, "p")
    assert _row(admin, queue, "p") == (now + 2000, 1, True)
    _discard(queue, second, "p")
    # A channel with a policy keeps its row, empty.
    assert _row(admin, queue, "p") == (None, 0, True)
    stats = queue.channel("p").stats()
    assert stats is not None
    assert stats.size == 0


def test_expediting_makes_a_scheduled_message_due_now(
    queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    now = queue.now()
    queue.create(b"other", channel="c", dequeue_at=now + 2 * HOUR_MS)
    later = queue.create(b"later", channel="c", dequeue_at=now + HOUR_MS).id
    assert queue.dequeue(lock_ms=LOCK_MS) is None
    assert _expedite(queue, later, "c") == ("c", True)
    row = _row(admin, queue, "c")
    assert row is not None
    assert row[0] <= queue.now()
    taken = queue.dequeue(lock_ms=LOCK_MS)
    assert taken is not None
    assert taken.id == later
    assert queue.dequeue(lock_ms=LOCK_MS) is None
    # Already due: left as it is.
    due = queue.create(b"due", channel="d").id
    before = _state(admin, queue)
    assert _expedite(queue, due) == ("d", False)
    assert _state(admin, queue) == before


def test_expediting_in_a_channel_with_a_policy_respects_its_interval(
    queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    queue.channel("p").set_policy(release_interval_ms=HOUR_MS)
    now = queue.now()
    queue.create(b"first", channel="p")
    taken = queue.dequeue(lock_ms=LOCK_MS)
    assert taken is not None
    queue.delete(taken)
    later = queue.create(b"later", channel="p", dequeue_at=now + 5 * HOUR_MS).id
    assert _expedite(queue, later) == ("p", True)
    row = _row(admin, queue, "p")
    assert row is not None
    # Due now, but the channel gives its next message an interval after its last one.
    assert now + HOUR_MS - 5_000 <= row[0] <= queue.now() + HOUR_MS
    assert queue.dequeue(lock_ms=LOCK_MS) is None
    queue.channel("p").set_policy(release_interval_ms=None, max_size=5)
    taken = queue.dequeue(lock_ms=LOCK_MS)
    assert taken is not None
    assert taken.id == later


def test_refusals_are_typed_and_change_nothing(
    make_queue: Any, admin: psycopg.Connection[Any]
) -> None:
    queue = make_queue(archive=True)
    queue.create(b"held", channel="c")
    held = queue.dequeue(lock_ms=LOCK_MS)
    assert held is not None
    waiting = queue.create(b"waiting", channel="c", dequeue_at=queue.now() + HOUR_MS).id
    queue.schedule("nightly", cron="0 3 * * *", content=b"job")
    (driver,) = admin.execute(
        sql.SQL("SELECT id FROM {}.message WHERE channel = 'lonnymq.schedules'").format(
            sql.Identifier(queue.schema)
        )
    ).fetchall()
    before = _state(admin, queue)
    for action in (_discard, _expedite):
        with pytest.raises(MessageLockedError, match=f"message {held.id} is locked"):
            action(queue, held.id)
        with pytest.raises(MessageNotFoundError, match="does not exist"):
            action(queue, waiting + 1000)
        with pytest.raises(MessageNotFoundError, match="is not in channel 'other'"):
            action(queue, waiting, "other")
        with pytest.raises(InvalidChannelError, match="drives a schedule"):
            action(queue, driver[0])
        with pytest.raises(InvalidArgumentError, match="must not be NULL"):
            action(queue, None)
        with pytest.raises(InvalidChannelError):
            action(queue, waiting, "")
        assert _state(admin, queue) == before
