"""The data source's one place that talks to PostgreSQL: its named statements, connections
(cached per executor process) and error translation. No pyspark here."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

import psycopg
from psycopg import sql

from .. import _core, migrate
from ..errors import InvalidArgumentError, SchemaNotInstalledError, SchemaVersionError, translate
from ..queue import _check_pooled as check_pooled
from ._options import Connection

__all__ = ["SPARK_SCHEMA_VERSION", "check_installed", "connect", "executor_connection", "run"]

# The first schema version with the tables the data source needs (the baseline has them all;
# a migration that changes them raises it). Its functions come with every install.
SPARK_SCHEMA_VERSION = 1

Conn = psycopg.Connection[Any]


def statement_texts() -> dict[str, str]:
    """The named statements of ``spark/statements.sql``."""
    return _core.statement_texts("lonnymq.spark", "statements.sql")


@cache
def statement(schema: str, name: str) -> sql.Composed:
    return sql.SQL(statement_texts()[name]).format(schema=sql.Identifier(schema))


def connect(conn: Connection, *, autocommit: bool = True) -> Conn:
    """A new connection to the queue's database."""
    try:
        db = psycopg.connect(
            _core.with_client_timeouts(conn.dsn),
            autocommit=True,
            application_name="lonnymq-spark",
        )
        try:
            # The queue's operations run at READ COMMITTED whatever the server's or the role's
            # default; a snapshot read still asks for REPEATABLE READ by name.
            db.execute("SET default_transaction_isolation TO 'read committed'")
            db.autocommit = autocommit
        except BaseException:
            db.close()
            raise
        return db
    except psycopg.Error as err:
        raise translate(err, schema=conn.schema) from err


_cache_lock = threading.Lock()
_cache: dict[tuple[int, str], Conn] = {}


def executor_connection(conn: Connection) -> Conn:
    """A connection kept for this process (Spark reuses its Python workers across tasks),
    opened again when it was closed, broken or closed by the server since the last task (a
    restart, an administrator's kill: the next statement would fail the task). Not in
    autocommit: callers run transactions."""
    key = (os.getpid(), conn.dsn)
    with _cache_lock:
        cached = _cache.get(key)
        if cached is not None and not cached.closed and not cached.broken:
            if cached.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
                try:
                    check_pooled(cached)  # the pool's own check: the socket, no round trip
                    return cached
                except psycopg.OperationalError:
                    pass
            cached.close()
        fresh = connect(conn, autocommit=False)
        _cache[key] = fresh
        return fresh


def enter_snapshot(db: Conn, snapshot: str) -> None:
    """Make the transaction just begun on ``db`` see the exported ``snapshot``; an id that
    names no snapshot open now raises :class:`InvalidArgumentError` naming the option."""
    db.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    try:
        db.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot)))
    except psycopg.OperationalError:
        raise
    except psycopg.DatabaseError as err:  # the statement fails only for the id it names
        raise InvalidArgumentError(
            f"lonnymq option 'snapshot': {err.diag.message_primary or err}; an id from "
            "lonnymq.spark.snapshot() is valid only while its with block is open, so run the "
            "Spark action inside it"
        ) from None


@contextmanager
def translated(schema: str) -> Iterator[None]:
    """Turn driver errors into lonnymq errors."""
    try:
        yield
    except psycopg.Error as err:
        raise translate(err, schema=schema) from err


def run(db: Conn, schema: str, name: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Run a named statement and return its rows."""
    with translated(schema):
        return db.execute(statement(schema, name), params).fetchall()


def check_installed(conn: Connection, snapshot: str | None = None) -> None:
    """Refuse early, on the driver, when the schema lacks what the data source needs, or
    when ``snapshot`` (the option) names no snapshot open now."""
    with connect(conn) as db, translated(conn.schema):
        row = db.execute(
            "SELECT to_regclass(format('%%I.migration', %s::text)) IS NOT NULL", [conn.schema]
        ).fetchone()
        version = 0
        if row is not None and row[0]:
            found = db.execute(migrate.applied_statement(conn.schema)).fetchone()
            version = int(found[0]) if found is not None else 0
        if version == 0:
            raise SchemaNotInstalledError(
                f"lonnymq is not installed in schema {conn.schema!r} of that database "
                f"(lonnymq option 'schema'); run Queue(dsn, schema=...).install() or "
                f"`lonnymq install` first"
            )
        if version < SPARK_SCHEMA_VERSION:
            raise SchemaVersionError(
                f"schema {conn.schema!r} is at version {version}; the Spark data source needs "
                f"version {SPARK_SCHEMA_VERSION}: run install() again to upgrade it"
            )
        if snapshot:
            with db.transaction():
                enter_snapshot(db, snapshot)
