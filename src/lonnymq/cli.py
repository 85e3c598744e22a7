"""The ``lonnymq`` command line: a thin layer over the API.

Every option has an environment twin: ``--some-option`` is ``LONNYMQ_SOME_OPTION`` (for
example ``--dsn`` / ``LONNYMQ_DSN``, ``--concurrency`` / ``LONNYMQ_CONCURRENCY``). Without a
DSN the embedded PostgreSQL is used.

Exit codes: 0 success, 1 the operation failed (a lonnymq error), 2 bad usage.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from typing import Any

from . import migrate
from .errors import InvalidArgumentError, LonnyMQError
from .queue import Queue
from .types import NewMessage

__all__ = ["main"]


def _env(option: str, default: Any = None, cast: Callable[[str], Any] = str) -> Any:
    """The environment twin of ``--option`` (``LONNYMQ_OPTION``), else ``default``."""
    value = os.environ.get("LONNYMQ_" + option.upper().replace("-", "_"))
    return default if value is None or value == "" else cast(value)


def _option(parser: argparse.ArgumentParser, name: str, help: str, **kwargs: Any) -> None:
    cast = kwargs.get("type", str)
    default = _env(name, kwargs.pop("default", None), cast)
    env = "LONNYMQ_" + name.upper().replace("-", "_")
    parser.add_argument(f"--{name}", default=default, help=f"{help} (env {env})", **kwargs)


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

    create = commands.add_parser(
        "create", help="create messages: one per argument, or one per line of standard input"
    )
    create.add_argument("contents", nargs="*", help="message contents (UTF-8); none: stdin")
    _option(create, "channel", "channel to create in")
    _option(create, "dequeue-at", "not before this time (ms since the epoch)", type=int)
    _option(create, "delay-ms", "not before now + this many ms", type=int)
    _option(create, "dedup-key", "deduplication key (one message only)")
    create.add_argument("--json", action="store_true", help="print one JSON result per line")

    policy = commands.add_parser("policy", help="set, clear or show channel policies")
    policy_commands = policy.add_subparsers(dest="policy_command", required=True)
    policy_set = policy_commands.add_parser("set", help="set a channel's policy")
    policy_set.add_argument("channel")
    _option(policy_set, "max-concurrency", "messages locked at once (0 pauses)", type=int)
    _option(policy_set, "release-interval-ms", "minimum gap between two dequeues", type=int)
    _option(policy_set, "max-size", "messages held; beyond it creates are dropped", type=int)
    policy_clear = policy_commands.add_parser("clear", help="remove a channel's policy")
    policy_clear.add_argument("channel")
    policy_show = policy_commands.add_parser("show", help="show policies")
    policy_show.add_argument("channel", nargs="?")
    policy_show.add_argument("--json", action="store_true", help="print JSON lines")

    worker = commands.add_parser("worker", help="run MODULE:FUNCTION on every message")
    worker.add_argument("handler", help="the handler, as module.path:function")
    _option(worker, "concurrency", "handlers running at once", type=int, default=4)
    _option(
        worker, "lock-ms", "lock length, renewed while a handler runs", type=int, default=30_000
    )
    _option(worker, "max-attempts", "attempts before a message fails for good", type=int, default=5)
    _option(worker, "dead-letter-channel", "move messages that fail for good here")
    _option(worker, "grace-s", "seconds running handlers get on SIGTERM", type=float, default=30.0)
    worker.add_argument(
        "--until-idle", action="store_true", help="exit once nothing is waiting or running"
    )

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
    demo.add_argument("--workers", type=int, default=4, help="handlers running at once")
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
    event_channel = getattr(args, "event_channel", None)
    with Queue(args.dsn, schema=args.schema, event_channel=event_channel) as q:
        return COMMANDS[args.command](q, args)


def _install(q: Queue, args: argparse.Namespace) -> int:
    version = q.install(archive=args.archive)
    print(f"schema {args.schema!r} is at version {version}")
    return 0


def _policy_text(policy: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in policy.items() if v is not None) or "-"


def _stats(q: Queue, args: argparse.Namespace) -> int:
    rows = q.stats()
    if args.json:
        for row in rows:
            print(json.dumps(asdict(row)))
        return 0
    print(f"{'channel':<24} {'size':>8} {'in flight':>9} {'next dequeue':>14}  policy")
    for row in rows:
        next_at = row.next_dequeue_at if row.next_dequeue_at is not None else "-"
        print(
            f"{row.channel:<24} {row.size:>8} {row.in_flight:>9} {next_at:>14}  "
            f"{_policy_text(asdict(row.policy))}"
        )
    return 0


def _contents(args: argparse.Namespace) -> Iterator[bytes]:
    if args.contents:
        yield from (c.encode() for c in args.contents)
        return
    for line in sys.stdin:
        text = line.rstrip("\n")
        if text:
            yield text.encode()


def _create(q: Queue, args: argparse.Namespace) -> int:
    if args.dequeue_at is not None and args.delay_ms is not None:
        raise InvalidArgumentError("give --dequeue-at or --delay-ms, not both")
    at = args.dequeue_at if args.delay_ms is None else q.now() + args.delay_ms
    contents = list(_contents(args))
    if args.dedup_key is not None and len(contents) != 1:
        raise InvalidArgumentError("--dedup-key applies to exactly one message")
    counts: dict[str, int] = {}
    for start in range(0, len(contents), 1000):
        chunk = [
            NewMessage(c, channel=args.channel, dequeue_at=at, dedup_key=args.dedup_key)
            for c in contents[start : start + 1000]
        ]
        for result in q.create_many(chunk):
            counts[result.status] = counts.get(result.status, 0) + 1
            if args.json:
                print(json.dumps(asdict(result)))
    if not args.json:
        print(", ".join(f"{n} {status}" for status, n in counts.items()) or "nothing to create")
    return 0


def _policy(q: Queue, args: argparse.Namespace) -> int:
    if args.policy_command == "set":
        q.channel(args.channel).set_policy(
            max_concurrency=args.max_concurrency,
            release_interval_ms=args.release_interval_ms,
            max_size=args.max_size,
        )
        return 0
    if args.policy_command == "clear":
        q.channel(args.channel).clear_policy()
        return 0
    rows = [r for r in q.stats() if args.channel in (None, r.channel)]
    for row in rows:
        policy = asdict(row.policy)
        if all(v is None for v in policy.values()):
            continue
        if args.json:
            print(json.dumps({"channel": row.channel, **policy}))
        else:
            print(f"{row.channel:<24} {_policy_text(policy)}")
    return 0


def _worker(q: Queue, args: argparse.Namespace) -> int:
    from .worker import Worker

    module_name, _, function_name = args.handler.partition(":")
    if not module_name or not function_name:
        raise InvalidArgumentError(f"handler must be module.path:function, got {args.handler!r}")
    try:
        handler = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as err:
        raise InvalidArgumentError(f"cannot load handler {args.handler!r}: {err}") from err
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    stats = Worker(
        q,
        handler,
        concurrency=args.concurrency,
        lock_ms=args.lock_ms,
        max_attempts=args.max_attempts,
        dead_letter_channel=args.dead_letter_channel,
        grace_s=args.grace_s,
    ).run(until_idle=args.until_idle)
    print(json.dumps(asdict(stats)))
    return 0


COMMANDS: dict[str, Callable[[Queue, argparse.Namespace], int]] = {
    "install": _install,
    "stats": _stats,
    "create": _create,
    "policy": _policy,
    "worker": _worker,
}


if __name__ == "__main__":
    raise SystemExit(main())
