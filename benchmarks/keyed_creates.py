"""Creates with dedup keys in two checkouts of lonnymq, side by side on one PostgreSQL.

    git worktree add /tmp/before <rev>
    python benchmarks/keyed_creates.py /tmp/before . [--dsn DSN] [--rounds 3] [--clients 8]
        [--seconds 4] [--sizes 10000,50000,100000] [--prefix keyed]

Each checkout installs its own schema (``keyed_a``, ``keyed_b``: ``--prefix`` names them; its
migrations, run with its own package). Then, in turns (the order swapped every round):
- one ``message_create_many`` call of each ``--sizes`` count, every message with its own
  dedup key, into the default channel: seconds per call;
- ``--clients`` connections each calling ``message_create`` with a fresh dedup key, one per
  transaction, over 100 channels, for ``--seconds``: creates per second.
Medians are printed, with the ratio b / a. The schemas are dropped at the end.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
from psycopg import sql

from lonnymq.bench import drop_schemas

INSTALL = """
import sys
from lonnymq import Queue
with Queue(sys.argv[1], schema=sys.argv[2]) as queue:
    queue.install()
"""


def _install(tree: Path, dsn: str, schema: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    subprocess.run([sys.executable, "-c", INSTALL, dsn, schema], check=True, env=env)


def _batch_seconds(dsn: str, schema: str, size: int, tag: str) -> float:
    statement = sql.SQL(
        "SELECT count(*) FROM {}.message_create_many(NULL, array_fill(%s::bytea, ARRAY[%s]),"
        " NULL, ARRAY(SELECT %s || g FROM generate_series(1, %s) g))"
    ).format(sql.Identifier(schema))
    with psycopg.connect(dsn, autocommit=True) as conn:
        started = time.perf_counter()
        conn.execute(statement, [b"x", size, f"{tag}-", size])
        return time.perf_counter() - started


def _singles_rate(dsn: str, schema: str, clients: int, seconds: float, tag: str) -> float:
    statement = sql.SQL("SELECT status FROM {}.message_create(%s, %s, NULL, %s)").format(
        sql.Identifier(schema)
    )
    counts = [0] * clients
    start = threading.Barrier(clients + 1)

    def client(n: int) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            start.wait()
            deadline = time.monotonic() + seconds
            for i in itertools.count():
                if time.monotonic() >= deadline:
                    break
                conn.execute(statement, [b"x", f"c{(n + i) % 100}", f"{tag}-{n}-{i}"])
                counts[n] += 1

    threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
    for thread in threads:
        thread.start()
    start.wait()
    for thread in threads:
        thread.join()
    return sum(counts) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path, help="the first checkout (a source tree)")
    parser.add_argument("b", type=Path, help="the second checkout")
    parser.add_argument("--dsn", default=os.environ.get("LONNYMQ_DSN", ""))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--sizes", default="10000,50000,100000")
    parser.add_argument("--prefix", default="keyed", help="schemas are PREFIX_a and PREFIX_b")
    args = parser.parse_args()
    if not args.dsn:
        parser.error("--dsn (or LONNYMQ_DSN) is required")
    sizes = [int(s) for s in args.sizes.split(",")]
    trees = {"a": args.a.resolve(), "b": args.b.resolve()}
    for tree in trees.values():
        if not (tree / "src" / "lonnymq").is_dir():
            parser.error(f"{tree} is no lonnymq checkout (no src/lonnymq)")
    schemas = {name: f"{args.prefix}_{name}" for name in trees}
    drop_schemas(args.dsn, *schemas.values())
    for name, tree in trees.items():
        _install(tree, args.dsn, schemas[name])
    batch: dict[tuple[str, int], list[float]] = {}
    singles: dict[str, list[float]] = {"a": [], "b": []}
    try:
        for round_no in range(args.rounds):
            order = ["a", "b"] if round_no % 2 == 0 else ["b", "a"]
            for name in order:
                for size in sizes:
                    seconds = _batch_seconds(args.dsn, schemas[name], size, f"r{round_no}")
                    batch.setdefault((name, size), []).append(seconds)
                rate = _singles_rate(
                    args.dsn, schemas[name], args.clients, args.seconds, f"r{round_no}"
                )
                singles[name].append(rate)
                print(f"round {round_no + 1} {name}: singles {rate:,.0f}/s", flush=True)
    finally:
        drop_schemas(args.dsn, *schemas.values())
    for size in sizes:
        a, b = (statistics.median(batch[(n, size)]) for n in ("a", "b"))
        print(f"batch of {size:,} keys: a {a:.2f} s, b {b:.2f} s (b/a {b / a:.2f})")
    a, b = (statistics.median(singles[n]) for n in ("a", "b"))
    print(
        f"single keyed creates, {args.clients} clients: a {a:,.0f}/s, b {b:,.0f}/s"
        f" (b/a {b / a:.2f})"
    )


if __name__ == "__main__":
    main()
