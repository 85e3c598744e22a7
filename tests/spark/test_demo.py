"""The demo pipeline (the README's main command), small, run as a user runs it: the CLI in a
subprocess, with its own Spark session (the demo stops its session at the end, so it cannot
share the test suite's)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from lonnymq._demo_model import TENANTS
from lonnymq.demo import NOTIFY_SCHEMA

ROWS = 4_000


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_pipeline_runs_and_its_report_adds_up(dsn: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    options = ["--rows", str(ROWS), "--workers", "4", "--batch", "1000", "--out", str(out)]
    with (tmp_path / "stderr.txt").open("w") as errors:
        demo = subprocess.Popen(
            [sys.executable, "-m", "lonnymq.cli", "demo", *options, "--dashboard", "0"],
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            env={**os.environ, "LONNYMQ_DSN": dsn},
        )
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(demo.stdout or ()), daemon=True)
        reader.start()
        try:
            pages = _watch_channels(demo, lines)
        finally:
            if demo.poll() is None:
                demo.kill()
        reader.join(timeout=60)
    stdout, stderr = "".join(lines), (tmp_path / "stderr.txt").read_text()
    assert demo.returncode == 0, stdout + stderr
    assert "All checks held." in stdout
    assert "Traceback" not in stderr
    # The dashboard served the notification queue's channels while the demo ran: the tenants
    # with a policy (their rows stay) once the policies were set. (The others are listed while
    # they hold messages, which a run this small does for a moment only.)
    with_policy = [t.name for t in TENANTS if t.policy]
    assert any(all(name in page for name in with_policy) for page in pages), pages[-1:]

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
        assert title in stdout
    chart = out / "report.png"
    assert chart.read_bytes().startswith(b"\x89PNG")
    assert chart.stat().st_size > 20_000
    assert (out / "orders.parquet").is_dir()


def _watch_channels(demo: subprocess.Popen[str], lines: list[str]) -> list[str]:
    """The notification queue's channels page, read from the demo's dashboard every 0.2 s
    while the demo runs."""
    pages: list[str] = []
    url = None
    deadline = time.monotonic() + 540
    while demo.poll() is None:
        assert time.monotonic() < deadline, "the demo did not end"
        if url is None:
            found = re.search(r"(http://127\.0\.0\.1:\d+/)", "".join(lines))
            url = found and f"{found.group(1)}{NOTIFY_SCHEMA}/channels"
        else:
            try:
                with urllib.request.urlopen(url, timeout=10) as response:
                    pages.append(response.read().decode())
            except OSError:
                pass  # not serving yet, or already stopped
        time.sleep(0.2)
    assert url is not None, "the demo never said where its dashboard is"
    assert pages, "the dashboard never answered"
    return pages
