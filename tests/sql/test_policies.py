"""Channel policies: max_concurrency, release_interval_ms, max_size, and stats()."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg import sql

from lonnymq import AckStatus, ChannelStats, CreateStatus, Policy, Queue
from lonnymq.errors import InvalidPolicyError

LOCK_MS = 60_000


def stats_of(queue: Queue, channel: str) -> ChannelStats | None:
    return next((s for s in queue.stats() if s.channel == channel), None)


def channels_of(queue: Queue, limit: int = 100) -> list[str]:
    return [m.channel for m in queue.dequeue_many(limit, lock_ms=LOCK_MS)]


# -- max_concurrency ---------------------------------------------------------------------


def test_channel_at_max_concurrency_gives_nothing_more(queue: Queue) -> None:
    queue.channel("a").set_policy(max_concurrency=2)
    for i in range(4):
        queue.create(f"a{i}".encode(), channel="a")
    first = queue.dequeue(lock_ms=LOCK_MS)
    second = queue.dequeue(lock_ms=LOCK_MS)
    assert first is not None
    assert second is not None
    assert queue.dequeue(lock_ms=LOCK_MS) is None
    assert queue.dequeue_many(10, lock_ms=LOCK_MS) == []
    stats = stats_of(queue, "a")
    assert stats is not None
    assert (stats.size, stats.in_flight) == (4, 2)


def test_delete_frees_a_concurrency_slot(queue: Queue) -> None:
    queue.channel("a").set_policy(max_concurrency=1)
    for i in range(3):
        queue.create(f"a{i}".encode(), channel="a")
    held = queue.dequeue(lock_ms=LOCK_MS)
    assert held is not None
    assert queue.dequeue(lock_ms=LOCK_MS) is None
    held.delete()
    following = queue.dequeue(lock_ms=LOCK_MS)
    assert following is not None
    assert following.content == b"a1"
    assert queue.dequeue(lock_ms=LOCK_MS) is None


def test_defer_frees_a_concurrency_slot(queue: Queue) -> None:
    queue.channel("a").set_policy(max_concurrency=1)
    now = queue.now()
    queue.create(b"a0", channel="a")
    queue.create(b"a1", channel="a")
    held = queue.dequeue(lock_ms=LOCK_MS)
    assert held is not None
    assert queue.dequeue(lock_ms=LOCK_MS) is None
    held.defer(dequeue_at=now + 100_000)
    following = queue.dequeue(lock_ms=LOCK_MS)
    assert following is not None
    assert following.content == b"a1"


def test_other_channels_are_served_while_one_is_saturated(queue: Queue) -> None:
    queue.channel("a").set_policy(max_concurrency=1)
    for i in range(3):
        queue.create(f"a{i}".encode(), channel="a")
        queue.create(f"b{i}".encode(), channel="b")
    assert sorted(channels_of(queue)) == ["a", "b", "b", "b"]


def test_max_concurrency_zero_pauses_the_channel(queue: Queue) -> None:
    queue.channel("a").set_policy(max_concurrency=0)
    queue.create(b"a0", channel="a")
    queue.create(b"b0", channel="b")
    assert channels_of(queue) == ["b"]
    assert queue.dequeue(lock_ms=LOCK_MS) is None
    queue.channel("a").set_policy(max_concurrency=None)
    message = queue.dequeue(lock_ms=LOCK_MS)
    assert message is not None
    assert message.content == b"a0"


def test_lowering_max_concurrency_applies_to_in_flight_messages(queue: Queue) -> None:
    for i in range(6):
        queue.create(f"a{i}".encode(), channel="a")
    held = queue.dequeue_many(3, lock_ms=LOCK_MS)
    assert len(held) == 3
    queue.channel("a").set_policy(max_concurrency=2)
    assert queue.dequeue(lock_ms=LOCK_MS) is None
    held[0].delete()
    assert queue.dequeue(lock_ms=LOCK_MS) is None  # 2 in flight, limit 2
    held[1].delete()
    refill = queue.dequeue(lock_ms=LOCK_MS)
    assert refill is not None
    assert refill.content == b"a3"
    assert queue.dequeue(lock_ms=LOCK_MS) is None


def test_raising_max_concurrency_applies_at_once(queue: Queue) -> None:
    queue.channel("a").set_policy(max_concurrency=1)
    for i in range(4):
        queue.create(f"a{i}".encode(), channel="a")
    assert len(queue.dequeue_many(10, lock_ms=LOCK_MS)) == 1
    queue.channel("a").set_policy(max_concurrency=3)
    assert [m.content for m in queue.dequeue_many(10, lock_ms=LOCK_MS)] == [b"a1", b"a2"]


# -- release_interval_ms -----------------------------------------------------------------


def test_release_interval_spaces_out_dequeues(queue: Queue) -> None:
    queue.channel("a").set_policy(release_interval_ms=10_000)
    queue.create(b"a0", channel="a")
    queue.create(b"a1", channel="a")
    first = queue.dequeue(lock_ms=LOCK_MS)
    assert first is not None
    dequeued_at = first.unlock_at - LOCK_MS

    batch = queue.dequeue_batch(5, lock_ms=LOCK_MS)
    assert batch.messages == []
    assert batch.retry_at == dequeued_at + 10_000
    stats = stats_of(queue, "a")
    assert stats is not None
    assert stats.next_dequeue_at == dequeued_at + 10_000

    queue.set_clock_offset(5_000)
    assert queue.dequeue(lock_ms=LOCK_MS) is None
    queue.set_clock_offset(10_000)
    second = queue.dequeue(lock_ms=LOCK_MS)
    assert second is not None
    assert second.content == b"a1"
    assert second.unlock_at - LOCK_MS >= dequeued_at + 10_000


def test_release_interval_does_not_slow_other_channels(queue: Queue) -> None:
    queue.channel("a").set_policy(release_interval_ms=10_000)
    for i in range(3):
        queue.create(f"a{i}".encode(), channel="a")
        queue.create(f"b{i}".encode(), channel="b")
    assert sorted(channels_of(queue)) == ["a", "b", "b", "b"]


def test_defer_into_rate_limited_channel_respects_the_interval(queue: Queue) -> None:
    queue.channel("a").set_policy(release_interval_ms=10_000)
    queue.create(b"a0", channel="a")
    message = queue.dequeue(lock_ms=LOCK_MS)
    assert message is not None
    dequeued_at = message.unlock_at - LOCK_MS
    message.defer()  # due now, but the channel released a message just now
    batch = queue.dequeue_batch(1, lock_ms=LOCK_MS)
    assert batch.messages == []
    assert batch.retry_at == dequeued_at + 10_000
    queue.set_clock_offset(10_000)
    again = queue.dequeue(lock_ms=LOCK_MS)
    assert again is not None
    assert again.id == message.id


def test_create_into_rate_limited_channel_respects_the_interval(queue: Queue) -> None:
    queue.channel("a").set_policy(release_interval_ms=10_000)
    queue.create(b"a0", channel="a")
    message = queue.dequeue(lock_ms=LOCK_MS)
    assert message is not None
    dequeued_at = message.unlock_at - LOCK_MS
    message.delete()
    queue.create(b"a1", channel="a")
    stats = stats_of(queue, "a")
    assert stats is not None
    assert stats.next_dequeue_at == dequeued_at + 10_000
    assert queue.dequeue(lock_ms=LOCK_MS) is None
    queue.set_clock_offset(10_000)
    again = queue.dequeue(lock_ms=LOCK_MS)
    assert again is not None
    assert again.content == b"a1"


def test_setting_a_release_interval_applies_to_the_live_channel(queue: Queue) -> None:
    for i in range(3):
        queue.create(f"a{i}".encode(), channel="a")
    first = queue.dequeue(lock_ms=LOCK_MS)
    assert first is not None
    queue.channel("a").set_policy(release_interval_ms=10_000)
    assert queue.dequeue(lock_ms=LOCK_MS) is None
    queue.channel("a").clear_policy()
    second = queue.dequeue(lock_ms=LOCK_MS)
    assert second is not None
    assert second.content == b"a1"


# -- max_size ----------------------------------------------------------------------------


def test_create_beyond_max_size_is_dropped(queue: Queue) -> None:
    queue.channel("a").set_policy(max_size=2)
    first = queue.create(b"a0", channel="a")
    second = queue.create(b"a1", channel="a")
    third = queue.create(b"a2", channel="a")
    assert (first.status, first.channel_size) == (CreateStatus.CREATED, 1)
    assert (second.status, second.channel_size) == (CreateStatus.CREATED, 2)
    assert (third.status, third.id, third.channel_size) == (CreateStatus.DROPPED, None, 2)
    stats = stats_of(queue, "a")
    assert stats is not None
    assert stats.size == 2
    assert [m.content for m in queue.dequeue_many(10, lock_ms=LOCK_MS)] == [b"a0", b"a1"]


def test_max_size_counts_in_flight_messages_and_frees_on_delete(queue: Queue) -> None:
    queue.channel("a").set_policy(max_size=1)
    queue.create(b"a0", channel="a")
    held = queue.dequeue(lock_ms=LOCK_MS)
    assert held is not None
    assert queue.create(b"a1", channel="a").status is CreateStatus.DROPPED
    held.delete()
    again = queue.create(b"a2", channel="a")
    assert (again.status, again.channel_size) == (CreateStatus.CREATED, 1)


def test_max_size_zero_drops_everything_and_keeps_the_policy(queue: Queue) -> None:
    queue.channel("a").set_policy(max_size=0)
    result = queue.create(b"a0", channel="a")
    assert (result.status, result.id, result.channel_size) == (CreateStatus.DROPPED, None, 0)
    assert queue.stats() == [
        ChannelStats("a", size=0, in_flight=0, next_dequeue_at=None, policy=Policy(max_size=0))
    ]


def test_lowering_max_size_keeps_messages_already_there(queue: Queue) -> None:
    for i in range(3):
        queue.create(f"a{i}".encode(), channel="a")
    queue.channel("a").set_policy(max_size=1)
    dropped = queue.create(b"a3", channel="a")
    assert (dropped.status, dropped.channel_size) == (CreateStatus.DROPPED, 3)
    assert len(queue.dequeue_many(10, lock_ms=LOCK_MS)) == 3


def test_policy_free_channel_has_no_size_limit(queue: Queue) -> None:
    results = [queue.create(b"x", channel="free") for _ in range(3)]
    assert [r.status for r in results] == [CreateStatus.CREATED] * 3
    # No policy, no counter: the size is not reported, stats() counts the messages.
    assert [r.channel_size for r in results] == [None, None, None]
    assert [(s.channel, s.size, s.in_flight) for s in queue.stats()] == [("free", 3, 0)]


def test_a_channel_with_a_policy_reports_its_size(queue: Queue) -> None:
    queue.channel("counted").set_policy(max_concurrency=5)
    results = [queue.create(b"x", channel="counted") for _ in range(3)]
    assert [r.channel_size for r in results] == [1, 2, 3]


# -- policy lifetime and stats() ---------------------------------------------------------


def test_policy_is_kept_when_the_channel_empties(queue: Queue) -> None:
    queue.channel("a").set_policy(max_concurrency=1, release_interval_ms=500, max_size=10)
    queue.create(b"a0", channel="a")
    message = queue.dequeue(lock_ms=LOCK_MS)
    assert message is not None
    message.delete()
    expected = Policy(max_concurrency=1, release_interval_ms=500, max_size=10)
    assert queue.stats() == [
        ChannelStats("a", size=0, in_flight=0, next_dequeue_at=None, policy=expected)
    ]
    # and it still applies to the next messages
    queue.create(b"a1", channel="a")
    queue.create(b"a2", channel="a")
    queue.set_clock_offset(1_000)
    assert len(queue.dequeue_many(10, lock_ms=LOCK_MS)) == 1


def test_policy_on_a_channel_that_never_held_messages_is_listed(queue: Queue) -> None:
    queue.channel("new").set_policy(max_concurrency=3)
    assert queue.stats() == [
        ChannelStats("new", 0, 0, None, Policy(max_concurrency=3)),
    ]
    assert queue.channel("new").stats() == ChannelStats("new", 0, 0, None, Policy(3))


def test_clear_policy_removes_an_empty_channel(queue: Queue) -> None:
    queue.channel("a").set_policy(max_concurrency=1)
    queue.channel("b").set_policy(max_size=5)
    queue.channel("a").clear_policy()
    assert [s.channel for s in queue.stats()] == ["b"]
    assert queue.channel("a").stats() is None


def test_clear_policy_on_a_busy_channel_makes_it_unlimited(queue: Queue) -> None:
    queue.channel("a").set_policy(max_concurrency=1, max_size=2)
    queue.create(b"a0", channel="a")
    queue.create(b"a1", channel="a")
    first = queue.dequeue_many(10, lock_ms=LOCK_MS)
    assert len(first) == 1
    queue.channel("a").clear_policy()
    assert queue.create(b"a2", channel="a").status is CreateStatus.CREATED
    stats = stats_of(queue, "a")
    assert stats is not None
    assert stats.policy == Policy()
    held = queue.dequeue_many(10, lock_ms=LOCK_MS)
    assert [m.content for m in held] == [b"a1", b"a2"]
    # Once drained, the now policy-free channel disappears.
    assert queue.delete_many(held) == [AckStatus.OK, AckStatus.OK]
    assert [s.channel for s in queue.stats()] == ["a"]  # a0 is still in flight
    first[0].delete()
    assert queue.stats() == []


def test_empty_channel_without_policy_disappears_from_stats(queue: Queue) -> None:
    queue.create(b"a0", channel="a")
    assert [s.channel for s in queue.stats()] == ["a"]
    message = queue.dequeue(lock_ms=LOCK_MS)
    assert message is not None
    message.delete()
    assert queue.stats() == []


def test_clear_policy_of_unknown_channel_is_a_no_op(queue: Queue) -> None:
    queue.channel("nothing").clear_policy()
    assert queue.stats() == []


def test_stats_fields(queue: Queue) -> None:
    now = queue.now()
    queue.channel("a").set_policy(max_concurrency=5, release_interval_ms=0, max_size=100)
    queue.create(b"a0", channel="a")
    queue.create(b"a1", channel="a")
    queue.create(b"a2", channel="a", dequeue_at=now + 50_000)
    queue.create(b"b0", channel="b", dequeue_at=now + 20_000)
    held = queue.dequeue_many(2, lock_ms=LOCK_MS)
    assert [m.content for m in held] == [b"a0", b"a1"]

    stats = queue.stats()
    assert [s.channel for s in stats] == ["a", "b"]
    a, b = stats
    assert (a.size, a.in_flight, a.next_dequeue_at) == (3, 2, now + 50_000)
    assert a.policy == Policy(max_concurrency=5, release_interval_ms=0, max_size=100)
    assert (b.size, b.in_flight, b.next_dequeue_at) == (1, 0, now + 20_000)
    assert b.policy == Policy()


def test_stats_next_dequeue_at_is_none_when_everything_is_in_flight(queue: Queue) -> None:
    queue.create(b"a0", channel="a")
    assert queue.dequeue(lock_ms=LOCK_MS) is not None
    stats = stats_of(queue, "a")
    assert stats is not None
    assert (stats.size, stats.in_flight, stats.next_dequeue_at) == (1, 1, None)


@pytest.mark.parametrize(
    ("max_concurrency", "release_interval_ms", "max_size"),
    [
        (-1, None, None),
        (None, -1, None),
        (None, None, -1),
        (None, 366 * 24 * 3600 * 1000, None),
    ],
)
def test_invalid_policy_is_refused_and_changes_nothing(
    queue: Queue,
    max_concurrency: int | None,
    release_interval_ms: int | None,
    max_size: int | None,
) -> None:
    queue.channel("a").set_policy(max_concurrency=2)
    with pytest.raises(InvalidPolicyError):
        queue.channel("a").set_policy(
            max_concurrency=max_concurrency,
            release_interval_ms=release_interval_ms,
            max_size=max_size,
        )
    assert queue.stats() == [ChannelStats("a", 0, 0, None, Policy(max_concurrency=2))]


def test_invalid_policy_is_refused_by_the_sql_layer(
    queue: Queue, admin: psycopg.Connection[Any], schema_name: str
) -> None:
    """The SQL functions check policies themselves (for callers that bypass Python)."""
    queue.channel("a").set_policy(max_concurrency=2)
    call = sql.SQL("SELECT {}.channel_policy_set('a', -1)").format(sql.Identifier(schema_name))
    with pytest.raises(psycopg.Error) as caught:
        admin.execute(call)
    assert caught.value.sqlstate == "LQ004"
    assert queue.stats() == [ChannelStats("a", 0, 0, None, Policy(max_concurrency=2))]
