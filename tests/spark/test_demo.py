"""The demo pipeline (the README's main command), small, run as a user runs it: the CLI in a
subprocess, with its own Spark session (the demo stops its session at the end, so it cannot
share the test suite's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lonnymq._demo_model import TENANTS

ROWS = 4_000


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_pipeline_runs_and_its_report_adds_up(dsn: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    options = ["--rows", str(ROWS), "--workers", "4", "--batch", "1000", "--out", str(out)]
    result = subprocess.run(
        [sys.executable, "-m", "lonnymq.cli", "demo", *options],
        capture_output=True,
        text=True,
        env={**os.environ, "LONNYMQ_DSN": dsn},
        timeout=540,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "All checks held." in result.stdout
    assert "Traceback" not in result.stderr

    report = json.loads((out / "report.json").read_text())
    assert report["rows"] == ROWS
    assert [c["ok"] for c in report["checks"]] == [True] * len(report["checks"])
    names = {c["name"] for c in report["checks"]}
    assert {"max_size held", "max_concurrency held", "release_interval_ms held"} <= names
    notify, orders = report["queues"]
    tenants = [t.name for t in TENANTS]
    for queue in (notify, orders):
        assert [t["tenant"] for t in queue["tenants"]] == tenants
        assert sum(t["messages"] for t in queue["tenants"]) == queue["messages"]
        for t in queue["tenants"]:
            assert 0 <= t["p50_ms"] <= t["p95_ms"] <= t["p99_ms"]
            assert 0 < t["done_s"] <= queue["span_s"]
            assert t["throughput"] > 0
            # The timeline for the chart ends with every message of the tenant.
            assert queue["timeline"][t["tenant"]][-1][1] == t["messages"]
    assert orders["messages"] == ROWS
    # Notifications: a few fail for good (after 3 attempts) and 5% are retried once.
    assert 0 < notify["messages"] < ROWS
    failed = sum(t["failed"] for t in notify["tenants"])
    retries = sum(t["retries"] for t in notify["tenants"])
    assert retries >= 2 * failed
    # Fairness in the orders queue: micro-batches of 1,000 take the tenants round-robin, so
    # the small tenant (8% of the orders) is done batches before the big one (62%).
    by_name = {t["tenant"]: t for t in orders["tenants"]}
    assert by_name["tenant-small"]["done_s"] < by_name["tenant-big"]["done_s"]

    for title in ("Notifications (Python Worker)", "Orders (Spark streaming query)"):
        assert title in result.stdout
    chart = out / "report.png"
    assert chart.read_bytes().startswith(b"\x89PNG")
    assert chart.stat().st_size > 20_000
    assert (out / "orders.parquet").is_dir()
