"""Finishing and heartbeating held messages with many messages locked, before and after 0018,
side by side in one run on one PostgreSQL.

    python benchmarks/held_lookup.py [--dsn DSN] [--held 100000] [--calls 200] [--rounds 3]
    python benchmarks/held_lookup.py --drain [--dsn DSN] [--seconds 8] [--rounds 3]

Migration 0018 looks a held message up by primary key only; before it, the planner could
answer the lookup from the partial index of locked messages, one entry per locked message,
whenever the statistics said few messages were locked. Two schemas on the same server hold
the same queue (``--held`` + 20,000 messages over 100 channels, ANALYZEd while none was
locked, then ``--held`` of them locked for 10 minutes): one as installed, one with the five
functions 0018 replaced put back as the earlier migrations defined them (from the shipped
migrations' text). One client, the schemas taking turns, each round in each schema:
``--calls`` single finishes (``message_delete``), ``--calls`` heartbeats
(``message_heartbeat``), ``--calls``/10 finishes and heartbeats of 100 (``message_delete_many``,
``message_heartbeat_many``), each call its own transaction. Then both schemas are ANALYZEd
(the statistics now see the locked messages) and the rounds run again. Figures: the median
over rounds of the mean milliseconds per call. The schemas are dropped at the end.

With ``--drain``: the drain shapes of ``lonnymq bench`` instead, on the same two kinds of
schema: 300,000 messages (900,000 for batches) over 100 channels, ANALYZEd, drained by 8
pgbench clients running the bench's own script (``complete_and_dequeue``, one or 100
messages per call) for ``--seconds``, the schemas taking turns; messages/s counted from the
table (finished = the rows gone), per round.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
from _shipped import function_text
from psycopg import sql

from lonnymq import Queue
from lonnymq.bench import SCRIPTS, drop_schemas, fill_backlog, pgbench_path

# What 0018 replaced, and the migration that last defined each before it.
EARLIER = {
    "message_finish_try": "0002_fast_paths.sql",
    "message_heartbeat": "0001_init.sql",
    "message_heartbeat_many": "0004_spark.sql",
    "message_requeue": "0002_fast_paths.sql",
    "message_delete_many": "0015_set_finish.sql",
}
OPERATIONS = ("finish 1", "heartbeat 1", "finish 100", "heartbeat 100")
LOCK_MS = 600_000


class Held:
    """The messages one schema holds, as (id, num_attempts), finished ones popped."""

    def __init__(self, conn: psycopg.Connection[Any], schema: str, count: int) -> None:
        self.schema = sql.Identifier(schema)
        self.items: list[tuple[int, int]] = []
        take = sql.SQL("SELECT id, num_attempts FROM {}.message_dequeue_many(10000, %s)").format(
            self.schema
        )
        while len(self.items) < count:
            rows = conn.execute(take, [LOCK_MS]).fetchall()
            if not rows or rows[0][0] is None:
                raise RuntimeError("the backlog ran out while locking")
            self.items.extend((r[0], r[1]) for r in rows)

    def pop(self, n: int) -> list[tuple[int, int]]:
        if len(self.items) < n:
            raise RuntimeError("no held messages left: use fewer --calls or --rounds")
        taken, self.items = self.items[-n:], self.items[:-n]
        return taken


def _timed(calls: int, call: Callable[[], object]) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - started) * 1000 / calls


def _round(conn: psycopg.Connection[Any], held: Held, calls: int) -> dict[str, float]:
    s = held.schema
    delete = sql.SQL("SELECT {}.message_delete(%s, %s)").format(s)
    beat = sql.SQL("SELECT {}.message_heartbeat(%s, %s, %s)").format(s)
    delete_many = sql.SQL("SELECT count(*) FROM {}.message_delete_many(%s, %s)").format(s)
    beat_many = sql.SQL("SELECT count(*) FROM {}.message_heartbeat_many(%s, %s, %s)").format(s)
    keep = held.items[: max(calls, 100)]  # heartbeats extend these, finishes take from the end

    def finish_one() -> None:
        (mid, na) = held.pop(1)[0]
        conn.execute(delete, [mid, na])

    beats = itertools.count()

    def beat_one() -> None:
        mid, na = keep[next(beats) % len(keep)]
        conn.execute(beat, [mid, na, LOCK_MS])

    def finish_many() -> None:
        batch = held.pop(100)
        conn.execute(delete_many, [[m for m, _ in batch], [a for _, a in batch]]).fetchall()

    def beat_many_call() -> None:
        batch = keep[:100]
        conn.execute(beat_many, [[m for m, _ in batch], [a for _, a in batch], LOCK_MS])

    return {
        "finish 1": _timed(calls, finish_one),
        "heartbeat 1": _timed(calls, beat_one),
        "finish 100": _timed(max(1, calls // 10), finish_many),
        "heartbeat 100": _timed(max(1, calls // 10), beat_many_call),
    }


def _drain(dsn: str, schemas: dict[str, str], seconds: int, rounds: int) -> None:
    """The bench's drain shapes, one schema then the other, each from a fresh backlog."""
    with tempfile.TemporaryDirectory() as tmp, psycopg.connect(dsn, autocommit=True) as conn:
        for batch in (1, 100):
            rates: dict[str, list[float]] = {v: [] for v in schemas}
            for _ in range(rounds):
                for version, schema in schemas.items():
                    ident = sql.Identifier(schema)
                    conn.execute(sql.SQL("TRUNCATE {}.message").format(ident))
                    conn.execute(sql.SQL("DELETE FROM {}.channel").format(ident))
                    fill_backlog(conn, schema, 300_000 if batch == 1 else 900_000, 100)
                    conn.execute(sql.SQL("VACUUM ANALYZE {}.message").format(ident))
                    conn.execute(sql.SQL("VACUUM ANALYZE {}.channel").format(ident))
                    script = f"{tmp}/take_{version}_{batch}.sql"
                    with open(script, "w") as out:
                        out.write(SCRIPTS[("lonnymq", "take", batch)].format(s=ident.as_string()))
                    before = _count(conn, schema)
                    args = [
                        pgbench_path(), "-n", "-c", "8", "-j", "2", "-T", str(seconds),
                        "-f", script, "-D", "id=0", "-D", "na=0", "-D", "ids={}", "-D", "nas={}",
                        dsn,
                    ]  # fmt: skip
                    subprocess.run(args, check=True, capture_output=True)
                    rates[version].append((before - _count(conn, schema)) / seconds)
            print(
                f"drain, {batch} per call, 8 clients, {seconds} s: "
                + "; ".join(
                    f"{v} " + ", ".join(f"{r:,.0f}" for r in rates[v]) + " msg/s" for v in schemas
                )
            )


def _count(conn: psycopg.Connection[Any], schema: str) -> int:
    row = conn.execute(
        sql.SQL("SELECT count(*) FROM {}.message").format(sql.Identifier(schema))
    ).fetchone()
    return int(row[0]) if row else 0


def _setup(dsn: str, schema: str, earlier: bool, messages: int) -> None:
    with Queue(dsn, schema=schema) as queue:
        queue.install()
    with psycopg.connect(dsn, autocommit=True) as conn:
        ident = sql.Identifier(schema)
        if earlier:
            conn.execute(sql.SQL("SET search_path = {}").format(ident))
            for name, migration in EARLIER.items():
                conn.execute(function_text(migration, name).encode())
            conn.execute(sql.SQL("SELECT {}.secure_functions()").format(ident))
        fill_backlog(conn, schema, messages, 100)
        conn.execute(sql.SQL("VACUUM ANALYZE {}.message").format(ident))
        conn.execute(sql.SQL("VACUUM ANALYZE {}.channel").format(ident))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get("LONNYMQ_DSN"))
    parser.add_argument("--held", type=int, default=100_000)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--drain", action="store_true", help="the bench's drain shapes instead")
    parser.add_argument("--seconds", type=int, default=8, help="with --drain: per run")
    args = parser.parse_args()
    if not args.dsn:
        parser.error("--dsn (or LONNYMQ_DSN) is required")
    needed = 2 * args.rounds * (args.calls + 100 * max(1, args.calls // 10)) + 100
    if not args.drain and needed > args.held:
        parser.error("--held is too small for that many --calls and --rounds")
    tag = uuid.uuid4().hex[:8]
    schemas = {"0017": f"lonnymq_bench_held17_{tag}", "0018": f"lonnymq_bench_held18_{tag}"}
    try:
        for version, schema in schemas.items():
            # --drain fills its own backlogs.
            _setup(args.dsn, schema, version == "0017", 0 if args.drain else args.held + 20_000)
        if args.drain:
            _drain(args.dsn, schemas, args.seconds, args.rounds)
            return
        with psycopg.connect(args.dsn, autocommit=True) as conn:
            held = {v: Held(conn, s, args.held) for v, s in schemas.items()}
            for phase in ("statistics from before the locks", "statistics ANALYZEd with the locks"):
                if phase.startswith("statistics ANALYZEd"):
                    for schema in schemas.values():
                        conn.execute(sql.SQL("ANALYZE {}.message").format(sql.Identifier(schema)))
                times: dict[str, dict[str, list[float]]] = {
                    v: {op: [] for op in OPERATIONS} for v in schemas
                }
                for _ in range(args.rounds):
                    for version in schemas:
                        for op, ms in _round(conn, held[version], args.calls).items():
                            times[version][op].append(ms)
                print(f"{args.held:,} messages locked, {phase} (ms per call, median of rounds):")
                for op in OPERATIONS:
                    old = statistics.median(times["0017"][op])
                    new = statistics.median(times["0018"][op])
                    print(f"  {op:<14} 0017 {old:8.3f}   0018 {new:8.3f}   {old / new:6.1f}x")
    finally:
        drop_schemas(args.dsn, *schemas.values())


if __name__ == "__main__":
    main()
