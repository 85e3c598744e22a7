"""The asyncio API against the real database (coroutines run with asyncio.run)."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from lonnymq import (
    AckStatus,
    AsyncQueue,
    CreateStatus,
    DatabaseError,
    InvalidArgumentError,
    MessageNotFoundError,
    NewMessage,
    Policy,
    StaleMessageError,
)

LOCK_MS = 60_000


def test_async_round_trip(dsn: str, schema_name: str) -> None:
    async def run() -> None:
        async with AsyncQueue(dsn, schema=schema_name) as queue:
            assert await queue.install() >= 1
            created = await queue.create(b"hello", channel="a", dedup_key="k")
            # No policy, no counter: the size is not reported, stats() counts it.
            assert (created.status, created.channel_size) == (CreateStatus.CREATED, None)
            duplicate = await queue.create(b"again", channel="a", dedup_key="k")
            assert (duplicate.status, duplicate.id) == (CreateStatus.DEDUPLICATED, created.id)
            assert [(s.channel, s.size) for s in await queue.stats()] == [("a", 1)]

            message = await queue.dequeue(lock_ms=LOCK_MS)
            assert message is not None
            assert (message.id, message.content, message.num_attempts) == (
                created.id,
                b"hello",
                1,
            )
            assert await queue.dequeue(lock_ms=LOCK_MS) is None

            await message.defer(state=b"half")
            again = await queue.dequeue(lock_ms=LOCK_MS)
            assert again is not None
            assert (again.state, again.num_attempts) == (b"half", 2)
            with pytest.raises(StaleMessageError):
                await message.delete()

            unlock_at = await again.heartbeat(lock_ms=2 * LOCK_MS)
            assert unlock_at > again.unlock_at
            await again.delete()
            with pytest.raises(MessageNotFoundError):
                await again.delete()
            assert await queue.stats() == []

    asyncio.run(run())


def test_async_scheduling_and_retry_at(dsn: str, schema_name: str) -> None:
    async def run() -> None:
        async with AsyncQueue(dsn, schema=schema_name) as queue:
            await queue.install()
            now = await queue.now()
            await queue.create(b"later", channel="a", dequeue_at=now + 10_000)
            batch = await queue.dequeue_batch(5, lock_ms=LOCK_MS)
            assert (batch.messages, batch.retry_at) == ([], now + 10_000)
            await queue.set_clock_offset(10_000)
            ready = await queue.dequeue_batch(5, lock_ms=LOCK_MS)
            assert [m.content for m in ready.messages] == [b"later"]

    asyncio.run(run())


def test_async_policies(dsn: str, schema_name: str) -> None:
    async def run() -> None:
        async with AsyncQueue(dsn, schema=schema_name) as queue:
            await queue.install()
            limited = queue.channel("limited")
            await limited.set_policy(max_concurrency=1, max_size=3)
            results = [await limited.create(f"l{i}".encode()) for i in range(4)]
            assert [r.status for r in results] == [CreateStatus.CREATED] * 3 + [
                CreateStatus.DROPPED
            ]
            await queue.channel("slow").set_policy(release_interval_ms=10_000)
            for i in range(3):
                await queue.create(f"s{i}".encode(), channel="slow")

            held = await queue.dequeue_many(100, lock_ms=LOCK_MS)
            assert sorted(m.content for m in held) == [b"l0", b"s0"]
            assert await queue.dequeue(lock_ms=LOCK_MS) is None

            stats = await limited.stats()
            assert stats is not None
            assert (stats.size, stats.in_flight) == (3, 1)
            assert stats.policy == Policy(max_concurrency=1, max_size=3)

            await next(m for m in held if m.channel == "limited").delete()
            following = await queue.dequeue(lock_ms=LOCK_MS)
            assert following is not None
            assert following.content == b"l1"

            await queue.set_clock_offset(10_000)
            slow = await queue.dequeue(lock_ms=LOCK_MS)
            assert slow is not None
            assert slow.content == b"s1"

            await limited.clear_policy()
            stats = await limited.stats()
            assert stats is not None
            assert stats.policy == Policy()

    asyncio.run(run())


def test_async_batches(dsn: str, schema_name: str) -> None:
    async def run() -> None:
        async with AsyncQueue(dsn, schema=schema_name) as queue:
            await queue.install()
            assert await queue.create_many([]) == []
            # "b" has a policy (exact counters, sizes reported); "a" has none.
            await queue.channel("b").set_policy(max_size=10)
            results = await queue.create_many(
                [
                    NewMessage(b"b0", channel="b"),
                    NewMessage(b"a0", channel="a"),
                    NewMessage(b"b1", channel="b", dedup_key="k"),
                    NewMessage(b"b2", channel="b", dedup_key="k"),
                ]
            )
            assert [(r.status, r.channel_size) for r in results] == [
                (CreateStatus.CREATED, 1),
                (CreateStatus.CREATED, None),
                (CreateStatus.CREATED, 2),
                (CreateStatus.DEDUPLICATED, 2),
            ]
            assert [(s.channel, s.size) for s in await queue.stats()] == [("a", 1), ("b", 2)]
            held = await queue.dequeue_many(10, lock_ms=LOCK_MS)
            assert sorted(m.content for m in held) == [b"a0", b"b0", b"b1"]
            by_content = {m.content: m for m in held}
            await by_content[b"a0"].delete()

            statuses = await queue.defer_many([by_content[b"b0"], by_content[b"a0"]])
            assert statuses == [AckStatus.OK, AckStatus.NOT_FOUND]
            statuses = await queue.delete_many([by_content[b"b1"], by_content[b"b0"]])
            assert statuses == [AckStatus.OK, AckStatus.STALE]

            again = await queue.dequeue_many(10, lock_ms=LOCK_MS)
            assert [(m.content, m.num_attempts) for m in again] == [(b"b0", 2)]
            assert await queue.delete_many(again) == [AckStatus.OK]
            stats = await queue.stats()
            assert [(s.channel, s.size, s.in_flight) for s in stats] == [("b", 0, 0)]

    asyncio.run(run())


def test_async_conn_runs_in_the_callers_transaction(dsn: str, schema_name: str) -> None:
    async def run() -> None:
        async with AsyncQueue(dsn, schema=schema_name) as queue:
            await queue.install()
            conn: psycopg.AsyncConnection[Any]
            async with await psycopg.AsyncConnection.connect(dsn) as conn:
                await queue.create(b"rolled-back", channel="a", conn=conn)
                assert len(await queue.stats(conn=conn)) == 1
                assert await queue.stats() == []
                await conn.rollback()
                assert await queue.stats() == []

                async with conn.transaction():
                    await queue.create(b"committed", channel="a", conn=conn)
                message = await queue.dequeue(lock_ms=LOCK_MS, conn=conn)
                assert message is not None
                assert message.content == b"committed"
                await conn.rollback()  # the dequeue is undone

                async with conn.transaction():
                    taken = await queue.dequeue(lock_ms=LOCK_MS, conn=conn)
                    assert taken is not None
                    assert taken.num_attempts == 1
                    await taken.delete(conn=conn)
            assert await queue.stats() == []

    asyncio.run(run())


def test_async_install_on_a_callers_connection(dsn: str, schema_name: str) -> None:
    async def run() -> None:
        queue = AsyncQueue(dsn, schema=schema_name)
        try:
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
                version = await queue.install(conn=conn)
                assert version >= 1
                assert await queue.install(conn=conn) == version
            assert (await queue.create(b"x")).status is CreateStatus.CREATED
        finally:
            await queue.close()

    asyncio.run(run())


def test_async_write_refuses_a_connection_the_server_puts_above_read_committed(
    dsn: str, schema_name: str
) -> None:
    async def run() -> None:
        async with AsyncQueue(dsn, schema=schema_name) as queue:
            await queue.install()
            async with await psycopg.AsyncConnection.connect(dsn) as conn:
                await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                with pytest.raises(InvalidArgumentError, match="conn is at REPEATABLE READ"):
                    await queue.create(b"x", conn=conn)
                await conn.rollback()
            assert await queue.stats() == []

    asyncio.run(run())


def test_async_callers_row_factory_does_not_change_results(dsn: str, schema_name: str) -> None:
    async def run() -> None:
        async with AsyncQueue(dsn, schema=schema_name) as queue:
            await queue.install()
            async with await psycopg.AsyncConnection.connect(
                dsn, autocommit=True, row_factory=dict_row
            ) as conn:
                assert await queue.install(conn=conn) >= 1
                assert (await queue.settings(conn=conn)).archive is False
                created = await queue.create(b"x", channel="a", conn=conn)
                assert created.status is CreateStatus.CREATED
                assert [(s.channel, s.size) for s in await queue.stats(conn=conn)] == [("a", 1)]
                message = await queue.dequeue(lock_ms=LOCK_MS, conn=conn)
                assert message is not None
                assert message.id == created.id
                await message.delete(conn=conn)
            assert await queue.stats() == []

    asyncio.run(run())


def test_async_transaction_block_that_caught_an_error_raises_at_its_end(
    dsn: str, schema_name: str
) -> None:
    async def catch_inside(queue: AsyncQueue) -> None:
        async with queue.transaction() as conn:
            await queue.create(b"x", channel="a", conn=conn)
            with pytest.raises(psycopg.errors.DivisionByZero):
                await conn.execute("SELECT 1/0")

    async def fail_inside(queue: AsyncQueue) -> None:
        async with queue.transaction() as conn:
            await conn.execute("SELECT 1/0")

    async def run() -> None:
        async with AsyncQueue(dsn, schema=schema_name) as queue:
            await queue.install()
            with pytest.raises(DatabaseError, match="aborted by an error caught"):
                await catch_inside(queue)
            with pytest.raises(psycopg.errors.DivisionByZero):
                await fail_inside(queue)
            assert await queue.stats() == []

    asyncio.run(run())
