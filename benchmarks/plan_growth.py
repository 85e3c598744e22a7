"""Creates in a session that planned them while ``channel`` was small, after the table grew: two
checkouts side by side, in one run on one PostgreSQL.

    git worktree add /tmp/before <rev>
    python benchmarks/plan_growth.py /tmp/before . [--dsn DSN] [--channels 100000] [--creates 200]

For each checkout: its queue is installed into a fresh schema (by its own package), ``channel``
is vacuumed while empty (so the planner knows it as small), one session makes 20 creates over
two channels (its plans are made and kept), another session then creates one message in each
of ``--channels`` new channels, and the first session's next ``--creates`` creates (into those
channels) are timed. Migration 0037 is about this: before it, the session kept a sequential
scan of ``channel`` for its lookups by name. The schemas are dropped at the end.
"""

from __future__ import annotations

import argparse
import os
import time
import uuid
from pathlib import Path

import psycopg
from checkouts import _install
from psycopg import sql


def _measure(tree: Path, dsn: str, channels: int, creates: int) -> float:
    schema = f"growth_{uuid.uuid4().hex[:8]}"
    _install(tree.resolve(), dsn, schema, 0, 1)
    ident = sql.Identifier(schema)
    create = sql.SQL("SELECT * FROM {}.message_create('\\x00'::bytea, %s)").format(ident)
    try:
        with (
            psycopg.connect(dsn, autocommit=True) as planned,
            psycopg.connect(dsn, autocommit=True) as other,
        ):
            planned.execute(sql.SQL("VACUUM ANALYZE {}.channel").format(ident))
            for i in range(20):
                planned.execute(create, [f"c{i % 2}"])
            other.execute(
                sql.SQL(
                    "SELECT count(*) FROM {}.message_create_many("
                    "ARRAY(SELECT 'g' || i FROM generate_series(1, %s) i),"
                    " array_fill('\\x00'::bytea, ARRAY[%s]), NULL, NULL)"
                ).format(ident),
                [channels, channels],
            )
            started = time.perf_counter()
            for i in range(creates):
                planned.execute(create, [f"g{i * 37 % channels + 1}"])
            return (time.perf_counter() - started) / creates
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(ident))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", type=Path, help="the first checkout (a source tree)")
    parser.add_argument("b", type=Path, help="the second checkout")
    parser.add_argument("--dsn", default=os.environ.get("LONNYMQ_DSN"))
    parser.add_argument("--channels", type=int, default=100_000)
    parser.add_argument("--creates", type=int, default=200)
    args = parser.parse_args()
    if not args.dsn:
        parser.error("--dsn (or LONNYMQ_DSN) is required")
    for label, tree in (("a", args.a), ("b", args.b)):
        seconds = _measure(tree, args.dsn, args.channels, args.creates)
        print(f"{label} {tree}: {seconds * 1000:.3f} ms per create after the growth")


if __name__ == "__main__":
    main()
