"""Many threads draining one queue at once: every message is delivered exactly once, none is
lost, and no channel ever has more messages in flight than its ``max_concurrency``.

The in-flight count is kept in Python under a lock: incremented right after a dequeue returns
and decremented right before the delete is sent. That window lies inside the time the database
holds the channel slot (from the dequeue's commit to the delete's commit), so a count above the
limit proves the database handed out more than it should have.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest

from lonnymq import AckStatus, CreateStatus, Message, NewMessage, Queue

LOCK_MS = 60_000  # no lock expires during a test: any second delivery is a double delivery
WORKERS = 8
CHANNELS = 20
MESSAGES = 3000
DEADLINE_S = 240.0
IDLE_S = 0.3

# c00..c03 one at a time, c04..c07 two at a time, the rest unlimited.
LIMITS: dict[str, int | None] = {
    f"c{i:02d}": (1 if i < 4 else 2 if i < 8 else None) for i in range(CHANNELS)
}


@dataclass
class Ledger:
    """What the workers saw, shared under one lock."""

    limits: dict[str, int | None]
    lock: threading.Lock = field(default_factory=threading.Lock)
    delivered: list[Message] = field(default_factory=list)
    seen: set[int] = field(default_factory=set)
    doubles: list[int] = field(default_factory=list)
    in_flight: Counter[str] = field(default_factory=Counter)
    peak: Counter[str] = field(default_factory=Counter)
    peak_total: int = 0
    over_limit: list[tuple[str, int]] = field(default_factory=list)
    order: defaultdict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    errors: list[BaseException] = field(default_factory=list)
    bad_acks: list[tuple[int, AckStatus]] = field(default_factory=list)
    counter_errors: list[tuple[str, int, int]] = field(default_factory=list)
    last_delivery: float = field(default_factory=time.monotonic)

    def took(self, messages: Sequence[Message]) -> None:
        with self.lock:
            self.last_delivery = time.monotonic()
            for message in messages:
                if message.id in self.seen:
                    self.doubles.append(message.id)
                self.seen.add(message.id)
                self.delivered.append(message)
                self.order[message.channel].append(message.id)
                self.in_flight[message.channel] += 1
                count = self.in_flight[message.channel]
                self.peak[message.channel] = max(self.peak[message.channel], count)
                self.peak_total = max(self.peak_total, self.in_flight.total())
                limit = self.limits.get(message.channel)
                if limit is not None and count > limit:
                    self.over_limit.append((message.channel, count))

    def releasing(self, messages: Sequence[Message]) -> None:
        with self.lock:
            for message in messages:
                self.in_flight[message.channel] -= 1


def _work(message: Message) -> None:
    """A little work: long enough for other threads to run in between."""
    if message.id % 7 == 0:
        time.sleep(0.002)


def _drain(
    queue: Queue,
    ledger: Ledger,
    *,
    batch: int,
    workers: int = WORKERS,
    producers_done: threading.Event | None = None,
) -> float:
    """Run ``workers`` threads until the queue is empty and nobody got a message for a while;
    returns the seconds it took."""
    stop = threading.Event()

    def worker() -> None:
        try:
            while not stop.is_set():
                if batch == 1:
                    message = queue.dequeue(lock_ms=LOCK_MS)
                    messages = [message] if message is not None else []
                else:
                    messages = queue.dequeue_many(batch, lock_ms=LOCK_MS)
                if not messages:
                    time.sleep(0.002)
                    continue
                ledger.took(messages)
                for message in messages:
                    _work(message)
                ledger.releasing(messages)
                if batch == 1:
                    messages[0].delete()
                else:
                    statuses = queue.delete_many(messages)
                    bad = [(m.id, s) for m, s in zip(messages, statuses, strict=True)]
                    bad = [(i, s) for i, s in bad if s is not AckStatus.OK]
                    if bad or len(statuses) != len(messages):
                        with ledger.lock:
                            ledger.bad_acks.extend(bad)
        except BaseException as err:
            with ledger.lock:
                ledger.errors.append(err)
            raise

    threads = [threading.Thread(target=worker, name=f"drain-{i}") for i in range(workers)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    try:
        while time.monotonic() - started < DEADLINE_S:
            time.sleep(0.05)
            if ledger.errors:
                break
            stats = queue.stats()
            # The database's own counters, sampled: never negative, never above the limit.
            ledger.counter_errors.extend(
                (s.channel, s.size, s.in_flight)
                for s in stats
                if s.in_flight < 0
                or s.in_flight > s.size
                or (s.policy.max_concurrency is not None and s.in_flight > s.policy.max_concurrency)
            )
            if producers_done is not None and not producers_done.is_set():
                continue
            with ledger.lock:
                idle = time.monotonic() - ledger.last_delivery
            if idle > IDLE_S and all(s.size == 0 and s.in_flight == 0 for s in stats):
                break
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads), "a worker thread hung"
    return time.monotonic() - started


def _set_policies(queue: Queue, limits: dict[str, int | None]) -> None:
    for name, limit in limits.items():
        if limit is not None:
            queue.channel(name).set_policy(max_concurrency=limit)


def _create(
    queue: Queue, count: int, channels: Sequence[str]
) -> tuple[dict[int, bytes], dict[int, str]]:
    """``count`` messages spread round-robin over ``channels``; id -> content, id -> channel."""
    items = [
        NewMessage(content=f"m{i}".encode(), channel=channels[i % len(channels)])
        for i in range(count)
    ]
    results = queue.create_many(items)
    assert [r.status for r in results] == [CreateStatus.CREATED] * count
    ids = [r.id for r in results]
    assert None not in ids
    pairs = [(i, item) for i, item in zip(ids, items, strict=True) if i is not None]
    return {i: item.content for i, item in pairs}, {i: item.channel or "" for i, item in pairs}


def _assert_exact_delivery(queue: Queue, ledger: Ledger, created: dict[int, bytes]) -> None:
    assert ledger.errors == []
    assert ledger.doubles == []
    assert ledger.bad_acks == []
    assert ledger.counter_errors == []
    assert ledger.over_limit == []
    assert set(ledger.in_flight.values()) <= {0}
    assert ledger.seen == set(created)
    assert len(ledger.delivered) == len(created)
    assert {m.id: m.content for m in ledger.delivered} == created
    assert {m.num_attempts for m in ledger.delivered} == {1}
    stats = queue.stats()
    assert [(s.size, s.in_flight, s.next_dequeue_at) for s in stats] == [(0, 0, None)] * len(stats)


def _make_drain_queue(make_queue: Callable[..., Queue]) -> Queue:
    return make_queue(pool_size=16)


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 10], ids=["dequeue", "dequeue_many_10"])
def test_parallel_drain_delivers_each_message_once_within_limits(
    make_queue: Callable[..., Queue], batch: int
) -> None:
    queue = _make_drain_queue(make_queue)
    _set_policies(queue, LIMITS)
    created, channels = _create(queue, MESSAGES, sorted(LIMITS))
    ledger = Ledger(limits=LIMITS)

    seconds = _drain(queue, ledger, batch=batch)
    print(
        f"\ndrained {len(ledger.delivered)} messages with batch {batch} in {seconds:.2f}s; "
        f"peak in flight per channel: {dict(sorted(ledger.peak.items()))}"
    )

    _assert_exact_delivery(queue, ledger, created)
    # Stats list exactly the channels that keep a policy; the others' rows are gone.
    assert [s.channel for s in queue.stats()] == sorted(n for n, m in LIMITS.items() if m)
    # The limits were never passed, and the workers did hold messages at the same time.
    for name, limit in LIMITS.items():
        if limit is not None:
            assert ledger.peak[name] <= limit
    assert ledger.peak_total > 1
    # A channel served one at a time gives its messages strictly in creation order.
    for name, limit in LIMITS.items():
        if limit == 1:
            assert ledger.order[name] == sorted(i for i in created if channels[i] == name)


@pytest.mark.slow
@pytest.mark.parametrize("limit", [None, 2], ids=["no_policy", "max_concurrency_2"])
def test_concurrent_producers_and_consumers_on_one_channel(
    make_queue: Callable[..., Queue], limit: int | None
) -> None:
    queue = _make_drain_queue(make_queue)
    limits: dict[str, int | None] = {"hot": limit}
    _set_policies(queue, limits)
    ledger = Ledger(limits=limits)
    created: dict[int, bytes] = {}
    created_lock = threading.Lock()
    producers_done = threading.Event()
    producer_errors: list[BaseException] = []
    per_producer = 300

    def producer(index: int) -> None:
        try:
            for n in range(per_producer):
                content = f"p{index}-{n}".encode()
                if index % 2 == 0:
                    result = queue.create(content, channel="hot")
                    pairs = [(result, content)]
                elif n % 10 == 0:
                    contents = [f"p{index}-{n}-{k}".encode() for k in range(10)]
                    results = queue.create_many(
                        [NewMessage(content=c, channel="hot") for c in contents]
                    )
                    pairs = list(zip(results, contents, strict=True))
                else:
                    continue
                for result, data in pairs:
                    assert result.status is CreateStatus.CREATED
                    assert result.id is not None
                    with created_lock:
                        created[result.id] = data
        except BaseException as err:
            producer_errors.append(err)
            raise

    producers = [threading.Thread(target=producer, args=(i,)) for i in range(4)]
    for thread in producers:
        thread.start()

    def wait_producers() -> None:
        for thread in producers:
            thread.join()
        producers_done.set()

    waiter = threading.Thread(target=wait_producers)
    waiter.start()
    seconds = _drain(queue, ledger, batch=1, workers=4, producers_done=producers_done)
    waiter.join()
    print(f"\nproduced and drained {len(created)} messages in {seconds:.2f}s")

    assert producer_errors == []
    assert len(created) == 4 * per_producer
    _assert_exact_delivery(queue, ledger, created)
    if limit is None:
        assert queue.stats() == []
    else:
        (stats,) = queue.stats()
        assert (stats.channel, stats.size, stats.in_flight) == ("hot", 0, 0)
        assert stats.policy.max_concurrency == limit
        assert ledger.peak["hot"] <= limit
