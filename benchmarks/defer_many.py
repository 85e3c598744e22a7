"""A batch defer before and after 0026, side by side in one run on one PostgreSQL.

    python benchmarks/defer_many.py [--dsn DSN] [--batch 10000] [--rounds 3]

Until 0026, ``message_defer_many`` deferred each message inside a subtransaction of its own
(one transaction id each). One schema holds ``--batch`` messages over 100 channels; the
function as 0001 defined it is installed next to the current one (renamed), and the two take
turns deferring all of them (each call its own transaction, after a dequeue that locks them
all again). Printed per call: milliseconds and transaction ids used (read from
``pg_current_xact_id`` around it). The schema is dropped at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from typing import Any

import psycopg
from _shipped import function_text
from psycopg import sql

from lonnymq import Queue

LOCK_MS = 600_000
OLD = "message_defer_many_0001"


def xid(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()
    assert row is not None
    return int(row[0])


def defer_all(
    conn: psycopg.Connection[Any], schema: str, function: str, batch: int
) -> tuple[float, int]:
    s = sql.Identifier(schema)
    rows = conn.execute(
        sql.SQL("SELECT id, num_attempts FROM {}.message_dequeue_many(%s, %s)").format(s),
        [batch, LOCK_MS],
    ).fetchall()
    conn.commit()
    if len(rows) != batch:
        raise RuntimeError(f"locked {len(rows)} of {batch} messages")
    first = xid(conn)
    conn.commit()
    start = time.perf_counter()
    statuses = conn.execute(
        sql.SQL("SELECT status FROM {}.{}(%s, %s)").format(s, sql.Identifier(function)),
        [[r[0] for r in rows], [r[1] for r in rows]],
    ).fetchall()
    conn.commit()
    elapsed = time.perf_counter() - start
    used = xid(conn) - first - 1
    conn.commit()
    if any(st[0] != "ok" for st in statuses):
        raise RuntimeError("a defer was refused")
    return elapsed * 1000, used


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dsn", default=os.environ.get("LONNYMQ_DSN"))
    parser.add_argument("--batch", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not args.dsn:
        parser.error("--dsn or LONNYMQ_DSN is required")

    schema = f"bench_defer_{uuid.uuid4().hex[:8]}"
    Queue(args.dsn, schema=schema).install()
    with psycopg.connect(args.dsn) as conn:
        try:
            conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
            conn.execute(function_text("0001_init.sql", "message_defer_many", OLD))
            conn.execute(
                "SELECT message_create_many(ARRAY(SELECT 'c' || (i %% 100) "
                "FROM generate_series(1, %s) i), "
                "array_fill('\\x00'::bytea, ARRAY[%s]), NULL, NULL)",
                [args.batch, args.batch],
            )
            conn.commit()
            results: dict[str, list[tuple[float, int]]] = {"0001": [], "0026": []}
            for n in range(args.rounds):
                order = [("0001", OLD), ("0026", "message_defer_many")]
                for label, function in order if n % 2 == 0 else order[::-1]:
                    results[label].append(defer_all(conn, schema, function, args.batch))
            for label, runs in results.items():
                ms = ", ".join(f"{r[0]:,.0f}" for r in runs)
                print(
                    f"{label}: defer {args.batch:,}: {ms} ms (median "
                    f"{statistics.median(r[0] for r in runs):,.0f}), "
                    f"transaction ids per call {max(r[1] for r in runs):,}"
                )
        finally:
            conn.rollback()
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
            conn.commit()


if __name__ == "__main__":
    main()
