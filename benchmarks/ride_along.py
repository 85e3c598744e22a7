"""A batch take riding along on many busy channels: every channel row held by another
transaction, as when other dequeues hold them (step 2b of ``message_dequeue_loop``).

    PYTHONPATH=<checkout>/src python benchmarks/ride_along.py [--dsn DSN] [--channels 100000]
        [--per 2] [--limit 10000] [--calls 2]

Fills a fresh schema (installed by the ``lonnymq`` on the path) with ``--per`` messages in
each of ``--channels`` channels, holds every channel row (``FOR UPDATE``) from a second
connection, and times ``--calls`` takes of ``--limit`` (each rolled back, so every call sees the
same queue). The schema is dropped at the end.
"""

from __future__ import annotations

import argparse
import os
import time

import psycopg
from psycopg import sql

from lonnymq import Queue

SCHEMA = "lonnymq_ride_along"
CHUNK = 10_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", default=os.environ.get("LONNYMQ_DSN"))
    parser.add_argument("--channels", type=int, default=100_000)
    parser.add_argument("--per", type=int, default=2)
    parser.add_argument("--limit", type=int, default=10_000)
    parser.add_argument("--calls", type=int, default=2)
    args = parser.parse_args()
    if not args.dsn:
        parser.error("--dsn (or LONNYMQ_DSN) is required")
    schema = sql.Identifier(SCHEMA)
    with psycopg.connect(args.dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(schema))
    try:
        with Queue(args.dsn, schema=SCHEMA) as queue:
            queue.install()
        with psycopg.connect(args.dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("SET search_path = {}").format(schema))
            step = max(1, CHUNK // args.per)
            for start in range(0, args.channels, step):
                names = [f"c{i}" for i in range(start, min(args.channels, start + step))]
                admin.execute(
                    "SELECT count(*) FROM message_create_many(%s,"
                    " array_fill('\\x00'::bytea, ARRAY[%s]), NULL, NULL)",
                    (names * args.per, len(names) * args.per),
                )
            admin.execute("VACUUM ANALYZE message")
            admin.execute("VACUUM ANALYZE channel")
        with psycopg.connect(args.dsn) as holder, psycopg.connect(args.dsn) as taker:
            holder.execute(
                sql.SQL("SELECT count(*) FROM (SELECT FROM {}.channel FOR UPDATE) AS c").format(
                    schema
                )
            )
            take = sql.SQL("SELECT count(*) FROM {}.message_dequeue_many(%s::int, 60000)").format(
                schema
            )
            for _ in range(args.calls):
                started = time.perf_counter()
                row = taker.execute(take, (args.limit,)).fetchone()
                seconds = time.perf_counter() - started
                taker.rollback()
                print(
                    f"take of {args.limit:,}: {row[0] if row else 0:,} messages in {seconds:.3f} s"
                )
            holder.rollback()
    finally:
        with psycopg.connect(args.dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(schema))


if __name__ == "__main__":
    main()
