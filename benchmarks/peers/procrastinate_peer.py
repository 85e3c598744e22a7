"""procrastinate: an async worker (``App.run_worker_async``) with ``concurrency`` job slots,
LISTEN/NOTIFY on, on a psycopg pool sized as lonnymq's; the producer defers through
``batch_defer`` on a second app with the synchronous connector, as a web process would."""

from __future__ import annotations

import asyncio
import time
from contextlib import suppress
from typing import Any

import procrastinate

from lonnymq.bench_worker import HANDLER_S, Consumer, Load, threadsafe

from .common import Counter, Peer, pool_size

TASK = "bench"
QUEUE = "bench"


class Procrastinate(Peer):
    name = "procrastinate"
    package = "procrastinate"
    fair_key = (
        "none: one queue (queues are fetched by priority then id, not in turns; a lock "
        "serialises jobs rather than sharing slots fairly)"
    )

    def __init__(self) -> None:
        self.dsn = ""
        self.producer: procrastinate.App | None = None
        self.counter: Counter | None = None

    def settings(self, concurrency: int) -> dict[str, Any]:
        return {
            "worker": "App.run_worker_async",
            "concurrency": concurrency,
            "listen_notify": True,
            "fetch_job_polling_interval_s": "default (5.0; NOTIFY wakes it)",
            "delete_jobs": "default (never): finished jobs stay, status 'succeeded'",
            "connector": f"PsycopgConnector, pool min=max={pool_size(concurrency)}",
            "producer": "SyncPsycopgConnector app, batch_defer of the whole deficit",
        }

    def open(self, dsn: str) -> None:
        self.dsn = dsn
        self.producer = procrastinate.App(
            connector=procrastinate.SyncPsycopgConnector(conninfo=dsn, min_size=1, max_size=1)
        )
        self.producer.open()
        self.producer.schema_manager.apply_schema()
        self.counter = Counter(dsn)

    def create(self, count: int) -> None:
        assert self.producer is not None
        deferrer = self.producer.configure_task(TASK, queue=QUEUE)
        created = time.time()
        deferrer.batch_defer(*({"t": created} for _ in range(count)))

    def finished(self) -> int:
        assert self.counter is not None
        return self.counter.number(
            "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'"
        )

    def consumer(self, concurrency: int, load: Load) -> Consumer:
        size = pool_size(concurrency)
        app = procrastinate.App(
            connector=procrastinate.PsycopgConnector(
                conninfo=self.dsn, min_size=size, max_size=size
            )
        )

        @app.task(name=TASK, queue=QUEUE)
        async def job(t: float) -> None:
            load.pickups.append(1000 * (time.time() - t))
            await asyncio.sleep(HANDLER_S)

        async def main() -> None:
            async with app.open_async():
                worker = asyncio.create_task(
                    app.run_worker_async(
                        queues=[QUEUE],
                        concurrency=concurrency,
                        listen_notify=True,
                        install_signal_handlers=False,
                    )
                )
                # Cancelling the worker's task is procrastinate's way to stop it gracefully.
                consumer.stop = threadsafe(asyncio.get_running_loop(), worker.cancel)
                consumer.ready.set()
                with suppress(asyncio.CancelledError):
                    await worker

        consumer = Consumer(lambda: asyncio.run(main()))
        return consumer

    def close(self) -> None:
        if self.counter is not None:
            self.counter.close()
        if self.producer is not None:
            self.producer.close()
