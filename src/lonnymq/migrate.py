"""How a schema reaches this package's version: versioned migrations, then the function layer.

The schema has two layers, applied in this order by every install, in one transaction that
holds an advisory lock for the target schema (so concurrent installs wait for each other):

1. **Migrations** (``sql/migrations/NNNN_name.sql``): tables, indexes, sequences, types and
   their data. Each runs once, in version order, and is recorded in the schema's ``migration``
   table. A released migration is never edited; a change comes as a new file. A migration may
   not call a function of the function layer: on a fresh install those do not exist yet, and
   on an upgrade they would be the old bodies.
2. **The function layer** (``sql/schema/*.sql``): every function, each defined exactly once
   with ``CREATE OR REPLACE``, grouped by concern. It is re-applied whole after any
   migration, when its source changed (a sha256 of the files, recorded in
   ``function_source``), and when the functions bearing the source's names changed since it
   was applied (a digest of their catalog rows: a body replaced by hand is put back;
   ``role_grant()`` changes ACLs, so the owner's next install re-applies the layer once).
   Before it runs, every function of the schema that the source does not define (by
   identity: name and argument types) is dropped, so a renamed or removed function, or one
   whose arguments changed, does not linger (nor does one of another name created by hand:
   the digest does not look for those, the next re-application drops them).
   ``CREATE OR REPLACE`` cannot change a function's return type or its parameters' names:
   such a change needs ``DROP FUNCTION IF EXISTS`` of the old one in a new migration (``IF
   EXISTS``: a fresh install has no functions when migrations run).
3. ``secure_functions()`` last: definer rights, pinned ``search_path``, grants.

A role that may not create in the schema (one granted a kind) installs only when nothing is
to be done: the recorded version and checksum are this package's; otherwise it is told to
run the install as the queue's owner. Nothing here does I/O: the queues run these
statements, and :func:`script` prints them.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources

from psycopg import sql

__all__ = [
    "Migration",
    "function_signatures",
    "functions_sha256",
    "functions_source",
    "latest_version",
    "migrations",
    "pending",
    "script",
]

_NAME_RE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
_SOURCE_RE = re.compile(r"^(\d{2})_([a-z0-9_]+)\.sql$")

# The name of migration 1. A schema whose migration 1 has another name was installed by a
# development build from before the first release: it cannot be upgraded.
BASELINE = "baseline"

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


@cache
def source_files() -> tuple[tuple[str, str], ...]:
    """The function layer's files, ``(name, text)``, in the order they run."""
    folder = resources.files("lonnymq").joinpath("sql/schema")
    found = [
        (entry.name, entry.read_text("utf-8"))
        for entry in folder.iterdir()
        if _SOURCE_RE.match(entry.name)
    ]
    found.sort()
    return tuple(found)


@cache
def functions_source() -> str:
    """The function layer as one SQL text (run with ``search_path`` set to the schema)."""
    return "\n".join(f"-- {name}\n{text.strip()}\n" for name, text in source_files())


@cache
def functions_sha256() -> str:
    """The checksum an install records for the function layer it applied."""
    return hashlib.sha256(functions_source().encode()).hexdigest()


_CREATE_RE = re.compile(r"CREATE OR REPLACE FUNCTION (\w+)\s*\(")
_COMMENT_RE = re.compile(r"--[^\n]*")
_PARAM_MODE = {"IN", "INOUT", "VARIADIC"}


def _input_types(params: str) -> list[str]:
    """The input types of a parameter list (``p_a TEXT, OUT b INT, p_c INT DEFAULT 1``)."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(params):
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(params[start:i])
            start = i + 1
    parts.append(params[start:])
    types = []
    for part in parts:
        words = re.split(r"\s+(?:DEFAULT\s|=)", part.strip(), maxsplit=1, flags=re.I)[0].split()
        if not words:
            continue
        if words[0].upper() == "OUT":
            continue
        if words[0].upper() in _PARAM_MODE:
            words = words[1:]
        types.append(" ".join(words[1:]))
    return types


def _closing(text: str, start: int) -> int:
    depth = 1
    i = start
    while depth:
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
        i += 1
    return i - 1


@cache
def function_signatures() -> tuple[str, ...]:
    """Every function the layer defines, as ``name(type, ...)`` (its identity), in source
    order; a name defined twice appears twice (a test refuses that)."""
    found = []
    for _, source in source_files():
        text = _COMMENT_RE.sub("", source)
        for match in _CREATE_RE.finditer(text):
            end = _closing(text, match.end())
            types = _input_types(text[match.end() : end])
            found.append(f"{match[1]}({', '.join(types)})")
    return tuple(found)


def pending(from_version: int) -> list[Migration]:
    """The migrations after ``from_version``, in the order they run."""
    return [m for m in migrations() if m.version > from_version]


def latest_version() -> int:
    return migrations()[-1].version


def lock_statement(schema: str) -> sql.Composed:
    return sql.SQL("SELECT pg_advisory_xact_lock({cls}, hashtext({schema}))").format(
        cls=sql.Literal(LOCK_CLASS), schema=sql.Literal(schema)
    )


def may_create_statement() -> sql.Composed:
    """Whether the current role may create in the schema: NULL when there is no such schema
    yet, false for a role granted a kind (it cannot install; see 90_security.sql)."""
    return sql.SQL(
        "SELECT has_schema_privilege(n.oid, 'CREATE') FROM pg_namespace n WHERE n.nspname = {}"
    ).format(sql.Placeholder("schema"))


def prepare_statements(schema: str) -> list[sql.Composed]:
    """The schema and the two tables that record what was applied to it."""
    ident = sql.Identifier(schema)
    return [
        sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(ident),
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS {}.migration ("
            "version INTEGER PRIMARY KEY, name TEXT NOT NULL, "
            "applied_at TIMESTAMPTZ NOT NULL DEFAULT now())"
        ).format(ident),
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS {}.function_source ("
            "singleton BOOLEAN PRIMARY KEY DEFAULT TRUE CHECK (singleton), "
            "sha256 TEXT NOT NULL, catalog_md5 TEXT NOT NULL, "
            "applied_at TIMESTAMPTZ NOT NULL DEFAULT now())"
        ).format(ident),
    ]


def open_statement(schema: str) -> sql.Composed:
    """An install's first round trip: take the lock, make the schema and its bookkeeping
    tables, read :func:`state_statement` (its rows are the last result)."""
    return sql.SQL("; ").join(
        [lock_statement(schema), *prepare_statements(schema), state_statement(schema)]
    )


@cache
def function_names() -> tuple[str, ...]:
    """The names of the functions the layer defines, sorted."""
    return tuple(sorted({signature.split("(")[0] for signature in function_signatures()}))


def catalog_md5(schema: str) -> sql.Composed:
    """A digest of the schema's functions that bear a name the source defines, as the catalog
    holds them: each one's oid and the transaction that last wrote its catalog row. Any CREATE
    OR REPLACE, ALTER, DROP, GRANT or REVOKE of such a function, or an overload of its name,
    changes it. It reads no function body and probes the catalog by name (a scan of pg_proc
    by schema would read every schema's functions): cheap enough for every install."""
    return sql.SQL(
        "(SELECT md5(coalesce(string_agg(p.oid::TEXT || ':' || p.xmin::TEXT, ',' "
        "ORDER BY p.oid), '')) "
        "FROM pg_proc p WHERE p.proname = ANY ({names}::NAME[]) AND p.pronamespace = "
        "(SELECT n.oid FROM pg_namespace n WHERE n.nspname = {schema}))"
    ).format(names=sql.Literal(list(function_names())), schema=sql.Literal(schema))


def state_statement(schema: str) -> sql.Composed:
    """What an install needs to decide: the latest migration applied, the name of migration 1,
    the function layer's recorded checksum and digest, and the digest now."""
    ident = sql.Identifier(schema)
    return sql.SQL(
        "SELECT (SELECT coalesce(max(m.version), 0) FROM {schema}.migration m), "
        "(SELECT m.name FROM {schema}.migration m WHERE m.version = 1), "
        "f.sha256, f.catalog_md5, {digest} "
        "FROM (SELECT NULL) AS one LEFT JOIN {schema}.function_source f ON TRUE"
    ).format(schema=ident, digest=catalog_md5(schema))


def installed_statement(schema: str) -> sql.Composed:
    """What an install needs to know, for a role that may only call the queue's functions (it
    has no right on the bookkeeping tables): the latest migration applied, the name of
    migration 1 and the function layer's recorded checksum, through schema_version(). Such a
    role cannot put a function back, so the catalog's digest is not its business."""
    return sql.SQL(
        "SELECT v.version, v.baseline, v.functions_sha256 FROM {}.schema_version() v"
    ).format(sql.Identifier(schema))


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


def drop_stale_statement() -> sql.Composed:
    """Drop every routine of the schema (the first on ``search_path``) that the function
    layer does not define, by identity. Nothing may depend on one (no CASCADE): a table that
    did would make the install fail rather than lose a column default or a trigger."""
    return sql.SQL(
        "DO $lonnymq$\n"
        "DECLARE\n"
        "    v_routine REGPROCEDURE;\n"
        "BEGIN\n"
        "    FOR v_routine IN\n"
        "        SELECT p.oid FROM pg_proc p\n"
        "        WHERE p.pronamespace =\n"
        "              (SELECT n.oid FROM pg_namespace n WHERE n.nspname = current_schema())\n"
        "          AND p.prokind IN ('f', 'p')\n"
        "          AND NOT EXISTS (SELECT FROM unnest({signatures}::TEXT[]) s\n"
        "                          WHERE to_regprocedure(s) = p.oid)\n"
        "    LOOP\n"
        "        EXECUTE format('DROP ROUTINE %s', v_routine);\n"
        "    END LOOP;\n"
        "END;\n"
        "$lonnymq$"
    ).format(signatures=sql.Literal(list(function_signatures())))


def functions_statement() -> sql.SQL:
    return sql.SQL(functions_source())


def secure_statement() -> sql.SQL:
    return sql.SQL("SELECT secure_functions()")


def record_functions_statement(schema: str) -> sql.Composed:
    return sql.SQL(
        "INSERT INTO {schema}.function_source (sha256, catalog_md5) VALUES ({sha}, {digest}) "
        "ON CONFLICT (singleton) DO UPDATE "
        "SET sha256 = excluded.sha256, catalog_md5 = excluded.catalog_md5, applied_at = now()"
    ).format(
        schema=sql.Identifier(schema),
        sha=sql.Literal(functions_sha256()),
        digest=catalog_md5(schema),
    )


def function_layer_statements(schema: str) -> list[sql.SQL | sql.Composed]:
    """Re-create the function layer, secure it and record it (``search_path`` set)."""
    return [
        drop_stale_statement(),
        functions_statement(),
        secure_statement(),
        record_functions_statement(schema),
    ]


def script(schema: str, *, from_version: int = 0) -> str:
    """The whole install as one SQL script, for teams that run their own migration tool:
    the migrations after ``from_version``, then the function layer and its securing."""
    parts = ["BEGIN;"]
    parts.append(lock_statement(schema).as_string() + ";")
    parts.extend(s.as_string() + ";" for s in prepare_statements(schema))
    parts.append(search_path_statement(schema).as_string() + ";")
    for migration in pending(from_version):
        parts.append(f"-- migration {migration.version:04d}_{migration.name}")
        parts.append(migration.sql.strip())
        parts.append(record_statement(schema, migration).as_string() + ";")
    parts.append("-- the function layer")
    parts.extend(s.as_string().strip().rstrip(";") + ";" for s in function_layer_statements(schema))
    parts.append("COMMIT;")
    return "\n".join(parts) + "\n"
