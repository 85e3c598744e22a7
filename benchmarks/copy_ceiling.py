"""The ceiling of any batch write that puts each row into the queue once: binary COPY straight
into ``message`` (its indexes, no staging, no Spark, no channel rows), from one connection and
from two in parallel, against one connection's binary COPY into a plain table.

    python benchmarks/copy_ceiling.py [--dsn DSN] [--rows 200000] [--rounds 3]

Same rows as the Spark section of ``lonnymq bench`` (100 channels, ~40-byte contents). The
ratio is the plain table's time over the other's: the most a Spark write could reach before
Spark's own time and the channels' bookkeeping are added.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import psycopg
from psycopg import sql

from lonnymq import Queue
from lonnymq.bench import drop_schemas

SCHEMA = "lonnymq_copy_ceiling"
CHANNELS = 100


def _copy(dsn: str, table: str, columns: list[str], rows: range, now: int | None) -> None:
    with psycopg.connect(dsn) as conn:
        statement = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT BINARY)").format(
            sql.Identifier(SCHEMA, table), sql.SQL(", ").join(map(sql.Identifier, columns))
        )
        with conn.cursor() as cursor, cursor.copy(statement) as copy:
            copy.set_types(["text", "bytea", "int8", "int8"])
            for i in rows:
                copy.write_row((f"tenant-{i % CHANNELS}", f"payload {i:032d}".encode(), now, now))
        conn.commit()


def _timed(dsn: str, table: str, total: int, parts: int) -> float:
    """Seconds to load ``total`` rows into ``table`` over ``parts`` parallel connections."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("TRUNCATE {}").format(sql.Identifier(SCHEMA, table)))
    if table == "raw":
        columns, now = ["channel", "content", "dequeue_at", "dedup_key"], None
    else:
        columns, now = ["channel", "content", "dequeue_at", "created_at"], int(time.time() * 1000)
    step = total // parts
    threads = [
        threading.Thread(
            target=_copy,
            args=(
                dsn,
                table,
                columns,
                range(k * step, total if k == parts - 1 else (k + 1) * step),
                now,
            ),
        )
        for k in range(parts)
    ]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get("LONNYMQ_DSN"))
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not args.dsn:
        parser.error("--dsn (or LONNYMQ_DSN) is required")
    with Queue(args.dsn, schema=SCHEMA) as queue:
        queue.install()
    try:
        with psycopg.connect(args.dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL(
                    "CREATE TABLE {} (id BIGSERIAL PRIMARY KEY, channel TEXT NOT NULL,"
                    " content BYTEA NOT NULL, dequeue_at BIGINT, dedup_key TEXT)"
                ).format(sql.Identifier(SCHEMA, "raw"))
            )
        for round_no in range(args.rounds):
            raw = _timed(args.dsn, "raw", args.rows, 1)
            one = _timed(args.dsn, "message", args.rows, 1)
            two = _timed(args.dsn, "message", args.rows, 2)
            print(
                f"round {round_no + 1}: plain table {raw:.3f} s; message, 1 connection"
                f" {one:.3f} s ({raw / one:.2f}x), 2 connections {two:.3f} s ({raw / two:.2f}x)"
            )
    finally:
        drop_schemas(args.dsn, SCHEMA)


if __name__ == "__main__":
    main()
