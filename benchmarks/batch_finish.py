"""A batch finish (``message_delete_many``) before and after 0015, side by side in one run on
one PostgreSQL: the loop of 0002 (one ``message_finish_try`` per id) against the set-based
function of 0015 (as installed: 0018 changed only how it looks up the held messages).

    python benchmarks/batch_finish.py [--dsn DSN] [--batch 100] [--channels 1 100 100000]
                                      [--calls 100] [--rounds 3]

One client. In a fresh schema per channel count, holding 60,000 policy-free messages, each call
locks ``--batch`` messages (``message_dequeue_many``, one transaction) and finishes them (one
transaction) with one function or the other, in alternating rounds of ``--calls`` calls; only
the finish is timed. 0002's function is created next to the current one (as
``message_delete_many_0002``, from the shipped migration's text). The figure per function is
the median over rounds of the mean milliseconds per finish call. The schemas are dropped at the
end.
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
from lonnymq.bench import drop_schemas, fill_backlog

FUNCTIONS = ("message_delete_many_0002", "message_delete_many")
BACKLOG = 60_000


def _round(
    conn: psycopg.Connection[Any], schema: str, function: str, batch: int, calls: int
) -> float:
    ident = sql.Identifier(schema)
    take = sql.SQL("SELECT id, num_attempts FROM {}.message_dequeue_many(%s, 60000)").format(ident)
    finish = sql.SQL("SELECT count(*) FROM {}.{}(%s, %s)").format(ident, sql.Identifier(function))
    spent = 0.0
    for _ in range(calls):
        rows = conn.execute(take, [batch]).fetchall()
        if not rows or rows[0][0] is None:
            raise RuntimeError("the backlog ran out: use fewer --calls or --rounds")
        started = time.perf_counter()
        conn.execute(finish, [[r[0] for r in rows], [r[1] for r in rows]]).fetchall()
        spent += time.perf_counter() - started
    return spent * 1000 / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get("LONNYMQ_DSN"))
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--channels", type=int, nargs="+", default=[1, 100, 100_000])
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not args.dsn:
        parser.error("--dsn (or LONNYMQ_DSN) is required")
    if 2 * args.rounds * args.calls * args.batch > BACKLOG:
        parser.error(f"rounds x calls x batch x 2 must not exceed the backlog of {BACKLOG:,}")
    for channels in args.channels:
        schema = f"lonnymq_bench_finish_{uuid.uuid4().hex[:8]}"
        try:
            with Queue(args.dsn, schema=schema) as queue:
                queue.install()
            with psycopg.connect(args.dsn, autocommit=True) as conn:
                ident = sql.Identifier(schema)
                conn.execute(sql.SQL("SET search_path = {}").format(ident))
                conn.execute(
                    function_text("0002_fast_paths.sql", FUNCTIONS[1], FUNCTIONS[0]).encode()
                )
                fill_backlog(conn, schema, BACKLOG, channels)
                times: dict[str, list[float]] = {f: [] for f in FUNCTIONS}
                for _ in range(args.rounds):
                    for function in FUNCTIONS:
                        times[function].append(
                            _round(conn, schema, function, args.batch, args.calls)
                        )
                old, new = (statistics.median(times[f]) for f in FUNCTIONS)
                print(
                    f"{channels:>7,} channels, batches of {args.batch}: 0002 {old:.2f} ms, "
                    f"now {new:.2f} ms per finish ({old / new:.1f}x); rounds: "
                    + ", ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(*times.values(), strict=True))
                )
        finally:
            drop_schemas(args.dsn, schema)


if __name__ == "__main__":
    main()
