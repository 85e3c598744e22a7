"""Streaming read and streaming write through real Spark streaming queries."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from psycopg import sql
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import StringType, StructField, StructType

from lonnymq import NewMessage, Queue
from lonnymq.spark import _write, purge_staging
from lonnymq.spark._source import LonnyMQDataSource

Conn = psycopg.Connection[Any]
CHILD = Path(__file__).with_name("stream_child.py")


def _fill(queue: Queue, n: int, channels: int = 4) -> set[int]:
    ids: set[int] = set()
    for start in range(0, n, 1_000):
        results = queue.create_many(
            NewMessage(f"m{i}".encode(), channel=f"c{i % channels}")
            for i in range(start, min(n, start + 1_000))
        )
        ids.update(r.id for r in results if r.id is not None)
    assert len(ids) == n
    return ids


def _ids(admin: Conn, schema: str, query: str) -> list[int]:
    rows = admin.execute(sql.SQL(query).format(schema=sql.Identifier(schema))).fetchall()
    return [int(r[0]) for r in rows]


@pytest.mark.slow
def test_stream_read_drains_and_deletes_only_after_commit(
    spark: SparkSession, queue: Queue, admin: Conn, options: dict[str, Any], tmp_path: Path
) -> None:
    created = _fill(queue, 2_000)
    delivered: list[int] = []
    problems: list[str] = []

    def sink(batch: DataFrame, batch_id: int) -> None:
        ids = [r.id for r in batch.select("id").collect()]
        delivered.extend(ids)
        # While Spark processes a batch, its messages are still in the queue, locked.
        live = set(_ids(admin, queue.schema, "SELECT id FROM {schema}.message WHERE is_locked"))
        if not set(ids) <= live:
            problems.append(f"batch {batch_id}: {len(set(ids) - live)} not locked in the queue")

    query = (
        spark.readStream.format("lonnymq")
        .options(**options, consumer="drain", maxMessagesPerBatch="500", lockMs="30000")
        .load()
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(tmp_path / "cp"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(timeout=180)
    assert not query.isActive
    assert problems == []
    assert set(delivered) == created
    assert len(delivered) == len(created)  # no failure, so no redelivery
    # The last batch was finished by the run's final planning: nothing is left behind.
    assert _ids(admin, queue.schema, "SELECT id FROM {schema}.message") == []
    assert _ids(admin, queue.schema, "SELECT msg_id FROM {schema}.spark_batch") == []


@pytest.mark.slow
def test_two_queries_cannot_share_a_consumer(
    spark: SparkSession, queue: Queue, options: dict[str, Any], tmp_path: Path
) -> None:
    _fill(queue, 10)

    def start(name: str) -> Any:
        return (
            spark.readStream.format("lonnymq")
            .options(**options, consumer="shared")
            .load()
            .writeStream.format("noop")
            .option("checkpointLocation", str(tmp_path / name))
            .trigger(processingTime="500 milliseconds")
            .start()
        )

    first = start("a")
    try:
        deadline = time.monotonic() + 120
        while first.lastProgress is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert first.isActive
        second = start("b")
        with pytest.raises(StreamingQueryException, match="consumer 'shared' is in use"):
            second.awaitTermination(timeout=120)
        assert first.isActive
    finally:
        first.stop()


def _json_contents(admin: Conn, schema: str) -> list[dict[str, Any]]:
    rows = admin.execute(
        sql.SQL("SELECT convert_from(content, 'UTF8') FROM {}.message").format(
            sql.Identifier(schema)
        )
    ).fetchall()
    return [json.loads(r[0]) for r in rows]


def _run_child(dsn: str, source: str, target: str, checkpoint: Path, mode: str) -> Any:
    return subprocess.Popen(
        [sys.executable, str(CHILD), dsn, source, target, str(checkpoint), mode],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc: PySpark's daemon leaves the process group)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_tree(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the child, its JVM and its Python workers, all at once."""
    for pid in [process.pid, *_descendants(process.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.wait(timeout=30)


@pytest.mark.slow
def test_a_killed_pipeline_restarts_from_its_checkpoint_with_nothing_lost_or_doubled(
    dsn: str, make_queue: Any, other_schema: str, admin: Conn, tmp_path: Path
) -> None:
    # lonnymq -> Spark -> lonnymq, SIGKILLed mid-stream, then restarted on its checkpoint and
    # run until the source is drained. The source is at-least-once (the killed run's last
    # planned batch is replayed); the sink is exactly once per micro-batch, so the target gets
    # each source message exactly once.
    source = make_queue()
    target = make_queue(schema=other_schema)
    created = _fill(source, 1_000)
    checkpoint = tmp_path / "cp"

    child = _run_child(dsn, source.schema, target.schema, checkpoint, "run")
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and child.poll() is None:
            committed = _ids(admin, target.schema, "SELECT batch_id FROM {schema}.spark_commit")
            if len(committed) >= 2:
                break
            time.sleep(0.2)
        assert child.poll() is None, child.stderr.read().decode()[-3000:] if child.stderr else ""
        assert len(committed) >= 2, "the pipeline did not get going"
        time.sleep(random.uniform(0.0, 0.5))  # somewhere inside a micro-batch
    finally:
        _kill_tree(child)
    at_kill = len(_json_contents(admin, target.schema))
    assert 0 < at_kill < len(created)
    planned = _ids(admin, source.schema, "SELECT DISTINCT batch_no FROM {schema}.spark_batch")
    assert planned, "the killed run left its last planned batch behind"

    child = _run_child(dsn, source.schema, target.schema, checkpoint, "drain")
    try:
        _, err = child.communicate(timeout=300)
    finally:
        if child.poll() is None:
            _kill_tree(child)
    assert child.returncode == 0, err.decode()[-3000:]

    origins = [int(c["origin"]) for c in _json_contents(admin, target.schema)]
    assert len(origins) == len(set(origins)), "the sink enqueued a message twice"
    assert set(origins) == created, "a message was lost"
    assert _ids(admin, source.schema, "SELECT id FROM {schema}.message") == []
    assert _ids(admin, source.schema, "SELECT msg_id FROM {schema}.spark_batch") == []
    # A task of the killed run may have staged rows that its dead driver never committed nor
    # aborted: nothing ever promotes them (the promoted counts above prove it), and the
    # janitor removes them.
    purge_staging(older_than_ms=0, dsn=dsn, schema=target.schema)
    assert _ids(admin, target.schema, "SELECT seq FROM {schema}.spark_stage") == []


@pytest.mark.slow
def test_a_replayed_micro_batch_is_not_enqueued_twice(
    spark: SparkSession, queue: Queue, admin: Conn, options: dict[str, Any], tmp_path: Path
) -> None:
    # Spark replays a batch whose offsets it logged but whose commit it did not: remove the
    # last commit-log entry, as a crash after the sink committed would leave it.
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    for part in range(3):
        lines = [json.dumps({"channel": f"c{part}", "content": f"{part}-{i}"}) for i in range(50)]
        (inbox / f"part-{part}.json").write_text("\n".join(lines) + "\n")
    checkpoint = tmp_path / "cp"

    def run(at: Path = checkpoint) -> None:
        (
            spark.readStream.schema("channel string, content string")
            .option("maxFilesPerTrigger", 1)
            .json(str(inbox))
            .writeStream.format("lonnymq")
            .options(**options, sinkId="files")
            .option("checkpointLocation", str(at))
            .trigger(availableNow=True)
            .start()
            .awaitTermination(timeout=180)
        )

    run()
    assert len(_ids(admin, queue.schema, "SELECT id FROM {schema}.message")) == 150
    commits = sorted((checkpoint / "commits").glob("[0-9]*"), key=lambda p: int(p.name))
    assert [int(p.name) for p in commits] == [0, 1, 2]
    commits[-1].unlink()
    commits[-1].with_name(".2.crc").unlink(missing_ok=True)  # Hadoop's checksum of it
    run()  # replays batch 2 with the same batch id
    assert len(_ids(admin, queue.schema, "SELECT id FROM {schema}.message")) == 150
    batches = _ids(admin, queue.schema, "SELECT batch_id FROM {schema}.spark_commit ORDER BY 1")
    assert batches == [0, 1, 2]
    assert (checkpoint / "commits" / "2").exists()
    # A new checkpoint is a new query, numbering its batches from 0 again: with the same
    # sinkId it would find batches 0-2 recorded and skip them. It is refused instead.
    with pytest.raises(StreamingQueryException, match="sinkId files is written by another"):
        run(tmp_path / "new-cp")
    assert len(_ids(admin, queue.schema, "SELECT id FROM {schema}.message")) == 150
    assert _ids(admin, queue.schema, "SELECT count(*) FROM {schema}.spark_stage") == [0]


@pytest.mark.slow
def test_a_write_id_and_a_sink_id_of_the_same_name_fail_before_enqueuing(
    spark: SparkSession, queue: Queue, admin: Conn, options: dict[str, Any], tmp_path: Path
) -> None:
    # Both record their commits under their name: a stream named like an earlier batch write
    # found its batch 0 recorded and enqueued nothing, and a batch write named like a stream's
    # sink was dropped, both without an error.
    def stream(sink_id: str, channel: str) -> None:
        inbox = tmp_path / f"inbox-{sink_id}"
        inbox.mkdir()
        lines = [json.dumps({"channel": channel, "content": f"m{i}"}) for i in range(10)]
        (inbox / "part-0.json").write_text("\n".join(lines) + "\n")
        (
            spark.readStream.schema("channel string, content string")
            .json(str(inbox))
            .writeStream.format("lonnymq")
            .options(**options, sinkId=sink_id)
            .option("checkpointLocation", str(tmp_path / f"cp-{sink_id}"))
            .trigger(availableNow=True)
            .start()
            .awaitTermination(timeout=180)
        )

    def batch(write_id: str, channel: str) -> None:
        frame = spark.range(5).select(
            F.lit(channel).alias("channel"), F.col("id").cast("string").alias("content")
        )
        frame.write.format("lonnymq").options(**options, writeId=write_id).mode("append").save()

    batch("orders", "batch")
    with pytest.raises(StreamingQueryException, match="sinkId orders is the writeId of a batch"):
        stream("orders", "stream")
    stream("feed", "stream")
    with pytest.raises(Exception, match="writeId feed is the sinkId of a streaming write"):
        batch("feed", "batch")
    assert {s.channel: s.size for s in queue.stats()} == {"batch": 5, "stream": 10}
    assert _ids(admin, queue.schema, "SELECT count(*) FROM {schema}.spark_stage") == [0]


def test_an_aborted_micro_batch_clears_what_failed_attempts_staged(
    queue: Queue, admin: Conn, options: dict[str, Any]
) -> None:
    """Every task of the micro-batch failed (Spark passes no message for a failed task): the
    rows their attempts staged are cleared all the same. Spark aborts on a writer of a data
    source of its own: only the options are the same."""
    columns = StructType([StructField("content", StringType())])
    opts = {**options, "checkpointLocation": "/tmp/cp-a"}
    tasks = LonnyMQDataSource(opts).streamWriter(columns, overwrite=False)
    batch = pa.record_batch({"content": pa.array(["a", "b", "c"])})
    for batch_id, tag in [(4, "p0-a0"), (5, "p0-a0"), (5, "p0-a1")]:  # a1: a retry
        write_id = tasks._write_id(batch_id, "the query id")
        assert write_id is not None
        assert _write.stage(tasks._opts, write_id, tag, iter([batch])) == 3
    other = {**options, "checkpointLocation": "/tmp/cp-b"}
    write_id = LonnyMQDataSource(other).streamWriter(columns, overwrite=False)._write_id(5)
    assert write_id is not None
    assert _write.stage(tasks._opts, write_id, "p0-a0", iter([batch])) == 3
    stage = "SELECT count(*) FROM {schema}.spark_stage"
    assert _ids(admin, queue.schema, stage) == [12]
    LonnyMQDataSource(opts).streamWriter(columns, overwrite=False).abort([None, None], 5)
    # Batch 4's rows, and the batch 5 of another query (checkpoint), are not this batch's.
    assert _ids(admin, queue.schema, stage) == [6]
    assert queue.stats() == []


def test_two_queries_given_one_sink_id_do_not_clear_each_others_staging(
    queue: Queue, admin: Conn, options: dict[str, Any]
) -> None:
    """A second query given the same sinkId by mistake (refused at its commit) stages under
    an id of its own: its abort leaves the first query's batch alone."""
    columns = StructType([StructField("content", StringType())])
    opts = {**options, "sinkId": "feed"}
    first = LonnyMQDataSource(opts).streamWriter(columns, overwrite=False)
    second = LonnyMQDataSource(opts).streamWriter(columns, overwrite=False)
    batch = pa.record_batch({"content": pa.array(["a", "b", "c"])})
    ids = [w._write_id(5, query) for w, query in ((first, "query-A"), (second, "query-B"))]
    assert ids[0] != ids[1]
    assert ids[0] is not None
    assert _write.stage(first._opts, ids[0], "p0-a0", iter([batch])) == 3
    second.abort([None], 5)
    assert _ids(admin, queue.schema, "SELECT count(*) FROM {schema}.spark_stage") == [3]


@pytest.mark.slow
def test_a_micro_batch_whose_every_task_failed_leaves_nothing_staged(
    spark: SparkSession, queue: Queue, admin: Conn, options: dict[str, Any], tmp_path: Path
) -> None:
    # Spark aborts the batch on a writer of its own, which no commit message reaches.
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    lines = [json.dumps({"channel": "c", "content": f"m{i}"}) for i in range(50)]
    (inbox / "part-0.json").write_text("\n".join(lines) + "\n")
    checkpoint = str(tmp_path / "cp")

    def run(**extra: str) -> None:
        (
            spark.readStream.schema("channel string, content string")
            .json(str(inbox))
            .writeStream.format("lonnymq")
            .options(**options, **extra)
            .option("checkpointLocation", checkpoint)
            .trigger(availableNow=True)
            .start()
            .awaitTermination(timeout=180)
        )

    with pytest.raises(StreamingQueryException, match="fails after write"):
        run(_testFailAfterWrite="0", _testFailEveryAttempt="true")
    assert _ids(admin, queue.schema, "SELECT count(*) FROM {schema}.spark_stage") == [0]
    assert _ids(admin, queue.schema, "SELECT count(*) FROM {schema}.spark_stage_task") == [0]
    assert queue.stats() == []
    # Batch 0 again, after a driver died and left what a task staged for it: the commit
    # promotes the new run's winning attempts only, and clears the rest.
    columns = StructType(
        [StructField("channel", StringType()), StructField("content", StringType())]
    )
    writer = LonnyMQDataSource({**options, "checkpointLocation": checkpoint}).streamWriter(
        columns, overwrite=False
    )
    write_id = writer._write_id(0)
    assert write_id is not None
    left = pa.record_batch({"channel": pa.array(["c"]), "content": pa.array(["stale"])})
    assert _write.stage(writer._opts, write_id, "p0-a0-dead", iter([left])) == 1
    run()
    contents = _contents(admin, queue.schema)
    assert sorted(contents) == sorted(f"m{i}" for i in range(50))
    assert _ids(admin, queue.schema, "SELECT count(*) FROM {schema}.spark_stage") == [0]


def _contents(admin: Conn, schema: str) -> list[str]:
    rows = admin.execute(
        sql.SQL("SELECT content FROM {}.message").format(sql.Identifier(schema))
    ).fetchall()
    return [bytes(r[0]).decode() for r in rows]


def test_stream_read_schema(spark: SparkSession, queue: Queue, options: dict[str, Any]) -> None:
    frame = spark.readStream.format("lonnymq").options(**options, consumer="x").load()
    assert frame.isStreaming
    assert frame.columns == [
        "id", "channel", "content", "state", "num_attempts", "dequeue_at", "batch_no"
    ]  # fmt: skip


@pytest.mark.slow
def test_a_slow_batch_keeps_its_locks(
    spark: SparkSession, queue: Queue, options: dict[str, Any], tmp_path: Path
) -> None:
    # lockMs is 3 s and the batch takes 7 s: the driver's heartbeat renews the locks (every
    # second), so a competing consumer finds nothing to take while Spark holds the batch.
    created = _fill(queue, 20)
    delivered: list[int] = []
    stolen: list[int] = []

    def sink(batch: DataFrame, batch_id: int) -> None:
        delivered.extend(r.id for r in batch.select("id").collect())
        time.sleep(7)
        stolen.extend(m.id for m in queue.dequeue_many(100, lock_ms=60_000))

    query = (
        spark.readStream.format("lonnymq")
        .options(**options, consumer="slow", lockMs="3000")
        .load()
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(tmp_path / "cp"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(timeout=120)
    assert stolen == []
    assert sorted(delivered) == sorted(created)
    assert queue.stats() == []


def _create(queue: Queue, channel: str, n: int) -> set[int]:
    results = queue.create_many(NewMessage(channel.encode(), channel=channel) for _ in range(n))
    ids = {r.id for r in results if r.id is not None}
    assert len(ids) == n
    return ids


def _drain_available_now(
    spark: SparkSession, options: dict[str, Any], checkpoint: Path, **extra: str
) -> tuple[list[int], float]:
    """Run one Trigger.AvailableNow query to its end: the ids it delivered, and its time."""
    delivered: list[int] = []

    def sink(batch: DataFrame, batch_id: int) -> None:
        delivered.extend(r.id for r in batch.select("id").collect())

    began = time.monotonic()
    query = (
        spark.readStream.format("lonnymq")
        .options(**options, maxMessagesPerBatch="10", lockMs="30000", **extra)
        .load()
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(timeout=150)
    assert not query.isActive
    return delivered, time.monotonic() - began


@pytest.mark.slow
def test_available_now_waits_for_messages_a_channel_policy_holds_back(
    spark: SparkSession, queue: Queue, admin: Conn, options: dict[str, Any], tmp_path: Path
) -> None:
    # A plan finds only what is ready: the rate-limited channel gives one message per 300 ms
    # and the other channel one at a time. The run waits for them instead of ending at the
    # first plan that finds nothing (which left 4 of 6 such messages in a review).
    queue.channel("slow").set_policy(release_interval_ms=300)
    queue.channel("single").set_policy(max_concurrency=1)
    created = _create(queue, "slow", 6)
    created |= _create(queue, "single", 3)
    created |= _fill(queue, 25)
    delivered, _ = _drain_available_now(spark, {**options, "consumer": "policies"}, tmp_path)
    assert sorted(delivered) == sorted(created)
    assert _ids(admin, queue.schema, "SELECT id FROM {schema}.message") == []
    assert _ids(admin, queue.schema, "SELECT msg_id FROM {schema}.spark_batch") == []


@pytest.mark.slow
def test_available_now_leaves_paused_held_and_later_messages_without_hanging(
    spark: SparkSession, queue: Queue, admin: Conn, options: dict[str, Any], tmp_path: Path
) -> None:
    # Not waited for: a paused channel's messages (max_concurrency 0) and one due in an hour.
    # The run ends well before availableNowWaitMs (60 s by default) has passed.
    queue.channel("paused").set_policy(max_concurrency=0)
    left = _create(queue, "paused", 3)
    later = queue.create(b"later", channel="later", dequeue_at=queue.now() + 3_600_000)
    assert later.id is not None
    left.add(later.id)
    created = _fill(queue, 12)
    delivered, took = _drain_available_now(
        spark, {**options, "consumer": "leaves"}, tmp_path / "cp1"
    )
    assert sorted(delivered) == sorted(created)
    assert took < 45
    assert set(_ids(admin, queue.schema, "SELECT id FROM {schema}.message")) == left

    # Waited for, up to availableNowWaitMs only: a message whose channel's one slot another
    # consumer holds (here for two minutes).
    queue.channel("held").set_policy(max_concurrency=1)
    held = _create(queue, "held", 2)
    taken = queue.dequeue_many(1, lock_ms=120_000)
    assert [m.id for m in taken] == [min(held)]
    created = _fill(queue, 12)
    delivered, took = _drain_available_now(
        spark, {**options, "consumer": "gives-up"}, tmp_path / "cp2", availableNowWaitMs="3000"
    )
    assert sorted(delivered) == sorted(created)
    assert took < 45
    assert set(_ids(admin, queue.schema, "SELECT id FROM {schema}.message")) == left | held
    # Left as they were: no attempt counted for a message the queries never delivered.
    assert _ids(admin, queue.schema, "SELECT id FROM {schema}.message WHERE num_attempts > 0") == [
        min(held)
    ]


@pytest.mark.slow
def test_a_consumer_belongs_to_the_checkpoint_that_last_took_it_over(
    spark: SparkSession, queue: Queue, admin: Conn, options: dict[str, Any], tmp_path: Path
) -> None:
    # A query from another checkpoint, or from an older copy of this one, counted batches on
    # its own: its plans finished the batches the consumer's checkpoint had planned, unread.
    opts = {**options, "consumer": "owned"}
    first = _fill(queue, 30)
    delivered, _ = _drain_available_now(spark, opts, tmp_path / "a")
    assert sorted(delivered) == sorted(first)
    shutil.copytree(tmp_path / "a", tmp_path / "a-copy")  # at batch 3
    second = _fill(queue, 20)
    delivered, _ = _drain_available_now(spark, opts, tmp_path / "a")  # on to batch 5
    assert sorted(delivered) == sorted(second)

    waiting = _fill(queue, 12)

    def refused(checkpoint: str, message: str) -> None:
        with pytest.raises(StreamingQueryException, match=message):
            _drain_available_now(spark, opts, tmp_path / checkpoint)
        assert set(_ids(admin, queue.schema, "SELECT id FROM {schema}.message")) == waiting
        assert _ids(admin, queue.schema, "SELECT id FROM {schema}.message WHERE is_locked") == []

    refused("a-copy", "the checkpoint of consumer owned is behind the consumer")
    # A new checkpoint takes the consumer over; then the old one is refused.
    delivered, _ = _drain_available_now(spark, opts, tmp_path / "b")
    assert sorted(delivered) == sorted(waiting)
    waiting = _fill(queue, 5)
    refused("a", "consumer owned belongs to another streaming query checkpoint")
    delivered, _ = _drain_available_now(spark, opts, tmp_path / "b")
    assert sorted(delivered) == sorted(waiting)


def _once(
    spark: SparkSession, opts: dict[str, Any], checkpoint: Path, fail: bool = False
) -> list[int]:
    """One Trigger.Once micro-batch into a sink that keeps the ids (or fails)."""
    got: list[int] = []

    def sink(batch: DataFrame, batch_id: int) -> None:
        ids = [r.id for r in batch.select("id").collect()]
        if fail:
            raise RuntimeError(f"the sink is down (batch {batch_id}, {len(ids)} rows)")
        got.extend(ids)

    query = (
        spark.readStream.format("lonnymq")
        .options(**opts)
        .load()
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(checkpoint))
        .trigger(once=True)
        .start()
    )
    query.awaitTermination(timeout=150)
    assert not query.isActive
    return got


@pytest.mark.slow
def test_a_copy_of_a_checkpoint_one_batch_behind_loses_nothing(
    spark: SparkSession, queue: Queue, admin: Conn, options: dict[str, Any], tmp_path: Path
) -> None:
    # The copy ran a batch after the fork, so the original is one batch behind it. The
    # original planned new messages under the batch number the copy had used, its sink
    # failed, and the copy, restarted, finished them as delivered: a review lost 5 of 15.
    opts = {**options, "consumer": "fork"}
    original, copy = tmp_path / "a", tmp_path / "a-copy"
    created = _fill(queue, 5)
    delivered = _once(spark, opts, original)
    shutil.copytree(original, copy)
    created |= _fill(queue, 5)
    delivered += _once(spark, opts, copy)
    created |= _fill(queue, 5)
    # The copy's batch stays planned until its next plan: Trigger.Once made none.
    held = _ids(admin, queue.schema, "SELECT id FROM {schema}.message WHERE is_locked")
    with pytest.raises(StreamingQueryException, match="the checkpoint of consumer fork is behind"):
        _once(spark, opts, original, fail=True)
    assert _ids(admin, queue.schema, "SELECT id FROM {schema}.message WHERE is_locked") == held
    last, _ = _drain_available_now(spark, opts, copy)  # its final plan finishes its batches
    assert sorted(delivered + last) == sorted(created)
    assert _ids(admin, queue.schema, "SELECT id FROM {schema}.message") == []


@pytest.mark.slow
def test_a_query_started_on_an_empty_queue_keeps_its_consumer(
    spark: SparkSession, queue: Queue, admin: Conn, options: dict[str, Any], tmp_path: Path
) -> None:
    # Started before any producer: Spark logs a first batch that names no owner, and commits
    # it after the first batch with messages took the consumer over. Then a query from
    # another checkpoint, run on the empty queue, takes nothing over.
    opts = {**options, "consumer": "early"}
    seen: list[int] = []

    def sink(batch: DataFrame, batch_id: int) -> None:
        seen.extend(r.id for r in batch.select("id").collect())

    query = (
        spark.readStream.format("lonnymq")
        .options(**opts)
        .load()
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(tmp_path / "a"))
        .trigger(processingTime="300 milliseconds")
        .start()
    )
    try:
        deadline = time.monotonic() + 120
        while query.lastProgress is None and time.monotonic() < deadline:
            time.sleep(0.3)
        created = _fill(queue, 10)
        deadline = time.monotonic() + 120
        while query.isActive and len(seen) < 10 and time.monotonic() < deadline:
            time.sleep(0.3)
        assert query.isActive, query.exception()
        assert sorted(seen) == sorted(created)
        # The next plan finishes the delivered batch (else the stray query below would find
        # it given back, take it again and the consumer with it: duplicates, as documented).
        deadline = time.monotonic() + 60
        while _ids(admin, queue.schema, "SELECT id FROM {schema}.message"):
            assert time.monotonic() < deadline
            time.sleep(0.3)
    finally:
        query.stop()
    delivered, _ = _drain_available_now(spark, opts, tmp_path / "stray")
    assert delivered == []
    created = _fill(queue, 5)
    delivered, _ = _drain_available_now(spark, opts, tmp_path / "a")
    assert sorted(delivered) == sorted(created)
