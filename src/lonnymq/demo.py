"""The demo pipeline: per-tenant channels with policies, drained by worker threads.

It installs a queue in the ``lonnymq_demo`` schema (dropped and recreated each run), creates
messages for a few tenants (one much busier than the others), gives each tenant a policy,
runs a Worker whose handler fails some first attempts (they are retried with backoff), and
prints what happened per channel: the policies held, and every message was finished exactly once.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass

import psycopg
from psycopg import sql

from .queue import Message, Queue
from .types import CreateStatus, NewMessage
from .worker import Backoff, Worker

SCHEMA = "lonnymq_demo"
LOCK_MS = 30_000

# tenant -> (share of the messages, policy)
TENANTS: dict[str, tuple[float, dict[str, int]]] = {
    "tenant-big": (0.70, {"max_concurrency": 3}),
    "tenant-rate": (0.10, {"release_interval_ms": 5}),
    "tenant-capped": (0.10, {"max_size": 100}),
    "tenant-small": (0.10, {}),
}


@dataclass
class Tally:
    """What the workers saw for one channel."""

    finished: int = 0
    retried: int = 0
    in_flight: int = 0
    max_in_flight: int = 0


def run_demo(*, dsn: str | None, messages: int, workers: int) -> int:
    """Run the demo; returns a process exit code (0 when every check held)."""
    queue = Queue(dsn, schema=SCHEMA, pool_size=workers + 2)
    with psycopg.connect(queue.dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(SCHEMA)))
    with queue:
        queue.install(archive=True)
        for tenant, (_, policy) in TENANTS.items():
            if policy:
                queue.channel(tenant).set_policy(
                    max_concurrency=policy.get("max_concurrency"),
                    release_interval_ms=policy.get("release_interval_ms"),
                    max_size=policy.get("max_size"),
                )
        print(
            f"Installed schema {SCHEMA!r}; policies: "
            + "; ".join(f"{t} {p}" for t, (_, p) in TENANTS.items() if p)
        )

        rng = random.Random(7)
        tenants = list(TENANTS)
        weights = [share for share, _ in TENANTS.values()]
        items = [
            NewMessage(content=f"order-{i}".encode(), channel=rng.choices(tenants, weights)[0])
            for i in range(messages)
        ]
        started = time.perf_counter()
        results = []
        for chunk in range(0, len(items), 500):
            results.extend(queue.create_many(items[chunk : chunk + 500]))
        created = Counter(
            item.channel
            for item, r in zip(items, results, strict=True)
            if r.status is CreateStatus.CREATED
        )
        dropped = Counter(
            item.channel
            for item, r in zip(items, results, strict=True)
            if r.status is CreateStatus.DROPPED
        )
        print(
            f"Created {sum(created.values())} messages in {time.perf_counter() - started:.2f}s "
            f"({sum(dropped.values())} dropped by max_size)"
        )

        tallies: dict[str, Tally] = defaultdict(Tally)
        seen: Counter[int] = Counter()
        lock = threading.Lock()
        fail_rng = random.Random(11)

        def handle(message: Message) -> None:
            with lock:
                tally = tallies[message.channel]
                tally.in_flight += 1
                tally.max_in_flight = max(tally.max_in_flight, tally.in_flight)
                fails = message.num_attempts == 1 and fail_rng.random() < 0.05
            try:
                time.sleep(0.001)  # the "work"
                if fails:
                    with lock:
                        tally.retried += 1
                    raise RuntimeError("simulated failure of a first attempt")
            finally:
                with lock:  # before the worker releases the message's slot
                    tally.in_flight -= 1
            with lock:
                seen[message.id] += 1
                tally.finished += 1

        started = time.perf_counter()
        worker = Worker(
            queue,
            handle,
            concurrency=workers,
            lock_ms=LOCK_MS,
            max_attempts=3,
            backoff=Backoff(base_ms=10, max_ms=100),
        )
        worker.run(handle_signals=False, until_idle=True)
        elapsed = time.perf_counter() - started

        print(
            f"\nA worker running {workers} handlers at once drained the queue in {elapsed:.2f}s "
            f"({sum(created.values()) / elapsed:.0f} msg/s)\n"
        )
        header = (
            f"{'channel':<14} {'created':>7} {'dropped':>7} {'finished':>8} "
            f"{'retried':>7} {'max in flight':>13} {'min gap ms':>10}  policy"
        )
        print(header)  # min gap: between two dequeues of the channel (database clock)
        print("-" * len(header))
        ok = True
        lock_times = _archived_lock_times(queue)
        for tenant, (_, policy) in TENANTS.items():
            t = tallies[tenant]
            times = lock_times.get(tenant, [])
            gaps = [b - a for a, b in itertools.pairwise(times)]
            min_gap = str(min(gaps)) if gaps else "-"
            print(
                f"{tenant:<14} {created[tenant]:>7} {dropped[tenant]:>7} {t.finished:>8} "
                f"{t.retried:>7} {t.max_in_flight:>13} {min_gap:>10}  {policy or '-'}"
            )
            limit = policy.get("max_concurrency")
            interval = policy.get("release_interval_ms")
            ok &= t.finished == created[tenant]
            ok &= limit is None or t.max_in_flight <= limit
            ok &= interval is None or not gaps or min(gaps) >= interval
        duplicates = [i for i, n in seen.items() if n > 1]
        leftover = queue.stats()
        ok &= not duplicates and all(s.size == 0 for s in leftover)
        print(
            f"\nFinished exactly once: {'yes' if not duplicates else duplicates[:5]}; "
            f"left in the queue: {sum(s.size for s in leftover)}; "
            f"archived: {sum(len(v) for v in lock_times.values())}"
        )
        print("All checks held." if ok else "A check FAILED (see above).")
        return 0 if ok else 1


def _archived_lock_times(queue: Queue) -> dict[str, list[int]]:
    """When each archived message's final attempt was dequeued (database clock), by channel."""
    query = sql.SQL("SELECT channel, locked_at FROM {}.archive ORDER BY channel, locked_at")
    times: dict[str, list[int]] = defaultdict(list)
    with psycopg.connect(queue.dsn) as conn:
        for channel, locked_at in conn.execute(query.format(sql.Identifier(SCHEMA))):
            times[channel].append(locked_at)
    return times
