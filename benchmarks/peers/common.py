"""What every peer provides to the runner, and the helpers they share: a database of its own,
and a way for the producer's thread to call an async API."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar
from urllib.parse import quote, urlencode

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from lonnymq.bench_worker import Consumer, Load

T = TypeVar("T")

POOL_CAP = 32
"""A consumer's pool: its concurrency, at most this, plus 4 (as lonnymq's bench workers)."""


def pool_size(concurrency: int) -> int:
    return min(concurrency, POOL_CAP) + 4


class Peer(ABC):
    """One job queue driven in the worker shape of ``lonnymq bench --worker``.

    The runner calls, for each concurrency: ``open`` (the peer's schema installed in a fresh
    database), then ``create`` from the producer's thread, ``finished`` from the measuring
    thread and ``consumer`` once, then ``close``."""

    name: str
    """The row's label."""
    package: str
    """The distribution whose version is reported."""
    fair_key: str
    """What stands for lonnymq's 100 channels (or why nothing does)."""

    @abstractmethod
    def settings(self, concurrency: int) -> dict[str, Any]:
        """How the peer is configured at ``concurrency``, for the report."""

    @abstractmethod
    def open(self, dsn: str) -> None:
        """Install the peer's schema into the empty database at ``dsn``; connect the producer."""

    @abstractmethod
    def create(self, count: int) -> None:
        """Enqueue ``count`` jobs through the peer's batch API, stamped with the time now."""

    @abstractmethod
    def finished(self) -> int:
        """Jobs the peer's tables hold as done since ``open``."""

    @abstractmethod
    def consumer(self, concurrency: int, load: Load) -> Consumer:
        """The peer's worker at ``concurrency``, not started; its handler records its pickup
        in ``load.pickups`` and sleeps ``HANDLER_S``."""

    @abstractmethod
    def close(self) -> None:
        """Close what ``open`` opened."""


def database_url(dsn: str, database: str) -> str:
    """A ``postgresql://`` URL to ``database`` on the server of ``dsn`` (a URL or key=value):
    host, port, user and password kept, other parameters (``options``...) left out, since
    awa takes only URLs and asyncpg reads unknown URL parameters as server settings."""
    params = conninfo_to_dict(dsn)
    auth = quote(str(params.get("user") or ""), safe="")
    if params.get("password"):
        auth += ":" + quote(str(params["password"]), safe="")
    host, port = str(params.get("host") or "localhost"), params.get("port")
    query: dict[str, str] = {}
    if host.startswith("/"):  # a Unix socket's directory, in the query (awa refuses an
        query["host"] = host  # empty host name, and this one is overridden by the query)
        if port:
            query["port"] = str(port)
        netloc = (auth + "@" if auth else "") + "localhost"
    else:
        netloc = (auth + "@" if auth else "") + host + (f":{port}" if port else "")
    url = f"postgresql://{netloc}/{quote(database, safe='')}"
    return url + ("?" + urlencode(query) if query else "")


def asyncpg_params(dsn: str) -> dict[str, Any]:
    """``asyncpg.connect``'s keyword arguments for ``dsn`` (asyncpg reads a URL's host from
    its authority before its query, so a socket directory must be passed this way)."""
    params = conninfo_to_dict(dsn)
    names = {"host": "host", "port": "port", "user": "user", "password": "password"}
    found = {ours: params[theirs] for theirs, ours in names.items() if params.get(theirs)}
    if "port" in found:
        found["port"] = int(found["port"])
    return found | {"database": params.get("dbname")}


def _drop(admin: psycopg.Connection[Any], database: str) -> None:
    admin.execute(
        sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database))
    )


@contextmanager
def fresh_database(dsn: str, database: str) -> Iterator[str]:
    """A new, empty ``database`` on the server of ``dsn`` (dropped first if a previous run
    left it), dropped again on the way out; yields its DSN."""
    with psycopg.connect(dsn, autocommit=True) as admin:
        _drop(admin, database)
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
    try:
        yield database_url(dsn, database)
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            _drop(admin, database)


class Counter:
    """A connection of the measuring thread's own, for the counts ``Peer.finished`` reads."""

    def __init__(self, dsn: str) -> None:
        self.conn = psycopg.connect(dsn, autocommit=True)

    def number(self, query: str) -> int:
        row = self.conn.execute(query.encode()).fetchone()
        return int(row[0]) if row else 0

    def close(self) -> None:
        self.conn.close()


class LoopBridge:
    """An event loop of its own, for a thread that must call an async API (the producer's):
    one call at a time, from any one thread at a time."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def run(self, awaitable: Awaitable[T]) -> T:
        async def wrapped() -> T:
            return await awaitable

        return self.loop.run_until_complete(wrapped())

    def close(self) -> None:
        self.loop.close()
