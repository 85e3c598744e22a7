"""``lonnymq bench --quick`` runs end to end (a smoke test: speed is never judged here)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest

from lonnymq import Queue, bench_worker
from lonnymq.bench import (
    CEILING,
    PROFILES,
    Bench,
    drop_schemas,
    pgbench_tps,
    run_bench,
    spark_unavailable,
)
from lonnymq.bench_worker import Consumer, Load, measure_consumer, run_worker_shape
from lonnymq.spark.bench import message_copy


@pytest.mark.slow
def test_bench_quick_writes_a_report(dsn: str, tmp_path: Path) -> None:
    env = {**os.environ, "LONNYMQ_DSN": dsn}
    result = subprocess.run(
        [sys.executable, "-m", "lonnymq.cli", "bench", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # The run's own schemas, named in its first line, are gone.
    named = re.search(r"schemas (\S+) and (\S+) \(dropped at the end\)", result.stdout)
    assert named is not None, result.stdout[:3000]
    assert _existing(dsn, *named.groups()) == []
    report = json.loads((tmp_path / "bench.json").read_text())
    rows = report["throughput"]
    # Every shape ran for the raw queue and for lonnymq, and moved messages.
    shapes = {(r["shape"], r["batch"], r["queue"].split(",")[0]) for r in rows}
    for shape in ("enqueue", "drain", "steady"):
        for batch in (1, 100):
            assert {(shape, batch, "raw"), (shape, batch, "lonnymq")} <= shapes
            # The durable floor runs where lonnymq locks then finishes, and lonnymq's rows
            # there carry their ratio to it.
            assert ((shape, batch, "durable floor") in shapes) == (shape != "enqueue")
    # The message-table ceiling runs beside enqueue in batches only, at every channel count
    # of the profile but the first.
    ceilings = [
        (r["shape"], r["batch"], r["queue"]) for r in rows if r["queue"].startswith(CEILING)
    ]
    assert ceilings == [
        ("enqueue", 100, f"{CEILING}, {n:,} ch") for n in PROFILES["quick"].channel_counts[1:]
    ]
    assert all(r["median"] > 0 for r in rows)
    for r in rows:
        assert r["x_raw"] > 0
        floored = r["queue"].startswith("lonnymq") and r["shape"] != "enqueue"
        assert (r["x_durable"] is not None) == floored
        if floored:
            floor = next(
                f["median"]
                for f in rows
                if (f["shape"], f["batch"], f["queue"]) == (r["shape"], r["batch"], "durable floor")
            )
            assert r["x_durable"] == pytest.approx(r["median"] / floor)
    assert {r["shape"] for r in report["latency"]} >= {"expired locks", "saturated channels"}
    assert (tmp_path / "throughput.png").stat().st_size > 0
    assert "x raw" in result.stdout
    assert "x durable" in result.stdout
    spark = report["spark"]
    reason = spark_unavailable()
    if reason is not None:
        assert spark == {"skipped": reason}
        assert f"skipped: {reason}" in result.stdout
        return
    # The Spark section: the batch write against a raw COPY, and one streaming read per
    # micro-batch size, each of which drained its queue (checked by the bench itself).
    write = spark["write"]
    assert write["rows"] == spark["profile"]["rows"]
    assert write["rows_per_s"]["spark write"] > 0
    assert write["rows_per_s"]["raw copy"] > 0
    assert write["ratio"] > 0
    # The ceiling: the same rows straight into message, beside the write in the same run.
    assert write["rows_per_s"]["ceiling"] > 0
    assert write["ratio_to_ceiling"] == pytest.approx(
        write["rows_per_s"]["spark write"] / write["rows_per_s"]["ceiling"]
    )
    assert "x ceiling" in result.stdout
    assert write["commit_seconds"] is not None
    assert 0 < write["commit_seconds"] < write["seconds"]
    sizes = [row["max_messages_per_batch"] for row in spark["stream"]]
    assert sizes == spark["profile"]["batch_sizes"]
    for row in spark["stream"]:
        assert row["msgs_per_s"] > 0
        # At least messages / batch size micro-batches (more when a plan came up short).
        assert row["batches"] >= -(-row["messages"] // row["max_messages_per_batch"])
    assert "stream read" in result.stdout


def test_bench_removes_its_scripts_when_a_run_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pgbench scripts' temporary directory goes even when the run stops on an error."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    with pytest.raises(psycopg.OperationalError):
        run_bench(
            "postgresql://postgres@127.0.0.1:1/db?connect_timeout=2",
            profile="quick",
            out=tmp_path / "out",
            log=lambda _: None,
        )
    assert list(scratch.iterdir()) == []


def _existing(dsn: str, *schemas: str) -> list[str]:
    """Those of ``schemas`` that exist, sorted."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT nspname FROM pg_namespace WHERE nspname = ANY (%s) ORDER BY 1", [list(schemas)]
        ).fetchall()
    return [row[0] for row in rows]


def test_bench_drops_its_schemas_when_a_run_fails(
    dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that stops midway (here: right after the first reset) leaves no bench schema."""
    made: list[str] = []

    def reset_then_fail(self: Bench) -> list[object]:
        self.reset()
        made.extend((self.schema, self.raw_schema))
        raise RuntimeError("pgbench failed")

    monkeypatch.setattr(Bench, "throughput", reset_then_fail)
    with pytest.raises(RuntimeError, match="pgbench failed"):
        run_bench(dsn, profile="quick", out=tmp_path / "out", log=lambda _: None)
    assert len(made) == 2
    assert _existing(dsn, *made) == []


def test_two_benches_on_one_server_keep_to_their_own_schemas(dsn: str, tmp_path: Path) -> None:
    """Two bench runs at once (two test sessions on one server, say) each name their schemas
    for themselves, and one that ends drops its own and leaves the other's, still usable (a
    fixed name had one run drop the schemas the other was measuring)."""
    first = Bench(dsn, PROFILES["quick"], tmp_path, lambda _: None)
    second = Bench(dsn, PROFILES["quick"], tmp_path, lambda _: None)
    try:
        names = {first.schema, first.raw_schema, second.schema, second.raw_schema}
        assert len(names) == 4
        assert all(name.startswith(f"lonnymq_bench_{os.getpid()}_") for name in names)
        first.reset()
        second.reset()
        first.close()
        assert _existing(dsn, *names) == sorted([second.schema, second.raw_schema])
        second.prefill("lonnymq", 3, 1)
        second.prefill("raw", 2, 1)
        assert (second._remaining("lonnymq"), second._remaining("raw")) == (3, 2)
    finally:
        first.close()
        second.close()
    assert _existing(dsn, *names) == []


@pytest.mark.parametrize("batch", [1, 100])
def test_the_durable_floor_locks_each_message_once_then_finishes_it(
    dsn: str, tmp_path: Path, batch: int
) -> None:
    """The durable floor's consumers, racing, never lock a message twice, delete exactly what
    their calls before locked, and leave locked exactly what each client's last call took.

    Each client makes a fixed number of calls (not calls for a fixed time) on a backlog that
    outlasts them all, so every call takes a full batch however fast the server is."""
    profile = PROFILES["quick"]
    clients, calls = profile.clients, 100
    # Schemas of its own, so that another session's bench on the server cannot meet it.
    schemas = (f"t_{uuid.uuid4().hex[:16]}", f"t_{uuid.uuid4().hex[:16]}")
    raw = schemas[1]
    bench = Bench(dsn, profile, tmp_path, lambda _: None, schemas=schemas)
    total = clients * (calls + 1) * batch  # a batch a client more than all the calls take
    try:
        bench.reset()
        bench.prefill("durable", total, 1)
        script = bench._script(("durable", "take", batch))
        proc = bench._pgbench(script, clients, 1, calls=calls)
        output, _ = proc.communicate()
        pgbench_tps(output, proc.returncode)  # raises if a client stopped on an error
        # pgbench 15+ goes on past a deadlock or serialization failure and counts it.
        failed = re.search(r"number of failed transactions: (\d+)", output)
        assert failed is None or failed[1] == "0", output
        with psycopg.connect(dsn) as conn:
            attempts, locked, left = conn.execute(
                "SELECT coalesce(max(attempts), 0), "
                "count(*) FILTER (WHERE unlock_at IS NOT NULL), count(*) "
                f"FROM {raw}.durable_queue"
            ).fetchone() or (0, 0, 0)
            unlocked_attempted = conn.execute(
                f"SELECT count(*) FROM {raw}.durable_queue WHERE unlock_at IS NULL AND attempts > 0"
            ).fetchone()
        assert attempts == 1  # nobody took a message that another call held
        assert unlocked_attempted == (0,)
        assert locked == clients * batch  # each client's last take, unfinished
        finished = clients * (calls - 1) * batch  # every take before it, finished
        assert left == total - finished
        assert bench._produced("durable") - bench._remaining("durable") == finished
    finally:
        bench.close()
        drop_schemas(dsn, *schemas)


def test_the_message_table_ceiling_inserts_into_a_copy_of_message(dsn: str, tmp_path: Path) -> None:
    """The ceiling's table has message's columns, indexes and storage settings and an id
    sequence of its own; a call of its script adds a batch of rows there over the channels
    asked for, and nothing to lonnymq's queue."""
    schemas = (f"t_{uuid.uuid4().hex[:16]}", f"t_{uuid.uuid4().hex[:16]}")
    queue_schema, raw = schemas
    bench = Bench(dsn, PROFILES["quick"], tmp_path, lambda _: None, schemas=schemas)
    try:
        bench.reset()
        bench.make_ceiling()
        script = bench._script(("ceiling", "create", 100))
        proc = bench._pgbench(script, 2, 7, calls=3)
        output, _ = proc.communicate()
        pgbench_tps(output, proc.returncode)
        with psycopg.connect(dsn) as conn:

            def catalog(schema: str, table: str) -> tuple[object, ...]:
                row = conn.execute(
                    "SELECT c.reloptions, "
                    # Each index's definition without its name and table's.
                    "(SELECT array_agg(x.d ORDER BY x.d) FROM (SELECT regexp_replace("
                    "  pg_get_indexdef(i.indexrelid), 'INDEX \\S+ ON \\S+ ', 'INDEX ON ') AS d "
                    "  FROM pg_index i WHERE i.indrelid = c.oid) x), "
                    "(SELECT array_agg(a.attname || ' ' || format_type(a.atttypid, a.atttypmod) "
                    "  ORDER BY a.attnum) FROM pg_attribute a "
                    " WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped) "
                    "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                    "WHERE n.nspname = %s AND c.relname = %s",
                    (schema, table),
                ).fetchone()
                assert row is not None
                return tuple(row)

            original, copy = catalog(queue_schema, "message"), catalog(raw, "message_copy")
            assert copy == original
            options = original[0]
            assert isinstance(options, list)
            assert "fillfactor=80" in options
            count, distinct_ids, channels, outside, unlocked = conn.execute(
                "SELECT count(*), count(DISTINCT id), count(DISTINCT channel), "
                "count(*) FILTER (WHERE channel NOT IN ('c1','c2','c3','c4','c5','c6','c7')), "
                "count(*) FILTER (WHERE NOT is_locked AND num_attempts = 0) "
                f"FROM {raw}.message_copy"
            ).fetchone() or (0, 0, 0, 0, 0)
            assert (count, distinct_ids, outside, unlocked) == (600, 600, 0, 600)
            assert channels > 1
            assert conn.execute(f"SELECT count(*) FROM {queue_schema}.message").fetchone() == (0,)
            assert conn.execute(
                f"SELECT is_called FROM {queue_schema}.message_id_seq"
            ).fetchone() == (False,)
    finally:
        bench.close()
        drop_schemas(dsn, *schemas)


def test_the_spark_ceiling_copies_every_row_into_an_emptied_message_table(
    make_queue: Callable[..., Queue], dsn: str, schema_name: str
) -> None:
    """The ceiling's COPY empties ``message`` first, then loads exactly the rows asked for,
    split over its connections, spread over the Spark section's channels."""
    queue = make_queue()
    queue.create(b"left over", channel="old")
    message_copy(dsn, schema_name, 1_001, connections=2)
    with psycopg.connect(dsn) as conn:
        count, distinct, channels, old = conn.execute(
            "SELECT count(*), count(DISTINCT content), count(DISTINCT channel), "
            f"count(*) FILTER (WHERE channel = 'old') FROM \"{schema_name}\".message"
        ).fetchone() or (0, 0, 0, 0)
    assert (count, distinct, channels, old) == (1_001, 1_001, 100, 0)


@pytest.mark.slow
def test_the_worker_shape_measures_every_consumer_at_every_concurrency(
    dsn: str, tmp_path: Path
) -> None:
    """The worker shape (``lonnymq bench --worker``) of the quick profile: the Worker, the
    AsyncWorker and the durable floor each ran at each of the profile's concurrencies,
    finished messages, and had handlers start in both phases (saturated and paced); each row
    carries its ratio to the floor's. Schemas of its own, so that another session's bench on
    the server cannot meet it."""
    schemas = (f"t_{uuid.uuid4().hex[:16]}", f"t_{uuid.uuid4().hex[:16]}")
    logged: list[str] = []
    bench = Bench(dsn, PROFILES["quick"], tmp_path, logged.append, schemas=schemas)
    try:
        rows = run_worker_shape(bench)
    finally:
        bench.close()
        drop_schemas(dsn, *schemas)
    wanted = {
        (name, concurrency)
        for name in ("Worker", "AsyncWorker", "durable floor")
        for concurrency in PROFILES["quick"].worker_concurrency
    }
    assert {(r["consumer"], r["concurrency"]) for r in rows} == wanted
    assert len(rows) == len(wanted)
    floors = {r["concurrency"]: r["msgs_per_s"] for r in rows if r["consumer"] == "durable floor"}
    for r in rows:
        assert r["msgs_per_s"] > 0
        assert r["x_floor"] == pytest.approx(r["msgs_per_s"] / floors[r["concurrency"]])
        for phase in ("pickup_saturated", "pickup_paced"):
            p50, p99 = r[phase]["p50_ms"], r[phase]["p99_ms"]
            assert p50 is not None
            assert p99 is not None
            assert 0 <= p50 <= p99
        assert isinstance(r["kept_up"], bool)
    assert len(logged) == len(wanted)
    assert all("x floor" in line for line in logged)


def test_bench_refuses_worker_with_another_single_section(tmp_path: Path) -> None:
    for other in ("--spark-only", "--long-txn"):
        result = subprocess.run(
            [sys.executable, "-m", "lonnymq.cli", "bench", "--worker", other, "--out",
             str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )  # fmt: skip
        assert result.returncode != 0
        assert "separate runs" in result.stderr


def test_the_worker_shape_measures_from_a_slow_starting_consumers_first_handler() -> None:
    """A consumer that reports ready well before it takes anything (as awa's runtime does) is
    measured from its first handler on, even when that comes after a whole measuring period."""
    load = Load(lambda count: None)  # the messages "created": a count is enough here
    consumer: Consumer

    def serve() -> None:
        consumer.ready.set()
        time.sleep(1.0)  # longer than the warm-up and the saturated period together
        while not load.stop.is_set():
            if load.waiting() > 0:
                load.pickups.append(0.5)
                served.append(1)
            else:
                time.sleep(0.001)

    served: list[int] = []
    consumer = Consumer(serve)
    consumer.stop = load.stop.set
    row = measure_consumer("slow starter", 8, 0.2, load=load, consumer=consumer,
                           finished=lambda: len(served))  # fmt: skip
    assert row["msgs_per_s"] > 0
    assert row["pickup_saturated"]["p50_ms"] == 0.5
    assert row["pickup_paced"]["p50_ms"] == 0.5


def test_paced_pickups_are_those_of_the_messages_created_while_measured() -> None:
    """The paced phase counts the messages created in its window, each however late it starts
    (within the grace after the window), and not what was left of the saturated backlog; the
    saturated phase counts every pickup in its window."""

    class Handlers:
        """Stands in for ``load.stop`` (only waited on): reports pickups as handlers would,
        during the window (the first wait) and during the grace after it (the second)."""

        def __init__(self, load: Load) -> None:
            self.load = load
            self.waits = 0
            self.window_end = 0.0

        def wait(self, seconds: float) -> bool:
            self.waits += 1
            time.sleep(0.05)
            if self.waits == 1:
                self.load.pickups.append(5_000.0)  # created 5 s ago: left from the backlog
                self.load.pickups.append(1.0)  # created while measured
                time.sleep(seconds)
                self.window_end = time.time()
            else:
                # Created just before the window ended, started only now; then one created
                # after the window.
                self.load.pickups.append(1000 * (time.time() - self.window_end) + 10)
                self.load.pickups.append(1.0)
            return False

    load = Load(lambda count: None)
    load.pickups.append(2.0)  # before the window
    handlers = Handlers(load)
    load.stop = handlers  # type: ignore[assignment]
    _, paced = bench_worker._measure(lambda: 0, load, 0.1, paced=True)
    assert handlers.waits == 2
    assert len(paced) == 2
    assert paced[0] == 1.0
    assert paced[1] > 10
    saturated = Load(lambda count: None)
    saturated.pickups.append(2.0)
    saturated.stop = Handlers(saturated)  # type: ignore[assignment]
    _, every = bench_worker._measure(lambda: 0, saturated, 0.1)
    assert every == [5_000.0, 1.0]


def test_paced_pickups_of_a_consumer_still_behind_are_its_wait_behind_the_backlog() -> None:
    """When none of the messages created in the paced window has started by the end of the
    grace (the consumer is still working through the backlog), the window's pickups are what
    the row reports, not nothing."""

    class Behind:
        """Stands in for ``load.stop``: only backlog messages start, in the window."""

        def __init__(self, load: Load) -> None:
            self.load = load
            self.waits = 0

        def wait(self, seconds: float) -> bool:
            self.waits += 1
            if self.waits == 1:
                time.sleep(0.05)
                self.load.pickups.append(3_000.0)
                self.load.pickups.append(3_100.0)
                time.sleep(seconds)
            return False

    load = Load(lambda count: None)
    load.stop = Behind(load)  # type: ignore[assignment]
    _, paced = bench_worker._measure(lambda: 0, load, 0.1, paced=True)
    assert paced == [3_000.0, 3_100.0]


def test_the_worker_shape_says_when_a_consumer_never_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bench_worker, "STARTUP_S", 0.3)
    load = Load(lambda count: None)

    def idle() -> None:
        consumer.ready.set()
        load.stop.wait(30)

    consumer = Consumer(idle)
    consumer.stop = load.stop.set
    with pytest.raises(RuntimeError, match=r"never starts at 8: no handler in 0\.3 s"):
        measure_consumer("never starts", 8, 0.2, load=load, consumer=consumer,
                         finished=lambda: 0)  # fmt: skip
