"""The Spark steps of the demo pipeline (see :mod:`lonnymq.demo`, which runs them): a local
session, the generated dataset, the two ingestions, the streaming query that drains the
orders queue, and the reports read back from the archives. Everything goes through the
public ``format("lonnymq")`` data source.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from .._demo_model import (
    MAX_ATTEMPTS,
    NOTIFY_MIN_CENTS,
    PERMANENT_EVERY,
    TENANTS,
    TRANSIENT_EVERY,
    QueueReport,
    TenantReport,
    policy_text,
)
from . import WriteResult, register, write_result
from ._session import LOCAL_SPARK_CONF

__all__ = [
    "Dataset",
    "OrderStream",
    "archive_report",
    "generate_orders",
    "ingest_notifications",
    "ingest_orders",
    "notification_fates",
    "processed_totals",
    "read_archive",
    "start_spark",
    "stop_spark",
]

DAY_START = 1_767_225_600  # 2026-01-01T00:00:00Z: the dataset's day of orders
ORDER_JSON = "order_id BIGINT, customer_id BIGINT, amount_cents BIGINT"


def start_spark(log: Path) -> SparkSession:
    """A local session with two task threads. The JVM's own output (and that of the Python
    workers it starts) goes to ``log``, so that the demo's output stays readable."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    sys.stderr.flush()
    saved = os.dup(2)
    with open(log, "wb") as sink:
        os.dup2(sink.fileno(), 2)  # the JVM inherits this descriptor as its stderr
        try:
            spark = (
                SparkSession.builder.master("local[2]")
                .appName("lonnymq-demo")
                .config("spark.ui.enabled", "false")
                .config("spark.ui.showConsoleProgress", "false")
                .config("spark.sql.shuffle.partitions", "2")
                .config("spark.sql.streaming.forceDeleteTempCheckpointLocation", "true")
                .config(map=LOCAL_SPARK_CONF)
                .getOrCreate()
            )
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    register(spark)
    return spark


def stop_spark(spark: SparkSession) -> None:
    spark.stop()


# -- the dataset ---------------------------------------------------------------------------


@dataclass
class Dataset:
    """The generated orders (a Parquet file) and what the checks compare against."""

    path: Path
    df: DataFrame
    rows: int
    orders: dict[str, int]
    notifications: dict[str, int]
    revenue: dict[str, tuple[int, int]]
    """Per tenant: (orders, sum of amount_cents)."""


def _uniform(salt: str) -> Any:
    """A number in [0, 1) from the order id: deterministic, unlike rand() in a plan."""
    return (F.abs(F.xxhash64(F.col("id"), F.lit(salt))) % 1_000_000) / 1_000_000


def generate_orders(spark: SparkSession, rows: int, path: Path) -> Dataset:
    """A day of ``rows`` orders: tenant (by the shares of ``TENANTS``), customer, amount
    (5.00 to 2,500.00, most of them small) and time, written to ``path`` as Parquet."""
    pick = _uniform("tenant")
    tenant: Any = None
    upto = 0.0
    for t in TENANTS:
        upto += t.share
        tenant = F.when(pick < upto, t.name) if tenant is None else tenant.when(pick < upto, t.name)
    tenant = tenant.otherwise(TENANTS[-1].name)
    (
        spark.range(0, rows, 1, 2)
        .select(
            F.col("id").alias("order_id"),
            tenant.alias("tenant"),
            ((F.col("id") * 7919) % 50_000).alias("customer_id"),
            (F.lit(500) + F.pow(_uniform("amount"), 3) * 249_500)
            .cast("long")
            .alias("amount_cents"),
            F.timestamp_seconds(
                F.lit(DAY_START) + (F.col("id") * 86_400 / max(rows, 1)).cast("long")
            ).alias("ordered_at"),
        )
        .write.mode("overwrite")
        .parquet(str(path))
    )
    df = spark.read.parquet(str(path))
    totals = {
        r.tenant: r
        for r in df.groupBy("tenant")
        .agg(
            F.count("*").alias("orders"),
            F.sum("amount_cents").alias("revenue"),
            F.sum((F.col("amount_cents") >= NOTIFY_MIN_CENTS).cast("long")).alias("notify"),
        )
        .collect()
    }
    names = [t.name for t in TENANTS]
    revenue = {
        n: (int(totals[n].orders), int(totals[n].revenue)) if n in totals else (0, 0) for n in names
    }
    return Dataset(
        path=path,
        df=df,
        rows=sum(n for n, _ in revenue.values()),
        orders={n: revenue[n][0] for n in names},
        notifications={n: int(totals[n].notify) if n in totals else 0 for n in names},
        revenue=revenue,
    )


# -- ingestion -----------------------------------------------------------------------------


def _write(df: DataFrame, dsn: str, schema: str, prefix: str) -> WriteResult:
    """Enqueue ``df`` (channel = tenant, content = the other columns as JSON) once; what the
    write did, by its ``writeId``."""
    write_id = f"{prefix}-{uuid.uuid4().hex}"
    (
        df.write.format("lonnymq")
        .options(dsn=dsn, schema=schema, contentFormat="json", onFull="count", writeId=write_id)
        .mode("append")
        .save()
    )
    result = write_result(write_id, dsn=dsn, schema=schema)
    assert result is not None, "a committed write has a result"
    return result


def _messages(df: DataFrame, prefix: str) -> DataFrame:
    return df.select(
        F.col("tenant").alias("channel"),
        F.concat(F.lit(prefix), F.col("order_id").cast("string")).alias("dedup_key"),
        "order_id",
        "customer_id",
        "amount_cents",
    )


def ingest_notifications(spark: SparkSession, data: Dataset, dsn: str, schema: str) -> WriteResult:
    """One notification per order of ``NOTIFY_MIN_CENTS`` or more (channels at their
    ``max_size`` drop the rest: counted, not an error)."""
    wanted = data.df.where(F.col("amount_cents") >= NOTIFY_MIN_CENTS)
    return _write(_messages(wanted, "notify-"), dsn, schema, "demo-notifications")


def ingest_orders(spark: SparkSession, data: Dataset, dsn: str, schema: str) -> WriteResult:
    """Every order, for the streaming query."""
    return _write(_messages(data.df, "order-"), dsn, schema, "demo-orders")


# -- the streaming query -------------------------------------------------------------------


class OrderStream:
    """Drains the orders queue (``spark.readStream``, Trigger.AvailableNow) into a Parquet
    table of processed orders; a message is finished once Spark committed its micro-batch.

    Spark gives the Python process that runs the source 10 seconds to start, which a busy
    machine can miss: the query then fails before it planned anything, and is started again
    from its checkpoint (at most ``RESTARTS`` times; ``on_restart`` is told why).
    """

    RESTARTS = 2

    def __init__(
        self,
        spark: SparkSession,
        dsn: str,
        schema: str,
        *,
        path: Path,
        batch: int,
        on_restart: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self.spark = spark
        self.dsn = dsn
        self.schema = schema
        self.path = path
        self.batch = batch
        self.restarts = 0
        self._on_restart = on_restart
        self._query: Any = None
        self._checkpoint: str | None = None
        self._earlier = 0  # orders processed by the queries before a restart

    def start(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)  # a file sink keeps its own log there
        self._checkpoint = tempfile.mkdtemp(prefix="lonnymq-demo-checkpoint-")
        self._launch()

    def _launch(self) -> None:
        messages = (
            self.spark.readStream.format("lonnymq")
            .options(
                dsn=self.dsn,
                schema=self.schema,
                consumer="demo-orders",
                maxMessagesPerBatch=str(self.batch),
                lockMs="120000",
            )
            .load()
        )
        processed = messages.select(
            F.col("channel").alias("tenant"),
            F.from_json(F.col("content").cast("string"), ORDER_JSON).alias("order"),
            F.col("num_attempts"),
            F.col("batch_no"),
        ).select("tenant", "order.*", "num_attempts", "batch_no")
        self._query = (
            processed.writeStream.format("parquet")
            .option("path", str(self.path))
            .option("checkpointLocation", self._checkpoint)
            .trigger(availableNow=True)
            .start()
        )

    def wait(self) -> None:
        """Until every order that was there when the query started is processed."""
        try:
            while True:
                try:
                    while not self._query.awaitTermination(1):
                        pass
                    return
                except StreamingQueryException as err:
                    if "connect back" not in str(err) or self.restarts >= self.RESTARTS:
                        raise
                    self._earlier = self.processed()
                    self.restarts += 1
                    self._on_restart(str(err).splitlines()[0])
                    self._launch()
        finally:
            self._cleanup()

    def stop(self) -> None:
        if self._query is not None and self._query.isActive:
            self._query.stop()
        self._cleanup()

    def _cleanup(self) -> None:
        if self._checkpoint is not None:
            shutil.rmtree(self._checkpoint, ignore_errors=True)
            self._checkpoint = None

    def _progress(self) -> list[dict[str, Any]]:
        return [] if self._query is None else list(self._query.recentProgress)

    def processed(self) -> int:
        """Orders in committed micro-batches so far."""
        return self._earlier + sum(int(p.get("numInputRows", 0)) for p in self._progress())

    def batches(self) -> int:
        """Micro-batches that processed orders (of the last run of the query)."""
        return sum(1 for p in self._progress() if int(p.get("numInputRows", 0)) > 0)


# -- the report ----------------------------------------------------------------------------


def _first(df: DataFrame) -> Any:
    """The one row of an aggregate."""
    row = df.first()
    assert row is not None
    return row


def read_archive(spark: SparkSession, dsn: str, schema: str) -> DataFrame:
    """The queue's archive, with each message's order (from its JSON content), cached: the
    report and the checks read it several times. ``unpersist()`` it when done."""
    order = F.from_json(F.col("content").cast("string"), ORDER_JSON)
    archive = (
        spark.read.format("lonnymq")
        .options(dsn=dsn, schema=schema, table="archive")
        .load()
        .select(
            "channel",
            "dedup_key",
            "num_attempts",
            "outcome",
            "created_at",
            "locked_at",
            "finished_at",
            order.order_id.alias("order_id"),
            order.customer_id.alias("customer_id"),
        )
        .cache()
    )
    archive.count()
    return archive


def archive_report(
    archive: DataFrame, schema: str, title: str, policy: dict[str, dict[str, int]]
) -> QueueReport:
    """Per tenant from the queue's archive: messages, failures, retries, throughput,
    latency percentiles (finished_at - created_at), when it was done, and when it would have
    been done by one FIFO queue serving the orders in the order they came, at the same
    overall rate."""
    bounds = _first(
        archive.agg(
            F.min("locked_at").alias("start"),
            F.max("finished_at").alias("end"),
            F.count("*").alias("n"),
        )
    )
    n = int(bounds.n)
    if n == 0:
        return QueueReport(title, schema, 0, 0.0, 0.0, [])
    start, end = int(bounds.start), int(bounds.end)
    span_ms = max(1, end - start)
    per = {
        r.channel: r
        for r in archive.groupBy("channel")
        .agg(
            F.count("*").alias("messages"),
            F.sum((F.col("outcome") != "completed").cast("long")).alias("failed"),
            F.sum(F.col("num_attempts") - 1).alias("retries"),
            F.expr("percentile(finished_at - created_at, array(0.5, 0.95, 0.99))").alias("lat"),
            F.max("finished_at").alias("done"),
            F.max("order_id").alias("last_order"),
        )
        .collect()
    }
    # One FIFO queue serves the orders in the order they came: how many messages come up to
    # each tenant's last order (inclusive).
    ranks = _first(
        archive.select(
            *[
                F.sum((F.col("order_id") <= int(r.last_order)).cast("long")).alias(c)
                for c, r in per.items()
            ]
        )
    )
    lag = F.lag("locked_at").over(Window.partitionBy("channel").orderBy("locked_at"))
    gaps = {
        r.channel: r.gap
        for r in archive.select("channel", (F.col("locked_at") - lag).alias("gap"))
        .groupBy("channel")
        .agg(F.min("gap").alias("gap"))
        .collect()
    }
    bin_ms = max(1, math.ceil(span_ms / 120))
    timeline: dict[str, list[tuple[float, int]]] = {}
    binned = (
        archive.groupBy("channel", F.floor((F.col("finished_at") - start) / bin_ms).alias("bin"))
        .count()
        .orderBy("channel", "bin")
        .collect()
    )
    for r in binned:
        points = timeline.setdefault(r.channel, [])
        total = (points[-1][1] if points else 0) + int(r["count"])
        points.append(((int(r.bin) + 1) * bin_ms / 1000, total))
    tenants = []
    for name in [t.name for t in TENANTS if t.name in per]:
        r = per[name]
        done_ms = max(1, int(r.done) - start)
        p50, p95, p99 = (float(x) for x in r.lat)
        tenants.append(
            TenantReport(
                tenant=name,
                policy=policy_text(policy.get(name, {})),
                messages=int(r.messages),
                failed=int(r.failed),
                retries=int(r.retries),
                throughput=int(r.messages) / (done_ms / 1000),
                p50_ms=p50,
                p95_ms=p95,
                p99_ms=p99,
                done_s=done_ms / 1000,
                fifo_done_s=int(ranks[name]) / n * span_ms / 1000,
                min_gap_ms=None if gaps.get(name) is None else int(gaps[name]),
            )
        )
    return QueueReport(
        title=title,
        schema=schema,
        messages=n,
        span_s=span_ms / 1000,
        throughput=n / (span_ms / 1000),
        tenants=tenants,
        timeline=timeline,
    )


@dataclass(frozen=True)
class Fates:
    """Archived notifications against what their handler was bound to do."""

    distinct_keys: int
    mismatched: int
    """Archived with an outcome or a number of attempts other than its fate's."""


def notification_fates(archive: DataFrame) -> Fates:
    """Every notification to a customer without an address failed after ``MAX_ATTEMPTS``;
    every other one completed, at its second attempt when its first was bound to time out."""
    permanent = F.col("customer_id") % PERMANENT_EVERY == 0
    attempts = (
        F.when(permanent, MAX_ATTEMPTS)
        .when(F.col("order_id") % TRANSIENT_EVERY == 0, 2)
        .otherwise(1)
    )
    outcome = F.when(permanent, "failed").otherwise("completed")
    row = _first(
        archive.agg(
            F.countDistinct("dedup_key").alias("keys"),
            F.sum(
                ((F.col("outcome") != outcome) | (F.col("num_attempts") != attempts)).cast("long")
            ).alias("bad"),
        )
    )
    return Fates(distinct_keys=int(row.keys), mismatched=int(row.bad or 0))


@dataclass(frozen=True)
class Processed:
    """The streaming query's output table."""

    rows: int
    distinct_orders: int
    by_tenant: dict[str, tuple[int, int]]
    """Per tenant: (orders, sum of amount_cents)."""


def processed_totals(spark: SparkSession, path: Path) -> Processed:
    df = spark.read.parquet(str(path))
    totals = {
        r.tenant: (int(r.orders), int(r.revenue))
        for r in df.groupBy("tenant")
        .agg(F.count("*").alias("orders"), F.sum("amount_cents").alias("revenue"))
        .collect()
    }
    row = _first(df.agg(F.count("*").alias("n"), F.countDistinct("order_id").alias("d")))
    return Processed(
        rows=int(row.n),
        distinct_orders=int(row.d),
        by_tenant={t.name: totals.get(t.name, (0, 0)) for t in TENANTS},
    )
