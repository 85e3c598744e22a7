"""The ``lonnymq`` command line: a thin layer over the API.

What ``lonnymq --help`` says (the commands by group, the environment twins of the options,
the exit codes) is written once, below, as plain text: ``SUMMARY``, ``EVERYDAY``, ``TOOLING``
and ``EPILOG``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import logging
import os
import queue
import signal
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, replace
from typing import Any

import psycopg

from . import __version__, _core, migrate
from .errors import DatabaseUnavailableError, InvalidArgumentError, LonnyMQError, translate
from .metrics import JsonFormatter, MetricsServer, OperationStats, WorkerMetrics
from .queue import Queue
from .queue_async import AsyncQueue
from .types import ChannelStats, NewMessage
from .worker import AsyncWorker, Backoff, Worker, WorkerStats

EXIT_NOT_FOUND = 3
MAX_TOP_INTERVAL_S = 86_400.0

SUMMARY = "lonnymq: a fair, durable message queue that lives inside PostgreSQL."

# The commands `lonnymq --help` lists, by group: the queue's everyday work, then tooling.
EVERYDAY = (
    "install",
    "migrate",
    "create",
    "worker",
    "stats",
    "top",
    "verify",
    "maintain",
    "policy",
    "schedule",
    "archive",
    "dashboard",
    "grant",
    "revoke",
    "grants",
)
TOOLING = ("bench", "demo")

EPILOG = """\
Run "lonnymq COMMAND --help" for a command's options.

Environment: an option whose help ends with (env LONNYMQ_NAME) takes its
default from that variable: --some-option is LONNYMQ_SOME_OPTION (--dsn is
LONNYMQ_DSN), except that the --out and --hold of bench and demo carry the
command's name (LONNYMQ_BENCH_OUT). A value given on the command line wins.
Without --dsn or LONNYMQ_DSN, lonnymq starts (or joins) its embedded
PostgreSQL.

Output: a table on a terminal, plain text otherwise; --json, where a command
has it, prints one JSON object per line for scripts.

Exit codes:
  0    success
  1    the operation failed, or verify found discrepancies
  2    bad usage
  3    the thing named does not exist (schedule remove of an unknown schedule)
  130  interrupted by Ctrl-C or SIGTERM (a worker stops gracefully instead,
       and exits 0)
  141  standard output was closed by its reader (lonnymq stats | head)
"""

__all__ = ["main"]


def _option(parser: argparse.ArgumentParser, name: str, help: str, **kwargs: Any) -> None:
    """``--name``, whose default is ``LONNYMQ_NAME`` when that is set. argparse converts a
    string default with the option's ``type``, so a malformed variable is a usage error (exit
    2) naming the option, as the same value on the command line would be."""
    env = "LONNYMQ_" + name.upper().replace("-", "_")
    kwargs["default"] = os.environ.get(env) or kwargs.get("default")
    parser.add_argument(f"--{name}", help=f"{help} (env {env})", **kwargs)


class _Command(argparse.ArgumentParser):
    """A subcommand's parser: ``--dsn`` and ``--schema`` may also follow the subcommand's name
    (``lonnymq stats --schema shop``); given there, they override the ones before it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_argument("--dsn", default=argparse.SUPPRESS, help="as lonnymq --dsn")
        self.add_argument("--schema", default=argparse.SUPPRESS, help="as lonnymq --schema")


def _version(text: str) -> int:
    """A schema version for ``migrate --from``: 0 (nothing installed) up to the latest."""
    latest = migrate.latest_version()
    try:
        version = int(text)
    except ValueError:
        version = -1
    if not 0 <= version <= latest:
        raise argparse.ArgumentTypeError(f"must be a schema version from 0 to {latest}: {text!r}")
    return version


# What the archive records a message's end as (the outcomes a worker or the API writes).
OUTCOMES = ("completed", "failed")


def _outcome(text: str) -> str:
    """An archive outcome for ``archive list --outcome``: a typo would find nothing."""
    if text not in OUTCOMES:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(OUTCOMES)}: {text!r}")
    return text


def _add(commands: Any, name: str, help: str, **kwargs: Any) -> argparse.ArgumentParser:
    """The (sub)command ``name``, summed up by ``help``; its own ``--help`` opens with its
    description, which is that summary as a sentence unless given."""
    kwargs.setdefault("description", help[0].upper() + help[1:] + ".")
    parser: argparse.ArgumentParser = commands.add_parser(name, help=help, **kwargs)
    return parser


def _listing(title: str, names: Sequence[str], summaries: dict[str, str]) -> str:
    """``title``, then one line per command: its name and summary, wrapped under itself."""
    width = max(map(len, summaries)) + 2
    lines = [f"{title}:"]
    for name in names:
        lines += textwrap.wrap(
            summaries[name],
            width=79,
            initial_indent=f"  {name:<{width}}",
            subsequent_indent=" " * (width + 2),
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lonnymq",
        usage="%(prog)s [-h] [--version] [--dsn DSN] [--schema SCHEMA] COMMAND ...",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s {__version__}",
        help="print lonnymq's version and exit",
    )
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
    # The commands are listed by group in the description (argparse has one flat list).
    commands = parser.add_subparsers(
        dest="command",
        required=True,
        parser_class=_Command,
        prog="lonnymq",
        metavar="COMMAND",
        help=argparse.SUPPRESS,
    )
    summaries: dict[str, str] = {}

    def command(name: str, help: str, **kwargs: Any) -> argparse.ArgumentParser:
        summaries[name] = help
        return _add(commands, name, help, **kwargs)

    install = command("install", help="create or upgrade the queue's schema")
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

    migrate_cmd = command("migrate", help="show the install SQL")
    migrate_cmd.add_argument(
        "--print",
        dest="print_sql",
        action="store_true",
        required=True,
        help="print the SQL script that install would run on an empty schema (no settings)",
    )
    migrate_cmd.add_argument(
        "--from",
        dest="from_version",
        type=_version,
        default=0,
        metavar="VERSION",
        help="only the migrations after VERSION (the schema's current version), for an upgrade",
    )

    stats = command("stats", help="channels: size, in flight, next dequeue, policy")
    stats.add_argument("--json", action="store_true", help="print JSON lines")

    verify = command(
        "verify", help="check channel counters and heads against the messages (exit 1: problems)"
    )
    verify.add_argument("--json", action="store_true", help="print JSON lines")

    maintain = command(
        "maintain",
        help="vacuum the queue's high-churn tables if they need it, and compact those a long "
        "transaction keeps dead rows in (as their owner)",
    )
    maintain.add_argument("--json", action="store_true", help="print a JSON object")

    create = command(
        "create", help="create messages: one per argument, or one per line of standard input"
    )
    create.add_argument(
        "contents",
        nargs="*",
        help="message contents (UTF-8); none: one per line of stdin, created as lines arrive, "
        "up to 1,000 per transaction",
    )
    _option(create, "channel", "channel to create in")
    _option(create, "dequeue-at", "not before this time (ms since the epoch)", type=int)
    _option(create, "delay-ms", "not before now + this many ms", type=int)
    _option(create, "dedup-key", "deduplication key (one message only)")
    create.add_argument("--json", action="store_true", help="print one JSON result per line")

    policy = command("policy", help="set, clear or show channel policies")
    policy_commands = policy.add_subparsers(
        dest="policy_command", required=True, parser_class=_Command
    )
    policy_set = _add(
        policy_commands,
        "set",
        help="set a channel's policy, whole: a limit not given is removed",
        description="Set a channel's policy. It replaces the whole policy: a limit not given "
        "here is removed (give every limit the channel should keep).",
    )
    policy_set.add_argument("channel")
    _option(policy_set, "max-concurrency", "messages locked at once (0 pauses)", type=int)
    _option(policy_set, "release-interval-ms", "minimum gap between two dequeues", type=int)
    _option(policy_set, "max-size", "messages held; beyond it creates are dropped", type=int)
    policy_clear = _add(policy_commands, "clear", help="remove a channel's policy")
    policy_clear.add_argument("channel")
    policy_show = _add(policy_commands, "show", help="show policies")
    policy_show.add_argument("channel", nargs="?")
    policy_show.add_argument("--json", action="store_true", help="print JSON lines")

    grant = command("grant", help="let a PostgreSQL role do what a producer, worker or admin needs")
    grant.add_argument("role", help="an existing PostgreSQL role")
    grant.add_argument("kind", choices=["producer", "worker", "admin"])
    revoke = command("revoke", help="take every right on the queue from a role")
    revoke.add_argument("role", help="an existing PostgreSQL role")
    grants = command("grants", help="list the roles granted a kind")
    grants.add_argument("--json", action="store_true", help="print JSON lines")

    worker = command("worker", help="run MODULE:FUNCTION on every message")
    worker.add_argument("handler", help="the handler, as module.path:function")
    _option(worker, "concurrency", "handlers running at once", type=int, default=4)
    _option(
        worker, "lock-ms", "lock length, renewed while a handler runs", type=int, default=30_000
    )
    _option(worker, "max-attempts", "attempts before a message fails for good", type=int, default=5)
    _option(worker, "dead-letter-channel", "move messages that fail for good here")
    _option(worker, "grace-s", "seconds running handlers get on SIGTERM", type=float, default=30.0)
    _option(worker, "heartbeat-ms", "lock renewal period (default lock-ms / 3)", type=int)
    _option(
        worker,
        "maintenance-ms",
        "how often to vacuum the queue's busiest tables when they need it (0: never)",
        type=int,
        default=1_000,
    )
    _option(worker, "backoff-base-ms", "first retry delay", type=int, default=1_000)
    _option(worker, "backoff-max-ms", "longest retry delay", type=int, default=300_000)
    _option(worker, "backoff-factor", "retry delay growth per attempt", type=float, default=2.0)
    worker.add_argument(
        "--no-jitter", action="store_true", help="exact retry delays (default: randomised)"
    )
    _option(worker, "metrics-port", "serve Prometheus metrics on this port (0: any)", type=int)
    _option(worker, "log-format", "text or json (one JSON object per line)", default="text")
    worker.add_argument(
        "--asyncio",
        action="store_true",
        help="run an AsyncWorker (coroutine handlers as tasks, others in threads)",
    )
    worker.add_argument(
        "--until-idle", action="store_true", help="exit once nothing is waiting or running"
    )

    top = command("top", help="live per-channel view: size, in flight, net rate, next dequeue")
    _option(top, "interval", "seconds between refreshes", type=float, default=1.0)
    _option(top, "iterations", "stop after this many refreshes (default: until Ctrl-C)", type=int)
    top.add_argument("--json", action="store_true", help="print JSON lines per refresh")

    schedule = command("schedule", help="add, list or remove periodic schedules")
    schedule_commands = schedule.add_subparsers(
        dest="schedule_command", required=True, parser_class=_Command
    )
    schedule_add = _add(schedule_commands, "add", help="create or update a schedule")
    schedule_add.add_argument("name")
    schedule_add.add_argument("--cron", required=True, help='five fields, UTC: "*/5 * * * *"')
    _option(schedule_add, "channel", "channel the task messages go to")
    schedule_add.add_argument("--content", default="", help="task message content (UTF-8)")
    schedule_list = _add(schedule_commands, "list", help="list schedules")
    schedule_list.add_argument("--json", action="store_true", help="print JSON lines")
    schedule_remove = _add(schedule_commands, "remove", help="remove a schedule")
    schedule_remove.add_argument("name")

    archive = command("archive", help="inspect finished messages, replay failures")
    archive_commands = archive.add_subparsers(
        dest="archive_command", required=True, parser_class=_Command
    )
    archive_list = _add(archive_commands, "list", help="archived messages, newest first")
    _option(archive_list, "outcome", "only this outcome (completed, failed)", type=_outcome)
    _option(archive_list, "channel", "only this channel")
    _option(archive_list, "limit", "at most this many", type=int, default=20)
    archive_list.add_argument("--json", action="store_true", help="print JSON lines")
    archive_replay = _add(
        archive_commands, "replay", help="create archived messages again (each at most once)"
    )
    archive_replay.add_argument("ids", nargs="*", type=int, help="archive ids")
    archive_replay.add_argument(
        "--failed", action="store_true", help="every failed message not replayed yet"
    )
    _option(archive_replay, "channel", "with --failed: only this channel")
    archive_replay.add_argument("--json", action="store_true", help="print JSON lines")

    dashboard = command(
        "dashboard", help="serve a web dashboard of the queue (needs the dashboard extra)"
    )
    _option(dashboard, "host", "interface to listen on", default="127.0.0.1")
    _option(dashboard, "port", "port to listen on (0: any free one)", type=int, default=8700)
    dashboard.add_argument(
        "--read-only", action="store_true", help="show only: every action is refused"
    )
    _option(dashboard, "token", "require this token from every client (see the docs)")

    bench = command(
        "bench", help="measure lonnymq against a raw SKIP LOCKED queue (same server, one run)"
    )
    bench.add_argument("--quick", action="store_true", help="a short smoke run (seconds)")
    bench.add_argument(
        "--spark-only",
        action="store_true",
        help="only the Spark section (batch write against raw COPY, streaming read)",
    )
    bench.add_argument(
        "--worker",
        action="store_true",
        help="only the worker shape: Worker, AsyncWorker and the durable floor on a backlog "
        "of 4,000 with 1 ms handlers, at 8, 32 and 128 slots (bench_worker.json)",
    )
    bench.add_argument(
        "--no-maintenance",
        action="store_true",
        help="time the queues without the vacuuming a worker does (default: both queues get it)",
    )
    bench.add_argument(
        "--out",
        default=os.environ.get("LONNYMQ_BENCH_OUT", "benchmarks/results"),
        help="where bench.json and the plots go (env LONNYMQ_BENCH_OUT)",
    )
    bench.add_argument(
        "--long-txn",
        action="store_true",
        help="instead: a Worker under a steady load at half its capacity, before, while and "
        "after another session holds the xmin horizon back (long_txn.json)",
    )
    bench.add_argument(
        "--hold",
        type=float,
        default=os.environ.get("LONNYMQ_BENCH_HOLD") or "600",
        help="with --long-txn: seconds each holder holds the horizon (env LONNYMQ_BENCH_HOLD)",
    )
    bench.add_argument(
        "--holders",
        choices=("idle", "reader", "spark", "idle,reader", "idle,reader,spark"),
        default="idle,reader",
        metavar="HOLDERS",
        help="with --long-txn: idle (a session idle in a transaction), reader (a long SELECT "
        "running), spark (a Spark job reading a queue of 10^6 messages in one snapshot), or "
        "one after the other: idle,reader (the default) or idle,reader,spark",
    )
    bench.add_argument(
        "--rate",
        type=float,
        help="with --long-txn: messages/s offered (default: half the capacity, measured first)",
    )

    demo = command(
        "demo",
        help="run the demo pipeline: Spark ingests orders, a Worker and a Spark stream drain "
        "them, Spark reports from the archives (needs the demo extra and Java 17+)",
    )
    _option(demo, "rows", "orders in the generated dataset", type=int, default=200_000)
    _option(demo, "workers", "notification handlers the Python Worker runs at once", type=int,
            default=8)  # fmt: skip
    _option(demo, "batch", "orders per Spark micro-batch", type=int, default=25_000)
    demo.add_argument(
        "--dashboard",
        type=int,
        metavar="PORT",
        help="serve the dashboard of both queues on 127.0.0.1:PORT (0: any free port) while "
        "the demo runs, read-only (needs the dashboard extra)",
    )
    demo.add_argument(
        "--out",
        default=os.environ.get("LONNYMQ_DEMO_OUT", "demo-output"),
        help="where the dataset, report.png, report.json and spark.log go "
        "(env LONNYMQ_DEMO_OUT; default demo-output)",
    )
    assert sorted(summaries) == sorted(EVERYDAY + TOOLING)
    parser.description = "\n\n".join(
        [
            SUMMARY,
            _listing("Everyday commands", EVERYDAY, summaries),
            _listing("Tooling", TOOLING, summaries),
        ]
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lonnymq`` command."""
    args = _parser().parse_args(argv)
    _interrupt_on_termination()
    try:
        return _run(args)
    except LonnyMQError as err:
        print(f"lonnymq: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    except psycopg.Error as err:  # from a command that talks to the server directly (bench)
        failure = translate(err, schema=getattr(args, "schema", None))
        print(f"lonnymq: {type(failure).__name__}: {failure}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (``lonnymq stats | head``): stop quietly, and let nothing
        # flush into the closed pipe on the way out.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _interrupt_on_termination() -> None:
    """SIGTERM (``timeout``, ``kill``) stops a command as Ctrl-C does, and it exits normally,
    so an embedded server it started is stopped too (the signal's default action killed the
    command and left the server running). SIGHUP (a closed terminal) is handled as SIGTERM,
    by whichever handler SIGTERM has: a worker replaces it with its graceful stop while it
    runs. (Not through SIGINT: a command started in the background may have it ignored.)"""
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread (tests call main())

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    def on_hangup(signum: int, frame: object) -> None:
        os.kill(os.getpid(), signal.SIGTERM)

    # A signal the command was started with ignored (``nohup``) stays ignored.
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN:
        signal.signal(signal.SIGTERM, on_term)
    if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, on_hangup)


def _tty() -> bool:
    return sys.stdout.isatty()


def _table(headers: list[str], rows: list[list[str]]) -> None:
    """A rich table on a terminal, aligned plain text otherwise."""
    if _tty():
        from rich.console import Console
        from rich.table import Table

        table = Table(*headers)
        for row in rows:
            table.add_row(*row)
        Console().print(table)
        return
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    for line in [headers, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip())


class _Progress:
    """A progress bar on stderr when it is a terminal; silent otherwise. ``total`` 0: no bar;
    ``None``: a total not known in advance (the bar counts what was done)."""

    def __init__(self, description: str, total: int | None) -> None:
        self._bar: Any = None
        self._description = description
        self._done = 0
        if sys.stderr.isatty() and total != 0:
            from rich.console import Console
            from rich.progress import Progress

            self._bar = Progress(console=Console(stderr=True), transient=True)
            self._bar.start()
            self._task = self._bar.add_task(description, total=total)
            self._counting = total is None

    def advance(self, n: int) -> None:
        self._done += n
        if self._bar is not None:
            self._bar.advance(self._task, n)
            if self._counting:
                self._bar.update(self._task, description=f"{self._description} {self._done:,}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def _run(args: argparse.Namespace) -> int:
    if args.command == "migrate":
        sys.stdout.write(
            migrate.script(_core.check_schema(args.schema), from_version=args.from_version)
        )
        return 0
    if args.command == "bench":
        from .bench import run_bench
        from .embedded import resolve_dsn

        if args.long_txn:
            from . import bench_long_txn

            for flag, given in (("--spark-only", args.spark_only), ("--worker", args.worker)):
                if given:
                    raise InvalidArgumentError(f"--long-txn and {flag} are separate runs")
            settings = replace(
                bench_long_txn.QUICK if args.quick else bench_long_txn.DEFAULT,
                holders=tuple(args.holders.split(",")),
                rate=args.rate,
                **({} if args.quick else {"hold": args.hold}),
            )
            bench_long_txn.run_long_txn(
                _core.with_client_timeouts(resolve_dsn(args.dsn)), settings, out=args.out
            )
            return 0
        if args.spark_only and args.worker:
            raise InvalidArgumentError("--spark-only and --worker are separate runs")
        run_bench(
            _core.with_client_timeouts(resolve_dsn(args.dsn)),
            profile="quick" if args.quick else "default",
            out=args.out,
            spark_only=args.spark_only,
            worker_only=args.worker,
            maintenance=not args.no_maintenance,
        )
        return 0
    if args.command == "demo":
        from .demo import run_demo

        for name, low, high in (("rows", 100, None), ("workers", 1, 64), ("batch", 100, 100_000)):
            value = getattr(args, name)
            if value < low or (high is not None and value > high):
                bounds = f">= {low}" if high is None else f"between {low} and {high}"
                raise InvalidArgumentError(f"--{name} must be {bounds}, got {value}")
        if args.dashboard is not None and not 0 <= args.dashboard <= 65_535:
            raise InvalidArgumentError(
                f"--dashboard must be a port between 0 and 65535, got {args.dashboard}"
            )
        return run_demo(
            dsn=args.dsn,
            rows=args.rows,
            workers=args.workers,
            out=args.out,
            batch=args.batch,
            dashboard=args.dashboard,
        )
    if args.command == "dashboard":
        return _dashboard(args)
    event_channel = getattr(args, "event_channel", None)
    with Queue(args.dsn, schema=args.schema, event_channel=event_channel) as q:
        return COMMANDS[args.command](q, args)


def _dashboard(args: argparse.Namespace) -> int:
    try:
        from .dashboard import _serve
    except ImportError as err:
        raise InvalidArgumentError(
            f"the dashboard needs its extra: pip install 'lonnymq[dashboard]' ({err})"
        ) from err
    if not 0 <= args.port <= 65_535:
        raise InvalidArgumentError(f"--port must be between 0 and 65535, got {args.port}")
    listener = _serve.listen(args.host, args.port)

    def started(_server: object) -> None:
        print(f"lonnymq dashboard on {_serve.url_of(listener)}", flush=True)

    with listener:
        asyncio.run(
            _serve.serve(
                listener,
                args.dsn,
                [args.schema],
                read_only=args.read_only,
                token=args.token,
                started=started,
            )
        )
    return 0


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
    _table(
        ["channel", "size", "in flight", "next dequeue", "policy"],
        [
            [
                row.channel,
                str(row.size),
                str(row.in_flight),
                "-" if row.next_dequeue_at is None else str(row.next_dequeue_at),
                _policy_text(asdict(row.policy)),
            ]
            for row in rows
        ],
    )
    return 0


def _verify(q: Queue, args: argparse.Namespace) -> int:
    found = q.verify()
    if args.json:
        for item in found:
            print(json.dumps(asdict(item)))
    elif found:

        def text(value: int | None) -> str:
            return "-" if value is None else str(value)

        _table(
            ["channel", "kind", "expected", "actual", "detail"],
            [[d.channel, d.kind, text(d.expected), text(d.actual), d.detail] for d in found],
        )
    else:
        print("consistent: no discrepancies")
    return 1 if found else 0


def _maintain(q: Queue, args: argparse.Namespace) -> int:
    vacuumed = q.maintain(compact=False)
    compacted = q.compact()
    if args.json:
        print(json.dumps({"vacuumed": vacuumed, "compacted": compacted}))
    elif vacuumed or compacted:
        if vacuumed:
            print("vacuumed: " + ", ".join(vacuumed))
        if compacted:
            print("compacted: " + ", ".join(compacted))
    else:
        print("nothing to do (or not the tables' owner)")
    return 0


def _utf8(text: str, what: str) -> bytes:
    """``text`` as UTF-8; text that has none (bytes the shell passed that were not UTF-8) is
    refused rather than sent mangled."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidArgumentError(f"{what} must be valid UTF-8 text: {err.reason}") from err


# Lines of standard input per create_many call (one transaction each), and how long the first
# line of a batch waits for others: a producer writing lines slowly gets each one created
# within about that long, instead of at end of input.
CREATE_BATCH = 1000
CREATE_IDLE_S = 0.2


def _read_stdin(lines: queue.Queue[tuple[int, bytes] | BaseException | None]) -> None:
    """Put standard input's lines (numbered from 1, line end kept) on ``lines``, then None.

    Runs in a daemon thread that may still be reading when the command ends: it reads its own
    duplicate of the file descriptor with ``os.read``, never through ``sys.stdin``, whose
    buffer lock a thread blocked in it would hold while the interpreter shuts down (a fatal
    error). Without a file descriptor (``sys.stdin`` replaced by a test), it reads
    ``sys.stdin`` itself."""
    number = 0
    try:
        try:
            fd = os.dup(sys.stdin.fileno())
        except (AttributeError, OSError, ValueError):
            for text in sys.stdin if sys.stdin is not None else ():
                number += 1
                lines.put((number, _utf8(text, f"line {number} of standard input")))
            lines.put(None)
            return
        pending = bytearray()
        with os.fdopen(fd, "rb", buffering=0) as raw:
            while chunk := raw.read(65536):
                # Look for line ends in the new chunk only: a long line is read in linear time.
                scan = len(pending)
                pending += chunk
                start = 0
                while (end := pending.find(b"\n", scan)) >= 0:
                    number += 1
                    lines.put((number, bytes(pending[start:end])))
                    start = scan = end + 1
                del pending[:start]
        if pending:
            lines.put((number + 1, bytes(pending)))
    except BaseException as err:  # handed to the main thread, which raises it
        lines.put(err)
        return
    lines.put(None)


def _stdin_batches() -> Iterator[list[bytes]]:
    """Standard input's non-empty lines (line ends taken off), in batches of up to
    ``CREATE_BATCH``; a batch is also yielded ``CREATE_IDLE_S`` after its first line came.
    A line that is not UTF-8 raises ``InvalidArgumentError`` naming its number."""
    lines: queue.Queue[tuple[int, bytes] | BaseException | None] = queue.Queue(
        maxsize=4 * CREATE_BATCH
    )
    threading.Thread(target=_read_stdin, args=(lines,), name="lonnymq-stdin", daemon=True).start()
    batch: list[bytes] = []
    deadline = 0.0
    while True:
        try:
            if batch:
                item = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            else:
                item = lines.get()
        except queue.Empty:
            yield batch
            batch = []
            continue
        if item is None:
            break
        if isinstance(item, BaseException):
            raise item
        number, line = item
        text = line.rstrip(b"\r\n")
        if not text:
            continue
        try:
            text.decode("utf-8")
        except UnicodeDecodeError as err:
            raise InvalidArgumentError(
                f"line {number} of standard input is not UTF-8 text: {err.reason}"
            ) from err
        if not batch:
            deadline = time.monotonic() + CREATE_IDLE_S
        batch.append(text)
        if len(batch) == CREATE_BATCH or time.monotonic() >= deadline:
            yield batch
            batch = []
    if batch:
        yield batch


@contextlib.contextmanager
def _signals_deferred() -> Iterator[list[int]]:
    """SIGINT and SIGTERM within the block are recorded in the list instead of interrupting
    it (a second one interrupts at once): a batch sent to the server is then counted whether
    or not its reply had come back when the first signal came."""
    got: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield got
        return

    def record(signum: int, frame: object) -> None:
        if got:
            raise KeyboardInterrupt
        got.append(signum)

    # A signal the command was started with ignored (a background job's SIGINT) stays so.
    before = {
        sig: signal.signal(sig, record)
        for sig in (signal.SIGINT, signal.SIGTERM)
        if signal.getsignal(sig) is not signal.SIG_IGN
    }
    try:
        yield got
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _create(q: Queue, args: argparse.Namespace) -> int:
    if args.dequeue_at is not None and args.delay_ms is not None:
        raise InvalidArgumentError("give --dequeue-at or --delay-ms, not both")
    # --delay-ms counts from when each batch is sent (lines may come long after the start).
    offset_ms = 0 if args.delay_ms is None else q.now() - int(time.time() * 1000)
    batches: Iterator[list[bytes]]
    total = 0
    if args.contents or args.dedup_key is not None:
        # All known before anything is created: from the arguments, or (with a dedup key,
        # which applies to exactly one message) all of standard input.
        if args.contents:
            contents = [_utf8(c, "message content") for c in args.contents]
        else:
            contents = [c for batch in _stdin_batches() for c in batch]
        if args.dedup_key is not None and len(contents) != 1:
            raise InvalidArgumentError("--dedup-key applies to exactly one message")
        total = len(contents)
        batches = (contents[i : i + CREATE_BATCH] for i in range(0, len(contents), CREATE_BATCH))
    else:
        batches = _stdin_batches()
    counts: dict[str, int] = {}
    sent = 0
    in_flight = 0
    if total:
        progress = _Progress("creating", total if total > CREATE_BATCH else 0)
    else:  # streaming standard input: count, unless a person is typing the lines
        progress = _Progress("creating", 0 if sys.stdin is None or sys.stdin.isatty() else None)
    try:
        for batch in batches:
            at = args.dequeue_at
            if args.delay_ms is not None:
                at = int(time.time() * 1000) + offset_ms + args.delay_ms
            # Until the batch's results are out: a signal waits for them. (In flight only from
            # inside: a signal that comes before the batch is sent stops ahead of it.)
            with _signals_deferred() as signalled:
                in_flight = len(batch)
                results = q.create_many(
                    NewMessage(c, channel=args.channel, dequeue_at=at, dedup_key=args.dedup_key)
                    for c in batch
                )
                sent += len(batch)
                in_flight = 0
                for result in results:
                    counts[result.status] = counts.get(result.status, 0) + 1
                    if args.json:
                        print(json.dumps(asdict(result)))
                progress.advance(len(batch))
            if signalled:
                raise KeyboardInterrupt
    except BaseException as err:
        # Each batch is its own transaction: say where a rerun should start.
        done = ", ".join(f"{n} {status}" for status, n in counts.items())
        unsure = in_flight and isinstance(err, KeyboardInterrupt | DatabaseUnavailableError)
        if unsure:
            print(
                f"lonnymq: the first {sent:,} messages were committed ({done or 'none'}); the "
                f"next {in_flight:,} may or may not have been (stopped while they were sent); "
                "none after them was",
                file=sys.stderr,
            )
        elif sent:
            print(
                f"lonnymq: stopped after the first {sent:,} messages, which were committed "
                f"({done}); none after them was",
                file=sys.stderr,
            )
        raise
    finally:
        progress.close()
    if not args.json:
        print(", ".join(f"{n} {status}" for status, n in counts.items()) or "nothing to create")
    return 0


def _policy(q: Queue, args: argparse.Namespace) -> int:
    if args.policy_command in ("set", "clear"):
        target = q.channel(args.channel)
        if args.policy_command == "set":
            target.set_policy(
                max_concurrency=args.max_concurrency,
                release_interval_ms=args.release_interval_ms,
                max_size=args.max_size,
            )
        else:
            target.clear_policy()
        # Read back: what is in force now, whoever else changed it meanwhile.
        stats = target.stats()
        limits = "-" if stats is None else _policy_text(asdict(stats.policy))
        in_force = "no limits" if limits == "-" else limits
        done = "set" if args.policy_command == "set" else "cleared"
        print(f"channel {target.name!r}: policy {done}; in force now: {in_force}")
        return 0
    rows = [
        (r.channel, asdict(r.policy))
        for r in q.stats()
        if args.channel in (None, r.channel)
        and any(v is not None for v in asdict(r.policy).values())
    ]
    if args.json:
        for channel, policy in rows:
            print(json.dumps({"channel": channel, **policy}))
    elif rows:
        _table(["channel", "policy"], [[channel, _policy_text(p)] for channel, p in rows])
    return 0


def _grant(q: Queue, args: argparse.Namespace) -> int:
    count = q.grant(args.role, args.kind)
    print(f"role {args.role!r} is a {args.kind} of schema {args.schema!r} ({count} functions)")
    return 0


def _revoke(q: Queue, args: argparse.Namespace) -> int:
    had = q.revoke(args.role)
    print(
        f"role {args.role!r} has no rights on schema {args.schema!r}"
        + ("" if had else " (it had no kind)")
    )
    return 0


def _grants(q: Queue, args: argparse.Namespace) -> int:
    grants = q.grants()
    if args.json:
        for g in grants:
            print(json.dumps({"role": g.role, "kind": g.kind.value, "granted_at": g.granted_at}))
        return 0
    _table(
        ["role", "kind", "granted at"],
        [[g.role, g.kind.value, _when(g.granted_at)] for g in grants],
    )
    return 0


def _worker(q: Queue, args: argparse.Namespace) -> int:

    module_name, _, function_name = args.handler.partition(":")
    if not module_name or not function_name:
        raise InvalidArgumentError(f"handler must be module.path:function, got {args.handler!r}")
    # As `python -m` would: a handler module in the current directory is found.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        handler = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as err:
        raise InvalidArgumentError(f"cannot load handler {args.handler!r}: {err}") from err
    if args.log_format not in ("text", "json"):
        raise InvalidArgumentError(f"--log-format must be text or json, got {args.log_format!r}")
    handler_out = logging.StreamHandler()
    if args.log_format == "json":
        handler_out.setFormatter(JsonFormatter())
    else:
        handler_out.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler_out], force=True)
    options: dict[str, Any] = {
        "concurrency": args.concurrency,
        "lock_ms": args.lock_ms,
        "heartbeat_ms": args.heartbeat_ms,
        "max_attempts": args.max_attempts,
        "backoff": Backoff(
            base_ms=args.backoff_base_ms,
            max_ms=args.backoff_max_ms,
            factor=args.backoff_factor,
            jitter=not args.no_jitter,
        ),
        "dead_letter_channel": args.dead_letter_channel,
        "grace_s": args.grace_s,
        "maintenance_ms": args.maintenance_ms or None,
        "metrics": WorkerMetrics(),
    }
    # Where the SQL operation counts come from: the queue the worker runs on.
    operations: list[Callable[[], list[OperationStats]]] = [q.operation_stats]
    server = None
    if args.metrics_port is not None:
        metrics: WorkerMetrics = options["metrics"]
        # A scrape reads the queue on its own connection (a second queue): the worker's pool
        # may be async, and a scrape must not take a worker's connection.
        with Queue(q.dsn, schema=q.schema, pool_size=1) as scraper:

            def scrape() -> str:
                # The channels first (a query, slow under load), the SQL totals last: what the
                # worker counted is then in the totals too.
                channels = [(s.channel, s.size, s.in_flight) for s in scraper.stats()]
                return metrics.render(operations[0], channels)

            server = MetricsServer(scrape, port=args.metrics_port)
            logging.getLogger("lonnymq.worker").info(
                "metrics on http://127.0.0.1:%s/metrics (every interface listens)", server.port
            )
            try:
                stats = _run_worker(q, handler, options, args, operations)
            finally:
                server.close()
    else:
        stats = _run_worker(q, handler, options, args, operations)
    print(json.dumps(asdict(stats)))
    return 0


def _run_worker(
    q: Queue,
    handler: Callable[..., Any],
    options: dict[str, Any],
    args: argparse.Namespace,
    operations: list[Callable[[], list[OperationStats]]],
) -> WorkerStats:
    if not args.asyncio:
        return Worker(q, handler, **options).run(until_idle=args.until_idle)

    async def run_async() -> WorkerStats:
        async with AsyncQueue(q.dsn, schema=q.schema) as aq:
            operations[0] = aq.operation_stats
            return await AsyncWorker(aq, handler, **options).run(until_idle=args.until_idle)

    return asyncio.run(run_async())


def _top(q: Queue, args: argparse.Namespace) -> int:
    if not 0 < args.interval <= MAX_TOP_INTERVAL_S:  # also refuses nan
        raise InvalidArgumentError(
            f"--interval must be more than 0 and at most {MAX_TOP_INTERVAL_S} s, "
            f"got {args.interval}"
        )
    if args.iterations is not None and args.iterations < 1:
        raise InvalidArgumentError(f"--iterations must be at least 1, got {args.iterations}")
    previous: dict[str, int] = {}
    last = time.monotonic()
    done = 0
    live: Any = None
    if _tty() and not args.json:
        from rich.live import Live

        live = Live(auto_refresh=False)
        live.start()
    try:
        while args.iterations is None or done < args.iterations:
            rows = q.stats()
            now_ms = q.now()
            elapsed = time.monotonic() - last
            last = time.monotonic()
            view = [_top_row(r, previous, elapsed, now_ms) for r in rows]
            previous = {r.channel: r.size for r in rows}
            done += 1
            if args.json:
                for row in view:
                    print(json.dumps(row), flush=True)
            elif live is not None:
                live.update(_top_table(view), refresh=True)
            else:
                print(f"-- {time.strftime('%H:%M:%S')}")
                _print_top(view)
            if args.iterations is None or done < args.iterations:
                time.sleep(args.interval)
    finally:
        if live is not None:
            live.stop()
    return 0


def _top_row(
    row: ChannelStats, previous: dict[str, int], elapsed: float, now_ms: int
) -> dict[str, Any]:
    before = previous.get(row.channel)
    rate = None if before is None or elapsed <= 0 else (before - row.size) / elapsed
    return {
        "channel": row.channel,
        "size": row.size,
        "in_flight": row.in_flight,
        # Net messages leaving per second (negative: the channel grows).
        "rate": None if rate is None else round(rate, 2),
        "next_dequeue_in_ms": (
            None if row.next_dequeue_at is None else max(0, row.next_dequeue_at - now_ms)
        ),
        "policy": asdict(row.policy),
    }


def _top_cells(view: list[dict[str, Any]]) -> list[list[str]]:
    def text(value: Any) -> str:
        return "-" if value is None else str(value)

    return [
        [
            v["channel"],
            str(v["size"]),
            str(v["in_flight"]),
            text(v["rate"]),
            text(v["next_dequeue_in_ms"]),
            _policy_text(v["policy"]),
        ]
        for v in view
    ]


TOP_HEADERS = ["channel", "size", "in flight", "rate/s", "next in ms", "policy"]


def _print_top(view: list[dict[str, Any]]) -> None:
    _table(TOP_HEADERS, _top_cells(view))


def _top_table(view: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    table = Table(*TOP_HEADERS, title="lonnymq top")
    for cells in _top_cells(view):
        table.add_row(*cells)
    return table


def _schedule(q: Queue, args: argparse.Namespace) -> int:
    if args.schedule_command == "add":
        created = q.schedule(
            args.name,
            cron=args.cron,
            content=_utf8(args.content, "--content"),
            channel=args.channel,
        )
        print(f"schedule {args.name!r} {'created' if created else 'updated'}")
        return 0
    if args.schedule_command == "remove":
        if not q.unschedule(args.name):
            print(f"lonnymq: no schedule named {args.name!r}", file=sys.stderr)
            return EXIT_NOT_FOUND
        print(f"schedule {args.name!r} removed")
        return 0
    schedules = q.schedules()
    if args.json:
        for s in schedules:
            data = asdict(s)
            data["content"] = s.content.decode("utf-8", "replace")
            print(json.dumps(data))
        return 0
    _table(
        ["name", "cron", "channel", "next at", "last fired", "firing"],
        [
            [s.name, s.cron, s.channel, _when(s.next_at), _when(s.last_fired_at), str(s.firing)]
            for s in schedules
        ],
    )
    return 0


def _when(ms: int | None) -> str:
    if ms is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ms / 1000)) + "Z"


def _archive(q: Queue, args: argparse.Namespace) -> int:
    if args.archive_command == "list":
        rows = q.archived(outcome=args.outcome, channel=args.channel, limit=args.limit)
        if args.json:
            for a in rows:
                data = asdict(a)
                data["content"] = a.content.decode("utf-8", "replace")
                data["state"] = None if a.state is None else a.state.decode("utf-8", "replace")
                print(json.dumps(data))
            return 0
        _table(
            ["id", "channel", "outcome", "attempts", "finished", "replayed as", "error"],
            [
                [
                    str(a.id),
                    a.channel,
                    a.outcome,
                    str(a.num_attempts),
                    _when(a.finished_at),
                    "-" if a.replayed_as is None else str(a.replayed_as),
                    (a.error or "").strip().splitlines()[-1][:60] if a.error else "",
                ]
                for a in rows
            ],
        )
        return 0
    ids = list(args.ids)
    if args.failed:
        before: int | None = None
        while True:
            page = q.archived(outcome="failed", channel=args.channel, before_id=before, limit=1000)
            ids.extend(a.id for a in page if a.replayed_as is None)
            if len(page) < 1000:
                break
            before = page[-1].id
    if not ids and args.failed:
        if not args.json:
            print("nothing to replay: no failed message in the archive waits for a replay")
        return 0
    if not ids:
        raise InvalidArgumentError("give archive ids, or --failed")
    counts: dict[str, int] = {}
    progress = _Progress("replaying", len(ids) if len(ids) > 1000 else 0)
    for start in range(0, len(ids), 1000):
        chunk = ids[start : start + 1000]
        for result in q.replay(chunk):
            counts[result.status] = counts.get(result.status, 0) + 1
            if args.json:
                print(json.dumps(asdict(result)))
        progress.advance(len(chunk))
    progress.close()
    if not args.json:
        print(", ".join(f"{n} {status}" for status, n in sorted(counts.items())))
    return 0


COMMANDS: dict[str, Callable[[Queue, argparse.Namespace], int]] = {
    "install": _install,
    "stats": _stats,
    "verify": _verify,
    "maintain": _maintain,
    "create": _create,
    "policy": _policy,
    "grant": _grant,
    "revoke": _revoke,
    "grants": _grants,
    "worker": _worker,
    "top": _top,
    "schedule": _schedule,
    "archive": _archive,
}


if __name__ == "__main__":
    raise SystemExit(main())
