"""The CLI, run as a real subprocess against the test server."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psycopg


def _run(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LONNYMQ_DSN": dsn}
    return subprocess.run(
        [sys.executable, "-m", "lonnymq.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )


def test_install_and_stats_json(dsn: str, schema_name: str) -> None:
    installed = _run(dsn, "--schema", schema_name, "install", "--archive")
    assert installed.returncode == 0, installed.stderr
    assert f"schema {schema_name!r} is at version 1" in installed.stdout
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'SELECT "{schema_name}".message_create(%s, %s)', (b"x", "cli"))
    stats = _run(dsn, "--schema", schema_name, "stats", "--json")
    assert stats.returncode == 0, stats.stderr
    rows = [json.loads(line) for line in stats.stdout.splitlines()]
    assert [(r["channel"], r["size"], r["in_flight"]) for r in rows] == [("cli", 1, 0)]


def test_migrate_print_is_the_install_script(dsn: str) -> None:
    printed = _run(dsn, "--schema", "printed", "migrate", "--print")
    assert printed.returncode == 0
    assert printed.stdout.startswith("BEGIN;")
    assert 'CREATE SCHEMA IF NOT EXISTS "printed"' in printed.stdout
    assert printed.stdout.rstrip().endswith("COMMIT;")


def test_bad_schema_name_is_a_clean_error(dsn: str) -> None:
    result = _run(dsn, "--schema", 'x"; DROP TABLE y; --', "stats")
    assert result.returncode == 1
    assert "InvalidArgumentError" in result.stderr
    assert "Traceback" not in result.stderr


def test_demo_runs_and_checks_hold(dsn: str) -> None:
    result = _run(dsn, "demo", "--messages", "300", "--workers", "3")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "All checks held." in result.stdout
    assert "Finished exactly once: yes" in result.stdout
