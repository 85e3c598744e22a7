"""Spark figures for ``lonnymq bench``, side by side in one run on one PostgreSQL:

* the batch write's bulk enqueue rate (``df.write.format("lonnymq")`` on ``local[2]``: tasks
  COPY into staging, the driver's commit promotes) against a raw binary ``COPY`` of the same
  rows into a plain table of the message's shape (a bigserial primary key only): the fastest
  way to put those rows into PostgreSQL, and no queue; and against the *ceiling*, the same
  rows copied straight into the queue's ``message`` table from two connections (its indexes,
  no Spark, no staging, no channel rows), the most any write that puts each row into the
  queue once could reach;
* the streaming read's throughput (messages per second, from a full queue until it is empty)
  per micro-batch size (``maxMessagesPerBatch``), with ``Trigger.AvailableNow`` into the
  ``noop`` sink.

Needs pyspark and Java: ``unavailable`` (``lonnymq.bench.spark_unavailable``) says what is missing.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from .._bench_env import drop_schemas
from .._bench_env import spark_unavailable as unavailable
from ..queue import Queue
from ._session import LOCAL_SPARK_CONF

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = [
    "SparkProfile",
    "message_copy",
    "raw_copy",
    "run",
    "session",
    "unavailable",
    "write_rates",
]

CHANNELS = 100


@dataclass(frozen=True)
class SparkProfile:
    """Rows per write (and its repeats), and the streaming read's backlog and batch sizes."""

    rows: int
    reps: int
    stream_messages: int
    batch_sizes: tuple[int, ...]


PROFILES = {
    "default": SparkProfile(200_000, 2, 100_000, (1_000, 10_000, 50_000)),
    "quick": SparkProfile(5_000, 1, 2_000, (500, 2_000)),
}


@contextmanager
def session(cores: int = 2) -> Iterator[SparkSession]:
    """A local Spark session (``local[cores]``) for the measurements, stopped afterwards."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master(f"local[{cores}]")
        .appName("lonnymq-bench")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.memory", "2g")
        .config("spark.sql.shuffle.partitions", str(cores))
        .config("spark.sql.streaming.forceDeleteTempCheckpointLocation", "true")
        # Every micro-batch's progress is counted (100 are kept by default).
        .config("spark.sql.streaming.numRecentProgressUpdates", "10000")
        .config(map=LOCAL_SPARK_CONF)
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    try:
        yield spark
    finally:
        spark.stop()


def _content(i: int) -> bytes:
    return f"payload {i:032d}".encode()


def raw_copy(dsn: str, schema: str, rows: int) -> float:
    """Seconds to load ``rows`` rows (as the Spark writes load) into a fresh plain table of
    ``schema`` with one binary COPY, commit included."""
    ident = sql.Identifier(schema)
    with psycopg.connect(dsn) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(ident))
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
                copy.write_row((f"tenant-{i % CHANNELS}", _content(i), None, None))
        conn.commit()
        return time.perf_counter() - started


def frames(spark: SparkSession, rows: int) -> tuple[DataFrame, DataFrame]:
    """The rows to load (100 channels, ~40-byte contents), cached: without and with a
    ``dedup_key`` column (the content as text)."""
    from pyspark.sql import functions as F

    frame = spark.range(rows, numPartitions=2).select(
        F.concat(F.lit("tenant-"), (F.col("id") % CHANNELS).cast("string")).alias("channel"),
        F.concat(F.lit("payload "), F.lpad(F.col("id").cast("string"), 32, "0"))
        .cast("binary")
        .alias("content"),
    )
    frame = frame.cache()
    frame.count()
    keyed = frame.withColumn("dedup_key", F.col("content").cast("string")).cache()
    keyed.count()
    return frame, keyed


class _Schemas:
    """Fresh schemas for one measurement each, all dropped at the end."""

    def __init__(self, dsn: str, prefix: str) -> None:
        self.dsn = dsn
        self.prefix = prefix
        self.made: list[str] = []

    def new(self) -> str:
        schema = f"{self.prefix}_{uuid.uuid4().hex[:8]}"
        self.made.append(schema)
        with Queue(self.dsn, schema=schema) as queue:
            queue.install()
        return schema

    def count(self, schema: str) -> int:
        with psycopg.connect(self.dsn) as conn:
            row = conn.execute(
                sql.SQL("SELECT count(*) FROM {}.message").format(sql.Identifier(schema))
            ).fetchone()
        return int(row[0]) if row else 0

    def drop(self) -> None:
        drop_schemas(self.dsn, *self.made)
        self.made.clear()


def _copy_messages(dsn: str, schema: str, rows: range, now: int) -> None:
    with psycopg.connect(dsn) as conn:
        statement = sql.SQL(
            "COPY {} (channel, content, dequeue_at, created_at) FROM STDIN (FORMAT BINARY)"
        ).format(sql.Identifier(schema, "message"))
        with conn.cursor() as cursor, cursor.copy(statement) as copy:
            copy.set_types(["text", "bytea", "int8", "int8"])
            for i in rows:
                copy.write_row((f"tenant-{i % CHANNELS}", _content(i), now, now))
        conn.commit()


def message_copy(dsn: str, schema: str, rows: int, connections: int = 2) -> float:
    """Seconds to load ``rows`` rows (as the Spark writes load) straight into the ``message``
    table of queue ``schema``, emptied first, with one binary COPY on each of ``connections``
    parallel connections (as Spark's tasks would), commits included."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("TRUNCATE {}").format(sql.Identifier(schema, "message")))
    now = int(time.time() * 1000)
    step = rows // connections
    parts = [
        range(k * step, rows if k == connections - 1 else (k + 1) * step)
        for k in range(connections)
    ]
    failures: list[BaseException] = []

    def load(part: range) -> None:
        try:
            _copy_messages(dsn, schema, part, now)
        except BaseException as exc:  # surfaced below, in the caller's thread
            failures.append(exc)

    threads = [threading.Thread(target=load, args=(part,)) for part in parts]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    if failures:
        raise failures[0]
    return seconds


def _timed_write(
    schemas: _Schemas, data: DataFrame, rows: int, commits: list[float], **extra: str
) -> float:
    """Seconds of one write into a fresh schema; appends to ``commits`` the seconds from the
    start of the driver's commit transaction to the end (staged writes only)."""
    schema = schemas.new()
    started = time.perf_counter()
    wall = time.time()
    data.write.format("lonnymq").options(dsn=schemas.dsn, schema=schema, **extra).mode(
        "append"
    ).save()
    seconds = time.perf_counter() - started
    ended = time.time()
    if (found := schemas.count(schema)) != rows:
        raise RuntimeError(f"the Spark write enqueued {found} of {rows} rows")
    with psycopg.connect(schemas.dsn) as conn:
        row = conn.execute(
            sql.SQL("SELECT min(committed_at) FROM {}.spark_commit").format(sql.Identifier(schema))
        ).fetchone()
    if row and row[0] is not None:
        commits.append(min(max(ended - row[0] / 1000, 0.0), ended - wall))
    return seconds


def write_rates(
    spark: SparkSession,
    dsn: str,
    rows: int,
    reps: int,
    *,
    keyed: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Rows per second of the Spark batch write, of a raw binary COPY and of the ceiling (see
    the top of this module), each the median of ``reps`` runs after a warm-up, taken in turns.
    With ``keyed``, also rows that carry a dedup key, staged and with ``mode=direct`` (tasks
    enqueue themselves)."""
    frame, keyed_frame = frames(spark, rows)
    schemas = _Schemas(dsn, "lonnymq_bench_spark")
    times: dict[str, list[float]] = {"spark write": [], "raw copy": [], "ceiling": []}
    commits: list[float] = []
    if keyed:
        times |= {"keyed, staged": [], "keyed, direct": []}
    try:
        for rep in range(reps + 1):
            figures = {
                "spark write": _timed_write(schemas, frame, rows, commits),
                "raw copy": raw_copy(dsn, schemas.made[-1], rows),
                "ceiling": message_copy(dsn, schemas.made[-1], rows),
            }
            if keyed:
                figures["keyed, staged"] = _timed_write(schemas, keyed_frame, rows, [])
                figures["keyed, direct"] = _timed_write(
                    schemas, keyed_frame, rows, [], mode="direct"
                )
            label = "warm-up" if rep == 0 else f"run {rep}"
            shown = ", ".join(f"{k} {rows / v:,.0f} rows/s" for k, v in figures.items())
            commit = f"{commits[-1]:.2f}s" if commits else "?"
            log(f"    {label}: {shown} (commit {commit} of {figures['spark write']:.2f}s)")
            if rep > 0:
                for name, seconds in figures.items():
                    times[name].append(seconds)
            else:
                commits.clear()
            schemas.drop()
    finally:
        schemas.drop()
        frame.unpersist()
        keyed_frame.unpersist()
    rates = {name: rows / statistics.median(seconds) for name, seconds in times.items()}
    return {
        "rows": rows,
        "reps": reps,
        "rows_per_s": rates,
        "ratio": rates["spark write"] / rates["raw copy"],
        "ceiling_ratio": rates["ceiling"] / rates["raw copy"],
        "ratio_to_ceiling": rates["spark write"] / rates["ceiling"],
        # Where a write's time goes: the driver's commit (promotion) and the rest (Spark's
        # job, the tasks' COPY into staging).
        "seconds": statistics.median(times["spark write"]),
        "commit_seconds": statistics.median(commits) if commits else None,
    }


def _fill(dsn: str, schema: str, count: int) -> None:
    chunk = 50_000
    with psycopg.connect(dsn, autocommit=True) as conn:
        for start in range(0, count, chunk):
            n = min(chunk, count - start)
            conn.execute(
                sql.SQL(
                    "SELECT count(*) FROM {}.message_create_many("
                    "ARRAY(SELECT 'tenant-' || (g %% %s::int) "
                    "FROM generate_series(%s::int, %s::int) g), "
                    "ARRAY(SELECT convert_to('payload ' || lpad(g::text, 32, '0'), 'UTF8') "
                    "FROM generate_series(%s::int, %s::int) g), NULL, NULL)"
                ).format(sql.Identifier(schema)),
                (CHANNELS, start, start + n - 1, start, start + n - 1),
            )


def stream_rate(spark: SparkSession, dsn: str, messages: int, batch_size: int) -> dict[str, Any]:
    """Drain a queue of ``messages`` with a streaming read of micro-batches of ``batch_size``
    (``Trigger.AvailableNow``, ``noop`` sink). ``msgs_per_s`` is end to end (query start
    included); ``batch_msgs_per_s`` counts only the micro-batches' own time."""
    schemas = _Schemas(dsn, "lonnymq_bench_stream")
    checkpoint = tempfile.mkdtemp(prefix="lonnymq-bench-cp-")
    try:
        schema = schemas.new()
        _fill(dsn, schema, messages)
        started = time.perf_counter()
        query = (
            spark.readStream.format("lonnymq")
            .options(
                dsn=dsn,
                schema=schema,
                consumer="bench",
                maxMessagesPerBatch=str(batch_size),
                lockMs="300000",
            )
            .load()
            .writeStream.format("noop")
            .option("checkpointLocation", str(Path(checkpoint, "cp")))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()
        seconds = time.perf_counter() - started
        progress = [p for p in query.recentProgress if p["numInputRows"]]
        if (left := schemas.count(schema)) != 0:
            raise RuntimeError(f"the streaming read left {left} of {messages} messages")
        read = sum(int(p["numInputRows"]) for p in progress)
        if read != messages:
            raise RuntimeError(f"the streaming read reported {read} of {messages} messages")
        batch_ms = sum(int(p["durationMs"]["triggerExecution"]) for p in progress)
    finally:
        schemas.drop()
        shutil.rmtree(checkpoint, ignore_errors=True)
    return {
        "max_messages_per_batch": batch_size,
        "messages": messages,
        "batches": len(progress),
        "seconds": seconds,
        "msgs_per_s": messages / seconds,
        "batch_msgs_per_s": messages / (batch_ms / 1000) if batch_ms else 0.0,
    }


def run(dsn: str, profile: str = "default", log: Callable[[str], None] = print) -> dict[str, Any]:
    """The whole Spark section: write rates and one streaming read per batch size."""
    chosen = PROFILES[profile]
    with session() as spark:
        log(f"  batch write, {chosen.rows:,} rows x {chosen.reps} (after a warm-up):")
        write = write_rates(spark, dsn, chosen.rows, chosen.reps, log=log)
        rates = write["rows_per_s"]
        log(
            f"  spark batch write {rates['spark write']:,.0f} rows/s, raw binary COPY "
            f"{rates['raw copy']:,.0f} rows/s: {write['ratio']:.2f}x raw; the ceiling (COPY "
            f"into message) {rates['ceiling']:,.0f} rows/s, {write['ceiling_ratio']:.2f}x raw: "
            f"the write {write['ratio_to_ceiling']:.2f}x the ceiling"
        )
        stream = []
        for size in chosen.batch_sizes:
            row = stream_rate(spark, dsn, chosen.stream_messages, size)
            stream.append(row)
            log(
                f"  streaming read, maxMessagesPerBatch {size:>6,}: {row['msgs_per_s']:>8,.0f} "
                f"msg/s end to end, {row['batch_msgs_per_s']:>8,.0f} msg/s in batches "
                f"({row['batches']} batches, {row['messages']:,} msgs)"
            )
    return {"profile": asdict(chosen), "write": write, "stream": stream}
