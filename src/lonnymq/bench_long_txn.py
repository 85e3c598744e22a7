"""A `Worker` under a steady offered load, before, while and after another session holds the
database's xmin horizon back: pickup latency, completion rate, backlog, dead rows, index sizes
and the pages each statement of a take and a finish touches, per window.

    lonnymq bench --long-txn [--hold 600] [--quick]
    python benchmarks/long_txn.py [--dsn DSN] [--hold 600] [--clean 120] [--recovery 180]
                                  [--window 10] [--rate N] [--capacity 20] [--concurrency 32]
                                  [--handler-ms 1] [--channels 1] [--holders idle,reader]
                                  [--spark-rows 1000000]
                                  [--schema NAME] [--out DIR] [--quick]

Without ``--dsn`` it uses ``$LONNYMQ_DSN``, else starts the embedded PostgreSQL and stops it at
the end.

The load: one producer creates messages at ``--rate`` per second (default: half of the clean
capacity, measured first in the same run: a `Worker` draining a backlog for ``--capacity``
seconds, after which the schema is installed afresh), spread over ``--channels`` channels, each
message carrying the time it was created. One `Worker` (``--concurrency`` handlers, default
32; its default lock, heartbeat and maintenance) runs a handler that sleeps ``--handler-ms``.
For each holder of ``--holders`` (default both, in this order), from a freshly installed queue:

- ``clean``: nothing holds the horizon (``--clean`` seconds);
- ``idle``: another session began a transaction, took a transaction id and idles in it
  (``--hold`` seconds); or ``reader``: another session runs one long ``SELECT`` over a table of
  its own (``pg_sleep`` inside the query, ``--hold`` seconds): an active reader, holding its
  snapshot while it runs; or ``spark``: a Spark job (``local[2]``, in this process) reads a
  queue of ``--spark-rows`` messages (default 10^6, written before the run in a schema of its
  own) with ``spark.read`` and counts them per channel, again and again, all in one snapshot
  (``lonnymq.spark.snapshot``), for ``--hold`` seconds and until its read under way ends: the
  worker shares the machine with Spark too;
- ``recovery`` after it (``--recovery`` seconds): the Worker's maintenance and autovacuum may
  clean up, and the Worker works off the backlog.

Each window of ``--window`` seconds records: messages created and completed per second; pickup
latency p50/p99 (creation to handler start) of the messages picked up in it; the backlog
(created, not yet picked up); per table (``message``, ``channel``) ``n_dead_tup`` and heap
pages, and each index's pages; the age of the oldest horizon held in the database; the pages
touched (shared buffers hit or read) by the take's index probes, run by ``EXPLAIN (ANALYZE,
BUFFERS)`` without locks (the expired-lock probe, the due-channel probe, the channel-head probe
and the channel-row look-up of a finish); and, when the server has ``pg_stat_statements``
loaded with ``pg_stat_statements.track = all``, the calls, pages per call and time per call of
the statements inside the queue's functions (the same probes as the Worker ran them, and the
finish's statements), with the statements that touched the most pages.

Prints a table per window and one per phase; writes ``long_txn.json`` to ``--out`` (default
``benchmarks/results``). The run's schemas, the queue's (``--schema``, by default a name of the
run's own: ``lonnymq_long_txn_<pid>_<token>``), the reader's (that name and ``_aux``) and the
spark holder's (that name and ``_spark``), are dropped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from ._bench_env import run_schema
from .embedded import resolve_dsn
from .errors import InvalidArgumentError
from .queue import Message, Queue
from .types import NewMessage
from .worker import Worker

__all__ = ["DEFAULT", "QUICK", "Settings", "main", "run_long_txn"]

HOLDERS = ("idle", "reader", "spark")
# Messages in the queue a ``spark`` holder reads, over this many channels, written this many a
# call.
SPARK_CHANNELS = 1_000
SPARK_FILL_BATCH = 10_000
APP = "lonnymq_long_txn"
STAMP = struct.Struct("<d")

# The statements of a take and a finish, as pg_stat_statements stores them (the text inside
# the functions, whitespace collapsed, constants as $n): a name for each, the texts that only
# it contains, and texts it does not contain.
STATEMENTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # Take: the oldest expired lock; the due channel (locked); that channel's head, locked;
    # the channel's next time; riding along on a busy channel (its look-up and its head); an
    # empty answer's earliest time.
    "expired_lock": (("e.is_locked AND e.unlock_at <=",), ()),
    "due_channel": (("c.next_dequeue_at <= v_now", "c.turn LIMIT", "SKIP LOCKED"), ()),
    "channel_head": (("h.channel = v_channel.name AND NOT h.is_locked",), ()),
    "channel_next": (("SET next_dequeue_at = n.next_at",), ()),
    "busy_channel": (("SELECT c.name FROM channel c", "c.next_dequeue_at <= v_now"), ("SKIP",)),
    "ride_along": (("h.channel = v_busy AND NOT h.is_locked",), ()),
    "rotate": (("r.channel = p_channel AND NOT r.is_locked",), ()),
    "retry_at": (("SELECT least(", "m.is_locked"), ()),
    # Finish: the delete, the look-up of the channel's policy.
    "finish_delete": (("DELETE FROM message m WHERE m.id = p_id",), ()),
    "finish_policy": (("c.has_policy FROM channel c WHERE c.name = v_message.channel",), ()),
    # The calls the Worker and the producer make.
    "complete_and_dequeue": (("message_complete_and_dequeue(",), ()),
    "settle": (("message_settle(",), ()),
    "dequeue_many": (("message_dequeue_many(",), ()),
    "create_many": (("message_create_many(",), ()),
}


@dataclass(frozen=True)
class Settings:
    """Durations (seconds) and load of one run; ``rate`` None: half the measured capacity."""

    clean: float
    hold: float
    recovery: float
    window: float
    capacity: float
    rate: float | None
    concurrency: int
    handler_ms: float
    channels: int
    holders: tuple[str, ...]
    spark_rows: int = 1_000_000

    def __post_init__(self) -> None:
        for name in ("clean", "hold", "recovery", "window", "capacity"):
            value = getattr(self, name)
            if not value > 0:
                raise InvalidArgumentError(
                    f"{name} must be a positive number of seconds, got {value}"
                )
        if self.rate is not None and not self.rate > 0:
            raise InvalidArgumentError(f"rate must be a positive number, got {self.rate}")
        if not 1 <= self.concurrency <= 256:
            raise InvalidArgumentError(
                f"concurrency must be between 1 and 256, got {self.concurrency}"
            )
        if not self.handler_ms >= 0:
            raise InvalidArgumentError(f"handler_ms must not be negative, got {self.handler_ms}")
        if not 1 <= self.channels <= 10_000:
            raise InvalidArgumentError(f"channels must be between 1 and 10000, got {self.channels}")
        if not self.holders or any(h not in HOLDERS for h in self.holders):
            raise InvalidArgumentError(
                f"holders must be one or more of {', '.join(HOLDERS)}, got {self.holders}"
            )
        if not 1 <= self.spark_rows <= 100_000_000:
            raise InvalidArgumentError(
                f"spark_rows must be between 1 and 100000000, got {self.spark_rows}"
            )


DEFAULT = Settings(
    clean=120, hold=600, recovery=180, window=10, capacity=20, rate=None, concurrency=32,
    handler_ms=1, channels=1, holders=("idle", "reader"),
)  # fmt: skip
QUICK = Settings(
    clean=2, hold=3, recovery=2, window=1, capacity=2, rate=None, concurrency=8, handler_ms=1,
    channels=1, holders=("idle", "reader"),
)  # fmt: skip


class _Load:
    """The producer and the Worker, and what they counted."""

    def __init__(self, dsn: str, schema: str, settings: Settings) -> None:
        self.settings = settings
        self.lock = threading.Lock()
        self.created = 0
        self.started = 0
        self.pickups: list[float] = []  # ms, since the last take()
        self.stop_producing = threading.Event()
        self.producer_queue = Queue(dsn, schema=schema, pool_size=2)
        self.queue = Queue(dsn, schema=schema, pool_size=settings.concurrency + 4)
        self.worker = Worker(self.queue, self._handle, concurrency=settings.concurrency)
        self.threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []

    def _handle(self, message: Message) -> None:
        now = time.time()
        (created,) = STAMP.unpack(message.content)
        with self.lock:
            self.started += 1
            self.pickups.append((now - created) * 1000)
        if self.settings.handler_ms:
            time.sleep(self.settings.handler_ms / 1000)

    def _produce(self, rate: float) -> None:
        names = [f"c{i + 1}" for i in range(self.settings.channels)]
        begun = time.monotonic()
        sent = 0
        while not self.stop_producing.is_set():
            due = int((time.monotonic() - begun) * rate) - sent
            if due <= 0:
                self.stop_producing.wait(0.002)
                continue
            due = min(due, 1000)
            # Counted before they commit, so that no handler starts one not counted yet (the
            # backlog, created minus picked up, never goes below zero); a failed create stops
            # the run.
            with self.lock:
                self.created += due
            stamp = STAMP.pack(time.time())
            self.producer_queue.create_many(
                NewMessage(stamp, channel=names[(sent + i) % len(names)]) for i in range(due)
            )
            sent += due

    def _guard(self, target: Callable[..., object], *args: object) -> Callable[[], None]:
        def run() -> None:
            try:
                target(*args)
            except BaseException as err:  # reported by stop()
                self.errors.append(err)

        return run

    def start(self, rate: float | None) -> None:
        def work() -> None:
            self.worker.run(handle_signals=False)

        self.threads.append(threading.Thread(target=self._guard(work), name="bench-worker"))
        if rate is not None:
            self.threads.append(
                threading.Thread(target=self._guard(self._produce, rate), name="bench-producer")
            )
        for thread in self.threads:
            thread.start()

    def counts(self) -> tuple[int, int, int, list[float]]:
        """Created, picked up, completed so far, and the pickups since the last call."""
        with self.lock:
            pickups, self.pickups = self.pickups, []
            return self.created, self.started, self.worker.stats.completed, pickups

    def stop(self) -> None:
        self.stop_producing.set()
        self.worker.stop()
        for thread in self.threads:
            thread.join(120)
        self.producer_queue.close()
        self.queue.close()
        if self.errors:
            raise RuntimeError(f"the load failed: {self.errors[0]!r}") from self.errors[0]


class LongTxnBench:
    """One run against one server."""

    def __init__(
        self,
        dsn: str,
        settings: Settings,
        schema: str | None = None,
        log: Callable[[str], None] = print,
    ) -> None:
        self.dsn = dsn
        self.settings = settings
        # The run's own unless given: another run on the server never drops it.
        self.schema = schema or run_schema(APP)
        self.aux = f"{self.schema}_aux"  # the reader's table; pg_stat_statements if we create it
        self.spark_schema = f"{self.schema}_spark"  # the queue a spark holder reads
        self._spark: Any = None  # its SparkSession, started before the load
        self._resources = ExitStack()  # what teardown() closes (the Spark session)
        self.log = log
        self.started = time.monotonic()
        self.windows: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.statements_schema: str | None = None
        self.capacity: float | None = None
        self.rate: float = 0.0
        self._last: dict[str, Any] = {}

    # -- setup ---------------------------------------------------------------------------

    def _admin(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.dsn, autocommit=True, application_name=APP)

    def _s(self, *names: str) -> sql.Identifier:
        return sql.Identifier(self.schema, *names)

    def install(self) -> None:
        """A fresh queue schema (dropped first), vacuumed and analysed."""
        with self._admin() as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(self._s()))
        # With events on, as a Worker should run: an idle Worker wakes on a create's NOTIFY.
        with Queue(self.dsn, schema=self.schema, event_channel=self.schema[:63]) as queue:
            queue.install()
        with self._admin() as conn:
            for table in ("message", "channel"):
                conn.execute(sql.SQL("VACUUM (ANALYZE) {}").format(self._s(table)))

    def setup(self) -> None:
        with self._admin() as conn:
            aux = sql.Identifier(self.aux)
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(aux))
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(aux))
            conn.execute(
                sql.SQL(
                    "CREATE TABLE {}.report AS SELECT g AS id FROM generate_series(1, 1000) g"
                ).format(aux)
            )
            track = conn.execute(
                "SELECT setting FROM pg_settings WHERE name = 'pg_stat_statements.track'"
            ).fetchone()
            if track is not None and track[0] == "all":
                conn.execute(
                    sql.SQL("CREATE EXTENSION IF NOT EXISTS pg_stat_statements SCHEMA {}").format(
                        aux
                    )
                )
                found = conn.execute(
                    "SELECT n.nspname FROM pg_extension e JOIN pg_namespace n "
                    "ON n.oid = e.extnamespace WHERE e.extname = 'pg_stat_statements'"
                ).fetchone()
                self.statements_schema = str(found[0]) if found else None
        if "spark" in self.settings.holders:
            self._fill_spark_queue()
        self.install()

    def _fill_spark_queue(self) -> None:
        """The queue a ``spark`` holder reads: ``spark_rows`` messages over ``SPARK_CHANNELS``
        channels, due in a day (nothing takes them); and the Spark session, started now so
        that its start does not fall into a measured phase."""
        from .spark.bench import session

        rows = self.settings.spark_rows
        self.log(f"spark holder: {rows:,} messages into {self.spark_schema}; starting Spark")
        with self._admin() as conn:
            conn.execute(
                sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                    sql.Identifier(self.spark_schema)
                )
            )
        with Queue(self.dsn, schema=self.spark_schema) as queue:
            queue.install()
            later = queue.now() + 86_400_000
            for start in range(0, rows, SPARK_FILL_BATCH):
                queue.create_many(
                    [
                        NewMessage(b"%032d" % i, channel=f"c{i % SPARK_CHANNELS}", dequeue_at=later)
                        for i in range(start, min(rows, start + SPARK_FILL_BATCH))
                    ]
                )
        with self._admin() as conn:
            conn.execute(
                sql.SQL("VACUUM (ANALYZE) {}").format(sql.Identifier(self.spark_schema, "message"))
            )
        self._spark = self._resources.enter_context(session())

    def teardown(self) -> None:
        self._resources.close()
        self._spark = None
        with self._admin() as conn:
            for schema in (self.schema, self.aux, self.spark_schema):
                conn.execute(
                    sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
                )

    # -- measuring -----------------------------------------------------------------------

    def _tables(self, conn: psycopg.Connection[Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for table in ("message", "channel"):
            row = conn.execute(
                "SELECT n_dead_tup, n_live_tup, pg_relation_size(relid) / 8192, autovacuum_count, "
                "vacuum_count FROM pg_stat_user_tables WHERE schemaname = %s AND relname = %s",
                (self.schema, table),
            ).fetchone()
            if row is None:
                raise RuntimeError(f"no statistics for {self.schema}.{table}")
            indexes = dict(
                conn.execute(
                    "SELECT indexrelname, pg_relation_size(indexrelid) / 8192 "
                    "FROM pg_stat_user_indexes WHERE schemaname = %s AND relname = %s "
                    "ORDER BY indexrelname",
                    (self.schema, table),
                ).fetchall()
            )
            out[table] = {
                "n_dead_tup": row[0],
                "n_live_tup": row[1],
                "heap_pages": row[2],
                "vacuums": row[3] + row[4],
                "index_pages": {str(k): int(v) for k, v in indexes.items()},
            }
        return out

    def _probes(self, conn: psycopg.Connection[Any]) -> dict[str, Any]:
        """Pages touched and time of each index probe of a take (and of the channel-row
        look-up of a finish), run as the functions run them but without taking locks."""
        now_row = conn.execute(sql.SQL("SELECT {}()").format(self._s("epoch"))).fetchone()
        assert now_row is not None
        now = sql.Literal(int(now_row[0]))
        message, channel = self._s("message"), self._s("channel")
        # Channel c1's head is looked for as a take looks: from where its row says its waiting
        # messages begin (the low end when it has no row), by the index's hash of the name.
        mark = conn.execute(
            sql.SQL("SELECT c.head_at, c.head_id FROM {} c WHERE c.name = 'c1'").format(channel)
        ).fetchone() or (-(2**63), 0)
        probes = {
            "expired_lock": sql.SQL(
                "SELECT e.id FROM {} e WHERE e.is_locked AND e.unlock_at <= {} "
                "ORDER BY e.unlock_at, e.id LIMIT 1"
            ).format(message, now),
            "due_channel": sql.SQL(
                "SELECT c.name FROM {} c WHERE c.next_dequeue_at IS NOT NULL "
                "AND (c.max_concurrency IS NULL OR c.current_concurrency < c.max_concurrency) "
                "AND c.next_dequeue_at <= {} ORDER BY c.next_dequeue_at, c.turn LIMIT 1"
            ).format(channel, now),
            "channel_head": sql.SQL(
                "SELECT h.id FROM {} h WHERE {}(h.channel) = {}('c1') AND h.channel = 'c1' "
                "AND NOT h.is_locked AND (h.dequeue_at, h.id) >= ({}, {}) "
                "AND h.dequeue_at <= {} ORDER BY h.dequeue_at, h.id LIMIT 1"
            ).format(
                message,
                self._s("channel_hash"),
                self._s("channel_hash"),
                sql.Literal(int(mark[0])),
                sql.Literal(int(mark[1])),
                now,
            ),
            "channel_row": sql.SQL("SELECT c.has_policy FROM {} c WHERE c.name = 'c1'").format(
                channel
            ),
        }
        out: dict[str, Any] = {}
        with conn.transaction():
            conn.execute("SET LOCAL enable_seqscan = off")
            conn.execute("SET LOCAL enable_bitmapscan = off")
            conn.execute("SET LOCAL jit = off")
            for name, query in probes.items():
                row = conn.execute(
                    sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {}").format(query)
                ).fetchone()
                assert row is not None
                plan = row[0][0]
                top = plan["Plan"]
                out[name] = {
                    "pages": top.get("Shared Hit Blocks", 0) + top.get("Shared Read Blocks", 0),
                    "ms": plan.get("Execution Time"),
                }
        return out

    def _statements(self, conn: psycopg.Connection[Any]) -> dict[str, tuple[int, int, float]]:
        """Per statement text (whitespace collapsed), calls, pages and ms so far."""
        if self.statements_schema is None:
            return {}
        rows = conn.execute(
            sql.SQL(
                "SELECT query, sum(calls), sum(shared_blks_hit + shared_blks_read), "
                "sum(total_exec_time) FROM {}.pg_stat_statements "
                "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) "
                "GROUP BY query"
            ).format(sql.Identifier(self.statements_schema))
        ).fetchall()
        out: dict[str, tuple[int, int, float]] = {}
        for query, calls, pages, ms in rows:
            key = re.sub(r"\s+", " ", query).strip()
            old = out.get(key, (0, 0, 0.0))
            out[key] = (old[0] + int(calls), old[1] + int(pages), old[2] + float(ms))
        return out

    def _horizon_age(self, conn: psycopg.Connection[Any]) -> int | None:
        row = conn.execute(
            "SELECT max(greatest(age(backend_xmin), age(backend_xid))) FROM pg_stat_activity "
            "WHERE datname = current_database()"
        ).fetchone()
        return int(row[0]) if row and row[0] is not None else None

    # -- phases --------------------------------------------------------------------------

    def measure_capacity(self) -> float:
        """Messages per second one Worker completes from a backlog (the clean capacity)."""
        s = self.settings
        count = max(5_000, int(s.capacity * 4_000))
        with self._admin() as conn:
            conn.execute(
                sql.SQL(
                    "SELECT count(*) FROM {}("
                    "ARRAY(SELECT 'c' || (1 + (g %% %s::int)) FROM generate_series(1, %s::int) g), "
                    "ARRAY(SELECT %s::bytea FROM generate_series(1, %s::int)), NULL, NULL)"
                ).format(self._s("message_create_many")),
                (s.channels, count, STAMP.pack(time.time()), count),
            )
            conn.execute(sql.SQL("VACUUM (ANALYZE) {}").format(self._s("message")))
        load = _Load(self.dsn, self.schema, s)
        load.start(None)
        try:
            time.sleep(min(1.0, s.capacity / 4))  # the Worker's start (pool, first dequeue)
            _, _, first, _ = load.counts()
            begun = time.monotonic()
            time.sleep(s.capacity)
            _, _, last, _ = load.counts()
            seconds = time.monotonic() - begun
        finally:
            load.stop()
        if last >= count:
            raise RuntimeError(f"the backlog of {count} ran out while measuring the capacity")
        return (last - first) / seconds

    def phase(self, load: _Load, name: str, seconds: float, holder: str | None) -> None:
        """Windows of ``--window`` seconds for ``seconds`` (at least one)."""
        s = self.settings
        count = max(1, round(seconds / s.window))
        for _ in range(count):
            self.window(load, name, holder)

    def window(self, load: _Load, phase: str, holder: str | None) -> None:
        s = self.settings
        before = self._last
        deadline = before["clock"] + s.window
        time.sleep(max(0.0, deadline - time.monotonic()))
        sample = self._sample(load)
        seconds = sample["clock"] - before["clock"]
        pickups = sample.pop("pickups")
        statements = {}
        if self.statements_schema is not None:
            statements = _statement_deltas(before["statements"], sample["statements"])
        record = {
            "phase": phase,
            "holder": holder,
            "t": before["clock"] - self.started,
            "seconds": seconds,
            "created_per_s": (sample["created"] - before["created"]) / seconds,
            "completed_per_s": (sample["completed"] - before["completed"]) / seconds,
            "picked_up": len(pickups),
            **_percentiles(pickups),
            "backlog": sample["created"] - sample["started"],
            "horizon_age": sample["horizon_age"],
            "tables": sample["tables"],
            "probes": sample["probes"],
            "statements": statements.get("named"),
            "top_statements": statements.get("top"),
            "measure_seconds": sample["measure_seconds"],
        }
        self._last = sample
        self.windows.append(record)
        self.log(_window_line(record))

    def _sample(self, load: _Load) -> dict[str, Any]:
        clock = time.monotonic()
        created, started, completed, pickups = load.counts()
        with self._admin() as conn:
            out = {
                "clock": clock,
                "created": created,
                "started": started,
                "completed": completed,
                "pickups": pickups,
                "statements": self._statements(conn),
                "tables": self._tables(conn),
                "horizon_age": self._horizon_age(conn),
                "probes": self._probes(conn),
            }
        out["measure_seconds"] = time.monotonic() - clock
        return out

    def event(self, name: str, **extra: Any) -> None:
        self.events.append({"event": name, "t": time.monotonic() - self.started} | extra)

    @contextmanager
    def hold(self, kind: str) -> Iterator[None]:
        """Another session holding the horizon back, as ``kind`` says, until the block ends."""
        s = self.settings
        if kind == "idle":
            with psycopg.connect(self.dsn, application_name=f"{APP}_idle") as holder:
                holder.execute("SELECT txid_current()").fetchone()
                self.event("idle start")
                try:
                    yield
                finally:
                    holder.commit()
                    self.event("idle end")
            return
        if kind == "spark":
            with self._spark_reads():
                yield
            return
        reader = psycopg.connect(self.dsn, autocommit=True, application_name=f"{APP}_reader")
        failed: list[BaseException] = []

        def read() -> None:
            try:
                reader.execute(
                    sql.SQL("SELECT count(*), pg_sleep(%s) FROM {}.report").format(
                        sql.Identifier(self.aux)
                    ),
                    (s.hold + 3600,),
                ).fetchone()
            except psycopg.errors.QueryCanceled:
                pass
            except BaseException as err:
                failed.append(err)

        thread = threading.Thread(target=read, name="bench-reader")
        thread.start()
        try:
            # Wait until its query runs, holding its snapshot: this reader's backend, not any
            # reader of the server (another run's may be running too).
            with self._admin() as conn:
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    row = conn.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE pid = %s "
                        "AND state = 'active' AND backend_xmin IS NOT NULL",
                        (reader.info.backend_pid,),
                    ).fetchone()
                    if row and row[0]:
                        break
                    time.sleep(0.01)
                else:
                    raise RuntimeError("the reader's query did not start within 30 s")
            self.event("reader start")
            yield
        finally:
            reader.cancel_safe()
            thread.join(60)
            reader.close()
            self.event("reader end")
        if failed:
            raise RuntimeError(f"the reader failed: {failed[0]!r}") from failed[0]

    @contextmanager
    def _spark_reads(self) -> Iterator[None]:
        """A Spark job reading the spark holder's queue (every message, counted per channel)
        again and again, all in one snapshot (``lonnymq.spark.snapshot``), until the block
        ends and the read under way finishes."""
        from .spark import snapshot

        done = threading.Event()
        reads: list[tuple[float, int]] = []
        failed: list[BaseException] = []

        def read(snap: str) -> None:
            try:
                while not done.is_set():
                    started = time.monotonic()
                    df = (
                        self._spark.read.format("lonnymq")
                        .option("dsn", self.dsn)
                        .option("schema", self.spark_schema)
                        .option("snapshot", snap)
                        .load()
                    )
                    counted = sum(r["count"] for r in df.groupBy("channel").count().collect())
                    reads.append((time.monotonic() - started, counted))
            except BaseException as err:
                failed.append(err)

        with snapshot(self.dsn) as snap:
            thread = threading.Thread(target=read, args=(snap,), name="bench-spark")
            thread.start()
            self.event("spark start")
            try:
                yield
            finally:
                done.set()
                thread.join()
                self.event(
                    "spark end",
                    reads=len(reads),
                    rows=[n for _, n in reads],
                    seconds=[round(t, 1) for t, _ in reads],
                )
        if failed:
            raise RuntimeError(f"the Spark read failed: {failed[0]!r}") from failed[0]
        if any(n != self.settings.spark_rows for _, n in reads):
            raise RuntimeError(f"a Spark read counted {[n for _, n in reads]} messages")

    def run(self) -> dict[str, Any]:
        s = self.settings
        self.setup()
        self.started = time.monotonic()
        if s.rate is None:
            self.log(f"capacity: a Worker drains a backlog for {s.capacity:g}s")
            self.capacity = self.measure_capacity()
            self.rate = self.capacity / 2
            self.log(f"capacity {self.capacity:,.0f} msg/s; offered load {self.rate:,.0f} msg/s")
            self.install()
            self.event("capacity measured", capacity=self.capacity)
        else:
            self.rate = s.rate
        for i, kind in enumerate(s.holders):
            if i:
                self.install()  # each holder starts from a fresh, clean queue
            load = _Load(self.dsn, self.schema, s)
            self._last = self._sample(load)
            self._last.pop("pickups")
            load.start(self.rate)
            self.event("load start", rate=self.rate)
            try:
                self.log(_header())
                self.phase(load, "clean", s.clean, kind)
                with self.hold(kind):
                    self.phase(load, kind, s.hold, kind)
                self.phase(load, "recovery", s.recovery, kind)
            finally:
                load.stop()
        return self.report()

    # -- report --------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        summary = []
        for kind in self.settings.holders:
            for phase in ("clean", kind, "recovery"):
                rows = [w for w in self.windows if w["phase"] == phase and w["holder"] == kind]
                summary.append(_summarise(phase, kind, rows))
                if phase == kind:
                    summary.append(_summarise(f"{kind} (last)", kind, rows[-1:]))
        with self._admin() as conn:
            version = conn.execute("SHOW server_version").fetchone()
            server = dict(
                conn.execute(
                    "SELECT name, setting FROM pg_settings WHERE name IN ('autovacuum', "
                    "'autovacuum_naptime', 'shared_buffers', 'max_connections', "
                    "'pg_stat_statements.track')"
                ).fetchall()
            )
        return {
            "settings": asdict(self.settings) | {"holders": list(self.settings.holders)},
            "capacity_per_s": self.capacity,
            "offered_per_s": self.rate,
            "server_version": version[0] if version else None,
            "server_settings": server,
            "statements_measured": self.statements_schema is not None,
            "events": self.events,
            "summary": summary,
            "windows": self.windows,
        }


def _statement_deltas(
    before: dict[str, tuple[int, int, float]], after: dict[str, tuple[int, int, float]]
) -> dict[str, Any]:
    """Calls, pages per call and ms per call in a window: per named statement, and the
    statements that touched the most pages."""
    deltas: dict[str, tuple[int, int, float]] = {}
    for key, (calls, pages, ms) in after.items():
        old = before.get(key, (0, 0, 0.0))
        if calls > old[0]:
            deltas[key] = (calls - old[0], pages - old[1], ms - old[2])
    named: dict[str, Any] = {}
    for name, (wanted, unwanted) in STATEMENTS.items():
        calls = pages = 0
        ms = 0.0
        for key, (c, p, m) in deltas.items():
            if all(w in key for w in wanted) and not any(u in key for u in unwanted):
                calls, pages, ms = calls + c, pages + p, ms + m
        named[name] = {
            "calls": calls,
            "pages_per_call": pages / calls if calls else None,
            "ms_per_call": ms / calls if calls else None,
        }
    top = sorted(deltas.items(), key=lambda kv: kv[1][1], reverse=True)[:3]
    return {
        "named": named,
        "top": [
            {"query": key[:120], "calls": c, "pages": p, "ms": round(m, 1)}
            for key, (c, p, m) in top
        ],
    }


def _percentiles(latencies: list[float]) -> dict[str, float | None]:
    """p50 and p99 of ``latencies`` (ms); None when nothing was picked up."""
    if not latencies:
        return {"p50_ms": None, "p99_ms": None}
    p50 = statistics.median(latencies)
    p99 = statistics.quantiles(latencies, n=100)[98] if len(latencies) >= 2 else p50
    return {"p50_ms": p50, "p99_ms": p99}


def _summarise(phase: str, holder: str | None, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A phase: rates over its windows, the median of its windows' latencies, the last
    window's state."""
    seconds = sum(r["seconds"] for r in rows)
    last = rows[-1] if rows else None

    def median(key: str) -> float | None:
        values = [r[key] for r in rows if r[key] is not None]
        return statistics.median(values) if values else None

    return {
        "phase": phase,
        "holder": holder,
        "windows": len(rows),
        "seconds": seconds,
        "created_per_s": sum(r["created_per_s"] * r["seconds"] for r in rows) / seconds
        if seconds
        else 0.0,
        "completed_per_s": sum(r["completed_per_s"] * r["seconds"] for r in rows) / seconds
        if seconds
        else 0.0,
        "p50_ms": median("p50_ms"),
        "p99_ms": median("p99_ms"),
        "backlog": last["backlog"] if last else None,
        "tables": last["tables"] if last else None,
        "probes": last["probes"] if last else None,
        "statements": last["statements"] if last else None,
    }


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if value < 1000 else f"{value / 1000:.1f}s"


def _header() -> str:
    return (
        f"{'t s':>6} {'phase':<9} {'created/s':>9} {'done/s':>7} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'backlog':>8} {'dead msg':>9} {'dead ch':>8} {'idx pages':>10} "
        f"{'probe pages lock/due/head/row':>30} {'stmt pages/call lock/due/head/del':>34}"
    )


def _window_line(w: dict[str, Any]) -> str:
    tables = w["tables"]
    index_pages = sum(sum(t["index_pages"].values()) for t in tables.values())
    probes = "/".join(
        str(w["probes"][k]["pages"])
        for k in ("expired_lock", "due_channel", "channel_head", "channel_row")
    )
    stmts = "-"
    if w["statements"]:
        stmts = "/".join(
            "-"
            if w["statements"][k]["pages_per_call"] is None
            else f"{w['statements'][k]['pages_per_call']:.0f}"
            for k in ("expired_lock", "due_channel", "channel_head", "finish_delete")
        )
    label = w["phase"] if w["phase"] == w["holder"] else f"{w['phase'][:5]}/{w['holder']}"
    return (
        f"{w['t']:6.0f} {label:<9} {w['created_per_s']:>9,.0f} {w['completed_per_s']:>7,.0f} "
        f"{_ms(w['p50_ms']):>7} {_ms(w['p99_ms']):>7} {w['backlog']:>8,} "
        f"{tables['message']['n_dead_tup']:>9,} {tables['channel']['n_dead_tup']:>8,} "
        f"{index_pages:>10,} {probes:>30} {stmts:>34}"
    )


def table(report: dict[str, Any]) -> str:
    """One line per phase (and the last window of each hold)."""
    lines = [
        f"{'phase':<14} {'created/s':>9} {'done/s':>7} {'x clean':>7} {'p50 ms':>7} "
        f"{'p99 ms':>7} {'backlog':>8} {'dead msg':>9} {'idx pages':>10} "
        f"{'probe pages lock/due/head/row':>30}"
    ]
    clean: dict[str, float] = {}
    for row in report["summary"]:
        if row["phase"] == "clean":
            clean[row["holder"]] = row["completed_per_s"]
        label = row["phase"]
        if not label.startswith(row["holder"]):
            label = f"{label}/{row['holder']}"
        if row["tables"] is None:
            continue
        index_pages = sum(sum(t["index_pages"].values()) for t in row["tables"].values())
        probes = "/".join(
            str(row["probes"][k]["pages"])
            for k in ("expired_lock", "due_channel", "channel_head", "channel_row")
        )
        base = clean.get(row["holder"], 0.0)
        ratio = row["completed_per_s"] / base if base else 0.0
        lines.append(
            f"{label:<14} {row['created_per_s']:>9,.0f} {row['completed_per_s']:>7,.0f} "
            f"{ratio:>7.2f} {_ms(row['p50_ms']):>7} {_ms(row['p99_ms']):>7} "
            f"{row['backlog']:>8,} {row['tables']['message']['n_dead_tup']:>9,} "
            f"{index_pages:>10,} {probes:>30}"
        )
    return "\n".join(lines)


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def dump(report: dict[str, Any]) -> str:
    """``report`` as JSON, floats to 3 decimals, one line per window (a 30-minute run has
    about 190 windows)."""
    rounded = _rounded(report)
    windows = rounded.pop("windows")
    head = json.dumps(rounded, indent=1)
    lines = ",\n".join(json.dumps(w, separators=(",", ":")) for w in windows)
    return f'{head[:-2]},\n "windows": [\n{lines}\n ]\n}}\n'


def run_long_txn(
    dsn: str,
    settings: Settings = DEFAULT,
    *,
    out: str | os.PathLike[str] = "benchmarks/results",
    schema: str | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the benchmark; print the tables, write ``long_txn.json`` to ``out`` and return
    the report. ``schema``: the queue's (default: a name of the run's own); it and the reader's
    are dropped at the end."""
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    bench = LongTxnBench(dsn, settings, schema, log)
    started = time.perf_counter()
    log(
        f"long transaction bench: a Worker of {settings.concurrency} handlers of "
        f"{settings.handler_ms:g} ms, {settings.channels} channel(s), windows of "
        f"{settings.window:g}s, holders {', '.join(settings.holders)} of {settings.hold:g}s each, "
        f"schemas {bench.schema} and {bench.aux} (dropped at the end)"
    )
    try:
        report = bench.run()
    finally:
        bench.teardown()
    report["seconds"] = time.perf_counter() - started
    if not report["statements_measured"]:
        log("(statements not measured: the server has no pg_stat_statements with track = all)")
    log("\n" + table(report))
    (out_dir / "long_txn.json").write_text(dump(report))
    log(f"wrote {out_dir / 'long_txn.json'} ({report['seconds']:.0f}s)")
    return report


def main(argv: list[str] | None = None) -> int:
    """``python benchmarks/long_txn.py``: every duration and size as an option."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--dsn", help="default: $LONNYMQ_DSN, else an embedded server (stopped at the end)"
    )
    d = DEFAULT
    parser.add_argument("--hold", type=float, default=d.hold, help="seconds each holder holds")
    parser.add_argument("--clean", type=float, default=d.clean, help="seconds before")
    parser.add_argument("--recovery", type=float, default=d.recovery, help="seconds after each")
    parser.add_argument("--window", type=float, default=d.window, help="seconds each")
    parser.add_argument("--capacity", type=float, default=d.capacity, help="seconds measured")
    parser.add_argument("--rate", type=float, help="messages/s offered (default: capacity / 2)")
    parser.add_argument("--concurrency", type=int, default=d.concurrency, help="handlers")
    parser.add_argument("--handler-ms", type=float, default=d.handler_ms, help="handler sleep")
    parser.add_argument("--channels", type=int, default=d.channels)
    parser.add_argument(
        "--holders",
        default=",".join(d.holders),
        help="a comma-separated list of idle, reader and spark (a Spark job reading a queue of "
        "--spark-rows messages in one snapshot, again and again)",
    )
    parser.add_argument("--spark-rows", type=int, default=d.spark_rows)
    parser.add_argument(
        "--schema",
        help="the queue's schema (default: lonnymq_long_txn_<pid>_<token>, the run's own)",
    )
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    args = parser.parse_args(argv)
    try:
        settings = (
            QUICK
            if args.quick
            else Settings(
                clean=args.clean,
                hold=args.hold,
                recovery=args.recovery,
                window=args.window,
                capacity=args.capacity,
                rate=args.rate,
                concurrency=args.concurrency,
                handler_ms=args.handler_ms,
                channels=args.channels,
                holders=tuple(h.strip() for h in args.holders.split(",") if h.strip()),
                spark_rows=args.spark_rows,
            )
        )
    except InvalidArgumentError as err:
        parser.error(str(err))
    run_long_txn(resolve_dsn(args.dsn), settings, out=args.out, schema=args.schema)
    return 0
