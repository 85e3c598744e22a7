"""The dashboard served by uvicorn on a free localhost port (in a thread of the test process,
with its own event loop and AsyncQueue), and one headless Chromium for the test session."""

from __future__ import annotations

import http.client
import logging
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette", reason="the dashboard extra is not installed")
from lonnymq import Queue
from lonnymq.dashboard._serve import Background

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
# The network is closed here: without these, Chromium waits on connections it tries itself.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1280,900",
)
# The docs' screenshots: rewritten only when asked (LONNYMQ_DOCS_SCREENSHOTS=1), so that a test
# run leaves the checkout as it found it; otherwise each is still taken and checked.
IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"


class Served(Background):
    """``app(queue, **options)`` served on 127.0.0.1 until ``close()``."""

    def __init__(self, dsn: str, schema: str, wrap: Callable[[Any], Any] | None, **options: Any):
        super().__init__(dsn, [schema], wrap=wrap, **options)


def get(served: Served, path: str) -> tuple[int, str]:
    """GET ``path`` of the served dashboard: its status and body."""
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def assert_bad_requests(served: Served, path: str, cases: tuple[tuple[str, str], ...]) -> None:
    """Each ``(query, expected)`` of ``cases``: GET ``path + query`` is refused with 400, and
    the body says ``expected``."""
    for query, expected in cases:
        status, body = get(served, path + query)
        assert status == 400, query
        assert expected in body, query


@pytest.fixture
def dashboard_log(caplog: pytest.LogCaptureFixture) -> Callable[[], list[str]]:
    """``dashboard_log()``: the messages the dashboard has logged (INFO and above) so far."""
    caplog.set_level(logging.INFO, logger="lonnymq.dashboard")
    return lambda: [r.getMessage() for r in caplog.records if r.name == "lonnymq.dashboard"]


@pytest.fixture
def archiving_queue(queue: Queue, make_queue: Callable[..., Queue]) -> Queue:
    """The test's queue (the one ``serve`` serves), installed again with the archive on."""
    return make_queue(archive=True)


@pytest.fixture
def serve(dsn: str, queue: Queue) -> Iterator[Callable[..., Served]]:
    """``serve(**options)``: the dashboard of the test's queue, stopped after the test;
    ``wrap`` builds the application served around the dashboard's (to mount it); ``as_dsn``
    connects it as another role."""
    started: list[Served] = []

    def start(
        *, wrap: Callable[[Any], Any] | None = None, as_dsn: str | None = None, **options: Any
    ) -> Served:
        served = Served(as_dsn or dsn, queue.schema, wrap, **options)
        started.append(served)
        return served

    yield start
    for served in started:
        served.close()


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    """One headless Chromium (Debian's, driven by its ChromeDriver) for the session."""
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.fail("Chromium is not installed: run scripts/browser.sh (scripts/test.sh does)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="lonnymq-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
