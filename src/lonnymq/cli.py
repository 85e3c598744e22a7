"""The ``lonnymq`` command line: a thin layer over the API.

Every option has an environment twin (``--dsn`` / ``LONNYMQ_DSN``, ``--schema`` /
``LONNYMQ_SCHEMA``). Without a DSN the embedded PostgreSQL is used.

Exit codes: 0 success, 1 the operation failed (a lonnymq error), 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict

from . import migrate
from .errors import LonnyMQError
from .queue import Queue

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lonnymq", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dsn",
        default=os.environ.get("LONNYMQ_DSN"),
        help="PostgreSQL connection string (env LONNYMQ_DSN; default: the embedded server)",
    )
    parser.add_argument(
        "--schema",
        default=os.environ.get("LONNYMQ_SCHEMA", "lonnymq"),
        help="schema the queue lives in (env LONNYMQ_SCHEMA; default lonnymq)",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    install = commands.add_parser("install", help="create or upgrade the queue's schema")
    install.add_argument(
        "--archive",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep finished messages in the archive table",
    )
    install.add_argument(
        "--event-channel",
        default=os.environ.get("LONNYMQ_EVENT_CHANNEL"),
        help="NOTIFY channel for wake-up events (env LONNYMQ_EVENT_CHANNEL)",
    )

    migrate_cmd = commands.add_parser("migrate", help="show the install SQL")
    migrate_cmd.add_argument(
        "--print",
        dest="print_sql",
        action="store_true",
        required=True,
        help="print the SQL script that install would run",
    )

    stats = commands.add_parser("stats", help="channels: size, in flight, next dequeue, policy")
    stats.add_argument("--json", action="store_true", help="print JSON lines")

    bench = commands.add_parser(
        "bench", help="measure lonnymq against a raw SKIP LOCKED queue (same server, one run)"
    )
    bench.add_argument("--quick", action="store_true", help="a short smoke run (seconds)")
    bench.add_argument(
        "--out",
        default=os.environ.get("LONNYMQ_BENCH_OUT", "benchmarks/results"),
        help="where bench.json and the plots go (env LONNYMQ_BENCH_OUT)",
    )

    demo = commands.add_parser("demo", help="run the demo pipeline")
    demo.add_argument("--messages", type=int, default=2000, help="messages to create")
    demo.add_argument("--workers", type=int, default=4, help="worker threads")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lonnymq`` command."""
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except LonnyMQError as err:
        print(f"lonnymq: {type(err).__name__}: {err}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    if args.command == "migrate":
        sys.stdout.write(migrate.script(args.schema))
        return 0
    if args.command == "bench":
        from .bench import run_bench
        from .embedded import resolve_dsn

        run_bench(resolve_dsn(args.dsn), profile="quick" if args.quick else "default", out=args.out)
        return 0
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(dsn=args.dsn, messages=args.messages, workers=args.workers)
    with Queue(
        args.dsn, schema=args.schema, event_channel=getattr(args, "event_channel", None)
    ) as q:
        if args.command == "install":
            version = q.install(archive=args.archive)
            print(f"schema {args.schema!r} is at version {version}")
        elif args.command == "stats":
            rows = q.stats()
            if args.json:
                for row in rows:
                    print(json.dumps(asdict(row)))
            else:
                print(f"{'channel':<24} {'size':>8} {'in flight':>9} {'next dequeue':>14}  policy")
                for row in rows:
                    policy = ", ".join(
                        f"{k}={v}" for k, v in asdict(row.policy).items() if v is not None
                    )
                    print(
                        f"{row.channel:<24} {row.size:>8} {row.in_flight:>9} "
                        f"{row.next_dequeue_at or '-':>14}  {policy or '-'}"
                    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
