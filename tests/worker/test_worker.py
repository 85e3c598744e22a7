"""The Worker against a real PostgreSQL: policies, retries, failure, heartbeats, signals."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg import sql

from lonnymq import InvalidArgumentError, Message, NewMessage, Queue
from lonnymq.worker import Backoff, Worker


def _archive(admin: psycopg.Connection[Any], schema: str) -> list[tuple[Any, ...]]:
    query = sql.SQL(
        "SELECT id, channel, outcome, error, num_attempts FROM {}.archive ORDER BY id"
    ).format(sql.Identifier(schema))
    return admin.execute(query).fetchall()


def _locked(admin: psycopg.Connection[Any], schema: str) -> int:
    query = sql.SQL("SELECT count(*) FROM {}.message WHERE is_locked").format(
        sql.Identifier(schema)
    )
    row = admin.execute(query).fetchone()
    assert row is not None
    return int(row[0])


def test_worker_drains_channels_within_their_limits(make_queue: Callable[..., Queue]) -> None:
    queue = make_queue(archive=True, pool_size=8)
    queue.channel("one-at-a-time").set_policy(max_concurrency=1)
    queue.channel("two-at-a-time").set_policy(max_concurrency=2)
    channels = ["one-at-a-time", "two-at-a-time", "free-a", "free-b"]
    queue.create_many(
        [NewMessage(f"{c}-{i}".encode(), channel=c) for i in range(30) for c in channels]
    )
    lock = threading.Lock()
    running: Counter[str] = Counter()
    peak: Counter[str] = Counter()
    seen: Counter[int] = Counter()

    def handler(message: Message) -> None:
        with lock:
            running[message.channel] += 1
            peak[message.channel] = max(peak[message.channel], running[message.channel])
            seen[message.id] += 1
        time.sleep(0.002)
        with lock:
            running[message.channel] -= 1

    stats = Worker(queue, handler, concurrency=6, lock_ms=30_000).run(
        handle_signals=False, until_idle=True
    )
    assert stats.completed == 120
    assert len(seen) == 120
    assert set(seen.values()) == {1}
    assert peak["one-at-a-time"] == 1
    assert peak["two-at-a-time"] <= 2
    assert all(s.size == 0 for s in queue.stats())


def test_failing_handler_is_retried_with_backoff_then_archived_as_failed(
    make_queue: Callable[..., Queue], admin: psycopg.Connection[Any], schema_name: str
) -> None:
    queue = make_queue(archive=True)
    created = queue.create(b"doomed", channel="c")
    attempts: list[tuple[int, float]] = []

    def handler(message: Message) -> None:
        attempts.append((message.num_attempts, time.monotonic()))
        raise ValueError("boom")

    backoff = Backoff(base_ms=50, max_ms=1_000, jitter=False)
    stats = Worker(queue, handler, max_attempts=3, backoff=backoff).run(
        handle_signals=False, until_idle=True
    )
    assert [n for n, _ in attempts] == [1, 2, 3]
    # Backoff: 50 ms after the first failure, 100 ms after the second.
    gaps = [b - a for (_, a), (_, b) in itertools.pairwise(attempts)]
    assert gaps[0] >= 0.045
    assert gaps[1] >= 0.095
    assert (stats.retried, stats.failed) == (2, 1)
    [(message_id, channel, outcome, error, num_attempts)] = _archive(admin, schema_name)
    assert (message_id, channel, outcome, num_attempts) == (created.id, "c", "failed", 3)
    assert "ValueError: boom" in error
    assert queue.stats() == []


def test_exhausted_message_goes_to_the_dead_letter_channel(
    make_queue: Callable[..., Queue], admin: psycopg.Connection[Any], schema_name: str
) -> None:
    queue = make_queue(archive=True)
    queue.channel("dead").set_policy(max_concurrency=0)
    created = queue.create(b"poison", channel="work")
    seen: list[str] = []

    def handler(message: Message) -> None:
        seen.append(message.channel)
        raise RuntimeError("cannot")

    worker = Worker(queue, handler, max_attempts=2, dead_letter_channel="dead")
    stats = worker.run(handle_signals=False, until_idle=True)
    # The copy waits in the paused channel: until_idle ends with it there, never run.
    assert seen == ["work", "work"]
    assert (stats.retried, stats.dead_lettered, stats.completed) == (1, 1, 0)
    outcomes = [(row[0], row[1], row[2]) for row in _archive(admin, schema_name)]
    assert outcomes == [(created.id, "work", "failed")]
    [dead] = queue.stats()
    assert (dead.channel, dead.size, dead.in_flight) == ("dead", 1, 0)


@pytest.mark.parametrize("policy", [None, (None, 10), (1, None)])
def test_a_worker_refuses_a_dead_letter_channel_it_would_take_from(
    queue: Queue, policy: tuple[int | None, int | None] | None
) -> None:
    # Every channel is served: an unpaused dead-letter channel would hand each moved message
    # back to the handler that failed it.
    if policy is not None:
        queue.channel("dead").set_policy(max_concurrency=policy[0], max_size=policy[1])
    created = queue.create(b"m", channel="work")
    worker = Worker(queue, lambda m: None, dead_letter_channel="dead")
    with pytest.raises(InvalidArgumentError, match=r"pause it first.*max_concurrency=0"):
        worker.run(handle_signals=False, until_idle=True)
    assert [(s.channel, s.size, s.in_flight) for s in queue.stats() if s.size] == [("work", 1, 0)]
    taken = queue.dequeue(lock_ms=1_000)  # never taken by the refused worker
    assert taken is not None
    assert (taken.id, taken.num_attempts) == (created.id, 1)


def test_a_dead_letter_message_that_fails_for_good_is_not_moved_again(
    make_queue: Callable[..., Queue], admin: psycopg.Connection[Any], schema_name: str
) -> None:
    # Someone let the dead-letter channel run after the worker started: moving its messages
    # into their own channel would make a new message to fail each time.
    queue = make_queue(archive=True)
    queue.channel("dead").set_policy(max_concurrency=0)
    worker = Worker(queue, _always_fails, max_attempts=1, dead_letter_channel="dead", idle_ms=100)
    thread = threading.Thread(target=worker.run, kwargs={"handle_signals": False})
    thread.start()
    try:
        # Once the worker dequeues, it has checked that the channel was paused (unpaused
        # before that, run() refuses to start: a loaded machine got there first once).
        started = time.monotonic() + 30
        while not any(op.name == "message_settle" for op in queue.operation_stats()):
            assert thread.is_alive(), "run() ended before it dequeued"
            assert time.monotonic() < started, "the worker did not start"
            time.sleep(0.01)
        queue.channel("dead").clear_policy()
        created = queue.create(b"old poison", channel="dead")
        deadline = time.monotonic() + 30
        while worker.stats.failed == 0:
            assert time.monotonic() < deadline, "the dead letter was not failed"
            time.sleep(0.05)
    finally:
        worker.stop()
        thread.join(timeout=30)
    assert (worker.stats.failed, worker.stats.dead_lettered) == (1, 0)
    outcomes = [(row[0], row[1], row[2]) for row in _archive(admin, schema_name)]
    assert outcomes == [(created.id, "dead", "failed")]
    assert queue.stats() == []


def _always_fails(message: Message) -> None:
    raise RuntimeError("cannot")


def test_a_full_dead_letter_channel_keeps_the_message_until_it_has_room(
    make_queue: Callable[..., Queue], admin: psycopg.Connection[Any], schema_name: str
) -> None:
    queue = make_queue(archive=True)
    queue.channel("dead").set_policy(max_concurrency=0, max_size=0)
    created = queue.create(b"poison", channel="work")

    def handler(message: Message) -> None:
        raise RuntimeError("cannot")

    worker = Worker(queue, handler, max_attempts=1, lock_ms=200, dead_letter_channel="dead")
    thread = threading.Thread(target=worker.run, kwargs={"handle_signals": False})
    thread.start()
    try:
        attempts = sql.SQL("SELECT num_attempts FROM {}.message WHERE id = %s").format(
            sql.Identifier(schema_name)
        )
        deadline = time.monotonic() + 30
        # Refused by the full channel, the message comes back when its lock expires and the
        # worker tries to move it again: it is neither dropped nor failed meanwhile.
        while (admin.execute(attempts, (created.id,)).fetchone() or (0,))[0] < 3:
            assert time.monotonic() < deadline, "the message did not come back"
            time.sleep(0.05)
        assert _archive(admin, schema_name) == []
        assert worker.stats.dead_lettered == 0
        queue.channel("dead").set_policy(max_concurrency=0, max_size=1)
        while worker.stats.dead_lettered == 0:
            assert time.monotonic() < deadline, "the message was not moved once there was room"
            time.sleep(0.05)
    finally:
        worker.stop()
        thread.join(timeout=30)
    [(message_id, channel, outcome, _, _)] = _archive(admin, schema_name)
    assert (message_id, channel, outcome) == (created.id, "work", "failed")
    assert [(s.channel, s.size) for s in queue.stats()] == [("dead", 1)]


@pytest.mark.parametrize(("max_attempts", "outcome"), [(3, "completed"), (2, "failed")])
def test_each_yield_of_a_handler_uses_an_attempt(
    make_queue: Callable[..., Queue],
    admin: psycopg.Connection[Any],
    schema_name: str,
    max_attempts: int,
    outcome: str,
) -> None:
    queue = make_queue(archive=True)
    created = queue.create(b"job", channel="c")
    steps: list[bytes | None] = []

    def handler(message: Message) -> None:
        steps.append(message.state)
        if len(steps) < 3:  # yield twice, saving where it stopped; finish on the third run
            message.defer(state=b"step %d" % len(steps))

    stats = Worker(queue, handler, max_attempts=max_attempts).run(
        handle_signals=False, until_idle=True
    )
    [(message_id, _, archived, error, attempts)] = _archive(admin, schema_name)
    assert (message_id, archived, attempts) == (created.id, outcome, 3)
    if outcome == "completed":
        assert steps == [None, b"step 1", b"step 2"]
        assert stats.completed == 1
    else:
        assert steps == [None, b"step 1"]
        assert "attempt 3 exceeds max_attempts=2" in error
        assert "yielded by the handler" in error


def test_a_message_taken_again_while_its_yielding_run_reports_is_waited_for(
    make_queue: Callable[..., Queue], admin: psycopg.Connection[Any], schema_name: str
) -> None:
    """The handler yields (defer to now) and keeps running a little: the dequeue loop takes
    the message again meanwhile. The first run's end must not drop the second from the
    running set, or the second's lock is no longer renewed (it expires, and the message runs
    a third time), it takes no slot, and a stop does not wait for it."""
    queue = make_queue(archive=True)
    created = queue.create(b"job", channel="c")
    runs: list[int] = []

    def handler(message: Message) -> None:
        runs.append(message.num_attempts)
        if message.num_attempts == 1:
            message.defer()
            time.sleep(0.5)  # the loop, polling every 20 ms, takes the message again
        else:
            time.sleep(1.0)  # outlives its 300 ms lock unless heartbeats renew it

    worker = Worker(queue, handler, concurrency=2, idle_ms=20, lock_ms=300)
    stats = worker.run(handle_signals=False, until_idle=True)
    assert runs == [1, 2]
    assert stats.completed == 1
    [(message_id, _, outcome, _, attempts)] = _archive(admin, schema_name)
    assert (message_id, outcome, attempts) == (created.id, "completed", 2)


def test_long_handler_keeps_its_lock_through_heartbeats(
    make_queue: Callable[..., Queue], admin: psycopg.Connection[Any], schema_name: str
) -> None:
    queue = make_queue(archive=True)
    queue.create(b"slow")
    runs: list[int] = []

    def handler(message: Message) -> None:
        runs.append(message.num_attempts)
        time.sleep(1.5)  # three lock lengths

    other = make_queue(install=False)
    stolen: list[Message | None] = []

    def thief() -> None:
        # Two lock lengths into the handler's run (not the worker's start, slow when loaded).
        deadline = time.monotonic() + 30
        while not runs and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(1.0)
        stolen.append(other.dequeue(lock_ms=1_000))

    thread = threading.Thread(target=thief)
    thread.start()
    stats = Worker(queue, handler, lock_ms=500, heartbeat_ms=150).run(
        handle_signals=False, until_idle=True
    )
    thread.join()
    assert stolen == [None]  # the lock never expired, so nobody else got the message
    assert runs == [1]
    assert (stats.completed, stats.lost) == (1, 0)
    assert [row[4] for row in _archive(admin, schema_name)] == [1]


WORKER_SCRIPT = textwrap.dedent(
    """
    import sys, threading, time
    from lonnymq import Queue
    from lonnymq.worker import Worker

    dsn, schema, nap = sys.argv[1], sys.argv[2], float(sys.argv[3])
    queue = Queue(dsn, schema=schema)
    lock = threading.Lock()

    def handler(message):
        with lock:  # one whole line per start, whatever the threads do
            sys.stdout.write(f"start {message.id}\\n")
            sys.stdout.flush()
        time.sleep(nap)

    Worker(queue, handler, concurrency=2, lock_ms=2_000, grace_s=float(sys.argv[4])).run()
    print("stopped", flush=True)
    """
)


# The same with the AsyncWorker and a plain (non-async) handler, which it runs in a thread.
ASYNC_WORKER_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys, threading, time
    from lonnymq import AsyncQueue
    from lonnymq.worker import AsyncWorker

    dsn, schema, nap = sys.argv[1], sys.argv[2], float(sys.argv[3])
    lock = threading.Lock()

    def handler(message):
        with lock:
            sys.stdout.write(f"start {message.id}\\n")
            sys.stdout.flush()
        time.sleep(nap)

    async def main():
        async with AsyncQueue(dsn, schema=schema) as queue:
            worker = AsyncWorker(
                queue, handler, concurrency=2, lock_ms=2_000, grace_s=float(sys.argv[4])
            )
            await worker.run()

    asyncio.run(main())
    print("stopped", flush=True)
    """
)


def _spawn_worker(
    dsn: str, schema: str, nap: float, grace: float, script: str = WORKER_SCRIPT
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script, dsn, schema, str(nap), str(grace)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_starts(proc: subprocess.Popen[str], count: int) -> None:
    assert proc.stdout is not None
    started = 0
    while started < count:
        line = proc.stdout.readline()
        assert line, f"worker exited early: {proc.stderr.read() if proc.stderr else ''}"
        started += line.count("start")


@pytest.mark.slow
def test_sigterm_finishes_running_work_and_leaves_no_lock(
    dsn: str, make_queue: Callable[..., Queue], admin: psycopg.Connection[Any], schema_name: str
) -> None:
    queue = make_queue(archive=True)
    queue.create_many([NewMessage(f"m{i}".encode()) for i in range(10)])
    proc = _spawn_worker(dsn, schema_name, nap=0.3, grace=10.0)
    _wait_for_starts(proc, 2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "stopped" in out
    assert _locked(admin, schema_name) == 0
    finished = len(_archive(admin, schema_name))
    left = sum(s.size for s in queue.stats())
    assert finished >= 2  # the running handlers were allowed to finish
    assert finished + left == 10  # nothing lost


@pytest.mark.slow
@pytest.mark.parametrize("script", [WORKER_SCRIPT, ASYNC_WORKER_SCRIPT], ids=["sync", "async"])
def test_sigterm_gives_back_what_outlives_the_grace_period(
    dsn: str,
    make_queue: Callable[..., Queue],
    admin: psycopg.Connection[Any],
    schema_name: str,
    script: str,
) -> None:
    """The handlers outlive the grace period: their messages are given back and the process
    exits without waiting for them (were it to wait, their work would run twice: here and
    wherever the given-back messages go next)."""
    queue = make_queue(archive=True)
    queue.create_many([NewMessage(f"m{i}".encode()) for i in range(4)])
    proc = _spawn_worker(dsn, schema_name, nap=300.0, grace=0.2, script=script)
    try:
        _wait_for_starts(proc, 2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert _locked(admin, schema_name) == 0
    assert _archive(admin, schema_name) == []
    assert sum(s.size for s in queue.stats()) == 4


@pytest.mark.slow
def test_sigkill_loses_nothing(
    dsn: str, make_queue: Callable[..., Queue], admin: psycopg.Connection[Any], schema_name: str
) -> None:
    queue = make_queue()
    queue.create_many([NewMessage(f"m{i}".encode()) for i in range(4)])
    proc = _spawn_worker(dsn, schema_name, nap=30.0, grace=10.0)
    _wait_for_starts(proc, 2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    assert _locked(admin, schema_name) == 2  # held by the dead worker until they expire
    queue.set_clock_offset(5_000)  # past the 2 s locks
    back = queue.dequeue_many(10, lock_ms=60_000)
    attempts = sorted(m.num_attempts for m in back)
    assert len(back) == 4
    assert attempts == [1, 1, 2, 2]  # the two that were running count a new attempt


def test_worker_finishes_and_takes_the_next_message_in_one_call(
    make_queue: Callable[..., Queue],
) -> None:
    queue = make_queue(archive=True)
    queue.create_many([NewMessage(f"m{i}".encode(), channel=f"c{i % 3}") for i in range(40)])
    handled: list[int] = []
    worker = Worker(queue, lambda m: handled.append(m.id), concurrency=1)
    stats = worker.run(handle_signals=False, until_idle=True)
    calls = {op.name: op.calls for op in queue.operation_stats()}
    assert stats.completed == 40
    assert len(set(handled)) == len(handled) == 40
    # Every completion was reported by the call that took the next message (one slot: one
    # outcome a call), and a few calls more only took (the first) or found the queue empty.
    assert 40 <= calls.get("message_settle", 0) <= 43
    assert "message_delete" not in calls
    assert "message_dequeue_many" not in calls
    with psycopg.connect(queue.dsn) as admin:
        assert [row[2] for row in _archive(admin, queue.schema)] == ["completed"] * 40


def test_run_returns_once_its_maintenance_has_stopped(make_queue: Callable[..., Queue]) -> None:
    """The caller may close the queue as soon as run() returns: no maintain() is still
    under way on it then."""
    queue = make_queue()
    queue.create_many([NewMessage(b"x", channel=f"c{i}") for i in range(50)])
    worker = Worker(queue, lambda message: None, concurrency=4, maintenance_ms=10)
    stats = worker.run(until_idle=True, handle_signals=False)
    assert stats.completed == 50
    assert not [t for t in threading.enumerate() if t.name == "lonnymq-maint"]
