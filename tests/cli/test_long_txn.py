"""``benchmarks/long_txn.py --quick`` and ``lonnymq bench --long-txn --quick`` run end to end
(a smoke test: speed is never judged here): every phase ran for both queues, messages moved,
and the held snapshot was seen."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "long_txn.py"
PHASES = ("baseline", "hold", "after", "vacuumed")


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["script", "cli"])
def test_long_txn_quick_writes_a_report(dsn: str, tmp_path: Path, entry: str) -> None:
    if entry == "script":
        schema = f"t_{uuid.uuid4().hex[:16]}"
        command = [sys.executable, str(SCRIPT), "--quick", "--schema", schema]
    else:
        schema = "lonnymq_long_txn"  # what `lonnymq bench --long-txn` uses
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
    report = json.loads((tmp_path / "long_txn.json").read_text())
    assert [e["event"] for e in report["events"]] == ["hold start", "hold end", "vacuum"]

    windows = report["windows"]
    for phase in PHASES:
        assert {w["queue"] for w in windows if w["phase"] == phase} == {"raw", "lonnymq"}
    # Windows are in time order and the phases follow each other in order.
    assert [w["t"] for w in windows] == sorted(w["t"] for w in windows)
    order = [PHASES.index(w["phase"]) for w in windows]
    assert order == sorted(order)
    for w in windows:
        assert w["consumed"] > 0, w
        assert w["produced"] > 0, w
        # A window may log no call at all on a loaded machine (then None); most must. pgbench
        # logs whole microseconds from a clock it reads lazily: 0 happens.
        assert w["p50_ms"] is None or 0 <= w["p50_ms"] <= w["p99_ms"], w
        tables = {"raw": {"raw_queue"}, "lonnymq": {"message", "channel"}}[w["queue"]]
        assert set(w["tables"]) == tables
        probes = {"raw": {"head"}, "lonnymq": {"ready_channel", "channel_head"}}[w["queue"]]
        assert set(w["probes"]) == probes
        assert all(p["pages"] >= 1 for p in w["probes"].values()), w["probes"]
        assert all(t["heap_bytes"] > 0 and t["n_dead_tup"] >= 0 for t in w["tables"].values())
    for kind in ("raw", "lonnymq"):
        mine = [w for w in windows if w["queue"] == kind]
        assert 2 * sum(w["p50_ms"] is not None for w in mine) >= len(mine), mine
    # While held, the snapshot is at least as old as every transaction since it was taken.
    held = [w["oldest_xmin_age"] for w in windows if w["phase"] == "hold"]
    assert all(age is not None and age > 0 for age in held)

    for kind in ("raw", "lonnymq"):
        summary = report["summary"][kind]
        for phase in PHASES:
            assert summary[phase]["msgs_per_s"] > 0
            assert summary[phase]["consumed"] == sum(
                w["consumed"] for w in windows if w["queue"] == kind and w["phase"] == phase
            )
        ratios = report["ratios"][kind]
        assert ratios["hold"] == pytest.approx(
            summary["hold"]["msgs_per_s"] / summary["baseline"]["msgs_per_s"]
        )
    assert report["ratios"]["lonnymq_to_raw"]["baseline"] == pytest.approx(
        report["summary"]["lonnymq"]["baseline"]["msgs_per_s"]
        / report["summary"]["raw"]["baseline"]["msgs_per_s"]
    )
    assert "x base" in result.stdout
    assert "hold_end" in result.stdout
    assert (tmp_path / "long_txn.png").stat().st_size > 0
    # The benchmark's schemas are gone.
    with psycopg.connect(dsn, autocommit=True) as conn:
        left = conn.execute(
            "SELECT count(*) FROM pg_namespace WHERE nspname IN (%s, %s)",
            (schema, f"{schema}_raw"),
        ).fetchone()
    assert left == (0,)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--long-txn", "--hold", "0"], "hold must be a positive number of seconds, got 0.0"),
        (["--long-txn", "--spark-only"], "--long-txn and --spark-only are separate runs"),
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


def test_script_refuses_bad_durations(dsn: str, tmp_path: Path) -> None:
    env = {**os.environ, "LONNYMQ_DSN": dsn}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--window", "-1", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2
    assert "window must be a positive number of seconds, got -1.0" in result.stderr
    assert not (tmp_path / "long_txn.json").exists()
