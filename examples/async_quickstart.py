import asyncio

from lonnymq import AsyncQueue


async def main() -> None:
    async with AsyncQueue(schema="async_quickstart") as q:
        await q.install()
        created = await q.create(b"hello", channel="greetings")
        message = await q.dequeue(lock_ms=30_000)
        assert message is not None
        assert message.id == created.id
        await message.delete()


asyncio.run(main())
