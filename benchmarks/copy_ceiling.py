"""The ceiling of any batch write that puts each row into the queue once: binary COPY straight
into ``message`` (its indexes, no staging, no Spark, no channel rows), from one connection and
from two in parallel, against one connection's binary COPY into a plain table.

    python benchmarks/copy_ceiling.py [--dsn DSN] [--rows 200000] [--rounds 3]

Same rows as the Spark section of ``lonnymq bench`` (100 channels, ~40-byte contents), and
its raw COPY (``lonnymq.spark.bench.raw_copy``) as the plain table; the two-connection figure
is the ceiling the bench's Spark section reports (``lonnymq.spark.bench.message_copy``). The
ratio is the plain table's time over the other's: the most a Spark write could reach before
Spark's own time and the channels' bookkeeping are added.
"""

from __future__ import annotations

import argparse
import os

from lonnymq import Queue
from lonnymq.bench import drop_schemas
from lonnymq.spark.bench import message_copy, raw_copy

SCHEMA = "lonnymq_copy_ceiling"


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
            one = message_copy(args.dsn, SCHEMA, args.rows, connections=1)
            two = message_copy(args.dsn, SCHEMA, args.rows, connections=2)
            print(
                f"round {round_no + 1}: plain table {raw:.3f} s; message, 1 connection"
                f" {one:.3f} s ({raw / one:.2f}x), 2 connections {two:.3f} s ({raw / two:.2f}x)"
            )
    finally:
        drop_schemas(args.dsn, SCHEMA)


if __name__ == "__main__":
    main()
