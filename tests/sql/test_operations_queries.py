"""The monitoring queries published in docs/operations.md run against a real server and return
the columns the document describes. The page includes them from examples/sql/, read here, so
the text an operator copies is the text tested."""

from __future__ import annotations

import re
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from lonnymq import Queue

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "operations.md"
# Each published query is a file examples/sql/<name>.sql that the page includes; its schema
# is written as my_queue.
INCLUDE = re.compile(r"^--8<--\nexamples/sql/([a-z_]+)\.sql\n--8<--$", re.M)
PLACEHOLDER = "my_queue"

COLUMNS = {
    "xmin_holders": ["holder", "name", "database", "state", "xmin_age", "open_for"],
    "queue_tables": [
        "table_name",
        "live_tuples",
        "dead_tuples",
        "dead_pct",
        "table_size",
        "index_size",
        "last_autovacuum",
        "last_vacuum",
        "autovacuum_count",
    ],
    "queue_depth": ["messages", "locked", "ready", "scheduled", "oldest_ready_s"],
    "channel_depth": [
        "channel",
        "size",
        "in_flight",
        "next_dequeue_at",
        "max_concurrency",
        "release_interval_ms",
        "max_size",
    ],
}


def _queries() -> dict[str, str]:
    names = INCLUDE.findall(DOC.read_text())
    return {n: (ROOT / "examples" / "sql" / f"{n}.sql").read_text() for n in names if n in COLUMNS}


def _run(conn: psycopg.Connection[Any], text: str, schema: str) -> tuple[list[str], list[Any]]:
    assert PLACEHOLDER in text or "my_queue" not in text
    # The schema name is a fresh identifier of ours (t_<hex>), safe to splice as text.
    assert re.fullmatch(r"t_[0-9a-f]{16}", schema)
    cur = conn.execute(text.replace(PLACEHOLDER, schema).encode())
    assert cur.description is not None
    return [c.name for c in cur.description], cur.fetchall()


def test_the_document_publishes_every_tested_query() -> None:
    assert set(_queries()) == set(COLUMNS)
    assert set(INCLUDE.findall(DOC.read_text())) == {*COLUMNS, "timeouts"}


def test_the_timeout_setting_applies_to_the_role(dsn: str) -> None:
    text = (ROOT / "examples" / "sql" / "timeouts.sql").read_text()
    role = f"t_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(role)))
        try:
            conn.execute(text.replace("app_worker", role).encode())
            config = conn.execute(
                "SELECT rolconfig FROM pg_roles WHERE rolname = %s", [role]
            ).fetchone()
            assert config == (["idle_in_transaction_session_timeout=60s"],)
        finally:
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_xmin_holders_lists_an_idle_repeatable_read_transaction(dsn: str) -> None:
    text = _queries()["xmin_holders"]
    with (
        psycopg.connect(dsn, application_name="ops_doc_holder") as holder,
        psycopg.connect(dsn, autocommit=True) as conn,
    ):
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT 1").fetchone()
        pid = holder.info.backend_pid
        # Another transaction commits, so the holder's snapshot is older than the newest.
        conn.execute("SELECT txid_current()")
        columns, rows = _run(conn, text, "t_" + "0" * 16)
        assert columns == COLUMNS["xmin_holders"]
        mine = [r for r in rows if r[0] == "session" and r[1] == str(pid)]
        if not mine:
            # The query shows the oldest ten; ours may be younger than other sessions'.
            assert len(rows) == 10
            return
        row = mine[0]
        assert row[3] == "idle in transaction"
        assert row[4] >= 1
        assert row[5] is not None
        holder.rollback()
        _, rows = _run(conn, text, "t_" + "0" * 16)
        assert all(not (r[0] == "session" and r[1] == str(pid)) for r in rows)
    ages = [r[4] for r in rows]
    assert ages == sorted(ages, reverse=True)


def test_queue_tables_shows_dead_tuples_of_the_queue(dsn: str, schema_name: str) -> None:
    rows: list[Any] = []
    columns: list[str] = []
    with Queue(dsn, schema=schema_name) as queue, psycopg.connect(dsn, autocommit=True) as conn:
        queue.install()
        # Statistics reach the cumulative view asynchronously (and a neighbour on a shared
        # server may reset them): make dead rows and poll, with a generous deadline.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for i in range(20):
                queue.create(b"x", channel=f"c{i % 3}")
            while (message := queue.dequeue(lock_ms=60_000)) is not None:
                message.delete()
            columns, rows = _run(conn, _queries()["queue_tables"], schema_name)
            if any(r[0] == "message" and r[2] > 0 for r in rows):
                break
            conn.execute("SELECT pg_sleep(0.5)")
    assert columns == COLUMNS["queue_tables"]
    by_name = {r[0]: r for r in rows}
    assert {"message", "channel"} <= set(by_name)
    message = by_name["message"]
    assert message[2] > 0  # finished messages (and their lock updates) are dead
    assert 0 < message[3] <= 100
    assert message[4]  # sizes, pretty-printed
    assert message[5]
    dead = [r[2] for r in rows]
    assert dead == sorted(dead, reverse=True)


def test_queue_depth_counts_by_state(dsn: str, schema_name: str) -> None:
    with Queue(dsn, schema=schema_name) as queue:
        queue.install()
        for i in range(5):
            queue.create(b"x", channel=f"c{i}")
        queue.create(b"later", channel="c0", dequeue_at=queue.now() + 3_600_000)
        locked = queue.dequeue(lock_ms=60_000)
        assert locked is not None
        with psycopg.connect(dsn, autocommit=True) as conn:
            columns, rows = _run(conn, _queries()["queue_depth"], schema_name)
            assert columns == COLUMNS["queue_depth"]
            messages, n_locked, ready, scheduled, oldest = rows[0]
            assert (messages, n_locked, ready, scheduled) == (6, 1, 4, 1)
            assert oldest is not None
            assert oldest >= 0
            columns, rows = _run(conn, _queries()["channel_depth"], schema_name)
            assert columns == COLUMNS["channel_depth"]
            sizes = {r[0]: (r[1], r[2]) for r in rows}
            assert sum(s for s, _ in sizes.values()) == 6
            assert sum(f for _, f in sizes.values()) == 1
            assert [r[1] for r in rows] == sorted((r[1] for r in rows), reverse=True)


def test_queue_depth_of_an_empty_queue(dsn: str, schema_name: str) -> None:
    with Queue(dsn, schema=schema_name) as queue:
        queue.install()
    with psycopg.connect(dsn, autocommit=True) as conn:
        _, rows = _run(conn, _queries()["queue_depth"], schema_name)
        assert rows == [(0, 0, 0, 0, None)]
        _, rows = _run(conn, _queries()["channel_depth"], schema_name)
        assert rows == []
