"""Crash soak: worker processes drain many channels while a chaos driver SIGKILLs them.

Run by hand (a fresh schema on ``--dsn``, else ``$LONNYMQ_TEST_DSN``, else the embedded server)::

    .venv/bin/python tests/reliability/soak.py --messages 50000 --workers 4 --kill-every 2

``tests/reliability/test_soak.py`` runs a short variant. The driver installs a queue with the
archive on, gives a quarter of the channels ``max_concurrency`` 1, 2 or 3 (some also a
``release_interval_ms``), leaves the rest policy-free, creates the messages, then starts
worker subprocesses (:class:`lonnymq.worker.Worker`, short locks) and SIGKILLs a random one
every ``--kill-every`` seconds (jittered), starting a new one in its place, until every
message is finished. Each handler records its run in the side table ``soak_run`` (own
autocommit connection, queue clock): message, channel, attempt, pid, start, end, and the
``unlock_at`` its message carried when the handler started.

Checks at the end:

* lost: every created id has a ``completed`` archive row and no message row is left;
* violations: per channel, runs overlapping at once above ``max_concurrency``. A run counts
  over ``[started_at, min(ended_at, unlock_at))``, ``unlock_at`` being the lock's expiry
  when the handler started (a killed run has no ``ended_at``: it counts until then). Past that
  instant the run no longer holds a valid lock, and its message may legitimately run again.
  Handlers nap a few ms against a lock of ``--lock-ms`` (1.5 s by default), so the first
  expiry is the one that matters; heartbeats may only make the real lock longer, so the rule
  never counts a run that did not hold its lock;
* attempts: no attempt number ran twice for a message, and the archived ``num_attempts`` is
  the attempt of its last recorded run (``redeliveries`` = the sum of ``num_attempts - 1``);
* ``queue.verify() == []``.

It prints one line of figures and exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from lonnymq import NewMessage, Queue
from lonnymq.embedded import embedded_dsn

WORKER_SCRIPT = textwrap.dedent(
    """
    import os, sys, threading, time
    import psycopg
    from psycopg import sql
    from lonnymq import Queue
    from lonnymq.worker import Worker

    dsn, schema = sys.argv[1], sys.argv[2]
    lock_ms, nap_ms, concurrency = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    s = sql.Identifier(schema)
    start = sql.SQL(
        "INSERT INTO {s}.soak_run (message_id, channel, attempt, pid, started_at, unlock_at)"
        " VALUES (%s, %s, %s, %s, {s}.epoch(), %s) RETURNING run_id"
    ).format(s=s)
    end = sql.SQL("UPDATE {s}.soak_run SET ended_at = {s}.epoch() WHERE run_id = %s").format(s=s)
    PID = os.getpid()
    spare = []
    guard = threading.Lock()

    def handler(message):
        with guard:
            conn = spare.pop() if spare else psycopg.connect(dsn, autocommit=True)
        row = conn.execute(
            start,
            (message.id, message.channel, message.num_attempts, PID, message.unlock_at),
        ).fetchone()
        time.sleep(nap_ms / 1000)
        conn.execute(end, (row[0],))
        with guard:
            spare.append(conn)

    queue = Queue(dsn, schema=schema)
    Worker(
        queue, handler, concurrency=concurrency, lock_ms=lock_ms, max_attempts=1_000, grace_s=5
    ).run()
    """
)

SIDE_TABLE = """
CREATE TABLE {s}.soak_run (
    run_id BIGSERIAL PRIMARY KEY,
    message_id BIGINT NOT NULL,
    channel TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    pid INTEGER NOT NULL,
    started_at BIGINT NOT NULL,
    unlock_at BIGINT NOT NULL,
    ended_at BIGINT
)
"""


@dataclass(frozen=True)
class SoakConfig:
    """The soak's size and pace."""

    messages: int = 3_000
    channels: int = 20
    workers: int = 3
    concurrency: int = 4
    kill_every_s: float = 1.0
    lock_ms: int = 1_500
    nap_ms: int = 3
    timeout_s: float = 600.0
    seed: int = 0


@dataclass
class SoakReport:
    """What the soak measured; ``ok`` when nothing was lost and no limit was exceeded."""

    messages: int = 0
    kills: int = 0
    runs: int = 0
    redeliveries: int = 0
    violations: int = 0
    lost: int = 0
    attempt_errors: int = 0
    discrepancies: int = 0
    elapsed_s: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def line(self) -> str:
        return (
            f"messages={self.messages} kills={self.kills} runs={self.runs} "
            f"redeliveries={self.redeliveries} violations={self.violations} lost={self.lost} "
            f"attempt_errors={self.attempt_errors} discrepancies={self.discrepancies} "
            f"elapsed={self.elapsed_s:.1f}s"
        )


def channel_policies(count: int) -> dict[str, tuple[int | None, int | None]]:
    """Channel name -> (max_concurrency, release_interval_ms); (None, None) is policy-free."""
    policies: dict[str, tuple[int | None, int | None]] = {}
    for i in range(count):
        if i % 2 == 0:
            limit = 1 + (i // 2) % 3
            interval = 5 if i % 4 == 2 else None
            policies[f"soak-{i}"] = (limit, interval)
        elif i % 4 == 1:
            policies[f"soak-{i}"] = (None, 2)
        else:
            policies[f"soak-{i}"] = (None, None)
    return policies


def _spawn(dsn: str, schema: str, config: SoakConfig, log: Any) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            WORKER_SCRIPT,
            dsn,
            schema,
            str(config.lock_ms),
            str(config.nap_ms),
            str(config.concurrency),
        ],
        stdout=subprocess.DEVNULL,
        stderr=log,
    )


def _finished(conn: psycopg.Connection[Any], schema: str) -> int:
    row = conn.execute(
        sql.SQL("SELECT count(*) FROM {}.archive").format(sql.Identifier(schema))
    ).fetchone()
    return int(row[0]) if row else 0


def count_violations(
    runs: list[tuple[str, int, int, int | None]], limits: dict[str, int]
) -> tuple[int, dict[str, int]]:
    """Starts at which a channel had more runs holding a valid lock than its limit; also the
    highest overlap seen per limited channel. ``runs``: (channel, started_at, unlock_at,
    ended_at)."""
    events: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for channel, started, unlock_at, ended in runs:
        if channel not in limits:
            continue
        stop = unlock_at if ended is None else min(ended, unlock_at)
        if stop <= started:
            continue  # started after its lock expired: it held nothing
        events[channel].append((started, 1))
        events[channel].append((stop, -1))
    violations = 0
    peaks: dict[str, int] = {}
    for channel, points in events.items():
        points.sort()  # at one instant, ends (-1) come before starts (+1): intervals are [a, b)
        running = peak = 0
        for _, step in points:
            running += step
            if step > 0 and running > limits[channel]:
                violations += 1
            peak = max(peak, running)
        peaks[channel] = peak
    return violations, peaks


def run_soak(dsn: str, schema: str, config: SoakConfig, *, say: Any = None) -> SoakReport:
    """Run the soak on a fresh ``schema`` (left in place) and check the invariants."""
    rng = random.Random(config.seed)
    report = SoakReport(messages=config.messages)
    s = sql.Identifier(schema)
    policies = channel_policies(config.channels)
    limits = {name: limit for name, (limit, _) in policies.items() if limit is not None}
    with Queue(dsn, schema=schema) as queue, psycopg.connect(dsn, autocommit=True) as admin:
        queue.install(archive=True)
        admin.execute(sql.SQL(SIDE_TABLE).format(s=s))
        for name, (limit, interval) in policies.items():
            if limit is not None or interval is not None:
                queue.channel(name).set_policy(max_concurrency=limit, release_interval_ms=interval)
        names = list(policies)
        created: set[int] = set()
        for first in range(0, config.messages, 1_000):
            batch = [
                NewMessage(f"m{i}".encode(), channel=rng.choice(names))
                for i in range(first, min(first + 1_000, config.messages))
            ]
            created.update(r.id for r in queue.create_many(batch) if r.id is not None)
        if len(created) != config.messages:
            report.problems.append(f"created {len(created)} of {config.messages}")

        started = time.monotonic()
        with tempfile.TemporaryFile() as log:
            workers = [_spawn(dsn, schema, config, log) for _ in range(config.workers)]
            try:
                next_kill = started + config.kill_every_s
                while _finished(admin, schema) < config.messages:
                    now = time.monotonic()
                    if now - started > config.timeout_s:
                        report.problems.append(f"not finished after {config.timeout_s:.0f}s")
                        break
                    if now >= next_kill:
                        victim = rng.randrange(len(workers))
                        os.kill(workers[victim].pid, signal.SIGKILL)
                        workers[victim].wait()
                        workers[victim] = _spawn(dsn, schema, config, log)
                        report.kills += 1
                        next_kill = now + config.kill_every_s * rng.uniform(0.5, 1.5)
                        if say is not None:
                            say(f"kill {report.kills}: {_finished(admin, schema)} finished")
                    time.sleep(0.05)
            finally:
                for proc in workers:
                    proc.send_signal(signal.SIGTERM)
                for proc in workers:
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
            report.elapsed_s = time.monotonic() - started
            if not report.ok:
                log.seek(0)
                report.problems.append(log.read().decode(errors="replace")[-4_000:])

        _check(admin, queue, schema=schema, created=created, limits=limits, report=report)
    return report


def _check(
    admin: psycopg.Connection[Any],
    queue: Queue,
    *,
    schema: str,
    created: set[int],
    limits: dict[str, int],
    report: SoakReport,
) -> None:
    s = sql.Identifier(schema)
    archived = admin.execute(
        sql.SQL("SELECT id, outcome, num_attempts FROM {s}.archive").format(s=s)
    ).fetchall()
    completed = {int(r[0]): int(r[2]) for r in archived if r[1] == "completed"}
    left = {int(r[0]) for r in admin.execute(sql.SQL("SELECT id FROM {s}.message").format(s=s))}
    report.lost = len(created - completed.keys()) + len(left & created)
    if report.lost:
        report.problems.append(f"{report.lost} messages lost or unfinished")
    if len(archived) != len(completed) or completed.keys() - created:
        report.problems.append("archive rows other than one completion per created message")
    report.redeliveries = sum(n - 1 for n in completed.values())

    runs = admin.execute(
        sql.SQL(
            "SELECT message_id, attempt, channel, started_at, unlock_at, ended_at FROM {s}.soak_run"
        ).format(s=s)
    ).fetchall()
    report.runs = len(runs)
    last_attempt: dict[int, int] = {}
    seen: set[tuple[int, int]] = set()
    for message_id, attempt, *_ in runs:
        if (message_id, attempt) in seen:
            report.attempt_errors += 1  # one attempt handed to two handlers
        seen.add((message_id, attempt))
        last_attempt[message_id] = max(attempt, last_attempt.get(message_id, 0))
    report.attempt_errors += sum(1 for id_, n in completed.items() if last_attempt.get(id_) != n)
    if report.attempt_errors:
        report.problems.append(f"{report.attempt_errors} attempt count errors")

    report.violations, _ = count_violations(
        [(r[2], int(r[3]), int(r[4]), None if r[5] is None else int(r[5])) for r in runs],
        limits,
    )
    if report.violations:
        report.problems.append(f"{report.violations} runs above their channel's limit")
    found = queue.verify()
    report.discrepancies = len(found)
    if found:
        report.problems.append(f"verify(): {found[:5]}")


def main(argv: list[str] | None = None) -> int:
    defaults = SoakConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--dsn", default=os.environ.get("LONNYMQ_TEST_DSN"))
    parser.add_argument("--schema", help="a schema that does not exist yet (default: random)")
    parser.add_argument("--keep", action="store_true", help="keep the schema afterwards")
    parser.add_argument("--messages", type=int, default=defaults.messages)
    parser.add_argument("--channels", type=int, default=defaults.channels)
    parser.add_argument("--workers", type=int, default=defaults.workers)
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency)
    parser.add_argument("--kill-every", type=float, default=defaults.kill_every_s, help="s")
    parser.add_argument("--lock-ms", type=int, default=defaults.lock_ms)
    parser.add_argument("--nap-ms", type=int, default=defaults.nap_ms)
    parser.add_argument("--timeout", type=float, default=defaults.timeout_s, help="s")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    config = SoakConfig(
        messages=args.messages,
        channels=args.channels,
        workers=args.workers,
        concurrency=args.concurrency,
        kill_every_s=args.kill_every,
        lock_ms=args.lock_ms,
        nap_ms=args.nap_ms,
        timeout_s=args.timeout,
        seed=args.seed,
    )
    dsn = args.dsn or embedded_dsn(Path(tempfile.mkdtemp(prefix="lonnymq-soak-")) / "data")
    schema = args.schema or f"soak_{uuid.uuid4().hex[:12]}"
    say = None if args.quiet else (lambda text: print(text, file=sys.stderr, flush=True))
    try:
        report = run_soak(dsn, schema, config, say=say)
    finally:
        if not args.keep:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(
                    sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
                )
    print(report.line(), flush=True)
    for problem in report.problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
