"""Serving the dashboard with uvicorn: in the foreground (``lonnymq dashboard``) or in a thread
of a running program (``lonnymq demo --dashboard``)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import RedirectResponse
from starlette.routing import Mount, Route
from starlette.types import ASGIApp

from ..errors import InvalidArgumentError, LonnyMQError
from ..queue_async import AsyncQueue
from ._app import app

START_TIMEOUT_S = 30.0


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host``:``port`` (0: any free port); InvalidArgumentError when
    that address cannot be had (in use, or not this machine's)."""
    try:
        return socket.create_server((host, port))
    except OSError as err:
        raise InvalidArgumentError(
            f"cannot listen on {host}:{port} ({err.strerror or err}): choose another port or host"
        ) from err


def url_of(listener: socket.socket) -> str:
    """The address a browser opens for what ``listener`` serves."""
    host, port = listener.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/"


async def serve(
    listener: socket.socket,
    dsn: str | None,
    schemas: Sequence[str],
    *,
    read_only: bool = False,
    token: str | None = None,
    wrap: Callable[[ASGIApp], ASGIApp] | None = None,
    started: Callable[[uvicorn.Server], None] | None = None,
) -> None:
    """Serve the dashboard of each schema on ``listener`` until the server is told to exit:
    one schema at the root, several each under ``/<schema>/`` (the root leads to the first).
    ``wrap`` builds the application served around the dashboard's (to mount it elsewhere);
    ``started`` is given the server before it serves, to stop it from another thread."""
    async with AsyncExitStack() as stack:
        queues = [
            await stack.enter_async_context(AsyncQueue(dsn, schema=schema, pool_size=2))
            for schema in schemas
        ]
        for queue in queues:
            await queue.now()  # the database is reachable and the schema installed
        application: ASGIApp
        if len(queues) == 1:
            application = app(queues[0], read_only=read_only, token=token)
        else:

            async def first(request: Request) -> RedirectResponse:
                return RedirectResponse(f"{request.scope.get('root_path', '')}/{schemas[0]}/")

            application = Starlette(
                routes=[
                    Route("/", first),
                    *(
                        Mount(f"/{queue.schema}", app(queue, read_only=read_only, token=token))
                        for queue in queues
                    ),
                ]
            )
        if wrap is not None:
            application = wrap(application)
        server = uvicorn.Server(uvicorn.Config(application, log_level="warning", lifespan="off"))
        if started is not None:
            started(server)
        await server.serve(sockets=[listener])


class Background:
    """The dashboards of ``schemas`` served on ``host``:``port`` by a thread of this process,
    until :meth:`close`; :attr:`url` is where to open them (:attr:`port` is the port given, or
    the one chosen for 0). The other options are :func:`serve`'s."""

    def __init__(
        self,
        dsn: str | None,
        schemas: Sequence[str],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        read_only: bool = False,
        token: str | None = None,
        wrap: Callable[[ASGIApp], ASGIApp] | None = None,
    ) -> None:
        self._listener = listen(host, port)
        self.url = url_of(self._listener)
        self.port: int = self._listener.getsockname()[1]
        self._server: uvicorn.Server | None = None
        self._failure: BaseException | None = None

        def started(server: uvicorn.Server) -> None:
            self._server = server

        def run() -> None:
            try:
                asyncio.run(
                    serve(
                        self._listener,
                        dsn,
                        schemas,
                        read_only=read_only,
                        token=token,
                        wrap=wrap,
                        started=started,
                    )
                )
            except BaseException as err:  # reported by close() and the start
                self._failure = err

        self._thread = threading.Thread(target=run, name="lonnymq-dashboard", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (self._server is not None and self._server.started):
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self._listener.close()
                raise LonnyMQError(f"the dashboard did not start: {self._failure!r}")
            time.sleep(0.01)

    def close(self) -> None:
        """Stop serving and wait for the thread to end; raise what made it fail, if anything."""
        if self._server is not None:
            self._server.should_exit = True
        self._thread.join(timeout=START_TIMEOUT_S)
        self._listener.close()
        if self._thread.is_alive():
            raise LonnyMQError("the dashboard did not stop in time")
        if self._failure is not None:
            raise LonnyMQError(f"the dashboard failed: {self._failure!r}") from self._failure
