"""awa (``awa-pg``, the Python SDK over awa's Rust runtime): its queue storage (the engine of
rings of partitions that its batched claims and completions are built for) installed and
active, one queue served by an ``AsyncClient`` runtime with ``max_workers = concurrency``;
the producer enqueues the whole deficit with ``enqueue_many_copy`` (COPY straight into queue
storage), the path its documentation gives high-volume Python producers."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import awa

from lonnymq.bench_worker import HANDLER_S, Consumer, Load, threadsafe

from .common import LoopBridge, Peer, pool_size

QUEUE = "bench"


@dataclass
class BenchJob:
    """The job's arguments: its creation time (epoch seconds)."""

    t: float


class Awa(Peer):
    name = "awa"
    package = "awa-pg"
    fair_key = (
        "none: one queue (each awa queue runs claimers of its own with its own worker cap; "
        "100 queues would be 100 dispatchers, not a fair share of one pool)"
    )

    def __init__(self) -> None:
        self.dsn = ""
        self.bridge: LoopBridge | None = None
        self.producer: awa.AsyncClient | None = None
        self.returned = 0

    def settings(self, concurrency: int) -> dict[str, Any]:
        return {
            "storage": "queue storage (install_queue_storage after migrate), its defaults",
            "worker": "AsyncClient.start, one queue",
            "max_workers": concurrency,
            "claim_batch_size / claimers / poll_interval_ms": "defaults",
            "max_connections": pool_size(concurrency),
            "producer": "AsyncClient.enqueue_many_copy of the whole deficit",
            "finished": "handlers returned (see finished())",
        }

    def open(self, dsn: str) -> None:
        self.dsn = dsn
        self.returned = 0
        # The async client, on a loop of the producer's: awa's synchronous calls keep the GIL
        # while they wait on the server, which stalls the worker's thread meanwhile.
        self.bridge = LoopBridge()
        self.producer = awa.AsyncClient(dsn, max_connections=2)
        self.bridge.run(self.producer.migrate())
        self.bridge.run(self.producer.install_queue_storage())

    def create(self, count: int) -> None:
        assert self.bridge is not None
        assert self.producer is not None
        created = time.time()
        jobs = [BenchJob(created) for _ in range(count)]
        self.bridge.run(self.producer.enqueue_many_copy(jobs, queue=QUEUE))

    def finished(self) -> int:
        """Handlers returned. awa records completions in batches in rings of partitions that
        it rotates and truncates, and its exact count (``queue_stats``) is a query that takes
        seconds on a backlog of thousands; counting in Python is what the peer allows."""
        return self.returned

    def consumer(self, concurrency: int, load: Load) -> Consumer:
        async def main() -> None:
            client = awa.AsyncClient(self.dsn, max_connections=pool_size(concurrency))

            @client.task(BenchJob, queue=QUEUE)
            async def job(job: awa.Job[BenchJob]) -> None:
                load.pickups.append(1000 * (time.time() - job.args.t))
                await asyncio.sleep(HANDLER_S)
                self.returned += 1

            stopping = asyncio.Event()
            try:
                await client.start([{"name": QUEUE, "max_workers": concurrency}])
                consumer.stop = threadsafe(asyncio.get_running_loop(), stopping.set)
                consumer.ready.set()
                await stopping.wait()
                await client.shutdown()
            finally:
                await client.close()

        consumer = Consumer(lambda: asyncio.run(main()))
        return consumer

    def close(self) -> None:
        if self.bridge is not None:
            if self.producer is not None:
                self.bridge.run(self.producer.close())
            self.bridge.close()
