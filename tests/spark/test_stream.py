"""Streaming read and streaming write through real Spark streaming queries."""

from __future__ import annotations

import contextlib
import json
import os
import random
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


def test_an_aborted_micro_batch_clears_what_failed_attempts_staged(
    queue: Queue, admin: Conn, options: dict[str, Any]
) -> None:
    """Every task of the micro-batch failed (Spark passes no message for a failed task): the
    rows their attempts staged under the writer's id are cleared all the same."""
    columns = StructType([StructField("content", StringType())])
    writer = LonnyMQDataSource(options).streamWriter(columns, overwrite=False)
    batch = pa.record_batch({"content": pa.array(["a", "b", "c"])})
    assert _write.stage(writer._opts, writer._write_id, "p0-a0", iter([batch])) == 3
    stage = "SELECT count(*) FROM {schema}.spark_stage"
    assert _ids(admin, queue.schema, stage) == [3]
    writer.abort([None, None], 0)
    assert _ids(admin, queue.schema, stage) == [0]
    assert queue.stats() == []


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
