"""The commit of a Spark write (spark_write_commit, in sql/schema/80_spark.sql), called
directly: rows of policy-free channels without dedup keys are promoted by one INSERT … SELECT,
the others through message_create_many, and the outcome is the one message_create_many alone
gives."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from lonnymq import Queue
from lonnymq.spark import _db

Conn = psycopg.Connection[Any]
# (task_tag, channel, content, dequeue_at, dedup_key)
Row = tuple[str, str | None, bytes, int | None, str | None]

HOUR_MS = 3_600_000
SENTINEL = "-- sentinel --"


def _stage(admin: Conn, schema: str, write_id: str, rows: list[Row]) -> list[str]:
    """Stage rows as write tasks do (seq counts per task); returns the task tags."""
    seqs: dict[str, int] = {}
    with (
        admin.cursor() as cursor,
        cursor.copy(
            sql.SQL(
                "COPY {}.spark_stage (write_id, task_tag, seq, channel, content, dequeue_at, "
                "dedup_key) FROM STDIN"
            ).format(sql.Identifier(schema))
        ) as copy,
    ):
        for tag, channel, content, dequeue_at, dedup_key in rows:
            seq = seqs.get(tag, 0)
            seqs[tag] = seq + 1
            copy.write_row((write_id, tag, seq, channel, content, dequeue_at, dedup_key))
    for tag, n in seqs.items():
        admin.execute(
            _db.statement(schema, "spark_stage_record"),
            {"write_id": write_id, "task_tag": tag, "n_rows": n},
        )
    return sorted(seqs)


def _commit(db: Conn, schema: str, write_id: str, tags: list[str]) -> tuple[Any, ...]:
    params = {"sink_id": write_id, "batch_id": 0, "write_id": write_id, "task_tags": tags}
    rows = db.execute(_db.statement(schema, "spark_write_commit"), params).fetchall()
    assert len(rows) == 1
    return tuple(rows[0])


def _by_channel(admin: Conn, schema: str) -> dict[str, list[tuple[bytes, str | None]]]:
    """Each channel's messages (content, dedup_key) in id order."""
    found: dict[str, list[tuple[bytes, str | None]]] = {}
    for channel, content, dedup_key in admin.execute(
        sql.SQL("SELECT channel, content, dedup_key FROM {}.message ORDER BY id").format(
            sql.Identifier(schema)
        )
    ):
        found.setdefault(channel, []).append((bytes(content), dedup_key))
    return found


def _next_at(admin: Conn, schema: str) -> dict[str, int | None]:
    rows = admin.execute(
        sql.SQL("SELECT name, next_dequeue_at FROM {}.channel").format(sql.Identifier(schema))
    ).fetchall()
    return dict(rows)


@pytest.fixture
def event_channel() -> str:
    return f"lmq_ev_{uuid.uuid4().hex[:16]}"


@pytest.fixture
def listen(dsn: str, event_channel: str) -> Iterator[Callable[[], list[dict[str, Any]]]]:
    """Everything published on the event channel since the last call (up to a sentinel)."""
    with (
        psycopg.connect(dsn, autocommit=True) as conn,
        psycopg.connect(dsn, autocommit=True) as sender,
    ):
        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(event_channel)))

        def received() -> list[dict[str, Any]]:
            sender.execute("SELECT pg_notify(%s, %s)", [event_channel, SENTINEL])
            got: list[dict[str, Any]] = []
            for notify in conn.notifies(timeout=5):
                if notify.payload == SENTINEL:
                    return got
                got.append(json.loads(notify.payload))
            raise AssertionError("sentinel not received")

        yield received


def test_plain_channels_land_in_order_due_and_announced_once(
    make_queue: Callable[..., Queue],
    admin: Conn,
    event_channel: str,
    listen: Callable[[], list[dict[str, Any]]],
) -> None:
    queue = make_queue(event_channel=event_channel)
    schema = queue.schema
    now = queue.now()
    # b is due in an hour: the write's rows must make it due now.
    queue.create(b"old", channel="b", dequeue_at=now + HOUR_MS)
    assert len(listen()) == 1
    rows: list[Row] = [
        ("t1", "a", b"a0", None, None),
        ("t2", "a", b"a2", None, None),
        ("t1", "b", b"b0", None, None),
        ("t1", None, b"d0", None, None),
        ("t1", "a", b"a1", None, None),
        ("t2", "b", b"b1", now - 5_000, None),
        ("t2", "c", b"c0", now + 60_000, None),
        ("t1", "c", b"c1", now + 90_000, None),
        ("lost", "a", b"never", None, None),
    ]
    tags = _stage(admin, schema, "w", rows)
    assert _commit(admin, schema, "w", ["t1", "t2"]) == (True, 8, 8, 0, 0, [])
    assert tags == ["lost", "t1", "t2"]

    # Per channel: task order, then input order within a task; only the winning tags.
    assert _by_channel(admin, schema) == {
        "a": [(b"a0", None), (b"a1", None), (b"a2", None)],
        "b": [(b"old", None), (b"b0", None), (b"b1", None)],
        "default": [(b"d0", None)],
        "c": [(b"c1", None), (b"c0", None)],
    }
    due = _next_at(admin, schema)
    assert set(due) == {"a", "b", "default", "c"}
    assert due["b"] == now - 5_000  # its earliest new message
    assert due["a"] is not None
    assert now <= due["a"] <= queue.now()
    assert due["c"] == now + 60_000
    # One event for the whole write: the soonest channel.
    events = listen()
    assert len(events) == 1
    assert events[0]["type"] == "created"
    assert events[0]["channel"] == "b"
    # ... naming the first new message of that channel.
    first_b = admin.execute(
        sql.SQL("SELECT id FROM {}.message WHERE content = 'b0'").format(sql.Identifier(schema))
    ).fetchone()
    assert first_b is not None
    assert events[0]["id"] == first_b[0]

    taken = queue.dequeue_many(20, lock_ms=HOUR_MS)
    per_channel: dict[str, list[bytes]] = {}
    for message in taken:
        per_channel.setdefault(message.channel, []).append(message.content)
    assert per_channel == {"a": [b"a0", b"a1", b"a2"], "b": [b"b1", b"b0"], "default": [b"d0"]}
    # The future ones come when due.
    queue.set_clock_offset(100_000)
    later = queue.dequeue_many(20, lock_ms=60_000)
    assert [m.content for m in later] == [b"c0", b"c1"]
    left = admin.execute(
        sql.SQL("SELECT count(*) FROM {}.spark_stage").format(sql.Identifier(schema))
    )
    assert left.fetchone() == (0,)


def _prepare(queue: Queue) -> None:
    queue.channel("p").set_policy(max_size=2)
    queue.create(b"p-old", channel="p")
    queue.create(b"k-old", channel="k", dedup_key="k1")
    queue.create(b"q-old", channel="q")


MIXED: list[Row] = [
    ("t1", "p", b"p0", None, None),
    ("t1", "q", b"q0", None, None),
    ("t1", "k", b"k-dup-live", None, "k1"),
    ("t1", "k", b"k2-first", None, "k2"),
    ("t2", "k", b"k-no-key", None, None),
    ("t2", "p", b"p1", None, None),
    ("t2", "k", b"k2-again", None, "k2"),
    ("t2", "q", b"q1", None, None),
    ("t2", None, b"d0", None, None),
    ("t2", "p", b"p2", None, None),
    ("t1", "z", b"z0", None, None),
]


def test_mixed_write_matches_message_create_many(
    make_queue: Callable[..., Queue], other_schema: str, admin: Conn
) -> None:
    fast = make_queue()
    generic = make_queue(schema=other_schema)
    _prepare(fast)
    _prepare(generic)

    tags = _stage(admin, fast.schema, "w", MIXED)
    result = _commit(admin, fast.schema, "w", tags)

    # The reference: message_create_many on the same rows in the order spark_write_commit
    # passes them to it (channel, task, seq).
    ordered = sorted(
        ((tag, seq, row) for seq, (tag, *row) in enumerate(MIXED)),
        key=lambda t: (t[2][0] is None, t[2][0] or "", t[0], t[1]),
    )
    statuses = [
        status
        for status, _, _ in admin.execute(
            sql.SQL(
                "SELECT status, id, channel_size FROM {}.message_create_many(%s, %s, %s, %s)"
            ).format(sql.Identifier(other_schema)),
            [[r[2][i] for r in ordered] for i in range(4)],
        )
    ]
    assert statuses.count("dropped") == 2
    assert statuses.count("deduplicated") == 2
    assert result == (
        True,
        len(MIXED),
        statuses.count("created"),
        statuses.count("deduplicated"),
        statuses.count("dropped"),
        ["p"],
    )
    assert _by_channel(admin, fast.schema) == _by_channel(admin, other_schema)
    # max_size counted exactly; sizes and policies as the generic path leaves them.
    stats = [(s.channel, s.size, s.in_flight, s.policy.max_size) for s in fast.stats()]
    assert stats == [(s.channel, s.size, s.in_flight, s.policy.max_size) for s in generic.stats()]
    assert ("p", 2, 0, 2) in stats
    assert set(_next_at(admin, fast.schema)) == set(_next_at(admin, other_schema))

    def drain(queue: Queue) -> dict[str, list[bytes]]:
        got: dict[str, list[bytes]] = {}
        for message in queue.dequeue_many(100, lock_ms=60_000):
            got.setdefault(message.channel, []).append(message.content)
        return got

    assert drain(fast) == drain(generic)


def test_policy_set_waits_for_the_commit_and_counts_its_rows(
    make_queue: Callable[..., Queue], dsn: str, admin: Conn
) -> None:
    queue = make_queue()
    schema = queue.schema
    tags = _stage(admin, schema, "w", [("t", "a", f"m{i}".encode(), None, None) for i in range(5)])
    done = threading.Event()

    def set_policy() -> None:
        with Queue(dsn, schema=schema) as other:
            other.channel("a").set_policy(max_size=100)
        done.set()

    with psycopg.connect(dsn) as db:
        assert _commit(db, schema, "w", tags)[:3] == (True, 5, 5)
        setter = threading.Thread(target=set_policy)
        setter.start()
        time.sleep(0.5)
        assert not done.is_set()  # held by the commit's lock on the channel row
        db.commit()
    setter.join(timeout=10)
    assert done.is_set()
    assert [(s.channel, s.size, s.policy.max_size) for s in queue.stats()] == [("a", 5, 100)]
