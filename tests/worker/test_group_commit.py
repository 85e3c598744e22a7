"""A worker's group commit: the outcomes of the handlers that returned are reported together,
in one call that also takes the next messages (``queue.settle``). Each outcome stays fenced
by its attempt, and an outcome waiting for its flush is never lost nor reported twice."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from lonnymq import AsyncQueue, NewMessage, Outcome, OutcomeKind, Queue
from lonnymq.errors import InvalidArgumentError
from lonnymq.schedule import SCHEDULE_CHANNEL
from lonnymq.types import AckStatus
from lonnymq.worker import AsyncWorker, Worker, WorkerStats

# Outcomes wait for a flush that nothing but a full batch or the end of every handler brings.
HOLD_FLUSH_MS = 10_000


class _Rows:
    """The test schema's rows as the admin reads them, in id order: (content, outcome,
    num_attempts) of the archive, (content, is_locked, num_attempts) of the message table."""

    def __init__(self, admin: psycopg.Connection[Any], schema: str) -> None:
        self.admin, self.schema = admin, schema

    def _read(self, table: str, column: str) -> list[tuple[bytes, Any, int]]:
        query = sql.SQL("SELECT content, {}, num_attempts FROM {} ORDER BY id").format(
            sql.Identifier(column), sql.Identifier(self.schema, table)
        )
        return [(bytes(row[0]), row[1], row[2]) for row in self.admin.execute(query).fetchall()]

    def archive(self) -> list[tuple[bytes, str, int]]:
        return self._read("archive", "outcome")

    def held(self) -> list[tuple[bytes, bool, int]]:
        return self._read("message", "is_locked")


@pytest.fixture
def rows(admin: psycopg.Connection[Any], schema_name: str) -> _Rows:
    return _Rows(admin, schema_name)


def _until(condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


# -- the settle call ---------------------------------------------------------------------------


def test_settle_reports_every_kind_of_outcome_and_takes_in_one_call(
    make_queue: Callable[..., Queue], rows: _Rows
) -> None:
    queue = make_queue(archive=True)
    queue.channel("dead").set_policy(max_concurrency=0)
    queue.create_many([NewMessage(f"m{i}".encode(), channel=f"c{i}") for i in range(5)])
    taken = sorted(queue.dequeue_many(5, lock_ms=60_000), key=lambda m: m.content)
    done, failed, later, dead, spare = taken
    queue.create(b"next", channel="n")
    queue.set_clock_offset(120_000)  # every lock expires: another consumer takes one
    stolen = queue.dequeue(lock_ms=60_000)
    queue.set_clock_offset(0)
    assert stolen is not None
    assert stolen.id == done.id  # the oldest expired lock first: the first taken
    at = queue.now() + 3_600_000
    batch = queue.settle(
        [
            Outcome.complete(spare),
            Outcome.fail(failed, error="boom"),
            Outcome.defer(later, dequeue_at=at, state=b"saved"),
            Outcome.dead_letter(dead, channel="dead", error="gave up"),
            Outcome.complete(done),  # its lock was lost: "done" was the one taken
        ],
        5,
        lock_ms=60_000,
    )
    assert batch.completed == [
        AckStatus.OK,
        AckStatus.OK,
        AckStatus.OK,
        AckStatus.OK,
        AckStatus.STALE,
    ]
    assert [m.content for m in batch.messages] == [b"next"]
    assert rows.archive() == [
        (b"m1", "failed", 1),
        (b"m3", "failed", 1),
        (b"m4", "completed", 1),
    ]
    held = {(content, locked, attempts) for content, locked, attempts in rows.held()}
    assert held == {(b"m0", True, 2), (b"m2", False, 1), (b"m3", False, 0), (b"next", True, 1)}
    assert queue.dequeue_many(10, lock_ms=60_000) == []  # "m2" waits an hour, "m3" is paused


def test_settle_leaves_a_dead_letter_whose_channel_is_full_held(
    make_queue: Callable[..., Queue], rows: _Rows
) -> None:
    queue = make_queue(archive=True)
    queue.channel("dead").set_policy(max_concurrency=0, max_size=1)
    queue.create(b"already", channel="dead")
    queue.create(b"poison", channel="work")
    message = queue.dequeue(lock_ms=60_000)
    assert message is not None
    batch = queue.settle([Outcome.dead_letter(message, channel="dead", error="x")], 0, lock_ms=1)
    assert batch.completed == [AckStatus.FULL]
    assert batch.messages == []
    assert rows.held() == [(b"already", False, 0), (b"poison", True, 1)]
    assert rows.archive() == []


def test_settle_refuses_bad_input_and_changes_nothing(queue: Queue) -> None:
    queue.create(b"m")
    message = queue.dequeue(lock_ms=60_000)
    assert message is not None
    with pytest.raises(InvalidArgumentError, match="limit"):
        queue.settle([Outcome.complete(message)], -1, lock_ms=60_000)
    with pytest.raises(InvalidArgumentError, match="outcome kind"):
        queue.settle([Outcome(message, "shelved")], lock_ms=60_000)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="Outcome"):
        queue.settle([message], lock_ms=60_000)  # type: ignore[list-item]
    with pytest.raises(InvalidArgumentError, match="error must be a str"):
        queue.settle([Outcome(message, OutcomeKind.FAILED)], lock_ms=60_000)
    with pytest.raises(InvalidArgumentError, match="dequeue_at must be an int"):
        queue.settle([Outcome.defer(message, dequeue_at="soon")], lock_ms=60_000)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="state must be bytes"):
        queue.settle([Outcome.defer(message, state="text")], lock_ms=60_000)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="reserved"):
        queue.settle(
            [Outcome.dead_letter(message, channel=SCHEDULE_CHANNEL, error="x")], lock_ms=60_000
        )
    [channel] = queue.stats()
    assert (channel.size, channel.in_flight) == (1, 1)
    assert queue.settle([Outcome.complete(message)], lock_ms=60_000).completed == [AckStatus.OK]


# -- a lost lock inside a flushed batch --------------------------------------------------------


def _run_worker(
    dsn: str, queue: Queue, handler: Callable[[Any], None], use_async: bool, **options: Any
) -> tuple[Callable[[], WorkerStats], Callable[[], None]]:
    """Start a Worker or AsyncWorker in a thread; return a join (its stats) and a stop."""
    box: dict[str, Any] = {}
    ready = threading.Event()
    if use_async:

        async def main() -> None:
            async with AsyncQueue(dsn, schema=queue.schema) as aqueue:
                worker = AsyncWorker(aqueue, handler, **options)
                loop = asyncio.get_running_loop()
                box["stop"] = lambda: loop.call_soon_threadsafe(worker.stop)
                ready.set()
                box["stats"] = await worker.run(handle_signals=False)

        thread = threading.Thread(target=lambda: asyncio.run(main()))
    else:
        worker = Worker(queue, handler, **options)
        box["stop"] = worker.stop

        def target() -> None:
            ready.set()
            box["stats"] = worker.run(handle_signals=False)

        thread = threading.Thread(target=target)
    thread.start()
    assert ready.wait(30)

    def join() -> WorkerStats:
        thread.join(60)
        assert not thread.is_alive()
        stats: WorkerStats = box["stats"]
        return stats

    stop: Callable[[], None] = box["stop"]
    return join, stop


@pytest.mark.parametrize("use_async", [False, True], ids=["Worker", "AsyncWorker"])
def test_a_lock_lost_before_its_batch_is_flushed_is_not_reported_done(
    dsn: str,
    make_queue: Callable[..., Queue],
    rows: _Rows,
    use_async: bool,
) -> None:
    """Three handlers return; their outcomes are flushed together. Before the flush, the
    first message's lock expired and another consumer took it: its outcome is refused (its
    attempt no longer holds it) and it stays with that consumer; the other two are finished."""
    queue = make_queue(archive=True)
    queue.create_many([NewMessage(name, channel=name.decode()) for name in (b"a", b"b", b"c")])
    thief = make_queue(install=False)
    stolen: list[int] = []

    def handler(message: Any) -> None:
        if message.content == b"a":
            # Every lock expires for a moment: the oldest one ("a") goes to another consumer.
            queue.set_clock_offset(120_000)
            taken = thief.dequeue(lock_ms=600_000)
            queue.set_clock_offset(0)
            assert taken is not None
            stolen.append(taken.id)

    join, stop = _run_worker(
        dsn,
        queue,
        handler,
        use_async,
        concurrency=3,
        lock_ms=60_000,
        flush_ms=HOLD_FLUSH_MS,
        batch_size=3,
        idle_ms=100,
    )
    try:
        _until(lambda: len(rows.archive()) == 2, "the batch was not flushed")
    finally:
        stop()
    stats = join()
    assert (stats.completed, stats.lost) == (2, 0)
    assert sorted(rows.archive()) == [(b"b", "completed", 1), (b"c", "completed", 1)]
    assert rows.held() == [(b"a", True, 2)]  # the other consumer's
    assert len(stolen) == 1


# -- a crash, and SIGTERM, while outcomes wait for their flush ---------------------------------

WORKER = (
    """
import sys, threading, time
from pathlib import Path
from lonnymq import Queue
from lonnymq.worker import Worker

dsn, schema, grace, release = sys.argv[1], sys.argv[2], float(sys.argv[3]), Path(sys.argv[4])
printing = threading.Lock()

def say(line):
    with printing:  # two handlers' lines, never mixed
        print(line, flush=True)

def handler(message):
    say("start " + message.content.decode())
    if message.content == b"slow":
        while not release.exists():  # the test's signal, never in the crash test
            time.sleep(0.01)
    say("returned " + message.content.decode())

with Queue(dsn, schema=schema) as queue:
    stats = Worker(queue, handler, concurrency=2, lock_ms=2_000, grace_s=grace,
                   flush_ms=FLUSH_MS, batch_size=2, idle_ms=100).run()
    print("stopped", stats.completed, stats.given_back, flush=True)
"""
).replace("FLUSH_MS", str(HOLD_FLUSH_MS))


def _spawn(dsn: str, schema: str, grace: float, tmp_path: Path) -> subprocess.Popen[str]:
    """The worker of ``WORKER``; its "slow" handler returns once ``tmp_path / "release"``
    exists. Its log goes to a file (a pipe nobody reads would block it once full)."""
    with (tmp_path / "worker.log").open("w") as log:
        return subprocess.Popen(
            [sys.executable, "-c", WORKER, dsn, schema, str(grace), str(tmp_path / "release")],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )


def _wait_for_lines(proc: subprocess.Popen[str], wanted: set[str], tmp_path: Path) -> None:
    assert proc.stdout is not None
    seen: set[str] = set()
    while not wanted <= seen:
        line = proc.stdout.readline()
        assert line, f"worker exited early: {(tmp_path / 'worker.log').read_text()}"
        seen.add(line.strip())


@pytest.mark.slow
def test_a_crash_before_the_flush_brings_the_message_back_and_reports_it_once(
    dsn: str,
    make_queue: Callable[..., Queue],
    rows: _Rows,
    schema_name: str,
    tmp_path: Path,
) -> None:
    """The "fast" handler has returned and its outcome waits for the flush (the "slow" one
    still runs) when the worker is killed: nothing was reported, the message comes back once
    its lock expires, runs again, and is finished exactly once."""
    queue = make_queue(archive=True)
    queue.create_many([NewMessage(b"fast", channel="f"), NewMessage(b"slow", channel="s")])
    proc = _spawn(dsn, schema_name, 10.0, tmp_path)  # "slow" is never released
    try:
        _wait_for_lines(proc, {"returned fast", "start slow"}, tmp_path)
        assert rows.archive() == []  # waiting for the flush
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
    assert rows.held() == [(b"fast", True, 1), (b"slow", True, 1)]
    queue.set_clock_offset(5_000)  # past the dead worker's 2 s locks
    ran: list[bytes] = []
    stats = Worker(queue, lambda m: ran.append(m.content), concurrency=2).run(
        handle_signals=False, until_idle=True
    )
    assert sorted(ran) == [b"fast", b"slow"]
    assert stats.completed == 2
    assert sorted(rows.archive()) == [
        (b"fast", "completed", 2),
        (b"slow", "completed", 2),
    ]
    assert rows.held() == []


@pytest.mark.slow
@pytest.mark.parametrize("outlives_grace", [False, True], ids=["finishes", "outlives"])
def test_sigterm_flushes_the_waiting_outcomes_and_gives_back_the_rest(
    make_queue: Callable[..., Queue],
    rows: _Rows,
    schema_name: str,
    tmp_path: Path,
    outlives_grace: bool,
) -> None:
    """SIGTERM while the "fast" outcome waits for its flush: it is reported, and the "slow"
    message is finished when its handler returns within the grace period, or given back
    (unlocked, its attempt kept) when it does not. Nothing is lost, nothing is left locked."""
    queue = make_queue(archive=True)
    queue.create_many([NewMessage(b"fast", channel="f"), NewMessage(b"slow", channel="s")])
    proc = _spawn(queue.dsn, schema_name, 1.0 if outlives_grace else 60.0, tmp_path)
    try:
        _wait_for_lines(proc, {"returned fast", "start slow"}, tmp_path)
        proc.send_signal(signal.SIGTERM)
        if not outlives_grace:
            (tmp_path / "release").touch()
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == 0, (tmp_path / "worker.log").read_text()
    if outlives_grace:
        assert "stopped 1 1" in out
        assert rows.archive() == [(b"fast", "completed", 1)]
        assert rows.held() == [(b"slow", False, 1)]
    else:
        assert "stopped 2 0" in out
        assert sorted(rows.archive()) == [
            (b"fast", "completed", 1),
            (b"slow", "completed", 1),
        ]
        assert rows.held() == []
