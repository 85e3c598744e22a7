"""An idle worker's dequeues while a due message sits in a channel another transaction holds."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from lonnymq import AsyncMessage, AsyncQueue, Message, Queue
from lonnymq.worker import AsyncWorker, Worker
from lonnymq.worker._policy import EMPTY_SLEEP_MAX_MS, clock_offset, sleep_ms

HELD_S = 1.5


def _dequeue_calls(queue: Queue | AsyncQueue) -> int:
    return sum(s.calls for s in queue.operation_stats() if s.name == "message_settle")


def _run_in_thread(
    dsn: str, queue: Queue, handler: Callable[[Any], None], use_async: bool
) -> tuple[threading.Thread, Callable[[], int], Callable[[], None]]:
    """Start a worker with a long ``idle_ms`` in a thread; return it, a count of its dequeue
    calls and a stop."""
    ready = threading.Event()
    box: dict[str, Any] = {}
    if use_async:

        async def main() -> None:
            async with AsyncQueue(dsn, schema=queue.schema) as aqueue:
                worker = AsyncWorker(aqueue, handler, concurrency=2, idle_ms=5_000)
                loop = asyncio.get_running_loop()
                box["queue"] = aqueue
                box["stop"] = lambda: loop.call_soon_threadsafe(worker.stop)
                ready.set()
                await worker.run(handle_signals=False)

        thread = threading.Thread(target=lambda: asyncio.run(main()))
    else:
        worker = Worker(queue, handler, concurrency=2, idle_ms=5_000)
        box["queue"] = queue
        box["stop"] = worker.stop

        def target() -> None:
            ready.set()
            worker.run(handle_signals=False)

        thread = threading.Thread(target=target)
    thread.start()
    assert ready.wait(30)
    return thread, lambda: _dequeue_calls(box["queue"]), box["stop"]


@pytest.mark.parametrize("use_async", [False, True], ids=["Worker", "AsyncWorker"])
def test_an_idle_worker_backs_off_while_a_due_channel_is_held(
    dsn: str, queue: Queue, use_async: bool
) -> None:
    """A policy change left open in a transaction holds a due channel's row and its policy
    lock: each dequeue passes the channel and answers "nothing, due now". The worker must
    not call again in a loop for as long as the transaction lasts, and must take the message
    once it ends."""
    queue.create(b"waits", channel="held")
    queue.channel("held").set_policy(max_concurrency=2)
    taken = threading.Event()

    def handler(message: Message | AsyncMessage) -> None:
        taken.set()

    with queue.transaction() as tx:
        queue.channel("held").set_policy(max_concurrency=3, conn=tx)
        thread, calls, stop = _run_in_thread(dsn, queue, handler, use_async)
        try:
            time.sleep(HELD_S)
            while_held = calls()
            assert not taken.is_set()
        except BaseException:
            stop()
            raise
    try:
        # Sleeps double from 1 ms to 100 ms: about 8 calls in the first 0.13 s, then ten a
        # second. Calling again at once made hundreds.
        assert 2 <= while_held <= 8 + HELD_S * 1000 / EMPTY_SLEEP_MAX_MS + 10, while_held
        assert taken.wait(30), "the worker did not take the message once the row was free"
    finally:
        stop()
        thread.join(60)
    assert not thread.is_alive()


def test_the_sleep_after_due_now_answers_in_a_row_doubles_to_its_cap_and_resets() -> None:
    now = 1_000_000
    empties = 0
    sleeps = []
    for _ in range(10):
        wait, empties = sleep_ms(now, now, 5_000, empties)
        sleeps.append(wait)
    assert sleeps == [0, 1, 2, 4, 8, 16, 32, 64, 100, 100]
    assert sleep_ms(now, now, 50, empties) == (50, 11)  # never past idle_ms
    # A retry_at up to 2 ms ahead of the worker's clock estimate is still "due now".
    assert sleep_ms(now + 2, now, 5_000, 3) == (4, 4)
    assert sleep_ms(now + 2, now, 5_000, 0) == (2, 1)
    # A message due later: sleep until then, not longer, and the count starts over (after
    # an idle spell next to a far-future message, one due 30 ms after a wake-up was taken
    # 80 ms late; a worker losing the race for a channel's next slot, 10 ms apart, would
    # have woken later and later); nothing at all: idle_ms.
    assert sleep_ms(now + 30, now, 5_000, 8) == (30, 0)
    assert sleep_ms(now + 10, now, 5_000, 8) == (10, 0)
    assert sleep_ms(now + 60_000, now, 5_000, 8) == (5_000, 0)
    assert sleep_ms(None, now, 5_000, empties) == (5_000, 0)


def test_the_clock_offset_comes_from_the_reading_with_the_shortest_round_trip() -> None:
    # The first reading waited 100 ms for a connection before it was sent: its middle is
    # 50 ms before the server read its clock.
    waited = (1_000.0, 1_000_100, 1_000.1005)
    quick = (2_000.0, 2_000_000 + 7, 2_000.001)
    assert clock_offset([waited, quick]) == 7
    assert clock_offset([waited]) == 1_000_100 - 1_000_050
