"""The CLI's schedule, archive, top and worker (metrics, retries, SIGTERM) commands, run as
real subprocesses."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest


def _cli(
    dsn: str, schema: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lonnymq.cli", "--schema", schema, *args],
        capture_output=True,
        text=True,
        env={**os.environ, "LONNYMQ_DSN": dsn, **(env or {})},
        timeout=120,
        check=False,
    )


def test_schedule_add_list_remove(dsn: str, schema_name: str) -> None:
    assert _cli(dsn, schema_name, "install").returncode == 0
    added = _cli(
        dsn, schema_name, "schedule", "add", "nightly", "--cron", "0 3 * * *", "--content", "go"
    )
    assert added.returncode == 0, added.stderr
    assert "created" in added.stdout
    env = {"LONNYMQ_CHANNEL": "reports"}
    updated = _cli(dsn, schema_name, "schedule", "add", "nightly", "--cron", "0 4 * * *", env=env)
    assert "updated" in updated.stdout
    listed = _cli(dsn, schema_name, "schedule", "list", "--json")
    [row] = [json.loads(line) for line in listed.stdout.splitlines()]
    assert (row["name"], row["cron"], row["channel"], row["content"]) == (
        "nightly",
        "0 4 * * *",
        "reports",
        "",
    )
    plain = _cli(dsn, schema_name, "schedule", "list")
    assert "nightly" in plain.stdout
    assert "0 4 * * *" in plain.stdout
    assert _cli(dsn, schema_name, "schedule", "remove", "nightly").returncode == 0
    missing = _cli(dsn, schema_name, "schedule", "remove", "nightly")
    assert missing.returncode == 3
    assert "no schedule named" in missing.stderr
    bad = _cli(dsn, schema_name, "schedule", "add", "x", "--cron", "61 * * * *")
    assert bad.returncode == 1
    assert "InvalidArgumentError" in bad.stderr


def test_archive_list_and_replay_failed(dsn: str, schema_name: str, tmp_path: Path) -> None:
    (tmp_path / "flaky_handlers.py").write_text(
        "def handle(message):\n"
        "    if message.content.startswith(b'bad'):\n"
        "        raise ValueError('cannot handle ' + message.content.decode())\n"
    )
    env = {"PYTHONPATH": str(tmp_path)}
    assert _cli(dsn, schema_name, "install", "--archive").returncode == 0
    assert _cli(dsn, schema_name, "create", "ok", "bad1", "bad2").returncode == 0
    worked = _cli(
        dsn,
        schema_name,
        "worker",
        "flaky_handlers:handle",
        "--until-idle",
        "--max-attempts",
        "2",
        "--backoff-base-ms",
        "10",
        "--backoff-max-ms",
        "10",
        "--no-jitter",
        "--log-format",
        "json",
        env=env,
    )
    assert worked.returncode == 0, worked.stderr
    stats = json.loads(worked.stdout.splitlines()[-1])
    assert (stats["completed"], stats["retried"], stats["failed"]) == (1, 2, 2)
    logs = [json.loads(line) for line in worked.stderr.splitlines() if line.startswith("{")]
    assert any(r.get("attempt") == 2 and r["level"] == "error" for r in logs)
    listed = _cli(dsn, schema_name, "archive", "list", "--outcome", "failed", "--json")
    failed = [json.loads(line) for line in listed.stdout.splitlines()]
    assert sorted(r["content"] for r in failed) == ["bad1", "bad2"]
    assert all("ValueError: cannot handle" in r["error"] for r in failed)
    assert all(r["num_attempts"] == 2 for r in failed)
    replayed = _cli(dsn, schema_name, "archive", "replay", "--failed")
    assert replayed.returncode == 0, replayed.stderr
    assert replayed.stdout.strip() == "2 replayed"
    again = _cli(dsn, schema_name, "archive", "replay", "--failed", "--json")
    assert (again.returncode, again.stdout) == (0, "")  # nothing left to replay
    said = _cli(dsn, schema_name, "archive", "replay", "--failed")
    assert said.returncode == 0, said.stderr
    assert said.stdout.startswith("nothing to replay")
    sizes = _cli(dsn, schema_name, "stats", "--json")
    assert [json.loads(line)["size"] for line in sizes.stdout.splitlines()] == [2]
    none = _cli(dsn, schema_name, "archive", "replay")
    assert none.returncode == 1


def test_top_json_shows_size_in_flight_and_rate(dsn: str, schema_name: str) -> None:
    assert _cli(dsn, schema_name, "install").returncode == 0
    assert _cli(dsn, schema_name, "create", "--channel", "t", "a", "b", "c").returncode == 0
    top = _cli(dsn, schema_name, "top", "--json", "--iterations", "2", "--interval", "0.05")
    assert top.returncode == 0, top.stderr
    rows = [json.loads(line) for line in top.stdout.splitlines()]
    assert [(r["channel"], r["size"], r["in_flight"]) for r in rows] == [("t", 3, 0)] * 2
    assert rows[0]["rate"] is None  # one sample has no rate yet
    assert rows[1]["rate"] == 0
    assert rows[1]["next_dequeue_in_ms"] == 0
    plain = _cli(dsn, schema_name, "top", "--iterations", "1")
    assert "in flight" in plain.stdout
    assert re.search(r"^t\s+3\s+0", plain.stdout, re.MULTILINE)


@pytest.mark.slow
def test_worker_serves_metrics_and_stops_cleanly_on_sigterm(
    dsn: str, schema_name: str, tmp_path: Path
) -> None:
    (tmp_path / "ok_handlers.py").write_text("def handle(message):\n    pass\n")
    assert _cli(dsn, schema_name, "install").returncode == 0
    assert _cli(dsn, schema_name, "create", "--channel", "mc", "1", "2").returncode == 0
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lonnymq.cli",
            "--schema",
            schema_name,
            "worker",
            "ok_handlers:handle",
            "--metrics-port",
            "0",
            "--asyncio",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "LONNYMQ_DSN": dsn, "PYTHONPATH": str(tmp_path)},
    )
    try:
        assert proc.stderr is not None
        port = None
        while port is None:
            line = proc.stderr.readline()
            assert line, "worker exited before serving metrics"
            found = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", line)
            port = int(found[1]) if found else None
        body = ""
        deadline = time.monotonic() + 60
        while 'event="completed"} 2' not in body and time.monotonic() < deadline:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as response:
                body = response.read().decode()
            time.sleep(0.05)
        assert 'lonnymq_worker_messages_total{channel="mc",event="completed"} 2' in body
        assert 'lonnymq_worker_messages_total{channel="mc",event="dequeued"} 2' in body
        # The worker's calls are counted: at least the one that took the messages and the
        # one that reported them (a call that failed, e.g. a connection lost under load, is
        # retried by the worker and counted as an error too).
        op = '{operation="message_settle"}'
        counts = {
            name: int(value)
            for name, value in re.findall(
                r"^(lonnymq_sql_\w+_total)" + re.escape(op) + r" (\d+)$", body, re.M
            )
            if name in ("lonnymq_sql_calls_total", "lonnymq_sql_errors_total")
        }
        sql_lines = [line for line in body.splitlines() if line.startswith("lonnymq_sql_")]
        assert (
            counts.get("lonnymq_sql_calls_total", 0) - counts.get("lonnymq_sql_errors_total", 0)
            >= 2
        ), sql_lines
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0
    assert json.loads(out.splitlines()[-1])["completed"] == 2
