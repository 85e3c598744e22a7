"""A streaming query run as its own process by test_stream.py, so that the test can SIGKILL
it mid-batch: it drains the source queue (schema argv[2], consumer "pipe") into the target
queue (schema argv[3]) through the lonnymq stream writer, checkpointing in argv[4].

    python stream_child.py DSN SOURCE_SCHEMA TARGET_SCHEMA CHECKPOINT MODE

MODE "run" keeps going until killed; "drain" uses Trigger.AvailableNow and exits when the
source is drained.
"""

from __future__ import annotations

import os
import sys

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from lonnymq.spark._session import LOCAL_SPARK_CONF


def main() -> None:
    dsn, source, target, checkpoint, mode = sys.argv[1:6]
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("lonnymq-stream-child")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config(map=LOCAL_SPARK_CONF)
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    stream = (
        spark.readStream.format("lonnymq")
        .options(dsn=dsn, schema=source, consumer="pipe", maxMessagesPerBatch="100")
        .options(lockMs="20000", numPartitions="2")
        .load()
    )
    out = stream.select(
        "channel",
        F.concat(F.lit(b"seen:"), F.col("content")).alias("content"),
        # The source id: lets the test tell duplicates from distinct messages.
        F.col("id").cast("string").alias("origin"),
    )
    writer = (
        out.writeStream.format("lonnymq")
        .options(dsn=dsn, schema=target, contentFormat="json", sinkId="pipe-sink")
        .option("checkpointLocation", checkpoint)
    )
    if mode == "drain":
        writer.trigger(availableNow=True).start().awaitTermination()
    else:
        writer.trigger(processingTime="200 milliseconds").start().awaitTermination()
    spark.stop()


if __name__ == "__main__":
    main()
