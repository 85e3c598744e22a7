"""Two creators of the same dedup key at once, on the two create paths.

A single ``create`` in a channel without a policy takes no channel-row lock up front (the
dedup index decides between concurrent creators); a batch with dedup keys, and a Spark
write's commit, lock the rows of their channels first. Whatever the interleaving, one of the
two creates the message and the other reports it deduplicated: never a unique violation,
never a deadlock.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import psycopg
import pytest

from lonnymq import DatabaseError, NewMessage, Queue, TransactionConflictError

sys.path.insert(0, str(Path(__file__).parent))
from lock_helpers import in_thread, wait_until_blocked

HOUR_MS = 3_600_000


def _joined(thread: threading.Thread, out: list[Any]) -> Any:
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert len(out) == 1
    if isinstance(out[0], Exception):
        raise out[0]
    return out[0]


def test_a_batch_behind_an_uncommitted_single_create_reports_deduplicated(
    dsn: str, queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    """The single create has inserted the key and not committed; the batch's insert waits
    for it, then must report the message deduplicated (not fail on the unique index)."""
    queue.create(b"keeps the channel due", channel="c")
    with psycopg.connect(dsn) as single:
        first = queue.create(b"single", channel="c", dedup_key="k", conn=single)
        assert first.status == "created"
        with psycopg.connect(dsn) as batch:
            pid = batch.info.backend_pid
            thread, out = in_thread(
                lambda: queue.create_many(
                    [NewMessage(b"batch", channel="c", dedup_key="k")], conn=batch
                )[0]
            )
            wait_until_blocked(admin, pid)
            single.commit()
            second = _joined(thread, out)
            batch.commit()
    assert second.status == "deduplicated"
    assert second.id == first.id
    assert queue.verify() == []


def test_a_key_repeated_in_the_batch_follows_its_first_item_when_that_one_lost(
    dsn: str, queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    """The batch names k1 twice; a single create holds k1 uncommitted. Once it commits, both
    of the batch's k1 items are deduplicated on its message, and k2 is created."""
    queue.create(b"keeps the channel due", channel="c")
    with psycopg.connect(dsn) as single:
        first = queue.create(b"single", channel="c", dedup_key="k1", conn=single)
        with psycopg.connect(dsn) as batch:
            items = [NewMessage(b"b", channel="c", dedup_key=k) for k in ("k2", "k1", "k1")]
            thread, out = in_thread(lambda: queue.create_many(items, conn=batch))
            wait_until_blocked(admin, batch.info.backend_pid)
            single.commit()
            results = _joined(thread, out)
            batch.commit()
    assert [r.status for r in results] == ["created", "deduplicated", "deduplicated"]
    assert [r.id for r in results[1:]] == [first.id, first.id]
    assert queue.verify() == []


def test_a_single_create_behind_a_batch_holding_the_channel_does_not_deadlock(
    dsn: str, queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    """The batch's transaction holds the channel's row; a single create that makes the
    channel due sooner must wait for that row before it claims the key, or the two wait for
    each other once the batch creates the same key."""
    later = queue.now() + HOUR_MS
    queue.create(b"later", channel="c", dequeue_at=later)  # the channel is due in an hour
    with psycopg.connect(dsn) as batch:
        held = queue.create_many(
            [NewMessage(b"holds the row", channel="c", dedup_key="other", dequeue_at=later)],
            conn=batch,
        )
        assert held[0].status == "created"
        with psycopg.connect(dsn) as single:
            pid = single.info.backend_pid
            thread, out = in_thread(
                lambda: queue.create(b"single", channel="c", dedup_key="k", conn=single)
            )
            wait_until_blocked(admin, pid)
            mine = queue.create_many([NewMessage(b"batch", channel="c", dedup_key="k")], conn=batch)
            batch.commit()
            theirs = _joined(thread, out)
            single.commit()
    assert mine[0].status == "created"
    assert theirs.status == "deduplicated"
    assert theirs.id == mine[0].id
    taken = queue.dequeue(lock_ms=60_000)
    assert taken is not None
    assert taken.content == b"batch"
    assert queue.verify() == []


def _race(queue: Queue, channel: str, keys: list[str], single_first: bool) -> list[Any]:
    """A single create of each key and a batch of all of them, started together; every
    result (or exception) of both."""
    barrier = threading.Barrier(2)
    results: list[Any] = []

    def singles() -> None:
        barrier.wait()
        for key in keys:
            try:
                results.append(queue.create(b"s", channel=channel, dedup_key=key))
            except Exception as exc:
                results.append(exc)

    def batch() -> None:
        barrier.wait()
        order = keys if single_first else list(reversed(keys))
        try:
            results.extend(
                queue.create_many([NewMessage(b"b", channel=channel, dedup_key=k) for k in order])
            )
        except Exception as exc:
            results.append(exc)

    threads = [threading.Thread(target=singles), threading.Thread(target=batch)]
    for thread in threads if single_first else reversed(threads):
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
        assert not thread.is_alive()
    return results


@pytest.mark.parametrize("single_first", [True, False])
def test_racing_creators_of_one_key_make_one_message(queue: Queue, single_first: bool) -> None:
    """Rounds of a single create and a batch of the same keys started together, in both start
    orders, over fresh and existing channels: each key ends with exactly one message and
    every result names it."""
    for round_no in range(8):
        keys = [f"{round_no}-k{i}" for i in range(40)]
        results = _race(queue, f"ch{round_no % 3}", keys, single_first)
        assert [r for r in results if isinstance(r, Exception)] == []
        assert len({r.id for r in results}) == len(keys)
        assert len([r for r in results if r.status == "created"]) == len(keys)
    assert queue.verify() == []


def test_a_deadlock_left_to_postgresql_is_a_typed_retryable_error(
    dsn: str, queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    """The case docs/guide/transactions.md names: a transaction holding a key (from a keyed
    create) then writes the channel's row, while a batch of that key holds the row and waits for
    the key. PostgreSQL rolls one of the two back; that one gets TransactionConflictError
    (40P01)."""
    later = queue.now() + HOUR_MS
    queue.create(b"later", channel="c", dequeue_at=later)  # the channel is due in an hour
    outcomes: list[Any] = []
    with psycopg.connect(dsn) as holder, psycopg.connect(dsn) as batch:
        queue.create(b"keyed", channel="c", dedup_key="k", dequeue_at=later + HOUR_MS, conn=holder)
        thread, out = in_thread(
            lambda: queue.create_many([NewMessage(b"b", channel="c", dedup_key="k")], conn=batch)
        )
        wait_until_blocked(admin, batch.info.backend_pid)
        try:
            outcomes.append(queue.create(b"now", channel="c", conn=holder))
        except TransactionConflictError as err:
            outcomes.append(err)
        thread.join(timeout=30)
        assert not thread.is_alive()
        outcomes.extend(out)
    conflicts = [o for o in outcomes if isinstance(o, TransactionConflictError)]
    assert len(conflicts) == 1, outcomes
    assert conflicts[0].sqlstate == "40P01"
    assert isinstance(conflicts[0], DatabaseError)
