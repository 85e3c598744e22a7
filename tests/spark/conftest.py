"""One local Spark session for the whole Spark test module (starting Spark is slow), and
installed queues on the test server. Spark tests must not run in parallel with each other."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from pyspark.sql import SparkSession

from lonnymq.spark._session import LOCAL_SPARK_CONF


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """``local[2,4]``: two task threads, and a failed task is tried up to 4 times."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    # Spark's processes inherit the environment the JVM starts with: without LONNYMQ_DSN,
    # the 'dsn' option is required (tests pass it explicitly).
    saved_dsn = os.environ.pop("LONNYMQ_DSN", None)
    session = (
        SparkSession.builder.master("local[2,4]")
        .appName("lonnymq-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.memory", "1g")
        .config("spark.sql.streaming.forceDeleteTempCheckpointLocation", "true")
        .config(map=LOCAL_SPARK_CONF)
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
    if saved_dsn is not None:
        os.environ["LONNYMQ_DSN"] = saved_dsn


@pytest.fixture
def options(dsn: str, schema_name: str) -> dict[str, Any]:
    """The connection options of the test's schema."""
    return {"dsn": dsn, "schema": schema_name}
