"""The Spark write's driver commit alone (no Spark): 0008's ``spark_write_commit`` (one
``INSERT … SELECT`` per write, with ``RETURNING``, extra scans and a ``DELETE`` of the staged
rows) against the current one, with the staging COPY and a raw binary COPY of the same rows for
scale, in turns in one run on one PostgreSQL.

    python benchmarks/spark_commit.py [--dsn DSN] [--rows 200000] [--reps 2]

Rows are staged as two write tasks stage them (two task tags, interleaved), over 100 channels,
~40-byte contents, no dedup key. 0008's function is created next to the current one (as
``spark_write_commit_0008``, from the shipped migration's text) in each fresh schema. Each
figure is the median of ``--reps`` runs; the schemas are dropped at the end.
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
from lonnymq.bench import drop_schemas
from lonnymq.spark import bench

TAGS = ["p0-a0-t1-00000000", "p1-a0-t2-00000000"]
COMMITS = ("spark_write_commit_0008", "spark_write_commit")


def _stage(conn: psycopg.Connection[Any], schema: str, rows: int) -> float:
    ident = sql.Identifier(schema)
    started = time.perf_counter()
    with (
        conn.cursor() as cursor,
        cursor.copy(
            sql.SQL(
                "COPY {}.spark_stage (write_id, task_tag, seq, channel, content, dequeue_at,"
                " dedup_key) FROM STDIN (FORMAT BINARY)"
            ).format(ident)
        ) as copy,
    ):
        copy.set_types(["text", "text", "int4", "text", "bytea", "int8", "text"])
        for i in range(rows):
            content = f"payload {i:032d}".encode()
            copy.write_row(("w", TAGS[i % 2], i // 2, f"tenant-{i % 100}", content, None, None))
    for tag in TAGS:
        conn.execute(
            sql.SQL("SELECT {}.spark_stage_record('w', %s, %s)").format(ident), [tag, rows // 2]
        )
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
    rows = args.rows - args.rows % 2
    old = function_text("0008_spark_fast_promote.sql", COMMITS[1], COMMITS[0])
    times: dict[str, list[float]] = {"staging COPY": [], "raw COPY": []}
    times |= {name: [] for name in COMMITS}
    schemas: list[str] = []
    try:
        with psycopg.connect(args.dsn) as conn:
            for rep in range(args.reps):
                for name in COMMITS:
                    schema = f"bench_commit_{uuid.uuid4().hex[:8]}"
                    schemas.append(schema)
                    with Queue(args.dsn, schema=schema) as queue:
                        queue.install()
                    ident = sql.Identifier(schema)
                    conn.execute(sql.SQL("SET search_path TO {}").format(ident))
                    conn.execute(old.encode())
                    conn.execute("RESET search_path")
                    conn.commit()
                    times["staging COPY"].append(_stage(conn, schema, rows))
                    started = time.perf_counter()
                    result = conn.execute(
                        sql.SQL("SELECT created FROM {}.{}('s', 0, 'w', %s)").format(
                            ident, sql.Identifier(name)
                        ),
                        [TAGS],
                    ).fetchone()
                    conn.commit()
                    times[name].append(time.perf_counter() - started)
                    assert result == (rows,), result
                times["raw COPY"].append(bench.raw_copy(args.dsn, schemas[-1], rows))
                print(
                    f"run {rep + 1}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()),
                    flush=True,
                )
    finally:
        drop_schemas(args.dsn, *schemas)
    print(
        f"median of {args.reps}, {rows:,} rows: "
        + ", ".join(f"{k} {rows / statistics.median(v):,.0f} rows/s" for k, v in times.items())
    )


if __name__ == "__main__":
    main()
