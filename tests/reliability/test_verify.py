"""verify(): clean after real work, and each kind of discrepancy found after corrupting state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from psycopg import sql

from lonnymq import Discrepancy, NewMessage, Queue

LOCK_MS = 60_000
DAY_MS = 86_400_000

Conn = psycopg.Connection[Any]


def run_sql(admin: Conn, schema: str, text: str, params: tuple[Any, ...] = ()) -> None:
    """Run ``text`` with ``{s}`` standing for the quoted schema."""
    admin.execute(sql.SQL(text).format(s=sql.Identifier(schema)), params)


def kinds(found: list[Discrepancy]) -> list[tuple[str, str]]:
    return [(d.channel, d.kind) for d in found]


def test_clean_after_a_mix_of_operations(queue: Queue) -> None:
    assert queue.verify() == []
    limited = queue.channel("limited")
    limited.set_policy(max_concurrency=2, release_interval_ms=0, max_size=5)
    queue.channel("paced").set_policy(release_interval_ms=50)
    for i in range(3):
        queue.create(b"a%d" % i, channel="free-a")
        limited.create(b"l%d" % i)
    queue.create(b"later", channel="free-b", dequeue_at=queue.now() + DAY_MS)
    queue.create(b"dup", channel="free-a", dedup_key="k")
    queue.create(b"dup", channel="free-a", dedup_key="k")
    queue.create_many(
        [
            NewMessage(b"m%d" % i, channel=c)
            for i, c in enumerate(["free-b", "limited", "paced"] * 3)
        ]
    )
    assert queue.verify() == []

    taken = queue.dequeue_many(6, lock_ms=LOCK_MS)
    assert len(taken) == 6
    assert queue.verify() == []
    taken[0].delete()
    taken[1].defer()
    taken[2].defer(dequeue_at=queue.now() + DAY_MS, state=b"s")
    taken[3].heartbeat(lock_ms=LOCK_MS)
    assert queue.verify() == []

    # Policies on and off while messages are in flight.
    queue.channel("free-a").set_policy(max_concurrency=1)
    limited.clear_policy()
    assert queue.verify() == []
    queue.channel("free-a").clear_policy()
    limited.set_policy(max_concurrency=3)
    assert queue.verify() == []

    # Locks that expire are recovered by a later dequeue.
    short = queue.dequeue_many(4, lock_ms=10)
    assert short
    queue.set_clock_offset(1_000)
    recovered = queue.dequeue_many(len(short), lock_ms=LOCK_MS)
    assert {m.id for m in short} <= {m.id for m in recovered}
    assert queue.verify() == []

    # Drain everything that is due; finished channels leave no orphan behind.
    while batch := queue.dequeue_many(10, lock_ms=LOCK_MS):
        for message in batch:
            message.delete()
    # Some of these were finished above or re-taken: delete_many reports those as stale.
    queue.delete_many(recovered + taken[3:])
    assert queue.verify() == []


def test_a_lingering_row_with_a_time_is_not_an_orphan(queue: Queue, admin: Conn) -> None:
    # A dequeue that could not take the channel's advisory lock leaves the row of a drained
    # channel with a time; the dequeue that visits it then deletes it. Only a row with no time
    # (which no dequeue visits) is orphaned.
    run_sql(
        admin,
        queue.schema,
        "INSERT INTO {s}.channel (name, next_dequeue_at) VALUES (%s, 1)",
        ("linger",),
    )
    assert queue.verify() == []
    assert queue.dequeue(lock_ms=LOCK_MS) is None
    assert queue.verify() == []


def _setup_free(queue: Queue) -> None:
    queue.create(b"1", channel="free")
    queue.create(b"2", channel="free")


def _setup_policy(queue: Queue) -> None:
    queue.channel("pol").set_policy(max_concurrency=3, release_interval_ms=1_000)
    queue.create(b"1", channel="pol")
    queue.create(b"2", channel="pol")
    queue.create(b"3", channel="pol")
    assert queue.dequeue(lock_ms=LOCK_MS) is not None


@dataclass(frozen=True)
class Corruption:
    """State set up through the API, one direct SQL change, and what verify must report."""

    setup: Callable[[Queue], None]
    statement: str
    channel: str
    kind: str
    expected: int | None = None
    actual: int | None = None


CORRUPTIONS = {
    "policy-size": Corruption(
        _setup_policy,
        "UPDATE {s}.channel SET current_size = 7 WHERE name = 'pol'",
        "pol",
        "size_mismatch",
        3,
        7,
    ),
    "free-size": Corruption(
        _setup_free,
        "UPDATE {s}.channel SET current_size = 2 WHERE name = 'free'",
        "free",
        "size_mismatch",
        0,
        2,
    ),
    "policy-in-flight": Corruption(
        _setup_policy,
        "UPDATE {s}.channel SET current_concurrency = 0 WHERE name = 'pol'",
        "pol",
        "in_flight_mismatch",
        1,
        0,
    ),
    "free-in-flight": Corruption(
        _setup_free,
        "UPDATE {s}.channel SET current_concurrency = 4 WHERE name = 'free'",
        "free",
        "in_flight_mismatch",
        0,
        4,
    ),
    "free-row-deleted": Corruption(
        _setup_free, "DELETE FROM {s}.channel WHERE name = 'free'", "free", "channel_missing"
    ),
    "policy-row-deleted": Corruption(
        _setup_policy, "DELETE FROM {s}.channel WHERE name = 'pol'", "pol", "channel_missing"
    ),
    "free-unscheduled": Corruption(
        _setup_free,
        "UPDATE {s}.channel SET next_dequeue_at = NULL WHERE name = 'free'",
        "free",
        "head_unscheduled",
    ),
    "policy-unscheduled": Corruption(
        _setup_policy,
        "UPDATE {s}.channel SET next_dequeue_at = NULL WHERE name = 'pol'",
        "pol",
        "head_unscheduled",
    ),
    "free-late": Corruption(
        _setup_free,
        "UPDATE {s}.channel SET next_dequeue_at = next_dequeue_at + 86400000 WHERE name = 'free'",
        "free",
        "head_late",
    ),
    "policy-late": Corruption(
        _setup_policy,
        "UPDATE {s}.channel SET next_dequeue_at = next_dequeue_at + 1001 WHERE name = 'pol'",
        "pol",
        "head_late",
    ),
    "free-head-hidden": Corruption(
        _setup_free,
        "UPDATE {s}.channel SET head_at = 9000000000000000 WHERE name = 'free'",
        "free",
        "head_hidden",
    ),
    "policy-head-hidden": Corruption(
        _setup_policy,
        "UPDATE {s}.channel SET head_at = 9000000000000000 WHERE name = 'pol'",
        "pol",
        "head_hidden",
    ),
    "orphan": Corruption(
        _setup_free, "INSERT INTO {s}.channel (name) VALUES ('ghost')", "ghost", "orphan_channel"
    ),
    "stray-policy": Corruption(
        _setup_free,
        "UPDATE {s}.channel SET max_size = 3 WHERE name = 'free'",
        "free",
        "stray_policy",
    ),
    "locked-without-attempt": Corruption(
        _setup_policy,
        "UPDATE {s}.message SET num_attempts = 0 WHERE is_locked",
        "pol",
        "bad_lock",
        1,
        0,
    ),
}


@pytest.mark.parametrize("case", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
def test_each_corruption_is_reported(queue: Queue, admin: Conn, case: Corruption) -> None:
    case.setup(queue)
    assert queue.verify() == []
    run_sql(admin, queue.schema, case.statement)
    found = queue.verify()
    assert kinds(found) == [(case.channel, case.kind)], found
    if case.expected is not None or case.actual is not None:
        assert (found[0].expected, found[0].actual) == (case.expected, case.actual)
    assert found[0].detail


def test_head_late_reports_the_allowed_time(queue: Queue, admin: Conn) -> None:
    _setup_policy(queue)
    with admin.cursor() as cur:
        cur.execute(
            sql.SQL(
                "SELECT last_dequeue_at, next_dequeue_at FROM {}.channel WHERE name = 'pol'"
            ).format(sql.Identifier(queue.schema))
        )
        row = cur.fetchone()
    assert row is not None
    last, next_at = row
    assert next_at == last + 1_000  # the release interval, then the next head
    run_sql(
        admin,
        queue.schema,
        "UPDATE {s}.channel SET next_dequeue_at = %s WHERE name = 'pol'",
        (next_at + 5,),
    )
    [late] = queue.verify()
    assert (late.kind, late.expected, late.actual) == ("head_late", next_at, next_at + 5)


def test_a_stranded_message_is_actually_stranded(queue: Queue, admin: Conn) -> None:
    # What verify calls channel_missing is real: no dequeue finds the message.
    _setup_free(queue)
    run_sql(admin, queue.schema, "DELETE FROM {s}.channel WHERE name = 'free'")
    assert queue.dequeue(lock_ms=LOCK_MS) is None
    assert kinds(queue.verify()) == [("free", "channel_missing")]


def test_verify_on_a_callers_transaction_sees_its_writes(queue: Queue) -> None:
    with queue.transaction() as conn:
        queue.create(b"x", channel="tx", conn=conn)
        conn.execute(
            sql.SQL("UPDATE {}.channel SET next_dequeue_at = NULL WHERE name = 'tx'").format(
                sql.Identifier(queue.schema)
            )
        )
        assert kinds(queue.verify(conn=conn)) == [("tx", "head_unscheduled")]
        raise psycopg.Rollback()
    assert queue.verify() == []


def _cli(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lonnymq.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "LONNYMQ_DSN": dsn},
        timeout=240,
        check=False,
    )


def test_cli_exit_codes_and_output(dsn: str, queue: Queue, admin: Conn) -> None:
    clean = _cli(dsn, "--schema", queue.schema, "verify")
    assert clean.returncode == 0, clean.stderr
    assert "consistent" in clean.stdout

    _setup_free(queue)
    run_sql(admin, queue.schema, "UPDATE {s}.channel SET current_size = 9 WHERE name = 'free'")
    table = _cli(dsn, "--schema", queue.schema, "verify")
    assert table.returncode == 1, table.stderr
    assert "size_mismatch" in table.stdout
    assert "free" in table.stdout

    as_json = _cli(dsn, "--schema", queue.schema, "verify", "--json")
    assert as_json.returncode == 1, as_json.stderr
    rows = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert [(r["channel"], r["kind"], r["expected"], r["actual"]) for r in rows] == [
        ("free", "size_mismatch", 0, 9)
    ]
