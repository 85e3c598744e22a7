"""The ceiling of any batch write that puts each row into the queue once: binary COPY straight
into ``message`` (its indexes, no staging, no Spark, no channel rows), from one connection and
from two in parallel, against one connection's binary COPY into a plain table.

    python benchmarks/copy_ceiling.py [--dsn DSN] [--rows 200000] [--rounds 3]

Same rows as the Spark section of ``lonnymq bench`` (100 channels, ~40-byte contents), and
its raw COPY (``lonnymq.spark.bench.raw_copy``) as the plain table. The ratio is the plain
table's time over the other's: the most a Spark write could reach before
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
from lonnymq.spark.bench import raw_copy

SCHEMA = "lonnymq_copy_ceiling"
CHANNELS = 100


def _copy(dsn: str, rows: range, now: int) -> None:
    with psycopg.connect(dsn) as conn:
        statement = sql.SQL(
            "COPY {} (channel, content, dequeue_at, created_at) FROM STDIN (FORMAT BINARY)"
        ).format(sql.Identifier(SCHEMA, "message"))
        with conn.cursor() as cursor, cursor.copy(statement) as copy:
            copy.set_types(["text", "bytea", "int8", "int8"])
            for i in rows:
                copy.write_row((f"tenant-{i % CHANNELS}", f"payload {i:032d}".encode(), now, now))
        conn.commit()


def _timed(dsn: str, total: int, parts: int) -> float:
    """Seconds to load ``total`` rows into ``message`` over ``parts`` parallel connections."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("TRUNCATE {}").format(sql.Identifier(SCHEMA, "message")))
    now = int(time.time() * 1000)
    step = total // parts
    threads = [
        threading.Thread(
            target=_copy,
            args=(dsn, range(k * step, total if k == parts - 1 else (k + 1) * step), now),
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
        for round_no in range(args.rounds):
            raw = raw_copy(args.dsn, SCHEMA, args.rows)
            one = _timed(args.dsn, args.rows, 1)
            two = _timed(args.dsn, args.rows, 2)
            print(
                f"round {round_no + 1}: plain table {raw:.3f} s; message, 1 connection"
                f" {one:.3f} s ({raw / one:.2f}x), 2 connections {two:.3f} s ({raw / two:.2f}x)"
            )
    finally:
        drop_schemas(args.dsn, SCHEMA)


if __name__ == "__main__":
    main()
