"""The worker shape of ``lonnymq bench``: a ``Worker``, an ``AsyncWorker`` and the durable
floor, each serving a backlog that a producer keeps at ``BACKLOG`` messages over ``CHANNELS``
channels, with a handler that sleeps ``HANDLER_S`` (1 ms), at several concurrencies.

Each run is measured twice, with the consumer running throughout:

- *saturated*: the producer tops the waiting messages up to ``BACKLOG`` with ``create_many``
  (the durable floor: one ``INSERT`` of as many rows). The completion rate is counted in the
  queue's table (messages created minus messages left), and pickup latency (the message's
  creation to its handler's start) is the time a message waits behind the backlog;
- *paced*: the producer creates at half the saturated rate, once the backlog has drained:
  pickup latency, of the messages created while measured (what was left of the backlog
  does not count), is then what a worker that keeps up adds.

The durable floor is driven the same way from Python: one connection whose loop finishes the
messages whose 1 ms has passed and locks one for every free slot, in one plain statement per
call, as soon as at least one has finished (the least a queue that locks then finishes can
do with this many in flight), and polls every millisecond when it has nothing in flight; the
lonnymq queue publishes events, so that an idle worker is woken by the next create. The
producer, the consumer and the handlers share one process, as an application's would.
"""

from __future__ import annotations

import asyncio
import statistics
import struct
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext, suppress
from typing import Any

import psycopg
from psycopg import sql

from .queue import Queue
from .queue_async import AsyncQueue
from .types import NewMessage

__all__ = [
    "BACKLOG",
    "CHANNELS",
    "CONSUMERS",
    "HANDLER_S",
    "Consumer",
    "Load",
    "Pickups",
    "describe",
    "measure_consumer",
    "percentiles",
    "run_worker_shape",
    "since_ms",
    "stamp",
    "threadsafe",
]

BACKLOG = 4_000
"""Messages the producer keeps waiting while saturating."""
CHANNELS = 100
HANDLER_S = 0.001
"""What each handler does: sleep 1 ms."""
LOCK_MS = 60_000
CONSUMERS = ("Worker", "AsyncWorker", "durable floor")
POOL_CAP = 32
"""A worker's pool: its concurrency, at most this, plus 4 (the server takes 100 connections)."""
PACE = 0.5
"""The paced phase creates at this share of the saturated rate."""
STARTUP_S = 60.0
"""How long a consumer may take from its start to its first handler."""
PACED_GRACE_S = 1.0
"""After the paced window, how long the handlers of the messages created in it may still start
and count."""
DRAIN_WAITS = 10
"""The paced phase waits for the backlog to drain for at most this many measuring periods
(then measures anyway, and says it had not kept up)."""

_STAMP = struct.Struct("<d")


def stamp() -> bytes:
    return _STAMP.pack(time.time())


def since_ms(content: bytes) -> float:
    """ms from the creation stamped in ``content`` to now."""
    created: float = _STAMP.unpack(bytes(content[:8]))[0]
    return 1000 * (time.time() - created)


class Pickups:
    """What handlers report as they start: each one's pickup latency (ms, from its message's
    creation), with the wall-clock time it was reported. ``append(ms)`` is the consumers' one
    call, safe from any thread (one ``list.append``)."""

    def __init__(self) -> None:
        self._seen: list[tuple[float, float]] = []

    def append(self, ms: float) -> None:
        self._seen.append((time.time(), ms))

    def __len__(self) -> int:
        return len(self._seen)

    def since(self, mark: int) -> list[tuple[float, float]]:
        """(reported at, latency in ms) of every pickup from the ``mark``-th on."""
        return self._seen[mark:]


class Load:
    """The producer, and what the consumer's handlers report back to it."""

    def __init__(self, create: Callable[[int], None]) -> None:
        self._create = create
        self.created = 0
        self.pickups = Pickups()
        self.rate: float | None = None  # None: saturate; else messages per second
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._guarded, name="bench-producer", daemon=True)

    def waiting(self) -> int:
        return self.created - len(self.pickups)

    def _make(self, count: int) -> None:
        self._create(count)
        self.created += count

    def _guarded(self) -> None:
        try:
            self._produce()
        except BaseException as exc:  # reported by the run
            self.error = exc

    def _produce(self) -> None:
        paced_since = 0.0
        paced = 0
        while not self.stop.is_set():
            if self.rate is None:
                deficit = BACKLOG - self.waiting()
                if deficit >= BACKLOG // 40:
                    self._make(deficit)
                else:
                    self.stop.wait(0.001)
                continue
            now = time.perf_counter()
            if not paced_since:
                paced_since, paced = now, 0
            due = int(self.rate * (now - paced_since)) - paced
            if due > 0:
                self._make(due)
                paced += due
            self.stop.wait(0.005)


def percentiles(timings: list[float]) -> dict[str, float | None]:
    if len(timings) < 2:
        return {"p50_ms": timings[0] if timings else None, "p99_ms": None}
    return {
        "p50_ms": statistics.median(timings),
        "p99_ms": statistics.quantiles(timings, n=100)[98],
    }


class Consumer:
    """A consumer running in a thread of its own until ``stop()``."""

    def __init__(self, target: Callable[[], None]) -> None:
        self.error: BaseException | None = None
        self.stop: Callable[[], object] = lambda: None
        self.ready = threading.Event()

        def guarded() -> None:
            try:
                target()
            except BaseException as exc:  # reported by the run
                self.error = exc
            finally:
                self.ready.set()

        self.thread = threading.Thread(target=guarded, name="bench-consumer", daemon=True)


def threadsafe(loop: asyncio.AbstractEventLoop, call: Callable[[], None]) -> Callable[[], None]:
    """``call`` on ``loop`` from another thread; nothing once the loop has ended (it failed)."""

    def stop() -> None:
        with suppress(RuntimeError):
            loop.call_soon_threadsafe(call)

    return stop


def _worker(dsn: str, schema: str, concurrency: int, load: Load) -> Consumer:
    from .worker import Worker

    def handler(message: Any) -> None:
        load.pickups.append(since_ms(message.content))
        time.sleep(HANDLER_S)

    def target() -> None:
        pool = min(concurrency, POOL_CAP) + 4
        with Queue(dsn, schema=schema, pool_size=pool) as queue:
            worker = Worker(queue, handler, concurrency=concurrency, lock_ms=LOCK_MS)
            consumer.stop = worker.stop
            consumer.ready.set()
            worker.run(handle_signals=False)

    consumer = Consumer(target)
    return consumer


def _async_worker(dsn: str, schema: str, concurrency: int, load: Load) -> Consumer:
    from .worker import AsyncWorker

    async def handler(message: Any) -> None:
        load.pickups.append(since_ms(message.content))
        await asyncio.sleep(HANDLER_S)

    async def main() -> None:
        pool = min(concurrency, POOL_CAP) + 4
        async with AsyncQueue(dsn, schema=schema, pool_size=pool) as queue:
            worker = AsyncWorker(queue, handler, concurrency=concurrency, lock_ms=LOCK_MS)
            consumer.stop = threadsafe(asyncio.get_running_loop(), worker.stop)
            consumer.ready.set()
            await worker.run(handle_signals=False)

    consumer = Consumer(lambda: asyncio.run(main()))
    return consumer


# The durable floor's call: finish the held messages whose handler is done (if their attempt
# still holds them), lock up to %(n)s more (expired locks first), in one statement.
FLOOR_CYCLE = """
WITH done AS (
    DELETE FROM {r}.durable_queue f USING unnest(%(ids)s::bigint[], %(nas)s::int[]) AS h(id, na)
    WHERE f.id = h.id AND f.attempts = h.na AND f.unlock_at IS NOT NULL
), expired AS (
    SELECT e.id FROM {r}.durable_queue e WHERE e.unlock_at <= {now}
    ORDER BY e.unlock_at, e.id LIMIT %(n)s FOR UPDATE SKIP LOCKED
), ready AS (
    SELECT u.id FROM {r}.durable_queue u WHERE u.unlock_at IS NULL
    ORDER BY u.id LIMIT %(n)s - (SELECT count(*) FROM expired) FOR UPDATE SKIP LOCKED
)
UPDATE {r}.durable_queue d SET unlock_at = {now} + {lock_ms}, attempts = d.attempts + 1
WHERE d.id IN (SELECT x.id FROM expired x UNION ALL SELECT y.id FROM ready y)
RETURNING d.id, d.attempts, d.payload
"""
_FLOOR_NOW = "floor(extract(epoch FROM now()) * 1000)::bigint"


def _floor(dsn: str, raw: str, concurrency: int, load: Load) -> Consumer:
    statement = sql.SQL(
        FLOOR_CYCLE.format(r=sql.Identifier(raw).as_string(), now=_FLOOR_NOW, lock_ms=LOCK_MS)
    )

    async def main() -> None:
        stopping = asyncio.Event()
        finished = asyncio.Event()
        done: list[tuple[int, int]] = []
        running = 0

        async def handle(message_id: int, attempts: int, payload: bytes) -> None:
            nonlocal running
            load.pickups.append(since_ms(payload))
            await asyncio.sleep(HANDLER_S)
            done.append((message_id, attempts))
            running -= 1
            finished.set()

        consumer.stop = threadsafe(asyncio.get_running_loop(), stopping.set)
        consumer.ready.set()
        tasks: set[asyncio.Task[None]] = set()
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            while not stopping.is_set():
                flushed, done[:] = list(done), []
                params = {
                    "ids": [d[0] for d in flushed],
                    "nas": [d[1] for d in flushed],
                    "n": concurrency - running,
                }
                rows = await (await conn.execute(statement, params)).fetchall()
                for message_id, attempts, payload in rows:
                    running += 1
                    task = asyncio.create_task(handle(message_id, attempts, payload))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                if not done:
                    finished.clear()
                    if running:
                        await finished.wait()
                    else:
                        await asyncio.sleep(0.001)  # the queue is empty: poll
            for task in list(tasks):
                await task

    consumer = Consumer(lambda: asyncio.run(main()))
    return consumer


def _measure(
    finished: Callable[[], int], load: Load, seconds: float, *, paced: bool = False
) -> tuple[float, list[float]]:
    """Messages finished per second over ``seconds``, and the pickup latencies (ms) of the
    window: saturated, every pickup in it; paced, those of the messages created in it, however
    late their handlers start (waiting up to ``PACED_GRACE_S`` after the window for the last
    ones), and not those of messages left from the backlog. A consumer so far behind that
    none of those started gets every pickup of the window instead: its wait behind what is
    left of the backlog (the row then says it did not keep up)."""
    first, mark = finished(), len(load.pickups)
    began_at = time.time()
    began = time.perf_counter()
    load.stop.wait(seconds)
    last, elapsed = finished(), time.perf_counter() - began
    rate = (last - first) / elapsed
    if not paced:
        return rate, [ms for _, ms in load.pickups.since(mark)]
    ended_at = time.time()
    load.stop.wait(min(seconds, PACED_GRACE_S))
    seen = load.pickups.since(mark)
    made_in_window = [ms for at, ms in seen if began_at <= at - ms / 1000 <= ended_at]
    return rate, made_in_window or [ms for at, ms in seen if at <= ended_at]


def run_worker_shape(bench: Any) -> list[dict[str, Any]]:
    """Every consumer at every concurrency of ``bench``'s profile; one row each (see the
    module docstring). ``bench`` is a :class:`lonnymq.bench.Bench`."""
    rows: list[dict[str, Any]] = []
    seconds = bench.profile.worker_seconds
    for concurrency in bench.profile.worker_concurrency:
        floor_rate: float | None = None
        for name in reversed(CONSUMERS):  # the floor first: each row's ratio to it
            row = _run_one(bench, name, concurrency, seconds)
            if name == "durable floor":
                floor_rate = row["msgs_per_s"]
            row["x_floor"] = row["msgs_per_s"] / floor_rate if floor_rate else None
            rows.append(row)
            bench.log(describe(row))
    return rows


def describe(row: dict[str, Any]) -> str:
    """One row of the shape as a line of the log."""
    sat, paced = row["pickup_saturated"], row["pickup_paced"]
    ratio = "-" if row.get("x_floor") is None else f"{row['x_floor']:.2f}"
    return (
        f"  {row['consumer']:<14} {row['concurrency']:>4} slots {row['msgs_per_s']:>8,.0f} msg/s "
        f"(x floor {ratio})  pickup saturated p50/p99 "
        f"{_ms(sat['p50_ms'])}/{_ms(sat['p99_ms'])}, paced at "
        f"{row['paced_rate']:,.0f}/s {_ms(paced['p50_ms'])}/{_ms(paced['p99_ms'])} ms"
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _run_one(bench: Any, name: str, concurrency: int, seconds: float) -> dict[str, Any]:
    bench.reset()
    dsn, schema, raw = bench.dsn, bench.schema, bench.raw_schema
    kind = "durable" if name == "durable floor" else "lonnymq"
    producer_conn = psycopg.connect(dsn, autocommit=True)
    # The queue publishes events, so that an idle worker is woken by a create (the floor polls
    # every ms when it has nothing to do), on a channel named after the run's own schema: another
    # run's creates do not wake this worker.
    producer = Queue(dsn, schema=schema, pool_size=1, event_channel=schema)
    producer.install()
    if kind == "durable":
        insert = sql.SQL("INSERT INTO {} (payload) SELECT unnest(%s::bytea[])").format(
            sql.Identifier(raw, "durable_queue")
        )

        def create(count: int) -> None:
            producer_conn.execute(insert, ([stamp()] * count,))

    else:
        spread = [f"c{i + 1}" for i in range(CHANNELS)]

        def create(count: int) -> None:
            created = stamp()
            producer.create_many(
                NewMessage(created, channel=spread[(load.created + i) % CHANNELS])
                for i in range(count)
            )

    load = Load(create)
    start = {"Worker": _worker, "AsyncWorker": _async_worker}.get(name)
    consumer = (
        start(dsn, schema, concurrency, load)
        if start is not None
        else _floor(dsn, raw, concurrency, load)
    )

    def finished() -> int:
        return int(bench._produced(kind) - bench._remaining(kind))

    try:
        maintained = bench._maintained("durable") if kind == "durable" else nullcontext()
        return measure_consumer(
            name,
            concurrency,
            seconds,
            load=load,
            consumer=consumer,
            finished=finished,
            maintained=maintained,
        )
    finally:
        producer_conn.close()
        producer.close()


def measure_consumer(
    name: str,
    concurrency: int,
    seconds: float,
    *,
    load: Load,
    consumer: Consumer,
    finished: Callable[[], int],
    maintained: AbstractContextManager[object] | None = None,
) -> dict[str, Any]:
    """Start ``load``, fill the backlog, start ``consumer`` (inside ``maintained``), measure it
    saturated then paced (see the module docstring), stop both; one row of the shape.

    ``finished()`` counts the messages the queue under test holds as done (it is read before
    and after each phase); the consumer's handlers append their pickup latency to
    ``load.pickups``. Shared by the ``lonnymq`` consumers and the peers in
    ``benchmarks/peers``."""
    try:
        load.thread.start()
        while load.created < BACKLOG and load.error is None:
            load.stop.wait(0.01)
        with maintained or nullcontext():
            consumer.thread.start()
            consumer.ready.wait(60)
            # Measure from the first handler on: a consumer may say it has started well before
            # it takes anything (awa's runtime elects a leader and starts its claimers first).
            deadline = time.perf_counter() + STARTUP_S
            while not load.pickups and consumer.error is None and load.error is None:
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"{name} at {concurrency}: no handler in {STARTUP_S} s")
                load.stop.wait(0.005)
            load.stop.wait(min(1.0, seconds))  # warm up: connections, plans, the pool
            rate, saturated = _measure(finished, load, seconds)
            # Paced: wait for the backlog to drain, then measure what pickup adds.
            load.rate = PACE * rate
            drain_s = min(3 * BACKLOG / max(rate, 1.0) + 10, DRAIN_WAITS * seconds)
            deadline = time.perf_counter() + drain_s
            while load.waiting() > concurrency + PACE * rate * 0.05:
                if time.perf_counter() > deadline or consumer.error or load.error:
                    break
                load.stop.wait(0.01)
            kept_up = load.waiting() <= concurrency + PACE * rate * 0.05
            paced_rate, paced = _measure(finished, load, seconds, paced=True)
    finally:
        load.stop.set()
        consumer.stop()
        load.thread.join(30)
        consumer.thread.join(60)
    for error in (load.error, consumer.error):
        if error is not None:
            raise RuntimeError(f"{name} at {concurrency}: {error!r}") from error
    if not saturated or not paced:
        raise RuntimeError(f"{name} at {concurrency}: no handler started while measured")
    return {
        "consumer": name,
        "concurrency": concurrency,
        "msgs_per_s": rate,
        "pickup_saturated": percentiles(saturated),
        "paced_rate": paced_rate,
        "kept_up": kept_up,
        "pickup_paced": percentiles(paced),
    }
