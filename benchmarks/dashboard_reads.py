"""How long each read of the dashboard takes on a big queue, beside the full ``channel_stats``
(what ``lonnymq stats`` reads), in one run on one PostgreSQL.

    python benchmarks/dashboard_reads.py [--dsn DSN] [--messages 1000000] [--channels 100000]
                                         [--archived 1000000] [--schema dashboard_bench]
                                         [--reuse]

It installs a queue in ``--schema`` (dropped first unless ``--reuse`` finds it filled),
creates ``--messages`` messages spread over ``--channels`` channels, locks 1,000 of them,
writes ``--archived`` rows straight into the archive (1% of them failed, each with a 2 KB
traceback), declares 100 schedules and has 20 workers report, vacuums and analyzes, then
times each read (the best of 5 calls, in ms) and prints the rows it returned. Nothing else
should run on the server meanwhile.
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
SCHEDULES = 100
WORKERS = 20
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
        for n in range(SCHEDULES):
            queue.schedule(f"nightly-{n:03d}", cron="0 3 * * *", content=b"report")
        for n in range(WORKERS):
            queue._fetch(
                "worker_report",
                {
                    "id": f"worker-{n}",
                    "host": f"host-{n % 4}",
                    "pid": 1000 + n,
                    "every_ms": 10_000,
                    "concurrency": 20,
                    "running": 20,
                    "message_ids": list(range(n * 20, n * 20 + 20)),
                    "channels": [f"tenant-{i:06d}" for i in range(20)],
                    "served_ms": 10_000,
                    "served_channels": [f"tenant-{i:06d}" for i in range(100)],
                    "served_counts": [100] * 100,
                    "served_other": 0,
                },
                None,
            )


def _fill_archive(dsn: str, schema: str, rows: int, channels: int) -> None:
    """``rows`` archived messages written directly (finishing as many through the queue would
    take long and measure nothing more): ids above the live ones, one in 100 failed."""
    started = time.monotonic()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.archive (id, channel, content, num_attempts, outcome, error,"
                " created_at, dequeue_at, locked_at, finished_at)"
                " SELECT 10000000000 + g, 'tenant-' || lpad((g %% %s)::text, 6, '0'), 'done',"
                " 1 + g %% 5, CASE WHEN g %% 100 = 0 THEN 'failed' ELSE 'completed' END,"
                " CASE WHEN g %% 100 = 0 THEN repeat('  File \"handler.py\", line 7' || chr(10),"
                "   64) || 'ValueError: ' || g END,"
                " g, g, g, g + 10 FROM generate_series(1, %s) g"
            ).format(sql.Identifier(schema)),
            [channels, rows],
        )
    print(f"archived {rows:,} messages in {time.monotonic() - started:.0f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", default=os.environ.get("LONNYMQ_DSN"), required=False)
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--channels", type=int, default=100_000)
    parser.add_argument("--archived", type=int, default=1_000_000)
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
        _fill_archive(args.dsn, args.schema, args.archived, args.channels)
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
        "failures, first page": "SELECT * FROM {}.dashboard_archive()",
        "failures, a page at 90%": (
            "SELECT * FROM {}.dashboard_archive(p_before_id => 10000100000)"
        ),
        "failures of one channel (10,000 walked)": (
            "SELECT * FROM {}.dashboard_archive(p_channel => 'tenant-000100')"
        ),
        "completed, first page": "SELECT * FROM {}.dashboard_archive(p_outcome => 'completed')",
        "schedules, first page": "SELECT * FROM {}.dashboard_schedules()",
        "workers": "SELECT * FROM {}.dashboard_workers()",
        "channel_stats (lonnymq stats), for comparison": "SELECT * FROM {}.channel_stats()",
    }
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        for table in ("message", "channel", "archive"):
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
