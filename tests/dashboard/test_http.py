"""The dashboard over plain HTTP: what every response carries, the token gate, bad requests,
escaping of hostile names and contents, mounting in another application, and the command."""

from __future__ import annotations

import asyncio
import http.client
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import psycopg
import pytest
import uvicorn
from psycopg import sql
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, Route

from lonnymq import AsyncQueue, NewMessage, Queue, cli
from lonnymq.dashboard import app
from lonnymq.errors import InvalidArgumentError

from .conftest import Served

HOSTILE = "<script>alert('x')</script>"


def _get(
    served: Served, path: str, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], str]:
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        body = response.read().decode()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, body
    finally:
        conn.close()


def test_pages_render_with_safe_headers(serve: Callable[..., Served], queue: Queue) -> None:
    queue.create(b"hello", channel="plain")
    served = serve()
    for path in ("/", "/live/overview", "/channels", "/channel?name=plain"):
        status, headers, body = _get(served, path)
        assert status == 200, (path, body)
        assert "script-src 'self'" in headers["content-security-policy"]
        assert "frame-ancestors 'none'" in headers["content-security-policy"]
        assert headers["x-content-type-options"] == "nosniff"
    status, headers, body = _get(served, "/static/htmx.min.js")
    assert status == 200
    assert body.startswith("/* htmx 2.0.11")


def test_the_overview_reads_a_channel_time_at_the_edge_of_bigint(
    serve: Callable[..., Served], queue: Queue, dsn: str
) -> None:
    """The lag is computed without overflow, whatever time a channel row holds (the public
    calls keep times within +/-10^15 ms; the schema's internal functions do not check)."""
    queue.create(b"first of all", channel="urgent")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("UPDATE {}.channel SET next_dequeue_at = %s WHERE name = 'urgent'").format(
                sql.Identifier(queue.schema)
            ),
            [-(2**63)],
        )
    served = serve()
    status, _, body = _get(served, "/live/overview")
    assert status == 200, body
    assert 'id="due">1<' in body.replace(" ", "")


def test_bad_requests_are_refused_with_a_message(
    serve: Callable[..., Served], queue: Queue
) -> None:
    served = serve()
    status, _, body = _get(served, "/channels?sort=size")
    assert status == 400
    assert "unknown sort" in body
    status, _, body = _get(served, "/channel?name=a&after_at=x")
    assert status == 400
    assert "not a whole number" in body
    status, _, body = _get(served, "/channel?name=")
    assert status == 400
    assert "channel name must be 1 to 255 characters" in body
    status, _, body = _get(served, "/channel?name=a&view=all")
    assert status == 400
    status, _, body = _get(served, "/channels?sort=due&after=a&after_due=soon")
    assert status == 400
    assert "not a whole number: &#39;soon&#39;" in body


def test_hostile_names_and_contents_are_escaped(serve: Callable[..., Served], queue: Queue) -> None:
    long_name = "L" * 255
    odd = "right\u202eleft\u200bzero"
    queue.create_many(
        [
            NewMessage(HOSTILE.encode(), channel=HOSTILE),
            NewMessage(b"\x00\xff\xfe binary", channel=odd),
            NewMessage(b"x" * 10_000, channel=long_name),
        ]
    )
    served = serve()
    _, _, listing = _get(served, "/channels")
    assert HOSTILE not in listing
    assert "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;" in listing
    assert "\u202e" not in listing
    assert "right\\u202eleft\\u200bzero" in listing
    assert long_name in listing
    _, _, page = _get(served, f"/channel?name={quote(HOSTILE, safe='')}")
    assert HOSTILE not in page
    escaped = "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;"
    assert f'<span class="name" id="channel-name">{escaped}</span>' in page
    assert f'<td class="payload">{escaped}</td>' in page
    _, _, page = _get(served, f"/channel?name={quote(odd, safe='')}")
    assert "(10 bytes) 00 ff fe 20 62 69 6e 61 72 79" in page
    _, _, page = _get(served, f"/channel?name={quote(long_name, safe='')}")
    assert "x" * 200 + "…" in page
    assert "x" * 201 not in page


def test_the_token_is_required_when_set(serve: Callable[..., Served], queue: Queue) -> None:
    served = serve(token="s3cret")
    status, _, body = _get(served, "/channels")
    assert status == 401
    assert "token" in body
    assert _get(served, "/channels", {"Authorization": "Bearer wrong"})[0] == 401
    assert _get(served, "/channels", {"Authorization": "Bearer s3cret"})[0] == 200
    status, headers, _ = _get(served, "/channels?sort=name&token=s3cret")
    assert status == 303
    assert headers["location"].endswith("/channels?sort=name")
    cookie = headers["set-cookie"]
    assert "httponly" in cookie.lower()
    assert "samesite=strict" in cookie.lower()
    assert _get(served, "/channels", {"Cookie": cookie.split(";")[0]})[0] == 200
    assert _get(served, "/channels", {"Cookie": "lonnymq_dashboard_token=nope"})[0] == 401


def test_mounted_in_another_application_links_stay_under_its_path(
    serve: Callable[..., Served], queue: Queue
) -> None:
    queue.create(b"m", channel="mounted")

    def wrap(dashboard: Any) -> Starlette:
        async def home(request: Any) -> PlainTextResponse:
            return PlainTextResponse("the user's own page")

        return Starlette(routes=[Route("/", home), Mount("/ops/queue", app=dashboard)])

    served = serve(wrap=wrap)
    assert _get(served, "/")[2] == "the user's own page"
    status, _, body = _get(served, "/ops/queue/channels")
    assert status == 200
    assert 'href="/ops/queue/channel?name=mounted"' in body
    assert 'src="/ops/queue/static/htmx.min.js"' in body
    assert _get(served, "/ops/queue/static/style.css")[0] == 200


def test_the_embedding_example_serves_the_dashboard_under_its_mount(
    dsn: str, queue: Queue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """examples/dashboard_embed.py (included in the docs), served as uvicorn serves it: its
    lifespan opens the queue, and the dashboard answers under its mount, with the token."""
    path = Path(__file__).resolve().parents[2] / "examples" / "dashboard_embed.py"
    code = path.read_text("utf-8").replace('schema="shop"', f'schema="{queue.schema}"')
    queue.create(b"m", channel="embedded")
    monkeypatch.setenv("LONNYMQ_DSN", dsn)
    monkeypatch.setenv("LONNYMQ_TOKEN", "s3cret")
    namespace: dict[str, Any] = {"__name__": "dashboard_embed"}
    exec(compile(code, str(path), "exec"), namespace)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(namespace["app"], log_level="warning", lifespan="on"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[listener])))
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:  # its lifespan has opened the queue
            assert thread.is_alive(), "it stopped before it started"
            assert time.monotonic() < deadline, "it never started"
            time.sleep(0.05)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            conn.request("GET", "/ops/queue/channels", headers={"Authorization": "Bearer s3cret"})
            response = conn.getresponse()
            body = response.read().decode()
        finally:
            conn.close()
        assert response.status == 200, body
        assert 'href="/ops/queue/channel?name=embedded"' in body
    finally:
        server.should_exit = True
        thread.join(30)
        listener.close()
    assert not thread.is_alive()


def test_app_refuses_what_is_not_an_async_queue(queue: Queue) -> None:
    with pytest.raises(InvalidArgumentError, match="AsyncQueue"):
        app(queue)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="token"):
        app(AsyncQueue(queue.dsn, schema=queue.schema), token="")


def test_the_command_serves_the_dashboard_on_localhost(dsn: str, queue: Queue) -> None:
    queue.create(b"c", channel="from-the-command")
    env = {**os.environ, "LONNYMQ_DSN": dsn, "LONNYMQ_SCHEMA": queue.schema}
    command = [sys.executable, "-m", "lonnymq.cli", "dashboard", "--port", "0", "--read-only"]
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True) as process:
        try:
            assert process.stdout is not None
            line = process.stdout.readline()
            assert line.startswith("lonnymq dashboard on http://127.0.0.1:"), line
            address = urlsplit(line.split()[-1])
            conn = http.client.HTTPConnection("127.0.0.1", address.port, timeout=30)
            conn.request("GET", "/channels")
            response = conn.getresponse()
            body = response.read().decode()
            conn.close()
            assert response.status == 200
            assert "from-the-command" in body
            assert 'id="read-only"' in body
        finally:
            process.send_signal(signal.SIGTERM)
            # Stopped as any command is by SIGTERM (exit 130), after uvicorn's own shutdown.
            assert process.wait(timeout=60) == 130


def test_the_command_refuses_a_bad_port(
    dsn: str, queue: Queue, capsys: pytest.CaptureFixture[str]
) -> None:
    arguments = ["--dsn", dsn, "--schema", queue.schema, "dashboard", "--port", "70000"]
    assert cli.main(arguments) == 1
    assert "--port must be between 0 and 65535" in capsys.readouterr().err
