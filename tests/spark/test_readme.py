"""The README's Spark example runs as written (on the shared test session)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import psycopg
import pytest
from pyspark.sql import SparkSession

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.slow
def test_readme_spark_example_runs(
    spark: SparkSession, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text("utf-8"), flags=re.DOTALL)
    [example] = [b for b in blocks if 'format("lonnymq")' in b]
    monkeypatch.setenv("LONNYMQ_DSN", dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP SCHEMA IF EXISTS sparkdemo CASCADE")
        try:
            namespace: dict[str, Any] = {}
            exec(compile(example, str(README), "exec"), namespace)
            assert namespace["spark"] is spark  # it joined the running session
            left = conn.execute("SELECT count(*) FROM sparkdemo.spark_batch").fetchone()
            assert left == (0,)
        finally:
            conn.execute("DROP SCHEMA IF EXISTS sparkdemo CASCADE")


def test_readme_says_what_write_result_returns() -> None:
    # It listed dropped_channels and replayed, which write_result never fills in.
    from lonnymq.spark import _write

    text = " ".join(README.read_text("utf-8").split())
    [said] = re.findall(r"`write_result` returns a `WriteResult`([^.]*)\.", text)
    named = set(re.findall(r"`(\w+)`", said))
    filled = {"created", "deduplicated", "dropped"}
    assert filled <= named
    unfilled = {f.name for f in dataclasses.fields(_write.WriteResult)} - filled
    assert unfilled <= named  # and said to be empty or false
    assert "is empty" in said
    assert "false" in said
