"""WAL written and transactions committed per message, lonnymq against the raw SKIP LOCKED
queue, in the steady shapes of ``lonnymq bench``, in one run on one PostgreSQL.

    python benchmarks/wal_per_message.py [--dsn DSN] [--seconds 8] [--rounds 2]

Each shape runs the bench's own pgbench scripts (8 producers and 8 consumers, one message or
100 per call; lonnymq durable: ``complete_and_dequeue``) on a fresh queue for ``--seconds``,
without maintenance, the queues taking turns. Around each run the server's ``pg_stat_wal``
(PostgreSQL 14+) and the database's committed transactions are read: divided by the messages
that went through (counted from the queue's id sequence and table, as the bench does), they
say what each message costs the server's log. "made/msg" is how many messages the producers
made per message consumed: above 1 the producers outran the consumers (a backlog grew) and
the per-message figures also carry the extra creates. Nothing else should run on the server
meanwhile.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

import psycopg

from lonnymq.bench import BATCH, PROFILES, Bench

# (messages per call, queue, channels)
SHAPES = [(1, "raw", 1), (1, "lonnymq", 1), (1, "lonnymq", 100)]
SHAPES += [(BATCH, "raw", 1), (BATCH, "lonnymq", 1), (BATCH, "lonnymq", 100)]


def _counters(dsn: str) -> tuple[float, float, float, float]:
    """(WAL records, full-page images, WAL bytes, commits in this database) so far."""
    with psycopg.connect(dsn) as conn:
        wal = conn.execute("SELECT wal_records, wal_fpi, wal_bytes FROM pg_stat_wal").fetchone()
        commits = conn.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
    if wal is None or commits is None:
        raise RuntimeError("pg_stat_wal or pg_stat_database returned no row")
    return float(wal[0]), float(wal[1]), float(wal[2]), float(commits[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get("LONNYMQ_DSN"))
    parser.add_argument("--seconds", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if not args.dsn:
        parser.error("--dsn (or LONNYMQ_DSN) is required")
    profile = dataclasses.replace(PROFILES["default"], seconds=args.seconds)
    out = Path(tempfile.mkdtemp(prefix="lonnymq-wal-"))
    bench = Bench(args.dsn, profile, out, print, maintenance=False)
    print(f"steady shapes, 8 clients per side, {args.seconds} s per run, no maintenance:")
    try:
        _rounds(bench, args.dsn, args.seconds, args.rounds)
    finally:
        bench.close()
        shutil.rmtree(out, ignore_errors=True)


def _rounds(bench: Bench, dsn: str, seconds: int, rounds: int) -> None:
    for _ in range(rounds):
        for batch, kind, channels in SHAPES:
            bench.reset()
            before = _counters(dsn)
            rate = bench._run(kind, "steady", batch, channels, 0)
            after = _counters(dsn)
            msgs = rate * seconds
            made = bench._produced(kind) / msgs
            records, fpi, size, commits = (a - b for a, b in zip(after, before, strict=True))
            label = "raw" if kind == "raw" else f"lonnymq, {channels} ch"
            print(
                f"  batch {batch:<3} {label:<16} {rate:>9,.0f} msg/s  {size / msgs:7,.0f} WAL B/msg"
                f"  {records / msgs:5.1f} records/msg  {fpi / msgs:5.2f} FPI/msg"
                f"  {commits / msgs:5.2f} commits/msg  {made:4.1f} made/msg"
            )


if __name__ == "__main__":
    main()
