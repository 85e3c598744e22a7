"""One group-commit call, alone: lonnymq's ``settle`` against the durable floor's statement.

    python benchmarks/settle_call.py [--dsn DSN] [--batch 64] [--calls 400] [--reps 2]

Each call reports ``--batch`` messages held (finished) and takes as many new ones, in one
transaction on one connection, with nothing else running: the durable floor's cycle (the
statement of ``lonnymq.bench_worker``), then ``Queue.settle`` over one channel and over 100
channels, in turns, ``--reps`` times. The backlog is made before the timed calls, so no
producer shares the server. Prints each call's median time and its ratio to the floor's: what
the worker shape's ratio could reach if its handlers and its producer cost nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from lonnymq import NewMessage, Outcome, Queue, bench, bench_worker


def floor_call(dsn: str, raw: str, batch: int, calls: int) -> float:
    """Median seconds of the floor's cycle statement, ``batch`` finished and ``batch`` taken."""
    statement = sql.SQL(
        bench_worker.FLOOR_CYCLE.format(
            r=sql.Identifier(raw).as_string(), now=bench_worker._FLOOR_NOW, lock_ms=60_000
        )
    )
    table = sql.Identifier(raw, "durable_queue")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("TRUNCATE {}").format(table))
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (payload) SELECT '\\x0102030405060708'::bytea "
                "FROM generate_series(1, %s)"
            ).format(table),
            (batch * (calls + 2),),
        )
        conn.execute(sql.SQL("VACUUM ANALYZE {}").format(table))
        held = conn.execute(statement, {"ids": [], "nas": [], "n": batch}).fetchall()
        timings = []
        for _ in range(calls):
            params: dict[str, Any] = {
                "ids": [h[0] for h in held],
                "nas": [h[1] for h in held],
                "n": batch,
            }
            began = time.perf_counter()
            held = conn.execute(statement, params).fetchall()
            timings.append(time.perf_counter() - began)
            assert len(held) == batch
    return statistics.median(timings)


def settle_call(dsn: str, schema: str, channels: int, batch: int, calls: int) -> float:
    """Median seconds of ``Queue.settle``, ``batch`` completed and ``batch`` taken, over
    ``channels`` channels."""
    with Queue(dsn, schema=schema, pool_size=1) as queue:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("TRUNCATE {}, {}").format(
                    sql.Identifier(schema, "message"), sql.Identifier(schema, "channel")
                )
            )
        total = batch * (calls + 2)
        for start in range(0, total, 50_000):
            queue.create_many(
                NewMessage(b"\x01" * 8, channel=f"c{i % channels}")
                for i in range(start, min(total, start + 50_000))
            )
        queue.maintain()
        held = queue.settle([], batch, lock_ms=60_000).messages
        timings = []
        for _ in range(calls):
            outcomes = [Outcome.complete(m) for m in held]
            began = time.perf_counter()
            held = queue.settle(outcomes, batch, lock_ms=60_000).messages
            timings.append(time.perf_counter() - began)
            assert len(held) == batch
    return statistics.median(timings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    run = bench.Bench(args.dsn, bench.PROFILES["default"], Path("."), print)
    try:
        run.reset()
        for rep in range(1, args.reps + 1):
            floor = floor_call(args.dsn, run.raw_schema, args.batch, args.calls)
            print(f"rep {rep}: durable floor {1000 * floor:.2f} ms a call")
            for channels in (1, 100):
                took = settle_call(args.dsn, run.schema, channels, args.batch, args.calls)
                print(
                    f"rep {rep}: settle over {channels:>3} channel(s) {1000 * took:.2f} ms a call, "
                    f"{floor / took:.2f}x the floor's rate"
                )
    finally:
        run.close()


if __name__ == "__main__":
    main()
