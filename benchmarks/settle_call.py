"""One group-commit call, alone: lonnymq's ``settle`` against the durable floor's statement.

    python benchmarks/settle_call.py [--dsn DSN] [--batch 64] [--calls 400] [--reps 2]
                                     [--parallel 1]

Each call reports ``--batch`` messages held (finished) and takes as many new ones, in one
transaction on one connection, with nothing else running: the durable floor's cycle (the
statement of ``lonnymq.bench_worker``), then ``Queue.settle`` over one channel and over 100
channels, in turns, ``--reps`` times. The backlog is made before the timed calls, so no
producer shares the server. Prints each call's median time and its ratio to the floor's: what
the worker shape's ratio could reach if its handlers and its producer cost nothing.

With ``--parallel N``, N connections run the calls over 100 channels at once (each its own
loop, in a thread of its own), after the same call on one connection: whether the server slows
calls that overlap, and the messages per second of all of them together.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
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


def settle_call(
    dsn: str, schema: str, channels: int, batch: int, calls: int, *, parallel: int = 1
) -> tuple[float, float]:
    """Median seconds of ``Queue.settle``, ``batch`` completed and ``batch`` taken, over
    ``channels`` channels, on ``parallel`` connections at once; and the messages taken per
    second by all of them together."""
    with Queue(dsn, schema=schema, pool_size=parallel) as queue:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("TRUNCATE {}, {}").format(
                    sql.Identifier(schema, "message"), sql.Identifier(schema, "channel")
                )
            )
        total = batch * (calls + 2) * parallel
        for start in range(0, total, 50_000):
            queue.create_many(
                NewMessage(b"\x01" * 8, channel=f"c{i % channels}")
                for i in range(start, min(total, start + 50_000))
            )
        queue.maintain()
        timings: list[float] = []

        def loop() -> None:
            held = queue.settle([], batch, lock_ms=60_000).messages
            for _ in range(calls):
                outcomes = [Outcome.complete(m) for m in held]
                began = time.perf_counter()
                held = queue.settle(outcomes, batch, lock_ms=60_000).messages
                timings.append(time.perf_counter() - began)  # (list.append is atomic)
                assert len(held) == batch

        threads = [threading.Thread(target=loop) for _ in range(parallel)]
        began = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - began
    if len(timings) != calls * parallel:
        raise RuntimeError("a settle loop failed (see its traceback above)")
    return statistics.median(timings), calls * parallel * batch / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", default=os.environ.get("LONNYMQ_DSN"))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--parallel", type=int, default=1)
    args = parser.parse_args()
    if not args.dsn:
        parser.error("--dsn (or LONNYMQ_DSN) is required")
    run = bench.Bench(args.dsn, bench.PROFILES["default"], Path("."), print)
    try:
        run.reset()
        for rep in range(1, args.reps + 1):
            floor = floor_call(args.dsn, run.raw_schema, args.batch, args.calls)
            print(f"rep {rep}: durable floor {1000 * floor:.2f} ms a call")
            for channels in (1, 100):
                took, _ = settle_call(args.dsn, run.schema, channels, args.batch, args.calls)
                print(
                    f"rep {rep}: settle over {channels:>3} channel(s) {1000 * took:.2f} ms a call, "
                    f"{floor / took:.2f}x the floor's rate"
                )
            if args.parallel > 1:
                rates = []
                for parallel in (1, args.parallel):
                    took, rate = settle_call(
                        args.dsn, run.schema, 100, args.batch, args.calls, parallel=parallel
                    )
                    rates.append(rate)
                    print(
                        f"rep {rep}: settle over 100 channels on {parallel} connection(s) at "
                        f"once {1000 * took:.2f} ms a call, {rate:,.0f} msg/s in all"
                    )
                print(f"rep {rep}: {args.parallel} at once: {rates[1] / rates[0]:.2f}x the rate")
    finally:
        run.close()


if __name__ == "__main__":
    main()
