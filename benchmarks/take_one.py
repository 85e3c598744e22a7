"""Migration 0021 (a dequeue of one message through ``message_take_one``) side by side with the
general loop it bypasses, in one run on one PostgreSQL.

    python benchmarks/take_one.py [--dsn DSN] [--seconds 5] [--rounds 3] [--clients 8]

Four fresh schemas, one per (version, channel count): "loop" puts back the single dequeue as it
was before 0021 (``message_dequeue_many`` is the general loop itself, and
``message_complete_and_dequeue`` is 0016's, which calls it), "0021" is as installed. Each holds
150,000 messages over 1 or 100 channels. pgbench drives a worker's steady call, finishing the
message the previous call took and taking the next (``message_complete_and_dequeue`` with a
limit of 1), in alternating rounds; each figure is the median over rounds of pgbench's calls
per second, with every round's rate. The schemas are dropped at the end.
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
from lonnymq.bench import SCRIPTS, drop_schemas, fill_backlog, pgbench_rate

BACKLOG = 150_000
CHANNELS = (1, 100)
VERSIONS = ("loop", "0021")

# Before 0021: the general loop answers every dequeue, and the worker's call reaches it directly.
LOOP = (
    "DROP FUNCTION message_dequeue_many(INTEGER, BIGINT);\n"
    "ALTER FUNCTION message_dequeue_loop(INTEGER, BIGINT) RENAME TO message_dequeue_many;\n"
    + function_text("0016_lean_checks.sql", "message_complete_and_dequeue")
    + "\nSELECT secure_functions();\n"
)


def _prepare(dsn: str, schema: str, version: str, channels: int) -> None:
    with Queue(dsn, schema=schema) as queue:
        queue.install()
    with psycopg.connect(dsn, autocommit=True) as conn:
        if version == "loop":
            conn.execute(sql.SQL("SET search_path = {}").format(sql.Identifier(schema)))
            conn.execute(LOOP.encode())
        fill_backlog(conn, schema, BACKLOG, channels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get("LONNYMQ_DSN"))
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=8)
    args = parser.parse_args()
    if not args.dsn:
        parser.error("--dsn (or LONNYMQ_DSN) is required")
    tmp = Path(tempfile.mkdtemp(prefix="lonnymq-take-one-"))
    schemas = {
        (version, channels): f"lonnymq_bench_{version}_{channels}_{uuid.uuid4().hex[:8]}"
        for channels in CHANNELS
        for version in VERSIONS
    }
    try:
        for (version, channels), schema in schemas.items():
            _prepare(args.dsn, schema, version, channels)
        rates: dict[tuple[str, int], list[float]] = {}
        for _ in range(args.rounds):
            for key, schema in schemas.items():
                script = tmp / f"{schema}.sql"
                script.write_text(
                    SCRIPTS[("lonnymq", "take", 1)].format(s=sql.Identifier(schema).as_string())
                )
                rate = pgbench_rate(
                    script,
                    args.dsn,
                    clients=args.clients,
                    seconds=args.seconds,
                    defines={"id": "0", "na": "0"},
                )
                rates.setdefault(key, []).append(rate)
        print(
            f"finish one and take the next: calls/s, {args.clients} client(s), "
            f"median of {args.rounds} rounds"
        )
        for channels in CHANNELS:
            before, after = (statistics.median(rates[v, channels]) for v in VERSIONS)
            rounds = ", ".join(
                f"{a:,.0f}/{b:,.0f}"
                for a, b in zip(rates["loop", channels], rates["0021", channels], strict=True)
            )
            print(
                f"  {channels:>3} channel(s)  loop {before:>8,.0f}  0021 {after:>8,.0f}  "
                f"({after / before:.2f}x; rounds {rounds})"
            )
    finally:
        drop_schemas(args.dsn, *schemas.values())


if __name__ == "__main__":
    main()
