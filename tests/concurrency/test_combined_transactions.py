"""Creates and policy operations combined in one transaction, two such transactions at once
(docs/guide/transactions.md, "What to combine": "Safe in one transaction").

Every ``create`` holds its channel's advisory lock in shared mode until commit (and the
channel's row too when the channel has a policy); a policy operation takes that lock in
exclusive mode, then the row. So on one channel the policy operation must come first: a
transaction that creates and then sets the policy has to turn its shared lock into an
exclusive one, and two of them wait for each other.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from lonnymq import AsyncQueue, Queue, TransactionConflictError

sys.path.insert(0, str(Path(__file__).parent))
from lock_helpers import in_thread, wait_until_blocked


def _outcome(conn: psycopg.Connection[Any], steps: Callable[[], object]) -> str:
    """Run ``steps`` in ``conn``'s transaction; commit, or roll back what raised a conflict."""
    try:
        steps()
    except TransactionConflictError as err:
        conn.rollback()
        return f"conflict {err.sqlstate}"
    conn.commit()
    return "committed"


@pytest.mark.parametrize("had_policy", [False, True], ids=["policy-free", "with a policy"])
def test_policy_before_create_on_one_channel_is_safe(
    dsn: str, queue: Queue, admin: psycopg.Connection[Any], had_policy: bool
) -> None:
    """A: set_policy(a); B: set_policy(a), waits for A; A: create(a), commits; B: create(a),
    commits. A already holds the channel's lock exclusively, so its create waits for no one."""
    if had_policy:
        queue.channel("a").set_policy(max_size=100)
    queue.create(b"seed", channel="a")
    with psycopg.connect(dsn) as a, psycopg.connect(dsn) as b:

        def b_steps() -> None:
            queue.channel("a").set_policy(max_size=52, conn=b)
            queue.create(b"from b", channel="a", conn=b)

        queue.channel("a").set_policy(max_size=51, conn=a)
        thread, out = in_thread(lambda: _outcome(b, b_steps))
        wait_until_blocked(admin, b.info.backend_pid)
        assert _outcome(a, lambda: queue.create(b"from a", channel="a", conn=a)) == "committed"
        thread.join(timeout=60)
        assert out == ["committed"]
    [stats] = queue.stats()
    assert (stats.channel, stats.size, stats.policy.max_size) == ("a", 3, 52)
    assert queue.verify() == []


@pytest.mark.parametrize("had_policy", [False, True], ids=["policy-free", "with a policy"])
def test_create_before_policy_on_one_channel_deadlocks(
    dsn: str, queue: Queue, admin: psycopg.Connection[Any], had_policy: bool
) -> None:
    """A: create(a); B: create(a) and set_policy(a), which waits for A's shared lock (for a
    channel with a policy, B's create already waits for A's row); A: set_policy(a), which
    waits for B's shared lock. PostgreSQL rolls one back; the other commits."""
    if had_policy:
        queue.channel("a").set_policy(max_size=100)
    queue.create(b"seed", channel="a")
    with psycopg.connect(dsn) as a, psycopg.connect(dsn) as b:

        def b_steps() -> None:
            queue.create(b"from b", channel="a", conn=b)
            queue.channel("a").set_policy(max_size=52, conn=b)

        queue.create(b"from a", channel="a", conn=a)
        thread, out = in_thread(lambda: _outcome(b, b_steps))
        wait_until_blocked(admin, b.info.backend_pid)
        mine = _outcome(a, lambda: queue.channel("a").set_policy(max_size=51, conn=a))
        thread.join(timeout=60)
        assert sorted([mine, *out]) == ["committed", "conflict 40P01"]
    [stats] = queue.stats()
    assert stats.size == 2
    assert queue.verify() == []


def _wait_for_a_waiting_policy_set(admin: psycopg.Connection[Any], holder_pid: int) -> None:
    """Return once a set_policy waits for a lock behind ``holder_pid`` (only such a one:
    another client of the server, a second test run, may be setting a policy too)."""
    deadline = time.monotonic() + 30
    while not admin.execute(
        "SELECT FROM pg_stat_activity WHERE state = 'active' AND wait_event_type = 'Lock'"
        " AND %s = ANY(pg_blocking_pids(pid)) AND query LIKE '%%channel_policy_set%%'",
        [holder_pid],
    ).fetchall():
        assert time.monotonic() < deadline, "no set_policy waited for a lock"
        time.sleep(0.01)


def _a_deadlocked_policy_set_runs_again(
    dsn: str, queue: Queue, admin: psycopg.Connection[Any], set_policy: Callable[[], object]
) -> None:
    """``set_policy`` (a pooled max_size=7 on channel a, in a thread) meets a transaction that
    holds the channel's row and then asks for the channel's lock: PostgreSQL rolls back the one
    that waited first, the set_policy. It runs again, and completes once the other ends."""
    queue.create(b"m", channel="a")
    with psycopg.connect(dsn) as holder:
        # The set_policy's deadlock check (after the default second) finds the cycle first.
        holder.execute("SET deadlock_timeout = '30s'")
        holder.execute(
            sql.SQL("SELECT FROM {}.channel WHERE name = 'a' FOR UPDATE").format(
                sql.Identifier(queue.schema)
            )
        )
        thread, out = in_thread(set_policy)
        _wait_for_a_waiting_policy_set(admin, holder.info.backend_pid)
        holder.execute(
            sql.SQL("SELECT pg_advisory_xact_lock_shared({}.channel_key('a'))").format(
                sql.Identifier(queue.schema)
            )
        )
        # The set_policy was rolled back and runs again, now waiting behind the holder.
        assert not out, out
        _wait_for_a_waiting_policy_set(admin, holder.info.backend_pid)
        assert thread.is_alive()
        holder.commit()
        thread.join(timeout=60)
    assert out == [None]
    stats = queue.channel("a").stats()
    assert stats is not None
    assert (stats.size, stats.policy.max_size) == (1, 7)
    assert queue.verify() == []


def test_a_pooled_operation_rolled_back_by_a_deadlock_runs_again(
    dsn: str, queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    """Nothing of the rolled-back set_policy was kept (its own transaction), so the queue runs
    it again (it raised TransactionConflictError before)."""
    _a_deadlocked_policy_set_runs_again(
        dsn, queue, admin, lambda: queue.channel("a").set_policy(max_size=7)
    )


def test_an_async_pooled_operation_rolled_back_by_a_deadlock_runs_again(
    dsn: str, queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    """The same through AsyncQueue, whose pause between the runs is an asyncio sleep: it
    sleeps in no thread of the loop's default executor (one that refuses to fails the test)."""

    class NoSleeps(ThreadPoolExecutor):
        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
            if fn is time.sleep or time.sleep in getattr(fn, "args", ()):
                raise AssertionError("time.sleep in a thread of the default executor")
            return super().submit(fn, *args, **kwargs)

    async def set_policy() -> None:
        asyncio.get_running_loop().set_default_executor(NoSleeps())
        async with AsyncQueue(dsn, schema=queue.schema) as aqueue:
            await aqueue.channel("a").set_policy(max_size=7)

    _a_deadlocked_policy_set_runs_again(dsn, queue, admin, lambda: asyncio.run(set_policy()))
