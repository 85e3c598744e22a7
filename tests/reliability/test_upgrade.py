"""Installs and upgrades: a fresh install and an upgraded one end with the same schema, a
stale function layer is put back, and an upgrade under load loses nothing."""

from __future__ import annotations

import gzip
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from lonnymq import Message, Queue, migrate
from lonnymq.worker import Worker

HOLD_MS = 600_000  # the held messages must outlive the whole test
OLD_LOCK_MS = 60_000

# The install script of the first baseline (``migrate.script(FROZEN_SCHEMA)`` at the commit
# that collapsed the development migrations into it), never edited: the oldest schema an
# install upgrades. It is an artifact, not source, so it is kept compressed: the schema's
# functions are defined once, in src/lonnymq/sql/schema/, and nowhere else in the tree.
FROZEN = Path(__file__).parent / "frozen" / "first-baseline.sql.gz"
FROZEN_SCHEMA = "lonnymq_frozen"

Conn = psycopg.Connection[Any]


def install_frozen(conn: Conn, schema: str) -> None:
    """Install the frozen baseline into ``schema`` (a plain name, as the tests' are)."""
    assert schema.isidentifier()
    assert schema == schema.lower()
    script = gzip.decompress(FROZEN.read_bytes()).decode("utf-8")
    conn.execute(script.replace(FROZEN_SCHEMA, schema).encode())


def _catalog(conn: Conn, schema: str) -> dict[str, list[tuple[Any, ...]]]:
    """What a schema holds, as the catalogs describe it, with its name written as ``S`` (and
    the number channel_key draws from it as ``KEY``). The bookkeeping of what was applied
    (function_source: when, and the catalog rows' digest) is left out."""
    key = conn.execute("SELECT hashtext(%s)::TEXT", [schema]).fetchone()
    assert key is not None
    queries = {
        "functions": """
            SELECT p.proname, pg_get_function_identity_arguments(p.oid),
                   pg_get_functiondef(p.oid), p.prosecdef, p.proconfig::TEXT, p.proacl::TEXT,
                   p.provolatile, p.proparallel, p.prokind
            FROM pg_proc p WHERE p.pronamespace = %(s)s::regnamespace ORDER BY 1, 2""",
        "relations": """
            SELECT c.relname, c.relkind, c.relpersistence, c.reloptions::TEXT, c.relacl::TEXT
            FROM pg_class c WHERE c.relnamespace = %(s)s::regnamespace
              AND c.relname NOT LIKE 'function_source%%' ORDER BY 1""",
        "columns": """
            SELECT c.relname, a.attnum, a.attname, format_type(a.atttypid, a.atttypmod),
                   a.attnotnull, pg_get_expr(d.adbin, d.adrelid), a.attacl::TEXT
            FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
            LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
            WHERE c.relnamespace = %(s)s::regnamespace AND a.attnum > 0 AND NOT a.attisdropped
              AND c.relname <> 'function_source' ORDER BY 1, 2""",
        "indexes": """
            SELECT i.relname, pg_get_indexdef(i.oid)
            FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid
            WHERE i.relnamespace = %(s)s::regnamespace ORDER BY 1""",
        "constraints": """
            SELECT c.conrelid::regclass::TEXT, c.conname, pg_get_constraintdef(c.oid)
            FROM pg_constraint c WHERE c.connamespace = %(s)s::regnamespace ORDER BY 1, 2""",
        "triggers": """
            SELECT t.tgname, pg_get_triggerdef(t.oid)
            FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
            WHERE c.relnamespace = %(s)s::regnamespace ORDER BY 1""",
        "types": """
            SELECT t.typname, t.typtype FROM pg_type t
            WHERE t.typnamespace = %(s)s::regnamespace ORDER BY 1""",
        "schema": "SELECT nspacl::TEXT FROM pg_namespace WHERE nspname = %(s)s",
        "config": "SELECT * FROM {ident}.config",
        "migrations": "SELECT version, name FROM {ident}.migration ORDER BY 1",
        "function source": "SELECT sha256 FROM {ident}.function_source",
    }

    def named(value: Any) -> Any:
        if isinstance(value, str):
            return value.replace(schema, "S").replace(key[0], "KEY")
        return value

    found = {}
    for what, query in queries.items():
        text = sql.SQL(query).format(ident=sql.Identifier(schema))
        rows = conn.execute(text, {"s": schema}).fetchall()
        found[what] = [tuple(named(v) for v in row) for row in rows]
    return found


def _grant(conn: Conn, schema: str, roles: dict[str, str]) -> None:
    for kind, role in roles.items():
        conn.execute(
            sql.SQL("SELECT {}.role_grant(%s, %s)").format(sql.Identifier(schema)), (role, kind)
        )


def test_a_fresh_install_equals_an_upgraded_one(
    dsn: str, schema_name: str, other_schema: str, admin: Conn
) -> None:
    """The frozen baseline, with roles granted, upgraded by install(); and a fresh install()
    granted the same roles afterwards: the same schema, to the last grant."""
    roles = {kind: f"lmq_up_{kind}_{uuid.uuid4().hex[:8]}" for kind in ("producer", "worker")}
    try:
        for role in roles.values():
            admin.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(role)))
        install_frozen(admin, schema_name)
        _grant(admin, schema_name, roles)
        with Queue(dsn, schema=schema_name) as queue:
            assert queue.install() == migrate.latest_version()
        with Queue(dsn, schema=other_schema) as queue:
            assert queue.install() == migrate.latest_version()
        _grant(admin, other_schema, roles)
        upgraded, fresh = _catalog(admin, schema_name), _catalog(admin, other_schema)
    finally:
        for role in roles.values():
            admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
    assert len(fresh["functions"]) == len(migrate.function_signatures())
    inlined = ("channel_key", "channel_hash")
    assert all(row[3] for row in fresh["functions"] if row[0] not in inlined)
    granted = [row for row in fresh["functions"] if roles["worker"] in (row[5] or "")]
    assert len(granted) > 5
    assert fresh["function source"] == [(migrate.functions_sha256(),)]
    assert upgraded == fresh


STALE = {
    "a body replaced by hand": "CREATE OR REPLACE FUNCTION epoch() RETURNS BIGINT"
    " LANGUAGE sql AS 'SELECT 42::BIGINT'",
    "a setting changed by hand": "ALTER FUNCTION message_take_one(BIGINT) RESET jit",
    "a function the source does not have, left by another version": "CREATE FUNCTION"
    " message_purge_all() RETURNS VOID LANGUAGE sql AS 'DELETE FROM message';"
    " UPDATE function_source SET sha256 = 'from another version'",
    "an old signature": "CREATE FUNCTION message_dequeue(p_lock_ms INTEGER) RETURNS VOID"
    " LANGUAGE sql AS 'SELECT'",
    "a function dropped by hand": "DROP FUNCTION channel_stats()",
    "another recorded checksum": "UPDATE function_source SET sha256 = 'from another version'",
}


@pytest.mark.parametrize("change", sorted(STALE))
def test_install_puts_a_stale_function_layer_back(
    dsn: str, schema_name: str, other_schema: str, admin: Conn, change: str
) -> None:
    with Queue(dsn, schema=schema_name) as queue, Queue(dsn, schema=other_schema) as fresh:
        queue.install()
        fresh.install()
        with admin.transaction():
            admin.execute(migrate.search_path_statement(schema_name))
            admin.execute(STALE[change])
        assert _catalog(admin, schema_name) != _catalog(admin, other_schema)
        queue.install()
        assert _catalog(admin, schema_name) == _catalog(admin, other_schema)
        assert queue.now() != 42


def test_a_second_install_changes_nothing(dsn: str, schema_name: str, admin: Conn) -> None:
    s = sql.Identifier(schema_name)
    state = sql.SQL(
        "SELECT (SELECT applied_at FROM {}.function_source),"
        " (SELECT array_agg(p.xmin::TEXT ORDER BY p.oid) FROM pg_proc p"
        "  WHERE p.pronamespace = %s::regnamespace)"
    ).format(s)
    with Queue(dsn, schema=schema_name) as queue:
        queue.install()
        before = admin.execute(state, [schema_name]).fetchone()
        assert queue.install() == migrate.latest_version()
        assert admin.execute(state, [schema_name]).fetchone() == before


def test_concurrent_installs_upgrade_a_stale_layer_once_each_in_turn(
    dsn: str, schema_name: str, other_schema: str, admin: Conn
) -> None:
    """Four installs at once over a schema whose function layer is another version's: the
    advisory lock makes them take turns; the first re-creates the layer, the others find
    nothing to do. None fails, and the schema ends as a fresh install."""
    install_frozen(admin, schema_name)
    admin.execute(
        sql.SQL("UPDATE {}.function_source SET sha256 = 'older'").format(
            sql.Identifier(schema_name)
        )
    )
    failures: list[BaseException] = []

    def install() -> None:
        try:
            with Queue(dsn, schema=schema_name) as queue:
                queue.install()
        except BaseException as err:  # reported below
            failures.append(err)

    threads = [threading.Thread(target=install) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert failures == []
    with Queue(dsn, schema=other_schema) as queue:
        queue.install()
    assert _catalog(admin, schema_name) == _catalog(admin, other_schema)


def test_the_install_script_equals_install(
    dsn: str, schema_name: str, other_schema: str, admin: Conn
) -> None:
    admin.execute(migrate.script(schema_name).encode())
    with Queue(dsn, schema=other_schema) as queue:
        queue.install()
    assert _catalog(admin, schema_name) == _catalog(admin, other_schema)
    # An install() after the script has nothing to do: it sees the layer it recorded.
    with Queue(dsn, schema=schema_name) as queue:
        before = admin.execute(
            sql.SQL("SELECT applied_at FROM {}.function_source").format(sql.Identifier(schema_name))
        ).fetchone()
        queue.install()
        after = admin.execute(
            sql.SQL("SELECT applied_at FROM {}.function_source").format(sql.Identifier(schema_name))
        ).fetchone()
        assert before == after


def test_a_schema_from_a_development_build_is_refused(
    dsn: str, schema_name: str, admin: Conn
) -> None:
    s = sql.Identifier(schema_name)
    with Queue(dsn, schema=schema_name) as queue:
        queue.install()
        admin.execute(sql.SQL("UPDATE {}.migration SET name = 'init'").format(s))
        with pytest.raises(Exception, match="development build"):
            queue.install()


class OldConsumer:
    """A consumer that calls ``message_dequeue`` and ``message_delete`` in plain SQL, one
    message at a time, as another language's binding would."""

    def __init__(self, dsn: str, schema: str) -> None:
        self.dsn = dsn
        self.s = sql.Identifier(schema)
        self.finished: list[int] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self._guard = threading.Lock()
        # What ended run() other than stop: the test fails on it.
        self.crashed: BaseException | None = None

    def count(self) -> int:
        with self._guard:
            return len(self.finished)

    def run(self) -> None:
        try:
            self._run()
        except BaseException as err:
            self.crashed = err
            raise

    def _run(self) -> None:
        dequeue = sql.SQL("SELECT id, num_attempts FROM {}.message_dequeue(%s)").format(self.s)
        delete = sql.SQL("SELECT {}.message_delete(%s, %s)").format(self.s)
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self.stop.is_set():
                # A statement may lose a deadlock with the upgrade (which holds channel, then
                # waits for message, as a take holds message, then waits for channel): the
                # take is rolled back whole, and run again.
                try:
                    row = conn.execute(dequeue, (OLD_LOCK_MS,)).fetchone()
                except psycopg.errors.DeadlockDetected as err:
                    self.errors.append(str(err))
                    continue
                if row is None or row[0] is None:
                    time.sleep(0.01)
                    continue
                time.sleep(0.005)
                for _ in range(5):  # as above
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
def test_upgrade_under_load_loses_nothing(dsn: str, schema_name: str, admin: Conn) -> None:
    """The function layer is re-created (every function replaced, then secured) while
    consumers take and finish messages: they lose nothing and finish each message once."""
    s = sql.Identifier(schema_name)
    install_frozen(admin, schema_name)
    # As a schema installed by another version: its whole function layer is re-applied.
    admin.execute(sql.SQL("UPDATE {}.function_source SET sha256 = 'older'").format(s))
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
    assert "one" in {r[1] for r in held}  # a channel blocked (at its concurrency limit)

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
            recorded = admin.execute(sql.SQL("SELECT sha256 FROM {}.function_source").format(s))
            assert recorded.fetchone() == (migrate.functions_sha256(),)
            _wait_until(lambda: old_done() >= after + 20, "old consumers after the upgrade")
        finally:
            for consumer in consumers:
                consumer.stop.set()
            for thread in threads:
                thread.join(timeout=30)
        assert not any(t.is_alive() for t in threads)
        assert [c.crashed for c in consumers] == [None, None]
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
