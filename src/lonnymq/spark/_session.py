"""Settings of the local Spark sessions lonnymq starts (the demo, the bench) and its tests use."""

from __future__ import annotations

LOCAL_SPARK_CONF: dict[str, bool | float | int | str | None] = {
    # How long the JVM waits for a Python worker it started to connect back (Spark's default
    # is 15 s). The planning of a Python data source starts a fresh worker, which imports
    # pyspark and lonnymq: on a two-core machine running two Spark sessions and two
    # PostgreSQL servers at once, that took longer, and the query failed with "Python worker
    # failed to connect back".
    "spark.python.authenticate.socketTimeout": "120s",
}
