"""How long each read of the dashboard takes on a big queue, beside the full ``channel_stats``
(what ``lonnymq stats`` reads), in one run on one PostgreSQL.

    python benchmarks/dashboard_reads.py [--dsn DSN] [--messages 1000000] [--channels 100000]
                                         [--schema dashboard_bench] [--reuse]

It installs a queue in ``--schema`` (dropped first unless ``--reuse`` finds it filled),
creates ``--messages`` messages spread over ``--channels`` channels, locks 1,000 of them,
vacuums and analyzes, then times each read (the best of 5 calls, in ms) and prints the rows it
returned. Nothing else should run on the server meanwhile.
"""

from __future__ import annotations

import argparse
import os
import time

import psycopg
from psycopg import sql

from lonnymq import NewMessage, Queue

BATCH = 10_000
LOCKED = 1_000
CALLS = 5


def _fill(dsn: str, schema: str, messages: int, channels: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    with Queue(dsn, schema=schema) as queue:
        queue.install(archive=True)
        started = time.monotonic()
        for first in range(0, messages, BATCH):
            queue.create_many(
                [
                    NewMessage(b"m%d" % n, channel=f"tenant-{n % channels:06d}")
                    for n in range(first, min(first + BATCH, messages))
                ]
            )
        print(f"created {messages:,} messages in {time.monotonic() - started:.0f} s", flush=True)
        queue.dequeue_many(LOCKED, lock_ms=3_600_000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", default=os.environ.get("LONNYMQ_DSN"), required=False)
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--channels", type=int, default=100_000)
    parser.add_argument("--schema", default="dashboard_bench")
    parser.add_argument("--reuse", action="store_true", help="keep a filled schema")
    args = parser.parse_args()
    if not args.dsn:
        parser.error("give --dsn or set LONNYMQ_DSN")
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        have = conn.execute(
            "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = %s AND c.relname = 'message'",
            [args.schema],
        ).fetchone()
    if not (args.reuse and have and have[0]):
        _fill(args.dsn, args.schema, args.messages, args.channels)
    schema = sql.Identifier(args.schema)
    reads = {
        "overview": "SELECT * FROM {}.dashboard_overview()",
        "channels by name, first page": "SELECT * FROM {}.dashboard_channels()",
        "channels by name, page at 90%": (
            "SELECT * FROM {}.dashboard_channels(p_after_name => 'tenant-090000')"
        ),
        "channels by name, descending": "SELECT * FROM {}.dashboard_channels(p_sort => '-name')",
        "channels by next due": "SELECT * FROM {}.dashboard_channels(p_sort => 'due')",
        "channels, search matching one": (
            "SELECT * FROM {}.dashboard_channels(p_search => '099999')"
        ),
        "channels, search matching many": "SELECT * FROM {}.dashboard_channels(p_search => '9')",
        "a channel's waiting messages": (
            "SELECT * FROM {}.dashboard_channel_messages('tenant-000001')"
        ),
        "a channel's locked messages": (
            "SELECT * FROM {}.dashboard_channel_messages('tenant-000001', p_locked => true)"
        ),
        "channel_stats (lonnymq stats), for comparison": "SELECT * FROM {}.channel_stats()",
    }
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        for table in ("message", "channel"):
            conn.execute(sql.SQL("VACUUM ANALYZE {}.{}").format(schema, sql.Identifier(table)))
        print(f"{'read':<48} {'best ms':>9} {'rows':>7}")
        for name, text in reads.items():
            statement = sql.SQL(text).format(schema)  # type: ignore[arg-type]
            best = float("inf")
            rows = 0
            for _ in range(CALLS):
                started = time.perf_counter()
                rows = len(conn.execute(statement).fetchall())
                best = min(best, time.perf_counter() - started)
            print(f"{name:<48} {best * 1000:>9.1f} {rows:>7}", flush=True)


if __name__ == "__main__":
    main()
