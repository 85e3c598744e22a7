"""``benchmarks/checkouts.py`` runs end to end on one tree given twice (a smoke test: speed is
never judged here): both sides drained messages, the ratio is printed, and the schemas are gone
afterwards."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "checkouts.py"


def _assert_two_medians_and_a_ratio(stdout: str, rounds: int) -> None:
    """Both checkouts' medians, each of ``rounds`` positive runs, and their ratio."""
    medians = re.findall(r"^[ab] .*: median ([\d,]+) msg/s \(([\d, ]+)\)$", stdout, re.M)
    assert len(medians) == 2, stdout
    for median, runs in medians:
        assert int(median.replace(",", "")) > 0
        assert len(runs.split(", ")) == rounds
    assert re.search(r"^b / a: \d+\.\d{3}$", stdout, re.M), stdout


def _schemas_left(dsn: str, pattern: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_namespace WHERE nspname LIKE %s", (pattern,)
        ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["drain", "steady"])
def test_checkouts_compares_two_trees_and_drops_its_schemas(dsn: str, shape: str) -> None:
    prefix = f"t_{uuid.uuid4().hex[:12]}"
    result = subprocess.run(
        [
            sys.executable, str(SCRIPT), str(ROOT), str(ROOT), "--dsn", dsn,
            "--prefix", prefix, "--channels", "10", "--backlog", "20000",
            "--rounds", "2", "--clients", "2", "--seconds", "1", "--shape", shape,
            "--batch", "100" if shape == "steady" else "1",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    _assert_two_medians_and_a_ratio(result.stdout, rounds=2)
    assert _schemas_left(dsn, f"{prefix}%") == 0


def test_checkouts_refuses_a_tree_that_is_no_checkout(dsn: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), str(ROOT), "--dsn", dsn],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "is no lonnymq checkout" in result.stderr


@pytest.mark.slow
def test_bench_rows_compares_two_trees_and_drops_the_bench_schemas(dsn: str) -> None:
    result = subprocess.run(
        [
            sys.executable, str(ROOT / "benchmarks" / "bench_rows.py"), str(ROOT), str(ROOT),
            "--dsn", dsn, "--shape", "steady", "--channels", "10", "--rounds", "2",
            "--seconds", "1",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    _assert_two_medians_and_a_ratio(result.stdout, rounds=2)
    assert _schemas_left(dsn, "lonnymq\\_bench%") == 0


def test_plan_growth_times_both_trees_and_drops_its_schemas(dsn: str) -> None:
    result = subprocess.run(
        [
            sys.executable, str(ROOT / "benchmarks" / "plan_growth.py"), str(ROOT), str(ROOT),
            "--dsn", dsn, "--channels", "500", "--creates", "5",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    pattern = r"^[ab] .*: (\d+\.\d{3}) ms per create after the growth$"
    times = re.findall(pattern, result.stdout, re.M)
    assert len(times) == 2, result.stdout
    assert all(float(t) > 0 for t in times)
    assert _schemas_left(dsn, "growth\\_%") == 0
