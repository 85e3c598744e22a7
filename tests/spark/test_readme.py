"""The Spark example of the documentation (examples/spark_pipeline.py) runs as written, on
the shared test session, and the Spark page says what write_result returns."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import psycopg
import pytest
from pyspark.sql import SparkSession

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples/spark_pipeline.py"
PAGE = ROOT / "docs" / "spark.md"


@pytest.mark.slow
def test_the_spark_example_runs(
    spark: SparkSession, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    example = EXAMPLE.read_text("utf-8")
    monkeypatch.setenv("LONNYMQ_DSN", dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP SCHEMA IF EXISTS sparkdemo CASCADE")
        try:
            namespace: dict[str, Any] = {}
            exec(compile(example, str(EXAMPLE), "exec"), namespace)
            assert namespace["spark"] is spark  # it joined the running session
            left = conn.execute("SELECT count(*) FROM sparkdemo.spark_batch").fetchone()
            assert left == (0,)
        finally:
            conn.execute("DROP SCHEMA IF EXISTS sparkdemo CASCADE")


def test_the_page_says_what_write_result_returns() -> None:
    # It listed dropped_channels and replayed, which write_result never fills in.
    from lonnymq.spark import _write

    text = " ".join(PAGE.read_text("utf-8").split())
    [said] = re.findall(r"returns a `WriteResult`([^.]*)\.", text)
    named = set(re.findall(r"`(\w+)`", said))
    filled = {"created", "deduplicated", "dropped"}
    assert filled <= named
    unfilled = {f.name for f in dataclasses.fields(_write.WriteResult)} - filled
    assert unfilled <= named  # and said to be empty or false
    assert "is empty" in said
    assert "false" in said
