"""What SECURITY DEFINER (0012_security) costs per call: single-message create, and dequeue
then delete (two calls, two transactions), with every function of the schema SECURITY DEFINER
(as installed) against the same schema switched back to SECURITY INVOKER. Nothing else
differs: both pin the same search_path. Runs alternate A/B so that a noisy machine hurts both
alike; each figure is the median of the rounds.

    LONNYMQ_DSN=postgresql://postgres@127.0.0.1:5432/test \\
        .venv/bin/python benchmarks/security_overhead.py [--seconds 5] [--rounds 3] [--clients 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from lonnymq import NewMessage, Queue
from lonnymq.bench import LOCK_MS, SCRIPTS, pgbench_rate

SCHEMA = "lmq_bench_security"
CHANNELS = 100
BACKLOG = 60_000


def _set_definer(conn: psycopg.Connection[Any], definer: bool) -> None:
    rows = conn.execute(
        "SELECT p.proname, pg_get_function_identity_arguments(p.oid) FROM pg_proc p"
        " JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = %s",
        [SCHEMA],
    ).fetchall()
    mode = sql.SQL("SECURITY DEFINER" if definer else "SECURITY INVOKER")
    for name, args in rows:
        conn.execute(
            sql.SQL("ALTER FUNCTION {}.{}(" + args + ") {}").format(
                sql.Identifier(SCHEMA), sql.Identifier(name), mode
            )
        )


def _refill(queue: Queue, conn: psycopg.Connection[Any]) -> None:
    conn.execute(sql.SQL("TRUNCATE {}.message, {}.channel").format(
        sql.Identifier(SCHEMA), sql.Identifier(SCHEMA)))  # fmt: skip
    for start in range(0, BACKLOG, 10_000):
        queue.create_many(
            NewMessage(b"\x00", channel=f"c{(start + i) % CHANNELS + 1}") for i in range(10_000)
        )
    conn.execute(sql.SQL("VACUUM ANALYZE {}.message").format(sql.Identifier(SCHEMA)))


def _tps(dsn: str, script: Path, seconds: int, clients: int) -> float:
    defines = {"channels": str(CHANNELS), "id": "0", "na": "0"}
    return pgbench_rate(script, dsn, clients=clients, seconds=seconds, defines=defines)


def _calls_per_s(conn: psycopg.Connection[Any], calls: int = 200_000) -> float:
    """Calls of epoch() (the cheapest function: one row read) per second, in one statement:
    the per-call cost alone, without a commit to hide it."""
    statement = sql.SQL("SELECT sum(e) FROM (SELECT {}.epoch() e FROM generate_series(1, %s)) t")
    statement = statement.format(sql.Identifier(SCHEMA))
    conn.execute(statement, [1000])
    started = time.perf_counter()
    conn.execute(statement, [calls])
    return calls / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args()
    dsn = os.environ.get("LONNYMQ_DSN", "postgresql://postgres@127.0.0.1:5432/test")
    tmp = Path(tempfile.mkdtemp(prefix="lmq-sec-"))
    scripts = {
        "create": SCRIPTS[("lonnymq", "create", 1)],
        "dequeue+delete": SCRIPTS[("lonnymq2", "take", 1)],
    }
    paths = {}
    for name, text in scripts.items():
        paths[name] = tmp / f"{name.replace('+', '_')}.sql"
        paths[name].write_text(text.format(s=SCHEMA, r="unused"))
    rates: dict[tuple[str, str], list[float]] = {}
    with psycopg.connect(dsn, autocommit=True) as conn, Queue(dsn, schema=SCHEMA) as queue:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(SCHEMA)))
        queue.install()
        try:
            for round_no in range(args.rounds):
                for mode in ("definer", "invoker") if round_no % 2 == 0 else ("invoker", "definer"):
                    _set_definer(conn, mode == "definer")
                    rates.setdefault(("epoch() calls", mode), []).append(_calls_per_s(conn))
                    for name, path in paths.items():
                        _refill(queue, conn)
                        tps = _tps(dsn, path, args.seconds, args.clients)
                        rates.setdefault((name, mode), []).append(tps)
                        print(f"round {round_no + 1} {mode:<8} {name:<15} {tps:>9,.0f} tx/s")
        finally:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(SCHEMA)))
    print(
        f"\nmedian of {args.rounds} rounds; pgbench rows: {args.clients} clients, {args.seconds} s"
        f" per run, lock {LOCK_MS} ms, {CHANNELS} channels, backlog {BACKLOG}:"
    )
    print(f"{'operation':<16}{'INVOKER /s':>14}{'DEFINER /s':>14}{'change':>9}")
    for name in ["epoch() calls", *scripts]:
        invoker = statistics.median(rates[(name, "invoker")])
        definer = statistics.median(rates[(name, "definer")])
        print(f"{name:<16}{invoker:>14,.0f}{definer:>14,.0f}{definer / invoker - 1:>+9.1%}")


if __name__ == "__main__":
    main()
