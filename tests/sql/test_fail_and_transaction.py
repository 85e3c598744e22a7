"""Finishing a message as failed, and ``Queue.transaction()``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg import sql

from lonnymq import (
    ChannelFullError,
    CreateStatus,
    InvalidArgumentError,
    Queue,
    StaleMessageError,
)

LOCK_MS = 60_000


def _archive(admin: psycopg.Connection[Any], schema: str) -> list[tuple[Any, ...]]:
    query = sql.SQL("SELECT id, outcome, error FROM {}.archive ORDER BY id")
    return admin.execute(query.format(sql.Identifier(schema))).fetchall()


def test_fail_finishes_the_message_and_archives_the_error(
    make_queue: Callable[..., Queue], admin: psycopg.Connection[Any], schema_name: str
) -> None:
    queue = make_queue(archive=True)
    created = queue.create(b"x", channel="c")
    message = queue.dequeue(lock_ms=LOCK_MS)
    assert message is not None
    message.fail(error="it broke\x00badly")
    assert queue.stats() == []
    assert _archive(admin, schema_name) == [(created.id, "failed", "it broke\ufffdbadly")]


def test_fail_by_a_stale_holder_is_refused(queue: Queue) -> None:
    queue.create(b"x")
    first = queue.dequeue(lock_ms=1_000)
    assert first is not None
    queue.set_clock_offset(2_000)
    second = queue.dequeue(lock_ms=LOCK_MS)
    assert second is not None
    with pytest.raises(StaleMessageError):
        first.fail(error="late")
    assert [s.in_flight for s in queue.stats()] == [1]


def test_fail_needs_a_text_error(queue: Queue) -> None:
    queue.create(b"x")
    message = queue.dequeue(lock_ms=LOCK_MS)
    assert message is not None
    with pytest.raises(InvalidArgumentError, match="error must be a str"):
        message.fail(error=42)  # type: ignore[arg-type]
    message.delete()


def test_transaction_commits_together_or_not_at_all(queue: Queue) -> None:
    with queue.transaction() as conn:
        queue.create(b"a", channel="t", conn=conn)
        queue.create(b"b", channel="t", conn=conn)
    assert [s.size for s in queue.stats()] == [2]

    class Boom(Exception):
        pass

    def create_then_fail() -> None:
        with queue.transaction() as conn:
            queue.create(b"c", channel="t", conn=conn)
            raise Boom

    with pytest.raises(Boom):
        create_then_fail()
    assert [s.size for s in queue.stats()] == [2]


def test_dead_letter_moves_the_content_and_fails_the_original(
    make_queue: Callable[..., Queue], admin: psycopg.Connection[Any], schema_name: str
) -> None:
    queue = make_queue(archive=True)
    created = queue.create(b"poison", channel="work")
    message = queue.dequeue(lock_ms=LOCK_MS)
    assert message is not None
    message.defer(state=b"step 2")
    message = queue.dequeue(lock_ms=LOCK_MS)
    assert message is not None
    assert message.state == b"step 2"
    moved = queue.dead_letter(message, channel="dead", error="gave up")
    assert moved.status is CreateStatus.CREATED
    assert _archive(admin, schema_name) == [(created.id, "failed", "gave up")]
    copy = queue.dequeue(lock_ms=LOCK_MS)
    assert copy is not None
    # The copy carries the content, not the saved state.
    assert (copy.id, copy.channel, copy.content, copy.state) == (moved.id, "dead", b"poison", None)


def test_dead_letter_into_a_full_channel_raises_and_keeps_the_message_held(
    make_queue: Callable[..., Queue], admin: psycopg.Connection[Any], schema_name: str
) -> None:
    queue = make_queue(archive=True)
    queue.channel("dead").set_policy(max_size=1)
    queue.create(b"earlier", channel="dead", dequeue_at=queue.now() + 3_600_000)
    created = queue.create(b"poison", channel="work")
    message = queue.dequeue(lock_ms=LOCK_MS)
    assert message is not None
    assert message.id == created.id
    with pytest.raises(ChannelFullError, match=r"'dead' is at its max_size.*still held"):
        queue.dead_letter(message, channel="dead", error="gave up")
    # Nothing changed: the message is still held by this attempt, the dead channel as it was.
    assert _archive(admin, schema_name) == []
    by_channel = {s.channel: (s.size, s.in_flight) for s in queue.stats()}
    assert by_channel == {"dead": (1, 0), "work": (1, 1)}
    queue.channel("dead").set_policy(max_size=2)
    assert queue.dead_letter(message, channel="dead", error="gave up").status is (
        CreateStatus.CREATED
    )
    assert _archive(admin, schema_name) == [(created.id, "failed", "gave up")]
