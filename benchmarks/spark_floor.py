"""What Spark alone costs a batch write: the same rows written by a Python Arrow data source
that does nothing with them, next to ``df.write.format("lonnymq")`` and a raw binary COPY, in
turns in one run.

    python benchmarks/spark_floor.py [--dsn DSN] [--rows 200000] [--reps 3]

The no-op writer reads every Arrow batch its task gets and returns: the job, the tasks, the
Python workers and the Arrow transfer from the JVM, with no database. No write through a
Python data source can be faster than it. The rows, the ``local[2]`` session and the raw COPY
are those of ``lonnymq.spark.bench``. Each figure is the median of ``--reps`` runs after one
warm-up; the schemas are dropped at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Iterator
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceArrowWriter, WriterCommitMessage

from lonnymq.spark import bench


class _DiscardWriter(DataSourceArrowWriter):
    def write(self, iterator: Iterator[Any]) -> WriterCommitMessage:
        rows = 0
        for batch in iterator:
            rows += batch.num_rows
        return WriterCommitMessage()


class _Discard(DataSource):
    """``format("discard")``: a write that reads its batches and keeps nothing."""

    @classmethod
    def name(cls) -> str:
        return "discard"

    def writer(self, schema: Any, overwrite: bool) -> _DiscardWriter:
        return _DiscardWriter()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get("LONNYMQ_DSN"))
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    if not args.dsn:
        parser.error("--dsn (or LONNYMQ_DSN) is required")
    if (reason := bench.unavailable()) is not None:
        parser.error(reason)
    times: dict[str, list[float]] = {"no-op writer": [], "lonnymq": [], "raw COPY": []}
    with bench.session() as spark:
        spark.dataSource.register(_Discard)
        frame, _ = bench.frames(spark, args.rows)
        schemas = bench._Schemas(args.dsn, "bench_floor")
        try:
            for rep in range(args.reps + 1):
                started = time.perf_counter()
                frame.write.format("discard").mode("append").save()
                times["no-op writer"].append(time.perf_counter() - started)
                times["lonnymq"].append(bench._timed_write(schemas, frame, args.rows, []))
                times["raw COPY"].append(bench.raw_copy(args.dsn, schemas.new(), args.rows))
                label = "warm-up" if rep == 0 else f"run {rep}"
                print(
                    f"{label}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()),
                    flush=True,
                )
        finally:
            schemas.drop()
    median = {k: statistics.median(v[1:]) for k, v in times.items()}
    raw = median["raw COPY"]
    print(
        f"median of {args.reps}, {args.rows:,} rows: "
        + ", ".join(
            f"{k} {v:.2f}s = {args.rows / v:,.0f} rows/s ({raw / v:.2f}x raw)"
            for k, v in median.items()
        )
    )


if __name__ == "__main__":
    main()
