"""Schedules fired by workers, wait(), events() and the archive, on a real PostgreSQL.

Time moves with ``set_clock_offset`` (whole minutes), never with sleeps.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from psycopg import sql

from lonnymq import Message, NewMessage, Queue
from lonnymq.errors import (
    InvalidArgumentError,
    InvalidChannelError,
    InvalidPolicyError,
    StaleMessageError,
)
from lonnymq.schedule import SCHEDULE_CHANNEL
from lonnymq.worker import Worker

MINUTE = 60_000


def _run_workers(queue: Queue, count: int, seen: list[bytes]) -> None:
    lock = threading.Lock()

    def handler(message: Message) -> None:
        with lock:
            seen.append(message.content)

    workers = [Worker(queue, handler, concurrency=2, idle_ms=50) for _ in range(count)]
    threads = [
        threading.Thread(target=w.run, kwargs={"handle_signals": False, "until_idle": True})
        for w in workers
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive()


def _one_second_into_a_minute(queue: Queue) -> int:
    """Set the queue's clock offset so that its now is one second past a minute boundary;
    returns that offset."""
    now = queue.set_clock_offset(0)
    offset = 1_000 - now % MINUTE
    queue.set_clock_offset(offset)
    return offset


def test_schedule_fires_once_per_period_across_competing_workers_and_restarts(
    make_queue: Callable[..., Queue],
) -> None:
    queue = make_queue(archive=True)
    # The queue's clock starts a second into a minute, so the first firing is 59 s away
    # whatever the wall clock says (a real minute boundary must not fire it mid-test).
    start = _one_second_into_a_minute(queue)
    assert queue.schedule("tick", cron="* * * * *", content=b"tick", channel="ticks") is True
    seen: list[bytes] = []
    _run_workers(queue, 2, seen)  # nothing is due yet
    assert seen == []
    for minute in (1, 2, 3):
        # Each round is a fresh start of two competing workers, one period later.
        queue.set_clock_offset(start + minute * MINUTE)
        _run_workers(queue, 2, seen)
        assert seen == [b"tick"] * minute
    # Ten periods missed while nothing ran: one firing, not a burst.
    queue.set_clock_offset(start + 13 * MINUTE)
    _run_workers(queue, 2, seen)
    assert seen == [b"tick"] * 4
    [schedule] = queue.schedules()
    assert (schedule.name, schedule.cron, schedule.channel) == ("tick", "* * * * *", "ticks")
    assert schedule.last_fired_at is not None
    assert schedule.next_at == schedule.last_fired_at + MINUTE
    assert not schedule.firing


def test_a_stale_driver_holder_fires_nothing(make_queue: Callable[..., Queue]) -> None:
    queue = make_queue()
    queue.schedule("s", cron="* * * * *", content=b"job", channel="jobs")
    queue.set_clock_offset(MINUTE + 500)
    stale = queue.dequeue(lock_ms=1_000)
    assert stale is not None
    assert stale.channel == SCHEDULE_CHANNEL
    # Its lock expires; another worker takes the driver and fires it.
    queue.set_clock_offset(MINUTE + 2_000)
    fresh = queue.dequeue(lock_ms=10_000)
    assert fresh is not None
    assert fresh.id == stale.id
    assert queue.fire_schedule(fresh).fire_at is not None
    with pytest.raises(StaleMessageError):
        queue.fire_schedule(stale)  # rolled back: no second task
    jobs = [s for s in queue.stats() if s.channel == "jobs"]
    assert [s.size for s in jobs] == [1]


def test_a_schedule_changed_while_it_fires_moves_to_its_new_times(
    make_queue: Callable[..., Queue],
) -> None:
    # The firing worker deferred the driver with the spec it had taken: a yearly schedule
    # changed to every five minutes during its 1 January firing waited a year.
    queue = make_queue()
    real_now = queue.set_clock_offset(0)
    queue.set_clock_offset(_at("2026-06-01") - real_now)
    queue.schedule("report", cron="0 0 1 1 *", content=b"run", channel="jobs")
    queue.set_clock_offset(_at("2027-01-01") + 30_000 - real_now)
    held = queue.dequeue(lock_ms=30_000)
    assert held is not None
    assert held.channel == SCHEDULE_CHANNEL
    assert queue.schedule("report", cron="*/5 * * * *", content=b"run", channel="jobs") is False
    # The change counts from its moment (after the 00:00 time): the firing in progress rolls
    # back, and the schedule waits for 00:05.
    with pytest.raises(StaleMessageError):
        queue.fire_schedule(held)
    assert [s.channel for s in queue.stats() if s.channel == "jobs"] == []
    [schedule] = queue.schedules()
    assert (schedule.cron, schedule.next_at) == ("*/5 * * * *", _at("2027-01-01") + 5 * MINUTE)
    queue.set_clock_offset(_at("2027-01-01") + 5 * MINUTE + 1_000 - real_now)
    seen: list[bytes] = []
    _run_workers(queue, 1, seen)
    assert seen == [b"run"]


def test_garbage_in_the_schedule_channel_is_failed_not_looped(
    make_queue: Callable[..., Queue], admin: psycopg.Connection[Any]
) -> None:
    queue = make_queue()
    # The Python API refuses that channel (below); SQL callers can still write there.
    admin.execute(
        sql.SQL("SELECT {}.message_create(%s, %s)").format(sql.Identifier(queue.schema)),
        [b"not a spec", SCHEDULE_CHANNEL],
    )
    stats = Worker(queue, lambda m: None).run(handle_signals=False, until_idle=True)
    assert stats.failed == 1
    assert queue.stats() == []


def test_messages_cannot_be_created_in_the_schedule_channel(
    make_queue: Callable[..., Queue],
) -> None:
    queue = make_queue()
    queue.create(b"x", channel="work")
    held = queue.dequeue(lock_ms=60_000)
    assert held is not None
    for attempt in (
        lambda: queue.create(b"x", channel=SCHEDULE_CHANNEL),
        lambda: queue.channel(SCHEDULE_CHANNEL).create(b"x"),
        lambda: queue.create_many([NewMessage(b"a"), NewMessage(b"x", channel=SCHEDULE_CHANNEL)]),
        lambda: queue.dead_letter(held, channel=SCHEDULE_CHANNEL, error="boom"),
    ):
        with pytest.raises(InvalidChannelError, match="reserved for schedules"):
            attempt()
    assert [(s.channel, s.size, s.in_flight) for s in queue.stats()] == [("work", 1, 1)]
    assert queue.schedules() == []


def test_a_schedule_declared_again_unchanged_still_fires_when_due(
    make_queue: Callable[..., Queue],
) -> None:
    """Workers were down across a due time (a deploy); the new deployment declares its
    schedules again at start, unchanged, before a worker runs: the due firing still fires.
    Before, the declaration moved the driver to the next time and the firing was lost."""
    queue = make_queue()
    assert queue.schedule("hourly", cron="0 * * * *", content=b"run", channel="jobs") is True
    [before] = queue.schedules()
    queue.set_clock_offset(before.next_at + 10 * MINUTE - queue.now())
    assert queue.schedule("hourly", cron="0 * * * *", content=b"run", channel="jobs") is False
    [kept] = queue.schedules()
    assert kept.next_at == before.next_at
    stats = Worker(queue, lambda m: None).run(handle_signals=False, until_idle=True)
    assert (stats.fired, stats.completed) == (1, 1)
    [fired] = queue.schedules()
    assert fired.last_fired_at == before.next_at
    # Changed, it counts from now: the next time of the new expression.
    assert queue.schedule("hourly", cron="30 * * * *", content=b"run", channel="jobs") is False
    [changed] = queue.schedules()
    assert changed.cron == "30 * * * *"
    assert 0 < changed.next_at - queue.now() <= 60 * MINUTE


def test_schedule_update_list_and_remove(make_queue: Callable[..., Queue]) -> None:
    queue = make_queue()
    assert queue.schedule("a", cron="0 * * * *", content=b"1") is True
    assert queue.schedule("a", cron="*/5 * * * *", content=b"2", channel="x") is False
    queue.schedule("b", cron="0 0 * * *", content=b"3")
    listed = {s.name: s for s in queue.schedules()}
    assert sorted(listed) == ["a", "b"]
    a = listed["a"]
    assert (a.cron, a.content, a.channel) == ("*/5 * * * *", b"2", "x")
    # The update moved the driver to the new expression's next time.
    now = queue.now()
    assert listed["a"].next_at - now <= 5 * MINUTE
    assert queue.unschedule("a") is True
    assert queue.unschedule("a") is False
    assert [s.name for s in queue.schedules()] == ["b"]
    assert queue.unschedule("b") is True
    assert queue.stats() == []  # the reserved channel left no row behind


def _at(text: str) -> int:
    return int(datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp() * 1000)


@pytest.mark.parametrize(
    ("cron", "first", "second"),
    [
        # 1 February on a Sunday: schedule() hit an assert (nothing in the five years it
        # searched); a leap day on a Sunday: refused as "never fires".
        ("0 0 */31 2 sun", "2032-02-01", "2037-02-01"),
        ("0 0 29 2 */7", "2032-02-29", "2060-02-29"),
    ],
)
def test_a_schedule_years_apart_is_set_fires_and_waits_years_again(
    make_queue: Callable[..., Queue], cron: str, first: str, second: str
) -> None:
    queue = make_queue()
    real_now = queue.set_clock_offset(0)
    queue.set_clock_offset(_at("2026-06-01") - real_now)
    assert queue.schedule("rare", cron=cron, content=b"run", channel="jobs") is True
    [schedule] = queue.schedules()
    assert schedule.next_at == _at(first)
    queue.set_clock_offset(_at(first) + 1_000 - real_now)
    seen: list[bytes] = []
    _run_workers(queue, 1, seen)
    assert seen == [b"run"]
    [schedule] = queue.schedules()
    assert (schedule.last_fired_at, schedule.next_at) == (_at(first), _at(second))


def test_schedule_bad_input(queue: Queue) -> None:
    with pytest.raises(InvalidArgumentError, match="cron"):
        queue.schedule("x", cron="not cron", content=b"")
    with pytest.raises(InvalidArgumentError, match="schedule name"):
        queue.schedule("", cron="* * * * *", content=b"")
    with pytest.raises(InvalidArgumentError, match="schedule name"):
        queue.schedule("n" * 201, cron="* * * * *", content=b"")
    with pytest.raises(InvalidArgumentError, match="reserved"):
        queue.schedule("x", cron="* * * * *", content=b"", channel=SCHEDULE_CHANNEL)
    with pytest.raises(InvalidChannelError):
        queue.schedule("x", cron="* * * * *", content=b"", channel="")
    with pytest.raises(InvalidArgumentError, match="bytes"):
        queue.schedule("x", cron="* * * * *", content="text")  # type: ignore[arg-type]
    assert queue.schedules() == []


def test_wait_returns_when_the_message_finishes(make_queue: Callable[..., Queue]) -> None:
    queue = make_queue(archive=True)
    created = queue.create(b"w")
    assert created.id is not None
    assert queue.wait(created.id, timeout=0.05) is None  # still waiting
    message = queue.dequeue(lock_ms=10_000)
    assert message is not None
    timer = threading.Timer(0.2, lambda: message.fail(error="nope"))
    timer.start()
    outcome = queue.wait(created.id, timeout=10)
    timer.join()
    assert outcome is not None
    assert (outcome.status, outcome.outcome, outcome.error, outcome.num_attempts) == (
        "finished",
        "failed",
        "nope",
        1,
    )
    assert queue.message_status(created.id).done
    with pytest.raises(InvalidArgumentError):
        queue.wait(0)
    with pytest.raises(InvalidArgumentError, match="timeout"):
        queue.wait(created.id, timeout=-1)


def test_events_iterates_what_the_queue_publishes(make_queue: Callable[..., Queue]) -> None:
    queue = make_queue(event_channel="ev_test")
    events = queue.events(timeout=30)
    received = []
    stop = threading.Event()

    def produce() -> None:
        # events() listens from its first iteration on: on a loaded machine that may come
        # after a first create, so create again until one is seen.
        while not stop.wait(0.2):
            queue.create(b"e", channel="evc")

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        for event in events:
            received.append(event)
            break
    finally:
        stop.set()
        producer.join()
    assert [(e.type, e.channel) for e in received] == [("created", "evc")]


def test_events_need_an_event_channel(queue: Queue) -> None:
    with pytest.raises(InvalidArgumentError, match="events are off"):
        next(iter(queue.events(timeout=0.1)))


def test_archive_lists_failures_and_replays_each_once(make_queue: Callable[..., Queue]) -> None:
    queue = make_queue(archive=True)
    for content in (b"ok", b"bad"):
        queue.create(content, channel="arc")
        message = queue.dequeue(lock_ms=10_000)
        assert message is not None
        if content == b"bad":
            message.fail(error="broken")
        else:
            message.delete()
    failed = queue.archived(outcome="failed")
    assert [(a.content, a.error, a.replayed_as) for a in failed] == [(b"bad", "broken", None)]
    assert len(queue.archived()) == 2
    assert len(queue.archived(channel="other")) == 0
    [result] = queue.replay([failed[0].id])
    assert result.status == "replayed"
    assert result.id is not None
    again = queue.replay([failed[0].id, 999_999])
    assert [(r.status, r.id) for r in again] == [("already", result.id), ("not_found", None)]
    replayed = queue.dequeue(lock_ms=10_000)
    assert replayed is not None
    assert (replayed.id, replayed.content, replayed.num_attempts) == (result.id, b"bad", 1)
    with pytest.raises(InvalidArgumentError):
        queue.archived(limit=0)
    with pytest.raises(InvalidArgumentError):
        queue.replay("1")  # type: ignore[arg-type]


def test_a_firing_into_a_full_channel_waits_for_room(make_queue: Callable[..., Queue]) -> None:
    """The task's channel is at its max_size: nothing fires, the time is not recorded as fired,
    and the driver comes back within a second to fire it once there is room."""
    queue = make_queue()
    queue.channel("jobs").set_policy(max_size=1)
    queue.create(b"already there", channel="jobs", dequeue_at=queue.now() + 3_600_000)
    queue.schedule("s", cron="* * * * *", content=b"job", channel="jobs")
    offset = _one_second_into_a_minute(queue) + MINUTE
    queue.set_clock_offset(offset)
    driver = queue.dequeue(lock_ms=10_000)
    assert driver is not None
    assert driver.channel == SCHEDULE_CHANNEL
    firing = queue.fire_schedule(driver)
    assert firing.full
    assert firing.fire_at is not None
    assert firing.next_at <= queue.now() + 1_000
    [schedule] = queue.schedules()
    assert schedule.last_fired_at is None
    # Room again: the next turn fires that same time.
    queue.channel("jobs").set_policy(max_size=2)
    queue.set_clock_offset(offset + 1_500)
    again = queue.dequeue(lock_ms=10_000)
    assert again is not None
    assert again.id == driver.id
    fired = queue.fire_schedule(again)
    assert (fired.full, fired.fire_at) == (False, firing.fire_at)
    [jobs] = [s for s in queue.stats() if s.channel == "jobs"]
    assert jobs.size == 2
    assert queue.schedules()[0].last_fired_at == firing.fire_at


def test_a_schedule_declared_in_a_full_schedules_channel_is_refused_by_its_policy(
    queue: Queue,
) -> None:
    """A max_size on the schedules' channel that leaves no room for a new schedule is a
    policy refusal (InvalidPolicyError, naming it), not a conflict to run again; nothing is
    changed."""
    queue.schedule("kept", cron="0 * * * *", content=b"k")
    queue.channel(SCHEDULE_CHANNEL).set_policy(max_size=1)
    with pytest.raises(InvalidPolicyError, match=r"lonnymq\.schedules is full"):
        queue.schedule("nightly", cron="0 3 * * *", content=b"x")
    assert [s.name for s in queue.schedules()] == ["kept"]
    queue.channel(SCHEDULE_CHANNEL).clear_policy()
    assert queue.schedule("nightly", cron="0 3 * * *", content=b"x") is True


def test_two_transactions_declaring_schedules_queue_up_instead_of_deadlocking(
    queue: Queue, dsn: str
) -> None:
    """A transaction declaring s1 then s2 beside another declaring s1: they queue up (in an
    earlier design the second waited for s1's key holding the schedules channel's row, which
    the first then needed for s2: a deadlock)."""
    far = 10**14
    search_path = sql.SQL("SET search_path = {}").format(sql.Identifier(queue.schema))
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(search_path)
        admin.execute("SELECT * FROM schedule_set('s2', 'spec', %s)", (far,))
    errors: list[BaseException] = []
    with psycopg.connect(dsn) as first:
        first.execute(search_path)
        first.execute("SELECT * FROM schedule_set('s1', 'spec', %s)", (far + 1,))

        def declare_s1() -> None:
            try:
                with psycopg.connect(dsn, autocommit=True) as second:
                    second.execute(search_path)
                    second.execute("SELECT * FROM schedule_set('s1', 'spec', 0)")
            except psycopg.Error as err:
                errors.append(err)

        other = threading.Thread(target=declare_s1)
        other.start()
        # The other declaration is waiting (for the first transaction) before going on.
        _waiting_for_a_lock(dsn, first.info.backend_pid, "%schedule_set('s1', 'spec', 0)%")
        first.execute("SELECT * FROM schedule_set('s2', 'spec2', 0)")
        first.commit()
        other.join(timeout=30)
    assert errors == []
    with psycopg.connect(dsn) as conn:
        drivers = conn.execute(
            sql.SQL(
                "SELECT dedup_key, content FROM {}.message WHERE channel = %s ORDER BY 1"
            ).format(sql.Identifier(queue.schema)),
            [SCHEDULE_CHANNEL],
        ).fetchall()
    assert drivers == [("s1", b"spec"), ("s2", b"spec2")]


def _waiting_for_a_lock(dsn: str, blocker_pid: int, *patterns: str) -> None:
    """Return once a session running a query like one of ``patterns`` waits for a lock held by
    backend ``blocker_pid`` (only such a one: another client of the server, a second test run,
    may run the same query)."""
    deadline = time.monotonic() + 30
    likes = " OR ".join(["query LIKE %s"] * len(patterns))
    with psycopg.connect(dsn, autocommit=True) as watcher:
        while watcher.execute(
            "SELECT EXISTS (SELECT FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            f" AND %s = ANY(pg_blocking_pids(pid)) AND ({likes}))",
            [blocker_pid, *patterns],
        ).fetchone() != (True,):
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_a_policy_then_a_schedule_in_one_transaction_beside_a_declaration(
    queue: Queue, dsn: str
) -> None:
    """A transaction setting the schedules channel's policy (its lock, exclusive) and then
    declaring, beside another declaration: the other waits for the policy before the
    declarations' own lock, not while holding it."""
    search_path = sql.SQL("SET search_path = {}").format(sql.Identifier(queue.schema))
    errors: list[BaseException] = []

    def declare_y() -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as other:
                other.execute(search_path)
                other.execute("SELECT * FROM schedule_set('y', 'spec', 100000000000000)")
        except psycopg.Error as err:
            errors.append(err)

    with psycopg.connect(dsn) as first:
        first.execute(search_path)
        first.execute("SELECT channel_policy_set(%s, NULL, NULL, 100)", [SCHEDULE_CHANNEL])
        thread = threading.Thread(target=declare_y)
        thread.start()
        _waiting_for_a_lock(dsn, first.info.backend_pid, "%schedule_set('y'%")
        try:
            first.execute("SELECT * FROM schedule_set('x', 'spec', 100000000000000)")
            first.commit()
        except psycopg.Error as err:
            errors.append(err)
        thread.join(timeout=30)
    assert errors == []


def test_a_removal_then_a_declaration_beside_two_declarations(queue: Queue, dsn: str) -> None:
    """schedule_remove (sql/schema/70_schedule.sql) takes the declarations' lock too (it locks a
    driver's row)."""
    search_path = sql.SQL("SET search_path = {}").format(sql.Identifier(queue.schema))
    far = 10**14
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(search_path)
        for name in ("s1", "s2", "s3"):
            admin.execute("SELECT * FROM schedule_set(%s, 'spec', %s)", (name, far))
    errors: list[BaseException] = []
    with psycopg.connect(dsn) as first, psycopg.connect(dsn) as second:
        first.execute(search_path)
        second.execute(search_path)
        first.commit()
        second.commit()
        first.execute("SELECT * FROM schedule_set('s2', 'spec2', %s)", (far,))

        def remove_then_declare() -> None:
            try:
                second.execute("SELECT schedule_remove('s1')")
                second.execute("SELECT * FROM schedule_set('s3', 'spec3', %s)", (far,))
                second.commit()
            except psycopg.Error as err:
                errors.append(err)

        thread = threading.Thread(target=remove_then_declare)
        thread.start()
        _waiting_for_a_lock(dsn, first.info.backend_pid, "%schedule_set('s3'%", "%schedule_remove%")
        try:
            first.execute("SELECT * FROM schedule_set('s1', 'spec1', %s)", (far,))
            first.commit()
        except psycopg.Error as err:
            errors.append(err)
        thread.join(timeout=30)
    assert errors == []
