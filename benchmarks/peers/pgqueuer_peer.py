"""pgqueuer: one ``QueueManager`` on one asyncpg connection (its documented setup), at most
``concurrency`` jobs picked at once, dequeued ``concurrency / 2`` at a time (the largest batch
``max_concurrent_tasks`` allows); the producer enqueues the whole deficit in one call."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
from pgqueuer import Job, Queries, QueueManager

from lonnymq.bench_worker import HANDLER_S, Consumer, Load, since_ms, stamp, threadsafe

from .common import Counter, LoopBridge, Peer, asyncpg_params

ENTRYPOINT = "bench"


def batch_size(concurrency: int) -> int:
    """pgqueuer requires ``max_concurrent_tasks >= 2 * batch_size``."""
    return max(1, concurrency // 2)


class PgQueuer(Peer):
    name = "pgqueuer"
    package = "pgqueuer"
    fair_key = (
        "none: one entrypoint (entrypoints are job kinds, each with an optional concurrency "
        "limit; dequeue takes the oldest by priority, not in turns)"
    )

    def __init__(self) -> None:
        self.dsn = ""
        self.bridge: LoopBridge | None = None
        self.conn: Any = None
        self.queries: Queries | None = None
        self.counter: Counter | None = None

    def settings(self, concurrency: int) -> dict[str, Any]:
        return {
            "worker": "QueueManager.run on one asyncpg connection",
            "max_concurrent_tasks": concurrency,
            "batch_size": batch_size(concurrency),
            "durability": "default (durable: logged tables)",
            "dequeue_timeout_s": "default (30; NOTIFY wakes it)",
            "producer": "Queries.enqueue of the whole deficit (lists), its own asyncpg connection",
        }

    def open(self, dsn: str) -> None:
        self.dsn = dsn
        self.bridge = LoopBridge()
        self.conn = self.bridge.run(asyncpg.connect(**asyncpg_params(dsn)))
        self.queries = Queries.from_asyncpg_connection(self.conn)
        self.bridge.run(self.queries.install())
        self.counter = Counter(dsn)

    def create(self, count: int) -> None:
        assert self.bridge is not None
        assert self.queries is not None
        created = stamp()
        self.bridge.run(self.queries.enqueue([ENTRYPOINT] * count, [created] * count, [0] * count))

    def finished(self) -> int:
        """Jobs enqueued (the id sequence) minus jobs left: pgqueuer deletes a job in the
        statement that logs its outcome (the log itself is folded into statistics as it goes,
        so it cannot be counted)."""
        assert self.counter is not None
        return self.counter.number(
            "SELECT (SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM pgqueuer_id_seq)"
            " - (SELECT count(*) FROM pgqueuer)"
        )

    def consumer(self, concurrency: int, load: Load) -> Consumer:
        async def main() -> None:
            conn = await asyncpg.connect(**asyncpg_params(self.dsn))
            try:
                manager = QueueManager(Queries.from_asyncpg_connection(conn))

                @manager.entrypoint(ENTRYPOINT)
                async def job(job: Job) -> None:
                    load.pickups.append(since_ms(job.payload or b""))
                    await asyncio.sleep(HANDLER_S)

                consumer.stop = threadsafe(asyncio.get_running_loop(), manager.shutdown.set)
                consumer.ready.set()
                await manager.run(
                    batch_size=batch_size(concurrency), max_concurrent_tasks=concurrency
                )
            finally:
                await conn.close()

        consumer = Consumer(lambda: asyncio.run(main()))
        return consumer

    def close(self) -> None:
        if self.counter is not None:
            self.counter.close()
        if self.bridge is not None:
            if self.conn is not None:
                self.bridge.run(self.conn.close())
            self.bridge.close()
