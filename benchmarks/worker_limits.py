"""What limits a worker as it gets wider: a ``Worker`` and an ``AsyncWorker`` drain a backlog
over 100 channels with handlers that sleep 1 ms, at 8, 32 and 128 slots, in one run.

    python benchmarks/worker_limits.py [--dsn DSN] [--messages 3000] [--kinds sync,async]

For each run it prints the completion rate; the process's CPU time over the run (user and
system, as a share of one core: near 100% would say Python, its threads or the GIL are the
limit); the worker's reporting call (``message_settle``, or ``message_complete_and_dequeue``
before group commit): how many calls, their mean time and how many messages each carried;
the time calls spent waiting for a pooled connection (psycopg_pool's ``requests_wait_ms``);
and the peak number of threads. Run it from a checkout of each commit to compare them. Each
run installs a fresh schema and drops it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import threading
import time
import uuid
from typing import Any

import psycopg
from psycopg import sql

from lonnymq import AsyncMessage, AsyncQueue, Message, NewMessage, Queue
from lonnymq.metrics import OperationStats
from lonnymq.worker import AsyncWorker, Worker, WorkerStats

REPORTS = ("message_settle", "message_complete_and_dequeue")


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _pool(concurrency: int) -> int:
    return min(concurrency, 32) + 4


def _run_async(dsn: str, schema: str, concurrency: int) -> tuple[WorkerStats, Any, Any]:
    async def main() -> tuple[WorkerStats, list[OperationStats], dict[str, int]]:
        async with AsyncQueue(dsn, schema=schema, pool_size=_pool(concurrency)) as queue:

            async def handler(message: AsyncMessage) -> None:
                await asyncio.sleep(0.001)

            worker = AsyncWorker(queue, handler, concurrency=concurrency)
            stats = await worker.run(handle_signals=False, until_idle=True)
            pool = queue._pool  # measuring: the pool's own counters
            return stats, queue.operation_stats(), pool.get_stats() if pool else {}

    return asyncio.run(main())


def _run_sync(dsn: str, schema: str, concurrency: int, peak: list[int]) -> tuple[Any, Any, Any]:
    with Queue(dsn, schema=schema, pool_size=_pool(concurrency)) as queue:

        def handler(message: Message) -> None:
            peak[0] = max(peak[0], threading.active_count())
            time.sleep(0.001)

        stats = Worker(queue, handler, concurrency=concurrency).run(
            handle_signals=False, until_idle=True
        )
        pool = queue._pool  # measuring: the pool's own counters
        return stats, queue.operation_stats(), pool.get_stats() if pool else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get("LONNYMQ_DSN"), required=False)
    parser.add_argument("--messages", type=int, default=3_000)
    parser.add_argument("--kinds", default="sync,async")
    args = parser.parse_args()
    if not args.dsn:
        parser.error("give --dsn or set LONNYMQ_DSN")
    for kind in args.kinds.split(","):
        for concurrency in (8, 32, 128):
            schema = f"limits_{uuid.uuid4().hex[:10]}"
            with Queue(args.dsn, schema=schema) as queue:
                queue.install()
                queue.create_many(
                    NewMessage(b"x", channel=f"c{i % 100}") for i in range(args.messages)
                )
            peak = [0]
            started, cpu = time.perf_counter(), _cpu()
            if kind == "async":
                stats, ops, pool = _run_async(args.dsn, schema, concurrency)
            else:
                stats, ops, pool = _run_sync(args.dsn, schema, concurrency, peak)
            elapsed, used = time.perf_counter() - started, _cpu() - cpu
            [report] = [op for op in ops if op.name in REPORTS]
            print(
                f"{kind:<5} {concurrency:>4} slots: {stats.completed / elapsed:>7,.0f} msg/s, "
                f"CPU {100 * used / elapsed:>3.0f}% of a core, {report.name} x{report.calls} "
                f"({1000 * report.seconds / report.calls:.1f} ms each, "
                f"{stats.completed / report.calls:.1f} msgs each), "
                f"pool waits {pool.get('requests_wait_ms', 0):,} ms, threads {peak[0] or '-'}",
                flush=True,
            )
            with psycopg.connect(args.dsn, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


if __name__ == "__main__":
    main()
