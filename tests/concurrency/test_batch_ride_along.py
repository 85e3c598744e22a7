"""A batch dequeue rides along on busy channels in one statement (step 2b of
message_dequeue_loop, in sql/schema/40_take.sql). Three faults a review of its first version
found, each reproduced: a channel with a policy starved, advisory locks growing with the square
of the limit, and a false empty when a policy is set while the batch rides along."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest
from psycopg import sql

from lonnymq import NewMessage, Queue

LOCK_MS = 60_000
Conn = psycopg.Connection[Any]


def _session(dsn: str, schema: str, autocommit: bool = False) -> Conn:
    conn = psycopg.connect(dsn, autocommit=autocommit)
    conn.execute(sql.SQL("SET search_path = {}").format(sql.Identifier(schema)))
    if not autocommit:
        conn.commit()
    return conn


def _dequeue(conn: Conn, limit: int) -> list[str | None]:
    rows = conn.execute(
        "SELECT convert_from(content, 'utf8') FROM message_dequeue_many(%s, %s)", [limit, LOCK_MS]
    ).fetchall()
    return [r[0] for r in rows]


def test_riding_along_keeps_a_slot_for_a_free_channel_with_a_policy(dsn: str, queue: Queue) -> None:
    """A channel with a policy comes first in turn and its row is free; the other due channels'
    rows are held by another dequeue. 2a locks the policy channel's row and leaves it to the
    one-by-one steps; 2b must keep it a slot, or it fills the batch from the busy channels and
    the policy channel, its row held by the batch, is not served (the first version did)."""
    queue.channel("p").set_policy(max_concurrency=5)
    now = queue.now()
    queue.create_many(
        [NewMessage(f"p{i}".encode(), channel="p", dequeue_at=now - 10_000) for i in (1, 2, 3)]
        + [
            NewMessage(f"{c}{i}".encode(), channel=c, dequeue_at=now - 5_000)
            for c in "abc"
            for i in range(1, 6)
        ]
    )
    holder = _session(dsn, queue.schema)
    consumer = _session(dsn, queue.schema)
    try:
        holder.execute("SELECT FROM channel WHERE name = ANY('{a,b,c}') FOR UPDATE")
        calls = []
        for _ in range(2):
            calls.append(_dequeue(consumer, 4))
            consumer.commit()
        assert any(m is not None and m.startswith("p") for m in calls[0]), calls
    finally:
        holder.rollback()
        consumer.rollback()
        holder.close()
        consumer.close()
    assert queue.verify() == []


def test_riding_along_takes_a_bounded_number_of_advisory_locks(dsn: str, queue: Queue) -> None:
    """Due channels whose rows say due while their only message is in flight (the "too early"
    state riders leave behind), with one channel that has a ready message in each window 2b
    reads. Each 2b round that takes something reads the next window, and every channel read
    keeps its shared advisory lock to the end of the transaction: about L*L/2 locks for a
    limit of L in the first version (the one-channel steps take at most one per probe, 2L+8;
    with L = 200, ~20,000 locks: "out of shared memory" on a default server). The channels 2b
    reads now count as probes."""
    limit = 50
    order: list[tuple[str, bool]] = []
    remaining, round_no = limit, 1
    while remaining >= 2:
        for _ in range(remaining - (1 if round_no > 1 else 0) - 1):
            order.append((f"s{len(order)}", False))
        order.append((f"g{round_no}", True))
        remaining, round_no = remaining - 1, round_no + 1
    now = queue.now()
    queue.create_many(
        [
            NewMessage(name.encode(), channel=name, dequeue_at=now - 1_000_000 + pos)
            for pos, (name, _) in enumerate(order)
        ]
    )
    names = [n for n, _ in order]
    stale = [n for n, good in order if not good]
    holder = _session(dsn, queue.schema)
    consumer = _session(dsn, queue.schema)
    try:
        holder.execute("SELECT FROM channel WHERE name = ANY(%s) FOR UPDATE", [names])
        # The stale channels' messages are in flight; their rows still say due (allowed).
        with _session(dsn, queue.schema, autocommit=True) as admin:
            admin.execute(
                "UPDATE message SET is_locked = TRUE, unlock_at = %s, locked_at = %s,"
                " num_attempts = 1 WHERE channel = ANY(%s)",
                [now + 3_600_000, now, stale],
            )
        taken = _dequeue(consumer, limit)
        row = consumer.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
        ).fetchone()
        assert row is not None
        assert taken  # the ready channels' messages
        assert row[0] <= 3 * limit + 8
    finally:
        holder.rollback()
        consumer.rollback()
        holder.close()
        consumer.close()


def _pause_channel_key_of_x(admin: Conn, schema: str) -> None:
    """Replace channel_key, in ``schema`` only, by one that sleeps 2 s for channel 'x' in a
    session that set lonnymq_test.pause: fault injection that holds a dequeue between reading
    the busy channels and taking x's advisory lock."""
    src = admin.execute(
        "SELECT prosrc FROM pg_proc WHERE proname = 'channel_key'"
        " AND pronamespace = %s::regnamespace",
        [schema],
    ).fetchone()
    assert src is not None
    expr = src[0].strip().removeprefix("SELECT ")
    admin.execute(
        "CREATE OR REPLACE FUNCTION channel_key(p_channel TEXT) RETURNS BIGINT"
        " LANGUAGE plpgsql VOLATILE AS $f$ BEGIN"
        " IF p_channel = 'x' AND current_setting('lonnymq_test.pause', TRUE) = 'on' THEN"
        " PERFORM pg_sleep(2); END IF;"
        f" RETURN {expr}; END $f$"
    )


def _wait_for_the_pause(admin: Conn, consumer_pid: int) -> None:
    """Return once the consumer's backend sleeps in the paused channel_key (its own only:
    another client of the server, a second test run, may be sleeping too)."""
    deadline = time.monotonic() + 30
    while not admin.execute(
        "SELECT FROM pg_stat_activity WHERE pid = %s AND wait_event = 'PgSleep'", [consumer_pid]
    ).fetchall():
        assert time.monotonic() < deadline, "the consumer never reached channel x"
        time.sleep(0.01)


def test_riding_along_leaves_a_channel_given_a_policy_meanwhile_to_its_row(
    dsn: str, queue: Queue
) -> None:
    """2b reads the busy channels, then takes their advisory locks. A policy set and committed
    in between is seen by its statement, which leaves the channel out; the channel then counts
    as "gave less than its share" and is passed, so the call answers nothing although the
    channel has a due message and a policy that allows it (the first version did). channel_key
    is replaced, in this test's schema only, by one that pauses for channel 'x' in the
    consumer's session: fault injection to hold the window open."""
    now = queue.now()
    queue.create_many(
        [
            NewMessage(b"y1", channel="y", dequeue_at=now - 3000),
            NewMessage(b"x1", channel="x", dequeue_at=now - 2000),
        ]
    )
    admin = _session(dsn, queue.schema, autocommit=True)
    _pause_channel_key_of_x(admin, queue.schema)
    holder = _session(dsn, queue.schema)
    rider = _session(dsn, queue.schema)
    consumer = _session(dsn, queue.schema)
    out: dict[str, list[str | None]] = {}
    try:
        holder.execute("SELECT FROM channel WHERE name = ANY('{x,y}') FOR UPDATE")
        # A single dequeue rides along on y (its row is held) and takes y1: y's row says due.
        assert _dequeue(rider, 1) == ["y1"]
        rider.commit()
        consumer.execute("SET lonnymq_test.pause = 'on'")
        thread = threading.Thread(target=lambda: out.setdefault("rows", _dequeue(consumer, 5)))
        thread.start()
        _wait_for_the_pause(admin, consumer.info.backend_pid)
        holder.rollback()
        queue.channel("x").set_policy(max_concurrency=5)
        thread.join()
        assert out["rows"] == ["x1"], out
    finally:
        holder.rollback()
        consumer.rollback()
        rider.rollback()
        for c in (holder, consumer, rider, admin):
            c.close()


def _stale(dsn: str, schema: str, channels: list[str], now: int) -> None:
    """Mark the messages of ``channels`` in flight while their rows still say due (the "too
    early" state riders leave behind)."""
    with _session(dsn, schema, autocommit=True) as admin:
        admin.execute(
            "UPDATE message SET is_locked = TRUE, unlock_at = %s, locked_at = %s,"
            " num_attempts = 1 WHERE channel = ANY(%s)",
            [now + 3_600_000, now, channels],
        )


@pytest.mark.parametrize("layout", ["deep_first", "spread"])
def test_riding_along_fills_the_batch_from_busy_channels_among_stale_ones(
    dsn: str, queue: Queue, layout: str
) -> None:
    """Every row is held; most due channels are stale. deep_first: channel g, first in turn, has
    100 ready messages; spread: 10 channels of 20 ready messages each among 190 stale ones, a
    stale one first. A batch takes as many as the limit asks for, as before it rode along in one
    statement (that statement's second version gave 3 of 50, and 60 of 100: each round charged
    its whole window as probes and gave each channel one message)."""
    now = queue.now()
    if layout == "deep_first":
        limit = 50
        good = {"g": 100}
        order = ["g"] + [f"s{i:03d}" for i in range(150)]
    else:
        limit = 100
        order = [f"s{i:03d}" if i % 20 else f"g{i:03d}" for i in range(1, 201)]
        good = {name: 20 for name in order if name.startswith("g")}
    created = []
    for pos, name in enumerate(order):
        for i in range(good.get(name, 1)):
            created.append(
                NewMessage(f"{name}-{i}".encode(), channel=name, dequeue_at=now - 1_000_000 + pos)
            )
    queue.create_many(created)
    _stale(dsn, queue.schema, [n for n in order if n not in good], now)
    holder = _session(dsn, queue.schema)
    consumer = _session(dsn, queue.schema)
    try:
        holder.execute("SELECT FROM channel FOR UPDATE")
        taken = _dequeue(consumer, limit)
        assert len(taken) == limit, taken
        assert all(m is not None and m.split("-")[0] in good for m in taken)
        if layout == "deep_first":
            assert taken == [f"g-{i}" for i in range(limit)]
    finally:
        holder.rollback()
        consumer.rollback()
        holder.close()
        consumer.close()


def test_riding_along_does_not_lock_the_heads_of_a_channel_given_a_policy_meanwhile(
    dsn: str, queue: Queue
) -> None:
    """x gets a policy between 2b's read of the busy channels and its advisory lock. x must be
    left out before any of its heads is locked: the second version filtered it beside the
    heads' FOR UPDATE SKIP LOCKED, which the planner ran first (with many channels), so x's
    heads stayed locked, untaken, to the end of the transaction, and another consumer serving
    x under its row took x2 and x3 before x1."""
    now = queue.now()
    queue.create_many(
        [
            NewMessage(f"{c}{i}".encode(), channel=c, dequeue_at=now - base + i)
            for c, base in (("y", 40_000), ("z", 30_000), ("w", 20_000), ("x", 10_000))
            for i in (1, 2, 3)
        ]
        + [NewMessage(b"f", channel=f"f{i:04d}", dequeue_at=now + 3_600_000) for i in range(3000)]
    )
    for i in range(6):
        queue.channel(f"f{i:04d}").set_policy(max_concurrency=5)
    admin = _session(dsn, queue.schema, autocommit=True)
    admin.execute("ANALYZE channel")
    admin.execute("ANALYZE message")
    _pause_channel_key_of_x(admin, queue.schema)
    holder = _session(dsn, queue.schema)
    consumer = _session(dsn, queue.schema)
    other = _session(dsn, queue.schema)
    out: dict[str, list[str | None]] = {}
    try:
        holder.execute("SELECT FROM channel FOR UPDATE")
        consumer.execute("SET lonnymq_test.pause = 'on'")
        # y (first in turn) is ridden alone; then z, w and x together, pausing at x.
        thread = threading.Thread(target=lambda: out.setdefault("rows", _dequeue(consumer, 8)))
        thread.start()
        _wait_for_the_pause(admin, consumer.info.backend_pid)
        holder.rollback()
        queue.channel("x").set_policy(max_concurrency=5)
        thread.join()
        assert out["rows"][:3] == ["y1", "y2", "y3"]
        assert not any(m is not None and m.startswith("x") for m in out["rows"]), out
        # The consumer has not committed; x1 was not locked, so the next consumer gets it.
        got = [m for m in _dequeue(other, 10) if m is not None and m.startswith("x")]
        assert got[:1] == ["x1"], got
    finally:
        for conn in (holder, consumer, other):
            conn.rollback()
            conn.close()
        admin.close()
