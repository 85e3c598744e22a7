"""Deduplication keys and the batch operations (create_many, dequeue_many, delete/defer_many)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg import sql

from lonnymq import AckStatus, CreateResult, CreateStatus, Message, NewMessage, Queue

LOCK_MS = 60_000


def contents_by_id(
    admin: psycopg.Connection[Any], schema: str, ids: list[int | None]
) -> dict[int, bytes]:
    query = sql.SQL("SELECT id, content FROM {}.message WHERE id = ANY(%s)").format(
        sql.Identifier(schema)
    )
    return {row[0]: bytes(row[1]) for row in admin.execute(query, [ids])}


def make_stale(queue: Queue, channel: str) -> tuple[Message, Message]:
    """Create a message in ``channel`` and return (stale holder, fresh holder)."""
    queue.create(b"stale", channel=channel)
    stale = queue.dequeue(lock_ms=1_000)
    assert stale is not None
    assert stale.channel == channel
    queue.set_clock_offset(2_000)
    fresh = queue.dequeue(lock_ms=LOCK_MS)
    assert fresh is not None
    assert (fresh.id, fresh.num_attempts) == (stale.id, 2)
    return stale, fresh


def sized(queue: Queue, policy: bool, *channels: str) -> None:
    """Give ``channels`` a policy (exact counters, sizes reported) when ``policy``; without
    one a channel keeps no counter and creates report ``channel_size`` None."""
    if policy:
        for channel in channels:
            queue.channel(channel).set_policy(max_size=1_000)


# -- dedup_key ---------------------------------------------------------------------------


@pytest.mark.parametrize("policy", [True, False], ids=["policy", "no_policy"])
def test_same_dedup_key_in_same_channel_is_deduplicated(queue: Queue, policy: bool) -> None:
    sized(queue, policy, "a")
    first = queue.create(b"one", channel="a", dedup_key="k")
    second = queue.create(b"two", channel="a", dedup_key="k")
    size = 1 if policy else None
    assert first == CreateResult(CreateStatus.CREATED, first.id, size)
    assert second == CreateResult(CreateStatus.DEDUPLICATED, first.id, size)
    assert [(s.channel, s.size) for s in queue.stats()] == [("a", 1)]
    messages = queue.dequeue_many(10, lock_ms=LOCK_MS)
    assert [(m.id, m.content) for m in messages] == [(first.id, b"one")]


def test_same_dedup_key_in_another_channel_creates(queue: Queue) -> None:
    first = queue.create(b"one", channel="a", dedup_key="k")
    other = queue.create(b"two", channel="b", dedup_key="k")
    assert other.status is CreateStatus.CREATED
    assert other.id != first.id
    assert sorted(m.content for m in queue.dequeue_many(10, lock_ms=LOCK_MS)) == [b"one", b"two"]


def test_messages_without_dedup_key_are_never_deduplicated(queue: Queue) -> None:
    results = [queue.create(b"same", channel="a") for _ in range(3)]
    assert [r.status for r in results] == [CreateStatus.CREATED] * 3
    assert len({r.id for r in results}) == 3


def test_in_flight_message_still_deduplicates(queue: Queue) -> None:
    first = queue.create(b"one", channel="a", dedup_key="k")
    held = queue.dequeue(lock_ms=LOCK_MS)
    assert held is not None
    again = queue.create(b"two", channel="a", dedup_key="k")
    assert (again.status, again.id) == (CreateStatus.DEDUPLICATED, first.id)


def test_dedup_key_is_free_again_after_delete(queue: Queue) -> None:
    first = queue.create(b"one", channel="a", dedup_key="k")
    held = queue.dequeue(lock_ms=LOCK_MS)
    assert held is not None
    held.delete()
    reused = queue.create(b"two", channel="a", dedup_key="k")
    assert reused.status is CreateStatus.CREATED
    assert reused.id is not None
    assert first.id is not None
    assert reused.id > first.id
    message = queue.dequeue(lock_ms=LOCK_MS)
    assert message is not None
    assert (message.id, message.content) == (reused.id, b"two")


@pytest.mark.parametrize("policy", [True, False], ids=["policy", "no_policy"])
def test_create_many_deduplicates_inside_one_batch(
    queue: Queue, admin: psycopg.Connection[Any], schema_name: str, policy: bool
) -> None:
    sized(queue, policy, "a", "b")
    results = queue.create_many(
        [
            NewMessage(b"k1-first", channel="a", dedup_key="k1"),
            NewMessage(b"k1-second", channel="a", dedup_key="k1"),
            NewMessage(b"k2", channel="a", dedup_key="k2"),
            NewMessage(b"k1-other-channel", channel="b", dedup_key="k1"),
            NewMessage(b"k1-third", channel="a", dedup_key="k1"),
        ]
    )
    assert [r.status for r in results] == [
        CreateStatus.CREATED,
        CreateStatus.DEDUPLICATED,
        CreateStatus.CREATED,
        CreateStatus.CREATED,
        CreateStatus.DEDUPLICATED,
    ]
    assert results[1].id == results[0].id
    assert results[4].id == results[0].id
    assert [r.channel_size for r in results] == ([1, 1, 2, 1, 2] if policy else [None] * 5)
    assert {s.channel: s.size for s in queue.stats()} == {"a": 2, "b": 1}
    stored = contents_by_id(admin, schema_name, [r.id for r in results])
    assert sorted(stored.values()) == [b"k1-first", b"k1-other-channel", b"k2"]


@pytest.mark.parametrize("policy", [True, False], ids=["policy", "no_policy"])
def test_create_many_deduplicates_against_live_messages(queue: Queue, policy: bool) -> None:
    sized(queue, policy, "a")
    live = queue.create(b"live", channel="a", dedup_key="k")
    results = queue.create_many(
        [NewMessage(b"dup", channel="a", dedup_key="k"), NewMessage(b"new", channel="a")]
    )
    assert [(r.status, r.channel_size) for r in results] == [
        (CreateStatus.DEDUPLICATED, 1 if policy else None),
        (CreateStatus.CREATED, 2 if policy else None),
    ]
    assert results[0].id == live.id
    assert [(s.channel, s.size) for s in queue.stats()] == [("a", 2)]


# -- create_many -------------------------------------------------------------------------


def test_create_many_returns_results_in_input_order(
    queue: Queue, admin: psycopg.Connection[Any], schema_name: str
) -> None:
    items = [
        NewMessage(b"c0", channel="c"),
        NewMessage(b"a0", channel="a"),
        NewMessage(b"b0", channel="b"),
        NewMessage(b"a1", channel="a"),
        NewMessage(b"c1", channel="c"),
        NewMessage(b"d0"),  # default channel
    ]
    # "a" and "c" have a policy and report their sizes; "b" and the default channel do not.
    sized(queue, True, "a", "c")
    results = queue.create_many(items)
    assert [r.status for r in results] == [CreateStatus.CREATED] * len(items)
    assert [r.channel_size for r in results] == [1, 1, None, 2, 2, None]
    stored = contents_by_id(admin, schema_name, [r.id for r in results])
    assert [stored[r.id] for r in results if r.id is not None] == [i.content for i in items]
    # Ids are numbered in input order, whatever the channels.
    ids = [r.id for r in results if r.id is not None]
    assert ids == sorted(ids)
    assert len(set(ids)) == len(items)
    assert {s.channel: s.size for s in queue.stats()} == {"a": 2, "b": 1, "c": 2, "default": 1}


def test_create_many_with_scheduling_and_max_size(queue: Queue) -> None:
    queue.channel("small").set_policy(max_size=1)
    now = queue.now()
    results = queue.create_many(
        [
            NewMessage(b"s0", channel="small"),
            NewMessage(b"s1", channel="small"),
            NewMessage(b"late", channel="big", dequeue_at=now + 10_000),
            NewMessage(b"early", channel="big", dequeue_at=0),
        ]
    )
    assert [(r.status, r.channel_size) for r in results] == [
        (CreateStatus.CREATED, 1),
        (CreateStatus.DROPPED, 1),
        (CreateStatus.CREATED, None),  # "big" has no policy: no counter
        (CreateStatus.CREATED, None),
    ]
    assert results[1].id is None
    assert {s.channel: s.size for s in queue.stats()} == {"big": 2, "small": 1}
    assert sorted(m.content for m in queue.dequeue_many(10, lock_ms=LOCK_MS)) == [b"early", b"s0"]


def test_empty_batches_return_empty_lists(queue: Queue) -> None:
    assert queue.create_many([]) == []
    assert queue.delete_many([]) == []
    assert queue.defer_many([]) == []
    assert queue.stats() == []


# -- dequeue_many ------------------------------------------------------------------------


def test_dequeue_many_honours_each_channel_policy(queue: Queue) -> None:
    queue.channel("limited").set_policy(max_concurrency=2)
    queue.channel("slow").set_policy(release_interval_ms=10_000)
    for i in range(5):
        queue.create(f"l{i}".encode(), channel="limited")
        queue.create(f"s{i}".encode(), channel="slow")
    queue.create(b"f0", channel="free")
    queue.create(b"f1", channel="free")

    batch = queue.dequeue_many(100, lock_ms=LOCK_MS)
    by_channel: dict[str, list[bytes]] = {}
    for message in batch:
        by_channel.setdefault(message.channel, []).append(message.content)
    assert by_channel == {"limited": [b"l0", b"l1"], "slow": [b"s0"], "free": [b"f0", b"f1"]}
    assert queue.dequeue_many(100, lock_ms=LOCK_MS) == []

    queue.set_clock_offset(10_000)
    assert [m.content for m in queue.dequeue_many(100, lock_ms=LOCK_MS)] == [b"s1"]


def test_dequeue_many_respects_the_limit(queue: Queue) -> None:
    for i in range(5):
        queue.create(f"m{i}".encode(), channel="a")
    assert [m.content for m in queue.dequeue_many(3, lock_ms=LOCK_MS)] == [b"m0", b"m1", b"m2"]
    assert [m.content for m in queue.dequeue_many(3, lock_ms=LOCK_MS)] == [b"m3", b"m4"]


def test_dequeue_many_gives_each_message_once(queue: Queue) -> None:
    for channel in "abcd":
        for i in range(5):
            queue.create(f"{channel}{i}".encode(), channel=channel)
    batch = queue.dequeue_many(100, lock_ms=LOCK_MS)
    assert len(batch) == 20
    assert len({m.id for m in batch}) == 20
    assert all(m.num_attempts == 1 for m in batch)


# -- delete_many / defer_many ------------------------------------------------------------


def test_delete_many_reports_each_message(queue: Queue) -> None:
    stale, fresh = make_stale(queue, "s")
    queue.create(b"ok", channel="a")
    queue.create(b"gone", channel="b")
    held = queue.dequeue_many(10, lock_ms=LOCK_MS)
    ok = next(m for m in held if m.content == b"ok")
    gone = next(m for m in held if m.content == b"gone")
    gone.delete()

    assert queue.delete_many([ok, stale, gone]) == [
        AckStatus.OK,
        AckStatus.STALE,
        AckStatus.NOT_FOUND,
    ]
    # ok is finished, the stale one still belongs to its fresh holder
    assert [(s.channel, s.size, s.in_flight) for s in queue.stats()] == [("s", 1, 1)]
    fresh.delete()
    assert queue.stats() == []


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


def test_defer_many_reports_each_message(queue: Queue) -> None:
    stale, fresh = make_stale(queue, "s")
    queue.create(b"x", channel="a")
    queue.create(b"y", channel="a")
    queue.create(b"gone", channel="b")
    held = queue.dequeue_many(10, lock_ms=LOCK_MS)
    assert sorted(m.content for m in held) == [b"gone", b"x", b"y"]
    gone = next(m for m in held if m.content == b"gone")
    gone.delete()
    xs = [m for m in held if m.channel == "a"]

    later = queue.now() + 5_000
    statuses = queue.defer_many([xs[0], stale, gone, xs[1]], dequeue_at=later)
    assert statuses == [AckStatus.OK, AckStatus.STALE, AckStatus.NOT_FOUND, AckStatus.OK]

    stats = {s.channel: s for s in queue.stats()}
    assert (stats["a"].size, stats["a"].in_flight, stats["a"].next_dequeue_at) == (2, 0, later)
    assert (stats["s"].size, stats["s"].in_flight) == (1, 1)
    assert queue.dequeue(lock_ms=LOCK_MS) is None
    fresh.heartbeat(lock_ms=LOCK_MS)  # still held by the fresh holder

    queue.set_clock_offset(7_000)
    again = queue.dequeue_many(10, lock_ms=LOCK_MS)
    assert sorted((m.content, m.num_attempts) for m in again) == [(b"x", 2), (b"y", 2)]


def test_defer_many_takes_no_transaction_id_per_message(queue: Queue, dsn: str) -> None:
    # A subtransaction per message (one transaction id each) overflows the backend's cache of
    # 64 and slows every other session's snapshots while the batch runs.
    stale, _fresh = make_stale(queue, "s")
    queue.channel("p").set_policy(max_concurrency=500)
    queue.create_many([NewMessage(b"m", channel=f"c{i % 7}") for i in range(200)])
    queue.create_many([NewMessage(b"p", channel="p") for _ in range(100)])
    held = queue.dequeue_many(1_000, lock_ms=LOCK_MS)
    assert len(held) == 300
    with psycopg.connect(dsn, autocommit=True) as conn:
        with conn.transaction():
            first = conn.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()
            statuses = queue.defer_many([*held, stale], conn=conn)
        after = conn.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()
    assert statuses == [AckStatus.OK] * 300 + [AckStatus.STALE]
    assert first is not None
    assert after is not None
    # One id for the batch's transaction (an earlier per-message loop took one more per message).
    assert after[0] - first[0] < 50
    stats = {s.channel: s for s in queue.stats()}
    assert (stats["p"].size, stats["p"].in_flight) == (100, 0)
    assert queue.verify() == []
    assert len(queue.dequeue_many(1_000, lock_ms=LOCK_MS)) == 300


def test_defer_many_with_an_id_named_twice_defers_it_once(queue: Queue) -> None:
    queue.create(b"x", channel="a")
    held = queue.dequeue(lock_ms=LOCK_MS)
    assert held is not None
    assert queue.defer_many([held, held]) == [AckStatus.OK, AckStatus.STALE]
    again = queue.dequeue(lock_ms=LOCK_MS)
    assert again is not None
    assert (again.id, again.num_attempts) == (held.id, 2)


def test_heartbeat_many_tells_a_stale_claim_from_the_holders(
    queue: Queue, admin: psycopg.Connection[Any], schema_name: str
) -> None:
    stale, fresh = make_stale(queue, "s")
    rows = admin.execute(
        sql.SQL("SELECT id, status FROM {}.message_heartbeat_many(%s, %s, %s)").format(
            sql.Identifier(schema_name)
        ),
        [[fresh.id, stale.id], [fresh.num_attempts, stale.num_attempts], LOCK_MS],
    ).fetchall()
    assert rows == [(fresh.id, "ok"), (stale.id, "stale")]


def test_defer_many_without_dequeue_at_is_due_now(queue: Queue) -> None:
    queue.create(b"x", channel="a")
    queue.create(b"y", channel="b")
    held = queue.dequeue_many(10, lock_ms=LOCK_MS)
    assert queue.defer_many(held) == [AckStatus.OK, AckStatus.OK]
    again = queue.dequeue_many(10, lock_ms=LOCK_MS)
    assert sorted(m.content for m in again) == [b"x", b"y"]


def test_delete_many_frees_slots(queue: Queue) -> None:
    queue.channel("a").set_policy(max_concurrency=2)
    for i in range(4):
        queue.create(f"a{i}".encode(), channel="a")
    held = queue.dequeue_many(10, lock_ms=LOCK_MS)
    assert len(held) == 2
    assert queue.delete_many(held) == [AckStatus.OK, AckStatus.OK]
    assert [m.content for m in queue.dequeue_many(10, lock_ms=LOCK_MS)] == [b"a2", b"a3"]
