"""The dashboard's failures and schedules reads, and its actions on a waiting message, are
index walks: on an archive of 10^5 rows (1% failed) and 10^4 messages, no statement they run
scans a table whole or sorts it, for the custom plans of the first calls and for generic
plans. Plans are captured with ``auto_explain`` (``log_nested_statements``), as
test_index_probes.py does for the dequeue."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from lonnymq import NewMessage, Queue

sys.path.insert(0, str(Path(__file__).parent))
from lock_helpers import log_plans

ARCHIVED = 100_000
MESSAGES = 10_000
TABLES = {"archive", "message", "channel"}
BAD_NODES = {"Seq Scan", "Bitmap Heap Scan", "Sort", "Incremental Sort"}
INDEXES = {
    "archive": {"archive_failed_ix", "archive_pkey"},
    "message": {"message_pkey", "message_dedup_ux", "message_channel_head_ix"},
    "channel": {"channel_pkey"},
}
CALLS = (
    "SELECT * FROM {s}.dashboard_archive()",
    "SELECT * FROM {s}.dashboard_archive(p_outcome => 'failed', p_before_id => 50000)",
    "SELECT * FROM {s}.dashboard_archive(p_channel => 'c7')",
    "SELECT * FROM {s}.dashboard_archive(p_outcome => 'completed', p_channel => 'c7')",
    "SELECT * FROM {s}.dashboard_schedules()",
    "SELECT * FROM {s}.dashboard_schedules(p_after_name => 'n')",
    "SELECT * FROM {s}.message_expedite((SELECT max(id) FROM {s}.message) - 1)",
    "SELECT * FROM {s}.message_discard((SELECT max(id) FROM {s}.message))",
)


def _nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", ()):
        yield from _nodes(child)


def _problems(query: str, root: dict[str, Any]) -> list[str]:
    problems = []
    for node in _nodes(root):
        kind, relation = node["Node Type"], node.get("Relation Name")
        below = {n["Relation Name"] for n in _nodes(node) if "Relation Name" in n}
        if kind in BAD_NODES and below & TABLES:
            problems.append(f"{kind} on {', '.join(sorted(below))}")
        index = node.get("Index Name")
        if relation in INDEXES and index is not None and index not in INDEXES[relation]:
            problems.append(f"{kind} on {relation} using {index}")
        # The failures are walked in their own index, however large the archive.
        failures = relation == "archive" and "outcome <> 'completed'" in query
        if failures and index != "archive_failed_ix":
            problems.append(f"{kind} on archive using {index}, not archive_failed_ix")
    return [f"{' '.join(query.split())[:120]}: {p}" for p in problems]


def test_the_dashboards_reads_and_actions_walk_indexes(
    dsn: str, queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    schema = sql.Identifier(queue.schema)
    admin.execute(
        sql.SQL(
            "INSERT INTO {}.archive (id, channel, content, num_attempts, outcome, error,"
            " created_at, dequeue_at, finished_at)"
            " SELECT g, 'c' || g %% 100, 'x', 1,"
            " CASE WHEN g %% 100 = 0 THEN 'failed' ELSE 'completed' END, 'boom', g, g, g"
            " FROM generate_series(1, %s) g"
        ).format(schema),
        [ARCHIVED],
    )
    for n in range(20):
        queue.schedule(f"s{n:02d}", cron="0 3 * * *", content=b"x")
    now = queue.now()
    for first in range(0, MESSAGES, 1000):
        queue.create_many(
            [
                NewMessage(b"m", channel=f"c{n % 100}", dequeue_at=now + 3_600_000)
                for n in range(first, first + 1000)
            ]
        )
    for table in TABLES:
        admin.execute(sql.SQL("ANALYZE {}.{}").format(schema, sql.Identifier(table)))

    problems: list[str] = []
    statements = 0

    def on_plan(query: str, plan: dict[str, Any]) -> None:
        nonlocal statements
        if any(n.get("Relation Name") in TABLES for n in _nodes(plan)):
            statements += 1
            problems.extend(_problems(query, plan))

    with psycopg.connect(dsn, autocommit=True) as conn:
        log_plans(conn, on_plan)
        for mode in ("auto", "force_generic_plan"):
            conn.execute(f"SET plan_cache_mode = {mode}")
            for call in CALLS:
                conn.execute(sql.SQL(call).format(s=schema)).fetchall()
    assert statements > len(CALLS)
    assert not problems, "\n".join(problems)
