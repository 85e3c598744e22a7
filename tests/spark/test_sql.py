"""The SQL that the Spark data source relies on, called directly (no Spark session)."""

from __future__ import annotations

import re
import time
from typing import Any

import psycopg
import pytest
from psycopg import sql

from lonnymq import NewMessage, Queue
from lonnymq.spark import _db, purge_staging

Conn = psycopg.Connection[Any]


def _call(admin: Conn, schema: str, name: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    return admin.execute(_db.statement(schema, name), params).fetchall()


def test_every_spark_statement_calls_its_own_function(queue: Queue, admin: Conn) -> None:
    functions = {
        name: set(args or [])
        for name, args in admin.execute(
            "SELECT p.proname, p.proargnames FROM pg_proc p"
            " JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = %s",
            [queue.schema],
        ).fetchall()
    }
    statements = _db.statement_texts()
    assert len(statements) >= 10
    for name, text in statements.items():
        called = re.findall(r"\{schema\}\.(\w+)\(", text)
        assert called == [name], f"statement {name} calls {called}"
        assert name in functions, f"statement {name}: no function {name}"
        for arg in re.findall(r"\b(p_\w+)\s*=>", text):
            assert arg in functions[name], f"statement {name} passes {arg}, not a parameter"


def test_heartbeat_many_extends_held_locks_and_reports_the_others(
    queue: Queue, admin: Conn
) -> None:
    for i in range(3):
        queue.create(f"m{i}".encode(), channel=f"c{i}")
    held = queue.dequeue_many(3, lock_ms=1_000)
    ident = sql.Identifier(queue.schema)
    ids = [m.id for m in held] + [10**9]
    attempts = [m.num_attempts for m in held] + [1]
    attempts[1] += 1  # a stale attempt: someone else's lock
    rows = admin.execute(
        sql.SQL("SELECT id, status FROM {}.message_heartbeat_many(%s, %s, 600000)").format(ident),
        [ids, attempts],
    ).fetchall()
    assert rows == [
        (held[0].id, "ok"),
        (held[1].id, "stale"),
        (held[2].id, "ok"),
        (10**9, "not_found"),
    ]
    # The extended locks outlive their first lock_ms; the stale one expires and comes back.
    queue.set_clock_offset(5_000)
    again = queue.dequeue_many(3, lock_ms=1_000)
    assert [m.id for m in again] == [held[1].id]


def test_write_commit_promotes_only_the_winning_tags_once(queue: Queue, admin: Conn) -> None:
    schema = queue.schema
    ident = sql.Identifier(schema)
    with (
        admin.cursor() as cursor,
        cursor.copy(
            sql.SQL(
                "COPY {}.spark_stage (write_id, task_tag, seq, channel, content, dequeue_at, "
                "dedup_key) FROM STDIN"
            ).format(ident)
        ) as copy,
    ):
        for tag, n in (("won", 3), ("lost", 2)):
            for seq in range(n):
                copy.write_row(("w", tag, seq, "c", f"{tag}{seq}".encode(), None, None))
    for tag, n in (("won", 3), ("lost", 2)):
        _call(admin, schema, "spark_stage_record", {"write_id": "w", "task_tag": tag, "n_rows": n})
    params = {"sink_id": "s", "batch_id": 7, "write_id": "w", "task_tags": ["won"]}
    first = _call(admin, schema, "spark_write_commit", params)
    assert first == [(True, 3, 3, 0, 0, [])]
    again = _call(admin, schema, "spark_write_commit", params)
    assert again == [(False, 0, 0, 0, 0, [])]
    assert [m.content for m in queue.dequeue_many(10, lock_ms=1_000)] == [b"won0", b"won1", b"won2"]
    recorded = _call(admin, schema, "spark_write_result", {"sink_id": "s", "batch_id": 7})
    assert [r[:3] for r in recorded] == [(3, 0, 0)]
    left = admin.execute(sql.SQL("SELECT count(*) FROM {}.spark_stage").format(ident)).fetchone()
    assert left == (0,)


def test_purge_removes_abandoned_staging_only(dsn: str, queue: Queue, admin: Conn) -> None:
    schema = queue.schema
    ident = sql.Identifier(schema)
    admin.execute(
        sql.SQL(
            "INSERT INTO {}.spark_stage (write_id, task_tag, seq, content) VALUES"
            " ('old', 't', 0, 'x'), ('old', 't', 1, 'y')"
        ).format(ident)
    )
    _call(admin, schema, "spark_stage_record", {"write_id": "old", "task_tag": "t", "n_rows": 2})
    assert purge_staging(older_than_ms=60_000, dsn=dsn, schema=schema) == 0  # still young
    queue.set_clock_offset(3_600_000)
    assert purge_staging(older_than_ms=60_000, dsn=dsn, schema=schema) == 2
    left = admin.execute(sql.SQL("SELECT count(*) FROM {}.spark_stage_task").format(ident))
    assert left.fetchone() == (0,)


def test_plan_acks_releases_and_records(queue: Queue, admin: Conn) -> None:
    schema = queue.schema
    for i in range(5):
        queue.create(f"m{i}".encode(), channel="c")

    def plan(start: int, limit: int) -> tuple[Any, ...]:
        params = {
            "consumer": "k",
            "start": start,
            "limit": limit,
            "lock_ms": 60_000,
            "max_id": None,
        }
        return _call(admin, schema, "spark_batch_plan", params)[0]

    assert plan(0, 2) == (1, 2, 0, 0)  # batch 1: two messages
    assert plan(1, 2) == (2, 2, 2, 0)  # batch 1 acked (Spark committed it), batch 2 planned
    # A restart at offset 1 finds batch 2 unrecorded by Spark: given back, then planned again.
    assert plan(1, 10) == (2, 3, 0, 2)
    assert len(queue.stats()) == 1
    read = _call(
        admin,
        schema,
        "spark_batch_read",
        {"consumer": "k", "after": 1, "upto": 2, "slice": 0, "slices": 1},
    )
    assert [bytes(r[2]) for r in read] == [b"m2", b"m3", b"m4"]
    assert _call(admin, schema, "spark_batch_ack", {"consumer": "k", "batch_no": 2}) == [(3,)]
    assert queue.stats() == []


def test_batch_heartbeat_counts_a_row_held_elsewhere_as_neither(
    dsn: str, queue: Queue, admin: Conn
) -> None:
    """A planned message whose row another transaction holds is not waited for, and is not
    counted lost: only the others are extended."""
    schema = queue.schema
    for i in range(3):
        queue.create(f"m{i}".encode(), channel=f"c{i}")
    params = {"consumer": "k", "start": 0, "limit": 3, "lock_ms": 60_000, "max_id": None}
    assert _call(admin, schema, "spark_batch_plan", params)[0][1] == 3
    with psycopg.connect(dsn) as holder:
        holder.execute(
            sql.SQL("SELECT 1 FROM {}.message ORDER BY id LIMIT 1 FOR UPDATE").format(
                sql.Identifier(schema)
            )
        )
        admin.execute("SET lock_timeout = '5s'")
        beat = _call(admin, schema, "spark_batch_heartbeat", {"consumer": "k", "lock_ms": 60_000})
        assert beat == [(2, 0)]


def test_plan_up_to_a_horizon_passes_later_messages_and_leaves_them_untouched(
    queue: Queue, admin: Conn
) -> None:
    """Trigger.AvailableNow plans up to the largest id at its start. Messages created later,
    even due before the older ones (ahead of them in their channel, or in a channel first in
    turn), neither end the planning early nor gain attempts from being passed over."""
    schema = queue.schema
    horizon = max(queue.create(f"m{i}".encode(), channel="old").id or 0 for i in range(5))
    later = [
        queue.create(b"late, same channel", channel="old", priority=0).id,
        queue.create(b"late, other channel", channel="new", priority=0).id,
    ]

    def plan(start: int) -> tuple[Any, ...]:
        params = {"consumer": "k", "start": start, "limit": 2, "lock_ms": 60_000}
        return _call(admin, schema, "spark_batch_plan", {**params, "max_id": horizon})[0]

    def attempts() -> list[tuple[Any, ...]]:
        query = sql.SQL(
            "SELECT id, num_attempts, unlock_at IS NOT NULL FROM {}.message"
            " WHERE id = ANY (%s) ORDER BY id"
        ).format(sql.Identifier(schema))
        return admin.execute(query, [later]).fetchall()

    assert plan(0) == (1, 2, 0, 0)
    assert plan(1) == (2, 2, 2, 0)
    assert plan(2) == (3, 1, 2, 0)
    assert plan(3) == (3, 0, 1, 0)  # nothing left up to the horizon: no new batch
    assert attempts() == [(later[0], 0, False), (later[1], 0, False)]
    assert sorted((s.channel, s.size, s.in_flight) for s in queue.stats()) == [
        ("new", 1, 0),
        ("old", 1, 0),
    ]
    # Without a horizon they are planned like any other message.
    params = {"consumer": "k", "start": 3, "limit": 10, "lock_ms": 60_000, "max_id": None}
    assert _call(admin, schema, "spark_batch_plan", params)[0] == (4, 2, 0, 0)
    assert [n for _, n, _ in attempts()] == [1, 1]


def test_a_plan_passing_many_later_messages_stops_before_its_locks_expire(
    queue: Queue, admin: Conn
) -> None:
    """One old message behind 3,000 later ones, a limit of 1 and locks of 1 s: the plan may
    not run until its own first locks expire (its next dequeue would take them again, for
    ever); it stops after a quarter of the lock time and gives every later message back."""
    now = queue.now()
    horizon = queue.create(b"old", channel="a", dequeue_at=now - 1_000).id
    queue.create_many(NewMessage(b"new", channel="a", dequeue_at=now - 5_000) for _ in range(3_000))
    started = time.monotonic()
    params = {"consumer": "k", "start": 0, "limit": 1, "lock_ms": 1_000, "max_id": horizon}
    [(batch_no, size, _, _)] = _call(admin, queue.schema, "spark_batch_plan", params)
    assert time.monotonic() - started < 30
    assert (batch_no, size) in ((0, 0), (1, 1))  # the old one, if reached in time
    left = admin.execute(
        sql.SQL(
            "SELECT content, is_locked, num_attempts, count(*) FROM {}.message"
            " WHERE content = 'new' GROUP BY 1, 2, 3"
        ).format(sql.Identifier(queue.schema))
    ).fetchall()
    assert left == [(b"new", False, 0, 3_000)]
    assert queue.verify() == []


def test_a_sink_id_belongs_to_the_first_query_that_claims_it(queue: Queue, admin: Conn) -> None:
    def claim(sink_id: str, query_id: str) -> None:
        _call(admin, queue.schema, "spark_sink_claim", {"sink_id": sink_id, "query_id": query_id})

    claim("orders", "q1")
    claim("orders", "q1")  # the same query, restarted from its checkpoint
    claim("refunds", "q2")
    with pytest.raises(psycopg.Error, match="sinkId orders is written by another streaming query"):
        claim("orders", "q2")
    with pytest.raises(psycopg.Error, match="sink_id must be 1 to 255 characters"):
        claim("", "q2")
    owners = admin.execute(
        sql.SQL("SELECT sink_id, query_id FROM {}.spark_sink ORDER BY 1").format(
            sql.Identifier(queue.schema)
        )
    ).fetchall()
    assert owners == [("orders", "q1"), ("refunds", "q2")]


def test_a_consumer_belongs_to_the_checkpoint_that_last_took_it_over(
    queue: Queue, admin: Conn
) -> None:
    schema = queue.schema
    ident = sql.Identifier(schema)
    for i in range(6):
        queue.create(f"m{i}".encode(), channel="c")

    def claim(owner: str | None, step: str, batch: int, end: int | None = None) -> None:
        params = {"consumer": "k", "owner": owner, "step": step, "batch": batch, "end": end}
        _call(admin, schema, "spark_consumer_claim", params)

    def plan(start: int) -> tuple[Any, ...]:
        params = {"consumer": "k", "start": start, "limit": 2, "lock_ms": 60_000, "max_id": None}
        return _call(admin, schema, "spark_batch_plan", params)[0]

    def locked() -> int:
        query = sql.SQL("SELECT count(*) FROM {}.message WHERE is_locked").format(ident)
        return int(admin.execute(query).fetchall()[0][0])

    def row() -> tuple[Any, ...] | None:
        query = "SELECT owner, committed, logged FROM {}.spark_consumer WHERE consumer = 'k'"
        return admin.execute(sql.SQL(query).format(ident)).fetchone()

    # Checkpoint a, as the data source drives it: its first plan finds messages and takes
    # the consumer over; Spark logs batch 1 and reads it, commits it, and a plans batch 2.
    assert plan(0)[:2] == (1, 2)
    claim("a", "take_over", 0)
    claim("a", "read", 0, 1)
    claim("a", "ack", 1)
    claim("a", "plan", 1)
    assert plan(1)[:2] == (2, 2)
    claim("a", "read", 1, 2)  # batch 2 logged and read; a stops before committing it
    assert row() == ("a", 1, 2)
    claim("a", "read", 1, 2)  # a restart of a replays batch 2
    # Another checkpoint's offsets (b at batch 5): refused before they finish a's batch 2.
    for step, batch, end in [("plan", 5, None), ("read", 5, 6), ("ack", 6, None)]:
        with pytest.raises(psycopg.Error, match="consumer k belongs to another streaming query"):
            claim("b", step, batch, end)
    # Copies of a's checkpoint that a has gone past: one that would plan the batch a logged,
    # one that would replay batch 1, one that would acknowledge batch 0.
    for step, batch, end in [("plan", 1, None), ("read", 0, 1), ("ack", 0, None)]:
        with pytest.raises(psycopg.Error, match="the checkpoint of consumer k is behind"):
            claim("a", step, batch, end)
    # A checkpoint from before owners, restarted after a claimed the consumer: refused.
    with pytest.raises(psycopg.Error, match="belongs to another streaming query"):
        claim(None, "plan", 2)
    assert locked() == 2
    assert row() == ("a", 1, 2)
    # A new checkpoint takes the consumer over; its first plan gives a's batch 2 back.
    assert plan(0)[:2] == (1, 2)
    claim("b", "take_over", 0)
    assert row() == ("b", 0, 0)
    assert locked() == 2
    with pytest.raises(psycopg.Error, match="belongs to another streaming query"):
        claim("a", "read", 1, 2)  # a restarted now
    claim("b", "read", 0, 1)
    assert row() == ("b", 0, 1)
    bad_claims: list[tuple[dict[str, Any], str]] = [
        ({"owner": "", "step": "plan", "batch": 0}, "owner must be NULL or 1 to 255"),
        ({"owner": "b", "step": "go", "batch": 0}, "step must be plan, read, ack or take_over"),
        ({"owner": "b", "step": "plan", "batch": -1}, "batch must be between 0"),
        ({"owner": "b", "step": "read", "batch": 1}, "end must be given for a read only"),
        ({"owner": "b", "step": "read", "batch": 3, "end": 2}, "be at least batch"),
        ({"owner": "b", "step": "ack", "batch": 3, "end": 4}, "end must be given for a read"),
        ({"owner": "b", "step": "take_over", "batch": 3}, "take_over needs an owner and batch 0"),
        ({"owner": None, "step": "take_over", "batch": 0}, "take_over needs an owner"),
        ({"consumer": "", "owner": "b", "step": "plan", "batch": 0}, "consumer must be 1 to 255"),
    ]
    for bad, message in bad_claims:
        with pytest.raises(psycopg.Error, match=message):
            _call(admin, schema, "spark_consumer_claim", {"consumer": "k", "end": None, **bad})
    assert row() == ("b", 0, 1)


def test_a_checkpoint_from_before_owners_keeps_its_consumer(queue: Queue, admin: Conn) -> None:
    # Offsets from a checkpoint of an earlier design, which recorded no owner, name none:
    # the first claim records it as such.
    def claim(step: str, batch: int, end: int | None = None) -> None:
        params = {"consumer": "old", "owner": None, "step": step, "batch": batch, "end": end}
        _call(admin, queue.schema, "spark_consumer_claim", params)

    claim("plan", 7)
    claim("read", 7, 8)
    claim("ack", 8)
    with pytest.raises(psycopg.Error, match="is behind the consumer"):
        claim("plan", 7)


def test_a_plan_leaves_schedules_drivers_to_the_workers(queue: Queue, admin: Conn) -> None:
    # A streaming read took a due driver like any message and finished it with its batch:
    # the schedule was gone for good.
    assert queue.schedule("tick", cron="* * * * *", content=b"t", channel="jobs")
    queue.set_clock_offset(120_000)  # the driver is due
    ident = sql.Identifier(queue.schema)
    driver_query = sql.SQL(
        "SELECT id, is_locked, num_attempts FROM {}.message WHERE channel = 'lonnymq.schedules'"
    ).format(ident)
    before = admin.execute(driver_query).fetchall()
    assert [(locked, attempts) for _, locked, attempts in before] == [(False, 0)]
    for max_id in (None, 10**9):  # a running query, and one under Trigger.AvailableNow
        start = 0 if max_id is None else 1
        results = queue.create_many(NewMessage(b"m", channel="c") for _ in range(3))
        created = {r.id for r in results}
        params = {
            "consumer": "k",
            "start": start,
            "limit": 10,
            "lock_ms": 60_000,
            "max_id": max_id,
        }
        batch_no, size, _, _ = _call(admin, queue.schema, "spark_batch_plan", params)[0]
        assert (batch_no, size) == (start + 1, 3)
        planned = admin.execute(
            sql.SQL("SELECT msg_id FROM {}.spark_batch WHERE batch_no = %s").format(ident),
            [batch_no],
        ).fetchall()
        assert {r[0] for r in planned} == created
        assert admin.execute(driver_query).fetchall() == before
        if max_id is not None:
            waiting = {"max_id": max_id, "due_by": queue.now()}
            [(channels, _, _)] = _call(admin, queue.schema, "spark_batch_waiting", waiting)
            assert channels == 0
    assert [s.name for s in queue.schedules()] == ["tick"]


def test_a_write_id_and_a_sink_id_cannot_share_a_name(queue: Queue, admin: Conn) -> None:
    # A batch write records batch 0 of its writeId, a stream its batches under its sinkId:
    # sharing a name, one would find the other's record and enqueue nothing.
    def claim_write(write_id: str) -> None:
        _call(admin, queue.schema, "spark_write_claim", {"write_id": write_id})

    def claim_sink(sink_id: str, query_id: str) -> None:
        _call(admin, queue.schema, "spark_sink_claim", {"sink_id": sink_id, "query_id": query_id})

    claim_write("orders")
    claim_write("orders")  # a rerun of the same batch write
    with pytest.raises(psycopg.Error, match="sinkId orders is the writeId of a batch write"):
        claim_sink("orders", "q1")
    claim_sink("feed", "q1")
    with pytest.raises(psycopg.Error, match="writeId feed is the sinkId of a streaming write"):
        claim_write("feed")
    # A stream that never claims (no sinkId: the query id) still has commit records.
    _call(
        admin,
        queue.schema,
        "spark_write_commit",
        {"sink_id": "q-2", "batch_id": 3, "write_id": "w", "task_tags": []},
    )
    with pytest.raises(psycopg.Error, match="writeId q-2 is the sinkId of a streaming write"):
        claim_write("q-2")
    with pytest.raises(psycopg.Error, match="write_id must be 1 to 255 characters"):
        claim_write("")
    owners = admin.execute(
        sql.SQL("SELECT sink_id, kind, query_id FROM {}.spark_sink ORDER BY 1").format(
            sql.Identifier(queue.schema)
        )
    ).fetchall()
    assert owners == [("feed", "stream", "q1"), ("orders", "write", None)]


def test_public_names_exist_and_are_documented() -> None:
    import lonnymq.spark

    assert lonnymq.spark.__all__
    for name in lonnymq.spark.__all__:
        value = getattr(lonnymq.spark, name)
        assert value.__doc__, f"lonnymq.spark.{name} has no docstring"


def _stage_rows(conn: Conn, schema: str, write_id: str, tag: str, n: int) -> None:
    ident = sql.Identifier(schema)
    with (
        conn.cursor() as cursor,
        cursor.copy(
            sql.SQL(
                "COPY {}.spark_stage (write_id, task_tag, seq, channel, content) FROM STDIN"
            ).format(ident)
        ) as copy,
    ):
        for seq in range(n):
            copy.write_row((write_id, tag, seq, "c", f"{write_id}{seq}".encode()))
    _call(conn, schema, "spark_stage_record", {"write_id": write_id, "task_tag": tag, "n_rows": n})


def _commit_write(conn: Conn, schema: str, write_id: str, tags: list[str]) -> list[Any]:
    params = {"sink_id": write_id, "batch_id": 0, "write_id": write_id, "task_tags": tags}
    return _call(conn, schema, "spark_write_commit", params)


def test_commit_clears_only_its_write_while_others_stage(
    dsn: str, queue: Queue, admin: Conn
) -> None:
    schema = queue.schema
    ident = sql.Identifier(schema)
    _stage_rows(admin, schema, "a", "t", 3)
    _stage_rows(admin, schema, "b", "t", 2)
    # A task of write c is still COPYing (its transaction is open): the commit of a must
    # neither wait for it nor remove its rows.
    with psycopg.connect(dsn) as task:
        _stage_rows(task, schema, "c", "t", 4)
        assert _commit_write(admin, schema, "a", ["t"]) == [(True, 3, 3, 0, 0, [])]
        task.commit()
    counts = admin.execute(
        sql.SQL("SELECT write_id, count(*) FROM {}.spark_stage GROUP BY 1 ORDER BY 1").format(ident)
    ).fetchall()
    assert counts == [("b", 2), ("c", 4)]
    assert _commit_write(admin, schema, "b", ["t"]) == [(True, 2, 2, 0, 0, [])]
    # Alone in staging now (a lost attempt of c included): emptied whole.
    _stage_rows(admin, schema, "c", "lost", 1)
    assert _commit_write(admin, schema, "c", ["t"]) == [(True, 4, 4, 0, 0, [])]
    for table in ("spark_stage", "spark_stage_task"):
        left = admin.execute(
            sql.SQL("SELECT count(*) FROM {}.{}").format(ident, sql.Identifier(table))
        )
        assert left.fetchone() == (0,)
    contents = [m.content for m in queue.dequeue_many(20, lock_ms=1_000)]
    assert contents == [b"a0", b"a1", b"a2", b"b0", b"b1", b"c0", b"c1", b"c2", b"c3"]


def test_commit_refuses_a_bad_staged_row_and_changes_nothing(queue: Queue, admin: Conn) -> None:
    schema = queue.schema
    ident = sql.Identifier(schema)
    _stage_rows(admin, schema, "w", "t", 2)
    admin.execute(
        sql.SQL(
            "INSERT INTO {}.spark_stage (write_id, task_tag, seq, channel, content)"
            " VALUES ('w', 't', 2, repeat('x', 256), 'bad')"
        ).format(ident)
    )
    with pytest.raises(psycopg.Error, match="channel") as raised:
        _commit_write(admin, schema, "w", ["t"])
    assert raised.value.sqlstate == "LQ005"  # an invalid channel name
    for table, left in (("message", 0), ("channel", 0), ("spark_commit", 0), ("spark_stage", 3)):
        found = admin.execute(
            sql.SQL("SELECT count(*) FROM {}.{}").format(ident, sql.Identifier(table))
        ).fetchone()
        assert found == (left,), table


def test_batch_waiting_counts_what_only_a_channel_policy_holds_back(
    queue: Queue, admin: Conn
) -> None:
    queue.channel("slow").set_policy(release_interval_ms=60_000)
    queue.channel("paused").set_policy(max_concurrency=0)
    queue.channel("full").set_policy(max_concurrency=1)
    ids = [queue.create(b"x", channel=c).id for c in ("slow", "slow", "paused", "full", "full")]
    queue.create(b"later", channel="later", dequeue_at=queue.now() + 3_600_000)
    taken = queue.dequeue_many(10, lock_ms=60_000)
    assert sorted(m.channel for m in taken) == ["full", "slow"]
    params = {"max_id": max(i for i in ids if i is not None), "due_by": queue.now()}

    def waiting() -> tuple[int, int | None]:
        [(channels, next_at, now)] = _call(admin, queue.schema, "spark_batch_waiting", params)
        return channels, None if next_at is None else next_at - now

    # slow (its interval ends in about 60 s) and full (its one slot is taken: poll, now); not
    # the paused channel, nor the message due in an hour.
    assert waiting() == (2, 0)
    queue.channel("full").set_policy(max_concurrency=0)
    channels, wait_ms = waiting()
    assert channels == 1
    assert wait_ms is not None
    assert 50_000 < wait_ms <= 60_000
    params["max_id"] = 0  # a horizon before them all
    assert waiting() == (0, None)
    # A later message at the head of the slow channel (created with a priority) is what every
    # plan takes and gives back: waiting for that channel's interval is of no use.
    params["max_id"] = max(i for i in ids if i is not None)
    queue.create(b"urgent", channel="slow", priority=1)
    assert waiting() == (0, None)


def test_batch_waiting_counts_a_policy_free_channel_dequeued_since_the_start(
    queue: Queue, admin: Conn
) -> None:
    """A channel without a policy that a dequeue served since the run's start (its next time
    moved past that start) still counts while its head is due; an idle one (its messages due
    later) does not."""
    for _ in range(3):
        queue.create(b"x", channel="free")
    queue.create(b"later", channel="idle", dequeue_at=queue.now() + 3_600_000)
    params = {"max_id": 10**12, "due_by": queue.now()}
    time.sleep(0.05)
    assert queue.dequeue(lock_ms=60_000) is not None  # next time: now, past due_by
    [(channels, _, _)] = _call(admin, queue.schema, "spark_batch_waiting", params)
    assert channels == 1


def test_an_executor_connection_the_server_ended_is_opened_again(
    dsn: str, queue: Queue, admin: Conn
) -> None:
    """Spark reuses its Python workers across tasks: a connection cached by one task whose
    session the server then ended (a restart, pg_terminate_backend) failed the next task's
    first statement, and in local mode the whole job."""
    from lonnymq.spark._options import Connection

    where = Connection(dsn=dsn, schema=queue.schema)
    first = _db.executor_connection(where)
    pid = first.info.backend_pid
    assert _db.executor_connection(where) is first  # a live one is kept
    admin.execute("SELECT pg_terminate_backend(%s, 10000)", [pid])
    again = _db.executor_connection(where)
    try:
        assert again.info.backend_pid != pid
        assert again.execute("SELECT 1").fetchone() == (1,)
        again.rollback()
        assert not again.autocommit  # callers run transactions
        assert _db.executor_connection(where) is again
    finally:
        again.close()
