import os
import tempfile

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from lonnymq import Queue
from lonnymq.spark import snapshot

dsn = os.environ["LONNYMQ_DSN"]
with Queue(dsn, schema="sparkdemo") as q:
    q.install(archive=True)
spark = SparkSession.builder.master("local[2]").getOrCreate()
opts = {"dsn": dsn, "schema": "sparkdemo"}

# Batch write: every row once (all or nothing), however often Spark retries a task.
orders = spark.range(1_000).select(
    F.concat(F.lit("tenant-"), (F.col("id") % 4).cast("string")).alias("channel"),
    F.col("id").cast("string").alias("content"),
    F.concat(F.lit("order-"), F.col("id").cast("string")).alias("dedup_key"),
)
orders.write.format("lonnymq").options(**opts).mode("append").save()

# Batch read: the queue (or table=archive) in parallel, all partitions in one snapshot.
with snapshot(dsn) as snap:
    waiting = spark.read.format("lonnymq").options(**opts, snapshot=snap).load()
    assert waiting.count() == 1_000

# Streaming read -> streaming write: drain the queue into another channel. Messages are
# deleted once Spark has committed the micro-batch that read them; each micro-batch is
# enqueued exactly once, even when Spark replays it after a crash.
drained = (
    spark.readStream.format("lonnymq")
    .options(**opts, consumer="pipeline", maxMessagesPerBatch="500")
    .load()
    .select(F.lit("done").alias("channel"), F.col("content"))
)
query = (
    drained.writeStream.format("lonnymq")
    .options(**opts)
    .option("checkpointLocation", tempfile.mkdtemp())
    .trigger(availableNow=True)
    .start()
)
query.awaitTermination()
with Queue(dsn, schema="sparkdemo") as q:
    assert [(s.channel, s.size) for s in q.stats()] == [("done", 1_000)]
