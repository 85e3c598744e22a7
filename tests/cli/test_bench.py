"""``lonnymq bench --quick`` runs end to end (a smoke test: speed is never judged here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import psycopg
import pytest

from lonnymq.bench import BENCH_SCHEMAS, Bench, run_bench, spark_unavailable


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
    report = json.loads((tmp_path / "bench.json").read_text())
    rows = report["throughput"]
    # Every shape ran for the raw queue and for lonnymq, and moved messages.
    shapes = {(r["shape"], r["batch"], r["queue"].split(",")[0]) for r in rows}
    for shape in ("enqueue", "drain", "steady"):
        for batch in (1, 100):
            assert {(shape, batch, "raw"), (shape, batch, "lonnymq")} <= shapes
    assert all(r["median"] > 0 for r in rows)
    assert {r["shape"] for r in report["latency"]} >= {"expired locks", "saturated channels"}
    assert (tmp_path / "throughput.png").stat().st_size > 0
    assert "x raw" in result.stdout
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


def test_bench_drops_its_schemas_when_a_run_fails(
    dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that stops midway (here: right after the first reset) leaves no bench schema."""

    def reset_then_fail(self: Bench) -> list[object]:
        self.reset()
        raise RuntimeError("pgbench failed")

    monkeypatch.setattr(Bench, "throughput", reset_then_fail)
    with pytest.raises(RuntimeError, match="pgbench failed"):
        run_bench(dsn, profile="quick", out=tmp_path / "out", log=lambda _: None)
    with psycopg.connect(dsn) as conn:
        left = conn.execute(
            "SELECT nspname FROM pg_namespace WHERE nspname = ANY (%s)", [list(BENCH_SCHEMAS)]
        ).fetchall()
    assert left == []
