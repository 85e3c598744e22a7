"""The PySpark data source ``lonnymq`` (install the ``lonnymq[spark]`` extra).

Four directions, all through ``format("lonnymq")``:

* ``df.write``: bulk-enqueue a DataFrame, all or nothing, once even when tasks are retried;
* ``spark.read``: read the queue (or, with ``table=archive``, its archive) in parallel, from
  one consistent snapshot when given ``snapshot`` (see :func:`snapshot`);
* ``spark.readStream``: drain the queue with at-least-once delivery (a message is deleted only
  once Spark has committed the micro-batch that read it);
* ``df.writeStream``: enqueue each micro-batch exactly once.

The format is registered in every Spark session by the top-level ``pyspark_lonnymq`` module;
:func:`register` does it explicitly. This package is the only part of lonnymq that imports
pyspark.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .. import _core
from ..embedded import DSN_ENV
from ..errors import InvalidArgumentError
from ._errors import ConsumerBusyError, ConsumerOwnedError, SparkWriteError
from ._options import Connection
from ._source import LonnyMQDataSource
from ._write import WriteResult

__all__ = [
    "ConsumerBusyError",
    "ConsumerOwnedError",
    "LonnyMQDataSource",
    "SparkWriteError",
    "WriteResult",
    "purge_staging",
    "register",
    "snapshot",
    "write_result",
]


def register(spark: Any) -> None:
    """Register ``format("lonnymq")`` in ``spark`` (a SparkSession). Not needed when the
    ``pyspark_lonnymq`` module is importable, which the package installs."""
    spark.dataSource.register(LonnyMQDataSource)


def _connection(dsn: str | None, schema: str) -> Connection:
    from ._options import connection_options

    options = {"schema": schema}
    if dsn is not None:
        options["dsn"] = dsn
    return connection_options(options)


@contextmanager
def snapshot(dsn: str | None = None) -> Iterator[str]:
    """Hold a snapshot of the database open and yield its id, for the ``snapshot`` option.

    Every partition of a ``spark.read`` given this id sees the database exactly as it was when
    the block started. Run the Spark action inside the block: the snapshot ends with it.
    While the block is open no queue's ``message`` table is compacted (``Queue.compact``); the
    ``channel`` table, which no Spark read reads, still is.
    ``dsn`` defaults to ``$LONNYMQ_DSN``.
    """
    import psycopg

    dsn = dsn or os.environ.get(DSN_ENV)
    if not dsn:
        raise InvalidArgumentError(f"snapshot() needs a dsn (or {DSN_ENV})")
    with psycopg.connect(_core.with_client_timeouts(dsn)) as conn:
        # Before the snapshot is taken, in a transaction of its own (a statement of the
        # snapshot's transaction would take the snapshot before the lock): a compaction in
        # progress finishes first, and none starts until the block ends.
        conn.autocommit = True
        conn.execute(f"SELECT pg_catalog.pg_advisory_lock_shared({_core.SNAPSHOT_LOCK_KEY})")
        try:
            conn.autocommit = False
            conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            conn.read_only = True
            with conn.transaction():
                row = conn.execute("SELECT pg_export_snapshot()").fetchone()
                assert row is not None
                yield str(row[0])
        finally:
            # Let go of the lock before the block ends: a closed connection's backend releases
            # its locks only as it exits, a moment after the close returns.
            if not conn.broken:
                conn.autocommit = True
                conn.execute(
                    f"SELECT pg_catalog.pg_advisory_unlock_shared({_core.SNAPSHOT_LOCK_KEY})"
                )


def write_result(
    write_id: str, *, dsn: str | None = None, schema: str = "lonnymq"
) -> WriteResult | None:
    """What the batch write run with option ``writeId=write_id`` enqueued (created,
    deduplicated, dropped), or ``None`` when no such write was committed. Only the counts are
    recorded: ``dropped_channels`` is empty and ``replayed`` false."""
    from ._options import writer_id
    from ._write import result_of

    return result_of(_connection(dsn, schema), writer_id("writeId", write_id), 0)


def purge_staging(
    *, older_than_ms: int = 24 * 3600 * 1000, dsn: str | None = None, schema: str = "lonnymq"
) -> int:
    """The janitor: remove rows staged by writes whose driver died before committing or
    aborting, staged more than ``older_than_ms`` ago (default a day), and commit records as old.
    Returns the staged rows removed."""
    from . import _db

    if (
        not isinstance(older_than_ms, int)
        or isinstance(older_than_ms, bool)
        or not 0 <= older_than_ms <= _core.TIME_BOUND_MS
    ):
        raise InvalidArgumentError(
            f"older_than_ms must be an int from 0 to 10^15, got {older_than_ms!r}"
        )
    conn = _connection(dsn, schema)
    with _db.connect(conn) as db:
        rows = _db.run(db, schema, "spark_stage_purge", {"older_than_ms": older_than_ms})
    return int(rows[0][0])
