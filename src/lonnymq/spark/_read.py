"""Reads: id-range scans of the queue or its archive, and the streaming consumer's runner.

The output schemas are declared once here, as Spark DDL and as the matching Arrow schema
(Spark checks a yielded ``RecordBatch`` against its own schema, nullability included).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import InvalidArgumentError
from . import _db
from ._errors import ConsumerBusyError, ConsumerOwnedError
from ._options import Connection, ReadOptions, StreamReadOptions, Table

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = [
    "ARCHIVE_COLUMNS",
    "MESSAGE_COLUMNS",
    "STREAM_COLUMNS",
    "ConsumerRunner",
    "arrow_schema",
    "ddl",
    "plan_ranges",
    "read_range",
    "read_slice",
]

log = logging.getLogger("lonnymq.spark")


@dataclass(frozen=True, slots=True)
class Column:
    name: str
    kind: str  # "long", "int", "string", "binary" or "boolean"
    nullable: bool


def _cols(spec: str) -> tuple[Column, ...]:
    columns = []
    for item in spec.split(","):
        name, kind, *flags = item.split()
        columns.append(Column(name, kind, nullable="null" in flags))
    return tuple(columns)


MESSAGE_COLUMNS = _cols(
    "id long, channel string, content binary, state binary null, dedup_key string null,"
    " num_attempts int, dequeue_at long, is_locked boolean, unlock_at long null,"
    " created_at long"
)
ARCHIVE_COLUMNS = _cols(
    "id long, channel string, content binary, state binary null, dedup_key string null,"
    " num_attempts int, outcome string, error string null, created_at long, dequeue_at long,"
    " locked_at long null, finished_at long"
)
STREAM_COLUMNS = _cols(
    "id long, channel string, content binary, state binary null, num_attempts int,"
    " dequeue_at long, batch_no long"
)

_DDL_TYPES = {
    "long": "BIGINT",
    "int": "INT",
    "string": "STRING",
    "binary": "BINARY",
    "boolean": "BOOLEAN",
}


def ddl(columns: tuple[Column, ...]) -> str:
    """The Spark schema as DDL."""
    return ", ".join(
        f"{c.name} {_DDL_TYPES[c.kind]}{'' if c.nullable else ' NOT NULL'}" for c in columns
    )


def arrow_schema(columns: tuple[Column, ...]) -> pa.Schema:
    """The Arrow schema Spark expects for these columns."""
    import pyarrow as pa

    types = {
        "long": pa.int64(),
        "int": pa.int32(),
        "string": pa.string(),
        "binary": pa.binary(),
        "boolean": pa.bool_(),
    }
    return pa.schema([pa.field(c.name, types[c.kind], nullable=c.nullable) for c in columns])


def _batches(
    rows_source: Iterator[list[tuple[Any, ...]]], columns: tuple[Column, ...]
) -> Iterator[pa.RecordBatch]:
    import pyarrow as pa

    schema = arrow_schema(columns)
    for rows in rows_source:
        if not rows:
            continue
        arrays = [
            pa.array(values, type=schema.field(i).type)
            for i, values in enumerate(zip(*rows, strict=True))
        ]
        yield pa.RecordBatch.from_arrays(arrays, schema=schema)


@contextmanager
def _snapshot_transaction(db: _db.Conn, conn: Connection, snapshot: str | None) -> Iterator[None]:
    """A transaction, in the exported snapshot when one is given."""
    with _db.translated(conn.schema), db.transaction():
        if snapshot is not None:
            _db.enter_snapshot(db, snapshot)
        yield


def plan_ranges(opts: ReadOptions) -> list[tuple[int, int]]:
    """Split the table's ids, as they are now (or in the snapshot), into id ranges."""
    with _db.connect(opts.conn, autocommit=False) as db:
        with _snapshot_transaction(db, opts.conn, opts.snapshot):
            rows = _db.run(db, opts.conn.schema, "spark_scan_bounds", {"table": str(opts.table)})
        low, high = rows[0]
    if low is None:
        return []
    span = high - low + 1
    parts = min(opts.partitions, span)
    step = -(-span // parts)
    return [(lo, min(lo + step - 1, high)) for lo in range(low, high + 1, step)]


def read_range(opts: ReadOptions, lo: int, hi: int) -> Iterator[pa.RecordBatch]:
    """The rows with lo <= id <= hi, as record batches of at most ``fetchSize`` rows."""
    schema = opts.conn.schema
    name = "spark_message_scan" if opts.table is Table.MESSAGE else "spark_archive_scan"
    columns = MESSAGE_COLUMNS if opts.table is Table.MESSAGE else ARCHIVE_COLUMNS
    db = _db.executor_connection(opts.conn)

    def fetch() -> Iterator[list[tuple[Any, ...]]]:
        with (
            _snapshot_transaction(db, opts.conn, opts.snapshot),
            db.cursor(name="lonnymq_spark_scan") as cursor,
        ):
            cursor.execute(_db.statement(schema, name), {"lo": lo, "hi": hi})
            while rows := cursor.fetchmany(opts.fetch_size):
                yield rows

    yield from _batches(fetch(), columns)


def read_slice(
    opts: StreamReadOptions, after: int, upto: int, index: int, slices: int
) -> Iterator[pa.RecordBatch]:
    """Slice ``index`` of ``slices`` of the recorded batches in (after, upto]."""
    db = _db.executor_connection(opts.conn)
    params = {
        "consumer": opts.consumer,
        "after": after,
        "upto": upto,
        "slice": index,
        "slices": slices,
    }

    def fetch() -> Iterator[list[tuple[Any, ...]]]:
        with _db.translated(opts.conn.schema), db.transaction():
            yield _db.run(db, opts.conn.schema, "spark_batch_read", params)

    yield from _batches(fetch(), STREAM_COLUMNS)


class ConsumerRunner:
    """The driver side of a streaming read, alive as long as Spark's source runner process.

    It owns the consumer (a session advisory lock on its connection refuses a second query
    with the same name), plans and acknowledges batches, and renews the locks of planned
    batches from a heartbeat thread every ``lock_ms / 3``. Plans and heartbeats take turns (one
    thread lock), since both touch the same messages.
    """

    def __init__(self, opts: StreamReadOptions) -> None:
        self._opts = opts
        self._db = _db.connect(opts.conn)
        try:
            taken = _db.run(
                self._db, opts.conn.schema, "spark_consumer_lock", {"consumer": opts.consumer}
            )
            if not taken[0][0]:
                raise ConsumerBusyError(
                    f"lonnymq consumer {opts.consumer!r} is in use by another running streaming "
                    f"query: give each query its own 'consumer' option"
                )
        except BaseException:
            self._db.close()
            raise
        self._turn = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._heartbeat, name=f"lonnymq-heartbeat-{opts.consumer}", daemon=True
        )
        self._thread.start()

    def plan(
        self, start: int, limit: int, max_id: int | None, owner: str | None, take_over: bool
    ) -> tuple[int, int]:
        """Ack batches <= start, release later ones, plan batch start+1: (batch_no, size).
        ``owner`` is the checkpoint's (see :meth:`_claim`); ``take_over``: a new checkpoint's
        first plan, which makes the consumer its own when it finds messages."""
        params = {
            "consumer": self._opts.consumer,
            "start": start,
            "limit": limit,
            "lock_ms": self._opts.lock_ms,
            "max_id": max_id,
        }
        with self._transaction():
            if not take_over:
                self._claim(owner, "plan", start)
            rows = _db.run(self._db, self._opts.conn.schema, "spark_batch_plan", params)
            batch_no, size, acked, released = rows[0]
            if take_over and size:
                self._claim(owner, "take_over", 0)
        if acked or released or size:
            log.debug(
                "consumer %s: acked %s, released %s, planned batch %s with %s messages",
                self._opts.consumer,
                acked,
                released,
                batch_no,
                size,
            )
        return int(batch_no), int(size)

    def ack(self, batch_no: int, owner: str | None) -> int:
        """Finish the messages of batches <= batch_no; returns how many."""
        if batch_no == 0:
            return 0  # no batch is numbered 0
        params = {"consumer": self._opts.consumer, "batch_no": batch_no}
        with self._transaction():
            self._claim(owner, "ack", batch_no)
            rows = _db.run(self._db, self._opts.conn.schema, "spark_batch_ack", params)
        return int(rows[0][0])

    def claim_read(self, owner: str | None, after: int, upto: int) -> None:
        """Before the logged batches in (after, upto] are read: refuse (ConsumerOwnedError)
        unless they are this checkpoint's."""
        with self._transaction():
            self._claim(owner, "read", after, upto)

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        """One transaction on the runner's connection, taking turns with the heartbeat."""
        with self._turn, _db.translated(self._opts.conn.schema), self._db.transaction():
            yield

    def _claim(self, owner: str | None, step: str, batch: int, end: int | None = None) -> None:
        """Check that the checkpoint whose offsets name ``owner`` (None: an offset that names
        no owner, as the initial one) may go on with the consumer, and record how far it got.
        The consumer belongs to the checkpoint that last took it over; a copy of it that
        another run has gone past is refused too."""
        params = {
            "consumer": self._opts.consumer,
            "owner": owner,
            "step": step,
            "batch": batch,
            "end": end,
        }
        try:
            _db.run(self._db, self._opts.conn.schema, "spark_consumer_claim", params)
        except InvalidArgumentError as err:
            raise ConsumerOwnedError(str(err)) from err

    def max_id(self) -> int | None:
        """The largest message id now (the horizon of Trigger.AvailableNow)."""
        with self._turn:
            rows = _db.run(
                self._db, self._opts.conn.schema, "spark_scan_bounds", {"table": "message"}
            )
        return None if rows[0][1] is None else int(rows[0][1])

    def clock(self) -> int:
        """The queue's clock now, in ms (the moment Trigger.AvailableNow's run starts)."""
        with self._turn:
            rows = _db.run(self._db, self._opts.conn.schema, "epoch", {})
        return int(rows[0][0])

    def waiting(self, max_id: int, due_by: int) -> tuple[int, int]:
        """Messages up to ``max_id`` due by ``due_by`` that only their channel's policy holds
        back: (how many channels hold some, ms until the first may leave; 0 when it may now,
        or when a channel's max_concurrency slots are all taken and only polling tells)."""
        params = {"max_id": max_id, "due_by": due_by}
        with self._turn:
            rows = _db.run(self._db, self._opts.conn.schema, "spark_batch_waiting", params)
        channels, next_at, now_at = rows[0]
        if not channels:
            return 0, 0
        return int(channels), max(0, int(next_at) - int(now_at))

    def _heartbeat(self) -> None:
        interval = self._opts.lock_ms / 3000
        db: _db.Conn | None = None
        params = {"consumer": self._opts.consumer, "lock_ms": self._opts.lock_ms}
        while not self._stop.wait(interval):
            try:
                if db is None or db.closed or db.broken:
                    db = _db.connect(self._opts.conn)
                with self._turn:
                    rows = _db.run(db, self._opts.conn.schema, "spark_batch_heartbeat", params)
                if rows[0][1]:
                    log.warning(
                        "consumer %s: %s planned message(s) lost their lock (it expired and "
                        "another consumer took them)",
                        self._opts.consumer,
                        rows[0][1],
                    )
            except Exception:
                log.exception("consumer %s: heartbeat failed", self._opts.consumer)
        if db is not None:
            db.close()

    def close(self) -> None:
        """Stop the heartbeat and give up the consumer. Planned batches stay as they are:
        the last one may be in the sink already, so releasing it would deliver it twice."""
        self._stop.set()
        self._thread.join(timeout=10)
        self._db.close()
