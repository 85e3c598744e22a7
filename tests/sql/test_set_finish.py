"""delete_many as one set of statements (0015): the same statuses, counters, archive rows and
events as finishing the messages one at a time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from lonnymq import AckStatus, Queue

from .test_dedup_batch import make_stale
from .test_events import HOUR_MS, Listener, equeue, event_channel, listener  # noqa: F401

LOCK_MS = 60_000


def test_an_id_named_twice_is_finished_once(queue: Queue) -> None:
    queue.create(b"x", channel="a")
    held = queue.dequeue_many(10, lock_ms=LOCK_MS)
    assert len(held) == 1
    assert queue.delete_many([held[0], held[0]]) == [AckStatus.OK, AckStatus.NOT_FOUND]
    assert queue.stats() == []


def test_a_stale_and_a_current_claim_on_one_message(queue: Queue) -> None:
    stale, fresh = make_stale(queue, "s")
    # As one at a time: the stale claim is refused, the current one finishes the message.
    assert queue.delete_many([stale, fresh]) == [AckStatus.STALE, AckStatus.OK]
    assert queue.stats() == []


def test_counters_drop_by_each_channels_finished_count(queue: Queue) -> None:
    for name in ("a", "b", "c"):
        queue.channel(name).set_policy(max_concurrency=5, max_size=100)
    stale, fresh = make_stale(queue, "b")
    for name in ("a", "b", "c"):
        for i in range(4):
            queue.create(f"{name}{i}".encode(), channel=name)
    held = [m for m in queue.dequeue_many(20, lock_ms=LOCK_MS) if m.id != fresh.id]
    by_channel = {name: [m for m in held if m.channel == name] for name in ("a", "b", "c")}
    assert [len(v) for v in by_channel.values()] == [4, 4, 4]
    finished = by_channel["a"][:3] + by_channel["c"] + [stale] + by_channel["b"][:1]
    statuses = queue.delete_many(finished)
    assert statuses == [AckStatus.OK] * 7 + [AckStatus.STALE, AckStatus.OK]
    stats = {s.channel: (s.size, s.in_flight) for s in queue.stats()}
    # a: 4 - 3; b: 5 (4 + the stale one) - 1, the fresh holder still in flight; c: emptied.
    assert stats == {"a": (1, 1), "b": (4, 4), "c": (0, 0)}


def test_a_batch_that_frees_a_saturated_channel_publishes_ready_once(
    equeue: Queue,  # noqa: F811
    listener: Listener,  # noqa: F811
) -> None:
    equeue.channel("a").set_policy(max_concurrency=2)
    equeue.channel("b").set_policy(max_concurrency=5)
    for i in range(3):
        equeue.create(f"a{i}".encode(), channel="a")
        equeue.create(f"b{i}".encode(), channel="b")
    held = equeue.dequeue_many(10, lock_ms=HOUR_MS)
    assert sorted(m.channel for m in held) == ["a", "a", "b", "b", "b"]
    listener.payloads()
    assert equeue.delete_many(held) == [AckStatus.OK] * 5
    payloads = listener.payloads()
    assert [(p["type"], p["channel"], p["id"]) for p in payloads] == [("ready", "a", None)]
    assert [m.content for m in equeue.dequeue_many(10, lock_ms=HOUR_MS)] == [b"a2"]


def test_a_batch_is_archived_with_its_outcome(
    make_queue: Callable[..., Queue], admin: psycopg.Connection[Any], schema_name: str
) -> None:
    queue = make_queue(archive=True)
    for i in range(5):
        queue.create(f"m{i}".encode(), channel=f"c{i % 2}")
    held = queue.dequeue_many(10, lock_ms=LOCK_MS)
    before = queue.now()
    assert queue.delete_many(held) == [AckStatus.OK] * 5
    rows = admin.execute(
        sql.SQL(
            "SELECT id, channel, content, outcome, num_attempts, finished_at >= %s "
            "FROM {}.archive ORDER BY id"
        ).format(sql.Identifier(schema_name)),
        [before],
    ).fetchall()
    assert [(r[0], r[1], bytes(r[2]), r[3], r[4], r[5]) for r in rows] == sorted(
        (m.id, m.channel, m.content, "completed", 1, True) for m in held
    )
