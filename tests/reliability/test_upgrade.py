"""Upgrading a live queue: from the first migration to the latest while consumers run."""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg import sql

from lonnymq import Message, Queue, migrate
from lonnymq.worker import Worker

HOLD_MS = 600_000  # the held messages must outlive the whole test
OLD_LOCK_MS = 60_000

Conn = psycopg.Connection[Any]


def install_up_to(conn: Conn, schema: str, version: int, *, after: int = 0) -> None:
    """Apply migrations ``after``+1..``version`` in one transaction, each in full."""
    with conn.transaction():
        conn.execute(migrate.lock_statement(), {"schema": schema})
        for statement in migrate.prepare_statements(schema):
            conn.execute(statement)
        for migration in migrate.migrations():
            if migration.version <= after:
                continue
            if migration.version > version:
                break
            conn.execute(migrate.search_path_statement(schema))
            conn.execute(migration.sql.encode())
            conn.execute(migrate.record_statement(schema, migration))


def _catalog(conn: Conn, schema: str) -> dict[str, list[tuple[Any, ...]]]:
    """What a schema holds, as the catalogs describe it, with its name written as ``S``."""
    # channel_key's body holds a number drawn from the schema's name: its text is left out.
    functions = conn.execute(
        """SELECT p.proname, pg_get_function_identity_arguments(p.oid), p.prosecdef,
                  p.proconfig::text, p.proacl::text, p.provolatile, p.prokind,
                  CASE WHEN p.proname <> 'channel_key' THEN md5(replace(p.prosrc, %s, 'S')) END
           FROM pg_proc p WHERE p.pronamespace = %s::regnamespace ORDER BY 1, 2""",
        (schema, schema),
    ).fetchall()
    relations = conn.execute(
        """SELECT c.relname, c.relkind, c.relacl::text,
                  (SELECT array_agg(a.attname || ' ' || format_type(a.atttypid, a.atttypmod)
                                    ORDER BY a.attnum)
                   FROM pg_attribute a WHERE a.attrelid = c.oid AND a.attnum > 0
                     AND NOT a.attisdropped)::text
           FROM pg_class c WHERE c.relnamespace = %s::regnamespace ORDER BY 1""",
        (schema,),
    ).fetchall()
    space = conn.execute(
        "SELECT nspacl::text FROM pg_namespace WHERE nspname = %s", (schema,)
    ).fetchall()

    def named(rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        return [
            tuple(v.replace(schema, "S") if isinstance(v, str) else v for v in row) for row in rows
        ]

    return {"functions": named(functions), "relations": named(relations), "schema": space}


@pytest.mark.parametrize("from_version", [0, 12, 23])
def test_an_install_equals_the_migrations_run_one_by_one(
    dsn: str, schema_name: str, other_schema: str, admin: Conn, from_version: int
) -> None:
    """install() runs secure_functions() once for all its migrations, not after each: the
    schema it leaves (a fresh one, or one upgraded with roles granted) is the one every
    migration run in full leaves."""
    latest = migrate.latest_version()
    roles = {kind: f"lmq_up_{kind}_{uuid.uuid4().hex[:8]}" for kind in ("producer", "worker")}
    try:
        for role in roles.values():
            admin.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(role)))
        if from_version:
            for schema in (schema_name, other_schema):
                install_up_to(admin, schema, from_version)
                for kind, role in roles.items():
                    admin.execute(
                        sql.SQL("SELECT {}.role_grant(%s, %s)").format(sql.Identifier(schema)),
                        (role, kind),
                    )
        with Queue(dsn, schema=schema_name) as queue:
            queue.install()
        install_up_to(admin, other_schema, latest, after=from_version)
        installed, one_by_one = _catalog(admin, schema_name), _catalog(admin, other_schema)
    finally:
        for role in roles.values():
            admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
    assert len(installed["functions"]) > 50
    assert all(row[2] for row in installed["functions"] if row[0] != "channel_key")
    if from_version:
        granted = [row for row in installed["functions"] if roles["worker"] in (row[4] or "")]
        assert len(granted) > 5
    assert installed == one_by_one
    calls = re.compile(r"^SELECT secure_functions\(\);$", re.MULTILINE)
    assert len(calls.findall(migrate.script("x", from_version=from_version))) == 1


def test_only_a_migrations_last_statement_counts_as_its_call_to_secure_functions() -> None:
    comment = "-- nothing to secure here, so no SELECT secure_functions();\n"
    assert migrate._SECURE_END.search("SELECT 1;\n" + comment) is None
    assert migrate._SECURE_END.search("SELECT 1;\nSELECT secure_functions();\n\n") is not None


class OldConsumer:
    """A consumer written against the first schema: ``message_dequeue`` and
    ``message_delete`` called in plain SQL, one message at a time."""

    def __init__(self, dsn: str, schema: str) -> None:
        self.dsn = dsn
        self.s = sql.Identifier(schema)
        self.finished: list[int] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self._guard = threading.Lock()

    def count(self) -> int:
        with self._guard:
            return len(self.finished)

    def run(self) -> None:
        dequeue = sql.SQL("SELECT id, num_attempts FROM {}.message_dequeue(%s)").format(self.s)
        delete = sql.SQL("SELECT {}.message_delete(%s, %s)").format(self.s)
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self.stop.is_set():
                row = conn.execute(dequeue, (OLD_LOCK_MS,)).fetchone()
                if row is None or row[0] is None:
                    time.sleep(0.01)
                    continue
                time.sleep(0.005)
                for _ in range(5):  # a statement may lose a deadlock with the upgrade
                    try:
                        conn.execute(delete, (row[0], row[1]))
                        break
                    except psycopg.errors.DeadlockDetected as err:
                        self.errors.append(str(err))
                else:
                    raise AssertionError(f"could not finish {row[0]}")
                with self._guard:
                    self.finished.append(int(row[0]))


def _wait_until(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.slow
def test_upgrade_from_the_first_schema_under_load_loses_nothing(
    dsn: str, schema_name: str, admin: Conn
) -> None:
    s = sql.Identifier(schema_name)
    install_up_to(admin, schema_name, 1)
    version = admin.execute(sql.SQL("SELECT max(version) FROM {}.migration").format(s))
    assert version.fetchone() == (1,)
    admin.execute(sql.SQL("SELECT {}.config_set(NULL, true)").format(s))
    admin.execute(sql.SQL("SELECT {}.channel_policy_set('one', 1, NULL, NULL)").format(s))
    admin.execute(sql.SQL("SELECT {}.channel_policy_set('paced', 2, 5, NULL)").format(s))
    channels = ["one", "paced", "free-a", "free-b", "free-c"]
    count = 600
    created = admin.execute(
        sql.SQL("SELECT id FROM {}.message_create_many(%s, %s, %s, %s)").format(s),
        (
            [channels[i % len(channels)] for i in range(count)],
            [f"m{i}".encode() for i in range(count)],
            [None] * count,
            [None] * count,
        ),
    ).fetchall()
    created_ids = {int(r[0]) for r in created}
    assert len(created_ids) == count

    # In flight across the upgrade: held by a consumer that finishes them afterwards.
    held = admin.execute(
        sql.SQL(
            "SELECT id, channel, content, state, num_attempts, dequeue_at, unlock_at"
            " FROM {}.message_dequeue_many(4, %s)"
        ).format(s),
        (HOLD_MS,),
    ).fetchall()
    assert len(held) == 4
    assert {r[1] for r in held} >= {"one", "paced"}  # one channel blocked, one at half

    consumers = [OldConsumer(dsn, schema_name) for _ in range(2)]
    threads = [threading.Thread(target=c.run, daemon=True) for c in consumers]
    for thread in threads:
        thread.start()

    def old_done() -> int:
        return sum(c.count() for c in consumers)

    with Queue(dsn, schema=schema_name) as queue:
        try:
            _wait_until(lambda: old_done() >= 20, "the old consumers to start")
            before = old_done()
            assert queue.install() == migrate.latest_version()
            after = old_done()
            _wait_until(lambda: old_done() >= after + 20, "old consumers after the upgrade")
        finally:
            for consumer in consumers:
                consumer.stop.set()
            for thread in threads:
                thread.join(timeout=30)
        assert not any(t.is_alive() for t in threads)
        assert before < count  # the upgrade ran while messages were waiting

        # The messages held since before the upgrade still carry valid attempts.
        for id_, channel, content, state, attempts, dequeue_at, unlock_at in held:
            Message(id_, channel, content, state, attempts, dequeue_at, unlock_at, queue).delete()

        handled: list[int] = []
        guard = threading.Lock()

        def handler(message: Message) -> None:
            with guard:
                handled.append(message.id)

        stats = Worker(queue, handler, concurrency=3, lock_ms=OLD_LOCK_MS).run(
            handle_signals=False, until_idle=True
        )

        old = [i for c in consumers for i in c.finished]
        finished = old + [int(r[0]) for r in held] + handled
        assert sorted(finished) == sorted(created_ids)  # each exactly once
        assert stats.completed == len(handled)
        archived = admin.execute(sql.SQL("SELECT id, outcome FROM {}.archive").format(s)).fetchall()
        assert sorted(archived) == sorted((i, "completed") for i in created_ids)
        assert admin.execute(sql.SQL("SELECT count(*) FROM {}.message").format(s)).fetchone() == (
            0,
        )
        assert queue.verify() == []
