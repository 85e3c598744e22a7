"""Migration 0016 (argument checks in one expression) side by side with the functions it
replaced, in one run on one PostgreSQL.

    python benchmarks/lean_checks.py [--dsn DSN] [--seconds 4] [--rounds 3] [--clients 1]

Two fresh schemas: one as installed, one where the six functions 0016 changed are put back as
the earlier migrations defined them (read from the shipped migration files). pgbench drives
four calls in each schema, in alternating rounds: ``message_create`` (one message, 100
channels), ``message_create_many`` (100 messages over 100 channels),
``message_complete_and_dequeue`` finishing and taking one, and finishing and taking 100, over
a backlog of 200,000 messages in 100 channels. Each figure is the median over rounds of
pgbench's calls per second. The schemas are dropped at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import uuid
from pathlib import Path

import psycopg
from _shipped import function_text
from psycopg import sql

from lonnymq import Queue
from lonnymq.bench import drop_schemas, fill_backlog, pgbench_rate

# (migration file, function) as it was before 0016.
BEFORE = [
    ("0001_init.sql", "arg_check_lock_ms"),
    ("0001_init.sql", "arg_check_claim"),
    ("0002_fast_paths.sql", "message_create"),
    ("0010_lean_calls.sql", "message_complete_and_dequeue"),
    ("0011_due_channels.sql", "message_dequeue_many"),
    ("0011_due_channels.sql", "message_create_many"),
]

# The calls carry the messages they hold from one call to the next (none to start).
DEFINES = {"id": "0", "na": "0", "ids": "{}", "nas": "{}"}

SCRIPTS = {
    "create 1": (
        "\\set c random(1, 100)\nSELECT * FROM {s}.message_create('\\x00'::bytea, 'c' || :c);\n"
    ),
    "create 100": (
        "SELECT count(*) FROM {s}.message_create_many("
        "ARRAY(SELECT 'c' || (1 + floor(random() * 100))::int FROM generate_series(1, 100)), "
        "array_fill('\\x00'::bytea, ARRAY[100]), NULL, NULL);\n"
    ),
    "finish+take 1": (
        "SELECT coalesce(max(id) FILTER (WHERE status = 'locked'), 0) AS id, "
        "coalesce(max(num_attempts) FILTER (WHERE status = 'locked'), 0) AS na "
        "FROM {s}.message_complete_and_dequeue("
        "CASE WHEN :id = 0 THEN '{{}}' ELSE ARRAY[:id] END::bigint[], "
        "CASE WHEN :id = 0 THEN '{{}}' ELSE ARRAY[:na] END::int[], 1, 60000) \\gset\n"
    ),
    "finish+take 100": (
        "SELECT coalesce(array_agg(id) FILTER (WHERE status = 'locked'), '{{}}') AS ids, "
        "coalesce(array_agg(num_attempts) FILTER (WHERE status = 'locked'), '{{}}') AS nas "
        "FROM {s}.message_complete_and_dequeue(':ids'::bigint[], ':nas'::int[], 100, 60000) "
        "\\gset\n"
    ),
}


def _before_text() -> str:
    parts = [function_text(migration, name) for migration, name in BEFORE]
    return "\n".join(parts) + "\nSELECT secure_functions();\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get("LONNYMQ_DSN"))
    parser.add_argument("--seconds", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=1)
    args = parser.parse_args()
    if not args.dsn:
        parser.error("--dsn (or LONNYMQ_DSN) is required")
    tmp = Path(tempfile.mkdtemp(prefix="lonnymq-lean-"))
    schemas = {
        label: f"lonnymq_bench_{label}_{uuid.uuid4().hex[:8]}" for label in ("before", "0016")
    }
    try:
        for label, schema in schemas.items():
            with Queue(args.dsn, schema=schema) as queue:
                queue.install()
            with psycopg.connect(args.dsn, autocommit=True) as conn:
                ident = sql.Identifier(schema)
                if label == "before":
                    conn.execute(sql.SQL("SET search_path = {}").format(ident))
                    conn.execute(_before_text().encode())
                fill_backlog(conn, schema, 200_000, 100)
        rates: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.rounds):
            for call, text in SCRIPTS.items():
                for label, schema in schemas.items():
                    script = tmp / f"{label}-{call.replace(' ', '_').replace('+', '_')}.sql"
                    script.write_text(text.format(s=sql.Identifier(schema).as_string()))
                    rate = pgbench_rate(
                        script,
                        args.dsn,
                        clients=args.clients,
                        seconds=args.seconds,
                        defines=DEFINES,
                    )
                    rates.setdefault((call, label), []).append(rate)
        print(f"calls/s, {args.clients} client(s), median of {args.rounds} rounds:")
        for call in SCRIPTS:
            before, after = (statistics.median(rates[call, label]) for label in schemas)
            rounds = ", ".join(
                f"{a:,.0f}/{b:,.0f}"
                for a, b in zip(rates[call, "before"], rates[call, "0016"], strict=True)
            )
            print(
                f"  {call:<16} before {before:>8,.0f}  0016 {after:>8,.0f}  "
                f"({after / before:.2f}x; rounds {rounds})"
            )
    finally:
        drop_schemas(args.dsn, *schemas.values())


if __name__ == "__main__":
    main()
