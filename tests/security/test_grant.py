"""Least privilege: roles granted producer, worker or admin log in and are refused everything
else, typed; nobody reaches the tables directly. Roles are cluster-wide, so each test creates
LOGIN roles with unique names and drops them afterwards, failed or not."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from lonnymq import NewMessage, Queue, RoleKind, Settings, migrate
from lonnymq.errors import InvalidArgumentError, PermissionDeniedError
from lonnymq.worker import Worker

Conn = psycopg.Connection[Any]
PASSWORD = "lonnymq-test-pw"


@pytest.fixture
def make_role(dsn: str, admin: Conn) -> Iterator[Callable[..., str]]:
    """Create LOGIN roles with unique names; each is stripped and dropped at the end."""
    made: list[str] = []

    def make(name: str | None = None) -> str:
        role = name or f"lmq_r_{uuid.uuid4().hex[:12]}"
        admin.execute(
            sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                sql.Identifier(role), sql.Literal(PASSWORD)
            )
        )
        made.append(role)
        return role

    yield make
    for role in made:
        # Privileges on the queue's objects depend on the role: DROP OWNED BY revokes them.
        admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


@pytest.fixture
def connect_as(dsn: str) -> Iterator[Callable[..., Any]]:
    """Queues and connections logged in as another role (closed at the end)."""
    queues: list[Queue] = []
    conns: list[Conn] = []

    def role_dsn(role: str) -> str:
        return make_conninfo(dsn, user=role, password=PASSWORD)

    def queue(role: str, schema: str) -> Queue:
        made = Queue(role_dsn(role), schema=schema, pool_size=2)
        queues.append(made)
        return made

    def conn(role: str) -> Conn:
        made = psycopg.connect(role_dsn(role), autocommit=True)
        conns.append(made)
        return made

    yield {"queue": queue, "conn": conn, "dsn": role_dsn}.__getitem__
    for q in queues:
        q.close()
    for c in conns:
        c.close()


def _granted(make_role: Callable[..., str], owner: Queue, kind: str) -> str:
    role = make_role()
    assert owner.grant(role, kind) > 0
    return role


def _table_statements(schema: str) -> list[sql.Composed]:
    ident = sql.Identifier(schema)
    return [
        sql.SQL("SELECT * FROM {}.message").format(ident),
        sql.SQL("INSERT INTO {}.message (channel, content) VALUES ('x', 'y')").format(ident),
        sql.SQL("UPDATE {}.message SET num_attempts = 0").format(ident),
        sql.SQL("DELETE FROM {}.message").format(ident),
        sql.SQL("SELECT * FROM {}.channel").format(ident),
        sql.SQL("UPDATE {}.config SET archive = true").format(ident),
        sql.SQL("DELETE FROM {}.archive").format(ident),
        sql.SQL("SELECT * FROM {}.role_grant").format(ident),
        sql.SQL("DELETE FROM {}.maintenance_vacuum").format(ident),
        sql.SQL("SELECT nextval({})").format(sql.Literal(f"{schema}.message_id_seq")),
        sql.SQL("CREATE TABLE {}.mine (x int)").format(ident),
    ]


def _assert_no_table_access(conn: Conn, schema: str) -> None:
    for statement in _table_statements(schema):
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute(statement)


def _denied(call: Callable[[], object]) -> PermissionDeniedError:
    with pytest.raises(PermissionDeniedError) as caught:
        call()
    assert caught.value.sqlstate == "42501"
    assert "grant" in str(caught.value)
    return caught.value


# -- producer ------------------------------------------------------------------------------


def test_producer_creates_but_cannot_take_finish_or_govern(
    queue: Queue, make_role: Callable[..., str], connect_as: Any
) -> None:
    role = _granted(make_role, queue, "producer")
    producer = connect_as("queue")(role, queue.schema)
    created = producer.create(b"one", channel="c")
    assert created.id is not None
    assert [r.status for r in producer.create_many([NewMessage(b"two", channel="c")])] == [
        "created"
    ]
    assert producer.now() > 0
    assert producer.settings().event_channel is None
    assert producer.message_status(created.id).status == "waiting"

    held = queue.dequeue(lock_ms=60_000)
    assert held is not None
    assert held.id == created.id
    theirs = producer._message(  # the same message, as seen through the producer's queue
        (held.id, held.channel, held.content, held.state, held.num_attempts, held.dequeue_at,
         held.unlock_at, None)
    )  # fmt: skip
    _denied(lambda: producer.dequeue(lock_ms=1000))
    _denied(lambda: producer.dequeue_many(5, lock_ms=1000))
    _denied(lambda: producer.delete(theirs))
    _denied(lambda: producer.defer(theirs))
    _denied(lambda: producer.heartbeat(theirs, lock_ms=1000))
    _denied(lambda: producer.channel("c").set_policy(max_concurrency=1))
    _denied(producer.stats)
    _denied(producer.verify)
    # Nothing changed: the held message is still held, the other still waits, no policy.
    assert [(s.channel, s.size, s.in_flight, s.policy.max_concurrency) for s in queue.stats()] == [
        ("c", 2, 1, None)
    ]
    _assert_no_table_access(connect_as("conn")(role), queue.schema)


def test_producer_stages_a_spark_write_by_copy_only(
    queue: Queue, admin: Conn, make_role: Callable[..., str], connect_as: Any
) -> None:
    role = _granted(make_role, queue, "producer")
    conn = connect_as("conn")(role)
    ident = sql.Identifier(queue.schema)
    copy = sql.SQL(
        "COPY {}.spark_stage (write_id, task_tag, seq, channel, content, dequeue_at, dedup_key)"
        " FROM STDIN"
    ).format(ident)
    with conn.transaction(), conn.cursor() as cursor:
        with cursor.copy(copy) as writer:
            writer.write_row(("w1", "t1", 0, "s", b"staged", None, None))
        cursor.execute(sql.SQL("SELECT {}.spark_stage_record('w1', 't1', 1)").format(ident))
    committed = conn.execute(
        sql.SQL(
            "SELECT created FROM {}.spark_write_commit(p_sink_id => 'w1', p_batch_id => 0,"
            " p_write_id => 'w1', p_task_tags => ARRAY['t1'])"
        ).format(ident)
    ).fetchone()
    assert committed == (1,)
    assert [(s.channel, s.size) for s in queue.stats()] == [("s", 1)]
    # Staging is write-only for it: it cannot read or erase other writers' rows.
    for statement in ("SELECT * FROM {}.spark_stage", "DELETE FROM {}.spark_stage"):
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute(sql.SQL(statement).format(ident))


# -- worker --------------------------------------------------------------------------------


def test_worker_takes_and_finishes_but_cannot_govern(
    queue: Queue, make_role: Callable[..., str], connect_as: Any
) -> None:
    role = _granted(make_role, queue, "worker")
    worker = connect_as("queue")(role, queue.schema)
    queue.create_many([NewMessage(str(i).encode(), channel="w") for i in range(6)])

    first = worker.dequeue(lock_ms=60_000)
    assert first is not None
    assert worker.heartbeat(first, lock_ms=120_000) >= first.unlock_at
    worker.defer(first, state=b"saved")
    again = worker.dequeue_many(3, lock_ms=60_000)
    assert len(again) == 3
    worker.delete(again[0])
    worker.fail(again[1], error="boom")
    assert worker.dead_letter(again[2], channel="dead", error="gave up").id is not None
    batch = worker.complete_and_dequeue([], 2, lock_ms=60_000)
    assert len(batch.messages) == 2
    batch = worker.complete_and_dequeue(batch.messages, 5, lock_ms=60_000)
    assert [s.value for s in batch.completed] == ["ok", "ok"]
    assert worker.delete_many(batch.messages) == ["ok"] * len(batch.messages)
    assert worker.stats() == []  # the dead letter was taken and finished too

    _denied(lambda: worker.channel("w").set_policy(max_concurrency=1))
    _denied(lambda: worker.channel("w").clear_policy())
    _denied(worker.verify)
    _denied(lambda: worker.set_clock_offset(1000))
    _denied(worker.archived)
    _denied(lambda: worker.schedule("s", cron="* * * * *", content=b"x"))
    _denied(lambda: worker.grant(role, "admin"))
    assert queue.stats() == []  # no policy was set
    _assert_no_table_access(connect_as("conn")(role), queue.schema)


def test_a_grant_reaches_one_schema_only(
    queue: Queue,
    dsn: str,
    other_schema: str,
    make_role: Callable[..., str],
    connect_as: Any,
) -> None:
    role = _granted(make_role, queue, "worker")
    with Queue(dsn, schema=other_schema) as other:
        other.install()
        other.create(b"not yours", channel="o")
        elsewhere = connect_as("queue")(role, other_schema)
        _denied(lambda: elsewhere.dequeue(lock_ms=1000))
        _denied(lambda: elsewhere.create(b"x"))
        _denied(elsewhere.now)
        _assert_no_table_access(connect_as("conn")(role), other_schema)
        assert [(s.channel, s.size, s.in_flight) for s in other.stats()] == [("o", 1, 0)]


def test_a_worker_runs_as_the_worker_role_and_drains_a_channel(
    queue: Queue, make_role: Callable[..., str], connect_as: Any
) -> None:
    role = _granted(make_role, queue, "worker")
    queue.create_many([NewMessage(f"m{i}".encode(), channel="drain") for i in range(20)])
    seen: list[bytes] = []
    lock = threading.Lock()

    def handler(message: Any) -> None:
        with lock:
            seen.append(message.content)

    runner = Worker(connect_as("queue")(role, queue.schema), handler, concurrency=3, idle_ms=200)
    stats = runner.run(handle_signals=False, until_idle=True)
    assert sorted(seen) == sorted(f"m{i}".encode() for i in range(20))
    assert stats.completed == 20
    assert queue.stats() == []


def test_a_worker_role_fires_schedules(
    queue: Queue, make_role: Callable[..., str], connect_as: Any
) -> None:
    # A firing may call only what the worker kind is granted (a version that read the
    # schedule's spec with the admin's schedule_list fired nothing as a worker role).
    role = _granted(make_role, queue, "worker")
    queue.schedule("tick", cron="* * * * *", content=b"job", channel="jobs")
    worker_queue = connect_as("queue")(role, queue.schema)
    queue.set_clock_offset(120_000)
    driver = worker_queue.dequeue(lock_ms=60_000)
    assert driver is not None
    assert worker_queue.fire_schedule(driver).fire_at is not None
    assert [(s.channel, s.size) for s in queue.stats() if s.channel == "jobs"] == [("jobs", 1)]


@pytest.mark.parametrize("kind", ["producer", "worker", "admin"])
def test_maintenance_is_the_owners_and_a_granted_role_skips_it_quietly(
    queue: Queue,
    make_role: Callable[..., str],
    connect_as: Any,
    churn: Callable[[Queue, int, int], None],
    kind: str,
) -> None:
    churn(queue, 3_000, 600)  # enough that the owner's maintain() vacuums both tables
    role = _granted(make_role, queue, kind)
    granted = connect_as("queue")(role, queue.schema)
    assert granted.maintain() == []
    assert granted.maintain() == []  # asked once only: the refusal is remembered
    calls = {op.name: (op.calls, op.errors) for op in granted.operation_stats()}
    assert calls["maintenance_due"] == (1, 1)
    assert queue.maintain() == ["channel", "message"]


# -- admin and nobody ----------------------------------------------------------------------


def test_admin_governs_but_cannot_touch_tables(
    queue: Queue, make_role: Callable[..., str], connect_as: Any
) -> None:
    role = _granted(make_role, queue, "admin")
    admin_queue = connect_as("queue")(role, queue.schema)
    admin_queue.channel("a").set_policy(max_concurrency=2, max_size=10)
    assert [(s.channel, s.policy.max_concurrency) for s in queue.stats()] == [("a", 2)]
    assert admin_queue.verify() == []
    assert admin_queue.schedule("nightly", cron="0 3 * * *", content=b"x") is True
    assert [s.name for s in admin_queue.schedules()] == ["nightly"]
    assert admin_queue.archived() == []
    admin_queue.channel("a").clear_policy()
    # Granting is for the owner: an admin cannot hand out rights.
    _denied(lambda: admin_queue.grant(role, "producer"))
    _denied(lambda: admin_queue.revoke(role))
    _assert_no_table_access(connect_as("conn")(role), queue.schema)


def test_a_role_granted_nothing_can_do_nothing(
    queue: Queue, make_role: Callable[..., str], connect_as: Any
) -> None:
    role = make_role()
    nobody = connect_as("queue")(role, queue.schema)
    queue.create(b"x", channel="n")
    _denied(lambda: nobody.create(b"y"))
    _denied(nobody.now)
    _denied(lambda: nobody.dequeue(lock_ms=1000))
    _denied(nobody.stats)
    _assert_no_table_access(connect_as("conn")(role), queue.schema)
    assert [(s.channel, s.size) for s in queue.stats()] == [("n", 1)]


# -- grant, revoke, refusals ---------------------------------------------------------------


def test_grant_replaces_the_kind_and_revoke_takes_everything(
    queue: Queue, make_role: Callable[..., str], connect_as: Any
) -> None:
    role = make_role()
    assert queue.grant(role, RoleKind.WORKER) > queue.grant(role, "producer")
    as_role = connect_as("queue")(role, queue.schema)
    as_role.create(b"x")
    _denied(lambda: as_role.dequeue(lock_ms=1000))
    assert [(g.role, g.kind) for g in queue.grants()] == [(role, RoleKind.PRODUCER)]
    assert queue.revoke(role) is True
    assert queue.revoke(role) is False
    assert queue.grants() == []
    _denied(lambda: as_role.create(b"y"))


def test_bad_grants_are_refused_and_change_nothing(
    queue: Queue, admin: Conn, make_role: Callable[..., str]
) -> None:
    role = make_role()
    queue.grant(role, "producer")
    with pytest.raises(InvalidArgumentError, match="kind must be one of"):
        queue.grant(role, "superuser")
    with pytest.raises(InvalidArgumentError, match="kind must be"):
        queue._fetch("role_grant", {"role": role, "kind": "root"}, None)  # the database's check
    missing = f"lmq_missing_{uuid.uuid4().hex[:8]}"
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        queue.grant(missing, "worker")
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        queue.revoke(missing)
    me = admin.execute("SELECT current_user").fetchone()
    assert me is not None
    with pytest.raises(InvalidArgumentError, match="superuser"):
        queue.grant(me[0], "producer")
    with pytest.raises(InvalidArgumentError, match="role must be"):
        queue.grant("", "producer")
    assert [(g.role, g.kind) for g in queue.grants()] == [(role, RoleKind.PRODUCER)]


def test_an_injection_looking_role_name_is_only_a_name(
    queue: Queue, admin: Conn, make_role: Callable[..., str], connect_as: Any
) -> None:
    role = make_role(f'lmq "x{uuid.uuid4().hex[:6]}"; DROP ROLE postgres; --')
    assert queue.grant(role, "producer") > 0
    created = connect_as("queue")(role, queue.schema).create(b"quoted")
    assert created.id is not None
    assert [g.role for g in queue.grants()] == [role]
    assert admin.execute("SELECT count(*) FROM pg_roles WHERE rolname = 'postgres'").fetchone()
    assert queue.revoke(role) is True


def test_reinstall_reapplies_grants_to_new_functions(
    queue: Queue, admin: Conn, make_role: Callable[..., str], connect_as: Any
) -> None:
    role = _granted(make_role, queue, "worker")
    ident = sql.Identifier(queue.schema)
    # What a later migration does: replace a function (its ACL stays) and add one (no ACL).
    admin.execute(
        sql.SQL(
            "REVOKE EXECUTE ON FUNCTION {}.message_dequeue_many(integer, bigint) FROM {}"
        ).format(ident, sql.Identifier(role))
    )
    as_worker = connect_as("queue")(role, queue.schema)
    _denied(lambda: as_worker.dequeue(lock_ms=1000))
    admin.execute(sql.SQL("SELECT {}.secure_functions()").format(ident))
    assert as_worker.dequeue(lock_ms=1000) is None


# -- the CLI -------------------------------------------------------------------------------


def _cli(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lonnymq.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "LONNYMQ_DSN": dsn},
        timeout=240,
        check=False,
    )


def test_cli_grant_grants_and_revoke(dsn: str, queue: Queue, make_role: Callable[..., str]) -> None:
    role = make_role()
    granted = _cli(dsn, "--schema", queue.schema, "grant", role, "worker")
    assert granted.returncode == 0, granted.stderr
    assert "worker" in granted.stdout
    listed = _cli(dsn, "--schema", queue.schema, "grants", "--json")
    assert listed.returncode == 0, listed.stderr
    assert f'"role": "{role}", "kind": "worker"' in listed.stdout
    bad_kind = _cli(dsn, "--schema", queue.schema, "grant", role, "root")
    assert bad_kind.returncode == 2
    missing = _cli(dsn, "--schema", queue.schema, "grant", "lmq_nobody_here", "worker")
    assert missing.returncode == 1
    assert "InvalidArgumentError" in missing.stderr
    assert "does not exist" in missing.stderr
    revoked = _cli(dsn, "--schema", queue.schema, "revoke", role)
    assert revoked.returncode == 0, revoked.stderr
    assert queue.grants() == []


# -- the documentation -----------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples/security.py"
PAGE = ROOT / "docs" / "security.md"


def test_the_example_runs(
    dsn: str,
    schema_name: str,
    make_role: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    code = EXAMPLE.read_text("utf-8").replace('schema="shop"', f'schema="{schema_name}"')
    roles = {name: make_role() for name in ("shop_api", "shop_worker", "shop_ops")}
    for name, role in roles.items():
        code = code.replace(f'"{name}"', f'"{role}"')
    monkeypatch.setenv("LONNYMQ_DSN", dsn)
    exec(compile(code, str(EXAMPLE), "exec"), {})
    with Queue(dsn, schema=schema_name) as queue:
        assert sorted((g.role, g.kind.value) for g in queue.grants()) == sorted(
            [(roles["shop_api"], "producer"), (roles["shop_worker"], "worker")]
        )


def test_the_role_table_is_the_database_s(queue: Queue, admin: Conn) -> None:
    text = PAGE.read_text("utf-8")
    rows = re.findall(r"^\| (producer|worker|admin) \|.*\| (.*) \|$", text, re.M)
    assert [kind for kind, _ in rows] == ["producer", "worker", "admin"]
    documented: set[str] = set()
    for kind, functions in rows:
        documented |= set(re.findall(r"`(\w+)`", functions.split(";")[0]))
        listed = admin.execute(
            sql.SQL("SELECT {}.role_kind_functions(%s)").format(sql.Identifier(queue.schema)),
            [kind],
        ).fetchone()
        assert listed is not None
        assert documented == set(listed[0]), kind


def test_install_as_a_granted_role_succeeds_when_there_is_nothing_to_do(
    queue: Queue, admin: Conn, make_role: Callable[..., str], connect_as: Any
) -> None:
    role = _granted(make_role, queue, "producer")
    as_producer = connect_as("queue")(role, queue.schema)
    assert as_producer.install() == migrate.latest_version()
    nobody = connect_as("queue")(make_role(), queue.schema)
    _denied(nobody.install)
    # A schema behind this package's version: only its owner may migrate it.
    admin.execute(
        sql.SQL("DELETE FROM {}.migration WHERE version = %s").format(sql.Identifier(queue.schema)),
        [migrate.latest_version()],
    )
    with pytest.raises(PermissionDeniedError, match="as the role that owns the queue"):
        as_producer.install()
    assert queue.stats() == []  # the refusal changed nothing


def test_install_as_a_granted_role_is_refused_when_the_functions_are_another_version_s(
    queue: Queue, admin: Conn, make_role: Callable[..., str], connect_as: Any
) -> None:
    role = _granted(make_role, queue, "producer")
    as_producer = connect_as("queue")(role, queue.schema)
    ident = sql.Identifier(queue.schema)
    admin.execute(sql.SQL("UPDATE {}.function_source SET sha256 = 'older'").format(ident))
    with pytest.raises(PermissionDeniedError, match="and its functions"):
        as_producer.install()
    queue.install()  # the owner re-creates them
    assert as_producer.install() == migrate.latest_version()


def test_install_as_a_granted_role_may_name_the_settings_in_place_but_not_change_them(
    queue: Queue, make_role: Callable[..., str], connect_as: Any
) -> None:
    with Queue(queue.dsn, schema=queue.schema, event_channel="lonnymq_events") as owner:
        owner.install(archive=True)
    role_dsn = connect_as("dsn")(_granted(make_role, queue, "producer"))
    with Queue(role_dsn, schema=queue.schema, event_channel="lonnymq_events") as as_producer:
        # The application's usual start-up line, as a producer: nothing to change, no refusal.
        assert as_producer.install(archive=True) == migrate.latest_version()
        assert as_producer.install() == migrate.latest_version()
        with pytest.raises(PermissionDeniedError):
            as_producer.install(archive=False)
    with (
        Queue(role_dsn, schema=queue.schema, event_channel="other_events") as as_producer,
        pytest.raises(PermissionDeniedError),
    ):
        as_producer.install()
    assert queue.settings() == Settings(event_channel="lonnymq_events", archive=True)
