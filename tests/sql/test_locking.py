"""Locks: expiry and recovery, heartbeat, stale holders, delete and defer."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import psycopg
import pytest
from psycopg import sql

from lonnymq import AckStatus, InvalidArgumentError, MessageNotFoundError, Queue, StaleMessageError

LOCK_MS = 60_000


def message_row(admin: psycopg.Connection[Any], schema: str, message_id: int) -> tuple[Any, ...]:
    """(is_locked, num_attempts, unlock_at, dequeue_at, state) of a message, read directly."""
    query = sql.SQL(
        "SELECT is_locked, num_attempts, unlock_at, dequeue_at, state FROM {}.message WHERE id = %s"
    ).format(sql.Identifier(schema))
    row = admin.execute(query, [message_id]).fetchone()
    assert row is not None
    return tuple(row)


def test_expired_lock_is_recovered_with_one_more_attempt(queue: Queue) -> None:
    queue.create(b"x", channel="a")
    first = queue.dequeue(lock_ms=1_000)
    assert first is not None
    assert first.num_attempts == 1
    assert queue.dequeue(lock_ms=LOCK_MS) is None  # still locked

    queue.set_clock_offset(1_500)
    second = queue.dequeue(lock_ms=LOCK_MS)
    assert second is not None
    assert (second.id, second.content, second.num_attempts) == (first.id, b"x", 2)
    assert second.unlock_at > first.unlock_at
    stats = queue.channel("a").stats()
    assert stats is not None
    assert (stats.size, stats.in_flight) == (1, 1)


def test_recovery_keeps_the_slot_of_a_saturated_channel(queue: Queue) -> None:
    """The recovered message never left its slot: in_flight stays at the limit, no more."""
    queue.channel("a").set_policy(max_concurrency=1)
    queue.create(b"a0", channel="a")
    queue.create(b"a1", channel="a")
    first = queue.dequeue(lock_ms=1_000)
    assert first is not None
    queue.set_clock_offset(2_000)
    batch = queue.dequeue_many(10, lock_ms=LOCK_MS)
    assert [(m.id, m.num_attempts) for m in batch] == [(first.id, 2)]
    stats = queue.channel("a").stats()
    assert stats is not None
    assert (stats.size, stats.in_flight) == (2, 1)
    batch[0].delete()
    following = queue.dequeue(lock_ms=LOCK_MS)
    assert following is not None
    assert following.content == b"a1"


def test_expired_locks_are_recovered_before_new_messages(queue: Queue) -> None:
    queue.create(b"old", channel="a")
    old = queue.dequeue(lock_ms=1_000)
    assert old is not None
    queue.create(b"new", channel="b")
    queue.set_clock_offset(2_000)
    batch = queue.dequeue_many(2, lock_ms=LOCK_MS)
    assert [(m.content, m.num_attempts) for m in batch] == [(b"old", 2), (b"new", 1)]


def test_heartbeat_extends_the_lock(queue: Queue) -> None:
    queue.create(b"x", channel="a")
    message = queue.dequeue(lock_ms=1_000)
    assert message is not None
    unlock_at = message.heartbeat(lock_ms=10_000)
    assert unlock_at >= message.unlock_at + 9_000

    queue.set_clock_offset(5_000)  # past the first lock, before the extended one
    assert queue.dequeue(lock_ms=LOCK_MS) is None
    message.delete()  # still ours
    assert queue.stats() == []


def test_heartbeat_lock_expires_in_turn(queue: Queue) -> None:
    queue.create(b"x", channel="a")
    message = queue.dequeue(lock_ms=1_000)
    assert message is not None
    unlock_at = message.heartbeat(lock_ms=3_000)
    batch = queue.dequeue_batch(1, lock_ms=LOCK_MS)
    assert (batch.messages, batch.retry_at) == ([], unlock_at)
    queue.set_clock_offset(5_000)
    recovered = queue.dequeue(lock_ms=LOCK_MS)
    assert recovered is not None
    assert (recovered.id, recovered.num_attempts) == (message.id, 2)


def test_a_heartbeat_late_in_a_transaction_counts_from_when_it_runs(queue: Queue, dsn: str) -> None:
    # docs/guide/transactions.md suggests heartbeating in your own transaction, last, before
    # commit: the lock must then run lock_ms from that moment, not from when the transaction
    # began.
    for name in ("a", "b"):
        queue.create(b"x", channel=name)
    held = queue.dequeue_many(2, lock_ms=LOCK_MS)
    assert len(held) == 2
    with psycopg.connect(dsn) as conn, conn.transaction():
        conn.execute("SELECT 1")  # the transaction (and its now()) begins here
        time.sleep(1.5)
        before = queue.now()
        one = held[0].heartbeat(lock_ms=2_000, conn=conn)
        assert queue.heartbeat_many(held[1:], lock_ms=2_000, conn=conn) == [AckStatus.OK]
    assert one >= before + 2_000
    unlock = _unlock_at(dsn, queue.schema, held[1].id)
    assert unlock >= before + 2_000


def _unlock_at(dsn: str, schema: str, message_id: int) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        query = sql.SQL("SELECT unlock_at FROM {}.message WHERE id = %s").format(
            sql.Identifier(schema)
        )
        row = conn.execute(query, [message_id]).fetchone()
    assert row is not None
    return int(row[0])


def test_stale_holder_is_refused_and_changes_nothing(
    queue: Queue, admin: psycopg.Connection[Any], schema_name: str
) -> None:
    queue.create(b"x", channel="a")
    stale = queue.dequeue(lock_ms=1_000)
    assert stale is not None
    queue.set_clock_offset(2_000)
    fresh = queue.dequeue(lock_ms=LOCK_MS)
    assert fresh is not None
    assert fresh.num_attempts == 2
    before = message_row(admin, schema_name, fresh.id)
    stats_before = queue.stats()

    with pytest.raises(StaleMessageError):
        stale.heartbeat(lock_ms=LOCK_MS)
    with pytest.raises(StaleMessageError):
        stale.delete()
    with pytest.raises(StaleMessageError):
        stale.defer(state=b"overwritten")

    assert message_row(admin, schema_name, fresh.id) == before
    assert queue.stats() == stats_before
    assert before[:3] == (True, 2, fresh.unlock_at)
    # The fresh holder still owns it.
    fresh.defer(state=b"mine")
    again = queue.dequeue(lock_ms=LOCK_MS)
    assert again is not None
    assert (again.id, again.num_attempts, again.state) == (fresh.id, 3, b"mine")


def test_delete_of_a_deferred_message_is_stale(queue: Queue) -> None:
    queue.create(b"x", channel="a")
    message = queue.dequeue(lock_ms=LOCK_MS)
    assert message is not None
    message.defer()
    with pytest.raises(StaleMessageError):
        message.delete()
    with pytest.raises(StaleMessageError):
        message.heartbeat(lock_ms=LOCK_MS)
    with pytest.raises(StaleMessageError):
        message.defer()
    stats = queue.channel("a").stats()
    assert stats is not None
    assert (stats.size, stats.in_flight) == (1, 0)


def test_unknown_id_is_not_found(queue: Queue) -> None:
    queue.create(b"x", channel="a")
    message = queue.dequeue(lock_ms=LOCK_MS)
    assert message is not None
    ghost = dataclasses.replace(message, id=message.id + 1_000)
    with pytest.raises(MessageNotFoundError):
        ghost.delete()
    with pytest.raises(MessageNotFoundError):
        ghost.heartbeat(lock_ms=LOCK_MS)
    with pytest.raises(MessageNotFoundError):
        ghost.defer()
    stats = queue.channel("a").stats()
    assert stats is not None
    assert (stats.size, stats.in_flight) == (1, 1)


def test_delete_twice_is_not_found(queue: Queue) -> None:
    queue.create(b"x", channel="a")
    message = queue.dequeue(lock_ms=LOCK_MS)
    assert message is not None
    message.delete()
    with pytest.raises(MessageNotFoundError):
        message.delete()
    assert queue.stats() == []


def test_defer_keeps_the_attempt_count(
    queue: Queue, admin: psycopg.Connection[Any], schema_name: str
) -> None:
    queue.create(b"x", channel="a")
    message = queue.dequeue(lock_ms=LOCK_MS)
    assert message is not None
    message.defer()
    is_locked, num_attempts, unlock_at, _, _ = message_row(admin, schema_name, message.id)
    assert (is_locked, num_attempts, unlock_at) == (False, 1, None)
    again = queue.dequeue(lock_ms=LOCK_MS)
    assert again is not None
    assert (again.id, again.num_attempts) == (message.id, 2)


def test_defer_saves_state(queue: Queue) -> None:
    queue.create(b"x", channel="a")
    first = queue.dequeue(lock_ms=LOCK_MS)
    assert first is not None
    assert first.state is None
    first.defer(state=b"step-1")

    second = queue.dequeue(lock_ms=LOCK_MS)
    assert second is not None
    assert second.state == b"step-1"
    second.defer()  # without state: the saved state stays

    third = queue.dequeue(lock_ms=LOCK_MS)
    assert third is not None
    assert (third.state, third.num_attempts) == (b"step-1", 3)
    third.defer(state=b"step-2")

    fourth = queue.dequeue(lock_ms=LOCK_MS)
    assert fourth is not None
    assert (fourth.content, fourth.state) == (b"x", b"step-2")


def test_defer_with_future_dequeue_at(queue: Queue) -> None:
    queue.create(b"x", channel="a")
    message = queue.dequeue(lock_ms=LOCK_MS)
    assert message is not None
    later = queue.now() + 30_000
    message.defer(dequeue_at=later)
    batch = queue.dequeue_batch(1, lock_ms=LOCK_MS)
    assert (batch.messages, batch.retry_at) == ([], later)
    stats = queue.channel("a").stats()
    assert stats is not None
    assert (stats.size, stats.in_flight, stats.next_dequeue_at) == (1, 0, later)

    queue.set_clock_offset(20_000)
    assert queue.dequeue(lock_ms=LOCK_MS) is None
    queue.set_clock_offset(30_000)
    again = queue.dequeue(lock_ms=LOCK_MS)
    assert again is not None
    assert (again.id, again.dequeue_at) == (message.id, later)


def test_deferred_message_goes_behind_its_channel(queue: Queue) -> None:
    queue.create(b"first", channel="a")
    queue.create(b"second", channel="a")
    message = queue.dequeue(lock_ms=LOCK_MS)
    assert message is not None
    assert message.content == b"first"
    queue.set_clock_offset(1_000)
    message.defer()  # due now, which is later than "second"
    order = [m.content for m in queue.dequeue_many(10, lock_ms=LOCK_MS)]
    assert order == [b"second", b"first"]


def test_delete_frees_the_slot_of_a_single_slot_channel(queue: Queue) -> None:
    queue.channel("a").set_policy(max_concurrency=1)
    queue.create(b"a0", channel="a")
    queue.create(b"a1", channel="a")
    held = queue.dequeue(lock_ms=LOCK_MS)
    assert held is not None
    assert queue.dequeue(lock_ms=LOCK_MS) is None
    held.delete()
    stats = queue.channel("a").stats()
    assert stats is not None
    assert (stats.size, stats.in_flight) == (1, 0)
    following = queue.dequeue(lock_ms=LOCK_MS)
    assert following is not None
    assert following.content == b"a1"


@pytest.mark.parametrize("lock_ms", [0, -1])
def test_non_positive_lock_ms_is_refused(queue: Queue, lock_ms: int) -> None:
    queue.create(b"x", channel="a")
    with pytest.raises(InvalidArgumentError):
        queue.dequeue(lock_ms=lock_ms)
    stats = queue.channel("a").stats()
    assert stats is not None
    assert stats.in_flight == 0
