"""The ``lonnymq`` data source: PySpark's Python Data Source API over the queue.

Which process runs what (PySpark 4.3): ``LonnyMQDataSource.__init__``, ``reader()``,
``writer()``, ``partitions()`` and the writers' ``commit``/``abort`` run in short-lived planner
processes of the driver; ``read()`` and ``write()`` run in executor workers, on a pickled copy
made at planning time; the stream reader's ``latestOffset``/``partitions``/``commit``/``stop``
run in one long-lived runner process per query. So options are checked once on the driver,
objects stay picklable (connections and threads are made lazily and never pickled), and
everything a commit needs travels in the commit messages.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    DataSourceStreamArrowWriter,
    DataSourceStreamReader,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import (
    BinaryType,
    ByteType,
    DataType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from ..errors import InvalidArgumentError
from . import _db, _read, _write
from ._options import (
    MAX_MESSAGES_PER_BATCH,
    TEST_FAIL_OPTION,
    ColumnInfo,
    ReadOptions,
    StreamReadOptions,
    Table,
    WriteMode,
    WriteOptions,
    check_all,
    read_options,
    stream_read_options,
    write_options,
)

__all__ = ["LonnyMQDataSource"]

# Trigger.AvailableNow waiting on a channel's policy: the poll when no time is known (a
# channel's max_concurrency slots are all taken), and the longest sleep before looking again
# (a policy may change, a holder finish).
_POLL_S = 0.25
_MAX_SLEEP_S = 1.0


def _kind(data_type: DataType) -> str:
    if isinstance(data_type, StringType):
        return "string"
    if isinstance(data_type, BinaryType):
        return "binary"
    if isinstance(data_type, LongType | IntegerType | ShortType | ByteType):
        return "integer"
    if isinstance(data_type, TimestampType | TimestampNTZType):
        return "timestamp"
    return "other"


def _columns(schema: StructType) -> list[ColumnInfo]:
    return [ColumnInfo(field.name, _kind(field.dataType)) for field in schema.fields]


def _task_tag() -> str:
    """A tag unique to this task attempt (a retry or a speculative twin gets another)."""
    ctx = TaskContext.get()
    if ctx is None:
        return f"local-{uuid.uuid4().hex}"
    return (
        f"p{ctx.partitionId()}-a{ctx.attemptNumber()}-t{ctx.taskAttemptId()}-{uuid.uuid4().hex[:8]}"
    )


def _maybe_fail(opts: WriteOptions) -> None:
    """Test hook (option ``_testFailAfterWrite=P``): the first attempt of partition P fails
    after its rows were staged, as a lost executor would; every attempt with
    ``_testFailEveryAttempt=true``."""
    ctx = TaskContext.get()
    if (
        opts.fail_after_write is not None
        and ctx is not None
        and ctx.partitionId() == opts.fail_after_write
        and (ctx.attemptNumber() == 0 or opts.fail_every_attempt)
    ):
        raise RuntimeError(f"{TEST_FAIL_OPTION}: partition {ctx.partitionId()} fails after write")


class LonnyMQDataSource(DataSource):
    """``format("lonnymq")``: enqueue DataFrames, read the queue or its archive, drain the
    queue into a stream, and enqueue a stream, exactly once per micro-batch."""

    @classmethod
    def name(cls) -> str:
        return "lonnymq"

    def __init__(self, options: dict[str, str]) -> None:
        super().__init__(options)
        # Checked here, on the driver, before any job runs; the rest is checked per direction.
        self._conn = check_all(self.options)
        _db.check_installed(self._conn, self.options.get("snapshot"))

    def _table(self) -> Table:
        value = str(self.options.get("table") or "message").lower()
        return Table.ARCHIVE if value == "archive" else Table.MESSAGE

    def schema(self) -> str:
        # Spark asks before it says which direction: a streaming read is the one with a
        # consumer (a batch read refuses that option).
        if self.options.get("consumer") is not None:
            return _read.ddl(_read.STREAM_COLUMNS)
        return _read.ddl(
            _read.ARCHIVE_COLUMNS if self._table() is Table.ARCHIVE else _read.MESSAGE_COLUMNS
        )

    def reader(self, schema: StructType) -> DataSourceReader:
        return _BatchReader(read_options(self.options))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return _StreamReader(stream_read_options(self.options))

    def writer(self, schema: StructType, overwrite: bool) -> _BatchWriter:
        if overwrite:
            raise InvalidArgumentError(
                "lonnymq only appends to a queue: use mode('append'), not overwrite"
            )
        return _BatchWriter(write_options(self.options, _columns(schema), streaming=False))

    def streamWriter(self, schema: StructType, overwrite: bool) -> _StreamWriter:
        if overwrite:
            raise InvalidArgumentError("lonnymq only appends to a queue: use outputMode('append')")
        opts = write_options(self.options, _columns(schema), streaming=True)
        # What the micro-batch's tasks and the writer that commits or aborts it (a new one,
        # made from a new data source: only the options are the same) both know.
        # Not the sinkId: two queries given one sinkId by mistake (the second is refused at
        # its commit) would stage under one id, and the second's abort clear the first's rows.
        checkpoint = self.options.get("checkpointLocation")
        key = f"checkpoint {checkpoint}" if checkpoint else None
        return _StreamWriter(opts, key)


# -- batch read --------------------------------------------------------------------------


@dataclass(frozen=True)
class IdRange(InputPartition):
    """Ids ``lo`` to ``hi`` (inclusive) of the table: one task."""

    lo: int
    hi: int


class _BatchReader(DataSourceReader):
    def __init__(self, opts: ReadOptions) -> None:
        self._opts = opts

    def partitions(self) -> Sequence[InputPartition]:
        return [IdRange(lo, hi) for lo, hi in _read.plan_ranges(self._opts)]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        if not isinstance(partition, IdRange):  # an empty table: one empty partition
            return iter(())
        return _read.read_range(self._opts, partition.lo, partition.hi)


# -- streaming read ----------------------------------------------------------------------


@dataclass(frozen=True)
class BatchSlice(InputPartition):
    """Slice ``index`` of ``slices`` (by message id) of the batches in (after, upto]."""

    after: int
    upto: int
    index: int
    slices: int


def _offset_owner(offset: dict[str, Any]) -> str | None:
    """The owner token an offset names (None when it names none, as the initial offset)."""
    owner = offset.get("owner")
    return None if owner is None else str(owner)


class _StreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Offsets are ``{"batch": N, "owner": T}``: the consumer's planned-batch counter, and the
    token of the checkpoint they belong to. ``initialOffset`` must be pure (Spark calls it
    again to replay a first batch), so it names no owner: the first plan from it is a new
    checkpoint's, which takes the consumer over under a token made by this reader, and every
    offset planned after names it."""

    def __init__(self, opts: StreamReadOptions) -> None:
        self._opts = opts
        self._runner: _read.ConsumerRunner | None = None
        self._max_id: int | None = None
        self._started_at: int | None = None
        self._available_now = False
        self._token: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Executors get the options only: never a connection or a thread.
        return {
            "_opts": self._opts,
            "_runner": None,
            "_max_id": None,
            "_started_at": None,
            "_available_now": False,
            "_token": None,
        }

    def _consumer(self) -> _read.ConsumerRunner:
        if self._runner is None:
            self._runner = _read.ConsumerRunner(self._opts)
        return self._runner

    def _owner(self, start: dict[str, Any]) -> tuple[str | None, bool]:
        """The checkpoint's owner token for a plan after ``start``, and whether that plan takes
        the consumer over (the first plan of a new checkpoint)."""
        owner = _offset_owner(start)
        if owner is not None:
            return owner, False
        if int(start["batch"]) != 0:
            return None, False  # a checkpoint from before owners
        if self._token is None:
            self._token = uuid.uuid4().hex
        return self._token, True

    def initialOffset(self) -> dict[str, Any]:
        return {"batch": 0}

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self._opts.max_messages)

    def prepareForTriggerAvailableNow(self) -> None:
        self._available_now = True
        consumer = self._consumer()
        # The clock first: every message up to the horizon was created by then.
        self._started_at = consumer.clock()
        self._max_id = consumer.max_id()

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        if isinstance(limit, ReadMaxRows):
            wanted = max(1, min(limit.max_rows, MAX_MESSAGES_PER_BATCH))
        elif isinstance(limit, ReadAllAvailable):
            wanted = MAX_MESSAGES_PER_BATCH
        else:
            wanted = self._opts.max_messages
        begin = int(start["batch"])
        owner, take_over = self._owner(start)
        if self._available_now and self._max_id is None:
            # The queue was empty when the run started: nothing is available now. Still
            # finish the batch Spark has just committed.
            self._consumer().ack(begin, owner)
            return start
        batch_no, size = self._consumer().plan(begin, wanted, self._max_id, owner, take_over)
        if size == 0 and self._available_now:
            batch_no = self._wait_and_plan(begin, wanted, owner, take_over)
        if batch_no == begin:
            return start  # nothing planned: the same offset
        return {"batch": batch_no} if owner is None else {"batch": batch_no, "owner": owner}

    def _wait_and_plan(self, start: int, wanted: int, owner: str | None, take_over: bool) -> int:
        """Trigger.AvailableNow, after a plan that found nothing: while messages up to the
        horizon, due when the run started, are held back only by their channel's policy
        (release_interval_ms, or max_concurrency slots taken), wait until the first may leave
        and plan again. Gives up (the run ends; they are left for the next one) when that is
        further away than ``availableNowWaitMs`` from this call, or once that long has passed
        without a plan finding one. Messages of a paused channel (max_concurrency 0), locked
        ones and those scheduled after the start are not waited for."""
        consumer = self._consumer()
        assert self._max_id is not None
        assert self._started_at is not None
        deadline = time.monotonic() + self._opts.available_now_wait_ms / 1000
        while True:
            channels, wait_ms = consumer.waiting(self._max_id, self._started_at)
            if channels == 0:
                return start
            wait = wait_ms / 1000 if wait_ms > 0 else _POLL_S
            if time.monotonic() + wait > deadline:
                return start
            if wait > _MAX_SLEEP_S:
                time.sleep(_MAX_SLEEP_S)  # then look again
                continue
            time.sleep(wait)
            batch_no, size = consumer.plan(start, wanted, self._max_id, owner, take_over)
            if size > 0:
                return batch_no

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        consumer = self._consumer()  # a replay after a restart starts here: heartbeat
        after, upto = int(start["batch"]), int(end["batch"])
        if upto <= after:
            return []
        # Before any task reads the batches: are they this checkpoint's? (A replay of a first
        # batch starts from initialOffset, which names no owner; its end does.)
        consumer.claim_read(_offset_owner(end), after, upto)
        slices = self._opts.partitions
        return [BatchSlice(after, upto, index, slices) for index in range(slices)]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        assert isinstance(partition, BatchSlice)
        return _read.read_slice(
            self._opts, partition.after, partition.upto, partition.index, partition.slices
        )

    def commit(self, end: dict[str, Any]) -> None:
        self._consumer().ack(int(end["batch"]), _offset_owner(end))

    def stop(self) -> None:
        if self._runner is not None:
            self._runner.close()
            self._runner = None


# -- batch write -------------------------------------------------------------------------


@dataclass(frozen=True)
class StagedTask(WriterCommitMessage):
    """What one successful write task staged."""

    write_id: str
    task_tag: str
    n_rows: int
    sink_id: str | None = None
    batch_id: int | None = None
    skipped: bool = False
    query_id: str | None = None


def _staged(messages: list[WriterCommitMessage | None]) -> list[StagedTask]:
    """The messages of the tasks that succeeded (a failed task's is None)."""
    return [m for m in messages if isinstance(m, StagedTask)]


@dataclass(frozen=True)
class DirectTask(WriterCommitMessage):
    """What one successful mode=direct task enqueued."""

    result: _write.WriteResult


class _BatchWriter(DataSourceArrowWriter):
    def __init__(self, opts: WriteOptions) -> None:
        self._opts = opts
        # Made on the driver, so every task and the commit share it (one pickle).
        self._write_id = uuid.uuid4().hex
        self._sink_id = opts.write_id or self._write_id

    def write(self, iterator: Iterator[Any]) -> WriterCommitMessage:
        if self._opts.mode is WriteMode.DIRECT:
            result = _write.create_direct(self._opts, iterator)
            _maybe_fail(self._opts)
            return DirectTask(result)
        tag = _task_tag()
        n_rows = _write.stage(self._opts, self._write_id, tag, iterator)
        _maybe_fail(self._opts)
        return StagedTask(self._write_id, tag, n_rows)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        if self._opts.mode is WriteMode.DIRECT:
            _write.check_direct(
                self._opts, [m.result for m in messages if isinstance(m, DirectTask)]
            )
            return
        staged = _staged(messages)
        try:
            _write.commit(
                self._opts,
                sink_id=self._sink_id,
                batch_id=0,
                write_id=self._write_id,
                task_tags=[m.task_tag for m in staged],
                expected_rows=sum(m.n_rows for m in staged),
                streaming=False,
                named=self._opts.write_id is not None,
            )
        except InvalidArgumentError:
            _write.clear(self._opts, [self._write_id])  # a refused writeId: what was staged
            raise

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        if self._opts.mode is WriteMode.STAGED:
            _write.clear(self._opts, [self._write_id])


# -- streaming write ---------------------------------------------------------------------


class _StreamWriter(DataSourceStreamArrowWriter):
    """Exactly once per micro-batch: the batch's commit is recorded under (sink id, batch id)
    in the transaction that enqueues it, so a replayed batch enqueues nothing.

    Spark commits or aborts a micro-batch on a new writer, not the one its tasks got, and
    passes no message for a failed task. So the tasks stage under a write id the aborting
    writer can derive: from the batch id and ``key``, the query's ``checkpointLocation``
    option (one query at a time runs on a checkpoint); an abort then clears what every attempt
    staged even when no task succeeded. A batch re-run after a restart stages under the same
    id: its commit promotes the winning attempts only and clears the rest, the crashed run's
    included. Without that option the id is the query id's (which only tasks know): such an
    abort clears only what the successful tasks name, and purge_staging the rest."""

    def __init__(self, opts: WriteOptions, key: str | None) -> None:
        self._opts = opts
        self._key = key

    def _write_id(self, batch_id: int, query_id: str | None = None) -> str | None:
        key = self._key if self._key is not None else query_id and f"query {query_id}"
        if key is None:
            return None
        return f"{hashlib.sha256(key.encode()).hexdigest()[:32]}-{batch_id}"

    def write(self, iterator: Iterator[Any]) -> StagedTask:
        ctx = TaskContext.get()
        batch = ctx.getLocalProperty("streaming.sql.batchId") if ctx is not None else None
        query = ctx.getLocalProperty("sql.streaming.queryId") if ctx is not None else None
        if batch is None or query is None:
            raise InvalidArgumentError("the lonnymq stream writer runs only in a streaming query")
        batch_id = int(batch)
        write_id = self._write_id(batch_id, str(query))
        assert write_id is not None
        sink_id = self._opts.sink_id or str(query)
        tag = _task_tag()
        if _write.is_committed(self._opts, sink_id, batch_id):
            _write.drain(iterator)
            return StagedTask(
                write_id, tag, 0, sink_id, batch_id, skipped=True, query_id=str(query)
            )
        n_rows = _write.stage(self._opts, write_id, tag, iterator)
        _maybe_fail(self._opts)
        return StagedTask(write_id, tag, n_rows, sink_id, batch_id, query_id=str(query))

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        staged = _staged(messages)
        sink_ids = {m.sink_id for m in staged if m.sink_id is not None}
        if self._opts.sink_id is not None:
            sink_ids = {self._opts.sink_id}
        if not sink_ids:
            return  # no task ran: nothing to enqueue or record
        if len(sink_ids) > 1:
            raise InvalidArgumentError(f"one micro-batch wrote for several sinks: {sink_ids}")
        sink_id = sink_ids.pop()
        write_ids = {m.write_id for m in staged}
        # A sinkId named by the user may be reused by a query from a new checkpoint, whose
        # batch ids start at 0 again: its tasks found the old query's batches recorded and
        # skipped them. The first query to commit owns the sinkId; others are refused.
        owners = sorted({m.query_id for m in staged if m.query_id is not None})
        try:
            _write.commit(
                self._opts,
                sink_id=sink_id,
                batch_id=batchId,
                write_id=next(iter(write_ids)) if len(write_ids) == 1 else "",
                task_tags=[m.task_tag for m in staged if not m.skipped],
                expected_rows=sum(m.n_rows for m in staged),
                streaming=True,
                owner=owners[0] if owners and self._opts.sink_id is not None else None,
            )
        except InvalidArgumentError:
            _write.clear(self._opts, write_ids)  # what the tasks staged
            raise

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        # The batch's write id: when no task succeeded, no message names it, yet failed
        # attempts staged under it.
        write_ids = {m.write_id for m in _staged(messages)}
        derived = self._write_id(batchId)
        if derived is not None:
            write_ids.add(derived)
        _write.clear(self._opts, write_ids)
