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
``unlock_at`` its message carried when the handler started. A record that fails (the server
went away) is tried again until it is written (keyed, so a second try changes nothing): the
handler does not return before its end is recorded, so a run never looks shorter than it was.

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

With ``--restart-every SECONDS`` the soak runs on a private server of its own
(``pgserver.RestartableServer``, never ``--dsn``) and restarts it in immediate mode that often
(``--max-restarts`` caps it) while it goes on. The messages are then created during the run by
``--producers`` processes over about ``--produce-for`` seconds (``create`` and ``create_many``
calls); each writes the ids of every call that returned to a file outside the database and
tries again after a :class:`~lonnymq.errors.LonnyMQError`; any other exception is an untyped
error. Workers are never restarted because of the server: they must reconnect by themselves
(a worker that exits by itself is a ``worker_death``). Handlers of even ids finish their
message themselves, in one transaction with a ``soak_finish`` row (message, attempt): that
record commits with the finish or not at all. A refused finish (the holder was stale) goes to
``soak_refused``. A driver thread also plays a stale holder on purpose: it dequeues a message
with a 200 ms lock, waits until a worker dequeued it again, then tries to finish it. More
checks in this mode:

* lost: every acknowledged id is finished (ids committed although their call failed are
  counted as ``unacknowledged`` and must be finished too);
* finished twice: no message has two archive rows or two ``soak_finish`` rows;
* stale finishes: a ``soak_finish`` row carries the archived (last) attempt, every refused
  holder's attempt is older than the one that finished, and the driver's stale holder is never
  let through;
* untyped errors (producers, tracebacks in the workers' output) and worker deaths are 0.

``typed_errors`` counts the producers' failed calls (most calls made during an outage wait for
the pool to reconnect and succeed), ``worker_retries`` the dequeues and outcome reports the
workers tried again after a lost connection (their warnings).

It also prints ``restarts``, the longest outage (restart command until a connection works)
and ``resume_max``: the longest time from a restart's start until a handler ran again.

It prints one line of figures and exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import psycopg
from psycopg import sql

from lonnymq import NewMessage, Queue
from lonnymq.embedded import embedded_dsn
from lonnymq.errors import LonnyMQError, MessageNotFoundError, StaleMessageError

WORKER_SCRIPT = textwrap.dedent(
    """
    import os, sys, threading, time, uuid
    import psycopg
    from psycopg import sql
    from lonnymq import Queue
    from lonnymq.errors import MessageNotFoundError, StaleMessageError
    from lonnymq.worker import Backoff, Worker

    dsn, schema = sys.argv[1], sys.argv[2]
    lock_ms, nap_ms, concurrency = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    self_finish = sys.argv[6] == "1"
    s = sql.Identifier(schema)
    start = sql.SQL(
        "INSERT INTO {s}.soak_run"
        " (run_key, message_id, channel, attempt, pid, started_at, unlock_at)"
        " VALUES (%s, %s, %s, %s, %s, {s}.epoch(), %s) ON CONFLICT (run_key) DO NOTHING"
    ).format(s=s)
    end = sql.SQL(
        "UPDATE {s}.soak_run SET ended_at = {s}.epoch() WHERE run_key = %s AND ended_at IS NULL"
    ).format(s=s)
    finish = sql.SQL(
        "INSERT INTO {s}.soak_finish (message_id, attempt, pid) VALUES (%s, %s, %s)"
    ).format(s=s)
    refused = sql.SQL(
        "INSERT INTO {s}.soak_refused (message_id, attempt, pid) VALUES (%s, %s, %s)"
    ).format(s=s)
    PID = os.getpid()
    spare = []
    guard = threading.Lock()

    def record(statement, params):
        # Retried until the server answers (both statements may run twice), so that a run's
        # record never says less than the time the handler held its message.
        deadline = time.monotonic() + 120
        while True:
            with guard:
                conn = spare.pop() if spare else None
            try:
                if conn is None:
                    conn = psycopg.connect(dsn, autocommit=True, connect_timeout=5)
                conn.execute(statement, params)
            except psycopg.OperationalError:
                if conn is not None:
                    conn.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
                continue
            with guard:
                spare.append(conn)
            return

    def handler(message):
        key = uuid.uuid4().hex
        record(
            start,
            (key, message.id, message.channel, message.num_attempts, PID, message.unlock_at),
        )
        time.sleep(nap_ms / 1000)
        record(end, (key,))
        if self_finish and message.id % 2 == 0:
            # Finish it here, in one transaction with the record of who finished it; the
            # worker then finds it gone. A stale holder is refused: that is recorded too.
            try:
                with queue.transaction() as tx:
                    tx.execute(finish, (message.id, message.num_attempts, PID))
                    message.delete(conn=tx)
            except (MessageNotFoundError, StaleMessageError):
                with psycopg.connect(dsn, autocommit=True) as other:
                    other.execute(refused, (message.id, message.num_attempts, PID))

    queue = Queue(dsn, schema=schema)
    Worker(
        queue,
        handler,
        concurrency=concurrency,
        lock_ms=lock_ms,
        max_attempts=1_000,
        backoff=Backoff(base_ms=50, max_ms=500),
        grace_s=5,
    ).run()
    """
)

PRODUCER_SCRIPT = textwrap.dedent(
    """
    import random, sys, time
    from lonnymq import NewMessage, Queue
    from lonnymq.errors import LonnyMQError

    dsn, schema, index, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    batch, pause_s, names, out = int(sys.argv[5]), float(sys.argv[6]), sys.argv[7], sys.argv[8]
    names = names.split(",")
    rng = random.Random(index)
    typed = untyped = calls = 0
    made = 0
    with Queue(dsn, schema=schema, pool_size=2) as queue, open(out, "a") as acked:
        while made < count:
            size = 1 if calls % 4 == 0 else min(batch, count - made)
            items = [
                NewMessage(f"p{index}-{made + i}".encode(), channel=rng.choice(names))
                for i in range(size)
            ]
            calls += 1
            try:
                if size == 1:
                    ids = [queue.create(items[0].content, channel=items[0].channel).id]
                else:
                    ids = [r.id for r in queue.create_many(items)]
            except LonnyMQError:
                typed += 1  # the server is away: try again (a lost commit makes an extra)
                time.sleep(0.05)
                continue
            except Exception as err:
                untyped += 1
                print(f"UNTYPED {type(err).__name__}: {err}", file=sys.stderr, flush=True)
                time.sleep(0.05)
                continue
            acked.write("".join(f"{id_}\\n" for id_ in ids))
            acked.flush()
            made += size
            time.sleep(pause_s)
        acked.write(f"# typed={typed} untyped={untyped}\\n")
    """
)

SIDE_TABLE = """
CREATE TABLE {s}.soak_run (
    run_id BIGSERIAL PRIMARY KEY,
    run_key TEXT UNIQUE,
    message_id BIGINT NOT NULL,
    channel TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    pid INTEGER NOT NULL,
    started_at BIGINT NOT NULL,
    unlock_at BIGINT NOT NULL,
    ended_at BIGINT
);
CREATE TABLE {s}.soak_finish (
    message_id BIGINT NOT NULL,
    attempt INTEGER NOT NULL,
    pid INTEGER NOT NULL
);
CREATE TABLE {s}.soak_refused (
    message_id BIGINT NOT NULL,
    attempt INTEGER NOT NULL,
    pid INTEGER NOT NULL
)
"""


@dataclass(frozen=True)
class SoakConfig:
    """The soak's size and pace. With ``restart_every_s`` the server is restarted in
    immediate mode that often (at most ``max_restarts`` times) while ``producers`` create the
    messages over about ``produce_s`` seconds; without it they are all created up front."""

    messages: int = 3_000
    channels: int = 20
    workers: int = 3
    concurrency: int = 4
    kill_every_s: float = 1.0
    lock_ms: int = 1_500
    nap_ms: int = 3
    timeout_s: float = 600.0
    seed: int = 0
    restart_every_s: float | None = None
    max_restarts: int | None = None
    producers: int = 2
    produce_s: float = 10.0
    steal_every_s: float = 1.0


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
    restarts: int = 0
    unacknowledged: int = 0
    finished_twice: int = 0
    stale_finishes: int = 0
    stale_refused: int = 0
    untyped_errors: int = 0
    typed_errors: int = 0
    worker_deaths: int = 0
    worker_retries: int = 0
    outage_max_s: float = 0.0
    resume_max_s: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def line(self) -> str:
        text = (
            f"messages={self.messages} kills={self.kills} runs={self.runs} "
            f"redeliveries={self.redeliveries} violations={self.violations} lost={self.lost} "
            f"attempt_errors={self.attempt_errors} discrepancies={self.discrepancies} "
            f"elapsed={self.elapsed_s:.1f}s"
        )
        if self.restarts:
            text += (
                f" restarts={self.restarts} unacknowledged={self.unacknowledged} "
                f"finished_twice={self.finished_twice} stale_finishes={self.stale_finishes} "
                f"stale_refused={self.stale_refused} typed_errors={self.typed_errors} "
                f"untyped_errors={self.untyped_errors} worker_deaths={self.worker_deaths} "
                f"worker_retries={self.worker_retries} "
                f"outage_max={self.outage_max_s:.2f}s resume_max={self.resume_max_s:.2f}s"
            )
        return text


class Restarter(Protocol):
    """The server the soak restarts (``pgserver.RestartableServer``)."""

    def restart(self) -> float: ...


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
            "1" if config.restart_every_s else "0",
        ],
        stdout=subprocess.DEVNULL,
        stderr=log,
    )


class _Admin:
    """The driver's own connection, opened again after the server went away."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self._conn: psycopg.Connection[Any] | None = None

    def rows(
        self, query: sql.SQL | sql.Composed, params: Any = None, *, wait_s: float = 120
    ) -> list[Any]:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                if self._conn is None or self._conn.closed:
                    self._conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=5)
                cursor = self._conn.execute(query, params)
                return cursor.fetchall() if cursor.description is not None else []
            except psycopg.OperationalError:
                if self._conn is not None:
                    self._conn.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def count(self, query: sql.SQL | sql.Composed) -> int:
        rows = self.rows(query)
        return int(rows[0][0]) if rows else 0

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


def _finished(admin: _Admin, schema: str) -> int:
    return admin.count(sql.SQL("SELECT count(*) FROM {}.archive").format(sql.Identifier(schema)))


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


class _Thief:
    """A stale holder on purpose: dequeues a message with a short lock, waits until a worker
    dequeued it again, then tries to finish it (recorded like a handler's finish)."""

    def __init__(self, dsn: str, schema: str) -> None:
        self.queue = Queue(dsn, schema=schema, pool_size=2)
        self.admin = _Admin(dsn)
        self.s = sql.Identifier(schema)
        self.refused = 0
        self.accepted_stale = 0
        self.finished = 0
        self.thread: threading.Thread | None = None

    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def start(self) -> None:
        self.thread = threading.Thread(target=self._steal, daemon=True)
        self.thread.start()

    def _steal(self) -> None:
        s = self.s
        try:
            message = self.queue.dequeue(lock_ms=200)
            if message is None:
                return
            self.admin.rows(
                sql.SQL(
                    "INSERT INTO {s}.soak_run (run_key, message_id, channel, attempt, pid,"
                    " started_at, unlock_at) VALUES (%s, %s, %s, %s, 0, {s}.epoch(), %s)"
                    " ON CONFLICT (run_key) DO NOTHING"
                ).format(s=s),
                (
                    uuid.uuid4().hex,
                    message.id,
                    message.channel,
                    message.num_attempts,
                    message.unlock_at,
                ),
            )
            again = False
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and not again:
                rows = self.admin.rows(
                    sql.SQL("SELECT num_attempts FROM {s}.message WHERE id = %s").format(s=s),
                    (message.id,),
                )
                again = not rows or int(rows[0][0]) > message.num_attempts
                time.sleep(0.05)
            with self.queue.transaction() as tx:
                tx.execute(
                    sql.SQL(
                        "INSERT INTO {s}.soak_finish (message_id, attempt, pid) VALUES (%s, %s, 0)"
                    ).format(s=s),
                    (message.id, message.num_attempts),
                )
                message.delete(conn=tx)
            self.finished += 1
            if again:
                self.accepted_stale += 1
        except (MessageNotFoundError, StaleMessageError):
            self.refused += 1
        except (LonnyMQError, psycopg.Error):
            pass  # the server went away meanwhile (the raw INSERT raises psycopg's own error)

    def close(self) -> None:
        if self.thread is not None:
            self.thread.join(timeout=30)
        self.queue.close()
        self.admin.close()


def _spawn_producer(
    dsn: str, schema: str, config: SoakConfig, *, index: int, out: Path, log: Any
) -> subprocess.Popen[bytes]:
    count = config.messages // config.producers + (index < config.messages % config.producers)
    batch = 20
    pause_s = config.produce_s / max(1, count / batch)
    names = ",".join(channel_policies(config.channels))
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            PRODUCER_SCRIPT,
            dsn,
            schema,
            str(index),
            str(count),
            str(batch),
            f"{pause_s:.4f}",
            names,
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=log,
    )


def run_soak(
    dsn: str,
    schema: str,
    config: SoakConfig,
    *,
    say: Any = None,
    server: Restarter | None = None,
) -> SoakReport:
    """Run the soak on a fresh ``schema`` (left in place) and check the invariants. With
    ``config.restart_every_s``, ``server`` (the one ``dsn`` points at) is restarted."""
    restarting = config.restart_every_s is not None
    if restarting and server is None:
        raise ValueError("restart_every_s needs the server to restart")
    rng = random.Random(config.seed)
    report = SoakReport(messages=config.messages)
    s = sql.Identifier(schema)
    policies = channel_policies(config.channels)
    limits = {name: limit for name, (limit, _) in policies.items() if limit is not None}
    admin = _Admin(dsn)
    workdir = Path(tempfile.mkdtemp(prefix="lonnymq-soak-acks-"))
    outages: list[tuple[float, float]] = []  # (down, up), wall-clock ms
    with Queue(dsn, schema=schema) as queue:
        queue.install(archive=True)
        admin.rows(sql.SQL(SIDE_TABLE).format(s=s))
        for name, (limit, interval) in policies.items():
            if limit is not None or interval is not None:
                queue.channel(name).set_policy(max_concurrency=limit, release_interval_ms=interval)
        names = list(policies)
        created: set[int] = set()
        if not restarting:
            for first in range(0, config.messages, 1_000):
                batch = [
                    NewMessage(f"m{i}".encode(), channel=rng.choice(names))
                    for i in range(first, min(first + 1_000, config.messages))
                ]
                created.update(r.id for r in queue.create_many(batch) if r.id is not None)
            if len(created) != config.messages:
                report.problems.append(f"created {len(created)} of {config.messages}")

        started = time.monotonic()
        thief = _Thief(dsn, schema) if restarting else None
        with tempfile.TemporaryFile() as log:
            workers = [_spawn(dsn, schema, config, log) for _ in range(config.workers)]
            acks = [workdir / f"producer-{i}.acked" for i in range(config.producers)]
            producers = (
                [
                    _spawn_producer(dsn, schema, config, index=i, out=acks[i], log=log)
                    for i in range(config.producers)
                ]
                if restarting
                else []
            )
            try:
                next_kill = started + config.kill_every_s
                next_restart = started + (config.restart_every_s or 0.0)
                next_steal = started + config.steal_every_s
                while True:
                    if restarting:
                        left = admin.count(sql.SQL("SELECT count(*) FROM {s}.message").format(s=s))
                        if left == 0 and all(p.poll() is not None for p in producers):
                            break
                    elif _finished(admin, schema) >= config.messages:
                        break
                    now = time.monotonic()
                    if now - started > config.timeout_s:
                        report.problems.append(f"not finished after {config.timeout_s:.0f}s")
                        break
                    for i, proc in enumerate(workers):
                        if proc.poll() is not None:  # it died by itself
                            report.worker_deaths += 1
                            workers[i] = _spawn(dsn, schema, config, log)
                    if now >= next_kill:
                        victim = rng.randrange(len(workers))
                        os.kill(workers[victim].pid, signal.SIGKILL)
                        workers[victim].wait()
                        workers[victim] = _spawn(dsn, schema, config, log)
                        report.kills += 1
                        next_kill = now + config.kill_every_s * rng.uniform(0.5, 1.5)
                        if say is not None:
                            say(f"kill {report.kills}: {_finished(admin, schema)} finished")
                    if (
                        restarting
                        and server is not None
                        and now >= next_restart
                        and (config.max_restarts is None or report.restarts < config.max_restarts)
                    ):
                        down = time.time() * 1000
                        server.restart()
                        outages.append((down, time.time() * 1000))
                        report.restarts += 1
                        assert config.restart_every_s is not None
                        next_restart = time.monotonic() + config.restart_every_s * rng.uniform(
                            0.75, 1.25
                        )
                        if say is not None:
                            say(f"restart {report.restarts}: {_finished(admin, schema)} finished")
                    if thief is not None and not thief.busy() and now >= next_steal:
                        thief.start()
                        next_steal = now + config.steal_every_s
                    time.sleep(0.05)
            finally:
                for proc in [*workers, *producers]:
                    proc.send_signal(signal.SIGTERM)
                for proc in [*workers, *producers]:
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
                if thief is not None:
                    thief.close()
            report.elapsed_s = time.monotonic() - started
            log.seek(0)
            stderr = log.read().decode(errors="replace")
            report.untyped_errors = stderr.count("UNTYPED ") + stderr.count("Traceback")
            # The workers' own warnings: a dequeue or a report tried again after a lost server.
            report.worker_retries = stderr.count("retrying in") + stderr.count("trying again in")
            if report.untyped_errors:
                report.problems.append(f"{report.untyped_errors} untyped errors")
            if report.worker_deaths:
                report.problems.append(f"{report.worker_deaths} workers died by themselves")
            if not report.ok:
                report.problems.append(stderr[-4_000:])

        if restarting:
            created = _read_acks(acks, report)
            report.messages = len(created)
            assert thief is not None
            report.stale_refused = thief.refused
            if thief.accepted_stale:
                report.problems.append(f"{thief.accepted_stale} stale finishes were accepted")
            report.outage_max_s = max((up - down for down, up in outages), default=0.0) / 1000
            report.resume_max_s = _resume_max_s(admin, schema, outages)
        shutil.rmtree(workdir, ignore_errors=True)
        _check(admin, queue, schema=schema, created=created, limits=limits, report=report)
    admin.close()
    return report


def _read_acks(files: list[Path], report: SoakReport) -> set[int]:
    """The ids the producers saw acknowledged (their files), and their error counts."""
    acked: set[int] = set()
    finished = 0
    for path in files:
        for line in path.read_text().splitlines() if path.exists() else []:
            if line.startswith("# "):
                finished += 1
                counts = dict(part.split("=") for part in line[2:].split())
                report.typed_errors += int(counts["typed"])
                report.untyped_errors += int(counts["untyped"])
            elif line:
                acked.add(int(line))
    if finished != len(files):
        report.problems.append(f"{len(files) - finished} producers did not finish")
    return acked


def _resume_max_s(admin: _Admin, schema: str, outages: list[tuple[float, float]]) -> float:
    """The longest time from a restart's start to the first handler run after it."""
    longest = 0.0
    for down, _ in outages:
        rows = admin.rows(
            sql.SQL(
                "SELECT min(started_at) FROM {}.soak_run WHERE started_at > %s AND pid <> 0"
            ).format(sql.Identifier(schema)),
            (int(down),),
        )
        if rows and rows[0][0] is not None:
            longest = max(longest, (int(rows[0][0]) - down) / 1000)
    return longest


def _check(
    admin: _Admin,
    queue: Queue,
    *,
    schema: str,
    created: set[int],
    limits: dict[str, int],
    report: SoakReport,
) -> None:
    s = sql.Identifier(schema)
    archived = admin.rows(sql.SQL("SELECT id, outcome, num_attempts FROM {s}.archive").format(s=s))
    completed = {int(r[0]): int(r[2]) for r in archived if r[1] == "completed"}
    left = {int(r[0]) for r in admin.rows(sql.SQL("SELECT id FROM {s}.message").format(s=s))}
    report.lost = len(created - completed.keys()) + len(left & created)
    if report.lost:
        report.problems.append(f"{report.lost} messages lost or unfinished")
    report.finished_twice = len(archived) - len({int(r[0]) for r in archived})
    extra = completed.keys() - created
    if report.restarts:
        # Committed although the producer saw its call fail: finished too, never twice.
        report.unacknowledged = len(extra)
        extra = set()
    if len(archived) != len(completed) or extra:
        report.problems.append("archive rows other than one completion per created message")
    report.redeliveries = sum(n - 1 for n in completed.values())

    finishes = admin.rows(sql.SQL("SELECT message_id, attempt FROM {s}.soak_finish").format(s=s))
    by_message: dict[int, list[int]] = defaultdict(list)
    for message_id, attempt in finishes:
        by_message[int(message_id)].append(int(attempt))
    report.finished_twice += sum(len(a) - 1 for a in by_message.values())
    if report.finished_twice:
        report.problems.append(f"{report.finished_twice} messages finished twice")
    # A recorded finish was made by the holder of the message's last attempt.
    report.stale_finishes = sum(
        1 for id_, a in by_message.items() if completed.get(id_) not in (None, a[-1])
    )
    refused = admin.rows(sql.SQL("SELECT message_id, attempt FROM {s}.soak_refused").format(s=s))
    report.stale_refused += len(refused)
    # A refused holder really was stale: a later attempt finished the message.
    report.stale_finishes += sum(1 for id_, a in refused if completed.get(int(id_), 0) <= a)
    if report.stale_finishes:
        report.problems.append(f"{report.stale_finishes} finishes by or refusals of a wrong holder")

    runs = admin.rows(
        sql.SQL(
            "SELECT message_id, attempt, channel, started_at, unlock_at, ended_at FROM {s}.soak_run"
        ).format(s=s)
    )
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
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the schema afterwards (with --restart-every: the private server's data)",
    )
    parser.add_argument("--messages", type=int, default=defaults.messages)
    parser.add_argument("--channels", type=int, default=defaults.channels)
    parser.add_argument("--workers", type=int, default=defaults.workers)
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency)
    parser.add_argument("--kill-every", type=float, default=defaults.kill_every_s, help="s")
    parser.add_argument("--lock-ms", type=int, default=defaults.lock_ms)
    parser.add_argument("--nap-ms", type=int, default=defaults.nap_ms)
    parser.add_argument("--timeout", type=float, default=defaults.timeout_s, help="s")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--restart-every",
        type=float,
        help="s: restart a private server (not --dsn) in immediate mode that often",
    )
    parser.add_argument("--max-restarts", type=int)
    parser.add_argument("--producers", type=int, default=defaults.producers)
    parser.add_argument(
        "--produce-for", type=float, default=defaults.produce_s, help="s, with --restart-every"
    )
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
        restart_every_s=args.restart_every,
        max_restarts=args.max_restarts,
        producers=args.producers,
        produce_s=args.produce_for,
    )
    schema = args.schema or f"soak_{uuid.uuid4().hex[:12]}"
    say = None if args.quiet else (lambda text: print(text, file=sys.stderr, flush=True))
    with contextlib.ExitStack() as stack:
        server: Any = None
        if config.restart_every_s is not None:
            sys.path.insert(0, str(Path(__file__).parent))
            from pgserver import RestartableServer

            server = stack.enter_context(RestartableServer())
            dsn = server.dsn
        else:
            dsn = args.dsn or embedded_dsn(Path(tempfile.mkdtemp(prefix="lonnymq-soak-")) / "data")
        try:
            report = run_soak(dsn, schema, config, say=say, server=server)
        finally:
            if not args.keep and server is None:
                with psycopg.connect(dsn, autocommit=True) as conn:
                    conn.execute(
                        sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
                    )
    if server is not None and not args.keep:
        shutil.rmtree(server.data_dir.parent, ignore_errors=True)
    print(report.line(), flush=True)
    for problem in report.problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
