"""``lonnymq bench --quick`` runs end to end (a smoke test: speed is never judged here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


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
