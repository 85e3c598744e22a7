"""Every kind of bad option fails with a message that names it, before any Spark job runs."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from lonnymq import NewMessage, Queue
from lonnymq.errors import InvalidArgumentError
from lonnymq.spark import snapshot


@contextmanager
def _no_job_runs(spark: SparkSession) -> Iterator[None]:
    group = f"bad-options-{uuid.uuid4().hex}"
    context = spark.sparkContext
    context.setJobGroup(group, "must not run")
    try:
        yield
    finally:
        context.setLocalProperty("spark.jobGroup.id", None)  # type: ignore[arg-type]
        assert list(context.statusTracker().getJobIdsForGroup(group)) == []


def _frame(spark: SparkSession) -> DataFrame:
    return spark.createDataFrame([("c", "hello", 1)], "channel string, content string, n int")


# Spark lower-cases option names on their way to the data source.
WRITE_CASES: dict[str, tuple[dict[str, str | None], str]] = {
    "missing dsn": ({"dsn": None}, "option 'dsn' is required"),
    "malformed dsn": ({"dsn": "not a dsn"}, "option 'dsn' is not a valid libpq"),
    "bad schema name": ({"schema": "1-bad"}, "option 'schema'"),
    "schema not installed": ({"schema": "nowhere_installed"}, "not installed in schema"),
    "unknown option": ({"lockMS2": "5"}, "(?i)unknown lonnymq option.*'lockMS2'"),
    "option of another direction": ({"consumer": "x"}, "unknown .*'consumer'.* for df.write"),
    "bad choice": ({"onFull": "maybe"}, "'onFull' must be 'fail' or 'count'"),
    "missing column": ({"contentColumn": "body"}, "'contentColumn' names column 'body'"),
    "wrong column type": ({"dequeueAtColumn": "channel"}, "must be an integer .* or timestamp"),
    "conflicting options": ({"channel": "x"}, "'channel' .* and 'channelColumn' .* cannot"),
    "reserved channel": ({"channel": "lonnymq.schedules"}, "'channel'.* reserved for schedules"),
}


# Checked once the schema is known to be installed (the others are refused before that).
NEED_INSTALL = {
    "option of another direction",
    "missing column",
    "wrong column type",
    "conflicting options",
    "reserved channel",
}


@pytest.mark.parametrize("case", list(WRITE_CASES))
def test_bad_write_option(
    spark: SparkSession, options: dict[str, Any], case: str, request: pytest.FixtureRequest
) -> None:
    bad, message = WRITE_CASES[case]
    if case in NEED_INSTALL:
        request.getfixturevalue("queue")
    extra = {"channelColumn": "channel"} if case == "conflicting options" else {}
    given = {k: v for k, v in {**options, **extra, **bad}.items() if v is not None}
    writer = _frame(spark).write.format("lonnymq").options(**given)
    with _no_job_runs(spark), pytest.raises(Exception, match=message):
        writer.mode("append").save()


def test_no_content_column(spark: SparkSession, queue: Queue, options: dict[str, Any]) -> None:
    frame = spark.createDataFrame([("c", 1)], "channel string, n int")
    with _no_job_runs(spark), pytest.raises(Exception, match="has no 'content' column"):
        frame.write.format("lonnymq").options(**options).mode("append").save()


def test_overwrite_is_refused(spark: SparkSession, queue: Queue, options: dict[str, Any]) -> None:
    with _no_job_runs(spark), pytest.raises(Exception, match="only appends"):
        _frame(spark).write.format("lonnymq").options(**options).mode("overwrite").save()


READ_CASES: dict[str, tuple[dict[str, str | None], str]] = {
    "bad integer": ({"numPartitions": "many"}, "'numPartitions' must be an integer"),
    "integer out of range": ({"numPartitions": "0"}, "'numPartitions' must be an integer"),
    "bad table": ({"table": "messages"}, "'table' must be 'message' or 'archive'"),
    "option of another direction": ({"writeId": "w"}, "(?i)unknown .*'writeId'.* for spark.read"),
}


def test_a_snapshot_that_is_not_open_fails_at_load_naming_the_option(
    spark: SparkSession, queue: Queue, options: dict[str, Any]
) -> None:
    """A made-up id, or one whose ``with snapshot()`` block has ended, failed only at the
    action, with the server's "invalid snapshot identifier" and no word of the option."""
    with snapshot(options["dsn"]) as ended:
        pass
    for bad in ("bogus", ended):
        reader = spark.read.format("lonnymq").options(**options, snapshot=bad)
        with (
            _no_job_runs(spark),
            pytest.raises(
                Exception,
                match=r"option 'snapshot': (invalid snapshot identifier|snapshot .* does not)",
            ),
        ):
            reader.load()


@pytest.mark.parametrize("case", list(READ_CASES))
def test_bad_read_option(
    spark: SparkSession, queue: Queue, options: dict[str, Any], case: str
) -> None:
    bad, message = READ_CASES[case]
    with _no_job_runs(spark), pytest.raises(Exception, match=message):
        spark.read.format("lonnymq").options(**{**options, **bad}).load().collect()


def _start_stream(spark: SparkSession, options: dict[str, Any], path: Path) -> Callable[[], Any]:
    def start() -> Any:
        return (
            spark.readStream.format("lonnymq")
            .options(**options)
            .load()
            .writeStream.format("noop")
            .option("checkpointLocation", str(path))
            .start()
        )

    return start


def test_stream_read_needs_a_consumer(
    spark: SparkSession, queue: Queue, options: dict[str, Any], tmp_path: Path
) -> None:
    query = _start_stream(spark, options, tmp_path / "cp")()
    with pytest.raises(StreamingQueryException, match="'consumer' is required"):
        query.awaitTermination(timeout=120)


def test_bad_stream_option_fails_when_loaded(spark: SparkSession, options: dict[str, Any]) -> None:
    with pytest.raises(Exception, match="'lockMs' must be an integer between 1000 and"):
        spark.readStream.format("lonnymq").options(**options, consumer="c", lockMs="5").load()
    with pytest.raises(Exception, match="'availableNowWaitMs' must be an integer between 0"):
        spark.readStream.format("lonnymq").options(
            **options, consumer="c", availableNowWaitMs="-1"
        ).load()


def test_the_known_options_named_in_an_error_are_the_documented_ones() -> None:
    from lonnymq.spark._options import STREAM_WRITE_OPTIONS, check_known

    with pytest.raises(InvalidArgumentError, match="known options: ") as raised:
        check_known({"bogus": "1"}, STREAM_WRITE_OPTIONS, "df.writeStream")
    assert "sinkId" in str(raised.value)
    assert "_test" not in str(raised.value)  # the test suite's hooks


@pytest.mark.slow
def test_a_bad_stream_write_option_fails_at_the_first_micro_batch(
    spark: SparkSession, queue: Queue, options: dict[str, Any], tmp_path: Path
) -> None:
    # As docs/spark.md says ("When options are checked"): start() takes it (Spark calls the
    # sink's code only to plan a micro-batch), the source has planned the batch by then, and a
    # restart from the checkpoint with the option fixed replays it.
    queue.create_many(NewMessage(f"m{i}".encode(), channel="in") for i in range(5))

    def start(**sink: str) -> Any:
        return (
            spark.readStream.format("lonnymq")
            .options(**options, consumer="c")
            .load()
            .select(F.lit("out").alias("channel"), F.col("content"))
            .writeStream.format("lonnymq")
            .options(**options, **sink)
            .option("checkpointLocation", str(tmp_path / "cp"))
            .trigger(availableNow=True)
            .start()
        )

    query = start(onFull="maybe")
    with pytest.raises(StreamingQueryException, match="'onFull' must be 'fail' or 'count'"):
        query.awaitTermination(timeout=120)
    assert {s.channel: (s.size, s.in_flight) for s in queue.stats()} == {"in": (5, 5)}
    start().awaitTermination(timeout=120)
    assert {s.channel: s.size for s in queue.stats()} == {"out": 5}
