"""Writes: a task stages its rows with one binary COPY, the driver promotes the winners.

Why staging: a Python write task's rows are durable before Spark decides which attempt of the
task won (a failed, retried or speculative attempt leaves its rows behind), so tasks never
create messages. The driver's commit enqueues the rows of the attempts Spark reports as
successful, in one transaction that also records the commit (see ``sql/schema/80_spark.sql``).
"""

from __future__ import annotations

import array
import json
import logging
import struct
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from psycopg import sql

from .. import _core
from ..errors import InvalidArgumentError, InvalidChannelError
from ..schedule import SCHEDULE_CHANNEL
from . import _db
from ._errors import SparkWriteError
from ._options import Connection, ContentFormat, OnFull, WriteOptions

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["WriteResult", "clear", "commit", "create_direct", "is_committed", "stage"]

log = logging.getLogger("lonnymq.spark")

# Streaming sinks keep the commit records of their last micro-batches only.
SINK_KEEP_BATCHES = 100

# Rows per message_create_many call (one transaction) in mode=direct.
DIRECT_CHUNK = 10_000

# COPY's binary format: the signature, flags and header extension length; the trailer.
_COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + struct.pack(">ii", 0, 0)
_COPY_TRAILER = struct.pack(">h", -1)
_NULL_FIELD = struct.pack(">i", -1)


@dataclass(frozen=True, slots=True)
class WriteResult:
    """What a committed write enqueued.

    ``created`` new messages; ``deduplicated`` rows whose ``dedup_key`` a live message of
    their channel already had; ``dropped`` rows refused by channels at their ``max_size``
    (``dropped_channels`` names up to 20 of those channels). ``replayed`` is true when the
    write had already been committed (a replayed micro-batch): nothing was enqueued again.
    ``lonnymq.spark.write_result`` reads the counts a commit recorded and nothing else: its
    ``dropped_channels`` is always empty and its ``replayed`` false.
    """

    created: int
    deduplicated: int
    dropped: int
    dropped_channels: tuple[str, ...] = ()
    replayed: bool = False


def _copy_statement(schema: str) -> sql.Composed:
    # The one statement that is not a function call: COPY can only target a table.
    return sql.SQL(
        "COPY {}.spark_stage (write_id, task_tag, seq, channel, content, dequeue_at, dedup_key)"
        " FROM STDIN (FORMAT BINARY)"
    ).format(sql.Identifier(schema))


def _json_default(value: object) -> Any:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    return str(value)


def _json_contents(opts: WriteOptions, batch: pa.RecordBatch) -> list[bytes]:
    """contentFormat=json: each row's other columns as one JSON object. NaN and infinity
    are refused: JSON has no such numbers, and most readers reject them."""
    try:
        return [
            json.dumps(row, default=_json_default, separators=(",", ":"), allow_nan=False).encode()
            for row in batch.select(list(opts.json_columns)).to_pylist()
        ]
    except ValueError as err:
        raise InvalidArgumentError(
            "contentFormat=json: a float column holds NaN or infinity, which JSON cannot "
            "carry; replace them (for example with null) before writing"
        ) from err


def _epoch_ms(column: pa.Array) -> pa.Array:
    """A timestamp column as integer ms since the Unix epoch, floored as lonnymq's times are.

    Not a cast to ``timestamp[ms]``: a safe one refuses Spark's microseconds, an unsafe one
    truncates toward zero (a time before 1970 would move a millisecond later).
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    values = column.cast(pa.int64())  # counts of the column's unit since the epoch, in UTC
    unit = column.type.unit
    if unit == "s":
        return pc.multiply_checked(values, 1000)
    per_ms = {"ms": 1, "us": 1_000, "ns": 1_000_000}[unit]
    quotient = pc.divide(values, per_ms)  # Arrow's integer division truncates toward zero
    return pc.subtract(quotient, pc.less(values, pc.multiply(quotient, per_ms)).cast(pa.int64()))


def _check_reserved(opts: WriteOptions, batch: pa.RecordBatch) -> None:
    """Refuse rows whose channel column names the schedules' reserved channel: a driver there
    is a schedule, which a write must not make (``write_options`` refuses it as the
    ``channel`` option)."""
    if opts.channel_column is None:
        return
    import pyarrow as pa
    import pyarrow.compute as pc

    column = batch.column(opts.channel_column)  # a string column (write_options checks)
    count = pc.sum(pc.equal(column, pa.scalar(SCHEDULE_CHANNEL, column.type))).as_py()
    if count:
        raise InvalidChannelError(
            f"column {opts.channel_column!r} names channel {SCHEDULE_CHANNEL!r} in {count} "
            f"row(s): it is reserved for schedules' drivers (use Queue.schedule to make one)"
        )


def _columns(opts: WriteOptions, batch: pa.RecordBatch) -> tuple[list[Any], ...]:
    """The batch as staging columns: channel, content, dequeue_at, dedup_key."""
    import pyarrow as pa
    import pyarrow.compute as pc

    n = batch.num_rows
    _check_reserved(opts, batch)
    if opts.channel_column is not None:
        channels = batch.column(opts.channel_column).to_pylist()
    else:
        channels = [opts.channel] * n
    if opts.content_format is ContentFormat.JSON:
        contents = _json_contents(opts, batch)
    else:
        assert opts.content_column is not None
        column = batch.column(opts.content_column)
        if column.null_count:
            raise InvalidArgumentError(
                f"column {opts.content_column!r} (the message content) has {column.null_count}"
                f" null value(s): every message needs a content"
            )
        if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
            column = pc.cast(column, pa.binary())
        contents = column.to_pylist()
    if opts.dequeue_at_column is not None:
        column = batch.column(opts.dequeue_at_column)
        if pa.types.is_timestamp(column.type):
            column = _epoch_ms(column)
        dequeue_ats = column.to_pylist()
    else:
        dequeue_ats = [None] * n
    if opts.dedup_key_column is not None:
        dedup_keys = batch.column(opts.dedup_key_column).to_pylist()
    else:
        dedup_keys = [None] * n
    return channels, contents, dequeue_ats, dedup_keys


def _big_endian(values: pa.Array, code: str) -> pa.Array:
    """The integers of ``values`` (nulls read as 0) as big-endian bytes, one binary value each;
    ``code`` is the ``array`` module's: ``"i"`` (4 bytes) or ``"q"`` (8 bytes)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    width = struct.calcsize(code)
    values = pc.fill_null(values.cast(pa.int64() if code == "q" else pa.int32()), 0)
    raw = array.array(code)
    raw.frombytes(memoryview(values.buffers()[1])[values.offset * width :][: len(values) * width])
    if sys.byteorder == "little":
        raw.byteswap()
    fixed = pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(width), len(values), [None, pa.py_buffer(raw.tobytes())]
    )
    return fixed.cast(pa.large_binary())


def _text_fields(values: pa.Array) -> list[pa.Array]:
    """A string or binary column as COPY fields: the length, then the bytes (-1 for NULL)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    values = values.cast(pa.large_binary())
    lengths = pc.fill_null(pc.binary_length(values), -1)
    return [_big_endian(lengths, "i"), pc.fill_null(values, pa.scalar(b"", pa.large_binary()))]


def _constant(value: str | None) -> pa.Scalar:
    import pyarrow as pa

    if value is None:
        return pa.scalar(_NULL_FIELD, pa.large_binary())
    data = value.encode()
    return pa.scalar(struct.pack(">i", len(data)) + data, pa.large_binary())


def _copy_rows(
    opts: WriteOptions, write_id: str, task_tag: str, seq: int, batch: pa.RecordBatch
) -> memoryview:
    """A batch as the rows of a binary COPY into spark_stage (no header, no trailer), built
    column by column in Arrow: no Python work per row (except for contentFormat=json)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    n = batch.num_rows
    fixed = struct.pack(">h", 7)
    for text in (write_id, task_tag):
        data = text.encode()
        fixed += struct.pack(">i", len(data)) + data
    fixed += struct.pack(">i", 4)
    parts: list[pa.Array | pa.Scalar] = [
        pa.scalar(fixed, pa.large_binary()),
        _big_endian(pa.array(range(seq, seq + n), pa.int32()), "i"),
    ]
    _check_reserved(opts, batch)
    if opts.channel_column is not None:
        parts += _text_fields(batch.column(opts.channel_column))
    else:
        parts.append(_constant(opts.channel))
    if opts.content_format is ContentFormat.JSON:
        content = pa.array(_json_contents(opts, batch), pa.large_binary())
    else:
        assert opts.content_column is not None
        content = batch.column(opts.content_column)
        if content.null_count:
            raise InvalidArgumentError(
                f"column {opts.content_column!r} (the message content) has "
                f"{content.null_count} null value(s): every message needs a content"
            )
    parts += _text_fields(content)
    if opts.dequeue_at_column is not None:
        column = batch.column(opts.dequeue_at_column)
        if pa.types.is_timestamp(column.type):
            column = _epoch_ms(column)
        present = pc.binary_join_element_wise(
            pa.scalar(struct.pack(">i", 8), pa.large_binary()),
            _big_endian(column, "q"),
            pa.scalar(b"", pa.large_binary()),
        )
        parts.append(pc.if_else(pc.is_valid(column), present, _constant(None)))
    else:
        parts.append(_constant(None))
    if opts.dedup_key_column is not None:
        parts += _text_fields(batch.column(opts.dedup_key_column))
    else:
        parts.append(_constant(None))
    rows = pc.binary_join_element_wise(*parts, pa.scalar(b"", pa.large_binary()))
    offsets = memoryview(rows.buffers()[1]).cast("B")
    start, end = (
        struct.unpack_from("<q", offsets, i * 8)[0] for i in (rows.offset, rows.offset + n)
    )
    return memoryview(rows.buffers()[2])[start:end]


def stage(
    opts: WriteOptions, write_id: str, task_tag: str, batches: Iterable[pa.RecordBatch]
) -> int:
    """Stage a task's rows under (write_id, task_tag) in one transaction; returns the count."""
    schema = opts.conn.schema
    db = _db.executor_connection(opts.conn)
    seq = 0
    with _db.translated(schema), db.transaction():
        with db.cursor() as cursor, cursor.copy(_copy_statement(schema)) as copy:
            copy.write(_COPY_HEADER)
            for batch in batches:
                if batch.num_rows:
                    copy.write(_copy_rows(opts, write_id, task_tag, seq, batch))
                    seq += batch.num_rows
            copy.write(_COPY_TRAILER)
        _db.run(
            db,
            schema,
            "spark_stage_record",
            {"write_id": write_id, "task_tag": task_tag, "n_rows": seq},
        )
    return seq


def create_direct(opts: WriteOptions, batches: Iterable[pa.RecordBatch]) -> WriteResult:
    """mode=direct: enqueue a task's rows straight away, in chunks of one transaction each;
    raise at a batch with a null dedup key, before enqueuing any of its rows."""
    schema = opts.conn.schema
    db = _db.executor_connection(opts.conn)
    statement = _core.Statements(schema)["message_create_many"]
    counts = {"created": 0, "deduplicated": 0, "dropped": 0}
    full: set[str] = set()
    assert opts.dedup_key_column is not None  # write_options requires it in mode=direct
    for batch in batches:
        # Checked for the whole batch before any of its chunks is enqueued: nothing absorbs
        # the replay of a null-key row, so a retried task would enqueue it again.
        keys = batch.column(opts.dedup_key_column)
        if keys.null_count:
            raise InvalidArgumentError(
                f"column {opts.dedup_key_column!r} (the dedup key) has {keys.null_count} null "
                f"value(s): with mode=direct every row needs a dedup key (it is what makes a "
                f"retried task harmless); this task's rows enqueued before them stay enqueued"
            )
        channels, contents, dequeue_ats, dedup_keys = _columns(opts, batch)
        for start in range(0, len(contents), DIRECT_CHUNK):
            part = slice(start, start + DIRECT_CHUNK)
            params = {
                "channels": channels[part],
                "contents": contents[part],
                "dequeue_ats": dequeue_ats[part],
                "dedup_keys": dedup_keys[part],
            }
            with _db.translated(schema), db.transaction():
                rows = db.execute(statement, params).fetchall()
            for (status, _, _), channel in zip(rows, channels[part], strict=True):
                counts[status] += 1
                if status == "dropped":
                    full.add(channel or _core.DEFAULT_CHANNEL)
    return WriteResult(
        created=counts["created"],
        deduplicated=counts["deduplicated"],
        dropped=counts["dropped"],
        dropped_channels=tuple(sorted(full)[:20]),
    )


def drain(batches: Iterator[Any]) -> None:
    """Consume a task's input without staging it (a replayed, already committed batch)."""
    for _ in batches:
        pass


def is_committed(opts: WriteOptions, sink_id: str, batch_id: int) -> bool:
    """Whether (sink_id, batch_id) was committed already."""
    db = _db.executor_connection(opts.conn)
    with _db.translated(opts.conn.schema), db.transaction():
        rows = _db.run(
            db,
            opts.conn.schema,
            "spark_write_result",
            {"sink_id": sink_id, "batch_id": batch_id},
        )
    return bool(rows)


def commit(
    opts: WriteOptions,
    *,
    sink_id: str,
    batch_id: int,
    write_id: str,
    task_tags: Sequence[str],
    expected_rows: int,
    streaming: bool,
    owner: str | None = None,
    named: bool = False,
) -> WriteResult:
    """Enqueue what the winning tasks staged, once per (sink_id, batch_id), in one
    transaction; raise (enqueuing nothing) when rows went missing or, with onFull=fail,
    when a channel refused some. With ``owner`` (a streaming query's id), the sink id is
    claimed for that query in the same transaction: another query's claim, or a batch
    write's, refuses it. A ``named`` batch write (option writeId) claims its name for batch
    writes the same way: a stream's sink of that name refuses it."""
    schema = opts.conn.schema
    with _db.connect(opts.conn, autocommit=False) as db, _db.translated(schema):
        if owner is not None:
            _db.run(db, schema, "spark_sink_claim", {"sink_id": sink_id, "query_id": owner})
        if named:
            _db.run(db, schema, "spark_write_claim", {"write_id": sink_id})
        rows = _db.run(
            db,
            schema,
            "spark_write_commit",
            {
                "sink_id": sink_id,
                "batch_id": batch_id,
                "write_id": write_id,
                "task_tags": list(task_tags),
            },
        )
        is_new, staged, created, deduplicated, dropped, dropped_channels = rows[0]
        if is_new and staged != expected_rows:
            db.rollback()
            raise SparkWriteError(
                f"the write's tasks staged {expected_rows} rows but {staged} were found at "
                f"commit (PostgreSQL restarted and emptied the UNLOGGED staging table?); "
                f"nothing was enqueued: run the job again"
            )
        if is_new and dropped and opts.on_full is OnFull.FAIL:
            db.rollback()
            raise SparkWriteError(
                f"{dropped} message(s) were refused by channels at their max_size "
                f"({', '.join(dropped_channels)}); nothing was enqueued. Set option "
                f"onFull=count to enqueue the rest and only count the refused ones"
            )
        if streaming:
            _db.run(
                db,
                schema,
                "spark_sink_prune",
                {"sink_id": sink_id, "batch_id": batch_id, "keep": SINK_KEEP_BATCHES},
            )
        db.commit()
    result = WriteResult(
        created=created,
        deduplicated=deduplicated,
        dropped=dropped,
        dropped_channels=tuple(dropped_channels),
        replayed=not is_new,
    )
    log.info("lonnymq write %s/%s committed: %s", sink_id, batch_id, result)
    return result


def check_direct(opts: WriteOptions, results: Sequence[WriteResult]) -> WriteResult:
    """The total of a direct write's tasks; with onFull=fail, raise when rows were refused
    (the rest stays enqueued: a direct write is not all or nothing)."""
    total = WriteResult(
        created=sum(r.created for r in results),
        deduplicated=sum(r.deduplicated for r in results),
        dropped=sum(r.dropped for r in results),
        dropped_channels=tuple(sorted({c for r in results for c in r.dropped_channels})[:20]),
    )
    if total.dropped and opts.on_full is OnFull.FAIL:
        raise SparkWriteError(
            f"{total.dropped} message(s) were refused by channels at their max_size "
            f"({', '.join(total.dropped_channels)}); with mode=direct the other "
            f"{total.created + total.deduplicated} were enqueued (or already there)"
        )
    log.info("lonnymq direct write done: %s", total)
    return total


def clear(opts: WriteOptions, write_ids: Iterable[str]) -> None:
    """Forget what was staged under these write ids (an aborted write)."""
    schema = opts.conn.schema
    with _db.connect(opts.conn) as db:
        for write_id in sorted(set(write_ids)):
            _db.run(db, schema, "spark_stage_clear", {"write_id": write_id})


def result_of(opts_conn: Connection, sink_id: str, batch_id: int) -> WriteResult | None:
    """The recorded result of a committed write, or None."""
    with _db.connect(opts_conn) as db:
        rows = _db.run(
            db, opts_conn.schema, "spark_write_result", {"sink_id": sink_id, "batch_id": batch_id}
        )
    if not rows:
        return None
    created, deduplicated, dropped, _ = rows[0]
    return WriteResult(created=created, deduplicated=deduplicated, dropped=dropped)
