"""The task side's binary COPY stream, built from Arrow columns: what it stages is what each
row holds, for every column type and NULL the writer accepts; and mode=direct's columns and
refusals (no Spark needed)."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from psycopg import sql

from lonnymq import Queue
from lonnymq.errors import InvalidArgumentError, InvalidChannelError
from lonnymq.spark import _write
from lonnymq.spark._options import ColumnInfo, write_options

UTC = dt.UTC


def _staged(admin: psycopg.Connection[Any], schema: str, task_tag: str) -> list[tuple[Any, ...]]:
    return admin.execute(
        sql.SQL(
            "SELECT seq, channel, content, dequeue_at, dedup_key FROM {}.spark_stage"
            " WHERE write_id = 'w' AND task_tag = %s ORDER BY seq"
        ).format(sql.Identifier(schema)),
        [task_tag],
    ).fetchall()


def _options(dsn: str, schema: str, columns: dict[str, str], **extra: str) -> Any:
    infos = [ColumnInfo(name, kind) for name, kind in columns.items()]
    return write_options({"dsn": dsn, "schema": schema, **extra}, infos, streaming=False)


def test_columns_with_nulls_and_several_batches(
    queue: Queue, admin: psycopg.Connection[Any], dsn: str, schema_name: str
) -> None:
    first = pa.record_batch(
        {
            "channel": pa.array(["a", None, "ché", "b"]),
            "content": pa.array([b"\x00\xff", b"", b"x" * 1000, b"\\\n"], pa.binary()),
            "dequeue_at": pa.array([None, -5, 2**40, 0], pa.int64()),
            "dedup_key": pa.array(["k1", None, "ключ", None]),
        }
    )
    # A slice: Arrow arrays that do not start at their buffers' beginning.
    second = pa.record_batch(
        {
            "channel": pa.array(["z", "c", "d"]),
            "content": pa.array([b"skip", b"one", b"two"], pa.binary()),
            "dequeue_at": pa.array([1, 7, None], pa.int64()),
            "dedup_key": pa.array(["s", None, "k2"]),
        }
    ).slice(1)
    empty = first.slice(0, 0)
    opts = _options(
        dsn,
        schema_name,
        {"channel": "string", "content": "binary", "dequeue_at": "integer", "dedup_key": "string"},
    )
    assert _write.stage(opts, "w", "t1", iter([first, empty, second])) == 6
    assert _staged(admin, schema_name, "t1") == [
        (0, "a", b"\x00\xff", None, "k1"),
        (1, None, b"", -5, None),
        (2, "ché", b"x" * 1000, 2**40, "ключ"),
        (3, "b", b"\\\n", 0, None),
        (4, "c", b"one", 7, None),
        (5, "d", b"two", None, "k2"),
    ]


def test_string_content_timestamps_and_a_fixed_channel(
    queue: Queue, admin: psycopg.Connection[Any], dsn: str, schema_name: str
) -> None:
    at = dt.datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=UTC)
    batch = pa.record_batch(
        {
            "content": pa.array(["héllo", "{}"]),
            "at": pa.array([at, None], pa.timestamp("us", tz="UTC")),
            "n": pa.array([1, 2], pa.int32()),
        }
    )
    opts = _options(
        dsn,
        schema_name,
        {"content": "string", "at": "timestamp", "n": "integer"},
        channel="fixed",
        dequeueAtColumn="at",
    )
    assert _write.stage(opts, "w", "t2", iter([batch])) == 2
    ms = int(at.timestamp() * 1000)
    assert _staged(admin, schema_name, "t2") == [
        (0, "fixed", "héllo".encode(), ms, None),
        (1, "fixed", b"{}", None, None),
    ]


def test_json_content_and_no_channel(
    queue: Queue, admin: psycopg.Connection[Any], dsn: str, schema_name: str
) -> None:
    batch = pa.record_batch(
        {"n": pa.array([1, None], pa.int64()), "s": pa.array(["x", "y"]), "when": [5, 6]}
    )
    opts = _options(
        dsn,
        schema_name,
        {"n": "integer", "s": "string", "when": "integer"},
        contentFormat="json",
        dequeueAtColumn="when",
    )
    assert _write.stage(opts, "w", "t3", iter([batch])) == 2
    rows = _staged(admin, schema_name, "t3")
    assert [(r[0], r[1], json.loads(r[2]), r[3], r[4]) for r in rows] == [
        (0, None, {"n": 1, "s": "x"}, 5, None),
        (1, None, {"n": None, "s": "y"}, 6, None),
    ]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_json_content_refuses_numbers_json_cannot_carry(
    queue: Queue, admin: psycopg.Connection[Any], dsn: str, schema_name: str, bad: float
) -> None:
    batch = pa.record_batch({"x": pa.array([1.5, bad], pa.float64())})
    opts = _options(dsn, schema_name, {"x": "double"}, contentFormat="json")
    with pytest.raises(InvalidArgumentError, match="NaN or infinity, which JSON cannot carry"):
        _write.stage(opts, "w", "t6", iter([batch]))
    assert _staged(admin, schema_name, "t6") == []


def test_null_content_is_refused_and_stages_nothing(
    queue: Queue, admin: psycopg.Connection[Any], dsn: str, schema_name: str
) -> None:
    batch = pa.record_batch({"content": pa.array([b"a", None], pa.binary())})
    opts = _options(dsn, schema_name, {"content": "binary"})
    with pytest.raises(InvalidArgumentError, match="null value"):
        _write.stage(opts, "w", "t4", iter([batch]))
    assert _staged(admin, schema_name, "t4") == []


def test_sub_millisecond_timestamps_are_floored_to_ms(
    queue: Queue, admin: psycopg.Connection[Any], dsn: str, schema_name: str
) -> None:
    # Spark's timestamps are microseconds: a safe cast to ms refused them, failing every task.
    micros = [1_767_323_045_678_901, 1_767_323_045_678_000, 999, 0, -1, -1_000, -1_500, None]
    floored = [1_767_323_045_678, 1_767_323_045_678, 0, 0, -1, -1, -2, None]
    batch = pa.record_batch(
        {
            "content": pa.array([b"m"] * len(micros), pa.binary()),
            "dequeue_at": pa.array(micros, pa.timestamp("us", tz="UTC")),
            "dedup_key": pa.array([str(i) for i in range(len(micros))]),
        }
    )
    opts = _options(
        dsn, schema_name, {"content": "binary", "dequeue_at": "timestamp", "dedup_key": "string"}
    )
    assert _write.stage(opts, "w", "t5", iter([batch])) == len(micros)
    assert [r[3] for r in _staged(admin, schema_name, "t5")] == floored
    # mode=direct builds its columns apart from the COPY stream.
    assert _write._columns(opts, batch)[2] == floored


def test_direct_mode_refuses_a_batch_with_a_null_dedup_key(
    queue: Queue, admin: psycopg.Connection[Any], dsn: str, schema_name: str
) -> None:
    opts = _options(dsn, schema_name, {"content": "binary", "dedup_key": "string"}, mode="direct")
    first = pa.record_batch(
        {"content": pa.array([b"a", b"b"], pa.binary()), "dedup_key": pa.array(["a", "b"])}
    )
    second = pa.record_batch(
        {"content": pa.array([b"c", b"d"], pa.binary()), "dedup_key": pa.array(["c", None])}
    )
    with pytest.raises(
        InvalidArgumentError,
        match=r"column 'dedup_key' \(the dedup key\) has 1 null value\(s\): with mode=direct "
        r"every row needs a dedup key",
    ):
        _write.create_direct(opts, iter([first, second]))
    # The batches before the refused one stay enqueued; none of the refused one's rows is.
    contents = admin.execute(
        sql.SQL("SELECT content FROM {}.message ORDER BY content").format(
            sql.Identifier(schema_name)
        )
    ).fetchall()
    assert [bytes(r[0]) for r in contents] == [b"a", b"b"]


def test_the_schedules_channel_is_refused_and_stages_nothing(
    queue: Queue, admin: psycopg.Connection[Any], dsn: str, schema_name: str
) -> None:
    # A row there is a schedule's driver, which a write must not make (one bad row there also
    # broke Queue.schedules()).
    batch = pa.record_batch(
        {
            "channel": pa.array(["jobs", "lonnymq.schedules", None]),
            "content": pa.array([b"a"] * 3, pa.binary()),
            "dedup_key": pa.array(["k1", "k2", "k3"]),
        }
    )
    columns = {"channel": "string", "content": "binary", "dedup_key": "string"}
    opts = _options(dsn, schema_name, columns)
    match = "names channel 'lonnymq.schedules' in 1 row"
    with pytest.raises(InvalidChannelError, match=match):
        _write.stage(opts, "w", "t9", iter([batch]))
    assert _staged(admin, schema_name, "t9") == []
    direct = _options(dsn, schema_name, columns, mode="direct")
    with pytest.raises(InvalidChannelError, match=match):
        _write.create_direct(direct, iter([batch]))
    assert queue.stats() == []
