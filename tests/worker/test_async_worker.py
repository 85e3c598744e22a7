"""AsyncWorker against a real PostgreSQL: same decisions as Worker, handlers as tasks."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable

import pytest

from lonnymq import AsyncMessage, AsyncQueue, NewMessage, Queue
from lonnymq.errors import InvalidArgumentError
from lonnymq.worker import AsyncWorker, Backoff, WorkerStats


def test_async_worker_drains_within_limits_and_retries_then_dead_letters(
    dsn: str, make_queue: Callable[..., Queue]
) -> None:
    sync = make_queue(archive=True)
    sync.channel("solo").set_policy(max_concurrency=1)
    sync.channel("dead").set_policy(max_concurrency=0)
    sync.create_many(
        [NewMessage(f"{c}-{i}".encode(), channel=c) for i in range(15) for c in ("solo", "free")]
    )
    sync.create(b"poison", channel="free")

    async def main() -> tuple[Counter[str], list[int], WorkerStats]:
        running: Counter[str] = Counter()
        peak: Counter[str] = Counter()
        poison_attempts: list[int] = []

        async def handler(message: AsyncMessage) -> None:
            if message.content == b"poison":
                poison_attempts.append(message.num_attempts)
                raise RuntimeError("poisoned")
            running[message.channel] += 1
            peak[message.channel] = max(peak[message.channel], running[message.channel])
            await asyncio.sleep(0.002)
            running[message.channel] -= 1

        async with AsyncQueue(dsn, schema=sync.schema) as queue:
            worker = AsyncWorker(
                queue,
                handler,
                concurrency=5,
                max_attempts=2,
                backoff=Backoff(base_ms=20, max_ms=20, jitter=False),
                dead_letter_channel="dead",
            )

            stats = await worker.run(handle_signals=False, until_idle=True)
        return peak, poison_attempts, stats

    peak, poison_attempts, stats = asyncio.run(main())
    assert peak["solo"] == 1
    assert poison_attempts == [1, 2]
    assert (stats.completed, stats.retried, stats.dead_lettered) == (30, 1, 1)
    # The poison's copy waits in the paused dead-letter channel.
    assert [(s.channel, s.size) for s in sync.stats() if s.size] == [("dead", 1)]


def test_async_worker_refuses_a_dead_letter_channel_it_would_take_from(
    dsn: str, queue: Queue
) -> None:
    queue.create(b"m", channel="work")

    async def main() -> None:
        async with AsyncQueue(dsn, schema=queue.schema) as aqueue:
            worker = AsyncWorker(aqueue, lambda m: None, dead_letter_channel="dead")
            await worker.run(handle_signals=False, until_idle=True)

    with pytest.raises(InvalidArgumentError, match="pause it first"):
        asyncio.run(main())
    assert [(s.channel, s.size, s.in_flight) for s in queue.stats()] == [("work", 1, 0)]


def test_async_worker_runs_plain_functions_in_threads(
    dsn: str, make_queue: Callable[..., Queue]
) -> None:
    sync = make_queue()
    sync.create_many([NewMessage(b"a"), NewMessage(b"b")])
    seen: list[bytes] = []

    async def main() -> WorkerStats:
        async with AsyncQueue(dsn, schema=sync.schema) as queue:
            return await AsyncWorker(queue, lambda m: seen.append(m.content)).run(
                handle_signals=False, until_idle=True
            )

    stats = asyncio.run(main())
    assert sorted(seen) == [b"a", b"b"]
    assert stats.completed == 2


def test_async_worker_keeps_long_handlers_locked_and_gives_back_on_stop(
    dsn: str, make_queue: Callable[..., Queue]
) -> None:
    sync = make_queue()
    sync.create(b"long")

    async def main() -> tuple[AsyncMessage | None, WorkerStats]:
        async with AsyncQueue(dsn, schema=sync.schema) as queue:
            started = asyncio.Event()

            async def handler(message: AsyncMessage) -> None:
                started.set()
                await asyncio.sleep(30)

            worker = AsyncWorker(queue, handler, lock_ms=300, heartbeat_ms=100, grace_s=0.1)
            running = asyncio.create_task(worker.run(handle_signals=False))
            await started.wait()
            await asyncio.sleep(0.8)  # more than two lock lengths
            thief = await queue.dequeue(lock_ms=1_000)
            worker.stop()
            return thief, await running

    thief, stats = asyncio.run(main())
    assert thief is None  # heartbeats kept the lock
    assert stats.given_back == 1
    [channel] = sync.stats()
    assert (channel.size, channel.in_flight) == (1, 0)


def test_async_worker_keeps_renewing_a_message_taken_again_while_its_yielding_run_reports(
    dsn: str, make_queue: Callable[..., Queue]
) -> None:
    """As the Worker's test: the first run yields (defer to now) and keeps running; the loop
    takes the message again; the second run, longer than its lock, must keep its heartbeats."""
    sync = make_queue()
    sync.create(b"job", channel="c")

    async def main() -> tuple[list[int], WorkerStats]:
        runs: list[int] = []

        async def handler(message: AsyncMessage) -> None:
            runs.append(message.num_attempts)
            if message.num_attempts == 1:
                await message.defer()
                await asyncio.sleep(0.5)
            else:
                await asyncio.sleep(1.0)

        async with AsyncQueue(dsn, schema=sync.schema) as queue:
            worker = AsyncWorker(queue, handler, concurrency=2, idle_ms=20, lock_ms=300)
            stats = await worker.run(handle_signals=False, until_idle=True)
        return runs, stats

    runs, stats = asyncio.run(main())
    assert runs == [1, 2]
    assert stats.completed == 1
    assert sync.stats() == []


def test_async_worker_refuses_bad_options(dsn: str) -> None:
    queue = AsyncQueue(dsn, schema="unused")
    with pytest.raises(InvalidArgumentError, match="concurrency"):
        AsyncWorker(queue, lambda m: None, concurrency=0)
    with pytest.raises(InvalidArgumentError, match="callable"):
        AsyncWorker(queue, 5)  # type: ignore[arg-type]


def test_async_worker_finishes_and_takes_the_next_message_in_one_call(
    dsn: str, make_queue: Callable[..., Queue]
) -> None:
    sync = make_queue()
    sync.create_many([NewMessage(f"m{i}".encode(), channel=f"c{i % 3}") for i in range(30)])

    async def main() -> tuple[WorkerStats, dict[str, int]]:
        async def handler(message: AsyncMessage) -> None:
            await asyncio.sleep(0)

        async with AsyncQueue(dsn, schema=sync.schema) as queue:
            stats = await AsyncWorker(queue, handler, concurrency=1).run(
                handle_signals=False, until_idle=True
            )
            return stats, {op.name: op.calls for op in queue.operation_stats()}

    stats, calls = asyncio.run(main())
    assert stats.completed == 30
    # Every completion was reported by the call that took the next message: one call per
    # message, and a few more that only took (the first) or found the queue empty.
    assert 30 <= calls.get("message_settle", 0) <= 33
    assert "message_delete" not in calls
    assert "message_dequeue_many" not in calls
    assert all(s.size == 0 for s in sync.stats())


def test_async_worker_reuses_its_handler_threads(
    dsn: str, make_queue: Callable[..., Queue]
) -> None:
    """Plain-function handlers run in at most ``concurrency`` threads, reused from message to
    message: thread-local state a handler sets up (a client session, say) lasts. (For a while
    each message got a thread of its own.)"""
    sync = make_queue()
    sync.create_many([NewMessage(b"m%d" % i) for i in range(200)])
    local = threading.local()
    setups: list[str] = []

    def handler(message: AsyncMessage) -> None:
        if not hasattr(local, "session"):
            local.session = threading.current_thread().name
            setups.append(local.session)

    async def main() -> WorkerStats:
        async with AsyncQueue(dsn, schema=sync.schema) as queue:
            worker = AsyncWorker(queue, handler, concurrency=4, idle_ms=20)
            return await worker.run(handle_signals=False, until_idle=True)

    stats = asyncio.run(main())
    assert stats.completed == 200
    assert 1 <= len(setups) <= 4


def test_a_plain_handler_raising_stopiteration_fails_its_message(
    dsn: str, make_queue: Callable[..., Queue]
) -> None:
    """``next(iter([]))`` in a handler fails the message like any other exception. (A future
    cannot hold StopIteration: the failure was lost, and the run hung with the message's lock
    renewed by the heartbeats for ever.)"""
    sync = make_queue()
    sync.create(b"m")

    def handler(message: AsyncMessage) -> None:
        next(iter([]))

    async def main() -> WorkerStats:
        async with AsyncQueue(dsn, schema=sync.schema) as queue:
            worker = AsyncWorker(queue, handler, max_attempts=1, idle_ms=20, grace_s=0.5)
            task = asyncio.create_task(worker.run(handle_signals=False, until_idle=True))
            done, _ = await asyncio.wait([task], timeout=5)
            if not done:
                worker.stop()
                await task
                raise AssertionError(f"the run never ended; {task.result()}")
            return task.result()

    stats = asyncio.run(main())
    assert stats.failed == 1
