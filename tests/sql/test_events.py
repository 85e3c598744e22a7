"""Wake-up events: NOTIFY payloads on the installation's event channel, published only when a
change can wake a worker (a channel became servable sooner), at most once per transaction
unless a later change is due earlier than what was announced.

To tell "nothing was published" without sleeping, every check sends a sentinel NOTIFY on
the same channel after the operation and reads until the sentinel: PostgreSQL delivers the
notifications of different transactions in commit order, so any event of the operation
would arrive before it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from lonnymq import AckStatus, NewMessage, Queue

Conn = psycopg.Connection[Any]
Event = dict[str, Any]

SENTINEL = "-- sentinel --"
HOUR_MS = 3_600_000


class Listener:
    """A LISTENing connection and a second one to send the sentinel."""

    def __init__(self, dsn: str, channels: list[str]) -> None:
        self.channels = channels
        self.conn: Conn = psycopg.connect(dsn, autocommit=True)
        self.sender: Conn = psycopg.connect(dsn, autocommit=True)
        for channel in channels:
            self.conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))

    def close(self) -> None:
        self.conn.close()
        self.sender.close()

    def events(self) -> list[tuple[str, Event]]:
        """Everything published so far, as (channel, payload) in arrival order."""
        for channel in self.channels:
            self.sender.execute("SELECT pg_notify(%s, %s)", [channel, SENTINEL])
        received: list[tuple[str, Event]] = []
        pending = set(self.channels)
        for notify in self.conn.notifies(timeout=5):
            if notify.payload == SENTINEL:
                pending.discard(notify.channel)
                if not pending:
                    break
                continue
            received.append((notify.channel, json.loads(notify.payload)))
        assert not pending, f"sentinel not received on {sorted(pending)}"
        return received

    def payloads(self) -> list[Event]:
        return [payload for _, payload in self.events()]


@pytest.fixture
def event_channel() -> str:
    return f"lmq_ev_{uuid.uuid4().hex[:16]}"


@pytest.fixture
def listener(dsn: str, event_channel: str) -> Iterator[Listener]:
    listening = Listener(dsn, [event_channel])
    yield listening
    listening.close()


@pytest.fixture
def equeue(make_queue: Callable[..., Queue], event_channel: str, listener: Listener) -> Queue:
    """A queue that publishes events on ``event_channel`` (with a listener already there)."""
    queue = make_queue(event_channel=event_channel)
    assert listener.payloads() == []  # installing publishes nothing
    return queue


def test_create_into_an_empty_channel_publishes_created(
    equeue: Queue, listener: Listener, event_channel: str
) -> None:
    before = equeue.now()
    created = equeue.create(b"x", channel="a")
    after = equeue.now()
    events = listener.events()
    assert len(events) == 1
    channel, payload = events[0]
    assert channel == event_channel
    assert set(payload) == {"type", "id", "channel", "dequeue_at"}
    assert (payload["type"], payload["id"], payload["channel"]) == ("created", created.id, "a")
    assert before <= payload["dequeue_at"] <= after


def test_created_event_carries_a_scheduled_time(equeue: Queue, listener: Listener) -> None:
    at = equeue.now() + 60_000
    created = equeue.create(b"x", channel="later", dequeue_at=at)
    assert listener.payloads() == [
        {"type": "created", "id": created.id, "channel": "later", "dequeue_at": at}
    ]


def test_create_behind_a_ready_head_publishes_nothing(equeue: Queue, listener: Listener) -> None:
    equeue.create(b"1", channel="a")
    assert len(listener.payloads()) == 1
    equeue.create(b"2", channel="a")
    equeue.create(b"3", channel="a", dequeue_at=equeue.now() + 60_000)
    assert listener.payloads() == []


def test_create_earlier_than_a_scheduled_head_publishes(equeue: Queue, listener: Listener) -> None:
    now = equeue.now()
    equeue.create(b"later", channel="a", dequeue_at=now + 60_000)
    assert [p["dequeue_at"] for p in listener.payloads()] == [now + 60_000]
    sooner = equeue.create(b"sooner", channel="a", dequeue_at=now + 1_000)
    assert listener.payloads() == [
        {"type": "created", "id": sooner.id, "channel": "a", "dequeue_at": now + 1_000}
    ]


def test_create_many_publishes_once_per_transaction(equeue: Queue, listener: Listener) -> None:
    results = equeue.create_many([NewMessage(b"%d" % i, channel="a") for i in range(50)])
    payloads = listener.payloads()
    assert len(payloads) == 1
    assert (payloads[0]["type"], payloads[0]["id"]) == ("created", results[0].id)

    # Many channels, all due now, in one call: still one event.
    equeue.create_many(
        [NewMessage(b"x", channel=f"c{i % 10}") for i in range(100)]  # fresh channels
    )
    assert len(listener.payloads()) == 1


def test_one_event_per_explicit_transaction(equeue: Queue, listener: Listener, dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
        for name in ("t1", "t2", "t3"):
            equeue.create(b"x", channel=name, conn=conn)
        equeue.create_many([NewMessage(b"y", channel="t4")], conn=conn)
    payloads = listener.payloads()
    assert len(payloads) == 1
    assert payloads[0]["channel"] == "t1"


def test_create_many_announces_only_its_earliest_time(equeue: Queue, listener: Listener) -> None:
    now = equeue.now()
    # Whatever the input order, a batch announces the soonest channel, once.
    for first, second in ((60_000, 1_000), (1_000, 60_000)):
        equeue.create_many(
            [
                NewMessage(b"x", channel=f"a{first}", dequeue_at=now + first),
                NewMessage(b"y", channel=f"b{first}", dequeue_at=now + second),
            ]
        )
        payloads = [(p["channel"], p["dequeue_at"]) for p in listener.payloads()]
        soonest = f"a{first}" if first < second else f"b{first}"
        assert payloads == [(soonest, now + 1_000)]


def test_transaction_publishes_again_for_an_earlier_time(
    dsn: str, equeue: Queue, listener: Listener
) -> None:
    now = equeue.now()
    with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
        equeue.create(b"a", channel="a", dequeue_at=now + 60_000, conn=conn)
        equeue.create(b"b", channel="b", dequeue_at=now + 1_000, conn=conn)
        equeue.create(b"c", channel="c", dequeue_at=now + 30_000, conn=conn)
    # "b" is due before what was announced, so it is announced too; "c" is not.
    assert [(p["channel"], p["dequeue_at"]) for p in listener.payloads()] == [
        ("a", now + 60_000),
        ("b", now + 1_000),
    ]


def test_dequeue_and_heartbeat_publish_nothing(equeue: Queue, listener: Listener) -> None:
    equeue.create(b"x", channel="a")
    equeue.create(b"y", channel="a")
    listener.payloads()
    message = equeue.dequeue(lock_ms=HOUR_MS)
    assert message is not None
    message.heartbeat(lock_ms=HOUR_MS)
    assert listener.payloads() == []


def test_defer_that_makes_a_message_ready_sooner_publishes_deferred(
    equeue: Queue, listener: Listener
) -> None:
    equeue.create(b"x", channel="a")
    message = equeue.dequeue(lock_ms=HOUR_MS)
    assert message is not None
    listener.payloads()
    before = equeue.now()
    message.defer()
    after = equeue.now()
    payloads = listener.payloads()
    assert len(payloads) == 1
    assert (payloads[0]["type"], payloads[0]["id"], payloads[0]["channel"]) == (
        "deferred",
        message.id,
        "a",
    )
    assert before <= payloads[0]["dequeue_at"] <= after


def test_defer_behind_a_ready_head_publishes_nothing(equeue: Queue, listener: Listener) -> None:
    equeue.create(b"x", channel="a")
    equeue.create(b"y", channel="a")
    message = equeue.dequeue(lock_ms=HOUR_MS)
    assert message is not None
    listener.payloads()
    message.defer(dequeue_at=equeue.now() + 60_000)
    assert listener.payloads() == []


def test_delete_that_frees_a_saturated_channel_publishes_ready(
    equeue: Queue, listener: Listener
) -> None:
    equeue.channel("a").set_policy(max_concurrency=1)
    equeue.create(b"1", channel="a")
    equeue.create(b"2", channel="a")
    message = equeue.dequeue(lock_ms=HOUR_MS)
    assert message is not None
    assert equeue.dequeue(lock_ms=HOUR_MS) is None  # saturated
    listener.payloads()
    before = equeue.now()
    message.delete()
    payloads = listener.payloads()
    assert len(payloads) == 1
    assert (payloads[0]["type"], payloads[0]["channel"]) == ("ready", "a")
    assert payloads[0]["id"] is None
    assert payloads[0]["dequeue_at"] <= before


def test_a_batch_that_frees_a_saturated_channel_publishes_ready_once(
    equeue: Queue, listener: Listener
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


def test_raising_the_concurrency_of_a_saturated_channel_publishes_ready(
    equeue: Queue, listener: Listener
) -> None:
    equeue.channel("a").set_policy(max_concurrency=1)
    equeue.create(b"1", channel="a")
    equeue.create(b"2", channel="a")
    assert equeue.dequeue(lock_ms=HOUR_MS) is not None
    listener.payloads()
    equeue.channel("a").set_policy(max_concurrency=2)
    assert [(p["type"], p["channel"]) for p in listener.payloads()] == [("ready", "a")]


def test_delete_in_an_unsaturated_channel_publishes_nothing(
    equeue: Queue, listener: Listener
) -> None:
    equeue.create(b"1", channel="a")
    equeue.create(b"2", channel="a")
    first = equeue.dequeue(lock_ms=HOUR_MS)
    assert first is not None
    listener.payloads()
    first.delete()
    second = equeue.dequeue(lock_ms=HOUR_MS)
    assert second is not None
    second.delete()  # the channel empties
    assert listener.payloads() == []


def test_without_event_channel_nothing_is_published(
    make_queue: Callable[..., Queue], dsn: str, admin: Conn, schema_name: str
) -> None:
    channel = f"lmq_ev_{uuid.uuid4().hex[:16]}"
    listening = Listener(dsn, [channel, schema_name, "lonnymq"])
    try:
        queue = make_queue()
        config = admin.execute(
            sql.SQL("SELECT event_channel FROM {}.config").format(sql.Identifier(schema_name))
        ).fetchone()
        assert config == (None,)

        def exercise() -> None:
            queue.channel("s").set_policy(max_concurrency=1)
            queue.create(b"1", channel="s")
            queue.create(b"2", channel="s")
            queue.create_many([NewMessage(b"x", channel=f"m{i}") for i in range(3)])
            held = queue.dequeue(lock_ms=HOUR_MS)
            assert held is not None
            held.delete()
            again = queue.dequeue(lock_ms=HOUR_MS)
            assert again is not None
            again.defer()

        exercise()
        assert listening.events() == []

        # The same operations with the event channel turned on are heard: the listener works.
        make_queue(event_channel=channel).close()
        queue.create(b"3", channel="fresh")
        events = listening.events()
        assert [(c, p["type"], p["channel"]) for c, p in events] == [(channel, "created", "fresh")]
    finally:
        listening.close()


def test_creates_that_cannot_wake_anyone_publish_nothing(equeue: Queue, listener: Listener) -> None:
    equeue.channel("paused").set_policy(max_concurrency=0)
    equeue.create(b"x", channel="paused")  # paused: nobody can take it
    equeue.channel("full").set_policy(max_size=0)
    assert equeue.create(b"x", channel="full").status == "dropped"
    assert listener.payloads() == []
    equeue.create(b"y", channel="e", dedup_key="k")
    assert len(listener.payloads()) == 1
    assert equeue.create(b"z", channel="e", dedup_key="k").status == "deduplicated"
    assert listener.payloads() == []


def test_unpausing_a_channel_with_waiting_messages_publishes_ready(
    equeue: Queue, listener: Listener
) -> None:
    equeue.channel("a").set_policy(max_concurrency=0)
    equeue.create(b"x", channel="a")
    equeue.channel("b").set_policy(max_concurrency=0)
    equeue.create(b"x", channel="b")
    assert listener.payloads() == []
    equeue.channel("a").clear_policy()
    equeue.channel("b").set_policy(max_concurrency=1)
    assert [(p["type"], p["channel"]) for p in listener.payloads()] == [
        ("ready", "a"),
        ("ready", "b"),
    ]
