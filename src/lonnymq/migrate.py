"""The schema's history: numbered migrations in ``sql/migrations/NNNN_name.sql``.

Each migration runs once, in order, and is recorded in the schema's ``migration`` table; an
install runs all those missing in one transaction that holds an advisory lock for the target
schema (so concurrent installs wait for each other). A released migration is never edited;
change comes as a new file. Nothing here does I/O: the queues run these statements.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources

from psycopg import sql

__all__ = ["Migration", "migrations", "pending", "script"]

_NAME_RE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")

# Advisory lock class for installs (ASCII "LMQ\0"); the object id is hashtext(schema).
LOCK_CLASS = 0x4C4D5100


@dataclass(frozen=True, slots=True)
class Migration:
    """One numbered migration file."""

    version: int
    name: str
    sql: str


@cache
def migrations() -> tuple[Migration, ...]:
    """Every migration shipped with this package, in version order."""
    folder = resources.files("lonnymq").joinpath("sql/migrations")
    found = []
    for entry in folder.iterdir():
        match = _NAME_RE.match(entry.name)
        if match is None:
            continue
        found.append(Migration(int(match[1]), match[2], entry.read_text("utf-8")))
    found.sort(key=lambda m: m.version)
    return tuple(found)


# The last line of every migration since 0012_security that creates or replaces functions:
# it secures every function the schema holds, whoever created it, and re-applies the grants
# (idempotent). Only that line counts (a comment that ends with the same words does not).
_SECURE_END = re.compile(r"^SELECT secure_functions\(\);\s*\Z", re.MULTILINE)


def pending(from_version: int) -> list[tuple[Migration, str]]:
    """The migrations after ``from_version``, each with the SQL to run for it when they all run
    in one transaction, in order.

    ``secure_functions()`` runs once, at the end of the last of them that calls it, instead of
    after each: it secures the whole schema, so the result is the same, and nobody sees the
    state in between (some 50 ms a call, most of a fresh install's time before)."""
    todo = [m for m in migrations() if m.version > from_version]
    securing = [i for i, m in enumerate(todo) if _SECURE_END.search(m.sql)]
    last = securing[-1] if securing else -1
    out = []
    for i, migration in enumerate(todo):
        text = migration.sql
        if i in securing and i != last:
            text = _SECURE_END.sub("", text)
        out.append((migration, text))
    return out


def latest_version() -> int:
    return migrations()[-1].version


def lock_statement() -> sql.Composed:
    return sql.SQL("SELECT pg_advisory_xact_lock({cls}, hashtext({schema}))").format(
        cls=sql.Literal(LOCK_CLASS), schema=sql.Placeholder("schema")
    )


def may_create_statement() -> sql.Composed:
    """Whether the current role may create in the schema: NULL when there is no such schema
    yet, false for a role granted a kind (it cannot migrate; see 0012_security)."""
    return sql.SQL(
        "SELECT has_schema_privilege(n.oid, 'CREATE') FROM pg_namespace n WHERE n.nspname = {}"
    ).format(sql.Placeholder("schema"))


def prepare_statements(schema: str) -> list[sql.Composed]:
    ident = sql.Identifier(schema)
    return [
        sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(ident),
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS {}.migration ("
            "version INTEGER PRIMARY KEY, name TEXT NOT NULL, "
            "applied_at TIMESTAMPTZ NOT NULL DEFAULT now())"
        ).format(ident),
    ]


def applied_statement(schema: str) -> sql.Composed:
    return sql.SQL("SELECT coalesce(max(version), 0) FROM {}.migration").format(
        sql.Identifier(schema)
    )


def search_path_statement(schema: str) -> sql.Composed:
    # The schema first so that CREATE lands there; pg_temp last so that temporary objects can
    # never shadow ours. Functions capture this path with SET search_path FROM CURRENT.
    return sql.SQL("SET LOCAL search_path TO {}, pg_catalog, pg_temp").format(
        sql.Identifier(schema)
    )


def search_path_show_statement() -> sql.SQL:
    return sql.SQL("SHOW search_path")


def search_path_restore_statement() -> sql.Composed:
    # SET LOCAL lasts to the end of the transaction, the caller's when install() runs in it:
    # its own value back, for the rest of that transaction (after it, the session's anyway).
    return sql.SQL("SELECT set_config('search_path', {}, true)").format(
        sql.Placeholder("search_path")
    )


def record_statement(schema: str, migration: Migration) -> sql.Composed:
    return sql.SQL("INSERT INTO {}.migration (version, name) VALUES ({}, {})").format(
        sql.Identifier(schema), sql.Literal(migration.version), sql.Literal(migration.name)
    )


def script(schema: str, *, from_version: int = 0) -> str:
    """The whole install as one SQL script, for teams that run their own migration tool."""
    parts = ["BEGIN;"]
    parts.append(
        sql.SQL("SELECT pg_advisory_xact_lock({}, hashtext({}));")
        .format(sql.Literal(LOCK_CLASS), sql.Literal(schema))
        .as_string()
    )
    parts.extend(s.as_string() + ";" for s in prepare_statements(schema))
    for migration, text in pending(from_version):
        parts.append(f"-- migration {migration.version:04d}_{migration.name}")
        parts.append(search_path_statement(schema).as_string() + ";")
        parts.append(text.strip())
        parts.append(record_statement(schema, migration).as_string() + ";")
    parts.append("COMMIT;")
    return "\n".join(parts) + "\n"
