"""The crash soak's short variant (the long one: ``tests/reliability/soak.py --help``)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg
import pytest
from psycopg import sql

from lonnymq import Queue


def _load_soak() -> ModuleType:
    path = Path(__file__).with_name("soak.py")
    spec = importlib.util.spec_from_file_location("lonnymq_soak", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


soak = _load_soak()


def test_overlap_counting_only_counts_runs_holding_a_valid_lock() -> None:
    runs = [
        ("one", 0, 1_000, 100),  # [0, 100)
        ("one", 100, 1_100, 200),  # starts as the first ends: no overlap
        ("one", 300, 1_300, None),  # killed: holds its lock until 1 300
        ("one", 1_300, 2_300, 1_400),  # the redelivery, once that lock expired
        ("one", 1_350, 2_350, 1_360),  # overlaps the redelivery: a violation
        ("two", 0, 1_000, 50),
        ("two", 10, 1_010, 60),  # limit 2: fine
        ("free", 0, 1_000, 50),
        ("free", 0, 1_000, 50),  # no limit: never counted
    ]
    violations, peaks = soak.count_violations(runs, {"one": 1, "two": 2})
    assert violations == 1
    assert peaks == {"one": 2, "two": 2}


@pytest.mark.slow
def test_killed_workers_lose_nothing_and_respect_channel_limits(
    dsn: str,
    schema_name: str,
    make_queue: Callable[..., Queue],
    admin: psycopg.Connection[Any],
) -> None:
    config = soak.SoakConfig(
        messages=2_000, channels=20, workers=3, kill_every_s=1.0, lock_ms=1_500, timeout_s=200
    )
    report = soak.run_soak(dsn, schema_name, config)
    print(report.line())
    assert report.problems == []
    assert report.kills >= 1
    assert (report.lost, report.violations, report.attempt_errors) == (0, 0, 0)
    assert report.runs >= config.messages
    # The same facts, read here again.
    s = sql.Identifier(schema_name)
    rows = admin.execute(
        sql.SQL("SELECT outcome, count(*) FROM {}.archive GROUP BY outcome").format(s)
    ).fetchall()
    assert rows == [("completed", config.messages)]
    left = admin.execute(sql.SQL("SELECT count(*) FROM {}.message").format(s)).fetchone()
    assert left == (0,)
    assert make_queue(install=False).verify() == []
