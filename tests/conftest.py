"""Fixtures shared by every test: a real PostgreSQL and one fresh schema per test.

The server is ``$LONNYMQ_TEST_DSN`` when set (CI sets it to the machine's PostgreSQL), else an
embedded server started in a temporary directory for the session.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from lonnymq import Queue
from lonnymq.embedded import embedded_dsn

TEST_DSN_ENV = "LONNYMQ_TEST_DSN"


@pytest.fixture(scope="session")
def dsn(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A connection string for the server the tests run against."""
    configured = os.environ.get(TEST_DSN_ENV)
    if configured:
        return configured
    data_dir: Path = tmp_path_factory.mktemp("pg") / "data"
    return embedded_dsn(data_dir)


@pytest.fixture
def admin(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection for looking at tables directly."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        yield conn


def _fresh_schema(dsn: str) -> Iterator[str]:
    name = f"t_{uuid.uuid4().hex[:16]}"
    yield name
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


@pytest.fixture
def schema_name(dsn: str) -> Iterator[str]:
    """A schema name no other test uses; the schema is dropped afterwards."""
    yield from _fresh_schema(dsn)


@pytest.fixture
def other_schema(dsn: str) -> Iterator[str]:
    """A second fresh schema name, dropped afterwards."""
    yield from _fresh_schema(dsn)


@pytest.fixture
def make_queue(dsn: str, schema_name: str) -> Iterator[Callable[..., Queue]]:
    """Build installed queues on the test's schema (closed at the end of the test)."""
    made: list[Queue] = []

    def make(*, install: bool = True, archive: bool | None = None, **kwargs: Any) -> Queue:
        kwargs.setdefault("schema", schema_name)
        queue = Queue(dsn, **kwargs)
        made.append(queue)
        if install:
            queue.install(archive=archive)
        return queue

    yield make
    for queue in made:
        queue.close()


@pytest.fixture
def queue(make_queue: Callable[..., Queue]) -> Queue:
    """An installed queue in a fresh schema."""
    return make_queue()
