"""The README's Spark example runs as written (on the shared test session)."""

from __future__ import annotations

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
