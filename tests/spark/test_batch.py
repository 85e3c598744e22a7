"""Batch write and batch read through a real local Spark session."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import psycopg
import pytest
from psycopg import sql
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from lonnymq import Queue
from lonnymq.spark import LonnyMQDataSource, register, snapshot, write_result

Conn = psycopg.Connection[Any]


def _count(admin: Conn, schema: str, table: str) -> int:
    row = admin.execute(
        sql.SQL("SELECT count(*) FROM {}.{}").format(sql.Identifier(schema), sql.Identifier(table))
    ).fetchone()
    assert row is not None
    return int(row[0])


def _frame(spark: SparkSession, n: int, partitions: int = 4) -> Any:
    return spark.range(n, numPartitions=partitions).select(
        F.concat(F.lit("tenant-"), (F.col("id") % 5).cast("string")).alias("channel"),
        F.concat(F.lit("payload-"), F.col("id").cast("string")).cast("binary").alias("content"),
        F.col("id").cast("string").alias("dedup_key"),
    )


def test_write_enqueues_every_row_once(
    spark: SparkSession, queue: Queue, admin: Conn, options: dict[str, Any]
) -> None:
    _frame(spark, 2_000).write.format("lonnymq").options(**options).mode("append").save()
    stats = {s.channel: s.size for s in queue.stats()}
    assert stats == {f"tenant-{i}": 400 for i in range(5)}
    contents = admin.execute(
        sql.SQL("SELECT content FROM {}.message").format(sql.Identifier(queue.schema))
    ).fetchall()
    assert sorted(bytes(c[0]) for c in contents) == sorted(
        f"payload-{i}".encode() for i in range(2_000)
    )
    assert _count(admin, queue.schema, "spark_stage") == 0
    assert _count(admin, queue.schema, "spark_stage_task") == 0


def test_a_task_that_fails_after_staging_is_retried_and_counted_once(
    spark: SparkSession, queue: Queue, admin: Conn, options: dict[str, Any]
) -> None:
    # Partition 1's first attempt stages its rows, then fails; Spark retries it. Without
    # staging, the failed attempt's rows would be enqueued as well (5,000 duplicates).
    frame = spark.range(20_000, numPartitions=4).select(
        F.lit("c").alias("channel"), F.col("id").cast("string").alias("content")
    )
    context = spark.sparkContext
    context.setJobGroup("failing-write", "a write whose task fails once")
    try:
        (
            frame.write.format("lonnymq")
            .options(**options, _testFailAfterWrite="1", writeId="job-1")
            .mode("append")
            .save()
        )
    finally:
        context.setLocalProperty("spark.jobGroup.id", None)  # type: ignore[arg-type]
    tracker = context.statusTracker()
    failed = 0
    for job_id in tracker.getJobIdsForGroup("failing-write"):
        job = tracker.getJobInfo(job_id)
        assert job is not None
        for stage_id in job.stageIds:
            stage = tracker.getStageInfo(stage_id)
            failed += stage.numFailedTasks if stage is not None else 0
    assert failed == 1  # the injected failure happened, and was retried
    rows = admin.execute(
        sql.SQL("SELECT convert_from(content, 'UTF8') FROM {}.message").format(
            sql.Identifier(queue.schema)
        )
    ).fetchall()
    assert len(rows) == 20_000
    assert sorted(int(r[0]) for r in rows) == list(range(20_000))
    assert _count(admin, queue.schema, "spark_stage") == 0
    result = write_result("job-1", dsn=options["dsn"], schema=queue.schema)
    assert result is not None
    assert (result.created, result.deduplicated, result.dropped) == (20_000, 0, 0)


def test_a_rerun_with_dedup_keys_creates_nothing_new(
    spark: SparkSession, queue: Queue, admin: Conn, options: dict[str, Any]
) -> None:
    frame = _frame(spark, 1_000)
    for _ in range(2):
        frame.write.format("lonnymq").options(**options).mode("append").save()
    assert _count(admin, queue.schema, "message") == 1_000


def test_a_rerun_with_the_same_write_id_enqueues_nothing(
    spark: SparkSession, queue: Queue, admin: Conn, options: dict[str, Any]
) -> None:
    # Even after the first run's messages were consumed (dedup keys no longer live).
    frame = spark.range(100).select(F.col("id").cast("string").alias("content"))
    frame.write.format("lonnymq").options(**options, writeId="nightly").mode("append").save()
    queue.delete_many(queue.dequeue_many(1_000, lock_ms=60_000))
    frame.write.format("lonnymq").options(**options, writeId="nightly").mode("append").save()
    assert _count(admin, queue.schema, "message") == 0


def test_columns_are_matched_ignoring_case_when_named_and_refused_when_not(
    spark: SparkSession, queue: Queue, admin: Conn, options: dict[str, Any]
) -> None:
    """``dedupKeyColumn="dedup_key"`` naming a ``Dedup_Key`` column failed, and left to the
    defaults it was dropped: every row went to ``default`` without a dedup key, and a re-run
    enqueued everything again. Such a column is now refused unless named; with JSON content
    it stays a field of the content."""
    frame = spark.createDataFrame(
        [("a", "x", "k1"), ("b", "y", "k2"), ("a", "z", "k3")],
        "Channel string, CONTENT string, Dedup_Key string",
    )
    with pytest.raises(Exception, match="column 'Channel', which differs from lonnymq's default"):
        frame.write.format("lonnymq").options(**options).mode("append").save()
    named = {"channelColumn": "channel", "contentColumn": "content", "dedupKeyColumn": "DEDUP_KEY"}
    for _ in range(2):
        frame.write.format("lonnymq").options(**options, **named).mode("append").save()
    rows = admin.execute(
        sql.SQL("SELECT channel, dedup_key, content FROM {}.message ORDER BY dedup_key").format(
            sql.Identifier(queue.schema)
        )
    ).fetchall()
    assert [(r[0], r[1], bytes(r[2])) for r in rows] == [
        ("a", "k1", b"x"),
        ("b", "k2", b"y"),
        ("a", "k3", b"z"),
    ]
    twins = spark.createDataFrame(
        [("a", "b", "w")], "Channel string, CHANNEL string, content string"
    )
    with pytest.raises(Exception, match="'channelColumn': column 'channel' is ambiguous"):
        twins.write.format("lonnymq").options(**options, channelColumn="channel").mode(
            "append"
        ).save()
    spark.createDataFrame([(7, "c")], "order_id int, Channel string").write.format(
        "lonnymq"
    ).options(**options, contentFormat="json").mode("append").save()
    row = admin.execute(
        sql.SQL("SELECT channel, content FROM {}.message WHERE dedup_key IS NULL").format(
            sql.Identifier(queue.schema)
        )
    ).fetchone()
    assert row is not None
    assert (row[0], bytes(row[1])) == ("default", b'{"order_id":7,"Channel":"c"}')


def test_mapping_options_json_content_and_timestamps(
    spark: SparkSession, queue: Queue, admin: Conn, options: dict[str, Any]
) -> None:
    frame = spark.createDataFrame(
        [("a", 1, "x", 5_000), ("b", 2, "y", 6_000)], "tenant string, n int, word string, at long"
    )
    (
        frame.write.format("lonnymq")
        .options(**options, channelColumn="tenant", dequeueAtColumn="at", contentFormat="json")
        .mode("append")
        .save()
    )
    rows = admin.execute(
        sql.SQL("SELECT channel, content, dequeue_at FROM {}.message ORDER BY channel").format(
            sql.Identifier(queue.schema)
        )
    ).fetchall()
    assert [(r[0], bytes(r[1]), r[2]) for r in rows] == [
        ("a", b'{"n":1,"word":"x"}', 5_000),
        ("b", b'{"n":2,"word":"y"}', 6_000),
    ]


def test_full_channels_fail_the_job_or_are_counted(
    spark: SparkSession, queue: Queue, admin: Conn, options: dict[str, Any]
) -> None:
    queue.channel("small").set_policy(max_size=3)
    frame = spark.range(10, numPartitions=2).select(
        F.lit("small").alias("channel"), F.col("id").cast("string").alias("content")
    )
    with pytest.raises(Exception, match=r"refused by channels at their max_size \(small\)"):
        frame.write.format("lonnymq").options(**options).mode("append").save()
    assert _count(admin, queue.schema, "message") == 0  # all or nothing
    assert _count(admin, queue.schema, "spark_stage") == 0  # aborted: staging cleared
    (
        frame.write.format("lonnymq")
        .options(**options, onFull="count", writeId="w")
        .mode("append")
        .save()
    )
    result = write_result("w", dsn=options["dsn"], schema=queue.schema)
    assert result is not None
    assert (result.created, result.dropped) == (3, 7)
    assert _count(admin, queue.schema, "message") == 3


def test_read_equals_the_table(
    spark: SparkSession, queue: Queue, admin: Conn, options: dict[str, Any]
) -> None:
    _frame(spark, 3_000).write.format("lonnymq").options(**options).mode("append").save()
    queue.dequeue_many(10, lock_ms=60_000)
    frame = spark.read.format("lonnymq").options(**options, numPartitions="3").load()
    assert frame.rdd.getNumPartitions() == 3
    rows = frame.collect()
    table = admin.execute(
        sql.SQL(
            "SELECT id, channel, content, num_attempts, is_locked, dedup_key FROM {}.message"
        ).format(sql.Identifier(queue.schema))
    ).fetchall()
    assert sorted((r.id, r.channel, bytes(r.content), r.num_attempts, r.is_locked, r.dedup_key)
                  for r in rows) == sorted(
        (t[0], t[1], bytes(t[2]), t[3], t[4], t[5]) for t in table
    )  # fmt: skip
    assert sum(r.is_locked for r in rows) == 10


def test_snapshot_read_ignores_later_changes(
    spark: SparkSession, queue: Queue, admin: Conn, options: dict[str, Any]
) -> None:
    _frame(spark, 1_000).write.format("lonnymq").options(**options).mode("append").save()
    with snapshot(options["dsn"]) as snap:
        queue.delete_many(queue.dequeue_many(100, lock_ms=60_000))
        spark.range(500).select(F.col("id").cast("string").alias("content")).write.format(
            "lonnymq"
        ).options(**options).mode("append").save()
        seen = spark.read.format("lonnymq").options(**options, snapshot=snap).load()
        assert seen.count() == 1_000
        assert seen.filter("is_locked").count() == 0
    assert spark.read.format("lonnymq").options(**options).load().count() == 1_400


def test_read_the_archive(spark: SparkSession, make_queue: Any, options: dict[str, Any]) -> None:
    queue = make_queue(archive=True)
    for i in range(30):
        queue.create(f"m{i}".encode(), channel=f"c{i % 3}")
    done = queue.dequeue_many(30, lock_ms=60_000)
    queue.delete_many(done[:20])
    for message in done[20:]:
        message.fail(error="boom")
    frame = spark.read.format("lonnymq").options(**options, table="archive").load()
    assert set(frame.columns) >= {"outcome", "error", "finished_at", "locked_at", "created_at"}
    outcomes = Counter(r.outcome for r in frame.collect())
    assert outcomes == {"completed": 20, "failed": 10}
    by_channel = {r.channel: r["count"] for r in frame.groupBy("channel").count().collect()}
    assert by_channel == {"c0": 10, "c1": 10, "c2": 10}


def test_the_format_is_registered_without_asking(spark: SparkSession) -> None:
    # The pyspark_lonnymq module makes format("lonnymq") known to every session; register()
    # does the same explicitly.
    from pyspark_lonnymq import DefaultSource

    assert DefaultSource is LonnyMQDataSource
    assert DefaultSource.name() == "lonnymq"
    register(spark)


def test_direct_mode_needs_dedup_keys_and_enqueues_once(
    spark: SparkSession, queue: Queue, admin: Conn, options: dict[str, Any]
) -> None:
    frame = _frame(spark, 4_000)
    with pytest.raises(Exception, match="mode=direct needs a dedup key"):
        frame.drop("dedup_key").write.format("lonnymq").options(**options, mode="direct").mode(
            "append"
        ).save()
    # A task that fails after enqueuing is retried: its rows' dedup keys absorb the replay.
    (
        frame.write.format("lonnymq")
        .options(**options, mode="direct", _testFailAfterWrite="2")
        .mode("append")
        .save()
    )
    assert _count(admin, queue.schema, "message") == 4_000
    assert _count(admin, queue.schema, "spark_stage") == 0


def test_direct_mode_refuses_null_dedup_keys(
    spark: SparkSession, queue: Queue, admin: Conn, options: dict[str, Any]
) -> None:
    # One partition of 100 rows: one Arrow batch, one chunk, refused before any row of it is
    # enqueued. A retried task used to enqueue its null-key rows again.
    frame = spark.range(100, numPartitions=1).select(
        F.col("id").cast("string").alias("content"),
        F.when(F.col("id") % 2 == 0, F.col("id").cast("string")).alias("dedup_key"),
    )
    with pytest.raises(
        Exception,
        match=r"column 'dedup_key' \(the dedup key\) has 50 null value\(s\): with mode=direct "
        r"every row needs a dedup key",
    ):
        (
            frame.write.format("lonnymq")
            .options(**options, mode="direct", _testFailAfterWrite="0")
            .mode("append")
            .save()
        )
    assert _count(admin, queue.schema, "message") == 0


@pytest.mark.parametrize("mode", ["staged", "direct"])
def test_microsecond_timestamps_are_floored_to_ms(
    spark: SparkSession, queue: Queue, admin: Conn, options: dict[str, Any], mode: str
) -> None:
    # Spark's timestamps are microseconds; every task failed on their sub-millisecond digits.
    micros = [1_767_323_045_678_901, 1_767_323_045_678_000, 999, -1, -1_500]
    floored = [1_767_323_045_678, 1_767_323_045_678, 0, -1, -2]
    now = len(micros)  # the row whose dequeue_at is current_timestamp()
    frame = spark.createDataFrame(list(enumerate([*micros, 0])), "id long, us long").select(
        F.col("id").cast("string").alias("content"),
        F.col("id").cast("string").alias("dedup_key"),
        F.when(F.col("id") == now, F.current_timestamp())
        .otherwise(F.timestamp_micros("us"))
        .alias("dequeue_at"),
    )
    before = time.time_ns() // 1_000_000
    frame.write.format("lonnymq").options(**options, mode=mode).mode("append").save()
    after = time.time_ns() // 1_000_000
    rows = admin.execute(
        sql.SQL("SELECT content, dequeue_at FROM {}.message").format(sql.Identifier(queue.schema))
    ).fetchall()
    stored = {int(bytes(r[0])): r[1] for r in rows}
    assert [stored[i] for i in range(now)] == floored
    assert before <= stored[now] <= after
