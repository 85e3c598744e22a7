"""``benchmarks/long_txn.py --quick`` and ``lonnymq bench --long-txn --quick`` run end to end
(a smoke test: speed is never judged here): every phase ran, messages moved through the Worker,
each window measured what it says, and the held horizon was seen."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from dataclasses import replace
from pathlib import Path

import psycopg
import pytest

from lonnymq import Queue
from lonnymq.bench_long_txn import QUICK, STATEMENTS, LongTxnBench, _statement_deltas

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "long_txn.py"
PHASES = [("clean", "idle"), ("idle", "idle"), ("recovery", "idle"),
          ("clean", "reader"), ("reader", "reader"), ("recovery", "reader")]  # fmt: skip
PROBES = {"expired_lock", "due_channel", "channel_head", "channel_row"}
INDEXES = {
    "message": {"message_pkey", "message_channel_head_ix", "message_unlock_ix", "message_dedup_ux"},
    "channel": {"channel_pkey", "channel_ready_ix"},
}


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["script", "cli"])
def test_long_txn_quick_writes_a_report(dsn: str, tmp_path: Path, entry: str) -> None:
    if entry == "script":
        schema = f"t_{uuid.uuid4().hex[:16]}"
        command = [sys.executable, str(SCRIPT), "--quick", "--schema", schema]
    else:
        schema = None  # `lonnymq bench --long-txn` names its own
        command = [sys.executable, "-m", "lonnymq.cli", "bench", "--long-txn", "--quick"]
    env = {**os.environ, "LONNYMQ_DSN": dsn}
    result = subprocess.run(
        [*command, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=280,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    named = re.search(r"schemas (\S+) and (\S+) \(dropped at the end\)", result.stdout)
    assert named is not None, result.stdout[:3000]
    if schema is None:
        schema = named[1]
        assert re.fullmatch(r"lonnymq_long_txn_\d+_[0-9a-f]{8}", schema), schema
    assert named.groups() == (schema, f"{schema}_aux")
    report = json.loads((tmp_path / "long_txn.json").read_text())
    assert [e["event"] for e in report["events"]] == [
        "capacity measured", "load start", "idle start", "idle end",
        "load start", "reader start", "reader end",
    ]  # fmt: skip
    assert report["capacity_per_s"] > 0
    # The file keeps 3 decimals.
    assert report["offered_per_s"] == pytest.approx(report["capacity_per_s"] / 2, abs=0.001)

    windows = report["windows"]
    # Every phase ran, in order, and windows are in time order.
    order = [PHASES.index((w["phase"], w["holder"])) for w in windows]
    assert order == sorted(order)
    assert set(order) == set(range(len(PHASES)))
    assert [w["t"] for w in windows] == sorted(w["t"] for w in windows)
    for w in windows:
        assert w["seconds"] > 0, w
        assert w["created_per_s"] > 0, w
        assert w["completed_per_s"] >= 0, w
        assert w["backlog"] >= 0, w
        assert w["p50_ms"] is None or 0 <= w["p50_ms"] <= w["p99_ms"], w
        assert set(w["tables"]) == {"message", "channel"}
        for name, table in w["tables"].items():
            assert table["heap_pages"] >= 0, table
            assert table["n_dead_tup"] >= 0, table
            assert set(table["index_pages"]) == INDEXES[name]
            assert all(pages >= 1 for pages in table["index_pages"].values()), table
        assert set(w["probes"]) == PROBES
        assert all(p["pages"] >= 1 for p in w["probes"].values()), w["probes"]
        if report["statements_measured"]:
            assert set(w["statements"]) == set(STATEMENTS)
        else:
            assert w["statements"] is None
            assert w["top_statements"] is None
    # Messages went through the Worker: picked up and completed, in most windows.
    assert sum(w["picked_up"] for w in windows) > 0
    assert 2 * sum(w["completed_per_s"] > 0 for w in windows) >= len(windows)
    # While held, the horizon is at least as old as the transactions since it was taken.
    held = [w["horizon_age"] for w in windows if w["phase"] in ("idle", "reader")]
    assert all(age is not None and age > 0 for age in held)

    summary = {(row["phase"], row["holder"]): row for row in report["summary"]}
    assert set(summary) == {*PHASES, ("idle (last)", "idle"), ("reader (last)", "reader")}
    for (phase, holder), row in summary.items():
        mine = [w for w in windows if (w["phase"], w["holder"]) == (phase, holder)]
        if mine:
            assert row["windows"] == len(mine)
            total = sum(w["seconds"] for w in mine)
            assert row["seconds"] == pytest.approx(total, abs=0.001 * len(mine))
    assert "x clean" in result.stdout
    assert "recovery/reader" in result.stdout
    # The benchmark's schemas are gone.
    assert _schemas_left(dsn, [schema, f"{schema}_aux"]) == []


def _schemas_left(dsn: str, names: list[str]) -> list[str]:
    """Which of the schemas ``names`` exist, in name order."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT nspname FROM pg_namespace WHERE nspname = ANY (%s) ORDER BY 1", [names]
        ).fetchall()
    return [row[0] for row in rows]


def test_two_long_txn_benches_on_one_server_keep_to_their_own_schemas(dsn: str) -> None:
    """Two runs at once each name their schemas for themselves; one that ends drops its own
    and leaves the other's queue working (a fixed name had one run drop the other's)."""
    first, second = LongTxnBench(dsn, QUICK, log=print), LongTxnBench(dsn, QUICK, log=print)
    names = [first.schema, first.aux, second.schema, second.aux]
    assert len(set(names)) == 4
    assert all(name.startswith(f"lonnymq_long_txn_{os.getpid()}_") for name in names)
    try:
        first.setup()
        second.setup()
        first.teardown()
        assert _schemas_left(dsn, names) == sorted([second.schema, second.aux])
        with Queue(dsn, schema=second.schema) as queue:
            queue.create(b"still here")
            assert [s.size for s in queue.stats()] == [1]
    finally:
        first.teardown()
        second.teardown()
    assert _schemas_left(dsn, names) == []


@pytest.mark.slow
def test_a_spark_holder_reads_its_queue_in_one_snapshot_beside_the_worker(
    dsn: str, tmp_path: Path
) -> None:
    """The spark holder: a queue of its own filled before the run, read by Spark (every
    message counted) at least once while the hold lasts, the horizon held meanwhile, and its
    schema dropped at the end."""
    settings = replace(QUICK, holders=("spark",), spark_rows=3_000, rate=50.0)
    bench = LongTxnBench(dsn, settings, log=print)
    try:
        report = bench.run()
    finally:
        bench.teardown()
    events = [e["event"] for e in report["events"]]
    assert events == ["load start", "spark start", "spark end"]
    end = report["events"][-1]
    assert end["reads"] >= 1
    assert end["rows"] == [3_000] * end["reads"]
    held = [w for w in report["windows"] if w["phase"] == "spark"]
    assert held
    assert any(w["horizon_age"] for w in held)
    assert sum(w["completed_per_s"] for w in report["windows"]) > 0
    with psycopg.connect(dsn) as conn:
        left = conn.execute(
            "SELECT count(*) FROM pg_namespace WHERE nspname = %s", [bench.spark_schema]
        ).fetchone()
    assert left == (0,)


def test_statement_deltas_name_the_statements_of_a_window() -> None:
    """What a window reports from two readings of pg_stat_statements (calls, pages, ms per
    statement text): per named statement, and the statements that touched the most pages."""
    head = "UPDATE message m SET x WHERE h.channel = v_channel.name AND NOT h.is_locked"
    locked = "SELECT * FROM channel c WHERE c.next_dequeue_at <= v_now ORDER BY c.next_dequeue_at, c.turn LIMIT $1 FOR UPDATE SKIP LOCKED"  # noqa: E501
    busy = "SELECT c.name FROM channel c WHERE c.next_dequeue_at <= v_now ORDER BY c.turn LIMIT $1"
    before = {head: (10, 100, 1.0), locked: (5, 10, 0.5), busy: (3, 3, 0.1)}
    after = {head: (14, 300, 3.0), locked: (5, 10, 0.5), busy: (5, 9, 0.3), "SELECT 1": (1, 0, 0)}
    deltas = _statement_deltas(before, after)
    named = deltas["named"]
    assert named["channel_head"] == {"calls": 4, "pages_per_call": 50, "ms_per_call": 0.5}
    # Not called in the window: no figure per call.
    assert named["due_channel"] == {"calls": 0, "pages_per_call": None, "ms_per_call": None}
    # The busy channel's look-up is told apart from the locking one by what it lacks.
    assert named["busy_channel"]["calls"] == 2
    assert named["busy_channel"]["pages_per_call"] == 3
    assert [t["query"] for t in deltas["top"]] == [head, busy, "SELECT 1"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--long-txn", "--hold", "0"], "hold must be a positive number of seconds, got 0.0"),
        (["--long-txn", "--spark-only"], "--long-txn and --spark-only are separate runs"),
        (["--long-txn", "--rate", "0"], "rate must be a positive number, got 0.0"),
    ],
)
def test_bench_long_txn_refuses_bad_options(
    dsn: str, tmp_path: Path, args: list[str], message: str
) -> None:
    env = {**os.environ, "LONNYMQ_DSN": dsn}
    result = subprocess.run(
        [sys.executable, "-m", "lonnymq.cli", "bench", *args, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert message in result.stderr
    assert not (tmp_path / "long_txn.json").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--window", "-1"], "window must be a positive number of seconds, got -1.0"),
        (
            ["--holders", "nobody"],
            "holders must be one or more of idle, reader, spark, got ('nobody',)",
        ),
        (["--spark-rows", "0"], "spark_rows must be between 1 and 100000000, got 0"),
        (["--concurrency", "0"], "concurrency must be between 1 and 256, got 0"),
        (["--channels", "0"], "channels must be between 1 and 10000, got 0"),
        (["--handler-ms", "-1"], "handler_ms must not be negative, got -1.0"),
    ],
)
def test_script_refuses_bad_settings(
    dsn: str, tmp_path: Path, args: list[str], message: str
) -> None:
    env = {**os.environ, "LONNYMQ_DSN": dsn}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2
    assert message in result.stderr
    assert not (tmp_path / "long_txn.json").exists()
