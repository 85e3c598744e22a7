import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.routing import Mount

from lonnymq import AsyncQueue, dashboard

queue = AsyncQueue(schema="shop")  # the DSN from LONNYMQ_DSN


@asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    async with queue:  # open while the application serves
        yield


app = Starlette(
    routes=[Mount("/ops/queue", app=dashboard.app(queue, token=os.environ["LONNYMQ_TOKEN"]))],
    lifespan=lifespan,
)
