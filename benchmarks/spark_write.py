"""Bulk enqueue through the Spark batch write against a raw binary COPY, in one run on one
PostgreSQL.

    python benchmarks/spark_write.py [--dsn DSN] [--rows 200000] [--reps 2]

The raw side is one Python process doing ``COPY … (FORMAT BINARY)`` into a plain table with
the message's shape (channel, content, dequeue_at, dedup_key; a bigserial primary key only):
the fastest way to put those rows into PostgreSQL, and no queue. The lonnymq side is
``df.write.format("lonnymq")`` on ``local[2]`` (2 partitions): tasks COPY into staging, the
driver's commit enqueues through ``message_create_many`` (channels, indexes, sizes). Both load
the same rows (100 channels, ~40-byte contents, no dedup key). Then, on rows that carry a
dedup key, staged against ``mode=direct`` (tasks enqueue themselves). Each figure is the
median of ``--reps`` runs after one warm-up write; the schemas are dropped at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from typing import TYPE_CHECKING

import psycopg
from psycopg import sql

from lonnymq import Queue

if TYPE_CHECKING:
    from pyspark.sql import DataFrame


def _raw_copy(dsn: str, schema: str, rows: int) -> float:
    with psycopg.connect(dsn) as conn:
        ident = sql.Identifier(schema)
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}.raw").format(ident))
        conn.execute(
            sql.SQL(
                "CREATE TABLE {}.raw (id BIGSERIAL PRIMARY KEY, channel TEXT NOT NULL,"
                " content BYTEA NOT NULL, dequeue_at BIGINT, dedup_key TEXT)"
            ).format(ident)
        )
        conn.commit()
        started = time.perf_counter()
        with (
            conn.cursor() as cursor,
            cursor.copy(
                sql.SQL(
                    "COPY {}.raw (channel, content, dequeue_at, dedup_key)"
                    " FROM STDIN (FORMAT BINARY)"
                ).format(ident)
            ) as copy,
        ):
            copy.set_types(["text", "bytea", "int8", "text"])
            for i in range(rows):
                copy.write_row((f"tenant-{i % 100}", f"payload {i:032d}".encode(), None, None))
        conn.commit()
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get("LONNYMQ_DSN"))
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    if not args.dsn:
        parser.error("--dsn (or LONNYMQ_DSN) is required")

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.memory", "2g")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    frame = spark.range(args.rows, numPartitions=2).select(
        F.concat(F.lit("tenant-"), (F.col("id") % 100).cast("string")).alias("channel"),
        F.concat(F.lit("payload "), F.lpad(F.col("id").cast("string"), 32, "0"))
        .cast("binary")
        .alias("content"),
    )
    frame = frame.cache()
    frame.count()
    keyed = frame.withColumn("dedup_key", F.col("content").cast("string")).cache()
    keyed.count()

    schemas: list[str] = []
    times: dict[str, list[float]] = {"raw": [], "staged": [], "keyed staged": [], "direct": []}

    def write(data: DataFrame, **extra: str) -> float:
        schema = f"bench_spark_{uuid.uuid4().hex[:8]}"
        schemas.append(schema)
        with Queue(args.dsn, schema=schema) as queue:
            queue.install()
        started = time.perf_counter()
        data.write.format("lonnymq").options(dsn=args.dsn, schema=schema, **extra).mode(
            "append"
        ).save()
        seconds = time.perf_counter() - started
        with psycopg.connect(args.dsn) as conn:
            count = conn.execute(
                sql.SQL("SELECT count(*) FROM {}.message").format(sql.Identifier(schema))
            ).fetchone()
        assert count == (args.rows,), count
        return seconds

    try:
        for rep in range(args.reps + 1):
            figures = {
                "staged": write(frame),
                "raw": _raw_copy(args.dsn, schemas[-1], args.rows),
                "keyed staged": write(keyed),
                "direct": write(keyed, mode="direct"),
            }
            label = "warm-up" if rep == 0 else f"run {rep}"
            print(
                label
                + ": "
                + ", ".join(f"{k} {args.rows / v:,.0f} rows/s" for k, v in figures.items())
            )
            if rep > 0:
                for name, seconds in figures.items():
                    times[name].append(seconds)
    finally:
        with psycopg.connect(args.dsn, autocommit=True) as conn:
            for schema in schemas:
                conn.execute(
                    sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
                )
        spark.stop()
    rate = {name: args.rows / statistics.median(seconds) for name, seconds in times.items()}
    print(
        f"median of {args.reps}: lonnymq spark write {rate['staged']:,.0f} rows/s, raw binary "
        f"COPY {rate['raw']:,.0f} rows/s, ratio {rate['staged'] / rate['raw']:.2f}"
    )
    print(
        f"with dedup keys: staged {rate['keyed staged']:,.0f} rows/s, mode=direct "
        f"{rate['direct']:,.0f} rows/s ({rate['direct'] / rate['keyed staged']:.2f}x)"
    )


if __name__ == "__main__":
    main()
