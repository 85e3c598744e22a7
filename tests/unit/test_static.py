"""Static properties of the package: statements, migrations, the generated sync API, the
public names and the error tree. Most need no database; the ones that look at an installed
schema use the usual fixtures."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

import lonnymq
import lonnymq.worker
from lonnymq import Queue, _core, errors, migrate, types

ROOT = Path(__file__).resolve().parents[2]
MIGRATION_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
SOURCE_NAME = re.compile(r"^(\d{2})_([a-z0-9_]+)\.sql$")

Conn = psycopg.Connection[Any]


def _schema_functions(admin: Conn, schema: str) -> dict[str, list[Any]]:
    rows = admin.execute(
        "SELECT p.proname, p.proconfig, p.proargnames FROM pg_proc p"
        " JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = %s",
        [schema],
    ).fetchall()
    return {name: [config, argnames] for name, config, argnames in rows}


# -- statements --------------------------------------------------------------------------


def test_statements_are_found() -> None:
    names = set(_core.statement_texts())
    assert {"message_create", "message_dequeue_many", "message_delete", "epoch"} <= names


def test_every_statement_calls_its_own_function(queue: Queue, admin: Conn) -> None:
    functions = _schema_functions(admin, queue.schema)
    statements = _core.statement_texts()
    assert statements
    for name, text in statements.items():
        called = re.findall(r"\{schema\}\.(\w+)\(", text)
        assert called == [name], f"statement {name} calls {called}"
        assert name in functions, f"statement {name}: no function {queue.schema}.{name}"
        argnames = set(functions[name][1] or [])
        for arg in re.findall(r"\b(p_\w+)\s*=>", text):
            assert arg in argnames, f"statement {name} passes {arg}, not a parameter"


def test_statements_compose_for_a_schema() -> None:
    statements = _core.Statements("my_schema")
    text = statements["message_create"].as_string()
    assert '"my_schema".message_create(' in text or "my_schema.message_create(" in text
    assert "{schema}" not in text


# -- migrations --------------------------------------------------------------------------


def test_migration_files_are_numbered_consecutively_from_1() -> None:
    folder = resources.files("lonnymq").joinpath("sql/migrations")
    names = sorted(entry.name for entry in folder.iterdir() if entry.name.endswith(".sql"))
    assert names
    versions = []
    for name in names:
        match = MIGRATION_NAME.match(name)
        assert match is not None, f"migration file {name!r} is not NNNN_name.sql"
        versions.append(int(match[1]))
    assert versions == list(range(1, len(versions) + 1))
    shipped = migrate.migrations()
    assert [m.version for m in shipped] == versions
    assert migrate.latest_version() == versions[-1]


def test_no_stray_files_among_migrations() -> None:
    folder = resources.files("lonnymq").joinpath("sql/migrations")
    stray = [
        entry.name
        for entry in folder.iterdir()
        if entry.name != "__pycache__" and MIGRATION_NAME.match(entry.name) is None
    ]
    assert stray == []


def test_the_first_migration_is_the_baseline() -> None:
    assert migrate.migrations()[0].name == migrate.BASELINE


def test_function_layer_files_are_named_by_concern() -> None:
    folder = resources.files("lonnymq").joinpath("sql/schema")
    names = sorted(entry.name for entry in folder.iterdir() if entry.name != "__pycache__")
    assert names
    for name in names:
        assert SOURCE_NAME.match(name), f"function file {name!r} is not NN_concern.sql"
    assert [name for name, _ in migrate.source_files()] == names


def test_each_function_is_defined_once_and_only_in_the_function_layer() -> None:
    names = [s.split("(")[0] for s in migrate.function_signatures()]
    assert len(names) >= 50
    assert sorted(n for n in set(names) if names.count(n) > 1) == []
    for migration in migrate.migrations():
        assert re.search(r"CREATE (OR REPLACE )?FUNCTION", migration.sql, re.I) is None, (
            f"migration {migration.version} defines a function: functions go in sql/schema/"
        )


def test_each_function_has_a_header_comment() -> None:
    """Above each function: what it does (starting with its name), the locks it takes and
    the SQLSTATEs it raises."""
    for name, text in migrate.source_files():
        for match in re.finditer(r"^(?:CREATE OR REPLACE FUNCTION (\w+)|DO \$\$)", text, re.M):
            lines = text[: match.start()].rstrip("\n").split("\n")
            block: list[str] = []
            while lines and lines[-1].startswith("--"):
                block.insert(0, lines.pop())
            header = "\n".join(block)
            function = match[1] or "channel_key"
            assert header.startswith(f"-- {function}()"), f"{name}: {function} has no header"
            assert "Locks:" in header, f"{name}: {function}'s header names no locks"
            assert "Raises" in header, f"{name}: {function}'s header names no SQLSTATEs"


def test_no_comment_tells_the_schema_s_history() -> None:
    """History is in git: no migration numbers in the function layer."""
    for name, text in migrate.source_files():
        assert re.search(r"(?<![\d.])00[0-9]{2}(?![\d.])", text) is None, name


def test_function_signatures_are_the_installed_identities(queue: Queue, admin: Conn) -> None:
    installed = admin.execute(
        "SELECT p.proname || '(' || pg_get_function_identity_arguments(p.oid) || ')'"
        " FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = %s",
        [queue.schema],
    ).fetchall()
    assert len(installed) == len(migrate.function_signatures())
    with admin.transaction():
        admin.execute(migrate.search_path_statement(queue.schema))
        for signature in migrate.function_signatures():
            found = admin.execute("SELECT to_regprocedure(%s)::oid", [signature]).fetchone()
            assert found is not None
            assert found[0] is not None, signature


# Functions the planner inlines into their callers: a SET clause would prevent that, so they
# pin nothing and name every object they use with its schema instead.
INLINED = {"channel_key", "channel_hash"}


def test_every_function_pins_its_search_path(queue: Queue, admin: Conn) -> None:
    functions = _schema_functions(admin, queue.schema)
    assert len(functions) >= 20
    for name, (config, _) in functions.items():
        if name in INLINED:
            continue
        paths = [c for c in config or [] if c.startswith("search_path=")]
        assert len(paths) == 1, f"function {name} does not pin its search_path"
        parts = [p.strip() for p in paths[0].removeprefix("search_path=").split(",")]
        assert parts[0] == queue.schema, f"{name}: {paths[0]}"
        assert parts[-1] == "pg_temp", f"{name}: {paths[0]}"


def test_every_function_runs_as_its_owner_for_no_one_else(queue: Queue, admin: Conn) -> None:
    # The function layer ends with secure_functions(): this fails when a function escapes it
    # (CREATE OR REPLACE resets SECURITY DEFINER and the SET clause).
    rows = admin.execute(
        "SELECT p.proname, p.prosecdef, p.proconfig,"
        " EXISTS (SELECT FROM aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a"
        "         WHERE a.grantee = 0)"
        " FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = %s",
        [queue.schema],
    ).fetchall()
    assert len(rows) >= 20
    pinned = f"search_path={queue.schema}, pg_catalog, pg_temp"
    for name, definer, config, public in rows:
        assert not public, f"PUBLIC may execute function {name}"
        if name in INLINED:
            continue
        assert definer, f"function {name} is not SECURITY DEFINER"
        paths = [c for c in config or [] if c.startswith("search_path=")]
        assert paths == [pinned], f"function {name}: {config}"
        assert not public, f"PUBLIC may execute function {name}"
    public_relations = admin.execute(
        "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace,"
        " aclexplode(coalesce(c.relacl, acldefault("
        "   CASE WHEN c.relkind = 'S' THEN 's' ELSE 'r' END::\"char\", c.relowner))) a"
        " WHERE n.nspname = %s AND a.grantee = 0",
        [queue.schema],
    ).fetchall()
    assert public_relations == []
    public_schema = admin.execute(
        "SELECT a.privilege_type FROM pg_namespace n,"
        " aclexplode(coalesce(n.nspacl, acldefault('n', n.nspowner))) a"
        " WHERE n.nspname = %s AND a.grantee = 0",
        [queue.schema],
    ).fetchall()
    assert ("CREATE",) not in public_schema


# -- the generated sync API --------------------------------------------------------------


def test_sync_api_is_up_to_date_with_the_async_one() -> None:
    result = subprocess.run(
        [sys.executable, "tools/async_to_sync.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def test_sync_and_async_apis_have_the_same_methods() -> None:
    def public(cls: type) -> set[str]:
        return {n for n in vars(cls) if not n.startswith("_") or n in {"__init__"}}

    async_to_sync = {"__aenter__": "__enter__", "__aexit__": "__exit__"}
    assert {async_to_sync.get(n, n) for n in public(lonnymq.AsyncQueue)} == public(Queue)
    assert public(lonnymq.AsyncChannel) == public(lonnymq.Channel)


# -- public names ------------------------------------------------------------------------


@pytest.mark.parametrize("module", [lonnymq, errors, types, migrate])
def test_all_names_exist(module: Any) -> None:
    names = module.__all__
    assert names
    assert len(names) == len(set(names))
    for name in names:
        assert hasattr(module, name), f"{module.__name__}.__all__ names missing {name}"


def _reference() -> dict[str, list[str]]:
    """The API reference pages: each ``::: name`` directive and the members it lists."""
    documented: dict[str, list[str]] = {}
    current: list[str] = []
    pages = (Path(__file__).resolve().parents[2] / "docs" / "reference").glob("*.md")
    for line in "\n".join(p.read_text("utf-8") for p in pages).splitlines():
        if line.startswith("::: "):
            current = documented.setdefault(line[4:].strip(), [])
        elif re.fullmatch(r" {8}- \w+", line):
            current.append(line.strip("- "))
    return documented


@pytest.mark.parametrize(
    ("cls", "twin"),
    [("Queue", "AsyncQueue"), ("Message", "AsyncMessage"), ("Channel", "AsyncChannel")],
)
def test_the_api_reference_lists_every_public_method(cls: str, twin: str) -> None:
    """The reference places each member explicitly: a public method missing from its list
    would be missing from the site."""
    documented = _reference()
    for name in (cls, twin):
        klass = getattr(lonnymq, name)
        fields = (
            {f.name for f in dataclasses.fields(klass)}
            if dataclasses.is_dataclass(klass)
            else set()
        )
        public = {m for m in vars(klass) if not m.startswith("_")} - fields
        assert sorted(documented[f"lonnymq.{name}"]) == sorted(public), name


def test_the_api_reference_shows_every_public_name() -> None:
    documented = _reference()
    names = {f"lonnymq.{n}" for n in lonnymq.__all__}
    names |= {f"lonnymq.worker.{n}" for n in lonnymq.worker.__all__}
    missing = sorted(names - set(documented))
    assert not missing, f"not in docs/reference: {missing}"


# -- the error tree ----------------------------------------------------------------------

REFUSALS: dict[str, type[errors.LonnyMQError]] = {
    "LQ001": errors.MessageNotFoundError,
    "LQ002": errors.StaleMessageError,
    "LQ003": errors.InvalidArgumentError,
    "LQ004": errors.InvalidPolicyError,
    "LQ005": errors.InvalidChannelError,
    "LQ006": errors.PayloadTooLargeError,
    "LQ007": errors.MessageLockedError,
}


def test_each_refusal_class_has_a_distinct_sqlstate() -> None:
    classes = [
        getattr(errors, name)
        for name in errors.__all__
        if isinstance(getattr(errors, name), type)
        and issubclass(getattr(errors, name), errors.LonnyMQError)
    ]
    states = [cls.sqlstate for cls in classes if cls.sqlstate is not None]
    assert len(states) == len(set(states))
    assert sorted(states) == sorted(REFUSALS)
    for sqlstate, cls in REFUSALS.items():
        assert cls.sqlstate == sqlstate
        assert issubclass(cls, errors.LonnyMQError)


def _raise(admin: Conn, sqlstate: str, message: str) -> psycopg.Error:
    block = sql.SQL("DO $$ BEGIN RAISE EXCEPTION {} USING ERRCODE = {}; END $$").format(
        sql.Literal(message), sql.Literal(sqlstate)
    )
    with pytest.raises(psycopg.Error) as caught:
        admin.execute(block)
    assert caught.value.sqlstate == sqlstate
    return caught.value


@pytest.mark.parametrize(("sqlstate", "cls"), list(REFUSALS.items()))
def test_translate_maps_each_refusal_to_its_class(
    admin: Conn, sqlstate: str, cls: type[errors.LonnyMQError]
) -> None:
    translated = errors.translate(_raise(admin, sqlstate, f"refused {sqlstate}"))
    assert type(translated) is cls
    assert str(translated) == f"refused {sqlstate}"


def test_translate_other_errors(admin: Conn) -> None:
    other = errors.translate(_raise(admin, "22012", "division"))
    assert type(other) is errors.DatabaseError
    assert other.sqlstate == "22012"
    missing = errors.translate(_raise(admin, "42883", "no function"), schema="nowhere")
    assert type(missing) is errors.SchemaNotInstalledError
    assert "nowhere" in str(missing)
    lost = errors.translate(_raise(admin, "57P01", "shutdown"))
    assert type(lost) is errors.DatabaseUnavailableError


def test_translated_queue_errors_carry_the_sqlstate(queue: Queue) -> None:
    with pytest.raises(errors.InvalidChannelError) as caught:
        queue._fetch(  # bypass the Python checks: the database refuses on its own
            "channel_policy_set",
            {"channel": "", "max_concurrency": None, "release_interval_ms": None,
             "max_size": None},
            None,
        )  # fmt: skip
    assert caught.value.sqlstate == "LQ005"
    assert "channel name" in str(caught.value)


# -- the install script ------------------------------------------------------------------


def _install_by_script(admin: Conn, schema: str) -> None:
    script = migrate.script(schema)
    assert script.startswith("BEGIN;")
    assert script.rstrip().endswith("COMMIT;")
    admin.execute(script.encode())


def _create_and_take(admin: Conn, schema: str) -> None:
    ident = sql.Identifier(schema)
    created = admin.execute(
        sql.SQL("SELECT status, id, channel_size FROM {}.message_create(%s, 'c')").format(ident),
        [b"payload"],
    ).fetchone()
    assert created is not None
    # A channel without a policy keeps no counter: no size comes back.
    assert (created[0], created[2]) == ("created", None)
    taken = admin.execute(
        sql.SQL("SELECT id, channel, content FROM {}.message_dequeue(60000)").format(ident)
    ).fetchone()
    assert taken == (created[1], "c", b"payload")


def test_install_script_installs_a_working_queue(dsn: str, admin: Conn, schema_name: str) -> None:
    _install_by_script(admin, schema_name)
    _create_and_take(admin, schema_name)
    recorded = admin.execute(
        sql.SQL("SELECT version, name FROM {}.migration ORDER BY version").format(
            sql.Identifier(schema_name)
        )
    ).fetchall()
    assert recorded == [(m.version, m.name) for m in migrate.migrations()]
    # The Python API sees it as installed and up to date, and works on it.
    with Queue(dsn, schema=schema_name) as queue:
        assert queue.install() == migrate.latest_version()
        assert [s.channel for s in queue.stats()] == ["c"]
        assert queue.create(b"more", channel="c").channel_size is None
        assert [(s.channel, s.size, s.in_flight) for s in queue.stats()] == [("c", 2, 1)]
    # From the latest version on: the function layer only.
    later = migrate.script(schema_name, from_version=migrate.latest_version())
    assert "-- migration" not in later
    assert "secure_functions()" in later


def test_install_script_quotes_any_schema_name(admin: Conn) -> None:
    schema = 'we"ird; DROP TABLE x; --'
    try:
        _install_by_script(admin, schema)
        _create_and_take(admin, schema)
    finally:
        admin.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def test_inlined_functions_are_plain_sql_naming_their_schemas(queue: Queue, admin: Conn) -> None:
    rows = admin.execute(
        "SELECT p.proname, p.proconfig, l.lanname, p.prosecdef, p.provolatile, p.prosrc"
        " FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
        " JOIN pg_language l ON l.oid = p.prolang"
        " WHERE n.nspname = %s AND p.proname = ANY (%s)",
        [queue.schema, list(INLINED)],
    ).fetchall()
    assert {row[0] for row in rows} == INLINED
    for name, config, language, secdef, volatility, source in rows:
        assert config is None, f"{name}: {config}"
        assert (language, secdef, volatility) == ("sql", False, "i"), name
        # Every function it calls is named with its schema.
        assert "pg_catalog." in source, f"{name}: {source}"
    # channel_key's keys: hashtextextended of the name, seeded with the schema's hash.
    # channel_hash: the expression that leads message_channel_head_ix (no seed: an index does
    # not move with the schema's name), so that the planner matches the probes to the index.
    same = admin.execute(
        sql.SQL(
            "SELECT {s}.channel_key(n) = hashtextextended(n, hashtext(%s)::BIGINT),"
            " {s}.channel_hash(n) = hashtextextended(n, 0)"
            " FROM unnest(ARRAY['default', 'a', 'é ü', repeat('x', 255)]) AS n"
        ).format(s=sql.Identifier(queue.schema)),
        [queue.schema],
    ).fetchall()
    assert same == [(True, True)] * 4
    row = admin.execute(
        "SELECT pg_get_indexdef(%s::regclass)", [f"{queue.schema}.message_channel_head_ix"]
    ).fetchone()
    assert row is not None
    assert "(hashtextextended(channel, (0)::bigint), dequeue_at, id)" in row[0], row[0]


def test_every_probe_by_channel_hash_checks_the_name_too() -> None:
    """Two channels whose hashes collide share a range of message_channel_head_ix: every
    probe that says ``channel_hash(m.channel) = channel_hash(x)`` says ``m.channel = x`` in
    the same condition, so that it never takes or counts the other channel's messages."""
    probe = re.compile(r"channel_hash\((\w+)\.channel\) = channel_hash\(([\w.]+)\)")
    found = 0
    for name, text in migrate.source_files():
        for match in probe.finditer(text):
            found += 1
            rest = text[match.end() : match.end() + 200]
            check = f"AND {match[1]}.channel = {match[2]} "
            assert rest.lstrip().startswith(check), f"{name}: {match[0]} without {check}"
    assert found >= 14
