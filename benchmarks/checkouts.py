"""Two checkouts of lonnymq draining a backlog side by side, in one run on one PostgreSQL.

    git worktree add /tmp/before <rev>
    python benchmarks/checkouts.py /tmp/before . [--dsn DSN] [--channels 100] [--batch 1]
        [--rounds 4] [--clients 8] [--seconds 5] [--backlog 300000] [--prefix checkout]
        [--shape drain|steady]

Each checkout installs its own schema (``checkout_a``, ``checkout_b``: ``--prefix`` names
them; its migrations, run with its own package) and gets the same backlog over ``--channels``
channels. pgbench then drives the bench's durable consumer (``message_complete_and_dequeue``,
``--batch`` messages per call) on each in turn, the order swapped every round, with a
``VACUUM`` of both queues before each run. A run's rate is the messages it finished (counted
from the table) per second of wall time. The medians and their ratio (b / a) are printed; the
schemas are dropped at the end.

With ``--shape steady`` there is no backlog: ``--clients`` producers (the bench's create
script, ``--batch`` messages per call over ``--channels`` channels) run beside as many
consumers, as in the bench's steady shape, and a run's rate is the messages consumed (created,
counted from the id sequence, minus the growth of the table) per second.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
from psycopg import sql

from lonnymq.bench import SCRIPTS, drop_schemas, pgbench_rate

INSTALL = """
import sys
from lonnymq import Queue
from lonnymq.bench import fill_backlog
import psycopg
dsn, schema, backlog, channels = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
with Queue(dsn, schema=schema) as queue:
    queue.install()
with psycopg.connect(dsn, autocommit=True) as conn:
    fill_backlog(conn, schema, backlog, channels)
"""


def _install(tree: Path, dsn: str, schema: str, backlog: int, channels: int) -> None:
    """Install ``tree``'s queue into ``schema`` with ``tree``'s own package, and fill it."""
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    subprocess.run(
        [sys.executable, "-c", INSTALL, dsn, schema, str(backlog), str(channels)],
        check=True,
        env=env,
    )


def _count(conn: psycopg.Connection[object], schema: str) -> int:
    row = conn.execute(sql.SQL("SELECT count(*) FROM {}.message").format(sql.Identifier(schema)))
    return int((row.fetchone() or (0,))[0])


def _created(conn: psycopg.Connection[object], schema: str) -> int:
    """Messages created in ``schema`` so far: its id sequence's last value."""
    row = conn.execute(
        sql.SQL("SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM {}").format(
            sql.Identifier(schema, "message_id_seq")
        )
    ).fetchone()
    return int((row or (0,))[0])


def _beside(*calls: Callable[[], object]) -> None:
    """Run ``calls`` at once, each in a thread, and wait for them all; raise the first
    error one of them raised."""
    errors: list[BaseException] = []

    def run(call: Callable[[], object]) -> None:
        try:
            call()
        except BaseException as err:  # raised below, in the caller's thread
            errors.append(err)

    threads = [threading.Thread(target=run, args=(call,)) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path, help="the first checkout (a source tree)")
    parser.add_argument("b", type=Path, help="the second checkout")
    parser.add_argument("--dsn", default=os.environ.get("LONNYMQ_DSN", ""))
    parser.add_argument("--channels", type=int, default=100)
    parser.add_argument("--batch", type=int, choices=(1, 100), default=1)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--backlog", type=int, default=300_000)
    parser.add_argument("--prefix", default="checkout", help="schemas are PREFIX_a and PREFIX_b")
    parser.add_argument("--shape", choices=("drain", "steady"), default="drain")
    args = parser.parse_args()
    if not args.dsn:
        parser.error("--dsn (or LONNYMQ_DSN) is required")
    schemas = {name: f"{args.prefix}_{name}" for name in ("a", "b")}
    trees = {"a": args.a.resolve(), "b": args.b.resolve()}
    for tree in trees.values():
        if not (tree / "src" / "lonnymq").is_dir():
            parser.error(f"{tree} is no lonnymq checkout (no src/lonnymq)")
    rates: dict[str, list[float]] = {"a": [], "b": []}
    try:
        for name, tree in trees.items():
            backlog = args.backlog if args.shape == "drain" else 0
            _install(tree, args.dsn, schemas[name], backlog, args.channels)
        with tempfile.TemporaryDirectory() as tmp:
            for round_no in range(args.rounds):
                for name in ("a", "b") if round_no % 2 == 0 else ("b", "a"):
                    schema = schemas[name]
                    script = Path(tmp) / f"{name}.sql"
                    script.write_text(SCRIPTS[("lonnymq", "take", args.batch)].format(s=schema))
                    producer = Path(tmp) / f"{name}_create.sql"
                    producer.write_text(SCRIPTS[("lonnymq", "create", args.batch)].format(s=schema))
                    with psycopg.connect(args.dsn, autocommit=True) as conn:
                        for other in schemas.values():
                            for table in ("message", "channel"):
                                conn.execute(
                                    sql.SQL("VACUUM {}.{}").format(
                                        sql.Identifier(other), sql.Identifier(table)
                                    )
                                )
                        before = _count(conn, schema)
                        created = _created(conn, schema)
                    defines = {
                        "id": "0", "na": "0", "ids": "{}", "nas": "{}",
                        "channels": str(args.channels),
                    }  # fmt: skip
                    runs = [script] if args.shape == "drain" else [script, producer]
                    started = time.monotonic()
                    _beside(
                        *(
                            functools.partial(
                                pgbench_rate,
                                run,
                                args.dsn,
                                clients=args.clients,
                                seconds=args.seconds,
                                defines=defines,
                            )
                            for run in runs
                        )
                    )
                    took = time.monotonic() - started
                    with psycopg.connect(args.dsn, autocommit=True) as conn:
                        left = _count(conn, schema)
                        created = _created(conn, schema) - created
                    if args.shape == "drain" and left < args.clients * args.batch * 2:
                        sys.exit(f"{name}: the backlog ran out; pass a larger --backlog")
                    rates[name].append((before + created - left) / took)
    finally:
        drop_schemas(args.dsn, *schemas.values())
    for name, tree in trees.items():
        runs = ", ".join(f"{rate:,.0f}" for rate in rates[name])
        print(f"{name} {tree}: median {statistics.median(rates[name]):,.0f} msg/s ({runs})")
    ratio = statistics.median(rates["b"]) / statistics.median(rates["a"])
    print(f"b / a: {ratio:.3f}")


if __name__ == "__main__":
    main()
