"""Bulk enqueue through the Spark batch write against a raw binary COPY, in one run on one
PostgreSQL.

    python benchmarks/spark_write.py [--dsn DSN] [--rows 200000] [--reps 2]

The measurement is ``lonnymq.spark.bench.write_rates`` (the one ``lonnymq bench`` reports):
``df.write.format("lonnymq")`` on ``local[2]`` (tasks COPY into staging, the driver's commit
promotes) against one Python process doing ``COPY … (FORMAT BINARY)`` into a plain table with
the message's shape; both load the same rows (100 channels, ~40-byte contents, no dedup key).
Here it also loads rows that carry a dedup key, staged and with ``mode=direct``. Each figure is
the median of ``--reps`` runs after one warm-up; the schemas are dropped at the end.
"""

from __future__ import annotations

import argparse
import os

from lonnymq.spark import bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get("LONNYMQ_DSN"))
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    if not args.dsn:
        parser.error("--dsn (or LONNYMQ_DSN) is required")
    if (reason := bench.unavailable()) is not None:
        parser.error(reason)
    with bench.session() as spark:
        result = bench.write_rates(spark, args.dsn, args.rows, args.reps, keyed=True)
    rate = result["rows_per_s"]
    print(
        f"median of {args.reps}: lonnymq spark write {rate['spark write']:,.0f} rows/s, raw "
        f"binary COPY {rate['raw copy']:,.0f} rows/s, ratio {result['ratio']:.2f}; the "
        f"driver's commit took {result['commit_seconds']:.2f}s of {result['seconds']:.2f}s"
    )
    print(
        f"with dedup keys: staged {rate['keyed, staged']:,.0f} rows/s, mode=direct "
        f"{rate['keyed, direct']:,.0f} rows/s "
        f"({rate['keyed, direct'] / rate['keyed, staged']:.2f}x)"
    )


if __name__ == "__main__":
    main()
